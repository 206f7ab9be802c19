"""Export the model astrai loads (e.g. SmolLM2-135M-Instruct from its GGUF, dequantized to float32) as a Hugging Face
directory, so that `transformers` and TRL load exactly the same float32 weights and tokenizer without a model hub.

    python bench/hf_export.py [--model smollm2-135m-instruct] [--output DIR]

Written with astrai's checkpoint writer (`astrai.checkpoint.parts`: the `hf_model` and `hf_tokenizer` parts that
checkpoints publish): config.json, model.safetensors (tied embeddings: no lm_head tensor), tokenizer.json,
tokenizer_config.json (ChatML template, pad = eos = <|im_end|>). A stamp file records the source file's path, size
and modification time; an existing directory with the same stamp is reused.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

DEFAULT_DIR = Path(tempfile.gettempdir()) / "astrai-bench-hf"
STAMP = "astrai_export.json"


def _stamp(model: str) -> dict:
    from astrai.models import resolve_model_path

    source = resolve_model_path(model)
    stat = source.stat()
    return {"model": model, "source": str(source), "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns,
            "dtype": "float32"}


def export_hf(model: str = "smollm2-135m-instruct", directory: Path | None = None) -> Path:
    """The Hugging Face directory of astrai's float32 load of `model` (an alias, GGUF file or HF directory), written
    to `directory` (default: <tmp>/astrai-bench-hf/<model name>) unless it already holds this export."""
    from astrai.checkpoint.parts import Part, write_parts
    from astrai.models import load_pretrained

    directory = Path(directory or DEFAULT_DIR / Path(str(model)).stem)
    stamp = _stamp(model)
    stamp_file = directory / STAMP
    if stamp_file.is_file() and json.loads(stamp_file.read_text()) == stamp:
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    stamp_file.unlink(missing_ok=True)
    policy, tokenizer = load_pretrained(model, torch.float32)
    write_parts(directory, {"model": Part(policy, "hf_model"), "tokenizer": Part(tokenizer, "hf_tokenizer")}, 0)
    stamp_file.write_text(json.dumps(stamp, indent=2) + "\n")
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    print(export_hf(args.model, args.output))


if __name__ == "__main__":
    main()
