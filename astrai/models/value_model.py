"""Critic for PPO (Schulman et al. 2017): a copy of the policy's trunk plus a scalar value head.

`ValueModel` = deep copy of `AutoRegressiveLM.model` (embeddings + decoder blocks + final norm, no LM head),
warm-started from the policy weights, and `value_head = Linear(H, 1)` with weight and bias zero, so the initial
values are exactly 0 (as in docs/conventions.md section 3). The policy class is not modified to serve the critic.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Sequence

import torch
from torch import nn

from .config import ModelConfig
from .llama import AutoRegressiveLM, LlamaTrunk

__all__ = ["ValueModel"]


class ValueModel(nn.Module):
    """Per-token state values V(s_t).

    Attributes: `config`, `model` (LlamaTrunk, its own parameters), `value_head` (Linear(H, 1), zero-initialised).
    Parameter names are `model.*` (as in the policy) and `value_head.weight` / `value_head.bias`.
    """

    def __init__(self, trunk: LlamaTrunk) -> None:
        super().__init__()
        self.config: ModelConfig = trunk.config
        self.model = trunk
        weight = trunk.embed_tokens.weight
        self.value_head = nn.Linear(self.config.hidden_size, 1, bias=True, device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            self.value_head.weight.zero_()
            self.value_head.bias.zero_()

    @classmethod
    def from_policy(cls, policy: AutoRegressiveLM, num_layers: int | None = None) -> "ValueModel":
        """Critic warm-started from `policy`: its trunk is deep-copied (no parameter is shared with the policy,
        including `gradient_checkpointing`'s setting), the head is zero. With `num_layers` = N, only the
        embeddings, the first N decoder layers and the final norm are copied (`config.num_hidden_layers` = N): a
        smaller critic whose forward and backward cost about N / L of the full one's.

        Raises:
            TypeError: for a policy that is not an `AutoRegressiveLM`.
            ValueError: `num_layers` outside 1..L.
        """
        if not isinstance(policy, AutoRegressiveLM):
            raise TypeError(f"ValueModel.from_policy expects an AutoRegressiveLM, got {type(policy).__name__}")
        total = policy.config.num_hidden_layers
        if num_layers is None or num_layers == total:
            return cls(copy.deepcopy(policy.model))
        if not 1 <= num_layers <= total:
            raise ValueError(f"num_layers: expected 1..{total} (the policy's decoder layers), got {num_layers}")
        kept, policy.model.layers = policy.model.layers, policy.model.layers[:num_layers]
        try:  # copy only what the critic keeps
            trunk = copy.deepcopy(policy.model)
        finally:
            policy.model.layers = kept
        trunk.config = dataclasses.replace(trunk.config, num_hidden_layers=num_layers,
                                           layer_types=trunk.config.layer_types[:num_layers])
        return cls(trunk)

    @property
    def trunk(self) -> LlamaTrunk:
        """Alias of `model`."""
        return self.model

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        *,
        seq_lengths: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """input_ids (B, S) long, attention_mask (B, S) 0/1, position_ids (B, S) long, seq_lengths (padding-free
        packed rows) as the policy takes them -> values (B, S) float32; `values[:, i]` is the value of the state
        after token i. Raises what `LlamaTrunk.forward` raises."""
        hidden = self.model(input_ids, attention_mask, position_ids, seq_lengths=seq_lengths)
        values = self.value_head(hidden.to(self.value_head.weight.dtype))
        return values.squeeze(-1).float()
