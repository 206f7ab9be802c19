"""Rule-based rewards: final-number extraction, math exact match (TRL's calling convention), the one table of
built-ins, and GSM8K gold answers."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from astrai.rewards.builtins import (
    BUILTIN_REWARDS,
    BuiltinReward,
    closeness,
    extract_final_number,
    has_marked_answer,
    math_exact_match,
    numbers_equal,
)

GSM8K_TEST = Path(__file__).resolve().parents[2] / "shared/data/gsm8k/test.jsonl"


def exact(responses: list, answers: list, **kw) -> list[float]:
    """`math_exact_match` in TRL's convention over the column `answer` (prompts unused)."""
    out = math_exact_match([""] * len(responses), responses, answer=answers, **kw)
    assert isinstance(out, list) and all(isinstance(v, float) for v in out)
    return out


def score(response: str, answer: str, **kw) -> float:
    (out,) = exact([response], [answer], **kw)
    return out


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The answer is 42.", "42"),
        ("12 + 30 = 42\n#### 42", "42"),
        ("#### 41 and later 42", "41"),  # first number after the last marker
        ("#### 3\nwait\n#### 4", "4"),  # last marker wins
        ("So the total is \\boxed{7}.", "7"),
        ("\\boxed{1} then \\boxed{x = 9} done 12", "9"),  # boxed beats the trailing number
        ("\\boxed{\\frac{3}{4}}", "3/4"),
        ("It costs $1,200 in total.", "1200"),
        ("Total: $1,234,567.", "1234567"),
        ("The temperature is -5 degrees.", "-5"),
        ("x = -$3", "-3"),
        ("10-4 gives 6, then 6 - 2", "2"),  # subtraction, not negative numbers
        ("He pays $2.50.", "2.50"),
        ("She has 12.", "12"),
        ("Use 1/2 cup", "1/2"),
        ("1,200, and then 300", "300"),
        ("First 3 apples, then 5 apples, so 8", "8"),
        ("no digits here", None),
        ("", None),
    ],
)
def test_extract_final_number(text, expected):
    assert extract_final_number(text) == expected


@pytest.mark.parametrize(
    "response, answer, expected",
    [
        ("The answer is 42.", "#### 42", 1.0),
        ("#### 41", "#### 42", 0.0),
        ("The result is \\boxed{7}", "Some work.\n#### 7", 1.0),
        ("They paid $1,200.", "#### 1,200", 1.0),
        ("They paid $1,200.", "1200", 1.0),
        ("It drops to -3 degrees.", "#### -3", 1.0),
        ("It rises to 3 degrees.", "#### -3", 0.0),
        ("Each costs $2.50", "#### 2.5", 1.0),
        ("5.0", "#### 5", 1.0),
        ("half: 1/2", "#### 0.5", 1.0),
        ("I do not know.", "#### 5", 0.0),
        ("Earlier 5, but finally 6", "#### 5", 0.0),  # the last number wins
        ("Earlier 6, but finally 5", "#### 5", 1.0),
        ("#### 10", "#### ten", 0.0),  # non-numeric gold compares as text
        ("#### ten", "#### ten", 0.0),  # ...but a response needs a number
    ],
)
def test_math_exact_match_cases(response, answer, expected):
    assert score(response, answer) == expected


def test_format_bonus():
    responses = ["#### 42", "#### 41", "The answer is 42.", "#### none"]
    answers = ["#### 42"] * 4
    assert exact(responses, answers) == [1.0, 0.0, 1.0, 0.0]
    assert exact(responses, answers, format_bonus=0.25) == [1.25, 0.25, 1.0, 0.0]
    assert has_marked_answer("a\n#### $1,000") and not has_marked_answer("####") and not has_marked_answer("42")


@pytest.mark.parametrize(
    "predicted, gold, expected",
    [
        ("22", "20", 0.9),  # 1 - 2/20
        ("97", "20", 0.0),  # an error as large as the answer itself scores nothing
        ("129", "119", 1 - 10 / 119),
        ("20", "20", 1.0),
        ("20.0", "20", 1.0),
        ("1", "0", 0.0),  # |gold| < 1 counts as 1
        ("0.5", "0", 0.5),
        ("-5", "5", 0.0),
        ("1/2", "1", 0.5),
        (None, "20", 0.0),
        ("12", "twelve", 0.0),  # a gold answer that is not a number: no credit
    ],
)
def test_closeness(predicted, gold, expected):
    assert closeness(predicted, gold) == pytest.approx(expected, abs=1e-12)


def test_partial_credit_scores_near_misses_below_a_right_answer():
    answers = ["63 - 43 = 20\n#### 20"] * 4 + ["#### 119"]
    responses = ["63 - 43 = 22.", "To add 63 and 43: 63 + 43 = 97.", "63 - 43 = 20", "I do not know.", "#### 129"]
    assert exact(responses, answers) == [0.0, 0.0, 1.0, 0.0, 0.0]
    shaped = exact(responses, answers, partial_credit=0.5)
    assert shaped == pytest.approx([0.45, 0.0, 1.0, 0.0, 0.5 * (1 - 10 / 119)])
    # with the format bonus on top, a marked near miss gets both; a right answer never gets partial credit
    both = exact(["#### 22", "#### 20"], ["#### 20"] * 2, partial_credit=0.5, format_bonus=0.1)
    assert both == pytest.approx([0.55, 1.1])


def test_batch_length_mismatch_missing_column_and_chat_completions():
    assert exact(["1", "2", "3"], ["1", "5", "3"]) == [1.0, 0.0, 1.0]
    assert exact([], []) == []
    with pytest.raises(ValueError, match="reward: got 2 responses but 1 answers"):
        exact(["1", "2"], ["1"])
    # the column named by answer_field; a missing one is named, with the columns there are
    assert math_exact_match(["q"], ["#### 7"], answer_field="solution", solution=["7"], answer=["8"]) == [1.0]
    with pytest.raises(KeyError, match="needs the reference-answer column 'solution'.*the prompts have answer"):
        math_exact_match(["q"], ["7"], answer_field="solution", answer=["7"])
    # chat completions (TRL's conversational form): the last message's content; non-string answers as str
    assert math_exact_match([[{"role": "user", "content": "q"}]], [[{"role": "assistant", "content": "It is 7"}]],
                            answer=[7]) == [1.0]


def test_numbers_equal():
    assert numbers_equal("5.0", "5") and numbers_equal("2.50", "2.5") and numbers_equal("-0", "0")
    assert not numbers_equal(None, "5") and not numbers_equal("5", "6")


def test_no_eval_of_model_text():
    assert score("#### __import__('os').getpid()", "#### 0") == 0.0
    assert extract_final_number("1e9999") == "9999"  # no scientific notation, no floats overflow


def test_one_table_one_record_per_builtin():
    from astrai.rewards import code

    assert sorted(BUILTIN_REWARDS) == ["code_unit_tests", "math_exact_match"]
    assert all(isinstance(r, BuiltinReward) and r.description and "\n" not in r.description
               for r in BUILTIN_REWARDS.values())
    math = BUILTIN_REWARDS["math_exact_match"]
    assert math.load() is math_exact_match and math.answer_field and math.extract_answer is extract_final_number
    assert math.check_answer("#### 12") and not math.check_answer("see the solution")
    tests = BUILTIN_REWARDS["code_unit_tests"]  # by import path: the sandbox loads on first use only
    assert tests.function == "astrai.rewards.code:code_unit_tests" and tests.load() is code.code_unit_tests
    assert not tests.answer_field and tests.extract_answer is None and tests.check_answer is None


@pytest.mark.skipif(not GSM8K_TEST.exists(), reason=f"{GSM8K_TEST} not present")
def test_gsm8k_gold_solutions_score_one():
    rows = [json.loads(line) for line in GSM8K_TEST.read_text(encoding="utf-8").splitlines() if line.strip()]
    assert len(rows) > 1000
    golds = [r["answer"] for r in rows]
    assert exact(golds, golds) == [1.0] * len(golds)
    # the stated final answer alone, as a model would phrase it, also matches
    finals = [f"The answer is {g.rpartition('####')[2].strip()}." for g in golds]
    assert exact(finals, golds) == [1.0] * len(golds)


def test_training_scores_with_the_configured_partial_credit(tiny_model_dir, tmp_path, monkeypatch):
    """reward.partial_credit (and reward.format_bonus) reach the reward function the rollouts are scored with."""
    from test_train_e2e import tiny_args

    from astrai.train import main
    seen = []

    def recording(prompts, completions, *, answer_field="answer", format_bonus=0.0, partial_credit=0.0, **columns):
        seen.append({"answer_field": answer_field, "format_bonus": format_bonus, "partial_credit": partial_credit})
        return math_exact_match(prompts, completions, answer_field=answer_field, format_bonus=format_bonus,
                                partial_credit=partial_credit, **columns)

    monkeypatch.setitem(BUILTIN_REWARDS, "math_exact_match",
                        dataclasses.replace(BUILTIN_REWARDS["math_exact_match"], function=recording))
    assert main(tiny_args(tiny_model_dir, tmp_path / "run", "--max_steps", "1", "--reward.partial_credit", "0.3",
                          "--reward.format_bonus", "0.1")) == 0
    assert seen and all(kw == {"answer_field": "answer", "partial_credit": 0.3, "format_bonus": 0.1} for kw in seen)
