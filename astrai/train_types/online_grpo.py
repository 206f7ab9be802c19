"""online_grpo: GRPO on groups sampled by the colocated engine (learner: `trainer/learners/online_grpo.py`).

Its rules, shared with offline `grpo`: the `grpo` minibatch sizes divide the rollout, and the reference KL goes
in the loss (`grpo.kl_coef`) or in the reward (`grpo.kl_reward_coef`), not both. On-policy distillation
(`distill.teacher`, online_grpo only: the config refuses it for offline grpo) goes with an estimator that reads the
teacher (`grpo.advantage_estimator: on_policy_distill`) and with neither reference-KL term.
"""

from __future__ import annotations

from astrai.algos import registry
from astrai.config_schema import ConfigError
from astrai.train_types.spec import (ModelsHeld, TrainType, check_policy_loss, check_rollout_minibatches, check_teacher,
                                     rollout_step_sizes)


def check_grpo(config) -> None:
    """The GRPO rules of online_grpo and grpo (ConfigError, one line)."""
    check_rollout_minibatches(config, "grpo", "group_size")
    check_policy_loss(config, "grpo")
    if config.grpo.kl_coef > 0 and config.grpo.kl_reward_coef > 0:
        raise ConfigError("grpo.kl_reward_coef: KL in the reward and KL in the loss (grpo.kl_coef) are mutually "
                          "exclusive; set one of them to 0")
    estimator = config.grpo.advantage_estimator
    reads_teacher = registry.ESTIMATORS[estimator].needs_teacher
    if reads_teacher and not config.distill.distills:
        raise ConfigError(f"grpo.advantage_estimator: {estimator} scores the samples with a teacher's log-probs; "
                          f"name the teacher in distill.teacher (online_grpo; a model with the student's tokenizer)")
    if config.distill.distills and not reads_teacher:
        choices, name = ", ".join(registry.teacher_estimators()), config.distill.teacher_field
        raise ConfigError(f"{name}: set, but grpo.advantage_estimator {estimator} does not read a teacher; "
                          f"set grpo.advantage_estimator to {choices} (or {name} to "
                          f"{'{}' if config.distill.teachers else 'null'})")
    check_teacher(config, "grpo", ("kl_coef", "kl_reward_coef"))


GRPO_SCALARS = {"std_eps": "eps", "std_floor": "std_floor", "scale_rewards": "scale", "gamma": "gamma"}
"""`grpo` fields -> the estimator scalar each sets (`registry.EstimatorSpec.reads` says which an estimator reads)."""


def grpo_unread(config) -> tuple[str, ...]:
    """The `grpo` fields its advantage estimator does not read (`registry.ESTIMATORS[...].reads`), and `std_eps`
    and `std_floor` when `grpo.scale_rewards` is none (nothing is divided)."""
    g = config.grpo
    reads = registry.ESTIMATORS[g.advantage_estimator].reads
    dividing = g.scale_rewards != "none"
    return tuple(name for name, scalar in GRPO_SCALARS.items()
                 if scalar not in reads or (name in ("std_eps", "std_floor") and not dividing))


def grpo_models_held(config) -> ModelsHeld:
    """The reference of a KL term (`grpo.kl_coef` or `grpo.kl_reward_coef` > 0)."""
    return ModelsHeld(reference=config.grpo.kl_coef > 0 or config.grpo.kl_reward_coef > 0)


def grpo_step_sizes(config) -> tuple[int, int]:
    """The `grpo` section's micro-batch size and micro-batches per optimizer step."""
    return rollout_step_sizes(config.grpo)


TRAIN_TYPE = TrainType(
    name="online_grpo",
    summary="GRPO on groups sampled by the colocated engine (no critic)",
    builder="astrai.trainer.learners.online_grpo:build_online_grpo",
    data="astrai.experience.prompts:online_data",
    section="grpo",
    online=True,
    group_size_field="grpo.group_size",
    metrics=("policy/entropy",),
    step_sizes=grpo_step_sizes,
    check=check_grpo,
    unread=grpo_unread,
    distills=True,
    models_held=grpo_models_held,
)
