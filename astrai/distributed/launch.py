"""Which engine trains the job: the launch configuration that `accelerate launch` exports, read and checked.

`accelerate launch --config_file X` does not pass its config file to the script; it exports it as environment
variables (accelerate 1.x, `accelerate/utils/launch.py`):

- DeepSpeed (`distributed_type: DEEPSPEED`): `ACCELERATE_USE_DEEPSPEED=true`, `ACCELERATE_DEEPSPEED_ZERO_STAGE`,
  and, when the file sets them, `ACCELERATE_DEEPSPEED_OFFLOAD_{OPTIMIZER,PARAM}_DEVICE`,
  `ACCELERATE_DEEPSPEED_ZERO3_INIT`, `ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL`,
  `ACCELERATE_GRADIENT_ACCUMULATION_STEPS`, `ACCELERATE_GRADIENT_CLIPPING` and `ACCELERATE_DEEPSPEED_CONFIG_FILE`
  (a DeepSpeed JSON file);
- FSDP (`distributed_type: FSDP`): `ACCELERATE_USE_FSDP=true`, `FSDP_VERSION` and the `FSDP_*` options;
- every launch: `ACCELERATE_MIXED_PRECISION` (`no` unless asked), and, without DeepSpeed,
  `ACCELERATE_DYNAMO_BACKEND`;
- plain multi-process (`MULTI_GPU`, `torchrun`, the `deepspeed` launcher): no marker at all.

`resolve_launch` turns that, with the job's `distributed.strategy` and mixed precision, into a `LaunchPlan`.
astrai applies the engines itself (`fully_shard`, `deepspeed.initialize`) so that CPU and GPU share one code
path (docs/distributed.md); a launch setting it cannot honour is a `LaunchError` naming it, never a silent
fallback to another engine. DeepSpeed batch sizes, accumulation and clipping always come from the job config:
`check_step_sizes` refuses launch settings that say otherwise.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

from astrai.deps import unavailable_reason

STRATEGIES = ("ddp", "fsdp2", "zero1", "zero2", "zero3")
RESHARDABLE = ("ddp", "fsdp2")
"""Engines whose checkpoints resume on another world size (per-rank state resized, dcp optimizer state resharded);
DeepSpeed's ZeRO optimizer partitions are not (docs/distributed.md)."""
"""The engines astrai trains with; `distributed.strategy` also takes "auto" (the launch config's, else ddp)."""
MIXED_PRECISION = ("no", "bf16", "fp16")
"""Mixed-precision modes (`train.bf16` / `train.fp16` of the job config)."""
HIDDEN_FROM_ACCELERATE = ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP", "ACCELERATE_GRADIENT_ACCUMULATION_STEPS")
"""Launch variables that would make `Accelerator()` build its own DeepSpeed/FSDP plugin (which does not run on
CPU) or parse "auto" as an integer; astrai hides them while it creates its `Accelerator` (process state and DDP
only)."""

# env var -> (accepted values, lower case; the launch-config key; why another value cannot be honoured)
_DEEPSPEED_SETTINGS = {
    "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": (("none",), "offload_optimizer_device",
                                                      "optimizer state offload (cpu/nvme) is not supported"),
    "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": (("none",), "offload_param_device",
                                                  "parameter offload (cpu/nvme) is not supported"),
    "ACCELERATE_DEEPSPEED_ZERO3_INIT": (("false",), "zero3_init_flag",
                                        "astrai partitions the model it loaded (no deepspeed.zero.Init)"),
    "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL": (("false",), "zero3_save_16bit_model",
                                                    "astrai's checkpoints hold the weights in the training dtype"),
}
_FSDP_SETTINGS = {
    "FSDP_OFFLOAD_PARAMS": (("false",), "fsdp_offload_params", "parameter offload is not supported"),
    "FSDP_ACTIVATION_CHECKPOINTING": (("false",), "fsdp_activation_checkpointing",
                                      "use model.gradient_checkpointing instead"),
    "FSDP_RESHARD_AFTER_FORWARD": (("true", "full_shard"), "fsdp_reshard_after_forward",
                                   "astrai's fsdp2 reshards every block after its forward"),
    "FSDP_SHARDING_STRATEGY": (("full_shard", "1"), "fsdp_sharding_strategy", "astrai's fsdp2 shards fully"),
}


class LaunchError(ValueError):
    """The launch configuration asks for something astrai cannot honour; the message is one line naming it."""


@dataclass(frozen=True)
class LaunchPlan:
    """The engine and precision a job trains with.

    Attributes:
        strategy: one of `STRATEGIES` (resolved: never "auto").
        mixed_precision: one of `MIXED_PRECISION`.
        source: where the strategy came from, for messages ("accelerate launch config", "distributed.strategy",
            "default").
        deepspeed_config: the user's DeepSpeed JSON (`deepspeed_config_file` of the launch config) after the
            checks here, or None; its batch sizes, accumulation, clipping and precision are astrai's to fill.
    """

    strategy: str
    mixed_precision: str = "no"
    source: str = "default"
    deepspeed_config: Optional[dict] = None


def _flag(env: Mapping[str, str], name: str) -> bool:
    """A boolean launch variable as accelerate writes them ("true"/"false", also 1/0, yes/no)."""
    return env.get(name, "false").strip().lower() in ("1", "true", "yes", "y", "on", "t")


def _check_settings(env: Mapping[str, str], table: Mapping[str, tuple]) -> None:
    """LaunchError for the first variable of `table` set to a value it does not accept."""
    for name, (accepted, key, why) in table.items():
        value = env.get(name)
        if value is not None and value.strip().lower() not in accepted:
            raise LaunchError(f"accelerate launch config: {key}: {value} cannot be honoured ({why}); "
                              f"set it to {accepted[0]} or leave it out")


def read_deepspeed_config(path: str) -> dict:
    """The DeepSpeed JSON file `path` of a launch config, checked for what astrai cannot honour.

    Raises:
        LaunchError: a missing or unreadable file, invalid JSON, no `zero_optimization` section, an `optimizer` or
            `scheduler` section (astrai's `optim` section defines both), or offload to a device.
    """
    where = f"accelerate launch config: deepspeed_config_file {path}"
    try:
        config = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise LaunchError(f"{where}: file not found") from None
    except (OSError, UnicodeDecodeError) as err:
        raise LaunchError(f"{where}: cannot read it ({' '.join(str(err).split())})") from None
    except json.JSONDecodeError as err:
        raise LaunchError(f"{where}: invalid JSON ({err.msg}, line {err.lineno})") from None
    if not isinstance(config, dict) or not isinstance(config.get("zero_optimization"), dict):
        raise LaunchError(f"{where}: expected a JSON object with a 'zero_optimization' section")
    for section in ("optimizer", "scheduler"):
        if section in config:
            raise LaunchError(f"{where}: remove its '{section}' section (astrai's optim section defines the "
                              "optimizer and learning-rate schedule)")
    for part in ("offload_optimizer", "offload_param"):
        device = (config["zero_optimization"].get(part) or {}).get("device", "none")
        if str(device).lower() != "none":
            raise LaunchError(f"{where}: zero_optimization.{part}.device {device} is not supported (no offload)")
    return config


def _deepspeed_request(env: Mapping[str, str]) -> tuple[str, Optional[dict]]:
    """(zero strategy, DeepSpeed JSON or None) of a DeepSpeed launch config."""
    _check_settings(env, _DEEPSPEED_SETTINGS)
    path = env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
    ds_config = None if path.lower() == "none" else read_deepspeed_config(path)
    stages = []
    if "ACCELERATE_DEEPSPEED_ZERO_STAGE" in env:
        stages.append(env["ACCELERATE_DEEPSPEED_ZERO_STAGE"].strip())
    if ds_config is not None and "stage" in ds_config["zero_optimization"]:
        stages.append(str(ds_config["zero_optimization"]["stage"]))
    if len(set(stages)) > 1:
        raise LaunchError(f"accelerate launch config: zero_stage {stages[0]} but its deepspeed_config_file says "
                          f"stage {stages[1]}")
    stage = stages[0] if stages else "2"  # accelerate's DeepSpeedPlugin default
    if stage not in ("1", "2", "3"):
        raise LaunchError(f"accelerate launch config: zero_stage {stage} is not supported (astrai runs ZeRO "
                          "stages 1, 2 and 3; for plain data parallelism use configs/zero/ddp.yaml)")
    return f"zero{stage}", ds_config


def launch_request(env: Mapping[str, str]) -> tuple[Optional[str], Optional[dict]]:
    """The strategy an `accelerate launch` config asked for through `env`, or None (plain multi-process launch,
    `torchrun`, the `deepspeed` launcher, one process), and the DeepSpeed JSON it names.

    Raises:
        LaunchError: a launch mode astrai cannot honour: FSDP version 1, FSDP or ZeRO options listed in
            `_FSDP_SETTINGS` / `_DEEPSPEED_SETTINGS` with other values, ZeRO stage 0, Megatron-LM, accelerate's
            parallelism config (TP/CP/SP), a torch.compile backend, or DeepSpeed and FSDP at once.
    """
    if _flag(env, "ACCELERATE_USE_MEGATRON_LM"):
        raise LaunchError("accelerate launch config: distributed_type MEGATRON_LM is not supported (use "
                          "configs/zero/*.yaml)")
    if _flag(env, "ACCELERATE_USE_PARALLELISM_CONFIG"):
        raise LaunchError("accelerate launch config: parallelism_config (tensor/context/sequence parallelism) "
                          "is not supported; astrai shards with fsdp2 or zero1/2/3")
    dynamo = env.get("ACCELERATE_DYNAMO_BACKEND", "no")
    if dynamo.strip().lower() not in ("no", ""):
        raise LaunchError(f"accelerate launch config: dynamo_backend {dynamo} is not supported; set it to 'no'")
    deepspeed, fsdp = _flag(env, "ACCELERATE_USE_DEEPSPEED"), _flag(env, "ACCELERATE_USE_FSDP")
    if deepspeed and fsdp:
        raise LaunchError("accelerate launch config: asks for DeepSpeed and FSDP at once")
    if deepspeed:
        return _deepspeed_request(env)
    if fsdp:
        version = env.get("FSDP_VERSION", "1").strip()
        if version != "2":
            raise LaunchError(f"accelerate launch config: fsdp_version {version} is not supported; astrai shards "
                              "with FSDP2 (set fsdp_config.fsdp_version: 2, as configs/zero/fsdp2.yaml does)")
        _check_settings(env, _FSDP_SETTINGS)
        return "fsdp2", None
    return None, None


def _check_available(strategy: str) -> None:
    """LaunchError when the engine of `strategy` is not installed, or installed but failing to import."""
    if strategy.startswith("zero"):
        reason = unavailable_reason("deepspeed", needed_by=f"distributed.strategy {strategy}",
                                    install="pip install 'astrai[deepspeed]'")
        if reason is not None:
            raise LaunchError(reason)
    if strategy == "fsdp2":
        import torch.distributed.fsdp as fsdp

        if not hasattr(fsdp, "fully_shard"):
            raise LaunchError("distributed.strategy fsdp2 needs torch.distributed.fsdp.fully_shard (PyTorch >= 2.6)")


def _mixed_precision(requested: str, env: Mapping[str, str], ds_config: Optional[dict]) -> str:
    """`requested` after checking that the launch config (and its DeepSpeed JSON) does not ask for another."""
    if requested not in MIXED_PRECISION:
        raise LaunchError(f"mixed precision: expected one of {', '.join(MIXED_PRECISION)}, got {requested!r}")
    asked = env.get("ACCELERATE_MIXED_PRECISION", "no").strip().lower()
    if asked not in MIXED_PRECISION:
        raise LaunchError(f"accelerate launch config: mixed_precision {asked} is not supported (no, bf16, fp16)")
    sources = [("mixed_precision", asked)] if asked != "no" else []
    for mode in ("bf16", "fp16"):
        if ds_config is not None and (ds_config.get(mode) or {}).get("enabled") is True:
            sources.append((f"deepspeed_config_file {mode}.enabled", mode))
    for key, mode in sources:
        if mode != requested:
            job = f"train.{requested} true" if requested != "no" else "train.bf16 and train.fp16 false"
            raise LaunchError(f"accelerate launch config: {key} {mode} contradicts the job ({job}); astrai applies "
                              f"mixed precision itself: set train.{mode} true in the job, or 'no' in the launch "
                              "config")
    return requested


def resolve_launch(strategy: str, *, mixed_precision: str = "no", env: Mapping[str, str]) -> LaunchPlan:
    """The engine and precision of this job.

    Args:
        strategy: `distributed.strategy`: "auto" (what the launch config asked for, else "ddp") or one of
            `STRATEGIES` (which must then agree with the launch config, if it asked for an engine).
        mixed_precision: "no", "bf16" or "fp16" (from `train.bf16` / `train.fp16`).
        env: the process environment (`os.environ`).

    Raises:
        LaunchError: see `launch_request`; an unknown strategy; an explicit strategy that contradicts the launch
            config; a launch mixed precision that contradicts the job's; a missing engine package.
    """
    if strategy != "auto" and strategy not in STRATEGIES:
        raise LaunchError(f"distributed.strategy: expected auto or one of {', '.join(STRATEGIES)}, got {strategy!r}")
    requested, ds_config = launch_request(env)
    if strategy == "auto":
        chosen, source = (requested, "accelerate launch config") if requested else ("ddp", "default")
    elif requested is not None and requested != strategy:
        raise LaunchError(f"distributed.strategy: the job asks for {strategy} but the accelerate launch config "
                          f"asks for {requested}; make them agree or set distributed.strategy auto")
    else:
        chosen, source = strategy, "distributed.strategy"
    _check_available(chosen)
    return LaunchPlan(strategy=chosen, mixed_precision=_mixed_precision(mixed_precision, env, ds_config),
                      source=source, deepspeed_config=ds_config)


def check_step_sizes(env: Mapping[str, str], *, strategy: str, deepspeed_config: Optional[dict],
                     micro_batch_size: int, accumulation_steps: int, max_grad_norm: float, world_size: int) -> None:
    """Refuse DeepSpeed launch settings that contradict the job's optimizer step ("auto" or absent is fine:
    astrai fills them): `gradient_accumulation_steps` and `gradient_clipping` of the accelerate config, and
    `train_micro_batch_size_per_gpu`, `gradient_accumulation_steps`, `train_batch_size` (= micro x accumulation x
    world size) and `gradient_clipping` of its DeepSpeed JSON (`LaunchPlan.deepspeed_config`). Only for the zero
    strategies (`strategy`).

    Raises:
        LaunchError: naming the setting, its value and the job's.
    """
    if not strategy.startswith("zero"):
        return
    expected = {"train_micro_batch_size_per_gpu": micro_batch_size, "gradient_accumulation_steps": accumulation_steps,
                "train_batch_size": micro_batch_size * accumulation_steps * world_size,
                "gradient_clipping": max_grad_norm}
    found: list[tuple[str, Any, str]] = []
    for name, key in (("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "gradient_accumulation_steps"),
                      ("ACCELERATE_GRADIENT_CLIPPING", "gradient_clipping")):
        if name in env:
            found.append((key, env[name], "accelerate launch config"))
    for key in expected:
        if deepspeed_config is not None and key in deepspeed_config:
            found.append((key, deepspeed_config[key], "deepspeed_config_file"))
    for key, value, where in found:
        if str(value).strip().lower() == "auto":
            continue
        try:
            agrees = float(value) == float(expected[key])
        except (TypeError, ValueError):
            agrees = False
        if not agrees:
            raise LaunchError(f"{where}: {key} {value} contradicts the job ({expected[key]}); astrai fills it from "
                              "the job config: set it to auto or leave it out")
