"""seq: causal-LM pre-training on raw text, next-token cross-entropy over every token.

Each record's `data.text_field` is tokenised (as text) with EOS appended; with `data.packing` (the usual
setting) whole documents are concatenated and the token stream is cut into rows of `data.max_length`
("concatenate and chunk", Radford et al. 2019), with positions and attention kept within each document;
without packing a document keeps its first `data.max_length` tokens. The step
is `sft.NextTokenLearner` (global token-mean over the optimizer step, gradient accumulation).
"""

from __future__ import annotations

from astrai.data.examples import text_example
from astrai.data.records import load_records, require_str
from astrai.trainer.learners.sft import NextTokenLearner, build_examples, build_next_token


def seq_data(config, model_config, tokenizer, *, main: bool = True) -> list:
    """The seq examples of `data.path` (records holding `data.text_field`), tokenised and packed or cut as
    `data.packing` / `data.max_length` say. Raises DataError for bad data."""
    d = config.data
    rows = load_records(d.path, {"data.text_field": d.text_field})
    return build_examples(
        rows, lambda row, where: text_example(require_str(row, d.text_field, "data.text_field", where), tokenizer,
                                              max_length=None if d.packing else d.max_length),
        packing=d.packing, max_length=d.max_length, source=d.path, truncation=d.truncation)


def build_seq(config, dist, policy, tokenizer) -> NextTokenLearner:
    """seq from `data.path` records holding `data.text_field` (`seq_data`). Raises DataError for bad data."""
    return build_next_token(config, dist, policy, tokenizer, seq_data(config, policy.config, tokenizer))
