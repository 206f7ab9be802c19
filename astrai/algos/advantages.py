"""Advantage estimation: PPO token rewards + GAE, and GRPO group-normalised advantages.

Methods:
- Generalised Advantage Estimation, J. Schulman, P. Moritz, S. Levine, M. Jordan, P. Abbeel, "High-Dimensional
  Continuous Control Using Generalized Advantage Estimation" (ICLR 2016), applied per response token as in RLHF
  PPO (Ziegler et al. 2019; Ouyang et al. 2022): a per-token KL penalty plus the scalar score on the last token.
- Group-relative advantages, Z. Shao et al., "DeepSeekMath" (2024), GRPO: the critic is replaced by the mean and
  standard deviation of the scores of the G samples drawn for the same prompt.

What it simplifies: one episode is one response (its action tokens, with any tool or environment tokens between
turns skipped); there is no bootstrapping beyond the response (the terminal value is 0), and GRPO needs no value
model at all. Exact definitions: docs/conventions.md section 2. Everything here computes
fixed targets once per rollout, so GAE runs under ``torch.no_grad``.
"""

from __future__ import annotations

import torch

from .masked import global_moments
from .registry import SCALE_REWARDS  # `group_advantages` scale modes (`grpo.scale_rewards`)

__all__ = ["ppo_token_rewards", "gae", "group_advantages", "last_token_index", "SCALE_REWARDS"]


def _check_same(name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor) -> None:
    if a.shape != b.shape:
        raise ValueError(f"{name_a} and {name_b} must have the same shape, got {tuple(a.shape)} and {tuple(b.shape)}")


def last_token_index(action_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last real token of each row.

    Shapes: ``action_mask`` (B, T) bool or 0/1. Returns (B,) int64: ``max {t : action_mask[b, t]}``
    (works for any mask, contiguous or not). Rows without a real token give 0; callers that need a real token
    must check (``ppo_token_rewards`` raises).
    Raises: ValueError if ``action_mask`` is not 2-D.
    """
    if action_mask.dim() != 2:
        raise ValueError(f"action_mask must be (B, T), got shape {tuple(action_mask.shape)}")
    steps = torch.arange(1, action_mask.shape[1] + 1, device=action_mask.device)
    return (action_mask.bool().long() * steps).argmax(dim=1)


def ppo_token_rewards(
    scores: torch.Tensor, kl: torch.Tensor, action_mask: torch.Tensor, *, kl_coef: float
) -> torch.Tensor:
    """Per-token PPO rewards: KL penalty on every real token, the score on the last real token.

    Shapes: ``scores`` (B,) floating (one scalar reward per response); ``kl`` (B, T) floating per-token KL estimate
    (e.g. k3 of ``ref_logprobs`` vs ``old_logprobs``); ``action_mask`` (B, T) bool or 0/1.
    Returns ``rewards`` (B, T), dtype of ``kl``.
    Formula: ``rewards[b, t] = -kl_coef * kl[b, t] * mask[b, t]`` plus ``scores[b]`` at
    ``t = last_token_index(mask)[b]`` (the EOS token if sampled, else the last generated token), never on padding.
    Values of ``kl`` at masked positions (even NaN) are ignored; masked rewards are exactly 0.
    Source: Ziegler et al. 2019 / Ouyang et al. 2022 reward shaping; docs/conventions.md section 2.
    Raises: ValueError on shape mismatches or if a row has no real token (checking this synchronises once).
    """
    if scores.dim() != 1 or kl.dim() != 2 or scores.shape[0] != kl.shape[0]:
        raise ValueError(f"expected scores (B,) and kl (B, T), got {tuple(scores.shape)} and {tuple(kl.shape)}")
    _check_same("kl", kl, "action_mask", action_mask)
    mask = action_mask.bool()
    if not bool(mask.any(dim=1).all()):
        empty = (~mask.any(dim=1)).nonzero().flatten().tolist()
        raise ValueError(f"rows {empty} of action_mask have no real token: nowhere to put their score")
    zero = torch.zeros((), dtype=kl.dtype, device=kl.device)
    rewards = torch.where(mask, -kl_coef * kl, zero)
    last = last_token_index(mask).unsqueeze(1)
    return rewards.scatter_add(1, last, scores.to(kl.dtype).unsqueeze(1))


@torch.no_grad()
def gae(
    rewards: torch.Tensor, values: torch.Tensor, action_mask: torch.Tensor, *, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation over response tokens (Schulman et al. 2016).

    Shapes: ``rewards`` (B, T), ``values`` (B, T) floating (critic values of the rollout), ``action_mask`` (B, T)
    bool or 0/1. Returns ``(advantages, returns)``, both (B, T) in the dtype of ``rewards``, without grad.
    Formula over the ACTION tokens of each row (``m_t`` true), in order, masked positions skipped: with ``t'`` the
    next action token after ``t`` (none: the episode ends, ``V_{t'} = A_{t'} = 0``),
      ``delta_t = r_t + gamma * V_{t'} - V_t``,  ``A_t = delta_t + gamma * lam * A_{t'}``,
      ``returns_t = A_t + V_t``; advantages and returns are exactly 0 at masked positions.
    A masked span INSIDE a response (tool or environment tokens of a multi-turn episode, between two turns of the
    policy) is not an action and not an episode end: credit flows across it, and gamma and lambda discount per
    action step (a span of tool tokens costs no discount). This is verl's convention
    (``verl/trainer/ppo/core_algos.py``, ``compute_gae_advantage_return``: "skip values and TD-error on observation
    tokens"), which equals textbook GAE on each row's action tokens alone. With right padding only (single turn) it is
    the plain per-token GAE. Values/rewards stored at masked positions (even NaN) influence nothing. ``lam = 0``
    gives the TD errors; ``gamma = lam = 1`` gives reward-to-go minus V.
    Source: Schulman et al. 2016, eq. 16; docs/conventions.md section 2.
    Raises: ValueError on shape mismatches or non-2-D inputs.
    """
    _check_same("rewards", rewards, "values", values)
    _check_same("rewards", rewards, "action_mask", action_mask)
    if rewards.dim() != 2:
        raise ValueError(f"expected (B, T) tensors, got shape {tuple(rewards.shape)}")
    mask = action_mask.bool()
    zero = torch.zeros((), dtype=rewards.dtype, device=rewards.device)
    r = torch.where(mask, rewards, zero)
    v = torch.where(mask, values.to(rewards.dtype), zero)
    m = mask.to(rewards.dtype)
    num_steps = rewards.shape[1]
    advantages = torch.zeros_like(r)
    next_value = torch.zeros_like(r[:, 0])  # V and A of the next ACTION token (0 past the last one)
    next_adv = torch.zeros_like(r[:, 0])
    for t in reversed(range(num_steps)):
        delta = r[:, t] + gamma * next_value - v[:, t]
        adv = delta + gamma * lam * next_adv
        act = mask[:, t]
        advantages[:, t] = torch.where(act, adv, zero)
        next_adv = torch.where(act, adv, next_adv)  # a masked position passes the next action's on unchanged
        next_value = torch.where(act, v[:, t], next_value)
    returns = (advantages + v) * m
    return advantages, returns




def group_advantages(
    scores: torch.Tensor,
    *,
    group_size: int,
    eps: float = 1e-6,
    std_floor: float | None = None,
    unbiased: bool = True,
    scale: str = "group",
    batch_std: torch.Tensor | None = None,
) -> torch.Tensor:
    """GRPO group-normalised advantages (Shao et al. 2024, DeepSeekMath, outcome supervision).

    Shapes: ``scores`` (B*G,) with the G samples of a prompt contiguous, or (B, G); floating (integers are
    converted to float32). Returns the same shape, floating. Broadcast over the response tokens by the caller,
    e.g. ``adv[:, None] * action_mask``.
    Formula: per group, ``A_i = (r_i - mean_G) / (max(std, std_floor) + eps)``, where ``std`` depends on ``scale``:
    ``"group"`` (GRPO) the group's own ``std_G``; ``"batch"`` the std of all B*G scores together (group mean,
    batch std: Liu et al. 2025, "Tricks or Traps? A Deep Dive into RL for LLM Reasoning", Lite PPO), so a group
    whose G rewards are nearly all equal is not scaled up to the same magnitude as a split one; ``"none"`` no
    division at all, ``A_i = r_i - mean_G`` (Liu et al. 2025, "Understanding R1-Zero-Like Training", Dr. GRPO,
    section 3.1: the std divisor weights prompts that are almost always or almost never solved most). Each std is
    the unbiased (Bessel, n - 1; the convention of common GRPO implementations) or, if not ``unbiased``, the
    population standard deviation. A group of identical scores gives A = 0 (never NaN); ``std_floor`` keeps
    near-identical groups from being blown up into +-1 advantages. A group of size 1 has std 0 and A = 0.
    ``batch_std`` (0-dim, ``"batch"`` only): the std to use instead of that of ``scores``, e.g. the square root of
    the variance from `global_moments` over the scores of every data-parallel rank (the batch is then all ranks'
    samples, as in TRL); ignored otherwise.
    Raises: ValueError if ``group_size < 1``, the length is not a multiple of ``group_size``, a 2-D input's second
    dimension differs from ``group_size``, ``scores`` is not 1-D/2-D, or ``scale`` is not one of the three.
    """
    if scale not in SCALE_REWARDS:
        raise ValueError(f"scale must be one of {', '.join(SCALE_REWARDS)}, got {scale!r}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size!r}")
    if scores.dim() == 1:
        if scores.shape[0] % group_size != 0:
            raise ValueError(f"{scores.shape[0]} scores are not a multiple of group_size={group_size}")
    elif scores.dim() == 2:
        if scores.shape[1] != group_size:
            raise ValueError(f"scores of shape {tuple(scores.shape)} do not have group_size={group_size} columns")
    else:
        raise ValueError(f"scores must be (B*G,) or (B, G), got shape {tuple(scores.shape)}")
    x = scores if scores.is_floating_point() else scores.float()
    groups = x.reshape(-1, group_size)
    mean = groups.mean(dim=1, keepdim=True)
    centered = groups - mean
    if scale == "none":
        return centered.reshape(scores.shape)
    if scale == "batch":
        std = global_moments(x, unbiased=unbiased)[1].sqrt() if batch_std is None else batch_std.to(x.dtype)
    else:
        denom = max(group_size - 1, 1) if unbiased else group_size
        std = ((centered * centered).sum(dim=1, keepdim=True) / denom).sqrt()
    if std_floor is not None:
        std = std.clamp(min=std_floor)
    return (centered / (std + eps)).reshape(scores.shape)

