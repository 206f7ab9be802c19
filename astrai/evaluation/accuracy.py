"""Scores of a policy on prompts: generate with the rollout engine, score with the job's reward functions.

One function, `evaluate`, serves the `python -m astrai.evaluate` command and the in-training evaluation callback
(`astrai.trainer.evaluation_callback`). Prompts are built by `astrai.data.truncation.encode_prompt_records`, exactly
as the online train types build them (the chat template or raw text as `data.chat_template` says, optional system
prompt, `max_prompt_length` under the `data.truncation` policy; prompts `filter` drops are not evaluated);
generation stops on the model's stop set (`astrai.models.special_tokens.stop_token_ids`) and responses are decoded
without a final stop token and with special tokens skipped, as for training, and scored as training scores them (`astrai.rewards.build.score_records`:
the `RewardFunctions` of the job, each called with the prompt record's columns; the total is their weighted sum).

Statistics, with k samples per question (`num_samples`):
- pass rate (`accuracy`): a sample passes when its total reward is at least `pass_threshold` (default 1.0,
  `CORRECT_SCORE`: an exact-match reward gives 1 for a right answer). A question's accuracy is its fraction of
  passing samples, `accuracy` the mean over questions (= pass@1), with the Wilson score interval
  (`astrai.algos.stats.wilson_interval`) over the questions (the unit that is sampled; for k > 1 the per-question
  fractions make it conservative). pass@k uses the unbiased estimator of Chen et al. 2021, section 2.1
  (`astrai.algos.stats.pass_at_k`), for k = 1, 2, 4, ... up to `num_samples`.
- mean total reward (`reward_mean`): the mean over questions of each question's mean total reward, with a 95%
  normal interval over the questions, ``mean +- 1.959964 * s / sqrt(n)`` (s the sample standard deviation of the
  n per-question means; for n = 1 the interval is the mean itself). A normal, not a t, interval: it is too narrow
  by a few percent below ~30 questions (t quantile 2.09 at n = 20).
- per reward function: its mean over the samples it applies to (None values excluded; 0 when it applies to none,
  as training logs it), the fraction of samples it applies to, and the samples whose call failed.

Greedy decoding: temperature 0 is expressed to the engine as `top_k = 1` (argmax of the logits; the sampling
temperature is then irrelevant and left at 1, which the engine's `SamplingParams` requires to be > 0).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Callable, Mapping, Optional, Sequence

import torch
from tqdm.auto import tqdm

from astrai.algos.stats import pass_at_k, wilson_interval
from astrai.data.truncation import encode_prompt_records, prompt_messages
from astrai.models.special_tokens import strip_stop
from astrai.rewards.build import score_records
from astrai.rollout.sampling import MIN_TEMPERATURE, SamplingParams

CORRECT_SCORE = 1.0
"""The default pass threshold: a sample whose total reward is at least this passes (counts as correct)."""

__all__ = ["CORRECT_SCORE", "EvalResult", "EvalSettings", "eval_statistics", "evaluate", "mean_interval",
           "pass_at_ks"]


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


def mean_interval(total: float, total_sq: float, n: int, *, confidence: float = 0.95) -> tuple[float, float]:
    """Normal interval ``(low, high)`` of a mean from the sum `total` and sum of squares `total_sq` of `n` values:
    ``mean +- z * s / sqrt(n)``, s the sample standard deviation (n - 1 in the denominator), z the two-sided normal
    quantile of `confidence`; ``(mean, mean)`` for n = 1.

    Raises:
        ValueError: n < 1.
    """
    if n < 1:
        raise ValueError(f"mean_interval: needs n >= 1 values, got {n}")
    mean = total / n
    if n == 1:
        return mean, mean
    variance = max(0.0, (total_sq - n * mean * mean) / (n - 1))
    half = NormalDist().inv_cdf(0.5 + confidence / 2) * math.sqrt(variance / n)
    return mean - half, mean + half


EPISODE_COUNTS = ("turns", "tool_calls", "tool_errors")
"""What each evaluated multi-turn episode counts (`EvalResult.examples`' lists of these names, per sample)."""


def eval_statistics(sums: Mapping[str, float], names: Sequence[str]) -> dict:
    """The statistics of an evaluation (module docstring) from its additive sums (`EvalResult.sums`, possibly summed
    over ranks) and reward function `names`: `accuracy`, `ci_low`, `ci_high` (95% Wilson), `reward_mean`,
    `reward_mean_ci_low`, `reward_mean_ci_high` (95% normal over questions), `truncated_fraction` (the share of
    samples the `max_new_tokens` cap cut before a stop token: their rewards scored unfinished answers),
    `rewards`: name -> {`mean`, `applies`, `failed`}, and for multi-turn episodes `episodes`: each of
    `EPISODE_COUNTS` per episode (turns, tool calls, tool errors). Plain floats.

    Raises:
        ValueError: no question (`sums["questions"]` < 1).
    """
    n = int(round(sums["questions"]))
    if n < 1:
        raise ValueError("evaluation: no question was evaluated")
    low, high = wilson_interval(sums["correct"], n)
    reward_low, reward_high = mean_interval(sums["reward_sum"], sums["reward_sumsq"], n)
    samples = max(sums["samples"], 1.0)
    rewards = {name: {"mean": sums[f"{name}/sum"] / sums[f"{name}/applied"] if sums[f"{name}/applied"] else 0.0,
                      "applies": sums[f"{name}/applied"] / samples, "failed": sums[f"{name}/failed"]}
               for name in names}
    stats = {"accuracy": sums["correct"] / n, "ci_low": low, "ci_high": high, "reward_mean": sums["reward_sum"] / n,
             "reward_mean_ci_low": reward_low, "reward_mean_ci_high": reward_high,
             "truncated_fraction": sums["unfinished"] / samples, "rewards": rewards}
    if sums.get("episodes", 0.0) > 0:
        stats["episodes"] = {key: sums[f"episodes/{key}"] / sums["episodes"] for key in EPISODE_COUNTS}
    return stats


@dataclass
class EvalResult:
    """Per-question results of one evaluation and their statistics.

    Attributes:
        examples: one dict per question, in input order: `index`, `question`, `answer` ("" when the data has no
            answers), and per sample (lists of length k) `responses`, `extracted_answers` (None when no reward
            states an extractor or it finds nothing), `scores` (the total reward), `rewards` (reward function name
            -> its values, None where it does not apply), `correct` (total >= `pass_threshold`),
            `response_tokens`, `finished` (ended with a stop token), for multi-turn episodes `turns`, `tool_calls` and
            `tool_errors`; `num_correct`.
        num_samples: k, responses per question.
        reward_names: the reward functions' names, in order.
        pass_threshold: the total reward a sample needs to pass.
        failed: reward function name -> samples whose call failed (raised, timed out, lost its worker).
        generated_tokens: response tokens generated over all samples.
        generation_seconds: wall time spent inside the engine.
        wall_seconds: wall time of the whole evaluation (prompt building, generation, decoding, scoring).
        interrupted: `evaluate`'s `should_stop` ended it before its last question.
    """

    examples: list[dict] = field(default_factory=list)
    num_samples: int = 1
    reward_names: list[str] = field(default_factory=list)
    pass_threshold: float = CORRECT_SCORE
    failed: dict[str, int] = field(default_factory=dict)
    generated_tokens: int = 0
    generation_seconds: float = 0.0
    wall_seconds: float = 0.0
    interrupted: bool = False

    @property
    def num_questions(self) -> int:
        """Questions evaluated."""
        return len(self.examples)

    @property
    def correct(self) -> float:
        """Sum over questions of the fraction of passing samples (the number of passing questions for k = 1)."""
        return sum(ex["num_correct"] / self.num_samples for ex in self.examples)

    @property
    def accuracy(self) -> float:
        """Mean per-question pass rate (pass@1); 0.0 when no question was evaluated."""
        return self.correct / self.num_questions if self.examples else 0.0

    def interval(self, confidence: float = 0.95) -> tuple[float, float]:
        """Wilson score interval of `accuracy` over the questions. Raises ValueError with no question."""
        return wilson_interval(self.correct, self.num_questions, confidence=confidence)

    def pass_at(self) -> dict[int, float]:
        """pass@k (Chen et al. 2021 estimator, averaged over questions) for each k of `pass_at_ks`."""
        n = self.num_samples
        return {k: sum(pass_at_k(n, ex["num_correct"], k) for ex in self.examples) / max(1, self.num_questions)
                for k in pass_at_ks(n)}

    def sums(self) -> dict[str, float]:
        """The additive sums the statistics are computed from (`eval_statistics`; summed over ranks in training):
        `questions`, `samples`, `correct` (as `correct`), `reward_sum` / `reward_sumsq` (of the per-question mean
        total rewards), `unfinished` (samples cut by `max_new_tokens` before a stop token), `interrupted`,
        `episodes` and `episodes/<count>` (the multi-turn episodes and their summed `EPISODE_COUNTS`; 0 without
        episodes), and per reward function `<name>/sum` (of the values that apply), `<name>/applied` (their
        count) and `<name>/failed`. Every key is present (zeros) without examples."""
        means = [sum(ex["scores"]) / len(ex["scores"]) for ex in self.examples]
        out = {"questions": float(self.num_questions), "samples": float(self.num_questions * self.num_samples),
               "correct": self.correct, "reward_sum": sum(means), "reward_sumsq": sum(m * m for m in means),
               "unfinished": float(sum(not f for ex in self.examples for f in ex["finished"])),
               "interrupted": float(self.interrupted)}
        played = [ex for ex in self.examples if "turns" in ex]  # multi-turn episodes (a player)
        out.update({"episodes": float(sum(len(ex["turns"]) for ex in played))},
                   **{f"episodes/{key}": float(sum(sum(ex[key]) for ex in played)) for key in EPISODE_COUNTS})
        for name in self.reward_names:
            values = [v for ex in self.examples for v in ex["rewards"][name] if v is not None]
            out.update({f"{name}/sum": sum(values), f"{name}/applied": float(len(values)),
                        f"{name}/failed": float(self.failed.get(name, 0))})
        return out

    def demonstrations(self, system_prompt: Optional[str] = None) -> list[dict]:
        """The passing responses as chat demonstrations for `train.type: sft` (`data.messages_field: messages`):
        one `{"messages": [system?, user, assistant], "index": <the question's index>}` per distinct passing
        response of each question that ended with a stop token (a response cut by `max_new_tokens` is never one),
        in question then sample order; the prompt turns are built as the evaluation built them
        (`astrai.data.truncation.prompt_messages`, the whole question even where `truncation: left` cut it).
        Empty responses are left out.

        With a teacher's samples this is sequence-level knowledge distillation (Kim and Rush 2016, "Sequence-Level
        Knowledge Distillation", section 3.2: train on the teacher's outputs); with the policy's own, filtered by
        the reward, rejection-sampling fine-tuning (Yuan et al. 2023, "Scaling Relationship on Learning
        Mathematical Reasoning with Large Language Models", section 3.3: distinct correct samples per question).

        Raises:
            ValueError: the examples are multi-turn episodes (their tool turns are not in `responses`).
        """
        rows = []
        for ex in self.examples:
            if "turns" in ex:
                raise ValueError("demonstrations: multi-turn episodes are not written as demonstrations")
            seen = set()
            for response, correct, finished in zip(ex["responses"], ex["correct"], ex["finished"]):
                if correct and finished and response.strip() and response not in seen:
                    seen.add(response)
                    rows.append({"messages": prompt_messages(ex["question"], system_prompt)
                                 + [{"role": "assistant", "content": response}], "index": ex["index"]})
        return rows

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens per second of generation time."""
        return self.generated_tokens / self.generation_seconds if self.generation_seconds > 0 else 0.0

    def metrics(self) -> dict:
        """Summary numbers (plain JSON): n, num_samples, correct, accuracy (the pass rate), ci_low/ci_high (95%
        Wilson), pass_threshold, pass_at_k, mean_score (= reward_mean), reward_mean with reward_mean_ci_low/high
        (95% normal over questions), truncated_fraction (samples `max_new_tokens` cut before they ended), rewards
        (name -> mean, applies, failed), generated_tokens, tokens_per_second, generation_seconds, wall_seconds;
        for multi-turn episodes `episodes` (turns, tool_calls, tool_errors per episode).

        Raises:
            ValueError: no question was evaluated.
        """
        stats = eval_statistics(self.sums(), self.reward_names)
        return {"n": self.num_questions, "num_samples": self.num_samples, "correct": self.correct,
                "accuracy": stats["accuracy"], "ci_low": stats["ci_low"], "ci_high": stats["ci_high"],
                "interval": "wilson, 95%", "pass_threshold": self.pass_threshold,
                "pass_at_k": {str(k): v for k, v in self.pass_at().items()},
                "mean_score": stats["reward_mean"], "reward_mean": stats["reward_mean"],
                "reward_mean_ci_low": stats["reward_mean_ci_low"], "reward_mean_ci_high": stats["reward_mean_ci_high"],
                "reward_mean_interval": "normal, 95%, over questions",
                "truncated_fraction": stats["truncated_fraction"], "rewards": stats["rewards"],
                "generated_tokens": self.generated_tokens, "tokens_per_second": self.tokens_per_second,
                "generation_seconds": self.generation_seconds, "wall_seconds": self.wall_seconds,
                **({"episodes": stats["episodes"]} if "episodes" in stats else {})}


def evaluate(engine, tokenizer, records: Sequence, *, rewards, settings: EvalSettings,
             max_prompt_length: int, system_prompt: Optional[str] = None, truncation: str = "error",
             chat_template: Optional[bool] = None,
             stop_token_ids: Optional[Sequence[int]] = None, source: str = "evaluation data",
             generator: Optional[torch.Generator] = None, extract_answer: Optional[Callable] = None,
             pass_threshold: float = CORRECT_SCORE, progress: bool = False, leave: bool = True, desc: str = "eval",
             log: Callable[[str], None] = print, should_stop: Callable[[], bool] = lambda: False,
             player=None) -> EvalResult:
    """Generate `settings.num_samples` responses per record with `engine`, score them, collect the results.

    Args:
        engine: a rollout engine (`astrai.rollout.engine.GenerationEngine`) holding the weights to evaluate;
            its weights are used as they are (the caller syncs them).
        tokenizer: the model's tokenizer (chat template, decode, eos).
        records: `astrai.data.PromptRecord`s (prompt, answer, index, columns).
        rewards: the reward functions (`astrai.rewards.functions.RewardFunctions`, e.g. from
            `astrai.rewards.build.build_rewards`; anything with its `names` and call), given every sample with its
            record's stored prompt and columns (`score_records`).
        settings: generation settings.
        max_prompt_length, system_prompt, truncation, chat_template: prompt building, as in training
            (`data.max_prompt_length`, `data.system_prompt`, `data.truncation`, `data.chat_template`: the chat
            template, raw text, or None = the template when the tokenizer has one); `source` names the data in errors
            and in what `log` prints.
        stop_token_ids: the stop set (default: the tokenizer's EOS alone).
        generator: RNG the engine draws one number from per call (pass a dedicated one so that evaluation leaves
            other random streams alone); None uses torch's default RNG.
        extract_answer: response text -> the answer it states (reported only), e.g. a built-in's
            `BuiltinReward.extract_answer`.
        pass_threshold: the total reward a sample needs to pass (count as correct).
        progress, leave, desc: a tqdm bar over questions (with ETA) when `progress`.
        should_stop: asked before each batch; True ends the evaluation there, marked `interrupted` (a stop signal
            during in-training evaluation).
        player: multi-turn episodes instead of one response per prompt (a job with `rollout.tools` or
            `rollout.environment`: `astrai.experience.episodes.EpisodeRunner`): `player.play(records, params,
            generator)` returns per record a sample with `completion` (what the reward functions receive: the
            episode's messages), `text`, `action_ids`, `finished` and `rewards` (name -> value or None, added to
            the total: the environment's), whose names `player.reward_names` lists; the prompts above only decide
            which records are evaluated (an overlong one is cut or dropped as in training).

    Returns:
        `EvalResult` (examples in record order).

    Raises:
        DataError: an overlong prompt with `truncation="error"`, or a chat prompt rendered as raw text (naming
            `source` and the row). ConfigError: `chat_template` True without a template, or a system prompt with
            raw text.
        RewardFunctionError: a reward function's bug (wrong number of values, a non-number), or more than
            `reward.max_error_fraction` of a batch's reward calls failed, as in training.
        ValueError: from the engine (a prompt plus `max_new_tokens` beyond the model's context, ...).
    """
    start = time.perf_counter()
    stops = tuple(stop_token_ids) if stop_token_ids is not None else (tokenizer.eos_token_id,)
    params = settings.sampling_params(stops)
    encoded = encode_prompt_records([r.prompt for r in records], tokenizer, system_prompt=system_prompt,
                                    chat_template=chat_template, limit=max_prompt_length,
                                    limit_name="max_prompt_length", policy=truncation, source=source, log=log)
    kept = [(record, ids) for record, ids in zip(records, encoded) if ids is not None]
    names = list(rewards.names) + list(getattr(player, "reward_names", ()))
    result = EvalResult(num_samples=settings.num_samples, reward_names=names, pass_threshold=pass_threshold,
                        failed=dict.fromkeys(names, 0))
    k = settings.num_samples
    with tqdm(total=len(kept), desc=desc, unit="question", disable=not progress, leave=leave,
              dynamic_ncols=True) as bar:
        for first in range(0, len(kept), settings.batch_size):
            if should_stop():
                result.interrupted = True
                break
            batch = [record for record, _ in kept[first:first + settings.batch_size]]
            prompt_ids = [ids for _, ids in kept[first:first + settings.batch_size]]
            generate_start = time.perf_counter()
            repeated = [record for record in batch for _ in range(k)]
            if player is None:
                generation = engine.generate(prompt_ids, params, generator, n=k)
                mask = generation.action_mask.cpu()
                ids = [row[m].tolist() for row, m in zip(generation.response_ids.cpu(), mask)]
                responses = [tokenizer.decode(strip_stop(r, stops), skip_special_tokens=True) for r in ids]
                completions, finished, extra = responses, generation.finished.cpu().tolist(), []
            else:
                played = player.play(repeated, params, generator)
                ids, responses = [p.action_ids for p in played], [p.text for p in played]
                completions, finished, extra = [p.completion for p in played], [p.finished for p in played], played
            result.generation_seconds += time.perf_counter() - generate_start
            scored = score_records(rewards, completions, repeated, ids)
            scores = scored.total.tolist()
            values = {name: [None if math.isnan(v) else v for v in scored.components[name].tolist()]
                      for name in rewards.names}
            for name in getattr(player, "reward_names", ()):  # the episodes' own rewards join the total
                values[name] = [p.rewards.get(name) for p in extra]
                scores = [s + (v or 0.0) for s, v in zip(scores, values[name])]
            for name in rewards.names:
                result.failed[name] += int(scored.failed[name].sum()) if name in scored.failed else 0
            result.generated_tokens += sum(len(r) for r in ids)
            for i, record in enumerate(batch):
                rows = range(i * k, (i + 1) * k)
                correct = [scores[r] >= pass_threshold for r in rows]
                result.examples.append({
                    "index": record.index, "question": record.prompt, "answer": record.answer,
                    "responses": [responses[r] for r in rows],
                    "extracted_answers": [extract_answer(responses[r]) if extract_answer else None for r in rows],
                    "scores": [scores[r] for r in rows],
                    "rewards": {name: [values[name][r] for r in rows] for name in names},
                    "correct": correct, "num_correct": sum(correct),
                    "response_tokens": [len(ids[r]) for r in rows], "finished": [bool(finished[r]) for r in rows],
                    **({key: [getattr(extra[r], key) for r in rows] for key in EPISODE_COUNTS} if extra else {})})
            bar.update(len(batch))
            bar.set_postfix(accuracy=f"{result.accuracy:.3f}")
    result.wall_seconds = time.perf_counter() - start
    return result
