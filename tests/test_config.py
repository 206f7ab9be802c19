"""Tests for astrai.config: YAML 1.2 loading, CLI overrides, validation, dump round trip."""
import dataclasses
import math

import pytest
import yaml

from astrai.config import (SECTIONS, TRAIN_TYPES, Config, ConfigError, PPOSection, config_from_dict,
                           config_to_dict, dump_config, load_config)


@pytest.fixture()
def extra_metrics(monkeypatch):
    """Stand-in metric names, so the list-parsing tests can use several (only policy/entropy exists)."""
    from astrai import config as config_module

    for name in ("critic/values", "a", "b", "1", "x"):
        monkeypatch.setitem(config_module.OPTIONAL_METRICS, name, TRAIN_TYPES)


def write(tmp_path, text, name="job.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def error(path, overrides=()):
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides))
    message = str(info.value)
    assert "\n" not in message
    return message


# ------------------------------------------------------------------------------------------- defaults & YAML
def test_defaults_valid_and_documented():
    config = load_config(None, [])
    assert config == Config()
    assert config.model.path == "smollm2-135m-instruct" and config.ppo.kl_estimator == "k3"
    assert config.ppo.value_clip == 0.2 and config.checkpoint.keep_last is None and config.train.metrics == []
    assert config.train.type in TRAIN_TYPES and isinstance(config.optim.learning_rate, float)
    assert list(SECTIONS) == ["model", "data", "reward", "rollout", "ppo", "grpo", "distill", "dpo", "optim", "train",
                              "checkpoint", "distributed", "runtime"]
    for cls in SECTIONS.values():
        for f in dataclasses.fields(cls):
            assert f.metadata["doc"], f"{cls.section}.{f.name} has no doc"


def test_yaml_floats_are_floats(tmp_path):
    path = write(tmp_path, "optim:\n  learning_rate: 2e-5\n  critic_learning_rate: 1e-4\n  adam_epsilon: 5E-6\n"
                           "  max_grad_norm: .5\n  weight_decay: 1_000.0\nrollout:\n  batch_size: 16\n")
    config = load_config(path, [])
    assert config.optim.learning_rate == 2e-5 and type(config.optim.learning_rate) is float
    assert config.optim.critic_learning_rate == 1e-4 and config.optim.adam_epsilon == 5e-6
    assert config.optim.max_grad_norm == 0.5 and config.optim.weight_decay == 1000.0
    assert config.rollout.batch_size == 16 and type(config.rollout.batch_size) is int


def test_infinite_values_parse_as_floats_but_are_rejected(tmp_path):
    from astrai.config_schema import YamlLoader
    assert math.isinf(yaml.load(".inf", Loader=YamlLoader))
    with pytest.raises(ConfigError, match=r"rollout\.temperature: expected a number >= 0.0001, got inf"):
        load_config(write(tmp_path, "rollout:\n  temperature: .inf\n"), [])


def test_int_accepted_for_float_and_global_safeloader_untouched(tmp_path):
    config = load_config(write(tmp_path, "ppo:\n  gamma: 1\n  clip_eps: 1\n"), [])
    assert config.ppo.gamma == 1.0 and type(config.ppo.gamma) is float
    assert yaml.safe_load("x: 2e-5") == {"x": "2e-5"}  # PyYAML's own loader keeps YAML 1.1 rules


def test_yaml_12_strings_and_empty_section(tmp_path):
    config = load_config(write(tmp_path, "data:\n  system_prompt: yes\n  path: 2024-01-01\nppo:\n"), [])
    assert config.data.system_prompt == "yes" and config.data.path == "2024-01-01"


def test_nan_rejected_by_range(tmp_path):
    assert "ppo.gamma: expected a number in [0, 1], got nan" in error(write(tmp_path, "ppo:\n  gamma: .nan\n"))


# ------------------------------------------------------------------------------------------- YAML errors
def test_unknown_key_with_suggestion(tmp_path):
    message = error(write(tmp_path, "ppo:\n  gama: 0.9\n"))
    assert "unknown key 'ppo.gama' (did you mean 'ppo.gamma'?)" in message and "job.yaml" in message
    message = error(write(tmp_path, "ppo:\n  learning_rate: 1e-5\n"))
    assert "'ppo.learning_rate'" in message and "did you mean 'optim.learning_rate'" in message


def test_unknown_section(tmp_path):
    assert "unknown section 'rolout' (did you mean 'rollout'?)" in error(write(tmp_path, "rolout: {}\n"))
    assert "unknown section 'zzz'" in error(write(tmp_path, "zzz: {}\n"))


@pytest.mark.parametrize("text,expected", [
    ("optim:\n  learning_rate: fast\n", "optim.learning_rate: expected a number > 0, got 'fast'"),
    ("optim:\n  learning_rate: '1e-5'\n", "optim.learning_rate: expected a number > 0, got '1e-5'"),
    ("rollout:\n  batch_size: true\n", "rollout.batch_size: expected an integer > 0, got True"),
    ("ppo:\n  gamma: false\n", "ppo.gamma: expected a number in [0, 1], got False"),
    ("ppo:\n  epochs: 1.5\n", "ppo.epochs: expected an integer > 0, got 1.5"),
    ("train:\n  progress_bar: 1\n", "train.progress_bar: expected a boolean, got 1"),
    ("train:\n  output_dir: 5\n", "train.output_dir: expected a string: a non-empty directory path, got 5"),
    ("rollout:\n  generation_device: 7\n", "rollout.generation_device: expected null or a string: cpu or cuda:N, got 7"),
    ("train:\n  metrics: [1]\n", "train.metrics: expected a list of strings, got [1]"),
    ("train:\n  type: rlhf\n", "train.type: expected one of 'online_ppo', 'online_grpo', 'grpo', 'sft', 'dpo', 'seq', 'rm', got 'rlhf'"),
    ("ppo:\n  gamma: 1.5\n", "ppo.gamma: expected a number in [0, 1], got 1.5"),
    ("rollout:\n  temperature: 0\n", "rollout.temperature: expected a number >= 0.0001, got 0"),
    ("rollout:\n  top_p: 0\n", "rollout.top_p: expected a number in (0, 1], got 0"),
    ("rollout:\n  top_k: -1\n", "rollout.top_k: expected an integer >= 0, got -1"),
    ("optim:\n  adam_beta2: 1.0\n", "optim.adam_beta2: expected a number in [0, 1), got 1.0"),
    ("reward:\n  partial_credit: 1\n", "reward.partial_credit: expected a number in [0, 1), got 1"),
    ("ppo:\n  value_clip: 0\n", "ppo.value_clip: expected null or a number > 0, got 0"),
    ("checkpoint:\n  keep_last: 0\n", "checkpoint.keep_last: expected null or an integer > 0, got 0"),
    ("runtime:\n  device: gpu\n", "runtime.device: expected 'auto', 'cpu', 'cuda' or 'cuda:N', got 'gpu'"),
    ("ppo:\n  kl_estimator: k4\n", "ppo.kl_estimator: expected one of 'k1', 'k2', 'k3', got 'k4'"),
])
def test_wrong_type_or_range_names_field(tmp_path, text, expected):
    assert expected in error(write(tmp_path, text))


def test_valid_special_values(tmp_path):
    config = load_config(write(tmp_path, "runtime:\n  device: cuda:1\n  num_threads: 2\nppo:\n  value_clip: null\n"
                                         "checkpoint:\n  keep_last: 3\n"), [])
    assert config.runtime.device == "cuda:1" and config.ppo.value_clip is None and config.checkpoint.keep_last == 3


def test_file_errors_are_one_line_and_name_file(tmp_path):
    missing = str(tmp_path / "nope.yaml")
    assert "not found" in error(missing) and missing in error(missing)
    assert str(tmp_path) in error(str(tmp_path)) and "directory" in error(str(tmp_path))
    bad = write(tmp_path, "ppo:\n  gamma: [1\n", "bad.yaml")
    message = error(bad)
    assert bad in message and "invalid YAML" in message and "line" in message
    scalar = write(tmp_path, "- 1\n- 2\n", "list.yaml")
    assert scalar in error(scalar) and "mapping" in error(scalar)
    section = write(tmp_path, "ppo: 3\n", "sect.yaml")
    assert "ppo: expected a mapping" in error(section) and section in error(section)
    duplicate = write(tmp_path, "ppo:\n  gamma: 1\n  gamma: 0.5\n", "dup.yaml")
    assert "duplicate key 'gamma'" in error(duplicate) and duplicate in error(duplicate)


def test_empty_file_gives_defaults(tmp_path):
    assert load_config(write(tmp_path, ""), []) == Config()


# ------------------------------------------------------------------------------------------- CLI overrides
def test_override_forms(tmp_path, extra_metrics):
    path = write(tmp_path, "ppo:\n  gamma: 0.5\ntrain:\n  max_steps: 10\n")
    config = load_config(path, [
        "--ppo_gamma", "0.99", "--ppo_gae_lambda", "0.9", "--ppo_vf_coef", "0.5", "--max_steps", "3",
        "--ppo.kl_coef=0.01", "--ppo.clip_eps", "0.3", "--output_dir", "x", "--learning_rate", "1e-5",
        "--seed", "1", "--logging_steps", "2", "--train_type", "online_ppo", "--ppo.value_clip", "null",
        "--train.metrics", "[policy/entropy, critic/values]", "--runtime.num_threads=4", "--shuffle", "false",
        "--data.system_prompt", "Be brief.", "--max-new-tokens", "32"])
    assert (config.ppo.gamma, config.ppo.gae_lambda, config.ppo.vf_coef) == (0.99, 0.9, 0.5)
    assert config.train.max_steps == 3 and config.ppo.kl_coef == 0.01 and config.ppo.clip_eps == 0.3
    assert config.train.output_dir == "x" and config.optim.learning_rate == 1e-5 and config.train.seed == 1
    assert config.train.logging_steps == 2 and config.ppo.value_clip is None
    assert config.train.metrics == ["policy/entropy", "critic/values"] and config.runtime.num_threads == 4
    assert config.data.shuffle is False and config.data.system_prompt == "Be brief."
    assert config.rollout.max_new_tokens == 32


def test_cli_str_field_keeps_raw_text_and_lists_split(extra_metrics):
    config = load_config(None, ["--train.output_dir", "123", "--data.path=true", "--metrics", "a,b"])
    assert config.train.output_dir == "123" and config.data.path == "true" and config.train.metrics == ["a", "b"]
    assert load_config(None, ["--data.system_prompt", "null"]).data.system_prompt is None


def test_cli_numbers_parsed_and_checked():
    assert load_config(None, ["--optim.adam_epsilon", "5E-6"]).optim.adam_epsilon == 5e-6
    assert "ppo.gamma: expected a number in [0, 1], got 1.5" in error(None, ["--ppo_gamma", "1.5"])
    assert "ppo.gamma: expected a number in [0, 1], got 'abc'" in error(None, ["--ppo.gamma", "abc"])
    assert "train.seed: expected an integer in [0, 4294967295], got True" in error(None, ["--seed", "true"])
    assert "train.metrics: cannot parse value" in error(None, ["--train.metrics", "[a, b"])


def test_cli_wins_over_yaml(tmp_path):
    path = write(tmp_path, "ppo:\n  gamma: 0.5\n")
    assert load_config(path, ["--ppo.gamma", "0.7"]).ppo.gamma == 0.7


def test_ambiguous_bare_name():
    message = error(None, ["--path", "x"])
    assert "ambiguous" in message and "'model.path'" in message and "'data.path'" in message


@pytest.mark.parametrize("tokens,expected", [
    (["--ppo.gamma"], "ppo.gamma: missing value"),
    (["--ppo_gamma", "--seed", "1"], "ppo.gamma: missing value"),
    (["--max_steps"], "train.max_steps: missing value"),
])
def test_missing_value(tokens, expected):
    assert expected in error(None, tokens)


@pytest.mark.parametrize("tokens,expected", [
    (["--ppo.gama", "1"], "unknown key 'ppo.gama' (did you mean 'ppo.gamma'?)"),
    (["--ppo_gama", "1"], "unknown key 'ppo.gama' (did you mean 'ppo.gamma'?)"),
    (["--gama", "1"], "unknown key 'gama' (did you mean 'gamma'?)"),
    (["--ppo.learning_rate", "1"], "did you mean 'optim.learning_rate'?"),
    (["--rolout.batch_size", "1"], "unknown section 'rolout' (did you mean 'rollout'?)"),
    (["0.9"], "unexpected argument '0.9'"),
])
def test_bad_override_keys(tokens, expected):
    assert expected in error(None, tokens)


def test_a_bad_command_line_value_says_where_it_came_from(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("grpo:\n  group_size: 1\nrollout:\n  max_new_tokens: 8\n")
    assert error(str(job), []) == f"{job}: grpo.group_size: expected an integer >= 2, got 1"  # the file's value
    job.write_text("rollout:\n  max_new_tokens: 8\n")
    for tokens, expected in [
            (["--grpo.group_size", "1"], "grpo.group_size: expected an integer >= 2, got 1"),
            (["--rollout.max_new_tokens", "abc"], "rollout.max_new_tokens: expected an integer > 0, got 'abc'")]:
        assert error(str(job), tokens) == f"{expected} (given on the command line)"


@pytest.mark.parametrize("flag, expected", [
    ("--chek", "error: unknown option '--chek' (did you mean '--check'?)"),
    ("--confg", "error: unknown option '--confg' (did you mean '--config'?)"),
    ("--max_stepz", "error: unknown key 'max_stepz' (did you mean 'max_steps'?)"),  # a field's typo stays one
])
def test_a_typo_of_the_command_lines_own_option_is_named_as_one(flag, expected, capsys):
    from astrai.train import main

    assert main([flag, "x"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == expected


# ------------------------------------------------------------------------------------------- cross-field
@pytest.mark.parametrize("tokens,expected", [
    (["--ppo.minibatch_size", "16"], "ppo.minibatch_size: expected <= rollout.batch_size * ppo.group_size (8), got 16"),
    (["--rollout.batch_size", "12"], "ppo.minibatch_size: expected a divisor of rollout.batch_size * ppo.group_size (12), got 8"),
    (["--ppo.micro_batch_size", "16", "--ppo.minibatch_size", "8"],
     "ppo.micro_batch_size: expected <= ppo.minibatch_size (8), got 16"),
    (["--ppo.micro_batch_size", "3"], "ppo.micro_batch_size: expected a divisor of ppo.minibatch_size (8), got 3"),
])
def test_cross_field_checks(tokens, expected):
    assert expected in error(None, tokens)


def test_cross_field_valid_and_code_construction_validates():
    config = load_config(None, ["--rollout.batch_size", "16", "--ppo.minibatch_size", "4", "--ppo.micro_batch_size",
                                "2"])
    assert (config.rollout.batch_size, config.ppo.minibatch_size, config.ppo.micro_batch_size) == (16, 4, 2)
    with pytest.raises(ConfigError, match=r"ppo\.gamma"):
        PPOSection(gamma=2.0)
    assert PPOSection(gamma=1).gamma == 1.0


# ------------------------------------------------------------------------------------------- dump
def test_dump_load_round_trip(tmp_path, extra_metrics):
    config = load_config(None, [
        "--optim.learning_rate", "2e-5", "--output_dir", "1e5", "--data.system_prompt", "yes: no\n#x 'q'",
        "--train.metrics", "[policy/entropy, '1']", "--ppo.value_clip", "null", "--checkpoint.keep_last", "2",
        "--rollout.temperature", "1e-3", "--model.path", "010", "--data.prompt_field", "true"])
    text = dump_config(config)
    assert text.index("checkpoint:") < text.index("train:")  # sorted, sectioned
    again = load_config(write(tmp_path, text, "dumped.yaml"), [])
    assert again == config and config_to_dict(again) == config_to_dict(config)
    assert again.train.output_dir == "1e5" and again.model.path == "010" and again.data.prompt_field == "true"
    assert dump_config(again) == text
    assert load_config(write(tmp_path, dump_config(Config()), "d.yaml"), []) == Config()


def test_config_to_dict_and_from_dict(extra_metrics):
    data = config_to_dict(Config())
    assert set(data) == set(SECTIONS) and data["ppo"]["gamma"] == 1.0
    data["train"]["metrics"].append("x")
    assert Config().train.metrics == []
    assert config_from_dict(data).train.metrics == ["x"]
    with pytest.raises(ConfigError, match="unknown key 'train.foo'"):
        config_from_dict({"train": {"foo": 1}})


# ------------------------------------------------------------------------------------------- train.metrics
def test_train_metrics_are_validated_against_the_metrics_that_exist(tiny_model_dir, tmp_path, capsys):
    from astrai.train import main

    assert load_config(None, ["--train.metrics", "policy/entropy"]).train.metrics == ["policy/entropy"]
    assert error(None, ["--train.metrics", "policy/entropi"]) == \
        "train.metrics: unknown metric 'policy/entropi' (did you mean 'policy/entropy'?); available: policy/entropy"
    assert "'policy/entropy' is not computed by train.type sft" in error(
        None, ["--train.type", "sft", "--train.metrics", "policy/entropy"])
    code = main(["--model.path", str(tiny_model_dir), "--train.output_dir", str(tmp_path / "o"),
                 "--train.metrics", "policy/entropy,critic/values"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "unknown metric 'critic/values'" in err and len(err.splitlines()) == 1


# ------------------------------------------------------------------------------------------- example configs
def test_example_configs_load_and_write_floats_without_a_point_zero_mantissa():
    """YAML 1.2 reads `1e-6` as a float, so the examples write it so (not the YAML 1.1 workaround `1.0e-6`)."""
    import re
    from pathlib import Path

    examples = sorted((Path(__file__).resolve().parents[1] / "configs" / "examples").glob("*.yaml"))
    assert len(examples) >= 6
    for path in examples:
        text = path.read_text()
        assert not re.search(r"\d\.0+e", text, re.IGNORECASE), f"{path.name} writes a float as N.0eX"
        config = load_config(str(path), [])
        assert isinstance(config.optim.learning_rate, float) and config.optim.learning_rate < 1e-3


def test_cross_field_errors_say_where_the_values_came_from(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("train:\n  type: online_grpo\nrollout:\n  generation_batch_size: 8\n")
    with pytest.raises(ConfigError) as err:
        load_config(str(job))
    message = str(err.value)
    assert message.startswith("rollout.generation_batch_size: only used with rollout.dynamic_sampling")
    assert message.endswith(f"(in {job})") and "\n" not in message
    job.write_text("train:\n  type: online_grpo\nrollout:\n  dynamic_sampling: true\n  generation_batch_size: 8\n")
    with pytest.raises(ConfigError, match=r"\(in .*job\.yaml with the command-line overrides\)$"):
        load_config(str(job), ["--rollout.dynamic_sampling", "false"])
    with pytest.raises(ConfigError, match=r"generation_batch_size: only used .*null$"):  # no file: nothing added
        load_config(None, ["--train.type", "online_grpo", "--rollout.generation_batch_size", "8"])


# ------------------------------------------------------------------------------------------- ignored settings
def test_ignored_settings_name_algorithm_fields_the_train_type_does_not_read():
    from astrai.config import ignored_settings

    assert ignored_settings(Config()) == []
    grpo_job = load_config(None, ["--train.type", "online_grpo", "--ppo.critic_layers", "6", "--ppo.vf_coef", "0.5",
                                  "--grpo.group_size", "8", "--dpo.beta", "0.2"])
    assert ignored_settings(grpo_job) == ["ppo.vf_coef", "ppo.critic_layers", "dpo.beta"]
    assert ignored_settings(load_config(None, ["--train.type", "grpo", "--grpo.group_size", "8"])) == []
    sft_job = load_config(None, ["--train.type", "sft", "--grpo.kl_coef", "0"])
    assert ignored_settings(sft_job) == ["grpo.kl_coef"]
    assert ignored_settings(load_config(None, ["--train.type", "dpo", "--dpo.beta", "0.2"])) == []
    # with nothing to divide by, the std settings of a GRPO job are unread too
    none_job = load_config(None, ["--train.type", "online_grpo", "--grpo.scale_rewards", "none",
                                  "--grpo.std_floor", "0.1", "--grpo.std_eps", "0.5"])
    assert ignored_settings(none_job) == ["grpo.std_eps", "grpo.std_floor"]
    assert ignored_settings(load_config(None, ["--train.type", "online_grpo", "--grpo.scale_rewards", "batch",
                                               "--grpo.std_floor", "0.1"])) == []
    # a value equal to the default is not reported: nothing tells it apart from an unset one
    assert ignored_settings(load_config(None, ["--train.type", "sft", "--ppo.gamma", "1.0"])) == []
    # a timeout of calls run in the trainer's process (workers 0): nothing enforces it
    from astrai.config import why_ignored

    tools = ["--train.type", "online_grpo", "--rollout.tools", "[{function: calculator, path: t.py}]",
             "--rollout.tool_timeout_seconds", "5"]
    in_process = load_config(None, tools + ["--rollout.tool_workers", "0"])
    assert ignored_settings(in_process) == ["rollout.tool_timeout_seconds"]
    assert "rollout.tool_workers > 0" in why_ignored(in_process, "rollout.tool_timeout_seconds")
    assert ignored_settings(load_config(None, tools)) == []
    env = load_config(None, ["--train.type", "online_grpo", "--rollout.environment", "{class: Game, path: e.py}",
                             "--rollout.environment_workers", "0", "--rollout.environment_timeout_seconds", "5"])
    assert ignored_settings(env) == ["rollout.environment_timeout_seconds"]
    assert "rollout.environment_workers > 0" in why_ignored(env, "rollout.environment_timeout_seconds")


def test_example_configs_set_nothing_their_train_type_ignores():
    from pathlib import Path

    from astrai.config import ignored_settings

    for path in sorted((Path(__file__).resolve().parents[1] / "configs" / "examples").glob("*.yaml")):
        assert ignored_settings(load_config(str(path), [])) == [], path.name


def test_the_cli_warns_in_one_line_about_ignored_settings(tiny_model_dir, tmp_path, capsys):
    from astrai.train import main

    code = main(["--model.path", str(tiny_model_dir), "--train.output_dir", str(tmp_path / "o"), "--train.type",
                 "online_grpo", "--grpo.group_size", "2", "--rollout.batch_size", "2", "--grpo.minibatch_size", "4",
                 "--grpo.micro_batch_size", "4", "--ppo.critic_layers", "1", "--data.truncation", "left",
                 "--rollout.max_new_tokens", "8", "--data.max_prompt_length", "64", "--rollout.max_turns", "3",
                 "--rollout.tool_workers", "2", "--check"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 0, err
    assert err == ["warning: rollout.max_turns, rollout.tool_workers have no effect on this job (read only with "
                   "rollout.tools or rollout.environment)",  # the reason, not the train type (a fresh-user trial)
                   "warning: ppo.critic_layers has no effect on this job (not read by train.type online_grpo)"]


def test_no_float_field_takes_nan_or_infinity(tmp_path):
    """Issue 42: YAML's .nan / .inf / -.inf are refused in one line for every float field of every section (a NaN
    reward.error_score used to pass --check and poison each failed sample's advantage)."""
    from typing import get_type_hints

    from astrai.config_schema import split_optional

    fields = [(section, f.name) for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)
              if split_optional(get_type_hints(cls)[f.name])[0] is float]
    assert ("reward", "error_score") in fields and len(fields) > 20
    for section, name in fields:
        for text in (".nan", ".inf", "-.inf"):
            message = error(write(tmp_path, f"{section}:\n  {name}: {text}\n"))
            assert f": {section}.{name}: expected " in message and message.endswith(("got nan", "got inf", "got -inf")), message


@pytest.mark.parametrize("text, expected", [
    ('data:\n  system_prompt: "bad \\ud800 text"\n',
     "data.system_prompt: not valid Unicode text (a lone surrogate, U+D800, at character 4)"),
    ('model:\n  lora: {r: 4, target_modules: ["q_proj", "\\udfff"]}\n',
     "model.lora: target_modules: not valid Unicode text (a lone surrogate, U+DFFF, at character 0)"),
    ('reward:\n  functions:\n    - {function: math_exact_match, kwargs: {a: ["x\\udc80"]}}\n',
     "reward.functions.0: kwargs: a: not valid Unicode text (a lone surrogate, U+DC80, at character 1)"),
])
def test_lone_surrogates_in_settings_are_refused(tmp_path, text, expected):
    """Issue 42, class 7: text that cannot be encoded (YAML allows "\\ud800") is refused in one line naming the field,
    not met later as the tokenizer's TypeError traceback."""
    assert error(write(tmp_path, text)).endswith(expected)


@pytest.mark.parametrize("text, field", [
    ("rollout:\n  generation_batch_size: 0\n", "rollout.generation_batch_size"),
    ("ppo:\n  critic_layers: 0\n", "ppo.critic_layers"),
    ("grpo:\n  loss_agg_mode: ''\n", "grpo.loss_agg_mode"),
    ("rollout:\n  dtype: ''\n", "rollout.dtype"),
    ("model:\n  lora:\n    alpha: 0\n", "model.lora"),
])
def test_a_zero_or_empty_value_of_a_field_whose_null_means_a_default_is_refused(tmp_path, text, field):
    """Issue 42, class 2: the fields read as `value if value is not None else default` (they were `value or
    default`, which would turn 0 or '' into the default) refuse 0 and '' in one line naming the field."""
    assert f"job.yaml: {field}" in error(write(tmp_path, text))
