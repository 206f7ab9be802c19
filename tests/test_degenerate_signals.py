"""A training signal that means less than the user thinks is counted and said once: responses cut by the length
cap (`rollout/truncated_fraction`), all-zero advantages on several rollouts in a row, a reward constant over a run
(issue 42, class 1; no applicable reward: tests/test_reward_failures.py)."""

import warnings

import torch


def test_degenerate_signals_are_said_once():
    """All-zero advantages on 3 rollouts in a row are said once (a rollout's later minibatches, same
    policy_version, do not count again); a reward constant over the whole run is said at its end; a signal that
    varies says nothing."""
    from astrai.trainer.callbacks import DegenerateSignals

    def run(records):
        watch = DegenerateSignals(rollouts=3)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for r in records:
                watch.observe(r)
            watch.finish()
        return [str(w.message) for w in caught]

    flat = [{"rollout/policy_version": v, "rollout/reward_std": 0.0, "rollout/reward_mean": 1.0,
             "rollout/advantage_abs_mean": 0.0} for v in (0, 0, 1, 1, 2, 3, 4)]
    said = run(flat)
    assert len(said) == 2 and said[0].startswith("every advantage was 0 on the last 3 rollouts"), said
    assert said[1].startswith("the reward was 1 on every sample of all 5 rollouts"), said
    assert run(flat[:4]) == []  # two rollouts only
    varied = [dict(r, **{"rollout/advantage_abs_mean": float(i % 2), "rollout/reward_std": 0.5})
              for i, r in enumerate(flat[::2] + flat[5:])]
    assert run(varied) == []


def test_responses_cut_by_the_length_cap_are_counted_and_said_once():
    """rollout/truncated_fraction counts the responses whose last token is not a stop token; the first rollout
    where more than half were cut is said once."""
    from astrai.experience.runner import RolloutRunner
    from astrai.rollout.sampling import SamplingParams
    from test_dynamic_sampling import EOS, ReferenceEngine, small_model

    runner = RolloutRunner(ReferenceEngine(small_model(), pad_token_id=EOS),
                           SamplingParams(max_new_tokens=2, temperature=1.0, stop_token_ids=(EOS,)),
                           decode=lambda ids: " ".join(map(str, ids)), score_fn=lambda t, a, i: torch.zeros(len(t)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exps = [runner.sample([[1, 2, 3]] * 8, [None] * 8, torch.Generator().manual_seed(s)) for s in range(2)]
    for exp in exps:
        ends = [exp.sequences.response_ids[r][exp.sequences.response_mask[r]].tolist()[-1] for r in range(8)]
        assert exp.stats["truncated_fraction"] == sum(e != EOS for e in ends) / 8
    said = [str(w.message) for w in caught if "rollout.max_new_tokens (2) cut" in str(w.message)]
    assert len(said) == (1 if any(e.stats["truncated_fraction"] > 0.5 for e in exps) else 0)
    assert any(e.stats["truncated_fraction"] > 0.5 for e in exps)  # a 2-token cap on a random model cuts most
