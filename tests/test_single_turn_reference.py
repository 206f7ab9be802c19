"""Single-turn rollouts are what they were before the trajectory seam: a fixed-seed online_grpo and online_ppo run
(3 steps on the tiny model, deterministic) gives the metrics and final weights recorded in
fixtures/single_turn_reference.json (`tests/single_turn_reference.py`). On the machine kind that recorded them the
weights must be bit-identical; elsewhere (another CPU's kernels round differently) the metrics and each tensor's sum
of squares equal to 1e-5 relative, and each tensor's sum to 1e-4 of its L2 norm: a sum of signed weights cancels,
so its rounding error scales with the norm, not with the sum (an AVX2-only machine differs from the AMX machine that
recorded the fixture by up to 2.2e-5 in a sum of 0.925 whose norm is 1.83)."""

import json
import math

import pytest
from single_turn_reference import FIXTURE, RUNS, machine, run, tiny_model

REFERENCE = json.loads(FIXTURE.read_text())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("tiny-reference"))


ADDED_SINCE = {"rollout/truncated_fraction"}
"""Metrics added after the reference was recorded: new keys, the recorded ones unchanged."""


def _close(a: float, b: float, rel: float) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=rel)


def _same_tensor(got: list, want: list, same_machine: bool) -> bool:
    """[sum, sum of squares] of one tensor: equal on the recording machine; elsewhere as the module says."""
    if same_machine:
        return got == want
    (total, squares), (want_total, want_squares) = got, want
    return (_close(squares, want_squares, 1e-5)
            and abs(total - want_total) <= 1e-4 * math.sqrt(max(want_squares, 1e-12)))


@pytest.mark.parametrize("kind", sorted(RUNS))
def test_single_turn_run_matches_the_recorded_reference(kind, model_dir, tmp_path):
    want = REFERENCE["runs"][kind]
    got = run(kind, model_dir, tmp_path / kind)
    same_machine = REFERENCE["machine"] == machine()
    rel = 0.0 if same_machine else 1e-5
    assert len(got["metrics"]) == len(want["metrics"])
    for step, (g, w) in enumerate(zip(got["metrics"], want["metrics"]), start=1):
        assert sorted(set(g) - ADDED_SINCE) == sorted(w), (step, set(g) ^ set(w))
        bad = {k: (g[k], w[k]) for k in w if not _close(g[k], w[k], rel)}
        assert not bad, f"{kind} step {step}: {bad}"
    assert sorted(got["weights"]) == sorted(want["weights"])
    bad = {k: (got["weights"][k], v) for k, v in want["weights"].items()
           if not _same_tensor(got["weights"][k], v, same_machine)}
    assert not bad, bad
    if same_machine:
        assert got["sha256"] == want["sha256"]
