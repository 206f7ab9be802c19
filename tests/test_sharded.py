"""Sharded training with 2 processes over gloo on CPU (`torch.distributed.run`, one thread each): online_ppo and sft
under ddp, fsdp2, zero2 and zero3 train, checkpoint and resume; a resume (in the middle of a PPO rollout) is bitwise
exact; every engine's parameters stay within float rounding of ddp's after the same steps; the loss is a global
token mean (2 ranks x 1 x 4 == 2 x 4 x 1 == 1 process x 8); a resume on another world size continues or stops
with one line; the bf16 configuration builds and steps.

The default tier runs one sharded engine per check (fsdp2 for sft, zero3 for online_ppo: the two that partition
parameters; zero2 for the token mean); the slow tier (`pytest -m slow`) runs the full engine matrix.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]
ENGINES = ("ddp", "fsdp2", "zero2", "zero3")

pytest.importorskip("deepspeed")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun(*args: str, nproc: int = 2) -> subprocess.CompletedProcess:
    """`python -m torch.distributed.run --nproc_per_node N -m astrai.train ARGS` with one thread per rank."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "astrai-torch-extensions"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
           str(free_port()), "-m", "astrai.train", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


def why(done: subprocess.CompletedProcess) -> str:
    """A failed launch's story: every rank's own error lines (rank 0's come first in stderr and would be cut from
    its tail), then the tail."""
    ranks = [line for line in done.stderr.splitlines() if line.startswith("[rank")]
    return "\n".join(ranks[-60:]) + "\n...\n" + done.stderr[-1500:]


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    path = tmp_path_factory.mktemp("chats") / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"What is {i} + {i}?"},
                                                     {"role": "assistant", "content": f"{i} + {i} = {2 * i}."}]})
                            + "\n" for i in range(16)))
    return path


def sft_args(model_dir, data, out, engine, *extra):
    return ["--config", str(REPO / "configs/examples/sft.yaml"), "--model.path", str(model_dir), "--data.path",
            str(data), "--train.output_dir", str(out), "--max_steps", "4", "--train.per_device_train_batch_size", "2",
            "--data.max_length", "64", "--train.progress_bar", "false", "--distributed.strategy", engine,
            "--checkpoint.save_steps", "1", "--checkpoint.keep_last", "4", "--runtime.deterministic", "true", *extra]


def ppo_args(model_dir, out, engine, *extra):
    return ["--config", str(REPO / "configs/examples/ppo.yaml"), "--model.path", str(model_dir),
            "--train.output_dir", str(out), "--max_steps", "4", "--rollout.batch_size", "4",
            "--ppo.minibatch_size", "2", "--ppo.micro_batch_size", "1", "--rollout.max_new_tokens", "6",
            "--train.progress_bar", "false", "--data.truncation", "left", "--distributed.strategy", engine,
            "--checkpoint.save_steps", "1", "--checkpoint.keep_last", "4", "--runtime.deterministic", "true", *extra]


def final(out: Path, critic: bool) -> dict:
    ckpt = out / "checkpoints" / "step-00000004"
    state = {"policy": load_file(str(ckpt / "model.safetensors"))}
    if critic:
        state["critic"] = torch.load(ckpt / "value_model.pt", weights_only=True)
    return state


def max_diff(a: dict, b: dict) -> float:
    return max(float((a[part][k] - b[part][k]).abs().max()) for part in a for k in a[part])


def run_and_resume(make_args, tmp_path, engine, *, critic: bool) -> tuple[dict, dict]:
    """4 steps straight; then a copy of its step-3 checkpoint resumed to step 4. Returns both final states."""
    straight, resumed = tmp_path / f"{engine}-straight", tmp_path / f"{engine}-resumed"
    done = torchrun(*make_args(straight, engine))
    assert done.returncode == 0, why(done)
    manifest = json.loads((straight / "checkpoints/step-00000003/manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["parts"]["rng_state"]["per_rank"]
    (resumed / "checkpoints").mkdir(parents=True)
    os.system(f"cp -r {straight}/checkpoints/step-00000003 {resumed}/checkpoints/")
    done = torchrun(*make_args(resumed, engine, "--checkpoint.resume", "auto"))
    assert done.returncode == 0, why(done)
    assert "resuming from" in done.stdout
    return final(straight, critic), final(resumed, critic)


@pytest.mark.parametrize("engine", ["fsdp2", pytest.param("ddp", marks=pytest.mark.slow),
                                    pytest.param("zero2", marks=pytest.mark.slow),
                                    pytest.param("zero3", marks=pytest.mark.slow)])
def test_sft_trains_checkpoints_and_resumes_exactly(tiny_model_dir, chats, tmp_path, engine):
    a, b = run_and_resume(lambda out, e, *x: sft_args(tiny_model_dir, chats, out, e, *x), tmp_path, engine,
                          critic=False)
    assert max_diff(a, b) == 0.0


@pytest.mark.parametrize("engine", ["zero3", pytest.param("ddp", marks=pytest.mark.slow),
                                    pytest.param("fsdp2", marks=pytest.mark.slow),
                                    pytest.param("zero2", marks=pytest.mark.slow)])
def test_online_ppo_resumes_mid_rollout_exactly(tiny_model_dir, tmp_path, engine):
    """Step 3 is the first minibatch of the second rollout: the checkpoint holds a rollout in flight."""
    a, b = run_and_resume(lambda out, e, *x: ppo_args(tiny_model_dir, out, e, *x), tmp_path, engine, critic=True)
    assert max_diff(a, b) == 0.0
    records = [json.loads(line) for line in (tmp_path / f"{engine}-straight" / "metrics.jsonl").read_text().splitlines()]
    assert max(r["rollout/logprob_gap"] for r in records) < 1e-5  # the engine held each step's gathered weights


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sft", "ppo"])
def test_engines_agree_with_ddp(tiny_model_dir, chats, tmp_path, kind):
    states = {}
    for engine in ENGINES:
        out = tmp_path / engine
        args = sft_args(tiny_model_dir, chats, out, engine) if kind == "sft" else ppo_args(tiny_model_dir, out, engine)
        done = torchrun(*args)
        assert done.returncode == 0, why(done)
        states[engine] = final(out, critic=kind == "ppo")
    for engine in ENGINES[1:]:
        assert max_diff(states[engine], states["ddp"]) < 1e-6, engine


def one_process(*args: str) -> subprocess.CompletedProcess:
    """`python -m astrai.train ARGS` in one process (one thread)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "astrai-torch-extensions"))
    return subprocess.run([sys.executable, "-m", "astrai.train", *args], env=env, capture_output=True, text=True,
                          timeout=600)


def copy_step(src: Path, step: int, dst: Path) -> Path:
    (dst / "checkpoints").mkdir(parents=True)
    os.system(f"cp -r {src}/checkpoints/step-{step:08d} {dst}/checkpoints/")
    return dst


def test_online_ppo_resumes_on_another_world_size_at_a_rollout_boundary(tiny_model_dir, tmp_path):
    """A 2-rank ddp run resumed on one process: from a rollout boundary it continues at the global data position
    and says what changed; from the middle of a rollout, or under another engine, it stops with one line (exit 2)
    and the checkpoint is untouched."""
    straight = tmp_path / "straight"
    done = torchrun(*ppo_args(tiny_model_dir, straight, "ddp"))
    assert done.returncode == 0, why(done)

    boundary = copy_step(straight, 2, tmp_path / "boundary")  # steps 1-2: the first rollout's two minibatches
    done = one_process(*ppo_args(tiny_model_dir, boundary, "ddp", "--checkpoint.resume", "auto"))
    assert done.returncode == 0, why(done)
    assert "resharded a checkpoint of 2 ranks to 1: the data position carries over" in done.stdout
    sampler = json.loads((boundary / "checkpoints/step-00000004/data_sampler.json").read_text())
    assert sampler["position"] == 2 * 4 + 4  # 2 ranks x 4 prompts, then this process's 4
    assert json.loads((boundary / "checkpoints/step-00000004/manifest.json").read_text())["world_size"] == 1

    middle = copy_step(straight, 3, tmp_path / "middle")
    before = sorted(p.name for p in (middle / "checkpoints/step-00000003").iterdir())
    done = one_process(*ppo_args(tiny_model_dir, middle, "ddp", "--checkpoint.resume", "auto"))
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert "saved in the middle of a rollout" in line and "resume with 2 processes" in line
    assert sorted(p.name for p in (middle / "checkpoints/step-00000003").iterdir()) == before

    done = torchrun(*ppo_args(tiny_model_dir, tmp_path / "cross", "fsdp2", "--checkpoint.resume",
                              str(straight / "checkpoints/step-00000002")))
    assert done.returncode != 0
    assert "written under distributed.strategy ddp, this job runs fsdp2" in done.stderr


@pytest.mark.slow
def test_zero_optimizer_partitions_of_another_world_size_are_refused(tiny_model_dir, chats, tmp_path):
    straight = tmp_path / "straight"
    done = torchrun(*sft_args(tiny_model_dir, chats, straight, "zero2", "--max_steps", "1"))
    assert done.returncode == 0, why(done)
    done = one_process(*sft_args(tiny_model_dir, chats, tmp_path / "again", "zero2", "--checkpoint.resume",
                                 str(straight / "checkpoints/step-00000001")))
    assert done.returncode == 2, why(done)
    (line,) = done.stderr.strip().splitlines()
    assert "written by 2 ranks, this job has 1: the DeepSpeed ZeRO optimizer partitions cannot be resharded" in line


def first_loss(out: Path) -> float:
    return json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["train/loss"]


def test_bf16_configuration_builds_and_steps_on_cpu(tiny_model_dir, chats, tmp_path):
    """`train.bf16: true` (ddp, one process): the forward runs in bf16 (the loss differs from fp32's by rounding),
    the weights and their update stay float32."""
    from astrai.train import main

    for name, extra in (("fp32", []), ("bf16", ["--train.bf16", "true"])):
        assert main(sft_args(tiny_model_dir, chats, tmp_path / name, "ddp", "--max_steps", "1", *extra)) == 0
    fp32, bf16 = first_loss(tmp_path / "fp32"), first_loss(tmp_path / "bf16")
    assert fp32 != bf16 and abs(fp32 - bf16) < 0.05 * abs(fp32)
    weights = load_file(str(tmp_path / "bf16/checkpoints/step-00000001/model.safetensors"))
    before = load_file(str(tiny_model_dir / "model.safetensors"))
    assert all(w.dtype == torch.float32 for w in weights.values())
    assert any(not torch.equal(weights[k], before[k]) for k in before)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["fsdp2", "zero2", "zero3"])
def test_bf16_sharded_engines_build_and_step(tiny_model_dir, chats, tmp_path, engine):
    fp32 = tmp_path / "fp32"
    assert torchrun(*sft_args(tiny_model_dir, chats, fp32, "ddp", "--max_steps", "2")).returncode == 0
    done = torchrun(*sft_args(tiny_model_dir, chats, tmp_path / engine, engine, "--max_steps", "2",
                              "--train.bf16", "true"))
    assert done.returncode == 0, why(done)
    assert abs(first_loss(tmp_path / engine) - first_loss(fp32)) < 0.05 * abs(first_loss(fp32))


def policy_after(out: Path, step: int) -> dict:
    return {"policy": load_file(str(out / "checkpoints" / f"step-{step:08d}" / "model.safetensors"))}


@pytest.mark.parametrize("engine", ["zero2", pytest.param("ddp", marks=pytest.mark.slow),
                                    pytest.param("fsdp2", marks=pytest.mark.slow),
                                    pytest.param("zero3", marks=pytest.mark.slow)])
def test_global_token_mean_is_independent_of_ranks_and_accumulation(tiny_model_dir, chats, tmp_path, engine):
    """Each optimizer step takes the same 8 chats (of different lengths) as 2 ranks x micro-batch 1 x accumulation 4,
    2 ranks x 4 x 1, or one process x 8: the loss is normalised by the step's real tokens over all ranks and
    micro-batches, so after 2 steps the parameters agree within 1e-5."""
    def args(out, per_device, accumulation):
        return sft_args(tiny_model_dir, chats, out, engine, "--max_steps", "2", "--checkpoint.save_steps", "2",
                        "--optim.learning_rate", "1e-3", "--optim.warmup_steps", "0",
                        "--train.per_device_train_batch_size", str(per_device),
                        "--train.gradient_accumulation_steps", str(accumulation))

    runs = {"2x1x4": torchrun(*args(tmp_path / "2x1x4", 1, 4)), "2x4x1": torchrun(*args(tmp_path / "2x4x1", 4, 1)),
            "1x8x1": one_process(*args(tmp_path / "1x8x1", 8, 1))}
    for name, done in runs.items():
        assert done.returncode == 0, f"{name}: {why(done)}"
    states = {name: policy_after(tmp_path / name, 2) for name in runs}
    start = {"policy": load_file(str(tiny_model_dir / "model.safetensors"))}
    assert max_diff(states["1x8x1"], start) > 1e-3  # it trained (AdamW moves each weight by about the rate)
    assert max_diff(states["2x1x4"], states["1x8x1"]) < 1e-5
    assert max_diff(states["2x4x1"], states["1x8x1"]) < 1e-5


def final_adapter(out: Path) -> dict:
    return {"adapter": load_file(str(out / "checkpoints" / "step-00000004" / "adapter_model.safetensors"))}


LORA = ("--model.lora", "{r: 4, alpha: 8}", "--optim.learning_rate", "1e-3")


@pytest.mark.slow  # ~150 s per engine here (three launches); test_lora.py covers LoRA in one process
@pytest.mark.parametrize("engine", ENGINES)
def test_lora_sft_trains_resumes_exactly_and_agrees_with_one_process(tiny_model_dir, chats, tmp_path, engine):
    """LoRA under a 2-rank engine: the adapters train (only they are checkpointed), a resume from step 3 ends
    bitwise equal, and the adapters match one process trained on the same global batches (float rounding)."""
    make = lambda out, e, *x: sft_args(tiny_model_dir, chats, out, e, *LORA, *x)  # noqa: E731
    straight, resumed = tmp_path / f"{engine}-straight", tmp_path / f"{engine}-resumed"
    done = torchrun(*make(straight, engine))
    assert done.returncode == 0, why(done)
    (resumed / "checkpoints").mkdir(parents=True)
    os.system(f"cp -r {straight}/checkpoints/step-00000003 {resumed}/checkpoints/")
    done = torchrun(*make(resumed, engine, "--checkpoint.resume", "auto"))
    assert done.returncode == 0, why(done)
    a, b = final_adapter(straight), final_adapter(resumed)
    assert max_diff(a, b) == 0.0
    assert any(".lora_B." in k and v.abs().max() > 0 for k, v in a["adapter"].items())
    one = tmp_path / "one"
    done = torchrun(*make(one, "ddp", "--train.per_device_train_batch_size", "4"), nproc=1)
    assert done.returncode == 0, why(done)
    assert max_diff(a, final_adapter(one)) < 1e-4


@pytest.mark.slow  # ~60 s per engine here
@pytest.mark.parametrize("engine", ["fsdp2", "zero3"])
def test_lora_grpo_reference_is_the_partitioned_policy_with_adapters_off(tiny_model_dir, tmp_path, engine):
    """online_grpo with LoRA and a KL term under an engine that partitions the policy in place: the reference is the
    policy itself with its adapters off (no copy). At the first rollout the adapters are zero, so the policy is the
    base and the KL to the reference is float rounding; after updates the adapters move the policy away from it."""
    out = tmp_path / engine
    rewards = tmp_path / "varied.py"  # rewards that differ within a group, so the adapters move
    rewards.write_text("def varied(prompts, completions, **kwargs):\n"
                       "    return [float(len(c) % 5) for c in completions]\n")
    done = torchrun("--config", str(REPO / "configs/examples/grpo.yaml"), "--model.path", str(tiny_model_dir),
                    "--reward.functions", f"[{{function: 'varied:varied', path: {rewards}}}]",
                    "--train.output_dir", str(out), "--max_steps", "6", "--rollout.batch_size", "2",
                    "--grpo.group_size", "2", "--grpo.minibatch_size", "2", "--grpo.micro_batch_size", "1",
                    "--rollout.max_new_tokens", "6", "--grpo.kl_coef", "0.1", "--train.progress_bar", "false",
                    "--data.truncation", "left", "--distributed.strategy", engine, "--train.report_to", "none",
                    "--checkpoint.save_at_end", "false", *LORA, "--optim.learning_rate", "5e-2")
    assert done.returncode == 0, why(done)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert abs(rows[0]["rollout/kl"]) < 1e-4, rows[0]["rollout/kl"]
    assert rows[-1]["rollout/kl"] > 1e-3, [r["rollout/kl"] for r in rows]
