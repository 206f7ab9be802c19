"""The rollout engine of a job: `rollout.engine` built (or checked, for `--check`) from the config's `rollout`
section through the engine factory (`astrai.rollout.engine.build_engine`)."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import types
import warnings
from typing import Optional

import torch

from astrai.kernels import BackendUnavailableError
from astrai.models.moe import upcycled_config
from astrai.rollout.engine import ATTENTION_BACKEND_ENV, GenerationEngine, attention_backend, build_engine, check_engine
from astrai.runtime_env import checked_threads, usable_cpus

__all__ = ["build_job_engine", "build_rollout_engine", "check_generation_cpus", "check_rollout_engine",
           "generation_devices",
           "generation_threads"]


def build_rollout_engine(config, policy: torch.nn.Module, tokenizer, *, policy_version: int = 0,
                         tp_group=None) -> GenerationEngine:
    """The colocated rollout engine `rollout.engine` (`astrai.rollout.engine.build_engine`): an inference copy of
    `policy` (made before the policy is sharded) in `rollout.dtype`, attending with `rollout.attention_backend`
    (`ASTR_BACKEND` overrides it), with CUDA graphs when `rollout.cuda_graphs` (passed only then: other registered
    engines need not know the option), split over `tp_group` (the distributed context's tensor-parallel group,
    passed as the factory's `tp_group` only when the job's `tensor_parallel_size` > 1; None: a whole copy, as the
    in-training evaluation and the evaluate CLI hold). Raises ValueError / BackendUnavailableError (one line) for
    what it refuses."""
    r = config.rollout
    options = _engine_options(config)
    if _check_tensor_parallel(config) > 1 and tp_group is not None:
        options["tp_group"] = tp_group
    _check_capacity(config)
    with _naming_the_backend_field():
        engine = build_engine(r.engine, policy, pad_token_id=tokenizer.pad_token_id, policy_version=policy_version,
                              dtype=r.dtype, attention_backend=attention_backend(r.attention_backend), **options)
    if r.cuda_graphs and engine.device.type != "cuda":
        warnings.warn(f"rollout.cuda_graphs: nothing is captured on {engine.device.type} (graphs are a CUDA "
                      "feature); decode steps run padded to their batch bucket, eagerly, which is slower here")
    return engine


def build_job_engine(config, policy: torch.nn.Module, tokenizer, *, device: torch.device, tp_group=None,
                     local_rank: int = 0, local_world_size: int = 1):
    """The engine a training rank's rollouts come from: `build_rollout_engine` in this process
    (`rollout.placement` colocated), or with `separate` a generation process of its own
    (`astrai.rollout.remote.RemoteEngine`) that builds the same engine from `policy`'s class and config on
    `generation_devices` with `generation_threads` (this process then keeps the rest of the threads, said once); with
    `rollout.generation_processes` N > 1, N of them behind one `astrai.rollout.remote.GenerationPool`. `device` is
    the training rank's; `local_rank` / `local_world_size` place GPU generation processes.

    Raises:
        ValueError / BackendUnavailableError: as `build_rollout_engine` (in the generation process, said here in
            one line), or a `generation_device` that does not exist.
        RemoteEngineError: a generation process could not start.
    """
    r = config.rollout
    if r.placement != "separate":
        return build_rollout_engine(config, policy, tokenizer, tp_group=tp_group)
    from astrai.rollout.remote import GenerationPool, RemoteEngine

    places = generation_devices(config, device, local_rank, local_world_size)
    check_generation_cpus(config, places[0])
    threads = generation_threads(config, places[0]) if places[0].type == "cpu" else None
    build = functools.partial(_generation_engine, config, tokenizer.pad_token_id)
    engines = []
    try:
        for i, where in enumerate(places):
            name = "the generation process" if len(places) == 1 else f"generation process {i + 1} of {len(places)}"
            engines.append(RemoteEngine(type(policy), policy.config, build, device=where, threads=threads,
                                        timeout_seconds=config.distributed.timeout_seconds,
                                        deterministic=config.runtime.deterministic, name=name))
    except BaseException:
        for engine in engines:
            engine.close()
        raise
    return engines[0] if len(engines) == 1 else GenerationPool(engines)


def generation_devices(config, device: torch.device, local_rank: int = 0,
                       local_world_size: int = 1) -> list[torch.device]:
    """The devices of the training rank's N generation processes (N = `rollout.generation_processes`): from
    `rollout.generation_device` (cpu: all on the CPU; cuda:K: cuda:K .. cuda:K+N-1) or, null, cpu for a CPU job,
    else the GPUs after the job's own on this node, cuda:<local_world_size + local_rank x N + i>. Raises ValueError
    (one line) for a GPU that is not there."""
    count = config.rollout.generation_processes
    chosen = config.rollout.generation_device
    if chosen is None:
        chosen = "cpu" if device.type == "cpu" else f"cuda:{local_world_size + local_rank * count}"
    first = torch.device(chosen)
    if first.type == "cpu":
        return [first] * count
    places = [torch.device("cuda", first.index + i) for i in range(count)]
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if places[-1].index >= have:
        wanted = chosen if count == 1 else f"cuda:{first.index}..cuda:{places[-1].index}"
        raise ValueError(f"rollout.generation_device: {wanted} does not exist ({have} CUDA device(s) here); a "
                         "separate placement needs a device of its own per generation process, or set it to cpu")
    return places


def check_generation_cpus(config, device: torch.device) -> None:
    """Refuse more CPU generation processes than CPUs (`rollout.generation_processes` x `rollout.generation_threads`,
    at least one thread each, on a CPU `device`): OpenMP threads beyond the cores wait on each other at every
    barrier, and each process holds an engine copy and an interpreter of its own. With one process,
    `rollout.generation_threads` above the CPUs is refused (`checked_threads`, as `generation_threads` does when the
    job starts), so `--check` refuses it too. Raises ValueError (one line)."""
    count = config.rollout.generation_processes
    if device.type != "cpu":
        return
    if count == 1:
        if config.rollout.generation_threads is not None:
            checked_threads(config.rollout.generation_threads, "rollout.generation_threads")
        return
    each = config.rollout.generation_threads or 1
    cpus = usable_cpus()
    if count * each > cpus:
        raise ValueError(f"rollout.generation_processes: {count} generation processes x {each} thread(s) need "
                         f"{count * each} CPUs, but this process may use {cpus}; expected at most "
                         f"{max(1, cpus // each)} (or put them on GPUs with rollout.generation_device)")


def generation_threads(config, device: torch.device) -> Optional[int]:
    """Each generation process's torch threads on a CPU `device` (`rollout.generation_threads`), with N =
    `rollout.generation_processes` of them. One step off (`rollout.max_off_policy_steps` > 0) they and this process
    compute at once: null is this process's threads split evenly over the N + 1 (at least 1 each), and when
    `runtime.num_threads` is null this process keeps the rest (more threads than cores collapse), said once.
    Synchronous, this process waits while they generate: null is its thread count split over the N (at least 1),
    and it keeps its own."""
    if device.type != "cpu":
        return None
    count = config.rollout.generation_processes
    have = torch.get_num_threads()
    if config.rollout.generation_threads is not None:
        checked_threads(config.rollout.generation_threads, "rollout.generation_threads")
    if config.rollout.max_off_policy_steps == 0:
        return config.rollout.generation_threads or max(1, have // count)
    threads = config.rollout.generation_threads or max(1, have // (count + 1))
    if config.runtime.num_threads is None and have > 1:
        keep = max(1, have - count * threads)
        if keep != have:
            torch.set_num_threads(keep)
            takes = "the generation process takes" if count == 1 else f"each of the {count} generation processes takes"
            print(f"rollout.placement separate: {takes} {threads} CPU thread(s), training "
                  f"keeps {keep} (set runtime.num_threads and rollout.generation_threads to choose)",
                  file=sys.stderr, flush=True)
    return threads


def _generation_engine(config, pad_token_id: int, model: torch.nn.Module):
    """`build_rollout_engine` in a generation process (picklable with `functools.partial`)."""
    return build_rollout_engine(config, model, types.SimpleNamespace(pad_token_id=pad_token_id), policy_version=-1)


def check_rollout_engine(config, model_config, device: torch.device) -> None:
    """What `build_rollout_engine` would refuse for a model of `model_config` on `device` (the engine name, its
    dtype, `rollout.attention_backend` or `ASTR_BACKEND`, `rollout.cuda_graphs`, a `rollout.tensor_parallel_size`
    the model's heads cannot split over), without building the engine.
    With `rollout.placement: separate` the engine is checked on the generation process's device
    (`generation_devices`, which must exist). Raises what they raise."""
    r = config.rollout
    if getattr(r, "placement", "colocated") == "separate":
        device = generation_devices(config, device)[0]
        check_generation_cpus(config, device)
    options = _engine_options(config)
    size = _check_tensor_parallel(config)
    if size > 1:
        options["tensor_parallel_size"] = size
    model_config = upcycled_config(model_config, config.model)  # upcycled at start-up: the engine's copy too
    _check_capacity(config)
    with _naming_the_backend_field():
        check_engine(r.engine, model_config, device=device, dtype=config.model.dtype if r.dtype is None else r.dtype,
                     attention_backend=attention_backend(r.attention_backend), **options)


def _engine_options(config) -> dict:
    """The engine options the job sets beyond the common arguments: `rollout.engine_options` as given,
    `cuda_graphs` only when on (so engines that do not know the option are built as before), and the paged engine's
    `adaptive_threads` (`runtime.adaptive_threads` unless `runtime.deterministic`).

    Raises:
        ValueError: `rollout.engine_options` naming a common argument (set through its own field)."""
    rollout = config.rollout
    common = {"pad_token_id", "policy_version", "dtype", "attention_backend", "cuda_graphs", "tp_group",
              "tensor_parallel_size", "adaptive_threads"}
    clash = sorted(common & set(rollout.engine_options))
    if clash:
        raise ValueError(f"rollout.engine_options: {clash[0]!r} is set through its own field (rollout.dtype, "
                         "rollout.attention_backend, rollout.cuda_graphs, rollout.tensor_parallel_size, "
                         "runtime.adaptive_threads), not as an engine option")
    adaptive = rollout.engine == "paged" and config.runtime.adaptive_threads and not config.runtime.deterministic
    return {**rollout.engine_options, **({"cuda_graphs": True} if rollout.cuda_graphs else {}),
            **({"adaptive_threads": True} if adaptive else {})}


def _check_tensor_parallel(config) -> int:
    """The job's tensor-parallel size (`Config.tensor_parallel_size`: `rollout.tensor_parallel_size` where the train
    type reads it, else 1); ValueError (one line) when it is > 1 with an engine other than `paged` (the one that
    splits its copy over a tensor-parallel group, astrai.rollout.tensor_parallel)."""
    size, engine = config.tensor_parallel_size, config.rollout.engine
    if size > 1 and engine != "paged":
        raise ValueError(f"rollout.tensor_parallel_size: {size} needs rollout.engine 'paged' (the engine that splits "
                         f"its copy over the group), got {engine!r}")
    return size


def _check_capacity(config) -> None:
    """ValueError when the paged engine's `rollout.engine_options.max_kv_tokens` cannot hold one sequence of the job
    (its longest prompt plus its response budget), which would stop the first rollout (another engine judges its own
    options)."""
    kv = config.rollout.engine_options.get("max_kv_tokens")
    need = config.data.max_prompt_length + config.rollout.max_new_tokens
    if config.rollout.engine == "paged" and isinstance(kv, int) and not isinstance(kv, bool) and kv < need:
        raise ValueError(f"rollout.engine_options.max_kv_tokens: {kv} cannot hold one sequence of "
                         f"data.max_prompt_length + rollout.max_new_tokens = {need} tokens")


@contextlib.contextmanager
def _naming_the_backend_field():
    """A backend refusal that names no field (the kernels' own messages) is said of `rollout.attention_backend`
    (or of `ASTR_BACKEND` when that variable chose the backend)."""
    try:
        yield
    except BackendUnavailableError as err:
        if str(err).startswith("rollout."):
            raise
        field = ATTENTION_BACKEND_ENV if os.environ.get(ATTENTION_BACKEND_ENV) else "rollout.attention_backend"
        raise BackendUnavailableError(f"{field}: {err}") from None
