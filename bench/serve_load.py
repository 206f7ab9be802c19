"""Serving under load: N concurrent streaming clients with mixed response lengths against `python -m astrai.serve`,
then transformers' `generate` one request at a time on the same weights and threads.

    python bench/serve_load.py [--clients 8] [--requests-per-client 4] [--short-tokens 32] [--long-tokens 256]
                               [--think-seconds 0.5] [--threads 1] [--sequential-requests 8] [--server-arg=--X ...]

Model: SmolLM2-135M-Instruct exported to a Hugging Face directory in float32 (`hf_export.py`), which both the server
and transformers load, so both run the same weights. Prompts: GSM8K test questions, chat-templated. Request j of
client c is long (`--long-tokens`) when (c + j) % 4 == 0, else short (`--short-tokens`): every client sends one long
request in four, and the clients start together, so long requests run while short ones arrive. Each client sends
its requests one after another (closed loop), waiting a random think time before each (exponential, mean
`--think-seconds`, seeded): without it, requests that started in one step end in one step and come back together,
so the clients fall into lock-step cohorts that no real traffic has. Requests are streaming chat completions,
greedy, with vLLM's `ignore_eos` (and transformers' `min_new_tokens`) so every response has exactly its length. Time to first token (TTFT) = from sending
the request to the first chunk with content; tokens/s = completion tokens (from `usage`) / wall time of the whole
load. `short while long` covers short requests sent while a long one was in flight. The sequential baseline runs
the first `--sequential-requests` requests of the same mix (in order of j, then c) through `generate` one at a
time: TTFT = time to its first new token (a `BaseStreamer`), tokens/s = all new tokens / all generate time. The
server process and transformers get the same `--threads` (OMP_NUM_THREADS); the clients run in this process.
Last line: `ratio: X.XX` = server aggregate tokens/s / sequential tokens/s.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
from http.client import HTTPConnection

import gsm8k
import hf_export
from cli_help import DefaultsFormatter  # noqa: E402  (bench/, the script's own folder)

MODEL = "served"


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between closest ranks."""
    values = sorted(values)
    if len(values) == 1:
        return values[0]
    pos = (len(values) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (pos - low)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir, port: int, threads: int, max_batch: int, extra: list[str]) -> subprocess.Popen:
    """The server on 127.0.0.1:port, once /health answers (exits naming the log on failure)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    log = open(os.path.join(os.path.dirname(str(model_dir)), "serve_load.log"), "w")
    proc = subprocess.Popen([sys.executable, "-m", "astrai.serve", "--checkpoint", str(model_dir), "--port",
                             str(port), "--served_model_name", MODEL, "--max_batch", str(max_batch),
                             "--max_kv_tokens", "16384", "--log_level", "warning", *extra], env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"the server exited with {proc.returncode}; see {log.name}")
        try:
            conn = HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return proc
        except OSError:
            pass
        time.sleep(0.5)
    proc.kill()
    sys.exit(f"the server did not answer /health in 300 s; see {log.name}")


def stream_chat(port: int, question: str, max_tokens: int) -> tuple[float, int]:
    """(TTFT seconds, completion tokens) of one streaming chat request."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    conn = HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        sys.exit(f"request failed with {response.status}: {response.read()[:300]!r}")
    ttft, tokens = None, 0
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if ttft is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
            ttft = time.perf_counter() - start
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
    conn.close()
    return ttft if ttft is not None else time.perf_counter() - start, tokens


def run_load(port: int, plan: dict[int, list[tuple[str, int, bool]]], think: float) -> tuple[list[dict], float]:
    """Every client's requests (closed loop, a think time before each), all clients at once: (one record per
    request, wall seconds)."""
    records, lock, long_in_flight = [], threading.Lock(), [0]
    barrier = threading.Barrier(len(plan))

    def client(c: int, requests: list[tuple[str, int, bool]]) -> None:
        rng = random.Random(c)
        barrier.wait()
        for question, max_tokens, is_long in requests:
            if think > 0:
                time.sleep(rng.expovariate(1 / think))
            with lock:
                while_long = long_in_flight[0] > 0
                long_in_flight[0] += is_long
            ttft, tokens = stream_chat(port, question, max_tokens)
            with lock:
                long_in_flight[0] -= is_long
                records.append({"long": is_long, "while_long": while_long, "ttft": ttft, "tokens": tokens})

    threads = [threading.Thread(target=client, args=(c, reqs)) for c, reqs in plan.items()]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return records, time.perf_counter() - start


def run_sequential(model_dir, questions: list[tuple[str, int]], threads: int) -> tuple[list[float], int, float]:
    """transformers' generate one request at a time: (TTFTs, new tokens, generate seconds)."""
    import torch
    import transformers
    from transformers.generation.streamers import BaseStreamer

    from astrai.models import load_pretrained

    torch.set_num_threads(threads)
    _, tokenizer = load_pretrained(str(model_dir), torch.float32)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()

    class FirstToken(BaseStreamer):
        def __init__(self):
            self.puts, self.at = 0, None

        def put(self, value):
            self.puts += 1
            if self.puts == 2:  # the first put is the prompt
                self.at = time.perf_counter()

        def end(self):
            pass

    ttfts, tokens, seconds = [], 0, 0.0
    for i, (question, max_tokens) in enumerate([questions[0]] + questions):  # the first is a warm-up
        ids = torch.tensor([tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": question}]))])
        streamer = FirstToken()
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                 min_new_tokens=max_tokens, do_sample=False, pad_token_id=2, streamer=streamer)
        if i == 0:
            continue
        seconds += time.perf_counter() - start
        ttfts.append(streamer.at - start)
        tokens += out.shape[1] - ids.shape[1]
    return ttfts, tokens, seconds


def summary(name: str, ttfts: list[float], tokens: int, seconds: float) -> str:
    return (f"{name:<22} n={len(ttfts):<3} TTFT p50 {percentile(ttfts, 50):6.3f} s  p99 {percentile(ttfts, 99):6.3f} s"
            f"  tokens {tokens:6d}  {tokens / seconds:7.1f} tok/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=DefaultsFormatter)
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients")
    parser.add_argument("--requests-per-client", type=int, default=4, help="requests each client sends in turn")
    parser.add_argument("--short-tokens", type=int, default=32, help="response length of short requests")
    parser.add_argument("--long-tokens", type=int, default=256, help="response length of long requests")
    parser.add_argument("--think-seconds", type=float, default=0.5,
                        help="mean think time of a client before each request (exponential; 0: none)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the server and of transformers")
    parser.add_argument("--sequential-requests", type=int, default=8,
                        help="requests of the transformers baseline (0: skip it, and the ratio)")
    parser.add_argument("--server-arg", action="append", default=[],
                        help="extra argument for python -m astrai.serve (repeat; e.g. --server-arg=--max_batch)")
    args = parser.parse_args()
    if min(args.clients, args.requests_per_client, args.short_tokens, args.long_tokens, args.threads) < 1:
        parser.error("every count must be >= 1")
    if args.sequential_requests < 0 or args.think_seconds < 0:
        parser.error("--sequential-requests and --think-seconds must be >= 0")
    total = args.clients * args.requests_per_client
    records = gsm8k.first_records(gsm8k.DEFAULT, total, "one question per request")
    model_dir = hf_export.export_hf("smollm2-135m-instruct")
    plan: dict[int, list[tuple[str, int, bool]]] = {c: [] for c in range(args.clients)}
    ordered = []
    for j in range(args.requests_per_client):
        for c in range(args.clients):
            is_long = (c + j) % 4 == 0
            request = (records[j * args.clients + c]["question"], args.long_tokens if is_long else args.short_tokens,
                       is_long)
            plan[c].append(request)
            ordered.append(request)
    print(f"threads: {args.threads} (server and transformers); model: {model_dir}")
    print(f"clients: {args.clients}, requests: {total} ({sum(r[2] for r in ordered)} long of {args.long_tokens} "
          f"tokens, the rest {args.short_tokens}), greedy, ignore_eos, think time {args.think_seconds} s; "
          f"server args {args.server_arg}")
    port = free_port()
    server = start_server(model_dir, port, args.threads, max(args.clients, 8), args.server_arg)
    try:
        stream_chat(port, ordered[0][0], 4)  # warm-up
        load, wall = run_load(port, plan, args.think_seconds)
    finally:
        server.terminate()
        server.wait(timeout=60)
    tokens = sum(r["tokens"] for r in load)
    print(summary("astrai serve, all", [r["ttft"] for r in load], tokens, wall))
    shorts = [r["ttft"] for r in load if not r["long"] and r["while_long"]]
    if shorts:
        print(f"{'  short while long':<22} n={len(shorts):<3} TTFT p50 {percentile(shorts, 50):6.3f} s  "
              f"p99 {percentile(shorts, 99):6.3f} s")
    longs = [r["ttft"] for r in load if r["long"]]
    print(f"{'  long':<22} n={len(longs):<3} TTFT p50 {percentile(longs, 50):6.3f} s  p99 {percentile(longs, 99):6.3f} s")
    print(f"astrai serve wall time {wall:.1f} s")
    if not args.sequential_requests:
        return
    sequential = [(q, n) for q, n, _ in ordered[:args.sequential_requests]]
    ttfts, seq_tokens, seq_seconds = run_sequential(model_dir, sequential, args.threads)
    print(summary("transformers, one at a time", ttfts, seq_tokens, seq_seconds))
    print(f"ratio: {(tokens / wall) / (seq_tokens / seq_seconds):.2f}")


if __name__ == "__main__":
    main()
