"""`RolloutResult`: one rollout's sequences with its training targets computed once and pinned.

The sequences use the layout of `astrai.data.sequences.Sequences` (left-padded prompt + right-padded response).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from astrai.data.sequences import Sequences

PER_TOKEN_FIELDS = ("old_logprobs", "ref_logprobs", "values", "kl", "rewards", "advantages", "returns",
                    "rollout_logprobs", "correction_weights", "policy_versions")
"""The (B, T) per-token fields of a `RolloutResult` (None where the train type has none)."""


@dataclass(frozen=True)
class RolloutResult:
    """One PPO rollout with its targets computed once and pinned (docs/conventions.md section 2).

    Every PPO epoch and minibatch replays these tensors; nothing recomputes advantages or returns.
    All per-token tensors are (B, T) float32 (the versions int64), zero outside the action mask; none requires grad.

    Attributes:
        sequences: model inputs and `action_mask` (B, T), the loss mask (`astrai.data.sequences.Sequences`).
        old_logprobs: (B, T) sampler-aligned behaviour log-probs from the engine.
        ref_logprobs: (B, T) frozen reference model log-probs (same temperature); None without a reference
            model (GRPO with no KL term).
        values: (B, T) critic values V(s_t) at rollout time; None for critic-free train types (GRPO).
        scores: (B,) float32 scalar task rewards.
        kl: (B, T) k-estimator of KL(policy || reference) per token; None without a reference model.
        rewards: (B, T) per-token rewards (PPO: -kl_coef * kl plus the score at the last real token; GRPO: the
            sequence reward broadcast over the real tokens).
        advantages: (B, T) GAE advantages (whitened when configured) or GRPO group advantages.
        returns: (B, T) GAE returns, the critic's regression target; None for critic-free train types.
        policy_version: version of the weights that generated the responses.
        responses: decoded response texts (B strings).
        rollout_logprobs: (B, T) the engine's log-probs when `old_logprobs` were rescored by the trainer (rollout
            correction, docs/conventions.md section 7), else None.
        correction_weights: (B, T) detached importance weights of the rollout correction (0 at dropped tokens),
            multiplied into the policy loss; None without a correction.
        policy_versions: (B, T) int64, the version that sampled each action token (-1 elsewhere); None at
            construction (and in rollouts saved before it existed) means `policy_version` for every action token.
        routes: B names, each row's teacher route when several teachers are routed by a data column
            (`Experience.routes`, `distill.teachers`): the policy update's top-k distillation picks each row's
            teacher by it; None otherwise (and in rollouts saved before it existed).
    """

    sequences: Sequences
    old_logprobs: torch.Tensor
    ref_logprobs: Optional[torch.Tensor]
    values: Optional[torch.Tensor]
    scores: torch.Tensor
    kl: Optional[torch.Tensor]
    rewards: torch.Tensor
    advantages: torch.Tensor
    returns: Optional[torch.Tensor]
    policy_version: int
    responses: tuple[str, ...]
    rollout_logprobs: Optional[torch.Tensor] = None
    correction_weights: Optional[torch.Tensor] = None
    policy_versions: Optional[torch.Tensor] = None
    routes: Optional[tuple[str, ...]] = None

    def __post_init__(self):
        if self.policy_versions is None:
            object.__setattr__(self, "policy_versions", torch.where(self.sequences.action_mask.bool(),
                                                                    self.policy_version, -1).to(torch.long))
        if self.routes is not None:
            object.__setattr__(self, "routes", tuple(self.routes))
            if len(self.routes) != len(self):
                raise ValueError(f"RolloutResult.routes: expected {len(self)} routes, got {len(self.routes)}")
        for field in PER_TOKEN_FIELDS:
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

    def with_fields(self, **fields: Optional[torch.Tensor]) -> "RolloutResult":
        """A copy with per-token `fields` replaced WITHOUT the constructor's checks: for the policy update's hot
        path, where they come from this result's own validated tensors and the step's forward (no host syncs; a
        non-finite value reaches the loss, whose step is then skipped, instead of raising mid-accumulation)."""
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        for name, value in fields.items():
            if name not in PER_TOKEN_FIELDS:
                raise ValueError(f"RolloutResult.with_fields: {name!r} is not a per-token field")
            object.__setattr__(new, name, value)
        return new

    def select(self, index: torch.Tensor) -> "RolloutResult":
        """Rows `index` (1-D int64) of every per-sample tensor, as a new (still pinned) result."""
        picked = {f: (getattr(self, f)[index] if getattr(self, f) is not None else None)
                  for f in PER_TOKEN_FIELDS + ("scores",)}
        rows = index.tolist()
        responses = tuple(self.responses[i] for i in rows)
        routes = None if self.routes is None else tuple(self.routes[i] for i in rows)
        return dataclasses.replace(self, sequences=self.sequences.select(index), responses=responses,
                                   routes=routes, **picked)

    def split(self, rows: int) -> list["RolloutResult"]:
        """Consecutive row chunks of at most `rows` rows (the micro-batches of a minibatch).

        Raises:
            ValueError: when `rows < 1`.
        """
        if rows < 1:
            raise ValueError(f"RolloutResult.split: rows must be >= 1, got {rows}")
        return [self.select(torch.arange(start, min(len(self), start + rows)))
                for start in range(0, len(self), rows)]

    def trim_padding(self) -> "RolloutResult":
        """The same rows without the columns that are padding in every row (`Sequences.trim_padding`): the
        sequences lose their all-padding leading and trailing columns, every per-token (B, T) tensor its trailing
        response columns beyond the T' kept. Masked sums and means over real tokens are unchanged."""
        _, sequences = self.sequences.trim_padding()
        width = sequences.action_mask.shape[1]
        cut = {f: (getattr(self, f)[:, :width] if getattr(self, f) is not None else None) for f in PER_TOKEN_FIELDS}
        return dataclasses.replace(self, sequences=sequences, **cut)

    def micro_batches(self, rows: int) -> list["RolloutResult"]:
        """The micro-batches a minibatch is trained in: its rows ordered by real length (prompt + response tokens,
        a stable sort, so the order is a pure function of the data), cut into chunks of at most `rows` rows, each
        trimmed to the columns its rows use (`trim_padding`). Rows of similar length share a micro-batch (astrai's
        models then run it padding-free, `astrai.forward`; other models compute less padding). The minibatch's
        rows are exactly the same; with a loss that is a token sum over the step's global token count
        (`Trainer.accumulate_and_step`) the result equals `split(rows)`'s up to float rounding. Per-token tensors
        of different micro-batches may differ in width T'. (An MoE model's load-balancing loss is a per-forward
        mean over the forward's positions, so it does change with other row groupings.)

        Raises:
            ValueError: when `rows < 1`.
        """
        if rows < 1:
            raise ValueError(f"RolloutResult.micro_batches: rows must be >= 1, got {rows}")
        lengths = self.sequences.attention_mask.sum(dim=1)
        order = torch.sort(lengths, stable=True).indices
        return [self.select(index).trim_padding() for index in order.split(rows)]

    def to_state(self) -> dict:
        """Plain dict of tensors / ints / strings (loadable with `torch.load(weights_only=True)`)."""
        state = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "sequences"}
        state["responses"] = list(self.responses)
        state["routes"] = None if self.routes is None else list(self.routes)
        state["sequences"] = {f.name: getattr(self.sequences, f.name) for f in dataclasses.fields(Sequences)}
        return state

    @classmethod
    def from_state(cls, state: dict, device: torch.device) -> "RolloutResult":
        """Inverse of `to_state`, with every tensor moved to `device`."""
        move = lambda v: v.to(device) if isinstance(v, torch.Tensor) else v  # noqa: E731
        fields = {k: move(v) for k, v in state.items() if k not in ("sequences", "responses", "routes")}
        sequences = Sequences(**{k: move(v) for k, v in state["sequences"].items()})
        routes = state.get("routes")  # absent in rollouts saved before routes were kept
        return cls(sequences=sequences, responses=tuple(state["responses"]),
                   routes=None if routes is None else tuple(routes), **fields)

    def minibatch_indices(self, minibatch_size: int, epochs: int,
                          generator: torch.Generator) -> list[torch.Tensor]:
        """Shuffled row indices: `epochs` passes, each cut into minibatches of `minibatch_size` rows.

        Raises:
            ValueError: when the batch size is not a multiple of `minibatch_size`.
        """
        if len(self) % minibatch_size:
            raise ValueError(f"minibatch_size={minibatch_size} must divide the rollout batch {len(self)} "
                             "(ppo.minibatch_size / grpo.minibatch_size)")
        out = []
        for _ in range(epochs):
            order = torch.randperm(len(self), generator=generator)
            out.extend(order.split(minibatch_size))
        return out
