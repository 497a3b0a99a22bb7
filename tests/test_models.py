"""TransformerBlock and TransformerLM: against PyTorch's own layer, cache == full pass, errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from selfattn.models import TransformerBlock, TransformerLM

ENCODINGS = ["none", "sinusoidal", "learned", "rotary", "alibi", "t5", "shaw"]


def _copy_into_torch(block: TransformerBlock, norm_first: bool) -> nn.TransformerEncoderLayer:
    d = block.num_hiddens
    layer = nn.TransformerEncoderLayer(
        d,
        block.attention.num_heads,
        block.ffn_hiddens,
        dropout=0.0,
        activation="gelu",
        batch_first=True,
        norm_first=norm_first,
        bias=False,
    )
    attn = block.attention
    with torch.no_grad():
        layer.self_attn.in_proj_weight.copy_(torch.cat([attn.W_q.weight, attn.W_k.weight, attn.W_v.weight]))
        layer.self_attn.out_proj.weight.copy_(attn.W_o.weight)
        assert block.mlp is not None and block.norm_2 is not None
        layer.linear1.weight.copy_(block.mlp[0].weight)
        layer.linear2.weight.copy_(block.mlp[2].weight)
        layer.norm1.weight.copy_(block.norm_1.weight)
        layer.norm2.weight.copy_(block.norm_2.weight)
    return layer.eval()


@pytest.mark.parametrize("norm_first", [True, False])
@pytest.mark.parametrize("causal", [True, False])
def test_block_matches_torch_encoder_layer(norm_first: bool, causal: bool) -> None:
    torch.manual_seed(0)
    block = TransformerBlock(16, 4, 24, norm_first=norm_first).double().eval()
    with torch.no_grad():  # non-trivial norm gains, so a swapped norm would show
        block.norm_1.weight.uniform_(0.5, 1.5)
        assert block.norm_2 is not None
        block.norm_2.weight.uniform_(0.5, 1.5)
    layer = _copy_into_torch(block, norm_first).double()
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    mask = nn.Transformer.generate_square_subsequent_mask(7, dtype=torch.float64) if causal else None
    expected = layer(x, src_mask=mask, is_causal=causal)
    torch.testing.assert_close(block(x, causal=causal), expected, rtol=1e-6, atol=1e-6)


def test_block_without_residual_or_mlp() -> None:
    torch.manual_seed(0)
    block = TransformerBlock(8, 2, 16, residual=False, mlp=False).double()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    attn = block.attention(block.norm_1(x), block.norm_1(x), block.norm_1(x))
    torch.testing.assert_close(block(x), attn)
    assert block.mlp is None and "mlp=False" in repr(block)
    full = TransformerBlock(8, 2, 16, residual=False).double()
    attn = full.attention(full.norm_1(x), full.norm_1(x), full.norm_1(x))
    assert full.mlp is not None and full.norm_2 is not None
    torch.testing.assert_close(full(x), full.mlp(full.norm_2(attn)))


@pytest.mark.parametrize("position", ENCODINGS)
def test_lm_shapes_hidden_and_greedy_generate_equals_full_pass(position: str) -> None:
    torch.manual_seed(1)
    model = TransformerLM(11, 16, 2, 3, position=position, max_len=40).eval()
    tokens = torch.randint(0, 11, (3, 6))
    logits, hidden = model(tokens, return_hidden=True)
    assert logits.shape == (3, 6, 11) and len(hidden) == 4 and all(h.shape == (3, 6, 16) for h in hidden)
    out = model.generate(tokens, 9)
    assert out.shape == (3, 15) and torch.equal(out[:, :6], tokens)
    with torch.no_grad():
        full = model(out[:, :-1])
    assert torch.equal(full.argmax(-1)[:, 5:], out[:, 6:])
    # Cached logits equal the full pass, to float precision.
    caches = model.make_caches(15)
    with torch.no_grad():
        pieces = [model(out[:, :6], caches=caches)] + [model(out[:, t : t + 1], caches=caches) for t in range(6, 14)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("position", ["sinusoidal", "rotary", "alibi", "shaw"])
def test_lm_valid_lens_right_padding_leaves_valid_positions_alone(position: str) -> None:
    torch.manual_seed(2)
    model = TransformerLM(9, 16, 2, 2, position=position).eval()
    short = torch.randint(1, 9, (1, 4))
    padded = torch.cat([torch.cat([short, torch.zeros(1, 3, dtype=torch.long)], 1), torch.randint(1, 9, (1, 7))])
    with torch.no_grad():
        batch = model(padded, torch.tensor([4, 7]))
        alone = model(short)
        whole = model(padded[1:])
    torch.testing.assert_close(batch[0, :4], alone[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(batch[1], whole[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("position", ["sinusoidal", "learned", "rotary"])
def test_lm_positions_equal_offset_when_consecutive_and_differ_otherwise(position: str) -> None:
    torch.manual_seed(3)
    model = TransformerLM(9, 16, 2, 2, position=position, max_len=64).eval()
    tokens = torch.randint(0, 9, (2, 5))
    with torch.no_grad():
        by_offset = model(tokens, offset=7)
        by_positions = model(tokens, positions=torch.arange(7, 12))
        spread = model(tokens, positions=torch.tensor([0, 3, 9, 10, 30]))
    torch.testing.assert_close(by_positions, by_offset)
    assert not torch.allclose(spread, by_offset)
    assert isinstance(model.position, nn.Module) or model.input_encoding is not None


def test_lm_encoding_kinds_and_learned_table_size() -> None:
    assert TransformerLM(5, 8, 2, 1, position="learned", max_len=33).encoding.weight.shape == (33, 8)  # type: ignore[union-attr]
    shared = TransformerLM(5, 8, 2, 3, position="t5")
    assert all(block.attention.position is shared.position for block in shared.blocks)
    assert TransformerLM(5, 8, 2, 1, position="rotary").encoding.acts_on == "query_key"
    # Tied head: the output matrix is the embedding.
    model = TransformerLM(5, 8, 2, 1, position="none")
    assert sum(p.numel() for p in model.parameters() if p.shape == (5, 8)) == 40


def test_lm_under_torch_compile() -> None:
    torch.manual_seed(4)
    model = TransformerLM(7, 16, 2, 2, position="rotary").eval()
    tokens = torch.randint(0, 7, (2, 6))
    compiled = torch.compile(model, backend="aot_eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(tokens), model(tokens))


def test_lm_errors() -> None:
    with pytest.raises(ValueError, match="position must be one of"):
        TransformerLM(5, 8, 2, 1, position="sinusoidal2d")
    with pytest.raises(ValueError, match="vocab_size"):
        TransformerLM(0, 8, 2, 1)
    with pytest.raises(ValueError, match="num_hiddens=8 is not divisible by num_heads=3"):
        TransformerLM(5, 8, 3, 1)
    model = TransformerLM(5, 8, 2, 2, position="learned", max_len=10)
    with pytest.raises(ValueError, match="tokens must have shape"):
        model(torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="integer ids"):
        model(torch.zeros(1, 4))
    with pytest.raises(ValueError, match=r"tokens must lie in \[0, 5\)"):
        model(torch.tensor([[0, 5]]))
    with pytest.raises(ValueError, match="max_len=10"):
        model(torch.zeros(1, 11, dtype=torch.long))
    with pytest.raises(ValueError, match="exceed max_len=10"):
        model.generate(torch.zeros(1, 4, dtype=torch.long), 7)
    with pytest.raises(ValueError, match="one KVCache per block"):
        model(torch.zeros(1, 2, dtype=torch.long), caches=model.make_caches()[:1])
    with pytest.raises(ValueError, match="strictly increasing"):
        model(torch.zeros(1, 3, dtype=torch.long), positions=torch.tensor([0, 2, 2]))
    with pytest.raises(ValueError, match="either offset or positions"):
        model(torch.zeros(1, 3, dtype=torch.long), offset=1, positions=torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="positions must be an integer tensor of shape"):
        model(torch.zeros(1, 3, dtype=torch.long), positions=torch.tensor([0.0, 1.0, 2.0]))
    with pytest.raises(ValueError, match="positions only apply to absolute and rotary"):
        TransformerLM(5, 8, 2, 1, position="alibi")(torch.zeros(1, 2, dtype=torch.long), positions=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="max_new_tokens"):
        TransformerLM(5, 8, 2, 1).generate(torch.zeros(1, 2, dtype=torch.long), -1)
    with pytest.raises(ValueError, match="must rotate queries/keys or bias the scores"):
        from selfattn.positional import SinusoidalPositionalEncoding

        TransformerBlock(8, 2, 16, position=SinusoidalPositionalEncoding(8))
    with pytest.raises(ValueError, match="x must have shape"):
        TransformerBlock(8, 2, 16)(torch.zeros(1, 3, 4))
    with pytest.raises(ValueError, match="ffn_hiddens"):
        TransformerBlock(8, 2, 0)


@pytest.mark.parametrize("new_tokens", [0, 1, 3])
def test_generate_keeps_the_prompt_s_id_dtype(new_tokens: int) -> None:
    """An int32 prompt came back int32 with no new token and int64 with some."""
    torch.manual_seed(0)
    lm = TransformerLM(20, 16, 2, 1).eval()
    prompt = torch.randint(0, 20, (2, 3), dtype=torch.int32, generator=torch.Generator().manual_seed(1))
    out = lm.generate(prompt, new_tokens)
    assert out.dtype == torch.int32 and out.shape == (2, 3 + new_tokens)
    assert torch.equal(out.long(), lm.generate(prompt.long(), new_tokens))
