"""`python -m astrai.serve` on 127.0.0.1 against the tiny main-job run, through the official `openai` client:
models, completions, chat (template, streaming), sampling parameters, batching of concurrent requests, bad input.
One server process serves the whole module."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch

from astrai.models import load_pretrained
from astrai.rollout.paged_engine import PagedGenerationEngine
from astrai.rollout.sampling import SamplingParams

MODEL = "step-00000002"  # the served name defaults to the checkpoint directory's name


def http(method, url, body=None, raw=None):
    """(status, parsed JSON or text lines) of one plain HTTP request (stdlib only)."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    request = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            status, kind, text = r.status, r.headers.get("content-type", ""), r.read().decode()
    except urllib.error.HTTPError as err:
        status, kind, text = err.code, err.headers.get("content-type", ""), err.read().decode()
    if kind.startswith("text/event-stream"):
        return status, [line for line in text.splitlines() if line]
    return status, json.loads(text)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny_ppo_run):
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "astrai.serve", "--checkpoint", str(tiny_ppo_run), "--port",
                             str(port), "--batch_window_ms", "50", "--max_batch", "16", "--log_level", "warning"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}: {proc.stdout.read()}")
        try:
            if http("GET", f"{base}/health")[0] == 200:
                break
        except OSError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("server did not become healthy in 180 s")
        time.sleep(0.3)
    yield base, openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="module")
def reference(tiny_ppo_run):
    """The served checkpoint loaded here: (tokenizer, greedy(prompt_ids, max_new_tokens) -> token ids)."""
    ckpt = sorted((tiny_ppo_run / "checkpoints").glob("step-*"))[-1]
    model, tokenizer = load_pretrained(str(ckpt))
    engine = PagedGenerationEngine(model, pad_token_id=tokenizer.pad_token_id)

    def greedy(ids, max_new_tokens):
        params = SamplingParams(max_new_tokens=max_new_tokens, top_k=1, stop_token_ids=(tokenizer.eos_token_id,))
        out = engine.generate([ids], params, torch.Generator().manual_seed(0))
        return out.response_ids[0][out.action_mask[0]].tolist()

    return tokenizer, greedy


MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is the answer"}]


def test_models_and_health(server):
    base, client = server
    assert [m.id for m in client.models.list().data] == [MODEL]
    health = http("GET", f"{base}/health")[1]
    assert health["status"] == "ok" and health["model"] == MODEL and health["policy_version"] == 2  # the checkpoint's


def test_chat_greedy_matches_the_engine(server, reference):
    _, client = server
    tokenizer, greedy = reference
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
    prompt = tokenizer.encode(tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True))
    tokens = greedy(prompt, 12)
    choice = reply.choices[0]
    assert reply.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.message.content == tokenizer.decode(tokens)
    assert choice.finish_reason == ("stop" if tokens[-1] == tokenizer.eos_token_id else "length")
    assert reply.usage.prompt_tokens == len(prompt) and reply.usage.completion_tokens == len(tokens)
    assert reply.usage.total_tokens == len(prompt) + len(tokens)


def test_chat_streaming_chunks(server):
    base, client = server
    full = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [full.choices[0].finish_reason]
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) >= 2  # token by token
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    status, lines = http("POST", f"{base}/v1/chat/completions",
                         {"model": MODEL, "messages": MESSAGES, "max_tokens": 3, "stream": True})
    assert status == 200 and isinstance(lines, list)
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"


def test_completions_n_prompts_seed_and_streaming(server):
    _, client = server
    kwargs = dict(model=MODEL, prompt=["the cat", "a dog"], n=2, max_tokens=5, temperature=1.0, top_p=0.9, seed=7)
    first, second = client.completions.create(**kwargs), client.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1, 2, 3]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]  # same seed, same text
    assert all(c.finish_reason in ("stop", "length") for c in first.choices)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens > 0
    stream = list(client.completions.create(model=MODEL, prompt="the cat", max_tokens=4, temperature=0,
                                            stream=True))
    plain = client.completions.create(model=MODEL, prompt="the cat", max_tokens=4, temperature=0)
    assert "".join(c.choices[0].text for c in stream) == plain.choices[0].text
    assert stream[-1].choices[0].finish_reason == plain.choices[0].finish_reason
    ids = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=2, temperature=0)
    assert ids.usage.prompt_tokens == 3


def test_concurrent_requests_are_batched(server):
    base, client = server
    before = http("GET", f"{base}/health")[1]

    def ask(i):
        return client.chat.completions.create(model=MODEL, max_tokens=6,
                                              messages=[{"role": "user", "content": f"question {i}"}])

    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(ask, range(8)))
    assert all(r.choices[0].finish_reason in ("stop", "length") for r in replies)
    after = http("GET", f"{base}/health")[1]
    assert after["requests"] - before["requests"] == 8
    assert after["rows"] - before["rows"] == 8
    assert after["engine_calls"] - before["engine_calls"] < 8  # several requests shared an engine call


@pytest.mark.parametrize("kwargs, status, param, code", [
    ({"temperature": 3}, 400, "temperature", None),
    ({"top_p": 1.5}, 400, "top_p", None),
    ({"n": 0}, 400, "n", None),
    ({"n": 17}, 400, "n", None),
    ({"max_tokens": 0}, 400, "max_tokens", None),
    ({"max_tokens": 100000}, 400, "max_tokens", "context_length_exceeded"),
    ({"stop": ["a", "b", "c", "d", "e"]}, 400, "stop", None),
    ({"presence_penalty": 1.0}, 400, "presence_penalty", "unsupported_parameter"),
    ({"model": "gpt-4o"}, 404, "model", "model_not_found"),
    ({"messages": []}, 400, "messages", None),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages.[0].content", None),
])
def test_bad_chat_requests_get_openai_errors(server, kwargs, status, param, code):
    _, client = server
    request = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **kwargs}
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(**request)
    err = info.value
    assert err.status_code == status
    body = err.response.json()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["message"]
    assert body["type"] == "invalid_request_error" and body["param"] == param and body["code"] == code


def test_malformed_bodies_and_unknown_routes(server):
    base, _ = server
    status, body = http("POST", f"{base}/v1/completions", raw=b"{not json")
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    status, body = http("POST", f"{base}/v1/completions", {"model": MODEL, "prompt": ""})
    assert status == 400 and body["error"]["param"] == "prompt"
    status, body = http("POST", f"{base}/v1/completions", {"model": MODEL, "prompt": [10**9]})
    assert status == 400 and "token ids" in body["error"]["message"]
    status, body = http("GET", f"{base}/v1/nothing")
    assert status == 404 and set(body["error"]) == {"message", "type", "param", "code"}


def test_cli_bad_checkpoint_exits_2(tmp_path, capsys):
    from astrai.serve.__main__ import main

    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    for path, needle in ((tmp_path / "missing", "missing"), (tmp_path / "run", "no complete checkpoint")):
        assert main(["--checkpoint", str(path)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error:") and needle in err and "\n" not in err
    with pytest.raises(SystemExit) as info:
        main(["--checkpoint", str(tmp_path), "--max_batch", "0"])
    assert info.value.code == 2
