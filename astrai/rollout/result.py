"""`RolloutResult`: one rollout's sequences with its training targets computed once and pinned.

The sequences use the layout of `astrai.data.sequences.Sequences` (left-padded prompt + right-padded response).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from astrai.data.sequences import Sequences


@dataclass(frozen=True)
class RolloutResult:
    """One PPO rollout with its targets computed once and pinned (docs/conventions.md section 2).

    Every PPO epoch and minibatch replays these tensors; nothing recomputes advantages or returns.
    All per-token tensors are (B, T) float32, zero at padding; none requires grad.

    Attributes:
        sequences: model inputs and `action_mask` (B, T).
        old_logprobs: sampler-aligned behaviour log-probs from the engine.
        ref_logprobs: frozen reference model log-probs (same temperature).
        values: critic values V(s_t) at rollout time (None for critic-free train types).
        scores: (B,) float32 scalar task rewards.
        kl: k-estimator of KL(policy || reference) per token.
        rewards: per-token rewards (-kl_coef * kl, plus the score at the last real token).
        advantages: GAE advantages (whitened when configured).
        returns: GAE returns, the critic's regression target.
        policy_version: version of the weights that generated the responses.
        responses: decoded response texts (B strings).
    """

    sequences: Sequences
    old_logprobs: torch.Tensor
    ref_logprobs: torch.Tensor
    values: Optional[torch.Tensor]
    scores: torch.Tensor
    kl: torch.Tensor
    rewards: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor
    policy_version: int
    responses: tuple[str, ...]

    def __post_init__(self):
        for field in ("old_logprobs", "ref_logprobs", "values", "kl", "rewards", "advantages", "returns"):
            tensor = getattr(self, field)
            if tensor is None:
                continue
            if tensor.shape != self.sequences.action_mask.shape:
                raise ValueError(f"RolloutResult.{field}: expected shape "
                                 f"{tuple(self.sequences.action_mask.shape)}, got {tuple(tensor.shape)}")
            if tensor.requires_grad:
                raise ValueError(f"RolloutResult.{field}: must not require grad (targets are pinned)")
            if not bool(torch.isfinite(tensor).all()):
                raise ValueError(f"RolloutResult.{field}: contains non-finite values")

    def __len__(self) -> int:
        return self.sequences.input_ids.shape[0]

    def select(self, index: torch.Tensor) -> "RolloutResult":
        """Rows `index` (1-D int64) of every per-sample tensor, as a new (still pinned) result."""
        picked = {f: (getattr(self, f)[index] if getattr(self, f) is not None else None)
                  for f in ("old_logprobs", "ref_logprobs", "values", "scores", "kl", "rewards",
                            "advantages", "returns")}
        responses = tuple(self.responses[i] for i in index.tolist())
        return dataclasses.replace(self, sequences=self.sequences.select(index), responses=responses,
                                   **picked)

    def to_state(self) -> dict:
        """Plain dict of tensors / ints / strings (loadable with `torch.load(weights_only=True)`)."""
        state = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "sequences"}
        state["responses"] = list(self.responses)
        state["sequences"] = {f.name: getattr(self.sequences, f.name) for f in dataclasses.fields(Sequences)}
        return state

    @classmethod
    def from_state(cls, state: dict, device: torch.device) -> "RolloutResult":
        """Inverse of `to_state`, with every tensor moved to `device`."""
        move = lambda v: v.to(device) if isinstance(v, torch.Tensor) else v  # noqa: E731
        fields = {k: move(v) for k, v in state.items() if k not in ("sequences", "responses")}
        sequences = Sequences(**{k: move(v) for k, v in state["sequences"].items()})
        return cls(sequences=sequences, responses=tuple(state["responses"]), **fields)

    def minibatch_indices(self, minibatch_size: int, epochs: int,
                          generator: torch.Generator) -> list[torch.Tensor]:
        """Shuffled row indices: `epochs` passes, each cut into minibatches of `minibatch_size` rows.

        Raises:
            ValueError: when the batch size is not a multiple of `minibatch_size`.
        """
        if len(self) % minibatch_size:
            raise ValueError(f"ppo.minibatch_size={minibatch_size} must divide the rollout batch {len(self)}")
        out = []
        for _ in range(epochs):
            order = torch.randperm(len(self), generator=generator)
            out.extend(order.split(minibatch_size))
        return out
