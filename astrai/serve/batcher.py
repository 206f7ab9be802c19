"""Request batching for the server: requests arriving within a short window share one `engine.generate` call.

A background asyncio task takes the first waiting `Job`, keeps collecting jobs for `window_s` seconds (or until
`max_batch` rows are gathered), and runs one engine call for them in a worker thread: the engine's `generate` is
synchronous and serialised by its own lock, so the event loop keeps accepting requests meanwhile, and those queue
up for the next call. Inside a call the engine batches continuously (rows join and leave between decode steps).

Each job's `n` choices are separate rows of the prompt (the engine prefills a repeated prompt once and shares its
KV blocks). A job with a `seed` runs in its own engine call with a generator seeded by it, so the same request with
the same seed gives the same text whatever else is being served; unseeded jobs draw from a server RNG.
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from astrai.rollout.sampling import SamplingParams
from astrai.rollout.sampling_strategies import FrequencyPenaltyStrategy

__all__ = ["Job", "Sample", "Batcher"]

logger = logging.getLogger(__name__)


@dataclass
class Sample:
    """One generated choice: `token_ids` as sampled (the stop token included when one ended it)."""

    token_ids: list[int]
    finished: bool


@dataclass
class Job:
    """One prompt of a request, generated `n` times.

    Attributes:
        prompt_ids: the prompt's token ids (non-empty, in the vocabulary; validated by the caller).
        params: engine sampling settings (max_new_tokens, temperature, top_p/top_k, stop token ids).
        n: choices (rows) for this prompt.
        penalty: optional frequency penalty.
        seed: when set, the job runs alone with a generator seeded by it (reproducible output).
        on_token: optional `(choice, token id) -> None`, called on the event loop for every sampled token.
        future: resolves to the job's n `Sample`s (set by the batcher).
    """

    prompt_ids: list[int]
    params: SamplingParams
    n: int = 1
    penalty: Optional[FrequencyPenaltyStrategy] = None
    seed: Optional[int] = None
    on_token: Optional[Callable[[int, int], None]] = None
    future: Optional[asyncio.Future] = field(default=None, repr=False)


class Batcher:
    """Collects `Job`s and runs them through `engine.generate` in batches of at most `max_batch` rows.

    Args:
        engine: a `GenerationEngine` (`astrai.rollout.engine`; its `generate` with the `on_token` hook).
        max_batch: most rows per engine call (set the engine's `max_num_seqs` to at least this).
        window_s: how long to wait for more jobs after the first one arrives (seconds).

    `stats` counts `requests` (jobs), `engine_calls` and `rows` since start.
    """

    def __init__(self, engine, *, max_batch: int, window_s: float = 0.005):
        if max_batch < 1:
            raise ValueError(f"max_batch: expected a positive integer, got {max_batch}")
        self.engine, self.max_batch, self.window_s = engine, max_batch, window_s
        self.stats = {"requests": 0, "engine_calls": 0, "rows": 0}
        self._queue: Optional[asyncio.Queue] = None
        self._held: Optional[Job] = None
        self._task: Optional[asyncio.Task] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._rng = random.Random()

    async def start(self) -> None:
        """Start the batching task on the running event loop."""
        self._loop = asyncio.get_running_loop()
        self._queue = asyncio.Queue()
        self._task = asyncio.create_task(self._run(), name="astrai-batcher")

    async def stop(self) -> None:
        """Cancel the batching task (jobs still queued get a cancelled future)."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    def submit(self, job: Job) -> asyncio.Future:
        """Queue `job` and return its future (a list of `job.n` Samples, or the engine's exception)."""
        if self._queue is None:
            raise RuntimeError("Batcher.submit before start()")
        if job.n > self.max_batch:
            raise ValueError(f"n: at most {self.max_batch} choices per prompt (the server's --max_batch)")
        job.future = self._loop.create_future()
        self.stats["requests"] += 1
        self._queue.put_nowait(job)
        return job.future

    async def _next(self, timeout: Optional[float]) -> Job:
        if self._held is not None:
            job, self._held = self._held, None
            return job
        if timeout is None:
            return await self._queue.get()
        return await asyncio.wait_for(self._queue.get(), timeout)

    async def _collect(self) -> list[Job]:
        """The first job plus every job arriving within the window, up to `max_batch` rows."""
        batch = [await self._next(None)]
        rows = batch[0].n
        deadline = self._loop.time() + self.window_s
        while rows < self.max_batch:
            try:
                job = await self._next(max(0.0, deadline - self._loop.time()))
            except asyncio.TimeoutError:
                break
            if rows + job.n > self.max_batch:
                self._held = job
                break
            batch.append(job)
            rows += job.n
        return [job for job in batch if not job.future.done()]  # drop jobs whose client went away

    async def _run(self) -> None:
        while True:
            batch = await self._collect()
            if batch:
                await asyncio.to_thread(self._serve, batch)

    # ------------------------------------------------------------------------------------ worker thread
    def _serve(self, batch: list[Job]) -> None:
        """Unseeded jobs in one engine call, each seeded job in its own; results go back to the loop."""
        plain = [job for job in batch if job.seed is None]
        calls = ([plain] if plain else []) + [[job] for job in batch if job.seed is not None]
        for jobs in calls:
            try:
                self._generate(jobs)
            except Exception as err:  # noqa: BLE001 - handed to the requests, which answer with an error
                if len(jobs) == 1:
                    self._resolve(jobs[0], err)
                    continue
                logger.warning("batched generate failed (%s); retrying its %d requests one by one", err, len(jobs))
                for job in jobs:
                    try:
                        self._generate([job])
                    except Exception as one:  # noqa: BLE001
                        self._resolve(job, one)

    def _generate(self, jobs: list[Job]) -> None:
        owners = [(job, c) for job in jobs for c in range(job.n)]
        seed = jobs[0].seed if len(jobs) == 1 and jobs[0].seed is not None else self._rng.getrandbits(63)
        streaming = any(job.on_token is not None for job in jobs)

        def on_token(row: int, token: int) -> None:
            job, choice = owners[row]
            if job.on_token is not None:
                self._loop.call_soon_threadsafe(job.on_token, choice, token)

        out = self.engine.generate([job.prompt_ids for job, _ in owners], [job.params for job, _ in owners],
                                   torch.Generator().manual_seed(seed), n=1,
                                   penalties=[job.penalty for job, _ in owners],
                                   on_token=on_token if streaming else None)
        self.stats["engine_calls"] += 1
        self.stats["rows"] += len(owners)
        lengths = out.action_mask.sum(-1).tolist()
        ids, finished = out.response_ids.tolist(), out.finished.tolist()
        samples: dict[int, list[Sample]] = {id(job): [] for job in jobs}
        for row, (job, _) in enumerate(owners):
            samples[id(job)].append(Sample(ids[row][:lengths[row]], bool(finished[row])))
        for job in jobs:
            self._resolve(job, samples[id(job)])

    def _resolve(self, job: Job, outcome) -> None:
        """Set the job's future (a result list or an exception) on the event loop thread."""

        def settle() -> None:
            if job.future.done():
                return
            if isinstance(outcome, BaseException):
                job.future.set_exception(outcome)
            else:
                job.future.set_result(outcome)

        self._loop.call_soon_threadsafe(settle)
