#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the main job: bench/train.py, a Llama trained on
# bytes of the Python stdlib's source, fused path vs the plain-XLA reference from the same
# initial parameters on the same batches. On an sm90 GPU: Llama-3.2-1B, batch 8 x 2048,
# 200 steps (tokens/s, loss agreement, memory); elsewhere the tiny config on CPU in a few
# minutes (the fused path's XLA fallback). Writes bench/results/<device>/train_<config>.*;
# extra args go to bench.train (e.g. --config tiny --steps 50 --out /tmp/train).
set -euo pipefail
cd "$(dirname "$0")/.."
py=$(bash scripts/setup.sh)
export NPROC="${NPROC:-32}"
# The report's command line: this script as it was called, not the python behind it.
CODA_JAX_COMMAND="bash scripts/main.sh"
[ $# -gt 0 ] && CODA_JAX_COMMAND+=$(printf ' %q' "$@")
export CODA_JAX_COMMAND
exec "$py" -m bench.train "$@"
