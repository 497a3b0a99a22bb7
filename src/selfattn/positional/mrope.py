"""Multimodal rotary (M-RoPE, Qwen2-VL, Qwen3-VL): rotary driven by a (time, height, width) position per token.

Shape legend: b batch, h heads, l tokens, dh head size, r rotated features, n images or videos.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Literal

import torch

from selfattn._validation import require_positive_int
from selfattn.functional._rotary import (
    _angle_dtype,
    _check_rotary_inputs,
    _require_rotary_dim,
    _rotate_by_angles,
    rotary_frequencies,
)
from selfattn.functional._sinusoidal import _require_base
from selfattn.positional._tables import KeepsTablePrecision
from selfattn.positional.base import QueryKeyEncoding

__all__ = ["MRoPELayout", "MultimodalRotaryPositionalEncoding", "default_sections", "frequency_axes"]

#: How the frequencies are shared out between the axes: contiguous sections (Qwen2-VL) or in turn (Qwen3-VL).
MRoPELayout = Literal["sectioned", "interleaved"]

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


def frequency_axes(sections: Sequence[int], layout: MRoPELayout = "sectioned") -> tuple[int, ...]:
    """The axis (0 time, 1 height, 2 width) each of the ``sum(sections)`` frequencies reads its position from.

    ``"sectioned"`` (Qwen2-VL): the first ``sections[0]`` frequencies follow time, the next
    ``sections[1]`` height, the last ``sections[2]`` width. ``"interleaved"`` (Qwen3-VL, Qwen3.5:
    transformers' ``recomposition_frequencies``): frequency ``j`` follows height when
    ``j % 3 == 1 and j < 3 * sections[1]``, width when ``j % 3 == 2 and j < 3 * sections[2]``, time
    otherwise; so every axis has fast and slow frequencies. ``frequency_axes((2, 1, 1), "interleaved")
    == (0, 1, 2, 0)``.
    """
    if layout == "sectioned":
        return tuple(axis for axis, count in enumerate(sections) for _ in range(count))
    if layout != "interleaved":
        raise ValueError(f"layout must be 'sectioned' or 'interleaved', got {layout!r}")
    height_stop, width_stop = 3 * sections[1], 3 * sections[2]

    def axis_of(j: int) -> int:
        if j % 3 == 1 and j < height_stop:
            return 1
        return 2 if j % 3 == 2 and j < width_stop else 0

    return tuple(axis_of(j) for j in range(sum(sections)))


class MultimodalRotaryPositionalEncoding(KeepsTablePrecision, QueryKeyEncoding):
    """Rotary whose frequencies are shared out between the time, height and width of each token.

    Frequency ``j`` of the ``r / 2`` (``w_j = base^(-2j / r)``, the slowest last; ``r`` is
    ``rotary_dim``, default ``dh``) turns the pair ``(j, j + r / 2)`` of the first ``r`` features
    (half-split, Hugging Face's ``rotate_half``) by ``p_a * w_j``, where ``p_a`` is the token's
    position along the axis ``a`` that reads ``j`` (:func:`frequency_axes`); the features past
    ``r`` pass through (partial rotary, Qwen3.5's ``partial_rotary_factor``). ``layout="sectioned"``:
    the first ``sections[0]`` frequencies follow time, the next ``sections[1]`` height, the last
    ``sections[2]`` width (Qwen2-VL's and Qwen2.5-VL's ``mrope_section``); ``layout="interleaved"``:
    the axes take the frequencies in turn (Qwen3-VL's, Qwen3.5's), so their attention weights port
    unchanged. A text token has the same position on all three axes, and then either layout is
    plain half-split rotary (:class:`RotaryPositionalEncoding` with ``interleaved=False``) at that
    position. Scores depend on the three position differences only. Angles are formed in float64
    from the integer positions (Hugging Face forms them in float32).

    :func:`multimodal_positions` builds the three position rows for a sequence of text,
    image and video tokens, as Qwen2-VL does.

    Args:
        head_dim: size of each query/key ``dh``, even.
        base: the 10000 of the formula (``rope_theta``; Qwen2-VL uses 1000000).
        sections: how many of the ``r / 2`` frequencies each axis (time, height, width) owns;
            they must add up to ``r / 2``. Default :func:`default_sections` of ``r`` (``(16, 24,
            24)`` for ``r = 128``).
        layout: ``"sectioned"`` (contiguous sections) or ``"interleaved"`` (in turn); see
            :func:`frequency_axes`.
        rotary_dim: how many leading features of each head rotate ``r`` (even, ``<= dh``);
            default ``dh``.
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
        layout: MRoPELayout = "sectioned",
        rotary_dim: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = require_positive_int("head_dim", head_dim)
        if rotary_dim is None:
            self.rotary_dim = _require_rotary_dim(self.head_dim, "head_dim")
        else:
            self.rotary_dim = _require_rotary_dim(rotary_dim, "rotary_dim")
        if self.rotary_dim > self.head_dim:
            raise ValueError(f"rotary_dim must be at most head_dim={self.head_dim}, got rotary_dim={self.rotary_dim}")
        if layout not in ("sectioned", "interleaved"):
            raise ValueError(f"layout must be 'sectioned' or 'interleaved', got {layout!r}")
        self.layout: MRoPELayout = layout
        self.base = _require_base(base)
        self.sections = self._check_sections(default_sections(self.rotary_dim) if sections is None else sections)
        self.register_buffer("inv_freq", torch.empty(0, dtype=torch.float64, device=device), persistent=False)
        self._build_tables()

    def _check_sections(self, sections: object) -> tuple[int, int, int]:
        half = self.rotary_dim // 2
        values = tuple(sections) if isinstance(sections, Sequence) and not isinstance(sections, str) else None
        if (
            values is None
            or len(values) != 3
            or any(isinstance(s, bool) or not isinstance(s, numbers.Integral) or s < 0 for s in values)
            or sum(values) != half
        ):
            raise ValueError(
                f"sections must be three non-negative integers (time, height, width) adding up to half the "
                f"{'head' if self.rotary_dim == self.head_dim else 'rotated'} size, {half}; got sections={sections!r}"
            )
        return int(values[0]), int(values[1]), int(values[2])

    def reset_parameters(self) -> None:
        """Recompute the tables (after ``to_empty()`` from the meta device)."""
        self._build_tables()

    def _build_tables(self) -> None:
        """``inv_freq`` ``(r / 2,)`` in float64 on the buffer's device, and which axis each frequency reads."""
        self.inv_freq = rotary_frequencies(self.rotary_dim, self.base).to(self.inv_freq.device)
        self.frequency_axes = frequency_axes(self.sections, self.layout)
        self._axis_masks: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def _reads(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Masks ``(r / 2,)`` of the frequencies that read height, and width, on ``device``: a cache, not a buffer
        (the layout fixes it; a state dict or a dtype cast has nothing to do with it)."""
        if device not in self._axis_masks:
            axes = torch.tensor(self.frequency_axes, device=device)
            self._axis_masks[device] = (axes == 1, axes == 2)
        return self._axis_masks[device]

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
        # Frequency j turns by the position along the axis that reads it: (..., l, r / 2) angles.
        angle_dtype = _angle_dtype(x.device)
        frequencies = self.inv_freq.to(x.device, angle_dtype)
        by_axis = axes.to(x.device, angle_dtype)[..., None] * frequencies  # (3, ..., l, r / 2)
        reads_height, reads_width = self._reads(x.device)
        angles = torch.where(reads_height, by_axis[1], by_axis[0])
        angles = torch.where(reads_width, by_axis[2], angles)
        return _rotate_by_angles(x, torch.cos(angles), torch.sin(angles), interleaved=False, rotary_dim=self.rotary_dim)

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | Any, **options: Any) -> MultimodalRotaryPositionalEncoding:
        """The M-RoPE of a Hugging Face Qwen2-VL, Qwen2.5-VL, Qwen3-VL or Qwen3.5 text config (a dict or an object).

        Reads ``head_dim`` (or ``hidden_size / num_attention_heads``), ``rope_theta``,
        ``mrope_section`` and ``partial_rotary_factor`` (rotary size ``int(head_dim * factor)``),
        at the top level or inside ``rope_parameters`` / ``rope_scaling``. The layout is
        ``"interleaved"`` when the config sets ``mrope_interleaved`` (or ``interleaved``) or its
        ``model_type`` is one whose transformers rotary interleaves whatever the flag says
        (Qwen3-VL and its successors), else ``"sectioned"``. A ``rope_type`` other than
        ``"default"`` (a scaling) is refused.

        Raises:
            ValueError: a missing size or no ``mrope_section``, a scaling, or a rotary size that is
                not even, named.
        """
        parameters = _read(config, "rope_parameters") or _read(config, "rope_scaling") or {}
        if not isinstance(parameters, Mapping):
            raise ValueError(f"config rope_parameters must be a dict, got {type(parameters).__name__}")
        rope_type = parameters.get("rope_type", parameters.get("type"))
        if rope_type not in (None, "default", "mrope"):
            raise ValueError(
                f"config rope_type={rope_type!r} rescales the rotary frequencies; MultimodalRotaryPositionalEncoding "
                "implements rope_type 'default' only"
            )
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
        head_dim = require_positive_int("head_dim", head_dim)
        fraction = parameters.get("partial_rotary_factor", _read(config, "partial_rotary_factor"))
        fraction = 1.0 if fraction is None else fraction
        if isinstance(fraction, bool) or not isinstance(fraction, numbers.Real) or not 0 < float(fraction) <= 1:
            raise ValueError(f"config partial_rotary_factor must be in (0, 1], got {fraction!r}")
        rotary_dim = int(head_dim * float(fraction))
        if rotary_dim < 2 or rotary_dim % 2:
            raise ValueError(
                f"config head_dim={head_dim} * partial_rotary_factor={fraction} gives {rotary_dim} rotated features; "
                "need an even number >= 2"
            )
        return cls(
            head_dim,
            10000.0 if base is None else float(base),
            sections=tuple(sections),
            layout=_layout(config, parameters),
            rotary_dim=rotary_dim,
            **options,
        )

    def extra_repr(self) -> str:
        partial = "" if self.rotary_dim == self.head_dim else f", rotary_dim={self.rotary_dim}"
        return (
            f"head_dim={self.head_dim}{partial}, base={self.base:g}, sections={self.sections}, layout={self.layout!r}"
        )


def _read(source: Mapping[str, Any] | Any, key: str) -> Any:
    """``source[key]`` of a dict, ``source.key`` of a config object; None when absent."""
    return source.get(key) if isinstance(source, Mapping) else getattr(source, key, None)


def _layout(config: Mapping[str, Any] | Any, parameters: Mapping[str, Any]) -> MRoPELayout:
    """``"interleaved"`` for a config whose flag says so or whose model type interleaves regardless."""
    for key in ("mrope_interleaved", "interleaved"):
        if parameters.get(key, _read(config, key)):
            return "interleaved"
    model_type = _read(config, "model_type")
    if isinstance(model_type, str) and any(
        model_type == family or model_type.startswith(f"{family}_") for family in _INTERLEAVED_MROPE_MODELS
    ):
        return "interleaved"
    return "sectioned"
