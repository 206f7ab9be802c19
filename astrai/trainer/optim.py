"""Optimizers and learning-rate schedules.

Schedules are multiplicative factors on the base learning rate, applied per optimizer step:
constant (after linear warmup), linear decay to 0, cosine decay to 0 (Loshchilov & Hutter 2017,
SGDR, without restarts), and warmup-stable-decay (Hu et al. 2024, MiniCPM; Hägele et al. 2024): constant
until the last `decay_ratio` share of the post-warmup steps, then linear decay to 0.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Optional, Sequence

import torch

SCHEDULES: dict[str, Callable[[float], float]] = {
    "constant": lambda progress: 1.0,
    "linear": lambda progress: max(0.0, 1.0 - progress),
    "cosine": lambda progress: 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))),
    "warmup_stable_decay": lambda progress, decay_ratio=0.1: _wsd(progress, decay_ratio),
}


def _wsd(progress: float, decay_ratio: float) -> float:
    """Warmup-stable-decay factor after warmup: 1 until `1 - decay_ratio`, then linear to 0 at progress 1."""
    if decay_ratio <= 0:
        return 1.0
    return max(0.0, min(1.0, (1.0 - progress) / decay_ratio))


def _fused_devices() -> set[str]:
    """Device types with torch's fused AdamW kernel (torch >= 2.4 includes "cpu"; "cuda" before that)."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    except ImportError:  # a torch without the helper
        return {"cuda"}
    return set(_get_fused_kernels_supported_devices())


def fused_supported(params: Sequence[torch.Tensor]) -> bool:
    """True when torch's fused AdamW can step every tensor of `params`: plain dense floating tensors (not a
    subclass such as FSDP2's DTensor shards), all on one device type that has the fused kernel."""
    devices = {p.device.type for p in params}
    return bool(params) and len(devices) == 1 and devices <= _fused_devices() and all(
        type(p) in (torch.Tensor, torch.nn.Parameter) and p.layout == torch.strided and p.is_floating_point()
        for p in params)


def build_optimizer(params: Iterable[torch.nn.Parameter], *, lr: float, betas: tuple[float, float],
                    eps: float, weight_decay: float, fused: Optional[bool] = None) -> torch.optim.AdamW:
    """AdamW (Loshchilov & Hutter 2019) over the trainable `params` (requires_grad only).

    `fused`: None (default) uses torch's fused kernel (one kernel over all parameters; the same update as the
    default multi-tensor "foreach" implementation up to float rounding) when `fused_supported(trainable)`, else the
    default implementation; False always the default; True requires the fused kernel (torch raises where it cannot
    run). A checkpointed state restores the implementation it was saved with (`fused` is a parameter-group entry).

    Raises:
        ValueError: when no parameter is trainable.
    """
    trainable = [p for p in params if p.requires_grad]
    if not trainable:
        raise ValueError("build_optimizer: the model has no trainable parameter")
    if fused is None:
        fused = fused_supported(trainable)
    return torch.optim.AdamW(trainable, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                             fused=fused or None)


def build_scheduler(optimizer: torch.optim.Optimizer, *, name: str, warmup_steps: int,
                    total_steps: int, decay_ratio: float = 0.1) -> torch.optim.lr_scheduler.LambdaLR:
    """LR schedule: linear warmup over `warmup_steps`, then `SCHEDULES[name]` over the remaining steps.

    The factor at step s is (s + 1) / warmup_steps during warmup, then f((s - warmup) / (total - warmup)).
    `decay_ratio` (in [0, 1]) is the decaying share of the post-warmup steps for "warmup_stable_decay".

    Raises:
        ValueError: on an unknown schedule name (naming `optim.lr_scheduler_type` and the choices).
    """
    if name not in SCHEDULES:
        raise ValueError(f"optim.lr_scheduler_type: expected one of {sorted(SCHEDULES)}, got {name!r}")
    decay = SCHEDULES[name]
    if name == "warmup_stable_decay":
        decay = lambda progress: _wsd(progress, decay_ratio)  # noqa: E731
    decay_steps = max(1, total_steps - warmup_steps)

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        return decay((step - warmup_steps) / decay_steps)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
