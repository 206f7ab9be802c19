"""The train-type registry: one torch-free record per train type (torchtitan's TrainSpec idea).

Every fact that depends on the train type is a field of its `TrainType` record, and the code that needs one asks
the registry instead of naming a train type: the config's choices and cross-field checks (`astrai.config`), the
optimizer-step sizes DeepSpeed is told (`trainer.build`), the length and model limits (`data.limits`), the builder
and the data loader (`trainer.build`, `--check`), the manifest fields and the resume rules of its checkpoints
(`trainer.build`, `trainer.resume`) and the files an old checkpoint must hold (`checkpoint`).
`tests/test_architecture.py` fails when a module outside this package and `astrai/trainer/learners/` names a
train type.

One module per train type, named like its learner module in `astrai/trainer/learners/`, declares
`TRAIN_TYPE = TrainType(...)`. The records import no torch (the host-side Docker tools and `--help` read the config
without it): the builder and the data loader are named by import path ("package.module:function") and imported on
first use. Adding a train type is its record module, one name in `_MODULES` below, its learner module and, when
it reads a section of its own, that section in `astrai/config.py` (docs/train_types.md, "Adding a train type").
"""

from __future__ import annotations

import importlib
from typing import Optional

from astrai.config_schema import ConfigError
from astrai.train_types.spec import TrainType

__all__ = ["DEFAULT", "TrainType", "all_train_types", "get", "legacy_required_files", "names"]

_MODULES = ("online_ppo", "online_grpo", "grpo", "sft", "dpo", "seq", "rm")
"""The record modules of this package, in the order the train types are listed (help, docs, errors)."""

_REGISTRY: dict[str, TrainType] = {}
for _module in _MODULES:
    _record = importlib.import_module(f"{__name__}.{_module}").TRAIN_TYPE
    if _record.name in _REGISTRY:
        raise RuntimeError(f"train type {_record.name!r} is declared twice ({__name__}.{_module})")
    _REGISTRY[_record.name] = _record

DEFAULT = _MODULES[0]
"""The train type of a job that does not set `train.type`."""


def names() -> tuple[str, ...]:
    """The registered train-type names, in declaration order (the choices of `train.type`)."""
    return tuple(_REGISTRY)


def all_train_types() -> tuple[TrainType, ...]:
    """Every registered record, in declaration order."""
    return tuple(_REGISTRY.values())


def get(name: str) -> TrainType:
    """The record of train type `name`.

    Raises:
        ConfigError: one line naming `train.type` and the registered names, for an unknown `name`.
    """
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ConfigError(f"train.type: unknown train type {name!r}; expected one of: {', '.join(_REGISTRY)}") from None


def legacy_required_files(name: Optional[str]) -> tuple[str, ...]:
    """Files beyond the policy that a checkpoint without recorded parts (the layout before parts were recorded in
    its manifest) must hold to resume, by the train type it records; () for None or an unknown name."""
    record = _REGISTRY.get(name) if name is not None else None
    return record.legacy_required_files if record is not None else ()
