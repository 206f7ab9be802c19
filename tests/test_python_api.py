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


class Countdown:
    """An environment TRL users pass as `environment_factory=Countdown`: importable from this module."""

    def reset(self, start, **row):
        self.steps, self.start = 0, int(start)
        return f" Start at {start}."

    def step(self, message):
        self.steps += 1
        return None if self.steps == 2 else "Again."

    def get_reward(self):
        return float(self.steps == 2) + self.start / 100


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first.
        b: the second.
    """
    return a + b


def test_an_environment_class_and_tool_functions_are_taken_by_their_import_path(tiny_model_dir, tmp_path):
    """`environment_factory=Countdown, tools=[add]` as TRL takes them: named "module:qualname" in the saved job and
    loaded by that name in the environment and tool workers (no JSON error); the environment is the reward."""
    import json
    import shutil

    import yaml

    from astrai import train
    from test_environments import _scripted_seven

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 1024}))
    _scripted_seven(model_dir, "scripted_python_api_test")
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"question": "Count.", "start": s}) + "\n" for s in (10, 30)))
    result = train({"train": {"type": "online_grpo", "output_dir": str(tmp_path / "run"), "progress_bar": False,
                              "report_to": ["none"]},
                    "data": {"path": str(data), "max_prompt_length": 64, "shuffle": False},
                    "rollout": {"batch_size": 1, "max_new_tokens": 96, "engine": "scripted_python_api_test",
                                "max_turns": 3},
                    "checkpoint": {"save_at_end": False}},
                   environment_factory=Countdown, tools=[add], max_steps=1, num_generations=2,
                   **{"model.path": str(model_dir), "grpo.minibatch_size": 2, "grpo.micro_batch_size": 2})
    assert result.global_step == 1
    assert result.metrics[0]["rewards/environment/mean"] == pytest.approx(1.1)
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["rollout"]["environment"] == "test_python_api:Countdown"
    assert [t["function"] for t in saved["rollout"]["tools"]] == ["test_python_api:add"]


def test_a_class_or_function_workers_cannot_import_is_refused_naming_the_field(tmp_path):
    from astrai import train
    from astrai.config import ConfigError

    class Local:
        def reset(self, **row):
            return None

    def shout(text: str) -> str:
        return text

    job = {"train": {"type": "online_grpo", "output_dir": str(tmp_path / "x")}}
    with pytest.raises(ConfigError, match=r"^rollout.environment: .*Local is defined in a function \(a local\), "
                                          r"which the worker processes cannot import; move it into a .py file"):
        train(job, environment_factory=Local)
    shout.__module__, shout.__qualname__ = "__main__", "shout"  # as a notebook cell's function is
    with pytest.raises(ConfigError, match=r"^rollout.tools.1: shout is defined in a notebook or the __main__ script"):
        train(job, tools=[add, shout])
    with pytest.raises(ConfigError, match=r"^rollout.environment.b: .*Local is defined in a function"):
        train({**job, "rollout": {"environment": {"a": Countdown, "b": Local}}})


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
