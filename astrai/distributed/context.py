"""Process state and collectives, through Accelerate (the only place, with the trainer loop, that touches
process groups).

`accelerate launch` and `torchrun` export RANK/WORLD_SIZE/...; a plain `python -m astrai.train` runs as one
process. On CPU, Accelerate does DDP only (docs/conventions.md section 6); sharding engines (FSDP2 `fully_shard`,
DeepSpeed ZeRO) plug in here later, selected from `distributed.strategy`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DistributedContext:
    """Rank, world size, device and collectives of this process.

    Attributes:
        accelerator: the `accelerate.Accelerator` holding the process state.
        device: the torch device this rank computes on.
        strategy: the data-parallel engine (`astrai.distributed.engines`): ddp, fsdp2, zero1, zero2 or zero3.
        mixed_precision: "no", "bf16" or "fp16".
    """

    accelerator: object
    device: torch.device
    strategy: str = "ddp"
    mixed_precision: str = "no"

    @property
    def rank(self) -> int:
        """Global rank of this process (0-based)."""
        return self.accelerator.process_index

    @property
    def world_size(self) -> int:
        """Number of processes in the job."""
        return self.accelerator.num_processes

    @property
    def is_main(self) -> bool:
        """True on global rank 0 (the process that logs and prints)."""
        return self.accelerator.is_main_process

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum of `tensor` over all ranks (the tensor itself with one process)."""
        if self.world_size == 1:
            return tensor
        return self.accelerator.reduce(tensor.clone(), reduction="sum")

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Move `model` to the device and wrap it for data parallelism when there is more than one rank."""
        model = model.to(self.device)
        if self.world_size == 1:
            return model
        return self.accelerator.prepare_model(model)

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The bare module under any data-parallel wrapper."""
        return self.accelerator.unwrap_model(model)

    def barrier(self) -> None:
        """Block until every rank arrives (no-op with one process)."""
        self.accelerator.wait_for_everyone()


def setup_distributed(device: str = "auto", strategy: str = "ddp", *,
                      mixed_precision: str = "no") -> DistributedContext:
    """Create the process state.

    Args:
        device: "auto" (CUDA when available, else CPU), "cpu", "cuda" or "cuda:N".
        strategy: data-parallel engine: "ddp", "fsdp2", "zero1", "zero2" or "zero3" ("auto": ddp).
        mixed_precision: "no", "bf16" or "fp16".

    Raises:
        ValueError: on a CUDA device without CUDA, or an unknown strategy.
    """
    from accelerate import Accelerator

    strategy = "ddp" if strategy == "auto" else strategy
    if strategy not in ("ddp", "fsdp2", "zero1", "zero2", "zero3"):
        raise ValueError(f"distributed.strategy: expected ddp, fsdp2, zero1, zero2 or zero3, got {strategy!r}")
    want_cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if want_cuda and not torch.cuda.is_available():
        raise ValueError(f"runtime.device: {device!r} requested but CUDA is not available")
    accelerator = Accelerator(cpu=not want_cuda)
    chosen = torch.device(device) if device.startswith("cuda:") else accelerator.device
    return DistributedContext(accelerator=accelerator, device=chosen, strategy=strategy,
                              mixed_precision=mixed_precision)
