"""Prepacked GEMM weights for the engine's inference copy on CPU (oneDNN: bfloat16, and float32 off Intel CPUs).

Why: a bfloat16 `F.linear` on a CPU with AMX goes through oneDNN, which reorders the (out, in) weight into its
blocked (VNNI) layout inside every call: each decode step then reads every weight twice and writes it once more.
The engine's copy never trains, so it can keep that layout: `torch.ops.mkldnn._reorder_linear_weight` makes it once
and `torch.ops.mkldnn._linear_pointwise` multiplies by it (what torch.compile's CPU freezing pass does). Measured on
SmolLM2-135M shapes at batch 32, 30 layers each, one thread, weights not cache-resident: gate/up 18.1 -> 13.8 ms,
down 5.4 -> 4.1 ms, q/k/v 3.9 -> 2.8 ms; results bitwise equal to `F.linear` at every row count tried (1 to 2048).

float32: `F.linear` goes to MKL's sgemm, whose decode-sized products run far below the machine's rate on CPUs other
than Intel's. Measured on a 2-core AMD EPYC (AVX2, no AVX-512), SmolLM2-135M shapes, 30 layers each at batch 32, two
threads: q/k/v 19.3 -> 12.8 ms, gate/up 71.0 -> 38.1, down 31.1 -> 21.0, o 14.2 -> 9.4, LM head 51.8 -> 22.1 (MKL's
own packed sgemm: no faster); at 512 rows still 4-18% faster, at 2048 within 4% either way. On Intel CPUs float32
stays with `F.linear` (MKL): with AMX there its oneDNN path was not consistently faster. oneDNN's float32 results
differ from MKL's in rounding (about 1e-6 relative), so the engine's float32 log-probs move by that much against
the trainer's; `rollout/logprob_gap` shows it.

Correctness across weight syncs: each packed copy remembers the version counter of the tensor it was made from
(in-place copies bump it, also through views, so `copy_weights` into the fused q/k/v rows counts); `linear` repacks
a stale copy before using it, and the engine repacks eagerly in `load_weights` (`refresh`). A packed copy can
therefore never serve old weights.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["PackedLinear", "PrepackedWeights", "cpu_vendor", "prepack_available", "prepack_linears",
           "slow_half_precision"]

PACK_ROWS = 32  # the row count oneDNN is told to expect (a decode step's batch; any count works)


@functools.lru_cache(maxsize=1)
def cpu_vendor() -> str:
    """The x86 CPU's vendor string from /proc/cpuinfo (`GenuineIntel`, `AuthenticAMD`, ...); "" where unknown
    (other architectures, other systems)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def prepack_available(device: torch.device, dtype: torch.dtype) -> bool:
    """True where prepacked weights are used: a CPU engine with oneDNN's linear ops, in bfloat16 where oneDNN
    supports it, in float32 on an x86 CPU that is not Intel's (where MKL's decode-sized sgemm is slow; module doc)."""
    ops = getattr(torch.ops, "mkldnn", None)
    if not (torch.device(device).type == "cpu" and torch.backends.mkldnn.is_available() and ops is not None
            and hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")):
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32 and cpu_vendor() not in ("", "GenuineIntel")


def slow_half_precision(device: torch.device, dtype: Optional[torch.dtype]) -> Optional[str]:
    """A one-line warning when an engine in bfloat16 / float16 would run on a CPU without native support for it
    (no AVX-512 BF16 / AMX, resp. AVX-512 FP16 / AMX-FP16: oneDNN says), else None. There every half-precision
    GEMM is emulated: measured on a 2-core AMD EPYC (AVX2 only), SmolLM2-135M, 32 prompts, 2 threads: 4.1 tok/s in
    bfloat16 against 116-129 in float32 (`bench/engine_vs_vllm.py --child astrai`)."""
    if dtype not in (torch.bfloat16, torch.float16) or torch.device(device).type != "cpu":
        return None
    ops = getattr(torch.ops, "mkldnn", None)
    check = "_is_mkldnn_bf16_supported" if dtype == torch.bfloat16 else "_is_mkldnn_fp16_supported"
    if ops is None or not hasattr(ops, check) or bool(getattr(ops, check)()):
        return None
    name = str(dtype).removeprefix("torch.")
    return (f"engine dtype {name}: this CPU has no native {name} support (oneDNN finds no AVX-512 "
            f"{'BF16' if dtype == torch.bfloat16 else 'FP16'} or AMX), so every {name} GEMM is emulated: expect "
            f"it many times slower than float32 (30x measured on an AVX2 machine); use float32 (rollout.dtype)")


class PrepackedWeights:
    """oneDNN-layout copies of some (out, in) weight tensors, kept in step with them.

    `linear(x, weight, bias)` equals `F.linear(x, weight, bias)` (x (..., in) -> (..., out) in x's dtype); for a
    registered weight it multiplies by the packed copy, repacked first if the weight changed in place since.
    """

    def __init__(self) -> None:
        self._sources: dict[int, torch.Tensor] = {}
        self._packed: dict[int, tuple[int, torch.Tensor]] = {}  # id(weight) -> (weight._version, packed copy)
        self.repacks = 0

    def __len__(self) -> int:
        return len(self._sources)

    def add(self, weight: torch.Tensor) -> None:
        """Register a 2-D weight (kept alive here, so its id stays its key) and pack it."""
        self._sources[id(weight)] = weight
        self._pack(weight)

    def _pack(self, weight: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_ROWS)
        self._packed[id(weight)] = (weight._version, packed)
        self.repacks += 1
        return packed

    def refresh(self) -> int:
        """Repack every weight changed in place since it was packed; returns how many were."""
        stale = [w for key, w in self._sources.items() if self._packed[key][0] != w._version]
        for weight in stale:
            self._pack(weight)
        return len(stale)

    def packed(self, weight: torch.Tensor) -> Optional[torch.Tensor]:
        """The up-to-date packed copy of a registered `weight` (repacked if stale), or None if not registered."""
        entry = self._packed.get(id(weight))
        if entry is None or self._sources[id(weight)] is not weight:
            return None
        version, packed = entry
        return packed if version == weight._version else self._pack(weight)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`F.linear(x, weight, bias)`, through the packed copy when `weight` is registered (and no grad is
        wanted: the packed op has no backward)."""
        packed = self.packed(weight)
        if packed is None or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
            return F.linear(x, weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedLinear(nn.Linear):
    """An `nn.Linear` over the SAME Parameters as the one it replaces (names, ties and in-place copies unchanged)
    whose forward multiplies by their `PrepackedWeights` copy."""

    def __init__(self, linear: nn.Linear, packs: PrepackedWeights) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.packs = packs
        packs.add(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) -> (..., out), as `nn.Linear`."""
        return self.packs.linear(x, self.weight, self.bias)


@torch.no_grad()
def prepack_linears(model: nn.Module) -> PrepackedWeights:
    """Give an inference-only `AutoRegressiveLM` copy (after `fuse_projections`) prepacked weights: the fused
    q/k/v and gate/up tensors (through the layers' `linear` hook), the output and down projections and the LM head
    (replaced by `PackedLinear`s over the same Parameters). Other weights are left to `F.linear`.

    Returns the `PrepackedWeights` to `refresh` after a weight update (stale copies are also repacked on use).
    """
    packs = PrepackedWeights()
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for module, fused in ((attn, getattr(attn, "qkv_weight", None)), (mlp, getattr(mlp, "gate_up_weight", None))):
            if fused is not None:
                packs.add(fused)
                module.linear = packs.linear
        for parent, name in ((attn, "o_proj"), (mlp, "down_proj")):
            child = getattr(parent, name, None)
            if type(child) is nn.Linear:
                setattr(parent, name, PackedLinear(child, packs))
    if type(model.lm_head) is nn.Linear:
        model.lm_head = PackedLinear(model.lm_head, packs)
    return packs
