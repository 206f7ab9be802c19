"""The FastAPI application: OpenAI-compatible routes over an `EngineLoop` that steps the paged engine.

Routes: `GET /health`, `GET /v1/models`, `GET /v1/models/{id}`, `POST /v1/completions`, `POST /v1/chat/completions`.
A completion's text prompt is raw text, encoded as training encodes raw prompts (`data.chat_template` false,
`astrai.data.prompt_format.raw_prompt_ids`: the BOS token first when the tokenizer adds one), with control tokens
spelled in it read as such; a chat request is rendered with the chat template and answered 400 when the tokenizer has
none (a base model: send the text to `/v1/completions`). A chat request's `tools` are rendered and its answer's tool
calls parsed as the agents' rollout renders and writes them (`astrai.serve.tools`).
Requests join the engine's running batch at its next decode step and leave it when they end (`engine_loop`), so a
short request is not held up by a long one. Every failure is answered in the OpenAI shape
`{"error": {"message", "type", "param", "code"}}`: bad JSON, invalid fields or text, unknown model or route, a
prompt longer than the context, unsupported options (4xx), and anything unexpected (500). A completion request
with `echo: true` and `max_tokens: 0` scores its prompt instead (`astrai.serve.scoring`: the log-probs of the
prompt's own tokens, as vLLM answers it; what a served teacher of on-policy distillation is asked). Streaming
(`"stream": true`) sends server-sent events in the OpenAI chunk format, ending with `data: [DONE]`. A client that
disconnects, streaming or not, has its request aborted in the engine before the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from typing import Optional, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException

from astrai.agents.chat import render
from astrai.data.prompt_format import raw_prompt_ids, uses_chat_template
from astrai.rollout.engine import StreamingEngine
from astrai.serve.detokenize import TextStream
from astrai.serve.engine_loop import EngineLoop, Job
from astrai.serve.logprobs import TokenText
from astrai.serve.protocol import (APIError, ChatCompletionRequest, CompletionRequest, check_supported, check_text,
                                   logprobs_k, sampling_for, stop_strings)
from astrai.serve.responses import Run, body, sse_lines
from astrai.serve.scoring import PromptScorer
from astrai.serve.tools import ToolSetup, conversation, tool_setup

__all__ = ["create_app"]

logger = logging.getLogger(__name__)


class _Server:
    """State behind the routes: the engine loop, tokenizer, served name, limits."""

    def __init__(self, engine, tokenizer, *, model_name: str, max_tokens: int, aliases: Sequence[str] = ()):
        self.loop = EngineLoop(engine)
        self.engine, self.tokenizer, self.model_name, self.max_tokens = engine, tokenizer, model_name, max_tokens
        self.names = {model_name, *aliases}
        self.text_of = TokenText(tokenizer)
        self.scorer = PromptScorer(engine, self.text_of)
        capacity = engine.capacity
        self.context, self.max_batch = capacity.max_position_embeddings, capacity.max_num_seqs
        self.vocab = engine.model.config.vocab_size
        eos = tokenizer.eos_token_id
        self.stop_token_ids = () if eos is None else (eos,)
        self.created = int(time.time())

    def model_card(self) -> dict:
        """The served model in OpenAI's model object shape, with vLLM's `max_model_len` (the context in tokens)."""
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "astrai",
                "max_model_len": self.context}

    def check_model(self, name: str) -> None:
        """APIError 404 (`model_not_found`) unless `name` is the served model (its id or an alias)."""
        if name not in self.names:
            raise APIError(f"The model '{name}' does not exist; this server serves '{self.model_name}'",
                           status=404, param="model", code="model_not_found")

    def prompts_of(self, req: CompletionRequest) -> list[list[int]]:
        """Token ids of each prompt of a completion request (text as raw text: `prompt_format.raw_prompt_ids`, the
        BOS token first when the tokenizer adds one; token ids as given); APIError for empty, invalid or
        out-of-vocabulary ones."""
        p = req.prompt
        if isinstance(p, str) or (isinstance(p, list) and p and isinstance(p[0], int)):
            p = [p]
        if not p:
            raise APIError("prompt: must not be empty", param="prompt")
        ids = [raw_prompt_ids(self.tokenizer, check_text(x, "prompt"), special_tokens=True) if isinstance(x, str)
               else list(x) for x in p]
        for i, prompt in enumerate(ids):
            if not prompt:
                raise APIError("prompt: must not be empty", param="prompt")
            if any(not 0 <= t < self.vocab for t in prompt):
                raise APIError(f"prompt[{i}]: token ids must lie in [0, {self.vocab})", param="prompt")
        return ids

    def budget(self, prompt: list[int], asked: Optional[int], param: str, *, prompt_param: str) -> int:
        """max_new_tokens for a prompt: the request's value (checked against the context) or the default.

        Raises:
            APIError: 400 `context_length_exceeded` naming `prompt_param` (`prompt` for /v1/completions, `messages`
                for chat) when the prompt leaves no room, else `param` when the asked tokens do not fit.
        """
        room = self.context - len(prompt)
        if asked is None:
            asked = min(self.max_tokens, room)
            if asked >= 1:
                return asked
        if room < 1 or asked > room:
            raise APIError(f"This model's maximum context length is {self.context} tokens; the prompt has "
                           f"{len(prompt)} tokens and {asked} more were requested ({param})",
                           param=param if room >= 1 else prompt_param, code="context_length_exceeded")
        return asked

    def check_context(self, prompts: list[list[int]]) -> None:
        """APIError 400 `context_length_exceeded` (param `prompt`) for a prompt to score longer than the model's
        context (`max_position_embeddings`): positions past it have no rotary angle, so its log-probs would be
        meaningless."""
        for i, ids in enumerate(prompts):
            if len(ids) > self.context:
                raise APIError(f"This model's maximum context length is {self.context} tokens; prompt[{i}] has "
                               f"{len(ids)} tokens to score", param="prompt", code="context_length_exceeded")

    def score(self, req: CompletionRequest, prompts: list[list[int]]) -> dict:
        """The body of a prompt-scoring request (`echo` with `max_tokens` 0): one choice per prompt with the log-probs
        of its own tokens (`scoring.PromptScorer`), no token generated."""
        check_supported(req)
        self.check_context(prompts)
        k = req.logprobs or 0
        choices = [self.scorer.echo_choice(i, ids, k) for i, ids in enumerate(prompts)]
        if req.logprobs is None:
            choices = [{**choice, "logprobs": None} for choice in choices]
        tokens = sum(len(p) for p in prompts)
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": self.model_name, "choices": choices,
                "usage": {"prompt_tokens": tokens, "completion_tokens": 0, "total_tokens": tokens}}

    def run(self, req, prompts: list[list[int]], budgets: list[int], *, chat: bool,
            tools: Optional[frozenset[str]] = None) -> Run:
        """Validate the request's options and submit one job per prompt; `tools`: the names the choices' tool calls
        are parsed against (None: not parsed)."""
        check_supported(req)
        if req.n * len(prompts) > self.max_batch:
            raise APIError(f"n: at most {self.max_batch} choices per request (the server's --max_batch)", param="n")
        k = logprobs_k(req)
        stops = stop_strings(req.stop)
        jobs, streams = [], []
        for prompt, budget in zip(prompts, budgets):
            params, penalty = sampling_for(req, max_new_tokens=budget, stop_token_ids=self.stop_token_ids)
            jobs.append(Job(prompt, params, n=req.n, penalty=penalty, seed=req.seed, top_logprobs=k or 0))
            streams += [TextStream(self.tokenizer, stop=stops, stop_token_ids=params.stop_token_ids, max_tokens=budget)
                        for _ in range(req.n)]
        return Run(self, jobs, streams, logprobs=k, prompt_tokens=sum(len(p) for p in prompts), chat=chat,
                   tools=tools)

    def chat_prompt(self, req: ChatCompletionRequest, tools: ToolSetup) -> list[int]:
        """The token ids of a chat request's messages (with its tools) rendered as the rollout renders them
        (`astrai.agents.chat.render`, generation prompt added); APIError when they cannot be."""
        messages = conversation(req.messages)  # invalid messages are named first
        if not uses_chat_template(self.tokenizer):
            raise APIError(f"messages: the model '{self.model_name}' has no chat template (a base model), so chat "
                           "messages cannot be rendered; send the text as a prompt to /v1/completions",
                           param="messages", code="chat_template_missing")
        try:
            text = render(self.tokenizer, messages, tools.schemas, add_generation_prompt=True)
        except Exception as err:  # noqa: BLE001 - a template's raise_exception or a missing template
            raise APIError(f"messages: the chat template rejected them: {err}", param="messages") from None
        return self.tokenizer.encode(text)


class _EventStream(StreamingResponse):
    """An SSE response that always watches for the client going away (whatever ASGI version the server speaks) and
    calls `on_close` when the stream ends, completed or cut off."""

    def __init__(self, content, on_close):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            sender = asyncio.ensure_future(self.stream_response(send))
            watcher = asyncio.ensure_future(self.listen_for_disconnect(receive))
            await asyncio.wait({sender, watcher}, return_when=asyncio.FIRST_COMPLETED)
            for task in (sender, watcher):
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await sender
        finally:
            self.on_close()


async def _unless_disconnected(request: Request, work):
    """Await `work` (a coroutine) unless the client disconnects first; then cancel it and raise `_Gone`."""
    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watcher = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        raise _Gone()
    return task.result()


class _Gone(Exception):
    """The client closed the connection before its answer was ready."""


async def _respond(server: _Server, request: Request, req, prompts, budgets, *, chat: bool,
                   tools: Optional[frozenset[str]] = None):
    run = server.run(req, prompts, budgets, chat=chat, tools=tools)
    try:
        await _unless_disconnected(request, run.started())  # the engine's refusal is still a 4xx here
        if req.stream:
            include_usage = bool((req.stream_options or {}).get("include_usage"))
            return _EventStream(sse_lines(run, include_usage), on_close=run.close)
        return _json(await _unless_disconnected(request, body(run)))
    except _Gone:
        run.close()
        return Response(status_code=499)  # nobody reads it
    except BaseException:
        run.close()
        raise


def _json(content, status: int = 200) -> Response:
    """JSON with non-ASCII escaped: an error message quoting invalid text (a lone surrogate) still encodes."""
    return Response(json.dumps(content, ensure_ascii=True), status_code=status, media_type="application/json")


def create_app(engine, tokenizer, *, model_name: str, max_tokens: int = 512, aliases: Sequence[str] = ()) -> FastAPI:
    """The OpenAI-compatible app over `engine` (a `StreamingEngine`, e.g. the paged engine) and its `tokenizer`.

    Args:
        model_name: the id served by `/v1/models`; requests naming another model (not in `aliases`) get 404.
        aliases: other names requests may give the model (the checkpoint's path as given, resolved, its folder).
        max_tokens: default response budget when a chat request sets none (capped by the context).
    The engine's `capacity.max_num_seqs` bounds the choices decoded at once and the choices per request.
    """
    if not isinstance(engine, StreamingEngine):
        raise TypeError(f"astrai.serve needs an engine with the streaming API (add_request, step, abort); "
                        f"{type(engine).__name__} has none")
    server = _Server(engine, tokenizer, model_name=model_name, max_tokens=max_tokens, aliases=aliases)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await server.loop.start()
        yield
        await server.loop.stop()

    app = FastAPI(title="astrai", lifespan=lifespan)
    app.state.server = server
    _add_error_handlers(app)

    @app.get("/health")
    async def health():
        return _json({"status": "ok", "model": server.model_name, "policy_version": engine.policy_version,
                      **server.loop.stats})

    @app.get("/v1/models")
    async def models():
        return _json({"object": "list", "data": [server.model_card()]})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        server.check_model(model_id)
        return _json(server.model_card())

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        server.check_model(req.model)
        prompts = server.prompts_of(req)
        if req.scores_prompt():
            return _json(await asyncio.to_thread(server.score, req, prompts))
        budgets = [server.budget(p, req.max_tokens, "max_tokens", prompt_param="prompt") for p in prompts]
        return await _respond(server, request, req, prompts, budgets, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        server.check_model(req.model)
        tools = tool_setup(req)
        prompt = server.chat_prompt(req, tools)
        asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        budget = server.budget(prompt, asked, "max_completion_tokens" if req.max_completion_tokens else "max_tokens",
                               prompt_param="messages")
        return await _respond(server, request, req, [prompt], [budget], chat=True, tools=tools.names)

    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error in the OpenAI shape, as JSON."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError):
        return _json(err.body(), err.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError):
        first = err.errors()[0] if err.errors() else {"loc": (), "msg": "invalid request"}
        if first.get("type") == "json_invalid":
            message = f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}"
            return _json(APIError(message).body(), 400)
        message, param = _validation_message(first)
        return _json(APIError(message, param=param).body(), 400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException):
        kind = "invalid_request_error" if err.status_code < 500 else "server_error"
        return _json(APIError(str(err.detail), status=err.status_code, kind=kind).body(), err.status_code)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, err: Exception):
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return _json(APIError(f"internal error: {type(err).__name__}: {err}", status=500, kind="server_error")
                     .body(), 500)


_NON_FINITE = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}  # as JSON's extensions spell them


def _validation_message(error: dict) -> tuple[str, Optional[str]]:
    """(one-line message, param) of one pydantic error: the field path as OpenAI writes it (`messages.[0].role`:
    list indices in brackets), then what was expected. A NaN or infinite number says a finite one is expected (not
    that it is out of the field's range); a validator's ValueError is its own text."""
    loc = [f"[{x}]" if isinstance(x, int) else str(x) for x in error.get("loc", ()) if x != "body"]
    param = ".".join(loc) or None
    kind, msg = error.get("type"), str(error.get("msg"))
    if kind == "finite_number":
        got = _NON_FINITE.get(str(error.get("input")).lower(), repr(error.get("input")))
        msg = f"expected a finite number, got {got}"
    elif kind == "value_error":
        msg = msg.removeprefix("Value error, ")
    return (f"{param}: {msg}" if param else msg), param
