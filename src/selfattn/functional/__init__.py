"""Pure functions: attention and the tables that positional encodings are built from.

The names load on first use: importing one of this package's modules (the routes import its kernels) runs no
more than that module, so the package and :mod:`selfattn.core` import each other's parts in any order.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from selfattn.functional._attention import attention, attention_weights, causal_mask, explain, valid_lens_mask
    from selfattn.functional._blockwise import blockwise_attention, choose_block_size, dropout_keep_probability
    from selfattn.functional._flex import flex_score_attention
    from selfattn.functional._relative import alibi_slopes, relative_distances, relative_shift, t5_relative_bucket
    from selfattn.functional._rotary import (
        apply_axial_rotary,
        apply_rotary,
        rotary_angles,
        rotary_frequencies,
        rotary_parameters,
    )
    from selfattn.functional._sinusoidal import sinusoidal_frequencies, sinusoidal_table
    from selfattn.functional._sparse import sparse_attention

__all__ = [
    "alibi_slopes",
    "apply_axial_rotary",
    "apply_rotary",
    "attention",
    "attention_weights",
    "blockwise_attention",
    "causal_mask",
    "choose_block_size",
    "dropout_keep_probability",
    "explain",
    "flex_score_attention",
    "relative_distances",
    "relative_shift",
    "rotary_angles",
    "rotary_frequencies",
    "rotary_parameters",
    "sinusoidal_frequencies",
    "sinusoidal_table",
    "sparse_attention",
    "t5_relative_bucket",
    "valid_lens_mask",
]

_HOMES = {
    "attention": "selfattn.functional._attention",
    "attention_weights": "selfattn.functional._attention",
    "causal_mask": "selfattn.functional._attention",
    "explain": "selfattn.functional._attention",
    "valid_lens_mask": "selfattn.functional._attention",
    "blockwise_attention": "selfattn.functional._blockwise",
    "choose_block_size": "selfattn.functional._blockwise",
    "dropout_keep_probability": "selfattn.functional._blockwise",
    "flex_score_attention": "selfattn.functional._flex",
    "alibi_slopes": "selfattn.functional._relative",
    "relative_distances": "selfattn.functional._relative",
    "relative_shift": "selfattn.functional._relative",
    "t5_relative_bucket": "selfattn.functional._relative",
    "apply_axial_rotary": "selfattn.functional._rotary",
    "apply_rotary": "selfattn.functional._rotary",
    "rotary_angles": "selfattn.functional._rotary",
    "rotary_frequencies": "selfattn.functional._rotary",
    "rotary_parameters": "selfattn.functional._rotary",
    "sinusoidal_frequencies": "selfattn.functional._sinusoidal",
    "sinusoidal_table": "selfattn.functional._sinusoidal",
    "sparse_attention": "selfattn.functional._sparse",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'selfattn.functional' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
