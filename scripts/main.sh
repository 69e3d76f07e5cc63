#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the main job: the GEMM-epilogue benchmark. On a GPU
# host it times every program at the benchmark shapes (CUPTI) and writes
# bench/results/<device>/; elsewhere it runs every program once through the CPU
# interpreter at a small shape and prints its error against the XLA reference.
set -euo pipefail
cd "$(dirname "$0")/.."
py=$(bash scripts/setup.sh)
export NPROC="${NPROC:-32}"
exec "$py" -m bench.gemm_epilogue "$@"
