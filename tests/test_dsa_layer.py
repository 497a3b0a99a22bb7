"""SparseLatentAttention (the whole DSA layer) against transformers' DeepseekV32Attention / GlmMoeDsaAttention.

Each transformers layer runs as transformers runs it: its model's rotary embedding class, a mask from
``transformers.masking_utils``, a left-padded batch, and for decoding its own DynamicCache. The top-k
(3) is below the number of keys (12), so the indexer's selection decides the output: each test checks
that the inputs have no tie at the top-k boundary (so the picks are defined) and that attending densely
would give another output.

Gradients: transformers runs its indexer under ``torch.no_grad`` and its top-k indices carry none, so
the indexer's parameters get no gradient on either side; the input and every attention parameter do.

Shape legend: b batch, n tokens, k picks per query.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from _hf_families import float64_kept  # noqa: E402
from reference_mla import yarn_frequencies  # noqa: E402
from transformers import masking_utils  # noqa: E402

import selfattn.masks as masks  # noqa: E402
from selfattn.latent import LatentCache, MultiHeadLatentAttention  # noqa: E402
from selfattn.sparse import LightningIndexer, SparseLatentAttention, SparseLatentCache  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

TOP_K = 3
LENGTH = 12
PADS = (0, 4, 1)
SIZES = dict(
    vocab_size=50, hidden_size=32, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=12,
    qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, max_position_embeddings=64, num_hidden_layers=1,
    index_topk=TOP_K, index_n_heads=8, index_head_dim=16,
)  # fmt: skip
YARN = dict(
    rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16, beta_fast=32.0,
    beta_slow=1.0, mscale=0.707, mscale_all_dim=1.0,
)  # fmt: skip
# family -> (config class, extra config, attention class, rotary class)
FAMILIES: dict[str, tuple[str, dict[str, Any], str, str]] = {
    "deepseek_v32": ("DeepseekV32Config", dict(rope_parameters=YARN), "DeepseekV32Attention", "DeepseekV32RotaryEmbedding"),
    "glm_moe_dsa": ("GlmMoeDsaConfig", dict(indexer_types=["full"]), "GlmMoeDsaAttention", "GlmMoeDsaRotaryEmbedding"),
}  # fmt: skip


def _layer(family: str, implementation: str = "eager", **sizes: Any) -> tuple[Any, Any, Any]:
    """transformers' layer (random weights, float32), its config and its model's rotary embedding; ``sizes`` override."""
    config_name, extra, attention_name, rotary_name = FAMILIES[family]
    config = getattr(transformers, config_name)(**{**SIZES, **sizes}, **extra)
    config._attn_implementation = implementation
    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    torch.manual_seed(3)
    layer = getattr(modeling, attention_name)(config, 0).eval()
    with torch.no_grad():
        for name, param in layer.named_parameters():
            param.copy_(torch.randn(param.shape) * (0.3 if "norm" in name else 1.0))
            if name.endswith(("proj.weight", "mqa.weight", "wq_b.weight", "wk.weight")):
                param.mul_(param.shape[-1] ** -0.5 * 1.5)
            if "norm.weight" in name or "layernorm" in name:
                param.add_(1.0)
    return layer, config, getattr(modeling, rotary_name)(config)


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` ``(b, n, d)``, transformers' attention_mask (0 = padding, left) and position_ids as generate makes them."""
    x = torch.randn(len(PADS), LENGTH, 32, generator=torch.Generator().manual_seed(5))
    attention_mask = torch.ones(len(PADS), LENGTH, dtype=torch.long)
    for row, pad in enumerate(PADS):
        attention_mask[row, :pad] = 0
    position_ids = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
    return x, attention_mask, position_ids


def _run_theirs(layer: Any, config: Any, rotary: Any, x: torch.Tensor, attention_mask: torch.Tensor, **kw: Any):
    """transformers' output and the indexer's picks of one call (``kw``: the cache and this chunk's positions)."""
    picks: list[torch.Tensor] = []
    hook = layer.indexer.register_forward_hook(lambda module, args, out: picks.append(out.long()))
    cache, position_ids = kw.get("cache"), kw["position_ids"]
    mask = masking_utils.create_causal_mask(config, x, attention_mask, cache, position_ids=position_ids)
    try:
        out = layer(x, position_embeddings=rotary(x, position_ids), attention_mask=mask, **kw)[0]
    finally:
        hook.remove()
    return out, picks[0]


def _visible_sets(picks: torch.Tensor, visible: torch.Tensor) -> list[list[set[int]]]:
    """Per row and query, the picked keys it can see (``visible`` bool ``(b, q, n)``)."""
    return [
        [{int(j) for j in picks[b, q] if j >= 0 and visible[b, q, j]} for q in range(picks.shape[1])]
        for b in range(picks.shape[0])
    ]


def _visible(attention_mask: torch.Tensor, first: int, count: int) -> torch.Tensor:
    """Bool ``(b, count, n)``: query ``first + i`` sees key ``j`` (earlier or itself, not padding)."""
    total = attention_mask.shape[1]
    causal = torch.arange(total)[None, :] <= torch.arange(first, first + count)[:, None]
    return causal[None] & attention_mask[:, None, :total].bool()


def _assert_no_ties(sparse: SparseLatentAttention, x: torch.Tensor, position_ids: torch.Tensor, visible: torch.Tensor):
    """Every real query with more than k visible keys has a gap between its k-th and (k+1)-th scores (float64)."""
    indexer = sparse.indexer
    with torch.no_grad():
        cos, sin = (t.double() for t in sparse.index_rotary(position_ids, torch.float64))
        x64 = x.double()
        q_latent = torch.nn.functional.rms_norm(
            x64 @ sparse.q_a_proj.weight.double().T, (12,), sparse.q_a_layernorm.weight.double(), 1e-6
        )
        indexer64 = indexer.double()
        keys = indexer64.index_keys(x64, cos, sin)
        queries, weights = indexer64.index_queries(x64, q_latent, cos, sin)
        scores = torch.einsum("bqh,bqhk->bqk", weights, torch.relu(torch.einsum("bqhd,bkd->bqhk", queries, keys)))
        indexer.float()
    smallest = float("inf")
    for b in range(x.shape[0]):
        for q in range(x.shape[1]):
            seen = scores[b, q][visible[b, q]].sort(descending=True).values
            if seen.numel() > TOP_K:
                smallest = min(smallest, float(seen[TOP_K - 1] - seen[TOP_K]))
    assert smallest > 1e-4, f"a tie at the top-k boundary: gap {smallest:.2e}"
    print(f"smallest gap at the top-k boundary: {smallest:.1e}")


def _float64_frequencies(rotary: Any, config: Any) -> None:
    """Give transformers' rotary module its inverse frequencies in float64, from the formula (``yarn_frequencies``).

    transformers forms them in float32 whatever the layer's dtype: DeepSeek-V3.2's YaRN in
    ``modeling_rope_utils._compute_yarn_parameters`` (``pos_freqs = base ** (torch.arange(0, dim,
    2).to(device=device, dtype=torch.float) / dim)`` and the float32 ``linear_ramp_factor``),
    GLM-MoE-DSA's default rope in ``GlmMoeDsaRotaryEmbedding.compute_default_rope_parameters``
    (``torch.arange(0, dim, 2, dtype=torch.float)``), kept as the float32 buffer ``inv_freq``.
    Rounded to float32 (2.2e-8 relative), the angles of positions up to 11 differ from the
    formula's by up to 2.4e-9, and so do the layer's outputs and gradients (up to 8.4e-10
    relative), where selfattn forms its frequencies in float64. Its ``forward`` is left as it
    is: under ``float64_kept`` it multiplies float64 positions by these float64 frequencies.
    """
    frequencies, factor = yarn_frequencies(config.qk_rope_head_dim, dict(config.rope_parameters))
    assert rotary.inv_freq.dtype == torch.float32  # the step lifted here
    torch.testing.assert_close(rotary.inv_freq, frequencies.float(), atol=0, rtol=1e-7)  # the same formula
    assert factor == pytest.approx(rotary.attention_scaling, rel=1e-15)
    rotary.inv_freq = frequencies


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_equals_the_layer(family: str, implementation: str, dtype: torch.dtype) -> None:
    """Output, input gradient and attention parameter gradients equal transformers' (1e-5 float32, 1e-10 float64); same picks.

    In float64 transformers' float32 upcasts (its indexer's ``q.float()``, its RMSNorm) are lifted
    (``float64_kept``), and its rotary module is given the frequencies in float64
    (:func:`_float64_frequencies`); every step is still its own code. With its float32 frequencies
    the layers differed by up to 8.4e-10 (GLM-MoE-DSA's parameter gradients); with them, by 2e-15.
    """
    layer, config, rotary = _layer(family, implementation)
    x, attention_mask, position_ids = _inputs()
    real = attention_mask.bool()
    sparse = SparseLatentAttention.from_transformers(layer)
    visible = _visible(attention_mask, 0, LENGTH)
    _assert_no_ties(sparse, x, position_ids, visible)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-10
    if dtype == torch.float64:
        layer, sparse, x = layer.double(), sparse.double(), x.double()
        _float64_frequencies(rotary, config)

    x_theirs = x.clone().requires_grad_(True)
    with float64_kept() if dtype == torch.float64 else contextlib.nullcontext():
        theirs, their_picks = _run_theirs(layer, config, rotary, x_theirs, attention_mask, position_ids=position_ids)
    x_ours = x.clone().requires_grad_(True)
    ours = sparse(x_ours, positions=position_ids, key_padding_mask=attention_mask == 0)
    weights = torch.randn(theirs.shape, generator=torch.Generator().manual_seed(9)) * real[..., None]
    (theirs * weights).sum().backward()
    (ours * weights).sum().backward()

    our_picks = sparse.select(x, position_ids, attention_mask == 0, None)
    assert _visible_sets(our_picks, visible) == _visible_sets(their_picks, visible)
    assert ours.dtype == theirs.dtype == dtype
    worst = float((ours[real] - theirs[real]).abs().max()) / max(float(theirs[real].abs().max()), 1.0)
    assert worst <= tolerance, f"output differs by {worst:.2e} (relative)"
    worst_grad = float((x_ours.grad - x_theirs.grad).abs().max())  # type: ignore[operator]
    worst_grad /= max(float(x_theirs.grad.abs().max()), 1.0)  # type: ignore[union-attr]
    assert worst_grad <= tolerance, f"input gradient differs by {worst_grad:.2e} (relative)"
    worst_param = 0.0
    theirs_params, ours_params = dict(layer.named_parameters()), dict(sparse.named_parameters())
    assert set(theirs_params) == set(ours_params)
    for name, param in theirs_params.items():
        if name.startswith("indexer."):  # no gradient through top-k indices, on either side
            assert param.grad is None and ours_params[name].grad is None, name
            continue
        error = float((ours_params[name].grad - param.grad).abs().max())  # type: ignore[operator]
        error /= max(float(param.grad.abs().max()), 1.0)
        assert error <= tolerance, f"{name}: gradient differs by {error:.2e}"
        worst_param = max(worst_param, error)
    with torch.no_grad():
        dense = MultiHeadLatentAttention.from_transformers(layer)(
            x, positions=position_ids, key_padding_mask=attention_mask == 0
        )
    assert float((dense[real] - theirs[real]).abs().max()) > 1e-3  # the selection mattered
    print(
        f"{family} {implementation} {dtype}: output {worst:.1e}, input gradient {worst_grad:.1e}, "
        f"parameters {worst_param:.1e}"
    )


@pytest.mark.parametrize("family", list(FAMILIES))
def test_decoding_equals_transformers_cache(family: str) -> None:
    """Prefill 5 tokens, then one at a time: SparseLatentCache vs DynamicCache, outputs to 1e-5 and the same picks."""
    layer, config, rotary = _layer(family)
    x, attention_mask, position_ids = _inputs()
    real = attention_mask.bool()
    sparse = SparseLatentAttention.from_transformers(layer)
    _assert_no_ties(sparse, x, position_ids, _visible(attention_mask, 0, LENGTH))
    theirs_cache, ours_cache = transformers.DynamicCache(config=config), SparseLatentCache(max_len=LENGTH)
    theirs, ours = [], []
    with torch.no_grad():
        for start, stop in [(0, 5)] + [(t, t + 1) for t in range(5, LENGTH)]:
            chunk, positions, padding = (
                x[:, start:stop],
                position_ids[:, start:stop],
                attention_mask[:, start:stop] == 0,
            )
            out, their_picks = _run_theirs(
                layer, config, rotary, chunk, attention_mask[:, :stop], cache=theirs_cache, position_ids=positions
            )
            our_picks = sparse.select(chunk, positions, padding, ours_cache.copy().index_keys)
            visible = _visible(attention_mask[:, :stop], start, stop - start)
            assert _visible_sets(our_picks, visible) == _visible_sets(their_picks, visible), (start, stop)
            theirs.append(out)
            ours.append(sparse(chunk, positions=positions, key_padding_mask=padding, cache=ours_cache))
    got, expected = torch.cat(ours, dim=1), torch.cat(theirs, dim=1)
    worst = float((got[real] - expected[real]).abs().max())
    print(f"{family} decoding: {worst:.1e}")
    assert worst <= 1e-5
    assert ours_cache.latent.length == ours_cache.index_keys.length == LENGTH
    # The indexer's cached keys are transformers' (rotated the same way), on the real tokens.
    stored, ours_keys = theirs_cache.layers[0].indexer_keys, ours_cache.index_keys._keys
    assert stored is not None and ours_keys is not None and stored.shape == ours_keys.shape
    torch.testing.assert_close(ours_keys[real], stored[real], atol=1e-5, rtol=0)


def test_sparse_selection_route_is_taken() -> None:
    """3 picks of 12 keys (under the route's 25%) for prefill and decoding: explain names "sparse selection"."""
    layer, _, _ = _layer("deepseek_v32")
    sparse = SparseLatentAttention.from_transformers(layer)
    x, attention_mask, position_ids = _inputs()
    assert sparse.explain(x, positions=position_ids, key_padding_mask=attention_mask == 0).route == "sparse selection"
    cache = SparseLatentCache(max_len=LENGTH)
    with torch.no_grad():
        sparse(x[:, :-1], positions=position_ids[:, :-1], key_padding_mask=attention_mask[:, :-1] == 0, cache=cache)
    step = dict(positions=position_ids[:, -1:], key_padding_mask=attention_mask[:, -1:] == 0, cache=cache)
    explanation = sparse.explain(x[:, -1:], **step)
    assert explanation.computation == "absorbed"  # heads over one latent: kept apart, not folded into one head's rows
    assert explanation.route == "sparse selection", str(explanation)
    assert cache.length == LENGTH - 1 and cache.index_keys.length == LENGTH - 1  # explain changed nothing


def test_long_prefill_takes_the_absorbed_sparse_route_and_equals_the_dense_masked_pass() -> None:
    """80 queries (past the route's 64 for one head per kv head), 3 picks each: absorbed, "sparse selection".

    Expanded, each gathered key would serve one head, so the route declines and a dense masked pass
    runs; absorbed, one gathered latent row serves every head (8 here: the route's least for many
    queries), so the computation is chosen by the picks it attends to, and equals the expanded
    dense masked pass (and its gradients) to rounding. With 4 heads the route declines the
    absorbed call too, and the picks are not counted.
    """
    layer, _, _ = _layer("deepseek_v32", num_attention_heads=8, num_key_value_heads=8)
    sparse = SparseLatentAttention.from_transformers(layer)
    x = torch.randn(2, 80, 32, generator=torch.Generator().manual_seed(2), requires_grad=True)
    explained = sparse.explain(x)
    assert (explained.computation, explained.route) == ("absorbed", "sparse selection"), str(explained)
    assert "3 selected keys per query" in explained.reason
    four_heads = SparseLatentAttention.from_transformers(_layer("deepseek_v32")[0]).explain(x)
    assert four_heads.computation == "expanded" and "selected keys" not in four_heads.reason
    expanded = sparse.explain(x, computation="expanded")
    assert expanded.route != "sparse selection"  # the dense masked pass it is checked against
    ours = sparse(x)
    (grad,) = torch.autograd.grad(ours.square().sum(), x)
    dense = sparse(x, computation="expanded")
    (dense_grad,) = torch.autograd.grad(dense.square().sum(), x)
    torch.testing.assert_close(ours, dense, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, dense_grad, atol=1e-4, rtol=1e-5)


def test_failed_call_leaves_both_caches() -> None:
    """A call failing after the indexer extended its keys commits neither part; the next call goes on as before."""
    layer, _, _ = _layer("glm_moe_dsa")
    sparse = SparseLatentAttention.from_transformers(layer)
    x = torch.randn(1, 4, 32, generator=torch.Generator().manual_seed(1))
    cache, fresh = SparseLatentCache(max_len=8), SparseLatentCache(max_len=8)
    with torch.no_grad():
        sparse(x[:, :3], cache=cache)
        sparse(x[:, :3], cache=fresh)
        with pytest.raises(ValueError, match="computation must be one of"):
            sparse(x[:, 3:], cache=cache, computation="neither")
        assert cache.latent.length == cache.index_keys.length == 3
        torch.testing.assert_close(sparse(x[:, 3:], cache=cache), sparse(x[:, 3:], cache=fresh), atol=0, rtol=0)


def test_state_dict_is_transformers() -> None:
    """Every name of transformers' layer, the indexer's under ``indexer.``; a state dict goes back as it is."""
    layer, _, _ = _layer("deepseek_v32")
    sparse = SparseLatentAttention.from_transformers(layer)
    assert set(sparse.state_dict()) == set(layer.state_dict())
    assert any(name.startswith("indexer.") for name in sparse.state_dict())
    with torch.no_grad():
        for p in sparse.parameters():
            p.mul_(1.5)
    layer.load_state_dict(sparse.state_dict(), strict=True)
    assert torch.equal(layer.indexer.wk.weight, sparse.indexer.wk.weight)


def test_bad_input_is_named() -> None:
    layer, _, _ = _layer("deepseek_v32")
    sparse = SparseLatentAttention.from_transformers(layer)
    x = torch.randn(1, 4, 32)
    with pytest.raises(ValueError, match="causal=False"):
        sparse(x, causal=False)
    with pytest.raises(ValueError, match="mask=Selected: the indexer's picks"):
        sparse(x, mask=masks.selected(torch.zeros(1, 4, 1, dtype=torch.long)))
    with pytest.raises(ValueError, match=r"cache must be a SparseLatentCache.*got LatentCache"):
        sparse(x, cache=LatentCache(max_len=4))
    apart = SparseLatentCache(max_len=8)
    with torch.no_grad():
        sparse(x, cache=apart)
    apart.index_keys.reset()
    with pytest.raises(ValueError, match="4 latents and 0 index keys"):
        sparse(x, cache=apart)
    with pytest.raises(ValueError, match="max_len must be a positive integer"):
        SparseLatentCache(max_len=0)
    with pytest.raises(ValueError, match="top_k"):
        SparseLatentAttention(
            index_heads=2, index_head_dim=8, top_k=0, hidden_size=32, num_heads=4, kv_lora_rank=16,
            qk_nope_head_dim=8, qk_rope_head_dim=0, v_head_dim=6, q_lora_rank=12,
        )  # fmt: skip
    with pytest.raises(ValueError, match="q_lora_rank=None: the indexer reads the query latent"):
        SparseLatentAttention(
            index_heads=2, index_head_dim=8, top_k=2, hidden_size=32, num_heads=4, kv_lora_rank=16,
            qk_nope_head_dim=8, qk_rope_head_dim=0, v_head_dim=6,
        )  # fmt: skip


def test_other_layer_classes_are_refused() -> None:
    with pytest.raises(
        ValueError, match="DeepseekV32Attention, GlmMoeDsaAttention, MistralLarge4TextAttention, got Linear"
    ):
        SparseLatentAttention.from_transformers(torch.nn.Linear(2, 2))


def _glm_pair() -> tuple[Any, Any, Any, Any]:
    """transformers' GLM-5 layers of ``indexer_types=["full", "shared"]`` (random weights), the config and the rotary."""
    config = transformers.GlmMoeDsaConfig(**{**SIZES, "num_hidden_layers": 2}, indexer_types=["full", "shared"])
    config._attn_implementation = "eager"
    modeling = importlib.import_module("transformers.models.glm_moe_dsa.modeling_glm_moe_dsa")
    torch.manual_seed(3)
    layers = [modeling.GlmMoeDsaAttention(config, i).eval() for i in (0, 1)]
    with torch.no_grad():
        for layer in layers:
            for name, param in layer.named_parameters():
                param.copy_(torch.randn(param.shape) * (0.3 if "norm" in name else param.shape[-1] ** -0.5 * 1.5))
                if "norm.weight" in name or "layernorm" in name:
                    param.add_(1.0)
    return layers[0], layers[1], config, modeling.GlmMoeDsaRotaryEmbedding(config)


def test_a_shared_layer_takes_the_full_layers_picks_as_transformers_does() -> None:
    """GLM-5's "shared" layer has no indexer: given the "full" layer's picks it equals transformers' (1e-5).

    transformers hands the shared layer ``prev_topk_indices``; here :meth:`forward_with_picks` of
    the full layer returns them. Decoding with the caches (a plain LatentCache for the shared layer)
    equals the full pass.
    """
    full, shared, config, rotary = _glm_pair()
    x, attention_mask, position_ids = _inputs()
    x_next = torch.randn(x.shape, generator=torch.Generator().manual_seed(11))  # the shared layer's own input
    padding, real = attention_mask == 0, attention_mask.bool()
    ours_full, ours_shared = (
        SparseLatentAttention.from_transformers(full),
        SparseLatentAttention.from_transformers(shared),
    )
    assert ours_shared.shares_picks and not ours_full.shares_picks and "shares_picks=True" in repr(ours_shared)
    assert set(ours_shared.state_dict()) == set(shared.state_dict())  # no indexer weights on either side
    _assert_no_ties(ours_full, x, position_ids, _visible(attention_mask, 0, LENGTH))
    mask = masking_utils.create_causal_mask(config, x, attention_mask, None, position_ids=position_ids)
    embeddings = rotary(x, position_ids)
    with torch.no_grad():
        theirs_full, _, their_picks = full(x, embeddings, mask, position_ids=position_ids)
        theirs, _, _ = shared(x_next, embeddings, mask, position_ids=position_ids, prev_topk_indices=their_picks)
        ours_out, picks = ours_full.forward_with_picks(x, positions=position_ids, key_padding_mask=padding)
        ours = ours_shared(x_next, positions=position_ids, key_padding_mask=padding, picks=picks)
        dense = MultiHeadLatentAttention.from_transformers(shared)(
            x_next, positions=position_ids, key_padding_mask=padding
        )
    torch.testing.assert_close(ours_out[real], theirs_full[real], atol=1e-5, rtol=0)
    torch.testing.assert_close(ours[real], theirs[real], atol=1e-5, rtol=0)
    assert float((dense[real] - theirs[real]).abs().max()) > 1e-3  # the shared picks mattered
    assert ours_shared.explain(x_next, positions=position_ids, key_padding_mask=padding, picks=picks).route == (
        "sparse selection"
    )
    full_cache, shared_cache, steps = SparseLatentCache(max_len=LENGTH), LatentCache(max_len=LENGTH), []
    with torch.no_grad():
        for start, stop in [(0, 5)] + [(t, t + 1) for t in range(5, LENGTH)]:
            chunk = dict(positions=position_ids[:, start:stop], key_padding_mask=padding[:, start:stop])
            _, step_picks = ours_full.forward_with_picks(x[:, start:stop], cache=full_cache, **chunk)
            steps.append(ours_shared(x_next[:, start:stop], cache=shared_cache, picks=step_picks, **chunk))
    torch.testing.assert_close(torch.cat(steps, dim=1)[real], ours[real], atol=1e-5, rtol=0)


def test_picks_go_only_where_they_are_taken() -> None:
    full, shared, _, _ = _glm_pair()
    ours_full, ours_shared = (
        SparseLatentAttention.from_transformers(full),
        SparseLatentAttention.from_transformers(shared),
    )
    x, picks = torch.randn(1, 4, 32), torch.zeros(1, 4, 1, dtype=torch.long)
    with pytest.raises(ValueError, match="picks=None: this layer has no indexer"):
        ours_shared(x)
    with pytest.raises(ValueError, match="picks given to a layer with its own indexer"):
        ours_full(x, picks=picks)
    with pytest.raises(ValueError, match=r"cache must be a LatentCache.*got SparseLatentCache"):
        ours_shared(x, picks=picks, cache=SparseLatentCache(max_len=4))
    with pytest.raises(ValueError, match=r"masks.selected: indices .* must lie in \[-1, 4\)"):
        ours_shared(x, picks=picks + 4)
    with pytest.raises(ValueError, match="this layer shares another layer's picks"):
        ours_shared.select(x, torch.arange(4), None, None)
    with pytest.raises(ValueError, match="index_heads=2, index_head_dim=None, top_k=3: give all three"):
        SparseLatentAttention(
            index_heads=2, index_head_dim=None, top_k=3, hidden_size=32, num_heads=4, kv_lora_rank=16,
            qk_nope_head_dim=8, qk_rope_head_dim=0, v_head_dim=6, q_lora_rank=12,
        )  # fmt: skip


def test_benchmark_hook_runs_the_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """benchmarks/latent_sparse.py's DSA part gives its rows and targets at a tiny size (its speed is not tested)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "latent_sparse.py"
    spec = importlib.util.spec_from_file_location("benchmarks_latent_sparse", path)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setitem(script.DSA_SIZES, "n", 64)
    monkeypatch.setitem(script.DSA_SIZES, "top_k", 8)
    monkeypatch.setattr(script.bounds, "SQUARE", 128)
    timing = {"min_repeats": 1, "max_repeats": 1, "budget_s": 1.0, "warmup": 0}
    rows, targets, bound_rows = script.dsa_rows(timing, {}, 1)
    assert len(rows) == 2 and all(len(row) == len(script.DSA_HEADER) for row in rows)
    assert bound_rows and all(len(row) == len(script.BOUNDS_HEADER) for row in bound_rows)
    parts = " ".join(row[2] for row in bound_rows)
    assert "indexer, 64 heads" in parts and "indexer, 8 heads" in parts and "8 index heads" in parts
    assert (
        "sparse expanded (sparse selection)" in rows[0][1] and "(sparse selection)" in rows[1][1]
    )  # causal pairs counted: expanding is cheaper
    assert [t[0].split(" n=")[0].split(" after")[0] for t in targets] == ["DSA prefill forward", "DSA decoding"]


def test_mistral_large4_layer_equals_transformers() -> None:
    """Mistral Large 4's DSA layer (indexer from the normed hidden states, per-head log scaling, learned rotary).

    A rope layer and a NoPE layer (``no_rope_layers``), each with top-k 3 of 12 keys, equal
    transformers' own (eager, left-padded) to 1e-5; the picks decide the output.
    """
    modeling = importlib.import_module("transformers.models.mistral_large4.modeling_mistral_large4")
    sizes = {**SIZES, "num_hidden_layers": 2, "q_lora_rank": None}
    config = transformers.MistralLarge4TextConfig(
        **sizes, no_rope_layers=[1, 0], rope_parameters=dict(YARN, attention_factor=1.0)
    )
    config._attn_implementation = "eager"
    rotary = modeling.MistralLarge4TextRotaryEmbedding(config)
    x, attention_mask, position_ids = _inputs()
    padding, real = attention_mask == 0, attention_mask.bool()
    mask = masking_utils.create_causal_mask(config, x, attention_mask, None, position_ids=position_ids)
    torch.manual_seed(4)
    with torch.no_grad():
        rotary.alpha.copy_(0.3 * torch.randn(rotary.alpha.shape))
    for layer_idx in (0, 1):
        layer = modeling.MistralLarge4TextAttention(config, layer_idx).eval()
        with torch.no_grad():
            for name, param in layer.named_parameters():
                param.copy_(torch.randn(param.shape) * (0.3 if "norm" in name else param.shape[-1] ** -0.5 * 1.5))
                if "norm.weight" in name or "layernorm" in name or name.endswith("scaling.bias"):
                    param.add_(1.0)
            theirs = layer(
                x, rotary(x, position_ids), mask, transformers.cache_utils.KVSharingDict(), position_ids=position_ids
            )[0]
            ours = SparseLatentAttention.from_transformers(layer, rotary_embedding=rotary)
            assert ours.indexer is not None and ours.indexer.query_input == "hidden"
            assert ours.indexer.rope_dim == (4 if layer_idx == 0 else 0)
            got = ours(x, positions=position_ids, key_padding_mask=padding)
            dense = MultiHeadLatentAttention.from_transformers(layer, rotary_embedding=rotary)(
                x, positions=position_ids, key_padding_mask=padding
            )
        torch.testing.assert_close(got[real], theirs[real], atol=1e-5, rtol=0, msg=f"layer {layer_idx}")
        assert float((dense[real] - theirs[real]).abs().max()) > 1e-3  # the picks mattered
        if layer_idx == 0:  # the indexer alone, handed the model's rotary as transformers hands it
            visible = _visible(attention_mask, 0, LENGTH)
            with torch.no_grad():
                their_picks = layer.indexer(x, rotary(x, position_ids), mask[:, 0], position_ids)
                alone = LightningIndexer.from_transformers(layer.indexer)
                our_picks = alone(x, x, positions=position_ids, rotary=rotary(x, position_ids), key_padding=padding)
            assert _visible_sets(our_picks, visible) == _visible_sets(their_picks, visible)
