"""Resuming with a changed job config: what may change, what may not, and saying which is which.

At resume the job's resolved config is compared with the checkpoint's `config.yaml` (the resolved config of the run
that wrote it), field by field:

- fields that define what the saved state means cannot change (`FIXED`: the train type, the seed and the data that
  the data position counts, the model's MoE layout, `model.lora`): refused in one line naming the field, both values
  and the ways on, before anything loads (`check_resume` calls `refusal`);
- every other changed field is applied and listed in one line printed by rank 0 (`describe`), e.g. "resume:
  optim.learning_rate 0.001 -> 0.0005 (applied to the schedule from step 3), train.max_steps 4 -> 6". Learning
  rates, schedule shape and length and AdamW's weight decay, betas and epsilon are applied over the restored optimizer
  state by `ConfiguredSchedule` (the optimizer's saved parameter groups would otherwise bring back the old values);
- `model.path` pointing elsewhere than the run's is refused where the job builds more than the tokenizer from it
  (`model_path_refusal`): a reference model (a KL term, dpo), which is the run's starting model (TRL's and verl's
  rule too), or, with `model.lora`, the base weights under the checkpoint's adapters; otherwise it is said apart:
  the weights come from the checkpoint.

Fields that only say how this launch runs (`checkpoint.resume`, `train.overwrite_output_dir`, `train.output_dir`)
are not compared. A field the checkpoint's config does not know (written by an older astrai) is not compared.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

import torch
import yaml

from astrai import train_types
from astrai.config import ConfigError, canonical_value, config_from_dict, config_to_dict
from astrai.rewards.functions import DEFAULT_REWARD

CONFIG_FILE = "config.yaml"
NOT_COMPARED = ("checkpoint.resume", "train.overwrite_output_dir", "train.output_dir")
FIXED = {
    "train.type": "the checkpoint's state belongs to its train type",
    "train.seed": "the data order and the random streams come from it",
    "data.path": "the data position counts records of the run's data",
    "data.mixture": "the data position counts records of the run's data",
    "data.shuffle": "the data order comes from it",
    "model.moe_num_experts": "the checkpoint's weights have the run's MoE layout",
    "model.moe_top_k": "the checkpoint's weights have the run's MoE layout",
    "model.moe_num_shared_experts": "the checkpoint's weights have the run's MoE layout",
    "model.lora": "the checkpoint holds adapters of the run's rank, scaling and targets, or whole weights without",
}
"""Fields that cannot change on resume -> why (`refusal`)."""
SCHEDULE_FIELDS = ("optim.learning_rate", "optim.critic_learning_rate", "optim.lr_scheduler_type",
                   "optim.warmup_steps", "optim.decay_ratio", "train.max_steps", "optim.weight_decay",
                   "optim.adam_beta1", "optim.adam_beta2", "optim.adam_epsilon")
"""Changes applied by `ConfiguredSchedule` (the others take effect because the job is built from its config)."""
GROUP_HYPERPARAMETERS = ("weight_decay", "betas", "eps")


@dataclass(frozen=True)
class Change:
    """One field whose value differs: `key` "section.field", `old` (the checkpoint's), `new` (the job's)."""

    key: str
    old: Any
    new: Any


def _flat(config: Mapping[str, Any]) -> dict[str, Any]:
    return {f"{section}.{name}": value for section, body in config.items() if isinstance(body, dict)
            for name, value in body.items()}


def config_changes(path: Path, config) -> Optional[list[Change]]:
    """The fields of `config` (an `astrai.config.Config`) whose values differ from the checkpoint's config.yaml at
    `path`, in the config's order; None when the checkpoint holds no readable config.yaml."""
    try:
        saved = yaml.safe_load((Path(path) / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    if not isinstance(saved, dict):
        return None
    old = {key: canonical_value(key, value) for key, value in _flat(saved).items()}  # older files: fewer keys
    if old.get("reward.name") == DEFAULT_REWARD:  # written before reward.name became null when unset
        old["reward.name"] = config.reward.name if config.reward.name is None else DEFAULT_REWARD
    return [Change(key, old[key], value) for key, value in _flat(config_to_dict(config)).items()
            if key in old and key not in NOT_COMPARED and old[key] != value]


def _fmt(value: Any) -> str:
    """A value as it is written on the command line (`1e-3` -> 0.001, `True` -> true, None -> null)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    return "null" if value is None else str(value)


def refusal(changes: Optional[list[Change]], path: Path) -> Optional[str]:
    """One line refusing the first change of a `FIXED` field (what it is, why, the ways on), or None."""
    for change in changes or ():
        if change.key in FIXED:
            return (f"{path}: {change.key} cannot change on resume ({FIXED[change.key]}): the run used "
                    f"{_fmt(change.old)}, this job says {_fmt(change.new)}; resume with --{change.key} "
                    f"{_fmt(change.old)}, or start a new run from its weights (--model.path {path})")
    return None


def _same_directory(old: Any, new: Any) -> bool:
    """Whether two `model.path` values name the same existing directory from here (`./m` and `/abs/m`)."""
    try:
        return Path(str(old)).is_dir() and Path(str(old)).resolve() == Path(str(new)).resolve()
    except (OSError, RuntimeError):
        return False


def built_from_model_path(config) -> Optional[str]:
    """What the job `config` builds from `model.path` besides its tokenizer when it resumes (in words, for a
    refusal), or None when nothing: with `model.lora` the base weights (the checkpoint holds the adapters only),
    else the frozen reference model of its train type (`TrainType.models_held`: a KL term, dpo's reference), which
    the teacher of `distill.teacher` replaces. The critic of online_ppo is warm-started from the policy only on a
    fresh start: a resume restores it from the checkpoint."""
    if config.model.lora:
        return "the checkpoint holds LoRA adapters only: the base weights under them are loaded from it"
    if not config.distill.distills and train_types.get(config.train.type).models_held(config).reference:
        return "the reference model is the run's starting model, loaded from it"
    return None


def _saved_config(config, changes: list[Change]):
    """The checkpoint's job: `config` with the `changes` put back to their old values (None when that is not a
    valid config, e.g. written by another astrai)."""
    data = config_to_dict(config)
    for change in changes:
        section, _, name = change.key.partition(".")
        data[section][name] = change.old
    try:
        return config_from_dict(data)
    except (ConfigError, ValueError, TypeError, KeyError):
        return None


def model_path_refusal(changes: Optional[list[Change]], path: Path, config) -> Optional[str]:
    """One line refusing a changed `model.path` where the job `config`, or the run that wrote the checkpoint,
    builds more than its tokenizer from it (`built_from_model_path`: a reference model, LoRA's base weights): the
    reference stays the run's starting model even across a resume that does not read it (`grpo.kl_coef` 0 for a
    while), since the next resume builds it from the `model.path` that resume recorded. None: no change, the same
    directory spelt otherwise, or only the tokenizer read on both sides (`describe` then says the weights come
    from the checkpoint)."""
    change = next((c for c in changes or () if c.key == "model.path"), None)
    if change is None or _same_directory(change.old, change.new):
        return None
    saved = _saved_config(config, changes)
    why = built_from_model_path(config) or (built_from_model_path(saved) if saved is not None else None)
    if why is None:
        return None
    return (f"{path}: model.path cannot change on resume of this {config.train.type} job ({why}): the run used "
            f"{_fmt(change.old)}, this job says {_fmt(change.new)}; resume with --model.path {_fmt(change.old)}, "
            f"or start a new run from its weights (--model.path {path})")


def describe(changes: Optional[list[Change]], path: Path, step: int) -> Optional[str]:
    """The one line rank 0 prints about what the resume applies (None when nothing changed)."""
    if changes is None:
        return f"resume: {path} holds no {CONFIG_FILE}, so changes to the job config cannot be listed"
    parts = []
    for change in changes:
        if change.key == "model.path":
            continue
        note = f" (applied to the schedule from step {step})" if change.key in SCHEDULE_FIELDS else ""
        parts.append(f"{change.key} {_fmt(change.old)} -> {_fmt(change.new)}{note}")
    model = next((c for c in changes if c.key == "model.path"), None)
    if model is not None:
        parts.append(f"model.path {model.old} -> {model.new}: the weights come from the checkpoint {path}, not from "
                     f"{model.new} (used for its tokenizer; start a new run to train from its weights)")
    return ("resume: " + ", ".join(parts)) if parts else None


class ConfiguredSchedule:
    """The learning-rate schedules and AdamW hyperparameters as the job configures them, kept across a restore.

    `capture(parts)` (before the checkpoint loads) records, for every part whose object is an `LRScheduler`, the peak
    rates the fresh schedule was built with and its optimizer's weight decay, betas and epsilon; `apply()` (after)
    puts them over the restored state and recomputes each group's current rate as peak x the schedule's factor at
    the restored step, as the schedule itself would (bitwise the restored rate when nothing changed).
    """

    def __init__(self):
        self._saved: list[tuple[Any, list[float], list[dict]]] = []

    def capture(self, parts: Mapping[str, Any]) -> "ConfiguredSchedule":
        for part in parts.values():
            sched = part.obj
            if isinstance(sched, torch.optim.lr_scheduler.LambdaLR):
                groups = [{k: g[k] for k in GROUP_HYPERPARAMETERS if k in g} for g in sched.optimizer.param_groups]
                self._saved.append((sched, list(sched.base_lrs), groups))
        return self

    def apply(self) -> None:
        for sched, base_lrs, groups in self._saved:
            sched.base_lrs = list(base_lrs)
            rates = [base * factor(sched.last_epoch) for base, factor in zip(base_lrs, sched.lr_lambdas)]
            for group, base, rate, hyper in zip(sched.optimizer.param_groups, base_lrs, rates, groups):
                group.update(hyper, initial_lr=base, lr=rate)
            sched._last_lr = list(rates)
