"""The reward of a job: its `reward` section resolved into `RewardFunctions` (the user's functions, the built-ins
and the reward model of `reward.model_path`), and completions scored with the columns of their prompt records."""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from astrai.models import load_reward_model
from astrai.rewards.functions import RewardFunctions, RewardFunctionSpec, ScoredRewards, resolve_specs
from astrai.rewards.reward_model import RewardModelScorer

__all__ = ["build_rewards", "reward_specs", "score_records"]


def reward_specs(config) -> list[RewardFunctionSpec]:
    """The job's reward functions (`reward.functions`, or the single `reward.name`), resolved."""
    return resolve_specs(config.reward, answer_field=config.data.answer_field)


def build_rewards(config, prompts: Sequence[Any], *, device: torch.device = torch.device("cpu"),
                  prepare_model: Optional[Callable[[torch.nn.Module], torch.nn.Module]] = None,
                  num_workers: Optional[int] = None) -> RewardFunctions:
    """The job's `RewardFunctions`, checked against the columns its prompt records offer (`prompts`: records with a
    `columns` mapping), with the reward model of `reward.model_path` (loaded on `device`, then passed through
    `prepare_model`, e.g. partitioned for inference under fsdp2 / zero3 as the reference model is) as the reward
    named `reward_model`. `num_workers` (None: `reward.num_workers`) 0 loads and checks every function in this
    process without starting workers (what `--check` does).

    Raises:
        RewardFunctionError: one line naming the function (import, signature, unknown built-in).
        FileNotFoundError / ValueError: a `reward.model_path` that is not a one-label sequence-classification model.
    """
    columns = dict.fromkeys(name for p in prompts for name in p.columns)
    r = config.reward
    extra = []
    if r.model_path:
        model, rm_tokenizer = load_reward_model(r.model_path, dtype=getattr(torch, config.model.dtype), device=device)
        scorer = RewardModelScorer(prepare_model(model) if prepare_model is not None else model, model.config,
                                   rm_tokenizer, batch_size=r.model_batch_size, device=device,
                                   system_prompt=config.data.system_prompt)
        spec = RewardFunctionSpec(name="reward_model", function="reward_model", index=len(r.functions) + 1,
                                  weight=r.model_weight)
        extra.append((spec, scorer))
    workers = r.num_workers if num_workers is None else num_workers
    return RewardFunctions(reward_specs(config), columns=list(columns), num_workers=workers,
                           timeout_seconds=r.timeout_seconds, on_error=r.on_error, error_score=r.error_score,
                           max_error_fraction=r.max_error_fraction, extra=extra)


def score_records(rewards: RewardFunctions, texts: list[str], records: Sequence[Any],
                  ids: list[list[int]]) -> ScoredRewards:
    """`rewards` of B completions of `records` (one per completion, each with its stored `prompt` and `columns`):
    their stored prompts and every column (a column a record lacks is None for it). Returns the `ScoredRewards`."""
    names = dict.fromkeys(name for record in records for name in record.columns)
    columns = {name: [record.columns.get(name) for record in records] for name in names}
    return rewards([record.prompt for record in records], texts, ids, columns)
