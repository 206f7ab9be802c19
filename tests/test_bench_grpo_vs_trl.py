"""bench/grpo_vs_trl.py and bench/learn_vs_trl.py without TRL: --help, the one-line exit 2 when no TRL interpreter is
given, argument checks, the TRL worker's reward against astrai's math_exact_match, and the pure helpers that
turn timings and accuracies into the printed lines."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import _trl_grpo_worker as worker  # noqa: E402
import floors  # noqa: E402
import grpo_vs_trl  # noqa: E402
import learn_vs_trl  # noqa: E402

SCRIPTS = {"grpo_vs_trl.py": [], "learn_vs_trl.py": ["--minutes", "1"]}


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRL_PYTHON"}
    return subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_help_and_exit_2_with_the_venv_recipe_without_trl(script):
    helped = _run(script, "--help")
    assert helped.returncode == 0 and "--trl-python" in helped.stdout
    proc = _run(script, *SCRIPTS[script])
    assert proc.returncode == 2
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and "pip install torch==2.13.0" in lines[0] and "pip install trl==1.16.0" in lines[0]


@pytest.mark.parametrize("argv", [["--group", "1"], ["--iters", "0"], ["--micro-batch", "5"],
                                  ["--temperature", "0"], ["--trl-generation", "vllm"]])
def test_grpo_vs_trl_refuses_bad_arguments(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        grpo_vs_trl.parse_args(argv)
    assert exit_info.value.code == 2 and "error: " in capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("argv", [[], ["--minutes", "0"], ["--minutes", "1", "--threads", "0"],
                                  ["--minutes", "1", "--eval-limit", "0"]])
def test_learn_vs_trl_refuses_bad_arguments(argv):
    with pytest.raises(SystemExit) as exit_info:
        learn_vs_trl.parse_args(argv)
    assert exit_info.value.code == 2


def test_the_defaults_are_the_task():
    args = grpo_vs_trl.parse_args([])
    assert (args.iters, args.prompts, args.group, args.max_new_tokens, args.temperature) == (5, 4, 8, 32, 0.8)
    assert args.trl_generation == "both" and not args.stop_at_eos


def test_trl_reward_is_astrai_math_exact_match():
    from astrai.rewards.builtins import math_exact_match

    texts = ["70 + 66 = 136", "The answer is #### 136.", "I think 135", "", "12 - 5 = 7, so 7", "$1,36"]
    answers = ["70 + 66 = 136\n#### 136"] * 3 + ["#### 4", "12 - 5 = 7\n#### 7", "#### 136"]
    expected = math_exact_match([""] * len(texts), texts, answer=answers)
    assert expected == [1.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    conversational = [[{"role": "assistant", "content": t}] for t in texts]
    prompts = [[{"role": "user", "content": "q"}]] * len(texts)
    assert worker.exact_match_reward(prompts, conversational, answers, trainer_state=None) == expected
    assert worker.exact_match_reward(["q"] * len(texts), texts, answers, completion_ids=[[1]] * len(texts)) == expected
    assert worker.conversations(["What is 2 + 3?"]) == [[{"role": "user", "content": "What is 2 + 3?"}]]


def test_worker_phases_from_its_timers():
    record = {"step_begin": [10.0, 30.0], "step_end": [20.0, 45.0],
              "rollouts": [{"start": 10.5, "end": 14.0, "generate": 3.0, "scoring": 0.1, "prompt_lengths": [5],
                            "response_lengths": [32], "prompt_mismatches": 0},
                           {"start": 21.0, "end": 26.0, "generate": 4.0, "prompt_lengths": [6],
                            "response_lengths": [31], "prompt_mismatches": 1}]}
    first, second = worker.speed_iterations(record)
    assert first["total"] == 10.0 and first["update"] == 6.0 and first["scoring"] == 0.1
    assert second["total"] == 25.0 and second["update"] == 19.0 and second["scoring"] == 0.0
    assert second["prompt_mismatches"] == 1 and worker.response_lengths([[1, 2], [3]]) == [2, 1]


def test_floors_other_table_and_ratio(capsys):
    dims = floors.Dims(layers=2, hidden=8, intermediate=16, heads=2, kv_heads=1, head_dim=4, vocab=32)
    it = grpo_vs_trl.add_other({"weight_sync": 0.5, "generate": 2.0, "scoring": 0.25, "update": 4.0, "total": 7.0,
                                "prompt_lengths": [3, 4], "response_lengths": [2, 2]})
    assert it["other"] == pytest.approx(0.25)
    fl = grpo_vs_trl.phase_floors(dims, it, rate=1e3, decode_rate=5e2)
    assert fl["scoring"] == 0.0 and fl["total"] == pytest.approx(fl["generate"] + fl["update"])
    trl = dict(it, total=14.0)
    grpo_vs_trl.print_table({"astrai": [it], "TRL generate": [trl]}, {"astrai": [fl], "TRL generate": [fl]})
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["phase", "astrai", "med", "min", "/floor", "TRL", "generate", "med", "min",
                                "/floor", "floor"]
    assert table[1].split()[:4] == ["weight_sync", "0.50", "0.50", "-"] and table[-1].split()[5] == "14.00"
    assert grpo_vs_trl.ratio_line(14.0, 7.0) == "ratio: 2.00"
    assert grpo_vs_trl.median_min([{"a": 3.0}, {"a": 1.0}, {}], "a") == (2.0, 1.0)


def test_accuracy_lines_and_curve():
    summary = {"accuracy": 0.415, "correct": 83.0, "n": 200, "ci_low": 0.3491, "ci_high": 0.4839}
    assert learn_vs_trl.accuracy_line("astrai", summary) == ("astrai: accuracy 0.4150 (83/200), 95% Wilson interval "
                                                             "[0.3491, 0.4839]")
    assert learn_vs_trl.difference_line(0.415, 0.2) == "difference: +21.5 points (astrai - TRL)"
    assert learn_vs_trl.difference_line(0.1, 0.2) == "difference: -10.0 points (astrai - TRL)"
    assert learn_vs_trl.accuracy_ratio_line(0.4, 0.2) == "ratio: 2.00"
    assert learn_vs_trl.accuracy_ratio_line(0.1, 0.0).startswith("ratio: inf")
    assert learn_vs_trl.accuracy_ratio_line(0.0, 0.0).startswith("ratio: n/a")
    points = [{"seconds": 5, "reward": 0.0}, {"seconds": 60, "reward": 0.5}, {"seconds": 61, "reward": 1.0},
              {"seconds": 200, "reward": 0.25}]
    assert learn_vs_trl.curve_by_minute(points) == [(1, 0.25, 2), (2, 1.0, 1), (4, 0.25, 1)]
    assert learn_vs_trl.curve_line("TRL", points) == "TRL training reward by minute: 1: 0.250  2: 1.000  4: 0.250"
    assert learn_vs_trl.curve_line("TRL", []).endswith("none logged")
