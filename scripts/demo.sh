#!/usr/bin/env bash
# Set up (idempotent) and run the main job: multi-process CPU training that shows what
# shardkit does. Extra arguments go to `python -m shardkit demo`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
exec .venv/bin/python -m shardkit demo "$@"
