"""TRL / transformers / verl / OpenRLHF names (issue 41.6): accepted as aliases where the meaning is the same (bare and
inside their section, listed in --help), refused with the right astrai name where it differs; TRL's `beta` is DPO's
in a dpo job and refused elsewhere; did-you-mean knows the aliases."""

import pytest

from astrai.config import ALIASES, REFUSED_NAMES, ConfigError, config_from_dict, load_config


@pytest.mark.parametrize("args, field, value", [
    (["--num_generations", "8"], ("grpo", "group_size"), 8),
    (["--max_completion_length", "32"], ("rollout", "max_new_tokens"), 32),
    (["--num_iterations", "2"], ("grpo", "epochs"), 2),
    (["--epsilon_high", "0.28"], ("grpo", "clip_ratio_high"), 0.28),
    (["--save_total_limit", "3"], ("checkpoint", "keep_last"), 3),
    (["--lr", "2e-5"], ("optim", "learning_rate"), 2e-5),
    (["--max_response_length", "100"], ("rollout", "max_new_tokens"), 100),
    (["--n_samples_per_prompt", "6"], ("grpo", "group_size"), 6),
    (["--grpo.num_generations", "5"], ("grpo", "group_size"), 5),
])
def test_their_names_with_the_same_meaning_set_astrai_fields(args, field, value):
    config = load_config(None, args)
    assert getattr(getattr(config, field[0]), field[1]) == pytest.approx(value)


def test_aliases_work_inside_their_section_in_a_job_file_and_clash_with_the_field():
    assert config_from_dict({"grpo": {"num_generations": 6}}).grpo.group_size == 6
    with pytest.raises(ConfigError, match="grpo.num_generations: set together with grpo.group_size"):
        config_from_dict({"grpo": {"num_generations": 6, "group_size": 4}})


@pytest.mark.parametrize("name", sorted(REFUSED_NAMES))
def test_their_names_with_another_meaning_are_refused_with_what_to_set(name):
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"--{name}", "1"])
    assert str(err.value) == f"{name}: {REFUSED_NAMES[name]}"
    with pytest.raises(ConfigError, match=f"^train.{name}: "):
        config_from_dict({"train": {name: 1}})


def test_beta_is_dpo_beta_in_a_dpo_job_and_refused_elsewhere():
    assert load_config(None, ["--train.type", "dpo", "--beta", "0.3"]).dpo.beta == 0.3
    assert load_config(None, ["--beta=0.2", "--train.type=dpo"]).dpo.beta == 0.2
    with pytest.raises(ConfigError, match=r"^beta: in TRL's GRPOConfig beta is the reference-KL coefficient, "
                                          r"grpo.kl_coef .* train.type online_grpo does not read$"):
        load_config(None, ["--train.type", "online_grpo", "--beta", "0.04"])
    assert load_config(None, ["--train.type", "online_grpo", "--dpo.beta", "0.3"]).dpo.beta == 0.3  # explicit


def test_did_you_mean_knows_the_aliases_and_help_lists_them():
    with pytest.raises(ConfigError, match=r"did you mean 'num_generations'"):
        load_config(None, ["--num_generationz", "3"])
    from astrai.train import fields_help
    text = fields_help()
    for alias, (section, name) in ALIASES.items():
        assert f"--{alias}" in text and f"= --{section}.{name}" in text
    assert "--num_train_epochs" in text
    # every alias names a real field
    from astrai.config import SECTIONS, field_specs
    assert all(name in field_specs(SECTIONS[section]) for section, name in ALIASES.values())


def test_an_alias_and_its_name_together_on_the_command_line_are_refused():
    """As in a job file: `--num_generations 4 --grpo.group_size 2` names one setting twice, which the command line
    used to resolve silently by order (a fresh-user trial); the same spelling repeated keeps the last, as usual."""
    from astrai.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"^--grpo.group_size: set together with --num_generations \(the same "
                                          r"setting, grpo.group_size\); keep one of them$"):
        load_config(None, ["--num_generations", "4", "--grpo.group_size", "2"])
    with pytest.raises(ConfigError, match=r"^--rollout.environment_factory: set together with --rollout.environment"):
        load_config(None, ["--rollout.environment", "a:B", "--rollout.environment_factory", "c:D"])
    assert load_config(None, ["--grpo.group_size", "4", "--grpo.group_size", "2"]).grpo.group_size == 2


@pytest.mark.parametrize("flat, nested", [
    ({"train_type": "sft"}, "train: {type: ...} (--train_type on the command line)"),
    ({"num_generations": 4}, "grpo: {group_size: ...} (--num_generations on the command line)"),
    ({"learning_rate": 1e-6}, "optim: {learning_rate: ...} (--learning_rate on the command line)"),
    ({"beta": 0.04}, "dpo: {beta: ...} (--beta on the command line); TRL's GRPOConfig beta is grpo.kl_coef"),
])
def test_a_flat_job_file_as_trl_writes_it_is_told_each_fields_section(flat, nested):
    """TRL's config files are flat (`num_generations: 4`): a job file's unknown top-level key that names a field
    says which section it belongs in (was: "unknown section 'train_type' (did you mean 'train'?)")."""
    with pytest.raises(ConfigError) as err:
        config_from_dict(flat)
    assert str(err.value) == (f"unknown section '{next(iter(flat))}': a job file nests each field in its section, "
                              + nested)
    with pytest.raises(ConfigError, match=r"^unknown section 'trian' \(did you mean 'train'\?\)$"):
        config_from_dict({"trian": {}})
    with pytest.raises(ConfigError, match="^num_train_epochs: astrai counts optimizer steps"):
        config_from_dict({"num_train_epochs": 3})


@pytest.mark.parametrize("name, hint", [
    ("steps_per_generation", "grpo.minibatch_size"), ("reward_weights", "reward.functions[i].weight"),
    ("importance_sampling_level", "grpo.policy_loss gspo"), ("use_vllm", "rollout.engine vllm"),
])
def test_trl_names_whose_did_you_mean_led_astray_name_the_astrai_setting(name, hint):
    """--steps_per_generation was answered "did you mean 'num_generations'?" and --reward_weights "did you mean
    'reward.model_weight'?": both are other settings."""
    with pytest.raises(ConfigError, match=f"^{name}: .*{hint.replace('[', '.').replace(']', '.')}"):
        load_config(None, [f"--{name}", "1"])


def test_transformers_batch_sizes_in_an_online_job_are_said_to_have_no_effect():
    """TRL's per_device_train_batch_size / gradient_accumulation_steps set on online_grpo or online_ppo were taken
    silently and read by nothing: they are listed as having no effect, naming the sizes that do."""
    from astrai.config import ignored_settings, why_ignored

    for kind, section in (("online_grpo", "grpo"), ("online_ppo", "ppo")):
        config = load_config(None, ["--train.type", kind, "--per_device_train_batch_size", "8",
                                    "--gradient_accumulation_steps", "2"])
        names = ["train.per_device_train_batch_size", "train.gradient_accumulation_steps"]
        assert ignored_settings(config) == names
        assert why_ignored(config, names[0]) == (f"train.type {kind} steps on {section}.minibatch_size samples per "
                                                 f"optimizer step, {section}.micro_batch_size per forward/backward")
    for kind in ("sft", "grpo", "dpo"):
        assert ignored_settings(load_config(None, ["--train.type", kind, "--per_device_train_batch_size", "8"])) == []


def test_rollout_settings_of_a_train_type_that_samples_none_are_said_to_have_no_effect():
    """`rollout.temperature` or `rollout.batch_size` on sft, dpo, rm or seq (`rollout.top_k` on offline grpo) were
    accepted and read by nothing: they are listed, in declaration order, while the fields its evaluations read (the
    in-training one and `astrai.evaluate --model RUN`, from the run's config) are not, except on rm, which reads
    none. Their evaluation engine is a whole copy, so rollout.tensor_parallel_size is one of the unread fields."""
    from astrai.config import ignored_settings, why_ignored

    engine = ["--rollout.dtype", "bfloat16", "--max_completion_length", "16"]
    sampling = ["--rollout.temperature", "0.7", "--rollout.batch_size", "2", "--rollout.max_turns", "3"]
    for kind in ("sft", "dpo", "seq"):
        config = load_config(None, ["--train.type", kind, *sampling, *engine, "--rollout.tensor_parallel_size", "2"])
        names = ["rollout.batch_size", "rollout.temperature", "rollout.tensor_parallel_size", "rollout.max_turns"]
        assert ignored_settings(config) == names, kind
        assert {why_ignored(config, name) for name in names} == {
            f"train.type {kind} samples no rollouts; of rollout it reads only its evaluations' max_new_tokens, "
            "engine, engine_options, dtype, attention_backend, cuda_graphs"}
    rm = load_config(None, ["--train.type", "rm", *sampling, *engine])
    assert ignored_settings(rm) == ["rollout.batch_size", "rollout.max_new_tokens", "rollout.temperature",
                                    "rollout.dtype", "rollout.max_turns"]
    assert why_ignored(rm, "rollout.dtype") == "train.type rm samples no rollouts and reads no rollout field"
    offline = load_config(None, ["--train.type", "grpo", "--rollout.top_k", "5", *sampling[:4], *engine])
    assert ignored_settings(offline) == ["rollout.top_k"]
    assert why_ignored(offline, "rollout.top_k").startswith(
        "train.type grpo samples no rollouts; of rollout it reads only batch_size, temperature and its evaluations' "
        "max_new_tokens, engine")
    assert ignored_settings(load_config(None, ["--train.type", "online_grpo", *sampling[:4], *engine])) == []


def test_correction_thresholds_the_correction_does_not_use_are_said_to_have_no_effect():
    """`rollout.correction_token_cap` with correction none, or icepop's bounds with token_tis, were read by
    nothing and not said."""
    from astrai.config import ignored_settings, why_ignored

    thresholds = ["--rollout.correction_token_cap", "3", "--rollout.correction_seq_cap", "4",
                  "--rollout.icepop_low", "0.3", "--rollout.icepop_high", "4"]
    expected = {"none": ["correction_token_cap", "correction_seq_cap", "icepop_low", "icepop_high"],
                "token_tis": ["correction_seq_cap", "icepop_low", "icepop_high"],
                "seq_tis": ["correction_token_cap", "icepop_low", "icepop_high"],
                "seq_mask": ["correction_token_cap", "icepop_low", "icepop_high"],
                "icepop": ["correction_token_cap", "correction_seq_cap"]}
    for mode, unread in expected.items():
        config = load_config(None, ["--train.type", "online_grpo", "--rollout.correction", mode, *thresholds])
        assert ignored_settings(config) == [f"rollout.{f}" for f in unread], mode
    config = load_config(None, ["--train.type", "online_ppo", "--rollout.icepop_low", "0.3"])
    assert why_ignored(config, "rollout.icepop_low") == "read only with rollout.correction icepop; this job's is none"


@pytest.mark.parametrize("field, value, default", [("max_off_policy_steps", "1", "0"),
                                                   ("generation_processes", "2", "1"),
                                                   ("generation_batch_size", "4", "null"),
                                                   ("generation_threads", "1", "null")])
def test_sampling_process_options_on_a_train_type_that_samples_none_are_refused_as_such(field, value, default):
    """sft with rollout.max_off_policy_steps 1 was told to set rollout.partial true or the placement separate,
    which sft refuses next: now the one line says the job samples no rollouts."""
    from astrai.config import ConfigError

    with pytest.raises(ConfigError, match=f"^rollout.{field}: sets how the online train types sample their "
                                          f"rollouts; train.type sft samples none; set it to {default}$"):
        load_config(None, ["--train.type", "sft", f"--rollout.{field}", value])


def test_an_offline_jobs_tensor_parallel_size_builds_no_mesh(tiny_model_dir, tmp_path, capsys):
    """sft with rollout.tensor_parallel_size 2 was said to have no effect, then refused because 2 does not divide one
    process, or (with train.eval_steps) the heads of its evaluation engine, a whole copy (trials): the job's size
    (`Config.tensor_parallel_size`, the mesh's and the engine's) takes the field only where the train type reads it."""
    from astrai.config import load_config as load
    from astrai.train import main

    assert load(None, ["--train.type", "sft", "--rollout.tensor_parallel_size", "2"]).tensor_parallel_size == 1
    assert load(None, ["--train.type", "online_grpo", "--rollout.tensor_parallel_size", "2"]).tensor_parallel_size == 2
    for extra in ([], ["--train.eval_steps", "1", "--data.eval_path", "builtin:arithmetic_test"]):
        code = main(["--train.type", "sft", "--model.path", str(tiny_model_dir), "--data.path", "builtin:sft_chat",
                     "--train.output_dir", str(tmp_path / "o"), "--data.max_length", "256",
                     "--rollout.tensor_parallel_size", "3", *extra, "--check"])
        err = capsys.readouterr().err
        assert code == 0, err
        assert "warning: rollout.tensor_parallel_size has no effect on this job" in err


def test_data_columns_and_packing_of_other_train_types_are_said_to_have_no_effect():
    """data.packing on dpo, or sft's data.messages_field on online_grpo, were accepted and read by nothing."""
    from astrai.config import ignored_settings, why_ignored

    config = load_config(None, ["--train.type", "dpo", "--data.packing", "true", "--data.margin_field", "m",
                                "--data.messages_field", "chat", "--data.chosen_field", "good"])
    assert ignored_settings(config) == ["data.messages_field", "data.margin_field", "data.packing"]
    assert why_ignored(config, "data.packing") == "read only by the train types that pack: sft and seq"
    assert why_ignored(config, "data.margin_field") == "rm's record columns, which train.type dpo does not read"
    online = load_config(None, ["--train.type", "online_grpo", "--data.max_length", "4096"])
    assert ignored_settings(online) == ["data.max_length"]
    assert why_ignored(online, "data.max_length") == ("train.type online_grpo samples its responses: its rows are "
                                                      "data.max_prompt_length + rollout.max_new_tokens tokens long")
    assert ignored_settings(load_config(None, ["--train.type", "grpo", "--data.max_length", "4096"])) == []
    seq = load_config(None, ["--train.type", "seq", "--data.chosen_field", "good"])
    assert why_ignored(seq, "data.chosen_field") == "dpo's and rm's record columns, which train.type seq does not read"
    for kind, own in (("sft", ["--data.messages_field", "m", "--data.packing", "true"]),
                      ("seq", ["--data.text_field", "t", "--data.packing", "true"]),
                      ("rm", ["--data.margin_field", "m", "--data.rejected_field", "bad"]),
                      ("grpo", ["--data.responses_field", "r", "--data.rewards_field", "s",
                                "--data.logprobs_field", "l"])):
        assert ignored_settings(load_config(None, ["--train.type", kind, *own])) == [], kind


def test_a_held_out_set_without_eval_steps_is_said_to_have_no_effect():
    """`data.eval_path` (and `data.eval_limit`) with `train.eval_steps` 0 were accepted and read by nothing: no
    evaluation ran, and `python -m astrai.evaluate` takes its questions from `--data`. They are listed now, on every
    train type, with the setting that reads them; with eval_steps they are read."""
    from astrai.config import ignored_settings, why_ignored

    held_out = ["--data.eval_path", "builtin:arithmetic_test", "--data.eval_limit", "5"]
    for kind in ("online_grpo", "online_ppo", "grpo", "sft", "dpo", "seq", "rm"):
        config = load_config(None, ["--train.type", kind, *held_out])
        assert ignored_settings(config) == ["data.eval_path", "data.eval_limit"], kind
        assert why_ignored(config, "data.eval_path") == why_ignored(config, "data.eval_limit") == (
            "train.type rm trains a model that answers no prompts, so nothing is evaluated"
            if kind == "rm" else "read only by the in-training evaluation, with "
            "train.eval_steps > 0; python -m astrai.evaluate takes --data"), kind
    assert ignored_settings(load_config(None, ["--train.type", "sft", *held_out[:2]])) == ["data.eval_path"]
    assert ignored_settings(load_config(None, ["--train.type", "online_grpo", *held_out, "--train.eval_steps",
                                               "2"])) == []


RM_SCORES_NOTHING = "train.type rm trains a model that answers no prompts, so nothing is scored"


def test_settings_read_only_beside_another_setting_are_said_to_have_no_effect_without_it():
    """Accepted and read by nothing (an audit of every field against every train type): the critic's learning rate
    without a critic, `optim.decay_ratio` under another schedule, the MoE options without `model.moe_num_experts`
    (nothing is upcycled; an MoE checkpoint keeps its own), the reward model's weight and batch size without
    `reward.model_path`, the reward model on train types that sample nothing (their evaluations leave it out) and
    every reward field and the answer column on rm, which scores no answers."""
    from astrai.config import ignored_settings, why_ignored

    cases = {
        ("online_grpo", "optim.critic_learning_rate", "2e-5"): "read only by the critic of a train type that has one: "
                                                              "online_ppo",
        ("sft", "optim.critic_learning_rate", "2e-5"): "read only by the critic of a train type that has one: "
                                                      "online_ppo",
        ("sft", "optim.decay_ratio", "0.2"): "read only with optim.lr_scheduler_type warmup_stable_decay; this job's "
                                            "is constant",
        ("online_ppo", "model.moe_top_k", "1"): "read only with model.moe_num_experts > 0, to upcycle a "
                                               "dense model; an MoE checkpoint keeps its own settings",
        ("dpo", "model.moe_aux_loss_coef", "0.1"): "read only with model.moe_num_experts > 0, to upcycle a "
                                                  "dense model; an MoE checkpoint keeps its own settings",
        ("online_grpo", "reward.model_weight", "0.5"): "read only with reward.model_path",
        ("online_ppo", "reward.model_batch_size", "3"): "read only with reward.model_path",
        ("sft", "reward.model_path", "/nowhere"): "train.type sft samples no rollouts to score; its evaluations "
                                                 "leave the reward model out",
        ("grpo", "reward.model_path", "/nowhere"): "train.type grpo samples no rollouts to score; its evaluations "
                                                  "leave the reward model out",
        ("rm", "reward.num_workers", "2"): RM_SCORES_NOTHING,
        ("rm", "reward.name", "code_unit_tests"): RM_SCORES_NOTHING,
        ("rm", "data.answer_field", "solution"): RM_SCORES_NOTHING,
    }
    for (kind, name, value), reason in cases.items():
        config = load_config(None, ["--train.type", kind, f"--{name}", value])
        assert ignored_settings(config) == [name], (kind, name)
        assert why_ignored(config, name) == reason, (kind, name)
    read = [("online_ppo", ["--optim.critic_learning_rate", "2e-5"]),
            ("sft", ["--optim.lr_scheduler_type", "warmup_stable_decay", "--optim.decay_ratio", "0.2"]),
            ("online_ppo", ["--model.moe_num_experts", "4", "--model.moe_top_k", "1", "--model.moe_aux_loss_coef",
                            "0.1"]),
            ("online_grpo", ["--reward.model_path", "/nowhere", "--reward.model_weight", "0.5",
                             "--reward.model_batch_size", "3"]),
            ("sft", ["--reward.num_workers", "2", "--reward.name", "code_unit_tests"]),
            ("dpo", ["--reward.functions", '[{"function": "math_exact_match"}]'])]
    for kind, extra in read:
        assert ignored_settings(load_config(None, ["--train.type", kind, *extra])) == [], (kind, extra)
    several = load_config(None, ["--train.type", "rm", "--reward.model_path", "/nowhere", "--reward.model_weight",
                                 "0.5"])
    assert ignored_settings(several) == ["reward.model_path", "reward.model_weight"]
    assert {why_ignored(several, n) for n in ignored_settings(several)} == {
        RM_SCORES_NOTHING}


def test_tool_executor_settings_beside_an_environment_alone_are_said_to_have_no_effect():
    """rollout.tool_workers / tool_timeout_seconds with rollout.environment and no rollout.tools were accepted
    silently (trial): the environment's methods run in its own workers under its own timeout."""
    from astrai.config import ignored_settings, why_ignored

    env = ["--train.type", "online_grpo", "--rollout.environment", "{class: Game, path: e.py}"]
    config = load_config(None, env + ["--rollout.tool_workers", "3", "--rollout.tool_timeout_seconds", "9",
                                      "--rollout.max_turns", "4"])
    assert ignored_settings(config) == ["rollout.tool_workers", "rollout.tool_timeout_seconds"]
    assert why_ignored(config, "rollout.tool_workers") == (
        "read only with rollout.tools (the environment's methods run in its rollout.environment_workers, under "
        "rollout.environment_timeout_seconds)")
    tools = ["--rollout.tools", "[{function: calculator, path: t.py}]", "--rollout.tool_workers", "3"]
    assert ignored_settings(load_config(None, env + tools)) == []


def test_the_default_reward_spelled_out_beside_other_rewards_is_said_to_have_no_effect():
    """reward.name null when unset: `math_exact_match` written out beside reward.model_path (a job file may spell it
    out) or reward.functions was dropped silently; it is said now, with how to add it. Another built-in there is
    refused, as before."""
    from astrai.config import ConfigError, ignored_settings, why_ignored

    named = ["--train.type", "online_ppo", "--reward.name", "math_exact_match"]
    for other in (["--reward.model_path", "/rm"], ["--reward.functions", '[{"function": "code_unit_tests"}]']):
        config = load_config(None, named + other)
        assert ignored_settings(config) == ["reward.name"], other
        assert why_ignored(config, "reward.name") == (
            "reward.functions / reward.model_path replace the single reward.name; to add math_exact_match to them, "
            "list it in reward.functions ({function: math_exact_match})")
        assert ignored_settings(load_config(None, ["--train.type", "online_ppo", *other])) == []
        with pytest.raises(ConfigError, match="^reward.name: 'code_unit_tests'"):
            load_config(None, ["--train.type", "online_ppo", "--reward.name", "code_unit_tests", *other])
