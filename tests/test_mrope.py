"""M-RoPE (Qwen2-VL's multimodal rotary): the encoding, the position builder, and attention with (3, b, l) positions.

References: a float64 NumPy formula written here, and Hugging Face transformers' own Qwen2-VL /
Qwen2.5-VL code where it is installed (rotary embedding, ``apply_rotary_pos_emb``, ``get_rope_index``).
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from selfattn import KVCache, MultiHeadAttention
from selfattn.positional import (
    MultimodalRotaryPositionalEncoding,
    RotaryPositionalEncoding,
    build,
    multimodal_positions,
)

HEAD_DIM, HEADS, SECTIONS, BASE = 16, 2, (2, 3, 3), 1000.0
IMAGE, VIDEO = 90, 91


def mrope_numpy(x: np.ndarray, positions: np.ndarray, sections, base: float) -> np.ndarray:
    """Pair ``(j, j + dh/2)`` turned by ``p[axis(j)] * base^(-2j/dh)``; x ``(..., l, dh)``, positions ``(3, l)``."""
    dh = x.shape[-1]
    half = dh // 2
    axis = np.repeat(np.arange(3), sections)  # the axis each frequency follows
    out = np.empty_like(x)
    for j in range(half):
        theta = positions[axis[j]].astype(np.float64) * base ** (-2.0 * j / dh)  # (l,), broadcast over (..., l)
        cos, sin = np.cos(theta), np.sin(theta)
        out[..., j] = x[..., j] * cos - x[..., j + half] * sin
        out[..., j + half] = x[..., j] * sin + x[..., j + half] * cos
    return out


def image_positions(length: int = 12) -> torch.Tensor:
    """``(3, l)`` positions of text, a 2x3 image, text: the layout multimodal_positions makes."""
    ids = torch.tensor([[1, 2, *[IMAGE] * 6, *range(3, 3 + length - 8)]])
    return multimodal_positions(ids, image_token_id=IMAGE, image_grids=[[1, 4, 6]]).positions[:, 0]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_encoding_matches_numpy_formula(dtype):
    torch.manual_seed(0)
    encoding = MultimodalRotaryPositionalEncoding(HEAD_DIM, BASE, sections=SECTIONS)
    x = torch.randn(2, HEADS, 12, HEAD_DIM, dtype=torch.float64)
    positions = torch.randint(0, 200, (3, 12))
    expected = mrope_numpy(x.numpy(), positions.numpy(), SECTIONS, BASE)
    got = encoding(x.to(dtype), positions)
    assert got.dtype == dtype
    tolerance = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(got.double(), torch.from_numpy(expected), rtol=0, atol=tolerance)


def test_qwen_position_layout_is_per_sequence_and_shared_by_heads():
    torch.manual_seed(1)
    encoding = MultimodalRotaryPositionalEncoding(HEAD_DIM, BASE, sections=SECTIONS).double()
    x = torch.randn(2, HEADS, 12, HEAD_DIM, dtype=torch.float64)
    positions = torch.stack([image_positions(), image_positions() + 5], dim=1)  # (3, b, l)
    got = encoding(x, positions)
    for row in range(2):
        expected = mrope_numpy(x[row].numpy(), positions[:, row].numpy(), SECTIONS, BASE)
        torch.testing.assert_close(got[row], torch.from_numpy(expected), rtol=0, atol=1e-12)


def test_text_positions_are_plain_half_split_rotary():
    """All three axes equal: every frequency reads the same position, so the sections do not matter."""
    torch.manual_seed(2)
    mrope = MultimodalRotaryPositionalEncoding(HEAD_DIM, BASE, sections=SECTIONS)
    rotary = RotaryPositionalEncoding(HEAD_DIM, BASE, interleaved=False)
    x = torch.randn(2, HEADS, 9, HEAD_DIM, dtype=torch.float64)
    positions = torch.arange(3, 12)
    expected = rotary(x, positions)
    torch.testing.assert_close(mrope(x, positions), expected, rtol=0, atol=1e-15)
    torch.testing.assert_close(mrope(x, positions.expand(3, -1)), expected, rtol=0, atol=1e-15)
    torch.testing.assert_close(mrope(x, positions.expand(3, 2, -1)), expected, rtol=0, atol=1e-15)


def test_build_and_default_sections():
    assert build("mrope", num_hiddens=512, num_heads=4).sections == (16, 24, 24)  # Qwen2-VL's, dh = 128
    encoding = build("mrope", num_hiddens=32, num_heads=2, sections=(2, 3, 3), base=1e6)
    assert isinstance(encoding, MultimodalRotaryPositionalEncoding)
    assert (encoding.head_dim, encoding.base, encoding.sections) == (16, 1e6, (2, 3, 3))
    assert encoding.to(torch.bfloat16).inv_freq.dtype == torch.float64  # the table keeps its precision


@pytest.mark.parametrize(
    "sections", [(16, 24, 20), (2, 3, 4), (4, 4), (2, 3, 3, 0), (-1, 5, 4), (2.0, 3, 3), "233", None]
)
def test_bad_sections_raise(sections):
    if sections is None:
        with pytest.raises(ValueError, match=r"head_dim must be even .* got 15"):
            MultimodalRotaryPositionalEncoding(15)
        return
    expected = re.escape(f"half the head size, 8; got sections={sections!r}")
    with pytest.raises(ValueError, match=rf"sections must .* {expected}"):
        build("mrope", num_hiddens=32, num_heads=2, sections=sections)


def test_encoding_rejects_bad_positions():
    encoding = MultimodalRotaryPositionalEncoding(HEAD_DIM, sections=SECTIONS)
    x = torch.randn(2, HEADS, 5, HEAD_DIM)
    with pytest.raises(ValueError, match=r"positions must have shape \(3, batch, 5\), \(3, 5\) or \(5,\) .*\(2, 5\)"):
        encoding(x, torch.zeros(2, 5, dtype=torch.long))  # (b, l) is ambiguous here: give (3, b, l)
    with pytest.raises(ValueError, match=r"positions must have shape .*\(3, 4\)"):
        encoding(x, torch.zeros(3, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="positions must be an integer tensor"):
        encoding(x, torch.zeros(3, 5))
    with pytest.raises(ValueError, match=r"x must have shape \(\.\.\., length, 16\)"):
        encoding(torch.randn(2, 5, 8), torch.arange(5))


# --------------------------------------------------------------------------- against transformers


def _qwen2_vl():
    pytest.importorskip("transformers", reason="transformers is not installed (optional cross-check)")
    from transformers.models.qwen2_vl import modeling_qwen2_vl
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLTextConfig

    return modeling_qwen2_vl, Qwen2VLTextConfig


def _hf_rotary(sections=SECTIONS, base=BASE):
    modeling, Config = _qwen2_vl()
    config = Config(
        hidden_size=HEAD_DIM * HEADS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        rope_parameters={"rope_type": "default", "mrope_section": list(sections), "rope_theta": base},
    )
    return modeling, config, modeling.Qwen2VLRotaryEmbedding(config)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_encoding_matches_transformers(dtype):
    modeling, _, hf = _hf_rotary()
    torch.manual_seed(3)
    q = torch.randn(2, HEADS, 12, HEAD_DIM, dtype=dtype)
    k = torch.randn(2, HEADS, 12, HEAD_DIM, dtype=dtype)
    positions = torch.stack([image_positions(), torch.randint(0, 40, (3, 12))], dim=1)  # (3, b, l)
    cos, sin = hf(q, positions)
    q_hf, k_hf = modeling.apply_rotary_pos_emb(q, k, cos, sin)
    encoding = MultimodalRotaryPositionalEncoding(HEAD_DIM, BASE, sections=SECTIONS)
    # transformers forms its angles in float32 whatever the dtype: at positions < 40 that rounding is < 1e-5
    torch.testing.assert_close(encoding(q, positions), q_hf, rtol=0, atol=1e-5)
    torch.testing.assert_close(encoding(k, positions), k_hf, rtol=0, atol=1e-5)


def test_section_layout_matches_transformers_exactly_in_float64():
    """transformers' own recomposition and rotation, fed float64 angles: equal to 1e-12 (the layout, not rounding)."""
    modeling, _, hf = _hf_rotary()
    torch.manual_seed(4)
    q = torch.randn(2, HEADS, 12, HEAD_DIM, dtype=torch.float64)
    positions = torch.randint(0, 5000, (3, 2, 12))
    encoding = MultimodalRotaryPositionalEncoding(HEAD_DIM, BASE, sections=SECTIONS)
    angles = positions[..., None].double() * encoding.inv_freq  # (3, b, l, dh/2)
    cos, sin = hf.recomposition_frequencies(angles.cos()), hf.recomposition_frequencies(angles.sin())
    q_hf, _ = modeling.apply_rotary_pos_emb(q, q, cos, sin)
    torch.testing.assert_close(encoding(q, positions), q_hf, rtol=0, atol=1e-12)


def test_from_config_reads_a_qwen2_vl_config():
    _, config, _ = _hf_rotary(sections=(2, 2, 4), base=1e6)
    encoding = MultimodalRotaryPositionalEncoding.from_config(config)
    assert (encoding.head_dim, encoding.base, encoding.sections) == (HEAD_DIM, 1e6, (2, 2, 4))
    legacy = {
        "hidden_size": 256,
        "num_attention_heads": 2,
        "rope_theta": 1e6,
        "rope_scaling": {"mrope_section": [16, 24, 24]},
    }
    assert MultimodalRotaryPositionalEncoding.from_config(legacy).sections == (16, 24, 24)
    with pytest.raises(ValueError, match="config has no mrope_section"):
        MultimodalRotaryPositionalEncoding.from_config({"head_dim": 16})


def _hf_rope_index(
    ids, *, attention_mask=None, images=None, videos=None, merge=2, seconds=None, tokens_per_second=None
):
    """transformers' get_rope_index, called on a stand-in that carries only the config it reads."""
    pytest.importorskip("transformers", reason="transformers is not installed (optional cross-check)")
    if tokens_per_second is None:
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel as Model
    else:
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel as Model
    vision = SimpleNamespace(spatial_merge_size=merge, tokens_per_second=tokens_per_second)
    model = SimpleNamespace(config=SimpleNamespace(vision_config=vision))
    model.get_vision_position_ids = Model.get_vision_position_ids.__get__(model)
    types = (ids == IMAGE).int() + 2 * (ids == VIDEO).int()
    extra = {} if seconds is None else {"second_per_grid_ts": torch.tensor(seconds)}
    return Model.get_rope_index(
        model, ids, types, image_grid_thw=images, video_grid_thw=videos, attention_mask=attention_mask, **extra
    )


def _tokens(*parts):
    return torch.tensor([[token for part in parts for token in part]])


ROPE_INDEX_CASES = {
    "text only": (_tokens(range(1, 9)), None, None),
    "one image": (_tokens([1, 2], [IMAGE] * 6, [3, 4, 5]), [[1, 4, 6]], None),
    "two images": (_tokens([1], [IMAGE] * 4, [2, 3], [IMAGE] * 9, [4]), [[1, 4, 4], [1, 6, 6]], None),
    "image first and last": (_tokens([IMAGE] * 2, [5], [IMAGE] * 8), [[1, 2, 4], [1, 8, 4]], None),
    "video": (_tokens([1, 2], [VIDEO] * 12, [3, 4]), None, [[3, 4, 4]]),
    "video many frames": (_tokens([1], [VIDEO] * 8, [3, 4]), None, [[8, 2, 2]]),
    "image and video": (_tokens([IMAGE] * 4, [1], [VIDEO] * 8, [2]), [[1, 4, 4]], [[2, 4, 4]]),
}


@pytest.mark.parametrize("case", sorted(ROPE_INDEX_CASES))
def test_positions_match_get_rope_index(case):
    ids, images, videos = ROPE_INDEX_CASES[case]
    images_t = None if images is None else torch.tensor(images)
    videos_t = None if videos is None else torch.tensor(videos)
    expected, expected_deltas = _hf_rope_index(ids, images=images_t, videos=videos_t)
    got = multimodal_positions(ids, image_token_id=IMAGE, video_token_id=VIDEO, image_grids=images, video_grids=videos)
    torch.testing.assert_close(got.positions, expected, rtol=0, atol=0)
    torch.testing.assert_close(got.deltas, expected_deltas, rtol=0, atol=0)


def test_positions_match_get_rope_index_left_padded_batch():
    """Two rows of a batch, left-padded; the grids are consumed in order across rows."""
    row0 = [0, 0, 0, 1, 2, *[IMAGE] * 6, 3, 4]
    row1 = [1, *[IMAGE] * 4, 2, *[IMAGE] * 2, 3, 4, 5, 6, 7]
    ids = torch.tensor([row0, row1])
    mask = (ids != 0).long()
    images = torch.tensor([[1, 4, 6], [1, 4, 4], [1, 2, 4]])
    expected, expected_deltas = _hf_rope_index(ids, attention_mask=mask, images=images)
    got = multimodal_positions(ids, image_token_id=IMAGE, image_grids=images, attention_mask=mask)
    torch.testing.assert_close(got.positions, expected, rtol=0, atol=0)
    torch.testing.assert_close(got.deltas, expected_deltas, rtol=0, atol=0)


def test_positions_match_qwen2_5_vl_video_time_steps():
    ids = _tokens([1, 2], [VIDEO] * 12, [3, 4], [VIDEO] * 8, [5])
    videos = torch.tensor([[3, 4, 4], [2, 4, 4]])
    seconds, tokens_per_second = [0.5, 2.0], 3
    expected, expected_deltas = _hf_rope_index(ids, videos=videos, seconds=seconds, tokens_per_second=tokens_per_second)
    steps = [tokens_per_second * s for s in seconds]
    got = multimodal_positions(ids, video_token_id=VIDEO, video_grids=videos, video_time_steps=steps)
    torch.testing.assert_close(got.positions, expected, rtol=0, atol=0)
    torch.testing.assert_close(got.deltas, expected_deltas, rtol=0, atol=0)


def test_positions_by_hand():
    """Independent of transformers: text, a 2x3 merged image, text (the formula in the docstring)."""
    got = multimodal_positions(_tokens([7, 8], [IMAGE] * 6, [9]), image_token_id=IMAGE, image_grids=[[1, 4, 6]])
    expected = torch.tensor([[0, 1, 2, 2, 2, 2, 2, 2, 5], [0, 1, 2, 2, 2, 3, 3, 3, 5], [0, 1, 2, 3, 4, 2, 3, 4, 5]])
    assert torch.equal(got.positions[:, 0], expected)
    assert got.deltas.tolist() == [[6 - 9]]


def test_adjacent_images_are_cut_by_their_grids():
    ids = _tokens([1], [IMAGE] * 4, [IMAGE] * 2, [2])  # two images with no text between
    got = multimodal_positions(ids, image_token_id=IMAGE, image_grids=[[1, 4, 4], [1, 2, 4]])
    two_calls = torch.cat(
        [
            multimodal_positions(_tokens([1], [IMAGE] * 4), image_token_id=IMAGE, image_grids=[[1, 4, 4]]).positions,
            multimodal_positions(_tokens([IMAGE] * 2, [2]), image_token_id=IMAGE, image_grids=[[1, 2, 4]]).positions
            + 3,
        ],
        dim=-1,
    )
    assert torch.equal(got.positions, two_calls)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"image_grids": [[1, 4, 4]]}, r"input_ids hold more image tokens than image_grids describe \(1\)"),
        ({"image_grids": [[1, 4, 4]] * 4}, r"image_grids describe 4 images but input_ids hold the tokens of 3"),
        ({"image_grids": [[1, 4, 4], [1, 4, 8], [1, 4, 4]]}, r"image 1 with grid \(1, 2, 4\) \(merged\) needs 8"),
        ({"image_grids": [[1, 4, 5]] * 3}, r"image_grids has a grid \(1, 4, 5\) .* not a multiple of 2"),
        ({"image_grids": [[1, 4]] * 3}, r"image_grids must be rows of three positive integers"),
        ({"image_grids": [[0, 4, 4]] * 3}, r"image_grids must be rows of three positive integers"),
        ({"video_grids": [[1, 4, 4]], "video_token_id": None}, r"video_grids are given without video_token_id"),
        ({"image_grids": [[1, 4, 4]] * 3, "video_token_id": IMAGE}, r"must differ, both are 90"),
        ({"image_grids": [[1, 4, 4]] * 3, "spatial_merge_size": 0}, r"spatial_merge_size"),
        ({"image_grids": [[1, 4, 4]] * 3, "attention_mask": torch.ones(3)}, r"attention_mask must have the shape"),
        ({"video_grids": [[1, 4, 4]], "video_time_steps": [1.0, 2.0]}, r"video_time_steps must be one finite step"),
    ],
)
def test_position_builder_errors(kwargs, message):
    ids = _tokens([1], [IMAGE] * 4, [2], [IMAGE] * 4, [3], [IMAGE] * 4)
    options = {"image_token_id": IMAGE, "video_token_id": VIDEO, **kwargs}
    with pytest.raises(ValueError, match=message):
        multimodal_positions(ids, **options)


def test_position_builder_rejects_bad_input_ids():
    with pytest.raises(
        ValueError, match=r"input_ids must be integer token ids of shape \(batch, length\), got .*\(4,\)"
    ):
        multimodal_positions(torch.arange(4))


# --------------------------------------------------------------------------- through MultiHeadAttention


def _mha(num_kv_heads: int = HEADS) -> MultiHeadAttention:
    torch.manual_seed(5)
    position = build("mrope", num_hiddens=HEAD_DIM * HEADS, num_heads=HEADS, sections=SECTIONS, base=BASE)
    return MultiHeadAttention(HEAD_DIM * HEADS, HEADS, position=position, num_kv_heads=num_kv_heads).double()


def _prompt():
    """Two sequences of 12 tokens, each with its own image: positions ``(3, 2, 12)``."""
    ids = torch.stack([_tokens([1, 2], [IMAGE] * 6, [3, 4, 5, 6])[0], _tokens([1], [IMAGE] * 8, [3, 4, 5])[0]])
    return multimodal_positions(ids, image_token_id=IMAGE, image_grids=[[1, 4, 6], [1, 4, 8]])


def test_attention_matches_transformers_style_reference():
    """The module with (3, b, l) positions equals projections, the M-RoPE formula and causal softmax written out."""
    mha = _mha()
    positions = _prompt().positions
    x = torch.randn(2, 12, HEAD_DIM * HEADS, dtype=torch.float64)
    q = mha.split_heads(mha.W_q(x)).detach().numpy()
    k = mha.split_heads(mha.W_k(x)).detach().numpy()
    v = mha.split_heads(mha.W_v(x)).detach()
    rotated = [[mrope_numpy(t[row], positions[:, row].numpy(), SECTIONS, BASE) for row in range(2)] for t in (q, k)]
    q_r, k_r = (torch.from_numpy(np.stack(t)) for t in rotated)
    scores = q_r @ k_r.transpose(-1, -2) / HEAD_DIM**0.5
    scores = scores.masked_fill(~torch.ones(12, 12, dtype=torch.bool).tril(), float("-inf"))
    expected = mha.W_o((scores.softmax(-1) @ v).transpose(1, 2).flatten(2))
    torch.testing.assert_close(mha(x, x, x, causal=True, positions=positions), expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("num_kv_heads", [HEADS, 1])
def test_cached_decoding_equals_full_pass(num_kv_heads):
    mha = _mha(num_kv_heads)
    prompt = _prompt()
    # the prompt, then 4 generated text tokens at index + delta on every axis
    generated = (torch.arange(12, 16) + prompt.deltas).expand(3, -1, -1)  # (3, b, 4)
    positions = torch.cat([prompt.positions, generated], dim=-1)  # (3, b, 16)
    x = torch.randn(2, 16, HEAD_DIM * HEADS, dtype=torch.float64)
    full = mha(x, x, x, causal=True, positions=positions)
    cache = KVCache(16)
    steps = [mha(x[:, :10], x[:, :10], x[:, :10], causal=True, cache=cache, positions=positions[..., :10])]
    for t in range(10, 16):
        step = x[:, t : t + 1]
        steps.append(mha(step, step, step, causal=True, cache=cache, positions=positions[..., t : t + 1]))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-12)
    assert torch.equal(cache.positions, positions[0])  # the cache keeps the temporal row


def test_left_padded_prompt_then_decoding_equals_each_sequence_alone():
    """Row 0 is left-padded by 3: its tokens, prompt and generated, give what the row gives alone."""
    mha = _mha()
    ids = torch.stack([_tokens([0, 0, 0, 1], [IMAGE] * 6, [3, 4, 5])[0], _tokens([1], [IMAGE] * 8, [3, 4, 5, 6])[0]])
    padding = ids == 0  # (b, 13), True = padding
    prompt = multimodal_positions(
        ids, image_token_id=IMAGE, image_grids=[[1, 4, 6], [1, 4, 8]], attention_mask=~padding
    )
    # three generated tokens: index among the row's own tokens (padding not counted) + delta
    index = (~padding).sum(-1, keepdim=True) + torch.arange(3)  # (b, 3)
    positions = torch.cat([prompt.positions, (index + prompt.deltas).expand(3, -1, -1)], dim=-1)  # (3, b, 16)
    padding = torch.cat([padding, torch.zeros(2, 3, dtype=torch.bool)], dim=-1)
    x = torch.randn(2, 16, HEAD_DIM * HEADS, dtype=torch.float64)
    cache = KVCache(16)
    steps = [mha(x[:, :13], x[:, :13], x[:, :13], causal=True, cache=cache, positions=positions[..., :13],
                 key_padding_mask=padding[:, :13])]  # fmt: skip
    for t in range(13, 16):
        step = x[:, t : t + 1]
        steps.append(mha(step, step, step, causal=True, cache=cache, positions=positions[..., t : t + 1],
                         key_padding_mask=padding[:, t : t + 1]))  # fmt: skip
    decoded = torch.cat(steps, dim=1)
    alone = x[:1, 3:]
    expected = mha(alone, alone, alone, causal=True, positions=positions[:, :1, 3:])
    torch.testing.assert_close(decoded[:1, 3:], expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(decoded[1:], mha(x[1:], x[1:], x[1:], causal=True, positions=positions[:, 1:]))
    assert (
        positions[:, 0, 3].tolist() == [0, 0, 0] and positions[:, 0, 13].tolist() == [7] * 3
    )  # text 0, image 1-3, text 4-6


def test_shifting_every_axis_changes_nothing_and_one_axis_does():
    mha = _mha()
    positions = _prompt().positions
    x = torch.randn(2, 12, HEAD_DIM * HEADS, dtype=torch.float64)
    out = mha(x, x, x, causal=True, positions=positions)
    torch.testing.assert_close(mha(x, x, x, causal=True, positions=positions + 37), out, rtol=0, atol=1e-12)
    for axis in range(3):  # each axis drives its own frequencies: moving one alone is seen
        moved = positions.clone()
        moved[axis, :, 5:] += 3
        assert (mha(x, x, x, causal=True, positions=moved) - out).abs().max() > 1e-3


def test_text_positions_in_attention_equal_rotary_attention():
    mrope = _mha()
    rotary = MultiHeadAttention(
        HEAD_DIM * HEADS, HEADS, position=RotaryPositionalEncoding(HEAD_DIM, BASE, interleaved=False)
    ).double()
    rotary.load_state_dict(mrope.state_dict())
    x = torch.randn(2, 9, HEAD_DIM * HEADS, dtype=torch.float64)
    per_sequence = torch.tensor([[0, 0, 0, 1, 2, 3, 4, 5, 6], list(range(4, 13))])  # (b, l) text positions
    for positions in (None, per_sequence, per_sequence.expand(3, -1, -1)):
        expected = rotary(
            x, x, x, causal=True, positions=positions if positions is None or positions.dim() == 2 else per_sequence
        )
        torch.testing.assert_close(mrope(x, x, x, causal=True, positions=positions), expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize(("skip_padded_queries", "return_weights"), [(False, False), (True, False), (False, True)])
def test_ragged_batch_equals_each_sequence_alone(skip_padded_queries, return_weights):
    """valid_lens (b,) with causal takes the ragged routes, which project and rotate per group of rows
    (or, with the weights asked for, one masked call); keys past the longest length are dropped first."""
    mha = _mha()
    mha.skip_padded_queries = skip_padded_queries
    positions = _prompt().positions
    x = torch.randn(2, 12, HEAD_DIM * HEADS, dtype=torch.float64)
    lengths = torch.tensor([10, 7])
    route = mha.explain(x, x, x, lengths, causal=True, positions=positions, return_weights=return_weights).route
    assert route.startswith("ragged") != return_weights
    out = mha(x, x, x, lengths, causal=True, positions=positions, return_weights=return_weights)
    out = out[0] if return_weights else out
    for row, length in enumerate(lengths.tolist()):
        alone = x[row : row + 1, :length]
        expected = mha(alone, alone, alone, causal=True, positions=positions[:, row : row + 1, :length])
        torch.testing.assert_close(out[row : row + 1, :length], expected, rtol=0, atol=1e-12)


def test_three_axis_positions_need_an_mrope_layer():
    x = torch.randn(2, 5, 32)
    positions = torch.zeros(3, 2, 5, dtype=torch.long)
    rotary = MultiHeadAttention(32, 2, position=build("rotary", num_hiddens=32, num_heads=2))
    with pytest.raises(ValueError, match=r"positions of shape \(3, 2, 5\) are 3-D.*RotaryPositionalEncoding"):
        rotary(x, x, x, positions=positions)
    with pytest.raises(ValueError, match=r"key_positions of shape \(3, 2, 5\) are 3-D.*ALiBi"):
        alibi = MultiHeadAttention(32, 2, position=build("alibi", num_hiddens=32, num_heads=2))
        alibi(x, x, x, key_positions=positions)
    with pytest.raises(ValueError, match=r"positions of shape \(3, 2, 5\) are 3-D.*no position encoding"):
        MultiHeadAttention(32, 2)(x, x, x, positions=positions)
    mrope = MultiHeadAttention(32, 2, position=build("mrope", num_hiddens=32, num_heads=2))
    with pytest.raises(
        ValueError, match=r"positions must be an integer tensor of shape \(3, 2, 5\), got .*\(2, 2, 5\)"
    ):
        mrope(x, x, x, positions=torch.zeros(2, 2, 5, dtype=torch.long))
    with pytest.raises(
        ValueError, match=r"positions must be an integer tensor of shape \(3, 2, 5\), got torch.float32"
    ):
        mrope(x, x, x, positions=positions.float())
