"""Shared fixtures: a tiny Hugging Face-format model directory (random weights, tiny tokenizer); every test runs in
an empty working directory of its own, so none reads or writes the clone's `outputs/` (or anything else relative
to where pytest was started), and the suite passes from any directory (`python -m pytest <clone>/tests`)."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported: one OpenMP thread per test process
# DeepSpeed compiles a small op on its first use (~90 s on CPU): keep the build between test runs
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(os.path.expanduser("~"), ".cache", "astrai",
                                                            "torch_extensions"))

import pytest  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _session_working_directory(tmp_path_factory):
    """Session fixtures (built before any test's own directory) run in an empty directory too."""
    previous = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("cwd-session"))
    yield
    os.chdir(previous)


@pytest.fixture(autouse=True)
def _working_directory(tmp_path_factory, monkeypatch):
    """Each test starts in an empty directory of its own (not its `tmp_path`, which a test may expect empty):
    a path relative to the working directory never reaches the clone. Paths into the repository are built from
    `Path(__file__)`."""
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A random-init tiny Llama (seed 0) saved as config.json + model.safetensors + tokenizer files."""
    from single_turn_reference import tiny_model

    return tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def long_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with room for the tool schemas its character-level tokenizer spells out (1024 positions; RoPE:
    any length works)."""
    import json
    import shutil

    model_dir = tmp_path_factory.mktemp("long-model") / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 1024}))
    return model_dir


@pytest.fixture(scope="session")
def tiny_ppo_run(tiny_model_dir, tmp_path_factory):
    """The main job (configs/examples/ppo.yaml) for 2 steps on the tiny model: metrics.jsonl, TensorBoard event
    files and a published checkpoint under the returned output directory."""
    from pathlib import Path

    from astrai.train import main

    out = tmp_path_factory.mktemp("tiny-ppo-run") / "run"
    example = Path(__file__).resolve().parents[1] / "configs/examples/ppo.yaml"
    code = main(["--config", str(example), "--model.path", str(tiny_model_dir), "--train.output_dir", str(out),
                 "--max_steps", "2", "--rollout.batch_size", "4", "--ppo.minibatch_size", "2",
                 "--ppo.micro_batch_size", "1", "--rollout.max_new_tokens", "6", "--train.progress_bar", "false",
                 "--data.truncation", "left"])  # the tiny tokenizer makes the example prompts longer
    assert code == 0
    return out
