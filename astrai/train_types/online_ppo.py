"""online_ppo: PPO with a learned critic on freshly sampled rollouts (learner: `trainer/learners/online_ppo.py`).

Its own rules: the `ppo` minibatch sizes divide the rollout; with `distill.teacher` (on-policy distillation: the
teacher's log-prob gap is the per-token reward) `ppo.kl_coef` is 0; the critic (`ppo.critic_layers` decoder
layers, all of the policy's by default) fits the loaded model; each checkpoint records the critic's size in its
manifest and resumes only into a job that builds the same critic; checkpoints from before parts were recorded must
hold the critic extras.
"""

from __future__ import annotations

from typing import Mapping, Optional

from astrai.config_schema import ConfigError
from astrai.train_types.spec import (ModelsHeld, TrainType, check_policy_loss, check_rollout_minibatches, check_teacher,
                                     rollout_step_sizes)


def _check(config) -> None:
    check_rollout_minibatches(config, "ppo", "group_size")
    check_policy_loss(config, "ppo")
    check_teacher(config, "ppo", ("kl_coef",))


def _check_model(config, model_config) -> None:
    """`ppo.critic_layers` at most the model's decoder layers (ConfigError otherwise)."""
    layers = config.ppo.critic_layers
    if layers is not None and layers > model_config.num_hidden_layers:
        raise ConfigError(f"ppo.critic_layers ({layers}) exceeds the {model_config.num_hidden_layers} decoder "
                          f"layers of model {config.model.path}")


def critic_fields(config, model_config) -> dict[str, int]:
    """Manifest fields that say which critic a checkpoint holds: `critic_layers` (its decoder layers:
    `ppo.critic_layers`, or all of the policy's) and `policy_layers`."""
    policy_layers = model_config.num_hidden_layers
    critic_layers = policy_layers if config.ppo.critic_layers is None else config.ppo.critic_layers
    return {"critic_layers": critic_layers, "policy_layers": policy_layers}


def critic_mismatch(manifest: Mapping, config) -> Optional[str]:
    """Why a checkpoint's critic (its manifest's `critic_fields`) does not fit the critic the job's
    `ppo.critic_layers` builds, or None when it fits (or the manifest does not record it: its parts are checked
    when they load)."""
    held = manifest.get("critic_layers")
    if held is None:
        return None
    policy_layers = manifest.get("policy_layers")
    want = config.ppo.critic_layers if config.ppo.critic_layers is not None else policy_layers
    if want == held:
        return None
    said = lambda n: f"{n} (all the policy's)" if n == policy_layers else str(n)  # noqa: E731
    return f"its critic has ppo.critic_layers {said(held)}, this job builds {said(want)}; resume with " \
           f"--ppo.critic_layers {held}"


def _models_held(config) -> ModelsHeld:
    """The reference of `ppo.kl_coef` > 0 and the critic of `ppo.critic_layers` layers."""
    return ModelsHeld(reference=config.ppo.kl_coef > 0, critic=True, critic_layers=config.ppo.critic_layers)


TRAIN_TYPE = TrainType(
    name="online_ppo",
    summary="PPO with a learned critic on rollouts sampled by the colocated engine",
    builder="astrai.trainer.learners.online_ppo:build_online_ppo",
    data="astrai.experience.prompts:online_data",
    section="ppo",
    online=True,
    group_size_field="ppo.group_size",
    metrics=("policy/entropy",),
    step_sizes=lambda config: rollout_step_sizes(config.ppo),
    check=_check,
    check_model=_check_model,
    manifest_fields=critic_fields,
    resume_problem=critic_mismatch,
    legacy_required_files=("value_model.pt", "value_optimizer.pt"),
    distills=True,
    models_held=_models_held,
)
