"""Pure functions: attention and the tables that positional encodings are built from."""

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
