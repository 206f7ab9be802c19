"""The non-finite guard holds where the job samples (issue 42, class 9): weights that make the logits NaN reach the
rollout and the in-training evaluation as one line naming the phase and the policy_version (exit 2), never the
sampler's traceback, and nothing is published."""

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from astrai.train import main


@pytest.fixture()
def nan_model(tiny_model_dir, tmp_path):
    path = tmp_path / "nan-model"
    shutil.copytree(tiny_model_dir, path)
    tensors = load_file(str(path / "model.safetensors"))
    name = next(k for k in tensors if k.endswith("norm.weight") and "layers" not in k)  # the final norm
    tensors[name] = torch.full_like(tensors[name], float("nan"))
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.mark.parametrize("phase, extra", [
    ("the rollout", []),
    ("evaluation", ["--train.eval_on_start", "true", "--train.eval_steps", "1", "--data.eval_path",
                    "builtin:arithmetic_test", "--data.eval_limit", "2"]),
])
def test_nan_logits_stop_the_job_in_one_line_naming_the_phase(nan_model, tmp_path, capfd, phase, extra):
    out = tmp_path / "run"
    code = main(["--model.path", str(nan_model), "--train.type", "online_grpo", "--train.output_dir", str(out),
                 "--train.max_steps", "2", "--data.path", "builtin:arithmetic_test", "--data.max_prompt_length", "128",
                 "--rollout.batch_size", "2", "--rollout.max_new_tokens", "4", "--grpo.group_size", "2",
                 "--grpo.minibatch_size", "4", "--grpo.micro_batch_size", "2", "--train.progress_bar", "false",
                 "--train.report_to", "none", *extra])
    err = capfd.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert err[-1].startswith(f"error: {phase} of policy_version 0 met non-finite logits (sample_rows: row 0 "), err
    assert not any("Traceback" in line for line in err)
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").glob("step-*"))


def test_evaluation_raises_the_fault_on_every_rank_together():
    """Non-finite logits met by one rank's evaluation: the ranks agree on a flag before the sums, so every rank
    raises the same `agreed` fault (no rank left waiting in a collective, and the launch scripts take the job's code
    without the launcher's report); the line is the failing rank's, named; no failure anywhere raises nothing."""
    import types

    from astrai.distributed.context import DistributedContext
    from astrai.trainer.evaluation_callback import EvaluationCallback
    from astrai.trainer.faults import NonFiniteError

    err = FloatingPointError("sample_rows: row 0 has non-finite logits (max nan)")
    for rank, failed, want in ((0, None, "rank 1: evaluation of policy_version 3 met non-finite logits"),
                               (1, err, "evaluation of policy_version 3 met non-finite logits")):
        lines = [None, f"evaluation of policy_version 3 met non-finite logits ({err}); ..."]
        dist = types.SimpleNamespace(rank=rank, world_size=2, device=torch.device("cpu"),
                                     all_reduce_max=lambda t: torch.ones_like(t), gather_objects=lambda line: lines)
        dist.first_failure = lambda line, dist=dist: DistributedContext.first_failure(dist, line)
        fault = EvaluationCallback._nonfinite_on_some_rank(types.SimpleNamespace(dist=dist), failed, 3)
        assert isinstance(fault, NonFiniteError) and fault.agreed and str(fault).startswith(want), str(fault)
    quiet = types.SimpleNamespace(world_size=2, device=torch.device("cpu"), all_reduce_max=lambda t: t)
    quiet.first_failure = lambda line: DistributedContext.first_failure(quiet, line)
    assert EvaluationCallback._nonfinite_on_some_rank(types.SimpleNamespace(dist=quiet), None, 3) is None


def test_the_evaluator_says_non_finite_logits_in_one_line(nan_model, tmp_path, capfd):
    from astrai import evaluate

    code = evaluate.main(["--model", str(nan_model), "--data", "builtin:arithmetic_test", "--limit", "2",
                          "--max_new_tokens", "4", "--output_dir", str(tmp_path / "eval"), "--no_progress_bar"])
    err = capfd.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("error: the evaluation met non-finite logits (sample_rows: row 0 "), err
    assert not any("Traceback" in line for line in err) and not (tmp_path / "eval").exists()
