"""The online experience source of a job: sampling settings, prompts, rewards and the rollout runner over the
colocated engine, from the validated config."""

from __future__ import annotations

import warnings
from typing import Callable, Optional

import torch

from astrai.data import PromptSampler
from astrai.experience.prompts import load_online_prompts
from astrai.experience.runner import RolloutRunner
from astrai.experience.sources import OnlineExperience
from astrai.models.special_tokens import stop_token_ids, strip_stop
from astrai.rewards.build import build_rewards, score_records
from astrai.rollout.engine import GenerationEngine
from astrai.rollout.sampling import SamplingParams

__all__ = ["build_online_experience"]


def build_online_experience(config, dist, tokenizer, *, engine: GenerationEngine, model_config,
                            sync_weights: Callable[[int], None], ref_model: Optional[torch.nn.Module],
                            chunk_size: int, group_size: int = 1,
                            prepare_model: Optional[Callable[[torch.nn.Module], torch.nn.Module]] = None
                            ) -> OnlineExperience:
    """The online experience source of a validated config over the colocated `engine` (`sync_weights` as
    `OnlineExperience`'s): sampling settings (stop on every id of `special_tokens.stop_token_ids`: the tokenizer's
    EOS and the eos list of the policy's `model_config`), reward (it sees the response text without a final stop
    token; a reward model goes through `prepare_model` as `build_rewards` says), runner, the prompts
    (`load_online_prompts`) and their sampler (seed `train.seed` on every rank, each rank drawing its own share of
    `dist.world_size`), and the sampling RNG (seed `train.seed + 1000 * dist.rank`, on `dist.device`);
    `rollout.dynamic_sampling`, `rollout.max_sampling_rounds` and `rollout.generation_batch_size` as
    `OnlineExperience`'s.

    Raises:
        DataError: for a missing or malformed prompt file, or an overlong prompt with `data.truncation=error`.
        RewardFunctionError: a reward function that cannot be loaded or served (`build_rewards`).
    """
    r = config.rollout
    stops = stop_token_ids(model_config, tokenizer)
    sampling = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_k=r.top_k,
                              top_p=r.top_p, stop_token_ids=stops)
    if sampling.truncates:
        warnings.warn("rollout.top_k/top_p truncate the sampled distribution: the trainer scores the "
                      "untruncated one, so importance ratios are biased (docs/conventions.md section 2)")
    prompts = load_online_prompts(config, tokenizer, main=dist.is_main)
    rewards = build_rewards(config, prompts, device=dist.device, prepare_model=prepare_model)
    runner = RolloutRunner(
        engine, sampling, decode=lambda ids: tokenizer.decode(strip_stop(ids, stops), skip_special_tokens=True),
        score_fn=lambda texts, records, ids: score_records(rewards, texts, records, ids),
        ref_model=ref_model, chunk_size=chunk_size)
    sampler = PromptSampler(prompts, seed=config.train.seed, shuffle=config.data.shuffle, rank=dist.rank,
                            world_size=dist.world_size)
    return OnlineExperience(sync_weights=sync_weights, runner=runner, sampler=sampler, batch_size=r.batch_size,
                            group_size=group_size, seed=config.train.seed + 1000 * dist.rank, device=dist.device,
                            dynamic_sampling=r.dynamic_sampling, max_sampling_rounds=r.max_sampling_rounds,
                            generation_batch_size=r.generation_batch_size)


