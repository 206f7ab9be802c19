"""Rollout throughput on CPU: astrai's paged engine vs `transformers` generate, same prompts, same threads.

    python bench/rollout.py [--threads 1] [--prompts 32] [--batch1-prompts 4] [--max-new-tokens 128]

SmolLM2-135M-Instruct (GGUF, float32), GSM8K test questions (chat-templated, mixed lengths, read from
`../shared/data/gsm8k/test.jsonl` relative to the repo root), sampling at temperature 1 (top_k 0, top_p 1), stop
at EOS. Counts generated tokens (EOS included) per second of wall time. Batch B = all prompts in one call;
batch 1 = one call per prompt on the first `--batch1-prompts` prompts. The engine runs with its defaults (prefix
cache on, cleared after the warm-up call). It also times the workload's GEMMs alone (the float32 matmul floor
that no engine computing the same products can go below; measured before and after the astrai run, the lower
counts) and prints the ratio that floor allows, then that floor plus the time to read, once, the keys/values every
decode step attends over (bench/floors.py: `decode_kv_bytes` at `measure_read_bandwidth`), which one query per row
makes memory-bound rather than FLOP-bound. Both floors assume every row runs all `--max-new-tokens` steps, so rows
that stop at EOS earlier make them slightly high (the token count line shows how many were generated). Ends with
`ratio: X.XX` = astrai / transformers tokens/s at batch B.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

import floors
import gsm8k

ROOT = Path(__file__).resolve().parents[1]
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GSM8K = gsm8k.DEFAULT


def load_prompts(tokenizer, count: int) -> list[list[int]]:
    """The first `count` GSM8K questions of `GSM8K`, chat-templated, as token ids; exits with one line naming the file
    when it holds fewer records or a record has no string 'question'."""
    records = gsm8k.first_records(GSM8K, count, "--prompts")
    for number, record in enumerate(records, 1):
        if not isinstance(record.get("question"), str):
            sys.exit(f"{GSM8K}: record {number} has no string 'question'")
    return [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": r["question"]}]))
            for r in records]


def run_astrai(engine, prompts, max_new: int, seed: int) -> int:
    """Generated tokens of one engine call over `prompts`."""
    from astrai.rollout.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=max_new, temperature=1.0, stop_token_ids=(2,))
    gen = engine.generate(prompts, params, torch.Generator().manual_seed(seed))
    return int(gen.action_mask.sum())


def run_hf(model, prompts, max_new: int, seed: int) -> int:
    """Generated tokens (up to and including EOS) of one left-padded `generate` call over `prompts`."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), 2, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new, do_sample=True, temperature=1.0,
                             top_k=0, top_p=1.0, eos_token_id=2, pad_token_id=2)
    total = 0
    for row in out[:, width:].tolist():
        total += row.index(2) + 1 if 2 in row else len(row)
    return total


def gemm_pass_seconds(model, rows: int, repeats: int = 3) -> float:
    """Fastest of `repeats` timings of one forward's GEMMs alone (fused q/k/v, o, fused gate/up, down per layer,
    plus the LM head on min(rows, 32) rows, as the engine runs them) for `rows` tokens, float32."""
    import torch.nn.functional as F

    from astrai.rollout.model_runner import LOGITS_CHUNK, fuse_projections

    fuse_projections(model)
    cfg = model.config
    x = torch.randn(rows, cfg.hidden_size)
    hidden = torch.randn(rows, cfg.intermediate_size)
    attn_out = torch.randn(rows, cfg.num_attention_heads * cfg.head_dim)
    head_rows = x[:min(rows, 32)]
    weight = model.lm_head.weight
    logits = torch.empty(head_rows.shape[0], weight.shape[0])
    best = float("inf")
    with torch.no_grad():
        for _ in range(repeats):
            start = time.perf_counter()
            for layer in model.model.layers:
                F.linear(x, layer.self_attn.qkv_weight)
                F.linear(attn_out, layer.self_attn.o_proj.weight)
                F.linear(x, layer.mlp.gate_up_weight)
                F.linear(hidden, layer.mlp.down_proj.weight)
            for s in range(0, weight.shape[0], LOGITS_CHUNK):
                torch.mm(head_rows, weight[s:s + LOGITS_CHUNK].t(), out=logits[:, s:s + LOGITS_CHUNK])
            best = min(best, time.perf_counter() - start)
    return best


def timed(fn, *args) -> tuple[int, float]:
    """(tokens, seconds) of `fn(*args)`."""
    start = time.perf_counter()
    tokens = fn(*args)
    return tokens, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] + f" Reads {GSM8K}.",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--threads", type=int, default=1, help="torch threads for both engines")
    parser.add_argument("--prompts", type=int, default=32, help="GSM8K questions = the batch B")
    parser.add_argument("--batch1-prompts", type=int, default=4, help="prompts generated one at a time")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per response (stop at EOS)")
    args = parser.parse_args()
    if not GSM8K.is_file():
        parser.error(f"{GSM8K} not found: the benchmark needs the GSM8K test split there (one JSON object with a "
                     "'question' per line)")
    if min(args.threads, args.prompts, args.max_new_tokens) < 1 or args.batch1_prompts < 0:
        parser.error("--threads, --prompts and --max-new-tokens must be >= 1, --batch1-prompts >= 0")
    torch.set_num_threads(args.threads)
    print(f"threads: {torch.get_num_threads()}")
    import transformers

    from astrai.models import load_pretrained, resolve_model_path
    from astrai.rollout.paged_engine import PagedGenerationEngine

    model, tokenizer = load_pretrained("smollm2-135m-instruct", torch.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(resolve_model_path("smollm2-135m-instruct").parent,
                                                           gguf_file=GGUF, dtype=torch.float32).eval()
    prompts = load_prompts(tokenizer, args.prompts)
    lengths = sorted(len(p) for p in prompts)
    print(f"prompts: {len(prompts)}, lengths {lengths[0]}..{lengths[-1]} (median {statistics.median(lengths):g}), "
          f"max_new_tokens {args.max_new_tokens}, sampling T=1")
    engine = PagedGenerationEngine(model, pad_token_id=2)
    print(f"astrai backend: {engine.backend.name}, block_size {engine.block_size}")
    run_astrai(engine, prompts[:2], 4, 0)  # warm-up (allocates the pool for small calls)
    engine.prefix_cache.clear()  # the timed call must not reuse the warm-up's prompt blocks
    prompt_tokens = sum(len(p) for p in prompts)
    chunk = min(engine.max_batch_tokens, prompt_tokens)

    def workload_floor() -> float:
        return (gemm_pass_seconds(engine.model, chunk, 1) * prompt_tokens / chunk
                + gemm_pass_seconds(engine.model, len(prompts)) * (args.max_new_tokens - 1))

    floors_measured = [workload_floor()]  # bracketing the astrai run: the machine's speed drifts
    results = {}
    for name, fn, target in (("astrai", run_astrai, engine), ("transformers", run_hf, hf)):
        tokens, secs = timed(fn, target, prompts, args.max_new_tokens, 1)
        results[name] = tokens / secs
        print(f"{name:12s} batch {len(prompts):3d}: {tokens:6d} tokens in {secs:7.1f} s = {tokens / secs:8.1f} tok/s")
        if name == "astrai":
            print(f"  engine stats (steps, groups, dense decode rebuilds, prefix-cache block hits / entries): "
                  f"{engine.last_stats}")
            results["astrai_seconds"] = secs
            floors_measured.append(workload_floor())
        else:
            results["transformers_seconds"] = secs
    floor = min(floors_measured)
    print(f"GEMM-only floor of this workload ({prompt_tokens} prompt tokens unpadded, {args.max_new_tokens - 1} "
          f"decode steps of {len(prompts)} rows, float32, no attention/sampling): {floors_measured[0]:.1f} s "
          f"measured before the astrai run, {floors_measured[1]:.1f} s after (a difference means the machine's "
          f"speed changed); astrai {results['astrai_seconds'] / floor:.2f}x the lower; ratio ceiling for any engine "
          f"doing these GEMMs: {results['transformers_seconds'] / floor:.2f}")
    dims = floors.Dims.of(engine.model.config)
    kv_bytes = floors.decode_kv_bytes(dims, [len(p) for p in prompts], [args.max_new_tokens] * len(prompts))
    bandwidth = floors.measure_read_bandwidth()
    kv_floor = floor + kv_bytes / bandwidth
    print(f"with the decode attention's reads of the cached keys/values ({kv_bytes / 1e9:.2f} GB at the "
          f"{bandwidth / 1e9:.1f} GB/s a torch.sum reads memory here): {kv_floor:.1f} s; astrai "
          f"{results['astrai_seconds'] / kv_floor:.2f}x that floor")
    for name, fn, target in (("astrai", run_astrai, engine), ("transformers", run_hf, hf))[:2 * bool(
            args.batch1_prompts)]:
        total_tokens, total_secs = 0, 0.0
        for i, prompt in enumerate(prompts[:args.batch1_prompts]):
            tokens, secs = timed(fn, target, [prompt], args.max_new_tokens, 100 + i)
            total_tokens, total_secs = total_tokens + tokens, total_secs + secs
        print(f"{name:12s} batch   1: {total_tokens:6d} tokens in {total_secs:7.1f} s = "
              f"{total_tokens / total_secs:8.1f} tok/s ({len(prompts[:args.batch1_prompts])} prompts)")
    print(f"ratio: {results['astrai'] / results['transformers']:.2f}")


if __name__ == "__main__":
    main()
