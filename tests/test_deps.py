"""Optional dependencies are reported honestly: "not installed" only when the package is absent, and "installed but
failed to import: <the import error's first line>" when it is present but broken (the 2026-12-03 failure: peft
installed, its import broken by a shadowed `kernels`, reported as "needs the peft package: pip install").

Each entry point is run in a subprocess with a stand-in package first on PYTHONPATH whose import raises, as a
shadowed or half-installed package does.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from astrai.deps import MissingDependencyError, import_optional, unavailable_reason

REPO = Path(__file__).resolve().parents[1]
BROKEN = "cannot import name 'CUDAProperties' from 'kernels' (stand-in)"


def _broken_packages(root: Path, *names: str) -> Path:
    """`root` holding a package per name whose import raises ImportError(BROKEN)."""
    for name in names:
        (root / name).mkdir(parents=True, exist_ok=True)
        (root / name / "__init__.py").write_text(f"raise ImportError({BROKEN!r})\n")
    return root


def test_absent_and_broken_packages_are_told_apart(tmp_path, monkeypatch):
    assert unavailable_reason("json", needed_by="x") is None
    assert import_optional("json", needed_by="x") is json
    absent = unavailable_reason("astrai_no_such_package", needed_by="model.lora", install="pip install it")
    assert absent == "model.lora needs the astrai_no_such_package package, which is not installed (pip install it)"
    monkeypatch.syspath_prepend(str(_broken_packages(tmp_path, "astrai_broken_probe")))
    broken = unavailable_reason("astrai_broken_probe", needed_by="model.lora", install="pip install it")
    assert broken == ("model.lora needs the astrai_broken_probe package, which is installed but failed to import: "
                      f"ImportError: {BROKEN}")
    with pytest.raises(MissingDependencyError, match="installed but failed to import: ImportError: cannot import"):
        import_optional("astrai_broken_probe", needed_by="model.lora")
    # a submodule checked under its distribution's name (torch.utils.tensorboard needs tensorboard)
    assert "the astrai_no_such_package package, which is not installed" in unavailable_reason(
        "json.decoder", package="astrai_no_such_package", needed_by="x")


def _run(args, cwd, shadow: Path, **env):
    full_env = {**os.environ, "PYTHONPATH": str(shadow), **env}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=full_env, capture_output=True, text=True,
                          timeout=300)


def _job(tmp_path: Path, model_dir: Path, **sections) -> Path:
    data = tmp_path / "train.csv"  # read through `datasets` (a .jsonl file is parsed line by line)
    data.write_text("question,answer\n" + "".join(f"What is {i} + 1?,#### {i + 1}\n" for i in range(8)))
    job = {"model": {"path": str(model_dir)}, "data": {"path": str(data), "max_prompt_length": 64},
           "rollout": {"batch_size": 2, "max_new_tokens": 4}, "grpo": {"group_size": 2, "minibatch_size": 4,
                                                                      "micro_batch_size": 2},
           "train": {"type": "online_grpo", "output_dir": str(tmp_path / "run"), "max_steps": 1,
                     "report_to": []}}
    for section, values in sections.items():
        job.setdefault(section, {}).update(values)
    path = tmp_path / "job.yaml"
    path.write_text(json.dumps(job))  # JSON is YAML
    return path


# (stand-in packages, entry point arguments (JOB and MODEL filled in), the message's start)
TRAIN_CASES = {
    "peft": (["peft"], {"model": {"lora": {"r": 4}}}, "error: model.lora needs the peft package"),
    "deepspeed": (["deepspeed"], {"distributed": {"strategy": "zero2"}},
                  "error: distributed.strategy zero2 needs the deepspeed package"),
    "tensorboard": (["tensorboard"], {"train": {"report_to": ["tensorboard"]}},
                    "error: train.report_to: 'tensorboard' needs the tensorboard package"),
    "datasets": (["datasets"], {}, "error: "),
}


@pytest.mark.parametrize("package", sorted(TRAIN_CASES))
def test_train_check_reports_an_installed_but_broken_package_as_such(package, tiny_model_dir, tmp_path):
    """`python -m astrai.train --check` with the package installed but broken: exit 2, one line quoting the import
    error, never "not installed"."""
    shadows, sections, start = TRAIN_CASES[package]
    job = _job(tmp_path, tiny_model_dir, **sections)
    out = _run(["-m", "astrai.train", "--check", "--config", str(job)], tmp_path,
               _broken_packages(tmp_path / "shadow", *shadows))
    last = out.stderr.strip().splitlines()[-1] if out.stderr.strip() else ""
    assert out.returncode == 2, out.stderr[-3000:]
    assert last.startswith(start), last
    assert f"the {package} package, which is installed but failed to import: ImportError: {BROKEN}" in last, last
    assert "not installed" not in last


def test_plot_and_serve_report_an_installed_but_broken_package_as_such(tmp_path):
    shadow = _broken_packages(tmp_path / "shadow", "matplotlib", "fastapi")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text(json.dumps({"step": 1, "rollout/reward_mean": 0.5}) + "\n")
    out = _run(["-m", "astrai.plot", str(tmp_path / "run")], tmp_path, shadow)
    assert out.returncode == 2 and out.stderr.strip() == (
        "error: astrai.plot needs the matplotlib package, which is installed but failed to import: "
        f"ImportError: {BROKEN}"), out.stderr
    out = _run(["-m", "astrai.serve", "--checkpoint", str(tmp_path / "nothing")], tmp_path, shadow)
    assert out.returncode == 2 and out.stderr.strip() == (
        "error: astrai.serve needs the fastapi package, which is installed but failed to import: "
        f"ImportError: {BROKEN}"), out.stderr


def test_attention_backends_report_an_installed_but_broken_package_as_such(tmp_path):
    shadow = _broken_packages(tmp_path / "shadow", "triton", "flash_attn")
    code = ("from astrai.kernels import backends; "
            "print(backends._import_error('triton')); print(backends._import_error('flash_attn'))")
    out = _run(["-c", code], tmp_path, shadow)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        f"the {name} attention backend needs the {name} package, which is installed but failed to import: "
        f"ImportError: {BROKEN}" for name in ("triton", "flash_attn")]


def test_unwrapping_a_model_imports_no_deepspeed():
    """A ddp run printed DeepSpeed's "Setting accelerator to CPU" line (a fresh-user trial): Accelerate's unwrapping
    imports DeepSpeed whenever it is installed. astrai unwraps by class name (`models.wrappers.bare_module`)."""
    import subprocess
    import sys

    code = ("import sys, torch\n"
            "from astrai.models import AutoRegressiveLM, tiny_config\n"
            "from astrai.models.wrappers import bare_module\n"
            "from astrai.forward import supports_packing\n"
            "m = AutoRegressiveLM(tiny_config())\n"
            "class DeepSpeedEngine(torch.nn.Module):\n"
            "    def __init__(self, module):\n"
            "        super().__init__(); self.module = module\n"
            "wrapped = DeepSpeedEngine(torch.nn.DataParallel(m))\n"
            "assert bare_module(wrapped) is m and supports_packing(wrapped)\n"
            "assert bare_module(torch.nn.Linear(2, 2)).in_features == 2\n"
            "sys.exit(1 if 'deepspeed' in sys.modules else 0)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
