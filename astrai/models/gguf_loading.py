"""Reading llama.cpp GGUF files: metadata, tensors dequantized to float32 with the `gguf` package, HF names.

The header is parsed here (GGUF v2/v3: magic, version, tensor count, key/value pairs, tensor infos, aligned data)
rather than by `gguf.GGUFReader`, which builds a Python object per array element (about 16 s for Gemma 3's
262k-token vocabulary on this CPU): `gguf_architecture` reads only up to `general.architecture` (the first key
llama.cpp writes), so an unsupported file is refused in milliseconds, before its vocabulary or tensors are read;
tensors are memory-mapped and dequantized one at a time with `gguf.quants.dequantize` (F32, F16, Q4_0..Q8_0,
Q4_K, Q5_K, Q6_K, ...).

Per architecture (`GGUF_FAMILIES`): the astrai `model_type`, llama.cpp's tensor names, and what its converter did
to the weights: for `llama` it permuted the q/k rows for its interleaved rotary layout (undone by `_unpermute`:
per head the rows (D/2, 2) go back to (2, D/2)); for Gemma it stored RMSNorm weights as 1 + w (w restored).
llama.cpp writes no sliding-window pattern, local rotary base or query_pre_attn_scalar for Gemma; they are taken
as llama.cpp's own model code sets them (Gemma 3: every 6th layer full, local base 10000; the softmax scale from
head_dim, or from hidden / heads for the 27B shapes, as llama.cpp does). Llama 3's rotary scaling is stored as a
`rope_freqs` tensor, not metadata: such files are refused in one line (load the Hugging Face directory instead).
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from .config import ModelConfig, merge_eos_ids
from .families import FULL, SLIDING

__all__ = ["GGUF_FAMILIES", "gguf_architecture", "read_gguf_header", "read_gguf", "gguf_config"]

GGUF_FAMILIES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2", "gemma3": "gemma3_text"}
"""GGUF `general.architecture` -> astrai `model_type` (Mistral GGUFs are written as `llama`)."""
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32, 7: np.bool_,
          10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
_LAYER_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
                "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
                "attn_norm": "input_layernorm"}
_PLAIN_NORMS = {"ffn_norm": "post_attention_layernorm"}
_GEMMA_NORMS = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


class _Cursor:
    """Sequential little-endian reads from a buffer; raises `ValueError` past its end."""

    def __init__(self, buffer, offset: int = 0):
        self.buffer, self.offset = buffer, offset

    def take(self, n: int) -> bytes:
        if self.offset + n > len(self.buffer):
            raise ValueError("truncated GGUF header")
        out = self.buffer[self.offset:self.offset + n]
        self.offset += n
        return out

    def unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack(fmt, self.take(struct.calcsize(fmt)))
        return value

    def string(self) -> str:
        return bytes(self.take(self.unpack("<Q"))).decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        """One metadata value: str, int, float (float32 at its shortest repr: 1e-05), bool, or a list of those."""
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.unpack("<I"), self.unpack("<Q")
            if item in _NUMPY:
                array = np.frombuffer(self.take(count * np.dtype(_NUMPY[item]).itemsize), dtype=_NUMPY[item])
                return array.tolist()
            return [self.value(item) for _ in range(count)]
        if kind not in _SCALAR:
            raise ValueError(f"unknown GGUF value type {kind}")
        value = self.unpack(_SCALAR[kind])
        return float(str(np.float32(value))) if kind == 6 else value


def _open(path: Path):
    """(mmap of the file, cursor after the magic and version); ValueError for a non-GGUF or unknown version."""
    with open(path, "rb") as f:
        buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    cursor = _Cursor(buffer)
    if cursor.take(4) != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file (no GGUF magic)")
    version = cursor.unpack("<I")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported (expected 2 or 3)")
    return buffer, cursor


def _pairs(cursor: _Cursor) -> Iterator[tuple[str, Any]]:
    """The (key, value) metadata pairs after the tensor and key/value counts."""
    cursor.unpack("<Q")  # tensor count, read again by read_gguf_header
    for _ in range(cursor.unpack("<Q")):
        key = cursor.string()
        yield key, cursor.value(cursor.unpack("<I"))


def gguf_architecture(path: str | Path) -> str | None:
    """`general.architecture` of a GGUF file, reading only the keys before it (milliseconds). Raises
    `ValueError` naming the path for a file that is not GGUF or whose header is damaged."""
    path = Path(path)
    try:
        buffer, cursor = _open(path)
        try:
            return next((value for key, value in _pairs(cursor) if key == "general.architecture"), None)
        finally:
            buffer.close()
    except (ValueError, struct.error, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot read GGUF header ({e})") from None


def read_gguf_header(path: str | Path) -> tuple[dict[str, Any], list[tuple[str, tuple[int, ...], int, int]], Any]:
    """(metadata, tensor infos, memory map): infos are (name, numpy shape (slowest dim first), ggml type, absolute
    byte offset). The caller closes the map. Raises `ValueError` naming the path for a damaged header."""
    path = Path(path)
    buffer, cursor = _open(path)
    try:
        count = struct.unpack_from("<Q", buffer, cursor.offset)[0]
        meta = dict(_pairs(cursor))
        infos = []
        for _ in range(count):
            name = cursor.string()
            dims = [cursor.unpack("<Q") for _ in range(cursor.unpack("<I"))]
            infos.append((name, tuple(reversed(dims)), cursor.unpack("<I"), cursor.unpack("<Q")))
        align = int(meta.get("general.alignment", 32))
        start = -(-cursor.offset // align) * align
    except (ValueError, struct.error) as e:
        buffer.close()
        raise ValueError(f"{path}: cannot read GGUF header ({e})") from None
    return meta, [(n, s, t, start + o) for n, s, t, o in infos], buffer


def _tensor(buffer, offset: int, shape: tuple[int, ...], kind: int) -> np.ndarray:
    """Float32 copy of one tensor of numpy `shape` and ggml type `kind` stored at byte `offset`, dequantized by
    `gguf.quants.dequantize`."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType(kind)
    block, size = GGML_QUANT_SIZES[qtype]
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    row_bytes = shape[-1] // block * size
    raw = np.frombuffer(buffer, dtype=np.uint8, count=rows * row_bytes, offset=offset)
    return np.array(dequantize(raw.reshape(rows, row_bytes), qtype), dtype=np.float32).reshape(shape)


def _unpermute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: rows (heads, D/2, 2) -> (heads, 2, D/2). weight (Nh*D, H)."""
    rows, cols = weight.shape
    return weight.reshape(num_heads, rows // num_heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _rope_scaling(meta: dict[str, Any], arch: str, path: Path) -> dict[str, Any] | None:
    """Rotary scaling of the metadata (`{arch}.rope.scaling.*`: none, linear, yarn); ValueError otherwise."""
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind not in ("linear", "yarn"):
        raise ValueError(f"{path}: unsupported rotary scaling {arch}.rope.scaling.type={kind!r}; implemented: "
                         "none, linear, yarn")
    spec = {"rope_type": kind, "factor": meta[f"{arch}.rope.scaling.factor"]}
    original = meta.get(f"{arch}.rope.scaling.original_context_length")
    if original:
        spec["original_max_position_embeddings"] = original
    return spec


def _gemma_fields(meta: dict[str, Any], arch: str, hidden: int, heads: int, head_dim: int, layers: int) -> dict:
    """Gemma options llama.cpp's model code hard-codes: window pattern, local rotary base, softmax scale."""
    big = layers == (62 if arch == "gemma3" else 46)  # the 27B shapes scale by hidden / heads in llama.cpp
    pattern = 6 if arch == "gemma3" else 2
    fields = {"sliding_window": meta.get(f"{arch}.attention.sliding_window", 4096),
              "layer_types": [SLIDING if (i + 1) % pattern else FULL for i in range(layers)],
              "query_pre_attn_scalar": float(hidden // heads if big else head_dim), "hidden_act": "gelu_pytorch_tanh",
              "norm_unit_offset": True, "post_sublayer_norms": True, "scale_embeddings": True}
    if arch == "gemma3":
        fields.update(qk_norm=True, sliding_rope_theta=10000.0)
    else:
        fields.update(attn_logit_softcapping=meta.get("gemma2.attn_logit_softcapping", 50.0),
                      final_logit_softcapping=meta.get("gemma2.final_logit_softcapping", 30.0))
    return fields


def gguf_config(meta: dict[str, Any], path: Path) -> ModelConfig:
    """ModelConfig from `{arch}.*` GGUF metadata (tied embeddings and Qwen2's biases are set by `read_gguf` from
    the tensors). Raises `ValueError` (one line naming the path) for other architectures, rotary scalings or
    partial rotary."""
    arch = meta.get("general.architecture")
    if arch not in GGUF_FAMILIES:
        raise ValueError(f"{path}: unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_FAMILIES)}")
    heads, hidden = meta[f"{arch}.attention.head_count"], meta[f"{arch}.embedding_length"]
    head_dim = meta.get(f"{arch}.attention.key_length") or hidden // heads
    layers = meta[f"{arch}.block_count"]
    rope_dim = meta.get(f"{arch}.rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise ValueError(f"{path}: partial rotary (dimension {rope_dim} < head_dim {head_dim}) is unsupported")
    family = {"model_type": GGUF_FAMILIES[arch]}
    if arch.startswith("gemma"):
        family.update(_gemma_fields(meta, arch, hidden, heads, head_dim, layers))
    elif arch == "qwen3":
        family["qk_norm"] = True
    return ModelConfig(
        vocab_size=meta.get(f"{arch}.vocab_size") or len(meta["tokenizer.ggml.tokens"]),
        hidden_size=hidden,
        intermediate_size=meta[f"{arch}.feed_forward_length"],
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=meta.get(f"{arch}.attention.head_count_kv") or heads,
        head_dim=head_dim,
        rms_norm_eps=meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=meta.get(f"{arch}.rope.freq_base", 1_000_000.0 if arch == "gemma3" else 10000.0),
        rope_scaling=_rope_scaling(meta, arch, path),
        max_position_embeddings=meta.get(f"{arch}.context_length", 2048),
        tie_word_embeddings=False,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=merge_eos_ids(meta.get("tokenizer.ggml.eos_token_id"), meta.get("tokenizer.ggml.eot_token_id")),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
        qkv_bias=arch == "qwen2",
        **family,
    )


def _hf_name(name: str, gemma: bool) -> str | None:
    """HF parameter name of a llama.cpp tensor name, or None if unknown."""
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk":
        module = _LAYER_NAMES.get(parts[2]) or (_GEMMA_NORMS if gemma else _PLAIN_NORMS).get(parts[2])
        return None if module is None else f"model.layers.{parts[1]}.{module}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _TOP_NAMES:
        return f"{_TOP_NAMES[parts[0]]}.{parts[1]}"
    return None


def read_gguf(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], dict[str, Any]]:
    """(config, float32 HF-named state dict, metadata) of a GGUF file; the architecture is checked first, before
    anything else is read. Raises `ValueError` (one line naming the path) for an unsupported architecture, a
    damaged file or an unknown tensor."""
    arch = gguf_architecture(path)
    if arch not in GGUF_FAMILIES:
        raise ValueError(f"{path}: unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_FAMILIES)}")
    meta, infos, buffer = read_gguf_header(path)
    try:
        config = gguf_config(meta, path)
        gemma = arch.startswith("gemma")
        state: dict[str, torch.Tensor] = {}
        for name, shape, kind, offset in infos:
            if name == "rope_freqs.weight":
                raise ValueError(f"{path}: llama3 rotary scaling stored as rope_freqs is not read from GGUF; load "
                                 "the Hugging Face directory of this model instead")
            hf = _hf_name(name, gemma)
            if hf is None:
                raise ValueError(f"{path}: unsupported GGUF tensor {name!r}")
            array = _tensor(buffer, offset, shape, kind)
            if arch == "llama" and hf.endswith("q_proj.weight"):
                array = _unpermute(array, config.num_attention_heads)
            elif arch == "llama" and hf.endswith("k_proj.weight"):
                array = _unpermute(array, config.num_key_value_heads)
            if gemma and hf.endswith("norm.weight"):
                array = array - 1.0  # llama.cpp stores Gemma's RMSNorm weights as 1 + w
            state[hf] = torch.from_numpy(np.ascontiguousarray(array))
    finally:
        buffer.close()
    config.tie_word_embeddings = "lm_head.weight" not in state
    return config, state, meta
