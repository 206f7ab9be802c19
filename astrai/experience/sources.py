"""Experience sources: where the rollout-replaying train types get scored samples (`astrai.experience.runner.Experience`).

An `ExperienceSource` turns the next records of its data sampler into B * G scored samples tagged with a
`policy_version`: `OnlineExperience` (online_ppo, online_grpo) samples them with the colocated rollout engine;
`astrai.trainer.learners.grpo.StoredGroups` (offline grpo) reads them from stored groups. The learner then pins
its targets on them (GAE, group advantages) and replays them (`astrai.experience.replay.RolloutReplay`).
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from typing import Any, Callable, Optional, Protocol, Sequence

import torch

from astrai.experience.partial import PartialRollouts
from astrai.experience.trajectory import Experience, concat_experiences, summed_timings
from astrai.experience.runner import RolloutRunner
from astrai.rollout.engine import GenerationEngine

__all__ = ["ExperienceSource", "OnlineExperience"]


class ExperienceSource(Protocol):
    """What a rollout-replaying learner draws its samples from.

    Attributes:
        data_sampler: the sampler of its records (the data position).
        engine: the rollout engine it samples with, or None (stored experience).
    """

    data_sampler: Any
    engine: Any

    def collect(self, policy_version: int) -> Experience:
        """The next batch of scored samples (groups of G contiguous), tagged with `policy_version`."""

    def state_dict(self) -> dict:
        """Its own resume state (e.g. the sampling RNG), merged into the learner's."""

    def load_state_dict(self, state: dict) -> None:
        """Inverse of `state_dict` (extra keys of the learner's state are ignored)."""


class OnlineExperience:
    """Sampled experience: sync the policy into the engine, draw B prompts, sample G responses of each, decode, score
    and compute reference log-probs (`RolloutRunner`).

    Args:
        sync_weights: `sync_weights(policy_version)` makes the runner's engine hold the policy's weights of that
            version before each batch (a no-op when it does already; `astrai.rollout.engine.sync_weights` over the
            trained model's `full_weights`).
        runner: the rollout runner (`RolloutRunner`; with `rollout.tools` an `astrai.experience.episodes.EpisodeRunner`,
            the same interface); its `engine` is the colocated `GenerationEngine`.
        sampler: endless resumable sampler of records with `.prompt_ids` (rendered, within the prompt
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
        any_rank: with several ranks, `any_rank(flag) -> bool` (the maximum of `flag` over the ranks): with
            `dynamic_sampling` every rank samples another round while any rank still lacks B groups, so that the
            ranks make the same number of engine and scoring calls (which agree on failures and may run collectives:
            a sharded reward model); a rank that has its groups samples on (the surplus is dropped) where it would
            otherwise wait for the slowest rank at the next collective. None (one process): each rank decides alone.
        should_stop: whether a stop signal arrived (`DistributedContext.stop_requested`): with `dynamic_sampling`,
            once any rank has one, no further round is sampled and the batch is filled up as at the round cap, so
            the step ends after one round instead of `max_sampling_rounds` (its checkpoint follows at the boundary).
        partial: `rollout.partial` (`astrai.experience.partial.PartialRollouts`, without `dynamic_sampling`): each
            batch is the first B groups completed by a partial rollout, the others carried to the next; None: every
            batch samples B fresh prompts to the end.

    With `dynamic_sampling` each round consumes `generation_batch_size` records of the sampler; reference
    log-probs are computed once, for the B * G kept samples. The experience's stats hold `sampling_rounds` and
    `sampled_zero_std_groups` (the fraction of all groups sampled for the batch whose rewards were all equal) and
    `sampled_reward_mean` (the mean score of every sample drawn for the batch, dropped groups included: the policy's
    reward, which `reward_mean` of the kept samples over-states or under-states by the filter's choice).

    Raises:
        ValueError: for `dynamic_sampling` with G < 2, `max_sampling_rounds` < 1, `generation_batch_size` < 1, or
            `generation_batch_size * max_sampling_rounds` < B (the batch could not be filled).
    """

    def __init__(self, *, sync_weights: Callable[[int], None], runner: RolloutRunner, sampler, batch_size: int,
                 group_size: int = 1, seed: int, device: torch.device, dynamic_sampling: bool = False,
                 max_sampling_rounds: int = 1, generation_batch_size: Optional[int] = None,
                 any_rank: Optional[Callable[[bool], bool]] = None,
                 should_stop: Callable[[], bool] = lambda: False, partial: Optional[PartialRollouts] = None):
        if dynamic_sampling and group_size < 2:
            raise ValueError(f"dynamic_sampling needs groups of at least 2 samples, got group_size={group_size}")
        if max_sampling_rounds < 1:
            raise ValueError(f"max_sampling_rounds: expected >= 1, got {max_sampling_rounds}")
        if generation_batch_size is not None and generation_batch_size < 1:
            raise ValueError(f"generation_batch_size: expected >= 1 or None, got {generation_batch_size}")
        if dynamic_sampling and (generation_batch_size or batch_size) * max_sampling_rounds < batch_size:
            raise ValueError(f"generation_batch_size {generation_batch_size} x max_sampling_rounds "
                             f"{max_sampling_rounds} prompts cannot fill a batch of {batch_size}")
        self.sync_weights, self.runner, self.data_sampler = sync_weights, runner, sampler
        self.batch_size, self.group_size = batch_size, group_size
        self.dynamic_sampling, self.max_sampling_rounds = dynamic_sampling, max_sampling_rounds
        self.generation_batch_size = generation_batch_size or batch_size
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.any_rank = any_rank or bool
        self.should_stop = should_stop
        self.partial = partial

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
        self.sync_weights(policy_version)
        synced = time.perf_counter() - start
        try:
            if self.partial is not None:
                experience = self.runner.add_reference(
                    self.partial.collect(self.runner, self.data_sampler, self.generator, policy_version))
            elif self.dynamic_sampling:
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
        while len(rounds) < self.max_sampling_rounds:
            if rounds and (self.any_rank(self.should_stop()) or not self.any_rank(len(kept) < self.batch_size)):
                break  # a stop signal on any rank: filled up now, as at the round cap, so the step ends soon
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
        experience.stats.update(_sampled_stats(rounds))  # the runner's own (multi-turn episodes' metrics)
        sampled = torch.cat([part.scores.reshape(-1).float() for part in rounds])
        experience.stats.update(sampling_rounds=float(len(rounds)),
                                truncated_fraction=self.runner.truncated_fraction(experience),
                                sampled_zero_std_groups=len(dropped) / (len(kept) + len(dropped)),
                                sampled_reward_mean=float(sampled.mean()))
        return experience

    def state_dict(self) -> dict:
        """The sampling RNG state, and with `partial` the groups in flight (`PartialRollouts.state_dict`)."""
        state = {"sampling_rng": self.generator.get_state()}
        if self.partial is not None:
            state["partial_rollouts"] = self.partial.state_dict(getattr(self.data_sampler, "dataset", None))
        return state

    def load_state_dict(self, state: dict) -> None:
        """Inverse of `state_dict` (a state saved without groups in flight leaves none). Groups in flight saved by a
        job with `rollout.partial`, resumed without it, are dropped with a warning saying how many (their prompts
        were drawn: they are not drawn again)."""
        self.generator.set_state(state["sampling_rng"])
        if self.partial is not None:
            self.partial.load_state_dict(state.get("partial_rollouts", {"groups": []}),
                                         getattr(self.data_sampler, "dataset", ()))
            return
        dropped = len(state.get("partial_rollouts", {}).get("groups", []))
        if dropped:
            warnings.warn(f"rollout.partial is false: the {dropped} group(s) in flight in the checkpoint are dropped "
                          "(their prompts were drawn and are not drawn again; resume with rollout.partial true to "
                          "continue them)", stacklevel=2)


def _sampled_stats(rounds: Sequence[Experience]) -> dict[str, float]:
    """The stats the runner gave each sampling round (`Experience.stats`: the multi-turn episodes' per-episode
    means, `episodes/...`), averaged over every sampled row, whether its group was kept or not: what the rounds
    sampled, as one round's stats say it."""
    rows = [len(part) for part in rounds]
    keys = {key for part in rounds for key in part.stats}
    out = {}
    for key in sorted(keys):
        have = [(part.stats[key], n) for part, n in zip(rounds, rows) if key in part.stats]
        out[key] = sum(value * n for value, n in have) / max(sum(n for _, n in have), 1)
    return out
