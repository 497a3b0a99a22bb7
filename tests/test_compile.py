"""torch.compile(fullgraph=True) traces MultiHeadAttention without graph breaks (checked with dynamo.explain)."""

import pytest
import torch
import torch._dynamo as dynamo

from selfattn import KVCache, MultiHeadAttention
from selfattn.positional import build

D, H = 16, 4


def _breaks(module, *args, **kwargs):
    dynamo.reset()
    explanation = dynamo.explain(module)(*args, **kwargs)
    dynamo.reset()
    return explanation.graph_break_count, [str(r.reason)[:200] for r in explanation.break_reasons]


@pytest.mark.parametrize("name", ["none", "rotary", "alibi", "t5", "shaw"])
def test_causal_with_every_encoding_and_valid_lens(name):
    position = None if name == "none" else build(name, num_hiddens=D, num_heads=H)
    mha = MultiHeadAttention(D, H, position=position).eval()
    x = torch.randn(2, 8, D)
    assert _breaks(mha, x, x, x, torch.tensor([8, 3]), causal=True) == (0, [])


def test_positions_documents_window_gqa():
    mha = MultiHeadAttention(D, H, num_kv_heads=2, window=3, position=build("alibi", num_hiddens=D, num_heads=H))
    x = torch.randn(2, 60, D)  # long enough for the blocked window path
    documents = torch.tensor([[0] * 20 + [1] * 40, [0] * 60])
    assert mha.explain(x, x, x, causal=True, document_ids=documents).route == "banded"
    assert _breaks(mha, x, x, x, causal=True, document_ids=documents) == (0, [])
    assert _breaks(mha, x, x, x, positions=torch.arange(60).expand(2, 60)) == (0, [])


def test_one_cache_decoding_step():
    mha = MultiHeadAttention(D, H, num_kv_heads=1, position=build("rotary", num_hiddens=D, num_heads=H)).eval()
    cache = KVCache(max_len=16)
    x = torch.randn(2, 5, D)
    with torch.no_grad():
        mha(x, x, x, causal=True, cache=cache)
        assert _breaks(mha, x[:, :1], x[:, :1], x[:, :1], causal=True, cache=cache) == (0, [])


def test_a_scale_and_softcap_that_change_between_calls():
    """Floats that change between calls of a compiled function become symbols on the second call (dynamo's automatic
    dynamic); the checks of the scale and the softcap trace on them (math.isfinite did not: a graph break)."""
    from selfattn.functional import attention

    q, k, v = (torch.randn(2, H, 5, 8) for _ in range(3))

    def forward(q, k, v, scale, softcap):
        return attention(q, k, v, scale=scale, softcap=softcap, causal=True)

    dynamo.reset()
    compiled = torch.compile(forward, fullgraph=True, backend="eager")
    for scale, softcap in ((0.3, 20.0), (0.4, 30.0), (0.5, 40.0)):
        torch.testing.assert_close(compiled(q, k, v, scale, softcap), forward(q, k, v, scale, softcap))
    dynamo.reset()


@pytest.mark.parametrize("label", [None, "alibi"])
def test_blockwise_attention_in_one_graph_forward_and_backward(label):
    """The public blockwise function with a key-less row (``valid_lens`` 0): no host read of a value in the graph
    (the lengths' checks, the rows that see no key), the same output and gradients as eager."""
    from selfattn.functional import blockwise_attention

    term = None if label is None else build(label, num_hiddens=H * 8, num_heads=H)
    q, k, v = (torch.randn(2, H, 6, 8, requires_grad=True) for _ in range(3))
    positions = torch.arange(6)
    options = {} if term is None else {"term": term, "q_positions": positions, "k_positions": positions}

    def forward(q, k, v, lengths):
        return blockwise_attention(q, k, v, valid_lens=lengths, causal=True, block_size=4, **options)

    lengths = torch.tensor([0, 3])
    expected = forward(q, k, v, lengths)
    dynamo.reset()
    got = torch.compile(forward, fullgraph=True, backend="eager")(q, k, v, lengths)
    dynamo.reset()
    torch.testing.assert_close(got, expected)
    assert not bool(got[0].any())  # the batch row that sees no key
    gradients = torch.autograd.grad(got.sum(), (q, k, v)), torch.autograd.grad(expected.sum(), (q, k, v))
    for ours, theirs in zip(*gradients, strict=True):
        torch.testing.assert_close(ours, theirs)
