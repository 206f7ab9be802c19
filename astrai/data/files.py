"""Data files: where a data path points (a file, a shipped asset ``builtin:<name>``, a generated set) and the one
error every loader raises (`DataError`: one line naming the file, line or row, and field), with the jsonl reader
the loaders share."""

from __future__ import annotations

import json
import re
from importlib import resources
from pathlib import Path
from typing import Iterator

__all__ = ["BUILTIN_PREFIX", "DataError", "builtin_names", "generated_records", "jsonl_objects",
           "resolve_prompt_path"]

BUILTIN_PREFIX = "builtin:"
_SURROGATE = re.compile("[\ud800-\udfff]")
"""A lone surrogate in a str (`json.loads` joins a valid pair of escapes into one character)."""


def _generated() -> dict:
    """The generated built-in sets by name: builtin:arithmetic[_test, _reworded] and builtin:tool_arithmetic[_test]
    (imported here, not at import time, so that ``python -m astrai.data.arithmetic`` and ``python -m
    astrai.data.tool_arithmetic`` run their module only once)."""
    from astrai.data.arithmetic import GENERATED as arithmetic
    from astrai.data.tool_arithmetic import GENERATED as tool_arithmetic

    return {**arithmetic, **tool_arithmetic}


def _generator_files() -> dict[str, str]:
    """File name -> the command line (without ``--out DIR``) of the data generator that writes it, named when such
    a file is missing (imported when needed, as `_generated`)."""
    from astrai.data import arithmetic, tool_arithmetic

    return {module.SFT_FILE: module.COMMAND for module in (arithmetic, tool_arithmetic)}


class DataError(ValueError):
    """A prompt file is missing or malformed, or a sampler state does not fit its dataset."""


def builtin_names() -> list[str]:
    """Names usable as ``builtin:<name>``: the ``.jsonl`` files in ``astrai/data/assets`` and the generated
    sets (`_generated`)."""
    assets = resources.files("astrai.data") / "assets"
    files = [p.name[: -len(".jsonl")] for p in assets.iterdir() if p.name.endswith(".jsonl")] \
        if assets.is_dir() else []
    return sorted(set(files) | set(_generated()))


def generated_records(path: str | Path) -> list[dict] | None:
    """The rows of a generated built-in set (``builtin:arithmetic``, ...) as dicts, or None for any other path."""
    text = str(path)
    generated = _generated()
    if not text.startswith(BUILTIN_PREFIX) or text[len(BUILTIN_PREFIX):] not in generated:
        return None
    return generated[text[len(BUILTIN_PREFIX):]]()


def resolve_prompt_path(path: str | Path, *, field: str = "data.path") -> Path:
    """Resolve a data path or ``builtin:<name>`` (a shipped asset) to an existing file.

    Args:
        path: a filesystem path (``~`` is expanded) or ``builtin:<name>``.
        field: the config key or option named in errors.

    Returns:
        The path of an existing regular file.

    Raises:
        DataError: ``<field>: file not found: X`` (with the command that writes X when it is a file of
            `_generator_files`), ``<field>: unknown built-in prompt set: builtin:X`` (listing
            the available ones), ``<field>: not a file: X`` for a directory, or, for a generated set
            (which has no file), ``<field>: builtin:X is a generated question/answer prompt set ...``.
    """
    text = str(path)
    if text.startswith(BUILTIN_PREFIX):
        name = text[len(BUILTIN_PREFIX):]
        if name in _generated():
            raise DataError(f"{field}: {text} is a generated question/answer prompt set, usable by the train types "
                            "that sample online and by evaluation, not as a training-record file")
        resolved = Path(str(resources.files("astrai.data") / "assets" / f"{name}.jsonl"))
        if name not in builtin_names() or not resolved.is_file():  # not a path: "builtin:../x" names nothing
            choices = ", ".join(BUILTIN_PREFIX + n for n in builtin_names()) or "none"
            raise DataError(f"{field}: unknown built-in prompt set: {text} (the built-in ones: {choices})")
        return resolved
    resolved = Path(text).expanduser()
    if not resolved.exists():
        writer = _generator_files().get(resolved.name)
        hint = (f" (written by `{writer} --out {resolved.parent}`, with the options the recipe's header names)"
                if writer else "")
        raise DataError(f"{field}: file not found: {resolved}{hint}")
    if not resolved.is_file():
        raise DataError(f"{field}: not a file: {resolved}")
    return resolved


def jsonl_objects(path: Path) -> Iterator[tuple[str, dict]]:
    """(location, object) for each non-blank line of a jsonl file; DataError for bad bytes, JSON or non-objects."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path} line {lineno}"
            try:
                line = raw.decode("utf-8").strip()
            except UnicodeDecodeError as e:
                raise DataError(f"{where}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
            if lineno == 1:
                line = line.lstrip("\ufeff")
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: invalid JSON: {e.msg} (column {e.colno})") from None
            if not isinstance(obj, dict):
                raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            check_text(obj, where)
            yield where, obj


def check_json_text(path: Path) -> None:
    """`check_text` over a .json file's rows (a top-level list: "<file> row N"), read with Python's JSON parser: the
    one `datasets` uses turns a lone surrogate into U+FFFD without a word. A file Python cannot parse is left to
    `datasets` to report."""
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except ValueError:
        return
    if isinstance(data, list):
        for number, row in enumerate(data, start=1):
            check_text(row, f"{path} row {number}")
    else:
        check_text(data, str(path))


def check_text(value, where: str, field: str = "") -> None:
    """DataError when a string in `value` (a row: nested dicts and lists) holds a lone surrogate, such as the escape
    `\\ud800` in valid JSON: half of a UTF-16 pair, no character, which no tokenizer or UTF-8 writer accepts. One
    line naming `where` (file and line or row), the field and the position."""
    if isinstance(value, str):
        bad = _SURROGATE.search(value)
        if bad is not None:
            raise DataError(f"{where}: {'field ' + field if field else 'a key'} holds a lone surrogate "
                            f"\\u{ord(bad.group()):04x} at character {bad.start()} (half of a UTF-16 pair, not text): "
                            "the file was written from broken text; fix or drop this row")
    elif isinstance(value, dict):
        for key, item in value.items():
            check_text(key, where, field)
            check_text(item, where, f"{field}[{key!r}]" if field else repr(key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            check_text(item, where, f"{field}[{index}]")
