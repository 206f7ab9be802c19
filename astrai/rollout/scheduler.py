"""Continuous-batching scheduler of the paged engine (Orca, Yu et al. 2022; paged KV from vLLM, Kwon et al. 2023).

Every step packs one decode token for each running request plus prefill chunks of waiting requests, bounded by a
`max_batch_tokens` budget and `max_num_seqs` live sequences; requests join after their prefill and leave as soon as
they stop, between steps. Requests with the same prompt form a group: the leader's prompt is prefilled once, then
the other members fork its block table (shared blocks, reference counted) and copy the partial last block on their
first write (copy-on-write). Full prompt blocks go to the prefix cache for later requests; a request whose first
prompt block is being computed by another group waits for it (one step) and then reuses it from the cache.

Admission reserves the worst-case number of blocks of a group (prompt + max_new_tokens), so a running request
never runs out of KV blocks and nothing is ever preempted.

Two ways to drive it: `run(groups)` generates a fixed set to completion (the engine's `generate`); `add` / `step` /
`abort` keep a live set that callers change between steps (the engine's streaming API, which the server drives:
requests join and leave the running batch between decode steps, and an aborted request's blocks are freed at once).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from astrai.kernels import InferenceWorkspace
from astrai.rollout.block_pool import BlockPool, PrefixCache
from astrai.rollout.model_runner import StepBatch
from astrai.rollout.row_sampling import RowSampling, sample_rows_with_top

__all__ = ["Request", "Group", "Scheduler", "TokenEvent"]


@dataclass
class Request:
    """One output row: its prompt, sampling state, block table and results."""

    index: int
    prompt: list[int]
    sampling: RowSampling
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose keys/values are in the cache
    logprobs: list[float] = field(default_factory=list)
    finished: bool = False  # ended with a stop token
    done: bool = False
    top_logprobs: int = 0  # k most likely tokens to report with each sampled one (0: none)
    cancelled: bool = False  # aborted by the caller; done as soon as it holds no blocks another member needs
    group: Optional["Group"] = field(default=None, repr=False, compare=False)
    cached_tokens: int = 0  # prompt tokens whose KV the prefix cache served at admission (leader only)

    @property
    def generated(self) -> list[int]:
        """Sampled token ids so far."""
        return self.sampling.generated


@dataclass
class Group:
    """Requests sharing one prompt; `members[0]` is the leader that prefills. `reserve`: blocks still reserved."""

    members: list[Request]
    reserve: int = 0

    @property
    def leader(self) -> Request:
        """The member whose prefill serves the whole group."""
        return self.members[0]


@dataclass(frozen=True)
class TokenEvent:
    """One sampled token of a step: the request, the token id, its behaviour log-prob (float, nats, under
    `log_softmax(logits / temperature)`), the `request.top_logprobs` most likely (token id, log-prob) pairs under
    the same distribution (most likely first; () when none were asked), and whether the request is now done."""

    request: Request
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]
    done: bool


class Scheduler:
    """Drives groups of requests to completion over a block pool, a prefix cache and a step function.

    Args:
        pool, prefix_cache, workspace: KV bookkeeping and storage (prefix_cache None disables reuse).
        forward: `StepBatch -> logits (R, V)`, e.g. `PagedModelRunner.forward`.
        policy_version: tag for prefix-cache lookups/inserts.
        max_batch_tokens: most tokens per step (decode tokens count 1 each).
        max_num_seqs: most requests decoding or prefilling at once.
        on_token: optional `(request index, token id) -> None`, called after each sampled token (streaming).
        wait_for_shared_prefix: let a group whose first prompt block another group is prefilling wait a step to
            reuse it (a throughput trade that suits a batch of rollouts; a server turns it off: a step of latency
            costs more than a block of prefill).
    """

    def __init__(self, *, pool: BlockPool, prefix_cache: Optional[PrefixCache], workspace: InferenceWorkspace,
                 forward: Callable[[StepBatch], torch.Tensor], policy_version: int, max_batch_tokens: int,
                 max_num_seqs: int, on_token: Optional[Callable[[int, int], None]] = None,
                 wait_for_shared_prefix: bool = True):
        self.pool, self.prefix_cache, self.workspace, self.forward = pool, prefix_cache, workspace, forward
        self.on_token, self.wait_for_shared_prefix = on_token, wait_for_shared_prefix
        self.block_size = workspace.block_size
        self.policy_version, self.max_batch_tokens, self.max_num_seqs = policy_version, max_batch_tokens, max_num_seqs
        self.reserved = 0
        self.steps = 0
        self.waiting: deque[Group] = deque()
        self.prefilling: list[Group] = []
        self.running: list[Request] = []
        self._events: list[TokenEvent] = []

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks holding `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def _admit(self, group: Group) -> bool:
        """Attach cached prefix blocks to the leader and reserve the group's worst case; False if it doesn't fit."""
        leader = group.leader
        cached = self.prefix_cache.lookup(leader.prompt, self.policy_version) if self.prefix_cache else []
        total = self.blocks_for(len(leader.prompt) + leader.sampling.params.max_new_tokens)
        shared_full = len(leader.prompt) // self.block_size
        need = total - len(cached) + (len(group.members) - 1) * (total - shared_full)
        short = need - (self.pool.num_free - self.reserved)
        if short > 0 and self.prefix_cache is not None:
            self.prefix_cache.evict(short)
        if need > self.pool.num_free - self.reserved:
            self.pool.release_all(cached)
            return False
        leader.blocks, leader.num_computed = list(cached), len(cached) * self.block_size
        leader.cached_tokens = leader.num_computed
        group.reserve, self.reserved = need, self.reserved + need
        return True

    def _waits_for_shared_prefix(self, group: Group, prefilling: list[Group]) -> bool:
        """True when a group still prefilling starts with the same full first block as `group`'s prompt and that
        block is not cached yet: admitted after that group's prefill, `group` reuses the block from the prefix
        cache instead of recomputing it (e.g. a system prompt shared by every prompt of a batch)."""
        if self.prefix_cache is None or not self.wait_for_shared_prefix:
            return False
        bs, prompt = self.block_size, group.leader.prompt
        if len(prompt) <= bs or self.prefix_cache.has_block(prompt[:bs], self.policy_version):
            return False
        return any(len(other.leader.prompt) > bs and other.leader.prompt[:bs] == prompt[:bs]
                   for other in prefilling)

    def _alloc(self, group: Group) -> int:
        """A new block charged to the group's reservation."""
        if group.reserve > 0:
            group.reserve -= 1
            self.reserved -= 1
        return self.pool.allocate()

    def _prepare_write(self, req: Request, group: Group, start: int, n: int) -> list[int]:
        """Make positions [start, start + n) writable (new blocks, copy-on-write of shared ones); their slots."""
        bs = self.block_size
        for idx in range(start // bs, (start + n - 1) // bs + 1):
            if idx == len(req.blocks):
                req.blocks.append(self._alloc(group))
            elif self.pool.refcount[req.blocks[idx]] > 1:
                fresh = self._alloc(group)
                self.workspace.copy_block(req.blocks[idx], fresh)
                self.pool.decref(req.blocks[idx])
                req.blocks[idx] = fresh
        return [req.blocks[p // bs] * bs + p % bs for p in range(start, start + n)]

    def _finish(self, req: Request, group: Group) -> None:
        """Free a stopped request's blocks; release the group's leftover reservation when all members stopped."""
        req.done = True
        self.pool.release_all(req.blocks)
        req.blocks = []
        if all(m.done for m in group.members):
            self.reserved -= group.reserve
            group.reserve = 0

    @property
    def has_work(self) -> bool:
        """True while some added request is not done."""
        return bool(self.waiting or self.prefilling or self.running)

    def add(self, groups: list[Group]) -> None:
        """Queue `groups` (FIFO) for admission at the next step."""
        for group in groups:
            for member in group.members:
                member.group = group
            self.waiting.append(group)

    def run(self, groups: list[Group]) -> None:
        """Generate until every request of `groups` is done.

        Raises:
            RuntimeError: when a group cannot fit in the KV pool even with nothing else running.
        """
        self.add(groups)
        while self.has_work:
            self.step()

    def step(self) -> list[TokenEvent]:
        """Admit waiting groups, run one forward (decode tokens + prefill chunks), sample; the step's tokens.

        Raises:
            RuntimeError: when the first waiting group cannot fit in the KV pool even with nothing else running.
        """
        waiting, prefilling, running = self.waiting, self.prefilling, self.running
        budget = self.max_batch_tokens - len(running)
        live = len(running) + sum(len(g.members) for g in prefilling)
        for group in list(waiting):  # FIFO, except groups waiting for a shared prefix let later ones pass
            if live + len(group.members) > self.max_num_seqs:
                break
            if self._waits_for_shared_prefix(group, prefilling):
                continue
            if not self._admit(group):
                break
            waiting.remove(group)
            live += len(group.members)
            prefilling.append(group)
        if not prefilling and not running:
            if not waiting:
                return []
            raise ValueError(f"KV pool of {self.pool.num_blocks} blocks x {self.block_size} tokens cannot "
                             f"hold one group of {len(waiting[0].members)} requests; raise max_kv_tokens")
        chunks = []
        for group in prefilling:
            leader = group.leader
            n = min(len(leader.prompt) - leader.num_computed, budget)
            if n <= 0:
                break
            chunks.append((group, n))
            budget -= n
        self._step(running, chunks)
        for group, _ in chunks:
            if group.leader.num_computed == len(group.leader.prompt):
                prefilling.remove(group)
                running.extend(m for m in group.members if not m.done)
        running[:] = [r for r in running if not r.done]
        events, self._events = self._events, []
        return events

    def abort(self, requests: list[Request]) -> None:
        """Stop `requests` now: blocks they alone hold go back to the pool before this returns; a group's leader
        still prefilling for live members finishes its prefill first (its blocks are theirs), then stops. Done
        requests are ignored."""
        for req in requests:
            if not req.done:
                req.cancelled = True
        for group in list(self.waiting):  # not admitted: nothing reserved, no blocks
            for member in group.members:
                member.done = member.done or member.cancelled
            group.members = [m for m in group.members if not m.done]
            if not group.members:
                self.waiting.remove(group)
        for group in list(self.prefilling):
            if all(m.cancelled or m.done for m in group.members):
                self.prefilling.remove(group)
                for member in group.members:
                    self._finish(member, group)
                continue
            for member in group.members[1:]:  # no blocks yet: they fork the leader's after its prefill
                if member.cancelled:
                    member.done = True
        for req in self.running:
            if req.cancelled and not req.done:
                self._finish(req, req.group)
        self.running[:] = [r for r in self.running if not r.done]

    def _step(self, running: list[Request], chunks: list[tuple[Group, int]]) -> None:
        """One forward: decode tokens of `running` + prefill `chunks`; then sample where logits are due."""
        batch = StepBatch([], [], [], [0], [], [], [], seq_ids=[])
        due: list[tuple[int, list[Request]]] = []  # (row in batch.logit_rows, requests sampling from it)
        for req in running:
            pos = req.num_computed
            self._add(batch, req, req.group, [req.generated[-1]], pos)
            due.append((len(batch.logit_rows), [req]))
            batch.logit_rows.append(batch.qo_indptr[-1] - 1)
        for group, n in chunks:
            leader = group.leader
            start = leader.num_computed
            self._add(batch, leader, group, leader.prompt[start:start + n], start)
            if start + n == len(leader.prompt):
                due.append((len(batch.logit_rows), [m for m in group.members if not (m.cancelled or m.done)]))
                batch.logit_rows.append(batch.qo_indptr[-1] - 1)
        logits = self.forward(batch)
        self.steps += 1
        for group, _ in chunks:
            if group.leader.num_computed == len(group.leader.prompt):
                self._fork(group)
                if group.leader.cancelled:  # prefilled for the other members only
                    self._finish(group.leader, group)
        rows = [row for row, reqs in due for _ in reqs]
        reqs = [req for _, members in due for req in members]
        if rows != list(range(logits.shape[0])):
            logits = logits[rows]
        # one computation for the sampled token's log-prob and the top ones (the same logsumexp), so they agree exactly
        tokens, logprobs, tops = sample_rows_with_top(logits, [r.sampling for r in reqs],
                                                      [r.top_logprobs for r in reqs], scratch=self.workspace)
        for req, token, logprob, top in zip(reqs, tokens, logprobs, tops):
            self._record(req, token, logprob, top)

    def _add(self, batch: StepBatch, req: Request, group: Group, token_ids: list[int], start: int) -> None:
        """Append a request's new tokens at positions [start, start + len) to the step."""
        n = len(token_ids)
        batch.slots.extend(self._prepare_write(req, group, start, n))
        batch.token_ids.extend(token_ids)
        batch.positions.extend(range(start, start + n))
        batch.qo_indptr.append(batch.qo_indptr[-1] + n)
        req.num_computed = start + n
        batch.kv_lens.append(req.num_computed)
        batch.block_tables.append(list(req.blocks))
        batch.seq_ids.append(req.index)

    def _fork(self, group: Group) -> None:
        """After the leader's prompt is computed: cache its full blocks; members share its block table."""
        leader = group.leader
        if self.prefix_cache is not None:
            self.prefix_cache.insert(leader.prompt, leader.blocks, self.policy_version)
        for member in group.members[1:]:
            if member.done:  # aborted before the fork
                continue
            for block in leader.blocks:
                self.pool.incref(block)
            member.blocks, member.num_computed = list(leader.blocks), leader.num_computed

    def _record(self, req: Request, token: int, logprob: float, top: tuple) -> None:
        """Append a sampled token; finish the request on a stop token or at max_new_tokens."""
        params = req.sampling.params
        req.generated.append(token)
        req.logprobs.append(logprob)
        if self.on_token is not None:
            self.on_token(req.index, token)
        if token in params.stop_token_ids:
            req.finished = True
        if req.finished or len(req.generated) >= params.max_new_tokens:
            self._finish(req, req.group)
        self._events.append(TokenEvent(req, token, logprob, top, req.done))
