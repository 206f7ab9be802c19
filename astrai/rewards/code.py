"""Built-in reward ``code_unit_tests``: a completion's Python, run against its record's unit tests in the sandbox.

TRL's reward-function calling convention (``trl`` ``GRPOTrainer`` ``reward_funcs``)::

    code_unit_tests(prompts: list[str], completions: list[str], *, tests: list, **columns) -> list[float | None]

``tests`` is the record column of tests, one entry per completion: a list of assert statements (MBPP's
``test_list``; the format is described in ``astrai/sandbox/code_tests.py``). An optional ``test_setup`` column
(one string per completion, e.g. imports; MBPP's ``test_setup_code``) runs after the solution and before the
tests. Every other column is ignored. The reward is passed / total in [0, 1] (partial credit by fraction of tests
passed); a completion whose ``tests`` entry is None or empty gets None (not applicable). Completions may also be
chat messages (TRL's conversational form): the last message's ``content`` is used.

Code extraction (``extract_code``), in this order:
  1. the LAST fenced block tagged ``python``, ``py`` or ``python3`` (```` ```python ... ``` ````);
  2. else the last fenced block with no language tag;
  3. else the whole completion.
A fence is a line starting with three backticks (leading spaces allowed); a block left open (generation stopped
at the length limit) runs to the end of the text.

The runs of one call go through a small thread pool (each run is its own process; ``max_workers`` bounds how
many run at once). Nothing of the completion is executed in this process.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

from astrai.sandbox.code_tests import parse_tests
from astrai.rewards.builtins import completion_text
from astrai.sandbox.execute import SandboxError, SandboxLimits, SandboxResult, run_tests

PYTHON_TAGS = ("python", "py", "python3")
DEFAULT_WORKERS = max(1, min(4, os.cpu_count() or 1))


def _fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(language tag lower-cased, body) of each fenced block, in order; an unclosed last block runs to the end."""
    blocks, tag, body = [], None, []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("```"):
            if tag is None:
                words = stripped[3:].split()
                tag, body = (words[0].lower() if words else ""), []
            else:
                blocks.append((tag, "\n".join(body)))
                tag = None
            continue
        if tag is not None:
            body.append(line)
    if tag is not None:
        blocks.append((tag, "\n".join(body)))
    return blocks


def extract_code(completion: str) -> str:
    """The Python source a completion gives (rule in the module docstring). Never raises for a ``str``."""
    blocks = _fenced_blocks(completion)
    for wanted in (lambda tag: tag in PYTHON_TAGS, lambda tag: tag == ""):
        chosen = [body for tag, body in blocks if wanted(tag)]
        if chosen:
            return chosen[-1] + "\n"
    return completion


def run_completions(completions: Sequence[Any], tests: Sequence[Any], *, setups: Sequence[Any] | None = None,
                    limits: SandboxLimits | None = None,
                    max_workers: int = DEFAULT_WORKERS) -> list[SandboxResult | None]:
    """Run each completion's code against its tests, at most ``max_workers`` sandboxes at a time.

    Returns:
        One ``SandboxResult`` per completion, in order; None where its tests are None or empty.

    Raises:
        ValueError: lengths differ, ``max_workers`` < 1, or malformed tests (naming the completion's index).
        SandboxError: when a run reports that the sandbox itself failed.
    """
    if len(tests) != len(completions) or (setups is not None and len(setups) != len(completions)):
        raise ValueError(f"code_unit_tests: got {len(completions)} completions but {len(tests)} tests entries"
                         + ("" if setups is None else f" and {len(setups)} test_setup entries"))
    if isinstance(max_workers, bool) or not isinstance(max_workers, int) or max_workers < 1:
        raise ValueError(f"code_unit_tests: max_workers must be a positive int, got {max_workers!r}")
    jobs = {}
    for i, (completion, entry) in enumerate(zip(completions, tests)):
        if entry is None or (hasattr(entry, "__len__") and len(entry) == 0):
            continue
        where = f"code_unit_tests: tests of completion {i}"
        entry = list(entry) if not isinstance(entry, str) and hasattr(entry, "tolist") else entry
        setup = "" if setups is None or setups[i] is None else str(setups[i])
        jobs[i] = (extract_code(completion_text(completion)), parse_tests(entry, where=where), setup)
    results: list[SandboxResult | None] = [None] * len(completions)
    if jobs:
        with ThreadPoolExecutor(max_workers=min(max_workers, len(jobs)), thread_name_prefix="sandbox") as pool:
            futures = {i: pool.submit(run_tests, code, parsed, setup=setup, limits=limits)
                       for i, (code, parsed, setup) in jobs.items()}
            for i, future in futures.items():
                results[i] = future.result()
    failed = next((r for r in results if r is not None and r.status == "sandbox_error"), None)
    if failed is not None:
        raise SandboxError(f"code_unit_tests: the sandbox failed: {failed.detail}")
    return results


def make_code_unit_tests(*, limits: SandboxLimits | None = None,
                         max_workers: int = DEFAULT_WORKERS) -> Callable[..., list[float | None]]:
    """A ``code_unit_tests`` reward with its own sandbox limits and concurrency (see the module docstring)."""

    def code_unit_tests(prompts: list[str], completions: list[Any], *, tests: list,
                        **columns: Any) -> list[float | None]:
        """passed / total per completion (None where it has no tests); see ``astrai.rewards.code``.

        Raises:
            ValueError: for mismatched lengths or malformed tests. SandboxError: the sandbox itself failed.
        """
        results = run_completions(completions, tests, setups=columns.get("test_setup"), limits=limits,
                                  max_workers=max_workers)
        return [None if r is None else r.score for r in results]

    return code_unit_tests


code_unit_tests = make_code_unit_tests()

__all__ = ["DEFAULT_WORKERS", "PYTHON_TAGS", "code_unit_tests", "completion_text", "extract_code",
           "make_code_unit_tests", "run_completions"]
