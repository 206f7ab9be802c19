"""Findings of a fresh-user trial (2026-12-03): bad input that passed `--check` or crashed later, and settings that
were dropped without a word, now refused at start-up in one line (exit 2)."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from astrai.config import ConfigError, config_from_dict
from astrai.rollout.engine_settings import check_paged_options
from astrai.train import main

REPO = Path(__file__).resolve().parents[1]
PPO = str(REPO / "configs/examples/ppo.yaml")


def _one_line_exit_2(args, capsys) -> str:
    code = main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_single_reward_options_that_no_reward_reads_are_said():
    """reward.format_bonus / partial_credit belong to the single reward.name: with reward.functions or a reward
    model they have no effect, and the start-up warning about ignored settings names them."""
    from astrai.config import ignored_settings

    config = config_from_dict({"reward": {"format_bonus": 0.1, "functions": [{"function": "math_exact_match"}]}})
    assert ignored_settings(config) == ["reward.format_bonus"]
    config = config_from_dict({"reward": {"partial_credit": 0.5, "model_path": "rm"}})
    assert ignored_settings(config) == ["reward.partial_credit"]
    assert ignored_settings(config_from_dict({"reward": {"format_bonus": 0.1}})) == []


def test_a_mixture_is_refused_where_it_would_be_ignored():
    with pytest.raises(ConfigError, match="data.mixture: blends the prompts of the train types that sample online; "
                                          "train.type sft reads data.path"):
        config_from_dict({"train": {"type": "sft"}, "data": {"mixture": [{"path": "chat.jsonl"}]}})


def test_dotted_overrides_reach_into_plain_mappings():
    config = config_from_dict({}, ["--rollout.engine_options.max_num_seqs", "4"])
    assert config.rollout.engine_options == {"max_num_seqs": 4}
    config = config_from_dict({"reward": {"functions": [{"function": "f"}]}},
                              ["--reward.functions.0.kwargs.scale", "2"])
    assert config.reward.functions[0].kwargs == {"scale": 2}


@pytest.mark.parametrize("options, message", [
    ({"max_num_seq": 4}, "the paged engine takes no option 'max_num_seq' (did you mean 'max_num_seqs'?)"),
    ({"max_num_seqs": 0}, "rollout.engine_options.max_num_seqs: expected an integer > 0, got 0"),
    ({"max_num_seqs": "many"}, "rollout.engine_options.max_num_seqs: expected an integer > 0, got 'many'"),
    ({"block_size": 1.5}, "rollout.engine_options.block_size: expected an integer > 0, got 1.5"),
    ({"max_kv_tokens": True}, "rollout.engine_options.max_kv_tokens: expected an integer > 0, got True"),
    ({"prefix_cache": "maybe"}, "rollout.engine_options.prefix_cache: expected true or false, got 'maybe'"),
])
def test_engine_option_values_are_checked(options, message):
    with pytest.raises(ValueError) as info:
        check_paged_options(options)
    assert message in str(info.value)


def test_check_refuses_engine_options_the_run_would_stop_on(tiny_model_dir, tmp_path, capsys):
    base = ["--config", PPO, "--model.path", str(tiny_model_dir), "--train.output_dir", str(tmp_path / "run"),
            "--data.truncation", "left", "--check"]
    line = _one_line_exit_2(base + ["--rollout.engine_options", "{max_kv_tokens: 20}"], capsys)
    assert "rollout.engine_options.max_kv_tokens: 20 cannot hold one sequence" in line
    line = _one_line_exit_2(base + ["--rollout.engine_options", "{dense_decode: x}"], capsys)
    assert "rollout.engine_options.dense_decode: expected true or false" in line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("broken, needle", [("model.safetensors", "not a readable safetensors file"),
                                            ("tokenizer.json", "is not a readable tokenizer")])
def test_a_corrupt_model_file_is_one_line(broken, needle, tiny_model_dir, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / broken).write_bytes(b"{not a real file")
    line = _one_line_exit_2(["--config", PPO, "--model.path", str(model), "--train.output_dir",
                             str(tmp_path / "run"), "--check"], capsys)
    assert needle in line and str(model) in line


def test_check_names_the_mixture_it_trains_on(tiny_model_dir, tmp_path, capsys):
    files = []
    for name in ("a", "b"):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"question": f"{name} {i}?", "answer": f"#### {i}"}) + "\n"
                                for i in range(4)))
        files.append(str(path))
    mixture = json.dumps([{"path": files[0]}, {"path": files[1], "weight": 2}])
    assert main(["--config", PPO, "--model.path", str(tiny_model_dir), "--train.output_dir", str(tmp_path / "run"),
                 "--data.truncation", "left", "--data.mixture", mixture, "--check"]) == 0
    assert f"from data.mixture ({files[0]} x 1, {files[1]} x 2)" in capsys.readouterr().out


def test_evaluate_refuses_an_unknown_device_in_one_line(tiny_model_dir, tmp_path):
    out = subprocess.run([sys.executable, "-m", "astrai.evaluate", "--model", str(tiny_model_dir), "--data",
                          "builtin:arithmetic_test", "--device", "gpu", "--output_dir", str(tmp_path / "eval")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and out.stderr.strip() == (
        "error: --device: expected auto, cpu, cuda or cuda:N, got 'gpu'"), out.stderr


def test_a_user_code_path_that_is_no_python_file_is_named_as_such(tmp_path):
    """A tool / reward / environment `path:` naming a YAML file failed with "AttributeError: 'NoneType' object has no
    attribute 'loader'", a directory with "file not found" (trial): both now say a .py file is expected."""
    from astrai.imports import ImportFailure, load_attribute

    (tmp_path / "job.yaml").write_text("train: {}\n")
    with pytest.raises(ImportFailure, match=r"^path .*job.yaml: expected a .py file, got a .yaml file$"):
        load_attribute("raising", tmp_path / "job.yaml")
    with pytest.raises(ImportFailure, match=r"^path .*: a directory; expected a .py file$"):
        load_attribute("raising", tmp_path)
    with pytest.raises(ImportFailure, match=r"^path .*nope.py: file not found$"):
        load_attribute("raising", tmp_path / "nope.py")
    (tmp_path / "tools.py").write_text("def raising():\n    raise ValueError\n")
    assert callable(load_attribute("raising", tmp_path / "tools.py"))


def test_a_job_that_fails_to_start_leaves_no_empty_output_directory(long_model_dir, tmp_path, capsys):
    """A bad tool function, found after the lock had created train.output_dir, left the directory behind, empty
    (trial): the lock removes the directories it created while they are empty. An existing directory stays."""
    (tmp_path / "tools.py").write_text("def add(a: int, b: int) -> str:\n    return str(a + b)\n")
    out = tmp_path / "new" / "run"
    args = ["--train.type", "online_grpo", "--model.path", str(long_model_dir), "--data.path", "builtin:arithmetic",
            "--data.max_prompt_length", "200", "--rollout.max_new_tokens", "16",
            "--rollout.tools", f'[{{function: nosuch, path: {tmp_path / "tools.py"}}}]', "--train.output_dir",
            str(out), "--max_steps", "1"]
    assert main(args) == 2
    assert "rollout.tools.0" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()
    out.mkdir(parents=True)
    assert main(args) == 2
    assert out.is_dir() and list(out.iterdir()) == []


def test_a_config_json_missing_a_key_names_the_key(tmp_path):
    """`{"model_type": "llama"}` alone said "not a supported config ('num_attention_heads')": a raw KeyError."""
    from astrai.models import load_pretrained

    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ValueError, match=r"config.json: not a supported config \(missing key '[a-z_]+'\)$"):
        load_pretrained(tmp_path)


def test_a_missing_model_path_is_named_as_the_field(tmp_path, capsys):
    """"model path X does not exist" named no field (a teacher's error names distill.teacher): now model.path."""
    assert main(["--config", PPO, "--model.path", str(tmp_path / "nope"), "--check"]) == 2
    assert capsys.readouterr().err.startswith(f"error: model.path: model path {tmp_path / 'nope'} does not exist")
