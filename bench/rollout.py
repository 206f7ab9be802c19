"""Rollout throughput on CPU: astrai's paged engine vs `transformers` generate, same prompts, same threads.

    python bench/rollout.py [--model smollm2-135m-instruct] [--threads 1] [--prompts 32] [--batch1-prompts 4]
                            [--max-new-tokens 128] [--ignore-eos]
    python bench/rollout.py --model qwen3-random      # Qwen3's attention shapes at SmolLM2's size, random weights

`--model`: any model astrai loads (`astrai.models.load_pretrained`: an alias such as `smollm2-135m-instruct` or
`gemma3-270m`, a `.gguf` file, or a Hugging Face directory of a supported family, docs/models.md), default
SmolLM2-135M-Instruct (GGUF), all in float32. transformers loads the same weights: a directory as it is, a GGUF
file or alias as astrai's float32 load of it exported to a Hugging Face directory (`bench/hf_export.py`, cached).
`qwen3-random` is a Qwen3ForCausalLM with random weights shaped like SmolLM2-135M but with Qwen3's attention
(head_dim 128, q/k norms, 14 KV heads: 9.33x SmolLM2's KV cache per token; `bench/random_model.py`, written once
into the temporary directory) and SmolLM2's tokenizer; it implies `--ignore-eos`. With `--ignore-eos` (for random
weights, whose near-flat logits make EOS a matter of chance) both sides generate exactly `--max-new-tokens` per
row: astrai with no stop tokens, transformers with `min_new_tokens` (which masks EOS), so both do the same work.

GSM8K test questions (chat-templated when the tokenizer has a template, mixed lengths, read from
`../shared/data/gsm8k/test.jsonl` relative to the repo root), sampling at temperature 1 (top_k 0, top_p 1), stop at
the model's stop tokens (EOS). Counts generated tokens (EOS included) per second of wall time. Batch B = all prompts
in one call; batch 1 = one call per prompt on the first `--batch1-prompts` prompts. The engine runs with its
defaults (prefix cache on, cleared after the warm-up call). It prints the model's shapes and KV bytes per token, and
times the workload's GEMMs alone (the float32 matmul floor that no engine computing the same products can go below;
measured before and after the astrai run, the lower counts) and prints the ratio that floor allows, then that floor
plus the time to read, once, the keys/values every decode step attends over (bench/floors.py: `decode_kv_bytes` at
`measure_read_bandwidth`), which one query per row makes memory-bound rather than FLOP-bound (both floors take the
model's real dimensions, `floors.Dims.of`: an explicit head_dim, its KV heads, sliding windows). Both floors assume
every row runs all `--max-new-tokens` steps, so rows that stop at EOS earlier make them slightly high (the token
count line shows how many were generated). Ends with `ratio: X.XX` = astrai / transformers tokens/s at batch B.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

import floors
import gsm8k
from cli_help import DefaultsFormatter  # noqa: E402  (bench/, the script's own folder)

ROOT = Path(__file__).resolve().parents[1]
GSM8K = gsm8k.DEFAULT
DEFAULT_MODEL = "smollm2-135m-instruct"
QWEN3_RANDOM = "qwen3-random"


def load_prompts(tokenizer, count: int) -> list[list[int]]:
    """The first `count` GSM8K questions of `GSM8K`, chat-templated, as token ids; exits with one line naming the file
    when it holds fewer records or a record has no string 'question'."""
    records = gsm8k.first_records(GSM8K, count, "--prompts")
    for number, record in enumerate(records, 1):
        if not isinstance(record.get("question"), str):
            sys.exit(f"{GSM8K}: record {number} has no string 'question'")
    if not tokenizer.chat_template:
        return [tokenizer.encode(r["question"]) for r in records]
    return [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": r["question"]}]))
            for r in records]


def load_models(name: str):
    """(astrai model, tokenizer, transformers model) of `--model` `name`, both float32 with the same weights (see
    the module docstring)."""
    import transformers

    from astrai.models import load_pretrained, resolve_model_path

    if name == QWEN3_RANDOM:
        import tempfile

        from random_model import write_random_model

        directory = write_random_model(Path(tempfile.gettempdir()) / "astrai-bench-hf" / "qwen3-random-smollm2")
    else:
        path = resolve_model_path(name)
        if path.is_dir():
            directory = path
        else:
            from hf_export import export_hf

            directory = export_hf(name)
    model, tokenizer = load_pretrained(directory if name == QWEN3_RANDOM else name, torch.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    return model, tokenizer, hf


def run_astrai(engine, prompts, max_new: int, seed: int, stops: tuple[int, ...]) -> int:
    """Generated tokens of one engine call over `prompts` (stopping at `stops`; none: exactly `max_new` per row)."""
    from astrai.rollout.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=max_new, temperature=1.0, stop_token_ids=stops)
    gen = engine.generate(prompts, params, torch.Generator().manual_seed(seed))
    return int(gen.action_mask.sum())


def run_hf(model, prompts, max_new: int, seed: int, stops: tuple[int, ...], pad: int) -> int:
    """Generated tokens (up to and including the first stop token) of one left-padded `generate` call over `prompts`;
    with no `stops`, exactly `max_new` per row (`min_new_tokens`)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    stopping = {"eos_token_id": list(stops)} if stops else {"min_new_tokens": max_new}
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new, do_sample=True, temperature=1.0,
                             top_k=0, top_p=1.0, pad_token_id=pad, **stopping)
    total = 0
    for row in out[:, width:].tolist():
        ends = [row.index(t) for t in stops if t in row]
        total += min(ends) + 1 if ends else len(row)
    return total


def gemm_pass_seconds(model, rows: int, repeats: int = 3) -> float:
    """Fastest of `repeats` timings of one forward's GEMMs alone (fused q/k/v, o, fused gate/up, down per layer,
    plus the LM head on min(rows, 32) rows, as the engine runs them) for `rows` tokens, float32."""
    import torch.nn.functional as F

    from astrai.rollout.model_runner import LOGITS_CHUNK, fuse_projections

    fuse_projections(model)
    cfg = model.config
    x = torch.randn(rows, cfg.hidden_size)
    hidden = torch.randn(rows, cfg.intermediate_size)
    attn_out = torch.randn(rows, cfg.num_attention_heads * cfg.head_dim)
    head_rows = x[:min(rows, 32)]
    weight = model.lm_head.weight
    logits = torch.empty(head_rows.shape[0], weight.shape[0])
    best = float("inf")
    with torch.no_grad():
        for _ in range(repeats):
            start = time.perf_counter()
            for layer in model.model.layers:
                F.linear(x, layer.self_attn.qkv_weight)
                F.linear(attn_out, layer.self_attn.o_proj.weight)
                F.linear(x, layer.mlp.gate_up_weight)
                F.linear(hidden, layer.mlp.down_proj.weight)
            for s in range(0, weight.shape[0], LOGITS_CHUNK):
                torch.mm(head_rows, weight[s:s + LOGITS_CHUNK].t(), out=logits[:, s:s + LOGITS_CHUNK])
            best = min(best, time.perf_counter() - start)
    return best


def timed(fn, *args) -> tuple[int, float]:
    """(tokens, seconds) of `fn(*args)`."""
    start = time.perf_counter()
    tokens = fn(*args)
    return tokens, time.perf_counter() - start


def describe(config, tokenizer) -> str:
    """One line: the model's shapes and its KV cache per token (float32) against SmolLM2-135M's."""
    dims = floors.Dims.of(config)
    per_token = dims.layers * 2 * dims.kv_heads * dims.head_dim
    return (f"model: {config.model_type}, {dims.layers} layers, hidden {dims.hidden}, heads {dims.heads}/"
            f"{dims.kv_heads} KV, head_dim {dims.head_dim}, vocab {dims.vocab}; KV cache {per_token * 4 / 1e3:.1f} "
            f"kB per token in float32 ({per_token / (30 * 2 * 3 * 64):.2f}x SmolLM2-135M's); tokenizer eos "
            f"{tokenizer.eos_token_id}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] + f" Reads {GSM8K}.",
                                     formatter_class=DefaultsFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"an alias, .gguf file or HF directory astrai loads, "
                                                               f"or {QWEN3_RANDOM}")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for both engines")
    parser.add_argument("--prompts", type=int, default=32, help="GSM8K questions = the batch B")
    parser.add_argument("--batch1-prompts", type=int, default=4, help="prompts generated one at a time")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per response (stop at EOS)")
    parser.add_argument("--ignore-eos", action="store_true", help=f"exactly --max-new-tokens per row (implied by "
                                                                  f"{QWEN3_RANDOM})")
    args = parser.parse_args()
    if not GSM8K.is_file():
        parser.error(f"{GSM8K} not found: the benchmark needs the GSM8K test split there (one JSON object with a "
                     "'question' per line)")
    if min(args.threads, args.prompts, args.max_new_tokens) < 1 or args.batch1_prompts < 0:
        parser.error("--threads, --prompts and --max-new-tokens must be >= 1, --batch1-prompts >= 0")
    torch.set_num_threads(args.threads)
    print(f"threads: {torch.get_num_threads()}")
    from astrai.models.special_tokens import stop_token_ids
    from astrai.rollout.paged_engine import PagedGenerationEngine

    try:
        model, tokenizer, hf = load_models(args.model)
    except (FileNotFoundError, ValueError) as exc:
        parser.exit(2, f"error: --model: {exc}\n")
    print(describe(model.config, tokenizer))
    ignore_eos = args.ignore_eos or args.model == QWEN3_RANDOM
    stops = () if ignore_eos else stop_token_ids(model.config, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (stops or (0,))[0]
    prompts = load_prompts(tokenizer, args.prompts)
    lengths = sorted(len(p) for p in prompts)
    print(f"prompts: {len(prompts)}, lengths {lengths[0]}..{lengths[-1]} (median {statistics.median(lengths):g}), "
          f"max_new_tokens {args.max_new_tokens}, sampling T=1, "
          + ("no stop: every row generates max_new_tokens" if ignore_eos else f"stop at {list(stops)}"))
    engine = PagedGenerationEngine(model, pad_token_id=pad)
    print(f"astrai backend: {engine.backend.name}, block_size {engine.block_size}")
    sides = (("astrai", lambda ps, seed: run_astrai(engine, ps, args.max_new_tokens, seed, stops)),
             ("transformers", lambda ps, seed: run_hf(hf, ps, args.max_new_tokens, seed, stops, pad)))
    run_astrai(engine, prompts[:2], 4, 0, stops)  # warm-up (allocates the pool for small calls)
    engine.prefix_cache.clear()  # the timed call must not reuse the warm-up's prompt blocks
    results = batch_run(engine, sides, prompts, args.max_new_tokens)
    for name, run in sides[:2 * bool(args.batch1_prompts)]:
        total_tokens, total_secs = 0, 0.0
        for i, prompt in enumerate(prompts[:args.batch1_prompts]):
            tokens, secs = timed(run, [prompt], 100 + i)
            total_tokens, total_secs = total_tokens + tokens, total_secs + secs
        print(f"{name:12s} batch   1: {total_tokens:6d} tokens in {total_secs:7.1f} s = "
              f"{total_tokens / total_secs:8.1f} tok/s ({len(prompts[:args.batch1_prompts])} prompts)")
    print(f"ratio: {results['astrai'] / results['transformers']:.2f}")


def batch_run(engine, sides, prompts: list[list[int]], max_new: int) -> dict[str, float]:
    """Both sides on the whole batch (tokens/s, printed with the engine's stats), then the GEMM-only floor (measured
    before and after the astrai run) and the floor with the decode attention's KV reads; returns
    {"astrai": tok/s, "transformers": tok/s, "astrai_seconds": s, "transformers_seconds": s}."""
    prompt_tokens = sum(len(p) for p in prompts)
    chunk = min(engine.max_batch_tokens, prompt_tokens)

    def workload_floor() -> float:
        return (gemm_pass_seconds(engine.model, chunk, 1) * prompt_tokens / chunk
                + gemm_pass_seconds(engine.model, len(prompts)) * (max_new - 1))

    floors_measured = [workload_floor()]  # bracketing the astrai run: the machine's speed drifts
    results = {}
    for name, run in sides:
        tokens, secs = timed(run, prompts, 1)
        results[name], results[f"{name}_seconds"] = tokens / secs, secs
        print(f"{name:12s} batch {len(prompts):3d}: {tokens:6d} tokens in {secs:7.1f} s = {tokens / secs:8.1f} tok/s")
        if name == "astrai":
            print(f"  engine stats (steps, groups, dense decode rebuilds, prefix-cache block hits / entries): "
                  f"{engine.last_stats}")
            floors_measured.append(workload_floor())
    floor = min(floors_measured)
    print(f"GEMM-only floor of this workload ({prompt_tokens} prompt tokens unpadded, {max_new - 1} "
          f"decode steps of {len(prompts)} rows, float32, no attention/sampling): {floors_measured[0]:.1f} s "
          f"measured before the astrai run, {floors_measured[1]:.1f} s after (a difference means the machine's "
          f"speed changed); astrai {results['astrai_seconds'] / floor:.2f}x the lower; ratio ceiling for any engine "
          f"doing these GEMMs: {results['transformers_seconds'] / floor:.2f}")
    dims = floors.Dims.of(engine.model.config)
    kv_bytes = floors.decode_kv_bytes(dims, [len(p) for p in prompts], [max_new] * len(prompts))
    bandwidth = floors.measure_read_bandwidth()
    kv_floor = floor + kv_bytes / bandwidth
    print(f"with the decode attention's reads of the cached keys/values ({kv_bytes / 1e9:.2f} GB at the "
          f"{bandwidth / 1e9:.1f} GB/s a torch.sum reads memory here): {kv_floor:.1f} s; astrai "
          f"{results['astrai_seconds'] / kv_floor:.2f}x that floor")
    return results


if __name__ == "__main__":
    main()
