"""Gemma's tokenizer from GGUF metadata: a SentencePiece-style BPE (Kudo & Richardson 2018, "SentencePiece";
Sennrich et al. 2016, BPE) with byte fallback, as `transformers` rebuilds it from the same file, so token ids equal
`AutoTokenizer.from_pretrained(dir, gguf_file=...)`.

llama.cpp stores Gemma's vocabulary (`tokenizer.ggml.model` = "llama") without merges. They are recovered from the
vocabulary: every split of a token into two vocabulary pieces is a merge, ranked by the token's position in the
file (Gemma's scores do not follow its merge order; its file order does), longer left pieces first. Tokens made of
whitespace with at least one space are stored with real spaces but looked up spelled with "▁", one per character.
Text is normalised by replacing " " with "▁" (no prefix space) and split after each space; unknown bytes fall back
to `<0xNN>` tokens; decoding turns "▁" back into spaces.

`GEMMA_CHAT_TEMPLATE` renders Gemma's turn format (`<start_of_turn>user ... <end_of_turn>`, the assistant's role
written `model`, a system message prefixed to the first user turn) for GGUF files that carry no template (the Gemma
3 270M base model's).
"""

from __future__ import annotations

from typing import Sequence

from tokenizers import decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _Backend

__all__ = ["gemma_bpe", "GEMMA_CHAT_TEMPLATE"]

GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(prefix='') %}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{% set ns.prefix = message['content'] | trim + '\n\n' %}"
    "{% else %}{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n'"
    " + ns.prefix + message['content'] | trim + '<end_of_turn>\n' }}{% set ns.prefix = '' %}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


def _respell(token: str) -> str:
    """A whitespace-only token holding a space, as the BPE vocabulary spells it ("▁" per character)."""
    return "\u2581" * len(token) if " " in token and not token.strip() else token


def gemma_bpe(tokens: Sequence[str], unk_token: str | None) -> _Backend:
    """The `tokenizers` backend of a Gemma GGUF vocabulary (see the module docstring); `unk_token` names the
    unknown token (`tokenizer.ggml.unknown_token_id`'s spelling)."""
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab[_respell(token)] = index  # a repeated spelling keeps its first place and its last id
    ranked = []
    for token, index in vocab.items():
        for cut in range(len(token) - 1, 0, -1):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((index, -cut, left, right))
    ranked.sort(key=lambda r: (r[0], r[1]))
    backend = _Backend(models.BPE(vocab=vocab, merges=[(left, right) for _, _, left, right in ranked],
                                  unk_token=unk_token, fuse_unk=True, byte_fallback=True))
    backend.normalizer = normalizers.Replace(" ", "\u2581")
    backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous", invert=False)
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return backend
