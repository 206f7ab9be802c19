"""Top-k logit distillation from a local teacher (`distill.jsd_top_k`; GKD's generalised JSD, Agarwal et al. 2024): the
per-position JSD(beta) over the teacher's top-k tokens, both distributions renormalised over them
(`astrai.algos.topk_distill`), against a naive per-position loop; the teacher's top-k and the student's log-probs at
those ids from the tiny model (`astrai.forward`) against full logits; refusals; online_grpo and online_ppo end to
end with `distill/jsd`."""

import math
import os
import socket
import subprocess
import sys

import pytest
import torch
from test_distill import PPO, REPO, SMALL, all_finite, grpo_args, records, teacher_dir  # noqa: F401 (fixture)
from test_grpo import make_experience

from astrai.algos import logprobs_at_ids, topk_jsd, topk_logprobs_from_logits
from astrai.config import ConfigError, config_from_dict, ignored_settings
from astrai.data.sequences import Sequences
from astrai.forward import response_logprobs, response_logprobs_at, response_topk
from astrai.models import AutoRegressiveLM, tiny_config
from astrai.train import main


def naive_topk_jsd(student: list[float], teacher: list[float], k: int, beta: float) -> float:
    """One position, plain Python: the teacher's k largest logits (ties by lower id), both softmaxes renormalised
    over those ids, then GKD's JSD(beta) (beta 0: KL(P || Q); beta 1: KL(Q || P))."""
    ids = sorted(range(len(teacher)), key=lambda i: (-teacher[i], i))[:k]
    zp = sum(math.exp(teacher[i]) for i in ids)
    zq = sum(math.exp(student[i]) for i in ids)
    p = [math.exp(teacher[i]) / zp for i in ids]
    q = [math.exp(student[i]) / zq for i in ids]
    if beta == 0:
        return sum(pi * math.log(pi / qi) for pi, qi in zip(p, q))
    if beta == 1:
        return sum(qi * math.log(qi / pi) for pi, qi in zip(p, q))
    m = [beta * pi + (1 - beta) * qi for pi, qi in zip(p, q)]
    return (beta * sum(pi * math.log(pi / mi) for pi, mi in zip(p, m))
            + (1 - beta) * sum(qi * math.log(qi / mi) for qi, mi in zip(q, m)))


def hand_logits() -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher and student logits (2, 3, 6) with distinct teacher values (an unambiguous top-k)."""
    teacher = torch.tensor([[[2.0, 0.5, -1.0, 1.5, 0.0, -2.0], [0.1, 0.2, 0.3, 3.0, -0.5, 1.0],
                             [-1.0, -0.2, 2.5, 0.7, 1.1, 0.4]],
                            [[0.0, 4.0, 1.0, -3.0, 2.0, 0.5], [1.2, -1.3, 0.8, 0.6, 2.2, -0.1],
                             [3.3, 1.7, -0.4, 0.9, -2.1, 0.2]]])
    student = torch.tensor([[[0.3, 1.0, 0.2, -0.5, 0.9, 0.0], [1.5, -0.7, 0.4, 0.2, 0.1, 0.6],
                             [0.0, 0.8, -1.2, 1.9, 0.3, -0.3]],
                            [[1.1, 0.1, 2.0, 0.4, -0.6, 0.7], [-0.2, 0.5, 1.4, -1.0, 0.3, 2.1],
                             [0.6, 0.6, 0.0, -0.8, 1.3, -1.5]]])
    return teacher, student


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("k", [1, 3, 6])
def test_topk_jsd_equals_a_naive_per_position_loop(beta, k):
    teacher, student = hand_logits()
    ids, teacher_lp = topk_logprobs_from_logits(teacher, k=k, chunk_rows=2)
    student_lp = logprobs_at_ids(student, ids, chunk_rows=4)
    got = topk_jsd(student_lp, teacher_lp, beta=beta)
    assert got.shape == (2, 3) and got.dtype == torch.float32
    for b in range(2):
        for t in range(3):
            want = naive_topk_jsd(student[b, t].tolist(), teacher[b, t].tolist(), k, beta)
            assert got[b, t].item() == pytest.approx(want, abs=1e-6), (b, t)
    if k == 1:  # one token: both renormalised distributions are the same point mass
        assert got.abs().max() < 1e-6


def test_topk_jsd_ends_are_the_kl_limits_and_k_equal_v_is_the_full_vocabulary():
    teacher, student = hand_logits()
    ids, teacher_lp = topk_logprobs_from_logits(teacher, k=4)
    student_lp = logprobs_at_ids(student, ids)
    forward, reverse = topk_jsd(student_lp, teacher_lp, beta=0.0), topk_jsd(student_lp, teacher_lp, beta=1.0)
    eps = 1e-4  # JSD(beta) / beta -> KL(P || Q) as beta -> 0, JSD / (1 - beta) -> KL(Q || P) as beta -> 1
    torch.testing.assert_close(topk_jsd(student_lp, teacher_lp, beta=eps) / eps, forward, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(topk_jsd(student_lp, teacher_lp, beta=1 - eps) / eps, reverse, atol=1e-3, rtol=1e-3)
    assert bool((forward > 0).all()) and bool((reverse > 0).all())
    # k = V: no renormalisation left, the full-vocabulary divergences
    ids, teacher_lp = topk_logprobs_from_logits(teacher, k=6)
    p, q = torch.log_softmax(teacher, -1), torch.log_softmax(student, -1)
    full = topk_jsd(logprobs_at_ids(student, ids), teacher_lp, beta=0.0)
    torch.testing.assert_close(full, (p.exp() * (p - q)).sum(-1))


def test_topk_is_chunk_independent_and_renormalisation_drops_the_rest_of_the_vocabulary():
    teacher, student = hand_logits()
    ids, values = topk_logprobs_from_logits(teacher, k=3, temperature=0.7, chunk_rows=1)
    full = torch.log_softmax(teacher / 0.7, -1).topk(3, -1)
    assert torch.equal(ids, full.indices)
    torch.testing.assert_close(values, full.values)
    # the student's logits outside the teacher's top-k change nothing: each renormalised distribution lives on the k ids
    moved = student + (torch.randn(student.shape, generator=torch.Generator().manual_seed(0)) * 3).scatter(-1, ids, 0.0)
    a = topk_jsd(logprobs_at_ids(student, ids, temperature=0.7), values, beta=0.5)
    b = topk_jsd(logprobs_at_ids(moved, ids, temperature=0.7), values, beta=0.5)
    assert not torch.equal(moved, student)
    torch.testing.assert_close(a, b)


def test_gradient_flows_to_the_student_only():
    teacher, student = hand_logits()
    teacher, student = teacher.clone().requires_grad_(True), student.clone().requires_grad_(True)
    ids, teacher_lp = topk_logprobs_from_logits(teacher, k=3)
    assert teacher_lp.requires_grad  # the top-k values would carry grad: topk_jsd detaches them
    loss = topk_jsd(logprobs_at_ids(student, ids), teacher_lp, beta=0.5).sum()
    loss.backward()
    assert teacher.grad is None
    on_topk = torch.zeros_like(student, dtype=torch.bool).scatter_(-1, ids, True)
    assert student.grad[on_topk].abs().min() > 0  # hand values: every top-k logit gets a gradient
    # renormalised over the k ids, the full normaliser cancels: the rest has none (up to float32 rounding)
    assert student.grad[~on_topk].abs().max() < 1e-6 * student.grad[on_topk].abs().max()


def test_refusals_of_topk_jsd_and_its_inputs():
    teacher, student = hand_logits()
    with pytest.raises(ValueError, match="beta must be in"):
        topk_jsd(student, teacher, beta=1.5)
    with pytest.raises(ValueError, match="k must be in"):
        topk_logprobs_from_logits(teacher, k=7)
    with pytest.raises(ValueError, match="must agree"):
        logprobs_at_ids(student, torch.zeros(2, 2, 3, dtype=torch.long))


# ------------------------------------------------------------------------------------- from the tiny model


def tiny_batch() -> tuple[AutoRegressiveLM, Sequences]:
    """The tiny model (seed 3) and 4 rows with responses of 3, 1, 2, 3 tokens; row 1's prompt left-padded."""
    torch.manual_seed(3)
    model = AutoRegressiveLM(tiny_config()).eval()
    seq = make_experience([0.0] * 4, lengths=[3, 1, 2, 3]).sequences
    attention = seq.attention_mask.clone()
    attention[1, 0] = False
    seq = Sequences(input_ids=seq.input_ids, attention_mask=attention,
                    position_ids=(attention.long().cumsum(1) - 1).clamp(min=0), prompt_length=seq.prompt_length,
                    action_mask=seq.action_mask)
    return model, seq


def full_response_logits(model, seq: Sequences, temperature: float) -> torch.Tensor:
    """(B, T, V) log-softmax at the positions that score each response token, from one padded forward."""
    logits = model(seq.input_ids, attention_mask=seq.attention_mask, position_ids=seq.position_ids)
    p, t = seq.prompt_length, seq.action_mask.shape[1]
    return torch.log_softmax(logits[:, p - 1:p - 1 + t].float() / temperature, -1)


def test_the_teachers_topk_and_the_students_logprobs_at_them_match_full_logits():
    model, seq = tiny_batch()
    mask = seq.action_mask
    with torch.no_grad():
        full = full_response_logits(model, seq, 0.8)
    top = full.topk(5, -1)
    for chunk in (1, 3):
        ids, values = response_topk(model, seq, k=5, temperature=0.8, chunk_size=chunk)
        assert ids.shape == (4, 3, 5) and ids.dtype == torch.long
        assert torch.equal(ids[mask], top.indices[mask]) and bool((ids[~mask] == 0).all())
        torch.testing.assert_close(values[mask], top.values[mask], atol=1e-5, rtol=1e-5)
        assert bool((values[~mask] == 0).all())
    ids, _ = response_topk(model, seq, k=5, temperature=0.8, chunk_size=2)
    for packed in (True, False):
        logprobs, entropy, at = response_logprobs_at(model, seq, ids, temperature=0.8, with_entropy=packed,
                                                     packed=packed)
        torch.testing.assert_close(at[mask], full.gather(-1, ids)[mask], atol=1e-5, rtol=1e-5)
        assert bool((at[~mask] == 0).all()) and at.requires_grad
        plain, _ = response_logprobs(model, seq, temperature=0.8, packed=packed)
        torch.testing.assert_close(logprobs * mask, plain * mask)
        assert (entropy is not None) == packed
    with pytest.raises(ValueError, match="ids must be"):
        response_logprobs_at(model, seq, ids[:, :2], temperature=0.8)


def test_coef_zero_logs_the_jsd_but_adds_nothing_and_the_metric_is_never_negative():
    """`distill.jsd_coef` 0: the term is computed and logged, the loss it adds is 0. A teacher equal to the student
    gives per-token JSDs that round around 0; the metric counts each at >= 0, so it is never below 0."""
    from astrai.trainer.learners.topk_distill import TopKDistillation

    model, seq = tiny_batch()
    units = seq.action_mask.sum()
    other = AutoRegressiveLM(tiny_config())
    zero = TopKDistillation(other, top_k=5, beta=0.5, coef=0.0, temperature=0.8, chunk_size=2)
    _, _, loss, metrics = zero(model, seq, units)
    assert float(loss) == 0.0 and float(metrics["distill/jsd"]) > 1e-4  # two random models disagree
    same = TopKDistillation(model, top_k=5, beta=0.5, coef=1.0, temperature=0.8, chunk_size=3)
    _, _, loss, metrics = same(model, seq, units)
    assert abs(float(loss)) < 1e-6 and 0.0 <= float(metrics["distill/jsd"]) < 1e-6


# ------------------------------------------------------------------------------------------------- config


BASE = {"train": {"type": "online_grpo"}, "grpo": {"advantage_estimator": "on_policy_distill", "kl_coef": 0}}


@pytest.mark.parametrize("distill, message", [
    ({"teacher": "t", "jsd_top_k": -1}, "distill.jsd_top_k: "),
    ({"teacher": "t", "jsd_top_k": 4, "jsd_beta": 1.5}, "distill.jsd_beta: "),
    ({"teacher": "t", "jsd_top_k": 4, "jsd_beta": -0.1}, "distill.jsd_beta: "),
    ({"teacher": "t", "jsd_top_k": 4, "jsd_coef": -1}, "distill.jsd_coef: "),
    ({"teacher": "http://127.0.0.1:8000/v1", "jsd_top_k": 4},
     "distill.jsd_top_k: a served distill.teacher returns only the sampled tokens' log-probs, not its top-k logits"),
    ({"jsd_top_k": 4}, "distill.jsd_top_k: top-k logit distillation reads a local teacher's logits; name it in "
     "distill.teacher (or several in distill.teachers), or set distill.jsd_top_k to 0"),
    ({"teachers": {"a": "t", "b": "https://host/v1"}, "route_field": "topic", "jsd_top_k": 4},
     "distill.jsd_top_k: distill.teachers.b is a served teacher (https://host/v1), which returns only the sampled "
     "tokens' log-probs, not its top-k logits"),
])
def test_config_refuses_bad_topk_settings_in_one_line(distill, message):
    with pytest.raises(ConfigError) as info:
        config_from_dict({**BASE, "distill": distill})
    assert str(info.value).startswith(message) and "\n" not in str(info.value), str(info.value)


def test_config_takes_topk_and_names_unread_beta():
    ok = config_from_dict({**BASE, "distill": {"teacher": "t", "jsd_top_k": 8, "jsd_beta": 0.0, "jsd_coef": 0.5}})
    assert (ok.distill.jsd_top_k, ok.distill.jsd_beta, ok.distill.jsd_coef) == (8, 0.0, 0.5)
    assert ignored_settings(ok) == []
    with pytest.raises(ConfigError, match="^distill.jsd_top_k: top-k logit distillation reads a local teacher"):
        config_from_dict({"distill": {"jsd_top_k": 4}})
    routed = config_from_dict({**BASE, "distill": {"teachers": {"a": "t", "b": "u"}, "route_field": "topic",
                                                   "jsd_top_k": 4}})  # several local teachers: each row its own
    assert routed.distill.jsd_top_k == 4 and ignored_settings(routed) == []
    unread = config_from_dict({**BASE, "distill": {"teacher": "t", "jsd_beta": 0.2, "jsd_coef": 2.0}})
    assert ignored_settings(unread) == ["distill.jsd_beta", "distill.jsd_coef"]


# -------------------------------------------------------------------------------------------------- end to end


def test_online_grpo_with_topk_distills_two_steps_and_logs_the_jsd(tiny_model_dir, teacher_dir, tmp_path):
    out = tmp_path / "run"
    assert main(grpo_args(tiny_model_dir, teacher_dir, out, "--distill.jsd_top_k", "4", "--distill.jsd_beta", "0.5",
                          "--distill.jsd_coef", "0.5")) == 0
    first, second = records(out)
    assert all_finite(first) and all_finite(second)
    assert first["distill/jsd"] > 1e-4 and second["distill/jsd"] > 0  # two random models disagree
    # before the first update the ratio is 1 and the rewards all 0: the token-mean PPO loss over the one minibatch
    # is mean(old - teacher) (tests/test_distill.py), and the JSD term adds jsd_coef times its token mean
    assert first["policy/loss"] == pytest.approx(first["distill/reverse_kl"] + 0.5 * first["distill/jsd"], abs=1e-5)


def test_a_teacher_equal_to_the_student_has_zero_jsd_at_step_1(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    assert main(grpo_args(tiny_model_dir, tiny_model_dir, out, "--distill.jsd_top_k", "8", "--distill.jsd_beta", "0",
                          "--rollout.temperature", "0.7", "--optim.learning_rate", "1e-2")) == 0
    first, second = records(out)
    assert 0.0 <= first["distill/jsd"] < 1e-6 and second["distill/jsd"] > 1e-6


def test_online_ppo_with_topk_logs_the_jsd(tiny_model_dir, teacher_dir, tmp_path):
    out = tmp_path / "run"
    assert main(["--config", str(PPO), "--model.path", str(tiny_model_dir), "--train.output_dir", str(out), *SMALL,
                 "--ppo.minibatch_size", "2", "--ppo.micro_batch_size", "1", "--ppo.kl_coef", "0",
                 "--distill.teacher", str(teacher_dir), "--distill.jsd_top_k", "3", "--distill.jsd_beta", "1"]) == 0
    first, second = records(out)
    assert all_finite(first) and all_finite(second) and first["distill/jsd"] > 1e-4


def test_a_topk_above_the_teachers_vocabulary_is_refused_by_check_and_at_start(tiny_model_dir, teacher_dir,
                                                                                 tmp_path, capsys):
    vocab = tiny_config().vocab_size
    for extra in (["--check"], []):
        assert main(grpo_args(tiny_model_dir, teacher_dir, tmp_path / f"run{len(extra)}", "--distill.jsd_top_k",
                              str(vocab + 1), *extra)) == 2
        err = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("warning:")]
        assert err == [f"error: distill.jsd_top_k: {vocab + 1} is more than the teacher's {vocab} tokens; set it <= "
                       f"{vocab}"], err


def test_lora_student_with_topk_trains(tiny_model_dir, teacher_dir, tmp_path):
    """Under LoRA the student's forward runs its adapters; the teacher is its own full model."""
    out = tmp_path / "run"
    assert main(grpo_args(tiny_model_dir, teacher_dir, out, "--model.lora", "{r: 4, alpha: 8}", "--distill.jsd_top_k",
                          "4", "--optim.learning_rate", "1e-2")) == 0
    first, second = records(out)
    assert all_finite(first) and all_finite(second) and first["distill/jsd"] > 1e-4
    assert first["policy/grad_norm"] > 0


def test_two_rank_fsdp2_online_grpo_with_topk(tiny_model_dir, teacher_dir, tmp_path):
    """2 ranks (torchrun, gloo, fsdp2): the teacher is partitioned like a reference model and runs one forward per
    micro-batch on every rank (the same count on each)."""
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
           "-m", "astrai.train", *grpo_args(tiny_model_dir, teacher_dir, out, "--distributed.strategy", "fsdp2",
                                            "--max_steps", "1", "--distill.jsd_top_k", "4")]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    (record,) = records(out)
    assert all_finite(record) and record["distill/jsd"] > 1e-4
