"""DeepSeek sparse attention (DSA) as one layer: multi-head latent attention over the keys its indexer picks.

DeepSeek-V3.2's and GLM-MoE-DSA's attention layer: the :class:`~selfattn.sparse.LightningIndexer`
reads the layer's input and its query latent ``q_a_layernorm(q_a_proj(x))``, scores every earlier
key and picks each query's ``top_k``; the multi-head latent attention then sees only those keys
(:func:`selfattn.masks.selected`, "and" the causal and padding rules), so the dispatcher may take
the "sparse selection" route. The parameters are named as transformers names them (the MLA's at
the top level, the indexer's under ``indexer.``), so a ``DeepseekV32Attention`` state dict loads
strictly.

Shape legend:
    b: batch, l: new tokens, n: keys seen (cache included), d: hidden size, k: picks per query,
    dr: rotary features (qk_rope_head_dim).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

import selfattn.masks as masks
from selfattn._validation import require_positive_int
from selfattn.latent.cache import LatentCache
from selfattn.latent.functional import LatentExplanation
from selfattn.latent.mla import MultiHeadLatentAttention
from selfattn.sparse.cache import IndexerKeyCache
from selfattn.sparse.indexer import LightningIndexer, select_top_k

__all__ = ["SparseLatentAttention", "SparseLatentCache"]

# Attention layer class -> its indexer's options beyond the sizes.
_LAYERS: dict[str, dict[str, Any]] = {
    "DeepseekV32Attention": {"index_interleaved": False},
    "GlmMoeDsaAttention": {"index_interleaved": True},
    "MistralLarge4TextAttention": {
        "index_interleaved": True, "index_query_input": "hidden", "index_head_log_scaling": True,
    },
}  # fmt: skip


class SparseLatentCache:
    """What one :class:`SparseLatentAttention` layer has seen: its latents and its indexer's keys, kept in step.

    Both parts take a call's new tokens only once the whole layer's call has succeeded, so their
    lengths never part: a failed call leaves both as they were.

    Args:
        max_len: the most tokens the cache will hold.

    Attributes:
        latent: the attention's :class:`~selfattn.latent.LatentCache`.
        index_keys: the indexer's :class:`~selfattn.sparse.IndexerKeyCache`.
    """

    def __init__(self, max_len: int):
        require_positive_int("max_len", max_len)
        self.latent = LatentCache(max_len)
        self.index_keys = IndexerKeyCache(max_len)

    @property
    def length(self) -> int:
        """Tokens seen so far; the position of the next token by default."""
        return self.latent.length

    @property
    def nbytes(self) -> int:
        """Bytes held by both parts (the latent storage allocated, the index keys stored)."""
        return self.latent.nbytes + self.index_keys.nbytes()

    def reset(self) -> None:
        """Forget everything stored in both parts."""
        self.latent.reset()
        self.index_keys.reset()

    def copy(self) -> SparseLatentCache:
        """A copy whose storage is its own (what ``explain`` may change without touching this cache)."""
        twin = copy.copy(self)
        twin.latent = self.latent.copy()
        twin.index_keys = copy.copy(self.index_keys)
        for name in ("_keys", "_padding"):
            stored = getattr(self.index_keys, name)
            setattr(twin.index_keys, name, None if stored is None else stored.clone())
        return twin

    def __repr__(self) -> str:
        return f"SparseLatentCache(length={self.length}, latent={self.latent!r})"


class SparseLatentAttention(MultiHeadLatentAttention):
    """Multi-head latent attention whose queries each see only the ``top_k`` keys a lightning indexer picks.

    The layer is a :class:`~selfattn.latent.MultiHeadLatentAttention` (same arguments, same
    parameters at the top level) with a :class:`~selfattn.sparse.LightningIndexer` as
    ``indexer``. The indexer rotates its first ``qk_rope_head_dim`` features with the layer's own
    rotary (``position``: its scaling and attention factor included, as transformers hands the
    model's rotary embedding to both). The picks carry no gradient (a top-k has none; transformers
    also runs its indexer under ``torch.no_grad``), so the indexer's parameters get none from this
    layer's output.

    A layer may instead share another layer's picks (GLM-5's ``indexer_types`` "shared" layers,
    which reuse the top-k of the last layer that ran an indexer): built with
    ``index_heads = index_head_dim = top_k = None`` it has no indexer (``indexer`` is None), its
    cache is a plain :class:`~selfattn.latent.LatentCache`, and each call takes the picks as
    ``picks=``, as :meth:`forward_with_picks` of the selecting layer returned them.

    Args:
        index_heads: the indexer's heads (``index_n_heads``); None for a layer that shares picks.
        index_head_dim: the indexer's head size (``index_head_dim``); None likewise.
        top_k: keys picked per query (``index_topk``); None likewise.
        index_interleaved: the indexer reads rotary pairs interleaved (GLM-MoE-DSA, Mistral Large 4)
            rather than as two halves (DeepSeek-V3.2).
        index_query_input: what the indexer's queries read: ``"latent"``, the query latent
            ``q_a_layernorm(q_a_proj(x))``, or ``"hidden"``, the layer's input (Mistral Large 4).
        index_head_log_scaling: the indexer scales its queries per head by the position (Mistral Large 4).
        **options: the arguments of :class:`~selfattn.latent.MultiHeadLatentAttention`;
            ``q_lora_rank`` is required by an indexer that reads the query latent.

    Raises:
        ValueError: no ``q_lora_rank`` with an indexer, some but not all of the indexer's sizes,
            a ``window`` (the indexer's cache keeps every key), a bad indexer size; named.
    """

    def __init__(
        self,
        *,
        index_heads: int | None,
        index_head_dim: int | None,
        top_k: int | None,
        index_interleaved: bool = False,
        index_query_input: str = "latent",
        index_head_log_scaling: bool = False,
        **options: Any,
    ):
        super().__init__(**options)
        if self.window is not None:
            raise ValueError(f"window={self.window}: a sparse latent layer picks among every earlier key")
        sizes = {"index_heads": index_heads, "index_head_dim": index_head_dim, "top_k": top_k}
        self.indexer: LightningIndexer | None = None
        if all(size is None for size in sizes.values()):
            return  # shares another layer's picks
        if index_heads is None or index_head_dim is None or top_k is None:
            raise ValueError(
                f"{', '.join(f'{k}={v}' for k, v in sizes.items())}: give all three (a layer with its own indexer) "
                "or none (a layer that takes another layer's picks)"
            )
        if self.q_lora_rank is None and index_query_input == "latent":
            raise ValueError("q_lora_rank=None: the indexer reads the query latent q_a_layernorm(q_a_proj(x))")
        self.indexer = LightningIndexer(
            self.hidden_size, self.q_lora_rank or self.hidden_size, index_heads, index_head_dim,
            self.qk_rope_head_dim, top_k, interleaved=index_interleaved, query_input=index_query_input,
            head_log_scaling=index_head_log_scaling,
        )  # fmt: skip
        self.indexer.to(device=self.o_proj.weight.device, dtype=self.o_proj.weight.dtype)

    @property
    def shares_picks(self) -> bool:
        """Whether the layer has no indexer and takes another layer's picks (``picks=``)."""
        return self.indexer is None

    @classmethod
    def from_transformers(cls, layer: nn.Module, *, rotary_embedding: nn.Module | None = None) -> SparseLatentAttention:
        """The layer equal to transformers' ``DeepseekV32Attention``, ``GlmMoeDsaAttention`` or ``MistralLarge4TextAttention``.

        ``layer(x, position_embeddings=rotary(x, position_ids), attention_mask=causal mask)`` then
        equals ``sparse(x, positions=position_ids, key_padding_mask=padding)``; the state dict
        loads strictly (every name of the transformers layer, the indexer's included).
        ``rotary_embedding``: the model's rotary module, for Mistral Large 4's learned frequencies
        (its indexer reads the hidden states and scales its queries per head).

        A layer of ``indexer_types`` "shared" (GLM-5, Mistral Large 4) has no indexer: the layer
        made shares picks (``picks=``, from the last "full" layer's :meth:`forward_with_picks`), as
        transformers hands it ``prev_topk_indices``. Mistral Large 4's cross-layer latent sharing
        (``kv_sharing_modes`` "reuse") is refused, as by the MLA loader.

        Raises:
            ValueError: another layer class; what
                :meth:`MultiHeadLatentAttention.from_transformers` refuses; named.
        """
        names = [c.__name__ for c in type(layer).__mro__ if c.__module__.startswith("transformers.")]
        found = [name for name in names if name in _LAYERS]
        if not found:
            raise ValueError(f"layer must be a transformers {', '.join(_LAYERS)}, got {type(layer).__name__}")
        hf: Any = layer
        mla = MultiHeadLatentAttention.from_transformers(layer, rotary_embedding=rotary_embedding)
        config = hf.config
        own = getattr(hf, "indexer", None) is not None
        made = cls(
            index_heads=int(config.index_n_heads) if own else None,
            index_head_dim=int(config.index_head_dim) if own else None,
            top_k=int(config.index_topk) if own else None, **_LAYERS[found[0]], **_options_of(mla),
        )  # fmt: skip
        made.load_state_dict(hf.state_dict(), strict=True)
        return made.train(hf.training)

    # ------------------------------------------------------------------ the steps of forward

    def index_rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``(b or 1, l, dr)`` of the layer's rotary at ``positions``, halves repeated (the indexer's layout)."""
        length = positions.shape[-1]
        if self.position is None:
            empty = torch.zeros(1, length, 0, dtype=dtype, device=positions.device)
            return empty, empty
        frequencies, attention_factor = self.position.frequencies_at(None)  # a length-free rotary (checked)
        angles = positions.to(torch.float64).reshape(-1, length)[..., None] * frequencies.to(positions.device)
        angles = torch.cat((angles, angles), dim=-1)
        return (angles.cos() * attention_factor).to(dtype), (angles.sin() * attention_factor).to(dtype)

    def select(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        key_padding_mask: torch.Tensor | None,
        index_keys: IndexerKeyCache | None,
    ) -> torch.Tensor:
        """Each new query's picks, int64 ``(b, l, min(top_k, n))``, ``-1`` past its visible keys.

        The new index keys are put after ``index_keys``' (not committed: the layer commits them
        with the latents).
        """
        if self.indexer is None:
            raise ValueError("this layer shares another layer's picks (no indexer): pass picks= to forward")
        with torch.no_grad():  # integer picks: no gradient flows through them
            if self.indexer.query_input == "hidden":
                q_input = x
            else:
                assert self.q_a_proj is not None and self.q_a_layernorm is not None
                q_input = self.q_a_layernorm(self.q_a_proj(x))  # (b, l, rq)
            cos, sin = self.index_rotary(positions, x.dtype)
            keys = self.indexer.index_keys(x, cos, sin)  # (b, l, D)
            queries, weights = self.indexer.index_queries(x, q_input, cos, sin, positions)
            first, padding = 0, key_padding_mask
            if index_keys is not None:
                first = index_keys.length
                keys, padding = index_keys.extend(keys, padding)
            return select_top_k(queries, weights, keys, padding, first, self.indexer.top_k)

    def forward(
        self,
        x: torch.Tensor,
        *,
        positions: torch.Tensor | None = None,
        causal: bool = True,
        key_padding_mask: torch.Tensor | None = None,
        mask: masks.Rule | torch.Tensor | None = None,
        cache: Any = None,
        computation: str | None = None,
        picks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal self-attention of ``x`` over the keys its indexer picks (the cache's included).

        Args:
            x: ``(b, l, d)`` the new tokens.
            positions: integer ``(l,)`` or ``(b, l)`` positions of the new tokens (default
                ``cache.length ..``); with left padding, each row's own.
            causal: must be True (the indexer picks among earlier keys).
            key_padding_mask: bool ``(b, l)``, True = padding, for the new tokens.
            mask: must be None (the indexer's picks are this layer's mask).
            cache: a :class:`SparseLatentCache` (decoding); a
                :class:`~selfattn.latent.LatentCache` for a layer that shares picks.
            computation: ``"expanded"``, ``"absorbed"`` or ``"auto"`` for this call.
            picks: integer ``(b or 1, l, k)`` key indices (cache included, ``-1`` unused), another
                layer's (:meth:`forward_with_picks`): required by a layer that shares picks,
                refused by one with its own indexer.

        Returns:
            ``(b, l, d)``.

        Raises:
            ValueError: ``causal=False``, a ``mask``, a cache of another kind, ``picks`` missing or
                not wanted, and what :class:`~selfattn.latent.MultiHeadLatentAttention` refuses; named.
        """
        return self.forward_with_picks(
            x, positions=positions, causal=causal, key_padding_mask=key_padding_mask, mask=mask, cache=cache,
            computation=computation, picks=picks,
        )[0]  # fmt: skip

    def forward_with_picks(
        self,
        x: torch.Tensor,
        *,
        positions: torch.Tensor | None = None,
        causal: bool = True,
        key_padding_mask: torch.Tensor | None = None,
        mask: masks.Rule | torch.Tensor | None = None,
        cache: Any = None,
        computation: str | None = None,
        picks: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward`'s output and the picks it attended to, ``(b or 1, l, k)``, for layers that share them.

        GLM-5 runs its indexer in "full" layers only; each "shared" layer after one takes its picks.
        The arguments are :meth:`forward`'s.
        """
        latent, index_keys, positions = self._prepare(x, positions, causal, key_padding_mask, mask, cache, picks)
        if picks is None:
            picks = self.select(x, positions, key_padding_mask, index_keys)
        result = super().forward(
            x, positions=positions, key_padding_mask=key_padding_mask, mask=masks.selected(picks), cache=latent,
            computation=computation,
        )  # fmt: skip
        if index_keys is not None:
            index_keys.commit()  # the latent cache committed inside: both or neither
        return result, picks

    def explain(self, x: torch.Tensor, **kwargs: Any) -> LatentExplanation:
        """Which computation and route :meth:`forward` takes with these arguments (a cache is copied, not changed)."""
        cache = kwargs.get("cache")
        if isinstance(cache, SparseLatentCache):
            kwargs["cache"] = cache.copy()  # a LatentCache (a layer that shares picks) is copied by the MLA's explain
        picks = kwargs.pop("picks", None)
        latent, index_keys, positions = self._prepare(
            x, kwargs.get("positions"), kwargs.get("causal", True), kwargs.get("key_padding_mask"),
            kwargs.get("mask"), kwargs.get("cache"), picks,
        )  # fmt: skip
        if picks is None:
            picks = self.select(x, positions, kwargs.get("key_padding_mask"), index_keys)
        arguments = {**kwargs, "positions": positions, "mask": masks.selected(picks), "cache": latent}
        return MultiHeadLatentAttention.explain(self, x, **arguments)

    def _prepare(
        self,
        x: torch.Tensor,
        positions: torch.Tensor | None,
        causal: object,
        key_padding_mask: torch.Tensor | None,
        mask: object,
        cache: object,
        picks: torch.Tensor | None = None,
    ) -> tuple[LatentCache | None, IndexerKeyCache | None, torch.Tensor]:
        """Refuse what does not fit; the cache's two parts and the new tokens' positions."""
        if causal is not True:
            raise ValueError(f"causal={causal!r}: a sparse latent layer's indexer picks among earlier keys only")
        if mask is not None:
            raise ValueError(f"mask={type(mask).__name__}: the indexer's picks are this layer's mask")
        if self.indexer is None:
            return self._prepare_shared(x, positions, key_padding_mask, cache, picks)
        if picks is not None:
            raise ValueError("picks given to a layer with its own indexer: it attends to the keys it picks")
        if cache is not None and not isinstance(cache, SparseLatentCache):
            raise ValueError(
                f"cache must be a SparseLatentCache (the latents and the indexer's keys), got {type(cache).__name__}"
            )
        latent = None if cache is None else cache.latent
        index_keys = None if cache is None else cache.index_keys
        if latent is not None and index_keys is not None and latent.length != index_keys.length:
            raise ValueError(
                f"cache holds {latent.length} latents and {index_keys.length} index keys: its parts were used apart"
            )
        _, positions = self._check(x, positions, key_padding_mask, latent, causal)
        return latent, index_keys, positions

    def _prepare_shared(
        self,
        x: torch.Tensor,
        positions: torch.Tensor | None,
        key_padding_mask: torch.Tensor | None,
        cache: object,
        picks: torch.Tensor | None,
    ) -> tuple[LatentCache | None, None, torch.Tensor]:
        """A layer that shares picks: they are given, and its cache holds latents only."""
        if picks is None:
            raise ValueError("picks=None: this layer has no indexer and takes another layer's picks (picks=)")
        if cache is not None and not isinstance(cache, LatentCache):
            raise ValueError(
                f"cache must be a LatentCache (a layer that shares picks keeps no index keys), got {type(cache).__name__}"
            )
        _, positions = self._check(x, positions, key_padding_mask, cache, True)
        return cache, None, positions

    def extra_repr(self) -> str:
        indexer = self.indexer
        if indexer is None:
            return f"{super().extra_repr()}, shares_picks=True"
        return (
            f"{super().extra_repr()}, index_heads={indexer.num_heads}, index_head_dim={indexer.head_dim}, "
            f"top_k={indexer.top_k}, index_interleaved={indexer.interleaved}, index_query_input={indexer.query_input!r}"
        )


def _options_of(mla: MultiHeadLatentAttention) -> dict[str, Any]:
    """The constructor arguments that rebuild ``mla`` (a DSA family's: no query scaling, LoRA scales or window)."""
    weight = mla.o_proj.weight
    return {
        "hidden_size": mla.hidden_size, "num_heads": mla.num_heads, "kv_lora_rank": mla.kv_lora_rank,
        "qk_nope_head_dim": mla.qk_nope_head_dim, "qk_rope_head_dim": mla.qk_rope_head_dim,
        "v_head_dim": mla.v_head_dim, "q_lora_rank": mla.q_lora_rank, "bias": mla.o_proj.bias is not None,
        "norm_eps": mla.kv_a_layernorm.eps, "position": mla.position, "split_rotated_pairs": mla.split_rotated_pairs,
        "scale": mla.scale, "dropout": mla.dropout, "computation": mla.computation, "device": weight.device,
        "head_log_scaling": mla.softmax_scaling is not None,
        "dtype": weight.dtype,
    }  # fmt: skip
