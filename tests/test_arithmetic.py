"""The built-in arithmetic task: deterministic, disjoint splits, correct answers, varied phrasings, scored right."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from astrai.data import DataError, PromptDataset, extract_gsm8k_answer
from astrai.data.arithmetic import (ADDITION, SUBTRACTION, all_problems, arithmetic_records, split_problems)
from astrai.data.files import builtin_names
from astrai.data.records import load_records
from astrai.rewards.builtins import math_exact_match


def triple(record: dict) -> tuple[str, int, int]:
    return record["operation"], record["a"], record["b"]


def test_problem_space_is_every_two_digit_pair_with_non_negative_answer():
    add, sub = all_problems("+"), all_problems("-")
    assert len(add) == 90 * 90 and len(sub) == 90 * 91 // 2
    assert all(10 <= p.a <= 99 and 10 <= p.b <= 99 for p in add + sub)
    assert min(p.answer for p in sub) == 0 and all(p.a >= p.b for p in sub)
    with pytest.raises(ValueError, match="operation"):
        all_problems("*")


def test_deterministic_by_seed():
    assert arithmetic_records("train") == arithmetic_records("train")
    assert arithmetic_records("test", seed=5) == arithmetic_records("test", seed=5)
    assert arithmetic_records("test", seed=5) != arithmetic_records("test", seed=6)
    assert [r.prompt for r in PromptDataset("builtin:arithmetic_test")] == \
        [r["question"] for r in arithmetic_records("test")]


@pytest.mark.parametrize("seed", [0, 1, 20240517])
def test_splits_are_disjoint_balanced_and_sized(seed):
    train, test = arithmetic_records("train", seed=seed), arithmetic_records("test", seed=seed)
    assert len(train) == 2000 and len(test) == 200
    train_triples, test_triples = {triple(r) for r in train}, {triple(r) for r in test}
    assert len(train_triples) == len(train) and len(test_triples) == len(test)  # no repeats inside a split
    assert not train_triples & test_triples
    assert Counter(r["operation"] for r in test) == {"+": 100, "-": 100}
    assert Counter(r["operation"] for r in train) == {"+": 1000, "-": 1000}
    small = split_problems(seed, num_train=10, num_test=4)
    assert len(small["train"]) == 10 and len(small["test"]) == 4


def test_split_size_errors():
    with pytest.raises(ValueError, match="num_test"):
        split_problems(num_test=3)
    with pytest.raises(ValueError, match="num_train"):
        split_problems(num_train=20000)
    with pytest.raises(ValueError, match="split"):
        arithmetic_records("validation")


@pytest.mark.parametrize("split", ["train", "test"])
def test_answers_parse_back_and_are_correct(split):
    for record in arithmetic_records(split):
        op, a, b = triple(record)
        numbers = [int(n) for n in re.findall(r"\d+", record["question"])]
        assert sorted(numbers) == sorted([a, b]), record  # the question states exactly the two operands
        gold = int(extract_gsm8k_answer(record["answer"]))
        assert gold == (a + b if op == "+" else a - b) >= 0, record
        solution, final = record["answer"].split("\n")
        assert final == f"#### {gold}" and solution == f"{a} {op} {b} = {gold}"


def test_phrasings_are_varied():
    records = arithmetic_records("train")
    used = Counter()
    for record in records:
        templates = ADDITION if record["operation"] == "+" else SUBTRACTION
        pattern = [t for t in templates if re.fullmatch(
            re.escape(t).replace(r"\{a\}", r"\d+").replace(r"\{b\}", r"\d+").replace(r"\{name\}", r"[A-Z][a-z]+"),
            record["question"])]
        assert len(pattern) == 1, record
        used[pattern[0]] += 1
    assert set(used) == set(ADDITION) | set(SUBTRACTION)  # every template appears ...
    assert max(used.values()) < 3 * min(used.values())  # ... roughly evenly
    words = ("apples", "coins", "pages")
    assert all(any(w in r["question"] for r in records) for w in words)
    assert sum(r["question"].startswith("What is") for r in records) < len(records) // 4


def test_builtin_names_and_datasets():
    assert {"arithmetic", "arithmetic_test", "math_prompts"} <= set(builtin_names())
    ds = PromptDataset("builtin:arithmetic")
    assert len(ds) == 2000 and ds.path is None and [r.index for r in ds][:3] == [0, 1, 2]
    with pytest.raises(DataError, match="builtin:arithmetic_test row 1: missing field 'prompt'"):
        PromptDataset("builtin:arithmetic_test", prompt_field="prompt")
    with pytest.raises(DataError, match="data.path: builtin:arithmetic is a generated question/answer prompt set"):
        load_records("builtin:arithmetic", {"data.messages_field": "messages"})
    with pytest.raises(DataError, match=r"data.eval_path: unknown built-in prompt set: builtin:nope .*builtin:arithmetic_test"):
        PromptDataset("builtin:nope", field="data.eval_path")


def test_reward_scores_right_answers_one_and_wrong_answers_zero():
    records = arithmetic_records("test")[:20]
    answers = [r["answer"] for r in records]
    golds = [int(extract_gsm8k_answer(a)) for a in answers]
    right = [f"{r['a']} {r['operation']} {r['b']} = {g}. The answer is {g}." for r, g in zip(records, golds)]
    marked = [f"Let me compute.\n#### {g}" for g in golds]
    wrong = [f"The answer is {g + 1}." for g in golds]
    score = lambda completions, golds: math_exact_match([""] * len(completions), completions, answer=golds)  # noqa: E731
    assert score(right, answers) == [1.0] * 20
    assert score(marked, answers) == [1.0] * 20
    assert score(wrong, answers) == [0.0] * 20
    assert score(["I do not know."], answers[:1]) == [0.0]
