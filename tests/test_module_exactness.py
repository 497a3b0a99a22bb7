"""Module-level exactness found by a differential audit (issue 30): each test failed before its fix.

Properties of :class:`~selfattn.MultiHeadAttention` as a whole: cached decoding against a full
pass over the sequence so far, in float64.
"""

import pytest
import torch

import selfattn.masks as masks
from selfattn import KVCache, MultiHeadAttention
from selfattn.positional import RotaryPositionalEncoding

DYNAMIC = {"rope_type": "dynamic", "factor": 4.0, "original_max_position_embeddings": 2}
LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0, 1.5],
    "long_factor": [3.0, 5.0],
    "factor": 4.0,
    "original_max_position_embeddings": 3,
}


@pytest.mark.parametrize("scaling", [DYNAMIC, LONGROPE], ids=["dynamic", "longrope"])
@pytest.mark.parametrize("sink_tokens", [0, 1])
def test_windowed_cache_rerotates_length_dependent_rotary(scaling, sink_tokens):
    """A windowed cache's keys are re-rotated as the frequencies change, as a full cache's are.

    Before the fix the stored keys of a windowed cache kept the frequencies of the step that
    added them (attention.py skipped re-rotation for ``cache.window``), so a step differed from
    the full pass over the sequence so far once the length passed ``original_max_position_embeddings``.
    """
    torch.manual_seed(0)
    window = 3
    position = RotaryPositionalEncoding(4, scaling=scaling)
    layer_window = None if sink_tokens else window  # StreamingLLM: the layer has no window, the cache has
    mha = MultiHeadAttention(8, 2, window=layer_window, position=position, dtype=torch.float64).eval()
    rule = masks.causal() & (masks.prefix(sink_tokens) | masks.window(window)) if sink_tokens else None
    x = torch.randn(2, 7, 8, dtype=torch.float64)
    cache = KVCache(window=window, sink_tokens=sink_tokens)
    with torch.no_grad():
        for t in range(x.shape[1]):
            token, so_far = x[:, t : t + 1], x[:, : t + 1]
            step = mha(token, token, token, causal=True, cache=cache)
            full = mha(so_far, so_far, so_far, causal=True, mask=rule)[:, -1:]
            torch.testing.assert_close(step, full, rtol=0, atol=1e-12, msg=lambda m, t=t: f"step {t}: {m}")


@pytest.mark.parametrize("value", [float("inf"), float("nan")], ids=["+inf", "nan"])
def test_float_attn_mask_with_inf_or_nan_is_refused(value):
    """A float ``attn_mask`` adds finite values and masks with -inf; +inf or NaN is refused, not a NaN row.

    Before the fix ``mha(x, x, x, attn_mask=m)`` with one +inf in ``m`` returned NaN in that query's row.
    """
    mha = MultiHeadAttention(8, 2, dtype=torch.float64)
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    attn_mask = torch.zeros(5, 5, dtype=torch.float64)
    attn_mask[0, 1] = value
    with pytest.raises(ValueError, match=r"attn_mask must hold finite values or -inf .* 1 NaN or \+inf"):
        mha(x, x, x, attn_mask=attn_mask)
    attn_mask[0, 1] = float("-inf")  # -inf masks, as documented
    assert torch.isfinite(mha(x, x, x, attn_mask=attn_mask)).all()


@pytest.mark.parametrize("argument", ["valid_lens", "attn_mask"])
def test_sink_token_cache_refuses_arguments_that_read_key_indices(argument):
    """A ``KVCache(window, sink_tokens)`` keeps keys that are not consecutive; lengths and dense masks are refused.

    Before the fix both were read as if the kept keys were the last ones before the new token:
    decoding with ``valid_lens=[3]`` differed from the full pass with the same lengths by 0.85.
    """
    mha = MultiHeadAttention(8, 2, dtype=torch.float64)
    x = torch.randn(1, 4, 8, dtype=torch.float64)
    cache = KVCache(window=2, sink_tokens=1)
    for t in range(3):
        mha(x[:, t : t + 1], x[:, t : t + 1], x[:, t : t + 1], causal=True, cache=cache)
    given = {"valid_lens": torch.tensor([2]), "attn_mask": torch.ones(1, 4, dtype=torch.bool)}[argument]
    with pytest.raises(ValueError, match=f"sink_tokens=1 drops the keys .* so {argument} "):
        mha(x[:, 3:], x[:, 3:], x[:, 3:], causal=True, cache=cache, **{argument: given})
    assert cache.length == 3  # the refused call left the cache as it was


def test_spans_put_queries_before_the_first_key_in_no_span():
    """Cross-attention with more queries than keys puts the first queries before key 0 (index -1, -2, ..).

    Before the fix ``Spans`` clamped index -1 to token 0, so query -1 joined token 0's span and saw
    key 0 (weights ``[1, 0]`` where ``[0, 0]`` is due: causally it sees no key either).
    """
    torch.manual_seed(0)
    layer = MultiHeadAttention(4, 1).double()
    queries, keys = torch.randn(1, 3, 4, dtype=torch.float64), torch.randn(1, 2, 4, dtype=torch.float64)
    rule = masks.causal() | masks.spans(torch.tensor([[1, 0]]))
    out, weights = layer(queries, keys, keys, mask=rule, return_weights=True)
    scores = (layer.W_q(queries) @ layer.W_k(keys).transpose(1, 2))[0] / 2  # (3, 2), head size 4
    visible = torch.tensor([[False, False], [True, False], [True, True]])  # query i at index i - 1 sees keys <= it
    expected = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1).nan_to_num(0.0)
    torch.testing.assert_close(weights[0, 0], expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out[0, 0], layer.W_o.bias if layer.W_o.bias is not None else torch.zeros(4).double())


def test_a_non_bool_bias_flag_is_refused():
    with pytest.raises(ValueError, match="bias must be True or False, got 'yes'"):
        MultiHeadAttention(8, 2, bias="yes")
