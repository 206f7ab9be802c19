"""One online PPO iteration, astrai against TRL 1.12's PPOTrainer, on the same work in one run, phase by phase, with
each phase's matmul floor.

    python bench/ppo_vs_trl.py [--iters 3] [--threads 1] [--data GSM8K.jsonl] [--trl-python PATH] [--stop-at-eos]
                               [--trl-first]

TRL dropped its PPO trainer after 1.12, so it runs in its own virtual environment (`--trl-python`, default the
TRL_PYTHON environment variable):

    python3 -m venv /work/trl-venv && /work/trl-venv/bin/pip install torch==2.13.0 && \\
        /work/trl-venv/bin/pip install trl==1.12.0 transformers gguf
    TRL_PYTHON=/work/trl-venv/bin/python python bench/ppo_vs_trl.py

The same work on both sides: SmolLM2-135M-Instruct (astrai's float32 load of the GGUF, exported once as a Hugging
Face directory by bench/hf_export.py, so TRL loads identical weights and tokenizer) as policy, reference and critic
trunk; the first B * (iters + 1) GSM8K questions of `--data` with astrai's system prompt, chat-templated and encoded
by astrai, the same token ids given to TRL; iteration k uses prompts [k*B, (k+1)*B) on both sides (B = 8);
sampling at temperature 1 (top_k 0, top_p 1), 64 new tokens; 1 PPO epoch of 2 minibatches of 4 rows (one optimizer
step each); k3 KL in the reward (coef 0.05), GAE (gamma 1, lambda 0.95), whitened advantages, clipped value loss;
astrai's `math_exact_match` reward; plain `torch.optim.AdamW` (TRL's default, the fused AdamW, is replaced by
`adamw_torch`); float32; no gradient checkpointing; the same torch thread count. The first iteration of each side is
a warm-up and is not counted; the table shows the median and minimum of the next `--iters`.

astrai runs in this process through its trainer (as bench/ppo_step.py does) with its `time/*_seconds` metrics:
weight_sync, generate, reference, critic_scoring, policy_update and critic_update per minibatch; the reward call is
timed by wrapping the runner's score function. TRL runs in bench/_trl_ppo_worker.py under `--trl-python`, which
times TRL's phases by wrapping the functions its monolithic `train` loop calls (see that file).

What cannot be aligned:
- Stop tokens. By default neither side stops at EOS (astrai's stop list is emptied, TRL gets `stop_token=None`), so
  both sample exactly 64 tokens per prompt and do identical token work. `--stop-at-eos` stops both at <|im_end|>;
  response lengths then differ by sampling luck, and each side's floor is computed from its own tokens.
- Sampling: each side has its own RNG and sampler (astrai's paged engine; TRL's HF `generate` with output_scores,
  whose scores give its behaviour log-probs, while astrai's engine computes them while sampling), so the sampled
  tokens differ.
- Padding token: SmolLM2's pad is its EOS <|im_end|>, which ChatML prompts contain; TRL treats pad ids as padding,
  so its side pads with <|endoftext|> (id 0) instead.
- Reward: TRL 1.12 calls a sequence-classification reward model; `RuleReward` puts astrai's rule behind that
  interface, so no reward forward is run on either side.
- Model structure of the update: TRL trains policy and critic as one module with ONE AdamW over both (loss =
  pg + vf_coef * vf, one backward) and computes logits over all positions and an entropy over the full vocabulary
  in every minibatch; astrai runs two optimizers (policy, critic), computes logits only for response positions,
  clips gradients (max_grad_norm 1; TRL's PPO does not clip). Its update row is therefore the policy + critic sum.
- Scoring chunks: astrai scores reference and critic in chunks of the micro-batch (4 rows); TRL in one chunk of
  B (its local_rollout_forward_batch_size also sets its generation batch, kept at B).
- Whitening: both whiten advantages over the batch; TRL's variance is unbiased, as astrai's; TRL does not whiten
  rewards (whiten_rewards=False).
- Weight sync: astrai's engine holds its own copy of the weights, refreshed before each rollout (a copy, no FLOPs);
  TRL generates with the trained module itself, so it has no such phase.

Floors (bench/floors.py): matmul FLOPs of each phase's real tokens (generation with a KV cache: prefill of the
prompts, then one token per row per step; reference: a forward scoring the response tokens; critic scoring: the
critic's forward; update: 3 x (policy forward + critic forward)), divided by the float32 GEMM rate of the model's
own shapes measured in this run at the same thread count (at `--rate-rows` rows, and at B rows for decode steps)
before the first side, between the two and after the second; each side's floors use the faster of the two
measurements around its own run (the machine's speed drifts by up to a sixth within minutes on the 2-core machine).
astrai runs first unless `--trl-first`: alternate the order between runs, so that a drift favours neither side.
Ends with `ratio: X.XX` = TRL median seconds per iteration / astrai median seconds per iteration.
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
import gsm8k
from hf_export import export_hf
from cli_help import DefaultsFormatter  # noqa: E402  (bench/, the script's own folder)

ROOT = Path(__file__).resolve().parents[1]
GSM8K = gsm8k.DEFAULT
MODEL = "smollm2-135m-instruct"
TRL_PAD = "<|endoftext|>"
VENV_HINT = ("create it with: python3 -m venv /work/trl-venv && /work/trl-venv/bin/pip install torch==2.13.0 && "
             "/work/trl-venv/bin/pip install trl==1.12.0 transformers gguf; then pass --trl-python "
             "/work/trl-venv/bin/python or set TRL_PYTHON")
PHASES = ("weight_sync", "generate", "reference", "critic_scoring", "reward", "update", "policy_update",
          "critic_update", "other", "total")


def check_trl_python(path: str | None) -> str:
    """The TRL interpreter, or exit 2 with one line saying how to make it."""
    if not path:
        print(f"no TRL interpreter: --trl-python / TRL_PYTHON is not set; {VENV_HINT}")
        sys.exit(2)
    probe = "from trl.experimental.ppo import PPOConfig, PPOTrainer; import trl; print(trl.__version__)"
    try:
        out = subprocess.run([path, "-c", probe], capture_output=True, text=True, timeout=300,
                             env=dict(os.environ, TRL_EXPERIMENTAL_SILENCE="1"))
    except OSError as e:
        print(f"TRL interpreter {path} cannot run ({e.strerror}); {VENV_HINT}")
        sys.exit(2)
    if out.returncode != 0:
        print(f"TRL interpreter {path} has no trl.experimental.ppo.PPOTrainer (needs trl==1.12.0); {VENV_HINT}")
        sys.exit(2)
    return path


def write_subset(data: Path, count: int, directory: Path) -> Path:
    """The first `count` records of `data` (GSM8K jsonl) as a file of their own."""
    records = gsm8k.first_records(data, count, "batch x (iters + 1)")
    path = directory / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def astrai_config(args, prompts: Path, workdir: Path):
    from astrai.config import load_config

    steps = (args.iters + 1) * args.batch // args.minibatch
    return load_config(str(ROOT / "configs/examples/ppo.yaml"), [
        "--model.path", MODEL, "--data.path", str(prompts), "--data.shuffle", "false",
        "--data.max_prompt_length", "512", "--rollout.batch_size", str(args.batch),
        "--rollout.max_new_tokens", str(args.max_new_tokens), "--rollout.temperature", "1.0",
        "--ppo.epochs", "1", "--ppo.minibatch_size", str(args.minibatch), "--ppo.micro_batch_size",
        str(args.minibatch), "--runtime.num_threads", str(args.threads), "--train.output_dir", str(workdir / "astrai"),
        "--train.progress_bar", "false", "--checkpoint.save_at_end", "false", "--max_steps", str(steps)])


def run_astrai(args, config) -> list[dict]:
    """Seconds per phase of each PPO iteration (the warm-up included), with its prompt and response lengths."""
    from astrai.trainer.build import build_trainer

    trainer = build_trainer(config)
    learner = trainer.learner
    trainer.callbacks = []
    runner = learner.experience.runner
    if not args.stop_at_eos:
        runner.sampling = dataclasses.replace(runner.sampling, stop_token_ids=())
    reward_seconds = []
    score_fn = runner.score_fn

    def timed_score(*a):
        start = time.perf_counter()
        out = score_fn(*a)
        reward_seconds.append(time.perf_counter() - start)
        return out

    runner.score_fn = timed_score
    print(f"astrai: threads {torch.get_num_threads()}, stop tokens {list(runner.sampling.stop_token_ids)}", flush=True)
    iterations = []
    for k in range(args.iters + 1):
        it = dict.fromkeys(("policy_update", "critic_update", "total"), 0.0)
        for step in range(args.batch // args.minibatch):
            start = time.perf_counter()
            metrics = learner.train_step(trainer)
            it["total"] += time.perf_counter() - start
            trainer.state.global_step += 1
            if step == 0:
                for name in ("weight_sync", "generate", "reference", "critic_scoring"):
                    it[name] = float(metrics[f"time/{name}_seconds"])
                seq = learner.rollout.sequences
                it["prompt_lengths"] = seq.attention_mask[:, :seq.prompt_length].sum(1).tolist()
                it["response_lengths"] = seq.action_mask.sum(1).tolist()
                it["reward"] = reward_seconds[-1]
            for name in ("policy_update", "critic_update"):
                it[name] += float(metrics[f"time/{name}_seconds"])
        it["update"] = it["policy_update"] + it["critic_update"]
        iterations.append(it)
        print(f"  astrai iteration {k}{' (warm-up)' if k == 0 else ''}: {it['total']:.1f} s", flush=True)
    del trainer, learner, runner
    gc.collect()
    return iterations


def run_trl(args, config, workdir: Path, hf_dir: Path) -> dict:
    """The worker's result: seconds per phase of each TRL iteration (the warm-up included)."""
    from astrai.models import load_pretrained
    from astrai.experience.prompts import load_online_prompts
    from astrai.rewards.functions import single_reward_name

    _, tokenizer = load_pretrained(MODEL, torch.float32)
    prompts = load_online_prompts(config, tokenizer)
    p, s = config.ppo, config
    spec = {"hf_dir": str(hf_dir), "astrai_root": str(ROOT), "pad_token": TRL_PAD, "threads": args.threads,
            "prompts": [list(e.prompt_ids) for e in prompts], "answers": [e.answer for e in prompts],
            "stop_at_eos": args.stop_at_eos, "reward": single_reward_name(s.reward), "format_bonus": s.reward.format_bonus,
            "optim": "adamw_torch",
            "settings": {"seed": s.train.seed, "learning_rate": s.optim.learning_rate, "batch_size": args.batch,
                         "minibatch_size": args.minibatch, "epochs": p.epochs, "max_new_tokens": args.max_new_tokens,
                         "temperature": s.rollout.temperature, "kl_coef": p.kl_coef, "kl_estimator": p.kl_estimator,
                         "clip_eps": p.clip_eps, "vf_coef": p.vf_coef, "value_clip": p.value_clip,
                         "gamma": p.gamma, "gae_lambda": p.gae_lambda}}
    (workdir / "spec.json").write_text(json.dumps(spec))
    log = workdir / "trl_worker.log"
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), TRL_EXPERIMENTAL_SILENCE="1",
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    with open(log, "w") as fh:
        proc = subprocess.run([args.trl_python, str(ROOT / "bench" / "_trl_ppo_worker.py"), "--spec",
                               str(workdir / "spec.json"), "--output", str(workdir / "trl.json")],
                              stdout=fh, stderr=subprocess.STDOUT, env=env)
    text = log.read_text(errors="replace")
    if proc.returncode != 0:
        sys.exit(f"TRL worker failed (exit {proc.returncode}); its output ends with:\n{text[-4000:]}")
    print("\n".join(line for line in text.splitlines() if line.startswith("trl ")), flush=True)
    return json.loads((workdir / "trl.json").read_text())


def phase_floors(dims: floors.Dims, it: dict, rate: float, decode_rate: float) -> dict[str, float]:
    """Floor seconds of each phase of one iteration from its prompt and response lengths."""
    prompts, responses = it["prompt_lengths"], it["response_lengths"]
    prefill, decode = floors.generation_flops(dims, prompts, responses)
    policy = floors.sequence_forward_flops(dims, prompts, responses, head="lm")
    critic = floors.sequence_forward_flops(dims, prompts, responses, head="value")
    out = {"weight_sync": 0.0, "reward": 0.0, "generate": prefill / rate + decode / decode_rate,
           "reference": policy / rate, "critic_scoring": critic / rate, "policy_update": 3 * policy / rate,
           "critic_update": 3 * critic / rate, "update": 3 * (policy + critic) / rate, "other": 0.0}
    out["total"] = sum(out[name] for name in ("generate", "reference", "critic_scoring", "update"))
    return out


def add_other(it: dict) -> dict:
    """`other` = the iteration's total minus its timed phases (bookkeeping, GAE, data, garbage collection)."""
    timed = sum(it.get(name, 0.0) for name in ("weight_sync", "generate", "reference", "critic_scoring", "reward",
                                                "update"))
    return dict(it, other=it["total"] - timed)


def fmt(value: float | None, width: int = 9) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:{width}.2f}"


def print_table(astrai: list[dict], trl: list[dict], astrai_floor: list[dict], trl_floor: list[dict]) -> None:
    """Per phase: median and minimum seconds of each side, the median floor, and the median / floor ratios."""
    def med(rows, name):
        values = [r[name] for r in rows if name in r]
        return (statistics.median(values), min(values)) if values else (None, None)

    print(f"{'phase':16s}{'astrai med':>11s}{'min':>9s}{'TRL med':>11s}{'min':>9s}{'floor':>9s}"
          f"{'astrai/fl':>11s}{'TRL/fl':>9s}")
    for name in PHASES:
        a_med, a_min = med(astrai, name)
        t_med, t_min = (None, None) if name in ("weight_sync", "policy_update", "critic_update") else med(trl, name)
        floor = statistics.median(f[name] for f in astrai_floor)
        t_floor = statistics.median(f[name] for f in trl_floor)
        a_ratio = a_med / floor if floor and a_med is not None else None
        t_ratio = t_med / t_floor if t_floor and t_med is not None else None
        label = ("  " + name) if name in ("policy_update", "critic_update") else name
        print(f"{label:16s}{fmt(a_med, 11)}{fmt(a_min)}{fmt(t_med, 11)}{fmt(t_min)}"
              f"{fmt(floor if floor else None)}{fmt(a_ratio, 11)}{fmt(t_ratio)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=DefaultsFormatter)
    parser.add_argument("--iters", type=int, default=3, help="timed PPO iterations per side (after one warm-up)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of both sides")
    parser.add_argument("--data", type=Path, default=GSM8K, help="GSM8K-format jsonl (question, answer)")
    parser.add_argument("--trl-python", default=os.environ.get("TRL_PYTHON"),
                        help="python of the TRL 1.12 venv (default: $TRL_PYTHON)")
    parser.add_argument("--batch", type=int, default=8, help="prompts per PPO iteration (B)")
    parser.add_argument("--minibatch", type=int, default=4, help="rows per minibatch (one optimizer step each)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per response")
    parser.add_argument("--stop-at-eos", action="store_true", help="stop responses at EOS on both sides")
    parser.add_argument("--rate-rows", type=int, default=256, help="token rows of the GEMM-rate measurement")
    parser.add_argument("--trl-first", action="store_true",
                        help="run TRL's iterations before astrai's (alternate between runs: a machine whose speed "
                             "drifts during a run then favours neither side)")
    args = parser.parse_args()
    if min(args.iters, args.threads, args.batch, args.minibatch, args.max_new_tokens, args.rate_rows) < 1:
        parser.error("--iters, --threads, --batch, --minibatch, --max-new-tokens and --rate-rows must be >= 1")
    if args.batch % args.minibatch:
        parser.error("--batch must be a multiple of --minibatch")
    args.trl_python = check_trl_python(args.trl_python)
    if not args.data.is_file():
        parser.error(f"{args.data} not found: expected a GSM8K-format jsonl (question, answer per line)")
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    print(f"threads: {args.threads}  batch {args.batch}  minibatch {args.minibatch}  max_new_tokens "
          f"{args.max_new_tokens}  stop at EOS: {args.stop_at_eos}  iterations: 1 warm-up + {args.iters}  "
          f"load average at start: {' '.join(f'{x:.2f}' for x in load_start)}", flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="astrai-ppo-vs-trl-"))
    try:
        hf_dir = export_hf(MODEL)
        config = astrai_config(args, write_subset(args.data, args.batch * (args.iters + 1), workdir), workdir)
        from astrai.models.config import ModelConfig

        dims = floors.Dims.of(ModelConfig.from_hf_dict(json.loads((hf_dir / "config.json").read_text())))
        sides = ("TRL", "astrai") if args.trl_first else ("astrai", "TRL")

        def rates(when: str) -> tuple[float, float]:
            measured = floors.measure_gemm_rate(dims, args.rate_rows), floors.measure_gemm_rate(dims, args.batch)
            print(f"fp32 GEMM rate of the model's shapes {when}: {measured[0] / 1e9:.1f} GFLOP/s at "
                  f"{args.rate_rows} rows, {measured[1] / 1e9:.1f} GFLOP/s at {args.batch} rows (decode)", flush=True)
            return measured

        # The machine's speed drifts within minutes: each side's floors use the faster of the two measurements
        # that bracket its run (the lower floor), and a change between them is visible in the output.
        bracket = [rates(f"before {sides[0]}")]
        results: dict[str, list[dict]] = {}
        side_rates: dict[str, tuple[float, float]] = {}
        for side in sides:
            if side == "astrai":
                results[side] = [add_other(it) for it in run_astrai(args, config)]
            else:
                results[side] = [add_other(it) for it in run_trl(args, config, workdir, hf_dir)["iterations"]]
            bracket.append(rates(f"after {side}"))
            side_rates[side] = (max(bracket[-2][0], bracket[-1][0]), max(bracket[-2][1], bracket[-1][1]))
        astrai, trl = results["astrai"], results["TRL"]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if len(trl) != args.iters + 1:
        sys.exit(f"TRL ran {len(trl)} iterations, expected {args.iters + 1}")
    astrai, trl = astrai[1:], trl[1:]
    a_floor = [phase_floors(dims, it, *side_rates["astrai"]) for it in astrai]
    t_floor = [phase_floors(dims, it, *side_rates["TRL"]) for it in trl]
    for name, rows in (("astrai", astrai), ("TRL", trl)):
        lengths = [n for it in rows for n in it["response_lengths"]]
        prompts = [n for it in rows for n in it["prompt_lengths"]]
        print(f"{name} tokens per iteration: prompts {sum(prompts) / len(rows):.0f}, responses "
              f"{sum(lengths) / len(rows):.0f} (mean response {statistics.mean(lengths):.1f})")
    print(f"seconds per PPO iteration ({args.iters} timed; floors = matmul FLOPs / measured rate; 'floor' is "
          "astrai's; TRL/fl uses the floor of TRL's own tokens at the rates measured around TRL's run):")
    print_table(astrai, trl, a_floor, t_floor)
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    ratio = statistics.median(it["total"] for it in trl) / statistics.median(it["total"] for it in astrai)
    print(f"ratio: {ratio:.2f}")


if __name__ == "__main__":
    main()
