"""TRL side of bench/grpo_vs_trl.py and bench/learn_vs_trl.py: TRL 1.16's `GRPOTrainer` on astrai's arithmetic
prompts. Run by the TRL virtual environment's interpreter, never by astrai's:

    $TRL_PYTHON bench/_trl_grpo_worker.py --spec spec.json --output result.json

The spec (written by the calling script) names the exported Hugging Face directory (astrai's float32 SmolLM2,
bench/hf_export.py), the questions and their reference answers, and the mode:

- "speed" (bench/grpo_vs_trl.py): `iterations` optimizer steps of B prompts x G completions each, every step one
  rollout and one update over its B*G completions (gradient accumulation over micro-batches), prompts in order,
  timed per phase. TRL's GRPO loop is spread over the Trainer's methods, so phases are timed by wrapping the
  trainer's own methods on the instance: `_generate_and_score_completions` (the rollout), `_generate_single_turn`
  (generate: `model.generate`, or `generate_batch` with transformers' continuous batching, and the EOS mask), and
  `_calculate_rewards` plus any no-grad `_get_per_token_logps_and_entropies` inside the rollout (scoring; with one
  update per rollout and beta 0 TRL runs none). `update` runs from the end of the rollout to the step-end callback
  (the micro-batches' forward and backward, clipping, the AdamW and LR steps); `total` from one step end to the
  next (the first from its step begin). Each prompt's token ids are checked against astrai's encoding.
- "learn" (bench/learn_vs_trl.py): TRL's documented GRPO defaults except the settings the spec fixes, trained until
  `minutes` of wall time have passed (a callback stops at the first step end after it; `max_steps` is huge); the
  final model is saved as a Hugging Face directory, and each log record (step, seconds, mean reward) is kept.

The reward is astrai's `math_exact_match` behind TRL's reward-function signature (`exact_match_reward`).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

PAGE_SIZE = 256
"""Tokens per KV-cache page of transformers' continuous batching (its default)."""

def completion_text(completion) -> str:
    """The text of one TRL completion: a string (standard prompts) or the last message's content (conversational
    prompts: a list of {"role", "content"} messages)."""
    if isinstance(completion, str):
        return completion
    return completion[-1]["content"] if completion else ""


def exact_match_reward(prompts, completions, answer, **kwargs) -> list[float]:
    """TRL's reward-function signature over astrai's `math_exact_match` (no format bonus, no partial credit): 1.0
    when the completion's final number equals the final number of the reference `answer` ("... #### N"), else 0.0.
    `prompts` and the other columns TRL passes are unused."""
    from astrai.rewards.builtins import math_exact_match

    return [float(s) for s in math_exact_match(list(prompts), [completion_text(c) for c in completions],
                                               answer=list(answer))]


def conversations(questions: list[str]) -> list[list[dict]]:
    """Each question as a one-message conversation (TRL applies the tokenizer's chat template, whose default system
    message astrai's prompts carry too when data.system_prompt is null)."""
    return [[{"role": "user", "content": q}] for q in questions]


def load_model(hf_dir: str):
    """(policy, tokenizer) of the exported directory in float32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32), AutoTokenizer.from_pretrained(hf_dir)


def speed_config(spec: dict, workdir: str):
    """GRPOConfig of the speed mode: one optimizer step per rollout of B*G completions, fp32, no logging/saving."""
    from trl import GRPOConfig

    s = spec["settings"]
    rows = s["prompts_per_step"] * s["group_size"]
    return GRPOConfig(
        output_dir=workdir, report_to="none", save_strategy="no", logging_strategy="no", disable_tqdm=True,
        use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False, seed=s["seed"],
        learning_rate=s["learning_rate"], lr_scheduler_type="constant", weight_decay=0.0,
        max_grad_norm=s["max_grad_norm"],
        per_device_train_batch_size=s["micro_batch_size"], gradient_accumulation_steps=rows // s["micro_batch_size"],
        steps_per_generation=rows // s["micro_batch_size"], num_generations=s["group_size"], num_iterations=1,
        max_steps=spec["iterations"], shuffle_dataset=False, max_completion_length=s["max_new_tokens"],
        temperature=s["temperature"], top_p=1.0, top_k=0, beta=0.0, epsilon=s["clip_eps"], loss_type="dapo",
        scale_rewards="group", log_completions=False,
        use_transformers_continuous_batching=spec["generation"] == "continuous",
        transformers_continuous_batching_config=continuous_batching_sizes(spec))


def continuous_batching_sizes(spec: dict) -> dict:
    """KV-cache blocks and batch tokens for transformers' continuous batching that hold one whole rollout (every
    completion's prompt and new tokens, all prompts prefilled in one batch). Left to itself on a CPU it sizes its
    cache from the machine's total memory (half of it under TRL's default), which got the worker killed here."""
    s = spec["settings"]
    rows = s["prompts_per_step"] * s["group_size"]
    longest = max(len(p) for p in spec["prompt_ids"]) + s["max_new_tokens"]
    return {"num_blocks": rows * -(-longest // PAGE_SIZE) + 1, "max_batch_tokens": rows * longest,
            "page_size": PAGE_SIZE}


def learn_config(spec: dict, workdir: str):
    """GRPOConfig of the learn mode: TRL's defaults except what the spec fixes (see bench/learn_vs_trl.py)."""
    from trl import GRPOConfig

    s = spec["settings"]
    return GRPOConfig(
        output_dir=workdir, report_to="none", save_strategy="no", disable_tqdm=True, use_cpu=True, bf16=False,
        gradient_checkpointing=False, seed=s["seed"], learning_rate=s["learning_rate"],
        num_generations=s["group_size"], max_completion_length=s["max_new_tokens"], max_steps=10**9)


def response_lengths(completion_ids: list[list[int]]) -> list[int]:
    """Tokens of each completion as TRL keeps it (up to and including the first EOS)."""
    return [len(ids) for ids in completion_ids]


def install_timers(trainer, expected: set[tuple[int, ...]]) -> dict:
    """Wrap the trainer's rollout, generation, reward and log-prob methods and add a step callback; returns the
    record they fill: `rollouts` (one dict per rollout: start, end, generate, scoring, lengths, prompts that differ
    from astrai's encoding), `step_begin` and `step_end` (perf_counter times)."""
    import transformers

    record: dict = {"rollouts": [], "step_begin": [], "step_end": []}
    rollout, generate = trainer._generate_and_score_completions, trainer._generate_single_turn
    rewards, logps = trainer._calculate_rewards, trainer._get_per_token_logps_and_entropies

    def add(phase: str, seconds: float) -> None:
        current = record["rollouts"][-1]
        current[phase] = current.get(phase, 0.0) + seconds

    def timed_rollout(inputs):
        entry = {"start": time.perf_counter(), "open": True}
        record["rollouts"].append(entry)
        try:
            return rollout(inputs)
        finally:
            entry["end"], entry["open"] = time.perf_counter(), False

    def timed_generate(prompt_ids, *args, **kwargs):
        start = time.perf_counter()
        completion_ids, logprobs = generate(prompt_ids, *args, **kwargs)
        add("generate", time.perf_counter() - start)
        entry = record["rollouts"][-1]
        entry["prompt_lengths"] = [len(p) for p in prompt_ids]
        entry["response_lengths"] = response_lengths(completion_ids)
        entry["prompt_mismatches"] = sum(tuple(p) not in expected for p in prompt_ids)
        return completion_ids, logprobs

    def timed_rewards(*args, **kwargs):
        start = time.perf_counter()
        out = rewards(*args, **kwargs)
        add("scoring", time.perf_counter() - start)
        return out

    def timed_logps(*args, **kwargs):
        start = time.perf_counter()
        out = logps(*args, **kwargs)
        if record["rollouts"] and record["rollouts"][-1]["open"]:
            add("scoring", time.perf_counter() - start)
        return out

    class Steps(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            record["step_begin"].append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            record["step_end"].append(time.perf_counter())

    trainer._generate_and_score_completions, trainer._generate_single_turn = timed_rollout, timed_generate
    trainer._calculate_rewards, trainer._get_per_token_logps_and_entropies = timed_rewards, timed_logps
    trainer.add_callback(Steps())
    return record


def speed_iterations(record: dict) -> list[dict]:
    """Seconds per phase of each optimizer step (one rollout each) from the timers' record."""
    out = []
    for k, (entry, end) in enumerate(zip(record["rollouts"], record["step_end"])):
        begin = record["step_end"][k - 1] if k else record["step_begin"][0]
        out.append({"generate": entry.get("generate", 0.0), "scoring": entry.get("scoring", 0.0),
                    "update": end - entry["end"], "total": end - begin,
                    "prompt_lengths": entry["prompt_lengths"], "response_lengths": entry["response_lengths"],
                    "prompt_mismatches": entry["prompt_mismatches"]})
    return out


def time_limit(seconds: float):
    """A TrainerCallback that stops training at the first step end after `seconds` of training (clock from
    on_train_begin) and records (step, seconds, mean reward) of each log; its `done` holds the final step and time."""
    import transformers

    class TimeLimit(transformers.TrainerCallback):
        def __init__(self):
            self.start, self.curve, self.done = None, [], {}

        def on_train_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            elapsed = time.perf_counter() - self.start
            self.done = {"steps": state.global_step, "seconds": elapsed}
            if elapsed >= seconds:
                control.should_training_stop = True

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                self.curve.append({"step": state.global_step, "seconds": time.perf_counter() - self.start,
                                   "reward": logs["reward"]})

    return TimeLimit()


def run(spec: dict, workdir: str) -> dict:
    """Build the trainer of `spec`, train, and return the result (see the module docstring)."""
    import transformers
    import trl
    from datasets import Dataset
    from trl import GRPOTrainer

    sys.path.insert(0, spec["astrai_root"])
    policy, tokenizer = load_model(spec["hf_dir"])
    learn = spec["mode"] == "learn"
    args = learn_config(spec, workdir) if learn else speed_config(spec, workdir)
    dataset = Dataset.from_dict({"prompt": conversations(spec["questions"]), "answer": spec["answers"]})
    trainer = GRPOTrainer(model=policy, reward_funcs=[exact_match_reward], args=args, train_dataset=dataset,
                          processing_class=tokenizer)
    trainer.remove_callback(transformers.trainer_callback.PrinterCallback)
    if not spec.get("stop_at_eos", True):  # sample exactly max_completion_length tokens, as astrai's side does
        trainer.generation_config.eos_token_id = None
        trainer.generation_kwargs["eos_token_id"] = None
        trainer.eos_token_ids = []
    torch.set_num_threads(spec["threads"])
    result = {"trl_version": trl.__version__, "transformers_version": transformers.__version__,
              "threads": torch.get_num_threads(), "optim": str(trainer.args.optim)}
    print(f"trl {trl.__version__} (transformers {transformers.__version__}): threads {torch.get_num_threads()}, "
          f"optim {trainer.args.optim}, generation "
          f"{'continuous batching' if trainer.args.use_transformers_continuous_batching else 'generate'}", flush=True)
    if learn:
        limit = time_limit(60.0 * spec["minutes"])
        trainer.add_callback(limit)
        trainer.train()
        trainer.save_model(spec["model_out"])
        tokenizer.save_pretrained(spec["model_out"])
        result.update(limit.done, curve=limit.curve)
    else:
        record = install_timers(trainer, {tuple(p) for p in spec["prompt_ids"]})
        trainer.train()
        result["iterations"] = speed_iterations(record)
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    result["optimizer"] = f"{type(optimizer).__name__} (fused {optimizer.defaults.get('fused')})"
    return result


def main() -> None:
    """Read the spec, run, write the result JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", required=True, type=Path)
    parser.add_argument("--output", required=True, type=Path)
    args = parser.parse_args()
    spec = json.loads(args.spec.read_text())
    torch.set_num_threads(spec["threads"])
    with tempfile.TemporaryDirectory(prefix="trl-grpo-bench-") as workdir:
        result = run(spec, workdir)
    args.output.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
