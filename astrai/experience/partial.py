"""Partial rollouts on the colocated engine (`rollout.partial`): no rollout waits for its longest response.

A synchronous rollout decodes until the longest of its B * G responses ends, so with long-tailed lengths most of
its decode steps run a few rows while the rest wait. A partial rollout (Kimi k1.5's partial rollouts, verl's
`colocate_async`, OpenRLHF's `partial_rollout_enable`) keeps more groups in flight than it needs
(`rollout.generation_batch_size`, default 2 B) and drives the engine one decode step at a time through its streaming
API (`add_request` / `step` / `abort`, `astrai.rollout.engine.StreamingEngine`); as soon as B groups are complete
(every one of their G samples ended with a stop token or at `rollout.max_new_tokens`) it aborts the rest. The
unfinished samples keep their tokens, their per-token behaviour log-probs and the per-token `policy_version` of the
weights that sampled them, and continue in the next rollout under the new weights. Groups stay whole: a rollout
trains on complete groups only (GRPO's statistics over a group need all G rewards); a group whose samples are partly
done waits, with its done samples, for the others.

Re-prefill, never stale KV: a continued sample is sent again as a new request whose prompt is its prompt + its
partial response, after the weight sync, so its keys and values are recomputed by the new weights. The engine keeps
no KV across rollouts: `load_weights` ends the streaming session and clears the prefix cache (whose blocks are also
tagged with the version that wrote them), and `sleep` after every rollout clears it again.

Staleness (DESIGN.md section 4): a token sampled by version v' and trained on at version v has lag v - v'; a sample's
staleness is the lag of its oldest token. `rollout.max_off_policy_steps` K bounds it: a carried sample whose
staleness would exceed K is re-generated from its prompt at the start of the rollout (dropping it instead biases the
batch toward prompts with short answers: tinker-cookbook PR #822). The loss then corrects for the mixture of
behaviour policies with `rollout.correction` (required with partial rollouts): the trainer rescores every token with
the weights being trained (the proximal policy) and weights each token by the truncated ratio of that to the
engine's per-token behaviour log-prob, the decoupled PPO objective of Hilton et al. 2022 ("Batch size-invariance for
policy optimization", section 3) with truncated importance sampling (Yao et al. 2025).

At a token budget: `rollout.max_new_tokens` caps a response over all the rollouts it spans (a continued sample may
add only the tokens its response has left), so every sample ends within a bounded number of decode steps and every
group completes; a response cut there counts in `rollout/truncated_fraction` as in a synchronous rollout. At the end
of training the samples still in flight are not trained on (their decode time is lost); checkpoints save them with
the learner's state, so a resumed job continues them exactly.

Over several processes each data-parallel rank runs its own partial rollouts on its share of the prompts and keeps
its own groups in flight (saved per rank). Multi-turn episodes (`rollout.tools`, `rollout.environment`) are carried
the same way, mid-turn or between turns (`astrai.experience.partial_episodes`). What it simplifies: no
tensor-parallel engine, no dynamic sampling.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from astrai.experience.trajectory import Experience, Trajectory
from astrai.rollout.engine import StreamingEngine
from astrai.rollout.row_sampling import draw_base_seed

__all__ = ["InFlightGroup", "InFlightSample", "LAG_METRICS", "PartialRollouts",
           "staleness_stats"]

LAG_METRICS = 8
"""The largest lag k with its own `staleness/lag_k` metric (a larger bound would log a metric per version)."""


@dataclass
class InFlightSample:
    """One sample of a group in flight: what it has sampled so far.

    Attributes:
        response_ids: its response tokens so far (the stop token included once it ended with one).
        logprobs: per token, the behaviour log-prob (nats, float32 values) the engine sampled it with.
        policy_versions: per token, the `policy_version` of the weights that sampled it.
        done: it ended (a stop token, or `max_new_tokens` over all its rollouts).
    """

    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    policy_versions: list[int] = field(default_factory=list)
    done: bool = False

    def staleness(self, policy_version: int) -> int:
        """`policy_version` minus the version of its oldest token (0 with no tokens)."""
        return policy_version - min(self.policy_versions) if self.policy_versions else 0


@dataclass
class InFlightGroup:
    """The G samples of one prompt record, in flight until all are done.

    Attributes:
        record: the prompt record (its `prompt_ids`; the reward's target).
        samples: its G samples.
    """

    record: Any
    samples: list[InFlightSample]

    @property
    def complete(self) -> bool:
        """Every sample is done."""
        return all(s.done for s in self.samples)


def _described(kind: dict) -> str:
    """A saved kind of sample (`PartialRollouts._kind`) in words."""
    if kind["kind"] == "samples":
        return "single answers"
    return (f"episodes offering the tools {kind.get('tools', [])}"
            + (f" and the environment {kind['environment']}" if kind.get("environment") else ""))


def staleness_stats(policy_versions: torch.Tensor, action_mask: torch.Tensor, policy_version: int,
                    max_lag: int) -> dict[str, float]:
    """Staleness of a batch trained at `policy_version` (DESIGN.md section 4).

    Args:
        policy_versions: (B, T) int64, the version that sampled each action token (-1 elsewhere).
        action_mask: (B, T) bool, the action tokens (each row has one at least).
        policy_version: the version the batch is trained at (the weights of the rollout).
        max_lag: the largest lag reported per token (`rollout.max_off_policy_steps`; at most `LAG_METRICS`).

    Returns:
        `staleness_mean` and `staleness_max` (over samples, a sample's staleness being `policy_version` minus its
        oldest token's version), and `staleness/lag_k` for k in 0..min(max_lag, LAG_METRICS): the share of action
        tokens sampled k versions before `policy_version` (they sum to 1 when no token lags more).
    """
    mask = action_mask.bool()
    lags = torch.where(mask, policy_version - policy_versions, torch.zeros_like(policy_versions))
    per_sample = lags.amax(dim=1).double()
    real = lags[mask]
    top = min(max_lag, LAG_METRICS)
    stats = {"staleness_mean": float(per_sample.mean()), "staleness_max": float(per_sample.max())}
    counts = torch.bincount(real.clamp(min=0, max=top + 1), minlength=top + 2).double() / max(real.numel(), 1)
    stats.update({f"staleness/lag_{k}": float(counts[k]) for k in range(top + 1)})
    return stats


class PartialRollouts:
    """The groups in flight between rollouts, and the partial rollout that advances them (module docstring).

    Args:
        batch_size: B, the complete groups a rollout returns.
        group_size: G, samples per prompt.
        in_flight: groups kept in flight per rollout (> B): the carried ones, topped up with new prompts.
        max_off_policy_steps: K >= 1, the largest staleness a trained sample may have.

    Raises:
        ValueError: for B, G < 1, `in_flight` <= B or K < 1.
    """

    def __init__(self, *, batch_size: int, group_size: int, in_flight: int, max_off_policy_steps: int):
        if batch_size < 1 or group_size < 1:
            raise ValueError(f"PartialRollouts: batch_size and group_size must be >= 1, got {batch_size}, {group_size}")
        if in_flight <= batch_size:
            raise ValueError(f"rollout.generation_batch_size: with rollout.partial, the groups in flight must exceed "
                             f"rollout.batch_size {batch_size}, got {in_flight}")
        if max_off_policy_steps < 1:
            raise ValueError(f"rollout.max_off_policy_steps: rollout.partial needs >= 1, got {max_off_policy_steps}")
        self.batch_size, self.group_size, self.in_flight = batch_size, group_size, in_flight
        self.max_off_policy_steps = max_off_policy_steps
        self.groups: list[InFlightGroup] = []

    def collect(self, runner, sampler, generator: torch.Generator, policy_version: int) -> Experience:
        """B complete groups (B * G scored samples, each group's G contiguous, `ref_logprobs` None) of the weights
        of `policy_version`, which the engine holds (awake): re-generate the carried samples past the staleness
        bound, top the groups in flight up to `in_flight` with the sampler's next records, decode until B groups
        are complete (`decode`), and score them with `runner`'s decode and score functions. Its `policy_versions`
        are per token; `policy_version` is the rollout's. Stats: `truncated_fraction`, `staleness_stats`,
        `carried_samples` (samples that entered with tokens of an earlier rollout, after the bound),
        `regenerated_samples` (those the bound re-started, and those a smaller `rollout.max_new_tokens` of a
        resumed job no longer fits), `groups_in_flight` (left for the next rollout).

        Raises:
            ValueError: an engine without the streaming API, or a bad score (as `RolloutRunner.sample`).
            FloatingPointError: non-finite logits in the sampler.
        """
        self._check(runner)
        cap = runner.sampling.max_new_tokens
        stale = [(group, i) for group in self.groups for i, sample in enumerate(group.samples)
                 if self._started(sample) and (sample.staleness(policy_version) > self.max_off_policy_steps
                                               or self._over_budget(sample, cap))]
        self._restart(runner, stale)
        carried = sum(1 for g in self.groups for s in g.samples if self._started(s))
        missing = self.in_flight - len(self.groups)
        if missing > 0:
            self.groups += self._new_groups(runner, sampler.next_batch(missing))
        start = time.perf_counter()
        runner.generate_agreed(lambda: self._advance(runner, generator, policy_version))
        timings = {"generate": time.perf_counter() - start}
        chosen = [g for g in self.groups if g.complete][:self.batch_size]
        if len(chosen) < self.batch_size:  # every sample ends by max_new_tokens: only a broken engine gets here
            raise RuntimeError(f"rollout.partial: the engine stopped with {len(chosen)} of {self.batch_size} groups "
                               "complete")
        self.groups = [g for g in self.groups if not any(g is c for c in chosen)]
        experience = self._scored(runner, chosen, policy_version, timings)
        experience = runner.count_truncated(experience)
        experience.stats.update(staleness_stats(experience.policy_versions, experience.sequences.action_mask,
                                                policy_version, self.max_off_policy_steps))
        experience.stats.update(carried_samples=float(carried), regenerated_samples=float(len(stale)),
                                groups_in_flight=float(len(self.groups)))
        return experience

    # The kind of sample: single-turn here (`InFlightSample`); multi-turn episodes override these
    # (`astrai.experience.partial_episodes.PartialEpisodes`).
    def _check(self, runner) -> None:
        """Refuse a runner whose engine has no streaming API (ValueError)."""
        if not isinstance(runner.engine, StreamingEngine):
            raise ValueError(f"rollout.partial: the engine ({type(runner.engine).__name__}) has no streaming API "
                             "(add_request / step / abort); use rollout.engine paged")

    @staticmethod
    def _started(sample) -> bool:
        """Whether `sample` holds sampled tokens."""
        return bool(sample.response_ids)

    @staticmethod
    def _over_budget(sample, cap: int) -> bool:
        """Whether `sample` (carried from a job with a larger `rollout.max_new_tokens`) no longer fits `cap`: done
        with more tokens, or running with no token left."""
        return len(sample.response_ids) > cap or (not sample.done and len(sample.response_ids) >= cap)

    def _restart(self, runner, stale: list[tuple[InFlightGroup, int]]) -> None:
        """Re-start the samples `stale` ((group, index) pairs) from their prompts."""
        for group, i in stale:
            group.samples[i] = InFlightSample()

    def _new_groups(self, runner, records: Sequence[Any]) -> list[InFlightGroup]:
        """A new group of G unstarted samples per record."""
        return [InFlightGroup(record, [InFlightSample() for _ in range(self.group_size)]) for record in records]

    def _advance(self, runner, generator: torch.Generator, policy_version: int) -> None:
        """Decode the groups in flight until B are complete (`decode`)."""
        self.decode(runner.engine, runner.sampling, generator, policy_version)

    @torch.no_grad()
    def decode(self, engine, sampling, generator: torch.Generator, policy_version: int) -> None:
        """Advance the groups in flight on `engine` (awake, holding `policy_version`) until B of them are complete:
        per group, its samples with no tokens as one request of n choices of the prompt, each continued sample as
        its own request of its prompt + partial response (re-prefilled) with the tokens its response has left; one
        seed per request drawn from `generator`. Then every request still live is aborted; the samples keep what
        they sampled. The tokens of this rollout are tagged `policy_version`."""
        cap = sampling.max_new_tokens
        live: dict[tuple[int, int], tuple[InFlightSample, InFlightGroup]] = {}
        requests: list[int] = []

        def add(prompt: Sequence[int], params, members: list[InFlightSample], group: InFlightGroup) -> None:
            seed = draw_base_seed(generator)
            request = engine.add_request(list(prompt), params, n=len(members), seed=seed)
            requests.append(request)
            for choice, sample in enumerate(members):
                live[(request, choice)] = (sample, group)

        complete = sum(g.complete for g in self.groups)
        try:
            for group in self.groups:
                if complete >= self.batch_size:
                    break
                fresh = [s for s in group.samples if not s.done and not s.response_ids]
                if fresh:
                    add(group.record.prompt_ids, sampling, fresh, group)
                for sample in group.samples:
                    if not sample.done and sample.response_ids:
                        add(list(group.record.prompt_ids) + sample.response_ids,
                            dataclasses.replace(sampling, max_new_tokens=cap - len(sample.response_ids)), [sample],
                            group)
            while complete < self.batch_size and engine.has_unfinished_requests:
                for out in engine.step():
                    sample, group = live[(out.request_id, out.choice)]
                    sample.response_ids.append(out.token_id)
                    sample.logprobs.append(out.logprob)
                    sample.policy_versions.append(policy_version)
                    if out.done:
                        sample.done = True
                        complete += group.complete
        finally:  # also on a failure (non-finite logits, a refused request): the engine must be able to sleep
            for request in requests:
                engine.abort(request)
        if engine.has_unfinished_requests:
            raise RuntimeError("rollout.partial: the engine kept requests live after they were all aborted")

    def _scored(self, runner, groups: list[InFlightGroup], policy_version: int,
                timings: dict[str, float]) -> Experience:
        """The samples of `groups` as a scored batch (`Experience.from_trajectories` on the engine's device)."""
        trajectories = [Trajectory(prompt_ids=tuple(g.record.prompt_ids), response_ids=tuple(s.response_ids),
                                   loss_mask=(True,) * len(s.response_ids), logprobs=tuple(s.logprobs),
                                   policy_versions=tuple(s.policy_versions))
                        for g in groups for s in g.samples]
        response_ids = [list(t.response_ids) for t in trajectories]
        responses = tuple(runner.decode(ids) for ids in response_ids)
        answers = [g.record for g in groups for _ in g.samples]
        start = time.perf_counter()
        scored = runner.score_fn(list(responses), answers, response_ids)
        timings["reward"] = time.perf_counter() - start
        scores = torch.as_tensor(getattr(scored, "total", scored), dtype=torch.float32)
        if scores.shape != (len(answers),) or not bool(torch.isfinite(scores).all()):
            raise ValueError(f"reward: expected {len(answers)} finite scores, got {tuple(scores.shape)}")
        batch = Experience.from_trajectories(trajectories, pad_token_id=runner.engine.pad_token_id,
                                             device=runner.engine.device, timings=timings)
        return dataclasses.replace(batch, scores=scores.to(batch.old_logprobs.device), responses=responses,
                                   policy_version=policy_version,
                                   reward_components=dict(getattr(scored, "components", {})),
                                   reward_failed=dict(getattr(scored, "failed", {})),
                                   routes=runner.routes_of(answers))  # each sample's teacher (distill.teachers)

    def state_dict(self, records: Optional[Sequence[Any]]) -> dict:
        """The groups in flight (plain lists; loadable with `torch.load(weights_only=True)`), each record saved as
        its position in `records` (the sampler's dataset).

        Raises:
            ValueError: when a record in flight is not one of `records`.
        """
        position = {id(record): i for i, record in enumerate(records or ())}
        groups = []
        for group in self.groups:
            if id(group.record) not in position:
                raise ValueError("rollout.partial: a prompt in flight is not in the sampler's dataset; its state "
                                 "cannot be saved")
            groups.append({"record": position[id(group.record)],
                           "samples": [self._sample_state(s) for s in group.samples]})
        return {"groups": groups, **self._kind()}

    def _kind(self) -> dict:
        """What the saved samples are ("samples": single answers), and what they need of the job to continue."""
        return {"kind": "samples"}

    def load_state_dict(self, state: dict, records: Sequence[Any]) -> None:
        """Inverse of `state_dict` over the same `records`. Groups saved by a job whose samples were of another
        kind (single answers / episodes, or episodes offering other tools: `rollout.tools` or
        `rollout.environment` changed) cannot continue here: they are dropped with a warning saying how many."""
        saved = {"kind": "samples", **{k: v for k, v in state.items() if k != "groups"}}
        if state["groups"] and saved != self._kind():
            warnings.warn(f"rollout.partial: the {len(state['groups'])} group(s) in flight in the checkpoint were "
                          f"sampled as {_described(saved)} and this job samples {_described(self._kind())} "
                          "(rollout.tools or rollout.environment changed): they are dropped (their prompts were "
                          "drawn and are not drawn again)", stacklevel=2)
            self.groups = []
            return
        self.groups = [InFlightGroup(records[g["record"]], self._load_samples(records[g["record"]], g["samples"]))
                       for g in state["groups"]]

    def close(self) -> None:
        """The end of training with groups still in flight (nothing to release for single answers)."""

    @staticmethod
    def _sample_state(sample: InFlightSample) -> dict:
        """`sample` as plain data."""
        return {"response_ids": list(sample.response_ids), "logprobs": list(sample.logprobs),
                "policy_versions": list(sample.policy_versions), "done": sample.done}

    def _load_samples(self, record: Any, states: Sequence[dict]) -> list:
        """The samples of `record`'s group saved as `states` (`_sample_state`)."""
        return [InFlightSample(list(s["response_ids"]), list(s["logprobs"]), list(s["policy_versions"]),
                               bool(s["done"])) for s in states]
