"""Advantage estimators by name: GAE, GRPO, RLOO, REINFORCE++, REINFORCE++-baseline and on-policy distillation, one
calling convention.

Methods (exact definitions: docs/conventions.md section 2):
- ``gae``: Generalised Advantage Estimation with a critic (Schulman et al. 2016), `advantages.gae`, optionally
  whitened over the whole batch.
- ``grpo``: group-normalised outcome advantages (Shao et al. 2024, DeepSeekMath), `advantages.group_advantages`
  with its scale modes (group / batch / none).
- ``rloo``: REINFORCE Leave-One-Out (Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style
  Optimization for Learning from Human Feedback in LLMs", section 3): ``A_i = R_i - mean of the other G - 1
  returns of its group = G / (G - 1) * (R_i - mean_G)``, no std scaling: as verl's
  ``compute_rloo_outcome_advantage`` and TRL's ``RLOOTrainer`` (whose optional ``normalize_advantages``, off by
  default, astrai does not provide). A group of one gives 0 (TRL; verl's vectorised variant).
- ``reinforce_pp``: REINFORCE++ (Hu 2025, "REINFORCE++: An Efficient RLHF Algorithm with Robustness to Both
  Prompt and Reward Models", section 3): per-token rewards, discounted reward-to-go ``G_t = r_t + gamma G_{t'}``
  over the action tokens (``t'`` the next one; masked positions skipped, as GAE skips them), then whitened over
  the real tokens of the WHOLE batch (every data-parallel rank: `masked.global_moments` through ``all_reduce_sum``), as verl's ``compute_reinforce_plus_plus_outcome_
  advantage`` (unbiased variance, ``(x - mean) / sqrt(var + whiten_eps)``).
- ``reinforce_pp_baseline``: REINFORCE++-baseline (same paper): the group mean of the SCORES is subtracted from the
  reward at each response's last real token, then reward-to-go with ``gamma`` and global whitening as above. This
  is OpenRLHF's order (``reinforce_baseline``: ``r - mean_G(r)`` before the per-token KL is added and the returns
  accumulated). verl's ``compute_reinforce_plus_plus_baseline_outcome_advantage`` centres the SUM of the token
  rewards and broadcasts it to every token (no reward-to-go); both agree when the token rewards carry no KL term
  and ``gamma = 1`` (tested against both loops).
- ``on_policy_distill``: on-policy distillation (Lu and Thinking Machines Lab 2025, "On-Policy Distillation";
  Agarwal et al. 2024, GKD): the per-token advantage is the teacher's log-prob minus the student's at the sampled token (the
  negative reverse-KL estimate), undiscounted, plus ``reward_weight`` times GRPO's group advantage of the task
  reward. Cross-tokenizer distillation is out of scope: both log-probs score the same token ids.

Calling convention (every estimator, `AdvantageEstimatorFn`): keyword-only ``scores`` (N,), ``action_mask`` (N, T),
optional ``token_rewards`` (N, T) and ``values`` (N, T), optional ``old_logprobs`` (N, T) and ``teacher_logprobs``
(N, T) (read only by the estimators that need a teacher), and scalars; returns ``(advantages (N, T), returns (N, T)
or None)`` in float, both exactly 0 at padding, without grad. ``token_rewards`` are the full per-token rewards
(KL penalty on every real token plus the score on the last one, `advantages.ppo_token_rewards`); when None they
are the score on the last real token only. Outcome estimators (grpo, rloo) use the per-response return
``R_i = sum_t token_rewards[i, t]`` (= score minus the KL sum; the KL-in-reward of verl and TRL) or ``scores`` when
no token rewards are given. Rows of a group are contiguous (G = ``group_size``). Masked positions (even NaN)
influence nothing. An estimator that reduces over ranks (reinforce_pp*, grpo with ``scale="batch"``, gae with
``whiten_advantages``, on_policy_distill with ``reward_weight`` and ``scale="batch"``) must be called on every rank
together. Adding an estimator is one function with this
signature plus one `registry.ESTIMATORS` entry (its needs) and one `_FUNCTIONS` entry.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable, Optional, Protocol

import torch

from .advantages import gae as _gae
from .advantages import group_advantages, last_token_index
from .masked import _real, global_moments, masked_whiten
from .registry import ESTIMATORS, EstimatorSpec

__all__ = ["ADVANTAGE_ESTIMATORS", "AdvantageEstimator", "AdvantageEstimatorFn", "advantage_estimator",
           "estimate_gae", "estimate_grpo", "estimate_on_policy_distill", "estimate_reinforce_pp",
           "estimate_reinforce_pp_baseline", "estimate_rloo"]

Reduce = Optional[Callable[[torch.Tensor], torch.Tensor]]
Result = tuple[torch.Tensor, Optional[torch.Tensor]]


class AdvantageEstimatorFn(Protocol):
    """The uniform estimator signature (module docstring)."""

    def __call__(self, *, scores: torch.Tensor, action_mask: torch.Tensor,
                 token_rewards: torch.Tensor | None = None, values: torch.Tensor | None = None,
                 group_size: int = 1, gamma: float = 1.0, lam: float = 1.0, eps: float = 1e-6,
                 std_floor: float | None = None, scale: str = "group", unbiased: bool = True,
                 whiten_advantages: bool = False, whiten_eps: float = 1e-8,
                 all_reduce_sum: Reduce = None, old_logprobs: torch.Tensor | None = None,
                 teacher_logprobs: torch.Tensor | None = None, reward_weight: float = 0.0) -> Result: ...


def _check(scores: torch.Tensor, action_mask: torch.Tensor, token_rewards: torch.Tensor | None,
           values: torch.Tensor | None) -> torch.Tensor:
    """Shape checks shared by every estimator; returns the bool mask."""
    if action_mask.dim() != 2:
        raise ValueError(f"action_mask must be (N, T), got shape {tuple(action_mask.shape)}")
    if tuple(scores.shape) != (action_mask.shape[0],):
        raise ValueError(f"scores must be ({action_mask.shape[0]},) for action_mask {tuple(action_mask.shape)}, "
                         f"got {tuple(scores.shape)}")
    for name, x in (("token_rewards", token_rewards), ("values", values)):
        if x is not None and x.shape != action_mask.shape:
            raise ValueError(f"{name} must have the shape of action_mask {tuple(action_mask.shape)}, "
                             f"got {tuple(x.shape)}")
    return action_mask.bool()


def _float(x: torch.Tensor) -> torch.Tensor:
    return x if x.is_floating_point() else x.float()


def _per_token(scores: torch.Tensor, token_rewards: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor:
    """The per-token rewards, 0 at padding: ``token_rewards``, or the score on the last real token of each row
    (a row without a real token gets nothing: no host-side check)."""
    if token_rewards is not None:
        return _real(_float(token_rewards), mask)
    s = _float(scores)
    placed = torch.zeros(mask.shape, dtype=s.dtype, device=s.device).scatter(
        1, last_token_index(mask).unsqueeze(1), s.unsqueeze(1))
    return _real(placed, mask)


def _outcome(scores: torch.Tensor, token_rewards: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor:
    """Per-response return R (N,): the sum of the token rewards, or the scores."""
    return _float(scores) if token_rewards is None else _real(_float(token_rewards), mask).sum(dim=1)


def _broadcast(per_row: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return _real(per_row.unsqueeze(1).expand(mask.shape), mask)


def _whiten(x: torch.Tensor, mask: torch.Tensor, *, unbiased: bool, whiten_eps: float,
            all_reduce_sum: Reduce) -> torch.Tensor:
    """Whitening over the real tokens of every rank: ``(x - mean) / sqrt(var + whiten_eps)``, 0 at padding."""
    moments = global_moments(x, mask, all_reduce_sum=all_reduce_sum, unbiased=unbiased)
    return masked_whiten(x, mask, moments=moments, eps=whiten_eps)


def _reward_to_go(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """``G_t = r_t + gamma G_{t'}`` over the action tokens (``t'`` the next one, masked positions skipped, 0 there):
    GAE with V = 0 and lambda = 1."""
    return _gae(rewards, torch.zeros_like(rewards), mask, gamma=gamma, lam=1.0)[0]


@torch.no_grad()
def estimate_gae(*, scores: torch.Tensor, action_mask: torch.Tensor, token_rewards: torch.Tensor | None = None,
                 values: torch.Tensor | None = None, group_size: int = 1, gamma: float = 1.0, lam: float = 1.0,
                 eps: float = 1e-6, std_floor: float | None = None, scale: str = "group", unbiased: bool = True,
                 whiten_advantages: bool = False, whiten_eps: float = 1e-8,
                 all_reduce_sum: Reduce = None, old_logprobs: torch.Tensor | None = None,
                 teacher_logprobs: torch.Tensor | None = None, reward_weight: float = 0.0) -> Result:
    """``gae``: `advantages.gae` of the per-token rewards against the critic's ``values`` (Schulman et al. 2016).

    Reads: ``scores`` or ``token_rewards``, ``values`` (required), ``gamma``, ``lam``; with ``whiten_advantages``
    also ``unbiased``, ``whiten_eps`` and ``all_reduce_sum`` (whitening over every rank's real tokens). Returns
    ``(advantages, returns)``, ``returns = A + V`` computed before any whitening.
    Raises: ValueError if ``values`` is None or on shape mismatches.
    """
    mask = _check(scores, action_mask, token_rewards, values)
    if values is None:
        raise ValueError("advantage estimator 'gae' needs the critic's values")
    rewards = _per_token(scores, token_rewards, mask)
    advantages, returns = _gae(rewards, _real(values.to(rewards.dtype), mask), mask, gamma=gamma, lam=lam)
    if whiten_advantages:
        advantages = _whiten(advantages, mask, unbiased=unbiased, whiten_eps=whiten_eps,
                             all_reduce_sum=all_reduce_sum)
    return advantages, returns


@torch.no_grad()
def estimate_grpo(*, scores: torch.Tensor, action_mask: torch.Tensor, token_rewards: torch.Tensor | None = None,
                  values: torch.Tensor | None = None, group_size: int = 1, gamma: float = 1.0, lam: float = 1.0,
                  eps: float = 1e-6, std_floor: float | None = None, scale: str = "group", unbiased: bool = True,
                  whiten_advantages: bool = False, whiten_eps: float = 1e-8,
                  all_reduce_sum: Reduce = None, old_logprobs: torch.Tensor | None = None,
                  teacher_logprobs: torch.Tensor | None = None, reward_weight: float = 0.0) -> Result:
    """``grpo``: `advantages.group_advantages` of the returns R (N,), broadcast to the real tokens.

    Reads: ``scores`` or ``token_rewards`` (R = their row sum), ``group_size``, ``eps``, ``std_floor``, ``scale``,
    ``unbiased``; with ``scale="batch"`` the std is that of every rank's R together (``all_reduce_sum``). Returns
    ``(advantages, None)``. Raises: ValueError from `group_advantages` or on shape mismatches.
    """
    mask = _check(scores, action_mask, token_rewards, values)
    return _broadcast(_group(scores, token_rewards, mask, group_size=group_size, eps=eps, std_floor=std_floor,
                             scale=scale, unbiased=unbiased, all_reduce_sum=all_reduce_sum), mask), None


def _group(scores: torch.Tensor, token_rewards: torch.Tensor | None, mask: torch.Tensor, *, group_size: int,
           eps: float, std_floor: float | None, scale: str, unbiased: bool, all_reduce_sum: Reduce) -> torch.Tensor:
    """GRPO's group advantage (N,) of the returns R (`_outcome`); with ``scale="batch"`` the std of every rank's R."""
    r = _outcome(scores, token_rewards, mask)
    batch_std = (global_moments(r, all_reduce_sum=all_reduce_sum, unbiased=unbiased)[1].sqrt()
                 if scale == "batch" else None)
    return group_advantages(r, group_size=group_size, eps=eps, std_floor=std_floor, unbiased=unbiased,
                            scale=scale, batch_std=batch_std)


def _groups(x: torch.Tensor, group_size: int) -> torch.Tensor:
    if group_size < 1 or x.shape[0] % group_size != 0:
        raise ValueError(f"{x.shape[0]} rows are not whole groups of group_size={group_size!r}")
    return x.reshape(-1, group_size)


@torch.no_grad()
def estimate_rloo(*, scores: torch.Tensor, action_mask: torch.Tensor, token_rewards: torch.Tensor | None = None,
                  values: torch.Tensor | None = None, group_size: int = 1, gamma: float = 1.0, lam: float = 1.0,
                  eps: float = 1e-6, std_floor: float | None = None, scale: str = "group", unbiased: bool = True,
                  whiten_advantages: bool = False, whiten_eps: float = 1e-8,
                  all_reduce_sum: Reduce = None, old_logprobs: torch.Tensor | None = None,
                  teacher_logprobs: torch.Tensor | None = None, reward_weight: float = 0.0) -> Result:
    """``rloo``: ``A_i = R_i - (sum_G R - R_i) / (G - 1)`` (Ahmadian et al. 2024), broadcast to the real tokens.

    Reads: ``scores`` or ``token_rewards`` (R = their row sum), ``group_size`` (G; G = 1 gives A = 0). Returns
    ``(advantages, None)``. Raises: ValueError if the rows are not whole groups or on shape mismatches.
    """
    mask = _check(scores, action_mask, token_rewards, values)
    groups = _groups(_outcome(scores, token_rewards, mask), group_size)
    if group_size == 1:
        return _broadcast(torch.zeros_like(groups.flatten()), mask), None
    others = (groups.sum(dim=1, keepdim=True) - groups) / (group_size - 1)
    return _broadcast((groups - others).flatten(), mask), None


@torch.no_grad()
def estimate_reinforce_pp(*, scores: torch.Tensor, action_mask: torch.Tensor,
                          token_rewards: torch.Tensor | None = None, values: torch.Tensor | None = None,
                          group_size: int = 1, gamma: float = 1.0, lam: float = 1.0, eps: float = 1e-6,
                          std_floor: float | None = None, scale: str = "group", unbiased: bool = True,
                          whiten_advantages: bool = False, whiten_eps: float = 1e-8,
                          all_reduce_sum: Reduce = None, old_logprobs: torch.Tensor | None = None,
                          teacher_logprobs: torch.Tensor | None = None, reward_weight: float = 0.0) -> Result:
    """``reinforce_pp``: REINFORCE++ (Hu 2025): discounted reward-to-go, whitened over the whole batch.

    Reads: ``scores`` or ``token_rewards``, ``gamma``, ``unbiased``, ``whiten_eps``, ``all_reduce_sum``.
    Formula: ``G_t = r_t + gamma G_{t'}`` over the action tokens (``t'`` the next one; 0 past the last and at masked
    positions); ``A = (G - mean) / sqrt(var + whiten_eps)`` with
    the mean and variance of G over the real tokens of every rank. Returns ``(advantages, G)``.
    Raises: ValueError on shape mismatches.
    """
    mask = _check(scores, action_mask, token_rewards, values)
    returns = _reward_to_go(_per_token(scores, token_rewards, mask), mask, gamma)
    advantages = _whiten(returns, mask, unbiased=unbiased, whiten_eps=whiten_eps, all_reduce_sum=all_reduce_sum)
    return advantages, returns


@torch.no_grad()
def estimate_reinforce_pp_baseline(*, scores: torch.Tensor, action_mask: torch.Tensor,
                                   token_rewards: torch.Tensor | None = None, values: torch.Tensor | None = None,
                                   group_size: int = 1, gamma: float = 1.0, lam: float = 1.0, eps: float = 1e-6,
                                   std_floor: float | None = None, scale: str = "group", unbiased: bool = True,
                                   whiten_advantages: bool = False, whiten_eps: float = 1e-8,
                                   all_reduce_sum: Reduce = None, old_logprobs: torch.Tensor | None = None,
                                   teacher_logprobs: torch.Tensor | None = None, reward_weight: float = 0.0) -> Result:
    """``reinforce_pp_baseline``: REINFORCE++-baseline (Hu 2025; OpenRLHF's order, module docstring).

    Reads: ``scores`` (their group mean is the baseline), ``token_rewards`` (None: the score on the last real
    token), ``group_size``, ``gamma``, ``unbiased``, ``whiten_eps``, ``all_reduce_sum``. Formula:
    ``r'_t = r_t - [t = last real token] * mean_G(scores)``, ``G_t = r'_t + gamma G_{t'}`` over the action tokens,
    ``A = (G - mean) / sqrt(var + whiten_eps)`` over the real tokens of every rank. Returns ``(advantages, G)``.
    Raises: ValueError if the rows are not whole groups or on shape mismatches.
    """
    mask = _check(scores, action_mask, token_rewards, values)
    s = _float(scores)
    baseline = _groups(s, group_size).mean(dim=1, keepdim=True).expand(-1, group_size).flatten()
    rewards = _per_token(scores, token_rewards, mask) - _per_token(baseline, None, mask)
    returns = _reward_to_go(rewards, mask, gamma)
    advantages = _whiten(returns, mask, unbiased=unbiased, whiten_eps=whiten_eps, all_reduce_sum=all_reduce_sum)
    return advantages, returns


@torch.no_grad()
def estimate_on_policy_distill(*, scores: torch.Tensor, action_mask: torch.Tensor,
                               token_rewards: torch.Tensor | None = None, values: torch.Tensor | None = None,
                               group_size: int = 1, gamma: float = 1.0, lam: float = 1.0, eps: float = 1e-6,
                               std_floor: float | None = None, scale: str = "group", unbiased: bool = True,
                               whiten_advantages: bool = False, whiten_eps: float = 1e-8,
                               all_reduce_sum: Reduce = None, old_logprobs: torch.Tensor | None = None,
                               teacher_logprobs: torch.Tensor | None = None, reward_weight: float = 0.0) -> Result:
    """``on_policy_distill``: the negative reverse-KL estimate at each sampled token, plus the weighted task reward.

    Source: Kevin Lu and Thinking Machines Lab, "On-Policy Distillation" (Connectionism, October 2025): the student samples, the teacher scores
    every sampled token, and the per-token advantage is ``-(log pi_student - log pi_teacher)``, with no discount
    (each token's own term only); on-policy distillation itself is Agarwal et al. 2024 (GKD) with the reverse KL.
    Formula, per real token t of row i (0 at padding)::

        A[i, t] = teacher_logprobs[i, t] - old_logprobs[i, t] + reward_weight * A_grpo[i]

    ``old_logprobs`` (N, T) are the student's behaviour log-probs of the sampled tokens (the sampler's, at the
    sampling temperature), ``teacher_logprobs`` (N, T) the teacher's of the same tokens at the same temperature;
    ``A_grpo`` (N,) is `estimate_grpo`'s group advantage of the returns R (``scores`` or the row sums of
    ``token_rewards``), computed only when ``reward_weight`` != 0 (then reading ``group_size``, ``eps``,
    ``std_floor``, ``scale``, ``unbiased`` and, for ``scale="batch"``, ``all_reduce_sum``). The log-prob difference
    is the single-sample (k1) estimate of ``-KL(pi_student || pi_teacher)`` at ``s_t``; its mean over the action
    tokens is minus the logged ``distill/reverse_kl``. Floating inputs keep their dtype; returns
    ``(advantages (N, T), None)``.
    Raises: ValueError if ``old_logprobs`` or ``teacher_logprobs`` is None, or on shape mismatches.
    """
    mask = _check(scores, action_mask, token_rewards, values)
    if old_logprobs is None or teacher_logprobs is None:
        raise ValueError("advantage estimator 'on_policy_distill' needs old_logprobs and teacher_logprobs (the "
                         "student's and the teacher's log-probs of the sampled tokens)")
    for name, x in (("old_logprobs", old_logprobs), ("teacher_logprobs", teacher_logprobs)):
        if x.shape != action_mask.shape:
            raise ValueError(f"{name} must have the shape of action_mask {tuple(action_mask.shape)}, "
                             f"got {tuple(x.shape)}")
    advantages = _real(_float(teacher_logprobs), mask) - _real(_float(old_logprobs), mask)
    if reward_weight != 0:
        task = _group(scores, token_rewards, mask, group_size=group_size, eps=eps, std_floor=std_floor, scale=scale,
                      unbiased=unbiased, all_reduce_sum=all_reduce_sum)
        advantages = advantages + reward_weight * _broadcast(task.to(advantages.dtype), mask)
    return advantages, None


@dataclass(frozen=True)
class AdvantageEstimator(EstimatorSpec):
    """A registered advantage estimator: its `registry.EstimatorSpec` (needs, reads, source) and ``fn``, the
    estimator (`AdvantageEstimatorFn`)."""

    fn: AdvantageEstimatorFn


_FUNCTIONS: dict[str, AdvantageEstimatorFn] = {
    "gae": estimate_gae, "grpo": estimate_grpo, "rloo": estimate_rloo, "reinforce_pp": estimate_reinforce_pp,
    "reinforce_pp_baseline": estimate_reinforce_pp_baseline, "on_policy_distill": estimate_on_policy_distill,
}
if set(_FUNCTIONS) != set(ESTIMATORS):
    raise ImportError(f"astrai.algos.estimators: functions {sorted(_FUNCTIONS)} != registry {sorted(ESTIMATORS)}")
ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    name: AdvantageEstimator(fn=_FUNCTIONS[name], **{f.name: getattr(spec, f.name) for f in fields(spec)})
    for name, spec in ESTIMATORS.items()}
"""Advantage estimators by name (`advantage_estimator` looks them up); every ``fn`` has the same signature."""


def advantage_estimator(name: str) -> AdvantageEstimator:
    """The `ADVANTAGE_ESTIMATORS` record called ``name``.
    Raises: ValueError naming the unknown estimator and the choices."""
    try:
        return ADVANTAGE_ESTIMATORS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown advantage estimator {name!r}; choices: {', '.join(ADVANTAGE_ESTIMATORS)}"
                         ) from None
