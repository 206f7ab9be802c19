"""Shared fixtures: a tiny Hugging Face-format model directory (random weights, tiny tokenizer)."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported: one OpenMP thread per test process

import json  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A random-init tiny Llama saved as config.json + model.safetensors + tokenizer files."""
    from astrai.models import AutoRegressiveLM, hf_state_dict, tiny_config, tiny_tokenizer

    path = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    model = AutoRegressiveLM(tiny_config())
    save_file({k: v.contiguous() for k, v in hf_state_dict(model).items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(model.config.to_hf_dict()))
    tiny_tokenizer().save(path)
    return path
