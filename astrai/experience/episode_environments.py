"""The environment side of multi-turn episodes (`rollout.environment`): what `astrai.experience.episodes.run_episodes`
asks of each episode's instance at each phase, and how failures end episodes and are counted.

Per episode (docs/agents.md, "Environments"): the instance is created and reset with the row before the first turn
(`start`, `first_messages`); a tool call naming one of its methods runs on it (`call_tools`); an assistant turn that
calls no tool goes to its ``step`` when the class has one (`step`); once the episode is over, ``get_reward`` (when
defined and nothing failed) and ``close`` (always) run (`finish`), and the rollout's failures are counted against the
stop rule (`astrai.experience.environments.EnvironmentFailures`).

Failures: a reset, a step or a get_reward that raises, returns the wrong kind of value or times out; a tool method
that times out; an instance lost with its worker; a close that raises. Each is counted per episode by kind
(``env_errors/<kind>``: reset, step, call, get_reward, close, lost), warned about once per kind with the user's
traceback, and ends the episode ("env_error") when it happens before its end: no observation is appended (no
policy turn would follow it). A reset that fails leaves the row's prompt, so the episode still samples its first turn
(the batch keeps G samples per prompt) and then ends. A tool method that raises is no failure of the environment
(TRL's convention): its error is that call's result, which the model reads, counted in ``tool_errors/<method>``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

from astrai.agents.environments import (EnvironmentSpec, environment_tools, is_single, load_environment_class)
from astrai.agents.tool_calls import ToolCall, argument_problem
from astrai.agents.tools import Tool
from astrai.experience.environments import EnvironmentFailures, EnvironmentPool, Reply, Request

__all__ = ["EpisodeEnvironment", "ENV_ERROR_KINDS"]

ENV_ERROR_KINDS = ("reset", "step", "call", "get_reward", "close", "lost")
"""The kinds of environment failure counted per episode (`rollout/episodes/env_errors/<kind>`)."""


@dataclass
class EpisodeEnvironment:
    """The job's environment classes for episodes: their instances (`pool`), tools and protocol per route.

    Attributes:
        pool: holds the instances (worker processes or this one).
        tools: route -> the class's public methods as tools (`environment_tools`).
        steps: route -> whether the class has ``step``; rewards: route -> whether it has ``get_reward``.
        names: route -> the class name (for messages).
        failures: the stop rule and the warn-once of failures.
        routed_by: the column routing rows to classes (None: one class for every row).
        max_prompt_tokens: the most tokens the first messages may render to (the model's positions left after the
            response budget); None: unchecked.
    """

    pool: EnvironmentPool
    tools: Mapping[Optional[str], Sequence[Tool]]
    steps: Mapping[Optional[str], bool]
    rewards: Mapping[Optional[str], bool]
    names: Mapping[Optional[str], str]
    failures: EnvironmentFailures = field(default_factory=EnvironmentFailures)
    routed_by: Optional[str] = None
    max_prompt_tokens: Optional[int] = None

    @classmethod
    def load(cls, specs: Sequence[EnvironmentSpec], *, num_workers: int, timeout_seconds: float,
             routed_by: Optional[str] = None, failures: Optional[EnvironmentFailures] = None,
             max_prompt_tokens: Optional[int] = None,
             should_stop: Optional[Callable[[], bool]] = None) -> "EpisodeEnvironment":
        """Load and check the classes of `specs` in this process (schemas, protocol) and start their pool
        (`should_stop`: the trainer's stop requests, which interrupt its calls: `EnvironmentPool`).

        Raises:
            EnvironmentClassError: one line naming the entry.
        """
        classes = {spec.route: load_environment_class(spec) for spec in specs}
        return cls(pool=EnvironmentPool(specs, num_workers=num_workers, timeout_seconds=timeout_seconds,
                                        should_stop=should_stop),
                   tools={spec.route: environment_tools(spec, classes[spec.route]) for spec in specs},
                   steps={r: callable(getattr(c, "step", None)) for r, c in classes.items()},
                   rewards={r: callable(getattr(c, "get_reward", None)) for r, c in classes.items()},
                   names={r: c.__name__ for r, c in classes.items()}, failures=failures or EnvironmentFailures(),
                   routed_by=routed_by, max_prompt_tokens=max_prompt_tokens)

    @property
    def has_reward(self) -> bool:
        """Whether any class defines ``get_reward`` (then the episodes carry an environment reward)."""
        return any(self.rewards.values())

    def route_and_row(self, record: Any, prompt_field: str) -> tuple[Optional[str], dict[str, Any]]:
        """The route of a prompt record (its routing column's value, None for one class) and the row its reset
        receives: the stored prompt under `prompt_field` and every other column, the routing column left out."""
        row = {prompt_field: record.prompt, **record.columns}
        if self.routed_by is None:
            return None, row
        route = row.pop(self.routed_by, None)
        return (None if route is None else str(route)), row

    def start(self, episodes: Sequence[Any], routes: Sequence[Optional[str]], rows: Sequence[Mapping[str, Any]]
              ) -> list[Reply]:
        """Create and reset one instance per episode (keys assigned to `episodes`); the replies, in order."""
        keys = self.pool.new_keys(len(episodes))
        for e, key, route in zip(episodes, keys, routes):
            e.env_key, e.env_route = key, route
        return self.pool.run([Request("reset", k, (r, dict(row))) for k, r, row in zip(keys, routes, rows)])

    @staticmethod
    def first_messages(conversation: list[dict[str, Any]], observation: Any) -> list[dict[str, Any]]:
        """The episode's first messages after its reset returned `observation` (checked): None keeps
        `conversation`; a string is appended to its last user message (a new user message when the last is not
        one); a list of messages replaces it, after `conversation`'s leading system message when the list has
        none."""
        if observation is None:
            return conversation
        if isinstance(observation, str):
            if conversation and conversation[-1].get("role") == "user":
                last = conversation[-1]
                return conversation[:-1] + [{**last, "content": (last.get("content") or "") + observation}]
            return conversation + [{"role": "user", "content": observation}]
        system = [conversation[0]] if conversation and conversation[0].get("role") == "system" else []
        return ([] if observation[0].get("role") == "system" else system) + [dict(m) for m in observation]

    def fail(self, e: Any, kind: str, text: str, trace: Optional[str] = None, call: Optional[str] = None) -> None:
        """Count a failure of `kind` on episode `e` (the first one's text kept), warned about once per kind. `call`
        (reset, step, get_reward, a method's name) is the call that failed, which the message names (the kind
        ``lost`` is a counter, not a call); without one, a ``lost`` instance is said as `text` alone."""
        e.env_errors[kind] += 1
        what = call or (None if kind == "lost" else kind)
        e.env_error = e.env_error or f"{what or kind}: {text}"
        self.failures.warn_once(kind, f"{self.names.get(e.env_route, 'the environment')}: "
                                f"{f'{what} failed: {text}' if what else text}",
                                trace, f"rollout/episodes/env_errors/{kind}")

    def call_tools(self, pairs: Sequence[tuple[Any, ToolCall]]) -> dict[int, tuple[str, Optional[str]]]:
        """Run the calls of environment methods in `pairs` ((episode, call)) on each episode's instance: by
        ``id(call)``, (result text, error text or None). A call whose reply is fatal (a timeout, a lost instance)
        ends its episode ("env_error"; its results are then not appended)."""
        out: dict[int, tuple[str, Optional[str]]] = {}
        requests, asked = [], []
        for e, call in pairs:
            tool = next(t for t in self.tools[e.env_route] if t.name == call.name)
            problem = argument_problem(tool, call.arguments)
            if problem is not None:
                out[id(call)] = (problem, problem)
            elif e.ended_by is None:
                requests.append(Request("call", e.env_key, (call.name, dict(call.arguments))))
                asked.append((e, call))
        for (e, call), reply in zip(asked, self.pool.run(requests)):
            if reply.ok:
                out[id(call)] = (reply.value, None)
            elif reply.fatal:
                out[id(call)] = (f"Error: {reply.value}", f"Error: {reply.value}")
                if e.ended_by is None:
                    self.fail(e, "lost" if self.pool.lost(e.env_key) and "timed out" not in reply.value else "call",
                              reply.value, reply.trace, call=call.name)
                    e.ended_by = "env_error"
            else:
                text = f"Error: {reply.value}"
                out[id(call)] = (text, text)
                self.failures.warn_once(f"method {call.name}", f"{self.names.get(e.env_route)}.{call.name} raised "
                                        f"{reply.value} (its result, which the model reads)", reply.trace,
                                        f"rollout/episodes/tool_errors/{call.name}")
        return out

    def step(self, episodes: Sequence[Any], messages: Optional[Sequence[Mapping[str, Any]]] = None
             ) -> list[Optional[list[dict[str, Any]]]]:
        """Call ``step`` of each episode's instance with its last (assistant) message (or its entry of `messages`,
        as a replay gives them): per episode the observation messages, or None when the episode ended (the
        environment ended it: ended_by "environment"; or it failed: "env_error")."""
        messages = messages if messages is not None else [e.messages[-1] for e in episodes]
        replies = self.pool.run([Request("step", e.env_key, dict(m)) for e, m in zip(episodes, messages)])
        out = []
        for e, reply in zip(episodes, replies):
            if not reply.ok:
                self.fail(e, "lost" if self.pool.lost(e.env_key) else "step", reply.value, reply.trace, call="step")
                e.ended_by = "env_error"
                out.append(None)
            elif reply.value is None:
                e.ended_by = "environment"
                out.append(None)
            else:
                out.append(reply.value)
        return out

    def end_lost(self, episodes: Sequence[Any]) -> None:
        """End the running episodes whose instance went with its worker (a call of another episode hung)."""
        for e in episodes:
            why = self.pool.lost(e.env_key) if e.env_key is not None else None
            if why is not None and e.ended_by is None:
                self.fail(e, "lost", why)
                e.ended_by = "env_error"

    def finish(self, episodes: Sequence[Any]) -> None:
        """The end of every episode: ``get_reward`` where the class has one and the episode met no failure (its
        value in ``env_reward``; a failure marks ``env_reward_failed``), then ``close`` of every instance; then the
        rollout's failures are counted (`EnvironmentFailures.account`, which may stop the job)."""
        scored = [e for e in episodes if self.rewards.get(e.env_route)]
        asked = [e for e in scored if not e.env_errors]
        for e in scored:
            e.env_reward_failed = bool(e.env_errors)
        for e, reply in zip(asked, self.pool.run([Request("reward", e.env_key) for e in asked])):
            if reply.ok:
                e.env_reward = reply.value
            else:
                e.env_reward_failed = True
                self.fail(e, "lost" if self.pool.lost(e.env_key) else "get_reward", reply.value, reply.trace,
                          call="get_reward")
        for e, reply in zip(episodes, self.pool.run([Request("close", e.env_key) for e in episodes])):
            if not reply.ok:
                self.fail(e, "close", reply.value, reply.trace, call="close")
        failed = [e for e in episodes if e.env_errors]
        self.failures.account(len(failed), len(episodes), failed[0].env_error if failed else None)

    def abandon(self, episodes: Sequence[Any]) -> None:
        """Close the instances of `episodes` when the loop stops on an error of its own (best effort: a failure
        here is not reported over the error that stopped it)."""
        try:
            self.pool.run([Request("close", e.env_key) for e in episodes if e.env_key is not None])
        except Exception:  # noqa: BLE001 - the error in flight is the one to see
            pass

    def close(self) -> None:
        """End the worker processes."""
        self.pool.close()


def routes_of(value: Any) -> Optional[list[str]]:
    """The route names of a ``rollout.environment`` value, None for a single class."""
    return None if is_single(value) else [str(k) for k in value]
