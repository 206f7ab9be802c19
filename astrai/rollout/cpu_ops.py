"""The elementwise pieces of the engine's CPU forward in compiled code: RMSNorm, rotary and the gated activation.

Why: a decode step's GEMMs are a few large calls, but between them each decoder layer ran about 20 small torch ops
(the two norms' upcast, pow, mean, add, rsqrt, two multiplies and downcast; rotary's multiplies, negation, concat
and add; SiLU and the multiply by up), each dispatched on its own and forked over the OpenMP team: about 600 per
SmolLM2-135M step. vLLM's CPU build has one C++ kernel per piece (and compiles the rest with inductor).
`use_cpu_kernels` points the inference copy's layers at the compiled kernels of `astrai.kernels.cpu_kernels`
(`cpu_elementwise.c`), one call per piece, through the hooks the layers offer for inference copies
(`RMSNorm.kernel`, `Attention.rotary`, `MLP.gated`); the training model never has them set.

Numerics: rotary is bitwise torch's; the norm differs by the order of its float32 sum and the activation by the
last bit of exp (float32: about 1e-6 relative; bfloat16 / float16: now and then a last bit, which the layers carry
on: SmolLM2's greedy bf16 log-probs moved by up to 0.085, within bf16's own 0.07-0.14 from float32), so the engine's
log-probs move against the trainer's by about that much (`rollout/logprob_gap`).
"""

from __future__ import annotations

import torch
from torch import nn

from astrai.kernels import cpu_kernels
from astrai.models.layers import MLP, Attention, RMSNorm

__all__ = ["use_cpu_kernels"]


def use_cpu_kernels(model: nn.Module, dtype: torch.dtype) -> bool:
    """Point the norms, rotary embeddings and gated activations of an inference-only `AutoRegressiveLM` copy on
    the CPU (after `fuse_projections`, so that each gated MLP has its fused gate/up output) at the compiled kernels.

    Args:
        model: the engine's copy (eval, no grad), its parameters in `dtype`.
        dtype: the copy's dtype.

    The hooks are the kernels' unchecked forms (`*_nocheck`): the copy's dtype is checked here, once, and its
    layers' shapes are its own.

    Returns:
        True when the kernels are in use, False where the library is unavailable (the reason is
        `cpu_kernels.unavailable_reason()`) or does not read `dtype`: the layers keep their torch ops.
    """
    if not cpu_kernels.supports(dtype):
        return False
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.kernel = cpu_kernels.rmsnorm_nocheck
        elif isinstance(module, Attention):
            module.rotary = cpu_kernels.rotary_nocheck_
        elif isinstance(module, MLP) and module.gate_up_weight is not None:
            module.gated = cpu_kernels.gated_activation_nocheck
    return True
