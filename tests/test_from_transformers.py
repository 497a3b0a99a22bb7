"""MultiHeadAttention.from_transformers against transformers' own layers, rotary modules, masks and eager attention."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import masking_utils  # noqa: E402

from selfattn import KVCache, MultiHeadAttention  # noqa: E402
from selfattn.positional import NAMES  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

COMMON = dict(
    vocab_size=50,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
LAYERS = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=3)

# family -> (config class, its keyword arguments, attention class, rotary class, module path)
FAMILIES: dict[str, tuple[str, dict[str, Any], str, str, str]] = {
    "llama": (
        "LlamaConfig",
        dict(head_dim=8, attention_bias=True, rope_parameters=dict(
            rope_type="llama3", rope_theta=10000.0, factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=16,
        )),
        "LlamaAttention", "LlamaRotaryEmbedding", "llama",
    ),
    "qwen3": (
        "Qwen3Config", dict(head_dim=16, use_sliding_window=True, **LAYERS), "Qwen3Attention", "Qwen3RotaryEmbedding",
        "qwen3",
    ),
    "gemma2": (
        "Gemma2Config", dict(head_dim=16, query_pre_attn_scalar=10, attn_logit_softcapping=2.0, **LAYERS),
        "Gemma2Attention", "Gemma2RotaryEmbedding", "gemma2",
    ),
    "gemma3": (
        "Gemma3TextConfig",
        dict(head_dim=16, query_pre_attn_scalar=12, rope_parameters={
            "sliding_attention": dict(rope_type="default", rope_theta=100.0),
            "full_attention": dict(rope_type="linear", factor=4.0, rope_theta=10000.0),
        }, **LAYERS),
        "Gemma3Attention", "Gemma3RotaryEmbedding", "gemma3",
    ),
    "gpt_oss": (
        "GptOssConfig",
        dict(head_dim=16, num_local_experts=2, num_experts_per_tok=1, rope_parameters=dict(
            rope_type="yarn", rope_theta=150000.0, factor=4.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
            original_max_position_embeddings=16,
        ), **LAYERS),
        "GptOssAttention", "GptOssRotaryEmbedding", "gpt_oss",
    ),
    "llama4": (
        "Llama4TextConfig",
        dict(head_dim=8, intermediate_size_mlp=64, num_local_experts=2, no_rope_layers=[1, 0], attention_chunk_size=4,
             floor_scale=2, attn_scale=0.5, attention_bias=True),
        "Llama4TextAttention", "Llama4TextRotaryEmbedding", "llama4",
    ),
    "qwen3_next": (
        "Qwen3NextConfig",
        dict(head_dim=16, partial_rotary_factor=0.5, attention_bias=True, layer_types=["full_attention"] * 2),
        "Qwen3NextAttention", "Qwen3NextRotaryEmbedding", "qwen3_next",
    ),
    "qwen2_vl": (
        "Qwen2VLTextConfig", dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[1, 1, 2])),
        "Qwen2VLAttention", "Qwen2VLRotaryEmbedding", "qwen2_vl",
    ),
    "qwen2_5_vl": (
        "Qwen2_5_VLTextConfig",
        dict(rope_parameters=dict(rope_type="default", rope_theta=1000.0, mrope_section=[2, 1, 1])),
        "Qwen2_5_VLAttention", "Qwen2_5_VLRotaryEmbedding", "qwen2_5_vl",
    ),
}  # fmt: skip
MROPE = {"qwen2_vl", "qwen2_5_vl"}  # positions (3, b, l)
_NO_MROPE = pytest.mark.skipif("mrope" not in NAMES, reason="M-RoPE (build('mrope')) is not in this checkout")
CASES = [
    pytest.param(family, layer, marks=[_NO_MROPE] if family in MROPE else [])
    for family in FAMILIES
    for layer in (0, 1)
    if family not in ("qwen3_next", *MROPE) or layer == 0
]


def _layer(family: str, layer_idx: int, dtype: torch.dtype, **overrides: Any) -> tuple[Any, Any, Any]:
    """A transformers attention layer with random weights (norms and sinks included), its config and rotary."""
    config_name, kwargs, attention_name, rotary_name, module_name = FAMILIES[family]
    config = getattr(transformers, config_name)(**COMMON, **(kwargs | overrides))
    config._attn_implementation = "eager"
    modeling = importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}")
    torch.manual_seed(layer_idx)
    layer = getattr(modeling, attention_name)(config, layer_idx).eval()
    with torch.no_grad():
        for name, param in layer.named_parameters():
            param.copy_(torch.randn(param.shape) * (0.3 if "norm" in name else 1.0) * (2 if "sinks" in name else 1))
            if "proj.weight" in name:
                param.mul_(param.shape[-1] ** -0.5 * 1.5)  # scores of a few units: softcap and sinks matter
    rotary = getattr(modeling, rotary_name)(config)
    return layer.to(dtype), config, rotary


def _mask(config: Any, layer: Any, x: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor) -> Any:
    """The eager mask transformers builds for this layer's type."""
    layer_type = config.layer_types[layer.layer_idx] if getattr(config, "layer_types", None) else None
    make = {
        "sliding_attention": masking_utils.create_sliding_window_causal_mask,
        "chunked_attention": masking_utils.create_chunked_causal_mask,
    }.get(layer_type, masking_utils.create_causal_mask)
    return make(config, x, attention_mask, None, position_ids=position_ids, allow_is_causal_skip=False)


def _reference(layer: Any, config: Any, rotary: Any, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The layer's output the way transformers computes it: its rotary module, its mask, its eager attention."""
    position_ids = _position_ids(attention_mask)
    rotary_positions = _mrope_positions(attention_mask) if type(layer).__name__ in _MROPE_LAYERS else position_ids
    layer_type = config.layer_types[layer.layer_idx] if getattr(config, "layer_types", None) else None
    if type(rotary).__name__ == "Gemma3RotaryEmbedding":
        embeddings = rotary(x, position_ids, layer_type)
    else:
        embeddings = rotary(x, rotary_positions)
    with torch.no_grad():
        out, _ = layer(
            x, position_embeddings=embeddings, attention_mask=_mask(config, layer, x, attention_mask, position_ids)
        )
    return out


def _position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """As generate makes them: count the real tokens; padding gets position 1."""
    return (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)


_MROPE_LAYERS = ("Qwen2VLAttention", "Qwen2_5_VLAttention")


def _mrope_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """(3, b, l) positions whose time, height and width differ, as an image's tokens' do."""
    position_ids = _position_ids(attention_mask)
    return torch.stack((position_ids, (2 * position_ids) % 5, position_ids // 2))


def _inputs(dtype: torch.dtype, pads: tuple[int, ...] = (0, 3, 1), length: int = 7) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(len(pads), length, 32, generator=gen, dtype=torch.float64).to(dtype)
    attention_mask = torch.ones(len(pads), length, dtype=torch.long)
    for row, pad in enumerate(pads):
        attention_mask[row, :pad] = 0
    return x, attention_mask


def _selfattn_positions(layer: Any, attention_mask: torch.Tensor) -> torch.Tensor:
    """position_ids, except Llama 4's NoPE layers, whose temperature follows each token's index in the batch."""
    if type(layer).__name__ == "Llama4TextAttention" and not layer.use_rope:
        return torch.arange(attention_mask.shape[1]).expand_as(attention_mask)
    return _mrope_positions(attention_mask) if type(layer).__name__ in _MROPE_LAYERS else _position_ids(attention_mask)


def _check(family: str, layer_idx: int, dtype: torch.dtype, pads: tuple[int, ...] = (0, 3, 1)) -> float:
    layer, config, rotary = _layer(family, layer_idx, dtype)
    x, attention_mask = _inputs(dtype, pads)
    expected = _reference(layer, config, rotary, x, attention_mask)
    mha = MultiHeadAttention.from_transformers(layer)
    positions, padding = _selfattn_positions(layer, attention_mask), attention_mask == 0
    with torch.no_grad():
        got = mha(x, x, x, causal=True, positions=positions, key_padding_mask=padding)
        assert isinstance(got, torch.Tensor)
        # Cached decoding: a prefill of 3 tokens, then one token at a time.
        cache, steps = KVCache(max_len=x.shape[1]), []
        for start, stop in [(0, 3)] + [(t, t + 1) for t in range(3, x.shape[1])]:
            chunk = x[:, start:stop]
            steps.append(
                mha(chunk, chunk, chunk, causal=True, cache=cache, positions=positions[..., start:stop],
                    key_padding_mask=padding[:, start:stop])
            )  # fmt: skip
    decoded = torch.cat(steps, dim=1)
    real = attention_mask.bool()  # padded query rows: zeros here, a uniform average in eager
    torch.testing.assert_close(decoded[real], got[real], atol=1e-5, rtol=0)
    return float((got[real] - expected[real]).abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("family", "layer_idx"), CASES)
def test_equals_the_layer(family: str, layer_idx: int, dtype: torch.dtype) -> None:
    assert _check(family, layer_idx, dtype) <= 1e-5


@pytest.mark.parametrize(("family", "layer_idx"), CASES)
def test_config_round_trip(family: str, layer_idx: int) -> None:
    """A config from to_transformers_config, a layer built from it with the weights copied, equals the module."""
    layer, config, _ = _layer(family, layer_idx, torch.float32)
    mha = MultiHeadAttention.from_transformers(layer)
    fields = mha.to_transformers_config()
    assert fields["model_type"] == config.model_type.replace("qwen2_5_vl", "qwen2_vl")  # the same attention
    rebuilt_config = transformers.AutoConfig.for_model(**fields)
    rebuilt_config._attn_implementation = "eager"
    _, _, attention_name, rotary_name, module_name = FAMILIES[family]
    modeling = importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}")
    rebuilt = getattr(modeling, attention_name)(rebuilt_config, 0).eval()
    rebuilt.load_state_dict(layer.state_dict())
    x, attention_mask = _inputs(torch.float32, (0, 4, 0) if family == "llama4" else (0, 3, 1))
    expected = _reference(rebuilt, rebuilt_config, getattr(modeling, rotary_name)(rebuilt_config), x, attention_mask)
    with torch.no_grad():
        got = mha(x, x, x, causal=True, positions=_selfattn_positions(layer, attention_mask),
                  key_padding_mask=attention_mask == 0)  # fmt: skip
    real = attention_mask.bool()
    torch.testing.assert_close(got[real], expected[real], atol=1e-5, rtol=0)


@pytest.mark.parametrize("scaling", ["dynamic", "phi3 longrope"])
def test_a_length_dependent_scaling_keeps_its_trained_length_through_the_config(scaling: str) -> None:
    """to_transformers_config wrote no max_position_embeddings (dynamic's trained length in transformers) and no
    top-level original_max_position_embeddings (Phi-3's, default 4,096, which wins over the dict's): the rebuilt
    model's cos and sin were 2.0 and 2.3 off the original's past the trained length of 16."""
    from transformers.models.llama import modeling_llama
    from transformers.models.phi3 import modeling_phi3

    sizes = dict(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8)  # fmt: skip
    if scaling == "dynamic":
        rope = dict(rope_type="dynamic", factor=2.0, rope_theta=100.0)
        config, modeling, names = transformers.LlamaConfig(**sizes, max_position_embeddings=16, rope_parameters=rope), \
            modeling_llama, ("LlamaAttention", "LlamaRotaryEmbedding")  # fmt: skip
    else:
        rope = dict(rope_type="longrope", rope_theta=100.0, short_factor=[1.0] * 4, long_factor=[2.0, 3.0, 4.0, 5.0])
        config = transformers.Phi3Config(
            **sizes, max_position_embeddings=64, original_max_position_embeddings=16, rope_parameters=rope
        )
        modeling, names = modeling_phi3, ("Phi3Attention", "Phi3RotaryEmbedding")
    config._attn_implementation = "eager"
    mha = MultiHeadAttention.from_transformers(getattr(modeling, names[0])(config, 0))
    rebuilt = transformers.AutoConfig.for_model(**mha.to_transformers_config())
    x, positions = torch.zeros(1, 40, 32), torch.arange(40)[None]  # past the trained length
    for original, again in zip(getattr(modeling, names[1])(config)(x, positions),
                               getattr(modeling, names[1])(rebuilt)(x, positions), strict=True):  # fmt: skip
        torch.testing.assert_close(again, original, atol=0, rtol=0)
    frequencies, factor = mha.position.frequencies_at(40)
    reloaded = MultiHeadAttention.from_transformers(getattr(modeling, names[0])(rebuilt, 0)).position
    torch.testing.assert_close(reloaded.frequencies_at(40)[0], frequencies, atol=0, rtol=0)
    assert reloaded.frequencies_at(40)[1] == factor


def _float64_llama(layer: Any, x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """Llama attention written out in float64: exact angles p * base^(-2j/dh), half-split pairs, causal softmax."""
    weights = {name: t.detach().double() for name, t in layer.state_dict().items()}
    batch, length, _ = x.shape
    heads, kv_heads, dh = layer.config.num_attention_heads, layer.config.num_key_value_heads, layer.head_dim

    def project(name: str, count: int) -> torch.Tensor:
        out = x.double() @ weights[f"{name}.weight"].T + weights.get(f"{name}.bias", 0.0)
        return out.view(batch, length, count, dh).transpose(1, 2)  # (b, count, l, dh)

    angles = positions.double()[:, None, :, None] * base ** (-torch.arange(0, dh, 2, dtype=torch.float64) / dh)
    cos, sin = angles.cos(), angles.sin()  # (b, 1, l, dh / 2)

    def rotate(t: torch.Tensor) -> torch.Tensor:
        first, second = t[..., : dh // 2], t[..., dh // 2 :]
        return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)

    q, k, v = rotate(project("q_proj", heads)), rotate(project("k_proj", kv_heads)), project("v_proj", kv_heads)
    k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    scores = (q @ k.transpose(-1, -2)) * dh**-0.5
    scores = scores.masked_fill(~torch.ones(length, length, dtype=torch.bool).tril(), float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(batch, length, heads * dh)
    return out @ weights["o_proj.weight"].T + weights.get("o_proj.bias", 0.0)


def test_positions_past_8192() -> None:
    """transformers forms its angles in float32 (position * inv_freq); selfattn forms them in float64.

    Against the float64 formula at positions 10,000 and 60,000 (head size 8, base 10,000), the
    module in float32 stays within 1e-5, and transformers' layer within the rounding of its
    float32 angles: a position p carries an angle error up to about p * 2^-24 (6e-4 rad at 10,000,
    4e-3 at 60,000). Measured (outputs up to about 9 in size): transformers 3e-5 to 5e-5 at 10,000
    and 6.7e-4 to 7.2e-4 at 60,000, selfattn 1.3e-6 to 2.2e-6; the test bounds them by 5e-3 and 1e-5.
    """
    layer, config, rotary = _layer("llama", 0, torch.float32, rope_parameters=dict(rope_type="default", rope_theta=1e4))
    x, attention_mask = _inputs(torch.float32, (0, 0))
    positions = torch.stack((10_000 + torch.arange(7), 60_000 + torch.arange(7)))  # (b, l)
    expected = _float64_llama(layer, x, positions, 1e4)
    with torch.no_grad():
        causal = _mask(config, layer, x, attention_mask, positions)
        reference, _ = layer(x, position_embeddings=rotary(x, positions), attention_mask=causal)
        got = MultiHeadAttention.from_transformers(layer)(x, x, x, causal=True, positions=positions)
    assert isinstance(got, torch.Tensor)
    ours, theirs = float((got - expected).abs().max()), float((reference.double() - expected).abs().max())
    print(f"worst error against float64: selfattn float32 {ours:.2e}, transformers float32 {theirs:.2e}")
    assert ours <= 1e-5
    assert 1e-5 < theirs <= 5e-3  # the float32 angles show, within their rounding


def test_llama4_chunks_with_left_padding() -> None:
    """transformers counts a chunked layer's chunks from each sequence's first real token
    ((i - left_padding) // C); chunk_size counts positions, which start there too, so a left
    padding that is not a multiple of C moves the boundaries alike (and the cache keeps them)."""
    assert _check("llama4", 0, torch.float32, pads=(0, 3, 1)) <= 1e-5
    assert _check("llama4", 0, torch.float64, pads=(2, 0, 5)) <= 1e-5


class _NotAttention(torch.nn.Module):
    pass


def test_errors() -> None:
    with pytest.raises(ValueError, match=r"layer must be a transformers attention layer of .*got _NotAttention"):
        MultiHeadAttention.from_transformers(_NotAttention())
    # A family the table does not hold (Mistral was refused here until it joined the table).
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXAttention

    neox = transformers.GPTNeoXConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=1)
    with pytest.raises(ValueError, match=r"got GPTNeoXAttention"):
        MultiHeadAttention.from_transformers(GPTNeoXAttention(neox, 0))
    layer, _, _ = _layer("llama", 0, torch.float32)
    layer.k_proj.bias = None
    with pytest.raises(ValueError, match=r"bias on only some of q_proj, k_proj, v_proj"):
        MultiHeadAttention.from_transformers(layer)
    layer, _, _ = _layer("gemma3", 0, torch.float32, use_bidirectional_attention=True)
    with pytest.raises(ValueError, match=r"use_bidirectional_attention=True"):
        MultiHeadAttention.from_transformers(layer)
    layer, config, _ = _layer("qwen3", 0, torch.float32)
    config.layer_types = ["linear_attention", "full_attention"]
    with pytest.raises(ValueError, match=r"layer_types\[0\]='linear_attention'"):
        MultiHeadAttention.from_transformers(layer)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            dict(sinks=True, qk_norm=True),
            r"no transformers attention layer has all of \['half-split rotary', 'qk_norm with unit weights', 'sinks'\]",
        ),
        (dict(position="alibi"), r"position=ALiBi.*rotate queries and keys"),
        (dict(output_size=16), r"output_size must be equal, got 32, 32, 32, 16"),
        (dict(scale=0.3, softcap=5.0), r"scale \*\* -2 \(query_pre_attn_scalar\)=11.1.*positive integer"),
        (dict(position=None, temperature_tuning=(0.1, 2.5)), r"temperature_tuning\[1\] \(floor_scale\)=2.5"),
        (dict(temperature_tuning=(0.1, 4.0)), r"no transformers attention layer has all of"),
    ],
)
def test_config_errors(options: dict[str, Any], message: str) -> None:
    from selfattn.positional import RotaryPositionalEncoding, build

    position = options.pop("position", "half-split rotary")
    encoding = (
        None if position is None else build(position, num_hiddens=32, num_heads=4) if position == "alibi" else None
    )
    if position == "half-split rotary":
        encoding = RotaryPositionalEncoding(8, interleaved=False)
    mha = MultiHeadAttention(32, 4, position=encoding, **options)
    with pytest.raises(ValueError, match=message):
        mha.to_transformers_config()


def test_bias_errors() -> None:
    with pytest.raises(ValueError, match=r"output_bias must be True, False or None, got 'yes'"):
        MultiHeadAttention(32, 4, output_bias="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"a bias on W_o only"):
        MultiHeadAttention(32, 4, output_bias=True).to_transformers_config()


@_NO_MROPE
def test_mrope_config_needs_qwen2_vl_biases() -> None:
    from selfattn.positional import build

    mrope = build("mrope", num_hiddens=32, num_heads=4, sections=(1, 1, 2))
    with pytest.raises(ValueError, match=r"M-RoPE is Qwen2-VL's.*got output_bias=False, bias=False"):
        MultiHeadAttention(32, 4, position=mrope).to_transformers_config()
    fields = MultiHeadAttention(32, 4, position=mrope, bias=True, output_bias=False).to_transformers_config()
    assert fields["model_type"] == "qwen2_vl_text" and fields["rope_parameters"]["mrope_section"] == [1, 1, 2]


def test_output_size_and_bias_on_every_route() -> None:
    """output_size and output_bias=False, on the ragged route (skip_padded_queries) and the plain one."""
    torch.manual_seed(0)
    mha = MultiHeadAttention(64, 4, query_size=32, key_size=32, value_size=32, output_size=24, bias=True,
                             output_bias=False, skip_padded_queries=True)  # fmt: skip
    assert mha.W_o.out_features == 24 and mha.W_o.bias is None and mha.W_q.bias is not None
    x, lengths = torch.randn(3, 6, 32), torch.tensor([6, 2, 4])
    assert mha.explain(x, x, x, lengths).route == "ragged valid rows"
    with torch.no_grad():
        out = mha(x, x, x, lengths)
        assert isinstance(out, torch.Tensor) and out.shape == (3, 6, 24)
        for row, length in enumerate(lengths.tolist()):
            alone = mha(x[row : row + 1, :length], x[row : row + 1, :length], x[row : row + 1, :length])
            torch.testing.assert_close(out[row, :length], alone[0], atol=1e-6, rtol=0)
            assert not out[row, length:].any()
