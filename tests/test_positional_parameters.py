"""Parameters of the position encodings that were taken silently (or raised the wrong error): each now a ValueError
naming it, and the accepted form still computing what it should."""

from __future__ import annotations

import math

import pytest
import torch

from selfattn.functional import apply_rotary, rotary_frequencies, sinusoidal_table
from selfattn.positional import FIREPositionalBias, RotaryPositionalEncoding, T5RelativePositionBias, XPosEncoding

ROPE = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0, "partial_rotary_factor": 0.5}


def test_a_partial_rotary_factor_in_the_scaling_dict_must_agree_with_rotary_dim() -> None:
    """transformers' rope_parameters passed as they are: their partial_rotary_factor (half the head here) was dropped
    and the whole head rotated (4.5 off transformers' answer for inputs of 3); now it must name rotary_dim."""
    with pytest.raises(ValueError, match=r"partial_rotary_factor'\]=0.5 rotates 32 of head_dim=64 .* rotary_dim=64"):
        RotaryPositionalEncoding(64, interleaved=False, scaling=ROPE)
    x, positions = torch.randn(1, 2, 5, 64, dtype=torch.float64), torch.arange(100, 105)
    with pytest.raises(ValueError, match=r"pass rotary_dim=32"):
        apply_rotary(x, positions, interleaved=False, scaling=ROPE)
    with pytest.raises(ValueError, match=r"partial_rotary_factor'\] must be in \(0, 1\], got 2"):
        RotaryPositionalEncoding(64, rotary_dim=32, scaling={**ROPE, "partial_rotary_factor": 2})
    agreeing = RotaryPositionalEncoding(64, interleaved=False, rotary_dim=32, scaling=ROPE)
    config = {"head_dim": 64, "rope_parameters": dict(ROPE)}
    torch.testing.assert_close(agreeing(x, positions), RotaryPositionalEncoding.from_config(config)(x, positions))
    by_function = apply_rotary(x, positions, interleaved=False, rotary_dim=32, scaling=ROPE)
    torch.testing.assert_close(by_function, agreeing(x, positions))
    assert torch.equal(by_function[..., 32:], x[..., 32:])  # the other half passes as it is


@pytest.mark.parametrize(
    "make",
    [
        lambda: sinusoidal_table(4, 8, base=math.inf),
        lambda: rotary_frequencies(8, base=math.inf),
        lambda: RotaryPositionalEncoding(8, base=math.inf),
        lambda: XPosEncoding(8, base=math.inf),
    ],
    ids=["sinusoidal table", "rotary frequencies", "rotary", "xpos"],
)
def test_an_infinite_base_is_refused(make) -> None:  # type: ignore[no-untyped-def]
    """inf ** -0 == 1: every pair but the first never turned, the sinusoidal table's later columns 0 and 1."""
    with pytest.raises(ValueError, match="base must be a finite number greater than 1, got inf"):
        make()


@pytest.mark.parametrize("rope_type", ["yarn", "llama3", "dynamic"])
def test_an_infinite_trained_length_is_a_value_error(rope_type: str) -> None:
    """It raised OverflowError from int(inf)."""
    scaling = {"rope_type": rope_type, "factor": 4.0, "original_max_position_embeddings": math.inf}
    if rope_type == "llama3":
        scaling.update(low_freq_factor=1.0, high_freq_factor=4.0)
    with pytest.raises(ValueError, match=f"scaling '{rope_type}': original_max_position_embeddings must be a positive"):
        RotaryPositionalEncoding(16, scaling=scaling)


@pytest.mark.parametrize(
    ("scaling", "factor", "seq_len", "growth"),
    [
        ("ntk", 4.0, None, 4.0),
        ({"rope_type": "dynamic", "factor": 4.0, "original_max_position_embeddings": 8}, 1.0, 32, 13.0),
    ],
    ids=["ntk", "dynamic"],
)
def test_a_base_scaling_of_one_rotated_pair_is_refused(
    scaling: object, factor: float, seq_len: int | None, growth: float
) -> None:
    """ntk and dynamic multiply the base, which the one pair of rotary_dim 2 never reads: the factor was ignored
    (frequency 1, where the docs promise the slowest pair divided by the factor: 4 * 32 / 8 - 3 = 13 for dynamic)."""
    options = {"scaling": scaling, "scaling_factor": factor, "seq_len": seq_len}
    with pytest.raises(ValueError, match="needs rotary_dim >= 4"):
        rotary_frequencies(2, **options)  # type: ignore[arg-type]
    slowest = rotary_frequencies(4, **options)  # type: ignore[arg-type]
    assert slowest[0] == 1.0 and math.isclose(slowest[-1], rotary_frequencies(4)[-1] / growth, rel_tol=1e-12)


def test_flags_and_finite_numbers_of_the_score_and_key_encodings() -> None:
    with pytest.raises(ValueError, match="bidirectional must be True or False, got str 'no'"):
        T5RelativePositionBias(2, bidirectional="no")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="threshold must be a positive finite number, got inf"):
        FIREPositionalBias(2, hidden_size=4, threshold=math.inf)  # every distance normalised to 0: a constant bias
    with pytest.raises(ValueError, match="scale_base must be a positive finite number, got inf"):
        XPosEncoding(8, scale_base=math.inf)  # accepted, then every call raised OverflowError
    with pytest.raises(ValueError, match="attention_factor must be a positive finite number, got inf"):
        apply_rotary(torch.ones(2, 4), torch.arange(2), attention_factor=math.inf)  # gave inf and NaN


def test_the_xpos_docstring_states_the_limits_the_code_enforces() -> None:
    """It said 18,152 (float32 and bf16) and 2,267 (float16), where positions past 18,130 and 2,266 raise."""
    encoding = XPosEncoding(64)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        assert f"{encoding.max_position(dtype):,}" in " ".join(XPosEncoding.__doc__.split()), dtype  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="must be <= 18130"):
        encoding(torch.randn(1, 1, 1, 64), torch.tensor([18131]))
    assert encoding(torch.randn(1, 1, 1, 64), torch.tensor([18130])).isfinite().all()
