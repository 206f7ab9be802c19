"""The paged engine's streaming API (add_request / step / abort) on a tiny random model: same samples as
`generate`, requests joining a running batch, aborts that free KV blocks at once, top log-probs against a naive
log-softmax, and refusal to mix with generate / load_weights while requests are live."""

import pytest
import torch

from astrai.models import AutoRegressiveLM, tiny_config
from astrai.rollout.paged_engine import PagedGenerationEngine
from astrai.rollout.sampling import SamplingParams

VOCAB, EOS = 32, 2
LONG, SHORT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [20, 21, 22]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return AutoRegressiveLM(tiny_config(vocab_size=VOCAB, eos_token_id=EOS, pad_token_id=EOS)).eval()


def engine_for(model, **kw):
    kw.setdefault("block_size", 4)
    kw.setdefault("max_kv_tokens", 512)
    return PagedGenerationEngine(model, pad_token_id=EOS, backend="torch", **kw)


def params(max_new_tokens, **kw):
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.9, **kw)


def base_seed(seed):
    """The base seed `generate` draws from `torch.Generator().manual_seed(seed)`."""
    return int(torch.randint(0, 2**62, (1,), generator=torch.Generator().manual_seed(seed)))


def drain(engine, outputs=None, limit=1000):
    """Step until nothing is live; {(request id, choice): [(token, logprob, top)]} of every output seen."""
    outputs = {} if outputs is None else outputs
    for _ in range(limit):
        if not engine.has_unfinished_requests:
            return outputs
        for out in engine.step():
            outputs.setdefault((out.request_id, out.choice), []).append((out.token_id, out.logprob, out.top_logprobs))
    raise AssertionError("requests did not finish")


def generated(engine, prompt, p, seed, n=1):
    gen = engine.generate([prompt], p, torch.Generator().manual_seed(seed), n=n)
    return [(gen.response_ids[r][gen.action_mask[r]].tolist(), gen.old_logprobs[r][gen.action_mask[r]].tolist())
            for r in range(n)]


def test_requests_joining_a_running_batch_sample_what_generate_samples(model):
    engine = engine_for(model)
    first = engine.add_request(LONG, params(14, stop_token_ids=(EOS,)), n=2, seed=base_seed(3))
    outputs = {}
    for _ in range(3):
        for out in engine.step():
            outputs.setdefault((out.request_id, out.choice), []).append((out.token_id, out.logprob, ()))
    second = engine.add_request(SHORT, params(6), seed=base_seed(4))
    drain(engine, outputs)
    reference = engine_for(model)
    for request, prompt, p, seed, n in ((first, LONG, params(14, stop_token_ids=(EOS,)), 3, 2),
                                        (second, SHORT, params(6), 4, 1)):
        for choice, (tokens, logprobs) in enumerate(generated(reference, prompt, p, seed, n)):
            got = outputs[(request, choice)]
            assert [t for t, _, _ in got] == tokens
            assert [lp for _, lp, _ in got] == pytest.approx(logprobs, abs=1e-6)
    assert engine.stream_stats()["running"] == 0


def test_choices_ending_in_the_same_step_all_report(model):
    engine = engine_for(model)
    request = engine.add_request(SHORT, params(4), n=3, seed=base_seed(5))  # no stop token: all end at step 4
    outputs = drain(engine)
    expected = generated(engine_for(model), SHORT, params(4), 5, n=3)
    assert [[t for t, _, _ in outputs[(request, c)]] for c in range(3)] == [tokens for tokens, _ in expected]
    assert not engine.has_unfinished_requests and held_blocks(engine) == 0


def test_a_short_request_finishes_while_a_long_one_runs(model):
    engine = engine_for(model)
    long_id = engine.add_request(LONG, params(60))
    for _ in range(5):
        engine.step()
    short_id = engine.add_request(SHORT, params(3))
    steps, short_tokens = 0, []
    while len(short_tokens) < 3:
        outs = engine.step()
        steps += 1
        short_tokens += [o for o in outs if o.request_id == short_id]
        assert any(o.request_id == long_id for o in outs)  # the long one decodes in the same steps
    assert steps == 3 and short_tokens[-1].done  # first token in the step after it was added
    assert engine.has_unfinished_requests and engine.stream_stats()["running"] == 1


def held_blocks(engine):
    pool, cache = engine.pool, engine.prefix_cache
    return pool.num_blocks - pool.num_free - cache.num_reclaimable


def test_abort_frees_the_blocks_before_the_next_step(model):
    engine = engine_for(model, max_batch_tokens=6, max_num_seqs=5)  # an 11-token prompt prefills over two steps
    running = engine.add_request(SHORT, params(40), n=2)
    for _ in range(4):
        engine.step()
    prefilling = engine.add_request(LONG, params(40), n=3)
    waiting = engine.add_request(LONG + [1], params(40))
    engine.step()  # LONG is half prefilled; the third request waits for a free sequence slot (2 + 3 of 5)
    held = held_blocks(engine)
    assert held > 0 and engine.stream_stats()["waiting"] == 1
    engine.abort(waiting)
    assert held_blocks(engine) == held and engine.stream_stats()["waiting"] == 0  # it held nothing
    engine.abort(prefilling)
    after_prefill_abort = held_blocks(engine)
    assert after_prefill_abort < held
    engine.abort(running)
    assert held_blocks(engine) == 0 and not engine.has_unfinished_requests
    assert engine.step() == [] and engine.stream_stats()["running"] == 0
    engine.abort(running)  # a finished or unknown id is ignored


def test_aborting_the_leader_during_prefill_keeps_the_other_choices(model):
    p, seed = params(8), base_seed(11)
    engine = engine_for(model, max_batch_tokens=6)
    request = engine.add_request(LONG, p, n=2, seed=seed)
    engine.step()
    engine.abort(request, choice=0)  # choice 0 leads the prefill that choice 1 shares
    outputs = drain(engine)
    assert set(outputs) == {(request, 1)}
    expected = generated(engine_for(model), LONG, p, 11, n=2)[1][0]
    assert [t for t, _, _ in outputs[(request, 1)]] == expected
    assert held_blocks(engine) == 0


def test_top_logprobs_are_the_most_likely_tokens_of_the_scaled_distribution(model):
    engine = engine_for(model)
    p = SamplingParams(max_new_tokens=5, temperature=0.7, top_k=4)
    request = engine.add_request(SHORT, p, top_logprobs=3, seed=1)
    outputs = drain(engine)[(request, 0)]
    prefix = list(SHORT)
    for token, logprob, top in outputs:
        with torch.no_grad():
            reference = torch.log_softmax(model(torch.tensor([prefix]))[0, -1] / 0.7, -1)
        values, ids = reference.topk(3)
        assert [t for t, _ in top] == ids.tolist()
        assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-5)
        assert logprob == pytest.approx(float(reference[token]), abs=1e-5)
        prefix.append(token)
    assert drain(engine) == {}


def test_the_sampled_tokens_logprob_is_exactly_its_top_logprobs_entry():
    """The sampled token's log-prob and its entry among the top log-probs are one computation (the same float32
    logsumexp of the row), not a log_softmax beside the sampler's own: equal exactly, greedy or sampled. A peaked
    tiny model (its head scaled up) is where two computations disagreed in the last bits."""
    torch.manual_seed(1)
    peaked = AutoRegressiveLM(tiny_config(vocab_size=VOCAB, eos_token_id=EOS, pad_token_id=EOS)).eval()
    with torch.no_grad():
        peaked.lm_head.weight.mul_(40)
    engine = engine_for(peaked)
    greedy = engine.add_request(LONG, SamplingParams(max_new_tokens=8, top_k=1), top_logprobs=2, seed=1)
    sampled = engine.add_request(SHORT, SamplingParams(max_new_tokens=8, temperature=0.7), n=3, top_logprobs=5,
                                 seed=2)
    outputs = drain(engine)
    compared = 0
    for (request, _), tokens in outputs.items():
        for token, logprob, top in tokens:
            if request == greedy:
                assert top[0][0] == token
            values = dict(top)
            if token in values:
                assert values[token] == logprob  # exactly, not approximately
                compared += 1
    assert set(r for r, _ in outputs) == {greedy, sampled} and compared >= 16


def test_streaming_and_generate_do_not_interleave(model):
    engine = engine_for(model)
    engine.add_request(SHORT, params(4))
    for call in (lambda: engine.generate([SHORT], params(2)), lambda: engine.load_weights(model.state_dict(), 1),
                 engine.sleep):
        with pytest.raises(RuntimeError, match="streamed request"):
            call()
    drain(engine)
    assert engine.generate([SHORT], params(2)).response_ids.shape[0] == 1
    request = engine.add_request(SHORT, params(2))
    assert set(drain(engine)) == {(request, 0)}


@pytest.mark.parametrize("kwargs, match", [
    ({"n": 0}, "n must be"), ({"top_logprobs": -1}, "top_logprobs"), ({"params": 3}, "SamplingParams"),
    ({"params": SamplingParams(max_new_tokens=254)}, "max_position_embeddings"),
    ({"prompt_ids": [VOCAB]}, "outside the vocabulary"),
    ({"params": SamplingParams(max_new_tokens=200), "n": 8}, "raise max_kv_tokens"),
])
def test_add_request_rejects_bad_input_by_name(model, kwargs, match):
    engine = engine_for(model, max_kv_tokens=256)
    args = {"prompt_ids": SHORT, "params": params(4), **kwargs}
    with pytest.raises(ValueError, match=match):
        engine.add_request(args.pop("prompt_ids"), args.pop("params"), **args)
    assert not engine.has_unfinished_requests


def test_requests_sharing_a_first_block_both_prefill_at_once(model):
    engine = engine_for(model)  # generate would let the second wait a step to reuse the first's block
    first = engine.add_request(LONG, params(3))
    second = engine.add_request(LONG[:8] + [30, 31], params(3))  # the same first two blocks of 4
    assert {o.request_id for o in engine.step()} == {first, second}
    drain(engine)
