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

from astrai.experience.partial import PartialRollouts, staleness_stats
from astrai.experience.trajectory import Experience, concat_experiences, summed_timings
from astrai.experience.runner import RolloutRunner
from astrai.rollout.engine import GenerationEngine
from astrai.rollout.generation import Generation
from astrai.rollout.remote import GenerationProcessDied

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
        one_step_off: one-step-off training (`rollout.placement` separate with `rollout.max_off_policy_steps` > 0,
            docs/async.md; without `partial` or `dynamic_sampling`): the engine is a generation process
            (`astrai.rollout.remote.RemoteEngine`, with `submit` / `result` / `discard`). Each `collect` takes the
            batch generated ahead, then at once sends the next one with the weights of `policy_version`, which the
            generation process samples while this batch is scored and trained on. Batch k (k >= 1) is thus sampled
            by the weights batch k - 1 was collected at; the first is generated on the spot. Its `policy_version`
            is the trained one, its per-token `policy_versions` the sampling one; stats add `staleness_stats`;
            timings "generate" is the time this process waited for it, "generation_process" the time the
            generation process took to generate it.
        max_off_policy_steps: with `one_step_off`, the bound the staleness metrics report lags up to.
        generation_restarts: with a generation process (`rollout.placement` separate), how many times one that
            dies (`astrai.rollout.remote.GenerationProcessDied`: killed, out of memory) is started again before
            its death stops the job (`rollout.generation_restarts`); each restart is warned about in one line. The
            new process takes the weights of the `policy_version` being collected; the generation lost is sent
            again with the same prompts and sampling RNG state: synchronous (`one_step_off` False), so the batch
            is exactly the one that was lost; one step off, the batch generated ahead is sampled again by the
            newer weights (a lag of 0 for that batch); a death while a checkpoint waits for the batch ahead
            leaves it lost (saved as its prompts and RNG state), and the next collect sends it again (after a
            resume too). 0: every death stops the job.

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
                 should_stop: Callable[[], bool] = lambda: False, partial: Optional[PartialRollouts] = None,
                 one_step_off: bool = False, max_off_policy_steps: int = 0, generation_restarts: int = 0):
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
        self.one_step_off, self.max_off_policy_steps = one_step_off, max_off_policy_steps
        self.generation_restarts = generation_restarts
        self._ahead: Optional[_Ahead] = None
        self._positions: Optional[tuple[Any, dict[int, int]]] = None

    @property
    def engine(self) -> GenerationEngine:
        """The runner's rollout engine."""
        return self.runner.engine

    def collect(self, policy_version: int) -> Experience:
        """B * G scored samples of the weights of `policy_version`: the engine wakes (takes its KV memory back),
        takes the weights, generates, and sleeps again (releases the KV memory while the trainer steps); the sync
        time is added to the experience's `timings` as "weight_sync". With `one_step_off`, see the class
        docstring (`timings["generate"]` is then the time this process waited for the generation)."""
        if self.one_step_off:
            return self._collect_ahead(policy_version)
        engine = self.runner.engine

        def take_weights() -> None:  # a generation process that died while the trainer trained is found here
            engine.wake()
            self.sync_weights(policy_version)

        start = time.perf_counter()
        self._surviving(take_weights, policy_version)
        synced = time.perf_counter() - start
        try:
            if self.partial is not None:
                experience = self.runner.add_reference(
                    self.partial.collect(self.runner, self.data_sampler, self.generator, policy_version))
            elif self.dynamic_sampling:
                experience = self.runner.add_reference(self._sample_dynamically(engine.pad_token_id))
            else:
                prompts = self._next_prompts(self.batch_size)
                experience = self._surviving(lambda: self.runner.collect(*prompts, self.generator), policy_version)
        finally:
            self._sleep()
        experience.timings["weight_sync"] = synced
        return experience

    def _sleep(self) -> None:
        """Put the engine to sleep; a generation process found dead here is left for the next wake to restart
        (`_surviving`) when restarts are allowed."""
        try:
            self.runner.engine.sleep()
        except GenerationProcessDied:
            if self.runner.engine.restarts >= self.generation_restarts:
                raise

    def _surviving(self, call: Callable[[], Any], policy_version: int) -> Any:
        """`call()` (a generation in the generation process), again after each death of the process that
        `generation_restarts` allows (`_restart`), with the sampling RNG as it was before the first try and the
        new process holding the weights of `policy_version`."""
        state = self.generator.get_state()
        while True:
            try:
                return call()
            except GenerationProcessDied as err:
                self._restart(err)
                self.generator.set_state(state)
                self.runner.engine.wake()
                self.sync_weights(policy_version)

    def _restart(self, err: GenerationProcessDied) -> None:
        """Start a new generation process after `err`, said in one line; raises `err` when the restarts allowed
        are spent."""
        engine = self.runner.engine
        if engine.restarts >= self.generation_restarts:
            spent = (f"the {self.generation_restarts} restart(s) of rollout.generation_restarts are spent"
                     if self.generation_restarts else "rollout.generation_restarts is 0")
            raise GenerationProcessDied(f"{err}; {spent}", err.exit_code) from None
        warnings.warn(f"{err}; started a new one (restart {engine.restarts + 1} of {self.generation_restarts}, "
                      "rollout.generation_restarts), which generates the lost batch again", stacklevel=3)
        engine.restart()

    def _collect_ahead(self, policy_version: int) -> Experience:
        """One-step-off `collect` (class docstring)."""
        synced = 0.0
        if self._ahead is None:  # the first batch (or after a resume without one): generated now
            self._ahead, synced = self._submit_ahead(policy_version)
        start = time.perf_counter()
        ahead = self._finish_ahead(policy_version)
        waited = time.perf_counter() - start
        self._ahead, sync_next = self._submit_ahead(policy_version)  # sampled while this batch trains
        experience = self.runner.scored(ahead.generation, ahead.answers, {"generate": waited})
        experience = dataclasses.replace(experience, policy_version=policy_version)  # trained at; tokens: sampled at
        experience.stats.update(staleness_stats(experience.policy_versions, experience.sequences.action_mask,
                                                policy_version, self.max_off_policy_steps))
        experience = self.runner.add_reference(experience)
        experience.timings.update(weight_sync=synced + sync_next, generation_process=ahead.seconds)
        return experience

    def _submit_ahead(self, policy_version: int, answers: Optional[list] = None) -> tuple["_Ahead", float]:
        """Sync the weights of `policy_version` into the generation process and send it the next batch's prompts
        (`answers`' when given: a batch sent again after a restart; awake only around the call, as a colocated
        engine); (the batch in flight, the sync's seconds)."""
        engine = self.runner.engine
        if answers is None:
            prompt_ids, answers = self._next_prompts(self.batch_size)
        else:
            prompt_ids = [record.prompt_ids for record in answers]
        synced = 0.0

        def send() -> int:
            nonlocal synced
            engine.wake()
            start = time.perf_counter()
            self.sync_weights(policy_version)
            synced += time.perf_counter() - start
            request = engine.submit(prompt_ids, self.runner.sampling, self.generator)
            self._sleep()
            return request

        state = self.generator.get_state()  # `submit` leaves it; `result` advances it from here
        return _Ahead(answers=answers, request=self._surviving(send, policy_version), generator_state=state), synced

    def _finish_ahead(self, policy_version: Optional[int] = None) -> "_Ahead":
        """The batch generated ahead, waited for if still in flight (non-finite logits agreed over the ranks as a
        colocated generation's: `RolloutRunner.generate_agreed`); the sampling RNG is then where it left it. A
        generation process that died meanwhile is restarted (`_restart`) and the batch is lost with it: with
        `policy_version` (a collect) it is sent again at once with the RNG state it was sent with, under the
        weights of `policy_version`; without (a checkpoint's state) it stays lost (no request, no generation) and
        the next collect sends it."""
        ahead, engine = self._ahead, self.runner.engine
        while ahead.generation is None:
            if ahead.request is None:  # lost with a generation process that died
                if policy_version is None:
                    return ahead
                self.generator.set_state(ahead.generator_state)
                ahead.request = self._submit_ahead(policy_version, ahead.answers)[0].request
            try:
                generation = self.runner.generate_agreed(lambda: engine.result(ahead.request))
            except GenerationProcessDied as err:
                self._restart(err)
                ahead.request = None
                self.generator.set_state(ahead.generator_state)
                continue
            ahead.generation = _on_device(generation, self.generator.device)
            ahead.seconds, ahead.request = engine.last_seconds, None
        return ahead

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

    def close(self) -> None:
        """The end of training: with `partial`, what its groups in flight hold outside this process is released
        (multi-turn episodes: their environment instances closed; `PartialRollouts.close`)."""
        if self.partial is not None:
            self.partial.close()

    def state_dict(self) -> dict:
        """The sampling RNG state, with `partial` the groups in flight (`PartialRollouts.state_dict`), and with
        `one_step_off` the batch generated ahead (waited for first: a checkpoint holds it whole, so a resume trains
        on exactly it; one lost with a generation process that died meanwhile is saved as its prompts and RNG state,
        which the resumed job sends again; plain tensors and record positions, loadable with
        `torch.load(weights_only=True)`)."""
        state = {}
        if self.one_step_off:
            state["one_step_off"] = None if self._ahead is None else self._saved(self._finish_ahead())
        state["sampling_rng"] = self.generator.get_state()  # after the batch ahead advanced it
        if self.partial is not None:
            state["partial_rollouts"] = self.partial.state_dict(getattr(self.data_sampler, "dataset", None))
        return state

    def _saved(self, ahead: "_Ahead") -> dict:
        """`ahead` as plain data: its records by their position in the sampler's dataset (one per group)."""
        dataset = getattr(self.data_sampler, "dataset", ())
        if self._positions is None or self._positions[0] is not dataset:  # built once per dataset
            self._positions = (dataset, {id(record): i for i, record in enumerate(dataset)})
        positions = self._positions[1]
        records = ahead.answers[::self.group_size]
        if any(id(record) not in positions for record in records):
            raise ValueError("rollout.placement: a prompt generated ahead is not in the sampler's dataset; its state "
                             "cannot be saved")
        saved = {"records": [positions[id(record)] for record in records]}
        if ahead.generation is None:  # lost with a generation process that died: sent again after the resume
            return {**saved, "generation": None, "generator_state": ahead.generator_state, "seconds": 0.0}
        return {**saved, "generation": {name: getattr(ahead.generation, name) for name in _GENERATION_FIELDS},
                "seconds": ahead.seconds}

    def load_state_dict(self, state: dict) -> None:
        """Inverse of `state_dict` (a state saved without groups in flight leaves none). Groups in flight saved by a
        job with `rollout.partial`, resumed without it, are dropped with a warning saying how many (their prompts
        were drawn: they are not drawn again)."""
        if self._ahead is not None and self._ahead.request is not None:  # sent ahead, no longer wanted
            self.runner.engine.discard(self._ahead.request)
        self._ahead = None
        saved = state.get("one_step_off")
        if self.one_step_off and saved is not None:
            dataset = getattr(self.data_sampler, "dataset", ())
            answers = [dataset[i] for i in saved["records"] for _ in range(self.group_size)]
            if saved["generation"] is None:  # lost with a generation process that died: the next collect sends it
                self._ahead = _Ahead(answers=answers, generator_state=saved["generator_state"])
            else:
                self._ahead = _Ahead(answers=answers, seconds=float(saved.get("seconds", 0.0)),
                                     generation=_on_device(Generation(**saved["generation"]), self.generator.device))
        elif saved is not None:
            warnings.warn(f"rollout.placement: the batch of {len(saved['records'])} prompt(s) generated ahead in the "
                          "checkpoint is dropped, as this job does not train one step off (their prompts were drawn "
                          "and are not drawn again)", stacklevel=2)
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


@dataclasses.dataclass
class _Ahead:
    """A batch of one-step-off training: its records (the score function's targets, each G times) and either the
    generation process's request still in flight or the generation it returned (with its seconds there), or
    neither: lost with a generation process that died, to be sent again with `generator_state`."""

    answers: list
    request: Optional[int] = None
    generation: Optional[Generation] = None
    seconds: float = 0.0
    generator_state: Optional[torch.Tensor] = None  # the sampling RNG when it was sent (to send it again)


_GENERATION_FIELDS = tuple(f.name for f in dataclasses.fields(Generation))  # saved and moved whole


def _on_device(generation: Generation, device: torch.device) -> Generation:
    """`generation` with its tensors on `device`."""
    return Generation(**{name: value.to(device) if isinstance(value, torch.Tensor) else value
                         for name, value in ((n, getattr(generation, n)) for n in _GENERATION_FIELDS)})


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
