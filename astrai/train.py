"""Entry point: `python -m astrai.train --config FILE [--section.key VALUE ...]`, and `from astrai import train` for
notebooks and scripts (`train("job.yaml", max_steps=2, reward_funcs=[my_reward])`, see `fit`).

Also runs under `accelerate launch -m astrai.train ...`. Parses the config, exports `runtime.environment`
(`astrai.runtime_env`), builds the trainer, fits.
Bad input (config, model path, data file) exits with code 2 and a one-line error; the faults of a running job have
their own codes and one line each (`astrai.trainer.faults`, docs/launch.md "When things go wrong").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence, Union

from astrai.outputs import show_warning as _show_warning  # the command line's (set in __main__ below)

if TYPE_CHECKING:
    from astrai.config import ConfigError

EXIT_BAD_INPUT = 2


def fields_help() -> str:
    """One line per config field: `--section.key  meaning (default: value)`, for `--help`."""
    import dataclasses

    from astrai.config import ALIASES, REFUSED_NAMES, SECTIONS

    lines = ["config fields (YAML section.key; override with --section.key VALUE):"]
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            lines.append(f"  --{section}.{f.name:<30} {f.metadata.get('doc', '')} (default: {default!r})")
    lines.append("names from transformers, TRL, verl and OpenRLHF with the same meaning (docs/names.md):")
    lines += [f"  --{alias:<37} = --{section}.{name}" for alias, (section, name) in ALIASES.items()]
    lines.append("their names with another meaning, refused with what to set instead:")
    lines += [f"  --{name:<37} {why}" for name, why in REFUSED_NAMES.items()]
    return "\n".join(lines)


def parse_args(argv: Optional[Sequence[str]] = None) -> tuple[argparse.Namespace, list[str]]:
    """`--config FILE` plus free-form overrides (`--ppo_gamma 0.99`, `--ppo.gamma=0.99`, `--max_steps 2`)."""
    from astrai import train_types

    parser = argparse.ArgumentParser(
        prog="python -m astrai.train", allow_abbrev=False, epilog=fields_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=f"Train a decoder-only LM ({', '.join(train_types.names())}). Any config field can be "
                    "overridden with --section.key VALUE, --section_key VALUE or a unique --key VALUE.")
    parser.add_argument("--config", default=None, help="YAML job file (default: built-in defaults)")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None,
                        help="this process's rank on its node, as the deepspeed launcher passes it (LOCAL_RANK in "
                             "the environment wins)")
    parser.add_argument("--check", action="store_true",
                        help="check the job (config, launch mode, step sizes, output directory, model limits, data) "
                             "in this process without training; exit 0 when it would start, 2 with one line when "
                             "not. The number of ranks is WORLD_SIZE (default 1)")
    return parser.parse_known_args(argv)


OWN_OPTIONS = ("check", "config", "local_rank", "help")
"""The command line's own options (`parse_args`), not config fields."""


def _own_option_hint(err: ConfigError) -> str:
    """`err`'s line, or for an unknown key that no config field resembles but one of `OWN_OPTIONS` does (`--chek`),
    a line that names the option: such a typo is otherwise taken for a config override."""
    import difflib
    import re

    unknown = re.fullmatch(r"unknown key '([^'.]+)'", str(err))
    close = difflib.get_close_matches(unknown.group(1), OWN_OPTIONS, n=1, cutoff=0.75) if unknown else []
    return f"unknown option '--{unknown.group(1)}' (did you mean '--{close[0]}'?)" if close else str(err)


_ENDED: dict[str, Any] = {}
"""How this process's job ended besides its code: `line` (its one-line error), `said` (this process prints it),
`agreed` (every rank ended with it at the same point), `handed_over` (the launch scripts have the code: see `main`)."""


def _error(err, *, said: bool = True, agreed: bool = False) -> None:
    """The job ends with the one line `error: ERR`; printed to stderr by `main` where `said` (unless it goes to the
    launch scripts instead)."""
    _ENDED.update(line=f"error: {' '.join(str(err).split())}", said=said, agreed=agreed)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run one training job; returns the process exit code, after printing the job's one-line error (if any).

    Under the launch scripts (`launch/*.sh`, which set `ASTRAI_EXIT_FILE`), rank 0 also writes the code and that
    line to the file, and the script exits with the code and prints the line last, after anything the launcher
    said: the launcher's own code hides the ranks' (torchrun exits 1 when a rank exits non-zero, `accelerate launch`
    128 + N after signal N). When every rank ends at the same point (an agreed fault, a stop signal, one process)
    and the launcher would not restart the ranks (no torchrun restart left), the line is left to the script and the
    process exits 0 (`__main__`; the first rank of every other node writes the file too), so the launcher adds no
    failure report of its own (`ChildFailedError` and its banner) and the script's output ends with the line once.
    Otherwise the line is also printed at once and, under torchrun, written to the worker's error file, which the
    launcher's report names as the root cause."""
    _ENDED.clear()
    code = _main(argv)
    env = os.environ
    exit_file, line = env.get("ASTRAI_EXIT_FILE"), _ENDED.get("line")
    handing_over = bool(exit_file) and code != 0 and _no_restart_left(env) and (
        _ENDED.get("agreed", False) or code == 75 or int(env.get("WORLD_SIZE", "1")) == 1)
    writes = bool(exit_file) and (env.get("RANK", "0") == "0" or (handing_over and env.get("LOCAL_RANK") == "0"))
    wrote = writes and _write_exit_file(Path(exit_file), code, line)
    _ENDED["handed_over"] = handing_over and (wrote or not writes)
    if line and _ENDED.get("said") and not _ENDED["handed_over"]:  # else the script prints it
        print(line, file=sys.stderr)
        _tell_torchelastic(line)
    return code


def _tell_torchelastic(line: str) -> None:
    """Under a bare torchrun (or `accelerate launch` on several processes), write the one-line error to the worker's
    error file (TORCHELASTIC_ERROR_FILE), so that the launcher's failure report names it as the root cause instead
    of a link to its documentation."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        Path(path).write_text(json.dumps({"message": {"message": line, "extraInfo": {
            "py_callstack": line, "timestamp": str(int(time.time()))}}}))
    except OSError:
        pass


def _no_restart_left(env) -> bool:
    """Whether a launcher would not start the ranks again after this exit (torchrun's `--max-restarts` used up)."""
    try:
        return int(env.get("TORCHELASTIC_RESTART_COUNT", "0")) >= int(env.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    except ValueError:
        return False


def _write_exit_file(path: Path, code: int, line: Optional[str]) -> bool:
    """Replace `path` with the job's code and one-line error (one line each; whole or not at all); False when it
    cannot be written (then the launcher's own code and this process's line stand)."""
    from astrai.checkpoint.fsutil import write_atomic

    try:
        write_atomic(path, f"{code}\n" + (f"{line}\n" if line else ""))
    except OSError:
        return False
    return True


def _main(argv: Optional[Sequence[str]]) -> int:
    from astrai.config import ConfigError, ignored_settings, load_config, why_ignored

    from astrai.runtime_env import job_runtime

    args, overrides = parse_args(argv)
    if args.local_rank is not None and "WORLD_SIZE" in os.environ:  # a launcher that passes only the argument
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))
    try:
        config = load_config(args.config, overrides)
    except ConfigError as err:
        _error(_own_option_hint(err))
        return EXIT_BAD_INPUT
    if os.environ.get("RANK", "0") == "0":
        reasons: dict[str, list[str]] = {}
        for name in ignored_settings(config):
            reasons.setdefault(why_ignored(config, name), []).append(name)
        for why, names in reasons.items():
            print(f"warning: {', '.join(names)} {'has' if len(names) == 1 else 'have'} no effect on this job "
                  f"({why})", file=sys.stderr)
    job = contextlib.ExitStack()
    try:  # runtime.environment is exported before build_trainer creates the process group
        job.enter_context(job_runtime(config.runtime.environment))
    except ValueError as err:  # an unknown ASTR_LOG_LEVEL
        _error(err)
        return EXIT_BAD_INPUT
    with job:  # and restored when the job ends
        return _check(config) if args.check else _run(config)


def _bad_input_errors() -> tuple[type[BaseException], ...]:
    """The exception types that mean bad input (exit 2 with their one-line message)."""
    from astrai.checkpoint import CheckpointError
    from astrai.data import DataError
    from astrai.kernels import BackendUnavailableError

    return FileNotFoundError, NotADirectoryError, DataError, CheckpointError, ValueError, BackendUnavailableError


def _check(config) -> int:
    """`--check`: `build.check_job` for WORLD_SIZE ranks; returns the exit code."""
    from astrai.trainer.build import check_job

    try:
        print(check_job(config, world_size=int(os.environ.get("WORLD_SIZE", "1"))))
    except _bad_input_errors() as err:
        _error(err)
        return EXIT_BAD_INPUT
    return 0


def _where_to_resume(config) -> str:
    """Where a job that stopped on a fault resumes: its newest complete checkpoint, or none written yet."""
    from astrai.checkpoint.layout import find_latest_checkpoint

    latest = find_latest_checkpoint(config.train.output_dir)
    if latest is None:
        return "no checkpoint was written yet (checkpoint.save_steps), so a rerun starts over"
    return f"resume from {latest} (checkpoint.resume auto)"


def _run(config) -> int:
    """Build and fit the trainer for a loaded `Config`; returns the exit code (`astrai.trainer.faults`: 0 done,
    2 refused, 75 stopped by a signal before the last step after publishing a checkpoint (a signal during the last
    step: 0, the run is complete, said in one line), 124 a rank stopped answering)."""
    from astrai.distributed.context import end_process_group
    from astrai.trainer.build import build_trainer
    from astrai.outputs import OutputWriteError
    from astrai.trainer.faults import EXIT_PREEMPTED, GenerationProcessFault, JobFault, StopSignals

    start = time.perf_counter()
    rank = int(os.environ.get("RANK", "0"))
    signals = StopSignals(rank=rank).install()
    trainer = state = None
    try:
        trainer = build_trainer(config, signals)
        first = trainer.state.global_step  # > 0 on a resume
        state = trainer.fit()
        is_main = trainer.dist.is_main
    except _bad_input_errors() as err:
        _error(err, said=rank == 0 or not _agreed(err), agreed=_agreed(err))
        return EXIT_BAD_INPUT
    except (JobFault, OutputWriteError) as err:  # OutputWriteError: a file the job writes cannot be written
        if isinstance(err, GenerationProcessFault):
            err = GenerationProcessFault(f"{err}: {_where_to_resume(config)}")
        _error(err, said=rank == 0 or not getattr(err, "every_rank", True), agreed=err.agreed)
        return err.exit_code
    except RuntimeError as err:
        stalled = _stalled(config, trainer, err, rank)
        if stalled is None:
            raise
        return stalled
    finally:
        signals.restore()
        if trainer is not None:
            trainer.lock.release()
        trainer = None  # the models hold the process group: end_process_group destroys it once they are gone
        end_process_group(wait=state is not None)
    if is_main:
        ran = state.global_step - first
        steps = f"{ran} step{'' if ran == 1 else 's'}"
        steps += f" (resumed at step {first}, now at {state.global_step})" if first else ""
        if state.stopped_by is not None:
            saved = (f"with a checkpoint of step {state.global_step}" if ran else
                     "before its first step (nothing new to checkpoint)")
            launcher = ("" if "ASTRAI_EXIT_FILE" in os.environ or "TORCHELASTIC_RUN_ID" not in os.environ else
                        " (the ranks'; a bare launcher reports its own, e.g. accelerate 128 + the signal: "
                        "launch/accelerate.sh and launch/torchrun.sh exit with the ranks' code)")
            print(f"stopped by {state.stopped_by} after {steps}, {saved}; exit code {EXIT_PREEMPTED}{launcher}: "
                  f"resume with --checkpoint.resume auto (a requeued or restarted job does so itself); outputs in "
                  f"{config.train.output_dir}")
        elif state.out_of_time:
            print(f"stopped at train.max_minutes ({config.train.max_minutes:g} minutes of training) after {steps}, "
                  f"with a checkpoint of step {state.global_step}; policy_version {state.policy_version}, "
                  f"{time.perf_counter() - start:.1f} s; outputs in {config.train.output_dir}")
        else:
            print(f"done: {steps}, policy_version {state.policy_version}, "
                  f"{time.perf_counter() - start:.1f} s; outputs in {config.train.output_dir}")
            late = state.signal_at_end or signals.received
            if late is not None:
                print(_late_signal_line(late, state, config))
    return EXIT_PREEMPTED if state.stopped_by is not None else 0


def _late_signal_line(signal_name: str, state, config) -> str:
    """The line of a run that a stop signal reached during its last step (or its final checkpoint) and that
    completed anyway: the signal's handler promised exit code 75, the run ends with 0, since a finished run is not
    to be resumed or requeued (`faults.StopSignals`)."""
    from astrai.checkpoint import find_latest_checkpoint, parse_step
    from astrai.trainer.faults import EXIT_PREEMPTED

    latest = find_latest_checkpoint(config.train.output_dir, run_id=state.run_id)
    saved = (f"its final checkpoint {latest} is published" if latest is not None and
             parse_step(latest.name) == state.global_step else
             "no final checkpoint was asked for (checkpoint.save_at_end false)")
    return (f"{signal_name} received during the last step: the run completed it (step {state.global_step} of "
            f"train.max_steps {state.max_steps}) and {saved}; exit code 0, not {EXIT_PREEMPTED}: the run is "
            "complete, nothing to resume or requeue")


def _agreed(err: BaseException) -> bool:
    """Errors every rank raises alike, after a collective carried them (rank 0 alone prints them)."""
    from astrai.checkpoint.safety import AGREED_ERRORS
    from astrai.distributed.rank_checks import RanksDisagree
    from astrai.checkpoint.lock import OutputDirLocked

    return isinstance(err, (*AGREED_ERRORS.values(), RanksDisagree, OutputDirLocked)) or getattr(err, "agreed", False)


def _stalled(config, trainer, err: RuntimeError, rank: int):
    """The exit code of a collective that timed out (one line, from the lowest rank still running), else None."""
    from astrai.distributed.rank_checks import describe_stall, is_timeout
    from astrai.trainer.faults import EXIT_TIMEOUT

    if not is_timeout(err):
        return None
    dist = trainer.dist if trainer is not None else None
    if dist is None:
        _error(f"rank {rank}: a collective did not complete within distributed.timeout_seconds "
               f"{config.distributed.timeout_seconds:g} while the job started; the job stops")
        return EXIT_TIMEOUT
    line, silent = describe_stall(dist, config.distributed.timeout_seconds, err)
    alive = [r for r in range(dist.world_size) if r not in (silent or ())]
    _error(line, said=not alive or rank == alive[0])
    return EXIT_TIMEOUT


@dataclass(frozen=True)
class TrainResult:
    """What `fit` returns.

    Attributes:
        output_dir: the run's output directory (config.yaml, metrics.jsonl, checkpoints/).
        global_step: optimizer steps done; policy_version: the version of the final weights.
        checkpoint: the newest complete checkpoint directory, or None.
        metrics: the records of metrics.jsonl, one dict per logged step.
        stopped_by: the signal that stopped the run early, or None.
    """

    output_dir: Path
    global_step: int
    policy_version: int
    checkpoint: Optional[Path]
    metrics: list[dict]
    stopped_by: Optional[str]


def fit(config: Union[str, os.PathLike, Mapping[str, Any], None] = None, *,
        reward_funcs: Sequence[Callable] = (), **overrides: Any) -> TrainResult:
    """Train in this process, as `python -m astrai.train` does: `from astrai import train; train(...)` calls this.

    Args:
        config: a YAML job file, a sectioned mapping (`{"train": {"type": "online_grpo"}, ...}`) or None (defaults).
        reward_funcs: reward functions as callables, in TRL's convention (`fn(prompts, completions, **columns)`),
            added to `reward.functions` (weight 1, named after the function). One importable from a module runs in
            the reward workers like a configured one; one defined in a notebook or `__main__` runs in this process
            (no timeout).
        overrides: fields by any name the command line takes: `max_steps=2`, `num_generations=8`, or dotted names
            through a mapping (`**{"grpo.group_size": 4}`). `environment_factory` / `rollout.environment` and
            `tools` / `rollout.tools` also take what TRL's trainer takes, a class (or a mapping of them by name) and
            functions: each is named by its "module:qualname", which the worker processes import, so it must be
            importable from a module; one defined in a notebook, `__main__` or a function is refused (`ConfigError`
            naming the field: move it into a .py file and import it from there).

    Returns: a `TrainResult`.
    Raises: `astrai.config.ConfigError` and the other bad-input errors the CLI answers with exit code 2 (ValueError,
        FileNotFoundError, DataError, CheckpointError), `astrai.trainer.faults.JobFault` for a job that fails
        while it runs and `astrai.outputs.OutputWriteError` for a file it cannot write (metrics.jsonl on a full
        disk ...); nothing is swallowed.
    """
    from astrai.config import config_from_dict, config_to_dict, load_config
    from astrai.distributed.context import end_process_group
    from astrai.rewards.functions import reward_reference
    from astrai.runtime_env import job_runtime
    from astrai.trainer.build import build_trainer
    from astrai.trainer.faults import StopSignals

    overrides = {key: _python_objects(key, value) for key, value in overrides.items()}
    if isinstance(config, Mapping) and isinstance(config.get("rollout"), Mapping):
        config = {**config, "rollout": {key: _python_objects(f"rollout.{key}", value)
                                        for key, value in config["rollout"].items()}}
    tokens = []
    for key, value in overrides.items():
        tokens += [f"--{key}", value if isinstance(value, str) else json.dumps(value)]
    if isinstance(config, Mapping):
        job = config_from_dict(dict(config), tokens)
    else:
        job = load_config(None if config is None else str(config), tokens)
    if reward_funcs:  # after the configured functions (they replace the single reward.name, as configured ones do)
        data = config_to_dict(job)
        data["reward"]["functions"] += [{"function": reward_reference(fn)} for fn in reward_funcs]
        job = config_from_dict(data)
    signals = StopSignals(rank=int(os.environ.get("RANK", "0"))).install()
    trainer = state = None
    try:
        with job_runtime(job.runtime.environment):
            trainer = build_trainer(job, signals)
            state = trainer.fit()
    finally:
        signals.restore()
        if trainer is not None:
            trainer.lock.release()
        trainer = None  # the models hold the process group (end_process_group)
        end_process_group(wait=state is not None)
    output_dir = Path(job.train.output_dir)
    metrics_file = output_dir / "metrics.jsonl"
    records = []
    if metrics_file.is_file():  # a torn last line (a crash, a full disk) is skipped and said once
        import warnings

        from astrai.outputs import read_jsonl

        records = read_jsonl(metrics_file, say=lambda line: warnings.warn(line, stacklevel=3))
    steps = sorted((output_dir / "checkpoints").glob("step-*")) if (output_dir / "checkpoints").is_dir() else []
    return TrainResult(output_dir=output_dir, global_step=state.global_step, policy_version=state.policy_version,
                       checkpoint=steps[-1] if steps else None, metrics=records, stopped_by=state.stopped_by)


_ENVIRONMENT_KEYS = ("environment_factory", "rollout.environment", "rollout.environment_factory")
_TOOLS_KEYS = ("tools", "rollout.tools")


def _python_objects(key: str, value: Any) -> Any:
    """An override `value` of `fit` with the classes and functions TRL users pass (`environment_factory=Wordle`,
    `tools=[count]`) replaced by their "module:qualname" references (`_importable_reference`); any other value as
    it is. Raises ConfigError (via `_importable_reference`)."""
    if key in _ENVIRONMENT_KEYS:
        if isinstance(value, type):
            return _importable_reference(value, "rollout.environment")
        if isinstance(value, Mapping) and any(isinstance(v, type) for v in value.values()):
            return {route: _importable_reference(v, f"rollout.environment.{route}") if isinstance(v, type) else v
                    for route, v in value.items()}
    if key in _TOOLS_KEYS:
        items = [value] if callable(value) else value
        if isinstance(items, (list, tuple)) and any(callable(item) for item in items):
            return [{"function": _importable_reference(item, f"rollout.tools.{i}")} if callable(item) else item
                    for i, item in enumerate(items)]
    return value


def _importable_reference(obj: Any, field: str) -> str:
    """The "module:qualname" a worker process imports `obj` (a class or function handed to `fit`) by.

    Raises:
        ConfigError: one line naming `field` when that import would not give `obj` back (defined in a notebook,
            `__main__` or inside a function).
    """
    import importlib

    from astrai.config import ConfigError

    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    name = getattr(obj, "__name__", None) or type(obj).__name__
    if module and module != "__main__" and qualname and "<" not in qualname and "." not in qualname:
        try:  # the jobs' references name a module's top-level attribute (`astrai.imports.load_attribute`)
            if getattr(importlib.import_module(module), qualname, None) is obj:
                return f"{module}:{qualname}"
        except ImportError:
            pass
    where = ("a notebook or the __main__ script" if module == "__main__" or not module else
             "a function (a local)" if qualname and "<locals>" in qualname else
             "a class body" if qualname and "." in qualname else f"module {module}, under another name")
    raise ConfigError(f"{field}: {name} is defined in {where}, which the worker processes cannot import; move it "
                      "into a .py file and import it from there (or name it in the job by file: "
                      f"{{{'class' if isinstance(obj, type) else 'function'}: {name}, "
                      "path: file.py}) (docs/agents.md)")


class _CallableModule(types.ModuleType):
    """This module, callable: `from astrai import train; train("job.yaml", max_steps=2)` runs `fit`."""

    def __call__(self, config=None, **kwargs):
        return fit(config, **kwargs)


if __name__ == "__main__":
    import warnings

    warnings.showwarning = _show_warning
    try:
        _code = main()
    except BaseException as _err:  # noqa: BLE001 - printed as Python would, then the same exit path
        from astrai.distributed.context import had_process_group

        if isinstance(_err, SystemExit) or not had_process_group():
            raise
        import traceback

        traceback.print_exc()
        _code = 130 if isinstance(_err, KeyboardInterrupt) else 1
    from astrai.distributed.context import exit_process  # a rank: no interpreter finalization

    exit_process(0 if _ENDED.get("handed_over") else _code)  # handed over: the launch script exits with it
else:
    sys.modules[__name__].__class__ = _CallableModule
