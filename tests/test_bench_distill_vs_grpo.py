"""bench/distill_vs_grpo.py runs both arms end to end on tiny models (a random teacher, a random student: the
arithmetic recipes' settings, a few seconds each) and prints the teacher's accuracy, each arm's curve, the
final `python -m astrai.evaluate` score and where each reached the target; the curve and target helpers by hand."""

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_distill import save_tiny, swapped_tokenizer

BENCH = Path(__file__).resolve().parents[1] / "bench" / "distill_vs_grpo.py"
ASYNC_BENCH = BENCH.with_name("async_learning.py")


def load_bench():
    spec = importlib.util.spec_from_file_location("distill_vs_grpo", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_curve_and_minutes_to_the_target(tmp_path):
    bench = load_bench()
    rows = [{"step": 1, "time/elapsed_seconds": 30.0, "policy/loss": 0.1},
            {"step": 2, "time/elapsed_seconds": 90.0, "eval/accuracy": 0.25, "eval/accuracy_ci_low": 0.2,
             "eval/accuracy_ci_high": 0.3},
            {"step": 4, "time/elapsed_seconds": 180.0, "eval/accuracy": 0.5, "eval/accuracy_ci_low": 0.4,
             "eval/accuracy_ci_high": 0.6}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    points = bench.curve(tmp_path)
    assert [(p["step"], p["minutes"], p["accuracy"]) for p in points] == [(2, 1.5, 0.25), (4, 3.0, 0.5)]
    assert bench.minutes_to(points, 0.25) == 1.5 and bench.minutes_to(points, 0.3) == 3.0
    assert bench.minutes_to(points, 0.51) is None
    grpo = [{"minutes": 1.0, "accuracy": 0.3}, {"minutes": 2.0, "accuracy": 0.4}]
    assert bench.ratio_lines({"distill": points, "grpo": grpo}, 0.7, 15) == [  # neither reached 70%
        "ratio: 0.67 at the common level 40.0% (the lower arm's best): grpo 2.0 min, distill 3.0 min"]
    lines = bench.ratio_lines({"distill": points, "grpo": grpo}, 0.45, 15)  # distill reached 45% at 3.0, grpo not
    assert lines[0] == "ratio: at least 5.00 (grpo's minutes to 45.0% / distill's)"
    later = grpo + [{"minutes": 6.0, "accuracy": 0.45}]  # grpo reached it at 6.0
    assert bench.ratio_lines({"distill": points, "grpo": later}, 0.45, 15)[0] == \
        "ratio: 2.00 (grpo's minutes to 45.0% / distill's)"


@pytest.mark.parametrize("argv, message", [
    (["--teacher", "/no/such/teacher"], "--teacher: /no/such/teacher does not exist"),
    (["--teacher", ".", "--arms", "sft"], "--arms: expected some of distill, seqkd, grpo"),
    (["--teacher", ".", "--minutes", "0"], "--minutes: expected a finite number > 0"),
    (["--teacher", ".", "--minutes", "nan"], "--minutes: expected a finite number > 0, got nan"),
    (["--teacher", ".", "--eval-steps", "0"], "--eval-steps: expected >= 1"),
    (["--teacher", "."], "--teacher: "),  # a directory without config.json: refused before any evaluation
])
def test_bad_arguments_exit_2_in_one_line(argv, message):
    done = subprocess.run([sys.executable, str(BENCH), *argv], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and message in done.stderr, done.stderr


@pytest.mark.slow  # 35 s; the refusals above stay in the default suite
def test_both_arms_run_on_tiny_models(tiny_model_dir, tmp_path):
    teacher = save_tiny(tmp_path / "teacher", seed=1)
    out = tmp_path / "bench"
    done = subprocess.run([sys.executable, str(BENCH), "--teacher", str(teacher), "--student", str(tiny_model_dir),
                           "--minutes", "0.01", "--eval-steps", "1", "--threads", "1", "--output-dir", str(out),
                           "--arms", "distill,grpo"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert re.search(r"^  teacher: \d+\.\d% \[", done.stdout, re.M), done.stdout
    for arm in ("distill", "grpo"):  # one step each (the time limit), evaluated, then scored once more
        assert re.search(rf"^  {arm}\s+\d+\.\d% at 1 \(\d+\.\d min\)", done.stdout, re.M), done.stdout
        assert (out / f"{arm}_eval" / "summary.json").is_file()
        config = (out / arm / "config.yaml").read_text()
        assert "max_minutes: 0.01" in config
    assert str(teacher) in (out / "distill" / "config.yaml").read_text()
    assert "on_policy_distill" in (out / "distill" / "config.yaml").read_text()
    assert done.stdout.count("final, python -m astrai.evaluate: ") == 2
    assert re.search(r"^ratio: \d+\.\d\d at the common level ", done.stdout, re.M), done.stdout
    scored = (out / "teacher_eval" / "summary.json").stat().st_mtime_ns
    again = subprocess.run([sys.executable, str(BENCH), "--teacher", str(teacher), "--student", str(tiny_model_dir),
                            "--output-dir", str(out)], capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "holds an earlier run" in again.stderr, again.stderr  # before any evaluation
    assert (out / "teacher_eval" / "summary.json").stat().st_mtime_ns == scored


@pytest.mark.parametrize("bench", [BENCH, ASYNC_BENCH])
def test_an_output_dir_that_is_a_file_exits_2_in_one_line(bench, tiny_model_dir, tmp_path):
    argv = ["--teacher", str(tiny_model_dir), "--student", str(tiny_model_dir)] if bench == BENCH else []
    file = tmp_path / "runs"
    file.write_text("not a directory")
    done = subprocess.run([sys.executable, str(bench), *argv, "--output-dir", str(file)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and f"--output-dir: {file} exists and is not a directory" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and file.read_text() == "not a directory"


def test_a_failed_run_quotes_its_log_when_the_directory_goes_away(tmp_path):
    sys.path.insert(0, str(BENCH.parent))
    try:
        from async_learning import run_failed
    finally:
        sys.path.remove(str(BENCH.parent))
    log = tmp_path / "sync.log"
    log.write_text("".join(f"line {i}\n" for i in range(30)))
    assert run_failed("sync: the training run", 2, log, kept=True) == (
        f"sync: the training run failed (exit 2); its log: {log}")
    quoted = run_failed("sync: the training run", 2, log, kept=False)  # the temporary directory is removed on exit
    assert quoted.startswith("sync: the training run failed (exit 2); the end of its log:\nline 10\n")
    assert quoted.endswith("line 29\n") and "line 9\n" not in quoted


def test_a_teacher_with_another_tokenizer_is_refused_before_any_evaluation(tiny_model_dir, tmp_path):
    teacher = save_tiny(tmp_path / "teacher", seed=1, tokenizer=swapped_tokenizer())
    out = tmp_path / "bench"
    done = subprocess.run([sys.executable, str(BENCH), "--teacher", str(teacher), "--student", str(tiny_model_dir),
                           "--arms", "distill", "--output-dir", str(out)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode != 0 and "distill: `python -m astrai.train --check` refused the run: " in done.stderr
    assert "share the student's tokenizer" in done.stderr, done.stderr
    assert not (out / "teacher_eval").exists()  # refused in seconds: the teacher was never evaluated


@pytest.mark.parametrize("rows", [pytest.param(3, marks=pytest.mark.slow), 0])  # 3: a minute of training (slow tier)
def test_seqkd_trains_on_the_teachers_answers_after_their_minutes(tiny_model_dir, tmp_path, monkeypatch, capsys,
                                                                  rows):
    """The seqkd arm with the teacher's demonstrations stubbed (`python -m astrai.evaluate --demonstrations` is
    tested in test_evaluate.py): sft trains on them for --minutes less the teacher's, its curve starts after them,
    and it is compared with grpo; without a right answer the arm is skipped."""
    bench = load_bench()
    demonstrations = tmp_path / "demos.jsonl"
    demonstrations.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"What is {i} + 1?"},
                                                               {"role": "assistant", "content": str(i + 1)}]}) + "\n"
                                      for i in range(rows)))
    monkeypatch.setattr(bench, "teacher_demonstrations", lambda args, root: (demonstrations, rows, 0.5))
    out = tmp_path / "bench"
    bench.main(["--teacher", str(tiny_model_dir), "--student", str(tiny_model_dir),
                "--arms", "seqkd,grpo" if rows else "seqkd",
                "--minutes", "0.51", "--eval-steps", "1", "--threads", "1", "--output-dir", str(out)])
    printed = capsys.readouterr().out
    assert f"seqkd: the teacher answered the builtin:arithmetic questions in 0.5 min; {rows} right answers" in printed
    if not rows:
        assert "seqkd: no right answer to train on: skipped" in printed and not (out / "seqkd").exists()
        assert "ratio" not in printed
        return
    config = (out / "seqkd" / "config.yaml").read_text()
    assert f"path: {demonstrations}" in config and "max_minutes: 0.01" in config and "type: sft" in config
    first = re.search(r"^  seqkd\s+\d+\.\d% at 1 \((\d+\.\d) min\)", printed, re.M)
    assert first and float(first.group(1)) >= 0.5, printed  # the teacher's half minute comes first
    assert printed.count("final, python -m astrai.evaluate: ") == 2
    assert re.search(r"^ratio: \d+\.\d\d at the common level .*, seqkd \d+\.\d min$", printed, re.M), printed
