#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite. Extra arguments go to pytest.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh || exit 1
export TRITON_INTERPRET=1   # lets the Triton kernels' tests run on CPU
# Two test modules at a time (pytest-xdist, each module whole on one worker, so its world starts
# once): much of a distributed test's time is spent waiting (process start-up, rendezvous,
# peers), which the other module's work fills. SHARDKIT_TEST_WORKERS=0 runs them one by one.
workers="${SHARDKIT_TEST_WORKERS:-2}"
parallel=()
if [ "$workers" != "0" ]; then
    parallel=(-n "$workers" --dist loadfile)
fi
.venv/bin/python -m pytest "${parallel[@]}" "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
    echo "error: pytest collected no tests" >&2
    exit 1
fi
exit "$rc"
