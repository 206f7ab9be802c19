"""Multi-turn episodes with tools and environments: the policy samples a turn, its tool calls run (or its
environment's step answers), the results are appended, and so on until it answers, the environment ends the
episode, a cap ends it, or the token budget runs out. Token-in, token-out.

Per episode (on a streaming engine each at its own pace, below; else all episodes of a batch turn by turn, one
engine call per turn; `astrai.agents.chat` has the rendering rules):

1. the prompt: the first messages rendered with the tools (in the template's ``tools`` variable when it has one,
   else listed in the system turn, Hermes format) and the generation prompt;
2. a turn: the engine continues the episode's ids (prompt + everything so far; the paged engine's prefix cache
   reuses the KV of earlier turns) for at most the budget left; the sampled ids are appended verbatim with loss
   mask 1, their behaviour log-probs and the engine's `policy_version`;
3. the turn's text is parsed for ``<tool_call>`` blocks into its assistant message
   (`astrai.agents.tool_calls.assistant_message`: the text outside the calls as its content, the calls in
   ``tool_calls``, OpenAI's shape, whatever the template; a malformed block is in neither, its error becomes its
   result); none: the episode ends ("answer"); at `EpisodeLimits.max_turns`: it ends ("max_turns"); else the calls run
   (`ToolExecutor`, at most `max_parallel_tool_calls` of them, each result cut to `max_tool_response_tokens`) and
   the results, rendered as the template renders them (`astrai.agents.chat.suffix_ids`: the separator after the
   end of turn, then the tool messages and the next generation prompt) are appended with loss mask 0;
4. a turn the budget cut before its end-of-turn token ends the episode ("length"); results that would leave no
   room for another token end it too ("budget"), not appended.

With an environment (`rollout.environment`, `astrai.experience.episode_environments`): before the first turn each
episode's instance is created and reset with its row (which may change the first messages); the episode offers the
job's tools and its class's methods, the methods' calls run on its instance; a turn without a call goes to the
class's ``step`` when it has one, whose observation is appended as tool results are (None ends the episode:
"environment"); a failure of the environment ends the episode ("env_error"); at the end get_reward and close run.

On a streaming engine (`streams`: the paged engine's add_request / step, not tensor-parallel) the episodes of a
batch progress together but not in lockstep: an episode's next turn is added to the running batch as soon as its
tool results (or observation) are in; its tool calls and environment steps run in a helper thread (one job per
ended turn, queued in the order the turns ended) while the engine keeps stepping the other episodes' turns, so one
episode waiting on a slow tool does not stall the others' decoding. The helper is the only caller of the tool
workers and the environment instances (each pool serves one caller), and it coalesces: it takes with a job every
job of its kind queued at that moment that fits what the workers run at once and runs them as one batch (one
`ToolExecutor.run` over the tool workers, one `EpisodeEnvironment.step`), so the calls of different episodes run in
parallel on `rollout.tool_workers` processes; each episode receives its own calls' results, as if they had run
alone. In-process tools and environments (0 workers) run one job at a time (`_ToolHelper`). Each turn's context
is the previous turn's plus its sampled tokens and results, so the version-tagged prefix cache serves the KV of the
earlier turns' full blocks (`Episode.prefill_tokens_reused`, the metric `prefill_tokens_reused`). The
trajectories are what the synchronous path gives: the same ids, loss mask, log-probs, `policy_version` per token
and endings (whether a call ran alone or in a batch changes only when its result comes), and the same samples
where the engine's arithmetic is batch-invariant (float32 on CPU) and the seeds agree. Turn t of episode i is
seeded `request_seed(base_t, i)`, base_t the generator's t-th draw, as `generate` seeds row i of turn t; the
synchronous path numbers the rows of turn t among the episodes still running, so the two agree on every turn that
no earlier episode of the batch has ended before (always on the first turn; the tokens of greedy sampling always).

The budget is the response side of the sequence, `SamplingParams.max_new_tokens` (`rollout.max_new_tokens`): every
turn and every tool result together, so the start-up check of prompt + response length against the model's
position limit holds for episodes as for single turns. What the reward sees of an episode is its new messages (the
assistant turns and tool results, TRL's convention for conversational completions), in the same shape for every
template: the last message's content is the final answer (`Episode.text`), never a ``<tool_call>`` block (""
when the episode ended on a call).
"""

from __future__ import annotations

import dataclasses
import math
import re
import threading
import time
import warnings
import weakref
from collections import Counter, deque
from concurrent.futures import ALL_COMPLETED, FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from astrai.agents.chat import check_prefix_preserving, render, suffix_ids, turn_end
from astrai.agents.tool_calls import ToolCall, ToolCallError, assistant_message
from astrai.agents.tools import Tool
from astrai.experience.episode_environments import ENV_ERROR_KINDS, EpisodeEnvironment
from astrai.experience.tool_executor import ToolExecutor, tool_references
from astrai.experience.trajectory import NOT_SAMPLED, Experience, Trajectory
from astrai.rewards.workers import CallInterrupted, ScoringStopped, in_process_call
from astrai.rollout.engine import StreamingEngine
from astrai.rollout.row_sampling import draw_base_seed, row_base_seed
from astrai.rollout.sampling import SamplingParams

__all__ = ["EpisodeLimits", "Episode", "EpisodeRunner", "PlayedSample", "ToolExecutor", "check_episodes",
           "run_episodes", "episode_metrics", "streams", "tool_references", "turn_seed", "ENDINGS",
           "ENVIRONMENT_REWARD"]

ENVIRONMENT_REWARD = "environment"
"""The name of the environment's reward among the reward functions' (`rewards/environment/...`)."""

ENDINGS = ("answer", "max_turns", "length", "budget", "environment", "env_error")
"""Why an episode ended: the policy answered without a tool call, `max_turns` turns were sampled, a turn was cut by
the budget before its end of turn, the tool results (or observation) would have left no room for another token, the
environment's step returned None, or its environment failed (`astrai.experience.episode_environments`)."""


@dataclass(frozen=True)
class EpisodeLimits:
    """The caps of an episode (`rollout.max_turns`, `rollout.max_tool_response_tokens`,
    `rollout.tool_response_truncation`, `rollout.max_parallel_tool_calls`).

    Attributes:
        max_turns: policy turns per episode, >= 1.
        max_tool_response_tokens: most tokens of one tool result (its text is cut to them and marked).
        tool_response_truncation: "right" keeps a long result's start, "left" its end.
        max_parallel_tool_calls: most calls run per turn; the others get an error result saying so.
    """

    max_turns: int = 4
    max_tool_response_tokens: int = 256
    tool_response_truncation: str = "right"
    max_parallel_tool_calls: int = 4


@dataclass
class Episode:
    """One episode as it grows: the ids and per-token fields of a `Trajectory`, the conversation, and its counts.

    Attributes:
        prompt_ids: the rendered first messages (with the tools and the generation prompt).
        messages: the conversation so far (the first messages, then assistant turns and tool results).
        first: how many of `messages` were the prompt's.
        response_ids, loss_mask, logprobs, policy_versions, turn_starts: as `Trajectory`'s.
        tool_calls, tool_errors: per tool name (None for a call whose name could not be read), the calls made and
            those whose result was an error.
        tool_results_cut: how many of its tool results `max_tool_response_tokens` cut (marked in the text).
        ended_by: one of `ENDINGS`, None while it runs.
        tools: the tools this episode offers (the job's, then its environment's methods).
        env_key, env_route: its environment instance's key in the pool and its class's route (None without an
            environment / for a single class).
        env_errors: per kind (`ENV_ERROR_KINDS`), the environment failures it met; env_error: the first one's text.
        env_reward: what its environment's get_reward returned (None: no get_reward, or it failed);
        env_reward_failed: whether that reward is missing because of a failure.
        prefill_tokens: on a streaming engine, the context tokens its turns submitted (prompt + everything before
            each turn, summed over its turns; 0 on the synchronous path).
        prefill_tokens_reused: of those, the tokens whose KV the engine's prefix cache served instead of a prefill
            (`StepOutput.cached_tokens`; None when the engine does not say).
        pending_ids, pending_logprobs, pending_versions: the turn in progress when a partial rollout stopped
            (`rollout.partial`, `astrai.experience.partial_episodes`): its sampled ids so far, their behaviour
            log-probs and `policy_version`s; the next rollout continues it (empty otherwise).
    """

    prompt_ids: list[int]
    messages: list[dict[str, Any]]
    first: int
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    policy_versions: list[int] = field(default_factory=list)
    turn_starts: list[int] = field(default_factory=list)
    tool_calls: Counter = field(default_factory=Counter)
    tool_errors: Counter = field(default_factory=Counter)
    tool_results_cut: int = 0
    ended_by: Optional[str] = None
    tools: list[Tool] = field(default_factory=list)
    env_key: Optional[int] = None
    env_route: Optional[str] = None
    env_errors: Counter = field(default_factory=Counter)
    env_error: Optional[str] = None
    env_reward: Optional[float] = None
    env_reward_failed: bool = False
    prefill_tokens: int = 0
    prefill_tokens_reused: Optional[int] = None
    pending_ids: list[int] = field(default_factory=list)
    pending_logprobs: list[float] = field(default_factory=list)
    pending_versions: list[int] = field(default_factory=list)

    @property
    def done(self) -> bool:
        """It ended (`ended_by` set)."""
        return self.ended_by is not None

    @property
    def started(self) -> bool:
        """The policy sampled a token of it (a turn, or the start of one a partial rollout stopped)."""
        return bool(self.turn_starts or self.pending_ids)

    def staleness(self, policy_version: int) -> int:
        """`policy_version` minus the version of its oldest sampled token (0 with none; DESIGN.md section 4)."""
        versions = [v for v in self.policy_versions if v != NOT_SAMPLED] + self.pending_versions
        return policy_version - min(versions) if versions else 0

    @property
    def completion(self) -> list[dict[str, Any]]:
        """The episode's new messages, what reward functions receive as its completion."""
        return self.messages[self.first:]

    @property
    def text(self) -> str:
        """The final assistant message's content, which holds no tool call (`assistant_message`): the answer the
        single-turn rewards read; "" for an episode that ended on a call (its budget or max_turns ran out)."""
        return next((m.get("content") or "" for m in reversed(self.messages) if m.get("role") == "assistant"), "")

    def trajectory(self, **scored: Any) -> Trajectory:
        """The episode as a `Trajectory` (`scored`: score, reward_components, reward_failed)."""
        metadata = {"ended_by": self.ended_by, **({"env_error": self.env_error} if self.env_error else {})}
        return Trajectory(prompt_ids=tuple(self.prompt_ids), response_ids=tuple(self.response_ids),
                          loss_mask=tuple(self.loss_mask), logprobs=tuple(self.logprobs),
                          policy_versions=tuple(self.policy_versions), text=self.text,
                          turn_starts=tuple(self.turn_starts), metadata=metadata,
                          messages=[dict(m) for m in self.completion], **scored)

    def _append(self, ids: Sequence[int], *, sampled: bool, logprobs: Sequence[float] = (),
                versions: Sequence[int] = ()):
        self.response_ids += list(ids)
        self.loss_mask += [sampled] * len(ids)
        self.logprobs += list(logprobs) if sampled else [0.0] * len(ids)
        self.policy_versions += list(versions) if sampled else [NOT_SAMPLED] * len(ids)


def run_episodes(engine, tokenizer, conversations: Sequence[Sequence[Mapping[str, Any]]], tools: Sequence[Tool],
                 executor: ToolExecutor, sampling: SamplingParams, limits: EpisodeLimits,
                 generator: Optional[torch.Generator] = None, *, environment: Optional[EpisodeEnvironment] = None,
                 routes: Optional[Sequence[Optional[str]]] = None,
                 rows: Optional[Sequence[Mapping[str, Any]]] = None,
                 streaming: Optional[bool] = None) -> list[Episode]:
    """Run one episode per conversation (module docstring) and return them, ended.

    Args:
        engine: a `GenerationEngine`; tokenizer: the policy's (`astrai.models.Tokenizer`, with a chat template).
        conversations: each episode's first messages ([{"role", "content"}, ...], the last the user's).
        tools: the tools offered (their schemas rendered into the prompt); executor: runs their calls.
        sampling: the sampling settings; its `max_new_tokens` is each episode's whole response budget and its
            `stop_token_ids` must hold the template's end-of-turn token.
        limits: the episode caps.
        environment: the job's environment classes (`rollout.environment`), None without; then `routes` (per
            episode its class's route, None for a single class) and `rows` (per episode the row its reset
            receives) are required. Each episode also offers its class's methods as tools, steps a class with
            ``step`` on every turn that calls no tool, and gets its environment reward (`EpisodeEnvironment`).
        streaming: run on the engine's streaming API (module docstring, "On a streaming engine"); None: when the
            engine offers it (`streams`), False: turn-synchronously with `engine.generate`.

    Raises:
        ValueError: the end-of-turn token of the template is not a stop token (a turn would never end), a
            rendered prompt is empty, or `streaming` True on an engine without the streaming API.
            `astrai.agents.chat.TemplatePrefixError`: the template rewrites earlier turns.
            `astrai.experience.environments.EnvironmentFailure`: past the environment failures' threshold.
        ScoringStopped: a stop request interrupted a tool or environment call (`ToolExecutor`,
            `astrai.experience.environments.EnvironmentPool`); the instances are closed first (best effort).
    """
    if streaming is None:
        streaming = streams(engine)
    elif streaming and not streams(engine):
        raise ValueError(f"multi-turn episodes: streaming needs an engine with the streaming API and no tensor "
                         f"parallelism, and {type(engine).__name__} is not one")
    episodes = _open_episodes(tokenizer, conversations, tools, sampling, environment, routes, rows)
    try:
        if streaming:
            _streamed_turns(engine, tokenizer, episodes, executor, sampling, limits, generator, environment)
        else:
            _synchronous_turns(engine, tokenizer, episodes, executor, sampling, limits, generator, environment)
    except BaseException:  # the instances are closed before the error goes on
        if environment is not None:
            environment.abandon(episodes)
        raise
    for e in episodes:
        e.ended_by = e.ended_by or "max_turns"
    if environment is not None:
        environment.finish(episodes)
    return episodes


def streams(engine) -> bool:
    """Whether `run_episodes` runs on `engine`'s streaming API (`astrai.rollout.engine.StreamingEngine`: the paged
    engine's add_request / step / abort): an engine that has it and is not tensor-parallel (its ranks must agree
    on every batch, which `generate` does; the TP engine and the vLLM adapter run turn-synchronously)."""
    return isinstance(engine, StreamingEngine) and getattr(engine, "tp", None) is None


def _close_turn(tokenizer, e: Episode, sampled: list[int], logprobs: list[float], versions: list[int],
                finished: bool, last: bool, environment: Optional[EpisodeEnvironment]) -> Optional[tuple]:
    """Append the turn `sampled` (per token its behaviour log-prob in `logprobs` and the `policy_version` of the
    weights that sampled it in `versions`; `finished`: it ended with a stop token; `last`: it was the episode's
    `max_turns`-th) to `e` and decide what follows: None when the turn ended the episode (`e.ended_by` set),
    ("call", calls, errors) when its tool calls run next, ("step",) when its environment's step answers it next."""
    e.turn_starts.append(len(e.response_ids))
    e._append(sampled, sampled=True, logprobs=logprobs, versions=versions)
    calls, errors = _read_turn(tokenizer, e, sampled)
    if not finished:
        e.ended_by = "length"
    elif e.env_errors:  # its reset failed: the first turn is sampled on the row's prompt, then it ends
        e.ended_by = "env_error"
    elif calls or errors:
        if last:
            e.ended_by = "max_turns"
        else:
            return ("call", calls, errors)
    elif environment is not None and environment.steps.get(e.env_route):
        return ("step",)  # on the last turn too: the environment sees every finished action
    else:
        e.ended_by = "answer"
    return None


def _apply_observation(tokenizer, e: Episode, observation, last: bool, budget: int) -> None:
    """An environment step's `observation` for `e` (None: the step ended it): appended, or at the last turn the
    episode ends ("max_turns")."""
    if observation is not None and last:
        e.ended_by = "max_turns"
    elif observation is not None:
        _append_observation(tokenizer, e, observation, budget)


def _synchronous_turns(engine, tokenizer, episodes: list[Episode], executor: ToolExecutor, sampling: SamplingParams,
                       limits: EpisodeLimits, generator, environment: Optional[EpisodeEnvironment]) -> None:
    """The turn-synchronous loop: every running episode's turn t in one `engine.generate` call (one base seed
    drawn from `generator` per turn, row i of the running episodes seeded `request_seed(base, i)` by the engine),
    then all their tool calls and environment steps, then turn t + 1."""
    budget = sampling.max_new_tokens
    for turn in range(limits.max_turns):
        active = [e for e in episodes if e.ended_by is None]
        if not active:
            break
        params = [dataclasses.replace(sampling, max_new_tokens=budget - len(e.response_ids)) for e in active]
        generation = engine.generate([e.prompt_ids + e.response_ids for e in active], params, generator)
        rows_out = zip(active, generation.response_ids.tolist(), generation.action_mask.tolist(),
                       generation.old_logprobs.tolist(), generation.finished.tolist())
        calling, stepping = [], []
        last = turn == limits.max_turns - 1
        for e, ids, mask, logprobs, finished in rows_out:
            sampled = [t for t, m in zip(ids, mask) if m]
            follow = _close_turn(tokenizer, e, sampled, [lp for lp, m in zip(logprobs, mask) if m],
                                 [generation.policy_version] * len(sampled), bool(finished), last, environment)
            if follow is not None and follow[0] == "call":
                calling.append((e, follow[1], follow[2]))
            elif follow is not None:
                stepping.append(e)
        _answer_calls(tokenizer, calling, executor, limits, budget, environment)
        for e, observation in zip(stepping, environment.step(stepping) if stepping else ()):
            _apply_observation(tokenizer, e, observation, last, budget)
        if environment is not None:
            environment.end_lost(active)


def turn_seed(bases: list[int], turn: int, index: int, generator: Optional[torch.Generator]) -> int:
    """The `add_request` seed of episode `index`'s turn `turn` on the streaming path: the seed whose first choice
    samples with `request_seed(base_turn, index)`, the generator `engine.generate` gives row `index` of a call
    whose base seed is base_turn; base_turn is the turn-th int64 drawn from `generator` (into `bases`, when the
    first episode reaches that turn, so the generator gives as many draws, in the same order, as the synchronous
    path's one `generate` call per turn takes); the seed is `row_base_seed(base_turn, index)`."""
    while len(bases) <= turn:
        bases.append(draw_base_seed(generator))
    return row_base_seed(bases[turn], index)


@torch.no_grad()
def _streamed_turns(engine, tokenizer, episodes: list[Episode], executor: ToolExecutor, sampling: SamplingParams,
                    limits: EpisodeLimits, generator, environment: Optional[EpisodeEnvironment], *,
                    until: Optional[Callable[[], bool]] = None, blocking: bool = False) -> None:
    """The streaming loop (module docstring, "On a streaming engine"): each episode's next turn is added to the
    engine as soon as its tool results (or observation) are in; the tool calls and environment steps run in one
    helper thread (`_ToolHelper`: the jobs of a step's ended turns queued together, queued jobs that fit the
    workers coalesced into one batch), while this thread keeps stepping the engine over the other episodes'
    turns; a finished job is polled between two steps (waited for when nothing decodes). Every live
    request is aborted on the way out, an error included.

    Partial rollouts (`astrai.experience.partial_episodes`): an episode with a turn in progress (`pending_ids`)
    continues it, its context the prompt, the response and the turn's ids so far (re-prefilled), its budget what
    they leave. `until`, checked after every engine step and every applied job, stops the loop early: the turns
    still decoding keep their ids so far as the episodes' turns in progress, the jobs in flight are waited for and
    their results appended (so each episode is either ended, in a turn, or ready for its next one). `blocking`:
    each step's jobs are waited for before the next step, so the order of the requests, and with it the batches
    and every sample, is fixed by the seed (what `runtime.deterministic` needs on this path)."""
    budget = sampling.max_new_tokens
    bases: list[int] = []
    # request id -> (episode, the turn's ids, log-probs and versions so far, the version its new tokens get)
    live: dict[int, tuple[int, list[int], list[float], list[int], int]] = {}
    jobs: dict[Future, tuple[int, tuple]] = {}  # the helper's work -> (episode, what follows its turn)
    ready = [i for i, e in enumerate(episodes) if e.ended_by is None]
    requests: list[int] = []
    prefilled: set[int] = set()  # the requests whose first output (which says the prefix-cache hits) came
    helper = _ToolHelper(executor, limits, environment)
    failed = True

    def apply(future: Future) -> None:
        i, follow = jobs.pop(future)
        e = episodes[i]
        if follow[0] == "call":
            _append_results(tokenizer, [(e, follow[1], follow[2])], future.result(), limits, budget)
        else:
            _apply_observation(tokenizer, e, future.result(), len(e.turn_starts) >= limits.max_turns, budget)
        if environment is not None:
            environment.end_lost([e])
        if e.ended_by is None:
            ready.append(i)

    try:
        while (ready or live or jobs) and not (until is not None and until()):
            for i in ready:
                e = episodes[i]
                context = e.prompt_ids + e.response_ids + e.pending_ids
                params = dataclasses.replace(sampling, max_new_tokens=budget - len(e.response_ids) - len(e.pending_ids))
                request = engine.add_request(context, params, seed=turn_seed(bases, len(e.turn_starts), i, generator))
                requests.append(request)
                live[request] = (i, e.pending_ids, e.pending_logprobs, e.pending_versions, engine.policy_version)
                e.pending_ids, e.pending_logprobs, e.pending_versions = [], [], []
                e.prefill_tokens += len(context)
            ready = []
            if engine.has_unfinished_requests:
                ended: list[tuple[int, tuple]] = []  # this step's turns whose calls or step run next
                for out in engine.step():
                    i, ids, logprobs, versions, version = live[out.request_id]
                    e = episodes[i]
                    if out.request_id not in prefilled and getattr(out, "cached_tokens", None) is not None:
                        e.prefill_tokens_reused = (e.prefill_tokens_reused or 0) + out.cached_tokens
                    prefilled.add(out.request_id)
                    ids.append(out.token_id)
                    logprobs.append(out.logprob)
                    versions.append(version)
                    if not out.done:
                        continue
                    del live[out.request_id]
                    last = len(e.turn_starts) >= limits.max_turns - 1
                    follow = _close_turn(tokenizer, e, ids, logprobs, versions, out.finished, last, environment)
                    if follow is not None:
                        ended.append((i, follow))
                if ended:  # queued together: the helper takes a step's jobs at once when they fit the workers
                    for future, job in zip(helper.submit([(episodes[i], follow) for i, follow in ended]), ended):
                        jobs[future] = job
                    if blocking:
                        helper.wait(list(jobs))
            elif jobs:
                helper.wait(list(jobs), return_when=FIRST_COMPLETED)
            elif live:
                raise RuntimeError("multi-turn episodes: the engine has no unfinished request while "
                                   f"{len(live)} turn(s) are not done")
            for future in [f for f in jobs if f.done()]:
                apply(future)
        for i, ids, logprobs, versions, _ in live.values():  # stopped by `until`: turns in progress kept
            e = episodes[i]
            e.pending_ids, e.pending_logprobs, e.pending_versions = ids, logprobs, versions
        live.clear()
        for future in list(jobs):
            helper.wait([future])
            apply(future)
        failed = False
    finally:  # also on a failure (non-finite logits, a tool job's error): the engine must be able to sleep
        for request in requests:
            engine.abort(request)
        helper.shutdown(wait=not failed)


SHUTDOWN_GRACE_SECONDS = 1.0
"""How long `_ToolHelper.shutdown` without wait gives a batch on worker processes to end."""


class _ToolHelper:
    """The streaming loop's helper thread: runs the tool calls and environment steps of ended turns (jobs) while
    the loop keeps stepping the engine, one batch of jobs at a time, so each worker pool (`ToolExecutor`'s,
    the environment's `EnvironmentPool`) and each environment instance has one caller, this thread.

    Coalescing: when the thread takes a job, it also takes every job of the same kind queued at that moment, in
    order, as long as they fit what the pools run at once: for tool-call jobs, their plain tools' calls (at most
    `max_parallel_tool_calls` per turn) within `ToolExecutor.capacity` and their environment methods' calls
    within the environment's workers; for step jobs, one step each within the environment's workers. It runs the
    batch as one job (`_run_calls`: one `ToolExecutor.run`, one `RewardWorkerPool.run` over the workers;
    `EpisodeEnvironment.step` over the episodes), then hands each episode's future its own results. So the
    calls of different episodes run in parallel on the tool workers, and the results are those each call gives
    alone: a timeout or a dead worker is that call's error text only. In-process tools and environments
    (`tool_workers: 0`, `environment_workers: 0`: capacity 1) stay serial: a job runs alone unless the others
    add no call (their calls are malformed, or past the cap). A batch ends when its slowest call ends: a job that
    arrives meanwhile waits for it, as a fast call of the batch does for the slow one.

    Jobs: (episode, follow), `_close_turn`'s ("call", calls, errors) or ("step",); the future of a call job gives
    `_run_calls`'s results (by ``id(call)``), a step job's the episode's observation (None: it ended)."""

    def __init__(self, executor: ToolExecutor, limits: EpisodeLimits, environment: Optional[EpisodeEnvironment]):
        self.executor, self.limits, self.environment = executor, limits, environment
        env_workers = environment.pool.num_workers if environment is not None else 0
        self._capacity = (executor.capacity, max(env_workers, 1))  # (plain tool calls, environment calls) at once
        self.in_process = executor.pool is None or (environment is not None and env_workers == 0)
        self._queue: deque[tuple[Future, Episode, tuple]] = deque()
        self._lock = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="astrai-episode-tools", daemon=True)
        self._thread.start()

    def wait(self, futures: Sequence[Future], return_when: str = ALL_COMPLETED) -> None:
        """Wait for `futures` (`concurrent.futures.wait`). When the helper runs calls in this process (0 tool or
        environment workers: no timeout, no stop poll), the wait is an `in_process_call` of the main thread, which
        a second stop signal interrupts: `ScoringStopped`, the call left running in the helper thread (a daemon).

        Raises:
            ScoringStopped: a second stop signal interrupted the wait."""
        if not self.in_process:
            wait(futures, return_when=return_when)
            return
        try:
            with in_process_call():
                wait(futures, return_when=return_when)
        except CallInterrupted as err:
            raise ScoringStopped(f"{err} (a tool or environment call in this process: rollout.tool_workers / "
                                 "rollout.environment_workers 0; it is left running in its thread)") from None

    def submit(self, jobs: Sequence[tuple[Episode, tuple]]) -> list[Future]:
        """Queue `jobs` ((episode, follow) pairs) together; one future each, in order."""
        futures = [Future() for _ in jobs]
        with self._lock:
            if self._closed:
                raise RuntimeError("multi-turn episodes: the tool helper is shut down")
            self._queue.extend((f, e, follow) for f, (e, follow) in zip(futures, jobs))
            self._lock.notify()
        return futures

    def _weight(self, e: Episode, follow: tuple) -> tuple[int, int]:
        """The calls a job runs: (plain tools' calls, environment calls)."""
        if follow[0] == "step":
            return 0, 1
        plain, methods, _ = _split_calls(e, follow[1], self.limits, self.environment)
        return len(plain), len(methods)

    def _take(self) -> list[tuple[Future, Episode, tuple]]:
        """The next batch (the lock held, the queue not empty): the first job and the queued jobs of its kind that
        fit the pools beside it (class docstring), in order; the others stay queued in theirs."""
        first = self._queue.popleft()
        batch, load = [first], list(self._weight(first[1], first[2]))
        kind, kept = first[2][0], deque()
        while self._queue:
            job = self._queue.popleft()
            if job[2][0] != kind:
                kept.append(job)
                continue
            weight = self._weight(job[1], job[2])
            if any(have + add > cap for have, add, cap in zip(load, weight, self._capacity)):
                kept.append(job)
                kept.extend(self._queue)  # first in, first out: a later job does not overtake it
                self._queue.clear()
                break
            batch.append(job)
            load = [have + add for have, add in zip(load, weight)]
        self._queue.extendleft(reversed(kept))
        return batch

    def _serve(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._lock.wait()
                if not self._queue:
                    return
                batch = [job for job in self._take() if job[0].set_running_or_notify_cancel()]
            if not batch:
                continue
            try:
                if batch[0][2][0] == "call":
                    results = _run_calls([(e, follow[1], follow[2]) for _, e, follow in batch], self.executor,
                                         self.limits, self.environment)
                    outcomes = [results] * len(batch)
                else:
                    outcomes = self.environment.step([e for _, e, _ in batch])
            except BaseException as err:  # noqa: BLE001 - the loop raises it from the futures
                for future, _, _ in batch:
                    future.set_exception(err)
                continue
            for (future, _, _), outcome in zip(batch, outcomes):
                future.set_result(outcome)

    def shutdown(self, wait: bool = True) -> None:
        """Stop the thread: the queued jobs are cancelled; with `wait`, after the batch running now ends. Without
        `wait` (an error ends the loop), a batch on worker processes is still given `SHUTDOWN_GRACE_SECONDS` to
        end (after a stop request it ends within the pools' poll), so that the caller's next use of the pools (the
        environment instances' close) does not overlap it; an in-process batch is not waited for."""
        with self._lock:
            self._closed = True
            for future, _, _ in self._queue:
                future.cancel()
            self._queue.clear()
            self._lock.notify()
        if wait:
            self._thread.join()
        elif not self.in_process:
            self._thread.join(timeout=SHUTDOWN_GRACE_SECONDS)


def _open_episodes(tokenizer, conversations, tools: Sequence[Tool], sampling: SamplingParams,
                   environment: Optional[EpisodeEnvironment], routes, rows) -> list[Episode]:
    """The episodes of `conversations` before their first turn: with an environment, each instance created and
    reset (its observation applied to the first messages; a failure counted, the row's prompt kept), the tools
    each offers, and the prompt rendered (a template whose end of turn does not stop the sampler refused)."""
    n = len(conversations)
    episodes = [Episode(prompt_ids=[], messages=[dict(m) for m in c], first=len(c), tools=list(tools))
                for c in conversations]
    if environment is not None:
        for e, reply in zip(episodes, environment.start(episodes, routes or [None] * n, rows or [{}] * n)):
            e.tools = list(tools) + list(environment.tools[e.env_route])
            if not reply.ok:
                environment.fail(e, "lost" if environment.pool.lost(e.env_key) else "reset", reply.value, reply.trace,
                                 call="reset")
            else:
                e.messages = environment.first_messages(e.messages, reply.value)
                e.first = len(e.messages)
    checked: set[tuple[str, ...]] = set()
    for e, conversation in zip(episodes, conversations):
        if tuple(t.name for t in e.tools) not in checked:
            _check_turn_end(tokenizer, e.tools, sampling)
            checked.add(tuple(t.name for t in e.tools))
        e.prompt_ids = tokenizer.encode(render(tokenizer, e.messages, e.tools, add_generation_prompt=True))
        limit = environment.max_prompt_tokens if environment is not None else None
        if limit is not None and len(e.prompt_ids) > limit and not e.env_errors:  # reset's messages: too long
            environment.fail(e, "reset", f"its first messages render to {len(e.prompt_ids)} tokens, more than the "
                                         f"{limit} the model's positions leave after rollout.max_new_tokens")
            e.messages = [dict(m) for m in conversation]
            e.first = len(e.messages)
            e.prompt_ids = tokenizer.encode(render(tokenizer, e.messages, e.tools, add_generation_prompt=True))
        if not e.prompt_ids:
            if environment is not None:
                environment.abandon(episodes)
            raise ValueError("multi-turn episodes: a prompt renders to no tokens")
    return episodes


def _parse_turn(tokenizer, e: Episode, sampled: list[int]) -> tuple[dict[str, Any], list, list]:
    """The assistant message of the turn `sampled` of `e` (`assistant_message`: the content outside its well-formed
    calls and the calls in ``tool_calls``, for every template; the text as sampled for an episode without tools)
    and the turn's (calls, malformed calls), none for an episode without tools."""
    text = tokenizer.decode(sampled, skip_special_tokens=True)
    if not e.tools:
        return {"role": "assistant", "content": text}, [], []
    return assistant_message(text, [t.name for t in e.tools])


def _read_turn(tokenizer, e: Episode, sampled: list[int]) -> tuple[list, list]:
    """Append the assistant message of the turn `sampled` to `e.messages` (`_parse_turn`); return the turn's
    (calls, malformed calls)."""
    message, calls, errors = _parse_turn(tokenizer, e, sampled)
    e.messages.append(message)
    return calls, errors


def _check_turn_end(tokenizer, tools: Sequence[Tool], sampling: SamplingParams) -> None:
    """Refuse a template whose end-of-turn token (with these tools) is not a stop token of the sampler."""
    end_token, _ = turn_end(tokenizer, tools)
    end_id = tokenizer.token_to_id(end_token)
    if end_id not in sampling.stop_token_ids:
        raise ValueError(f"multi-turn episodes: the chat template ends a turn with {end_token!r} (id {end_id}), "
                         f"which is not a stop token of the sampler {list(sampling.stop_token_ids)}")


def _append_observation(tokenizer, e: Episode, messages: list[dict[str, Any]], budget: int) -> None:
    """Append `messages` (tool results or an environment's observation) to episode `e` with loss mask 0, as the
    template renders them after its last turn; when they would leave no room for another token, end it
    ("budget") without them."""
    suffix = suffix_ids(tokenizer, e.messages, messages, e.tools)
    added = suffix.separator_ids + suffix.ids
    if len(e.response_ids) + len(added) >= budget:
        e.ended_by = "budget"
        return
    e._append(added, sampled=False)
    e.messages += messages


def _answer_calls(tokenizer, calling, executor: ToolExecutor, limits: EpisodeLimits, budget: int,
                  environment: Optional[EpisodeEnvironment] = None) -> None:
    """Run the calls of every episode in `calling` ((episode, calls, errors) triples) and append their results:
    plain tools through `executor`, the methods of an episode's environment on its instance."""
    _append_results(tokenizer, calling, _run_calls(calling, executor, limits, environment), limits, budget)


def _run_calls(calling, executor: ToolExecutor, limits: EpisodeLimits,
               environment: Optional[EpisodeEnvironment] = None) -> dict[int, tuple[str, Optional[str]]]:
    """Run the calls of every episode in `calling` ((episode, calls, errors) triples): by ``id(call)``, (result
    text, error text or None); plain tools through `executor`, the methods of an episode's environment on its
    instance, the calls past `max_parallel_tool_calls` an error result without running. Touches no tokenizer (the
    streaming loop runs it in its helper thread)."""
    runnable, on_instance, results = [], [], {}
    for e, calls, errors in calling:
        plain, methods, over = _split_calls(e, calls, limits, environment)
        for c in over:
            text = (f"Error: at most {limits.max_parallel_tool_calls} tool calls run per turn "
                    f"(rollout.max_parallel_tool_calls); this one did not")
            results[id(c)] = (text, text)
        runnable += plain
        on_instance += [(e, c) for c in methods]
    results.update(zip(map(id, runnable), executor.run(runnable)))
    if on_instance:
        results.update(environment.call_tools(on_instance))
    return results


def _split_calls(e: Episode, calls: Sequence[ToolCall], limits: EpisodeLimits,
                 environment: Optional[EpisodeEnvironment]) -> tuple[list[ToolCall], list[ToolCall], list[ToolCall]]:
    """(plain tools' calls, calls of `e`'s environment methods, calls past `max_parallel_tool_calls`) of one turn's
    well-formed `calls`, in order: what `_run_calls` runs where, and what `_ToolHelper` counts against its pools."""
    running = list(calls[:limits.max_parallel_tool_calls])
    names = {t.name for t in environment.tools[e.env_route]} if environment is not None else set()
    return ([c for c in running if c.name not in names], [c for c in running if c.name in names],
            list(calls[limits.max_parallel_tool_calls:]))


def _append_results(tokenizer, calling, results: Mapping[int, tuple[str, Optional[str]]], limits: EpisodeLimits,
                    budget: int) -> None:
    """Append to every episode of `calling` the results of its calls (`_run_calls`), in the order the turn made
    them, malformed calls' errors included, each cut to `max_tool_response_tokens`; count calls and errors."""
    for e, calls, errors in calling:
        items: list[ToolCall | ToolCallError] = sorted([*calls, *errors], key=lambda item: item.index)
        tool_messages = []
        for item in items:
            if isinstance(item, ToolCallError):
                text, error = item.message, item.message
            else:
                text, error = results[id(item)]
            e.tool_calls[item.name] += 1
            e.tool_errors[item.name] += error is not None
            content = _cut(tokenizer, text, limits)
            e.tool_results_cut += content != text
            tool_messages.append({"role": "tool", "name": item.name or "unknown", "content": content})
        if e.ended_by is None:  # a call that timed out or lost the instance ended it: nothing more is appended
            _append_observation(tokenizer, e, tool_messages, budget)


CUT_MARGIN_CHARS = 1024
"""Characters `_cut` keeps beyond twice what `max_tool_response_tokens` tokens can span (`_cut_bound`)."""

_LONGEST_TOKEN: "weakref.WeakKeyDictionary[Any, Optional[int]]" = weakref.WeakKeyDictionary()
"""Per tokenizer, the characters of its longest token (`_longest_token_chars`), computed once."""


def _longest_token_chars(tokenizer) -> Optional[int]:
    """The length of the longest token string of `tokenizer`'s vocabulary (added tokens included), an upper bound on
    the characters of text one token stands for (a byte-level token's string has a character per byte, a
    SentencePiece piece one per character, a byte-fallback piece six for one byte); None when the tokenizer does
    not expose its vocabulary (no bound: `_cut` tokenizes the whole text). Cached per tokenizer."""
    try:
        return _LONGEST_TOKEN[tokenizer]
    except (KeyError, TypeError):
        pass
    try:
        longest = max(map(len, tokenizer.backend.get_vocab(with_added_tokens=True)), default=1)
    except Exception:  # noqa: BLE001 - a tokenizer without a `tokenizers` backend
        longest = None
    try:
        _LONGEST_TOKEN[tokenizer] = longest
    except TypeError:  # not weak-referenceable: not cached
        pass
    return longest


def _cut_bound(tokenizer, keep: int) -> Optional[int]:
    """The characters of a tool result `_cut` tokenizes at most: twice what `keep` + 1 tokens of the longest token
    can span, plus `CUT_MARGIN_CHARS` (the tokens at the edge of a piece cut out of a text may merge otherwise than
    in the whole text; twice the need leaves those edge tokens far past the `keep` that are kept), or None (no
    bound, `_longest_token_chars`)."""
    longest = _longest_token_chars(tokenizer)
    return None if longest is None else 2 * (keep + 1) * longest + CUT_MARGIN_CHARS


_WORD_START = re.compile(r"\s(?=\S)")
"""A whitespace character before a non-whitespace one: where a tokenizer's pre-tokenization starts a word."""


def _bounded_piece(text: str, bound: int, left: bool) -> str:
    """The start (or with `left` the end) of `text` that `_cut` tokenizes: at most `bound` characters, cut at the
    start of a word (`_WORD_START`) in the half of the piece away from the kept side, so that the words the kept
    tokens come from are tokenized as in the whole text; a piece without one there (a single huge word) is cut at
    `bound` characters (its far edge may then merge otherwise, never its kept tokens near the start with "right";
    with "left" BPE merges of one word run from its start, so the last tokens of a huge word may differ)."""
    if left:
        at = _WORD_START.search(text, len(text) - bound, len(text) - bound // 2)
        return text[at.start():] if at is not None else text[-bound:]
    ends = [m.start() for m in _WORD_START.finditer(text, bound // 2, bound)]
    return text[:ends[-1]] if ends else text[:bound]


def _cut(tokenizer, text: str, limits: EpisodeLimits) -> str:
    """`text` within `limits.max_tool_response_tokens` tokens: its start ("right") or end ("left") kept, marked.

    A text longer than `_cut_bound` characters is first cut to a piece of at most that many (`_bounded_piece`: its
    start or end, as the truncation keeps, cut at the start of a word), so a huge result (a tool returning 50 MB)
    costs the tokenization of a bounded piece, not of the whole; the bound is far above what the kept tokens span,
    so the result is the same as tokenizing the whole text (tested)."""
    keep = limits.max_tool_response_tokens
    left = limits.tool_response_truncation == "left"
    bound = _cut_bound(tokenizer, keep)
    piece = text if bound is None or len(text) <= bound else _bounded_piece(text, bound, left)
    ids = tokenizer.encode_text(piece)
    if len(ids) <= keep and piece is text:
        return text
    if left:
        return f"[... cut to the last {keep} tokens]" + tokenizer.decode(ids[-keep:])
    return tokenizer.decode(ids[:keep]) + f"[... cut to the first {keep} tokens]"


def episode_metrics(episodes: Sequence[Episode]) -> dict[str, float]:
    """Per-rollout agent metrics: `turns` (mean policy turns per episode), `tool_calls` and `tool_errors` (mean per
    episode, and per tool as `tool_calls/<name>`), `tool_results_cut` (the share of tool results
    `max_tool_response_tokens` cut), `ended/<why>` (the share of episodes per `ENDINGS` entry) and
    `masked_out_fraction` (the share of response tokens with loss mask 0: tool results, observations and
    separators); with an environment, `env_errors` (failures per episode) and `env_errors/<kind>` per
    `ENV_ERROR_KINDS` entry; on a streaming engine that reports prefix-cache hits, `prefill_tokens_reused` (mean
    per episode: context tokens of its turns whose KV the prefix cache served, no prefill) and
    `prefill_reused_fraction` (their share of all the context tokens its turns submitted)."""
    n = max(len(episodes), 1)
    calls, errors = Counter(), Counter()
    for e in episodes:
        calls.update(e.tool_calls)
        errors.update(e.tool_errors)
    tokens = sum(len(e.response_ids) for e in episodes)
    out = {"turns": sum(len(e.turn_starts) for e in episodes) / n, "tool_calls": sum(calls.values()) / n,
           "tool_errors": sum(errors.values()) / n,
           "tool_results_cut": sum(e.tool_results_cut for e in episodes) / max(sum(calls.values()), 1),
           "masked_out_fraction": sum(len(e.loss_mask) - sum(e.loss_mask) for e in episodes) / max(tokens, 1)}
    reported = [e for e in episodes if e.prefill_tokens_reused is not None]
    if reported:
        out["prefill_tokens_reused"] = sum(e.prefill_tokens_reused for e in reported) / len(reported)
        out["prefill_reused_fraction"] = (sum(e.prefill_tokens_reused for e in reported)
                                          / max(sum(e.prefill_tokens for e in reported), 1))
    out.update({f"ended/{why}": sum(e.ended_by == why for e in episodes) / n for why in ENDINGS})
    out.update({f"tool_calls/{name or 'unknown'}": count / n for name, count in calls.items()})
    out.update({f"tool_errors/{name or 'unknown'}": count / n for name, count in errors.items()})
    if any(e.env_key is not None for e in episodes):
        failures = Counter()
        for e in episodes:
            failures.update(e.env_errors)
        out["env_errors"] = sum(failures.values()) / n
        out.update({f"env_errors/{kind}": failures[kind] / n for kind in ENV_ERROR_KINDS})
    return out


@dataclass(frozen=True)
class PlayedSample:
    """One evaluated episode (`EpisodeRunner.play`), in the shape `astrai.evaluation.accuracy.evaluate` scores.

    Attributes:
        completion: what the reward functions receive as the completion (the episode's new messages).
        text: the final answer's text (the results files' response).
        action_ids: the token ids the policy sampled (loss mask 1), in order.
        finished: the policy ended the episode (an answer, max_turns, the environment), not the token budget.
        rewards: the rewards it adds to the reward functions' total, by name (the environment's; None: none).
        turns: the policy's turns; tool_calls, tool_errors: the calls it made and those whose result was an error.
    """

    completion: Any
    text: str
    action_ids: list[int]
    finished: bool
    rewards: dict[str, Optional[float]] = field(default_factory=dict)
    turns: int = 1
    tool_calls: int = 0
    tool_errors: int = 0


class EpisodeRunner:
    """The online train types' runner when `rollout.tools` or `rollout.environment` is set: `RolloutRunner`'s
    interface (`sample`, `collect`, `add_reference`, `truncated_fraction`, `engine`), each sample a multi-turn
    episode (`run_episodes`) from its prompt record's conversation (`data.system_prompt`, then the stored prompt as
    the user turn, or the stored chat); on the streaming API of the engine when it has one (`streams`).

    Args:
        runner: the single-turn runner whose engine, sampling settings, reference model and score function it uses;
            the score function receives each episode's new messages as its completion (TRL's convention).
        tokenizer: the policy's; tools, executor, limits: as `run_episodes`'s; system_prompt: `data.system_prompt`.
        environment: the job's environment classes (None: none); prompt_field: `data.prompt_field` (the key of
            the stored prompt in the row a reset receives); on_error, error_score: `reward.on_error` and
            `reward.error_score`, for an environment reward that failed. The environment's reward is added to the
            total with weight 1 and kept as the reward component `ENVIRONMENT_REWARD`.
        deterministic: `runtime.deterministic`: run turn-synchronously even on a streaming engine. On the
            streaming path the moment a tool's result joins the running batch depends on timing, and a row's
            log-probs depend on the batch it is computed in by rounding (about 1e-6 in float32), so a run, or its
            resume, is reproducible to that rounding only; the turn-synchronous path is bitwise.

    Raises:
        ValueError: from construction, as `check_episodes` (the template, the stop token, the length limit).
    """

    def __init__(self, runner, tokenizer, tools: Sequence[Tool], executor: ToolExecutor, limits: EpisodeLimits, *,
                 system_prompt: Optional[str] = None, environment: Optional[EpisodeEnvironment] = None,
                 prompt_field: str = "question", on_error: str = "score", error_score: float = 0.0,
                 deterministic: bool = False):
        self.runner, self.tokenizer, self.tools, self.executor = runner, tokenizer, list(tools), executor
        self.streaming = False if deterministic else None  # None: on the streaming API when the engine has one
        self.limits, self.system_prompt, self.environment = limits, system_prompt, environment
        self.prompt_field, self.on_error, self.error_score = prompt_field, on_error, error_score
        self._said_cut = False  # the once-note on tool results cut by max_tool_response_tokens

    @property
    def engine(self):
        """The single-turn runner's engine."""
        return self.runner.engine

    @property
    def sampling(self) -> SamplingParams:
        """The single-turn runner's sampling settings (`max_new_tokens`: each episode's whole budget)."""
        return self.runner.sampling

    def generate_agreed(self, generate: Callable[[], Any]) -> Any:
        """As `RolloutRunner.generate_agreed` (non-finite logits on any rank stop every rank)."""
        return self.runner.generate_agreed(generate)

    def count_truncated(self, experience: Experience) -> Experience:
        """As `RolloutRunner.count_truncated`."""
        return self.runner.count_truncated(experience)

    def conversation(self, record) -> list[dict[str, Any]]:
        """The first messages of `record`'s episode."""
        prompt = record.prompt
        if isinstance(prompt, list):
            messages = [dict(m) for m in prompt]
        else:
            messages = [{"role": "user", "content": str(prompt)}]
        if self.system_prompt is not None and messages[0].get("role") != "system":
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages

    def sample(self, prompt_ids, records, generator: Optional[torch.Generator] = None) -> Experience:
        """One episode per record (`prompt_ids`, the single-turn renderings, are not used), scored; stats: the
        `episode_metrics` (as `episodes/<name>`) and `truncated_fraction`."""
        start = time.perf_counter()
        env = self.environment
        routed = [env.route_and_row(r, self.prompt_field) for r in records] if env is not None else []
        episodes = self.runner.generate_agreed(lambda: run_episodes(  # non-finite logits: every rank stops
            self.runner.engine, self.tokenizer, [self.conversation(r) for r in records], self.tools, self.executor,
            self.runner.sampling, self.limits, generator, environment=env,
            routes=[route for route, _ in routed] or None, rows=[row for _, row in routed] or None,
            streaming=self.streaming))
        return self.scored(episodes, records, {"generate": time.perf_counter() - start})

    def open(self, records: Sequence[Any]) -> list[Episode]:
        """The episodes of `records` before their first turn (with an environment, each instance created and reset
        with its row), for a partial rollout to advance (`advance`)."""
        env = self.environment
        routed = [env.route_and_row(r, self.prompt_field) for r in records] if env is not None else []
        return _open_episodes(self.tokenizer, [self.conversation(r) for r in records], self.tools,
                              self.runner.sampling, env, [route for route, _ in routed] or None,
                              [row for _, row in routed] or None)

    def advance(self, episodes: list[Episode], generator: Optional[torch.Generator],
                until: Callable[[], bool]) -> None:
        """Advance `episodes` (opened by `open`, some perhaps mid-turn) on the engine's streaming API until
        `until()` holds or every one has ended (`_streamed_turns` with `until`); deterministic (`runtime.
        deterministic`): each step's tool calls and environment steps are waited for before the next step, so the
        run is bitwise reproducible. The environment's end of the episodes that ended is the caller's (`end`).

        Raises:
            ValueError: an engine without the streaming API (or tensor-parallel).
        """
        if not streams(self.engine):
            raise ValueError(f"rollout.partial: multi-turn episodes need an engine with the streaming API and no "
                             f"tensor parallelism, and {type(self.engine).__name__} is not one")
        _streamed_turns(self.engine, self.tokenizer, episodes, self.executor, self.runner.sampling, self.limits,
                        generator, self.environment, until=until, blocking=self.streaming is False)

    def end(self, episodes: Sequence[Episode]) -> None:
        """With an environment, the end of `episodes` (all ended): get_reward and close of their instances, their
        failures counted (`EpisodeEnvironment.finish`)."""
        if self.environment is not None and episodes:
            self.environment.finish(episodes)

    def abandon(self, episodes: Sequence[Episode]) -> None:
        """With an environment, close the instances of `episodes` that will not go on (best effort)."""
        if self.environment is not None and episodes:
            self.environment.abandon(episodes)

    def restore(self, episodes: Sequence[Episode], record: Any) -> None:
        """Episodes of `record` loaded from a checkpoint (`astrai.experience.partial_episodes`): the tools each
        offers, and with an environment, for those still running, a new instance reset with the record's row and
        brought to where the episode left it by replaying, in order, the calls of its methods and the steps its
        turns made (each turn read again from its tokens; results dropped). Failures are counted as in a run: a
        reset that fails leaves the episode to end after its turn in progress (or its next one) with "env_error"; a
        replayed step that ends it, or a replayed call that fails, ends it now (its turn in progress dropped)."""
        env = self.environment
        for e in episodes:
            e.tools = list(self.tools) + (list(env.tools[e.env_route]) if env is not None else [])
        running = [e for e in episodes if not e.done]
        if env is None or not running:
            return
        route, row = env.route_and_row(record, self.prompt_field)
        for e, reply in zip(running, env.start(running, [route] * len(running), [row] * len(running))):
            if not reply.ok:  # as at an episode's start: it goes on to the end of its turn, then ends (env_error)
                env.fail(e, "lost" if env.pool.lost(e.env_key) else "reset", reply.value, reply.trace, call="reset")
        for turn in range(max((len(e.turn_starts) for e in running), default=0)):
            calling, stepping = [], []
            for e in (e for e in running if turn < len(e.turn_starts) and e.ended_by is None and not e.env_errors):
                end = e.turn_starts[turn + 1] if turn + 1 < len(e.turn_starts) else len(e.response_ids)
                sampled = [t for t, m in zip(e.response_ids[e.turn_starts[turn]:end],
                                             e.loss_mask[e.turn_starts[turn]:end]) if m]
                message, calls, errors = _parse_turn(self.tokenizer, e, sampled)  # as the run read it
                if calls or errors:
                    calling += [(e, c) for c in _split_calls(e, calls, self.limits, env)[1]]
                elif env.steps.get(e.env_route):
                    stepping.append((e, message))
            if calling:
                env.call_tools(calling)
            if stepping:
                env.step([e for e, _ in stepping], [m for _, m in stepping])
        for e in running:
            if e.done:  # the replay ended it (its step said so, or a call failed): its turn in progress is dropped
                e.pending_ids, e.pending_logprobs, e.pending_versions = [], [], []

    def scored(self, episodes: Sequence[Episode], records: Sequence[Any], timings: dict[str, float]) -> Experience:
        """Ended `episodes` (one per record of `records`) scored by the reward functions (and the environment's
        reward) into a batch on the engine's device; `timings` gains "reward"; stats: the `episode_metrics` (as
        `episodes/<name>`) and `truncated_fraction`. The tools' calls since the last rollout are counted first
        (`ToolExecutor.account`).

        Raises:
            astrai.experience.tool_executor.ToolFailure: a tool failed on every call over several rollouts.
        """
        env = self.environment
        self.executor.account()
        start = time.perf_counter()
        scored = self.runner.score_fn([e.completion for e in episodes], list(records),
                                      [[t for t, m in zip(e.response_ids, e.loss_mask) if m] for e in episodes])
        timings["reward"] = time.perf_counter() - start
        components = dict(getattr(scored, "components", {}))
        failed = dict(getattr(scored, "failed", {}))
        scores = torch.as_tensor(getattr(scored, "total", scored), dtype=torch.float32).tolist()
        if env is not None and env.has_reward:  # the environment's reward: one more weight-1 reward, TRL's rule
            values = self.environment_rewards(episodes)
            scores = [s + (0.0 if math.isnan(v) else v) for s, v in zip(scores, values)]
            components[ENVIRONMENT_REWARD] = torch.tensor(values, dtype=torch.float32)
            failed[ENVIRONMENT_REWARD] = torch.tensor([e.env_reward_failed for e in episodes], dtype=torch.bool)
        trajectories = [e.trajectory(score=scores[i],
                                     reward_components={k: (None if math.isnan(v[i]) else float(v[i]))
                                                        for k, v in components.items()},
                                     reward_failed={k: bool(v[i]) for k, v in failed.items()})
                        for i, e in enumerate(episodes)]
        stats = {f"episodes/{k}": v for k, v in episode_metrics(episodes).items()}
        self._say_cut(episodes)
        experience = Experience.from_trajectories(trajectories, pad_token_id=self.engine.pad_token_id,
                                                  device=self.engine.device, timings=timings, stats=stats)
        experience = dataclasses.replace(experience, routes=self.runner.routes_of(records))  # distill.teachers
        return self.runner.count_truncated(experience)

    def _say_cut(self, episodes: Sequence[Episode]) -> None:
        """The first time `max_tool_response_tokens` cut a tool result, a warning says how many (once per runner)."""
        cut = sum(e.tool_results_cut for e in episodes)
        if cut and not self._said_cut:
            self._said_cut = True
            results = sum(sum(e.tool_calls.values()) for e in episodes)
            warnings.warn(f"rollout.max_tool_response_tokens ({self.limits.max_tool_response_tokens}) cut {cut} of "
                          f"{results} tool results of this rollout: the policy read them shortened (marked "
                          f"'[... cut to ...]'); raise it unless that is meant (rollout/episodes/tool_results_cut "
                          f"counts it on every rollout; said once)", stacklevel=3)

    @property
    def reward_names(self) -> tuple[str, ...]:
        """The rewards its episodes add to the reward functions' (`ENVIRONMENT_REWARD` when an environment class
        has `get_reward`)."""
        env = self.environment
        return (ENVIRONMENT_REWARD,) if env is not None and env.has_reward else ()

    def play(self, records: Sequence[Any], sampling: SamplingParams,
             generator: Optional[torch.Generator] = None) -> list[PlayedSample]:
        """One unscored episode per record with `sampling` (an evaluation's settings, not the rollout's): what the
        evaluator scores (`astrai.evaluation.accuracy.evaluate`'s `player`). No agreement across ranks: ranks
        evaluate different numbers of questions.

        Returns:
            per record a `PlayedSample`: the episode's new messages (the reward functions' completion), its final
            answer's text, the tokens the policy sampled, whether the policy ended it (not the token budget), and
            the environment's reward (NaN-free: None where it does not apply or failed).
        """
        env = self.environment
        routed = [env.route_and_row(r, self.prompt_field) for r in records] if env is not None else []
        episodes = run_episodes(self.runner.engine, self.tokenizer, [self.conversation(r) for r in records],
                                self.tools, self.executor, sampling, self.limits, generator, environment=env,
                                routes=[route for route, _ in routed] or None, rows=[row for _, row in routed] or None,
                                streaming=self.streaming)
        rewards = self.environment_rewards(episodes) if self.reward_names else [math.nan] * len(episodes)
        return [PlayedSample(completion=e.completion, text=e.text,
                             action_ids=[t for t, m in zip(e.response_ids, e.loss_mask) if m],
                             finished=e.ended_by not in ("length", "budget"),
                             rewards={name: None if math.isnan(r) else r for name in self.reward_names},
                             turns=len(e.turn_starts), tool_calls=sum(e.tool_calls.values()),
                             tool_errors=sum(e.tool_errors.values()))
                for e, r in zip(episodes, rewards)]

    def environment_rewards(self, episodes: Sequence[Episode]) -> list[float]:
        """Per episode its environment reward: get_reward's value; NaN where its class has none (it does not
        apply), and for a failure ``reward.error_score`` (``reward.on_error: score``) or NaN (``skip``)."""
        failed = self.error_score if self.on_error == "score" else math.nan
        return [failed if e.env_reward_failed else math.nan if e.env_reward is None else e.env_reward
                for e in episodes]

    def collect(self, prompt_ids, records, generator: Optional[torch.Generator] = None) -> Experience:
        """`sample`, then the reference log-probs (`add_reference`)."""
        return self.add_reference(self.sample(prompt_ids, records, generator))

    def add_reference(self, experience: Experience) -> Experience:
        """As `RolloutRunner.add_reference`."""
        return self.runner.add_reference(experience)

    def truncated_fraction(self, experience: Experience) -> float:
        """As `RolloutRunner.truncated_fraction`: episodes whose last turn the budget cut."""
        return self.runner.truncated_fraction(experience)

    def close(self) -> None:
        """End the tool and environment workers."""
        self.executor.close()
        if self.environment is not None:
            self.environment.close()


def check_episodes(tokenizer, tools: Sequence[Tool], sampling: SamplingParams, *, max_prompt_length: int,
                   max_position_embeddings: int, with_user_turn: bool = False, where: str = "rollout.tools") -> None:
    """The start-up checks of a job with tools (or an environment; `where` names the setting): the tokenizer has a
    chat template that preserves prefixes (`astrai.agents.chat.check_prefix_preserving`; `with_user_turn`: also
    across an injected user turn, as an environment's step appends), its end-of-turn token stops the sampler, and
    `data.max_prompt_length` plus the tools' share of the prompt plus `rollout.max_new_tokens` fits the model.

    Raises:
        ValueError: one line naming the setting (TemplatePrefixError for the template).
    """
    if not tokenizer.chat_template:
        raise ValueError(f"{where}: multi-turn episodes need the tokenizer's chat template, and it has none")
    check_prefix_preserving(tokenizer, tools, with_user_turn=with_user_turn)
    end_token, _ = turn_end(tokenizer, tools)
    if tokenizer.token_to_id(end_token) not in sampling.stop_token_ids:
        raise ValueError(f"{where}: the chat template ends a turn with {end_token!r}, which is not a stop token "
                         f"of the model (its eos ids {list(sampling.stop_token_ids)})")
    probe = [{"role": "user", "content": "?"}]
    overhead = len(tokenizer.encode(render(tokenizer, probe, tools))) - len(tokenizer.encode(render(tokenizer, probe)))
    need = max_prompt_length + max(overhead, 0) + sampling.max_new_tokens
    if need > max_position_embeddings:
        raise ValueError(f"{where}: data.max_prompt_length ({max_prompt_length}) + the tools' schemas in the "
                         f"prompt ({overhead} tokens) + rollout.max_new_tokens ({sampling.max_new_tokens}) = {need} "
                         f"exceeds max_position_embeddings ({max_position_embeddings})")
