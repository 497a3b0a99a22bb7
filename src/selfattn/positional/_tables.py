"""Derived tables that follow the module's device but keep their own precision."""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
from torch import nn

__all__ = ["KeepsTablePrecision"]


class KeepsTablePrecision(nn.Module):
    """Mixin: the buffers named in ``exact_tables`` move with ``.to(device)`` but ignore dtype casts.

    ``model.to(torch.bfloat16)`` would otherwise round inverse frequencies or slopes to 8
    significant bits, and every angle computed from them afterwards would be wrong. The
    tables are small; the encodings cast what they compute from them to the input's dtype.
    """

    exact_tables: ClassVar[tuple[str, ...]] = ()

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
        before = {name: table for name in self.exact_tables if (table := self._buffers.get(name)) is not None}
        super()._apply(fn, recurse)  # type: ignore[no-untyped-call]  # torch leaves Module._apply untyped
        for name, table in before.items():
            applied = self._buffers[name]
            if applied is not None and applied.dtype != table.dtype:
                self._buffers[name] = table.to(applied.device)
        return self
