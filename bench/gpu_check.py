"""One check of astrai's GPU rollout path: kernels, greedy parity, throughput, roofline, CUDA graphs, a PPO step.

    pip install --no-deps --no-build-isolation -e .              # once, in the checkout on the GPU machine
    python bench/gpu_check.py --output gpu_check.json            # one CUDA GPU (see --budget-s)
    python bench/gpu_check.py --smoke --output smoke.json        # tiny shapes on CPU: checks the script itself

Needs only PyTorch, Triton, transformers and accelerate (no flash-attn, no DeepSpeed, no network). The model has
SmolLM2-135M's shapes (30 layers, hidden 576, MLP 1536, 9 heads, 3 KV heads, vocab 49152, tied embeddings, rope
theta 1e5, 8192 positions) with random weights (HF init, seeded), saved in Hugging Face format so that astrai and
transformers load the same weights. Parts, each recorded in the JSON written to --output:
1. kernel_parity: the Triton paged kernels vs the torch reference on CUDA (`astrai.kernels.parity`, float32 /
   float16 / bfloat16, block sizes 1-32, GQA groups 1-8, SmolLM2 lengths up to 1000).
2. greedy_parity: greedy tokens of astrai's engine (bfloat16 copy, `auto` backend) vs transformers `generate` in
   bfloat16, one prompt at a time on the transformers side (no padding): share of tokens before each row's first
   divergence, and at the first divergence the transformers logit margin between the two tokens (random
   weights give near-flat logits, so a bfloat16 near-tie explains a divergence when the margin is ~1e-2). A float32
   run of both is the control (expected 1.0).
3. throughput: rollout tokens/s (sampling at temperature 1, fixed length, bfloat16) of astrai vs transformers
   `generate` at batch 1 (a few prompts, one call each), 32 and 128, same prompts; `ratio:` = astrai / transformers.
4. roofline: decode step time from two astrai runs that differ only in response length (their difference is pure
   decode), bytes a decode step must read (all weights once + every attended KV position), and the fraction of the
   peak HBM bandwidth (--peak-tbps, H200: 4.8 TB/s) that this achieves.
5. cuda_graphs: the engine with `cuda_graphs=True` (decode steps padded to batch buckets, replayed as CUDA graphs):
   greedy match rate against the eager engine (padded GEMMs may round a bfloat16 near-tie differently), part 4
   with graphs, the buckets captured; part 3 times it beside the eager engine (each bucket captured in an untimed
   call first). On CPU (`--smoke`) the padded steps run eagerly: that checks the script, not the speed.
6. train_step: one online_ppo optimizer step of a tiny model through the real entry point (`astrai.train`) on the
   device, with `rollout.dtype=bfloat16` (fp32 policy, bf16 rollout copy).
Parts that need CUDA are skipped on CPU with a note; a part that raises is recorded with its error and the others
still run. Exit code 1 if a part failed, a kernel parity case is off or a capture failed, else 0.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from cli_help import DefaultsFormatter  # noqa: E402  (bench/, the script's own folder)

ROOT = Path(__file__).resolve().parents[1]
try:
    import astrai.kernels  # noqa: F401  (the astrai.kernels package exists only once astrai is installed)
except ImportError as exc:
    raise SystemExit(f"gpu_check: astrai is not installed ({exc}); run `pip install --no-deps "
                     "--no-build-isolation -e .` in the checkout first")

SMOLLM2_SHAPES = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, rms_norm_eps=1e-5, rope_theta=100000.0,
                      max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                      pad_token_id=2)
SMOKE_SHAPES = dict(SMOLLM2_SHAPES, vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


@dataclass(frozen=True)
class Plan:
    """Sizes of one mode: prompt lengths drawn from [prompt_lo, prompt_hi], token counts per part."""

    shapes: dict
    prompt_lo: int
    prompt_hi: int
    parity_prompts: int
    parity_tokens: int
    batches: tuple
    batch1_prompts: int
    bench_tokens: int
    roofline_batch: int
    roofline_tokens: tuple


FULL = Plan(SMOLLM2_SHAPES, 32, 160, 8, 64, (1, 32, 128), 3, 128, 128, (32, 160))
SMOKE = Plan(SMOKE_SHAPES, 4, 24, 4, 12, (1, 4, 8), 2, 12, 8, (4, 12))


def sync(device: torch.device) -> None:
    """Wait for queued device work (timings are host wall-clock)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn, *args):
    """(fn(*args), seconds), the device synchronised before and after."""
    sync(device)
    start = time.perf_counter()
    result = fn(*args)
    sync(device)
    return result, time.perf_counter() - start


def save_random_model(shapes: dict, path: Path, seed: int) -> Path:
    """Random-init `AutoRegressiveLM` with `shapes` saved as an HF directory (config.json, model.safetensors,
    tokenizer files of the tiny test tokenizer: prompts here are random ids, not text)."""
    from safetensors.torch import save_file

    from astrai.models import AutoRegressiveLM, ModelConfig, hf_state_dict, tiny_tokenizer

    torch.manual_seed(seed)
    model = AutoRegressiveLM(ModelConfig(**shapes))
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in hf_state_dict(model).items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(model.config.to_hf_dict()))
    tiny_tokenizer().save(path)
    return path


def random_prompts(count: int, plan: Plan, seed: int) -> list[list[int]]:
    """`count` prompts of random ids in [3, V) (no special tokens) with lengths in [prompt_lo, prompt_hi]."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(plan.prompt_lo, plan.prompt_hi + 1, (count,), generator=gen).tolist()
    return [torch.randint(3, plan.shapes["vocab_size"], (n,), generator=gen).tolist() for n in lengths]


def load_models(model_dir: Path, device: torch.device, dtype: torch.dtype, max_tokens: int):
    """(astrai `PagedGenerationEngine` with a `dtype` copy, transformers model in `dtype`) of the same weights."""
    import transformers

    from astrai.models import load_pretrained
    from astrai.rollout.paged_engine import PagedGenerationEngine

    model, _ = load_pretrained(model_dir, torch.float32, device=device)
    engine = PagedGenerationEngine(model, pad_token_id=0, dtype=dtype, prefix_cache=False, max_kv_tokens=max_tokens,
                                   max_batch_tokens=8192, max_num_seqs=256)
    del model
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir).to(device=device, dtype=dtype).eval()
    hf.generation_config.eos_token_id = None  # fixed-length responses on both sides
    return engine, hf


def astrai_tokens(engine, prompts, new_tokens: int, greedy: bool, seed: int) -> list[list[int]]:
    """Generated ids (B lists of `new_tokens`) of one engine call (no stop token)."""
    from astrai.rollout.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, top_k=1 if greedy else 0, stop_token_ids=())
    gen = engine.generate(prompts, params, torch.Generator(engine.device).manual_seed(seed))
    if not bool(gen.action_mask.all()) or gen.response_ids.shape[1] != new_tokens:
        raise RuntimeError(f"astrai generated {int(gen.action_mask.sum())} tokens, expected "
                           f"{len(prompts) * new_tokens}")
    return gen.response_ids.tolist()


def hf_tokens(hf, prompts, new_tokens: int, greedy: bool, seed: int) -> list[list[int]]:
    """Generated ids (B lists) of one left-padded transformers `generate` call (no stop token)."""
    device = hf.device
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):], mask[row, width - len(p):] = torch.tensor(p), 1
    sampling = {"do_sample": False} if greedy else {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
    torch.manual_seed(seed)
    with torch.no_grad():
        out = hf.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, pad_token_id=0, **sampling)
    if out.shape[1] - width != new_tokens:
        raise RuntimeError(f"transformers generated {out.shape[1] - width} tokens, expected {new_tokens}")
    return out[:, width:].tolist()


def kernel_parity(device: torch.device, plan: Plan) -> dict:
    """Every case of `FULL_CASES + SMOLLM2_CASES` in float32 / float16 / bfloat16 against the float32 reference."""
    from astrai.kernels.parity import FULL_CASES, SMOLLM2_CASES, run_cases

    rows = run_cases("triton", FULL_CASES + SMOLLM2_CASES, (torch.float32, torch.float16, torch.bfloat16), device)
    worst = {}
    for row in rows:
        worst[row["dtype"]] = max(worst.get(row["dtype"], 0.0), row["max_abs_err"])
    return {"all_ok": all(r["ok"] for r in rows), "cases": len(rows), "max_abs_err": worst,
            "failed": [r for r in rows if not r["ok"]]}


def greedy_compare(engine, hf, prompts, new_tokens: int) -> dict:
    """Greedy tokens of the engine (one call) vs transformers (one call per prompt): see the module docstring."""
    ours = astrai_tokens(engine, prompts, new_tokens, True, 0)
    theirs = [hf_tokens(hf, [p], new_tokens, True, 0)[0] for p in prompts]
    firsts = [next((t for t, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(ours, theirs)]
    matched = sum(new_tokens if f is None else f for f in firsts)
    result = {"rows": len(prompts), "tokens_per_row": new_tokens, "match_rate": matched / (len(prompts) * new_tokens),
              "identical_rows": sum(f is None for f in firsts), "first_divergence": None}
    diverged = [(f, row) for row, f in enumerate(firsts) if f is not None]
    if diverged:
        step, row = min(diverged)
        context = torch.tensor([prompts[row] + theirs[row][:step]], device=hf.device)
        with torch.no_grad():
            logits = hf(input_ids=context).logits[0, -1].float()
        a, b = ours[row][step], theirs[row][step]
        result["first_divergence"] = {"row": row, "step": step, "astrai_token": a, "transformers_token": b,
                                      "transformers_logit_margin": float(logits[b] - logits[a])}
    return result


def greedy_parity(model_dir: Path, device: torch.device, plan: Plan) -> dict:
    """bfloat16 comparison plus the float32 control."""
    prompts = random_prompts(plan.parity_prompts, plan, seed=1)
    out = {}
    for name, dtype in (("bfloat16", torch.bfloat16), ("float32_control", torch.float32)):
        engine, hf = load_models(model_dir, device, dtype, 4 * len(prompts) * (plan.prompt_hi + plan.parity_tokens))
        out[name] = dict(greedy_compare(engine, hf, prompts, plan.parity_tokens), backend=engine.backend.name)
        del engine, hf
    return out


def throughput(engine, hf, plan: Plan, device: torch.device, graphs=None) -> dict:
    """tokens/s of both at each batch size (sampling, fixed length); batch 1 = one call per prompt. With `graphs`
    (the engine with CUDA graphs) also its tokens/s, after an untimed call that captures the batch's bucket."""
    out = {}
    warm = random_prompts(max(plan.batches), plan, seed=9)  # warm-up at the largest batch: compiles, pool size
    astrai_tokens(engine, warm, 4, False, 0)
    hf_tokens(hf, warm, 4, False, 0)
    sides = (("astrai", astrai_tokens, engine), ("astrai_graphs", astrai_tokens, graphs),
             ("transformers", hf_tokens, hf))
    for batch in plan.batches:
        prompts = random_prompts(max(batch, plan.batch1_prompts) if batch == 1 else batch, plan, seed=100 + batch)
        calls = [[p] for p in prompts] if batch == 1 else [prompts]
        rates = {}
        for name, fn, target in [side for side in sides if side[2] is not None]:
            if target is graphs:
                astrai_tokens(graphs, calls[0], 4, False, 0)
            seconds = sum(timed(device, fn, target, call, plan.bench_tokens, False, 1)[1] for call in calls)
            rates[name] = len(prompts) * plan.bench_tokens / seconds
        out[str(batch)] = {"astrai_tok_s": rates["astrai"], "transformers_tok_s": rates["transformers"],
                           "ratio": rates["astrai"] / rates["transformers"], "prompts": len(prompts)}
        if graphs is not None:
            out[str(batch)].update(astrai_graphs_tok_s=rates["astrai_graphs"],
                                   graphs_speedup=rates["astrai_graphs"] / rates["astrai"])
    return out


def roofline(engine, plan: Plan, device: torch.device, peak_tbps: float) -> dict:
    """Decode step time = (t(T2) - t(T1)) / (T2 - T1) at `roofline_batch` (when noise makes that difference not
    positive, as it can on a busy CPU, t(T2) / T2 instead: an upper bound that includes the prefill; `step_time`
    says which); bytes per step = weights + the KV of every attended position (kv_len of the step feeding token t
    is P + t + 1), averaged over those steps."""
    prompts = random_prompts(plan.roofline_batch, plan, seed=7)
    short, long = plan.roofline_tokens
    astrai_tokens(engine, prompts, short, False, 2)  # warm-up at this batch
    t_short = min(timed(device, astrai_tokens, engine, prompts, short, False, 3)[1] for _ in range(2))
    t_long = min(timed(device, astrai_tokens, engine, prompts, long, False, 3)[1] for _ in range(2))
    steps = long - short
    difference = t_long > t_short
    step_s = (t_long - t_short) / steps if difference else t_long / long
    cfg = engine.model.config
    element = torch.empty((), dtype=engine.dtype).element_size()
    weight_bytes = sum(p.numel() for p in engine.model.parameters()) * element
    kv_per_position = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * element
    positions = sum(sum(len(p) + t + 1 for p in prompts) for t in range(short - 1, long - 1))
    step_bytes = weight_bytes + positions * kv_per_position / steps
    achieved = step_bytes / step_s
    return {"batch": len(prompts), "decode_steps": steps, "decode_step_ms": 1e3 * step_s,
            "step_time": "difference" if difference else "upper bound (t(T2) / T2)",
            "weight_bytes": weight_bytes, "kv_bytes_per_step": step_bytes - weight_bytes,
            "achieved_tbps": achieved / 1e12, "peak_tbps": peak_tbps, "fraction": achieved / (peak_tbps * 1e12),
            "backend": engine.backend.name, "dtype": str(engine.dtype).removeprefix("torch."),
            "note": None if device.type == "cuda" else "CPU: the fraction of a GPU's peak is not meaningful here"}


def graph_engine(eager, model_dir: Path, device: torch.device):
    """An engine like `eager` (the same weights from `model_dir`, sizes and dtype) with `cuda_graphs=True`. Built
    from the checkpoint, not from `eager.model`: on a CPU where the engine prepacks its GEMM weights, those are
    oneDNN tensors without storage, which cannot be copied into another engine."""
    from astrai.models import load_pretrained
    from astrai.rollout.paged_engine import PagedGenerationEngine

    model, _ = load_pretrained(model_dir, torch.float32, device=device)
    return PagedGenerationEngine(model, pad_token_id=0, dtype=eager.dtype, prefix_cache=False,
                                 max_kv_tokens=eager.max_kv_blocks * eager.block_size,
                                 max_batch_tokens=eager.max_batch_tokens, max_num_seqs=eager.max_num_seqs,
                                 cuda_graphs=True)


def cuda_graphs(graphs, eager, plan: Plan, device: torch.device, peak_tbps: float) -> dict:
    """The engine with CUDA graphs against the eager one: greedy match rate, its roofline, what it captured."""
    prompts = random_prompts(plan.parity_prompts, plan, seed=1)
    ours, theirs = (astrai_tokens(e, prompts, plan.parity_tokens, True, 0) for e in (graphs, eager))
    firsts = [next((t for t, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(ours, theirs)]
    return {"backend": graphs.backend.name, "greedy_match_rate": sum(firsts) / (len(prompts) * plan.parity_tokens),
            "roofline": roofline(graphs, plan, device, peak_tbps), "captured_buckets": sorted(graphs._graphs.graphs),
            "padded_steps": graphs._graphs.replays, "capture_error": graphs._graphs.capture_error}


def train_step(workdir: Path, device: torch.device) -> dict:
    """One online_ppo optimizer step (tiny model, fp32 policy, bf16 rollout copy) through `astrai.train.main`."""
    from astrai.models import tiny_config
    from astrai.train import main as train_main

    model_dir = save_random_model(asdict(tiny_config()), workdir / "tiny", seed=0)
    out = workdir / "ppo"
    args = ["--config", str(ROOT / "configs" / "examples" / "ppo.yaml"), "--model.path", str(model_dir),
            "--train.output_dir", str(out), "--max_steps", "1", "--rollout.batch_size", "4",
            "--ppo.minibatch_size", "4", "--ppo.micro_batch_size", "2", "--rollout.max_new_tokens", "8",
            "--rollout.dtype", "bfloat16", "--train.progress_bar", "false", "--checkpoint.save_at_end", "false",
            "--runtime.device", str(device), "--data.truncation", "left"]  # the tiny tokenizer makes long prompts
    code, seconds = timed(device, train_main, args)
    from astrai.outputs import read_jsonl  # a torn last line is skipped, said once

    records = read_jsonl(out / "metrics.jsonl") if code == 0 else []
    last = records[-1] if records else {}
    keys = ("policy/loss", "critic/loss", "rollout/logprob_gap", "rollout/reward_mean", "policy_version")
    metrics = {k: last.get(k) for k in keys}
    finite = all(isinstance(v, (int, float)) and math.isfinite(v) for v in metrics.values())
    return {"ok": code == 0 and finite and metrics["policy_version"] == 1, "exit_code": code, "seconds": seconds,
            "metrics": metrics}


def run_part(report: dict, name: str, start: float, budget_s: float, fn, *args) -> None:
    """report[name] = fn(*args), or {"error": ...} if it raised, or {"skipped": ...} past the time budget."""
    if time.perf_counter() - start > budget_s:
        report[name] = {"skipped": f"time budget of {budget_s:.0f} s spent before this part"}
        return
    print(f"[{time.perf_counter() - start:6.1f} s] {name} ...", flush=True)
    try:
        report[name] = fn(*args)
    except Exception as exc:  # recorded, so that the other parts still run and the JSON says what broke
        traceback.print_exc()
        report[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}


def summary(report: dict) -> list[str]:
    """Human-readable lines of the report (the last one is `ratio: X.XX` at the largest batch)."""
    lines = [f"device: {report['device_name']} ({report['mode']}), torch {report['torch']}, triton "
             f"{report['triton']}, transformers {report['transformers']}, auto backend: {report['auto_backend']}"]
    for name, part in report.items():
        if isinstance(part, dict) and ("skipped" in part or "error" in part):
            lines.append(f"{name}: {part.get('skipped') or 'ERROR ' + part['error']}")
    kp = report.get("kernel_parity", {})
    if "all_ok" in kp:
        errs = ", ".join(f"{k} {v:.1e}" for k, v in kp["max_abs_err"].items())
        lines.append(f"kernel parity: {'ok' if kp['all_ok'] else 'FAILED'} over {kp['cases']} cases (max |err| {errs})")
    for name, part in report.get("greedy_parity", {}).items():
        if isinstance(part, dict) and "match_rate" in part:
            lines.append(f"greedy parity {name}: match rate {part['match_rate']:.3f}, identical rows "
                         f"{part['identical_rows']}/{part['rows']}, first divergence {part['first_divergence']}")
    ratio = None
    for batch, row in report.get("throughput", {}).items():
        if isinstance(row, dict) and "ratio" in row:
            ratio = row["ratio"]
            graphs = (f" (with CUDA graphs {row['astrai_graphs_tok_s']:9.1f}, {row['graphs_speedup']:.2f}x)"
                      if "astrai_graphs_tok_s" in row else "")
            lines.append(f"batch {batch:>4}: astrai {row['astrai_tok_s']:9.1f} tok/s{graphs}, transformers "
                         f"{row['transformers_tok_s']:9.1f} tok/s, ratio {ratio:.2f}")
    for name, rl in (("", report.get("roofline", {})), (" with CUDA graphs", report.get("cuda_graphs", {}).get(
            "roofline", {}))):
        if "fraction" in rl:
            lines.append(f"decode roofline{name} at batch {rl['batch']}: {rl['decode_step_ms']:.2f} ms/step, "
                         f"{rl['achieved_tbps']:.3g} of {rl['peak_tbps']:.1f} TB/s = {rl['fraction']:.3g} of peak")
    cg = report.get("cuda_graphs", {})
    if "captured_buckets" in cg:
        failed = f", CAPTURE FAILED: {cg['capture_error']}" if cg.get("capture_error") else ""
        lines.append(f"CUDA graphs ({cg['backend']}): captured buckets {cg['captured_buckets']}{failed}, greedy "
                     f"match rate vs eager {cg['greedy_match_rate']:.3f}, {cg['padded_steps']} padded steps")
    ts = report.get("train_step", {})
    if "ok" in ts:
        lines.append(f"online_ppo step: {'ok' if ts['ok'] else 'FAILED'} in {ts['seconds']:.1f} s, {ts['metrics']}")
    if ratio is not None:
        lines.append(f"ratio: {ratio:.2f}")
    return lines


def failed(report: dict) -> bool:
    """True when a part raised, the kernels disagree with the reference, the train step failed or a CUDA graph
    capture failed."""
    parts = [p for p in report.values() if isinstance(p, dict)]
    return (any("error" in p for p in parts) or report.get("kernel_parity", {}).get("all_ok") is False
            or report.get("train_step", {}).get("ok") is False or bool(report.get("cuda_graphs", {}).get(
                "capture_error")))


def main(argv: list[str] | None = None) -> int:
    """CLI (see the module docstring); returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=DefaultsFormatter)
    parser.add_argument("--output", type=Path, default=Path("gpu_check.json"), help="JSON report path")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (CUDA-only parts skipped)")
    parser.add_argument("--peak-tbps", type=float, default=4.8, help="peak HBM bandwidth, TB/s (H200: 4.8)")
    parser.add_argument("--budget-s", type=float, default=420.0, help="skip the remaining parts after this")
    args = parser.parse_args(argv)
    if args.peak_tbps <= 0 or args.budget_s <= 0:
        parser.error("--peak-tbps and --budget-s must be > 0")
    if not args.smoke and not torch.cuda.is_available():
        parser.error("no CUDA device: run on a GPU machine, or pass --smoke for the tiny CPU check")
    import transformers

    from astrai.kernels import select_backend

    start = time.perf_counter()
    plan, device = (SMOKE, torch.device("cpu")) if args.smoke else (FULL, torch.device("cuda"))
    report = {"mode": "smoke" if args.smoke else "full", "device_name": torch.cuda.get_device_name(device)
              if device.type == "cuda" else "cpu", "torch": torch.__version__, "transformers": transformers.__version__,
              "triton": _version("triton"), "plan": asdict(plan),
              "auto_backend": select_backend("auto", device, dtype=torch.bfloat16).name}
    cuda_note = "needs CUDA (on CPU the Triton kernels are checked under TRITON_INTERPRET=1 by the test suite)"
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        if device.type == "cuda":
            run_part(report, "kernel_parity", start, args.budget_s, kernel_parity, device, plan)
        else:
            report["kernel_parity"] = {"skipped": cuda_note}
        model_dir = save_random_model(plan.shapes, workdir / "model", seed=0)
        run_part(report, "greedy_parity", start, args.budget_s, greedy_parity, model_dir, device, plan)
        max_tokens = 2 * max(plan.batches + (plan.roofline_batch,)) * (plan.prompt_hi + plan.roofline_tokens[1]) + 4096
        engine, hf = load_models(model_dir, device, torch.bfloat16, max_tokens)
        try:
            graphs = graph_engine(engine, model_dir, device)
        except Exception as exc:  # noqa: BLE001 - recorded; the other parts still run
            graphs, report["cuda_graphs"] = None, {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"}
        run_part(report, "throughput", start, args.budget_s, throughput, engine, hf, plan, device, graphs)
        del hf
        run_part(report, "roofline", start, args.budget_s, roofline, engine, plan, device, args.peak_tbps)
        if graphs is not None:
            run_part(report, "cuda_graphs", start, args.budget_s, cuda_graphs, graphs, engine, plan, device,
                     args.peak_tbps)
        del engine, graphs
        run_part(report, "train_step", start, args.budget_s, train_step, workdir, device)
    report["elapsed_s"] = time.perf_counter() - start
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2))
    print("\n".join(summary(report)))
    print(f"report: {args.output} ({report['elapsed_s']:.0f} s)")
    return 1 if failed(report) else 0


def _version(module: str) -> str | None:
    """Installed version of `module`, or None when it is missing."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(module)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
