"""Item: a chat model whose turns end with a token other than the tokenizer's EOS. The stop set is the tokenizer's
EOS plus every id of config.json / generation_config.json (and a GGUF end-of-turn id); rollouts stop on it, sft
labels and dpo / offline grpo responses end with the template's end of turn, the reward text drops the stop
token, and a checkpoint's config.json keeps the whole list."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from astrai.config import load_config
from astrai.data.examples import IGNORE_INDEX, chat_example
from astrai.distributed import setup_distributed
from astrai.models import AutoRegressiveLM, Tokenizer, hf_state_dict, load_pretrained, tiny_config, tiny_tokenizer
from astrai.models.loading import _gguf_config

REPO = Path(__file__).resolve().parents[1]
ENDOFTEXT, IM_END = 0, 2


def always_im_end(model: AutoRegressiveLM) -> AutoRegressiveLM:
    """Weights that make the model emit <|im_end|> after any token: blocks add nothing, every embedding is the
    same vector, and only the LM head row of <|im_end|> is non-zero."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.fill_(1.0)
        model.lm_head.weight.zero_()
        model.lm_head.weight[IM_END] = 1.0
    return model


@pytest.fixture()
def chat_model_dir(tmp_path):
    """An HF directory whose tokenizer says eos_token=<|endoftext|> (id 0) while ChatML turns end with <|im_end|>
    (id 2); config.json has eos_token_id 0 and generation_config.json [2, 0]."""
    path = tmp_path / "chat-model"
    path.mkdir()
    model = always_im_end(AutoRegressiveLM(tiny_config(eos_token_id=ENDOFTEXT, pad_token_id=ENDOFTEXT)))
    save_file({k: v.contiguous() for k, v in hf_state_dict(model).items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(model.config.to_hf_dict()))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [IM_END, ENDOFTEXT]}))
    tiny = tiny_tokenizer()
    Tokenizer(tiny.backend, chat_template=tiny.chat_template, bos_token="<|im_start|>", eos_token="<|endoftext|>",
              pad_token="<|endoftext|>").save(path)
    return path


def test_rollouts_stop_on_every_config_eos_id(chat_model_dir):
    from toy_rl import built_online_experience, next_prompts

    config = load_config(str(REPO / "configs/examples/grpo.yaml"),
                         ["--model.path", str(chat_model_dir), "--rollout.max_new_tokens", "8",
                          "--data.max_prompt_length", "240", "--data.system_prompt", "null"])
    policy, tokenizer = load_pretrained(chat_model_dir)
    experience = built_online_experience(config, policy, tokenizer)
    runner = experience.runner
    prompt_ids, answers = next_prompts(experience, 2)
    experience = runner.collect(prompt_ids, answers, torch.Generator().manual_seed(0))
    mask = experience.sequences.action_mask
    assert mask.sum(-1).tolist() == [1, 1]  # the sampled <|im_end|> ends each response (8 on the old code)
    response = experience.sequences.input_ids[:, experience.sequences.prompt_length]
    assert response.tolist() == [IM_END, IM_END] and experience.responses == ("", "")
    assert tokenizer.eos_token_id == ENDOFTEXT and policy.config.eos_token_id == [ENDOFTEXT, IM_END]
    assert runner.sampling.stop_token_ids == (ENDOFTEXT, IM_END)


def test_checkpoint_config_json_keeps_the_eos_list(chat_model_dir, tmp_path):
    from astrai.checkpoint import Part, publish_checkpoint

    policy, tokenizer = load_pretrained(chat_model_dir)
    path = publish_checkpoint(tmp_path / "out", 1, {"policy": Part(policy, "hf_model"),
                                                    "tokenizer": Part(tokenizer, "hf_tokenizer", required=False)})
    assert json.loads((path / "config.json").read_text())["eos_token_id"] == [ENDOFTEXT, IM_END]
    again, _ = load_pretrained(path)
    assert again.config.eos_token_id == [ENDOFTEXT, IM_END]
    transformers = pytest.importorskip("transformers")
    assert transformers.LlamaConfig.from_pretrained(path).eos_token_id == [ENDOFTEXT, IM_END]


def test_sft_labels_end_at_the_end_of_turn_stop_token():
    tok = tiny_tokenizer()
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    ids, labels = chat_example(messages, tok, max_length=None, stops=(ENDOFTEXT, IM_END))
    learned = [t for t in labels if t != IGNORE_INDEX]
    assert tok.decode(learned, skip_special_tokens=False) == "hello<|im_end|>4<|im_end|>"
    assert labels[-1] == IGNORE_INDEX and tok.decode(ids[-1:]) == "\n"  # the template's newline is not learned


def test_dpo_and_offline_grpo_responses_end_with_the_turn_end(chat_model_dir, tmp_path):
    from astrai.trainer.learners.dpo import build_dpo
    from astrai.trainer.learners.grpo import build_grpo

    dist = setup_distributed("cpu")
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "1+1?", "chosen": "2", "rejected": "3"}) + "\n")
    config = load_config(str(REPO / "configs/examples/dpo.yaml"),
                         ["--model.path", str(chat_model_dir), "--data.path", str(pairs)])
    policy, tokenizer = load_pretrained(chat_model_dir)
    prompt, chosen, rejected = build_dpo(config, dist, policy, tokenizer).data_sampler.dataset[0]
    assert chosen[-1] == IM_END and rejected[-1] == IM_END
    groups = tmp_path / "groups.jsonl"
    groups.write_text(json.dumps({"prompt": "1+1?", "responses": ["2", "3"], "rewards": [1, 0]}) + "\n")
    config = load_config(str(REPO / "configs/examples/grpo_offline.yaml"),
                         ["--model.path", str(chat_model_dir), "--data.path", str(groups), "--grpo.group_size", "2",
                          "--grpo.minibatch_size", "2", "--grpo.micro_batch_size", "2", "--rollout.batch_size", "1"])
    policy, tokenizer = load_pretrained(chat_model_dir)
    record = build_grpo(config, dist, policy, tokenizer).data_sampler.dataset[0]
    assert [ids[-1] for ids in record.response_ids] == [IM_END, IM_END]


def test_gguf_end_of_turn_joins_the_eos_list(tmp_path):
    meta = {"general.architecture": "llama", "llama.attention.head_count": 4, "llama.embedding_length": 64,
            "llama.feed_forward_length": 128, "llama.block_count": 2, "llama.vocab_size": 283,
            "tokenizer.ggml.eos_token_id": ENDOFTEXT, "tokenizer.ggml.eot_token_id": IM_END}
    assert _gguf_config(meta, tmp_path / "x.gguf").eos_token_id == [ENDOFTEXT, IM_END]
    del meta["tokenizer.ggml.eot_token_id"]
    assert _gguf_config(meta, tmp_path / "x.gguf").eos_token_id == ENDOFTEXT
