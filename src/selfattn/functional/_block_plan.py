"""The plan of one blockwise call: its blocks, their biases and what each may see.

Shape legend: b batch, h heads, lq queries, lk keys, d head size, dv value size.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch.nn.utils import stateless

from selfattn.functional._block_clipped import _Clipped
from selfattn.functional._block_common import ScoreTerm, _as_4d, _Workspace
from selfattn.functional._dropout_masks import _keep_factors, _keep_mask
from selfattn.masks import Causal, Visibility


@dataclass
class _Plan:
    """Everything about one call that is not a tensor needing a gradient."""

    term: ScoreTerm | None
    q_positions: torch.Tensor | None
    k_positions: torch.Tensor | None
    visibility: Visibility
    scale: float
    block: int
    dropout_p: float
    seed: int
    bias_needs_grad: bool
    queries_in_term: bool
    value_term: bool
    num_queries: int
    num_keys: int
    on_cpu: bool
    band_base: int | None = None  # set when the term is read from one band (see band())
    clipped: _Clipped | None = None  # set for a Shaw term at consecutive positions (see _Clipped)
    key_bias: torch.Tensor | None = None  # set when one row of bias serves every query (see _key_only_bias)
    # Names of the term's parameters handed to the autograd Function: the term is evaluated with
    # those very tensors, so a stateless call (torch.func.functional_call) gets its gradients.
    param_names: list[str] = field(default_factory=list)
    softcap: float | None = None  # logits become softcap * tanh(logit / softcap) before the mask
    sink_param: int | None = None  # index of the (h,) sink logits among the Function's params
    skip_leading_keys: bool = False  # a block starts at the first key its queries may reach, not at key 0

    def term_params(self, params: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
        """The score term's parameters among the Function's ``params`` (the sink logits come last)."""
        return params if self.sink_param is None else params[: self.sink_param]

    def sinks(self, params: Sequence[torch.Tensor]) -> torch.Tensor | None:
        return None if self.sink_param is None else params[self.sink_param]

    @contextlib.contextmanager
    def using(self, params: Sequence[torch.Tensor]) -> Iterator[None]:
        """Evaluate the term with ``params`` (the Function's inputs) in place of its own parameters."""
        if self.term is None or not self.param_names:
            yield
            return
        named = dict(zip(self.param_names, self.term_params(params), strict=True))
        with stateless._reparametrize_module(self.term, named):  # type: ignore[arg-type]
            yield

    @property
    def causal(self) -> bool:
        return self.visibility.causal

    def key_mask(self, rows: int, keys: slice) -> torch.Tensor:
        """The float mask of a block of ``rows`` queries when the bias is the same for every query: a view."""
        assert self.key_bias is not None
        row = self.key_bias[..., keys]
        return row.expand(*row.shape[:-2], rows, row.shape[-1])

    @property
    def last_start(self) -> int:
        return (self.num_queries - 1) // self.block * self.block

    def band(self, q: torch.Tensor) -> torch.Tensor:
        """The term for every block at once, ``(1 or b, h, block, last_start + lk)``.

        For a term of ``j - i`` alone (``is_relative``) at consecutive positions, block ``s``'s
        bias is the window ``[last_start - s, last_start - s + lk)`` of the columns of one band:
        row ``r``, column ``m`` holds the term for query position ``r`` and key position
        ``m + band_base``. The band is built once per pass instead of once per block.
        """
        assert self.term is not None and self.band_base is not None
        rows = torch.arange(self.block, device=q.device)  # (block,)
        columns = torch.arange(self.last_start + self.num_keys, device=q.device) + self.band_base  # (width,)
        band = _as_4d(self.term(q[:1, :, : self.block], q_positions=rows, k_positions=columns))
        return band.expand(*band.shape[:2], rows.shape[0], columns.shape[0])

    def hide_future(self, band: torch.Tensor) -> torch.Tensor:
        """``band`` with ``-inf`` on keys a causal query may not see (a function of ``j - i`` too)."""
        if not self.causal:
            return band
        rows = torch.arange(band.shape[-2], device=band.device)[:, None]  # (block, 1)
        columns = torch.arange(band.shape[-1], device=band.device)  # (width,)
        shift = self.visibility.q_first - self.visibility.k_first  # query r sees keys c <= r + shift
        hidden = columns > rows + self.last_start + shift  # (block, width)
        return band.masked_fill(hidden, float("-inf"))

    def window(self, band: torch.Tensor, start: int, end: int, keys: slice) -> torch.Tensor:
        """Block ``start``'s ``(1 or b, h, end - start, keys)`` bias: a view of the band."""
        first = self.last_start - start
        return band[..., : end - start, first + keys.start : first + keys.stop]

    @property
    def flash_forward(self) -> bool:
        """Whether the forward hands blocks to the CPU flash kernel (it takes no value term, no dropout, no softcap)."""
        return self.on_cpu and self.dropout_p == 0.0 and not self.value_term and self.softcap is None

    @property
    def flash_backward(self) -> bool:
        return self.flash_forward and not self.bias_needs_grad

    def blocks(self) -> list[tuple[int, int, int, slice]]:
        """``(index, first query, end query, keys)`` of every block: the keys its queries may reach."""
        out = []
        for index, start in enumerate(range(0, self.num_queries, self.block)):
            end = min(start + self.block, self.num_queries)
            if self.skip_leading_keys:
                keys = slice(*self.visibility.key_range(start, end))
            else:
                keys = slice(0, self.visibility.key_limit(start, end))
            out.append((index, start, end, keys))
        return out

    def bias(self, q: torch.Tensor, start: int, end: int, keys: slice) -> torch.Tensor | None:
        if self.term is None:
            return None
        assert self.q_positions is not None and self.k_positions is not None
        return self.term(q, q_positions=self.q_positions[..., start:end], k_positions=self.k_positions[..., keys])

    def value(self, weights: torch.Tensor, start: int, end: int, keys: slice) -> torch.Tensor:
        assert self.term is not None and self.q_positions is not None and self.k_positions is not None
        return self.term.value_term(
            weights, q_positions=self.q_positions[..., start:end], k_positions=self.k_positions[..., keys]
        )

    def visible(self, start: int, end: int, keys: slice, device: torch.device) -> torch.Tensor | None:
        """Bool, True = attend, broadcastable to ``(b, h, block, keys)``; None when all are visible.

        With a band and causality alone the causal part is already in the band's ``-inf`` and is
        left out here. With any other rule it stays in: a query may then see no key only because
        of causality (the first queries of a left-padded row), and the empty rows are found from
        this mask (the blocks zero them; a softmax over a row of ``-inf`` would be NaN).
        """
        # A softcap would turn the band's -inf into -softcap: then the mask hides the future itself.
        band_hides_future = self.band_base is not None and self.softcap is None
        every_query_sees_a_key = self.visibility.only(Causal) and self.visibility.q_first >= self.visibility.k_first
        skip_causal = band_hides_future and every_query_sees_a_key
        return self.visibility.block(start, end, keys, device=device, skip_causal=skip_causal)

    def keep(self, index: int, shape: Sequence[int], device: torch.device) -> torch.Tensor:
        return _keep_mask(shape, self.block_seed(index), self.dropout_p, device)

    def keep_factors(self, index: int, shape: Sequence[int], dtype: torch.dtype, workspace: _Workspace) -> torch.Tensor:
        """Block ``index``'s keep mask as 1.0 / 0.0 in a workspace buffer."""
        return _keep_factors(shape, self.block_seed(index), self.dropout_p, dtype, workspace)

    def block_seed(self, index: int) -> int:
        return (self.seed + index * 0x9E3779B1) % 2**63
