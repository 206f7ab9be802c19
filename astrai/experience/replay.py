"""Rollout replay: one rollout feeds several optimizer steps (PPO epochs x minibatches; Schulman et al. 2017).

`RolloutReplay` holds the current `RolloutResult` with its pinned targets, hands out its minibatches one per
optimizer step (`epochs` shuffled passes), and saves/restores its position, so a checkpoint taken in the middle of
a rollout resumes exactly.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from astrai.experience.result import RolloutResult


class RolloutReplay:
    """The rollout in progress and its minibatches not yet replayed.

    Args:
        minibatch_size: rows per minibatch (must divide every rollout's row count).
        epochs: shuffled passes over each rollout.
        seed: seeds the CPU generator that shuffles the minibatches.

    Attributes:
        rollout: the current rollout (None before the first).
        metrics: detached 0-dim metrics of the current rollout (logged with each of its minibatches).
    """

    def __init__(self, *, minibatch_size: int, epochs: int, seed: int):
        self.minibatch_size, self.epochs = minibatch_size, epochs
        self.shuffle_generator = torch.Generator().manual_seed(seed)
        self.rollout: Optional[RolloutResult] = None
        self.metrics: dict[str, torch.Tensor] = {}
        self._pending: list[torch.Tensor] = []

    @property
    def exhausted(self) -> bool:
        """True when every minibatch of the current rollout has been handed out (or there is none)."""
        return not self._pending

    def next_minibatch(self, make_rollout: Callable[[], tuple[RolloutResult, dict[str, torch.Tensor]]]
                       ) -> tuple[RolloutResult, bool]:
        """The next minibatch, calling `make_rollout() -> (rollout, metrics)` first when the current rollout is
        exhausted. Returns `(minibatch, first)`, `first` True for a new rollout's first minibatch.

        Raises:
            ValueError: when `minibatch_size` does not divide the new rollout's rows.
        """
        first = self.exhausted
        if first:
            self.rollout, self.metrics = make_rollout()
            self._pending = self.rollout.minibatch_indices(self.minibatch_size, self.epochs, self.shuffle_generator)
        return self.rollout.select(self._pending.pop(0)), first

    def state_dict(self) -> dict:
        """The shuffling RNG, the rollout in progress (None when exhausted), its pending minibatch indices and its
        metrics (tensors; loadable with `torch.load(weights_only=True)`)."""
        return {"shuffle_rng": self.shuffle_generator.get_state(),
                "pending": [index.clone() for index in self._pending],
                "rollout": self.rollout.to_state() if self._pending else None,
                "rollout_metrics": dict(self.metrics)}

    @staticmethod
    def pending_minibatches(state: dict) -> int:
        """The number of minibatches not yet replayed in a saved `state_dict`."""
        return len(state["pending"])

    def load_state_dict(self, state: dict, device: torch.device) -> None:
        """Inverse of `state_dict`, the rollout's tensors moved to `device`."""
        self.shuffle_generator.set_state(state["shuffle_rng"])
        self._pending = list(state["pending"])
        self.rollout = (RolloutResult.from_state(state["rollout"], device) if state["rollout"] is not None
                        else None)
        self.metrics = dict(state["rollout_metrics"])
