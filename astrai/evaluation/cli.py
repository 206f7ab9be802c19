"""Evaluate a model on prompts: `python -m astrai.evaluate --model PATH --data FILE.jsonl [...]`.

Generates with the paged rollout engine, greedy by default (`--temperature T` samples, `--num_samples k` draws k
responses per question and reports pass@k), over a prompt set (a GSM8K-format jsonl: `question`, `answer` ending in
`#### N`, or any prompts with the columns the job's rewards read) or a built-in set (`builtin:arithmetic_test`,
`builtin:math_prompts`, ...), with prompts built exactly as the online train types build them (the chat template or
raw text as `data.chat_template` says, `astrai.data.prompt_format`), and scores each
response with the job's reward functions as training does (`reward.functions`, or the single `reward.name`; the
reward model of `reward.model_path` is left out), or with the one built-in of `--reward NAME`. Statistics and
greedy decoding are described in `astrai.evaluation.accuracy`: the pass rate (`accuracy`: total reward >=
`--pass_threshold`) with its 95% Wilson score interval over the questions, pass@k by the unbiased estimator of Chen
et al. 2021, the mean total reward with a 95% normal interval over the questions, and each reward function's mean
and applies-fraction.

PATH is anything `model.path` accepts (`smollm2-135m-instruct`, a `.gguf` file, a Hugging Face-format directory
such as a checkpoint `outputs/ppo/checkpoints/step-00000004`, a Hugging Face Hub id such as
`Qwen/Qwen2.5-0.5B-Instruct` at `--revision`) or a training output_dir (its latest complete checkpoint is used);
FILE may be a Hugging Face dataset id, `org/name[@revision][:config[:split]]` (its `test` split unless one is
named). When PATH lies in a training output_dir holding `config.yaml`, that run's prompt and reward
settings (fields, system prompt, chat template or raw text, prompt length, reward functions,
`rollout.max_new_tokens`) are the defaults;
`--config FILE` names a job file to take them from instead; explicit options win.

Writes `<output_dir>/results.jsonl` (one object per question: question, answer, responses, extracted answers,
scores, per-function rewards, ...) and `<output_dir>/summary.json` (model, data, n, pass rate, intervals, pass@k,
mean reward, per-function means, settings, tokens/s, wall time), with `--demonstrations FILE` also FILE (the
distinct passing responses that ended, as chats for `train.type: sft`: `EvalResult.demonstrations`), each replaced
atomically (a file that cannot be written, a full disk: one line naming it, exit code 2, the previous file left
whole). Bad input (options, model, data, config, reward functions) prints one line and exits with code 2; so does a
reward function's bug or too many failed reward calls, as training stops for them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

EXIT_BAD_INPUT = 2
RESULTS_FILE, SUMMARY_FILE = "results.jsonl", "summary.json"
CHAT_TEMPLATE_CHOICES = {"true": True, "false": False, "null": None}
"""`--chat_template` values -> `data.chat_template` values (spelled as in YAML)."""


class UsageError(Exception):
    """A bad command-line option (reported in one line, exit code 2)."""


class _Parser(argparse.ArgumentParser):
    """argparse that raises `UsageError` instead of printing the usage block and exiting."""

    def error(self, message: str):
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    """The command's options (None defaults are filled from the run's or `--config`'s settings)."""
    p = _Parser(prog="python -m astrai.evaluate", allow_abbrev=False,
                description="Scores of a model on prompts with the job's reward functions (greedy by default): "
                            "pass rate with a 95% Wilson interval, mean reward, per-function means; writes "
                            "per-example results and a summary.")
    p.add_argument("--model", required=True, help="model name, .gguf, HF-format directory, checkpoint directory, "
                   "training output_dir (latest checkpoint) or Hugging Face Hub id (org/name)")
    p.add_argument("--revision", default=None, help="the Hub id's branch, tag or commit hash (default: main)")
    p.add_argument("--data", required=True, help="question/answer prompts: a .jsonl, .json, .parquet or .csv file, "
                   "a save_to_disk directory, builtin:<name> (e.g. builtin:arithmetic_test), or a Hugging Face "
                   "dataset id org/name[:config[:split]] (default split: test)")
    p.add_argument("--config", default=None, help="job YAML whose data/reward/rollout settings are the defaults")
    p.add_argument("--reward", default=None, help="score with this one built-in reward instead of the job's reward "
                   "functions (default: the config's reward.functions, or its reward.name)")
    p.add_argument("--pass_threshold", type=float, default=None,
                   help="a sample passes when its total reward is >= this (default: 1.0)")
    p.add_argument("--max_new_tokens", type=int, default=None, help="response cap (default: rollout.max_new_tokens)")
    p.add_argument("--batch_size", type=int, default=64, help="questions per engine call (default: 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default), else sampling temperature")
    p.add_argument("--num_samples", type=int, default=1, help="responses per question (k); reports pass@k")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    p.add_argument("--output_dir", default="outputs/eval",
                   help="where results.jsonl and summary.json go (default: outputs/eval)")
    p.add_argument("--demonstrations", default=None, metavar="FILE",
                   help="also write each distinct passing response that ended (not cut by --max_new_tokens) as a "
                        "chat demonstration, {\"messages\": [...]} per line, to FILE for train.type sft: "
                        "rejection-sampling fine-tuning on a model's own samples, or sequence-level distillation "
                        "from a teacher's (chat-template prompts only)")
    p.add_argument("--system_prompt", default=None, help="system message (default: the config's data.system_prompt)")
    p.add_argument("--chat_template", default=None, choices=tuple(CHAT_TEMPLATE_CHOICES),
                   help="render prompts with the tokenizer's chat template (true), as raw text (false), or the "
                        "template when the tokenizer has one (null); default: the config's data.chat_template")
    p.add_argument("--max_prompt_length", type=int, default=None, help="prompt token budget (default: the config's)")
    p.add_argument("--truncation", default=None, choices=("error", "filter", "left"),
                   help="overlong prompts: error, filter (skip) or left (cut the question's start); default: the "
                        "config's data.truncation")
    p.add_argument("--prompt_field", default=None, help="record field of the question (default: question)")
    p.add_argument("--answer_field", default=None, help="record field of the reference answer (default: answer)")
    p.add_argument("--limit", type=int, default=None, help="evaluate only the first N questions")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: auto)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="model dtype (default: float32; bfloat16 is much slower on CPUs without AVX-512/AMX)")
    p.add_argument("--num_threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--adaptive_threads", default=None, choices=("true", "false"),
                   help="on a CPU, decode with fewer threads while other processes busy the cores (default: the "
                        "config's runtime.adaptive_threads, true; docs/kernels.md)")
    p.add_argument("--no_progress_bar", action="store_true", help="hide the progress bar")
    return p


def resolve_model(path: str) -> tuple[str, Optional[Path]]:
    """(what `load_pretrained` gets, the training run's `config.yaml` when PATH lies in a run output_dir).

    A directory without `config.json` (or a LoRA checkpoint's `adapter_config.json`) is read as a training output_dir
    and replaced by its latest complete checkpoint; a `<run>/checkpoints/step-N` directory keeps its path and points
    at `<run>/config.yaml`.

    Raises:
        FileNotFoundError: an output_dir without a complete checkpoint.
    """
    from astrai.checkpoint import checkpoints_root, find_latest_checkpoint, parse_step
    from astrai.models.loading import is_model_directory

    p = Path(path).expanduser()
    if not p.is_dir():
        return path, None
    if not is_model_directory(p):
        if not checkpoints_root(p).is_dir():
            return path, None  # load_pretrained reports the missing config.json
        latest = find_latest_checkpoint(p)
        if latest is None:
            raise FileNotFoundError(f"--model: {p} is a training output_dir without a complete checkpoint")
        run = p
        p = latest
    elif parse_step(p.name) is not None and p.parent.name == "checkpoints":
        run = p.parent.parent
    else:
        return str(p), None
    run_config = run / "config.yaml"
    return str(p), run_config if run_config.is_file() else None


def prompt_settings(args: argparse.Namespace, config_path: Optional[Path]) -> tuple[Any, dict[str, Any]]:
    """(the job config, the prompt and scoring settings): explicit options, else the job config's (`config_path`),
    else the defaults. `reward` is `--reward`, else the config's `reward.name` when it has no `reward.functions`
    (None: the functions score); `pass_threshold` is `--pass_threshold`, else 1.0 (`CORRECT_SCORE`);
    `chat_template` is `--chat_template` (true, false or null), else the config's `data.chat_template`.

    Raises:
        ConfigError: a job config that does not load.
    """
    from astrai.config import load_config
    from astrai.evaluation.accuracy import CORRECT_SCORE
    from astrai.rewards.build import environment_is_the_reward
    from astrai.rewards.functions import single_reward_name

    config = load_config(str(config_path) if config_path is not None else None)
    chosen = {"prompt_field": config.data.prompt_field, "answer_field": config.data.answer_field,
              "system_prompt": config.data.system_prompt, "chat_template": config.data.chat_template,
              "max_prompt_length": config.data.max_prompt_length,
              "truncation": config.data.truncation,
              "reward": (None if config.reward.functions or environment_is_the_reward(config)
                         else single_reward_name(config.reward)),
              "max_new_tokens": config.rollout.max_new_tokens, "pass_threshold": CORRECT_SCORE}
    for key in chosen:
        if getattr(args, key) is not None:
            chosen[key] = getattr(args, key)
    if args.chat_template is not None:  # "null" is a value here, not "not given"
        chosen["chat_template"] = CHAT_TEMPLATE_CHOICES[args.chat_template]
    return config, chosen


def check_options(args: argparse.Namespace) -> None:
    """One-line `UsageError` for option values argparse cannot check."""
    for name in ("max_new_tokens", "batch_size", "num_samples", "limit", "max_prompt_length", "num_threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UsageError(f"--{name}: expected an integer >= 1, got {value}")
    if args.num_threads is not None:
        from astrai.runtime_env import checked_threads

        try:
            checked_threads(args.num_threads, "--num_threads")
        except ValueError as err:
            raise UsageError(str(err)) from None
    if args.pass_threshold is not None and not math.isfinite(args.pass_threshold):
        raise UsageError(f"--pass_threshold: expected a finite number, got {args.pass_threshold}")
    if not re.fullmatch(r"auto|cpu|cuda(:[0-9]+)?", args.device):
        raise UsageError(f"--device: expected auto, cpu, cuda or cuda:N, got {args.device!r}")
    out = Path(args.output_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise UsageError(f"--output_dir: not a directory: {out}")
    if args.demonstrations is not None:
        check_demonstrations_path(args, out)


def check_demonstrations_path(args: argparse.Namespace, out: Path) -> None:
    """Refuse, before anything is evaluated or written, a `--demonstrations` path that is a directory (or
    `--output_dir`), one of the evaluation's own files, its `--data` or `--config`, or one under an existing file
    or in a folder that cannot be written."""
    target = Path(args.demonstrations).expanduser()
    if target.is_dir() or not target.name or target.resolve() == out.resolve():
        raise UsageError(f"--demonstrations: expected a file path, got the directory {args.demonstrations!r}")
    if target.resolve() in ((out / RESULTS_FILE).resolve(), (out / SUMMARY_FILE).resolve()):
        raise UsageError(f"--demonstrations: {target} is the evaluation's own {target.name}; name another file")
    for name in ("data", "config"):
        given = getattr(args, name)
        if given is not None and target.resolve() == Path(given).expanduser().resolve():
            raise UsageError(f"--demonstrations: {target} is the --{name} file; name another file")
    parent = target.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise UsageError(f"--demonstrations: {parent} is a file, not a folder; cannot write {target}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"--demonstrations: the folder {parent} is not writable; cannot write {target}")


def load_scoring(args: argparse.Namespace, config, chosen: dict) -> tuple[list, Any, list]:
    """(the records to evaluate, their `RewardFunctions`, the reward specs): the data of `--data` (the first
    `--limit`), whose answer field is required only when a reward reads it, and the job's reward functions
    (`rewards.build.evaluation_specs`: `--reward` alone when given) built over its columns. Warns about reference
    answers a reward can never match before anything heavier loads.

    Raises:
        UsageError: an unknown `--reward`. DataError: bad data. RewardFunctionError: a reward function that cannot
        be loaded or served (naming it).
    """
    from astrai.data import PromptDataset
    from astrai.rewards.build import answer_readers, build_rewards, evaluation_specs
    from astrai.rewards.builtins import BUILTIN_REWARDS, unscorable_warning

    if args.reward is not None and args.reward not in BUILTIN_REWARDS:
        raise UsageError(f"--reward: unknown reward {args.reward!r}; choices: {', '.join(sorted(BUILTIN_REWARDS))}")
    specs = evaluation_specs(config, answer_field=chosen["answer_field"], reward=args.reward)
    readers = answer_readers(specs)
    dataset = PromptDataset(args.data, prompt_field=chosen["prompt_field"], answer_field=chosen["answer_field"],
                            field="--data", require_answers=bool(readers))
    records = dataset.records[:args.limit] if args.limit else dataset.records
    for spec in readers:  # said before the model loads, as training says it before its first rollout
        unscorable = unscorable_warning(spec.function, [r.answer for r in records], source=args.data,
                                        field=chosen["answer_field"])
        if unscorable:
            warnings.warn(unscorable, stacklevel=3)
    return records, build_rewards(config, records, specs=specs), specs


def run(args: argparse.Namespace, make_player: Optional[Callable] = None) -> dict:
    """Load, evaluate, write the files; returns the summary. A job with `rollout.tools` or `rollout.environment`
    (its `--config`) plays multi-turn episodes through `make_player(config, engine, tokenizer, model_config,
    records)` (`astrai.experience.build.build_episode_player`, given by `python -m astrai.evaluate`). Raises the
    errors `main` maps to exit code 2."""
    import torch

    from astrai.checkpoint.fsutil import write_atomic
    from astrai.data.prompt_format import check_prompt_format
    from astrai.outputs import OutputWriteError
    from astrai.evaluation.accuracy import EvalSettings, evaluate
    from astrai.checkpoint import load_model
    from astrai.models.special_tokens import stop_token_ids
    from astrai.rewards.build import answer_extractor
    from astrai.rollout.build import build_rollout_engine

    check_options(args)
    model_path, run_config = resolve_model(args.model)
    config_path = Path(args.config) if args.config is not None else run_config
    config, chosen = prompt_settings(args, config_path)
    if args.demonstrations is not None and (config.rollout.tools or config.rollout.environment is not None):
        raise UsageError("--demonstrations: the job's rollout.tools / rollout.environment play multi-turn episodes, "
                         "whose tool turns are not written as demonstrations")
    try:  # EvalSettings names its fields; on this command line they are options
        settings = EvalSettings(max_new_tokens=chosen["max_new_tokens"], temperature=args.temperature,
                                num_samples=args.num_samples, batch_size=args.batch_size)
    except ValueError as err:
        raise UsageError(f"--{err}") from None
    records, rewards, specs = load_scoring(args, config, chosen)
    player = None
    try:
        if args.num_threads:
            torch.set_num_threads(args.num_threads)
        device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                              "cpu" if args.device == "auto" else args.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise UsageError(f"--device: {args.device!r} requested but CUDA is not available")
        if config_path is not None:
            print(f"prompt settings from {config_path}", file=sys.stderr)
        model, tokenizer = load_model(model_path, dtype=getattr(torch, args.dtype), device=device,
                                      revision=args.revision)
        templated = check_prompt_format(tokenizer, chosen["chat_template"], system_prompt=chosen["system_prompt"],
                                        model=model_path, say=lambda line: print(line, file=sys.stderr))
        if args.demonstrations is not None and not templated:
            raise UsageError("--demonstrations: the prompts are raw text (the tokenizer has no chat template, or "
                             "--chat_template false); sft trains on chats, which need the template")
        if args.adaptive_threads is not None:
            config.runtime.adaptive_threads = args.adaptive_threads == "true"
        engine = build_rollout_engine(config, model, tokenizer)  # the job's rollout.engine and its options
        stops = stop_token_ids(model.config, tokenizer)
        if config.rollout.tools or config.rollout.environment is not None:  # the job's multi-turn episodes
            if make_player is None:
                raise UsageError("--config: the job's rollout.tools / rollout.environment play multi-turn episodes; "
                                 "evaluate it with python -m astrai.evaluate")
            player = make_player(config, engine, tokenizer, model.config, records)
        del model
        generator = torch.Generator(device=device).manual_seed(args.seed)
        result = evaluate(engine, tokenizer, records, rewards=rewards, settings=settings,
                          max_prompt_length=chosen["max_prompt_length"], system_prompt=chosen["system_prompt"],
                          truncation=chosen["truncation"], chat_template=chosen["chat_template"],
                          stop_token_ids=stops, source=args.data,
                          generator=generator, extract_answer=answer_extractor(specs),
                          pass_threshold=chosen["pass_threshold"], progress=not args.no_progress_bar,
                          desc="evaluate", player=player)
    finally:
        rewards.close()
        if player is not None:
            player.close()
    functions = [{"name": s.name, "function": s.function, "weight": s.weight, "kwargs": dict(s.kwargs)}
                 for s in specs]
    summary = {"model": args.model, "model_path": model_path, "data": args.data, **result.metrics(),
               "settings": {**chosen, "prompts": "chat template" if templated else "raw text",
                            "reward_functions": functions, "temperature": args.temperature,
                            "greedy": settings.greedy, "num_samples": args.num_samples, "batch_size": args.batch_size,
                            "seed": args.seed, "limit": args.limit, "dtype": args.dtype, "device": str(device),
                            "threads": torch.get_num_threads(), "threads_mean": mean_threads(engine),
                            "config": str(config_path) if config_path else None}}
    out = Path(args.output_dir).expanduser()
    files = []  # the demonstrations first: a failure there leaves the previous results and summary as a pair
    if args.demonstrations is not None:
        rows = result.demonstrations(chosen["system_prompt"])
        target = Path(args.demonstrations).expanduser()
        files.append((target, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)))
        summary["demonstrations"] = {"path": str(target), "rows": len(rows),
                                     "questions": len({row["index"] for row in rows})}
    files += [(out / RESULTS_FILE, "".join(json.dumps(ex, ensure_ascii=False) + "\n" for ex in result.examples)),
              (out / SUMMARY_FILE, json.dumps(summary, indent=2, ensure_ascii=False) + "\n")]
    for path, text in files:
        try:  # each replaced whole or not at all (a full disk leaves the previous file)
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, text)
        except OSError as err:
            raise OutputWriteError.of(path, err) from None
    report(summary, out)
    return summary


def mean_threads(engine) -> Optional[float]:
    """The mean torch thread count of the engine's decode steps over the whole evaluation (the paged engine's
    adaptive threads, `thread_steps`), rounded to 0.01; None for engines without it."""
    steps = getattr(engine, "thread_steps", None)
    return round(steps[0] / steps[1], 2) if steps and steps[1] else None


def report(summary: dict, out: Path) -> None:
    """Print the result lines (pass rate with its interval, pass@k, mean reward with its interval, each reward
    function's mean, throughput, files) to stdout."""
    s = summary["settings"]
    mode = "greedy" if s["greedy"] else f"temperature {s['temperature']}, {s['num_samples']} samples/question"
    print(f"model {summary['model']} | data {summary['data']} ({summary['n']} questions) | {mode}, "
          f"{s['max_new_tokens']} new tokens")
    print(f"accuracy {summary['accuracy']:.4f} ({summary['correct']:g}/{summary['n']}), "
          f"95% Wilson interval [{summary['ci_low']:.4f}, {summary['ci_high']:.4f}] "
          f"(pass: total reward >= {summary['pass_threshold']:g})")
    if summary["num_samples"] > 1:
        print("  ".join(f"pass@{k} {v:.4f}" for k, v in summary["pass_at_k"].items()))
    print(f"mean reward {summary['reward_mean']:.4f}, 95% normal interval over questions "
          f"[{summary['reward_mean_ci_low']:.4f}, {summary['reward_mean_ci_high']:.4f}]")
    print("  ".join(f"{name}: mean {r['mean']:.4f}, applies {r['applies']:.2f}"
                    + (f", failed {r['failed']:g}" if r["failed"] else "") for name, r in summary["rewards"].items()))
    if summary["truncated_fraction"] > 0:
        print(f"{summary['truncated_fraction']:.1%} of the responses were cut by --max_new_tokens "
              f"({s['max_new_tokens']}) before they ended: their rewards scored unfinished answers"
              + ("; raise it" if summary["truncated_fraction"] > 0.5 else ""))
    if "episodes" in summary:
        e = summary["episodes"]
        print(f"per episode: {e['turns']:.2f} turns, {e['tool_calls']:.2f} tool calls, {e['tool_errors']:.2f} tool "
              "errors")
    threads = f"{s['threads']} thread{'' if s['threads'] == 1 else 's'}"
    if s.get("threads_mean") is not None and s["threads_mean"] < s["threads"] - 0.005:
        threads += f", {s['threads_mean']:.2f} on average: other processes were busy (runtime.adaptive_threads)"
    print(f"{summary['generated_tokens']} tokens in {summary['generation_seconds']:.1f} s "
          f"({summary['tokens_per_second']:.1f} tok/s, {threads}); evaluation {summary['wall_seconds']:.1f} s in all")
    if "demonstrations" in summary:
        d = summary["demonstrations"]
        print(f"wrote {d['rows']} demonstrations (the distinct passing responses that ended, of {d['questions']} of "
              f"the {summary['n']} questions) to {d['path']}")
    print(f"wrote {out / RESULTS_FILE} and {out / SUMMARY_FILE}")


def main(argv: Optional[Sequence[str]] = None, make_player: Optional[Callable] = None) -> int:
    """Run the command; returns the exit code (0, or 2 with a one-line message on stderr for bad input, a reward
    function's bug, too many failed reward calls, a results file that cannot be written, or a model whose logits
    are not finite)."""
    from astrai.checkpoint import CheckpointError
    from astrai.config import ConfigError
    from astrai.data import DataError
    from astrai.outputs import OutputWriteError

    from astrai.runtime_env import LOG_LEVEL_VAR, configure_logging, log_level

    start = time.perf_counter()
    try:
        args = build_parser().parse_args(argv)
        configure_logging(log_level(os.environ.get(LOG_LEVEL_VAR)))  # ASTR_LOG_LEVEL, as training jobs read it
        run(args, make_player)
    except (UsageError, ConfigError, DataError, CheckpointError, FileNotFoundError, ValueError,
            OutputWriteError) as err:
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except FloatingPointError as err:  # the sampler met non-finite logits: one line, not its traceback
        print(f"error: the evaluation met non-finite logits ({err}): a model with NaN/inf weights, or activations "
              "that overflow its dtype (try --dtype float32)", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"done in {time.perf_counter() - start:.1f} s (model loading included)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    from astrai.outputs import show_warning

    warnings.showwarning = show_warning  # "warning: MESSAGE" in one line, as python -m astrai.train says them
    sys.exit(main())
