"""Hugging Face dataset ids as data paths: ``org/name[@revision][:config[:split]]`` (``openai/gsm8k:main:train``),
loaded with `datasets.load_dataset`.

One string carries the whole choice, so it works wherever a data path goes (`data.path`, `data.eval_path`,
`data.mixture[i].path`, `python -m astrai.evaluate --data`); TRL's `dataset_name` is `data.path`, its
`dataset_config` and `dataset_train_split` are the ``:config:split`` parts. The split may use `datasets`' slicing
(``train[:500]``); without one, the dataset's only split, else ``train`` (``test`` for the held-out sets of
`data.eval_path` and ``--data``). A local file or directory that exists always wins over an id spelled the same.

Where the data comes from (`astrai.models.hub` reads the environment when called):

- offline (`HF_HUB_OFFLINE=1`), or online with the Hub unreachable: the repository's snapshot in the Hub cache
  (`HF_HUB_CACHE` / `HF_HOME/hub`: ``datasets--org--name/snapshots/<commit>/`` through ``refs/<revision>``, as
  `datasets` itself leaves it after an online load, found with `huggingface_hub.snapshot_download(...,
  local_files_only=True)`) loaded as a local dataset directory (its README's ``configs``, or its files by split
  name), else the prepared Arrow copy `datasets` keeps in `HF_DATASETS_CACHE` / `HF_HOME/datasets` (no revision
  can be checked there, so it is used only when none is asked for);
- online: `load_dataset(id, config, revision=<the commit the Hub names>)`, which downloads what it needs.

No repository code runs: a dataset that is a loading script (``name.py``, what `trust_remote_code` would run) is
refused in one line pointing at its Parquet export (revision ``refs/convert/parquet``). Every failure is a
`DataError` in one line naming the id and, for a dataset not found, the caches looked in.
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

from astrai.data.files import DataError
from astrai.deps import MissingDependencyError, import_optional
from astrai.models.hub import datasets_cache_dir, hub_cache_dir, is_hub_id, offline_reason

__all__ = ["EVAL_FIELDS", "HubDataset", "load_hub_dataset", "parse_dataset_id"]

EVAL_FIELDS = ("data.eval_path", "--data")
"""The data paths of held-out sets: a dataset id without a split reads its ``test`` split there."""

_ID = re.compile(r"(?P<repo>[^@:/\s]+/[^@:/\s]+)(?:@(?P<revision>[^:\s]+))?(?::(?P<config>[^:\s]*)"
                 r"(?::(?P<split>\S+))?)?")


@dataclass(frozen=True)
class HubDataset:
    """A dataset id as `parse_dataset_id` reads it: the repository, and the revision, config and split when
    given (None otherwise)."""

    repo_id: str
    revision: Optional[str] = None
    config: Optional[str] = None
    split: Optional[str] = None

    def __str__(self) -> str:
        text = self.repo_id + (f"@{self.revision}" if self.revision else "")
        if self.config or self.split:
            text += f":{self.config or ''}"
        return text + (f":{self.split}" if self.split else "")


def parse_dataset_id(text: str) -> Optional[HubDataset]:
    """The `HubDataset` of ``org/name[@revision][:config[:split]]`` (an empty config, ``org/name::test``, is the
    default one), or None when `text` is not spelled so (a file path, ``builtin:<name>``). Says nothing of whether
    the dataset exists."""
    match = _ID.fullmatch(str(text).strip())
    if match is None or not is_hub_id(match["repo"]):
        return None
    return HubDataset(match["repo"], match["revision"] or None, match["config"] or None, match["split"] or None)


def _datasets(field: str) -> Any:
    try:
        module = import_optional("datasets", needed_by=f"{field}: a Hugging Face dataset id",
                                 install="pip install datasets")
    except MissingDependencyError as err:
        raise DataError(str(err)) from None
    module.disable_progress_bars()
    module.logging.set_verbosity_error()
    return module


def _line(err: BaseException) -> str:
    return " ".join(str(err).split())[:300]


@contextlib.contextmanager
def _datasets_offline(datasets: Any) -> Iterator[None]:
    """`datasets` in offline mode for the block: it read `HF_HUB_OFFLINE` when it was imported, and the Arrow-cache
    look-up must not try the Hub (whatever the variable said then)."""
    names = [n for n in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE") if hasattr(datasets.config, n)]  # by version
    previous = {n: getattr(datasets.config, n) for n in names}
    for name in names:
        setattr(datasets.config, name, True)
    try:
        yield
    finally:
        for name, value in previous.items():
            setattr(datasets.config, name, value)


def _script(files: list[str], repo_id: str) -> Optional[str]:
    """The loading script among a repository's top-level `files` (``<name>.py``), else None."""
    name = repo_id.split("/")[1] + ".py"
    return name if name in files else None


def _refuse_script(spec: HubDataset, script: str, field: str) -> DataError:
    return DataError(f"{field}: {spec.repo_id} is a loading script ({script}), which needs trust_remote_code; astrai "
                     f"never runs a repository's code: use its Parquet export, {spec.repo_id}@refs/convert/parquet"
                     f":{spec.config or '<config>'}:{spec.split or 'train'}")


def _remote(spec: HubDataset, field: str) -> tuple[Optional[str], Optional[str]]:
    """(the commit `spec`'s revision names on the Hub, None) when the Hub answers, (None, why not) when it cannot
    be reached. DataError for a dataset, revision or access the Hub refuses, or a loading script."""
    from huggingface_hub import HfApi, errors

    try:
        info = HfApi(endpoint=os.getenv("HF_ENDPOINT") or None).dataset_info(spec.repo_id, revision=spec.revision)
    except errors.RevisionNotFoundError:
        raise DataError(f"{field}: the Hub has no revision {spec.revision!r} of dataset {spec.repo_id}") from None
    except errors.GatedRepoError:
        raise DataError(f"{field}: dataset {spec.repo_id} is gated on the Hub: accept its terms on its page, then "
                        "log in (hf auth login) or set HF_TOKEN") from None
    except errors.RepositoryNotFoundError:
        raise DataError(f"{field}: no dataset {spec.repo_id} on the Hub (or a private one: log in with hf auth "
                        "login or set HF_TOKEN)") from None
    except Exception as err:  # unreachable: connection, timeout, 5xx, offline mode set at import
        return None, f"the Hub cannot be reached ({type(err).__name__}: {_line(err)[:120]})"
    script = _script([s.rfilename for s in info.siblings or []], spec.repo_id)
    if script is not None:
        raise _refuse_script(spec, script, field)
    return info.sha, None


def _cached_snapshot(spec: HubDataset) -> Optional[Path]:
    """The dataset's snapshot directory in the Hub cache at `spec.revision` (`snapshot_download`, local files
    only; a snapshot holding only some files, as `datasets` leaves one, counts), else None."""
    from huggingface_hub import errors, snapshot_download

    try:
        return Path(snapshot_download(spec.repo_id, repo_type="dataset", revision=spec.revision,
                                      cache_dir=hub_cache_dir(), local_files_only=True))
    except getattr(errors, "IncompleteSnapshotError", ()) as err:
        return Path(err.snapshot_path) if getattr(err, "snapshot_path", None) else None
    except (errors.LocalEntryNotFoundError, OSError, ValueError):
        return None


def _load(datasets: Any, source: str, spec: HubDataset, field: str, **kwargs: Any) -> Any:
    """`load_dataset(source, spec.config, **kwargs)` (every split), errors as one-line DataError (a missing or
    unknown config named with the configs there are)."""
    try:
        return datasets.load_dataset(source, spec.config, cache_dir=str(datasets_cache_dir()), **kwargs)
    except Exception as err:  # datasets raises many types; its message says what is wrong (a config, a file)
        try:
            configs = list(datasets.get_dataset_config_names(source, **kwargs))
        except Exception:  # the configs cannot be listed either: datasets' own message
            configs = []
        if (spec.config is None and len(configs) > 1) or (spec.config is not None and configs
                                                          and spec.config not in configs):
            example = HubDataset(spec.repo_id, spec.revision, configs[0], spec.split)
            what = "has several configs" if spec.config is None else f"has no config {spec.config!r}; its configs are"
            raise DataError(f"{field}: dataset {spec.repo_id} {what} {', '.join(configs)}; name one: {example}") \
                from None
        raise DataError(f"{field}: cannot load dataset {spec}: {type(err).__name__}: {_line(err)}") from None


def _splits(datasets: Any, spec: HubDataset, field: str) -> tuple[Any, Any]:
    """(the DatasetDict of every split, how to reload it with a split argument) from where `spec` can be read."""
    offline = offline_reason()
    why = offline and f"{offline}: nothing is downloaded"
    if not offline:
        sha, why = _remote(spec, field)
        if sha is not None:
            kwargs = {"revision": sha}
            return _load(datasets, spec.repo_id, spec, field, **kwargs), (spec.repo_id, kwargs)
    snapshot = _cached_snapshot(spec)
    if snapshot is not None:
        script = _script([p.name for p in snapshot.iterdir()], spec.repo_id)
        if script is not None:
            raise _refuse_script(spec, script, field)
        return _load(datasets, str(snapshot), spec, field), (str(snapshot), {})
    if spec.revision is None:  # datasets' own prepared copy (it records no commit: only without a revision)
        with _datasets_offline(datasets):
            try:
                loaded = datasets.load_dataset(spec.repo_id, spec.config, cache_dir=str(datasets_cache_dir()))
            except Exception:  # not there (datasets raises FileNotFoundError, ConnectionError, ValueError)
                loaded = None
        if loaded is not None:
            return loaded, (spec.repo_id, {})
    where = spec.repo_id if spec.revision is None else f"{spec.repo_id} (revision {spec.revision})"
    raise DataError(f"{field}: Hugging Face dataset {where} is not in the cache {hub_cache_dir()} nor in "
                    f"{datasets_cache_dir()} ({why}); download it where the Hub is reachable (hf download "
                    f"{spec.repo_id} --repo-type dataset) and copy that cache here, or point HF_HOME / HF_HUB_CACHE "
                    "at a cache that holds it")


def load_hub_dataset(spec: HubDataset, *, field: str = "data.path") -> tuple[str, Any]:
    """(how messages name it, the `datasets.Dataset`) of the split of `spec` (its own, else the dataset's only
    split, else ``train``, or ``test`` for the `EVAL_FIELDS`), in memory.

    Raises:
        DataError: one line naming `field` and the id: not cached and not downloadable (naming the caches looked
            in), no such dataset, revision, config or split (listing the splits there are), no access, a loading
            script (trust_remote_code), `datasets` missing.
    """
    datasets = _datasets(field)
    every, (source, kwargs) = _splits(datasets, spec, field)
    if not isinstance(every, datasets.DatasetDict):
        every = datasets.DatasetDict({spec.split or "train": every})
    names = list(every)
    default = "test" if field in EVAL_FIELDS else "train"
    split = spec.split or (names[0] if len(names) == 1 else default)
    base = re.split(r"[\[+]", split, maxsplit=1)[0]
    if base not in every:
        raise DataError(f"{field}: dataset {spec.repo_id}{f' (config {spec.config})' if spec.config else ''} has no "
                        f"split {base!r}; its splits: {', '.join(names)} (name one: "
                        f"{spec.repo_id}:{spec.config or ''}:{names[0]})")
    label = str(HubDataset(spec.repo_id, spec.revision, spec.config, split))
    if split == base:
        return label, every[split]
    try:  # datasets' slicing (train[:500]) or joined splits: its own split syntax, from its cache now
        with contextlib.nullcontext() if kwargs else _datasets_offline(datasets):
            return label, datasets.load_dataset(source, spec.config, split=split,
                                                cache_dir=str(datasets_cache_dir()), **kwargs)
    except Exception as err:
        raise DataError(f"{field}: dataset {label}: split {split!r}: {type(err).__name__}: {_line(err)}") from None
