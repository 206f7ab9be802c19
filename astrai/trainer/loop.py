"""The one training loop shared by every train type.

`Trainer.fit()` runs until `max_steps` policy optimizer steps are done. Each iteration asks the strategy
(one small class per train type, `trainer/strategies/`) for exactly one policy optimizer step; the strategy
calls back `Trainer.optimizer_step` for every optimizer it owns, so clipping, the optimizer hooks and the
`policy_version` bookkeeping live in one place.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass
from typing import Iterable, Optional, Protocol

import torch

from astrai.distributed import DistributedContext


@dataclass
class TrainerState:
    """Progress counters (restored on resume).

    Attributes:
        global_step: completed iterations of the loop (one policy optimizer step each).
        policy_version: completed policy optimizer steps; tags the weights the rollout engine holds.
        consumed_samples: prompts (or examples) drawn from the data so far, over all ranks.
        max_steps: the run's target number of steps.
    """

    global_step: int = 0
    policy_version: int = 0
    consumed_samples: int = 0
    max_steps: int = 0

    def to_dict(self) -> dict:
        """JSON-serialisable copy of the counters (written to trainer_state.json)."""
        return asdict(self)


class Strategy(Protocol):
    """A train type: owns its models and optimizers and performs one policy optimizer step per call."""

    def train_step(self, trainer: "Trainer") -> dict[str, torch.Tensor]:
        """Do one policy optimizer step (via `trainer.optimizer_step`); return detached 0-dim metrics."""

    def checkpoint_state(self) -> dict:
        """Objects the checkpoint publisher saves (models, optimizers, schedulers, tokenizer ...)."""


class Callback:
    """Hooks of the training loop; every method is optional.

    `before_optimizer_step` / `after_optimizer_step` fire around each optimizer step with `name` "policy"
    or "critic"; `on_step_end` receives the step's metrics as detached tensors (convert them only there).
    """

    def on_train_begin(self, trainer: "Trainer") -> None: ...
    def before_optimizer_step(self, trainer: "Trainer", name: str) -> None: ...
    def after_optimizer_step(self, trainer: "Trainer", name: str) -> None: ...
    def on_step_end(self, trainer: "Trainer", metrics: dict[str, torch.Tensor]) -> None: ...
    def on_train_end(self, trainer: "Trainer") -> None: ...


class Trainer:
    """The outer loop: `fit()` calls `strategy.train_step(self)` until `state.max_steps`.

    Args:
        strategy: the train type.
        dist: process state (rank, world size, device) from `astrai.distributed`.
        max_steps: number of policy optimizer steps to reach.
        max_grad_norm: gradient-norm clip applied to every optimizer (policy and critic alike).
        callbacks: hooks, called in order.
        state: initial counters (for resume); fresh when None.
    """

    def __init__(self, strategy: Strategy, *, dist: DistributedContext, max_steps: int,
                 max_grad_norm: float, callbacks: Iterable[Callback] = (),
                 state: Optional[TrainerState] = None):
        self.strategy = strategy
        self.dist = dist
        self.max_grad_norm = max_grad_norm
        self.callbacks = list(callbacks)
        self.state = state or TrainerState()
        self.state.max_steps = max_steps
        self.version_lock = threading.Lock()

    def _emit(self, hook: str, *args) -> None:
        for callback in self.callbacks:
            getattr(callback, hook)(self, *args)

    def fit(self) -> TrainerState:
        """Run the loop to `max_steps`; returns the final state."""
        self._emit("on_train_begin")
        while self.state.global_step < self.state.max_steps:
            metrics = self.strategy.train_step(self)
            self.state.global_step += 1
            metrics["policy_version"] = torch.tensor(self.state.policy_version)
            self._emit("on_step_end", metrics)
        self._emit("on_train_end")
        return self.state

    def optimizer_step(self, name: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                       scheduler: Optional[torch.optim.lr_scheduler.LRScheduler] = None) -> torch.Tensor:
        """Clip gradients to `max_grad_norm`, step `optimizer` (+ `scheduler`) and zero the gradients.

        When `name == "policy"`, `policy_version` increments under `version_lock` right after the step;
        any other optimizer (the critic) steps outside that lock.

        Returns:
            the pre-clip global gradient norm (0-dim float32 tensor, detached).
        """
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), self.max_grad_norm)
        self._emit("before_optimizer_step", name)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if name == "policy":
            with self.version_lock:
                self.state.policy_version += 1
        self._emit("after_optimizer_step", name)
        return grad_norm.detach().float()
