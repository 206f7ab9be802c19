"""`python -m astrai.checkpoint export --merge DIR OUT`: a LoRA checkpoint (its PEFT adapter files) merged into its
base model and written as a plain Hugging Face model directory (model.safetensors, config.json, tokenizer files)
that transformers loads as the base's class; a full checkpoint is written as it is (its policy files).

The directory is written under a hidden staging name next to OUT and renamed into place, so OUT is either absent or
complete; an OUT that exists is refused (nothing is overwritten).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

from astrai.checkpoint.fsutil import fsync_dir, nearest_existing
from astrai.checkpoint.load import check_model_files
from astrai.checkpoint.parts import write_json, write_safetensors
from astrai.checkpoint.manifest import GENERATION_CONFIG, PEFT_FILES, CheckpointError
from astrai.models import hf_state_dict, load_pretrained
from astrai.models.lora_merge import load_merged

__all__ = ["export_merged"]


def export_merged(checkpoint: str | Path, out: str | Path, *, base: Optional[str] = None) -> Path:
    """Write the merged model of `checkpoint` (a checkpoint or adapter directory; `base` overrides the base model its
    `adapter_config.json` names) to the new directory `out`; returns `out`.

    Raises:
        CheckpointError: `out` exists or lies under a file, or `checkpoint` holds neither adapter nor model files
            (one line).
        FileNotFoundError / ValueError: from loading the base model or merging (one line).
    """
    src, out = Path(checkpoint), Path(out)
    if out.exists():
        raise CheckpointError(f"export: {out} exists; name a new directory (nothing is overwritten)")
    check_model_files(src)  # the model files as the checkpoint's manifest lists them
    if all((src / f).is_file() for f in PEFT_FILES):
        model, tokenizer = load_merged(src, load_pretrained, base=base)
    elif (src / "model.safetensors").is_file():
        model, tokenizer = load_pretrained(str(src))
    else:
        raise CheckpointError(f"export: {src} holds neither {PEFT_FILES[0]} nor model.safetensors")
    blocker = nearest_existing(out.parent)
    if blocker is not None and not blocker.is_dir():
        raise CheckpointError(f"export: {blocker} is a file, not a directory; name an output directory whose "
                              "parents are directories")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.export-", dir=out.parent))
    try:
        write_safetensors({k: v.detach().cpu().contiguous() for k, v in hf_state_dict(model).items()},
                          staging / "model.safetensors")
        write_json(staging / "config.json", model.config.to_hf_dict())
        write_json(staging / GENERATION_CONFIG, model.config.generation_config_dict())
        tokenizer.save(staging)
        for name in os.listdir(staging):
            with open(staging / name, "rb") as f:
                os.fsync(f.fileno())
        os.chmod(staging, 0o755)
        os.rename(staging, out)
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out
