"""Triton paged attention over the block KV cache: a decode kernel and a ragged prefill kernel.

Same layout as the torch reference (`kernels.paged_attention`, PagedAttention by Kwon et al. 2023):
    k_cache, v_cache: (num_blocks, block_size, Nkv, D), any block size, float16/bfloat16/float32
    block_tables:     (B, max_blocks) int32, block ids of each sequence in order (entries past kv_lens unread)
    kv_lens:          (B,) int32, cached tokens of each sequence INCLUDING this step's
    qo_indptr:        (B + 1,) int32, cumulative query offsets into the packed queries q (N, Nh, D)
Query j of sequence b (q_len = qo_indptr[b+1] - qo_indptr[b]) sits at absolute position kv_lens[b] - q_len + j and
attends causally to keys [0, kv_lens[b] - q_len + j]; a sliding `window` W keeps only the last W of them (the loop
starts at the tile holding the first visible key), and a `softcap` c caps each score s as c * tanh(s / c), all as
the torch reference does (Gemma 2/3, Mistral; constexpr flags, so the plain kernels are unchanged).

Both kernels compute softmax attention in one pass with the running max / running sum rescaling of
FlashAttention (Dao et al. 2022, "FlashAttention: Fast and Memory-Efficient Exact Attention with IO-Awareness",
section 3.1), in base 2 (`exp2` with the scale multiplied by log2(e)), accumulating in float32. Keys are visited in
tiles of BLOCK_N cache positions (64; 32 in float32, see `TILES`); each position's block id comes from the block
table, so no dense copy is made.

Grouped-query attention (Ainslie et al. 2023, GQA): one program serves one KV head and all G = Nh / Nkv query
heads that share it, so each key/value tile is read once per KV head rather than once per query head. Its rows
are (query, head-in-group) pairs: row r = query r // G_PAD, head r % G_PAD, with G_PAD = next power of two >= G
(padding rows load zeros and are never stored).
    decode:  grid (B, Nkv); rows = the G heads of one query (padded to 16 rows, the smallest `tl.dot` operand)
    prefill: grid (B, Nkv, ceil(max_q / BLOCK_Q)); rows = BLOCK_Q queries x G_PAD heads; programs past their
             sequence's q_len return at once, and a tile reads keys only up to its last query's position.
float32 dot products run with `input_precision="ieee"` (no TF32), so float32 results match the reference to
rounding; float16/bfloat16 keep the probabilities in the input dtype for the second product, as FlashAttention.

Under `TRITON_INTERPRET=1` (set before this module is imported) the kernels run on CPU tensors through Triton's
interpreter: that is how the tests check them without a GPU. The interpreter cannot multiply bfloat16 operands
in `tl.dot` (it holds them as raw 16-bit integers; triton-lang/triton issue 11584), so there, and only there,
bfloat16 operands are widened to float32 right before each product: the products of bfloat16 values are exact
in float32, which is what tensor cores compute with float32 accumulation, so the loads, casts, masks and the
online softmax are the code that runs on the GPU.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

__all__ = ["triton_paged_decode", "triton_paged_prefill", "kernel_constants", "SUPPORTED_DTYPES", "TILES"]

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
LOG2_E = 1.4426950408889634
LOG2E_CONST = tl.constexpr(LOG2_E)
TILES = {torch.float16: (64, 64), torch.bfloat16: (64, 64), torch.float32: (32, 32)}
"""dtype -> (BLOCK_N cache positions per key tile, rows (query x head) per prefill program). float32 tiles are
halved so that the shared memory of a program stays near the half-precision one (about 53 KB at D = 128 on sm_80,
within every CUDA GPU's limit): a kernel that does not fit would fail at its first launch, mid-rollout."""
MIN_DOT = 16  # smallest tl.dot operand dimension
LAUNCH_OPTIONS = {"enable_fp_fusion": True}
"""Compiler options of every launch: fused multiply-adds, stated rather than left to Triton's changing default."""
INTERPRETED = os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes")
"""Whether the kernels below were decorated for Triton's CPU interpreter (it reads the variable at decoration)."""


@triton.jit
def _attend_tile(q, m_i, l_i, acc, k_ptr, v_ptr, tables_row, kv_len, key_start, q_pos, qk_scale, block_size,
                 stride_kb, stride_ks, stride_vb, stride_vs, head_k, head_v, d, d_ok, window, softcap,
                 CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
                 WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr):
    """One key tile: scores of the rows `q` (R, D) against positions [key_start, key_start + BLOCK_N) of the
    sequence whose block-table row starts at `tables_row`, folded into the running max `m_i`, sum `l_i` and
    output accumulator `acc` (R, D) (all float32; `qk_scale` = softmax scale * log2(e), so scores are in base 2).
    WINDOWED: a row at `q_pos` sees only positions > q_pos - window; SOFTCAP: natural-log scores s become
    softcap * tanh(s / softcap), with tanh(x) = 2 sigmoid(2x) - 1."""
    pos = key_start + tl.arange(0, BLOCK_N)
    pos_ok = pos < kv_len
    blocks = tl.load(tables_row + pos // block_size, mask=pos_ok, other=0).to(tl.int64)
    offsets = (pos % block_size).to(tl.int64)
    tile_ok = pos_ok[:, None] & d_ok[None, :]
    k = tl.load(k_ptr + (blocks * stride_kb + offsets * stride_ks + head_k)[:, None] + d[None, :],
                mask=tile_ok, other=0.0).to(q.dtype)
    if UPCAST_DOT:  # interpreter + bfloat16: exact float32 products of the bfloat16 values
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    if SOFTCAP:
        s = s * (qk_scale / LOG2E_CONST) / softcap
        s = (2.0 * tl.sigmoid(2.0 * s) - 1.0) * (softcap * LOG2E_CONST)
    else:
        s = s * qk_scale  # (R, BLOCK_N) float32, base-2 logits
    visible = pos_ok[None, :]
    if CAUSAL:
        visible = visible & (pos[None, :] <= q_pos[:, None])
    if WINDOWED:
        visible = visible & (pos[None, :] > q_pos[:, None] - window)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_ref = m_new
    if WINDOWED:  # a row may see no key of its first tiles: keep its (empty) state finite instead of NaN
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    v = tl.load(v_ptr + (blocks * stride_vb + offsets * stride_vs + head_v)[:, None] + d[None, :],
                mask=tile_ok, other=0.0).to(q.dtype)
    p_in = p.to(q.dtype)  # probabilities rounded to the input dtype for the second product
    if UPCAST_DOT:
        pv = tl.dot(p_in.to(tl.float32), v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p_in, v, input_precision=PRECISION)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i * alpha + tl.sum(p, 1), acc


@triton.jit
def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, o_ptr, tables_ptr, kv_lens_ptr, qk_scale, block_size, window, softcap,
                         stride_qn, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                         stride_on, stride_oh, stride_tb,
                         GROUP: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                         BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
                         WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr):
    """One query per sequence: program (b, kv head) computes the GROUP query heads of that kv head; a windowed
    layer starts at the tile holding position kv_len - window."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    kv_len = tl.load(kv_lens_ptr + seq)
    g = tl.arange(0, ROWS)
    d = tl.arange(0, D_PAD)
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    heads = kv_head * GROUP + g
    io_mask = g_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + seq * stride_qn + heads[:, None] * stride_qh + d[None, :], mask=io_mask, other=0.0)
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, D_PAD], tl.float32)
    tables_row = tables_ptr + seq.to(tl.int64) * stride_tb
    first = 0
    if WINDOWED:
        first = (tl.maximum(kv_len - window, 0) // BLOCK_N) * BLOCK_N
    q_pos = tl.zeros([ROWS], tl.int32) + (kv_len - 1)
    for key_start in range(first, kv_len, BLOCK_N):
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_ptr, v_ptr, tables_row, kv_len, key_start, q_pos,
                                     qk_scale, block_size, stride_kb, stride_ks, stride_vb, stride_vs,
                                     kv_head * stride_kh, kv_head * stride_vh, d, d_ok, window, softcap,
                                     CAUSAL=False, BLOCK_N=BLOCK_N, PRECISION=PRECISION,
                                     UPCAST_DOT=UPCAST_DOT, WINDOWED=WINDOWED, SOFTCAP=SOFTCAP)
    out = acc / l_i[:, None]
    tl.store(o_ptr + seq * stride_on + heads[:, None] * stride_oh + d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=io_mask)


@triton.jit
def _paged_prefill_kernel(q_ptr, k_ptr, v_ptr, o_ptr, tables_ptr, kv_lens_ptr, qo_indptr_ptr, qk_scale, block_size,
                          window, softcap,
                          stride_qn, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                          stride_on, stride_oh, stride_tb,
                          GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
                          HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                          PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr, WINDOWED: tl.constexpr,
                          SOFTCAP: tl.constexpr):
    """Ragged causal attention: program (b, kv head, tile) computes queries [tile * BLOCK_Q, +BLOCK_Q) of
    sequence b for the GROUP query heads of that kv head; a windowed layer starts at the tile holding the first
    key its first query sees."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2)
    q_start = tl.load(qo_indptr_ptr + seq)
    q_len = tl.load(qo_indptr_ptr + seq + 1) - q_start
    if tile * BLOCK_Q >= q_len:
        return
    kv_len = tl.load(kv_lens_ptr + seq)
    r = tl.arange(0, BLOCK_Q * GROUP_PAD)
    query = tile * BLOCK_Q + r // GROUP_PAD
    g = r % GROUP_PAD
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    row_ok = (query < q_len) & (g < GROUP)
    io_mask = row_ok[:, None] & d_ok[None, :]
    tokens = (q_start + query).to(tl.int64)
    heads = kv_head * GROUP + g
    q = tl.load(q_ptr + tokens[:, None] * stride_qn + heads[:, None] * stride_qh + d[None, :], mask=io_mask,
                other=0.0)
    q_pos = kv_len - q_len + query  # absolute positions; rows past q_len see every key (never stored)
    m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, D_PAD], tl.float32)
    tables_row = tables_ptr + seq.to(tl.int64) * stride_tb
    key_end = tl.minimum(kv_len, kv_len - q_len + (tile + 1) * BLOCK_Q)  # past the tile's last query: masked
    first = 0
    if WINDOWED:
        first = (tl.maximum(kv_len - q_len + tile * BLOCK_Q - window + 1, 0) // BLOCK_N) * BLOCK_N
    for key_start in range(first, key_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_ptr, v_ptr, tables_row, kv_len, key_start, q_pos,
                                     qk_scale, block_size, stride_kb, stride_ks, stride_vb, stride_vs,
                                     kv_head * stride_kh, kv_head * stride_vh, d, d_ok, window, softcap,
                                     CAUSAL=True, BLOCK_N=BLOCK_N, PRECISION=PRECISION,
                                     UPCAST_DOT=UPCAST_DOT, WINDOWED=WINDOWED, SOFTCAP=SOFTCAP)
    out = acc / l_i[:, None]
    tl.store(o_ptr + tokens[:, None] * stride_on + heads[:, None] * stride_oh + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=io_mask)


def kernel_constants(kind: str, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, *,
                     windowed: bool = False, softcap: bool = False) -> dict:
    """The `tl.constexpr` arguments of a launch of the `kind` ("decode" or "prefill") kernel: tile sizes from
    `TILES`, the padded group and head dim, PRECISION (no TF32 in float32), UPCAST_DOT (interpreter + bfloat16),
    WINDOWED and SOFTCAP (a sliding window / score soft-cap is applied). Also what an ahead-of-time compile of the
    kernels must pass to compile what runs."""
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    block_n, rows = TILES[dtype]
    shared = {"GROUP": group, "HEAD_DIM": head_dim, "D_PAD": max(MIN_DOT, triton.next_power_of_2(head_dim)),
              "BLOCK_N": block_n, "PRECISION": "ieee" if dtype == torch.float32 else "tf32",
              "UPCAST_DOT": INTERPRETED and dtype == torch.bfloat16, "WINDOWED": bool(windowed),
              "SOFTCAP": bool(softcap)}
    if kind == "decode":
        return dict(shared, ROWS=max(MIN_DOT, group_pad))
    return dict(shared, GROUP_PAD=group_pad, BLOCK_Q=max(MIN_DOT // group_pad, rows // group_pad, 1))


def _strides(q, k_cache, v_cache, out, block_tables) -> tuple[int, ...]:
    """The stride arguments shared by both kernels (the head dim of every tensor must be contiguous)."""
    return (q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1),
            block_tables.stride(0))


def triton_paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                        kv_lens: torch.Tensor, scale: float, *, window: int | None = None,
                        softcap: float | None = None) -> torch.Tensor:
    """One query per sequence over its paged keys/values (the torch reference: `paged_decode_attention`).

    Args:
        q: (B, Nh, D) float16/bfloat16/float32, last dim contiguous; Nh a multiple of Nkv.
        k_cache, v_cache: (num_blocks, block_size, Nkv, D), last dim contiguous (cast to q's dtype when read).
        block_tables: (B, max_blocks) int32, last dim contiguous.
        kv_lens: (B,) int32, each >= 1 (the query's own key is already in the cache).
        scale: softmax scale, usually D ** -0.5.
        window: sliding window W (the query sees its last W keys) or None; softcap: score soft-cap or None.

    Returns:
        (B, Nh, D) in q's dtype.
    """
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    grid = (q.shape[0], k_cache.shape[2])
    constants = kernel_constants("decode", q.dtype, q.shape[1], k_cache.shape[2], k_cache.shape[3],
                                 windowed=window is not None, softcap=softcap is not None)
    _paged_decode_kernel[grid](
        q, k_cache, v_cache, out, block_tables, kv_lens, scale * LOG2_E, k_cache.shape[1], window or 0,
        float(softcap or 0.0), *_strides(q, k_cache, v_cache, out, block_tables), **constants, **LAUNCH_OPTIONS)
    return out


def triton_paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                         qo_indptr: torch.Tensor, kv_lens: torch.Tensor, max_q: int, scale: float, *,
                         window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Ragged causal attention of packed queries over their paged keys/values (the torch reference:
    `paged_prefill_attention`); sequences of one query (decode rows of a mixed step) are served too.

    Args:
        q: (N, Nh, D) packed queries, N = qo_indptr[-1], last dim contiguous.
        k_cache, v_cache: (num_blocks, block_size, Nkv, D), already holding this step's keys/values.
        block_tables: (B, max_blocks) int32.
        qo_indptr: (B + 1,) int32 cumulative query offsets.
        kv_lens: (B,) int32 cached lengths including this step's tokens, kv_lens[b] >= q_len[b] (not checked:
            the engine's scheduler guarantees it).
        max_q: the longest q_len (sizes the grid).
        scale: softmax scale.
        window, softcap: as `triton_paged_decode`.

    Returns:
        (N, Nh, D) in q's dtype.
    """
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    constants = kernel_constants("prefill", q.dtype, q.shape[1], k_cache.shape[2], k_cache.shape[3],
                                 windowed=window is not None, softcap=softcap is not None)
    grid = (kv_lens.shape[0], k_cache.shape[2], math.ceil(max_q / constants["BLOCK_Q"]))
    _paged_prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, kv_lens, qo_indptr, scale * LOG2_E, k_cache.shape[1], window or 0,
        float(softcap or 0.0), *_strides(q, k_cache, v_cache, out, block_tables), **constants, **LAUNCH_OPTIONS)
    return out


def compile_for(arch: int, kind: str, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                head_dim: int, *, windowed: bool = False, softcap: bool = False) -> int:
    """Compile the `kind` ("decode" or "prefill") kernel ahead of time for CUDA compute capability `arch` (90 for
    H100/H200, 80 for A100) with the constants a launch would use; needs no GPU (Triton ships its own ptxas).
    Returns the shared memory (bytes) one program needs. Triton >= 3.3 (signatures by argument name).

    Raises:
        RuntimeError: under the interpreter (nothing to compile), or when Triton fails to compile.
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if INTERPRETED:
        raise RuntimeError("compile_for: the kernels were decorated for the interpreter (TRITON_INTERPRET=1)")
    kernel = _paged_decode_kernel if kind == "decode" else _paged_prefill_kernel
    constants = kernel_constants(kind, dtype, num_heads, num_kv_heads, head_dim, windowed=windowed, softcap=softcap)
    element = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16"}[dtype]
    types = {"q_ptr": element, "k_ptr": element, "v_ptr": element, "o_ptr": element, "qk_scale": "fp32",
             "softcap": "fp32"}
    signature = {name: "constexpr" if name in constants else types.get(name, "*i32" if name.endswith("_ptr")
                                                                         else "i32")
                 for name in kernel.arg_names}
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants),
                              target=GPUTarget("cuda", arch, 32), options=LAUNCH_OPTIONS)
    return int(compiled.metadata.shared)
