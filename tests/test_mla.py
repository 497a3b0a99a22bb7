"""MultiHeadLatentAttention on its own: the float64 formulas, expanded == absorbed, LatentCache, explain, bad input."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from reference_mla import mla_reference, yarn_frequencies

import selfattn.masks as masks
from selfattn import KVCache
from selfattn.core import dispatch
from selfattn.latent import LatentCache, MultiHeadLatentAttention, choose_computation, latent_attention
from selfattn.latent.functional import describe_latent, latent_visibility
from selfattn.positional.rotary import RotaryPositionalEncoding

YARN = dict(
    rope_type="yarn", factor=4.0, original_max_position_embeddings=16, beta_fast=32.0, beta_slow=1.0, mscale=0.707,
    mscale_all_dim=1.0,
)  # fmt: skip
SIZES = dict(hidden_size=32, num_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, v_head_dim=6)

# variant -> the layer's options beyond SIZES
VARIANTS: dict[str, dict[str, Any]] = {
    "deepseek": dict(q_lora_rank=12, qk_rope_head_dim=4, bias=True, split_rotated_pairs=True),
    "half_split": dict(qk_rope_head_dim=4, query_scaling=(0.5, 2.0), lora_scales=(1.3, 0.8)),
    "nope": dict(q_lora_rank=12, qk_rope_head_dim=0),
}


def _layer(variant: str, dtype: torch.dtype = torch.float64, **overrides: Any) -> MultiHeadLatentAttention:
    options = {**SIZES, **VARIANTS[variant], **overrides}
    rope = options["qk_rope_head_dim"]
    if rope:
        interleaved = variant == "deepseek"
        options["position"] = RotaryPositionalEncoding(rope, 10000.0, interleaved, scaling=dict(YARN))
    torch.manual_seed(1)
    layer = MultiHeadLatentAttention(**options, dtype=dtype)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.3 * torch.randn(param.shape))
            else:
                param.copy_(torch.randn(param.shape) * param.shape[-1] ** -0.5 * 1.5)
    return layer


def _inputs(dtype: torch.dtype = torch.float64, pads: tuple[int, ...] = (0, 3, 1), length: int = 7) -> Any:
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(len(pads), length, 32, generator=gen, dtype=torch.float64).to(dtype)
    padding = torch.zeros(len(pads), length, dtype=torch.bool)
    for row, pad in enumerate(pads):
        padding[row, :pad] = True
    positions = (~padding).long().cumsum(-1) - 1
    return x, positions.clamp(min=0), padding


def _sizes(layer: MultiHeadLatentAttention) -> dict[str, Any]:
    sizes: dict[str, Any] = dict(
        heads=layer.num_heads, rank=layer.kv_lora_rank, nope=layer.qk_nope_head_dim, rope=layer.qk_rope_head_dim,
        value=layer.v_head_dim, eps=layer.kv_a_layernorm.eps, scale=layer.scale,
        query_scaling=layer.query_scaling, lora_scales=layer.lora_scales,
        interleaved=layer.position is not None and layer.position.interleaved,
    )  # fmt: skip
    frequencies, factor = yarn_frequencies(layer.qk_rope_head_dim, dict(YARN, rope_theta=10000.0))
    sizes.update(frequencies=frequencies, attention_factor=factor)
    return sizes


@pytest.mark.parametrize("computation", ["expanded", "absorbed"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_equals_the_formulas_in_float64(variant: str, computation: str) -> None:
    """Left padding, causal, and a bool selection passed as ``mask``: the layer equals the formulas to 1e-10."""
    layer = _layer(variant)
    x, positions, padding = _inputs()
    selection = torch.rand(3, 7, 7, generator=torch.Generator().manual_seed(2)) < 0.6
    selection |= torch.eye(7, dtype=torch.bool)  # each query keeps itself
    with torch.no_grad():
        got = layer(x, positions=positions, key_padding_mask=padding, mask=selection, computation=computation)
    causal = torch.ones(7, 7, dtype=torch.bool).tril()
    visible = causal & ~padding[:, None, :] & selection
    expected = mla_reference(layer.state_dict(), x, positions, visible, _sizes(layer))
    real = ~padding
    worst = float((got[real] - expected[real]).abs().max())
    print(f"{variant} {computation}: {worst:.1e} against the float64 formulas")
    assert worst <= 1e-10


def _run_with_grads(layer: MultiHeadLatentAttention, x: torch.Tensor, **kwargs: Any) -> dict[str, torch.Tensor]:
    layer.zero_grad()
    x = x.clone().requires_grad_(True)
    out = layer(x, **kwargs)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(out.dtype)
    (out * weights).sum().backward()
    grads = {name: p.grad.clone() for name, p in layer.named_parameters()}  # type: ignore[union-attr]
    return {"output": out.detach(), "input": x.grad.clone(), **grads}  # type: ignore[union-attr]


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.float64, 1e-12)])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_absorbed_equals_expanded(variant: str, dtype: torch.dtype, tolerance: float) -> None:
    """Outputs, the input's gradient and every parameter's gradient, on real rows of a left-padded batch."""
    layer = _layer(variant, dtype)
    x, positions, padding = _inputs(dtype, pads=(0, 0, 0))
    expanded = _run_with_grads(layer, x, positions=positions, key_padding_mask=padding, computation="expanded")
    absorbed = _run_with_grads(layer, x, positions=positions, key_padding_mask=padding, computation="absorbed")
    for name, value in expanded.items():
        size = max(float(value.abs().max()), 1.0)
        assert float((absorbed[name] - value).abs().max()) / size <= tolerance, name


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("variant", ["deepseek", "half_split"])
def test_decoding_with_the_latent_cache_equals_the_full_pass(variant: str, window: int | None) -> None:
    layer = _layer(variant, window=window)
    x, positions, padding = _inputs()
    with torch.no_grad():
        full = layer(x, positions=positions, key_padding_mask=padding)
        cache = LatentCache(max_len=None if window else 7, window=window)
        steps = [layer(x[:, :3], positions=positions[:, :3], key_padding_mask=padding[:, :3], cache=cache)]
        for t in range(3, 7):
            cut = slice(t, t + 1)
            steps.append(layer(x[:, cut], positions=positions[:, cut], key_padding_mask=padding[:, cut], cache=cache))
    real = ~padding
    assert float((torch.cat(steps, dim=1)[real] - full[real]).abs().max()) <= 1e-12
    assert cache.length == 7
    assert cache.stored == (2 if window else 7)


def test_default_positions_count_from_the_cache() -> None:
    layer = _layer("deepseek")
    x, _, _ = _inputs(pads=(0, 0, 0))
    with torch.no_grad():
        full = layer(x)
        cache = LatentCache(max_len=7)
        steps = [layer(x[:, t : t + 1], cache=cache) for t in range(7)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-12, rtol=0)


def test_cache_bytes_per_token() -> None:
    """576 numbers per token for DeepSeek-V3's sizes (512 latent + 64 rope), however many heads."""
    cache = LatentCache(max_len=10)
    assert cache.nbytes == 0 and cache.bytes_per_token == 0
    cache.update(torch.zeros(2, 1, 3, 512), torch.zeros(2, 1, 3, 64))
    assert cache.bytes_per_token == 576 * 4
    assert cache.nbytes == 2 * 10 * 576 * 4
    assert cache.length == 3


def test_a_failed_call_leaves_the_cache_as_it_was() -> None:
    layer = _layer("deepseek")
    x, _, _ = _inputs(pads=(0, 0, 0))
    with torch.no_grad():
        full = layer(x)
        cache = LatentCache(max_len=7)
        first = layer(x[:, :4], cache=cache)
        with pytest.raises(ValueError, match=r"must have one column per key seen \(5\)"):
            layer(x[:, 4:5], cache=cache, mask=torch.ones(1, 2, 2, dtype=torch.bool))  # a mask of the wrong size
        assert cache.length == 4
        rest = [layer(x[:, t : t + 1], cache=cache) for t in range(4, 7)]
    torch.testing.assert_close(torch.cat([first, *rest], dim=1), full, atol=1e-12, rtol=0)


def test_a_mask_has_a_column_per_key_seen_or_one() -> None:
    """A mask wider than the keys seen was cut to its first columns, silently (0.37 off its right-aligned columns);
    a mask of one column broadcasts, also once a windowed cache has dropped keys."""
    x, _, _ = _inputs(pads=(0, 0, 0), length=6)
    wide = torch.rand(6, 9, generator=torch.Generator().manual_seed(0)) > 0.5
    with pytest.raises(ValueError, match=r"mask of shape \(6, 9\) must have one column per key seen \(6\)"):
        _layer("deepseek")(x, mask=wide)
    layer = _layer("deepseek", window=3)
    with torch.no_grad():
        plain, broadcast = LatentCache(window=3), LatentCache(window=3)
        for t in range(6):
            step = x[:, t : t + 1]
            expected = layer(step, cache=plain)
            torch.testing.assert_close(layer(step, cache=broadcast, mask=torch.ones(1, 1, dtype=torch.bool)), expected)
        with pytest.raises(ValueError, match=r"mask of shape \(1, 2\) must have one column per key seen \(7\)"):
            layer(x[:, :1], cache=broadcast, mask=torch.ones(1, 2, dtype=torch.bool))


def test_explain_names_the_computation_and_the_route() -> None:
    layer = _layer("deepseek")
    x, _, _ = _inputs(pads=(0, 0, 0))
    prefill = layer.explain(x)
    assert prefill.computation == "expanded" and prefill.route
    cache = LatentCache(max_len=8)
    with torch.no_grad():
        layer(x, cache=cache)
    step = layer.explain(x[:, :1], cache=cache)
    assert step.computation == "absorbed"
    assert "absorbed" in str(step) and f"route: {step.route}" in str(step)
    assert cache.length == 7  # explain copied the cache
    assert layer.explain(x, computation="absorbed").computation == "absorbed"


def test_choose_computation_by_sizes() -> None:
    """DeepSeek-V3's sizes: absorbing wins for few queries, expanding for a long prefill."""
    v3 = dict(heads=128, rank=512, nope=128, rope=64, value=128)
    assert choose_computation("auto", 1, 16384, **v3)[0] == "absorbed"
    assert choose_computation("auto", 100, 4096, **v3)[0] == "absorbed"
    assert choose_computation("auto", 4096, 4096, **v3)[0] == "expanded"
    assert choose_computation("expanded", 1, 16384, **v3)[0] == "expanded"


def test_choose_computation_with_a_top_k_selection() -> None:
    """Absorbed attends to the picks only (at twice a dense multiply-add each); expanded, to every key, masked.

    A quarter of the keys (top-k 2048 of 8192), absorbed on the sparse route, measured 3.9x slower
    than the dense causal layer (the masked pass expanded takes costs about twice the causal one), so
    expanding wins; at 16384 keys and past, the picks' share is small enough for absorbing.
    """
    v3 = dict(heads=16, rank=512, nope=128, rope=64, value=128)
    assert choose_computation("auto", 8192, 8192, **v3, picks=2048)[0] == "expanded"
    chosen, reason = choose_computation("auto", 16384, 16384, **v3, picks=2048)
    assert chosen == "absorbed" and "2048 selected keys per query" in reason
    assert choose_computation("auto", 32768, 32768, **v3, picks=2048)[0] == "absorbed"


def test_a_causal_selection_counts_the_expanded_pass_in_causal_blocks() -> None:
    """A causal selection's expanded pass runs in blocks that skip the hidden half: its causal pairs are counted.

    Measured at n=4096, top-k 512, 16 heads (one thread): expanded in causal blocks 8.8-10.3 s,
    absorbed on the sparse route 12.4-13.6 s; counting every pair chose absorbed.
    """
    v3 = dict(heads=16, rank=512, nope=128, rope=64, value=128)
    assert choose_computation("auto", 4096, 4096, **v3, picks=512)[0] == "absorbed"  # every pair counted
    causal_pairs = 4096 * 4097 // 2
    assert choose_computation("auto", 4096, 4096, **v3, picks=512, pairs=causal_pairs)[0] == "expanded"
    layer = _layer("deepseek", num_heads=8, q_lora_rank=12)
    x = torch.randn(1, 80, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    earlier = torch.rand(80, 80, generator=torch.Generator().manual_seed(4)) - torch.ones(80, 80).triu(1) * 2
    top, picks = earlier.topk(12, dim=-1)
    selection = masks.selected(torch.where(top >= 0, picks, -1)[None])
    explained = layer.explain(x, mask=selection)
    reason = f"expanded {80 * 16 * 8 * 14 + 80 * 81 // 2 * 8 * 18:,} vs absorbed"
    assert explained.computation == "expanded" and reason in explained.reason, str(explained)  # was absorbed
    expanded, absorbed = layer(x, mask=selection), layer(x, mask=selection, computation="absorbed")
    torch.testing.assert_close(expanded, absorbed, atol=1e-10, rtol=0)


def test_absorbed_sparse_pass_weighs_the_latent_only() -> None:
    """On the "sparse selection" route the absorbed values are the latent ``c`` (``r`` wide), not ``[c, k_rope]``.

    A dense absorbed pass takes the whole latent key as the value (equal head sizes for PyTorch's
    flash kernel) and drops the last ``dr`` outputs; the sparse route gathers the key rows once and
    reads the values from them, so computing the dropped ``dr`` outputs is waste (64 of 576 in
    DeepSeek's sizes). The output equals the expanded dense masked pass in float64.
    """
    heads, length, rank, rope, nope, value, picked = 8, 80, 6, 2, 3, 4, 3
    gen = torch.Generator().manual_seed(7)
    q_nope, q_rope = (torch.randn(1, heads, length, size, generator=gen, dtype=torch.float64) for size in (nope, rope))
    latent_key = torch.randn(1, 1, length, rank + rope, generator=gen, dtype=torch.float64)
    kv_b_weight = torch.randn(heads * (nope + value), rank, generator=gen, dtype=torch.float64)
    earlier = torch.rand(length, length, generator=gen).masked_fill(torch.ones(length, length).triu(1) > 0, -1.0)
    top, picks = earlier.topk(picked, dim=-1)
    picks = torch.where(top >= 0, picks, -1)[None]
    visibility = latent_visibility(length, length, causal=True, mask=masks.selected(picks))
    arguments = (q_nope, q_rope, latent_key, kv_b_weight, visibility)
    plan = describe_latent(*arguments, scale=0.3)
    assert plan.computation == "absorbed" and dispatch.explain(plan.call).route == "sparse selection"
    assert plan.call.value_dim == rank and plan.call.v.shape[-1] == rank  # was rank + rope
    assert plan.call.v.data_ptr() == latent_key.data_ptr()  # a view: no copy of the latent
    dense = latent_visibility(length, length, causal=True)
    dense_plan = describe_latent(*arguments[:4], dense, scale=0.3, computation="absorbed")
    assert dense_plan.call.value_dim == rank + rope  # the dense pass keeps equal sizes for the flash kernel
    got = latent_attention(*arguments[:4], visibility=visibility, scale=0.3)
    expected = latent_attention(*arguments[:4], visibility=visibility, scale=0.3, computation="expanded")
    torch.testing.assert_close(got, expected, atol=1e-10, rtol=0)


def test_functional_mask_rule_equals_bool_mask() -> None:
    gen = torch.Generator().manual_seed(0)
    q_nope, q_rope = torch.randn(2, 4, 5, 8, generator=gen), torch.randn(2, 4, 5, 4, generator=gen)
    latent_key, weight = torch.randn(2, 1, 5, 20, generator=gen), torch.randn(4 * 14, 16, generator=gen)
    rule = masks.causal() & masks.window(2)
    dense = torch.ones(5, 5, dtype=torch.bool).tril() & ~torch.ones(5, 5, dtype=torch.bool).tril(-2)
    for computation in ("expanded", "absorbed"):
        by_rule = latent_attention(q_nope, q_rope, latent_key, weight, scale=0.2, mask=rule, computation=computation)
        by_mask = latent_attention(q_nope, q_rope, latent_key, weight, scale=0.2, mask=dense, computation=computation)
        torch.testing.assert_close(by_rule, by_mask, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(hidden_size=0), "hidden_size"),
        (dict(kv_lora_rank=-1), "kv_lora_rank"),
        (dict(qk_rope_head_dim=3, position=None), "qk_rope_head_dim must be even"),
        (dict(qk_rope_head_dim=4, position=None), "a rotary needs rope features"),
        (dict(position=RotaryPositionalEncoding(8)), "head_dim=8.*qk_rope_head_dim=4"),
        (
            dict(
                position=RotaryPositionalEncoding(
                    4, scaling={"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 8}
                )
            ),
            "changes with the length",
        ),
        (dict(computation="fast"), "computation must be one of"),
        (dict(query_scaling=(0.1, 0.0)), r"query_scaling\[1\]"),
        (dict(lora_scales=(1.0,)), "lora_scales must be a pair"),
        (dict(scale=float("nan")), "scale"),
        (dict(window=0), "window"),
    ],
)
def test_constructor_errors(overrides: dict[str, Any], message: str) -> None:
    options: dict[str, Any] = {**SIZES, "qk_rope_head_dim": 4, "position": RotaryPositionalEncoding(4)}
    with pytest.raises(ValueError, match=message):
        MultiHeadLatentAttention(**{**options, **overrides})


def test_forward_errors() -> None:
    layer = _layer("deepseek")
    x = torch.randn(2, 3, 32, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"x must have shape \(b, l, 32\)"):
        layer(torch.randn(2, 3, 31, dtype=torch.float64))
    with pytest.raises(ValueError, match="positions must be an integer tensor"):
        layer(x, positions=torch.arange(3.0))
    with pytest.raises(ValueError, match=r"positions must have shape \(3,\) or \(2, 3\)"):
        layer(x, positions=torch.arange(4))
    with pytest.raises(ValueError, match="key_padding_mask must be a bool tensor"):
        layer(x, key_padding_mask=torch.zeros(2, 3))
    with pytest.raises(ValueError, match="cache is a KVCache"):
        layer(x, cache=KVCache(max_len=3))
    with pytest.raises(ValueError, match="cache must be a LatentCache, got dict"):
        layer(x, cache={})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="causal"):
        layer(x, causal=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"mask must be a selfattn\.masks rule or a bool tensor"):
        layer(x, mask="causal")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cache keeps only a window of 2"):
        layer(x, cache=LatentCache(window=2))


def test_cache_errors() -> None:
    cache = LatentCache(max_len=4)
    with pytest.raises(ValueError, match="max_len"):
        LatentCache()
    with pytest.raises(ValueError, match=r"latent must have shape \(b, 1, l, features\)"):
        cache.update(torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 4))
    with pytest.raises(ValueError, match=r"k_rope .* does not fit latent"):
        cache.update(torch.zeros(1, 1, 3, 8), torch.zeros(1, 1, 2, 4))
    cache.update(torch.zeros(1, 1, 3, 8), torch.zeros(1, 1, 3, 4))
    with pytest.raises(ValueError, match="latent of 10 features does not fit a cache holding latents of 8"):
        cache.update(torch.zeros(1, 1, 1, 10), torch.zeros(1, 1, 1, 2))
    with pytest.raises(ValueError, match="cache overflow"):
        cache.update(torch.zeros(1, 1, 2, 8), torch.zeros(1, 1, 2, 4))
    assert cache.length == 3


def test_functional_errors() -> None:
    q_nope, q_rope = torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 4)
    weight = torch.randn(4 * 14, 16)
    with pytest.raises(ValueError, match=r"latent_key \(1, 1, 2, 16\) must be \(1, 1, lk, r \+ dr\)"):
        latent_attention(q_nope, q_rope, torch.randn(1, 1, 2, 16), weight, scale=0.1)
    with pytest.raises(ValueError, match="kv_b_weight"):
        latent_attention(q_nope, q_rope, torch.randn(1, 1, 2, 20), torch.randn(4 * 8, 16), scale=0.1)
    with pytest.raises(ValueError, match="scale"):
        latent_attention(q_nope, q_rope, torch.randn(1, 1, 2, 20), weight, scale=-1.0)
    with pytest.raises(ValueError, match="computation must be one of"):
        latent_attention(q_nope, q_rope, torch.randn(1, 1, 2, 20), weight, scale=0.1, computation="sparse")


def test_a_decoding_step_folds_its_heads_without_a_mask() -> None:
    """One query after the cache sees every key: the stacked heads' call has no rule (it had an all-True dense mask,
    rendered over every key at each step and read by the kernel); after a padded prompt the mask stays. Both equal
    the expanded computation."""
    layer = _layer("deepseek")
    rules: list[tuple[Any, ...]] = []
    for pads in ((0, 0, 0), (0, 3, 1)):
        x, positions, padding = _inputs(pads=pads, length=8)
        padding = padding if any(pads) else None  # no padding mask at all
        cache = LatentCache(max_len=8)
        step = dict(positions=positions[:, -1:], key_padding_mask=None if padding is None else padding[:, -1:])
        with torch.no_grad():
            layer(
                x[:, :7],
                positions=positions[:, :7],
                key_padding_mask=None if padding is None else padding[:, :7],
                cache=cache,
            )
            q_nope, q_rope = layer.project_queries(x[:, 7:], step["positions"])
            seen, visibility = layer._seen(
                x[:, 7:], step["positions"], step["key_padding_mask"], None, cache.copy(), True
            )
            plan = describe_latent(q_nope, q_rope, seen.latent_key, layer.kv_b_proj.weight, visibility, scale=0.1)
            assert plan.folded and plan.computation == "absorbed"
            rules.append(plan.call.visibility.rules)
            absorbed = layer(x[:, 7:], **step, cache=cache.copy(), computation="absorbed")
            expanded = layer(x[:, 7:], **step, cache=cache.copy(), computation="expanded")
        torch.testing.assert_close(absorbed, expanded, atol=1e-12, rtol=0)
    assert rules[0] == ()
    assert len(rules[1]) == 1  # the padded keys: a mask


@pytest.mark.parametrize("fold", [True, False])
def test_absorbed_with_and_without_folded_heads(fold: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Few queries stack the heads over one copy of the latent; more (or a mask per head) keep them apart: same numbers."""
    import selfattn.latent.functional as functional

    if not fold:
        monkeypatch.setattr(functional, "FOLD_MAX_QUERIES", 0)
    layer = _layer("deepseek")
    x, positions, padding = _inputs()
    per_head = torch.rand(3, 4, 7, 7, generator=torch.Generator().manual_seed(6)) < 0.7
    per_head |= torch.eye(7, dtype=torch.bool)
    with torch.no_grad():
        for mask in (None, per_head):
            options = dict(positions=positions, key_padding_mask=padding, mask=mask)
            expanded = layer(x, computation="expanded", **options)
            absorbed = layer(x, computation="absorbed", **options)
            torch.testing.assert_close(absorbed[~padding], expanded[~padding], atol=1e-12, rtol=0)
            stacked = "stacked as one head" in layer.explain(x, computation="absorbed", **options).reason
            assert stacked == (fold and mask is None)


def test_sink_tokens_keep_the_first_keys_beside_the_window() -> None:
    """StreamingLLM: token t sees keys j < 2 and t - 3 < j <= t, as a full pass with that mask."""
    layer = _layer("deepseek")
    x, _, _ = _inputs(pads=(0, 0, 0))
    index = torch.arange(7)
    kept = (index[None, :] < 2) | (index[None, :] > index[:, None] - 3)
    with torch.no_grad():
        full = layer(x, mask=kept)
        cache = LatentCache(window=3, sink_tokens=2)
        steps = [layer(x[:, t : t + 1], cache=cache) for t in range(7)]
        with pytest.raises(ValueError, match="sink_tokens=2: the cache dropped keys"):
            layer(x[:, :1], cache=cache, mask=masks.causal())
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-12, rtol=0)
    assert cache.stored == 4 and cache.length == 7
    with pytest.raises(ValueError, match="sink_tokens=2 drops the keys"):
        _layer("deepseek", window=3)(x[:, :1], cache=LatentCache(window=3, sink_tokens=2))


def test_scaled_frequency_rotary_checks_its_factors() -> None:
    from selfattn.latent.rotary import ScaledFrequencyRotary

    with pytest.raises(ValueError, match=r"multipliers must be \(2,\) finite positive factors"):
        ScaledFrequencyRotary(4, 10000.0, True, multipliers=torch.ones(3))
    with pytest.raises(ValueError, match="multipliers must be"):
        ScaledFrequencyRotary(4, 10000.0, True, multipliers=torch.tensor([1.0, 0.0]))
    doubled = ScaledFrequencyRotary(4, 10000.0, True, multipliers=torch.full((2,), 2.0))
    plain = RotaryPositionalEncoding(4, 10000.0, True)
    x = torch.randn(1, 1, 3, 4, dtype=torch.float64)
    torch.testing.assert_close(doubled(x, torch.arange(3)), plain(x, 2 * torch.arange(3)), atol=1e-12, rtol=0)
