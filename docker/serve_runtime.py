"""Host-side helper of `launch/serve.sh`: renders a job's `infra:` and `runtime:` sections for the `server` service.

    python3 docker/serve_runtime.py exports JOB.yaml [--env-file .env.serve] [--checkpoint DIR] [--port P]
        shell lines for `eval`: SERVE_JOB_NAME, SERVE_CHECKPOINT (host checkpoint directory), SERVE_MODEL_NAME,
        SERVE_PORT, SERVE_GPU_COUNT, CUDA_VISIBLE_DEVICES (unset for `gpus: all`), and the job's
        `runtime.environment` (for a server started on the host)
    python3 docker/serve_runtime.py project JOB.yaml [--env-file .env.serve]
        the job name (the server's compose project is astrai-<job_name>-serve)
    python3 docker/serve_runtime.py compose JOB.yaml [same options] [-- SERVER_ARGS...]
        a compose override (YAML on stdout) for the `server` service of docker/compose.yaml: the checkpoint
        mounted read-only at /checkpoint, `runtime.environment`, and the `python -m astrai.serve` command

`.env.serve` takes the infra keys of `.env.train` (TRAIN_JOB_NAME, TRAIN_CHECKPOINT_DIR, TRAIN_GPUS ...) plus
SERVE_CHECKPOINT and SERVE_PORT. The checkpoint is `--checkpoint` when given, else SERVE_CHECKPOINT from the env
file, else the newest complete checkpoint under the job's checkpoint directory (`infra.checkpoint_dir`, else
`train.output_dir`). The served model name is the job name. The port is `--port`, else SERVE_PORT from the env
file, else 8000. Errors are one line, exit 2.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional, Sequence

from jobfile import (JobError, dump_compose, export_lines, load_job, read_env_file, run_cli,
                     split_dashes)

from astrai.checkpoint.layout import find_latest_checkpoint
from astrai.runtime_env import render_environment

CHECKPOINT_TARGET, CONTAINER_PORT = "/checkpoint", 8000


def resolve(args: argparse.Namespace) -> tuple:
    """(infra, checkpoint path, port) for the parsed arguments; JobError when no checkpoint can be found."""
    infra = load_job(args.job_file, (), args.env_file)
    env = read_env_file(args.env_file)
    chosen = args.checkpoint or env.get("SERVE_CHECKPOINT")
    if chosen:
        checkpoint = Path(chosen).expanduser().resolve()
        if not checkpoint.is_dir():
            raise JobError(f"checkpoint directory not found: {checkpoint}")
    else:
        checkpoint = find_latest_checkpoint(infra.checkpoint_dir)
        if checkpoint is None:
            raise JobError(f"no complete checkpoint under {infra.checkpoint_dir}/checkpoints (train first, or "
                           f"pass --checkpoint DIR)")
    port = args.port if args.port is not None else env.get("SERVE_PORT", "8000")
    if not str(port).isdigit() or not 1 <= int(port) <= 65535:
        raise JobError(f"port: expected an integer in [1, 65535], got {port!r}")
    return infra, Path(checkpoint), str(int(port))


def exports(args: argparse.Namespace) -> dict[str, Optional[str]]:
    """The variables serve.sh exports (None = unset)."""
    infra, checkpoint, port = resolve(args)
    count, visible = infra.gpu_exports()
    return {**render_environment(infra.config.runtime.environment),
            "SERVE_JOB_NAME": infra.job_name, "SERVE_CHECKPOINT": str(checkpoint),
            "SERVE_MODEL_NAME": infra.job_name, "SERVE_PORT": port, "SERVE_GPU_COUNT": count,
            "CUDA_VISIBLE_DEVICES": visible}


def compose_override(args: argparse.Namespace) -> dict:
    """The `server` service override: checkpoint mount, environment, command."""
    infra, checkpoint, _ = resolve(args)
    service: dict = {}
    environment = render_environment(infra.config.runtime.environment)
    if environment:
        service["environment"] = environment
    service["volumes"] = [{"type": "bind", "source": str(checkpoint), "target": CHECKPOINT_TARGET,
                           "read_only": True}]
    service["command"] = ["python", "-m", "astrai.serve", "--checkpoint", CHECKPOINT_TARGET, "--host", "0.0.0.0",
                          "--port", str(CONTAINER_PORT), "--served_model_name", infra.job_name, *args.server_args]
    return {"services": {"server": service}}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command line (see the module docstring); returns the exit code (JobError: see `jobfile.run_cli`)."""
    parser = argparse.ArgumentParser(prog="docker/serve_runtime.py", description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("exports", "compose", "project"))
    parser.add_argument("job_file")
    parser.add_argument("--env-file", default=None, help="dotenv fallbacks (e.g. .env.serve)")
    parser.add_argument("--checkpoint", default=None, help="checkpoint directory to serve (default: the newest)")
    parser.add_argument("--port", default=None, help="host port (default: SERVE_PORT or 8000)")
    argv, after = split_dashes(argv)
    args = parser.parse_args(argv)
    args.server_args = after  # extra python -m astrai.serve arguments after --
    if args.what == "project":
        print(load_job(args.job_file, (), args.env_file).job_name)
    elif args.what == "exports":
        print(export_lines(exports(args)), end="")
    else:
        print(dump_compose(compose_override(args)), end="")
    return 0


if __name__ == "__main__":
    run_cli(main)
