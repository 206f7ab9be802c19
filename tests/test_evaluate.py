"""The evaluator: statistics against naive references, and `python -m astrai.evaluate` end to end on a tiny model
whose greedy responses are computed independently (a plain argmax loop over full forwards)."""

from __future__ import annotations

import itertools
import json
import math
import warnings

import pytest
import torch

from astrai.algos.stats import mcnemar_exact_p, pass_at_k, wilson_interval
from astrai.evaluation.cli import main
from astrai.models import load_pretrained
from astrai.evaluation.accuracy import EvalSettings, pass_at_ks
from astrai.rewards.builtins import BUILTIN_REWARDS, BuiltinReward

SYSTEM = "Answer briefly."


# ------------------------------------------------------------------------------------------- statistics
def test_wilson_interval_hand_computed():
    # n=4, 2 successes, z=1.959964: center 0.5, half = z/(1+z^2/4) * sqrt(1/16 + z^2/64) = 0.349961
    low, high = wilson_interval(2, 4)
    assert low == pytest.approx(0.150039, abs=1e-6) and high == pytest.approx(0.849961, abs=1e-6)
    # 0 of 20: [0, z^2 / (n + z^2)] = [0, 3.841459 / 23.841459]
    assert wilson_interval(0, 20) == pytest.approx((0.0, 0.161125), abs=1e-6)
    # 11 of 200 (the baseline): center 0.064604 / 1.019207 = 0.063386,
    # half = 1.959964 / 1.019207 * sqrt(0.055 * 0.945 / 200 + 3.841459 / 160000) = 0.032401
    assert wilson_interval(11, 200) == pytest.approx((0.030985, 0.095787), abs=1e-6)
    assert wilson_interval(5, 5)[1] == 1.0 and wilson_interval(5, 5)[0] == pytest.approx(0.565518, abs=1e-6)
    assert wilson_interval(2, 4, confidence=0.5)[0] > 0.150039  # narrower at lower confidence
    for bad in [(1, 0), (-1, 4), (5, 4)]:
        with pytest.raises(ValueError):
            wilson_interval(*bad)


@pytest.mark.parametrize("n,c", [(1, 0), (1, 1), (4, 1), (5, 2), (6, 6), (7, 3), (8, 0)])
def test_pass_at_k_equals_average_over_all_k_subsets(n, c):
    outcomes = [True] * c + [False] * (n - c)
    for k in range(1, n + 1):
        subsets = list(itertools.combinations(outcomes, k))
        naive = sum(any(s) for s in subsets) / len(subsets)
        assert pass_at_k(n, c, k) == pytest.approx(naive, abs=1e-12), (n, c, k)
    with pytest.raises(ValueError):
        pass_at_k(n, c, n + 1)


def test_mcnemar_exact_p_against_enumeration():
    for gained, lost in [(0, 0), (3, 0), (5, 1), (2, 6), (12, 3)]:
        total = gained + lost
        outcomes = list(itertools.product([0, 1], repeat=total))  # every sign pattern equally likely under H0
        naive = sum(sum(o) >= gained for o in outcomes) / len(outcomes)
        assert mcnemar_exact_p(gained, lost) == pytest.approx(naive, abs=1e-12)
    assert mcnemar_exact_p(5, 0) == pytest.approx(1 / 32)


def test_settings_greedy_is_top_k_1_and_validation():
    greedy = EvalSettings(max_new_tokens=8).sampling_params((2,))
    assert greedy.top_k == 1 and greedy.temperature == 1.0 and greedy.stop_token_ids == (2,)
    sampled = EvalSettings(max_new_tokens=8, temperature=0.7, num_samples=4).sampling_params((2,))
    assert sampled.top_k == 0 and sampled.top_p == 1.0 and sampled.temperature == 0.7
    for kwargs, field in [({"num_samples": 4}, "num_samples"), ({"temperature": 1e-6}, "temperature"),
                          ({"batch_size": 0}, "batch_size"), ({"max_new_tokens": 0}, "max_new_tokens")]:
        with pytest.raises(ValueError, match=field):
            EvalSettings(**{"max_new_tokens": 8, **kwargs})
    assert pass_at_ks(1) == [1] and pass_at_ks(8) == [1, 2, 4, 8] and pass_at_ks(6) == [1, 2, 4, 6]


# ------------------------------------------------------------------------------------------- end to end
def naive_greedy(model, tokenizer, question: str, max_new_tokens: int) -> str:
    """Greedy continuation by full forwards and argmax: no cache, no engine."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    ids = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    out = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            token = int(model(torch.tensor([ids + out]))[0, -1].argmax())
            out.append(token)
            if token == tokenizer.eos_token_id:
                break
    return tokenizer.decode(out, skip_special_tokens=True)


def exact_text(prompts, completions, *, answer_field="answer", **columns):
    """Stub reward: 1 when the response is exactly the stored answer."""
    return [float(c == a) for c, a in zip(completions, columns[answer_field])]


def even_length(prompts, completions, **columns):
    """Stub reward: 1 when the response has an even number of characters."""
    return [float(len(c) % 2 == 0) for c in completions]


EXACT_TEXT = BuiltinReward(exact_text, "stub: 1 for the stored answer", answer_field=True)
EVEN_LENGTH = BuiltinReward(even_length, "stub: 1 for an even number of characters")


def cli(model, data, out, *extra):
    return main(["--model", str(model), "--data", str(data), "--output_dir", str(out), "--max_new_tokens", "6",
                 "--max_prompt_length", "64", "--truncation", "left", "--system_prompt", SYSTEM, "--no_progress_bar",
                 *extra])


def read_outputs(out):
    results = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    return results, json.loads((out / "summary.json").read_text())


@pytest.mark.filterwarnings("ignore:.*no final number")  # its stub answers are text on purpose
def test_greedy_accuracy_matches_hand_computed_expectation(tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(BUILTIN_REWARDS, "exact_text", EXACT_TEXT)
    model, tokenizer = load_pretrained(tiny_model_dir)
    questions = ["What is 12 + 35?", "Compute 40 - 17.", "How many apples?", "Say hi."]
    greedy = [naive_greedy(model, tokenizer, q, 6) for q in questions]
    answers = [greedy[0], "not this", greedy[2], "nor this"]  # exactly questions 0 and 2 are right
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in zip(questions, answers)))
    out = tmp_path / "eval"
    assert cli(tiny_model_dir, data, out, "--reward", "exact_text", "--batch_size", "3") == 0
    results, summary = read_outputs(out)
    assert [r["responses"] for r in results] == [[g] for g in greedy]
    assert [r["correct"] for r in results] == [[True], [False], [True], [False]]
    assert [r["question"] for r in results] == questions and results[1]["answer"] == "not this"
    assert summary["n"] == 4 and summary["accuracy"] == 0.5 and summary["pass_at_k"] == {"1": 0.5}
    assert summary["ci_low"] == pytest.approx(0.150039, abs=1e-6)  # Wilson, 2 of 4 (see above)
    assert summary["ci_high"] == pytest.approx(0.849961, abs=1e-6)
    assert summary["generated_tokens"] == sum(sum(r["response_tokens"]) for r in results) > 0
    s = summary["settings"]
    assert s["greedy"] and s["system_prompt"] == SYSTEM and s["max_new_tokens"] == 6 and s["reward"] == "exact_text"
    printed = capsys.readouterr().out
    assert "accuracy 0.5000 (2/4), 95% Wilson interval [0.1500, 0.8500]" in printed
    # --limit takes the first questions; the default reward reports the number it read from each response
    assert cli(tiny_model_dir, data, out, "--limit", "2") == 0
    results, summary = read_outputs(out)
    assert summary["n"] == 2 and summary["settings"]["reward"] == "math_exact_match"
    assert all(len(r["extracted_answers"]) == 1 for r in results)


def test_sampled_pass_at_k_is_seeded_and_consistent(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(BUILTIN_REWARDS, "even_length", EVEN_LENGTH)
    args = ("--limit", "6", "--reward", "even_length", "--temperature", "1.0", "--num_samples", "4")
    runs = {}
    for name, seed in [("a", "3"), ("b", "3"), ("c", "4")]:
        assert cli(tiny_model_dir, "builtin:arithmetic_test", tmp_path / name, *args, "--seed", seed) == 0
        runs[name] = read_outputs(tmp_path / name)
    (results, summary), (again, _), (other, _) = runs["a"], runs["b"], runs["c"]
    assert [r["responses"] for r in results] == [r["responses"] for r in again]
    assert [r["responses"] for r in results] != [r["responses"] for r in other]
    counts = [sum(r["correct"]) for r in results]
    assert all(len(r["responses"]) == 4 for r in results) and 0 < sum(counts) < 24
    assert summary["accuracy"] == pytest.approx(sum(counts) / 24)
    for k in (1, 2, 4):  # average over questions of the all-subsets pass rate
        naive = sum(sum(any(s) for s in itertools.combinations(r["correct"], k)) / math.comb(4, k)
                    for r in results) / 6
        assert summary["pass_at_k"][str(k)] == pytest.approx(naive)
    low, high = wilson_interval(sum(counts) / 4, 6)
    assert (summary["ci_low"], summary["ci_high"]) == pytest.approx((low, high))


@pytest.mark.parametrize("args,needle", [
    (["--data", "/nonexistent/q.jsonl"], "--data: file not found: /nonexistent/q.jsonl"),
    (["--model", "/nonexistent/model"], "/nonexistent/model"),
    (["--reward", "nope"], "--reward: unknown reward 'nope'"),
    (["--num_samples", "4"], "--num_samples: 4 samples per question need temperature > 0"),
    (["--temperature", "-1"], "--temperature: expected 0 (greedy)"),
    (["--batch_size", "0"], "--batch_size"),
    (["--limit", "x"], "--limit"),
    (["--answer_field", "solution"], "missing field 'solution'"),
    (["--config", "/nonexistent.yaml"], "/nonexistent.yaml"),
    (["--bogus"], "--bogus"),
])
def test_bad_input_exits_2_with_one_line(tiny_model_dir, tmp_path, capsys, args, needle):
    values = {"--model": str(tiny_model_dir), "--data": "builtin:arithmetic_test"}
    rest = []
    for i in range(0, len(args), 2):
        if args[i] in values:
            values[args[i]] = args[i + 1]
        else:
            rest += args[i:i + 2]
    code = main(["--model", values["--model"], "--data", values["--data"], "--output_dir", str(tmp_path / "o"),
                 "--limit", "1", "--no_progress_bar", *rest])
    err = capsys.readouterr().err.strip()
    assert code == 2 and needle in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "o").exists()


def test_output_dir_that_is_a_file_is_left_alone(tiny_model_dir, tmp_path, capsys):
    target = tmp_path / "taken"
    target.write_text("keep me")
    assert cli(tiny_model_dir, "builtin:arithmetic_test", target) == 2
    assert target.read_text() == "keep me" and "--output_dir" in capsys.readouterr().err


def test_unscorable_answers_are_warned_before_the_model_loads(tiny_model_dir, tmp_path, monkeypatch):
    data = tmp_path / "qa.jsonl"
    answers = ["so 47.\n#### 47", "The answer is twelve", "see the worked solution", "12"]
    data.write_text("".join(json.dumps({"question": f"q{i}", "answer": a}) + "\n" for i, a in enumerate(answers)))
    loaded = []
    import astrai.models

    real = astrai.models.load_pretrained
    monkeypatch.setattr(astrai.models, "load_pretrained", lambda *a, **k: loaded.append(1) or real(*a, **k))
    with pytest.warns(UserWarning) as caught:
        assert cli(tiny_model_dir, data, tmp_path / "eval") == 0  # math_exact_match, the default reward
    (warning,) = [w for w in caught if "no final number" in str(w.message)]
    assert str(warning.message) == (f"{data}: 2 of 4 answers ('answer') have no final number ('#### N' or a bare "
                                    "number), so math_exact_match scores every response to them 0 (rows 2, 3)")
    assert loaded  # and it still evaluates
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # scorable answers: no warning
        assert cli(tiny_model_dir, data, tmp_path / "eval", "--limit", "1") == 0



def test_a_lora_checkpoint_directory_uses_its_runs_config(tmp_path):
    """A LoRA step directory holds adapter_config.json, not config.json: it is still the run's checkpoint, so the
    run's config.yaml gives the prompt settings (as for a full-weight checkpoint)."""
    from astrai.evaluation.cli import resolve_model

    step = tmp_path / "run" / "checkpoints" / "step-00000003"
    step.mkdir(parents=True)
    (step / "adapter_config.json").write_text("{}")
    (tmp_path / "run" / "config.yaml").write_text("train: {type: sft}\n")
    assert resolve_model(str(step)) == (str(step), tmp_path / "run" / "config.yaml")


# ------------------------------------------------------------------------------------------- demonstrations
def test_demonstrations_keep_distinct_passing_finished_responses():
    from astrai.evaluation.accuracy import EvalResult

    def example(index, question, responses, correct, finished):
        return {"index": index, "question": question, "responses": responses, "correct": correct,
                "finished": finished}

    chat = [{"role": "system", "content": "own"}, {"role": "user", "content": "q2"}]
    result = EvalResult(num_samples=4, examples=[
        example(0, "q0", ["a", "a", "b", "c"], [True, True, True, False], [True, True, True, True]),
        example(1, "q1", ["x", "y", " ", "z"], [False, True, True, True], [True, False, True, True]),
        example(2, chat, ["p", "p", "p", "p"], [True] * 4, [True] * 4),
        example(3, "q3", ["n"] * 4, [False] * 4, [True] * 4)])
    rows = result.demonstrations("S")
    sys_turn, user = {"role": "system", "content": "S"}, lambda q: {"role": "user", "content": q}
    reply = lambda text: {"role": "assistant", "content": text}  # noqa: E731
    assert rows == [  # duplicates, failures, cut and blank responses left out; a chat's own system turn kept
        {"messages": [sys_turn, user("q0"), reply("a")], "index": 0},
        {"messages": [sys_turn, user("q0"), reply("b")], "index": 0},
        {"messages": [sys_turn, user("q1"), reply("z")], "index": 1},
        {"messages": [*chat, reply("p")], "index": 2}]
    assert result.demonstrations(None)[0]["messages"] == [user("q0"), reply("a")]
    result.examples.append({**example(4, "q4", ["t"], [True], [True]), "turns": [2]})
    with pytest.raises(ValueError, match="multi-turn episodes"):
        result.demonstrations(None)


def test_demonstrations_file_trains_sft_on_the_responses(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """Sampled responses that end within 16 tokens (seeded: some do, some are cut) and pass the stub reward become
    chats whose sft labels are exactly the response (then the end-of-turn token)."""
    from astrai.data.examples import IGNORE_INDEX, chat_example
    from astrai.models.special_tokens import stop_token_ids

    monkeypatch.setitem(BUILTIN_REWARDS, "even_length", EVEN_LENGTH)
    out, demos = tmp_path / "eval", tmp_path / "new" / "demos.jsonl"
    assert cli(tiny_model_dir, "builtin:arithmetic_test", out, "--limit", "8", "--reward", "even_length",
               "--temperature", "1.0", "--num_samples", "8", "--max_new_tokens", "16", "--seed", "1",
               "--demonstrations", str(demos)) == 0
    results, summary = read_outputs(out)
    rows = [json.loads(line) for line in demos.read_text().splitlines()]
    passing = [(r["index"], text) for r in results for text, ok, end in zip(r["responses"], r["correct"],
                                                                           r["finished"]) if ok and end]
    cut = sum(ok and not end for r in results for ok, end in zip(r["correct"], r["finished"]))
    assert rows and cut > 0  # the seed gives both kinds
    assert [(row["index"], row["messages"][-1]["content"]) for row in rows] == list(dict.fromkeys(passing))
    questions = {r["index"]: r["question"] for r in results}
    assert all(row["messages"][:2] == [{"role": "system", "content": SYSTEM},
                                       {"role": "user", "content": questions[row["index"]]}] for row in rows)
    assert summary["demonstrations"] == {"path": str(demos), "rows": len(rows),
                                         "questions": len({i for i, _ in passing})}
    assert f"wrote {len(rows)} demonstrations" in capsys.readouterr().out
    model, tokenizer = load_pretrained(tiny_model_dir)
    stops = stop_token_ids(model.config, tokenizer)
    for row in rows:
        ids, labels = chat_example(row["messages"], tokenizer, max_length=None, stops=stops)
        learned = [t for t in labels if t != IGNORE_INDEX]
        assert learned[-1] in stops
        assert tokenizer.decode(learned[:-1]) == row["messages"][-1]["content"]


@pytest.mark.parametrize("extra,needle", [
    (["--demonstrations", "{tmp}"], "--demonstrations: expected a file path"),
    (["--demonstrations", "{tmp}/o/results.jsonl"], "is the evaluation's own results.jsonl"),
    (["--demonstrations", "{tmp}/d.jsonl", "--chat_template", "false"], "--demonstrations: the prompts are raw text"),
    (["--demonstrations", "{tmp}/o"], "--demonstrations: expected a file path"),  # the --output_dir, not yet made
    (["--demonstrations", "{tmp}/q.jsonl", "--data", "{tmp}/q.jsonl"], "is the --data file"),
    (["--demonstrations", "{tmp}/taken/d.jsonl"], "{tmp}/taken is a file, not a folder"),
])
def test_demonstrations_bad_input_exits_2(tiny_model_dir, tmp_path, capsys, extra, needle):
    (tmp_path / "q.jsonl").write_text(json.dumps({"question": "What is 1 + 1?", "answer": "#### 2"}) + "\n")
    (tmp_path / "taken").write_text("keep")
    kept = {p.name: p.read_text() for p in tmp_path.iterdir()}
    code = main(["--model", str(tiny_model_dir), "--data", "builtin:arithmetic_test", "--output_dir",
                 str(tmp_path / "o"), "--limit", "1", "--no_progress_bar",
                 *[e.replace("{tmp}", str(tmp_path)) for e in extra]])
    err = capsys.readouterr().err.strip()
    assert code == 2 and needle.replace("{tmp}", str(tmp_path)) in err and len(err.splitlines()) == 1, err
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == kept  # nothing written, nothing changed


def test_the_command_line_says_a_warning_in_one_line(tiny_model_dir, tmp_path):
    """`python -m astrai.evaluate` printed its warnings as Python does (the file and line of astrai's code that
    warned, then that source line: trial); every astrai command line now prints `warning: MESSAGE`, as
    `python -m astrai.train` does."""
    import os
    import subprocess
    import sys

    data = tmp_path / "qa.jsonl"
    data.write_text(json.dumps({"question": "q", "answer": "see the worked solution"}) + "\n")
    result = subprocess.run([sys.executable, "-m", "astrai.evaluate", "--model", str(tiny_model_dir), "--data",
                             str(data), "--max_new_tokens", "2", "--output_dir", str(tmp_path / "eval")],
                            capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if "no final number" in line]
    assert lines == [f"warning: {data}: 1 of 1 answers ('answer') have no final number ('#### N' or a bare number), "
                     "so math_exact_match scores every response to them 0 (rows 1)"], result.stderr
    assert ".py:" not in result.stderr
