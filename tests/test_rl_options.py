"""The RL options wired through the registries: advantage estimator, policy loss, loss aggregation and the rollout
correction of the training-inference mismatch, chosen by config, in the GRPO and PPO updates."""

import dataclasses
import json
import warnings

import pytest
import torch
from test_grpo import GradCapture, make_experience, small_model
from toy_rl import trained

from astrai import algos
from astrai.algos import registry
from astrai.config import (ADVANTAGE_ESTIMATORS, ROLLOUT_CORRECTIONS, ConfigError, GRPOSection, config_from_dict,
                           ignored_settings)
from astrai.forward import response_logprobs
from astrai.trainer.loop import Trainer
from astrai.experience.replay import RolloutReplay
from astrai.trainer.learners.online_grpo import GRPOLearner, group_rollout
from astrai.trainer.learners.policy_loss import GSPO_CLIP, RolloutCorrection, clip_range, loss_agg_mode


def test_config_choices_are_the_registries():
    """One owner per name: the torch-free registry names every registered function, the config's choices are
    read from it, and the records carry the registry's needs."""
    assert list(algos.ADVANTAGE_ESTIMATORS) == list(registry.ESTIMATORS)
    assert list(algos.POLICY_LOSSES) == list(registry.POLICY_LOSSES)
    assert tuple(algos.ROLLOUT_CORRECTIONS) == registry.ROLLOUT_CORRECTIONS
    assert tuple(algos.KL_ESTIMATORS) == registry.KL_ESTIMATORS
    assert algos.LOSS_AGG_MODES == registry.LOSS_AGG_MODES and algos.SCALE_REWARDS == registry.SCALE_REWARDS
    assert set(ADVANTAGE_ESTIMATORS) == {n for n, e in algos.ADVANTAGE_ESTIMATORS.items() if not e.needs_values}
    assert set(ROLLOUT_CORRECTIONS) == set(algos.ROLLOUT_CORRECTIONS) | {"none"}
    for name, spec in registry.ESTIMATORS.items():
        record = algos.ADVANTAGE_ESTIMATORS[name]
        assert (record.needs_values, record.needs_groups, record.reads) == (spec.needs_values, spec.needs_groups,
                                                                              spec.reads)


SCALARS = {"gamma": 0.5, "lam": 0.3, "eps": 0.7, "std_floor": 5.0, "scale": "none", "unbiased": False,
           "whiten_advantages": True, "whiten_eps": 3.0, "group_size": 4, "reward_weight": 2.0}
"""A value, other than the default, for every keyword scalar of the estimators' calling convention."""


@pytest.mark.parametrize("name", sorted(registry.ESTIMATORS))
def test_an_estimator_reads_exactly_the_scalars_its_record_says(name):
    """What `reads` claims is true: changing a scalar it does not list changes nothing; changing one it lists
    changes the advantages or returns (for gae's unbiased and whiten_eps: with whitening on)."""
    g = torch.Generator().manual_seed(0)
    mask = torch.arange(5)[None, :] < torch.tensor([5, 3, 4, 2, 5, 1, 4, 5])[:, None]
    inputs = dict(scores=torch.randn(8, generator=g, dtype=torch.float64), action_mask=mask,
                  token_rewards=torch.randn(8, 5, generator=g, dtype=torch.float64) * mask,
                  values=torch.randn(8, 5, generator=g, dtype=torch.float64), group_size=2,
                  old_logprobs=-torch.rand(8, 5, generator=g, dtype=torch.float64),
                  teacher_logprobs=-torch.rand(8, 5, generator=g, dtype=torch.float64), reward_weight=0.5)
    record = algos.ADVANTAGE_ESTIMATORS[name]

    def differs(scalar, value) -> bool:
        whitened = {"whiten_advantages": True} if name == "gae" and scalar in ("unbiased", "whiten_eps") else {}
        base, out = record.fn(**inputs, **whitened), record.fn(**{**inputs, **whitened, scalar: value})
        return any(not (b is None and o is None) and (b is None or o is None or not torch.allclose(b, o))
                   for b, o in zip(base, out))

    for scalar, value in SCALARS.items():
        assert differs(scalar, value) == (scalar in record.reads), (name, scalar)


def test_clip_ranges_and_aggregation_defaults():
    assert clip_range(GRPOSection(clip_eps=0.2)) == (0.2, 0.2)
    assert clip_range(GRPOSection(clip_eps=0.2, clip_ratio_high=0.28)) == (0.2, 0.28)  # DAPO clip-higher
    assert clip_range(GRPOSection(policy_loss="gspo")) == GSPO_CLIP
    assert loss_agg_mode(GRPOSection(policy_loss="gspo")) == "seq-mean-token-mean"
    assert loss_agg_mode(GRPOSection(policy_loss="gspo", loss_agg_mode="token-mean")) == "token-mean"
    with pytest.raises(ConfigError, match="grpo.clip_ratio_c: dual clip applies to grpo.policy_loss ppo_clip"):
        config_from_dict({"train": {"type": "online_grpo"}, "grpo": {"policy_loss": "cispo", "clip_ratio_c": 3}})
    with pytest.raises(ConfigError, match="rollout.correction: corrects rollouts sampled by the engine; train.type sft"):
        config_from_dict({"train": {"type": "sft"}, "rollout": {"correction": "token_tis"}})
    unread = ignored_settings(config_from_dict({"train": {"type": "online_grpo"},
                                                "grpo": {"advantage_estimator": "rloo", "gamma": 0.9,
                                                         "std_floor": 0.1}}))
    assert unread == ["grpo.gamma", "grpo.std_floor"]


def _grads(policy, rollout, settings, micro):
    strategy = GRPOLearner(policy=trained(policy, lr=0.0), experience=None, settings=dataclasses.replace(
        settings, micro_batch_size=micro), temperature=0.7, loss_scale_factor=8.0,
                            replay=RolloutReplay(minibatch_size=len(rollout), epochs=1, seed=0))
    capture = GradCapture(policy)
    trainer = Trainer(strategy, dist=strategy.policy.dist, max_steps=1, max_grad_norm=1e9, callbacks=[capture])
    metrics = strategy.update(trainer, rollout, first=True)
    return capture.grads, metrics


@pytest.mark.parametrize("loss, mode", [("ppo_clip", "seq-mean-token-mean"), ("ppo_clip", "seq-mean-token-sum-norm"),
                                        ("gspo", None), ("cispo", "token-mean"), ("ppo_clip", "seq-mean-token-sum")])
def test_every_loss_and_mode_is_split_invariant_and_equals_the_direct_formula(loss, mode):
    """The step's gradient does not depend on the micro-batch split (units counted per mode over the step), and
    equals the registry loss + k3 KL written out on the whole batch."""
    policy = small_model()
    exp = make_experience([1.0, 0.0, 0.5, 2.0, 0.0, 0.0], t=4, lengths=[4, 1, 3, 2, 4, 1])
    rollout = group_rollout(exp, group_size=3)
    settings = GRPOSection(group_size=3, kl_coef=0.3, policy_loss=loss, loss_agg_mode=mode, clip_ratio_high=0.28,
                           clip_ratio_low=0.1)
    grads = [_grads(policy, rollout, settings, micro)[0] for micro in (1, 4, 6)]
    mask = rollout.sequences.action_mask
    agg = mode or algos.POLICY_LOSSES[loss].loss_agg_mode
    low, high = clip_range(settings)
    logprobs, _ = response_logprobs(policy, rollout.sequences, temperature=0.7)
    pg, _ = algos.POLICY_LOSSES[loss].fn(logprobs, rollout.old_logprobs, rollout.advantages, mask,
                                         clip_ratio_low=low, clip_ratio_high=high, loss_agg_mode=agg,
                                         loss_scale_factor=8.0)
    kl = algos.aggregate_loss(algos.kl_k3(logprobs, rollout.ref_logprobs), mask, loss_agg_mode=agg,
                              loss_scale_factor=8.0)
    (pg + 0.3 * kl).backward()
    for name, p in policy.named_parameters():
        for g in grads:
            torch.testing.assert_close(g[name], p.grad, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("estimator", ["rloo", "reinforce_pp", "reinforce_pp_baseline"])
def test_group_rollout_pins_the_registry_estimator(estimator):
    exp = make_experience([1.0, 0.0, 0.5, 2.0, 0.0, 0.0], t=4, lengths=[4, 1, 3, 2, 4, 1])
    pinned = group_rollout(exp, group_size=3, estimator=estimator, gamma=0.9, kl_reward_coef=0.2)
    mask = exp.sequences.action_mask
    kl = algos.kl_k3(exp.old_logprobs * mask, exp.ref_logprobs * mask) * mask
    rewards = algos.ppo_token_rewards(exp.scores, kl, mask, kl_coef=0.2)
    want, _ = algos.ADVANTAGE_ESTIMATORS[estimator].fn(scores=exp.scores, action_mask=mask, token_rewards=rewards,
                                                        group_size=3, gamma=0.9)
    torch.testing.assert_close(pinned.advantages, want * mask)
    if estimator == "rloo":  # hand value, first group rewards r = scores - 0.2 * KL sum: A_0 = r_0 - mean(r_1, r_2)
        r = rewards.sum(-1)
        assert pinned.advantages[0, 0] == pytest.approx(float(r[0] - (r[1] + r[2]) / 2), abs=1e-6)


class _StaticExperience:
    """An experience source that hands out one fixed experience."""

    def __init__(self, exp):
        self.exp, self.engine, self.data_sampler = exp, None, None

    def collect(self, policy_version):
        return self.exp


@pytest.mark.parametrize("mode", ["token_tis", "seq_mask", "icepop"])
def test_the_rollout_correction_rescores_and_weights_the_loss(mode):
    """With a correction, old_logprobs become the trainer's own (rescored before any update), the engine's are kept
    as rollout_logprobs, the weights are the registry's, and the loss equals a naive per-token reference."""
    policy = small_model()
    exp = make_experience([1.0, 0.0, 0.5, 2.0, 0.0, 0.0], t=4, lengths=[4, 1, 3, 2, 4, 1])
    settings = GRPOSection(group_size=3, kl_coef=0.0)
    correction = RolloutCorrection(mode, token_cap=2.0, seq_cap=3.0, icepop_low=0.5, icepop_high=5.0,
                                   temperature=0.7, chunk_size=2)
    strategy = GRPOLearner(policy=trained(policy, lr=0.0), experience=_StaticExperience(exp), settings=settings,
                            temperature=0.7, correction=correction,  # two minibatches: rescored before the first
                            replay=RolloutReplay(minibatch_size=3, epochs=1, seed=0))
    rollout, metrics = strategy.make_rollout(0)
    mask = exp.sequences.action_mask
    with torch.no_grad():
        train_old = response_logprobs(policy, exp.sequences, temperature=0.7)[0] * mask
    torch.testing.assert_close(rollout.old_logprobs, train_old)
    torch.testing.assert_close(rollout.rollout_logprobs, exp.old_logprobs * mask)
    weights, keep, _ = algos.correction_weights(mode, train_old, exp.old_logprobs * mask, mask)
    torch.testing.assert_close(rollout.correction_weights, weights * mask)
    d = (train_old - exp.old_logprobs) * mask
    assert metrics["rollout/mismatch_max_abs_diff"] == pytest.approx(float(d.abs().max()), rel=1e-5)
    # the corrected loss, naively: sum over real tokens of w_t * max(-A r, -A clip(r)) / real tokens; r = 1 here
    logprobs, _ = response_logprobs(policy, rollout.sequences, temperature=0.7)
    total, count = 0.0, 0
    for b in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if mask[b, t]:
                ratio = float(torch.exp(logprobs[b, t].detach() - rollout.old_logprobs[b, t]))
                a = float(rollout.advantages[b, t])
                term = max(-a * ratio, -a * min(max(ratio, 0.8), 1.2))
                total, count = total + float(rollout.correction_weights[b, t]) * term, count + 1
    loss, _ = strategy.objective(logprobs, rollout, torch.tensor(count))
    assert float(loss.detach()) == pytest.approx(total / count, rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("mode", ["token_tis", "seq_tis", "seq_mask", "icepop"])
def test_a_rollout_trained_in_one_step_is_weighed_from_that_steps_forward_without_a_rescore(mode, monkeypatch):
    """One minibatch, one epoch (TRL's default): the rescoring forward repeated what the step's own forward computes
    before its only update. Now it is skipped; the step's gradient and the correction and mismatch metrics equal the
    rescored path's (float rounding apart), and two minibatches or a KL term in the rewards still rescore."""
    policy = small_model()
    exp = make_experience([1.0, 0.0, 0.5, 2.0, 0.0, 0.0], t=4, lengths=[4, 1, 3, 2, 4, 1])
    generator = torch.Generator().manual_seed(3)  # an engine whose log-probs are off the trainer's
    noise = 0.3 * torch.randn(exp.old_logprobs.shape, generator=generator)
    exp = dataclasses.replace(exp, old_logprobs=(exp.old_logprobs + noise).clamp(max=-1e-3))
    correction = RolloutCorrection(mode, token_cap=1.5, seq_cap=2.0, icepop_low=0.8, icepop_high=1.25,
                                   temperature=0.7, chunk_size=2)

    def step(rescore: bool, **grpo):
        grpo = {"kl_coef": 0.0, **grpo}
        learner = GRPOLearner(policy=trained(policy, lr=0.0), experience=_StaticExperience(exp), temperature=0.7,
                              settings=GRPOSection(group_size=3, micro_batch_size=2, **grpo), correction=correction,
                              replay=RolloutReplay(minibatch_size=grpo.pop("minibatch", 6), epochs=1, seed=0))
        calls = []
        real = RolloutCorrection.rescore
        monkeypatch.setattr(RolloutCorrection, "rescore", lambda *a: calls.append(1) or real(*a))
        if rescore:  # the path taken before: rescore, then train
            monkeypatch.setattr(learner, "corrects_in_update", lambda experience: False)
        capture = GradCapture(policy)
        trainer = Trainer(learner, dist=learner.policy.dist, max_steps=1, max_grad_norm=1e9, callbacks=[capture])
        metrics = learner.train_step(trainer)
        return capture.grads, metrics, len(calls)

    grads, metrics, calls = step(False)
    assert calls == 0 and "time/rescore_seconds" not in metrics
    rescored_grads, rescored, rescored_calls = step(True)
    assert rescored_calls == 1 and "time/rescore_seconds" in rescored
    for name, grad in rescored_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-7)
    names = [n for n in rescored if n.startswith(("rollout/correction_", "rollout/mismatch_"))]
    assert len(names) == 6
    for name in names:
        assert float(metrics[name]) == pytest.approx(float(rescored[name]), rel=1e-5, abs=1e-7), name
    assert float(metrics["rollout/mismatch_k3_kl"]) > 1e-3  # the engine's noise is seen, not the trainer's own
    assert step(False, kl_reward_coef=0.1)[2] == 1  # KL in the rewards: pinned from rescored ones
    assert step(False, kl_coef=0.1)[2] == 0  # the loss's KL term reads the step's own log-probs


def test_online_grpo_trains_with_rloo_gspo_and_a_correction_logging_the_mismatch(tiny_model_dir, tmp_path):
    """End to end (tiny model, 2 steps): rloo advantages, the gspo loss, bf16 rollouts with token TIS against fp32
    training; the mismatch is logged on every step and is nonzero only through the bf16 engine."""
    from pathlib import Path

    from astrai.train import main

    def run(name, *extra):
        out = tmp_path / name
        example = Path(__file__).resolve().parents[1] / "configs/examples/grpo.yaml"
        code = main(["--config", str(example), "--model.path", str(tiny_model_dir), "--train.output_dir", str(out),
                     "--max_steps", "2", "--rollout.batch_size", "2", "--grpo.group_size", "2",
                     "--grpo.minibatch_size", "4", "--grpo.micro_batch_size", "2", "--rollout.max_new_tokens", "6",
                     "--train.progress_bar", "false", "--data.truncation", "left", "--train.report_to", "none",
                     "--checkpoint.save_at_end", "false", *extra])
        assert code == 0
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    plain = run("plain", "--grpo.advantage_estimator", "rloo", "--grpo.policy_loss", "gspo")
    assert all(r["rollout/mismatch_max_abs_diff"] < 1e-4 for r in plain)  # fp32 engine = the trainer's forward
    corrected = run("bf16", "--rollout.dtype", "bfloat16", "--rollout.correction", "token_tis")
    assert all(r["rollout/mismatch_max_abs_diff"] > 1e-4 for r in corrected)
    # one minibatch per rollout: weighed from the step's own forward, no rescoring forward
    assert all(0 < r["rollout/correction_weight_mean"] <= 2.0 and "time/rescore_seconds" not in r for r in corrected)
    two = run("bf16_two", "--rollout.dtype", "bfloat16", "--rollout.correction", "token_tis",
              "--grpo.minibatch_size", "2")  # two minibatches: rescored before the first
    assert all(r["rollout/mismatch_max_abs_diff"] > 1e-4 and "time/rescore_seconds" in r for r in two)


def test_an_engine_copy_in_another_dtype_without_a_correction_is_said_by_check(tiny_model_dir, tmp_path, capsys):
    """The rollout engine computing in another dtype than the trainer (bfloat16 rollouts of a float32 policy, a
    float32 engine beside bf16 mixed precision) with rollout.correction none: one warning line from --check (and
    from the run's start, `build_online_experience`); none with a correction, or with equal dtypes."""
    from astrai.config import config_from_dict
    from astrai.experience.build import uncorrected_dtype_mismatch
    from astrai.train import main

    def job(train=None, model=None, **rollout):
        return config_from_dict({"train": {"type": "online_grpo", **(train or {})}, "model": model or {},
                                 "rollout": rollout})

    said = uncorrected_dtype_mismatch(job(dtype="bfloat16"))
    assert said.startswith("the rollout engine computes in bfloat16 (rollout.dtype) and the trainer in float32 "
                           "(model.dtype) with rollout.correction none")
    assert said.endswith("set rollout.correction: token_tis, or leave rollout.dtype unset") and "\n" not in said
    widened = uncorrected_dtype_mismatch(job(model={"dtype": "bfloat16"}, dtype="float32"))
    assert widened.startswith("the rollout engine computes in float32 (rollout.dtype) and the trainer in bfloat16 "
                              "(model.dtype)")
    mixed = uncorrected_dtype_mismatch(job(train={"bf16": True}))
    assert mixed.startswith("the rollout engine computes in float32 (model.dtype) and the trainer in bfloat16 "
                            "(train.bf16)") and mixed.endswith("token_tis")
    assert uncorrected_dtype_mismatch(job(dtype="bfloat16", correction="token_tis")) is None
    both = uncorrected_dtype_mismatch(job(train={"bf16": True}, dtype="bfloat16"))
    assert both.startswith("the rollout engine and the trainer both compute in bfloat16 (rollout.dtype, train.bf16) "
                           "with rollout.correction none") and both.endswith("set rollout.correction: token_tis")
    for model, engine in (("bfloat16", "float32"), ("float16", "bfloat16")):  # unset, both would be half precision
        assert not uncorrected_dtype_mismatch(job(model={"dtype": model}, dtype=engine)).endswith("unset")
    half = uncorrected_dtype_mismatch(job(model={"dtype": "float16"}))  # the engine takes the policy's dtype
    assert half.startswith("the rollout engine and the trainer both compute in float16 (model.dtype) with")
    assert uncorrected_dtype_mismatch(job(model={"dtype": "bfloat16"}, correction="icepop")) is None
    assert uncorrected_dtype_mismatch(job(dtype="float32")) is None and uncorrected_dtype_mismatch(job()) is None

    def check(*extra):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            code = main(["--model.path", str(tiny_model_dir), "--train.output_dir", str(tmp_path / "o"),
                         "--train.type", "online_grpo", "--grpo.group_size", "2", "--rollout.batch_size", "2",
                         "--grpo.minibatch_size", "4", "--grpo.micro_batch_size", "4", "--data.truncation", "left",
                         "--rollout.max_new_tokens", "8", "--data.max_prompt_length", "64", "--rollout.dtype",
                         "bfloat16", *extra, "--check"])
        assert code == 0, capsys.readouterr().err
        return [str(w.message) for w in caught if "rollout.correction" in str(w.message)]

    assert check() == [said]
    assert check("--rollout.correction", "token_tis") == []


def test_online_ppo_without_a_kl_term_weighs_a_one_step_rollout_from_that_steps_forward(tiny_model_dir, tmp_path,
                                                                                         monkeypatch):
    """online_ppo with ppo.kl_coef 0 pins its targets (values, GAE) without old_logprobs: a rollout trained in one
    step skips the rescoring forward, and the run logs what the rescored run logs (float rounding apart); with a KL
    term the rewards read old_logprobs, so it still rescores."""
    from test_train_e2e import tiny_args

    from astrai.train import main
    from astrai.trainer.learners.policy_gradient import RolloutLearner

    def run(name, *extra):
        out = tmp_path / name
        assert main(tiny_args(tiny_model_dir, out, "--max_steps", "2", "--ppo.minibatch_size", "4",
                              "--rollout.dtype", "bfloat16", "--rollout.correction", "token_tis",
                              "--train.report_to", "none", "--checkpoint.save_at_end", "false", *extra)) == 0
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    weighed = run("weighed", "--ppo.kl_coef", "0")
    assert all("time/rescore_seconds" not in r and r["rollout/mismatch_max_abs_diff"] > 1e-4 for r in weighed)
    assert all("time/rescore_seconds" in r for r in run("kl", "--ppo.kl_coef", "0.05"))
    monkeypatch.setattr(RolloutLearner, "corrects_in_update", lambda self, experience: False)
    rescored = run("rescored", "--ppo.kl_coef", "0")
    assert all("time/rescore_seconds" in r for r in rescored)
    for mine, theirs in zip(weighed, rescored):
        for name in ("policy/loss", "critic/loss", "rollout/mismatch_k3_kl", "rollout/correction_weight_mean"):
            assert mine[name] == pytest.approx(theirs[name], rel=1e-4, abs=1e-6), name


def test_a_one_step_rollout_with_a_non_finite_forward_skips_the_step_and_a_resumed_uncorrected_one_trains(
        monkeypatch):
    """Two edges of the rescore-free path (a review): a non-finite log-prob in the step's forward (an fp16
    overflow) raised from the weights' bookkeeping mid-accumulation instead of skipping the step as every other
    path does; a rollout pinned without a correction (a checkpoint resumed with rollout.correction turned on) was
    taken for one to weigh and crashed; it trains as it was pinned."""
    from astrai.trainer.learners import policy_gradient

    policy = small_model()
    exp = make_experience([1.0, 0.0, 0.5, 2.0, 0.0, 0.0], t=4, lengths=[4, 1, 3, 2, 4, 1])
    correction = RolloutCorrection("token_tis", token_cap=2.0, seq_cap=3.0, icepop_low=0.5, icepop_high=5.0,
                                   temperature=0.7, chunk_size=2)

    def learner():
        return GRPOLearner(policy=trained(policy, lr=1e-3), experience=_StaticExperience(exp), temperature=0.7,
                           settings=GRPOSection(group_size=3, micro_batch_size=2, kl_coef=0.0),
                           correction=correction, replay=RolloutReplay(minibatch_size=6, epochs=1, seed=0))

    real = policy_gradient.response_logprobs

    def overflowing(model, sequences, **kwargs):  # the training forward only (a rescore runs without grad)
        logprobs, entropy = real(model, sequences, **kwargs)
        first = sequences.action_mask & (torch.arange(logprobs.shape[1]) == 0)
        return logprobs + torch.where(first, float("-inf"), 0.0), entropy

    one_step = learner()
    trainer = Trainer(one_step, dist=one_step.policy.dist, max_steps=5, max_grad_norm=1.0)
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    with monkeypatch.context() as patch:
        patch.setattr(policy_gradient, "response_logprobs", overflowing)
        one_step.train_step(trainer)
    assert trainer.state.skipped_steps == 1
    assert all(torch.equal(before[n], p) for n, p in policy.named_parameters())

    uncorrected = group_rollout(exp, group_size=3)  # pinned without a correction: no engine log-probs kept
    resumed = learner()
    trainer = Trainer(resumed, dist=resumed.policy.dist, max_steps=5, max_grad_norm=1.0)
    metrics = resumed.update(trainer, uncorrected, first=True)
    assert torch.isfinite(metrics["policy/loss"]) and "rollout/correction_weight_mean" not in metrics


def test_under_bf16_mixed_precision_both_paths_score_the_old_logprobs_as_the_step_does(tiny_model_dir, tmp_path,
                                                                                        monkeypatch):
    """The rescore ran outside the training forward's autocast (float32 old log-probs against a bf16 forward:
    `rollout/logprob_gap` 3.9e-4, GSPO's narrow clip band hit), so the one-step path and the rescored one gave
    different clipping under train.bf16 (a review). The rescore now runs in the forward's precision: both log the
    same."""
    from pathlib import Path

    from astrai.train import main
    from astrai.trainer.learners.policy_gradient import RolloutLearner

    def run(name):
        out = tmp_path / name
        example = Path(__file__).resolve().parents[1] / "configs/examples/grpo.yaml"
        assert main(["--config", str(example), "--model.path", str(tiny_model_dir), "--train.output_dir", str(out),
                     "--max_steps", "2", "--rollout.batch_size", "2", "--grpo.group_size", "2",
                     "--grpo.minibatch_size", "4", "--grpo.micro_batch_size", "2", "--rollout.max_new_tokens", "6",
                     "--train.progress_bar", "false", "--data.truncation", "left", "--train.report_to", "none",
                     "--checkpoint.save_at_end", "false", "--grpo.policy_loss", "gspo", "--train.bf16", "true",
                     "--rollout.correction", "token_tis", "--runtime.device", "cpu"]) == 0
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    weighed = run("weighed")
    monkeypatch.setattr(RolloutLearner, "corrects_in_update", lambda self, experience: False)
    rescored = run("rescored")
    for mine, theirs in zip(weighed, rescored):
        assert theirs["rollout/logprob_gap"] < 1e-5 and "time/rescore_seconds" in theirs
        for name in ("policy/clipfrac", "policy/loss", "rollout/mismatch_k3_kl", "rollout/correction_weight_mean"):
            assert mine[name] == pytest.approx(theirs[name], rel=1e-3, abs=1e-7), name
