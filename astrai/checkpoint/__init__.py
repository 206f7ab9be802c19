"""Checkpoint publishing (the only package that writes checkpoint files), loading and verification.

See docs/conventions.md section 5 and the module docstrings: `publish` (protocol),
`parts` (the named parts a checkpoint stores and how each kind is written), `layout` (names, latest, recovery,
retention), `manifest`, `load`, `verify`, `lock` (one job per output directory), `__main__` (CLI).
Names are imported lazily so that `python -m astrai.checkpoint verify` does not import torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "layout": ("CheckpointWarning", "apply_retention", "checkpoints_root", "find_latest_checkpoint",
               "list_checkpoints", "parse_step", "recover", "run_id_of", "step_dirname"),
    "load": ("LoadedCheckpoint", "ModelFilesError", "VerificationError", "check_model_files", "load_checkpoint",
             "load_model"),
    "manifest": ("FORMAT_NAME", "FORMAT_VERSION", "CheckpointError", "FileStatus", "NotACheckpointError"),
    "parts": ("GlobalRNGState", "Part", "capture_rng_state", "derived_seed", "part_files", "restore_rng_state"),
    "publish": ("DistLike", "publish_checkpoint"),
    "verify": ("VerifyReport", "verify_checkpoint"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
