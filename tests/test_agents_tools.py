"""astrai.agents.tools and astrai.agents.tool_calls: tool schemas from type hints and docstrings (transformers'
`get_json_schema`), tools loaded by reference, the Hermes `<tool_call>` format parsed without ever raising on model
output, and calling a tool with every failure turned into the text the model sees."""

import json
import textwrap
from typing import Literal

import pytest

from astrai.agents.tool_calls import (ToolCall, assistant_message, assistant_text, call_tool, format_tool_call,
                                      parse_tool_calls, template_supports_tools, tools_system_prompt,
                                      with_calls_in_text, with_tools_prompt)
from astrai.agents.tools import Tool, ToolError, load_tools, tool_from_function

pytest.importorskip("transformers")


def calculator(expression: str, precision: int = 2) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: The expression, e.g. "12 * 34".
        precision: Digits after the decimal point.
    """
    if "__" in expression or any(c.isalpha() for c in expression):
        raise ValueError(f"not arithmetic: {expression}")
    return f"{eval(expression, {'__builtins__': {}}):.{precision}f}"  # test-only: digits and operators


def convert(amount: float, unit: Literal["cm", "inch"], exact: bool = False) -> dict:
    """Convert a length.

    Args:
        amount: The length.
        unit: The unit to convert to.
        exact: Whether to keep every digit.
    """
    return {"value": amount * (2.54 if unit == "cm" else 1 / 2.54), "unit": unit, "exact": exact}


def lookup(name: str) -> str:
    """Look a name up.

    Args:
        name: The name.
    """
    return undefined_name  # noqa: F821 - raises NameError on purpose


def test_schema_of_a_typed_function_is_the_openai_function_format():
    tool = tool_from_function(calculator)
    assert tool.schema == {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {
                    "expression": {"type": "string", "description": 'The expression, e.g. "12 * 34".'},
                    "precision": {"type": "integer", "description": "Digits after the decimal point."},
                },
                "required": ["expression"],
            },
            "return": {"type": "string"},
        },
    }
    assert (tool.name, tool.description, tool.function) == ("calculator", "Evaluate an arithmetic expression.",
                                                            calculator)
    assert tool_from_function(calculator, name="calc").schema["function"]["name"] == "calc"


def _no_docstring(x: int) -> int:
    return x


def _no_hint(x):
    """Doc.

    Args:
        x: A thing.
    """


def _undocumented_argument(x: int):
    """Only a summary."""


@pytest.mark.parametrize("fn, missing", [(_no_docstring, "no docstring"), (_no_hint, "type hint"),
                                         (_undocumented_argument, "no description for the argument 'x'")])
def test_a_function_without_docstring_or_hints_is_one_line_naming_it(fn, missing):
    with pytest.raises(ToolError) as err:
        tool_from_function(fn)
    text = str(err.value)
    assert "\n" not in text and fn.__name__ in text and missing in text


def test_load_tools_by_module_path_and_file_and_callables(tmp_path, monkeypatch):
    source = textwrap.dedent('''
        def shout(text: str) -> str:
            """Shout.

            Args:
                text: What to shout.
            """
            return text.upper()
    ''')
    (tmp_path / "my_tools.py").write_text(source)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "file_tools.py").write_text(source.replace("shout", "whisper").replace(".upper", ".lower"))
    monkeypatch.syspath_prepend(str(tmp_path))
    tools = load_tools(["my_tools:shout", {"function": "whisper", "path": "sub/file_tools.py"},
                        {"function": "file_tools:whisper", "path": "sub/file_tools.py", "name": "quiet"},
                        calculator, tool_from_function(convert)], base_dir=tmp_path)
    assert [t.name for t in tools] == ["shout", "whisper", "quiet", "calculator", "convert"]
    assert tools[0].function("hi") == "HI" and tools[1].function("HI") == "hi"
    assert tools[2].schema["function"]["name"] == "quiet"


@pytest.mark.parametrize("reference, message", [
    ("no_colon", "rollout.tools.1: function 'no_colon': expected 'package.module:function'"),
    ("no_such_module_xyz:f", "rollout.tools.1: cannot import no_such_module_xyz: ModuleNotFoundError"),
    ({"function": "f", "path": "missing.py"}, "rollout.tools.1: path "),
    ({"function": "f", "pth": "x.py"}, "rollout.tools.1: expected {function"),
    ("json:nothing_here", "rollout.tools.1: json has no attribute 'nothing_here'"),
    ("json:__doc__", "rollout.tools.1: json:__doc__ is of type str, not a function"),
    (calculator, "rollout.tools.1: tool name 'calculator' is already taken by rollout.tools.0"),
])
def test_load_tools_refuses_in_one_line_naming_the_entry(reference, message, tmp_path):
    with pytest.raises(ToolError) as err:
        load_tools([calculator, reference], base_dir=tmp_path)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_parallel_calls_are_read_with_the_content():
    text = ("I will compute both.\n" + format_tool_call("calculator", {"expression": "1 + 2"}) + "\n"
            '<tool_call>{"name": "convert", "arguments": "{\\"amount\\": 1, \\"unit\\": \\"cm\\"}"}</tool_call>')
    content, calls, errors = parse_tool_calls(text, {"calculator", "convert"})
    assert content == "I will compute both."
    assert calls == [ToolCall(0, "calculator", {"expression": "1 + 2"}),
                     ToolCall(1, "convert", {"amount": 1, "unit": "cm"})]  # arguments as a JSON string: accepted
    assert errors == []
    assert parse_tool_calls("no call at all") == ("no call at all", [], [])


@pytest.mark.parametrize("body, message", [
    ('{"name": "calculator", "arguments": {"expression": "1"', "Error: the tool call is not valid JSON"),
    ("{'name': 'calculator', 'arguments': {}}", "Error: the tool call is not valid JSON"),  # Python, never eval'd
    ('["calculator", {}]', "Error: the tool call must be a JSON object"),
    ('{"arguments": {"expression": "1"}}', 'Error: the tool call has no "name" string'),
    ('{"name": 7, "arguments": {}}', 'Error: the tool call has no "name" string'),
    ('{"name": "rm_rf", "arguments": {}}', "Error: unknown tool 'rm_rf' (tools: calculator)"),
    ('{"name": "calculator", "arguments": [1, 2]}', 'Error: the "arguments" of calculator must be a JSON object'),
    ('{"name": "calculator", "arguments": "1 + 2"}', 'Error: the "arguments" of calculator must be a JSON object'),
    ("[" * 100_000 + "]" * 100_000, "Error: the tool call is not valid JSON"),  # RecursionError inside json
])
def test_malformed_calls_become_errors_never_exceptions(body, message):
    good = format_tool_call("calculator", {"expression": "2"})
    content, calls, errors = parse_tool_calls(f"before {good} middle <tool_call>{body}</tool_call> after",
                                              ["calculator"])
    assert content == "before  middle  after"
    assert calls == [ToolCall(0, "calculator", {"expression": "2"})]
    assert len(errors) == 1 and errors[0].index == 1 and errors[0].message.startswith(message)
    assert "\n" not in errors[0].message
    assert errors[0].name in (None, "calculator")  # an invented name never becomes a metric key (tool_calls/<name>)


def test_an_unclosed_call_runs_to_the_end_and_says_so():
    content, calls, errors = parse_tool_calls('Let me see <tool_call>{"name": "calculator", "argu', ["calculator"])
    assert content == "Let me see" and calls == []
    assert errors[0].message.endswith("(the <tool_call> block is not closed by </tool_call>)")
    _, calls, _ = parse_tool_calls('<tool_call>{"name": "calculator", "arguments": {}}', ["calculator"])
    assert calls == [ToolCall(0, "calculator", {})]  # complete JSON, only the closing tag missing: taken


def test_an_assistant_turn_keeps_its_calls_in_tool_calls_and_its_content_outside_them():
    """The message of a sampled turn, for every template: the text outside the calls as content (stripped), the
    well-formed calls in `tool_calls` (OpenAI shape, arguments a dict), a malformed block in neither (its error is
    returned for the result), a turn without a block as sampled."""
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "1 + 2"}}}
    text = "I will compute.\n" + format_tool_call("calculator", {"expression": "1 + 2"})
    message, calls, errors = assistant_message(text, ["calculator"])
    assert message == {"role": "assistant", "content": "I will compute.", "tool_calls": [call]}
    assert calls == [ToolCall(0, "calculator", {"expression": "1 + 2"})] and errors == []
    broken = 'Try 408. <tool_call>{"name": "calculator", "arguments": {"expression": "408"</tool_call> Then.'
    message, calls, errors = assistant_message(broken + format_tool_call("calculator", {"expression": "1 + 2"}),
                                               ["calculator"])
    assert message == {"role": "assistant", "content": "Try 408.  Then.", "tool_calls": [call]}
    assert [e.index for e in errors] == [0] and calls == [ToolCall(1, "calculator", {"expression": "1 + 2"})]
    cut = 'Let me see. <tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 34'  # budget cut it
    message, calls, errors = assistant_message(cut, ["calculator"])
    assert message == {"role": "assistant", "content": "Let me see."} and calls == [] and len(errors) == 1
    assert assistant_message(" The answer is 3.\n", ["calculator"]) == (
        {"role": "assistant", "content": " The answer is 3.\n"}, [], [])  # no block: the text as sampled


def test_calls_written_back_as_text_read_back_to_the_same_message():
    """`with_calls_in_text` writes an assistant's `tool_calls` (nested or flat, arguments a dict or a JSON string)
    back as the blocks the model writes, after the content: the sampled text when it was in the canonical form,
    which `assistant_message` reads back to the same message; other messages are untouched."""
    sampled = ("I will compute both.\n" + format_tool_call("calculator", {"expression": "1 + 2"}) + "\n"
               + format_tool_call("convert", {"amount": 1, "unit": "cm"}))
    message, _, _ = assistant_message(sampled, ["calculator", "convert"])
    user = {"role": "user", "content": "hi"}
    assert with_calls_in_text([user, message]) == [user, {"role": "assistant", "content": sampled}]
    assert assistant_message(with_calls_in_text([message])[0]["content"], ["calculator", "convert"])[0] == message
    openai_shaped = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "1"}'}},
        {"name": "convert", "arguments": {"amount": 1, "unit": "cm"}}]}
    assert with_calls_in_text([openai_shaped]) == [{"role": "assistant", "content": assistant_text(
        "", [("calculator", {"expression": "1"}), ("convert", {"amount": 1, "unit": "cm"})])}]
    assert "tool_calls" in openai_shaped  # the input is not modified
    assert assistant_text("", [("calculator", "not json")]) == (
        '<tool_call>\n{"name": "calculator", "arguments": "not json"}\n</tool_call>')  # written as it is


def test_call_tool_results_and_errors():
    calc, conv, look = (tool_from_function(f) for f in (calculator, convert, lookup))
    assert call_tool(calc, {"expression": "12 * 34", "precision": 0}) == ("408", None)
    assert call_tool(conv, {"amount": 2, "unit": "cm", "exact": True}) == (
        '{"value": 5.08, "unit": "cm", "exact": true}', None)  # a dict result: as JSON
    cases = [
        (calc, {}, "Error: calculator is missing the required argument 'expression'"),
        (calc, {"expression": "1", "digits": 3}, "Error: calculator takes no argument 'digits' (it takes: "
                                                 "expression, precision)"),
        (calc, {"expression": 12}, "Error: argument 'expression' of calculator must be of type string, got 12"),
        (calc, {"expression": "1", "precision": True}, "Error: argument 'precision' of calculator must be of type "
                                                       "integer, got true"),
        (conv, {"amount": 1, "unit": "mile"}, "Error: argument 'unit' of convert must be one of ['cm', 'inch']"),
        (calc, {"expression": "__import__('os')"}, "Error: ValueError: not arithmetic: __import__('os')"),
        (look, {"name": "x"}, "Error: NameError: name 'undefined_name' is not defined"),
    ]
    for tool, arguments, expected in cases:
        text, error = call_tool(tool, arguments)
        assert text == error and text.startswith(expected), (arguments, text)


def test_a_tool_without_arguments_refuses_one():
    def now() -> str:
        """The time."""
        return "noon"

    tool = tool_from_function(now)
    assert call_tool(tool, {}) == ("noon", None)
    assert call_tool(tool, {"zone": "UTC"})[1] == "Error: now takes no argument 'zone' (it takes: none)"


def test_tools_prompt_lists_every_schema_in_the_system_turn():
    tools = [tool_from_function(calculator), tool_from_function(convert)]
    prompt = tools_system_prompt(tools)
    lines = prompt.split("\n")
    start = lines.index("<tools>")
    assert [json.loads(line) for line in lines[start + 1:start + 3]] == [t.schema for t in tools]
    assert lines[start + 3] == "</tools>" and prompt.endswith(
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
    user = {"role": "user", "content": "hi"}
    assert with_tools_prompt([user], tools) == [{"role": "system", "content": prompt}, user]
    with_system = with_tools_prompt([{"role": "system", "content": "Be brief."}, user], tools)
    assert with_system[0]["content"] == "Be brief.\n\n" + prompt and with_system[1] == user


def test_template_supports_tools_reads_the_variable_not_the_text():
    assert template_supports_tools("{% if tools %}{{ tools | tojson }}{% endif %}{{ messages[0]['content'] }}")
    assert not template_supports_tools("{{ 'no tools here' }}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert not template_supports_tools("{% set tools = [] %}{{ tools }}")  # assigned by the template itself
    with pytest.raises(ValueError, match="not valid Jinja2"):
        template_supports_tools("{% if tools %}")
    assert isinstance(tool_from_function(calculator), Tool)


def test_an_async_tool_is_awaited_not_shown_as_a_coroutine():
    import asyncio

    from astrai.agents.tool_calls import call_tool
    from astrai.agents.tools import tool_from_function

    async def lookup(city: str) -> str:
        """Look a city up.

        Args:
            city: its name.
        """
        await asyncio.sleep(0)
        return city.upper()

    assert call_tool(tool_from_function(lookup), {"city": "paris"}) == ("PARIS", None)
