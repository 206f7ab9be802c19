"""Experience sources: where the rollout-replaying train types get scored samples (`astrai.rollout.runner.Experience`).

An `ExperienceSource` turns the next records of its data sampler into B * G scored samples tagged with a
`policy_version`: `OnlineExperience` (online_ppo with G = 1, online_grpo) samples them with the colocated rollout
engine; `astrai.trainer.strategies.grpo.StoredGroups` (offline grpo) reads them from stored groups. The strategy
then pins its targets on them (GAE, group advantages) and replays them (`replay.RolloutReplay`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
import warnings
from typing import Any, Optional, Protocol, Sequence

import torch

from astrai.data import PromptDataset, PromptSampler
from astrai.data.prompts import mixture_records
from astrai.data.truncation import EncodedPrompt, encode_prompt_records
from astrai.models.special_tokens import stop_token_ids, strip_stop
from astrai.kernels import BackendUnavailableError
from astrai.rollout.engine import (ATTENTION_BACKEND_ENV, GenerationEngine, attention_backend, build_engine,
                                  check_engine)
from astrai.distributed.engines import prepare_reference
from astrai.models import load_reward_model
from astrai.rollout.reward_functions import RewardFunctions, RewardFunctionSpec, resolve_specs
from astrai.rollout.reward_model_scorer import RewardModelScorer
from astrai.rollout.rewards import unscorable_answers
from astrai.rollout.runner import Experience, RolloutRunner, concat_experiences, summed_timings
from astrai.rollout.sampling import SamplingParams
from astrai.trainer.lora import merged_weights
from astrai.trainer.models import TrainedModel


class ExperienceSource(Protocol):
    """What a rollout-replaying strategy draws its samples from.

    Attributes:
        data_sampler: the sampler of its records (the data position).
        engine: the rollout engine it samples with, or None (stored experience).
    """

    data_sampler: Any
    engine: Any

    def collect(self, policy_version: int) -> Experience:
        """The next batch of scored samples (groups of G contiguous), tagged with `policy_version`."""

    def state_dict(self) -> dict:
        """Its own resume state (e.g. the sampling RNG), merged into the strategy's."""

    def load_state_dict(self, state: dict) -> None:
        """Inverse of `state_dict` (extra keys of the strategy's state are ignored)."""


def sync_engine(engine, policy: TrainedModel, policy_version: int) -> None:
    """Load the policy's weights into `engine` unless it already holds `policy_version` (docs/conventions.md
    section 4: the engine acknowledges the version it now holds). The weights stream in one full parameter at a time
    (`TrainedModel.full_weights`: gathered from the shards under fsdp2 / zero3, on every rank), so no second full
    copy is held beside the engine's.

    Raises:
        RuntimeError: when the engine acknowledges another version.
    """
    if engine.policy_version != policy_version:
        weights = policy.full_weights()
        lora = getattr(policy, "lora", None)
        if lora is not None:  # the engine's plain copy takes W + s B A, one layer at a time
            weights = merged_weights(weights, lora.scaling)
        acknowledged = engine.load_weights(weights, policy_version)
        if acknowledged != policy_version:
            raise RuntimeError(f"engine acknowledged version {acknowledged}, expected {policy_version}")


class OnlineExperience:
    """Sampled experience: sync the policy into the engine, draw B prompts, sample G responses of each, decode, score
    and compute reference log-probs (`RolloutRunner`).

    Args:
        policy: the trained policy (its current weights go to the engine before each batch).
        runner: the rollout runner (its `engine` is the colocated `GenerationEngine`).
        sampler: endless resumable sampler of records with `.prompt_ids` (chat-templated, within the prompt
            budget), `.answer`, `.prompt` and `.columns` (`PromptSampler` over `data.truncation.EncodedPrompt`s).
        batch_size: B, prompts per batch; group_size: G, samples per prompt (rows b * G ... b * G + G - 1).
        seed: seeds the sampling RNG (on `device`).
        dynamic_sampling: DAPO's dynamic sampling (Yu et al. 2025, "DAPO", section 3.2): a group whose G rewards
            are all equal has zero group advantage everywhere, so it is dropped and more prompts are drawn and
            sampled, round after round, until B groups with unequal rewards are kept (later surplus groups are
            dropped). Needs G >= 2.
        max_sampling_rounds: the cap on generation rounds per batch with `dynamic_sampling`; when it is reached,
            the batch is filled up with dropped groups (in the order they were sampled), so a step never stalls.
        generation_batch_size: prompts drawn and sampled per round with `dynamic_sampling` (None = B). More than B
            makes fewer, larger rounds: a decode step over more rows runs its GEMMs nearer the matmul peak.

    With `dynamic_sampling` each round consumes `generation_batch_size` records of the sampler; reference
    log-probs are computed once, for the B * G kept samples. The experience's stats hold `sampling_rounds` and
    `sampled_zero_std_groups` (the fraction of all groups sampled for the batch whose rewards were all equal) and
    `sampled_reward_mean` (the mean score of every sample drawn for the batch, dropped groups included: the policy's
    reward, which `reward_mean` of the kept samples over-states or under-states by the filter's choice).

    Raises:
        ValueError: for `dynamic_sampling` with G < 2, `max_sampling_rounds` < 1, `generation_batch_size` < 1, or
            `generation_batch_size * max_sampling_rounds` < B (the batch could not be filled).
    """

    def __init__(self, *, policy: TrainedModel, runner: RolloutRunner, sampler, batch_size: int,
                 group_size: int = 1, seed: int, device: torch.device, dynamic_sampling: bool = False,
                 max_sampling_rounds: int = 1, generation_batch_size: Optional[int] = None):
        if dynamic_sampling and group_size < 2:
            raise ValueError(f"dynamic_sampling needs groups of at least 2 samples, got group_size={group_size}")
        if max_sampling_rounds < 1:
            raise ValueError(f"max_sampling_rounds: expected >= 1, got {max_sampling_rounds}")
        if generation_batch_size is not None and generation_batch_size < 1:
            raise ValueError(f"generation_batch_size: expected >= 1 or None, got {generation_batch_size}")
        if dynamic_sampling and (generation_batch_size or batch_size) * max_sampling_rounds < batch_size:
            raise ValueError(f"generation_batch_size {generation_batch_size} x max_sampling_rounds "
                             f"{max_sampling_rounds} prompts cannot fill a batch of {batch_size}")
        self.policy, self.runner, self.data_sampler = policy, runner, sampler
        self.batch_size, self.group_size = batch_size, group_size
        self.dynamic_sampling, self.max_sampling_rounds = dynamic_sampling, max_sampling_rounds
        self.generation_batch_size = generation_batch_size or batch_size
        self.generator = torch.Generator(device=device).manual_seed(seed)

    @property
    def engine(self) -> GenerationEngine:
        """The runner's rollout engine."""
        return self.runner.engine

    def collect(self, policy_version: int) -> Experience:
        """B * G scored samples of the weights of `policy_version`: the engine wakes (takes its KV memory back),
        takes the weights, generates, and sleeps again (releases the KV memory while the trainer steps); the sync
        time is added to the experience's `timings` as "weight_sync"."""
        engine = self.runner.engine
        engine.wake()
        start = time.perf_counter()
        sync_engine(engine, self.policy, policy_version)
        synced = time.perf_counter() - start
        try:
            if self.dynamic_sampling:
                experience = self.runner.add_reference(self._sample_dynamically(engine.pad_token_id))
            else:
                experience = self.runner.collect(*self._next_prompts(self.batch_size), self.generator)
        finally:
            engine.sleep()
        experience.timings["weight_sync"] = synced
        return experience

    def _next_prompts(self, count: int) -> tuple[list[list[int]], list]:
        """The next `count` records' prompt ids and the records themselves (the score function's targets), each
        repeated G times."""
        records = self.data_sampler.next_batch(count)
        return ([record.prompt_ids for record in records for _ in range(self.group_size)],
                [record for record in records for _ in range(self.group_size)])

    def _sample_dynamically(self, pad_token_id: int) -> Experience:
        """B groups without reference log-probs (see the class docstring): the first B groups of unequal rewards,
        or at the round cap all of those filled up with the first dropped ones; in the order they were sampled."""
        g, rounds, kept, dropped = self.group_size, [], [], []
        while len(kept) < self.batch_size and len(rounds) < self.max_sampling_rounds:
            part = self.runner.sample(*self._next_prompts(self.generation_batch_size), self.generator)
            spread = part.scores.reshape(-1, g).amax(dim=1) > part.scores.reshape(-1, g).amin(dim=1)
            for group, useful in enumerate(spread.tolist()):
                (kept if useful else dropped).append((len(rounds), group))
            rounds.append(part)
        chosen = (kept + dropped)[:self.batch_size]
        parts = [rounds[r].select([group * g + i for (rr, group) in chosen if rr == r for i in range(g)])
                 for r in range(len(rounds)) if any(rr == r for rr, _ in chosen)]
        # every round's time counts, also that of the rounds none of whose groups were kept
        experience = dataclasses.replace(concat_experiences(parts, pad_token_id), timings=summed_timings(rounds))
        sampled = torch.cat([part.scores.reshape(-1).float() for part in rounds])
        experience.stats.update(sampling_rounds=float(len(rounds)),
                                sampled_zero_std_groups=len(dropped) / (len(kept) + len(dropped)),
                                sampled_reward_mean=float(sampled.mean()))
        return experience

    def state_dict(self) -> dict:
        """The sampling RNG state."""
        return {"sampling_rng": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        """Inverse of `state_dict`."""
        self.generator.set_state(state["sampling_rng"])


def build_rollout_engine(config, policy: torch.nn.Module, tokenizer, *, policy_version: int = 0) -> GenerationEngine:
    """The colocated rollout engine `rollout.engine` (`astrai.rollout.engine.build_engine`): an inference copy of
    `policy` (made before the policy is sharded) in `rollout.dtype`, attending with `rollout.attention_backend`
    (`ASTR_BACKEND` overrides it), with CUDA graphs when `rollout.cuda_graphs` (passed only then: other registered
    engines need not know the option). Raises ValueError / BackendUnavailableError (one line) for what it refuses."""
    r = config.rollout
    options = _engine_options(r)
    with _naming_the_backend_field():
        engine = build_engine(r.engine, policy, pad_token_id=tokenizer.pad_token_id, policy_version=policy_version,
                              dtype=r.dtype, attention_backend=attention_backend(r.attention_backend), **options)
    if r.cuda_graphs and engine.device.type != "cuda":
        warnings.warn(f"rollout.cuda_graphs: nothing is captured on {engine.device.type} (graphs are a CUDA "
                      "feature); decode steps run padded to their batch bucket, eagerly, which is slower here")
    return engine


def _engine_options(rollout) -> dict:
    """The engine options `rollout` sets beyond the common arguments: `cuda_graphs` only when on (so engines that
    do not know the option are built as before)."""
    return {"cuda_graphs": True} if rollout.cuda_graphs else {}


@contextlib.contextmanager
def _naming_the_backend_field():
    """A backend refusal that names no field (the kernels' own messages) is said of `rollout.attention_backend`
    (or of `ASTR_BACKEND` when that variable chose the backend)."""
    try:
        yield
    except BackendUnavailableError as err:
        if str(err).startswith("rollout."):
            raise
        field = ATTENTION_BACKEND_ENV if os.environ.get(ATTENTION_BACKEND_ENV) else "rollout.attention_backend"
        raise BackendUnavailableError(f"{field}: {err}") from None


def check_rollout_engine(config, model_config, device: torch.device) -> None:
    """What `build_rollout_engine` would refuse for a model of `model_config` on `device` (the engine name, its
    dtype, `rollout.attention_backend` or `ASTR_BACKEND`, `rollout.cuda_graphs`), without building the engine.
    Raises what it raises."""
    r = config.rollout
    options = _engine_options(r)
    with _naming_the_backend_field():
        check_engine(r.engine, model_config, device=device, dtype=r.dtype or config.model.dtype,
                     attention_backend=attention_backend(r.attention_backend), **options)


def build_online_experience(config, dist, policy: TrainedModel, tokenizer, *, engine: GenerationEngine,
                            ref_model: Optional[torch.nn.Module], chunk_size: int,
                            group_size: int = 1) -> OnlineExperience:
    """The online experience source of a validated config: the rollout engine (`build_rollout_engine`), sampling
    settings (stop on every id of `special_tokens.stop_token_ids`: the tokenizer's EOS
    and the model config's eos list), reward (it sees the response text without a final stop token), runner, the
    prompts (`load_online_prompts`) and their sampler (seed `train.seed` on every rank, each rank drawing its
    own share), and the sampling RNG (seed `train.seed + 1000 * rank`); `rollout.dynamic_sampling`,
    `rollout.max_sampling_rounds` and `rollout.generation_batch_size` as `OnlineExperience`'s.

    Raises:
        DataError: for a missing or malformed prompt file, or an overlong prompt with `data.truncation=error`.
        RewardFunctionError: a reward function that cannot be loaded or served (`build_rewards`).
    """
    r = config.rollout
    stops = stop_token_ids(policy.model.config, tokenizer)
    sampling = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_k=r.top_k,
                              top_p=r.top_p, stop_token_ids=stops)
    if sampling.truncates:
        warnings.warn("rollout.top_k/top_p truncate the sampled distribution: the trainer scores the "
                      "untruncated one, so importance ratios are biased (docs/conventions.md section 2)")
    prompts = load_online_prompts(config, tokenizer, main=dist.is_main)
    rewards = build_rewards(config, prompts, dist)
    runner = RolloutRunner(
        engine, sampling, decode=lambda ids: tokenizer.decode(strip_stop(ids, stops), skip_special_tokens=True),
        score_fn=lambda texts, records, ids: score_records(rewards, texts, records, ids),
        ref_model=ref_model, chunk_size=chunk_size)
    sampler = PromptSampler(prompts, seed=config.train.seed, shuffle=config.data.shuffle, rank=dist.rank,
                            world_size=dist.world_size)
    return OnlineExperience(policy=policy, runner=runner, sampler=sampler, batch_size=r.batch_size,
                            group_size=group_size, seed=config.train.seed + 1000 * dist.rank, device=dist.device,
                            dynamic_sampling=r.dynamic_sampling, max_sampling_rounds=r.max_sampling_rounds,
                            generation_batch_size=r.generation_batch_size)


def _quiet(message: str) -> None:
    """A log that prints nothing (ranks other than the main one)."""


def online_data(config, model_config, tokenizer, *, main: bool = True) -> list[EncodedPrompt]:
    """The data of a train type that samples online: the `data.path` prompts, chat-templated
    (`load_online_prompts`; `model_config` is not needed). Raises DataError for bad data."""
    return load_online_prompts(config, tokenizer, main=main)


def reward_specs(config) -> list[RewardFunctionSpec]:
    """The job's reward functions (`reward.functions`, or the single `reward.name`), resolved."""
    return resolve_specs(config.reward, answer_field=config.data.answer_field)


def build_rewards(config, prompts: Sequence[EncodedPrompt], dist=None, *,
                  num_workers: Optional[int] = None) -> RewardFunctions:
    """The job's `RewardFunctions`, checked against the columns its prompt records offer, with the reward model of
    `reward.model_path` (loaded on `dist.device` and prepared for inference like the reference model: partitioned
    under fsdp2 / zero3) as the reward named `reward_model`. `num_workers` (None: `reward.num_workers`) 0 loads and
    checks every function in this process without starting workers (what `--check` does).

    Raises:
        RewardFunctionError: one line naming the function (import, signature, unknown built-in).
        FileNotFoundError / ValueError: a `reward.model_path` that is not a one-label sequence-classification model.
    """
    columns = dict.fromkeys(name for p in prompts for name in p.columns)
    r = config.reward
    extra = []
    if r.model_path:
        device = dist.device if dist is not None else torch.device("cpu")
        model, rm_tokenizer = load_reward_model(r.model_path, dtype=getattr(torch, config.model.dtype), device=device)
        scorer = RewardModelScorer(prepare_reference(dist, model) if dist is not None else model, model.config,
                                   rm_tokenizer, batch_size=r.model_batch_size, device=device,
                                   system_prompt=config.data.system_prompt)
        spec = RewardFunctionSpec(name="reward_model", function="reward_model", index=len(r.functions) + 1,
                                  weight=r.model_weight)
        extra.append((spec, scorer))
    workers = r.num_workers if num_workers is None else num_workers
    return RewardFunctions(reward_specs(config), columns=list(columns), num_workers=workers,
                           timeout_seconds=r.timeout_seconds, on_error=r.on_error, error_score=r.error_score,
                           max_error_fraction=r.max_error_fraction, extra=extra)


def score_records(rewards: RewardFunctions, texts: list[str], records: Sequence[EncodedPrompt],
                  ids: list[list[int]]):
    """`rewards` of B completions of `records` (one per completion): their stored prompts and every column (a
    column a record lacks is None for it). Returns the `ScoredRewards`."""
    names = dict.fromkeys(name for record in records for name in record.columns)
    columns = {name: [record.columns.get(name) for record in records] for name in names}
    return rewards([record.prompt for record in records], texts, ids, columns)


def _prompt_datasets(config, *, require_answers: bool) -> tuple[list[PromptDataset], str]:
    """The prompt datasets of the job (`data.mixture`'s files, else `data.path`) and how to name them."""
    d = config.data
    if not d.mixture:
        return [PromptDataset(d.path, prompt_field=d.prompt_field, answer_field=d.answer_field,
                              require_answers=require_answers)], d.path
    return [PromptDataset(item["path"], prompt_field=d.prompt_field, answer_field=d.answer_field,
                          field=f"data.mixture[{i}].path", require_answers=require_answers)
            for i, item in enumerate(d.mixture, start=1)], "data.mixture"


def load_online_prompts(config, tokenizer, *, main: bool = True) -> list[EncodedPrompt]:
    """The prompts of `data.path` (or the blend of `data.mixture`, `data.prompts.mixture_records`), chat-templated
    once at load time with overlong ones handled by `data.truncation` against `data.max_prompt_length`, each with
    its stored prompt and columns for the reward functions. The answer field is required only when a reward reads
    it (`math_exact_match`). On the `main` rank, prints what `filter` / `left` did and warns (count and first
    rows) about reference answers such a reward can never match (GSM8K answers without `#### N`); those rows
    are kept: the data needs fixing, and the warning says where.

    Raises:
        DataError: for a missing or malformed prompt file, or from `data.truncation.encode_prompt_records`.
    """
    d = config.data
    specs = reward_specs(config)
    readers = [s for s in specs if "answer_field" in s.kwargs]
    datasets, source = _prompt_datasets(config, require_answers=bool(readers))
    if d.mixture:
        records = mixture_records(datasets, [item.get("weight") or 1.0 for item in d.mixture], seed=config.train.seed)
    else:
        records, source = list(datasets[0]), str(datasets[0].path or d.path)
    for spec in readers if main else ():
        bad = unscorable_answers(spec.function, [rec.answer for rec in records])
        if bad:
            rows = ", ".join(str(i + 1) for i in bad[:5]) + (", ..." if len(bad) > 5 else "")
            warnings.warn(f"{source}: {len(bad)} of {len(records)} answers ({d.answer_field!r}) have no final number "
                          f"('#### N' or a bare number), so {spec.function} scores every response to them 0 "
                          f"(rows {rows})", stacklevel=2)
    ids = encode_prompt_records([rec.prompt for rec in records], tokenizer, system_prompt=d.system_prompt,
                                limit=d.max_prompt_length, limit_name="data.max_prompt_length",
                                policy=d.truncation, source=source, log=print if main else _quiet)
    return [EncodedPrompt(prompt_ids=p, answer=rec.answer, index=rec.index, prompt=rec.prompt, columns=rec.columns)
            for p, rec in zip(ids, records) if p is not None]
