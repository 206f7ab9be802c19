"""Publish overhead: `publish_checkpoint` (staging, fsync of every file, sha256 manifest, rename) versus a
plain `save_file`/`torch.save` of the same state into a directory (no fsync, no hashing).

The state is an online_ppo checkpoint of a SmolLM2-135M-shaped model (random weights, fp32): policy,
AdamW moments, critic and critic AdamW moments (~2.9 GB); `--no-critic` drops the critic. `os.sync()`
runs (untimed) before every timed save so neither side pays for the other's dirty pages.

    python bench/checkpoint_overhead.py [--repeats 5] [--no-critic] [--dir /path/on/target/disk]

Prints the median seconds of each and `ratio: X.XX` (publish / plain).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from astrai.checkpoint import Part, publish_checkpoint
from astrai.checkpoint.fsutil import sha256_file
from astrai.models import AutoRegressiveLM, ModelConfig, ValueModel, hf_state_dict, tiny_tokenizer

SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, rms_norm_eps=1e-5, rope_theta=100000.0,
                    max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                    pad_token_id=2)


def build_state(critic: bool) -> dict:
    """The objects of an online_ppo checkpoint with AdamW moments populated (one step on random gradients)."""
    torch.manual_seed(0)
    policy = AutoRegressiveLM(ModelConfig(**SMOLLM2_135M))
    objects = {"policy": policy, "tokenizer": tiny_tokenizer()}
    models = {"optimizer": policy}
    if critic:
        objects["value_model"] = models["value_optimizer"] = ValueModel.from_policy(policy)
    for key, model in models.items():
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
        objects[key] = opt
    return objects


def plain_save(directory: Path, objects: dict, trainer_state: dict) -> None:
    """The baseline: the same files, written directly, nothing synced or hashed."""
    directory.mkdir(parents=True)
    tensors = {k: v.detach().contiguous() for k, v in hf_state_dict(objects["policy"]).items()}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(objects["policy"].config.to_hf_dict()))
    objects["tokenizer"].save(directory)
    for key in ("optimizer", "value_model", "value_optimizer"):
        if key in objects:
            torch.save(objects[key].state_dict(), directory / f"{key}.pt")
    (directory / "trainer_state.json").write_text(json.dumps(trainer_state))


def as_parts(objects: dict, trainer_state: dict) -> dict[str, Part]:
    """The objects as the checkpoint parts a strategy declares (plus the counters)."""

    class Counters:
        def state_dict(self):
            return trainer_state

    kinds = {"policy": "hf_model", "tokenizer": "hf_tokenizer"}
    parts = {name: Part(obj, kinds.get(name, "torch"), required=name != "tokenizer") for name, obj in objects.items()}
    return dict(parts, trainer_state=Part(Counters(), "json"))


def timed(fn) -> float:
    os.sync()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-critic", action="store_true")
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    args = parser.parse_args()
    objects = build_state(critic=not args.no_critic)
    params = sum(p.numel() for p in objects["policy"].parameters())
    scratch = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir))
    state = {"step": 1, "policy_version": 1}
    plain, publish = [], []
    try:
        for i in range(args.repeats):  # alternate the order so drift hits both sides alike
            runs = [(plain, lambda: plain_save(scratch / f"plain-{i}", objects, state), f"plain-{i}"),
                    (publish, lambda: publish_checkpoint(scratch / f"pub-{i}", 1, as_parts(objects, state),
                                                         metadata={"policy_version": 1}), f"pub-{i}")]
            for times, fn, name in runs if i % 2 == 0 else runs[::-1]:
                times.append(timed(fn))
                if name != f"pub-{args.repeats - 1}":
                    shutil.rmtree(scratch / name)
        final = scratch / f"pub-{args.repeats - 1}" / "checkpoints" / "step-00000001"
        files = [p for p in final.iterdir() if p.is_file()]
        total = sum(p.stat().st_size for p in files)
        start = time.perf_counter()
        for p in files:
            sha256_file(p)
        hash_s = time.perf_counter() - start
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    p_med, q_med = statistics.median(plain), statistics.median(publish)
    print(f"state: policy {params / 1e6:.1f}M params fp32, critic {not args.no_critic}, "
          f"{total / 1e9:.2f} GB in {len(files)} files")
    print(f"plain save_file/torch.save: {p_med:.2f} s (runs {', '.join(f'{t:.2f}' for t in plain)})")
    print(f"publish_checkpoint:         {q_med:.2f} s (runs {', '.join(f'{t:.2f}' for t in publish)})")
    print(f"  for reference, sha256 of all files in one thread (page cache): {hash_s:.2f} s "
          f"({total / hash_s / 1e9:.2f} GB/s)")
    print(f"ratio: {q_med / p_med:.2f}")


if __name__ == "__main__":
    main()
