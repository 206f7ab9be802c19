"""Decode steps padded to batch buckets (`astrai.rollout.cuda_graphs`), run eagerly on CPU through the code a CUDA
graph records: the same tokens and log-probs as the unpadded engine (generate and streaming, rows finishing at
different steps so the bucket shrinks), the same logits and cache contents as an unpadded step with the padded rows
touching only the scratch block, the graph-shaped inputs (full-width block tables with stale entries) giving the
same logits, the buckets, the refusals (torch/flash-attn backends on CUDA, MoE) and the config field."""

from types import SimpleNamespace

import pytest
import torch

from astrai.config import load_config
from astrai.kernels import BackendUnavailableError, InferenceWorkspace, select_backend
from astrai.models import AutoRegressiveLM, tiny_config
from astrai.rollout.cuda_graphs import (DecodeGraphs, backend_for_graphs, check_cuda_graphs,
                                        cuda_graphs_unavailable_reason, decode_buckets)
from astrai.rollout.model_runner import PagedModelRunner, StepBatch
from astrai.rollout.paged_engine import PagedGenerationEngine
from astrai.rollout.sampling import SamplingParams

VOCAB, EOS = 32, 2
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [5, 6, 7, 8, 9, 10, 1]]
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return AutoRegressiveLM(tiny_config(vocab_size=VOCAB, eos_token_id=EOS, pad_token_id=EOS)).eval()


def engine_for(model, **kw):
    kw.setdefault("block_size", 4)
    return PagedGenerationEngine(model, pad_token_id=EOS, backend="torch", **kw)


def test_buckets_are_powers_of_two_up_to_max_num_seqs():
    assert decode_buckets(1) == (1,)
    assert decode_buckets(5) == (1, 2, 4, 8)
    assert decode_buckets(256)[-1] == 256 and len(decode_buckets(256)) == 9


@pytest.mark.parametrize("max_num_seqs", [5, 256])
def test_padded_decode_gives_the_unpadded_tokens_and_logprobs(model, max_num_seqs):
    """8 rows (4 prompts x 2 samples) with a stop token: rows finish at different steps, so decode steps run at
    several batch sizes, each padded to its bucket (max_num_seqs 5: batches of 5 padded to 8)."""
    params = SamplingParams(max_new_tokens=14, temperature=0.9, stop_token_ids=(EOS, 9))
    plain = engine_for(model, max_num_seqs=max_num_seqs, dense_decode=False)
    padded = engine_for(model, max_num_seqs=max_num_seqs, cuda_graphs=True)
    want = plain.generate(PROMPTS, params, torch.Generator().manual_seed(3), n=2)
    got = padded.generate(PROMPTS, params, torch.Generator().manual_seed(3), n=2)
    lengths = want.action_mask.sum(1).tolist()
    assert len(set(lengths)) > 1  # rows stop at different steps: the bucket changes during the call
    assert torch.equal(got.response_ids, want.response_ids) and torch.equal(got.action_mask, want.action_mask)
    assert torch.allclose(got.old_logprobs, want.old_logprobs, atol=1e-5)
    assert padded._graphs.replays > 0 and not padded._graphs.capture and not padded._graphs.graphs
    assert padded.workspace.num_blocks == padded.pool.num_blocks + 1  # the scratch block is outside the pool


def test_streamed_requests_decode_through_the_padded_path(model):
    def run(engine):
        ids = [engine.add_request(p, SamplingParams(max_new_tokens=6 + i, temperature=0.9), seed=i)
               for i, p in enumerate(PROMPTS)]
        tokens = {i: [] for i in ids}
        while engine.has_unfinished_requests:
            for out in engine.step():
                tokens[out.request_id].append((out.token_id, round(out.logprob, 4)))
        return tokens

    padded = engine_for(model, cuda_graphs=True)
    assert run(padded) == run(engine_for(model, dense_decode=False))
    assert padded._graphs.replays > 0


def _prefilled(model):
    """A runner over a fresh workspace (8 pool blocks of 4 + scratch block 8) holding three prefilled sequences,
    and the decode step that follows: (runner, decode StepBatch)."""
    engine_model = engine_for(model).model  # fused projections, eval, no grad
    workspace = InferenceWorkspace.for_model(engine_model.config, num_blocks=9, block_size=4, dtype=torch.float32,
                                             device=CPU)
    runner = PagedModelRunner(engine_model, workspace, select_backend("torch", CPU), dense_decode=False)
    prompts, tables = [PROMPTS[0], PROMPTS[1], PROMPTS[2]], [[0, 1], [2], [3, 4, 5]]
    slots = [tables[s][p // 4] * 4 + p % 4 for s, prompt in enumerate(prompts) for p in range(len(prompt))]
    indptr = [0, 6, 8, 19]
    runner.forward(StepBatch([t for p in prompts for t in p], [p for q in prompts for p in range(len(q))], slots,
                             indptr, [6, 2, 11], tables, [5, 7, 18], [0, 1, 2]))
    decode = StepBatch([13, 14, 15], [6, 2, 11], [1 * 4 + 2, 2 * 4 + 2, 5 * 4 + 3], [0, 1, 2, 3], [7, 3, 12],
                       tables, [0, 1, 2], [0, 1, 2])
    return runner, decode


def test_padded_rows_write_only_the_scratch_block_and_real_rows_match(model):
    runner, decode = _prefilled(model)
    ws = runner.workspace
    before = [t.clone() for t in ws.k_caches + ws.v_caches]
    want = runner.forward(decode).clone()
    expected = [t.clone() for t in ws.k_caches + ws.v_caches]
    for t, b in zip(ws.k_caches + ws.v_caches, before):
        t.copy_(b)
    graphs = DecodeGraphs(runner.model, ws, runner.backend, buckets=(1, 2, 4, 8), scratch_block=8, capture=False)
    padded = PagedModelRunner(runner.model, ws, runner.backend, graphs=graphs)
    assert graphs.serves(decode) and graphs.bucket(3) == 4
    got = padded.forward(decode)
    assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5)
    written = torch.zeros(9 * 4, dtype=torch.bool)
    written[decode.slots] = True
    for t, e, b in zip(ws.k_caches + ws.v_caches, expected, before):
        t, e, b = t.flatten(0, 1), e.flatten(0, 1), b.flatten(0, 1)  # (slots, Nkv, D)
        assert torch.equal(t[:32][~written[:32]], b[:32][~written[:32]])  # no other real slot changed
        assert torch.allclose(t[written], e[written], atol=1e-6)  # the step's own keys/values, as unpadded
        assert not torch.equal(t[32], b[32])  # the padded row wrote its key/value into the scratch block
    # The graph-shaped step (block tables at full width with stale entries past each row, lengths bounded by the
    # width, as captured) gives the same logits.
    graphs.tables[:4, 3:] = 7
    assert torch.allclose(graphs._step(4, graphs.width, graphs.width * 4)[:3], want, atol=1e-5)


def test_mixed_and_oversized_steps_are_not_served(model):
    runner, decode = _prefilled(model)
    graphs = DecodeGraphs(runner.model, runner.workspace, runner.backend, buckets=(1, 2), scratch_block=8,
                          capture=False)
    assert not graphs.serves(decode)  # 3 rows > the largest bucket
    mixed = StepBatch([1, 2, 3], [0, 1, 2], [32, 33, 34], [0, 3], [3], [[8]], [2], [0])
    assert not DecodeGraphs(runner.model, runner.workspace, runner.backend, buckets=(1, 2, 4), scratch_block=8,
                            capture=False).serves(mixed)


def test_refusals_name_the_field_and_auto_picks_triton_on_cuda(monkeypatch):
    config = tiny_config()
    cuda = torch.device("cuda")
    for name in ("torch", "flash_attn"):
        reason = cuda_graphs_unavailable_reason(cuda, name, config)
        assert reason.startswith("rollout.cuda_graphs needs the triton attention backend on CUDA")
        assert "\n" not in reason
        with pytest.raises(BackendUnavailableError, match="rollout.cuda_graphs"):
            check_cuda_graphs(cuda, name, config)
    assert cuda_graphs_unavailable_reason(cuda, "triton", config) is None
    assert cuda_graphs_unavailable_reason(CPU, "torch", config) is None  # CPU: the padded eager path
    moe = SimpleNamespace(num_local_experts=4)
    assert "mixture-of-experts" in cuda_graphs_unavailable_reason(CPU, "torch", moe)
    monkeypatch.delenv("ASTR_BACKEND", raising=False)
    assert backend_for_graphs(None, cuda) == backend_for_graphs("auto", cuda) == "triton"
    assert backend_for_graphs("torch", cuda) == "torch" and backend_for_graphs(None, CPU) is None
    monkeypatch.setenv("ASTR_BACKEND", "torch")
    assert backend_for_graphs(None, cuda) is None  # the environment's explicit choice stands (and is refused)


def test_engine_drops_its_graphs_with_the_kv_storage_and_the_config_field_reaches_it(model):
    params = SamplingParams(max_new_tokens=4, temperature=1.0)
    engine = engine_for(model, cuda_graphs=True)
    engine.generate(PROMPTS, params, torch.Generator().manual_seed(0))
    first = engine._graphs
    engine.generate(PROMPTS, params, torch.Generator().manual_seed(1))
    assert engine._graphs is first  # kept across calls
    engine.sleep()
    assert engine._graphs is None and not first.valid
    engine.wake()
    engine.generate(PROMPTS, params, torch.Generator().manual_seed(1))
    assert engine._graphs is not first and engine._graphs.valid

    from astrai.rollout.build import build_rollout_engine

    config = load_config(None, ["--rollout.cuda_graphs", "true"])
    assert config.rollout.cuda_graphs is True
    with pytest.warns(UserWarning, match="rollout.cuda_graphs: nothing is captured on cpu"):
        built = build_rollout_engine(config, model, SimpleNamespace(pad_token_id=EOS))
    assert built.cuda_graphs and not build_rollout_engine(load_config(None, []), model,
                                                          SimpleNamespace(pad_token_id=EOS)).cuda_graphs


def test_a_failed_capture_falls_back_to_the_padded_eager_step(model, caplog):
    """Capturing on CPU fails (no CUDA stream): the step still returns the right logits, eagerly, and says why."""
    runner, decode = _prefilled(model)
    want = PagedModelRunner(runner.model, runner.workspace, runner.backend, dense_decode=False)
    graphs = DecodeGraphs(runner.model, runner.workspace, runner.backend, buckets=(1, 2, 4), scratch_block=8,
                          capture=True)
    before = [t.clone() for t in runner.workspace.k_caches + runner.workspace.v_caches]
    expected = want.forward(decode).clone()
    for t, b in zip(runner.workspace.k_caches + runner.workspace.v_caches, before):
        t.copy_(b)
    with caplog.at_level("WARNING", logger="astrai.rollout"):
        got = graphs.forward(decode)
    assert torch.allclose(got, expected, atol=1e-5)
    assert not graphs.capture and graphs.capture_error and not graphs.graphs
    assert "rollout.cuda_graphs: capturing the decode step of batch 4 failed" in caplog.text
