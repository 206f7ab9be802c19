"""Per-rank memory of training state (parameters + gradients + optimizer state) under each engine and world size.

    python bench/memory.py [--ranks 2 4] [--layers 20] [--engines ddp,fsdp2,zero2,zero3] [--bf16]

For each world size N of `--ranks` (`--nproc N` is an alias of `--ranks N`) and each engine, starts
`torch.distributed.run` with N processes (gloo on CPU, one thread each); every rank builds a SmolLM2-135M-shaped
decoder with `--layers` blocks (20: ~99M parameters, random weights, fp32), wraps it with the engine exactly as
training does (`astrai.distributed.sharding.prepare_trained`, AdamW; `--bf16`: the engines' bf16 mixed precision,
fp32 master weights and optimizer state), runs two optimizer steps on random tokens, and measures on each rank:

- training state at the step: the summed size of every distinct tensor storage the process holds (found through the
  garbage collector) just before the second optimizer step, when parameters (or their shards), gradients and the
  optimizer's moments and master copies all exist (the activations are freed by then): the peak of the state that
  persists over training;
- between steps: the same after that step (ddp frees its gradients there; DeepSpeed keeps its flat buffers);
- peak RSS: the process's maximum resident set size (`getrusage`), which also counts the transient gathers of a step
  and the Python/torch runtime itself (about the same for every engine).

The state at the step is broken down by what holds each storage (a storage counts once, in the first matching
kind): `params` (the parameters or this rank's shards of them: FSDP2's DTensor local shards, ZeRO-3's partitions
and its persistent small parameters, held whole), `master` (DeepSpeed's fp32 master partition, when it is a
separate copy), `grads` (gradients or their partitions), `optim` (AdamW's moments and step counters), `buffers`
(the model's buffers: rotary frequencies) and `other` (anything else: communication buckets, a gathered layer
still alive, autograd leftovers; its largest storages are named, as a whole parameter or decoder block of the
model when their size matches one). Each kind is printed as a fraction of ddp's training state at the same world
size, so the kinds add up to the engine's ratio; a fully sharded engine would be at 1/N of ddp in every kind.

Prints, per world size, one line per engine with the largest rank's numbers and their ratio to ddp, then the
breakdown lines, and last `ratio: X.XX`, the WORST (highest) ratio of fsdp2 / zero3 training state at the step at
the largest world size (the goal at 4 ranks: <= 0.30, i.e. 1/N plus what cannot be sharded).

What is not sharded (a smoke run with `--layers 2`, 35M parameters, fp32; fsdp2 0.250 and zero3 0.281 at 4 ranks):
the model's buffers (a few kB), ZeRO-3's persistent parameters (tensors under `stage3_param_persistence_threshold` =
10,000 elements, the norms: held whole on every rank, a few kB), DeepSpeed's reduce bucket (`reduce_bucket_size`:
astrai sets an eighth of the model, clamped to [1e6, 5e8] elements, `astrai.distributed.sharding.deepspeed_config`:
a resident fp32 buffer of 1/32 of ddp's fp32 state at any world size, zero3's only excess) and, for ZeRO-2, the
full parameters (it shards gradients and optimizer state only) and a gradient buffer the size of the whole model
(the parameters' `.grad` are views into it at the step). DeepSpeed 0.19.8's ZeRO-3 keeps an fp32 master partition beside the parameter partition even when both
are fp32: it means to alias them (stage3.py `_create_fp32_partitions`, "we don't need another copy of the weights"),
but compares `tensor.device` (a torch.device) with `self.device` (a str such as 'cpu' or 'cuda:0'), which is never
equal, so it clones. That copy is 1/(4N) of ddp's fp32 state (0.0625 at 4 ranks) and alone would put zero3 above
0.30; astrai aliases the master partition to the parameter partition after `deepspeed.initialize` when both are
fp32 on the same device (`astrai.distributed.zero_memory.share_zero3_fp32_master`), as DeepSpeed intended. With `--bf16` the master is a
real fp32 copy of bf16 parameters and is kept.

    python bench/memory.py --lora 16 [--reference] [--engines ddp]

With `--lora R`, each engine runs twice (at the first world size of `--ranks`), full training and LoRA rank R on
the attention and MLP projections (`model.lora`, astrai's own `trainer.lora.apply_lora`: frozen base, adapters and
their AdamW state), and the lines compare LoRA to full on the same engine; `--reference` also holds the KL reference
model of an RL job (full: a frozen copy; LoRA: the base sharing the policy's tensors,
`trainer.lora.shared_base_model`). The last line is then `ratio: X.XX`, LoRA's training state at the step over full
training's, on the first engine.
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
KINDS = ("params", "master", "grads", "optim", "buffers", "other")


def _storages():
    """{storage data_ptr: (nbytes, example tensor)} of every distinct non-empty tensor storage reachable by the
    garbage collector (DTensors through their local shards)."""
    import torch

    found = {}
    for obj in gc.get_objects():
        try:
            if not isinstance(obj, torch.Tensor):
                continue
            tensor = obj.to_local() if hasattr(obj, "to_local") else obj
            storage = tensor.untyped_storage()
        except Exception:  # noqa: BLE001 - meta tensors, tensor subclasses without storage
            continue
        if storage.nbytes() and storage.data_ptr() not in found:
            found[storage.data_ptr()] = (storage.nbytes(), tensor)
    return found


def live_tensor_bytes() -> int:
    """Bytes of every distinct tensor storage reachable by the garbage collector (DTensors through their local
    shards)."""
    return sum(nbytes for nbytes, _ in _storages().values())


def _ptr(tensor) -> int | None:
    """Storage address of a tensor (a DTensor's local shard), None for None, empty or storage-less tensors."""
    if tensor is None:
        return None
    try:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        storage = local.untyped_storage()
    except Exception:  # noqa: BLE001
        return None
    return storage.data_ptr() if storage.nbytes() else None


def _tensors(value) -> list:
    """Every tensor in `value`: a tensor, None, or nested lists / tuples / dicts of them."""
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return [] if value is None or not hasattr(value, "untyped_storage") else [value]


def _known_storages(trained) -> dict[int, str]:
    """{storage address: kind} of the training state `trained` (a `TrainedModel`) holds, by kind (`KINDS`; the first
    kind that claims a storage keeps it)."""
    model, optimizer = trained.model, trained.optimizer
    inner = getattr(optimizer, "optimizer", optimizer)  # DeepSpeed's ZeRO optimizer wraps the torch one
    params = list(model.parameters())
    masters = _tensors([getattr(optimizer, "fp32_partitioned_groups_flat", None),
                        getattr(optimizer, "single_partition_of_fp32_groups", None)])
    claims = {
        "params": _tensors([params, [getattr(p, "ds_tensor", None) for p in params],
                            getattr(optimizer, "fp16_partitioned_groups_flat", None),
                            getattr(optimizer, "bit16_groups_flat", None)]),
        "master": masters,
        "grads": _tensors([[p.grad for p in params + masters], [q.grad for g in inner.param_groups
                                                                  for q in g["params"]],
                           getattr(optimizer, "grad_partitions_flat_buffer", None),
                           getattr(optimizer, "averaged_gradients", None)]),
        "optim": _tensors(list(inner.state.values())),
        "buffers": _tensors(list(model.buffers())),
    }
    kinds: dict[int, str] = {}
    for kind, tensors in claims.items():
        for tensor in tensors:
            ptr = _ptr(tensor)
            if ptr is not None:
                kinds.setdefault(ptr, kind)
    return kinds


def breakdown(trained, full_sizes: dict[int, str]) -> tuple[dict[str, int], list[str]]:
    """Bytes of training state by kind (`KINDS`) and descriptions of its largest storages: the largest of each
    kind but `other`, and the three largest `other` ones, each of at least 1 MiB (`full_sizes`: nbytes of a whole
    parameter or decoder block -> its name)."""
    kinds = _known_storages(trained)
    totals = dict.fromkeys(KINDS, 0)
    by_kind: dict[str, list] = {kind: [] for kind in KINDS}
    for ptr, (nbytes, tensor) in _storages().items():
        kind = kinds.get(ptr, "other")
        totals[kind] += nbytes
        by_kind[kind].append((nbytes, tensor))
    named = []
    for kind, found in by_kind.items():
        found.sort(key=lambda item: -item[0])
        for nbytes, tensor in [item for item in found[:3 if kind == "other" else 1] if item[0] >= 2**20]:
            what = full_sizes.get(nbytes, f"{str(tensor.dtype).removeprefix('torch.')} {tuple(tensor.shape)}")
            named.append(f"{kind}: {what} {nbytes / 2**20:.1f} MiB")
    return totals, named


def worker(engine: str, layers: int, out: str, bf16: bool, lora: int = 0, reference: bool = False) -> None:
    """One rank: build (LoRA rank `lora` when > 0; the KL reference beside it with `reference`), wrap, step twice,
    measure, append a JSON line to `out`."""
    import torch
    import torch.distributed as dist

    from astrai.distributed import setup_distributed
    from astrai.distributed.sharding import prepare_trained
    from astrai.models import AutoRegressiveLM, ModelConfig
    from astrai.trainer.optim import build_optimizer, build_scheduler

    torch.set_num_threads(1)
    ctx = setup_distributed("cpu", engine, mixed_precision="bf16" if bf16 else "no")
    torch.manual_seed(0)
    model = AutoRegressiveLM(ModelConfig(num_hidden_layers=layers, **SMOLLM2_135M))
    params = sum(p.numel() for p in model.parameters())
    full_sizes = {p.numel() * p.element_size(): f"whole {name}" for name, p in model.named_parameters()}
    full_sizes[sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())] = "whole block"
    keep = []  # the reference model, alive for the measurement
    if reference:  # as training builds it: the shared base (LoRA on ddp/zero1/zero2) or a prepared frozen copy
        from types import SimpleNamespace

        from astrai.trainer.models import reference_model

        keep.append(reference_model(ctx, model, SimpleNamespace(model=SimpleNamespace(lora={"r": lora} if lora
                                                                                      else {}))))
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

    at_step: list[tuple[dict[str, int], list[str]]] = []

    def measure() -> None:
        gc.collect()
        at_step.append(breakdown(trained, full_sizes))

    backward()
    trained.step(1.0, lambda: None)
    backward()
    trained.step(1.0, measure)
    gc.collect()
    trainable = sum(p.numel() for p in trained.model.parameters() if p.requires_grad)
    kinds, largest = at_step[0]
    record = {"engine": engine, "rank": ctx.rank, "params": params, "trainable": trainable,
              "step_bytes": sum(kinds.values()), "kinds": kinds, "largest": largest,
              "live_bytes": live_tensor_bytes(),
              "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    with open(out, "a") as fh:
        fh.write(json.dumps(record) + "\n")
    dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--engines", default="ddp,fsdp2,zero2,zero3")
    parser.add_argument("--ranks", type=int, nargs="+", default=None, help="world sizes to measure (default: 2)")
    parser.add_argument("--nproc", type=int, default=None, help="alias of --ranks N (one world size)")
    parser.add_argument("--bf16", action="store_true", help="bf16 mixed precision (train.bf16)")
    parser.add_argument("--lora", type=int, default=0, help="also run LoRA of this rank and compare it with full")
    parser.add_argument("--reference", action="store_true", help="with --lora: hold the KL reference model too")
    parser.add_argument("--worker", nargs=3, metavar=("ENGINE", "LAYERS", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        engine, _, rank = args.worker[0].partition(":")
        worker(engine, int(args.worker[1]), args.worker[2], args.bf16, lora=int(rank or 0), reference=args.reference)
        from astrai.distributed.context import exit_process

        exit_process(0)  # a rank: no interpreter finalization (a gloo thread can abort it)
    if args.nproc is not None and args.ranks is not None:
        parser.error("--nproc is an alias of --ranks N: give one of them")
    args.ranks = args.ranks or [args.nproc or 2]
    if min(args.ranks) < 1 or args.layers < 1:
        parser.error("--ranks and --layers must be >= 1")
    engines = [e for e in args.engines.split(",") if e]
    unknown = [e for e in engines if e not in ("ddp", "fsdp2", "zero1", "zero2", "zero3")]
    if unknown or not engines:
        parser.error(f"--engines: unknown engine {unknown[0] if unknown else args.engines!r}; choose from ddp, fsdp2, "
                     "zero1, zero2, zero3")
    if args.lora:
        return compare_lora(args)
    if "ddp" not in engines:
        parser.error("--engines must include ddp (the baseline of every ratio)")
    worst = {}
    with tempfile.TemporaryDirectory() as tmp:
        for world in args.ranks:
            results = {}
            for i, engine in enumerate(engines):
                record = run_engine(engine, world, args, tmp, 29600 + 8 * len(worst) + i)
                if record is not None:
                    results[engine] = record
            if "ddp" not in results:
                sys.exit(f"ddp did not run at {world} ranks: no baseline to compare with")
            report(results, world, args.bf16)
            report_plan(results, world, args)
            worst[world] = [r["step_bytes"] / results["ddp"]["step_bytes"] for e, r in results.items()
                            if e in ("fsdp2", "zero3")]
    largest = max(worst)
    print(f"ratio: {max(worst[largest]):.2f}" if worst[largest] else
          f"ratio: n/a (no fully sharded engine ran at {largest} ranks)")


def report_plan(results: dict[str, dict], world: int, args) -> None:
    """One line per engine: the state at the step that `astrai.trainer.memory_plan` plans for this model, engine and
    world size (an sft-like job: the policy's parameters, gradients, optimizer state, DeepSpeed's master, gradient
    partition and bucket), and the measured / planned ratio; the last such line of the run is `plan_ratio: LO..HI`."""
    import torch

    from astrai.config import config_from_dict
    from astrai.models.config import ModelConfig
    from astrai.trainer.memory_plan import plan_memory

    config = config_from_dict({"train": {"type": "sft", "bf16": bool(args.bf16)}})
    model_config = ModelConfig(num_hidden_layers=args.layers, **SMOLLM2_135M)
    ratios = []
    print("planned by astrai.trainer.memory_plan (GiB; measured / planned):")
    for engine, r in results.items():
        plan = plan_memory(config, model_config, strategy=engine, world_size=world, device=torch.device("cpu"))
        ratios.append(r["step_bytes"] / plan.total)
        print(f"  {engine:6s} {plan.total / 2**30:6.3f}  measured {r['step_bytes'] / 2**30:6.3f}  ({ratios[-1]:.3f})")
    print(f"plan_ratio: {min(ratios):.3f}..{max(ratios):.3f}")


def report(results: dict[str, dict], world: int, bf16: bool) -> None:
    """The lines of one world size: per engine the largest rank's state at the step, between steps and peak RSS
    (GiB, ratio to ddp), then the breakdown of the state at the step by kind as fractions of ddp's."""
    base = results["ddp"]
    precision = "bf16 mixed precision" if bf16 else "fp32"
    print(f"{world} ranks: model {base['params'] / 1e6:.1f}M parameters, {precision}, AdamW (largest rank shown); "
          f"GiB and ratio to ddp; a fully sharded engine would be at 1/N = {1 / world:.3f}")
    print(f"{'engine':6s}  {'state at the step':>22s}  {'between steps':>20s}  {'peak RSS':>20s}")
    for engine, r in results.items():
        cells = [f"{r[k] / 2**30:6.2f} ({r[k] / base[k]:.2f}x)" for k in ("step_bytes", "live_bytes", "peak_rss_bytes")]
        print(f"{engine:6s}  {cells[0]:>22s}  {cells[1]:>20s}  {cells[2]:>20s}")
    print(f"state at the step by kind, as a fraction of ddp's ({' + '.join(KINDS)}):")
    for engine, r in results.items():
        parts = " + ".join(f"{kind} {r['kinds'][kind] / base['step_bytes']:.3f}" for kind in KINDS)
        other = f"; largest storages: {', '.join(r['largest'])}" if r["largest"] else ""
        print(f"  {engine:6s} {r['step_bytes'] / base['step_bytes']:.3f} = {parts}{other}")


def run_engine(engine: str, world: int, args, tmp: str, port: int) -> dict | None:
    """The largest rank's record of one `--worker` launch of `engine` ("zero2" or "zero2:16" for LoRA rank 16) on
    `world` processes."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "astrai-torch-extensions"))
    out = Path(tmp) / f"{engine.replace(':', '-')}-{world}.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_port",
           str(port), str(Path(__file__).resolve()), "--worker", engine, str(args.layers), str(out),
           *(["--bf16"] if args.bf16 else []), *(["--reference"] if args.reference else [])]
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0 or not out.exists():
        print(f"{engine} at {world} ranks: failed (exit {done.returncode})\n{done.stderr[-2000:]}", file=sys.stderr)
        return None
    return max((json.loads(line) for line in out.read_text().splitlines()), key=lambda r: r["step_bytes"])


def compare_lora(args) -> None:
    """`--lora R`: full training and LoRA rank R on each engine; one line each, last `ratio:` (first engine)."""
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, engine in enumerate(args.engines.split(",")):
            full = run_engine(engine, args.ranks[0], args, tmp, 29600 + 2 * i)
            lora = run_engine(f"{engine}:{args.lora}", args.ranks[0], args, tmp, 29601 + 2 * i)
            if full is None or lora is None:
                continue
            if not ratios:
                print(f"model: {full['params'] / 1e6:.1f}M parameters; LoRA r={args.lora}: "
                      f"{lora['trainable'] / 1e6:.2f}M trained ({lora['trainable'] / full['params']:.1%}); "
                      f"{args.ranks[0]} rank(s), largest shown; reference model held: {args.reference}; GiB")
            ratio = lora["step_bytes"] / full["step_bytes"]
            ratios.append(ratio)
            print(f"{engine:6s}  full {full['step_bytes'] / 2**30:5.2f}  LoRA {lora['step_bytes'] / 2**30:5.2f}  "
                  f"({ratio:.2f}x; between steps {lora['live_bytes'] / full['live_bytes']:.2f}x, peak RSS "
                  f"{lora['peak_rss_bytes'] / full['peak_rss_bytes']:.2f}x)")
    print(f"ratio: {ratios[0]:.2f}" if ratios else "ratio: n/a (nothing ran)")


if __name__ == "__main__":
    main()
