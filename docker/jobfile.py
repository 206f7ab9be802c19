"""Host-side reading of a job YAML for the container tools (`train_runtime.py`, `serve_runtime.py`).

Runs on the host's `python3` (3.9+) with PyYAML and the astrai source tree on `sys.path` (no torch, no install):
the job is parsed with astrai's own YAML 1.2 loader and validated with `astrai.config` (CLI overrides included),
so a bad job fails here, before any container starts. The top-level `infra:` section, which `astrai.train` skips,
describes where the job runs:

    infra:
      job_name: ppo-smollm2          # compose project astrai-<job_name>; default: the YAML file's stem
      data: /srv/data/gsm8k.jsonl    # host file or directory, mounted read-only in the container
      model: /srv/models/smollm2-hf  # host HF model directory or .gguf file, mounted read-only
      checkpoint_dir: /srv/runs/ppo  # host directory that receives train.output_dir (default: train.output_dir)
      gpus: [0, 1]                   # GPU indices (list, "0,1" or one index) or `all` (the default)

Each key may instead come from an env file (`.env.train` / `.env.serve`: `KEY=VALUE` lines with `TRAIN_JOB_NAME`,
`TRAIN_DATA`, `TRAIN_MODEL`, `TRAIN_CHECKPOINT_DIR`, `TRAIN_GPUS`); `infra:` takes precedence and absent keys fall
back to the env file, then to the defaults. Relative paths are resolved against the directory of the file that
names them (`checkpoint_dir`'s default, `train.output_dir`, against the current directory).
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

try:
    import yaml  # noqa: F401  (astrai.config_schema needs it; checked here for a clear message)
except ImportError:
    print("error: host python3 has no PyYAML: pip install pyyaml (or apt-get install python3-yaml)", file=sys.stderr)
    sys.exit(2)

from astrai.config import ConfigError, config_from_dict  # noqa: E402
from astrai.config_schema import YamlLoader  # noqa: E402

INFRA_KEYS = {"job_name": "TRAIN_JOB_NAME", "data": "TRAIN_DATA", "model": "TRAIN_MODEL",
              "checkpoint_dir": "TRAIN_CHECKPOINT_DIR", "gpus": "TRAIN_GPUS"}
"""`infra:` key -> its env-file name."""
_JOB_NAME = re.compile(r"[a-z0-9][a-z0-9_-]*")


class JobError(Exception):
    """Bad job file, infra value or env file; the message is one line naming the file or key."""


@dataclass
class Infra:
    """Resolved `infra:` of one job (host paths absolute; None where not given)."""

    job_name: str
    data: Optional[Path]
    model: Optional[Path]
    checkpoint_dir: Path
    gpus: Optional[list[int]]  # None = all
    config: Any = field(repr=False, default=None)  # the validated astrai Config

    def gpu_exports(self) -> tuple[str, Optional[str]]:
        """(GPU count, CUDA_VISIBLE_DEVICES or None for all GPUs). For `all` the count is the host's
        `nvidia-smi -L` line count, or "" when nvidia-smi is not available (the launcher then counts)."""
        if self.gpus is not None:
            return str(len(self.gpus)), ",".join(map(str, self.gpus))
        return host_gpu_count(), None


def host_gpu_count() -> str:
    """Number of GPUs `nvidia-smi -L` lists, or "" without nvidia-smi (or when it fails)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return ""
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    return str(sum(1 for line in out.splitlines() if line.startswith("GPU ")))


def read_env_file(path: Optional[str]) -> dict[str, str]:
    """`KEY=VALUE` lines of a dotenv file (`#` comments, optional `export `, optional quotes); {} when absent."""
    if not path or not Path(path).is_file():
        return {}
    values = {}
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, eq, value = line.removeprefix("export ").partition("=")
        if not eq or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key.strip()):
            raise JobError(f"{path}:{number}: expected KEY=VALUE, got {line!r}")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        values[key.strip()] = value
    return values


def parse_gpus(value: Any, where: str) -> Optional[list[int]]:
    """`all`/None -> None; an index, "0,1" or a list of indices -> sorted unique-checked list of ints."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("all", "")):
        return None
    items = value if isinstance(value, list) else str(value).split(",") if not isinstance(value, bool) else [value]
    gpus = []
    for item in items:
        text = str(item).strip()
        if isinstance(item, bool) or not text.isdigit():
            raise JobError(f"{where}: expected 'all', a GPU index or a list of indices, got {value!r}")
        gpus.append(int(text))
    if not gpus or len(set(gpus)) != len(gpus):
        raise JobError(f"{where}: expected distinct GPU indices, got {value!r}")
    return gpus


def _path(value: Any, base: Path, where: str, *, must_exist: bool) -> Optional[Path]:
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise JobError(f"{where}: expected a path, got {value!r}")
    path = Path(value).expanduser()
    path = (path if path.is_absolute() else base / path).resolve()
    if must_exist and not path.exists():
        raise JobError(f"{where}: {path} does not exist")
    return path


def load_job(job_file: str, overrides: Sequence[str] = (), env_file: Optional[str] = None) -> Infra:
    """Read and validate a job YAML (+ astrai CLI overrides) and resolve its `infra:` against `env_file`.

    Raises:
        JobError: one line naming the file, the key or the override at fault.
    """
    path = Path(job_file)
    if not path.is_file():
        raise JobError(f"job file not found: {job_file}")
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=YamlLoader) or {}
    except yaml.YAMLError as err:
        raise JobError(f"invalid YAML in job file {job_file}: {' '.join(str(err).split())}") from None
    if not isinstance(data, dict):
        raise JobError(f"{job_file}: expected a mapping of sections at the top level")
    try:
        config = config_from_dict(data, overrides, source=str(job_file))
    except ConfigError as err:
        raise JobError(str(err)) from None
    infra = data.get("infra") or {}
    unknown = sorted(set(infra) - set(INFRA_KEYS))
    if unknown:
        raise JobError(f"{job_file}: unknown key 'infra.{unknown[0]}' (expected one of: {', '.join(INFRA_KEYS)})")
    env = read_env_file(env_file)
    env_base = Path(env_file).resolve().parent if env_file else Path.cwd()

    def pick(key: str):
        """(value, base dir, where) from infra first, then the env file."""
        if infra.get(key) is not None:
            return infra[key], path.resolve().parent, f"infra.{key}"
        if env.get(INFRA_KEYS[key]):
            return env[INFRA_KEYS[key]], env_base, f"{env_file}: {INFRA_KEYS[key]}"
        return None, None, f"infra.{key}"

    name, _, where = pick("job_name")
    name = str(name) if name is not None else re.sub(r"[^a-z0-9_-]+", "-", path.stem.lower()).strip("-_") or "job"
    if not _JOB_NAME.fullmatch(name):
        raise JobError(f"{where}: expected lowercase letters, digits, '-' or '_' (a compose project name), "
                       f"got {name!r}")
    data_path, model_path, ckpt = pick("data"), pick("model"), pick("checkpoint_dir")
    return Infra(
        job_name=name,
        data=_path(data_path[0], data_path[1], data_path[2], must_exist=True),
        model=_path(model_path[0], model_path[1], model_path[2], must_exist=True),
        checkpoint_dir=(_path(ckpt[0], ckpt[1], ckpt[2], must_exist=False)
                        or Path(config.train.output_dir).expanduser().resolve()),
        gpus=parse_gpus(pick("gpus")[0], pick("gpus")[2]),
        config=config,
    )


def export_lines(values: dict[str, Optional[str]]) -> str:
    """Shell lines for `eval`: `export NAME='value'` (quoted, no expansion) or `unset NAME` for None."""
    return "".join(f"unset {k}\n" if v is None else f"export {k}={shlex.quote(v)}\n" for k, v in values.items())


def dump_compose(document: dict) -> str:
    """A compose override document as YAML (block style, keys in insertion order, `$` escaped as `$$`)."""

    def escape(obj):
        if isinstance(obj, str):
            return obj.replace("$", "$$")  # compose would interpolate ${...} in values: keep them literal
        if isinstance(obj, dict):
            return {k: escape(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [escape(v) for v in obj]
        return obj

    return yaml.safe_dump(escape(document), sort_keys=False, default_flow_style=False, allow_unicode=True)


def split_dashes(argv: Optional[Sequence[str]]) -> tuple[list[str], list[str]]:
    """(arguments before the first `--`, arguments after it) of `argv` (default: sys.argv[1:])."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        return argv, []
    i = argv.index("--")
    return argv[:i], argv[i + 1:]


def run_cli(main) -> None:
    """Run a helper's `main()`: JobError -> one line on stderr, exit 2."""
    try:
        sys.exit(main())
    except JobError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
