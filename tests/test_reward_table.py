"""The one table of built-in rewards (`BUILTIN_REWARDS`) as the job's reward functions see it: the single
`reward.name` form and a `reward.functions` entry of the same built-in score alike, what evaluation scores with
(`evaluation_specs`), the options of the single-reward form, and a failing reward warned about once."""

from __future__ import annotations

import textwrap
import warnings

import pytest
import torch

from astrai.config import config_from_dict
from astrai.rewards.build import answer_extractor, answer_readers, evaluation_specs, reward_specs
from astrai.rewards.builtins import BUILTIN_REWARDS, extract_final_number
from astrai.rewards.functions import RewardFunctionError, RewardFunctions, resolve_specs

TEXTS = ["#### 42", "The answer is 41.", "63 - 43 = 22", "no idea", "#### 20", "It is -3"]
ANSWERS = ["#### 42", "#### 42", "#### 20", "#### 5", "#### 20", "x\n#### -3"]


def score(reward_section: dict, *, answer_field: str = "answer", columns=None):
    section = config_from_dict({"reward": reward_section}).reward
    fns = RewardFunctions(resolve_specs(section, answer_field=answer_field), columns=["answer"], num_workers=0)
    try:
        return fns(["q"] * len(TEXTS), TEXTS, [[1]] * len(TEXTS), columns or {"answer": ANSWERS})
    finally:
        fns.close()


@pytest.mark.parametrize("options", [{}, {"format_bonus": 0.1, "partial_credit": 0.5}])
def test_reward_name_and_a_functions_entry_of_the_same_builtin_score_identically(options):
    by_name = score({"name": "math_exact_match", **options})
    by_entry = score({"functions": [{"function": "math_exact_match", "kwargs": options}]})
    assert torch.equal(by_name.total, by_entry.total)
    assert torch.equal(by_name.components["math_exact_match"], by_entry.components["math_exact_match"])
    # hand values: right, near miss (41 for 42), near miss (22 for 20), no number, right, right; marked answers
    # get the bonus
    bonus, credit = options.get("format_bonus", 0.0), options.get("partial_credit", 0.0)
    expected = [1 + bonus, credit * (1 - 1 / 42), credit * 0.9, 0.0, 1 + bonus, 1.0]
    assert by_name.total.tolist() == pytest.approx(expected)


def test_the_answer_column_is_the_jobs_answer_field():
    solutions = {"solution": ANSWERS, "answer": ["#### 0"] * len(ANSWERS)}
    section = config_from_dict({"reward": {"name": "math_exact_match"}}).reward
    (spec,) = resolve_specs(section, answer_field="solution")
    assert spec.kwargs["answer_field"] == "solution"
    fns = RewardFunctions([spec], columns=["solution", "answer"], num_workers=0)
    assert fns(["q"] * 6, TEXTS, [[1]] * 6, solutions).total.tolist() == [1.0, 0.0, 0.0, 0.0, 1.0, 1.0]


def test_single_reward_form_passes_its_options_only_to_a_builtin_that_takes_them():
    code = resolve_specs(config_from_dict({"reward": {"name": "code_unit_tests"}}).reward, answer_field="answer")
    assert [(s.function, dict(s.kwargs)) for s in code] == [("code_unit_tests", {})]  # reads no answers either
    RewardFunctions(code, columns=["tests"], num_workers=0).close()
    section = config_from_dict({"reward": {"name": "code_unit_tests", "format_bonus": 0.2}}).reward
    set_but_unused = resolve_specs(section, answer_field="answer")
    with pytest.raises(RewardFunctionError, match="code_unit_tests takes no argument 'format_bonus'"):
        RewardFunctions(set_but_unused, columns=["tests"], num_workers=0)


def test_evaluation_scores_with_the_jobs_functions_without_the_reward_model(tmp_path):
    functions = [{"function": "mod:length", "path": str(tmp_path / "mod.py"), "weight": 2.0, "name": "len"},
                 {"function": "math_exact_match", "kwargs": {"format_bonus": 0.1}}]
    job = config_from_dict({"reward": {"functions": functions, "model_path": str(tmp_path / "rm")},
                            "data": {"answer_field": "solution"}})
    specs = evaluation_specs(job)
    assert [(s.name, s.weight) for s in specs] == [("len", 2.0), ("math_exact_match", 1.0)]
    assert [s.name for s in specs] == [s.name for s in reward_specs(job)]  # the same as training's, in order
    assert specs[1].kwargs == {"format_bonus": 0.1, "answer_field": "solution"}
    assert answer_readers(specs) == [specs[1]] and answer_extractor(specs) is extract_final_number
    # a job scored by its reward model alone: training has no function, evaluation scores with reward.name
    alone = config_from_dict({"reward": {"model_path": str(tmp_path / "rm")}})
    assert reward_specs(alone) == []
    assert [s.function for s in evaluation_specs(alone)] == ["math_exact_match"]
    # --reward NAME: that one built-in with its default options, told the answer column when it reads one
    (override,) = evaluation_specs(job, reward="math_exact_match", answer_field="gold")
    assert (override.name, dict(override.kwargs), override.weight) == ("math_exact_match", {"answer_field": "gold"}, 1)
    (code,) = evaluation_specs(job, reward="code_unit_tests")
    assert dict(code.kwargs) == {} and answer_readers([code]) == [] and answer_extractor([code]) is None


def test_a_failing_reward_is_warned_once_with_its_traceback_and_counted(tmp_path):
    (tmp_path / "flaky.py").write_text(textwrap.dedent("""\
        def flaky(prompts, completions, **kw):
            if "b" in completions:
                raise ZeroDivisionError("no b here")
            return [1.0 for _ in completions]
        """))
    entry = {"function": "flaky:flaky", "path": str(tmp_path / "flaky.py")}
    section = config_from_dict({"reward": {"functions": [entry], "max_error_fraction": 1.0}}).reward
    fns = RewardFunctions(resolve_specs(section, answer_field="answer"), columns=[], num_workers=0,
                          max_error_fraction=section.max_error_fraction)
    with pytest.warns(UserWarning) as caught:
        first = fns(["p", "p"], ["a", "b"], [[1], [2]], {})
    (warning,) = caught
    text = str(warning.message)
    assert text.startswith("reward.functions.0 (flaky) failed on 2 of 2 samples (ZeroDivisionError: no b here)")
    assert "Traceback (most recent call last)" in text and 'raise ZeroDivisionError("no b here")' in text
    assert first.failed["flaky"].tolist() == [True, True] and first.total.tolist() == [0.0, 0.0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second failure is only counted
        again = fns(["p"], ["b"], [[1]], {})
    assert again.failed["flaky"].tolist() == [True]


def test_every_builtin_is_servable_by_name():
    columns = ["answer", "tests"]
    for name, record in BUILTIN_REWARDS.items():
        fns = RewardFunctions(resolve_specs(config_from_dict({"reward": {"name": name}}).reward,
                                            answer_field="answer"), columns=columns, num_workers=0)
        assert fns.names == [name] and callable(record.load())
        fns.close()
