"""Partial rollouts against synchronous ones on a long-tailed workload: the generation phase alone, same engine.

    python bench/partial_rollouts.py [--threads 1] [--batch-size 4] [--group-size 4] [--in-flight 8]
                                     [--max-new-tokens 256] [--stop-ids 3] [--rollouts 6] [--hidden 256]
                                     [--episodes] [--max-turns 3] [--plot PATH]

A random-weight decoder (astrai's `tiny_config` at `--hidden` width, 4 layers, vocabulary 512, float32) on the paged
engine (torch backend). Random weights give near-flat logits, so with `--stop-ids` k stop tokens each token ends its
response with probability about k / 512: geometric, long-tailed response lengths (mean about 512 / k, cut at
`--max-new-tokens`), the shape of reasoning answers. Each rollout needs B = `--batch-size` complete groups of G =
`--group-size` samples of random prompts (8 to 24 ids):

- synchronous: one `generate` of the B prompts x G, to the longest response;
- partial (`astrai.experience.partial.PartialRollouts`, `--in-flight` groups in flight): the engine streamed step by
  step until B groups are complete, the unfinished samples carried to the next rollout (re-prefilled there). The
  staleness bound is set high enough that no sample is re-generated (the weights do not change here).

With `--episodes`, every sample is a multi-turn episode (`astrai.experience.episodes`, docs/agents.md) of up to
`--max-turns` turns: a tool-less environment answers each turn with "Go on." (in this process), the tiny byte-level
tokenizer's ChatML template renders it, and `--max-new-tokens` is the episode's whole budget; vocabulary 283 (the
tokenizer's), the end of turn one of the stop ids. Synchronous: `EpisodeRunner.sample` (the streaming path, every
episode to its end); partial: `astrai.experience.partial_episodes.PartialEpisodes` (episodes carried mid-turn or
between turns).

Prints per mode, over `--rollouts` rollouts after one warm-up rollout: seconds per rollout, decode steps per rollout,
mean rows per decode step (the batch-size profile: generated tokens / steps), generated tokens per second, and the
ratio `sync s/rollout / partial s/rollout`. Generation only: the training step and the staleness it costs are not
part of it (docs/async.md). With `--plot PATH` (single answers only), one more untimed pass of `--rollouts` rollouts
per mode through the engine's streaming API records the rows of every decode step and draws them against the decode
step (the batch-size profile: the tail of a synchronous rollout, a few rows decoding alone, against the partial
rollouts' refilled batch) to PATH (needs matplotlib).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from astrai.experience.partial import PartialRollouts  # noqa: E402
from astrai.experience.partial_episodes import PartialEpisodes  # noqa: E402
from astrai.models import AutoRegressiveLM, tiny_config  # noqa: E402
from astrai.rollout.paged_engine import PagedGenerationEngine  # noqa: E402
from astrai.rollout.sampling import SamplingParams  # noqa: E402

VOCAB, EOS = 512, 2


class CountingEngine:
    """The engine with its streamed steps and their rows counted (everything else passed through)."""

    def __init__(self, engine):
        self.engine, self.steps, self.tokens, self.rows = engine, 0, 0, []

    def step(self):
        out = self.engine.step()
        if out:
            self.steps += 1
            self.tokens += len(out)
            self.rows.append(len(out))
        return out

    def __getattr__(self, name):
        return getattr(self.engine, name)


def prompts(generator: torch.Generator, n: int) -> list[SimpleNamespace]:
    lengths = torch.randint(8, 25, (n,), generator=generator).tolist()
    return [SimpleNamespace(prompt_ids=torch.randint(100, VOCAB, (k,), generator=generator).tolist(), answer="")
            for k in lengths]


def synchronous(engine, params, args, generator) -> tuple[float, int, int]:
    batch = prompts(generator, args.batch_size)
    start = time.perf_counter()
    out = engine.generate([p.prompt_ids for p in batch], params, generator, n=args.group_size)
    return time.perf_counter() - start, engine.last_stats["steps"], int(out.action_mask.sum())


def streamed_synchronous(engine, params, args, generator) -> list[int]:
    """One synchronous rollout (the requests of `synchronous`) through the streaming API: the rows of each decode
    step, to the longest response."""
    counted = CountingEngine(engine)
    engine.wake()
    for record in prompts(generator, args.batch_size):
        engine.add_request(record.prompt_ids, params, n=args.group_size,
                           seed=int(torch.randint(0, 2 ** 62, (1,), generator=generator)))
    while engine.has_unfinished_requests:
        counted.step()
    engine.sleep()
    return counted.rows


def plot_profile(profiles: dict[str, list[list[int]]], args, path: Path) -> None:
    """Rows per decode step against the decode step, one panel per mode, rollouts one after another (a dotted
    line where each begins), to `path` (PNG)."""
    try:
        import matplotlib
    except ImportError:
        print("(no plot: matplotlib is not installed; pip install 'astrai[plot]')")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(profiles), 1, figsize=(8, 2.4 * len(profiles)), sharex=True, sharey=True)
    for ax, (mode, rollouts) in zip(axes, profiles.items()):
        start = 0
        for rows in rollouts:
            ax.step(range(start, start + len(rows)), rows, where="post", color="C0" if mode == "sync" else "C1")
            ax.axvline(start, color="gray", linestyle=":", linewidth=0.8)
            start += len(rows)
        steps = sum(map(len, rollouts))
        mean = sum(map(sum, rollouts)) / steps
        ax.set_title(f"{mode}: {steps} decode steps, {mean:.1f} rows per step on average", fontsize=10)
        ax.set_ylabel("rows")
    axes[-1].set_xlabel(f"decode step ({len(next(iter(profiles.values())))} rollouts of B {args.batch_size} x G "
                        f"{args.group_size}, one after another)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"plot: {path}")


def partial_rollout(engine, params, args, generator, source, version, rows: list | None = None
                    ) -> tuple[float, int, int]:
    """One partial rollout: seconds, decode steps, sampled tokens; each decode step's rows appended to `rows`."""
    counted = CountingEngine(engine)
    runner = SimpleNamespace(engine=counted, sampling=params, decode=lambda ids: "", generate_agreed=lambda f: f(),
                             score_fn=lambda texts, records, ids: torch.zeros(len(ids)),
                             routes_of=lambda records: None, count_truncated=lambda exp: exp)
    sampler = SimpleNamespace(next_batch=lambda n: prompts(generator, n))
    engine.wake()
    start = time.perf_counter()
    source.collect(runner, sampler, generator, version)
    seconds = time.perf_counter() - start
    engine.sleep()
    if rows is not None:
        rows.extend(counted.rows)
    return seconds, counted.steps, counted.tokens


GO_ON = '''
class GoOn:
    """Says "Go on." after every turn; the episode ends at rollout.max_turns."""

    def reset(self, **row):
        return None

    def step(self, message):
        return "Go on."
'''


def episode_runner(engine, params, args, folder: Path):
    """An `EpisodeRunner` over `engine` (counted) with the `GoOn` environment in this process, scores all 0."""
    from astrai.agents.environments import EnvironmentSpec
    from astrai.experience.episode_environments import EpisodeEnvironment
    from astrai.experience.episodes import EpisodeLimits, EpisodeRunner, ToolExecutor
    from astrai.models import tiny_tokenizer

    (folder / "go_on.py").write_text(GO_ON)
    environment = EpisodeEnvironment.load([EnvironmentSpec(None, "GoOn", str(folder / "go_on.py"))], num_workers=0,
                                          timeout_seconds=60.0)
    runner = SimpleNamespace(engine=CountingEngine(engine), sampling=params, generate_agreed=lambda f: f(),
                             score_fn=lambda texts, records, ids: torch.zeros(len(ids)),
                             routes_of=lambda records: None, count_truncated=lambda exp: exp)
    return EpisodeRunner(runner, tiny_tokenizer(), [], ToolExecutor([]), EpisodeLimits(max_turns=args.max_turns),
                         environment=environment)


def episode_records(generator: torch.Generator, n: int) -> list:
    from astrai.data.prompts import PromptRecord

    lengths = torch.randint(2, 8, (n,), generator=generator).tolist()
    return [PromptRecord(" ".join(["Tell me more."] * k), "", i, {}) for i, k in enumerate(lengths)]


def episode_rollout(runner, args, generator, source, version) -> tuple[float, int, int]:
    """One rollout of episodes (synchronous when `source` is None): seconds, decode steps, sampled tokens."""
    counted = runner.engine
    counted.steps = counted.tokens = 0
    counted.wake()
    start = time.perf_counter()
    if source is None:
        records = [r for r in episode_records(generator, args.batch_size) for _ in range(args.group_size)]
        runner.sample(None, records, generator)
    else:
        source.collect(runner, SimpleNamespace(next_batch=lambda n: episode_records(generator, n)), generator,
                       version)
    seconds = time.perf_counter() - start
    counted.sleep()
    return seconds, counted.steps, counted.tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--in-flight", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--stop-ids", type=int, default=3)
    parser.add_argument("--rollouts", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--episodes", action="store_true", help="multi-turn episodes (a step environment)")
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--plot", default=None, help="draw the batch-size profile of each mode to this PNG")
    args = parser.parse_args()
    if args.plot and args.episodes:
        parser.error("--plot: the batch-size profile is drawn for single answers only; drop --episodes")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    vocab = 283 if args.episodes else VOCAB  # episodes: the tiny tokenizer's vocabulary (its ids decode)
    config = tiny_config(vocab_size=vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, eos_token_id=EOS,
                         pad_token_id=EOS, bos_token_id=1, max_position_embeddings=2048)
    model = AutoRegressiveLM(config).eval()
    engine = PagedGenerationEngine(model, pad_token_id=EOS, backend="torch", block_size=16)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0,
                            stop_token_ids=tuple(range(EOS, EOS + args.stop_ids)))
    print(f"threads {args.threads}; B {args.batch_size} x G {args.group_size}; {args.in_flight} groups in flight; "
          f"max_new_tokens {args.max_new_tokens}; {args.stop_ids} stop ids of {VOCAB} (mean length about "
          f"{vocab // args.stop_ids} per turn); hidden {args.hidden}, 4 layers; {args.rollouts} rollouts after a "
          "warm-up"
          + (f"; episodes of up to {args.max_turns} turns" if args.episodes else ""))
    results = {}
    folder = Path(tempfile.mkdtemp(prefix="astrai-bench-"))
    settings = dict(batch_size=args.batch_size, group_size=args.group_size, in_flight=args.in_flight,
                    max_off_policy_steps=10**6)
    for mode in ("sync", "partial"):
        generator = torch.Generator().manual_seed(1)
        runner = episode_runner(engine, params, args, folder) if args.episodes else None
        source = PartialEpisodes(runner, **settings) if args.episodes else PartialRollouts(**settings)
        runs = []
        for r in range(args.rollouts + 1):
            if args.episodes:
                runs.append(episode_rollout(runner, args, generator, source if mode == "partial" else None, r))
            elif mode == "sync":
                runs.append(synchronous(engine, params, args, generator))
            else:
                runs.append(partial_rollout(engine, params, args, generator, source, r))
        runs = runs[1:]
        seconds = statistics.mean(s for s, _, _ in runs)
        steps = statistics.mean(n for _, n, _ in runs)
        tokens = sum(t for _, _, t in runs)
        results[mode] = seconds
        # every measured rollout may find its groups complete already (carried ones): no decode step at all
        rows = tokens / max(1, sum(n for _, n, _ in runs))
        print(f"{mode:8s} {seconds:7.2f} s/rollout  {steps:6.1f} decode steps/rollout  {rows:5.1f} rows/step  "
              f"{tokens / sum(s for s, _, _ in runs):7.1f} tokens/s")
    print(f"ratio: {results['sync'] / results['partial']:.2f} (sync s/rollout / partial s/rollout)")
    if args.plot:  # untimed: the streaming API's decode steps, rollout by rollout
        profiles = {}
        for mode in ("sync", "partial"):
            generator = torch.Generator().manual_seed(1)
            source = PartialRollouts(**settings)
            rollouts = []
            for r in range(args.rollouts + 1):
                if mode == "sync":
                    rollouts.append(streamed_synchronous(engine, params, args, generator))
                else:
                    rollouts.append([])
                    partial_rollout(engine, params, args, generator, source, r, rollouts[-1])
            profiles[mode] = rollouts[1:]
        plot_profile(profiles, args, Path(args.plot))


if __name__ == "__main__":
    main()
