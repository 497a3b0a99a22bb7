"""Every family in selfattn's transformers table against transformers' own layer, run as its model runs it.

The families are read from ``selfattn.integrations.from_transformers.LAYERS`` at import, so a family
added there is tested here with no edit beyond its tiny config in tests/_hf_families.py (and a test
fails until that config exists). For each family and layer type: a left-padded batch of 3 (pads
0, 3, 1; length 7) through ``MultiHeadAttention.from_transformers(layer)`` as
``mha(x, x, x, causal=True, positions=position_ids, key_padding_mask=padding)`` and through the
layer with its rotary module and its masking_utils mask (eager, and sdpa where the family offers
it): outputs on the real rows, the input gradient and every parameter gradient of transformers'
layer, in float32 (1e-5) and float64 (1e-10); then a prefill of 3 tokens and one token at a time,
selfattn's KVCache against the layer's own DynamicCache; then the config round trip.

Which selfattn parameter is which transformers parameter is read from the loader itself: the layer's
parameters are set to distinct tags (8 + 4k), loaded, and each selfattn element is traced back to the
tag it holds (a copy: 8 + 4k; Gemma's ``1 + w``: 9 + 4k).

Shape legend:
    b: batch, l: tokens, d: hidden size.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import _hf_families as hf  # noqa: E402  (tests/ is on sys.path: tests/conftest.py)

from selfattn import KVCache, MultiHeadAttention  # noqa: E402
from selfattn.integrations.families import family_of_layer  # noqa: E402
from selfattn.integrations.from_transformers import LAYERS  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

TABLE = sorted(set(LAYERS.values()))  # the model_types selfattn loads


def _case(model_type: str, layer_idx: int) -> Any:
    return pytest.param(model_type, layer_idx, id=f"{model_type}-{layer_idx}")


_LAYERS = [(t, i) for t in TABLE if t in hf.FAMILIES for i in hf.FAMILIES[t].layers]
CASES = [_case(model_type, layer_idx) for model_type, layer_idx in _LAYERS]
ROUND_TRIP_CASES = CASES
PADS, LENGTH = (0, 3, 1), 7
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-10}
_TAG_START, _TAG_STEP = 8.0, 4.0  # tags 8 + 4k: a copy keeps the remainder 0, a (1 + w) weight makes it 1


def _inputs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``(b, l, d)`` and the attention mask ``(b, l)``: 1 for real tokens, left padding 0."""
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(len(PADS), LENGTH, 32, generator=generator, dtype=torch.float64).to(dtype)
    attention_mask = torch.ones(len(PADS), LENGTH, dtype=torch.long)
    for row, pad in enumerate(PADS):
        attention_mask[row, :pad] = 0
    return x, attention_mask


def _real_rows_loss(out: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """A fixed random weighting of the outputs on the real rows, summed: padded query rows (zeros in
    selfattn, a uniform average in eager) reach no gradient."""
    generator = torch.Generator().manual_seed(11)
    weights = torch.randn(out.shape, generator=generator, dtype=torch.float64).to(out.dtype)
    return (out * weights)[real].sum()


def _assert_grad_close(
    got: torch.Tensor, expected: torch.Tensor, tolerance: float, where: str, scale: torch.Tensor | None = None
) -> None:
    """Gradients sum many rows' terms: ``tolerance`` counts in units of the largest one (at least 1), or of
    the largest in ``scale`` (a gradient that cancels, as a key bias's nearly does, rounds at its terms' size)."""
    atol = tolerance * max(1.0, float(expected.abs().max()), 0.0 if scale is None else float(scale.abs().max()))
    torch.testing.assert_close(got, expected, atol=atol, rtol=0, msg=lambda m, where=where: f"{where}: {m}")


def _exact_frequencies(mha: Any, rotary: Any, config: Any, layer_idx: int) -> tuple[torch.Tensor, float] | None:
    """selfattn's float64 frequencies and attention factor, checked against transformers' float32 ones.

    transformers forms ``position * inv_freq`` in float32; the float64 comparison gives the layer
    angles formed from these float64 frequencies instead, after this check pins them to its own.
    """
    rotaries = [module for module in mha.modules() if isinstance(getattr(module, "inv_freq", None), torch.Tensor)]
    if not rotaries:
        return None  # a NoPE layer
    assert len(rotaries) == 1, f"selfattn's module has {len(rotaries)} rotary encodings; this test reads one"
    position = rotaries[0]
    ours, factor = position.inv_freq, float(getattr(position, "attention_factor", 1.0))
    theirs, scaling = hf.hf_frequencies(rotary, hf.layer_type(config, layer_idx))
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=1e-6, atol=0)
    assert abs(factor - scaling) <= 1e-6 * abs(scaling)
    return ours, factor


def _run_transformers(
    model_type: str, layer: Any, config: Any, rotary: Any, x: torch.Tensor, attention_mask: torch.Tensor, exact: Any
) -> torch.Tensor:
    """The layer's output ``(b, l, d)`` as its model computes it: its rotary, its mask, its attention function."""
    ids = hf.position_ids(attention_mask)
    positions = hf.rotary_positions(model_type, attention_mask)
    embeddings = hf.embeddings(model_type, rotary, config, layer.layer_idx, x, positions, exact)
    causal = hf.mask(config, layer.layer_idx, x, attention_mask, ids)
    with hf.float64_kept() if x.dtype == torch.float64 else contextlib.nullcontext():
        out, _ = layer(x, position_embeddings=embeddings, attention_mask=causal, **hf.forward_kwargs(layer, ids))
    return out


@functools.cache
def _sources(model_type: str, layer_idx: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """For each selfattn parameter: the flat index of the transformers element each of its elements was
    loaded from, and whether it was (``-1`` where it was not loaded from any)."""
    layer, _ = hf.build_layer(model_type, layer_idx, torch.float64)
    with torch.no_grad():
        start = 0
        for param in layer.parameters():
            tags = _TAG_START + _TAG_STEP * torch.arange(start, start + param.numel(), dtype=torch.float64)
            param.copy_(tags.view(param.shape))
            start += param.numel()
    mha = MultiHeadAttention.from_transformers(layer)
    sources = {}
    for name, param in mha.named_parameters():
        steps = (param.detach().double() - _TAG_START) / _TAG_STEP
        index = steps.floor()
        traced = (index >= 0) & (index < start) & torch.isin(steps - index, torch.tensor([0.0, 0.25]))
        sources[name] = (torch.where(traced, index, -1).long().flatten(), param.detach().flatten())
    return sources


def _check_parameter_grads(model_type: str, layer: Any, mha: Any, atol: float, where: str) -> None:
    """Every transformers parameter's gradient equals the sum of the gradients of the selfattn elements
    loaded from it; a selfattn parameter loaded from nothing may only be an identity norm weight."""
    sources = _sources(model_type, layer.layer_idx)
    hf_params = list(layer.named_parameters())
    total = sum(param.numel() for _, param in hf_params)
    expected = torch.zeros(total, dtype=torch.float64)
    covered = torch.zeros(total, dtype=torch.bool)
    for name, param in mha.named_parameters():
        index, tagged_values = sources[name]
        traced = index >= 0
        if not bool(traced.any()):
            assert name.endswith("norm.weight") and bool((tagged_values == 1).all()), f"selfattn {name} is not loaded"
            continue
        assert bool(traced.all()), f"selfattn {name}: some elements are not loaded from the layer"
        assert param.grad is not None, f"selfattn {name} has no gradient"
        expected.index_add_(0, index, param.grad.flatten().double())
        covered[index] = True
    start = 0
    for name, param in hf_params:
        stop = start + param.numel()
        assert bool(covered[start:stop].all()), f"transformers {name} is not (wholly) loaded into selfattn"
        assert param.grad is not None, f"transformers {name} has no gradient"
        got = param.grad.flatten().double()
        _assert_grad_close(got, expected[start:stop], atol, f"{where}: grad of {name}", scale=expected)
        start = stop


def _implementations(model_type: str, dtype: torch.dtype) -> list[str]:
    return ["eager", "sdpa"] if hf.supports_sdpa(model_type) else ["eager"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize(("model_type", "layer_idx"), CASES)
def test_outputs_and_gradients(model_type: str, layer_idx: int, dtype: torch.dtype) -> None:
    layer, config = hf.build_layer(model_type, layer_idx, dtype)
    rotary = hf.build_rotary(model_type, config)
    mha = MultiHeadAttention.from_transformers(layer)
    x, attention_mask = _inputs(dtype)
    real, padding = attention_mask.bool(), attention_mask == 0
    exact = _exact_frequencies(mha, rotary, config, layer_idx) if dtype == torch.float64 else None
    atol = TOLERANCE[dtype]

    ours_x = x.clone().requires_grad_(True)
    ours = mha(
        ours_x,
        ours_x,
        ours_x,
        causal=True,
        positions=hf.selfattn_positions(model_type, layer, attention_mask),
        key_padding_mask=padding,
    )
    assert isinstance(ours, torch.Tensor)
    _real_rows_loss(ours, real).backward()
    for implementation in _implementations(model_type, dtype):
        config._attn_implementation = implementation
        layer.zero_grad()
        theirs_x = x.clone().requires_grad_(True)
        theirs = _run_transformers(model_type, layer, config, rotary, theirs_x, attention_mask, exact)
        _real_rows_loss(theirs, real).backward()
        where = f"{model_type} layer {layer_idx} {implementation} {dtype}"
        torch.testing.assert_close(
            ours[real], theirs[real], atol=atol, rtol=0, msg=lambda m, where=where: f"{where}: {m}"
        )
        assert ours_x.grad is not None and theirs_x.grad is not None
        _assert_grad_close(ours_x.grad, theirs_x.grad, atol, f"{where}: input gradient")
        _check_parameter_grads(model_type, layer, mha, atol, where)


STEPS = [(0, 3)] + [(t, t + 1) for t in range(3, LENGTH)]  # a prefill of 3 tokens, then one at a time


def _decode_transformers(
    model_type: str, layer: Any, config: Any, rotary: Any, x: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """The layer's outputs ``(b, l, d)`` over :data:`STEPS` with its own DynamicCache, as generate runs it."""
    ids, positions = hf.position_ids(attention_mask), hf.rotary_positions(model_type, attention_mask)
    cache, steps = transformers.DynamicCache(config=config), []
    with torch.no_grad():
        for start, stop in STEPS:
            chunk = x[:, start:stop]
            embeddings = hf.embeddings(model_type, rotary, config, layer.layer_idx, chunk, positions[..., start:stop])
            causal = hf.mask(config, layer.layer_idx, chunk, attention_mask[:, :stop], ids[:, start:stop], cache)
            out, _ = layer(
                chunk,
                position_embeddings=embeddings,
                attention_mask=causal,
                cache=cache,
                **hf.forward_kwargs(layer, ids[:, start:stop]),
            )
            steps.append(out)
    return torch.cat(steps, dim=1)


@pytest.mark.parametrize(("model_type", "layer_idx"), CASES)
def test_cached_decoding(model_type: str, layer_idx: int) -> None:
    """A prefill of 3 tokens, then one at a time: selfattn's KVCache against the layer's own DynamicCache."""
    layer, config = hf.build_layer(model_type, layer_idx, torch.float32)
    mha = MultiHeadAttention.from_transformers(layer)
    x, attention_mask = _inputs(torch.float32)
    positions, padding = hf.selfattn_positions(model_type, layer, attention_mask), attention_mask == 0
    cache, steps = KVCache(max_len=LENGTH), []
    with torch.no_grad():
        for start, stop in STEPS:
            chunk = x[:, start:stop]
            out = mha(
                chunk,
                chunk,
                chunk,
                causal=True,
                cache=cache,
                positions=positions[..., start:stop],
                key_padding_mask=padding[:, start:stop],
            )
            steps.append(out)
    theirs = _decode_transformers(model_type, layer, config, hf.build_rotary(model_type, config), x, attention_mask)
    ours, real = torch.cat(steps, dim=1), attention_mask.bool()
    torch.testing.assert_close(ours[real], theirs[real], atol=1e-5, rtol=0)


def _weights_for(layer: Any, rebuilt: Any) -> dict[str, torch.Tensor]:
    """``layer``'s state dict for ``rebuilt``, which may be another family's layer: a QK-norm stored as ``w``
    for a ``(1 + w)`` RMSNorm (Gemma, Step-3.7) is stored as ``1 + w`` for a ``w`` one (LFM3), and back."""
    source, target = family_of_layer(layer), family_of_layer(rebuilt)
    shift = float(source.norm_plus_one) - float(target.norm_plus_one)
    names = {f"{name}.weight" for name in source.norm_names} if source.qk_norm is not None else set()
    return {key: value + shift if key in names else value for key, value in layer.state_dict().items()}


# The families whose layer is another entry's (same class body, same config fields): their entries are not
# targets of the way back, and a module loaded from one is written as the sibling. Every other family in the
# table is written as itself.
SIBLINGS = {
    "qwen2_5_vl_text": "qwen2_vl_text",
    "qwen3_5_moe_text": "qwen3_5_text",
    "hunyuan_v1_moe": "hunyuan_v1_dense",
    "flex_olmo": "olmo2",
}
# Not a sibling, a gap left for its owner: Cohere 2's full layers are NoPE, and its entry does not express
# "no rotary", so a module loaded from one is written as Llama 4's NoPE layer (which computes the same).
WRITTEN_AS_ANOTHER: dict[tuple[str, int], str] = {}


@pytest.mark.parametrize(("model_type", "layer_idx"), ROUND_TRIP_CASES)
def test_config_round_trip(model_type: str, layer_idx: int) -> None:
    """to_transformers_config -> AutoConfig.for_model -> the same family's layer (or its sibling's), the weights
    copied, equals the module."""
    layer, _ = hf.build_layer(model_type, layer_idx, torch.float32)
    mha = MultiHeadAttention.from_transformers(layer)
    fields = mha.to_transformers_config()  # every family goes back: a refusal fails here
    expected_type = WRITTEN_AS_ANOTHER.get((model_type, layer_idx), SIBLINGS.get(model_type, model_type))
    assert fields["model_type"] == expected_type, "written as another family"
    rebuilt_config = transformers.AutoConfig.for_model(**fields)
    rebuilt_config._attn_implementation = "eager"
    rebuilt, _ = hf.build_layer(fields["model_type"], 0, torch.float32, config=rebuilt_config)
    rebuilt.load_state_dict(_weights_for(layer, rebuilt))
    x, attention_mask = _inputs(torch.float32)
    rotary = hf.build_rotary(fields["model_type"], rebuilt_config)
    with torch.no_grad():
        expected = _run_transformers(fields["model_type"], rebuilt, rebuilt_config, rotary, x, attention_mask, None)
        got = mha(
            x,
            x,
            x,
            causal=True,
            positions=hf.selfattn_positions(model_type, layer, attention_mask),
            key_padding_mask=attention_mask == 0,
        )
    real = attention_mask.bool()
    torch.testing.assert_close(got[real], expected[real], atol=1e-5, rtol=0)


def test_every_family_in_the_table_has_a_config() -> None:
    """A family added to selfattn's table without a tiny config here would go untested: that fails."""
    missing = sorted(set(TABLE) - set(hf.FAMILIES))
    assert not missing, f"add these model_types to tests/_hf_families.py FAMILIES: {missing}"
    for attention, model_type in LAYERS.items():
        family = hf.FAMILIES[model_type]
        assert family.attention == attention, f"{model_type}: the table says {attention}, the config {family.attention}"
        assert hf.build_config(model_type).model_type == model_type


_ALL = os.environ.get("SELFATTN_ALL_FAMILIES") == "1"


@pytest.mark.skipif(not _ALL, reason="SELFATTN_ALL_FAMILIES=1 runs every family's transformers layer (~30 s)")
@pytest.mark.parametrize("model_type", sorted(set(hf.FAMILIES) - set(TABLE)))
def test_families_not_yet_in_the_table_run(model_type: str) -> None:
    """The configs waiting for a recipe build, and their layers run as the harness runs them: whole, and
    cached (which must agree, so the harness's masks, positions and arguments fit the family)."""
    config = hf.build_config(model_type)
    assert config.model_type == model_type
    rotary = hf.build_rotary(model_type, config)
    x, attention_mask = _inputs(torch.float32)
    for layer_idx in hf.FAMILIES[model_type].layers:
        layer, _ = hf.build_layer(model_type, layer_idx, torch.float32, config=copy.deepcopy(config))
        with torch.no_grad():
            out = _run_transformers(model_type, layer, config, rotary, x, attention_mask, None)
        decoded = _decode_transformers(model_type, layer, config, rotary, x, attention_mask)
        real = attention_mask.bool()
        assert out.shape == x.shape and bool(out[real].isfinite().all())
        torch.testing.assert_close(decoded[real], out[real], atol=1e-5, rtol=0)


def test_gemma3_ignores_its_softcap_field() -> None:
    """A Gemma 3 config with attn_logit_softcapping set: transformers' layer computes no softcap."""
    config = hf.build_config("gemma3_text", attn_logit_softcapping=2.0)
    layer, _ = hf.build_layer("gemma3_text", 0, torch.float32, config=config)
    mha = MultiHeadAttention.from_transformers(layer)
    x, attention_mask = _inputs(torch.float32)
    rotary = hf.build_rotary("gemma3_text", config)
    with torch.no_grad():
        expected = _run_transformers("gemma3_text", layer, config, rotary, x, attention_mask, None)
        got = mha(x, x, x, causal=True, positions=hf.position_ids(attention_mask), key_padding_mask=attention_mask == 0)
    real = attention_mask.bool()
    torch.testing.assert_close(got[real], expected[real], atol=1e-5, rtol=0)


MODULES: dict[str, dict[str, Any]] = {
    "window only": dict(window=3),
    "window and sinks": dict(window=3, sinks=True),
    "a bias on q, k, v only": dict(bias=True, output_bias=False, window=3),
    "QK-norm over the projection": dict(parts={"q_norm": "query_features", "k_norm": "key_features"}),
    "QK-norm and a window": dict(qk_norm=True, window=3),
    "query scaling by position": dict(parts={"query_scaling": "log floor"}, window=5),
}


def _module(options: dict[str, Any]) -> MultiHeadAttention:
    from selfattn.parts import HeadNorm, LogFloorScaling
    from selfattn.positional import RotaryPositionalEncoding

    options = dict(options)
    parts = {}
    for name, kind in options.pop("parts", {}).items():
        size = 32 if kind == "query_features" else 16
        parts[name] = LogFloorScaling(0.3, 16) if kind == "log floor" else HeadNorm(size, slot=kind)
    return MultiHeadAttention(32, 4, num_kv_heads=2, position=RotaryPositionalEncoding(8, interleaved=False),
                              parts=parts, **options)  # fmt: skip


@pytest.mark.parametrize("name", list(MODULES))
def test_a_module_written_as_a_config_loads_back_with_the_same_recipe(name: str) -> None:
    """module -> config -> transformers layer -> module: the same parts, options and sizes (weights aside).

    A config that named a family whose layer does more (Qwen3's QK-norm for a window-only module)
    would load back with a part the module lacks.
    """
    mha = _module(MODULES[name])
    fields = mha.to_transformers_config()
    config = transformers.AutoConfig.for_model(**fields)
    config._attn_implementation = "eager"
    layer, _ = hf.build_layer(fields["model_type"], 0, torch.float32, config=config)
    back = MultiHeadAttention.from_transformers(layer)
    assert back.describe_parts() == mha.describe_parts(), fields["model_type"]
    assert back.extra_repr() == mha.extra_repr(), fields["model_type"]
    assert repr(back.position) == repr(mha.position)


def test_a_projection_of_another_size_is_refused_not_left_random() -> None:
    """A layer whose o_proj reads more features than its heads give: the loader must not skip the copy."""
    layer, _ = hf.build_layer("llama", 0, torch.float32)
    layer.o_proj = torch.nn.Linear(layer.o_proj.in_features + 8, layer.o_proj.out_features, bias=False)
    with pytest.raises(ValueError, match=r"layer 0: W_o is \(32, 32\) but the layer's is \(32, 40\)"):
        MultiHeadAttention.from_transformers(layer)
