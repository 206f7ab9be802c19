"""bench/ppo_vs_trl.py without TRL: the one-line exit 2 when no TRL interpreter is given, and the TRL worker's
rule-based reward behind TRL's reward-model call convention (run here with astrai's tiny tokenizer)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import _trl_ppo_worker as worker  # noqa: E402


def test_exit_2_with_the_venv_recipe_without_trl():
    env = {k: v for k, v in os.environ.items() if k != "TRL_PYTHON"}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "ppo_vs_trl.py")], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and "pip install torch==2.13.0" in lines[0] and "pip install trl==1.12.0" in lines[0]


def test_rule_reward_through_trl_get_reward_convention():
    from astrai.models import tiny_tokenizer
    from astrai.rewards.builtins import math_exact_match

    tok = tiny_tokenizer()
    p1, p2 = tok.encode("the sum"), tok.encode("a total of this")
    reward = worker.RuleReward(tok, {tuple(p1): "#### 5", tuple(p2): "#### 7"}, math_exact_match,
                               0.1, 2)
    r1, r2 = tok.encode("is #### 5") + [2], tok.encode("is 8")
    ctx, width = max(len(p1), len(p2)), max(len(r1), len(r2))
    rows = torch.tensor([[0] * (ctx - len(p1)) + p1 + r1 + [0] * (width - len(r1)),
                         [0] * (ctx - len(p2)) + p2 + r2 + [0] * (width - len(r2))])
    mask = rows != 0
    # What TRL 1.12's get_reward does with a reward model (pad id 0 here).
    out = getattr(reward, reward.base_model_prefix)(input_ids=rows, attention_mask=mask, position_ids=None,
                                                    return_dict=True, output_hidden_states=True, use_cache=False)
    logits = reward.score(out.hidden_states[-1])  # (B, S, 1): the score at every position, so at the last real one
    assert logits.shape == (2, rows.shape[1], 1)
    assert logits[:, -1, 0].tolist() == pytest.approx([1.1, 0.0])


def test_response_lengths_and_timed_batches():
    responses = torch.tensor([[5, 2, 0, 0], [5, 6, 7, 8]])
    assert worker.response_lengths(responses, 2) == [2, 4]
    assert worker.response_lengths(responses, None) == [4, 4]
    batches = worker.TimedBatches([1, 2])
    assert list(batches) == [1, 2] and len(batches.requested) == 2 and len(batches) == 2
