"""Online GRPO iterations, astrai against TRL 1.16's GRPOTrainer, on the same work in one run, phase by phase, with
each phase's matmul floor.

    python bench/grpo_vs_trl.py [--iters 5] [--threads 1] [--trl-python PATH] [--trl-generation both]
                                [--stop-at-eos] [--trl-first]

TRL runs in its own virtual environment (`--trl-python`, default the TRL_PYTHON environment variable):

    python3 -m venv /work/trl116-venv && /work/trl116-venv/bin/pip install torch==2.13.0 && \\
        /work/trl116-venv/bin/pip install trl==1.16.0 transformers gguf
    TRL_PYTHON=/work/trl116-venv/bin/python python bench/grpo_vs_trl.py

(resolved here to trl 1.16.0, transformers 5.24.0, accelerate 1.16.0, datasets 5.2.0 on torch 2.13.0.)

The same work on both sides: SmolLM2-135M-Instruct (astrai's float32 load of the GGUF, exported once as a Hugging
Face directory by bench/hf_export.py, so TRL loads identical weights and tokenizer); the first 4 * (iters + 1)
questions of astrai's `builtin:arithmetic` in order, iteration k on prompts [4k, 4k + 4) on both sides, chat-templated
with the template's own system message (TRL applies the tokenizer's template; its token ids are checked against
astrai's encoding); G = 8 completions per prompt, 32 new tokens, temperature 0.8 (top_k 0, top_p 1); no reference
model (kl_coef 0 / beta 0); one policy update per rollout: one AdamW step over the 32 completions in micro-batches of
8 (astrai: grpo.minibatch_size 32, micro_batch_size 8, epochs 1, dynamic sampling off; TRL:
per_device_train_batch_size 8, gradient_accumulation_steps = steps_per_generation = 4, num_iterations 1, so it
keeps no old log-probs); PPO-clip 0.2 with token-mean loss over the step (TRL's loss_type "dapo"); group-normalised
advantages; gradient clipping at 1.0; constant learning rate 1e-5; fused torch AdamW on both sides; reward
`math_exact_match` (TRL: astrai's rule behind its reward-function signature); float32; no gradient checkpointing;
the same torch thread count. TRL's logging and saving are off (logging_strategy and save_strategy "no", no
completion logs, report_to none); astrai runs its learner without callbacks (no metrics file, no checkpoints).
The first iteration of each side is a warm-up and is not counted; the table shows the median and minimum of the
next `--iters`.

TRL's generation: plain `model.generate` ("generate") and transformers' continuous-batching `generate_batch`
(GRPOConfig.use_transformers_continuous_batching, "continuous"); `--trl-generation both` (the default) runs TRL
once with each. astrai runs in this process through its trainer with its `time/*_seconds` metrics (weight_sync,
generate, reward as scoring, policy_update as update); TRL in bench/_trl_grpo_worker.py, which times TRL's phases
by wrapping the GRPOTrainer methods its loop calls (see that file).

What cannot be aligned:
- Stop tokens. By default neither side stops at EOS (astrai's stop list is emptied; TRL's generation config and its
  EOS mask get no EOS), so both sample exactly 32 tokens per completion and do identical token work.
  `--stop-at-eos` stops both at <|im_end|>; lengths then differ by sampling luck and each side's floor uses its own.
- Sampling: each side has its own RNG and sampler (astrai's paged engine computes the behaviour log-probs while
  sampling; TRL's `generate` returns none, and with one update per rollout it takes the update's own detached
  log-probs as the old ones), so the sampled tokens and the rewards differ.
- Padding: TRL pads each micro-batch's prompts (left) and completions (right) to the longest and computes every
  padded position; astrai's scoring and training forwards are padding-free.
- Advantages: TRL divides by the group's Bessel-corrected std + 1e-4, astrai by the population std + grpo.std_eps
  (set to 1e-4 here); the cost is the same, the values differ slightly.
- Weight sync: astrai's engine holds its own copy of the weights, refreshed before each rollout (a copy, no FLOPs);
  TRL generates with the trained module itself.
- TRL's per-step extras that astrai does not do: an entropy over the full vocabulary for every completion token in
  every micro-batch (computed in the update, logged only), the Trainer's `floating_point_ops` estimate and its
  metric bookkeeping (`_metrics` lists filled even with logging off), and shuffling/splitting the rollout.

Floors (bench/floors.py): matmul FLOPs of each phase's real tokens (generation with a KV cache: prefill of the
prompts, then one token per row per step; scoring: the reward is a rule, no matmul; update: 3 x the policy forward
over prompt + completion scoring the completion tokens), divided by the float32 GEMM rate of the model's own shapes
measured in this run at the same thread count (at `--rate-rows` rows, and at B*G rows for decode steps) before the
first side and after each; each side's floors use the faster of the two measurements around its own run.
astrai runs first unless `--trl-first`: alternate the order between runs, so that a drift favours neither side.
Prints the load average at start and end, a `TRL (<generation>) / astrai` line per TRL generation path, and ends
with `ratio: X.XX` = the median seconds per iteration of TRL's faster generation path / astrai's median.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import floors
from hf_export import export_hf
from cli_help import DefaultsFormatter  # noqa: E402  (bench/, the script's own folder)

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "configs" / "examples" / "grpo_arithmetic.yaml"
MODEL = "smollm2-135m-instruct"
VENV_HINT = ("create it with: python3 -m venv /work/trl116-venv && /work/trl116-venv/bin/pip install torch==2.13.0 "
             "&& /work/trl116-venv/bin/pip install trl==1.16.0 transformers gguf; then pass --trl-python "
             "/work/trl116-venv/bin/python or set TRL_PYTHON")
PHASES = ("weight_sync", "generate", "scoring", "update", "other", "total")
GENERATIONS = {"generate": ("generate",), "continuous": ("continuous",), "both": ("generate", "continuous")}


def check_trl_python(path: str | None) -> str:
    """The TRL interpreter, or exit 2 with one line saying how to make it."""
    if not path:
        print(f"no TRL interpreter: --trl-python / TRL_PYTHON is not set; {VENV_HINT}")
        sys.exit(2)
    probe = "from trl import GRPOConfig, GRPOTrainer; import trl; print(trl.__version__)"
    try:
        out = subprocess.run([path, "-c", probe], capture_output=True, text=True, timeout=300)
    except OSError as e:
        print(f"TRL interpreter {path} cannot run ({e.strerror}); {VENV_HINT}")
        sys.exit(2)
    if out.returncode != 0:
        print(f"TRL interpreter {path} has no trl.GRPOTrainer (needs trl 1.16); {VENV_HINT}")
        sys.exit(2)
    return path


def run_worker(trl_python: str, spec: dict, workdir: Path, name: str) -> dict:
    """Run bench/_trl_grpo_worker.py on `spec` under `trl_python`; its result (exit 1 with the log's tail on
    failure). The worker's `trl ...` lines are echoed."""
    (workdir / f"{name}.spec.json").write_text(json.dumps(spec))
    log = workdir / f"{name}.log"
    env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]), TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    with open(log, "w") as fh:
        proc = subprocess.run([trl_python, str(ROOT / "bench" / "_trl_grpo_worker.py"), "--spec",
                               str(workdir / f"{name}.spec.json"), "--output", str(workdir / f"{name}.json")],
                              stdout=fh, stderr=subprocess.STDOUT, env=env)
    text = log.read_text(errors="replace")
    if proc.returncode != 0:
        sys.exit(f"TRL worker failed (exit {proc.returncode}); its output ends with:\n{text[-4000:]}")
    print("\n".join(line for line in text.splitlines() if line.startswith("trl ")), flush=True)
    return json.loads((workdir / f"{name}.json").read_text())


def astrai_config(args, workdir: Path):
    """The recipe configs/examples/grpo_arithmetic.yaml with one update per rollout, no dynamic sampling, no
    evaluation and no outputs."""
    from astrai.config import load_config

    rows = args.prompts * args.group
    return load_config(str(RECIPE), [
        "--data.shuffle", "false", "--rollout.dynamic_sampling", "false", "--rollout.generation_batch_size", "null",
        "--rollout.batch_size", str(args.prompts), "--grpo.group_size", str(args.group),
        "--rollout.max_new_tokens", str(args.max_new_tokens), "--rollout.temperature", str(args.temperature),
        "--grpo.epochs", "1", "--grpo.minibatch_size", str(rows), "--grpo.micro_batch_size", str(args.micro_batch),
        "--grpo.kl_coef", "0", "--grpo.std_eps", "1e-4", "--optim.lr_scheduler_type", "constant",
        "--train.eval_steps", "0", "--max_steps", str(args.iters + 1), "--runtime.num_threads", str(args.threads),
        "--train.output_dir", str(workdir / "astrai"), "--train.progress_bar", "false", "--train.report_to", "none",
        "--checkpoint.save_at_end", "false"])


def run_astrai(args, config) -> list[dict]:
    """Seconds per phase of each GRPO iteration (the warm-up included), with its prompt and response lengths."""
    from astrai.trainer.build import build_trainer

    trainer = build_trainer(config)
    learner = trainer.learner
    trainer.callbacks = []
    runner = learner.experience.runner
    if not args.stop_at_eos:
        runner.sampling = dataclasses.replace(runner.sampling, stop_token_ids=())
    print(f"astrai: threads {torch.get_num_threads()}, stop tokens {list(runner.sampling.stop_token_ids)}", flush=True)
    iterations = []
    for k in range(args.iters + 1):
        start = time.perf_counter()
        metrics = learner.train_step(trainer)
        it = {"total": time.perf_counter() - start}
        trainer.state.global_step += 1
        for phase, name in (("weight_sync", "weight_sync"), ("generate", "generate"), ("scoring", "reward"),
                            ("update", "policy_update")):
            it[phase] = float(metrics[f"time/{name}_seconds"])
        seq = learner.rollout.sequences
        it["prompt_lengths"] = seq.attention_mask[:, :seq.prompt_length].sum(1).tolist()
        it["response_lengths"] = seq.action_mask.sum(1).tolist()
        iterations.append(it)
        print(f"  astrai iteration {k}{' (warm-up)' if k == 0 else ''}: {it['total']:.1f} s", flush=True)
    trainer.lock.release()
    del trainer, learner, runner
    gc.collect()
    return iterations


def trl_spec(args, config, hf_dir: Path, generation: str) -> dict:
    """The worker's spec for the speed mode: the same questions, answers and settings as astrai's side."""
    from astrai.models import load_pretrained
    from astrai.experience.prompts import load_online_prompts

    _, tokenizer = load_pretrained(MODEL, torch.float32)
    prompts = load_online_prompts(config, tokenizer)[:args.prompts * (args.iters + 1)]
    return {"mode": "speed", "generation": generation, "hf_dir": str(hf_dir), "astrai_root": str(ROOT),
            "threads": args.threads, "iterations": args.iters + 1, "stop_at_eos": args.stop_at_eos,
            "questions": [p.prompt for p in prompts], "answers": [p.answer for p in prompts],
            "prompt_ids": [list(p.prompt_ids) for p in prompts],
            "settings": {"seed": config.train.seed, "learning_rate": config.optim.learning_rate,
                         "max_grad_norm": config.optim.max_grad_norm, "prompts_per_step": args.prompts,
                         "group_size": args.group, "micro_batch_size": args.micro_batch,
                         "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                         "clip_eps": config.grpo.clip_eps}}


def phase_floors(dims: floors.Dims, it: dict, rate: float, decode_rate: float) -> dict[str, float]:
    """Floor seconds of each phase of one iteration from its prompt and response lengths."""
    prompts, responses = it["prompt_lengths"], it["response_lengths"]
    prefill, decode = floors.generation_flops(dims, prompts, responses)
    policy = floors.sequence_forward_flops(dims, prompts, responses, head="lm")
    out = {"weight_sync": 0.0, "generate": prefill / rate + decode / decode_rate, "scoring": 0.0,
           "update": 3 * policy / rate, "other": 0.0}
    out["total"] = out["generate"] + out["update"]
    return out


def add_other(it: dict) -> dict:
    """`other` = the iteration's total minus its timed phases (data, advantages, bookkeeping, garbage collection)."""
    timed = sum(it.get(name, 0.0) for name in ("weight_sync", "generate", "scoring", "update"))
    return dict(it, other=it["total"] - timed)


def fmt(value: float | None, width: int = 9) -> str:
    """`value` with two decimals right-aligned in `width`, or '-' for None."""
    return f"{'-':>{width}}" if value is None else f"{value:{width}.2f}"


def median_min(rows: list[dict], name: str) -> tuple[float | None, float | None]:
    """(median, minimum) of `name` over the rows that have it, (None, None) when none has."""
    values = [r[name] for r in rows if name in r]
    return (statistics.median(values), min(values)) if values else (None, None)


def print_table(sides: dict[str, list[dict]], side_floors: dict[str, list[dict]]) -> None:
    """Per phase and side: median and minimum seconds and median / the median floor of that side's own tokens; the
    last column is astrai's floor."""
    widths = {name: max(len(name) + 5, 11) for name in sides}
    print(f"{'phase':13s}" + "".join(f"{name + ' med':>{widths[name]}s}{'min':>8s}{'/floor':>8s}" for name in sides)
          + f"{'floor':>8s}")
    for phase in PHASES:
        line = f"{phase:13s}"
        for name, rows in sides.items():
            med, low = median_min(rows, phase) if name == "astrai" or phase != "weight_sync" else (None, None)
            floor = statistics.median(f[phase] for f in side_floors[name])
            line += (f"{fmt(med, widths[name])}{fmt(low, 8)}"
                     f"{fmt(med / floor if floor and med is not None else None, 8)}")
        astrai_floor = statistics.median(f[phase] for f in side_floors["astrai"])
        print(line + fmt(astrai_floor if astrai_floor else None, 8))


def ratio_line(peer_seconds: float, astrai_seconds: float) -> str:
    """The closing line: `ratio: X.XX` = peer seconds per iteration / astrai's."""
    return f"ratio: {peer_seconds / astrai_seconds:.2f}"


def parse_args(argv=None) -> argparse.Namespace:
    """The command line; bad values exit 2 with one line (argparse's usage error)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=DefaultsFormatter)
    parser.add_argument("--iters", type=int, default=5, help="timed GRPO iterations per side (after one warm-up)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of both sides")
    parser.add_argument("--trl-python", default=os.environ.get("TRL_PYTHON"),
                        help="python of the TRL 1.16 venv (default: $TRL_PYTHON)")
    parser.add_argument("--trl-generation", choices=tuple(GENERATIONS), default="both",
                        help="TRL's generation path: model.generate, transformers' continuous batching, or both runs")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per iteration (B)")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt (G)")
    parser.add_argument("--micro-batch", type=int, default=8, help="completions per forward/backward")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="new tokens per completion")
    parser.add_argument("--temperature", type=float, default=0.8, help="sampling temperature of both sides")
    parser.add_argument("--stop-at-eos", action="store_true", help="stop completions at EOS on both sides")
    parser.add_argument("--rate-rows", type=int, default=256, help="token rows of the GEMM-rate measurement")
    parser.add_argument("--trl-first", action="store_true",
                        help="run TRL before astrai (alternate between runs: a machine whose speed drifts during a "
                             "run then favours neither side)")
    args = parser.parse_args(argv)
    if min(args.iters, args.threads, args.prompts, args.micro_batch, args.max_new_tokens, args.rate_rows) < 1:
        parser.error("--iters, --threads, --prompts, --micro-batch, --max-new-tokens and --rate-rows must be >= 1")
    if args.group < 2:
        parser.error(f"--group must be >= 2 (GRPO normalises rewards within a group), got {args.group}")
    if (args.prompts * args.group) % args.micro_batch:
        parser.error(f"--micro-batch {args.micro_batch} must divide --prompts x --group = {args.prompts * args.group}")
    if not args.temperature > 0:
        parser.error(f"--temperature must be > 0, got {args.temperature}")
    return args


def main() -> None:
    """Run both sides, print the per-phase table and the ratio."""
    args = parse_args()
    args.trl_python = check_trl_python(args.trl_python)
    torch.set_num_threads(args.threads)
    rows = args.prompts * args.group
    print(f"threads: {args.threads}  prompts {args.prompts} x group {args.group}  micro-batch {args.micro_batch}  "
          f"max_new_tokens {args.max_new_tokens}  temperature {args.temperature}  stop at EOS: {args.stop_at_eos}  "
          f"iterations: 1 warm-up + {args.iters}  load average at start: "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="astrai-grpo-vs-trl-"))
    try:
        hf_dir = export_hf(MODEL)
        config = astrai_config(args, workdir)
        from astrai.models.config import ModelConfig

        dims = floors.Dims.of(ModelConfig.from_hf_dict(json.loads((hf_dir / "config.json").read_text())))
        trl_sides = [f"TRL {g}" for g in GENERATIONS[args.trl_generation]]
        order = trl_sides + ["astrai"] if args.trl_first else ["astrai"] + trl_sides

        def rates(when: str) -> tuple[float, float]:
            measured = floors.measure_gemm_rate(dims, args.rate_rows), floors.measure_gemm_rate(dims, rows)
            print(f"fp32 GEMM rate of the model's shapes {when}: {measured[0] / 1e9:.1f} GFLOP/s at "
                  f"{args.rate_rows} rows, {measured[1] / 1e9:.1f} GFLOP/s at {rows} rows (decode)", flush=True)
            return measured

        bracket = [rates(f"before {order[0]}")]
        results: dict[str, list[dict]] = {}
        side_rates: dict[str, tuple[float, float]] = {}
        for side in order:
            if side == "astrai":
                results[side] = [add_other(it) for it in run_astrai(args, config)]
            else:
                spec = trl_spec(args, config, hf_dir, side.split()[1])
                out = run_worker(args.trl_python, spec, workdir, side.replace(" ", "-"))
                results[side] = [add_other(it) for it in out["iterations"]]
                mismatched = sum(it["prompt_mismatches"] for it in out["iterations"])
                print(f"{side}: {out['optimizer']}; prompts whose token ids differ from astrai's: {mismatched}")
            bracket.append(rates(f"after {side}"))
            side_rates[side] = (max(bracket[-2][0], bracket[-1][0]), max(bracket[-2][1], bracket[-1][1]))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    for side, its in results.items():
        if len(its) != args.iters + 1:
            sys.exit(f"{side} ran {len(its)} iterations, expected {args.iters + 1}")
    sides = {side: results[side][1:] for side in ["astrai"] + trl_sides}
    side_floors = {side: [phase_floors(dims, it, *side_rates[side]) for it in its] for side, its in sides.items()}
    for side, its in sides.items():
        lengths = [n for it in its for n in it["response_lengths"]]
        prompts = [n for it in its for n in it["prompt_lengths"]]
        print(f"{side} tokens per iteration: prompts {sum(prompts) / len(its):.0f}, completions "
              f"{sum(lengths) / len(its):.0f} (mean completion {statistics.mean(lengths):.1f})")
    print(f"seconds per GRPO iteration ({args.iters} timed; /floor = median / the matmul floor of that side's own "
          "tokens at the rates measured around its run; 'floor' is astrai's):")
    print_table(sides, side_floors)
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    astrai_median = statistics.median(it["total"] for it in sides["astrai"])
    medians = {side: statistics.median(it["total"] for it in sides[side]) for side in trl_sides}
    for side, seconds in medians.items():
        print(f"{side} / astrai: {seconds / astrai_median:.2f} ({seconds:.2f} s / {astrai_median:.2f} s)")
    print(ratio_line(min(medians.values()), astrai_median))


if __name__ == "__main__":
    main()
