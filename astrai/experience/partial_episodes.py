"""Partial rollouts of multi-turn episodes (`rollout.partial` with `rollout.tools` or `rollout.environment`).

What `astrai.experience.partial` does for single-turn samples, for episodes (`astrai.experience.episodes`): each
rollout keeps `rollout.generation_batch_size` groups of G episodes in flight, advances them on the engine's
streaming API (turns decoding while other episodes' tool calls run) until B groups have all their episodes ended,
and carries the others, as they are, to the next rollout. An episode can be stopped anywhere:

- in a turn: the turn's ids so far, their behaviour log-probs and `policy_version`s are kept (`Episode.pending_ids`
  ...); the next rollout re-sends its whole context (prompt, earlier turns and results, the turn so far) as a new
  request after the weight sync, so no KV of older weights is served, and the turn goes on from there. Its tokens
  then carry two versions, which the per-token `policy_versions` record and `rollout.correction` corrects.
- between turns: the tool calls and environment steps in flight when the rollout stops are waited for and their
  results appended, so every carried episode is either ended, in a turn, or ready for its next turn.

Token-exact as ever: a carried turn's ids are the ones sampled, appended verbatim, and a turn is read (its tool
calls parsed) only once it ends. The token budget (`rollout.max_new_tokens`) spans the rollouts, so every episode
ends within a bounded number of decode steps. The staleness bound re-starts a carried episode whose oldest sampled
token would lag more than `rollout.max_off_policy_steps` from its prompt (its environment instance closed and a new
one reset).

Environments: an episode's instance lives in the environment workers across rollouts; an episode that ends is
finished at the end of that rollout (get_reward, close; its failures counted with that rollout's), so a group
waits with its rewards, not its instances. A checkpoint saves the episodes in flight (tokens, messages, counts) but
cannot save the instances (the user's objects, in worker processes): a resumed job re-creates the instance of each
episode still running and replays what the episode did to it (reset with its row, then every call of its
methods and every step, in order, each read again from the episode's tokens), so an environment whose state
follows from those calls (what TRL's and verl's environments are) continues where it was; one that draws
unseeded random numbers, reads the clock or the world continues from another state. When training ends, the
instances of the episodes still in flight are closed (`close`, after the final checkpoint).

Resuming with other settings: a checkpoint's episodes continue only in a job whose episodes offer the same tools and
environment classes (their prompts list them), else they are dropped with a warning (`PartialRollouts.
load_state_dict`); one that no longer fits a smaller `rollout.max_new_tokens` or `rollout.max_turns` is restarted
from its prompt.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any, Sequence

import torch

from astrai.experience.episodes import Episode, EpisodeRunner
from astrai.experience.partial import InFlightGroup, PartialRollouts
from astrai.experience.trajectory import Experience

__all__ = ["PartialEpisodes"]

_SAVED_FIELDS = ("prompt_ids", "messages", "first", "response_ids", "loss_mask", "logprobs", "policy_versions",
                 "turn_starts", "tool_results_cut", "ended_by", "env_key", "env_route", "env_error", "env_reward",
                 "env_reward_failed", "prefill_tokens", "prefill_tokens_reused", "pending_ids", "pending_logprobs",
                 "pending_versions")
_COUNTERS = ("tool_calls", "tool_errors", "env_errors")


class PartialEpisodes(PartialRollouts):
    """`PartialRollouts` whose samples are multi-turn episodes (module docstring), run by `episodes`.

    Args:
        episodes: the job's `EpisodeRunner` (tools, environment, caps, score function).
        batch_size, group_size, in_flight, max_off_policy_steps: as `PartialRollouts`'.

    Raises:
        ValueError: as `PartialRollouts`.
    """

    def __init__(self, episodes: EpisodeRunner, **kwargs):
        super().__init__(**kwargs)
        self.episodes = episodes
        self._finished: set[int] = set()  # id() of the ended episodes in flight whose environment end has run

    def _check(self, runner) -> None:
        """The runner must be this one's `EpisodeRunner` (its engine's streaming API is checked by `advance`)."""
        if runner is not self.episodes:
            raise ValueError("rollout.partial: the episodes in flight belong to another runner")

    @staticmethod
    def _started(sample: Episode) -> bool:
        return sample.started

    def _over_budget(self, sample: Episode, cap: int) -> bool:
        """As `PartialRollouts._over_budget`, and with more turns than a resumed job's smaller
        `rollout.max_turns` allows: done with more, or running with no turn left."""
        used, turns = len(sample.response_ids) + len(sample.pending_ids), len(sample.turn_starts)
        max_turns = self.episodes.limits.max_turns
        return used > cap or turns > max_turns or (not sample.done and (used >= cap or turns >= max_turns))

    def _kind(self) -> dict:
        """Episodes, with the tools and environment classes they offer (a carried prompt lists them)."""
        env = self.episodes.environment
        return {"kind": "episodes", "tools": [t.name for t in self.episodes.tools],
                "environment": sorted(f"{route}: {name}" if route is not None else name
                                      for route, name in env.names.items()) if env is not None else []}

    def _restart(self, runner, stale: list[tuple[InFlightGroup, int]]) -> None:
        """Re-start the episodes `stale` from their prompts: their instances closed, new ones opened."""
        if not stale:
            return
        self.episodes.abandon([g.samples[i] for g, i in stale if not g.samples[i].done])
        for (group, i), episode in zip(stale, self.episodes.open([g.record for g, _ in stale])):
            self._finished.discard(id(group.samples[i]))
            group.samples[i] = episode

    def _new_groups(self, runner, records: Sequence[Any]) -> list[InFlightGroup]:
        """A group of G episodes per record, opened together (with an environment, G instances each)."""
        opened = self.episodes.open([record for record in records for _ in range(self.group_size)])
        g = self.group_size
        return [InFlightGroup(record, opened[k * g:(k + 1) * g]) for k, record in enumerate(records)]

    def _advance(self, runner, generator: torch.Generator, policy_version: int) -> None:
        """Advance every episode in flight until B groups are complete, then finish (environment) the episodes
        that ended in this rollout. On an error, every instance in flight is closed before it goes on."""
        groups = self.groups
        flat = [e for g in groups for e in g.samples]
        try:
            self.episodes.advance(flat, generator, until=lambda: sum(g.complete for g in groups) >= self.batch_size)
        except BaseException:
            self.episodes.abandon([e for e in flat if id(e) not in self._finished])
            raise
        ended = [e for e in flat if e.done and id(e) not in self._finished]
        self.episodes.end(ended)
        self._finished.update(id(e) for e in ended)

    def _scored(self, runner, groups: list[InFlightGroup], policy_version: int,
                timings: dict[str, float]) -> Experience:
        """The episodes of `groups` scored (`EpisodeRunner.scored`), tagged with the rollout's `policy_version`."""
        episodes = [e for g in groups for e in g.samples]
        for e in episodes:
            self._finished.discard(id(e))
        experience = self.episodes.scored(episodes, [g.record for g in groups for _ in g.samples], timings)
        return dataclasses.replace(experience, policy_version=policy_version)

    def close(self) -> None:
        """The end of training with episodes in flight: their environment instances are closed (`close` of each;
        the episodes themselves stay, as a checkpoint saved them)."""
        running = [e for g in self.groups for e in g.samples if id(e) not in self._finished]
        self.episodes.abandon(running)
        self._finished.update(id(e) for e in running)

    @staticmethod
    def _sample_state(sample: Episode) -> dict:
        """The episode as plain data (its tools and instance key left out: `_load_samples` finds them again)."""
        state = {name: getattr(sample, name) for name in _SAVED_FIELDS}
        state["messages"] = [dict(m) for m in sample.messages]
        state.update({name: [[key, count] for key, count in getattr(sample, name).items()] for name in _COUNTERS})
        return state

    def _load_samples(self, record: Any, states: Sequence[dict]) -> list[Episode]:
        """The episodes saved as `states`: the tools each offers, and, with an environment, the instances of
        those still running re-created and replayed (module docstring)."""
        episodes = []
        for state in states:
            e = Episode(**{name: state[name] for name in _SAVED_FIELDS})
            for name in _COUNTERS:
                setattr(e, name, Counter({key: count for key, count in state[name]}))
            episodes.append(e)
        finished = [e for e in episodes if e.done]  # their environment's end ran before the checkpoint
        self.episodes.restore(episodes, record)
        self._finished.update(id(e) for e in finished)
        return episodes
