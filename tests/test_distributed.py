"""Choosing the engine (docs/distributed.md): configs/zero/*.yaml through accelerate's own launch code, launch modes
astrai cannot honour (exit 2, one line), the --local_rank argument, and a real 2-process launch (gloo, CPU)."""

import json
import os
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.run

from astrai.config import load_config
from astrai.distributed import STRATEGIES, LaunchError, launch, resolve_launch
from astrai.train import main, parse_args

REPO = Path(__file__).resolve().parents[1]
ZERO = REPO / "configs" / "zero"
SFT = REPO / "configs" / "examples" / "sft.yaml"
LAUNCH_VARS = ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP", "ACCELERATE_MIXED_PRECISION", "FSDP_VERSION",
               "ACCELERATE_DEEPSPEED_ZERO_STAGE", "ACCELERATE_DEEPSPEED_CONFIG_FILE", "LOCAL_RANK",
               "ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_env(config_file: Path, monkeypatch) -> dict:
    """The environment `accelerate launch --config_file FILE` gives its processes, captured in this process:
    accelerate's own launch code runs up to the call of torch.distributed.run that would start them."""
    from accelerate.commands.launch import launch_command, launch_command_parser

    captured = {}
    monkeypatch.setattr(torch.distributed.run, "run", lambda args: captured.update(os.environ))
    args = launch_command_parser().parse_args(["--config_file", str(config_file), "--main_process_port",
                                               str(free_port()), "script.py"])
    launch_command(args)
    assert captured, "accelerate did not reach torch.distributed.run"
    return captured


def launched(env: dict, *args, cwd=None, timeout=300) -> subprocess.CompletedProcess:
    """`args` run in a subprocess with OMP_NUM_THREADS=1 and `env` on top of this environment."""
    return subprocess.run(list(map(str, args)), env={**os.environ, "OMP_NUM_THREADS": "1", **env},
                          capture_output=True, text=True, timeout=timeout, cwd=cwd or REPO)


@pytest.fixture
def clean_env(monkeypatch):
    """No launch variables of the environment running the tests leak into a test."""
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_configs_zero_holds_one_launch_config_per_engine():
    assert sorted(p.stem for p in ZERO.glob("*.yaml")) == sorted(STRATEGIES)


@pytest.mark.parametrize("name", STRATEGIES)
def test_auto_selects_the_engine_of_each_launch_config(name, clean_env):
    env = launch_env(ZERO / f"{name}.yaml", clean_env)
    plan = resolve_launch("auto", env=env)
    assert (plan.strategy, plan.mixed_precision) == (name, "no")
    assert plan.source == ("default" if name == "ddp" else "accelerate launch config")
    assert resolve_launch(name, env=env).strategy == name  # an explicit strategy that agrees is fine
    other = "zero2" if name != "zero2" else "fsdp2"
    if name != "ddp":  # a plain multi-process launch asks for no engine: an explicit one then decides
        with pytest.raises(LaunchError, match=f"asks for {other} but the accelerate launch config asks for {name}"):
            resolve_launch(other, env=env)
    assert resolve_launch("auto", env={}).strategy == "ddp"


@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> Path:
    """12 short chats (the tiny tokenizer spells the built-in ones in more than 64 tokens)."""
    path = tmp_path_factory.mktemp("chats") / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"What is {i} + {i % 5}?"},
        {"role": "assistant", "content": f"{i} + {i % 5} = {i + i % 5}." + " Yes." * (i % 3)}]}) + "\n"
        for i in range(12)))
    return path


def sft_args(model_dir, out, data, *extra):
    return ["--config", str(SFT), "--model.path", str(model_dir), "--train.output_dir", str(out),
            "--data.path", str(data), "--data.max_length", "64", "--train.per_device_train_batch_size", "2",
            "--train.gradient_accumulation_steps", "1", "--train.progress_bar", "false", *map(str, extra)]


def _ds_json(tmp_path, **fields) -> str:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}, **fields}))
    return str(path)


DS = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"}
BAD_LAUNCHES = {
    "fsdp1": ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1"}, [], "fsdp_version 1"),
    "offload": ({**DS, "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "nvme"}, [], "offload_param_device: nvme"),
    "stage0": ({**DS, "ACCELERATE_DEEPSPEED_ZERO_STAGE": "0"}, [], "zero_stage 0"),
    "explicit": (DS, ["--distributed.strategy", "zero3"], "the job asks for zero3 but the accelerate launch"),
    "accumulation": ({**DS, "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "4"}, [], "gradient_accumulation_steps 4"),
    "ds_batch": ({"ACCELERATE_USE_DEEPSPEED": "true"}, [], "train_batch_size 64 contradicts the job (2)"),
    "ds_optimizer": ({"ACCELERATE_USE_DEEPSPEED": "true"}, [], "remove its 'optimizer' section"),
    "precision": ({"ACCELERATE_MIXED_PRECISION": "bf16"}, [], "mixed_precision bf16 contradicts the job"),
    "fp16_cpu": ({}, ["--train.fp16", "true", "--runtime.device", "cpu"], "train.fp16: fp16 mixed precision"),
    "bf16_and_fp16": ({}, ["--train.fp16", "true", "--train.bf16", "true"], "mutually exclusive"),
}


@pytest.mark.parametrize("case", BAD_LAUNCHES)
def test_launch_modes_astrai_cannot_honour_exit_2_with_one_line(case, tiny_model_dir, chats, tmp_path, clean_env,
                                                                capsys):
    env, extra, needle = BAD_LAUNCHES[case]
    if case == "ds_batch":
        env = {**env, "ACCELERATE_DEEPSPEED_CONFIG_FILE": _ds_json(tmp_path, train_batch_size=64)}
    if case == "ds_optimizer":
        env = {**env, "ACCELERATE_DEEPSPEED_CONFIG_FILE": _ds_json(tmp_path, optimizer={"type": "Adam"})}
    for name, value in env.items():
        clean_env.setenv(name, value)
    code = main(sft_args(tiny_model_dir, tmp_path / "run", chats, "--max_steps", 1, *extra))
    err = capsys.readouterr().err.strip()
    assert code == 2 and needle in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "run").exists()


def test_zero_without_deepspeed_installed_is_refused(clean_env):
    clean_env.setitem(sys.modules, "deepspeed", None)  # find_spec answers None: not installed
    with pytest.raises(LaunchError, match=r"zero3 needs the deepspeed package, which is not installed.*astrai\[deepspeed\]"):
        resolve_launch("zero3", env={})
    assert resolve_launch("fsdp2", env={}).strategy == "fsdp2"


def test_consistent_deepspeed_settings_and_bf16_on_cpu_are_accepted(tmp_path):
    path = _ds_json(tmp_path, train_batch_size="auto", gradient_accumulation_steps=2, gradient_clipping=1.0,
                    bf16={"enabled": True})
    env = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": path,
           "ACCELERATE_MIXED_PRECISION": "bf16", "ACCELERATE_GRADIENT_CLIPPING": "auto"}
    plan = resolve_launch("auto", mixed_precision="bf16", env=env)
    assert (plan.strategy, plan.mixed_precision, plan.deepspeed_config["gradient_accumulation_steps"]) == \
        ("zero2", "bf16", 2)
    launch.check_step_sizes(env, strategy=plan.strategy, deepspeed_config=plan.deepspeed_config,
                            micro_batch_size=4, accumulation_steps=2, max_grad_norm=1.0, world_size=2)
    with pytest.raises(LaunchError, match="gradient_accumulation_steps 2 contradicts the job"):
        launch.check_step_sizes(env, strategy=plan.strategy, deepspeed_config=plan.deepspeed_config,
                                micro_batch_size=4, accumulation_steps=1, max_grad_norm=1.0, world_size=2)


@pytest.mark.parametrize("argv", [["--local_rank=1"], ["--local_rank", "1"], ["--local-rank=1"]])
def test_local_rank_argument_of_the_deepspeed_launcher_is_accepted(argv):
    args, overrides = parse_args([*argv, "--config", "x.yaml", "--max_steps", "2"])
    assert (args.local_rank, args.config, overrides) == (1, "x.yaml", ["--max_steps", "2"])


def test_config_strategy_and_mixed_precision_fields():
    from astrai.config import ConfigError

    config = load_config(str(SFT))
    assert (config.distributed.strategy, config.train.mixed_precision) == ("auto", "no")
    assert load_config(str(SFT), ["--train.bf16", "true"]).train.mixed_precision == "bf16"
    assert load_config(str(SFT), ["--distributed.strategy", "zero3"]).distributed.strategy == "zero3"
    with pytest.raises(ConfigError, match="distributed.strategy"):
        load_config(str(SFT), ["--distributed.strategy", "fsdp"])


def test_one_process_metrics_pass_through_and_step_sizes_follow_the_train_type():
    from astrai.distributed import setup_distributed
    from astrai.trainer.loop import mean_over_ranks

    metrics = {"b": torch.tensor(2.0), "a": torch.tensor(3)}
    out = mean_over_ranks(metrics, setup_distributed("cpu"))
    assert out == metrics and all(out[k] is metrics[k] for k in metrics)
    ppo = load_config(str(REPO / "configs/examples/ppo.yaml"), ["--ppo.minibatch_size", "8", "--ppo.micro_batch_size",
                                                                "2"])
    from astrai import train_types
    assert train_types.get("online_ppo").step_sizes(ppo) == (2, 4)
    sft = load_config(str(SFT))
    assert train_types.get(sft.train.type).step_sizes(sft) == (4, 2)


def _probe(config: str, tmp_path) -> dict[int, dict]:
    """rank -> what tests/dist_probe.py found on that rank, launched with configs/zero/<config>.yaml."""
    proc = launched({}, sys.executable, "-m", "accelerate.commands.launch", "--config_file", ZERO / f"{config}.yaml",
                    "--main_process_port", free_port(), REPO / "tests" / "dist_probe.py", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    probes = {int(p.stem[4:]): json.loads(p.read_text()) for p in tmp_path.glob("rank*.json")}
    assert sorted(probes) == [0, 1], proc.stdout[-3000:]
    return probes


def _check_probe(probes: dict[int, dict], strategy: str) -> None:
    """Both ranks resolved `strategy`, share one process group, drew disjoint halves of each epoch and averaged
    their metrics; differing metric names are an error on every rank; `end_process_group` joined gloo's threads."""
    from astrai.data.prompts import epoch_order

    for rank, probe in probes.items():
        assert (probe["strategy"], probe["world_size"], probe["sum"]) == (strategy, 2, 3.0)
        assert probe["metrics"] == {"a": 0.5, "b": 6.0}
        assert probe["threads_left"] == 0, probe["threads_left"]  # none may run into the interpreter's exit
        assert "metrics differ across ranks" in probe["mismatch"]
        assert probe["drawn"] == 10 and probe["sampler_state"]["epoch"] == 2
        for epoch in range(2):
            assert probe["share"][5 * epoch:5 * epoch + 5] == epoch_order(10, seed=3, epoch=epoch)[rank::2]


def test_two_process_launch_with_a_zero_config_resolves_zero3_and_shares_the_data(tmp_path):
    _check_probe(_probe("zero3", tmp_path), "zero3")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ddp", "fsdp2", "zero1", "zero2"])
def test_two_process_launch_of_each_config(name, tmp_path):
    _check_probe(_probe(name, tmp_path), name)


@pytest.mark.slow
def test_fsdp1_launch_exits_2_with_one_line(tmp_path):
    config = tmp_path / "fsdp1.yaml"
    config.write_text((ZERO / "fsdp2.yaml").read_text().replace("fsdp_version: 2", "fsdp_version: 1"))
    proc = launched({}, sys.executable, "-m", "accelerate.commands.launch", "--config_file", config,
                    "--main_process_port", free_port(), "-m", "astrai.train", "--config", SFT, "--max_steps", 1,
                    "--train.output_dir", tmp_path / "run", "--model.path", "/nonexistent")
    assert proc.returncode != 0
    # each rank prints the line; the launcher stops the other rank when the first one exits
    assert proc.stderr.count("error: accelerate launch config: fsdp_version 1 is not supported") >= 1, \
        proc.stderr[-3000:]
    assert "exitcode  : 2" in proc.stderr


DOC_COMMAND = re.compile(r"^ +(accelerate launch --config_file \S+ +-m astrai\.train .*)$", re.M)
TINY_PPO = ["--max_steps", "1", "--rollout.batch_size", "4", "--ppo.minibatch_size", "2", "--ppo.micro_batch_size",
            "1", "--rollout.max_new_tokens", "6", "--train.progress_bar", "false", "--data.truncation", "left"]


def doc_commands() -> list[str]:
    """The `accelerate launch --config_file ...` command lines of the README and docs/distributed.md."""
    return [line for doc in (REPO / "README.md", REPO / "docs" / "distributed.md")
            for line in DOC_COMMAND.findall(doc.read_text())]


def test_doc_commands_name_every_launch_config_and_parse():
    from accelerate.commands.launch import launch_command_parser

    commands = doc_commands()
    named = set()
    for line in commands:
        parsed = launch_command_parser().parse_args(shlex.split(line)[2:])
        assert parsed.module and parsed.training_script == "astrai.train", line
        named.add(Path(parsed.config_file).stem)
        args, overrides = parse_args(parsed.training_script_args)
        load_config(str(REPO / args.config), overrides)
    assert named == set(STRATEGIES)


@pytest.mark.slow
@pytest.mark.parametrize("name", STRATEGIES)
def test_doc_command_trains_the_tiny_model_with_2_processes(name, tiny_model_dir, tmp_path):
    (line,) = {line for line in doc_commands() if f"configs/zero/{name}.yaml" in line}
    args = shlex.split(line)
    args[2:2] = ["--main_process_port", str(free_port())]
    out = tmp_path / "run"
    proc = launched({}, sys.executable, "-m", "accelerate.commands.launch", *args[2:], "--model.path", tiny_model_dir,
                    "--train.output_dir", out, *TINY_PPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1


@pytest.mark.parametrize("with_group", [False, True])
def test_exit_process_runs_the_exit_handlers_flushes_and_keeps_the_code(tmp_path, with_group):
    """A process with a process group ends without interpreter finalization (gloo's worker threads may still want
    the GIL then: `exit_process`); its atexit handlers still run, buffered output still arrives and the exit code
    is the job's. A process without one exits the ordinary way, with the same code."""
    script = tmp_path / "ends.py"
    group = ("import torch.distributed as d\n"
             "d.init_process_group('gloo', store=d.HashStore(), rank=0, world_size=1)\n"
             "d.all_reduce(__import__('torch').ones(3))\n") if with_group else ""
    script.write_text(
        "import atexit, pathlib, sys\n"
        f"{group}"
        "from astrai.distributed.context import exit_process, had_process_group\n"
        f"atexit.register(lambda: pathlib.Path({str(tmp_path / 'handler-ran')!r}).write_text('yes'))\n"
        "sys.stdout.write(f'group {had_process_group()}, no newline, still buffered')\n"
        "exit_process(7)\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 7, done.stderr
    assert done.stdout == f"group {with_group}, no newline, still buffered"
    assert (tmp_path / "handler-ran").read_text() == "yes"
