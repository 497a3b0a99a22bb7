"""Multi-head attention with the chapter's ``valid_lens``, causal masks, positions and a cache.

``forward`` reads as its steps: check the arguments, describe the call (projections made on
first use, positions, the cache's keys, what each query may see), let the dispatcher
(:mod:`selfattn.core.dispatch`) choose a route and run it, project out.

Shape legend:
    b: batch, lq: queries, lk: keys, h: heads, hk: key/value heads, dh: head size
    (num_hiddens / h), d: num_hiddens, dq / dk / dv: feature sizes of queries / keys / values.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

import selfattn._validation as _validation
import selfattn.core.dispatch as dispatch
import selfattn.masks as masks
from selfattn._scripting import NotScriptable
from selfattn._validation import (
    require_positive_finite,
    require_positive_int,
    require_probability,
    require_temperature_tuning,
    require_tuned_positions,
)
from selfattn.cache import KVCache
from selfattn.core.call import AttentionCall, ModuleInputs
from selfattn.core.dispatch import Explanation
from selfattn.core.documents import cumulative_lengths_to_document_ids, document_positions
from selfattn.core.inputs import Request, check_request, zero_padding
from selfattn.core.route import Output
from selfattn.masks import Visibility
from selfattn.positional.base import PositionalEncoding, QueryKeyEncoding, ScoreEncoding
from selfattn.positional.rotary import RotaryPositionalEncoding

__all__ = ["MultiHeadAttention", "cumulative_lengths_to_document_ids", "document_positions"]


class _Seen(NamedTuple):
    """The keys the queries of one call may see: the new ones, or what the cache holds."""

    positions: torch.Tensor  # (lk,) or (b, lk)
    padding: torch.Tensor | None  # (b, lk), True = padding
    documents: torch.Tensor | None  # (b, lk)
    first_index: int  # index of the first of them in the whole sequence
    num_keys: int  # lk

    @classmethod
    def new_keys(cls, request: Request) -> _Seen:
        return cls(request.k_positions, request.key_padding_mask, request.key_documents, 0, request.keys.shape[1])


def _per_head(positions: torch.Tensor) -> torch.Tensor:
    return positions[:, None, :] if positions.dim() == 2 else positions  # (b, 1, l) broadcasts over heads


def _encoding_positions(positions: torch.Tensor, axes: torch.Tensor | None) -> torch.Tensor:
    """The positions the projections take: M-RoPE's ``(3, b, l)`` axes when there are some, else ``positions``."""
    return positions if axes is None else axes


def _for_heads(positions: torch.Tensor) -> torch.Tensor:
    """``(l,)``, ``(b, l)`` or M-RoPE's ``(3, b, l)`` as the encodings take them over heads."""
    return positions if positions.dim() == 3 else _per_head(positions)


def _updates_cached_keys(encoding: QueryKeyEncoding) -> bool:
    """Whether ``encoding.update_cached_keys`` may change a cache: not the base's no-op, nor a rotary's that
    re-rotates nothing (:attr:`~selfattn.positional.RotaryPositionalEncoding.rerotates_cache` False)."""
    hook = type(encoding).update_cached_keys
    if hook is QueryKeyEncoding.update_cached_keys:
        return False
    if isinstance(encoding, RotaryPositionalEncoding) and hook is RotaryPositionalEncoding.update_cached_keys:
        return encoding.rerotates_cache
    return True


def _check_position_sizes(position: PositionalEncoding | None, num_heads: int, head_dim: int) -> None:
    """Refuse an encoding built for another head count or head size, here rather than deep in a forward pass.

    Score encodings record the heads they bias (``num_heads``: ALiBi, T5, Kerple, FIRE); the
    others the head size they act on (``head_dim``: rotary, xPos, M-RoPE, Shaw).
    """
    built_heads, built_size = getattr(position, "num_heads", None), getattr(position, "head_dim", None)
    name = type(position).__name__
    if isinstance(built_heads, int) and built_heads != num_heads:
        raise ValueError(f"position={name} built for {built_heads} heads, the layer has {num_heads}")
    if isinstance(built_size, int) and built_size != head_dim:
        raise ValueError(
            f"position={name} built for head size {built_size}, the layer's is {head_dim} (num_hiddens / num_heads)"
        )


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
            before the rotation (Qwen3, OLMo 2, Gemma 3): the modules ``q_norm`` and ``k_norm``
            with ``(dh,)`` weights.
        qk_norm_eps: the RMSNorm's epsilon.
        chunk_size: chunked attention (Llama 4's ``attention_chunk_size``): a query sees only keys
            of its own chunk, ``p_i // chunk_size == p_j // chunk_size`` for the tokens' positions
            ``p`` (by default their indices in the whole sequence, cache included; with left
            padding, ``positions`` counted from each row's first token start its chunks there,
            as Llama 4 does); combined with every other mask by "and".
        temperature_tuning: ``(attn_scale, floor_scale)``: each query at position ``p`` is
            multiplied by ``1 + attn_scale * log(1 + floor((p + 1) / floor_scale))`` before
            attention (Llama 4's NoPE layers, which sharpen attention at long range).
        gated_output: a sigmoid gate per output feature, ``sigmoid(W_g(queries))``, multiplies
            the merged heads before ``W_o`` (Qwen3-Next's full-attention layers).
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

    def __init__(
        self,
        num_hiddens: int,
        num_heads: int,
        dropout: float = 0.0,
        *,
        bias: bool = False,
        output_bias: bool | None = None,
        query_size: int | None = None,
        key_size: int | None = None,
        value_size: int | None = None,
        output_size: int | None = None,
        position: PositionalEncoding | None = None,
        num_kv_heads: int | None = None,
        window: int | None = None,
        block_size: int | None = None,
        skip_padded_queries: bool = False,
        scale: float | None = None,
        softcap: float | None = None,
        sinks: bool = False,
        qk_norm: bool = False,
        qk_norm_eps: float = 1e-6,
        gated_output: bool = False,
        chunk_size: int | None = None,
        temperature_tuning: tuple[float, float] | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.num_hiddens = require_positive_int("num_hiddens", num_hiddens)
        self.num_heads = require_positive_int("num_heads", num_heads)
        if num_hiddens % num_heads:
            raise ValueError(f"num_hiddens={num_hiddens} is not divisible by num_heads={num_heads}")
        self.num_kv_heads = num_heads if num_kv_heads is None else require_positive_int("num_kv_heads", num_kv_heads)
        if num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not divisible by num_kv_heads={num_kv_heads}")
        self.window = None if window is None else require_positive_int("window", window)
        self.chunk_size = None if chunk_size is None else require_positive_int("chunk_size", chunk_size)
        self.temperature_tuning = None if temperature_tuning is None else require_temperature_tuning(temperature_tuning)
        self.head_dim = num_hiddens // num_heads
        self.dropout = require_probability("dropout", dropout)
        sizes = {}
        given = (
            ("query_size", query_size),
            ("key_size", key_size),
            ("value_size", value_size),
            ("output_size", output_size),
        )
        for name, size in given:
            sizes[name] = num_hiddens if size is None else require_positive_int(name, size)
        self.query_size, self.key_size, self.value_size = sizes["query_size"], sizes["key_size"], sizes["value_size"]
        self.output_size = sizes["output_size"]
        if position is not None and not isinstance(position, (QueryKeyEncoding, ScoreEncoding)):
            raise ValueError(
                f"position must rotate queries/keys or bias the scores, got {type(position).__name__} "
                "(add input encodings to the input instead)"
            )
        _check_position_sizes(position, self.num_heads, self.head_dim)
        self.position = position
        self.block_size = None if block_size is None else require_positive_int("block_size", block_size)
        if not isinstance(skip_padded_queries, bool):
            raise ValueError(f"skip_padded_queries must be True or False, got {skip_padded_queries!r}")
        self.skip_padded_queries = skip_padded_queries
        self.scale = None if scale is None else require_positive_finite("scale", scale)
        self.softcap = None if softcap is None else require_positive_finite("softcap", softcap)
        for name, flag in (("bias", bias), ("sinks", sinks), ("qk_norm", qk_norm), ("gated_output", gated_output)):
            if not isinstance(flag, bool):
                raise ValueError(f"{name} must be True or False, got {flag!r}")
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        kv_hiddens = self.num_kv_heads * self.head_dim
        self.W_q = nn.Linear(self.query_size, num_hiddens, bias=bias, **factory)
        self.W_k = nn.Linear(self.key_size, kv_hiddens, bias=bias, **factory)
        self.W_v = nn.Linear(self.value_size, kv_hiddens, bias=bias, **factory)
        if output_bias is not None and not isinstance(output_bias, bool):
            raise ValueError(f"output_bias must be True, False or None, got {output_bias!r}")
        self.W_o = nn.Linear(
            num_hiddens, self.output_size, bias=bias if output_bias is None else output_bias, **factory
        )
        self.W_g = nn.Linear(self.query_size, num_hiddens, bias=bias, **factory) if gated_output else None
        self.sinks = nn.Parameter(torch.zeros(num_heads, **factory)) if sinks else None
        self.q_norm = self.k_norm = None
        if qk_norm:
            eps = require_positive_finite("qk_norm_eps", qk_norm_eps)
            self.q_norm = nn.RMSNorm(self.head_dim, eps=eps, **factory)
            self.k_norm = nn.RMSNorm(self.head_dim, eps=eps, **factory)

    def reset_parameters(self) -> None:
        """Reset ``position`` (built before this module), then re-draw the projections as ``nn.Linear`` does.

        With the same seed this repeats a normal construction, so meta-device modules can be
        materialized with ``to_empty()`` and this method.
        """
        reset = getattr(self.position, "reset_parameters", None)
        if callable(reset):
            reset()
        for layer in (self.W_q, self.W_k, self.W_v, self.W_o, self.W_g, self.q_norm, self.k_norm):
            if layer is not None:
                layer.reset_parameters()
        if self.sinks is not None:
            with torch.no_grad():
                self.sinks.zero_()

    @classmethod
    def from_torch(
        cls, module: nn.MultiheadAttention, *, position: PositionalEncoding | None = None
    ) -> MultiHeadAttention:
        """The same attention as ``module`` (an ``nn.MultiheadAttention``), with its weights copied.

        Projections (``in_proj`` or the separate ``q/k/v_proj`` of ``kdim``/``vdim``), the
        output projection, their biases and the dropout are copied, on ``module``'s device
        and dtype. Call the result with batch-first tensors ``(b, l, d)`` whatever
        ``module.batch_first`` was, and note that a bool ``attn_mask`` here means True =
        attend (``nn.MultiheadAttention``: True = masked out); ``key_padding_mask`` means
        the same in both.

        Raises:
            ValueError: for ``add_bias_kv`` or ``add_zero_attn``, which have no equivalent here.
        """
        if not isinstance(module, nn.MultiheadAttention):
            raise ValueError(f"module must be an nn.MultiheadAttention, got {type(module).__name__}")
        if module.bias_k is not None or module.add_zero_attn:
            raise ValueError("module uses add_bias_kv or add_zero_attn, which MultiHeadAttention does not have")
        has_bias = module.in_proj_bias is not None
        if has_bias != (module.out_proj.bias is not None):
            raise ValueError("module has a bias on only some projections; MultiHeadAttention has all or none")
        weight = module.out_proj.weight
        mha = cls(
            module.embed_dim,
            module.num_heads,
            module.dropout,
            bias=has_bias,
            key_size=module.kdim,
            value_size=module.vdim,
            position=position,
            device=weight.device,
            dtype=weight.dtype,
        )
        with torch.no_grad():
            if module.in_proj_weight is not None:
                weights = module.in_proj_weight.chunk(3)
            else:
                weights = (module.q_proj_weight, module.k_proj_weight, module.v_proj_weight)
            for linear, w in zip((mha.W_q, mha.W_k, mha.W_v), weights, strict=True):
                linear.weight.copy_(w)
            mha.W_o.weight.copy_(module.out_proj.weight)
            if has_bias:
                for linear, b in zip((mha.W_q, mha.W_k, mha.W_v), module.in_proj_bias.chunk(3), strict=True):
                    linear.bias.copy_(b)
                mha.W_o.bias.copy_(module.out_proj.bias)
        return mha.train(module.training)

    @classmethod
    def from_transformers(cls, layer: nn.Module) -> MultiHeadAttention:
        """The same attention as a Hugging Face transformers (5.x) attention layer, with its weights copied.

        Reads the layer and the config it carries (``layer.config``, ``layer.layer_idx``): Llama,
        Qwen3 (QK-norm), Gemma 2 (softcap, ``query_pre_attn_scalar``, sliding or global by
        ``layer_types``), Gemma 3 (QK-norm with Gemma's ``(1 + weight)`` RMSNorm, whose ``1 + w``
        is copied; a rotary base per layer type), gpt-oss (sinks, sliding or full, bias), Llama 4
        text (chunked layers; NoPE layers with temperature tuning; the L2 QK-norm of its rotary
        layers, an RMSNorm with unit weights; interleaved rotary) and Qwen3-Next full attention
        (gated output from the gate half of each head's ``q_proj`` rows, QK-norm with
        ``(1 + w)``, partial rotary). Then ``mha(x, x, x, causal=True, positions=position_ids)``
        equals the layer run with its model's rotary embedding and its causal mask; pass the
        attention mask's padding as ``key_padding_mask``.

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
            causal: query ``i`` sees only keys up to its own index (lower-right aligned).
                ``True`` or ``False`` (anything else raises ``ValueError``, as for ``return_weights``).
            return_weights: also return the ``(b, h, lq, lk)`` attention weights.
            offset: position of the first query (default 0, or ``cache.length``); the
                shorthand for ``positions = offset + arange(lq)``.
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

        Returns:
            ``(b, lq, output_size)``, or ``(output, weights)``.
        """
        request = check_request(
            self,
            queries, keys, values, valid_lens, causal, return_weights, offset, cache, positions, key_positions,
            attn_mask, key_padding_mask, document_ids, cumulative_lengths, mask,
        )  # fmt: skip
        call = self._describe(request)
        return self._finish(request, call, dispatch.run(call))

    def explain(
        self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, *args: Any, **kwargs: Any
    ) -> Explanation:
        """Which route :meth:`forward` takes with these arguments, and why each route before it declined.

        Takes exactly :meth:`forward`'s arguments and computes no attention (a cache is copied,
        not changed). ``str()`` of the result lists the reasons; ``.route`` is the route's name.
        """
        forward_arguments = inspect.signature(self.forward).bind(queries, keys, values, *args, **kwargs)
        forward_arguments.apply_defaults()
        given = dict(forward_arguments.arguments)
        if given["cache"] is not None:
            given["cache"] = given["cache"].copy()
        return dispatch.explain(self._describe(check_request(self, **given)))

    def split_heads(self, x: torch.Tensor, heads: int | None = None) -> torch.Tensor:
        """``(b, l, heads * dh)`` -> ``(b, heads, l, dh)``, a view."""
        b, length, _ = x.shape
        heads = self.num_heads if heads is None else heads
        return x.view(b, length, heads, self.head_dim).transpose(1, 2)  # (b, heads, l, dh)

    @property
    def rotates(self) -> bool:
        """Whether ``position`` transforms the queries and keys (rotary, xPos)."""
        return isinstance(self.position, QueryKeyEncoding)

    @property
    def query_key_encoding(self) -> QueryKeyEncoding:
        """``position`` when it transforms the queries and keys."""
        assert isinstance(self.position, QueryKeyEncoding)
        return self.position

    def project_queries(self, x: torch.Tensor, positions: torch.Tensor, first: int | None = None) -> torch.Tensor:
        """Query heads ``(b, h, lq, dh)`` from ``(b, lq, dq)``: ``W_q``, QK-norm, then the rotation at ``positions``.

        ``positions``: ``(lq,)``, ``(b, lq)``, or M-RoPE's ``(3, b, lq)``; ``first``: ``positions[0]``
        when they count up from it (a rotary then reads its angle table), else None.
        """
        q = self.split_heads(self.W_q(x))  # (b, h, lq, dh)
        if self.q_norm is not None:
            q = self.q_norm(q)
        if self.temperature_tuning is not None:
            attn_scale, floor_scale = self.temperature_tuning
            time = positions[0] if positions.dim() == 3 else positions  # M-RoPE's first axis counts tokens
            require_tuned_positions(time)
            steps = torch.floor((_per_head(time).to(torch.float64) + 1) / floor_scale)  # (lq,) or (b, 1, lq)
            q = q * (1 + attn_scale * torch.log1p(steps)).to(q.dtype)[..., None]  # (b, h, lq, dh)
        if not self.rotates:
            return q
        rotated = self._rotate_consecutive(q, first)
        return self.query_key_encoding.encode_queries(q, _for_heads(positions)) if rotated is None else rotated

    def project_keys(self, x: torch.Tensor, positions: torch.Tensor, first: int | None = None) -> torch.Tensor:
        """Key heads ``(b, hk, lk, dh)`` from ``(b, lk, dk)``: ``W_k``, QK-norm, then the rotation at ``positions``
        (``first`` as for :meth:`project_queries`)."""
        k = self.split_heads(self.W_k(x), self.num_kv_heads)  # (b, hk, lk, dh)
        if self.k_norm is not None:
            k = self.k_norm(k)
        if not self.rotates:
            return k
        rotated = self._rotate_consecutive(k, first)
        return self.query_key_encoding.encode_keys(k, _for_heads(positions)) if rotated is None else rotated

    def _rotate_consecutive(self, x: torch.Tensor, first: int | None) -> torch.Tensor | None:
        """A plain rotary's rotation of ``x`` at positions counting up from ``first``, from its table; else None.

        Only the class itself: a subclass may change ``forward`` or the hooks, which the table would bypass.
        """
        if first is None or type(self.position) is not RotaryPositionalEncoding:
            return None
        return self.position.rotate_consecutive(x, first)

    def project_output(self, merged: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
        """``W_o`` of the merged heads ``(b, lq, h * dh)``, gated by ``sigmoid(W_g(queries))`` first when gated."""
        if self.W_g is not None:
            merged = merged * torch.sigmoid(self.W_g(queries))  # (b, lq, h * dh)
        out: torch.Tensor = self.W_o(merged)  # (b, lq, d)
        return out

    # ------------------------------------------------------------------ the steps of forward

    def _finish(
        self, request: Request, call: AttentionCall, result: Output
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Project out, zero padded query rows, commit the cache, pad the weights to every key."""
        out = result.out
        if result.stage == "heads":
            out = out.transpose(1, 2).flatten(2)  # (b, h, lq, dh) -> (b, lq, d)
        if result.stage != "projected":
            queries = request.queries
            if self.W_g is not None and request.valid_rows is not None:  # padded rows reach no gate
                queries = queries.masked_fill(~request.valid_rows[:, :, None], 0.0)
            out = self.project_output(out, queries)  # (b, lq, d)
        if request.valid_rows is not None:
            out = out.masked_fill(~request.valid_rows[:, :, None], 0.0)  # padded query rows: zero, no W_o bias
        if request.cache is not None:
            request.cache.commit()  # the new keys count as stored only once attention has succeeded
        if not request.return_weights:
            return out
        weights = result.weights
        assert weights is not None
        if request.valid_rows is not None:
            weights = weights.masked_fill(~request.valid_rows[:, None, :, None], 0.0)  # (b, h, lq, lk)
        # Keys never scored (skipped padding, or dropped by a windowed cache) weigh 0: (b, h, lq, total).
        first = call.visibility.k_first
        return out, F.pad(weights, (first, request.total - first - weights.shape[-1]))

    def _describe(self, request: Request) -> AttentionCall:
        """The call: lazily projected heads, positions, the cache's keys, and what each query may see."""
        queries, keys = request.queries, request.keys
        batch, num_queries = queries.shape[:2]

        zeroed: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

        def inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            """The inputs, with padded rows zeroed for skip_padded_queries (a NaN there reaches nothing)."""
            if request.valid_rows is None:
                return queries, keys, request.values
            if not zeroed:  # once for the queries and the keys alike
                zeroed.append(zero_padding(request.valid_rows, queries, keys, request.values))
            return zeroed[0]

        def make_q() -> torch.Tensor:
            return self.project_queries(
                inputs()[0], _encoding_positions(request.q_positions, request.q_axes), request.q_first_position
            )  # (b, h, lq, dh)

        def project_kv() -> tuple[torch.Tensor, torch.Tensor]:
            if self.rotates:
                self._update_cached_keys(request)
            k = self.project_keys(
                inputs()[1], _encoding_positions(request.k_positions, request.k_axes), request.k_first_position
            )  # (b, hk, lk_new, dh)
            v = self.split_heads(self.W_v(inputs()[2]), self.num_kv_heads)  # (b, hk, lk_new, dh)
            return k, v

        seen = _Seen.new_keys(request)
        make_kv = project_kv
        if request.cache is not None:  # what the cache holds decides the visibility: gather it now
            k, v = project_kv()
            stored = request.cache.update(
                k, v, positions=request.k_positions, padding=request.key_padding_mask,
                documents=request.key_documents, commit=False,
            )  # fmt: skip
            seen = _Seen(stored.positions, stored.padding, stored.documents, stored.first_index, stored.keys.shape[-2])
            make_kv = lambda: (stored.keys, stored.values)  # noqa: E731
        visibility, bias = self._visibility(request, seen)
        return AttentionCall(
            shape=(batch, self.num_heads, self.num_kv_heads, num_queries, seen.num_keys, self.head_dim, self.head_dim),
            visibility=visibility,
            device=queries.device,
            dtype=self.W_q.weight.dtype,
            make_q=make_q,
            make_kv=make_kv,
            q_positions=request.q_positions,
            k_positions=seen.positions,
            term=self.position if isinstance(self.position, ScoreEncoding) else None,
            bias=bias,
            dropout_p=self.dropout if self.training else 0.0,
            scale=self.scale,
            softcap=self.softcap,
            sinks=self.sinks,
            return_weights=request.return_weights,
            block_size=self.block_size,
            inputs=ModuleInputs(
                self, queries, keys, request.values,
                request.q_positions if request.q_axes is None else request.q_axes,  # the encoding's positions
                request.k_positions if request.k_axes is None else request.k_axes,
                self.skip_padded_queries, request.cache is not None,
            ),
        )  # fmt: skip

    def _update_cached_keys(self, request: Request) -> None:
        """Give the encoding the positions of the stored keys and the new ones (dynamic rotary re-rotates the cache).

        A windowed cache holds only some keys (``cache.stored`` of ``cache.length``), with their own
        positions: those are the keys to re-rotate, and a window that slid past others changes nothing.
        """
        cache = request.cache
        if cache is None or not _updates_cached_keys(self.query_key_encoding):
            return  # the positions would be gathered for nothing (a rotary without length scaling)
        cached = cache.positions
        if cached is None:
            return
        new_positions = request.k_positions
        if cached.dim() != new_positions.dim():  # one of them per sequence: both per sequence
            batch = request.queries.shape[0]
            cached, new_positions = cached.expand(batch, -1), new_positions.expand(batch, -1)
        self.query_key_encoding.update_cached_keys(cache, torch.cat((cached, new_positions), dim=-1))

    def _visibility(self, request: Request, seen: _Seen) -> tuple[Visibility, torch.Tensor | None]:
        """What each query may see (and a float ``attn_mask``'s finite part, a bias)."""
        num_queries = request.queries.shape[1]
        visibility = Visibility(num_queries, seen.num_keys, request.total - num_queries, seen.first_index)
        mask, bias = request.attn_mask, None
        if mask is not None:
            mask = mask[..., seen.first_index : seen.first_index + seen.num_keys]
            if mask.is_floating_point():
                bias = mask.masked_fill(mask == float("-inf"), 0.0)  # -inf goes into the bool mask
                mask = mask != float("-inf")
        both = request.document_ids is not None and seen.documents is not None
        visibility = visibility.with_rules(
            masks.causal() if request.causal else None,
            None if self.window is None else masks.window(self.window),
            self._chunks(request, seen),
            None if request.valid_lens is None else masks.ValidLengths(request.valid_lens),  # checked: check_valid_lens
            None if seen.padding is None else masks.key_padding(seen.padding),
            masks.documents(request.document_ids, seen.documents) if both else None,  # type: ignore[arg-type]
            None if mask is None else masks.dense(mask),
            request.mask,
        )
        return visibility, bias

    def _chunks(self, request: Request, seen: _Seen) -> masks.Rule | None:
        """``chunk_size`` as a rule: chunks of token indices when positions are the indices, else of positions."""
        if self.chunk_size is None:
            return None
        q_positions, k_positions = request.q_positions, seen.positions
        num_queries = request.queries.shape[1]
        first_query = request.total - num_queries
        if q_positions.dim() == 1 and k_positions.dim() == 1 and not _validation.is_compiling():
            by_index = torch.arange(first_query, request.total, device=q_positions.device)
            keys_by_index = torch.arange(seen.first_index, seen.first_index + seen.num_keys, device=k_positions.device)
            if torch.equal(q_positions, by_index) and torch.equal(k_positions, keys_by_index):
                return masks.chunks(self.chunk_size)  # indices: blocks can skip other chunks' keys
        return masks.chunks(self.chunk_size, query_positions=q_positions, key_positions=k_positions)

    def extra_repr(self) -> str:
        extra = "" if self.num_kv_heads == self.num_heads else f", num_kv_heads={self.num_kv_heads}"
        extra += "" if self.output_size == self.num_hiddens else f", output_size={self.output_size}"
        extra += "" if self.window is None else f", window={self.window}"
        extra += "" if self.chunk_size is None else f", chunk_size={self.chunk_size}"
        extra += "" if self.temperature_tuning is None else f", temperature_tuning={self.temperature_tuning}"
        extra += ", skip_padded_queries=True" if self.skip_padded_queries else ""
        extra += "" if self.scale is None else f", scale={self.scale}"
        extra += "" if self.softcap is None else f", softcap={self.softcap}"
        extra += ", sinks=True" if self.sinks is not None else ""
        extra += ", qk_norm=True" if self.q_norm is not None else ""
        extra += ", gated_output=True" if self.W_g is not None else ""
        return f"num_hiddens={self.num_hiddens}, num_heads={self.num_heads}, dropout={self.dropout}{extra}"
