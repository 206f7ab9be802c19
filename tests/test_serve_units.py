"""Server pieces without a server: incremental detokenization with stop strings, the OpenAI -> engine sampling
mapping, and the batcher (one engine call for concurrent jobs, a failing job isolated, seeds reproducible)."""

import asyncio

import pytest
import torch

from astrai.models import tiny_tokenizer
from astrai.rollout.generation import Generation
from astrai.rollout.sampling import SamplingParams
from astrai.serve.batcher import Batcher, Job
from astrai.serve.detokenize import TextStream
from astrai.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    sampling_for,
    stop_strings,
)


class CharTokenizer:
    """Token id = a character's code point; id 0 is a special (stop) token."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if i)


def push_all(stream, text):
    return [stream.push(ord(c)) for c in text]


def test_text_stream_holds_back_possible_stop_strings():
    stream = TextStream(CharTokenizer(), stop=("END", "xy"), max_tokens=100)
    deltas = push_all(stream, "abEN")
    assert deltas == ["a", "b", "", ""] and stream.text == "ab"  # "EN" may start "END"
    assert stream.push(ord("x")) == "EN"  # "ENx" cannot start a stop any more, but "x" may start "xy"
    assert stream.push(ord("z")) == "xz"
    assert push_all(stream, "qEND") == ["q", "", "", ""]
    assert stream.finish_reason == "stop" and stream.text == "abENxzq"
    assert stream.push(ord("k")) == "" and stream.num_tokens == 10  # tokens after the end are ignored


def test_text_stream_stop_token_and_length():
    stream = TextStream(CharTokenizer(), stop_token_ids=(0,), max_tokens=10)
    assert push_all(stream, "hi") == ["h", "i"] and stream.push(0) == ""
    assert stream.finish_reason == "stop" and stream.text == "hi" and stream.num_tokens == 3
    stream = TextStream(CharTokenizer(), stop=("zzz",), max_tokens=3)
    assert push_all(stream, "azz") == ["a", "", "zz"]  # the budget ends it: held-back text is sent
    assert stream.finish_reason == "length" and stream.text == "azz"
    stream = TextStream(CharTokenizer(), max_tokens=5)
    push_all(stream, "ab")
    assert stream.finish(finished=False) == "" and stream.finish_reason == "length"


def test_text_stream_waits_for_whole_utf8_characters():
    tok = tiny_tokenizer()
    ids = tok.encode("é!")  # byte-level BPE: "é" is two byte tokens
    assert len(ids) == 3
    stream = TextStream(tok, max_tokens=10)
    assert [stream.push(i) for i in ids] == ["", "é", "!"]


def test_sampling_mapping_follows_openai_semantics():
    req = CompletionRequest(model="m", prompt="x")
    params, penalty = sampling_for(req, max_new_tokens=7, stop_token_ids=(2,))
    assert params == SamplingParams(max_new_tokens=7, temperature=1.0, top_k=0, top_p=1.0, stop_token_ids=(2,))
    assert penalty is None and req.max_tokens == 16  # OpenAI's completions default
    for greedy in ({"temperature": 0}, {"top_p": 0}, {"temperature": 1e-6}):
        params, _ = sampling_for(CompletionRequest(model="m", prompt="x", **greedy), max_new_tokens=3,
                                 stop_token_ids=())
        assert params.top_k == 1 and params.temperature == 1.0
    params, penalty = sampling_for(ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "q"}],
                                                         temperature=0.7, top_p=0.9, frequency_penalty=0.5),
                                   max_new_tokens=3, stop_token_ids=())
    assert (params.temperature, params.top_p, params.top_k, penalty.penalty) == (0.7, 0.9, 0, 0.5)
    with pytest.raises(APIError, match="frequency_penalty"):
        sampling_for(CompletionRequest(model="m", prompt="x", frequency_penalty=-1), max_new_tokens=3,
                     stop_token_ids=())
    assert stop_strings("###") == ("###",) and stop_strings(None) == ()
    with pytest.raises(APIError) as info:
        stop_strings(["a", ""])
    assert info.value.body()["error"]["param"] == "stop"


class FakeEngine:
    """Records each generate call; row r answers [prompt[0] + r, stop]; a prompt starting with 999 fails."""

    def __init__(self):
        self.calls = []

    def generate(self, prompts, params, generator, *, n=1, penalties=None, on_token=None):
        self.calls.append((list(prompts), int(torch.randint(0, 2**31, (1,), generator=generator))))
        if any(p[0] == 999 for p in prompts):
            raise ValueError("bad prompt 999")
        rows = [[p[0] + r, 0] for r, p in enumerate(prompts)]
        for r, row in enumerate(rows):
            for token in row:
                if on_token is not None:
                    on_token(r, token)
        ids = torch.tensor(rows)
        return Generation(prompt_ids=ids, prompt_mask=torch.ones_like(ids, dtype=torch.bool), response_ids=ids,
                          action_mask=torch.ones_like(ids, dtype=torch.bool), old_logprobs=torch.zeros(ids.shape),
                          finished=torch.ones(len(rows), dtype=torch.bool), policy_version=0)


def run_jobs(jobs, engine, max_batch=8):
    async def main():
        batcher = Batcher(engine, max_batch=max_batch, window_s=0.05)
        await batcher.start()
        results = await asyncio.gather(*(batcher.submit(job) for job in jobs), return_exceptions=True)
        await batcher.stop()
        return results, batcher.stats

    return asyncio.run(main())


def params():
    return SamplingParams(max_new_tokens=4, stop_token_ids=(0,))


def test_batcher_one_engine_call_for_concurrent_jobs_and_streams_tokens():
    engine, streamed = FakeEngine(), []
    jobs = [Job([10], params(), n=2, on_token=lambda c, t: streamed.append((c, t))), Job([20], params())]
    results, stats = run_jobs(jobs, engine)
    assert len(engine.calls) == 1 and engine.calls[0][0] == [[10], [10], [20]]
    assert [[s.token_ids for s in r] for r in results] == [[[10, 0], [11, 0]], [[22, 0]]]
    assert streamed == [(0, 10), (0, 0), (1, 11), (1, 0)]  # only the streaming job's choices
    assert stats == {"requests": 2, "engine_calls": 1, "rows": 3}


def test_batcher_isolates_a_failing_job_and_respects_max_batch():
    engine = FakeEngine()
    results, _ = run_jobs([Job([1], params()), Job([999], params()), Job([3], params())], engine)
    assert isinstance(results[1], ValueError) and "999" in str(results[1])
    assert [s.token_ids for s in results[0]] == [[1, 0]] and [s.token_ids for s in results[2]] == [[3, 0]]
    assert [len(c[0]) for c in engine.calls] == [3, 1, 1, 1]  # the batch, then one by one
    engine = FakeEngine()
    run_jobs([Job([1], params(), n=3), Job([2], params(), n=3)], engine, max_batch=4)
    assert [len(c[0]) for c in engine.calls] == [3, 3]  # 6 rows do not fit in one call of 4


def test_batcher_seeded_jobs_run_alone_and_reproducibly():
    engine = FakeEngine()
    run_jobs([Job([1], params(), seed=5), Job([2], params()), Job([3], params(), seed=5)], engine)
    assert sorted(len(c[0]) for c in engine.calls) == [1, 1, 1]
    seeded = [draw for prompts, draw in engine.calls if prompts[0][0] in (1, 3)]
    assert seeded[0] == seeded[1]  # the same seed gives the engine the same generator state
