"""The FastAPI application: OpenAI-compatible routes over a `Batcher` of the paged engine.

Routes: `GET /health`, `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions`. Errors (bad JSON,
invalid fields, unknown model, a prompt longer than the context, unsupported options) are answered in the OpenAI
shape `{"error": {"message", "type", "param", "code"}}` with a 4xx status. Streaming (`"stream": true`) sends
server-sent events, one `data: {chunk}` per token delta in the OpenAI chunk format, ending with `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from typing import AsyncIterator, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from astrai.serve.batcher import Batcher, Job
from astrai.serve.detokenize import TextStream
from astrai.serve.protocol import (APIError, ChatCompletionRequest, CompletionRequest, check_supported,
                                   message_text, sampling_for, stop_strings)

__all__ = ["create_app"]


class _Server:
    """State behind the routes: engine batcher, tokenizer, served name, limits."""

    def __init__(self, engine, tokenizer, *, model_name: str, max_batch: int, batch_window_s: float,
                 max_tokens: int):
        self.batcher = Batcher(engine, max_batch=max_batch, window_s=batch_window_s)
        self.engine, self.tokenizer, self.model_name, self.max_tokens = engine, tokenizer, model_name, max_tokens
        self.context = engine.model.config.max_position_embeddings
        self.vocab = engine.model.config.vocab_size
        eos = tokenizer.eos_token_id
        self.stop_token_ids = () if eos is None else (eos,)
        self.created = int(time.time())

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(f"The model '{name}' does not exist; this server serves '{self.model_name}'",
                           status=404, param="model", code="model_not_found")

    def prompts_of(self, req: CompletionRequest) -> list[list[int]]:
        """Token ids of each prompt of a completion request; APIError for empty or out-of-vocabulary ones."""
        p = req.prompt
        if isinstance(p, str) or (isinstance(p, list) and p and isinstance(p[0], int)):
            p = [p]
        if not p:
            raise APIError("prompt: must not be empty", param="prompt")
        ids = [self.tokenizer.encode(x) if isinstance(x, str) else list(x) for x in p]
        for i, prompt in enumerate(ids):
            if not prompt:
                raise APIError("prompt: must not be empty", param="prompt")
            if any(not 0 <= t < self.vocab for t in prompt):
                raise APIError(f"prompt[{i}]: token ids must lie in [0, {self.vocab})", param="prompt")
        return ids

    def budget(self, prompt: list[int], asked: Optional[int], param: str) -> int:
        """max_new_tokens for a prompt: the request's value (checked against the context) or the default."""
        room = self.context - len(prompt)
        if asked is None:
            asked = min(self.max_tokens, room)
            if asked >= 1:
                return asked
        if room < 1 or asked > room:
            raise APIError(f"This model's maximum context length is {self.context} tokens; the prompt has "
                           f"{len(prompt)} tokens and {asked} more were requested ({param})",
                           param=param if room >= 1 else "messages", code="context_length_exceeded")
        return asked

    def jobs(self, req, prompts: list[list[int]], budgets: list[int], on_token=None) -> list[Job]:
        """One `Job` per prompt (choices `i * n .. i * n + n - 1` belong to prompt i)."""
        check_supported(req)
        if req.n * len(prompts) > self.batcher.max_batch:
            raise APIError(f"n: at most {self.batcher.max_batch} choices per request (the server's --max_batch)",
                           param="n")
        out = []
        for i, (prompt, budget) in enumerate(zip(prompts, budgets)):
            params, penalty = sampling_for(req, max_new_tokens=budget, stop_token_ids=self.stop_token_ids)
            hook = None if on_token is None else (lambda c, t, base=i * req.n: on_token(base + c, t))
            out.append(Job(prompt, params, n=req.n, penalty=penalty, seed=req.seed, on_token=hook))
        return out

    def streams(self, req, budgets: list[int]) -> list[TextStream]:
        stops = stop_strings(req.stop)
        return [TextStream(self.tokenizer, stop=stops, stop_token_ids=self.stop_token_ids, max_tokens=b)
                for b in budgets for _ in range(req.n)]


def _usage(prompts: list[list[int]], streams: list[TextStream]) -> dict:
    prompt_tokens = sum(len(p) for p in prompts)  # once per prompt, as OpenAI counts
    completion = sum(s.num_tokens for s in streams)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _generate(server: _Server, req, prompts, budgets, *, chat: bool):
    """Non-streaming: run the jobs, return the OpenAI response body."""
    streams = server.streams(req, budgets)
    jobs = server.jobs(req, prompts, budgets)
    results = await asyncio.gather(*(server.batcher.submit(job) for job in jobs))
    for stream, sample in zip(streams, (s for samples in results for s in samples)):
        for token in sample.token_ids:
            stream.push(token)
        stream.finish(sample.finished)
    choices = []
    for i, s in enumerate(streams):
        body = {"message": {"role": "assistant", "content": s.text}} if chat else {"text": s.text}
        choices.append({"index": i, **body, "logprobs": None, "finish_reason": s.finish_reason})
    return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": server.model_name, "choices": choices, "usage": _usage(prompts, streams)}


async def _stream(server: _Server, req, prompts, budgets, *, chat: bool) -> AsyncIterator[str]:
    """Streaming: validate and submit first (errors before the first byte are plain 4xx), then yield SSE lines."""
    streams = server.streams(req, budgets)
    events: asyncio.Queue = asyncio.Queue()
    jobs = server.jobs(req, prompts, budgets, on_token=lambda c, t: events.put_nowait((c, t)))
    futures = [server.batcher.submit(job) for job in jobs]
    for future in futures:
        future.add_done_callback(lambda f: events.put_nowait(None))
    head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
            "model": server.model_name}
    include_usage = bool((req.stream_options or {}).get("include_usage"))

    def chunk(index: int, text: Optional[str], reason: Optional[str], first: bool = False) -> str:
        if chat:
            delta = ({"role": "assistant", "content": ""} if first else
                     {} if text is None else {"content": text})
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": reason}
        return _sse({**head, "choices": [choice], **({"usage": None} if include_usage else {})})

    async def lines() -> AsyncIterator[str]:
        try:
            if chat:
                for i in range(len(streams)):
                    yield chunk(i, None, None, first=True)
            pending = len(futures)
            while pending:
                event = await events.get()
                if event is None:
                    pending -= 1
                    continue
                choice, token = event
                stream, was_open = streams[choice], streams[choice].finish_reason is None
                text = stream.push(token)
                if text:
                    yield chunk(choice, text, None)
                if was_open and stream.finish_reason is not None:
                    yield chunk(choice, None, stream.finish_reason)
            samples = [s for f in futures for s in f.result()]
        except Exception as err:  # noqa: BLE001 - the status line is gone: report in the stream
            yield _sse(_engine_error(err).body())
            yield "data: [DONE]\n\n"
            return
        for i, (stream, sample) in enumerate(zip(streams, samples)):
            if stream.finish_reason is None:
                text = stream.finish(sample.finished)
                if text:
                    yield chunk(i, text, None)
                yield chunk(i, None, stream.finish_reason)
        if include_usage:
            yield _sse({**head, "choices": [], "usage": _usage(prompts, streams)})
        yield "data: [DONE]\n\n"

    return lines()


def _engine_error(err: Exception) -> APIError:
    if isinstance(err, APIError):
        return err
    if isinstance(err, ValueError):
        return APIError(str(err))
    return APIError(f"generation failed: {err}", status=500, kind="server_error")


def create_app(engine, tokenizer, *, model_name: str, max_batch: int = 32, batch_window_ms: float = 5.0,
               max_tokens: int = 512) -> FastAPI:
    """The OpenAI-compatible app over `engine` (a `GenerationEngine`) and its `tokenizer`.

    Args:
        model_name: the id served by `/v1/models`; requests naming another model get 404.
        max_batch: most rows (choices) per engine call; the engine's `max_num_seqs` must be at least this.
        batch_window_ms: how long the batcher waits for more requests after the first (milliseconds).
        max_tokens: default response budget when a chat request sets none (capped by the context).
    """
    server = _Server(engine, tokenizer, model_name=model_name, max_batch=max_batch,
                     batch_window_s=batch_window_ms / 1000.0, max_tokens=max_tokens)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await server.batcher.start()
        yield
        await server.batcher.stop()

    app = FastAPI(title="astrai", lifespan=lifespan)
    app.state.server = server
    _add_error_handlers(app)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": server.model_name, "policy_version": engine.policy_version,
                **server.batcher.stats}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": server.created,
                                            "owned_by": "astrai"}]}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        server.check_model(req.model)
        prompts = server.prompts_of(req)
        budgets = [server.budget(p, req.max_tokens, "max_tokens") for p in prompts]
        return await _respond(server, req, prompts, budgets, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest):
        server.check_model(req.model)
        messages = [message_text(m, i) for i, m in enumerate(req.messages)]
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except Exception as err:  # noqa: BLE001 - a template's raise_exception or a missing template
            raise APIError(f"messages: the chat template rejected them: {err}", param="messages") from None
        prompt = tokenizer.encode(text)
        asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        budget = server.budget(prompt, asked, "max_completion_tokens" if req.max_completion_tokens else "max_tokens")
        return await _respond(server, req, [prompt], [budget], chat=True)

    return app


async def _respond(server: _Server, req, prompts, budgets, *, chat: bool):
    if req.stream:
        return StreamingResponse(await _stream(server, req, prompts, budgets, chat=chat),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    try:
        return await _generate(server, req, prompts, budgets, chat=chat)
    except APIError:
        raise
    except Exception as err:  # noqa: BLE001
        raise _engine_error(err) from None


def _add_error_handlers(app: FastAPI) -> None:
    """Every error in the OpenAI shape."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0] if err.errors() else {"loc": (), "msg": "invalid request"}
        if first.get("type") == "json_invalid":
            message = f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}"
            return JSONResponse(APIError(message).body(), status_code=400)
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
        return JSONResponse(APIError(message, param=param).body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException) -> JSONResponse:
        kind = "invalid_request_error" if err.status_code < 500 else "server_error"
        return JSONResponse(APIError(str(err.detail), status=err.status_code, kind=kind).body(),
                            status_code=err.status_code)
