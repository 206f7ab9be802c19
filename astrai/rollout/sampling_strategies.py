"""Per-request sampling for the paged engine: temperature, top-k, top-p and a frequency penalty, composed per row.

Order per row: scaled = logits / temperature; the behaviour log-prob is `log_softmax(scaled)[token]`, taken BEFORE
penalties and truncation (DESIGN.md section 2: it is what the trainer scores). The sampling distribution then
subtracts the frequency penalty (OpenAI-style `frequency_penalty`: penalty x count of each token among the
request's last `window` generated tokens), applies top-k (Fan et al. 2018) and top-p (Holtzman et al. 2020), and
draws with the request's own `torch.Generator`, so a row's samples do not depend on which other rows share its
batch. `top_k == 1` is greedy (argmax; the row still draws, and ignores, its one uniform per step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from astrai.rollout.sampling import SamplingParams, truncation_mask

__all__ = ["FrequencyPenaltyStrategy", "RowSampling", "sample_rows", "request_seed"]

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class FrequencyPenaltyStrategy:
    """Subtract `penalty * count(token)` from the (temperature-scaled) logits, counting the request's last
    `window` generated tokens (0 = all of them).

    Raises:
        ValueError: for a negative window.
    """

    penalty: float
    window: int = 0

    def __post_init__(self):
        if self.window < 0:
            raise ValueError(f"FrequencyPenaltyStrategy.window: expected >= 0, got {self.window}")

    def apply(self, scaled: torch.Tensor, generated: Sequence[int]) -> torch.Tensor:
        """scaled (V,) float32 -> penalised copy (V,); `generated`: the request's sampled token ids so far."""
        recent = generated[-self.window:] if self.window else generated
        if not recent or self.penalty == 0:
            return scaled
        ids = torch.tensor(list(recent), dtype=torch.long, device=scaled.device)
        counts = torch.bincount(ids, minlength=scaled.shape[0]).to(scaled.dtype)
        return scaled - self.penalty * counts


@dataclass
class RowSampling:
    """Sampling state of one request: settings, optional penalty, own RNG, tokens generated so far."""

    params: SamplingParams
    penalty: Optional[FrequencyPenaltyStrategy]
    generator: torch.Generator
    generated: list[int]


def request_seed(base_seed: int, index: int) -> int:
    """Seed of request `index` from a call's base seed (a splitmix64 step; result in [0, 2**63))."""
    x = (base_seed + (index + 1) * 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) & ((1 << 63) - 1)


def _distribution(scaled: torch.Tensor, row: RowSampling) -> torch.Tensor | int:
    """The row's sampling probabilities (V,) float32 after penalty and truncation, or a greedy token id."""
    p = row.params
    if row.penalty is not None:
        scaled = row.penalty.apply(scaled, row.generated)
    if p.top_k == 1:
        return int(scaled.argmax())
    if p.truncates:
        keep = truncation_mask(scaled[None], top_k=p.top_k, top_p=p.top_p)[0]
        scaled = scaled.masked_fill(~keep, float("-inf"))
    return torch.softmax(scaled, dim=-1)


def sample_rows(logits: torch.Tensor, rows: Sequence[RowSampling]) -> tuple[list[int], list[float]]:
    """Sample one token for each row of `logits` (R, V) with the matching `rows[i]`.

    Each non-greedy row draws ONE uniform u from its own generator and takes the inverse CDF of its distribution
    (first token whose cumulative probability exceeds u), batched over rows; rows without penalty or
    truncation use `exp(log_softmax(logits / temperature))` directly.

    Returns:
        token ids (R Python ints) and their behaviour log-probs (R floats, float32 precision) under
        `log_softmax(logits / temperature)` (no penalty, no truncation).
    """
    if not rows:
        return [], []
    temps = torch.tensor([r.params.temperature for r in rows], dtype=torch.float32, device=logits.device)
    scaled = logits.float() / temps[:, None]
    logprobs = torch.log_softmax(scaled, dim=-1)
    probs = logprobs.exp()
    greedy: dict[int, int] = {}
    for i, row in enumerate(rows):
        if row.penalty is not None or row.params.truncates:
            dist = _distribution(scaled[i], row)
            if isinstance(dist, int):
                greedy[i] = dist
            else:
                probs[i] = dist
    uniforms = torch.stack([torch.rand((), generator=row.generator, device=logits.device) for row in rows])
    cdf = probs.double().cumsum(-1)
    target = (uniforms.double() * cdf[:, -1])[:, None]
    drawn = torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_(max=logits.shape[-1] - 1)
    tokens = [greedy.get(i, t) for i, t in enumerate(drawn.tolist())]
    index = torch.tensor(tokens, dtype=torch.long, device=logits.device)
    chosen = logprobs.gather(-1, index[:, None]).squeeze(-1).tolist()
    return tokens, chosen
