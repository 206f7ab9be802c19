"""Multi-turn episodes with tools: the policy samples a turn, its tool calls run, their results are appended, and so
on until it answers, a cap ends the episode, or the token budget runs out. Token-in, token-out.

Per episode (all episodes of a batch advance together, one engine call per turn; `astrai.agents.chat` has the
rendering rules):

1. the prompt: the first messages rendered with the tools (in the template's ``tools`` variable when it has one,
   else listed in the system turn, Hermes format) and the generation prompt;
2. a turn: the engine continues the episode's ids (prompt + everything so far; the paged engine's prefix cache
   reuses the KV of earlier turns) for at most the budget left; the sampled ids are appended verbatim with loss
   mask 1, their behaviour log-probs and the engine's `policy_version`;
3. the turn's text is parsed for ``<tool_call>`` blocks (`astrai.agents.tool_calls.parse_tool_calls`); none: the
   episode ends ("answer"); at `EpisodeLimits.max_turns`: it ends ("max_turns"); else the calls run
   (`ToolExecutor`, at most `max_parallel_tool_calls` of them, each result cut to `max_tool_response_tokens`) and
   the results, rendered as the template renders them (`astrai.agents.chat.suffix_ids`: the separator after the
   end of turn, then the tool messages and the next generation prompt) are appended with loss mask 0;
4. a turn the budget cut before its end-of-turn token ends the episode ("length"); results that would leave no
   room for another token end it too ("budget"), not appended.

The budget is the response side of the sequence, `SamplingParams.max_new_tokens` (`rollout.max_new_tokens`): every
turn and every tool result together, so the start-up check of prompt + response length against the model's
position limit holds for episodes as for single turns. What the reward sees of an episode is its new messages (the
assistant turns and tool results, TRL's convention for conversational completions): the last message's content is
the final answer.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import torch

from astrai.agents.chat import check_prefix_preserving, render, suffix_ids, turn_end
from astrai.agents.tool_calls import (ToolCall, ToolCallError, argument_problem, call_tool, parse_tool_calls,
                                      result_text, template_supports_tools)
from astrai.agents.tools import Tool
from astrai.experience.trajectory import NOT_SAMPLED, Experience, Trajectory
from astrai.rewards.workers import RewardFunctionSpec, RewardWorkerPool
from astrai.rollout.sampling import SamplingParams

__all__ = ["EpisodeLimits", "Episode", "EpisodeRunner", "ToolExecutor", "check_episodes", "run_episodes",
           "episode_metrics", "tool_references", "ENDINGS"]

ENDINGS = ("answer", "max_turns", "length", "budget")
"""Why an episode ended: the policy answered without a tool call, `max_turns` turns were sampled, a turn was cut by
the budget before its end of turn, or the tool results would have left no room for another token."""


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
        ended_by: one of `ENDINGS`, None while it runs.
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
    ended_by: Optional[str] = None

    @property
    def completion(self) -> list[dict[str, Any]]:
        """The episode's new messages, what reward functions receive as its completion."""
        return self.messages[self.first:]

    @property
    def text(self) -> str:
        """The final assistant message's content (the answer the single-turn rewards read)."""
        return next((m.get("content") or "" for m in reversed(self.messages) if m.get("role") == "assistant"), "")

    def trajectory(self, **scored: Any) -> Trajectory:
        """The episode as a `Trajectory` (`scored`: score, reward_components, reward_failed)."""
        return Trajectory(prompt_ids=tuple(self.prompt_ids), response_ids=tuple(self.response_ids),
                          loss_mask=tuple(self.loss_mask), logprobs=tuple(self.logprobs),
                          policy_versions=tuple(self.policy_versions), text=self.text,
                          turn_starts=tuple(self.turn_starts), metadata={"ended_by": self.ended_by}, **scored)

    def _append(self, ids: Sequence[int], *, sampled: bool, logprobs: Sequence[float] = (), version: int = 0):
        self.response_ids += list(ids)
        self.loss_mask += [sampled] * len(ids)
        self.logprobs += list(logprobs) if sampled else [0.0] * len(ids)
        self.policy_versions += [version if sampled else NOT_SAMPLED] * len(ids)


class ToolExecutor:
    """Runs tool calls: in `num_workers` worker processes with a hard `timeout_seconds` per call
    (`astrai.rewards.workers.RewardWorkerPool`, loading each tool by its reference), or with `num_workers` 0 in this
    process (no timeout). Arguments are checked against the tool's signature and schema here first. Never raises on
    a call: a bad argument, an exception, a timeout or a dead worker is the error text the model sees.

    Args:
        tools: the loaded tools (schemas, and the callables for in-process calls).
        references: per tool, the (function, path) it was loaded from, for the workers; None: in process only.
    """

    def __init__(self, tools: Sequence[Tool], references: Optional[Sequence[tuple[str, Optional[str]]]] = None, *,
                 num_workers: int = 1, timeout_seconds: float = 30.0):
        self.tools = {tool.name: tool for tool in tools}
        self._index = {tool.name: i for i, tool in enumerate(tools)}
        self.pool = None
        if references is not None and num_workers > 0:
            specs = [RewardFunctionSpec(name=tool.name, function=function, index=i, path=path)
                     for i, (tool, (function, path)) in enumerate(zip(tools, references))]
            self.pool = RewardWorkerPool(specs, num_workers=num_workers, timeout_seconds=timeout_seconds,
                                         timeout_setting="rollout.tool_timeout_seconds")

    def run(self, calls: Sequence[ToolCall]) -> list[tuple[str, Optional[str]]]:
        """(result text, error text or None) per call, in order."""
        if self.pool is None:
            return [call_tool(self.tools[c.name], c.arguments) for c in calls]
        out: list[Optional[tuple[str, Optional[str]]]] = [None] * len(calls)
        pending: dict[str, list[int]] = {}
        for k, c in enumerate(calls):
            problem = argument_problem(self.tools[c.name], c.arguments)
            if problem is not None:
                out[k] = (problem, problem)
            else:
                pending.setdefault(c.name, []).append(k)
        width = self.pool.num_workers
        for name, ks in pending.items():
            for start in range(0, len(ks), width):
                chunk = ks[start:start + width]
                for k, (status, value, _) in zip(chunk, self.pool.run(self._index[name],
                                                                      [calls[k].arguments for k in chunk])):
                    if status == "ok":
                        out[k] = (result_text(value), None)
                    else:
                        text = f"Error: {value}"
                        out[k] = (text, text)
        return out

    def close(self) -> None:
        """End the worker processes (idempotent)."""
        if self.pool is not None:
            self.pool.close()


def run_episodes(engine, tokenizer, conversations: Sequence[Sequence[Mapping[str, Any]]], tools: Sequence[Tool],
                 executor: ToolExecutor, sampling: SamplingParams, limits: EpisodeLimits,
                 generator: Optional[torch.Generator] = None) -> list[Episode]:
    """Run one episode per conversation (module docstring) and return them, ended.

    Args:
        engine: a `GenerationEngine`; tokenizer: the policy's (`astrai.models.Tokenizer`, with a chat template).
        conversations: each episode's first messages ([{"role", "content"}, ...], the last the user's).
        tools: the tools offered (their schemas rendered into the prompt); executor: runs their calls.
        sampling: the sampling settings; its `max_new_tokens` is each episode's whole response budget and its
            `stop_token_ids` must hold the template's end-of-turn token.
        limits: the episode caps.

    Raises:
        ValueError: the end-of-turn token of the template is not a stop token (a turn would never end), or a
            rendered prompt is empty. `astrai.agents.chat.TemplatePrefixError`: the template rewrites earlier
            turns.
    """
    end_token, _ = turn_end(tokenizer, tools)
    end_id = tokenizer.token_to_id(end_token)
    if end_id not in sampling.stop_token_ids:
        raise ValueError(f"multi-turn episodes: the chat template ends a turn with {end_token!r} (id {end_id}), "
                         f"which is not a stop token of the sampler {list(sampling.stop_token_ids)}")
    native = template_supports_tools(tokenizer.chat_template or "")
    names = [tool.name for tool in tools]
    episodes = []
    for conversation in conversations:
        messages = [dict(m) for m in conversation]
        ids = tokenizer.encode(render(tokenizer, messages, tools, add_generation_prompt=True))
        if not ids:
            raise ValueError("multi-turn episodes: a prompt renders to no tokens")
        episodes.append(Episode(prompt_ids=ids, messages=messages, first=len(messages)))
    budget = sampling.max_new_tokens
    for turn in range(limits.max_turns):
        active = [e for e in episodes if e.ended_by is None]
        if not active:
            break
        params = [dataclasses.replace(sampling, max_new_tokens=budget - len(e.response_ids)) for e in active]
        generation = engine.generate([e.prompt_ids + e.response_ids for e in active], params, generator)
        rows = zip(generation.response_ids.tolist(), generation.action_mask.tolist(),
                   generation.old_logprobs.tolist(), generation.finished.tolist())
        calling = []
        for e, (ids, mask, logprobs, finished) in zip(active, rows):
            sampled = [t for t, m in zip(ids, mask) if m]
            e.turn_starts.append(len(e.response_ids))
            e._append(sampled, sampled=True, logprobs=[lp for lp, m in zip(logprobs, mask) if m],
                      version=generation.policy_version)
            text = tokenizer.decode(sampled, skip_special_tokens=True)
            content, calls, errors = parse_tool_calls(text, names)
            message: dict[str, Any] = {"role": "assistant", "content": content if native else text}
            if native and calls:
                message["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                         for c in calls]
            e.messages.append(message)
            if not finished:
                e.ended_by = "length"
            elif not calls and not errors:
                e.ended_by = "answer"
            elif turn == limits.max_turns - 1:
                e.ended_by = "max_turns"
            else:
                calling.append((e, calls, errors))
        _answer_calls(tokenizer, calling, tools, executor, limits, budget)
    for e in episodes:
        e.ended_by = e.ended_by or "max_turns"
    return episodes


def _answer_calls(tokenizer, calling, tools, executor: ToolExecutor, limits: EpisodeLimits, budget: int) -> None:
    """Run the calls of every episode in `calling` ((episode, calls, errors) triples) and append their results."""
    runnable, over = [], {}
    for e, calls, errors in calling:
        for c in calls[limits.max_parallel_tool_calls:]:
            over[id(c)] = (f"Error: at most {limits.max_parallel_tool_calls} tool calls run per turn "
                           f"(rollout.max_parallel_tool_calls); this one did not")
        runnable += calls[:limits.max_parallel_tool_calls]
    results = dict(zip(map(id, runnable), executor.run(runnable)))
    for e, calls, errors in calling:
        items: list[ToolCall | ToolCallError] = sorted([*calls, *errors], key=lambda item: item.index)
        tool_messages = []
        for item in items:
            if isinstance(item, ToolCallError):
                text, error = item.message, item.message
            else:
                text, error = results.get(id(item)) or (over[id(item)], over[id(item)])
            e.tool_calls[item.name] += 1
            e.tool_errors[item.name] += error is not None
            tool_messages.append({"role": "tool", "name": item.name or "unknown",
                                  "content": _cut(tokenizer, text, limits)})
        suffix = suffix_ids(tokenizer, e.messages, tool_messages, tools)
        added = suffix.separator_ids + suffix.ids
        if len(e.response_ids) + len(added) >= budget:
            e.ended_by = "budget"
            continue
        e._append(added, sampled=False)
        e.messages += tool_messages


def _cut(tokenizer, text: str, limits: EpisodeLimits) -> str:
    """`text` within `limits.max_tool_response_tokens` tokens: its start ("right") or end ("left") kept, marked."""
    ids = tokenizer.encode_text(text)
    keep = limits.max_tool_response_tokens
    if len(ids) <= keep:
        return text
    if limits.tool_response_truncation == "left":
        return f"[... cut to the last {keep} tokens]" + tokenizer.decode(ids[-keep:])
    return tokenizer.decode(ids[:keep]) + f"[... cut to the first {keep} tokens]"


def episode_metrics(episodes: Sequence[Episode]) -> dict[str, float]:
    """Per-rollout agent metrics: `turns` (mean policy turns per episode), `tool_calls` and `tool_errors` (mean per
    episode, and per tool as `tool_calls/<name>`), `ended/<why>` (the share of episodes per `ENDINGS` entry) and
    `masked_out_fraction` (the share of response tokens with loss mask 0: tool results and separators)."""
    n = max(len(episodes), 1)
    calls, errors = Counter(), Counter()
    for e in episodes:
        calls.update(e.tool_calls)
        errors.update(e.tool_errors)
    tokens = sum(len(e.response_ids) for e in episodes)
    out = {"turns": sum(len(e.turn_starts) for e in episodes) / n, "tool_calls": sum(calls.values()) / n,
           "tool_errors": sum(errors.values()) / n,
           "masked_out_fraction": sum(len(e.loss_mask) - sum(e.loss_mask) for e in episodes) / max(tokens, 1)}
    out.update({f"ended/{why}": sum(e.ended_by == why for e in episodes) / n for why in ENDINGS})
    out.update({f"tool_calls/{name or 'unknown'}": count / n for name, count in calls.items()})
    out.update({f"tool_errors/{name or 'unknown'}": count / n for name, count in errors.items()})
    return out


def tool_references(entries, base_dir: Optional[str] = None) -> list[tuple[Mapping[str, Any], tuple[str, Optional[str]]]]:
    """Per `rollout.tools` entry (`astrai.config.ToolEntry` records): the reference `astrai.agents.tools.load_tools`
    takes ({function, path, name}) and the (function, absolute path or None) a worker loads it by; relative paths
    from `base_dir` (default: the working directory)."""
    base = Path.cwd() if base_dir is None else Path(base_dir)
    out = []
    for entry in entries:
        path = None if entry.path is None else str((base / Path(entry.path).expanduser()).resolve())
        reference = {"function": entry.function, **({"path": path} if path else {}),
                     **({"name": entry.name} if entry.name else {})}
        out.append((reference, (entry.function, path)))
    return out


class EpisodeRunner:
    """The online train types' runner when `rollout.tools` is set: `RolloutRunner`'s interface (`sample`, `collect`,
    `add_reference`, `truncated_fraction`, `engine`), each sample a multi-turn episode (`run_episodes`) from its
    prompt record's conversation (`data.system_prompt`, then the stored prompt as the user turn, or the stored chat).

    Args:
        runner: the single-turn runner whose engine, sampling settings, reference model and score function it uses;
            the score function receives each episode's new messages as its completion (TRL's convention).
        tokenizer: the policy's; tools, executor, limits: as `run_episodes`'s; system_prompt: `data.system_prompt`.

    Raises:
        ValueError: from construction, as `check_episodes` (the template, the stop token, the length limit).
    """

    def __init__(self, runner, tokenizer, tools: Sequence[Tool], executor: ToolExecutor, limits: EpisodeLimits, *,
                 system_prompt: Optional[str] = None):
        self.runner, self.tokenizer, self.tools, self.executor = runner, tokenizer, list(tools), executor
        self.limits, self.system_prompt = limits, system_prompt

    @property
    def engine(self):
        """The single-turn runner's engine."""
        return self.runner.engine

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
        episodes = run_episodes(self.runner.engine, self.tokenizer, [self.conversation(r) for r in records],
                                self.tools, self.executor, self.runner.sampling, self.limits, generator)
        timings = {"generate": time.perf_counter() - start}
        start = time.perf_counter()
        scored = self.runner.score_fn([e.completion for e in episodes], list(records),
                                      [[t for t, m in zip(e.response_ids, e.loss_mask) if m] for e in episodes])
        timings["reward"] = time.perf_counter() - start
        components = getattr(scored, "components", {})
        failed = getattr(scored, "failed", {})
        scores = torch.as_tensor(getattr(scored, "total", scored), dtype=torch.float32).tolist()
        trajectories = [e.trajectory(score=scores[i],
                                     reward_components={k: (None if math.isnan(v[i]) else float(v[i]))
                                                        for k, v in components.items()},
                                     reward_failed={k: bool(v[i]) for k, v in failed.items()})
                        for i, e in enumerate(episodes)]
        stats = {f"episodes/{k}": v for k, v in episode_metrics(episodes).items()}
        experience = Experience.from_trajectories(trajectories, pad_token_id=self.engine.pad_token_id,
                                                  device=self.engine.device, timings=timings, stats=stats)
        return self.runner.count_truncated(experience)

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
        """End the tool workers."""
        self.executor.close()


def check_episodes(tokenizer, tools: Sequence[Tool], sampling: SamplingParams, *, max_prompt_length: int,
                   max_position_embeddings: int) -> None:
    """The start-up checks of a job with tools: the tokenizer has a chat template that preserves prefixes
    (`astrai.agents.chat.check_prefix_preserving`), its end-of-turn token stops the sampler, and
    `data.max_prompt_length` plus the tools' share of the prompt plus `rollout.max_new_tokens` fits the model.

    Raises:
        ValueError: one line naming the setting (TemplatePrefixError for the template).
    """
    if not tokenizer.chat_template:
        raise ValueError("rollout.tools: multi-turn episodes need the tokenizer's chat template, and it has none")
    check_prefix_preserving(tokenizer, tools)
    end_token, _ = turn_end(tokenizer, tools)
    if tokenizer.token_to_id(end_token) not in sampling.stop_token_ids:
        raise ValueError(f"rollout.tools: the chat template ends a turn with {end_token!r}, which is not a stop token "
                         f"of the model (its eos ids {list(sampling.stop_token_ids)})")
    probe = [{"role": "user", "content": "?"}]
    overhead = len(tokenizer.encode(render(tokenizer, probe, tools))) - len(tokenizer.encode(render(tokenizer, probe)))
    need = max_prompt_length + max(overhead, 0) + sampling.max_new_tokens
    if need > max_position_embeddings:
        raise ValueError(f"rollout.tools: data.max_prompt_length ({max_prompt_length}) + the tools' schemas in the "
                         f"prompt ({overhead} tokens) + rollout.max_new_tokens ({sampling.max_new_tokens}) = {need} "
                         f"exceeds max_position_embeddings ({max_position_embeddings})")
