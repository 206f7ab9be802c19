"""`rollout.placement: separate` (astrai.rollout.remote, docs/async.md): a generation process of its own per training
rank that only generates, weights streamed to it over a two-process gloo group after each update, and one-step-off
training that samples rollout k + 1 while rollout k trains. Tests: the remote engine against the colocated one
(exact), its errors, the staleness accounting by hand, the config refusals, and online_grpo / online_ppo jobs end to
end (1 trainer + 1 generation process): synchronous separate equals colocated bitwise, one step off lags by exactly one
rollout and resumes bitwise."""

import json
import os
import re
import signal
from pathlib import Path

import pytest
import torch

from astrai.config import ConfigError, load_config
from astrai.models import AutoRegressiveLM, tiny_config
from astrai.rollout.build import _generation_engine
from astrai.rollout.paged_engine import PagedGenerationEngine
from astrai.rollout.generation import Generation, concat_generations
from astrai.rollout.remote import GenerationPool, GenerationProcessDied, RemoteEngine, RemoteEngineError
from astrai.rollout.sampling import SamplingParams

REPO = Path(__file__).resolve().parents[1]
GRPO = str(REPO / "configs/examples/grpo.yaml")
PPO = str(REPO / "configs/examples/ppo.yaml")


# ----------------------------------------------------------------------------------------- the remote engine
def _paged(model):
    return PagedGenerationEngine(model, pad_token_id=0, max_kv_tokens=512)


def _build(config, pad_token_id, model):  # picklable: module level
    return PagedGenerationEngine(model, pad_token_id=pad_token_id, max_kv_tokens=512)


@pytest.fixture(scope="module")
def remote():
    torch.manual_seed(0)
    config = tiny_config()
    engine = RemoteEngine(AutoRegressiveLM, config, _functools_partial(_build, None, 0), threads=1)
    yield engine
    engine.close()


def _functools_partial(*args):
    import functools

    return functools.partial(*args)


def test_a_generation_process_equals_the_colocated_engine_on_the_same_weights_and_rng(remote):
    torch.manual_seed(1)
    model = AutoRegressiveLM(tiny_config()).eval()
    local = _paged(model)
    assert remote.policy_version == -1  # random weights until the first load
    assert remote.load_weights(dict(model.state_dict()), 3) == 3 and remote.policy_version == 3
    params = SamplingParams(max_new_tokens=12, temperature=1.0, stop_token_ids=(2,))
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(2):  # the RNG comes back advanced: two calls in a row agree too
            g_local, g_remote = (torch.Generator().manual_seed(7) for _ in range(2))
            for _ in range(2):
                a = local.generate(prompts, params, g_local, n=2)
                b = remote.generate(prompts, params, g_remote, n=2)
                for name in ("prompt_ids", "prompt_mask", "response_ids", "action_mask", "old_logprobs", "finished"):
                    assert torch.equal(getattr(a, name), getattr(b, name)), name
                assert b.policy_version == 3
                assert torch.equal(g_local.get_state(), g_remote.get_state())
    finally:
        torch.set_num_threads(threads)


def test_new_weights_streamed_one_tensor_at_a_time_reach_the_generation_process(remote):
    torch.manual_seed(2)
    model = AutoRegressiveLM(tiny_config()).eval()
    params = SamplingParams(max_new_tokens=6, temperature=1.0, stop_token_ids=(2,))
    remote.load_weights(((name, t.to(torch.bfloat16)) for name, t in model.state_dict().items()), 4)  # a stream
    bf16 = AutoRegressiveLM(tiny_config()).eval()
    bf16.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in model.state_dict().items()})
    torch.set_num_threads(1)
    want = _paged(bf16).generate([[5, 6]], params, torch.Generator().manual_seed(3))
    got = remote.generate([[5, 6]], params, torch.Generator().manual_seed(3))
    assert torch.equal(want.old_logprobs, got.old_logprobs) and got.policy_version == 4


def test_the_engines_refusals_come_back_as_the_same_one_line_errors(remote):
    params = SamplingParams(max_new_tokens=4, temperature=1.0, stop_token_ids=(2,))
    with pytest.raises(ValueError, match="vocab"):
        remote.generate([[10 ** 6]], params)
    with pytest.raises(ValueError, match="on_token"):
        remote.generate([[5]], params, on_token=lambda row, token: None)
    bad = {name: torch.zeros(1) for name in AutoRegressiveLM(tiny_config()).state_dict()}
    with pytest.raises(ValueError, match="shape"):
        remote.load_weights(bad, 9)
    assert remote.policy_version == -1  # refused mid-stream: no version held, the next sync reloads
    remote.load_weights(dict(AutoRegressiveLM(tiny_config()).state_dict()), 5)  # every broadcast was taken
    assert remote.generate([[5, 6]], params).policy_version == 5


def test_a_generation_sent_ahead_returns_later_and_a_discarded_one_leaves_the_rng(remote):
    params = SamplingParams(max_new_tokens=5, temperature=1.0, stop_token_ids=(2,))
    g = torch.Generator().manual_seed(11)
    before = g.get_state()
    request = remote.submit([[5, 6]], params, g)
    remote.discard(request)
    assert torch.equal(g.get_state(), before)
    first = remote.result(remote.submit([[5, 6]], params, g))
    g2 = torch.Generator().manual_seed(11)
    assert torch.equal(remote.generate([[5, 6]], params, g2).response_ids, first.response_ids)


def test_weights_loaded_while_a_generation_is_out_wait_for_it_and_leave_it_sampled_by_the_old_ones(remote):
    """An in-training evaluation syncs the engine while one-step-off training has the next rollout out: the
    load waits for that generation, which keeps the weights it was sent with; later requests see the new ones."""
    params = SamplingParams(max_new_tokens=6, temperature=1.0, stop_token_ids=(2,))
    old, new = (AutoRegressiveLM(tiny_config()).eval() for _ in range(2))
    remote.load_weights(dict(old.state_dict()), 20)
    g = torch.Generator().manual_seed(5)
    ahead = remote.submit([[5, 6], [7]], params, g)
    assert remote.load_weights(dict(new.state_dict()), 21) == 21
    got = remote.result(ahead)
    torch.set_num_threads(1)
    g_want = torch.Generator().manual_seed(5)
    want = _paged(old).generate([[5, 6], [7]], params, g_want)
    assert got.policy_version == 20 and torch.equal(got.old_logprobs, want.old_logprobs)
    assert torch.equal(g.get_state(), g_want.get_state())  # the RNG advanced when it was collected
    later = remote.generate([[5, 6], [7]], params, torch.Generator().manual_seed(5))
    assert later.policy_version == 21
    assert torch.equal(later.old_logprobs, _paged(new).generate([[5, 6], [7]], params,
                                                                torch.Generator().manual_seed(5)).old_logprobs)
    first, second = remote.submit([[5]], params), remote.submit([[6]], params)
    remote.result(second)  # answered in order: the first is kept for its own result
    assert remote.result(first).prompt_ids.tolist() == [[5]]
    with pytest.raises(RemoteEngineError, match="no generation"):
        remote.result(first)


def test_a_generation_process_that_dies_is_one_line_naming_its_exit_code():
    engine = RemoteEngine(AutoRegressiveLM, tiny_config(), _functools_partial(_build, None, 0), threads=1)
    os.kill(engine.process.pid, signal.SIGKILL)
    with pytest.raises(RemoteEngineError, match=r"died with exit code -9"):
        engine.generate([[5]], SamplingParams(max_new_tokens=2, stop_token_ids=(2,)))
    engine.close()


def test_a_dead_generation_process_is_restarted_in_place_with_no_weights_and_its_requests_forgotten():
    model = AutoRegressiveLM(tiny_config())
    engine = RemoteEngine(AutoRegressiveLM, tiny_config(), _functools_partial(_build, None, 0), threads=1)
    try:
        engine.load_weights(model.state_dict(), 3)
        params = SamplingParams(max_new_tokens=4, stop_token_ids=(2,))
        before = engine.generate([[5, 6]], params, torch.Generator().manual_seed(1))
        lost = engine.submit([[5, 6]], params, torch.Generator())
        first = engine.process.pid
        os.kill(first, signal.SIGKILL)
        with pytest.raises(GenerationProcessDied, match="died with exit code -9") as died:
            engine.result(lost)
        assert died.value.exit_code == -9
        engine.restart()
        assert engine.restarts == 1 and engine.process.pid != first and engine.policy_version == -1
        with pytest.raises(RemoteEngineError, match="no generation"):
            engine.result(lost)
        assert engine.load_weights(model.state_dict(), 3) == 3
        again = engine.generate([[5, 6]], params, torch.Generator().manual_seed(1))
        assert torch.equal(again.response_ids, before.response_ids)  # the same weights and RNG: the same sample
    finally:
        engine.close()
    assert not engine.process.is_alive()


def test_a_generation_process_killed_during_the_weight_broadcast_is_the_same_one_line():
    """A trial: kill -9 while the weights streamed surfaced as gloo's "Connection reset by peer" traceback (the
    process's sockets close before it has an exit code)."""
    import time

    engine = RemoteEngine(AutoRegressiveLM, tiny_config(), _functools_partial(_build, None, 0), threads=1)
    weights = list(AutoRegressiveLM(tiny_config()).state_dict().items())

    def stream():
        yield weights[0]
        os.kill(engine.process.pid, signal.SIGKILL)
        time.sleep(0.1)
        yield from weights[1:]

    with pytest.raises(RemoteEngineError, match=r"died with exit code -9 during the weight load"):
        engine.load_weights(stream(), 1)
    engine.close()
    del engine  # the weight group, aborted, is destroyed without waiting on the broadcast left pending (it hung)
    __import__("gc").collect()


def test_an_engine_the_generation_process_cannot_build_is_its_one_line_error():
    def_config = load_config(GRPO, ["--rollout.engine_options", json.dumps({"max_num_seqs": 0})])
    with pytest.raises(ValueError, match="max_num_seqs"):
        RemoteEngine(AutoRegressiveLM, tiny_config(), _functools_partial(_generation_engine, def_config, 0), threads=1)


# ------------------------------------------------------------------ several generation processes (a pool)
FIELDS = ("prompt_ids", "prompt_mask", "response_ids", "action_mask", "old_logprobs", "finished")


@pytest.fixture(scope="module")
def pool():
    engines = [RemoteEngine(AutoRegressiveLM, tiny_config(), _functools_partial(_build, None, 0), threads=1)
               for _ in range(2)]
    pool = GenerationPool(engines)
    yield pool
    pool.close()


def _by_shares(local, prompts, params, seed: int, parts: int = 2):
    """The naive reference of a pool's `generate`: the colocated engine on each contiguous share (sizes differing
    by at most one, larger first), share i with a generator seeded by the i-th int64 drawn from `seed`'s."""
    caller = torch.Generator().manual_seed(seed)
    seeds = torch.randint(0, 2 ** 63 - 1, (parts,), generator=caller).tolist()
    size, extra = divmod(len(prompts), parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + size + (i < extra)
        if stop > start:
            share = params[start:stop] if isinstance(params, list) else params
            out.append(local.generate(prompts[start:stop], share, torch.Generator().manual_seed(seeds[i])))
        start = stop
    return concat_generations(out, 0), caller


def test_a_pool_generates_each_share_in_its_own_process_as_the_colocated_engine_would(pool):
    torch.manual_seed(1)
    model = AutoRegressiveLM(tiny_config()).eval()
    local = _paged(model)
    assert pool.policy_version == -1
    assert pool.load_weights(dict(model.state_dict()), 3) == 3
    assert [e.policy_version for e in pool.engines] == [3, 3] and len({p.pid for p in pool.processes}) == 2
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14], [15, 16]]  # 3 + 2 rows: unequal widths to join
    params = [SamplingParams(max_new_tokens=k, temperature=1.0, stop_token_ids=(2,)) for k in (3, 9, 5, 12, 7)]
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(7)
    got = pool.generate(prompts, params, g)
    want, caller = _by_shares(local, prompts, params, 7)
    for name in FIELDS:
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert got.policy_version == 3 and torch.equal(g.get_state(), caller.get_state())
    assert got.response_ids.shape[1] == int(got.action_mask.sum(1).max())  # as wide as the longest answer
    one = pool.generate([[5, 6]], params[0], torch.Generator().manual_seed(8))  # fewer prompts than processes
    assert torch.equal(one.response_ids, _by_shares(local, [[5, 6]], params[0], 8)[0].response_ids)


def test_a_pool_streams_new_weights_to_every_process_and_refusals_leave_none_half_loaded(pool):
    params = SamplingParams(max_new_tokens=6, temperature=1.0, stop_token_ids=(2,))
    new = AutoRegressiveLM(tiny_config()).eval()
    assert pool.load_weights(iter(list(new.state_dict().items())), 4) == 4  # a stream, consumed once
    torch.set_num_threads(1)
    got = pool.generate([[5, 6], [7], [8, 9]], params, torch.Generator().manual_seed(3))
    want = _by_shares(_paged(new), [[5, 6], [7], [8, 9]], params, 3)[0]
    assert torch.equal(got.old_logprobs, want.old_logprobs) and got.policy_version == 4
    bad = {name: torch.zeros(1) for name in new.state_dict()}
    with pytest.raises(ValueError, match="shape"):
        pool.load_weights(bad, 9)
    assert pool.policy_version == -1 and [e.policy_version for e in pool.engines] == [-1, -1]
    assert pool.load_weights(dict(new.state_dict()), 5) == 5  # both took every broadcast: nothing left in a pipe
    assert pool.generate([[5], [6]], params).policy_version == 5


def test_a_pool_request_sent_ahead_is_kept_through_a_weight_load_and_a_discarded_one_is_gone(pool):
    params = SamplingParams(max_new_tokens=5, temperature=1.0, stop_token_ids=(2,))
    old, new = (AutoRegressiveLM(tiny_config()).eval() for _ in range(2))
    pool.load_weights(dict(old.state_dict()), 20)
    ahead = pool.submit([[5, 6], [7], [8]], params, torch.Generator().manual_seed(5))
    dropped = pool.submit([[9]], params)
    pool.discard(dropped)
    assert pool.load_weights(dict(new.state_dict()), 21) == 21
    got = pool.result(ahead)
    torch.set_num_threads(1)
    assert got.policy_version == 20
    assert torch.equal(got.old_logprobs, _by_shares(_paged(old), [[5, 6], [7], [8]], params, 5)[0].old_logprobs)
    for request in (ahead, dropped):
        with pytest.raises(RemoteEngineError, match="no generation"):
            pool.result(request)


def _killing(stream, process, after: int):
    """`stream`'s items, with `process` killed (SIGKILL) after the first `after`."""
    import time

    for i, item in enumerate(stream):
        if i == after:
            os.kill(process.pid, signal.SIGKILL)
            time.sleep(0.1)
        yield item


@pytest.mark.parametrize("during", ["a generation", "the weight load"])
def test_a_dead_process_of_a_pool_is_restarted_alone_and_the_pool_generates_as_before(during):
    model = AutoRegressiveLM(tiny_config())
    pool = GenerationPool([RemoteEngine(AutoRegressiveLM, tiny_config(), _functools_partial(_build, None, 0),
                                        threads=1) for _ in range(2)])
    try:
        pool.load_weights(model.state_dict(), 3)
        params = SamplingParams(max_new_tokens=4, stop_token_ids=(2,))
        before = pool.generate([[5, 6], [7]], params, torch.Generator().manual_seed(1))
        pids = [p.pid for p in pool.processes]
        if during == "a generation":
            lost = pool.submit([[5, 6], [7]], params, torch.Generator())
            os.kill(pids[1], signal.SIGKILL)
            with pytest.raises(GenerationProcessDied, match="died with exit code -9 during a generation"):
                pool.result(lost)
        else:
            with pytest.raises(GenerationProcessDied, match="died with exit code -9 during the weight load"):
                pool.load_weights(_killing(model.state_dict().items(), pool.processes[1], 2), 4)
        pool.restart()
        assert pool.restarts == 1 and pool.processes[0].pid == pids[0] and pool.processes[1].pid != pids[1]
        assert pool.policy_version == -1
        if during == "a generation":
            with pytest.raises(RemoteEngineError, match="no generation"):
                pool.result(lost)
        assert pool.load_weights(model.state_dict(), 3) == 3
        again = pool.generate([[5, 6], [7]], params, torch.Generator().manual_seed(1))
        assert torch.equal(again.response_ids, before.response_ids)  # the same weights and RNG: the same samples
    finally:
        pool.close()
    assert not any(p.is_alive() for p in pool.processes)


def test_concat_generations_pads_each_part_to_the_widest_and_refuses_mixed_versions():
    def part(prompt, response, version=1):
        return Generation(prompt_ids=torch.tensor([prompt]), prompt_mask=torch.ones(1, len(prompt), dtype=torch.bool),
                          response_ids=torch.tensor([response]), action_mask=torch.ones(1, len(response),
                                                                                        dtype=torch.bool),
                          old_logprobs=torch.full((1, len(response)), -0.5), finished=torch.tensor([True]),
                          policy_version=version)

    joined = concat_generations([part([5, 6], [7]), part([8], [9, 10, 11])], pad_token_id=0)
    assert joined.prompt_ids.tolist() == [[5, 6], [0, 8]] and joined.prompt_mask.tolist() == [[True, True],
                                                                                              [False, True]]
    assert joined.response_ids.tolist() == [[7, 0, 0], [9, 10, 11]]
    assert joined.action_mask.tolist() == [[True, False, False], [True, True, True]]
    assert joined.old_logprobs.tolist() == [[-0.5, 0.0, 0.0], [-0.5, -0.5, -0.5]]
    with pytest.raises(ValueError, match=r"policy versions \[1, 2\]"):
        concat_generations([part([5], [7]), part([5], [7], version=2)], 0)


# ------------------------------------------------------------------------------------------- end to end
REWARD = ("def length(prompts, completions, completion_ids, **kwargs):\n"
          "    return [len(i) / 6 for i in completion_ids]\n")
ONE_STEP_OFF = ["--rollout.placement", "separate", "--rollout.max_off_policy_steps", "1",
                "--rollout.correction", "token_tis"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny model with 41 stop ids: its random answers end at uneven lengths, so the length reward differs
    within groups and every step updates the weights."""
    from single_turn_reference import tiny_model

    path = tiny_model(tmp_path_factory.mktemp("tiny-separate"))
    config = json.loads((path / "config.json").read_text())
    config["eos_token_id"] = [2, *range(40, 80)]
    (path / "config.json").write_text(json.dumps(config))
    return path


def run_job(model_dir, root: Path, steps: int, extra=(), config=GRPO) -> list[dict]:
    """A tiny online job of `steps` optimizer steps (one per rollout: minibatch = B x G); its metrics rows."""
    from astrai.train import main

    root.mkdir(parents=True, exist_ok=True)
    (root / "length.py").write_text(REWARD)
    section = "grpo" if config == GRPO else "ppo"
    code = main(["--config", config, "--model.path", str(model_dir), "--train.output_dir", str(root / "run"),
                 "--max_steps", str(steps), "--rollout.max_new_tokens", "8", "--train.progress_bar", "false",
                 "--data.truncation", "left", "--train.report_to", "none", "--runtime.num_threads", "1",
                 "--runtime.deterministic", "true", f"--{section}.group_size", "2", "--rollout.batch_size", "2",
                 f"--{section}.minibatch_size", "4", f"--{section}.micro_batch_size", "2",
                 "--optim.learning_rate", "1e-3", "--rollout.temperature", "2.0",
                 "--reward.functions", json.dumps([{"function": "length", "path": str(root / "length.py")}]),
                 *extra])
    assert code == 0
    return [json.loads(line) for line in (root / "run/metrics.jsonl").read_text().splitlines()]


def same_run(rows_a, rows_b, out_a: Path, out_b: Path, step: int) -> None:
    from safetensors.torch import load_file

    volatile = ("time/", "memory/", "perf/")
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith(volatile)} for r in rows]  # noqa: E731
    assert strip(rows_b) == strip(rows_a)
    a, b = (load_file(str(out / f"run/checkpoints/step-{step:08d}/model.safetensors")) for out in (out_a, out_b))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_synchronous_separate_placement_equals_colocated_bitwise(model_dir, tmp_path):
    colocated = run_job(model_dir, tmp_path / "colocated", 3)
    separate = run_job(model_dir, tmp_path / "separate", 3,
                       ["--rollout.placement", "separate", "--rollout.generation_threads", "1"])
    same_run(colocated, separate, tmp_path / "colocated", tmp_path / "separate", 3)


# ------------------------------------------------------------------ one step off, by hand against a naive loop
def test_one_step_off_samples_rollout_k_with_the_weights_of_rollout_k_minus_1(remote):
    """Rollout 0 is generated with version 0 and trained at 0; rollout k >= 1 was sent ahead when rollout k - 1 was
    collected, so the weights of version k - 1 sampled it, and it is trained at version k (lag 1). The naive loop
    replays that schedule on a colocated engine with the same prompts and sampling RNG."""
    from toy_rl import RandomPrompts

    from astrai.experience.runner import RolloutRunner
    from astrai.experience.sources import OnlineExperience
    from astrai.rollout.engine import sync_weights

    weights = {}
    for version in range(4):
        torch.manual_seed(100 + version)
        weights[version] = dict(AutoRegressiveLM(tiny_config()).state_dict())
    params = SamplingParams(max_new_tokens=6, temperature=1.0, stop_token_ids=(2,))
    vocab = tiny_config().vocab_size

    def score(texts, records, ids):
        return torch.tensor([float(len(i)) for i in ids])

    runner = RolloutRunner(remote, params, decode=str, score_fn=score)
    source = OnlineExperience(sync_weights=lambda v: sync_weights(remote, lambda: weights[v].items(), v),
                              runner=runner, sampler=RandomPrompts(vocab, 5), batch_size=2, group_size=2, seed=9,
                              device=torch.device("cpu"), one_step_off=True, max_off_policy_steps=1)
    got = [source.collect(version) for version in range(4)]

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        local = _paged(AutoRegressiveLM(tiny_config()).eval())
        sampler, generator = RandomPrompts(vocab, 5), torch.Generator().manual_seed(9)
        for k, experience in enumerate(got):
            local.load_weights(weights[max(k - 1, 0)], max(k - 1, 0))
            records = sampler.next_batch(2)
            want = local.generate([r.prompt_ids for r in records for _ in range(2)], params, generator)
            assert torch.equal(experience.sequences.response_ids, want.response_ids)
            assert torch.equal(experience.old_logprobs, want.old_logprobs)
            sampled = experience.policy_versions[experience.sequences.action_mask]
            assert experience.policy_version == k and bool((sampled == max(k - 1, 0)).all())
            assert experience.stats["staleness_max"] == (0 if k == 0 else 1)
            assert experience.stats["staleness/lag_1"] == (0.0 if k == 0 else 1.0)
    finally:
        torch.set_num_threads(threads)
    source.load_state_dict({"sampling_rng": generator.get_state()})  # the batch sent ahead is discarded
    assert source._ahead is None
    remote.wake()  # the source leaves the engine asleep between its calls, as a colocated one
    assert remote.generate([[5, 6]], params).policy_version == 3  # and nothing of it is left in the pipe


@pytest.mark.parametrize("processes", [1, pytest.param(2, marks=pytest.mark.slow)])  # 2: 22 s
def test_online_grpo_one_step_off_lags_one_rollout_and_resumes_bitwise(model_dir, tmp_path, monkeypatch,
                                                                        processes):
    """With 2 generation processes as well: each samples half of every rollout (GenerationPool), and the run is as
    reproducible."""
    extra = ONE_STEP_OFF + ["--checkpoint.save_steps", "2", "--rollout.generation_processes", str(processes),
                            "--rollout.generation_threads", "1"]
    shares = []
    if processes > 1:
        real = GenerationPool.result
        monkeypatch.setattr(GenerationPool, "result", lambda self, request: shares.append(
            len(self._requests[request])) or real(self, request))
    whole = run_job(model_dir, tmp_path / "whole", 4, extra)
    # 5 rollouts (4 trained, the fifth sent ahead during step 4 and collected for the checkpoint), 2 shares each
    assert shares == ([] if processes == 1 else [2] * 5)
    trained = [m for m in whole if "policy/loss" in m]
    assert [m["rollout/staleness_max"] for m in trained] == [0, 1, 1, 1]
    assert [m["rollout/staleness/lag_1"] for m in trained] == [0, 1, 1, 1]
    assert [m["rollout/policy_version"] for m in trained] == [0, 1, 2, 3]
    # the first rollout's tokens come from the weights being trained; the later ones' from the step before
    assert trained[0]["rollout/mismatch_max_abs_diff"] < 1e-5 < trained[2]["rollout/mismatch_max_abs_diff"]
    assert all(m["time/generation_process_seconds"] > 0 for m in trained)
    # stopped after step 2 (the batch of step 3, generated ahead, is in the checkpoint), then resumed to step 4
    from astrai.trainer.loop import Trainer

    fit = Trainer.fit

    def stop_after_two(self):
        self.state.max_steps = 2
        return fit(self)

    monkeypatch.setattr(Trainer, "fit", stop_after_two)
    run_job(model_dir, tmp_path / "resumed", 4, extra)
    monkeypatch.undo()
    saved = torch.load(tmp_path / "resumed/run/checkpoints/step-00000002/strategy_state.pt", weights_only=True)
    assert saved["one_step_off"]["generation"]["policy_version"] == 1
    resumed = run_job(model_dir, tmp_path / "resumed", 4, extra + ["--checkpoint.resume", "auto"])
    same_run(whole, resumed, tmp_path / "whole", tmp_path / "resumed", 4)


def test_in_training_evaluation_one_step_off_scores_the_current_weights_and_leaves_training_as_it_was(
        model_dir, tmp_path):
    """train.eval_steps syncs the generation process's engine while the next rollout is out (it once raised "a
    generation is still in flight"): the evaluation runs, and every training metric and the weights equal the run
    without it."""
    plain = run_job(model_dir, tmp_path / "plain", 3, ONE_STEP_OFF)
    evaluated = run_job(model_dir, tmp_path / "evaluated", 3, ONE_STEP_OFF + [
        "--train.eval_steps", "1", "--data.eval_path", "builtin:arithmetic_test", "--data.eval_limit", "4",
        "--train.log_completions", "1"])
    logged = [json.loads(line) for line in (tmp_path / "evaluated/run/completions.jsonl").read_text().splitlines()]
    assert [(r["step"], r["policy_version"]) for r in logged] == [(1, 0), (2, 0), (3, 1)]  # who sampled it
    scores = [m for m in evaluated if "eval/accuracy" in m]
    assert [m["step"] for m in scores] == [1, 2, 3] and all(m["eval/num_questions"] == 4 for m in scores)
    trained = [{k: v for k, v in m.items() if not k.startswith("eval/")} for m in evaluated if "policy/loss" in m]
    assert [m["rollout/staleness_max"] for m in trained] == [0, 1, 1]
    same_run([m for m in plain if "policy/loss" in m], trained, tmp_path / "plain", tmp_path / "evaluated", 3)
    from astrai.evaluation.cli import main as evaluate  # the same answers as a standalone evaluation of the step

    run = tmp_path / "evaluated/run"
    assert evaluate(["--model", str(run / "checkpoints/step-00000003"), "--data", "builtin:arithmetic_test",
                     "--config", str(run / "config.yaml"), "--limit", "4", "--num_threads", "1", "--output_dir",
                     str(tmp_path / "standalone")]) == 0
    answers = lambda path: [json.loads(line)["responses"] for line in path.read_text().splitlines()]  # noqa: E731
    assert answers(run / "eval/step-00000003.jsonl") == answers(tmp_path / "standalone/results.jsonl")


def test_online_ppo_trains_one_step_off_in_a_generation_process(model_dir, tmp_path):
    rows = [m for m in run_job(model_dir, tmp_path, 2, ONE_STEP_OFF, config=PPO) if "policy/loss" in m]
    assert [m["rollout/staleness_max"] for m in rows] == [0, 1]
    assert all(torch.isfinite(torch.tensor(m["policy/loss"])) for m in rows)


def test_two_training_ranks_each_train_one_step_off_with_a_generation_process_of_their_own(model_dir, tmp_path):
    """torchrun, 2 training ranks (fsdp2 over gloo), each with its own generation process (4 processes): each rank
    gathers the full weights and streams them to its own; both lag one rollout and checkpoint their batch ahead."""
    import socket
    import subprocess
    import sys

    (tmp_path / "length.py").write_text(REWARD)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
           "-m", "astrai.train", "--config", GRPO, "--model.path", str(model_dir), "--train.output_dir",
           str(tmp_path / "run"), "--max_steps", "3", "--rollout.max_new_tokens", "8", "--train.progress_bar", "false",
           "--data.truncation", "left", "--train.report_to", "none", "--runtime.num_threads", "1",
           "--grpo.group_size", "2", "--rollout.batch_size", "2", "--grpo.minibatch_size", "4",
           "--grpo.micro_batch_size", "2", "--rollout.temperature", "2.0", "--distributed.strategy", "fsdp2",
           "--checkpoint.save_steps", "3", *ONE_STEP_OFF,
           "--reward.functions", json.dumps([{"function": "length", "path": str(tmp_path / "length.py")}])]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert [m["rollout/staleness_max"] for m in rows if "policy/loss" in m] == [0, 1, 1]
    for suffix in ("", "_rank00001"):
        saved = torch.load(tmp_path / f"run/checkpoints/step-00000003/strategy_state{suffix}.pt", weights_only=True)
        assert saved["one_step_off"]["generation"]["policy_version"] == 2


@pytest.mark.parametrize("extra, message", [
    (["--rollout.placement", "separate", "--rollout.max_off_policy_steps", "1"], "set rollout.correction"),
    (ONE_STEP_OFF + ["--grpo.minibatch_size", "4"], "below the 2 optimizer steps"),
    (ONE_STEP_OFF + ["--rollout.partial", "true"], "not supported yet with rollout.partial"),
    (ONE_STEP_OFF + ["--rollout.dynamic_sampling", "true"], "not supported yet with rollout.dynamic_sampling"),
    (ONE_STEP_OFF + ["--rollout.environment", "m:C"], "not supported yet with rollout.environment"),
    (ONE_STEP_OFF + ["--rollout.tensor_parallel_size", "2"], "tensor_parallel_size"),
    (ONE_STEP_OFF + ["--rollout.engine", "vllm"], "rollout.engine vllm"),
    (["--rollout.generation_threads", "1"], "placement is colocated"),
    (["--rollout.generation_processes", "2"], "generation_processes: 2 generation processes need rollout.placement"),
    (["--rollout.placement", "separate", "--rollout.generation_processes", "0"], "generation_processes"),
    (["--rollout.placement", "separate", "--rollout.generation_device", "gpu1"], "cpu or cuda:N"),
    (["--rollout.placement", "separate", "--train.type", "sft"], "samples none"),
    (["--rollout.max_off_policy_steps", "2"], "rollout.placement colocated"),
])
def test_config_refuses_what_separate_placement_does_not_support(extra, message):
    with pytest.raises(ConfigError, match=message):
        load_config(GRPO, extra)


def test_a_generation_device_that_is_not_there_is_one_line(monkeypatch):
    from astrai.rollout.build import generation_devices

    config = load_config(GRPO, ["--rollout.placement", "separate", "--rollout.generation_device", "cuda:7"])
    with pytest.raises(ValueError, match="rollout.generation_device: cuda:7 does not exist"):
        generation_devices(config, torch.device("cpu"))
    separate = ["--rollout.placement", "separate"]
    assert generation_devices(load_config(GRPO, separate), torch.device("cpu")) == [torch.device("cpu")]
    three = load_config(GRPO, separate + ["--rollout.generation_processes", "3"])
    assert generation_devices(three, torch.device("cpu")) == [torch.device("cpu")] * 3
    # on a node of 8 GPUs, 2 training ranks with 3 generation processes each: cuda:2-4 and cuda:5-7
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert [str(d) for d in generation_devices(three, torch.device("cuda:1"), 1, 2)] == ["cuda:5", "cuda:6", "cuda:7"]
    assert [str(d) for d in generation_devices(three, torch.device("cuda:0"), 0, 2)] == ["cuda:2", "cuda:3", "cuda:4"]
    with pytest.raises(ValueError, match=r"rollout.generation_device: cuda:6..cuda:8 does not exist \(8 CUDA"):
        generation_devices(load_config(GRPO, separate + ["--rollout.generation_processes", "3",
                                                         "--rollout.generation_device", "cuda:6"]),
                           torch.device("cuda:0"))


def test_a_batch_generated_ahead_resumed_without_one_step_off_is_dropped_with_a_warning():
    import types

    from astrai.experience.sources import OnlineExperience

    generator = torch.Generator()
    fake = types.SimpleNamespace(generator=generator, partial=None, data_sampler=None, one_step_off=False, _ahead=None)
    state = {"sampling_rng": generator.get_state(), "one_step_off": {"records": [4, 7], "generation": {}}}
    with pytest.warns(UserWarning, match=r"^rollout.placement: the batch of 2 prompt\(s\) generated ahead in the "
                                         r"checkpoint is dropped"):
        OnlineExperience.load_state_dict(fake, state)


def test_more_threads_than_cpus_is_one_line_for_every_thread_setting(model_dir, tmp_path, capsys):
    """A trial gave rollout.generation_threads 10000: the generation process started 10000 OpenMP threads on 2
    cores (load average 3470). Every thread setting is now refused above the CPUs the process may use, in one line
    (exit 2), before any process starts."""
    from astrai.config import load_config
    from astrai.evaluation.cli import UsageError, build_parser, check_options
    from astrai.runtime_env import usable_cpus
    from astrai.train import main
    from astrai.trainer.build import apply_runtime

    too_many = str(usable_cpus() + 1)
    for extra, field in ((["--runtime.num_threads", too_many], "runtime.num_threads"),
                         (["--rollout.placement", "separate", "--rollout.generation_threads", too_many],
                          "rollout.generation_threads")):
        code = main(["--config", GRPO, "--model.path", str(model_dir), "--train.output_dir", str(tmp_path / "out"),
                     "--max_steps", "1", "--train.progress_bar", "false", *extra])
        err = capsys.readouterr().err
        assert code == 2 and f"{field}: {too_many} threads, but this process may use {usable_cpus()} CPU(s)" in err
        assert "Traceback" not in err
    with pytest.raises(ValueError, match="runtime.num_threads"):
        apply_runtime(load_config(None, ["--runtime.num_threads", too_many]))
    with pytest.raises(UsageError, match="--num_threads"):
        check_options(build_parser().parse_args(["--model", str(model_dir), "--data", "builtin:arithmetic_test", "--num_threads",
                                  too_many]))


def test_a_generation_process_killed_mid_run_stops_the_job_in_one_line(model_dir, tmp_path, capsys, monkeypatch):
    """A trial: kill -9 of the generation process printed ~60 lines of traceback (exit 1). With no restart allowed
    (`rollout.generation_restarts 0`) the job now ends with one line naming the exit code
    (trainer.faults.GenerationProcessFault, exit code 1) and leaves no process."""
    from astrai.train import main

    collected, kill_at = [], [2]
    real_result = RemoteEngine.result

    def result(self, request):
        collected.append(request)
        if len(collected) == kill_at[0]:  # 2: the batch sent ahead during step 1, collected by step 2
            os.kill(self.process.pid, signal.SIGKILL)
        return real_result(self, request)

    monkeypatch.setattr(RemoteEngine, "result", result)
    (tmp_path / "length.py").write_text(REWARD)
    code = main(["--config", GRPO, "--model.path", str(model_dir), "--train.output_dir", str(tmp_path / "run"),
                 "--max_steps", "3", "--rollout.max_new_tokens", "8", "--train.progress_bar", "false",
                 "--data.truncation", "left", "--runtime.num_threads", "1", "--grpo.group_size", "2",
                 "--rollout.batch_size", "2", "--grpo.minibatch_size", "4", "--grpo.micro_batch_size", "2",
                 "--reward.functions", json.dumps([{"function": "length", "path": str(tmp_path / "length.py")}]),
                 "--rollout.generation_restarts", "0", *ONE_STEP_OFF])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err, err
    assert re.search(r"error: the generation process \(pid \d+\) died with exit code -9 during a generation; "
                     r"rollout.generation_restarts is 0: no checkpoint was written yet \(checkpoint.save_steps\), so a "
                     r"rerun starts over", err)
    # again, with a checkpoint after each step (each collects the batch ahead first), killed while step 2's is
    # written: the line names step 1's to resume from
    collected.clear()
    kill_at[0] = 3
    code = main(["--config", GRPO, "--model.path", str(model_dir), "--train.output_dir", str(tmp_path / "saved"),
                 "--max_steps", "3", "--rollout.max_new_tokens", "8", "--train.progress_bar", "false",
                 "--data.truncation", "left", "--runtime.num_threads", "1", "--grpo.group_size", "2",
                 "--rollout.batch_size", "2", "--grpo.minibatch_size", "4", "--grpo.micro_batch_size", "2",
                 "--reward.functions", json.dumps([{"function": "length", "path": str(tmp_path / "length.py")}]),
                 "--rollout.generation_restarts", "0", "--checkpoint.save_steps", "1", *ONE_STEP_OFF])
    err = capsys.readouterr().err
    step = tmp_path / "saved/checkpoints/step-00000001"
    assert code == 1 and f"rollout.generation_restarts is 0: resume from {step} (checkpoint.resume auto)" in err, err


def test_an_engine_setting_the_generation_process_cannot_honour_is_bad_input_as_colocated(model_dir, tmp_path,
                                                                                           capsys):
    """A trial: rollout.attention_backend triton on a CPU was one line and exit 2 colocated, but two tracebacks and
    exit 1 in a generation process. Both placements now say the same line with exit 2."""
    from astrai.train import main

    lines = []
    for placement in ("colocated", "separate"):
        code = main(["--config", GRPO, "--model.path", str(model_dir), "--train.output_dir",
                     str(tmp_path / placement), "--max_steps", "1", "--train.progress_bar", "false",
                     "--data.truncation", "left", "--rollout.attention_backend", "triton", "--rollout.placement",
                     placement])
        err = capsys.readouterr().err
        assert code == 2 and "Traceback" not in err, err
        lines.append(next(line for line in err.splitlines() if line.startswith("error:")))
    assert lines[0] == lines[1] and "triton" in lines[0]


def test_check_refuses_a_generation_device_that_is_not_there(model_dir, tmp_path, capsys):
    """A trial: `--check` passed rollout.generation_device cuda:7 on a machine without GPUs; the run refused it."""
    from astrai.train import main

    code = main(["--check", "--config", GRPO, "--model.path", str(model_dir), "--train.output_dir",
                 str(tmp_path / "out"), "--data.truncation", "left", "--rollout.placement", "separate",
                 "--rollout.generation_device", "cuda:7"])
    err = capsys.readouterr().err
    assert code == 2 and "rollout.generation_device: cuda:7 does not exist" in err and "Traceback" not in err


def test_more_generation_processes_than_cpus_or_samples_is_one_line_before_any_starts(model_dir, tmp_path, capsys):
    """A trial gave rollout.generation_processes 64 on 2 cores: --check passed and the run started 64 processes one
    after another (250 MB each) until memory ran short. Now refused, in --check and the run, in one line (exit 2);
    so are more processes than a rollout's samples (some would never generate)."""
    from astrai.runtime_env import usable_cpus
    from astrai.train import main

    cpus = usable_cpus()
    base = ["--config", GRPO, "--model.path", str(model_dir), "--train.output_dir", str(tmp_path / "out"),
            "--data.truncation", "left", "--rollout.placement", "separate", "--max_steps", "1",
            "--rollout.batch_size", "64", "--train.progress_bar", "false"]
    for check in (["--check"], []):
        code = main(check + base + ["--rollout.generation_processes", str(cpus + 1)])
        err = capsys.readouterr().err
        assert code == 2 and (f"rollout.generation_processes: {cpus + 1} generation processes x 1 thread(s) need "
                              f"{cpus + 1} CPUs, but this process may use {cpus}") in err, err
        assert "Traceback" not in err and not (tmp_path / "out/checkpoints").exists()
    code = main(["--check"] + base + ["--rollout.batch_size", "1", "--grpo.group_size", "2", "--grpo.minibatch_size",
                                      "2", "--grpo.micro_batch_size", "2", "--rollout.generation_processes", "3"])
    err = capsys.readouterr().err
    assert code == 2 and "rollout.generation_processes: 3 generation processes share each rollout's 1 x 2 = 2 " \
                         "samples per training rank, so some would never generate; expected at most 2" in err, err
    if cpus >= 2:
        code = main(["--check"] + base + ["--rollout.generation_processes", "2", "--rollout.generation_threads", "1"])
        out = capsys.readouterr().out
        assert code == 0 and "rollouts in 2 generation process(es) per rank" in out


def test_check_refuses_more_generation_threads_than_cpus_with_one_generation_process(model_dir, tmp_path, capsys):
    """A trial: `--check` passed rollout.generation_threads 64 with one generation process on 2 CPUs (it refused
    2 processes x 64); docs/async.md says thread counts above the CPUs are refused. Now one line, exit 2."""
    from astrai.runtime_env import usable_cpus
    from astrai.train import main

    cpus = usable_cpus()
    code = main(["--check", "--config", GRPO, "--model.path", str(model_dir), "--train.output_dir",
                 str(tmp_path / "out"), "--data.truncation", "left", "--rollout.placement", "separate",
                 "--rollout.max_off_policy_steps", "1", "--rollout.correction", "token_tis",
                 "--rollout.generation_threads", str(cpus + 1)])
    err = capsys.readouterr().err
    assert code == 2 and (f"rollout.generation_threads: {cpus + 1} threads, but this process may use {cpus} CPU(s); "
                          f"expected at most {cpus}") in err, err
    assert "Traceback" not in err
    code = main(["--check", "--config", GRPO, "--model.path", str(model_dir), "--train.output_dir",
                 str(tmp_path / "out"), "--data.truncation", "left", "--rollout.placement", "separate",
                 "--rollout.generation_threads", str(cpus)])
    assert code == 0, capsys.readouterr().err


def kill_at_second_generation(monkeypatch, method: str):
    """Kill the generation process (SIGKILL) when `RemoteEngine.<method>` is called the second time (before it
    runs: the call meets the death)."""
    calls = []
    real = getattr(RemoteEngine, method)

    def patched(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            os.kill(self.process.pid, signal.SIGKILL)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(RemoteEngine, method, patched)
    return calls


@pytest.mark.parametrize("method, during, processes", [("result", "a generation", 1),
                                                       ("load_weights", "the weight load", 1),
                                                       pytest.param("result", "a generation", 2,  # 15 s
                                                                    marks=pytest.mark.slow)])
def test_a_killed_synchronous_generation_process_is_restarted_and_the_run_is_unchanged(model_dir, tmp_path,
                                                                                      monkeypatch, method, during,
                                                                                      processes):
    """Synchronous separate placement: the generation process killed during the second rollout's generation (or
    its weight load: a process that died while the trainer trained is found there) is started again (one warning
    line), loads the same weights, and generates the same batch from the same RNG state: metrics and weights equal
    an undisturbed run's, bit for bit. With 2 generation processes (the second share's killed during the first
    rollout), the pool restarts that one alone."""
    separate = ["--rollout.placement", "separate", "--rollout.generation_threads", "1",
                "--rollout.generation_processes", str(processes)]
    straight = run_job(model_dir, tmp_path / "straight", 3, separate)
    kill_at_second_generation(monkeypatch, method)
    who = "the generation process" if processes == 1 else "generation process 2 of 2"
    with pytest.warns(UserWarning, match=rf"{who} \(pid \d+\) died with exit code -9 during {during}; started a "
                                         r"new one \(restart 1 of 2, rollout.generation_restarts\)"):
        killed = run_job(model_dir, tmp_path / "killed", 3, separate)
    same_run(straight, killed, tmp_path / "straight", tmp_path / "killed", 3)


def test_a_killed_one_step_off_generation_process_is_restarted_and_its_batch_sampled_again(model_dir, tmp_path,
                                                                                          monkeypatch):
    """One step off: killed while the batch sent ahead during step 1 was generating, the new process generates it
    again with the newest weights (that batch lags 0, the others 1 as ever), and the job trains its 3 steps."""
    kill_at_second_generation(monkeypatch, "result")
    with pytest.warns(UserWarning, match="restart 1 of 2"):
        rows = run_job(model_dir, tmp_path / "killed", 3, ONE_STEP_OFF)
    steps = [r for r in rows if "policy/loss" in r]
    assert len(steps) == 3 and [r["rollout/staleness_max"] for r in steps] == [0.0, 0.0, 1.0]


def test_generation_restarts_are_refused_where_the_weights_are_sharded_or_nothing_is_separate():
    with pytest.raises(ConfigError, match="rollout.generation_restarts: 1 needs the trained weights whole on every "
                                          "rank .* distributed.strategy fsdp2 shards them"):
        load_config(GRPO, ["--rollout.placement", "separate", "--rollout.generation_restarts", "1",
                           "--distributed.strategy", "fsdp2"])
    with pytest.raises(ConfigError, match="rollout.generation_restarts: sets the generation process"):
        load_config(GRPO, ["--rollout.generation_restarts", "1"])
    separate = load_config(GRPO, ["--rollout.placement", "separate"])
    assert separate.generation_restarts_under("ddp") == 2 and separate.generation_restarts_under("zero3") == 0
    assert load_config(GRPO, []).generation_restarts_under("ddp") == 0
    auto = load_config(GRPO, ["--rollout.placement", "separate", "--rollout.generation_restarts", "3"])
    with pytest.raises(ConfigError, match=r"distributed.strategy auto \(the launch's zero3\) shards them"):
        auto.generation_restarts_under("zero3")  # "auto" resolved at launch: both named


def test_a_batch_ahead_lost_while_a_checkpoint_waits_is_saved_as_lost_and_sent_again_after_the_resume():
    """The generation process dies while the checkpoint's state waits for the batch sent ahead: it is restarted
    (one warning), the batch is saved as lost (its records and RNG state, no generation), and the resumed source
    sends it again with the weights it collects at, from that RNG state: what a colocated engine samples with
    those weights and state."""
    import io

    from toy_rl import RandomPrompts

    from astrai.experience.runner import RolloutRunner
    from astrai.experience.sources import OnlineExperience
    from astrai.rollout.engine import sync_weights

    weights = {}
    for version in range(2):
        torch.manual_seed(200 + version)
        weights[version] = dict(AutoRegressiveLM(tiny_config()).state_dict())
    params = SamplingParams(max_new_tokens=6, temperature=1.0, stop_token_ids=(2,))
    vocab = tiny_config().vocab_size
    engine = RemoteEngine(AutoRegressiveLM, tiny_config(), _functools_partial(_build, None, 0), threads=1)

    records = RandomPrompts(vocab, 5).next_batch(8)

    class Prompts:  # a sampler over a dataset (a checkpoint saves records by their position in it)
        def __init__(self):
            self.dataset, self.at = records, 0

        def next_batch(self, n):
            self.at += n
            return self.dataset[self.at - n:self.at]

    def source_over(engine):
        runner = RolloutRunner(engine, params, decode=str, score_fn=lambda t, r, ids: torch.zeros(len(ids)))
        return OnlineExperience(sync_weights=lambda v: sync_weights(engine, lambda: weights[v].items(), v),
                                runner=runner, sampler=Prompts(), batch_size=2, group_size=2, seed=9,
                                device=torch.device("cpu"), one_step_off=True, max_off_policy_steps=1,
                                generation_restarts=2)

    try:
        source = source_over(engine)
        source.collect(0)  # rollout 0, and rollout 1 sent ahead with version 0
        os.kill(engine.process.pid, signal.SIGKILL)
        with pytest.warns(UserWarning, match="restart 1 of 2"):
            state = source.state_dict()
        assert state["one_step_off"]["generation"] is None and len(state["one_step_off"]["records"]) == 2
        buffer = io.BytesIO()
        torch.save(state, buffer)
        buffer.seek(0)
        state = torch.load(buffer, weights_only=True)
        resumed = source_over(engine)
        resumed.data_sampler.next_batch(4)  # the sampler's position, as the checkpoint's data state restores it
        resumed.load_state_dict(state)
        got = resumed.collect(1)  # the lost batch, sent again with version 1
    finally:
        engine.close()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        local = _paged(AutoRegressiveLM(tiny_config()).eval())
        local.load_weights(weights[1], 1)
        generator = torch.Generator()
        generator.set_state(state["one_step_off"]["generator_state"])
        want = local.generate([r.prompt_ids for r in records[2:4] for _ in range(2)], params, generator)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(got.sequences.response_ids, want.response_ids)
    assert got.stats["staleness_max"] == 0 and got.policy_version == 1
