"""The compiled CPU kernels: decode attention (`cpu_attention.c`), the elementwise pieces of a layer and of the
sampler (`cpu_elementwise.c`: `rmsnorm`, `rotary_`, `gated_activation`, `store_kv`, `softmax_chunks`), the few-row
product `gemv` (`cpu_gemv.c`) and a decode step of a few rows through every layer, `decode_token` (`cpu_decode.c`;
docs/kernels.md says why and what each measured), built into one library with the machine's C compiler at first
use, cached, loaded through ctypes; the torch ops stay the fallback.

Why: in a CPU decode step of batch 32 the two batched matmuls of `DenseDecodeCache.attention` (scores (B, Nkv, G,
K) and their product with the values) multiply G = Nh / Nkv query rows by each (row, kv head) matrix, products too
small for MKL/oneDNN to reach the memory bandwidth, plus separate ops for the scale, mask, softmax and a float32
copy of half-precision caches. vLLM's CPU build runs one C++ kernel per layer instead; profiled side by side
(SmolLM2-135M, bfloat16, 32 rows, 2 threads, torch.profiler per decode step) its attention took 5.5 ms a step
against astrai's 9.8 ms of matmuls plus ~3 ms of the ops around them. This kernel does one layer in one call: each
(row, kv head) task reads that head's transposed keys and its values once, in their stored dtype (bfloat16 and
float16 convert exactly), and computes scores, soft-cap, softmax and output in float32 with the per-row lengths
(no mask tensor), the G queries of a kv head sharing every load. Measured on SmolLM2's shapes (B = 32, Nkv = 3,
G = 3, D = 64, lengths 120-204, 30 layers, two threads, AVX-512 BF16 CPU without AMX): 7.3 ms in bfloat16 and
10.3 ms in float32 against 12.5-14 ms for the torch path (float32 copies).

Build: `$CC` (default `cc`) with `-O3 -march=native -fopenmp -shared -fPIC`, once per sources (and header), compiler
and CPU (the cache key hashes them), into `$ASTR_KERNEL_CACHE` (default `$XDG_CACHE_HOME/astrai/kernels`, else
`~/.cache/astrai/kernels`), written to a temporary file and renamed, so concurrent builds never load a partial
file. OpenMP: the library must share torch's OpenMP runtime (two runtimes would spin against each other), so it is
used only where torch runs on GNU libgomp (the Linux wheels) and loading it maps no second one; its parallel
region takes `torch.get_num_threads()` threads (the adaptive thread count included). Anything else (no compiler,
a failed build, another runtime, `ASTR_CPU_KERNELS=0`) leaves the torch path, with the reason in
`unavailable_reason()` (the engine says it once).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shlex
import shutil
import signal
import struct
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

import torch

__all__ = ["SOURCES", "HEADERS", "DTYPE_CODES", "cache_dir", "library", "unavailable_reason", "supports",
           "dense_decode_attention", "rmsnorm", "rotary_", "gated_activation", "store_kv", "softmax_chunks",
           "rmsnorm_nocheck", "rotary_nocheck_", "gated_activation_nocheck", "store_kv_nocheck", "gemv",
           "gemv_nocheck", "DecodeLayer", "DecodeStep", "decode_scratch_bytes", "decode_token", "decode_token_nocheck"]

SOURCES = tuple(Path(__file__).with_name(name) for name in ("cpu_attention.c", "cpu_elementwise.c", "cpu_gemv.c",
                                                           "cpu_decode.c"))
"""The library's C sources: decode attention, the elementwise pieces of a layer (`rmsnorm`, `rotary_`,
`gated_activation`, `store_kv`) and of the sampler (`softmax_chunks`), the few-row product `gemv`, and one decode
token through every layer (`decode_token`)."""
HEADERS = (Path(__file__).with_name("cpu_common.h"),)
"""What the sources include (dtype codes, vector types, loads): hashed into the cache key with them."""
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
BUILD_TIMEOUT_S = 120  # about a second on a 2-core machine

_P, _I64, _F, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int


class DecodeLayer(ctypes.Structure):
    """`struct astrai_decode_layer` of cpu_decode.c: one layer's tensor addresses (None where absent), its sliding
    window (0: none) and score soft-cap (0: none), whether it reads the local rotary table and uses GELU."""

    _fields_ = [(name, _P) for name in (
        "input_norm", "post_attention_norm", "pre_feedforward_norm", "post_feedforward_norm", "q_norm", "k_norm",
        "qkv_weight", "qkv_bias", "o_weight", "o_bias", "gate_up_weight", "down_weight", "down_bias",
        "k_pages", "v_pages", "dense_keys", "dense_values")] + [
        ("window", _I64), ("softcap", _F), ("local_rotary", ctypes.c_int32), ("gelu", ctypes.c_int32)]


class DecodeStep(ctypes.Structure):
    """`struct astrai_decode_step` of cpu_decode.c: the model's sizes, the step's B rows and the addresses of their
    slots and positions (int64 (B,)), attended lengths (int32 (B,)) and rotary rows ((B, D) each)."""

    _fields_ = [(name, _I64) for name in ("layers", "B", "H", "Nh", "Nkv", "D", "I", "cap")] + [
        (name, _P) for name in ("slots", "positions", "lens", "cos", "sin", "cos_local", "sin_local")] + [
        (name, ctypes.c_int32) for name in ("dtype", "unit_offset", "num_threads")] + [("eps", _F), ("scale", _F)]
_reason: Optional[str] = None


def cache_dir() -> Path:
    """Where built libraries are kept: `$ASTR_KERNEL_CACHE`, else `$XDG_CACHE_HOME/astrai/kernels`, else
    `~/.cache/astrai/kernels`."""
    explicit = os.environ.get("ASTR_KERNEL_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "astrai" / "kernels"


def _openmp_runtimes() -> set[str]:
    """Paths of the OpenMP runtimes mapped into this process (/proc/self/maps; empty where it cannot be read)."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            paths = {line.split()[-1] for line in f if line.rstrip().endswith(".so") or ".so." in line}
    except OSError:
        return set()
    return {p for p in paths if os.path.basename(p).startswith(("libgomp", "libiomp", "libomp"))}


def _machine() -> str:
    """The CPU's model name and flags (the library is built for this CPU: -march=native)."""
    try:
        lines = Path("/proc/cpuinfo").read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags", "Features"))}))


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """`cmd` in its own session, output captured; past `timeout` seconds the whole process group is killed (a
    compiler driver's children too) and `subprocess.TimeoutExpired` raised."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _build(compiler: list[str], target: Path) -> Optional[str]:
    """Compile SOURCES into one library at `target` (a temporary file renamed, mode 0755 so that other users of a
    shared cache can load it); None on success, else a one-line reason."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=target.stem + ".", suffix=".so.tmp", dir=target.parent)
        os.close(fd)
    except OSError as err:
        return f"cannot write the kernel cache {target.parent} ({err.strerror or err}; set ASTR_KERNEL_CACHE)"
    name, what = " ".join(compiler), " and ".join(source.name for source in SOURCES)
    try:
        proc = _run([*compiler, *FLAGS, "-o", tmp, *map(str, SOURCES), "-lm"], BUILD_TIMEOUT_S)
        if proc.returncode != 0:
            lines = proc.stderr.strip().splitlines()
            fallback = lines[0] if lines else f"exit {proc.returncode}"
            first = next((ln for ln in lines if "error" in ln.lower()), fallback)
            return f"{name} failed to build {what}: {first.strip()}"
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)
        return None
    except subprocess.TimeoutExpired:
        return f"{name} did not build {what} within {BUILD_TIMEOUT_S} s (killed)"
    except (OSError, subprocess.SubprocessError) as err:
        return f"{name} could not build {what}: {type(err).__name__}: {err}"
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _elf_complete(target: Path) -> bool:
    """True unless `target` is a 64-bit little-endian ELF file cut short: a segment to be mapped (PT_LOAD) or its
    section headers reaching past the file's end. dlopen maps such a file and the process dies of SIGBUS when the
    missing pages are touched, so a truncated cached library must be caught before it is opened."""
    try:
        with open(target, "rb") as f:
            data = f.read()
    except OSError:
        return False
    if len(data) < 64 or data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return True  # not a 64-bit little-endian ELF: dlopen refuses it cleanly
    phoff, shoff = struct.unpack_from("<QQ", data, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", data, 0x36)
    if shoff + shnum * shentsize > len(data) or phoff + phnum * phentsize > len(data):
        return False
    for i in range(phnum):
        kind, = struct.unpack_from("<I", data, phoff + i * phentsize)
        offset, = struct.unpack_from("<Q", data, phoff + i * phentsize + 8)
        size, = struct.unpack_from("<Q", data, phoff + i * phentsize + 32)
        if kind == 1 and offset + size > len(data):
            return False
    return True


def _open(target: Path, *, fresh: bool = False) -> ctypes.CDLL:
    """The library at `target`, its functions looked up. `fresh`: open it under another name
    (/proc/self/fd/N), for a file rebuilt after a failed load: the dynamic loader hands back the library it already
    loaded under a path it has seen. Raises OSError (not a loadable library) or AttributeError (not this one)."""
    if not _elf_complete(target):
        raise OSError(f"{target} is cut short")
    fd = os.open(target, os.O_RDONLY) if fresh else None
    try:
        lib = ctypes.CDLL(f"/proc/self/fd/{fd}" if fresh else str(target))
        for name in ("astrai_cpu_attention_supports", "astrai_dense_decode_attention", "astrai_cpu_attention_openmp",
                     "astrai_rmsnorm", "astrai_rotary", "astrai_gated_activation", "astrai_store_kv",
                     "astrai_softmax_chunks", "astrai_gemv", "astrai_decode_token", "astrai_decode_scratch_bytes"):
            getattr(lib, name)
        return lib
    finally:
        if fd is not None:
            os.close(fd)


def _unusable(lib: ctypes.CDLL, target: Path, runtimes: set[str]) -> Optional[str]:
    """Why a loaded library must not be used (a rebuild would not change it), or None after typing its functions."""
    if _openmp_runtimes() != runtimes:
        extra = ", ".join(sorted(_openmp_runtimes() - runtimes))
        return f"{target.name} mapped a second OpenMP runtime ({extra})"
    lib.astrai_cpu_attention_openmp.restype = _I
    if not lib.astrai_cpu_attention_openmp():
        return f"{target.name} was built without OpenMP (one thread; the torch path uses every thread)"
    lib.astrai_cpu_attention_supports.argtypes, lib.astrai_cpu_attention_supports.restype = [_I], _I
    lib.astrai_dense_decode_attention.argtypes = [_P, _I64, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _I, _F, _I64,
                                                  _F, _P, _I]
    lib.astrai_dense_decode_attention.restype = _I
    lib.astrai_rmsnorm.argtypes, lib.astrai_rmsnorm.restype = [_P, _I64, _P, _P, _I64, _I64, _F, _I, _I, _I], _I
    lib.astrai_rotary.argtypes, lib.astrai_rotary.restype = [_P, _I64, _P, _P, _I64, _I64, _I64, _I, _I], _I
    lib.astrai_gated_activation.argtypes = [_P, _I64, _P, _I64, _I64, _I, _I, _I]
    lib.astrai_gated_activation.restype = _I
    lib.astrai_store_kv.argtypes = [_P, _I64, _P, _I64, _P, _P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I]
    lib.astrai_store_kv.restype = _I
    lib.astrai_softmax_chunks.argtypes = [_P, _I64, _I64, _I64, _I64, _P, _P, _P, _I]
    lib.astrai_softmax_chunks.restype = _I
    lib.astrai_gemv.argtypes, lib.astrai_gemv.restype = [_P, _I64, _I64, _P, _P, _I64, _I64, _P, _I, _I], _I
    lib.astrai_decode_token.argtypes = [ctypes.POINTER(DecodeStep), ctypes.POINTER(DecodeLayer), _P, _P]
    lib.astrai_decode_token.restype = _I
    lib.astrai_decode_scratch_bytes.argtypes = [_I64, _I64, _I64, _I64, _I64, _I64, _I]
    lib.astrai_decode_scratch_bytes.restype = _I64
    return None


@functools.lru_cache(maxsize=1)
def library() -> Optional[ctypes.CDLL]:
    """The loaded kernel library (built first if this machine has none cached, or none that loads), or None with
    the reason in `unavailable_reason()`. Decided once per process."""
    global _reason
    if os.environ.get("ASTR_CPU_KERNELS", "").strip().lower() in ("0", "off", "false", "no"):
        _reason = "turned off by ASTR_CPU_KERNELS"
        return None
    torch.ones(2, 2).sum()  # torch's CPU ops (and their OpenMP runtime) are loaded once a kernel has run
    runtimes = _openmp_runtimes()
    if not any(os.path.basename(p).startswith("libgomp") for p in runtimes):
        _reason = (f"torch's OpenMP runtime is not GNU libgomp ({', '.join(sorted(runtimes)) or 'none found'}), "
                   "and the kernel must share it")
        return None
    compiler = shlex.split(os.environ.get("CC") or "cc")  # `CC="ccache gcc"`: a program and its arguments
    path = shutil.which(compiler[0]) if compiler else None
    if path is None:
        _reason = f"no C compiler found ({compiler[0] if compiler else ''!r} is not on PATH; set CC)"
        return None
    compiler = [path, *compiler[1:]]
    try:
        version = _run([*compiler, "--version"], 60).stdout
    except (OSError, subprocess.SubprocessError) as err:
        _reason = f"the C compiler {' '.join(compiler)} did not answer --version: {type(err).__name__}"
        return None
    texts = [source.read_text() for source in (*SOURCES, *HEADERS)]
    key = hashlib.sha256("\n".join([*texts, *compiler, version, " ".join(FLAGS), _machine()]).encode()).hexdigest()[:16]
    target = cache_dir() / f"cpu_attention-{key}.so"
    tried, lib = target.is_file(), None
    if tried:
        try:
            lib = _open(target)
        except (OSError, AttributeError):
            pass  # truncated, overwritten, foreign: built again below
    if lib is None:
        _reason = _build(compiler, target)
        if _reason is not None:
            return None
        try:
            lib = _open(target, fresh=tried)
        except (OSError, AttributeError) as err:
            _reason = f"could not load {target}: {err}"
            return None
    _reason = _unusable(lib, target, runtimes)
    return lib if _reason is None else None


def unavailable_reason() -> Optional[str]:
    """None when the kernel library is loaded, else one line saying why not (after `library()` was asked)."""
    return None if library() is not None else _reason


def supports(dtype: torch.dtype) -> bool:
    """True when the kernels are available and read `dtype` (float32, bfloat16; float16 where the compiler has
    `_Float16`)."""
    lib = library()
    return lib is not None and dtype in DTYPE_CODES and bool(lib.astrai_cpu_attention_supports(DTYPE_CODES[dtype]))


def dense_decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lens: torch.Tensor,
                           scale: float, *, window: Optional[int] = None, softcap: Optional[float] = None
                           ) -> torch.Tensor:
    """Decode attention of one layer over dense per-row copies (the layout of `cpu_attention.c`'s header).

    Args:
        q: (B, Nh, D) CPU tensor of the caches' dtype, last dim contiguous and head stride D (rows may be strided).
        keys: (B, Nkv, D, cap) contiguous, transposed keys; values: (B, Nkv, cap, D) contiguous; same dtype.
        lens: (B,) int32 contiguous: row b attends to positions [0, lens[b]) (or its last `window` of them),
            each 1 <= lens[b] <= cap.
        scale: softmax scale; window: sliding window or None; softcap: score soft-cap c (c * tanh(s / c)) or None.

    Returns:
        (B, Nh, D) float32.

    Raises:
        RuntimeError: the kernel is unavailable (call `supports` first) or could not allocate its buffers.
    """
    lib = _loaded()
    rows, heads, dim = q.shape
    out = torch.empty(rows, heads, dim, dtype=torch.float32)
    status = lib.astrai_dense_decode_attention(
        q.data_ptr(), q.stride(0), keys.data_ptr(), values.data_ptr(), lens.data_ptr(), rows, heads, keys.shape[1],
        dim, keys.shape[3], DTYPE_CODES[keys.dtype], scale, window or 0, softcap or 0.0, out.data_ptr(),
        torch.get_num_threads())
    if status:
        raise RuntimeError(f"the CPU attention kernel failed (status {status}: "
                           f"{'out of memory' if status == 1 else 'unsupported dtype'})")
    return out


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """x (..., C) as rows of C elements at one stride: (x or a contiguous copy, row count, row stride)."""
    cols = x.shape[-1]
    rows = x.numel() // cols if cols else 0
    if x.dim() == 2 and x.stride(-1) == 1 and x.stride(0) >= cols:
        return x, rows, x.stride(0)
    if not x.is_contiguous():
        x = x.contiguous()
    return x, rows, cols  # contiguous: rows at stride C whatever the strides of size-1 dimensions say


def _code(x: torch.Tensor, what: str, *same: torch.Tensor) -> int:
    """The kernel's code of x's dtype, after checking that x and the tensors `same` are CPU tensors of one dtype
    the kernels read; raises ValueError naming `what` otherwise."""
    tensors = (x, *same)
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        raise ValueError(f"{what}: expected tensors, got {[type(t).__name__ for t in tensors]}")
    code = DTYPE_CODES.get(x.dtype)
    if code is None or any(t.dtype != x.dtype or t.device.type != "cpu" for t in tensors):
        found = ", ".join(f"{str(t.dtype).removeprefix('torch.')} on {t.device}" for t in tensors)
        raise ValueError(f"{what}: expected CPU float32/bfloat16/float16 tensors of one dtype, got {found}")
    return code


def _loaded() -> ctypes.CDLL:
    """`library()`, or RuntimeError saying why it is unavailable (call `supports` first)."""
    lib = library()
    if lib is None:
        raise RuntimeError(f"the CPU kernels are unavailable: {_reason}")
    return lib


def _check(status: int, what: str) -> None:
    if status:
        raise RuntimeError(f"the CPU {what} kernel failed (status {status}: unsupported dtype or shape)")


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich 2019) in one call, as `astrai.models.layers.RMSNorm.forward`.

    Args:
        x: (..., H) CPU tensor (float32, bfloat16 or float16); weight: (H,) contiguous, same dtype.
        eps: added to mean(x^2); unit_offset: Gemma's form, y = h * (1 + weight) in float32.

    Returns:
        (..., H) in x's dtype: weight * round(x / sqrt(mean(x^2) + eps)) with the norm in float32 (`cpu_elementwise.c`
        has the rounding; the sum's order differs from torch's: about 1e-6 relative in float32).

    Raises:
        RuntimeError: the kernel is unavailable (call `supports` first); ValueError: another dtype or device, a
            weight of another dtype, length or layout.
    """
    _loaded()
    _code(x, "rmsnorm", weight)
    if weight.shape != x.shape[-1:] or not weight.is_contiguous():
        raise ValueError(f"rmsnorm: weight must be a contiguous ({x.shape[-1]},) tensor, got {tuple(weight.shape)}")
    return rmsnorm_nocheck(x, weight, eps, unit_offset)


def rmsnorm_nocheck(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor:
    """`rmsnorm` without its argument checks (the engine's hook: its layers' shapes and dtype are checked once)."""
    x2, rows, row = _rows(x)
    out = torch.empty(x.shape, dtype=x.dtype)
    _check(library().astrai_rmsnorm(x2.data_ptr(), row, weight.data_ptr(), out.data_ptr(), rows, x.shape[-1], eps,
                                    int(unit_offset), DTYPE_CODES[x.dtype], torch.get_num_threads()), "RMSNorm")
    return out


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (RoFormer, Su et al. 2021) in place, as `astrai.models.layers.apply_rotary` (bitwise).

    Args:
        x: (B, S, heads, D) CPU tensor, head stride D and last dim contiguous, tokens at one stride (B * S of
            them; a view into a fused q/k/v output is fine).
        cos, sin: (B, S, 1, D) contiguous, x's dtype.

    Returns:
        x, each head of each token rotated: x * cos + rotate_half(x) * sin, rounded as torch rounds it.

    Raises:
        RuntimeError: the kernel is unavailable, or D is odd; ValueError: another dtype or device, or shapes and
            layouts other than the above.
    """
    _loaded()
    _code(x, "rotary_", cos, sin)
    if x.dim() != 4 or cos.shape != sin.shape or cos.numel() != x.shape[0] * x.shape[1] * x.shape[3]:
        raise ValueError(f"rotary_: x needs (B, S, heads, D) and cos/sin (B, S, 1, D), got {tuple(x.shape)} and "
                         f"{tuple(cos.shape)} / {tuple(sin.shape)}")
    return rotary_nocheck_(x, cos, sin)


def rotary_nocheck_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`rotary_` without its dtype and shape checks (the engine's hook), the layout still checked (views vary)."""
    b, s, heads, dim = x.shape
    if x.stride(-1) != 1 or x.stride(-2) != dim or (b > 1 and x.stride(0) != s * x.stride(1)):
        raise ValueError(f"rotary_: x needs (B, S, heads, D) with head stride D, got strides {x.stride()}")
    cos, sin = cos.contiguous(), sin.contiguous()
    _check(library().astrai_rotary(x.data_ptr(), x.stride(1), cos.data_ptr(), sin.data_ptr(), b * s, heads, dim,
                                   DTYPE_CODES[x.dtype], torch.get_num_threads()), "rotary")
    return x


def gated_activation(gate_up: torch.Tensor, gelu: bool = False) -> torch.Tensor:
    """act(gate) * up in one call, as `astrai.models.layers.MLP` (SiLU, or GELU's tanh form with `gelu`).

    Args:
        gate_up: (..., 2 I) CPU tensor, the gate in the first I columns and up in the last I (the fused gate/up
            GEMM's output).

    Returns:
        (..., I) in gate_up's dtype: round(round(act(gate)) * up), act in float32.

    Raises:
        RuntimeError: the kernel is unavailable; ValueError: another dtype or device, or an odd last dim.
    """
    _loaded()
    _code(gate_up, "gated_activation")
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gated_activation: the last dim holds gate and up, so it must be even, got "
                         f"{gate_up.shape[-1]}")
    return gated_activation_nocheck(gate_up, gelu)


def gated_activation_nocheck(gate_up: torch.Tensor, gelu: bool = False) -> torch.Tensor:
    """`gated_activation` without its argument checks (the engine's hook)."""
    x, rows, row = _rows(gate_up)
    inner = gate_up.shape[-1] // 2
    out = torch.empty(*gate_up.shape[:-1], inner, dtype=gate_up.dtype)
    _check(library().astrai_gated_activation(x.data_ptr(), row, out.data_ptr(), rows, inner, int(gelu),
                                             DTYPE_CODES[gate_up.dtype], torch.get_num_threads()),
           "gated activation")
    return out


def store_kv(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
             positions: torch.Tensor, dense_keys: torch.Tensor, dense_values: torch.Tensor) -> None:
    """Store one decode step's keys and values of one layer in the paged cache and in the dense copies of
    `DenseDecodeCache` (the kernel's layout) in one call, bit for bit (`write_kv` plus `DenseDecodeCache.append`).

    Args:
        k, v: (B, Nkv, D) CPU tensors, head stride D, last dim contiguous (rows may be strided), the caches' dtype.
        slots: (B,) int64 contiguous flat paged slots; k_pages, v_pages: (blocks, block_size, Nkv, D) contiguous.
        positions: (B,) int64 contiguous, row b's position in the dense copies. Slots and positions must lie
            inside the caches: their values are not checked here (a pass over them each layer; the engine's own
            come from its block tables).
        dense_keys: (B, Nkv, D, cap) contiguous (transposed keys); dense_values: (B, Nkv, cap, D) contiguous.

    Raises:
        RuntimeError: the kernel is unavailable; ValueError: dtypes or layouts other than the above.
    """
    _loaded()
    _code(k, "store_kv", v, k_pages, v_pages, dense_keys, dense_values)
    rows, heads, dim = k.shape
    layouts = (v.shape == k.shape and k.stride()[1:] == v.stride()[1:] == (dim, 1)
               and k_pages.shape[-2:] == v_pages.shape[-2:] == (heads, dim) and k_pages.is_contiguous()
               and v_pages.is_contiguous() and dense_keys.is_contiguous() and dense_values.is_contiguous()
               and dense_keys.shape[:3] == (rows, heads, dim) and dense_values.shape == (rows, heads,
                                                                                          dense_keys.shape[-1], dim)
               and slots.dtype == positions.dtype == torch.int64 and slots.shape == positions.shape == (rows,)
               and slots.is_contiguous() and positions.is_contiguous())
    if not layouts:
        raise ValueError("store_kv: expected k, v (B, Nkv, D) with head stride D, contiguous pages (.., Nkv, D), "
                         "dense keys (B, Nkv, D, cap) and values (B, Nkv, cap, D), int64 slots and positions (B,)")
    store_kv_nocheck(k, v, slots, k_pages, v_pages, positions, dense_keys, dense_values)


def store_kv_nocheck(k, v, slots, k_pages, v_pages, positions, dense_keys, dense_values) -> None:
    """`store_kv` without its argument checks (`DenseDecodeCache.store`, whose buffers are its own)."""
    rows, heads, dim = k.shape
    _check(library().astrai_store_kv(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), slots.data_ptr(),
                                     k_pages.data_ptr(), v_pages.data_ptr(), positions.data_ptr(),
                                     dense_keys.data_ptr(), dense_values.data_ptr(), rows, heads, dim,
                                     dense_keys.shape[-1], DTYPE_CODES[k.dtype]), "KV store")


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for a few rows, streaming each weight row once (`cpu_gemv.c`): the products of the
    engine's decode steps of one to `TOKEN_ROWS` (8) rows (`cpu_decode.c`), where it beats oneDNN's at one and two
    rows and the saved glue pays for it up to eight (docs/kernels.md). Inference only: no gradient.

    Args:
        x: (..., K) CPU tensor (float32, bfloat16 or float16), last dim contiguous; weight: (N, K) contiguous, the
            same dtype; bias: (N,) contiguous or None.

    Returns:
        (..., N) in x's dtype: the float32 sum of float32 products (its order differs from oneDNN's and MKL's:
        about 1e-6 relative in float32, and is the same for a row whatever the rows beside it and the thread count),
        plus the bias, rounded once. bfloat16 on a CPU with AVX-512 BF16 uses its
        dot-product instruction, which reads subnormal inputs (below 1.2e-38) as zero.

    Raises:
        RuntimeError: the kernel is unavailable; ValueError: not tensors, another dtype or device, or mismatched
            shapes.
    """
    _loaded()
    _code(x, "gemv", weight, *(() if bias is None else (bias,)))
    if x.dim() < 1 or weight.dim() != 2 or weight.shape[1] != x.shape[-1] or (
            bias is not None and bias.shape != weight.shape[:1]):
        raise ValueError(f"gemv: x (..., K), weight (N, K) contiguous and bias (N,) expected, got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)}, {None if bias is None else tuple(bias.shape)}")
    strided = [f"{name} (strides {tuple(t.stride())})" for name, t in (("weight", weight), ("bias", bias))
               if t is not None and not t.is_contiguous()]
    if strided:
        raise ValueError(f"gemv: {' and '.join(strided)} must be contiguous; pass .contiguous()")
    return gemv_nocheck(x, weight, bias)


def gemv_nocheck(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`gemv` without its argument checks."""
    if x.shape[-1] == 0:  # empty sums: the bias alone, as F.linear
        out = torch.zeros(*x.shape[:-1], weight.shape[0], dtype=x.dtype)
        return out if bias is None else out.add_(bias)
    x2, rows, row = _rows(x)
    out = torch.empty(*x.shape[:-1], weight.shape[0], dtype=x.dtype)
    _check(library().astrai_gemv(x2.data_ptr(), row, rows, weight.data_ptr(), None if bias is None else
                                 bias.data_ptr(), weight.shape[0], weight.shape[1], out.data_ptr(),
                                 DTYPE_CODES[x.dtype], torch.get_num_threads()), "gemv")
    return out


def decode_scratch_bytes(rows: int, hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int,
                         dtype: torch.dtype) -> int:
    """Bytes of scratch `decode_token` needs for `rows` rows of a model of these sizes in `dtype`.

    Raises:
        RuntimeError: the kernels are unavailable; ValueError: a size below 1 or a dtype the kernels do not read.
    """
    sizes = {"rows": rows, "hidden": hidden, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
             "intermediate": intermediate}
    bad = [name for name, value in sizes.items() if isinstance(value, bool) or not isinstance(value, int) or value < 1]
    if bad or dtype not in DTYPE_CODES:
        raise ValueError(f"decode_scratch_bytes: sizes >= 1 and a float32/bfloat16/float16 dtype expected, got "
                         f"{sizes} and {dtype}")
    return int(_loaded().astrai_decode_scratch_bytes(rows, hidden, heads, kv_heads, head_dim, intermediate,
                                                     DTYPE_CODES[dtype]))


def decode_token(step: DecodeStep, layers, h: torch.Tensor, scratch: torch.Tensor) -> None:
    """One decode token of each of `step.B` rows through every decoder layer in one call (`cpu_decode.c`), h
    (B, H) updated in place.

    Args:
        step: the sizes and this step's inputs; layers: a `DecodeLayer` array of `step.layers` entries (the
            callers' own: `astrai.rollout.cpu_decode.FlatTrunk` fills them from its layers and the step's caches);
        h: (B, H) contiguous in the model's dtype; scratch: a contiguous uint8 tensor of at least
            `decode_scratch_bytes(B, ...)` bytes.

    The sizes of h and the scratch are checked against `step` here; the addresses in `step` and `layers` are not:
    they must point at live tensors of the sizes `step` gives (the weights, the paged cache and the dense copies).

    Raises:
        RuntimeError: the kernel is unavailable, or failed (out of memory for the attention's buffers);
        ValueError: h or the scratch do not fit `step`, or len(layers) != step.layers.
    """
    dtype = {code: dtype for dtype, code in DTYPE_CODES.items()}.get(step.dtype)
    need = decode_scratch_bytes(step.B, step.H, step.Nh, step.Nkv, step.D, step.I, dtype) if dtype else 0
    if (dtype is None or h.dtype != dtype or tuple(h.shape) != (step.B, step.H) or not h.is_contiguous()
            or scratch.dtype != torch.uint8 or not scratch.is_contiguous() or scratch.numel() < need
            or len(layers) != step.layers or h.device.type != "cpu" or scratch.device.type != "cpu"):
        raise ValueError(f"decode_token: h must be a contiguous CPU ({step.B}, {step.H}) tensor of the step's dtype "
                         f"and the scratch {need} contiguous CPU bytes for {step.layers} layers, got h "
                         f"{tuple(h.shape)} {h.dtype}, scratch {scratch.numel()} {scratch.dtype}, {len(layers)} "
                         "layers")
    decode_token_nocheck(step, layers, h, scratch)


def decode_token_nocheck(step: DecodeStep, layers, h: torch.Tensor, scratch: torch.Tensor) -> None:
    """`decode_token` without its size checks (the engine's step: `FlatTrunk` sized its scratch and h itself and
    sends at most the rows it sized it for)."""
    _check(library().astrai_decode_token(ctypes.byref(step), layers, h.data_ptr(), scratch.data_ptr()),
           "decode token")


def softmax_chunks(scaled: torch.Tensor, probs: torch.Tensor, chunk_mass: torch.Tensor, maxes: torch.Tensor,
                   chunk: int) -> None:
    """The sampler's first pass in one call per step (`astrai.rollout.row_sampling.sample_rows`): per row r,
    `maxes[r] = max(scaled[r])`, `probs[r, :V] = exp(scaled[r] - maxes[r])` (its padding columns zeroed) and
    `chunk_mass[r, c]` = the float64 sum of its c-th `chunk` columns. exp is within 2 ulp of torch's.

    Args:
        scaled: (R, V) float32 CPU tensor, last dim contiguous; probs: (R, C * chunk) float32 contiguous with
            C = ceil(V / chunk); chunk_mass: (R, C) float64 contiguous; maxes: (R,) float32 contiguous;
            chunk: a multiple of 16. A row whose max is not finite gets only its max (the caller raises).

    Raises:
        RuntimeError: the kernel is unavailable or `chunk` is not a multiple of 16; ValueError: other dtypes or
            shapes.
    """
    lib = _loaded()
    rows, vocab = scaled.shape
    chunks = -(-vocab // chunk)
    if not (scaled.dtype == probs.dtype == maxes.dtype == torch.float32 and chunk_mass.dtype == torch.float64
            and scaled.stride(-1) == 1 and probs.shape == (rows, chunks * chunk) and probs.is_contiguous()
            and chunk_mass.shape == (rows, chunks) and chunk_mass.is_contiguous() and maxes.numel() == rows
            and maxes.is_contiguous()):
        raise ValueError("softmax_chunks: expected float32 scaled (R, V), probs (R, C * chunk), maxes (R,) and "
                         "float64 chunk_mass (R, C), contiguous")
    _check(lib.astrai_softmax_chunks(scaled.data_ptr(), scaled.stride(0), rows, vocab, chunk, probs.data_ptr(),
                                     chunk_mass.data_ptr(), maxes.data_ptr(), torch.get_num_threads()),
           "softmax chunks")
