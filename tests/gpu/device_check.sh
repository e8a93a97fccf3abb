#!/usr/bin/env bash
# Device check as JSON (tests/gpu/device_check.py's stream, spqr and gguf sections): pinned H2D bandwidth and
# streaming efficiency of Llama-3.1-70B-shaped layers (bf16, RAM tier) for trees of 1..2048 tokens, and one
# such layer's SpQR w4 and GGUF Q4_K decoding against the link. tests/gpu/gpu_session.sh runs the same sections
# (and more) step by step on a lent GPU.
#   bash tests/gpu/device_check.sh [OUT.json]            on a GPU machine
#   bash tests/gpu/device_check.sh --dry-run [OUT.json]  anywhere (small shapes, CPU): the test suite runs this
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
if [ "${1:-}" = "--dry-run" ]; then
  shift
  "$PY" tests/gpu/device_check.py --dry-run --layers 3 --tokens 1,16,64 > "${1:-/dev/stdout}"
else
  "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA GPU: use --dry-run')"
  "$PY" tests/gpu/device_check.py --device cuda --layers 4 --tokens 1,16,64,256,1024,2048 > "${1:-/dev/stdout}"
fi
