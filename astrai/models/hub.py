"""Hugging Face Hub ids (`Qwen/Qwen2.5-0.5B-Instruct`), fetched or found in the local cache through `huggingface_hub`.

`download_model` returns the snapshot directory of a model repository (`snapshot_download`, only the files astrai
reads: config, safetensors weights, tokenizer and generation config, PEFT adapter files), `download_file` one file
of a repository (`hf_hub_download`: a `.gguf` of a GGUF repository). Both honour, read when they are called:

- `HF_HUB_OFFLINE` (or `TRANSFORMERS_OFFLINE`) = 1: nothing is downloaded, the cache alone answers
  (`local_files_only`);
- `HF_HUB_CACHE` (or the older `HUGGINGFACE_HUB_CACHE`), else `HF_HOME/hub`, else `$XDG_CACHE_HOME/huggingface/hub`,
  else `~/.cache/huggingface/hub`: the cache, in huggingface_hub's layout (`models--org--name/snapshots/<commit>/`
  and `refs/<branch or tag>`);
- `HF_ENDPOINT` (a mirror) and `HF_TOKEN` (private and gated repositories), as huggingface_hub reads them.

Online, a Hub that cannot be reached falls back to the cache (huggingface_hub's own behaviour). A repository that
is neither reachable nor cached is a `HubError` (a `FileNotFoundError`) in one line naming the id, the revision when
one was asked for, and the cache directory looked in.

`datasets` reads the same variables (`HF_DATASETS_CACHE`, else `HF_HOME/datasets`, for its prepared Arrow files:
`datasets_cache_dir`); `astrai.data.hub` loads data ids with it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional

__all__ = ["FILE_SUFFIXES", "HubError", "MODEL_FILES", "cached_repo_files", "datasets_cache_dir", "download_file",
           "download_model", "hf_home", "hub_cache_dir", "hub_offline", "is_hub_file", "is_hub_id", "offline_reason",
           "split_hub_file"]

MODEL_FILES = ("config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
               "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
               "chat_template.json", "adapter_config.json")
"""What `download_model` fetches of a model repository (`allow_patterns`): what `load_pretrained` reads of a Hugging
Face directory or a PEFT adapter (`*.safetensors` covers the sharded weights and `adapter_model.safetensors`)."""

_TRUE = ("1", "ON", "YES", "TRUE")  # huggingface_hub's ENV_VARS_TRUE_VALUES
_PART = r"[A-Za-z0-9_](?:[\w.-]*[A-Za-z0-9_])?"  # huggingface_hub's repo-id rule: word characters at both ends
_REPO_ID = re.compile(rf"{_PART}/{_PART}")
_REPO_FILE = re.compile(rf"({_PART}/{_PART})/((?:[\w.-]+/)*[\w.-]+\.gguf)")


class HubError(FileNotFoundError):
    """A Hub id that is neither cached nor downloadable (offline, unreachable, no such repository or revision, no
    access): one line naming the id and the cache directory looked in."""


def hf_home() -> Path:
    """`HF_HOME`, else `$XDG_CACHE_HOME/huggingface`, else `~/.cache/huggingface` (as huggingface_hub and datasets
    compute it, but read now rather than when they were imported)."""
    default = os.path.join(os.getenv("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache")), "huggingface")
    return Path(os.path.expandvars(os.path.expanduser(os.getenv("HF_HOME", default))))


def hub_cache_dir() -> Path:
    """The Hub cache: `HF_HUB_CACHE`, else `HUGGINGFACE_HUB_CACHE`, else `hf_home()/hub`."""
    value = os.getenv("HF_HUB_CACHE") or os.getenv("HUGGINGFACE_HUB_CACHE") or str(hf_home() / "hub")
    return Path(os.path.expandvars(os.path.expanduser(value)))


def datasets_cache_dir() -> Path:
    """`datasets`' cache of prepared (Arrow) datasets: `HF_DATASETS_CACHE`, else `hf_home()/datasets`."""
    value = os.getenv("HF_DATASETS_CACHE") or str(hf_home() / "datasets")
    return Path(os.path.expandvars(os.path.expanduser(value)))


def offline_reason() -> Optional[str]:
    """`"HF_HUB_OFFLINE=1"` (or the variable that set it) when the Hub must not be contacted, else None."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        value = os.getenv(name, "")
        if value.strip().upper() in _TRUE:
            return f"{name}={value.strip()}"
    return None


def hub_offline() -> bool:
    """Whether `HF_HUB_OFFLINE` (or `TRANSFORMERS_OFFLINE`, `HF_DATASETS_OFFLINE`) is set to a true value now."""
    return offline_reason() is not None


FILE_SUFFIXES = (".gguf", ".safetensors", ".bin", ".pt", ".jsonl", ".json", ".parquet", ".csv", ".arrow", ".txt",
                 ".yaml", ".yml", ".py")
"""Names ending so are read as (missing) file paths, never as Hub ids: `data/train.jsonl` is a file."""


def is_hub_id(text: str) -> bool:
    """Whether `text` is spelled as a Hub repository id `org/name` (one slash; letters, digits, `_ . -`, not `--`
    or `..`, no `.git` ending, at most 96 characters) and not as a file (`FILE_SUFFIXES`). Says nothing of whether
    it exists."""
    text = str(text)
    return (_REPO_ID.fullmatch(text) is not None and "--" not in text and ".." not in text
            and not text.endswith(".git") and len(text) <= 96 and not text.lower().endswith(FILE_SUFFIXES))


def split_hub_file(text: str) -> Optional[tuple[str, str]]:
    """`(repo id, file)` of `org/name/<path>.gguf` (a file inside a Hub repository), else None."""
    match = _REPO_FILE.fullmatch(str(text))
    if match is None or not is_hub_id(match.group(1)) or ".." in match.group(2):
        return None
    return match.group(1), match.group(2)


def is_hub_file(text: str) -> bool:
    """Whether `text` is spelled `org/name/<path>.gguf`: a GGUF file inside a Hub repository."""
    return split_hub_file(text) is not None


def _where(repo_id: str, revision: Optional[str]) -> str:
    return repo_id if revision in (None, "main") else f"{repo_id} (revision {revision})"


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [""])[0][:150]


def _hub_error(err: BaseException, what: str, repo_id: str, revision: Optional[str], cache: Path,
               offline: Optional[str], fetch: str) -> Exception:
    """The one-line error for a failed look-up or download of `repo_id` (`err` from huggingface_hub)."""
    from huggingface_hub import errors

    where = _where(repo_id, revision)
    copy = (f"download it where the Hub is reachable ({fetch}) and copy that cache here, or point HF_HOME / "
            f"HF_HUB_CACHE at a cache that holds it")
    if isinstance(err, errors.HFValidationError):
        return HubError(f"{what} {repo_id}: not a valid Hub id or revision ({_first_line(err)})")
    if isinstance(err, errors.RevisionNotFoundError):
        return HubError(f"{what} {repo_id}: the Hub has no revision {revision!r} of it (a branch, tag or commit "
                        "hash is expected)")
    if isinstance(err, errors.GatedRepoError):
        return HubError(f"{what} {repo_id} is gated on the Hub: accept its terms on its page, then log in "
                        "(hf auth login) or set HF_TOKEN")
    if isinstance(err, errors.RepositoryNotFoundError):
        return HubError(f"{what} {repo_id}: no such repository on the Hub (or a private one: log in with "
                        "hf auth login or set HF_TOKEN), and not in the cache " + str(cache))
    if isinstance(err, (errors.LocalEntryNotFoundError, OSError)):
        if offline:
            return HubError(f"{what} {where} is not in the Hugging Face cache {cache} ({offline}: nothing is "
                            f"downloaded); {copy}")
        cause = err.__cause__ or err.__context__
        reason = f"{type(cause).__name__}: {_first_line(cause)}" if cause is not None else _first_line(err)
        return HubError(f"{what} {where}: the Hub cannot be reached ({reason}) and it is not in the Hugging Face "
                        f"cache {cache}; {copy}")
    return HubError(f"{what} {where}: {type(err).__name__}: {_first_line(err)} (cache {cache})")


def download_model(repo_id: str, *, revision: Optional[str] = None, what: str = "model") -> Path:
    """The local snapshot directory of model repository `repo_id` at `revision` (default: its main branch), from
    the cache, downloaded first when online (`MODEL_FILES` only).

    Args:
        repo_id: `org/name` (`is_hub_id`).
        revision: a branch, tag or commit hash; None = `main`.
        what: how messages name the model (`model`, `reward.model_path`).

    Raises:
        HubError: offline (or the Hub unreachable) and not cached, no such repository or revision, no access; one
            line naming the id and the cache directory.
    """
    from huggingface_hub import errors, snapshot_download

    cache, offline = hub_cache_dir(), offline_reason()
    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=bool(offline),
                                      allow_patterns=list(MODEL_FILES), endpoint=os.getenv("HF_ENDPOINT") or None))
    except getattr(errors, "IncompleteSnapshotError", ()) as err:  # some listed files absent: astrai checks its own
        if getattr(err, "snapshot_path", None):
            return Path(err.snapshot_path)
        raise _hub_error(err, what, repo_id, revision, cache, offline, f"hf download {repo_id}") from None
    except Exception as err:  # huggingface_hub's errors, and the HTTP client's beneath them
        raise _hub_error(err, what, repo_id, revision, cache, offline, f"hf download {repo_id}") from None


def download_file(repo_id: str, filename: str, *, revision: Optional[str] = None, what: str = "model") -> Path:
    """The local path of `filename` in model repository `repo_id` at `revision` (`hf_hub_download`): from the cache,
    downloaded first when online.

    Raises:
        HubError: as `download_model` (one line naming the id, the file and the cache directory).
    """
    from huggingface_hub import hf_hub_download

    cache, offline = hub_cache_dir(), offline_reason()
    try:
        return Path(hf_hub_download(repo_id, filename, revision=revision, cache_dir=cache,
                                    local_files_only=bool(offline), endpoint=os.getenv("HF_ENDPOINT") or None))
    except Exception as err:  # huggingface_hub's errors, and the HTTP client's beneath them
        from huggingface_hub import errors

        if isinstance(err, errors.EntryNotFoundError) and not isinstance(err, errors.LocalEntryNotFoundError):
            raise HubError(f"{what} {repo_id}/{filename}: the repository {_where(repo_id, revision)} has no file "
                           f"{filename}") from None
        raise _hub_error(err, f"{what} file {filename} of", repo_id, revision, cache, offline,
                         f"hf download {repo_id} {filename}") from None


def cached_repo_files(snapshot: Path, pattern: str) -> list[str]:
    """Names of the files under `snapshot` matching `pattern` (sorted, relative): what a cached snapshot holds."""
    return sorted(str(p.relative_to(snapshot)) for p in snapshot.rglob(pattern) if p.is_file())
