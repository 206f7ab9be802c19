"""`from astrai import train` (issue 41.10): a notebook or script trains with a config file or dict, overrides by
any CLI name, and reward functions as callables (an importable one runs in the reward workers, a local one in this
process); it returns the run's result and raises bad input instead of exiting."""

import pytest


def length_reward(completions, **kwargs):
    """Importable from this module: runs in a reward worker."""
    return [min(len(c), 10) / 10 for c in completions]


def test_train_is_callable_with_a_dict_overrides_and_reward_callables(tiny_model_dir, tmp_path):
    from astrai import train

    def shouts(completions, **kwargs):  # defined here: runs in this process
        return [float(c.isupper()) for c in completions]

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(f'{{"question": "Say {i}"}}\n' for i in range(4)))
    result = train({"train": {"type": "online_grpo", "output_dir": str(tmp_path / "run"), "progress_bar": False,
                              "report_to": ["none"]},
                    "data": {"path": str(data), "max_prompt_length": 64},
                    "rollout": {"batch_size": 2, "max_new_tokens": 4},
                    "checkpoint": {"save_at_end": True}},
                   reward_funcs=[length_reward, shouts], max_steps=2, num_generations=2,
                   **{"model.path": str(tiny_model_dir), "grpo.minibatch_size": 4, "grpo.micro_batch_size": 2})
    assert result.global_step == 2 and result.policy_version == 2 and result.output_dir == tmp_path / "run"
    assert result.checkpoint is not None and result.checkpoint.name == "step-00000002"
    assert len(result.metrics) == 2
    for record in result.metrics:
        assert {"rewards/length_reward/mean", "rewards/shouts/mean"} <= set(record)
        assert record["rewards/length_reward/failed"] == 0 and record["rewards/shouts/failed"] == 0
    import yaml
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert [f["function"] for f in saved["reward"]["functions"]] == ["test_python_api:length_reward",
                                                                     "python:shouts"]


def test_bad_input_raises_instead_of_exiting(tmp_path):
    from astrai import train
    from astrai.config import ConfigError

    with pytest.raises(ConfigError, match="unknown key 'max_stepz'"):
        train(None, max_stepz=2)
    with pytest.raises(ConfigError, match="config file not found"):
        train(tmp_path / "missing.yaml")
    with pytest.raises(TypeError, match="reward_funcs: expected callables"):
        train({"train": {"output_dir": str(tmp_path / "x")}}, reward_funcs=["not callable"])


def test_the_command_line_still_runs_the_module():
    import astrai.train as module
    from astrai.train import main

    assert callable(module) and callable(main) and module.fit.__doc__
