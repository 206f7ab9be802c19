"""sft, dpo, seq and offline grpo: losses by hand, data loading and errors, chat masking, packing, micro-batch
invariance of the token-mean / pair-mean, the old-policy fallback, schedules, and every example config for one
step on the tiny model (every trainable parameter changes)."""

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from astrai.algos import dpo_loss, logprobs_from_logits, token_cross_entropy
from astrai.config import load_config
from astrai.data import DataError, PromptSampler
from astrai.data.examples import IGNORE_INDEX, chat_example, collate_lm, pack_examples, text_example
from astrai.data.records import load_records
from astrai.distributed import setup_distributed
from astrai.models import AutoRegressiveLM, tiny_config, tiny_tokenizer
from astrai.train import main
from astrai.trainer.loop import Callback, Trainer
from astrai.trainer.models import TrainedModel
from astrai.trainer.optim import build_optimizer, build_scheduler

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------------- losses
def test_dpo_loss_hand_computed():
    pc, pr = torch.tensor([-1.0, -3.0]), torch.tensor([-2.0, -1.0])
    rc, rr = torch.tensor([-1.5, -3.0]), torch.tensor([-1.8, -2.0])
    loss, m = dpo_loss(pc, pr, rc, rr, beta=0.1)
    z = [0.1 * ((-1.0 + 1.5) - (-2.0 + 1.8)), 0.1 * ((-3.0 + 3.0) - (-1.0 + 2.0))]  # 0.07, -0.1
    expected = sum(math.log1p(math.exp(-x)) for x in z) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert m["dpo/accuracy"].item() == 0.5 and m["dpo/margin"].item() == pytest.approx(sum(z) / 2, rel=1e-5)
    assert m["dpo/reward_chosen"].item() == pytest.approx((0.05 + 0.0) / 2, rel=1e-5)
    smoothed, _ = dpo_loss(pc, pr, rc, rr, beta=0.1, label_smoothing=0.2, num_pairs=4)
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    expected = sum(-0.8 * math.log(sig(x)) - 0.2 * math.log(sig(-x)) for x in z) / 4
    assert smoothed.item() == pytest.approx(expected, rel=1e-6)
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(pc, pr, rc, rr, beta=0.0)


def test_token_cross_entropy_matches_torch():
    torch.manual_seed(0)
    logits, labels = torch.randn(3, 5, 11), torch.randint(0, 11, (3, 5))
    labels[0, :2] = IGNORE_INDEX
    mask = labels != IGNORE_INDEX
    loss, _ = token_cross_entropy(logprobs_from_logits(logits, labels.clamp(min=0)), mask)
    expected = F.cross_entropy(logits.reshape(-1, 11), labels.reshape(-1), ignore_index=IGNORE_INDEX)
    torch.testing.assert_close(loss, expected)


# --------------------------------------------------------------------------------------------------- data
def test_chat_example_labels_exactly_the_assistant_turns():
    tok = tiny_tokenizer()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"}, {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4"}]
    ids, labels = chat_example(messages, tok, max_length=512)
    assert tok.decode(ids, skip_special_tokens=False) == tok.apply_chat_template(messages, add_generation_prompt=False)
    learned = tok.decode([t for t in labels if t != IGNORE_INDEX], skip_special_tokens=False)
    assert learned == "hello<|im_end|>\n4<|im_end|>\n"  # no stop set given: the whole turn
    ids, labels = chat_example(messages, tok, max_length=512, stops=(2,))
    learned = tok.decode([t for t in labels if t != IGNORE_INDEX], skip_special_tokens=False)
    assert learned == "hello<|im_end|>4<|im_end|>"
    with pytest.raises(DataError, match="no assistant"):
        chat_example([{"role": "user", "content": "hi"}], tok, max_length=512)
    with pytest.raises(DataError, match="role"):
        chat_example([{"role": "user"}], tok, max_length=512, where="x.jsonl row 3")


def test_packing_and_collation():
    examples = [([1, 2, 3], [1, 2, 3]), ([4, 5], [IGNORE_INDEX, 5]), ([6, 7, 8, 9], [6, 7, 8, 9])]
    rows = pack_examples(examples, max_length=4)
    # each document's first token in a row is no target (never predicted from another document); [9] has none
    assert rows == [([1, 2, 3, 4], [IGNORE_INDEX, 2, 3, IGNORE_INDEX], [0, 0, 0, 1]),
                    ([5, 6, 7, 8], [IGNORE_INDEX, IGNORE_INDEX, 7, 8], [0, 1, 1, 1])]
    batch = collate_lm([([1, 2, 3], [1, 2, 3]), ([4], [4])], pad_token_id=0)
    assert batch.input_ids.tolist() == [[1, 2, 3], [4, 0, 0]] and batch.document_ids is None
    assert batch.loss_mask.tolist() == [[True, True], [False, False]]
    packed = collate_lm(rows[1:] + [([9], [9], [0])], pad_token_id=0)
    assert packed.position_ids.tolist()[0] == [0, 0, 1, 2] and packed.document_ids.tolist()[1] == [0, -1, -1, -1]
    ids, labels = text_example("abc", tiny_tokenizer(), max_length=2)
    assert len(ids) == 2 and ids == labels


def test_records_through_datasets_jsonl_and_parquet(tmp_path):
    import datasets

    rows = [{"text": "a b", "n": 1}, {"text": "c", "n": 2}]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert load_records(path, {"data.text_field": "text"}) == [{"text": "a b"}, {"text": "c"}]
    parquet = tmp_path / "t.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(parquet))
    assert load_records(parquet, {"data.text_field": "text"}, optional={"x": "n"})[1] == {"text": "c", "n": 2}
    with pytest.raises(DataError) as err:
        load_records(path, {"data.messages_field": "messages"})
    assert "'messages' (data.messages_field)" in str(err.value) and "\n" not in str(err.value)
    (tmp_path / "x.csv").write_text("a\nhello\n")
    assert load_records(tmp_path / "x.csv", {"data.text_field": "a"}) == [{"a": "hello"}]
    (tmp_path / "x.txt").write_text("a\n1\n")
    with pytest.raises(DataError, match="unsupported file type '.txt'"):
        load_records(tmp_path / "x.txt", {"data.text_field": "a"})
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n\n{"text": "cut off\n')
    with pytest.raises(DataError) as err:  # the broken line is named by its number, in one line
        load_records(tmp_path / "bad.jsonl", {"data.text_field": "text"})
    assert f"{tmp_path / 'bad.jsonl'} line 3: invalid JSON" in str(err.value) and "\n" not in str(err.value)
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match="empty.jsonl: no records"):
        load_records(tmp_path / "empty.jsonl", {"data.text_field": "text"})
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(DataError, match="cannot read as json"):
        load_records(tmp_path / "bad.json", {"data.text_field": "text"})


def test_missing_field_exits_2_with_one_line(tiny_model_dir, tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "p", "chosen": "c"}) + "\n")
    code = main(["--config", str(REPO / "configs/examples/dpo.yaml"), "--model.path", str(tiny_model_dir),
                 "--data.path", str(data), "--train.output_dir", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "'rejected' (data.rejected_field)" in err and len(err.splitlines()) == 1, err


# -------------------------------------------------------------------------------- micro-batch invariance
class GradCapture(Callback):
    """Records the gradients the step seam is about to apply (after clipping with an unreachable norm)."""

    def __init__(self, model):
        self.model, self.grads = model, None

    def before_optimizer_step(self, trainer, name):
        self.grads = {n: p.grad.clone() for n, p in self.model.named_parameters() if p.grad is not None}


def _model():
    torch.manual_seed(0)
    return AutoRegressiveLM(tiny_config(hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                        num_key_value_heads=1))


def _grads(make_strategy, micro, accum):
    model, dist = _model(), setup_distributed("cpu")
    opt = build_optimizer(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    sched = build_scheduler(opt, name="constant", warmup_steps=0, total_steps=1)
    policy = TrainedModel(name="policy", module=model, optimizer=opt, scheduler=sched, dist=dist)
    capture = GradCapture(model)
    strategy = make_strategy(policy, micro, accum)
    strategy.train_step(Trainer(strategy, dist=dist, max_steps=1, max_grad_norm=1e9, callbacks=[capture]))
    return capture.grads


@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_token_and_pair_means_are_invariant_to_the_micro_batch_split(kind):
    from astrai.trainer.learners.dpo import DPOLearner
    from astrai.trainer.learners.sft import NextTokenLearner

    g = torch.Generator().manual_seed(1)
    lengths = [3, 9, 5, 2]
    if kind == "sft":
        data = [(ids, [IGNORE_INDEX] * (len(ids) // 2) + ids[len(ids) // 2:])
                for ids in (torch.randint(3, 200, (n,), generator=g).tolist() for n in lengths)]
    else:
        data = [(torch.randint(3, 200, (2,), generator=g).tolist(), torch.randint(3, 200, (n,), generator=g).tolist(),
                 torch.randint(3, 200, (n + 1,), generator=g).tolist()) for n in lengths]

    def make(policy, micro, accum):
        sampler = PromptSampler(data, shuffle=False)
        common = dict(policy=policy, sampler=sampler, micro_batch_size=micro, accumulation_steps=accum,
                      pad_token_id=2)
        if kind == "sft":
            return NextTokenLearner(**common)
        ref, noise = _model().eval().requires_grad_(False), torch.Generator().manual_seed(2)
        with torch.no_grad():
            for p in ref.parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=noise))
        return DPOLearner(ref_model=ref, beta=0.5, label_smoothing=0.0, **common)

    whole = _grads(make, 4, 1)
    for micro, accum in ((1, 4), (2, 2)):
        split = _grads(make, micro, accum)
        for name in whole:
            torch.testing.assert_close(split[name], whole[name], rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("packing", [False, True])
def test_sft_lm_head_at_labelled_positions_only_equals_the_full_logits(packing):
    """The sft/seq loss computes the LM head only where a label is not ignored; loss and gradients equal the
    cross-entropy of the full (B, S, V) logits."""
    from astrai.trainer.learners.sft import NextTokenLearner

    g = torch.Generator().manual_seed(3)
    data = [(ids, [IGNORE_INDEX] * (len(ids) // 2) + ids[len(ids) // 2:])
            for ids in (torch.randint(3, 200, (n,), generator=g).tolist() for n in (3, 9, 5, 2, 7, 4))]
    if packing:
        data = pack_examples(data, max_length=8)
    rows = 4 if packing else len(data)  # one micro-batch with every row of the step
    data = data[:rows]
    batch = collate_lm(data, pad_token_id=2)
    # the untouched path: logits at every position
    model = _model()
    logits = model(batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                   document_ids=batch.document_ids)
    logprobs = logprobs_from_logits(logits[:, :-1], batch.labels[:, 1:].clamp(min=0))
    loss, _ = token_cross_entropy(logprobs, batch.loss_mask)
    loss.backward()
    expected = {n: p.grad for n, p in model.named_parameters()}
    # the strategy's path, on the same initial weights
    model2, dist, head_rows = _model(), setup_distributed("cpu"), []
    model2.lm_head.register_forward_hook(lambda module, args, out: head_rows.append(tuple(args[0].shape)))
    opt = build_optimizer(model2.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    policy = TrainedModel(name="policy", module=model2, optimizer=opt, dist=dist,
                          scheduler=build_scheduler(opt, name="constant", warmup_steps=0, total_steps=1))
    capture = GradCapture(model2)
    strategy = NextTokenLearner(policy=policy, sampler=PromptSampler(data, shuffle=False), micro_batch_size=rows,
                                 accumulation_steps=1, pad_token_id=2)
    metrics = strategy.train_step(Trainer(strategy, dist=dist, max_steps=1, max_grad_norm=1e9, callbacks=[capture]))
    assert head_rows == [(int(batch.loss_mask.sum()), 32)]  # (N, H): no logits at ignored labels or padding
    assert int(batch.loss_mask.sum()) < batch.loss_mask.numel()
    torch.testing.assert_close(metrics["train/loss"], loss.detach(), rtol=1e-5, atol=1e-7)
    for name, grad in expected.items():
        torch.testing.assert_close(capture.grads[name], grad, rtol=1e-4, atol=1e-4 * float(grad.abs().max()))


# ------------------------------------------------------------------------------------------ offline grpo
def test_offline_grpo_uses_given_logprobs_else_the_old_policy(tiny_model_dir, tmp_path):
    from astrai.models import load_pretrained
    from astrai.forward import response_logprobs
    from astrai.trainer.learners.grpo import build_grpo

    tok = tiny_tokenizer()
    ids = [tok.encode("12") + [2], tok.encode("7") + [2]]
    rows = [{"prompt": "1+11?", "responses": ["12", "7"], "rewards": [1, 0], "response_ids": ids,
             "logprobs": [[-0.5] * len(ids[0]), [-0.25] * len(ids[1])]},
            {"prompt": "2+2?", "responses": ["4", "5"], "rewards": [0, 1]}]
    data = tmp_path / "g.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = load_config(str(REPO / "configs/examples/grpo_offline.yaml"),
                         ["--model.path", str(tiny_model_dir), "--data.path", str(data), "--data.shuffle", "false",
                          "--grpo.group_size", "2", "--grpo.minibatch_size", "4", "--grpo.micro_batch_size", "2",
                          "--data.system_prompt", "null"])
    policy, tokenizer = load_pretrained(str(tiny_model_dir))
    strategy = build_grpo(config, setup_distributed("cpu"), policy, tokenizer)
    rollout, _ = strategy.make_rollout(0)
    mask = rollout.sequences.action_mask
    assert torch.equal(rollout.old_logprobs[0][mask[0]], torch.full((len(ids[0]),), -0.5))
    fallback, _ = response_logprobs(policy, rollout.sequences.select(torch.tensor([2, 3])), temperature=1.0)
    torch.testing.assert_close(rollout.old_logprobs[2:], fallback.detach() * mask[2:])
    torch.testing.assert_close(rollout.advantages[:, 0], torch.tensor([1.0, -1.0, -1.0, 1.0]) / (2 ** 0.5 + 1e-6))
    bad = dict(rows[0], logprobs=[[-0.5], [-0.25]])
    data.write_text(json.dumps(bad) + "\n")
    with pytest.raises(DataError, match="one log-prob per response token"):
        build_grpo(config, setup_distributed("cpu"), policy, tokenizer)


def test_warmup_stable_decay_schedule():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = build_scheduler(opt, name="warmup_stable_decay", warmup_steps=2, total_steps=10, decay_ratio=0.25)
    factors = []
    for _ in range(10):
        factors.append(round(sched.get_last_lr()[0], 4))
        opt.step()
        sched.step()
    # progress (s - 2) / 8 reaches 1 after the last step (as for "linear"): the last quarter decays 1 -> 0.5 -> (0)
    assert factors == [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.5]


# ------------------------------------------------------------------------------------------ example configs
@pytest.mark.parametrize("name,extra,key", [
    ("sft", ["--train.gradient_accumulation_steps", "1", "--data.max_length", "96"], "train/loss"),
    ("sft", ["--data.packing", "true", "--data.max_length", "96", "--model.gradient_checkpointing", "true"],
     "train/loss"),
    ("dpo", ["--train.gradient_accumulation_steps", "1", "--data.truncation", "left"], "dpo/accuracy"),
    ("seq", ["--data.max_length", "64"], "train/loss"),
    ("grpo_offline", ["--data.shuffle", "false", "--grpo.epochs", "1", "--optim.learning_rate", "1e-4",
                      "--data.truncation", "left"], "policy/pg_loss"),
])
def test_example_config_one_step_changes_every_parameter(tiny_model_dir, tmp_path, name, extra, key):
    out = tmp_path / "run"
    code = main(["--config", str(REPO / f"configs/examples/{name}.yaml"), "--model.path", str(tiny_model_dir),
                 "--train.output_dir", str(out), "--max_steps", "1", "--train.progress_bar", "false", *extra])
    assert code == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 1 and math.isfinite(records[0][key]) and records[0]["policy_version"] == 1
    after = load_file(str(out / "checkpoints/step-00000001/model.safetensors"))
    before = load_file(str(tiny_model_dir / "model.safetensors"))
    unchanged = [k for k in before if torch.equal(before[k], after[k])]
    assert not unchanged, unchanged


@pytest.mark.parametrize("name,extra", [
    ("sft", ["--data.max_length", "96", "--train.gradient_accumulation_steps", "1"]),
    ("grpo", ["--rollout.batch_size", "2", "--grpo.minibatch_size", "4", "--grpo.micro_batch_size", "4",
              "--rollout.max_new_tokens", "4", "--reward.name", "toy_length", "--optim.learning_rate", "1e-3",
              "--data.truncation", "left"]),
])
def test_resume_matches_an_uninterrupted_run(tiny_model_dir, tmp_path, monkeypatch, name, extra):
    from astrai.rewards import builtins as rewards

    monkeypatch.setitem(rewards.BUILTIN_REWARDS, "toy_length", rewards.BuiltinReward(
        lambda prompts, completions, format_bonus=0.0, partial_credit=0.0, **_: [len(c) % 5 / 4 for c in completions],
        "toy: length mod 5"))
    base = ["--config", str(REPO / f"configs/examples/{name}.yaml"), "--model.path", str(tiny_model_dir),
            "--train.progress_bar", "false", *extra]
    assert main([*base, "--train.output_dir", str(tmp_path / "a"), "--max_steps", "3"]) == 0
    assert main([*base, "--train.output_dir", str(tmp_path / "b"), "--max_steps", "1"]) == 0
    assert main([*base, "--train.output_dir", str(tmp_path / "b"), "--max_steps", "3",
                 "--checkpoint.resume", "auto"]) == 0
    a = load_file(str(tmp_path / "a/checkpoints/step-00000003/model.safetensors"))
    b = load_file(str(tmp_path / "b/checkpoints/step-00000003/model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_prompt_without_room_for_a_response_names_the_row():
    """dpo and offline grpo share `prompt_ids_and_budget`: the budget is what max_length leaves after the prompt,
    and a prompt that leaves no room for a response is a one-line DataError naming the row (or dropped / cut
    under data.truncation)."""
    from types import SimpleNamespace

    from astrai.data.truncation import prompt_ids_and_budget

    tok = tiny_tokenizer()
    data = SimpleNamespace(system_prompt=None, chat_template=None, max_prompt_length=64, max_length=200,
                           truncation="error")
    ids, budget = prompt_ids_and_budget("what is 2 + 2?", tok, data, "pairs.jsonl row 3")
    assert ids and budget == 200 - len(ids)
    data.max_length = len(ids)
    with pytest.raises(DataError, match=r"^pairs\.jsonl row 3: the prompt is \d+ tokens, more than "
                                        r"data\.max_length - 1 \(room for a response\)="):
        prompt_ids_and_budget("what is 2 + 2?", tok, data, "pairs.jsonl row 3")
    data.truncation = "filter"
    assert prompt_ids_and_budget("what is 2 + 2?", tok, data, "pairs.jsonl row 3") is None
    data.truncation = "left"
    cut, budget = prompt_ids_and_budget("what is 2 + 2?", tok, data, "pairs.jsonl row 3")
    assert budget == 1 and cut[:3] == ids[:3] and cut[-5:] == ids[-5:]
