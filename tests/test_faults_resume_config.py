"""Issue 28 part 7, resuming with a changed config: fields that cannot change are refused in one line; the others
are applied and listed in one line (learning rates and the schedule over the restored optimizer state, max_steps,
logging); a model.path elsewhere says which weights are used, or is refused where the job builds its reference model (or
LoRA base) from it. Nothing changes silently."""

import json

import pytest
from fault_jobs import REPO, sft_args, write_chats

from astrai.train import main


@pytest.fixture
def chats(tmp_path):
    return write_chats(tmp_path / "chats.jsonl")


def constant(model_dir, out, chats, *extra):
    """The tiny sft job on a constant schedule without warmup (the example's is cosine with warmup)."""
    return sft_args(model_dir, out, chats, "--optim.lr_scheduler_type", "constant", "--optim.warmup_steps", 0, *extra)


def lrs(out):
    return [json.loads(line)["policy/lr"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_new_learning_rate_and_length_are_applied_and_listed(tiny_model_dir, chats, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(constant(tiny_model_dir, out, chats, "--max_steps", 2)) == 0
    capsys.readouterr()
    assert main(constant(tiny_model_dir, out, chats, "--max_steps", 4, "--optim.learning_rate", "5e-4",
                         "--train.logging_steps", 2, "--checkpoint.resume", "auto")) == 0
    printed = capsys.readouterr().out.splitlines()
    (line,) = [p for p in printed if p.startswith("resume: ")]
    assert line == ("resume: optim.learning_rate 0.001 -> 0.0005 (applied to the schedule from step 2), "
                    "train.max_steps 2 -> 4 (applied to the schedule from step 2), train.logging_steps 1 -> 2")
    assert lrs(out) == pytest.approx([1e-3, 1e-3, 5e-4, 5e-4])  # the old rate came back from the optimizer before


def test_a_new_schedule_applies_from_the_resumed_step(tiny_model_dir, chats, tmp_path, capsys):
    """Linear decay over 4 steps after 2 constant ones: the rates the resumed steps apply are the new schedule's at
    steps 2 and 3 times the peak: 1e-3 * (1 - 2/4) and 1e-3 * (1 - 3/4)."""
    out = tmp_path / "run"
    assert main(constant(tiny_model_dir, out, chats, "--max_steps", 2)) == 0
    assert main(constant(tiny_model_dir, out, chats, "--max_steps", 4, "--optim.lr_scheduler_type", "linear",
                         "--checkpoint.resume", "auto")) == 0
    assert "optim.lr_scheduler_type constant -> linear (applied to the schedule from step 2)" in capsys.readouterr().out
    assert lrs(out) == pytest.approx([1e-3, 1e-3, 5e-4, 2.5e-4])


@pytest.mark.parametrize("field, value, why", [
    ("train.seed", "7", "the data order and the random streams come from it"),
    ("data.shuffle", "false", "the data order comes from it"),
])
def test_a_field_that_cannot_change_is_refused_in_one_line(tiny_model_dir, chats, tmp_path, capsys, field, value,
                                                           why):
    out = tmp_path / "run"
    assert main(sft_args(tiny_model_dir, out, chats, "--max_steps", 1)) == 0
    capsys.readouterr()
    ckpt = out / "checkpoints" / "step-00000001"
    for check in ((), ("--check",)):
        assert main([*check, *sft_args(tiny_model_dir, out, chats, "--max_steps", 2, f"--{field}", value,
                                       "--checkpoint.resume", "auto")]) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        old = {"train.seed": "42", "data.shuffle": "true"}[field]
        assert line == (f"error: {ckpt}: {field} cannot change on resume ({why}): the run used {old}, this job says "
                        f"{value}; resume with --{field} {old}, or start a new run from its weights (--model.path "
                        f"{ckpt})")


def test_another_model_path_says_which_weights_are_used(tiny_model_dir, chats, tmp_path, capsys):
    import shutil

    copy = tmp_path / "other-model"
    shutil.copytree(tiny_model_dir, copy)
    out = tmp_path / "run"
    assert main(sft_args(tiny_model_dir, out, chats, "--max_steps", 1)) == 0
    capsys.readouterr()
    assert main(sft_args(copy, out, chats, "--max_steps", 2, "--checkpoint.resume", "auto")) == 0
    ckpt = out / "checkpoints" / "step-00000001"
    (line,) = [p for p in capsys.readouterr().out.splitlines() if p.startswith("resume: ")]
    assert line == (f"resume: train.max_steps 1 -> 2 (applied to the schedule from step 1), "
                    f"model.path {tiny_model_dir} -> {copy}: the weights come from the checkpoint {ckpt}, "
                    f"not from {copy} (used for its tokenizer; start a new run to train from its weights)")


def test_an_unchanged_resume_lists_nothing(tiny_model_dir, chats, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(sft_args(tiny_model_dir, out, chats, "--max_steps", 1)) == 0
    assert main(sft_args(tiny_model_dir, out, chats, "--max_steps", 1, "--checkpoint.resume", "auto")) == 0
    assert "resume: " not in capsys.readouterr().out


def test_another_lora_is_refused_before_anything_loads(tiny_model_dir, chats, tmp_path, capsys):
    """The checkpoint holds r=4 adapters: another rank, no LoRA, or LoRA over a full-weight run is one line (exit
    2), at --check too, not a state-dict size mismatch from torch."""
    out, full = tmp_path / "run", tmp_path / "full"
    lora = ("--model.lora", "{r: 4, alpha: 8}")
    assert main(sft_args(tiny_model_dir, out, chats, "--max_steps", 1, *lora)) == 0
    assert main(sft_args(tiny_model_dir, full, chats, "--max_steps", 1)) == 0
    capsys.readouterr()
    for run, change in ((out, ("--model.lora", "{r: 2, alpha: 8}")), (out, ("--model.lora", "{}")), (full, lora)):
        for check in ((), ("--check",)):
            assert main([*check, *sft_args(tiny_model_dir, run, chats, "--max_steps", 2, *change,
                                           "--checkpoint.resume", "auto")]) == 2
            (line,) = capsys.readouterr().err.strip().splitlines()
            assert line.startswith(f"error: {run / 'checkpoints' / 'step-00000001'}: model.lora cannot change on "
                                   "resume (the checkpoint holds adapters of the run's rank"), line


def grpo_args(model_dir, out, *extra):
    """The grpo example on the tiny model, small (2 prompts x 4 responses of 4 tokens per step)."""
    return ["--config", str(REPO / "configs/examples/grpo.yaml"), "--model.path", str(model_dir),
            "--train.output_dir", str(out), "--rollout.batch_size", "2", "--grpo.minibatch_size", "4",
            "--grpo.micro_batch_size", "4", "--rollout.max_new_tokens", "4", "--data.truncation", "left",
            "--train.progress_bar", "false", *map(str, extra)]


def test_another_model_path_is_refused_where_the_reference_is_built_from_it(tiny_model_dir, tmp_path, capsys):
    """A user trial: resuming grpo (kl_coef 0.04) with another model.path rebuilt the KL reference from it (step 2's
    rollout/kl 4e-10 vs 8e-4). The reference is the run's starting model: refused in one line (exit 2), at --check
    too, before anything loads or is written."""
    import shutil

    copy = tmp_path / "other-model"
    shutil.copytree(tiny_model_dir, copy)
    out = tmp_path / "run"
    assert main(grpo_args(tiny_model_dir, out, "--max_steps", 1)) == 0
    capsys.readouterr()
    ckpt = out / "checkpoints" / "step-00000001"
    metrics = (out / "metrics.jsonl").read_text()
    # a job that reads no reference now is refused too: the run's checkpoint was written with one (the next resume
    # would build it from the path this one records)
    for extra in ((), ("--grpo.kl_coef", 0)):
        for check in ((), ("--check",)):
            assert main([*check, *grpo_args(copy, out, "--max_steps", 2, "--checkpoint.resume", "auto",
                                            *extra)]) == 2
            (line,) = capsys.readouterr().err.strip().splitlines()
            assert line == (f"error: {ckpt}: model.path cannot change on resume of this online_grpo job (the "
                            f"reference model is the run's starting model, loaded from it): the run used "
                            f"{tiny_model_dir}, this job says {copy}; resume with --model.path {tiny_model_dir}, or "
                            f"start a new run from its weights (--model.path {ckpt})")
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000001"]
    assert (out / "metrics.jsonl").read_text() == metrics


def test_another_model_path_is_applied_where_no_reference_is_read(tiny_model_dir, tmp_path, capsys):
    """grpo without a KL term on either side reads only the tokenizer from model.path: the resume goes on and says
    that the weights come from the checkpoint."""
    import shutil

    copy = tmp_path / "other-model"
    shutil.copytree(tiny_model_dir, copy)
    out = tmp_path / "run"
    assert main(grpo_args(tiny_model_dir, out, "--max_steps", 1, "--grpo.kl_coef", 0)) == 0
    capsys.readouterr()
    assert main(grpo_args(copy, out, "--max_steps", 2, "--grpo.kl_coef", 0, "--checkpoint.resume", "auto")) == 0
    (line,) = [p for p in capsys.readouterr().out.splitlines() if p.startswith("resume: ")]
    assert f"model.path {tiny_model_dir} -> {copy}: the weights come from the checkpoint" in line


def test_another_model_path_under_lora_is_refused(tiny_model_dir, chats, tmp_path, capsys):
    """A LoRA checkpoint holds the adapters only: the base weights under them come from model.path."""
    import shutil

    copy = tmp_path / "other-model"
    shutil.copytree(tiny_model_dir, copy)
    out = tmp_path / "run"
    lora = ("--model.lora", "{r: 4, alpha: 8}")
    assert main(sft_args(tiny_model_dir, out, chats, "--max_steps", 1, *lora)) == 0
    capsys.readouterr()
    assert main(sft_args(copy, out, chats, "--max_steps", 2, *lora, "--checkpoint.resume", "auto")) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"error: {out / 'checkpoints' / 'step-00000001'}: model.path cannot change on resume of "
                           "this sft job (the checkpoint holds LoRA adapters only: the base weights under them are "
                           f"loaded from it): the run used {tiny_model_dir}, this job says {copy}; "), line

def test_an_older_runs_spelled_out_default_reward_is_no_change(tmp_path):
    """reward.name became null when unset (an explicit math_exact_match beside an environment's get_reward is then
    kept): a checkpoint written before, whose config.yaml spells the default out, resumed by a job that leaves it
    unset lists no reward change; another built-in is still listed."""
    from astrai.config import config_from_dict, config_to_dict, dump_config, load_config
    from astrai.trainer.resume_changes import config_changes

    config = load_config(None)
    saved = config_from_dict(dict(config_to_dict(config), reward={"name": "math_exact_match"}))
    (tmp_path / "config.yaml").write_text(dump_config(saved))
    assert "name: math_exact_match" in (tmp_path / "config.yaml").read_text()
    assert config_changes(tmp_path, load_config(None)) == []
    assert config_changes(tmp_path, load_config(None, ["--reward.name", "math_exact_match"])) == []
    (change,) = config_changes(tmp_path, load_config(None, ["--reward.name", "code_unit_tests"]))
    assert (change.key, change.old, change.new) == ("reward.name", "math_exact_match", "code_unit_tests")
    (tmp_path / "config.yaml").write_text(dump_config(load_config(None)))
    assert config_changes(tmp_path, load_config(None)) == []


def test_a_checkpoint_that_fails_its_sha256_names_the_ways_on(tiny_model_dir, chats, tmp_path, capsys):
    """A byte changed in place in the newest checkpoint (same size: only the sha256 tells) stopped resume auto with
    no way on (trial, helper-57): the line names mark-bad and a resume path, as the all-damaged refusal does."""
    out = tmp_path / "run"
    assert main(sft_args(tiny_model_dir, out, chats, "--max_steps", 1)) == 0
    ckpt = out / "checkpoints" / "step-00000001"
    with open(ckpt / "optimizer.pt", "r+b") as f:
        f.seek(-10, 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    capsys.readouterr()
    assert main(sft_args(tiny_model_dir, out, chats, "--max_steps", 2, "--checkpoint.resume", "auto")) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"error: {ckpt}: checkpoint failed verification: optimizer.pt: MISMATCH (sha256")
    assert line.endswith(f"`python -m astrai.checkpoint mark-bad {ckpt} --reason TEXT` makes --checkpoint.resume auto "
                         "take the one before it, --checkpoint.resume DIR names another")
