"""The memory a job holds per rank, planned from its config and its model's shape before anything is built, and a
one-line refusal (with the setting that would make it fit) when it cannot fit the device.

What is counted, per rank, in bytes (`plan_memory`):
- the trained models' state (the policy; online_ppo's critic): parameters in `model.dtype`, gradients of the trained
  parameters in the same dtype, AdamW's two moments in float32 (8 bytes per trained parameter), and under DeepSpeed
  with bf16/fp16 (and zero1 / zero2 in fp32 too, as measured by bench/memory.py) an fp32 master copy (4 bytes per
  trained parameter), and DeepSpeed's fp32 reduce bucket (an eighth of the trained parameters, clamped to
  [1e6, 5e8], `astrai.distributed.sharding.deepspeed_config`). Sharding divides them by the world size N
  (ZeRO, Rajbhandari et al. 2020, section 5): zero1 and zero2 the optimizer state and master, plus an fp32
  gradient partition beside whole gradients (DeepSpeed 0.19.8 at the step: ZeRO-2's `.grad` are views into a
  whole-model buffer, so it holds what ZeRO-1 does); zero3 and fsdp2 parameters, gradients and optimizer state; ddp
  nothing. The sums agree with `bench/memory.py`'s measured state at the step (tests/test_memory_plan.py). Under LoRA (`model.lora`) only the adapters are trained: the
  base parameters have no gradient and no optimizer state;
- the frozen models (the train type's `models_held`): the reference policy of a KL term or of dpo (none under LoRA:
  it is the policy's own base), the teacher of on-policy distillation in its place (every distinct local teacher of
  `distill.teachers`, one item each; served teachers none), each in `model.dtype`, partitioned (/ N) under fsdp2 and
  zero3;
- the colocated rollout engine (online train types; with `rollout.placement` separate the generation process's,
  counted on a CPU, whose memory it shares, and left out on a GPU, where it has a device of its own): its weight
  copy in `rollout.dtype` (else `model.dtype`) and its KV cache at `rollout.engine_options.max_kv_tokens` (the paged engine's default 32768 tokens when unset), 2 x layers
  x KV heads x head_dim per token; both split over `rollout.tensor_parallel_size` T (KV heads below T replicated, as
  Megatron does); on a CPU where the paged engine prepacks its GEMM weights (`astrai.rollout.packed_linear`: bf16,
  float32 off Intel CPUs; T = 1), one more copy of its weights ("engine prepacked").
Not counted: activations (they depend on micro-batch size, sequence length and activation checkpointing), transient
all-gathers of sharded weights, communication buckets, the CUDA context and the allocator's fragmentation: the plan
is a floor, so `check_fits` refuses only what cannot fit even then and warns above `WARN_FRACTION` of the device.

Parameter counts are exact: the model classes are built on the meta device (no memory) and their tensors counted.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Mapping, Optional

import torch

from astrai.models import AutoRegressiveLM
from astrai.models.config import ModelConfig
from astrai.models.moe import upcycled_config
from astrai.models.value_model import ValueModel
from astrai.rollout.packed_linear import prepack_available

__all__ = ["MemoryPlan", "MemoryItem", "plan_memory", "device_bytes", "check_fits", "local_teachers", "WARN_FRACTION"]

WARN_FRACTION = 0.8
"""Above this share of the device, the plan warns that activations and runtime may not fit beside it."""
DEFAULT_KV_TOKENS = 32768
"""The paged engine's `max_kv_tokens` when `rollout.engine_options` does not set it."""
SHARDS_PARAMETERS = ("zero3", "fsdp2")
SHARDS_GRADIENTS = ("zero3", "fsdp2")  # at the step: ZeRO-2's .grad are views into a whole-model buffer
SHARDS_OPTIMIZER = ("zero1", "zero2", "zero3", "fsdp2")
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclasses.dataclass(frozen=True)
class MemoryItem:
    """One line of the plan: what it is, its bytes per rank, and how they were counted (for the table)."""

    name: str
    bytes: int
    how: str


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """The planned bytes per rank of one job (`plan_memory`): `items`, the `world_size`, `strategy` and tensor-parallel
    size `tp` they assume, and the device's bytes per rank (`available`, None when unknown)."""

    items: tuple[MemoryItem, ...]
    world_size: int
    strategy: str
    tp: int
    device: str
    available: Optional[int]

    @property
    def total(self) -> int:
        """Planned bytes per rank, every item."""
        return sum(item.bytes for item in self.items)

    def table(self) -> str:
        """The plan as lines of text: one per item (bytes and how counted), the total, and the device's share."""
        width = max(len(item.name) for item in self.items)
        head = (f"memory per rank, planned ({self.world_size} rank{'s' if self.world_size > 1 else ''}, "
                f"{self.strategy}, rollout tensor parallel {self.tp}; activations and transient gathers not "
                "included):")
        lines = [head] + [f"  {item.name:<{width}}  {_gib(item.bytes):>10}  {item.how}" for item in self.items]
        share = (f" of {_gib(self.available)} per rank on {self.device} ({self.total / self.available:.0%})"
                 if self.available else f" (the {self.device}'s memory is unknown)")
        return "\n".join(lines + [f"  {'total':<{width}}  {_gib(self.total):>10}{share}"])


def _gib(n: float) -> str:
    return f"{n / 2 ** 30:.2f} GiB"


def parameter_count(model_config: ModelConfig) -> int:
    """Exact parameter count of the causal LM of `model_config` (built on the meta device: no memory)."""
    with torch.device("meta"):
        return sum(p.numel() for p in AutoRegressiveLM(model_config).parameters())


def critic_count(model_config: ModelConfig, num_layers: Optional[int]) -> int:
    """Exact parameter count of online_ppo's critic (`ValueModel.from_policy` with `ppo.critic_layers`)."""
    with torch.device("meta"):
        return sum(p.numel() for p in ValueModel.from_policy(AutoRegressiveLM(model_config), num_layers).parameters())


def lora_count(model_config: ModelConfig, lora) -> int:
    """Trained parameters of `model.lora` on the model of `model_config`: r x (in + out) per targeted Linear."""
    with torch.device("meta"):
        model = AutoRegressiveLM(model_config)
    targets = set(lora.target_modules)
    return sum(lora.r * (m.in_features + m.out_features) for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets)


def kv_bytes_per_token(model_config: ModelConfig, dtype_bytes: int, tp: int) -> int:
    """KV cache bytes per token on one rank of a tensor-parallel group of `tp`: 2 (K and V) x layers x local KV
    heads (at least 1: heads fewer than `tp` are replicated) x head_dim x `dtype_bytes`."""
    heads = max(1, model_config.num_key_value_heads // tp)
    return 2 * model_config.num_hidden_layers * heads * model_config.head_dim * dtype_bytes


def device_bytes(device: torch.device, local_world_size: int = 1) -> Optional[int]:
    """Memory of `device` per rank: a CUDA device's total memory, or the machine's physical memory shared by the
    `local_world_size` ranks of this node (CPU); None when it cannot be read."""
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device.index or 0).total_memory
    if device.type == "cpu":
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(1, local_world_size)
        except (ValueError, OSError, AttributeError):
            return None
    return None


def _trained(name: str, params: int, trained: int, *, param_bytes: int, strategy: str, n: int,
             master: bool) -> list[MemoryItem]:
    """The items of one trained model: parameters, gradients, optimizer state (and the fp32 master copy)."""
    shard = lambda kinds: n if strategy in kinds else 1  # noqa: E731
    note = lambda kinds: f" / {n} ranks ({strategy})" if strategy in kinds and n > 1 else ""  # noqa: E731
    items = [MemoryItem(f"{name} parameters", params * param_bytes // shard(SHARDS_PARAMETERS),
                        f"{params / 1e6:.1f}M x {param_bytes} B{note(SHARDS_PARAMETERS)}"),
             MemoryItem(f"{name} gradients", trained * param_bytes // shard(SHARDS_GRADIENTS),
                        f"{trained / 1e6:.1f}M trained x {param_bytes} B{note(SHARDS_GRADIENTS)}"),
             MemoryItem(f"{name} optimizer", trained * 8 // shard(SHARDS_OPTIMIZER),
                        f"AdamW: 2 x {trained / 1e6:.1f}M x 4 B{note(SHARDS_OPTIMIZER)}")]
    if strategy in ("zero1", "zero2"):  # the fp32 gradient partition the optimizer steps (measured: bench/memory.py)
        items.append(MemoryItem(f"{name} gradient partition", trained * 4 // n,
                                f"{trained / 1e6:.1f}M x 4 B / {n} ranks ({strategy})"))
    if master:
        items.append(MemoryItem(f"{name} fp32 master", trained * 4 // shard(SHARDS_OPTIMIZER),
                                f"{trained / 1e6:.1f}M x 4 B{note(SHARDS_OPTIMIZER)}"))
    if strategy.startswith("zero"):  # the reduce bucket astrai configures (`sharding.deepspeed_config`), fp32
        bucket = int(min(5e8, max(trained // 8, 1_000_000)))
        items.append(MemoryItem(f"{name} reduce bucket", bucket * 4, f"{bucket / 1e6:.1f}M x 4 B (DeepSpeed)"))
    return items


def local_teachers(config) -> dict[str, str]:
    """The local teachers of on-policy distillation the job holds (served ones hold no memory here): memory item name
    -> route. `distill.teacher`: {"teacher": ""}; `distill.teachers`: {"teacher <route>": route} per distinct
    local teacher (routes naming the same one share its copy: the first route names it); {} otherwise."""
    from astrai.config import served_url

    distill = config.distill
    if distill.teachers:
        first = {}
        for route, path in distill.teachers.items():
            if not served_url(path):
                first.setdefault(path.strip(), route)
        return {f"teacher {route}": route for route in first.values()}
    return {"teacher": ""} if distill.teacher and not distill.served else {}


def plan_memory(config, model_config: ModelConfig, *, strategy: str, world_size: int, device: torch.device,
                local_world_size: int = 1, teacher_config: Optional[ModelConfig] = None,
                teacher_configs: Optional[Mapping[str, ModelConfig]] = None) -> MemoryPlan:
    """The planned bytes per rank of the job of `config` (a validated `astrai.config.Config`) for a policy of
    `model_config`, under the resolved `strategy` (ddp, zero1, zero2, zero3, fsdp2) at `world_size` ranks on `device`
    (`local_world_size` ranks per node share a CPU's memory; `distributed.device_memory_gib`, when set, is the
    memory per rank instead); `teacher_config` is the local teacher's shape (None: the policy's), `teacher_configs`
    each routed local teacher's by route (`distill.teachers`; one missing: the policy's). See the module
    docstring for what is counted."""
    from astrai import train_types

    spec = train_types.get(config.train.type)
    n, param_bytes = world_size, _DTYPE_BYTES[config.model.dtype]
    # DeepSpeed keeps an fp32 master partition under bf16/fp16, and under zero1 / zero2 in fp32 too (measured:
    # bench/memory.py); astrai aliases zero3's fp32 one to the parameters (`distributed.zero_memory`)
    master = strategy in ("zero1", "zero2") or (strategy == "zero3" and config.train.mixed_precision != "no")
    params = parameter_count(model_config)
    lora = config.model.lora
    trained = lora_count(model_config, lora) if lora else params
    items = _trained("policy", params + (trained if lora else 0), trained, param_bytes=param_bytes,
                     strategy=strategy, n=n, master=master)
    held = spec.models_held(config)
    if held.critic:
        critic = critic_count(model_config, held.critic_layers)
        items += _trained("critic", critic, critic, param_bytes=param_bytes, strategy=strategy, n=n, master=master)
    frozen_shard = n if strategy in SHARDS_PARAMETERS else 1
    frozen_note = f" / {n} ranks ({strategy})" if frozen_shard > 1 else ""
    teachers = local_teachers(config)
    for name, route in teachers.items():
        shape = (teacher_configs or {}).get(route) or (teacher_config if route == "" else None) or model_config
        count = parameter_count(shape)
        items.append(MemoryItem(name, count * param_bytes // frozen_shard,
                                f"{count / 1e6:.1f}M x {param_bytes} B{frozen_note}"))
    if not teachers and held.reference and not lora:
        items.append(MemoryItem("reference", params * param_bytes // frozen_shard,
                                f"{params / 1e6:.1f}M x {param_bytes} B{frozen_note}"))
    r = config.rollout
    separate = getattr(r, "placement", "colocated") == "separate"
    if spec.online and separate and device.type != "cpu":  # the engine is on the generation process's own device
        tp = 1
    elif spec.online:
        tp = getattr(r, "tensor_parallel_size", 1)
        engine_dtype = config.model.dtype if r.dtype is None else r.dtype
        engine_bytes = _DTYPE_BYTES[engine_dtype]
        copies = getattr(r, "generation_processes", 1) if separate else 1  # on a CPU: counted, in the same memory
        where = "" if not separate else (", in the generation process" if copies == 1 else
                                         f" x {copies} (one in each generation process)")
        split = (f" / {tp} (tensor parallel)" if tp > 1 else "") + where
        items.append(MemoryItem("engine weights", params * engine_bytes // tp * copies,
                                f"{params / 1e6:.1f}M x {engine_bytes} B{split}"))
        if r.engine == "paged" and tp == 1 and prepack_available(device, getattr(torch, engine_dtype)):
            items.append(MemoryItem("engine prepacked", params * engine_bytes * copies,
                                    f"{params / 1e6:.1f}M x {engine_bytes} B (oneDNN layout of its GEMM weights, "
                                    f"CPU; astrai.rollout.packed_linear){where}"))
        tokens = r.engine_options.get("max_kv_tokens", DEFAULT_KV_TOKENS) if r.engine == "paged" else None
        if isinstance(tokens, int):
            per_token = kv_bytes_per_token(model_config, engine_bytes, tp)
            items.append(MemoryItem("engine KV cache", tokens * per_token * copies,
                                    f"{tokens} tokens x {per_token / 1024:.1f} KiB (max_kv_tokens){where}"))
    else:
        tp = 1
    budget = config.distributed.device_memory_gib
    return MemoryPlan(items=tuple(items), world_size=n, strategy=strategy, tp=tp,
                      device=device.type if budget is None else "budget (distributed.device_memory_gib)",
                      available=device_bytes(device, local_world_size) if budget is None else int(budget * 2**30))


def check_fits(plan: MemoryPlan, alternatives: dict[str, MemoryPlan]) -> Optional[str]:
    """None when `plan` fits its device (or the device is unknown); a warning line (starting "memory:") when it
    takes more than `WARN_FRACTION` of it; raises ValueError with one line when the plan alone exceeds the device,
    naming the first of `alternatives` (a setting, e.g. "distributed.strategy fsdp2", -> its plan) that would fit.

    Raises:
        ValueError: "memory: ... needs X GiB per rank ... but the device has Y GiB; setting S would plan Z GiB".
    """
    if not plan.available:
        return None
    if plan.total > plan.available:
        largest = max(plan.items, key=lambda item: item.bytes)
        fits = [(name, alt) for name, alt in alternatives.items() if alt.total <= WARN_FRACTION * plan.available]
        hint = (f"; {fits[0][0]} would plan {_gib(fits[0][1].total)}" if fits else
                "; none of " + ", ".join(alternatives) + " alone would fit" if alternatives else "")
        raise ValueError(f"memory: this job needs at least {_gib(plan.total)} per rank ({largest.name} "
                         f"{_gib(largest.bytes)} the largest part; activations not counted) but the {plan.device} has "
                         f"{_gib(plan.available)} per rank{hint}")
    if plan.total > WARN_FRACTION * plan.available:
        return (f"memory: the planned state takes {plan.total / plan.available:.0%} of the {plan.device}'s "
                f"{_gib(plan.available)} per rank before activations; the job may run out of memory")
    return None


def planned_job(config, model_config: ModelConfig, *, strategy: str, world_size: int, device: torch.device,
                local_world_size: int = 1, teacher_config: Optional[ModelConfig] = None,
                teacher_configs: Optional[Mapping[str, ModelConfig]] = None) -> tuple[MemoryPlan, Optional[str]]:
    """The job's plan (`plan_memory`) and `check_fits`'s warning (or None), with the settings that would make a
    plan that cannot fit smaller tried in this order: a fully sharded strategy (fsdp2, at several ranks), LoRA
    (`model.lora` r 16, for full training), the rollout engine split over the ranks
    (`rollout.tensor_parallel_size`, online train types at several ranks) and the largest KV cache that leaves the
    rest room (when it still holds one sequence); when none fits alone, all of them together.

    Raises:
        ValueError: the plan cannot fit (one line, `check_fits`).
    """
    from astrai import train_types

    kwargs = dict(world_size=world_size, device=device, local_world_size=local_world_size,
                  teacher_config=teacher_config, teacher_configs=teacher_configs)
    model_config = upcycled_config(model_config, config.model)  # a dense checkpoint upcycled at start-up: its experts
    plan = plan_memory(config, model_config, strategy=strategy, **kwargs)
    if not plan.available or plan.total <= plan.available:
        return plan, check_fits(plan, {})
    tries: dict[str, tuple[list[str], str]] = {}
    if world_size > 1 and strategy not in SHARDS_PARAMETERS:
        tries["distributed.strategy fsdp2"] = ([], "fsdp2")
    if not config.model.lora:
        tries["model.lora {r: 16}"] = (["--model.lora", "{r: 16}"], strategy)
    online = train_types.get(config.train.type).online
    if online and world_size > 1 and hasattr(config.rollout, "tensor_parallel_size") \
            and config.rollout.tensor_parallel_size < world_size:
        tries[f"rollout.tensor_parallel_size {world_size}"] = (
            ["--rollout.tensor_parallel_size", str(world_size)], strategy)
    kv_item = next((item for item in plan.items if item.name == "engine KV cache"), None)
    if kv_item is not None:  # the largest KV cache that leaves the rest room, if it still holds one sequence
        kv = config.rollout.engine_options.get("max_kv_tokens", DEFAULT_KV_TOKENS)
        per_token = kv_item.bytes // kv
        room = int(WARN_FRACTION * plan.available) - (plan.total - kv_item.bytes)
        tokens = room // per_token // 1024 * 1024 if per_token else 0
        if config.data.max_prompt_length + config.rollout.max_new_tokens <= tokens < kv:
            options = {**config.rollout.engine_options, "max_kv_tokens": tokens}
            tries[f"rollout.engine_options.max_kv_tokens {tokens}"] = (
                ["--rollout.engine_options", repr(options).replace("'", "")], strategy)
    alternatives = {}
    for name, (overrides, their_strategy) in tries.items():
        changed = _changed(config, overrides)
        if changed is not None:
            alternatives[name] = plan_memory(changed, model_config, strategy=their_strategy, **kwargs)
    if tries and not any(alt.total <= WARN_FRACTION * plan.available for alt in alternatives.values()):
        together = [override for overrides, _ in tries.values() for override in overrides]
        strategies = {their for _, their in tries.values()} - {strategy}
        changed = _changed(config, together)
        if changed is not None:  # none alone: all of them at once
            alternatives[" together with ".join(tries)] = plan_memory(
                changed, model_config, strategy=strategies.pop() if strategies else strategy, **kwargs)
    return plan, check_fits(plan, alternatives)


def _changed(config, overrides: list[str]):
    """`config` with command-line `overrides`, or None when the job refuses them (e.g. a TP that does not divide)."""
    from astrai.config import config_from_dict, config_to_dict

    try:
        return config_from_dict(config_to_dict(config), overrides)
    except ValueError:
        return None
