"""Fixed-seed single-turn online_grpo and online_ppo runs on the tiny model: their metrics and final weights.

`tests/test_single_turn_reference.py` compares a run of today's code with `fixtures/single_turn_reference.json`,
written by this script before the rollout layer was rebuilt around the trajectory (a loss mask apart from the
attention mask), so that single-turn rollouts stay what they were:

    python tests/single_turn_reference.py            # rewrites the fixture (only when a change is meant to move it)
"""

from __future__ import annotations

import hashlib
import json
import platform
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "tests" / "fixtures" / "single_turn_reference.json"
RUNS = {
    "online_grpo": ("grpo.yaml", ["--grpo.group_size", "4", "--rollout.batch_size", "2", "--grpo.minibatch_size", "4",
                                  "--grpo.micro_batch_size", "2", "--optim.learning_rate", "1e-3"]),
    "online_ppo": ("ppo.yaml", ["--rollout.batch_size", "4", "--ppo.minibatch_size", "2", "--ppo.micro_batch_size",
                                "1", "--optim.learning_rate", "1e-3", "--ppo.epochs", "2"]),
}
"""train type -> (its example job, overrides)."""
REWARD = """def spread(prompts, completions, completion_ids, **kwargs):
    return [len(ids) / 6 + (ids[0] % 3) / 3 for ids in completion_ids]
"""
"""A reward that varies on the tiny model's random answers (math_exact_match scores them all 0)."""
COMMON = ["--max_steps", "3", "--rollout.max_new_tokens", "6", "--train.progress_bar", "false",
          "--data.truncation", "left", "--runtime.deterministic", "true", "--train.report_to", "none",
          "--runtime.num_threads", "1"]
VOLATILE = ("time/", "memory/", "perf/")
"""Metric prefixes that measure the machine, not the run."""


def tiny_model(path: Path) -> Path:
    """The tiny random Llama of tests/conftest.py's `tiny_model_dir` (seed 0), saved under `path`."""
    from astrai.models import AutoRegressiveLM, hf_state_dict, tiny_config, tiny_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = AutoRegressiveLM(tiny_config())
    save_file({k: v.contiguous() for k, v in hf_state_dict(model).items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(model.config.to_hf_dict()))
    tiny_tokenizer().save(path)
    return path


def machine() -> str:
    """What decides bitwise results: torch's version and the CPU's model and flags (sha256, 16 hex digits)."""
    cpu = ""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = next((ln for ln in lines if ln.startswith("model name")), "") + \
            next((ln for ln in lines if ln.startswith("flags")), "")
    except OSError:
        cpu = platform.processor()
    return hashlib.sha256(f"{torch.__version__}|{platform.machine()}|{cpu}".encode()).hexdigest()[:16]


def run(kind: str, model_dir: Path, out: Path) -> dict:
    """Train `kind` for 3 steps; its metrics (machine-dependent ones left out) and the final policy's weights:
    per tensor [sum, sum of squares] in float64 and the sha256 of all of them in name order."""
    import yaml

    from astrai.train import main

    out.mkdir(parents=True)
    example, overrides = RUNS[kind]
    job = yaml.safe_load((REPO / "configs/examples" / example).read_text())
    (out.parent / f"{kind}_reward.py").write_text(REWARD)
    job["reward"] = {"functions": [{"function": f"{kind}_reward:spread", "path": str(out.parent / f"{kind}_reward.py")}],
                     "num_workers": 0}
    (out.parent / f"{kind}.yaml").write_text(yaml.safe_dump(job))
    code = main(["--config", str(out.parent / f"{kind}.yaml"), *overrides, *COMMON, "--model.path", str(model_dir),
                 "--train.output_dir", str(out), "--overwrite_output_dir", "true"])
    assert code == 0, f"{kind} exited {code}"
    metrics = []
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        metrics.append({k: v for k, v in sorted(record.items())
                        if isinstance(v, (int, float)) and not k.startswith(VOLATILE)})
    (checkpoint,) = sorted((out / "checkpoints").glob("step-*"))[-1:]
    weights = load_file(str(checkpoint / "model.safetensors"))
    digest = hashlib.sha256()
    stats = {}
    for name in sorted(weights):
        tensor = weights[name].contiguous()
        digest.update(name.encode() + tensor.numpy().tobytes())
        x = tensor.double()
        stats[name] = [float(x.sum()), float((x * x).sum())]
    return {"metrics": metrics, "weights": stats, "sha256": digest.hexdigest()}


def main() -> int:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = tiny_model(Path(tmp) / "tiny")
        result = {"machine": machine(), "runs": {kind: run(kind, model_dir, Path(tmp) / kind) for kind in RUNS}}
    FIXTURE.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    print(f"wrote {FIXTURE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
