"""Multi-turn episodes with tools (astrai.experience.episodes) on SmolLM2's real tokenizer and template, with a
scripted engine that "samples" given assistant texts: the ids are token-exact (prompt + sampled turns verbatim +
separators and tool results equal the whole conversation rendered and tokenized), the loss mask is 1 exactly on
sampled tokens, every cap ends an episode for its reason, malformed and surplus calls become error results, tools
run in worker processes with a hard timeout, and the episode collates into the training batch."""

import dataclasses
import textwrap

import pytest
import torch

from astrai.agents.chat import render
from astrai.agents.tool_calls import format_tool_call
from astrai.agents.tools import load_tools
from astrai.experience.episodes import EpisodeLimits, ToolExecutor, episode_metrics, run_episodes
from astrai.experience.trajectory import Experience
from astrai.rollout.generation import Generation
from astrai.rollout.sampling import SamplingParams
from scripted_turns import register_calculator_engine
from test_agents_chat import smollm2

TOOLS = '''
import time

def calculator(expression: str) -> str:
    """Evaluate a product of two integers.

    Args:
        expression: two integers joined by '*', e.g. "12 * 34".
    """
    a, b = (int(x) for x in expression.split("*"))
    return str(a * b)


def sleepy(seconds: float) -> str:
    """Sleep, then say so.

    Args:
        seconds: how long.
    """
    time.sleep(seconds)
    return "awake"


def shout(text: str) -> str:
    """Repeat the text many times.

    Args:
        text: what to repeat.
    """
    return " ".join([text.upper()] * 200)
'''


def scripted_generation(rows: list[list[int]], finished: list[bool], policy_version: int) -> Generation:
    """The `Generation` of scripted response `rows` (right-padded with 0, log-prob -0.5 per sampled token)."""
    width = max(map(len, rows))
    response = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask = torch.tensor([[True] * len(r) + [False] * (width - len(r)) for r in rows])
    return Generation(prompt_ids=torch.zeros(len(rows), 1, dtype=torch.long),
                      prompt_mask=torch.ones(len(rows), 1, dtype=torch.bool), response_ids=response,
                      action_mask=mask, old_logprobs=torch.where(mask, -0.5, 0.0), finished=torch.tensor(finished),
                      policy_version=policy_version)


class ScriptedEngine:
    """A `GenerationEngine` stand-in: row i of each call "samples" the next scripted text of the episode whose
    context it continues (found by its prompt), through the end-of-turn token, cut at its max_new_tokens; every
    sampled token has log-prob -0.5. Records the contexts it was given."""

    def __init__(self, tokenizer, scripts: dict[tuple[int, ...], list[str]], policy_version: int = 7):
        self.tokenizer, self.scripts, self.policy_version = tokenizer, scripts, policy_version
        self.end = tokenizer.special_tokens["<|im_end|>"]
        self.contexts: list[list[int]] = []
        self._turn: dict[tuple[int, ...], int] = {}

    def generate(self, prompts, params, generator=None) -> Generation:
        rows, finished = [], []
        for context, p in zip(prompts, params):
            self.contexts.append(list(context))
            key = next(k for k in self.scripts if tuple(context[:len(k)]) == k)
            turn = self._turn.get(key, 0)
            self._turn[key] = turn + 1
            ids = self.tokenizer.encode(self.scripts[key][turn]) + [self.end]
            finished.append(len(ids) <= p.max_new_tokens)
            rows.append(ids[:p.max_new_tokens])
        return scripted_generation(rows, finished, self.policy_version)


@pytest.fixture()
def tools(tmp_path):
    path = tmp_path / "my_tools.py"
    path.write_text(TOOLS)
    references = [{"function": name, "path": str(path)} for name in ("calculator", "sleepy", "shout")]
    return load_tools(references), [(name, str(path)) for name in ("calculator", "sleepy", "shout")]


def _run(tok, tools, conversations, scripts, *, budget=400, limits=EpisodeLimits(), workers=0, timeout=30.0):
    loaded, references = tools
    prompt_keys = [tuple(tok.encode(render(tok, c, loaded))) for c in conversations]
    engine = ScriptedEngine(tok, dict(zip(prompt_keys, scripts)))
    executor = ToolExecutor(loaded, references, num_workers=workers, timeout_seconds=timeout)
    try:
        sampling = SamplingParams(max_new_tokens=budget, stop_token_ids=(engine.end,))
        return run_episodes(engine, tok, conversations, loaded, executor, sampling, limits), engine
    finally:
        executor.close()


ASK = [{"role": "user", "content": "What is 12 * 34?"}]
CALL = "Let me compute.\n" + format_tool_call("calculator", {"expression": "12 * 34"})


@pytest.mark.parametrize("workers", [0, 1])
def test_an_episode_is_token_exact_and_masks_only_sampled_tokens(tools, workers):
    tok = smollm2()
    (episode,), engine = _run(tok, tools, [ASK], [[CALL, "12 * 34 = 408."]], workers=workers)
    assert episode.ended_by == "answer" and episode.text == "12 * 34 = 408."
    assert episode.completion == [{"role": "assistant", "content": "Let me compute.", "tool_calls": [  # OpenAI shape
                                      {"type": "function", "function": {"name": "calculator",
                                                                        "arguments": {"expression": "12 * 34"}}}]},
                                  {"role": "tool", "name": "calculator", "content": "408"},
                                  {"role": "assistant", "content": "12 * 34 = 408."}]
    # the call written back as the Hermes text it was sampled as: token-exact, as rendered in one piece
    full = tok.encode(render(tok, ASK + episode.completion, tools[0], add_generation_prompt=False))
    separator = tok.encode("\n")
    assert episode.prompt_ids + episode.response_ids + separator == full
    sampled = [tok.encode(CALL) + [engine.end], tok.encode("12 * 34 = 408.") + [engine.end]]
    starts = episode.turn_starts
    assert episode.response_ids[starts[0]:starts[0] + len(sampled[0])] == sampled[0]
    assert episode.response_ids[starts[1]:] == sampled[1]  # the sampled ids verbatim
    assert sum(episode.loss_mask) == sum(map(len, sampled))
    assert all(m == (lp == -0.5) == (v == 7) for m, lp, v in zip(episode.loss_mask, episode.logprobs,
                                                              episode.policy_versions))
    # the engine continued the episode's own ids: the second turn's context is prompt + first turn + tool result
    assert engine.contexts[1] == episode.prompt_ids + episode.response_ids[:starts[1]]
    traj = episode.trajectory(score=1.0)
    batch = Experience.from_trajectories([traj, traj], pad_token_id=0)
    assert batch.sequences.action_mask.sum().item() == 2 * sum(map(len, sampled))
    assert batch.trajectories()[0] == dataclasses.replace(traj, metadata={})  # the batch keeps no metadata


def test_every_cap_ends_an_episode_for_its_reason(tools):
    tok = smollm2()
    asks = [[{"role": "user", "content": f"Question {i}?"}] for i in range(4)]
    scripts = [[CALL, CALL, CALL],                          # keeps calling: max_turns (2)
               ["An answer far too long to fit " * 40],   # cut by the budget mid-turn: length
               [format_tool_call("shout", {"text": "hey"})],  # a long result leaves no room: budget
               ["Done."]]                                   # answers
    limits = EpisodeLimits(max_turns=2, max_tool_response_tokens=150)
    episodes, _ = _run(tok, tools, asks, scripts, budget=160, limits=limits)
    assert [e.ended_by for e in episodes] == ["max_turns", "length", "budget", "answer"]
    assert [len(e.turn_starts) for e in episodes] == [2, 1, 1, 1]
    assert all(len(e.response_ids) <= 160 for e in episodes)
    assert episodes[2].messages[-1]["role"] == "assistant"  # the result that did not fit was not appended
    metrics = episode_metrics(episodes)
    assert metrics["ended/max_turns"] == metrics["ended/length"] == metrics["ended/budget"] == 0.25
    assert metrics["turns"] == 5 / 4 and metrics["tool_calls/calculator"] == 1 / 4  # one result ran, then the cap
    assert 0 < metrics["masked_out_fraction"] < 1


def test_malformed_and_surplus_calls_become_error_results(tools):
    tok = smollm2()
    turn = ("<tool_call>{not json}</tool_call>" + format_tool_call("calculator", {"expression": "2 * 3"})
            + format_tool_call("calculator", {"expression": "4 * 5"})
            + format_tool_call("nope", {}) + format_tool_call("calculator", {"wrong": 1}))
    limits = EpisodeLimits(max_parallel_tool_calls=2)
    (episode,), _ = _run(tok, tools, [ASK], [[turn, "ok"]], limits=limits)
    results = [m["content"] for m in episode.messages if m["role"] == "tool"]
    assert results[0].startswith("Error: ") and results[1:3] == ["6", "20"]
    assert "nope" in results[3] and results[3].startswith("Error")
    assert results[4].startswith("Error: at most 2 tool calls run per turn")
    assert episode.ended_by == "answer" and episode.tool_errors["calculator"] == 1


@pytest.mark.parametrize("workers", [0, 1])
def test_a_raising_tool_is_warned_once_with_its_traceback_and_counted(tools, workers):
    """Two episodes each call the calculator with a bad expression: one warning (the first failure) names the tool
    and carries its traceback (the worker's user frames, or this process's); both failures are counted."""
    tok = smollm2()
    bad = format_tool_call("calculator", {"expression": "x * 2"})
    asks = [ASK, [{"role": "user", "content": "What is x * 2?"}]]
    with pytest.warns(UserWarning) as warned:
        episodes, _ = _run(tok, tools, asks, [[bad, "ok"], [bad, "ok"]], workers=workers)
    said = [str(w.message) for w in warned if "rollout.tools" in str(w.message)]
    assert len(said) == 1, said
    assert said[0].startswith("rollout.tools: calculator failed: ValueError: invalid literal for int()"), said
    assert "rollout/episodes/tool_errors/calculator" in said[0]
    assert "Traceback" in said[0] and 'a, b = (int(x) for x in expression.split("*"))' in said[0], said
    assert [e.tool_errors["calculator"] for e in episodes] == [1, 1]


def test_a_hanging_tool_is_killed_at_the_timeout_and_long_results_are_cut(tools):
    tok = smollm2()
    turn = format_tool_call("sleepy", {"seconds": 100}) + format_tool_call("shout", {"text": "hi"})
    limits = EpisodeLimits(max_tool_response_tokens=30, tool_response_truncation="left")
    with pytest.warns(UserWarning, match=r"rollout.tools: sleepy failed: timed out after 1 s"):
        (episode,), _ = _run(tok, tools, [ASK], [[turn, "ok"]], workers=1, timeout=1.0, limits=limits)
    sleepy, shout = [m["content"] for m in episode.messages if m["role"] == "tool"]
    assert sleepy == "Error: timed out after 1 s (rollout.tool_timeout_seconds)"
    assert shout.startswith("[... cut to the last 30 tokens]") and shout.endswith("HI")
    assert episode.tool_errors == {"sleepy": 1, "shout": 0}
    assert episode.tool_results_cut == 1 and episode_metrics([episode])["tool_results_cut"] == 0.5  # 1 of 2 results


def test_tool_results_cut_by_the_limit_are_counted_and_said_once(tools):
    """Issue 42, class 1: a tool result `rollout.max_tool_response_tokens` cuts is counted on every rollout
    (`episodes/tool_results_cut`, the share of tool results cut) and said once, not only marked in the text."""
    import warnings

    tok = smollm2()
    shout = "Let me shout.\n" + format_tool_call("shout", {"text": "hi"})
    limits = EpisodeLimits(max_turns=2, max_tool_response_tokens=8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        experience, _ = _scored_episodes(tok, tools, ["Shout?"], [[shout, "done", shout, "done"]], limits=limits,
                                         rollouts=2)
    said = [str(w.message) for w in caught if "max_tool_response_tokens" in str(w.message)]
    assert len(said) == 1 and said[0].startswith("rollout.max_tool_response_tokens (8) cut 1 of 1 tool results of "
                                                 "this rollout"), said
    assert experience.stats["episodes/tool_results_cut"] == 1.0
    uncut, _ = _scored_episodes(tok, tools, ["Shout?"], [[shout, "done"]], limits=EpisodeLimits(max_turns=2))
    assert uncut.stats["episodes/tool_results_cut"] == 0.0


def test_the_end_of_turn_token_must_stop_the_sampler(tools):
    tok = smollm2()
    with pytest.raises(ValueError, match="not a stop token of the sampler"):
        run_episodes(ScriptedEngine(tok, {}), tok, [ASK], tools[0], ToolExecutor(tools[0]),
                     SamplingParams(max_new_tokens=8, stop_token_ids=(0,)), EpisodeLimits())


@pytest.mark.parametrize("kind", ["online_grpo", "online_ppo"])
def test_online_train_types_train_on_multi_turn_episodes_with_tools(tiny_model_dir, tmp_path, tools, kind):
    """rollout.tools on a job: every sample is an episode (the tiny random model rarely calls a tool, so the engine
    is wrapped to answer its first turn with a calculator call): online_grpo and online_ppo (its critic and GAE
    across the masked tool tokens) train 2 steps, log the episode metrics, and the reward sees each episode's
    messages."""
    import json
    import shutil

    from astrai.train import main

    model_dir = tmp_path / "model"  # the tiny model with room for the tool schemas its character-level tokenizer
    shutil.copytree(tiny_model_dir, model_dir)  # spells out (RoPE positions: any length works)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 1024}))

    reward = tmp_path / "episode_reward.py"
    reward.write_text(textwrap.dedent('''\
        def used_tool(completions, **kw):
            return [float(any(m["role"] == "tool" and m["content"] == "408" for m in c)) for c in completions]
        '''))
    register_calculator_engine("scripted_test", model_dir)  # a first turn (nothing of the budget spent): a call
    job = tmp_path / "job.yaml"
    job.write_text(textwrap.dedent(f"""\
        train: {{type: {kind}, max_steps: 2, output_dir: {tmp_path / 'run'}, progress_bar: false,
                report_to: [none]}}
        data: {{max_prompt_length: 64}}
        reward:
          functions: [{{function: used_tool, path: {reward}}}]
          num_workers: 0
        rollout:
          batch_size: 2
          max_new_tokens: 160
          engine: scripted_test
          tools: [{{function: calculator, path: {tools[1][0][1]}}}]
          max_turns: 2
          tool_workers: 1
        grpo: {{group_size: 2, minibatch_size: 4, micro_batch_size: 2}}
        ppo: {{minibatch_size: 2, micro_batch_size: 2, kl_coef: 0.0}}
        checkpoint: {{save_at_end: false}}
        """))
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is 12 * {i}?", "answer": "0"}) + "\n" for i in range(4)))
    assert main(["--config", str(job), "--model.path", str(model_dir), "--data.path", str(data)]) == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2
    for r in records:
        assert r["rewards/used_tool/mean"] == 1.0  # every episode's tool result reached the reward
        assert r["rollout/episodes/tool_calls/calculator"] == 1.0 and r["rollout/episodes/tool_errors"] == 0.0
        assert r["rollout/episodes/turns"] >= 1.0 and 0 < r["rollout/episodes/masked_out_fraction"] < 1
        # the paged engine streams the episodes: the second turn reuses the first turn's prompt blocks
        assert r["rollout/episodes/prefill_tokens_reused"] > 0 and 0 < r["rollout/episodes/prefill_reused_fraction"] < 1
    # runtime.deterministic: turn-synchronous episodes (bitwise reproducible), which report no prefix-cache reuse
    det = tmp_path / "deterministic"
    assert main(["--config", str(job), "--model.path", str(model_dir), "--data.path", str(data), "--train.output_dir",
                 str(det), "--max_steps", "1", "--runtime.deterministic", "true"]) == 0
    logged = json.loads((det / "metrics.jsonl").read_text().splitlines()[-1])
    assert logged["rewards/used_tool/mean"] == 1.0 and "rollout/episodes/prefill_tokens_reused" not in logged
    # evaluated as it trains: in training (data.eval_path) and by python -m astrai.evaluate with the job's config,
    # each question an episode with the same tools, scored by the job's reward on the episode's messages
    from astrai import evaluate

    out = tmp_path / "eval-run"
    assert main(["--config", str(job), "--model.path", str(model_dir), "--data.path", str(data), "--train.output_dir",
                 str(out), "--max_steps", "1", "--train.eval_steps", "1", "--data.eval_path", str(data)]) == 0
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
    assert logged["eval/rewards/used_tool/mean"] == 1.0 and logged["eval/num_questions"] == 4
    answers = [json.loads(line) for line in (out / "eval" / "step-00000001.jsonl").read_text().splitlines()]
    assert len(answers) == 4 and all(ex["rewards"]["used_tool"] == [1.0] for ex in answers)
    # and the episodes' turns and tool use are counted, per question and per episode
    assert all(ex["tool_calls"] == [1] and ex["tool_errors"] == [0] and ex["turns"][0] >= 1 for ex in answers)
    assert logged["eval/episodes/tool_calls"] == 1.0 and logged["eval/episodes/tool_errors"] == 0.0
    assert logged["eval/episodes/turns"] == sum(ex["turns"][0] for ex in answers) / 4
    assert evaluate.main(["--model", str(model_dir), "--config", str(job), "--data", str(data), "--output_dir",
                          str(tmp_path / "cli"), "--no_progress_bar"]) == 0
    summary = json.loads((tmp_path / "cli" / "summary.json").read_text())
    assert summary["rewards"]["used_tool"]["mean"] == 1.0 and summary["n"] == 4
    assert summary["episodes"]["tool_calls"] == 1.0 and summary["episodes"]["tool_errors"] == 0.0
    assert summary["episodes"]["turns"] >= 1.0


def _scored_episodes(tok, tools, questions, scripts, *, budget=400, limits=EpisodeLimits(), rollouts=1):
    """`EpisodeRunner.sample` over the `ScriptedEngine` (scripts per question) with the job's reward path
    (`RewardFunctions` through `score_records`, as `astrai.experience.build` wires it): the built-in
    `math_exact_match` against answer "408" and a user function that records the completions it was given.
    Returns (the last of `rollouts` sampled Experiences, what the user function received)."""
    from types import SimpleNamespace

    from astrai.data.prompts import PromptRecord
    from astrai.experience.episodes import EpisodeRunner
    from astrai.rewards.build import score_records
    from astrai.rewards.functions import RewardFunctions, reward_reference
    from astrai.rewards.workers import RewardFunctionSpec

    seen = []

    def shape(completions, **kwargs):
        seen.extend(completions)
        return [0.0] * len(completions)

    specs = [RewardFunctionSpec("math", "math_exact_match", 0, kwargs={"answer_field": "answer"}),
             RewardFunctionSpec("shape", reward_reference(shape), 1)]
    rewards = RewardFunctions(specs, columns=["answer"], num_workers=0)
    loaded, references = tools
    asks = [[{"role": "user", "content": q}] for q in questions]
    engine = ScriptedEngine(tok, {tuple(tok.encode(render(tok, a, loaded))): s for a, s in zip(asks, scripts)})
    engine.pad_token_id, engine.device = 0, torch.device("cpu")
    sampling = SamplingParams(max_new_tokens=budget, stop_token_ids=(engine.end,))
    runner = SimpleNamespace(engine=engine, sampling=sampling, generate_agreed=lambda generate: generate(),
                             score_fn=lambda texts, records, ids: score_records(rewards, texts, records, ids),
                             routes_of=lambda records: None, count_truncated=lambda experience: experience)
    records = [PromptRecord(q, "408", i, {"answer": "408"}) for i, q in enumerate(questions)]
    episodes = EpisodeRunner(runner, tok, loaded, ToolExecutor(loaded, references, num_workers=0), limits)
    try:
        for _ in range(rollouts - 1):
            episodes.sample(None, records)
        return episodes.sample(None, records), seen
    finally:
        episodes.close()


def test_the_math_reward_is_never_paid_from_a_calls_arguments(tools):
    """The gold number (408) only in a call's arguments: one episode ends by its budget on a well-formed call (its
    long result would not fit), one has its turn cut by the budget inside the call (an open, malformed block). The
    final assistant message holds no call text, `Episode.text` / the trajectory's text is the content outside the
    calls, and math_exact_match scores 0 where the raw sampled text would have paid 1."""
    from astrai.rewards.builtins import math_exact_match

    tok = smollm2()
    shouted = "Let me shout.\n" + format_tool_call("shout", {"text": "408"})
    cut = "I need the product.\n" + format_tool_call("calculator", {"expression": "408" + " and so on" * 60})
    limits = EpisodeLimits(max_turns=2, max_tool_response_tokens=150)
    experience, seen = _scored_episodes(tok, tools, ["Shout?", "Product?"], [[shouted], [cut]], budget=160,
                                        limits=limits)
    by_budget, by_length = experience.trajectories()
    assert experience.stats["episodes/ended/budget"] == experience.stats["episodes/ended/length"] == 0.5
    assert by_budget.messages == [{"role": "assistant", "content": "Let me shout.", "tool_calls": [
        {"type": "function", "function": {"name": "shout", "arguments": {"text": "408"}}}]}]
    assert by_length.messages == [{"role": "assistant", "content": "I need the product."}]  # the open call: dropped
    assert [t.text for t in (by_budget, by_length)] == ["Let me shout.", "I need the product."]
    assert [t.reward_components["math"] for t in (by_budget, by_length)] == [0.0, 0.0]
    assert seen == [by_budget.messages, by_length.messages]
    sampled = tok.decode([t for t, m in zip(by_length.response_ids, by_length.loss_mask) if m])
    assert sampled.startswith(cut[:60]) and len(sampled) < len(cut)  # the budget cut the call's arguments
    raw = [[{"role": "assistant", "content": text}] for text in (shouted, sampled)]
    assert math_exact_match([None, None], raw, answer=["408", "408"]) == [1.0, 1.0]  # what the call text paid
    only_a_call = format_tool_call("shout", {"text": "408"})
    (episode,), _ = _run(tok, tools, [ASK], [[only_a_call]], budget=160, limits=limits)
    assert episode.ended_by == "budget" and episode.text == "" and episode.completion[-1]["content"] == ""


def test_an_episode_cut_by_max_turns_after_a_call_is_not_paid_from_its_arguments(tools):
    """Issue 39's trial: the episode's last turn (its `max_turns`-th) makes a call whose arguments end with the gold
    number (408), so the call does not run and the episode ends on it. The reward functions, the trajectory's text
    and the responses that `completions.jsonl` logs see the content outside the call, not the call's JSON:
    math_exact_match scores 0 where the raw sampled text would have paid 1 (its last-number fallback)."""
    from astrai.rewards.builtins import math_exact_match

    tok = smollm2()
    check = "Let me check it.\n" + format_tool_call("calculator", {"expression": "1 * 408"})
    experience, seen = _scored_episodes(tok, tools, ["Product?"], [[CALL, check]], limits=EpisodeLimits(max_turns=2))
    (trajectory,) = experience.trajectories()
    assert experience.stats["episodes/ended/max_turns"] == 1.0
    assert [m["role"] for m in trajectory.messages] == ["assistant", "tool", "assistant"]
    assert trajectory.messages[-1] == {"role": "assistant", "content": "Let me check it.", "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "1 * 408"}}}]}
    assert seen == [trajectory.messages] and trajectory.text == experience.responses[0] == "Let me check it."
    assert trajectory.reward_components["math"] == 0.0
    assert all("<tool_call>" not in (m.get("content") or "") for m in trajectory.messages)
    raw = [{"role": "assistant", "content": check}]
    assert math_exact_match([None], [raw], answer=["408"]) == [1.0]  # what the call's text would have paid


def test_a_call_sampled_in_a_non_canonical_form_keeps_the_trajectory_token_exact(tools):
    """The model writes its call on one line, compact JSON, with text after it: the message holds the text outside
    the call as content and the call in `tool_calls` (rendered back in the canonical form, which is not the sampled
    text), yet the trajectory is the sampled ids verbatim and the tool result's ids are those the sampled text gives:
    the episode's ids equal the conversation with the raw sampled text as content, rendered in one piece."""
    tok = smollm2()
    turn = ('Let me compute. <tool_call>{"name":"calculator","arguments":{"expression":"12*34"}}</tool_call>'
            ' Then answer.')
    (episode,), engine = _run(tok, tools, [ASK], [[turn, "12 * 34 = 408."]])
    assert episode.ended_by == "answer" and episode.text == "12 * 34 = 408."
    assert episode.completion[0] == {"role": "assistant", "content": "Let me compute.  Then answer.", "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "12*34"}}}]}
    as_sampled = [{"role": "assistant", "content": turn}, *episode.completion[1:]]
    full = tok.encode(render(tok, ASK + as_sampled, tools[0], add_generation_prompt=False))
    assert episode.prompt_ids + episode.response_ids + tok.encode("\n") == full
    canonical = tok.encode(render(tok, ASK + episode.completion, tools[0], add_generation_prompt=False))
    assert canonical != full  # the call written back is not what was sampled: only the messages were re-read
    start = episode.turn_starts[1]
    assert engine.contexts[1] == episode.prompt_ids + episode.response_ids[:start]
    assert episode.response_ids[:len(tok.encode(turn)) + 1] == tok.encode(turn) + [engine.end]


def test_reward_functions_get_the_same_completion_messages_for_a_native_and_a_non_native_template(tools):
    """The same sampled turns (a call beside a malformed block, then the answer) under ChatML without tool support
    and a Qwen2.5-style template with it: the reward functions receive the same messages, in the OpenAI shape
    (TRL's, verl's), and the math reward pays the answer in both."""
    from test_agents_chat import QWEN25_LIKE, tiny_with

    from astrai.models import tiny_tokenizer

    turn = CALL + '\n<tool_call>{"name": "calculator", "arguments": {"expression": "1 * 2"</tool_call>'
    received = {}
    for name, tok in (("chatml", tiny_tokenizer()), ("qwen25_like", tiny_with(QWEN25_LIKE))):
        experience, seen = _scored_episodes(tok, tools, ["What is 12 * 34?"], [[turn, "12 * 34 = 408."]])
        (trajectory,) = experience.trajectories()
        assert experience.stats["episodes/ended/answer"] == 1.0 and trajectory.reward_components["math"] == 1.0
        assert seen == [trajectory.messages]
        received[name] = seen[0]
    assert received["chatml"] == received["qwen25_like"]
    assert [m["role"] for m in received["chatml"]] == ["assistant", "tool", "tool", "assistant"]
    assert received["chatml"][0] == {"role": "assistant", "content": "Let me compute.", "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "12 * 34"}}}]}
    assert received["chatml"][1] == {"role": "tool", "name": "calculator", "content": "408"}
    assert received["chatml"][2]["content"].startswith("Error: the tool call is not valid JSON")
    assert received["chatml"][3] == {"role": "assistant", "content": "12 * 34 = 408."}


def test_max_turns_1_with_tools_is_warned_at_start_and_check(long_model_dir, tmp_path):
    """rollout.max_turns 1 with rollout.tools ended every episode at its first response: no tool ever ran, nothing
    said it (trial). Start-up and --check now warn in one line; 2 turns do not."""
    from astrai.config import load_config
    from astrai.experience.build import unanswered_tool_calls
    from astrai.train import main

    tools = ["--train.type", "online_grpo", "--rollout.tools", '[{function: "astrai.agents.calculator:calculator"}]']
    assert unanswered_tool_calls(load_config(None, tools + ["--rollout.max_turns", "2"])) is None
    assert unanswered_tool_calls(load_config(None, ["--rollout.max_turns", "1"])) is None
    args = [*tools, "--model.path", str(long_model_dir), "--data.path", "builtin:arithmetic", "--data.max_prompt_length",
            "200", "--rollout.max_new_tokens", "16", "--train.output_dir", str(tmp_path / "out"),
            "--rollout.max_turns", "1", "--check"]
    with pytest.warns(UserWarning, match="^rollout.max_turns 1 with rollout.tools: each episode ends at its first "
                                         "response, so no tool call is ever run"):
        assert main(args) == 0
    assert not (tmp_path / "out").exists()


def _cut_of_the_whole_text(tok, text, limits):
    """The cut as it was: the whole text tokenized, then its first or last `max_tool_response_tokens` kept."""
    ids, keep = tok.encode_text(text), limits.max_tool_response_tokens
    if len(ids) <= keep:
        return text
    if limits.tool_response_truncation == "left":
        return f"[... cut to the last {keep} tokens]" + tok.decode(ids[-keep:])
    return tok.decode(ids[:keep]) + f"[... cut to the first {keep} tokens]"


@pytest.mark.parametrize("side", ["right", "left"])
def test_a_long_tool_result_is_cut_from_a_bounded_piece_exactly_as_from_the_whole(side):
    """A trial: a tool returning 50 MB made each rollout's generation take 130 s (the whole text was tokenized to
    keep 32 tokens). Now a text longer than a bound (twice what the kept tokens can span) is cut to it by
    characters first: the cut equals the whole text's for every kind of text, and a huge one is cheap."""
    import random

    from astrai.experience.episodes import _cut, _cut_bound

    tok = smollm2()
    rng = random.Random(0)
    words = ["alpha", "Beta", "  ", "\n\n", "12345", "{\"k\": [1, 2]}", "ünïcödé", "日本語のテキスト", "🙂🙃", "\t", "x" * 300,
             "def f(x):\n    return x", "<|im_end|>", "-" * 90, " " * 200]
    for keep in (1, 8, 32, 256):
        limits = EpisodeLimits(max_tool_response_tokens=keep, tool_response_truncation=side)
        bound = _cut_bound(tok, keep)
        texts = ["", "short", "word " * keep, "word " * (keep + 1), " ".join(["SHOUT"] * bound),
                 *("".join(rng.choice(words) for _ in range(n)) for n in (3, keep, 4 * keep, bound // 4, bound))]
        for text in texts:
            assert _cut(tok, text, limits) == _cut_of_the_whole_text(tok, text, limits), (keep, text[:80])
        assert sum(len(t) > bound for t in texts) >= 2  # the bounded path was taken
    seen = []
    encode = tok.encode_text
    tok.encode_text = lambda text: seen.append(len(text)) or encode(text)
    limits = EpisodeLimits(max_tool_response_tokens=32, tool_response_truncation=side)
    out = _cut(tok, "x" * 50_000_000, limits)
    assert seen == [_cut_bound(tok, 32)] and seen[0] < 10_000, seen  # one bounded piece tokenized; one word: no start
    assert out == _cut_of_the_whole_text(tok, "x" * (_cut_bound(tok, 32)), limits)
