#!/usr/bin/env bash
# Sets up .venv-peers: the peers that bench/peers.py compares against and that must never touch .venv
# (AirLLM and whatever it pulls in). Idempotent. torch stays the CPU build 2.13.0 (it lies on this
# machine's disk); a constraints file pins it so no dependency can swap in a CUDA build.
#   scripts/setup_peers.sh            # then: .venv/bin/python bench/peers.py --max-new-tokens 32 --gpu-mem 450MiB
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${PEERS_VENV:-.venv-peers}
TORCH_VERSION=${PEERS_TORCH_VERSION:-2.13.0}
AIRLLM_SPEC=${PEERS_AIRLLM_SPEC:-airllm}
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
"$VENV/bin/python" - <<EOF
import importlib.metadata as m, sys, torch
assert torch.__version__.split("+")[0] == "$TORCH_VERSION", torch.__version__
assert not torch.version.cuda, f"a CUDA torch slipped in: {torch.__version__}"
import airllm  # noqa: F401  (fails here, not in the benchmark, if the install is broken)
print(f"$VENV ready: torch {torch.__version__}, airllm {m.version('airllm')}, transformers {m.version('transformers')}")
EOF
