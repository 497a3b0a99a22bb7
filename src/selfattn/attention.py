"""Multi-head attention with the chapter's ``valid_lens``, causal masks, positions and a cache.

Shape legend:
    b: batch, lq: queries, lk: keys, h: heads, dh: head size (num_hiddens / h),
    d: num_hiddens, dq / dk / dv: feature sizes of queries / keys / values.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from selfattn._validation import ArgumentTypeError, require_position, require_positive_int, require_probability
from selfattn.cache import KVCache
from selfattn.functional import attention, attention_weights, valid_lens_mask
from selfattn.positional.base import PositionalEncoding, QueryKeyEncoding, ScoreEncoding

__all__ = ["MultiHeadAttention"]


class MultiHeadAttention(nn.Module):
    """Multi-head scaled dot-product attention, named as in the chapter.

    The projections ``W_q, W_k, W_v, W_o`` are ``nn.Linear`` layers, so a ``state_dict``
    saved from the textbook's ``MultiHeadAttention`` loads as it is.

    Differences from the textbook, all deliberate:

    * a query whose valid length is 0 attends to nothing: its output row and weights are
      zeros (the textbook returns a uniform average over the padding);
    * keys at or past the longest valid length are never projected nor scored, so padding
      costs nothing;
    * ``causal=True`` with fewer queries than keys aligns the mask to the last key.

    Args:
        num_hiddens: output size ``d``, split over the heads.
        num_heads: number of heads ``h``; must divide ``num_hiddens``.
        dropout: dropout on the attention weights (training only).
        bias: whether the four projections have a bias.
        query_size: feature size of the queries (default ``num_hiddens``).
        key_size: feature size of the keys (default ``num_hiddens``).
        value_size: feature size of the values (default ``num_hiddens``).
        position: a query/key encoding (rotary) or a score encoding (ALiBi, T5, Shaw) applied
            inside attention. Encodings added to the input are applied by the caller.
    """

    def __init__(
        self,
        num_hiddens: int,
        num_heads: int,
        dropout: float = 0.0,
        *,
        bias: bool = False,
        query_size: int | None = None,
        key_size: int | None = None,
        value_size: int | None = None,
        position: PositionalEncoding | None = None,
    ):
        super().__init__()
        self.num_hiddens = require_positive_int("num_hiddens", num_hiddens)
        self.num_heads = require_positive_int("num_heads", num_heads)
        if num_hiddens % num_heads:
            raise ValueError(f"num_hiddens={num_hiddens} is not divisible by num_heads={num_heads}")
        self.head_dim = num_hiddens // num_heads
        self.dropout = require_probability("dropout", dropout)
        sizes = {}
        for name, size in (("query_size", query_size), ("key_size", key_size), ("value_size", value_size)):
            sizes[name] = num_hiddens if size is None else require_positive_int(name, size)
        self.query_size, self.key_size, self.value_size = sizes["query_size"], sizes["key_size"], sizes["value_size"]
        if position is not None and not isinstance(position, (QueryKeyEncoding, ScoreEncoding)):
            raise ValueError(
                f"position must rotate queries/keys or bias the scores, got {type(position).__name__} "
                "(add input encodings to the input instead)"
            )
        self.position = position
        self.W_q = nn.Linear(self.query_size, num_hiddens, bias=bias)
        self.W_k = nn.Linear(self.key_size, num_hiddens, bias=bias)
        self.W_v = nn.Linear(self.value_size, num_hiddens, bias=bias)
        self.W_o = nn.Linear(num_hiddens, num_hiddens, bias=bias)

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        b, length, _ = x.shape
        return x.view(b, length, self.num_heads, self.head_dim).transpose(1, 2)  # (b, h, l, dh)

    def _check_inputs(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        for name, t, size in (
            ("queries", queries, self.query_size),
            ("keys", keys, self.key_size),
            ("values", values, self.value_size),
        ):
            if not isinstance(t, torch.Tensor) or t.dim() != 3 or t.shape[-1] != size:
                raise ValueError(f"{name} must have shape (batch, length, {size}), got {tuple(getattr(t, 'shape', ()))}")
            if not t.is_floating_point():
                raise ValueError(f"{name} must be floating point, got dtype {t.dtype}")
            weight = self.W_q.weight
            mixed_ok = torch.is_autocast_enabled(t.device.type)  # autocast casts inside the projections
            if (t.dtype != weight.dtype and not mixed_ok) or t.device != weight.device:
                raise ValueError(
                    f"{name} must be {weight.dtype} on {weight.device} like this layer's weights, "
                    f"got {t.dtype} on {t.device} (convert the input or call .to() on the layer)"
                )
        if not queries.shape[0] == keys.shape[0] == values.shape[0]:
            raise ValueError(
                f"queries, keys and values must share the batch size, got {queries.shape[0]}, {keys.shape[0]}, {values.shape[0]}"
            )
        if keys.shape[1] != values.shape[1]:
            raise ValueError(f"keys and values must have the same length, got {keys.shape[1]} and {values.shape[1]}")

    @staticmethod
    def _check_valid_lens(valid_lens: torch.Tensor, batch: int, num_queries: int, max_keys: int) -> torch.Tensor:
        if not isinstance(valid_lens, torch.Tensor):
            try:
                valid_lens = torch.as_tensor(valid_lens)
            except (TypeError, ValueError, RuntimeError):
                raise ArgumentTypeError(
                    f"valid_lens must be a tensor (or list) of lengths, got {type(valid_lens).__name__} {valid_lens!r}"
                ) from None
        if valid_lens.shape not in ((batch,), (batch, num_queries)):
            raise ValueError(
                f"valid_lens must have shape ({batch},) or ({batch}, {num_queries}), got {tuple(valid_lens.shape)}"
            )
        if valid_lens.dtype == torch.bool or valid_lens.is_complex():
            raise ValueError(f"valid_lens must hold integer lengths, got dtype {valid_lens.dtype}")
        if valid_lens.is_floating_point():
            if not torch.equal(valid_lens, valid_lens.round()):
                raise ValueError(f"valid_lens must hold whole numbers, got {valid_lens.tolist()}")
            valid_lens = valid_lens.long()
        if valid_lens.numel():
            low, high = int(valid_lens.min()), int(valid_lens.max())
            if low < 0 or high > max_keys:
                raise ValueError(f"valid_lens must lie in [0, {max_keys}] (the number of keys), got {valid_lens.tolist()}")
        return valid_lens

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
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attend from ``queries`` to ``keys``/``values``.

        Args:
            queries: ``(b, lq, dq)``.
            keys: ``(b, lk, dk)``.
            values: ``(b, lk, dv)``.
            valid_lens: ``(b,)`` or ``(b, lq)``; key ``j`` is visible iff ``j < valid_len``
                (with a cache, ``j`` counts every key stored, and lengths may reach
                ``cache.max_len``).
            causal: query ``i`` sees only keys at positions up to its own (lower-right aligned).
            return_weights: also return the ``(b, h, lq, lk)`` attention weights.
            offset: absolute position of the first query (default 0, or ``cache.length``).
            cache: a :class:`~selfattn.KVCache` for incremental decoding.

        Returns:
            ``(b, lq, d)``, or ``(output, weights)``.
        """
        self._check_inputs(queries, keys, values)
        if cache is not None and not isinstance(cache, KVCache):
            raise ArgumentTypeError(f"cache must be a KVCache, got {type(cache).__name__} {cache!r}")
        batch, num_queries, num_new_keys = queries.shape[0], queries.shape[1], keys.shape[1]
        if offset is None:
            offset = 0 if cache is None else cache.length
        offset = require_position("offset", offset, num_queries)
        past = 0 if cache is None else cache.length
        total_keys = past + num_new_keys

        if valid_lens is not None:
            max_keys = total_keys if cache is None else cache.max_len
            valid_lens = self._check_valid_lens(valid_lens, batch, num_queries, max_keys)
            if cache is None:
                # Keys at or past the longest valid length are invisible to every query: skip them.
                kept = max(int(valid_lens.max()), 1) if valid_lens.numel() else num_new_keys
                if kept < num_new_keys:
                    keys, values, num_new_keys = keys[:, :kept], values[:, :kept], kept

        device = queries.device
        # Queries are the last lq of all keys: key j of the full sequence sits at offset + lq - total + j.
        first_key_position = offset + num_queries - total_keys
        q_positions = torch.arange(offset, offset + num_queries, device=device)  # (lq,)
        k_positions = torch.arange(first_key_position, first_key_position + past + num_new_keys, device=device)

        q = self._split_heads(self.W_q(queries))  # (b, h, lq, dh)
        k = self._split_heads(self.W_k(keys))  # (b, h, lk_new, dh)
        v = self._split_heads(self.W_v(values))  # (b, h, lk_new, dh)
        if isinstance(self.position, QueryKeyEncoding):
            if cache is not None and past:
                self.position.update_cached_keys(cache, k_positions)  # e.g. dynamic rotary re-rotates them
            q = self.position(q, q_positions)
            k = self.position.encode_keys(k, k_positions[past:])
        if cache is not None:
            k, v = cache.append(k, v, commit=False)  # (b, h, past + lk_new, dh); stored once attention succeeds

        mask = None if valid_lens is None else valid_lens_mask(valid_lens.to(device), k.shape[-2])
        truncated = k.shape[-2] < total_keys
        if causal and truncated:
            # Dropped keys shift the lower-right alignment, so spell the causal mask out by position.
            by_position = k_positions[None, :] <= q_positions[:, None]  # (lq, lk)
            mask = by_position if mask is None else mask & by_position
            causal = False

        bias = None
        if isinstance(self.position, ScoreEncoding):
            bias = self.position(q, q_positions=q_positions, k_positions=k_positions)
        dropout_p = self.dropout if self.training else 0.0

        if isinstance(self.position, ScoreEncoding) and self.position.uses_weights:
            weights = attention_weights(q, k, mask=mask, bias=bias, causal=causal)
            dropped = F.dropout(weights, p=dropout_p) if dropout_p > 0 else weights
            out = torch.matmul(dropped, v) + self.position.value_term(
                dropped, q_positions=q_positions, k_positions=k_positions
            )
        elif return_weights:
            out, weights = attention(q, k, v, mask=mask, bias=bias, causal=causal, dropout_p=dropout_p, return_weights=True)
        else:
            out = attention(q, k, v, mask=mask, bias=bias, causal=causal, dropout_p=dropout_p)

        out = out.transpose(1, 2).reshape(batch, num_queries, self.num_hiddens)  # (b, lq, d)
        out = self.W_o(out)
        if cache is not None:
            cache.commit()
        if not return_weights:
            return out
        if truncated:
            weights = F.pad(weights, (0, total_keys - weights.shape[-1]))  # skipped keys weigh 0: (b, h, lq, lk)
        return out, weights

    def extra_repr(self) -> str:
        return f"num_hiddens={self.num_hiddens}, num_heads={self.num_heads}, dropout={self.dropout}"
