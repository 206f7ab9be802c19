"""The compiled CPU decode attention (`astrai.kernels.cpu_kernels`): its results against a naive loop, thread-count
independence, the build cache, every reason it is not used (and the torch path then), and the engine with and
without it."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from astrai.kernels import DenseDecodeCache, InferenceWorkspace, cpu_kernels

needs_kernel = pytest.mark.skipif(not cpu_kernels.supports(torch.float32),
                                  reason=f"no CPU attention kernel here: {cpu_kernels.unavailable_reason()}")


@pytest.fixture
def fresh_library():
    """`library()` decided again inside the test (after its monkeypatches) and again after it."""
    cpu_kernels.library.cache_clear()
    yield
    cpu_kernels.library.cache_clear()


def naive_attention(q, keys, values, lens, scale, window=None, softcap=None):
    """Float64 loops over rows, query heads and positions: q (B, Nh, D), keys (B, Nkv, D, cap), values (B, Nkv,
    cap, D) -> (B, Nh, D)."""
    rows, heads, dim = q.shape
    nkv = keys.shape[1]
    out = torch.zeros(rows, heads, dim, dtype=torch.float64)
    for b in range(rows):
        n = int(lens[b])
        start = n - window if window is not None and n > window else 0
        for head in range(heads):
            kv = head // (heads // nkv)
            scores = []
            for t in range(start, n):
                s = scale * sum(float(q[b, head, d]) * float(keys[b, kv, d, t]) for d in range(dim))
                scores.append(softcap * math.tanh(s / softcap) if softcap else s)
            top = max(scores)
            weights = [math.exp(s - top) for s in scores]
            total = sum(weights)
            for i, t in enumerate(range(start, n)):
                out[b, head] += weights[i] / total * values[b, kv, t].double()
    return out


def dense_case(dtype, heads, kv_heads, dim, lens, cap, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rows = len(lens)
    qkv = torch.randn(rows, heads + 2 * kv_heads, dim, generator=gen).to(dtype)  # q rows strided, as in the engine
    keys = torch.randn(rows, kv_heads, dim, cap, generator=gen).to(dtype)
    values = torch.randn(rows, kv_heads, cap, dim, generator=gen).to(dtype)
    return qkv[:, :heads], keys, values, torch.tensor(lens, dtype=torch.int32)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(6, 2, 64), (5, 1, 80), (4, 4, 16), (8, 1, 128)])
@pytest.mark.parametrize("window,softcap", [(None, None), (7, None), (None, 2.5)])
def test_kernel_matches_a_naive_loop(dtype, heads, kv_heads, dim, window, softcap):
    """Query groups of 1 to 8 (groups of 4 and remainders), head dims with and without a 64-dim remainder, rows
    of length 1, of a partial tile and ending at the capacity (the one-by-one tail), windows and soft-caps, in
    every dtype: equal to float64 loops over the same (rounded) inputs within float32 rounding."""
    if not cpu_kernels.supports(dtype):
        pytest.skip(f"this build reads no {dtype}")
    cap = 48
    q, keys, values, lens = dense_case(dtype, heads, kv_heads, dim, [1, 20, 33, 48], cap)
    got = cpu_kernels.dense_decode_attention(q, keys, values, lens, 0.3, window=window, softcap=softcap)
    assert got.dtype == torch.float32 and got.shape == (4, heads, dim)
    expected = naive_attention(q.double(), keys.double(), values.double(), lens, 0.3, window, softcap)
    torch.testing.assert_close(got.double(), expected, atol=2e-5, rtol=1e-4)


@needs_kernel
def test_kernel_result_does_not_depend_on_the_thread_count():
    """One (row, kv head) is one thread's task: 1 and 2 threads give bitwise the same output."""
    q, keys, values, lens = dense_case(torch.bfloat16, 9, 3, 64, [5, 70, 100, 33, 64, 7], 128, seed=3)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_kernels.dense_decode_attention(q, keys, values, lens, 0.125)
        torch.set_num_threads(2)
        two = cpu_kernels.dense_decode_attention(q, keys, values, lens, 0.125)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@needs_kernel
def test_build_goes_to_the_cache_folder_once(tmp_path, monkeypatch, fresh_library):
    """The library is built into ASTR_KERNEL_CACHE under a content key, with no temporary file left, and a second
    decision loads that file instead of compiling again."""
    monkeypatch.setenv("ASTR_KERNEL_CACHE", str(tmp_path))
    assert cpu_kernels.library() is not None
    built = list(tmp_path.iterdir())
    assert len(built) == 1 and built[0].name.startswith("cpu_attention-") and built[0].suffix == ".so"
    assert built[0].stat().st_mode & 0o755 == 0o755  # other users of a shared cache can load it
    stamp = built[0].stat().st_mtime_ns
    cpu_kernels.library.cache_clear()
    assert cpu_kernels.library() is not None
    assert [p.name for p in tmp_path.iterdir()] == [built[0].name] and built[0].stat().st_mtime_ns == stamp


@needs_kernel
@pytest.mark.parametrize("damage", [b"", "first page"] + [  # each rebuilds the library (8 s)
    pytest.param(d, marks=pytest.mark.slow) for d in (b"not an ELF file at all", "foreign", "half")])
def test_a_cached_file_that_does_not_load_is_rebuilt(damage, tmp_path, monkeypatch, fresh_library):
    """A truncated, garbage or foreign file under the cached name (an interrupted copy, a bad disk) is built again
    instead of leaving the torch path for good; a library cut short after its headers (which dlopen would map and
    die of SIGBUS on) too."""
    monkeypatch.setenv("ASTR_KERNEL_CACHE", str(tmp_path))
    assert cpu_kernels.library() is not None
    (built,) = tmp_path.iterdir()
    if damage in ("half", "first page"):
        whole = built.read_bytes()
        damage = whole[:len(whole) // 2] if damage == "half" else whole[:4096]
    if damage == "foreign":  # a real shared library without the kernel's functions
        import ctypes.util

        damage = open(f"/lib/x86_64-linux-gnu/{ctypes.util.find_library('m')}", "rb").read() \
            if os.path.exists(f"/lib/x86_64-linux-gnu/{ctypes.util.find_library('m')}") else b"\x7fELF"
    os.unlink(built)
    built.write_bytes(damage)
    # a fresh process: this one's dynamic loader would hand back the library it already loaded from that path
    check = ("from astrai.kernels import cpu_kernels\n"
             "assert cpu_kernels.library() is not None, cpu_kernels.unavailable_reason()")
    subprocess.run([sys.executable, "-c", check], check=True, timeout=300)
    assert built.stat().st_size > 1000 and [p.name for p in tmp_path.iterdir()] == [built.name]


@needs_kernel
def test_a_compiler_with_arguments(tmp_path, monkeypatch, fresh_library):
    """CC as make reads it, a program and its arguments (`ccache gcc`, `gcc -std=gnu11`)."""
    monkeypatch.setenv("ASTR_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "cc -Wno-unused-function")
    assert cpu_kernels.library() is not None, cpu_kernels.unavailable_reason()


@pytest.mark.parametrize("setting,reason", [
    ({"ASTR_CPU_KERNELS": "0"}, "turned off by ASTR_CPU_KERNELS"),
    ({"CC": "no-such-compiler-here"}, "no C compiler found"),
    ({"CC": "false"}, "false failed to build cpu_attention.c"),
    ({"ASTR_KERNEL_CACHE": "/proc/astrai-cannot-be-here"}, "cannot write the kernel cache"),
])
def test_every_reason_leaves_the_torch_path(setting, reason, tmp_path, monkeypatch, fresh_library):
    """Turned off, no compiler, a failing compiler, a cache folder that cannot be written: `library()` is None with
    the reason in one line (nothing raised, no file left behind), and the dense decode cache then keeps float32
    copies (the matmul path), still equal to the paged reference."""
    from astrai.kernels import paged_decode_attention, write_kv

    monkeypatch.setenv("ASTR_KERNEL_CACHE", str(tmp_path))  # nothing cached: the compiler is asked (or the folder)
    for name, value in setting.items():
        monkeypatch.setenv(name, value)
    assert cpu_kernels.library() is None and not cpu_kernels.supports(torch.float32)
    said = cpu_kernels.unavailable_reason()
    assert reason in said and "\n" not in said
    assert not [p for p in tmp_path.iterdir() if p.suffix != ".so"]  # no temporary file left behind
    with pytest.raises(RuntimeError, match="unavailable"):
        cpu_kernels.dense_decode_attention(*dense_case(torch.float32, 2, 1, 8, [3], 8), 1.0)

    ws = InferenceWorkspace(num_layers=1, num_blocks=4, block_size=4, num_kv_heads=1, head_dim=8,
                            dtype=torch.bfloat16)
    write_kv(ws.k_caches[0], ws.v_caches[0], torch.arange(5), torch.randn(5, 1, 8), torch.randn(5, 1, 8))
    cache = DenseDecodeCache(ws)
    assert not cache.kernel and cache.dtype == torch.float32
    tables = torch.tensor([[0, 1, 2, 3]], dtype=torch.int32)
    assert cache.begin_step([7], [5], tables, 0.5)
    cache.append(0, ws.k_caches[0].view(-1, 1, 8)[4:5], ws.v_caches[0].view(-1, 1, 8)[4:5])
    q = torch.randn(1, 2, 8).bfloat16()
    expected = paged_decode_attention(q.float(), ws.k_caches[0].float(), ws.v_caches[0].float(), tables,
                                      torch.tensor([5]), 0.5).bfloat16()
    torch.testing.assert_close(cache.attention(0, q), expected)


@needs_kernel
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_with_and_without_the_kernel(dtype, monkeypatch):
    """The paged engine on a tiny model decodes the same tokens with the kernel as with the torch path, log-probs
    within float32 (and bfloat16) rounding, and the kernel served its decode steps (from Python, or inside the
    one-call decode of a few rows, `cpu_kernels.decode_token`)."""
    from astrai.models import AutoRegressiveLM, tiny_config
    from astrai.rollout.paged_engine import PagedGenerationEngine
    from astrai.rollout.sampling import SamplingParams

    torch.manual_seed(0)
    model = AutoRegressiveLM(tiny_config(vocab_size=64)).eval()
    prompts = [[1, 5, 9, 11], [3, 4], [7, 8, 9, 10, 11, 12]]
    calls = []
    real = cpu_kernels.dense_decode_attention

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    def generate():
        engine = PagedGenerationEngine(model, pad_token_id=0, dtype=dtype, prefix_cache=False,
                                       adaptive_threads=False)
        return engine.generate(prompts, SamplingParams(max_new_tokens=12), torch.Generator().manual_seed(2))

    monkeypatch.setattr(cpu_kernels, "dense_decode_attention", counted)
    real_token = cpu_kernels.decode_token_nocheck
    monkeypatch.setattr(cpu_kernels, "decode_token_nocheck", lambda *a: calls.append(1) or real_token(*a))
    with_kernel = generate()
    assert calls
    monkeypatch.setattr(cpu_kernels, "supports", lambda dtype: False)
    without = generate()
    assert torch.equal(with_kernel.response_ids, without.response_ids)
    tolerance = 1e-4 if dtype == "float32" else 2e-2
    torch.testing.assert_close(with_kernel.old_logprobs, without.old_logprobs, atol=tolerance, rtol=0)


def test_source_is_shipped_with_the_package():
    """The C sources and the header they include sit beside the module (package data), so an installed astrai can
    build them."""
    assert [source.name for source in cpu_kernels.SOURCES] == ["cpu_attention.c", "cpu_elementwise.c", "cpu_gemv.c",
                                                             "cpu_decode.c"]
    assert [header.name for header in cpu_kernels.HEADERS] == ["cpu_common.h"]
    for source in (*cpu_kernels.SOURCES, *cpu_kernels.HEADERS):
        assert source.is_file() and os.path.dirname(cpu_kernels.__file__) == str(source.parent)
