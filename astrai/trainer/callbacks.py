"""Standard callbacks: metrics logging (metrics.jsonl + console), completions logging (completions.jsonl), progress
bar, timing, checkpointing. `JsonlFile` is the run's jsonl file behaviour both loggers share."""

from __future__ import annotations

import json
import os
import time
import warnings
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
from tqdm.auto import tqdm

from astrai.checkpoint.fsutil import write_atomic
from astrai.outputs import OutputWriteError, skipped_lines
from astrai.trainer.loop import Callback

CONSOLE_KEYS = (
    ("rollout/reward_mean", "reward"), ("rollout/kl", "kl"), ("critic/loss", "value_loss"),
    ("critic/explained_variance", "explained_var"), ("policy/loss", "policy_loss"),
    ("policy/clipfrac", "clipfrac"), ("rollout/logprob_gap", "logprob_gap"), ("train/loss", "loss"),
    ("distill/reverse_kl", "reverse_kl"),  # distillation (GRPO/PPO with a teacher): the KL to the teacher
    ("distill/jsd", "jsd"),  # top-k logit distillation (distill.jsd_top_k): the generalised JSD to the teacher
    ("dpo/accuracy", "accuracy"), ("dpo/margin", "margin"), ("moe/aux_loss", "aux_loss"),
    ("time/step_seconds", "s/step"),
)


class StepTimer(Callback):
    """Adds `time/step_seconds` (wall time of the step) and `time/elapsed_seconds` to the step's metrics."""

    def on_train_begin(self, trainer) -> None:
        self._start = self._last = time.perf_counter()

    def on_step_end(self, trainer, metrics) -> None:
        now = time.perf_counter()
        metrics["time/step_seconds"] = torch.tensor(now - self._last)
        metrics["time/elapsed_seconds"] = torch.tensor(now - self._start)
        self._last = now


class DegenerateSignals:
    """Says once, loudly (a warning), when the training signal of an online run means less than the user thinks,
    from the metrics records (`observe` each, `finish` at the end):

    - `rollout/advantage_abs_mean` 0 on `rollouts` rollouts in a row: every sample's advantage was zero (GRPO: every
      group's rewards were equal), so those updates had no policy gradient;
    - `rollout/reward_std` 0 on every rollout of a run of at least `rollouts` rollouts, with one `reward_mean`:
      the reward was one constant on every sample, at the end of the run.

    Rollouts are told apart by `rollout/policy_version` (a rollout's later minibatches repeat its metrics).
    """

    def __init__(self, rollouts: int = 3):
        self.rollouts = rollouts
        self._zero_streak = 0
        self._rewards: set[float] = set()  # the distinct reward means of the run while every reward_std is 0
        self._constant, self._seen, self._said, self._version = True, 0, set(), None

    def observe(self, record: dict) -> None:
        """Take one step's record (floats); warn the first time a condition holds."""
        version = record.get("rollout/policy_version")
        if "rollout/reward_std" not in record or (version is not None and version == self._version):
            return
        self._version, self._seen = version, self._seen + 1
        zero = record.get("rollout/advantage_abs_mean") == 0.0
        self._zero_streak = self._zero_streak + 1 if zero else 0
        if self._zero_streak >= self.rollouts and "advantages" not in self._said:
            self._said.add("advantages")
            warnings.warn(f"every advantage was 0 on the last {self._zero_streak} rollouts (rollout/advantage_abs_mean):"
                          f" the responses of each group scored alike, so these updates had no policy gradient; "
                          f"a reward that tells responses apart, a larger group size or rollout.dynamic_sampling "
                          f"helps (said once)", stacklevel=2)
        self._constant = self._constant and record["rollout/reward_std"] == 0.0
        self._rewards.add(record.get("rollout/reward_mean"))

    def finish(self) -> None:
        """At the end of the run: warn when the reward was one constant throughout."""
        if self._constant and self._seen >= self.rollouts and len(self._rewards) == 1:
            warnings.warn(f"the reward was {next(iter(self._rewards)):g} on every sample of all {self._seen} "
                          f"rollouts of this run: it never told responses apart, so nothing was learned from it; "
                          f"check the reward functions against a few completions (train.log_completions, "
                          f"train.eval_steps, python -m astrai.evaluate)", stacklevel=2)


class JsonlFile:
    """A run's jsonl file under the output directory, one JSON object per line, each with a "step" (main process).

    `open()` prepares what an earlier run left there: a fresh run (`resume_step` None) keeps an existing file under a
    timestamped name (`<stem>.<YYYYmmdd-HHMMSS>.jsonl`, never overwritten); a resumed run drops the records of steps
    after the resumed checkpoint (they are about to be redone) and torn (crash-truncated) lines, said once, rewriting
    the file atomically (a line that is not JSON before the last one is not a crash's: the file as it was is kept
    under a timestamped name first). The file is then opened for appending; each record is one line written whole (`os.write`
    until all of it is written); `flush()` fsyncs it.

    A write that fails (a full disk, a file-size limit, a read-only filesystem) cuts the file back to its last whole
    record, so no reader meets a torn line, and raises `OutputWriteError` (one line naming the file and the cause);
    the file then takes no more records.

    Args:
        path: the file (`<output_dir>/metrics.jsonl` ...); its parent is created on `open()`.
        resume_step: the step of the checkpoint the run resumed from, or None for a fresh run.
        printer: says where a previous run's file was kept.
    """

    def __init__(self, path: str | os.PathLike, *, resume_step: Optional[int] = None,
                 printer: Callable[[str], None] = tqdm.write):
        self.path, self.resume_step, self.printer = Path(path), resume_step, printer
        self._fd: Optional[int] = None
        self._size = 0  # bytes of whole records in the file
        self._failed = False

    @property
    def is_open(self) -> bool:
        """Whether `open()` was called and `close()` not yet."""
        return self._fd is not None

    def open(self) -> None:
        """Prepare an existing file (see the class docstring) and open it for appending.

        Raises:
            OutputWriteError: the directory, the kept or rewritten file, or the file itself cannot be written.
        """
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if self.path.exists():
                self._prepare_existing()
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
            self._size = os.fstat(self._fd).st_size
        except OSError as err:
            raise OutputWriteError.of(self.path, err) from None
        self._failed = False

    def _prepare_existing(self) -> None:
        """Keep (fresh run) or cut back to the resumed step (resumed run) the file an earlier run left."""
        if self.resume_step is None:
            kept = self._kept_name()
            os.replace(self.path, kept)
            self.printer(f"kept the previous run's {self.path.stem} as {kept}")
            return
        data = self.path.read_bytes()
        raw = data.split(b"\n")
        steps = [(number, line, _record_step(line)) for number, line in enumerate(raw, start=1) if line.strip()]
        bad = [number for number, _, step in steps if step is None]
        if bad:
            said = skipped_lines(self.path, bad, last=steps[-1][0])
            if bad != [steps[-1][0]]:  # more than a torn last line: what the others held stays readable
                kept = self._kept_name()
                write_atomic(kept, data)
                said = f"warning: {said}; the file as it was is kept as {kept}"
            self.printer(said)
        lines = [line for _, line, step in steps if step is not None and step <= self.resume_step]
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            tmp.write_bytes(b"".join(line + b"\n" for line in lines))
            os.replace(tmp, self.path)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise

    def _kept_name(self) -> Path:
        """A new `<stem>.<YYYYmmdd-HHMMSS>[-N].jsonl` beside the file (never an existing one)."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        kept = self.path.with_name(f"{self.path.stem}.{stamp}{self.path.suffix}")
        count = 1
        while kept.exists():  # two fresh starts within a second
            kept, count = self.path.with_name(f"{self.path.stem}.{stamp}-{count}{self.path.suffix}"), count + 1
        return kept

    def write(self, record: dict) -> None:
        """Append one record (one line, written whole). A file whose write failed takes no more (no-op).

        Raises:
            OutputWriteError: the write failed; the file was cut back to its last whole record.
        """
        if self._fd is None or self._failed:
            return
        line = (json.dumps(record) + "\n").encode("utf-8")
        data = memoryview(line)
        try:
            while data:  # a short write (the disk filling up) is followed by one that says why
                data = data[os.write(self._fd, data):]
        except OSError as err:
            self._failed = True
            try:  # drop the part of the record that was written (shrinking needs no space)
                os.ftruncate(self._fd, self._size)
            except OSError:
                pass  # the readers skip a torn last line
            raise OutputWriteError.of(self.path, err) from None
        self._size += len(line)

    def flush(self) -> None:
        """fsync the file (no-op when it is not open, or after a failed write).

        Raises:
            OutputWriteError: the filesystem refused it (a network filesystem says a full disk here).
        """
        if self._fd is not None and not self._failed:
            try:
                os.fsync(self._fd)
            except OSError as err:
                self._failed = True
                raise OutputWriteError.of(self.path, err) from None

    def close(self) -> None:
        """fsync and close the file (no-op when it is not open).

        Raises:
            OutputWriteError: the final fsync failed (the file is closed all the same).
        """
        if self._fd is not None:
            try:
                self.flush()
            finally:
                fd, self._fd = self._fd, None
                os.close(fd)

    def abort(self) -> None:
        """The run failed: close what was written, as `close`; a full disk may refuse it: nothing more to do then."""
        try:
            self.close()
        except (OSError, OutputWriteError):
            self._fd = None


def _record_step(line: bytes) -> Optional[int]:
    """The "step" of one jsonl line; None for a blank, torn (crash-truncated) or undecodable line."""
    try:
        return int(json.loads(line.decode("utf-8"))["step"])
    except (ValueError, KeyError, TypeError):
        return None


class MetricsLogger(Callback):
    """Writes one JSON object per optimizer step to `<output_dir>/metrics.jsonl` (main process only) and
    prints the main metrics (and the samples each reward function failed on, when any) every `logging_steps` steps;
    warns once when the signal is degenerate (`DegenerateSignals`).

    Metrics arrive as detached tensors; this is the one place that turns them into Python numbers.
    The file is a `JsonlFile`: on a resumed run, records of steps after the resumed checkpoint are dropped first; on
    a fresh run an existing file is kept under a timestamped name, never overwritten.
    """

    def __init__(self, output_dir: str | os.PathLike, *, logging_steps: int, enabled: bool = True,
                 resume_step: Optional[int] = None, printer: Callable[[str], None] = tqdm.write):
        self.signals = DegenerateSignals()
        self.file = JsonlFile(Path(output_dir) / "metrics.jsonl", resume_step=resume_step, printer=printer)
        self.logging_steps = logging_steps
        self.enabled = enabled
        self.printer = printer

    @property
    def path(self) -> Path:
        """`<output_dir>/metrics.jsonl`."""
        return self.file.path

    def on_train_begin(self, trainer) -> None:
        if self.enabled:
            self.file.open()

    def on_log(self, trainer, metrics) -> None:
        """Write `metrics` (the step-0 record) as the record of the current step, without a console line."""
        self._write(trainer, metrics)

    def on_step_end(self, trainer, metrics) -> None:
        record = self._write(trainer, metrics)
        if record is not None:
            self.signals.observe(record)
        if record is not None and (trainer.state.global_step % self.logging_steps == 0 or
                                   trainer.state.global_step == trainer.state.max_steps):
            parts = [f"{short} {record[key]:.4g}" for key, short in CONSOLE_KEYS if key in record]
            parts += [f"{key[len('rewards/'):-len('/failed')]} failed on {record[key]:.4g} samples" for key in record
                      if key.startswith("rewards/") and key.endswith("/failed") and record[key] > 0]
            if record.get("rollout/episodes/env_errors", 0) > 0:  # rollout.environment failures (docs/agents.md)
                parts.append(f"environment errors {record['rollout/episodes/env_errors']:.4g} per episode")
            if record.get("rollout/episodes/tool_errors", 0) > 0:  # failed tool calls (docs/agents.md)
                parts.append(f"tool errors {record['rollout/episodes/tool_errors']:.4g} per episode")
            self.printer(f"step {trainer.state.global_step}/{trainer.state.max_steps} | " + " | ".join(parts))

    def _write(self, trainer, metrics) -> Optional[dict]:
        """Append one record (step, the metrics as floats, policy_version); None when disabled."""
        if not self.enabled:
            return None
        names = sorted(metrics)
        values = torch.stack([metrics[k].detach().float().cpu().reshape(()) for k in names]).tolist()
        record = {"step": trainer.state.global_step, **dict(zip(names, values))}
        record["policy_version"] = trainer.state.policy_version
        self.file.write(record)
        return record

    def flush(self) -> None:
        """Flush and fsync metrics.jsonl (called before a checkpoint covering these steps is published)."""
        self.file.flush()

    def on_train_end(self, trainer) -> None:
        if self.file.is_open:
            self.signals.finish()
        self.file.close()

    def on_train_abort(self, trainer) -> None:
        """The run failed: flush and fsync what was logged (a full disk may refuse it: nothing more to do then)."""
        self.file.abort()


COMPLETION_FIELDS = ("step", "policy_version", "prompt", "completion", "score", "rewards", "advantage",
                     "response_length")
"""The keys of a completions.jsonl record, in order (`policy_gradient.completion_samples` and the step)."""


class CompletionsLogger(Callback):
    """`train.log_completions`: writes the samples the learner exposes for each new rollout (`take_completions()`:
    the first N rows of rank 0's rollout, `policy_gradient.completion_samples`) to `<output_dir>/completions.jsonl`,
    one JSON object per sample with the keys of `COMPLETION_FIELDS` (main process only), and hands them to each of
    `reporters` that has `log_completions(step, records)` (TensorBoard text, a W&B table: `trainer.reporting`).

    `step` is the optimizer step the rollout trained first (the step that collected it). The file is a `JsonlFile`,
    as metrics.jsonl: a resumed run drops the records of steps after its checkpoint, a fresh run keeps an old file
    under a timestamped name.
    """

    def __init__(self, output_dir: str | os.PathLike, *, enabled: bool = True, resume_step: Optional[int] = None,
                 reporters: Sequence[Callback] = (), printer: Callable[[str], None] = tqdm.write):
        self.file = JsonlFile(Path(output_dir) / "completions.jsonl", resume_step=resume_step, printer=printer)
        self.enabled = enabled
        self.sinks = [r.log_completions for r in reporters if callable(getattr(r, "log_completions", None))]

    def on_train_begin(self, trainer) -> None:
        if self.enabled:
            self.file.open()

    def on_step_end(self, trainer, metrics) -> None:
        take = getattr(trainer.learner, "take_completions", None)
        samples = take() if take is not None else []
        if not self.enabled or not samples:
            return
        step = trainer.state.global_step
        records = [{"step": step, **sample} for sample in samples]
        for record in records:
            self.file.write(record)
        for sink in self.sinks:
            sink(step, records)

    def flush(self) -> None:
        """Flush and fsync completions.jsonl (before a checkpoint covering these steps is published)."""
        self.file.flush()

    def on_train_end(self, trainer) -> None:
        self.file.close()

    def on_train_abort(self, trainer) -> None:
        """The run failed: flush and fsync what was logged."""
        self.file.abort()


class ProgressBar(Callback):
    """A tqdm bar over optimizer steps, showing the latest reward (main process only)."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._bar: Optional[tqdm] = None

    def on_train_begin(self, trainer) -> None:
        if self.enabled:
            self._bar = tqdm(total=trainer.state.max_steps, initial=trainer.state.global_step,
                             desc="train", unit="step", dynamic_ncols=True)

    def on_step_end(self, trainer, metrics) -> None:
        if self._bar is not None:
            self._bar.update(1)
            if "rollout/reward_mean" in metrics:
                self._bar.set_postfix(reward=f"{float(metrics['rollout/reward_mean']):.3f}")

    def on_train_end(self, trainer) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def on_train_abort(self, trainer) -> None:
        """An error ends the run: close the bar with a newline (without redrawing it), so the error line printed
        next stands on a line of its own and is the last one on the terminal."""
        if self._bar is not None:
            self._bar.leave = False
            self._bar.close()
            self._bar = None


class CheckpointCallback(Callback):
    """Publishes a checkpoint every `save_steps` steps (0: never by steps), when the step boundary says one is due by
    time (`checkpoint.save_minutes`, `trainer.boundary.save_due`), when a signal or `train.max_minutes` stops the run
    early or a signal arrives during the last step (`TrainerState.signal_at_end`), and at the end when `save_at_end`.

    Args:
        save: called with the trainer; does the publishing (`astrai.checkpoint`).
        before_save: called first (e.g. `MetricsLogger.flush`), so metrics never lag behind a checkpoint: when it,
            or an earlier callback of the step, could not write its file, every rank stops before the publish
            (`Trainer.agree_faults`).
        saved_step: the step of the checkpoint the run resumed from (-1: none), so a run that trains no further
            step does not publish it again.
    """

    def __init__(self, save: Callable, *, save_steps: int, save_at_end: bool,
                 before_save: Callable[[], None] = lambda: None, saved_step: int = -1):
        self.save, self.before_save = save, before_save
        self.save_steps, self.save_at_end = save_steps, save_at_end
        self._last_saved = saved_step

    def _publish(self, trainer) -> None:
        try:
            self.before_save()
        except OutputWriteError as err:  # the logs cannot be flushed: no checkpoint gets ahead of them
            trainer.keep_fault(err)
        trainer.agree_faults()  # every rank stops here, before the publish, when a rank kept a write fault
        self.save(trainer)
        self._last_saved = trainer.state.global_step
        if trainer.boundary is not None:
            trainer.boundary.saved()

    def on_step_end(self, trainer, metrics) -> None:
        by_steps = self.save_steps and trainer.state.global_step % self.save_steps == 0
        by_time = trainer.boundary is not None and trainer.boundary.save_due
        if by_steps or (by_time and trainer.state.global_step < trainer.state.max_steps):
            self._publish(trainer)

    def on_train_end(self, trainer) -> None:
        step = trainer.state.global_step
        early = trainer.state.stopped_by or trainer.state.out_of_time or trainer.state.signal_at_end  # as promised
        if (self.save_at_end or early) and self._last_saved != step and step > 0:
            self._publish(trainer)

    @property
    def last_saved(self) -> int:
        """The step of the newest checkpoint this run published or resumed from (-1: none)."""
        return self._last_saved


class ExperienceEnd(Callback):
    """At the end of training (normal, stopped, or aborted by an error), after the final checkpoint: the learner's
    experience source releases what it holds beyond the checkpoint (`OnlineExperience.close`: the environment
    instances of episodes still in flight, whose `close` then runs). A failure here is warned about, never raised
    over the run's own outcome."""

    def on_train_end(self, trainer) -> None:
        self._close(trainer)

    def on_train_abort(self, trainer) -> None:
        self._close(trainer)

    @staticmethod
    def _close(trainer) -> None:
        close = getattr(getattr(trainer.learner, "experience", None), "close", None)
        if close is None:
            return
        try:
            close()
        except Exception as err:  # noqa: BLE001 - the run's result stands; the user hears of it
            warnings.warn(f"closing the environment instances of the episodes in flight failed: {err}", stacklevel=2)

