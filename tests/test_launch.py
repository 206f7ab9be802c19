"""launch/ scripts against fake docker / accelerate / deepspeed / torchrun / srun executables placed first on PATH:
the exact invocation, the exported variables, `infra:` precedence over `.env.train`, the fallbacks, and the
fail-fast paths (missing python3 or PyYAML, bad options, a PPO checkpoint without its critic)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
LAUNCH = REPO / "launch"

FAKE = r"""#!/usr/bin/env bash
# fake {tool}: records its arguments (NUL-separated), environment and any compose files, then acts a little
set -eu
if [[ {tool} == docker && "$*" == "compose version" ]]; then exit "${{FAKE_COMPOSE_RC:-0}}"; fi  # the plugin probe
n=$(find "$FAKE_LOG" -mindepth 1 -maxdepth 1 -type d | wc -l)
d=$FAKE_LOG/$(printf '%03d' "$n")-{tool}
mkdir -p "$d"
printf '%s\0' "$@" >"$d/args"
env -0 >"$d/env"
case {tool} in
  docker)
    prev="" i=0
    for a in "$@"; do
      if [[ $prev == -f && -f $a ]]; then cp "$a" "$d/compose-$i.yaml"; i=$((i + 1)); fi
      prev=$a
    done
    if [[ ${{1:-}} == image ]]; then exit "${{FAKE_IMAGE_RC:-0}}"; fi ;;
  srun)
    while [[ ${{1:-}} == --* ]]; do shift; done
    exec "$@" ;;
  scontrol) if [[ ${{1:-}} == show ]]; then printf 'node-a\nnode-b\n'; fi ;;
  torchrun)
    if [[ -n ${{FAKE_WAIT_USR1:-}} ]]; then  # a job that runs until SIGUSR1, then exits as a preempted job does
      trap 'echo USR1 >"$d/signal"; exit "${{FAKE_USR1_RC:-75}}"' USR1
      touch "$d/ready"
      while :; do sleep 0.05; done
    fi ;;
  nvidia-smi) for i in $(seq 0 $((${{FAKE_GPUS:-8}} - 1))); do echo "GPU $i: Fake (UUID: GPU-$i)"; done ;;
esac
"""
TOOLS = ("docker", "accelerate", "deepspeed", "torchrun", "srun", "scontrol")


class Calls(list):
    """The recorded calls, in order: dicts with tool, args, env, dir."""

    def of(self, tool):
        return [c for c in self if c["tool"] == tool]


@pytest.fixture
def fake(tmp_path):
    """A bin dir with the fakes, a log dir, and `run(script, *args, env=..., cwd=...)`."""
    bindir, log = tmp_path / "bin", tmp_path / "log"
    bindir.mkdir()
    log.mkdir()
    for tool in TOOLS + ("nvidia-smi",):
        path = bindir / tool
        path.write_text(FAKE.format(tool=tool))
        path.chmod(0o755)
    (bindir / "nvidia-smi").rename(tmp_path / "nvidia-smi")  # opt-in: see with_gpus()

    class Fake:
        bin, dir = bindir, tmp_path

        def with_gpus(self):
            shutil.copy(tmp_path / "nvidia-smi", bindir / "nvidia-smi")

        def run(self, script, *args, env=None, cwd=None, path=None):
            shutil.rmtree(log)
            log.mkdir()
            base = {k: v for k, v in os.environ.items() if not k.startswith(("TRAIN_", "SERVE_", "SLURM_"))}
            base.pop("CUDA_VISIBLE_DEVICES", None)
            full = {**base, "PATH": path or f"{bindir}:{os.environ['PATH']}", "FAKE_LOG": str(log),
                    "TRAIN_CHECK": "0", **(env or {})}  # the pre-flight has its own tests (real python)
            out = subprocess.run(["bash", str(LAUNCH / script), *map(str, args)], env=full, cwd=cwd or tmp_path,
                                 capture_output=True, text=True, timeout=120)
            calls = Calls()
            for d in sorted(log.iterdir()):
                if d.name.endswith("nvidia-smi"):
                    continue
                raw_env = (d / "env").read_bytes().split(b"\0")
                calls.append({"tool": d.name.split("-", 1)[1], "dir": d,
                              "args": [a.decode() for a in (d / "args").read_bytes().split(b"\0")[:-1]],
                              "env": dict(e.decode().split("=", 1) for e in raw_env if b"=" in e)})
            return out, calls

    return Fake()


@pytest.fixture
def job(tmp_path):
    path = tmp_path / "jobs" / "My Job.yaml"
    path.parent.mkdir()
    path.write_text("train:\n  type: online_ppo\n  output_dir: out/ppo\n")
    return path


def one_line_error(out, *needles):
    assert out.returncode == 2, out
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


# ------------------------------------------------------------------------------------------------ accelerate
def test_accelerate_single_node_cpu(fake, job):
    out, calls = fake.run("accelerate.sh", job, "--max_steps", "2")
    assert out.returncode == 0, out.stderr
    assert [c["args"] for c in calls] == [["launch", "--num_processes", "1", "-m", "astrai.train", "--config",
                                           str(job), "--max_steps", "2"]]


def test_accelerate_counts_gpus_and_adds_multi_gpu(fake, job):
    fake.with_gpus()
    out, calls = fake.run("accelerate.sh", job, env={"FAKE_GPUS": "8"})
    assert calls[0]["args"][:4] == ["launch", "--num_processes", "8", "--multi_gpu"]
    out, calls = fake.run("accelerate.sh", job, env={"CUDA_VISIBLE_DEVICES": "2,5"})
    assert calls[0]["args"][:4] == ["launch", "--num_processes", "2", "--multi_gpu"]
    assert calls[0]["env"]["CUDA_VISIBLE_DEVICES"] == "2,5"
    out, calls = fake.run("accelerate.sh", job, env={"TRAIN_GPU_COUNT": "3"})
    assert calls[0]["args"][:4] == ["launch", "--num_processes", "3", "--multi_gpu"]


def test_accelerate_multi_node_with_config_file(fake, job, tmp_path):
    cfg = tmp_path / "zero2.yaml"
    cfg.write_text("distributed_type: DEEPSPEED\n")
    out, calls = fake.run("accelerate.sh", "--config_file", cfg, "--num_machines", "2", "--machine_rank", "1",
                          "--main_process_ip", "10.0.0.1", job, "--ppo.gamma", "0.99")
    assert out.returncode == 0, out.stderr
    assert calls[0]["args"] == ["launch", "--config_file", str(cfg), "--num_machines", "2", "--machine_rank", "1",
                                "--main_process_ip", "10.0.0.1", "--main_process_port", "29500", "-m",
                                "astrai.train", "--config", str(job), "--ppo.gamma", "0.99"]
    out, calls = fake.run("accelerate.sh", "--num_processes=16", "--num_machines=2", "--machine_rank=0",
                          "--main_process_ip=h0", "--main_process_port=6000", job)
    assert calls[0]["args"][:12] == ["launch", "--num_processes", "16", "--num_machines", "2", "--machine_rank",
                                     "0", "--main_process_ip", "h0", "--main_process_port", "6000", "--multi_gpu"]


@pytest.mark.parametrize("args, needle", [
    (["--num_machines", "2", "JOB"], "--machine_rank and --main_process_ip"),
    (["--config_file", "missing.yaml", "JOB"], "--config_file: no such file"),
    (["--bogus", "JOB"], "unknown launcher option --bogus"),
    (["--num_processes", "zero", "JOB"], "--num_processes"),
    (["--num_machines", "2", "--machine_rank", "2", "--main_process_ip", "h", "JOB"], "--machine_rank"),
    ([], "missing JOB.yaml"),
    (["nope.yaml"], "job file not found: nope.yaml"),
])
def test_accelerate_bad_input_fails_fast(fake, job, args, needle):
    out, calls = fake.run("accelerate.sh", *[str(job) if a == "JOB" else a for a in args])
    one_line_error(out, "accelerate.sh:", needle)
    assert not calls


# ------------------------------------------------------------------------------------- deepspeed / torchrun
def sft_job(tmp_path, tiny_model_dir, data_line):
    """A tiny sft job file whose data file holds `data_line`."""
    data = tmp_path / "chats.jsonl"
    data.write_text(data_line + "\n")
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump({"train": {"type": "sft", "output_dir": str(tmp_path / "out"),
                                              "per_device_train_batch_size": 1, "gradient_accumulation_steps": 1},
                                    "model": {"path": str(tiny_model_dir)},
                                    "data": {"path": str(data), "max_length": 32}}))
    return path


GOOD_CHAT = '{"messages": [{"role": "user", "content": "1 + 1?"}, {"role": "assistant", "content": "2"}]}'


def test_preflight_refuses_in_one_line_before_any_rank_starts(fake, tmp_path, tiny_model_dir):
    """A job the ranks would refuse is refused by the pre-flight, in one process: one line, exit 2, and the
    launcher is never called (no per-rank errors, no ChildFailedError traceback)."""
    real = {"TRAIN_CHECK": "1", "TRAIN_PYTHON": sys.executable}
    fsdp1 = tmp_path / "fsdp1.yaml"
    fsdp1.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: FSDP\nfsdp_config:\n  fsdp_version: 1\n"
                     "mixed_precision: 'no'\nnum_machines: 1\nnum_processes: 2\n")
    good = sft_job(tmp_path, tiny_model_dir, GOOD_CHAT)
    out, calls = fake.run("accelerate.sh", "--config_file", fsdp1, good, env=real)
    one_line_error(out, "fsdp_version 1 is not supported")
    assert not calls.of("accelerate")
    zero2 = REPO / "configs/zero/zero2.yaml"  # a DeepSpeed micro-batch size that contradicts the job's (1)
    ds_json = tmp_path / "ds.json"
    ds_json.write_text('{"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 4}')
    ds_launch = tmp_path / "zero2.yaml"
    ds_launch.write_text(zero2.read_text().replace("  gradient_clipping: auto\n",
                                                   f"  deepspeed_config_file: {ds_json}\n"))
    out, calls = fake.run("accelerate.sh", "--config_file", ds_launch, good, env=real)
    one_line_error(out, "train_micro_batch_size_per_gpu 4 contradicts the job (1)")
    bad = sft_job(tmp_path, tiny_model_dir, GOOD_CHAT[:-3])
    for script, args in (("accelerate.sh", ("--config_file", zero2)), ("torchrun.sh", ("--nproc_per_node", "2")),
                         ("deepspeed.sh", ())):
        out, calls = fake.run(script, *args, bad, env=real)
        one_line_error(out, f"{tmp_path / 'chats.jsonl'} line 1: invalid JSON")
        assert not calls.of(script.removesuffix(".sh")), script


def test_preflight_passes_a_good_job_to_the_launcher(fake, tmp_path, tiny_model_dir):
    job = sft_job(tmp_path, tiny_model_dir, GOOD_CHAT)
    out, calls = fake.run("accelerate.sh", "--config_file", REPO / "configs/zero/zero3.yaml", job,
                          env={"TRAIN_CHECK": "1", "TRAIN_PYTHON": sys.executable})
    assert out.returncode == 0, out.stderr
    assert "check passed: sft on 2 process(es) with zero3" in out.stdout
    assert calls.of("accelerate")[0]["args"][-2:] == ["--config", str(job)]
    assert not (tmp_path / "out").exists()  # the check writes nothing


def test_launch_environment_is_accelerates_own():
    from astrai.distributed.preflight import launch_environment

    env, script_args = launch_environment(["--config_file", str(REPO / "configs/zero/zero3.yaml"), "-m",
                                           "astrai.train", "--config", "job.yaml", "--max_steps", "2"])
    assert env["ACCELERATE_USE_DEEPSPEED"] == "true" and env["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == "3"
    assert env["WORLD_SIZE"] == "2" and script_args == ["--config", "job.yaml", "--max_steps", "2"]
    env, _ = launch_environment(["--config_file", str(REPO / "configs/zero/fsdp2.yaml"), "--num_processes", "4",
                                 "-m", "astrai.train"])
    assert env["ACCELERATE_USE_FSDP"] == "true" and env["FSDP_VERSION"] == "2" and env["WORLD_SIZE"] == "4"


def test_preflight_bad_launch_options_are_one_line(capsys):
    """argparse's usage text (about a hundred lines) is swallowed; its error becomes the one line."""
    from astrai.distributed.preflight import main as preflight

    assert preflight(["--bogus_opt", "3", "-m", "astrai.train"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.strip().splitlines() == [
        "error: accelerate launch options: unrecognized arguments: --bogus_opt"], err


def test_deepspeed_with_hostfile(fake, job):
    hostfile = LAUNCH / "hostfile.example"
    out, calls = fake.run("deepspeed.sh", "--hostfile", hostfile, "--num_gpus", "8", "--master_port=29600", job,
                          "--max_steps", "2")
    assert out.returncode == 0, out.stderr
    assert calls[0]["args"] == ["--hostfile", str(hostfile), "--num_gpus", "8", "--master_port", "29600",
                                "--no_local_rank", "--module", "astrai.train", "--config", str(job),
                                "--max_steps", "2"]
    hosts = [line.split() for line in hostfile.read_text().splitlines() if line and not line.startswith("#")]
    assert hosts and all(len(h) == 2 and h[1].startswith("slots=") for h in hosts)
    out, _ = fake.run("deepspeed.sh", "--hostfile", "missing", job)
    one_line_error(out, "--hostfile: no such file")


def test_torchrun_single_and_multi_node(fake, job):
    out, calls = fake.run("torchrun.sh", job)
    assert calls[0]["args"] == ["--nnodes", "1", "--nproc_per_node", "1", "-m", "astrai.train", "--config", str(job)]
    out, calls = fake.run("torchrun.sh", "--nnodes", "2", "--nproc_per_node", "4", "--rdzv_endpoint", "h0:29400",
                          job, "--max_steps", "3")
    assert calls[0]["args"] == ["--nnodes", "2", "--nproc_per_node", "4", "--rdzv_backend", "c10d",
                                "--rdzv_endpoint", "h0:29400", "--rdzv_id", "My Job", "-m", "astrai.train",
                                "--config", str(job), "--max_steps", "3"]
    out, calls = fake.run("torchrun.sh", "--nnodes", "2", job)
    one_line_error(out, "needs --rdzv_endpoint")
    out, calls = fake.run("torchrun.sh", "--rdzv_endpoint", "nocolon", job)
    one_line_error(out, "HOST:PORT")


SLURM_ENV = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node-[a-b]", "SLURM_JOB_NUM_NODES": "2",
             "SLURM_GPUS_PER_NODE": "h100:4", "SLURM_CPUS_PER_TASK": "16", "SLURM_SUBMIT_DIR": str(REPO)}


def test_torchrun_restarts_use_the_c10d_rendezvous_and_forward_usr1(fake, job):
    out, calls = fake.run("torchrun.sh", "--max_restarts", "3", job)
    assert out.returncode == 0, out.stderr
    assert calls[0]["args"] == ["--nnodes", "1", "--nproc_per_node", "1", "--rdzv_backend", "c10d", "--rdzv_endpoint",
                                "localhost:29400", "--rdzv_id", "My Job", "--max_restarts", "3", "-m", "astrai.train",
                                "--config", str(job)]
    env = calls[0]["env"]
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1" and env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "600"
    assert env["PET_SIGNALS_TO_HANDLE"] == "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
    out, calls = fake.run("torchrun.sh", "--master_addr", "h0", "--master_port", "6000", job,
                          env={"TRAIN_MAX_RESTARTS": "2"})
    assert calls[0]["args"][4:10] == ["--rdzv_backend", "c10d", "--rdzv_endpoint", "h0:6000", "--rdzv_id", "My Job"]
    out, calls = fake.run("torchrun.sh", job)  # no restarts: torchrun's default rendezvous, as before
    assert "--rdzv_backend" not in calls[0]["args"] and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in calls[0]["env"]
    one_line_error(fake.run("torchrun.sh", "--max_restarts", "x", job)[0], "--max_restarts")


def test_accelerate_restarts(fake, job):
    out, calls = fake.run("accelerate.sh", "--max_restarts", "2", job)
    assert out.returncode == 0, out.stderr
    assert calls[0]["args"][:6] == ["launch", "--num_processes", "1", "--max_restarts", "2", "--rdzv_backend"]
    assert calls[0]["env"]["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert calls[0]["env"]["PET_SIGNALS_TO_HANDLE"].endswith(",SIGUSR1")


def test_slurm_one_torchrun_per_node_from_slurm_env(fake, job):
    out, calls = fake.run("slurm.sbatch", job, "--max_steps", "2", env=SLURM_ENV)
    assert out.returncode == 0, out.stderr
    assert [c["tool"] for c in calls] == ["scontrol", "srun", "torchrun"]
    assert calls[0]["args"] == ["show", "hostnames", "node-[a-b]"]
    # srun does not inherit sbatch's --cpus-per-task since Slurm 22.05: passed on, and exported for inner sruns
    assert calls[1]["args"][:4] == ["--ntasks-per-node=1", "--kill-on-bad-exit=1", "--cpus-per-task=16", "bash"]
    assert calls[1]["env"]["SRUN_CPUS_PER_TASK"] == "16"
    assert calls[2]["args"] == ["--nnodes", "2", "--nproc_per_node", "4", "--rdzv_backend", "c10d",
                                "--rdzv_endpoint", "node-a:29500", "--rdzv_id", "4242", "-m", "astrai.train",
                                "--config", str(job), "--max_steps", "2"]
    assert calls[2]["env"]["PET_SIGNALS_TO_HANDLE"] == "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
    assert calls[2]["env"]["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    out, calls = fake.run("slurm.sbatch", job, env={**SLURM_ENV, "MASTER_PORT": "7000", "SLURM_GPUS_PER_NODE": "",
                                                    "SLURM_CPUS_PER_TASK": ""})
    assert "node-a:7000" in calls[-1]["args"] and calls[-1]["args"][3] == "1"  # per node: the GPUs it sees
    assert not [a for a in calls[1]["args"] if a.startswith("--cpus-per-task")]
    out, calls = fake.run("slurm.sbatch", job, env={"SLURM_SUBMIT_DIR": str(REPO)})
    one_line_error(out, "not inside a Slurm job")


def test_slurm_one_node_and_restarts(fake, job):
    env = {**SLURM_ENV, "SLURM_JOB_NODELIST": "node-a", "SLURM_JOB_NUM_NODES": "1", "TRAIN_MAX_RESTARTS": "3"}
    out, calls = fake.run("slurm.sbatch", job, env=env)
    assert out.returncode == 0, out.stderr
    assert calls[-1]["args"][:12] == ["--nnodes", "1", "--nproc_per_node", "4", "--rdzv_backend", "c10d",
                                      "--rdzv_endpoint", "node-a:29500", "--rdzv_id", "4242", "--max_restarts", "3"]


def test_slurm_script_asks_for_the_preemption_signal_and_requeue():
    header = [line for line in (LAUNCH / "slurm.sbatch").read_text().splitlines() if line.startswith("#SBATCH")]
    assert "#SBATCH --signal=B:USR1@300" in header and "#SBATCH --requeue" in header
    assert "#SBATCH --open-mode=append" in header  # a requeued job appends to its log


@pytest.mark.parametrize("rc", [75, 0])
def test_slurm_usr1_stops_the_ranks_and_requeues_the_job(fake, job, rc):
    """Slurm's --signal=B:USR1 reaches the batch script: it passes SIGUSR1 through srun to torchrun, waits for the
    job to end, and requeues it; not when the ranks exit 0 (the signal came during the last step, which completed
    the run: a finished run is not requeued)."""
    import signal
    import time

    log = fake.dir / "log"
    shutil.rmtree(log)
    log.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAIN_", "SLURM_"))}
    env.update(SLURM_ENV, PATH=f"{fake.bin}:{os.environ['PATH']}", FAKE_LOG=str(log), TRAIN_CHECK="0",
               FAKE_WAIT_USR1="1", FAKE_USR1_RC=str(rc))
    proc = subprocess.Popen(["bash", str(LAUNCH / "slurm.sbatch"), str(job)], env=env, cwd=fake.dir,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not list(log.glob("*-torchrun/ready")):
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR1)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    (torchrun_dir,) = log.glob("*-torchrun")
    assert (torchrun_dir / "signal").read_text().strip() == "USR1"  # it reached the job through srun
    requeue = [d for d in sorted(log.iterdir()) if d.name.endswith("scontrol")][-1]
    if rc == 0:
        assert (requeue / "args").read_bytes().split(b"\0")[:-1] == [b"show", b"hostnames", b"node-[a-b]"]
        assert "the ranks exited with 0: the run completed its last step, so job 4242 is not requeued" in err
        return
    assert (requeue / "args").read_bytes().split(b"\0")[:-1] == [b"requeue", b"4242"]
    assert "requeued job 4242 (ranks exited with 75); it resumes from its latest checkpoint" in err


def test_launchers_print_help():
    for script in ("accelerate.sh", "deepspeed.sh", "torchrun.sh", "train.sh", "serve.sh"):
        out = subprocess.run(["bash", str(LAUNCH / script), "--help"], capture_output=True, text=True)
        assert out.returncode == 0 and out.stdout.startswith(f"launch/{script}:"), (script, out)


# --------------------------------------------------------------------------------------------------- train.sh
def write_job(path, infra=None, extra=""):
    text = ("" if infra is None else yaml.safe_dump({"infra": infra})) + "train:\n  type: online_ppo\n" + extra
    path.write_text(text)
    return path


def test_train_run_infra_precedence_over_env_file(fake, tmp_path):
    data = tmp_path / "data" / "train.jsonl"
    data.parent.mkdir()
    data.write_text('{"question": "1+1", "answer": "#### 2"}\n')
    job = write_job(tmp_path / "job.yaml", {"job_name": "ppo-a", "gpus": [1, 3], "checkpoint_dir": "runs/a"},
                    "runtime:\n  environment:\n    NCCL_P2P_DISABLE: 1\n    EMPTY: null\n    LITERAL: $HOME\n")
    (tmp_path / ".env.train").write_text("# fallbacks\nTRAIN_JOB_NAME=from-env\nexport TRAIN_DATA='data/train.jsonl'"
                                         "\nTRAIN_GPUS=all\nTRAIN_CHECKPOINT_DIR=/elsewhere\n")
    out, calls = fake.run("train.sh", "run", job, "--max_steps", "2", env={"CUDA_VISIBLE_DEVICES": "0"})
    assert out.returncode == 0, out.stderr
    inspect, run = calls.of("docker")
    assert inspect["args"] == ["image", "inspect", "astrai:latest"]
    assert run["args"][:6] == ["compose", "-p", "astrai-ppo-a", "-f", str(REPO / "docker/compose.yaml"), "-f"]
    assert run["args"][7:] == ["run", "--rm", "trainer"]
    env = run["env"]
    assert env["TRAIN_JOB_NAME"] == "ppo-a"  # infra wins
    assert env["TRAIN_DATA"] == str(data)  # absent from infra: .env.train, relative to that file
    assert env["TRAIN_CHECKPOINT_DIR"] == str(tmp_path / "runs/a") and (tmp_path / "runs/a").is_dir()
    assert env["CUDA_VISIBLE_DEVICES"] == "1,3" and env["TRAIN_GPU_COUNT"] == "2"
    assert env["TRAIN_JOB_FILE"] == str(job)
    override = yaml.safe_load((run["dir"] / "compose-1.yaml").read_text())["services"]["trainer"]
    assert override["environment"] == {"NCCL_P2P_DISABLE": "1", "EMPTY": "", "LITERAL": "$$HOME"}
    assert override["volumes"] == [{"type": "bind", "source": str(data), "target": "/data/train.jsonl",
                                    "read_only": True}]
    assert override["command"] == ["launch/accelerate.sh", "/job/config.yaml", "--max_steps", "2",
                                   "--train.output_dir", "/outputs", "--data.path", "/data/train.jsonl"]


def test_train_fallbacks_and_gpus_all(fake, tmp_path):
    job = write_job(tmp_path / "Fancy Job.yaml", extra="  output_dir: outputs/x\n")
    out, calls = fake.run("train.sh", "up", job, env={"CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 0, out.stderr
    up = calls.of("docker")[-1]
    assert up["args"][2] == "astrai-fancy-job" and up["args"][7:] == ["up", "-d", "--no-build", "trainer"]
    assert "CUDA_VISIBLE_DEVICES" not in up["env"]  # gpus: all (default) leaves it unset, even if empty on host
    assert up["env"]["TRAIN_CHECKPOINT_DIR"] == str(tmp_path / "outputs/x")  # default: train.output_dir
    assert up["env"]["TRAIN_DATA"] == "" and up["env"]["TRAIN_GPU_COUNT"] == ""  # no nvidia-smi here
    fake.with_gpus()
    out, calls = fake.run("train.sh", "run", job, env={"CUDA_VISIBLE_DEVICES": "7", "FAKE_GPUS": "4"})
    run = calls.of("docker")[-1]
    assert "CUDA_VISIBLE_DEVICES" not in run["env"] and run["env"]["TRAIN_GPU_COUNT"] == "4"


def test_train_build_down_logs_status(fake, tmp_path):
    job = write_job(tmp_path / "job.yaml", {"job_name": "j1"})
    compose = str(REPO / "docker/compose.yaml")
    out, calls = fake.run("train.sh", "build")
    assert calls[0]["args"] == ["compose", "-f", compose, "build", "trainer"]
    for cmd, tail in (("down", ["down"]), ("logs", ["logs", "-f", "trainer"]),
                      ("status", ["ps", "--all", "trainer"])):
        out, calls = fake.run("train.sh", cmd, job)
        assert out.returncode == 0, out.stderr
        assert calls[0]["args"] == ["compose", "-p", "astrai-j1", "-f", compose, *tail]


def test_train_bad_input(fake, tmp_path):
    job = write_job(tmp_path / "job.yaml", {"gpus": "0,x"})
    out, calls = fake.run("train.sh", "run", job)
    one_line_error(out, "infra.gpus")
    assert not calls
    job = write_job(tmp_path / "job.yaml", {"job_name": "ok", "color": "red"})
    one_line_error(fake.run("train.sh", "run", job)[0], "infra.color")
    job = write_job(tmp_path / "job.yaml", {"data": "missing.jsonl"})
    one_line_error(fake.run("train.sh", "run", job)[0], "infra.data", "does not exist")
    job = write_job(tmp_path / "job.yaml", {})
    one_line_error(fake.run("train.sh", "run", job, "--max_stepz", "2")[0], "max_stepz")
    one_line_error(fake.run("train.sh", "launch", job)[0], "unknown command 'launch'")
    out, calls = fake.run("train.sh", "run", job, env={"FAKE_IMAGE_RC": "1"})
    one_line_error(out, "image astrai:latest not found", "train.sh build")
    assert [c["args"][0] for c in calls] == ["image"]


def test_train_says_whether_docker_or_its_compose_plugin_is_missing(fake, tmp_path):
    job = write_job(tmp_path / "job.yaml", {"job_name": "j"})
    out, calls = fake.run("train.sh", "run", job, env={"FAKE_COMPOSE_RC": "1"})
    one_line_error(out, "docker is installed but its compose plugin is not", "docker-compose-plugin")
    assert not calls
    one_line_error(fake.run("train.sh", "build", env={"FAKE_COMPOSE_RC": "1"})[0], "compose plugin is not")
    bare = tmp_path / "bare"  # a PATH without docker (this machine may have a real one elsewhere on PATH)
    bare.mkdir()
    for tool in ("bash", "dirname"):
        (bare / tool).symlink_to(shutil.which(tool))
    one_line_error(fake.run("train.sh", "build", path=str(bare))[0], "docker not found on PATH", "install Docker")


def test_train_fails_fast_without_python3_or_pyyaml(fake, tmp_path):
    job = write_job(tmp_path / "job.yaml", {})
    nopy = tmp_path / "nopy"
    nopy.mkdir()
    for tool in ("bash", "dirname", "env", "cat", "mktemp", "rm", "grep", "head", "tr", "mkdir"):
        (nopy / tool).symlink_to(shutil.which(tool))
    out, calls = fake.run("train.sh", "run", job, path=f"{fake.bin}:{nopy}")
    one_line_error(out, "host python3 not found")
    assert not calls
    wrapper = tmp_path / "bare" / "python3"
    wrapper.parent.mkdir()
    wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} -S \"$@\"\n")  # no site-packages: no PyYAML
    wrapper.chmod(0o755)
    out, calls = fake.run("train.sh", "run", job, path=f"{wrapper.parent}:{fake.bin}:{os.environ['PATH']}")
    one_line_error(out, "no PyYAML")
    assert not calls


def write_checkpoint(output_dir, step, *, critic):
    from astrai.checkpoint.manifest import write_manifest

    path = Path(output_dir) / "checkpoints" / f"step-{step:08d}"
    path.mkdir(parents=True)
    names = ["model.safetensors", "config.json"] + (["value_model.pt", "value_optimizer.pt"] if critic else [])
    for name in names:
        (path / name).write_bytes(b"{}")
    write_manifest(path, {"step": step, "policy_version": step, "world_size": 1, "train_type": "online_ppo"})
    return path


def test_train_refuses_to_resume_ppo_without_critic(fake, tmp_path):
    job = write_job(tmp_path / "job.yaml", {"job_name": "r", "checkpoint_dir": "run"},
                    "checkpoint:\n  resume: auto\n")
    out, calls = fake.run("train.sh", "run", job)  # nothing to resume yet: a fresh start
    assert out.returncode == 0, out.stderr
    assert calls.of("docker")[-1]["env"]["TRAIN_RESUME_CHECKPOINT"] == ""
    good = write_checkpoint(tmp_path / "run", 2, critic=True)
    out, calls = fake.run("train.sh", "run", job)
    assert out.returncode == 0, out.stderr
    assert calls.of("docker")[-1]["env"]["TRAIN_RESUME_CHECKPOINT"] == str(good)
    bad = write_checkpoint(tmp_path / "run", 4, critic=False)
    out, calls = fake.run("train.sh", "run", job)
    one_line_error(out, "refusing to resume online_ppo", str(bad), "value_model.pt")
    assert not calls
    out, calls = fake.run("train.sh", "run", job, "--checkpoint.resume", "/outputs/checkpoints/step-00000002")
    assert out.returncode == 0 and calls.of("docker")[-1]["env"]["TRAIN_RESUME_CHECKPOINT"] == str(good)
    out, calls = fake.run("train.sh", "run", job, "--train.type", "online_grpo")  # no critic needed
    assert out.returncode == 0, out.stderr


# --------------------------------------------------------------------------------------------------- serve.sh
def test_serve_local_and_docker(fake, tmp_path):
    job = write_job(tmp_path / "job.yaml", {"job_name": "chat", "checkpoint_dir": "run", "gpus": 2},
                    "runtime:\n  environment:\n    ASTR_LOG_LEVEL: DEBUG\n")
    out, calls = fake.run("serve.sh", "up", job)
    one_line_error(out, "no complete checkpoint")
    ckpt = write_checkpoint(tmp_path / "run", 3, critic=True)
    py = tmp_path / "py" / "python3"  # a fake python3 for `local`: records the server command line
    py.parent.mkdir()
    py.write_text(f"#!/bin/sh\ncase \"$1\" in -m) exec \"{fake.bin}/accelerate\" \"$@\";; esac\n"
                  f"exec {sys.executable} \"$@\"\n")
    py.chmod(0o755)
    out, calls = fake.run("serve.sh", "local", job, "--port", "9001", "--", "--max_batch", "8",
                          path=f"{py.parent}:{fake.bin}:{os.environ['PATH']}")
    assert out.returncode == 0, out.stderr
    assert calls[0]["args"] == ["-m", "astrai.serve", "--checkpoint", str(ckpt), "--port", "9001",
                                "--served_model_name", "chat", "--max_batch", "8"]
    assert calls[0]["env"]["CUDA_VISIBLE_DEVICES"] == "2" and calls[0]["env"]["ASTR_LOG_LEVEL"] == "DEBUG"
    out, calls = fake.run("serve.sh", "up", job, "--", "--max_batch", "64")
    assert out.returncode == 0, out.stderr
    up = calls.of("docker")[-1]
    assert up["args"][:3] == ["compose", "-p", "astrai-chat-serve"] and up["args"][-4:] == ["up", "-d",
                                                                                             "--no-build", "server"]
    assert up["env"]["SERVE_CHECKPOINT"] == str(ckpt) and up["env"]["SERVE_PORT"] == "8000"
    server = yaml.safe_load((up["dir"] / "compose-1.yaml").read_text())["services"]["server"]
    assert server["volumes"][0]["source"] == str(ckpt) and server["volumes"][0]["target"] == "/checkpoint"
    assert server["command"][-4:] == ["--served_model_name", "chat", "--max_batch", "64"]
    assert server["environment"] == {"ASTR_LOG_LEVEL": "DEBUG"}
    out, calls = fake.run("serve.sh", "down", job)
    assert calls[0]["args"] == ["compose", "-p", "astrai-chat-serve", "-f", str(REPO / "docker/compose.yaml"),
                                "down"]
    one_line_error(fake.run("serve.sh", "up", job, "--port", "99999")[0], "port")


@pytest.mark.parametrize("script, tool", [("accelerate.sh", "accelerate"), ("torchrun.sh", "torchrun")])
def test_the_scripts_exit_with_the_job_code_not_the_launcher_code(fake, job, script, tool):
    """Rank 0 writes the job's code to ASTRAI_EXIT_FILE; when the launcher fails with its own code (accelerate:
    143 after SIGTERM, torchrun: 1), the script exits with the job's (75: stopped with a checkpoint)."""
    wrapper = fake.bin / tool
    wrapper.write_text(wrapper.read_text().replace(
        "case ", 'if [[ -n ${FAKE_JOB_CODE:-} ]]; then echo "$FAKE_JOB_CODE" >"$ASTRAI_EXIT_FILE"; exit 143; fi\ncase ',
        1))
    out, calls = fake.run(script, job, env={"FAKE_JOB_CODE": "75"})
    assert out.returncode == 75, out
    assert calls.of(tool)[0]["env"]["ASTRAI_EXIT_FILE"]
    out, _ = fake.run(script, job)
    assert out.returncode == 0, out  # a launcher that succeeds: its code


def test_a_stop_signal_to_the_script_reaches_the_job(fake, job):
    """SIGTERM and SIGINT to launch/torchrun.sh reach the launcher (INT as TERM: a background command ignores INT),
    and the job's code comes back."""
    import signal
    import time

    wrapper = fake.bin / "torchrun"
    wrapper.write_text(wrapper.read_text().replace(
        "case ", "trap 'echo TERM >\"$d/signal\"; echo 75 >\"$ASTRAI_EXIT_FILE\"; exit 143' TERM\n"
                 "touch \"$d/ready\"; while :; do sleep 0.05; done\ncase ", 1))
    # a shell started with SIGINT ignored (this test run under nohup, or as a background job of a shell without job
    # control) cannot trap it (bash: "signals ignored upon entry cannot be trapped"), so INT is tried only when the
    # test process itself receives it
    for sig in (signal.SIGTERM, signal.SIGINT)[:1 if signal.getsignal(signal.SIGINT) is signal.SIG_IGN else 2]:
        log = fake.dir / "log"
        shutil.rmtree(log)
        log.mkdir()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAIN_", "SLURM_"))}
        env.update(PATH=f"{fake.bin}:{os.environ['PATH']}", FAKE_LOG=str(log), TRAIN_CHECK="0")
        proc = subprocess.Popen(["bash", str(LAUNCH / "torchrun.sh"), str(job)], env=env, cwd=fake.dir,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while not list(log.glob("*-torchrun/ready")):
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(sig)
        proc.communicate(timeout=60)
        assert proc.returncode == 75, sig
        (torchrun_dir,) = log.glob("*-torchrun")
        assert (torchrun_dir / "signal").read_text().strip() == "TERM"


def test_rank_zero_writes_the_job_code_for_the_scripts(tmp_path, monkeypatch, capsys):
    """The code, and the one-line error the script prints last (the rank does not print it then)."""
    from astrai.train import main

    exit_file = tmp_path / "code"
    monkeypatch.setenv("ASTRAI_EXIT_FILE", str(exit_file))
    monkeypatch.setenv("RANK", "0")
    assert main(["--max_steps", "0"]) == 2
    assert exit_file.read_text() == "2\nerror: train.max_steps: expected an integer > 0, got 0 (given on the command line)\n"
    assert "error:" not in capsys.readouterr().err
    monkeypatch.setenv("RANK", "1")
    exit_file.unlink()
    assert main(["--max_steps", "0"]) == 2 and not exit_file.exists()  # only rank 0 speaks for the job
