"""Loss aggregation modes: how a per-token loss (B, T) becomes the scalar of an optimizer step.

Method: the four modes of verl (`verl/trainer/ppo/core_algos.py`, ``agg_loss``), under their names, divided by the
GLOBAL number of loss units of the optimizer step (all micro-batches and data-parallel ranks: docs/conventions.md
section 2, "Loss aggregation"), so that re-splitting the same data leaves the loss and its gradient unchanged. With
``l`` the per-token loss, ``m`` the action mask, ``n_i = sum_t m[i, t]`` and ``U`` the step's units:

- ``token-mean``               ``sum_{i,t} m l / U``, U = real tokens (PPO/DAPO; Yu et al. 2025, DAPO, section 3.3).
- ``seq-mean-token-mean``      ``sum_i (sum_t m l / n_i) / U``, U = sequences with >= 1 real token (GRPO's
                               original per-response mean, Shao et al. 2024; GSPO, Zheng et al. 2025).
- ``seq-mean-token-sum``       ``sum_i sum_t m l / U``, U = sequences.
- ``seq-mean-token-sum-norm``  ``sum_i sum_t m l / (U * L)``, U = sequences and ``L = loss_scale_factor`` a
                               constant (the maximum response length: Dr. GRPO, Liu et al. 2025, "Understanding
                               R1-Zero-Like Training", section 3.1; TRL's ``dr_grpo`` divides by batch size times
                               ``max_completion_length``). verl defaults L to the padded width T of the batch; astrai
                               requires it, because micro-batches are trimmed to their own width and a per-batch T
                               would make the shares of a step disagree with the whole-batch loss.

Sequences without a real token are no unit (they contribute 0 and are not counted), as in verl. What it
simplifies: one count per micro-batch (`loss_units`) is all the trainer sums over micro-batches and ranks.
"""

from __future__ import annotations

import torch

from .masked import _denominator, _real
from .registry import LOSS_AGG_MODES  # the `loss_agg_mode` choices (verl's names; the first is astrai's default)

__all__ = ["LOSS_AGG_MODES", "aggregate_loss", "loss_units", "metric_agg_mode"]


def _check_mode(loss_agg_mode: str) -> None:
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode must be one of {', '.join(LOSS_AGG_MODES)}, got {loss_agg_mode!r}")


def loss_units(action_mask: torch.Tensor, loss_agg_mode: str) -> torch.Tensor:
    """What one micro-batch contributes to the step's unit count under ``loss_agg_mode`` (module docstring).

    Shapes: ``action_mask`` (B, T) bool or 0/1. Returns a 0-dim int64 tensor on the mask's device: the number of
    real tokens for ``token-mean``, else the number of rows with at least one real token. Sum it over the
    micro-batches and ranks of a step and pass the total as ``num_units``.
    Raises: ValueError for an unknown mode or a mask that is not 2-D.
    """
    _check_mode(loss_agg_mode)
    if action_mask.dim() != 2:
        raise ValueError(f"action_mask must be (B, T), got shape {tuple(action_mask.shape)}")
    mask = action_mask.bool()
    if loss_agg_mode == "token-mean":
        return mask.sum()
    return mask.any(dim=1).sum()


def metric_agg_mode(loss_agg_mode: str) -> str:
    """The mode the policy losses aggregate their per-token METRICS with, so that metrics are shares over the same
    ``num_units`` as the loss: ``token-mean`` for ``token-mean``, else ``seq-mean-token-mean`` (a mean over
    sequences of each sequence's token mean: still a fraction for ``policy/clipfrac``).
    Raises: ValueError for an unknown mode."""
    _check_mode(loss_agg_mode)
    return "token-mean" if loss_agg_mode == "token-mean" else "seq-mean-token-mean"


def aggregate_loss(
    per_token: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    num_units: int | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Aggregate a per-token loss into a 0-dim loss (or this micro-batch's additive share of the step's loss).

    Shapes: ``per_token`` (B, T) floating (may carry grad); ``action_mask`` (B, T) bool or 0/1. Returns 0-dim,
    dtype of ``per_token``. Formulas: module docstring; ``U = num_units`` when given (the step's global count from
    `loss_units`, so the micro-batch results sum to the step's value), else this batch's own count (clamped >= 1,
    so an empty batch gives 0). ``loss_scale_factor``: L of ``seq-mean-token-sum-norm`` (required there, ignored
    by the other modes). Values at masked positions (even NaN) influence neither the result nor its gradient.
    Raises: ValueError for an unknown mode, a shape mismatch, an int ``num_units < 1``, or a missing or
    non-positive ``loss_scale_factor`` under ``seq-mean-token-sum-norm``.
    """
    _check_mode(loss_agg_mode)
    if action_mask.dim() != 2:
        raise ValueError(f"action_mask must be (B, T), got shape {tuple(action_mask.shape)}")
    norm = loss_agg_mode == "seq-mean-token-sum-norm"
    if norm and (loss_scale_factor is None or not loss_scale_factor > 0):
        raise ValueError("loss_agg_mode 'seq-mean-token-sum-norm' needs loss_scale_factor > 0 (a constant such as "
                         f"the maximum response length), got {loss_scale_factor!r}")
    mask = action_mask.bool()
    x = _real(per_token, mask)
    if loss_agg_mode == "token-mean":
        return x.sum() / _denominator(mask.sum(), num_units, x.dtype, "num_units")
    row_sum = x.sum(dim=1)
    if loss_agg_mode == "seq-mean-token-mean":
        row_sum = row_sum / mask.sum(dim=1).clamp(min=1).to(x.dtype)
    total = row_sum.sum() / _denominator(mask.any(dim=1).sum(), num_units, x.dtype, "num_units")
    return total / loss_scale_factor if norm else total
