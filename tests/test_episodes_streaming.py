"""Multi-turn episodes on the streaming engine (astrai.experience.episodes, "On a streaming engine"): the same
trajectories as the turn-synchronous path on the tiny model's paged engine (random sampling, seeded per request,
with a deterministic calculator tool), the KV of earlier turns served by the prefix cache (counted per episode),
one episode blocked in a tool while the others decode and finish their turns, and the tool calls (and environment
steps) of different episodes running in parallel on the workers (calls that succeed only when another is inside at
once: a file rendezvous across the worker processes)."""

import time
from typing import Sequence

import pytest
import torch

from astrai.agents.chat import render
from astrai.agents.tool_calls import ToolCall, format_tool_call
from astrai.agents.tools import load_tools
from astrai.experience.episodes import (EpisodeLimits, ToolExecutor, episode_metrics, run_episodes, streams,
                                        turn_seed)
from astrai.models import AutoRegressiveLM, tiny_config, tiny_tokenizer
from astrai.rollout.paged_engine import PagedGenerationEngine
from astrai.rollout.row_sampling import request_seed
from astrai.rollout.sampling import SamplingParams
from astrai.rollout.streaming import StepOutput
from scripted_turns import script_turns
from test_agents_chat import smollm2
from test_environments import (ContextEngine, _environment, _log, counter_policy, env_file,  # noqa: F401
                               guess_policy)
from test_episodes import TOOLS, ScriptedEngine


@pytest.fixture()
def calculator(tmp_path):
    path = tmp_path / "my_tools.py"
    path.write_text(TOOLS)
    return load_tools([{"function": "calculator", "path": str(path)}])


def tiny_episodes(calculator, *, streaming: bool, temperature: float = 1.0, seed: int = 3):
    """Three episodes (two of one prompt, as a group of G = 2) on a fresh paged engine of the tiny model (seed 0,
    float32, CPU): a scripted calculator call on the first turn (`script_turns`: the tiny random model never
    calls a tool), then the model's own samples. Returns the episodes, the engine and the tokenizer."""
    tok = tiny_tokenizer()
    torch.manual_seed(0)
    model = AutoRegressiveLM(tiny_config(max_position_embeddings=1024))
    budget = 160
    call = tok.encode(format_tool_call("calculator", {"expression": "12 * 34"})) + [tok.eos_token_id]
    engine = PagedGenerationEngine(model, pad_token_id=0, backend="torch", block_size=4, max_kv_tokens=8192)
    script_turns(engine, lambda params: call if params.max_new_tokens == budget else None)  # the first turn
    conversations = [[{"role": "user", "content": q}] for q in ("What is 12 * 34?", "What is 12 * 34?", "And 5 * 6?")]
    sampling = SamplingParams(max_new_tokens=budget, temperature=temperature, stop_token_ids=(tok.eos_token_id,))
    executor = ToolExecutor(calculator)
    episodes = run_episodes(engine, tok, conversations, calculator, executor, sampling, EpisodeLimits(max_turns=3),
                            torch.Generator().manual_seed(seed), streaming=streaming)
    return episodes, engine, tok


def trajectory_fields(e):
    """What an episode's trajectory carries but its log-probs (compared to float32 rounding, `same_episodes`)."""
    t = e.trajectory()
    return (t.prompt_ids, t.response_ids, t.loss_mask, t.policy_versions, t.turn_starts, t.metadata, t.messages,
            t.text, dict(e.tool_calls), dict(e.tool_errors))


def same_episodes(streamed, synchronous, logprob_tolerance: float = 0.0) -> None:
    """Assert the episodes carry the same trajectories: every field equal, the behaviour log-probs within
    `logprob_tolerance` (the engine's GEMMs may round a row differently in a batch of another composition, as
    tests/test_paged_engine_streaming.py allows: 1e-6)."""
    assert len(streamed) == len(synchronous)
    for s, y in zip(streamed, synchronous):
        assert trajectory_fields(s) == trajectory_fields(y)
        assert s.logprobs == pytest.approx(y.logprobs, abs=logprob_tolerance, rel=0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_streamed_episodes_equal_the_synchronous_ones_on_the_tiny_model(calculator, temperature):
    streamed, engine, tok = tiny_episodes(calculator, streaming=True, temperature=temperature)
    synchronous, _, _ = tiny_episodes(calculator, streaming=False, temperature=temperature)
    assert streams(engine)
    assert not engine.has_unfinished_requests  # every request ended or aborted
    same_episodes(streamed, synchronous, 1e-6)
    for s in streamed:
        # the tool's result is in the context with loss mask 0, the engine's second turn after it with mask 1
        assert s.completion[1] == {"role": "tool", "name": "calculator", "content": "408"}
        second = s.turn_starts[1]
        called = sum(s.loss_mask[:second])  # the first turn's sampled tokens, then the tool's with loss mask 0
        assert all(s.loss_mask[:called]) and called < second and not any(s.loss_mask[called:second])
        assert all(s.loss_mask[second:]) and len(s.response_ids) > second
    metrics = {k: v for k, v in episode_metrics(streamed).items() if not k.startswith("prefill")}
    assert metrics == episode_metrics(synchronous)
    # a different seed samples something else (the identity above is not a constant output)
    other, _, _ = tiny_episodes(calculator, streaming=True, temperature=temperature, seed=4)
    assert [e.response_ids for e in other] != [e.response_ids for e in streamed]


def test_later_turns_reuse_the_kv_of_earlier_turns_through_the_prefix_cache(calculator):
    episodes, engine, tok = tiny_episodes(calculator, streaming=True)
    block = engine.block_size
    for e in episodes:
        # turn 2's context starts with turn 1's prompt, whose full blocks the cache holds (version-tagged)
        assert e.prefill_tokens == len(e.prompt_ids) + len(e.prompt_ids) + e.turn_starts[1]
        assert len(e.prompt_ids) // block * block <= e.prefill_tokens_reused < e.prefill_tokens
    metrics = episode_metrics(episodes)
    assert metrics["prefill_tokens_reused"] == sum(e.prefill_tokens_reused for e in episodes) / 3
    assert metrics["prefill_reused_fraction"] == pytest.approx(
        sum(e.prefill_tokens_reused for e in episodes) / sum(e.prefill_tokens for e in episodes))
    print(f"prefill tokens per episode {[e.prefill_tokens for e in episodes]}, reused "
          f"{[e.prefill_tokens_reused for e in episodes]} (fraction {metrics['prefill_reused_fraction']:.3f})")


class ScriptedStreamingEngine(ScriptedEngine):
    """`ScriptedEngine` with the streaming API: each `step()` emits the next token of every live request (in the
    order they were added); a request's turn is the next scripted text of the episode whose context it continues.
    Counts its steps and logs (step, "start" / "end", episode key index, turn) events."""

    tp = None

    def __init__(self, tokenizer, scripts, policy_version: int = 7):
        super().__init__(tokenizer, scripts, policy_version)
        self.live: dict[int, list[int]] = {}
        self.keys = list(scripts)
        self.steps = 0
        self.log: list[tuple[int, str, int, int]] = []
        self.on_end = lambda key, turn: None
        self._meta: dict[int, tuple[int, int]] = {}

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self.live)

    def add_request(self, prompt_ids, params, *, n=1, penalty=None, seed=None, top_logprobs=0):
        generation = self.generate([list(prompt_ids)], [params])
        key = next(k for k in self.keys if tuple(prompt_ids[:len(k)]) == k)
        request = len(self._meta)
        self.live[request] = generation.response_ids[0][generation.action_mask[0]].tolist()
        self._meta[request] = (self.keys.index(key), self._turn[key] - 1, bool(generation.finished[0]))
        self.log.append((self.steps, "start", *self._meta[request][:2]))
        return request

    def step(self):
        self.steps += 1
        out = []
        for request in list(self.live):
            ids = self.live[request]
            token = ids.pop(0)
            done = not ids
            episode, turn, finished = self._meta[request]
            out.append(StepOutput(request, 0, token, -0.5, (), done, finished and done))
            if done:
                del self.live[request]
                self.log.append((self.steps, "end", episode, turn))
                self.on_end(episode, turn)
        return out

    def abort(self, request_id, choice=None):
        self.live.pop(request_id, None)

    def stream_stats(self):
        return {"running": len(self.live)}


GATE_TOOL = '''
import threading

GATE = threading.Event()
WAITED = []


def gate(name: str) -> str:
    """Wait until the gate opens.

    Args:
        name: who waits.
    """
    opened = GATE.wait(timeout=20)
    WAITED.append(name)
    return "opened" if opened else "closed"
'''


def test_an_episode_waiting_on_a_tool_does_not_stall_the_others(tmp_path):
    """Episode 0 calls a tool that blocks until episode 1 has finished its second turn (the gate opens then; its
    call ends after episode 1's, whose calculator call runs first in the helper thread):
    on the streaming path episode 1's calculator result comes in, its second turn decodes and episode 2's long
    answer finishes while episode 0 waits, and episode 0's second turn starts after; the turn-synchronous path
    (the same engine, gate open from the start) gives the same trajectories."""
    (tmp_path / "gate_tools.py").write_text(GATE_TOOL)
    (tmp_path / "calc_tools.py").write_text(TOOLS)
    tools = load_tools([{"function": "gate", "path": str(tmp_path / "gate_tools.py")},
                        {"function": "calculator", "path": str(tmp_path / "calc_tools.py")}])
    gate = tools[0].function.__globals__["GATE"]  # the event of the module the tool was loaded from
    tok = smollm2()
    conversations = [[{"role": "user", "content": f"Question {k}"}] for k in range(3)]
    scripts = [["Let me wait for the gate, it takes a while. " + format_tool_call("gate", {"name": "zero"}), "Done."],
               [format_tool_call("calculator", {"expression": "12 * 34"}), "It is 408, " + "and so on, " * 12],
               ["A long answer without tools, " + "word " * 40]]
    keys = [tuple(tok.encode(render(tok, c, tools))) for c in conversations]
    sampling = SamplingParams(max_new_tokens=400, stop_token_ids=(tok.special_tokens["<|im_end|>"],))

    def play(streaming: bool):
        engine = ScriptedStreamingEngine(tok, dict(zip(keys, scripts)))
        gate.clear()
        if streaming:
            engine.on_end = lambda episode, turn: gate.set() if (episode, turn) == (1, 1) else None
        else:
            gate.set()
        executor = ToolExecutor(tools)
        episodes = run_episodes(engine, tok, conversations, tools, executor, sampling, EpisodeLimits(),
                                streaming=streaming)
        return episodes, engine

    streamed, engine = play(True)
    assert streamed[0].completion[1]["content"] == "opened"  # the gate opened while episode 0's call waited
    log = engine.log
    first_end = next(s for s, what, ep, turn in log if (what, ep, turn) == ("end", 0, 0))
    second_start = next(s for s, what, ep, turn in log if (what, ep, turn) == ("start", 0, 1))
    during = [(what, ep, turn) for s, what, ep, turn in log if first_end <= s <= second_start and ep != 0]
    assert ("end", 1, 1) in during and ("end", 2, 0) in during  # the others' turns ended while it waited
    end_1 = next(s for s, what, ep, turn in log if (what, ep, turn) == ("end", 1, 1))
    assert first_end < end_1 <= second_start  # episode 1's second turn ended in episode 0's wait
    assert second_start - first_end >= 40  # engine steps taken while episode 0's tool call was blocked
    assert [e.ended_by for e in streamed] == ["answer", "answer", "answer"]
    synchronous, sync_engine = play(False)
    assert sync_engine.steps == 0  # the synchronous path called generate only
    same_episodes(streamed, synchronous)  # scripted log-probs: exact
    assert {k: v for k, v in episode_metrics(streamed).items() if not k.startswith("prefill")} == \
        episode_metrics(synchronous)


def test_a_streamed_turn_is_seeded_as_generate_seeds_its_row():
    """`add_request(seed=turn_seed(...))` gives its choice the generator `generate` gives row i of the turn's call
    (`request_seed(base, i)`), the base drawn from the rollout's generator once per turn, in order."""
    generator, bases = torch.Generator().manual_seed(5), []
    expected = torch.Generator().manual_seed(5)
    first, second = (int(torch.randint(0, 2**62, (1,), generator=expected)) for _ in range(2))
    for i in (0, 1, 7, 255):
        assert request_seed(turn_seed(bases, 0, i, generator), 0) == request_seed(first, i)
        assert request_seed(turn_seed(bases, 1, i, generator), 0) == request_seed(second, i)
    assert bases == [first, second]


def test_streaming_is_refused_on_an_engine_without_it(calculator):
    tok = smollm2()
    engine = ScriptedEngine(tok, {})
    assert not streams(engine)
    with pytest.raises(ValueError, match="streaming needs an engine with the streaming API"):
        run_episodes(engine, tok, [[{"role": "user", "content": "?"}]], calculator, ToolExecutor(calculator),
                     SamplingParams(max_new_tokens=8, stop_token_ids=(engine.end,)), EpisodeLimits(), streaming=True)
    tp = PagedGenerationEngine(AutoRegressiveLM(tiny_config()), pad_token_id=0, backend="torch")
    assert streams(tp)
    tp.tp = object()  # a tensor-parallel engine: its ranks agree on each batch through generate
    assert not streams(tp)


class StreamedContextEngine(ContextEngine):
    """`ContextEngine` (tests/test_environments.py: each turn is `policy(decoded context)`) with the streaming API:
    a request's turn is decided when it is added and emitted one token per `step()`."""

    tp = None
    policy_version = 3

    def __init__(self, tokenizer, policy):
        super().__init__(tokenizer, policy)
        self.live: dict[int, tuple[list[int], bool]] = {}
        self._next = 0

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self.live)

    def add_request(self, prompt_ids, params, *, n=1, penalty=None, seed=None, top_logprobs=0):
        generation = self.generate([list(prompt_ids)], [params])
        request, self._next = self._next, self._next + 1
        self.live[request] = (generation.response_ids[0][generation.action_mask[0]].tolist(),
                              bool(generation.finished[0]))
        return request

    def step(self):
        out = []
        for request in list(self.live):
            ids, finished = self.live[request]
            token = ids.pop(0)
            out.append(StepOutput(request, 0, token, self.token_logprob, (), not ids, finished and not ids))
            if not ids:
                del self.live[request]
        return out

    @property
    def token_logprob(self) -> float:
        """The log-prob every emitted token carries."""
        return -0.5

    def abort(self, request_id, choice=None):
        self.live.pop(request_id, None)

    def stream_stats(self):
        return {"running": len(self.live)}


@pytest.mark.parametrize("game", ["counter", "guess"])
def test_environment_episodes_stream_as_they_run_synchronously(env_file, game):
    """An environment's methods (Counter: two add calls on each episode's own instance, then an answer) and its
    step (Guess: higher / lower until the secret, or max_turns), in a worker process: the streaming path gives
    the synchronous path's trajectories, environment rewards and endings."""
    tok = smollm2()
    if game == "counter":
        classes, policy, limits = {None: "Counter"}, counter_policy, EpisodeLimits()
        rows = [{"question": f"Count from {s}.", "start": s} for s in (10, 10, 20, 20)]
    else:
        classes, policy, limits = {None: "Guess"}, guess_policy, EpisodeLimits(max_turns=3)
        rows = [{"question": "Play.", "secret": s} for s in (37, 99, 50)]
    played = []
    for streaming in (True, False):
        engine = (StreamedContextEngine if streaming else ContextEngine)(tok, policy)
        environment = _environment(env_file, classes, workers=1)
        sampling = SamplingParams(max_new_tokens=400, stop_token_ids=(engine.end,))
        try:
            played.append(run_episodes(engine, tok, [[{"role": "user", "content": r["question"]}] for r in rows], [],
                                       ToolExecutor([]), sampling, limits, environment=environment,
                                       routes=[None] * len(rows), rows=rows, streaming=streaming))
        finally:
            environment.close()
    streamed, synchronous = played
    same_episodes(streamed, synchronous)
    assert [(e.env_reward, e.ended_by) for e in streamed] == [(e.env_reward, e.ended_by) for e in synchronous]
    assert sum(len(e.turn_starts) for e in streamed) > len(rows)  # several turns each


def test_a_failing_engine_step_aborts_the_live_turns_and_closes_the_instances(env_file):
    """Non-finite logits (FloatingPointError) in a step while the episodes' first turns decode: the error goes on,
    every live request is aborted (the engine can sleep) and every environment instance is closed."""
    tok = smollm2()

    class Failing(StreamedContextEngine):
        steps = 0

        def step(self):
            self.steps += 1
            if self.steps == 12:
                raise FloatingPointError("non-finite logits")
            return super().step()

    engine = Failing(tok, counter_policy)
    environment = _environment(env_file, {None: "Counter"}, workers=1)
    rows = [{"question": f"Count from {s}.", "start": s} for s in (10, 20)]
    try:
        with pytest.raises(FloatingPointError, match="non-finite"):
            run_episodes(engine, tok, [[{"role": "user", "content": r["question"]}] for r in rows], [],
                         ToolExecutor([]), SamplingParams(max_new_tokens=400, stop_token_ids=(engine.end,)),
                         EpisodeLimits(), environment=environment, routes=[None, None], rows=rows)
    finally:
        environment.close()
    assert engine.steps == 12 and not engine.has_unfinished_requests
    assert sorted(event[1] for event in _log(env_file) if event[0] == "close") == [10, 20]


MEETING_TOOLS = '''
import os
import time
from pathlib import Path

ROOM = Path({room!r})


def _meet(name):
    """Arrive in the room and wait (at most 30 s) until another call is there too; alone, fail."""
    (ROOM / f"{{name}}.arrived").write_text(name)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        others = sorted(p.stem for p in ROOM.glob("*.arrived") if p.stem != name)
        if others:
            return ", ".join(others)
        time.sleep(0.01)
    raise TimeoutError(f"{{name}} waited alone")


def meet(name: str) -> str:
    """Meet another caller.

    Args:
        name: who meets.
    """
    return f"{{name}} met {{_meet(name)}}"


def greet(name: str) -> str:
    """Greet another caller.

    Args:
        name: who greets.
    """
    return f"{{name}} greeted {{_meet(name)}}"


def meet_then_die(name: str) -> str:
    """Meet another caller, then kill the process.

    Args:
        name: who meets.
    """
    _meet(name)
    os._exit(3)


def meet_then_hang(name: str) -> str:
    """Meet another caller, then never return.

    Args:
        name: who meets.
    """
    _meet(name)
    time.sleep(600)


def hold(name: str) -> str:
    """Say it holds, then wait (at most 30 s) until released.

    Args:
        name: who holds.
    """
    (ROOM / "holding").write_text(name)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if (ROOM / "release").exists():
            return "released"
        time.sleep(0.01)
    raise TimeoutError("never released")
'''

MEETING_NAMES = ("meet", "greet", "meet_then_die", "meet_then_hang", "hold")


@pytest.fixture()
def meeting(tmp_path):
    """The meeting tools (each waits, across the worker processes, until another call is inside too: a file-based
    rendezvous in tmp_path/room) and their references; returns (tools, references, room)."""
    room = tmp_path / "room"
    room.mkdir()
    path = tmp_path / "meeting_tools.py"
    path.write_text(MEETING_TOOLS.format(room=str(room)))
    tools = load_tools([{"function": name, "path": str(path)} for name in MEETING_NAMES])
    return tools, [(name, str(path)) for name in MEETING_NAMES], room


def play_scripted(tok, tools, references, scripts, *, streaming=True, workers=2, timeout=60.0, before_step=None):
    """One episode per script (a list of turn texts) on `ScriptedStreamingEngine` (or the synchronous path) with the
    tools in `workers` worker processes; `before_step(engine)` runs before each engine step. Returns the episodes
    and the engine."""
    conversations = [[{"role": "user", "content": f"Question {k}"}] for k in range(len(scripts))]
    keys = [tuple(tok.encode(render(tok, c, tools))) for c in conversations]
    engine = ScriptedStreamingEngine(tok, dict(zip(keys, scripts)))
    if before_step is not None:
        step = engine.step
        engine.step = lambda: (before_step(engine), step())[1]
    sampling = SamplingParams(max_new_tokens=400, stop_token_ids=(tok.special_tokens["<|im_end|>"],))
    executor = ToolExecutor(tools, references, num_workers=workers, timeout_seconds=timeout)
    try:
        episodes = run_episodes(engine, tok, conversations, tools, executor, sampling, EpisodeLimits(),
                                streaming=streaming)
    finally:
        executor.close()
    return episodes, engine


def tool_results(e):
    """The contents of an episode's tool messages, in order."""
    return [m["content"] for m in e.completion if m["role"] == "tool"]


def test_tool_calls_of_episodes_whose_turns_end_together_run_in_parallel(meeting):
    """Two episodes' turns end in the same engine step, each with a call that succeeds only when another call is
    inside at once (tool_workers 2): the helper runs both jobs as one batch over the two workers, each episode gets
    its own result, and the trajectories are the turn-synchronous path's (which runs both calls together too)."""
    tools, references, room = meeting
    tok = smollm2()
    calls = [format_tool_call("meet", {"name": name}) for name in ("one", "two")]
    assert len(tok.encode(calls[0])) == len(tok.encode(calls[1]))  # the turns end in the same step
    scripts = [[calls[0], "Done."], [calls[1], "Done."]]
    streamed, engine = play_scripted(tok, tools, references, scripts)
    assert [tool_results(e) for e in streamed] == [["one met two"], ["two met one"]]
    assert [dict(e.tool_errors) for e in streamed] == [{"meet": 0}, {"meet": 0}]
    assert [e.ended_by for e in streamed] == ["answer", "answer"] and not engine.has_unfinished_requests
    for arrived in room.glob("*.arrived"):
        arrived.unlink()
    synchronous, _ = play_scripted(tok, tools, references, scripts, streaming=False)
    same_episodes(streamed, synchronous)
    assert episode_metrics(synchronous) == {k: v for k, v in episode_metrics(streamed).items()
                                            if not k.startswith("prefill")}


def hold_then_release(room, holder: int, waiting: Sequence[int]):
    """A `before_step` hook ordering the helper's jobs: once episode `holder`'s first turn has ended, the engine
    steps on only after its `hold` call is running (alone: no other turn had ended); once the first turns of
    `waiting` have all ended (their jobs queued behind the held one), the hold is released."""
    def before_step(engine):
        ended = {episode for _, what, episode, turn in engine.log if what == "end" and turn == 0}
        if holder in ended:
            deadline = time.monotonic() + 60
            while not (room / "holding").exists() and time.monotonic() < deadline:
                time.sleep(0.01)
        if set(waiting) <= ended:
            (room / "release").touch()
    return before_step


def test_tool_calls_queued_behind_a_running_job_are_coalesced(meeting):
    """Episode 0's call holds the helper; meanwhile the turns of episodes 1 and 2 end at different steps with
    calls of two different tools (meet, greet), each succeeding only when the other is inside at once; episode 3
    decodes a long answer. When the hold is released the helper takes both queued jobs as one batch (one pool run
    of two functions over two workers): both calls succeed and each result reaches its own episode."""
    tools, references, room = meeting
    tok = smollm2()
    scripts = [[format_tool_call("hold", {"name": "zero"}), "Held."],
               ["Let me meet. " + format_tool_call("meet", {"name": "one"}), "Met."],
               ["Let me greet them all, slowly. " + format_tool_call("greet", {"name": "two"}), "Greeted."],
               ["A long answer without tools, " + "word " * 80]]
    episodes, engine = play_scripted(tok, tools, references, scripts, before_step=hold_then_release(room, 0, (1, 2)))
    ends = {episode: step for step, what, episode, turn in engine.log if what == "end" and turn == 0}
    assert ends[0] < ends[1] < ends[2] < ends[3]  # the calls' turns ended one after another
    assert [tool_results(e) for e in episodes] == [["released"], ["one met two"], ["two greeted one"], []]
    assert [sum(e.tool_errors.values()) for e in episodes] == [0, 0, 0, 0]
    assert [e.ended_by for e in episodes] == ["answer"] * 4


@pytest.mark.parametrize("fails", ["meet_then_die", "meet_then_hang"])
def test_a_failing_call_in_a_coalesced_batch_is_only_its_own_episodes_error(meeting, fails):
    """In one batch (the two calls meet, so they ran together), a call that kills its worker or outlives
    rollout.tool_timeout_seconds is its own episode's error text; the other episode gets its result; the next
    turn's calls run on a fresh worker."""
    tools, references, room = meeting
    tok = smollm2()
    scripts = [[format_tool_call("hold", {"name": "zero"}), "Held."],
               ["Let me do it. " + format_tool_call(fails, {"name": "one"}), "Failed."],
               ["Let me greet them all, slowly. " + format_tool_call("greet", {"name": "two"}), "Greeted."],
               ["A long answer without tools, " + "word " * 80]]
    timeout = 60.0 if fails == "meet_then_die" else 10.0  # the hold and the meeting take far less
    with pytest.warns(UserWarning, match=f"rollout.tools: {fails} failed"):
        episodes, _ = play_scripted(tok, tools, references, scripts, timeout=timeout,
                                    before_step=hold_then_release(room, 0, (1, 2)))
    error = ("Error: the worker process died (exit code 3)" if fails == "meet_then_die" else
             f"Error: timed out after {timeout:g} s (rollout.tool_timeout_seconds)")
    assert [tool_results(e) for e in episodes] == [["released"], [error], ["two greeted one"], []]
    assert episodes[1].tool_errors == {fails: 1} and episodes[2].tool_errors == {"greet": 0}
    assert [e.ended_by for e in episodes] == ["answer"] * 4


def test_the_tool_executor_runs_calls_of_different_tools_in_one_pool_run(meeting):
    """`ToolExecutor.run` with two workers runs a meet and a greet call at once (each succeeds only then), each
    result in its call's place."""
    tools, references, _ = meeting
    executor = ToolExecutor(tools, references, num_workers=2, timeout_seconds=60.0)
    try:
        assert executor.capacity == 2
        calls = [ToolCall(0, "greet", {"name": "a"}), ToolCall(1, "meet", {"name": "b"})]
        assert executor.run(calls) == [("a greeted b", None), ("b met a", None)]
    finally:
        executor.close()
    assert ToolExecutor(tools).capacity == 1  # in process: one call at a time


MEETING_ENV = '''
import time
from pathlib import Path


class Meeting:
    """A game whose step waits (at most 30 s, in the room the row names) until another episode's step is inside
    too, then answers whom it met; the second step ends the episode."""

    def reset(self, room, name, **row):
        self.room, self.name, self.steps = Path(room), name, 0
        return None

    def step(self, message):
        self.steps += 1
        if self.steps > 1:
            return None
        (self.room / f"{self.name}.arrived").write_text(self.name)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            others = sorted(p.stem for p in self.room.glob("*.arrived") if p.stem != self.name)
            if others:
                return f"{self.name} met {', '.join(others)}"
            time.sleep(0.01)
        raise TimeoutError(f"{self.name} waited alone")
'''


def test_environment_steps_of_episodes_whose_turns_end_together_run_in_parallel(tmp_path):
    """Two episodes on two environment workers (one instance each) end their first turns in the same step; their
    steps succeed only when both are inside at once: the helper runs them as one batch over the two workers, and
    each observation reaches its own episode, as on the turn-synchronous path."""
    path = tmp_path / "meeting_env.py"
    path.write_text(MEETING_ENV)
    tok = smollm2()
    played = []
    for streaming, room in ((True, tmp_path / "streamed"), (False, tmp_path / "synchronous")):
        room.mkdir()
        rows = [{"question": "Meet.", "room": str(room), "name": name} for name in ("one", "two")]
        engine = (StreamedContextEngine if streaming else ContextEngine)(tok, lambda context: "Hello.")
        environment = _environment(path, {None: "Meeting"}, workers=2, timeout=60.0)
        sampling = SamplingParams(max_new_tokens=200, stop_token_ids=(engine.end,))
        try:
            played.append(run_episodes(engine, tok, [[{"role": "user", "content": r["question"]}] for r in rows], [],
                                       ToolExecutor([]), sampling, EpisodeLimits(), environment=environment,
                                       routes=[None, None], rows=rows, streaming=streaming))
        finally:
            environment.close()
    streamed, synchronous = played
    assert [[m["content"] for m in e.completion if m["role"] == "user"] for e in streamed] == \
        [["one met two"], ["two met one"]]
    assert [e.ended_by for e in streamed] == ["environment", "environment"]
    assert not any(e.env_errors for e in streamed)
    same_episodes(streamed, synchronous)
