"""Rotary position embedding (RoPE), applied to the per-head queries and keys."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

import torch

import selfattn._validation as _validation
from selfattn._validation import require_positive_int
from selfattn.functional._rotary import (
    RotaryScaling,
    _check_rotary_inputs,
    _rotate_by_positions,
    _rotate_swapped,
    rotary_angles,
    rotary_parameters,
    rotation_dtype,
    signed_angle_rows,
)
from selfattn.functional._rotary_scaling import (
    RotaryScalingConfig,
    check_partial_rotary_factor,
    parse_rotary_scaling,
    scaled_rotary_parameters,
)
from selfattn.functional._sinusoidal import _require_base
from selfattn.positional._tables import KeepsTablePrecision
from selfattn.positional.base import QueryKeyEncoding

if TYPE_CHECKING:
    from selfattn.cache import KVCache

__all__ = ["RotaryPositionalEncoding"]

CachedKeys = Literal["rerotate", "keep"]

#: The angle table holds at most this many values (cos and signed sin of each position's features,
#: float64): 16 MiB, e.g. 16,384 positions of a head size of 64. Positions past it are rotated from angles formed per call.
MAX_ANGLE_TABLE_VALUES = 1 << 21

#: Positions whose angle rows are formed together past the table's size cap, and kept while the steps stay inside.
ROWS_PAST_CAP = 1024


class RotaryPositionalEncoding(KeepsTablePrecision, QueryKeyEncoding):
    """Rotate each query and key by its position, so their scores depend on distance only.

    Pass it to :class:`~selfattn.MultiHeadAttention` as ``position=``; it is applied to the
    queries and to each new key before the key is cached. See :func:`~selfattn.functional.apply_rotary`
    for the formula and the pair conventions, and :mod:`selfattn.functional._rotary_scaling` for
    the scaling methods (linear, ntk, dynamic, yarn, llama3, longrope) and their papers.

    The inverse frequencies are a float64 non-persistent buffer that follows ``.to(device)``
    but not ``.to(dtype)``; angles are formed from the exact integer positions on every call
    (O(l * dh), negligible next to attention), so no cache can go stale under an offset.
    :meth:`rotate_consecutive` (what :class:`~selfattn.MultiHeadAttention` calls when positions
    count up from a known first one, as in decoding) reads them from ``angle_table`` instead:
    cos and sin of positions ``0 .. n - 1``, formed the same way once, grown (doubling) when
    positions pass it. It is a cache attribute, not a buffer: its size depends on the positions
    seen, and whatever copies buffers between two models of one shape (``AveragedModel``, EMA)
    would meet tables of two sizes; it is rebuilt on the frequencies' device when they move.

    **Length-dependent scaling and the cache.** ``dynamic`` and ``longrope`` change their
    frequencies with the current length ``L`` (the largest position + 1 of the call, as Hugging
    Face does); a call's queries and new keys share it. Keys already in a
    :class:`~selfattn.KVCache` were rotated with the frequencies of their own step, so once the
    length crosses ``original_max_position_embeddings`` they disagree with the new ones:

    * ``cached_keys="rerotate"`` (default): before new keys are appended, the cached keys are
      turned by ``position * (w_new - w_old)`` (rotations of one plane add up), so every step
      of one attention layer equals a full pass over the sequence so far (a call whose positions
      stay below the cached ones, as packed ``document_ids`` restarting at 0, raises
      ``ValueError``: the full pass would rotate it at the longer length) (in a deeper stack the
      later layers' cached keys come from hidden states made at earlier frequencies, which no
      rotation undoes). It costs one rotation of the cache per step
      while the frequencies keep changing (every step past ``L0`` for ``dynamic``, once for
      ``longrope``), and each turn rounds once in the cache's dtype.
    * ``cached_keys="keep"``: cached keys stay as they were rotated (Hugging Face's
      ``generate`` behaviour); outputs then differ from a full pass once ``L > L0``.

    Static methods ignore ``cached_keys``.

    Args:
        head_dim: size of each query/key ``dh``.
        base: the 10000 of the formula (``rope_theta``).
        interleaved: rotate pairs ``(2j, 2j + 1)`` (RoFormer) if True, ``(j, j + r / 2)``
            (GPT-NeoX, Llama, Hugging Face) if False.
        rotary_dim: rotate only the first ``r`` features (even, ``<= head_dim``); default all.
        scaling: ``None``, a type name (with ``scaling_factor``) or a Hugging Face
            ``rope_scaling`` dict, e.g. ``{"rope_type": "llama3", "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}``.
        scaling_factor: how many times longer than the trained context, ``>= 1``, for a
            ``scaling`` given by name.
        p: p-RoPE (Barbero et al. 2024, "Round and round we go!"): rotate only the fastest
            ``floor(p * r / 2)`` pairs and leave the slowest ones unrotated (frequency 0);
            ``p=0`` is no position encoding (NoPE), ``p=1`` (default) full rotary.
        cached_keys: ``"rerotate"`` or ``"keep"``: what cached keys do when a length-dependent
            scaling changes the frequencies (see above).

        device: where the inverse frequencies live.
        dtype: accepted for uniformity; the frequencies stay float64.

    Attributes:
        attention_factor: multiplies cos and sin (YaRN's and LongRoPE's temperature), else 1.

    Shape:
        x ``(b, h, l, dh)``, positions ``(l,)`` or ``(b, 1, l)`` (one row per sequence) -> ``(b, h, l, dh)``.
    """

    exact_tables = ("inv_freq",)
    inv_freq: torch.Tensor
    angle_table: torch.Tensor
    head_dim: int
    rotary_dim: int
    base: float
    interleaved: bool
    scaling: RotaryScaling | None
    scaling_factor: float
    scaling_config: RotaryScalingConfig | None
    p: float
    cached_keys: CachedKeys
    attention_factor: float

    def __init__(
        self,
        head_dim: int,
        base: float = 10000.0,
        interleaved: bool = True,
        *,
        rotary_dim: int | None = None,
        scaling: RotaryScaling | None = None,
        scaling_factor: float = 1.0,
        p: float = 1.0,
        cached_keys: CachedKeys = "rerotate",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = require_positive_int("head_dim", head_dim)
        self.rotary_dim = self.head_dim if rotary_dim is None else require_positive_int("rotary_dim", rotary_dim)
        if self.rotary_dim > self.head_dim:
            raise ValueError(f"rotary_dim must be at most head_dim={self.head_dim}, got {rotary_dim}")
        if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0.0 <= float(p) <= 1.0:
            raise ValueError(f"p must be a fraction in [0, 1], got {p!r}")
        if cached_keys not in ("rerotate", "keep"):
            raise ValueError(f"cached_keys must be 'rerotate' or 'keep', got {cached_keys!r}")
        self.base = _require_base(base)
        self.interleaved = bool(interleaved)
        self.scaling_config = parse_rotary_scaling(scaling, scaling_factor)
        check_partial_rotary_factor(scaling, self.head_dim, self.rotary_dim)
        self.scaling = scaling
        self.scaling_factor = float(scaling_factor)
        rotary_parameters(self.rotary_dim, self.base, scaling=scaling, scaling_factor=scaling_factor)  # validates
        self.p = float(p)
        self.cached_keys = cached_keys
        self.attention_factor = 1.0
        self._last: tuple[int | None, torch.Tensor, float] | None = None
        # angle_table's cos and sin halves in the rotation's dtype, made once: (the table they came from, the dtype,
        # cos rows, signed sin rows).
        self._split_tables: tuple[torch.Tensor, torch.dtype, torch.Tensor, torch.Tensor] | None = None
        # Rows past the cap (_rows_past_cap): (the table then, the dtype, the first position, cos rows, sin rows).
        self._past_cap: tuple[torch.Tensor, torch.dtype, int, torch.Tensor, torch.Tensor] | None = None
        self.register_buffer("inv_freq", torch.empty(0, dtype=torch.float64, device=device), persistent=False)
        self._build_tables()

    def reset_parameters(self) -> None:
        """Recompute ``inv_freq`` (after ``to_empty()`` from the meta device)."""
        self._build_tables()

    @property
    def rotated_pairs(self) -> int:
        """How many pairs rotate at all (``floor(p * r / 2)``)."""
        return math.floor(self.p * (self.rotary_dim // 2) + 1e-9)

    def frequencies_at(self, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
        """Frequencies ``(r / 2,)`` float64 (on the buffer's device) and attention factor at length ``seq_len``.

        ``None`` is the trained length; only ``dynamic`` and ``longrope`` depend on it.
        """
        device = self.inv_freq.device
        if self._last is not None and self._last[0] == seq_len and self._last[1].device == device:
            return self._last[1], self._last[2]  # a step's queries and keys share one length
        frequencies, attention_factor = scaled_rotary_parameters(
            self.rotary_dim, self.base, self.scaling_config, seq_len=seq_len
        )
        frequencies[self.rotated_pairs :] = 0.0  # p-RoPE: the slowest pairs stay put
        frequencies = frequencies.to(device)
        self._last = (seq_len, frequencies, attention_factor)
        return frequencies, attention_factor

    def _build_tables(self) -> None:
        """(Re)compute ``inv_freq`` ``(r / 2,)`` in float64 on the buffer's device, and the attention factor."""
        self._last = None
        self.inv_freq, self.attention_factor = self.frequencies_at(None)
        self.angle_table = self.inv_freq.new_empty(0, 0)  # float64, filled on first use

    def _grow_angle_table(self, stop: int) -> None:
        """Make ``angle_table`` ``(n, 2r)`` float64 of positions ``0 .. n - 1`` with ``n >= stop``: the cos and sin
        :func:`_rotate_by_positions` forms (times the attention factor), as :func:`signed_angle_rows` lays them out."""
        rows = max(stop, 2 * self.angle_table.shape[0], 256)
        rows = max(stop, min(rows, MAX_ANGLE_TABLE_VALUES // (2 * self.rotary_dim)))
        self.angle_table = self._angle_rows(torch.arange(rows, device=self.inv_freq.device))  # (n, 2r)

    def _angle_rows(self, positions: torch.Tensor) -> torch.Tensor:
        """``(l, 2r)`` float64 rows of ``positions`` ``(l,)`` as ``angle_table`` lays them out (each row depends
        only on its own position, so a row formed alone equals the table's bit for bit)."""
        cos, sin = rotary_angles(positions, self.inv_freq)  # (l, r/2)
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return signed_angle_rows(cos, sin, self.interleaved)

    def rotate_consecutive(self, x: torch.Tensor, first: int) -> torch.Tensor | None:
        """``forward(x, arange(first, first + l))`` for ``x`` ``(..., l, dh)``, its angles read from ``angle_table``.

        None where the table does not serve, and ``forward`` must: a length-dependent scaling,
        a negative first position, another device than the table's, or inside ``torch.compile``.
        Positions past :data:`MAX_ANGLE_TABLE_VALUES` get their rows formed for the call alone.
        The result equals ``forward``'s bit for bit: the same float64 angles, cast as it casts them.
        """
        rows = self._consecutive_rows(x, first)
        if rows is None:
            return None
        return _rotate_swapped(x, *rows, interleaved=self.interleaved, rotary_dim=self.rotary_dim)

    def rotate_consecutive_pair(
        self, q: torch.Tensor, k: torch.Tensor, first: int
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """:meth:`rotate_consecutive` of queries and keys at the same positions (a decoding step's), its checks and
        table reads made once for both; None where it would return None for either."""
        rows = self._consecutive_rows(q, first) if q.shape[-2] == k.shape[-2] and q.dtype == k.dtype else None
        if rows is None:
            return None
        rotary_dim, interleaved = self.rotary_dim, self.interleaved
        return (
            _rotate_swapped(q, *rows, interleaved=interleaved, rotary_dim=rotary_dim),
            _rotate_swapped(k, *rows, interleaved=interleaved, rotary_dim=rotary_dim),
        )

    def _consecutive_rows(self, x: torch.Tensor, first: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The cos and signed sin rows ``(l, r)`` of positions ``first .. first + l - 1`` for ``x`` ``(..., l, dh)``,
        read from ``angle_table`` (grown if short; past its size cap formed for these positions alone: a long
        decoding keeps its fast path), or None where :meth:`rotate_consecutive` says the table does not serve."""
        length = x.shape[-2]
        stop = first + length
        config = self.scaling_config
        frequencies = self._buffers["inv_freq"]  # not self.inv_freq: nn.Module.__getattr__ costs a step more
        assert frequencies is not None
        device = frequencies.device
        if (
            first < 0
            or (config is not None and config.depends_on_length)
            or x.device != device
            or _validation.is_compiling()
        ):
            return None
        if 2 * stop * self.rotary_dim > MAX_ANGLE_TABLE_VALUES:
            return self._rows_past_cap(first, length, rotation_dtype(x), device)
        if stop > self.angle_table.shape[0] or self.angle_table.device != device or not self.angle_table.numel():
            self._grow_angle_table(stop)  # (the table never grown has no columns, which even no rows would read)
        cos_table, sin_table = self._split_table(rotation_dtype(x))
        return cos_table.narrow(0, first, length), sin_table.narrow(0, first, length)  # two views: the cheapest reads

    def _rows_past_cap(
        self, first: int, length: int, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_consecutive_rows` past the table's size cap: read from :data:`ROWS_PAST_CAP` positions' rows formed
        together and kept while the steps stay inside them (a long decoding forms rows once a block, not once a
        step: on a GPU those are several launches). Each row depends on its own position alone: the same bits."""
        held, table = self._past_cap, self.angle_table
        if (
            held is None
            or held[0] is not table
            or held[1] != dtype
            or not 0 <= first - held[2] <= held[3].shape[0] - length
        ):
            count = max(length, ROWS_PAST_CAP)
            rows = self._angle_rows(torch.arange(first, first + count, device=device)).to(dtype)  # (count, 2r)
            r = self.rotary_dim
            held = self._past_cap = (table, dtype, first, rows[:, :r].contiguous(), rows[:, r:].contiguous())
        start = first - held[2]
        return held[3].narrow(0, start, length), held[4].narrow(0, start, length)

    def _split_table(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``angle_table``'s cos and signed sin halves ``(n, r)`` each, contiguous, in ``dtype``: made once per table
        and dtype, not per call (a cast or a slice of the whole rows is a few microseconds of every step)."""
        table = self.angle_table
        held = self._split_tables
        if held is None or held[0] is not table or held[1] != dtype:
            rows = table.to(dtype)
            held = self._split_tables = (
                table,
                dtype,
                rows[:, : self.rotary_dim].contiguous(),
                rows[:, self.rotary_dim :].contiguous(),
            )
        return held[2], held[3]

    def _current(self, positions: torch.Tensor) -> tuple[torch.Tensor, float]:
        config = self.scaling_config
        if config is None or not config.depends_on_length or positions.numel() == 0:
            return self.inv_freq, self.attention_factor
        return self.frequencies_at(max(int(positions.max()) + 1, 1))  # one host sync per call

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dim() < 2 or x.shape[-1] != self.head_dim:
            raise ValueError(f"x must have shape (..., length, {self.head_dim}), got {tuple(getattr(x, 'shape', ()))}")
        _check_rotary_inputs(x, positions)
        frequencies, attention_factor = self._current(positions)
        return _rotate_by_positions(
            x,
            positions,
            frequencies,
            interleaved=self.interleaved,
            rotary_dim=self.rotary_dim,
            magnitude=attention_factor,
        )

    @property
    def rerotates_cache(self) -> bool:
        """Whether :meth:`update_cached_keys` may turn cached keys: ``cached_keys="rerotate"`` with a
        length-dependent scaling (``dynamic``, ``longrope``)."""
        config = self.scaling_config
        return self.cached_keys == "rerotate" and config is not None and config.depends_on_length

    def update_cached_keys(self, cache: KVCache, positions: torch.Tensor) -> None:
        """Re-rotate the keys in ``cache`` to the frequencies of the coming call (``cached_keys="rerotate"``).

        ``positions`` are those of the stored keys and the new ones (``(cache.stored + l_new,)``; a
        windowed cache stores fewer keys than it has seen, at their own positions). The
        cached keys were rotated at the length noted in ``cache.encoding_state`` by the last
        re-rotation or by the call that filled the empty cache (a window may keep none of that call's
        newest keys, only its sink tokens, whose own positions then understate it); the coming call runs at
        ``max(positions) + 1``.
        """
        config = self.scaling_config
        past = cache.stored  # a windowed cache keeps only some of the cache.length keys it has seen
        if not self.rerotates_cache or config is None:
            return
        if past == 0:  # the call's keys rotate at its own length (forward's one sync, here a second)
            if positions.numel():
                cache.encoding_state["rotary_length"] = max(int(positions.max()), 0) + 1
            return
        cached_positions = positions[..., :past]  # (past,) or per sequence (b, past)
        new_positions = positions[..., past:] if positions.shape[-1] > past else cached_positions
        # One host sync for both: the largest cached position and the largest new one.
        cached_last, new_last = (int(p) for p in torch.stack((cached_positions.max(), new_positions.max())).tolist())
        noted = cache.encoding_state.get("rotary_length")
        old_length = noted if isinstance(noted, int) else max(cached_last, 0) + 1  # a cache filled by another means
        new_length, call_length = max(cached_last, new_last, 0) + 1, max(new_last, 0) + 1
        if call_length < new_length:
            # The queries and new keys rotate at their own call's length (the full pass's rule); a cached
            # key further on (an earlier packed document, positions given going back) makes the full pass
            # use a longer one, which this call cannot: refuse rather than differ from it.
            raise ValueError(
                f"cached_keys='rerotate' with a {config.rope_type!r} rotary: the new tokens' positions reach "
                f"{call_length - 1} but the cache holds position {new_length - 1}; a full pass would rotate "
                "them at its whole length. Positions that restart (packed document_ids) or go back cannot "
                "be decoded equal to a full pass; use cached_keys='keep' (Hugging Face's behaviour) or one "
                "document per cache"
            )
        old, old_factor = self.frequencies_at(old_length)
        old = old.clone()  # frequencies_at keeps only the latest length
        new, new_factor = self.frequencies_at(new_length)
        if old_factor != new_factor or not torch.equal(old, new):
            cache.update_keys(
                lambda keys: _rotate_by_positions(
                    keys,
                    cached_positions if cached_positions.dim() < 2 else cached_positions[:, None],  # (b, 1, past)
                    new - old,
                    interleaved=self.interleaved,
                    rotary_dim=self.rotary_dim,
                    magnitude=new_factor / old_factor,
                )
            )
        cache.encoding_state["rotary_length"] = new_length

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | Any, **options: Any) -> RotaryPositionalEncoding:
        """The rotary of a Hugging Face model config, in its half-split layout.

        Reads ``rope_theta`` (default 10000; also inside ``rope_parameters``), ``head_dim`` (or
        ``hidden_size / num_attention_heads``), ``partial_rotary_factor`` (rotary size
        ``int(head_dim * factor)``), ``rope_scaling`` or ``rope_parameters`` and
        ``max_position_embeddings``, filling in what Hugging Face (v5) fills in: ``dynamic``
        trains on ``max_position_embeddings``; ``llama3``, ``yarn`` and ``longrope`` take a
        top-level ``original_max_position_embeddings`` (Phi-3) over the dict's, else default it
        to ``max_position_embeddings``; ``yarn`` and ``longrope`` without ``factor`` use
        ``max_position_embeddings / original_max_position_embeddings``. The rotation then
        equals Hugging Face's ``apply_rotary_pos_emb`` with that model's cos/sin (checked against
        transformers 5.23 for every type). ``rope_type="proportional"`` (Gemma 4, LFM3) is p-RoPE
        over the whole head, see :meth:`_proportional`.

        Args:
            config: a dict (e.g. a parsed ``config.json``) or an object with those attributes.
            **options: other constructor options (``cached_keys``, ``p``).

        Raises:
            ValueError: a missing size, an odd rotary size, or a bad scaling, named.
        """

        def read(key: str, default: Any = None) -> Any:
            value = config.get(key, default) if isinstance(config, Mapping) else getattr(config, key, default)
            return default if value is None else value

        parameters = read("rope_parameters") or read("rope_scaling")
        if parameters is not None and not isinstance(parameters, Mapping):
            raise ValueError(f"config rope_scaling must be a dict, got {type(parameters).__name__}")
        scaling = dict(parameters) if parameters else None
        base = read("rope_theta", (scaling or {}).get("rope_theta", 10000.0))
        partial = read("partial_rotary_factor", (scaling or {}).get("partial_rotary_factor", 1.0))
        head_dim = read("head_dim")
        if head_dim is None:
            hidden, heads = read("hidden_size"), read("num_attention_heads")
            if hidden is None or heads is None:
                raise ValueError("config needs head_dim, or hidden_size and num_attention_heads")
            head_dim = require_positive_int("hidden_size", hidden) // require_positive_int("num_attention_heads", heads)
        head_dim = require_positive_int("head_dim", head_dim)
        if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "proportional":
            return cls._proportional(head_dim, float(base), scaling, read("partial_rotary_factor", 1.0), **options)
        if isinstance(partial, bool) or not isinstance(partial, numbers.Real) or not 0 < float(partial) <= 1:
            raise ValueError(f"config partial_rotary_factor must be in (0, 1], got {partial!r}")
        rotary_dim = int(head_dim * float(partial))
        if rotary_dim < 2 or rotary_dim % 2:
            raise ValueError(
                f"config head_dim={head_dim} * partial_rotary_factor={partial} gives {rotary_dim} rotated features; "
                "need an even number >= 2"
            )
        if scaling is not None:
            scaling.pop("rope_theta", None)
            scaling.pop("partial_rotary_factor", None)
            kind = scaling.get("rope_type", scaling.get("type"))
            max_positions = read("max_position_embeddings")
            top_level_original = read("original_max_position_embeddings")
            if kind in ("llama3", "yarn", "longrope"):
                if top_level_original is not None:  # Phi-3 keeps the trained length outside the dict
                    scaling["original_max_position_embeddings"] = top_level_original
                elif scaling.get("original_max_position_embeddings") is None and max_positions is not None:
                    scaling["original_max_position_embeddings"] = max_positions
            if kind in ("yarn", "longrope") and scaling.get("factor") is None:
                original = scaling.get("original_max_position_embeddings")
                if max_positions is not None and original:
                    scaling["factor"] = max_positions / original
            if kind == "dynamic" and max_positions is not None:
                scaling["original_max_position_embeddings"] = max_positions  # Hugging Face's dynamic L0
            if kind == "default" or (kind is None and not scaling):
                scaling = None
        return cls(head_dim, float(base), False, rotary_dim=rotary_dim, scaling=scaling, **options)

    @classmethod
    def _proportional(
        cls, head_dim: int, base: float, parameters: Mapping[str, Any], top_level_partial: Any, **options: Any
    ) -> RotaryPositionalEncoding:
        """transformers' ``rope_type="proportional"`` (Gemma 4, LFM3) as p-RoPE over the whole head.

        Its frequencies are ``base^(-2j / dh) / factor`` for the first ``k = int(partial_rotary_factor
        * dh // 2)`` pairs and 0 (no turn) for the rest, half-split over the whole head: so the
        rotated features are the first ``k`` of each half. That is half-split rotary of size ``dh``
        with p-RoPE keeping ``k`` of its ``dh / 2`` pairs (``p = k / (dh / 2)``), and ``linear``
        scaling for a ``factor`` other than 1. ``partial_rotary_factor`` is read from the dict
        (the rotary's own), else from the config.
        """
        known = {"rope_type", "type", "rope_theta", "partial_rotary_factor", "factor"}
        unknown = sorted(key for key in parameters if key not in known)
        if unknown:
            raise ValueError(f"config rope_type 'proportional' does not take {', '.join(unknown)}")
        partial = parameters.get("partial_rotary_factor", top_level_partial)
        if isinstance(partial, bool) or not isinstance(partial, numbers.Real) or not 0 <= float(partial) <= 1:
            raise ValueError(
                f"config partial_rotary_factor must be in [0, 1] for rope_type 'proportional', got {partial!r}"
            )
        if head_dim % 2:
            raise ValueError(
                f"config head_dim={head_dim}: rope_type 'proportional' rotates the whole head, need it even"
            )
        rotated_pairs = int(float(partial) * head_dim // 2)  # transformers' rope_angles
        factor = parameters.get("factor", 1.0)
        scaling = None if factor == 1 else {"rope_type": "linear", "factor": factor}
        p = rotated_pairs / (head_dim // 2)
        return cls(head_dim, base, False, rotary_dim=head_dim, scaling=scaling, p=p, **options)

    def extra_repr(self) -> str:
        if self.scaling_config is None:
            scaling = ""
        elif isinstance(self.scaling, str):
            scaling = f", scaling={self.scaling!r}, scaling_factor={self.scaling_factor:g}"
        else:
            scaling = f", scaling={self.scaling_config.as_dict()!r}"
        partial = "" if self.p == 1.0 else f", p={self.p:g}"
        return (
            f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, base={self.base:g}, "
            f"interleaved={self.interleaved}{scaling}{partial}"
        )
