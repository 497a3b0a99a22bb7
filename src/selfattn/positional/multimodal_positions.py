"""The (time, height, width) positions of a sequence of text, image and video tokens, as Qwen2-VL makes them.

Shape legend: b batch, l tokens, n images or videos.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import NamedTuple

import torch

from selfattn._validation import require_positive_int

__all__ = ["MultimodalPositions", "multimodal_positions"]

_TEXT, _IMAGE, _VIDEO = 0, 1, 2
_KIND_NAMES = {_IMAGE: "image", _VIDEO: "video"}


class MultimodalPositions(NamedTuple):
    """What :func:`multimodal_positions` returns.

    Attributes:
        positions: ``(3, b, l)`` int64: time, height and width of every token (0 on padding).
        deltas: ``(b, 1)`` int64: the largest position + 1 minus the number of tokens. A text
            token that follows the ``i``-th token (counting from 0, padding not counted) sits
            at ``i + delta`` on all three axes: the positions of decoding.
    """

    positions: torch.Tensor
    deltas: torch.Tensor


def _grids(name: str, grids: torch.Tensor | Sequence[Sequence[int]] | None, merge: int) -> list[tuple[int, int, int]]:
    """``(t, h / merge, w / merge)`` of each grid, checked."""
    if grids is None:
        return []
    rows = grids.tolist() if isinstance(grids, torch.Tensor) else [list(g) for g in grids]
    checked = []
    for row in rows:
        if len(row) != 3 or any(isinstance(s, bool) or not isinstance(s, numbers.Integral) or s < 1 for s in row):
            raise ValueError(f"{name} must be rows of three positive integers (t, h, w), got {rows!r}")
        t, h, w = (int(s) for s in row)
        if h % merge or w % merge:
            raise ValueError(f"{name} has a grid {(t, h, w)} whose height or width is not a multiple of {merge}")
        checked.append((t, h // merge, w // merge))
    return checked


def _grid_positions(start: int, grid: tuple[int, int, int], time_step: float) -> torch.Tensor:
    """``(3, t h w)`` positions of one grid's tokens in raster order (time, then row, then column)."""
    frames, rows, columns = grid
    time = (torch.arange(frames, dtype=torch.float64) * time_step).long()  # Qwen2.5-VL: seconds, truncated
    grid_time, grid_row, grid_column = torch.meshgrid(time, torch.arange(rows), torch.arange(columns), indexing="ij")
    return torch.stack((grid_time, grid_row, grid_column)).reshape(3, -1) + start


def multimodal_positions(
    input_ids: torch.Tensor,
    *,
    image_token_id: int | None = None,
    video_token_id: int | None = None,
    image_grids: torch.Tensor | Sequence[Sequence[int]] | None = None,
    video_grids: torch.Tensor | Sequence[Sequence[int]] | None = None,
    spatial_merge_size: int = 2,
    attention_mask: torch.Tensor | None = None,
    video_time_steps: torch.Tensor | Sequence[float] | None = None,
) -> MultimodalPositions:
    """The M-RoPE positions of token sequences mixing text, images and videos (Qwen2-VL, Qwen2.5-VL).

    Walking through each sequence's tokens (padding skipped) with a running position ``s``
    (from 0):

    * a text token sits at ``(s, s, s)``, then ``s += 1``;
    * an image or video whose grid is ``(t, h, w)`` patches is ``t (h / m) (w / m)`` tokens in
      raster order (``m = spatial_merge_size``): the token of frame ``f``, row ``r`` and column
      ``c`` sits at ``(s + floor(f * step), s + r, s + c)`` (``step`` is 1 for images), then
      ``s += max(h, w) / m``.

    Consecutive image tokens are cut into images by their grids' token counts (Hugging Face
    takes each run of them as one image). This equals ``get_rope_index`` of Hugging Face
    transformers 5.x's Qwen2-VL and Qwen2.5-VL (checked against 5.24 in
    ``tests/test_mrope.py``). Older versions (4.x) started the text after a video one past
    its *largest* position, temporal included; the two differ when a video's temporal positions
    pass ``s + max(h, w) / m``.

    Args:
        input_ids: ``(b, l)`` token ids.
        image_token_id: the id of the image placeholder token (Qwen2-VL's ``image_token_id``).
        video_token_id: the id of the video placeholder token.
        image_grids: ``(n, 3)`` ``(t, h, w)`` of each image in patches, in the order the
            images come (row by row), as ``image_grid_thw``.
        video_grids: ``(n, 3)`` of each video, as ``video_grid_thw``.
        spatial_merge_size: ``m``, patches merged per side into one token.
        attention_mask: ``(b, l)``, nonzero for tokens and 0 for padding (left or right).
        video_time_steps: ``(n_videos,)`` the temporal step of each video (Qwen2.5-VL:
            ``tokens_per_second * second_per_grid_ts``); default 1 (Qwen2-VL).

    Returns:
        :class:`MultimodalPositions`: ``positions`` ``(3, b, l)`` for
        ``MultiHeadAttention(..., positions=...)`` and ``deltas`` ``(b, 1)``.

    Raises:
        ValueError: a bad shape or grid, or tokens and grids that disagree (more or fewer
            image tokens than the grids describe), named.
    """
    _check_ids(input_ids)
    merge = require_positive_int("spatial_merge_size", spatial_merge_size)
    valid = _valid_tokens(input_ids, attention_mask)
    grids = {_IMAGE: _grids("image_grids", image_grids, merge), _VIDEO: _grids("video_grids", video_grids, merge)}
    kinds = _token_kinds(input_ids.cpu(), grids, image_token_id, video_token_id)
    time_steps = _time_steps(video_time_steps, len(grids[_VIDEO]))
    batch, length = input_ids.shape
    positions = torch.zeros(3, batch, length, dtype=torch.long)
    deltas = torch.zeros(batch, 1, dtype=torch.long)
    used = {_IMAGE: 0, _VIDEO: 0}  # grids consumed so far, across the batch
    for row in range(batch):
        pieces = _row_pieces(kinds[row, valid[row]].tolist(), row, grids, used, time_steps)
        if pieces:
            row_positions = torch.cat(pieces, dim=1)  # (3, valid tokens)
            positions[:, row, valid[row]] = row_positions
            deltas[row, 0] = int(row_positions.max()) + 1 - row_positions.shape[1]
    for kind, name in _KIND_NAMES.items():
        if used[kind] != len(grids[kind]):
            raise ValueError(
                f"{name}_grids describe {len(grids[kind])} {name}s but input_ids hold the tokens of {used[kind]}"
            )
    return MultimodalPositions(positions.to(input_ids.device), deltas.to(input_ids.device))


def _check_ids(input_ids: object) -> None:
    if (
        not isinstance(input_ids, torch.Tensor)
        or input_ids.dim() != 2
        or input_ids.is_floating_point()
        or input_ids.dtype == torch.bool
    ):
        got = f"{input_ids.dtype} {tuple(input_ids.shape)}" if isinstance(input_ids, torch.Tensor) else repr(input_ids)
        raise ValueError(f"input_ids must be integer token ids of shape (batch, length), got {got}")


def _valid_tokens(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """``(b, l)`` bool on the CPU: True for tokens, False for padding."""
    batch, length = input_ids.shape
    if attention_mask is None:
        return torch.ones(batch, length, dtype=torch.bool)
    if isinstance(attention_mask, torch.Tensor) and attention_mask.shape == input_ids.shape:
        return attention_mask.cpu() != 0
    got_mask = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else repr(attention_mask)
    raise ValueError(f"attention_mask must have the shape of input_ids, {(batch, length)}, got {got_mask}")


def _token_kinds(
    ids: torch.Tensor, grids: dict[int, list[tuple[int, int, int]]], image_token_id: int | None,
    video_token_id: int | None,
) -> torch.Tensor:  # fmt: skip
    """``(b, l)``: text, image or video for each token."""
    kinds = torch.zeros_like(ids)
    for kind, token_id in ((_IMAGE, image_token_id), (_VIDEO, video_token_id)):
        name = _KIND_NAMES[kind]
        if token_id is None:
            if grids[kind]:
                raise ValueError(f"{name}_grids are given without {name}_token_id")
            continue
        kinds[ids == token_id] = kind
    if image_token_id is not None and image_token_id == video_token_id:
        raise ValueError(f"image_token_id and video_token_id must differ, both are {image_token_id}")
    return kinds


def _time_steps(video_time_steps: torch.Tensor | Sequence[float] | None, videos: int) -> list[float]:
    if video_time_steps is None:
        return [1.0] * videos
    given = video_time_steps.tolist() if isinstance(video_time_steps, torch.Tensor) else video_time_steps
    time_steps = [float(step) for step in given]
    if len(time_steps) != videos or not all(math.isfinite(step) and step >= 0 for step in time_steps):
        raise ValueError(f"video_time_steps must be one finite step >= 0 per video ({videos}), got {time_steps!r}")
    return time_steps


def _row_pieces(
    row_kinds: list[int], row: int, grids: dict[int, list[tuple[int, int, int]]], used: dict[int, int],
    time_steps: list[float],
) -> list[torch.Tensor]:  # fmt: skip
    """One sequence's positions, ``(3, tokens)`` per run of text or per grid, walking with a running start."""
    pieces: list[torch.Tensor] = []
    start, i = 0, 0
    while i < len(row_kinds):
        kind = row_kinds[i]
        if kind == _TEXT:
            end = i
            while end < len(row_kinds) and row_kinds[end] == _TEXT:
                end += 1
            pieces.append(torch.arange(start, start + end - i).expand(3, -1))
            start, i = start + end - i, end
            continue
        name, index = _KIND_NAMES[kind], used[kind]
        if index == len(grids[kind]):
            raise ValueError(f"input_ids hold more {name} tokens than {name}_grids describe ({len(grids[kind])})")
        grid = grids[kind][index]
        count = grid[0] * grid[1] * grid[2]
        if row_kinds[i : i + count] != [kind] * count:
            raise ValueError(
                f"{name} {index} with grid {grid} (merged) needs {count} consecutive {name} tokens; "
                f"row {row} has fewer at token {i} (padding not counted)"
            )
        pieces.append(_grid_positions(start, grid, time_steps[index] if kind == _VIDEO else 1.0))
        start, i = start + max(grid[1], grid[2]), i + count
        used[kind] += 1
    return pieces
