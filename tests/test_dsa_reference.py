"""The whole DSA layer (indexer, top-k, latent attention) in float64 against its formulas written here.

Independent of transformers and of selfattn's code: the indexer's scores
``I(t, s) = sum_h w_th ReLU(q_th . k_s / sqrt(D))`` with ``w_th = weights_proj(x_t)_h / sqrt(H)``, its
LayerNorm'd key and half-split rotary (scaled by YaRN's attention factor, as the model hands its
rotary to both), each query's ``top_k`` best visible keys by a sort, and the latent attention over
them (``reference_mla.mla_reference``) with left padding. Forward, input and parameter gradients, at
a length past the sparse route's 64 queries so the layer's own choice (absorbed, "sparse
selection") is the one checked, and with each computation forced.

Shape legend: b batch, n tokens, H index heads, D index head size, dr rotary features, k picks.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from reference_mla import mla_reference, yarn_frequencies

from selfattn.positional.rotary import RotaryPositionalEncoding
from selfattn.sparse import SparseLatentAttention

YARN = dict(
    rope_type="yarn", factor=4.0, original_max_position_embeddings=16, beta_fast=32.0, beta_slow=1.0,
    mscale=0.707, mscale_all_dim=1.0,
)  # fmt: skip
SIZES = dict(
    hidden_size=32, num_heads=8, kv_lora_rank=16, q_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4,
    v_head_dim=6, split_rotated_pairs=True,
)  # fmt: skip
INDEX_HEADS, INDEX_DIM, TOP_K = 16, 8, 5  # 16 heads: a score of exactly 0 (every ReLU off) is rare
PADS, LENGTH = (0, 9), 70


def _layer() -> SparseLatentAttention:
    """Seeded float64 weights, norms near 1; the rotary is DeepSeek's (interleaved read, YaRN)."""
    position = RotaryPositionalEncoding(4, 10000.0, True, scaling=dict(YARN), dtype=torch.float64)
    torch.manual_seed(6)
    layer = SparseLatentAttention(
        index_heads=INDEX_HEADS, index_head_dim=INDEX_DIM, top_k=TOP_K, position=position, dtype=torch.float64,
        **SIZES,
    )  # fmt: skip
    with torch.no_grad():
        for name, param in layer.named_parameters():
            if "norm" in name:
                param.copy_((1.0 if name.endswith("weight") else 0.0) + 0.3 * torch.randn(param.shape))
            else:
                param.copy_(torch.randn(param.shape) * param.shape[-1] ** -0.5 * 1.5)
    return layer


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x (b, n, d)``, positions counting real tokens only, and the left padding (True = pad)."""
    x = torch.randn(len(PADS), LENGTH, 32, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    padding = torch.zeros(len(PADS), LENGTH, dtype=torch.bool)
    for row, pad in enumerate(PADS):
        padding[row, :pad] = True
    return x, ((~padding).long().cumsum(-1) - 1).clamp(min=0), padding


def _index_scores(w: dict[str, torch.Tensor], x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``I (b, n, n)`` from the formula: turns of the half-split pairs ``(j, j + dr / 2)`` as complex numbers."""
    frequencies, factor = yarn_frequencies(4, dict(YARN, rope_theta=10000.0))
    turn = torch.polar(
        torch.full((*positions.shape, 2), factor, dtype=torch.float64), positions[..., None] * frequencies
    )

    def rotated(v: torch.Tensor, turns: torch.Tensor) -> torch.Tensor:
        pairs = torch.complex(v[..., :2], v[..., 2:4]) * turns
        return torch.cat([pairs.real, pairs.imag, v[..., 4:]], dim=-1)

    latent = torch.nn.functional.rms_norm(x @ w["q_a_proj.weight"].T, (12,), w["q_a_layernorm.weight"], 1e-6)
    keys = torch.nn.functional.layer_norm(
        x @ w["indexer.wk.weight"].T, (INDEX_DIM,), w["indexer.k_norm.weight"], w["indexer.k_norm.bias"], 1e-6
    )
    keys = rotated(keys, turn)  # (b, n, D)
    queries = rotated((latent @ w["indexer.wq_b.weight"].T).unflatten(-1, (INDEX_HEADS, INDEX_DIM)), turn[:, :, None])
    head_weights = x @ w["indexer.weights_proj.weight"].T / INDEX_HEADS**0.5  # (b, n, H)
    relu = torch.relu(torch.einsum("bthd,bsd->bths", queries, keys) / INDEX_DIM**0.5)
    return torch.einsum("bth,bths->bts", head_weights, relu)


def _selected(scores: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Bool ``(b, n, n)``: each query's ``TOP_K`` best visible keys (all of them when it sees fewer), by a sort."""
    chosen = torch.zeros_like(visible)
    for b in range(scores.shape[0]):
        for t in range(scores.shape[1]):
            seen = visible[b, t].nonzero().flatten()
            order = scores[b, t, seen].argsort(descending=True)
            if seen.numel() > TOP_K:  # the picks are defined: no tie at the boundary
                ranked = scores[b, t, seen[order]]
                assert float(ranked[TOP_K - 1] - ranked[TOP_K]) > 1e-9, (b, t)
            chosen[b, t, seen[order[:TOP_K]]] = True
    return chosen


def _reference(layer: SparseLatentAttention, x: torch.Tensor, positions: torch.Tensor, padding: torch.Tensor) -> Any:
    w = dict(layer.named_parameters())
    with torch.no_grad():
        visible = torch.ones(LENGTH, LENGTH, dtype=torch.bool).tril()[None] & ~padding[:, None, :]
        chosen = _selected(_index_scores({k: v.detach() for k, v in w.items()}, x, positions), visible)
    frequencies, factor = yarn_frequencies(4, dict(YARN, rope_theta=10000.0))
    sizes = dict(
        heads=8, rank=16, nope=8, rope=4, value=6, eps=1e-6, scale=layer.scale, interleaved=True,
        frequencies=frequencies, attention_factor=factor,
    )  # fmt: skip
    weights = {k: v for k, v in w.items() if not k.startswith("indexer.")}
    return mla_reference(weights, x, positions, visible & chosen, sizes), chosen


@pytest.mark.parametrize("computation", [None, "expanded", "absorbed"])
def test_the_layer_equals_the_formulas_in_float64(computation: str | None) -> None:
    """Output, input and attention-parameter gradients to 1e-10; the default is absorbed on the sparse route."""
    layer = _layer()
    x, positions, padding = _inputs()
    explained = layer.explain(x, positions=positions, key_padding_mask=padding, computation=computation)
    if computation is None:
        assert (explained.computation, explained.route) == ("absorbed", "sparse selection"), str(explained)
    x_ours, x_theirs = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ours = layer(x_ours, positions=positions, key_padding_mask=padding, computation=computation)
    ours_grads = dict(layer.named_parameters())
    real = ~padding
    weights = torch.randn(ours.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (ours[real] * weights[real]).sum().backward()
    got = {name: p.grad.clone() for name, p in ours_grads.items() if p.grad is not None}
    layer.zero_grad(set_to_none=True)
    expected, chosen = _reference(layer, x_theirs, positions, padding)
    (expected[real] * weights[real]).sum().backward()
    assert chosen.sum(-1)[real].min() >= 1 and chosen.sum(-1).max() == TOP_K  # early queries see all they can
    torch.testing.assert_close(ours[real], expected[real], atol=1e-10, rtol=0)
    torch.testing.assert_close(x_ours.grad[real], x_theirs.grad[real], atol=1e-10, rtol=0)  # type: ignore[index]
    attention_params = [name for name, _ in layer.named_parameters() if not name.startswith("indexer.")]
    assert set(got) == set(attention_params)  # no gradient reaches the indexer through its integer picks
    for name in attention_params:
        theirs = dict(layer.named_parameters())[name].grad
        assert theirs is not None, name
        torch.testing.assert_close(got[name], theirs, atol=1e-10, rtol=0, msg=name)
    dense = torch.ones(LENGTH, LENGTH, dtype=torch.bool).tril()[None] & ~padding[:, None, :]
    assert bool((chosen != dense)[real].any())  # the selection hid keys: the check is not the dense layer's
