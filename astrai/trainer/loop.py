"""The one training loop shared by every train type, and the one seam that backpropagates and steps.

`Trainer.fit()` runs until `max_steps` policy optimizer steps are done. Each iteration asks the learner (one small
class per train type, `trainer/learners/`) for exactly one policy optimizer step. A learner only computes
losses: it hands its micro-batches and a loss function to `Trainer.accumulate_and_step`, which owns the global
token count, the data-parallel loss scale, backward, gradient clipping, the optimizer and scheduler step, the
learning rate actually applied, the optimizer hooks and the `policy_version` bookkeeping, for whichever engine wraps
the model (`models.TrainedModel`). The data position advances in one place too: `consumed_samples` grows by what the
learner's data sampler handed out during the step. The step's metrics are averaged over the data-parallel ranks
(`mean_over_ranks`, one collective) before any callback sees them.

Faults (`trainer.faults`, docs/distributed.md "Faults across ranks"): after each step the ranks agree whether to stop
(a signal on any rank) and whether a checkpoint is due by time (`StepBoundary`); an optimizer step whose loss or
global gradient norm is not finite is skipped on every rank alike, and too many in a row stop the job. A step that a
stop request interrupted before it trained (`faults.StepAbandoned`: its rollout's reward scoring) ends the run at
the last completed step.
"""

from __future__ import annotations

import sys
import threading
import zlib
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable, Mapping, Optional, Protocol, Sequence

import torch

from astrai.checkpoint import Part
from astrai.distributed import DistributedContext
from astrai.cpu_threads import ThreadGovernor, governed
from astrai.outputs import OutputWriteError
from astrai.rollout.remote import RemoteEngineError
from astrai.trainer.faults import (GenerationProcessFault, NonFiniteCounter, StepAbandoned, StepBoundary,
                                   poison_nonfinite)
from astrai.trainer.models import TrainedModel, moe_aux_loss

LossFn = Callable[[Any, torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""(micro-batch, global unit count (0-dim)) -> (loss share (0-dim, with grad), metric shares (detached 0-dim)).

A "share" is the micro-batch's contribution to the step's mean over ALL units (real tokens, pairs ...) of all
micro-batches and ranks: its sum divided by the global count, so shares add up to the global mean."""


@dataclass
class TrainerState:
    """Progress counters (restored on resume; the checkpoint part `trainer_state`).

    Attributes:
        global_step: completed iterations of the loop (one policy optimizer step each).
        policy_version: completed policy optimizer steps; tags the weights the rollout engine holds.
        consumed_samples: records (prompts, examples, pairs) drawn from the data so far, over all ranks.
        max_steps: the run's target number of steps (not restored: the job sets it).
        run_id: the id of the training run (`trainer.runs`; not restored: resolved before the checkpoint loads).
        skipped_steps: optimizer steps (of any trained model) skipped for a non-finite loss or gradient norm.
        stopped_by: the signal that stopped the run before `max_steps` ("SIGTERM" ...), else None (not restored).
        out_of_time: `train.max_minutes` ended the run before `max_steps` (not restored).
        signal_at_end: a stop signal the ranks agreed on after the step that reached `max_steps` (it arrived while
            the last step trained): the run is complete, its final checkpoint is published as for a stop, and it
            ends as done (exit code 0: nothing to resume or requeue) rather than stopped; else None (not restored).
    """

    global_step: int = 0
    policy_version: int = 0
    consumed_samples: int = 0
    max_steps: int = 0
    run_id: Optional[str] = None
    skipped_steps: int = 0
    stopped_by: Optional[str] = None
    out_of_time: bool = False
    signal_at_end: Optional[str] = None

    def state_dict(self) -> dict:
        """JSON-serialisable copy of the counters (written to trainer_state.json)."""
        return asdict(self)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take the counters of a checkpoint (`max_steps` and `run_id` stay this run's)."""
        self.global_step = int(state["global_step"])
        self.policy_version = int(state["policy_version"])
        self.consumed_samples = int(state.get("consumed_samples", 0))
        self.skipped_steps = int(state.get("skipped_steps", 0))


class DataSampler(Protocol):
    """What the loop needs of a learner's data sampler (`astrai.data.PromptSampler`)."""

    @property
    def drawn(self) -> int:
        """Records handed out on this rank since the sampler was created or restored (monotone)."""


class Learner(Protocol):
    """A train type's learner (after RLlib's Learner): owns its trained models, computes losses for one policy optimizer step per call and declares its state.

    Attributes:
        policy: the trained policy (`models.TrainedModel`).
        data_sampler: the sampler its records come from (the data position; `consumed_samples` follows it).
        rollout_engine: the colocated rollout engine of an online train type, else None.
    """

    policy: TrainedModel
    data_sampler: DataSampler
    rollout_engine: Any

    def train_step(self, trainer: "Trainer") -> dict[str, torch.Tensor]:
        """Do one policy optimizer step (through `trainer.accumulate_and_step`); return detached 0-dim metrics."""

    def checkpoint_parts(self) -> dict[str, Part]:
        """The state to checkpoint, as named parts (models, optimizers, schedules, data position, its own state);
        a part marked required must be present to resume (online_ppo: the critic and its optimizer)."""

    def state_dict(self) -> dict:
        """The learner's own resume state (RNGs, rollout in progress); one of its checkpoint parts."""

    def load_state_dict(self, state: dict) -> None:
        """Inverse of `state_dict`."""


class Callback:
    """Hooks of the training loop; every method is optional.

    `before_optimizer_step` / `after_optimizer_step` fire around each optimizer step with the trained model's
    name ("policy" or "critic"); `on_step_end` receives the step's metrics as detached tensors (convert them only
    there). On a fresh run (global_step 0), after every `on_train_begin`, `before_first_step` lets callbacks add
    metrics measured before training (the step-0 evaluation of `train.eval_on_start`) in place; when any were
    added, `on_log` receives them (plus `policy_version`) as the record of step 0.
    """

    def on_train_begin(self, trainer: "Trainer") -> None: ...
    def before_first_step(self, trainer: "Trainer", metrics: dict[str, torch.Tensor]) -> None: ...
    def on_log(self, trainer: "Trainer", metrics: dict[str, torch.Tensor]) -> None: ...
    def before_optimizer_step(self, trainer: "Trainer", name: str) -> None: ...
    def after_optimizer_step(self, trainer: "Trainer", name: str) -> None: ...
    def on_step_end(self, trainer: "Trainer", metrics: dict[str, torch.Tensor]) -> None: ...
    def on_train_end(self, trainer: "Trainer") -> None: ...
    def on_train_abort(self, trainer: "Trainer") -> None: ...


class Trainer:
    """The outer loop: `fit()` calls `learner.train_step(self)` until `state.max_steps`.

    Args:
        learner: the train type's learner.
        dist: process state (rank, world size, device) from `astrai.distributed`.
        max_steps: number of policy optimizer steps to reach.
        max_grad_norm: gradient-norm clip applied to every optimizer (policy and critic alike).
        callbacks: hooks, called in order.
        state: initial counters; fresh when None.
        boundary: the decisions the ranks take together after each step (stop on a signal, a checkpoint due by
            time; `faults.StepBoundary`); None: never stop early.
        max_nonfinite_steps: optimizer steps of one model in a row with a non-finite loss or gradient norm (each
            skipped) after which `NonFiniteError` stops the job.
        threads: each `learner.train_step` (its rollout, scoring passes and updates) runs in its scope, deciding
            at each micro-batch of `accumulate_and_step` and after the last (`astrai.cpu_threads.ThreadGovernor`:
            fewer CPU threads while other processes busy the cores; `runtime.adaptive_threads`); the engine's decode
            steps tick it too (`astrai.cpu_threads.active_governor`). None: the thread count stays as set.
    """

    def __init__(self, learner: Learner, *, dist: DistributedContext, max_steps: int,
                 max_grad_norm: float, callbacks: Iterable[Callback] = (),
                 state: Optional[TrainerState] = None, boundary: Optional[StepBoundary] = None,
                 max_nonfinite_steps: int = 3, threads: Optional[ThreadGovernor] = None):
        self.learner = learner
        self.dist = dist
        self.max_grad_norm = max_grad_norm
        self.callbacks = list(callbacks)
        self.state = state or TrainerState()
        self.state.max_steps = max_steps
        self.version_lock = threading.Lock()
        self.boundary = boundary
        self.nonfinite = NonFiniteCounter(max_nonfinite_steps)
        self.fault: Optional[OutputWriteError] = None
        self.threads = threads

    def _emit(self, hook: str, *args) -> None:
        for callback in self.callbacks:
            try:
                getattr(callback, hook)(self, *args)
            except OutputWriteError as err:  # a file of the main process (metrics.jsonl ...) cannot be written
                self.keep_fault(err)

    def keep_fault(self, err: OutputWriteError) -> None:
        """A write fault this rank met (a callback's file cannot be written): raised at once in a one-process job
        (and when already agreed); with several ranks kept, this rank's other callbacks run on (they may take part
        in collectives, as a checkpoint publish does), and `agree_faults` raises it on every rank together."""
        if err.agreed or self.dist.world_size == 1:
            raise err
        if self.fault is None:
            self.fault = err

    def agree_faults(self) -> None:
        """Raise on every rank at once the write fault any rank kept (`keep_fault`), agreed through
        `DistributedContext.first_failure` (one all-reduce of a flag, no collective with one process; when it is set,
        one gather of the line, prefixed "rank N: " by the other ranks when N is not 0). `fit` calls it after the start-up hooks, after each step's callbacks and after the
        end's; the checkpoint callback before it publishes (a checkpoint never gets ahead of its metrics)."""
        fault, self.fault = self.fault, None
        line = self.dist.first_failure(None if fault is None else str(fault))
        if line is None:
            return
        if fault is None:
            fault = OutputWriteError(line)
        fault.agreed = True  # every rank raises it here
        raise fault

    def _abort(self) -> None:
        """`on_train_abort` of every callback (an exception ends the run; theirs are swallowed: the first is the one
        to report)."""
        for callback in self.callbacks:
            try:
                callback.on_train_abort(self)
            except Exception:  # noqa: BLE001 - the original error is the one to report
                pass

    def fit(self) -> TrainerState:
        """Run the loop to `max_steps`, or until a stop signal (`boundary`: agreed by every rank after a step, again
        after the step's callbacks when they ran long (an evaluation), and once before the first) or, after a step,
        the boundary's time limit (`train.max_minutes`, counted from here);
        returns the final state (`stopped_by` names the signal, `out_of_time` says the time ran out,
        `signal_at_end` names a signal that came during the last step, which still completed the run). Callbacks
        receive each step's metrics averaged over ranks (`mean_over_ranks`), plus `policy_version` and
        `train/skipped_steps`. A file a callback cannot write (`faults.OutputWriteError`: metrics.jsonl on a full
        disk ...) stops every rank together, after that hook's callbacks (`agree_faults`).
        A step abandoned for a stop request (`faults.StepAbandoned`, raised by every rank together: a signal that
        landed during its rollout's reward scoring; the learner put its state back) ends the run as a stop at the
        last completed step: `stopped_by` set, `global_step` not incremented, no callback sees the step, and
        `on_train_end` runs (the final checkpoint is the last completed step's).
        When another exception ends the loop, `on_train_abort` runs instead of `on_train_end` and it propagates."""
        try:
            self._emit("on_train_begin")
            if self.state.global_step == 0:
                start: dict[str, torch.Tensor] = {}
                self._emit("before_first_step", start)
                if start:
                    start["policy_version"] = torch.tensor(self.state.policy_version)
                    self._emit("on_log", start)
            self.agree_faults()  # a file the start-up wrote (metrics.jsonl, eval answers ...) stops every rank now
            if self.boundary is not None:
                self.boundary.start()
            stop = self.boundary is not None and self.boundary.agree(self.dist, timed=False)[0]
            abandoned = False
            while not stop and self.state.global_step < self.state.max_steps:
                drawn = self.learner.data_sampler.drawn
                try:
                    with governed(self.threads):
                        step_metrics = self.learner.train_step(self)
                except StepAbandoned as err:  # every rank alike: the step did not train, the state is the last's
                    if self.dist.is_main:
                        print(f"step {self.state.global_step + 1}: {err}", file=sys.stderr, flush=True)
                    stop = abandoned = True
                    break
                metrics = mean_over_ranks(step_metrics, self.dist)
                # the data-parallel groups' draws (the ranks of one tensor-parallel group draw the same prompts)
                groups = getattr(self.dist, "dp_size", self.dist.world_size)
                self.state.consumed_samples += (self.learner.data_sampler.drawn - drawn) * groups
                self.state.global_step += 1
                metrics["policy_version"] = torch.tensor(self.state.policy_version)
                metrics["train/skipped_steps"] = torch.tensor(float(self.state.skipped_steps))
                stop = self.boundary is not None and self.boundary.agree(self.dist)[0]
                self._emit("on_step_end", metrics)
                self.agree_faults()
                if not stop and self.boundary is not None:  # a signal during the callbacks' work (an evaluation)
                    stop = self.boundary.agree(self.dist, timed=False)[0]  # stops now, not after one more step
            if abandoned:
                received = self.boundary.signals.received if self.boundary is not None else None
                self.state.stopped_by = received or "a signal on another rank"
            elif stop and self.state.global_step < self.state.max_steps:
                if self.boundary.stop:
                    self.state.stopped_by = self.boundary.signals.received or "a signal on another rank"
                else:
                    self.state.out_of_time = True
            elif stop and self.boundary.stop:  # during the last step: the run is complete all the same
                self.state.signal_at_end = self.boundary.signals.received or "a signal on another rank"
        except RemoteEngineError as err:  # this rank's generation process died: one line, not a traceback
            self._abort()
            raise GenerationProcessFault(str(err)) from None
        except BaseException:
            self._abort()
            raise
        try:
            self._emit("on_train_end")
            self.agree_faults()  # the logs closed (flushed) at the end, the final checkpoint's agreement
        except RemoteEngineError as err:  # this rank's generation process died: one line, not a traceback
            self._abort()
            raise GenerationProcessFault(str(err)) from None
        except BaseException:
            self._abort()
            raise
        return self.state

    def accumulate_and_step(self, trained: TrainedModel, micro_batches: Sequence[Any], loss_fn: LossFn, *,
             count: Callable[[Any], torch.Tensor]) -> dict[str, torch.Tensor]:
        """One optimizer step of `trained` over `micro_batches` (gradient accumulation).

        The loss is a token-mean (or pair-mean ...) over the GLOBAL number of units of the step, all micro-batches
        and all data-parallel ranks (docs/conventions.md section 2), so the gradient does not depend on how the
        step's data is split. For each micro-batch: `loss, metrics = loss_fn(micro, num_units)` (a share, see
        `LossFn`), plus the model's weighted MoE load-balancing loss averaged over the micro-batches, times the
        engine's loss scale, backward (gradients synchronised across ranks on the last micro-batch only). A loss that
        is not finite is multiplied by NaN first (`faults.poison_nonfinite`, no host sync), so its NaN gradients reach
        every rank through the reduction. Then clip to `max_grad_norm` and, when the global gradient norm is finite
        (the same decision on every rank; DeepSpeed decides it itself), `before_optimizer_step`, optimizer + scheduler
        step; zero the gradients; for "policy", `policy_version` increments under `version_lock`;
        `after_optimizer_step`. A skipped step changes no weight, optimizer state, schedule or `policy_version`: it is
        counted (`state.skipped_steps`) and said on rank 0, and `max_nonfinite_steps` of one model in a row raise
        `faults.NonFiniteError`.

        Args:
            trained: the model with its optimizer and schedule.
            micro_batches: anything `loss_fn` and `count` take, one per forward/backward.
            loss_fn: see `LossFn`.
            count: micro-batch -> its number of loss units on this rank (0-dim integer tensor).

        Returns:
            detached 0-dim metrics: the loss_fn metrics as this rank's means (shares rescaled by global / local
            units), `<name>/grad_norm` (pre-clip), `<name>/lr` (the learning rate this step applied) and, for MoE
            models, `moe/aux_loss` and `moe/weighted_aux_loss` (per-forward means); with adaptive threads
            `<name>/threads`, the mean torch thread count of its micro-batches.
        """
        local = torch.stack([count(micro) for micro in micro_batches]).sum()
        num_units = self.dist.all_reduce_sum(local).clamp(min=1)
        to_local_mean = num_units / local.clamp(min=1)
        scale = trained.loss_scale
        sums: dict[str, torch.Tensor] = {}
        loss_finite = torch.ones((), dtype=torch.bool, device=local.device)
        governor, threads = self.threads, []  # threads: the count each micro-batch ran with
        with governed(governor):
            for index, micro in enumerate(micro_batches):
                if governor is not None:
                    threads.append(governor.tick())
                with trained.gradient_sync(index == len(micro_batches) - 1):
                    with trained.autocast():
                        loss, metrics = loss_fn(micro, num_units)
                        aux, aux_metrics = moe_aux_loss(trained.model, len(micro_batches))
                    # the auxiliary loss is a per-forward mean: divided by `scale` so that ranks average it
                    total = loss if aux is None else loss + aux.to(loss.dtype) / scale
                    total, finite = poison_nonfinite(total)
                    loss_finite = loss_finite & finite
                    trained.backward(total * scale)
                _accumulate(sums, metrics, weight=to_local_mean)
                _accumulate(sums, aux_metrics)
            if governor is not None:
                governor.tick()  # closes the window the last micro-batch ran in
                sums[f"{trained.name}/threads"] = torch.tensor(sum(threads) / len(threads))
        grad_norm, lr, applied = trained.step(self.max_grad_norm,
                                              lambda: self._emit("before_optimizer_step", trained.name))
        sums[f"{trained.name}/grad_norm"], sums[f"{trained.name}/lr"] = grad_norm, lr
        if not applied:
            self.state.skipped_steps += 1
            diverging = not trained.loss_scaling or bool(self.dist.all_reduce_max((~loss_finite).float()))
            self.nonfinite.skipped(trained.name, step=self.state.global_step + 1, grad_norm=float(grad_norm),
                                   count=diverging, is_main=self.dist.is_main)
            return sums
        self.nonfinite.applied(trained.name)
        if trained.name == "policy":
            with self.version_lock:
                self.state.policy_version += 1
        self._emit("after_optimizer_step", trained.name)
        return sums


def mean_over_ranks(metrics: Mapping[str, torch.Tensor], dist: DistributedContext) -> dict[str, torch.Tensor]:
    """The mean of each 0-dim metric over all data-parallel ranks, with one all-reduce; with one process, a copy of
    `metrics` (same tensors, no collective).

    The values are stacked in sorted key order behind a header (number of keys, CRC-32 of the key names) and summed
    over ranks in float64; each mean keeps its metric's floating dtype (integer metrics become float64).

    Raises:
        RuntimeError: when the ranks' metric names differ (the header sum is not world_size times this rank's).
            Every rank must return the same names from `train_step`; with a different NUMBER of names the
            collective itself cannot line up, and the other ranks fail when this one exits.
    """
    if dist.world_size == 1:
        return dict(metrics)
    keys = sorted(metrics)
    header = torch.tensor([len(keys), zlib.crc32("\n".join(keys).encode())], dtype=torch.float64,
                          device=dist.device)
    values = [metrics[k].detach().reshape(()).to(device=dist.device, dtype=torch.float64) for k in keys]
    total = dist.all_reduce_sum(torch.cat([header, torch.stack(values)]) if values else header)
    if not torch.equal(total[:2], header * dist.world_size):
        raise RuntimeError(f"metrics differ across ranks: rank {dist.rank} returned {len(keys)} names "
                           f"({', '.join(keys)}) but the ranks' names do not all match; every rank must return "
                           "the same metric names from train_step")
    means = total[2:] / dist.world_size
    return {k: means[i].to(metrics[k].dtype) if metrics[k].is_floating_point() else means[i]
            for i, k in enumerate(keys)}


def _accumulate(sums: dict[str, torch.Tensor], metrics: Mapping[str, torch.Tensor], *, weight=1.0) -> None:
    """In place: `sums[k] += weight * metrics[k].detach()` for every key of `metrics`."""
    for key, value in metrics.items():
        sums[key] = sums.get(key, 0.0) + value.detach() * weight
