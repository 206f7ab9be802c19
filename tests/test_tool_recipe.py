"""The tool-use recipe end to end on the tiny model: the generator's demonstrations, configs/examples/sft_tools.yaml
for 2 steps, then configs/examples/grpo_tools.yaml from that checkpoint for 2 steps with the built-in calculator
(episodes, their metrics and an in-training evaluation on episodes)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from astrai.config import load_config
from astrai.data.tool_arithmetic import write_files
from astrai.train import main

REPO = Path(__file__).resolve().parents[1]
SFT = REPO / "configs/examples/sft_tools.yaml"
GRPO = REPO / "configs/examples/grpo_tools.yaml"


def test_grpo_recipe_starts_from_the_sft_recipes_final_checkpoint():
    sft, grpo = load_config(str(SFT)), load_config(str(GRPO))
    assert sft.train.type == "sft" and grpo.train.type == "online_grpo"
    assert grpo.model.path == f"{sft.train.output_dir}/checkpoints/step-{sft.train.max_steps:08d}"
    assert sft.data.path == "outputs/tool_arithmetic/sft_tools.jsonl"  # what the generator's --out writes
    assert [t.function for t in grpo.rollout.tools] == ["astrai.agents.calculator:calculator"]
    assert grpo.data.path == "builtin:tool_arithmetic" and grpo.data.eval_path == "builtin:tool_arithmetic_test"


def test_sft_then_grpo_with_the_calculator_run_on_the_tiny_model(tiny_model_dir, tmp_path):
    model_dir = tmp_path / "model"  # room for the tool schema the tiny character-level tokenizer spells out
    shutil.copytree(tiny_model_dir, model_dir)  # (RoPE positions: any length works)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    files = write_files(tmp_path / "data", num_train=8, num_test=4, num_demonstrations=8)
    quiet = ["--train.progress_bar", "false", "--train.report_to", "none"]

    sft_out = tmp_path / "sft"
    assert main(["--config", str(SFT), "--model.path", str(model_dir), "--data.path", str(files["sft_tools"]),
                 "--train.output_dir", str(sft_out), "--max_steps", "2", "--data.max_length", "2048",
                 "--train.per_device_train_batch_size", "2", "--train.gradient_accumulation_steps", "1",
                 *quiet]) == 0
    sft_records = [json.loads(line) for line in (sft_out / "metrics.jsonl").read_text().splitlines()]
    assert len(sft_records) == 2 and all(r["train/loss"] > 0 for r in sft_records)
    checkpoint = sft_out / "checkpoints" / "step-00000002"
    assert (checkpoint / "model.safetensors").is_file()

    grpo_out = tmp_path / "grpo"
    assert main(["--config", str(GRPO), "--model.path", str(checkpoint), "--data.path", str(files["train"]),
                 "--data.eval_path", str(files["test"]), "--data.eval_limit", "2", "--train.eval_steps", "2",
                 "--train.output_dir", str(grpo_out), "--max_steps", "2", "--data.max_prompt_length", "256",
                 "--rollout.batch_size", "2", "--rollout.generation_batch_size", "2", "--grpo.group_size", "2",
                 "--grpo.minibatch_size", "2", "--grpo.micro_batch_size", "2", "--rollout.max_new_tokens", "24",
                 "--rollout.max_sampling_rounds", "2", *quiet]) == 0
    records = [json.loads(line) for line in (grpo_out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "policy/loss" in r] == [1, 2]
    assert all(r["rollout/sampling_rounds"] >= 1 for r in records if "policy/loss" in r)
    assert [r["eval/num_questions"] for r in records if "eval/accuracy" in r] == [2]
    assert (grpo_out / "checkpoints" / "step-00000002" / "model.safetensors").is_file()
    # Every sample is an episode with the calculator offered (its metrics; with dynamic sampling the rounds'
    # episode metrics are not logged today, so this step samples one round of the same job).
    single = tmp_path / "single"
    assert main(["--config", str(GRPO), "--model.path", str(checkpoint), "--data.path", str(files["train"]),
                 "--train.eval_steps", "0", "--train.output_dir", str(single), "--max_steps", "1",
                 "--data.max_prompt_length", "256", "--rollout.batch_size", "2", "--rollout.dynamic_sampling", "false",
                 "--rollout.generation_batch_size", "null", "--grpo.group_size", "2", "--grpo.minibatch_size", "2",
                 "--grpo.micro_batch_size", "2", "--rollout.max_new_tokens", "24",
                 "--checkpoint.save_at_end", "false", *quiet]) == 0
    (record,) = [json.loads(line) for line in (single / "metrics.jsonl").read_text().splitlines()]
    assert record["rollout/episodes/turns"] >= 1 and "rollout/episodes/tool_calls" in record
