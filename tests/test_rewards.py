"""Rule-based rewards: final-number extraction, math exact match, registry, and GSM8K gold answers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from astrai.rewards.builtins import (
    REWARDS,
    closeness,
    extract_final_number,
    get_reward,
    has_marked_answer,
    math_exact_match,
    numbers_equal,
)

GSM8K_TEST = Path(__file__).resolve().parents[2] / "shared/data/gsm8k/test.jsonl"


def score(response: str, answer: str, **kw) -> float:
    out = math_exact_match([response], [answer], **kw)
    assert out.shape == (1,) and out.dtype == torch.float32
    return out.item()


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
    assert math_exact_match(responses, answers).tolist() == [1.0, 0.0, 1.0, 0.0]
    bonus = math_exact_match(responses, answers, format_bonus=0.25)
    assert bonus.tolist() == [1.25, 0.25, 1.0, 0.0]
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
    assert math_exact_match(responses, answers).tolist() == [0.0, 0.0, 1.0, 0.0, 0.0]
    shaped = math_exact_match(responses, answers, partial_credit=0.5)
    assert shaped.dtype == torch.float32
    assert shaped.tolist() == pytest.approx([0.45, 0.0, 1.0, 0.0, 0.5 * (1 - 10 / 119)])
    # with the format bonus on top, a marked near miss gets both; a right answer never gets partial credit
    both = math_exact_match(["#### 22", "#### 20"], ["#### 20"] * 2, partial_credit=0.5, format_bonus=0.1)
    assert both.tolist() == pytest.approx([0.55, 1.1])


def test_batch_shape_and_length_mismatch():
    out = math_exact_match(["1", "2", "3"], ["1", "5", "3"])
    assert out.dtype == torch.float32 and out.shape == (3,) and out.tolist() == [1.0, 0.0, 1.0]
    assert math_exact_match([], []).shape == (0,)
    with pytest.raises(ValueError, match="2 responses but 1 answers"):
        math_exact_match(["1", "2"], ["1"])


def test_numbers_equal():
    assert numbers_equal("5.0", "5") and numbers_equal("2.50", "2.5") and numbers_equal("-0", "0")
    assert not numbers_equal(None, "5") and not numbers_equal("5", "6")


def test_no_eval_of_model_text():
    assert score("#### __import__('os').getpid()", "#### 0") == 0.0
    assert extract_final_number("1e9999") == "9999"  # no scientific notation, no floats overflow


def test_registry():
    assert REWARDS["math_exact_match"] is math_exact_match
    assert get_reward("math_exact_match") is math_exact_match
    with pytest.raises(ValueError, match=r"reward.name: unknown reward 'nope'; choices: .*math_exact_match"):
        get_reward("nope")


@pytest.mark.skipif(not GSM8K_TEST.exists(), reason=f"{GSM8K_TEST} not present")
def test_gsm8k_gold_solutions_score_one():
    rows = [json.loads(line) for line in GSM8K_TEST.read_text(encoding="utf-8").splitlines() if line.strip()]
    assert len(rows) > 1000
    golds = [r["answer"] for r in rows]
    assert math_exact_match(golds, golds).tolist() == [1.0] * len(golds)
    # the stated final answer alone, as a model would phrase it, also matches
    finals = [f"The answer is {g.rpartition('####')[2].strip()}." for g in golds]
    assert math_exact_match(finals, golds).tolist() == [1.0] * len(golds)


def test_training_scores_with_the_configured_partial_credit(tiny_model_dir, tmp_path, monkeypatch):
    """reward.partial_credit (and reward.format_bonus) reach the reward function the rollouts are scored with."""
    from test_train_e2e import tiny_args

    from astrai.rewards import builtins as rewards
    from astrai.train import main
    seen = []

    def recording(responses, answers, **kwargs):
        seen.append(kwargs)
        return math_exact_match(responses, answers, **kwargs)

    monkeypatch.setitem(rewards.REWARDS, "math_exact_match", recording)
    assert main(tiny_args(tiny_model_dir, tmp_path / "run", "--max_steps", "1", "--reward.partial_credit", "0.3",
                          "--reward.format_bonus", "0.1")) == 0
    assert seen and all(kw == {"partial_credit": 0.3, "format_bonus": 0.1} for kw in seen)
