"""Multimodal rotary (M-RoPE, Qwen2-VL): rotary driven by a (time, height, width) position per token.

Shape legend: b batch, h heads, l tokens, dh head size, n images or videos.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch

from selfattn._validation import require_positive_int
from selfattn.functional._rotary import (
    _angle_dtype,
    _check_rotary_inputs,
    _require_rotary_dim,
    _rotate,
    rotary_frequencies,
)
from selfattn.functional._sinusoidal import _require_base
from selfattn.positional._tables import KeepsTablePrecision
from selfattn.positional.base import QueryKeyEncoding

__all__ = ["MultimodalRotaryPositionalEncoding", "default_sections"]

# transformers' model types whose M-RoPE interleaves the sections (frequency j follows time,
# height, width in turn, ``j % 3``; Qwen3-VL's layout) whatever their config says; a model type
# matches itself and its ``_text`` / ``_moe_text`` sub-configs.
_INTERLEAVED_MROPE_MODELS = (
    "qwen3_vl",
    "qwen3_5",
    "qwen3_omni_moe",
    "qwen4_exp",
    "cohere_compass",
    "cosmos3_edge",
    "hy_v4_vl",
)


def default_sections(head_dim: int) -> tuple[int, int, int]:
    """Qwen2-VL's split of the ``dh / 2`` frequencies, scaled: a quarter to time, the rest to height and width.

    ``default_sections(128) == (16, 24, 24)``, the ``mrope_section`` of Qwen2-VL and Qwen2.5-VL.
    """
    half = head_dim // 2
    time = half // 4
    height = (half - time + 1) // 2
    return time, height, half - time - height


class MultimodalRotaryPositionalEncoding(KeepsTablePrecision, QueryKeyEncoding):
    """Rotary whose frequencies are shared out between the time, height and width of each token.

    Frequency ``j`` of the ``dh / 2`` (``w_j = base^(-2j / dh)``, the slowest last) turns the
    pair ``(j, j + dh / 2)`` (half-split, Hugging Face's ``rotate_half``) by ``p_a * w_j``,
    where ``p_a`` is the token's position along the axis ``a`` that owns ``j``: the first
    ``sections[0]`` frequencies follow time, the next ``sections[1]`` height, the last
    ``sections[2]`` width. This is Qwen2-VL's and Qwen2.5-VL's ``mrope_section``, so their
    attention weights port unchanged. A text token has the same position on all three axes,
    and then this is plain half-split rotary (:class:`RotaryPositionalEncoding` with
    ``interleaved=False``) at that position. Scores depend on the three position differences
    only. Angles are formed in float64 from the integer positions (Hugging Face forms them in
    float32).

    :func:`multimodal_positions` builds the three position rows for a sequence of text,
    image and video tokens, as Qwen2-VL does.

    Args:
        head_dim: size of each query/key ``dh``, even.
        base: the 10000 of the formula (``rope_theta``; Qwen2-VL uses 1000000).
        sections: how many of the ``dh / 2`` frequencies each axis (time, height, width) owns;
            they must add up to ``dh / 2``. Default :func:`default_sections` (``(16, 24, 24)``
            for ``dh = 128``).
        device: where the inverse frequencies live.
        dtype: accepted for uniformity; the frequencies stay float64.

    Shape:
        x ``(b, h, l, dh)`` (or ``(..., l, dh)``); positions ``(3, b, l)`` (one row per
        sequence and axis, Qwen2-VL's ``position_ids``), ``(3, l)`` (shared by the batch), any
        ``(3, ..., l)`` broadcastable to ``x.shape[:-1]``, or ``(l,)`` for text tokens (all
        axes equal) -> ``(b, h, l, dh)``. :class:`~selfattn.MultiHeadAttention` also takes
        text positions ``(l,)`` or ``(b, l)`` with it.
    """

    #: How many position axes a token has; :class:`~selfattn.MultiHeadAttention` reads it.
    position_axes: ClassVar[int] = 3
    exact_tables = ("inv_freq",)
    inv_freq: torch.Tensor

    def __init__(
        self,
        head_dim: int,
        base: float = 10000.0,
        *,
        sections: Sequence[int] | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = _require_rotary_dim(head_dim, "head_dim")
        self.base = _require_base(base)
        self.sections = self._check_sections(default_sections(self.head_dim) if sections is None else sections)
        self.register_buffer("inv_freq", torch.empty(0, dtype=torch.float64, device=device), persistent=False)
        self._build_tables()

    def _check_sections(self, sections: object) -> tuple[int, int, int]:
        half = self.head_dim // 2
        values = tuple(sections) if isinstance(sections, Sequence) and not isinstance(sections, str) else None
        if (
            values is None
            or len(values) != 3
            or any(isinstance(s, bool) or not isinstance(s, numbers.Integral) or s < 0 for s in values)
            or sum(values) != half
        ):
            raise ValueError(
                f"sections must be three non-negative integers (time, height, width) adding up to half the "
                f"head size, {half}; got sections={sections!r}"
            )
        return int(values[0]), int(values[1]), int(values[2])

    def reset_parameters(self) -> None:
        """Recompute the tables (after ``to_empty()`` from the meta device)."""
        self._build_tables()

    def _build_tables(self) -> None:
        """``inv_freq`` ``(dh / 2,)`` in float64 on the buffer's device."""
        self.inv_freq = rotary_frequencies(self.head_dim, self.base).to(self.inv_freq.device)

    def axis_positions(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``(3, ..., l)`` positions broadcastable to ``x.shape[:-1]``, from any accepted form (see the class)."""
        length = x.shape[-2]
        if not isinstance(positions, torch.Tensor) or positions.is_floating_point() or positions.is_complex():
            raise ValueError(f"positions must be an integer tensor, got {getattr(positions, 'dtype', positions)!r}")
        if positions.dim() == 1 and positions.shape[0] == length:
            return positions.expand(3, length)  # text: every axis at the same position
        if positions.dim() < 2 or positions.shape[0] != 3 or positions.shape[-1] != length:
            raise ValueError(
                f"positions must have shape (3, batch, {length}), (3, {length}) or ({length},) for text, "
                f"got {positions.dtype} {tuple(positions.shape)}"
            )
        if positions.dim() == 3 and x.dim() == 4:
            return positions[:, :, None, :]  # Qwen2-VL's (3, b, l): one row per sequence, shared by the heads
        return positions

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dim() < 2 or x.shape[-1] != self.head_dim:
            raise ValueError(f"x must have shape (..., length, {self.head_dim}), got {tuple(getattr(x, 'shape', ()))}")
        axes = self.axis_positions(x, positions)
        _check_rotary_inputs(x, axes[0])
        # Each axis turns its own section of the frequencies: (..., l, dh / 2) angles.
        angle_dtype = _angle_dtype(x.device)
        frequencies = torch.split(self.inv_freq.to(x.device, angle_dtype), list(self.sections))
        axes = axes.to(x.device, angle_dtype)
        angles = torch.cat([axes[a][..., None] * frequencies[a] for a in range(3)], dim=-1)
        compute_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        cos, sin = torch.cos(angles).to(compute_dtype), torch.sin(angles).to(compute_dtype)
        return _rotate(x.to(compute_dtype), cos, sin, interleaved=False).to(x.dtype)

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | Any, **options: Any) -> MultimodalRotaryPositionalEncoding:
        """The M-RoPE of a Hugging Face Qwen2-VL / Qwen2.5-VL text config (a dict or an object).

        Reads ``head_dim`` (or ``hidden_size / num_attention_heads``), ``rope_theta`` and
        ``mrope_section``, at the top level or inside ``rope_parameters`` / ``rope_scaling``.
        Configs whose rotary this class would compute differently are refused: interleaved
        sections (Qwen3-VL and its successors, ``mrope_interleaved``), a ``rope_type`` other than
        ``"default"`` (scaling), a ``partial_rotary_factor`` below 1.

        Raises:
            ValueError: a missing size or no ``mrope_section``, or a setting above, named.
        """
        parameters = _read(config, "rope_parameters") or _read(config, "rope_scaling") or {}
        if not isinstance(parameters, Mapping):
            raise ValueError(f"config rope_parameters must be a dict, got {type(parameters).__name__}")
        _refuse_what_it_cannot_express(config, parameters)
        sections = parameters.get("mrope_section", _read(config, "mrope_section"))
        if sections is None:
            raise ValueError("config has no mrope_section (in rope_parameters or rope_scaling)")
        base = parameters.get("rope_theta", _read(config, "rope_theta"))
        head_dim = _read(config, "head_dim")
        if head_dim is None:
            hidden, heads = _read(config, "hidden_size"), _read(config, "num_attention_heads")
            if hidden is None or heads is None:
                raise ValueError("config needs head_dim, or hidden_size and num_attention_heads")
            head_dim = require_positive_int("hidden_size", hidden) // require_positive_int("num_attention_heads", heads)
        return cls(head_dim, 10000.0 if base is None else float(base), sections=tuple(sections), **options)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, base={self.base:g}, sections={self.sections}"


def _read(source: Mapping[str, Any] | Any, key: str) -> Any:
    """``source[key]`` of a dict, ``source.key`` of a config object; None when absent."""
    return source.get(key) if isinstance(source, Mapping) else getattr(source, key, None)


def _refuse_what_it_cannot_express(config: Mapping[str, Any] | Any, parameters: Mapping[str, Any]) -> None:
    """Raise for a config whose rotary is not contiguous-section M-RoPE at full width without scaling."""
    for key in ("mrope_interleaved", "interleaved"):
        value = parameters.get(key, _read(config, key))
        if value:
            raise ValueError(
                f"config sets {key}={value!r}: its M-RoPE interleaves the time, height and width frequencies "
                "(Qwen3-VL's layout), and MultimodalRotaryPositionalEncoding has contiguous sections only "
                "(Qwen2-VL, Qwen2.5-VL); interleaved M-RoPE is not implemented"
            )
    model_type = _read(config, "model_type")
    if isinstance(model_type, str) and any(
        model_type == family or model_type.startswith(f"{family}_") for family in _INTERLEAVED_MROPE_MODELS
    ):
        raise ValueError(
            f"config model_type={model_type!r} interleaves its M-RoPE sections (transformers' Qwen3-VL layout, "
            "set or not by mrope_interleaved), and MultimodalRotaryPositionalEncoding has contiguous sections "
            "only (Qwen2-VL, Qwen2.5-VL); interleaved M-RoPE is not implemented"
        )
    rope_type = parameters.get("rope_type", parameters.get("type"))
    if rope_type not in (None, "default", "mrope"):
        raise ValueError(
            f"config rope_type={rope_type!r} rescales the rotary frequencies; MultimodalRotaryPositionalEncoding "
            "implements rope_type 'default' only"
        )
    fraction = parameters.get("partial_rotary_factor", _read(config, "partial_rotary_factor"))
    if fraction is not None and fraction != 1:
        raise ValueError(
            f"config partial_rotary_factor={fraction!r} rotates part of each head; "
            "MultimodalRotaryPositionalEncoding rotates all of it"
        )
