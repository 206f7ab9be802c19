"""DAPO dynamic sampling in the online experience source (Yu et al. 2025, section 3.2): groups whose rewards are all
equal are dropped and replaced by newly sampled ones, up to a cap on rounds; the batch re-padding it needs
(`Sequences.concat`, `concat_experiences`) against building the same rows in one go."""

import pytest
import torch
from reference_engine import ReferenceEngine
from toy_rl import RandomPrompts, online_experience, trained

from astrai.config import ConfigError, load_config
from astrai.data.sequences import Sequences
from astrai.models import AutoRegressiveLM, tiny_config
from astrai.experience.trajectory import Experience, concat_experiences
from astrai.experience.runner import RolloutRunner
from astrai.rollout.sampling import SamplingParams
from astrai.experience.sources import OnlineExperience

VOCAB, EOS, B, G = 16, 2, 2, 4


def small_model(seed=0):
    torch.manual_seed(seed)
    return AutoRegressiveLM(tiny_config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                        num_attention_heads=2, num_key_value_heads=1, eos_token_id=EOS,
                                        pad_token_id=EOS, bos_token_id=1))


def test_sequences_concat_equals_building_all_rows_at_once():
    prompts_a, responses_a = [[5, 6], [7, 8, 9]], [[3], [4, 5, 6, 2]]
    prompts_b, responses_b = [[3, 4, 5, 6, 7]], [[9, 9]]
    whole = Sequences.from_tokens(prompts_a + prompts_b, responses_a + responses_b, pad_token_id=0)
    parts = [Sequences.from_tokens(prompts_a, responses_a, pad_token_id=0),
             Sequences.from_tokens(prompts_b, responses_b, pad_token_id=0)]
    joined = Sequences.concat(parts, pad_token_id=0)
    assert joined.prompt_length == whole.prompt_length == 5
    for name in ("input_ids", "attention_mask", "position_ids", "action_mask"):
        assert torch.equal(getattr(joined, name), getattr(whole, name)), name
    with pytest.raises(ValueError, match="no parts"):
        Sequences.concat([], pad_token_id=0)


def _experience(prompts, responses, scores, version=3, ref=True):
    seqs = Sequences.from_tokens(prompts, responses, pad_token_id=0)
    t = seqs.action_mask.shape[1]
    old = torch.arange(len(prompts) * t, dtype=torch.float32).reshape(len(prompts), t).neg() * seqs.action_mask
    return Experience(sequences=seqs, old_logprobs=old, ref_logprobs=old * 2 if ref else None,
                      scores=torch.tensor(scores), responses=tuple(str(r) for r in responses),
                      policy_version=version, timings={"generate": 1.5})


def test_concat_experiences_pads_per_token_tensors_with_zero_and_sums_timings():
    a = _experience([[5, 6], [7]], [[3], [4, 5, 6]], [0.0, 1.0])
    b = _experience([[3, 4, 5]], [[9, 9]], [0.5])
    joined = concat_experiences([a.select([1]), b], pad_token_id=0)
    assert joined.scores.tolist() == [1.0, 0.5]
    assert joined.responses == (a.responses[1], b.responses[0])
    assert torch.equal(joined.old_logprobs, torch.tensor([[-3.0, -4.0, -5.0], [0.0, -1.0, 0.0]]))
    assert torch.equal(joined.ref_logprobs, joined.old_logprobs * 2)
    assert joined.timings == {"generate": 3.0} and joined.policy_version == 3
    with pytest.raises(ValueError, match="policy versions"):
        concat_experiences([a, _experience([[1]], [[1]], [0.0], version=4)], pad_token_id=0)
    with pytest.raises(ValueError, match="ref_logprobs"):
        concat_experiences([a, _experience([[1]], [[1]], [0.0], ref=False)], pad_token_id=0)


class ScriptedScores:
    """A reward that returns the next scripted score vector on each call, and records the texts it scored."""

    def __init__(self, script):
        self.script, self.calls = list(script), []

    def __call__(self, texts, answers, response_ids):
        self.calls.append(list(texts))
        return torch.tensor(self.script[len(self.calls) - 1])


class RowCounter(torch.nn.Module):
    """A reference model wrapper that counts the rows it scores."""

    def __init__(self, model):
        super().__init__()
        self.model, self.rows = model, 0

    def forward(self, *args, **kwargs):
        self.rows += kwargs.get("input_ids", args[0] if args else None).shape[0]
        return self.model(*args, **kwargs)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.model, name)


def _source(script, *, max_rounds, ref=None):
    policy = small_model()
    runner = RolloutRunner(ReferenceEngine(policy, pad_token_id=EOS),
                           SamplingParams(max_new_tokens=5, temperature=1.0, stop_token_ids=(EOS,)),
                           decode=lambda ids: " ".join(map(str, ids)), score_fn=ScriptedScores(script),
                           ref_model=ref, chunk_size=3)
    source = online_experience(trained(policy), runner, vocab=VOCAB, batch_size=B, group_size=G)
    source.dynamic_sampling, source.max_sampling_rounds = True, max_rounds
    return source


def _cut(exp):
    """The share of `exp`'s responses that do not end with the stop token (cut by max_new_tokens), counted here."""
    ends = [exp.sequences.response_ids[row][exp.sequences.action_mask[row]].tolist()[-1] for row in range(len(exp))]
    return sum(end != EOS for end in ends) / len(exp)


def test_dynamic_sampling_keeps_the_first_groups_with_unequal_rewards():
    script = [[0, 0, 0, 0, 1, 0, 1, 0],   # round 1: group 0 all equal (dropped), group 1 kept
              [1, 1, 0, 1, 0, 0, 1, 0]]  # round 2: both kept; the second is surplus
    ref = RowCounter(small_model(1)).eval().requires_grad_(False)
    source = _source(script, max_rounds=4, ref=ref)
    exp = source.collect(policy_version=0)
    texts = source.runner.score_fn.calls
    assert len(texts) == 2  # stopped once B groups differ
    assert exp.responses == tuple(texts[0][G:2 * G] + texts[1][:G])
    assert exp.scores.tolist() == [1, 0, 1, 0, 1, 1, 0, 1]
    assert exp.stats == {"sampling_rounds": 2.0, "sampled_zero_std_groups": 0.25, "sampled_reward_mean": 6 / 16,
                         "truncated_fraction": _cut(exp)}
    assert ref.rows == B * G  # reference log-probs only for the kept samples
    assert exp.ref_logprobs.shape == exp.old_logprobs.shape == exp.sequences.action_mask.shape
    # each kept row is the sampled row: its response tokens decode to the text scored for it
    for row, text in enumerate(exp.responses):
        ids = exp.sequences.response_ids[row][exp.sequences.action_mask[row]].tolist()
        assert " ".join(map(str, ids)) == text
    assert bool((exp.old_logprobs[~exp.sequences.action_mask] == 0).all())
    assert source.data_sampler.drawn == 2 * B  # each round drew B prompts


def test_dynamic_sampling_fills_the_batch_with_dropped_groups_at_the_round_cap():
    script = [[1, 1, 1, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 1, 0, 0]]
    source = _source(script, max_rounds=2)
    exp = source.collect(policy_version=0)
    texts = source.runner.score_fn.calls
    assert exp.stats == {"sampling_rounds": 2.0, "sampled_zero_std_groups": 0.75, "sampled_reward_mean": 5 / 16,
                         "truncated_fraction": _cut(exp)}
    # the one group of unequal rewards (round 2, group 1), then the first dropped one (round 1, group 0)
    assert exp.responses == tuple(texts[0][:G] + texts[1][G:])
    assert exp.scores.tolist() == [1, 1, 1, 1, 0, 1, 0, 0]


def test_a_larger_generation_batch_fills_the_batch_in_one_round():
    # B = 2 groups kept from rounds of 4 prompts: group 0 all equal, groups 1-3 unequal (group 3 surplus)
    script = [[0, 0, 0, 0, 1, 0, 0, 0, 1, 1, 0, 1, 0, 1, 1, 1]]
    source = _source(script, max_rounds=1)
    source.generation_batch_size = 2 * B
    exp = source.collect(policy_version=0)
    texts = source.runner.score_fn.calls
    assert len(texts) == 1 and len(texts[0]) == 2 * B * G  # one round of 4 prompts x G responses
    assert exp.responses == tuple(texts[0][G:3 * G])
    assert exp.scores.tolist() == [1, 0, 0, 0, 1, 1, 0, 1]
    assert exp.stats == {"sampling_rounds": 1.0, "sampled_zero_std_groups": 0.25, "sampled_reward_mean": 7 / 16,
                         "truncated_fraction": _cut(exp)}
    assert source.data_sampler.drawn == 2 * B


def test_without_dynamic_sampling_one_round_and_only_the_truncated_share():
    source = _source([[0] * (B * G)], max_rounds=4)
    source.dynamic_sampling = False
    exp = source.collect(policy_version=0)
    assert len(source.runner.score_fn.calls) == 1 and exp.scores.shape == (B * G,)
    assert exp.stats == {"truncated_fraction": _cut(exp)} and 0 < _cut(exp) < 1


def test_dynamic_sampling_arguments_and_config_are_checked():
    kwargs = dict(sync_weights=None, runner=None, sampler=RandomPrompts(VOCAB, 0), batch_size=2, seed=0,
                  device=torch.device("cpu"))
    with pytest.raises(ValueError, match="group_size=1"):
        OnlineExperience(group_size=1, dynamic_sampling=True, **kwargs)
    with pytest.raises(ValueError, match="max_sampling_rounds"):
        OnlineExperience(group_size=2, dynamic_sampling=True, max_sampling_rounds=0, **kwargs)
    with pytest.raises(ConfigError, match="rollout.dynamic_sampling: only online_ppo and online_grpo sample their groups"):
        load_config(None, ["--train.type", "grpo", "--rollout.dynamic_sampling", "true"])
    with pytest.raises(ConfigError, match=r"online_ppo needs ppo.group_size >= 2 .*, got 1"):
        load_config(None, ["--train.type", "online_ppo", "--rollout.dynamic_sampling", "true"])
    with pytest.raises(ConfigError, match="rollout.max_sampling_rounds"):
        load_config(None, ["--train.type", "online_grpo", "--rollout.max_sampling_rounds", "0"])
    with pytest.raises(ConfigError, match=r"rollout.max_sampling_rounds: rollout.dynamic_sampling needs >= 2 "):
        load_config(None, ["--train.type", "online_grpo", "--rollout.dynamic_sampling", "true",
                           "--rollout.max_sampling_rounds", "1"])
    with pytest.raises(ConfigError, match=r"ppo.minibatch_size: expected a divisor of rollout.batch_size \* "
                                          r"ppo.group_size \(24\), got 16"):
        load_config(None, ["--train.type", "online_ppo", "--rollout.batch_size", "8", "--ppo.group_size", "3",
                           "--ppo.minibatch_size", "16"])
    with pytest.raises(ValueError, match="generation_batch_size: expected >= 1 or None, got 0"):
        OnlineExperience(group_size=2, dynamic_sampling=True, generation_batch_size=0, **kwargs)
    with pytest.raises(ValueError, match="cannot fill a batch of 2"):  # kwargs: batch_size 2
        OnlineExperience(group_size=2, dynamic_sampling=True, generation_batch_size=1, max_sampling_rounds=1,
                         **kwargs)
    with pytest.raises(ConfigError, match=r"rollout.generation_batch_size: 1 prompt per round x "
                                          r"rollout.max_sampling_rounds 2 cannot fill rollout.batch_size 4; "
                                          r"expected at least 2"):
        load_config(None, ["--train.type", "online_grpo", "--rollout.dynamic_sampling", "true",
                           "--rollout.batch_size", "4", "--grpo.minibatch_size", "8", "--rollout.max_sampling_rounds",
                           "2", "--rollout.generation_batch_size", "1"])
    config = load_config(None, ["--train.type", "online_grpo", "--rollout.dynamic_sampling", "true",
                                "--rollout.batch_size", "4", "--grpo.minibatch_size", "8",
                                "--rollout.max_sampling_rounds", "2", "--rollout.generation_batch_size", "2"])
    assert config.rollout.generation_batch_size == 2  # two rounds of 2 can fill 4
    with pytest.raises(ConfigError, match=r"rollout.generation_batch_size: only used with rollout.dynamic_sampling"):
        load_config(None, ["--train.type", "online_grpo", "--rollout.generation_batch_size", "16"])
    with pytest.raises(ConfigError, match="rollout.generation_batch_size"):
        load_config(None, ["--train.type", "online_grpo", "--rollout.dynamic_sampling", "true",
                           "--rollout.generation_batch_size", "0"])
    with pytest.raises(ConfigError, match=r"rollout.max_sampling_rounds: .* or rollout.generation_batch_size > "):
        load_config(None, ["--train.type", "online_grpo", "--rollout.dynamic_sampling", "true",
                           "--rollout.max_sampling_rounds", "1", "--rollout.generation_batch_size", "8"])
    config = load_config(None, ["--train.type", "online_grpo", "--rollout.dynamic_sampling", "true",
                                "--rollout.max_sampling_rounds", "1", "--rollout.generation_batch_size", "9"])
    assert config.rollout.generation_batch_size == 9  # one round of 9 prompts picks the batch's 8 groups
    config = load_config(None, ["--train.type", "online_grpo", "--rollout.dynamic_sampling", "true"])
    assert config.rollout.dynamic_sampling and config.rollout.max_sampling_rounds == 4
    assert config.rollout.generation_batch_size is None
    config = load_config(None, ["--train.type", "online_ppo", "--rollout.dynamic_sampling", "true",
                                "--ppo.group_size", "4"])
    assert config.ppo.group_size == 4


def test_online_ppo_with_groups_and_dynamic_sampling_trains(tiny_model_dir, tmp_path, monkeypatch):
    """online_ppo with ppo.group_size 2 and dynamic sampling: each rollout holds rollout.batch_size * 2 samples,
    critic values and GAE for every one, and the sampling stats are logged."""
    import json

    from test_train_e2e import tiny_args

    from astrai.rewards import builtins as rewards
    from astrai.train import main
    monkeypatch.setitem(rewards.BUILTIN_REWARDS, "math_exact_match", rewards.BuiltinReward(
        lambda prompts, completions, format_bonus=0.0, partial_credit=0.0, **_: [float(len(c) % 2) for c in completions],
        "toy: length parity"))
    out = tmp_path / "run"
    assert main(tiny_args(tiny_model_dir, out, "--max_steps", "2", "--rollout.batch_size", "2", "--ppo.group_size",
                          "2", "--ppo.minibatch_size", "4", "--ppo.micro_batch_size", "2",
                          "--rollout.dynamic_sampling", "true", "--rollout.max_sampling_rounds", "3")) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert 1 <= r["rollout/sampling_rounds"] <= 3 and 0 <= r["rollout/sampled_zero_std_groups"] <= 1
        assert "critic/explained_variance" in r or "critic/value_loss" in r


def test_dynamic_sampling_counts_the_generation_time_of_every_round():
    script = [[0] * 8, [1, 0, 0, 0, 0, 0, 1, 1]]  # round 1 keeps nothing
    source = _source(script, max_rounds=4)
    sample, seen = source.runner.sample, []

    def recorded(*args):
        part = sample(*args)
        seen.append(part.timings["generate"])
        return part

    source.runner.sample = recorded
    exp = source.collect(policy_version=0)
    assert len(seen) == 2 and exp.timings["generate"] == pytest.approx(sum(seen))
    assert exp.responses == tuple(source.runner.score_fn.calls[1])


def test_the_config_sets_the_generation_batch(tiny_model_dir, tmp_path):
    """rollout.generation_batch_size reaches the experience source: each round draws that many prompts."""
    import json
    from pathlib import Path

    from astrai.distributed import setup_distributed
    from astrai.models import load_pretrained
    from astrai.rollout.build import build_rollout_engine
    from astrai.trainer.models import build_trained_model
    from astrai.trainer.learners.policy_gradient import online_experience

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i} + 1?", "answer": f"#### {i + 1}"}) + "\n"
                            for i in range(20)))
    config = load_config(str(Path(__file__).resolve().parents[1] / "configs/examples/grpo.yaml"),
                         ["--model.path", str(tiny_model_dir), "--data.path", str(data), "--rollout.batch_size", "2",
                          "--grpo.group_size", "2", "--grpo.minibatch_size", "4", "--grpo.micro_batch_size", "2",
                          "--rollout.max_new_tokens", "2", "--rollout.dynamic_sampling",
                          "true", "--rollout.max_sampling_rounds", "2", "--rollout.generation_batch_size", "3"])
    policy, tokenizer = load_pretrained(tiny_model_dir)
    dist = setup_distributed("cpu")
    experience = online_experience(config, dist, build_trained_model(config, dist, policy, name="policy"),
                                   tokenizer, engine=build_rollout_engine(config, policy, tokenizer),
                                   ref_model=None, chunk_size=2, group_size=2)
    exp = experience.collect(policy_version=0)
    rounds = int(exp.stats["sampling_rounds"])
    assert experience.data_sampler.drawn == 3 * rounds and exp.scores.shape == (4,)


def test_with_several_ranks_every_rank_samples_while_any_rank_lacks_groups():
    """Issue 42: the ranks agree on each further round (`any_rank`), so a rank that has its B groups after round 2
    samples a third round with a rank that still lacks some: the same number of engine and scoring calls on every rank
    (a sharded reward model's collectives, the failure agreement), its own first B groups kept."""
    script = [[0, 0, 0, 0, 1, 0, 1, 0], [1, 1, 0, 1, 0, 0, 1, 0], [1, 0, 1, 0, 1, 0, 1, 0]]
    asked = []
    source = _source(script, max_rounds=4)
    def any_rank(flag):  # after each round: (a stop on any rank?, groups lacking on any rank?); another rank
        asked.append(flag)  # lacks groups until its third round
        stop_question = len(asked) % 2 == 1
        return flag if stop_question else len(asked) <= 4

    source.any_rank = any_rank
    exp = source.collect(policy_version=0)
    texts = source.runner.score_fn.calls
    # this rank had its groups after round 2
    assert len(texts) == 3 and asked == [False, True, False, False, False, False]
    assert exp.responses == tuple(texts[0][G:2 * G] + texts[1][:G])  # the same kept groups as alone
    assert exp.stats["sampling_rounds"] == 3.0


def test_non_finite_logits_on_any_rank_stop_every_rank_before_scoring():
    """`RolloutRunner.agree`: the rank whose sampler met non-finite logits and a rank that did not both raise the
    agreed FloatingPointError right after generating, carrying the failing rank's line, and neither scores."""
    from astrai.distributed.context import DistributedContext

    class NaNEngine(ReferenceEngine):
        def generate(self, *args, **kwargs):
            raise FloatingPointError("sample_rows: row 0 has non-finite logits (max nan)")

    policy = small_model()
    for engine, other in ((NaNEngine(policy, pad_token_id=EOS), None),
                          (ReferenceEngine(policy, pad_token_id=EOS), "sample_rows: row 3 has non-finite logits")):
        scores = ScriptedScores([[0] * B * G])
        fake = type("Dist", (), {"world_size": 2, "rank": 0, "device": torch.device("cpu"),
                                 "all_reduce_max": staticmethod(lambda t: torch.ones_like(t)),
                                 "gather_objects": staticmethod(lambda line: [line, other])})()
        runner = RolloutRunner(engine, SamplingParams(max_new_tokens=5, temperature=1.0, stop_token_ids=(EOS,)),
                               decode=lambda ids: " ".join(map(str, ids)), score_fn=scores,
                               agree=lambda line: DistributedContext.first_failure(fake, line))
        with pytest.raises(FloatingPointError) as info:
            runner.sample([[5, 6]] * (B * G), [None] * (B * G))
        assert info.value.agreed and scores.calls == []
        assert str(info.value) == ("sample_rows: row 0 has non-finite logits (max nan)" if other is None
                                   else "rank 1: sample_rows: row 3 has non-finite logits")
    quiet = type("Dist", (), {"world_size": 2, "device": torch.device("cpu"),
                              "all_reduce_max": staticmethod(lambda t: t)})()
    assert DistributedContext.first_failure(quiet, None) is None  # no rank failed: one all-reduce, no gather


def test_a_stop_signal_ends_dynamic_sampling_after_the_round_in_flight():
    """Issue 42, class 5: a stop requested during a rollout with dynamic sampling ends it after the current round
    (filled up with dropped groups, as at the round cap) instead of after max_sampling_rounds, so the step and its
    checkpoint come soon."""
    script = [[0, 0, 0, 0, 1, 1, 1, 1]] * 4  # every group all equal: without the stop, 4 rounds
    source = _source(script, max_rounds=4)
    calls = []
    source.should_stop = lambda: bool(calls.append(1)) or True  # a signal arrived during round 1
    exp = source.collect(policy_version=0)
    assert len(source.runner.score_fn.calls) == 1 and exp.stats["sampling_rounds"] == 1.0 and len(exp) == B * G
    plain = _source(script, max_rounds=4)
    plain.collect(policy_version=0)
    assert len(plain.runner.score_fn.calls) == 4


def test_the_runners_own_stats_survive_dynamic_sampling_averaged_over_every_sampled_row():
    """Multi-turn episodes give each sampled round their metrics (`rollout/episodes/...`) in `Experience.stats`;
    joining the rounds kept none of them (concat_experiences' stats are empty), so a job with tools and dynamic
    sampling logged no turns or tool calls. They are the mean over every sampled row, kept or not."""
    script = [[0, 0, 0, 0, 1, 0, 1, 0],   # round 1: group 1 kept
              [1, 1, 0, 1, 0, 0, 1, 0]]  # round 2
    source = _source(script, max_rounds=4)
    sample, turns = source.runner.sample, iter([1.0, 2.5])

    def sample_with_stats(*args, **kwargs):
        part = sample(*args, **kwargs)
        part.stats["episodes/turns"] = next(turns)
        return part

    source.runner.sample = sample_with_stats
    exp = source.collect(policy_version=0)
    assert exp.stats["sampling_rounds"] == 2.0
    assert exp.stats["episodes/turns"] == pytest.approx((1.0 * B * G + 2.5 * B * G) / (2 * B * G))
