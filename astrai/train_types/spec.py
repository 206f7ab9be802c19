"""`TrainType`: the record a train type declares, and the small torch-free rules several records share.

A record's callables take the validated job configuration (`astrai.config.Config`, duck-typed: this module imports
neither it nor torch) and, where said, the loaded model's `ModelConfig`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from astrai.config_schema import ConfigError, check_divides

__all__ = ["EVALUATION_ROLLOUT_FIELDS", "ModelsHeld", "TrainType", "check_policy_loss", "check_rollout_minibatches",
           "check_teacher", "rollout_step_sizes", "supervised_step_sizes"]


EVALUATION_ROLLOUT_FIELDS = ("max_new_tokens", "engine", "engine_options", "dtype", "attention_backend", "cuda_graphs")
"""The `rollout` fields a policy's evaluations read: the in-training one (`train.eval_steps`) builds its engine from
them and caps its greedy answers, and `python -m astrai.evaluate --model RUN` takes them from the run's config."""


def _nothing(config) -> None:
    """The default `check`: no rule of its own."""


def _no_model_rule(config, model_config) -> None:
    """The default `check_model`: no limit of its own."""


def _no_fields(config, model_config) -> dict:
    """The default `manifest_fields`: nothing recorded."""
    return {}


def _no_resume_rule(manifest: Mapping, config) -> Optional[str]:
    """The default `resume_problem`: every checkpoint of the train type fits."""
    return None


def _all_read(config) -> tuple[str, ...]:
    """The default `unread`: the job reads every field of its section."""
    return ()


@dataclass(frozen=True)
class ModelsHeld:
    """The models a job holds beside its policy (and beside the teacher of `distill.teacher`, which takes the
    reference's place), for the memory planner (`astrai.trainer.memory_plan`): a frozen `reference` policy, and a
    trained `critic` of `critic_layers` decoder layers (None: all of the policy's)."""

    reference: bool = False
    critic: bool = False
    critic_layers: Optional[int] = None


def _policy_only(config) -> ModelsHeld:
    """The default `models_held`: the policy alone."""
    return ModelsHeld()


def supervised_step_sizes(config) -> tuple[int, int]:
    """(`train.per_device_train_batch_size`, `train.gradient_accumulation_steps`): the optimizer step of the train
    types that draw examples (sft, dpo, seq)."""
    return config.train.per_device_train_batch_size, config.train.gradient_accumulation_steps


def rollout_step_sizes(section) -> tuple[int, int]:
    """(micro-batch size, micro-batches per optimizer step) of a rollout-replaying section (`micro_batch_size`,
    `minibatch_size / micro_batch_size`)."""
    return section.micro_batch_size, section.minibatch_size // section.micro_batch_size


def check_rollout_minibatches(config, section: str, group_field: str) -> None:
    """The minibatch rules of a rollout-replaying train type reading section `section`: its `minibatch_size`
    divides the rollout's samples (`rollout.batch_size` times `<group_field>`) and its `micro_batch_size` divides
    `minibatch_size`.

    Raises:
        ConfigError: one line naming the fields and their values.
    """
    s = getattr(config, section)
    group = getattr(s, group_field)
    check_divides((f"{section}.minibatch_size", s.minibatch_size),
                  (f"rollout.batch_size * {section}.{group_field}", config.rollout.batch_size * group))
    check_divides((f"{section}.micro_batch_size", s.micro_batch_size), (f"{section}.minibatch_size", s.minibatch_size))


def check_policy_loss(config, section: str) -> None:
    """The policy-loss rules of a section with `policy_loss`: dual clip (`clip_ratio_c`) only with ppo_clip.

    Raises:
        ConfigError: one line naming the fields.
    """
    s = getattr(config, section)
    if s.clip_ratio_c is not None and s.policy_loss != "ppo_clip":
        raise ConfigError(f"{section}.clip_ratio_c: dual clip applies to {section}.policy_loss ppo_clip, got "
                          f"{s.policy_loss!r}; set clip_ratio_c to null")


def check_teacher(config, section: str, kl_fields: tuple[str, ...]) -> None:
    """The rules of on-policy distillation shared by the train types that distill (`TrainType.distills`): the
    teacher takes the reference model's place (its log-probs are scored where the reference's would be), so a
    reference-KL term of `section` (each of `kl_fields` > 0) is refused together with `distill.teacher`; and so is
    `rollout.dynamic_sampling`, which drops a group whose rewards are all equal as one without signal, while the
    teacher gives every sampled token its own.

    Raises:
        ConfigError: one line naming the field.
    """
    if not config.distill.distills:  # distill.teacher, or distill.teachers routed by a column
        return
    if config.rollout.dynamic_sampling:
        raise ConfigError("rollout.dynamic_sampling: drops groups whose rewards are all equal as carrying no signal, "
                          "but with distill.teacher every sampled token carries the teacher's; set it to false")
    for name in kl_fields:
        if getattr(getattr(config, section), name) > 0:
            raise ConfigError(f"{section}.{name}: a reference-KL term is set together with distill.teacher; the "
                              f"teacher replaces the reference model (its per-token log-prob gap is the signal), "
                              f"so set {section}.{name} to 0")


def _resolve(reference: str) -> Callable:
    """The function named by `reference` ("package.module:function"), imported now."""
    module, _, name = reference.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class TrainType:
    """Everything the rest of astrai needs to know about one train type.

    Attributes:
        name: the `train.type` value.
        summary: one line for `--help` and docs.
        builder: "module:function" of `(config, dist, policy, tokenizer) -> Learner` (see
            `astrai.trainer.loop.Learner`); the policy arrives with the model options applied.
        data: "module:function" of `(config, model_config, tokenizer, *, main) -> list`: the job's data as the
            learner will train on it (the builder loads it the same way; `--check` loads it alone). Raises
            `astrai.data.DataError` for bad data.
        section: the algorithm section of the config it reads ("ppo", "grpo", "dpo"), or None.
        online: it samples its responses with the colocated rollout engine (its longest sequence is
            `data.max_prompt_length + rollout.max_new_tokens`; it can use `rollout.dynamic_sampling`).
        group_size_field: "section.field" of its responses per prompt, for train types that sample groups.
        metrics: the optional costly metrics it can compute (`train.metrics`).
        step_sizes: config -> (micro-batch size per rank, micro-batches per optimizer step), the numbers DeepSpeed's
            `train_micro_batch_size_per_gpu` and `gradient_accumulation_steps` must equal.
        check: its cross-field rules, run when a `Config` is constructed; raises `ConfigError` (one line).
        check_model: (config, model_config) -> None, its limits against the loaded model; raises `ConfigError`.
        manifest_fields: (config, model_config) -> dict recorded in each checkpoint's manifest (e.g. the critic's
            size), read back by `resume_problem`.
        resume_problem: (manifest, config) -> None when a checkpoint of this train type fits the job, else the
            reason, one line (the caller names the checkpoint).
        unread: config -> the fields of its section that this job leaves unread (warned about when set).
        legacy_required_files: files beyond the policy that its checkpoints written before parts were recorded
            must hold to resume.
        packs: its data step packs several examples into each `data.max_length` row when `data.packing` is set
            (so what it counts are rows, not examples).
        distills: it learns from a teacher's log-probs of its sampled tokens when `distill.teacher` is set
            (on-policy distillation; its `check` holds the rules, e.g. `check_teacher`); other train types refuse
            `distill.teacher`.
        renders: what of its data becomes model input through a tokenizer (`astrai.data.prompt_format`):
            "prompts" (rendered as `data.chat_template` says: the template or raw text), "chats" (always the chat
            template: sft) or "text" (raw documents, never a template: seq).
        models_held: config -> `ModelsHeld`, the models its job builds beside the policy (a reference, a critic).
        data_fields: the `data` fields naming its own records' columns, which no other train type reads (sft's
            `messages_field`); set on a job of another type they are warned about as having no effect.
        answers: whether its model answers prompts that rewards score (in training or in evaluations); False for
            a reward model (rm): the `reward` section, `data.answer_field` and the held-out set are then unread.
        rollout_fields: the only `rollout` fields it reads, where it samples no rollouts of its own (None: it
            reads the section, as the online train types do). The others, set, are warned about as having no
            effect; `EVALUATION_ROLLOUT_FIELDS` belong here for a train type whose policy answers evaluations (the
            in-training one, and `python -m astrai.evaluate --model RUN`, which takes them from the run's config).
    """

    name: str
    summary: str
    builder: str
    data: str
    section: Optional[str] = None
    online: bool = False
    group_size_field: Optional[str] = None
    metrics: tuple[str, ...] = ()
    step_sizes: Callable[[Any], tuple[int, int]] = supervised_step_sizes
    check: Callable[[Any], None] = _nothing
    check_model: Callable[[Any, Any], None] = _no_model_rule
    manifest_fields: Callable[[Any, Any], dict] = _no_fields
    resume_problem: Callable[[Mapping, Any], Optional[str]] = _no_resume_rule
    unread: Callable[[Any], tuple[str, ...]] = _all_read
    legacy_required_files: tuple[str, ...] = ()
    packs: bool = False
    renders: str = "prompts"
    distills: bool = False
    models_held: Callable[[Any], ModelsHeld] = _policy_only
    rollout_fields: Optional[tuple[str, ...]] = None
    data_fields: tuple[str, ...] = ()
    answers: bool = True

    def reads_rollout(self, field: str) -> bool:
        """Whether a job of this train type reads `rollout.<field>` (`rollout_fields`)."""
        return self.rollout_fields is None or field in self.rollout_fields

    def build(self, config, dist, policy, tokenizer):
        """The learner of this train type for a validated job (the `builder`, imported now)."""
        return _resolve(self.builder)(config, dist, policy, tokenizer)

    def load_data(self, config, model_config, tokenizer, *, main: bool = True) -> list:
        """The job's data as the learner trains on it (the `data` function, imported now)."""
        return _resolve(self.data)(config, model_config, tokenizer, main=main)

    def group_size(self, config) -> Optional[int]:
        """Its responses per prompt in `config` (`group_size_field`), or None when it samples no groups."""
        if self.group_size_field is None:
            return None
        section, _, name = self.group_size_field.partition(".")
        return getattr(getattr(config, section), name)
