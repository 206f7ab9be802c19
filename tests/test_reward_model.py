"""Reward models: the Bradley-Terry loss, the `rm` train type, its checkpoints as transformers'
`LlamaForSequenceClassification`, `reward.model_path` scoring online rollouts, and the sft -> rm -> online_ppo
pipeline end to end on a tiny model. Also: degenerate pairs and examples found at load time, and an rm checkpoint
given where a causal LM is expected (serve, evaluate, checkpoint export) refused in one line as a reward model."""

import json
import math
from pathlib import Path

import pytest
import torch

from astrai.algos import bradley_terry_loss

REPO = Path(__file__).resolve().parents[1]


def test_bradley_terry_hand_values():
    chosen, rejected = torch.tensor([2.0, 0.0]), torch.tensor([0.0, 1.0])
    loss, metrics = bradley_terry_loss(chosen, rejected)
    # -log sigmoid(2) = 0.126928, -log sigmoid(-1) = 1.313262; mean 0.720095
    assert float(loss) == pytest.approx((0.126928 + 1.313262) / 2, abs=1e-5)
    assert metrics["rm/accuracy"] == 0.5 and metrics["rm/margin"] == pytest.approx(0.5)
    with_margin, _ = bradley_terry_loss(chosen, rejected, margin=torch.tensor([1.0, 0.0]), num_pairs=4)
    # -log sigmoid(2 - 1) = 0.313262; shares over 4 pairs
    assert float(with_margin) == pytest.approx((0.313262 + 1.313262) / 4, abs=1e-5)


def _train(args):
    from astrai.train import main

    assert main([*args, "--train.progress_bar", "false", "--train.report_to", "none"]) == 0


def test_sft_then_rm_then_online_ppo_with_the_reward_model(tiny_model_dir, tmp_path):
    """The InstructGPT pipeline, each step one command: sft on chats, rm on preference pairs from the sft weights,
    online_ppo from the sft weights scored by the rm checkpoint; the rm checkpoint loads in transformers as
    LlamaForSequenceClassification with the same scores."""
    import transformers

    from astrai.models import load_reward_model

    sft, rm, ppo = tmp_path / "sft", tmp_path / "rm", tmp_path / "ppo"
    _train(["--config", str(REPO / "configs/examples/sft.yaml"), "--model.path", str(tiny_model_dir),
            "--train.output_dir", str(sft), "--max_steps", "2", "--data.max_length", "128"])
    sft_ckpt = next((sft / "checkpoints").glob("step-*"))
    _train(["--config", str(REPO / "configs/examples/rm.yaml"), "--model.path", str(sft_ckpt),
            "--train.output_dir", str(rm), "--max_steps", "3", "--data.max_length", "128",
            "--data.truncation", "filter", "--optim.learning_rate", "1e-3"])
    records = [json.loads(line) for line in (rm / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["train/loss"] == pytest.approx(math.log(2), abs=1e-4)  # the zero head: every reward 0
    assert records[-1]["train/loss"] < records[0]["train/loss"]
    rm_ckpt = next((rm / "checkpoints").glob("step-*"))
    config = json.loads((rm_ckpt / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"] and config["num_labels"] == 1

    ours, _ = load_reward_model(rm_ckpt)
    theirs = transformers.AutoModelForSequenceClassification.from_pretrained(str(rm_ckpt)).eval()
    ids = torch.tensor([[5, 9, 12, 7, 3], [8, 4, 6, 11, 10]])  # no pad id inside: both pool at the last token
    with torch.no_grad():
        want = theirs(input_ids=ids).logits.squeeze(-1)
        got = ours(ids, torch.ones_like(ids))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(got, torch.zeros_like(got))  # trained: the head moved

    _train(["--config", str(REPO / "configs/examples/ppo.yaml"), "--model.path", str(sft_ckpt),
            "--reward.model_path", str(rm_ckpt), "--train.output_dir", str(ppo), "--max_steps", "2",
            "--rollout.batch_size", "2", "--ppo.minibatch_size", "2", "--ppo.micro_batch_size", "1",
            "--rollout.max_new_tokens", "6", "--data.truncation", "left", "--checkpoint.save_at_end", "false"])
    steps = [json.loads(line) for line in (ppo / "metrics.jsonl").read_text().splitlines()]
    assert all(r["rewards/reward_model/applies"] == 1.0 for r in steps)
    assert all(r["rollout/reward_mean"] == pytest.approx(r["rewards/reward_model/mean"], abs=1e-5) for r in steps)
    assert len({round(r["rollout/reward_mean"], 6) for r in steps}) >= 1 and steps[0]["rollout/reward_mean"] != 0


def test_degenerate_pairs_and_examples_are_found_at_load_time(tiny_model_dir, tmp_path):
    from astrai.config import load_config
    from astrai.data import DataError
    from astrai.models import load_pretrained
    from astrai.trainer.learners.dpo import dpo_data
    from astrai.trainer.learners.sft import sft_data

    policy, tokenizer = load_pretrained(tiny_model_dir)
    pairs = tmp_path / "pairs.jsonl"
    same_start = "a" * 200  # the difference lies beyond the response budget
    pairs.write_text(json.dumps({"prompt": "q", "chosen": same_start + "good", "rejected": same_start + "bad"}) + "\n"
                     + json.dumps({"prompt": "q", "chosen": "yes", "rejected": "no"}) + "\n")
    base = ["--train.type", "dpo", "--data.path", str(pairs), "--data.max_length", "64", "--data.prompt_field", "prompt"]
    with pytest.raises(DataError, match=r"1 of 2 pairs have identical chosen and rejected tokens within "
                                        r"data.max_length=64 .*first row 1"):
        dpo_data(load_config(None, base), policy.config, tokenizer)
    kept = dpo_data(load_config(None, base + ["--data.truncation", "filter"]), policy.config, tokenizer)
    assert len(kept) == 1 and kept[0][1] != kept[0][2]

    chats = tmp_path / "chats.jsonl"
    long_user = {"messages": [{"role": "user", "content": "x " * 300}, {"role": "assistant", "content": "ok"}]}
    fine = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    chats.write_text(json.dumps(long_user) + "\n" + json.dumps(fine) + "\n")
    sft = ["--train.type", "sft", "--data.path", str(chats), "--data.max_length", "64"]
    with pytest.raises(DataError, match=r"1 of 2 examples keep no labelled token within data.max_length=64 "
                                        r"\(first row 1\)"):
        sft_data(load_config(None, sft), policy.config, tokenizer)
    assert len(sft_data(load_config(None, sft + ["--data.truncation", "filter"]), policy.config, tokenizer)) == 1


def test_each_dropped_pair_is_counted_once_under_its_reason(tiny_model_dir, tmp_path, capsys):
    """Issue 42, class 8: under data.truncation filter a pair dropped as identical is not reported again as dropped
    for prompt length (dpo and rm), and a file of identical pairs is not called 'every prompt is too long'."""
    from astrai.config import load_config
    from astrai.data import DataError
    from astrai.models import load_pretrained
    from astrai.trainer.learners.dpo import dpo_data
    from astrai.trainer.learners.rm import rm_data

    policy, tokenizer = load_pretrained(tiny_model_dir)
    pairs = tmp_path / "pairs.jsonl"
    same = {"prompt": "q", "chosen": "a" * 200 + "good", "rejected": "a" * 200 + "bad"}
    long_prompt = {"prompt": "x " * 300, "chosen": "yes", "rejected": "no"}
    fine = {"prompt": "q", "chosen": "yes", "rejected": "no"}
    pairs.write_text("".join(json.dumps(r) + "\n" for r in (same, long_prompt, fine)))
    for train_type, load in (("dpo", dpo_data), ("rm", rm_data)):
        args = ["--train.type", train_type, "--data.path", str(pairs), "--data.max_length", "64",
                "--data.max_prompt_length", "32", "--data.prompt_field", "prompt", "--data.truncation", "filter"]
        capsys.readouterr()
        assert len(load(load_config(None, args), policy.config, tokenizer)) == 1
        said = [line for line in capsys.readouterr().out.splitlines() if "dropped" in line]
        assert len(said) == 2, said
        assert "dropped 1 of 3 records" in said[0] and "prompt is longer" in said[0]
        assert "dropped 1 pairs" in said[1] and "identical" in said[1]

    pairs.write_text(json.dumps(same) + "\n" + json.dumps(long_prompt) + "\n")
    args = ["--train.type", "dpo", "--data.path", str(pairs), "--data.max_length", "64", "--data.max_prompt_length",
            "32", "--data.prompt_field", "prompt", "--data.truncation", "filter"]
    with pytest.raises(DataError, match=r"no pair left to train on: data.truncation=filter dropped 1 of 2 for prompt "
                                        r"length and 1 with identical chosen and rejected tokens$"):
        dpo_data(load_config(None, args), policy.config, tokenizer)


def test_a_reward_model_shorter_than_the_samples_is_said_at_start_and_its_cuts_counted(tmp_path, monkeypatch):
    """Issue 42, class 1: a reward model whose position limit is below data.max_prompt_length + max_new_tokens is
    named at start-up; at run time the samples it scored cut are counted and warned about once."""
    import warnings

    import astrai.rewards.build as build
    from astrai.config import config_from_dict
    from astrai.models import AutoRegressiveLM, tiny_config, tiny_tokenizer
    from astrai.models.reward_model import RewardModel

    torch.manual_seed(0)
    model = RewardModel.from_policy(AutoRegressiveLM(tiny_config(max_position_embeddings=24))).eval()
    monkeypatch.setattr(build, "load_reward_model", lambda *a, **k: (model, tiny_tokenizer()))
    config = config_from_dict({"reward": {"model_path": "rm"}, "data": {"max_prompt_length": 16},
                               "rollout": {"max_new_tokens": 16}})
    with pytest.warns(UserWarning, match=r"reward.model_path: the reward model reads at most 24 positions, but a "
                                         r"prompt .* can take 33 "):
        rewards = build.build_rewards(config, [], num_workers=0)
    scorer = rewards._functions[rewards.names.index("reward_model")]
    with pytest.warns(UserWarning, match=r"reward model: 1 of 2 samples of this batch were longer than its 24 "
                                         r"positions and were scored cut"):
        scores = scorer(["a short question", "q"], ["x" * 60, "ok"])
    assert len(scores) == 2 and scorer.cut == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once: the second batch only counts
        scorer(["q"], ["y" * 80])
    assert scorer.cut == 2
    rewards.close()


@pytest.fixture(scope="module")
def rm_run(tiny_model_dir, tmp_path_factory):
    """A `train.type: rm` run of one step on the tiny model: (its output directory, its checkpoint)."""
    out = tmp_path_factory.mktemp("rm-run") / "rm"
    _train(["--config", str(REPO / "configs/examples/rm.yaml"), "--model.path", str(tiny_model_dir),
            "--train.output_dir", str(out), "--max_steps", "1", "--data.max_length", "128",
            "--data.truncation", "filter"])
    return out, next((out / "checkpoints").glob("step-*"))


def _said_reward_model(err: str, ckpt: Path) -> None:
    """`err` (a command's stderr) is one line saying `ckpt` is a reward model that cannot generate."""
    err = err.strip()
    assert err == (f"error: {ckpt}: a reward model (config.json architectures LlamaForSequenceClassification; what "
                   "train.type rm writes): it scores text and cannot generate; expected a causal language model (a "
                   "policy checkpoint, *ForCausalLM); a reward model is used through reward.model_path"), err


def test_serving_a_reward_model_checkpoint_says_it_cannot_generate(rm_run, capsys):
    """`python -m astrai.serve --checkpoint` of an rm run (or its checkpoint) names it a reward model in one line,
    not a tensor mismatch (`unexpected tensors ['score.weight']`)."""
    import socket

    from astrai.serve.__main__ import main

    out, ckpt = rm_run
    for given in (out, ckpt):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        assert main(["--checkpoint", str(given), "--port", str(port)]) == 2
        _said_reward_model(capsys.readouterr().err, ckpt)


def test_evaluating_a_reward_model_checkpoint_says_it_cannot_generate(rm_run, tmp_path, capsys):
    from astrai.evaluate import main

    _, ckpt = rm_run
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "1 + 1", "answer": "2"}) + "\n")
    assert main(["--model", str(ckpt), "--data", str(data), "--output_dir", str(tmp_path / "eval")]) == 2
    _said_reward_model(capsys.readouterr().err.strip().splitlines()[-1], ckpt)


def test_exporting_a_reward_model_checkpoint_says_it_cannot_generate(rm_run, tmp_path, capsys):
    from astrai.checkpoint.__main__ import main

    _, ckpt = rm_run
    assert main(["export", str(ckpt), str(tmp_path / "out")]) == 2
    _said_reward_model(capsys.readouterr().err, ckpt)
    assert not (tmp_path / "out").exists()


def test_a_sequence_classifier_without_astrai_config_is_named_by_its_architecture(rm_run, tmp_path):
    """A transformers `*ForSequenceClassification` directory (no config.yaml) is refused by `load_pretrained` by
    its architecture alone; `load_reward_model` still reads it."""
    import shutil

    from astrai.models import load_pretrained, load_reward_model

    _, ckpt = rm_run
    plain = tmp_path / "classifier"
    plain.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ckpt / name, plain / name)
    with pytest.raises(ValueError) as info:
        load_pretrained(plain)
    assert str(info.value) == (f"{plain}: a reward model (config.json architectures LlamaForSequenceClassification; "
                               "what train.type rm writes): it scores text and cannot generate; expected a causal "
                               "language model (a policy checkpoint, *ForCausalLM); a reward model is used through "
                               "reward.model_path")
    model, _ = load_reward_model(plain)
    assert model(torch.tensor([[5, 9, 12]]), torch.ones(1, 3, dtype=torch.long)).shape == (1,)
