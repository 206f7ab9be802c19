"""The memory plans of docs/scaling.md: online_grpo for Qwen2.5-7B, Qwen3-32B and Llama-3.1-70B on 8 and 16 GPUs of
80 GB (H100) and 141 GB (H200), full fine-tuning and LoRA, planned by `astrai.trainer.memory_plan` from each model's
published config.json (no weights needed).

    python tools/scaling_tables.py            # prints the markdown tables docs/scaling.md holds
    python tools/scaling_tables.py --write-models DIR   # writes DIR/<model>/config.json (config-only directories)

Each row is the smallest `rollout.tensor_parallel_size` (1, 2, 4, 8) whose plan takes at most 80% of the GPU
(`memory_plan.WARN_FRACTION`: activations need the rest), under fsdp2 with bf16 weights (`model.dtype: bfloat16`,
AdamW state in fp32) and the engine in bf16 with its default 32768-token KV cache. The decode floor is the time one
decode step needs to read the rank's engine weights once from memory at the GPU's bandwidth (H100 SXM 3.35 TB/s,
H200 4.8 TB/s): no step can be faster, whatever the batch.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

MODELS = {
    "qwen2.5-7b": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 152064,
                   "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                   "num_attention_heads": 28, "num_key_value_heads": 4, "max_position_embeddings": 32768,
                   "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False},
    "qwen3-32b": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
                  "hidden_size": 5120, "intermediate_size": 25600, "num_hidden_layers": 64, "num_attention_heads": 64,
                  "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
                  "rope_theta": 1000000.0, "tie_word_embeddings": False},
    "llama-3.1-70b": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
                      "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                      "num_attention_heads": 64, "num_key_value_heads": 8, "max_position_embeddings": 131072,
                      "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
                      "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 8192, "rope_type": "llama3"}},
}
"""The fields of each model's published config.json that fix its shapes (Hugging Face model cards)."""
GPUS = {"H100 80GB": (80e9, 3.35e12), "H200 141GB": (141e9, 4.8e12)}
"""Memory (bytes) and memory bandwidth (bytes/s) per GPU."""
METHODS = {"full": [], "LoRA r=64": ["--model.lora", "{r: 64}"]}


def plan_row(model: str, gpus: int, memory: float, method: str, tp: int):
    """The plan of one scenario on a GPU (`memory_plan.plan_memory` on the meta device's shapes; only the device's type is read)."""
    import torch

    from astrai.config import load_config
    from astrai.models.config import ModelConfig
    from astrai.trainer.memory_plan import plan_memory

    config = load_config(None, ["--train.type", "online_grpo", "--model.dtype", "bfloat16", "--rollout.dtype",
                                "bfloat16", "--distributed.strategy", "fsdp2", "--rollout.tensor_parallel_size",
                                str(tp), "--distributed.device_memory_gib", str(memory / 2**30), *METHODS[method]])
    return plan_memory(config, ModelConfig.from_hf_dict(MODELS[model]), strategy="fsdp2", world_size=gpus,
                       device=torch.device("cuda"))  # a GPU: no CPU-only prepacked copy


def tables() -> str:
    """The markdown tables, one per GPU kind."""
    from astrai.trainer.memory_plan import WARN_FRACTION

    out = []
    for gpu, (memory, bandwidth) in GPUS.items():
        out += [f"**{gpu}** (fits: at most {WARN_FRACTION:.0%} of it per rank planned)", "",
                "| model | GPUs | training | rollout TP | planned per rank | largest part | decode floor |",
                "| --- | --- | --- | --- | --- | --- | --- |"]
        for model in MODELS:
            for gpus in (8, 16):
                for method in METHODS:
                    fits = [(tp, plan) for tp in (1, 2, 4, 8) if gpus % tp == 0
                            for plan in [plan_row(model, gpus, memory, method, tp)]
                            if plan.total <= WARN_FRACTION * plan.available]
                    if not fits:
                        out.append(f"| {model} | {gpus} | {method} | does not fit | | | |")
                        continue
                    tp, plan = fits[0]
                    items = {item.name: item.bytes for item in plan.items}
                    largest = max(plan.items, key=lambda item: item.bytes)
                    floor = items["engine weights"] / bandwidth * 1e3
                    out.append(f"| {model} | {gpus} | {method} | {tp} | {plan.total / 1e9:.1f} GB | "
                               f"{largest.name} {largest.bytes / 1e9:.1f} GB | {floor:.1f} ms |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write-models", metavar="DIR", help="write DIR/<model>/config.json and exit")
    args = parser.parse_args()
    if args.write_models:
        for name, fields in MODELS.items():
            folder = Path(args.write_models) / name
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "config.json").write_text(json.dumps(fields, indent=2) + "\n")
        return
    print(tables(), end="")


if __name__ == "__main__":
    main()
