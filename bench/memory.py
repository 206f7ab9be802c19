"""Per-rank memory of training state (parameters + gradients + optimizer state) under each engine, 2 ranks on CPU.

    python bench/memory.py [--layers 20] [--engines ddp,fsdp2,zero2,zero3] [--nproc 2] [--bf16]

For each engine, starts `torch.distributed.run` with `--nproc` processes (gloo, one thread each); every rank builds a
SmolLM2-135M-shaped decoder with `--layers` blocks (20: ~99M parameters, random weights, fp32), wraps it with the
engine exactly as training does (`astrai.distributed.engines.prepare_trained`, AdamW; `--bf16`: the engines' bf16
mixed precision, fp32 master weights and optimizer state), runs two optimizer steps on random tokens, and measures
on each rank:

- training state at the step: the summed size of every distinct tensor storage the process holds (found through the
  garbage collector) just before the second optimizer step, when parameters (or their shards), gradients and the
  optimizer's moments and master copies all exist (the activations are freed by then): the peak of the state that
  persists over training;
- between steps: the same after that step (ddp frees its gradients there; DeepSpeed keeps its flat buffers);
- peak RSS: the process's maximum resident set size (`getrusage`), which also counts the transient gathers of a step
  and the Python/torch runtime itself (about the same for every engine).

Prints one line per engine with the largest rank's numbers and their ratio to ddp, and last `ratio: X.XX`, the best
(lowest) ratio of fsdp2 / zero3 training state at the step.

    python bench/memory.py --lora 16 [--reference] [--engines ddp]

With `--lora R`, each engine runs twice, full training and LoRA rank R on the attention and MLP projections
(`model.lora`, astrai's own `trainer.lora.apply_lora`: frozen base, adapters and their AdamW state), and the lines
compare LoRA to full on the same engine; `--reference` also holds the KL reference model of an RL job (full: a frozen
copy; LoRA: the base sharing the policy's tensors, `trainer.lora.shared_base_model`). The last line is then
`ratio: X.XX`, LoRA's training state at the step over full training's, on the first engine. They shard parameters, gradients and optimizer state, so
with 2 ranks it should be near half of ddp's; DeepSpeed adds an fp32 master partition beside its parameter partition
(a second fp32 copy when training in fp32, a bf16 + fp32 pair under `--bf16`).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                    num_key_value_heads=3, rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=2048,
                    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)


def live_tensor_bytes() -> int:
    """Bytes of every distinct tensor storage reachable by the garbage collector (DTensors through their local
    shards)."""
    import torch

    seen, total = set(), 0
    for obj in gc.get_objects():
        try:
            if not isinstance(obj, torch.Tensor):
                continue
            tensor = obj.to_local() if hasattr(obj, "to_local") else obj
            storage = tensor.untyped_storage()
        except Exception:  # noqa: BLE001 - meta tensors, tensor subclasses without storage
            continue
        if storage.data_ptr() in seen or storage.nbytes() == 0:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def worker(engine: str, layers: int, out: str, bf16: bool, lora: int = 0, reference: bool = False) -> None:
    """One rank: build (LoRA rank `lora` when > 0; the KL reference beside it with `reference`), wrap, step twice,
    measure, append a JSON line to `out`."""
    import torch
    import torch.distributed as dist

    from astrai.distributed import setup_distributed
    from astrai.distributed.engines import prepare_trained
    from astrai.models import AutoRegressiveLM, ModelConfig
    from astrai.trainer.optim import build_optimizer, build_scheduler

    torch.set_num_threads(1)
    ctx = setup_distributed("cpu", engine, mixed_precision="bf16" if bf16 else "no")
    torch.manual_seed(0)
    model = AutoRegressiveLM(ModelConfig(num_hidden_layers=layers, **SMOLLM2_135M))
    params = sum(p.numel() for p in model.parameters())
    keep = []  # the reference model, alive for the measurement
    if reference:
        from astrai.trainer.lora import shared_base_model
        from astrai.trainer.models import frozen_copy

        keep.append(shared_base_model(model) if lora else frozen_copy(model))
    if lora:
        from astrai.trainer.lora import DEFAULT_TARGET_MODULES, LoraSettings, apply_lora

        apply_lora(model, LoraSettings(r=lora, alpha=2.0 * lora, dropout=0.0, target_modules=DEFAULT_TARGET_MODULES,
                                       use_rslora=False, base_model="bench"))
    trained = prepare_trained(
        ctx, "policy", model, max_grad_norm=1.0,
        optimizer=lambda m: build_optimizer([p for p in m.parameters() if p.requires_grad], lr=1e-4,
                                            betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0),
        scheduler=lambda o: build_scheduler(o, name="constant", warmup_steps=0, total_steps=10))
    del model
    generator = torch.Generator().manual_seed(ctx.rank)

    def backward() -> None:  # the activations die with this frame
        ids = torch.randint(0, 49152, (2, 64), generator=generator)
        with trained.gradient_sync(True), trained.autocast():
            logits = trained.module(ids)
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
        trained.backward(loss)

    at_step: list[int] = []

    def measure() -> None:
        gc.collect()
        at_step.append(live_tensor_bytes())

    backward()
    trained.step(1.0, lambda: None)
    backward()
    trained.step(1.0, measure)
    gc.collect()
    trainable = sum(p.numel() for p in trained.model.parameters() if p.requires_grad)
    record = {"engine": engine, "rank": ctx.rank, "params": params, "trainable": trainable, "step_bytes": at_step[0],
              "live_bytes": live_tensor_bytes(),
              "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    with open(out, "a") as fh:
        fh.write(json.dumps(record) + "\n")
    dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--engines", default="ddp,fsdp2,zero2,zero3")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--bf16", action="store_true", help="bf16 mixed precision (train.bf16)")
    parser.add_argument("--lora", type=int, default=0, help="also run LoRA of this rank and compare it with full")
    parser.add_argument("--reference", action="store_true", help="with --lora: hold the KL reference model too")
    parser.add_argument("--worker", nargs=3, metavar=("ENGINE", "LAYERS", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        engine, _, rank = args.worker[0].partition(":")
        worker(engine, int(args.worker[1]), args.worker[2], args.bf16, lora=int(rank or 0), reference=args.reference)
        return
    if args.lora:
        return compare_lora(args)
    engines = args.engines.split(",")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "astrai-torch-extensions"))
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for engine in engines:
            out = Path(tmp) / f"{engine}.jsonl"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc),
                   "--master_port", str(29600 + len(results)), str(Path(__file__).resolve()), "--worker", engine,
                   str(args.layers), str(out), *(["--bf16"] if args.bf16 else [])]
            done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
            if done.returncode != 0 or not out.exists():
                print(f"{engine}: failed (exit {done.returncode})\n{done.stderr[-2000:]}", file=sys.stderr)
                continue
            ranks = [json.loads(line) for line in out.read_text().splitlines()]
            results[engine] = max(ranks, key=lambda r: r["step_bytes"])
    if "ddp" not in results:
        sys.exit("ddp did not run: no baseline to compare with")
    base = results["ddp"]
    precision = "bf16 mixed precision" if args.bf16 else "fp32"
    print(f"model: {base['params'] / 1e6:.1f}M parameters, {precision}, AdamW; {args.nproc} ranks (largest rank "
          "shown); GiB and ratio to ddp")
    print(f"{'engine':6s}  {'state at the step':>22s}  {'between steps':>20s}  {'peak RSS':>20s}")
    for engine, r in results.items():
        cells = [f"{r[k] / 2**30:6.2f} ({r[k] / base[k]:.2f}x)" for k in ("step_bytes", "live_bytes", "peak_rss_bytes")]
        print(f"{engine:6s}  {cells[0]:>22s}  {cells[1]:>20s}  {cells[2]:>20s}")
    sharded = [r["step_bytes"] / base["step_bytes"] for e, r in results.items() if e in ("fsdp2", "zero3")]
    print(f"ratio: {min(sharded):.2f}" if sharded else "ratio: n/a (no fully sharded engine ran)")


def run_engine(engine: str, args, tmp: str, port: int) -> dict | None:
    """The largest rank's record of one `--worker` launch of `engine` ("zero2" or "zero2:16" for LoRA rank 16)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "astrai-torch-extensions"))
    out = Path(tmp) / f"{engine.replace(':', '-')}.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc), "--master_port",
           str(port), str(Path(__file__).resolve()), "--worker", engine, str(args.layers), str(out),
           *(["--bf16"] if args.bf16 else []), *(["--reference"] if args.reference else [])]
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0 or not out.exists():
        print(f"{engine}: failed (exit {done.returncode})\n{done.stderr[-2000:]}", file=sys.stderr)
        return None
    return max((json.loads(line) for line in out.read_text().splitlines()), key=lambda r: r["step_bytes"])


def compare_lora(args) -> None:
    """`--lora R`: full training and LoRA rank R on each engine; one line each, last `ratio:` (first engine)."""
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, engine in enumerate(args.engines.split(",")):
            full = run_engine(engine, args, tmp, 29600 + 2 * i)
            lora = run_engine(f"{engine}:{args.lora}", args, tmp, 29601 + 2 * i)
            if full is None or lora is None:
                continue
            if not ratios:
                print(f"model: {full['params'] / 1e6:.1f}M parameters; LoRA r={args.lora}: "
                      f"{lora['trainable'] / 1e6:.2f}M trained ({lora['trainable'] / full['params']:.1%}); "
                      f"{args.nproc} rank(s), largest shown; reference model held: {args.reference}; GiB")
            ratio = lora["step_bytes"] / full["step_bytes"]
            ratios.append(ratio)
            print(f"{engine:6s}  full {full['step_bytes'] / 2**30:5.2f}  LoRA {lora['step_bytes'] / 2**30:5.2f}  "
                  f"({ratio:.2f}x; between steps {lora['live_bytes'] / full['live_bytes']:.2f}x, peak RSS "
                  f"{lora['peak_rss_bytes'] / full['peak_rss_bytes']:.2f}x)")
    print(f"ratio: {ratios[0]:.2f}" if ratios else "ratio: n/a (nothing ran)")


if __name__ == "__main__":
    main()
