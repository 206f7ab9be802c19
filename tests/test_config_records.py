"""Typed records inside sections (`model.lora`, `reward.functions` items, `data.mixture` files): built from mappings
with one-line errors naming the field, the item and the key; reached by dotted command-line overrides; dumped and
read back unchanged; an older config.yaml's shorter mapping compares equal to today's full one."""

import pytest

from astrai.config import (ConfigError, LoraConfig, MixtureFile, RewardFunction, canonical_value, config_from_dict,
                           config_to_dict, dump_config, load_config)

FUNCTIONS = {"reward": {"functions": [{"function": "math_exact_match"}, {"function": "my:f", "weight": 2}]}}


def test_records_are_typed():
    config = config_from_dict({"model": {"lora": {"r": 8}}, "data": {"mixture": [{"path": "a.jsonl"},
                                                                                  {"path": "b.jsonl", "weight": 3}]},
                               **FUNCTIONS})
    assert config.model.lora == LoraConfig(r=8) and config.model.lora.alpha is None
    assert config.data.mixture == [MixtureFile(path="a.jsonl", weight=1.0), MixtureFile(path="b.jsonl", weight=3.0)]
    assert isinstance(config.data.mixture[1].weight, float)
    assert config.reward.functions == [RewardFunction(function="math_exact_match"),
                                       RewardFunction(function="my:f", weight=2.0)]
    assert config_from_dict({"model": {"lora": {}}}).model.lora is None  # {} = off
    assert config_from_dict({"model": {"lora": {"r": 4, "alpha": None}}}).model.lora.alpha is None  # null = default


@pytest.mark.parametrize("data, message", [
    ({"model": {"lora": {"rank": 8}}}, "model.lora: unknown key 'rank'; keys: r, alpha, dropout"),
    ({"model": {"lora": {"r": 4, "alhpa": 8}}}, "model.lora: unknown key 'alhpa' (did you mean 'alpha'?)"),
    ({"model": {"lora": {"alpha": 8}}}, "model.lora: missing key 'r'"),
    ({"model": {"lora": {"r": 0}}}, "model.lora: r: expected an integer > 0, got 0"),
    ({"model": {"lora": {"r": 4, "dropout": 1}}}, "model.lora: dropout: expected a number in [0, 1), got 1"),
    ({"model": {"lora": {"r": 4, "target_modules": []}}},
     "model.lora: target_modules: expected a non-empty list of module names"),
    ({"model": {"lora": 8}}, "model.lora: expected a mapping with keys r, alpha, dropout, target_modules, use_rslora"),
    ({"reward": {"functions": [{"function": "f"}, {"weight": 1}]}}, "reward.functions.1: missing key 'function'"),
    ({"reward": {"functions": [{"function": "f", "wieght": 1}]}},
     "reward.functions.0: unknown key 'wieght' (did you mean 'weight'?)"),
    ({"reward": {"functions": {"function": "f"}}}, "reward.functions: expected a list of mappings with keys function"),
    ({"data": {"mixture": [{"path": "a", "weight": -1}]}}, "data.mixture.0: weight: expected a number >= 0, got -1"),
    ({"data": {"mixture": [{"path": "a", "weight": 0}, {"path": "b", "weight": 0}]}},
     "data.mixture: every file has weight 0"),
])
def test_a_bad_record_is_one_line_naming_field_item_and_key(data, message):
    with pytest.raises(ConfigError) as info:
        config_from_dict(data)
    assert str(info.value).startswith(message) and "\n" not in str(info.value), str(info.value)


def test_dotted_overrides_reach_into_records():
    config = config_from_dict({"model": {"lora": {"r": 4, "alpha": 16}}}, ["--model.lora.r", "8"])
    assert config.model.lora == LoraConfig(r=8, alpha=16.0)
    assert config_from_dict({}, ["--model.lora.r", "8"]).model.lora == LoraConfig(r=8)  # from off
    assert config_from_dict({}, ["--model.lora.target_modules", "[q_proj, v_proj]", "--model.lora.r=2"]
                            ).model.lora.target_modules == ["q_proj", "v_proj"]
    config = config_from_dict(FUNCTIONS, ["--reward.functions.1.weight", "0.5", "--reward.functions.0.name", "exact"])
    assert [f.weight for f in config.reward.functions] == [1.0, 0.5]
    assert config.reward.functions[0].name == "exact"
    assert config_from_dict({}, ["--model.lora", "{r: 2}"]).model.lora == LoraConfig(r=2)  # the whole value


@pytest.mark.parametrize("overrides, message", [
    (["--reward.functions.2.weight", "1"], "reward.functions.2.weight: reward.functions has 2 function(s), numbered"),
    (["--model.lora.rank", "8"], "model.lora.rank: model.lora has no such key"),
    (["--model.lora.r", "zero"], "model.lora: r: expected an integer > 0, got 'zero'"),
    (["--reward.functions.0.weight", "x"], "reward.functions.0: weight: expected a number, got 'x'"),
    (["--train.max_steps.x", "1"], "train.max_steps.x: train.max_steps has no such key"),
])
def test_a_bad_dotted_override_is_one_line(overrides, message):
    with pytest.raises(ConfigError) as info:
        config_from_dict(FUNCTIONS, overrides)
    assert str(info.value).startswith(message) and "\n" not in str(info.value), str(info.value)


def test_records_dump_and_load_back_unchanged(tmp_path):
    config = config_from_dict({"model": {"lora": {"r": 4, "target_modules": ["q_proj"]}},
                               "data": {"mixture": [{"path": "a.jsonl", "weight": 2}]}, **FUNCTIONS})
    path = tmp_path / "config.yaml"
    path.write_text(dump_config(config))
    assert load_config(str(path)) == config
    assert config_to_dict(config_from_dict({}))["model"]["lora"] == {}  # off is written as it is read
    assert "lora: {}" in dump_config(config_from_dict({}))


def test_an_older_files_shorter_record_compares_equal():
    """resume compares a checkpoint's config.yaml field by field: `model.lora: {r: 4, alpha: 8}` written by an
    older astrai is the same setting as today's full mapping."""
    today = config_to_dict(config_from_dict({"model": {"lora": {"r": 4, "alpha": 8}}}))["model"]["lora"]
    assert canonical_value("model.lora", {"r": 4, "alpha": 8}) == today
    assert canonical_value("model.lora", {}) == {} and canonical_value("model.nope", 3) == 3
    assert canonical_value("model.lora", {"r": "bad"}) == {"r": "bad"}  # not a valid value: left as it is
