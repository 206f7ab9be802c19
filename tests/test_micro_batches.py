"""RL micro-batches: rows grouped by length and trimmed to the columns they use (`Sequences.trim_padding`,
`RolloutResult.micro_batches`); a hand case with known shapes, and PPO policy and critic losses and gradients
equal to the untrimmed full-batch computation."""

import dataclasses
from pathlib import Path

import pytest
import torch
from toy_rl import trained

from astrai.config import load_config

from astrai.algos import explained_variance, ppo_clip, value_loss
from astrai.data.sequences import Sequences, position_ids_from_mask
from astrai.models import AutoRegressiveLM, ValueModel, tiny_config
from astrai.experience.trajectory import Experience
from astrai.forward import response_logprobs, response_values
from astrai.trainer.build import build_trainer
from astrai.trainer.loop import Callback, Trainer
from astrai.experience.replay import RolloutReplay
from astrai.config import PPOSection
from astrai.trainer.learners.online_ppo import OnlinePPOLearner

REPO = Path(__file__).resolve().parents[1]
VOCAB, EOS = 16, 2
PROMPTS = [[3], [4, 5, 6], [7, 8], [9, 10, 11, 12], [13, 14], [5, 6, 7]]
RESPONSES = [[3, 4], [5, 6, 7, 8, 2], [9], [10, 11, 2], [12, 13, 14, 15], [3]]


def experience(seed=0) -> Experience:
    seqs = Sequences.from_tokens(PROMPTS, RESPONSES, pad_token_id=EOS)
    g = torch.Generator().manual_seed(seed)
    mask = seqs.action_mask
    return Experience(sequences=seqs, old_logprobs=-torch.rand(mask.shape, generator=g) * mask,
                      ref_logprobs=-torch.rand(mask.shape, generator=g) * mask,
                      scores=torch.rand(len(PROMPTS), generator=g), responses=("x",) * len(PROMPTS), policy_version=0)


def test_trim_padding_hand_case():
    # rows 0 and 2: prompts of 1 and 2 tokens in P = 4 columns, responses of 2 and 1 tokens in T = 5 columns
    seqs = Sequences.from_tokens(PROMPTS[:4], RESPONSES[:4], pad_token_id=EOS)
    assert seqs.input_ids.shape == (4, 9) and seqs.prompt_length == 4
    columns, trimmed = seqs.select(torch.tensor([0, 2])).trim_padding()
    assert columns == slice(2, 6) and trimmed.prompt_length == 2
    assert trimmed.input_ids.tolist() == [[EOS, 3, 3, 4], [7, 8, 9, EOS]]
    assert trimmed.attention_mask.tolist() == [[False, True, True, True], [True, True, True, False]]
    assert trimmed.action_mask.tolist() == [[True, True], [True, False]]
    assert trimmed.position_ids.tolist() == [[0, 0, 1, 2], [0, 1, 2, 2]]
    assert torch.equal(trimmed.position_ids, position_ids_from_mask(trimmed.attention_mask))
    assert torch.equal(trimmed.response_ids, seqs.response_ids[[0, 2], :2])
    # nothing to drop: the full batch is unchanged
    columns, same = seqs.trim_padding()
    assert columns == slice(0, 9) and torch.equal(same.input_ids, seqs.input_ids) and same.prompt_length == 4
    # all responses empty after the first column: one response column is kept
    empty = Sequences.from_padded(seqs.input_ids[:, :4], seqs.attention_mask[:, :4], seqs.response_ids,
                                  torch.zeros(4, 5, dtype=torch.bool))
    assert empty.trim_padding()[1].action_mask.shape == (4, 1)


def test_micro_batches_group_by_length_and_cut_every_per_token_tensor():
    rollout = strategy(micro=2).pin_targets(experience())[0]
    micros = rollout.micro_batches(2)
    # real lengths 3, 8, 3, 7, 6, 4 -> stable order 0, 2, 5, 4, 3, 1
    assert [m.responses for m in micros] == [("x", "x")] * 3
    order = [0, 2, 5, 4, 3, 1]
    for k, micro in enumerate(micros):
        rows = torch.tensor(order[2 * k:2 * k + 2])
        width = micro.sequences.action_mask.shape[1]
        assert torch.equal(micro.sequences.action_mask, rollout.sequences.action_mask[rows, :width])
        assert not rollout.sequences.action_mask[rows, width:].any()
        for name in ("old_logprobs", "ref_logprobs", "values", "kl", "rewards", "advantages", "returns"):
            assert torch.equal(getattr(micro, name), getattr(rollout, name)[rows, :width]), name
    # widths: max prompt + max response of each micro-batch (4 + 5 untrimmed)
    assert [m.sequences.input_ids.shape[1] for m in micros] == [2 + 2, 3 + 4, 4 + 5]


class GradCapture(Callback):
    """The gradients each optimizer step is about to apply, by trained model name."""

    def __init__(self, models):
        self.models, self.grads = models, {}

    def before_optimizer_step(self, trainer, name):
        self.grads[name] = {n: p.grad.clone() for n, p in self.models[name].named_parameters()}


def models(seed=0):
    torch.manual_seed(seed)
    policy = AutoRegressiveLM(tiny_config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                          num_attention_heads=2, num_key_value_heads=1, eos_token_id=EOS,
                                          pad_token_id=EOS, bos_token_id=1))
    critic = ValueModel.from_policy(policy)
    with torch.no_grad():  # a non-zero critic head, so the value loss has a gradient through the trunk
        critic.value_head.weight.normal_(0.0, 0.5)
    return policy, critic


def strategy(micro: int, seed=0) -> OnlinePPOLearner:
    policy, critic = models(seed)
    settings = PPOSection(micro_batch_size=micro, clip_eps=0.2, value_clip=0.2, gamma=1.0, gae_lambda=0.95,
                           vf_coef=0.5, kl_coef=0.05, kl_estimator="k3", whiten_advantages=True)
    return OnlinePPOLearner(policy=trained(policy, lr=0.0), critic=trained(critic, name="critic", lr=0.0),
                             experience=None, replay=RolloutReplay(minibatch_size=6, epochs=1, seed=0),
                             settings=settings, temperature=0.7)


def test_trimmed_grouped_micro_batches_give_the_full_batch_losses_and_gradients():
    reference = strategy(micro=6)
    rollout = reference.pin_targets(experience())[0]
    policy, critic = reference.policy.module, reference.critic.module
    mask = rollout.sequences.action_mask
    # the untouched path: one padded forward over the whole untrimmed minibatch
    logprobs, _ = response_logprobs(policy, rollout.sequences, temperature=0.7, packed=False)
    pg, _ = ppo_clip(logprobs, rollout.old_logprobs, rollout.advantages, mask, clip_ratio_low=0.2,
                     clip_ratio_high=0.2)
    pg.backward()
    values = response_values(critic, rollout.sequences, packed=False)
    vl, _ = value_loss(values, rollout.values, rollout.returns, mask, clip_range=0.2)
    (0.5 * vl).backward()
    expected = {"policy": {n: p.grad for n, p in policy.named_parameters()},
                "critic": {n: p.grad for n, p in critic.named_parameters()}}
    ev = explained_variance(values.detach(), rollout.returns, mask)
    for grads in expected.values():  # every parameter has a gradient to compare
        assert min(g.abs().max() for g in grads.values()) > 1e-5
    for micro in (1, 2, 4, 6):
        s = strategy(micro)
        capture = GradCapture({"policy": s.policy.module, "critic": s.critic.module})
        trainer = Trainer(s, dist=s.policy.dist, max_steps=1, max_grad_norm=1e9, callbacks=[capture])
        metrics = s.update(trainer, rollout, first=True)
        torch.testing.assert_close(metrics["policy/loss"], pg.detach(), rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(metrics["critic/loss"], vl.detach(), rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(metrics["critic/explained_variance"], ev, rtol=1e-5, atol=1e-6)
        for name in ("policy", "critic"):
            for param, grad in expected[name].items():
                # float rounding relative to the tensor's scale; a wrong column would differ by O(1) of it
                torch.testing.assert_close(capture.grads[name][param], grad, rtol=1e-4,
                                           atol=1e-4 * float(grad.abs().max()),
                                           msg=lambda m: f"{name} {param} micro={micro}: {m}")


def test_ppo_without_kl_needs_no_reference_and_learns_the_same_targets():
    # kl_coef 0: the rollout carries no reference log-probs, and advantages and returns are those of a rollout
    # that has them (their KL term is multiplied by 0)
    with_ref = strategy(micro=2)
    with_ref.settings = dataclasses.replace(with_ref.settings, kl_coef=0.0)
    without_ref = strategy(micro=2)
    without_ref.settings = with_ref.settings
    exp = experience()
    expected, metrics = with_ref.pin_targets(exp)
    result, no_ref_metrics = without_ref.pin_targets(dataclasses.replace(exp, ref_logprobs=None))
    assert result.ref_logprobs is None and result.kl is None
    for name in ("rewards", "advantages", "returns", "values"):
        torch.testing.assert_close(getattr(result, name), getattr(expected, name), msg=name)
    assert "rollout/kl" in metrics and set(no_ref_metrics) == set(metrics) - {"rollout/kl"}


def test_ppo_kl_coef_zero_builds_no_reference_model(tiny_model_dir, tmp_path):
    config = load_config(str(REPO / "configs/examples/ppo.yaml"),
                         ["--model.path", str(tiny_model_dir), "--train.output_dir", str(tmp_path / "run"),
                          "--ppo.kl_coef", "0", "--data.truncation", "left"])
    assert build_trainer(config).learner.experience.runner.ref_model is None
    config.ppo.kl_coef = 0.05
    assert build_trainer(config).learner.experience.runner.ref_model is not None


def test_ppo_critic_from_the_policys_first_layers_trains_and_resumes(tiny_model_dir, tmp_path, capsys):
    # ppo.critic_layers 1 on the 2-layer tiny model: a 1-layer critic is built, trained, checkpointed and resumed;
    # resuming it with a full critic, and more layers than the model has, are refused with one line
    from astrai.config_schema import ConfigError
    from astrai.train import main

    out = tmp_path / "run"
    args = ["--config", str(REPO / "configs/examples/ppo.yaml"), "--model.path", str(tiny_model_dir),
            "--train.output_dir", str(out), "--rollout.batch_size", "4", "--ppo.minibatch_size", "2",
            "--ppo.micro_batch_size", "1", "--rollout.max_new_tokens", "6", "--train.progress_bar", "false",
            "--data.truncation", "left", "--checkpoint.save_steps", "1"]
    assert main([*args, "--ppo.critic_layers", "1", "--max_steps", "2"]) == 0
    assert main([*args, "--ppo.critic_layers", "1", "--max_steps", "3", "--checkpoint.resume", "auto"]) == 0
    critic = torch.load(out / "checkpoints/step-00000003/value_model.pt", weights_only=True)
    assert {k.split(".")[2] for k in critic if k.startswith("model.layers.")} == {"0"}
    assert main([*args, "--max_steps", "4", "--checkpoint.resume", "auto"]) == 2  # a 2-layer critic now
    err = capsys.readouterr().err  # refused from the manifest, before the model loads
    assert ("step-00000003: its critic has ppo.critic_layers 1, this job builds 2 (all the policy's); resume with "
            "--ppo.critic_layers 1\n") in err
    assert main([*args, "--max_steps", "4", "--checkpoint.resume", "auto", "--ppo.critic_layers", "2", "--check"]) == 2
    assert "its critic has ppo.critic_layers 1, this job builds 2" in capsys.readouterr().err  # the pre-flight too
    assert main([*args, "--max_steps", "4", "--checkpoint.resume", "auto", "--ppo.critic_layers", "1", "--check"]) == 0
    config = load_config(str(REPO / "configs/examples/ppo.yaml"),
                         ["--model.path", str(tiny_model_dir), "--train.output_dir", str(tmp_path / "bad"),
                          "--ppo.critic_layers", "3", "--data.truncation", "left"])
    with pytest.raises(ConfigError, match=r"^ppo\.critic_layers \(3\) exceeds the 2 decoder layers of model [^\n]*$"):
        build_trainer(config)
