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


# ------------------------------------------------------------ the reworded held-out set and the SFT warm-up
def test_the_reworded_set_is_the_test_problems_in_words_no_train_question_uses():
    from astrai.data.arithmetic import REWORDED, reworded_records

    test, reworded = arithmetic_records("test"), reworded_records()
    assert [(r["operation"], r["a"], r["b"]) for r in reworded] == [(r["operation"], r["a"], r["b"]) for r in test]
    assert [r["answer"] for r in reworded] == [r["answer"] for r in test]
    skeleton = lambda q: re.sub(r"\d+", "N", q)  # noqa: E731 - a question without its numbers
    names = re.compile("|".join(__import__("astrai.data.arithmetic", fromlist=["NAMES"]).NAMES))
    trained = {names.sub("X", skeleton(r["question"])) for r in arithmetic_records("train")}
    assert not trained & {names.sub("X", skeleton(r["question"])) for r in reworded}  # other words, every one
    assert not set(REWORDED["+"] + REWORDED["-"]) & set(ADDITION + SUBTRACTION)
    assert len({names.sub("X", skeleton(r["question"])) for r in reworded}) == 20  # every template used
    assert reworded_records() == reworded and "arithmetic_reworded" in builtin_names()
    assert math_exact_match([], [r["answer"].split("\n")[0] for r in reworded],
                            answer=[r["answer"] for r in reworded]) == [1.0] * 200


def test_worked_answers_are_right_by_place_value_and_score_one():
    from astrai.data.arithmetic import worked_answer, worked_steps

    assert worked_answer("-", 73, 48) == "We need the difference between 73 and 48: 73 - 48 = 73 - 40 - 8 = 33 - 8 = 25"
    assert worked_answer("+", 47, 38) == "We need the sum of 47 and 38: 47 + 38 = 47 + 30 + 8 = 77 + 8 = 85"
    for r in arithmetic_records("train"):
        text = worked_steps(r["operation"], r["a"], r["b"])
        assert worked_answer(r["operation"], r["a"], r["b"]).endswith(": " + text)
        terms = text.split(" = ")
        values = {eval(t) for t in terms}  # noqa: S307 - the test's own arithmetic strings
        assert values == {int(extract_gsm8k_answer(r["answer"]))}, text
    records = arithmetic_records("test")
    texts = [worked_answer(r["operation"], r["a"], r["b"]) for r in records]
    assert math_exact_match([], texts, answer=[r["answer"] for r in records]) == [1.0] * len(records)


def test_the_generator_writes_one_demonstration_per_train_question(tmp_path, capsys):
    import json

    from astrai.data.arithmetic import main, worked_answer

    assert main(["--out", str(tmp_path / "d")]) == 0
    assert "sft_arithmetic:" in capsys.readouterr().out
    rows = [json.loads(line) for line in (tmp_path / "d" / "sft_arithmetic.jsonl").read_text().splitlines()]
    train = arithmetic_records("train")
    assert len(rows) == len(train) == 2000
    for row, r in zip(rows, train):
        assert row["messages"] == [{"role": "user", "content": r["question"]},
                                   {"role": "assistant", "content": worked_answer(r["operation"], r["a"], r["b"])}]
    assert main(["--out", str(tmp_path / "s"), "--form", "steps", "--num_train", "4"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "s" / "sft_arithmetic.jsonl").read_text().splitlines()]
    assert [row["messages"][1]["content"] for row in rows] == [
        worked_answer(r["operation"], r["a"], r["b"], form="steps") for r in arithmetic_records("train", num_train=4)]
    assert rows[0]["messages"][1]["content"][0].isdigit()  # the steps alone
    capsys.readouterr()
    assert main(["--out", str(tmp_path / "e"), "--num_train", "3"]) == 2  # odd: refused in one line
    assert "num_train: expected an even number" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    assert main(["--out", str(tmp_path / "file")]) == 2
    assert "--out: " in capsys.readouterr().err and (tmp_path / "file").read_text() == ""
    assert main(["--out", str(tmp_path / "small"), "--num_train", "100"]) == 0  # a smaller split: still disjoint
    assert len((tmp_path / "small" / "sft_arithmetic.jsonl").read_text().splitlines()) == 100
    held_out = {(r["operation"], r["a"], r["b"]) for r in arithmetic_records("test")}
    assert not held_out & {(r["operation"], r["a"], r["b"]) for r in arithmetic_records("train", num_train=100)}


def test_a_missing_generated_file_names_the_command_that_writes_it(tmp_path):
    from astrai.data.files import resolve_prompt_path

    for name, command in (("sft_arithmetic.jsonl", "python -m astrai.data.arithmetic"),
                          ("sft_tools.jsonl", "python -m astrai.data.tool_arithmetic")):
        with pytest.raises(DataError) as err:
            resolve_prompt_path(tmp_path / "out" / name)
        assert str(err.value) == f"data.path: file not found: {tmp_path / 'out' / name} (written by `{command} " \
                                 f"--out {tmp_path / 'out'}`, with the options the recipe's header names)"
    with pytest.raises(DataError, match=r"file not found: .*other\.jsonl$"):  # other files: no hint
        resolve_prompt_path(tmp_path / "other.jsonl")


@pytest.mark.parametrize("recipe", ["sft_arithmetic.yaml", "sft_arithmetic_gemma3.yaml"])
def test_the_sft_recipe_runs_on_the_tiny_model_and_feeds_the_rl_recipes(tiny_model_dir, tmp_path, recipe):
    import json
    from pathlib import Path

    from astrai.config import load_config
    from astrai.data.arithmetic import write_files
    from astrai.train import main

    repo = Path(__file__).resolve().parents[1]
    sft = repo / "configs/examples" / recipe
    config = load_config(str(sft))
    form = "steps" if "gemma3" in recipe else "stated"  # the form each was measured with (its header's command)
    folder = "arithmetic_steps" if form == "steps" else "arithmetic"
    assert config.train.type == "sft" and config.data.path == f"outputs/{folder}/sft_arithmetic.jsonl"
    assert f"--out outputs/{folder}" + (" --form steps" if form == "steps" else "") in sft.read_text()
    assert config.train.per_device_train_batch_size * config.train.gradient_accumulation_steps == 16
    files = write_files(tmp_path / "data", num_train=16, form=form)
    out = tmp_path / "sft"
    assert main(["--config", str(sft), "--model.path", str(tiny_model_dir), "--data.path",
                 str(files["sft_arithmetic"]), "--train.output_dir", str(out), "--max_steps", "2",
                 "--train.per_device_train_batch_size", "4", "--train.progress_bar", "false",
                 "--train.report_to", "none"]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2 and all(r["train/loss"] > 0 for r in records)
    grpo = out / "grpo"  # the GRPO recipe from the warm-up's final checkpoint
    assert main(["--config", str(repo / "configs/examples/grpo_arithmetic.yaml"), "--model.path",
                 str(out / "checkpoints/step-00000002"),
                 "--train.output_dir", str(grpo), "--max_steps", "1", "--train.eval_steps", "0",
                 "--rollout.batch_size", "2", "--rollout.generation_batch_size", "2", "--grpo.group_size", "2",
                 "--grpo.minibatch_size", "4", "--grpo.micro_batch_size", "2", "--rollout.max_new_tokens", "8",
                 "--data.max_prompt_length", "128", "--data.truncation", "left", "--train.progress_bar", "false",
                 "--train.report_to",
                 "none"]) == 0


def test_a_training_output_dir_as_model_path_is_refused_naming_its_checkpoint(tmp_path):
    """A trial gave `--model.path outputs/sft_arithmetic` (the output dir, which `python -m astrai.evaluate` takes):
    the one-line refusal now names a checkpoint to give instead."""
    from astrai.models.loading import resolve_model_path

    (tmp_path / "run" / "checkpoints" / "step-00000125").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match=r"has no config.json: .* \(a training output_dir: give one of its "
                                                r"checkpoints, e.g. .*run/checkpoints/step-00000125\)$"):
        resolve_model_path(tmp_path / "run")
    with pytest.raises(FileNotFoundError, match=r"has no config.json: .* \(a training run's checkpoints: give one "
                                                r"of them, e.g. .*run/checkpoints/step-00000125\)$"):
        resolve_model_path(tmp_path / "run" / "checkpoints")  # its checkpoints directory (a trial gave it too)
    with pytest.raises(FileNotFoundError, match=r"has no config.json: expected .*\.gguf file$"):
        resolve_model_path(tmp_path / "run" / "checkpoints" / "step-00000125")  # an empty checkpoint: no hint
