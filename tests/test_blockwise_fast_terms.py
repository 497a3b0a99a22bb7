"""The fast paths of two score terms: ALiBi as one key-only row of bias, FIRE as a piecewise linear MLP.

Both are checked against independent float64 references: the dense attention of
``test_blockwise`` (softmax over the whole bias) and FIRE's MLP written out here.
"""

from __future__ import annotations

import math
from unittest import mock

import pytest
import torch
from test_blockwise import HEADS, check_forward_and_gradients, dense, make_term, qkv, visibility
from torch.autograd import gradcheck, gradgradcheck
from torch.func import functional_call

import selfattn.functional._block_autograd as blockwise
from selfattn import MultiHeadAttention
from selfattn.functional import blockwise_attention
from selfattn.positional import build

# ---- ALiBi: one row of bias for every query ---------------------------------------------------


def flash_masks(call) -> list[torch.Tensor]:
    """The float masks ``call()`` hands to the CPU flash kernel's forward."""
    with mock.patch.object(blockwise, "_flash_forward", wraps=blockwise._flash_forward) as spy:
        call()
    return [c.kwargs["attn_mask"] for c in spy.call_args_list]


def test_alibi_key_only_term_differs_from_the_term_by_a_constant_per_query():
    alibi = make_term("alibi")
    q, _, _ = qkv(1, 6, 9)
    q_positions, k_positions = torch.arange(40, 46), torch.arange(37, 46)
    term = alibi(q, q_positions=q_positions, k_positions=k_positions)  # (1, h, 6, 9)
    row = alibi.key_only_term((k_positions - 44)[None, None, None, :], torch.float64)  # (1, h, 1, 9)
    assert row.shape == (1, HEADS, 1, 9)
    difference = term - row  # m (44 - i): the same for every key
    torch.testing.assert_close(difference, difference[..., :1].expand_as(difference), rtol=0, atol=1e-12)
    assert not torch.allclose(difference[..., 0, 0], difference[..., 1, 0])
    assert make_term("alibi-bidirectional").key_only_term(k_positions, torch.float64) is None


@pytest.mark.parametrize(("lq", "lk", "block"), [(11, 11, 4), (11, 11, None), (5, 13, 2), (13, 5, 3)])
def test_alibi_key_only_path_equals_dense_without_a_causal_mask(lq, lk, block):
    check_forward_and_gradients("alibi", b=2, lq=lq, lk=lk, block=block)
    check_forward_and_gradients("alibi", b=3, lq=lq, lk=lk, block=block, valid_lens=torch.tensor([lk, 0, 2]))


def test_alibi_key_only_path_equals_dense_with_key_masks():
    gen = torch.Generator().manual_seed(2)
    per_sequence = torch.rand(2, 1, 1, 9, generator=gen) > 0.5
    per_sequence[1] = False  # a sequence that sees no key: zeros
    out = check_forward_and_gradients("alibi", b=2, lq=7, lk=9, block=3, mask=per_sequence)
    assert not bool(out[1].any())
    per_head = torch.rand(2, HEADS, 1, 9, generator=gen) > 0.3
    check_forward_and_gradients("alibi", b=2, lq=7, lk=9, block=None, mask=per_head)
    check_forward_and_gradients("alibi", b=2, lq=7, lk=9, block=4, mask=torch.rand(9, generator=gen) > 0.5)


def test_alibi_key_only_path_hands_one_expanded_row_to_the_kernel():
    term = make_term("alibi")
    q, k, v = qkv(2, 10, 10)
    lens = torch.tensor([10, 4])
    masks = flash_masks(lambda: blockwise_attention(q, k, v, term=term, valid_lens=lens))
    assert len(masks) == 1 and masks[0].shape == (2, HEADS, 10, 10) and masks[0].stride(-2) == 0
    assert len(flash_masks(lambda: blockwise_attention(q, k, v, term=term, block_size=3))) == 4
    # A causal mask, per-query lengths or the bidirectional form keep the (lq, lk) bias of each block.
    causal = flash_masks(lambda: blockwise_attention(q, k, v, term=term, causal=True, block_size=5))
    per_query = flash_masks(lambda: blockwise_attention(q, k, v, term=term, valid_lens=lens[:, None].expand(2, 10)))
    bidirectional = make_term("alibi-bidirectional")
    both_ways = flash_masks(lambda: blockwise_attention(q, k, v, term=bidirectional))
    for mask in [*causal, *per_query, *both_ways]:
        assert mask.stride(-2) != 0


def test_alibi_key_only_path_with_per_sequence_positions():
    term = make_term("alibi")
    q, k, v = qkv(2, 6, 8, grad=True)
    k_positions = torch.stack([torch.arange(8), torch.arange(100, 108)])  # (b, lk)
    q_positions = k_positions[:, 2:]
    lens = torch.tensor([8, 5])
    out = blockwise_attention(q, k, v, term=term, q_positions=q_positions, k_positions=k_positions, valid_lens=lens)
    want = dense(term, q, k, v, q_positions, k_positions, visibility(2, 6, 8, valid_lens=lens))
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    got = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref = torch.autograd.grad(want.square().sum(), (q, k, v))
    for g, w in zip(got, ref, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-10)


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 2e-5), (torch.bfloat16, 0.03)])
def test_alibi_key_only_path_keeps_its_precision_far_from_position_zero(dtype, atol):
    term, term64 = make_term("alibi", dtype), make_term("alibi")
    q, k, v = qkv(2, 40, 40, dtype, seed=1)
    positions = torch.arange(10**6, 10**6 + 40)
    lens = torch.tensor([40, 17])
    with torch.no_grad():
        out = blockwise_attention(q, k, v, term=term, q_positions=positions, k_positions=positions, valid_lens=lens)
        want = dense(
            term64, *(t.double() for t in (q, k, v)), positions, positions, visibility(2, 40, 40, valid_lens=lens)
        )
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), want, rtol=0, atol=atol)


def test_gradcheck_alibi_key_only_path():
    term = make_term("alibi")
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, HEADS, n, 2, generator=gen, dtype=torch.float64, requires_grad=True) for n in (3, 4, 4))
    lens = torch.tensor([4, 2])

    def run(q, k, v):
        return blockwise_attention(q, k, v, term=term, valid_lens=lens, block_size=2)

    assert gradcheck(run, (q, k, v), atol=1e-7, rtol=1e-5)


def test_multihead_attention_alibi_without_causal_equals_its_dense_path():
    torch.manual_seed(0)
    mha = MultiHeadAttention(HEADS * 8, HEADS, position=build("alibi", num_hiddens=HEADS * 8, num_heads=HEADS))
    x = torch.randn(2, 12, HEADS * 8)
    lens = torch.tensor([12, 5])
    out = mha(x, x, x, lens, offset=30)
    dense_out, _ = mha(x, x, x, lens, offset=30, return_weights=True)
    torch.testing.assert_close(out, dense_out, rtol=0, atol=2e-6)


# ---- FIRE: the MLP of a scalar as a piecewise linear function ---------------------------------


def fire_reference(fire, q_positions, k_positions) -> torch.Tensor:
    """FIRE's term in float64 from its formula, the MLP written out: (h, lq, lk) or (b, h, lq, lk)."""
    c = torch.nn.functional.softplus(fire.raw_c.double())
    threshold = torch.nn.functional.softplus(fire.raw_threshold.double())
    i = q_positions.double()[..., :, None]
    j = k_positions.double()[..., None, :]
    x = torch.log(c * (i - j).abs() + 1) / torch.log(c * torch.maximum(i, threshold) + 1)  # (..., lq, lk)
    w1, b1 = fire.mlp[0].weight.double()[:, 0], fire.mlp[0].bias.double()
    w2, b2 = fire.mlp[2].weight.double(), fire.mlp[2].bias.double()
    hidden = torch.clamp(x[..., None] * w1 + b1, min=0)  # (..., lq, lk, hidden)
    return (hidden @ w2.T + b2).movedim(-1, -3)


def awkward_fire(hidden_size: int = 6) -> torch.nn.Module:
    """FIRE with a flat unit of each sign, two units with the same kink and kinks inside [0, 1]."""
    torch.manual_seed(7)
    fire = build("fire", num_hiddens=HEADS * 8, num_heads=HEADS, hidden_size=hidden_size, threshold=3.0).double()
    with torch.no_grad():
        for p in fire.parameters():
            p.add_(torch.randn_like(p) * 0.3)
        w1, b1 = fire.mlp[0].weight[:, 0], fire.mlp[0].bias
        w1[:4] = torch.tensor([0.0, 0.0, 2.0, -1.0])
        b1[:4] = torch.tensor([0.5, -0.5, -0.6, 0.3])  # kinks at 0.3 and 0.3
    return fire


@pytest.mark.parametrize("per_sequence", [False, True])
def test_fire_piecewise_term_equals_its_mlp_in_float64(per_sequence):
    fire = awkward_fire()
    q_positions, k_positions = torch.arange(0, 9), torch.arange(0, 12)
    if per_sequence:
        q_positions = torch.stack([q_positions, q_positions + 50])
        k_positions = torch.stack([k_positions, k_positions + 47])
    q = torch.zeros(1, HEADS, 9, 8, dtype=torch.float64)
    got = fire(q, q_positions=q_positions, k_positions=k_positions)
    want = fire_reference(fire, q_positions, k_positions)
    assert got.shape == ((2, HEADS, 9, 12) if per_sequence else (1, HEADS, 9, 12))
    torch.testing.assert_close(got, want.expand_as(got), rtol=0, atol=1e-12)
    grad = torch.randn_like(got)
    params = list(fire.parameters())
    got_grads = torch.autograd.grad(got, params, grad)
    want_grads = torch.autograd.grad(want.expand_as(got), params, grad)
    for (name, _), g, w in zip(fire.named_parameters(), got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-10, msg=lambda m, name=name: f"d{name}: {m}")


def test_fire_piecewise_term_in_float32_stays_near_the_float64_mlp():
    fire = awkward_fire(32)
    positions = torch.arange(4000, 4064)
    q = torch.zeros(1, HEADS, 64, 8)
    got = fire.float()(q, q_positions=positions, k_positions=torch.arange(0, 4064, 7))
    want = fire_reference(fire.double(), positions, torch.arange(0, 4064, 7))
    torch.testing.assert_close(got.double(), want[None], rtol=0, atol=1e-5)


def test_gradcheck_fire_term_through_its_parameters():
    fire = awkward_fire(5)
    q = torch.zeros(1, HEADS, 3, 8, dtype=torch.float64)
    q_positions, k_positions = torch.tensor([1, 4, 9]), torch.tensor([0, 2, 5, 9])
    names = [name for name, _ in fire.named_parameters()]

    def term(*params):
        return functional_call(fire, dict(zip(names, params, strict=True)), (q,),
                               {"q_positions": q_positions, "k_positions": k_positions})  # fmt: skip

    params = tuple(p.detach().clone().requires_grad_(True) for p in fire.parameters())
    assert gradcheck(term, params, atol=1e-7, rtol=1e-5)
    assert gradgradcheck(term, params, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize(("lq", "lk", "block"), [(11, 11, 4), (5, 13, 2)])
@pytest.mark.parametrize("causal", [False, True])
def test_fire_blockwise_equals_dense_in_both_directions(lq, lk, block, causal):
    check_forward_and_gradients("fire", b=2, lq=lq, lk=lk, block=block, causal=causal)
    check_forward_and_gradients(
        "fire", b=3, lq=lq, lk=lk, block=block, causal=causal, valid_lens=torch.tensor([lk, 0, 3])
    )


def test_fire_blockwise_equals_the_written_out_mlp():
    fire = awkward_fire()
    q, k, v = qkv(2, 10, 10, grad=True)
    positions = torch.arange(2, 12)
    out = blockwise_attention(q, k, v, term=fire, q_positions=positions, k_positions=positions, block_size=3)
    scores = q @ k.transpose(-2, -1) / math.sqrt(8) + fire_reference(fire, positions, positions)
    want = torch.softmax(scores, dim=-1) @ v
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    params = [q, k, v, *fire.parameters()]
    for g, w in zip(torch.autograd.grad(out.sum(), params), torch.autograd.grad(want.sum(), params), strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-10)


@pytest.mark.parametrize("parameter", ["mlp.0.weight", "mlp.0.bias", "mlp.2.weight", "raw_c"])
def test_fire_piecewise_term_keeps_a_nan_parameter_visible(parameter):
    fire = awkward_fire()
    with torch.no_grad():
        dict(fire.named_parameters())[parameter].view(-1)[0] = float("nan")
    q = torch.zeros(1, HEADS, 4, 8, dtype=torch.float64)
    term = fire(q, q_positions=torch.arange(4), k_positions=torch.arange(4))
    want = fire_reference(fire, torch.arange(4), torch.arange(4))
    assert torch.equal(term.isnan(), want.isnan()[None].expand_as(term)) and bool(term.isnan().any())
