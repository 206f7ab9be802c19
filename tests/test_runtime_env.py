"""runtime.environment (validation, rendering, export before the process group, no leaks across jobs),
ASTR_LOG_LEVEL, the host-side `infra:` section, train.report_to validation, and the one-line notice before
DeepSpeed's first op compile."""

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from astrai.config import ConfigError, config_from_dict, dump_config, load_config
from astrai.runtime_env import job_environment, job_runtime, log_level, render_environment

REPO = Path(__file__).resolve().parents[1]


def test_environment_field_validates_and_round_trips(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("runtime:\n  environment:\n    NCCL_P2P_DISABLE: 1\n    NCCL_DEBUG: INFO\n    FLAG: true\n"
                    "    RATIO: 1.5e-3\n    EMPTY: null\n    _X2: '$HOME'\n")
    config = load_config(str(path))
    env = config.runtime.environment
    assert env == {"NCCL_P2P_DISABLE": 1, "NCCL_DEBUG": "INFO", "FLAG": True, "RATIO": 1.5e-3, "EMPTY": None,
                   "_X2": "$HOME"}
    again = tmp_path / "again.yaml"
    again.write_text(dump_config(config))
    assert load_config(str(again)) == config
    assert load_config(None).runtime.environment == {}
    cli = load_config(None, ["--runtime.environment", "{A: 1, B: x}"])
    assert cli.runtime.environment == {"A": 1, "B": "x"}


@pytest.mark.parametrize("value, needle", [
    ({"1ABC": "x"}, "key '1ABC' is not an environment variable name"),
    ({"A-B": "x"}, "key 'A-B'"),
    ({"A": [1, 2]}, "A: expected a string, number, boolean or null, got list"),
    ({"A": {"b": 1}}, "A: expected a string, number, boolean or null, got dict"),
    (["A=1"], "expected a mapping of environment variable names"),
    ("A=1", "expected a mapping of environment variable names"),
])
def test_environment_field_rejects_bad_entries(value, needle):
    with pytest.raises(ConfigError) as info:
        config_from_dict({"runtime": {"environment": value}})
    assert str(info.value).startswith("runtime.environment: ") and needle in str(info.value)
    assert "\n" not in str(info.value)


def test_render_environment_is_str_with_null_empty_and_no_expansion():
    assert render_environment({"A": 1, "B": True, "C": None, "D": 0.5, "E": "$HOME/~"}) == {
        "A": "1", "B": "True", "C": "", "D": "0.5", "E": "$HOME/~"}


def test_job_environment_restores_previous_values(monkeypatch):
    monkeypatch.setenv("ASTR_T_KEEP", "old")
    monkeypatch.delenv("ASTR_T_NEW", raising=False)
    with pytest.raises(RuntimeError):
        with job_environment({"ASTR_T_KEEP": "job", "ASTR_T_NEW": None}) as rendered:
            assert rendered == {"ASTR_T_KEEP": "job", "ASTR_T_NEW": ""}
            assert os.environ["ASTR_T_KEEP"] == "job" and os.environ["ASTR_T_NEW"] == ""
            raise RuntimeError("job failed")
    assert os.environ["ASTR_T_KEEP"] == "old" and "ASTR_T_NEW" not in os.environ


def test_log_level_names_and_errors():
    assert log_level("debug") == logging.DEBUG and log_level(" WARNING ") == logging.WARNING
    assert log_level("15") == 15 and log_level(None) is None and log_level("") is None
    with pytest.raises(ValueError, match="ASTR_LOG_LEVEL: expected one of DEBUG"):
        log_level("loud")


def test_job_runtime_sets_and_restores_astrai_level(monkeypatch):
    monkeypatch.delenv("ASTR_LOG_LEVEL", raising=False)
    logger = logging.getLogger("astrai")
    before = logger.level
    with job_runtime({"ASTR_LOG_LEVEL": "DEBUG"}):
        assert logger.level == logging.DEBUG and logger.handlers
        assert logging.getLogger("astrai.serve").isEnabledFor(logging.DEBUG)
    assert logger.level == before


JOBS_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import astrai.trainer.build as build
    import astrai.train as train
    seen = []

    def fake_setup(device, strategy, **kwargs):  # the process group would be created here
        seen.append({k: os.environ.get(k) for k in ("ASTR_T_A", "ASTR_T_B", "ASTR_LOG_LEVEL")})
        raise ValueError("stop before loading a model")

    build.setup_distributed = fake_setup
    codes = [train.main(["--config", sys.argv[1]]), train.main(["--config", sys.argv[2]])]
    after = {k: os.environ.get(k) for k in ("ASTR_T_A", "ASTR_T_B", "ASTR_LOG_LEVEL")}
    print(json.dumps({"codes": codes, "seen": seen, "after": after}))
""")


def test_train_exports_before_process_group_and_nothing_leaks(tmp_path):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("runtime:\n  environment:\n    ASTR_T_A: 1\n    ASTR_T_B: null\n    ASTR_LOG_LEVEL: debug\n")
    b.write_text("runtime:\n  environment: {}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASTR_")}
    out = subprocess.run([sys.executable, "-c", JOBS_SCRIPT, str(a), str(b)], capture_output=True, text=True,
                         env=env, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["codes"] == [2, 2]
    assert result["seen"][0] == {"ASTR_T_A": "1", "ASTR_T_B": "", "ASTR_LOG_LEVEL": "debug"}
    assert result["seen"][1] == {"ASTR_T_A": None, "ASTR_T_B": None, "ASTR_LOG_LEVEL": None}  # job b: no leak
    assert result["after"] == {"ASTR_T_A": None, "ASTR_T_B": None, "ASTR_LOG_LEVEL": None}
    assert "DEBUG astrai.runtime_env: runtime.environment exported: ASTR_LOG_LEVEL, ASTR_T_A, ASTR_T_B" in out.stderr


def test_train_rejects_bad_log_level(tmp_path, capsys):
    from astrai.train import main

    job = tmp_path / "job.yaml"
    job.write_text("runtime:\n  environment:\n    ASTR_LOG_LEVEL: loud\n")
    assert main(["--config", str(job)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ASTR_LOG_LEVEL:") and "\n" not in err
    assert "ASTR_LOG_LEVEL" not in os.environ


def test_infra_section_is_skipped_by_astrai_train_but_must_be_a_mapping():
    config = config_from_dict({"infra": {"job_name": "x", "gpus": [0, 1]}, "train": {"max_steps": 3}})
    assert config.train.max_steps == 3
    with pytest.raises(ConfigError, match="infra: expected a mapping"):
        config_from_dict({"infra": [1, 2]})


def test_report_to_choices():
    assert config_from_dict({"train": {"report_to": ["tensorboard", "wandb"]}}).train.report_to == [
        "tensorboard", "wandb"]
    assert load_config(None, ["--train.report_to", "none"]).train.report_to == ["none"]
    assert load_config(None).train.report_to == ["tensorboard"]  # tensorboard is installed (dev extra)
    for bad in (["mlflow"], ["none", "wandb"]):
        with pytest.raises(ConfigError, match="train.report_to: expected a list of 'tensorboard', 'wandb', 'none'"):
            config_from_dict({"train": {"report_to": bad}})


def test_deepspeed_op_build_is_announced_once_with_its_cache(tmp_path, monkeypatch, capsys):
    deepspeed = pytest.importorskip("deepspeed")
    from astrai import runtime_env
    from astrai.runtime_env import announce_deepspeed_op_build

    builder = deepspeed.accelerator.get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None:
        pytest.skip("this accelerator has no op that deepspeed.initialize compiles")
    capsys.readouterr()  # DeepSpeed's own accelerator line
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setattr(runtime_env, "_ANNOUNCED_OPS", set())
    line = announce_deepspeed_op_build(deepspeed)
    assert line.startswith("compiling a DeepSpeed op once (deepspeed_shm_comm), ~2 min; cached in " + str(tmp_path))
    assert capsys.readouterr().out == line + "\n"
    assert announce_deepspeed_op_build(deepspeed) is None  # once per process
    cache = next((tmp_path / "ext").rglob("deepspeed_shm_comm"))  # where torch's extension loader builds it
    (cache / "deepspeed_shm_comm.so").write_bytes(b"")
    monkeypatch.setattr(runtime_env, "_ANNOUNCED_OPS", set())
    assert announce_deepspeed_op_build(deepspeed) is None and capsys.readouterr().out == ""  # built already


def test_log_lines_are_written_above_a_progress_bar_not_onto_it(capsys):
    """The `astrai` logger's stderr handler writes through `tqdm.write`: a bar on stderr is cleared first and
    redrawn below, so a log line starts its own line (a DEBUG reading during a training step once stuck to the
    bar's last frame)."""
    from tqdm import tqdm

    from astrai.runtime_env import _StderrHandler

    logger = logging.getLogger("astrai.test_bar")
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        with tqdm(total=2, desc="train", file=sys.stderr, ascii=True) as bar:
            bar.update(1)
            logger.info("a reading")
    finally:
        logger.removeHandler(handler)
    err = capsys.readouterr().err
    lines = err.replace("\r", "\n").split("\n")
    assert "INFO astrai.test_bar: a reading" in lines  # a line of its own, no bar frame before it
