"""Training engines: how a model under training is wrapped, backpropagated, clipped, stepped, gathered and
checkpointed under each data-parallel strategy (`DistributedContext.strategy`).

- `TrainedModel` (ddp): the model itself (one process) or Accelerate's DDP wrapper; every rank holds the full
  parameters, gradients and optimizer state.
- `FSDP2Model` (fsdp2): PyTorch FSDP2 `fully_shard` per decoder block and on the root (Zhao et al. 2023, "PyTorch
  FSDP"): parameters, gradients and optimizer state are sharded over the ranks (DTensors); a forward all-gathers one
  block at a time. Optimizer state is checkpointed with `torch.distributed.checkpoint` (reshardable).
- `DeepSpeedModel` (zero1 / zero2 / zero3): DeepSpeed ZeRO (Rajbhandari et al. 2020): stage 1 shards the optimizer
  state, 2 also the gradients, 3 also the parameters. One `deepspeed.initialize` per trained model with a
  `torch.optim` optimizer and astrai's schedule; DeepSpeed clips (`gradient_clipping`) and steps. Optimizer state is
  checkpointed per rank (the same world size resumes).

Every engine averages gradients over the ranks, so a loss normalised by the GLOBAL unit count is multiplied by the
world size (`loss_scale`). `full_weights()` yields the full parameters one at a time on every rank (a collective for
the sharded engines), which is how the colocated rollout engine takes new weights without a second full copy.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Protocol

import torch

from astrai.checkpoint import Part
from astrai.distributed.zero_memory import share_zero3_fp32_master
from astrai.runtime_env import announce_deepspeed_op_build

__all__ = ["Adapters", "DeepSpeedModel", "FSDP2Model", "FullModelState", "TrainedModel", "prepare_reference",
           "prepare_trained", "shard_blocks"]


class Adapters(Protocol):
    """What a model trained through adapters (LoRA: `astrai.trainer.lora.LoraAdapters`) changes in its trained model:
    the weights it hands out and the part it checkpoints."""

    def merged(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The plain model's (name, tensor) stream of the adapted model's stream (adapters merged into their base)."""

    def checkpoint_view(self, obj: Any, kind: str) -> tuple[Any, str]:
        """(model part object, kind) -> (object, kind) to checkpoint instead (LoRA: only the trained tensors)."""


def _deepspeed():
    """The `deepspeed` module, imported on first use (it is an optional extra). DeepSpeed 0.19's ZeRO gathers and
    reductions call `torch.distributed.all_gather_into_tensor` / `reduce_scatter_tensor`, which torch 2.13 marks
    deprecated: one FutureWarning per call (about a hundred per 2-rank run) that says nothing to an astrai user,
    so exactly those two warnings are silenced."""
    import deepspeed

    warnings.filterwarnings(
        "ignore", message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
        category=FutureWarning)
    return deepspeed


class TrainedModel:
    """A model under training (ddp): what `Trainer.accumulate_and_step` backpropagates through, clips and steps.

    Args:
        name: "policy" or "critic": the prefix of its metrics (`policy/grad_norm`) and the name the optimizer hooks
            receive; only "policy" steps advance `policy_version`.
        module: the model as wrapped for data parallelism (call it for forwards, with or without grad).
        optimizer: its optimizer; scheduler: its learning-rate schedule (stepped once per optimizer step).
        dist: the process state (`DistributedContext`).
        adapters: set when the model trains adapters (LoRA): `full_weights` merges them, checkpoints hold only them.
    """

    casts_itself = False
    """True for the sharded engines, which cast through their own precision settings (no torch autocast or
    GradScaler here)."""

    def __init__(self, *, name: str, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler, dist, adapters: Optional[Adapters] = None):
        self.name, self.module, self.optimizer, self.scheduler, self.dist = name, module, optimizer, scheduler, dist
        self.adapters = adapters
        self.mixed_precision = dist.mixed_precision
        self.grad_scaler = (torch.amp.GradScaler(dist.device.type) if self.mixed_precision == "fp16"
                            and not self.casts_itself else None)

    def autocast(self):
        """Context for the training forward and loss: under ddp with `train.bf16` / `train.fp16`, autocast to that
        dtype over fp32 parameters (log-probs, KL, advantages and losses are computed in float32 by `astrai.algos`
        either way); the sharded engines cast through their own precision settings, so nothing here."""
        if self.mixed_precision == "no" or self.casts_itself:
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.mixed_precision == "bf16" else torch.float16
        return torch.autocast(device_type=self.dist.device.type, dtype=dtype)

    @property
    def model(self) -> torch.nn.Module:
        """The model under any wrapper (its config, its MoE layers); its parameters may be shards."""
        return self.dist.unwrap(self.module)

    @property
    def loss_scale(self) -> float:
        """Factor that turns a loss normalised by the GLOBAL unit count into the engine's averaged gradient: the
        world size (every engine averages gradients over the ranks)."""
        return float(self.dist.world_size)

    def gradient_sync(self, sync: bool):
        """Context for one micro-batch's forward and backward: gradients are reduced across ranks only when `sync`
        (the step's last micro-batch); a DDP module accumulates the others locally (`no_sync`)."""
        if sync or not isinstance(self.module, torch.nn.parallel.DistributedDataParallel):
            return contextlib.nullcontext()
        return self.module.no_sync()

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate the gradient of `loss` (0-dim) into the parameters (fp16: dynamically loss-scaled,
        `torch.amp.GradScaler`)."""
        if self.grad_scaler is not None:
            self.grad_scaler.scale(loss).backward()
        else:
            loss.backward()

    def step(self, max_grad_norm: float, before_step: Callable[[], None]
             ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """Clip the global gradient norm to `max_grad_norm`; when that norm is finite call `before_step()`, step the
        optimizer and then the schedule; zero the gradients either way. A non-finite norm (a NaN or an infinity in
        any rank's gradients, which the data-parallel reduction carries to every rank) skips the optimizer and
        schedule step on every rank alike: the norm is the same global number everywhere. Reading it is the step's
        one host synchronisation.

        Returns:
            (pre-clip global gradient norm, learning rate of the step, whether the step was applied); the norm and
            rate are 0-dim float32 tensors; the rate is read (first parameter group) before the schedule moves it to
            the next step's value.
        """
        if self.grad_scaler is not None:
            self.grad_scaler.unscale_(self.optimizer)
        grad_norm = _as_local(torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_grad_norm))
        applied = bool(torch.isfinite(grad_norm))
        lr = torch.tensor(float(self.optimizer.param_groups[0]["lr"]))
        if applied:
            before_step()
            if self.grad_scaler is not None:
                self.grad_scaler.step(self.optimizer)
            else:
                self.optimizer.step()
            self.scheduler.step()
        if self.grad_scaler is not None:  # lowers the loss scale after an overflow
            self.grad_scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm.detach().float(), lr, applied

    @property
    def loss_scaling(self) -> bool:
        """Whether a dynamic loss scale skips overflowing steps by design (fp16): such skips are not divergence."""
        return self.mixed_precision == "fp16"

    def full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full tensor) for every entry of the plain model's state dict (tied weights under each name; with
        adapters, merged into their base: W + s B A), one at a time; every rank must iterate to the end (a
        collective for the sharded engines). A tensor may share memory with the model or be freed after the next
        item: copy it before advancing. What the rollout engine loads (`astrai.rollout.engine.sync_weights`)."""
        weights = self._state_stream()
        yield from (self.adapters.merged(weights) if self.adapters is not None else weights)

    def _state_stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The model's own (name, full tensor) stream, adapters unmerged."""
        yield from self.model.state_dict().items()

    def checkpoint_parts(self, model_part: str, *, kind: str = "torch", prefix: str = "") -> dict[str, Part]:
        """Its checkpoint parts, all required: the model as `model_part` (`kind` "hf_model" for the policy's Hugging
        Face layout, "torch" for a state dict), `<prefix>optimizer` and `<prefix>scheduler`. Every rank calls it
        (the sharded engines gather the full weights here)."""
        return {model_part: self._model_part(self.model, kind), f"{prefix}optimizer": Part(self.optimizer),
                f"{prefix}scheduler": Part(self.scheduler)}

    def _model_part(self, obj: Any, kind: str) -> Part:
        """The model's checkpoint part, through the adapters' `checkpoint_view` when it trains adapters."""
        if self.adapters is not None:
            obj, kind = self.adapters.checkpoint_view(obj, kind)
        return Part(obj, kind, weights=True)


def _as_local(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor of a (possibly distributed) 0-dim result: DTensors are materialised in full."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


class FullModelState:
    """A sharded model's full state as a checkpoint part object: `state_dict()` returns the state gathered when the
    part was made (on rank 0; empty elsewhere), `load_state_dict(full)` shards a full state back in (every rank calls
    it with the full state read from the checkpoint). `config` is the model's, for the Hugging Face layout."""

    def __init__(self, config, state: Mapping[str, torch.Tensor], load: Callable[[Mapping[str, torch.Tensor]], None]):
        self.config, self._state, self._load = config, dict(state), load

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The gathered full state (parameter names of the model, tied weights under each name)."""
        return self._state

    def load_state_dict(self, state: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        """Shard `state` (full tensors) into the model; with `strict` False, `state` may hold only some tensors."""
        self._load(state, strict)


def shard_blocks(model: torch.nn.Module, **kwargs) -> torch.nn.Module:
    """FSDP2 `fully_shard` on every decoder block (`model.model.layers`, policy and critic alike) and then on the
    root, which holds the embeddings, the final norm and the heads; returns `model` (sharded in place)."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


class FSDP2Model(TrainedModel):
    """fsdp2: `module` is the model sharded by `shard_blocks`; the optimizer holds DTensor shards."""

    casts_itself = True

    @property
    def model(self) -> torch.nn.Module:
        """The sharded model itself (FSDP2 shards in place; there is no wrapper)."""
        return self.module

    def gradient_sync(self, sync: bool):
        """Reduce-scatter gradients only on the step's last micro-batch (`set_requires_gradient_sync`)."""
        self.module.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()

    def _state_stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Each parameter all-gathered in turn (`DTensor.full_tensor`), in state-dict order on every rank."""
        for name, tensor in self.module.state_dict().items():
            yield name, _as_local(tensor)

    def checkpoint_parts(self, model_part: str, *, kind: str = "torch", prefix: str = "") -> dict[str, Part]:
        """The full model (gathered to rank 0 here, on every rank), the optimizer state through
        `torch.distributed.checkpoint` (kind "dcp": each rank writes its shards; reshardable), the schedule."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            set_model_state_dict,
        )

        full = get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

        def load(state, strict=True):
            set_model_state_dict(self.module, dict(state), options=StateDictOptions(full_state_dict=True,
                                                                                  strict=strict))

        return {model_part: self._model_part(FullModelState(self.module.config, full, load), kind),
                f"{prefix}optimizer": Part(_FSDP2OptimizerState(self.module, self.optimizer), "dcp"),
                f"{prefix}scheduler": Part(self.scheduler)}


class _FSDP2OptimizerState:
    """The sharded optimizer state of an FSDP2 model as a "dcp" checkpoint part object (`get_optimizer_state_dict`,
    `set_optimizer_state_dict`: keyed by parameter names, so torch.distributed.checkpoint can reshard it)."""

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.module, self.optimizer = module, optimizer

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.module, self.optimizer)

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.module, self.optimizer, state)


class DeepSpeedModel(TrainedModel):
    """zero1 / zero2 / zero3: `module` is the DeepSpeed engine (forward, backward and step go through it), `optimizer`
    its ZeRO optimizer (the wrapped `torch.optim` optimizer's parameter groups), `scheduler` astrai's schedule, which
    the engine steps. The engine clips with `gradient_clipping` = `optim.max_grad_norm` and reports the pre-clip
    norm after the step."""

    casts_itself = True

    def __init__(self, *, stage: int, **kwargs):
        super().__init__(**kwargs)
        self.stage = stage

    @property
    def model(self) -> torch.nn.Module:
        """The engine's module (its parameters are partitions under ZeRO-3)."""
        return self.module.module

    def gradient_sync(self, sync: bool):
        """Tell the engine whether this micro-batch ends the step (it reduces gradients at the boundary)."""
        self.module.set_gradient_accumulation_boundary(sync)
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        """`engine.backward` (no scaling by the engine's accumulation count: the loss is already a share)."""
        self.module.backward(loss, scale_wrt_gas=False)

    def step(self, max_grad_norm: float, before_step: Callable[[], None]
             ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """`before_step()`, then the engine's step (clip to its `gradient_clipping`, optimizer, schedule, zero).
        DeepSpeed itself skips the optimizer and schedule step when the global gradient norm is not finite (ZeRO 1-3,
        fp32 and bf16 as fp16; an all-reduced decision, the same on every rank): `was_step_applied()` says so."""
        before_step()
        lr = torch.tensor(float(self.optimizer.param_groups[0]["lr"]))
        self.module.step()
        norm = self.module.get_global_grad_norm()
        applied = bool(self.module.was_step_applied())
        return torch.as_tensor(0.0 if norm is None else norm).detach().float(), lr, applied

    def _state_stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Each parameter in full: under ZeRO-3 gathered in turn (`deepspeed.zero.GatheredParameters`)."""
        if self.stage < 3:
            yield from self.model.state_dict().items()
            return
        deepspeed = _deepspeed()

        for name, param in self.model.named_parameters(remove_duplicate=False):
            with deepspeed.zero.GatheredParameters([param]):
                yield name, param.data

    def checkpoint_parts(self, model_part: str, *, kind: str = "torch", prefix: str = "") -> dict[str, Part]:
        """The full model (ZeRO-3: consolidated on rank 0 here, on every rank), this rank's optimizer partition
        (per rank; resuming needs the same world size) and the schedule."""
        model: Any = self.model
        if self.stage == 3:
            full = self.module._zero3_consolidated_16bit_state_dict() or {}
            model = FullModelState(self.model.config, full, self._load_zero3)
        return {model_part: self._model_part(model, kind),
                f"{prefix}optimizer": Part(_ZeroOptimizerState(self.optimizer, self.dist), per_rank=True),
                f"{prefix}scheduler": Part(self.scheduler)}

    def _load_zero3(self, state: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        """Copy full tensors into the ZeRO-3 partitions (each parameter gathered, overwritten, re-partitioned); with
        `strict` False only the parameters `state` holds."""
        deepspeed = _deepspeed()

        with torch.no_grad():
            for name, param in self.model.named_parameters():
                if not strict and name not in state:
                    continue
                with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                    if self.dist.rank == 0:
                        param.data.copy_(state[name])


class _ZeroOptimizerState:
    """This rank's ZeRO optimizer state as a per-rank checkpoint part object. Loading passes it at this rank's index
    of DeepSpeed's list of partitions (the same world size) and restores the fp32 master partitions from it.
    It has no `resized_state`: partitions written by another world size are refused at resume."""

    checkpoint_description = "the DeepSpeed ZeRO optimizer partitions"

    def __init__(self, optimizer, dist):
        self.optimizer, self.dist = optimizer, dist

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        states: list = [None] * self.dist.world_size
        states[self.dist.rank] = state
        self.optimizer.load_state_dict(states, load_optimizer_states=True, load_from_fp32_weights=True)


def deepspeed_config(*, stage: int, max_grad_norm: float, mixed_precision: str, num_params: int,
                     user: Optional[dict] = None) -> dict:
    """The DeepSpeed config astrai passes to `deepspeed.initialize`: the ZeRO stage, clipping and precision from the
    astrai config; one micro-batch per engine step as DeepSpeed counts it (astrai marks the accumulation
    boundaries itself with `set_gradient_accumulation_boundary`); communication buckets of an eighth of the model
    (between 1e6 and DeepSpeed's default 5e8 elements): a bucket is a resident buffer, and one larger than the
    model is allocated and zeroed for nothing (25x slower steps with a tiny model on this CPU, and under ZeRO-3 a
    full-model-sized buffer that undoes the sharding). `user` is the DeepSpeed JSON the launch config names
    (`launch.read_deepspeed_config` has refused the fields that contradict astrai's): its other settings (e.g. its
    own bucket sizes) are kept, astrai's batch, accumulation, clipping, precision and stage override it."""
    bucket = int(min(5e8, max(num_params // 8, 1_000_000)))
    zero = {"stage": stage, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket}
    if stage == 3:  # gathered parameters are released after use (nothing stays whole between steps)
        zero = {"stage": stage, "reduce_bucket_size": bucket, "stage3_prefetch_bucket_size": bucket,
                "stage3_max_live_parameters": bucket, "stage3_max_reuse_distance": 0,
                "stage3_param_persistence_threshold": 10_000}
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "gradient_clipping": max_grad_norm, "zero_optimization": zero,
              "zero_allow_untested_optimizer": True, "steps_per_print": 2**31 - 1, "wall_clock_breakdown": False}
    if mixed_precision == "bf16":
        config["bf16"] = {"enabled": True}
    elif mixed_precision == "fp16":
        config["fp16"] = {"enabled": True, "loss_scale": 0}
    if user:
        zero = dict(zero, **user.get("zero_optimization", {}), stage=stage)
        config = dict(user, **config, zero_optimization=zero)
    return config


def _allow_deepspeed_state() -> None:
    """Let `torch.load(..., weights_only=True)` rebuild the DeepSpeed classes a ZeRO optimizer state holds (its loss
    scaler, the ZeRO stage enum and the parameter fragment addresses); nothing else is allowed."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    torch.serialization.add_safe_globals([LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address])


def prepare_trained(dist, name: str, model: torch.nn.Module, *,
                    optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer],
                    scheduler: Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler],
                    max_grad_norm: float, adapters: Optional[Adapters] = None) -> TrainedModel:
    """Wrap `model` (on `dist.device`) for training under `dist.strategy` and build its optimizer and schedule from
    the factories (after sharding: FSDP2 optimizers take the DTensor shards). `adapters`: see `TrainedModel`.

    Raises:
        ValueError: an unknown strategy.
    """
    strategy, mixed = dist.strategy, dist.mixed_precision
    model = model.to(dist.device)
    if strategy != "ddp":
        _ensure_process_group(dist)
    if strategy == "ddp":
        opt = optimizer(model)
        return TrainedModel(name=name, module=dist.prepare_model(model), optimizer=opt, scheduler=scheduler(opt),
                            dist=dist, adapters=adapters)
    if strategy == "fsdp2":
        shard_blocks(model, **_fsdp_precision(mixed))
        opt = optimizer(model)
        return FSDP2Model(name=name, module=model, optimizer=opt, scheduler=scheduler(opt), dist=dist,
                          adapters=adapters)
    if strategy in ("zero1", "zero2", "zero3"):
        deepspeed = _deepspeed()

        _allow_deepspeed_state()
        announce_deepspeed_op_build(deepspeed)  # one line before a first-use compile
        stage = int(strategy[-1])
        opt = optimizer(model)
        sched = scheduler(opt)
        engine, zero_optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=opt, lr_scheduler=sched,
            config=deepspeed_config(stage=stage, max_grad_norm=max_grad_norm, mixed_precision=mixed,
                                    num_params=sum(p.numel() for p in model.parameters()),
                                    user=dist.deepspeed_config))
        if stage == 3:
            share_zero3_fp32_master(zero_optimizer)
        return DeepSpeedModel(stage=stage, name=name, module=engine, optimizer=zero_optimizer, scheduler=sched,
                              dist=dist, adapters=adapters)
    raise ValueError(f"distributed.strategy: unknown {strategy!r}")


def _ensure_process_group(dist) -> None:
    """A one-process job started without a launcher gets what a launcher would give it before a sharding engine is
    built: a one-rank process group (in memory; gloo on CPU, nccl on CUDA) and RANK=0, LOCAL_RANK=0, WORLD_SIZE=1 in
    the environment where unset (DeepSpeed reads LOCAL_RANK throughout, and looks for MPI without a group). A no-op
    once a group exists."""
    import os

    if torch.distributed.is_initialized():
        return
    for name in ("RANK", "LOCAL_RANK"):
        os.environ.setdefault(name, "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    backend = "nccl" if dist.device.type == "cuda" else "gloo"
    torch.distributed.init_process_group(backend, store=torch.distributed.HashStore(), rank=0, world_size=1)


def _fsdp_precision(mixed_precision: str) -> dict:
    """`fully_shard` keyword arguments for the run's precision: bf16/fp16 compute with fp32 parameters (and fp32
    gradient reduction); none for fp32."""
    if mixed_precision == "no":
        return {}
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dtype = torch.bfloat16 if mixed_precision == "bf16" else torch.float16
    return {"mp_policy": MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)}


def prepare_reference(dist, model: torch.nn.Module) -> torch.nn.Module:
    """A frozen reference model for inference only (never given an optimizer): on `dist.device`, eval mode, no grad;
    partitioned under fsdp2 (`shard_blocks`) and zero3 (a ZeRO-3 inference engine), whole on every rank otherwise.
    Returns a module to call under `torch.no_grad()`."""
    model = model.to(dist.device).eval().requires_grad_(False)
    strategy = dist.strategy
    if strategy != "ddp":
        _ensure_process_group(dist)
    if strategy == "fsdp2":
        return shard_blocks(model, **_fsdp_precision(dist.mixed_precision))
    if strategy == "zero3":
        deepspeed = _deepspeed()

        config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
                  "steps_per_print": 2**31 - 1}
        announce_deepspeed_op_build(deepspeed)  # one line before a first-use compile
        engine, *_ = deepspeed.initialize(model=model, config=config)
        return engine
    return model

