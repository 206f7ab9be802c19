"""Prompt data: the built-in math asset, jsonl loading errors, and the resumable sampler."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from astrai.data import DataError, PromptDataset, PromptRecord, PromptSampler, extract_gsm8k_answer
from astrai.data.files import builtin_names
from astrai.data.prompts import epoch_order

REPO = Path(__file__).resolve().parents[1]


def _load_generator():
    spec = importlib.util.spec_from_file_location("make_math_prompts", REPO / "tools" / "make_math_prompts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write(tmp_path: Path, text: str, name: str = "p.jsonl") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


# ---------------------------------------------------------------- built-in asset


def test_builtin_math_prompts_load():
    ds = PromptDataset("builtin:math_prompts")
    assert "math_prompts" in builtin_names()
    assert len(ds) >= 300
    assert [r.index for r in ds] == list(range(len(ds)))
    assert all(isinstance(r, PromptRecord) and r.prompt and r.answer for r in ds)


def test_builtin_answers_are_integers_and_solutions_are_consistent():
    for record in PromptDataset("builtin:math_prompts"):
        final = extract_gsm8k_answer(record.answer)
        assert re.fullmatch(r"\d+", final), record
        assert record.answer.count("####") == 1 and record.answer.rstrip().endswith(f"#### {final}")
        # the last computed value of the worked solution is the final answer
        last_line = record.answer.split("\n")[-2]
        assert re.findall(r"\d+", last_line.split("=")[-1])[0] == final, record


def test_builtin_questions_unique_and_varied():
    ds = PromptDataset("builtin:math_prompts")
    questions = [r.prompt for r in ds]
    assert len(set(questions)) == len(questions)
    steps = [r.answer.count("\n") for r in ds]  # solution lines before "#### N"
    assert steps.count(1) >= len(ds) // 4, "want a good share of one-step problems"
    assert max(steps) >= 3
    assert len({q.split()[0] for q in questions}) >= 15


def test_builtin_asset_matches_generator():
    gen = _load_generator()
    records = gen.generate()
    assert records == gen.generate(), "generator must be deterministic"
    asset = REPO / "astrai" / "data" / "assets" / "math_prompts.jsonl"
    assert asset.read_text(encoding="utf-8") == gen.render(records), "rerun python tools/make_math_prompts.py"
    assert len(gen.TEMPLATES) >= 15


# ---------------------------------------------------------------- loading


def test_custom_fields_blank_lines_and_no_answer(tmp_path):
    path = _write(tmp_path, '{"q": "hi", "a": "#### 1"}\n\n   \n{"q": "yo", "a": "2", "x": 3}\n')
    ds = PromptDataset(path, prompt_field="q", answer_field="a")
    assert [(r.prompt, r.answer, r.index) for r in ds] == [("hi", "#### 1", 0), ("yo", "2", 1)]
    ds = PromptDataset(str(path), prompt_field="q", answer_field=None)
    assert [r.answer for r in ds] == ["", ""]


@pytest.mark.parametrize(
    "text, pattern",
    [
        ('{"question": "a", "answer": "1"}\n{"question": "b", "answer": \n', r"line 2: invalid JSON"),
        ('\n["question", "answer"]\n', r"line 2: expected a JSON object, got list"),
        ('{"question": "a", "answer": "1"}\n{"prompt": "b", "answer": "2"}\n',
         r"line 2: missing field 'question' \(data.prompt_field\); present keys: 'prompt', 'answer'; set data.prompt_field: prompt \(TRL's prompt column\)$"),
        ('{"question": "a", "answer": 7}\n', r"line 1: field 'answer' must be a string, got int"),
        ("", r"no records"),
        ("\n \n", r"no records"),
    ],
)
def test_loading_errors_name_file_line_and_field(tmp_path, text, pattern):
    path = _write(tmp_path, text)
    with pytest.raises(DataError, match=pattern) as info:
        PromptDataset(path)
    message = str(info.value)
    assert str(path) in message and "\n" not in message
    assert isinstance(info.value, ValueError)


def test_invalid_utf8_names_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"question": "a", "answer": "1"}\n{"question": "\xff", "answer": "1"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl line 2: not valid UTF-8"):
        PromptDataset(path)


def test_missing_paths(tmp_path):
    with pytest.raises(DataError, match=r"^data.path: file not found: .*nope.jsonl$"):
        PromptDataset(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match=r"data.path: unknown built-in prompt set: builtin:nope .*builtin:math_prompts"):
        PromptDataset("builtin:nope")
    for name in ("builtin:../assets/math_prompts", "builtin:"):  # a name, never a path
        with pytest.raises(DataError, match=r"data.path: unknown built-in prompt set: "):
            PromptDataset(name)
    with pytest.raises(DataError, match=r"data.path: .* is a directory but not one written by datasets' save_to_disk"):
        PromptDataset(tmp_path)


def test_extract_gsm8k_answer():
    assert extract_gsm8k_answer("a\nb #### x\n#### 1,450,000 \n") == "1450000"
    assert extract_gsm8k_answer("#### -3") == "-3"
    assert extract_gsm8k_answer(" 42 ") == "42"


# ---------------------------------------------------------------- sampler


def _records(n: int) -> list[PromptRecord]:
    return [PromptRecord(prompt=f"q{i}", answer=str(i), index=i) for i in range(n)]


def test_epoch_order_is_a_pure_permutation():
    a = epoch_order(50, seed=1, epoch=0)
    assert sorted(a) == list(range(50))
    assert a == epoch_order(50, seed=1, epoch=0)
    assert a != epoch_order(50, seed=1, epoch=1)
    assert a != epoch_order(50, seed=2, epoch=0)
    assert epoch_order(50, seed=1, epoch=1) != epoch_order(50, seed=2, epoch=0)
    assert epoch_order(5, seed=1, epoch=3, shuffle=False) == [0, 1, 2, 3, 4]


def test_sampler_crosses_epochs_and_covers_each_epoch_once():
    data = _records(10)
    sampler = PromptSampler(data, seed=7)
    drawn = [r.index for _ in range(5) for r in sampler.next_batch(4)]  # 20 = two full epochs
    assert sorted(drawn[:10]) == list(range(10)) and sorted(drawn[10:]) == list(range(10))
    assert drawn[:10] == epoch_order(10, seed=7, epoch=0)
    assert drawn[10:] == epoch_order(10, seed=7, epoch=1)
    assert sampler.state_dict()["epoch"] == 2 and sampler.state_dict()["position"] == 0
    big = PromptSampler(data, seed=7).next_batch(25)  # larger than the dataset
    assert [r.index for r in big] == drawn + epoch_order(10, seed=7, epoch=2)[:5]


def test_sampler_same_seed_same_batches():
    a, b = PromptSampler(_records(13), seed=3), PromptSampler(_records(13), seed=3)
    assert [a.next_batch(5) for _ in range(6)] == [b.next_batch(5) for _ in range(6)]
    c = PromptSampler(_records(13), seed=4)
    assert [r.index for r in c.next_batch(13)] != [r.index for r in PromptSampler(_records(13), seed=3).next_batch(13)]


@pytest.mark.parametrize("stop_after", [0, 1, 2, 3, 7])
def test_sampler_resume_equals_uninterrupted(stop_after):
    data = _records(11)
    full = PromptSampler(data, seed=5)
    expected = [full.next_batch(3) for _ in range(12)]
    first = PromptSampler(data, seed=5)
    got = [first.next_batch(3) for _ in range(stop_after)]
    state = json.loads(json.dumps(first.state_dict()))  # survives a JSON round trip
    resumed = PromptSampler(data, seed=5)
    resumed.load_state_dict(state)
    got += [resumed.next_batch(3) for _ in range(12 - stop_after)]
    assert got == expected


def _stream(n: int, seed: int, length: int) -> list[int]:
    """The first `length` record indices of the epoch orders of a dataset of `n` records, one after the other."""
    out: list[int] = []
    for epoch in range(length // n + 1):
        out += epoch_order(n, seed=seed, epoch=epoch)
    return out[:length]


def _one_call(samplers: list[PromptSampler], batch: int) -> list[int]:
    """One `next_batch(batch)` on every rank, put back in stream order (rank r's j-th record is element r + j*W)."""
    shares = [[r.index for r in s.next_batch(batch)] for s in samplers]
    return [shares[i % len(samplers)][i // len(samplers)] for i in range(batch * len(samplers))]


@pytest.mark.parametrize("n,world", [(10, 2), (11, 3)])
def test_sampler_ranks_draw_disjoint_shares_of_every_epoch(n, world):
    samplers = [PromptSampler(_records(n), seed=5, rank=r, world_size=world) for r in range(world)]
    first = [[r.index for r in s.next_batch(n // world)] for s in samplers]
    order = epoch_order(n, seed=5, epoch=0)
    assert first == [order[r::world][:n // world] for r in range(world)]  # rank r takes order[r::world]
    assert len({i for share in first for i in share}) == world * (n // world)  # disjoint
    got = [i for share in zip(*first) for i in share]
    for _ in range(6):
        got += _one_call(samplers, 2)
    assert got == _stream(n, 5, len(got))  # together: each epoch once, across epoch boundaries too
    assert all(s.drawn == n // world + 12 for s in samplers)  # records handed out on each rank
    assert len({json.dumps(s.state_dict()) for s in samplers}) == 1  # the state is global: the same on every rank


@pytest.mark.parametrize("before,after", [(2, 1), (1, 2), (2, 3), (3, 2)])
def test_sampler_state_reshards_across_world_sizes(before, after):
    """A job resumed on another number of ranks continues the stream exactly: no record twice, none lost."""
    n, batch = 11, 2
    old = [PromptSampler(_records(n), seed=9, rank=r, world_size=before) for r in range(before)]
    got = [i for _ in range(5) for i in _one_call(old, batch)]
    state = json.loads(json.dumps(old[0].state_dict()))
    new = [PromptSampler(_records(n), seed=9, rank=r, world_size=after) for r in range(after)]
    for sampler in new:
        sampler.load_state_dict(state)
    got += [i for _ in range(5) for i in _one_call(new, batch)]
    assert got == _stream(n, 9, len(got))
    with pytest.raises(ValueError, match="rank 2 outside"):
        PromptSampler(_records(n), rank=2, world_size=2)


def test_sampler_state_validation():
    sampler = PromptSampler(_records(6), seed=1)
    state = sampler.state_dict()
    with pytest.raises(DataError, match="num_records"):
        PromptSampler(_records(7), seed=1).load_state_dict(state)
    with pytest.raises(DataError, match="seed"):
        PromptSampler(_records(6), seed=2).load_state_dict(state)
    with pytest.raises(DataError, match="missing keys"):
        sampler.load_state_dict({"epoch": 0})
    with pytest.raises(DataError, match="out of range"):
        sampler.load_state_dict({**state, "position": 6})
    with pytest.raises(ValueError, match="batch_size"):
        sampler.next_batch(0)
    with pytest.raises(DataError):
        PromptSampler([], seed=0)


def test_answers_without_a_final_number_are_counted_at_load_time(tiny_model_dir, tmp_path):
    """GSM8K-format answers that lost their `#### N` would silently score 0 with math_exact_match: the online
    loader warns with the count and the first rows (and keeps them: the data needs fixing, not a silent drop)."""
    from toy_rl import built_online_experience

    from astrai.config import load_config
    from astrai.models import load_pretrained

    answers = ["So 2.\n#### 2", "The answer is 42.", "42", "#### forty", "#### 1,450"]
    path = _write(tmp_path, "".join(json.dumps({"question": f"q{i}?", "answer": a}) + "\n"
                                    for i, a in enumerate(answers)))
    config = load_config(str(REPO / "configs/examples/grpo.yaml"), ["--data.path", str(path)])
    policy, tokenizer = load_pretrained(tiny_model_dir)
    with pytest.warns(UserWarning, match=r"2 of 5 answers \('answer'\) have no final number .* \(rows 2, 4\)"):
        sampler = built_online_experience(config, policy, tokenizer).data_sampler
    assert len(sampler.dataset) == 5
