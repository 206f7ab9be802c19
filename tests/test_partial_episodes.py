"""Partial rollouts of multi-turn episodes (`rollout.partial` with `rollout.tools` / `rollout.environment`,
astrai.experience.partial_episodes): a rollout returns B complete groups of episodes and carries the others, an
episode stopped mid-turn keeps the turn's tokens, log-probs and versions and continues it token-exactly in the next
rollout (its whole context re-sent), tool calls in flight are waited for, the staleness bound restarts an episode,
a checkpoint's episodes continue as they would have (an environment's instance re-created and replayed), and an
online_grpo job with tools trains and resumes bitwise."""

import json
import math
import re
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from astrai.agents.chat import render
from astrai.agents.tool_calls import format_tool_call
from astrai.agents.tools import load_tools
from astrai.data.prompts import PromptRecord
from astrai.experience.episodes import EpisodeLimits, EpisodeRunner, ToolExecutor
from astrai.experience.partial_episodes import PartialEpisodes
from astrai.experience.trajectory import NOT_SAMPLED
from astrai.rollout.sampling import SamplingParams
from test_agents_chat import smollm2
from test_environments import _environment, _log, env_file  # noqa: F401
from test_episodes import TOOLS
from test_episodes_streaming import StreamedContextEngine

REPO = Path(__file__).resolve().parents[1]
ASSISTANT = "<|im_start|>assistant\n"


class PolicyStreamingEngine(StreamedContextEngine):
    """A streaming engine stand-in whose turns are `policy(context text)` (the context up to the turn's start),
    one token per `step()` per live request, each with log-prob -0.1 * policy_version - 0.5. A request whose
    context ends inside an assistant turn (a turn a partial rollout stopped) continues that turn after the ids it
    already has (which must be the turn's first ids). Records each request's context."""

    def __init__(self, tokenizer, policy, policy_version: int = 0):
        super().__init__(tokenizer, policy)
        self.policy_version = policy_version
        self.start = tokenizer.encode(ASSISTANT)
        self.contexts: list[list[int]] = []

    @property
    def token_logprob(self) -> float:
        return -0.1 * self.policy_version - 0.5

    def add_request(self, prompt_ids, params, *, n=1, penalty=None, seed=None, top_logprobs=0):
        context = list(prompt_ids)
        self.contexts.append(context)
        k = len(self.start)
        at = max(i + k for i in range(len(context) - k + 1) if context[i:i + k] == self.start)
        done = context[at:]
        turn = self.tokenizer.encode(self.policy(self.tokenizer.decode(context[:at], skip_special_tokens=False)))
        turn += [self.end]
        assert turn[:len(done)] == done, "a continued turn must start with the ids it has"
        rest = turn[len(done):]
        request, self._next = self._next, self._next + 1
        self.live[request] = (rest[:params.max_new_tokens], len(rest) <= params.max_new_tokens)
        return request


CALL = "Let me compute this one carefully, step by step.\n" + format_tool_call("calculator", {"expression": "12 * 34"})
LONG = "A long answer, " + "word " * 80


def tool_policy(context: str) -> str:
    """Question A: a short answer; B: a calculator call, then "It is 408."; C: a long answer."""
    question = re.findall(r"Question (\w)", context)[-1]
    turns = context.count(ASSISTANT) - 1  # the context ends with this turn's start
    if question == "A":
        return "Ok."
    if question == "B":
        return CALL if turns == 0 else "It is 408."
    return LONG


class Prompts:
    """A sampler of the given records, in order."""

    def __init__(self, records):
        self.dataset, self.at = list(records), 0

    def next_batch(self, n):
        out = self.dataset[self.at:self.at + n]
        self.at += n
        return out


def records(questions, **columns):
    return [PromptRecord(f"Question {q}", "408", i, {"answer": "408", **columns.get(q, {})})
            for i, q in enumerate(questions)]


def partial_source(tok, policy, *, tools=(), environment=None, in_flight=3, bound=2, workers=0, max_turns=4):
    """A `PartialEpisodes` of B = 1, G = 1 over a `PolicyStreamingEngine`, with its runner and engine;
    deterministic: each step's tool calls are waited for (the scripted engine's steps take microseconds and never
    let the tool thread run otherwise)."""
    engine = PolicyStreamingEngine(tok, policy)
    sampling = SamplingParams(max_new_tokens=400, stop_token_ids=(engine.end,))
    runner = SimpleNamespace(engine=engine, sampling=sampling, generate_agreed=lambda generate: generate(),
                             score_fn=lambda texts, records, ids: torch.ones(len(ids)),
                             routes_of=lambda records: None, count_truncated=lambda experience: experience)
    loaded = list(tools)
    episodes = EpisodeRunner(runner, tok, loaded, ToolExecutor(loaded, num_workers=workers),
                             EpisodeLimits(max_turns=max_turns), environment=environment, deterministic=True)
    return PartialEpisodes(episodes, batch_size=1, group_size=1, in_flight=in_flight,
                           max_off_policy_steps=bound), engine


@pytest.fixture()
def calculator(tmp_path):
    path = tmp_path / "my_tools.py"
    path.write_text(TOOLS)
    return load_tools([{"function": "calculator", "path": str(path)}])


def test_an_episode_stopped_mid_turn_continues_it_token_exactly_under_the_new_weights(calculator):
    tok = smollm2()
    partial, engine = partial_source(tok, tool_policy, tools=calculator)
    sampler = Prompts(records("ABC"))
    first = partial.collect(partial.episodes, sampler, torch.Generator(), policy_version=0)
    # A answers in 3 tokens: its group is the rollout's one; B and C are stopped 3 tokens into their first turns
    assert [t.text for t in first.trajectories()] == ["Ok."]
    b, c = (g.samples[0] for g in partial.groups)
    call_ids = tok.encode(CALL) + [engine.end]
    assert b.pending_ids == call_ids[:3] and b.pending_versions == [0, 0, 0] and b.pending_logprobs == [-0.5] * 3
    assert not b.turn_starts and not b.done and c.pending_ids == tok.encode(LONG)[:3]
    assert first.stats["carried_samples"] == 0 and first.stats["groups_in_flight"] == 2

    engine.policy_version, engine.contexts = 2, []
    second = partial.collect(partial.episodes, sampler, torch.Generator(), policy_version=2)
    # B's turn went on from its 3 tokens (its context re-sent: prompt + the turn so far), called the calculator, and
    # answered, before C's long answer ended
    assert engine.contexts[0] == b.prompt_ids + call_ids[:3]
    (traj,) = second.trajectories()
    assert traj.text == "It is 408." and b.ended_by == "answer"
    assert [m["content"] for m in traj.messages[1:]] == ["408", "It is 408."]
    full = tok.encode(render(tok, [{"role": "user", "content": "Question B"}] + traj.messages, calculator,
                             add_generation_prompt=False))
    assert list(traj.prompt_ids + traj.response_ids) + tok.encode("\n") == full  # token-exact across the stop
    first_turn = len(call_ids)
    assert list(traj.response_ids[:first_turn]) == call_ids
    assert list(traj.policy_versions[:first_turn]) == [0] * 3 + [2] * (first_turn - 3)  # two versions, one turn
    assert list(traj.logprobs[:first_turn]) == pytest.approx([-0.5] * 3 + [-0.7] * (first_turn - 3))
    second_turn = traj.turn_starts[1]
    assert set(traj.policy_versions[first_turn:second_turn]) == {NOT_SAMPLED}  # the tool result, masked out
    assert not any(traj.loss_mask[first_turn:second_turn]) and all(traj.loss_mask[second_turn:])
    assert set(traj.policy_versions[second_turn:]) == {2}
    s = second.stats
    assert s["carried_samples"] == 2 and s["staleness_max"] == 2 and s["regenerated_samples"] == 0
    assert s["episodes/tool_calls/calculator"] == 1 and s["episodes/turns"] == 2
    assert second.policy_version == 2 and second.stats["staleness/lag_2"] == pytest.approx(3 / sum(traj.loss_mask))

    engine.policy_version, engine.contexts = 5, []
    third = partial.collect(partial.episodes, sampler, torch.Generator(), policy_version=5)
    # C's oldest tokens (version 0) would lag 5 > 2: it was re-started from its prompt
    assert third.stats["regenerated_samples"] == 1 and third.stats["carried_samples"] == 0
    assert c.prompt_ids in engine.contexts and third.stats["staleness_max"] == 0
    assert [t.text for t in third.trajectories()] == [LONG]


def test_tool_calls_in_flight_when_the_rollout_stops_are_waited_for(calculator):
    """B's call ends its first turn on the step that completes A's group: the call still runs and its result is
    appended before the rollout returns; B is carried ready for its second turn."""
    tok = smollm2()
    call_ids = tok.encode(CALL) + [tok.special_tokens["<|im_end|>"]]
    partial, _ = partial_source(tok, lambda ctx: "x " * (len(call_ids) - 2) if "Question A" in ctx
                                else tool_policy(ctx), tools=calculator, in_flight=2)
    partial.collect(partial.episodes, Prompts(records("AB")), torch.Generator(), policy_version=0)
    (b,) = partial.groups[0].samples
    assert len(b.turn_starts) == 1 and not b.pending_ids and b.completion[-1] == {"role": "tool",
                                                                                "name": "calculator", "content": "408"}


def round_trip(state: dict) -> dict:
    """`state` through torch.save / torch.load(weights_only=True), as a checkpoint holds it."""
    import io

    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_a_checkpoint_of_episodes_in_flight_continues_as_the_run_would_have(calculator):
    tok = smollm2()
    partial_records = records("ABC")
    straight, engine = partial_source(tok, tool_policy, tools=calculator)
    straight.collect(straight.episodes, Prompts(partial_records), torch.Generator(), policy_version=0)
    state = round_trip(straight.state_dict(partial_records))
    assert any(s["pending_ids"] for g in state["groups"] for s in g["samples"])
    resumed, resumed_engine = partial_source(tok, tool_policy, tools=calculator)
    resumed.load_state_dict(state, partial_records)
    outs = []
    for source, eng in ((straight, engine), (resumed, resumed_engine)):
        eng.policy_version = 2
        sampler = Prompts(partial_records)
        sampler.at = 3
        outs.append(source.collect(source.episodes, sampler, torch.Generator(), policy_version=2))
    a, b = (o.trajectories() for o in outs)
    assert a == b and len(a) == 1 and a[0].text == "It is 408."
    assert outs[0].stats == outs[1].stats


SLOW = "Thinking, " + "more " * 30


def counter_policy(context: str) -> str:
    """Quick: add 1, add 2, "Done."; Slow: add 1, then a long turn of thought ending with add 2, then "Done."."""
    turns = context.count(ASSISTANT) - 1  # the context ends with this turn's start
    slow = "Slow" in context
    if turns == 0:
        return format_tool_call("add", {"k": 1})
    if turns == 1:
        return (SLOW if slow else "") + format_tool_call("add", {"k": 2})
    return "Done."


def test_an_environment_episode_resumed_from_a_checkpoint_replays_its_calls_on_a_new_instance(env_file):
    tok = smollm2()
    rows = [PromptRecord("Quick", "", 0, {"start": 10}), PromptRecord("Slow", "", 1, {"start": 100})]
    runs = []
    for resume in (False, True):
        env = _environment(env_file, {None: "Counter"}, workers=1)
        partial, engine = partial_source(tok, counter_policy, environment=env, in_flight=2)
        partial.collect(partial.episodes, Prompts(rows), torch.Generator(), policy_version=0)
        (slow,) = partial.groups[0].samples
        assert len(slow.turn_starts) == 1 and slow.pending_ids  # one add ran; stopped in the long second turn
        if resume:
            state = partial.state_dict(rows)
            env.close()
            env = _environment(env_file, {None: "Counter"}, workers=1)
            partial, engine = partial_source(tok, counter_policy, environment=env, in_flight=2)
            partial.load_state_dict(state, rows)
        engine.policy_version = 1
        try:
            out = partial.collect(partial.episodes, Prompts([]), torch.Generator(), policy_version=1)
        finally:
            env.close()
        runs.append(out)
    straight, resumed = runs
    # the replayed instance held 100 + 1 when the episode went on: add 2 said "total 103", get_reward 103
    for out in runs:
        (traj,) = out.trajectories()
        assert [m["content"] for m in traj.messages if m["role"] == "tool"] == ["total 101", "total 103"]
        assert traj.reward_components["environment"] == 103.0 and traj.text == "Done."
    assert straight.trajectories() == resumed.trajectories()
    resets = [e for e in _log(env_file) if e[0] == "reset" and e[1] == 100]
    assert len(resets) == 3  # the straight run's, the interrupted run's, and the replay's


FLAKY = '''
import json, os


def log(*event):
    with open(os.environ["ASTRAI_TEST_FLAKY_LOG"], "a") as f:
        f.write(json.dumps(event) + "\\n")


class Flaky:
    """A counter of steps whose reset fails while the file ASTRAI_TEST_FLAKY_FAIL exists and whose step ends the
    game while ASTRAI_TEST_FLAKY_END exists (so a resumed job's replay can meet other answers)."""

    def reset(self, start, **row):
        if os.path.exists(os.environ["ASTRAI_TEST_FLAKY_FAIL"]):
            raise RuntimeError("reset is down")
        self.total = int(start)
        log("reset", start)

    def step(self, message):
        self.total += 1
        return None if os.path.exists(os.environ["ASTRAI_TEST_FLAKY_END"]) else f"total {self.total}"

    def get_reward(self):
        return float(self.total)

    def close(self):
        log("close", getattr(self, "total", None))
'''


def flaky_policy(context: str) -> str:
    """Quick: three short turns; Slow: a short turn, then a long one."""
    turns = context.count(ASSISTANT) - 1
    return SLOW if "Slow" in context and turns >= 1 else "Hm."


@pytest.fixture()
def flaky(tmp_path, monkeypatch):
    path = tmp_path / "flaky.py"
    path.write_text(FLAKY)
    monkeypatch.setenv("ASTRAI_TEST_FLAKY_LOG", str(tmp_path / "flaky.log"))
    monkeypatch.setenv("ASTRAI_TEST_FLAKY_FAIL", str(tmp_path / "fail"))
    monkeypatch.setenv("ASTRAI_TEST_FLAKY_END", str(tmp_path / "end"))
    return path


def flaky_log(flaky):
    log = flaky.parent / "flaky.log"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def stopped_then_resumed(tok, flaky, *, flag: str = "", max_turns: int = 3):
    """Run one rollout of Quick and Slow (B = 1 of 2 groups in flight) with `Flaky`, save, create the file `flag`
    ("fail": resets fail, "end": steps end the game; "" none), and load into a new source (`max_turns`) over a new
    environment; returns the new source (its engine at policy_version 1) and environment."""
    rows = [PromptRecord("Quick", "", 0, {"start": 10}), PromptRecord("Slow", "", 1, {"start": 20})]
    env = _environment(flaky, {None: "Flaky"}, workers=0)
    partial, _ = partial_source(tok, flaky_policy, environment=env, in_flight=2, max_turns=3)
    partial.collect(partial.episodes, Prompts(rows), torch.Generator(), policy_version=0)
    state = round_trip(partial.state_dict(rows))
    env.close()
    if flag:
        (flaky.parent / flag).write_text("")
    env = _environment(flaky, {None: "Flaky"}, workers=0)
    partial, engine = partial_source(tok, flaky_policy, environment=env, in_flight=2, max_turns=max_turns)
    partial.load_state_dict(state, rows)
    engine.policy_version = 1
    return partial, env


def test_a_reset_failing_on_resume_ends_the_episode_after_its_turn_as_a_failed_start_does(flaky):
    """The resumed job's reset fails: the episode (one turn done, stopped in its long second turn) finishes that
    turn and ends "env_error", its environment reward marked failed, never an empty or unfinished trajectory."""
    with pytest.warns(UserWarning, match="reset failed: RuntimeError: reset is down"):
        partial, env = stopped_then_resumed(smollm2(), flaky, flag="fail")
    (slow,) = partial.groups[0].samples
    assert len(slow.turn_starts) == 1 and slow.pending_ids and not slow.done  # it goes on, as a failed start does
    try:
        out = partial.collect(partial.episodes, Prompts([]), torch.Generator(), policy_version=1)
    finally:
        env.close()
    (traj,) = out.trajectories()
    assert slow.ended_by == "env_error" and len(traj.turn_starts) == 2 and traj.text == SLOW
    assert traj.reward_failed["environment"] is True and out.stats["episodes/env_errors/reset"] == 1


def test_an_episode_a_replayed_step_ends_gets_its_reward_and_close(flaky):
    """An environment that answers otherwise on the resume (its step ends the game once ASTRAI_TEST_FLAKY_END
    exists): the replayed step of the first turn ends the episode on load ("environment", its turn in progress
    dropped), and the next rollout returns it with get_reward's value and runs its close."""
    partial, env = stopped_then_resumed(smollm2(), flaky, flag="end")
    (slow,) = partial.groups[0].samples
    assert slow.ended_by == "environment" and not slow.pending_ids and len(slow.turn_starts) == 1
    try:
        out = partial.collect(partial.episodes, Prompts([]), torch.Generator(), policy_version=1)
    finally:
        env.close()
    (traj,) = out.trajectories()
    assert traj.text == "Hm." and traj.reward_components["environment"] == 21.0  # 20, then the replayed step
    assert flaky_log(flaky)[-1] == ["close", 21]


def test_groups_of_another_kind_of_sample_are_dropped_on_resume_with_a_warning(calculator, tmp_path):
    """A checkpoint's groups in flight continue only where they were sampled alike: single answers into a job with
    tools, episodes into a job without, or episodes whose prompts offer other tools, are dropped, said once."""
    from astrai.experience.partial import PartialRollouts

    tok = smollm2()
    rows = records("ABC")
    source, _ = partial_source(tok, tool_policy, tools=calculator)
    source.collect(source.episodes, Prompts(rows), torch.Generator(), policy_version=0)
    episodes_state = round_trip(source.state_dict(rows))
    assert episodes_state["kind"] == "episodes" and episodes_state["tools"] == ["calculator"]
    single = PartialRollouts(batch_size=1, group_size=1, in_flight=3, max_off_policy_steps=2)
    with pytest.warns(UserWarning, match=r"the 2 group\(s\) in flight in the checkpoint were sampled as episodes "
                                         r"offering the tools \['calculator'\] and this job samples single answers"):
        single.load_state_dict(episodes_state, rows)
    assert single.groups == []
    (tmp_path / "other.py").write_text(TOOLS)
    shout = load_tools([{"function": "shout", "path": str(tmp_path / "other.py")}])
    other, _ = partial_source(tok, tool_policy, tools=shout)
    with pytest.warns(UserWarning, match=r"and this job samples episodes offering the tools \['shout'\]"):
        other.load_state_dict(episodes_state, rows)
    assert other.groups == []
    single_state = {"groups": [{"record": 0, "samples": [{"response_ids": [5], "logprobs": [-1.0],
                                                          "policy_versions": [0], "done": False}]}]}
    with pytest.warns(UserWarning, match="were sampled as single answers"):
        source.load_state_dict(single_state, rows)  # a checkpoint of before this field: single answers
    assert source.groups == []
    source.load_state_dict(episodes_state, rows)  # the same kind: continued
    assert len(source.groups) == 2


def test_a_resumed_job_with_a_smaller_budget_restarts_the_episodes_it_no_longer_fits(calculator):
    """rollout.max_new_tokens lowered on resume: a carried episode whose tokens fill the new budget is restarted
    from its prompt (counted in regenerated_samples), not sent with no token left."""
    tok = smollm2()
    rows = records("ABC")
    source, engine = partial_source(tok, lambda ctx: "Ok." if "Question A" in ctx else LONG, tools=calculator)
    source.collect(source.episodes, Prompts(rows), torch.Generator(), policy_version=0)
    state = round_trip(source.state_dict(rows))
    resumed, engine = partial_source(tok, lambda ctx: "Ok." if "Question A" in ctx else LONG, tools=calculator)
    resumed.load_state_dict(state, rows)
    assert [len(g.samples[0].pending_ids) for g in resumed.groups] == [3, 3]
    resumed.episodes.runner.sampling = SamplingParams(max_new_tokens=3, stop_token_ids=(engine.end,))
    engine.policy_version = 1
    out = resumed.collect(resumed.episodes, Prompts([]), torch.Generator(), policy_version=1)
    assert out.stats["regenerated_samples"] == 2 and all(len(t.response_ids) <= 3 for t in out.trajectories())


def test_a_resumed_job_with_fewer_turns_restarts_the_episodes_past_them(flaky):
    """rollout.max_turns lowered on resume (3 -> 1): the carried Slow episode, one turn done and in its second,
    has no turn left and is restarted from its prompt (a trial saw such episodes run on to 5.5 turns)."""
    resumed, env = stopped_then_resumed(smollm2(), flaky, max_turns=1)
    (slow,) = resumed.groups[0].samples
    assert len(slow.turn_starts) == 1 and slow.pending_ids
    try:
        out = resumed.collect(resumed.episodes, Prompts([]), torch.Generator(), policy_version=1)
    finally:
        env.close()
    assert out.stats["regenerated_samples"] == 1 and out.stats["episodes/turns"] == 1


def test_config_accepts_partial_rollouts_with_tools_and_environments():
    from astrai.config import load_config

    grpo = str(REPO / "configs/examples/grpo.yaml")
    on = ["--rollout.partial", "true", "--rollout.max_off_policy_steps", "2", "--rollout.correction", "token_tis"]
    tools = json.dumps([{"function": "calculator", "path": "t.py"}])
    assert load_config(grpo, on + ["--rollout.tools", tools]).rollout.partial
    assert load_config(grpo, on + ["--rollout.environment", "m:C"]).rollout.environment == "m:C"


# ------------------------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def agent_model_dir(tmp_path_factory):
    """The tiny model with room for the tool schemas (1024 positions) and 11 stop ids: its random turns end at
    uneven lengths, so partial rollouts stop episodes mid-turn and between turns."""
    from single_turn_reference import tiny_model

    path = tiny_model(tmp_path_factory.mktemp("tiny-agent"))
    config = json.loads((path / "config.json").read_text())
    config.update(max_position_embeddings=1024, eos_token_id=[2, *range(40, 50)])
    (path / "config.json").write_text(json.dumps(config))
    return path


def run_agent(model_dir, root, steps, extra=(), config="grpo.yaml"):
    """online_grpo with a calculator tool and partial rollouts, on the tiny model (deterministic, 1 thread);
    the engine answers every first turn with a calculator call (`script_turns`); the reward pays a used tool and a
    long answer."""
    from astrai.train import main
    from scripted_turns import register_calculator_engine

    root.mkdir(parents=True, exist_ok=True)
    (root / "my_tools.py").write_text(TOOLS)
    (root / "reward.py").write_text(textwrap.dedent('''\
        def used_tool(completions, **kw):
            return [float(any(m["role"] == "tool" and m["content"] == "408" for m in c))
                    + len(c[-1]["content"] or "") / 100 for c in completions]
        '''))
    register_calculator_engine("scripted_partial_test", model_dir)
    data = root / "prompts.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is 12 * {i}?", "answer": "0"}) + "\n" for i in range(16)))
    out = root / "run"
    code = main(["--config", str(REPO / "configs/examples" / config), "--model.path", str(model_dir),
                 "--data.path", str(data), "--data.max_prompt_length", "128", "--train.output_dir", str(out),
                 "--max_steps", str(steps), "--rollout.max_new_tokens", "160", "--train.progress_bar", "false",
                 "--train.report_to", "none", "--runtime.num_threads", "1", "--runtime.deterministic", "true",
                 "--grpo.group_size", "2", "--rollout.batch_size", "2", "--grpo.minibatch_size", "2",
                 "--grpo.micro_batch_size", "2", "--optim.learning_rate", "1e-3", "--rollout.temperature", "2.0",
                 "--rollout.engine", "scripted_partial_test", "--rollout.max_turns", "3",
                 "--rollout.tools", json.dumps([{"function": "calculator", "path": str(root / "my_tools.py")}]),
                 "--reward.functions", json.dumps([{"function": "used_tool", "path": str(root / "reward.py")}]),
                 "--reward.num_workers", "0", "--rollout.partial", "true", "--rollout.max_off_policy_steps", "2",
                 "--rollout.correction", "token_tis", *extra])
    assert code == 0
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_online_grpo_with_tools_and_partial_rollouts_trains_and_resumes_bitwise(agent_model_dir, tmp_path,
                                                                                  monkeypatch):
    from test_partial_rollouts import assert_same_run

    from astrai.trainer.loop import Trainer

    extra = ["--checkpoint.save_steps", "4"]
    straight = run_agent(agent_model_dir, tmp_path / "straight", 4, extra)
    steps = [m for m in straight if "policy/loss" in m]
    assert len(steps) == 4
    for m in steps:
        assert m["rollout/episodes/tool_calls/calculator"] == 1.0 and m["rollout/staleness_max"] <= 2
        assert 0 < m["rollout/episodes/masked_out_fraction"] < 1 and m["rewards/used_tool/mean"] >= 1.0
    assert sum(m["rollout/carried_samples"] for m in steps) > 0
    fit = Trainer.fit

    def stop_after_three(self):  # in the middle of the second rollout (2 optimizer steps each)
        self.state.max_steps = 3
        return fit(self)

    monkeypatch.setattr(Trainer, "fit", stop_after_three)
    run_agent(agent_model_dir, tmp_path / "split", 4, extra)
    monkeypatch.undo()
    saved = torch.load(tmp_path / "split/run/checkpoints/step-00000003/strategy_state.pt", weights_only=True)
    episodes = [s for g in saved["partial_rollouts"]["groups"] for s in g["samples"]]
    assert any(e["ended_by"] is None and (e["pending_ids"] or e["turn_starts"]) for e in episodes)
    resumed = run_agent(agent_model_dir, tmp_path / "split", 4, extra + ["--checkpoint.resume", "auto"])
    assert_same_run(straight, resumed, tmp_path / "straight/run", tmp_path / "split/run", step=4)


def test_online_ppo_trains_on_partial_rollouts_of_episodes(agent_model_dir, tmp_path):
    """online_ppo: the critic's values and GAE over carried episodes (tool tokens masked out, several versions)."""
    steps = [m for m in run_agent(agent_model_dir, tmp_path, 3, ["--ppo.minibatch_size", "2",
                                                                  "--ppo.micro_batch_size", "2"], config="ppo.yaml")
             if "policy/loss" in m]
    assert len(steps) == 3 and all(math.isfinite(m["critic/loss"]) and math.isfinite(m["policy/loss"]) for m in steps)
    assert sum(m["rollout/carried_samples"] for m in steps) > 0
    assert all(m["rollout/episodes/tool_calls/calculator"] == 1.0 for m in steps)


TALLY = '''
def log(event):
    with open(__file__ + ".log", "a") as f:
        f.write(event + "\\n")


class Tally:
    """Adds up the length of every assistant message; its observations and reward say the running total."""

    def reset(self, start, **row):
        self.total, self.steps = int(start), 0
        log("reset")
        return f" Start at {start}."

    def close(self):
        log("close")

    def step(self, message):
        self.steps += 1
        self.total += len(message["content"])
        return None if self.steps == 3 else f"Total {self.total}."

    def get_reward(self):
        return self.total / 100
'''


def game_args(model_dir, root, steps, extra=()) -> list[str]:
    """The command line of `run_game` (its files written under `root`)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "game.py").write_text(TALLY)
    data = root / "prompts.jsonl"
    data.write_text("".join(json.dumps({"question": "Talk.", "start": s}) + "\n" for s in range(16)))
    out = root / "run"
    return ["--config", str(REPO / "configs/examples/grpo.yaml"), "--model.path", str(model_dir),
                 "--data.path", str(data), "--data.system_prompt", "null", "--data.max_prompt_length", "64",
                 "--train.output_dir", str(out), "--max_steps", str(steps), "--rollout.max_new_tokens", "128",
                 "--train.progress_bar", "false", "--train.report_to", "none", "--runtime.num_threads", "1",
                 "--runtime.deterministic", "true", "--grpo.group_size", "2", "--rollout.batch_size", "2",
                 "--grpo.minibatch_size", "2", "--grpo.micro_batch_size", "2", "--optim.learning_rate", "1e-3",
                 "--rollout.temperature", "2.0", "--rollout.max_turns", "4", "--rollout.environment_workers", "1",
                 "--rollout.environment", json.dumps({"class": "Tally", "path": str(root / "game.py")}),
                 "--rollout.partial", "true", "--rollout.max_off_policy_steps", "2",
                 "--rollout.correction", "token_tis", "--rollout.generation_batch_size", "8",
                 "--checkpoint.save_steps", "4", *extra]


def run_game(model_dir, root, steps, extra=()):
    """online_grpo on the `Tally` environment (its instances in a worker process) with partial rollouts, on the
    tiny model's own random turns (deterministic, 1 thread)."""
    from astrai.train import main

    assert main(game_args(model_dir, root, steps, extra)) == 0
    return [json.loads(line) for line in (root / "run/metrics.jsonl").read_text().splitlines()]


def test_an_environment_job_with_partial_rollouts_resumes_bitwise_by_replaying_its_instances(agent_model_dir, tmp_path,
                                                                                             monkeypatch):
    """The environment's state (a running total its observations and reward report) lives in a worker across
    rollouts; a job stopped at step 3 (mid-rollout, 2 optimizer steps each) with episodes mid-game and resumed
    re-creates and replays their instances: its metrics, weights and episodes in flight equal the uninterrupted
    run's; without the replay (the instances only reset) the observations differ. Every instance is closed by the
    end."""
    from test_partial_rollouts import assert_same_run

    from astrai.trainer.loop import Trainer

    straight = run_game(agent_model_dir, tmp_path / "straight", 6)
    steps = [m for m in straight if "policy/loss" in m]
    assert len(steps) == 6 and sum(m["rollout/carried_samples"] for m in steps) > 0
    events = (tmp_path / "straight/game.py.log").read_text().split()
    assert events.count("close") == events.count("reset") > 16  # in-flight instances closed when training ended
    assert all(m["rollout/episodes/env_errors"] == 0 and m["rewards/environment/mean"] > 0 for m in steps)
    fit = Trainer.fit

    def stop_after_three(self):  # in the middle of the second rollout (2 optimizer steps each)
        self.state.max_steps = 3
        return fit(self)

    monkeypatch.setattr(Trainer, "fit", stop_after_three)
    run_game(agent_model_dir, tmp_path / "split", 6)
    monkeypatch.undo()
    saved = torch.load(tmp_path / "split/run/checkpoints/step-00000003/strategy_state.pt", weights_only=True)
    episodes = [s for g in saved["partial_rollouts"]["groups"] for s in g["samples"]]
    assert any(e["ended_by"] is None and e["turn_starts"] for e in episodes)  # mid-game: its instance has state
    import shutil

    from astrai.experience.episode_environments import EpisodeEnvironment

    shutil.copytree(tmp_path / "split", tmp_path / "unreplayed")
    resumed = run_game(agent_model_dir, tmp_path / "split", 6, ["--checkpoint.resume", "auto"])
    assert_same_run(straight, resumed, tmp_path / "straight/run", tmp_path / "split/run", step=6)
    # the control: the same resume with the replayed steps skipped (the instances only reset) differs
    step = EpisodeEnvironment.step
    monkeypatch.setattr(EpisodeEnvironment, "step", lambda self, episodes, messages=None: (
        [None] * len(episodes) if messages is not None else step(self, episodes)))
    unreplayed = run_game(agent_model_dir, tmp_path / "unreplayed", 6,
                          ["--checkpoint.resume", "auto", "--data.path", str(tmp_path / "split/prompts.jsonl")])
    assert [m["step"] for m in unreplayed if "policy/loss" in m] == [1, 2, 3, 4, 5, 6]  # 4-6 after the resume

    def in_flight(run):  # the episodes in flight at the end: their messages (observations say the totals)
        state = torch.load(tmp_path / run / "run/checkpoints/step-00000006/strategy_state.pt", weights_only=True)
        return [[s["messages"] for s in g["samples"]] for g in state["partial_rollouts"]["groups"]]

    assert in_flight("split") == in_flight("straight") != in_flight("unreplayed")


def test_two_ranks_carry_their_own_episodes_and_resume_them_bitwise(agent_model_dir, tmp_path):
    """2 processes (torchrun, gloo): each rank its own episodes in flight and environment instances, saved per rank
    and replayed on resume: a job stopped after step 2 and resumed equals the uninterrupted one."""
    import os
    import socket
    import subprocess
    import sys

    from test_partial_rollouts import assert_same_run

    def two_ranks(root, steps, extra=()):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
               "-m", "astrai.train", *game_args(agent_model_dir, root, steps, ["--checkpoint.save_steps", "2",
                                                                              *extra])]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert done.returncode == 0, done.stderr[-3000:]
        return [json.loads(line) for line in (root / "run/metrics.jsonl").read_text().splitlines()]

    straight = two_ranks(tmp_path / "straight", 4)
    assert sum(m["rollout/carried_samples"] for m in straight) > 0
    two_ranks(tmp_path / "split", 2)
    saved = [torch.load(tmp_path / f"split/run/checkpoints/step-00000002/strategy_state{suffix}.pt",
                        weights_only=True) for suffix in ("", "_rank00001")]
    assert all(state["partial_rollouts"]["kind"] == "episodes" and state["partial_rollouts"]["groups"]
               for state in saved)
    resumed = two_ranks(tmp_path / "split", 4, ["--checkpoint.resume", "auto"])
    assert_same_run(straight, resumed, tmp_path / "straight/run", tmp_path / "split/run", step=4)
