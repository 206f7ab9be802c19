"""Items: overlong prompts (`data.truncation` for online prompts and dpo / offline grpo prompts), length budgets
beyond the model's context, and token ids outside the embedding. Each bad input stops at start-up or load time
with a one-line error and exit code 2."""

import json
from pathlib import Path

import pytest
from safetensors.torch import save_file

from astrai.config import load_config
from astrai.data import DataError
from astrai.distributed import setup_distributed
from astrai.models import AutoRegressiveLM, hf_state_dict, load_pretrained, tiny_config, tiny_tokenizer
from astrai.train import main

REPO = Path(__file__).resolve().parents[1]
SYSTEM = "Be brief."
LONG = " ".join(f"word{i}" for i in range(120)) + " What is 2 + 2?"  # ~250 tokens of the tiny tokenizer
from toy_rl import built_online_experience, next_prompts


def prompts_file(tmp_path, questions):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"question": q, "answer": "#### 4"}) + "\n" for q in questions))
    return path


def online_experience(model_dir, data, *extra):
    config = load_config(str(REPO / "configs/examples/grpo.yaml"),
                         ["--model.path", str(model_dir), "--data.path", str(data), "--data.shuffle", "false",
                          "--data.system_prompt", SYSTEM, *extra])
    policy, tokenizer = load_pretrained(model_dir)
    return built_online_experience(config, policy, tokenizer)


# ------------------------------------------------------------------------------------------ data.truncation
def test_left_truncation_cuts_the_question_and_keeps_the_chat_head(tiny_model_dir, tmp_path):
    tok = tiny_tokenizer()
    data = prompts_file(tmp_path, [LONG])
    assert len(tok.encode(LONG)) > 240
    experience = online_experience(tiny_model_dir, data, "--data.max_prompt_length", "48",
                                   "--data.truncation", "left")
    (ids,), _ = next_prompts(experience, 1)
    text = tok.decode(ids, skip_special_tokens=False)
    head = f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n"
    assert len(ids) == 48 and text.startswith(head), text
    assert text.endswith("What is 2 + 2?<|im_end|>\n<|im_start|>assistant\n")
    assert ids[-len(tok.encode("2?<|im_end|>\n<|im_start|>assistant\n")):] == \
        tok.encode("2?<|im_end|>\n<|im_start|>assistant\n")


def test_filter_drops_overlong_prompts_at_load_time_and_says_how_many(tiny_model_dir, tmp_path, capsys):
    data = prompts_file(tmp_path, ["1 + 1?", LONG, "2 + 2?"])
    experience = online_experience(tiny_model_dir, data, "--data.max_prompt_length", "64",
                                   "--data.truncation", "filter")
    assert "dropped 1 of 3 prompts" in capsys.readouterr().out
    assert len(experience.data_sampler.dataset) == 2
    ids, _ = next_prompts(experience, 4)
    assert all(len(x) <= 64 for x in ids)


def test_error_names_file_row_and_lengths_and_exits_2(tiny_model_dir, tmp_path, capsys):
    data = prompts_file(tmp_path, ["1 + 1?", LONG])
    code = main(["--config", str(REPO / "configs/examples/ppo.yaml"), "--model.path", str(tiny_model_dir),
                 "--data.path", str(data), "--train.output_dir", str(tmp_path / "o"), "--data.max_prompt_length",
                 "160", "--train.progress_bar", "false"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"{data} row 2: the prompt is" in err and "more than data.max_prompt_length=160" in err
    assert not (tmp_path / "o" / "checkpoints").exists()


def test_fit_prompt_cuts_only_question_tokens():
    from astrai.data.truncation import fit_prompt

    ids, question = list(range(10)), (3, 8)  # template 0-2, question 3-7, template 8-9
    kw = dict(limit_name="data.max_prompt_length", where="p.jsonl row 1")
    assert fit_prompt(ids, question, limit=10, policy="error", **kw) == ids
    assert fit_prompt(ids, question, limit=7, policy="left", **kw) == [0, 1, 2, 6, 7, 8, 9]
    assert fit_prompt(ids, question, limit=7, policy="filter", **kw) is None
    with pytest.raises(DataError, match=r"^p\.jsonl row 1: the prompt is 10 tokens and all but 5 of them"):
        fit_prompt(ids, question, limit=5, policy="left", **kw)
    with pytest.raises(DataError, match="rewrites the question"):
        fit_prompt(ids, None, limit=7, policy="left", **kw)


def test_offline_prompts_follow_the_same_policy(tiny_model_dir, tmp_path, capsys):
    from astrai.trainer.learners.dpo import build_dpo

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": p, "chosen": "4", "rejected": "5"}) + "\n"
                             for p in ("2 + 2?", LONG, "1 + 3?")))
    args = ["--model.path", str(tiny_model_dir), "--data.path", str(pairs), "--data.system_prompt", SYSTEM]
    policy, tokenizer = load_pretrained(tiny_model_dir)
    config = load_config(str(REPO / "configs/examples/dpo.yaml"), args)
    with pytest.raises(DataError, match=rf"^{pairs} row 2: the prompt is \d+ tokens, more than "
                                        r"data\.max_prompt_length=128"):
        build_dpo(config, setup_distributed("cpu"), policy, tokenizer)
    config = load_config(str(REPO / "configs/examples/dpo.yaml"), args + ["--data.truncation", "filter"])
    assert len(build_dpo(config, setup_distributed("cpu"), policy, tokenizer).data_sampler.dataset) == 2
    assert "dropped 1 of 3 records" in capsys.readouterr().out
    config = load_config(str(REPO / "configs/examples/dpo.yaml"), args + ["--data.truncation", "left"])
    prompt, chosen, _ = build_dpo(config, setup_distributed("cpu"), policy, tokenizer).data_sampler.dataset[1]
    text = tokenizer.decode(prompt, skip_special_tokens=False)
    assert len(prompt) == 128 and text.startswith(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n")
    assert text.endswith("word119 What is 2 + 2?<|im_end|>\n<|im_start|>assistant\n") and "word0 " not in text


# ------------------------------------------------------------------------------------- context length budget
@pytest.mark.parametrize("config_name,extra,fields", [
    ("ppo.yaml", ["--data.max_prompt_length", "240", "--rollout.max_new_tokens", "48"],
     "data.max_prompt_length (240) + rollout.max_new_tokens (48) = 288 exceeds max_position_embeddings (256)"),
    ("sft.yaml", ["--data.max_length", "512"], "data.max_length (512) exceeds max_position_embeddings (256)"),
    ("seq.yaml", ["--data.max_length", "300"], "data.max_length (300) exceeds max_position_embeddings (256)"),
    ("dpo.yaml", ["--data.max_length", "257"], "data.max_length (257) exceeds max_position_embeddings (256)"),
])
def test_budgets_beyond_the_context_exit_2_at_start_up(tiny_model_dir, tmp_path, capsys, config_name, extra,
                                                       fields):
    code = main(["--config", str(REPO / "configs/examples" / config_name), "--model.path", str(tiny_model_dir),
                 "--train.output_dir", str(tmp_path / "o"), "--max_steps", "1", "--train.progress_bar", "false",
                 "--data.truncation", "left", *extra])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and fields in err, err


# ------------------------------------------------------------------------------------------- vocabulary
def test_tokenizer_larger_than_the_embedding_exits_2(tmp_path, capsys):
    from tokenizers import AddedToken

    path = tmp_path / "model"
    path.mkdir()
    model = AutoRegressiveLM(tiny_config())
    save_file({k: v.contiguous() for k, v in hf_state_dict(model).items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(model.config.to_hf_dict()))
    tok = tiny_tokenizer()
    tok.backend.add_tokens([AddedToken("<tool>", special=False, normalized=False)])
    tok.save(path)
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                              {"role": "assistant", "content": "<tool> ok"}]}) + "\n")
    code = main(["--config", str(REPO / "configs/examples/sft.yaml"), "--model.path", str(path),
                 "--data.path", str(chats), "--train.output_dir", str(tmp_path / "o"), "--max_steps", "1",
                 "--train.progress_bar", "false"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"the tokenizer has {tok.vocab_size} tokens" in err and "vocab_size=283" in err


@pytest.mark.parametrize("bad,shown", [(999, "999"), (-1, "-1"), (2.5, "2.5"), (True, "True")])
def test_pretokenised_response_ids_are_checked_at_load_time(tiny_model_dir, tmp_path, bad, shown):
    from astrai.trainer.learners.grpo import build_grpo

    rows = [{"prompt": "1+1?", "responses": ["2", "3"], "rewards": [1, 0], "response_ids": [[50, 2], [51, 2]]},
            {"prompt": "2+2?", "responses": ["4", "5"], "rewards": [1, 0], "response_ids": [[52, 2], [53, bad, 2]]}]
    data = tmp_path / "groups.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = load_config(str(REPO / "configs/examples/grpo_offline.yaml"),
                         ["--model.path", str(tiny_model_dir), "--data.path", str(data), "--grpo.group_size", "2",
                          "--grpo.minibatch_size", "2", "--grpo.micro_batch_size", "2", "--rollout.batch_size", "1"])
    policy, tokenizer = load_pretrained(tiny_model_dir)
    with pytest.raises(DataError) as err:
        build_grpo(config, setup_distributed("cpu"), policy, tokenizer)
    assert str(err.value) == (f"{data} row 2: field 'response_ids[1]'[1] = {shown} is not a token id of the "
                              f"vocabulary [0, 283)")


def test_pretokenised_ids_within_the_vocabulary_train(tiny_model_dir, tmp_path):
    rows = [{"prompt": "1+1?", "responses": ["2", "3"], "rewards": [1, 0], "response_ids": [[50, 2], [282, 2]]}]
    data = tmp_path / "groups.jsonl"
    data.write_text(json.dumps(rows[0]) + "\n")
    code = main(["--config", str(REPO / "configs/examples/grpo_offline.yaml"), "--model.path", str(tiny_model_dir),
                 "--data.path", str(data), "--grpo.group_size", "2", "--grpo.minibatch_size", "2",
                 "--grpo.micro_batch_size", "2", "--rollout.batch_size", "1", "--max_steps", "1",
                 "--train.output_dir", str(tmp_path / "o"), "--train.progress_bar", "false"])
    assert code == 0 and (tmp_path / "o/checkpoints/step-00000001/model.safetensors").is_file()
