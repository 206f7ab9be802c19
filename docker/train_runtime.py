"""Host-side helper of `launch/train.sh`: renders a job's `infra:` and `runtime:` sections for Docker Compose.

    python3 docker/train_runtime.py exports JOB.yaml [--env-file .env.train] [-- OVERRIDES...]
        shell lines for `eval`: TRAIN_JOB_NAME, TRAIN_JOB_FILE, TRAIN_DATA, TRAIN_MODEL, TRAIN_CHECKPOINT_DIR,
        TRAIN_GPU_COUNT, CUDA_VISIBLE_DEVICES (unset for `gpus: all`), TRAIN_TYPE and TRAIN_RESUME_CHECKPOINT
        (the host checkpoint an `auto` or explicit resume would load; empty when none)
    python3 docker/train_runtime.py compose JOB.yaml [--env-file .env.train] [-- OVERRIDES...]
        a compose override (YAML on stdout) for the `trainer` service of docker/compose.yaml: the data and
        model mounts, `runtime.environment` as the container environment, and the command
        (`launch/accelerate.sh /job/config.yaml OVERRIDES --train.output_dir /outputs [--model.path ...]`)

The job is validated with astrai's own config code first (see `jobfile.py`); errors are one line, exit 2.
Container paths: the job file at /job/config.yaml, train.output_dir at /outputs (TRAIN_CHECKPOINT_DIR), a model
directory at /model (a .gguf file at /model/NAME), a data file at /data/NAME (a data directory at /data).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional, Sequence

from jobfile import Infra, dump_compose, export_lines, load_job, run_cli, split_dashes

from astrai.checkpoint.layout import find_latest_checkpoint
from astrai.runtime_env import render_environment

JOB_TARGET, OUTPUTS_TARGET = "/job/config.yaml", "/outputs"


def resume_checkpoint(infra: Infra) -> str:
    """Host path of the checkpoint the job would resume from ("" for a fresh start)."""
    resume = infra.config.checkpoint.resume
    if resume == "none":
        return ""
    if resume == "auto":
        latest = find_latest_checkpoint(infra.checkpoint_dir)
        return "" if latest is None else str(latest)
    path = Path(resume)
    if path.is_absolute() and path.parts[:2] == ("/", OUTPUTS_TARGET.strip("/")):
        return str(infra.checkpoint_dir.joinpath(*path.parts[2:]))
    return str(path.expanduser().resolve())


def exports(infra: Infra, job_file: str) -> dict[str, Optional[str]]:
    """The variables train.sh exports (None = unset)."""
    count, visible = infra.gpu_exports()
    return {
        "TRAIN_JOB_NAME": infra.job_name,
        "TRAIN_JOB_FILE": str(Path(job_file).resolve()),
        "TRAIN_DATA": str(infra.data or ""),
        "TRAIN_MODEL": str(infra.model or ""),
        "TRAIN_CHECKPOINT_DIR": str(infra.checkpoint_dir),
        "TRAIN_GPU_COUNT": count,
        "CUDA_VISIBLE_DEVICES": visible,
        "TRAIN_TYPE": infra.config.train.type,
        "TRAIN_RESUME_CHECKPOINT": resume_checkpoint(infra),
    }


def _mount(source: Path, kind: str) -> tuple[dict, str]:
    """(read-only bind mount, container path) for the model or data source."""
    target = f"/{kind}" if source.is_dir() else f"/{kind}/{source.name}"
    return {"type": "bind", "source": str(source), "target": target, "read_only": True}, target


def compose_override(infra: Infra, overrides: Sequence[str]) -> dict:
    """The `trainer` service override: mounts, environment (runtime.environment), command."""
    command = ["launch/accelerate.sh", JOB_TARGET, *overrides, "--train.output_dir", OUTPUTS_TARGET]
    volumes = []
    if infra.model is not None:
        mount, target = _mount(infra.model, "model")
        volumes.append(mount)
        command += ["--model.path", target]
    if infra.data is not None:
        mount, target = _mount(infra.data, "data")
        volumes.append(mount)
        if infra.data.is_file():
            command += ["--data.path", target]
    service: dict = {}
    environment = render_environment(infra.config.runtime.environment)
    if environment:
        service["environment"] = environment
    if volumes:
        service["volumes"] = volumes
    service["command"] = command
    return {"services": {"trainer": service}}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command line (see the module docstring); returns the exit code (JobError: see `jobfile.run_cli`)."""
    parser = argparse.ArgumentParser(prog="docker/train_runtime.py", description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("exports", "compose"))
    parser.add_argument("job_file")
    parser.add_argument("--env-file", default=None, help="dotenv fallbacks for infra: (e.g. .env.train)")
    argv, after = split_dashes(argv)
    args = parser.parse_args(argv)
    args.overrides = after  # astrai overrides after --, e.g. -- --max_steps 2
    infra = load_job(args.job_file, args.overrides, args.env_file)
    if args.what == "exports":
        print(export_lines(exports(infra, args.job_file)), end="")
    else:
        print(dump_compose(compose_override(infra, args.overrides)), end="")
    return 0


if __name__ == "__main__":
    run_cli(main)
