"""Raw text prompts (`data.chat_template`, `astrai.data.prompt_format`): a base model without a chat template trains
online_grpo with default settings (raw prompts, said once), `true` on it fails in one line naming the field,
`false` on a chat tokenizer gives the plain encoding of the text, and evaluation (in training, `python -m
astrai.evaluate`) and the server render prompts exactly as training does."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from astrai.config import ConfigError, config_from_dict, load_config
from astrai.data import DataError
from astrai.data.prompt_format import raw_prompt_ids
from astrai.models import Tokenizer, tiny_tokenizer
from astrai.models.tokenizer import tiny_gguf_fields
from astrai.rollout.paged_engine import PagedGenerationEngine

QUESTIONS = ["What is 3 + 2?", "Name a colour.", "the cat sat on the mat", "Say <|im_end|> twice."]
NOTICE = "data.chat_template: the tokenizer of"


def base_tokenizer() -> Tokenizer:
    """The tiny tokenizer as a base model's: no chat template, the BOS token put in front of text (as base Llama
    and Gemma tokenizers do)."""
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template, tokenizer.add_bos_token = None, True
    return tokenizer


@pytest.fixture(scope="module")
def base_model_dir(tmp_path_factory):
    """The tiny random Llama of `tiny_model_dir` with `base_tokenizer()`."""
    from single_turn_reference import tiny_model

    path = tiny_model(tmp_path_factory.mktemp("tiny-base"))
    base_tokenizer().save(path)
    return path


def prompt_file(path: Path, questions=QUESTIONS) -> Path:
    path.write_text("".join(json.dumps({"question": q, "answer": f"#### {i}"}) + "\n"
                            for i, q in enumerate(questions)))
    return path


def grpo_args(model_dir, out, data, *extra):
    """A 1-step online_grpo job on the tiny model, every prompt setting left at its default."""
    return ["--model.path", str(model_dir), "--train.type", "online_grpo", "--data.path", str(data),
            "--train.output_dir", str(out), "--max_steps", "1", "--rollout.batch_size", "2",
            "--grpo.group_size", "2", "--grpo.minibatch_size", "4", "--grpo.micro_batch_size", "2",
            "--rollout.max_new_tokens", "4", "--data.max_prompt_length", "64", "--train.progress_bar", "false",
            "--train.report_to", "none", "--runtime.num_threads", "1", *extra]


@pytest.fixture
def engine_prompts(monkeypatch):
    """Every prompt (token ids) any paged engine is asked to generate from, in this process."""
    seen: list[list[int]] = []
    generate = PagedGenerationEngine.generate

    def recording(self, prompts, *args, **kwargs):
        seen.extend([int(t) for t in p] for p in prompts)
        return generate(self, prompts, *args, **kwargs)

    monkeypatch.setattr(PagedGenerationEngine, "generate", recording)
    return seen


# ------------------------------------------------------------------------------------------------ the tokenizer
def test_the_bos_token_follows_transformers_and_survives_a_save(tmp_path):
    transformers = pytest.importorskip("transformers")
    text = "the cat sat on the mat"
    for name, tokenizer in (("base", base_tokenizer()), ("chat", tiny_tokenizer())):
        tokenizer.save(tmp_path / name)
        again = Tokenizer.from_dir(tmp_path / name)
        assert again.add_bos_token == tokenizer.add_bos_token and again.chat_template == tokenizer.chat_template
        hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path / name))
        assert hf(text)["input_ids"] == raw_prompt_ids(again, text)  # transformers' tokenizer(text)
    assert raw_prompt_ids(base_tokenizer(), text) == [1] + tiny_tokenizer().encode_text(text)
    assert raw_prompt_ids(tiny_tokenizer(), text) == tiny_tokenizer().encode_text(text)  # byte-level BPE: no BOS
    # GGUF: llama.cpp's flag, read as transformers reads it (no flag: BOS only for a SentencePiece vocabulary)
    assert not Tokenizer.from_gguf_fields(tiny_gguf_fields()).add_bos_token
    assert Tokenizer.from_gguf_fields({**tiny_gguf_fields(), "tokenizer.ggml.add_bos_token": True}).add_bos_token


# ------------------------------------------------------------------------------------------------ a base model
def test_a_base_model_trains_online_grpo_on_raw_prompts_said_once_and_evaluates_them_alike(
        base_model_dir, tmp_path, capsys, engine_prompts):
    from astrai import evaluate
    from astrai.train import main

    data = prompt_file(tmp_path / "p.jsonl")
    out = tmp_path / "run"
    assert main(grpo_args(base_model_dir, out, data, "--train.eval_steps", "1", "--data.eval_path", str(data))) == 0
    printed = capsys.readouterr().out
    assert printed.count(NOTICE) == 1, printed  # said once, for the training prompts and the held-out ones
    line = next(ln for ln in printed.splitlines() if NOTICE in ln)
    assert "raw text" in line and "after the BOS token" in line
    tokenizer = base_tokenizer()
    expected = {tuple([1] + tokenizer.encode_text(q)) for q in QUESTIONS}
    training = {tuple(p) for p in engine_prompts}
    assert training and training <= expected  # the rollouts' and in-training evaluation's prompts: BOS + text
    assert (out / "eval" / "step-00000001.jsonl").is_file()
    engine_prompts.clear()
    # python -m astrai.evaluate on the run (its config.yaml: data.chat_template null) renders them alike
    assert evaluate.main(["--model", str(out), "--data", str(data), "--output_dir", str(tmp_path / "eval"),
                          "--max_new_tokens", "2", "--no_progress_bar", "--device", "cpu"]) == 0
    assert {tuple(p) for p in engine_prompts} == expected
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert summary["settings"]["prompts"] == "raw text" and summary["settings"]["chat_template"] is None
    assert capsys.readouterr().err.count(NOTICE) == 1


def test_check_says_raw_prompts_once_and_refuses_what_needs_a_template(base_model_dir, tmp_path, capsys):
    from astrai.train import main

    data = prompt_file(tmp_path / "p.jsonl")
    assert main([*grpo_args(base_model_dir, tmp_path / "ok", data), "--check"]) == 0
    assert capsys.readouterr().out.count(NOTICE) == 1
    refusals = {
        ("--data.chat_template", "true"): "error: data.chat_template: true, but the tokenizer of",
        ("--data.system_prompt", "Be brief."): "error: data.system_prompt: a system message needs the chat template",
    }
    for extra, start in refusals.items():
        for check in ((), ("--check",)):
            assert main([*grpo_args(base_model_dir, tmp_path / "no", data, *extra), *check]) == 2
            err = capsys.readouterr().err.strip()
            assert err.startswith(start) and "\n" not in err, err
    # sft needs the template for its chats
    sft = tmp_path / "chats.jsonl"
    sft.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                            {"role": "assistant", "content": "yo"}]}) + "\n")
    assert main(["--model.path", str(base_model_dir), "--train.type", "sft", "--data.path", str(sft),
                 "--data.max_length", "64", "--train.output_dir", str(tmp_path / "sft"), "--check"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: model.path: the tokenizer of") and "sft" in err and "\n" not in err


# ------------------------------------------------------------------------------------------------ a chat tokenizer
def test_raw_prompts_on_a_chat_tokenizer_are_the_plain_encoding_in_training_and_evaluation(tmp_path):
    from astrai.data.truncation import prompt_ids_and_budget
    from astrai.evaluation.accuracy import EvalSettings, evaluate
    from astrai.experience.prompts import load_online_prompts
    from astrai.models import AutoRegressiveLM, tiny_config
    from astrai.rewards.build import build_rewards, evaluation_specs
    from astrai.trainer.evaluation_callback import load_eval_records

    data = prompt_file(tmp_path / "p.jsonl")
    tokenizer = tiny_tokenizer()  # ChatML template, no BOS added
    config = config_from_dict({"train": {"type": "online_grpo"},
                               "data": {"path": str(data), "eval_path": str(data), "chat_template": False}})
    plain = [tokenizer.encode_text(q) for q in QUESTIONS]  # a control token's spelling stays text
    prompts = load_online_prompts(config, tokenizer, main=False)
    assert [p.prompt_ids for p in prompts] == plain
    templated = load_online_prompts(config_from_dict({"data": {"path": str(data)}}), tokenizer, main=False)
    assert [p.prompt_ids for p in templated] != plain  # null on a chat tokenizer: the template, as before
    assert prompt_ids_and_budget(QUESTIONS[0], tokenizer, config.data, "dpo row 1") == \
        (plain[0], config.data.max_length - len(plain[0]))  # dpo / offline grpo / rm prompts alike

    class Recorder:
        def __init__(self, engine):
            self.engine, self.prompts = engine, []

        def generate(self, prompts, *args, **kwargs):
            self.prompts += [list(p) for p in prompts]
            return self.engine.generate(prompts, *args, **kwargs)

    torch.manual_seed(0)
    engine = Recorder(PagedGenerationEngine(AutoRegressiveLM(tiny_config()), pad_token_id=tokenizer.pad_token_id))
    records = load_eval_records(config, tokenizer, main=False, check_rewards=False)
    rewards = build_rewards(config, records, specs=evaluation_specs(config), num_workers=0)
    try:
        evaluate(engine, tokenizer, records, rewards=rewards, settings=EvalSettings(max_new_tokens=2),
                 max_prompt_length=config.data.max_prompt_length, chat_template=config.data.chat_template,
                 log=lambda line: None)
    finally:
        rewards.close()
    assert engine.prompts == plain


def test_left_truncation_of_a_raw_prompt_keeps_the_bos_token(tmp_path):
    from astrai.data.truncation import encode_prompt_records

    tokenizer = base_tokenizer()
    text = QUESTIONS[2]
    full = raw_prompt_ids(tokenizer, text)
    [cut] = encode_prompt_records([text], tokenizer, system_prompt=None, limit=4, limit_name="data.max_prompt_length",
                                  policy="left", source="p.jsonl", chat_template=None, log=lambda line: None)
    assert cut == [full[0]] + full[-3:] and cut[0] == tokenizer.bos_token_id


def test_chat_records_with_raw_prompts_are_refused_naming_the_file_and_row(tmp_path):
    from astrai.experience.prompts import load_online_prompts

    path = tmp_path / "mixed.jsonl"
    path.write_text(json.dumps({"question": "plain", "answer": "#### 1"}) + "\n"
                    + json.dumps({"question": [{"role": "user", "content": "hi"}], "answer": "#### 2"}) + "\n")
    for tokenizer, setting in ((tiny_tokenizer(), False), (base_tokenizer(), None)):
        config = config_from_dict({"data": {"path": str(path), "chat_template": setting}})
        with pytest.raises(DataError) as err:
            load_online_prompts(config, tokenizer, main=False)
        message = str(err.value)
        assert message.startswith(f"{path} row 2: the prompt is a chat") and "data.chat_template" in message
        assert "\n" not in message


def test_config_field_its_help_and_the_config_time_refusals():
    from astrai.train import fields_help

    assert load_config(None).data.chat_template is None
    assert load_config(None, ["--data.chat_template", "false"]).data.chat_template is False
    assert load_config(None, ["--chat_template", "true"]).data.chat_template is True
    assert any(line.strip().startswith("--data.chat_template") and "raw text" in line
               for line in fields_help().splitlines())
    with pytest.raises(ConfigError, match=r"^data.chat_template: expected null or a boolean, got 'no' \(given on the command line\)$"):
        load_config(None, ["--data.chat_template", "no"])
    with pytest.raises(ConfigError, match=r"^data.system_prompt: a system message needs the chat template.*"
                                          r"data.chat_template is false"):
        config_from_dict({"data": {"chat_template": False, "system_prompt": "Be brief."}})
    with pytest.raises(ConfigError, match=r"^data.chat_template: false, but train.type sft trains on chats"):
        config_from_dict({"train": {"type": "sft"}, "data": {"chat_template": False}})
    config_from_dict({"train": {"type": "seq"}, "data": {"chat_template": False}})  # documents: no template anyway


# ------------------------------------------------------------------------------------------------ the server
def _post(app, path: str, body: dict) -> tuple[int, dict]:
    """(status, JSON body) of one POST to the ASGI `app`, without a server."""
    request = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]
    sent: list[dict] = []

    async def receive():
        return request.pop(0) if request else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "path": path,
             "raw_path": path.encode(), "root_path": "", "query_string": b"", "scheme": "http",
             "headers": [(b"content-type", b"application/json")], "client": ("test", 1), "server": ("test", 80)}
    asyncio.run(app(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, json.loads(b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"))


def test_the_server_refuses_chat_without_a_template_and_reads_completions_as_raw_prompts():
    pytest.importorskip("fastapi")
    from astrai.models import AutoRegressiveLM, tiny_config
    from astrai.serve.app import create_app
    from astrai.serve.protocol import CompletionRequest

    torch.manual_seed(0)
    tokenizer = base_tokenizer()
    engine = PagedGenerationEngine(AutoRegressiveLM(tiny_config()), pad_token_id=tokenizer.pad_token_id)
    app = create_app(engine, tokenizer, model_name="base")
    status, body = _post(app, "/v1/chat/completions", {"model": "base", "messages": [{"role": "user",
                                                                                        "content": "hi"}]})
    assert status == 400 and body["error"]["param"] == "messages" and body["error"]["code"] == "chat_template_missing"
    assert "no chat template" in body["error"]["message"] and "/v1/completions" in body["error"]["message"]
    server = app.state.server
    text = QUESTIONS[0]
    assert server.prompts_of(CompletionRequest(model="base", prompt=text)) == [raw_prompt_ids(tokenizer, text)]
    spelled = server.prompts_of(CompletionRequest(model="base", prompt="<|im_start|>x"))[0]
    assert spelled == [1] + tokenizer.encode("x")  # a prompt that starts with the BOS token gets no second one
    chat = app.state.server.tokenizer = tiny_tokenizer()  # a chat tokenizer: completions stay raw, as before
    assert server.prompts_of(CompletionRequest(model="base", prompt=text)) == [chat.encode(text)]
