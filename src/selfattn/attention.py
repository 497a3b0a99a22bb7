"""Multi-head attention with the chapter's ``valid_lens``, causal masks, positions and a cache.

The layer is its projections ``W_q, W_k, W_v, W_o``, a position scheme, and parts
(:mod:`selfattn.parts`), each acting at one slot of the pass. ``forward`` reads as its steps: check
the arguments, describe the call (:mod:`selfattn._layer_call`: projections made on first use,
positions, the cache's keys, what each query may see), let the dispatcher
(:mod:`selfattn.core.dispatch`) choose a route and run it, project out. A decoding step of a kind the layer
has run replays the plan that step left (:mod:`selfattn._decode_plan`): the same route, without the checks.

Shape legend:
    b: batch, lq: queries, lk: keys, h: heads, hk: key/value heads, dh: query/key head size
    (num_hiddens / h), dv: value head size, d: num_hiddens, dq / dk / dv_in: feature sizes of
    queries / keys / values.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

import selfattn._decode_plan as decode_plan
import selfattn.core.dispatch as dispatch
import selfattn.masks as masks
from selfattn._cache_checks import copy_for_dry_run
from selfattn._layer_call import describe, for_heads
from selfattn._layer_options import KEYWORD_PARTS, OPTION_NAMES, build_projections, layer_options, shorthand_parts
from selfattn._scripting import NotScriptable
from selfattn.cache import KVCache
from selfattn.core.dispatch import Explanation
from selfattn.core.documents import cumulative_lengths_to_document_ids, document_positions
from selfattn.core.inputs import check_request
from selfattn.parts import SLOTS, HeadNorm, OutputGate, Part, TemperatureTuning
from selfattn.positional.base import PositionalEncoding, QueryKeyEncoding
from selfattn.positional.rotary import RotaryPositionalEncoding

__all__ = ["MultiHeadAttention", "cumulative_lengths_to_document_ids", "document_positions"]

_KEPT = ("num_hiddens", "num_heads", "num_kv_heads", "head_dim", "value_head_dim", "dropout", "query_size",
         "key_size", "value_size", "output_size", "position", "window", "chunk_size", "block_size",
         "skip_padded_queries", "scale", "softcap", "shared_kv")  # fmt: skip


class MultiHeadAttention(NotScriptable, nn.Module):
    """Multi-head scaled dot-product attention, named as in the chapter.

    The projections ``W_q, W_k, W_v, W_o`` are ``nn.Linear`` layers, so a ``state_dict``
    saved from the textbook's ``MultiHeadAttention`` loads as it is.

    Differences from the textbook, all deliberate:

    * a query whose valid length is 0 attends to nothing: its output row and weights are
      zeros (the textbook returns a uniform average over the padding);
    * keys at or past the longest valid length are never projected nor scored, and a batch
      whose sequences have few distinct valid lengths runs one fused call per length, each
      on its own keys only;
    * ``causal=True`` with fewer queries than keys aligns the mask to the last key;
    * with ``skip_padded_queries=True`` (opt-in), padded query rows are zeros, not computed.

    Args:
        num_hiddens: size ``d`` of the merged heads, split over them (``h * dh``), and of the
            output unless ``output_size`` is given.
        num_heads: number of query heads ``h``; must divide ``num_hiddens``.
        dropout: dropout on the attention weights (training only).
        bias: whether the four projections have a bias.
        output_bias: whether ``W_o`` has one (default ``bias``): Qwen2 and Qwen2-VL have a bias on
            ``W_q, W_k, W_v`` only.
        query_size: feature size of the queries (default ``num_hiddens``).
        key_size: feature size of the keys (default ``num_hiddens``).
        value_size: feature size of the values (default ``num_hiddens``).
        output_size: feature size of the output, ``W_o``'s ``out_features`` (default
            ``num_hiddens``): a model whose ``h * dh`` differs from its hidden size (Gemma, gpt-oss).
        position: a query/key encoding (rotary) or a score encoding (ALiBi, T5, Shaw, Kerple,
            FIRE) applied inside attention. Encodings added to the input are applied by the caller.
            It must be built for this layer: for ``num_heads`` heads (score encodings) or head
            size ``num_hiddens / num_heads`` (rotary, xPos, M-RoPE, Shaw), else ``ValueError``.
        num_kv_heads: heads of the keys and values ``hk`` (grouped-query attention; 1 is
            multi-query attention); must divide ``num_heads``. Key/value head ``j`` serves
            query heads ``j * g .. j * g + g - 1`` (``g = h / hk``, as Llama's ``repeat_kv``),
            ``W_k`` and ``W_v`` have ``hk * dh`` outputs and a cache stores only ``hk`` heads.
            Default ``num_heads``.
        window: sliding-window attention: with ``causal=True`` query ``i`` sees keys
            ``i - window + 1 .. i``, otherwise keys with ``|i - j| < window`` (indices in the
            whole sequence, cache included). Long sequences cost O(l * window).
        device: where the parameters are created (``"meta"`` for deferred initialization,
            then ``to_empty()`` and :meth:`reset_parameters`).
        dtype: dtype of the parameters.
        block_size: queries per block when attention goes blockwise (score encodings, dropout);
            default :func:`~selfattn.functional.choose_block_size` from the sizes of each call.
        scale: the softmax's score scale (default ``1 / sqrt(dh)``): Gemma's
            ``query_pre_attn_scalar ** -0.5``, T5's 1.
        softcap: logit soft-capping (Gemma 2's ``attn_logit_softcapping``): each scaled score
            plus the score term's bias ``x`` becomes ``softcap * tanh(x / softcap)``, before the mask.
        sinks: a learnable sink logit per query head (gpt-oss), the parameter ``sinks`` ``(h,)``
            (zeros at first): it joins each softmax's denominator and adds no value, so a query
            may give part of its attention to nothing.
        qk_norm: RMSNorm over each head of the queries and of the keys, after projection and
            before the rotation (Qwen3, Gemma 3): the parts ``q_norm`` and ``k_norm``
            (:class:`~selfattn.parts.HeadNorm` with ``(dh,)`` weights).
        qk_norm_eps: the RMSNorm's epsilon.
        chunk_size: chunked attention (Llama 4's ``attention_chunk_size``): a query sees only keys
            of its own chunk, ``p_i // chunk_size == p_j // chunk_size`` for the tokens' positions
            ``p`` (by default their indices in the whole sequence, cache included; with left
            padding, ``positions`` counted from each row's first token start its chunks there,
            as Llama 4 does); combined with every other mask by "and".
        temperature_tuning: ``(attn_scale, floor_scale)``: each query at position ``p`` is
            multiplied by ``1 + attn_scale * log(1 + floor((p + 1) / floor_scale))`` before
            attention (Llama 4's NoPE layers, which sharpen attention at long range): the part
            ``query_scaling`` (:class:`~selfattn.parts.TemperatureTuning`).
        gated_output: a sigmoid gate per output feature, ``sigmoid(W_g(queries))``, multiplies
            the merged heads before ``W_o`` (Qwen3-Next's full-attention layers): the part ``W_g``
            (:class:`~selfattn.parts.OutputGate`).
        value_head_dim: the value heads' size ``dv`` (default ``dh``): ``W_v`` has ``hk * dv``
            outputs and ``W_o`` ``h * dv`` inputs (MiMo-V2-Flash: ``dh`` 192, ``dv`` 128).
        values_from_keys: the values are ``W_k``'s output before the key parts and the rotation
            (Gemma 4's global layers); the layer has no ``W_v``.
        shared_kv: the keys and values are another layer's (Gemma 3n's and Gemma 4's last layers): the
            layer has no ``W_k``, ``W_v`` nor key or value parts (``qk_norm`` normalizes its queries
            only), and each call reads what the source layer's latest call attended to from ``cache``,
            a :class:`~selfattn.models.SharedKVView` of the source's cache.
        parts: more parts, ``{name: part}`` (:mod:`selfattn.parts`): each acts at its slot, after
            the keywords' parts of that slot, in the given order; ``name`` is its attribute and its
            state dict prefix.
        skip_padded_queries: self-attention over a padded batch with per-sequence ``valid_lens``
            ``(b,)``: rows ``i >= valid_lens[s]`` of sequence ``s`` are padding as queries too.
            Their output (and attention weights) are exactly zero, with no ``W_o`` bias, and
            the padded rows of the queries, keys and values are never read (a NaN there reaches
            no output and no gradient), so each valid row equals running its sequence alone at
            its own length. Ragged batches then project and attend only each sequence's valid
            rows; other paths (masks, windows, score encodings, compiled graphs) compute the
            padded rows from zeros and discard them. Default ``False``: the chapter's masked
            softmax, where a padded query attends over its sequence's valid keys. Needs
            ``valid_lens`` of shape ``(b,)``, as many queries as keys and no cache (else
            ``ValueError``); without ``valid_lens`` it changes nothing.
    """

    num_hiddens: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    value_head_dim: int
    dropout: float
    query_size: int
    key_size: int
    value_size: int
    output_size: int
    position: PositionalEncoding | None
    window: int | None
    chunk_size: int | None
    block_size: int | None
    skip_padded_queries: bool
    scale: float | None
    softcap: float | None
    shared_kv: bool
    W_q: nn.Linear
    W_k: nn.Linear | None
    W_v: nn.Linear | None
    W_o: nn.Linear
    sinks: nn.Parameter | None
    q_norm: HeadNorm | None
    k_norm: HeadNorm | None
    W_g: OutputGate | None
    # The transformers family a layer was loaded from (from_transformers); to_transformers_config writes it first.
    transformers_model_type: str | None = None

    def __init__(
        self, num_hiddens: int, num_heads: int, dropout: float = 0.0, *, bias: bool = False,
        output_bias: bool | None = None, query_size: int | None = None, key_size: int | None = None,
        value_size: int | None = None, output_size: int | None = None, position: PositionalEncoding | None = None,
        num_kv_heads: int | None = None, value_head_dim: int | None = None, values_from_keys: bool = False,
        shared_kv: bool = False, window: int | None = None, block_size: int | None = None,
        skip_padded_queries: bool = False, scale: float | None = None, softcap: float | None = None,
        sinks: bool = False, qk_norm: bool = False,
        qk_norm_eps: float = 1e-6, gated_output: bool = False, chunk_size: int | None = None,
        temperature_tuning: tuple[float, float] | None = None, parts: Mapping[str, Part] | None = None,
        device: torch.device | str | None = None, dtype: torch.dtype | None = None,
    ):  # fmt: skip
        options = {name: value for name, value in locals().items() if name in OPTION_NAMES}
        super().__init__()
        checked = layer_options(num_hiddens, num_heads, dropout, options)
        for name in _KEPT:
            setattr(self, name, getattr(checked, name))
        for name, weight in build_projections(checked).items():
            setattr(self, name, weight)
        self.q_norm = self.k_norm = self.W_g = None  # the shorthands' parts, when given
        parts = shorthand_parts(checked)
        for name, part in parts.items():
            if name not in ("q_norm", "k_norm", "W_g") and hasattr(self, name):
                raise ValueError(f"parts[{name!r}]: the name is an attribute of the layer; choose another")
            setattr(self, name, part)
        self.part_names = {slot: tuple(n for n, p in parts.items() if p.slot == slot) for slot in SLOTS}

    def __setattr__(self, name: str, value: Any) -> None:
        decode_plan.drop(self)  # an option, a part or an encoding set anew: the next step runs in full
        super().__setattr__(name, value)

    def _apply(self, fn: Any, recurse: bool = True) -> MultiHeadAttention:
        decode_plan.drop(self)  # .to(), .half(), ...: the weights' dtype or device may change
        return super()._apply(fn, recurse)  # type: ignore[no-untyped-call, no-any-return]

    def reset_parameters(self) -> None:
        """Reset ``position`` and the parts of ``parts=`` (built before this module, in that order), re-draw the
        projections as ``nn.Linear`` does, then reset the keywords' parts (built after them, as ``gated_output``'s).

        With the same seed this repeats a normal construction, so meta-device modules can be
        materialized with ``to_empty()`` and this method.
        """
        names = [name for name in self._modules if any(name in self.part_names[slot] for slot in SLOTS)]  # in order
        given = [self._modules[name] for name in names if name not in KEYWORD_PARTS]
        own = [self._modules[name] for name in names if name in KEYWORD_PARTS]
        for layer in (self.position, *given, self.W_q, self.W_k, self.W_v, self.W_o, *own):
            reset_layer = getattr(layer, "reset_parameters", None)
            if callable(reset_layer):
                reset_layer()
        if self.sinks is not None:
            with torch.no_grad():
                self.sinks.zero_()

    @classmethod
    def from_torch(
        cls, module: nn.MultiheadAttention, *, position: PositionalEncoding | None = None
    ) -> MultiHeadAttention:
        """The same attention as ``module`` (an ``nn.MultiheadAttention``), with its weights copied.

        Projections (``in_proj`` or the separate ``q/k/v_proj`` of ``kdim``/``vdim``), the output projection,
        their biases and the dropout are copied, on ``module``'s device and dtype. Call the result with
        batch-first tensors ``(b, l, d)`` whatever ``module.batch_first`` was, and note that a bool ``attn_mask``
        here means True = attend (``nn.MultiheadAttention``: True = masked out); a bool ``key_padding_mask`` means
        the same in both (a float one, which torch adds to the scores, is refused).

        Raises:
            ValueError: for ``add_bias_kv`` or ``add_zero_attn``, which have no equivalent here.
        """
        from selfattn.integrations.from_torch import from_torch

        return from_torch(module, cls, position=position)

    @classmethod
    def from_transformers(cls, layer: nn.Module) -> MultiHeadAttention:
        """The same attention as a Hugging Face transformers (5.x) attention layer, with its weights copied.

        Reads the layer and the config it carries (``layer.config``, ``layer.layer_idx``); the
        families it knows, and how each becomes parts, are the table
        :data:`selfattn.integrations.families.FAMILIES`. Then
        ``mha(x, x, x, causal=True, positions=position_ids)`` equals the layer run with its model's
        rotary embedding and its causal (sliding, chunked) mask; pass the attention mask's padding
        as ``key_padding_mask`` (M-RoPE families take ``(3, b, l)`` positions).

        Two Llama 4 details differ with left padding: transformers tunes a NoPE layer's
        temperature by each token's index in the padded batch (pass those indices as
        ``positions`` there), and counts a chunked layer's chunks from each sequence's first
        token, which ``chunk_size`` (chunks of indices) does not.

        Raises:
            ValueError: an unknown layer class, or a layer type or option this module cannot
                express (e.g. a bidirectional Gemma layer, a bias on only some projections), named.
        """
        from selfattn.integrations.from_transformers import from_transformers

        return from_transformers(layer, cls)

    def to_transformers_config(self) -> dict[str, Any]:
        """The Hugging Face config fields that rebuild this module as one transformers attention layer.

        See :func:`selfattn.integrations.from_transformers.to_transformers_config`.
        """
        from selfattn.integrations.from_transformers import to_transformers_config

        return to_transformers_config(self)

    def forward(
        self,
        queries: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        valid_lens: torch.Tensor | None = None,
        *,
        causal: bool = False,
        return_weights: bool = False,
        offset: int | None = None,
        cache: KVCache | None = None,
        positions: torch.Tensor | None = None,
        key_positions: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        key_padding_mask: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        cumulative_lengths: torch.Tensor | Sequence[torch.Tensor | Sequence[int]] | None = None,
        mask: masks.Rule | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attend from ``queries`` to ``keys``/``values``.

        Every mask below combines with every other (a key is seen only if all allow it).
        Indices ``i``/``j`` count tokens in the whole sequence (cache included); positions are
        what the encodings see, and default to the indices shifted by ``offset``.

        Args:
            queries: ``(b, lq, dq)``.
            keys: ``(b, lk, dk)``.
            values: ``(b, lk, dv)``.
            valid_lens: ``(b,)`` or ``(b, lq)``; key ``j`` is visible iff ``j < valid_len``
                (with a cache, ``j`` counts every key stored, and lengths may reach
                ``cache.max_len``).
            causal: query ``i`` sees only keys up to its own index (lower-right aligned); a bool,
                as ``return_weights`` (anything else raises ``ValueError``).
            return_weights: also return the ``(b, h, lq, lk)`` attention weights.
            offset: position of the first query (default 0, or ``cache.length``): ``positions = offset + arange(lq)``.
            cache: a :class:`~selfattn.KVCache` for incremental decoding.
            positions: integer positions of the queries, ``(lq,)`` or per sequence
                ``(b, lq)`` (left padding, packed documents); the new keys get the same ones
                in self-attention. Every encoding (rotary, ALiBi, T5, Shaw) uses them, and a
                cache stores them with the keys. With an M-RoPE ``position``
                (:class:`~selfattn.positional.MultimodalRotaryPositionalEncoding`) also
                ``(3, b, lq)``: time, height and width (:func:`~selfattn.positional.multimodal_positions`);
                the encoding gets all three, the rest of the call (the cache) the time row.
            key_positions: positions of the keys, ``(lk,)`` or ``(b, lk)`` (or ``(3, b, lk)``
                with M-RoPE), when they are not the queries' (cross-attention).
            attn_mask: bool with **True = attend** (as ``scaled_dot_product_attention`` and
                :func:`selfattn.functional.attention`; the *opposite* of
                ``nn.MultiheadAttention``'s bool mask), or float, added to the scaled scores
                (``-inf`` masks). Shape ``(lq, lk)``, ``(b, lq, lk)`` or ``(b, h, lq, lk)``,
                ``lk`` counting every key (cache included).
            key_padding_mask: bool ``(b, lk)``, **True = padding** (as in torch); with a
                cache, it covers the new keys and the cache remembers it.
            document_ids: ``(b, l)`` integers labelling packed documents: a token sees only
                tokens of its own document, and positions restart at 0 at each document
                (unless ``positions`` are given). Self-attention. A cache stores them with the
                keys: pass the new tokens' ids on every later call; a token whose id is that
                of the previous token continues its document (and its positions), another
                starts a new one at position 0.
            cumulative_lengths: the packed documents as cumulative lengths instead (flash-attn's
                ``cu_seqlens``): ``(k + 1,)`` integers ``0 = c_0 < ... < c_k = l`` shared by
                every row, or a list of ``b`` of them (one per row); document ``i`` is tokens
                ``c_i .. c_{i+1} - 1`` and gets document id ``i``. With a cache, only while it is
                empty (later calls give ``document_ids``).
            mask: a rule of :mod:`selfattn.masks`, joined to everything above by "and": e.g.
                ``masks.causal() | masks.prefix(n)`` (prefix-LM), ``masks.causal() |
                masks.spans(ids)`` (bidirectional image spans), ``masks.causal() &
                masks.chunks(512)``. Indices count tokens in the whole sequence (cache
                included). A block of queries that can reach no key of a stretch of keys never
                computes them (see :meth:`selfattn.masks.Visibility.key_range`).

        Returns: ``(b, lq, output_size)``, or ``(output, weights)``.
        """
        return decode_plan.run_call(self, (
            queries, keys, values, valid_lens, causal, return_weights, offset, cache, positions, key_positions,
            attn_mask, key_padding_mask, document_ids, cumulative_lengths, mask,
        ))  # fmt: skip

    def explain(
        self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, *args: Any, **kwargs: Any
    ) -> Explanation:
        """Which route :meth:`forward` takes with these arguments, why each route before it declined, and the parts.

        Takes exactly :meth:`forward`'s arguments (and ``verbose``, as :func:`selfattn.functional.explain` does) and
        computes no attention (a cache is copied, not changed). ``str()`` of the result lists the reasons; ``.route``
        is the route's name; ``.parts`` names the layer's parts by slot."""
        verbose = bool(kwargs.pop("verbose", False))
        forward_arguments = inspect.signature(self.forward).bind(queries, keys, values, *args, **kwargs)
        forward_arguments.apply_defaults()
        given = dict(forward_arguments.arguments)
        if given["cache"] is not None:
            given["cache"] = copy_for_dry_run(given["cache"])
        explanation = dispatch.explain(describe(self, check_request(self, **given)), verbose=verbose)
        return explanation.with_parts(self.describe_parts())

    # ------------------------------------------------------------------ the parts

    def parts(self, slot: str) -> tuple[Part, ...]:
        """The parts acting at ``slot``, in the order they apply."""
        return tuple(part for _, part in self._named_parts(slot))

    def _named_parts(self, slot: str) -> list[tuple[str, Part]]:
        return [(name, self._modules[name]) for name in self.part_names[slot]]  # type: ignore[misc]

    def describe_parts(self) -> tuple[str, ...]:
        """One line per part (``name at slot: Class(options)``) in the order of the pass, after the position scheme."""
        lines = [f"{name} at {slot}: {part.describe()}" for slot in SLOTS for name, part in self._named_parts(slot)]
        if self.position is not None:
            lines.insert(0, f"position = {type(self.position).__name__} ({self.position.acts_on})")
        if self.shared_kv:
            lines.insert(0, "keys and values = another layer's, read from the cache (shared_kv)")
        elif self.W_v is None:
            lines.insert(0, "values = W_k's projection (values_from_keys)")
        return tuple(lines)

    @property
    def gated(self) -> bool:
        """Whether a part gates the merged heads (so padded query rows must reach it as zeros)."""
        return bool(self.part_names["merged"])

    @property
    def temperature_tuning(self) -> tuple[float, float] | None:
        """``(attn_scale, floor_scale)`` of the :class:`~selfattn.parts.TemperatureTuning` part, if there is one."""
        part = self._modules.get("query_scaling")
        return (part.attn_scale, part.floor_scale) if isinstance(part, TemperatureTuning) else None

    def split_heads(self, x: torch.Tensor, heads: int | None = None, head_dim: int | None = None) -> torch.Tensor:
        """``(b, l, heads * head_dim)`` -> ``(b, heads, l, head_dim)``, a view (default: query heads of size dh)."""
        b, length, _ = x.shape
        heads = self.num_heads if heads is None else heads
        return x.view(b, length, heads, self.head_dim if head_dim is None else head_dim).transpose(1, 2)

    @property
    def rotates(self) -> bool:
        """Whether ``position`` transforms the queries and keys (rotary, xPos)."""
        return isinstance(self.position, QueryKeyEncoding)

    @property
    def query_key_encoding(self) -> QueryKeyEncoding:
        """``position`` when it transforms the queries and keys (otherwise no such attribute: ``hasattr`` False)."""
        if not isinstance(self.position, QueryKeyEncoding):
            raise AttributeError(f"query_key_encoding: the position {type(self.position).__name__} acts elsewhere")
        return self.position

    def _run_parts(self, slot: str, x: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        for name in self.part_names[slot]:
            x = self._modules[name](x, positions)  # type: ignore[misc]
        return x

    def project_queries(self, x: torch.Tensor, positions: torch.Tensor, first: int | None = None) -> torch.Tensor:
        """Query heads ``(b, h, lq, dh)`` from ``(b, lq, dq)``: ``W_q``, the query parts around the rotation.

        ``positions``: ``(lq,)``, ``(b, lq)``, or M-RoPE's ``(3, b, lq)``; ``first``: ``positions[0]``
        when they count up from it (a rotary then reads its angle table), else None.
        """
        q = self.split_heads(self._run_parts("query_features", self.W_q(x), positions))  # (b, h, lq, dh)
        q = self._run_parts("queries", q, positions)
        position = self.position  # read once: a submodule's lookup goes through nn.Module.__getattr__
        if isinstance(position, QueryKeyEncoding):
            rotated = _rotate_consecutive(position, q, first)
            q = position.encode_queries(q, for_heads(positions)) if rotated is None else rotated
        return self._run_parts("rotated_queries", q, positions)

    def project_keys(self, x: torch.Tensor, positions: torch.Tensor, first: int | None = None) -> torch.Tensor:
        """Key heads ``(b, hk, lk, dh)`` from ``(b, lk, dk)``: ``W_k``, the key parts around the rotation
        (``first`` as for :meth:`project_queries`)."""
        k = self.split_heads(self._run_parts("key_features", self._key_projection()(x), positions), self.num_kv_heads)
        k = self._run_parts("keys", k, positions)  # (b, hk, lk, dh)
        position = self.position
        if isinstance(position, QueryKeyEncoding):
            rotated = _rotate_consecutive(position, k, first)
            k = position.encode_keys(k, for_heads(positions)) if rotated is None else rotated
        return self._run_parts("rotated_keys", k, positions)

    def project_values(self, x: torch.Tensor, keys: torch.Tensor | None = None) -> torch.Tensor:
        """Value heads ``(b, hk, lk, dv)`` from ``(b, lk, dv_in)``: ``W_v`` (or ``W_k`` of ``keys`` when values
        are the keys' projection), then the value parts."""
        values_projection = self.W_v
        projected = (
            self._key_projection()(x if keys is None else keys) if values_projection is None else values_projection(x)
        )
        v = self.split_heads(projected, self.num_kv_heads, self.value_head_dim)  # (b, hk, lk, dv)
        return self._run_parts("values", v, None)

    def _key_projection(self) -> nn.Linear:
        """``W_k``; a layer reading another layer's keys (``shared_kv``) has none."""
        projection: nn.Linear | None = self.W_k
        if projection is None:
            raise ValueError("shared_kv=True: this layer reads another layer's keys and values and projects none")
        return projection

    def project_output(self, merged: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
        """``W_o`` of the merged heads ``(b, lq, h * dv)``, after the output parts (norms per head, then gates)."""
        if self.part_names["output_heads"]:
            b, lq, _ = merged.shape
            heads = merged.view(b, lq, self.num_heads, self.value_head_dim)  # (b, lq, h, dv)
            merged = self._run_parts("output_heads", heads, None).flatten(2)  # (b, lq, h * dv)
        for name in self.part_names["merged"]:
            merged = self._modules[name](merged, queries)  # type: ignore[misc]
        out: torch.Tensor = self.W_o(merged)  # (b, lq, d)
        return out

    def extra_repr(self) -> str:
        extra = "" if self.num_kv_heads == self.num_heads else f", num_kv_heads={self.num_kv_heads}"
        extra += "" if self.output_size == self.num_hiddens else f", output_size={self.output_size}"
        extra += "" if self.window is None else f", window={self.window}"
        extra += "" if self.chunk_size is None else f", chunk_size={self.chunk_size}"
        extra += "" if self.temperature_tuning is None else f", temperature_tuning={self.temperature_tuning}"
        extra += "" if self.value_head_dim == self.head_dim else f", value_head_dim={self.value_head_dim}"
        extra += ", shared_kv=True" if self.shared_kv else ", values_from_keys=True" if self.W_v is None else ""
        extra += ", skip_padded_queries=True" if self.skip_padded_queries else ""
        extra += "" if self.scale is None else f", scale={self.scale}"
        extra += "" if self.softcap is None else f", softcap={self.softcap}"
        extra += ", sinks=True" if self.sinks is not None else ""
        extra += ", qk_norm=True" if self.q_norm is not None else ""
        extra += ", gated_output=True" if self.W_g is not None else ""
        return f"num_hiddens={self.num_hiddens}, num_heads={self.num_heads}, dropout={self.dropout}{extra}"


def _rotate_consecutive(position: QueryKeyEncoding, x: torch.Tensor, first: int | None) -> torch.Tensor | None:
    """A plain rotary's rotation of ``x`` at positions counting up from ``first``, from its table; else None.

    Only the class itself: a subclass may change ``forward`` or the hooks, which the table would bypass.
    """
    if first is None or type(position) is not RotaryPositionalEncoding:
        return None
    return position.rotate_consecutive(x, first)
