"""Ctrl-C that always ends the command, even when it lands in a finalizer.

Python raises ``KeyboardInterrupt`` wherever the signal finds the program. Inside a weakref
callback or a ``__del__`` (matplotlib runs many while it draws figures) the exception cannot
propagate: Python prints it as "Exception ignored in ..." with a traceback, drops it, and the
command runs on to the end and exits 0. :func:`interrupts_end_the_command` catches such a
dropped interrupt, keeps its report off the terminal, and raises ``KeyboardInterrupt`` again a
moment later in ordinary code (a ``SIGALRM`` timer), so the command ends as for any Ctrl-C.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

__all__ = ["Interrupts", "interrupts_end_the_command"]

_RETRY_SECONDS = 0.05  # when a dropped interrupt is raised again


@dataclass
class Interrupts:
    """What :func:`interrupts_end_the_command` saw: ``dropped`` is true once a Ctrl-C was dropped."""

    dropped: bool = False


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def interrupts_end_the_command() -> Iterator[Interrupts]:
    """Within the block, a ``KeyboardInterrupt`` that Python drops is raised again.

    Only an interrupt that was dropped arms the timer, so an interrupt on its way out (through
    ``finally`` blocks that remove temporary files) is never interrupted a second time. Where
    there is no ``SIGALRM`` timer (Windows) or outside the main thread, a dropped interrupt is
    only recorded in ``dropped``: the command runs on, and the caller reports it at the end.
    """
    seen = Interrupts()
    can_retry = hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
    previous_hook = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        if not isinstance(unraisable.exc_value, KeyboardInterrupt):
            previous_hook(unraisable)
            return
        seen.dropped = True
        if can_retry:
            signal.setitimer(signal.ITIMER_REAL, _RETRY_SECONDS)

    previous_alarm = signal.signal(signal.SIGALRM, _raise_interrupt) if can_retry else signal.SIG_DFL
    sys.unraisablehook = hook
    try:
        yield seen
    finally:
        # A timer that went off just before it is stopped raises here: each step is restored even
        # then, so the process never keeps this hook or handler (they would act in later code).
        try:
            if can_retry:
                signal.setitimer(signal.ITIMER_REAL, 0)
        finally:
            try:
                if can_retry:
                    signal.signal(signal.SIGALRM, signal.SIG_DFL if previous_alarm is None else previous_alarm)
            finally:
                sys.unraisablehook = previous_hook
