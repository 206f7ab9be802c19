"""A rollout engine in its own process (`rollout.placement: separate`): the generation process.

`RemoteEngine` is a `GenerationEngine` whose engine lives in a child process (the generation process) that only
generates, while the process that made it (a training rank) only trains. It is what one-step-off training
(docs/async.md) overlaps: `submit` sends a rollout's prompts and returns at once, `result` waits for it, and the
training rank trains on the previous rollout meanwhile.

Two channels join the processes:

- a `multiprocessing` pipe carries messages in order (load, generate, sleep, wake, close), each answered in order;
- a two-process gloo group of its own (a `ProcessGroupGloo` over a `TCPStore` on 127.0.0.1, apart from the job's
  process group) carries the weights: after each update the training rank streams every parameter, one
  `torch.distributed` broadcast each (its bytes, staged on the CPU), and the generation process copies it into its
  engine as it arrives (`GenerationEngine.load_weights` over a stream: no second full copy). The version is
  acknowledged as with a colocated engine (`astrai.rollout.engine.sync_weights`).

The generation process builds its engine from the model's class and config (random weights, tagged -1 so that the
first sync loads the policy's) and the engine factory the caller gives (`rollout.engine` and its options, picklable).
A generation is exact: the caller's sampling RNG state goes with the request and comes back advanced, so a rollout
generated in the generation process equals the colocated engine's on the same weights, RNG and threads.

`GenerationPool` puts several generation processes behind one engine (`rollout.generation_processes`): each call's
prompts split in contiguous shares generated at once, every weight load streamed to all of them concurrently.

Failures: an error of the engine is raised in the training rank in one line: bad input (prompts or settings it
refuses, a backend the machine lacks) as ValueError, non-finite logits as FloatingPointError, anything else as
`RemoteEngineError` with the generation process's traceback printed once; a generation process that dies is a
`GenerationProcessDied` (a `RemoteEngineError`) naming its exit code: `RemoteEngine.restart` starts another in its
place (`astrai.experience.sources.OnlineExperience`, `rollout.generation_restarts`), else the trainer stops in one
line (`trainer.faults.GenerationProcessFault`);
a training rank that dies ends the generation process (its pipe closes, once the
generation process is idle); signals meant for the job (SIGINT, SIGTERM) leave it running until the training rank,
which stops gracefully, closes it.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import multiprocessing
import os
import signal
import sys
import time
import traceback
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as c10d

from astrai.rollout.engine import EngineCapacity
from astrai.rollout.generation import Generation, concat_generations
from astrai.rollout.sampling import SamplingParams

__all__ = ["GenerationPool", "GenerationProcessDied", "RemoteEngine", "RemoteEngineError"]

_POLL_SECONDS = 0.2
"""How often a wait for the generation process checks that it is still alive."""


class RemoteEngineError(RuntimeError):
    """The generation process died, or failed in a way that is not the caller's input (one line)."""


class GenerationProcessDied(RemoteEngineError):
    """The generation process is gone (killed, crashed, out of memory): `RemoteEngine.restart` can start another.

    Attributes:
        exit_code: its exit code (None when it had none yet)."""

    def __init__(self, message: str, exit_code: Optional[int] = None):
        super().__init__(message)
        self.exit_code = exit_code


@dataclass
class _Pending:
    """A message sent and not yet answered: its sequence number, what it was (for error lines) and, for a
    generation, the caller's RNG that the answer advances."""

    seq: int
    what: str
    generator: Optional[torch.Generator] = None


class RemoteEngine:
    """A `GenerationEngine` proxy whose engine runs in a generation process (module docstring).

    Args:
        model_class: the policy's class (`astrai.models.llama.AutoRegressiveLM`), built as `model_class(config)`.
        model_config: its config (picklable).
        build: `build(model) -> GenerationEngine`, picklable (a `functools.partial` of a module-level function):
            makes the engine over the random-weight model in the generation process.
        device: the generation process's device ("cpu", "cuda:1" ...).
        threads: torch intra-op threads of the generation process (None: torch's default).
        timeout_seconds: the weight group's timeout for one broadcast, and for the process to start.
        deterministic: `torch.use_deterministic_algorithms(True)` in the generation process (`runtime.deterministic`).
        name: what its error lines call it ("generation process 2 of 3" in a `GenerationPool`).

    Attributes:
        policy_version: the version of the weights the generation process acknowledged; -1 until the first load.
        restarts: how many times `restart` started a new generation process.
        pad_token_id: the engine's padding id.
        last_seconds: how long the last generation collected with `result` took in the generation process.
        asleep: whether the engine has been asked to sleep (and not to wake since), as `PagedGenerationEngine.asleep`.

    Raises:
        ValueError: the engine's settings refused in the generation process (one line, as a colocated engine's).
        RemoteEngineError: the generation process could not start or build its engine otherwise (one line).
    """

    def __init__(self, model_class: type, model_config: Any, build: Callable[[torch.nn.Module], Any], *,
                 device: Union[str, torch.device] = "cpu", threads: Optional[int] = None,
                 timeout_seconds: float = 600.0, deterministic: bool = False,
                 name: str = "the generation process"):
        self._args = (model_class, model_config, build, str(device), threads, timeout_seconds, deterministic)
        self.name = name
        self.restarts = 0
        self._seq = 0  # message numbers, never reused (not across a restart either: a lost request stays unknown)
        self._start()

    def restart(self) -> None:
        """Start a new generation process in place of one that died (`GenerationProcessDied`): the old one is
        reaped, the requests it had in flight are forgotten (their `result` raises; their generators were not
        advanced), and the new engine holds no weights (`policy_version` -1: the next sync loads them).

        Raises:
            RemoteEngineError, ValueError: the new process could not start or build its engine (as at creation).
        """
        self._finalizer()
        self._abort_weight_group()
        self.restarts += 1
        self._start()

    def _start(self) -> None:
        """Start the generation process, join the weight group with it and wait for its engine."""
        model_class, model_config, build, device, threads, timeout_seconds, deterministic = self._args
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        store = c10d.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout_seconds))
        self.process = context.Process(
            target=_serve, name="astrai-generation", daemon=True,
            args=(child_conn, store.port, model_class, model_config, build, device, threads, timeout_seconds,
                  deterministic))
        self.process.start()
        child_conn.close()
        self._pending: deque[_Pending] = deque()
        # generations answered before their `result` was asked for: their payload and the caller's generator
        self._done: dict[int, tuple[dict, Optional[torch.Generator]]] = {}
        self._finalizer = weakref.finalize(self, _stop, self.process, self._conn)
        atexit.register(self._finalizer)  # before multiprocessing's own exit handler, which would wait on it
        self._expect("its start-up", timeout_seconds)  # it joins the weight group next
        self._group = c10d.ProcessGroupGloo(store, 0, 2, datetime.timedelta(seconds=timeout_seconds))
        self._store = store
        ready = self._expect("the build of its engine")
        self._device = torch.device(ready["device"])
        self._capacity: EngineCapacity = ready["capacity"]
        self.pad_token_id: int = ready["pad_token_id"]
        self.policy_version = -1
        self.last_seconds = 0.0
        self.asleep = False  # as the generation process's engine will be once it has read what was sent

    # ------------------------------------------------------------------ GenerationEngine
    @property
    def device(self) -> torch.device:
        """The generation process's device (where its outputs came from; they arrive on the CPU of this process
        when it is a CPU)."""
        return self._device

    @property
    def capacity(self) -> EngineCapacity:
        """The generation process's engine capacity."""
        return self._capacity

    def generate(self, prompts: Sequence[Sequence[int]], params: Union[SamplingParams, Sequence[SamplingParams]],
                 generator: Optional[torch.Generator] = None, *, n: int = 1, penalties: Any = None,
                 on_token: Optional[Callable[[int, int], None]] = None) -> Generation:
        """`result(submit(...))`: as `GenerationEngine.generate`, in the generation process.

        Raises:
            ValueError: `on_token` (tokens are not streamed across processes), or the engine's refusal of the
                prompts or settings. FloatingPointError: non-finite logits. RemoteEngineError: as `result`.
        """
        if on_token is not None:
            raise ValueError("generate: on_token is not supported by an engine in another process "
                             "(rollout.placement separate)")
        return self.result(self.submit(prompts, params, generator, n=n, penalties=penalties))

    def submit(self, prompts: Sequence[Sequence[int]], params: Union[SamplingParams, Sequence[SamplingParams]],
               generator: Optional[torch.Generator] = None, *, n: int = 1, penalties: Any = None) -> int:
        """Send one `generate` call to the generation process and return at once; the returned id is for
        `result`. The state of `generator` goes with it; `result` advances `generator` to the state the generation
        left (exactly as a colocated `generate` would). Do not draw from `generator` until then."""
        state = None if generator is None else generator.get_state()
        return self._post(("generate", [list(map(int, p)) for p in prompts], params, state, n, penalties),
                          "a generation", generator)

    def result(self, request: int) -> Generation:
        """Wait for the generation `request` (`submit`); its `Generation` (tensors on this process's CPU when the
        generation process computes on a CPU; `policy_version` the weights that sampled it).

        Raises:
            ValueError, FloatingPointError: the engine's, as `generate` raises them.
            RemoteEngineError: the generation process died or failed otherwise.
        """
        generator = next((p.generator for p in self._pending if p.seq == request), None)
        if request in self._done:  # answered already (a weight load or a later request waited for it)
            out, generator = self._done.pop(request)
        elif not any(p.seq == request for p in self._pending):
            raise RemoteEngineError(f"result: no generation {request} in flight (collected already, or failed)")
        else:
            out = self._expect("a generation", until=request)
        if generator is not None:
            generator.set_state(out["generator_state"])
        self.last_seconds = float(out["seconds"])
        return out["generation"]

    def discard(self, request: int) -> None:
        """Wait for `request` (`submit`) and drop its result, leaving its generator where it was (a generation
        sent ahead that is no longer wanted: its state was put back)."""
        for pending in self._pending:
            if pending.seq == request:
                pending.generator = None
        if self._done.pop(request, None) is None:
            self._expect("a generation", until=request)

    def load_weights(self, state_dict: Union[Mapping[str, torch.Tensor], Iterable], policy_version: int) -> int:
        """Stream `state_dict` (a mapping, or (name, tensor) pairs one at a time: a trained model's
        `full_weights`) to the generation process, one broadcast per tensor over the weight group, and return the
        version it acknowledges. A generation still in flight is waited for first (the generation process would
        take no broadcast before it ends) and kept for its `result`: it was sampled by the weights it was sent
        with, as it would have been colocated (an in-training evaluation during one-step-off training syncs the
        engine while the next rollout is out).

        Raises:
            KeyError / ValueError: the engine refused a tensor (its name or shape; the generation process still
                took every broadcast, and holds no version: -1). RemoteEngineError: as `result`.
        """
        return _stream_weights([self], state_dict, policy_version)[0]

    def _begin_load(self, policy_version: int) -> int:
        """The first message of a weight load (`_stream_weights`): generations in flight are waited for first (the
        generation process takes no broadcast before it ends) and kept for their `result`; the version is -1 until
        the load is acknowledged. Returns the load's sequence number."""
        for pending in [p for p in self._pending if p.what == "a generation"]:
            generator = pending.generator
            self._done[pending.seq] = (self._expect("a generation", until=pending.seq), generator)
        self.policy_version = -1
        return self._post(("load", int(policy_version)), "the weight load")

    def _send_tensor(self, name: str, data: torch.Tensor):
        """Announce one tensor of a weight load and start its broadcast (`data`: contiguous, on the CPU); returns
        the broadcast's work (None for an empty tensor), waited for with `_wait`."""
        with self._dying("the weight load"):
            self._conn.send(("tensor", name, tuple(data.shape), str(data.dtype).removeprefix("torch.")))
            if not data.numel():
                return None
            options = c10d.BroadcastOptions()
            options.rootRank = 0
            return self._group.broadcast([data.reshape(-1).view(torch.uint8)], options)

    def _end_load(self) -> None:
        """Say that the weight load's tensors are all sent."""
        with self._dying("the weight load"):
            self._conn.send(("end",))

    @contextlib.contextmanager
    def _dying(self, what: str):
        """Raise `GenerationProcessDied` in place of the pipe's or the weight group's error when the generation
        process is gone (a kill -9 is seen by its sockets, which close before it has an exit code)."""
        try:
            yield
        except (OSError, RuntimeError):
            self.process.join(5)
            if not self.process.is_alive():
                self._abort_weight_group()
                raise self._died(what) from None
            raise

    def _wait(self, work) -> None:
        """Wait for one broadcast, checking that the generation process lives: a peer killed mid-broadcast can
        leave gloo waiting for its whole timeout (a trial saw 600 s), so this raises as soon as it is gone."""
        pause = 1e-4
        while not work.is_completed():
            if not self.process.is_alive():
                self._abort_weight_group()
                raise self._died("the weight load")
            time.sleep(pause)
            pause = min(2 * pause, 0.01)
        work.wait()  # raises the broadcast's own error, if any

    def _abort_weight_group(self) -> None:
        """Abort the weight group after its peer died: a broadcast left pending would otherwise hang this process
        when the group is destroyed (seen at the job's end, after its one-line error)."""
        try:
            self._group.abort()
        except Exception:  # noqa: BLE001 - best effort: the job is ending with the death's line
            pass

    def sleep(self) -> None:
        """Ask the generation process's engine to release its KV memory (answered in order; errors surface at the
        next wait)."""
        self._post(("sleep",), "sleep")
        self.asleep = True

    def wake(self) -> None:
        """Ask the generation process's engine to take its KV memory back."""
        self._post(("wake",), "wake")
        self.asleep = False

    def close(self) -> None:
        """End the generation process (it finishes what it is doing first; killed after 10 s). Idempotent."""
        self._finalizer()

    # ------------------------------------------------------------------ messages
    def _post(self, message: tuple, what: str, generator: Optional[torch.Generator] = None) -> int:
        """Send `message` with the next sequence number; its answer is awaited later (`_expect`)."""
        if not self._finalizer.alive:
            raise RemoteEngineError("the generation process was closed")
        self._seq += 1
        try:
            self._conn.send((self._seq, *message))
        except OSError:
            raise self._died(what) from None
        self._pending.append(_Pending(self._seq, what, generator))
        return self._seq

    def _expect(self, what: str, timeout: Optional[float] = None, *, until: Optional[int] = None) -> dict:
        """Read answers in order until the one of sequence number `until` (or, with None, the next unsolicited
        one: the start-up's), raising the first error among them; returns its payload."""
        while True:
            answer = self._receive(what, timeout)
            seq, ok, payload = answer
            pending = self._pending.popleft() if seq else None
            if pending is not None and pending.seq != seq:
                raise RemoteEngineError(f"the generation process answered message {seq}, expected {pending.seq}")
            if not ok:
                raise _rebuild(payload, pending.what if pending is not None else what)
            if until is None or seq == until:
                return payload
            if pending is not None and pending.what == "a generation":  # an earlier one: kept for its `result`
                self._done[seq] = (payload, pending.generator)

    def _receive(self, what: str, timeout: Optional[float]) -> tuple:
        """The next answer; RemoteEngineError when the process dies first (or `timeout` seconds pass)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while not self._conn.poll(_POLL_SECONDS):
                if not self.process.is_alive():
                    raise self._died(what)
                if deadline is not None and time.monotonic() > deadline:
                    raise RemoteEngineError(f"the generation process did not answer within {timeout:g} s "
                                            f"(during {what})")
            return self._conn.recv()
        except (EOFError, OSError):
            raise self._died(what) from None

    def _died(self, what: str) -> GenerationProcessDied:
        """The one line saying the generation process is gone (its exit code, once it has one)."""
        self.process.join(5)
        return GenerationProcessDied(f"{self.name} (pid {self.process.pid}) died with exit code "
                                     f"{self.process.exitcode} during {what}", self.process.exitcode)


def _stream_weights(engines: Sequence[RemoteEngine], state_dict: Union[Mapping[str, torch.Tensor], Iterable],
                    policy_version: int) -> list[int]:
    """Stream `state_dict` to the generation process of each of `engines` at once: every tensor is staged on the
    CPU once, announced to each and broadcast over each one's weight group concurrently (gloo's work runs in the
    background: the copies overlap), then the versions they acknowledge, in order. A failure mid-stream (a
    generation process that died, the stream's own error) is raised once the survivors were told the stream ended
    (they then hold no version: -1). Raises as `RemoteEngine.load_weights`; with several engines, the first
    refusal once every engine has answered."""
    seqs = [engine._begin_load(policy_version) for engine in engines]
    items = state_dict.items() if isinstance(state_dict, Mapping) else state_dict
    try:
        for name, tensor in items:
            data = tensor.detach().to("cpu").contiguous()
            works = [engine._send_tensor(name, data) for engine in engines]
            for engine, work in zip(engines, works):
                if work is not None:
                    with engine._dying("the weight load"):
                        engine._wait(work)
        for engine in engines:
            engine._end_load()
    except BaseException:
        for engine, seq in zip(engines, seqs):  # the survivors: end their stream and read their answer
            if engine.process.is_alive():
                try:
                    engine._end_load()
                    engine._expect("the weight load", until=seq)
                except Exception:  # noqa: BLE001 - the first failure is the one raised
                    pass
        raise
    acknowledged, error = [], None
    for engine, seq in zip(engines, seqs):
        try:
            engine.policy_version = int(engine._expect("the weight load", until=seq)["policy_version"])
        except Exception as err:  # noqa: BLE001 - raised once every engine has answered
            error = error or err
        acknowledged.append(engine.policy_version)
    if error is not None:
        raise error
    return acknowledged


def _shares(count: int, parts: int) -> list[tuple[int, int]]:
    """`count` rows in `parts` contiguous (start, stop) shares, sizes differing by at most one, the larger first;
    empty shares left out."""
    size, extra = divmod(count, parts)
    bounds = [0]
    for part in range(parts):
        bounds.append(bounds[-1] + size + (part < extra))
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


class GenerationPool:
    """Several generation processes behind one engine (`rollout.generation_processes` > 1): each `generate` call's
    prompts are split in contiguous shares, one per process (`_shares`), generated at once, and joined in order
    (`astrai.rollout.generation.concat_generations`); every weight load streams to all of them concurrently
    (`_stream_weights`). It answers `RemoteEngine`'s methods, so the trainer, the one-step-off source and the
    in-training evaluation use it unchanged.

    Sampling: share i is sampled with its own generator seeded by the i-th of `len(engines)` int64 seeds drawn from
    the caller's generator at `submit` (which is then where the draw left it: `result` does not move it). A run is
    therefore reproducible for a fixed seed and number of processes, but its samples differ from one process's
    (other random streams), as a different data-parallel layout's would.

    Args:
        engines: the generation processes (`RemoteEngine`s with the same model and engine settings); the pool owns
            them (`close` ends them all).

    Attributes:
        engines: as given. restarts: how many times `restart` ran. last_seconds: the slowest share of the last
        generation collected with `result` (they run at once). asleep: as `RemoteEngine.asleep`.
    """

    def __init__(self, engines: Sequence[RemoteEngine]):
        if not engines:
            raise ValueError("GenerationPool: expected at least one generation process")
        self.engines = list(engines)
        self.restarts = 0
        self.last_seconds = 0.0
        self._seq = 0
        self._requests: dict[int, list[tuple[int, int]]] = {}  # pool request -> [(engine index, its request)]

    @property
    def policy_version(self) -> int:
        """The version every generation process acknowledged; -1 when one holds another (or none)."""
        versions = {engine.policy_version for engine in self.engines}
        return versions.pop() if len(versions) == 1 else -1

    @property
    def device(self) -> torch.device:
        """The first generation process's device (`RemoteEngine.device`)."""
        return self.engines[0].device

    @property
    def capacity(self) -> EngineCapacity:
        """One generation process's engine capacity (each holds the whole model and its own KV memory)."""
        return self.engines[0].capacity

    @property
    def pad_token_id(self) -> int:
        """The engines' padding id."""
        return self.engines[0].pad_token_id

    @property
    def asleep(self) -> bool:
        """Whether the engines have been asked to sleep (and not to wake since)."""
        return self.engines[0].asleep

    @property
    def processes(self) -> list:
        """The generation processes (`multiprocessing.Process`), in share order."""
        return [engine.process for engine in self.engines]

    def generate(self, prompts: Sequence[Sequence[int]], params: Union[SamplingParams, Sequence[SamplingParams]],
                 generator: Optional[torch.Generator] = None, *, n: int = 1, penalties: Any = None,
                 on_token: Optional[Callable[[int, int], None]] = None) -> Generation:
        """`result(submit(...))`; raises as `RemoteEngine.generate`."""
        if on_token is not None:
            raise ValueError("generate: on_token is not supported by an engine in another process "
                             "(rollout.placement separate)")
        return self.result(self.submit(prompts, params, generator, n=n, penalties=penalties))

    def submit(self, prompts: Sequence[Sequence[int]], params: Union[SamplingParams, Sequence[SamplingParams]],
               generator: Optional[torch.Generator] = None, *, n: int = 1, penalties: Any = None) -> int:
        """Send each generation process its share of `prompts` (and of `params` / `penalties` when given per
        prompt) and return at once; the id is for `result`. `generator` advances here by the shares' seeds."""
        seeds = [None] * len(self.engines)
        if generator is not None:
            seeds = torch.randint(0, 2 ** 63 - 1, (len(self.engines),), generator=generator,
                                  device=generator.device).tolist()
        per_prompt = lambda value, a, b: value[a:b] if isinstance(value, (list, tuple)) else value  # noqa: E731
        sent = []
        try:
            for index, (a, b) in enumerate(_shares(len(prompts), len(self.engines))):
                share_generator = (None if generator is None else
                                   torch.Generator(device=generator.device).manual_seed(seeds[index]))
                sent.append((index, self.engines[index].submit(
                    prompts[a:b], per_prompt(params, a, b), share_generator, n=n,
                    penalties=per_prompt(penalties, a, b))))
        except BaseException:
            self._drop(sent)
            raise
        self._seq += 1
        self._requests[self._seq] = sent
        return self._seq

    def result(self, request: int) -> Generation:
        """Wait for every share of `request` (`submit`) and join them in prompt order. Raises as
        `RemoteEngine.result` (the first share's failure, the other shares dropped)."""
        sent = self._requests.pop(request, None)
        if sent is None:
            raise RemoteEngineError(f"result: no generation {request} in flight (collected already, or failed)")
        parts = []
        try:
            for index, share in sent:
                parts.append(self.engines[index].result(share))
        except BaseException:
            self._drop(sent[len(parts) + 1:])
            raise
        self.last_seconds = max(self.engines[index].last_seconds for index, _ in sent)
        return concat_generations(parts, self.pad_token_id)

    def discard(self, request: int) -> None:
        """Wait for every share of `request` and drop them (`RemoteEngine.discard`)."""
        self._drop(self._requests.pop(request, []))

    def _drop(self, sent: Sequence[tuple[int, int]]) -> None:
        """Discard these shares where their generation process lives (a dead one's are gone with it)."""
        for index, share in sent:
            engine = self.engines[index]
            if engine.process.is_alive():
                try:
                    engine.discard(share)
                except RemoteEngineError:
                    pass  # it died meanwhile: `restart` replaces it

    def load_weights(self, state_dict: Union[Mapping[str, torch.Tensor], Iterable], policy_version: int) -> int:
        """Stream `state_dict` to every generation process at once (`_stream_weights`); the version they all
        acknowledge (-1 when they differ). Raises as `RemoteEngine.load_weights`."""
        _stream_weights(self.engines, state_dict, policy_version)
        return self.policy_version

    def sleep(self) -> None:
        """Ask every engine to release its KV memory (the first death raised after all were asked)."""
        self._each("sleep")

    def wake(self) -> None:
        """Ask every engine to take its KV memory back (the first death raised after all were asked)."""
        self._each("wake")

    def _each(self, method: str) -> None:
        error = None
        for engine in self.engines:
            try:
                getattr(engine, method)()
            except RemoteEngineError as err:
                error = error or err
        if error is not None:
            raise error

    def restart(self) -> None:
        """Start a new generation process in place of each that died (`RemoteEngine.restart`); the pool's requests
        in flight are forgotten (the survivors' shares waited for and dropped; their `result` raises), and the
        next weight sync loads every process again."""
        for sent in self._requests.values():
            self._drop(sent)
        self._requests.clear()
        for engine in self.engines:
            if not engine.process.is_alive():
                engine.restart()
            engine.policy_version = -1  # the next sync streams to all: one load, every process on one version
        self.restarts += 1

    def close(self) -> None:
        """End every generation process (`RemoteEngine.close`). Idempotent."""
        for engine in self.engines:
            engine.close()


def _rebuild(payload: dict, what: str) -> Exception:
    """The generation process's error as raised here: FloatingPointError (the sampler's non-finite logits) and
    KeyError keep their type, bad input (a ValueError, or a setting the machine cannot honour, e.g. an attention
    backend it lacks: `_answer`) is a ValueError of the same line (exit code 2 from the CLI, as colocated);
    anything else is a RemoteEngineError with the generation process's traceback printed once."""
    kind, message = payload["type"], payload["message"]
    if kind in ("FloatingPointError", "KeyError"):
        return {"FloatingPointError": FloatingPointError, "KeyError": KeyError}[kind](message)
    if payload.get("bad_input"):
        return ValueError(message)
    print(f"the generation process failed during {what}:\n{payload['traceback']}", file=sys.stderr, flush=True)
    return RemoteEngineError(f"the generation process failed during {what}: {kind}: {message}")


def _stop(process, conn) -> None:
    """Ask the generation process to end, then make sure it has (the finalizer of `RemoteEngine`)."""
    try:
        conn.send((0, "close"))
    except (OSError, ValueError):
        pass
    process.join(10)
    if process.is_alive():
        process.kill()
        process.join(5)
    conn.close()


# ---------------------------------------------------------------------- the generation process
def _serve(conn, port: int, model_class: type, model_config: Any, build: Callable, device: str,
           threads: Optional[int], timeout_seconds: float, deterministic: bool) -> None:
    """The generation process: join the weight group, build the engine, then answer messages in order until
    "close" or the pipe closes (the training rank is gone). It ignores SIGINT and SIGTERM: a Ctrl-C or a scheduler's
    SIGTERM reaches every process of the job, and the training rank, stopping gracefully, still needs the batch in
    flight for its last checkpoint; it ends the generation process itself (`RemoteEngine.close`, at exit)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if threads:
        torch.set_num_threads(threads)
    if deterministic:
        torch.use_deterministic_algorithms(True)
    timeout = datetime.timedelta(seconds=timeout_seconds)
    try:
        conn.send((0, True, {}))
        store = c10d.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timeout)
        group = c10d.ProcessGroupGloo(store, 1, 2, timeout)
        with torch.device(device):
            model = model_class(model_config)
        engine = build(model)
        del model
        engine.policy_version = -1  # random weights: the first sync loads the policy's
        conn.send((0, True, {"device": str(engine.device), "capacity": engine.capacity,
                             "pad_token_id": engine.pad_token_id}))
    except BaseException as err:  # noqa: BLE001 - said to the training rank, which raises it
        _answer(conn, 0, err)
        return
    while True:
        try:
            seq, kind, *args = conn.recv()
        except (EOFError, OSError):
            return  # the training rank is gone
        if kind == "close":
            return
        try:
            if kind == "load":
                payload = {"policy_version": _load(conn, group, engine, args[0])}
            elif kind == "generate":
                payload = _generate(engine, *args)
            elif kind == "sleep":
                engine.sleep()
                payload = {}
            elif kind == "wake":
                engine.wake()
                payload = {}
            else:
                raise RuntimeError(f"unknown message {kind!r}")
        except Exception as err:  # noqa: BLE001 - said to the training rank, which raises it
            _answer(conn, seq, err)
            continue
        conn.send((seq, True, payload))


def _answer(conn, seq: int, err: BaseException) -> None:
    """Send `err` as the answer to message `seq`."""
    from astrai.kernels import BackendUnavailableError

    bad_input = isinstance(err, (ValueError, FileNotFoundError, NotADirectoryError, BackendUnavailableError))
    try:
        conn.send((seq, False, {"type": type(err).__name__, "message": str(err).strip("'\""),
                                "traceback": traceback.format_exc(), "bad_input": bad_input}))
    except (OSError, ValueError):
        pass


def _load(conn, group, engine, policy_version: int) -> int:
    """Take the streamed weights (module docstring) into `engine`; every broadcast is taken even when the engine
    refuses a tensor, so the training rank never waits on one. Returns the acknowledged version."""
    options = c10d.BroadcastOptions()
    options.rootRank = 0
    finished = False

    def received():
        nonlocal finished
        while True:
            message = conn.recv()
            if message[0] == "end":
                finished = True
                return
            _, name, shape, dtype = message
            data = torch.empty(shape, dtype=getattr(torch, dtype))
            if data.numel():
                group.broadcast([data.reshape(-1).view(torch.uint8)], options).wait()
            yield name, data

    stream = received()
    try:
        return engine.load_weights(stream, policy_version)
    finally:
        for _ in stream if not finished else ():  # the rest of the broadcasts, after a refusal
            pass


@torch.no_grad()
def _generate(engine, prompts, params, generator_state, n, penalties) -> dict:
    """One `generate` call with the caller's RNG state; the generation (on the CPU) and the state it left."""
    generator = None
    if generator_state is not None:
        generator = torch.Generator(device=engine.device)
        generator.set_state(generator_state)
    start = time.perf_counter()
    out = engine.generate(prompts, params, generator, n=n, penalties=penalties)
    seconds = time.perf_counter() - start
    if out.prompt_ids.device.type != "cpu":
        out = Generation(**{name: (value.cpu() if isinstance(value, torch.Tensor) else value)
                            for name, value in vars(out).items()})
    return {"generation": out, "generator_state": None if generator is None else generator.get_state(),
            "seconds": seconds, "pid": os.getpid()}
