"""Loading the families whose sizes, values or gates differ: what the loader must refuse, by name.

The parity of these families with transformers is in tests/test_families.py (they are in the table);
here are the layers and settings no one MultiHeadAttention computes: a Gemma 3n / Gemma 4 layer that
reuses an earlier layer's keys and values, a layer whose head count the loader did not read, a
bidirectional Gemma 4 or Step-3.7 layer.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import _hf_families as hf  # noqa: E402  (tests/ is on sys.path: tests/conftest.py)
import test_families as parity  # noqa: E402  (the parity harness's inputs and transformers runs)

from selfattn import MultiHeadAttention  # noqa: E402
from selfattn.integrations import _size_steps as steps  # noqa: E402
from selfattn.parts import HeadNorm, OutputGate, ValueScale  # noqa: E402
from selfattn.positional import RotaryPositionalEncoding  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

_THREE = dict(num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "full_attention"])


@pytest.mark.parametrize(
    ("model_type", "more"),
    [("gemma3n_text", dict(activation_sparsity_pattern=[0.0] * 3)), ("gemma4_text", {})],
    ids=["gemma3n", "gemma4"],
)
def test_a_layer_reusing_earlier_keys_and_values_is_refused(model_type: str, more: dict) -> None:
    config = hf.build_config(model_type, num_kv_shared_layers=1, **_THREE, **more)
    assert config.kv_sharing_modes[2] == "reuse"
    layer, _ = hf.build_layer(model_type, 2, torch.float32, config=config)
    with pytest.raises(ValueError, match="k_proj"):
        MultiHeadAttention.from_transformers(layer)


def test_a_head_count_the_loader_did_not_read_is_refused_by_name() -> None:
    """Laguna's layer 1 has 2 heads, config.num_attention_heads 4: loaded with 4 heads, its weights would
    not fit (and the common copy skips a weight whose shape differs): the family's step refuses it."""
    layer, _ = hf.build_layer("laguna", 1, torch.float32)
    mha = MultiHeadAttention(32, 4, num_kv_heads=2, qk_norm=True)  # what a loader reading the config builds
    with pytest.raises(ValueError, match=r"q_proj is \(16, 32\).*per-layer head count"):
        steps.require_loaded_sizes(layer, mha)
    fitting = MultiHeadAttention(16, 2, num_kv_heads=2, query_size=32, key_size=32, value_size=32, output_size=32)
    steps.require_loaded_sizes(layer, fitting)  # the sizes the layer has: no error


def test_a_bidirectional_gemma4_layer_is_refused() -> None:
    layer, config = hf.build_layer("gemma4_text", 0, torch.float32)
    config.use_bidirectional_attention = "vision"
    with pytest.raises(ValueError, match="use_bidirectional_attention='vision'"):
        steps.read_gemma4(layer, config, {})


def test_a_bidirectional_step3p7_layer_is_refused() -> None:
    layer, config = hf.build_layer("step3p5", 1, torch.float32)
    config.use_bidirectional_attention = True
    with pytest.raises(ValueError, match="use_bidirectional_attention=True"):
        steps.read_step3p7(layer, config, {})


def test_mimo_values_are_scaled_and_sized_apart() -> None:
    """MiMo-V2-Flash's sliding layer: value heads of 8 (queries 16), values times attention_value_scale,
    twice the key/value heads, sinks: the module keeps each of them (parity is in test_families.py)."""
    layer, config = hf.build_layer("mimo_v2_flash", 0, torch.float32)
    mha = MultiHeadAttention.from_transformers(layer)
    assert (mha.head_dim, mha.value_head_dim) == (16, 8)
    assert mha.num_kv_heads == 2 * config.num_key_value_heads and mha.sinks is not None
    assert [part.factor for part in mha.parts("values")] == [config.attention_value_scale]


def _rotary(head_dim: int = 8) -> RotaryPositionalEncoding:
    return RotaryPositionalEncoding(head_dim, interleaved=False)  # half-split, as transformers rotates


def test_the_way_back_writes_afmoe_or_refuses_by_name() -> None:
    afmoe_sliding = MultiHeadAttention(
        32, 4, num_kv_heads=2, qk_norm=True, gated_output=True, window=3, position=_rotary()
    )
    assert afmoe_sliding.to_transformers_config()["model_type"] == "afmoe"
    window_without_rotary = MultiHeadAttention(32, 4, qk_norm=True, gated_output=True, window=3)
    with pytest.raises(ValueError, match="AFMoE rotates its sliding layers and no others: window=3"):
        window_without_rotary.to_transformers_config()
    gate_with_bias = MultiHeadAttention(32, 4, bias=True, qk_norm=True, gated_output=True, window=3, position=_rotary())
    with pytest.raises(ValueError, match="gate_proj, which has no bias: got a gate with a bias"):
        gate_with_bias.to_transformers_config()


def test_the_way_back_writes_muse_glimmer_or_refuses_by_name() -> None:
    unweighted = {
        "q_norm": HeadNorm(8, slot="queries", weighted=False, eps=1e-5),
        "k_norm": HeadNorm(8, slot="keys", weighted=False, eps=1e-6),
    }
    two_epsilons = MultiHeadAttention(32, 4, scale=0.5, gated_output=True, parts=unweighted)
    with pytest.raises(ValueError, match="one unweighted norm of the query and key heads"):
        two_epsilons.to_transformers_config()
    unweighted["k_norm"] = HeadNorm(8, slot="keys", weighted=False, eps=1e-5)
    fields = MultiHeadAttention(32, 4, scale=0.5, gated_output=True, parts=unweighted).to_transformers_config()
    assert fields["model_type"] == "muse_glimmer_text"
    assert fields["layer_rope_theta"] == [0] and fields["qk_scale_factor"] == pytest.approx(0.5 * 8**0.5, rel=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize(("model_type", "layer_idx"), [pytest.param("laguna", 0, id="laguna-softplus")])
def test_a_gate_per_feature_equals_transformers(model_type: str, layer_idx: int, dtype: torch.dtype) -> None:
    """``gating=False``: Laguna's gate per feature (the table's config gates per head)."""
    config = hf.build_config(model_type, gating=False)
    layer, _ = hf.build_layer(model_type, layer_idx, dtype, config=config)
    assert not layer.gate_per_head
    mha = MultiHeadAttention.from_transformers(layer)
    assert mha.W_g is not None and mha.W_g.per == "feature"
    x, attention_mask = parity._inputs(dtype)
    rotary = hf.build_rotary(model_type, config)
    exact = parity._exact_frequencies(mha, rotary, config, layer_idx) if dtype == torch.float64 else None
    with torch.no_grad():
        theirs = parity._run_transformers(model_type, layer, config, rotary, x, attention_mask, exact)
        ours = mha(
            x, x, x, causal=True, positions=hf.position_ids(attention_mask), key_padding_mask=attention_mask == 0
        )
    real = attention_mask.bool()
    torch.testing.assert_close(ours[real], theirs[real], atol=parity.TOLERANCE[dtype], rtol=0)


def test_a_step3p7_gate_per_feature_is_refused() -> None:
    """transformers' own Step-3.7 layer fails with ``gating=False`` (a per-feature gate broadcast per head)."""
    config = hf.build_config("step3p5", gating=False)
    layer, _ = hf.build_layer("step3p5", 1, torch.float32, config=config)
    x, attention_mask = parity._inputs(torch.float32)
    with pytest.raises(RuntimeError, match="must match the size"):
        parity._run_transformers("step3p5", layer, config, hf.build_rotary("step3p5", config), x, attention_mask, None)
    with pytest.raises(ValueError, match=r"gating=False: Step-3\.7's gate per feature"):
        steps.read_step3p7(layer, config.per_layer_config[1], {})


def test_the_way_back_writes_mimo_v2_flash_or_refuses_by_name() -> None:
    scaled = {"v_scale": ValueScale(0.5)}
    sliding = MultiHeadAttention(
        32, 2, num_kv_heads=2, value_head_dim=8, window=3, sinks=True, position=_rotary(16), parts=scaled
    )
    fields = sliding.to_transformers_config()
    assert fields["model_type"] == "mimo_v2_flash"
    assert (fields["num_key_value_heads"], fields["v_head_dim"], fields["attention_value_scale"]) == (1, 8, 0.5)
    no_sinks = MultiHeadAttention(32, 2, value_head_dim=8, window=3, position=_rotary(16))
    with pytest.raises(ValueError, match=r"sliding layers have sinks.*window=3, sinks=False"):
        no_sinks.to_transformers_config()
    odd = MultiHeadAttention(32, 1, value_head_dim=8, window=3, sinks=True, position=_rotary(32))
    with pytest.raises(ValueError, match="twice its key/value heads, got 1"):
        odd.to_transformers_config()


def _gemma_parts(eps: float = 1e-6, **v_norm: Any) -> dict[str, HeadNorm]:
    return {
        "q_norm": HeadNorm(8, slot="queries", eps=eps),
        "k_norm": HeadNorm(8, slot="keys", eps=eps),
        "v_norm": HeadNorm(8, slot="values", eps=eps, **({"weighted": False} | v_norm)),
    }


def test_the_way_back_writes_gemma3n_and_gemma4_or_refuses_by_name() -> None:
    """Scale exactly 1, one unweighted value norm; Gemma 4's sliding layer is the first of two (its last layer
    is always full), its values from keys only on a full layer."""
    gemma3n = MultiHeadAttention(32, 4, num_kv_heads=2, scale=1.0, window=3, position=_rotary(), parts=_gemma_parts())
    gemma3n.transformers_model_type = "gemma3n_text"
    assert gemma3n.to_transformers_config()["model_type"] == "gemma3n_text"
    gemma4 = MultiHeadAttention(32, 4, num_kv_heads=2, scale=1.0, window=3, position=_rotary(), parts=_gemma_parts())
    gemma4.transformers_model_type = "gemma4_text"
    fields = gemma4.to_transformers_config()
    assert (fields["model_type"], fields["layer_types"]) == ("gemma4_text", ["sliding_attention", "full_attention"])
    half = MultiHeadAttention(32, 4, scale=0.5, position=_rotary(), parts=_gemma_parts())
    with pytest.raises(ValueError, match=r"scale 1\.0 \(scaling = 1\.0\); got scale=0\.5"):
        half.to_transformers_config()
    weighted = MultiHeadAttention(32, 4, scale=1.0, position=_rotary(), parts=_gemma_parts(weighted=True))
    with pytest.raises(ValueError, match="one more norm, v_norm: unweighted"):
        weighted.to_transformers_config()
    sliding_k_eq_v = MultiHeadAttention(
        32, 4, scale=1.0, values_from_keys=True, window=3, position=_rotary(), parts=_gemma_parts()
    )
    with pytest.raises(ValueError, match="values_from_keys with a window"):
        sliding_k_eq_v.to_transformers_config()


def _gate(per: str, activation: str, bias: bool = False) -> OutputGate:
    return OutputGate(32, 4, 8, per=per, activation=activation, bias=bias)


def test_the_way_back_writes_laguna_and_step3p7_or_refuses_by_name() -> None:
    """Laguna: a softplus gate per head or per feature; Step-3.7: a sigmoid gate per head; both without bias,
    their head count in the per-layer fields."""
    laguna = MultiHeadAttention(32, 4, qk_norm=True, position=_rotary(), parts={"W_g": _gate("feature", "softplus")})
    laguna.transformers_model_type = "laguna"
    fields = laguna.to_transformers_config()
    assert (fields["model_type"], fields["gating"], fields["num_attention_heads_per_layer"]) == ("laguna", False, [4])
    gate_with_bias = MultiHeadAttention(
        32, 4, qk_norm=True, position=_rotary(), parts={"W_g": _gate("feature", "softplus", True)}
    )
    gate_with_bias.transformers_model_type = "laguna"
    with pytest.raises(ValueError, match="Laguna's layer gates its output with g_proj, a softplus gate"):
        gate_with_bias.to_transformers_config()
    step = MultiHeadAttention(
        32, 4, qk_norm=True, scale=0.5, window=3, position=_rotary(), parts={"W_g": _gate("head", "sigmoid")}
    )
    step.transformers_model_type = "step3p5"
    fields = step.to_transformers_config()
    assert (fields["model_type"], fields["query_pre_attn_scalar"], fields["num_sliding_attention_heads"]) == (
        "step3p5",
        4.0,
        4,
    )
    softplus = MultiHeadAttention(32, 4, qk_norm=True, position=_rotary(), parts={"W_g": _gate("head", "softplus")})
    softplus.transformers_model_type = "step3p5"
    with pytest.raises(ValueError, match=r"Step-3\.7's layer gates its output with g_proj, a sigmoid gate per head"):
        softplus.to_transformers_config()


def test_the_way_back_writes_muse_spark_or_refuses_by_name() -> None:
    def spark(o_norm: HeadNorm) -> MultiHeadAttention:
        norms = {
            name: HeadNorm(8, slot=slot, weighted=False, eps=1e-5)
            for name, slot in (("q_norm", "queries"), ("k_norm", "keys"))
        }
        return MultiHeadAttention(32, 4, scale=0.5, gated_output=True, parts={**norms, "o_norm": o_norm})

    fields = spark(HeadNorm(8, slot="output_heads", weighted=False, eps=1e-5)).to_transformers_config()
    assert fields["model_type"] == "muse_spark_text"
    with pytest.raises(ValueError, match="one more norm, o_norm: unweighted, at output_heads"):
        spark(HeadNorm(8, slot="output_heads", weighted=True, eps=1e-5)).to_transformers_config()
    with pytest.raises(ValueError, match="one more norm, o_norm"):
        spark(HeadNorm(8, slot="output_heads", weighted=False, eps=1e-6)).to_transformers_config()


def test_a_laguna_gate_per_feature_goes_back_as_laguna() -> None:
    """``gating=False`` (the table's config gates per head): written back with ``gating=False``, rebuilt equal."""
    layer, _ = hf.build_layer("laguna", 1, torch.float32, config=hf.build_config("laguna", gating=False))
    mha = MultiHeadAttention.from_transformers(layer)
    fields = mha.to_transformers_config()
    assert (fields["model_type"], fields["gating"]) == ("laguna", False)
    config = transformers.AutoConfig.for_model(**fields)
    config._attn_implementation = "eager"
    rebuilt, _ = hf.build_layer("laguna", 0, torch.float32, config=config)
    rebuilt.load_state_dict(layer.state_dict())
    x, attention_mask = parity._inputs(torch.float32)
    with torch.no_grad():
        theirs = parity._run_transformers(
            "laguna", rebuilt, config, hf.build_rotary("laguna", config), x, attention_mask, None
        )
        ours = mha(
            x, x, x, causal=True, positions=hf.position_ids(attention_mask), key_padding_mask=attention_mask == 0
        )
    real = attention_mask.bool()
    torch.testing.assert_close(ours[real], theirs[real], atol=1e-5, rtol=0)
