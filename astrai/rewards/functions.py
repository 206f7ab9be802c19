"""Reward functions by import path, TRL's calling convention, weighted and logged one by one (`reward.functions`).

Each function is called as ``fn(prompts=[...], completions=[...], completion_ids=[...], **columns)``: the prompts
as stored (a string, or a chat: a list of messages), the completions as text (for chat prompts, as TRL does, a
one-message list ``[{"role": "assistant", "content": text}]``), the sampled token ids, and every other column of
the prompt records as a list by name (TRL's ``reward_funcs`` convention, so reward code written for TRL ports as
is), plus its configured ``kwargs``. A function that takes ``**kwargs`` receives everything; otherwise only the
names it declares, and a required parameter that is neither is refused at start-up. It returns one float or None
per completion (None: the reward does not apply to that sample; it is left out of that reward's sum and metrics).

The total reward of a sample is the weighted sum of the values that apply (0 when none does), as TRL's
``nansum(rewards * reward_weights)``. Built-in rewards (`builtins.BUILTIN_REWARDS`) run in the trainer's process;
functions given by import path or file run in `workers.RewardWorkerPool` processes (``reward.num_workers``)
with a hard ``reward.timeout_seconds``; with ``num_workers`` 0 they run in the trainer's process without one. A
call that raises, times out or kills its worker gives its samples ``reward.error_score`` (``on_error: score``) or
no value (``skip``), is counted (``rewards/<name>/failed``, on the console at each logging step), is warned about
once per function (its first failure, with the traceback from this process or the worker), and stops the job when
that function failed on more than ``reward.max_error_fraction`` of its samples over its last ``reward.error_window``
rollouts (the message quotes its first failure). A function that returns the
wrong number of values, a value that is not a number (bools and numpy scalars count) or None, or a non-finite number
is a bug: a one-line `RewardFunctionError` naming it, at once. ``async def`` functions are awaited (in the worker,
under the timeout). Each function gets its own copy of the arguments. A function with verl's
``compute_score(data_source, solution_str, ground_truth, extra_info)`` parameters is called per sample
(`workers.VerlScore`). When no function applies to any sample of a rollout, that is said once.

A stop request (`should_stop`: the trainer's stop signals) ends a scoring early with `ScoringStopped` and no
scores: the workers stop waiting within `workers.STOP_POLL_SECONDS` (busy ones are killed and started afresh later),
and no further function is started. A function running in the trainer's process (a built-in, or any with
``num_workers`` 0) is one call that cannot be interrupted: the stop is seen when it returns. The reward model
(`reward.model_path`) always runs: it may take part in collectives with the other ranks.
"""

from __future__ import annotations

import collections
import copy
import importlib
import inspect
import math
import numbers
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Collection, Mapping, Optional, Sequence

import torch

from astrai.rewards.builtins import BUILTIN_REWARDS
from astrai.rewards.workers import (RewardFunctionError, RewardFunctionSpec, RewardWorkerPool, ScoringStopped,
                                    as_list, call_reward, load_reward_function, user_traceback)

__all__ = ["RewardFunctionError", "RewardFunctionSpec", "RewardFunctions", "ScoredRewards", "ScoringStopped",
           "resolve_specs", "reward_metrics", "reward_reference"]

STANDARD_ARGUMENTS = ("prompts", "completions", "completion_ids")
"""What every call offers besides the columns and the configured kwargs."""

IN_PROCESS_PREFIX = "python:"
"""`reward.functions[].function` of a callable handed over in Python (`reward_reference`), run in this process."""
_CALLABLES: dict[str, Callable] = {}


def reward_reference(fn: Callable) -> str:
    """How `reward.functions` names the callable `fn` handed over in Python (`astrai.train.fit`'s `reward_funcs`):
    "module:qualname" when that import gives `fn` back (it then runs in the reward workers, with the timeout), else
    "python:<name>" for a function defined in a notebook or `__main__`, which runs in this process.

    Raises:
        TypeError: `fn` is not callable.
    """
    if not callable(fn):
        raise TypeError(f"reward_funcs: expected callables, got {type(fn).__name__}")
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if module and module != "__main__" and "<" not in qualname:
        try:
            imported = importlib.import_module(module)
            for part in qualname.split("."):
                imported = getattr(imported, part)
            if imported is fn:
                return f"{module}:{qualname}"
        except (ImportError, AttributeError):
            pass
    name = getattr(fn, "__name__", type(fn).__name__)
    key = name if _CALLABLES.get(name, fn) is fn else f"{name}_{len(_CALLABLES)}"
    _CALLABLES[key] = fn
    return IN_PROCESS_PREFIX + key


def resolve_specs(section, *, answer_field: Optional[str], base_dir: Path | None = None,
                  with_model: bool = True) -> list[RewardFunctionSpec]:
    """The `reward.functions` of a config's `reward` section, resolved; without any, the one built-in
    `reward.name` with `reward.format_bonus` / `reward.partial_credit` (the single-reward form; only those it
    takes, unless set: `_single_reward_options`). A built-in that
    reads the reference answer (`BuiltinReward.answer_field`, e.g. `math_exact_match`) is told its column:
    `answer_field`. With `reward.model_path` and no functions there is none (the reward model alone scores), unless
    `with_model` is False (the reward model is left out: then `reward.name` is the reward). A relative `path` is
    taken from `base_dir` (default: the working directory)."""
    base = Path.cwd() if base_dir is None else base_dir
    single = single_reward_name(section)
    default = [] if with_model and getattr(section, "model_path", None) else [
        SimpleNamespace(function=single, name=single, path=None, weight=1.0, kwargs=_single_reward_options(section))]
    specs = []
    for i, entry in enumerate(section.functions or default):  # `astrai.config.RewardFunction` records
        kwargs = dict(entry.kwargs or {})
        builtin = BUILTIN_REWARDS.get(entry.function) if entry.path is None else None
        if builtin is not None and builtin.answer_field:  # it reads the reference answers' column
            kwargs.setdefault("answer_field", answer_field)
        specs.append(RewardFunctionSpec(
            name=entry.name or entry.function.rpartition(":")[2], function=entry.function, index=i,
            path=None if entry.path is None else str((base / Path(entry.path).expanduser()).resolve()),
            weight=float(entry.weight), kwargs=kwargs, answer_field=answer_field))
    return specs


DEFAULT_REWARD = "math_exact_match"
"""The single built-in reward of a job that names none (`reward.name` null)."""


def single_reward_name(section) -> str:
    """The built-in of the single-reward form: `reward.name`, else `DEFAULT_REWARD`."""
    return getattr(section, "name", None) or DEFAULT_REWARD


def _single_reward_options(section) -> dict[str, float]:
    """The kwargs of the single-reward form (`reward.name`): `reward.format_bonus` and `reward.partial_credit`, each
    given when the built-in names it as a parameter (`math_exact_match`) or when it is set (non-zero: then a
    built-in without it is refused by name, instead of the setting being ignored)."""
    options = {"format_bonus": section.format_bonus, "partial_credit": section.partial_credit}
    builtin = BUILTIN_REWARDS.get(single_reward_name(section))
    try:
        named = set(inspect.signature(builtin.load()).parameters) if builtin is not None else set()
    except (TypeError, ValueError):
        named = set()
    return {key: value for key, value in options.items() if key in named or value}


def _argument_picker(fn: Callable, spec: RewardFunctionSpec, offered: Collection[str], *,
                     builtin: bool = False) -> Optional[set[str]]:
    """The argument names to pass `fn` (None: all, it takes **kwargs), after checking its signature.

    Raises:
        RewardFunctionError: a positional-only parameter, a required parameter nothing offers, or a configured
            kwarg the function does not take (for a `builtin`, one it does not name, even with **kwargs).
    """
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None  # a builtin or C callable without a signature: offer everything
    if any(p.kind is p.POSITIONAL_ONLY for p in params):
        raise RewardFunctionError(f"{spec.label}: {spec.function} has positional-only parameters; reward functions "
                                  "are called with keyword arguments (prompts=, completions=, ...)")
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params)
    for p in params:  # a required parameter nothing provides fails every call, **kwargs or not
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is p.empty and p.name not in offered:
            raise RewardFunctionError(f"{spec.label}: parameter {p.name!r} of {spec.function} is neither a column of "
                                      f"the prompts nor one of {', '.join(STANDARD_ARGUMENTS)} nor a configured "
                                      f"kwarg (columns: {', '.join(sorted(set(offered) - set(STANDARD_ARGUMENTS)))})")
    # a built-in's options are its named parameters: a configured kwarg it does not name is a typo even though it
    # takes **columns; a user function with **kwargs may read any key
    unknown = sorted(set(spec.kwargs) - names) if builtin or not takes_any else []
    if takes_any and not unknown:
        return None
    if unknown:
        raise RewardFunctionError(f"{spec.label}: {spec.function} takes no argument {unknown[0]!r} (reward.functions "
                                  f"kwargs)")
    return names


@dataclass(frozen=True)
class ScoredRewards:
    """The rewards of B samples.

    Attributes:
        total: (B,) float32, the weighted sum of the values that apply.
        components: function name -> (B,) float32 values, NaN where it returned None (or skipped a failure).
        failed: function name -> (B,) bool, the samples whose call raised, timed out or lost its worker.
    """

    total: torch.Tensor
    components: dict[str, torch.Tensor]
    failed: dict[str, torch.Tensor]


class RewardFunctions:
    """The job's reward: its functions, loaded and checked once, called per rollout.

    Args:
        specs: `resolve_specs`; columns: the column names every prompt record offers.
        extra: (spec, callable) pairs of rewards built in the trainer (the reward model), run in its process.
        allow_none: no specs and no extra is fine (every total is 0): another reward, an environment's `get_reward`,
            is the whole reward (`astrai.rewards.build.environment_is_the_reward`).
        num_workers, timeout_seconds, on_error, error_score, max_error_fraction, error_window: as `reward.*`
            (module docstring).
        should_stop: whether a stop was requested (`DistributedContext.stop_requested`): a call then raises
            `ScoringStopped` instead of finishing (module docstring); None: never.

    Raises:
        RewardFunctionError: an unknown built-in, an import that fails, or a signature that cannot be served.
    """

    def __init__(self, specs: Sequence[RewardFunctionSpec], *, columns: Collection[str], num_workers: int = 1,
                 timeout_seconds: float = 60.0, on_error: str = "score", error_score: float = 0.0,
                 max_error_fraction: float = 0.5, error_window: int = 3,
                 extra: Sequence[tuple[RewardFunctionSpec, Callable]] = (), allow_none: bool = False,
                 should_stop: Optional[Callable[[], bool]] = None):
        if not specs and not extra and not allow_none:  # allow_none: another reward (an environment's) is the whole
            raise RewardFunctionError("reward.functions: no reward function")
        self.specs, self.on_error, self.error_score = list(specs), on_error, error_score
        self.max_error_fraction, self.error_window = max_error_fraction, error_window
        offered = set(STANDARD_ARGUMENTS) | set(columns)
        self._functions, self._pickers, remote = [], [], []
        for spec in self.specs:
            clash = sorted(set(spec.kwargs) & offered)
            if clash:
                raise RewardFunctionError(f"{spec.label}: kwargs key {clash[0]!r} is also an argument every call "
                                          "passes (a column or a standard argument); rename it")
            builtin = BUILTIN_REWARDS.get(spec.function) if spec.path is None else None
            if builtin is not None:
                fn = builtin.load()
            elif spec.function.startswith(IN_PROCESS_PREFIX):
                fn = _CALLABLES.get(spec.function[len(IN_PROCESS_PREFIX):])
                if fn is None:
                    raise RewardFunctionError(f"{spec.label}: {spec.function} names a callable handed over in Python "
                                              "(astrai.train.fit's reward_funcs) in another process")
            elif ":" not in spec.function and spec.path is None:
                raise RewardFunctionError(f"{spec.label}: unknown built-in reward {spec.function!r} (built-in: "
                                          f"{', '.join(sorted(BUILTIN_REWARDS))}; or 'package.module:function')")
            else:
                fn = load_reward_function(spec)
                remote.append(len(self._functions))
            self._functions.append(fn)
            self._pickers.append(_argument_picker(fn, spec, offered | set(spec.kwargs), builtin=builtin is not None))
        self._interruptible = len(self._functions)  # the user's and the built-ins, not the extra ones
        for spec, fn in extra:
            self.specs.append(spec)
            self._functions.append(fn)
            self._pickers.append(_argument_picker(fn, spec, offered | set(spec.kwargs)))
        self._remote = set(remote) if num_workers > 0 else set()
        self._warned: set[int] = set()  # functions whose first failure was warned about
        self._first_failure: dict[int, str] = {}  # function index -> its first failure's one-line text
        # per function, (failed, scored) samples of its last `error_window` rollouts
        self._recent = [collections.deque(maxlen=error_window) for _ in self.specs]
        self._said_none_applies = False
        self.should_stop = should_stop
        self.pool = (RewardWorkerPool(self.specs, num_workers=num_workers, timeout_seconds=timeout_seconds,
                                      should_stop=should_stop) if self._remote else None)

    @property
    def names(self) -> list[str]:
        """The functions' metric names, in order."""
        return [spec.name for spec in self.specs]

    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], completion_ids: Sequence[list[int]],
                 columns: Mapping[str, Sequence[Any]]) -> ScoredRewards:
        """Score B completions (see the module docstring for what each function receives): texts, or a multi-turn
        episode's new messages (a list of {"role", "content"} dicts, passed as they are).

        Raises:
            RewardFunctionError: a function returned the wrong number of values, a non-number or a non-finite
                number; or more than `max_error_fraction` of the samples' calls failed (naming the first failure).
            ScoringStopped: `should_stop` turned true before a function started or while workers ran one (the
                functions not started are skipped, the reward model still runs: module docstring).
        """
        n = len(completions)
        chat = [isinstance(p, list) for p in prompts]
        shown = [c if isinstance(c, list) else [{"role": "assistant", "content": c}] if is_chat else c
                 for c, is_chat in zip(completions, chat)]  # a list already: an episode's messages
        offered = {"prompts": list(prompts), "completions": shown, "completion_ids": [list(i) for i in completion_ids],
                   **{name: list(values) for name, values in columns.items()}}
        total = torch.zeros(n, dtype=torch.float32)
        components, failed = {}, {}
        stopped: Optional[str] = None  # where a stop request interrupted the scoring
        for i, spec in enumerate(self.specs):
            if i < self._interruptible:
                if stopped is not None:
                    continue
                if self.should_stop is not None and self.should_stop():
                    stopped = f"before {spec.label}"
                    continue
            try:
                values, errors, detail = self._call(i, offered, n)
            except ScoringStopped:
                stopped = f"while {spec.label} ran"
                continue
            if stopped is not None:  # an extra reward (the reward model) that ran for the collectives it takes part in
                continue
            failed[spec.name] = torch.tensor([e is not None for e in errors], dtype=torch.bool)
            self._account_failures(i, errors, detail)
            if self.on_error == "score":
                values = [self.error_score if e is not None else v for v, e in zip(values, errors)]
            column = torch.tensor([math.nan if v is None else v for v in values], dtype=torch.float32)
            components[spec.name] = column
            total += torch.nan_to_num(column, nan=0.0) * spec.weight
        if stopped is not None:
            raise ScoringStopped(f"a stop request interrupted the reward scoring of {n} samples ({stopped})")
        if n and components and not self._said_none_applies and all(bool(c.isnan().all()) for c in components.values()):
            self._said_none_applies = True
            warnings.warn(f"no reward function applies to any of the {n} samples of this rollout (each returned None "
                          f"for all): they all score 0 and teach nothing; check that the prompts' columns are what "
                          f"{', '.join(self.names)} read (said once)", stacklevel=2)
        return ScoredRewards(total=total, components=components, failed=failed)

    def _call(self, i: int, offered: Mapping[str, list], n: int) -> tuple[list, list[Optional[str]], Optional[str]]:
        """(values, per-sample error text or None, the traceback of a failure or None) of function `i` over all n
        samples. In this process the function gets its own deep copy of its arguments (a worker gets a pickled
        one), so an in-place edit reaches neither the next function nor the stored prompts. `ScoringStopped` when a
        stop request ended the workers' wait (`RewardWorkerPool.run`)."""
        spec, picker = self.specs[i], self._pickers[i]
        kwargs = {k: v for k, v in offered.items() if picker is None or k in picker}
        kwargs.update(spec.kwargs)
        if i not in self._remote:
            try:
                return self._check(spec, as_list(call_reward(self._functions[i], copy.deepcopy(kwargs))), n), \
                    [None] * n, None
            except RewardFunctionError:
                raise
            except Exception as err:  # the reward's own failure: counted, as in a worker
                text = f"{type(err).__name__}: {' '.join(str(err).split())[:200]}"
                return [None] * n, [text] * n, user_traceback(err)
        chunks = _chunks(n, self.pool.num_workers)
        calls = [{k: (v[a:b] if k in offered else v) for k, v in kwargs.items()} for a, b in chunks]
        values, errors, detail = [], [], None
        results = self.pool.run(i, calls)
        if any(status == "stopped" for status, _, _ in results):
            raise ScoringStopped(f"{spec.label}: interrupted by a stop request")
        for (a, b), (status, result, trace) in zip(chunks, results):
            if status == "ok":
                values += self._check(spec, result, b - a)
                errors += [None] * (b - a)
            else:
                values += [None] * (b - a)
                errors += [result] * (b - a)
                detail = detail or trace
        return values, errors, detail

    def _account_failures(self, i: int, errors: Sequence[Optional[str]], detail: Optional[str]) -> None:
        """Count function `i`'s failed samples of one rollout: warn on its first failure (with the traceback), and
        stop when it failed on more than `max_error_fraction` of its samples over its last `error_window` rollouts
        (judged once that many were scored: one bad rollout, a verifier briefly down, does not end a run).

        Raises:
            RewardFunctionError: one line naming the function, the count and its first failure.
        """
        spec, count, n = self.specs[i], sum(e is not None for e in errors), len(errors)
        recent = self._recent[i]
        recent.append((count, n))
        if not count:
            return
        first = self._first_failure.setdefault(i, next(e for e in errors if e is not None))
        if i not in self._warned:
            self._warned.add(i)
            self._warn_first_failure(i, count, n, first, detail)
        failed, scored = map(sum, zip(*recent))
        if len(recent) == recent.maxlen and failed > self.max_error_fraction * scored:
            rollouts = "this rollout" if recent.maxlen == 1 else f"the last {recent.maxlen} rollouts"
            raise RewardFunctionError(f"{spec.label} failed on {failed} of {scored} samples of {rollouts}, more than "
                                      f"reward.max_error_fraction {self.max_error_fraction:g} (reward.error_window "
                                      f"{recent.maxlen}); its first failure: {first}")

    def _warn_first_failure(self, i: int, count: int, n: int, first: str, detail: Optional[str]) -> None:
        """Warn (once per function: the caller keeps count) that function `i` failed on `count` of `n` samples:
        the first error, what their samples score, and its traceback (from this process or the worker's)."""
        spec = self.specs[i]
        then = (f"score reward.error_score {self.error_score:g}" if self.on_error == "score"
                else "are left out of it (reward.on_error skip)")
        warnings.warn(f"{spec.label} failed on {count} of {n} samples ({first}); failed samples {then}; later "
                      f"failures are counted (rewards/{spec.name}/failed, on the console at each logging step)"
                      + (f"\n{detail.rstrip()}" if detail else ""), stacklevel=4)

    @staticmethod
    def _check(spec: RewardFunctionSpec, result: Any, n: int) -> list[Optional[float]]:
        """`result` as n floats or None; RewardFunctionError naming `spec` otherwise."""
        if not isinstance(result, list):
            raise RewardFunctionError(f"{spec.label}: expected a list of {n} floats or None, got "
                                      f"{type(result).__name__}")
        if len(result) != n:
            raise RewardFunctionError(f"{spec.label}: returned {len(result)} values for {n} completions")
        out = []
        for j, value in enumerate(result):
            if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:  # a numpy scalar or a 0-d tensor
                value = value.item()
            if value is not None and not isinstance(value, numbers.Real):  # bools and ints count, as in TRL
                raise RewardFunctionError(f"{spec.label}: value {j} is {value!r}, expected a number or None")
            if value is not None and not math.isfinite(value):
                raise RewardFunctionError(f"{spec.label}: value {j} is {value!r}; rewards must be finite (None "
                                          "marks a sample the reward does not apply to)")
            out.append(None if value is None else float(value))
        return out

    def close(self) -> None:
        """End the worker processes (idempotent)."""
        if self.pool is not None:
            self.pool.close()


def _chunks(n: int, parts: int) -> list[tuple[int, int]]:
    """Up to `parts` contiguous (start, end) ranges covering range(n), sizes differing by at most one."""
    parts = max(1, min(parts, n))
    size, extra = divmod(n, parts)
    bounds, start = [], 0
    for k in range(parts):
        end = start + size + (k < extra)
        bounds.append((start, end))
        start = end
    return bounds


def reward_metrics(components: Mapping[str, torch.Tensor],
                   failed: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`rewards/<name>/mean` and `/std` (population) over the samples each function applies to (0 when none),
    `rewards/<name>/applies` (the fraction it applies to) and `rewards/<name>/failed` (failed samples)."""
    out = {}
    for name, values in components.items():
        real = values[torch.isfinite(values)]
        zero = torch.zeros((), dtype=torch.float32)
        out[f"rewards/{name}/mean"] = real.mean() if real.numel() else zero
        out[f"rewards/{name}/std"] = real.std(unbiased=False) if real.numel() else zero
        out[f"rewards/{name}/applies"] = torch.tensor(real.numel() / max(values.numel(), 1))
        if name in failed:
            out[f"rewards/{name}/failed"] = failed[name].sum().float()
    return out
