"""The note's worry: adding P changes every token embedding. How much of the token survives?

For a vocabulary of random token embeddings E ``(V, d)`` and the table P, each sum
``E[t] + P[i]`` is decoded back to the nearest embedding (Euclidean distance); the share of
sums decoded to their own token is the measure. Two scales of embedding are tried:
``nn.Embedding``'s default N(0, 1) entries (norm about sqrt(d), larger than P's sqrt(d/2)), and
unit-norm embeddings, which P outweighs.

Shape legend: V vocabulary, n positions, d model size.
"""

from __future__ import annotations

import torch

from selfattn._validation import require_positive_int
from selfattn.functional import sinusoidal_table
from selfattn.tour._common import seeded

__all__ = ["embedding_survival"]


def _recovery(embeddings: torch.Tensor, table: torch.Tensor) -> tuple[float, float]:
    """Share of ``E[t] + P[i]`` nearest to ``E[t]``, and the mean cosine between them."""
    sums = embeddings[:, None, :] + table[None, :, :]  # (V, n, d)
    flat = sums.reshape(-1, sums.shape[-1])  # (V n, d)
    nearest = torch.cdist(flat, embeddings).argmin(dim=-1).reshape(sums.shape[:2])  # (V, n)
    tokens = torch.arange(embeddings.shape[0])[:, None]
    cosine = torch.nn.functional.cosine_similarity(sums, embeddings[:, None, :].expand_as(sums), dim=-1)
    return float((nearest == tokens).double().mean()), float(cosine.mean())


def embedding_survival(
    sizes: tuple[int, ...] = (8, 16, 32, 64, 128, 256),
    vocabulary: int = 512,
    num_positions: int = 32,
    seed: int = 0,
    scale: float = 1.0,
) -> dict[str, object]:
    """Nearest-token recovery after adding P, for each model size d in ``sizes``.

    ``scale`` is the standard deviation of the drawn embeddings (1: ``nn.Embedding``'s default).
    """
    vocabulary = require_positive_int("vocabulary", vocabulary)
    num_positions = require_positive_int("num_positions", num_positions)
    rows: dict[str, list[float]] = {"recovered": [], "cosine": [], "recovered_unit": [], "cosine_unit": []}
    with seeded(seed):
        for d in sizes:
            d = require_positive_int("sizes", d)
            embeddings = scale * torch.randn(vocabulary, d, dtype=torch.float64)  # nn.Embedding's N(0, 1) at scale 1
            table = sinusoidal_table(num_positions, d, dtype=torch.float64)  # (n, d)
            recovered, cosine = _recovery(embeddings, table)
            unit = embeddings / embeddings.norm(dim=-1, keepdim=True)
            recovered_unit, cosine_unit = _recovery(unit, table)
            rows["recovered"].append(recovered)
            rows["cosine"].append(cosine)
            rows["recovered_unit"].append(recovered_unit)
            rows["cosine_unit"].append(cosine_unit)
    return {"sizes": list(sizes), "vocabulary": vocabulary, "num_positions": num_positions, "scale": scale, **rows}
