"""Reward functions by import path (`reward.functions`): TRL's calling convention, weights, None, metrics, worker
processes with a hard timeout, failures counted not fatal, bugs refused in one line; and a user's reward file on a
parquet prompt set with extra columns driving an online_grpo run."""

import json
import textwrap
import time

import pytest
import torch

from astrai.config import config_from_dict
from astrai.rewards.functions import (RewardFunctionError, RewardFunctions, reward_metrics, resolve_specs)

USER_REWARDS = '''
import os, time

def length_match(prompts, completions, target_len, **kwargs):
    """1 when the completion has target_len characters, less the further off it is; None without a target."""
    return [None if t is None else max(0.0, 1.0 - abs(len(c) - t) / 10) for c, t in zip(completions, target_len)]

def shout(completions, **kwargs):
    return [float(c.isupper()) for c in completions]

def only_named(prompts, completions, level):
    return [float(level) for _ in completions]

def positional_only(prompts, completions, /):
    return [0.0 for _ in completions]

def needs_missing(prompts, completions, nowhere):
    return [0.0 for _ in completions]

def needs_missing_with_kwargs(prompts, completions, nowhere, **kwargs):
    return [0.0 for _ in completions]

def too_few(prompts, completions, **kw):
    return [0.0]

def not_finite(prompts, completions, **kw):
    return [float("nan") for _ in completions]

def text(prompts, completions, **kw):
    return ["yes" for _ in completions]

def slow(prompts, completions, **kw):
    with open(os.environ["ASTRAI_TEST_SLEEP_FILE"]) as f:  # read at call time: workers outlive env changes
        time.sleep(float(f.read()))
    return [1.0 for _ in completions]

def crash(prompts, completions, **kw):
    os._exit(3)

def fails_on_b(prompts, completions, **kw):
    if any(c == "b" for c in completions):
        raise ZeroDivisionError("no b")
    return [1.0 for _ in completions]

def seen(prompts, completions, completion_ids, **kw):
    return [float(len(ids)) for ids in completion_ids]
'''


@pytest.fixture()
def reward_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(USER_REWARDS)
    return path


def rewards(reward_file, entries, *, columns=("target_len",), **options):
    section = config_from_dict({"reward": {"functions": [dict(e, path=str(reward_file)) for e in entries],
                                           **options}}).reward
    return RewardFunctions(resolve_specs(section, answer_field="answer"), columns=columns,
                           num_workers=section.num_workers, timeout_seconds=section.timeout_seconds,
                           on_error=section.on_error, error_score=section.error_score,
                           max_error_fraction=section.max_error_fraction, error_window=section.error_window)


def test_weighted_sum_skips_none_and_each_reward_is_logged(reward_file):
    fns = rewards(reward_file, [{"function": "my_rewards:length_match", "weight": 2.0},
                                {"function": "my_rewards:shout", "weight": 0.5, "name": "loud"}], num_workers=0)
    texts = ["abcd", "ABC", "abcdefghijkl"]
    scored = fns(["p1", "p2", "p3"], texts, [[1], [2], [3]], {"target_len": [4, None, 2]})
    # length_match: 1.0, None, 0.0 (|12 - 2| = 10); shout: 0, 1, 0
    assert torch.allclose(scored.total, torch.tensor([2.0 * 1.0 + 0.0, 0.5 * 1.0, 0.0]))
    assert torch.isnan(scored.components["length_match"][1])
    metrics = reward_metrics(scored.components, scored.failed)
    assert metrics["rewards/length_match/mean"] == pytest.approx(0.5)  # over the two that apply
    assert metrics["rewards/length_match/applies"] == pytest.approx(2 / 3)
    assert metrics["rewards/loud/mean"] == pytest.approx(1 / 3) and metrics["rewards/loud/failed"] == 0


def test_chat_prompts_get_message_completions_and_only_declared_arguments(reward_file):
    fns = rewards(reward_file, [{"function": "my_rewards:only_named", "kwargs": {"level": 3}},
                                {"function": "my_rewards:seen"}], num_workers=0)
    chat = [{"role": "user", "content": "hi"}]
    scored = fns([chat, "plain"], ["x", "y"], [[5, 6, 7], [8]], {"target_len": [1, 2]})
    assert scored.components["only_named"].tolist() == [3.0, 3.0]  # target_len not passed: not declared
    assert scored.components["seen"].tolist() == [3.0, 1.0]
    from astrai.rewards.builtins import completion_text
    assert completion_text([{"role": "assistant", "content": "z"}]) == "z"


@pytest.mark.parametrize("function, kwargs, needle", [
    ("my_rewards:positional_only", {}, "has positional-only parameters"),
    ("my_rewards:needs_missing", {}, "parameter 'nowhere' of my_rewards:needs_missing is neither a column"),
    ("my_rewards:needs_missing_with_kwargs", {}, "parameter 'nowhere' of my_rewards:needs_missing_with_kwargs is"),
    ("my_rewards:only_named", {"level": 1, "extra": 2}, "takes no argument 'extra'"),
    ("my_rewards:nothing_here", {}, "has no attribute 'nothing_here'"),
    ("nowhere_module_xyz:fn", {}, "cannot import nowhere_module_xyz: ModuleNotFoundError"),
])
def test_bad_functions_are_refused_at_start_up_in_one_line(reward_file, function, kwargs, needle):
    path = None if function.startswith("nowhere") else reward_file
    section = config_from_dict({"reward": {"functions": [{"function": function, "kwargs": kwargs,
                                                          **({"path": str(path)} if path else {})}]}}).reward
    with pytest.raises(RewardFunctionError) as err:
        RewardFunctions(resolve_specs(section, answer_field="answer"), columns=["target_len"], num_workers=0)
    assert needle in str(err.value) and str(err.value).startswith("reward.functions.0 (") and "\n" not in str(err.value)
    # a built-in's options are its named parameters: a misspelt one is refused although it takes **columns
    typo = config_from_dict({"reward": {"functions": [{"function": "math_exact_match",
                                                       "kwargs": {"partial_credt": 0.2}}]}}).reward
    with pytest.raises(RewardFunctionError, match="math_exact_match takes no argument 'partial_credt'"):
        RewardFunctions(resolve_specs(typo, answer_field="answer"), columns=["answer"], num_workers=0)
    # ... while a user function with **kwargs may be given any key
    free = config_from_dict({"reward": {"functions": [{"function": "my_rewards:shout", "path": str(reward_file),
                                                       "kwargs": {"anything": 1}}]}}).reward
    RewardFunctions(resolve_specs(free, answer_field="answer"), columns=[], num_workers=0).close()
    with pytest.raises(RewardFunctionError, match="unknown built-in reward 'nope'"):
        RewardFunctions(resolve_specs(config_from_dict({"reward": {"functions": [{"function": "nope"}]}}).reward,
                                      answer_field="answer"), columns=[])


@pytest.mark.parametrize("function, needle", [("too_few", "returned 1 values for 2 completions"),
                                              ("not_finite", "value 0 is nan; rewards must be finite"),
                                              ("text", "value 0 is 'yes', expected a number or None")])
@pytest.mark.parametrize("workers", [0, 1])
def test_wrong_returns_are_bugs_named_in_one_line(reward_file, function, needle, workers):
    fns = rewards(reward_file, [{"function": f"my_rewards:{function}"}], num_workers=workers)
    try:
        with pytest.raises(RewardFunctionError, match=f"reward\\.functions\\.0 \\({function}\\): {needle}"):
            fns(["a", "b"], ["x", "y"], [[1], [2]], {"target_len": [1, 2]})
    finally:
        fns.close()


def test_a_hanging_reward_is_killed_at_the_timeout_and_counted(reward_file, monkeypatch, tmp_path):
    sleep = tmp_path / "sleep"
    sleep.write_text("100")
    monkeypatch.setenv("ASTRAI_TEST_SLEEP_FILE", str(sleep))
    fns = rewards(reward_file, [{"function": "my_rewards:slow"}, {"function": "my_rewards:shout"}],
                  num_workers=2, timeout_seconds=1.5, max_error_fraction=0.6, error_score=-1.0)
    try:
        start = time.perf_counter()
        scored = fns(["a"] * 4, ["x", "Y", "z", "W"], [[1]] * 4, {"target_len": [1] * 4})
        took = time.perf_counter() - start
        assert 1.5 <= took < 15, took  # bounded by the timeout (plus the workers' start), not by the 100 s sleep
        assert scored.failed["slow"].all() and not scored.failed["shout"].any()
        assert scored.components["slow"].tolist() == [-1.0] * 4  # on_error score: error_score
        assert scored.total.tolist() == [-1.0, 0.0, -1.0, 0.0]
        assert fns.pool.restarts == 2  # both workers of the timed-out call were killed
        sleep.write_text("0")  # the next call (fresh workers for the killed ones) succeeds
        assert fns(["a"] * 2, ["x", "y"], [[1]] * 2, {"target_len": [1, 1]}).components["slow"].tolist() == [1, 1]
    finally:
        fns.close()


def test_crashes_and_exceptions_are_counted_and_too_many_stop_the_job(reward_file):
    fns = rewards(reward_file, [{"function": "my_rewards:fails_on_b"}, {"function": "my_rewards:crash"}],
                  num_workers=2, on_error="skip", max_error_fraction=0.9)
    try:
        scored = fns(["p"] * 4, ["a", "a", "b", "a"], [[1]] * 4, {"target_len": [0] * 4})
        # worker chunks [0, 2) and [2, 4): the second holds "b" and raises; crash kills both of its workers
        assert scored.failed["fails_on_b"].tolist() == [False, False, True, True]
        assert scored.failed["crash"].all() and torch.isnan(scored.components["crash"]).all()
        assert scored.total.tolist() == [1.0, 1.0, 0.0, 0.0]
    finally:
        fns.close()
    strict = rewards(reward_file, [{"function": "my_rewards:fails_on_b"}], num_workers=0, max_error_fraction=0.25,
                     error_window=1)
    with pytest.raises(RewardFunctionError, match=r"reward.functions.0 \(fails_on_b\) failed on 2 of 2 samples of "
                                                  r"this rollout, more than reward.max_error_fraction 0.25 "
                                                  r"\(reward.error_window 1\); its first failure: ZeroDivisionError: "
                                                  r"no b"):
        strict(["p"] * 2, ["a", "b"], [[1]] * 2, {"target_len": [0, 0]})


def test_config_refuses_ambiguous_reward_settings():
    from astrai.config import ConfigError
    with pytest.raises(ConfigError, match="reward.name: 'x' is set together with reward.functions"):
        config_from_dict({"reward": {"name": "x", "functions": [{"function": "a:b"}]}})
    with pytest.raises(ConfigError, match="reward.functions.1: missing key 'function'"):
        config_from_dict({"reward": {"functions": [{"function": "a:b"}, {"weight": 1}]}})
    old = resolve_specs(config_from_dict({"reward": {"partial_credit": 0.3}}).reward, answer_field="solution")
    assert [(s.function, s.kwargs) for s in old] == [("math_exact_match", {"format_bonus": 0.0, "partial_credit": 0.3,
                                                                           "answer_field": "solution"})]


def test_a_user_reward_file_on_a_parquet_prompt_set_trains_online_grpo(reward_file, tiny_model_dir, tmp_path):
    """The user's reward file outside the package, a parquet prompt set with an extra column (`target_len`, no
    answers at all), two weighted functions in a worker process: online_grpo trains 2 steps and logs each reward."""
    import datasets

    from astrai.train import main

    rows = [{"question": f"Say something {i}", "target_len": 4 + i % 3} for i in range(8)]
    data = tmp_path / "prompts.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(data))
    job = tmp_path / "job.yaml"
    job.write_text(textwrap.dedent(f"""\
        train: {{type: online_grpo, max_steps: 2, output_dir: {tmp_path / 'run'}, progress_bar: false,
                report_to: [none]}}
        data: {{path: {data}, max_prompt_length: 64}}
        reward:
          functions:
            - {{function: "my_rewards:length_match", path: {reward_file}, weight: 1.0}}
            - {{function: "my_rewards:shout", path: {reward_file}, weight: 0.5, name: loud}}
          num_workers: 1
        rollout: {{batch_size: 2, max_new_tokens: 6}}
        grpo: {{group_size: 2, minibatch_size: 4, micro_batch_size: 2}}
        checkpoint: {{save_at_end: false}}
        """))
    assert main(["--config", str(job), "--model.path", str(tiny_model_dir)]) == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2
    for r in records:
        assert {"rewards/length_match/mean", "rewards/loud/mean", "rewards/loud/failed", "time/reward_seconds"} <= set(r)
        assert r["rewards/length_match/failed"] == 0
        total = r["rewards/length_match/mean"] * r["rewards/length_match/applies"] + 0.5 * r["rewards/loud/mean"]
        assert r["rollout/reward_mean"] == pytest.approx(total, abs=1e-5)
