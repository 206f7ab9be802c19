"""Top-k logit distillation (`distill.jsd_top_k`, docs/train_types.md): what the teacher's side keeps and costs.

    python bench/topk_distill.py [--device cuda] [--batch 64] [--response 256] [--k 16] [--chunk 8] [--layers 30]

A SmolLM2-135M-shaped teacher (V = 49152, H = 576, `--layers` blocks, random weights; bf16 on CUDA, fp32 on CPU)
scores `--batch` rows of a 64-token prompt and a `--response`-token response, two ways:

- full vocabulary: one forward of every row and the (B, T, V) float32 log-softmax kept (what a full-vocabulary
  JSD, as in GKD / TRL's GKDTrainer, holds for the teacher);
- top-k: `astrai.forward.response_topk` (`--chunk` rows per forward, the LM head 256 positions at a time): the
  (B, T, k) ids and log-probs kept;
- and, as the baseline the runner already pays, the sampled tokens' log-probs in the same chunks
  (`astrai.forward.response_logprobs`, how the teacher scores for the per-token advantage).

Prints per way the MiB kept, the peak memory above the model (CUDA only: `torch.cuda.max_memory_allocated`) and the
best of 3 wall times.
"""

from __future__ import annotations

import argparse
import time

import torch

from astrai.data.sequences import Sequences
from astrai.forward import response_logprobs, response_topk, score_in_chunks
from astrai.models import AutoRegressiveLM, tiny_config


def random_batch(rows: int, prompt: int, response: int, vocab: int, device: torch.device) -> Sequences:
    """`rows` random sequences of `prompt` + `response` real tokens (every response token an action)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (rows, prompt + response), generator=g)
    attention = torch.ones(rows, prompt + response, dtype=torch.bool)
    return Sequences(input_ids=ids.to(device), attention_mask=attention.to(device),
                     position_ids=torch.arange(prompt + response).expand(rows, -1).contiguous().to(device),
                     prompt_length=prompt, action_mask=torch.ones(rows, response, dtype=torch.bool, device=device))


def measure(fn, device: torch.device) -> tuple[float, float, object]:
    """(peak MiB above the memory held before, or NaN off CUDA; best of 3 seconds; the last result)."""
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    out = fn()
    sync()
    base = torch.cuda.memory_allocated() if cuda else 0
    del out
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        out = fn()
        sync()
        times.append(time.perf_counter() - start)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if cuda else float("nan")
    return peak, min(times), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--response", type=int, default=256)
    parser.add_argument("--k", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=8)
    parser.add_argument("--layers", type=int, default=30)
    args = parser.parse_args()
    device = torch.device(args.device)
    config = tiny_config(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=args.layers,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    teacher = AutoRegressiveLM(config).to(device, dtype).eval()
    seq = random_batch(args.batch, 64, args.response, config.vocab_size, device)
    t = args.response

    @torch.no_grad()
    def full_vocabulary():
        logits = teacher(seq.input_ids, attention_mask=seq.attention_mask, position_ids=seq.position_ids,
                         logits_to_keep=t + 1)[:, :-1]
        return torch.log_softmax(logits.float(), -1)

    ways = {
        "full vocabulary (B, T, V)": full_vocabulary,
        f"top-k (B, T, {args.k}), {args.chunk} rows per forward":
            lambda: response_topk(teacher, seq, k=args.k, temperature=1.0, chunk_size=args.chunk),
        f"sampled tokens (B, T), {args.chunk} rows per forward":
            lambda: score_in_chunks(lambda c: response_logprobs(teacher, c, temperature=1.0)[0], seq, args.chunk),
    }
    print(f"{args.device} {dtype}: B={args.batch} T={t} V={config.vocab_size} layers={args.layers}")
    for name, fn in ways.items():
        peak, seconds, out = measure(fn, device)
        kept = sum(x.numel() * x.element_size() for x in (out if isinstance(out, tuple) else (out,))) / 2**20
        print(f"{name}: kept {kept:.2f} MiB, peak {peak:.0f} MiB, {seconds * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
