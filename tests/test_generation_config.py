"""A published checkpoint and an export carry generation_config.json (issue 41.9): transformers' and vLLM's
`generate` read the stop ids from it, every eos id of the model included."""

import json

import pytest

from astrai.models import AutoRegressiveLM, tiny_config


def test_generation_config_lists_every_stop_id():
    config = tiny_config()
    config.eos_token_id = [2, 0]
    config.bos_token_id, config.pad_token_id = 1, None
    assert AutoRegressiveLM(config).config.generation_config_dict() == {"bos_token_id": 1, "eos_token_id": [2, 0]}
    config.eos_token_id = 2
    assert config.generation_config_dict()["eos_token_id"] == 2


def test_checkpoints_and_exports_carry_a_generation_config_transformers_reads(tiny_ppo_run, tmp_path):
    transformers = pytest.importorskip("transformers")
    from astrai.checkpoint.export import export_merged

    step = sorted((tiny_ppo_run / "checkpoints").glob("step-*"))[-1]
    manifest = json.loads((step / "manifest.json").read_text())
    assert "generation_config.json" in json.dumps(manifest)  # hashed like every other file
    exported = export_merged(step, tmp_path / "export")
    for folder in (step, exported):
        written = json.loads((folder / "generation_config.json").read_text())
        model_config = json.loads((folder / "config.json").read_text())
        assert written["eos_token_id"] == model_config["eos_token_id"]
        loaded = transformers.GenerationConfig.from_pretrained(str(folder))
        assert loaded.eos_token_id == written["eos_token_id"]
