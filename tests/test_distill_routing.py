"""On-policy distillation from several teachers routed by a data column (`distill.teachers` with
`distill.route_field`; TRL#6734): each prompt row is scored by the teacher its column names, the samples of a row
carry its route (`Experience.routes`) to where the teachers score them, each teacher scores its rows in one batch and
the log-probs are scattered back. Tiny models: the student is tests/conftest.py's (seed 0), the teachers other seeds
with the same tokenizer (`test_distill.save_tiny`)."""

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_distill import SMALL, all_finite, one_error_line, records, save_tiny
from test_grpo import make_experience

from astrai.config import ConfigError, config_from_dict, ignored_settings
from astrai.experience.runner import RolloutRunner
from astrai.experience.teachers import TeacherRoutes, route_metrics, route_of
from astrai.experience.trajectory import concat_experiences
from astrai.forward import response_logprobs
from astrai.models import AutoRegressiveLM, tiny_config
from astrai.rollout.sampling import SamplingParams
from astrai.train import main
from astrai.trainer.learners.online_grpo import group_rollout

REPO = Path(__file__).resolve().parents[1]
GRPO = REPO / "configs/examples/grpo.yaml"
PPO = REPO / "configs/examples/ppo.yaml"


def tiny_teacher(seed: int) -> AutoRegressiveLM:
    torch.manual_seed(seed)
    return AutoRegressiveLM(tiny_config()).eval().requires_grad_(False)


class Forwards(torch.nn.Module):
    """A teacher that counts its forward calls (what a partitioned teacher's collectives would count)."""

    def __init__(self, model):
        super().__init__()
        self.model, self.calls = model, 0

    def forward(self, *args, **kwargs):
        self.calls += 1
        return self.model(*args, **kwargs)


def runner(teachers: TeacherRoutes, *, temperature: float = 0.7, chunk_size: int = 2) -> RolloutRunner:
    """A runner that only scores (`add_reference`): no engine, no reward."""
    return RolloutRunner(None, SamplingParams(max_new_tokens=4, temperature=temperature), decode=str,
                         score_fn=None, ref_model=teachers, chunk_size=chunk_size)


def alone(model, seq, row: int, temperature: float) -> torch.Tensor:
    """Row `row` of `seq` scored by `model` alone (one row, one forward)."""
    with torch.no_grad():
        return response_logprobs(model, seq.select(torch.tensor([row])), temperature=temperature)[0][0]


# ------------------------------------------------------------------------------------------- scoring and routing


def test_routed_advantages_equal_a_naive_loop_scoring_each_row_with_its_own_teacher():
    """8 samples (G = 2) routed a, b, a, a, b, b, a, b: the teachers' log-probs and the per-token on_policy_distill
    advantages equal a loop that scores each row alone with the teacher of its route; a row routed to b holds b's
    log-probs, not a's."""
    teachers = {"a": tiny_teacher(1), "b": tiny_teacher(2)}
    routes = ("a", "b", "a", "a", "b", "b", "a", "b")
    exp = make_experience([1.0, 0.0, 0.0, 2.0, 1.0, 1.0, 0.0, 3.0], t=4, lengths=[4, 1, 2, 4, 3, 4, 2, 1], ref=False)
    exp = dataclasses.replace(exp, routes=routes)
    scored = runner(TeacherRoutes(teachers, route_field="topic")).add_reference(exp)
    mask = exp.sequences.action_mask
    naive = torch.stack([alone(teachers[r], exp.sequences, b, 0.7) for b, r in enumerate(routes)]) * mask
    torch.testing.assert_close(scored.ref_logprobs * mask, naive, rtol=0, atol=1e-5)
    assert scored.ref_logprobs.dtype == torch.float32 and not scored.ref_logprobs[~mask].any()
    for b, route in enumerate(routes):  # the other teacher's scores are far from the row's own
        other = alone(teachers["b" if route == "a" else "a"], exp.sequences, b, 0.7)
        assert (scored.ref_logprobs[b] - other)[mask[b]].abs().max() > 1e-2
    result = group_rollout(scored, group_size=2, estimator="on_policy_distill", reward_weight=0.0)
    expected = torch.zeros_like(naive)
    for b in range(len(routes)):
        for t in range(mask.shape[1]):
            if mask[b, t]:
                expected[b, t] = naive[b, t] - exp.old_logprobs[b, t]
    torch.testing.assert_close(result.advantages, expected, rtol=0, atol=1e-5)


def test_partitioned_teachers_score_the_agreed_number_of_rows_and_keep_their_own():
    """With partitioned teachers every rank must call each teacher as often as the others: here the other rank has
    3 more rows for each teacher (`agree_counts`), so this rank pads its groups (b has none here: it still runs b's
    forwards) and the scores of its own rows are unchanged."""
    a, b = Forwards(tiny_teacher(1)), Forwards(tiny_teacher(2))
    exp = make_experience([0.0] * 4, t=3, ref=False)
    exp = dataclasses.replace(exp, routes=("a", "a", "a", "a"))
    plain = runner(TeacherRoutes({"a": a, "b": b}, route_field="topic")).add_reference(exp).ref_logprobs
    assert (a.calls, b.calls) == (2, 0)  # 4 rows of a in chunks of 2; nothing for b
    a.calls = 0
    seen = []
    agree = lambda counts: seen.append(counts.tolist()) or counts + 3  # noqa: E731
    padded = runner(TeacherRoutes({"a": a, "b": b}, route_field="topic", agree_counts=agree)).add_reference(exp)
    assert seen == [[4, 0]] and (a.calls, b.calls) == (4, 2)  # 7 rows of a, 3 of b, chunks of 2
    torch.testing.assert_close(padded.ref_logprobs, plain, rtol=0, atol=1e-6)


def test_two_routes_naming_one_teacher_score_it_in_one_batch():
    shared, other = Forwards(tiny_teacher(1)), tiny_teacher(2)
    exp = make_experience([0.0] * 4, t=3, ref=False)
    exp = dataclasses.replace(exp, routes=("math", "default", "math", "code"))
    teachers = TeacherRoutes({"math": shared, "default": shared, "code": other}, route_field="topic")
    out = runner(teachers, chunk_size=4).add_reference(exp)
    assert shared.calls == 1  # rows 0, 1, 2 together
    mask = exp.sequences.action_mask
    torch.testing.assert_close(out.ref_logprobs[1] * mask[1], alone(shared, exp.sequences, 1, 0.7) * mask[1],
                               rtol=0, atol=1e-5)


class Record:
    def __init__(self, index, **columns):
        self.index, self.columns = index, columns


def test_route_of_uses_the_value_or_the_default_and_names_the_row_otherwise():
    assert route_of(Record(0, topic="math"), ("math", "code"), "topic") == "math"
    assert route_of(Record(0, topic=3), ("3", "code"), "topic") == "3"  # values compared as text
    assert route_of(Record(0, topic="poetry"), ("math", "default"), "topic") == "default"
    assert route_of(Record(0), ("math", "default"), "topic") == "default"
    with pytest.raises(ValueError) as info:
        route_of(Record(7, topic="poetry"), ("math", "code"), "topic", source="data.jsonl")
    assert str(info.value) == ("distill.teachers: row 7 of data.jsonl names 'poetry' in its 'topic' column "
                               "(distill.route_field), which no teacher scores (teachers: math, code); add a teacher "
                               "for it or a 'default' one")


def test_routes_travel_through_select_and_concat_and_the_runner_reads_them_from_the_records():
    exp = make_experience([0.0] * 4, t=3, ref=False)
    exp = dataclasses.replace(exp, routes=("a", "b", "b", "a"))
    assert exp.select([3, 1]).routes == ("a", "b")
    assert concat_experiences([exp.select([0, 1]), exp.select([2])], pad_token_id=2).routes == ("a", "b", "b")
    teachers = TeacherRoutes({"a": tiny_teacher(1), "default": tiny_teacher(2)}, route_field="topic")
    records = [Record(0, topic="a"), Record(1, topic="zzz")]
    assert runner(teachers).routes_of([r for r in records for _ in range(2)]) == ("a", "a", "default", "default")
    assert RolloutRunner(None, SamplingParams(max_new_tokens=1), decode=str, score_fn=None).routes_of(records) is None
    with pytest.raises(ValueError, match="the experience carries no routes"):
        runner(teachers).add_reference(make_experience([0.0], ref=False))


def test_route_metrics_are_each_teachers_token_mean_over_the_ranks():
    kl = torch.tensor([[1.0, 2.0, 0.0], [4.0, 0.0, 0.0], [8.0, 8.0, 8.0]])
    mask = torch.tensor([[True, True, False], [True, False, False], [True, True, True]])
    out = route_metrics(kl, mask, ("a", "b", "a"), ("a", "b", "c"))
    assert out["distill/a/reverse_kl"] == pytest.approx((1 + 2 + 8 * 3) / 5)
    assert out["distill/b/reverse_kl"] == pytest.approx(4.0) and out["distill/c/reverse_kl"] == 0
    assert out["distill/a/share"] == pytest.approx(2 / 3) and out["distill/c/share"] == 0
    doubled = route_metrics(kl, mask, ("a", "b", "a"), ("a", "b", "c"), all_reduce_sum=lambda x: 2 * x)
    assert all(torch.allclose(doubled[k], out[k]) for k in out)  # two equal ranks: the same means


# ------------------------------------------------------------------------------------------------ config rules


BASE = {"train": {"type": "online_grpo"}, "grpo": {"advantage_estimator": "on_policy_distill", "kl_coef": 0}}


@pytest.mark.parametrize("distill, message", [
    ({"teacher": "t", "teachers": {"a": "x"}, "route_field": "topic"},
     "distill.teachers: set together with distill.teacher; name one teacher in distill.teacher or several routed "
     "by a column in distill.teachers, not both"),
    ({"teachers": {"a": "x"}}, "distill.route_field: distill.teachers routes each prompt row by a data column; "
                               "name it"),
    ({"teachers": {1: "x"}, "route_field": "topic"}, "distill.teachers: route 1: expected a non-empty string"),
    ({"teachers": {"a": ""}, "route_field": "topic"}, "distill.teachers: a: expected a model name or path"),
    ({"teachers": {"a:model": None}, "route_field": "topic"},
     "distill.teachers: a:model: expected a model name or path, or a server URL, got None (YAML needs a space after "
     "the colon: {a: model})"),
])
def test_config_refuses_both_teacher_fields_and_malformed_routes_in_one_line(distill, message):
    with pytest.raises(ConfigError) as info:
        config_from_dict({**BASE, "distill": distill})
    assert str(info.value).startswith(message) and "\n" not in str(info.value), str(info.value)


def test_config_rules_of_one_teacher_hold_for_every_routed_teacher():
    teachers = {"distill": {"teachers": {"math": "/m", "code": "http://127.0.0.1:1/v1"}, "route_field": "topic"}}
    ok = config_from_dict({**BASE, **teachers})
    assert ok.distill.distills and ignored_settings(ok) == []
    with pytest.raises(ConfigError, match=r"^distill.teachers.code: a served teacher returns log-probs of its raw "):
        config_from_dict({**BASE, **teachers, "rollout": {"temperature": 0.7}})
    with pytest.raises(ConfigError, match=r"^grpo.kl_coef: a reference-KL term is set together with distill.teacher"):
        config_from_dict({**BASE, **teachers, "grpo": {"advantage_estimator": "on_policy_distill"}})
    with pytest.raises(ConfigError, match=r"^distill.teachers: set, but grpo.advantage_estimator grpo does not read"):
        config_from_dict({"train": {"type": "online_grpo"}, **teachers, "grpo": {"kl_coef": 0}})
    with pytest.raises(ConfigError, match=r"^distill.teachers: on-policy distillation scores the tokens sampled by "):
        config_from_dict({"train": {"type": "sft"}, **teachers})
    assert ignored_settings(config_from_dict({"distill": {"route_field": "topic"}})) == ["distill.route_field"]


# -------------------------------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def teachers(tmp_path_factory):
    root = tmp_path_factory.mktemp("teachers")
    return save_tiny(root / "math", seed=1), save_tiny(root / "code", seed=2)


def write_data(path: Path, topics) -> Path:
    rows = [{"question": f"what is {i} plus {i}?", "answer": str(2 * i), **({} if t is None else {"topic": t})}
            for i, t in enumerate(topics)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def routed_args(student, teachers: dict, data: Path, out: Path, *extra, config=GRPO) -> list[str]:
    mapping = "{" + ", ".join(f"{k}: '{v}'" for k, v in teachers.items()) + "}"
    args = ["--config", str(config), "--model.path", str(student), "--train.output_dir", str(out), *SMALL,
            "--data.path", str(data), "--distill.teachers", mapping, "--distill.route_field", "topic",
            "--optim.learning_rate", "1e-3"]
    if config == GRPO:
        args += ["--grpo.group_size", "2", "--grpo.minibatch_size", "4", "--grpo.micro_batch_size", "2",
                 "--grpo.kl_coef", "0", "--grpo.advantage_estimator", "on_policy_distill"]
    return args + list(extra)


def test_a_row_without_a_teacher_and_a_missing_column_are_refused_in_one_line(tiny_model_dir, teachers, tmp_path,
                                                                              capsys):
    math_dir, code_dir = teachers
    both = {"math": math_dir, "code": code_dir}
    data = write_data(tmp_path / "data.jsonl", ["math", "code", "poetry", "math"])
    for extra in (["--check"], []):
        assert main(routed_args(tiny_model_dir, both, data, tmp_path / f"run{len(extra)}", *extra)) == 2
        assert one_error_line(capsys) == (
            f"error: distill.teachers: row 2 of {data} names 'poetry' in its 'topic' column (distill.route_field), "
            "which no teacher scores (teachers: math, code); add a teacher for it or a 'default' one")
    unlabelled = write_data(tmp_path / "plain.jsonl", [None, None])
    for extra in (["--check"], []):
        assert main(routed_args(tiny_model_dir, both, unlabelled, tmp_path / f"plain{len(extra)}", *extra)) == 2
        assert one_error_line(capsys) == (
            f"error: distill.route_field: no row of {unlabelled} has a 'topic' column, which distill.teachers routes "
            "the rows by; name a column of the data")
    assert not (tmp_path / "run0" / "metrics.jsonl").exists()
    other = save_tiny(tmp_path / "short", seed=3, max_position_embeddings=64)  # one teacher's checks: its context
    assert main(routed_args(tiny_model_dir, {"math": math_dir, "default": other}, data, tmp_path / "short-run",
                            "--check")) == 2
    assert one_error_line(capsys).startswith(f"error: distill.teachers.default: {other} has "
                                             "max_position_embeddings=64, fewer than the ")


def test_online_grpo_with_two_teachers_runs_a_step_and_logs_each_teachers_kl(tiny_model_dir, teachers, tmp_path,
                                                                              capsys):
    """One process, two local teachers and a default route to the first: --check plans both teachers' memory (one
    item each, the shared one once), then one step logs distill/<route>/reverse_kl and share for every route."""
    math_dir, code_dir = teachers
    data = write_data(tmp_path / "data.jsonl", ["math", "code", "poetry", "code"])
    routes = {"math": math_dir, "code": code_dir, "default": math_dir}
    assert main(routed_args(tiny_model_dir, routes, data, tmp_path / "check", "--check")) == 0
    out = capsys.readouterr().out
    assert "check passed" in out and "teacher math" in out and "teacher code" in out
    assert "teacher default" not in out  # the default route shares the math teacher's copy
    run = tmp_path / "run"
    assert main(routed_args(tiny_model_dir, routes, data, run, "--max_steps", "1", "--rollout.batch_size", "4",
                            "--data.shuffle", "false")) == 0
    (record,) = records(run)
    assert all_finite(record)
    assert record["distill/math/share"] == pytest.approx(0.25) and record["distill/code/share"] == pytest.approx(0.5)
    assert record["distill/default/share"] == pytest.approx(0.25)
    for route in routes:
        assert abs(record[f"distill/{route}/reverse_kl"]) > 1e-3, route
    # the overall mean is the token-weighted mean of the teachers' parts
    parts = [record[f"distill/{r}/reverse_kl"] for r in routes]
    assert min(parts) - 1e-6 <= record["distill/reverse_kl"] <= max(parts) + 1e-6


def test_online_ppo_with_two_teachers_logs_each_teachers_kl(tiny_model_dir, teachers, tmp_path):
    math_dir, code_dir = teachers
    data = write_data(tmp_path / "data.jsonl", ["math", "code"])
    run = tmp_path / "run"
    assert main(routed_args(tiny_model_dir, {"math": math_dir, "code": code_dir}, data, run, "--max_steps", "1",
                            "--ppo.minibatch_size", "2", "--ppo.micro_batch_size", "1", "--ppo.kl_coef", "0",
                            config=PPO)) == 0
    (record,) = records(run)
    assert all_finite(record) and record["distill/math/share"] + record["distill/code/share"] == pytest.approx(1)
    assert abs(record["distill/math/reverse_kl"]) > 1e-3 and abs(record["distill/code/reverse_kl"]) > 1e-3


def test_a_served_teacher_and_a_local_one_mixed_score_as_two_local_ones(tiny_model_dir, teachers, tmp_path):
    """The code teacher behind `python -m astrai.serve`, the math one local: the first step's metrics equal those
    of the same job with both teachers local (deterministic sampling)."""
    from test_serve import free_port, http

    math_dir, code_dir = teachers
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "astrai.serve", "--checkpoint", str(code_dir), "--port", str(port),
                             "--log_level", "warning"], env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            assert proc.poll() is None, proc.stdout.read()
            try:
                if http("GET", f"{base}/health")[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.2)
        data = write_data(tmp_path / "data.jsonl", ["math", "code", "code", "math"])
        runs = {}
        for name, code in (("local", code_dir), ("served", f"{base}/v1")):
            out = tmp_path / name
            assert main(routed_args(tiny_model_dir, {"math": math_dir, "code": code}, data, out, "--max_steps", "1",
                                    "--runtime.deterministic", "true", "--rollout.temperature", "1.0")) == 0
            runs[name] = records(out)[0]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    for key in ("distill/reverse_kl", "distill/math/reverse_kl", "distill/code/reverse_kl", "policy/loss"):
        assert runs["served"][key] == pytest.approx(runs["local"][key], abs=1e-5), key


def test_two_rank_fsdp2_routes_each_ranks_rows_to_its_teachers(tiny_model_dir, teachers, tmp_path):
    """2 ranks (torchrun, gloo, fsdp2), one prompt each: rank 0 draws the math row and rank 1 the code row, so each
    rank holds rows of one teacher only; the partitioned teachers still run the same forwards on both ranks (the
    ranks agree on the rows each one scores). Exactness: the math teacher is the student itself, so its reverse KL at
    step 1 is ~0 (had the ranks called different teachers' forwards, their all-gathers would have mixed the two
    teachers' shards: no error, wrong log-probs)."""
    math_dir, code_dir = tiny_model_dir, teachers[1]
    data = write_data(tmp_path / "data.jsonl", ["math", "code"])
    out = tmp_path / "run"
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
           "-m", "astrai.train", *routed_args(tiny_model_dir, {"math": math_dir, "code": code_dir}, data, out,
                                              "--distributed.strategy", "fsdp2", "--max_steps", "1",
                                              "--rollout.batch_size", "1", "--data.shuffle", "false",
                                              "--grpo.minibatch_size", "2", "--grpo.micro_batch_size", "2")]
    done = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    (record,) = records(out)
    assert all_finite(record)
    assert record["distill/math/share"] == pytest.approx(0.5) and record["distill/code/share"] == pytest.approx(0.5)
    assert abs(record["distill/math/reverse_kl"]) < 1e-5 and abs(record["distill/code/reverse_kl"]) > 1e-3
    # the overall metric is the mean over the ranks of each rank's own teacher's mean
    assert record["distill/reverse_kl"] == pytest.approx(
        (record["distill/math/reverse_kl"] + record["distill/code/reverse_kl"]) / 2, abs=1e-5)
