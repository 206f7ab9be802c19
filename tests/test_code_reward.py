"""The ``code_unit_tests`` reward (TRL calling convention), code extraction, and the built-in code tasks."""

from __future__ import annotations

import importlib.util
import json
import threading
import time
from pathlib import Path

import pytest

from astrai.data.prompts import PromptDataset
from astrai.rewards import code as code_reward
from astrai.rewards.code import code_unit_tests, extract_code, make_code_unit_tests, run_completions
from astrai.sandbox.code_tests import parse_tests
from astrai.sandbox.execute import SandboxLimits

REPO = Path(__file__).resolve().parents[1]
ADD_TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(10, 5) == 15", "assert add(0, 0) == 0"]
RIGHT = "def add(a, b):\n    return a + b"


@pytest.mark.parametrize("text, expected", [
    (f"Here:\n```python\n{RIGHT}\n```\nDone.", RIGHT + "\n"),
    (f"```py\nx = 1\n```\nbetter:\n```python\n{RIGHT}\n```", RIGHT + "\n"),  # the last python block
    (f"```python\n{RIGHT}\n```\n```bash\nls\n```", RIGHT + "\n"),  # other languages are skipped
    (f"```\n{RIGHT}\n```", RIGHT + "\n"),  # an untagged block when no python one
    (f"```python3\n{RIGHT}\n```\n```\nnot this\n```", RIGHT + "\n"),  # a tagged block beats an untagged one
    (f"  ```Python\n{RIGHT}\n  ```", RIGHT + "\n"),  # indented fences, tag case ignored
    (f"```python\n{RIGHT}\n    # cut by the length limit", RIGHT + "\n    # cut by the length limit\n"),
    (RIGHT, RIGHT),  # no fence: the whole text
    ("```bash\nls\n```", "```bash\nls\n```"),  # only other languages: the whole text (and it will not run)
])
def test_extract_code(text, expected):
    assert extract_code(text) == expected


def test_reward_scores_with_trl_calling_convention():
    completions = [f"```python\n{RIGHT}\n```", "```python\ndef add(a, b):\n    return a + b if a > 0 else -1\n```",
                   "def add(a, b):\n    return a * b + 100", "no tests for this one",
                   [{"role": "assistant", "content": f"```python\n{RIGHT}\n```"}]]
    tests = [ADD_TESTS, ADD_TESTS, ADD_TESTS, None, ADD_TESTS]
    scores = code_unit_tests(["p"] * 5, completions, tests=tests, answer=["unused"] * 5, difficulty=[1] * 5)
    assert scores == [1.0, 0.5, 0.0, None, 1.0]  # add(-1, 1) and add(0, 0) give -1
    assert code_unit_tests(["p"], ["x = 1"], tests=[[]]) == [None]
    with_setup = code_unit_tests(["p"], ["def root(x):\n    return x ** 0.5"],
                                 tests=[["assert math.isclose(root(2.0), math.sqrt(2))"]], test_setup=["import math"])
    assert with_setup == [1.0]


def test_reward_errors_are_one_line_and_name_the_completion():
    with pytest.raises(ValueError, match="code_unit_tests: got 2 completions but 1 tests entries"):
        code_unit_tests(["p", "q"], ["a", "b"], tests=[ADD_TESTS])
    with pytest.raises(ValueError, match=r"code_unit_tests: tests of completion 1\[0\]: expected only assert"):
        code_unit_tests(["p", "q"], ["a", "b"], tests=[ADD_TESTS, ["print(1)"]])
    with pytest.raises(ValueError, match="reward: a completion must be a string or a list of chat messages"):
        code_unit_tests(["p"], [42], tests=[ADD_TESTS])
    with pytest.raises(ValueError, match="max_workers must be a positive int"):
        run_completions(["a"], [ADD_TESTS], max_workers=0)


def test_concurrency_is_bounded_by_max_workers(monkeypatch):
    running, peak, lock = [0], [0], threading.Lock()
    real = code_reward.run_tests

    def counting(*args, **kwargs):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        try:
            time.sleep(0.05)  # keep runs overlapping long enough to count them
            return real(*args, **kwargs)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(code_reward, "run_tests", counting)
    for workers in (1, 3):
        peak[0] = 0
        reward = make_code_unit_tests(max_workers=workers, limits=SandboxLimits(timeout_s=2.0))
        assert reward(["p"] * 6, [RIGHT] * 6, tests=[ADD_TESTS] * 6) == [1.0] * 6
        assert peak[0] == workers, (workers, peak[0])


def _generator():
    spec = importlib.util.spec_from_file_location("make_code_tasks", REPO / "tools" / "make_code_tasks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_code_tasks_asset_is_fresh_and_loads_as_builtin():
    gen = _generator()
    asset = REPO / "astrai" / "data" / "assets" / "code_tasks.jsonl"
    assert asset.read_text(encoding="utf-8") == gen.render(gen.generate()), "rerun python tools/make_code_tasks.py"
    ds = PromptDataset("builtin:code_tasks")
    assert len(ds) == len(gen.TEMPLATES) * gen.VARIANTS == 48
    rows = [json.loads(line) for line in asset.read_text(encoding="utf-8").splitlines()]
    assert [r.prompt for r in ds] == [r["question"] for r in rows]
    for row in rows:
        assert row["tests"][0] in row["question"] and f"`{row['entry_point']}(" in row["question"]
        assert len(row["tests"]) == gen.NUM_TESTS


def test_code_tasks_reference_answers_pass_and_wrong_ones_fail():
    rows = [json.loads(line) for line in (REPO / "astrai/data/assets/code_tasks.jsonl").read_text().splitlines()]
    tests = [r["tests"] for r in rows]
    right = code_unit_tests([r["question"] for r in rows], [f"```python\n{r['answer']}```" for r in rows],
                            tests=tests, entry_point=[r["entry_point"] for r in rows])
    assert right == [1.0] * len(rows)
    wrong = code_unit_tests(["q"] * len(rows), [f"def {r['entry_point']}(*args):\n    return 0" for r in rows],
                            tests=tests)
    assert max(wrong) <= 0.4 and sum(wrong) / len(wrong) < 0.1, wrong
    for row in rows:  # no constant answer passes more than 3 of 5: an expected value repeats at most 2 times (3 if bool)
        expected = [repr(t.expected) for t in parse_tests(row["tests"])]
        assert max(expected.count(e) for e in expected) <= (3 if expected[0] in ("True", "False") else 2), row
