"""How a prompt becomes token ids: through the tokenizer's chat template, or as raw text (`data.chat_template`).

The decision is made in one place, `uses_chat_template(tokenizer, setting)`, and everything that renders a prompt
asks it: the prompts of the online train types, of dpo / offline grpo / rm (`astrai.data.truncation.encode_prompt`,
with `data.truncation`), the held-out set of `train.eval_steps`, `python -m astrai.evaluate`, `--check`, the
start-up line (`check_job_prompt_format`) and the server (`astrai.serve`: a chat request needs the template; a
completion prompt is raw text, `raw_prompt_ids`).

`data.chat_template`:

- `true`: the chat template (a system turn from `data.system_prompt`, the question as the user turn, the generation
  prompt); a tokenizer without one is refused in one line naming the field.
- `false`: raw text: the prompt string encoded as it is stored, after the tokenizer's BOS token when the tokenizer
  adds one (`Tokenizer.add_bos_token`: base Llama and Gemma tokenizers do, GPT-2-style byte-level ones such as
  Qwen's and SmolLM2's do not). That is `transformers`' convention (`tokenizer(text)` with its default
  `add_special_tokens=True`) and vLLM's for a completion prompt, i.e. how a base model saw text in pre-training.
  TRL's GRPOTrainer encodes a non-conversational prompt with `add_special_tokens=False` (no BOS), which leaves a
  base Llama or Gemma model without the BOS it always had in front.
- `null` (the default): the template when the tokenizer has one, raw text otherwise; the choice of raw text is said
  once at start-up.

Raw text and what needs a template:

- a prompt stored as a chat (a list of messages) is refused, naming the file and row: rendering a chat is what a
  template is for;
- `data.system_prompt` is refused (at config time for `false`, at start-up or `--check` for `null`). TRL has no
  system prompt for non-conversational prompts: a system message exists only inside a conversational prompt,
  and a standard prompt is passed to the model verbatim. Prepending it as plain text would invent a format
  ("System: ...") that the model never saw and that evaluation, serving and other tools would not reproduce, so
  the text belongs in the prompts themselves;
- sft trains on chats and always needs the template (`TrainType.renders`); seq trains on raw documents and never
  uses one.
"""

from __future__ import annotations

from typing import Callable, Optional

from astrai.config_schema import ConfigError

__all__ = ["CHAT_TEMPLATE_FIELD", "uses_chat_template", "bos_prefix", "raw_prompt_ids", "raw_prompts_notice",
           "check_prompt_format", "check_job_prompt_format", "refuse_system_prompt"]

CHAT_TEMPLATE_FIELD = "data.chat_template"
"""The config field that chooses between the chat template and raw text."""


def _model(model: Optional[str]) -> str:
    """How messages name the tokenizer: "the tokenizer of <model>" when the model is known."""
    return f"the tokenizer of {model}" if model else "the tokenizer"


def uses_chat_template(tokenizer, setting: Optional[bool] = None, *, model: Optional[str] = None) -> bool:
    """Whether prompts go through `tokenizer`'s chat template under `setting` (`data.chat_template`: True, False or
    None = the template when the tokenizer has one). The one place this is decided.

    Raises:
        ConfigError: `setting` True and the tokenizer has no chat template (one line naming the field and, when
            given, the `model`).
    """
    has = bool(getattr(tokenizer, "chat_template", None))
    if setting is None:
        return has
    if setting and not has:
        raise ConfigError(f"{CHAT_TEMPLATE_FIELD}: true, but {_model(model)} has no chat template (a base model?); "
                          f"set it to false (raw text prompts) or null (raw text when there is no template)")
    return bool(setting)


def bos_prefix(tokenizer) -> list[int]:
    """`[bos id]` when the tokenizer puts its BOS token in front of text (`add_bos_token`), else `[]`."""
    bos = tokenizer.bos_token_id
    return [bos] if getattr(tokenizer, "add_bos_token", False) and bos is not None else []


def raw_prompt_ids(tokenizer, text: str, *, special_tokens: bool = False) -> list[int]:
    """Token ids of a raw text prompt: the BOS token when the tokenizer adds one (`bos_prefix`; not twice when the
    text already starts with it), then the text.

    Args:
        special_tokens: False (data): the text is encoded as text (`Tokenizer.encode_text`: a control token's
            spelling gives ordinary ids). True (a client's completion prompt, as vLLM and OpenAI's completions
            read it): control tokens spelled in the text become their ids (`Tokenizer.encode`).
    """
    ids = tokenizer.encode(text) if special_tokens else tokenizer.encode_text(text)
    prefix = bos_prefix(tokenizer)
    return ids if ids[:len(prefix)] == prefix else prefix + ids


def raw_prompts_notice(tokenizer, *, model: Optional[str] = None) -> str:
    """The start-up line said when `data.chat_template` null chose raw text (the tokenizer has no template)."""
    bos = "after the BOS token" if bos_prefix(tokenizer) else "without a BOS token"
    return (f"{CHAT_TEMPLATE_FIELD}: {_model(model)} has no chat template, so prompts are raw text (the text as "
            f"stored, {bos}); set {CHAT_TEMPLATE_FIELD} false to choose this explicitly")


def refuse_system_prompt(setting: Optional[bool], *, model: Optional[str] = None) -> ConfigError:
    """The one-line error for `data.system_prompt` with raw text prompts (`setting`: `data.chat_template`)."""
    if setting is False:
        why, other = f"{CHAT_TEMPLATE_FIELD} is false", f"set {CHAT_TEMPLATE_FIELD} to true"
    else:
        why, other = f"{_model(model)} has no chat template", "use a model with a template"
    return ConfigError(f"data.system_prompt: a system message needs the chat template, but prompts are raw text "
                       f"({why}); write the text into the prompts themselves, or {other}")


def check_prompt_format(tokenizer, setting: Optional[bool], *, system_prompt: Optional[str] = None,
                        model: Optional[str] = None, say: Callable[[str], None] = print) -> bool:
    """Decide once, before any prompt is encoded, how prompts are rendered (`uses_chat_template`); say
    `raw_prompts_notice` through `say` when `setting` None chose raw text. Returns the decision.

    Raises:
        ConfigError: `setting` True without a template, or a `system_prompt` with raw text (one line each).
    """
    template = uses_chat_template(tokenizer, setting, model=model)
    if not template and system_prompt:
        raise refuse_system_prompt(setting, model=model)
    if not template and setting is None:
        say(raw_prompts_notice(tokenizer, model=model))
    return template


def check_job_prompt_format(config, tokenizer, *, say: Callable[[str], None] = print) -> Optional[bool]:
    """Start-up (training and `--check`) check of a job's `data.chat_template` against its loaded tokenizer, by
    what its train type renders (`TrainType.renders`): prompts (`check_prompt_format`, the notice said through
    `say`), chats (sft: the template is required) or raw documents (seq: nothing to check). Returns whether prompts
    use the template (None for seq).

    Raises:
        ConfigError: one line naming the field at fault.
    """
    from astrai import train_types

    spec = train_types.get(config.train.type)
    d, model = config.data, config.model.path
    if spec.renders == "text":
        return None
    if spec.renders == "chats":
        if not uses_chat_template(tokenizer, d.chat_template, model=model):
            raise ConfigError(f"model.path: {_model(model)} has no chat template, which train.type {spec.name} "
                              f"needs to render the chats of data.messages_field ({d.messages_field!r})")
        return True
    return check_prompt_format(tokenizer, d.chat_template, system_prompt=d.system_prompt, model=model, say=say)
