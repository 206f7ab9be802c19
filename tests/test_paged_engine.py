"""Paged engine on a tiny random model: naive-loop parity, batching/sharing invariance, log-prob alignment,
weight updates, sleep/wake, block accounting, penalties."""

import pytest
import torch

from astrai.models import AutoRegressiveLM, tiny_config
from astrai.rollout.block_pool import BlockPool, PrefixCache
from astrai.rollout.paged_engine import PagedGenerationEngine
from astrai.rollout.sampling import SamplingParams
from astrai.rollout.row_sampling import FrequencyPenalty, RowSampling, request_seed, sample_rows
from astrai.forward import response_logprobs

VOCAB, EOS = 32, 2
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [5, 6, 7, 8, 9, 10, 1]]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return AutoRegressiveLM(tiny_config(vocab_size=VOCAB, eos_token_id=EOS, pad_token_id=EOS)).eval()


def engine_for(model, **kw):
    kw.setdefault("block_size", 4)
    return PagedGenerationEngine(model, pad_token_id=EOS, backend="torch", **kw)


def rows(gen):
    return [gen.response_ids[r][gen.action_mask[r]].tolist() for r in range(gen.response_ids.shape[0])]


def naive(model, prompts, params, seed, n=1, penalty=None):
    """No-cache reference: full forward per token, request i drawing from its own generator."""
    base = int(torch.randint(0, 2**62, (1,), generator=torch.Generator().manual_seed(seed)))
    out, lps = [], []
    for b, prompt in enumerate(prompts):
        for g in range(n):
            row = RowSampling(params, penalty, torch.Generator().manual_seed(request_seed(base, b * n + g)), [])
            lp = []
            for _ in range(params.max_new_tokens):
                with torch.no_grad():
                    logits = model(torch.tensor([prompt + row.generated]))[:, -1]
                tokens, logprobs = sample_rows(logits, [row])
                row.generated.append(tokens[0])
                lp.append(logprobs[0])
                if tokens[0] in params.stop_token_ids:
                    break
            out.append(row.generated)
            lps.append(lp)
    return out, lps


@pytest.mark.parametrize("top_k,top_p,penalty", [(1, 1.0, None), (0, 1.0, None), (5, 0.9, None),
                                                 (0, 1.0, FrequencyPenalty(0.7, window=4))])
def test_matches_naive_loop(model, top_k, top_p, penalty):
    params = SamplingParams(max_new_tokens=12, temperature=0.9, top_k=top_k, top_p=top_p, stop_token_ids=(EOS,))
    gen = engine_for(model).generate(PROMPTS, params, torch.Generator().manual_seed(3), n=2, penalties=penalty)
    toks, lps = naive(model, PROMPTS, params, 3, n=2, penalty=penalty)
    assert rows(gen) == toks
    for r, lp in enumerate(lps):
        torch.testing.assert_close(gen.old_logprobs[r][gen.action_mask[r]], torch.tensor(lp), atol=1e-5, rtol=0)


def test_batching_and_sharing_do_not_change_samples(model):
    params = SamplingParams(max_new_tokens=10, temperature=1.0, stop_token_ids=(EOS,))
    ref = engine_for(model, prefix_cache=False).generate(PROMPTS, params, torch.Generator().manual_seed(1), n=3)
    # identical prompts listed explicitly share blocks exactly like n=3
    repeated = [p for p in PROMPTS for _ in range(3)]
    shared = engine_for(model).generate(repeated, params, torch.Generator().manual_seed(1))
    assert rows(shared) == rows(ref)
    # tiny step budget and 2 live sequences: chunked prefill, requests joining/leaving every step
    tight = engine_for(model, max_batch_tokens=3, max_num_seqs=3)
    assert rows(tight.generate(PROMPTS, params, torch.Generator().manual_seed(1), n=3)) == rows(ref)
    # second call on a warm prefix cache (PROMPTS[0] and [3] share a 4-token block) gives the same rows
    warm = engine_for(model)
    warm.generate(PROMPTS, params, torch.Generator().manual_seed(9), n=3)
    assert len(warm.prefix_cache) > 0
    again = warm.generate(PROMPTS, params, torch.Generator().manual_seed(1), n=3)
    assert rows(again) == rows(ref) and warm.prefix_cache.hits > 0
    torch.testing.assert_close(again.old_logprobs, ref.old_logprobs, atol=1e-5, rtol=0)


def test_behaviour_logprobs_equal_trainer_recomputation(model):
    params = SamplingParams(max_new_tokens=16, temperature=0.6, stop_token_ids=(EOS,))
    engine = engine_for(model)
    gen = engine.generate(PROMPTS, params, torch.Generator().manual_seed(5), n=2)
    with torch.no_grad():
        logprobs, _ = response_logprobs(model, gen.sequences(), temperature=0.6)
    assert float((logprobs - gen.old_logprobs)[gen.action_mask].abs().max()) < 1e-5
    assert bool((gen.old_logprobs[~gen.action_mask] == 0).all())
    assert gen.prompt_ids.shape[0] == 8 and gen.policy_version == 0


def _gap(engine, policy, seed=0):
    gen = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, stop_token_ids=(EOS,)),
                          torch.Generator().manual_seed(seed))
    with torch.no_grad():
        logprobs, _ = response_logprobs(policy, gen.sequences(), temperature=1.0)
    return float((logprobs - gen.old_logprobs)[gen.action_mask].abs().max()), gen


def test_load_weights_sleep_wake_keep_gap_zero(model):
    engine = engine_for(model)
    _gap(engine, model)
    assert len(engine.prefix_cache) > 0
    trained = AutoRegressiveLM(model.config)
    trained.load_state_dict(model.state_dict())
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.05 * torch.randn_like(p))
    assert engine.load_weights(trained.state_dict(), policy_version=4) == 4
    assert len(engine.prefix_cache) == 0  # stale KV dropped
    gap, gen = _gap(engine, trained)
    assert gap < 1e-5 and gen.policy_version == 4
    engine.sleep()
    assert engine.workspace.nbytes == 0
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(PROMPTS, SamplingParams(max_new_tokens=2), None)
    engine.wake()
    assert _gap(engine, trained)[0] < 1e-5
    with pytest.raises(KeyError):
        engine.load_weights({"nope": torch.zeros(1)}, policy_version=5)
    assert engine.policy_version == 4


def test_blocks_are_returned_and_stop_tokens(model):
    engine = engine_for(model, prefix_cache=False)
    params = SamplingParams(max_new_tokens=6, stop_token_ids=(EOS, 7, 9))
    gen = engine.generate(PROMPTS * 2, params, torch.Generator().manual_seed(0), n=2)
    assert engine.pool.num_free == engine.pool.num_blocks
    for r, ids in enumerate(rows(gen)):
        stops = [i for i, t in enumerate(ids) if t in params.stop_token_ids]
        assert stops in ([], [len(ids) - 1]) and bool(gen.finished[r]) == bool(stops)
        assert stops or len(ids) == 6
        assert all(t == EOS for t in gen.response_ids[r][len(ids):].tolist())


def test_pool_too_small_raises_and_bad_arguments(model):
    engine = engine_for(model, max_kv_tokens=8)
    with pytest.raises(ValueError, match="max_kv_tokens"):
        engine.generate([[1] * 10], SamplingParams(max_new_tokens=4), None)
    with pytest.raises(ValueError):
        engine.generate([[1], []], SamplingParams(max_new_tokens=4), None)
    with pytest.raises(ValueError):
        engine.generate([[1]], SamplingParams(max_new_tokens=4), None, n=0)
    with pytest.raises(ValueError, match="max_position"):
        engine.generate([[1]], SamplingParams(max_new_tokens=10**6), None)


def test_frequency_penalty_blocks_repeats_in_window(model):
    params = SamplingParams(max_new_tokens=12, top_k=1)
    gen = engine_for(model).generate(PROMPTS, params, None, penalties=FrequencyPenalty(1e4, window=5))
    for ids in rows(gen):
        for i in range(len(ids)):
            assert ids[i] not in ids[max(0, i - 5):i]


def test_block_pool_and_prefix_cache():
    pool = BlockPool(4)
    a = pool.allocate()
    pool.incref(a)
    pool.decref(a)
    assert pool.num_free == 3 and pool.refcount[a] == 1
    cache = PrefixCache(pool, block_size=2)
    b = pool.allocate()
    cache.insert([1, 2, 3, 4, 5], [a, b], policy_version=1)
    assert cache.lookup([1, 2, 3, 4, 9], policy_version=2) == []  # other version: no reuse
    assert cache.lookup([1, 2, 3, 4], policy_version=1) == [a]  # keeps >= 1 token to compute
    pool.decref(a)
    pool.release_all([a, b])
    assert cache.evict(5) == 2 and pool.num_free == 4
    with pytest.raises(ValueError):
        pool.decref(a)


@pytest.mark.parametrize("vocab", [7, 1024, 2500, 49152])
def test_sample_rows_matches_full_inverse_cdf(vocab):
    """The two-level inverse CDF draws the token a full float64 cumulative sum picks for the same uniform, and the
    behaviour log-prob is log_softmax(logits / T) at that token; scratch buffers are reused across shapes."""
    from astrai.kernels import InferenceWorkspace

    scratch = InferenceWorkspace(num_layers=1, num_blocks=1, block_size=1, num_kv_heads=1, head_dim=1)
    torch.manual_seed(vocab)
    for trial, temperature in enumerate((1.0, 0.7)):
        logits = torch.randn(6, vocab) * 4
        logits[0, vocab // 2] = 30.0  # one nearly deterministic row
        params = SamplingParams(max_new_tokens=1, temperature=temperature)
        seeds = [100 * trial + r for r in range(6)]
        rows_ = [RowSampling(params, None, torch.Generator().manual_seed(s), []) for s in seeds]
        before = logits.clone()
        tokens, logprobs = sample_rows(logits, rows_, scratch=scratch)
        assert torch.equal(logits, before)
        reference = torch.log_softmax(logits.double() / temperature, dim=-1)
        for r, s in enumerate(seeds):
            u = float(torch.rand((), generator=torch.Generator().manual_seed(s)))
            cdf = reference[r].exp().cumsum(-1)
            expected = int(torch.searchsorted(cdf, u * float(cdf[-1]), right=True))
            assert tokens[r] == expected
            assert abs(logprobs[r] - float(reference[r, tokens[r]])) < 1e-5


def test_sample_rows_never_draws_truncated_tokens():
    """Top-k truncation zeroes the other tokens' mass; the two-level CDF never draws them (200 seeds)."""
    logits = torch.zeros(1, 3000)
    logits[0, :5] = 10.0
    params = SamplingParams(max_new_tokens=1, top_k=5)
    for seed in range(200):
        tokens, _ = sample_rows(logits, [RowSampling(params, None, torch.Generator().manual_seed(seed), [])])
        assert tokens[0] < 5


def test_fuse_projections_keeps_parameters_and_outputs(model):
    """Fused q/k/v and gate/up storage: same names, same values, same forward; in-place copies reach the fused
    tensors (what `load_weights` relies on)."""
    import copy

    from astrai.rollout.model_runner import fuse_projections

    fused = copy.deepcopy(model)
    fuse_projections(fused)
    fuse_projections(fused)  # idempotent
    assert list(dict(fused.named_parameters())) == list(dict(model.named_parameters()))
    for (name, a), b in zip(fused.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), name
    ids = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        torch.testing.assert_close(fused(ids), model(ids), atol=0, rtol=0)
    attn, mlp = fused.model.layers[0].self_attn, fused.model.layers[0].mlp
    with torch.no_grad():
        attn.k_proj.weight.copy_(torch.full_like(attn.k_proj.weight, 0.5))
        mlp.up_proj.weight.copy_(torch.full_like(mlp.up_proj.weight, -2.0))
    q_rows = attn.q_proj.weight.shape[0]
    assert torch.all(attn.qkv_weight[q_rows:q_rows + attn.k_proj.weight.shape[0]] == 0.5)
    assert torch.all(mlp.gate_up_weight[mlp.gate_proj.weight.shape[0]:] == -2.0)


@pytest.mark.parametrize("budget", [{}, {"max_batch_tokens": 3, "max_num_seqs": 3}, {"dtype": "bfloat16"}])
def test_dense_decode_cache_gives_same_samples(model, budget):
    """The torch backend's dense decode cache changes nothing: same tokens and log-probs as gathering the blocks
    every step, with rows stopping early (EOS) and, under a tight budget, prefill chunks mixed into decode steps;
    in bfloat16 too (where a softmax in bf16 would have flipped tokens). In bfloat16 the dense path attends in
    float32 over the bf16 values (the CPU kernel, or float32 copies) where the gathering path's SDPA multiplies
    bf16 probabilities by bf16 values: the same tokens, log-probs within bf16 rounding (2e-3 measured)."""
    params = SamplingParams(max_new_tokens=14, temperature=1.0, stop_token_ids=(EOS,))
    on = engine_for(model, **budget)
    off = engine_for(model, dense_decode=False, **budget)
    a = on.generate(PROMPTS, params, torch.Generator().manual_seed(5), n=3)
    b = off.generate(PROMPTS, params, torch.Generator().manual_seed(5), n=3)
    assert rows(a) == rows(b)
    assert len({len(r) for r in rows(a)}) > 1  # rows of different lengths: the row set changed mid-call
    tolerance = 1e-2 if budget.get("dtype") == "bfloat16" else 1e-6
    torch.testing.assert_close(a.old_logprobs, b.old_logprobs, atol=tolerance, rtol=0)
    assert on.last_stats["dense_decode_rebuilds"] > 0 and off.last_stats["dense_decode_rebuilds"] == 0


def test_shared_first_block_is_computed_once_within_a_call(model):
    """Prompts opening with the same block (a shared system prompt): the first one prefills it, the others wait
    one step and reuse it from the prefix cache; the samples equal those of an engine without sharing."""
    system = [3, 4, 5, 6]  # one full block at block_size 4
    prompts = [system + [7 + i, 8, 9 + i] for i in range(4)] + [[11, 12]]
    params = SamplingParams(max_new_tokens=8, temperature=1.0, stop_token_ids=(EOS,))
    shared = engine_for(model)
    gen = shared.generate(prompts, params, torch.Generator().manual_seed(4), n=2)
    plain = engine_for(model, prefix_cache=False).generate(prompts, params, torch.Generator().manual_seed(4), n=2)
    assert rows(gen) == rows(plain)
    torch.testing.assert_close(gen.old_logprobs, plain.old_logprobs, atol=1e-5, rtol=0)
    assert shared.prefix_cache.hits == 3  # prompts 2..4 each reused the one system block
    assert shared.last_stats["prefix_cache_hits"] == 3


def test_bad_load_weights_changes_nothing(model):
    """A wrongly shaped (or broadcastable) tensor is rejected by name before anything is copied: weights,
    policy_version and prefix cache stay as they were and generation is unchanged."""
    engine = engine_for(model)
    params = SamplingParams(max_new_tokens=4, top_k=1)
    before = rows(engine.generate(PROMPTS, params, None))
    entries = len(engine.prefix_cache)
    other = AutoRegressiveLM(model.config)
    for bad_name, bad in (("lm_head.weight", torch.zeros(3, 3)),
                          ("model.layers.0.input_layernorm.weight", torch.tensor(5.0)),
                          ("model.norm.weight", torch.ones(model.config.hidden_size, dtype=torch.long))):
        state = dict(other.state_dict())
        state[bad_name] = bad
        with pytest.raises(ValueError, match=bad_name.replace(".", r"\.")):
            engine.load_weights(state, policy_version=7)
        assert engine.policy_version == 0 and len(engine.prefix_cache) == entries
        assert rows(engine.generate(PROMPTS, params, None)) == before


@pytest.mark.parametrize("kwargs,prompts,match", [
    ({}, [], "no prompts"),
    ({}, torch.tensor([[5, 6]]), "list of token-id lists"),
    ({}, [5, 6], "prompt 0 must be a list"),
    ({}, [[5, VOCAB]], rf"prompt 0 token 1: id {VOCAB} is outside the vocabulary \[0, {VOCAB}\)"),
    ({}, [[5], [-1]], "prompt 1 token 0: id -1 is outside"),
    ({}, [[5, 6.7]], "prompt 0 token 1: expected an integer token id, got 6.7"),
    ({"n": 2.5}, [[5]], "n must be an integer >= 1"),
    ({"n": 5}, [[5]], "5 samples of one prompt exceed max_num_seqs 4"),
    ({"params": None}, [[5]], "params must be a SamplingParams"),
])
def test_generate_rejects_bad_input_by_name(model, kwargs, prompts, match):
    engine = engine_for(model, max_num_seqs=4)
    args = {"params": SamplingParams(max_new_tokens=2), **kwargs}
    params = args.pop("params")
    with pytest.raises(ValueError, match=match):
        engine.generate(prompts, params, None, **args)


@pytest.mark.parametrize("kwargs,match", [({"max_batch_tokens": 0}, "max_batch_tokens must be a positive"),
                                          ({"block_size": 0}, "block_size must be a positive"),
                                          ({"max_num_seqs": -1}, "max_num_seqs must be a positive"),
                                          ({"block_size": 16, "max_kv_tokens": 4}, "below one block")])
def test_engine_rejects_bad_sizes(model, kwargs, match):
    kwargs.setdefault("block_size", 4)
    with pytest.raises(ValueError, match=match):
        PagedGenerationEngine(model, pad_token_id=EOS, backend="torch", **kwargs)


@pytest.mark.parametrize("kwargs,match", [({"max_new_tokens": 2.5}, "max_new_tokens: expected an integer"),
                                          ({"temperature": 1e-300}, "temperature: expected a finite number"),
                                          ({"temperature": float("nan")}, "temperature"),
                                          ({"top_k": 2.5}, "top_k: expected an integer"),
                                          ({"stop_token_ids": 2}, "stop_token_ids: expected a tuple")])
def test_sampling_params_reject_bad_types(kwargs, match):
    kwargs.setdefault("max_new_tokens", 3)
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)
    assert SamplingParams(max_new_tokens=2, stop_token_ids=[2, 3]).stop_token_ids == (2, 3)


def test_non_finite_logits_raise_instead_of_nan_logprobs(model):
    broken = AutoRegressiveLM(model.config)
    broken.load_state_dict(model.state_dict())
    with torch.no_grad():
        broken.model.norm.weight.fill_(float("nan"))
    with pytest.raises(FloatingPointError, match="row 0 has non-finite logits"):
        engine_for(broken).generate([[5, 6]], SamplingParams(max_new_tokens=2), None)
