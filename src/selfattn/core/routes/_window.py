"""What the sliding-window routes share: their block size, and when a window call is theirs.

Shape legend: b batch, h heads, l queries and keys, dh head size.
"""

from __future__ import annotations

from selfattn.core.call import AttentionCall

__all__ = ["PER_ROW_BAND_ELEMENTS", "window_block", "window_declines"]

# A pure sliding window runs one sequence at a time once a row's key and value bands would hold this
# many elements as a batched copy. Measured on one core (attention alone, batched / per row):
# b=64 l=256 w=8 d=64 0.25x (27K elements), b=16 l=512 w=16 0.9x (71K), b=8 l=1024 w=64 d=256 1.26x
# (910K), b=4 l=4096 w=128 d=512 1.9x, b=2 l=16384 w=512 2.1x.
PER_ROW_BAND_ELEMENTS = 1 << 19


def window_block(window: int) -> int:
    """Queries per block of the window routes.

    Smaller blocks waste less of each key band, larger ones run the kernel better. Measured on
    one CPU core, attention alone vs full causal: n=16384 w=512, blocks of 64 12.8x, 128 9.1x,
    512 3.9x; n=1024 w=64, 16 2.1x, 64 2.6x, 128 1.2x; n=4096 w=128, 32 11x, 64 11x. The
    band-only route (one shared mask), n=16384 w=512: 32 790 ms, 64 820, 128 900, 256 975.
    """
    return max(16, min(64, 8 * window))


def window_declines(call: AttentionCall) -> str | None:
    """Why neither window route can take the call, or None; worked out once per call."""
    return call.remember("window_declines", _window_declines)


def _window_declines(call: AttentionCall) -> str | None:
    window = call.visibility.window
    if window is None:
        return "no window"
    if not isinstance(call.num_queries, int):
        return "the length is symbolic (dynamic shapes): the bands are chosen by the length"
    if call.return_weights or call.value_term:
        return "the weights are needed"
    if call.bias is not None:
        return "a float bias (attn_mask) is given"
    if not (call.visibility.square and call.visibility.k_first == 0):
        return "queries and keys are not one whole sequence (a cache, cross-attention)"
    if call.num_queries <= 2 * (window_block(window) + 2 * (window - 1)):
        return "too short for bands to pay"
    return None
