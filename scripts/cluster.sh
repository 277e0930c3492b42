#!/usr/bin/env bash
# Set up (idempotent), then run a torchrun job on a simulated cluster of network namespaces
# (needs root). Arguments go to `python -m shardkit cluster`, e.g.
#   bash scripts/cluster.sh --nodes 2 --nproc-per-node 2 --link-rate 1gbit -- examples/deepspeed_style.py
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
exec .venv/bin/python -m shardkit cluster "$@"
