"""Rollout throughput of the paged engine on one GPU (H200) with the flash-attn backend, vs the HBM roofline.

    ASTR_BACKEND=flash_attn python bench/rollout_gpu.py [--batch 256] [--max-new-tokens 512] [--dtype bfloat16]

NOT RUN on the development machine (no CUDA there): written to be correct, check the numbers on the GPU.

Decoding is memory-bound: every step reads all weights once plus each live sequence's KV. The script counts the
bytes a perfect kernel would read during the run,
    bytes = steps * weight_bytes + sum over generated tokens of (kv length at that token) * kv_bytes_per_token,
and prints tokens/s plus achieved bandwidth / peak (4.8 TB/s HBM3e of an H200) as the roofline fraction.
(Prefill is compute-bound and counted in the wall time, so the fraction is a lower bound for decode.)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
PEAK_BYTES_PER_S = 4.8e12


def prompts_from_gsm8k(tokenizer, count: int) -> list[list[int]]:
    """`count` chat-templated GSM8K questions (cycled if the file is shorter)."""
    with open(ROOT.parent / "shared" / "data" / "gsm8k" / "test.jsonl") as fh:
        questions = [json.loads(line)["question"] for line in fh]
    return [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": questions[i % len(questions)]}]))
            for i in range(count)]


def bytes_read(model, gen, steps: int) -> float:
    """Ideal HBM bytes of the decode: weights once per step + the KV of every attended position."""
    cfg = model.config
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    elem = next(model.parameters()).element_size()
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * elem
    prompt_lens = gen.prompt_mask.sum(-1).double()
    resp_lens = gen.action_mask.sum(-1).double()
    # token t of a response attends over prompt_len + t cached positions: sum_t (P + t) = T*P + T(T-1)/2
    kv_positions = float((resp_lens * prompt_lens + resp_lens * (resp_lens - 1) / 2).sum())
    return steps * weight_bytes + kv_positions * kv_per_token


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/rollout_gpu.py needs a CUDA device")
    from astrai.models import load_pretrained
    from astrai.rollout.paged_engine import PagedGenerationEngine
    from astrai.rollout.sampling import SamplingParams

    dtype = getattr(torch, args.dtype)
    model, tokenizer = load_pretrained(args.model, torch.float32)
    model = model.to("cuda", dtype)
    prompts = prompts_from_gsm8k(tokenizer, args.batch)
    engine = PagedGenerationEngine(model, pad_token_id=tokenizer.pad_token_id, prefix_cache=False,
                                   max_kv_tokens=args.batch * (max(map(len, prompts)) + args.max_new_tokens) + 4096,
                                   max_batch_tokens=16384, max_num_seqs=args.batch)
    print(f"device: {torch.cuda.get_device_name()}, backend: {engine.backend.name} "
          f"({getattr(engine.backend, 'fallback_reason', 'selected')}), block_size {engine.block_size}, {args.dtype}")
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0,
                            stop_token_ids=(tokenizer.eos_token_id,))
    engine.generate(prompts[:8], SamplingParams(max_new_tokens=8), torch.Generator("cuda").manual_seed(0))
    torch.cuda.synchronize()
    start = time.perf_counter()
    gen = engine.generate(prompts, params, torch.Generator("cuda").manual_seed(1))
    torch.cuda.synchronize()
    secs = time.perf_counter() - start
    tokens = int(gen.action_mask.sum())
    steps = engine.last_stats["steps"]
    achieved = bytes_read(engine.model, gen, steps) / secs
    print(f"batch {args.batch}: {tokens} tokens in {secs:.2f} s = {tokens / secs:.0f} tok/s over {steps} steps")
    print(f"HBM roofline fraction: {achieved / PEAK_BYTES_PER_S:.3f} "
          f"({achieved / 1e12:.2f} TB/s of {PEAK_BYTES_PER_S / 1e12:.1f} TB/s)")


if __name__ == "__main__":
    main()
