"""The online experience source of a job: sampling settings, prompts, rewards and the rollout runner over the
colocated engine, from the validated config."""

from __future__ import annotations

import warnings
from typing import Any, Callable, Optional, Sequence

import torch

from astrai.agents.environments import (EnvironmentSpec, environment_specs, environment_tools,
                                        load_environment_class, missing_reset_columns)
from astrai.agents.tools import load_tools
from astrai.data import PromptSampler
from astrai.experience.environments import EnvironmentFailures
from astrai.experience.episode_environments import EpisodeEnvironment, routes_of
from astrai.experience.episodes import (ENVIRONMENT_REWARD, EpisodeLimits, EpisodeRunner, ToolExecutor,
                                        check_episodes, tool_references)
from astrai.experience.partial import PartialRollouts
from astrai.experience.partial_episodes import PartialEpisodes
from astrai.experience.prompts import load_online_prompts
from astrai.experience.runner import RolloutRunner
from astrai.experience.sources import OnlineExperience
from astrai.experience.tool_executor import ToolFailures
from astrai.models.special_tokens import stop_token_ids, strip_stop
from astrai.rewards.build import build_rewards, environment_is_the_reward, reward_specs, score_records
from astrai.rewards.functions import RewardFunctions, ScoredRewards, ScoringStopped
from astrai.rollout.engine import GenerationEngine
from astrai.rollout.sampling import SamplingParams

__all__ = ["agreed_scoring", "build_online_experience", "build_episode_player", "build_episode_runner",
           "load_job_environment", "load_job_tools", "sampling_params", "unanswered_tool_calls",
           "uncorrected_dtype_mismatch"]


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


def load_job_environment(config, tokenizer, model_config, records: Sequence[Any], tools: Sequence = ()
                         ) -> list[EnvironmentSpec]:
    """The classes of `rollout.environment`, loaded in this process (relative paths from the working directory)
    and checked against the job: each a class with reset (whose required parameters every row of `records`, the
    prompt records, offers), its public methods' schemas derivable and named apart from `tools` (the job's plain
    tools: both are offered, an environment's methods after them), the template with each class's tools (and an
    injected user turn for a class with step, `check_episodes`), the routing column present in every row and naming
    a class, and no reward function named `ENVIRONMENT_REWARD` when a class has get_reward. `--check` runs it too.

    Raises:
        astrai.agents.environments.EnvironmentClassError / ValueError: one line naming the entry or the setting.
    """
    r, d = config.rollout, config.data
    specs = environment_specs(r.environment)
    classes = {spec.route: load_environment_class(spec) for spec in specs}
    routed_by = r.environment_field if routes_of(r.environment) is not None else None
    if routed_by is not None:
        for record in records:
            route = record.columns.get(routed_by)
            if route is None:
                raise ValueError(f"rollout.environment: routes rows by their {routed_by!r} column "
                                 f"(rollout.environment_field), which row {record.index} of {d.path} lacks")
            if str(route) not in classes:
                raise ValueError(f"rollout.environment: row {record.index} of {d.path} names {route!r} in its "
                                 f"{routed_by!r} column, not one of rollout.environment's: {', '.join(classes)}")
    offered = set.intersection(*[set(record.columns) for record in records]) if records else set()
    offered = (offered | {d.prompt_field}) - {routed_by}
    sampling = sampling_params(config, model_config, tokenizer)
    names = {tool.name for tool in tools}
    for spec in specs:
        cls = classes[spec.route]
        own = environment_tools(spec, cls)
        clash = sorted(names & {tool.name for tool in own})
        if clash:
            raise ValueError(f"{spec.label}: method {cls.__name__}.{clash[0]} has the name of a tool of "
                             "rollout.tools; rename one of them")
        missing = missing_reset_columns(cls, sorted(offered))
        if missing:
            raise ValueError(f"{spec.label}: {cls.__name__}.reset requires {missing[0]!r}, a column the rows do not "
                             f"all have (they have: {', '.join(sorted(offered))})")
        check_episodes(tokenizer, [*tools, *own], sampling, max_prompt_length=d.max_prompt_length,
                       max_position_embeddings=model_config.max_position_embeddings,
                       with_user_turn=callable(getattr(cls, "step", None)), where=spec.label)
    rewarded = [c.__name__ for c in classes.values() if callable(getattr(c, "get_reward", None))]
    if rewarded and ENVIRONMENT_REWARD in [spec.name for spec in reward_specs(config)]:
        raise ValueError(f"reward.functions: a function is named {ENVIRONMENT_REWARD!r}, the name of the reward of "
                         f"rollout.environment ({rewarded[0]}.get_reward); name it otherwise")
    return specs


def build_episode_player(config, engine: GenerationEngine, tokenizer, model_config,
                         records: Sequence[Any] = ()) -> Optional[EpisodeRunner]:
    """What plays the episodes of a job with `rollout.tools` or `rollout.environment` for `python -m
    astrai.evaluate` (`EpisodeRunner.play` over `engine`, its classes checked against the held-out `records`), or
    None for a single-turn job. Call its `close()` when done.

    Raises:
        as `build_episode_runner`.
    """
    if not config.rollout.tools and config.rollout.environment is None:
        return None
    runner = RolloutRunner(engine, sampling_params(config, model_config, tokenizer), decode=tokenizer.decode,
                           score_fn=_unused_score)
    return build_episode_runner(config, runner, tokenizer, model_config, records)


def _unused_score(*args) -> None:
    """The score function of a runner that only plays episodes (the evaluator scores them itself)."""
    raise AssertionError("an evaluation's episodes are scored by the evaluator")


def build_episode_runner(config, runner, tokenizer, model_config, records: Sequence[Any] = (),
                         should_stop: Optional[Callable[[], bool]] = None) -> EpisodeRunner:
    """The multi-turn runner of a job with `rollout.tools` or `rollout.environment` over the single-turn `runner`:
    the tools (`load_job_tools`), their executor (`rollout.tool_workers` processes, `rollout.tool_timeout_seconds`;
    a tool failing on every call over `reward.error_window` rollouts or more stops the job: `ToolFailures`), the
    environment classes (`load_job_environment`, checked against the prompt `records`) in
    `rollout.environment_workers` processes (`rollout.environment_timeout_seconds`; failures stop the job as the
    reward functions' do: `reward.max_error_fraction`, `reward.error_window`) and the episode caps. `should_stop`
    (the trainer's stop requests) interrupts the tool and environment calls (`ScoringStopped`; None: never).

    Raises:
        astrai.agents.tools.ToolError / EnvironmentClassError / ValueError: as `load_job_tools` and
            `load_job_environment`.
    """
    r = config.rollout
    tools, sources = load_job_tools(config, tokenizer, model_config) if r.tools else ([], [])
    environment = None
    if r.environment is not None:
        specs = load_job_environment(config, tokenizer, model_config, records, tools)
        failures = EnvironmentFailures(max_error_fraction=config.reward.max_error_fraction,
                                       error_window=config.reward.error_window)
        environment = EpisodeEnvironment.load(
            specs, num_workers=r.environment_workers, timeout_seconds=r.environment_timeout_seconds,
            routed_by=r.environment_field if routes_of(r.environment) is not None else None, failures=failures,
            max_prompt_tokens=model_config.max_position_embeddings - r.max_new_tokens, should_stop=should_stop)
    executor = ToolExecutor(tools, sources, num_workers=r.tool_workers if tools else 0,
                            timeout_seconds=r.tool_timeout_seconds, should_stop=should_stop,
                            failures=ToolFailures(error_window=config.reward.error_window))
    limits = EpisodeLimits(max_turns=r.max_turns, max_tool_response_tokens=r.max_tool_response_tokens,
                           tool_response_truncation=r.tool_response_truncation,
                           max_parallel_tool_calls=r.max_parallel_tool_calls)
    return EpisodeRunner(runner, tokenizer, tools, executor, limits, system_prompt=config.data.system_prompt,
                         environment=environment, prompt_field=config.data.prompt_field,
                         on_error=config.reward.on_error, error_score=config.reward.error_score,
                         deterministic=config.runtime.deterministic)


def build_online_experience(config, dist, tokenizer, *, engine: GenerationEngine, model_config,
                            sync_weights: Callable[[int], None], ref_model: Optional[torch.nn.Module],
                            chunk_size: int, group_size: int = 1,
                            prepare_model: Optional[Callable[[torch.nn.Module], torch.nn.Module]] = None
                            ) -> OnlineExperience:
    """The online experience source of a validated config over the colocated `engine` (`sync_weights` as
    `OnlineExperience`'s): sampling settings (stop on every id of `special_tokens.stop_token_ids`: the tokenizer's
    EOS and the eos list of the policy's `model_config`), reward (it sees the response text without a final stop
    token; a reward model goes through `prepare_model` as `build_rewards` says), runner, the prompts
    (`load_online_prompts`) and their sampler (seed `train.seed` on every rank, each data-parallel group drawing its
    own share of `dist.dp_size`: with `rollout.tensor_parallel_size` T > 1 the T ranks of one tensor-parallel group
    draw the same prompts, which their engines generate together; T = 1: each rank its own share of the world), and
    the sampling RNG (seed `train.seed + 1000 * dist.dp_rank`, on `dist.device`);
    `rollout.dynamic_sampling`, `rollout.max_sampling_rounds` and `rollout.generation_batch_size` as
    `OnlineExperience`'s; `rollout.partial` as `partial_rollouts` (each data-parallel rank its own groups in flight);
    `rollout.placement` separate with `rollout.max_off_policy_steps` > 0 trains one step off (`engine` then a
    generation process, `astrai.rollout.remote.RemoteEngine`: `OnlineExperience`'s `one_step_off`). With
    `rollout.tools` or `rollout.environment` every sample is a multi-turn episode (`build_episode_runner`). With
    several ranks, the ranks agree after each generation on non-finite logits met by any of them
    (`RolloutRunner.agree`) and, with dynamic sampling, on another round while any rank lacks groups
    (`OnlineExperience.any_rank`), so that they make the same collective calls and stop together. A stop request
    (`dist.stop_requested`) interrupts the reward scoring (`RewardFunctions`' `should_stop`), and the ranks agree
    right after each scoring whether one was interrupted (`agreed_scoring`): then every rank raises
    `ScoringStopped`, and nothing trains on a partial scoring. It interrupts the episodes' tool and environment
    calls too (`build_episode_runner`), the ranks agreeing after the generation (`RolloutRunner.generate_agreed`).

    Raises:
        DataError: for a missing or malformed prompt file, or an overlong prompt with `data.truncation=error`.
        RewardFunctionError: a reward function that cannot be loaded or served (`build_rewards`).
    """
    r = config.rollout
    sampling = sampling_params(config, model_config, tokenizer)
    stops = sampling.stop_token_ids
    if sampling.truncates and dist.is_main:  # said once, not by every rank
        warnings.warn("rollout.top_k/top_p truncate the sampled distribution: the trainer scores the "
                      "untruncated one, so importance ratios are biased (docs/conventions.md section 2)")
    for said in (uncorrected_dtype_mismatch(config), unanswered_tool_calls(config)):
        if said and dist.is_main:
            warnings.warn(said)
    prompts = load_online_prompts(config, tokenizer, main=dist.is_main)
    should_stop = getattr(dist, "stop_requested", lambda: False)
    any_rank = ((lambda flag: bool(dist.all_reduce_max(torch.tensor([float(flag)], device=dist.device)).item()))
                if dist.world_size > 1 else None)
    rewards = build_rewards(config, prompts, device=dist.device, prepare_model=prepare_model, should_stop=should_stop)
    if dist.is_main and environment_is_the_reward(config):
        print("reward: the environment's get_reward is the whole reward (rollout.environment; no reward.name, "
              "reward.functions or reward.model_path set, so no built-in reward is added; docs/agents.md)")
    runner = RolloutRunner(
        engine, sampling, decode=lambda ids: tokenizer.decode(strip_stop(ids, stops), skip_special_tokens=True),
        score_fn=agreed_scoring(rewards, any_rank),
        ref_model=ref_model, chunk_size=chunk_size,
        agree=dist.first_failure if dist.world_size > 1 else None)
    if r.tools or r.environment is not None:  # every sample a multi-turn episode
        runner = build_episode_runner(config, runner, tokenizer, model_config, prompts, should_stop=should_stop)
    sampler = PromptSampler(prompts, seed=config.train.seed, shuffle=config.data.shuffle, rank=dist.dp_rank,
                            world_size=dist.dp_size)
    return OnlineExperience(sync_weights=sync_weights, runner=runner, sampler=sampler, batch_size=r.batch_size,
                            group_size=group_size, seed=config.train.seed + 1000 * dist.dp_rank, device=dist.device,
                            dynamic_sampling=r.dynamic_sampling, max_sampling_rounds=r.max_sampling_rounds,
                            generation_batch_size=r.generation_batch_size,
                            any_rank=any_rank, partial=partial_rollouts(config, group_size, runner),
                            should_stop=should_stop,
                            one_step_off=r.placement == "separate" and r.max_off_policy_steps > 0,
                            max_off_policy_steps=r.max_off_policy_steps,
                            generation_restarts=config.generation_restarts_under(getattr(dist, "strategy", "ddp")))


MIXED_PRECISION_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
"""The compute dtype of each `train.mixed_precision` mode other than "no"."""


def unanswered_tool_calls(config) -> Optional[str]:
    """The start-up warning for a job with `rollout.tools` whose `rollout.max_turns` is 1: each episode ends at its
    first response, so a tool call in it is never run and its result never read (the tools only reach the prompt);
    else None."""
    if config.rollout.tools and config.rollout.max_turns == 1:
        return ("rollout.max_turns 1 with rollout.tools: each episode ends at its first response, so no tool call "
                "is ever run or its result read (the tools only reach the prompt); set rollout.max_turns >= 2")
    return None


def uncorrected_dtype_mismatch(config) -> Optional[str]:
    """The start-up warning for an online job whose rollout engine's log-probs differ from the trainer's beyond float
    rounding, with `rollout.correction: none`; else None: the engine computes in another dtype than the trainer's
    forward, or both compute in half precision (bfloat16 / float16), where their kernels round apart. The engine's
    dtype is `rollout.dtype` (unset: `model.dtype`), the trainer's `bfloat16` / `float16` under `train.bf16` /
    `train.fp16` mixed precision, else `model.dtype`.

    Then the PPO ratio is taken against the engine's log-probs, which differ from the trainer's, and nothing corrects
    for it (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training", who measured
    it between vLLM and FSDP both in bfloat16): on the GRPO arithmetic recipe (`configs/examples/grpo_arithmetic.yaml`,
    one run each, docs/kernels.md) bfloat16 rollouts of the float32 policy without a correction reached 23.5% held
    out, with `token_tis` 46.5%, float32 rollouts 43.0%. A bfloat16 engine against a bfloat16 trainer differed more
    (`bench/mismatch.py --model-dtype bfloat16`: k3 KL 1.9e-3 - 2.1e-3 a token, against 1.3e-3 - 1.4e-3 for the
    float32 trainer, 3e-11 - 4e-11 with both in float32).
    """
    r, mixed = config.rollout, config.train.mixed_precision
    engine, engine_field = (r.dtype, "rollout.dtype") if r.dtype else (config.model.dtype, "model.dtype")
    trainer, trainer_field = ((MIXED_PRECISION_DTYPES[mixed], f"train.{mixed}") if mixed != "no"
                              else (config.model.dtype, "model.dtype"))
    if r.correction != "none" or (engine == trainer and engine == "float32"):
        return None
    if engine == trainer:
        fields = engine_field if engine_field == trainer_field else f"{engine_field}, {trainer_field}"
        return (f"the rollout engine and the trainer both compute in {engine} ({fields}) with rollout.correction "
                "none: in half precision their kernels round apart, so their log-probs differ and nothing corrects "
                "for it (measured in bfloat16 by bench/mismatch.py, docs/kernels.md); set rollout.correction: "
                "token_tis")
    # leaving rollout.dtype unset cures it only where the engine then computes in float32 as the trainer does
    unset = ", or leave rollout.dtype unset" if r.dtype and config.model.dtype == trainer == "float32" else ""
    measured = (" (on the GRPO arithmetic recipe bfloat16 rollouts of a float32 policy learned half as much, "
                "docs/kernels.md)" if trainer == "float32" else "")
    return (f"the rollout engine computes in {engine} ({engine_field}) and the trainer in {trainer} ({trainer_field}) "
            f"with rollout.correction none: their log-probs differ and nothing corrects for it{measured}; set "
            f"rollout.correction: token_tis{unset}")


def agreed_scoring(rewards: RewardFunctions, any_rank: Optional[Callable[[bool], bool]]
                   ) -> Callable[[list[str], Sequence[Any], list[list[int]]], ScoredRewards]:
    """The score function of a runner (`RolloutRunner.score_fn`): `score_records` with `rewards`, after which, with
    several ranks, the ranks agree whether a stop request interrupted the scoring on any of them (`any_rank`: one
    all-reduce of a flag per scoring; none with one process, `any_rank` None).

    Raises:
        ScoringStopped: on every rank alike, when the scoring of any rank was interrupted (`RewardFunctions`).
    """

    def score(texts: list[str], records: Sequence[Any], ids: list[list[int]]) -> ScoredRewards:
        try:
            scored, stopped = score_records(rewards, texts, records, ids), None
        except ScoringStopped as err:
            if any_rank is None:
                raise
            scored, stopped = None, err
        if any_rank is not None and any_rank(stopped is not None):
            raise stopped or ScoringStopped("a stop request interrupted the reward scoring on another rank")
        return scored

    return score


def partial_rollouts(config, group_size: int, runner=None) -> Optional[PartialRollouts]:
    """The groups in flight of `rollout.partial` (`rollout.generation_batch_size` of them, null = 2 x
    `rollout.batch_size`; bound `rollout.max_off_policy_steps`), or None without it; when `runner` is an
    `EpisodeRunner` (`rollout.tools` / `rollout.environment`), groups of multi-turn episodes (`PartialEpisodes`)."""
    r = config.rollout
    if not r.partial:
        return None
    settings = dict(batch_size=r.batch_size, group_size=group_size,
                    in_flight=2 * r.batch_size if r.generation_batch_size is None else r.generation_batch_size,
                    max_off_policy_steps=r.max_off_policy_steps)
    if isinstance(runner, EpisodeRunner):
        return PartialEpisodes(runner, **settings)
    return PartialRollouts(**settings)


