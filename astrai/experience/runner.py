"""RolloutRunner: prompts -> token ids -> engine samples -> decoded responses -> scores (+ reference log-probs).

Shared by the online train types; the learner adds what is specific to it (critic values, GAE for PPO;
group advantages for GRPO).
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from typing import Any, Callable, Optional, Sequence

import torch

from astrai.data.sequences import Sequences
from astrai.experience.teachers import TeacherRoutes
from astrai.experience.trajectory import Experience
from astrai.forward import response_logprobs, score_in_chunks
from astrai.rewards.workers import ScoringStopped
from astrai.rollout.sampling import SamplingParams

STOPPED_MARK = "\x00stopped\x00"
"""Marks the line of a rank whose episodes a stop request interrupted in `RolloutRunner.generate_agreed`."""

ScoreFn = Callable[[list[str], list[Any], list[list[int]]], Any]
"""(responses, targets, response_ids) -> scores (B,) float32, or a `reward_functions.ScoredRewards` (its `total`
and per-function values). `targets` are what the caller passed per sample (answers, prompt records ...)."""


class RolloutRunner:
    """Turns prompt token ids into scored `Experience` with the colocated engine.

    Args:
        engine: a `GenerationEngine` (`astrai.rollout.engine`); its weights are synced by the caller.
        sampling: sampling settings (temperature is also used to score, docs/conventions.md section 2).
        decode: token ids -> text (special tokens skipped).
        score_fn: the reward, see `ScoreFn`.
        ref_model: frozen reference policy (or the teacher of on-policy distillation in its place), or None; an
            object that is not a module scores by its own `response_logprobs(sequences) -> (B, T) float32` (a
            served teacher, `astrai.experience.served_teacher.ServedTeacher`); several teachers routed by a data
            column (`astrai.experience.teachers.TeacherRoutes`) score each sample with the teacher of its prompt
            record (`routes_of`, carried by the experience as `Experience.routes`).
        chunk_size: rows per no-grad scoring forward.
        agree: with several ranks, `agree(line or None) -> line or None` (the distributed context's
            `first_failure`): the ranks agree right after generating whether the sampler met non-finite logits
            on any of them, before scoring (which may run collectives: a sharded reward model), so that every rank
            raises together; None (one process) raises at once.
    """

    def __init__(self, engine, sampling: SamplingParams, *,
                 decode: Callable[[list[int]], str], score_fn: ScoreFn,
                 ref_model: Optional[torch.nn.Module] = None, chunk_size: int = 8,
                 agree: Optional[Callable[[Optional[str]], Optional[str]]] = None):
        self.engine = engine
        self.sampling = sampling
        self.decode = decode
        self.score_fn = score_fn
        self.ref_model = ref_model
        self.chunk_size = chunk_size
        self.agree = agree
        self._said_truncated = False

    def generate_agreed(self, generate: Callable[[], Any]) -> Any:
        """`generate()` (the engine's call), with non-finite logits met on any rank raised on every rank together
        (`agree`): a `FloatingPointError` whose `agreed` is True, carrying the failing rank's line; likewise a stop
        request that interrupted a multi-turn episode's tool or environment call on any rank (`ScoringStopped`).

        Raises:
            FloatingPointError: the sampler met non-finite logits here or (with `agree`) on another rank.
            ScoringStopped: a stop request interrupted the generation's episodes here or on another rank.
        """
        if self.agree is None:
            return generate()
        failure = None
        try:
            out = generate()
        except FloatingPointError as err:
            out, failure = None, str(err)
        except ScoringStopped as err:  # a stop request interrupted an episode's tool or environment call
            out, failure = None, STOPPED_MARK + str(err)
        line = self.agree(failure)
        if line is not None and STOPPED_MARK in line:
            raise ScoringStopped(line.replace(STOPPED_MARK, "") if failure is not None else
                                 "a stop request interrupted the rollout on another rank")
        if line is not None:
            err = FloatingPointError(line)
            err.agreed = True
            raise err
        return out

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
        `answers` are the score function's per-sample targets (reference answers, or the prompt records). Its
        stats hold `truncated_fraction`: the share of responses the length cap (`SamplingParams.max_new_tokens`)
        cut before a stop token (the first time more than half are cut, a warning says so, once), and with the
        paged engine's adaptive threads `engine_threads`: the mean torch thread count of its decode steps.

        Raises:
            ValueError: when `prompt_ids` and `answers` differ in length, or the score function returns a
                tensor of the wrong shape or with non-finite values.
            FloatingPointError: non-finite logits in the sampler (`generate_agreed`).
        """
        if len(prompt_ids) != len(answers):
            raise ValueError(f"collect: {len(prompt_ids)} prompts but {len(answers)} answers")
        start = time.perf_counter()
        generation = self.generate_agreed(lambda: self.engine.generate(prompt_ids, self.sampling, generator))
        experience = self.scored(generation, answers, {"generate": time.perf_counter() - start})
        threads = getattr(self.engine, "last_stats", {}).get("threads_mean")
        if threads is not None:  # the paged engine's adaptive threads (runtime.adaptive_threads)
            experience.stats["engine_threads"] = threads
        return experience

    def scored(self, generation, answers: Sequence[Any], timings: dict[str, float]) -> Experience:
        """The engine's `generation` (one row per item of `answers`) decoded and scored, as `sample` returns it;
        `timings` (the generation's) gains "reward".

        Raises:
            ValueError: the score function returns a tensor of the wrong shape or with non-finite values.
        """
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
        experience = Experience(sequences=sequences, old_logprobs=generation.old_logprobs, ref_logprobs=None,
                                scores=scores.to(generation.old_logprobs.device), responses=responses,
                                policy_version=generation.policy_version, timings=timings,
                                reward_components=dict(components), reward_failed=dict(failed),
                                routes=self.routes_of(answers))
        return self.count_truncated(experience)

    def routes_of(self, records: Sequence[Any]) -> Optional[tuple[str, ...]]:
        """Per prompt record (the score function's targets, one per sample) the route of the teacher that scores
        it, when `ref_model` routes rows to several teachers (`teachers.TeacherRoutes.route_of`); None otherwise.

        Raises:
            ValueError: a record whose route value has no teacher (checked at start-up already).
        """
        if not isinstance(self.ref_model, TeacherRoutes):
            return None
        return tuple(self.ref_model.route_of(record) for record in records)

    def count_truncated(self, experience: Experience) -> Experience:
        """`experience` with `stats["truncated_fraction"]` (`truncated_fraction`); the first time it is more than
        half, a warning says so (once per runner)."""
        truncated = self.truncated_fraction(experience)
        if truncated > 0.5 and not self._said_truncated:
            self._said_truncated = True
            warnings.warn(f"rollout.max_new_tokens ({self.sampling.max_new_tokens}) cut {truncated:.0%} of this "
                          f"rollout's responses before they ended: the rewards scored unfinished answers; raise it "
                          f"unless that is meant (rollout/truncated_fraction counts it on every rollout; said once)",
                          stacklevel=3)
        experience.stats["truncated_fraction"] = truncated
        return experience

    def truncated_fraction(self, experience: Experience) -> float:
        """The share of `experience`'s responses whose last real token is not a stop token
        (`SamplingParams.stop_token_ids`): those the length cap cut before they ended."""
        seq = experience.sequences
        lengths = seq.response_mask.sum(-1)
        last = seq.response_ids.gather(1, (lengths - 1).clamp(min=0)[:, None]).squeeze(1)
        stops = torch.tensor(self.sampling.stop_token_ids, dtype=last.dtype, device=last.device)
        finished = torch.isin(last, stops) & (lengths > 0)
        return 1.0 - float(finished.float().mean()) if len(experience) else 0.0

    def add_reference(self, experience: Experience) -> Experience:
        """`experience` with the reference model's log-probs (B, T) float32 of its responses at the sampling
        temperature, scored `chunk_size` rows per no-grad forward (timing "reference"); unchanged without a
        reference model. Several routed teachers (`teachers.TeacherRoutes`) score the rows of each teacher
        together, each row by the teacher of its route (`experience.routes`).

        Raises:
            ValueError: routed teachers and an experience without routes.
        """
        if self.ref_model is None:
            return experience
        start = time.perf_counter()
        if isinstance(self.ref_model, TeacherRoutes):
            if experience.routes is None:
                raise ValueError("distill.teachers: the experience carries no routes to pick each row's teacher by")
            ref_logprobs = self.ref_model.response_logprobs(experience.sequences, experience.routes, self.score)
        else:
            ref_logprobs = self.score(self.ref_model, experience.sequences)
        timings = {**experience.timings, "reference": time.perf_counter() - start}
        return dataclasses.replace(experience, ref_logprobs=ref_logprobs, timings=timings)

    def score(self, model, sequences: Sequences) -> torch.Tensor:
        """The log-probs (B, T) float32 that `model` gives `sequences`' response tokens: a module at the sampling
        temperature, `chunk_size` rows per no-grad forward; any other object by its own
        `response_logprobs(sequences)` (a served teacher: `served_teacher.ServedTeacher`)."""
        if isinstance(model, torch.nn.Module):
            temperature = self.sampling.temperature
            return score_in_chunks(lambda chunk: response_logprobs(model, chunk, temperature=temperature)[0],
                                   sequences, self.chunk_size)
        return model.response_logprobs(sequences)
