"""The tool-call text format, for chat templates without tool support (SmolLM2's ChatML), and calling a tool.

The format is Hermes function calling (NousResearch Hermes 2 Pro), as Qwen2.5's template renders it: the tools'
JSON schemas are listed in the system turn (`tools_system_prompt`, the text of Qwen2.5's template), and the model
calls a tool by writing, anywhere in its assistant text, one block per call (several blocks = parallel calls)::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12 * 34"}}
    </tool_call>

Each result goes back in a ``{"role": "tool", "content": ...}`` message. A template with tool support (it reads the
``tools`` variable: `template_supports_tools`; Qwen2.5, Qwen3, Llama 3.x) gets the schemas through that variable
instead (`astrai.agents.chat.render`). `parse_tool_calls` reads calls from model text with `json.loads` only (never
eval) and never raises: every malformed call becomes an error entry whose text the model sees as that call's result.

Messages hold calls in the OpenAI shape whatever the template (`assistant_message`, as TRL, verl and the OpenAI API
give them): ``{"role": "assistant", "content": <the text outside the calls>, "tool_calls": [{"type": "function",
"function": {"name", "arguments": {...}}}]}``. A malformed block (one `parse_tool_calls` reports as an error, a
block the budget cut open included) is left out of the content as well, and is in no ``tool_calls``: the model
meant a call, so it is answered as one (its error is the result the model reads, a ``tool`` message) and is never
read as part of the answer, which is what rewards read in the content (a number in a broken call's arguments must
not pay). vLLM's Hermes parser keeps unparsable calls as text instead, as `astrai.serve` does for an API client,
who decides; in an episode the rollout has decided. For a template without tool support the calls are written back
into the text, in this format, when a conversation is rendered (`with_calls_in_text`).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import traceback
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Collection, Mapping, Optional, Sequence

from astrai.agents.tools import Tool

__all__ = ["ToolCall", "ToolCallError", "parse_tool_calls", "assistant_message", "format_tool_call", "assistant_text",
           "with_calls_in_text", "tools_system_prompt", "with_tools_prompt", "template_supports_tools", "call_tool",
           "call_tool_traced", "argument_problem", "result_text", "schema_of"]

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", re.DOTALL)
_JSON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
               "array": (list,), "object": (dict,), "null": (type(None),)}


@dataclass(frozen=True)
class ToolCall:
    """A well-formed call: the `index`-th ``<tool_call>`` block of the text (0-based), the tool `name` and its
    `arguments` (a dict, ``{}`` when the call gives none)."""

    index: int
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ToolCallError:
    """A malformed call: the `index`-th block, the tool `name` when it could be read and names a known tool (for
    per-tool metrics; None otherwise, so that a model inventing names adds no metric keys: they count as
    ``unknown``), and `message`, the one-line text the model sees as that call's result (``"Error: ..."``, which
    quotes an unknown name)."""

    index: int
    name: Optional[str]
    message: str


def parse_tool_calls(text: str, tools: Optional[Collection[str]] = None
                     ) -> tuple[str, list[ToolCall], list[ToolCallError]]:
    """(content, calls, errors) of assistant `text`: `content` is the text without its ``<tool_call>`` blocks
    (stripped); each block is a `ToolCall` or a `ToolCallError` (their `index` orders them). A block left open
    (the turn ended inside it) runs to the end of the text. Errors: not valid JSON, not a JSON object, no string
    ``"name"``, a name not in `tools` (the known names; None: not checked), ``"arguments"`` not an object (a JSON
    string holding an object is accepted, as OpenAI writes arguments). Never raises."""
    calls: list[ToolCall] = []
    errors: list[ToolCallError] = []
    for index, match in enumerate(_BLOCK.finditer(text)):
        body = match.group(1)
        closed = match.group(0).endswith(CLOSE)
        call = _read_call(index, body.strip(), tools)
        if isinstance(call, ToolCallError) and not closed:
            call = ToolCallError(index, call.name, f"{call.message} (the {OPEN} block is not closed by {CLOSE})")
        (calls if isinstance(call, ToolCall) else errors).append(call)
    return _BLOCK.sub("", text).strip(), calls, errors


def assistant_message(text: str, tools: Optional[Collection[str]] = None
                      ) -> tuple[dict[str, Any], list[ToolCall], list[ToolCallError]]:
    """(message, calls, errors) of a sampled assistant turn's `text` (`parse_tool_calls`' calls and errors;
    `tools`: the known names). The message is ``{"role": "assistant", "content": ...}`` plus, when the turn made
    well-formed calls, ``"tool_calls": [{"type": "function", "function": {"name", "arguments": {...}}}]`` (the
    OpenAI shape, arguments as a dict as chat templates read them). Its content is the text outside every
    ``<tool_call>`` block, stripped, malformed blocks left out too (module docstring); a turn without any block
    keeps its text as sampled. Never raises."""
    content, calls, errors = parse_tool_calls(text, tools)
    message: dict[str, Any] = {"role": "assistant", "content": content if calls or errors else text}
    if calls:
        message["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in calls]
    return message, calls, errors


def _read_call(index: int, body: str, tools: Optional[Collection[str]]) -> ToolCall | ToolCallError:
    """One block's body as a call, or the error the model will read."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as err:  # RecursionError: absurdly nested JSON
        return ToolCallError(index, None, f"Error: the tool call is not valid JSON ({_one_line(err)})")
    if not isinstance(data, dict):
        return ToolCallError(index, None, f"Error: the tool call must be a JSON object with \"name\" and "
                                          f"\"arguments\", got a JSON {type(data).__name__}")
    name = data.get("name")
    if not isinstance(name, str) or not name:
        return ToolCallError(index, None, "Error: the tool call has no \"name\" string")
    if tools is not None and name not in tools:
        known = ", ".join(sorted(tools)) or "none"
        return ToolCallError(index, None, f"Error: unknown tool {name!r} (tools: {known})")
    arguments = data.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError):
            pass  # reported below as not an object
    if not isinstance(arguments, dict):
        return ToolCallError(index, name, f"Error: the \"arguments\" of {name} must be a JSON object, got "
                                          f"{json.dumps(arguments, ensure_ascii=False)[:100]}")
    return ToolCall(index, name, arguments)


def format_tool_call(name: str, arguments: Mapping[str, Any]) -> str:
    """The block that calls `name` with `arguments`, as Qwen2.5's template renders an assistant's ``tool_calls``
    (for demonstrations and tests); `parse_tool_calls` reads it back."""
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': dict(arguments)}, ensure_ascii=False)}\n{CLOSE}"


def assistant_text(content: Optional[str], calls: Sequence[tuple[str, Any]]) -> str:
    """The assistant text that makes (`content`, `calls`: (name, arguments) pairs) in this format: the content,
    then each call's block (`format_tool_call`), one per line, as Qwen2.5's template writes an assistant's
    ``tool_calls``; `assistant_message` reads back (`content`, `calls`). Arguments that are not a mapping (a JSON
    string is read first) are written as they are."""
    blocks = []
    for name, arguments in calls:
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except (ValueError, RecursionError):
                pass
        if isinstance(arguments, Mapping):
            blocks.append(format_tool_call(name, arguments))
        else:
            body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False, default=str)
            blocks.append(f"{OPEN}\n{body}\n{CLOSE}")
    return "\n".join(([content] if content else []) + blocks)


def with_calls_in_text(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """`messages` for a chat template without tool support: each assistant message's ``tool_calls`` (OpenAI shape,
    ``{"function": {"name", "arguments"}}`` or ``{"name", "arguments"}``; arguments a dict or a JSON string) written
    back into its content as this format's blocks (`assistant_text`) and the key dropped, so the rendered turn is
    the text the model sampled (when it wrote the calls in the canonical form). The input is not modified."""
    out = []
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None) if m.get("role") == "assistant" else None
        if calls:
            pairs = []
            for call in calls:
                function = call.get("function", call) if isinstance(call, Mapping) else {}
                function = function if isinstance(function, Mapping) else {}
                pairs.append((function.get("name"), function.get("arguments", {})))
            m["content"] = assistant_text(m.get("content") or "", pairs)
        out.append(m)
    return out


def tools_system_prompt(tools: Sequence[Tool | Mapping[str, Any]]) -> str:
    """The text listing `tools` (Tools or their schemas) and the call format, as Qwen2.5's chat template writes it
    in the system turn (one schema per line, ``tojson``)."""
    schemas = "".join("\n" + json.dumps(schema_of(t), ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>{schemas}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            f"{OPEN}{CLOSE} XML tags:\n{OPEN}\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n' + CLOSE)


def with_tools_prompt(messages: Sequence[Mapping[str, Any]], tools: Sequence[Tool | Mapping[str, Any]]
                      ) -> list[dict[str, Any]]:
    """`messages` with `tools_system_prompt(tools)` in the system turn: after the first message's content and a
    blank line when it is a system message, else as a new first system message (which replaces a template's
    built-in default system prompt, e.g. SmolLM2's). The input is not modified."""
    messages = [dict(m) for m in messages]
    prompt = tools_system_prompt(tools)
    if messages and messages[0].get("role") == "system":
        content = messages[0].get("content") or ""
        messages[0]["content"] = f"{content}\n\n{prompt}" if content else prompt
        return messages
    return [{"role": "system", "content": prompt}, *messages]


@lru_cache(maxsize=16)
def template_supports_tools(chat_template: str) -> bool:
    """Whether `chat_template` (Jinja2 source) reads the ``tools`` variable (then the schemas go through it).
    Cached per template source (rendering asks once per conversation, SFT data once per example).

    Raises:
        ValueError: one line, when the template is not valid Jinja2.
    """
    import jinja2
    import jinja2.ext
    import jinja2.meta

    try:
        parsed = jinja2.Environment(extensions=[jinja2.ext.loopcontrols]).parse(chat_template)
    except jinja2.TemplateSyntaxError as err:
        raise ValueError(f"the chat template is not valid Jinja2: line {err.lineno}: {_one_line(err)}") from None
    return "tools" in jinja2.meta.find_undeclared_variables(parsed)


def call_tool(tool: Tool, arguments: Mapping[str, Any]) -> tuple[str, Optional[str]]:
    """(result text, error text or None) of calling `tool` with `arguments` as keywords, in this process.

    The arguments are checked against the signature and the schema first: a missing required argument, an
    argument the function does not take, or a value of the wrong JSON type (or outside its ``enum``) is an error
    naming it. An exception the tool raises becomes ``"Error: <ExceptionType>: <message>"`` (one line); on any
    error the result text is the error text, what the model sees. A result is shown as itself when a string, as
    JSON when a dict or list, else by `str`. Never raises (but lets KeyboardInterrupt through).
    Isolation (worker processes, a hard timeout, truncation of long results) is a later slice.
    """
    return call_tool_traced(tool, arguments)[:2]


def call_tool_traced(tool: Tool, arguments: Mapping[str, Any]) -> tuple[str, Optional[str], Optional[str]]:
    """`call_tool`'s (result text, error text or None) and the traceback of an exception the tool raised (from the
    tool's own frame on, as `traceback.format_exception` writes it), else None. Never raises (but lets
    KeyboardInterrupt through)."""
    problem = argument_problem(tool, arguments)
    if problem is not None:
        return problem, problem, None
    try:
        result = tool.function(**arguments)
        if inspect.isawaitable(result):  # an `async def` tool: awaited here (in a worker: under the timeout)
            result = asyncio.run(_awaited(result))
    except (Exception, SystemExit) as err:
        text = f"Error: {type(err).__name__}: {_one_line(err)}"
        tb = err.__traceback__
        tb = tb.tb_next if tb is not None and tb.tb_next is not None else tb  # this frame left out
        return text, text, "".join(traceback.format_exception(type(err), err, tb))
    return result_text(result), None, None


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def result_text(result: Any) -> str:
    """How the model sees a tool's return value: a string as itself, a dict or list as JSON, anything else by
    `str`."""
    if isinstance(result, str):
        return result
    if isinstance(result, (dict, list)):
        try:
            return json.dumps(result, ensure_ascii=False, default=str)
        except (TypeError, ValueError):
            pass
    return str(result)


def argument_problem(tool: Tool, arguments: Mapping[str, Any]) -> Optional[str]:
    """The error text for `arguments` that do not fit `tool` (signature, then schema types), or None."""
    try:
        params = list(inspect.signature(tool.function).parameters.values())
        known = True
    except (TypeError, ValueError):  # a builtin without a signature: left to the call itself
        params, known = [], False
    names = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params)
    for p in params:
        if p.name in names and p.default is p.empty and p.name not in arguments:
            return f"Error: {tool.name} is missing the required argument {p.name!r}"
    if known and not takes_any:
        unknown = [key for key in arguments if key not in names]
        if unknown:
            return f"Error: {tool.name} takes no argument {unknown[0]!r} (it takes: {', '.join(names) or 'none'})"
    properties = tool.parameters.get("properties") or {}
    for key, value in arguments.items():
        schema = properties.get(key) or {}
        kinds = schema.get("type")
        kinds = [kinds] if isinstance(kinds, str) else list(kinds or [])
        if value is None and schema.get("nullable"):
            continue
        if kinds and not any(_is_json_type(value, kind) for kind in kinds):
            return (f"Error: argument {key!r} of {tool.name} must be of type {' or '.join(kinds)}, got "
                    f"{json.dumps(value, ensure_ascii=False, default=str)[:100]}")
        if "enum" in schema and value not in schema["enum"]:
            return f"Error: argument {key!r} of {tool.name} must be one of {schema['enum']}, got {value!r}"
    return None


def _is_json_type(value: Any, kind: str) -> bool:
    """Whether `value` (decoded JSON) has JSON-schema type `kind` (a bool is no integer or number)."""
    if kind not in _JSON_TYPES:
        return True  # a type this check does not know: not refused here
    return isinstance(value, _JSON_TYPES[kind]) and not (isinstance(value, bool) and kind in ("integer", "number"))


def schema_of(tool: Tool | Mapping[str, Any]) -> dict[str, Any]:
    """The JSON schema of a Tool, or the schema itself when given one."""
    return dict(tool.schema) if isinstance(tool, Tool) else dict(tool)


def _one_line(err: BaseException, limit: int = 300) -> str:
    """An exception's text on one line, at most `limit` characters."""
    text = " ".join(str(err).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."
