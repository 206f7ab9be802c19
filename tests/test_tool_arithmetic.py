"""The built-in tool-use task: deterministic disjoint splits, right answers, and SFT demonstrations that render as an
episode that calls the calculator renders."""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest

from astrai.agents.calculator import calculator
from astrai.agents.chat import render
from astrai.agents.tool_calls import assistant_message, with_tools_prompt
from astrai.agents.tools import tool_from_function
from astrai.data import PromptDataset
from astrai.data.files import builtin_names
from astrai.data.records import load_records
from astrai.data.tool_arithmetic import (PRODUCT, SUM4, demonstration, main, split_problems,
                                        tool_arithmetic_records, write_files)
from astrai.models import tiny_tokenizer
from astrai.rewards.builtins import math_exact_match


def key(record: dict) -> tuple:
    return record["kind"], tuple(sorted(record["operands"]))


def test_deterministic_by_seed_and_served_as_builtin():
    assert tool_arithmetic_records("train") == tool_arithmetic_records("train")
    assert tool_arithmetic_records("test", seed=3) == tool_arithmetic_records("test", seed=3)
    assert tool_arithmetic_records("test", seed=3) != tool_arithmetic_records("test", seed=4)
    assert {"tool_arithmetic", "tool_arithmetic_test"} <= set(builtin_names())
    assert [r.prompt for r in PromptDataset("builtin:tool_arithmetic_test")] == \
        [r["question"] for r in tool_arithmetic_records("test")]


@pytest.mark.parametrize("seed", [0, 7])
def test_splits_are_disjoint_balanced_and_in_range(seed):
    train, test = tool_arithmetic_records("train", seed=seed), tool_arithmetic_records("test", seed=seed)
    assert len(train) == 2000 and len(test) == 200
    assert len({key(r) for r in train}) == 2000 and len({key(r) for r in test}) == 200
    assert not {key(r) for r in train} & {key(r) for r in test}
    assert Counter(r["kind"] for r in test) == {"product": 100, "sum4": 100}
    for r in train + test:
        if r["kind"] == "product":
            a, b = r["operands"]
            assert 100 <= a <= 999 and 10 <= b <= 999
        else:
            assert len(r["operands"]) == 4 and all(100 <= n <= 999 for n in r["operands"])
    with pytest.raises(ValueError, match="num_test"):
        split_problems(num_test=3)
    with pytest.raises(ValueError, match="split"):
        tool_arithmetic_records("validation")


def test_answers_are_right_and_every_operand_is_in_the_question():
    records = tool_arithmetic_records("test")
    for r in records:
        value = int(calculator(r["expression"]))
        assert r["answer"] == f"{r['expression']} = {value}\n#### {value}"
        assert all(str(n) in r["question"] for n in r["operands"])
    assert math_exact_match([r["question"] for r in records], [r["answer"] for r in records],
                            answer=[r["answer"] for r in records]) == [1.0] * len(records)
    templates = {template for r in records for template in PRODUCT + SUM4
                 if re.fullmatch(re.escape(template).replace(r"\{name\}", r"\w+").replace(r"\{a\}", r"\d+")
                                 .replace(r"\{b\}", r"\d+").replace(r"\{c\}", r"\d+").replace(r"\{d\}", r"\d+"),
                                 r["question"])}
    assert len(templates) == len(PRODUCT) + len(SUM4)  # every phrasing is used on 200 questions


def test_demonstration_is_the_text_an_episode_that_calls_the_calculator_holds():
    tools = [tool_from_function(calculator)]
    record = tool_arithmetic_records("test")[0]
    messages = demonstration(record, tools)["messages"]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert messages[:2] == with_tools_prompt([{"role": "user", "content": record["question"]}], tools)
    call, calls, errors = assistant_message(messages[2]["content"], ["calculator"])
    assert not errors and [(c.name, c.arguments) for c in calls] == [("calculator",
                                                                      {"expression": record["expression"]})]
    value = record["answer"].rsplit("#### ", 1)[1]
    assert messages[3]["content"] == value and messages[4]["content"].endswith(f"= {value}")
    # Rendered for the SFT data path (calls in the text) and as an episode's messages (calls in tool_calls, the
    # tools in the system turn): the same text.
    tokenizer = tiny_tokenizer()  # ChatML without tool support, as SmolLM2's
    episode = [{"role": "user", "content": record["question"]}, call, messages[3], messages[4]]
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=False) == \
        render(tokenizer, episode, tools, add_generation_prompt=False)


def test_cli_writes_the_files(tmp_path):
    assert main(["--out", str(tmp_path / "data"), "--num_train", "20", "--num_test", "4",
                 "--num_demonstrations", "5"]) == 0
    train = [json.loads(line) for line in (tmp_path / "data/train.jsonl").read_text().splitlines()]
    assert train == tool_arithmetic_records("train", num_train=20, num_test=4)
    assert len((tmp_path / "data/test.jsonl").read_text().splitlines()) == 4
    demos = load_records(tmp_path / "data/sft_tools.jsonl", {"data.messages_field": "messages"})
    assert len(demos) == 5 and demos[0]["messages"][1]["content"] == train[0]["question"]
    paths = write_files(tmp_path / "again", num_train=20, num_test=4, num_demonstrations=5)
    assert paths["sft_tools"].read_bytes() == (tmp_path / "data/sft_tools.jsonl").read_bytes()


def test_sft_messages_with_openai_tool_calls_train_on_the_text_a_rollout_samples():
    """An SFT record may hold an assistant's calls in OpenAI's `tool_calls`: for a template without tool support
    they are written back as the Hermes blocks a rollout turn samples (the same ids and labels as the calls written
    in the content); a template with its own tool-call format is refused in one line instead of dropping them."""
    from test_agents_chat import QWEN25_LIKE, tiny_with

    from astrai.data.examples import chat_example
    from astrai.data.files import DataError
    from astrai.agents.tool_calls import format_tool_call

    tokenizer = tiny_tokenizer()
    call = {"name": "calculator", "arguments": {"expression": "12 * 34"}}
    in_text = [{"role": "user", "content": "What is 12 * 34?"},
               {"role": "assistant", "content": format_tool_call(**call)},
               {"role": "tool", "content": "408"}, {"role": "assistant", "content": "12 * 34 = 408"}]
    as_calls = [dict(m) for m in in_text]
    as_calls[1] = {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": call}]}
    assert chat_example(as_calls, tokenizer, max_length=None) == chat_example(in_text, tokenizer, max_length=None)
    with pytest.raises(DataError, match="^row 3: assistant tool_calls in training messages .* own format"):
        chat_example(as_calls, tiny_with(QWEN25_LIKE), max_length=None, where="row 3")
    with pytest.raises(DataError, match="^row 3: message 0: tool_calls must be a list, on an assistant message"):
        chat_example([{"role": "user", "content": "x", "tool_calls": []}, *in_text[1:]], tokenizer,
                     max_length=None, where="row 3")
