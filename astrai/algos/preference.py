"""Supervised and preference losses: token cross-entropy (SFT, pre-training), DPO and the reward model's
Bradley-Terry loss.

Methods: next-token cross-entropy over labelled tokens (masked SFT; pre-training); Direct Preference
Optimization, R. Rafailov, A. Sharma, E. Mitchell, S. Ermon, C. Manning, C. Finn, "Direct Preference
Optimization: Your Language Model is Secretly a Reward Model" (NeurIPS 2023), with the label-smoothed
("conservative DPO", Mitchell 2023) variant; the pairwise reward-model loss of InstructGPT (Ouyang et al. 2022,
section 3.5: Bradley-Terry, -log sigmoid(r_chosen - r_rejected)), with Llama 2's optional margin (Touvron et al.
2023, section 3.2.2). What it simplifies: sequence log-probs are sums of per-token
log-probs computed elsewhere (`logprobs_from_logits`); the reference is a frozen model whose log-probs arrive
as tensors. Denominators can be global counts (tokens or pairs of the whole optimizer step), so micro-batch
shares add up to the step's value (docs/conventions.md section 2, "Loss aggregation").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .masked import masked_mean

__all__ = ["bradley_terry_loss", "token_cross_entropy", "dpo_loss"]


def token_cross_entropy(
    logprobs: torch.Tensor, loss_mask: torch.Tensor, *, num_tokens: int | torch.Tensor | None = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Masked next-token cross-entropy from label log-probs.

    Shapes: ``logprobs`` (B, S') float, log p(label) per position (``logprobs_from_logits(logits[:, :-1],
    labels[:, 1:])``); ``loss_mask`` (B, S') bool, False at ignored labels (-100) and padding.
    Formula: ``loss = masked_mean(-logprobs, loss_mask, num_tokens=num_tokens)``.
    Metric: ``train/loss`` (detached loss share).
    Raises: ValueError on shape mismatches or an int ``num_tokens < 1``.
    """
    loss = masked_mean(-logprobs, loss_mask.bool(), num_tokens=num_tokens)
    return loss, {"train/loss": loss.detach()}


def dpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    beta: float,
    label_smoothing: float = 0.0,
    num_pairs: int | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPO loss over preference pairs (Rafailov et al. 2023).

    Shapes: each input (B,) float, the summed response log-probs of the chosen / rejected response under the
    policy (with grad) and the frozen reference. Formula: ``z = beta * ((pc - rc) - (pr - rr))``,
    ``l = -(1 - ls) * logsigmoid(z) - ls * logsigmoid(-z)``, ``loss = sum(l) / N`` with ``N = num_pairs`` if
    given (global pair count of the step) else B.
    Metrics (same denominator): ``dpo/reward_chosen`` = mean beta*(pc - rc), ``dpo/reward_rejected``,
    ``dpo/margin`` = mean z, ``dpo/accuracy`` = share of pairs with z > 0.
    Raises: ValueError if ``beta <= 0``, ``label_smoothing`` not in [0, 0.5), or shapes differ / are not 1-D.
    """
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta!r}")
    if not 0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing!r}")
    shape = chosen_logps.shape
    if len(shape) != 1 or any(t.shape != shape for t in (rejected_logps, ref_chosen_logps, ref_rejected_logps)):
        raise ValueError("dpo_loss: expected four 1-D tensors of the same shape (B,)")
    denom = torch.as_tensor(shape[0] if num_pairs is None else num_pairs, dtype=chosen_logps.dtype,
                            device=chosen_logps.device).clamp(min=1)
    chosen_reward = beta * (chosen_logps - ref_chosen_logps.to(chosen_logps.dtype))
    rejected_reward = beta * (rejected_logps - ref_rejected_logps.to(chosen_logps.dtype))
    z = chosen_reward - rejected_reward
    per_pair = -(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)
    loss = per_pair.sum() / denom
    with torch.no_grad():
        metrics = {
            "dpo/reward_chosen": chosen_reward.detach().sum() / denom,
            "dpo/reward_rejected": rejected_reward.detach().sum() / denom,
            "dpo/margin": z.detach().sum() / denom,
            "dpo/accuracy": (z.detach() > 0).to(z.dtype).sum() / denom,
        }
    return loss, metrics


def bradley_terry_loss(
    chosen_rewards: torch.Tensor,
    rejected_rewards: torch.Tensor,
    *,
    margin: torch.Tensor | None = None,
    num_pairs: int | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Pairwise reward-model loss (Bradley-Terry; Ouyang et al. 2022, section 3.5; margin: Touvron et al. 2023).

    Shapes: ``chosen_rewards``, ``rejected_rewards`` (B,) float (with grad); ``margin`` (B,) or None (0).
    Formula: ``d = r_c - r_r``, ``l = -logsigmoid(d - margin)``, ``loss = sum(l) / N`` with ``N = num_pairs`` if
    given (the step's global pair count, so micro-batch shares add up) else B.
    Metrics (same denominator): ``rm/accuracy`` share of pairs with ``d > 0``, ``rm/margin`` mean ``d``,
    ``rm/chosen_reward`` and ``rm/rejected_reward`` means.
    Raises: ValueError if the shapes differ or are not 1-D.
    """
    shape = chosen_rewards.shape
    if len(shape) != 1 or rejected_rewards.shape != shape or (margin is not None and margin.shape != shape):
        raise ValueError("bradley_terry_loss: expected 1-D chosen, rejected (and margin) tensors of the same shape")
    denom = torch.as_tensor(shape[0] if num_pairs is None else num_pairs, dtype=chosen_rewards.dtype,
                            device=chosen_rewards.device).clamp(min=1)
    d = chosen_rewards - rejected_rewards.to(chosen_rewards.dtype)
    shifted = d if margin is None else d - margin.to(d.dtype)
    loss = -F.logsigmoid(shifted).sum() / denom
    with torch.no_grad():
        metrics = {"rm/accuracy": (d > 0).to(d.dtype).sum() / denom, "rm/margin": d.sum() / denom,
                   "rm/chosen_reward": chosen_rewards.detach().sum() / denom,
                   "rm/rejected_reward": rejected_rewards.detach().sum() / denom}
    return loss, metrics
