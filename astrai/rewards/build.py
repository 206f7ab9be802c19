"""The reward of a job: its `reward` section resolved into `RewardFunctions` (the user's functions, the built-ins
and the reward model of `reward.model_path`), and completions scored with the columns of their prompt records.
Training and evaluation (`astrai.evaluation`) build their rewards here, the same way; evaluation leaves the reward
model out (`evaluation_specs`)."""

from __future__ import annotations

import functools
import warnings
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from astrai.imports import ImportFailure, load_attribute
from astrai.models import load_reward_model
from astrai.rewards.builtins import BUILTIN_REWARDS
from astrai.rewards.functions import RewardFunctions, RewardFunctionSpec, ScoredRewards, resolve_specs
from astrai.rewards.reward_model import RewardModelScorer

__all__ = ["answer_extractor", "answer_readers", "build_rewards", "environment_is_the_reward", "evaluation_specs",
           "reward_specs", "score_records"]


def reward_specs(config) -> list[RewardFunctionSpec]:
    """The job's reward functions (`reward.functions`, or the single `reward.name`), resolved; none when the
    environment's reward is the whole reward (`environment_is_the_reward`)."""
    if environment_is_the_reward(config):
        return []
    return resolve_specs(config.reward, answer_field=config.data.answer_field)


def environment_is_the_reward(config) -> bool:
    """Whether the job's reward is its environment's alone: `rollout.environment` is set, a class of it has
    ``get_reward``, and the job sets no reward itself (no `reward.name`, no `reward.functions`, no
    `reward.model_path`), so the default built-in is not added (docs/agents.md). A class that cannot be imported
    counts as without ``get_reward`` here (the environment's own loading refuses it in one line)."""
    r, environment = config.reward, getattr(getattr(config, "rollout", None), "environment", None)
    if environment is None or r.functions or r.model_path or r.name is not None:
        return False
    single = isinstance(environment, str) or "class" in environment or "path" in environment
    entries = [environment] if single else list(environment.values())
    base = Path.cwd()  # relative paths as `astrai.agents.environments.environment_specs` takes them
    for entry in entries:
        reference, path = (entry, None) if isinstance(entry, str) else (entry.get("class"), entry.get("path"))
        if isinstance(reference, str) and _has_get_reward(
                reference, None if path is None else str((base / Path(path).expanduser()).resolve())):
            return True
    return False


@functools.lru_cache(maxsize=64)
def _has_get_reward(reference: str, path: Optional[str]) -> bool:
    """Whether the class `reference` (in the file `path`) has a callable ``get_reward`` (False when it cannot be
    imported)."""
    try:
        cls = load_attribute(reference, path)
    except ImportFailure:
        return False
    return callable(getattr(cls, "get_reward", None))


def evaluation_specs(config, *, answer_field: Optional[str] = None,
                     reward: Optional[str] = None) -> list[RewardFunctionSpec]:
    """The reward functions evaluation scores with: the job's (`reward.functions`, or the single `reward.name`,
    with the same weights and kwargs as training; `reward.model_path`'s reward model is left out, so a job scored
    by the reward model alone is evaluated with `reward.name`), or with `reward` the one built-in of that name
    with its default options (`python -m astrai.evaluate --reward NAME`). `answer_field` (None: `data.answer_field`)
    is the column of reference answers. (An unknown `reward` is refused by `RewardFunctions`.)"""
    field = config.data.answer_field if answer_field is None else answer_field
    if reward is None and environment_is_the_reward(config):
        return []
    if reward is None:
        return resolve_specs(config.reward, answer_field=field, with_model=False)
    builtin = BUILTIN_REWARDS.get(reward)
    kwargs = {"answer_field": field} if builtin is not None and builtin.answer_field else {}
    return [RewardFunctionSpec(name=reward, function=reward, kwargs=kwargs)]


def answer_readers(specs: Sequence[RewardFunctionSpec]) -> list[RewardFunctionSpec]:
    """The `specs` that read the reference-answer column (told its name as the kwarg `answer_field`): with any, the
    prompts must hold answers."""
    return [spec for spec in specs if "answer_field" in spec.kwargs]


def answer_extractor(specs: Sequence[RewardFunctionSpec]) -> Optional[Callable[[str], Optional[str]]]:
    """What the evaluator reports as the answer a response states: the `BuiltinReward.extract_answer` of the first
    built-in among `specs` that has one (`math_exact_match`: the final number), or None."""
    for spec in specs:
        builtin = BUILTIN_REWARDS.get(spec.function) if spec.path is None else None
        if builtin is not None and builtin.extract_answer is not None:
            return builtin.extract_answer
    return None


def build_rewards(config, prompts: Sequence[Any], *, device: torch.device = torch.device("cpu"),
                  prepare_model: Optional[Callable[[torch.nn.Module], torch.nn.Module]] = None,
                  num_workers: Optional[int] = None,
                  specs: Optional[Sequence[RewardFunctionSpec]] = None,
                  should_stop: Optional[Callable[[], bool]] = None) -> RewardFunctions:
    """The job's `RewardFunctions`, checked against the columns its prompt records offer (`prompts`: records with a
    `columns` mapping), with the reward model of `reward.model_path` (loaded on `device`, then passed through
    `prepare_model`, e.g. partitioned for inference under fsdp2 / zero3 as the reference model is) as the reward
    named `reward_model`. `num_workers` (None: `reward.num_workers`) 0 loads and checks every function in this
    process without starting workers (what `--check` does). With `specs` (e.g. `evaluation_specs`) those functions
    are built instead of the job's, without the reward model; workers, timeouts and error handling stay the job's.
    `should_stop` (the trainer's stop requests) interrupts a scoring (`RewardFunctions`: `ScoringStopped`).

    Raises:
        RewardFunctionError: one line naming the function (import, signature, unknown built-in).
        FileNotFoundError / ValueError: a `reward.model_path` that is not a one-label sequence-classification model.
    """
    columns = dict.fromkeys(name for p in prompts for name in p.columns)
    r = config.reward
    extra = []
    if r.model_path and specs is None:
        model, rm_tokenizer = load_reward_model(r.model_path, dtype=getattr(torch, config.model.dtype), device=device)
        scorer = RewardModelScorer(prepare_model(model) if prepare_model is not None else model, model.config,
                                   rm_tokenizer, batch_size=r.model_batch_size, device=device,
                                   system_prompt=config.data.system_prompt, chat_template=config.data.chat_template)
        longest = config.data.max_prompt_length + config.rollout.max_new_tokens + 1
        if model.config.max_position_embeddings < longest:  # what can be known at start-up (issue 42, class 1)
            warnings.warn(f"reward.model_path: the reward model reads at most {model.config.max_position_embeddings} "
                          f"positions, but a prompt (data.max_prompt_length {config.data.max_prompt_length}) and its "
                          f"response (rollout.max_new_tokens {config.rollout.max_new_tokens}) can take {longest} "
                          "(in the policy's tokens): longer samples are scored cut, the prompt's start first",
                          stacklevel=2)
        spec = RewardFunctionSpec(name="reward_model", function="reward_model", index=None,
                                  weight=r.model_weight)
        extra.append((spec, scorer))
    workers = r.num_workers if num_workers is None else num_workers
    return RewardFunctions(reward_specs(config) if specs is None else specs, columns=list(columns), num_workers=workers,
                           timeout_seconds=r.timeout_seconds, on_error=r.on_error, error_score=r.error_score,
                           max_error_fraction=r.max_error_fraction, error_window=r.error_window,
                           extra=extra, allow_none=environment_is_the_reward(config), should_stop=should_stop)


def score_records(rewards: RewardFunctions, texts: list[str], records: Sequence[Any],
                  ids: list[list[int]]) -> ScoredRewards:
    """`rewards` of B completions of `records` (one per completion, each with its stored `prompt` and `columns`):
    their stored prompts and every column (a column a record lacks is None for it). Returns the `ScoredRewards`."""
    names = dict.fromkeys(name for record in records for name in record.columns)
    columns = {name: [record.columns.get(name) for record in records] for name in names}
    return rewards([record.prompt for record in records], texts, ids, columns)
