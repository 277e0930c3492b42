#!/usr/bin/env bash
# Idempotent set-up: a venv in .venv with torch 2.13.0 (CPU build) where no torch is present,
# and shardkit installed editable with its test extras. Fast when nothing changed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV="${SHARDKIT_VENV:-.venv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup] creating $VENV"
    "$PY" -m venv "$VENV"
fi
stamp="$VENV/.shardkit-setup"
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$VENV/bin/python" -c "import shardkit, torch" 2>/dev/null; then
    exit 0
fi
pip=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    echo "[setup] installing torch==2.13.0 (CPU build)"
    "${pip[@]}" "torch==2.13.0"
fi
echo "[setup] installing shardkit[test]"
"${pip[@]}" -e ".[test]"
echo "$want" > "$stamp"
