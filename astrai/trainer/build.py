"""Build a ready-to-fit `Trainer` from a validated config: runtime, process state, model, learner,
callbacks, and the checkpoint parts of the job (saved by the checkpoint callback, restored on resume). The train
type's own pieces (builder, data, step sizes, manifest fields, resume rule) come from its record in the registry
(`astrai.train_types`)."""

from __future__ import annotations

import hashlib
import os
import random
import sys
import warnings
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from astrai import train_types
from astrai.checkpoint import GlobalRNGState, Part, checkpoints_root, load_model, publish_checkpoint, recover
from astrai.checkpoint.fsutil import nearest_existing, write_atomic
from astrai.config import Config, config_to_dict, dump_config
from astrai.cpu_threads import ThreadGovernor, adaptive_threads
from astrai.data.limits import check_model_limits
from astrai.data.prompt_format import check_job_prompt_format
from astrai.distributed import run_device, setup_distributed
from astrai.distributed.context import check_mesh
from astrai.distributed.launch import check_step_sizes, resolve_launch
from astrai.distributed.rank_checks import check_ranks_agree
from astrai.models.moe import upcycled_config
from astrai.outputs import OutputWriteError
from astrai.rollout.engine import engine_factory
from astrai.trainer.callbacks import (CheckpointCallback, CompletionsLogger, ExperienceEnd, MetricsLogger,
                                      ProgressBar, StepTimer)
from astrai.trainer.evaluation_callback import build_evaluation, load_eval_records
from astrai.experience.build import (load_job_environment, load_job_tools, unanswered_tool_calls,
                                    uncorrected_dtype_mismatch)
from astrai.rewards.build import build_rewards
from astrai.rollout.build import check_rollout_engine
from astrai.rollout.remote import RemoteEngineError
from astrai.runtime_env import checked_threads
from astrai.trainer.faults import GenerationProcessFault, StepBoundary, StopSignals
from astrai.trainer.lora import lora_summary
from astrai.checkpoint.lock import OutputDirLock, OutputDirLocked
from astrai.trainer.loop import Trainer, TrainerState
from astrai.trainer.reporting import build_reporters
from astrai.trainer.memory_plan import parameter_count, planned_job
from astrai.trainer.models import apply_model_options, check_teacher_routes, load_teachers, local_teacher_configs
from astrai.trainer.learners.topk_distill import check_top_k
from astrai.trainer.resume import check_resume, restore
from astrai.trainer.resume_changes import ConfiguredSchedule, config_changes
from astrai.trainer.resume_changes import describe as describe_changes
from astrai.trainer.runs import record_run, resolve_run

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def training_threads(config: Config, dist) -> Optional[ThreadGovernor]:
    """The trainer's `ThreadGovernor` (`astrai.cpu_threads`) on a CPU with `runtime.adaptive_threads` and without
    `runtime.deterministic`; None otherwise (and where the system cannot report the load, said once)."""
    if dist.device.type != "cpu" or not config.runtime.adaptive_threads:
        return None
    if config.runtime.deterministic:
        if torch.get_num_threads() > 1 and dist.is_main:
            print(f"runtime.deterministic: the job keeps {torch.get_num_threads()} threads even while other processes "
                  "busy the cores (runtime.adaptive_threads is off in bitwise runs: a thread count changes float "
                  "rounding)", file=sys.stderr, flush=True)
        return None
    online = train_types.get(config.train.type).online
    metrics = "rollout/engine_threads and policy/threads" if online else "policy/threads"
    return adaptive_threads("the training step" + (" (rollout, scoring, updates)" if online else ""), "runs",
                            metrics)


def apply_runtime(config: Config) -> None:
    """Thread count, determinism and seeds from `config.runtime` / `config.train.seed`."""
    if config.runtime.num_threads:
        torch.set_num_threads(checked_threads(config.runtime.num_threads, "runtime.num_threads"))
    if config.runtime.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    seed_everything(config.train.seed)


def check_job_step_sizes(config: Config, strategy: str, deepspeed_config, world_size: int) -> None:
    """The job's optimizer step (its train type's `TrainType.step_sizes`) against the DeepSpeed launch settings in
    `os.environ` and `deepspeed_config` for `world_size` ranks (`launch.check_step_sizes`; raises LaunchError)."""
    micro_batch_size, accumulation_steps = train_types.get(config.train.type).step_sizes(config)
    check_step_sizes(os.environ, strategy=strategy, deepspeed_config=deepspeed_config,
                     micro_batch_size=micro_batch_size, accumulation_steps=accumulation_steps,
                     max_grad_norm=config.optim.max_grad_norm, world_size=world_size)


def _dangling_link(output_dir: Path, subdirs: tuple[str, ...]) -> Optional[Path]:
    """The first symbolic link whose target does not exist among `output_dir`, its ancestors up to the nearest
    existing one, and its `subdirs`; None when there is none."""
    for place in (output_dir, *output_dir.parents):
        if place.exists():
            break
        if place.is_symlink():
            return place
    return next((output_dir / sub for sub in subdirs
                 if (output_dir / sub).is_symlink() and not (output_dir / sub).exists()), None)


def checked_output_dir(path: str, subdirs: tuple[str, ...] = ()) -> Path:
    """`train.output_dir` as a Path, when it is a directory or can become one (its nearest existing ancestor is a
    directory) and each of its `subdirs` the job writes into (e.g. "eval") is a directory or absent.

    A symbolic link to a missing path on the way (the directory itself, an ancestor, or one of `subdirs`) is
    refused rather than followed: `mkdir -p` cannot create a directory through it either, and its target is often
    a filesystem that is not mounted, where creating it would write onto the one below.

    Raises:
        NotADirectoryError: one line naming the field and the file in the way, or the dangling link and its target.
    """
    output_dir = Path(path)
    link = _dangling_link(output_dir, (*subdirs, "checkpoints"))
    if link is not None:
        target = Path(link.parent, os.readlink(link))  # a relative target is relative to the link's directory
        raise NotADirectoryError(f"train.output_dir: {link} is a symbolic link to {target}, which does not exist; "
                                 f"create it (mkdir -p {target}) or choose another --train.output_dir")
    for sub in subdirs:
        if (output_dir / sub).exists() and not (output_dir / sub).is_dir():
            raise NotADirectoryError(f"train.output_dir: {output_dir / sub} is a file, not a directory (the job "
                                     f"writes its {sub}/ files there)")
    place = nearest_existing(output_dir)
    if place is not None and not place.is_dir():
        raise NotADirectoryError(f"train.output_dir: {place} is a file, not a directory"
                                 + (f" (needed for {output_dir})" if place != output_dir else ""))
    return output_dir


def output_subdirs(config: Config) -> tuple[str, ...]:
    """The directories under `train.output_dir` the job writes files into, besides `checkpoints/`."""
    return ("eval",) if config.train.eval_steps else ()


def job_parts(trainer: Trainer, tokenizer, config_text: str) -> dict[str, Part]:
    """Every checkpoint part of the job, in restore order: the learner's parts, the tokenizer (export), the
    resolved job config (`config.yaml`, export), the counters (`trainer_state`) and, last, this process's global
    RNGs (`rng_state`, per rank)."""
    return {**trainer.learner.checkpoint_parts(), "tokenizer": Part(tokenizer, "hf_tokenizer", required=False),
            "config": Part(config_text, "yaml", required=False), "trainer_state": Part(trainer.state, "json"),
            "rng_state": Part(GlobalRNGState(), per_rank=True)}


def build_trainer(config: Config, signals: Optional[StopSignals] = None) -> Trainer:
    """Everything `python -m astrai.train` needs, wired together.

    Checks that every rank sees the same job and output directory (`rank_checks.check_ranks_agree`, several ranks),
    takes the output directory's lock (`checkpoint.lock`, rank 0: one job per directory), cleans up after a crashed
    publish (main process), resolves the run (`trainer.runs`: a fresh start in a directory holding checkpoints
    needs `train.overwrite_output_dir`; a restarted job resumes itself), checks the length budgets and vocabulary
    against the model (`data.limits`), plans the memory per rank (`memory_plan.planned_job`: its table printed by
    the main process, a job that cannot fit refused in one line naming a setting that would), resumes when `checkpoint.resume` says so (applying and listing the config
    changes that may change, `resume_changes`), and writes the resolved config to `<output_dir>/config.yaml` and
    the run id to `<output_dir>/run.json` once everything has been built (a start that fails leaves the
    directory's run as it was, and its lock released).

    Args:
        signals: the stop-signal handlers of this process (`faults.StopSignals`, installed by the caller); None: a
            signal ends the process as usual.

    Raises:
        FileNotFoundError / ValueError / CheckpointError: from model, data or checkpoint loading, with
            one-line messages naming the path; `LaunchError` (a ValueError) for a launch mode astrai cannot
            honour (`distributed.launch`); `RanksDisagree` and `OutputDirLocked` (ValueErrors) from the checks above.
    """
    apply_runtime(config)
    dist = setup_distributed(config.runtime.device, config.distributed.strategy,
                             mixed_precision=config.train.mixed_precision,
                             timeout_seconds=config.distributed.timeout_seconds,
                             tensor_parallel_size=config.tensor_parallel_size,
                             stop_requested=(lambda: signals.requested) if signals is not None else None)
    check_job_step_sizes(config, dist.strategy, dist.deepspeed_config, dist.world_size)
    reporters = build_reporters(config.train.report_to, config.train.output_dir, config_to_dict(config),
                                enabled=dist.is_main)  # train.report_to; fails before the model loads
    output_dir = checked_output_dir(config.train.output_dir, output_subdirs(config))
    config_text = dump_config(config)
    if dist.world_size > 1:
        dist.peers = check_ranks_agree(dist, output_dir, hashlib.sha256(config_text.encode()).hexdigest())
    lock = _lock_output_dir(output_dir, dist)
    try:
        trainer = _build(config, dist, output_dir, config_text, reporters, signals, lock)
    except BaseException:
        lock.release()
        raise
    trainer.lock = lock
    return trainer


def _quiet(message: str) -> None:
    """A log that prints nothing (ranks other than the main one)."""


def _lock_output_dir(output_dir: Path, dist) -> OutputDirLock:
    """Rank 0 takes the output directory's lock; every rank raises `OutputDirLocked` when it is held elsewhere, and
    `OutputWriteError` when rank 0 cannot write the lock file (a full disk, a read-only filesystem)."""
    lock = OutputDirLock(output_dir)
    refused, note = None, None
    if dist.is_main:
        try:
            note = lock.acquire(None)
        except (OutputDirLocked, OutputWriteError) as err:
            refused = (type(err) is OutputWriteError, str(err))
    refused = dist.broadcast_object(refused)
    if refused is not None:
        lock.release()
        if refused[0]:
            raise OutputWriteError.carried(refused[1])
        raise OutputDirLocked(refused[1])
    if note is not None:
        print(f"{note}; this job takes over")
    return lock


def _build(config: Config, dist, output_dir: Path, config_text: str, reporters, signals,
           lock: OutputDirLock) -> Trainer:
    """`build_trainer` once the directory is this job's (`lock`, held by rank 0): recovery, the run (whose id the
    lock then records), the model, the learner, the resume and the callbacks. Says once (rank 0) when prompts are
    raw text because the tokenizer has no chat template."""
    if dist.is_main and checkpoints_root(output_dir).is_dir():
        recover(output_dir)
    dist.barrier()
    resume_from, run_id = resolve_run(config.checkpoint.resume, output_dir,
                                      overwrite=config.train.overwrite_output_dir, dist=dist)
    lock.name_run(run_id)  # rank 0's record (other ranks hold nothing): a job refused now names the run
    if resume_from is not None:  # refused before anything loads (restore() checks again, with sha256 if asked)
        check_resume(resume_from, config=config, world_size=dist.world_size, strategy=dist.strategy)
    if train_types.get(config.train.type).reads_rollout("engine"):  # an unknown rollout.engine, before loading
        engine_factory(config.rollout.engine)
    policy, tokenizer = _load_policy(config, hashes=config.checkpoint.verify_on_load)
    check_model_limits(config, policy.config, tokenizer)
    memory, memory_note = planned_job(config, policy.config, strategy=dist.strategy, world_size=dist.world_size,
                                      device=dist.device, local_world_size=_local_world_size(1))  # or refused
    if dist.is_main:
        print(memory.table() + (f"\n{memory_note}" if memory_note else ""))
    check_job_prompt_format(config, tokenizer, say=print if dist.is_main else _quiet)  # data.chat_template
    policy.train()
    policy.gradient_checkpointing = config.model.gradient_checkpointing
    spec = train_types.get(config.train.type)
    try:
        learner = spec.build(config, dist, apply_model_options(config, policy), tokenizer)
    except RemoteEngineError as err:  # the generation process could not start: one line
        raise GenerationProcessFault(str(err)) from None
    boundary = StepBoundary(signals or StopSignals(rank=dist.rank), save_minutes=config.checkpoint.save_minutes,
                            max_minutes=config.train.max_minutes, is_main=dist.is_main)
    trainer = Trainer(learner, dist=dist, max_steps=config.train.max_steps, max_grad_norm=config.optim.max_grad_norm,
                      state=TrainerState(run_id=run_id), boundary=boundary,
                      max_nonfinite_steps=config.train.max_nonfinite_steps, threads=training_threads(config, dist))
    resized = changes = None
    if resume_from is not None:
        parts = job_parts(trainer, tokenizer, config_text)
        schedule = ConfiguredSchedule().capture(parts)
        resized = restore(parts, resume_from, rank=dist.rank, config=config, verify=config.checkpoint.verify_on_load,
                          world_size=dist.world_size, strategy=dist.strategy)
        schedule.apply()
        changes = describe_changes(config_changes(resume_from, config), resume_from, trainer.state.global_step)
    trainer.callbacks = _callbacks(config, dist, output_dir, trainer, tokenizer, config_text, reporters, run_id,
                                   resume_from, spec.manifest_fields(config, policy.config))
    _write_run_files(config, dist, output_dir, config_text, run_id, resume_from)
    if dist.is_main:
        _say_start(config, trainer, resume_from, resized, changes)
    return trainer


def _write_run_files(config: Config, dist, output_dir: Path, config_text: str, run_id: str,
                     resume_from: Optional[Path]) -> None:
    """Rank 0 writes `<output_dir>/config.yaml` (atomically) and run.json (`runs.record_run`); when either cannot be
    written, every rank raises the same `OutputWriteError` (one broadcast), and no torn file is left."""
    line = None
    if dist.is_main:
        path = output_dir / "config.yaml"
        try:
            try:
                output_dir.mkdir(parents=True, exist_ok=True)
                write_atomic(path, config_text)
            except OSError as err:
                raise OutputWriteError.of(path, err) from None
            record_run(output_dir, run_id, resume_from=resume_from, resume=config.checkpoint.resume, dist=dist)
        except OutputWriteError as err:
            line = str(err)
    line = dist.broadcast_object(line)
    if line is not None:
        raise OutputWriteError.carried(line)


def _load_policy(config: Config, *, hashes: bool, shapes_only: bool = False):
    """`model.path` loaded by `astrai.checkpoint.load_model` (a published checkpoint's model files checked against
    its manifest first: sha256 with `hashes`); a missing path named as `model.path`.

    Raises:
        FileNotFoundError / NotADirectoryError: "model.path: ..."; ValueError: as `load_pretrained`.
    """
    try:
        return load_model(config.model.path, hashes=hashes, dtype=DTYPES[config.model.dtype],
                          revision=config.model.revision, shapes_only=shapes_only)
    except (FileNotFoundError, NotADirectoryError) as err:
        raise type(err)(f"model.path: {err}") from None


def _callbacks(config: Config, dist, output_dir: Path, trainer: Trainer, tokenizer, config_text: str, reporters,
               run_id: str, resume_from: Optional[Path], manifest_fields: dict) -> list:
    """The job's callbacks, in order: evaluation, timing, metrics, completions (`train.log_completions` > 0; they
    reach the reporters too), progress, checkpoints, the experience source's end, reporters."""
    resume_step = None if resume_from is None else trainer.state.global_step
    logger = MetricsLogger(output_dir, logging_steps=config.train.logging_steps, enabled=dist.is_main,
                           resume_step=resume_step)
    logs = [logger]
    if config.train.log_completions:
        logs.append(CompletionsLogger(output_dir, enabled=dist.is_main, resume_step=resume_step, reporters=reporters))

    def flush_logs() -> None:  # before a checkpoint: the logs never lag behind it
        for log in logs:
            log.flush()

    def save(trainer: Trainer) -> None:
        publish_checkpoint(
            output_dir, trainer.state.global_step, job_parts(trainer, tokenizer, config_text),
            metadata={"policy_version": trainer.state.policy_version, "train_type": config.train.type,
                      "distributed_strategy": dist.strategy, **manifest_fields},
            world_size=dist.world_size, dist=dist if dist.world_size > 1 else None,
            keep_last=config.checkpoint.keep_last, run_id=run_id, timeout_s=config.distributed.timeout_seconds)

    evaluation = build_evaluation(config, dist, trainer.learner, tokenizer)  # None unless train.eval_steps > 0
    return [
        *([evaluation] if evaluation is not None else []),  # first: its eval/* metrics reach the logger
        StepTimer(), *logs, ProgressBar(enabled=dist.is_main and config.train.progress_bar),
        CheckpointCallback(save, save_steps=config.checkpoint.save_steps,
                           save_at_end=config.checkpoint.save_at_end, before_save=flush_logs,
                           saved_step=-1 if resume_from is None else trainer.state.global_step),
        ExperienceEnd(),  # after the final checkpoint, which saves the episodes in flight
        *reporters,
    ]


def _say_start(config: Config, trainer: Trainer, resume_from: Optional[Path], resized: Optional[str],
               changes: Optional[str]) -> None:
    """Rank 0's start-up lines: the resume and its config changes, and when checkpoints will be written."""
    state = trainer.state
    if resume_from is not None:
        print(f"resuming from {resume_from} (step {state.global_step}, policy_version {state.policy_version})")
        for line in (resized, changes):
            if line is not None:
                print(line)
        if state.global_step >= config.train.max_steps:
            print(f"nothing to train: the checkpoint is at step {state.global_step} and train.max_steps is "
                  f"{config.train.max_steps}; raise --train.max_steps to train on")
    plan = checkpoint_plan(config)
    if plan is not None and state.global_step < config.train.max_steps:
        print(plan)


def checkpoint_plan(config: Config) -> Optional[str]:
    """The start-up line about checkpoints when none is written every N steps (`checkpoint.save_steps` 0), else None:
    every `checkpoint.save_minutes` of training, or, without that, none before the end; a stop signal and
    `train.max_minutes` (when set) each publish one too."""
    c, steps = config.checkpoint, config.train.max_steps
    if c.save_steps or steps <= 1:
        return None
    end = f"and after step {steps} (the end)" if c.save_at_end else "and none at the end (checkpoint.save_at_end false)"
    stop = "a stop signal (SIGTERM, SIGINT, SIGUSR1) also publishes one"
    if config.train.max_minutes is not None:
        stop += (f", and so does train.max_minutes {config.train.max_minutes:g} when it ends the run before step "
                 f"{steps}")
    if c.save_minutes is not None:
        return (f"checkpoints: every {c.save_minutes:g} minutes of training (checkpoint.save_minutes) {end}; {stop}; "
                "set checkpoint.save_steps for a checkpoint every N steps")
    return (f"checkpoints: none before step {steps} (checkpoint.save_steps 0, checkpoint.save_minutes null) {end}; "
            f"{stop}, a crash loses the run: set checkpoint.save_steps or checkpoint.save_minutes")


def check_job(config: Config, *, world_size: int) -> str:
    """Pre-flight: every check `build_trainer` makes before it trains, without creating a process group, an engine
    or an optimizer, in this one process: the launch mode (`distributed.strategy` against the accelerate launch
    environment in `os.environ`) and its precision, DeepSpeed step sizes for `world_size` ranks, the tensor-parallel
    groups (`rollout.tensor_parallel_size` dividing `world_size`), `train.report_to`,
    the output directory (not locked by another job) and `checkpoint.resume` (read only: nothing is written),
    `runtime.device`, the model (loaded on CPU; a directory without weights, config.json and tokenizer only, as its
    shapes on the meta device) and its length and vocabulary limits, the memory per rank (`memory_plan.planned_job`:
    its table follows the summary line; refused in one line when it cannot fit), the teacher of
    `distill.teacher` or every teacher of `distill.teachers` (loaded on CPU, its tokenizer the student's:
    `models.load_teachers`; the data's rows routed by `distill.route_field`, `models.check_teacher_routes`;
    `distill.jsd_top_k` against the teacher's vocabulary, `topk_distill.check_top_k`), how
    prompts are rendered (`data.chat_template` against the tokenizer, `prompt_format.check_job_prompt_format`: the
    raw-text line is said here too), the data as the train type will train on it, for online train types the rollout engine's settings on
    the run's device (`rollout.engine`, dtype, attention backend, CUDA graphs), the reward functions (imported and
    matched to the data's columns, in this process), the tools and environment classes of multi-turn episodes
    (`load_job_tools`, `load_job_environment`: imported, schemas, template, data columns), and the held-out data of `train.eval_steps`. Launch scripts run
    it before they start the ranks, so a refusal is one line with exit 2 instead of one line per rank followed by the
    launcher's traceback.

    Returns: a one-line summary of what was checked.
    Raises: the errors `build_trainer` raises for bad input (ValueError and its subclasses LaunchError,
        DataError; FileNotFoundError, NotADirectoryError, CheckpointError).
    """
    plan = resolve_launch(config.distributed.strategy, mixed_precision=config.train.mixed_precision, env=os.environ)
    check_job_step_sizes(config, plan.strategy, plan.deepspeed_config, world_size)
    config.generation_restarts_under(plan.strategy)  # the launch's strategy may shard the weights
    check_mesh(world_size, config.tensor_parallel_size)  # the (data x tensor) mesh the ranks would build
    build_reporters(config.train.report_to, config.train.output_dir, config_to_dict(config), enabled=False)
    output_dir = checked_output_dir(config.train.output_dir, output_subdirs(config))
    OutputDirLock(output_dir).check_free()  # another job training there: refused now, not after the launch
    resume_from, _ = resolve_run(config.checkpoint.resume, output_dir, overwrite=config.train.overwrite_output_dir,
                                 dist=None)
    if resume_from is not None:
        check_resume(resume_from, config=config, world_size=world_size, strategy=plan.strategy,
                     verify=config.checkpoint.verify_on_load)
    device = run_device(config.runtime.device)  # CUDA asked for where there is none
    spec = train_types.get(config.train.type)
    if spec.reads_rollout("engine"):  # an unknown rollout.engine, before the model loads
        engine_factory(config.rollout.engine)
    policy, tokenizer = _load_policy(config, hashes=False, shapes_only=True)  # sizes only; no weights needed
    check_model_limits(config, policy.config, tokenizer)
    check_job_prompt_format(config, tokenizer)  # data.chat_template against the tokenizer, said once
    teachers = load_teachers(config, tokenizer)  # each shares the student's tokenizer
    check_top_k(config, teachers)  # distill.jsd_top_k: local teachers with at least k tokens each
    memory, memory_note = planned_job(config, policy.config, strategy=plan.strategy, world_size=world_size,
                                      device=device, local_world_size=_local_world_size(world_size),
                                      teacher_configs=local_teacher_configs(teachers))  # refused if it cannot fit
    data = spec.load_data(config, policy.config, tokenizer, main=True)
    check_teacher_routes(config, data)  # distill.teachers: every row has a teacher
    if spec.online:  # the engine's settings on the run's device, and every reward function loaded and matched
        check_rollout_engine(config, policy.config, device)
        for said in (uncorrected_dtype_mismatch(config), unanswered_tool_calls(config)):
            if said:  # said by --check as by the run
                warnings.warn(said)
        build_rewards(config, data, num_workers=0).close()
        tools = load_job_tools(config, tokenizer, policy.config)[0] if config.rollout.tools else []
        if config.rollout.environment is not None:  # classes imported and checked against the data and the tools
            load_job_environment(config, tokenizer, policy.config, data, tools)
    if config.train.eval_steps:
        if not spec.online:  # the evaluation's own engine, which otherwise would first be built at step eval_steps
            check_rollout_engine(config, policy.config, device)
        load_eval_records(config, tokenizer)
    params = sum(p.numel() for p in policy.parameters())
    trained_config = upcycled_config(policy.config, config.model)
    upcycled = (f", upcycled to {parameter_count(trained_config) / 1e6:.1f}M with {trained_config.num_local_experts} "
                f"experts" if trained_config is not policy.config else "")
    start = f"resumes {resume_from}" if resume_from is not None else "starts fresh"
    counted = (f"packed rows of up to {config.data.max_length} tokens (data.packing)"
               if spec.packs and config.data.packing else "training examples")
    generating = ""
    if spec.online and config.rollout.placement == "separate":
        count = config.rollout.generation_processes
        generating = (f", rollouts in {count} generation process(es) per rank"
                      f"{' one step off' if config.rollout.max_off_policy_steps else ''}")
    return (f"check passed: {config.train.type} on {world_size} process(es) with {plan.strategy} "
            f"({plan.mixed_precision} mixed precision){generating}; model {config.model.path} "
            f"({params / 1e6:.1f}M parameters{upcycled})"
            f"{lora_summary(config, policy)}; {len(data)} {counted} from {data_source(config)}; {start} in "
            f"{output_dir}\n{memory.table()}" + (f"\n{memory_note}" if memory_note else ""))


def _local_world_size(world_size: int) -> int:
    """Ranks sharing this node's memory: LOCAL_WORLD_SIZE when a launcher set it, else all `world_size` (--check
    runs before the launch: planned as if every rank were here)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    except ValueError:
        return world_size


def data_source(config) -> str:
    """How the start-up and `--check` lines name the job's training data: `data.path`, or the files of
    `data.mixture` with their weights."""
    if not config.data.mixture:
        return config.data.path
    return "data.mixture (" + ", ".join(f"{f.path} x {f.weight:g}" for f in config.data.mixture) + ")"
