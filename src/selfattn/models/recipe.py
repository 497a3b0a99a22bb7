"""What one layer's attention is, as today's open models vary it from layer to layer.

A model is a list of :class:`LayerRecipe`: Gemma 2 alternates sliding-window and global layers,
Llama 4 puts a NoPE layer (no rotary, with temperature tuning) after every three chunked ones,
Gemma 3 gives its local layers their own rotary base, Gemma 4 its global layers other head
counts and sizes, and Gemma 3n's and Gemma 4's last layers read the keys and values of an earlier
layer (``shares_kv_with``). :func:`repeat_pattern` writes such a stack in one line, and
:class:`~selfattn.models.TransformerLM` takes it as ``layers=``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

from selfattn._validation import (
    require_non_negative_int,
    require_positive_finite,
    require_positive_int,
    require_temperature_tuning,
)

__all__ = ["LayerRecipe", "LayerSizes", "repeat_pattern"]


class LayerSizes(NamedTuple):
    """One layer's attention sizes: query heads ``h``, key/value heads ``hk`` and head size ``dh``."""

    num_heads: int
    num_kv_heads: int
    head_dim: int


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
        num_heads: this layer's query heads, or None for the model's.
        num_kv_heads: this layer's key/value heads (grouped-query attention), or None for the
            model's (its ``num_heads``: the model's own layers are not grouped).
        head_dim: this layer's head size, or None for the model's (``d / num_heads``). A layer whose
            ``num_heads * head_dim`` differs from ``d`` projects from and back to ``d``, and gets
            the model's query/key or score encoding built anew for its heads (one per distinct shape).
        shares_kv_with: the index of an earlier layer whose keys and values this layer reads (Gemma
            3n's and Gemma 4's KV sharing), as that layer attended to them (normalized, rotated,
            cache included); this layer projects none of its own (``shared_kv=True``: no ``W_k``,
            ``W_v`` nor ``k_norm``). The model checks that the source shares nothing itself and has
            this layer's key/value heads, head size, ``position`` and ``rotary_base``; when
            decoding, this layer's cache is a view of the source's, which stores them once.
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
    num_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    shares_kv_with: int | None = None

    def __post_init__(self) -> None:
        for name in ("position", "sinks", "qk_norm", "gated_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name in ("window", "chunk_size", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) is not None:
                require_positive_int(name, getattr(self, name))
        for name in ("rotary_base", "softcap", "scale"):
            if getattr(self, name) is not None:
                require_positive_finite(name, getattr(self, name))
        if self.temperature_tuning is not None:  # a tuple, so the frozen recipe stays hashable
            object.__setattr__(self, "temperature_tuning", require_temperature_tuning(self.temperature_tuning))
        if self.shares_kv_with is not None:
            require_non_negative_int("shares_kv_with", self.shares_kv_with)
        if self.rotary_base is not None and not self.position:
            raise ValueError(f"rotary_base={self.rotary_base} is given for a layer without position (position=False)")

    def attention_options(self) -> dict[str, Any]:
        """The keyword arguments of :class:`~selfattn.MultiHeadAttention` this recipe sets, besides its sizes
        (:meth:`sizes`)."""
        options = asdict(self)
        for name in ("position", "rotary_base", "num_heads", "num_kv_heads", "head_dim", "shares_kv_with"):
            del options[name]
        options["shared_kv"] = self.shares_kv_with is not None
        return options

    def sizes(self, num_hiddens: int, num_heads: int) -> LayerSizes:
        """This layer's heads and head size in a model of size ``num_hiddens`` with ``num_heads`` heads.

        Raises:
            ValueError: when the model's head size is needed and ``num_heads`` does not divide ``num_hiddens``.
        """
        if self.head_dim is None and num_hiddens % num_heads:
            raise ValueError(f"num_hiddens={num_hiddens} is not divisible by num_heads={num_heads}")
        heads = num_heads if self.num_heads is None else self.num_heads
        kv_heads = num_heads if self.num_kv_heads is None else self.num_kv_heads
        return LayerSizes(heads, kv_heads, num_hiddens // num_heads if self.head_dim is None else self.head_dim)


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


def check_stack(recipes: Sequence[LayerRecipe], num_hiddens: int, num_heads: int) -> None:
    """Each layer's sizes fit together, and each ``shares_kv_with`` names a layer whose keys it can read.

    Raises:
        ValueError: naming ``layers[i]``'s field and value: heads that ``num_kv_heads`` does not
            divide; a source that is not an earlier layer, that shares itself, or whose key/value
            heads, head size, ``position`` or ``rotary_base`` differ from the sharing layer's.
    """
    for index, recipe in enumerate(recipes):
        sizes = recipe.sizes(num_hiddens, num_heads)
        if sizes.num_heads % sizes.num_kv_heads:
            given = "num_kv_heads" if recipe.num_kv_heads is not None else "num_kv_heads (the model's num_heads)"
            raise ValueError(
                f"layers[{index}].num_heads={sizes.num_heads} is not divisible by {given}={sizes.num_kv_heads}"
            )
        if recipe.shares_kv_with is not None:
            _check_source(recipes, index, num_hiddens, num_heads)


def _check_source(recipes: Sequence[LayerRecipe], index: int, num_hiddens: int, num_heads: int) -> None:
    recipe = recipes[index]
    source_index = recipe.shares_kv_with
    assert source_index is not None
    field = f"layers[{index}].shares_kv_with={source_index}"
    if source_index >= index:
        earlier = f"one of 0..{index - 1}" if index else "and layer 0 has none"
        raise ValueError(f"{field}: a layer reads the keys and values of an earlier layer, {earlier}")
    source = recipes[source_index]
    if source.shares_kv_with is not None:
        raise ValueError(
            f"{field}: layer {source_index} reads layer {source.shares_kv_with}'s keys and values itself; "
            f"name layer {source.shares_kv_with}"
        )
    mine, theirs = recipe.sizes(num_hiddens, num_heads), source.sizes(num_hiddens, num_heads)
    if (mine.num_kv_heads, mine.head_dim) != (theirs.num_kv_heads, theirs.head_dim):
        raise ValueError(
            f"{field}: layer {source_index} has {theirs.num_kv_heads} key/value heads of size {theirs.head_dim}, "
            f"this layer {mine.num_kv_heads} of size {mine.head_dim}"
        )
    if (recipe.position, recipe.rotary_base) != (source.position, source.rotary_base):
        raise ValueError(
            f"{field}: layer {source_index} has position={source.position}, rotary_base={source.rotary_base}; "
            f"this layer position={recipe.position}, rotary_base={recipe.rotary_base} (its queries must be "
            "encoded as the keys it reads)"
        )
