"""A user's reward code is loud and isolated: each function's first failure is warned about with its traceback (from
the trainer's process or the worker), a function failing on more than `reward.max_error_fraction` of its own samples
over its last `reward.error_window` rollouts stops the job in one line quoting the failure; the console
line of a logging step counts failed samples; no applicable reward is said once; bools and NumPy scalars are numbers;
`async def` rewards are awaited under the timeout; in-place edits of the arguments reach nobody; a verl
`compute_score` file runs unchanged; and worker processes (and what they started) die with a SIGKILLed trainer."""

import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import pytest
import torch

from astrai.config import config_from_dict
from astrai.rewards.functions import RewardFunctionError, RewardFunctions, resolve_specs

USER_REWARDS = '''
import asyncio, os, subprocess, time
import numpy as np

def good(completions, **kw):
    return [1.0 for _ in completions]

def broken(completions, **kw):
    return [undefined_helper(c) for c in completions]

def fails_on_b(completions, **kw):
    if any(c == "b" for c in completions):
        raise ZeroDivisionError("no b")
    return [1.0 for _ in completions]

def kinds(completions, **kw):
    return [True, 2, np.float32(0.5), np.bool_(False)][:len(completions)]

def never_applies(completions, **kw):
    return [None for _ in completions]

async def async_length(completions, **kw):
    await asyncio.sleep(0.01)
    return [float(len(c)) for c in completions]

async def async_hangs(completions, **kw):
    await asyncio.sleep(100)
    return [0.0 for _ in completions]

def mutates(prompts, completions, target_len, **kw):
    prompts[0] = "EDITED"
    completions[0] = "EDITED"
    target_len.append(99)
    return [0.0 for _ in completions]

def reads(prompts, completions, target_len, **kw):
    return [float(p != "EDITED" and c != "EDITED" and len(target_len) == len(completions))
            for p, c in zip(prompts, completions)]

def spawns_and_sleeps(completions, **kw):
    child = subprocess.Popen(["sleep", "300"])
    with open(os.environ["ASTRAI_TEST_PID_FILE"], "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    time.sleep(300)
    return [0.0 for _ in completions]
'''

VERL_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
    """verl's custom_reward_function signature, returning a dict as verl allows."""
    hit = ground_truth is not None and solution_str.strip().endswith(str(ground_truth))
    return {"score": float(hit) + bonus, "source": data_source, "extra": extra_info}
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
                           max_error_fraction=section.max_error_fraction,
                           error_window=section.error_window)


def score(fns, completions, **columns):
    n = len(completions)
    return fns(["p"] * n, list(completions), [[1]] * n, {"target_len": [1] * n, **columns})


@pytest.mark.parametrize("workers", [0, 1])
def test_an_always_failing_reward_warns_with_its_traceback_then_stops_naming_it(reward_file, workers):
    """Issue 41's case: three functions, one raising NameError on every call, the others fine."""
    fns = rewards(reward_file, [{"function": "my_rewards:good"}, {"function": "my_rewards:broken"},
                                {"function": "my_rewards:fails_on_b"}], num_workers=workers)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            score(fns, ["a", "a"])
            score(fns, ["a", "a"])
        said = [str(w.message) for w in caught]
        assert len(said) == 1, said  # once per function, not per rollout
        assert said[0].startswith("reward.functions.1 (broken) failed on 2 of 2 samples (NameError: name "
                                  "'undefined_helper' is not defined)")
        assert "Traceback (most recent call last)" in said[0] and "my_rewards.py" in said[0]  # the worker's too
        with pytest.raises(RewardFunctionError) as err:
            score(fns, ["a", "a"])  # the window of 3 rollouts is full: 6 of 6 failed
        assert str(err.value) == ("reward.functions.1 (broken) failed on 6 of 6 samples of the last 3 rollouts, "
                                  "more than reward.max_error_fraction 0.5 (reward.error_window 3); its first "
                                  "failure: NameError: name 'undefined_helper' is not defined")
    finally:
        fns.close()


def test_the_command_line_prints_the_first_failures_traceback_line_by_line(reward_file):
    """`python -m astrai.train` prints warnings as one line each; the traceback of a reward's first failure was
    flattened into that line too ('Traceback (most recent call last): File ".../my_rewards.py", line 9, in broken
    return ...'): it keeps its own lines below the warning."""
    import io

    import astrai.train as cli

    fns = rewards(reward_file, [{"function": "my_rewards:broken"}], num_workers=0)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            score(fns, ["a", "a"])
    finally:
        fns.close()
    printed = io.StringIO()
    cli._show_warning(caught[0].message, caught[0].category, "f.py", 1, file=printed)
    lines = printed.getvalue().splitlines()
    assert lines[0].startswith("warning: reward.functions.0 (broken) failed on 2 of 2 samples (NameError: ")
    assert "Traceback" not in lines[0] and lines[1] == "Traceback (most recent call last):"
    assert any(line.strip().startswith("File ") and "my_rewards.py" in line for line in lines[2:])
    assert lines[-1] == "NameError: name 'undefined_helper' is not defined"
    printed = io.StringIO()
    cli._show_warning(UserWarning("one\n  line"), UserWarning, "f.py", 1, file=printed)
    assert printed.getvalue() == "warning: one line\n"


def test_a_warning_met_while_the_step_bar_is_drawn_starts_on_its_own_line():
    """The command line's warning printer clears a progress bar drawn on the same stream first (tqdm.write), so the
    warning is not appended to the bar's line, and the bar is drawn again below it."""
    import io

    from tqdm import tqdm

    import astrai.train as cli

    printed = io.StringIO()
    with tqdm(total=4, desc="train", file=printed, ascii=True) as bar:
        bar.update(1)
        cli._show_warning(UserWarning("slow reward"), UserWarning, "f.py", 1, file=printed)
        bar.update(1)
    text = printed.getvalue()
    lines = text.replace("\r", "\n").split("\n")
    assert "warning: slow reward" in lines  # a line of its own: nothing of the bar before it
    assert text.index("warning: slow reward") < text.rindex("train:")  # the bar is drawn again after it


def test_failures_are_judged_over_the_window_per_function(reward_file):
    """One bad rollout does not end a run; the fraction is each function's own, over its last error_window
    rollouts: fails_on_b fails 4 of 4, then 0 of 4 twice (4 of 12: fine), then 4 of 4 twice more (8 of 12: stop),
    although over both functions that is 8 of 24, not more than half."""
    fns = rewards(reward_file, [{"function": "my_rewards:good"}, {"function": "my_rewards:fails_on_b"}],
                  num_workers=0, max_error_fraction=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for batch in (["b"] * 4, ["a"] * 4, ["a"] * 4, ["b"] * 4):
            score(fns, batch)
        with pytest.raises(RewardFunctionError, match=r"^reward.functions.1 \(fails_on_b\) failed on 8 of 12 "
                                                      r"samples of the last 3 rollouts, more than "
                                                      r"reward.max_error_fraction 0.5 \(reward.error_window 3\); "
                                                      r"its first failure: ZeroDivisionError: no b$"):
            score(fns, ["b"] * 4)
    single = rewards(reward_file, [{"function": "my_rewards:fails_on_b"}], num_workers=0, error_window=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(RewardFunctionError, match="failed on 2 of 2 samples of this rollout"):
            score(single, ["a", "b"])


def test_bools_ints_and_numpy_scalars_are_numbers(reward_file):
    for workers in (0, 1):
        fns = rewards(reward_file, [{"function": "my_rewards:kinds"}], num_workers=workers)
        try:
            assert score(fns, ["a", "b", "c", "d"]).components["kinds"].tolist() == [1.0, 2.0, 0.5, 0.0]
        finally:
            fns.close()


def test_no_applicable_reward_is_said_once(reward_file):
    fns = rewards(reward_file, [{"function": "my_rewards:never_applies"}], num_workers=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert score(fns, ["a", "b"]).total.tolist() == [0.0, 0.0]
        score(fns, ["a", "b"])
    said = [str(w.message) for w in caught]
    assert len(said) == 1 and said[0].startswith("no reward function applies to any of the 2 samples"), said


@pytest.mark.parametrize("workers", [0, 1])
def test_async_rewards_are_awaited(reward_file, workers):
    fns = rewards(reward_file, [{"function": "my_rewards:async_length"}], num_workers=workers)
    try:
        assert score(fns, ["ab", "abcd"]).components["async_length"].tolist() == [2.0, 4.0]
    finally:
        fns.close()


def test_an_async_reward_that_hangs_is_killed_at_the_timeout(reward_file):
    fns = rewards(reward_file, [{"function": "my_rewards:async_hangs"}], num_workers=1, timeout_seconds=1.0,
                  max_error_fraction=1.0)
    try:
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            scored = score(fns, ["a"])
        assert time.perf_counter() - start < 30 and scored.failed["async_hangs"].all()
    finally:
        fns.close()


def test_in_place_edits_reach_neither_the_next_function_nor_the_stored_prompts(reward_file):
    fns = rewards(reward_file, [{"function": "my_rewards:mutates"}, {"function": "my_rewards:reads"}],
                  num_workers=0)
    prompts, completions, lengths = ["p1", "p2"], ["a", "b"], [1, 2]
    scored = fns(prompts, completions, [[1], [2]], {"target_len": lengths})
    assert scored.components["reads"].tolist() == [1.0, 1.0]
    assert prompts == ["p1", "p2"] and completions == ["a", "b"] and lengths == [1, 2]


def test_a_verl_compute_score_file_runs_unchanged(tmp_path):
    """verl's `custom_reward_function: {path, name}`: a bare name with `path`, called per sample with the ground
    truth from `reward_model` (verl's parquet layout), a dict result's "score", and the entry's kwargs."""
    path = tmp_path / "verl_reward.py"
    path.write_text(VERL_REWARD)
    section = config_from_dict({"reward": {"functions": [{"function": "compute_score", "path": str(path),
                                                          "kwargs": {"bonus": 0.5}}]}}).reward
    fns = RewardFunctions(resolve_specs(section, answer_field="answer"), num_workers=1,
                          columns=["data_source", "reward_model", "extra_info"])
    try:
        scored = fns(["q1", "q2"], ["so #### 4", "so #### 5"], [[1], [2]],
                     {"data_source": ["gsm8k", "gsm8k"], "reward_model": [{"ground_truth": "4"}, {"ground_truth": "4"}],
                      "extra_info": [{"index": 0}, {"index": 1}]})
        assert scored.components["compute_score"].tolist() == [1.5, 0.5]
    finally:
        fns.close()
    # without a ground_truth or reward_model column, the job's answer column is the ground truth
    plain = RewardFunctions(resolve_specs(section, answer_field="solution"), num_workers=0, columns=["solution"])
    assert plain(["q"], ["#### 7"], [[1]], {"solution": ["7"]}).components["compute_score"].tolist() == [1.5]


def test_the_console_line_counts_failed_samples(tmp_path):
    from types import SimpleNamespace

    from astrai.trainer.callbacks import MetricsLogger
    lines = []
    logger = MetricsLogger(tmp_path, logging_steps=1, printer=lines.append)
    trainer = SimpleNamespace(state=SimpleNamespace(global_step=1, max_steps=2, policy_version=1))
    logger.on_train_begin(trainer)
    logger.on_step_end(trainer, {"loss": torch.tensor(0.5), "rewards/broken/failed": torch.tensor(8.0),
                                 "rewards/good/failed": torch.tensor(0.0)})
    logger.on_train_end(trainer)
    assert "broken failed on 8 samples" in lines[-1] and "good failed" not in lines[-1], lines


def test_the_console_line_shows_tool_errors_and_the_distillation_kl(tmp_path):
    from types import SimpleNamespace

    from astrai.trainer.callbacks import MetricsLogger
    lines = []
    logger = MetricsLogger(tmp_path, logging_steps=1, printer=lines.append)
    trainer = SimpleNamespace(state=SimpleNamespace(global_step=1, max_steps=3, policy_version=1))
    logger.on_train_begin(trainer)
    logger.on_step_end(trainer, {"loss": torch.tensor(0.5), "rollout/episodes/tool_errors": torch.tensor(0.25),
                                 "distill/reverse_kl": torch.tensor(0.125)})
    trainer.state.global_step = 2
    logger.on_step_end(trainer, {"loss": torch.tensor(0.5), "rollout/episodes/tool_errors": torch.tensor(0.0)})
    logger.on_train_end(trainer)
    assert "tool errors 0.25 per episode" in lines[0] and "reverse_kl 0.125" in lines[0], lines
    assert "tool errors" not in lines[1] and "reverse_kl" not in lines[1], lines


PARENT = '''
import sys, threading, time
sys.path.insert(0, {repo!r})
from astrai.rewards.workers import RewardFunctionSpec, RewardWorkerPool
pool = RewardWorkerPool([RewardFunctionSpec(name="s", function="my_rewards:spawns_and_sleeps", path={path!r})],
                        num_workers=1, timeout_seconds=600)
threading.Thread(target=pool.run, args=(0, [{{"completions": ["a"]}}]), daemon=True).start()
time.sleep(600)
'''


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_workers_and_what_they_started_die_with_a_sigkilled_trainer(reward_file, tmp_path):
    pid_file = tmp_path / "pids"
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    parent = subprocess.Popen([sys.executable, "-c", PARENT.format(repo=repo, path=str(reward_file))],
                              env={**os.environ, "ASTRAI_TEST_PID_FILE": str(pid_file)})
    try:
        deadline = time.monotonic() + 120
        while not (pid_file.exists() and pid_file.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.1)
        worker, grandchild = map(int, pid_file.read_text().split())
        assert _alive(worker) and _alive(grandchild)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 10
        while (_alive(worker) or _alive(grandchild)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(worker) and not _alive(grandchild)
    finally:
        parent.kill()
        parent.wait()


def test_a_training_run_with_one_broken_reward_of_three_stops_in_one_line(reward_file, tiny_model_dir, tmp_path,
                                                                          capsys):
    """Issue 41's journey end to end: three reward functions, one raising NameError on every call. The run warns
    once with its traceback, counts it on each logging step's console line, and stops at the third rollout with
    one line naming it (exit 2), keeping no broken checkpoint."""
    from astrai.train import main

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(f'{{"question": "What is {i} + 1?", "answer": "#### {i + 1}"}}\n' for i in range(8)))
    job = tmp_path / "job.yaml"
    job.write_text(textwrap.dedent(f"""\
        train: {{type: online_grpo, max_steps: 5, output_dir: {tmp_path / 'run'}, progress_bar: false,
                report_to: [none]}}
        data: {{path: {data}, max_prompt_length: 64}}
        reward:
          functions:
            - {{function: "my_rewards:good", path: {reward_file}}}
            - {{function: "my_rewards:broken", path: {reward_file}}}
            - {{function: math_exact_match}}
        rollout: {{batch_size: 2, max_new_tokens: 4}}
        grpo: {{group_size: 2, minibatch_size: 4, micro_batch_size: 2}}
        checkpoint: {{save_at_end: false}}
        """))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["--config", str(job), "--model.path", str(tiny_model_dir)]) == 2
    said = [str(w.message) for w in caught if "reward.functions.1 (broken)" in str(w.message)]
    assert len(said) == 1 and "NameError: name 'undefined_helper' is not defined" in said[0] and "Traceback" in said[0]
    out, err = capsys.readouterr()
    assert "broken failed on 4 samples" in out  # the console line of steps 1 and 2
    last = err.strip().splitlines()[-1]
    assert "reward.functions.1 (broken) failed on 12 of 12 samples of the last 3 rollouts" in last, err
    records = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(records) == 2  # steps 1 and 2 trained; the third rollout stopped the job



def test_an_empty_or_slashed_metric_name_is_refused_not_replaced():
    """reward.functions.N.name "" used to become the function's name silently (`name or ...`); a "/" would split
    the metric's path."""
    from astrai.config import ConfigError
    for bad in ("", "a/b", "two words"):
        with pytest.raises(ConfigError, match=r"^reward.functions.0: name: expected null or a metric name"):
            config_from_dict({"reward": {"functions": [{"function": "m:f", "name": bad}]}})
    assert config_from_dict({"reward": {"functions": [{"function": "m:f", "name": "len-2.v1"}]}})
