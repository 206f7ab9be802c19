"""Tokenizer: a thin wrapper over a `tokenizers.Tokenizer` (byte-level BPE, Radford et al. 2019 / Sennrich et al.
2016) plus a Jinja2 chat template rendered in a sandbox.

Built from GGUF metadata (llama.cpp keys `tokenizer.ggml.*`) the same way `transformers` builds it, so token ids
equal `AutoTokenizer.from_pretrained(dir, gguf_file=...)`: the vocabulary spelled in the GPT-2 byte alphabet, the
file's merges, the GPT-2 byte-level split regex (or the Llama-3 regex for `pre` = llama-bpe), control tokens (type
3) as special added tokens and user-defined tokens (type 4) as plain added tokens. Note: for SmolLM2 this is the
regex `transformers` uses for the GGUF; the Hub `tokenizer.json` additionally splits digits off first, which gives
different ids only where a whitespace run of two or more characters directly precedes a digit ("a  1", "\n 1",
"\n\n1": 1 of the first 600 GSM8K questions and answers).
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping, Sequence

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as _Backend

from .gemma_tokenizer import GEMMA_CHAT_TEMPLATE, gemma_bpe

__all__ = ["Tokenizer", "tiny_tokenizer", "tiny_gguf_fields", "TINY_VOCAB_SIZE", "byte_alphabet",
           "GEMMA_CHAT_TEMPLATE"]

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT}


@lru_cache(maxsize=1)
def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable unicode character table (256 entries): printable Latin-1 bytes map to themselves,
    the others to chr(256 + k) in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    table, extra = {}, 0
    for byte in range(256):
        if byte in keep:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


@lru_cache(maxsize=1)
def _jinja_env():
    """Sandboxed Jinja2 environment configured like `transformers` chat templates (trim/lstrip blocks,
    loop controls, `raise_exception`, `strftime_now`, a non-HTML-escaping `tojson`)."""
    import jinja2.ext
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


@lru_cache(maxsize=16)
def _compiled_template(source: str):
    """The chat template `source` compiled once (compiling costs milliseconds; rendering, microseconds)."""
    return _jinja_env().from_string(source)


def _token_str(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string or an AddedToken dict {"content": ...}."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value


class Tokenizer:
    """Text <-> token ids plus the chat template.

    Attributes: `backend` (`tokenizers.Tokenizer`), `chat_template` (str | None), `bos_token`, `eos_token`,
    `pad_token`, `unk_token` (str | None), `add_bos_token` (bool: `transformers` puts the BOS token in front of
    encoded text, as base Llama and Gemma tokenizers do; astrai's raw text prompts follow it,
    `astrai.data.prompt_format`). `encode` never adds special tokens; special tokens written in the text (e.g.
    `<|im_start|>`) encode to their single ids. `encode_text` is for text that comes from data: a special token's
    spelling in it is ordinary text (several ordinary ids), as `transformers`' `split_special_tokens=True` does
    (the backend's `encode_special_tokens` switch).
    """

    def __init__(
        self,
        backend: _Backend,
        *,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        unk_token: str | None = None,
        add_bos_token: bool = False,
    ) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token, self.eos_token, self.pad_token, self.unk_token = bos_token, eos_token, pad_token, unk_token
        self.add_bos_token = bool(add_bos_token)
        self._text_backend: _Backend | None = None

    # ids ------------------------------------------------------------------------------------------------------
    def token_to_id(self, token: str | None) -> int | None:
        """Id of `token` (None if absent or None)."""
        return None if token is None else self.backend.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        """V, including added tokens."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        """Id of `bos_token` or None."""
        return self.token_to_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        """Id of `eos_token` or None."""
        return self.token_to_id(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        """Id of `pad_token`, falling back to `eos_token_id` when there is no pad token."""
        pad = self.token_to_id(self.pad_token)
        return self.eos_token_id if pad is None else pad

    # text -------------------------------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, no special tokens added (BOS/EOS are the caller's business)."""
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_text(self, text: str) -> list[int]:
        """Token ids of data text, encoded as text only: special (control) tokens spelled in `text` become
        ordinary tokens, exactly as if they were not special; non-special added tokens still match."""
        return self.text_backend.encode(text, add_special_tokens=False).ids

    @property
    def text_backend(self) -> _Backend:
        """A copy of `backend` with `encode_special_tokens` on (special tokens are not matched in the input)."""
        if self._text_backend is None:
            self._text_backend = _Backend.from_str(self.backend.to_str())
            self._text_backend.encode_special_tokens = True
        return self._text_backend

    @property
    def special_tokens(self) -> dict[str, int]:
        """Spelling -> id of every special (control) added token, e.g. `{"<|im_end|>": 2, ...}`."""
        return {t.content: i for i, t in self.backend.get_added_tokens_decoder().items() if t.special}

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """`encode` for many texts (parallel in the Rust backend)."""
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids` (a list or 1-D tensor of ints); special tokens dropped unless `skip_special_tokens=False`."""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
        """Render `messages` ([{"role", "content"}, ...]) with the chat template, as transformers'
        `apply_chat_template(..., tokenize=False)` does. Raises `ValueError` if there is no template and
        `jinja2.TemplateError` if the template calls `raise_exception`."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat_template")
        template = _compiled_template(self.chat_template)
        return template.render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            pad_token=self.pad_token or "",
            unk_token=self.unk_token or "",
        )

    # construction ---------------------------------------------------------------------------------------------
    @classmethod
    def from_gguf_fields(cls, fields: Mapping[str, Any]) -> "Tokenizer":
        """Build from GGUF metadata values keyed by their GGUF names (`tokenizer.ggml.model`, `.tokens`,
        `.merges`, `.token_type`, `.pre`, `.bos_token_id`, `.eos_token_id`, `.padding_token_id`,
        `.unknown_token_id`, `.add_bos_token`, `tokenizer.chat_template`; `general.architecture` picks Gemma's
        SentencePiece rebuild, `astrai.models.gemma_tokenizer`). `add_bos_token` is the file's flag, true by
        default for a SentencePiece vocabulary ("llama": llama.cpp adds BOS unless the file says otherwise), as
        `transformers` reads it. Raises `ValueError` unless the model is byte-level BPE ("gpt2") with tokens and
        merges, or a Gemma file's SentencePiece vocabulary ("llama")."""
        kind = fields.get("tokenizer.ggml.model")
        gemma = kind == "llama" and str(fields.get("general.architecture", "")).startswith("gemma")
        if "tokenizer.ggml.tokens" not in fields or not gemma and (
                kind != "gpt2" or "tokenizer.ggml.merges" not in fields):
            raise ValueError(f"unsupported GGUF tokenizer {kind!r}: byte-level BPE ('gpt2') with merges, or Gemma's "
                             "SentencePiece vocabulary ('llama'), is read")
        tokens = list(fields["tokenizer.ggml.tokens"])
        types = list(fields.get("tokenizer.ggml.token_type") or [])
        unk = fields.get("tokenizer.ggml.unknown_token_id")
        if gemma:
            backend = gemma_bpe(tokens, tokens[unk] if unk is not None and 0 <= unk < len(tokens) else None)
            alphabet = None
        else:
            backend = _byte_level_bpe(tokens, fields["tokenizer.ggml.merges"], fields.get("tokenizer.ggml.pre"))
            alphabet = set(byte_alphabet().values())
        control = [t for t, k in zip(tokens, types) if k == _CONTROL and (alphabet is None or set(t) <= alphabet)]
        backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
        user = [t for t, k in zip(tokens, types) if k == _USER_DEFINED and backend.token_to_id(t) is not None]
        backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])

        def name(key: str) -> str | None:
            idx = fields.get(f"tokenizer.ggml.{key}")
            return tokens[int(idx)] if idx is not None and 0 <= int(idx) < len(tokens) else None

        return cls(
            backend,
            chat_template=fields.get("tokenizer.chat_template"),
            bos_token=name("bos_token_id"),
            eos_token=name("eos_token_id"),
            pad_token=name("padding_token_id"),
            unk_token=name("unknown_token_id"),
            add_bos_token=bool(fields.get("tokenizer.ggml.add_bos_token", kind == "llama")) and name("bos_token_id")
            is not None,
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        """Load `tokenizer.json` plus special tokens and chat template from `tokenizer_config.json` (or
        `chat_template.jinja` / `chat_template.json`, as newer transformers save it). `add_bos_token` is true when
        `tokenizer.json`'s post-processor puts the BOS token in front of the text (what `transformers` does with
        it) or `tokenizer_config.json` says `add_bos_token: true`. Raises `FileNotFoundError` naming the path when
        `tokenizer.json` is missing, `ValueError` (one line) when it or the config is malformed."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"no tokenizer.json in {path}: expected a Hugging Face tokenizer directory")
        try:
            backend = _Backend.from_file(str(path / "tokenizer.json"))
            config_file = path / "tokenizer_config.json"
            config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
        except Exception as err:  # the tokenizers library raises a bare Exception for a malformed file
            raise ValueError(f"{path}: tokenizer.json or tokenizer_config.json is not a readable tokenizer "
                             f"({type(err).__name__}: {(str(err).splitlines() or [''])[0]})") from None
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: pick "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if template is None and (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        if template is None and (path / "chat_template.json").is_file():
            template = json.loads((path / "chat_template.json").read_text(encoding="utf-8")).get("chat_template")
        tokens = {k: _token_str(config.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        bos = backend.token_to_id(tokens["bos_token"]) if tokens["bos_token"] is not None else None
        add_bos = bos is not None and (config.get("add_bos_token") is True or _prepends(backend, bos))
        return cls(backend, chat_template=template, add_bos_token=add_bos, **tokens)

    def save(self, directory: str | Path) -> None:
        """Write `tokenizer.json` and `tokenizer_config.json` (chat_template, special tokens, `add_bos_token`, no
        EOS added) into `directory` (created if needed), loadable by `Tokenizer.from_dir` and
        `transformers.AutoTokenizer`. With `add_bos_token`, the saved `tokenizer.json` gets a post-processor that
        puts the BOS token in front (unless its own does), since that is what `transformers` follows."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        backend = self.backend
        bos = self.bos_token_id
        if self.add_bos_token and bos is not None and not _prepends(backend, bos):
            backend = _Backend.from_str(backend.to_str())
            prepend = processors.TemplateProcessing(single=f"{self.bos_token} $A", pair=f"{self.bos_token} $A $B",
                                                    special_tokens=[(self.bos_token, bos)])
            backend.post_processor = prepend if backend.post_processor is None else \
                processors.Sequence([backend.post_processor, prepend])
        backend.save(str(directory / "tokenizer.json"))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": self.add_bos_token,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "pad_token": self.pad_token,
            "unk_token": self.unk_token,
            "chat_template": self.chat_template,
        }
        text = json.dumps(config, indent=2, ensure_ascii=False) + "\n"
        (directory / "tokenizer_config.json").write_text(text, encoding="utf-8")


def _prepends(backend: _Backend, bos: int) -> bool:
    """Whether `backend`'s post-processor puts id `bos` in front of encoded text (`add_special_tokens=True`)."""
    try:
        ids = backend.encode("a", add_special_tokens=True).ids
    except Exception:  # noqa: BLE001 - a post-processor that cannot run is one that adds nothing we can use
        return False
    return bool(ids) and ids[0] == bos and backend.encode("a", add_special_tokens=False).ids[:1] != [bos]


def _byte_level_bpe(tokens: list[str], merges: Sequence[str], pre: str | None) -> _Backend:
    """BPE over the GPT-2 byte alphabet: tokens not already spelled in it are respelled byte by byte."""
    table = byte_alphabet()
    alphabet = set(table.values())
    vocab = {}
    for index, token in enumerate(tokens):
        spelled = token if set(token) <= alphabet else "".join(table[b] for b in token.encode("utf-8"))
        vocab[spelled] = index
    pairs = [tuple(m.split(" ")) for m in merges]
    backend = _Backend(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    split = _SPLITS.get(pre or "")
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()
    return backend


_CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>'"
    " + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_TINY_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_TINY_MERGES = [
    "Ġ t", "h e", "i n", "Ġ a", "e r", "o n", "Ġt he", "r e", "a t", "Ġ s", "e n", "Ġ o",
    "Ġ w", "n d", "i s", "Ġ b", "o u", "Ġ c", "a n", "Ġ f", "i t", "e s", "Ġ m", "Ġ d",
]  # fmt: skip
TINY_VOCAB_SIZE = len(_TINY_SPECIALS) + 256 + len(_TINY_MERGES)


def tiny_tokenizer() -> Tokenizer:
    """A 283-token byte-level BPE tokenizer for tests (no file or network needed): ids 0-2 are `<|endoftext|>`,
    `<|im_start|>` (bos), `<|im_end|>` (eos and pad), then the 256 byte symbols and 24 merges; ChatML template.
    Pairs with `tiny_config()`."""
    return Tokenizer.from_gguf_fields(tiny_gguf_fields())


def tiny_gguf_fields() -> dict[str, Any]:
    """The GGUF tokenizer metadata (`tokenizer.*` keys) of `tiny_tokenizer()`, e.g. to write a tiny GGUF file."""
    byte_tokens = [byte_alphabet()[b] for b in range(256)]
    merged = [m.replace(" ", "") for m in _TINY_MERGES]
    tokens = _TINY_SPECIALS + byte_tokens + merged
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": list(_TINY_MERGES),
        "tokenizer.ggml.token_type": [_CONTROL] * 3 + [1] * (len(tokens) - 3),
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.padding_token_id": 2,
        "tokenizer.chat_template": _CHATML,
    }
