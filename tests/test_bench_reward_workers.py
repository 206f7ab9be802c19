"""bench/reward_workers.py: its slow reward scores every completion 1.0 through the worker pool, in and out of
process, and the worker list is parsed or refused in one line."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import reward_workers  # noqa: E402


@pytest.mark.parametrize("workers", [0, 2])
def test_slow_reward_is_scored_and_costs_its_time(tmp_path, workers):
    path = reward_workers.write_reward(tmp_path, ms=5, kind="sleep")
    seconds = reward_workers.time_rounds(path, workers, completions=4, rounds=1)
    assert len(seconds) == 1
    # 4 completions x 5 ms, split over the workers: at least one share of the serial cost
    assert seconds[0] >= 4 * 0.005 / max(workers, 1) * 0.9


def test_worker_counts_parsed_or_refused():
    assert reward_workers.parse_workers("0,1, 2") == [0, 1, 2]
    for bad in ("", "a,1", "-1"):
        with pytest.raises(ValueError, match="--workers"):
            reward_workers.parse_workers(bad)
