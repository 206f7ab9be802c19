"""TRL side of bench/ppo_vs_trl.py: online PPO iterations of TRL 1.12's `PPOTrainer` (trl.experimental.ppo), timed
per phase. Run by the TRL virtual environment's interpreter, never by astrai's:

    $TRL_PYTHON bench/_trl_ppo_worker.py --spec spec.json --output result.json

The spec (written by bench/ppo_vs_trl.py) names the exported Hugging Face directory, the prompts as token ids (astrai's
chat-templated encoding, so both sides see the same tokens), their GSM8K answers, and the PPO settings. Policy and
reference are `AutoModelForCausalLM` of that directory, the critic `AutoModelForSequenceClassification` (num_labels 1,
score head set to zero as astrai's critic head is); the reward is astrai's `math_exact_match` rule behind TRL's
reward-model interface (`RuleReward`), so it costs a decode and a regex, not a forward.

`PPOTrainer.train` is one monolithic loop, so phases are timed by wrapping the module-level functions it calls
(`batch_generation`, `forward`, `get_reward`) and by timestamps: the batch request that starts each iteration
(a wrapper around its dataloader, which is replaced by an unshuffled one so iteration k gets prompts
[k*B, (k+1)*B) as astrai does) and a callback at each step's end. Phases per iteration:

    generate        batch_generation (HF generate of B rows, output_scores; behaviour log-probs come from its scores)
    reference       forward() of the reference model
    critic_scoring  get_reward() of the value model
    reward          get_reward() of RuleReward
    update          from the first training forward of the iteration to the step-end callback: per minibatch the
                    joint policy + value forward, the losses, one backward, one AdamW step over both, TRL's
                    no-grad statistics (entropy over the full vocabulary), then the metrics and the LR step
    total           from the iteration's batch request to the next one (the last: to the end of train)

The result JSON holds, per iteration, these seconds, the prompt lengths and the real response lengths.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch


class TimedBatches:
    """Iterates a dataloader and records `time.perf_counter()` when each batch is requested."""

    def __init__(self, loader):
        self.loader, self.requested = loader, []

    def __iter__(self):
        it = iter(self.loader)
        while True:
            self.requested.append(time.perf_counter())
            try:
                batch = next(it)
            except StopIteration:
                self.requested.pop()
                return
            yield batch

    def __len__(self):
        return len(self.loader)


class _RuleBackbone(torch.nn.Module):
    """Decodes each row's response (the real tokens after its known prompt, stop token dropped) and returns the
    rule's score at every position as a (B, S, 1) "hidden state"."""

    def __init__(self, tokenizer, answers: dict[tuple, str], reward_fn, format_bonus: float, stop_id: int | None):
        super().__init__()
        self.tokenizer, self.answers, self.reward_fn = tokenizer, answers, reward_fn
        self.format_bonus, self.stop_id = format_bonus, stop_id
        self.lengths = sorted({len(p) for p in answers}, reverse=True)

    def forward(self, input_ids, attention_mask, **_):
        texts, answers = [], []
        for ids, mask in zip(input_ids.tolist(), attention_mask.tolist()):
            real = [t for t, m in zip(ids, mask) if m]
            length = next(n for n in self.lengths if tuple(real[:n]) in self.answers)
            response = real[length:]
            if response and response[-1] == self.stop_id:
                response = response[:-1]
            texts.append(self.tokenizer.decode(response, skip_special_tokens=True))
            answers.append(self.answers[tuple(real[:length])])
        scores = torch.tensor(self.reward_fn([""] * len(texts), texts, answer=answers, format_bonus=self.format_bonus),
                              dtype=torch.float32)
        return SimpleNamespace(hidden_states=(scores[:, None, None].expand(-1, input_ids.shape[1], 1),))


class RuleReward(torch.nn.Module):
    """A rule-based reward behind TRL's reward-model interface: `get_reward` calls
    `getattr(model, model.base_model_prefix)(input_ids=..., attention_mask=..., ...)`, applies `model.score` to the
    last hidden state and reads it at each row's last real token."""

    base_model_prefix = "backbone"

    def __init__(self, *args):
        super().__init__()
        self.backbone = _RuleBackbone(*args)
        self.score = torch.nn.Identity()


def response_lengths(responses: torch.Tensor, stop_id: int | None) -> list[int]:
    """Real tokens of each generated row: up to and including the first stop token, else all of them."""
    out = []
    for row in responses.tolist():
        out.append(row.index(stop_id) + 1 if stop_id is not None and stop_id in row else len(row))
    return out


def build(spec: dict, workdir: str):
    """The PPOTrainer of `spec` with its phase timers installed: (trainer, timings, loader)."""
    import transformers
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
    from trl.experimental.ppo import PPOConfig, PPOTrainer
    from trl.experimental.ppo import ppo_trainer as ppo_module

    sys.path.insert(0, spec["astrai_root"])
    from astrai.rewards.builtins import BUILTIN_REWARDS

    hf_dir = spec["hf_dir"]
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    tokenizer.pad_token = spec["pad_token"]  # not <|im_end|>: TRL takes pad ids for padding, and prompts hold it
    tokenizer.padding_side = "left"
    f32 = torch.float32
    policy = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=f32)
    ref = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=f32)
    critic = AutoModelForSequenceClassification.from_pretrained(hf_dir, num_labels=1, dtype=f32)
    torch.nn.init.zeros_(critic.score.weight)
    for model in (policy, ref, critic):
        model.config.pad_token_id = tokenizer.pad_token_id
    stop_id = tokenizer.eos_token_id if spec["stop_at_eos"] else None
    answers = {tuple(p): a for p, a in zip(spec["prompts"], spec["answers"])}
    reward = RuleReward(tokenizer, answers, BUILTIN_REWARDS[spec["reward"]].load(), spec["format_bonus"], stop_id)
    dataset = Dataset.from_dict({"input_ids": spec["prompts"]})
    s = spec["settings"]
    args = PPOConfig(
        output_dir=workdir, report_to="none", save_strategy="no", use_cpu=True, bf16=False, fp16=False,
        gradient_checkpointing=False, disable_tqdm=True, logging_steps=1, num_sample_generations=0, seed=s["seed"],
        optim=spec["optim"], learning_rate=s["learning_rate"], lr_scheduler_type="constant", weight_decay=0.0,
        per_device_train_batch_size=s["batch_size"], gradient_accumulation_steps=1,
        num_mini_batches=s["batch_size"] // s["minibatch_size"], num_ppo_epochs=s["epochs"],
        total_episodes=len(spec["prompts"]), local_rollout_forward_batch_size=s["batch_size"],
        response_length=s["max_new_tokens"], stop_token="eos" if spec["stop_at_eos"] else None,
        temperature=s["temperature"], kl_coef=s["kl_coef"], kl_estimator=s["kl_estimator"], cliprange=s["clip_eps"],
        vf_coef=s["vf_coef"], cliprange_value=s["value_clip"], gamma=s["gamma"], lam=s["gae_lambda"],
        whiten_rewards=False)
    trainer = PPOTrainer(args=args, processing_class=tokenizer, model=policy, ref_model=ref, reward_model=reward,
                         train_dataset=dataset, value_model=critic)
    trainer.remove_callback(transformers.trainer_callback.PrinterCallback)
    loader = TimedBatches(torch.utils.data.DataLoader(
        dataset, batch_size=s["batch_size"], shuffle=False, drop_last=True,
        collate_fn=transformers.DataCollatorWithPadding(tokenizer)))
    trainer.dataloader = loader
    timings = install_timers(trainer, ppo_module, stop_id, tokenizer.pad_token_id)
    return trainer, timings, loader


def install_timers(trainer, module, stop_id: int | None, pad_id: int) -> list[dict]:
    """Wrap the functions `PPOTrainer.train` calls (module globals) with timers that add to the current iteration's
    entry of the returned list (one entry is opened per generation call)."""
    import transformers

    timings: list[dict] = []
    generate, forward, get_reward = module.batch_generation, module.forward, module.get_reward

    def add(phase: str, seconds: float) -> None:
        timings[-1][phase] = timings[-1].get(phase, 0.0) + seconds

    def timed_generation(model, queries, *args, **kwargs):
        start = time.perf_counter()
        out = generate(model, queries, *args, **kwargs)
        timings.append({"generate": time.perf_counter() - start,
                        "prompt_lengths": (queries != pad_id).sum(1).tolist(),
                        "response_lengths": response_lengths(out[0][:, queries.shape[1]:], stop_id)})
        return out

    def timed_forward(model, *args, **kwargs):
        start = time.perf_counter()
        out = forward(model, *args, **kwargs)
        if model is trainer.ref_model:
            add("reference", time.perf_counter() - start)
        else:
            timings[-1].setdefault("update_start", start)
        return out

    def timed_reward(model, *args, **kwargs):
        start = time.perf_counter()
        out = get_reward(model, *args, **kwargs)
        add("reward" if isinstance(model, RuleReward) else "critic_scoring", time.perf_counter() - start)
        return out

    class StepEnd(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            timings[-1]["step_end"] = time.perf_counter()

        def on_train_end(self, args, state, control, **kwargs):
            timings[-1]["train_end"] = time.perf_counter()

    module.batch_generation, module.forward, module.get_reward = timed_generation, timed_forward, timed_reward
    trainer.add_callback(StepEnd())
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", required=True, type=Path)
    parser.add_argument("--output", required=True, type=Path)
    args = parser.parse_args()
    spec = json.loads(args.spec.read_text())
    torch.set_num_threads(spec["threads"])
    import trl

    with tempfile.TemporaryDirectory(prefix="trl-ppo-bench-") as workdir:
        trainer, timings, loader = build(spec, workdir)
        torch.set_num_threads(spec["threads"])
        print(f"trl {trl.__version__}: threads {torch.get_num_threads()}, optimizer "
              f"{type(trainer.optimizer.optimizer).__name__} ({spec['optim']})", flush=True)
        trainer.train()
    iterations = []
    for k, t in enumerate(timings):
        end = loader.requested[k + 1] if k + 1 < len(loader.requested) else t["train_end"]
        iterations.append({
            "generate": t["generate"], "reference": t.get("reference", 0.0),
            "critic_scoring": t.get("critic_scoring", 0.0), "reward": t.get("reward", 0.0),
            "update": t["step_end"] - t["update_start"], "total": end - loader.requested[k],
            "prompt_lengths": t["prompt_lengths"], "response_lengths": t["response_lengths"]})
    args.output.write_text(json.dumps({"trl_version": trl.__version__, "threads": torch.get_num_threads(),
                                       "iterations": iterations}, indent=1))


if __name__ == "__main__":
    main()
