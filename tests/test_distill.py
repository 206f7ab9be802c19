"""On-policy distillation from a local teacher (`distill.teacher`; Lu and Thinking Machines Lab 2025, "On-Policy
Distillation"): the teacher scores the student's sampled tokens in the reference model's place and the per-token
advantage is `teacher_logprobs - old_logprobs` (`grpo.advantage_estimator: on_policy_distill`; online_ppo: the
per-token reward). Tiny models: the student is tests/conftest.py's (seed 0), the teacher another seed with the same
tokenizer. The estimator's hand values and naive loop are in tests/test_algos_estimators.py."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from test_grpo import make_experience

from astrai.config import ConfigError, config_from_dict, ignored_settings
from astrai.models import AutoRegressiveLM, Tokenizer, hf_state_dict, tiny_config, tiny_tokenizer
from astrai.models.tokenizer import tiny_gguf_fields
from astrai.train import main
from astrai.trainer.learners.online_grpo import group_rollout
from astrai.trainer.models import vocabulary_mismatch

REPO = Path(__file__).resolve().parents[1]
GRPO = REPO / "configs/examples/grpo.yaml"
PPO = REPO / "configs/examples/ppo.yaml"


def save_tiny(path: Path, *, seed: int, tokenizer: Tokenizer | None = None, **config) -> Path:
    """A tiny random Llama of `seed` (tests/single_turn_reference.py's `tiny_model` with another seed and the
    `tiny_config` overrides `config`) with `tokenizer` (default: the tiny one, the student's)."""
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = AutoRegressiveLM(tiny_config(**config))
    save_file({k: v.contiguous() for k, v in hf_state_dict(model).items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(model.config.to_hf_dict()))
    (tokenizer or tiny_tokenizer()).save(path)
    return path


def swapped_tokenizer() -> Tokenizer:
    """The tiny tokenizer with the ids of two byte tokens swapped: same size, another token -> id map."""
    fields = tiny_gguf_fields()
    tokens = list(fields["tokenizer.ggml.tokens"])
    tokens[3], tokens[4] = tokens[4], tokens[3]
    return Tokenizer.from_gguf_fields({**fields, "tokenizer.ggml.tokens": tokens})


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("teacher"), seed=1)


SMALL = ("--train.progress_bar", "false", "--train.report_to", "none", "--rollout.batch_size", "2",
         "--rollout.max_new_tokens", "6", "--data.truncation", "left", "--max_steps", "2")


def grpo_args(student, teacher, out, *extra) -> list[str]:
    return ["--config", str(GRPO), "--model.path", str(student), "--train.output_dir", str(out), *SMALL,
            "--grpo.group_size", "2", "--grpo.minibatch_size", "4", "--grpo.micro_batch_size", "2",
            "--grpo.kl_coef", "0", "--grpo.advantage_estimator", "on_policy_distill", "--distill.teacher", str(teacher),
            "--optim.learning_rate", "1e-3", *extra]


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def all_finite(record: dict) -> bool:
    return all(math.isfinite(v) for v in record.values() if isinstance(v, float))


# ------------------------------------------------------------------------------------------- the rollout's targets


def test_group_rollout_takes_the_teachers_logprobs_from_the_reference_slot():
    exp = make_experience([1.0, 0.0, 0.0, 2.0], lengths=[3, 1, 2, 3])
    mask = exp.sequences.action_mask
    pure = group_rollout(exp, group_size=2, estimator="on_policy_distill")
    torch.testing.assert_close(pure.advantages, (exp.ref_logprobs - exp.old_logprobs) * mask)
    assert pure.kl is None and torch.equal(pure.ref_logprobs, exp.ref_logprobs * mask)
    mixed = group_rollout(exp, group_size=2, estimator="on_policy_distill", reward_weight=0.5, std_eps=0.0)
    grpo = group_rollout(exp, group_size=2, std_eps=0.0).advantages
    torch.testing.assert_close(mixed.advantages, pure.advantages + 0.5 * grpo)
    with pytest.raises(ValueError, match="on_policy_distill needs the teacher's log-probs"):
        group_rollout(make_experience([1.0, 0.0], ref=False), group_size=2, estimator="on_policy_distill")


# ------------------------------------------------------------------------------------------------ config rules


@pytest.mark.parametrize("settings, message", [
    ({"grpo": {"advantage_estimator": "on_policy_distill", "kl_coef": 0}},
     "grpo.advantage_estimator: on_policy_distill scores the samples with a teacher's log-probs; name the teacher"),
    ({"distill": {"teacher": "t"}, "grpo": {"kl_coef": 0}},
     "distill.teacher: set, but grpo.advantage_estimator grpo does not read a teacher; set "
     "grpo.advantage_estimator to on_policy_distill"),
    ({"distill": {"teacher": "t"}, "grpo": {"advantage_estimator": "on_policy_distill"}},
     "grpo.kl_coef: a reference-KL term is set together with distill.teacher; the teacher replaces the reference"),
    ({"distill": {"teacher": "t"}, "grpo": {"advantage_estimator": "on_policy_distill", "kl_coef": 0,
                                            "kl_reward_coef": 0.1}},
     "grpo.kl_reward_coef: a reference-KL term is set together with distill.teacher"),
    ({"train": {"type": "online_ppo"}, "distill": {"teacher": "t"}},
     "ppo.kl_coef: a reference-KL term is set together with distill.teacher"),
    ({"distill": {"teacher": "t"}, "grpo": {"advantage_estimator": "on_policy_distill", "kl_coef": 0},
      "rollout": {"dynamic_sampling": True}},
     "rollout.dynamic_sampling: drops groups whose rewards are all equal as carrying no signal, but with "
     "distill.teacher"),
    ({"train": {"type": "sft"}, "distill": {"teacher": "t"}},
     "distill.teacher: on-policy distillation scores the tokens sampled by online_ppo and online_grpo; train.type "
     "sft samples none"),
    ({"train": {"type": "grpo"}, "distill": {"teacher": "t"},
      "grpo": {"advantage_estimator": "on_policy_distill", "kl_coef": 0}},
     "distill.teacher: on-policy distillation scores the tokens sampled by online_ppo and online_grpo; train.type "
     "grpo samples none"),
    ({"distill": {"teacher": "http://127.0.0.1:8000/v1"}, "rollout": {"temperature": 0.7},
      "grpo": {"advantage_estimator": "on_policy_distill", "kl_coef": 0}},
     "distill.teacher: a served teacher returns log-probs of its raw distribution (as vLLM echoes prompt log-probs), "
     "which match the student's only at rollout.temperature 1, got 0.7"),
])
def test_config_refuses_a_teacher_without_its_estimator_and_with_a_reference_kl(settings, message):
    with pytest.raises(ConfigError) as info:
        config_from_dict({"train": {"type": "online_grpo"}, **settings} if "train" not in settings else settings)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)
    ok = config_from_dict({"train": {"type": "online_grpo"}, "distill": {"teacher": "t", "reward_weight": 0.3},
                           "grpo": {"advantage_estimator": "on_policy_distill", "kl_coef": 0}})
    assert ok.distill.teacher == "t" and ok.distill.reward_weight == 0.3 and not ok.distill.served
    assert config_from_dict({"train": {"type": "online_ppo"}, "distill": {"teacher": "t"},
                             "ppo": {"kl_coef": 0}}).distill.teacher == "t"
    assert ignored_settings(ok) == []
    assert ignored_settings(config_from_dict({"distill": {"reward_weight": 0.3}})) == ["distill.reward_weight"]


def test_vocabulary_mismatch_names_the_size_or_the_first_token_that_differs():
    tiny = tiny_tokenizer()
    assert vocabulary_mismatch(tiny, tiny_tokenizer()) is None
    swapped = vocabulary_mismatch(tiny, swapped_tokenizer())
    assert swapped.startswith("token ") and " is id 3 for the student, 4 for the teacher" in swapped
    fields = tiny_gguf_fields()
    smaller = Tokenizer.from_gguf_fields({**fields, "tokenizer.ggml.tokens": fields["tokenizer.ggml.tokens"][:-1],
                                          "tokenizer.ggml.merges": fields["tokenizer.ggml.merges"][:-1],
                                          "tokenizer.ggml.token_type": fields["tokenizer.ggml.token_type"][:-1]})
    assert vocabulary_mismatch(tiny, smaller) == f"its tokenizer has {tiny.vocab_size - 1} tokens, the student's " \
                                                 f"{tiny.vocab_size}"


def test_a_teacher_with_another_tokenizer_is_refused_in_one_line_by_check_and_at_start(tiny_model_dir, tmp_path,
                                                                                        capsys):
    other = save_tiny(tmp_path / "other", seed=1, tokenizer=swapped_tokenizer())
    for extra in (["--check"], []):
        code = main(grpo_args(tiny_model_dir, other, tmp_path / f"run{len(extra)}", *extra))
        err = capsys.readouterr().err.strip().splitlines()
        err = [line for line in err if not line.startswith("warning:")]
        assert code == 2 and len(err) == 1, err
        assert err[0].startswith(f"error: distill.teacher: {other} does not share the student's tokenizer"), err
        assert "cross-tokenizer distillation is not supported" in err[0]
    assert not (tmp_path / "run0" / "metrics.jsonl").exists()


def one_error_line(capsys) -> str:
    """The one line of stderr (warnings aside) a refused job printed."""
    err = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("warning:")]
    assert len(err) == 1, err
    return err[0]


def test_a_teacher_with_too_short_a_context_is_refused_by_check_and_at_start(teacher_dir, tmp_path, capsys):
    """The student holds 512 positions, the teacher 256: 300 prompt + 64 response tokens are more than the teacher
    can score, refused in one line naming distill.teacher (not scored silently past its rotary table)."""
    student = save_tiny(tmp_path / "student", seed=0, max_position_embeddings=512)
    long = ("--data.max_prompt_length", "300", "--rollout.max_new_tokens", "64")
    for extra in (["--check"], []):
        assert main(grpo_args(student, teacher_dir, tmp_path / f"run{len(extra)}", *long, *extra)) == 2
        assert one_error_line(capsys) == (
            f"error: distill.teacher: {teacher_dir} has max_position_embeddings=256, fewer than the 364 tokens it must "
            "score (data.max_prompt_length 300 + rollout.max_new_tokens 64); use a teacher with a longer context or "
            "lower them")
    assert not (tmp_path / "run0" / "metrics.jsonl").exists()
    assert main(grpo_args(student, teacher_dir, tmp_path / "fits", "--data.max_prompt_length", "200", "--check")) == 0


@pytest.mark.parametrize("teacher, start", [
    ("/nonexistent/teacher", "error: distill.teacher: model path /nonexistent/teacher does not exist: expected "),
    ("ftp://host/teacher", "error: distill.teacher: ftp://host/teacher is a URL of scheme ftp; a served teacher is "
                           "an http:// or https:// URL (the API root, e.g. http://host:8000/v1)"),
])
def test_a_teacher_that_cannot_load_is_named_as_distill_teacher(tiny_model_dir, tmp_path, capsys, teacher, start):
    for extra in (["--check"], []):
        assert main(grpo_args(tiny_model_dir, teacher, tmp_path / f"run{len(extra)}", *extra)) == 2
        line = one_error_line(capsys)
        assert line.startswith(start), line
        assert "ftp:/host" not in line  # the URL is not read as a path


# -------------------------------------------------------------------------------------------------- end to end


def test_online_grpo_distills_two_steps_from_another_teacher(tiny_model_dir, teacher_dir, tmp_path, capsys):
    assert main(grpo_args(tiny_model_dir, teacher_dir, tmp_path / "check", "--check")) == 0
    assert "check passed" in capsys.readouterr().out
    out = tmp_path / "run"
    assert main(grpo_args(tiny_model_dir, teacher_dir, out, "--distill.reward_weight", "0.5")) == 0
    first, second = records(out)
    assert all_finite(first) and all_finite(second)
    assert "rollout/kl" not in first and first["policy_version"] == 1 and second["policy_version"] == 2
    # two random models disagree (the k1 estimate over a few tokens has either sign)
    assert abs(first["distill/reverse_kl"]) > 1e-3 and math.isfinite(second["distill/reverse_kl"])
    assert first["rollout/advantage_abs_mean"] > 0  # the per-token signal, though every task reward is 0
    # the loss is the signal: before the first update the ratio is 1 and the group term 0 (equal rewards), so the
    # token-mean PPO loss -mean(A) over the whole rollout (one minibatch) is mean(old - teacher)
    assert first["policy/loss"] == pytest.approx(first["distill/reverse_kl"], abs=1e-5)


def test_a_teacher_equal_to_the_student_has_zero_reverse_kl_at_step_1(tiny_model_dir, tmp_path):
    """Exactness: the teacher's log-probs (scored like the reference's, at the sampling temperature) of the
    student's own samples equal the sampler's, so at step 1 (before any update) the reverse KL is ~0; the second
    rollout is sampled by the updated student, which has moved away from the teacher."""
    out = tmp_path / "run"
    assert main(grpo_args(tiny_model_dir, tiny_model_dir, out, "--rollout.temperature", "0.7",
                          "--optim.learning_rate", "1e-2")) == 0
    first, second = records(out)
    assert abs(first["distill/reverse_kl"]) < 1e-5, first["distill/reverse_kl"]
    assert first["rollout/advantage_abs_mean"] < 1e-5
    assert abs(second["distill/reverse_kl"]) > 10 * abs(first["distill/reverse_kl"])


def test_lora_student_with_a_full_teacher_trains(tiny_model_dir, teacher_dir, tmp_path):
    """Under LoRA the reference would be the student's own base: the teacher is loaded as its own full model."""
    out = tmp_path / "run"
    assert main(grpo_args(tiny_model_dir, teacher_dir, out, "--model.lora", "{r: 4, alpha: 8}",
                          "--optim.learning_rate", "1e-2")) == 0
    first, second = records(out)
    assert all_finite(first) and all_finite(second) and abs(first["distill/reverse_kl"]) > 1e-3
    saved = out / "checkpoints" / "step-00000002"
    assert (saved / "adapter_model.safetensors").is_file() and not (saved / "model.safetensors").exists()


def test_online_ppo_distills_with_the_teachers_gap_as_the_token_reward(tiny_model_dir, teacher_dir, tmp_path):
    out = tmp_path / "run"
    assert main(["--config", str(PPO), "--model.path", str(tiny_model_dir), "--train.output_dir", str(out), *SMALL,
                 "--ppo.minibatch_size", "2", "--ppo.micro_batch_size", "1", "--ppo.kl_coef", "0",
                 "--distill.teacher", str(teacher_dir)]) == 0
    first, second = records(out)
    assert all_finite(first) and all_finite(second)
    assert abs(first["distill/reverse_kl"]) > 1e-3 and "rollout/kl" not in first
    # every score is 0 (math answers from a random model) and reward_weight is 0: the returns are the gaps alone
    assert first["rollout/reward_mean"] == 0 and first["rollout/returns_mean"] != 0


def test_two_rank_fsdp2_online_grpo_distills(tiny_model_dir, teacher_dir, tmp_path):
    """2 ranks (torchrun, gloo, fsdp2): the teacher is partitioned like a reference model and every rank scores
    its own samples with it."""
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
           "-m", "astrai.train", *grpo_args(tiny_model_dir, teacher_dir, out, "--distributed.strategy", "fsdp2",
                                            "--max_steps", "1")]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    (record,) = records(out)
    assert all_finite(record) and abs(record["distill/reverse_kl"]) > 1e-3
