"""`python -m astrai.serve` on 127.0.0.1 against the tiny main-job run, through the official `openai` client:
models, completions, chat (template, streaming), sampling parameters, continuous batching (a short request ends
while a long one streams), disconnects (the request is aborted, its KV blocks freed), logprobs, bad input (JSON
errors, a lone surrogate included). One server process serves the whole module."""

from http.client import HTTPConnection
import errno
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

MODEL = "step-00000002"  # the served checkpoint's folder name: accepted besides the path given (vLLM's id)


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
                             str(port), "--max_batch", "16", "--log_level", "warning"],
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

    def greedy(ids, max_new_tokens, logprobs=False):
        params = SamplingParams(max_new_tokens=max_new_tokens, top_k=1, stop_token_ids=(tokenizer.eos_token_id,))
        out = engine.generate([ids], params, torch.Generator().manual_seed(0))
        tokens = out.response_ids[0][out.action_mask[0]].tolist()
        return (tokens, out.old_logprobs[0][out.action_mask[0]].tolist()) if logprobs else tokens

    return tokenizer, greedy


MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is the answer"}]


def test_models_and_health(server, tiny_ppo_run):
    base, client = server
    assert [m.id for m in client.models.list().data] == [str(tiny_ppo_run)]  # the checkpoint as given, as vLLM
    step = sorted((tiny_ppo_run / "checkpoints").glob("step-*"))[-1]
    for name in (str(tiny_ppo_run), str(step), MODEL):  # the path given, the step it resolved to, its folder
        assert client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=1).choices
    health = http("GET", f"{base}/health")[1]
    assert health["status"] == "ok" and health["model"] == str(tiny_ppo_run) and health["policy_version"] == 2  # the checkpoint's


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


def test_concurrent_requests_share_engine_steps(server):
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
    tokens = sum(r.usage.completion_tokens for r in replies)
    assert after["steps"] - before["steps"] < tokens  # one step sampled tokens of several requests


def open_stream(base, path, body):
    """A streaming POST left open: (connection, response) to read events from with `events`."""
    host, port = base.removeprefix("http://").split(":")
    conn = HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", path, json.dumps({**body, "stream": True}), {"content-type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    return conn, response


def events(response, limit=None):
    """Parsed `data:` payloads of an open event stream, up to `limit` (all until [DONE] when None)."""
    out = []
    while limit is None or len(out) < limit:
        line = response.readline().decode().strip()
        if line == "data: [DONE]" or (not line and response.isclosed()):
            break
        if line.startswith("data: "):
            out.append(json.loads(line[6:]))
    return out


LONG = {"model": MODEL, "prompt": "the cat", "max_tokens": 240, "ignore_eos": True, "temperature": 1.0}


def wait_health(base, done, timeout=20.0):
    deadline = time.monotonic() + timeout
    while True:
        health = http("GET", f"{base}/health")[1]
        if done(health) or time.monotonic() > deadline:
            return health
        time.sleep(0.02)


def test_a_short_request_completes_while_a_long_one_streams(server):
    base, client = server
    conn, response = open_stream(base, "/v1/completions", {**LONG, "stream_options": {"include_usage": True}})
    try:
        assert events(response, 2)  # the long request is decoding
        short = client.completions.create(model=MODEL, prompt="a dog", max_tokens=2, temperature=0)
        assert short.usage.completion_tokens == 2 and short.choices[0].finish_reason == "length"
        assert http("GET", f"{base}/health")[1]["running"] >= 1  # the long one is still generating
        rest = events(response)
    finally:
        conn.close()
    assert rest[-1]["usage"]["completion_tokens"] == 240
    assert [c["choices"][0]["finish_reason"] for c in rest if c["choices"]][-1] == "length"


def test_a_disconnected_client_frees_its_request(server):
    base, _ = server
    idle = wait_health(base, lambda h: h["running"] == 0)
    conn, response = open_stream(base, "/v1/completions", LONG)
    assert len(events(response, 3)) == 3
    conn.close()  # mid-stream
    after = wait_health(base, lambda h: h["running"] == 0)
    assert after["running"] == 0 and after["aborted"] == idle["aborted"] + 1
    assert after["steps"] - idle["steps"] < 240  # stopped early, not decoded to max_tokens
    assert after["kv_blocks_free"] + after["kv_blocks_cached"] == after["kv_blocks"]  # every block back
    # the same for a non-streaming request: the client goes away while it waits
    host, port = base.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    payload = json.dumps({**LONG, "max_tokens": 240}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                 + f"content-length: {len(payload)}\r\n\r\n".encode() + payload)
    assert wait_health(base, lambda h: h["running"] == 1)["running"] == 1
    sock.close()
    final = wait_health(base, lambda h: h["running"] == 0)
    assert final["aborted"] == after["aborted"] + 1 and final["steps"] - after["steps"] < 240
    assert final["kv_blocks_free"] + final["kv_blocks_cached"] == final["kv_blocks"]


def test_logprobs_in_openai_shapes(server, reference):
    _, client = server
    tokenizer, greedy = reference
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0,
                                           logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    prompt = tokenizer.encode(tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True))
    tokens, logprobs = greedy(prompt, 8, logprobs=True)
    if tokens[-1] == tokenizer.eos_token_id:  # the stop token has no entry
        tokens, logprobs = tokens[:-1], logprobs[:-1]
    assert len(content) == len(tokens) and len(content) > 0
    assert b"".join(bytes(e.bytes) for e in content).decode(errors="replace") == reply.choices[0].message.content
    assert [e.logprob for e in content] == pytest.approx(logprobs, abs=1e-5)  # the engine's behaviour log-probs
    for entry in content:
        assert len(entry.top_logprobs) == 3
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        assert entry.top_logprobs[0].bytes == entry.bytes  # greedy: the sampled token is the most likely
        assert entry.top_logprobs[0].logprob == entry.logprob  # one computation: exactly the same number
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0,
                                                 logprobs=True, top_logprobs=3, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.bytes, e.logprob) for e in streamed] == [(e.bytes, e.logprob) for e in content]
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3)
    assert plain.choices[0].logprobs is None
    text = client.completions.create(model=MODEL, prompt="the cat", max_tokens=5, temperature=0, logprobs=2,
                                     extra_body={"ignore_eos": True})
    lp = text.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert all(len(top) <= 2 and max(top.values()) == value  # exactly: the sampled token's own entry
               for top, value in zip(lp.top_logprobs, lp.token_logprobs))
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    stream = list(client.completions.create(model=MODEL, prompt="the cat", max_tokens=5, temperature=0, logprobs=2,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert [t for c in stream if c.choices[0].logprobs for t in c.choices[0].logprobs.token_logprobs] == \
        lp.token_logprobs


def test_models_by_id_and_json_errors_for_invalid_text(server):
    base, _ = server
    status, card = http("GET", f"{base}/v1/models/{MODEL}")
    listed = http("GET", f"{base}/v1/models")[1]["data"][0]["id"]
    assert status == 200 and card["id"] == listed != MODEL and card["object"] == "model"  # found by its alias
    status, body = http("GET", f"{base}/v1/models/other")
    assert status == 404 and body["error"]["code"] == "model_not_found"
    lone = b'"\\ud800"'  # JSON allows the escape; the text is not valid Unicode
    cases = [(b'{"model": "%s", "messages": [{"role": "user", "content": %s}]}', "/v1/chat/completions",
              "messages.[0].content"),
             (b'{"model": "%s", "prompt": %s}', "/v1/completions", "prompt"),
             (b'{"model": "%s", "prompt": "x", "stop": [%s]}', "/v1/completions", "stop")]
    for template, path, param in cases:
        status, body = http("POST", f"{base}{path}", raw=template % (MODEL.encode(), lone))
        assert status == 400 and body["error"]["param"] == param and "surrogate" in body["error"]["message"]
    status, body = http("POST", f"{base}/v1/completions", raw=b'{"model": %s, "prompt": "x"}' % lone)
    assert status == 404 and body["error"]["code"] == "model_not_found"  # the name is echoed, still JSON
    for extra, param in (({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": True, "top_logprobs": 21},
                                                                  "top_logprobs")):
        status, body = http("POST", f"{base}/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, **extra})
        assert status == 400 and body["error"]["param"] == param
    status, body = http("POST", f"{base}/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 6})
    assert status == 400 and body["error"]["param"] == "logprobs"


@pytest.mark.parametrize("kwargs, status, param, code", [
    ({"temperature": 3}, 400, "temperature", None),
    ({"top_p": 1.5}, 400, "top_p", None),
    ({"n": 0}, 400, "n", None),
    ({"n": 17}, 400, "n", None),
    ({"max_tokens": 0}, 400, "max_tokens", None),
    ({"max_tokens": 100000}, 400, "max_tokens", "context_length_exceeded"),
    ({"stop": ["a", "b", "c", "d", "e"]}, 400, "stop", None),
    ({"presence_penalty": 1.0}, 400, "presence_penalty", "unsupported_parameter"),
    ({"response_format": {"type": "json_object"}}, 400, "response_format", "unsupported_parameter"),
    ({"extra_body": {"min_p": 0.1}}, 400, "min_p", "unsupported_parameter"),  # unknown: refused, not ignored
    ({"model": "gpt-4o"}, 404, "model", "model_not_found"),
    ({"messages": []}, 400, "messages", None),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages.[0].content.[0].type", None),
    ({"messages": [{"role": "user", "content": None}]}, 400, "messages.[0].content", None),
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
        assert main(["--checkpoint", str(path), "--port", str(free_port())]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error:") and needle in err and "\n" not in err
    with pytest.raises(SystemExit) as info:
        main(["--checkpoint", str(tmp_path), "--max_batch", "0"])
    assert info.value.code == 2


def test_cli_port_in_use_exits_2_before_loading_the_model(tmp_path, capsys, monkeypatch):
    import astrai.serve.__main__ as cli

    monkeypatch.setattr(cli, "build_engine", lambda args: pytest.fail("the model loaded before the port was checked"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli.main(["--checkpoint", str(tmp_path), "--host", "127.0.0.1", "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: --port {port}: cannot listen on 127.0.0.1:{port}") and "\n" not in err


def test_cli_an_address_not_of_this_machine_names_host_not_port(tmp_path, capsys, monkeypatch):
    """An address this machine does not have (192.0.2.1, TEST-NET-1) or a name that does not resolve is --host's
    fault, said in one line before the model loads; the port is not blamed."""
    import astrai.serve.__main__ as cli

    monkeypatch.setattr(cli, "build_engine", lambda args: pytest.fail("the model loaded before the host was checked"))
    for host in ("192.0.2.1", "no-such-host.invalid"):
        assert cli.main(["--checkpoint", str(tmp_path), "--host", host, "--port", str(free_port())]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"error: --host {host}: ") and "--port" not in err and "\n" not in err, err


@pytest.mark.parametrize("code, flag", [(errno.EADDRNOTAVAIL, "--host"), (errno.EAFNOSUPPORT, "--host"),
                                        (errno.EINVAL, "--host"), (errno.EADDRINUSE, "--port"),
                                        (errno.EACCES, "--port")])
def test_check_port_names_the_option_the_bind_error_is_about(monkeypatch, code, flag):
    """bind()'s errno decides: not an address of this machine (or its family, or an IPv6 link-local address
    without its interface) is --host; in use or not permitted (a privileged port) is --port."""
    from astrai.serve.__main__ import check_port

    def refuse(self, address):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(socket.socket, "bind", refuse)
    with pytest.raises(ValueError) as info:
        check_port("127.0.0.1", 8000)
    assert str(info.value).startswith(f"{flag} {'127.0.0.1' if flag == '--host' else 8000}: cannot listen on "
                                      f"127.0.0.1:8000 ({os.strerror(code)}); ")


def test_echo_with_max_tokens_0_scores_the_prompt(server, tiny_ppo_run):
    """vLLM's prompt scoring: `echo` + `max_tokens: 0` answers the log-probs of the prompt's own tokens (null for the
    first), equal to the model's forward; echo with tokens to generate, max_tokens 0 alone, n > 1 are 400s."""
    base, client = server
    ckpt = sorted((tiny_ppo_run / "checkpoints").glob("step-*"))[-1]
    model, _ = load_pretrained(str(ckpt))
    ids = [[5, 9, 12, 7, 3, 30], [8, 4, 6]]
    status, reply = http("POST", f"{base}/v1/completions", {"model": MODEL, "prompt": ids, "echo": True,
                                                            "max_tokens": 0, "logprobs": 2})
    assert status == 200 and reply["usage"] == {"prompt_tokens": 9, "completion_tokens": 0, "total_tokens": 9}
    for choice, row in zip(reply["choices"], ids):
        lp = choice["logprobs"]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None and len(lp["tokens"]) == len(row)
        with torch.no_grad():
            want = torch.log_softmax(model(torch.tensor([row]))[0, :-1].float(), -1)
        assert lp["token_logprobs"][1:] == pytest.approx(want.gather(1, torch.tensor(row[1:])[:, None])[:, 0].tolist(),
                                                         abs=1e-5)
        assert all(len(top) == 2 for top in lp["top_logprobs"][1:]) and choice["text"] == "".join(lp["tokens"])
    sdk = client.completions.create(model=MODEL, prompt=ids[0], echo=True, max_tokens=0, logprobs=0)
    assert sdk.choices[0].logprobs.token_logprobs[1:] == pytest.approx(reply["choices"][0]["logprobs"]
                                                                       ["token_logprobs"][1:], abs=1e-6)
    for extra, param in (({"echo": True, "max_tokens": 3}, "echo"), ({"max_tokens": 0}, "max_tokens"),
                         ({"echo": True, "max_tokens": 0, "n": 2}, "n")):
        status, reply = http("POST", f"{base}/v1/completions", {"model": MODEL, "prompt": ids[0], **extra})
        assert status == 400 and reply["error"]["param"] == param, reply


def test_a_served_teacher_scores_as_the_local_one(server, tiny_ppo_run):
    """Issue 45: distill.teacher as a URL (this server) gives the response tokens the log-probs the local teacher
    (the same checkpoint loaded here) gives them; its tokenizer check passes for the same tokenizer and names the
    first token that differs for another; a dead URL is one line naming distill.teacher."""
    from astrai.data.sequences import Sequences
    from astrai.experience.served_teacher import ServedTeacher, TeacherServerError
    from astrai.forward import response_logprobs

    base, _ = server
    ckpt = sorted((tiny_ppo_run / "checkpoints").glob("step-*"))[-1]
    model, tokenizer = load_pretrained(str(ckpt))
    teacher = ServedTeacher(f"{base}/v1", rows_per_request=2)
    assert teacher.model == str(tiny_ppo_run)
    teacher.check_tokenizer(tokenizer)
    seq = Sequences.from_tokens([[5, 9, 12], [8, 4], [3, 3, 3, 3]], [[7, 3, 30, 2], [6], [11, 12]], pad_token_id=2)
    served = teacher.response_logprobs(seq)
    with torch.no_grad():
        local = response_logprobs(model, seq, temperature=1.0)[0]
    mask = seq.action_mask
    assert served.shape == local.shape and served.dtype == torch.float32 and not served[~mask].any()
    torch.testing.assert_close(served[mask], local[mask], rtol=0, atol=1e-5)

    class Shifted:  # a tokenizer that spells every token differently
        def encode(self, text):
            return tokenizer.encode(text)

        def decode(self, ids, skip_special_tokens=True):
            return "x" + tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    with pytest.raises(TeacherServerError, match=r"^distill.teacher: .* does not share the student's tokenizer: "):
        teacher.check_tokenizer(Shifted())
    with pytest.raises(TeacherServerError, match=r"^distill.teacher: GET http://127.0.0.1:\d+/v1/models failed after "
                                                 r"1 attempts: "):
        ServedTeacher(f"http://127.0.0.1:{free_port()}/v1", retries=0)


def test_a_served_teachers_url_is_the_api_root_as_given_and_its_context_is_enforced(server, tiny_ppo_run, tmp_path,
                                                                                    capsys):
    """The URL is used as given (nothing appended): the server's root and another version answer 404, refused in one
    line saying the URL must be the API root. A row longer than the server's context is a 400
    `context_length_exceeded` (param `prompt`) that the client turns into one line naming distill.teacher, and a
    job whose rollout outgrows the served model's `max_model_len` is refused by --check and at start-up."""
    from test_distill import grpo_args, save_tiny

    from astrai.data.sequences import Sequences
    from astrai.experience.served_teacher import ServedTeacher, TeacherServerError
    from astrai.train import main

    base, _ = server
    for url in (base, f"{base}/v2"):
        with pytest.raises(TeacherServerError) as info:
            ServedTeacher(url, retries=0)
        message = str(info.value)
        assert message.startswith(f"distill.teacher: GET {url}/models answered 404: ") and "\n" not in message
        assert message.endswith("distill.teacher must be the server's API root, where /models and /completions are "
                                "(e.g. http://host:8000/v1)")
    teacher = ServedTeacher(f"{base}/v1/", retries=0)
    assert teacher.base_url == f"{base}/v1" and teacher.max_model_len == 256
    status, reply = http("POST", f"{base}/v1/completions", {"model": MODEL, "prompt": [5] * 257, "echo": True,
                                                            "max_tokens": 0, "logprobs": 0})
    assert status == 400 and reply["error"]["param"] == "prompt" and reply["error"]["code"] == "context_length_exceeded"
    seq = Sequences.from_tokens([[5] * 200], [[7] * 60], pad_token_id=2)
    with pytest.raises(TeacherServerError) as info:
        teacher.response_logprobs(seq)
    assert str(info.value) == (f"distill.teacher: {base}/v1 ({tiny_ppo_run}) cannot score a row this long: This "
                               "model's maximum context length is 256 tokens; prompt[0] has 260 tokens to score; its "
                               "context must hold data.max_prompt_length + rollout.max_new_tokens tokens")
    student = save_tiny(tmp_path / "student", seed=0, max_position_embeddings=512)  # the served tokenizer's
    long = ("--data.max_prompt_length", "300", "--rollout.max_new_tokens", "8")
    for extra in (["--check"], []):
        assert main(grpo_args(student, f"{base}/v1", tmp_path / f"run{len(extra)}", *long, *extra)) == 2
        err = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("warning:")]
        assert err == [f"error: distill.teacher: {base}/v1 has max_model_len=256, fewer than the 308 tokens it must "
                       "score (data.max_prompt_length 300 + rollout.max_new_tokens 8); use a teacher with a longer "
                       "context or lower them"], err


def test_an_over_context_prompt_names_prompt_for_completions_and_messages_for_chat(server):
    base, _ = server
    status, reply = http("POST", f"{base}/v1/completions", {"model": MODEL, "prompt": [5] * 256, "max_tokens": 4})
    assert status == 400 and reply["error"]["param"] == "prompt" and reply["error"]["code"] == "context_length_exceeded"
    status, reply = http("POST", f"{base}/v1/completions", {"model": MODEL, "prompt": [5] * 250, "max_tokens": 10})
    assert status == 400 and reply["error"]["param"] == "max_tokens"
    long = [{"role": "user", "content": " a" * 300}]
    status, reply = http("POST", f"{base}/v1/chat/completions", {"model": MODEL, "messages": long, "max_tokens": 4})
    assert status == 400 and reply["error"]["param"] == "messages"
    assert reply["error"]["code"] == "context_length_exceeded"


def test_online_grpo_distills_from_a_served_teacher_as_from_the_local_one(server, tiny_ppo_run, tmp_path):
    """The served checkpoint as both student and teacher: at step 1 the reverse KL is ~0 and the first step's
    metrics equal those of the same job with the teacher loaded locally (deterministic sampling)."""
    from test_distill import grpo_args, records

    from astrai.train import main

    base, _ = server
    ckpt = sorted((tiny_ppo_run / "checkpoints").glob("step-*"))[-1]
    runs = {}
    for name, teacher in (("local", ckpt), ("served", f"{base}/v1")):
        out = tmp_path / name
        assert main(grpo_args(ckpt, teacher, out, "--runtime.deterministic", "true", "--max_steps", "1")) == 0
        runs[name] = records(out)[0]
    assert abs(runs["served"]["distill/reverse_kl"]) < 1e-5
    for key in ("distill/reverse_kl", "policy/loss", "rollout/advantage_abs_mean"):
        assert runs["served"][key] == pytest.approx(runs["local"][key], abs=1e-5), key
