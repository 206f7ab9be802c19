"""RolloutRunner: prompts -> token ids -> engine samples -> decoded responses -> scores (+ reference log-probs).

Shared by the online train types; the strategy adds what is specific to it (critic values, GAE for PPO;
group advantages for GRPO).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from astrai.data.sequences import Sequences
from astrai.rollout.sampling import SamplingParams
from astrai.forward import response_logprobs, score_in_chunks

ScoreFn = Callable[[list[str], list[Any], list[list[int]]], Any]
"""(responses, targets, response_ids) -> scores (B,) float32, or a `reward_functions.ScoredRewards` (its `total`
and per-function values). `targets` are what the caller passed per sample (answers, prompt records ...)."""


@dataclass(frozen=True)
class Experience:
    """Sampled responses with their scores, before any train-type specific targets.

    Attributes:
        sequences: prompt + response model inputs, `action_mask` (B, T).
        old_logprobs: (B, T) float32 sampler-aligned behaviour log-probs.
        ref_logprobs: (B, T) float32 reference log-probs, or None when no reference model is used.
        scores: (B,) float32 task rewards.
        responses: decoded responses (B strings, special tokens skipped).
        policy_version: version of the weights that sampled.
        timings: wall seconds of the phases that produced it, by phase name (e.g. "generate", "reference").
        stats: how it was collected, by name (e.g. "sampling_rounds"), logged as `rollout/<name>`.
        reward_components: reward function name -> (B,) float32 values (NaN where it does not apply).
        reward_failed: reward function name -> (B,) bool, the samples whose reward call failed.
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

    def select(self, rows: Sequence[int]) -> "Experience":
        """The samples at `rows` (indices into B, in that order), with the same widths P and T, timings and stats."""
        index = torch.as_tensor(list(rows), dtype=torch.long, device=self.scores.device)
        return dataclasses.replace(
            self, sequences=self.sequences.select(index), old_logprobs=self.old_logprobs[index],
            ref_logprobs=None if self.ref_logprobs is None else self.ref_logprobs[index], scores=self.scores[index],
            responses=tuple(self.responses[i] for i in rows),
            reward_components={k: v[index.cpu()] for k, v in self.reward_components.items()},
            reward_failed={k: v[index.cpu()] for k, v in self.reward_failed.items()})


def concat_experiences(parts: Sequence[Experience], pad_token_id: int) -> Experience:
    """The samples of `parts` (same `policy_version`) as one batch, in order: prompts re-left-padded and responses
    re-right-padded to the widest part (`Sequences.concat`), per-token tensors (B_i, T_i) right-padded with 0, the
    timings of the phases summed. Its stats are empty (the caller sets them).

    Raises:
        ValueError: for no parts, parts of different policy versions, or some parts with reference log-probs and
            some without.
    """
    if not parts:
        raise ValueError("concat_experiences: no parts")
    versions = {p.policy_version for p in parts}
    if len(versions) != 1:
        raise ValueError(f"concat_experiences: parts of several policy versions {sorted(versions)}")
    if len({p.ref_logprobs is None for p in parts}) != 1:
        raise ValueError("concat_experiences: some parts have ref_logprobs and some do not")
    width = max(p.old_logprobs.shape[1] for p in parts)

    def per_token(tensors):
        return torch.cat([F.pad(t, (0, width - t.shape[1])) for t in tensors])

    return Experience(sequences=Sequences.concat([p.sequences for p in parts], pad_token_id),
                      old_logprobs=per_token([p.old_logprobs for p in parts]),
                      ref_logprobs=(None if parts[0].ref_logprobs is None
                                    else per_token([p.ref_logprobs for p in parts])),
                      scores=torch.cat([p.scores for p in parts]),
                      responses=tuple(r for p in parts for r in p.responses),
                      policy_version=parts[0].policy_version, timings=summed_timings(parts),
                      reward_components={k: torch.cat([p.reward_components[k] for p in parts])
                                         for k in parts[0].reward_components},
                      reward_failed={k: torch.cat([p.reward_failed[k] for p in parts]) for k in parts[0].reward_failed})


def summed_timings(experiences: Sequence[Experience]) -> dict[str, float]:
    """The wall seconds of each phase summed over `experiences` (phases in first-seen order)."""
    timings: dict[str, float] = {}
    for experience in experiences:
        for phase, seconds in experience.timings.items():
            timings[phase] = timings.get(phase, 0.0) + seconds
    return timings


class RolloutRunner:
    """Turns prompt token ids into scored `Experience` with the colocated engine.

    Args:
        engine: a `GenerationEngine` (`astrai.rollout.engine`); its weights are synced by the caller.
        sampling: sampling settings (temperature is also used to score, docs/conventions.md section 2).
        decode: token ids -> text (special tokens skipped).
        score_fn: the reward, see `ScoreFn`.
        ref_model: frozen reference policy, or None.
        chunk_size: rows per no-grad scoring forward.
    """

    def __init__(self, engine, sampling: SamplingParams, *,
                 decode: Callable[[list[int]], str], score_fn: ScoreFn,
                 ref_model: Optional[torch.nn.Module] = None, chunk_size: int = 8):
        self.engine = engine
        self.sampling = sampling
        self.decode = decode
        self.score_fn = score_fn
        self.ref_model = ref_model
        self.chunk_size = chunk_size

    def collect(self, prompt_ids: Sequence[Sequence[int]], answers: Sequence[Any],
                generator: Optional[torch.Generator] = None) -> Experience:
        """Sample one response per prompt, decode, score (`sample`), and compute reference log-probs
        (`add_reference`).

        Raises:
            ValueError: as `sample`.
        """
        return self.add_reference(self.sample(prompt_ids, answers, generator))

    def sample(self, prompt_ids: Sequence[Sequence[int]], answers: Sequence[Any],
               generator: Optional[torch.Generator] = None) -> Experience:
        """Sample one response per prompt, decode and score it; `ref_logprobs` stay None (`add_reference`).
        `answers` are the score function's per-sample targets (reference answers, or the prompt records).

        Raises:
            ValueError: when `prompt_ids` and `answers` differ in length, or the score function returns a
                tensor of the wrong shape or with non-finite values.
        """
        if len(prompt_ids) != len(answers):
            raise ValueError(f"collect: {len(prompt_ids)} prompts but {len(answers)} answers")
        start = time.perf_counter()
        generation = self.engine.generate(prompt_ids, self.sampling, generator)
        timings = {"generate": time.perf_counter() - start}
        sequences = generation.sequences()
        response_ids = [row[mask].tolist() for row, mask in
                        zip(generation.response_ids.cpu(), generation.action_mask.cpu())]
        responses = tuple(self.decode(ids) for ids in response_ids)
        start = time.perf_counter()
        scored = self.score_fn(list(responses), list(answers), response_ids)
        timings["reward"] = time.perf_counter() - start
        components, failed = getattr(scored, "components", {}), getattr(scored, "failed", {})
        scores = torch.as_tensor(getattr(scored, "total", scored), dtype=torch.float32)
        if scores.shape != (len(answers),) or not bool(torch.isfinite(scores).all()):
            raise ValueError(f"reward: expected {len(answers)} finite scores, got {tuple(scores.shape)}")
        return Experience(sequences=sequences, old_logprobs=generation.old_logprobs, ref_logprobs=None,
                          scores=scores.to(generation.old_logprobs.device), responses=responses,
                          policy_version=generation.policy_version, timings=timings,
                          reward_components=dict(components), reward_failed=dict(failed))

    def add_reference(self, experience: Experience) -> Experience:
        """`experience` with the reference model's log-probs (B, T) float32 of its responses at the sampling
        temperature, scored `chunk_size` rows per no-grad forward (timing "reference"); unchanged without a
        reference model."""
        if self.ref_model is None:
            return experience
        start = time.perf_counter()
        ref_logprobs = score_in_chunks(
            lambda chunk: response_logprobs(self.ref_model, chunk, temperature=self.sampling.temperature)[0],
            experience.sequences, self.chunk_size)
        timings = {**experience.timings, "reference": time.perf_counter() - start}
        return dataclasses.replace(experience, ref_logprobs=ref_logprobs, timings=timings)
