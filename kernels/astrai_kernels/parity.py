"""Backend parity check: random paged layouts, one backend's attention against the torch reference.

    TRITON_INTERPRET=1 python -m astrai.kernels.parity --backend triton --device cpu --sweep small   # no GPU
    python -m astrai.kernels.parity --backend triton --device cuda --sweep full                     # on a GPU

Each case scatters random keys/values of B sequences into shuffled blocks of a cache whose other blocks hold
garbage, builds the engine's `AttentionMetadata` (decode-only, or ragged prefill mixing full prompts, chunked
prefill after a cached prefix and single-query rows), and compares the backend's output with `TorchBackend`'s on
float32 copies of the same inputs (so the reference itself carries no half-precision rounding). Prints one JSON
object per case (name, dtype, max_abs_err, tolerance, ok) and exits 1 if any case is off, 0 otherwise.
`TRITON_INTERPRET=1` must be in the environment before Triton is imported, hence on the command line.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

import torch

from .backends import AttentionMetadata, TorchBackend, select_backend

__all__ = ["ParityCase", "SMALL_CASES", "FULL_CASES", "FAMILY_CASES", "GEMMA3_CASES", "TOLERANCES", "make_inputs", "check_case", "run_cases"]

TOLERANCES = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
"""Max abs error allowed against the float32 reference (outputs are O(1): convex mixtures of N(0, 1) values)."""


@dataclass(frozen=True)
class ParityCase:
    """One random layout: per-sequence query counts and cached lengths (q_lens[b] <= kv_lens[b])."""

    name: str
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    window: int | None = None
    softcap: float | None = None


SMALL_CASES = (
    ParityCase("decode_gqa3", (1, 1, 1), (1, 19, 70), 6, 2, 16, 16),
    ParityCase("prefill_mixed_gqa3", (5, 1, 12, 3), (5, 9, 30, 3), 6, 2, 16, 4),
)
"""Tiny cases for the CPU interpreter (seconds): decode over one and several tiles, mixed ragged prefill."""

FULL_CASES = SMALL_CASES + (
    ParityCase("decode_mha_bs1", (1, 1), (3, 40), 4, 4, 32, 1),
    ParityCase("decode_gqa8_d24", (1, 1, 1, 1), (64, 65, 130, 2), 8, 1, 24, 16),
    ParityCase("prefill_chunked_gqa3", (1, 40, 7, 70), (33, 100, 7, 70), 9, 3, 64, 16),
    ParityCase("prefill_block32", (20, 1, 66), (20, 50, 90), 4, 2, 32, 32),
)
"""The sweep: block sizes 1..32, MHA and GQA groups of 2, 3 and 8, a non-power-of-two head dim, several tiles."""

SMOLLM2_CASES = (
    ParityCase("smollm2_decode", (1,) * 8, (1, 17, 63, 64, 65, 200, 511, 1000), 9, 3, 64, 16),
    ParityCase("smollm2_prefill", (300, 1, 64, 130), (300, 700, 64, 200), 9, 3, 64, 16),
)
"""SmolLM2-135M's attention shapes (9 heads, 3 KV heads, D = 64) at realistic lengths, for a GPU."""

FAMILY_CASES = (
    ParityCase("decode_window7", (1, 1, 1), (3, 19, 70), 6, 2, 16, 4, window=7),
    ParityCase("prefill_window5", (5, 1, 12, 30), (5, 9, 30, 41), 6, 2, 16, 4, window=5),
    ParityCase("decode_softcap", (1, 1), (19, 70), 4, 2, 16, 16, softcap=0.5),
    ParityCase("prefill_window_softcap", (12, 1, 20), (30, 40, 20), 4, 1, 16, 8, window=9, softcap=0.5),
)
"""Sliding windows (shorter and longer than the sequences, windows ending mid-tile) and score soft-caps (Mistral,
Gemma 2/3), tiny for the CPU interpreter (a soft-cap of 0.5 keeps tanh far from linear on N(0, 1) scores)."""

GEMMA3_CASES = (
    ParityCase("gemma3_270m_decode", (1,) * 6, (1, 64, 511, 512, 513, 1500), 4, 1, 256, 16, window=512),
    ParityCase("gemma3_270m_prefill", (700, 1, 513), (700, 900, 513), 4, 1, 256, 16, window=512),
)
"""Gemma 3 270M's attention shapes (4 heads, 1 KV head, D = 256, sliding window 512) around the window, for a GPU."""


def make_inputs(case: ParityCase, dtype: torch.dtype, device: torch.device | str, seed: int = 0):
    """Random `(q (N, Nh, D), k_cache, v_cache (num_blocks, block_size, Nkv, D), AttentionMetadata)` for `case`;
    q is a non-contiguous view (last dim contiguous), as the engine's q sliced from its fused q/k/v projection."""
    gen = torch.Generator().manual_seed(seed)
    bs = case.block_size
    need = [-(-n // bs) for n in case.kv_lens]
    num_blocks = sum(need) + 2
    shape = (num_blocks, bs, case.num_kv_heads, case.head_dim)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(case.kv_lens), max(need), dtype=torch.int32)
    for b, n in enumerate(need):
        tables[b, :n] = torch.tensor([order.pop() for _ in range(n)])
    indptr = [0]
    for n in case.q_lens:
        indptr.append(indptr[-1] + n)
    # q as the engine passes it: a view into a wider (N, Nh + 2 Nkv, D) q/k/v tensor (row stride != Nh * D)
    q = torch.randn(indptr[-1], case.num_heads + 2 * case.num_kv_heads, case.head_dim, generator=gen)
    meta = AttentionMetadata(
        qo_indptr=indptr, kv_lens=list(case.kv_lens),
        qo_indptr_t=torch.tensor(indptr, dtype=torch.int32, device=device),
        kv_lens_t=torch.tensor(case.kv_lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device), max_q=max(case.q_lens), max_kv=max(case.kv_lens),
        scale=case.head_dim ** -0.5)
    q = q.to(device, dtype)[:, :case.num_heads]
    return q, k_cache.to(device, dtype), v_cache.to(device, dtype), meta


def check_case(backend, case: ParityCase, dtype: torch.dtype, device: torch.device | str, seed: int = 0) -> dict:
    """Run `backend` and the float32 torch reference on one case; returns {name, dtype, max_abs_err, tolerance,
    ok} (max_abs_err over the N real query rows)."""
    q, k_cache, v_cache, meta = make_inputs(case, dtype, device, seed)
    options = {"window": case.window, "softcap": case.softcap}
    out = backend.attention(q, k_cache, v_cache, meta, **options)
    expected = TorchBackend().attention(q.float(), k_cache.float(), v_cache.float(), meta, **options)
    err = float((out.float() - expected).abs().max())
    tol = TOLERANCES[dtype]
    return {"name": case.name, "dtype": str(dtype).removeprefix("torch."), "max_abs_err": err, "tolerance": tol,
            "ok": err <= tol and out.dtype == dtype and out.shape == q.shape}


def run_cases(backend_name: str, cases, dtypes, device: torch.device | str) -> list[dict]:
    """`check_case` for every (case, dtype) pair, the backend selected by name for each dtype.

    Raises:
        BackendUnavailableError: when the backend cannot serve `device` and a dtype.
    """
    rows = []
    for dtype in dtypes:
        backend = select_backend(backend_name, device, dtype=dtype)
        rows += [check_case(backend, case, dtype, device) for case in cases]
    return rows


def main(argv: list[str] | None = None) -> int:
    """CLI (see the module docstring). Returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="triton", choices=["torch", "triton", "flash_attn"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--sweep", default="small", choices=["small", "full", "smollm2", "families", "gemma3"])
    parser.add_argument("--dtypes", default="float32,float16,bfloat16")
    args = parser.parse_args(argv)
    dtypes = [getattr(torch, name) for name in args.dtypes.split(",")]
    cases = {"small": SMALL_CASES, "full": FULL_CASES, "smollm2": SMOLLM2_CASES, "families": FAMILY_CASES,
             "gemma3": GEMMA3_CASES}[args.sweep]
    results = run_cases(args.backend, cases, dtypes, args.device)
    for row in results:
        print(json.dumps(row))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
