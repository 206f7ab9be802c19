"""Pre-flight for `accelerate launch`: `python -m astrai.distributed.preflight [accelerate launch options] -m
astrai.train --config JOB [overrides]` checks the job as its ranks would see it, in this one process, without
starting them (it becomes `python -m astrai.train --check ...` with the ranks' environment:
`astrai.trainer.build.check_job`).

Why: a job that `accelerate launch` starts and that refuses bad input (an unsupported launch mode, a DeepSpeed
setting contradicting the job, a missing data file) prints its one-line error on every rank, and then the
launcher prints its own `ChildFailedError` traceback and exits 1. The launch scripts (`launch/accelerate.sh`,
`torchrun.sh`, `deepspeed.sh`) run this first, so the user gets the one line and exit 2.

The launch environment the ranks would get (`ACCELERATE_USE_DEEPSPEED`, `ACCELERATE_DEEPSPEED_ZERO_STAGE`,
`FSDP_VERSION`, `ACCELERATE_MIXED_PRECISION` ...) is computed by Accelerate's own launch code from the same
options and config file (`accelerate.commands.launch`), and `WORLD_SIZE` is the launch's process count.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from typing import Optional, Sequence

EXIT_BAD_INPUT = 2


def launch_environment(launch_args: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """The environment `accelerate launch LAUNCH_ARGS` gives its ranks, and the script's own arguments.

    Args:
        launch_args: what follows `accelerate launch`, e.g. `["--config_file", "configs/zero/zero2.yaml", "-m",
            "astrai.train", "--config", "job.yaml"]`.

    Returns:
        (the full environment with the launcher's variables and `WORLD_SIZE` set, the arguments after the
        script or module name).

    Raises:
        ValueError: one line, for options or a config file that Accelerate refuses.
    """
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import (
        prepare_deepspeed_cmd_env,
        prepare_multi_gpu_env,
        prepare_simple_launcher_cmd_env,
    )

    parser = launch_command_parser()
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said), contextlib.redirect_stdout(said):  # argparse's usage and help text
            args = parser.parse_args(list(launch_args))
        args, defaults, mixed_precision_from_config = _validate_launch_command(args)
    except SystemExit:
        lines = [line for line in said.getvalue().splitlines() if "error: " in line]
        why = lines[-1].split("error: ", 1)[1] if lines else "see accelerate launch --help"
        raise ValueError(f"accelerate launch options: {why}") from None
    except (ValueError, OSError, KeyError) as err:
        raise ValueError(f"accelerate launch: {' '.join(str(err).split())}") from None
    if args.use_deepspeed and not args.cpu:
        fields = list(defaults.deepspeed_config) if defaults is not None else []
        if mixed_precision_from_config:
            fields.append("mixed_precision")
        args.deepspeed_fields_from_accelerate_config = ",".join(fields)
        _, env = prepare_deepspeed_cmd_env(args)
    elif (args.use_fsdp or args.multi_gpu) and not args.cpu:
        env = prepare_multi_gpu_env(args)
    else:
        _, env = prepare_simple_launcher_cmd_env(args)
    env = {**os.environ, **env, "WORLD_SIZE": str(args.num_processes or 1)}
    return env, list(args.training_script_args)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Check the job that `accelerate launch ARGV` would start; returns the exit code (0 ok, 2 refused)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        env, script_args = launch_environment(argv)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    # the check runs in this process's place (its exit code is the preflight's), as `python -m astrai.train
    # --check` with the ranks' environment: the launcher's layer, not a caller of the trainer
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "astrai.train", "--check", *script_args], env)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
