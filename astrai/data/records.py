"""Records from local jsonl / json / parquet / csv files, `datasets.save_to_disk` directories or Hugging Face
dataset ids (``org/name[@revision][:config[:split]]``, `astrai.data.hub`), through the `datasets` library (jsonl
is parsed line by line first, so a broken line is named by its number).

Used by the offline train types (sft, dpo, seq, grpo) (`load_records`) and by the prompt sets (`read_rows`). `builtin:<name>` resolves to
``astrai/data/assets/<name>.jsonl`` shipped with the package (small example sets for the example configs).
Every problem is a `DataError` with a one-line message naming the file and, for a missing field, the config
key that names it and the fields that are present.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from astrai.data.files import BUILTIN_PREFIX, DataError, jsonl_objects, resolve_prompt_path
from astrai.data.hub import HubDataset, load_hub_dataset, parse_dataset_id
from astrai.deps import MissingDependencyError, import_optional

BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
"""File suffix -> `datasets` builder name (a directory is read with `datasets.load_from_disk`)."""
SAVED_DATASET_FILES = ("dataset_info.json", "state.json")
"""What `datasets.Dataset.save_to_disk` writes into its directory (a `DatasetDict` writes dataset_dict.json)."""


def _resolve(path: str | Path, field: str) -> Path:
    """A data file (`resolve_prompt_path`) or a saved dataset directory; DataError naming `field` otherwise."""
    text = str(path)
    if not text.startswith("builtin:") and Path(text).expanduser().is_dir():
        directory = Path(text).expanduser()
        if not any((directory / name).is_file() for name in SAVED_DATASET_FILES + ("dataset_dict.json",)):
            raise DataError(f"{field}: {directory} is a directory but not one written by datasets' save_to_disk "
                            f"(no {' / '.join(SAVED_DATASET_FILES)})")
        return directory
    resolved = resolve_prompt_path(path, field=field)
    if resolved.suffix.lower() not in BUILDERS:
        raise DataError(f"{field}: unsupported file type {resolved.suffix!r} of {resolved} "
                        f"(expected one of {', '.join(BUILDERS)}, or a save_to_disk directory)")
    return resolved


def _source(path: str | Path, field: str) -> Path | HubDataset:
    """A local data file or saved dataset directory (`_resolve`), or the Hugging Face dataset id `path` spells when
    no such local path exists (a local path always wins)."""
    text = str(path)
    if not text.startswith(BUILTIN_PREFIX) and not Path(text).expanduser().exists():
        spec = parse_dataset_id(text)
        if spec is not None:
            return spec
    return _resolve(path, field)


def _dataset(resolved: Path) -> Any:
    """The `datasets.Dataset` of a resolved file or directory (a `DatasetDict` directory: its train split)."""
    if resolved.is_dir():
        return _read_saved(resolved)
    return _read(BUILDERS[resolved.suffix.lower()], resolved)


def read_rows(path: str | Path, *, field: str = "data.path") -> tuple[Path | str, list[tuple[str, dict]]]:
    """(resolved path, [(location, row)]) of a data file, saved dataset or Hugging Face dataset id, rows in order,
    every column kept. For an id the "path" is the id with its split (``openai/gsm8k:main:train``; a string).

    Locations are "<file> line N" for jsonl (blank lines are skipped and not counted as rows) and
    "<file> row N" otherwise.

    Raises:
        DataError: one line naming `field` or the file: not found, unsupported type, unreadable content; for an id
            what `astrai.data.hub.load_hub_dataset` raises (not cached offline, no such config or split, ...).
    """
    resolved = _source(path, field)
    if isinstance(resolved, HubDataset):
        label, dataset = load_hub_dataset(resolved, field=field)
        return label, [(f"{label} row {i}", row) for i, row in enumerate(dataset.to_list(), start=1)]
    if resolved.is_file() and resolved.suffix.lower() == ".jsonl":
        return resolved, list(jsonl_objects(resolved))
    rows = _dataset(resolved).to_list()
    return resolved, [(f"{resolved} row {i}", row) for i, row in enumerate(rows, start=1)]


def load_records(path: str | Path, fields: Mapping[str, str], *, optional: Mapping[str, str] = {}) -> list[dict]:
    """Rows of a local data file or Hugging Face dataset as dicts holding the requested fields.

    Args:
        path: a .jsonl / .json / .parquet / .csv file, a `save_to_disk` directory, ``builtin:<name>``, or a
            dataset id ``org/name[@revision][:config[:split]]`` (split default: its only one, else ``train``).
        fields: config key -> field name that every row must hold non-null (e.g.
            ``{"data.messages_field": "messages"}``).
        optional: config key -> field name kept when the file has that column (rows may hold null).

    Returns:
        one dict per row (file order) with the present field names as keys (at least one row).

    Raises:
        DataError: file not found / unsupported suffix / unreadable or malformed content / no rows / a missing
            column or a null value in a required field (naming the config key and 1-based row); a dataset id not
            cached offline or not loadable (`astrai.data.hub.load_hub_dataset`).
    """
    resolved = _source(path, "data.path")
    if isinstance(resolved, HubDataset):
        resolved, dataset = load_hub_dataset(resolved, field="data.path")
    else:
        dataset = _dataset(resolved)
    present = list(dataset.column_names)
    for key, name in fields.items():
        if name not in present:
            raise DataError(f"{resolved}: missing field {name!r} ({key}); present fields: {', '.join(present)}")
    keep = list(fields.values()) + [n for n in optional.values() if n in present]
    rows = dataset.select_columns(keep).to_list()
    if not rows:
        raise DataError(f"{resolved}: no records")
    for number, row in enumerate(rows, start=1):
        for key, name in fields.items():
            if row[name] is None:
                raise DataError(f"{resolved} row {number}: field {name!r} ({key}) is null")
    return rows


def _datasets(path: Path) -> Any:
    """The `datasets` module, or DataError naming `path` when it is missing or installed but failing to import."""
    try:
        return import_optional("datasets", needed_by=f"{path}: reading it", install="pip install datasets")
    except MissingDependencyError as err:
        raise DataError(str(err)) from None


def _read(builder: str, path: Path) -> Any:
    """`datasets.load_dataset(builder, data_files=path)` (train split, in memory), errors as one-line DataError.

    A .jsonl file is parsed line by line first, so a broken line is named by its number (`datasets` reports
    only that the build failed)."""
    datasets = _datasets(path)

    if path.suffix.lower() == ".jsonl" and sum(1 for _ in jsonl_objects(path)) == 0:  # every line parsed
        raise DataError(f"{path}: no records (the file is empty or holds only blank lines)")
    if path.suffix.lower() == ".json":  # a lone surrogate, which datasets would silently replace
        from astrai.data.files import check_json_text

        check_json_text(path)

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    try:
        return datasets.load_dataset(builder, data_files=str(path), split="train", keep_in_memory=True)
    except Exception as err:  # datasets/pyarrow raise many types; the message is what the user needs
        text = " ".join(str(err).split())[:300]
        raise DataError(f"{path}: cannot read as {builder}: {type(err).__name__}: {text}") from None


def _read_saved(directory: Path) -> Any:
    """`datasets.load_from_disk(directory)` (a `DatasetDict`: its "train" split), errors as one-line DataError."""
    datasets = _datasets(directory)

    datasets.disable_progress_bars()
    try:
        loaded = datasets.load_from_disk(str(directory), keep_in_memory=True)
    except Exception as err:  # datasets/pyarrow raise many types
        text = " ".join(str(err).split())[:300]
        raise DataError(f"{directory}: cannot read as a saved dataset: {type(err).__name__}: {text}") from None
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise DataError(f"{directory}: a saved DatasetDict without a 'train' split (splits: "
                            f"{', '.join(loaded)})")
        loaded = loaded["train"]
    return loaded


def require_str(row: Mapping[str, Any], name: str, key: str, where: str) -> str:
    """`row[name]` when it is a string, else a DataError naming `key` (the config key) and `where` (row)."""
    value = row[name]
    if not isinstance(value, str):
        raise DataError(f"{where}: field {name!r} ({key}) must be a string, got {type(value).__name__}")
    return value


def check_token_ids(value: Any, vocab_size: int, *, field: str, where: str) -> list[int]:
    """`value` as a list of int token ids when it is a list of integers in `[0, vocab_size)`. Integral floats
    count as integers (`datasets` reads a whole column as floats when one of its values is fractional).

    Raises:
        DataError: one line naming `where` (file and row), `field`, the first bad position and value.
    """
    if not isinstance(value, list):
        raise DataError(f"{where}: field {field!r} must be a list of token ids, got {type(value).__name__}")
    ids = []
    for position, token in enumerate(value):
        integral = isinstance(token, int) or (isinstance(token, float) and token.is_integer())
        if isinstance(token, bool) or not integral or not 0 <= token < vocab_size:
            raise DataError(f"{where}: field {field!r}[{position}] = {token!r} is not a token id of the "
                            f"vocabulary [0, {vocab_size})")
        ids.append(int(token))
    return ids
