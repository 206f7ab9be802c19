"""Process state and collectives, through Accelerate (the only place, with the trainer loop, that touches
process groups).

`accelerate launch` and `torchrun` export RANK/WORLD_SIZE/...; a plain `python -m astrai.train` runs as one
process. The engine (`strategy`: ddp, fsdp2, zero1/2/3) is resolved from `distributed.strategy` and the launch
configuration (`launch.resolve_launch`). Accelerate provides the process state and DDP only: its FSDP plugin does
not run on CPU, so both sharding engines are applied through their own APIs, the same way on CPU and GPU
(docs/distributed.md).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import sys
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable, Iterable, Iterator, NoReturn, Optional

import torch

from astrai.distributed.launch import HIDDEN_FROM_ACCELERATE, LaunchError, resolve_launch
from astrai.models.wrappers import bare_module


@dataclass
class DistributedContext:
    """Rank, world size, device and collectives of this process.

    Attributes:
        accelerator: the `accelerate.Accelerator` holding the process state (created without mixed precision and
            without Accelerate's DeepSpeed/FSDP plugins).
        device: the torch device this rank computes on.
        strategy: the resolved engine: "ddp", "fsdp2", "zero1", "zero2" or "zero3" (never "auto").
        mixed_precision: "no", "bf16" or "fp16" (`train.bf16` / `train.fp16`), applied by the engines.
        deepspeed_config: the user's DeepSpeed JSON named by the launch config (checked by
            `launch.read_deepspeed_config`), or None; batch sizes, accumulation, clipping and precision in it are
            astrai's to fill.
        timeout_seconds: `distributed.timeout_seconds`: the process group's timeout for every collective, and
            astrai's own waits on other ranks.
        peers: per rank, {"host", "pid", ...} as `rank_checks.check_ranks_agree` gathered them (empty before).
        mesh: the 2-D (data x tensor) `torch.distributed.device_mesh.DeviceMesh` with dims ("dp", "tp") when
            `rollout.tensor_parallel_size` T > 1 (`build_device_mesh`), else None (every rank a data-parallel rank,
            as before). Ranks r and r + 1 .. are one tensor-parallel group (T consecutive ranks: on one node).
        stop_requested: whether a stop signal reached this process (`trainer.faults.StopSignals.requested`), for
            long work inside a step that can end early (dynamic-sampling rounds); never, without handlers.
    """

    accelerator: object
    device: torch.device
    strategy: str = "ddp"
    mixed_precision: str = "no"
    deepspeed_config: Optional[dict] = None
    timeout_seconds: float = 600.0
    peers: list = field(default_factory=list)
    mesh: Optional[object] = None
    stop_requested: Callable[[], bool] = field(default=lambda: False, repr=False)

    @property
    def rank(self) -> int:
        """Global rank of this process (0-based)."""
        return self.accelerator.process_index

    @property
    def world_size(self) -> int:
        """Number of processes in the job."""
        return self.accelerator.num_processes

    @property
    def tp_size(self) -> int:
        """Ranks of one tensor-parallel group (`rollout.tensor_parallel_size`; 1 without a mesh)."""
        return 1 if self.mesh is None else self.mesh.size(1)

    @property
    def tp_group(self):
        """The torch process group of this rank's tensor-parallel group (what the rollout engine splits its copy
        over), or None without a mesh."""
        return None if self.mesh is None else self.mesh.get_group("tp")

    @property
    def dp_rank(self) -> int:
        """Index of this rank's data-parallel group (its tensor-parallel group): what the prompt sampler shares by,
        so every rank of one tensor-parallel group draws the same prompts. The rank itself without a mesh."""
        return self.rank // self.tp_size

    @property
    def dp_size(self) -> int:
        """Number of data-parallel groups: world size / `tp_size`."""
        return self.world_size // self.tp_size

    @property
    def is_main(self) -> bool:
        """True on global rank 0 (the process that logs and prints)."""
        return self.accelerator.is_main_process

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum of `tensor` over all ranks (the tensor itself with one process)."""
        if self.world_size == 1:
            return tensor
        return self.accelerator.reduce(tensor.clone(), reduction="sum")

    def all_reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        """Elementwise maximum of `tensor` over all ranks (the tensor itself with one process)."""
        if self.world_size == 1:
            return tensor
        out = tensor.clone()
        torch.distributed.all_reduce(out, op=torch.distributed.ReduceOp.MAX)
        return out

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Move `model` to the device and wrap it for data parallelism when there is more than one rank. The
        parameters keep their storage: Accelerate's own placement is skipped, since on CPU its device is 'cpu:0',
        which `.to` treats as another device and copies the whole model to (breaking storage that a LoRA reference
        model shares with the policy)."""
        model = model.to(self.device)
        if self.world_size == 1:
            return model
        return self.accelerator.prepare_model(model, device_placement=False)

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The bare module under any data-parallel wrapper (`astrai.models.wrappers.bare_module`)."""
        return bare_module(model)

    def first_failure(self, line: Optional[str]) -> Optional[str]:
        """Agree over the ranks on whether any has a failure `line`: None when none has (one all-reduce of a flag),
        else this rank's own line or the first failing rank's (prefixed "rank N: " when N is not 0; one gather
        more, only then). Every rank must call it at the same point; with one process, `line` itself."""
        if self.world_size == 1:
            return line
        flag = torch.tensor([float(line is not None)], device=self.device)
        if not self.all_reduce_max(flag).item():
            return None
        rank, first = next((r, text) for r, text in enumerate(self.gather_objects(line)) if text is not None)
        return line if line is not None else first if rank == 0 else f"rank {rank}: {first}"

    def broadcast_object(self, obj):
        """The main rank's `obj` (any picklable value) on every rank; `obj` itself with one process."""
        if self.world_size == 1:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def gather_objects(self, obj) -> list:
        """Every rank's `obj` (any picklable value), in rank order, on every rank; `[obj]` with one process."""
        if self.world_size == 1:
            return [obj]
        box = [None] * self.world_size
        torch.distributed.all_gather_object(box, obj)
        return box

    def barrier(self) -> None:
        """Block until every rank arrives (no-op with one process)."""
        self.accelerator.wait_for_everyone()

    def shutdown(self, *, wait: bool = True) -> None:
        """End of the job: drop Accelerate's references to the models and optimizers it prepared, then
        `end_process_group(wait)`. The caller drops its own references to the models first."""
        self.accelerator.free_memory()
        end_process_group(wait=wait)


_GROUP_ENDED = False  # end_process_group destroyed a process group in this process


def end_process_group(*, wait: bool = True) -> None:
    """Destroy this process's process groups (a multi-process job's, or the one-process group ZeRO creates; no-op
    without one, or once done): wait for every rank first (`wait`, with several; False on a failure path, where a
    peer may be gone), collect garbage, destroy. Every path that
    ends a job which created a process group calls it, before the interpreter exits.

    Why: a gloo worker thread frees the last finished collectives' tensors after the collective has returned, and
    freeing a tensor that Python also saw takes the GIL (torch >= 2.10); a thread asking for the GIL while the
    interpreter finalizes is ended inside a destructor and the process aborts ("terminate called without an
    active exception", exit -6: 1 in ~20 loaded 2-rank CPU runs here, and the exit code the launcher reports is
    lost; pytorch/pytorch#190489). Destroying the group joins those threads while the interpreter still runs
    them, but only once nothing holds the group: a live DDP or FSDP2 model (and the Accelerator that prepared it)
    does, so the caller drops its models (`astrai.train` drops the trainer) before calling this; DDP and DeepSpeed
    hold it even after that (`exit_process`)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    if torch.distributed.get_world_size() > 1 and wait:
        torch.distributed.barrier()
    global _GROUP_ENDED
    gc.collect()
    _end_vllm_groups()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    _GROUP_ENDED = True


def _end_vllm_groups() -> None:
    """Let vLLM destroy its groups first when a vLLM engine (`rollout.engine: vllm`) made them in this process:
    vLLM keeps them in module globals (`vllm.distributed.parallel_state`) over the default group, so destroying only
    the default group left the next vLLM engine of the process (a notebook's evaluation after its training) failing
    with "Process group ... is not initialized in the world group map". vLLM's own teardown
    (`destroy_model_parallel`, `destroy_distributed_environment`) ends them and the default group."""
    state = sys.modules.get("vllm.distributed.parallel_state")
    if state is not None and getattr(state, "_WORLD", None) is not None:
        try:
            state.destroy_model_parallel()
            state.destroy_distributed_environment()
        except Exception as err:  # never hides the error a failing job is ending with; torch's teardown follows
            warnings.warn(f"vLLM's teardown of its process groups failed ({type(err).__name__}: {err}); the next "
                          "vLLM engine of this process may not build")


def had_process_group() -> bool:
    """Whether this process has, or had (`end_process_group`), a torch.distributed process group."""
    return _GROUP_ENDED or (torch.distributed.is_available() and torch.distributed.is_initialized())


def exit_process(code: int) -> NoReturn:
    """End a process that created a process group (a rank of a multi-process job, or one process under ZeRO)
    with exit code `code`, without interpreter finalization: run the `atexit` handlers (reward workers,
    environment pools, logging, multiprocessing's queues), flush the standard streams, then `os._exit`. A process
    that never had a process group (`had_process_group`) exits the ordinary way (`sys.exit(code)`).

    Why: after the last collective a gloo worker thread may still have to free tensors that Python saw, which
    takes the GIL; if the interpreter is finalizing by then, CPython ends the thread inside a C++ destructor and
    the process aborts ("terminate called without an active exception", exit -6 in place of `code`; see
    `end_process_group`). Destroying the process group joins those threads, but DDP and DeepSpeed keep the group
    alive in C++ after their modules are gone (torch 2.13: gloo's threads outlive `destroy_process_group`), so only
    skipping finalization is certain. Python's own `multiprocessing` ends forked children the same way."""
    if not had_process_group():
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def run_device(device: str = "auto") -> torch.device:
    """The device type a job with `runtime.device` = `device` runs on: "auto" is CUDA when available, else CPU
    (the index under a launcher is Accelerate's choice). Raises ValueError (one line) for CUDA without CUDA."""
    want_cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if want_cuda and not torch.cuda.is_available():
        raise ValueError(f"runtime.device: {device!r} requested but CUDA is not available")
    return torch.device(device if device.startswith("cuda:") else "cuda" if want_cuda else "cpu")


def check_mesh(world_size: int, tensor_parallel_size: int) -> None:
    """LaunchError (one line naming `rollout.tensor_parallel_size`) unless it is an integer >= 1 dividing
    `world_size`."""
    tp = tensor_parallel_size
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise LaunchError(f"rollout.tensor_parallel_size: expected an integer >= 1, got {tp!r}")
    if world_size % tp:
        raise LaunchError(f"rollout.tensor_parallel_size: {tp} does not divide the world size {world_size} "
                          "(processes); each tensor-parallel group takes that many ranks")


def build_device_mesh(device: torch.device, world_size: int, tensor_parallel_size: int):
    """The 2-D (data x tensor) device mesh of the job, dims ("dp", "tp") of sizes (world / T, T), over the default
    process group (a collective: every rank calls it); None when T is 1 (no mesh: every rank data-parallel, the
    behaviour without tensor parallelism, with no extra process group). Raises LaunchError as `check_mesh`.

    Training is not on the mesh: FSDP2 / ZeRO / DDP shard and average over the whole world as before (the rollout
    engine is the only tensor-parallel part; each rank of a tensor-parallel group then trains on the rollouts its
    group sampled together)."""
    check_mesh(world_size, tensor_parallel_size)
    if tensor_parallel_size == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (world_size // tensor_parallel_size, tensor_parallel_size),
                            mesh_dim_names=("dp", "tp"))


def setup_distributed(device: str = "auto", strategy: str = "auto", *, mixed_precision: str = "no",
                      timeout_seconds: float = 600.0, tensor_parallel_size: int = 1,
                      stop_requested: Optional[Callable[[], bool]] = None) -> DistributedContext:
    """Resolve the engine and create the process state.

    Args:
        device: "auto" (CUDA when available, else CPU), "cpu", "cuda" or "cuda:N".
        strategy: `distributed.strategy`: "auto" (what `accelerate launch`'s config asked for, else "ddp"),
            "ddp", "fsdp2", "zero1", "zero2" or "zero3" (`launch.resolve_launch`).
        mixed_precision: "no", "bf16" or "fp16".
        timeout_seconds: the process group's timeout (`init_process_group(timeout=...)`, through Accelerate's
            `InitProcessGroupKwargs`): a collective that waits longer raises on the ranks still running.
        tensor_parallel_size: `rollout.tensor_parallel_size` T: > 1 builds the (world / T, T) device mesh
            (`build_device_mesh`).
        stop_requested: the context's `stop_requested` (None: never).

    Raises:
        ValueError: on a CUDA device without CUDA. LaunchError (a ValueError, one line): a launch mode astrai
            cannot honour (see `launch.resolve_launch`), fp16 on CPU, or a T that does not divide the world size.
    """
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    plan = resolve_launch(strategy, mixed_precision=mixed_precision, env=os.environ)
    want_cuda = run_device(device).type == "cuda"
    if plan.mixed_precision == "fp16" and not want_cuda:
        raise LaunchError("train.fp16: fp16 mixed precision (with loss scaling) needs a CUDA device; use train.bf16 "
                          "on CPU")
    with _hidden_environment(HIDDEN_FROM_ACCELERATE):
        accelerator = Accelerator(cpu=not want_cuda, mixed_precision="no", kwargs_handlers=[
            InitProcessGroupKwargs(timeout=timedelta(seconds=timeout_seconds))])
    chosen = torch.device(device) if device.startswith("cuda:") else accelerator.device
    if chosen.type == "cpu":  # Accelerate says "cpu:0" under a launcher; tensors live on "cpu", and .to("cpu:0")
        chosen = torch.device("cpu")  # copies every tensor (a model moved twice: two copies, shared weights broken)
    mesh = build_device_mesh(chosen, accelerator.num_processes, tensor_parallel_size)
    return DistributedContext(accelerator=accelerator, device=chosen, strategy=plan.strategy,
                              mixed_precision=plan.mixed_precision, deepspeed_config=plan.deepspeed_config,
                              timeout_seconds=timeout_seconds, mesh=mesh,
                              stop_requested=stop_requested or (lambda: False))


@contextlib.contextmanager
def _hidden_environment(names: Iterable[str]) -> Iterator[None]:
    """Remove `names` from `os.environ` inside the block and put them back after it."""
    saved = {name: os.environ.pop(name) for name in names if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)
