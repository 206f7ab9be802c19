"""Tensor-parallel rollout engine (astrai/rollout/tensor_parallel.py) and the device mesh
(astrai/distributed/context.py), at 2 ranks over gloo on CPU: for tiny Llama (untied head, q/k/v/o and MLP biases,
llama3 rotary), Qwen3 (q/k norms, GQA 4:2, head_dim unlike H / Nh) and Gemma 3 (sliding windows shorter than the
sequences, one KV head: replicated on both ranks, soft-capped scores and logits, scaled and offset norms) models,
every rank's engine is compared with a whole (TP=1) engine of the same weights built on the same rank."""

import os
import socket
import traceback

import pytest
import torch
from spawn_ranks import spawn_ranks

from astrai.models import AutoRegressiveLM, ModelConfig
from astrai.rollout.sampling import SamplingParams

WORLD = 2
BASE = dict(vocab_size=283, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
            pad_token_id=2)
FAMILIES = {
    "llama": dict(model_type="llama", rope_theta=500000.0, attention_bias=True, mlp_bias=True,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen3": dict(model_type="qwen3", head_dim=32, rope_theta=1e6, qk_norm=True, tie_word_embeddings=True),
    "gemma3": dict(model_type="gemma3_text", num_hidden_layers=3, num_key_value_heads=1, head_dim=32,
                   tie_word_embeddings=True, qk_norm=True, hidden_act="gelu_pytorch_tanh", rope_theta=1e6,
                   rope_scaling={"rope_type": "linear", "factor": 2.0}, sliding_window=32,
                   layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                   sliding_rope_theta=1e4, query_pre_attn_scalar=24.0, attn_logit_softcapping=5.0,
                   final_logit_softcapping=30.0, norm_unit_offset=True, post_sublayer_norms=True,
                   scale_embeddings=True),
}
PROMPTS = [[5, 9, 33, 70, 101], [3 + (7 * i) % 250 for i in range(20)], [3 + (7 * i) % 250 for i in range(16)] + [4, 8]]
NEW_TOKENS = 40  # prompt + response run past Gemma 3's 32-key window


def tiny_model(family: str, seed: int = 0) -> AutoRegressiveLM:
    """A random model of `family` with weights at a scale where logits are O(5) (std 0.15; norms 1 +- 0.2, Gemma's
    offsets 0 +- 0.2), so a wrong head, slice or sum shows as a difference of order 1."""
    torch.manual_seed(seed)
    model = AutoRegressiveLM(ModelConfig(**{**BASE, **FAMILIES[family]})).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_((0.0 if family == "gemma3" else 1.0) + 0.2 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.15)
    return model


def weight_bytes(engine) -> int:
    """Bytes of the distinct storages behind an engine copy's parameters (fused q/k/v views counted once)."""
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in engine.model.parameters()}
    return sum(storages.values())


def _generate(engine, params, seed):
    out = engine.generate(PROMPTS, params, torch.Generator().manual_seed(seed), n=2)
    return {"tokens": out.response_ids.tolist(), "logprobs": out.old_logprobs.tolist(),
            "mask": out.action_mask.tolist()}


def _family_run(family, dist, rank):
    from astrai.rollout.paged_engine import PagedGenerationEngine

    model = tiny_model(family)
    whole = PagedGenerationEngine(model, pad_token_id=2, backend="torch")
    split = PagedGenerationEngine(model, pad_token_id=2, backend="torch", tp_group=dist.tp_group)
    greedy, sampled = SamplingParams(NEW_TOKENS, top_k=1), SamplingParams(NEW_TOKENS, temperature=1.0)
    out = {"greedy": [_generate(e, greedy, 0) for e in (whole, split)],
           # rank 1 passes another generator: the group agrees on rank 0's seed
           "sampled": [_generate(whole, sampled, 7), _generate(split, sampled, 7 + 100 * rank)],
           "bytes": [weight_bytes(whole), weight_bytes(split)],
           "kv": [whole.workspace.k_caches[0].shape[2], split.workspace.k_caches[0].shape[2]],
           "kv_bytes": [whole.workspace.nbytes, split.workspace.nbytes],
           # the engines copied the policy: its own parameters are whole and unchanged
           "source_intact": all(torch.equal(a, b) for a, b in zip(model.parameters(), tiny_model(family).parameters()))}
    if family == "llama":  # a bfloat16 copy: its collectives run in bfloat16, and the ranks still agree bit for bit
        half = PagedGenerationEngine(model, pad_token_id=2, backend="torch", tp_group=dist.tp_group, dtype="bfloat16")
        out["bf16"] = _generate(half, sampled, 3)
    torch.manual_seed(5)  # the same change on every rank, as a gathered parameter is the same everywhere
    changed = {name: p.detach() + 0.05 * torch.randn_like(p)
               for name, p in model.named_parameters(remove_duplicate=False)}
    whole.load_weights(changed, policy_version=1)
    split.load_weights(((name, t) for name, t in changed.items()), policy_version=1)  # streamed, full tensors
    out["synced"] = [_generate(e, greedy, 0) for e in (whole, split)]
    try:
        split.load_weights({**changed, "model.layers.0.mlp.down_proj.weight": torch.zeros(64, 64)}, 2)
        out["bad_shape"] = None
    except ValueError as err:
        out["bad_shape"] = str(err)
    out["version_after_bad"] = split.policy_version
    try:  # ranks asking for other prompts: refused on both in one line, before any step could hang
        split.generate([[5 + rank, 6, 7]], greedy)
        out["mismatch"] = None
    except ValueError as err:
        out["mismatch"] = str(err)
    try:
        split.add_request(PROMPTS[0], greedy)
        out["stream"] = None
    except RuntimeError as err:
        out["stream"] = str(err)
    return out


def _worker(rank, tmp, results):
    port = (tmp / "port").read_text()
    os.environ.update(OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    out = {}
    dist = None
    try:
        from astrai.data import PromptRecord, PromptSampler
        from astrai.distributed import setup_distributed

        dist = setup_distributed("cpu", "ddp", tensor_parallel_size=2)
        out["mesh"] = [dist.tp_size, dist.dp_rank, dist.dp_size, torch.distributed.get_world_size(dist.tp_group)]
        records = [PromptRecord(prompt=f"q{i}", answer="", index=i) for i in range(10)]
        sampler = PromptSampler(records, seed=3, rank=dist.dp_rank, world_size=dist.dp_size)
        out["prompts"] = [r.index for r in sampler.next_batch(4)]
        for family in FAMILIES:
            out[family] = _family_run(family, dist, rank)
    except Exception:  # noqa: BLE001 - reported to the parent
        out["error"] = traceback.format_exc()
    results.put((rank, out))
    if dist is not None:
        dist.shutdown()


def _mesh_worker(rank, tmp, results):
    """Rank `rank` of 4 with tensor_parallel_size 2: its groups and its prompts."""
    os.environ.update(OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=(tmp / "port").read_text(),
                      RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="4", LOCAL_WORLD_SIZE="4")
    out, dist = {}, None
    try:
        from astrai.data import PromptRecord, PromptSampler
        from astrai.distributed import setup_distributed

        dist = setup_distributed("cpu", "ddp", tensor_parallel_size=2)
        out["groups"] = [dist.dp_rank, dist.dp_size, torch.distributed.get_process_group_ranks(dist.tp_group)]
        records = [PromptRecord(prompt=f"q{i}", answer="", index=i) for i in range(12)]
        sampler = PromptSampler(records, seed=3, rank=dist.dp_rank, world_size=dist.dp_size)
        out["prompts"] = [r.index for r in sampler.next_batch(3)]
        total = torch.tensor([float(rank)])
        torch.distributed.all_reduce(total, group=dist.tp_group)  # the group's collectives reach its ranks only
        out["tp_sum"] = float(total)
    except Exception:  # noqa: BLE001 - reported to the parent
        out["error"] = traceback.format_exc()
    results.put((rank, out))
    if dist is not None:
        dist.shutdown()


def test_mesh_of_four_ranks_pairs_neighbours_and_shares_prompts_per_pair(tmp_path):
    (tmp_path / "port").write_text(_free_port())
    outs = spawn_ranks(_mesh_worker, tmp_path, 4, timeout=300)
    for rank in range(4):
        first = rank - rank % 2
        assert outs[rank]["groups"] == [rank // 2, 2, [first, first + 1]]
        assert outs[rank]["tp_sum"] == 2 * first + 1
    assert outs[0]["prompts"] == outs[1]["prompts"] and outs[2]["prompts"] == outs[3]["prompts"]
    assert not set(outs[0]["prompts"]) & set(outs[2]["prompts"])  # the two data-parallel groups: disjoint shares


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp")
    (tmp / "port").write_text(_free_port())
    return spawn_ranks(_worker, tmp, WORLD, timeout=600)


def test_mesh_groups_both_ranks_and_shares_prompts(two_ranks):
    for rank in range(WORLD):
        assert two_ranks[rank]["mesh"] == [2, 0, 1, 2]  # one TP group of 2, one data-parallel group
    assert two_ranks[0]["prompts"] == two_ranks[1]["prompts"]  # the TP group's ranks draw the same prompts
    assert len(set(two_ranks[0]["prompts"])) == 4


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_tokens_and_logprobs_match_one_rank(two_ranks, family):
    for rank in range(WORLD):
        for phase in ("greedy", "synced"):  # synced: after the same weight change streamed into both engines
            whole, split = two_ranks[rank][family][phase]
            assert split["tokens"] == whole["tokens"], (rank, phase)
            assert split["mask"] == whole["mask"]
            torch.testing.assert_close(torch.tensor(split["logprobs"]), torch.tensor(whole["logprobs"]),
                                       atol=1e-5, rtol=0)
    # bit-identical behaviour log-probs on the two ranks of the group
    assert two_ranks[0][family]["greedy"][1] == two_ranks[1][family]["greedy"][1]
    # the change moved the tokens (the sync is not a no-op)
    assert two_ranks[0][family]["synced"][0]["tokens"] != two_ranks[0][family]["greedy"][0]["tokens"]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_sampled_tokens_agree_across_ranks_and_with_one_rank(two_ranks, family):
    split0, split1 = two_ranks[0][family]["sampled"][1], two_ranks[1][family]["sampled"][1]
    assert split0 == split1  # tokens and log-probs, bit for bit, though rank 1's generator seed differed
    whole = two_ranks[0][family]["sampled"][0]
    assert split0["tokens"] == whole["tokens"]
    torch.testing.assert_close(torch.tensor(split0["logprobs"]), torch.tensor(whole["logprobs"]), atol=1e-5, rtol=0)
    assert any(t != row[0] for row in whole["tokens"] for t in row)  # really sampled, not one token repeated
    if family == "llama":
        assert two_ranks[0][family]["bf16"] == two_ranks[1][family]["bf16"]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_rank_holds_its_slice_and_its_kv_heads(two_ranks, family):
    config = ModelConfig(**{**BASE, **FAMILIES[family]})
    for rank in range(WORLD):
        out = two_ranks[rank][family]
        whole_bytes, split_bytes = out["bytes"]
        assert split_bytes <= 0.55 * whole_bytes, (family, split_bytes / whole_bytes)
        whole_kv, split_kv = out["kv"]
        assert whole_kv == config.num_key_value_heads
        assert split_kv == max(config.num_key_value_heads // WORLD, 1)  # Gemma 3's one KV head: replicated
        assert out["kv_bytes"][1] * whole_kv == out["kv_bytes"][0] * split_kv
        assert "down_proj.weight" in out["bad_shape"] and "(64, 128)" in out["bad_shape"]
        assert out["version_after_bad"] == 1  # refused before any copy: weights and version kept
        assert out["source_intact"]
        assert out["stream"].startswith("add_request: the streaming API is not supported on a tensor-parallel")
        assert out["mismatch"].startswith("rollout.tensor_parallel_size: rank 1 of a tensor-parallel group asked "
                                          "its engine for other prompts") and "must return the same" in out["mismatch"]


def test_bad_sizes_are_refused_in_one_line():
    from astrai.distributed.context import check_mesh
    from astrai.distributed.launch import LaunchError
    from astrai.rollout.engine_settings import check_paged_engine
    from astrai.rollout.tensor_parallel import check_tensor_parallel

    config = ModelConfig(**BASE)
    with pytest.raises(LaunchError, match=r"^rollout\.tensor_parallel_size: 3 does not divide the world size 4"):
        check_mesh(4, 3)
    with pytest.raises(ValueError, match=r"^rollout\.tensor_parallel_size: 8 does not divide num_attention_heads 4"):
        check_paged_engine(config, device="cpu", tensor_parallel_size=8)
    odd_kv = ModelConfig(**{**BASE, "num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 96})
    with pytest.raises(ValueError, match=r"^rollout\.tensor_parallel_size: 2 is neither a divisor nor a multiple "
                                         r"of num_key_value_heads 3"):
        check_tensor_parallel(odd_kv, 2)
    with pytest.raises(ValueError, match="intermediate_size 129"):
        check_tensor_parallel(ModelConfig(**{**BASE, "intermediate_size": 129}), 2)
    with pytest.raises(ValueError, match="mixture-of-experts"):
        check_tensor_parallel(ModelConfig(**{**BASE, "num_local_experts": 4}), 2)
    with pytest.raises(ValueError, match="not yet supported"):
        check_paged_engine(config, device="cpu", tensor_parallel_size=2, cuda_graphs=True)
    check_tensor_parallel(config, 2)  # 4 heads, 2 KV heads, 128 wide: splits
    # the job's field: refused in one line at --check (heads) and by the config itself (not a positive integer)
    from astrai.config import ConfigError, load_config
    from astrai.rollout.build import check_rollout_engine

    job = load_config(None, ["--rollout.tensor_parallel_size", "8", "--rollout.attention_backend", "torch"])
    with pytest.raises(ValueError, match=r"^rollout\.tensor_parallel_size: 8 does not divide num_attention_heads 4$"):
        check_rollout_engine(job, config, torch.device("cpu"))
    other = load_config(None, ["--rollout.tensor_parallel_size", "2", "--rollout.engine", "reference"])
    with pytest.raises(ValueError, match=r"^rollout\.tensor_parallel_size: 2 needs rollout\.engine 'paged'"):
        check_rollout_engine(other, config, torch.device("cpu"))
    with pytest.raises(ConfigError, match="rollout.tensor_parallel_size"):
        load_config(None, ["--rollout.tensor_parallel_size", "0"])
    check_rollout_engine(load_config(None, ["--rollout.tensor_parallel_size", "2", "--rollout.attention_backend",
                                            "torch"]), config, torch.device("cpu"))
    check_tensor_parallel(ModelConfig(**{**BASE, "num_key_value_heads": 1}), 4)  # KV head replicated 4 times
    check_mesh(4, 1)


REWARD = '''def lengthy(prompts, completions, **kwargs):
    """A reward with spread on a random model: the response's length in characters, mod 5, over 4."""
    return [float(len(c) % 5) / 4 for c in completions]
'''
TIMING = ("time/", "s/step")


def _online_grpo_job(tmp, model_dir) -> str:
    """configs/examples/grpo.yaml on the tiny model with a reward that varies within groups (a KL term on, so the
    reference is scored too), 2 rollouts of 2 prompts x 4 samples, each trained on in two minibatches (an optimizer
    step each: 4 steps), 12 new tokens."""
    import yaml

    from test_distributed import REPO

    job = yaml.safe_load((REPO / "configs" / "examples" / "grpo.yaml").read_text())
    (tmp / "reward.py").write_text(REWARD)
    job["model"]["path"] = str(model_dir)
    job["data"].update(truncation="left", max_prompt_length=128)
    job["reward"] = {"functions": [{"function": "lengthy", "path": str(tmp / "reward.py")}], "num_workers": 0}
    job["rollout"]["max_new_tokens"] = 12
    job["grpo"].update(minibatch_size=4, micro_batch_size=2)  # two minibatches: their order must match too
    job["optim"]["learning_rate"] = 1e-3  # the second step's rollout sees the first step's change
    job["train"].update(max_steps=4, progress_bar=False)
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return str(path)


def test_online_grpo_with_rollout_tp2_under_fsdp2_matches_one_process(tiny_model_dir, tmp_path):
    """2 ranks, fsdp2, rollout.tensor_parallel_size 2 (one data-parallel group: both ranks draw one process's
    prompts, generate them together and train on them) against one process with a whole engine: the same rewards,
    losses, KL and gradient norms at every step (the second rollout after a weight sync), and the same in-training
    evaluations (both ranks of the group evaluate the same questions on the split engine; counted once)."""
    import json
    import sys

    from test_distributed import ZERO, free_port, launched

    job = _online_grpo_job(tmp_path, tiny_model_dir)
    evaluated = ("--train.eval_steps", "2", "--data.eval_path", "builtin:arithmetic_test", "--data.eval_limit", "3")
    one = launched({}, sys.executable, "-m", "astrai.train", "--config", job, "--train.output_dir", tmp_path / "one",
                   *evaluated)
    assert one.returncode == 0, one.stderr[-3000:]
    two = launched({}, sys.executable, "-m", "accelerate.commands.launch", "--config_file", ZERO / "fsdp2.yaml",
                   "--main_process_port", free_port(), "-m", "astrai.train", "--config", job,
                   "--train.output_dir", tmp_path / "two", "--rollout.tensor_parallel_size", "2", *evaluated)
    assert two.returncode == 0, two.stderr[-3000:]
    records = [[json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
               for run in ("one", "two")]
    assert [r["step"] for r in records[1]] == [1, 2, 3, 4]
    assert records[1][1]["eval/num_questions"] == 3  # the group evaluates its questions together, counted once
    assert records[0][0]["rollout/reward_std"] > 0 and records[0][0]["policy/grad_norm"] > 0
    second = records[0][2]  # step 3 trains on the rollout sampled after two updates: the engine took new weights
    assert second["rollout/policy_version"] == 2 and second["rollout/kl"] > 1e-4
    for alone, split in zip(*records):
        keys = sorted(k for k in alone if not k.startswith(TIMING))
        assert sorted(k for k in split if not k.startswith(TIMING)) == keys
        for key in keys:
            assert split[key] == pytest.approx(alone[key], rel=1e-4, abs=1e-5), key
    for run in ("one", "two"):  # 2 prompts per rollout, drawn once per tensor-parallel group
        state = json.loads((tmp_path / run / "checkpoints" / "step-00000004" / "trainer_state.json").read_text())
        assert state["consumed_samples"] == 4, run


def test_check_refuses_a_size_that_does_not_divide_the_world(tiny_model_dir, tmp_path):
    """`python -m astrai.train --check` (`check_job`) refuses before loading anything, in one line."""
    from astrai.config import load_config
    from astrai.distributed.launch import LaunchError
    from astrai.trainer.build import check_job

    config = load_config(None, ["--model.path", str(tiny_model_dir), "--train.output_dir", str(tmp_path / "run"),
                                "--rollout.tensor_parallel_size", "2"])
    with pytest.raises(LaunchError, match=r"^rollout\.tensor_parallel_size: 2 does not divide the world size 3 "):
        check_job(config, world_size=3)


def test_check_refuses_tensor_parallelism_with_upcycled_experts(tiny_model_dir, tmp_path):
    """`model.moe_num_experts` upcycles the loaded dense model at start-up: `--check` judges the engine's MoE copy,
    refusing tensor parallelism in the line the ranks would say (a fresh-user trial found it passing --check)."""
    from astrai.config import load_config
    from astrai.trainer.build import check_job

    config = load_config(None, ["--model.path", str(tiny_model_dir), "--train.output_dir", str(tmp_path / "run"),
                                "--train.type", "online_grpo", "--rollout.tensor_parallel_size", "2",
                                "--model.moe_num_experts", "4", "--data.max_prompt_length", "128",
                                "--data.truncation", "left"])
    with pytest.raises(ValueError, match=r"^rollout\.tensor_parallel_size: 2 > 1 is not supported for "
                                         r"mixture-of-experts models \(num_local_experts 4\); use 1$"):
        check_job(config, world_size=2)
