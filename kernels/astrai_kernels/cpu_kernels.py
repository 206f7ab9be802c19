"""The compiled CPU decode attention (`cpu_attention.c`): built with the machine's C compiler at first use, cached,
loaded through ctypes; the torch path stays the fallback.

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

Build: `$CC` (default `cc`) with `-O3 -march=native -fopenmp -shared -fPIC`, once per source, compiler and CPU (the
cache key hashes them), into `$ASTR_KERNEL_CACHE` (default `$XDG_CACHE_HOME/astrai/kernels`, else
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
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

import torch

__all__ = ["SOURCE", "DTYPE_CODES", "cache_dir", "library", "unavailable_reason", "supports", "dense_decode_attention"]

SOURCE = Path(__file__).with_name("cpu_attention.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
BUILD_TIMEOUT_S = 120  # about a second on a 2-core machine

_P, _I64, _F, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
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
    """Compile SOURCE into `target` (a temporary file renamed, mode 0755 so that other users of a shared cache can
    load it); None on success, else a one-line reason."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=target.stem + ".", suffix=".so.tmp", dir=target.parent)
        os.close(fd)
    except OSError as err:
        return f"cannot write the kernel cache {target.parent} ({err.strerror or err}; set ASTR_KERNEL_CACHE)"
    name = " ".join(compiler)
    try:
        proc = _run([*compiler, *FLAGS, "-o", tmp, str(SOURCE), "-lm"], BUILD_TIMEOUT_S)
        if proc.returncode != 0:
            lines = proc.stderr.strip().splitlines()
            fallback = lines[0] if lines else f"exit {proc.returncode}"
            first = next((ln for ln in lines if "error" in ln.lower()), fallback)
            return f"{name} failed to build {SOURCE.name}: {first.strip()}"
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)
        return None
    except subprocess.TimeoutExpired:
        return f"{name} did not build {SOURCE.name} within {BUILD_TIMEOUT_S} s (killed)"
    except (OSError, subprocess.SubprocessError) as err:
        return f"{name} could not build {SOURCE.name}: {type(err).__name__}: {err}"
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _open(target: Path, *, fresh: bool = False) -> ctypes.CDLL:
    """The library at `target`, its three functions looked up. `fresh`: open it under another name
    (/proc/self/fd/N), for a file rebuilt after a failed load: the dynamic loader hands back the library it already
    loaded under a path it has seen. Raises OSError (not a loadable library) or AttributeError (not this one)."""
    fd = os.open(target, os.O_RDONLY) if fresh else None
    try:
        lib = ctypes.CDLL(f"/proc/self/fd/{fd}" if fresh else str(target))
        for name in ("astrai_cpu_attention_supports", "astrai_dense_decode_attention", "astrai_cpu_attention_openmp"):
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
    key = hashlib.sha256("\n".join([SOURCE.read_text(), *compiler, version, " ".join(FLAGS), _machine()])
                         .encode()).hexdigest()[:16]
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
    """True when the kernel is available and reads `dtype` (float32, bfloat16; float16 where the compiler has
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
    lib = library()
    if lib is None:
        raise RuntimeError(f"the CPU attention kernel is unavailable: {_reason}")
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
