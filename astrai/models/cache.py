"""Contiguous key/value cache for incremental decoding with `AutoRegressiveLM`.

This is the simple, per-batch cache (one dense buffer per layer). The rollout engine's paged cache lives in
`astrai.rollout`; this one serves reference decoding, tests and small generation loops.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import ModelConfig

__all__ = ["KVCache"]


@dataclass
class KVCache:
    """Per-layer key/value buffers `keys[l], values[l]: (B, Nkv, S_max, D)` plus `length`, the number of positions
    already written (the same for every row; left padding is expressed through `attention_mask`).

    A forward with a cache writes the new (rotated) keys and values of S tokens at `[length, length + S)`, attends
    over `[0, length + S)` and, after all layers, the model advances `length` by S.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    length: int = 0

    @classmethod
    def allocate(
        cls,
        config: ModelConfig,
        batch_size: int,
        max_length: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> "KVCache":
        """Allocate zeroed buffers `(batch_size, Nkv, max_length, D)` for each of the L layers.

        Raises `ValueError` for a non-positive batch size or length.
        """
        if batch_size <= 0 or max_length <= 0:
            raise ValueError(f"KVCache needs batch_size > 0 and max_length > 0, got {batch_size}, {max_length}")
        shape = (batch_size, config.num_key_value_heads, max_length, config.head_dim)
        n = config.num_hidden_layers
        keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n)]
        values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n)]
        return cls(keys=keys, values=values)

    @property
    def batch_size(self) -> int:
        """B of the buffers."""
        return self.keys[0].shape[0]

    @property
    def max_length(self) -> int:
        """S_max, the capacity in positions."""
        return self.keys[0].shape[2]

    def check_room(self, batch_size: int, num_new: int) -> None:
        """Raise `ValueError` if `num_new` more positions for `batch_size` rows do not fit."""
        if batch_size != self.batch_size:
            raise ValueError(f"KVCache holds batch size {self.batch_size}, forward got {batch_size}")
        if self.length + num_new > self.max_length:
            raise ValueError(
                f"KVCache overflow: length {self.length} + {num_new} new tokens > max_length {self.max_length}"
            )

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write `k, v: (B, Nkv, S, D)` at `[length, length + S)` of layer `layer_idx` and return the views
        `(B, Nkv, length + S, D)` to attend over. Does not advance `length` (see `advance`)."""
        start, end = self.length, self.length + k.shape[2]
        self.keys[layer_idx][:, :, start:end] = k
        self.values[layer_idx][:, :, start:end] = v
        return self.keys[layer_idx][:, :, :end], self.values[layer_idx][:, :, :end]

    def advance(self, num_new: int) -> None:
        """Advance `length` by `num_new` (called once per forward by the model, after all layers)."""
        self.length += num_new

    def reset(self) -> None:
        """Forget the stored positions (buffers are kept and overwritten by the next forward)."""
        self.length = 0
