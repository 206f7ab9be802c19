"""Top-k logit distillation (`distill.jsd_top_k`) with several local teachers routed by a data column
(`distill.teachers` with `distill.route_field`): each micro-batch row of the policy update takes its top-k from its
own route's teacher (the routes travel with the rollout, `RolloutResult.routes`); partitioned teachers run the same
number of forwards on every rank; `distill/<route>/jsd` per route. Against naive per-row loops on the tiny models
and end to end (tests/test_distill_routing.py's fixtures and data)."""

import dataclasses
import math
import os
import socket
import subprocess
import sys

import pytest
import torch
from test_distill import all_finite, records
from test_distill_routing import PPO, REPO, Forwards, routed_args, tiny_teacher, write_data
from test_distill_routing import teachers  # noqa: F401 (fixture)
from test_distill_topk import naive_topk_jsd, tiny_batch
from test_grpo import make_experience

from astrai.config import ConfigError, config_from_dict
from astrai.experience.result import RolloutResult
from astrai.experience.teachers import TeacherRoutes
from astrai.forward import response_topk
from astrai.train import main
from astrai.trainer.learners.online_grpo import group_rollout
from astrai.trainer.learners.topk_distill import TopKDistillation, check_top_k

ROUTES = ("a", "b", "b", "a")  # tiny_batch's 4 rows (responses of 3, 1, 2, 3 tokens)


def full_scaled_logprobs(model, seq, temperature: float) -> torch.Tensor:
    """(B, T, V) log-softmax(logits / temperature) at the positions scoring each response token (one padded
    forward, no grad)."""
    with torch.no_grad():
        logits = model(seq.input_ids, attention_mask=seq.attention_mask, position_ids=seq.position_ids)
    p, t = seq.prompt_length, seq.action_mask.shape[1]
    return torch.log_softmax(logits[:, p - 1:p - 1 + t].float() / temperature, -1)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_routed_topk_equals_a_naive_per_row_loop_with_each_rows_teacher(beta):
    """Rows routed a, b, b, a: the teachers' top-k ids and log-probs, the loss term (token mean) and the per-route
    JSD means equal a loop over the rows that scores each one alone with the teacher of its route and takes the JSD
    position by position in plain Python; a row's top-k is not the other teacher's."""
    student, seq = tiny_batch()
    teachers = {"a": tiny_teacher(1), "b": tiny_teacher(2)}
    mask = seq.action_mask
    topk = TopKDistillation(TeacherRoutes(teachers, route_field="topic"), top_k=4, beta=beta, coef=1.0,
                            temperature=0.8, chunk_size=3)
    assert topk.routes == ("a", "b")
    ids, values = topk.teacher_topk(seq, ROUTES)
    for row, route in enumerate(ROUTES):
        own_ids, own_values = response_topk(teachers[route], seq.select(torch.tensor([row])), k=4, temperature=0.8,
                                            chunk_size=1)
        assert torch.equal(ids[row][mask[row]], own_ids[0][mask[row]]), row
        torch.testing.assert_close(values[row][mask[row]], own_values[0][mask[row]], rtol=0, atol=1e-5)
        other = "b" if route == "a" else "a"
        other_ids, _ = response_topk(teachers[other], seq.select(torch.tensor([row])), k=4, temperature=0.8,
                                     chunk_size=1)
        assert not torch.equal(ids[row][mask[row]], other_ids[0][mask[row]]), row
    topk.reset_route_metrics()
    units = mask.sum()
    _, _, loss, metrics = topk(student, seq, units, routes=ROUTES)
    q = full_scaled_logprobs(student, seq, 0.8)
    per_route = {"a": [], "b": []}
    for row, route in enumerate(ROUTES):  # naive: each row with its own teacher, position by position
        p = full_scaled_logprobs(teachers[route], seq.select(torch.tensor([row])), 0.8)[0]
        for t in range(mask.shape[1]):
            if mask[row, t]:
                per_route[route].append(naive_topk_jsd(q[row, t].tolist(), p[t].tolist(), 4, beta))
    every = per_route["a"] + per_route["b"]
    assert float(loss.detach()) == pytest.approx(sum(every) / len(every), abs=1e-5)
    assert float(metrics["distill/jsd"]) == pytest.approx(sum(max(x, 0.0) for x in every) / len(every), abs=1e-5)
    got = topk.route_metrics()
    for route in ("a", "b"):
        want = sum(max(x, 0.0) for x in per_route[route]) / len(per_route[route])
        assert float(got[f"distill/{route}/jsd"]) == pytest.approx(want, abs=1e-5), route
    assert float(topk.route_metrics()["distill/a/jsd"]) == 0.0  # taken: the sums start again
    with pytest.raises(ValueError, match="carries no routes"):
        topk(student, seq, units)


def test_partitioned_routed_teachers_run_the_agreed_forwards_and_keep_their_rows_topk():
    """The other rank holds 2 more rows of each teacher (`agree_counts`): this rank pads each group, so both
    teachers run the agreed number of chunked forwards (b with none of this rank's rows too), and its own rows' top-k
    are unchanged; two ranks summing the per-route sums give the same means."""
    student, seq = tiny_batch()
    a, b = Forwards(tiny_teacher(1)), Forwards(tiny_teacher(2))
    routes = ("a", "a", "a", "a")
    plain = TopKDistillation(TeacherRoutes({"a": a, "b": b}, route_field="topic"), top_k=3, beta=0.5, coef=1.0,
                             temperature=0.8, chunk_size=2)
    ids, values = plain.teacher_topk(seq, routes)
    assert (a.calls, b.calls) == (2, 0)
    a.calls = 0
    seen = []
    agree = lambda counts: seen.append(counts.tolist()) or counts + 2  # noqa: E731
    padded = TopKDistillation(TeacherRoutes({"a": a, "b": b}, route_field="topic", agree_counts=agree), top_k=3,
                              beta=0.5, coef=1.0, temperature=0.8, chunk_size=2)
    ids2, values2 = padded.teacher_topk(seq, routes)
    assert seen == [[4, 0]] and (a.calls, b.calls) == (3, 1)  # 6 rows of a, 2 of b, chunks of 2
    assert torch.equal(ids2, ids)
    torch.testing.assert_close(values2, values, rtol=0, atol=1e-6)
    padded(student, seq, seq.action_mask.sum(), routes=routes)
    one = plain.route_metrics()  # nothing accumulated: zeros
    assert float(one["distill/a/jsd"]) == 0.0
    padded(student, seq, seq.action_mask.sum(), routes=routes)
    doubled = padded.route_metrics(all_reduce_sum=lambda x: 2 * x)
    plain(student, seq, seq.action_mask.sum(), routes=routes)
    single = plain.route_metrics()
    assert all(torch.allclose(doubled[k], single[k]) for k in single) and float(single["distill/b/jsd"]) == 0.0


def test_routes_travel_from_the_experience_into_the_micro_batches_and_the_saved_rollout(tmp_path):
    exp = dataclasses.replace(make_experience([1.0, 0.0, 2.0, 2.0], lengths=[3, 1, 2, 3]),
                              routes=("a", "b", "b", "a"))
    result = group_rollout(exp, group_size=2, estimator="on_policy_distill")
    assert result.routes == ("a", "b", "b", "a")
    micro = result.micro_batches(2)  # ordered by length: rows 1, 2 then 0, 3
    assert [m.routes for m in micro] == [("b", "b"), ("a", "a")]
    assert result.select(torch.tensor([3, 1])).routes == ("a", "b")
    state = result.to_state()
    torch.save(state, tmp_path / "rollout.pt")
    loaded = RolloutResult.from_state(torch.load(tmp_path / "rollout.pt", weights_only=True), torch.device("cpu"))
    assert loaded.routes == result.routes
    state.pop("routes")  # a rollout saved before routes were kept
    assert RolloutResult.from_state(state, torch.device("cpu")).routes is None
    with pytest.raises(ValueError, match="expected 4 routes, got 1"):
        dataclasses.replace(result, routes=("a",))


# ------------------------------------------------------------------------------------------------ refusals


BASE = {"train": {"type": "online_grpo"}, "grpo": {"advantage_estimator": "on_policy_distill", "kl_coef": 0}}


def test_a_served_teacher_among_the_routes_is_refused_in_one_line_naming_it():
    distill = {"teachers": {"math": "/m", "code": " http://127.0.0.1:1/v1"}, "route_field": "topic", "jsd_top_k": 4}
    with pytest.raises(ConfigError) as info:
        config_from_dict({**BASE, "distill": distill})
    assert str(info.value) == (
        "distill.jsd_top_k: distill.teachers.code is a served teacher (http://127.0.0.1:1/v1), which returns only the "
        "sampled tokens' log-probs, not its top-k logits; load every routed teacher locally or set distill.jsd_top_k "
        "to 0")
    ok = config_from_dict({**BASE, "distill": {**distill, "teachers": {"math": "/m", "code": "/c"}}})
    assert ok.distill.jsd_top_k == 4
    local = {"math": tiny_teacher(1), "code": object()}  # a served one that slipped through is refused too
    with pytest.raises(ConfigError, match=r"^distill.jsd_top_k: distill.teachers.code is a served teacher"):
        check_top_k(ok, local)
    vocab = tiny_teacher(1).config.vocab_size
    big = config_from_dict({**BASE, "distill": {**distill, "teachers": {"math": "/m"}, "jsd_top_k": vocab + 1}})
    with pytest.raises(ConfigError) as info:
        check_top_k(big, TeacherRoutes({"math": tiny_teacher(1)}, route_field="topic"))
    assert str(info.value) == (f"distill.jsd_top_k: {vocab + 1} is more than the teacher's (distill.teachers.math) "
                               f"{vocab} tokens; set it <= {vocab}")


# -------------------------------------------------------------------------------------------------- end to end


def test_online_grpo_with_two_routed_teachers_and_topk_distills_two_steps(tiny_model_dir, teachers, tmp_path):
    """Two local teachers, the math one the student itself: at step 1 (before any update) the math rows' JSD is ~0
    and the code rows' is not, so each row took its top-k from its own teacher in the policy update; the first
    step's loss is the reverse-KL signal plus jsd_coef times the JSD, the overall JSD between the routes' means."""
    code_dir = teachers[1]
    data = write_data(tmp_path / "data.jsonl", ["math", "code"])
    run = tmp_path / "run"
    assert main(routed_args(tiny_model_dir, {"math": tiny_model_dir, "code": code_dir}, data, run, "--check",
                            "--distill.jsd_top_k", "4")) == 0
    assert main(routed_args(tiny_model_dir, {"math": tiny_model_dir, "code": code_dir}, data, run,
                            "--distill.jsd_top_k", "4", "--distill.jsd_coef", "0.5", "--data.shuffle", "false",
                            "--rollout.temperature", "0.7")) == 0
    first, second = records(run)
    assert all_finite(first) and all_finite(second)
    assert 0.0 <= first["distill/math/jsd"] < 1e-6 and first["distill/code/jsd"] > 1e-4
    assert second["distill/jsd"] > 0 and math.isfinite(second["distill/code/jsd"])
    assert first["distill/math/jsd"] - 1e-6 <= first["distill/jsd"] <= first["distill/code/jsd"] + 1e-6
    assert first["policy/loss"] == pytest.approx(first["distill/reverse_kl"] + 0.5 * first["distill/jsd"], abs=1e-5)


def test_online_ppo_with_two_routed_teachers_and_topk_logs_each_routes_jsd(tiny_model_dir, teachers, tmp_path):
    data = write_data(tmp_path / "data.jsonl", ["math", "code"])
    run = tmp_path / "run"
    assert main(routed_args(tiny_model_dir, {"math": tiny_model_dir, "code": teachers[1]}, data, run,
                            "--max_steps", "1", "--ppo.minibatch_size", "2", "--ppo.micro_batch_size", "1",
                            "--ppo.kl_coef", "0", "--distill.jsd_top_k", "3", "--data.shuffle", "false",
                            config=PPO)) == 0
    (record,) = records(run)
    assert all_finite(record) and record["distill/jsd"] > 1e-4
    assert 0.0 <= record["distill/math/jsd"] < 1e-6 and record["distill/code/jsd"] > 1e-4


def test_a_routed_topk_job_resumes_mid_rollout_exactly(tiny_model_dir, teachers, tmp_path, monkeypatch):
    """Two optimizer steps per rollout (minibatches of 2 rows of 4), a checkpoint after the first: the rollout in
    flight is saved with its rows' routes, and the resumed step 2 (the rollout's second minibatch, each row's top-k
    from its own teacher again) equals the uninterrupted run's."""
    from astrai.trainer.loop import Trainer

    data = write_data(tmp_path / "data.jsonl", ["math", "code"])
    routes = {"math": teachers[0], "code": teachers[1]}

    def run(out, *extra):
        assert main(routed_args(tiny_model_dir, routes, data, out, "--distill.jsd_top_k", "4", "--data.shuffle",
                                "false", "--grpo.minibatch_size", "2", "--grpo.micro_batch_size", "1",
                                "--checkpoint.save_steps", "1", "--runtime.deterministic", "true", *extra)) == 0

    run(tmp_path / "straight")
    fit = Trainer.fit

    def stop_after_one(self):
        self.state.max_steps = 1
        return fit(self)

    monkeypatch.setattr(Trainer, "fit", stop_after_one)
    run(tmp_path / "split")
    monkeypatch.undo()
    saved = torch.load(tmp_path / "split/checkpoints/step-00000001/strategy_state.pt", weights_only=True)
    assert saved["rollout"]["routes"] == ["math", "math", "code", "code"]
    run(tmp_path / "split", "--checkpoint.resume", "auto")
    straight, split = records(tmp_path / "straight")[1], records(tmp_path / "split")[-1]
    assert max(straight["distill/math/jsd"], straight["distill/code/jsd"]) > 1e-4  # the minibatch's routes
    for key in ("policy/loss", "distill/jsd", "distill/math/jsd", "distill/code/jsd", "policy/grad_norm"):
        assert split[key] == pytest.approx(straight[key], rel=1e-6, abs=1e-7), key


def test_two_rank_fsdp2_routed_topk_runs_each_teacher_on_both_ranks(tiny_model_dir, teachers, tmp_path):
    """2 ranks (torchrun, gloo, fsdp2), one prompt each: rank 0's micro-batch holds math rows only and rank 1's code
    rows only, so each rank pads the other teacher's forward (the ranks agree on each teacher's rows per
    micro-batch). Exactness: the math teacher is the student, so its JSD at step 1 is ~0 (forwards out of step would
    hang or mix the two teachers' shards)."""
    data = write_data(tmp_path / "data.jsonl", ["math", "code"])
    out = tmp_path / "run"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
           "-m", "astrai.train", *routed_args(tiny_model_dir, {"math": tiny_model_dir, "code": teachers[1]}, data,
                                              out, "--distributed.strategy", "fsdp2", "--max_steps", "1",
                                              "--rollout.batch_size", "1", "--data.shuffle", "false",
                                              "--grpo.minibatch_size", "2", "--grpo.micro_batch_size", "2",
                                              "--distill.jsd_top_k", "4")]
    done = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    (record,) = records(out)
    assert all_finite(record)
    assert abs(record["distill/math/jsd"]) < 1e-5 and record["distill/code/jsd"] > 1e-4
    assert abs(record["distill/math/reverse_kl"]) < 1e-5
    # each rank's distill/jsd is its own route's mean; the log averages the two ranks
    assert record["distill/jsd"] == pytest.approx((record["distill/math/jsd"] + record["distill/code/jsd"]) / 2,
                                                  abs=1e-5)
