"""A DeepSpeed ZeRO-3 memory fix: the fp32 master partition shares the fp32 parameter partition's storage.

`bench/memory.py` measures what a rank holds under each engine; without this, fp32 ZeRO-3 keeps two fp32 copies of
the rank's parameter partition (see `share_zero3_fp32_master`).
"""

from __future__ import annotations

import torch

__all__ = ["share_zero3_fp32_master"]


def share_zero3_fp32_master(zero_optimizer) -> int:
    """Make each fp32 master partition of a ZeRO-3 optimizer share the storage of the parameter partition it copies
    when both are fp32 on the same device (training in fp32); returns the number of partitions shared.

    DeepSpeed means to do this itself (stage3.py `_create_fp32_partitions`: "we don't need another copy of the
    weights"), but it compares the partition's `device` (a `torch.device`) with its own `device` (a str such as
    'cpu' or 'cuda:0'), which are never equal in DeepSpeed 0.19.8, so it keeps a clone: a second fp32 copy of this
    rank's parameters, 1/(4N) of a ddp rank's fp32 training state at N ranks. The optimizer steps the master in
    place and then copies it into the parameter partition (a copy onto itself once they share storage), so the
    updates are unchanged; the master tensor objects stay the same, so DeepSpeed's parameter groups and optimizer
    state keep their keys. bf16/fp16 training (a real fp32 copy of 16-bit parameters) is left as it is."""
    masters = getattr(zero_optimizer, "fp32_partitioned_groups_flat", None) or []
    params = getattr(zero_optimizer, "fp16_partitioned_groups_flat", None) or []
    shared = 0
    for master, param in zip(masters, params):
        if (param is not None and master is not param and master.dtype == param.dtype == torch.float32
                and master.device == param.device and master.shape == param.shape
                and master.untyped_storage().data_ptr() != param.untyped_storage().data_ptr()):
            with torch.no_grad():
                master.data = param.data
            shared += 1
    return shared
