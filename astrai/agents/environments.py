"""Environments: a class whose instance keeps the state of one episode (TRL's ``environment_factory``).

The job names the class as tools and rewards are named (`astrai.imports`): ``rollout.environment:
"my_env:Game"``, or ``{class: Game, path: my_env.py}``; or a mapping of such entries by name, which routes each row
by its ``rollout.environment_field`` column (default ``environment``, TRL's). One instance per episode (G per
prompt), created with no arguments. The class defines:

- ``reset(**row)`` (required): called first, with the row (the stored prompt under ``data.prompt_field`` and every
  other column, the routing column left out, as TRL does; the instance's own copy). A reset that does not take
  ``**kwargs`` receives only the columns it names. It returns None (the row's prompt is the first turn), a string
  (appended to the last user message, TRL's rule: with an empty stored prompt it is the first user turn) or a list
  of messages (the episode's first messages instead of the row's prompt).
- public methods (not starting with ``_``, other than the reserved ``reset``, ``step``, ``get_reward``, ``close``):
  tools, their schemas from the bound methods' type hints and docstrings exactly as plain tools
  (`astrai.agents.tools.tool_from_function`); a call runs on the episode's own instance.
- ``step(message)`` (optional): for games without tools. Called with each assistant turn that calls no tool (a dict
  ``{"role": "assistant", "content": text}``); returns the observation (a string: a user message; a message; a list
  of messages) appended with loss mask 0, or None to end the episode.
- ``get_reward()`` (optional): a number, the episode's environment reward, added to the reward functions' total
  (weight 1) and logged as its own reward (``rewards/environment/...``).
- ``close()`` (optional): always called once the episode is over, after a failure or a timeout too.

This module loads and checks the classes and checks what their methods return; running instances (in worker
processes, with timeouts) is `astrai.experience.environments`.
"""

from __future__ import annotations

import inspect
import math
import numbers
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

from astrai.agents.tools import Tool, ToolError, tool_from_function
from astrai.imports import ImportFailure, load_attribute, split_reference

__all__ = ["RESERVED", "EnvironmentClassError", "EnvironmentSpec", "ObservationError", "environment_specs",
           "environment_tools", "is_single", "load_environment_class", "missing_reset_columns", "observation_messages",
           "reset_arguments", "reset_observation", "reward_value"]

RESERVED = ("reset", "step", "get_reward", "close")
"""Method names of the environment protocol: never exposed as tools."""
ROLES = ("system", "user", "tool")
"""Roles an observation's messages may have (an assistant message would be text the policy did not sample)."""


class EnvironmentClassError(ValueError):
    """An environment class cannot be loaded or does not fit the protocol; one line naming the entry."""


class ObservationError(ValueError):
    """An environment method returned something of the wrong kind; one line saying what it returned."""


@dataclass(frozen=True)
class EnvironmentSpec:
    """One environment class of the job, resolved (picklable: what a worker loads it by).

    Attributes:
        route: its name in a routing mapping (the value of the rows' routing column), None for a single class.
        reference: ``"module:Class"``, or ``"Class"`` / ``"module:Class"`` with `path`.
        path: the absolute path of the .py file holding it, or None (imported from `sys.path`).
    """

    route: Optional[str]
    reference: str
    path: Optional[str] = None

    @property
    def label(self) -> str:
        """How messages name it: ``rollout.environment`` or ``rollout.environment.<route>``."""
        return "rollout.environment" + ("" if self.route is None else f".{self.route}")


def environment_specs(value: Union[str, Mapping[str, Any]], base_dir: Optional[Union[str, Path]] = None
                      ) -> list[EnvironmentSpec]:
    """The classes `value` (a validated ``rollout.environment``) names: one spec for ``"module:Class"`` or
    ``{class, path}``, one per route for a routing mapping; a relative ``path`` from `base_dir` (default: the
    working directory)."""
    base = Path.cwd() if base_dir is None else Path(base_dir)

    def one(route: Optional[str], entry: Union[str, Mapping[str, Any]]) -> EnvironmentSpec:
        if isinstance(entry, str):
            return EnvironmentSpec(route, entry)
        path = entry.get("path")
        path = None if path is None else str((base / Path(path).expanduser()).resolve())
        return EnvironmentSpec(route, entry["class"], path)

    if is_single(value):
        return [one(None, value)]
    return [one(str(route), entry) for route, entry in value.items()]


def is_single(value: Union[str, Mapping[str, Any]]) -> bool:
    """Whether a ``rollout.environment`` value names one class (else it routes rows to several by name)."""
    return isinstance(value, str) or "class" in value or "path" in value


def load_environment_class(spec: EnvironmentSpec) -> type:
    """The class `spec` names, imported now, checked: a class, with a callable ``reset``, and ``step``,
    ``get_reward``, ``close`` callable when present.

    Raises:
        EnvironmentClassError: one line naming the entry (a malformed reference, a missing file, an import that
            fails, no such attribute, not a class, an ``__init__`` that needs arguments, no reset).
    """
    if split_reference(spec.reference, spec.path) is None:
        raise EnvironmentClassError(f"{spec.label}: class {spec.reference!r}: expected 'package.module:Class', or "
                                    "a `path` to its file")
    try:
        cls = load_attribute(spec.reference, spec.path)
    except ImportFailure as err:
        raise EnvironmentClassError(f"{spec.label}: {err}") from None
    if not inspect.isclass(cls):
        raise EnvironmentClassError(f"{spec.label}: {spec.reference} is of type {type(cls).__name__}, not a class")
    if not callable(getattr(cls, "reset", None)):
        raise EnvironmentClassError(f"{spec.label}: {cls.__name__} has no reset method (an environment class "
                                    "defines reset(**row); docs/agents.md)")
    try:  # TRL's rule: every episode's instance is created with no arguments
        init = inspect.signature(cls)
    except (TypeError, ValueError):  # no signature to check (a builtin base): left to the first instance
        init = None
    if init is not None:
        try:
            init.bind()
        except TypeError:
            raise EnvironmentClassError(f"{spec.label}: {cls.__name__}{init} cannot be created without arguments (each "
                                        "episode's instance is created as Class(), TRL's rule; give its parameters "
                                        "defaults, or read the row in reset)") from None
    for name in RESERVED[1:]:
        if hasattr(cls, name) and not callable(getattr(cls, name)):
            raise EnvironmentClassError(f"{spec.label}: {cls.__name__}.{name} is a "
                                        f"{type(getattr(cls, name)).__name__}, not a method")
    for name, need in (("step", 1), ("get_reward", 0), ("close", 0)):
        if hasattr(cls, name):
            try:
                signature = inspect.signature(_bound(cls, name))
            except (TypeError, ValueError):  # no signature to check (a builtin): left to the call
                continue
            try:
                signature.bind(*[None] * need)
            except TypeError:
                takes = "one argument (the assistant message)" if need else "no argument"
                raise EnvironmentClassError(f"{spec.label}: {cls.__name__}.{name}{signature} cannot be called with "
                                            f"{takes}") from None
    return cls


def _required(cls: type, name: str) -> Optional[list[str]]:
    """The required parameters of method `name` of `cls` beyond the instance, or None when it has no signature."""
    try:
        params = list(inspect.signature(_bound(cls, name)).parameters.values())
    except (TypeError, ValueError):
        return None
    return [p.name for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD,
                                                                         p.KEYWORD_ONLY)]


def _bound(cls: type, name: str) -> Any:
    """Method `name` of `cls` bound as on an instance, without creating one (no ``__init__`` runs): a plain
    function bound to a placeholder, a staticmethod as it is, a classmethod bound to the class."""
    raw = inspect.getattr_static(cls, name)
    if isinstance(raw, staticmethod):
        return raw.__func__
    if isinstance(raw, classmethod):
        return types.MethodType(raw.__func__, cls)
    function = getattr(cls, name)
    return types.MethodType(function, _PLACEHOLDER) if inspect.isfunction(function) else function


_PLACEHOLDER = object()


def environment_tools(spec: EnvironmentSpec, cls: type) -> list[Tool]:
    """The tools of `cls`: its public methods (not ``_``-prefixed, not `RESERVED`; functions, static and class
    methods, inherited ones included; not properties or other attributes), in name order, each schema derived from
    the bound method as a plain tool's (`tool_from_function`).

    Raises:
        EnvironmentClassError: a method whose schema cannot be derived (naming it).
    """
    tools = []
    for name in sorted(dir(cls)):
        if name.startswith("_") or name in RESERVED:
            continue
        raw = inspect.getattr_static(cls, name, None)
        if not (inspect.isfunction(raw) or isinstance(raw, (staticmethod, classmethod))):
            continue
        try:
            tools.append(tool_from_function(_bound(cls, name)))
        except ToolError as err:
            raise EnvironmentClassError(f"{spec.label}: method {cls.__name__}.{name} (public methods are tools; "
                                        f"prefix it with _ to hide it): {err}") from None
    return tools


def reset_arguments(cls: type, row: Mapping[str, Any]) -> dict[str, Any]:
    """What ``cls.reset`` receives of `row`: all of it when reset takes ``**kwargs`` (or has no signature), else the
    columns it names."""
    try:
        params = inspect.signature(_bound(cls, "reset")).parameters.values()
    except (TypeError, ValueError):
        return dict(row)
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return dict(row)
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return {k: v for k, v in row.items() if k in names}


def missing_reset_columns(cls: type, columns: Sequence[str]) -> list[str]:
    """The required parameters of ``cls.reset`` that are not among `columns` (what every row offers)."""
    required = _required(cls, "reset") or []
    return [name for name in required if name not in columns]


def reset_observation(value: Any) -> Union[None, str, list[dict[str, Any]]]:
    """What reset returned, checked: None, a string, or a non-empty list of messages (as copies).

    Raises:
        ObservationError: anything else, or a malformed message.
    """
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and value:
        return [_message(m, f"message {i} of the list") for i, m in enumerate(value)]
    raise ObservationError(f"reset returned {_shown(value)}; expected None, a string (appended to the last user "
                           "message) or a non-empty list of messages")


def observation_messages(value: Any) -> Optional[list[dict[str, Any]]]:
    """What step returned, as the messages to append: None (the episode ends), a string (one user message), a
    message, or a non-empty list of messages.

    Raises:
        ObservationError: anything else, or a malformed message.
    """
    if value is None:
        return None
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if isinstance(value, Mapping):
        return [_message(value, "the message")]
    if isinstance(value, list) and value:
        return [_message(m, f"message {i} of the list") for i, m in enumerate(value)]
    raise ObservationError(f"step returned {_shown(value)}; expected None (the episode ends), a string, a message "
                           "or a non-empty list of messages")


def _message(value: Any, what: str) -> dict[str, Any]:
    """`value` as a message dict with a role of `ROLES` and string content."""
    if not isinstance(value, Mapping):
        raise ObservationError(f"{what} is {_shown(value)}, not a message ({{'role': ..., 'content': ...}})")
    role, content = value.get("role"), value.get("content")
    if role not in ROLES:
        raise ObservationError(f"{what} has role {role!r}; expected one of {', '.join(ROLES)}")
    if not isinstance(content, str):
        raise ObservationError(f"{what} has content {_shown(content)}; expected a string")
    return dict(value)


def reward_value(value: Any) -> float:
    """What get_reward returned, as a float: a finite real number (bools, numpy scalars and 0-d tensors count).

    Raises:
        ObservationError: anything else.
    """
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        value = value.item()
    if not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ObservationError(f"get_reward returned {_shown(value)}; expected a finite number")
    return float(value)


def _shown(value: Any) -> str:
    """A short description of a returned value: its type and the start of its repr."""
    text = repr(value)
    return f"{type(value).__name__} {text[:60] + '...' if len(text) > 60 else text}"
