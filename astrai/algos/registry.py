"""The names of astrai.algos' registries and what each registered method needs, without torch.

The job configuration (which host-side tools load without torch) and the train-type records read their choices and
rules from here; the tensor modules register one function under each of these names (`estimators`,
`policy_losses`, `aggregation`, `rollout_correction`, `kl`, `advantages`), and a test holds the two equal. One
owner per fact: a name, its needs and its source are written once, here.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ESTIMATORS", "EstimatorSpec", "KL_ESTIMATORS", "LOSS_AGG_MODES", "POLICY_LOSSES", "PolicyLossSpec",
           "ROLLOUT_CORRECTIONS", "SCALE_REWARDS", "critic_free_estimators", "teacher_estimators"]


@dataclass(frozen=True)
class EstimatorSpec:
    """What an advantage estimator needs and gives (`estimators.AdvantageEstimator` adds its function).

    Fields: ``needs_values`` it reads a critic's ``values`` (the train type must build a critic); ``needs_groups``
    it reads ``group_size`` (G >= 2 samples per prompt, contiguous); ``per_token_rewards`` the layout of
    ``token_rewards`` matters (KL per token, reward-to-go), not only their row sum; ``gives_returns`` the second
    output is a tensor (critic targets / returns), not None; ``reads`` the keyword scalars of the calling convention
    it reads (``gamma``, ``lam``, ``eps``, ``std_floor``, ``scale``, ``unbiased``, ``whiten_advantages``,
    ``whiten_eps``, ``group_size``, ``reward_weight``); ``needs_teacher`` it reads a teacher's log-probs
    (``teacher_logprobs``) and the behaviour log-probs (``old_logprobs``) of the sampled tokens (the job must name
    a teacher, `distill.teacher`); ``source`` the paper.
    """

    needs_values: bool
    needs_groups: bool
    per_token_rewards: bool
    gives_returns: bool
    reads: frozenset[str]
    needs_teacher: bool
    source: str


ESTIMATORS: dict[str, EstimatorSpec] = {
    "gae": EstimatorSpec(needs_values=True, needs_groups=False, per_token_rewards=True, gives_returns=True,
                         reads=frozenset({"gamma", "lam", "whiten_advantages", "whiten_eps", "unbiased"}),
                         needs_teacher=False, source="Schulman et al. 2016, GAE"),
    "grpo": EstimatorSpec(needs_values=False, needs_groups=True, per_token_rewards=False, gives_returns=False,
                          reads=frozenset({"group_size", "eps", "std_floor", "scale", "unbiased"}),
                          needs_teacher=False, source="Shao et al. 2024, DeepSeekMath (GRPO)"),
    "rloo": EstimatorSpec(needs_values=False, needs_groups=True, per_token_rewards=False, gives_returns=False,
                          reads=frozenset({"group_size"}), needs_teacher=False,
                          source="Ahmadian et al. 2024, Back to Basics (RLOO)"),
    "reinforce_pp": EstimatorSpec(needs_values=False, needs_groups=False, per_token_rewards=True, gives_returns=True,
                                  reads=frozenset({"gamma", "whiten_eps", "unbiased"}),
                                  needs_teacher=False, source="Hu 2025, REINFORCE++"),
    "reinforce_pp_baseline": EstimatorSpec(needs_values=False, needs_groups=True, per_token_rewards=True,
                                           gives_returns=True,
                                           reads=frozenset({"group_size", "gamma", "whiten_eps", "unbiased"}),
                                           needs_teacher=False, source="Hu 2025, REINFORCE++-baseline"),
    "on_policy_distill": EstimatorSpec(
        needs_values=False, needs_groups=True, per_token_rewards=False, gives_returns=False,
        reads=frozenset({"group_size", "eps", "std_floor", "scale", "unbiased", "reward_weight"}), needs_teacher=True,
        source="Lu and Thinking Machines Lab 2025, On-Policy Distillation; Agarwal et al. 2024, GKD"),
}
"""Advantage estimators by name (`estimators.ADVANTAGE_ESTIMATORS` gives each its function)."""


def critic_free_estimators() -> tuple[str, ...]:
    """The estimators that need no critic (`grpo.advantage_estimator`'s choices), in registry order."""
    return tuple(name for name, spec in ESTIMATORS.items() if not spec.needs_values)


def teacher_estimators() -> tuple[str, ...]:
    """The estimators that read a teacher's log-probs (chosen together with `distill.teacher`), in registry order."""
    return tuple(name for name, spec in ESTIMATORS.items() if spec.needs_teacher)


@dataclass(frozen=True)
class PolicyLossSpec:
    """A policy loss's needs (`policy_losses.PolicyLoss` adds its function): ``dual_clip`` it takes
    ``clip_ratio_c``; ``loss_agg_mode`` its default aggregation; ``source`` the paper."""

    dual_clip: bool
    loss_agg_mode: str
    source: str


POLICY_LOSSES: dict[str, PolicyLossSpec] = {
    "ppo_clip": PolicyLossSpec(dual_clip=True, loss_agg_mode="token-mean",
                               source="Schulman et al. 2017 (PPO); Yu et al. 2025 (DAPO clip-higher); Ye et al. 2020"),
    "gspo": PolicyLossSpec(dual_clip=False, loss_agg_mode="seq-mean-token-mean",
                           source="Zheng et al. 2025, Group Sequence Policy Optimization"),
    "cispo": PolicyLossSpec(dual_clip=False, loss_agg_mode="token-mean", source="MiniMax 2025, MiniMax-M1"),
}
"""Policy losses by name (`policy_losses.POLICY_LOSSES` gives each its function)."""

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
"""Loss aggregation modes (verl's names; the first is astrai's default): `aggregation`."""

ROLLOUT_CORRECTIONS = ("token_tis", "seq_tis", "seq_mask", "icepop")
"""Training-inference mismatch corrections (`rollout_correction.ROLLOUT_CORRECTIONS`)."""

SCALE_REWARDS = ("group", "batch", "none")
"""What GRPO's group-centred rewards are divided by (`advantages.group_advantages`)."""

KL_ESTIMATORS = ("k1", "k2", "k3")
"""KL estimators (Schulman 2020; `kl.KL_ESTIMATORS`)."""
