"""Partial rollouts (`rollout.partial`, astrai.experience.partial): B complete groups per rollout, the rest carried
to the next under the new weights with their tokens, behaviour log-probs and per-token versions; the staleness
bound re-generates; the decoupled-PPO loss over mixed-version tokens against a naive loop; config refusals; an
online_grpo job end to end."""

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from toy_rl import RandomPrompts, trained

from astrai.algos import correction_weights
from astrai.config import ConfigError, load_config
from astrai.data.sequences import Sequences
from astrai.experience.partial import LAG_METRICS, PartialRollouts, staleness_stats
from astrai.experience.result import RolloutResult
from astrai.experience.runner import RolloutRunner
from astrai.experience.sources import OnlineExperience
from astrai.forward import response_logprobs
from astrai.models import AutoRegressiveLM, tiny_config
from astrai.rollout.engine import EngineCapacity, sync_weights
from astrai.rollout.paged_engine import PagedGenerationEngine
from astrai.rollout.sampling import SamplingParams
from astrai.rollout.streaming import StepOutput
from astrai.trainer.learners.policy_loss import policy_objective

REPO = Path(__file__).resolve().parents[1]
EOS, FILL, MARK = 2, 1, 100


# ------------------------------------------------------------------------------------- the corrected loss
def test_corrected_loss_with_mixed_version_tokens_matches_a_naive_loop():
    # one response of 4 tokens: two sampled by version 0, two by version 2; the trainer (version 2) rescored them
    behaviour = [-1.0, -0.5, -0.2, -0.3]  # the engine's log-probs, each under the version that sampled it
    proximal = [-0.8, -0.9, -0.2, -0.4]   # the trainer's own before the update (rollout.correction's rescore)
    current = [-0.5, -0.9, -0.1, -0.4]    # the policy being updated
    advantage, eps, cap = 1.5, 0.2, 2.0
    # naive: w_t = min(pi_prox / pi_behav, C) (TIS), r_t = pi / pi_prox, l_t = -w_t * min(r_t A, clip(r_t) A)
    naive = 0.0
    for b, p, c in zip(behaviour, proximal, current):
        w = min(math.exp(p - b), cap)
        r = math.exp(c - p)
        naive += -w * min(r * advantage, min(max(r, 1 - eps), 1 + eps) * advantage)
    naive /= 4
    mask = torch.ones(1, 4, dtype=torch.bool)
    weights, keep, _ = correction_weights("token_tis", torch.tensor([proximal]), torch.tensor([behaviour]), mask,
                                          token_cap=cap)
    assert keep.all() and weights[0, 0] == pytest.approx(math.exp(0.2)) and weights[0, 1] == pytest.approx(
        math.exp(-0.4))
    seqs = Sequences.from_tokens([[5, 6]], [[7, 8, 9, 10]], pad_token_id=0)
    micro = RolloutResult(sequences=seqs, old_logprobs=torch.tensor([proximal]), ref_logprobs=None, values=None,
                          scores=torch.tensor([1.0]), kl=None, rewards=torch.zeros(1, 4),
                          advantages=torch.full((1, 4), advantage), returns=None, policy_version=2, responses=("",),
                          rollout_logprobs=torch.tensor([behaviour]), correction_weights=weights,
                          policy_versions=torch.tensor([[0, 0, 2, 2]]))
    section = SimpleNamespace(policy_loss="ppo_clip", loss_agg_mode=None, clip_ratio_low=None, clip_ratio_high=None,
                              clip_ratio_c=None, clip_eps=eps)
    loss, metrics = policy_objective(section)(torch.tensor([current], requires_grad=True), micro, torch.tensor(4))
    assert float(loss.detach()) == pytest.approx(naive, rel=1e-6)
    assert float(metrics["policy/clipfrac"]) > 0  # the first token's ratio exp(0.3) is clipped: the case matters


# ------------------------------------------------------------------------------ a scripted streaming engine
class ScriptedEngine:
    """A streaming engine whose samples have scripted lengths. A prompt is [0, L_0, ..., L_{G-1}]: choice c of it
    emits MARK + c, then FILL tokens, and EOS as its L_c-th token; a continued request (prompt + partial response)
    finds its choice in the response's first token. Each token's log-prob is -(version + 1) / 10 - position / 100,
    so a token's log-prob says which version sampled it and where."""

    def __init__(self):
        self.policy_version, self.pad_token_id, self.device = 0, 0, torch.device("cpu")
        self.capacity = EngineCapacity()
        self.live, self.next_id, self.added, self.asleep = {}, 0, [], True

    def generate(self, *args, **kwargs):
        raise AssertionError("a partial rollout streams")

    def load_weights(self, state_dict, policy_version):
        assert not self.live
        self.policy_version = policy_version
        return policy_version

    def sleep(self):
        assert not self.live
        self.asleep = True

    def wake(self):
        self.asleep = False

    @property
    def has_unfinished_requests(self):
        return bool(self.live)

    def add_request(self, prompt_ids, params, *, n=1, penalty=None, seed=None, top_logprobs=0):
        assert not self.asleep
        self.added.append((list(prompt_ids), params.max_new_tokens, n))
        marks = [i for i, t in enumerate(prompt_ids) if t >= MARK]
        cut = marks[0] if marks else len(prompt_ids)
        lengths, response = prompt_ids[1:cut], prompt_ids[cut:]
        rid, self.next_id = self.next_id, self.next_id + 1
        for c in range(n):
            choice = response[0] - MARK if response else c
            self.live[(rid, c)] = {"choice": choice, "length": lengths[choice], "done_tokens": len(response),
                                   "left": params.max_new_tokens}
        return rid

    def step(self):
        out = []
        for (rid, c), s in list(self.live.items()):
            pos = s["done_tokens"]
            token = MARK + s["choice"] if pos == 0 else (EOS if pos + 1 == s["length"] else FILL)
            s["done_tokens"] += 1
            s["left"] -= 1
            done = token == EOS or s["left"] == 0
            logprob = float(torch.tensor(-(self.policy_version + 1) / 10 - pos / 100))  # float32 values, as engines
            out.append(StepOutput(rid, c, token, logprob, (), done, token == EOS))
            if done:
                del self.live[(rid, c)]
        return out

    def abort(self, request_id, choice=None):
        for key in [k for k in self.live if k[0] == request_id and (choice is None or k[1] == choice)]:
            del self.live[key]

    def stream_stats(self):
        return {}


class Prompts:
    """A sampler of scripted prompts [0, L_0, ..., L_{G-1}] (`ScriptedEngine`), in order."""

    def __init__(self, lengths):
        self.dataset = [SimpleNamespace(prompt_ids=[0, *ls], answer="", index=i) for i, ls in enumerate(lengths)]
        self.drawn = 0

    def next_batch(self, n):
        out = self.dataset[self.drawn:self.drawn + n]
        self.drawn += n
        return out


def scripted_source(lengths, *, batch_size, group_size, in_flight, bound, max_new_tokens=16):
    engine = ScriptedEngine()
    runner = RolloutRunner(engine, SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=(EOS,)),
                           decode=lambda ids: " ".join(map(str, ids)),
                           score_fn=lambda texts, records, ids: torch.tensor([float(len(i)) for i in ids]))
    partial = PartialRollouts(batch_size=batch_size, group_size=group_size, in_flight=in_flight,
                              max_off_policy_steps=bound)
    return OnlineExperience(sync_weights=lambda v: sync_weights(engine, lambda: iter(()), v), runner=runner,
                            sampler=Prompts(lengths), batch_size=batch_size, group_size=group_size, seed=0,
                            device=torch.device("cpu"), partial=partial)


def rows(exp):
    """Per sample: (prompt ids, response ids, log-probs, versions) over its real tokens."""
    return [(t.prompt_ids, t.response_ids, t.logprobs, t.policy_versions) for t in exp.trajectories()]


def test_staleness_accounting_by_hand_and_groups_whole():
    # B = 1, G = 2, 2 groups in flight; group A: lengths 2 and 5, group B: 3 and 3, group C: 4 and 4
    source = scripted_source([[2, 5], [3, 3], [4, 4], [6, 6]], batch_size=1, group_size=2, in_flight=2, bound=2)
    first = source.collect(policy_version=0)
    # steps 1-3: A0 ends at step 2, B0 and B1 at step 3 -> group B complete, stop; A1 has 3 tokens of version 0
    assert [r[0] for r in rows(first)] == [(0, 3, 3), (0, 3, 3)]  # one whole group, its G rows contiguous
    assert [r[1] for r in rows(first)] == [(MARK, FILL, EOS), (MARK + 1, FILL, EOS)]
    assert first.scores.tolist() == [3.0, 3.0]
    assert first.stats["staleness_mean"] == 0 and first.stats["staleness/lag_0"] == 1.0
    assert first.stats["carried_samples"] == 0 and first.stats["groups_in_flight"] == 1
    carried = source.partial.groups[0].samples
    assert carried[0].response_ids == [MARK, EOS] and carried[0].done
    assert carried[1].response_ids == [MARK + 1, FILL, FILL] and carried[1].policy_versions == [0, 0, 0]
    saved = [(list(s.response_ids), list(s.logprobs), list(s.policy_versions)) for s in carried]

    source.engine.added.clear()
    second = source.collect(policy_version=2)  # two optimizer steps later
    # A1 continues from its 3 tokens: its prompt + partial response re-sent, with 5 - 3 = 2 tokens... of a cap of 16
    assert source.engine.added[0] == ([0, 2, 5, MARK + 1, FILL, FILL], 16 - 3, 1)
    got = rows(second)
    assert [r[0] for r in got] == [(0, 2, 5), (0, 2, 5)]
    for (ids, logprobs, versions), row in zip(saved, got):  # carried tokens exactly as they were sampled
        assert list(row[1][:len(ids)]) == ids and list(row[2][:len(ids)]) == logprobs
        assert list(row[3][:len(ids)]) == versions
    assert got[1][1] == (MARK + 1, FILL, FILL, FILL, EOS) and got[1][3] == (0, 0, 0, 2, 2)
    assert got[1][2][3] == pytest.approx(-0.3 - 0.03)  # version 2 sampled position 3
    # lags: A0 [2, 2], A1 [2, 2, 2, 0, 0] -> 5 of 7 tokens lag 2, 2 lag 0; both samples' staleness 2
    s = second.stats
    assert s["staleness_mean"] == 2 and s["staleness_max"] == 2
    assert s["staleness/lag_0"] == pytest.approx(2 / 7) and s["staleness/lag_1"] == 0
    assert s["staleness/lag_2"] == pytest.approx(5 / 7)
    assert s["carried_samples"] == 2 and s["regenerated_samples"] == 0 and second.policy_version == 2
    # group C was drawn and decoded for 2 steps at version 2: carried with 2 tokens each
    assert [x.policy_versions for x in source.partial.groups[0].samples] == [[2, 2], [2, 2]]


def test_the_staleness_bound_regenerates_from_the_prompt():
    source = scripted_source([[2, 5], [3, 3], [4, 4], [6, 6]], batch_size=1, group_size=2, in_flight=2, bound=2)
    source.collect(policy_version=0)
    source.collect(policy_version=2)
    source.engine.added.clear()
    third = source.collect(policy_version=5)  # C's tokens of version 2 would lag 3 > 2: both re-generated
    assert third.stats["regenerated_samples"] == 2 and third.stats["carried_samples"] == 0
    assert source.engine.added[0] == ([0, 4, 4], 16, 2)  # from the prompt alone, both choices in one request
    assert third.stats["staleness_max"] <= 2
    assert all(v == 5 for row in rows(third) for v in row[3])


def test_a_smaller_budget_on_resume_restarts_the_samples_it_no_longer_fits():
    """rollout.max_new_tokens lowered (a resumed job): the carried A1 (3 tokens, running) has no token left under
    a cap of 3 and is restarted from its prompt, never sent with max_new_tokens 0; the done A0 (2 tokens) stays."""
    source = scripted_source([[2, 5], [3, 3], [4, 4]], batch_size=1, group_size=2, in_flight=2, bound=2)
    source.collect(policy_version=0)
    source.runner.sampling = SamplingParams(max_new_tokens=3, stop_token_ids=(EOS,))
    source.engine.added.clear()
    second = source.collect(policy_version=1)
    assert second.stats["regenerated_samples"] == 1 and all(len(r[1]) <= 3 for r in rows(second))
    assert source.engine.added[0] == ([0, 2, 5], 3, 1)  # A1 from its prompt alone, with the whole new budget


def test_staleness_stats_by_hand():
    versions = torch.tensor([[3, 3, 5, -1], [5, 5, 5, 5]])
    mask = versions >= 0
    stats = staleness_stats(versions, mask, 5, 2)
    assert stats == {"staleness_mean": 1.0, "staleness_max": 2.0, "staleness/lag_0": 5 / 7, "staleness/lag_1": 0.0,
                     "staleness/lag_2": 2 / 7}
    wide = staleness_stats(torch.tensor([[0, 20, 20]]), torch.ones(1, 3, dtype=torch.bool), 20, 50)
    assert [k for k in wide if k.startswith("staleness/")] == [f"staleness/lag_{k}" for k in range(LAG_METRICS + 1)]
    assert wide["staleness/lag_0"] == pytest.approx(2 / 3) and wide["staleness_max"] == 20  # lag 20: no own metric


# ------------------------------------------------------------------------- the paged engine, a tiny model
def small_model(seed=0):
    torch.manual_seed(seed)
    return AutoRegressiveLM(tiny_config(vocab_size=16, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                        num_key_value_heads=1, eos_token_id=EOS, pad_token_id=EOS, bos_token_id=1))


def test_carried_samples_continue_under_the_new_weights_with_their_old_tokens_exact():
    model = small_model()
    engine = PagedGenerationEngine(model, pad_token_id=EOS, backend="torch", block_size=4)
    runner = RolloutRunner(engine, SamplingParams(max_new_tokens=10, stop_token_ids=(EOS,)),
                           decode=lambda ids: " ".join(map(str, ids)),
                           score_fn=lambda texts, records, ids: torch.zeros(len(ids)))
    policy = trained(model)
    source = OnlineExperience(sync_weights=lambda v: sync_weights(engine, policy.full_weights, v), runner=runner,
                              sampler=RandomPrompts(16, 0), batch_size=1, group_size=2, seed=0,
                              device=torch.device("cpu"),
                              partial=PartialRollouts(batch_size=1, group_size=2, in_flight=4, max_off_policy_steps=3))
    old_model = small_model()
    source.collect(0)
    carried = {tuple(s.response_ids): (list(s.logprobs), list(s.policy_versions))
               for g in source.partial.groups for s in g.samples if s.response_ids and not s.done}
    assert carried
    with torch.no_grad():  # a new policy version: other weights
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    exp = source.collect(2)
    continued = 0
    for row, traj in enumerate(exp.trajectories()):
        for prefix, (logprobs, versions) in carried.items():
            if traj.response_ids[:len(prefix)] == prefix and len(traj.response_ids) >= len(prefix):
                continued += 1
                assert list(traj.logprobs[:len(prefix)]) == logprobs
                assert list(traj.policy_versions[:len(prefix)]) == versions == [0] * len(prefix)
    assert continued, "no carried sample finished in the second rollout (pick another seed)"
    # behaviour log-probs are those of the weights that sampled each token: version 0's tokens score so under the
    # old weights, version 2's under the new ones (re-prefilled: no KV of the old weights served)
    seqs, mask = exp.sequences, exp.sequences.action_mask
    new_lp = response_logprobs(model.eval(), seqs, temperature=1.0)[0]
    old_lp = response_logprobs(old_model.eval(), seqs, temperature=1.0)[0]
    v = exp.policy_versions
    assert torch.allclose(exp.old_logprobs[mask & (v == 2)], new_lp[mask & (v == 2)], atol=1e-5)
    assert torch.allclose(exp.old_logprobs[mask & (v == 0)], old_lp[mask & (v == 0)], atol=1e-5)
    assert bool((mask & (v == 0)).any()) and bool((mask & (v == 2)).any())


# ---------------------------------------------------------------------------------------------- the config
GRPO = str(REPO / "configs/examples/grpo.yaml")
ON = ["--rollout.partial", "true", "--rollout.max_off_policy_steps", "1", "--rollout.correction", "token_tis"]


@pytest.mark.parametrize("extra, message", [
    (["--rollout.partial", "true", "--rollout.correction", "token_tis"], "max_off_policy_steps >= 1"),
    (["--rollout.partial", "true", "--rollout.max_off_policy_steps", "1"], "set rollout.correction"),
    (ON + ["--rollout.dynamic_sampling", "true"], "not supported yet with rollout.dynamic_sampling"),
    (ON + ["--rollout.tensor_parallel_size", "2"], "tensor_parallel_size"),
    (ON + ["--rollout.engine", "vllm"], "rollout.engine vllm"),
    (ON + ["--rollout.generation_batch_size", "2"], "must exceed rollout.batch_size 2"),
    (ON + ["--grpo.minibatch_size", "4"], "below the 2 optimizer steps"),
    (["--rollout.max_off_policy_steps", "2"], "rollout.partial is false"),
])
def test_config_refuses_what_partial_rollouts_do_not_support(extra, message):
    with pytest.raises(ConfigError, match=message):
        load_config(GRPO, extra)


def test_config_defaults_are_synchronous_and_partial_accepts_in_flight_groups():
    config = load_config(GRPO, [])
    assert config.rollout.partial is False and config.rollout.max_off_policy_steps == 0
    config = load_config(GRPO, ON + ["--rollout.generation_batch_size", "3"])
    assert config.rollout.partial and config.rollout.generation_batch_size == 3


def test_without_partial_the_source_saves_no_groups_in_flight():
    source = scripted_source([[2, 2]], batch_size=1, group_size=2, in_flight=2, bound=1)
    source.partial = None
    assert set(source.state_dict()) == {"sampling_rng"}


# ------------------------------------------------------------------------------------------- end to end
REWARD = ("def length(prompts, completions, completion_ids, **kwargs):\n"
          "    return [len(i) / 6 for i in completion_ids]\n")


def run_partial(model_dir, root, steps, extra=()):
    from astrai.train import main

    root.mkdir(parents=True, exist_ok=True)
    (root / "length.py").write_text(REWARD)
    out = root / "run"
    code = main(["--config", GRPO, "--model.path", str(model_dir), "--train.output_dir", str(out),
                 "--max_steps", str(steps), "--rollout.max_new_tokens", "8", "--train.progress_bar", "false",
                 "--data.truncation", "left", "--train.report_to", "none", "--runtime.num_threads", "1",
                 "--runtime.deterministic", "true", "--grpo.group_size", "2", "--rollout.batch_size", "2",
                 "--grpo.minibatch_size", "4", "--grpo.micro_batch_size", "2", "--optim.learning_rate", "1e-3",
                 "--rollout.temperature", "2.0", *ON,
                 "--reward.functions", json.dumps([{"function": "length", "path": str(root / "length.py")}]),
                 *extra])
    assert code == 0
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def assert_same_run(rows_a: list[dict], rows_b: list[dict], out_a: Path, out_b: Path, *, step: int) -> None:
    """Two runs' metrics equal (but time, memory and speed) and their step-`step` weights bitwise equal."""
    from safetensors.torch import load_file

    volatile = ("time/", "memory/", "perf/")
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith(volatile)} for r in rows]  # noqa: E731
    assert strip(rows_b) == strip(rows_a)
    a, b = (load_file(str(out / f"checkpoints/step-{step:08d}/model.safetensors")) for out in (out_a, out_b))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def stopping_model_dir(tmp_path_factory):
    """The tiny model with 41 stop ids (its eos list): its random answers end at uneven lengths, so partial rollouts
    carry, continue and re-generate samples."""
    from single_turn_reference import tiny_model

    path = tiny_model(tmp_path_factory.mktemp("tiny-stopping"))
    config = json.loads((path / "config.json").read_text())
    config["eos_token_id"] = [2, *range(40, 80)]
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_online_grpo_with_partial_rollouts_trains_three_steps(stopping_model_dir, tmp_path):
    metrics = [m for m in run_partial(stopping_model_dir, tmp_path, 3, ["--rollout.max_new_tokens", "16"])
               if "policy/loss" in m]
    assert len(metrics) == 3
    for m in metrics:
        for name in ("policy/loss", "rollout/staleness_mean", "rollout/staleness_max", "rollout/staleness/lag_0",
                     "rollout/staleness/lag_1", "rollout/carried_samples", "rollout/regenerated_samples",
                     "rollout/correction_weight_mean", "rollout/reward_mean"):
            assert math.isfinite(m[name]), name
        assert m["rollout/staleness_max"] <= 1
        assert m["rollout/staleness/lag_0"] + m["rollout/staleness/lag_1"] == pytest.approx(1.0)
    assert metrics[0]["rollout/staleness_max"] == 0  # nothing carried into the first rollout
    assert sum(m["rollout/carried_samples"] for m in metrics) > 0  # later ones continue samples
    assert max(m["rollout/staleness/lag_1"] for m in metrics) > 0


def test_resume_mid_partial_rollout_is_bitwise_exact(stopping_model_dir, tmp_path, monkeypatch):
    from astrai.trainer.loop import Trainer

    extra = ["--rollout.max_new_tokens", "16", "--checkpoint.save_steps", "2"]
    straight = run_partial(stopping_model_dir, tmp_path / "straight", 4, extra)
    fit = Trainer.fit

    def stop_after_two(self):
        self.state.max_steps = 2
        return fit(self)

    monkeypatch.setattr(Trainer, "fit", stop_after_two)
    run_partial(stopping_model_dir, tmp_path / "split", 4, extra)
    monkeypatch.undo()
    # the checkpoint holds groups in flight, some of them mid-sample
    saved = torch.load(tmp_path / "split/run/checkpoints/step-00000002/strategy_state.pt", weights_only=True)
    samples = [s for g in saved["partial_rollouts"]["groups"] for s in g["samples"]]
    assert any(s["response_ids"] and not s["done"] for s in samples)
    resumed = run_partial(stopping_model_dir, tmp_path / "split", 4, extra + ["--checkpoint.resume", "auto"])
    assert_same_run(straight, resumed, tmp_path / "straight/run", tmp_path / "split/run", step=4)


def test_online_ppo_with_partial_rollouts_trains(stopping_model_dir, tmp_path):
    from astrai.train import main

    (tmp_path / "length.py").write_text(REWARD)
    out = tmp_path / "run"
    assert main(["--config", str(REPO / "configs/examples/ppo.yaml"), "--model.path", str(stopping_model_dir),
                 "--train.output_dir", str(out), "--max_steps", "3", "--rollout.max_new_tokens", "16",
                 "--train.progress_bar", "false", "--data.truncation", "left", "--train.report_to", "none",
                 "--runtime.num_threads", "1", "--rollout.batch_size", "4", "--ppo.minibatch_size", "4",
                 "--ppo.micro_batch_size", "2", *ON,
                 "--reward.functions", json.dumps([{"function": "length", "path": str(tmp_path / "length.py")}])]) == 0
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 3 and all(math.isfinite(m["policy/loss"]) for m in metrics)
    assert sum(m["rollout/carried_samples"] for m in metrics) > 0


def run_two_ranks(model_dir, root, steps, extra=()) -> list[dict]:
    """`run_partial`'s job on 2 processes (torchrun, gloo): each rank its own partial rollouts and groups in flight."""
    import socket
    import subprocess
    import sys

    root.mkdir(parents=True, exist_ok=True)
    (root / "length.py").write_text(REWARD)
    out = root / "run"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
           "-m", "astrai.train", "--config", GRPO, "--model.path", str(model_dir), "--train.output_dir", str(out),
           "--max_steps", str(steps), "--rollout.max_new_tokens", "16", "--train.progress_bar", "false",
           "--data.truncation", "left", "--train.report_to", "none", "--runtime.num_threads", "1",
           "--runtime.deterministic", "true", "--grpo.group_size", "2", "--rollout.batch_size", "2",
           "--grpo.minibatch_size", "4", "--grpo.micro_batch_size", "2", "--optim.learning_rate", "1e-3",
           "--rollout.temperature", "2.0", "--checkpoint.save_steps", "2", *ON,
           "--reward.functions", json.dumps([{"function": "length", "path": str(root / "length.py")}]), *extra]
    import os

    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_two_ranks_run_partial_rollouts_and_resume_them_bitwise(stopping_model_dir, tmp_path):
    """2 processes: each rank carries its own groups in flight (saved per rank) and a resume on 2 processes
    continues them exactly: the metrics and weights equal an uninterrupted run's (the learning rate is constant,
    so stopping the first half at max_steps 2 changes nothing else)."""
    straight = run_two_ranks(stopping_model_dir, tmp_path / "straight", 4)
    assert sum(m["rollout/carried_samples"] for m in straight) > 0
    assert all(m["rollout/staleness_max"] <= 1 for m in straight)
    run_two_ranks(stopping_model_dir, tmp_path / "split", 2)
    saved = [torch.load(tmp_path / f"split/run/checkpoints/step-00000002/strategy_state{suffix}.pt", weights_only=True)
             for suffix in ("", "_rank00001")]
    assert all(state["partial_rollouts"]["groups"] for state in saved)  # both ranks had groups in flight
    resumed = run_two_ranks(stopping_model_dir, tmp_path / "split", 4, ["--checkpoint.resume", "auto"])
    assert_same_run(straight, resumed, tmp_path / "straight/run", tmp_path / "split/run", step=4)


def test_a_resume_on_fewer_ranks_drops_their_groups_in_flight_with_a_warning():
    """Resizing from 2 ranks to 1: rank 0 keeps its own state; rank 1's groups in flight cannot go anywhere, and
    the warning says how many are dropped."""
    from astrai.trainer.learners.policy_gradient import RolloutLearner

    states = [{"pending": [], "partial_rollouts": {"groups": [{"record": 0}]}},
              {"pending": [], "partial_rollouts": {"groups": [{"record": 1}, {"record": 2}]}}]
    learner = SimpleNamespace(state_dict=lambda: pytest.fail("rank 0 had a saved state"))
    with pytest.warns(UserWarning, match=r"the 2 group\(s\) in flight on the 1 rank\(s\) this job of 1 lacks are dropped"):
        assert RolloutLearner.resized_state(learner, states, 0, 1) is states[0]


def test_groups_in_flight_resumed_without_partial_rollouts_are_dropped_with_a_warning():
    """A fresh-user trial: a partial-rollout checkpoint resumed with rollout.partial false dropped its groups in
    flight without a word; the resume now says how many."""
    import types

    import pytest

    from astrai.experience.sources import OnlineExperience

    generator = torch.Generator()
    fake = types.SimpleNamespace(generator=generator, partial=None, data_sampler=None, one_step_off=False, _ahead=None)
    state = {"sampling_rng": generator.get_state(), "partial_rollouts": {"groups": [{"samples": []}] * 3}}
    with pytest.warns(UserWarning, match=r"^rollout.partial is false: the 3 group\(s\) in flight in the checkpoint "
                                         r"are dropped"):
        OnlineExperience.load_state_dict(fake, state)
