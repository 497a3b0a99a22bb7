"""Blockwise attention: score terms, learnable biases, value terms and dropout in O(block) memory.

The fused kernel takes a plain float mask and nothing else: a bias that needs a gradient, a
term added to the values (Shaw) or dropout send ``scaled_dot_product_attention`` to a path
that holds every ``(b, h, lq, lk)`` score at once. :func:`blockwise_attention` instead walks
over blocks of queries. For each block it asks the score term for its bias at those query
positions and the keys they may see (a block is just a smaller call of the encoding), and

* with no gradient to give the bias, no value term and no dropout, hands the block and its
  bias (a float mask) to the CPU flash kernel, forward and backward;
* otherwise computes the block's scores, probabilities and output explicitly, and in the
  backward pass recomputes them, so nothing of size ``(h, lq, lk)`` outlives a block. The
  gradient of the score term (its parameters, and the queries for Shaw's key term) comes from
  autograd run on the block's bias alone, so any encoding with parameters gets its gradient
  without writing one.

The explicit path is written for few passes over the ``(b, h, block, lk)`` tensors: they live
in buffers reused by every block (a fresh tensor of tens of MiB per block is page-faulted in
each time), the scale goes on the queries, the probabilities come from PyTorch's fused
softmax (in place on CPU; the backward recomputes them the same way, so no log-sum-exp is
kept) and the score gradient from its fused softmax backward.

A term that is a function of the key alone up to a constant per query (ALiBi's causal form:
``-m (i - j) = m (j - a) - m (i - a)``, and softmax ignores ``m (i - a)``) needs no
``(lq, lk)`` bias at all when every query sees the same keys (no causal mask, 1-D
``valid_lens``, a mask with one row): one ``(1 or b, h, 1, lk)`` row, anchored at the last
visible key so that float32 keeps the precision of the term itself, is expanded into the
float mask of every block, and the default block is then all queries at once (one call of the
flash kernel, forward and backward; :func:`_key_only_bias`). Terms with parameters evaluate
cheaply per block where they can (FIRE's MLP of a scalar is read as a piecewise linear
function, see :class:`~selfattn.positional.FIREPositionalBias`).

Causal attention with such a term (the language-model case; ``lq == lk``, no other mask) goes
chunk by chunk (:class:`_CausalKeyRows`): the keys before a chunk of queries are seen by all of
them, so they take one flash call with a view of the key-only row as the mask, and the square
diagonal tile takes one with the kernel's own causal mask; the two are merged by their
log-sum-exps, and each backward call is given the merged output and log-sum-exp.

Dropout draws a fresh mask per block from a generator seeded by (call seed, block index), so
the backward pass redraws exactly the forward's mask. Dropout or a softcap with no score term
and no sinks on CPU (and at least ``SLICED_MIN_SCORES`` scores per slice) goes one
``(batch, head)`` slice at a time in tiles of about 2 MiB (:class:`_SlicedAttention`,
:func:`choose_slice_block`), seeded per (call seed, slice, block index): each tile's cap,
softmax, keep mask and products then work in cache, and the slices go to worker threads
running one PyTorch thread each, so no small op waits on an OpenMP team. On CPU the cap's tanh
is NumPy's when NumPy is installed (PyTorch's CPU tanh is slower than a tile's matrix product;
see :func:`_tanh_in_place`). The keep test compares 16 random bits
with a threshold: the drop probability is ``p`` rounded to a multiple of ``2**-16`` (0.1 becomes
0.100006), and kept weights are divided by the exact keep probability, so the output stays an
unbiased estimate. The mask is applied as 1.0 / 0.0 factors (a float multiply is several times
faster than ``masked_fill`` with a bool mask), and ``1 / keep`` goes on the ``(block, dv)``
side: the block's output in the forward, the output gradient in the backward.

Shaw's terms at consecutive positions (:class:`_Clipped`) gather nothing over the block: the
keys more than ``K`` away from every query of the block share the two end embeddings, which
two indicator columns appended to the keys and values carry through the block's matrix
products (scores, weight sums per distance, and their gradients); only a band of
``block + 2K`` keys is gathered by distance. Value terms must be linear in the weights.

Every query block sees all keys (up to the last one it may see when causal), so each row's
softmax is finished within its block and no online rescaling is needed; the block size
(:func:`choose_block_size`) keeps one block's ``(b, h, block, lk)`` scores near 32 MiB.

Shape legend:
    b: batch, h: heads, lq: queries, lk: keys, d: head size, dv: value size.
"""

from __future__ import annotations

import torch

import selfattn.core.dispatch as dispatch
from selfattn._validation import require_bool, require_positive_int, require_probability
from selfattn.core.call import AttentionCall
from selfattn.functional._block_common import ScoreTerm, choose_block_size
from selfattn.functional._dropout_masks import dropout_keep_probability
from selfattn.functional._kernels import _check_groups, _check_shapes, _check_valid_lens, _scale
from selfattn.masks import ValidLengths, Visibility, dense
from selfattn.masks import causal as causal_rule

__all__ = ["ScoreTerm", "blockwise_attention", "choose_block_size", "dropout_keep_probability"]


def blockwise_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    term: ScoreTerm | None = None,
    q_positions: torch.Tensor | None = None,
    k_positions: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    valid_lens: torch.Tensor | None = None,
    causal: bool = False,
    dropout_p: float = 0.0,
    scale: float | None = None,
    block_size: int | None = None,
) -> torch.Tensor:
    """Attention with a score term, value term and/or dropout, one block of queries at a time.

    Equal to dense attention with the term's full bias (``term(q, q_positions=...,
    k_positions=...)``) added to the scaled scores, plus its value term for value encodings,
    while holding only one block of ``(b, h, block, lk)`` scores at a time, in the forward and
    the backward pass. A query that sees no key gets an output row of zeros.

    ``torch.compile(fullgraph=True)`` traces it with no term or a term without parameters (ALiBi),
    forward and backward (``valid_lens`` values are not checked in a graph); a learned term's
    gradient (``torch.autograd.grad`` inside the backward) breaks the graph.

    Args:
        q: ``(b, h, lq, d)`` queries.
        k: ``(b, h, lk, d)`` keys.
        v: ``(b, h, lk, dv)`` values.
        term: a score encoding (ALiBi, T5, Shaw, Kerple, FIRE, ...), or None for dropout alone.
        q_positions: integer ``(lq,)`` or ``(b, lq)`` positions of the queries (default: the
            last ``lq`` of ``0 .. lk - 1``).
        k_positions: integer ``(lk,)`` or ``(b, lk)`` positions of the keys (default ``0 .. lk - 1``).
        mask: bool, True = attend, broadcastable to ``(b, h, lq, lk)``.
        valid_lens: ``(b,)`` or ``(b, lq)``: key ``j`` is visible iff ``j < valid_len``.
        causal: query ``i`` attends keys ``j <= i + lk - lq``.
        dropout_p: dropout on the attention weights (drawn per block, redrawn identically in
            the backward pass; see :func:`dropout_keep_probability`).
        scale: score scale, default ``1 / sqrt(d)``.
        block_size: queries per block; default :func:`choose_block_size`, or all queries when
            the term is one key-only row of bias for every query (ALiBi's causal form without
            a causal mask; see the module's notes), or :func:`choose_slice_block` for dropout
            with no term on CPU (one ``(batch, head)`` slice at a time).

    Returns:
        ``(b, h, lq, dv)``.
    """
    dropout_p, causal = require_probability("dropout_p", dropout_p), require_bool("causal", causal)
    q_positions, k_positions = _check_inputs(q, k, v, term, q_positions, k_positions, mask)
    if block_size is not None:
        block_size = require_positive_int("block_size", block_size)
    if valid_lens is not None:
        _check_valid_lens(valid_lens)  # whole numbers, not negative; the call checks the batch and queries
    num_queries, num_keys = q.shape[-2], k.shape[-2]
    if valid_lens is not None:
        valid_lens = valid_lens.clamp(max=num_keys).long()  # a whole float past int64's range sees every key
    rules = [
        causal_rule() if causal else None,
        None if valid_lens is None else ValidLengths(valid_lens.to(q.device)),
        None if mask is None else dense(mask.reshape(1, -1) if mask.dim() < 2 else mask),
    ]
    scale = None if scale is None else _scale(scale, q.shape[-1])  # positive and finite, as attention's
    call = AttentionCall.of_heads(
        q, k, v, Visibility.lower_right(num_queries, num_keys, *rules), q_positions=q_positions,
        k_positions=k_positions, term=term, dropout_p=dropout_p, scale=scale, block_size=block_size,
    )  # fmt: skip
    return dispatch.run(call, dispatch.BLOCKWISE_ROUTES).out


def _check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    term: ScoreTerm | None,
    q_positions: torch.Tensor | None,
    k_positions: torch.Tensor | None,
    mask: torch.Tensor | None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Raise for heads that do not fit or a mask that is not bool; the positions a term reads (defaults filled)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, k and v must have shape (batch, heads, length, features), got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    _check_shapes(q, k, v)  # as attention: sizes, the batch, one dtype and device
    _check_groups(q, k, v)
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool):
        raise ValueError(
            f"mask must be a bool tensor (True = attend), got {getattr(mask, 'dtype', type(mask).__name__)}"
        )
    num_queries, num_keys = q.shape[-2], k.shape[-2]
    if term is not None:
        if k_positions is None:
            k_positions = torch.arange(num_keys, device=q.device)
        if q_positions is None:
            q_positions = torch.arange(num_keys - num_queries, num_keys, device=q.device)
        if q_positions.shape[-1] != num_queries or k_positions.shape[-1] != num_keys:
            raise ValueError(
                f"q_positions and k_positions must end in {num_queries} and {num_keys}, "
                f"got {tuple(q_positions.shape)} and {tuple(k_positions.shape)}"
            )
    return q_positions, k_positions
