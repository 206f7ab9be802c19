"""Accuracy of a policy on question/answer prompts: generate with the rollout engine, score with a reward.

One function, `evaluate`, serves the `python -m astrai.evaluate` command and the in-training evaluation callback
(`astrai.trainer.evaluation_callback`). Prompts are built by `astrai.data.truncation.encode_prompt_records`, exactly as the
online train types build them (chat template, optional system prompt, `max_prompt_length` under the
`data.truncation` policy; prompts `filter` drops are not evaluated); generation stops on the model's stop set
(`astrai.models.special_tokens.stop_token_ids`) and responses are decoded without a final stop token and with
special tokens skipped, as for training, and scored by a reward of `astrai.rewards.builtins` with
`format_bonus=0`.

Correctness and statistics: a response is correct when its score is at least 1 (`CORRECT_SCORE`; the exact-match
rewards give 1 for a right answer, 0 otherwise). With k samples per question (`num_samples`), a question's
accuracy is its fraction of correct samples, and `accuracy` is the mean over questions (= pass@1). The 95% interval
is the Wilson score interval (`astrai.algos.stats.wilson_interval`) over the questions (the unit that is
sampled; for k > 1 the per-question fractions make it conservative). pass@k uses the unbiased estimator of Chen
et al. 2021, section 2.1 (`astrai.algos.stats.pass_at_k`), for k = 1, 2, 4, ... up to `num_samples`.

Greedy decoding: temperature 0 is expressed to the engine as `top_k = 1` (argmax of the logits; the sampling
temperature is then irrelevant and left at 1, which the engine's `SamplingParams` requires to be > 0).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
from tqdm.auto import tqdm

from astrai.algos.stats import pass_at_k, wilson_interval
from astrai.data.truncation import encode_prompt_records
from astrai.models.special_tokens import strip_stop
from astrai.rollout.sampling import MIN_TEMPERATURE, SamplingParams

CORRECT_SCORE = 1.0
"""A response whose reward (format bonus 0) is at least this counts as correct."""

__all__ = ["CORRECT_SCORE", "EvalResult", "EvalSettings", "evaluate", "pass_at_ks"]


@dataclass(frozen=True)
class EvalSettings:
    """How to generate for evaluation.

    Attributes:
        max_new_tokens: response length cap in tokens (> 0).
        temperature: 0 for greedy decoding (the default), else the sampling temperature (>= 1e-4).
        num_samples: responses per question (k); > 1 needs temperature > 0 (greedy samples would be identical).
        batch_size: questions per engine call (the engine batches their samples continuously).

    Raises:
        ValueError: one line naming the first invalid field.
    """

    max_new_tokens: int
    temperature: float = 0.0
    num_samples: int = 1
    batch_size: int = 64

    def __post_init__(self):
        for name in ("max_new_tokens", "num_samples", "batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected an integer >= 1, got {value!r}")
        if not (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature < float("inf")):
            raise ValueError(f"temperature: expected 0 (greedy) or a finite number >= {MIN_TEMPERATURE}, "
                             f"got {self.temperature!r}")
        if self.num_samples > 1 and self.temperature == 0:
            raise ValueError(f"num_samples: {self.num_samples} samples per question need temperature > 0 "
                             "(greedy decoding gives the same response every time)")

    @property
    def greedy(self) -> bool:
        """True for temperature 0."""
        return self.temperature == 0

    def sampling_params(self, stop_token_ids: Sequence[int]) -> SamplingParams:
        """The engine's `SamplingParams`: greedy as `top_k=1`, else plain temperature sampling (no truncation)."""
        if self.greedy:
            return SamplingParams(max_new_tokens=self.max_new_tokens, temperature=1.0, top_k=1,
                                  stop_token_ids=tuple(stop_token_ids))
        return SamplingParams(max_new_tokens=self.max_new_tokens, temperature=float(self.temperature),
                              stop_token_ids=tuple(stop_token_ids))


def pass_at_ks(num_samples: int) -> list[int]:
    """The k reported for `num_samples` samples per question: powers of two below it, and itself."""
    ks, k = [], 1
    while k < num_samples:
        ks.append(k)
        k *= 2
    return ks + [num_samples]


@dataclass
class EvalResult:
    """Per-question results of one evaluation and their statistics.

    Attributes:
        examples: one dict per question, in input order: `index`, `question`, `answer`, and per sample
            (lists of length k) `responses`, `extracted_answers` (None when the reward has no extractor or finds
            nothing), `scores`, `correct`, `response_tokens`, `finished` (ended with a stop token); `num_correct`.
        num_samples: k, responses per question.
        generated_tokens: response tokens generated over all samples.
        generation_seconds: wall time spent inside the engine.
        wall_seconds: wall time of the whole evaluation (prompt building, generation, decoding, scoring).
    """

    examples: list[dict] = field(default_factory=list)
    num_samples: int = 1
    generated_tokens: int = 0
    generation_seconds: float = 0.0
    wall_seconds: float = 0.0

    @property
    def num_questions(self) -> int:
        """Questions evaluated."""
        return len(self.examples)

    @property
    def correct(self) -> float:
        """Sum over questions of the fraction of correct samples (the number of correct questions for k = 1)."""
        return sum(ex["num_correct"] / self.num_samples for ex in self.examples)

    @property
    def accuracy(self) -> float:
        """Mean per-question accuracy (pass@1); 0.0 when no question was evaluated."""
        return self.correct / self.num_questions if self.examples else 0.0

    def interval(self, confidence: float = 0.95) -> tuple[float, float]:
        """Wilson score interval of `accuracy` over the questions. Raises ValueError with no question."""
        return wilson_interval(self.correct, self.num_questions, confidence=confidence)

    def pass_at(self) -> dict[int, float]:
        """pass@k (Chen et al. 2021 estimator, averaged over questions) for each k of `pass_at_ks`."""
        n = self.num_samples
        return {k: sum(pass_at_k(n, ex["num_correct"], k) for ex in self.examples) / max(1, self.num_questions)
                for k in pass_at_ks(n)}

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens per second of generation time."""
        return self.generated_tokens / self.generation_seconds if self.generation_seconds > 0 else 0.0

    def metrics(self) -> dict:
        """Summary numbers (plain JSON): n, num_samples, correct, accuracy, ci_low/ci_high (95% Wilson),
        pass_at_k, mean_score, generated_tokens, tokens_per_second, generation_seconds, wall_seconds."""
        low, high = self.interval()
        scores = [s for ex in self.examples for s in ex["scores"]]
        return {"n": self.num_questions, "num_samples": self.num_samples, "correct": self.correct,
                "accuracy": self.accuracy, "ci_low": low, "ci_high": high, "interval": "wilson, 95%",
                "pass_at_k": {str(k): v for k, v in self.pass_at().items()},
                "mean_score": sum(scores) / max(1, len(scores)), "generated_tokens": self.generated_tokens,
                "tokens_per_second": self.tokens_per_second, "generation_seconds": self.generation_seconds,
                "wall_seconds": self.wall_seconds}


def evaluate(engine, tokenizer, records: Sequence, *, reward: Callable, settings: EvalSettings,
             max_prompt_length: int, system_prompt: Optional[str] = None, truncation: str = "error",
             stop_token_ids: Optional[Sequence[int]] = None, source: str = "evaluation data",
             generator: Optional[torch.Generator] = None, extract_answer: Optional[Callable] = None,
             progress: bool = False, leave: bool = True, desc: str = "eval",
             log: Callable[[str], None] = print) -> EvalResult:
    """Generate `settings.num_samples` responses per record with `engine`, score them, collect the results.

    Args:
        engine: a rollout engine (`astrai.rollout.engine.GenerationEngine`) holding the weights to evaluate;
            its weights are used as they are (the caller syncs them).
        tokenizer: the model's tokenizer (chat template, decode, eos).
        records: `astrai.data.PromptRecord`s (prompt, answer, index).
        reward: a reward function of `astrai.rewards.builtins` (called with `format_bonus=0.0`).
        settings: generation settings.
        max_prompt_length, system_prompt, truncation: prompt building, as in training (`data.max_prompt_length`,
            `data.system_prompt`, `data.truncation`); `source` names the data in errors and in what `log` prints.
        stop_token_ids: the stop set (default: the tokenizer's EOS alone).
        generator: RNG the engine draws one number from per call (pass a dedicated one so that evaluation leaves
            other random streams alone); None uses torch's default RNG.
        extract_answer: response text -> the answer it states (reported only), e.g. `ANSWER_EXTRACTORS[name]`.
        progress, leave, desc: a tqdm bar over questions (with ETA) when `progress`.

    Returns:
        `EvalResult` (examples in record order).

    Raises:
        DataError: an overlong prompt with `truncation="error"` (naming `source` and the row).
        ValueError: from the engine (a prompt plus `max_new_tokens` beyond the model's context, ...) or from a
            reward that returns the wrong number of scores.
    """
    start = time.perf_counter()
    stops = tuple(stop_token_ids) if stop_token_ids is not None else (tokenizer.eos_token_id,)
    params = settings.sampling_params(stops)
    encoded = encode_prompt_records([r.prompt for r in records], tokenizer, system_prompt=system_prompt,
                                    limit=max_prompt_length, limit_name="max_prompt_length", policy=truncation,
                                    source=source, log=log)
    kept = [(record, ids) for record, ids in zip(records, encoded) if ids is not None]
    result = EvalResult(num_samples=settings.num_samples)
    k = settings.num_samples
    with tqdm(total=len(kept), desc=desc, unit="question", disable=not progress, leave=leave,
              dynamic_ncols=True) as bar:
        for first in range(0, len(kept), settings.batch_size):
            batch = [record for record, _ in kept[first:first + settings.batch_size]]
            prompt_ids = [ids for _, ids in kept[first:first + settings.batch_size]]
            answers = [record.answer for record in batch]
            generate_start = time.perf_counter()
            generation = engine.generate(prompt_ids, params, generator, n=k)
            result.generation_seconds += time.perf_counter() - generate_start
            mask = generation.action_mask.cpu()
            ids = [row[m].tolist() for row, m in zip(generation.response_ids.cpu(), mask)]
            responses = [tokenizer.decode(strip_stop(r, stops), skip_special_tokens=True) for r in ids]
            scores = reward(responses, [a for a in answers for _ in range(k)], format_bonus=0.0)
            scores = torch.as_tensor(scores, dtype=torch.float32).reshape(-1).tolist()
            if len(scores) != len(responses):
                raise ValueError(f"reward: expected {len(responses)} scores, got {len(scores)}")
            result.generated_tokens += int(mask.sum())
            finished = generation.finished.cpu().tolist()
            for i, record in enumerate(batch):
                rows = range(i * k, (i + 1) * k)
                correct = [scores[r] >= CORRECT_SCORE for r in rows]
                result.examples.append({
                    "index": record.index, "question": record.prompt, "answer": record.answer,
                    "responses": [responses[r] for r in rows],
                    "extracted_answers": [extract_answer(responses[r]) if extract_answer else None for r in rows],
                    "scores": [scores[r] for r in rows], "correct": correct, "num_correct": sum(correct),
                    "response_tokens": [len(ids[r]) for r in rows], "finished": [bool(finished[r]) for r in rows]})
            bar.update(len(batch))
            bar.set_postfix(accuracy=f"{result.accuracy:.3f}")
    result.wall_seconds = time.perf_counter() - start
    return result
