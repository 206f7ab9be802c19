"""The prompts of an online job: `data.path` (or the blend of `data.mixture`) loaded once, rendered as
`data.chat_template` says (the chat template or raw text, `astrai.data.prompt_format`), with overlong prompts handled
by `data.truncation`, each record keeping its stored prompt and columns for the rewards."""

from __future__ import annotations

import warnings

from astrai.data import PromptDataset
from astrai.data.prompts import mixture_records
from astrai.data.truncation import EncodedPrompt, encode_prompt_records
from astrai.rewards.build import answer_readers, reward_specs
from astrai.rewards.builtins import unscorable_warning

__all__ = ["load_online_prompts", "online_data"]


def online_data(config, model_config, tokenizer, *, main: bool = True) -> list[EncodedPrompt]:
    """The data of a train type that samples online: the `data.path` prompts, rendered and fitted
    (`load_online_prompts`; `model_config` is not needed). Raises DataError for bad data."""
    return load_online_prompts(config, tokenizer, main=main)


def _quiet(message: str) -> None:
    """A log that prints nothing (ranks other than the main one)."""


def _prompt_datasets(config, *, require_answers: bool) -> tuple[list[PromptDataset], str]:
    """The prompt datasets of the job (`data.mixture`'s files of weight > 0, else `data.path`) and how to name
    them."""
    d = config.data
    if not d.mixture:
        return [PromptDataset(d.path, prompt_field=d.prompt_field, answer_field=d.answer_field,
                              require_answers=require_answers)], d.path
    return [PromptDataset(item.path, prompt_field=d.prompt_field, answer_field=d.answer_field,
                          field=f"data.mixture[{i}].path", require_answers=require_answers)
            for i, item in enumerate(d.mixture, start=1) if item.weight > 0], "data.mixture"


def load_online_prompts(config, tokenizer, *, main: bool = True) -> list[EncodedPrompt]:
    """The prompts of `data.path` (or the blend of `data.mixture`, `data.prompts.mixture_records`), rendered once at
    load time as `data.chat_template` says (`data.truncation.encode_prompt`) with overlong ones handled by
    `data.truncation` against `data.max_prompt_length`, each with its stored prompt and columns for the reward
    functions. The answer field is required only when a reward reads
    it (`rewards.build.answer_readers`, e.g. `math_exact_match`). On the `main` rank, prints what `filter` / `left`
    did and warns (count and first rows) about reference answers such a reward can never match (GSM8K answers
    without `#### N`); those rows are kept: the data needs fixing, and the warning says where.

    Raises:
        DataError: for a missing or malformed prompt file, or from `data.truncation.encode_prompt_records`.
    """
    d = config.data
    readers = answer_readers(reward_specs(config))
    datasets, source = _prompt_datasets(config, require_answers=bool(readers))
    if d.mixture:
        weights = [item.weight for item in d.mixture if item.weight > 0]  # a weight of 0 leaves its file out
        records = mixture_records(datasets, weights, seed=config.train.seed)
    else:
        records, source = list(datasets[0]), str(datasets[0].path or d.path)
    for spec in readers if main else ():
        message = unscorable_warning(spec.function, [rec.answer for rec in records], source=source,
                                     field=d.answer_field)
        if message:
            warnings.warn(message, stacklevel=2)
    ids = encode_prompt_records([rec.prompt for rec in records], tokenizer, system_prompt=d.system_prompt,
                                chat_template=d.chat_template, limit=d.max_prompt_length,
                                limit_name="data.max_prompt_length", policy=d.truncation, source=source,
                                log=print if main else _quiet)
    return [EncodedPrompt(prompt_ids=p, answer=rec.answer, index=rec.index, prompt=rec.prompt, columns=rec.columns)
            for p, rec in zip(ids, records) if p is not None]
