"""docker/: compose.yaml structure (services, image, GPU reservation), the Dockerfile's base and extras, and the
host-side helpers that render `infra:` / `runtime:` (no Docker daemon is needed)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

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
    assert trainer["build"] == {"context": "..", "dockerfile": "docker/Dockerfile"} and "build" not in server
    assert {v["target"] for v in trainer["volumes"]} == {"/job/config.yaml", "/outputs"}
    assert trainer["command"][:2] == ["launch/accelerate.sh", "/job/config.yaml"]
    assert server["command"][:5] == ["python", "-m", "astrai.serve", "--checkpoint", "/checkpoint"]
    assert server["ports"] == ["${SERVE_PORT:-8000}:8000"] and server["volumes"][0]["read_only"] is True
    assert (REPO / trainer["volumes"][0]["source"].split(":-")[1].rstrip("}").replace("../", "")).is_file()


def test_dockerfile_cuda_base_and_extras():
    text = (REPO / "docker/Dockerfile").read_text()
    base = next(line for line in text.splitlines() if line.startswith("ARG CUDA_IMAGE="))
    assert base.split("=", 1)[1].startswith("nvidia/cuda:") and "devel" in base
    install = next(line for line in text.splitlines() if "pip install --no-build-isolation" in line)
    extras = install.split('".[', 1)[1].split("]", 1)[0].split(",")
    assert {"deepspeed", "flash", "serve"} <= set(extras)
    copied = {word for line in text.splitlines() if line.startswith("COPY ") for word in line.split()[1:-1]}
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
