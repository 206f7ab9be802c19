"""Server pieces without a server: incremental detokenization with stop strings, the OpenAI -> engine sampling
mapping, token bytes and log-prob shapes, and the engine loop over a tiny paged engine (jobs joining between steps,
aborts applied before the next step, a failing request or step isolated)."""

import asyncio

import pytest
import torch

from astrai.models import AutoRegressiveLM, tiny_config, tiny_tokenizer
from astrai.rollout.paged_engine import PagedGenerationEngine
from astrai.rollout.sampling import SamplingParams
from astrai.serve.detokenize import TextStream
from astrai.serve.engine_loop import EngineLoop, Job
from astrai.serve.logprobs import TokenText, chat_logprobs, completion_logprobs
from astrai.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    check_text,
    logprobs_k,
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
    params, _ = sampling_for(CompletionRequest(model="m", prompt="x", ignore_eos=True), max_new_tokens=3,
                             stop_token_ids=(2,))
    assert params.stop_token_ids == ()
    assert stop_strings("###") == ("###",) and stop_strings(None) == ()
    with pytest.raises(APIError) as info:
        stop_strings(["a", ""])
    assert info.value.body()["error"]["param"] == "stop"


def test_top_k_is_honoured_and_unknown_options_are_named():
    from astrai.serve.protocol import ChatCompletionRequest, sampling_for

    def request(**extra):
        return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], **extra)

    assert sampling_for(request(top_k=5), max_new_tokens=3, stop_token_ids=(2,))[0].top_k == 5  # vLLM's extension
    assert sampling_for(request(top_k=-1), max_new_tokens=3, stop_token_ids=(2,))[0].top_k == 0  # -1: off
    assert request(response_format={"type": "text"}, metadata={"a": "b"}).unsupported() == []
    assert request(response_format={"type": "json_schema"}, min_p=0.1).unsupported() == ["response_format", "min_p"]


def test_lone_surrogates_and_logprobs_options_are_named():
    with pytest.raises(APIError) as info:
        check_text("ok \ud800", "messages.[0].content")
    assert info.value.body()["error"]["param"] == "messages.[0].content" and "U+D800" in info.value.message
    assert check_text("é 😀", "prompt") == "é 😀"
    chat = lambda **kw: ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "q"}], **kw)  # noqa
    assert logprobs_k(chat()) is None and logprobs_k(chat(logprobs=True)) == 0
    assert logprobs_k(chat(logprobs=True, top_logprobs=4)) == 4
    with pytest.raises(APIError, match="requires logprobs"):
        logprobs_k(chat(top_logprobs=2))
    assert logprobs_k(CompletionRequest(model="m", prompt="x", logprobs=0)) == 0


def test_token_text_gives_exact_bytes_and_openai_spellings():
    tok = tiny_tokenizer()
    text_of = TokenText(tok)
    ids = tok.encode("é!")  # two byte tokens for "é", then "!"
    assert b"".join(text_of(i)[1] for i in ids) == "é!".encode()
    assert text_of(ids[0])[0] == "bytes:\\xc3" and text_of(ids[2]) == ("!", b"!")
    assert text_of(tok.eos_token_id) == ("<|im_end|>", b"<|im_end|>")
    space = tok.encode(" a")
    assert "".join(text_of(i)[0] for i in space) == " a"
    entries = [(ids[2], -0.5, [(ids[2], -0.5), (space[0], -1.5)])]
    chat = chat_logprobs(text_of, entries)
    assert chat == {"content": [{"token": "!", "logprob": -0.5, "bytes": [33], "top_logprobs": [
        {"token": "!", "logprob": -0.5, "bytes": [33]},
        {"token": text_of(space[0])[0], "logprob": -1.5, "bytes": list(text_of(space[0])[1])}]}], "refusal": None}
    block, offset = completion_logprobs(text_of, entries * 2, offset=3)
    assert block["tokens"] == ["!", "!"] and block["text_offset"] == [3, 4] and offset == 5
    assert block["top_logprobs"][0] == {"!": -0.5, text_of(space[0])[0]: -1.5}


@pytest.fixture(scope="module")
def engine():
    torch.manual_seed(0)
    model = AutoRegressiveLM(tiny_config(vocab_size=32, eos_token_id=2, pad_token_id=2)).eval()
    return PagedGenerationEngine(model, pad_token_id=2, backend="torch", block_size=4, max_kv_tokens=1024,
                                 max_num_seqs=8)


def with_loop(engine, body):
    async def main():
        loop = EngineLoop(engine)
        await loop.start()
        try:
            return await body(loop)
        finally:
            await loop.stop()

    return asyncio.run(main())


async def collect(queue, count):
    """`count` items from an output queue: {tag: [outputs or exception]}."""
    items = {}
    for _ in range(count):
        tag, item = await queue.get()
        items.setdefault(tag, []).append(item)
    return items


def test_engine_loop_aborts_before_the_next_step_and_frees_blocks(engine):
    async def body(loop):
        queue = asyncio.Queue()
        job = loop.submit(Job([5, 6, 7], SamplingParams(max_new_tokens=200)), queue)
        await queue.get()  # decoding
        steps_at_abort = loop.stats["steps"]  # steps the worker has finished (one more may be in flight)
        loop.abort(job)
        while loop.stats["running"] or loop.stats["aborted"] == 0:
            await asyncio.sleep(0.001)
        late = loop.stats["steps"] - steps_at_abort
        while not queue.empty():
            queue.get_nowait()
        short = loop.submit(Job([8, 9], SamplingParams(max_new_tokens=3), n=2), queue, tag=1)
        got = await collect(queue, 3)  # 2 choices x 3 tokens arrive in 3 steps
        return late, loop.stats, got, short

    late, stats, got, short = with_loop(engine, body)
    assert late <= 1  # at most the step in flight when abort() was called ran after it
    assert stats["aborted"] == 1
    assert [sorted((o.choice, o.done) for o in outs) for outs in got[1]] == [[(0, False), (1, False)]] * 2 + [
        [(0, True), (1, True)]]
    assert not short.open
    pool, cache = engine.pool, engine.prefix_cache
    assert pool.num_free + cache.num_reclaimable == pool.num_blocks


def test_engine_loop_isolates_a_refused_request_and_a_failed_step(engine, monkeypatch):
    async def body(loop):
        queue = asyncio.Queue()
        loop.submit(Job([5], SamplingParams(max_new_tokens=2), n=9), queue, tag=0)  # n > max_num_seqs
        loop.submit(Job([5], SamplingParams(max_new_tokens=2)), queue, tag=1)
        first = await collect(queue, 3)
        real_step = engine.step
        calls = []

        def failing_step():
            calls.append(1)
            if len(calls) == 1:
                raise FloatingPointError("nan logits")
            return real_step()

        monkeypatch.setattr(engine, "step", failing_step)
        loop.submit(Job([6], SamplingParams(max_new_tokens=2)), queue, tag=2)
        failed = await collect(queue, 1)
        loop.submit(Job([7], SamplingParams(max_new_tokens=2)), queue, tag=3)
        after = await collect(queue, 2)
        return first, failed, after

    first, failed, after = with_loop(engine, body)
    assert isinstance(first[0][0], ValueError) and "n must be" in str(first[0][0])
    assert [o.done for outs in first[1] for o in outs] == [False, True]
    assert isinstance(failed[2][0], FloatingPointError)
    assert [o.done for outs in after[3] for o in outs] == [False, True]  # the loop kept serving
    assert not engine.has_unfinished_requests


def test_over_context_prompts_are_named_by_their_field_and_scoring_enforces_the_context(engine):
    """A prompt that leaves no room is `prompt` for /v1/completions and `messages` for chat; scoring (`echo` with
    `max_tokens` 0, what a served teacher asks) refuses a prompt longer than the context (400
    `context_length_exceeded`, param `prompt`) and scores one that fills it; the model card says the context."""
    from astrai.serve.app import create_app

    server = create_app(engine, tiny_tokenizer(), model_name="tiny").state.server
    context = engine.capacity.max_position_embeddings
    assert server.model_card()["max_model_len"] == context == 256
    for field in ("prompt", "messages"):
        with pytest.raises(APIError) as info:
            server.budget([5] * context, 4, "max_tokens", prompt_param=field)
        assert (info.value.status, info.value.param, info.value.code) == (400, field, "context_length_exceeded")
    with pytest.raises(APIError) as info:  # room left, but fewer tokens than asked: the asked field
        server.budget([5] * (context - 2), 4, "max_tokens", prompt_param="prompt")
    assert info.value.param == "max_tokens"

    def score(*lengths):
        prompts = [[5, 6, 7][:1] * n for n in lengths]
        req = CompletionRequest(model="tiny", prompt=prompts, echo=True, max_tokens=0, logprobs=0)
        return server.score(req, prompts)

    with pytest.raises(APIError) as info:
        score(3, context + 1)
    assert (info.value.status, info.value.param, info.value.code) == (400, "prompt", "context_length_exceeded")
    assert f"maximum context length is {context} tokens; prompt[1] has {context + 1}" in info.value.message
    full = score(context)["choices"][0]["logprobs"]["token_logprobs"]
    assert len(full) == context and full[0] is None and all(v <= 0 for v in full[1:])
