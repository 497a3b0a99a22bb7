"""A rotary whose frequencies are multiplied by fixed per-pair factors (Mistral Large 4's learned ``alpha``).

Shape legend: r rotated features, r / 2 pairs.
"""

from __future__ import annotations

from typing import Any

import torch

from selfattn.positional.rotary import RotaryPositionalEncoding

__all__ = ["ScaledFrequencyRotary"]


class ScaledFrequencyRotary(RotaryPositionalEncoding):
    """:class:`~selfattn.RotaryPositionalEncoding` with each pair's frequency multiplied by a fixed factor.

    Mistral Large 4 learns ``alpha`` per pair and rotates at ``inv_freq * exp(alpha)``; a trained
    model's factors are constants, kept here as a float64 buffer (not a parameter: they are read
    from the model's rotary module, which owns them in transformers).

    Args:
        head_dim: rotated features ``r`` (every feature rotates).
        base: ``rope_theta``.
        interleaved: pairs ``(2j, 2j + 1)`` if True, ``(j, j + r / 2)`` if False.
        multipliers: ``(r / 2,)`` factors of the frequencies (``exp(alpha)``).
        **options: the other options of :class:`~selfattn.RotaryPositionalEncoding` (``scaling`` ...).

    Raises:
        ValueError: ``multipliers`` of another shape, or not finite and positive.
    """

    frequency_multipliers: torch.Tensor

    def __init__(self, head_dim: int, base: float, interleaved: bool, *, multipliers: torch.Tensor, **options: Any):
        factors = torch.as_tensor(multipliers).detach().to(torch.float64).cpu()
        if factors.shape != (head_dim // 2,) or not bool(torch.isfinite(factors).all() and (factors > 0).all()):
            raise ValueError(
                f"multipliers must be ({head_dim // 2},) finite positive factors, got {tuple(factors.shape)} {factors}"
            )
        self._pending_multipliers = factors
        super().__init__(head_dim, base, interleaved, **options)
        self.register_buffer("frequency_multipliers", factors.to(self.inv_freq.device), persistent=False)
        self._build_tables()

    def frequencies_at(self, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
        frequencies, attention_factor = super().frequencies_at(seq_len)
        factors = getattr(self, "frequency_multipliers", self._pending_multipliers)
        return frequencies * factors.to(frequencies.device), attention_factor
