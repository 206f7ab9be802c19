"""The train-type registry (`astrai.train_types`): every record resolves, and the rules that moved into the records
(step sizes, minibatch checks, the critic's manifest fields and resume rule, legacy files) behave as before."""

import pytest

from astrai import train_types
from astrai.config import TRAIN_TYPES, ConfigError, config_from_dict, ignored_settings
from astrai.config_schema import ConfigError as SchemaConfigError


def test_every_record_names_a_builder_and_a_data_loader_that_exist():
    from astrai.train_types.spec import _resolve

    assert train_types.names() == TRAIN_TYPES == ("online_ppo", "online_grpo", "grpo", "sft", "dpo", "seq", "rm")
    assert train_types.DEFAULT == "online_ppo" == config_from_dict({}).train.type
    for record in train_types.all_train_types():
        assert callable(_resolve(record.builder)) and callable(_resolve(record.data)), record.name
        assert record.summary and "\n" not in record.summary
        config = config_from_dict({"train": {"type": record.name}})
        micro, accumulation = record.step_sizes(config)
        assert micro >= 1 and accumulation >= 1
        assert record.section is None or hasattr(config, record.section)
        if record.group_size_field:
            assert record.online and record.group_size(config) >= 1


def test_unknown_train_type_is_one_line():
    with pytest.raises(ConfigError, match=r"train.type: expected one of 'online_ppo', .*'rm', got 'ppo'"):
        config_from_dict({"train": {"type": "ppo"}})
    with pytest.raises(SchemaConfigError, match="train.type: unknown train type 'ppo'; expected one of: online_ppo"):
        train_types.get("ppo")


def test_step_sizes_come_from_the_train_types_section():
    ppo = config_from_dict({"train": {"type": "online_ppo"}, "ppo": {"minibatch_size": 8, "micro_batch_size": 2}})
    grpo = config_from_dict({"train": {"type": "grpo"}, "grpo": {"minibatch_size": 8, "micro_batch_size": 4}})
    sft = config_from_dict({"train": {"type": "sft", "per_device_train_batch_size": 3,
                                      "gradient_accumulation_steps": 5}})
    assert train_types.get("online_ppo").step_sizes(ppo) == (2, 4)
    assert train_types.get("grpo").step_sizes(grpo) == (4, 2)
    assert train_types.get("sft").step_sizes(sft) == (3, 5)


def test_minibatch_rules_run_only_for_the_train_type_that_reads_the_section():
    bad_ppo = {"ppo": {"minibatch_size": 6}}  # 6 does not divide rollout.batch_size 8
    with pytest.raises(ConfigError, match=r"ppo.minibatch_size: expected a divisor of rollout.batch_size \* "
                                          r"ppo.group_size \(8\), got 6"):
        config_from_dict(dict(bad_ppo, train={"type": "online_ppo"}))
    config_from_dict(dict(bad_ppo, train={"type": "online_grpo"}))  # online_grpo reads grpo, not ppo
    with pytest.raises(ConfigError, match="grpo.kl_reward_coef: KL in the reward and KL in the loss"):
        config_from_dict({"train": {"type": "grpo"}, "grpo": {"kl_coef": 0.1, "kl_reward_coef": 0.1}})
    assert ignored_settings(config_from_dict({"train": {"type": "online_grpo"}, "ppo": {"gamma": 0.5},
                                              "grpo": {"scale_rewards": "none", "std_floor": 0.1}})) == [
        "ppo.gamma", "grpo.std_floor"]


def test_the_critic_rules_live_in_the_online_ppo_record():
    class Model:
        num_hidden_layers = 4

    record = train_types.get("online_ppo")
    full = config_from_dict({})
    small = config_from_dict({"ppo": {"critic_layers": 2}})
    assert record.manifest_fields(full, Model) == {"critic_layers": 4, "policy_layers": 4}
    assert record.manifest_fields(small, Model) == {"critic_layers": 2, "policy_layers": 4}
    held = record.manifest_fields(small, Model)
    assert record.resume_problem(held, small) is None
    assert record.resume_problem({}, small) is None  # not recorded: the parts are checked when they load
    assert record.resume_problem(held, full) == ("its critic has ppo.critic_layers 2, this job builds 4 (all the "
                                                 "policy's); resume with --ppo.critic_layers 2")
    with pytest.raises(ConfigError, match="ppo.critic_layers \\(5\\) exceeds the 4 decoder layers"):
        record.check_model(config_from_dict({"ppo": {"critic_layers": 5}}), Model)
    for name in ("online_grpo", "sft", "dpo"):
        other = train_types.get(name)
        assert other.manifest_fields(full, Model) == {} and other.resume_problem(held, full) is None


def test_legacy_required_files_by_train_type():
    assert train_types.legacy_required_files("online_ppo") == ("value_model.pt", "value_optimizer.pt")
    assert train_types.legacy_required_files("sft") == ()
    assert train_types.legacy_required_files(None) == ()
    assert train_types.legacy_required_files("no_such_type") == ()
