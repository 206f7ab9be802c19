"""A real 2-rank DDP sft run (`accelerate launch --config_file configs/zero/ddp.yaml`, gloo, CPU): metrics.jsonl
holds the means over ranks (not rank 0's own numbers), the ranks' data shares make up the single-process batch,
and the run resumes on one process (launched with the deepspeed launcher's `--local_rank`) at the global data
position."""

import json
import sys
from pathlib import Path

import pytest
import torch

from astrai.config import load_config
from astrai.models import load_pretrained
from astrai.trainer.loop import Trainer
from astrai import train_types
from astrai.train import main
from test_distributed import ZERO, chats, free_port, launched, sft_args  # noqa: F401 (chats: a fixture)


class OneRankOf:
    """The process state of rank `rank` of `world_size` as one process sees it alone: sums over ranks are this
    rank's own (no collective), so a strategy built on it reports that rank's own numbers."""

    strategy, mixed_precision, deepspeed_config = "ddp", "no", None
    device = torch.device("cpu")

    tp_group = None  # no tensor parallelism: every rank its own data-parallel group

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size, self.is_main = rank, world_size, rank == 0
        self.dp_rank, self.dp_size = rank, world_size

    def all_reduce_sum(self, tensor):
        return tensor

    def first_failure(self, line):
        return line  # this rank's own, as its sums

    def prepare_model(self, model):
        return model

    def unwrap(self, model):
        return model

    def loss_scale(self) -> float:
        return 1.0

    def barrier(self) -> None:
        pass


def own_step(config, model_dir, rank: int, world_size: int) -> dict[str, float]:
    """Rank `rank`'s own metrics of the job's first step."""
    policy, tokenizer = load_pretrained(model_dir)
    strategy = train_types.get("sft").build(config, OneRankOf(rank, world_size), policy.train(), tokenizer)
    metrics = strategy.train_step(Trainer(strategy, dist=strategy.policy.dist, max_steps=1,
                                          max_grad_norm=config.optim.max_grad_norm))
    return {k: float(v) for k, v in metrics.items()}


def test_two_rank_ddp_run_logs_means_over_ranks_and_resumes_on_one_process(tiny_model_dir, chats, tmp_path):
    out = tmp_path / "run"
    args = sft_args(tiny_model_dir, out, chats, "--max_steps", 1)
    proc = launched({}, sys.executable, "-m", "accelerate.commands.launch", "--config_file", ZERO / "ddp.yaml",
                    "--main_process_port", free_port(), "-m", "astrai.train", *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (record,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    config = load_config(args[1], args[2:])
    own = [own_step(config, tiny_model_dir, rank, 2) for rank in (0, 1)]
    assert abs(own[0]["train/loss"] - own[1]["train/loss"]) > 1e-3  # the ranks saw different chats
    assert record["train/loss"] == pytest.approx((own[0]["train/loss"] + own[1]["train/loss"]) / 2, abs=1e-5)
    assert abs(record["train/loss"] - own[0]["train/loss"]) > 5e-4  # not rank 0's own number
    # the two shares are the 4 chats one process takes at batch 4: same global token-mean gradient
    single = load_config(args[1], [*args[2:], "--train.per_device_train_batch_size", "4"])
    alone = own_step(single, tiny_model_dir, 0, 1)
    assert record["policy/grad_norm"] == pytest.approx(alone["policy/grad_norm"], rel=1e-5)
    assert record["train/tokens"] == alone["train/tokens"]

    # resume the 2-rank run on one process: it continues at the global data position (4 chats drawn)
    assert main(["--local_rank=0", *sft_args(tiny_model_dir, out, chats, "--max_steps", 2,
                                             "--checkpoint.resume", "auto")]) == 0
    step2 = out / "checkpoints" / "step-00000002"
    sampler = json.loads((step2 / "data_sampler.json").read_text())
    assert (sampler["epoch"], sampler["position"]) == (0, 6)
    assert json.loads((step2 / "trainer_state.json").read_text())["consumed_samples"] == 6
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]


@pytest.mark.parametrize("name,extra", [
    ("ppo", ["--data.truncation", "left"]),
    ("sft", ["--data.packing", "true", "--data.max_length", "96"]),
    ("dpo", ["--data.truncation", "left"]),
    ("seq", ["--data.max_length", "64"]),
    ("grpo_offline", ["--data.truncation", "left"]),
])
def test_every_train_type_samples_its_rank_share_with_the_job_seed(name, extra, tiny_model_dir):
    """Each builder gives its sampler the rank and world size and the SAME seed on every rank (rank 1 of 3 draws
    order[1::3] of the job seed's epoch order)."""
    from astrai.data.prompts import epoch_order

    config = load_config(str(ZERO.parents[1] / "configs" / "examples" / f"{name}.yaml"),
                         ["--model.path", str(tiny_model_dir), *extra])
    policy, tokenizer = load_pretrained(tiny_model_dir)
    sampler = train_types.get(config.train.type).build(config, OneRankOf(1, 3), policy.train(), tokenizer).data_sampler
    assert (sampler.rank, sampler.world_size, sampler.seed) == (1, 3, config.train.seed)
    dataset = list(sampler.dataset)
    order = epoch_order(len(dataset), seed=config.train.seed, epoch=0, shuffle=config.data.shuffle)
    assert [dataset.index(r) for r in sampler.next_batch(2)] == order[1::3][:2]


@pytest.mark.slow
def test_deepspeed_launcher_passes_local_rank_and_trains(tiny_model_dir, chats, tmp_path):
    """`deepspeed --num_gpus 2 --module astrai.train ...` appends --local_rank=N to every process's arguments."""
    out = tmp_path / "run"
    proc = launched({}, Path(sys.executable).parent / "deepspeed", "--num_gpus", 2, "--master_port", free_port(),
                    "--module", "astrai.train", *sft_args(tiny_model_dir, out, chats, "--max_steps", 1))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1
    assert json.loads((out / "checkpoints" / "step-00000001" / "manifest.json").read_text())["world_size"] == 2


def run_two_rank_online_grpo(tiny_model_dir, out, *extra) -> None:
    """Launch a 1-step online_grpo run with dynamic sampling (at most 2 rounds) and evaluation on 5 held-out
    questions after every step on 2 ranks (ddp, gloo) into `out`, plus `extra` overrides; asserts it exits 0."""
    from test_train_e2e import tiny_args
    args = tiny_args(tiny_model_dir, out, "--max_steps", "1", "--train.type", "online_grpo",
                     "--rollout.batch_size", "2", "--grpo.group_size", "2", "--grpo.minibatch_size", "4",
                     "--grpo.micro_batch_size", "2", "--rollout.dynamic_sampling", "true",
                     "--rollout.max_sampling_rounds", "2", "--train.eval_steps", "1",
                     "--data.eval_path", "builtin:arithmetic_test", "--data.eval_limit", "5", *extra)
    proc = launched({}, sys.executable, "-m", "accelerate.commands.launch", "--config_file", ZERO / "ddp.yaml",
                    "--main_process_port", free_port(), "-m", "astrai.train", *args)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_two_rank_online_grpo_with_dynamic_sampling_writes_every_ranks_eval_answers(tiny_model_dir, tmp_path):
    """2 ranks (ddp, gloo): each samples its own groups for up to the round cap, and the in-training evaluation
    gathers both ranks' shares of the held-out questions into one eval file, in question order."""
    out = tmp_path / "run"
    run_two_rank_online_grpo(tiny_model_dir, out)
    (record,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert record["eval/num_questions"] == 5 and 1 <= record["rollout/sampling_rounds"] <= 2
    rows = [json.loads(line) for line in (out / "eval" / "step-00000001.jsonl").read_text().splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2, 3, 4]
    assert sum(r["num_correct"] for r in rows) == record["eval/accuracy"] * 5


def test_two_rank_online_grpo_with_a_generation_batch_and_a_step_0_evaluation(tiny_model_dir, tmp_path):
    """2 ranks (ddp, gloo): rollout.generation_batch_size sets the prompts each rank draws per sampling round
    (consumed_samples = rank 0's draws, 3 prompts per round, times the 2 ranks), and train.eval_on_start evaluates
    on both ranks before the first step, gathered into one step-0 record and one eval file."""
    out = tmp_path / "run"
    run_two_rank_online_grpo(tiny_model_dir, out, "--rollout.generation_batch_size", "3",
                             "--train.eval_on_start", "true")
    start, step = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert start["step"] == 0 and start["eval/num_questions"] == 5 and start["policy_version"] == 0
    assert step["step"] == 1 and 1 <= step["rollout/sampling_rounds"] <= 2
    rows = [json.loads(line) for line in (out / "eval" / "step-00000000.jsonl").read_text().splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2, 3, 4]
    assert sum(r["num_correct"] for r in rows) == start["eval/accuracy"] * 5
    state = json.loads((out / "checkpoints" / "step-00000001" / "trainer_state.json").read_text())
    rounds = step["rollout/sampling_rounds"]  # the mean over ranks: 1, 1.5 or 2
    assert state["consumed_samples"] in ({6 * rounds} if rounds in (1, 2) else {6, 12})
