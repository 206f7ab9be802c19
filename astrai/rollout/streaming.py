"""Iteration-level serving over the paged engine: requests are added, stepped and aborted one decode step at a time.

Continuous batching as Orca (Yu et al. 2022, "iteration-level scheduling") and vLLM's `LLMEngine`
(`add_request` / `step` / `abort_request`) drive it: a server thread calls `PagedGenerationEngine.step()` in a loop;
between two steps it may add requests (they are prefilled in the next step, alongside the decode tokens of the
running ones) and abort others (their KV blocks go back to the pool before `abort` returns). So a short request's
time to first token is at most one running step plus its own prefill, whatever else is running, and a client that
goes away costs at most the step in flight.

The session runs on the engine's `Scheduler` (the one `generate` uses), over the whole KV pool (`max_kv_tokens`,
allocated when the first request is added). Sampling per choice draws from its own generator seeded by
`request_seed(seed, choice)`, exactly as `generate([prompt], n=n)` seeds its rows from a base seed, so a request
added with `seed=s` samples what `generate` samples with base seed `s` when the arithmetic is batch-invariant
(it is on CPU in float32 here; a GPU GEMM may round differently at another batch size).

What it simplifies: no preemption (admission reserves each request's worst case, as the scheduler does), FIFO
admission, no priorities.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Optional

import torch

from astrai.rollout.sampling import SamplingParams
from astrai.rollout.row_sampling import FrequencyPenalty, RowSampling, draw_base_seed, request_seed
from astrai.rollout.scheduler import Group, Request, Scheduler

__all__ = ["StepOutput", "StreamSession"]


@dataclass(frozen=True)
class StepOutput:
    """One token of one choice, produced by `PagedGenerationEngine.step()`.

    Attributes:
        request_id: the id `add_request` returned; choice: the sample index in [0, n).
        token_id: the sampled token; logprob: its behaviour log-prob (nats, float32 precision) under
            `log_softmax(logits / temperature)` (docs/conventions.md section 2).
        top_logprobs: the request's `top_logprobs` most likely (token id, log-prob) pairs under that distribution,
            most likely first (() when none were asked).
        done: this choice is over (stop token or max_new_tokens); finished: it ended with a stop token.
        cached_tokens: the tokens of its prompt whose KV the version-tagged prefix cache served when it was admitted
            (no prefill for them; the same on each of its outputs; 0 for choices after the first, which share the
            first's blocks).
    """

    request_id: int
    choice: int
    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...]
    done: bool
    finished: bool
    cached_tokens: int = 0


class StreamSession:
    """The live requests of one engine between `add_request` calls and `step()`s (built by the engine; one at a
    time; dropped by `generate`, `load_weights` and `sleep`, which refuse while requests are live).

    Args:
        engine: the `PagedGenerationEngine` (its workspace, pool, prefix cache, model and sizes).
    """

    EMPTY_STATS = {"running": 0, "waiting": 0, "kv_blocks": 0, "kv_blocks_free": 0, "kv_blocks_cached": 0, "steps": 0}

    def __init__(self, engine):
        engine._ensure_capacity(engine.max_kv_blocks)
        self.engine = engine
        self.runner = engine._runner()
        self.scheduler = Scheduler(pool=engine.pool, prefix_cache=engine.prefix_cache, workspace=engine.workspace,
                                   forward=engine._ticking(self.runner.forward), policy_version=engine.policy_version,
                                   max_batch_tokens=engine.max_batch_tokens, max_num_seqs=engine.max_num_seqs,
                                   wait_for_shared_prefix=False)  # serving: a step of latency > a block of prefill
        self.requests: dict[int, list[Request]] = {}  # request id -> its n choices
        self._owner: dict[int, tuple[int, int]] = {}  # row index -> (request id, choice)
        self._next_request = 0
        self._next_row = 0

    @property
    def live(self) -> bool:
        """True while some added request has a choice that is not done."""
        return bool(self.requests)

    def add(self, prompt: list[int], params: SamplingParams, *, n: int, penalty: Optional[FrequencyPenalty],
            seed: Optional[int], top_logprobs: int) -> int:
        """Queue one request (n choices of `prompt`, already checked token by token); its request id.

        Raises:
            ValueError: naming the argument: params not a SamplingParams, n or top_logprobs out of range, prompt +
                max_new_tokens beyond the rotary table, or a request whose worst case cannot fit the KV pool.
        """
        engine = self.engine
        if not isinstance(params, SamplingParams):
            raise ValueError(f"add_request: params must be a SamplingParams, got {type(params).__name__}")
        for name, value, low, high in (("n", n, 1, engine.max_num_seqs),
                                       ("top_logprobs", top_logprobs, 0, engine.model.config.vocab_size)):
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ValueError(f"add_request: {name} must be an integer in [{low}, {high}], got {value!r}")
        limit = engine.model.config.max_position_embeddings
        if len(prompt) + params.max_new_tokens > limit:
            raise ValueError(f"add_request: the prompt ({len(prompt)} tokens) + max_new_tokens "
                             f"{params.max_new_tokens} exceeds max_position_embeddings {limit}")
        scheduler = self.scheduler
        total = scheduler.blocks_for(len(prompt) + params.max_new_tokens)
        need = total + (n - 1) * (total - len(prompt) // engine.block_size)
        if need > engine.pool.num_blocks:
            raise ValueError(f"add_request: {n} choice(s) of {len(prompt)} + {params.max_new_tokens} tokens need "
                             f"{need} KV blocks, the pool holds {engine.pool.num_blocks} "
                             f"({engine.pool.num_blocks * engine.block_size} tokens); raise max_kv_tokens")
        if seed is None:
            seed = draw_base_seed()
        seed = operator.index(seed)
        request_id, self._next_request = self._next_request, self._next_request + 1
        members = []
        for choice in range(n):
            rng = torch.Generator(device=engine.device).manual_seed(request_seed(seed, choice))
            row, self._next_row = self._next_row, self._next_row + 1
            members.append(Request(index=row, prompt=list(prompt), top_logprobs=top_logprobs,
                                   sampling=RowSampling(params, penalty, rng, [])))
            self._owner[row] = (request_id, choice)
        self.requests[request_id] = members
        scheduler.add([Group(members=members)])
        return request_id

    def step(self) -> list[StepOutput]:
        """One engine step over the live requests (nothing when none is live); the tokens it sampled."""
        if not self.requests:
            return []
        out, ended = [], set()
        for event in self.scheduler.step():
            req = event.request
            request_id, choice = self._owner[req.index]
            out.append(StepOutput(request_id, choice, event.token_id, event.logprob, event.top, event.done,
                                  req.finished, req.cached_tokens))
            if event.done:
                ended.add(request_id)
        for request_id in ended:  # after the loop: choices of one request may end in the same step
            self._forget(request_id)
        return out

    def abort(self, request_id: int, choice: Optional[int] = None) -> None:
        """Stop one choice (or all of a request's); its KV blocks are back in the pool on return. Unknown or
        finished ids are ignored (a client may go away after its request ended)."""
        members = self.requests.get(request_id)
        if members is None:
            return
        chosen = members if choice is None else [m for c, m in enumerate(members) if c == choice]
        self.scheduler.abort(chosen)
        self._forget(request_id)

    def _forget(self, request_id: int) -> None:
        """Drop a request's bookkeeping once every choice is done (aborted leaders finish after their prefill)."""
        members = self.requests.get(request_id)
        if members is not None and all(m.done for m in members):
            del self.requests[request_id]
            for m in members:
                del self._owner[m.index]

    def stats(self) -> dict[str, int]:
        """Live requests and KV blocks: `running` (choices decoding or prefilling), `waiting` (choices not yet
        admitted), `kv_blocks`, `kv_blocks_free` (reference count 0), `kv_blocks_cached` (held only by the
        prefix cache, reclaimable), `steps` (engine steps of this session)."""
        s = self.scheduler
        pool, cache = self.engine.pool, self.engine.prefix_cache
        cached = 0 if cache is None else cache.num_reclaimable
        return {"running": len(s.running) + sum(len(g.members) for g in s.prefilling),
                "waiting": sum(len(g.members) for g in s.waiting), "kv_blocks": pool.num_blocks,
                "kv_blocks_free": pool.num_free, "kv_blocks_cached": cached, "steps": s.steps}
