"""Environments (rollout.environment, astrai.agents.environments and astrai.experience.environments): one instance
per episode whose state persists across its turns and never leaks to another episode (G per prompt), reset's three
return forms, a tool-less game driven by step and ended by None, get_reward summed with a reward function, close
called after a normal end, an exception and a timeout, a hanging method interrupted at 1 s and one that ignores the
interruption killed with its worker, routing rows by a column, the stop rule, bad config lines and --check, and
online_grpo end to end. The policy is a scripted engine whose turn is a function of the episode's decoded context
(so the G episodes of one prompt are driven alike and their difference can only come from the environment), on
SmolLM2's real tokenizer and template for token-exactness."""

import json
import re
import textwrap
import time
from types import SimpleNamespace

import pytest
import torch

from astrai.agents.chat import render
from astrai.agents.tool_calls import format_tool_call
from astrai.agents.tools import load_tools
from astrai.experience.environments import EnvironmentFailure, EnvironmentFailures
from astrai.experience.episode_environments import EpisodeEnvironment
from astrai.experience.episodes import EpisodeLimits, EpisodeRunner, ToolExecutor, episode_metrics, run_episodes
from astrai.experience.runner import RolloutRunner
from astrai.agents.environments import EnvironmentSpec
from astrai.rewards.functions import ScoredRewards
from astrai.rollout.generation import Generation
from astrai.rollout.sampling import SamplingParams
from scripted_turns import script_turns
from test_agents_chat import smollm2
from test_episodes import scripted_generation

ENVS = '''
import json, os, re, time

def log(*event):
    with open(os.environ["ASTRAI_TEST_ENV_LOG"], "a") as f:
        f.write(json.dumps(event) + "\\n")


class Counter:
    """A counter each episode adds to with its own instance."""

    def __init__(self):
        self.total = None

    def reset(self, start, **row):
        self.total = int(start)
        log("reset", start, sorted(row))
        return None

    def add(self, k: int) -> str:
        """Add k to the counter.

        Args:
            k: the amount to add.
        """
        self.total += k
        return f"total {self.total}"

    def boom(self) -> str:
        """Always fails."""
        raise ValueError("no boom today")

    def hang(self) -> str:
        """Sleeps far too long."""
        time.sleep(100)

    def stubborn(self) -> str:
        """Sleeps far too long and swallows every interruption."""
        while True:
            try:
                time.sleep(100)
            except BaseException:
                pass

    def get_reward(self) -> float:
        return float(self.total)

    def close(self):
        log("close", self.total)


class Greeter:
    """reset returns what the row's mode says."""

    def reset(self, mode, **row):
        if mode == "text":
            return " Also, say hello."
        if mode == "messages":
            return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there?"}]
        return None


class Guess:
    """Guess the number: replies higher or lower; the episode ends when the guess is right."""

    def reset(self, secret, **row):
        self.secret, self.won, self.tries = int(secret), False, 0
        log("reset", secret, sorted(row))
        return "I think of a number between 1 and 100."

    def step(self, message):
        self.tries += 1
        guess = int(re.findall(r"\\d+", message["content"])[-1])
        if guess == self.secret:
            self.won = True
            return None
        return "higher" if guess < self.secret else "lower"

    def get_reward(self):
        return 1.0 if self.won else 0.0

    def close(self):
        log("close", self.tries)


class Broken:
    """Fails where the row says."""

    def reset(self, fail, **row):
        self.fail = fail
        if fail == "reset":
            raise RuntimeError("reset is broken")
        if fail == "wrong":
            return 42
        return None

    def step(self, message):
        if self.fail == "step":
            raise KeyError("step is broken")
        if self.fail == "hang":
            time.sleep(100)
        return "go on"

    def get_reward(self):
        return "lots" if self.fail == "reward" else 1.0

    def close(self):
        log("close", self.fail)
'''

TOOLS = '''
def shout(text: str) -> str:
    """Shout the text.

    Args:
        text: what to shout.
    """
    return text.upper()
'''


class ContextEngine:
    """A `GenerationEngine` stand-in: each row "samples" `policy(decoded context)` through the end-of-turn token,
    cut at its max_new_tokens, every token with log-prob -0.5."""

    def __init__(self, tokenizer, policy):
        self.tokenizer, self.policy = tokenizer, policy
        self.end = tokenizer.special_tokens["<|im_end|>"]
        self.pad_token_id, self.device = 0, torch.device("cpu")

    def generate(self, prompts, params, generator=None) -> Generation:
        rows, finished = [], []
        for context, p in zip(prompts, params):
            text = self.tokenizer.decode(list(context), skip_special_tokens=False)
            ids = self.tokenizer.encode(self.policy(text)) + [self.end]
            finished.append(len(ids) <= p.max_new_tokens)
            rows.append(ids[:p.max_new_tokens])
        return scripted_generation(rows, finished, 3)


@pytest.fixture()
def env_file(tmp_path, monkeypatch):
    path = tmp_path / "my_envs.py"
    path.write_text(ENVS)
    monkeypatch.setenv("ASTRAI_TEST_ENV_LOG", str(tmp_path / "log.jsonl"))
    return path


def _log(env_file):
    log = env_file.parent / "log.jsonl"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def _environment(env_file, classes, *, workers=0, timeout=30.0, routed_by=None, window=3, fraction=0.5):
    specs = [EnvironmentSpec(route, name, str(env_file)) for route, name in classes.items()]
    return EpisodeEnvironment.load(specs, num_workers=workers, timeout_seconds=timeout, routed_by=routed_by,
                                   failures=EnvironmentFailures(max_error_fraction=fraction, error_window=window))


def _run(tok, environment, rows, policy, *, tools=(), budget=400, limits=EpisodeLimits(), routes=None,
         conversations=None):
    engine = ContextEngine(tok, policy)
    conversations = conversations or [[{"role": "user", "content": row["question"]}] for row in rows]
    sampling = SamplingParams(max_new_tokens=budget, stop_token_ids=(engine.end,))
    return run_episodes(engine, tok, conversations, list(tools), ToolExecutor(list(tools)), sampling, limits,
                        environment=environment, routes=routes or [None] * len(rows), rows=rows)


def _tool_results(episode):
    return [m["content"] for m in episode.completion if m["role"] == "tool"]


COUNTER_TURNS = [format_tool_call("add", {"k": 1}), format_tool_call("add", {"k": 2}), "Done."]


def counter_policy(context: str) -> str:
    """Add 1, then add 2, then answer: the turn after as many as the context holds."""
    return COUNTER_TURNS[min(context.count("<|im_start|>assistant") - 1, 2)]


@pytest.mark.parametrize("workers", [0, 2])
def test_an_instance_keeps_its_episode_state_and_never_shares_it(env_file, workers):
    """Two prompts x G = 2 episodes: each episode adds 1 then 2 to its own counter started from its row, so its
    results are start + 1, start + 3 and its reward start + 3; a shared or leaked instance would count on."""
    tok = smollm2()
    environment = _environment(env_file, {None: "Counter"}, workers=workers)
    rows = [{"question": f"Count from {s}.", "start": s} for s in (10, 10, 20, 20)]
    try:
        episodes = _run(tok, environment, rows, counter_policy)
    finally:
        environment.close()
    assert [_tool_results(e) for e in episodes] == [["total 11", "total 13"]] * 2 + [["total 21", "total 23"]] * 2
    assert [e.env_reward for e in episodes] == [13.0, 13.0, 23.0, 23.0]
    assert all(e.ended_by == "answer" and not e.env_errors for e in episodes)
    log = _log(env_file)
    assert sorted(event[1] for event in log if event[0] == "close") == [13, 13, 23, 23]  # close: every instance
    assert all(event[2] == ["question"] for event in log if event[0] == "reset")  # the row, less what reset names
    e = episodes[0]  # token-exact: prompt + response (+ the final separator) = the conversation rendered whole
    full = tok.encode(render(tok, e.messages, e.tools, add_generation_prompt=False))
    assert e.prompt_ids + e.response_ids + tok.encode("\n") == full
    assert [t.name for t in e.tools] == ["add", "boom", "hang", "stubborn"]  # public methods, reserved ones not
    sampled = [tok.encode(text) + [tok.special_tokens["<|im_end|>"]] for text in COUNTER_TURNS]
    assert sum(e.loss_mask) == sum(map(len, sampled))  # loss mask 1 exactly on the three sampled turns, verbatim
    assert [e.response_ids[s:s + len(ids)] for s, ids in zip(e.turn_starts, sampled)] == sampled
    assert episode_metrics(episodes)["env_errors"] == 0.0 and episode_metrics(episodes)["tool_calls/add"] == 2.0


def test_reset_returns_text_messages_or_none(env_file):
    tok = smollm2()
    environment = _environment(env_file, {None: "Greeter"})
    rows = [{"question": "Hi.", "mode": m} for m in ("text", "messages", "none")]
    conversations = [[{"role": "system", "content": "You are kind."}, {"role": "user", "content": "Hi."}]] * 3
    episodes = _run(tok, environment, rows, lambda context: "Hello!", conversations=conversations)
    firsts = [e.messages[:e.first] for e in episodes]
    assert firsts[0] == [{"role": "system", "content": "You are kind."},
                         {"role": "user", "content": "Hi. Also, say hello."}]  # appended to the last user turn
    assert firsts[1] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there?"}]
    assert firsts[2] == conversations[2]  # None: the row's prompt
    for e, first in zip(episodes, firsts):
        assert e.prompt_ids == tok.encode(render(tok, first, add_generation_prompt=True))
        assert e.tools == [] and e.completion == [{"role": "assistant", "content": "Hello!"}]


def guess_policy(context: str) -> str:
    """Guess 50, then 25 after "lower" or 75 after "higher", then 37."""
    replies = re.findall(r"<\|im_start\|>user\n(higher|lower)<\|im_end\|>", context)
    if not replies:
        return "I guess 50."
    return {("lower",): "25", ("higher",): "75"}.get(tuple(replies), "Then 37.")


def test_a_tool_less_game_steps_every_turn_and_ends_when_step_returns_none(env_file):
    """Secret 37: 50 (lower), 25 (higher), 37 (step returns None: ended "environment", reward 1); secret 99: 50
    (higher), 75 (higher), 37 at the last turn (step still called, then max_turns, reward 0)."""
    tok = smollm2()
    environment = _environment(env_file, {None: "Guess"}, workers=1)
    rows = [{"question": "Play.", "secret": 37}, {"question": "Play.", "secret": 99}]
    try:
        won, lost = _run(tok, environment, rows, guess_policy, limits=EpisodeLimits(max_turns=3))
    finally:
        environment.close()
    assert won.ended_by == "environment" and lost.ended_by == "max_turns"
    assert [m["content"] for m in won.completion] == ["I guess 50.", "lower", "25", "higher", "Then 37."]
    assert [m["content"] for m in lost.completion] == ["I guess 50.", "higher", "75", "higher", "Then 37."]
    assert [m["role"] for m in won.completion] == ["assistant", "user"] * 2 + ["assistant"]
    assert won.messages[won.first - 1]["content"] == "Play.I think of a number between 1 and 100."
    assert (won.env_reward, lost.env_reward) == (1.0, 0.0)
    assert sorted(e[1] for e in _log(env_file) if e[0] == "close") == [3, 3]  # the last turn was stepped too
    full = tok.encode(render(tok, won.messages, add_generation_prompt=False))
    assert won.prompt_ids + won.response_ids + tok.encode("\n") == full  # observations token-exact, mask 0
    observation_tokens = len(won.response_ids) - sum(won.loss_mask)
    assert observation_tokens == 2 * len(tok.encode("\n<|im_start|>user\nlower<|im_end|>\n<|im_start|>assistant\n"))
    assert episode_metrics([won, lost])["ended/environment"] == 0.5


def test_get_reward_is_summed_with_the_reward_functions(env_file):
    """The episode's score = the reward functions' total (0.5 each, by hand) + get_reward (1 or 0); the environment
    reward is its own component, and a class without get_reward leaves it NaN (it does not apply)."""
    tok = smollm2()
    environment = _environment(env_file, {None: "Guess"})
    engine = ContextEngine(tok, guess_policy)
    sampling = SamplingParams(max_new_tokens=400, stop_token_ids=(engine.end,))
    seen = []

    def score_fn(completions, records, ids):
        seen.extend(completions)
        n = len(completions)
        return ScoredRewards(total=torch.full((n,), 0.5), components={"format": torch.full((n,), 0.5)},
                             failed={"format": torch.zeros(n, dtype=torch.bool)})

    runner = RolloutRunner(engine, sampling, decode=tok.decode, score_fn=score_fn)
    episodes = EpisodeRunner(runner, tok, [], ToolExecutor([]), EpisodeLimits(max_turns=3), environment=environment,
                             prompt_field="question")
    records = [SimpleNamespace(prompt="Play.", columns={"secret": s}, index=i, answer="")
               for i, s in enumerate((37, 99))]
    experience = episodes.sample(None, records)
    assert experience.scores.tolist() == [1.5, 0.5]
    assert experience.reward_components["environment"].tolist() == [1.0, 0.0]
    assert experience.reward_failed["environment"].tolist() == [False, False]
    assert seen[0][-1] == {"role": "assistant", "content": "Then 37."}  # the reward saw the episode's messages
    assert experience.stats["episodes/ended/environment"] == 0.5


def test_close_runs_after_a_normal_end_an_exception_and_a_timeout(env_file):
    """Episodes whose reset raises, returns the wrong kind, whose step raises or hangs past the 1 s timeout, and one
    that runs to the end: every instance is closed, each failure ends its episode ("env_error"), is counted by kind,
    warned about once with the user's traceback, and the failed episodes' environment reward is marked failed."""
    tok = smollm2()
    environment = _environment(env_file, {None: "Broken"}, workers=1, timeout=1.0, window=1, fraction=1.0)
    rows = [{"question": "Go.", "fail": f} for f in ("reset", "wrong", "step", "hang", "none", "reward")]
    start = time.monotonic()
    try:
        with pytest.warns(UserWarning) as warned:
            episodes = _run(tok, environment, rows, lambda context: "Move.", limits=EpisodeLimits(max_turns=2))
    finally:
        environment.close()
    assert time.monotonic() - start < 10
    assert [e.ended_by for e in episodes] == ["env_error"] * 4 + ["max_turns"] * 2
    assert [dict(e.env_errors) for e in episodes] == [{"reset": 1}, {"reset": 1}, {"step": 1}, {"step": 1}, {},
                                                      {"get_reward": 1}]
    assert [e.env_reward for e in episodes] == [None] * 4 + [1.0, None]
    assert [e.env_reward_failed for e in episodes] == [True] * 4 + [False, True]
    assert episodes[5].env_error == "get_reward: get_reward returned str 'lots'; expected a finite number"
    assert episodes[1].env_error == ("reset: reset returned int 42; expected None, a string (appended to the last "
                                     "user message) or a non-empty list of messages")
    assert episodes[3].env_error == "step: timed out after 1 s (rollout.environment_timeout_seconds)"
    assert [len(e.turn_starts) for e in episodes] == [1, 1, 1, 1, 2, 2]  # a failed reset still samples its first turn
    assert sorted(e[1] for e in _log(env_file) if e[0] == "close") == ["hang", "none", "reset", "reward", "step",
                                                                       "wrong"]
    texts = [str(w.message) for w in warned]
    assert any("reset failed: RuntimeError: reset is broken" in t and 'raise RuntimeError("reset is broken")' in t
               for t in texts)  # the user's traceback, once
    assert sum("step failed" in t for t in texts) == 1  # the step's two failures: warned once
    metrics = episode_metrics(episodes)
    assert metrics["env_errors/reset"] == metrics["env_errors/step"] == 2 / 6 and metrics["ended/env_error"] == 4 / 6
    assert metrics["env_errors"] == 5 / 6 and metrics["env_errors/get_reward"] == 1 / 6


def test_a_method_past_the_timeout_ends_its_episode_and_its_instance_is_closed(env_file):
    tok = smollm2()
    environment = _environment(env_file, {None: "Counter"}, workers=1, timeout=1.0, window=1, fraction=1.0)
    try:
        with pytest.warns(UserWarning, match="Counter: hang failed: timed out after 1 s"):
            (episode,) = _run(tok, environment, [{"question": "Wait.", "start": 4}],
                              lambda context: format_tool_call("hang", {}))
    finally:
        environment.close()
    assert episode.ended_by == "env_error" and episode.env_errors == {"call": 1}
    assert episode.completion[-1]["role"] == "assistant"  # no result appended after the failure
    assert episode.env_reward is None and episode.env_reward_failed
    assert [e for e in _log(env_file) if e[0] == "close"] == [["close", 4]]  # interrupted, then closed


def test_a_call_that_ignores_the_timeout_is_killed_with_its_worker(env_file):
    """A method that swallows the 1 s interruption is killed with its worker at 2 s; the other episode on that
    worker loses its instance and ends too, counted as lost; the next rollout gets a fresh worker."""
    tok = smollm2()
    environment = _environment(env_file, {None: "Counter"}, workers=1, timeout=1.0, window=1, fraction=1.0)
    rows = [{"question": "Stall.", "start": 1}, {"question": "Count.", "start": 2}]

    def policy(context):
        return format_tool_call("stubborn" if "Stall" in context else "add", {} if "Stall" in context else {"k": 1})

    start = time.monotonic()
    try:
        with pytest.warns(UserWarning):
            stalled, other = _run(tok, environment, rows, policy)
        assert 2 <= time.monotonic() - start < 10
        assert stalled.ended_by == other.ended_by == "env_error"
        assert stalled.env_errors == {"call": 1} and other.env_errors == {"lost": 1}
        assert "did not stop within 2 s: its worker process was killed" in stalled.env_error
        assert environment.pool.restarts == 1
        again = _run(tok, environment, [{"question": "Count.", "start": 5}], counter_policy)[0]
        assert _tool_results(again) == ["total 6", "total 8"] and again.env_reward == 8.0
    finally:
        environment.close()


def test_a_reset_that_ignores_the_timeout_is_named_as_the_failed_call(env_file):
    """The reset that hung is the call the warning names (counted as lost: its worker was killed with it)."""
    tok = smollm2()
    (env_file.parent / "hard.py").write_text(
        "import time\n\nclass HangHard:\n    def reset(self, **row):\n        while True:\n            try:\n"
        "                time.sleep(100)\n            except BaseException:\n                pass\n")
    environment = EpisodeEnvironment.load([EnvironmentSpec(None, "HangHard", str(env_file.parent / "hard.py"))],
                                          num_workers=1, timeout_seconds=1.0, routed_by=None,
                                          failures=EnvironmentFailures(max_error_fraction=1.0, error_window=1))
    try:
        with pytest.warns(UserWarning) as warned:
            (episode,) = _run(tok, environment, [{"question": "Hi."}], lambda context: "Done.")
    finally:
        environment.close()
    texts = [str(w.message) for w in warned]
    assert any("rollout.environment: HangHard: reset failed: timed out after 1 s" in t
               and "worker process was killed" in t for t in texts), texts
    assert not any("lost failed" in t for t in texts), texts
    assert episode.env_errors == {"lost": 1} and episode.ended_by == "env_error"


def test_an_error_of_the_loop_itself_still_closes_the_instances(env_file):
    tok = smollm2()
    environment = _environment(env_file, {None: "Counter"}, workers=1)

    def policy(context):
        if "total" in context:
            raise RuntimeError("the engine broke")
        return format_tool_call("add", {"k": 1})

    try:
        with pytest.raises(RuntimeError, match="the engine broke"):
            _run(tok, environment, [{"question": "Go.", "start": s} for s in (1, 2)], policy)
    finally:
        environment.close()
    assert sorted(e[1] for e in _log(env_file) if e[0] == "close") == [2, 3]


def test_a_raising_method_is_the_calls_result_and_not_a_failure(env_file):
    tok = smollm2()
    environment = _environment(env_file, {None: "Counter"})

    def policy(context):
        return "Done." if "Error" in context else format_tool_call("boom", {})

    with pytest.warns(UserWarning, match="Counter.boom raised ValueError: no boom today"):
        (episode,) = _run(tok, environment, [{"question": "Boom.", "start": 0}], policy)
    assert _tool_results(episode) == ["Error: ValueError: no boom today"]
    assert episode.ended_by == "answer" and not episode.env_errors and episode.tool_errors == {"boom": 1}


def test_rows_are_routed_to_their_class_by_a_column(env_file, tmp_path):
    """A mapping of classes: each row's "environment" value picks its class; a Counter episode offers the job's
    tool and Counter's methods, a Guess episode only the job's tool; the routing column does not reach reset."""
    tok = smollm2()
    (tmp_path / "tools.py").write_text(TOOLS)
    tools = load_tools([{"function": "shout", "path": str(tmp_path / "tools.py")}])
    environment = _environment(env_file, {"count": "Counter", "guess": "Guess"}, routed_by="environment")
    records = [SimpleNamespace(prompt="Go.", columns={"environment": "count", "start": 3}, index=0),
               SimpleNamespace(prompt="Go.", columns={"environment": "guess", "secret": 50}, index=1)]
    routed = [environment.route_and_row(r, "question") for r in records]
    assert routed == [("count", {"question": "Go.", "start": 3}), ("guess", {"question": "Go.", "secret": 50})]
    counted, guessed = _run(tok, environment, [row for _, row in routed],
                            lambda c: "I guess 50." if "Guess" in c or "number" in c else counter_policy(c),
                            tools=tools, routes=[route for route, _ in routed])
    assert [t.name for t in counted.tools] == ["shout", "add", "boom", "hang", "stubborn"]
    assert [t.name for t in guessed.tools] == ["shout"]
    assert _tool_results(counted) == ["total 4", "total 6"] and counted.env_reward == 6.0
    assert guessed.ended_by == "environment" and guessed.env_reward == 1.0
    assert '"name": "add"' in tok.decode(counted.prompt_ids) and '"name": "add"' not in tok.decode(guessed.prompt_ids)


def test_too_many_failures_stop_the_job_in_one_line(env_file):
    tok = smollm2()
    environment = _environment(env_file, {None: "Broken"}, window=2, fraction=0.5)
    rows = [{"question": "Go.", "fail": "reset"}, {"question": "Go.", "fail": "none"}]
    with pytest.warns(UserWarning):
        _run(tok, environment, rows, lambda c: "Move.", limits=EpisodeLimits(max_turns=1))  # 1 of 2: the window fills
        with pytest.raises(EnvironmentFailure, match=r"^rollout.environment failed in 3 of 4 episodes of the last 2 "
                                                     r"rollouts, more than reward.max_error_fraction 0.5 \(reward."
                                                     r"error_window 2\); its first failure: reset: RuntimeError"):
            _run(tok, environment, [rows[0], rows[0]], lambda c: "Move.", limits=EpisodeLimits(max_turns=1))


TRL_STYLE = '''
class WordGame:
    def __init__(self):
        self.word = None

    def reset(self, **kwargs) -> str | None:
        self.word, self.reward, self.done = kwargs["answer"], 0.0, False
        return " Guess the word with the guess tool."

    def guess(self, guess: str) -> str:
        """
        Make a guess in the word game.

        Args:
            guess: The guessed word.

        Returns:
            The feedback message from the environment.
        """
        if self.done:
            raise ValueError("Game over.")
        self.done = True
        self.reward = 1.0 if guess == self.word else 0.0
        return "correct" if self.reward else "wrong"

    def get_reward(self) -> float:
        return self.reward
'''


def test_a_class_written_to_trls_requirements_runs_unchanged(tmp_path):
    """No-argument __init__, reset(**kwargs) -> str appended to the prompt, a docstring'd tool method that raises
    ValueError("Game over.") once the game is done (the model reads it), get_reward (TRL's environment_factory)."""
    tok = smollm2()
    (tmp_path / "trl_env.py").write_text(TRL_STYLE)
    environment = _environment(tmp_path / "trl_env.py", {None: "WordGame"}, workers=1)
    turns = [format_tool_call("guess", {"guess": "crane"}), format_tool_call("guess", {"guess": "slate"}), "Done."]
    rows = [{"question": "Play.", "answer": word} for word in ("crane", "slate")]
    try:
        with pytest.warns(UserWarning, match="WordGame.guess raised ValueError: Game over."):
            right, wrong = _run(tok, environment, rows,
                                lambda context: turns[min(context.count("<|im_start|>assistant") - 1, 2)])
    finally:
        environment.close()
    assert right.messages[right.first - 1]["content"] == "Play. Guess the word with the guess tool."
    assert _tool_results(right) == ["correct", "Error: ValueError: Game over."]
    assert _tool_results(wrong) == ["wrong", "Error: ValueError: Game over."]
    assert (right.env_reward, wrong.env_reward) == (1.0, 0.0) and right.ended_by == wrong.ended_by == "answer"
    assert right.tools[0].schema["function"]["parameters"]["properties"]["guess"] == {
        "type": "string", "description": "The guessed word."}


# ------------------------------------------------------------------------------------------------ config and jobs
def _job(tmp_path, model_dir, data, environment, extra="", reward="", kind="online_grpo", max_steps=1):
    job = tmp_path / "job.yaml"
    job.write_text(textwrap.dedent(f"""\
        train: {{type: {kind}, max_steps: {max_steps}, output_dir: {tmp_path / 'run'}, progress_bar: false,
                report_to: [none]}}
        data: {{max_prompt_length: 64, path: {data}}}
        reward:
          functions: [{{function: half, path: {reward or tmp_path / 'reward.py'}, name: half}}]
          num_workers: 0
        rollout:
          batch_size: 2
          max_new_tokens: 96
          environment: {json.dumps(environment)}
          max_turns: 3
        EXTRA
        grpo: {{group_size: 2, minibatch_size: 4, micro_batch_size: 2}}
        checkpoint: {{save_at_end: false}}
        """).replace("EXTRA", extra))
    (tmp_path / "reward.py").write_text("def half(completions, **kw):\n    return [0.5] * len(completions)\n")
    return job


def _data(tmp_path, rows):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return data


BAD_CLASSES = '''
class NoReset:
    def step(self, message):
        return None

class Undocumented:
    def reset(self, **row):
        return None

    def move(self, where):
        return where

class NeedsSeed:
    def reset(self, seed):
        return None

class Shout:
    def reset(self, **row):
        return None

    def shout(self, text: str) -> str:
        """Shout.

        Args:
            text: what.
        """
        return text

class BadStep:
    def reset(self, **row):
        return None

    def step(self):
        return None

class NeedsArgs:
    def __init__(self, size):
        self.size = size

    def reset(self, **row):
        return None

not_a_class = 3
'''


@pytest.mark.parametrize("environment, message", [
    ({"class": "NoReset", "path": "bad.py"}, "rollout.environment: NoReset has no reset method"),
    ({"class": "not_a_class", "path": "bad.py"}, "rollout.environment: not_a_class is of type int, not a class"),
    ({"class": "Missing", "path": "bad.py"}, "bad.py has no attribute 'Missing'"),
    ({"class": "NoReset", "path": "nowhere.py"}, "rollout.environment: path "),
    ({"class": "Undocumented", "path": "bad.py"}, "rollout.environment: method Undocumented.move (public methods are "
                                                  "tools; prefix it with _ to hide it): tool"),
    ({"class": "NeedsSeed", "path": "bad.py"}, "rollout.environment: NeedsSeed.reset requires 'seed', a column the "
                                               "rows do not all have"),
    ({"class": "Shout", "path": "bad.py"}, "rollout.environment: method Shout.shout has the name of a tool of "
                                           "rollout.tools"),
    ({"a": {"class": "Shout", "path": "bad.py"}}, "rollout.environment: row 0 of"),
    ({"class": "BadStep", "path": "bad.py"}, "rollout.environment: BadStep.step() cannot be called with one "
                                             "argument (the assistant message)"),
    ({"class": "NeedsArgs", "path": "bad.py"}, "rollout.environment: NeedsArgs(size) cannot be created without "
                                               "arguments"),
    ("Game", "rollout.environment: expected 'package.module:Class'"),
    ({"clas": "Game", "path": "bad.py"}, "rollout.environment: unknown key 'clas'"),
])
def test_bad_environment_lines_are_refused_by_check_in_one_line(long_model_dir, tmp_path, capsys, monkeypatch,
                                                                environment, message):
    from astrai.train import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.py").write_text(BAD_CLASSES)
    (tmp_path / "tools.py").write_text(TOOLS)
    data = _data(tmp_path, [{"question": "Hi?", "answer": "1", "environment": "b"}])
    extra = "  tools: [{function: shout, path: tools.py}]" if "Shout" in json.dumps(environment) else ""
    job = _job(tmp_path, long_model_dir, data, environment, extra=extra)
    code = main(["--config", str(job), "--model.path", str(long_model_dir), "--check"])
    out = capsys.readouterr()
    assert code == 2, out
    lines = [line for line in (out.out + out.err).splitlines() if "rollout.environment" in line]
    assert lines and message in lines[-1], out


def test_a_good_environment_passes_check_and_a_reward_named_environment_does_not(long_model_dir, tmp_path, capsys,
                                                                                 monkeypatch):
    from astrai.train import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "game.py").write_text(GAME)
    data = _data(tmp_path, [{"question": "Hi?", "answer": "1", "start": 3}])
    job = _job(tmp_path, long_model_dir, data, {"class": "Countdown", "path": "game.py"})
    assert main(["--config", str(job), "--model.path", str(long_model_dir), "--check"]) == 0
    assert "check passed" in capsys.readouterr().out
    assert main(["--config", str(job), "--model.path", str(long_model_dir), "--check",
                 "--reward.functions.0.name", "environment"]) == 2
    assert ("reward.functions: a function is named 'environment', the name of the reward of rollout.environment "
            "(Countdown.get_reward)") in capsys.readouterr().err


def test_an_offline_or_raw_text_job_is_refused_and_unread_settings_named(tmp_path):
    from astrai.config import ConfigError, config_from_dict

    with pytest.raises(ConfigError, match="rollout.environment: multi-turn episodes are sampled by the online"):
        config_from_dict({"train": {"type": "sft"}, "rollout": {"environment": "m:Game"}})
    with pytest.raises(ConfigError, match="rollout.environment: multi-turn episodes are chats"):
        config_from_dict({"train": {"type": "online_grpo"}, "data": {"chat_template": False},
                          "rollout": {"environment": "m:Game"}})
    config = config_from_dict({"train": {"type": "online_grpo"}, "rollout": {"environment_workers": 4}})
    from astrai.config import ignored_settings

    assert ignored_settings(config) == ["rollout.environment_workers"]


GAME = '''
class Countdown:
    """Say a number; the episode ends at the second step."""

    def reset(self, start, **row):
        self.steps, self.start = 0, int(start)
        return f" Start at {start}."

    def step(self, message):
        self.steps += 1
        return None if self.steps == 2 else "Again."

    def get_reward(self):
        return float(self.steps == 2) + self.start / 100
'''


def test_online_grpo_trains_on_a_step_environment_end_to_end(long_model_dir, tmp_path):
    """A tool-less environment on a job: every episode steps twice (the engine's turns are scripted to end), the
    environment's reward (1 + start / 100) joins the reward function's 0.5, both logged apart; 2 steps train."""
    from astrai.train import main

    model_dir = long_model_dir
    (tmp_path / "game.py").write_text(GAME)
    _scripted_seven(model_dir, "scripted_env_test")
    data = _data(tmp_path, [{"question": "Count.", "answer": "0", "start": s} for s in (10, 30, 10, 30)])
    job = _job(tmp_path, model_dir, data, {"class": "Countdown", "path": str(tmp_path / "game.py")},
               extra="  engine: scripted_env_test\n  environment_workers: 1", max_steps=2)
    assert main(["--config", str(job), "--model.path", str(model_dir), "--data.shuffle", "false"]) == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2
    for r, start in zip(records, (10, 30)):  # rollout 1: the rows of start 10 and 30; so is rollout 2
        assert r["rewards/half/mean"] == 0.5
        assert r["rollout/episodes/ended/environment"] == 1.0 and r["rollout/episodes/turns"] == 2.0
        assert r["rollout/episodes/env_errors"] == 0.0 and r["rewards/environment/failed"] == 0.0
        assert r["rewards/environment/mean"] == pytest.approx(1.2)  # (1.1 + 1.3) / 2, by hand
        assert 0 < r["rollout/episodes/masked_out_fraction"] < 1
    # evaluated with the environment: the held-out rows (start 10 and 30) each play an episode, the environment's
    # reward joining the reward function's in the total, logged as eval/rewards/environment
    out = tmp_path / "eval-run"
    assert main(["--config", str(job), "--model.path", str(model_dir), "--data.shuffle", "false", "--max_steps", "1",
                 "--train.output_dir", str(out), "--train.eval_steps", "1", "--data.eval_path", str(data)]) == 0
    logged = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert logged["eval/rewards/environment/mean"] == pytest.approx(1.2) and logged["eval/rewards/half/mean"] == 0.5
    assert logged["eval/reward_mean"] == pytest.approx(1.7)  # 0.5 + (1.1 + 1.3) / 2


def _scripted_seven(model_dir, name):
    """Register engine `name`: the paged engine whose every turn is "7" and the end of turn (finished)."""
    from astrai.models import Tokenizer
    from astrai.rollout import engine as engines

    paged = engines.engine_factory("paged")

    def scripted(model, **kwargs):  # both engine paths: generate and the streaming add_request / step
        tok = Tokenizer.from_dir(model_dir)
        said = tok.encode("7") + [tok.eos_token_id]
        return script_turns(paged(model, **kwargs), lambda params: said)
    engines.register_engine(name, scripted)


def test_an_environment_with_get_reward_is_the_whole_reward_when_the_job_sets_none(long_model_dir, tmp_path,
                                                                                  capsys):
    """No reward section: the rows have no `answer` column (the default math_exact_match would need one), the
    environment's get_reward (1 + start / 100) is the total, said once; completions.jsonl logs each episode's
    messages (what a reward function receives), and evaluation scores with the environment alone."""
    import yaml

    from astrai.train import main

    _scripted_seven(long_model_dir, "scripted_env_only_test")
    (tmp_path / "game.py").write_text(GAME)
    data = _data(tmp_path, [{"question": "Count.", "start": s} for s in (10, 30, 10, 30)])
    job = _job(tmp_path, long_model_dir, data, {"class": "Countdown", "path": str(tmp_path / "game.py")},
               extra="  engine: scripted_env_only_test\n  environment_workers: 0")
    settings = yaml.safe_load(job.read_text())
    del settings["reward"]
    settings["train"]["log_completions"] = 2
    job.write_text(yaml.safe_dump(settings))
    assert main(["--config", str(job), "--model.path", str(long_model_dir), "--data.shuffle", "false",
                 "--train.eval_steps", "1", "--data.eval_path", str(data)]) == 0, capsys.readouterr()
    out = capsys.readouterr().out
    assert out.count("reward: the environment's get_reward is the whole reward") == 1, out
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = next(r for r in records if "rollout/reward_mean" in r)
    assert trained["rollout/reward_mean"] == pytest.approx(1.2)  # (1.1 + 1.3) / 2: the environment's alone
    assert not any(key.startswith("rewards/math_exact_match") for key in trained), sorted(trained)
    evaluated = next(r for r in records if "eval/reward_mean" in r)
    assert evaluated["eval/reward_mean"] == pytest.approx(1.2)
    completions = [json.loads(line) for line in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    assert len(completions) == 2
    for record in completions:  # the episode's messages: the policy's turn, step's observation, the last turn
        assert [m["role"] for m in record["completion"]] == ["assistant", "user", "assistant"], record
        assert record["completion"][1]["content"] == "Again." and record["completion"][-1]["content"] == "7"
        assert record["score"] == pytest.approx(1.1) and list(record["rewards"]) == ["environment"]


def test_a_job_that_sets_a_reward_keeps_it_beside_the_environments(long_model_dir, tmp_path):
    """A job that sets its reward (reward.name, even the default's, reward.functions or reward.model_path) keeps it,
    the environment's reward added to it as before; a class without get_reward leaves the default built-in."""
    from astrai.config import config_from_dict
    from astrai.rewards.build import environment_is_the_reward, reward_specs

    (tmp_path / "game.py").write_text(GAME)
    (tmp_path / "plain.py").write_text("class Plain:\n    def reset(self, **row):\n        return None\n")
    env = {"class": "Countdown", "path": str(tmp_path / "game.py")}
    base = {"train": {"type": "online_grpo"}, "rollout": {"environment": env}}
    assert environment_is_the_reward(config_from_dict(base)) and reward_specs(config_from_dict(base)) == []
    for reward in ({"name": "code_unit_tests"}, {"functions": [{"function": "half", "path": "r.py"}]},
                   {"model_path": str(tmp_path)}, {"name": "math_exact_match"}):
        config = config_from_dict({**base, "reward": reward})
        assert not environment_is_the_reward(config), reward
    # the default built-in named explicitly is kept (it was dropped as if unset: trial); null is the unset value
    named = reward_specs(config_from_dict({**base, "reward": {"name": "math_exact_match"}}))
    assert [spec.function for spec in named] == ["math_exact_match"]
    assert config_from_dict(base).reward.name is None
    # the evaluator's settings name no built-in where the environment's reward is the whole reward (review)
    from astrai.config import dump_config
    from astrai.evaluation.cli import build_parser, prompt_settings

    job = tmp_path / "job.yaml"
    args = build_parser().parse_args(["--model", "m", "--data", "d"])
    for reward, said in ((None, None), ("math_exact_match", "math_exact_match")):
        job.write_text(dump_config(config_from_dict({**base, "reward": {"name": reward}})))
        assert prompt_settings(args, job)[1]["reward"] == said, reward
    plain = config_from_dict({**base, "rollout": {"environment": {"class": "Plain",
                                                                  "path": str(tmp_path / "plain.py")}}})
    assert not environment_is_the_reward(plain)  # no get_reward: the default built-in stays
    assert [spec.function for spec in reward_specs(plain)] == ["math_exact_match"]


OWN_COPY_ENV = '''
import asyncio


class Mutating:
    """Edits the row it is reset with in place; async step and get_reward (awaited, as for reward functions)."""

    def reset(self, items, **row):
        items.append("seen")
        self.items = items
        return f"{len(items)} items"

    async def step(self, message):
        await asyncio.sleep(0)
        return None

    async def get_reward(self):
        await asyncio.sleep(0)
        return float(len(self.items))
'''


@pytest.mark.parametrize("workers", [0, 1])
def test_an_environment_gets_its_own_copy_of_the_row_and_its_async_methods_are_awaited(tmp_path, workers):
    """Issue 42, classes 3 and 4 for environments: a reset that edits its row in place changes neither the stored
    row nor the next episode's (in the trainer's process too), and `async def` step / get_reward are awaited."""
    from astrai.experience.environments import EnvironmentPool, Request

    path = tmp_path / "own_copy_env.py"
    path.write_text(OWN_COPY_ENV)
    pool = EnvironmentPool([EnvironmentSpec(None, "Mutating", str(path))], num_workers=workers, timeout_seconds=30)
    row = {"items": ["a"]}
    try:
        for _ in range(2):
            key, = pool.new_keys(1)
            replies = pool.run([Request("reset", key, (None, row)), Request("step", key, "an answer"),
                                Request("reward", key), Request("close", key)])
            assert [(r.ok, r.value) for r in replies] == [(True, "2 items"), (True, None), (True, 2.0), (True, None)]
        assert row == {"items": ["a"]}
    finally:
        pool.close()


BUSY_ENV = '''
import os, subprocess


class Busy:
    """reset writes its worker's pid and a child's to a file, then waits on the child (a call in flight)."""

    def reset(self, **row):
        child = subprocess.Popen(["sleep", "300"])
        with open(os.environ["ASTRAI_TEST_PID_FILE"], "w") as f:
            f.write(f"{os.getpid()} {child.pid}")
        child.wait()
'''

BUSY_TRAINER = '''
import sys
from astrai.agents.environments import EnvironmentSpec
from astrai.experience.environments import EnvironmentPool, Request
pool = EnvironmentPool([EnvironmentSpec(None, "Busy", sys.argv[1])], num_workers=1, timeout_seconds=300)
key, = pool.new_keys(1)
pool.run([Request("reset", key, (None, {}))])
'''


def _alive(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def test_environment_workers_and_what_they_started_die_with_a_sigkilled_trainer(tmp_path):
    """Issue 42, class 6 for environments: a worker busy in a call, and the process it started, end when the trainer
    is SIGKILLed (the workers' parent watch, `rewards.workers.die_with_parent`)."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    path, pid_file = tmp_path / "busy_env.py", tmp_path / "pids"
    path.write_text(BUSY_ENV)
    repo = Path(__file__).resolve().parents[1]
    trainer = subprocess.Popen([sys.executable, "-c", BUSY_TRAINER, str(path)], cwd=repo,
                               env={**os.environ, "ASTRAI_TEST_PID_FILE": str(pid_file)})
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not (pid_file.exists() and pid_file.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.1)
        pids = [int(p) for p in pid_file.read_text().split()]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [p for p in pids if _alive(p)] == []
    finally:
        trainer.kill()
        trainer.wait()
        for p in pids:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
