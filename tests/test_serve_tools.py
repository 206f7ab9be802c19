"""OpenAI function calling on astrai.serve, through the official `openai` client: the app runs in uvicorn over a
scripted streaming engine (request k "samples" the k-th scripted reply, token by token) with the tiny tokenizer's
ChatML template (tools in the system turn) and a Qwen2.5-style template (tools through its variable). A reply in
the model's tool-call format comes back as `tool_calls` (streamed or not, n choices each parsed); a client loop
(call, run the tool, send the result back) makes the server render the very token ids the agents' rollout builds
for the same conversation; unsupported options are one-line 400s naming the field; without tools nothing changes.
The real server (`python -m astrai.serve` on the tiny checkpoint) renders the tools into its prompt too."""

import contextlib
import json
import threading
import time
from types import SimpleNamespace

import openai
import pytest
import torch

from astrai.agents.chat import render
from astrai.agents.tool_calls import format_tool_call
from astrai.models import tiny_tokenizer
from astrai.rollout.engine import EngineCapacity
from astrai.rollout.streaming import StepOutput
from astrai.serve.app import create_app
from test_agents_chat import CALCULATOR, QWEN25_LIKE, tiny_with
from test_episodes import ASK, CALL, _run, tools  # noqa: F401 - `tools`: the fixture, used by the loop test
from test_serve import MODEL, free_port, http, reference, server  # noqa: F401 - fixtures of the real server


class ScriptedServing:
    """A streaming engine stand-in (`add_request` / `step` / `abort`): the k-th request "samples" `replies[k]` (a
    text, or one text per choice) one token per step, then the EOS token, cut at its max_new_tokens; log-prob -0.5
    per token. Records each request's prompt ids in `prompts`."""

    def __init__(self, tokenizer, replies):
        self.tokenizer, self.replies, self.prompts = tokenizer, list(replies), []
        self.model = SimpleNamespace(config=SimpleNamespace(vocab_size=tokenizer.backend.get_vocab_size()))
        self.device, self.policy_version = torch.device("cpu"), 0
        self.capacity = EngineCapacity(max_num_seqs=8, max_position_embeddings=4096)
        self._live: dict[tuple[int, int], tuple[list[int], bool]] = {}

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self._live)

    def add_request(self, prompt_ids, params, *, n=1, penalty=None, seed=None, top_logprobs=0) -> int:
        rid = len(self.prompts)
        self.prompts.append(list(prompt_ids))
        reply = self.replies.pop(0)
        for c, text in enumerate([reply] * n if isinstance(reply, str) else reply):
            ids = self.tokenizer.encode(text) + [self.tokenizer.eos_token_id]
            self._live[(rid, c)] = (ids[:params.max_new_tokens], len(ids) <= params.max_new_tokens)
        return rid

    def step(self) -> list:
        outputs = []
        for (rid, c), (ids, finished) in list(self._live.items()):
            token, rest = ids[0], ids[1:]
            outputs.append(StepOutput(rid, c, token, -0.5, (), not rest, finished and not rest))
            if rest:
                self._live[(rid, c)] = (rest, finished)
            else:
                del self._live[(rid, c)]
        return outputs

    def abort(self, request_id, choice=None) -> None:
        for key in [k for k in self._live if k[0] == request_id and choice in (None, k[1])]:
            del self._live[key]

    def stream_stats(self) -> dict:
        return {"running": len(self._live), "waiting": 0, "kv_blocks": 0, "kv_blocks_free": 0, "kv_blocks_cached": 0}


@contextlib.contextmanager
def serving(tokenizer, replies):
    """(base URL, openai client, engine) of the app over a `ScriptedServing` engine, in uvicorn on a free port."""
    import uvicorn

    engine = ScriptedServing(tokenizer, replies)
    port = free_port()
    app = create_app(engine, tokenizer, model_name="agent", max_tokens=200)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive(), "uvicorn did not start"
        time.sleep(0.01)
    base = f"http://127.0.0.1:{port}"
    try:
        yield base, openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60), engine
    finally:
        server.should_exit = True
        thread.join(timeout=30)


TEMPLATES = {"chatml": tiny_tokenizer, "qwen25_like": lambda: tiny_with(QWEN25_LIKE)}
PARALLEL = ("I will compute both.\n" + format_tool_call("calculator", {"expression": "1 + 2"}) + "\n"
            + format_tool_call("calculator", {"expression": "3 + 4"}))


def streamed(client, **request):
    """(content, [(id, name, arguments)], finish_reason) of choice 0 rebuilt from a streamed request's deltas, as an
    OpenAI client accumulates them."""
    content, calls, reason = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **request):
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, ["", "", ""])
                entry[0] += call.id or ""
                entry[1] += (call.function.name or "") if call.function else ""
                entry[2] += (call.function.arguments or "") if call.function else ""
            reason = choice.finish_reason or reason
    return content, [tuple(calls[k]) for k in sorted(calls)], reason


@pytest.mark.parametrize("template", TEMPLATES)
def test_a_tool_call_in_the_models_format_comes_back_as_tool_calls(template):
    tok = TEMPLATES[template]()
    replies = [CALL, PARALLEL, [CALL, "No tool needed: 408."], CALL, PARALLEL]
    with serving(tok, replies) as (_, client, engine):
        request = dict(model="agent", messages=ASK, tools=[CALCULATOR])
        reply = client.chat.completions.create(**request)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me compute."
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_") and len(call.id) == 29
        assert call.function.name == "calculator" and json.loads(call.function.arguments) == {"expression": "12 * 34"}
        assert engine.prompts[0] == tok.encode(render(tok, ASK, [CALCULATOR]))  # the tools rendered as the rollout
        parallel = client.chat.completions.create(**request).choices[0]
        assert parallel.message.content == "I will compute both." and parallel.finish_reason == "tool_calls"
        assert [json.loads(c.function.arguments)["expression"] for c in parallel.message.tool_calls] == ["1 + 2",
                                                                                                         "3 + 4"]
        assert len({c.id for c in parallel.message.tool_calls}) == 2
        two = client.chat.completions.create(n=2, **request).choices  # each choice parsed on its own
        assert [c.finish_reason for c in two] == ["tool_calls", "stop"]
        assert two[0].message.tool_calls[0].function.name == "calculator"
        assert two[0].message.content == "Let me compute."
        assert two[1].message.tool_calls is None and two[1].message.content == "No tool needed: 408."
        for plain, text in ((choice, CALL), (parallel, PARALLEL)):  # streamed: the same message
            content, calls, reason = streamed(client, **request)
            assert content == plain.message.content and reason == "tool_calls"
            assert [(name, json.loads(args)) for _, name, args in calls] == [
                (c.function.name, json.loads(c.function.arguments)) for c in plain.message.tool_calls]
            assert all(i.startswith("call_") for i, _, _ in calls)


def test_calls_that_cannot_be_honoured_stay_text_and_tool_choice_none_renders_no_tools():
    tok = tiny_tokenizer()
    unknown = "Hmm.\n" + format_tool_call("weather", {"city": "Paris"})
    broken = CALL + "\n<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \n</tool_call>"
    replies = [unknown, broken, broken, CALL, "  spaced out  "]
    with serving(tok, replies) as (_, client, engine):
        request = dict(model="agent", messages=ASK, tools=[CALCULATOR])
        for text in (unknown, broken):  # a tool not offered; one valid call beside a malformed one: all text
            choice = client.chat.completions.create(**request).choices[0]
            assert choice.message.tool_calls is None and choice.finish_reason == "stop"
            assert choice.message.content == text
        assert streamed(client, **request) == (broken, [], "stop")
        none = client.chat.completions.create(tool_choice="none", **request).choices[0]
        assert none.message.content == CALL and none.message.tool_calls is None and none.finish_reason == "stop"
        assert engine.prompts[3] == tok.encode(render(tok, ASK))  # not told about tools
        stripped = client.chat.completions.create(**request).choices[0]  # with tools, content is stripped
        assert stripped.message.content == "spaced out" and stripped.finish_reason == "stop"


@pytest.mark.parametrize("template", TEMPLATES)
def test_a_client_loop_renders_the_ids_the_rollout_builds(template, tools):  # noqa: F811 - the imported fixture
    """Call -> run the tool here -> send the `tool` message back -> answer: the prompt ids the server renders for
    each request equal the contexts the agents' rollout (`run_episodes` over the same scripted turns) samples from:
    prompt + the sampled turn + separator + the tool result rendered by the template."""
    tok = TEMPLATES[template]()
    loaded, _ = tools
    script = [CALL, "12 * 34 = 408."]
    (episode,), rollout = _run(tok, tools, [ASK], [list(script)])
    schemas = [dict(t.schema) for t in loaded]
    with serving(tok, script) as (_, client, engine):
        messages = list(ASK)
        reply = client.chat.completions.create(model="agent", messages=messages, tools=schemas, temperature=0)
        message = reply.choices[0].message
        assert reply.choices[0].finish_reason == "tool_calls"
        messages.append(message.model_dump(exclude_none=True))
        functions = {t.name: t.function for t in loaded}
        for call in message.tool_calls:
            result = functions[call.function.name](**json.loads(call.function.arguments))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        final = client.chat.completions.create(model="agent", messages=messages, tools=schemas, temperature=0)
    assert final.choices[0].message.content == episode.text == "12 * 34 = 408."
    assert final.choices[0].finish_reason == "stop" and final.choices[0].message.tool_calls is None
    assert len(engine.prompts) == len(rollout.contexts) == 2
    assert engine.prompts[0] == rollout.contexts[0]
    assert engine.prompts[1] == rollout.contexts[1]  # token ids equal: the result rendered as the rollout renders it
    assert final.usage.prompt_tokens == len(rollout.contexts[1])


CALLED = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "1"}'}}]}


@pytest.mark.parametrize("template", TEMPLATES)
def test_a_clients_tool_calls_become_the_rollouts_messages_and_render_as_the_model_wrote_them(template):
    """A client's assistant `tool_calls` (arguments a JSON string) become the message an episode holds for the same
    turn, whatever the template (`conversation`: OpenAI shape, arguments an object), and render as an episode's do:
    for ChatML (no tool support) as the Hermes text the model wrote, for a Qwen2.5-style template through its own
    `tool_calls`."""
    from astrai.agents.tool_calls import assistant_message
    from astrai.serve.protocol import ChatCompletionRequest
    from astrai.serve.tools import conversation

    tok = TEMPLATES[template]()
    said = "Let me see.\n" + format_tool_call("calculator", {"expression": "1"})
    sent = ASK + [{**CALLED, "content": "Let me see."}, {"role": "tool", "tool_call_id": "call_1", "content": "1"}]
    messages = conversation(ChatCompletionRequest(model="agent", messages=sent).messages)
    episode_turn, _, _ = assistant_message(said, ["calculator"])
    assert messages == ASK + [episode_turn, {"role": "tool", "content": "1", "name": "calculator"}]
    assert render(tok, messages, [CALCULATOR]) == render(tok, ASK + [episode_turn, messages[2]], [CALCULATOR])
    if template == "chatml":
        written = ASK + [{"role": "assistant", "content": said}, messages[2]]
        assert render(tok, messages, [CALCULATOR]) == render(tok, written, [CALCULATOR])
        assert render(tok, messages) == render(tok, written)  # tool_choice "none": the calls are still written


@pytest.mark.parametrize("extra, param, code", [
    ({"tool_choice": "required"}, "tool_choice", "unsupported_parameter"),
    ({"tool_choice": {"type": "function", "function": {"name": "calculator"}}}, "tool_choice",
     "unsupported_parameter"),
    ({"tool_choice": "sometimes"}, "tool_choice", None),
    ({"parallel_tool_calls": False}, "parallel_tool_calls", "unsupported_parameter"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools.[0].type", None),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools.[0].function.name", None),
    ({"tools": [CALCULATOR, CALCULATOR]}, "tools.[1].function.name", None),
    ({"tools": [{"type": "function", "function": {**CALCULATOR["function"], "strict": True}}]},
     "tools.[0].function.strict", "unsupported_parameter"),
    ({"messages": ASK + [{"role": "tool", "tool_call_id": "call_9", "content": "1"}]}, "messages.[1].tool_call_id",
     None),
    ({"messages": ASK + [{**CALLED, "tool_calls": [{**CALLED["tool_calls"][0], "function": {
        "name": "calculator", "arguments": "{not json"}}]}]}, "messages.[1].tool_calls.[0].function.arguments", None),
    ({"functions": [CALCULATOR["function"]]}, "functions", "unsupported_parameter"),  # the legacy field
])
def test_what_cannot_be_honoured_is_refused_in_one_line(extra, param, code):
    with serving(tiny_tokenizer(), []) as (base, _, engine):
        status, body = http("POST", f"{base}/v1/chat/completions",
                            {"model": "agent", "messages": ASK, "tools": [CALCULATOR], **extra})
    assert status == 400 and engine.prompts == []
    error = body["error"]
    assert (error["param"], error["code"], error["type"]) == (param, code, "invalid_request_error")
    assert "\n" not in error["message"] and param in error["message"]


def test_without_tools_the_text_is_returned_as_before():
    """No `tools`: the prompt is the template's render of the messages (as before tools existed), and a reply that
    happens to contain a call block is plain content with finish_reason "stop", streamed or not, unstripped."""
    tok = tiny_tokenizer()
    text = " " + CALL + " "
    with serving(tok, [text, text]) as (_, client, engine):
        reply = client.chat.completions.create(model="agent", messages=ASK)
        choice = reply.choices[0]
        assert choice.message.content == text and choice.finish_reason == "stop"
        assert choice.message.tool_calls is None
        assert streamed(client, model="agent", messages=ASK) == (text, [], "stop")
    assert engine.prompts[0] == tok.encode(tok.apply_chat_template(ASK, add_generation_prompt=True))


def test_the_real_server_renders_the_tools_into_its_prompt(server, reference):  # noqa: F811 - imported fixtures
    """`python -m astrai.serve` on the tiny trained checkpoint (context 256 tokens): a chat request with tools has
    the prompt the rollout renders (the Hermes tool list makes it longer than the context: the 400 counts its
    tokens); with tool_choice "none" the same request is answered greedily from the plain messages."""
    _, client = server
    tokenizer, greedy = reference
    prompt = tokenizer.encode(render(tokenizer, ASK, [CALCULATOR]))
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=ASK, tools=[CALCULATOR], max_tokens=8)
    error = info.value.response.json()["error"]
    assert error["param"] == "messages" and error["code"] == "context_length_exceeded"
    assert f"the prompt has {len(prompt)} tokens" in error["message"]
    reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=[CALCULATOR], tool_choice="none",
                                           max_tokens=8, temperature=0)
    plain = tokenizer.encode(render(tokenizer, ASK))
    tokens = greedy(plain, 8)
    assert reply.usage.prompt_tokens == len(plain) and reply.choices[0].message.tool_calls is None
    assert reply.choices[0].message.content == tokenizer.decode(tokens)
