"""Training-inference mismatch: measure it, and correct the policy loss for it (rollout correction).

Method: the rollout engine samples token a_t with log-prob ``rollout_logprobs`` (the engine's ``old_logprobs``);
the trainer, with the same weights, scores it as ``train_old_logprobs`` (its own forward before the first update).
Kernels and dtypes differ, so the two policies differ and the data is slightly off-policy (Yao et al. 2025, "Your
Efficient RL Framework Secretly Brings You Off-Policy RL Training"). With ``d_t = train_old_logprobs_t -
rollout_logprobs_t`` on real tokens, ``rho_t = exp(d_t) = pi_train_old(a_t) / pi_rollout(a_t)`` and
``S_i = sum_t d_t`` (``exp(S_i)`` = the sequence's product of rho), the corrections are (docs/conventions.md section
7, "Training-inference mismatch"):

- ``token_tis``  ``w_t = min(rho_t, token_cap)``, every token kept: truncated importance sampling (Yao et al.
                 2025, default C = 2; verl ``rollout_is: token``; TRL ``token_truncate``).
- ``seq_tis``    ``w_t = min(exp(S_i), seq_cap)`` for every token of row i, every token kept (verl
                 ``rollout_is: sequence``; TRL ``sequence_truncate``).
- ``seq_mask``   row i is dropped when ``exp(S_i) > seq_cap``; kept rows are weighted by ``exp(S_i)`` (masked
                 importance sampling): TRL 1.16's ``sequence_mask`` (its default mode, ``C_max = 3``): the product of
                 the ratios (the plain sum of log-ratios, NOT the geometric mean) and one-sided (TRL's optional
                 ``C_min`` is off by default and not offered here).
- ``icepop``     token t is dropped unless ``icepop_low <= rho_t <= icepop_high``; kept tokens are weighted by
                 ``rho_t`` (IcePop, Ling Team 2025, Ring-1T report; verl's ``rollout_is_threshold: "0.5_5.0"``,
                 which zeroes the weights outside the band and leaves the response mask alone).

Weights are detached, float, 0 at padding and at dropped tokens; ``keep`` (bool) is False there. The policy losses
take ``weights=`` and multiply it into the per-token loss, so a dropped token adds nothing to the loss while it
stays in the denominator (TRL's and verl-IcePop's behaviour); to drop it from the denominator too (verl's
rejection sampling), also pass ``action_mask & keep`` as the loss's mask and count units from it. Exponentials are
taken of ``min(d, log C)`` so no weight overflows. What it simplifies: one correction at a time (verl composes an
IS weight with a separate rejection rule); no batch normalisation of the weights.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from .kl import kl_k3
from . import registry
from .masked import _real, masked_mean

__all__ = ["MAX_METRICS", "ROLLOUT_CORRECTIONS", "correction_weights", "mismatch_metrics"]

MAX_METRICS = frozenset({"rollout/mismatch_max_abs_diff", "rollout/staleness_max"})
"""Metrics that are maxima, not additive shares: combine them over micro-batches and ranks with MAX."""


def _check(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor, names: tuple[str, str]) -> torch.Tensor:
    if mask.dim() != 2 or a.shape != mask.shape or b.shape != mask.shape:
        raise ValueError(f"{names[0]}, {names[1]} and action_mask must be the same (B, T) shape, got "
                         f"{tuple(a.shape)}, {tuple(b.shape)} and {tuple(mask.shape)}")
    return mask.bool()


@torch.no_grad()
def mismatch_metrics(logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, action_mask: torch.Tensor, *,
                     num_tokens: int | torch.Tensor | None = None, ratio_low: float = 0.5,
                     ratio_high: float = 2.0) -> dict[str, torch.Tensor]:
    """Detached 0-dim metrics of the mismatch between the trainer's and the engine's log-probs of the same tokens.

    Shapes: ``logprobs`` (B, T) the trainer's log-probs (before any update); ``rollout_logprobs`` (B, T) the
    engine's; ``action_mask`` (B, T). With ``d_t = logprobs_t - rollout_logprobs_t`` over real tokens:
    - ``rollout/mismatch_k3_kl``: token mean of ``exp(d) - 1 - d``, the k3 estimate (Schulman 2020) of
      KL(pi_rollout || pi_train) from the engine's samples (>= 0);
    - ``rollout/mismatch_max_abs_diff``: ``max |d|`` (0 without real tokens). A MAX, not a share: combine over
      micro-batches and ranks with max (`MAX_METRICS`); ``num_tokens`` does not change it;
    - ``rollout/mismatch_outside_frac``: share of real tokens with ``exp(d)`` outside ``[ratio_low, ratio_high]``.
    Token means divide by ``num_tokens`` when given (a share of a larger mean, as the losses), else by this
    batch's real tokens. Raises: ValueError on shape mismatches or an int ``num_tokens < 1``.
    """
    mask = _check(logprobs, rollout_logprobs, action_mask, ("logprobs", "rollout_logprobs"))
    train = _real(logprobs, mask)
    rollout = _real(rollout_logprobs.to(train.dtype), mask)
    d = train - rollout
    outside = (d < math.log(ratio_low)) | (d > math.log(ratio_high))
    return {
        "rollout/mismatch_k3_kl": masked_mean(kl_k3(rollout, train), mask, num_tokens=num_tokens),
        "rollout/mismatch_max_abs_diff": d.abs().amax() if d.numel() else d.new_zeros(()),
        "rollout/mismatch_outside_frac": masked_mean(outside.to(train.dtype), mask, num_tokens=num_tokens),
    }


CorrectionFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
"""``fn(d, mask, *, token_cap, seq_cap, icepop_low, icepop_high) -> (weights, keep)``: ``d`` (B, T) the log-ratios,
0 at padding; ``mask`` (B, T) bool; weights (B, T) before masking, keep (B, T) bool before masking."""


def _token_tis(d, mask, *, token_cap, seq_cap, icepop_low, icepop_high):
    return torch.exp(d.clamp(max=math.log(token_cap))), mask


def _seq_tis(d, mask, *, token_cap, seq_cap, icepop_low, icepop_high):
    seq = d.sum(dim=1, keepdim=True).clamp(max=math.log(seq_cap))
    return torch.exp(seq).expand(d.shape), mask


def _seq_mask(d, mask, *, token_cap, seq_cap, icepop_low, icepop_high):
    seq = d.sum(dim=1, keepdim=True)
    kept = seq <= math.log(seq_cap)
    weight = torch.exp(torch.where(kept, seq, torch.zeros_like(seq)))
    return weight.expand(d.shape), kept.expand(d.shape)


def _icepop(d, mask, *, token_cap, seq_cap, icepop_low, icepop_high):
    kept = (d >= math.log(icepop_low)) & (d <= math.log(icepop_high))
    return torch.exp(torch.where(kept, d, torch.zeros_like(d))), kept


ROLLOUT_CORRECTIONS: dict[str, CorrectionFn] = {
    "token_tis": _token_tis,
    "seq_tis": _seq_tis,
    "seq_mask": _seq_mask,
    "icepop": _icepop,
}
"""Rollout corrections by name (definitions: module docstring); `correction_weights` is the entry point."""
if tuple(ROLLOUT_CORRECTIONS) != registry.ROLLOUT_CORRECTIONS:
    raise ImportError(f"astrai.algos.rollout_correction: {tuple(ROLLOUT_CORRECTIONS)} != registry "
                      f"{registry.ROLLOUT_CORRECTIONS}")


@torch.no_grad()
def correction_weights(mode: str, train_old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                       action_mask: torch.Tensor, *, token_cap: float = 2.0, seq_cap: float = 3.0,
                       icepop_low: float = 0.5, icepop_high: float = 5.0,
                       num_tokens: int | torch.Tensor | None = None,
                       ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token importance weights and keep mask of rollout correction ``mode`` (module docstring).

    Shapes: ``train_old_logprobs`` (B, T) the trainer's log-probs of the rollout's tokens before the first update;
    ``rollout_logprobs`` (B, T) the engine's; ``action_mask`` (B, T). Returns ``(weights, keep, metrics)``:
    ``weights`` (B, T) detached, dtype of ``train_old_logprobs``, 0 at padding and at dropped tokens; ``keep``
    (B, T) bool, False there; metrics (detached 0-dim, token means over ``num_tokens`` when given, else this
    batch's real tokens): ``rollout/correction_weight_mean`` (mean weight, dropped tokens as 0),
    ``rollout/correction_kept_frac`` (share of real tokens kept), ``rollout/correction_capped_frac`` (share of
    real tokens whose weight the cap truncated: token_tis / seq_tis; 0 for the masking modes).
    Defaults are the peers': token cap 2 (Yao et al. 2025), sequence cap 3 (TRL), IcePop band [0.5, 5].
    Raises: ValueError for an unknown mode, caps <= 0, ``icepop_low > icepop_high`` or shape mismatches.
    """
    if mode not in ROLLOUT_CORRECTIONS:
        raise ValueError(f"unknown rollout correction {mode!r}; choices: {', '.join(ROLLOUT_CORRECTIONS)}")
    if not (token_cap > 0 and seq_cap > 0 and 0 < icepop_low <= icepop_high):
        raise ValueError(f"rollout correction needs token_cap > 0, seq_cap > 0 and 0 < icepop_low <= icepop_high, "
                         f"got {token_cap!r}, {seq_cap!r}, [{icepop_low!r}, {icepop_high!r}]")
    mask = _check(train_old_logprobs, rollout_logprobs, action_mask, ("train_old_logprobs", "rollout_logprobs"))
    train = _real(train_old_logprobs, mask)
    d = train - _real(rollout_logprobs.to(train.dtype), mask)
    raw, kept = ROLLOUT_CORRECTIONS[mode](d, mask, token_cap=token_cap, seq_cap=seq_cap, icepop_low=icepop_low,
                                          icepop_high=icepop_high)
    keep = kept & mask
    weights = _real(raw, keep)
    if mode == "token_tis":
        capped = d > math.log(token_cap)
    elif mode == "seq_tis":
        capped = (d.sum(dim=1, keepdim=True) > math.log(seq_cap)).expand(d.shape)
    else:
        capped = torch.zeros_like(mask)
    metrics = {
        "rollout/correction_weight_mean": masked_mean(weights, mask, num_tokens=num_tokens),
        "rollout/correction_kept_frac": masked_mean(keep.to(train.dtype), mask, num_tokens=num_tokens),
        "rollout/correction_capped_frac": masked_mean(capped.to(train.dtype), mask, num_tokens=num_tokens),
    }
    return weights, keep, metrics
