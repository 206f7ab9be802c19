"""The online experience source of a job: sampling settings, prompts, rewards and the rollout runner over the
colocated engine, from the validated config."""

from __future__ import annotations

import warnings
from typing import Callable, Optional

import torch

from astrai.agents.tools import load_tools
from astrai.data import PromptSampler
from astrai.experience.episodes import EpisodeLimits, EpisodeRunner, ToolExecutor, check_episodes, tool_references
from astrai.experience.prompts import load_online_prompts
from astrai.experience.runner import RolloutRunner
from astrai.experience.sources import OnlineExperience
from astrai.models.special_tokens import stop_token_ids, strip_stop
from astrai.rewards.build import build_rewards, score_records
from astrai.rollout.engine import GenerationEngine
from astrai.rollout.sampling import SamplingParams

__all__ = ["build_online_experience", "build_episode_runner", "load_job_tools", "sampling_params"]


def sampling_params(config, model_config, tokenizer) -> SamplingParams:
    """The rollout's sampling settings: `rollout.*`, stopping on every id of `special_tokens.stop_token_ids` (the
    tokenizer's EOS and the eos list of the policy's `model_config`)."""
    r = config.rollout
    return SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_k=r.top_k, top_p=r.top_p,
                          stop_token_ids=stop_token_ids(model_config, tokenizer))


def load_job_tools(config, tokenizer, model_config) -> tuple[list, list]:
    """The tools of `rollout.tools`, loaded (relative paths from the working directory) and checked with the job's
    tokenizer and model (`check_episodes`: template, stop token, length): (tools, the (function, path) each worker
    loads). `--check` runs it too.

    Raises:
        astrai.agents.tools.ToolError / ValueError: one line naming the entry or the setting.
    """
    references = tool_references(config.rollout.tools)
    tools = load_tools([reference for reference, _ in references])
    check_episodes(tokenizer, tools, sampling_params(config, model_config, tokenizer),
                   max_prompt_length=config.data.max_prompt_length,
                   max_position_embeddings=model_config.max_position_embeddings)
    return tools, [source for _, source in references]


def build_episode_runner(config, runner, tokenizer, model_config) -> EpisodeRunner:
    """The multi-turn runner of a job with `rollout.tools` over the single-turn `runner`: the tools
    (`load_job_tools`), their executor (`rollout.tool_workers` processes, `rollout.tool_timeout_seconds`) and the
    episode caps.

    Raises:
        astrai.agents.tools.ToolError / ValueError: as `load_job_tools`.
    """
    r = config.rollout
    tools, sources = load_job_tools(config, tokenizer, model_config)
    executor = ToolExecutor(tools, sources, num_workers=r.tool_workers, timeout_seconds=r.tool_timeout_seconds)
    limits = EpisodeLimits(max_turns=r.max_turns, max_tool_response_tokens=r.max_tool_response_tokens,
                           tool_response_truncation=r.tool_response_truncation,
                           max_parallel_tool_calls=r.max_parallel_tool_calls)
    return EpisodeRunner(runner, tokenizer, tools, executor, limits, system_prompt=config.data.system_prompt)


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
    `OnlineExperience`'s. With `rollout.tools` every sample is a multi-turn episode (`build_episode_runner`).

    Raises:
        DataError: for a missing or malformed prompt file, or an overlong prompt with `data.truncation=error`.
        RewardFunctionError: a reward function that cannot be loaded or served (`build_rewards`).
    """
    r = config.rollout
    sampling = sampling_params(config, model_config, tokenizer)
    stops = sampling.stop_token_ids
    if sampling.truncates:
        warnings.warn("rollout.top_k/top_p truncate the sampled distribution: the trainer scores the "
                      "untruncated one, so importance ratios are biased (docs/conventions.md section 2)")
    prompts = load_online_prompts(config, tokenizer, main=dist.is_main)
    rewards = build_rewards(config, prompts, device=dist.device, prepare_model=prepare_model)
    runner = RolloutRunner(
        engine, sampling, decode=lambda ids: tokenizer.decode(strip_stop(ids, stops), skip_special_tokens=True),
        score_fn=lambda texts, records, ids: score_records(rewards, texts, records, ids),
        ref_model=ref_model, chunk_size=chunk_size)
    if r.tools:  # every sample a multi-turn episode
        runner = build_episode_runner(config, runner, tokenizer, model_config)
    sampler = PromptSampler(prompts, seed=config.train.seed, shuffle=config.data.shuffle, rank=dist.rank,
                            world_size=dist.world_size)
    return OnlineExperience(sync_weights=sync_weights, runner=runner, sampler=sampler, batch_size=r.batch_size,
                            group_size=group_size, seed=config.train.seed + 1000 * dist.rank, device=dist.device,
                            dynamic_sampling=r.dynamic_sampling, max_sampling_rounds=r.max_sampling_rounds,
                            generation_batch_size=r.generation_batch_size)


