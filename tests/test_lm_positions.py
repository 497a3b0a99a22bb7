"""TransformerLM hands positions down to attention: each query/key encoding's own key transform and cache hook.

The reference below writes the pre-LN blocks out from the formulas in float64: the model's own
weights, the encoding's query transform (``forward``) and key transform (``encode_keys``) at the
given positions, a causal softmax. Nothing of MultiHeadAttention is used.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from selfattn import KVCache
from selfattn.models import TransformerBlock, TransformerLM
from selfattn.positional import QueryKeyEncoding, RotaryPositionalEncoding, XPosEncoding

# Head size 8: four rotated pairs. Trained length 4, so decoding 9 tokens crosses it.
SCALINGS: dict[str, dict[str, Any]] = {
    "dynamic": {"rope_type": "dynamic", "factor": 4.0, "original_max_position_embeddings": 4},
    "longrope": {
        "rope_type": "longrope",
        "short_factor": [1.0, 1.1, 1.3, 1.6],
        "long_factor": [1.0, 2.0, 4.0, 8.0],
        "factor": 4.0,
        "original_max_position_embeddings": 4,
    },
}


def _reference_logits(model: TransformerLM, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Logits ``(b, l, v)`` of a pre-LN ``model`` with a query/key encoding, written out step by step."""
    encoding = model.encoding
    assert isinstance(encoding, QueryKeyEncoding)
    d, length = model.num_hiddens, tokens.shape[1]
    future = torch.ones(length, length, dtype=torch.bool).triu(1)  # key j > query i: hidden
    x = model.embedding.weight[tokens] * math.sqrt(d)  # (b, l, d)
    for block in model.blocks:
        attention = block.attention
        heads, head_dim = attention.num_heads, d // attention.num_heads

        def split(t: torch.Tensor, heads: int = heads, head_dim: int = head_dim) -> torch.Tensor:
            return t.unflatten(-1, (heads, head_dim)).transpose(1, 2)  # (b, h, l, dh)

        a = block.norm_1(x)
        q = encoding(split(a @ attention.W_q.weight.T), positions)
        k = encoding.encode_keys(split(a @ attention.W_k.weight.T), positions)
        v = split(a @ attention.W_v.weight.T)
        scores = (q @ k.transpose(-1, -2) / math.sqrt(head_dim)).masked_fill(future, -math.inf)
        out = (scores.softmax(dim=-1) @ v).transpose(1, 2).flatten(2)  # (b, l, d)
        x = x + out @ attention.W_o.weight.T
        assert block.mlp is not None and block.norm_2 is not None
        x = x + block.mlp(block.norm_2(x))
    logits: torch.Tensor = model.norm(x) @ model.embedding.weight.T
    return logits


def _model(position: str, num_layers: int = 1, **options: Any) -> TransformerLM:
    torch.manual_seed(0)
    model = TransformerLM(11, 16, 2, num_layers, position=position, max_len=64, position_options=options)
    return model.double().eval()


@pytest.mark.parametrize("num_layers", [1, 2])
@pytest.mark.parametrize("position", ["xpos", "rotary"])
def test_lm_keys_get_the_encodings_key_transform(position: str, num_layers: int) -> None:
    model = _model(position, num_layers)
    tokens = torch.randint(0, 11, (2, 7))
    with torch.no_grad():
        got, expected = model(tokens), _reference_logits(model, tokens, torch.arange(7))
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("position", ["xpos", "rotary"])
def test_lm_randomized_positions_equal_the_reference(position: str) -> None:
    model = _model(position, 2)
    tokens = torch.randint(0, 11, (2, 6))
    positions = torch.tensor([0, 3, 9, 10, 30, 41])  # token i at positions[i] (Ruoss et al. 2023)
    with torch.no_grad():
        got, expected = model(tokens, positions=positions), _reference_logits(model, tokens, positions)
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-9)
    # The positions matter: the consecutive ones give other logits.
    assert (got - _reference_logits(model, tokens, torch.arange(6)).detach()).abs().max() > 1e-3


@pytest.mark.parametrize("scaling", sorted(SCALINGS))
def test_lm_cached_decoding_past_the_trained_length_equals_full_recompute(scaling: str) -> None:
    # One layer: deeper layers' cached keys come from hidden states computed at earlier lengths'
    # frequencies, so with more layers no cache equals a full recompute (a property of the method).
    model = _model("rotary", 1, scaling=SCALINGS[scaling])
    assert isinstance(model.encoding, RotaryPositionalEncoding) and model.encoding.cached_keys == "rerotate"
    tokens = torch.randint(0, 11, (2, 10))
    caches = model.make_caches(10)
    with torch.no_grad():
        prompt = model(tokens[:, :3], caches=caches)
        assert isinstance(prompt, torch.Tensor)
        torch.testing.assert_close(prompt, model(tokens[:, :3]), rtol=1e-9, atol=1e-9)
        for t in range(3, 10):  # positions 3..9: the frequencies change past length 4
            step = model(tokens[:, t : t + 1], caches=caches)
            full = model(tokens[:, : t + 1])  # a full pass over the sequence so far
            assert isinstance(step, torch.Tensor) and isinstance(full, torch.Tensor)
            torch.testing.assert_close(step[:, 0], full[:, -1], rtol=1e-5, atol=1e-5)
    # generate() decodes with the same caches: its tokens are the greedy argmax of full passes.
    out = model.generate(tokens[:, :3], 7)
    with torch.no_grad():
        for t in range(3, 10):
            full = model(out[:, :t])
            assert isinstance(full, torch.Tensor)
            assert torch.equal(full[:, -1].argmax(dim=-1), out[:, t])


@pytest.mark.parametrize("name", ["rotary", "dynamic", "xpos"])
def test_block_with_cache_and_randomized_positions_equals_full_pass(name: str) -> None:
    encoding: QueryKeyEncoding = {
        "rotary": lambda: RotaryPositionalEncoding(8),
        "dynamic": lambda: RotaryPositionalEncoding(8, scaling=SCALINGS["dynamic"]),
        "xpos": lambda: XPosEncoding(8),
    }[name]()
    torch.manual_seed(1)
    block = TransformerBlock(16, 2, 32, position=encoding).double().eval()
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    positions = torch.tensor([1, 2, 5, 6, 11, 17, 23])
    cache = KVCache(7)
    with torch.no_grad():
        steps = [block(x[:, :3], causal=True, positions=positions[:3], cache=cache)]
        steps += [block(x[:, t : t + 1], causal=True, positions=positions[t : t + 1], cache=cache) for t in range(3, 7)]
        assert cache.positions is not None and torch.equal(cache.positions, positions)
        for t in range(3, 7):
            full = block(x[:, : t + 1], causal=True, positions=positions[: t + 1])
            torch.testing.assert_close(steps[t - 2][:, 0], full[:, -1], rtol=1e-9, atol=1e-9)
        by_offset = block(x, causal=True, offset=4)
    torch.testing.assert_close(block(x, causal=True, positions=torch.arange(4, 11)), by_offset)
    with pytest.raises(ValueError, match="give either offset or positions"):
        block(x, causal=True, offset=1, positions=positions)


@pytest.mark.parametrize("position", ["rotary", "sinusoidal", "learned"])
def test_lm_positions_per_sequence_equal_each_sequence_alone(position: str) -> None:
    """``(b, l)`` positions: each row of the batch at its own positions, as if run alone with its ``(l,)`` row."""
    model = _model(position, 2)
    tokens = torch.randint(0, 11, (3, 5))
    positions = torch.tensor([[0, 3, 9, 10, 30], [1, 2, 4, 40, 63], [5, 6, 7, 8, 9]])
    with torch.no_grad():
        batched = model(tokens, positions=positions)
        alone = torch.cat([model(tokens[i : i + 1], positions=positions[i]) for i in range(3)])
        shared = model(tokens, positions=positions[0])
    assert isinstance(batched, torch.Tensor) and isinstance(shared, torch.Tensor)
    torch.testing.assert_close(batched, alone, rtol=1e-9, atol=1e-9)
    assert (batched[1:] - shared[1:]).abs().max() > 1e-3  # the rows' own positions, not the first row's
    with pytest.raises(ValueError, match=r"positions must be an integer tensor of shape \(5,\) or \(3, 5\)"):
        model(tokens, positions=positions[:2])
    with pytest.raises(ValueError, match="strictly increasing"):
        model(tokens, positions=torch.tensor([[0, 1, 2, 3, 4], [0, 1, 1, 3, 4], [0, 1, 2, 3, 4]]))
    with pytest.raises(ValueError, match="positions must be non-negative, got -1"):
        model(tokens, positions=torch.tensor([[0, 1, 2, 3, 4], [-1, 1, 2, 3, 4], [0, 1, 2, 3, 4]]))


@pytest.mark.parametrize("position", ["sinusoidal", "learned"])
def test_given_positions_drop_out_the_sum_of_input_and_encoding_in_training(position: str) -> None:
    """With positions the model added dropout(P)[positions] to the embeddings (the embeddings never dropped, P
    dropped and scaled alone); the encoding's docstring and the offset path give dropout(X + P[positions])."""
    torch.manual_seed(0)
    lm = TransformerLM(30, 16, 2, 1, position=position, max_len=12, position_options={"dropout": 0.5}).train()
    tokens = torch.randint(0, 30, (2, 6), generator=torch.Generator().manual_seed(1))
    seen = []
    lm.blocks[0].register_forward_pre_hook(lambda module, args, kwargs: seen.append(args[0]), with_kwargs=True)
    torch.manual_seed(3)
    by_offset = lm(tokens)
    torch.manual_seed(3)
    by_positions = lm(tokens, positions=torch.arange(6))
    torch.testing.assert_close(by_positions, by_offset, atol=0, rtol=0)
    assert (seen[1] == 0).float().mean() > 0.3  # the block's input itself is dropped, not only P
