"""The server's engine loop: one worker thread steps the engine; requests join and leave between decode steps.

Iteration-level scheduling (Orca, Yu et al. 2022; vLLM's engine loop): the event loop hands each `Job` to the
worker through a thread-safe inbox; before every engine step the worker adds the new jobs
(`engine.add_request`, prefilled in that step alongside the running decodes) and applies aborts (`engine.abort`,
whose KV blocks are free before the step runs), then calls `engine.step()` once and sends each request the tokens
it got, in one `call_soon_threadsafe` per step. The engine is synchronous and the worker is its only caller, so the
event loop never blocks on it and keeps accepting requests, which join the batch at the next step. A short
request therefore waits for at most the step in flight, not for a long request to end.

A failing `add_request` (bad input the routes did not catch) fails that job alone; a failing `step()` aborts and
fails every live job (the engine's state for them is no longer trusted) and the loop goes on serving new ones.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
from dataclasses import dataclass, field
from typing import Optional

from astrai.rollout.sampling import SamplingParams
from astrai.rollout.row_sampling import FrequencyPenalty

__all__ = ["EngineLoop", "Job"]

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Job:
    """One prompt of an HTTP request, sampled `n` times.

    Attributes:
        prompt_ids: the prompt's token ids (validated by the routes).
        params: engine sampling settings; penalty: optional frequency penalty.
        n: choices; seed: base seed of the choices' generators (None: one from the server's RNG).
        top_logprobs: k most likely tokens to report per sampled token (0: none).
        queue: where the worker puts `(tag, [StepOutput, ...])` per step, or `(tag, exception)` (set by submit).
        tag: an index the caller chose (e.g. the prompt's position in its request).
    """

    prompt_ids: list[int]
    params: SamplingParams
    n: int = 1
    penalty: Optional[FrequencyPenalty] = None
    seed: Optional[int] = None
    top_logprobs: int = 0
    queue: Optional[asyncio.Queue] = field(default=None, repr=False)
    tag: int = 0
    request_id: Optional[int] = field(default=None, repr=False)  # the engine's, once added
    cancelled: bool = field(default=False, repr=False)
    open: set = field(default_factory=set, repr=False)  # choices not done yet (the worker's view)


class EngineLoop:
    """Steps a streaming engine (`astrai.rollout.engine.StreamingEngine`) from one worker thread.

    Args:
        engine: has `add_request`, `step`, `abort`, `has_unfinished_requests`, `stream_stats`.

    `stats` holds `requests` (jobs submitted), `aborted` (jobs cancelled before their end), `steps` (engine steps)
    and the engine's latest `stream_stats()` (running, waiting, kv_blocks, kv_blocks_free, kv_blocks_cached),
    refreshed by the worker after every step and every abort.
    """

    def __init__(self, engine):
        self.engine = engine
        self.stats: dict[str, int] = {"requests": 0, "aborted": 0, "steps": 0, **engine.stream_stats()}
        self._inbox: list[Job] = []
        self._aborts: list[tuple[Job, Optional[int]]] = []
        self._live: dict[int, Job] = {}
        self._wake = threading.Condition()
        self._stopping = False
        self._thread: Optional[threading.Thread] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._rng = random.Random()

    async def start(self) -> None:
        """Start the worker thread (results go back to the running event loop)."""
        self._loop = asyncio.get_running_loop()
        self._stopping = False
        self._thread = threading.Thread(target=self._work, name="astrai-engine-loop", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Stop the worker after its current step; live jobs are aborted."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None

    def submit(self, job: Job, queue: asyncio.Queue, tag: int = 0) -> Job:
        """Queue `job` for the next step; its outputs go to `queue` as `(tag, outputs or exception)`."""
        if self._thread is None:
            raise RuntimeError("EngineLoop.submit before start()")
        job.queue, job.tag, job.open = queue, tag, set(range(job.n))
        if job.seed is None:
            job.seed = self._rng.getrandbits(63)
        self.stats["requests"] += 1
        with self._wake:
            self._inbox.append(job)
            self._wake.notify()
        return job

    def abort(self, job: Job, choice: Optional[int] = None) -> None:
        """Cancel `job` (or one choice of it) before the next step; a finished job is left alone. Thread-safe,
        idempotent."""
        if job.cancelled or not job.open:
            return
        if choice is None:
            job.cancelled = True
        with self._wake:
            self._aborts.append((job, choice))
            self._wake.notify()

    # ------------------------------------------------------------------------------------------ worker thread
    def _work(self) -> None:
        engine = self.engine
        while True:
            with self._wake:
                while not (self._inbox or self._aborts or self._stopping or engine.has_unfinished_requests):
                    self._wake.wait()
                if self._stopping:
                    break
                inbox, self._inbox = self._inbox, []
                aborts, self._aborts = self._aborts, []
            for job in inbox:
                self._add(job)
            for job, choice in aborts:
                self._abort(job, choice)
            if engine.has_unfinished_requests:
                self._step()
            self.stats.update(engine.stream_stats())
        for job in list(self._live.values()):
            self._abort(job, None)

    def _add(self, job: Job) -> None:
        if job.cancelled:  # its client went away before it reached the engine
            self.stats["aborted"] += 1
            return
        try:
            job.request_id = self.engine.add_request(job.prompt_ids, job.params, n=job.n, penalty=job.penalty,
                                                     seed=job.seed, top_logprobs=job.top_logprobs)
        except Exception as err:  # noqa: BLE001 - answered to this job's client
            self._send([(job, err)])
            return
        self._live[job.request_id] = job

    def _abort(self, job: Job, choice: Optional[int]) -> None:
        if job.request_id is None or job.request_id not in self._live:
            return
        self.engine.abort(job.request_id, choice)
        if choice is None:
            job.open.clear()
            self.stats["aborted"] += 1
        else:
            job.open.discard(choice)
        if not job.open:
            del self._live[job.request_id]

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as err:  # noqa: BLE001 - every live request gets the error; the loop goes on
            logger.error("engine step failed: %s; aborting %d live request(s)", err, len(self._live))
            failed = list(self._live.values())
            for job in failed:
                self._abort(job, None)
            self._send([(job, err) for job in failed])
            return
        self.stats["steps"] += 1
        by_job: dict[int, list] = {}
        for out in outputs:
            by_job.setdefault(out.request_id, []).append(out)
        batch = []
        for request_id, outs in by_job.items():
            job = self._live.get(request_id)
            if job is None:
                continue
            job.open.difference_update(o.choice for o in outs if o.done)
            if not job.open:
                del self._live[request_id]
            batch.append((job, outs))
        if batch:
            self._send(batch)

    def _send(self, batch: list) -> None:
        """Deliver (job, outputs or exception) pairs on the event loop thread, in one call."""

        def deliver() -> None:
            for job, item in batch:
                job.queue.put_nowait((job.tag, item))

        self._loop.call_soon_threadsafe(deliver)
