"""bench/gpu_check.py in its --smoke mode on CPU (tiny shapes): it runs, exits 0, and its JSON report holds sane
figures for every part, with the CUDA-only part skipped with a note (~15 s)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_smoke_on_cpu(tmp_path):
    out = tmp_path / "report.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", ASTR_BACKEND="")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--smoke", "--output", str(out)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["mode"] == "smoke" and report["device_name"] == "cpu" and report["auto_backend"] == "torch"
    assert "needs CUDA" in report["kernel_parity"]["skipped"]

    parity = report["greedy_parity"]
    for name in ("bfloat16", "float32_control"):
        part = parity[name]
        assert part["rows"] == 4 and part["tokens_per_row"] == 12 and 0.0 <= part["match_rate"] <= 1.0
        assert (part["first_divergence"] is None) == (part["identical_rows"] == part["rows"])
    assert parity["float32_control"]["match_rate"] == 1.0  # same weights in float32: the same greedy tokens

    assert set(report["throughput"]) == {"1", "4", "8"}
    for row in report["throughput"].values():
        assert row["astrai_tok_s"] > 0 and row["transformers_tok_s"] > 0
        assert math.isclose(row["ratio"], row["astrai_tok_s"] / row["transformers_tok_s"])

    roof = report["roofline"]
    cfg = report["plan"]["shapes"]
    params = cfg["vocab_size"] * cfg["hidden_size"] + cfg["num_hidden_layers"] * (
        2 * cfg["hidden_size"] ** 2 + 2 * cfg["hidden_size"] * cfg["hidden_size"] // 2  # q, o; k, v (Nkv = Nh / 2)
        + 3 * cfg["hidden_size"] * cfg["intermediate_size"] + 2 * cfg["hidden_size"]) + cfg["hidden_size"]
    assert roof["weight_bytes"] == 2 * params  # bfloat16 engine copy, tied embeddings counted once
    assert roof["decode_step_ms"] > 0 and roof["kv_bytes_per_step"] > 0 and 0 < roof["fraction"] < 1
    assert math.isclose(roof["fraction"], roof["achieved_tbps"] / roof["peak_tbps"])

    step = report["train_step"]
    assert step["ok"] and step["exit_code"] == 0 and step["metrics"]["policy_version"] == 1
    assert 0 <= step["metrics"]["rollout/logprob_gap"] < 0.1  # bf16 rollout copy of an fp32 policy
    assert "ratio:" in proc.stdout and "skipped" not in json.dumps({k: v for k, v in report.items()
                                                                    if k != "kernel_parity"})
