"""SFT training throughput: astrai's trainer against a plain `transformers` training loop, same batches, same threads.

    python bench/train_throughput.py [--steps 3] [--threads 1] [--batch 8] [--seq-len 256] [--data GSM8K.jsonl]

Both sides train SmolLM2-135M-Instruct in float32 from the same weights (astrai's load of the GGUF; the
`transformers` side loads the Hugging Face directory bench/hf_export.py writes from it, identical logits) on the
same batches: the first B * (steps + 1) GSM8K records of `--data` as chats (user: question, assistant: answer),
tokenized by astrai's SFT data path (ChatML, loss on the assistant turn only, rows cut at `--seq-len`, not packed,
right-padded to the batch's longest row) and collated by astrai (`astrai.data.examples.collate_lm`); step k of both
sides gets records [k*B, (k+1)*B). One optimizer step per batch (no accumulation), AdamW at `--lr` (weight decay 0,
constant schedule), gradient clipping at norm 1.

- astrai: `python -m astrai.train`'s sft learner and its accumulate-and-step seam, called step by step (the
  trainer's callbacks, logging and checkpoints left out, as bench/ppo_step.py does).
- transformers: `AutoModelForCausalLM` (its default attention, sdpa) with `torch.optim.AdamW`:
  `model(input_ids, attention_mask, position_ids, labels).loss.backward()`, `clip_grad_norm_`, `step`,
  `zero_grad`; the same collated tensors.

The first step of each side is a warm-up and is not counted. Tokens/s = real (unpadded) tokens of the timed steps /
their seconds. Achieved FLOP/s = the training FLOPs of those real tokens (bench/floors.py: 3 x a forward with the LM
head on every real token, causal attention within each row) / seconds, shown as a fraction of the float32 GEMM rate
of the model's shapes measured in the same run at the same thread count (`--rate-rows` rows; measured before
astrai's steps and after transformers' ones, the higher taken as the peak). Prints both sides'
first-step losses (equal weights and batch: they should agree) and ends with `ratio: X.XX` = astrai tokens/s /
transformers tokens/s.

What differs: attention kernels (astrai's own causal attention vs transformers' sdpa), how the loss is computed
(astrai: log-softmax gathered at the labels, token mean; transformers: its cross-entropy, token mean: the same
number), and the optimizer wiring (astrai's trained-model seam with its own AdamW; the loop here a bare AdamW).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
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


def write_chats(data: Path, count: int, directory: Path) -> Path:
    """The first `count` GSM8K records of `data` as one-turn chats (question -> answer), a jsonl of its own."""
    records = gsm8k.first_records(data, count, "batch x (steps + 1)")
    path = directory / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": r["question"]},
                                                      {"role": "assistant", "content": r["answer"]}]}) + "\n"
                            for r in records), encoding="utf-8")
    return path


def run_astrai(args, chats: Path, workdir: Path) -> tuple[list[float], list, float]:
    """(seconds of each step, the drawn batches' records, the first step's loss)."""
    from astrai.config import load_config
    from astrai.trainer.build import build_trainer

    config = load_config(str(ROOT / "configs/examples/sft.yaml"), [
        "--model.path", MODEL, "--data.path", str(chats), "--data.shuffle", "false", "--data.packing", "false",
        "--data.max_length", str(args.seq_len), "--train.per_device_train_batch_size", str(args.batch),
        "--train.gradient_accumulation_steps", "1", "--optim.learning_rate", str(args.lr),
        "--optim.weight_decay", "0", "--optim.max_grad_norm", "1.0", "--optim.lr_scheduler_type", "constant",
        "--optim.warmup_steps", "0", "--runtime.num_threads", str(args.threads),
        "--train.output_dir", str(workdir / "astrai"), "--train.progress_bar", "false",
        "--checkpoint.save_at_end", "false", "--max_steps", str(args.steps + 1)])
    trainer = build_trainer(config)
    learner = trainer.learner
    trainer.callbacks = []
    drawn: list = []
    draw = learner.draw

    def recorded_draw():
        batches = draw()
        drawn.extend(batches)
        return batches

    learner.draw = recorded_draw
    print(f"astrai: threads {torch.get_num_threads()}, pad id {learner.pad_token_id}", flush=True)
    seconds, first_loss = [], None
    for step in range(args.steps + 1):
        start = time.perf_counter()
        metrics = learner.train_step(trainer)
        seconds.append(time.perf_counter() - start)
        trainer.state.global_step += 1
        first_loss = float(metrics["train/loss"]) if first_loss is None else first_loss
        print(f"  astrai step {step}{' (warm-up)' if step == 0 else ''}: {seconds[-1]:.1f} s", flush=True)
    pad_id = learner.pad_token_id
    del trainer, learner
    gc.collect()
    return seconds, [(records, pad_id) for records in drawn], first_loss


def run_transformers(args, hf_dir: Path, batches: list) -> tuple[list[float], float]:
    """(seconds of each step, the first step's loss) of a plain transformers loop over astrai's collated batches."""
    import transformers

    from astrai.data.examples import collate_lm

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    torch.set_num_threads(args.threads)
    print(f"transformers {transformers.__version__}: threads {torch.get_num_threads()}, attention "
          f"{model.config._attn_implementation}", flush=True)
    seconds, first_loss = [], None
    for step, (records, pad_id) in enumerate(batches):
        start = time.perf_counter()
        batch = collate_lm(records, pad_token_id=pad_id)
        loss = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask.long(),
                     position_ids=batch.position_ids, labels=batch.labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds.append(time.perf_counter() - start)
        first_loss = float(loss.detach()) if first_loss is None else first_loss
        print(f"  transformers step {step}{' (warm-up)' if step == 0 else ''}: {seconds[-1]:.1f} s", flush=True)
    return seconds, first_loss


def batch_work(dims: floors.Dims, records: list, pad_id: int) -> tuple[int, int]:
    """(real tokens, training FLOPs) of one collated batch: 3 x a forward over each row's real tokens with the LM
    head on all of them and causal attention within the row."""
    from astrai.data.examples import collate_lm

    lengths = collate_lm(records, pad_token_id=pad_id).attention_mask.sum(1).tolist()
    tokens = sum(lengths)
    forward = floors.forward_flops(dims, tokens=tokens, pairs=sum(floors.causal_pairs(n) for n in lengths),
                                   lm_head_tokens=tokens)
    return tokens, 3 * forward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=DefaultsFormatter)
    parser.add_argument("--steps", type=int, default=3, help="timed optimizer steps per side (after one warm-up)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of both sides")
    parser.add_argument("--batch", type=int, default=8, help="chats per optimizer step")
    parser.add_argument("--seq-len", type=int, default=256, help="most tokens per row (data.max_length)")
    parser.add_argument("--lr", type=float, default=2e-5, help="AdamW learning rate of both sides")
    parser.add_argument("--data", type=Path, default=GSM8K, help="GSM8K-format jsonl (question, answer)")
    parser.add_argument("--rate-rows", type=int, default=512, help="token rows of the GEMM-rate measurement")
    args = parser.parse_args()
    if min(args.steps, args.threads, args.batch, args.seq_len, args.rate_rows) < 1:
        parser.error("--steps, --threads, --batch, --seq-len and --rate-rows must be >= 1")
    if not args.data.is_file():
        parser.error(f"{args.data} not found: expected a GSM8K-format jsonl (question, answer per line)")
    torch.set_num_threads(args.threads)
    print(f"threads: {args.threads}  batch {args.batch}  seq-len {args.seq_len}  lr {args.lr}  steps: 1 warm-up + "
          f"{args.steps}  load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="astrai-train-throughput-"))
    try:
        hf_dir = export_hf(MODEL)
        from astrai.models.config import ModelConfig

        dims = floors.Dims.of(ModelConfig.from_hf_dict(json.loads((hf_dir / "config.json").read_text())))
        rate_before = floors.measure_gemm_rate(dims, args.rate_rows)
        chats = write_chats(args.data, args.batch * (args.steps + 1), workdir)
        a_seconds, batches, a_loss = run_astrai(args, chats, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    h_seconds, h_loss = run_transformers(args, hf_dir, batches)
    rate_after = floors.measure_gemm_rate(dims, args.rate_rows)
    work = [batch_work(dims, records, pad_id) for records, pad_id in batches[1:]]
    tokens, flops = sum(w[0] for w in work), sum(w[1] for w in work)
    rate = max(rate_before, rate_after)
    print(f"fp32 GEMM rate of the model's shapes ({args.rate_rows} rows): {rate / 1e9:.1f} GFLOP/s (the higher of "
          f"before astrai and after transformers: {rate_before / 1e9:.1f}, {rate_after / 1e9:.1f}; a gap means the "
          "machine's load changed)")
    print(f"timed: {args.steps} steps, {tokens} real tokens ({tokens / args.steps:.0f} per step), "
          f"{flops / 1e12:.2f} TFLOP; first-step loss astrai {a_loss:.4f}, transformers {h_loss:.4f}")
    results = {}
    for name, seconds in (("astrai", a_seconds[1:]), ("transformers", h_seconds[1:])):
        total = sum(seconds)
        results[name] = tokens / total
        print(f"{name:12s} {tokens / total:8.1f} tokens/s  step median {statistics.median(seconds):6.2f} s "
              f"(min {min(seconds):.2f})  {flops / total / 1e9:6.1f} GFLOP/s = {flops / total / rate:.2f} of the "
              "measured fp32 GEMM rate")
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"ratio: {results['astrai'] / results['transformers']:.2f}")


if __name__ == "__main__":
    main()
