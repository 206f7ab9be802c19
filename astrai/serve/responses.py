"""One HTTP request's generation: its engine jobs, their tokens turned into text, and the OpenAI response bodies.

A `Run` submits one `Job` per prompt to the `EngineLoop` (n choices each; choice `i * n + c` is sample c of prompt
i), and folds the tokens of every engine step into the choices' `TextStream`s and log-prob lists. A choice that a
stop string ends is aborted in the engine at once (its KV blocks are freed rather than decoded to max_tokens), and
`Run.close()` aborts whatever is still running: the routes call it when the client goes away, so a disconnected
client's request stops within one engine step. With tools (`astrai.serve.tools`), each chat choice's text is read
for tool calls: `message.tool_calls` and finish_reason "tool_calls" in the body; when streaming, content deltas
until a call may start, then the rest and one `tool_calls` delta per call at the end.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import AsyncIterator, Optional

from astrai.serve.detokenize import TextStream
from astrai.serve.engine_loop import Job
from astrai.serve.logprobs import chat_logprobs, completion_logprobs
from astrai.serve.protocol import APIError
from astrai.serve.tools import ToolCallText, read_tool_calls

__all__ = ["Run", "body", "sse_lines", "engine_error"]


def engine_error(err: BaseException) -> APIError:
    """An engine-side failure as an API error: its refusals (ValueError) are 400, anything else 500."""
    if isinstance(err, APIError):
        return err
    if isinstance(err, ValueError):
        return APIError(str(err))
    return APIError(f"generation failed: {err}", status=500, kind="server_error")


class Run:
    """The engine jobs of one request and the state of its choices.

    Args:
        server: the app state (`loop`, `text_of`, `model_name`); jobs: one per prompt (validated);
        streams: one `TextStream` per choice; logprobs: k top tokens per generated token, None for no logprobs;
        prompt_tokens: the usage count of the prompts; chat: chat or text completion shapes;
        tools: the tool names a chat choice's calls are parsed against (None: its text is not parsed).
    """

    def __init__(self, server, jobs: list[Job], streams: list[TextStream], *, logprobs: Optional[int],
                 prompt_tokens: int, chat: bool, tools: Optional[frozenset[str]] = None):
        self.server, self.streams, self.logprobs, self.chat = server, streams, logprobs, chat
        self.tools = tools if chat else None
        self.n = jobs[0].n
        self.prompt_tokens = prompt_tokens
        self.tokens: list[list] = [[] for _ in streams]  # per choice: (token id, logprob, top) with logprobs on
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._queue: asyncio.Queue = asyncio.Queue()
        self._first = None
        self.jobs = [server.loop.submit(job, self._queue, tag=i) for i, job in enumerate(jobs)]

    async def started(self) -> None:
        """Wait for the first engine output (raises the engine's refusal of the request, as an `APIError`)."""
        self._first = await self._queue.get()
        if isinstance(self._first[1], BaseException):
            raise engine_error(self._first[1])

    def close(self) -> None:
        """Abort every job still generating (idempotent; finished ones are left alone)."""
        for job in self.jobs:
            self.server.loop.abort(job)

    async def steps(self) -> AsyncIterator[list[tuple[int, str]]]:
        """Per engine step: (choice, new text) for each choice that got tokens (text may be ""); ends when every
        choice has its finish_reason. Raises the engine's error (`APIError`) if it fails."""
        left = len(self.streams)
        while left:
            if self._first is not None:
                (tag, item), self._first = self._first, None
            else:
                tag, item = await self._queue.get()
            if isinstance(item, BaseException):
                raise engine_error(item)
            deltas = []
            for out in item:
                index = tag * self.n + out.choice
                stream = self.streams[index]
                if stream.finish_reason is not None:
                    continue
                if self.logprobs is not None and out.token_id not in stream.stop_token_ids:
                    self.tokens[index].append((out.token_id, out.logprob, out.top_logprobs))
                text = stream.push(out.token_id)
                if stream.finish_reason is None and out.done:
                    text += stream.finish(out.finished)
                elif stream.finish_reason is not None and not out.done:  # a stop string: free its row now
                    self.server.loop.abort(self.jobs[tag], out.choice)
                left -= stream.finish_reason is not None
                deltas.append((index, text))
            yield deltas

    def usage(self) -> dict:
        """OpenAI usage: prompts counted once each, every generated token (stop token included) counted."""
        completion = sum(s.num_tokens for s in self.streams)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}

    def head(self) -> dict:
        """The fields every body and chunk of this request starts with (id, object, created, model)."""
        kind = ("chat.completion.chunk" if self.chat else "text_completion")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.server.model_name}

    def logprobs_block(self, tokens: list, offset: int = 0) -> tuple[Optional[dict], int]:
        """(choice.logprobs for `tokens`, next text offset); (None, offset) when logprobs were not asked."""
        if self.logprobs is None:
            return None, offset
        if self.chat:
            return chat_logprobs(self.server.text_of, tokens), offset
        return completion_logprobs(self.server.text_of, tokens, offset)


async def body(run: Run) -> dict:
    """Non-streaming: run to the end and return the response body."""
    async for _ in run.steps():
        pass
    choices = []
    for i, stream in enumerate(run.streams):
        reason, calls = stream.finish_reason, None
        if run.tools is not None:
            content, calls = read_tool_calls(stream.text, run.tools)
            message = {"role": "assistant", "content": content or None if calls else content}
            text = {"message": {**message, "tool_calls": calls} if calls else message}
            reason = "tool_calls" if calls else reason
        else:
            text = {"message": {"role": "assistant", "content": stream.text}} if run.chat else {"text": stream.text}
        choices.append({"index": i, **text, "logprobs": run.logprobs_block(run.tokens[i])[0],
                        "finish_reason": reason})
    return {**run.head(), "object": "chat.completion" if run.chat else "text_completion", "choices": choices,
            "usage": run.usage()}


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def sse_lines(run: Run, include_usage: bool) -> AsyncIterator[str]:
    """Streaming: server-sent events, one chunk per piece of text (with the log-probs of its tokens), then one with
    each choice's finish_reason, optional usage, `[DONE]`. Engine errors after the first byte are sent in-stream."""
    sent, offsets = [0] * len(run.streams), [0] * len(run.streams)
    usage = {"usage": None} if include_usage else {}
    parsers = None if run.tools is None else [ToolCallText(run.tools) for _ in run.streams]

    def chunk(index: int, text: Optional[str], reason: Optional[str], first: bool = False,
              calls: Optional[list] = None) -> str:
        tokens, sent[index] = run.tokens[index][sent[index]:], len(run.tokens[index])
        logprobs, offsets[index] = run.logprobs_block(tokens, offsets[index]) if tokens else (None, offsets[index])
        if run.chat:
            delta = {"role": "assistant", "content": ""} if first else {} if text is None else {"content": text}
            if calls is not None:
                delta = {"tool_calls": calls}
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": reason}
        return _sse({**run.head(), "choices": [choice], **usage})

    try:
        if run.chat:
            for i in range(len(run.streams)):
                yield chunk(i, None, None, first=True)
        async for deltas in run.steps():
            for index, text in deltas:
                reason = run.streams[index].finish_reason
                if parsers is not None:
                    text, calls = parsers[index].push(text), None
                    if reason is not None:
                        rest, calls = parsers[index].finish()
                        text += rest
                        reason = "tool_calls" if calls else reason
                if text:
                    yield chunk(index, text, None)
                if parsers is not None and reason == "tool_calls":
                    for k, call in enumerate(calls):  # whole calls, as OpenAI's first delta of each
                        yield chunk(index, None, None, calls=[{"index": k, **call}])
                if reason is not None:
                    yield chunk(index, None, reason)
    except APIError as err:  # the status line is gone: report in the stream
        yield _sse(err.body())
        yield "data: [DONE]\n\n"
        return
    if include_usage:
        yield _sse({**run.head(), "choices": [], "usage": run.usage()})
    yield "data: [DONE]\n\n"
