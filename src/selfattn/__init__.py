"""selfattn: self-attention and positional encodings for PyTorch.

The pure functions live in :mod:`selfattn.functional`, the encodings in
:mod:`selfattn.positional`; the most used names are re-exported here.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from selfattn.attention import MultiHeadAttention
    from selfattn.cache import KVCache
    from selfattn.functional import attention, sinusoidal_table
    from selfattn.positional import (
        ALiBiPositionalBias,
        LearnedPositionalEncoding,
        NoPositionalEncoding,
        RotaryPositionalEncoding,
        ShawRelativePositionEncoding,
        SinusoidalPositionalEncoding,
        SinusoidalPositionalEncoding2D,
        SinusoidalPositionalEncoding3D,
        T5RelativePositionBias,
    )

__version__ = "0.1.0"

__all__ = [
    "ALiBiPositionalBias",
    "KVCache",
    "LearnedPositionalEncoding",
    "MultiHeadAttention",
    "NoPositionalEncoding",
    "RotaryPositionalEncoding",
    "ShawRelativePositionEncoding",
    "SinusoidalPositionalEncoding",
    "SinusoidalPositionalEncoding2D",
    "SinusoidalPositionalEncoding3D",
    "T5RelativePositionBias",
    "attention",
    "sinusoidal_table",
]

# The names above are imported on first use, not here: `import selfattn` stays free of torch until
# a name is needed, so `selfattn --version` and `selfattn --help` answer without loading torch.
_HOMES = {
    "MultiHeadAttention": "selfattn.attention",
    "KVCache": "selfattn.cache",
    "attention": "selfattn.functional",
    "sinusoidal_table": "selfattn.functional",
}
_SUBPACKAGES = (
    "attention",
    "cache",
    "functional",
    "integrations",
    "latent",
    "masks",
    "models",
    "nn",
    "parts",
    "positional",
    "sparse",
)


def __getattr__(name: str) -> Any:
    if name in _SUBPACKAGES and name != "attention":
        return importlib.import_module(f"selfattn.{name}")
    if name not in __all__:
        raise AttributeError(f"module 'selfattn' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES.get(name, "selfattn.positional")), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    """The public names, the subpackages and the module's dunders (not the helpers imported here: sys, types ...)."""
    return sorted({*__all__, *_SUBPACKAGES, *(name for name in globals() if name.startswith("__"))})


class _Package(types.ModuleType):
    """``selfattn.attention`` is the function, as it always was, even once the module of that name is loaded."""

    def __setattr__(self, name: str, value: Any) -> None:
        # Importing the submodule selfattn.attention binds it here; keep the name for the function
        # (the submodule stays reachable in sys.modules and through `from selfattn.attention import`).
        if name == "attention" and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
