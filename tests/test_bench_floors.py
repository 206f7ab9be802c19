"""bench/floors.py: FLOP counts of a tiny config against a hand computation, and a sane measured GEMM rate."""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import floors  # noqa: E402

# L=2 layers, H=8, I=16, Nh=2 heads, Nkv=1, D=4, V=10.
TINY = SimpleNamespace(num_hidden_layers=2, hidden_size=8, intermediate_size=16, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=4, vocab_size=10)


def test_dims_of_config():
    d = floors.Dims.of(TINY)
    assert (d.layers, d.hidden, d.intermediate, d.heads, d.kv_heads, d.head_dim, d.vocab) == (2, 8, 16, 2, 1, 4, 10)
    no_head_dim = SimpleNamespace(**{k: v for k, v in vars(TINY).items() if k != "head_dim"})
    assert floors.Dims.of(no_head_dim).head_dim == 4  # H / Nh


def test_flop_counts_by_hand():
    d = floors.Dims.of(TINY)
    # One layer's weights: q 8*8 + k 8*4 + v 8*4 + o 8*8 + gate/up/down 3*8*16 = 64+32+32+64+384 = 576;
    # 2 layers, 2 FLOPs per multiply-add: 2304 per token.
    assert floors.linear_flops_per_token(d) == 2304
    # Attention per pair and head: QK^T 2*D + AV 2*D = 16; 2 heads = 32 per layer; 2 layers = 64.
    assert floors.attention_flops(d, 1) == 64
    assert floors.causal_pairs(5) == 15 and floors.causal_pairs(4, 3) == 4 and floors.causal_pairs(3, 3) == 0
    # Prompt 3 + response 2: 5 tokens * 2304 + 15 pairs * 64 + LM head 2 tokens * 2*8*10 = 11520 + 960 + 320.
    assert floors.sequence_forward_flops(d, [3], [2]) == 12800
    # Critic: value head 2 tokens * 2*8 instead of the LM head.
    assert floors.sequence_forward_flops(d, [3], [2], head="value") == 11520 + 960 + 32
    # Generation of 2 tokens after 3: prefill 3 tokens (6 pairs, LM head once) = 6912 + 384 + 160;
    # one decode step: 1 token at position 3 (4 pairs, LM head once) = 2304 + 256 + 160.
    assert floors.generation_flops(d, [3], [2]) == (7456, 2720)
    # Batches add up row by row.
    assert floors.sequence_forward_flops(d, [3, 3], [2, 2]) == 2 * 12800
    with pytest.raises(ValueError):
        floors.sequence_forward_flops(d, [3], [2, 2])


def test_smollm2_linear_flops_match_its_parameter_count():
    # SmolLM2-135M: 30 layers of (576x576 q, 2 x 576x192 k/v, 576x576 o, 3 x 576x1536 MLP) = 106.2M linear weights.
    smollm2 = SimpleNamespace(num_hidden_layers=30, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                              num_key_value_heads=3, vocab_size=49152)
    d = floors.Dims.of(smollm2)
    assert floors.linear_flops_per_token(d) == 2 * 30 * (576 * 576 * 2 + 2 * 576 * 192 + 3 * 576 * 1536)


def test_measured_rate_and_floor():
    d = floors.Dims.of(TINY)
    rate = floors.measure_gemm_rate(d, rows=16, repeats=1)
    assert rate > 0
    assert floors.floor_seconds(2 * rate, rate) == pytest.approx(2.0)


def test_linear_and_head_flops_match_torch_flop_counter():
    """The linear + LM-head part agrees with torch's own count of the matmuls of a tiny astrai forward."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from astrai.models import AutoRegressiveLM
    from astrai.models.config import tiny_config

    config = tiny_config()
    model = AutoRegressiveLM(config).eval()
    d = floors.Dims.of(config)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(torch.randint(3, 100, (1, 20)), logits_to_keep=5)
    counts = counter.get_flop_counts()["Global"]
    counted = sum(counts.get(op, 0) for op in (torch.ops.aten.mm, torch.ops.aten.addmm))
    assert counted == floors.forward_flops(d, tokens=20, pairs=0, lm_head_tokens=5)


def test_decode_kv_bytes_by_hand_and_a_measured_read_bandwidth():
    d = floors.Dims.of(TINY)
    # Prompt 3, response 3: decode steps attend over 4 and 5 positions = 9; per position 2 layers * (key + value)
    # * Nkv 1 * D 4 * 4 bytes = 64 bytes.
    assert floors.decode_kv_bytes(d, [3], [3]) == 9 * 64
    assert floors.decode_kv_bytes(d, [3, 5], [1, 2], element_size=2) == 6 * 32  # R = 1: no decode step
    assert floors.decode_kv_bytes(d, [], []) == 0
    with pytest.raises(ValueError):
        floors.decode_kv_bytes(d, [3], [])
    assert 1e8 < floors.measure_read_bandwidth(8 * 2**20, repeats=1) < 1e13  # bytes/s: 0.1 GB/s .. 10 TB/s


def test_dims_of_a_qwen3_config_uses_its_explicit_head_dim():
    """Qwen3 sets head_dim = 128 whatever H / Nh is; q/k RMSNorm adds no GEMM. Both transformers' config and
    astrai's ModelConfig of it give the same dims, and the q, o and k/v GEMMs are sized by Nh * D and Nkv * D."""
    transformers = pytest.importorskip("transformers")
    from astrai.models import ModelConfig

    hf = transformers.Qwen3Config(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    for config in (hf, ModelConfig.from_hf_dict(hf.to_dict())):
        d = floors.Dims.of(config)
        assert (d.layers, d.hidden, d.heads, d.kv_heads, d.head_dim, d.windows) == (3, 64, 4, 2, 32, ())
        assert d.layer_weight_shapes()[:4] == [(128, 64), (64, 64), (64, 64), (64, 128)]
    # per (query, key) pair and layer: 4 * Nh * D = 512 FLOPs; per attended position: 2 * Nkv * D * 4 bytes = 512
    assert floors.attention_flops(floors.Dims.of(hf), 1) == 3 * 512
    assert floors.decode_kv_bytes(floors.Dims.of(hf), [2], [2]) == 3 * 3 * 512  # one decode step over 3 positions


def test_sliding_windows_cap_the_pairs_and_the_decode_kv_reads():
    from astrai.models import ModelConfig

    # A query at position i of a window-W layer sees min(i + 1, W) keys.
    assert floors.causal_pairs(6, window=4) == 1 + 2 + 3 + 4 + 4 + 4
    assert floors.causal_pairs(6, 2, window=4) == 3 + 4 + 4 + 4
    assert floors.causal_pairs(6, 5, window=2) == 2 and floors.causal_pairs(3, window=8) == floors.causal_pairs(3)
    for length in range(8):
        for start in range(length + 1):
            for window in (1, 2, 3, 5, 9):
                assert floors.causal_pairs(length, start, window=window) == sum(
                    min(i + 1, window) for i in range(start, length))
    config = ModelConfig(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, model_type="qwen3", qk_norm=True,
                         sliding_window=3, layer_types=["sliding_attention", "full_attention"], head_dim=4)
    d = floors.Dims.of(config)
    assert d.windows == (3, None)
    # Prompt 3, response 3: decode steps attend over 4 and 5 positions in the full layer, 3 and 3 in the windowed
    # one; per position and layer key + value of Nkv 1 * D 4 * 4 bytes = 32 bytes.
    assert floors.decode_kv_bytes(d, [3], [3]) == (4 + 5 + 3 + 3) * 32
    # Prefill of 5 tokens: 15 pairs in the full layer, 1 + 2 + 3 + 3 + 3 = 12 in the windowed one.
    assert d.attention_pairs(5) == 27
    plain = floors.Dims.of(SimpleNamespace(**vars(TINY)))
    assert floors.sequence_forward_flops(d, [3], [2]) - floors.sequence_forward_flops(plain, [3], [2]) == (
        4 * 2 * 4 * (27 - 30))  # only the attention term changes: 3 fewer pairs
    qwen2 = SimpleNamespace(**vars(TINY), sliding_window=4, use_sliding_window=False)
    assert floors.Dims.of(qwen2).windows == ()  # Qwen2.5 ships a window it does not use
    mistral = SimpleNamespace(**vars(TINY), sliding_window=4)
    assert floors.Dims.of(mistral).windows == (4, 4)
