"""OpenAI function calling on `/v1/chat/completions`, in the model's own tool-call format (what the agents' rollout
trains: `astrai.agents`).

Request: `tools` (OpenAI function tools) are rendered into the prompt by `astrai.agents.chat.render`, the rollout's
one rendering (the template's ``tools`` variable when it reads one, else the Hermes system prompt). The conversation's
assistant `tool_calls` and `role: "tool"` results become the messages the rollout writes (`conversation`): an
assistant message ``{"content", "tool_calls": [{"type": "function", "function": {"name", "arguments": {...}}}]}``
whatever the template, which `render` gives to a template with tool support as they are and writes back for one
without as ``<tool_call>`` blocks after the content (`astrai.agents.tool_calls.with_calls_in_text`, the text the
model emits and `parse_tool_calls` reads), as the rollout renders its episodes; a tool result is ``{"role":
"tool", "name": <the called tool>, "content"}``, its name found by its `tool_call_id`.
`tool_choice` "auto" (the default) renders and parses the tools; "none" neither renders nor parses them (the model
is not told about tools; earlier calls in the conversation are still rendered). "required", a named function and
`parallel_tool_calls: false` are refused (400 naming the field): sampling is not constrained, so none can be
honoured.

Response: with tools, a choice's text is read by `astrai.agents.tool_calls.parse_tool_calls`; when every
``<tool_call>`` block is a well-formed call of a tool in `tools`, they become `message.tool_calls` (ids
``call_<24 hex>``, arguments as a JSON string), `content` the text outside them (stripped, null when empty) and
`finish_reason` "tool_calls". Otherwise (no block, a block that is not valid JSON or names a tool not offered) the
whole text stays `content`, stripped of surrounding whitespace, with the finish reason of the generation.
Streaming (`ToolCallText`): content is sent as it arrives until a ``<tool_call>`` block may start; from there the
text is held to the end, then the rest of the content and one delta per call (its id, name and whole arguments)
are sent, so the streamed message equals the non-streamed one.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from astrai.agents.tool_calls import OPEN, parse_tool_calls
from astrai.serve.protocol import APIError, ChatCompletionRequest, message_text

__all__ = ["ToolSetup", "tool_setup", "conversation", "read_tool_calls", "ToolCallText"]

_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function names


@dataclass(frozen=True)
class ToolSetup:
    """What a chat request's tools mean for its prompt and its answer.

    Attributes:
        schemas: the tools as sent (OpenAI function format), given to the chat template; empty: none rendered.
        names: the tool names calls are parsed against; None: the answer is not parsed (no tools, or
            `tool_choice` "none").
    """

    schemas: tuple[dict, ...] = ()
    names: Optional[frozenset[str]] = None


def _unsupported(param: str, what: str) -> APIError:
    return APIError(f"{param}: {what}", param=param, code="unsupported_parameter")


def tool_setup(req: ChatCompletionRequest) -> ToolSetup:
    """The request's `tools`, `tool_choice` and `parallel_tool_calls`, checked (module docstring).

    Raises:
        APIError: 400 naming the field: a tool that is not `{"type": "function", "function": {"name", "description"?,
            "parameters"?}}`, a name OpenAI would refuse or one given twice, `strict: true`; `tool_choice` other
            than "auto" / "none"; `parallel_tool_calls: false`.
    """
    choice = req.tool_choice
    if isinstance(choice, dict) or choice == "required":
        what = "a named function" if isinstance(choice, dict) else "'required'"
        raise _unsupported("tool_choice", f"{what} is not supported (sampling is not constrained to a call); use "
                                          "'auto' or 'none'")
    if choice not in (None, "auto", "none"):
        raise APIError(f"tool_choice: expected 'auto' or 'none', got {choice!r}", param="tool_choice")
    if req.parallel_tool_calls is False:
        raise _unsupported("parallel_tool_calls", "false is not supported (sampling cannot be kept to one call); "
                                                  "leave it out or set it true")
    schemas = [_checked_tool(tool, i) for i, tool in enumerate(req.tools or ())]
    names = [s["function"]["name"] for s in schemas]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise APIError(f"tools.[{i}].function.name: {name!r} is already the name of tools.[{names.index(name)}]",
                           param=f"tools.[{i}].function.name")
    if not schemas or choice == "none":
        return ToolSetup()
    return ToolSetup(tuple(schemas), frozenset(names))


def _checked_tool(tool: Any, i: int) -> dict:
    """tools[i] as sent, when it is a function tool OpenAI accepts; APIError naming the field otherwise."""
    where = f"tools.[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        got = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
        raise APIError(f"{where}.type: only function tools ('function') are supported, got {got!r}",
                       param=f"{where}.type")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise APIError(f"{where}.function: expected an object with name, description, parameters",
                       param=f"{where}.function")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise APIError(f"{where}.function.name: expected 1 to 64 letters, digits, '_' or '-', got {name!r}",
                       param=f"{where}.function.name")
    if not isinstance(function.get("description", ""), str):
        raise APIError(f"{where}.function.description: expected a string", param=f"{where}.function.description")
    if not isinstance(function.get("parameters", {}), dict):
        raise APIError(f"{where}.function.parameters: expected a JSON schema object",
                       param=f"{where}.function.parameters")
    if function.get("strict"):
        raise _unsupported(f"{where}.function.strict", "true is not supported (sampling is not constrained to the "
                                                       "schema)")
    return tool


def conversation(messages: Sequence) -> list[dict[str, Any]]:
    """The request's `messages` (`ChatMessage`s) as the rollout's messages (module docstring): {"role", "content"}
    plus, for an assistant's `tool_calls`, the calls (OpenAI shape, arguments as objects), and for a `tool` message
    the called tool's ``name``.

    Raises:
        APIError: 400 naming the field: a call that is not {"id", "type": "function", "function": {"name",
            "arguments": a JSON object as a string}}; a tool message whose `tool_call_id` no earlier call has.
    """
    out, called = [], {}
    for i, message in enumerate(messages):
        rendered: dict[str, Any] = message_text(message, i)
        extra = message.model_extra or {}
        if message.role == "assistant" and extra.get("tool_calls"):
            calls = [_checked_call(call, f"messages.[{i}].tool_calls.[{j}]", called)
                     for j, call in enumerate(extra["tool_calls"])]
            rendered["tool_calls"] = [{"type": "function", "function": {"name": name, "arguments": args}}
                                      for name, args in calls]
        elif message.role == "tool":
            call_id = extra.get("tool_call_id")
            if not isinstance(call_id, str) or call_id not in called:
                raise APIError(f"messages.[{i}].tool_call_id: a tool message must answer a call of an earlier "
                               f"assistant message by its id, got {call_id!r}", param=f"messages.[{i}].tool_call_id")
            rendered["name"] = called[call_id]
        out.append(rendered)
    return out


def _checked_call(call: Any, where: str, called: dict[str, str]) -> tuple[str, dict]:
    """(name, arguments) of one assistant tool call; its id is recorded in `called`."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or call.get("type", "function") != "function":
        raise APIError(f"{where}: expected {{id, type: 'function', function: {{name, arguments}}}}", param=where)
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise APIError(f"{where}.function.name: expected a string", param=f"{where}.function.name")
    arguments = function.get("arguments", "{}")
    try:
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    except (ValueError, RecursionError):
        arguments = None
    if not isinstance(arguments, dict):
        raise APIError(f"{where}.function.arguments: expected a JSON object as a string", param=f"{where}.function"
                                                                                               ".arguments")
    if isinstance(call.get("id"), str):
        called[call["id"]] = name
    return name, arguments


def read_tool_calls(text: str, names: frozenset[str]) -> tuple[str, Optional[list[dict]]]:
    """(content, tool_calls) of a choice's `text` in the OpenAI shape: when every ``<tool_call>`` block is a call
    of a tool in `names`, (the text outside them, stripped; the calls, ids ``call_...``, arguments as JSON
    strings), else (the text stripped, None)."""
    content, calls, errors = parse_tool_calls(text, names)
    if errors or not calls:
        return text.strip(), None
    return content, [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
                     for c in calls]


class ToolCallText:
    """One streamed choice's content with tools: `push` the text deltas, `finish` at the end (module docstring).

    Content is sent stripped: leading whitespace never, trailing whitespace once more text follows it; from the
    first ``<tool_call>`` (or a tail that may start one) the text waits for `finish`.
    """

    def __init__(self, names: frozenset[str]):
        self.names, self.text, self.sent, self.held = names, "", "", False

    def push(self, delta: str) -> str:
        """Add `delta` (the choice's new text); returns the content to send now (possibly "")."""
        self.text += delta
        if self.held:
            return ""
        start = self.text.find(OPEN)
        self.held = start >= 0
        visible = self.text[:start] if self.held else self.text[:len(self.text) - _open_tail(self.text)]
        return self._send(visible.strip())

    def finish(self) -> tuple[str, Optional[list[dict]]]:
        """(the rest of the content, the tool calls or None) once the choice has ended."""
        content, calls = read_tool_calls(self.text, self.names)
        rest = content[len(self.sent):] if content.startswith(self.sent) else content  # always a prefix (see above)
        self.sent = content
        return rest, calls

    def _send(self, upto: str) -> str:
        if len(upto) <= len(self.sent):
            return ""
        delta, self.sent = upto[len(self.sent):], upto
        return delta


def _open_tail(text: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of ``<tool_call>``."""
    return max((k for k in range(1, len(OPEN)) if text.endswith(OPEN[:k])), default=0)
