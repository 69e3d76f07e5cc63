#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the test suite. On a machine without a Hopper GPU
# the kernels run through Mosaic GPU's CPU interpreter; on an H100/H200 they run compiled.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
py=$(bash scripts/setup.sh)
# The interpreter deadlocks on XLA's CPU thread pool on 2-core machines unless NPROC is
# large (tests/conftest.py sets it too, for plain `pytest`).
export NPROC="${NPROC:-32}"
exec "$py" -m pytest tests "$@"
