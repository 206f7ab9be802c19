"""The trajectory: what one sample of a rollout is, token by token, and the padded batch of them the train types
learn from (`Experience`).

A `Trajectory` (after OpenRLHF's Experience and Tinker's token-level episodes) holds every token id of one episode:
the prompt, then its response, which in a multi-turn episode interleaves the policy's turns with the tokens a tool or
environment inserted between them. Per response token it carries the loss mask (True: sampled by the policy and
trained on; False: tool, environment or template tokens), the behaviour log-prob and the `policy_version` of the
weights that sampled it (a sequence continued across a weight sync spans versions), and per episode its reward(s)
and metadata (the decoded text, the offsets where turns start). The attention mask is not the loss mask: every
token of a trajectory is real and attended to.

`Experience` is a batch of trajectories in the layout of `astrai.data.sequences.Sequences` (left-padded prompts,
right-padded responses; `action_mask` the loss mask, `attention_mask` the real tokens). A single-turn rollout builds
it straight from the engine's output (`RolloutRunner.sample`); any other producer builds trajectories and collates
them (`Experience.from_trajectories`), and `Experience.trajectories` is the inverse, exactly.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import torch
import torch.nn.functional as F

from astrai.data.sequences import Sequences, left_pad, right_pad

__all__ = ["Experience", "Trajectory", "concat_experiences", "summed_timings"]

NOT_SAMPLED = -1
"""The `policy_version` of a token no policy sampled (prompt, tool or environment tokens, padding)."""


@dataclass(frozen=True)
class Trajectory:
    """One sample of a rollout: an episode, token by token.

    Attributes:
        prompt_ids: the prompt's token ids (rendered: the chat template or raw text), P_i >= 1.
        response_ids: every token after the prompt, T_i >= 1: the policy's turns and, between them, the tokens tools
            or the environment inserted.
        loss_mask: per response token, True where the policy sampled it (trained on), False elsewhere.
        logprobs: per response token, the behaviour log-prob (nats) at sampling; 0.0 where `loss_mask` is False.
        policy_versions: per response token, the `policy_version` that sampled it; -1 where `loss_mask` is False.
        score: the scalar reward of the episode (the weighted sum of its reward functions, and any environment
            reward).
        text: the response decoded for the reward functions (special tokens skipped).
        reward_components: reward function name -> its value (None: does not apply to this sample).
        reward_failed: reward function name -> whether its call failed for this sample.
        turn_starts: the offsets into `response_ids` where each turn of the policy starts ((0,) for one turn).
        metadata: anything else the producer attaches (an environment's info, the prompt record's index ...).
        messages: a multi-turn episode's new messages ([{"role", "content", ...}, ...]: the completion the reward
            functions received), None for a single-turn sample (its completion is `text`).

    Raises:
        ValueError: from construction, when the per-token fields differ in length from `response_ids`, a prompt or
            response is empty, or a token outside the loss mask carries a log-prob or a version.
    """

    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    loss_mask: tuple[bool, ...]
    logprobs: tuple[float, ...]
    policy_versions: tuple[int, ...]
    score: float = 0.0
    text: str = ""
    reward_components: Mapping[str, Optional[float]] = field(default_factory=dict)
    reward_failed: Mapping[str, bool] = field(default_factory=dict)
    turn_starts: tuple[int, ...] = (0,)
    metadata: Mapping[str, Any] = field(default_factory=dict)
    messages: Optional[Sequence[Mapping[str, Any]]] = None

    def __post_init__(self):
        n = len(self.response_ids)
        if not self.prompt_ids or not n:
            raise ValueError(f"Trajectory: empty prompt or response ({len(self.prompt_ids)} and {n} tokens)")
        for name in ("loss_mask", "logprobs", "policy_versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"Trajectory.{name}: {len(getattr(self, name))} values for {n} response tokens")
        for t, sampled in enumerate(self.loss_mask):
            if not sampled and (self.logprobs[t] != 0.0 or self.policy_versions[t] != NOT_SAMPLED):
                raise ValueError(f"Trajectory: response token {t} is not sampled (loss_mask False) but carries a "
                                 f"log-prob {self.logprobs[t]} or a version {self.policy_versions[t]}")

    @property
    def num_actions(self) -> int:
        """How many response tokens the policy sampled."""
        return sum(self.loss_mask)


def _uniform_versions(action_mask: torch.Tensor, policy_version: int) -> torch.Tensor:
    """(B, T) int64: `policy_version` at the action tokens, -1 elsewhere."""
    return torch.where(action_mask.bool(), policy_version, NOT_SAMPLED).to(torch.long)


@dataclass(frozen=True)
class Experience:
    """A batch of trajectories with their scores, before any train-type specific targets.

    Attributes:
        sequences: prompt + response model inputs; `action_mask` (B, T) the loss mask, `response_mask` the real
            response tokens.
        old_logprobs: (B, T) float32 sampler-aligned behaviour log-probs, 0 outside the action mask.
        ref_logprobs: (B, T) float32 reference log-probs, or None when no reference model is used.
        scores: (B,) float32 task rewards.
        responses: decoded responses (B strings, special tokens skipped).
        policy_version: the version the batch was collected at, which trains on it first: the weights that
            finished it (every token's, for a synchronous rollout), or, one step off, the version after the one
            that sampled it ahead (`policy_versions` has each token's; the difference is the staleness).
        timings: wall seconds of the phases that produced it, by phase name (e.g. "generate", "reference").
        stats: how it was collected, by name (e.g. "sampling_rounds"), logged as `rollout/<name>`.
        reward_components: reward function name -> (B,) float32 values (NaN where it does not apply).
        reward_failed: reward function name -> (B,) bool, the samples whose reward call failed.
        policy_versions: (B, T) int64, the version that sampled each action token (-1 elsewhere); None at
            construction means every action token was sampled by `policy_version`.
        turn_starts: per sample, the offsets where the policy's turns start in its response ((0,) each, single turn).
        messages: per sample, a multi-turn episode's new messages (the completion the reward functions received;
            `Trajectory.messages`), None for a single-turn sample; None altogether: no sample has them.
        routes: per sample, the route of the teacher that scores it when several teachers are routed by a data
            column (`distill.teachers`: its prompt record's value, `astrai.experience.teachers.route_of`; the G
            samples of a prompt share it); None: not routed.
    """

    sequences: Sequences
    old_logprobs: torch.Tensor
    ref_logprobs: Optional[torch.Tensor]
    scores: torch.Tensor
    responses: tuple[str, ...]
    policy_version: int
    timings: dict[str, float] = field(default_factory=dict)
    stats: dict[str, float] = field(default_factory=dict)
    reward_components: dict[str, torch.Tensor] = field(default_factory=dict)
    reward_failed: dict[str, torch.Tensor] = field(default_factory=dict)
    policy_versions: Optional[torch.Tensor] = None
    turn_starts: Optional[tuple[tuple[int, ...], ...]] = None
    messages: Optional[tuple[Optional[Sequence[Mapping[str, Any]]], ...]] = None
    routes: Optional[tuple[str, ...]] = None

    def __post_init__(self):
        if self.policy_versions is None:
            object.__setattr__(self, "policy_versions",
                               _uniform_versions(self.sequences.action_mask, self.policy_version))
        if self.turn_starts is None:
            object.__setattr__(self, "turn_starts", ((0,),) * len(self.responses))

    def __len__(self) -> int:
        return len(self.responses)

    def select(self, rows: Sequence[int]) -> "Experience":
        """The samples at `rows` (indices into B, in that order), with the same widths P and T, timings and stats."""
        index = torch.as_tensor(list(rows), dtype=torch.long, device=self.scores.device)
        return dataclasses.replace(
            self, sequences=self.sequences.select(index), old_logprobs=self.old_logprobs[index],
            ref_logprobs=None if self.ref_logprobs is None else self.ref_logprobs[index], scores=self.scores[index],
            responses=tuple(self.responses[i] for i in rows),
            reward_components={k: v[index.cpu()] for k, v in self.reward_components.items()},
            reward_failed={k: v[index.cpu()] for k, v in self.reward_failed.items()},
            policy_versions=self.policy_versions[index], turn_starts=tuple(self.turn_starts[i] for i in rows),
            messages=None if self.messages is None else tuple(self.messages[i] for i in rows),
            routes=None if self.routes is None else tuple(self.routes[i] for i in rows))

    def trajectories(self) -> list[Trajectory]:
        """The batch's samples as trajectories (padding dropped); `from_trajectories` of them rebuilds this batch
        exactly (reference log-probs, timings, stats and teacher routes aside)."""
        seq = self.sequences
        prompt_mask = seq.attention_mask[:, :seq.prompt_length].bool().cpu()
        response_mask, actions = seq.response_mask.cpu(), seq.action_mask.bool().cpu()
        ids, logprobs, versions = seq.input_ids.cpu(), self.old_logprobs.cpu(), self.policy_versions.cpu()
        out = []
        for b in range(len(self)):
            real = response_mask[b]
            components = {k: (None if torch.isnan(v[b]) else float(v[b])) for k, v in self.reward_components.items()}
            out.append(Trajectory(
                prompt_ids=tuple(ids[b, :seq.prompt_length][prompt_mask[b]].tolist()),
                response_ids=tuple(ids[b, seq.prompt_length:][real].tolist()),
                loss_mask=tuple(actions[b][real].tolist()), logprobs=tuple(logprobs[b][real].tolist()),
                policy_versions=tuple(versions[b][real].tolist()), score=float(self.scores[b]),
                text=self.responses[b], reward_components=components,
                reward_failed={k: bool(v[b]) for k, v in self.reward_failed.items()},
                turn_starts=self.turn_starts[b], messages=None if self.messages is None else self.messages[b]))
        return out

    @classmethod
    def from_trajectories(cls, trajectories: Sequence[Trajectory], *, pad_token_id: int,
                          device: torch.device | str = "cpu", timings: Optional[dict[str, float]] = None,
                          stats: Optional[dict[str, float]] = None) -> "Experience":
        """Collate trajectories into a batch: prompts left-padded and responses right-padded with `pad_token_id`,
        `action_mask` from each loss mask, `attention_mask` True at every token of a trajectory, per-token
        log-probs (float32) and versions (int64) right-padded with 0 and -1; `policy_version` the newest version
        any token carries. A reward function that some trajectory lacks is NaN there (does not apply).

        Raises:
            ValueError: for no trajectories, or trajectories with different reward functions.
        """
        if not trajectories:
            raise ValueError("Experience.from_trajectories: no trajectories")
        names = list(trajectories[0].reward_components)
        if any(list(t.reward_components) != names for t in trajectories):
            raise ValueError("Experience.from_trajectories: trajectories scored by different reward functions")
        prompt_ids, prompt_mask = left_pad([t.prompt_ids for t in trajectories], pad_token_id, device)
        response_ids, response_mask = right_pad([t.response_ids for t in trajectories], pad_token_id, device)
        width = response_ids.shape[1]

        def per_token(name: str, dtype: torch.dtype, pad) -> torch.Tensor:
            rows = [list(getattr(t, name)) + [pad] * (width - len(t.response_ids)) for t in trajectories]
            return torch.tensor(rows, dtype=dtype, device=device)

        action_mask = per_token("loss_mask", torch.bool, False)
        versions = per_token("policy_versions", torch.long, NOT_SAMPLED)
        nan = float("nan")
        return cls(sequences=Sequences.from_padded(prompt_ids, prompt_mask, response_ids, action_mask, response_mask),
                   old_logprobs=per_token("logprobs", torch.float32, 0.0), ref_logprobs=None,
                   scores=torch.tensor([t.score for t in trajectories], dtype=torch.float32, device=device),
                   responses=tuple(t.text for t in trajectories), policy_version=int(versions.max()),
                   timings=dict(timings or {}), stats=dict(stats or {}),
                   reward_components={k: torch.tensor([nan if t.reward_components[k] is None
                                                       else t.reward_components[k] for t in trajectories],
                                                      dtype=torch.float32) for k in names},
                   reward_failed={k: torch.tensor([bool(t.reward_failed.get(k, False)) for t in trajectories])
                                  for k in trajectories[0].reward_failed},
                   policy_versions=versions, turn_starts=tuple(t.turn_starts for t in trajectories),
                   messages=(None if all(t.messages is None for t in trajectories)
                             else tuple(t.messages for t in trajectories)))


def concat_experiences(parts: Sequence[Experience], pad_token_id: int) -> Experience:
    """The samples of `parts` (same `policy_version`) as one batch, in order: prompts re-left-padded and responses
    re-right-padded to the widest part (`Sequences.concat`), per-token tensors (B_i, T_i) right-padded (0, and -1 for
    the versions), the timings of the phases summed. Its stats are empty (the caller sets them).

    Raises:
        ValueError: for no parts, parts of different policy versions, or some parts with reference log-probs (or
            teacher routes) and some without.
    """
    if not parts:
        raise ValueError("concat_experiences: no parts")
    versions = {p.policy_version for p in parts}
    if len(versions) != 1:
        raise ValueError(f"concat_experiences: parts of several policy versions {sorted(versions)}")
    if len({p.ref_logprobs is None for p in parts}) != 1:
        raise ValueError("concat_experiences: some parts have ref_logprobs and some do not")
    if len({p.routes is None for p in parts}) != 1:
        raise ValueError("concat_experiences: some parts have teacher routes and some do not")
    width = max(p.old_logprobs.shape[1] for p in parts)

    def per_token(tensors, value=0):
        return torch.cat([F.pad(t, (0, width - t.shape[1]), value=value) for t in tensors])

    return Experience(sequences=Sequences.concat([p.sequences for p in parts], pad_token_id),
                      old_logprobs=per_token([p.old_logprobs for p in parts]),
                      ref_logprobs=(None if parts[0].ref_logprobs is None
                                    else per_token([p.ref_logprobs for p in parts])),
                      scores=torch.cat([p.scores for p in parts]),
                      responses=tuple(r for p in parts for r in p.responses),
                      policy_version=parts[0].policy_version, timings=summed_timings(parts),
                      reward_components={k: torch.cat([p.reward_components[k] for p in parts])
                                         for k in parts[0].reward_components},
                      reward_failed={k: torch.cat([p.reward_failed[k] for p in parts]) for k in parts[0].reward_failed},
                      policy_versions=per_token([p.policy_versions for p in parts], NOT_SAMPLED),
                      turn_starts=tuple(s for p in parts for s in p.turn_starts),
                      messages=(None if all(p.messages is None for p in parts) else
                                tuple(m for p in parts for m in (p.messages or (None,) * len(p)))),
                      routes=None if parts[0].routes is None else tuple(r for p in parts for r in p.routes))


def summed_timings(experiences: Sequence[Experience]) -> dict[str, float]:
    """The wall seconds of each phase summed over `experiences` (phases in first-seen order)."""
    timings: dict[str, float] = {}
    for experience in experiences:
        for phase, seconds in experience.timings.items():
            timings[phase] = timings.get(phase, 0.0) + seconds
    return timings
