"""User code named in a job: ``"package.module:name"`` imported from `sys.path`, or a name in a ``.py`` file.

Reward functions (`astrai.rewards.workers`), tools (`astrai.agents.tools`) and environment classes
(`astrai.agents.environments`) are all named this way; `load_attribute` is their one loader. A file is loaded under
a private module name derived from its absolute path (``astrai_user_<digest>_<stem>``), once per process, so a file
outside any package works, and a file that holds a reward function and a tool is executed once. Each caller checks
the form of its reference first (`split_reference`) and what the attribute must be (a function, a class), in its own
words; this module words the failures they share. Stdlib only (reward and environment workers import it).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any, Optional, Union

__all__ = ["ImportFailure", "load_attribute", "one_line", "split_reference"]


class ImportFailure(ValueError):
    """The named attribute cannot be had; the message is one line (``path X: file not found``, ``cannot import X:
    Error: text``, ``X has no attribute 'y'``) without the caller's label."""


def one_line(err: BaseException, limit: int = 200) -> str:
    """An exception's text on one line, at most `limit` characters."""
    text = " ".join(str(err).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def split_reference(reference: str, path: Optional[Union[str, Path]] = None) -> Optional[tuple[str, str]]:
    """(module name, attribute) of `reference`: ``"module:attr"``; with a `path`, also a bare ``"attr"`` (the module
    named after the file's stem, as verl's ``custom_reward_function {path, name}``). None when it has neither form
    (the caller words that)."""
    module_name, sep, attr = reference.rpartition(":")
    if not sep and path is not None:
        module_name, sep, attr = Path(path).stem, ":", reference
    if not sep or not module_name or not attr:
        return None
    return module_name, attr


def load_attribute(reference: str, path: Optional[Union[str, Path]] = None) -> Any:
    """The object `reference` names (`split_reference`): from the module imported from `sys.path`, or from the file
    `path` (absolute, or from the working directory) loaded under its private module name.

    Raises:
        ImportFailure: a malformed reference, a missing file, a directory or a file that is not `.py`, an import
            that fails (its exception's type and one-line text), or no such attribute.
    """
    parts = split_reference(reference, path)
    if parts is None:
        raise ImportFailure(f"{reference!r}: expected 'package.module:name'")
    module_name, attr = parts
    where = module_name
    try:
        if path is not None:
            file = Path(path).expanduser().resolve()
            where = str(file)
            if file.is_dir():
                raise ImportFailure(f"path {file}: a directory; expected a .py file")
            if not file.is_file():
                raise ImportFailure(f"path {file}: file not found")
            if file.suffix != ".py":
                raise ImportFailure(f"path {file}: expected a .py file, got a {file.suffix or 'suffixless'} file")
            module = _load_file(file)
        else:
            module = importlib.import_module(module_name)
    except ImportFailure:
        raise
    except Exception as err:
        raise ImportFailure(f"cannot import {where}: {type(err).__name__}: {one_line(err)}") from None
    if not hasattr(module, attr):
        raise ImportFailure(f"{where} has no attribute {attr!r}")
    return getattr(module, attr)


def _load_file(file: Path):
    """The module of the .py `file`, executed once per process under its private name."""
    digest = hashlib.sha1(str(file).encode()).hexdigest()[:12]
    private = f"astrai_user_{digest}_{file.stem.replace('.', '_').replace('-', '_')}"
    module = sys.modules.get(private)
    if module is None:
        spec = importlib.util.spec_from_file_location(private, file)
        module = importlib.util.module_from_spec(spec)
        sys.modules[private] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[private]
            raise
    return module
