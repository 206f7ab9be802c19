"""bench/partial_rollouts.py runs both its workloads end to end on a small setting (single answers and multi-turn
episodes) and prints a ratio per run, and the partial side halves the decode steps of a long-tailed workload."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "partial_rollouts.py"


@pytest.mark.parametrize("extra", [[], ["--episodes", "--max-turns", "3"]])
def test_the_partial_rollouts_bench_prints_steps_and_a_ratio(extra):
    done = subprocess.run([sys.executable, str(BENCH), "--rollouts", "2", "--max-new-tokens", "96", "--hidden", "32",
                           "--batch-size", "2", "--group-size", "2", "--in-flight", "6", "--stop-ids", "4", *extra],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    steps = {m[0]: float(m[1]) for m in re.findall(r"^(sync|partial)\s+[\d.]+ s/rollout\s+([\d.]+) decode steps",
                                                   done.stdout, re.M)}
    assert set(steps) == {"sync", "partial"} and 0 < steps["partial"] < steps["sync"], done.stdout
    assert re.search(r"^ratio: \d+\.\d\d ", done.stdout, re.M), done.stdout


def test_the_batch_size_profile_is_plotted_and_refused_for_episodes(tmp_path):
    pytest.importorskip("matplotlib")
    small = [sys.executable, str(BENCH), "--rollouts", "2", "--max-new-tokens", "96", "--hidden", "32",
             "--batch-size", "2", "--group-size", "2", "--in-flight", "6", "--stop-ids", "4"]
    done = subprocess.run(small + ["--plot", str(tmp_path / "profile.png")], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "profile.png").stat().st_size > 1000 and "plot: " in done.stdout
    refused = subprocess.run(small + ["--episodes", "--plot", str(tmp_path / "x.png")], capture_output=True,
                             text=True, timeout=300)
    assert refused.returncode == 2 and "--plot: the batch-size profile is drawn for single answers only" in \
        refused.stderr and not (tmp_path / "x.png").exists()
