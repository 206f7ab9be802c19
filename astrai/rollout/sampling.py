"""Token sampling: temperature, top-k (Fan et al. 2018), nucleus/top-p (Holtzman et al. 2020).

The behaviour log-prob returned with each token is taken from the temperature-scaled distribution BEFORE
top-k/top-p truncation (docs/conventions.md section 2), because that is the distribution the trainer scores. With
RL defaults (top_k = 0, top_p = 1) the two coincide exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


MIN_TEMPERATURE = 1e-4  # below this, logits / temperature overflow float32 for ordinary logit ranges


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings.

    Attributes:
        max_new_tokens: most tokens generated per response (> 0).
        temperature: softmax temperature (> 0); logits are divided by it.
        top_k: keep the k most likely tokens; 0 disables.
        top_p: keep the smallest set of tokens whose probability mass reaches top_p; 1.0 disables.
        stop_token_ids: generation of a row ends after one of these ids is sampled (e.g. EOS).

    Raises:
        ValueError: on values of the wrong type or out of range, naming the field.
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        for name in ("max_new_tokens", "top_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name}: expected an integer, got {value!r}")
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens: expected > 0, got {self.max_new_tokens}")
        if not (isinstance(self.temperature, (int, float)) and MIN_TEMPERATURE <= self.temperature < float("inf")):
            raise ValueError(f"temperature: expected a finite number >= {MIN_TEMPERATURE} (top_k=1 is greedy), "
                             f"got {self.temperature!r}")
        if self.top_k < 0:
            raise ValueError(f"top_k: expected >= 0, got {self.top_k}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p: expected a number in (0, 1], got {self.top_p!r}")
        stops = self.stop_token_ids
        if isinstance(stops, (str, bytes)) or not isinstance(stops, (tuple, list)) or any(
                isinstance(t, bool) or not isinstance(t, int) for t in stops):
            raise ValueError(f"stop_token_ids: expected a tuple of integer token ids, got {stops!r}")
        object.__setattr__(self, "stop_token_ids", tuple(stops))

    @property
    def truncates(self) -> bool:
        """True when top-k or top-p changes the sampled distribution away from the scored one."""
        return self.top_k > 0 or self.top_p < 1.0


def truncation_mask(logits: torch.Tensor, *, top_k: int, top_p: float) -> torch.Tensor:
    """Boolean mask (B, V) of the tokens kept by top-k then top-p over `logits` (B, V).

    The most likely token is always kept.
    """
    keep = torch.ones_like(logits, dtype=torch.bool)
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        keep &= logits >= kth
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits.masked_fill(~keep, float("-inf")), dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        mass_before = probs.cumsum(-1) - probs
        sorted_keep = mass_before < top_p
        sorted_keep[:, 0] = True
        keep &= torch.zeros_like(keep).scatter(-1, order, sorted_keep)
    return keep


def sample_next_token(logits: torch.Tensor, params: SamplingParams,
                      generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row.

    Args:
        logits: (B, V) next-token logits (any float dtype; computed in float32).
        params: sampling settings.
        generator: optional torch RNG on the logits' device.

    Returns:
        tokens (B,) int64 and their behaviour log-probs (B,) float32 under
        `log_softmax(logits / temperature)` (untruncated).
    """
    scaled = logits.float() / params.temperature
    logprobs = torch.log_softmax(scaled, dim=-1)
    if params.truncates:
        keep = truncation_mask(scaled, top_k=params.top_k, top_p=params.top_p)
        probs = torch.softmax(scaled.masked_fill(~keep, float("-inf")), dim=-1)
    else:
        probs = logprobs.exp()
    tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)
