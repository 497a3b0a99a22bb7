"""Pure functions: attention and the tables that positional encodings are built from."""

from selfattn.functional._attention import attention, attention_weights, causal_mask, valid_lens_mask
from selfattn.functional._sinusoidal import sinusoidal_frequencies, sinusoidal_table

__all__ = [
    "attention",
    "attention_weights",
    "causal_mask",
    "sinusoidal_frequencies",
    "sinusoidal_table",
    "valid_lens_mask",
]
