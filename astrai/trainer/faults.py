"""What a job does when the cluster interferes: exit codes, stop signals and the step-boundary agreement.

A signal only sets a flag (`StopSignals`): SIGTERM (Slurm preemption, Kubernetes eviction, `torchrun` forwarding a
Ctrl-C or a SIGTERM it received), SIGINT (Ctrl-C) and SIGUSR1 (Slurm's `--signal=USR1@N` before the time limit).
The flag is read at the next optimizer-step boundary of the loop (`StepBoundary.agree`), where one all-reduce (max)
over the ranks of [stop requested, checkpoint due] makes every rank take the same decision at the same step: every
rank then publishes the same step and the job exits with `EXIT_PREEMPTED`, unless that step was the run's last
(`max_steps`): the run is then complete, publishes its final checkpoint and exits 0 (a scheduler must not requeue a
finished run), saying so in one line (`TrainerState.signal_at_end`). Further signals change nothing (the flag is
already set; but one that lands while the main thread waits on an in-process tool or environment call, which
nothing else can end, interrupts it: `StopSignals`): a save in progress finishes; SIGKILL still kills at once, and
the publish protocol then leaves the previous checkpoint visible (`astrai.checkpoint.publish`).

Exit codes (docs/launch.md): 0 done; 1 an unexpected error (a traceback); `EXIT_REFUSED` (2) the job cannot go on
as configured: bad input, no space for a checkpoint, a file the job writes that cannot be written (a full disk for
metrics.jsonl: `OutputWriteError`), `train.output_dir` locked by another job, ranks that disagree, non-finite
training; `EXIT_PREEMPTED` (75, sysexits' EX_TEMPFAIL: "try again later") stopped by a signal before its last
step after publishing a checkpoint, resume to continue; `EXIT_TIMEOUT` (124, as coreutils' `timeout`) a rank
stopped answering within `distributed.timeout_seconds`.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Optional

import torch

from astrai.outputs import OutputWriteError  # noqa: F401 - a file the job writes cannot be written (exit code 2)
from astrai.rewards.workers import in_process_call_waited, interrupt_in_process_call

EXIT_REFUSED = 2
EXIT_PREEMPTED = 75
EXIT_TIMEOUT = 124
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class JobFault(RuntimeError):
    """A fault the job stops for with one line and `exit_code` (every rank raises it; rank 0 prints it).

    `agreed` is True on an instance every rank raised at the same point (after a collective that carried it), so
    every rank ends now and none waits for another in a collective (the launch scripts then take the job's code
    without the launcher's failure report: `astrai.train`). `OutputWriteError` (`astrai.outputs`, torch-free so
    that every layer can raise it) is the same kind of fault for a file the job writes."""

    exit_code = 1
    agreed = False
    every_rank = True  # False: raised by one rank alone, which then says it (not only rank 0)


class NonFiniteError(JobFault):
    """Too many optimizer steps in a row had a non-finite loss or gradient norm (`train.max_nonfinite_steps`), or
    parameters about to be published are not finite."""

    exit_code = EXIT_REFUSED


def nonfinite_sampling(phase: str, policy_version: int, err: FloatingPointError) -> NonFiniteError:
    """The one-line fault of a sampler that met non-finite logits (`FloatingPointError` from
    `astrai.rollout.row_sampling`) while `phase` ("the rollout", "evaluation") sampled the weights of
    `policy_version`: the guard of the optimizer step, carried to the phases that sample."""
    fault = NonFiniteError(f"{phase} of policy_version {policy_version} met non-finite logits ({err}); the job "
                           "stops and publishes nothing of this step (a model loaded with NaN/inf weights, or "
                           "activations that overflow its dtype: try float32)")
    fault.agreed = getattr(err, "agreed", False)  # every rank raises it together (`RolloutRunner.generate_agreed`)
    return fault


class StepAbandoned(Exception):
    """A stop request interrupted a step before it trained (the reward scoring of its rollout: `make_rollout` of
    the rollout learners), and every rank raises this together (the ranks agreed right after the scoring). The
    learner has put back the state the step's collection advanced (the data position, the sampling RNG, partial
    rollouts in flight, the global RNGs), so the state is the last completed step's: `Trainer.fit` ends the run as
    a stop at that step, whose checkpoint is the final one."""


class GenerationProcessFault(JobFault):
    """A rank's generation process (`rollout.placement: separate`, `astrai.rollout.remote`) died or failed
    unexpectedly: the job stops in one line (exit code 1; the last published checkpoint is where to resume). Only
    that rank raises it (the others stop when their next collective times out: `StalledRankError`)."""

    every_rank = False


class StalledRankError(JobFault):
    """A collective or a wait on another rank did not complete within `distributed.timeout_seconds`."""

    exit_code = EXIT_TIMEOUT


class StopSignals:
    """Signal handlers that record a stop request instead of ending the process.

    `install()` replaces the handlers of `STOP_SIGNALS` (main thread only; elsewhere it does nothing) and `restore()`
    puts the previous ones back. The handler stores the signal's name and writes one line to stderr with `os.write`
    (safe inside a handler). It raises only on a second signal while the main thread waits on an in-process call of
    user code (a tool or an environment with 0 workers, which no timeout or stop poll ends:
    `astrai.rewards.workers.in_process_call`): `CallInterrupted` into that call, and the step is abandoned. Anywhere
    else it never raises, so it cannot interrupt a checkpoint being written.

    Attributes:
        received: the name of the first signal received ("SIGTERM" ...), None while none was.
        count: signals received so far.
    """

    def __init__(self, *, rank: int = 0):
        self.rank = rank
        self.received: Optional[str] = None
        self.count = 0
        self._previous: dict[int, object] = {}

    def install(self) -> "StopSignals":
        """Take over the stop signals (a no-op outside the main thread); returns self."""
        if not _in_main_thread():
            return self
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        """Put back the handlers `install` replaced."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    @property
    def requested(self) -> bool:
        """Whether a stop signal arrived on this rank."""
        return self.received is not None

    def _handle(self, signum, frame) -> None:  # noqa: ARG002 - the signal module's signature
        name = signal.Signals(signum).name
        self.count += 1
        if self.received is None:
            self.received = name
            note = (f"rank {self.rank}: {name} received: stopping at the end of this optimizer step (a step still "
                    "scoring its rewards or waiting on a tool or environment worker is abandoned; one waiting on "
                    "such a call in this process takes a second signal), publishing a checkpoint, then exiting with "
                    f"code {EXIT_PREEMPTED} (0 when that step is the run's last: the run is then complete)\n")
        elif in_process_call_waited():
            note = (f"rank {self.rank}: {name} received again: interrupting the in-process tool or environment call "
                    "the rollout waits on (rollout.tool_workers / rollout.environment_workers 0); the step is "
                    "abandoned\n")
        else:
            note = (f"rank {self.rank}: {name} received again: already stopping (a checkpoint being written is "
                    "finished; SIGKILL ends the job at once and keeps the previous checkpoint)\n")
        try:
            os.write(2, note.encode())
        except OSError:
            pass
        if self.count > 1:
            interrupt_in_process_call(name)


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


class StepBoundary:
    """The decisions every rank takes together at an optimizer-step boundary.

    Args:
        signals: this process's stop requests.
        save_minutes: a checkpoint is due when this many minutes passed since the last one on rank 0's clock (None:
            never by time).
        max_minutes: the run's time is up when this many minutes passed since `start()` on rank 0's clock
            (`train.max_minutes`; None: no limit).
        is_main: whether this is rank 0 (whose clock decides).

    Attributes:
        stop: a stop signal arrived on some rank (as of the last `agree`).
        save_due: a checkpoint is due by `save_minutes`.
        out_of_time: `max_minutes` have passed.
    """

    def __init__(self, signals: StopSignals, *, save_minutes: Optional[float] = None,
                 max_minutes: Optional[float] = None, is_main: bool = True):
        self.signals = signals
        self.save_minutes = save_minutes
        self.max_minutes = max_minutes
        self.is_main = is_main
        self.last_save = self.started = time.monotonic()
        self.stop = False
        self.save_due = False
        self.out_of_time = False

    def start(self) -> None:
        """The training clock of `max_minutes` starts now (`Trainer.fit` calls it before the first step)."""
        self.started = time.monotonic()

    def saved(self) -> None:
        """A checkpoint was just published: the time-based period starts again."""
        self.last_save = time.monotonic()

    def agree(self, dist, *, timed: bool = True) -> tuple[bool, bool]:
        """(stop, save due), the same on every rank: the maximum over ranks of this rank's flags (one all-reduce of
        three numbers; none with one process). Stop is a signal, or, when `timed`, `max_minutes` passed (the loop
        passes `timed=False` before the first step, so a run with a time limit trains at least one step). Also kept
        as `self.stop` (the signal), `self.save_due` and `self.out_of_time`."""
        now = time.monotonic()
        due = self.is_main and self.save_minutes is not None and now - self.last_save >= 60.0 * self.save_minutes
        late = (timed and self.is_main and self.max_minutes is not None
                and now - self.started >= 60.0 * self.max_minutes)
        flags = torch.tensor([float(self.signals.requested), float(due), float(late)], device=dist.device)
        if dist.world_size > 1:
            flags = dist.all_reduce_max(flags)
        stop, save, late = (bool(x) for x in flags.tolist())
        self.stop, self.save_due, self.out_of_time = stop, save, late
        return stop or late, save


def poison_nonfinite(loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(`loss` times 1, or times NaN when `loss` is not finite; whether it is finite (0-dim bool)), on the device.

    Multiplying by exactly 1 changes neither the loss nor its gradients by a bit. Multiplying a non-finite loss by
    NaN makes every gradient it reaches NaN (NaN times 0 is NaN), so one rank's non-finite loss reaches every rank
    through the data-parallel gradient reduction, and the global gradient norm, the same number on every rank, carries
    the decision to skip the step: no extra collective and no host synchronisation here."""
    finite = torch.isfinite(loss.detach())
    return loss * torch.where(finite, 1.0, float("nan")).to(loss.dtype), finite


class NonFiniteCounter:
    """Counts optimizer steps skipped in a row for a non-finite loss or gradient norm, per trained model.

    Args:
        limit: `train.max_nonfinite_steps`: this many skipped steps of one model in a row raise `NonFiniteError`.
    """

    def __init__(self, limit: int):
        self.limit = limit
        self.in_a_row: dict[str, int] = {}

    def applied(self, name: str) -> None:
        """`name` took a finite step: its count starts again."""
        self.in_a_row[name] = 0

    def skipped(self, name: str, *, step: int, grad_norm: float, count: bool = True, is_main: bool = True) -> None:
        """`name` skipped the optimizer step of loop step `step` (every rank calls it alike). `count` False: a loss
        scaler's overflow skip (fp16), said but not counted towards the limit.

        Raises:
            NonFiniteError: the limit is reached (one line: the model, the count, the step, the norm).
        """
        row = self.in_a_row.get(name, 0) + int(count)
        self.in_a_row[name] = row
        if row >= self.limit:
            raise NonFiniteError(f"train.max_nonfinite_steps: {row} {name} optimizer steps in a row had a non-finite "
                                 f"loss or gradient norm (the last at step {step}, gradient norm {grad_norm:g}); "
                                 "each was skipped and nothing non-finite was published: lower optim.learning_rate, "
                                 "check the data, or resume from the last good checkpoint")
        if is_main:
            why = "a non-finite loss or gradient norm" if count else "a loss-scale overflow (fp16)"
            print(f"step {step}: {name} optimizer step skipped on every rank ({why}, gradient norm {grad_norm:g}; "
                  f"{row} in a row, {self.limit} stop the job)", file=sys.stderr)
