"""Hugging Face Hub ids (issue 41.1): `model.path: org/name` and `data.path: org/name[@revision][:config[:split]]`
load through huggingface_hub and datasets from a local cache that these tests build in huggingface_hub's layout
(`models--org--name/blobs`, `snapshots/<commit>/...` as links to the blobs, `refs/<branch or tag>`) or datasets'
(`org___name/<config>/<version>/<hash>/`), with `HF_HOME` in a temporary directory and `HF_HUB_OFFLINE=1` (or an
unreachable `HF_ENDPOINT`); nothing here reaches the network. A local path spelled as an id wins; an id neither
local nor cached is one line naming it and the cache looked in (exit code 2 from the command lines)."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from astrai.data import DataError, PromptDataset
from astrai.data.records import load_records
from astrai.models import load_pretrained, resolve_model_path

HubError = FileNotFoundError  # astrai.models.hub.HubError is one; the messages tell them apart

REPO = Path(__file__).resolve().parents[1]
MAIN, TAGGED = "a" * 40, "b" * 40  # two commits of the model repository: main, and the tag v1
MODEL, DATA = "astrai-test/tiny-llama", "astrai-test/math"
README = """---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train.jsonl
  - split: test
    path: main/test.jsonl
- config_name: socratic
  data_files:
  - split: train
    path: socratic/train.jsonl
---
# A GSM8K-shaped test set
"""


def _rows(n: int, tag: str) -> str:
    return "".join(json.dumps({"question": f"{tag}: what is {i} + 1?", "answer": f"#### {i + 1}"}) + "\n"
                   for i in range(n))


def write_hub_repo(cache: Path, repo_id: str, files: dict, *, commit: str, refs=("main",),
                   repo_type: str = "model") -> Path:
    """Put `files` (name -> bytes, str or a file to copy) into `cache` as huggingface_hub stores a download: each
    content once under blobs/<sha256>, linked from snapshots/<commit>/<name>; refs/<ref> holds the commit.
    Returns the snapshot directory."""
    repo = cache / f"{repo_type}s--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    for name, content in files.items():
        data = content.read_bytes() if isinstance(content, Path) else \
            content.encode() if isinstance(content, str) else content
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


def _tiny_model(path: Path, seed: int) -> Path:
    from single_turn_reference import tiny_model

    if seed == 0:
        return tiny_model(path)
    from safetensors.torch import save_file

    from astrai.models import AutoRegressiveLM, hf_state_dict, tiny_config, tiny_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = AutoRegressiveLM(tiny_config())
    save_file({k: v.contiguous() for k, v in hf_state_dict(model).items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(model.config.to_hf_dict()))
    tiny_tokenizer().save(path)
    return path


def _files(directory: Path) -> dict:
    return {p.name: p for p in directory.iterdir()}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two tiny models (seeds 0 and 1) as plain directories."""
    root = tmp_path_factory.mktemp("hub-models")
    return _tiny_model(root / "seed0", 0), _tiny_model(root / "seed1", 1)


@pytest.fixture
def hf_home(tmp_path, monkeypatch):
    """HF_HOME in a temporary directory, offline; the other cache variables unset. Returns HF_HOME."""
    home = tmp_path / "hf-home"
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_DATASETS_CACHE", "TRANSFORMERS_OFFLINE",
                 "HF_DATASETS_OFFLINE", "HF_ENDPOINT", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return home


@pytest.fixture
def cached(hf_home, models):
    """The Hub cache under HF_HOME holding MODEL (main: seed 0; tag v1: seed 1) and DATA (configs main, socratic)."""
    hub = hf_home / "hub"
    write_hub_repo(hub, MODEL, _files(models[0]), commit=MAIN)
    write_hub_repo(hub, MODEL, _files(models[1]), commit=TAGGED, refs=("v1",))
    write_hub_repo(hub, DATA, {"README.md": README, "main/train.jsonl": _rows(5, "train"),
                               "main/test.jsonl": _rows(3, "test"), "socratic/train.jsonl": _rows(2, "socratic")},
                   commit="c" * 40, repo_type="dataset")
    return hub


def _same_weights(model, directory: Path) -> bool:
    from safetensors.torch import load_file

    from astrai.models import hf_state_dict

    saved = load_file(str(directory / "model.safetensors"))
    return all(torch.equal(v, saved[k]) for k, v in hf_state_dict(model).items())


def _one_line(err: BaseException) -> str:
    text = str(err)
    assert "\n" not in text, text
    return text


# ---------------------------------------------------------------------------------------------------- models
def test_a_model_id_loads_from_the_cache_offline_at_its_revision(cached, models):
    path = resolve_model_path(MODEL)
    assert path == cached / "models--astrai-test--tiny-llama" / "snapshots" / MAIN
    model, tokenizer = load_pretrained(MODEL)
    assert _same_weights(model, models[0]) and tokenizer.vocab_size > 0
    tagged, _ = load_pretrained(MODEL, revision="v1")  # a tag
    assert _same_weights(tagged, models[1])
    assert _same_weights(load_pretrained(MODEL, revision=MAIN)[0], models[0])  # a commit hash
    with pytest.raises(HubError) as err:  # a revision the cache does not hold
        resolve_model_path(MODEL, revision="v2")
    line = _one_line(err.value)
    assert f"model {MODEL} (revision v2) is not in the Hugging Face cache {cached} (HF_HUB_OFFLINE=1" in line


def test_an_id_neither_local_nor_cached_is_one_line_naming_it_and_the_cache(cached, monkeypatch, tmp_path):
    with pytest.raises(HubError) as err:
        load_pretrained("Qwen/Qwen2.5-0.5B-Instruct")
    line = _one_line(err.value)
    assert line.startswith(f"model Qwen/Qwen2.5-0.5B-Instruct is not in the Hugging Face cache {cached} "
                           "(HF_HUB_OFFLINE=1: nothing is downloaded)"), line
    assert "hf download Qwen/Qwen2.5-0.5B-Instruct" in line
    assert type(err.value).__name__ == "HubError"  # a FileNotFoundError: every command line maps it to exit code 2
    other = tmp_path / "elsewhere"  # HF_HUB_CACHE wins over HF_HOME, read when loading
    monkeypatch.setenv("HF_HUB_CACHE", str(other))
    with pytest.raises(HubError, match=f"not in the Hugging Face cache {other} "):
        resolve_model_path(MODEL)
    write_hub_repo(other, MODEL, _files(cached / "models--astrai-test--tiny-llama" / "snapshots" / MAIN), commit=MAIN)
    assert resolve_model_path(MODEL).is_relative_to(other)


def test_a_local_path_spelled_as_an_id_wins(cached, models):
    local = Path(MODEL)  # relative to the test's working directory
    shutil.copytree(models[1], local)
    assert resolve_model_path(MODEL) == local
    assert _same_weights(load_pretrained(MODEL)[0], models[1])
    with pytest.raises(ValueError, match=f"^revision 'v1': picks a commit of a Hugging Face Hub id, but {MODEL} is a "
                                         "local directory"):
        resolve_model_path(MODEL, revision="v1")
    shutil.rmtree(local.parent)
    assert resolve_model_path(MODEL).is_relative_to(cached)
    not_an_id = Path("no/such/model/dir")  # more than org/name and no .gguf: a path, said as before
    with pytest.raises(FileNotFoundError, match=r"^model path no/such/model/dir does not exist: expected .*a Hugging "
                                                r"Face Hub id \(org/name"):
        resolve_model_path(not_an_id)


def test_an_unreachable_hub_falls_back_to_the_cache(cached, monkeypatch, models):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: the connection is refused
    assert _same_weights(load_pretrained(MODEL)[0], models[0])
    with pytest.raises(HubError) as err:
        resolve_model_path("astrai-test/not-cached")
    line = _one_line(err.value)
    assert "model astrai-test/not-cached: the Hub cannot be reached (" in line
    assert f"and it is not in the Hugging Face cache {cached};" in line


def test_a_model_that_needs_remote_code_is_refused_in_one_line(hf_home, models, tmp_path):
    config = json.loads((models[0] / "config.json").read_text())
    config.update(model_type="my_custom_lm", auto_map={"AutoModelForCausalLM": "modeling_my.MyForCausalLM"})
    files = {**_files(models[0]), "config.json": json.dumps(config), "modeling_my.py": "raise SystemExit(1)\n"}
    write_hub_repo(hf_home / "hub", "astrai-test/custom", files, commit=MAIN)
    with pytest.raises(ValueError) as err:
        load_pretrained("astrai-test/custom")
    assert _one_line(err.value).startswith("astrai-test/custom: needs trust_remote_code (config.json auto_map: "
                                           "modeling_my.MyForCausalLM, model_type 'my_custom_lm'); astrai never "
                                           "runs a repository's code and implements the model types llama")
    local = tmp_path / "custom"  # a local directory too, named by its path
    shutil.copytree(models[0], local)
    (local / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"^{local}: needs trust_remote_code"):
        load_pretrained(local)
    config["model_type"] = "llama"  # an auto_map beside a family astrai implements: its own code is used
    (local / "config.json").write_text(json.dumps(config))
    assert _same_weights(load_pretrained(local)[0], models[0])


def test_a_gguf_file_of_a_hub_repository(hf_home, tmp_path):
    from test_models import _write_tiny_gguf

    from astrai.models import AutoRegressiveLM, tiny_config

    torch.manual_seed(0)
    model = AutoRegressiveLM(tiny_config())
    _write_tiny_gguf(model, tmp_path / "tiny-Q8_0.gguf")
    write_hub_repo(hf_home / "hub", "astrai-test/tiny-GGUF", {"tiny-Q8_0.gguf": tmp_path / "tiny-Q8_0.gguf",
                                                              "README.md": "# GGUF\n"}, commit=MAIN)
    loaded, _ = load_pretrained("astrai-test/tiny-GGUF/tiny-Q8_0.gguf")
    assert loaded.config.num_hidden_layers == model.config.num_hidden_layers
    with pytest.raises(FileNotFoundError, match=r"^astrai-test/tiny-GGUF: its snapshot .* has no config.json .*name "
                                                r"one of its GGUF files: astrai-test/tiny-GGUF/tiny-Q8_0.gguf\)$"):
        load_pretrained("astrai-test/tiny-GGUF")
    with pytest.raises(HubError, match=r"^model file other.gguf of astrai-test/tiny-GGUF is not in the Hugging Face "
                                       f"cache {hf_home / 'hub'} "):
        load_pretrained("astrai-test/tiny-GGUF/other.gguf")


def test_hub_id_spelling():
    from astrai.data.hub import HubDataset, parse_dataset_id
    from astrai.models.hub import is_hub_id, split_hub_file

    assert is_hub_id("Qwen/Qwen2.5-0.5B-Instruct") and is_hub_id("openai/gsm8k")
    for text in ("gpt2", "./x/y", "/abs/path", "a/b/c", "org/na--me", "org/name.git", "org/.hidden", "~/x",
                 "models/tiny.gguf", "data/train.jsonl"):
        assert not is_hub_id(text), text
    assert split_hub_file("Qwen/Qwen2.5-0.5B-Instruct-GGUF/qwen2.5-0.5b-instruct-q8_0.gguf") == (
        "Qwen/Qwen2.5-0.5B-Instruct-GGUF", "qwen2.5-0.5b-instruct-q8_0.gguf")
    assert split_hub_file("org/name/model.safetensors") is None and split_hub_file("org/name") is None
    assert parse_dataset_id("openai/gsm8k:main:train[:100]") == HubDataset("openai/gsm8k", None, "main", "train[:100]")
    assert parse_dataset_id("org/data@refs/convert/parquet::test") == HubDataset("org/data", "refs/convert/parquet",
                                                                                 None, "test")
    assert parse_dataset_id("openai/gsm8k") == HubDataset("openai/gsm8k")
    for text in ("builtin:math_prompts", "prompts.jsonl", "data/train.parquet", "a/b/c.jsonl", "/abs/x:y"):
        assert parse_dataset_id(text) is None, text
    assert str(HubDataset("o/n", "v1", None, "test")) == "o/n@v1::test"


# ---------------------------------------------------------------------------------------------------- data
def test_a_dataset_id_loads_its_config_and_split_from_the_cache(cached):
    train = PromptDataset(f"{DATA}:main:train")
    assert len(train) == 5 and train.path == f"{DATA}:main:train"
    assert train[0].prompt == "train: what is 0 + 1?" and train[0].answer == "#### 1"
    assert len(PromptDataset(f"{DATA}:main")) == 5  # training: the train split
    held_out = PromptDataset(f"{DATA}:main", field="data.eval_path")  # held-out sets: the test split
    assert held_out.path == f"{DATA}:main:test" and held_out[0].prompt.startswith("test:")
    assert len(PromptDataset(f"{DATA}:socratic", field="data.eval_path")) == 2  # its only split
    assert len(PromptDataset(f"{DATA}:main:train[:2]")) == 2  # datasets' slicing
    rows = load_records(f"{DATA}:main:train", {"data.prompt_field": "question"})
    assert [r["question"] for r in rows][:2] == ["train: what is 0 + 1?", "train: what is 1 + 1?"]
    with pytest.raises(DataError) as err:
        PromptDataset(DATA)
    assert _one_line(err.value) == (f"data.path: dataset {DATA} has several configs main, socratic; name one: "
                                    f"{DATA}:main")
    with pytest.raises(DataError, match=f"^data.path: dataset {DATA} has no config 'nope'; its configs are main, "):
        PromptDataset(f"{DATA}:nope")
    with pytest.raises(DataError) as err:
        PromptDataset(f"{DATA}:main:validation")
    assert _one_line(err.value) == (f"data.path: dataset {DATA} (config main) has no split 'validation'; its "
                                    f"splits: train, test (name one: {DATA}:main:train)")


def test_a_dataset_id_not_cached_offline_is_one_line_naming_both_caches(cached, hf_home):
    with pytest.raises(DataError) as err:
        PromptDataset("openai/gsm8k:main:train", field="data.mixture[1].path")
    line = _one_line(err.value)
    assert line.startswith(f"data.mixture[1].path: Hugging Face dataset openai/gsm8k is not in the cache {cached} "
                           f"nor in {hf_home / 'datasets'} (HF_HUB_OFFLINE=1: nothing is downloaded)"), line
    with pytest.raises(DataError, match=rf"^data.path: Hugging Face dataset {DATA} \(revision v9\) is not in the "):
        PromptDataset(f"{DATA}@v9:main")


def test_a_local_path_spelled_as_a_dataset_id_wins(cached):
    assert len(PromptDataset(DATA + ":socratic")) == 2  # from the cache while there is no such local path
    local = Path(DATA)
    local.mkdir(parents=True)  # a directory that is not a saved dataset: refused as the directory it is
    with pytest.raises(DataError, match=f"^data.path: {DATA} is a directory but not one written by datasets' "):
        PromptDataset(DATA)
    local.rmdir()
    Path("astrai-test").joinpath("math:main:train").write_text(_rows(1, "local"))  # a file of that name
    with pytest.raises(DataError, match="unsupported file type"):  # read as the local file, not the Hub
        PromptDataset(f"{DATA}:main:train")


def test_datasets_own_arrow_cache_serves_an_id_without_a_revision(hf_home, tmp_path):
    from datasets.packaged_modules.json.json import Json

    (tmp_path / "train.jsonl").write_text(_rows(4, "arrow"))
    builder = Json(cache_dir=str(tmp_path / "build"), dataset_name="gsm8k", config_name="main",
                   data_files={"train": str(tmp_path / "train.jsonl")}, hash="0" * 16)
    builder.download_and_prepare()  # then laid out as load_dataset("openai/gsm8k", "main") leaves it
    target = hf_home / "datasets" / "openai___gsm8k"
    target.mkdir(parents=True)
    shutil.move(str(next((tmp_path / "build" / "gsm8k").glob("main*"))), str(target / "main"))
    records = PromptDataset("openai/gsm8k:main:train")
    assert len(records) == 4 and records[0].prompt == "arrow: what is 0 + 1?"


def test_a_dataset_loading_script_is_refused_as_remote_code(hf_home):
    write_hub_repo(hf_home / "hub", "astrai-test/scripted", {"scripted.py": "import os\n", "README.md": "# x\n"},
                   commit=MAIN, repo_type="dataset")
    with pytest.raises(DataError) as err:
        PromptDataset("astrai-test/scripted:default:train")
    assert _one_line(err.value) == ("data.path: astrai-test/scripted is a loading script (scripted.py), which needs "
                                    "trust_remote_code; astrai never runs a repository's code: use its Parquet "
                                    "export, astrai-test/scripted@refs/convert/parquet:default:train")


def test_an_unreachable_hub_serves_a_cached_dataset(cached, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    assert len(PromptDataset(f"{DATA}:main:train")) == 5
    with pytest.raises(DataError, match=r"^data.path: Hugging Face dataset astrai-test/other is not in the cache .*"
                                        r"\(the Hub cannot be reached \("):
        PromptDataset("astrai-test/other:main:train")


# ---------------------------------------------------------------------------------------------------- config
def test_config_names_revision_and_refuses_remote_code_and_split_fields():
    from astrai.config import ConfigError, config_from_dict, load_config

    assert load_config(None, ["--model_revision", "v1"]).model.revision == "v1"  # TRL's name
    assert config_from_dict({"model": {"path": MODEL, "revision": MAIN}}).model.revision == MAIN
    assert config_from_dict({}).model.revision is None
    with pytest.raises(ConfigError, match=r"^trust_remote_code: astrai never runs a repository's code"):
        load_config(None, ["--trust_remote_code", "true"])
    with pytest.raises(ConfigError, match=r"^model.trust_remote_code: astrai never runs"):
        config_from_dict({"model": {"trust_remote_code": False}})
    with pytest.raises(ConfigError, match=r"^dataset_config: a dataset id names its config and split in data.path: "
                                          r"org/name:config:split \(openai/gsm8k:main:train\)$"):
        load_config(None, ["--dataset_config", "main"])


# ---------------------------------------------------------------------------------------------------- entry points
def _online_job(tmp_path: Path, *extra: str) -> list:
    return ["--train.type", "online_grpo", "--model.path", MODEL, "--data.path", f"{DATA}:main:train",
            "--data.max_prompt_length", "64", "--rollout.batch_size", "2", "--rollout.max_new_tokens", "4",
            "--grpo.group_size", "2", "--grpo.minibatch_size", "4", "--grpo.micro_batch_size", "2",
            "--train.output_dir", str(tmp_path / "run"), "--train.max_steps", "1", "--train.report_to", "none",
            "--train.progress_bar", "false", "--data.truncation", "left", *extra]


def test_train_check_takes_ids_and_exits_2_with_one_line_for_an_uncached_one(cached, tmp_path, capsys):
    from astrai.train import main

    code = main([*_online_job(tmp_path, "--data.eval_path", f"{DATA}:main", "--train.eval_steps", "1",
                              "--model.revision", "v1"), "--check"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert f"model {MODEL} (" in out.out and f"from {DATA}:main:train" in out.out
    code = main([*_online_job(tmp_path, "--model.path", "Qwen/Qwen2.5-0.5B-Instruct"), "--check"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [f"error: model.path: model Qwen/Qwen2.5-0.5B-Instruct is not in the Hugging Face "
                                 f"cache {cached} "
                                 "(HF_HUB_OFFLINE=1: nothing is downloaded); download it where the Hub is reachable "
                                 "(hf download Qwen/Qwen2.5-0.5B-Instruct) and copy that cache here, or point "
                                 "HF_HOME / HF_HUB_CACHE at a cache that holds it"], err
    code = main([*_online_job(tmp_path, "--data.path", "openai/gsm8k:main:train"), "--check"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith(
        f"error: data.path: Hugging Face dataset openai/gsm8k is not in the cache {cached} nor in "), err


def test_python_m_astrai_train_trains_on_a_hub_model_and_dataset_offline(cached, hf_home, tmp_path):
    """The command line as a user runs it: the variables set before Python starts (huggingface_hub and datasets
    read them at import too)."""
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO),
           "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "astrai.train", *_online_job(tmp_path)], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert (tmp_path / "run" / "checkpoints" / "step-00000001").is_dir()
    missing = subprocess.run([sys.executable, "-m", "astrai.train", *_online_job(
        tmp_path, "--model.path", "astrai-test/absent", "--train.output_dir", str(tmp_path / "run-2"))],
                             env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert missing.returncode == 2 and missing.stderr.strip().splitlines() == [
        f"error: model.path: model astrai-test/absent is not in the Hugging Face cache {cached} (HF_HUB_OFFLINE=1: "
        "nothing is downloaded); download it where the Hub is reachable (hf download astrai-test/absent) and copy "
        "that cache here, or point HF_HOME / HF_HUB_CACHE at a cache that holds it"], missing.stderr[-2000:]


def test_lora_on_a_hub_base_records_the_id_and_revision_and_merges_back_offline(cached, models, tmp_path):
    pytest.importorskip("peft")
    from astrai.train import main

    out = tmp_path / "run"
    code = main(["--config", str(REPO / "configs/examples/sft.yaml"), "--model.path", MODEL, "--model.revision",
                 "v1", "--model.lora", "{r: 4, alpha: 8}", "--train.output_dir", str(out), "--max_steps", "1",
                 "--data.max_length", "128", "--train.progress_bar", "false", "--train.report_to", "none"])
    assert code == 0
    checkpoint = next((out / "checkpoints").glob("step-*"))
    adapter = json.loads((checkpoint / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == MODEL and adapter["revision"] == "v1"
    merged, _ = load_pretrained(checkpoint)  # the base found in the cache at v1 (seed 1), the adapter merged in
    base, _ = load_pretrained(MODEL, revision="v1")
    names = dict(merged.named_parameters())
    assert all(torch.equal(p, names[n]) for n, p in base.named_parameters() if "proj" not in n)  # untouched ones
    from astrai.models import hf_state_dict
    main_base = hf_state_dict(load_pretrained(MODEL)[0])
    assert not torch.equal(hf_state_dict(merged)["model.embed_tokens.weight"], main_base["model.embed_tokens.weight"])


def test_evaluate_and_serve_take_ids(cached, tmp_path, capsys):
    from astrai.evaluation.cli import main as evaluate
    from astrai.serve.__main__ import build_engine, parse_args

    out = tmp_path / "eval"
    code = evaluate(["--model", MODEL, "--revision", "v1", "--data", f"{DATA}:main", "--limit", "2",
                     "--max_new_tokens", "4", "--output_dir", str(out), "--no_progress_bar", "--device", "cpu",
                     "--max_prompt_length", "64", "--truncation", "left"])
    err = capsys.readouterr().err
    assert code == 0, err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["n"] == 2
    assert [json.loads(line)["question"] for line in (out / "results.jsonl").read_text().splitlines()] == [
        "test: what is 0 + 1?", "test: what is 1 + 1?"]  # the test split of the held-out set
    code = evaluate(["--model", "astrai-test/absent", "--data", f"{DATA}:main", "--output_dir", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "astrai-test/absent is not in the Hugging Face cache" in err[0], err
    engine, tokenizer, name, aliases = build_engine(parse_args(["--checkpoint", MODEL, "--revision", "v1",
                                                                "--device", "cpu"]))
    assert name == MODEL and aliases == ()
    with pytest.raises(HubError, match=f"astrai-test/absent is not in the Hugging Face cache {cached} "):
        build_engine(parse_args(["--checkpoint", "astrai-test/absent", "--device", "cpu"]))


def test_a_reward_model_id_loads_from_the_cache(hf_home, models, tmp_path):
    from safetensors.torch import load_file, save_file

    from astrai.models import load_reward_model

    state = {k: v for k, v in load_file(str(models[0] / "model.safetensors")).items() if k.startswith("model.")}
    hidden = state["model.embed_tokens.weight"].shape[1]
    state["score.weight"] = torch.full((1, hidden), 0.5)
    save_file(state, str(tmp_path / "model.safetensors"))
    files = {**_files(models[0]), "model.safetensors": tmp_path / "model.safetensors"}
    write_hub_repo(hf_home / "hub", "astrai-test/tiny-rm", files, commit=MAIN)
    model, _ = load_reward_model("astrai-test/tiny-rm")
    assert torch.equal(model.score.weight, state["score.weight"])
    with pytest.raises(HubError, match=r"^reward.model_path astrai-test/absent-rm is not in the Hugging Face cache"):
        load_reward_model("astrai-test/absent-rm")
