#!/usr/bin/env bash
# Sets up .venv-peers: the peers that bench/peers.py compares against and that must never touch .venv
# (AirLLM and whatever it pulls in). Idempotent. torch stays the CPU build 2.13.0 (it lies on this
# machine's disk); a constraints file pins it so no dependency can swap in a CUDA build.
#   scripts/setup_peers.sh            # then: .venv/bin/python bench/peers.py --max-new-tokens 32 --gpu-mem 450MiB
#   scripts/setup_peers.sh --llama-cpp   # also llama-cpp-python (bench all's llama.cpp row; ~6 min to compile on 2 cores)
# llama-cpp-python compiles llama.cpp from source. Its default native build (GGML_NATIVE=ON) segfaulted on the first
# evaluation on virtual machines whose CPU reports AMX, so it is built for plain AVX2 unless CMAKE_ARGS is set.
set -euo pipefail
WITH_LLAMA_CPP=0
for arg in "$@"; do
  case "$arg" in
    --llama-cpp) WITH_LLAMA_CPP=1 ;;
    *) echo "usage: $0 [--llama-cpp]   (unknown argument: $arg)" >&2; exit 2 ;;
  esac
done
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${PEERS_VENV:-.venv-peers}
TORCH_VERSION=${PEERS_TORCH_VERSION:-2.13.0}
AIRLLM_SPEC=${PEERS_AIRLLM_SPEC:-airllm}
LLAMA_CPP_SPEC=${PEERS_LLAMA_CPP_SPEC:-llama-cpp-python>=0.3,<0.4}
LLAMA_CPP_CMAKE_ARGS=${CMAKE_ARGS:--DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_TILE=OFF}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "torch==$TORCH_VERSION" >"$constraints"

have() { "$VENV/bin/python" - "$@" <<'EOF' >/dev/null 2>&1
import importlib.metadata as m, sys
name, want = sys.argv[1], sys.argv[2]
version = m.version(name)
sys.exit(0 if version.split("+")[0] == want or want == "any" else 1)
EOF
}

if ! have torch "$TORCH_VERSION"; then
  # the CPU wheel; on this machine pip finds it in the local wheel folder (no CUDA download)
  $PIP install -q "torch==$TORCH_VERSION" 2>&1 | grep -v "is ignored: it is neither" || true
fi
if ! have airllm any || ! have numpy any; then
  $PIP install -q -c "$constraints" "$AIRLLM_SPEC" numpy 2>&1 | grep -v "is ignored: it is neither" || true
fi
if [ "$WITH_LLAMA_CPP" = 1 ] && ! have llama_cpp_python any; then
  echo "building llama-cpp-python (CMAKE_ARGS=$LLAMA_CPP_CMAKE_ARGS); this takes minutes"
  CMAKE_ARGS="$LLAMA_CPP_CMAKE_ARGS" $PIP install -q -c "$constraints" --no-cache-dir "$LLAMA_CPP_SPEC"
fi
if [ "$WITH_LLAMA_CPP" = 1 ]; then
  "$VENV/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
fi
"$VENV/bin/python" - <<EOF
import importlib.metadata as m, sys, torch
assert torch.__version__.split("+")[0] == "$TORCH_VERSION", torch.__version__
assert not torch.version.cuda, f"a CUDA torch slipped in: {torch.__version__}"
import airllm  # noqa: F401  (fails here, not in the benchmark, if the install is broken)
print(f"$VENV ready: torch {torch.__version__}, airllm {m.version('airllm')}, transformers {m.version('transformers')}")
EOF
