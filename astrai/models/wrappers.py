"""The bare model under the wrappers training puts around it, found without importing the wrappers' packages."""

from __future__ import annotations

import torch

__all__ = ["bare_module"]

_WRAPPERS = ("DistributedDataParallel", "DataParallel", "DeepSpeedEngine")
"""Classes (by name) whose `.module` is the wrapped model: torch's DDP and DataParallel, DeepSpeed's engine."""


def bare_module(model: torch.nn.Module) -> torch.nn.Module:
    """`model` under any data-parallel wrapper (`_WRAPPERS`) or `torch.compile` (`_orig_mod`). Told by class name so
    that DeepSpeed is not imported for it (Accelerate's `extract_model_from_parallel` imports it whenever it is
    installed, which prints its "Setting accelerator to CPU" line on every ddp run)."""
    while True:
        if type(model).__name__ in _WRAPPERS and isinstance(getattr(model, "module", None), torch.nn.Module):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):
            model = model._orig_mod
        else:
            return model
