"""In-training evaluation: greedy scores on a held-out prompt set during training, with the job's rewards.

With `train.eval_steps: N` (0 = off) and `data.eval_path` (+ `data.eval_limit`), `EvaluationCallback` evaluates
after every N-th step and after the last step, and adds to that step's metrics (so they land in its
metrics.jsonl record): `eval/accuracy` (the pass rate: total reward >= 1.0), `eval/accuracy_ci_low`,
`eval/accuracy_ci_high` (95% Wilson score interval), `eval/reward_mean`, `eval/reward_mean_ci_low`,
`eval/reward_mean_ci_high` (mean total reward, 95% normal interval over questions), per reward function
`eval/rewards/<name>/mean` (over the samples it applies to), `/applies` (that fraction) and `/failed` (samples whose
call failed), for multi-turn episodes `eval/episodes/turns`, `/tool_calls` and `/tool_errors` (per episode),
`eval/num_questions` and `time/eval_seconds`. It must run before the metrics logger; its time is
part of the step's `time/step_seconds` when it comes before the step timer. The per-question results (question,
answer, response, extracted answer, scores, rewards, correct ..., as `python -m astrai.evaluate` writes them) go
to `<train.output_dir>/eval/step-<N>.jsonl`, so what the model answers can be read as it learns.

What is measured is exactly what `python -m astrai.evaluate` measures on the job's config
(`astrai.evaluation.accuracy.evaluate`): prompts built as for training (`data.chat_template`, `data.system_prompt`,
`data.max_prompt_length`), greedy decoding with `rollout.max_new_tokens`, the job's reward functions
(`reward.functions` or `reward.name`, with training's weights, kwargs, workers and timeouts; the reward model of
`reward.model_path` is left out: `astrai.rewards.build.evaluation_specs`). A reward call that fails is counted and
warned about once, as in training; too many failures, or a reward function's bug, stop the job as in training.

Engine: an online train type evaluates with its own rollout engine (`learner.rollout_engine`), first synced to
the current `policy_version` (`astrai.rollout.engine.sync_weights`); afterwards the engine's prefix cache is
cleared, so the next rollout does not reuse blocks that evaluation prompts filled. Offline train types get an
engine of their own, copied from the policy at the first evaluation and synced the same way later. Random streams:
the engine draws from a dedicated generator seeded with `train.seed`, so training's RNGs (and bitwise resume) are
untouched.
With several ranks, each evaluates every world_size-th question and the sums behind the statistics
(`EvalResult.sums`) are summed over ranks.
"""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
from tqdm.auto import tqdm

from astrai.checkpoint.fsutil import write_atomic
from astrai.data import PromptDataset
from astrai.data.truncation import encode_prompt_records
from astrai.evaluation.accuracy import CORRECT_SCORE, EvalResult, EvalSettings, eval_statistics, evaluate
from astrai.models.loading import empty_model
from astrai.models.special_tokens import stop_token_ids
from astrai.rewards.build import answer_extractor, answer_readers, build_rewards, evaluation_specs
from astrai.rewards.builtins import unscorable_warning
from astrai.rollout.build import build_rollout_engine, check_rollout_engine
from astrai.rollout.engine import build_engine, sync_weights
from astrai.trainer.faults import NonFiniteError, nonfinite_sampling
from astrai.outputs import OutputWriteError
from astrai.trainer.loop import Callback

__all__ = ["EvaluationCallback", "build_evaluation"]


def _quiet(message: str) -> None:
    """A log that prints nothing."""


class EvaluationCallback(Callback):
    """Greedy held-out scores every `eval_steps` steps and at the end (see the module docstring).

    Args:
        records: the held-out `PromptRecord`s (all of them; each rank takes its share).
        tokenizer: the policy's tokenizer.
        rewards: the reward functions (`RewardFunctions`, `astrai.rewards.build.build_rewards`); closed at the
            end of training.
        settings: generation settings (greedy).
        pass_threshold: the total reward a sample needs to pass (count as correct for `eval/accuracy`).
        eval_steps: evaluate when `global_step % eval_steps == 0` (> 0), and after the last step.
        learner: the train type's learner: its `policy` (a `TrainedModel`) and `rollout_engine` (None for offline types).
        dist: `DistributedContext` (device, rank, world size, all-reduce).
        max_prompt_length, system_prompt, truncation, chat_template: prompt building as in training
            (`data.chat_template`: the chat template or raw text); `source` names the data.
        seed: seed of the dedicated sampling generator.
        printer: prints one line per evaluation on the main process.
        progress: show a progress bar over the questions on the main process.
        output_dir: where `eval/step-<N>.jsonl` goes (written by the main process); None = not written.
        extract_answer: response text -> the answer it states, reported per question
            (`rewards.build.answer_extractor`).
        eval_on_start: also evaluate before the first step of a fresh run (logged as step 0, answers in
            `eval/step-00000000.jsonl`).
        make_engine: model -> the callback's own `GenerationEngine` for train types without a rollout engine
            (tagged policy_version -1 until the first sync); None: the default `paged` engine.

    Raises:
        ValueError: for `eval_steps < 1` or no records.
    """

    def __init__(self, *, records: Sequence, tokenizer, rewards, settings: EvalSettings, eval_steps: int,
                 learner, dist, max_prompt_length: int, system_prompt: Optional[str] = None,
                 truncation: str = "error", chat_template: Optional[bool] = None, source: str = "data.eval_path",
                 seed: int = 0,
                 printer=tqdm.write, progress: bool = True, output_dir: Optional[Path] = None,
                 extract_answer=None, eval_on_start: bool = False, make_engine=None,
                 pass_threshold: float = CORRECT_SCORE):
        if eval_steps < 1:
            raise ValueError(f"train.eval_steps: expected >= 1 for an evaluation callback, got {eval_steps}")
        if len(records) == 0:
            raise ValueError("data.eval_path: no questions to evaluate")
        # every rank of a tensor-parallel group evaluates its group's share together (the learner's engine is split
        # over them); the group's first rank alone counts it (`lead`). An engine of its own (offline train types) is
        # a whole copy on every rank: each rank takes its own share then.
        tp = getattr(dist, "tp_size", 1) if learner.rollout_engine is not None else 1
        self.records = list(records)[dist.rank // tp::dist.world_size // tp]
        self.tp, self.lead = tp, dist.rank % tp == 0
        self.num_questions = len(records)
        self.tokenizer, self.rewards, self.settings, self.eval_steps = tokenizer, rewards, settings, eval_steps
        self.pass_threshold = pass_threshold
        self.learner, self.dist, self.seed, self.printer = learner, dist, seed, printer
        self.max_prompt_length, self.system_prompt = max_prompt_length, system_prompt
        self.truncation, self.source, self.chat_template = truncation, source, chat_template
        self.progress = progress and dist.is_main
        self.output_dir, self.extract_answer = output_dir, extract_answer
        self.eval_on_start = eval_on_start
        self._own_engine = None
        self._said_truncated = False  # the once-note on responses cut by max_new_tokens
        self.make_engine = make_engine or (lambda model: build_engine("paged", model, policy_version=-1,
                                                                      pad_token_id=tokenizer.pad_token_id))

    def engine(self, policy_version: int):
        """The learner's rollout engine, or (offline train types) this callback's own copy of the policy."""
        engine = self.learner.rollout_engine
        if engine is not None:
            return engine
        if self._own_engine is None:  # a skeleton filled by the first sync (the policy may be sharded)
            model = empty_model(self.learner.policy.model.config, device=self.dist.device)
            self._own_engine = self.make_engine(model)
        return self._own_engine

    def player(self):
        """The learner's multi-turn runner when its samples are episodes (`rollout.tools`, `rollout.environment`):
        the evaluation plays episodes with the same tools, environment and caps; None for single-turn jobs."""
        runner = getattr(getattr(self.learner, "experience", None), "runner", None)
        return runner if hasattr(runner, "play") else None

    def on_train_begin(self, trainer) -> None:
        """A fresh run (global_step 0) keeps an earlier run's answers: an `eval/` folder with `step-*.jsonl` files is
        renamed to `eval.<timestamp>/` (main process), as `MetricsLogger` keeps an old metrics.jsonl. A resumed run
        keeps `eval/` as it is (evaluations after the checkpoint are redone and rewritten)."""
        if self.output_dir is None or not self.dist.is_main or trainer.state.global_step != 0:
            return
        folder = Path(self.output_dir) / "eval"
        if folder.is_dir() and any(folder.glob("step-*.jsonl")):
            stamp = time.strftime('%Y%m%d-%H%M%S')
            kept, count = folder.with_name(f"eval.{stamp}"), 1
            while kept.exists():  # two fresh starts within a second
                kept, count = folder.with_name(f"eval.{stamp}-{count}"), count + 1
            try:
                folder.rename(kept)
            except OSError as err:
                raise OutputWriteError.of(folder, err) from None
            self.printer(f"kept the previous run's evaluation answers in {kept}")

    def before_first_step(self, trainer, metrics) -> None:
        """With `eval_on_start`, evaluate the starting policy (step 0 of a fresh run), adding `eval/*` in place."""
        if self.eval_on_start:
            metrics.update(self.run(trainer.state.policy_version, 0, should_stop=_stop_requested(trainer)))

    def on_step_end(self, trainer, metrics) -> None:
        """Evaluate after every `eval_steps`-th and after the last step, adding the `eval/*` metrics in place; not
        when the step boundary already agreed to stop (a stop signal: the checkpoint comes first)."""
        step = trainer.state.global_step
        stopping = trainer.boundary is not None and trainer.boundary.stop
        if (step % self.eval_steps == 0 or step == trainer.state.max_steps) and not stopping:
            metrics.update(self.run(trainer.state.policy_version, step, should_stop=_stop_requested(trainer)))

    def on_train_end(self, trainer) -> None:
        """End the reward functions' worker processes."""
        self.rewards.close()

    def on_train_abort(self, trainer) -> None:
        """End the reward functions' worker processes."""
        self.rewards.close()

    @torch.no_grad()
    def run(self, policy_version: int, step: int, *, should_stop: Callable[[], bool] = lambda: False
            ) -> dict[str, torch.Tensor]:
        """Evaluate the current policy; returns the `eval/*` metrics (0-dim tensors) of all ranks' questions, or none
        when `should_stop` (asked before each batch; a stop signal) ended it on some rank: then no answers are
        written and one line says so.

        Raises:
            RewardFunctionError: a reward function's bug, or too many failed reward calls (as in training).
        """
        start = time.perf_counter()
        engine = self.engine(policy_version)
        sync_weights(engine, self.learner.policy.full_weights, policy_version)
        asleep = getattr(engine, "asleep", False)
        if asleep:
            engine.wake()
        result = EvalResult(reward_names=list(self.rewards.names))  # a rank without questions adds zeros
        nonfinite = None
        try:
            if self.records:
                generator = torch.Generator(device=self.dist.device).manual_seed(self.seed)
                result = evaluate(engine, self.tokenizer, self.records, rewards=self.rewards, settings=self.settings,
                                  max_prompt_length=self.max_prompt_length, system_prompt=self.system_prompt,
                                  truncation=self.truncation, chat_template=self.chat_template, source=self.source,
                                  stop_token_ids=stop_token_ids(self.learner.policy.model.config, self.tokenizer),
                                  generator=generator, extract_answer=self.extract_answer,
                                  pass_threshold=self.pass_threshold, progress=self.progress, leave=False,
                                  desc=f"eval step {step}", log=_quiet,
                                  should_stop=should_stop if self.tp == 1 else lambda: False,  # the group's batches
                                  # must agree: under tensor parallelism the step boundary after it stops the job
                                  player=self.player())
        except FloatingPointError as err:  # non-finite logits in the sampler: one line, not its traceback, raised
            nonfinite = err                 # on every rank together once the sums below carried the flag
            result = EvalResult(reward_names=list(self.rewards.names))
        finally:
            if getattr(engine, "prefix_cache", None) is not None:
                engine.prefix_cache.clear()
            if asleep:
                engine.sleep()
        fault = self._nonfinite_on_some_rank(nonfinite, policy_version)
        if fault is not None:
            raise fault
        local = {key: value if self.lead or key == "interrupted" else 0.0 for key, value in result.sums().items()}
        summed = dict(zip(local, self.dist.all_reduce_sum(torch.tensor(list(local.values()), dtype=torch.float64,
                                                                       device=self.dist.device)).tolist()))
        if summed["interrupted"]:  # the same decision on every rank: the sums are
            if self.dist.is_main:
                self.printer(f"eval step {step}: interrupted by a stop signal after {time.perf_counter() - start:.1f} "
                             f"s; no eval metrics for this step")
            return {}
        stats = eval_statistics(summed, result.reward_names)
        if self.output_dir is not None:
            self.write_examples(step, result.examples if self.lead else [])
        seconds = time.perf_counter() - start
        questions = int(round(summed["questions"]))
        if self.dist.is_main:
            self.printer(f"eval step {step}: accuracy {stats['accuracy']:.4f} (95% Wilson [{stats['ci_low']:.4f}, "
                         f"{stats['ci_high']:.4f}]), mean reward {stats['reward_mean']:.4f} "
                         f"([{stats['reward_mean_ci_low']:.4f}, {stats['reward_mean_ci_high']:.4f}]) on "
                         f"{questions} questions, {seconds:.1f} s")
        if stats["truncated_fraction"] > 0.5 and not self._said_truncated and self.dist.is_main:
            self._said_truncated = True
            self.printer(f"eval step {step}: max_new_tokens ({self.settings.max_new_tokens}) cut "
                         f"{stats['truncated_fraction']:.0%} of the responses before they ended: the rewards scored "
                         "unfinished answers (eval/truncated_fraction counts it at every evaluation; said once)")
        metrics = {"eval/accuracy": stats["accuracy"], "eval/accuracy_ci_low": stats["ci_low"],
                   "eval/accuracy_ci_high": stats["ci_high"], "eval/reward_mean": stats["reward_mean"],
                   "eval/reward_mean_ci_low": stats["reward_mean_ci_low"],
                   "eval/reward_mean_ci_high": stats["reward_mean_ci_high"], "eval/num_questions": float(questions),
                   "eval/truncated_fraction": stats["truncated_fraction"]}
        for name, values in stats["rewards"].items():
            metrics.update({f"eval/rewards/{name}/{key}": value for key, value in values.items()})
        metrics.update({f"eval/episodes/{key}": value for key, value in stats.get("episodes", {}).items()})
        metrics["time/eval_seconds"] = seconds
        return {key: torch.tensor(value) for key, value in metrics.items()}

    def _nonfinite_on_some_rank(self, err: Optional[FloatingPointError],
                                policy_version: int) -> Optional[NonFiniteError]:
        """The `NonFiniteError` every rank raises together (`agreed`) when the sampler met non-finite logits on some
        rank (`err` on this one), or None: the ranks agree through `DistributedContext.first_failure` before the
        sums, so no rank is left waiting in their all-reduce; the line is this rank's own, else the first failing
        rank's."""
        line = self.dist.first_failure(None if err is None else str(nonfinite_sampling("evaluation", policy_version,
                                                                                       err)))
        if line is None:
            return None
        fault = NonFiniteError(line)
        fault.agreed = True
        return fault

    def write_examples(self, step: int, examples: list[dict]) -> None:
        """Gather every rank's per-question results and write them, in question order, to
        `output_dir/eval/step-<step>.jsonl` on the main process (`fsutil.write_atomic`: a reader sees no file or
        the whole of it).

        Raises:
            OutputWriteError: on the main process, the file cannot be written (nothing of it is left).
        """
        gathered = [ex for part in self.dist.gather_objects(examples) for ex in part]
        if not self.dist.is_main:
            return
        path = Path(self.output_dir) / "eval" / f"step-{step:08d}.jsonl"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, "".join(json.dumps(ex, ensure_ascii=False) + "\n"
                                       for ex in sorted(gathered, key=lambda ex: ex["index"])))
        except OSError as err:
            raise OutputWriteError.of(path, err) from None


def build_evaluation(config, dist, learner, tokenizer) -> Optional[EvaluationCallback]:
    """The evaluation callback of a validated `astrai.config.Config`, or None when `train.eval_steps` is 0. Its
    rewards are the job's (`rewards.build.evaluation_specs`), built over the held-out records' columns, with
    training's workers and timeouts.

    Raises:
        ValueError / BackendUnavailableError: (one line) what its own engine (offline train types) would refuse
            (`check_rollout_engine`).
        DataError: `data.eval_path` missing or malformed (naming `data.eval_path`).
        RewardFunctionError: a reward function that cannot be loaded or served by the held-out data (naming it).
    """
    if not config.train.eval_steps:
        return None
    if learner.rollout_engine is None:  # its own engine, built at the first evaluation: what it refuses, now
        check_rollout_engine(config, learner.policy.model.config, dist.device)
    d = config.data
    specs = evaluation_specs(config)
    records = load_eval_records(config, tokenizer, main=dist.is_main, check_rewards=False)
    return EvaluationCallback(
        records=records, tokenizer=tokenizer, rewards=build_rewards(config, records, specs=specs),
        settings=EvalSettings(max_new_tokens=config.rollout.max_new_tokens), eval_steps=config.train.eval_steps,
        learner=learner, dist=dist, max_prompt_length=d.max_prompt_length, system_prompt=d.system_prompt,
        truncation=d.truncation, chat_template=d.chat_template, source=str(d.eval_path),
        seed=config.train.seed, progress=config.train.progress_bar, output_dir=Path(config.train.output_dir),
        extract_answer=answer_extractor(specs), eval_on_start=config.train.eval_on_start,
        make_engine=lambda model: build_rollout_engine(config, model, tokenizer, policy_version=-1))


def load_eval_records(config, tokenizer, *, main: bool = True, check_rewards: bool = True) -> list:
    """The held-out records of `data.eval_path` (the first `data.eval_limit`), with their prompts encoded once as
    training encodes them, so an overlong prompt under `data.truncation=error` stops the job at start-up and what
    filter/left do is said once (on the `main` process). The answer field is required only when an evaluation
    reward reads it (`rewards.build.answer_readers`); reference answers such a reward can never match are warned
    about on `main`. With `check_rewards`, the evaluation's reward functions are also loaded and matched to the
    records' columns in this process (no workers started; what `--check` needs).

    Raises:
        DataError: `data.eval_path` missing or malformed (naming `data.eval_path`), or an overlong prompt.
        RewardFunctionError: with `check_rewards`, a reward function that cannot be loaded or served.
    """
    d = config.data
    specs = evaluation_specs(config)
    readers = answer_readers(specs)
    dataset = PromptDataset(d.eval_path, prompt_field=d.prompt_field, answer_field=d.answer_field,
                            field="data.eval_path", require_answers=bool(readers))
    records = dataset.records[:d.eval_limit]
    for spec in readers if main else ():
        message = unscorable_warning(spec.function, [r.answer for r in records], source=str(d.eval_path),
                                     field=d.answer_field)
        if message:
            warnings.warn(message, stacklevel=2)
    encode_prompt_records([r.prompt for r in records], tokenizer, system_prompt=d.system_prompt,
                          chat_template=d.chat_template, limit=d.max_prompt_length,
                          limit_name="data.max_prompt_length", policy=d.truncation, source=str(d.eval_path),
                          log=print if main else _quiet)
    if check_rewards:
        build_rewards(config, records, specs=specs, num_workers=0).close()
    return records


def _stop_requested(trainer) -> Callable[[], bool]:
    """Whether a stop signal arrived on this rank (`StopSignals.requested`), asked between evaluation batches."""
    boundary = trainer.boundary
    return (lambda: False) if boundary is None else (lambda: boundary.signals.requested)
