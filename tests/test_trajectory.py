"""The trajectory seam: per-sample records with a loss mask apart from the attention mask, per-token behaviour
log-probs and per-token policy versions, collated into the batch the train types learn from.

- A single-turn rollout of the real engine, split into trajectories and collated again, is bit-identical.
- A multi-turn batch (tool tokens between two turns of the policy) is attended to in full, scored only at the
  policy's tokens (the padding-free forward equals a per-row loop over the full logits), passes the rollout checks,
  and its GRPO targets and loss step never touch the tool tokens.
"""

import dataclasses

import pytest
import torch

from astrai.algos import advantage_estimator, logprobs_from_logits
from astrai.experience.runner import RolloutRunner
from astrai.experience.trajectory import Experience, Trajectory
from astrai.forward import response_logprobs, response_values
from astrai.models import AutoRegressiveLM, ValueModel, tiny_config
from astrai.rollout.engine import build_engine
from astrai.rollout.sampling import SamplingParams
from astrai.trainer.learners.online_grpo import group_rollout, validate_group_rollout

VOCAB, PAD = 32, 0


def _model(seed=0):
    torch.manual_seed(seed)
    return AutoRegressiveLM(tiny_config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                        num_key_value_heads=1, eos_token_id=2, pad_token_id=PAD, bos_token_id=1))


def _episode(prompt, turns, tool_turns, *, versions, score=1.0, g=None):
    """A trajectory alternating policy turns (sampled: random log-probs, their version) and tool turns."""
    response, mask, logprobs, token_versions, starts = [], [], [], [], []
    for i, turn in enumerate(turns):
        starts.append(len(response))
        response += turn
        mask += [True] * len(turn)
        logprobs += (-torch.rand(len(turn), generator=g)).tolist()
        token_versions += [versions[i]] * len(turn)
        if i < len(tool_turns):
            response += tool_turns[i]
            mask += [False] * len(tool_turns[i])
            logprobs += [0.0] * len(tool_turns[i])
            token_versions += [-1] * len(tool_turns[i])
    return Trajectory(prompt_ids=tuple(prompt), response_ids=tuple(response), loss_mask=tuple(mask),
                      logprobs=tuple(logprobs), policy_versions=tuple(token_versions), score=score,
                      text=f"episode of {len(turns)} turns", reward_components={"r": score},
                      reward_failed={"r": False}, turn_starts=tuple(starts))


def _multi_turn_batch():
    g = torch.Generator().manual_seed(0)
    episodes = [
        _episode([5, 6, 7], [[8, 9], [10, 11, 2]], [[20, 21, 22]], versions=[3, 4], score=1.0, g=g),
        _episode([5, 6], [[12, 13, 14, 2]], [], versions=[4], score=0.0, g=g),
        _episode([7, 8, 9, 10], [[15], [16], [17, 2]], [[23], [24, 25]], versions=[4, 4, 4], score=0.5, g=g),
        _episode([11], [[18, 19]], [], versions=[4], score=0.25, g=g),
    ]
    return episodes, Experience.from_trajectories(episodes, pad_token_id=PAD)


def test_an_episodes_messages_follow_its_row_through_select_concat_and_back():
    """`Trajectory.messages` (the completion the reward saw) stays with its sample: collated, selected, concatenated
    with a single-turn batch (None there) and split back; a batch without any keeps None."""
    from astrai.experience.trajectory import concat_experiences

    episodes, plain = _multi_turn_batch()
    assert plain.messages is None
    said = [[{"role": "assistant", "content": f"turn of {i}"}, {"role": "tool", "content": str(i)}] for i in range(4)]
    exp = Experience.from_trajectories([dataclasses.replace(t, messages=m) for t, m in zip(episodes, said)],
                                       pad_token_id=PAD)
    assert exp.select([2, 0]).messages == (said[2], said[0])
    both = concat_experiences([exp.select([3]), plain.select([1])], pad_token_id=PAD)
    assert both.messages == (said[3], None)
    assert [t.messages for t in both.trajectories()] == [said[3], None]


def test_trajectory_refuses_inconsistent_fields():
    good = dict(prompt_ids=(1,), response_ids=(2, 3), loss_mask=(True, False), logprobs=(-0.5, 0.0),
                policy_versions=(0, -1))
    Trajectory(**good)
    with pytest.raises(ValueError, match="loss_mask: 1 values for 2 response tokens"):
        Trajectory(**{**good, "loss_mask": (True,)})
    with pytest.raises(ValueError, match="token 1 is not sampled"):
        Trajectory(**{**good, "logprobs": (-0.5, -0.1)})
    with pytest.raises(ValueError, match="token 1 is not sampled"):
        Trajectory(**{**good, "policy_versions": (0, 0)})
    with pytest.raises(ValueError, match="empty prompt or response"):
        Trajectory(**{**good, "prompt_ids": ()})


def test_multi_turn_collation_keeps_attention_and_loss_masks_apart():
    episodes, exp = _multi_turn_batch()
    seq = exp.sequences
    assert seq.action_mask.shape == seq.response_mask.shape == (4, 8)
    row = 0  # [8, 9] sampled, [20, 21, 22] a tool's, [10, 11, 2] sampled
    assert seq.response_ids[row].tolist() == [8, 9, 20, 21, 22, 10, 11, 2]
    assert seq.response_mask[row].tolist() == [True] * 8
    assert seq.action_mask[row].tolist() == [True, True, False, False, False, True, True, True]
    assert exp.policy_versions[row].tolist() == [3, 3, -1, -1, -1, 4, 4, 4]
    assert exp.policy_versions[1].tolist() == [4, 4, 4, 4, -1, -1, -1, -1]  # right padding: -1, mask False
    assert not seq.response_mask[1, 4:].any() and not seq.action_mask[1, 4:].any()
    assert exp.policy_version == 4 and exp.turn_starts[0] == (0, 5) and exp.turn_starts[2] == (0, 2, 5)
    assert bool((exp.old_logprobs[~seq.action_mask] == 0).all())
    assert exp.scores.tolist() == [1.0, 0.0, 0.5, 0.25]
    # positions run through the tool tokens: the second turn continues where the first and the tool left off
    assert seq.position_ids[row, seq.prompt_length:].tolist() == list(range(3, 11))
    assert exp.trajectories() == episodes


def test_the_forward_attends_to_tool_tokens_and_scores_only_actions():
    """Padding-free log-probs and values of a multi-turn batch equal a per-row loop over the full logits of the
    unpadded sequence, at every action token; tool tokens are scored 0 (nothing is computed for them)."""
    _, exp = _multi_turn_batch()
    model, seq = _model().eval(), exp.sequences
    critic = ValueModel.from_policy(model).eval()
    with torch.no_grad():
        packed, _ = response_logprobs(model, seq, temperature=0.7)
        values = response_values(critic, seq)
        for b, episode in enumerate(exp.trajectories()):
            ids = torch.tensor([list(episode.prompt_ids) + list(episode.response_ids)])
            logits = model(ids)  # (1, S, V): the whole unpadded episode, tool tokens attended to
            p = len(episode.prompt_ids)
            want = logprobs_from_logits(logits[:, p - 1:-1] / 0.7, ids[:, p:])[0]
            actions = seq.action_mask[b, :len(episode.response_ids)]
            torch.testing.assert_close(packed[b, :len(episode.response_ids)][actions], want[actions],
                                       rtol=1e-5, atol=1e-5)
            assert bool((packed[b][~seq.action_mask[b]] == 0).all())
            assert values.shape == seq.action_mask.shape


def test_multi_turn_rollout_passes_the_checks_and_its_targets_skip_tool_tokens():
    _, exp = _multi_turn_batch()
    validate_group_rollout(exp, group_size=2, need_ref=False)
    result = group_rollout(exp, group_size=2, estimator="grpo")
    mask = exp.sequences.action_mask
    assert bool((result.advantages[~mask] == 0).all()) and bool((result.advantages[mask] != 0).all())
    assert torch.equal(result.policy_versions, exp.policy_versions)
    # REINFORCE++ carries the final reward back across the tool span, one discount per action step
    adv, returns = advantage_estimator("reinforce_pp").fn(scores=exp.scores, action_mask=mask, gamma=0.5,
                                                          group_size=2)
    assert returns[0].tolist() == [0.5 ** 4, 0.5 ** 3, 0, 0, 0, 0.5 ** 2, 0.5, 1.0]


def test_a_rollout_check_refuses_an_action_on_padding():
    _, exp = _multi_turn_batch()
    seq = exp.sequences
    bad_mask = seq.action_mask.clone()
    bad_mask[1, 6] = True  # row 1's response is 4 tokens long: column 6 is padding
    bad = dataclasses.replace(exp, sequences=dataclasses.replace(seq, action_mask=bad_mask))
    with pytest.raises(ValueError, match="action_mask marks a padding token"):
        validate_group_rollout(bad, group_size=2, need_ref=False)


def test_a_single_turn_rollout_round_trips_through_trajectories_bit_identically():
    model = _model()
    engine = build_engine("paged", model, pad_token_id=PAD, policy_version=7)
    runner = RolloutRunner(engine, SamplingParams(max_new_tokens=6, temperature=1.0, stop_token_ids=(2,)),
                           decode=lambda ids: " ".join(map(str, ids)),
                           score_fn=lambda texts, targets, ids: torch.tensor([float(len(i)) for i in ids]))
    prompts = [[5, 6, 7], [8], [9, 10, 11, 12], [13, 14]]
    exp = runner.sample(prompts, [None] * 4, torch.Generator().manual_seed(0))
    assert exp.policy_versions.dtype == torch.long
    assert torch.equal(exp.policy_versions, torch.where(exp.sequences.action_mask, 7, -1))
    assert torch.equal(exp.sequences.response_mask, exp.sequences.action_mask)  # single turn: the same mask
    again = Experience.from_trajectories(exp.trajectories(), pad_token_id=PAD)
    for name in ("input_ids", "attention_mask", "position_ids", "action_mask"):
        assert torch.equal(getattr(again.sequences, name), getattr(exp.sequences, name)), name
    assert again.sequences.prompt_length == exp.sequences.prompt_length
    assert torch.equal(again.old_logprobs, exp.old_logprobs) and torch.equal(again.scores, exp.scores)
    assert torch.equal(again.policy_versions, exp.policy_versions) and again.policy_version == 7
    assert again.responses == exp.responses and again.turn_starts == ((0,),) * 4


class _Static:
    """An experience source handing out one fixed batch."""

    def __init__(self, exp):
        self.exp, self.engine, self.data_sampler = exp, None, None

    def collect(self, policy_version):
        return self.exp


def test_the_grpo_objective_on_a_multi_turn_rollout_is_the_naive_loop_over_the_policys_tokens():
    from astrai.config import GRPOSection
    from astrai.experience.replay import RolloutReplay
    from astrai.trainer.learners.online_grpo import GRPOLearner
    from toy_rl import trained

    _, exp = _multi_turn_batch()
    policy = _model()
    strategy = GRPOLearner(policy=trained(policy, lr=0.0), experience=_Static(exp), temperature=1.0,
                            settings=GRPOSection(group_size=2, kl_coef=0.0, minibatch_size=4, micro_batch_size=2),
                            replay=RolloutReplay(minibatch_size=4, epochs=1, seed=0))
    rollout, metrics = strategy.make_rollout(0)
    mask = rollout.sequences.action_mask
    assert metrics["rollout/response_length"] == pytest.approx(float(mask.sum(-1).float().mean()))
    logprobs, _ = response_logprobs(policy, rollout.sequences, temperature=1.0)
    total, count = 0.0, 0
    for b in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if mask[b, t]:  # PPO-clip (0.2) at each of the policy's tokens; the tool tokens are no term
                ratio = float(torch.exp(logprobs[b, t].detach() - rollout.old_logprobs[b, t]))
                a = float(rollout.advantages[b, t])
                total, count = total + max(-a * ratio, -a * min(max(ratio, 0.8), 1.2)), count + 1
    loss, _ = strategy.objective(logprobs, rollout, torch.tensor(count))
    assert float(loss.detach()) == pytest.approx(total / count, rel=1e-5, abs=1e-7)
    loss.backward()
    assert all(p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in policy.parameters())
