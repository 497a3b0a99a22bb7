"""Multi-head latent attention (DeepSeek-V2/V3's MLA) as a module, with the weights' transformers names.

``forward`` reads as its steps: the queries (low-rank or full), the latent and the shared rotated
key of the new tokens, the cache's earlier ones, what each query may see, then
:func:`~selfattn.latent.functional.latent_attention` (expanded or absorbed; the dispatcher
chooses the route), then ``o_proj``.

Shape legend:
    b: batch, l: new tokens, n: keys seen (cache included), d: hidden size, h: heads,
    r: kv_lora_rank, rq: q_lora_rank, dn: qk_nope_head_dim, dr: qk_rope_head_dim,
    dv: v_head_dim.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

import selfattn.masks as masks
from selfattn._scripting import NotScriptable
from selfattn._validation import (
    require_bool,
    require_non_negative_int,
    require_positive_finite,
    require_positive_int,
    require_probability,
)
from selfattn.cache import KVCache
from selfattn.latent.cache import CachedLatents, LatentCache
from selfattn.latent.functional import (
    COMPUTATIONS,
    LatentExplanation,
    explain_latent,
    latent_attention,
)
from selfattn.latent.scaling import HeadLogScaling
from selfattn.masks import Visibility
from selfattn.positional.rotary import RotaryPositionalEncoding

__all__ = ["MultiHeadLatentAttention"]


def _check_rotary(position: RotaryPositionalEncoding | None, rope: int) -> None:
    """A rotary built for the ``dr`` rope features, whose frequencies do not depend on the length."""
    if position is None:
        return
    if not isinstance(position, RotaryPositionalEncoding):
        raise ValueError(f"position must be a RotaryPositionalEncoding, got {type(position).__name__}")
    if position.head_dim != rope:
        raise ValueError(f"position is built for head_dim={position.head_dim}, the layer's qk_rope_head_dim={rope}")
    config = position.scaling_config
    if config is not None and config.depends_on_length:
        raise ValueError(
            f"position scaling {config.rope_type!r} changes with the length; the latent cache keeps keys rotated once"
        )


class MultiHeadLatentAttention(NotScriptable, nn.Module):
    """Multi-head latent attention: keys and values from one small latent per token, shared by every head.

    The parameters are named as in transformers' ``DeepseekV3Attention`` (``q_proj`` or
    ``q_a_proj``/``q_a_layernorm``/``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_a_layernorm``,
    ``kv_b_proj``, ``o_proj``), so its ``state_dict`` loads and saves as it is.

    Per token: the query is ``q_b_proj(RMSNorm(q_a_proj(x)))`` (or ``q_proj(x)``), per head ``dn``
    features without rotary and ``dr`` rotated ones; ``kv_a_proj_with_mqa(x)`` gives the latent
    (first ``r`` features, then ``kv_a_layernorm``) and one key of ``dr`` features, rotated and
    shared by every head; ``kv_b_proj`` expands the latent into each head's ``k_nope`` (``dn``)
    and value (``dv``). Only the latent and the rotated key are cached
    (:class:`~selfattn.latent.LatentCache`).

    Two computations give the same numbers (to float rounding): ``"expanded"`` forms every head's
    keys and values (cheapest for prefill and training); ``"absorbed"`` folds ``kv_b_proj`` into
    the queries and the output, so attention is multi-query over the ``r + dr``-wide latent
    (cheapest when the queries are few: decoding). ``computation="auto"`` counts the multiply-adds
    of each for the call's sizes; :meth:`explain` says which it takes and the dispatcher's route.

    Args:
        hidden_size: ``d``, the input's and the output's features.
        num_heads: ``h``.
        kv_lora_rank: ``r``, the latent's size.
        qk_nope_head_dim: ``dn``, query/key features per head without rotary.
        qk_rope_head_dim: ``dr``, rotated features (0: no rotary, NoPE).
        v_head_dim: ``dv``, value features per head.
        q_lora_rank: ``rq`` for a low-rank query (``q_a_proj -> RMSNorm -> q_b_proj``), or None
            for one ``q_proj``.
        bias: a bias on ``q_a_proj``, ``kv_a_proj_with_mqa`` and ``o_proj`` (transformers'
            ``attention_bias``; ``q_proj``, ``q_b_proj`` and ``kv_b_proj`` never have one).
        norm_eps: the two RMSNorms' epsilon.
        position: the rotary of the ``dr`` features (built with ``head_dim=dr``), or None when
            ``dr`` is 0. A length-dependent scaling (dynamic, longrope) is refused.
        split_rotated_pairs: with an interleaved ``position`` (pairs ``(2j, 2j + 1)``), write the
            rotated pairs as all first members then all second members (transformers'
            ``rope_interleave``: interleaved read, half-split write). Scores are the same either way;
            the cached keys then equal transformers' own.
        scale: the softmax's score scale, default ``(dn + dr) ** -0.5`` (DeepSeek's families
            multiply it by YaRN's ``mscale ** 2``: the loader reads it).
        query_scaling: ``(beta, L0)``: each query at position ``p`` is multiplied by
            ``1 + beta * log(1 + floor(p / L0))`` (Mistral 4's ``llama_4_scaling_beta``).
        lora_scales: ``(q_scale, kv_scale)`` multiplying the query and the normalized latent
            (LongCat-Flash's ``mla_scale_q_lora``, ``mla_scale_kv_lora``).
        head_log_scaling: a learned multiplier of each head's query at position ``p``,
            ``scale_i * log(p + 1) + bias_i`` (Mistral Large 4): the module ``softmax_scaling``
            (:class:`~selfattn.latent.scaling.HeadLogScaling`).
        window: sliding-window attention (query ``i`` sees keys ``i - window + 1 .. i`` with causal).
        dropout: dropout on the attention weights (training only).
        computation: ``"auto"``, ``"expanded"`` or ``"absorbed"``.
        device: where the parameters are created.
        dtype: dtype of the parameters.
    """

    def __init__(
        self,
        *,
        hidden_size: int,
        num_heads: int,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        q_lora_rank: int | None = None,
        bias: bool = False,
        norm_eps: float = 1e-6,
        position: RotaryPositionalEncoding | None = None,
        split_rotated_pairs: bool = False,
        scale: float | None = None,
        query_scaling: tuple[float, float] | None = None,
        lora_scales: tuple[float, float] | None = None,
        head_log_scaling: bool = False,
        window: int | None = None,
        dropout: float = 0.0,
        computation: str = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.hidden_size = require_positive_int("hidden_size", hidden_size)
        self.num_heads = require_positive_int("num_heads", num_heads)
        self.kv_lora_rank = require_positive_int("kv_lora_rank", kv_lora_rank)
        self.qk_nope_head_dim = require_positive_int("qk_nope_head_dim", qk_nope_head_dim)
        self.qk_rope_head_dim = require_non_negative_int("qk_rope_head_dim", qk_rope_head_dim)
        self.v_head_dim = require_positive_int("v_head_dim", v_head_dim)
        self.q_lora_rank = None if q_lora_rank is None else require_positive_int("q_lora_rank", q_lora_rank)
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even (rotary turns pairs), got {qk_rope_head_dim}")
        if (position is None) != (self.qk_rope_head_dim == 0):
            raise ValueError(
                f"position={type(position).__name__} with qk_rope_head_dim={qk_rope_head_dim}: "
                "a rotary needs rope features, and rope features need a rotary"
            )
        _check_rotary(position, self.qk_rope_head_dim)
        self.position = position
        self.split_rotated_pairs = require_bool("split_rotated_pairs", split_rotated_pairs)
        self.qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        self.scale = self.qk_head_dim**-0.5 if scale is None else require_positive_finite("scale", scale)
        self.query_scaling = None if query_scaling is None else _pair("query_scaling", query_scaling, positive=False)
        self.lora_scales = None if lora_scales is None else _pair("lora_scales", lora_scales, positive=True)
        self.window = None if window is None else require_positive_int("window", window)
        self.dropout = require_probability("dropout", dropout)
        if computation not in COMPUTATIONS:
            raise ValueError(f"computation must be one of {COMPUTATIONS}, got {computation!r}")
        self.computation = computation
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        bias = require_bool("bias", bias)
        eps = require_positive_finite("norm_eps", norm_eps)
        query_out = self.num_heads * self.qk_head_dim
        self.q_proj = self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(self.hidden_size, query_out, bias=False, **factory)  # never biased (transformers)
        else:
            self.q_a_proj = nn.Linear(self.hidden_size, self.q_lora_rank, bias=bias, **factory)
            self.q_a_layernorm = nn.RMSNorm(self.q_lora_rank, eps=eps, **factory)
            self.q_b_proj = nn.Linear(self.q_lora_rank, query_out, bias=False, **factory)
        self.kv_a_proj_with_mqa = nn.Linear(
            self.hidden_size, self.kv_lora_rank + self.qk_rope_head_dim, bias=bias, **factory
        )
        self.kv_a_layernorm = nn.RMSNorm(self.kv_lora_rank, eps=eps, **factory)
        self.kv_b_proj = nn.Linear(
            self.kv_lora_rank, self.num_heads * (self.qk_nope_head_dim + self.v_head_dim), bias=False, **factory
        )
        self.o_proj = nn.Linear(self.num_heads * self.v_head_dim, self.hidden_size, bias=bias, **factory)
        self.softmax_scaling = (
            HeadLogScaling(self.num_heads, **factory) if require_bool("head_log_scaling", head_log_scaling) else None
        )

    @classmethod
    def from_transformers(
        cls, layer: nn.Module, *, rotary_embedding: nn.Module | None = None
    ) -> MultiHeadLatentAttention:
        """The layer equal to a transformers MLA layer (DeepSeek-V2/V3, Mistral 4, GLM-4-lite, LongCat-Flash, ...).

        ``rotary_embedding``: the model's rotary module, for Mistral Large 4's learned frequencies.
        See :func:`selfattn.latent.from_transformers.from_transformers`.
        """
        from selfattn.latent.from_transformers import from_transformers

        return from_transformers(layer, cls, rotary_embedding=rotary_embedding)

    # ------------------------------------------------------------------ the steps of forward

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The rope features ``(b, heads, l, dr)`` rotated at ``positions`` ``(l,)`` or ``(b, l)``."""
        if self.position is None:
            return x
        rotated: torch.Tensor = self.position(x, positions if positions.dim() == 1 else positions[:, None, :])
        if self.split_rotated_pairs:
            rotated = torch.cat((rotated[..., 0::2], rotated[..., 1::2]), dim=-1)  # half-split write
        return rotated

    def project_queries(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``q_nope`` ``(b, h, l, dn)`` and the rotated ``q_rope`` ``(b, h, l, dr)`` from ``(b, l, d)``."""
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))  # (b, l, h * (dn + dr))
        batch, length, _ = x.shape
        q = q.view(batch, length, self.num_heads, self.qk_head_dim).transpose(1, 2)  # (b, h, l, dn + dr)
        multiplier = 1.0 if self.lora_scales is None else self.lora_scales[0]
        if self.query_scaling is not None:
            beta, original = self.query_scaling
            steps = torch.floor(positions.to(torch.float64) / original)  # (l,) or (b, l)
            tuned = (1 + beta * torch.log1p(steps)).to(q.dtype)
            q = q * (tuned[:, None, :, None] if tuned.dim() == 2 else tuned[:, None])
        if self.softmax_scaling is not None:
            q = self.softmax_scaling(q, positions)
        if multiplier != 1.0:
            q = q * multiplier
        q_nope, q_rope = q.split((self.qk_nope_head_dim, self.qk_rope_head_dim), dim=-1)
        return q_nope, self.rotate(q_rope, positions)

    def project_latent(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The normalized latent ``(b, 1, l, r)`` and the rotated shared key ``(b, 1, l, dr)`` of new tokens."""
        joined = self.kv_a_proj_with_mqa(x)  # (b, l, r + dr)
        latent, k_rope = joined.split((self.kv_lora_rank, self.qk_rope_head_dim), dim=-1)
        latent = self.kv_a_layernorm(latent)
        if self.lora_scales is not None and self.lora_scales[1] != 1.0:
            latent = latent * self.lora_scales[1]
        return latent[:, None], self.rotate(k_rope[:, None], positions)

    def forward(
        self,
        x: torch.Tensor,
        *,
        positions: torch.Tensor | None = None,
        causal: bool = True,
        key_padding_mask: torch.Tensor | None = None,
        mask: masks.Rule | torch.Tensor | None = None,
        cache: LatentCache | None = None,
        computation: str | None = None,
    ) -> torch.Tensor:
        """Self-attention of ``x`` over itself and what ``cache`` holds.

        Args:
            x: ``(b, l, d)`` the new tokens.
            positions: integer ``(l,)`` or ``(b, l)`` positions of the new tokens (rotary and
                ``query_scaling``); default ``cache.length ..`` (or ``0 ..``). With left padding,
                give each row's own (transformers' ``position_ids``).
            causal: query ``i`` sees keys ``j <= i`` (indices in the whole sequence, cache included).
            key_padding_mask: bool ``(b, l)``, True = padding, for the new tokens; a cache remembers it.
            mask: a :mod:`selfattn.masks` rule, or a bool tensor (True = attend) ``(l, n)``,
                ``(b, l, n)`` or ``(b, h, l, n)`` over every key seen (cache included), joined to the
                rest by "and": e.g. a top-k selection.
            cache: a :class:`~selfattn.latent.LatentCache` (decoding).
            computation: override the layer's ``computation`` for this call.

        Returns:
            ``(b, l, d)``. A query that may see no key has zeros before ``o_proj``.
        """
        cache, positions = self._check(x, positions, key_padding_mask, cache, causal)
        q_nope, q_rope = self.project_queries(x, positions)
        seen, visibility = self._seen(x, positions, key_padding_mask, mask, cache, causal)
        out = latent_attention(
            q_nope, q_rope, seen.latent_key, self.kv_b_proj.weight, scale=self.scale, visibility=visibility,
            dropout_p=self.dropout if self.training else 0.0, computation=computation or self.computation,
        )  # fmt: skip
        result: torch.Tensor = self.o_proj(out.transpose(1, 2).flatten(2))  # (b, l, h * dv) -> (b, l, d)
        if cache is not None:
            cache.commit()  # the new tokens count as stored only once attention has succeeded
        return result

    def explain(self, x: torch.Tensor, **kwargs: Any) -> LatentExplanation:
        """Which computation and route :meth:`forward` takes with these arguments (a cache is copied, not changed).

        In the caller's grad mode, as :meth:`forward` would run: decoding under ``torch.no_grad`` may
        take the "split keys" route, which a call in grad mode does not.
        """
        given = inspect.signature(self.forward).bind(x, **kwargs)
        given.apply_defaults()
        arguments = dict(given.arguments)
        cache = arguments["cache"]
        if isinstance(cache, LatentCache):
            arguments["cache"] = cache.copy()
        grad_mode = torch.is_grad_enabled()  # the split-keys route takes only calls made without it
        with torch.no_grad():
            cache, positions = self._check(
                x, arguments["positions"], arguments["key_padding_mask"], arguments["cache"], arguments["causal"]
            )
            q_nope, q_rope = self.project_queries(x, positions)
            seen, visibility = self._seen(
                x, positions, arguments["key_padding_mask"], arguments["mask"], cache, arguments["causal"]
            )
        with torch.set_grad_enabled(grad_mode):
            return explain_latent(
                q_nope, q_rope, seen.latent_key, self.kv_b_proj.weight, scale=self.scale, visibility=visibility,
                computation=arguments["computation"] or self.computation,
            )  # fmt: skip

    # ------------------------------------------------------------------ helpers

    def _check(
        self,
        x: torch.Tensor,
        positions: torch.Tensor | None,
        key_padding_mask: torch.Tensor | None,
        cache: object,
        causal: object,
    ) -> tuple[LatentCache | None, torch.Tensor]:
        """Refuse what does not fit; the positions of the new tokens."""
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"x must have shape (b, l, {self.hidden_size}), got {getattr(x, 'shape', x)!r}")
        require_bool("causal", causal)
        if isinstance(cache, KVCache):
            raise ValueError("cache is a KVCache: a MultiHeadLatentAttention layer caches latents, pass a LatentCache")
        if cache is not None and not isinstance(cache, LatentCache):
            raise ValueError(f"cache must be a LatentCache, got {type(cache).__name__}")
        if cache is not None and cache.sink_tokens and self.window is not None:
            raise ValueError(
                f"a LatentCache with sink_tokens={cache.sink_tokens} drops the keys between its sinks and its window, "
                f"and this layer's window={self.window} reads where keys sit: use a cache without sink tokens"
            )
        kept = None if cache is None or cache.sink_tokens else cache.window
        if kept is not None and (self.window is None or kept < self.window):
            raise ValueError(f"cache keeps only a window of {kept} keys, and this layer has window={self.window}")
        batch, length = x.shape[:2]
        start = 0 if cache is None else cache.length
        if positions is None:
            positions = torch.arange(start, start + length, device=x.device)
        if not isinstance(positions, torch.Tensor) or positions.is_floating_point() or positions.dtype == torch.bool:
            raise ValueError(f"positions must be an integer tensor, got {getattr(positions, 'dtype', positions)!r}")
        if tuple(positions.shape) not in ((length,), (batch, length)):
            raise ValueError(
                f"positions must have shape ({length},) or ({batch}, {length}), got {tuple(positions.shape)}"
            )
        if key_padding_mask is not None and (
            not isinstance(key_padding_mask, torch.Tensor)
            or key_padding_mask.dtype != torch.bool
            or tuple(key_padding_mask.shape) != (batch, length)
        ):
            raise ValueError(
                f"key_padding_mask must be a bool tensor ({batch}, {length}), got {getattr(key_padding_mask, 'shape', key_padding_mask)!r}"
            )
        return cache, positions.to(x.device)

    def _seen(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        key_padding_mask: torch.Tensor | None,
        mask: masks.Rule | torch.Tensor | None,
        cache: LatentCache | None,
        causal: bool,
    ) -> tuple[CachedLatents, Visibility]:
        """The latents the queries may see (the cache's and the new) and what each query sees of them."""
        latent, k_rope = self.project_latent(x, positions)
        length = x.shape[1]
        if cache is None:
            seen = CachedLatents(torch.cat((latent, k_rope), dim=-1), positions, key_padding_mask, 0)
            total = length
        else:
            seen = cache.update(latent, k_rope, positions=positions, padding=key_padding_mask, commit=False)
            total = cache.length + length
        if mask is not None and not isinstance(mask, (masks.Rule, torch.Tensor)):
            raise ValueError(f"mask must be a selfattn.masks rule or a bool tensor, got {type(mask).__name__}")
        if mask is not None and cache is not None and cache.sink_tokens:
            raise ValueError(
                f"mask with a LatentCache of sink_tokens={cache.sink_tokens}: the cache dropped keys the mask would index"
            )
        if isinstance(mask, torch.Tensor):
            if mask.dim() == 3:
                mask = mask[:, None]  # (b, l, n) -> (b, 1, l, n): one selection per sequence, every head
            if mask.dim() >= 2 and mask.shape[-1] not in (1, total):  # cut to the kept keys below: check it first
                raise ValueError(
                    f"mask of shape {tuple(mask.shape)} must have one column per key seen ({total}), or 1 to broadcast"
                )
            if mask.dim() >= 2 and mask.shape[-1] != 1:
                mask = mask[..., seen.first_index : seen.first_index + seen.latent_key.shape[-2]]
            mask = masks.dense(mask)
        visibility = Visibility(length, seen.latent_key.shape[-2], total - length, seen.first_index).with_rules(
            masks.causal() if causal else None,
            None if self.window is None else masks.window(self.window),
            None if seen.padding is None else masks.key_padding(seen.padding),
            mask,
        )
        return seen, visibility

    def extra_repr(self) -> str:
        extra = "" if self.q_lora_rank is None else f", q_lora_rank={self.q_lora_rank}"
        extra += "" if self.query_scaling is None else f", query_scaling={self.query_scaling}"
        extra += "" if self.lora_scales is None else f", lora_scales={self.lora_scales}"
        extra += "" if self.window is None else f", window={self.window}"
        extra += "" if self.softmax_scaling is None else ", head_log_scaling=True"
        return (
            f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, kv_lora_rank={self.kv_lora_rank}, "
            f"qk_nope_head_dim={self.qk_nope_head_dim}, qk_rope_head_dim={self.qk_rope_head_dim}, "
            f"v_head_dim={self.v_head_dim}, scale={self.scale:.6g}, computation={self.computation!r}{extra}"
        )


def _pair(name: str, value: object, *, positive: bool) -> tuple[float, float]:
    """Two finite numbers (``positive``: both > 0; else the first any finite, the second > 0)."""
    if not isinstance(value, tuple) or len(value) != 2:
        raise ValueError(f"{name} must be a pair of numbers, got {value!r}")
    first, second = value
    if positive:
        return require_positive_finite(f"{name}[0]", first), require_positive_finite(f"{name}[1]", second)
    if isinstance(first, bool) or not isinstance(first, (int, float)) or first != first or abs(first) == float("inf"):
        raise ValueError(f"{name}[0] must be a finite number, got {first!r}")
    return float(first), require_positive_finite(f"{name}[1]", second)
