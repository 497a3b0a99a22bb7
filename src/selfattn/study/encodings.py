"""The study's encodings with settings scaled to the training length, beside the papers' settings.

Several encodings come with constants chosen for a training length far longer than the study's:

* **xPos** decays a query/key pair by ``zeta ** (distance / scale_base)``; the paper's
  ``scale_base`` 512 goes with training at 1,024 tokens. At the study's lengths (tens of tokens)
  the decay barely acts (at most x0.855 over 64 bytes) and xPos is rotary. ``xpos-scaled`` keeps
  the paper's ratio: ``scale_base`` = half the training sequence.
* **p-RoPE** leaves the slowest pairs unrotated so that no pair needs more than the training
  length for a turn; p = 0.75 of the paper (Gemma, trained at thousands of tokens) still rotates
  pairs whose wavelength exceeds the study's L. ``p-rope-scaled`` rotates only the pairs whose
  wavelength fits in the training sequence (:func:`p_rope_for_length`: 0.25 of 8 pairs for the
  synthetic tasks' 42 tokens, 0.375 for the text's 64 bytes).
* **ALiBi**'s slopes are a geometric sequence set by the number of heads; with 4 heads they are
  1/4 .. 1/256 (every head strongly local), with the paper's 8 heads 1/2 .. 1/256.
  ``alibi-8-heads`` trains the same model width with 8 heads of size 8.

Each scaled name trains beside the paper's setting (``xpos``, ``p-rope``, ``alibi``).
"""

from __future__ import annotations

import math
from typing import Any

from selfattn._validation import require_positive_int

__all__ = ["P_ROPE", "SCALED_ENCODINGS", "encoding_setting", "p_rope_for_length", "xpos_scale_base"]

#: p-RoPE's fraction of rotating pairs in the paper's setting (Barbero et al. 2024, ``p-rope``).
P_ROPE = 0.75

#: Scaled settings: name -> the encoding they scale.
SCALED_ENCODINGS = {"xpos-scaled": "xpos", "p-rope-scaled": "p-rope", "alibi-8-heads": "alibi"}


def p_rope_for_length(head_dim: int, length: int, base: float = 10000.0) -> float:
    """The p of p-RoPE that rotates exactly the pairs whose wavelength ``2 pi base^(2i/dh)`` fits in ``length``.

    p-RoPE rotates the fastest ``floor(p * dh / 2)`` pairs; this returns ``k / (dh / 2)`` for the
    ``k`` pairs with wavelength ``<= length`` (at least one pair).
    """
    head_dim = require_positive_int("head_dim", head_dim)
    length = require_positive_int("length", length)
    pairs = head_dim // 2
    fitting = sum(1 for i in range(pairs) if 2 * math.pi * base ** (2 * i / head_dim) <= length)
    return max(fitting, 1) / pairs


def xpos_scale_base(length: int) -> float:
    """xPos's ``scale_base`` at the paper's ratio to the training length (512 for 1,024): ``length / 2``."""
    return require_positive_int("length", length) / 2


def encoding_setting(encoding: str, train_sequence_len: int, head_dim: int) -> tuple[str, dict[str, Any], int | None]:
    """``(position name, position options, heads)`` of a study encoding at this training length.

    Args:
        encoding: a study encoding name (the paper's settings, or one of :data:`SCALED_ENCODINGS`).
        train_sequence_len: the longest training sequence, in tokens.
        head_dim: the model's head size (with its own number of heads).

    Returns:
        The name for :func:`selfattn.positional.build`, its options, and the number of heads
        the model trains with (8 for ``alibi-8-heads``; None: the config's).
    """
    if encoding == "p-rope":
        return "rotary", {"p": P_ROPE}, None
    if encoding == "p-rope-scaled":
        return "rotary", {"p": p_rope_for_length(head_dim, train_sequence_len)}, None
    if encoding == "xpos-scaled":
        return "xpos", {"scale_base": xpos_scale_base(train_sequence_len)}, None
    if encoding == "alibi-8-heads":
        return "alibi", {}, 8
    if encoding == "t5":
        return "t5", {"bidirectional": False}, None
    return encoding, {}, None
