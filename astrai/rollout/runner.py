"""RolloutRunner: prompts -> token ids -> engine samples -> decoded responses -> scores (+ reference log-probs).

Shared by the online train types; the strategy adds what is specific to it (critic values, GAE for PPO;
group advantages for GRPO).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from astrai.data.sequences import Sequences
from astrai.rollout.sampling import SamplingParams
from astrai.rollout.scoring import response_logprobs, score_in_chunks

ScoreFn = Callable[[list[str], list[str], list[list[int]]], torch.Tensor]
"""(responses, answers, response_ids) -> scores (B,) float32."""


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
    """

    sequences: Sequences
    old_logprobs: torch.Tensor
    ref_logprobs: Optional[torch.Tensor]
    scores: torch.Tensor
    responses: tuple[str, ...]
    policy_version: int
    timings: dict[str, float] = field(default_factory=dict)


class RolloutRunner:
    """Turns prompt token ids into scored `Experience` with the colocated engine.

    Args:
        engine: a `PagedGenerationEngine` (or anything with its `generate`); its weights are synced by the caller.
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

    def collect(self, prompt_ids: Sequence[Sequence[int]], answers: Sequence[str],
                generator: Optional[torch.Generator] = None) -> Experience:
        """Sample one response per prompt, decode, score, and compute reference log-probs.

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
        scores = torch.as_tensor(self.score_fn(list(responses), list(answers), response_ids),
                                 dtype=torch.float32)
        if scores.shape != (len(answers),) or not bool(torch.isfinite(scores).all()):
            raise ValueError(f"reward: expected {len(answers)} finite scores, got {tuple(scores.shape)}")
        ref_logprobs = None
        if self.ref_model is not None:
            start = time.perf_counter()
            ref_logprobs = score_in_chunks(
                lambda chunk: response_logprobs(self.ref_model, chunk,
                                                temperature=self.sampling.temperature)[0],
                sequences, self.chunk_size)
            timings["reference"] = time.perf_counter() - start
        return Experience(sequences=sequences, old_logprobs=generation.old_logprobs,
                          ref_logprobs=ref_logprobs, scores=scores.to(generation.old_logprobs.device),
                          responses=responses, policy_version=generation.policy_version, timings=timings)
