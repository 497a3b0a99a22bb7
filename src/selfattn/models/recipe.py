"""What one layer's attention is, as today's open models vary it from layer to layer.

A model is a list of :class:`LayerRecipe`: Gemma 2 alternates sliding-window and global layers,
Llama 4 puts a NoPE layer (no rotary, with temperature tuning) after every three chunked ones,
Gemma 3 gives its local layers their own rotary base. :func:`repeat_pattern` writes such a
stack in one line, and :class:`~selfattn.models.TransformerLM` takes it as ``layers=``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from selfattn._validation import require_positive_finite, require_positive_int, require_temperature_tuning

__all__ = ["LayerRecipe", "repeat_pattern"]


@dataclass(frozen=True)
class LayerRecipe:
    """One layer's attention: its position encoding and the options of its :class:`~selfattn.MultiHeadAttention`.

    Args:
        position: ``True`` to use the model's encoding (shared by the layers that use it),
            ``False`` for a NoPE layer (no encoding inside attention; an input encoding of the
            model still applies to its input).
        rotary_base: this layer's own rotary base (Gemma 3's local layers), when the model's
            encoding is rotary; None shares the model's.
        window: sliding-window size, or None.
        chunk_size: chunked attention (Llama 4), or None.
        softcap: logit soft-capping (Gemma 2), or None.
        sinks: a learnable sink logit per head (gpt-oss).
        qk_norm: RMSNorm of each query and key head (Qwen3, Gemma 3).
        gated_output: a sigmoid gate on the merged heads (Qwen3-Next).
        temperature_tuning: ``(attn_scale, floor_scale)`` for the queries (Llama 4's NoPE layers).
        scale: the softmax's score scale, or None for ``1 / sqrt(dh)``.
    """

    position: bool = True
    rotary_base: float | None = None
    window: int | None = None
    chunk_size: int | None = None
    softcap: float | None = None
    sinks: bool = False
    qk_norm: bool = False
    gated_output: bool = False
    temperature_tuning: tuple[float, float] | None = None
    scale: float | None = None

    def __post_init__(self) -> None:
        for name in ("position", "sinks", "qk_norm", "gated_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name in ("window", "chunk_size"):
            if getattr(self, name) is not None:
                require_positive_int(name, getattr(self, name))
        for name in ("rotary_base", "softcap", "scale"):
            if getattr(self, name) is not None:
                require_positive_finite(name, getattr(self, name))
        if self.temperature_tuning is not None:  # a tuple, so the frozen recipe stays hashable
            object.__setattr__(self, "temperature_tuning", require_temperature_tuning(self.temperature_tuning))
        if self.rotary_base is not None and not self.position:
            raise ValueError(f"rotary_base={self.rotary_base} is given for a layer without position (position=False)")

    def attention_options(self) -> dict[str, Any]:
        """The keyword arguments of :class:`~selfattn.MultiHeadAttention` this recipe sets."""
        options = asdict(self)
        del options["position"], options["rotary_base"]
        return options


def repeat_pattern(num_layers: int, *pattern: LayerRecipe) -> list[LayerRecipe]:
    """``num_layers`` recipes repeating ``pattern``: ``repeat_pattern(6, local, local, global_)``.

    Raises:
        ValueError: for a ``num_layers`` below 1, an empty pattern, or an entry that is not a
            :class:`LayerRecipe`.
    """
    num_layers = require_positive_int("num_layers", num_layers)
    if not pattern:
        raise ValueError("pattern must hold at least one LayerRecipe")
    return [check_recipe(pattern[i % len(pattern)], f"pattern[{i % len(pattern)}]") for i in range(num_layers)]


def check_recipe(recipe: object, name: str) -> LayerRecipe:
    if not isinstance(recipe, LayerRecipe):
        raise ValueError(f"{name} must be a LayerRecipe, got {type(recipe).__name__} {recipe!r}")
    return recipe


def check_recipes(layers: Sequence[LayerRecipe], num_layers: int) -> list[LayerRecipe]:
    """``layers`` checked: one :class:`LayerRecipe` per layer."""
    recipes = [check_recipe(recipe, f"layers[{i}]") for i, recipe in enumerate(layers)]
    if len(recipes) != num_layers:
        raise ValueError(f"layers must hold one LayerRecipe per layer ({num_layers}), got {len(recipes)}")
    return recipes
