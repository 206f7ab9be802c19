"""Any prompt dataset for online RL: jsonl / json / parquet / csv / save_to_disk, plain or chat prompts, optional
answers, every other column carried to the rewards, weighted mixtures; errors name the file, row and field."""

import json

import datasets
import pytest

from astrai.config import config_from_dict
from astrai.data import DataError, PromptDataset
from astrai.data.prompts import mixture_records
from astrai.models import tiny_tokenizer

ROWS = [{"question": "What is 2 + 3?", "answer": "#### 5", "level": 1, "tests": ["assert f(1) == 2"]},
        {"question": "Name a colour.", "answer": "red", "level": 2, "tests": []}]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
CHAT_ROWS = [{"question": CHAT, "answer": "red", "level": 2}, {"question": CHAT[1:], "answer": "blue", "level": 3}]


def write_all_formats(tmp_path, rows):
    """The rows as jsonl, json, parquet, csv (scalar columns only) and a save_to_disk directory."""
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    plain = [{"question": r["question"] if isinstance(r["question"], str) else "q", "answer": r["answer"],
              "level": r["level"]} for r in rows]  # csv holds scalars only
    ds = datasets.Dataset.from_list(rows)
    paths = {"jsonl": jsonl, "parquet": tmp_path / "p.parquet", "json": tmp_path / "p.json",
             "disk": tmp_path / "saved", "csv": tmp_path / "p.csv"}
    ds.to_parquet(str(paths["parquet"]))
    ds.to_json(str(paths["json"]))
    ds.save_to_disk(str(paths["disk"]))
    datasets.Dataset.from_list(plain).to_csv(str(paths["csv"]), index=False)
    return paths


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet", "disk"])
def test_every_format_gives_the_same_records_with_their_columns(tmp_path, fmt):
    path = write_all_formats(tmp_path, ROWS)[fmt]
    data = PromptDataset(path)
    assert len(data) == 2
    assert data[0].prompt == "What is 2 + 3?" and data[0].answer == "#### 5"
    assert data[0].columns == {"answer": "#### 5", "level": 1, "tests": ["assert f(1) == 2"]}
    assert data[1].columns["level"] == 2
    chats = PromptDataset(write_all_formats(tmp_path / "chat" if tmp_path.joinpath("chat").mkdir() is None else 0,
                                            CHAT_ROWS)[fmt])
    assert chats[0].prompt == CHAT and chats[1].prompt == CHAT[1:]  # chat prompts, as stored
    assert chats[1].columns == {"answer": "blue", "level": 3}


def test_csv_and_optional_answers(tmp_path):
    paths = write_all_formats(tmp_path, ROWS)
    assert [r.columns["level"] for r in PromptDataset(paths["csv"])] == [1, 2]
    no_answers = tmp_path / "n.jsonl"
    no_answers.write_text('{"question": "hi", "x": 1}\n')
    assert PromptDataset(no_answers, require_answers=False)[0].answer == ""
    with pytest.raises(DataError, match=r"n.jsonl line 1: missing field 'answer' \(data.answer_field\); "
                                        r"present keys: 'question', 'x'"):
        PromptDataset(no_answers)
    half = tmp_path / "h.jsonl"
    half.write_text('{"question": "a", "answer": "1"}\n{"question": "b"}\n')
    with pytest.raises(DataError, match=r"h.jsonl line 2: missing field 'answer'"):
        PromptDataset(half, require_answers=False)  # some rows hold it: every row must


@pytest.mark.parametrize("prompt, needle", [
    ([], "field 'question' is an empty list of messages"),
    ([{"role": "user"}], "field 'question' message 0: expected {'role': str, 'content': str}"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
     "the last message must be the user's (the model answers it), got role 'assistant'"),
    (7, "field 'question' must be a string, got int"),
])
def test_malformed_prompts_name_the_file_row_and_field(tmp_path, prompt, needle):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"question": "fine", "answer": "1"}) + "\n" + json.dumps({"question": prompt,
                                                                                        "answer": "1"}) + "\n")
    with pytest.raises(DataError) as err:
        PromptDataset(path)
    assert f"{path} line 2: " in str(err.value) and needle in str(err.value) and "\n" not in str(err.value)


def test_chat_prompts_are_templated_and_cut_at_the_user_turn(tmp_path):
    from astrai.data.truncation import encode_prompt, prompt_messages

    chat = CHAT
    assert prompt_messages(chat, "other system") == chat  # the chat's own system turn wins
    assert prompt_messages(chat[1:], "sys")[0] == {"role": "system", "content": "sys"}
    tokenizer = tiny_tokenizer()
    ids, span = encode_prompt(tokenizer, chat)
    text = tokenizer.decode(ids[span[0]:span[1]], skip_special_tokens=False)
    assert text.strip() == "Name a colour."  # data.truncation=left cuts only the last user turn's text


def test_mixture_blends_files_by_weight(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(json.dumps({"question": f"a{i}", "answer": "1"}) + "\n" for i in range(6)))
    b.write_text("".join(json.dumps({"question": f"b{i}", "answer": "1", "source": "own"}) + "\n" for i in range(2)))
    blend = mixture_records([PromptDataset(a), PromptDataset(b)], [1.0, 3.0], seed=0)
    # 8 records in all: a contributes round(8 * 1/4) = 2, b round(8 * 3/4) = 6 (its 2 records cycled 3 times)
    assert [r.prompt[0] for r in blend].count("a") == 2 and [r.prompt[0] for r in blend].count("b") == 6
    assert [r.index for r in blend] == list(range(8))
    assert blend[0].columns["source"] == str(a) and blend[-1].columns["source"] == "own"
    assert {r.prompt for r in blend if r.prompt[0] == "b"} == {"b0", "b1"}
    assert mixture_records([PromptDataset(a), PromptDataset(b)], [1.0, 3.0], seed=0) == blend  # deterministic
    with pytest.raises(DataError, match="weights must be positive"):
        mixture_records([PromptDataset(a)], [0.0], seed=0)


def test_a_mixture_file_of_weight_0_is_left_out(tmp_path):
    """Issue 42, class 2 (its example): weight 0 means the file is not trained on (it was `weight or 1.0`, so the
    file came in at full weight), and every weight 0 is refused in one line."""
    from astrai.config import ConfigError
    from astrai.experience.prompts import load_online_prompts

    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(json.dumps({"question": f"a{i}", "answer": "1"}) + "\n" for i in range(3)))
    b.write_text("".join(json.dumps({"question": f"b{i}", "answer": "1"}) + "\n" for i in range(2)))
    config = config_from_dict({"data": {"mixture": [{"path": str(a), "weight": 0}, {"path": str(b), "weight": 1}]}})
    assert [m.weight for m in config.data.mixture] == [0.0, 1.0]
    prompts = load_online_prompts(config, tiny_tokenizer(), main=False)
    assert prompts and {str(p.columns["source"]) for p in prompts} == {str(b)}
    with pytest.raises(ConfigError, match="data.mixture: every file has weight 0"):
        config_from_dict({"data": {"mixture": [{"path": str(a), "weight": 0}, {"path": str(b), "weight": 0}]}})


def test_mixture_config_and_loading(tmp_path):
    from astrai.config import ConfigError
    from astrai.experience.prompts import load_online_prompts

    a, b = tmp_path / "a.jsonl", tmp_path / "b.parquet"
    a.write_text(json.dumps({"question": "x", "answer": "#### 1"}) + "\n")
    datasets.Dataset.from_list([{"question": "y", "answer": "#### 2", "extra": 5}]).to_parquet(str(b))
    config = config_from_dict({"data": {"mixture": [{"path": str(a)}, {"path": str(b), "weight": 1}]}})
    prompts = load_online_prompts(config, tiny_tokenizer(), main=False)
    assert sorted(p.answer for p in prompts) == ["#### 1", "#### 2"]
    assert {p.columns.get("extra") for p in prompts} == {None, 5}
    with pytest.raises(ConfigError, match="data.mixture: set together with data.path"):
        config_from_dict({"data": {"path": str(a), "mixture": [{"path": str(b)}]}})
    with pytest.raises(DataError, match=r"data.mixture\[2\].path: file not found"):
        load_online_prompts(config_from_dict({"data": {"mixture": [{"path": str(a)}, {"path": "nope.jsonl"}]}}),
                            tiny_tokenizer(), main=False)
