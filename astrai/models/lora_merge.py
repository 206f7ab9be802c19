"""LoRA adapters in PEFT's file format, merged into their base weights: W' = W + s * B A (Hu et al. 2022, "LoRA:
Low-Rank Adaptation of Large Language Models", section 4.1; s = alpha / r, or alpha / sqrt(r) with rsLoRA,
Kalajdzievski 2023).

PEFT names an adapter tensor ``base_model.model.<module>.lora_A.weight`` (A: (r, in)) and ``...lora_B.weight``
(B: (out, r)) for the base weight ``<module>.weight`` (out, in); modules it trains whole (``modules_to_save``, e.g. a
reward model's ``score``) are stored as ``base_model.model.<module>.weight``. `load_merged` turns a directory with
``adapter_config.json`` + ``adapter_model.safetensors`` (an astrai LoRA checkpoint, or one PEFT wrote) into a plain
model: what serving, evaluation and ``python -m astrai.checkpoint export --merge`` use.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from .tokenizer import Tokenizer

__all__ = ["PEFT_PREFIX", "adapter_scaling", "load_merged", "merge_adapter", "peft_name", "module_name"]

PEFT_PREFIX = "base_model.model."
"""The prefix PEFT gives every adapter tensor name."""


def peft_name(name: str) -> str:
    """A trained model's state-dict name (``...q_proj.lora_A.default.weight``, ``value_head.weight``) as PEFT saves
    it (``base_model.model....q_proj.lora_A.weight``): the adapter name dropped, the prefix added."""
    return PEFT_PREFIX + name.replace(".default.", ".")


def module_name(name: str) -> str:
    """Inverse of `peft_name` for the default adapter."""
    name = name[len(PEFT_PREFIX):] if name.startswith(PEFT_PREFIX) else name
    for part in (".lora_A.", ".lora_B."):
        name = name.replace(part, part + "default.")
    return name


def adapter_scaling(adapter_config: Mapping[str, Any]) -> float:
    """s of `adapter_config.json`: ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with ``use_rslora``."""
    r, alpha = adapter_config["r"], adapter_config["lora_alpha"]
    return alpha / (math.sqrt(r) if adapter_config.get("use_rslora") else r)


@torch.no_grad()
def merge_adapter(base: Mapping[str, torch.Tensor], adapter: Mapping[str, torch.Tensor], *,
                  scaling: float) -> dict[str, torch.Tensor]:
    """The base state with the adapter merged in: for every ``<m>.lora_A`` / ``<m>.lora_B`` pair of `adapter`
    (PEFT names), ``<m>.weight = W + scaling * B @ A`` (computed in float32, stored in W's dtype); whole modules of
    `adapter` replace the base's tensors. Returns a new dict (tensors not merged are the base's own).

    Raises:
        ValueError: an adapter tensor without its pair, or one that names no base weight (one line, the name).
    """
    out = dict(base)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in adapter.items():
        plain = name[len(PEFT_PREFIX):] if name.startswith(PEFT_PREFIX) else name
        for part in ("lora_A", "lora_B"):
            if f".{part}." in plain:
                pairs.setdefault(plain.split(f".{part}.")[0], {})[part] = tensor
                break
        else:
            if plain not in out:
                raise ValueError(f"adapter tensor {name!r} names no tensor of the base model")
            out[plain] = tensor.to(out[plain].dtype)
    for module, ab in pairs.items():
        if set(ab) != {"lora_A", "lora_B"}:
            raise ValueError(f"adapter of {module!r} has {sorted(ab)} but needs lora_A and lora_B")
        weight = out.get(f"{module}.weight")
        if weight is None:
            raise ValueError(f"adapter of {module!r} names no base weight {module}.weight")
        delta = ab["lora_B"].float() @ ab["lora_A"].float()
        out[f"{module}.weight"] = (weight.float() + scaling * delta).to(weight.dtype)
    return out


def load_merged(path: str | Path, load_base: Callable[..., tuple[Any, Any]], *, dtype: torch.dtype = torch.float32,
                device: Any = "cpu", base: str | None = None):
    """(AutoRegressiveLM, Tokenizer) of an adapter directory: the base model (`base`, else the config's
    ``base_model_name_or_path``: a model name, Hugging Face directory, .gguf file or Hub id, at the config's
    ``revision`` when it records one (PEFT's field; not for an overriding `base`), loaded by
    `load_base(name, dtype=, device=[, revision=])`: `astrai.models.loading.load_pretrained`) with the adapter merged
    in; the tokenizer of the directory when it holds one, else the base's.

    Raises:
        FileNotFoundError / ValueError: a missing adapter file or base model, or an adapter that does not fit it.
    """
    from safetensors.torch import load_file

    path = Path(path)
    config = json.loads((path / "adapter_config.json").read_text(encoding="utf-8"))
    base_path = base or config.get("base_model_name_or_path")
    if not base_path:
        raise ValueError(f"{path / 'adapter_config.json'}: no base_model_name_or_path; name the base model")
    revision = None if base else config.get("revision")
    model, tokenizer = load_base(base_path, dtype=dtype, device=device,
                                 **({"revision": revision} if revision else {}))
    adapter = load_file(str(path / "adapter_model.safetensors"))
    merged = merge_adapter(model.state_dict(), adapter, scaling=adapter_scaling(config))
    model.load_state_dict(merged, strict=True)
    if (path / "tokenizer.json").is_file():
        tokenizer = Tokenizer.from_dir(path)
    return model, tokenizer
