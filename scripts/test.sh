#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the test suite. On a machine without a Hopper GPU
# the kernels run through Mosaic GPU's CPU interpreter; on an H100/H200 they run compiled.
# Extra arguments go to pytest.
#
# Workers (pytest-xdist): the suite runs in CODA_JAX_TEST_WORKERS processes: by default,
# without a GPU, one more than there are cores, at most one per 6 GB of available memory
# (the heaviest files peak near 6 GB), each test file kept in one worker (--dist
# loadfile: a file's tests share the worker's compiled programs). A worker keeps only
# ~0.7 of a core busy on average (the interpreter's warpgroups are Python threads that
# wait on each other and on XLA), so 3 workers beat 2 on 2 cores (docs/testing.md).
# With a GPU, as many as there are cores and 8 GiB of GPU memory each, each worker on
# one GPU of the host's (tests/worker_gpus.py; CODA_JAX_TEST_SPREAD_GPUS=0
# keeps them all on the first), the tests handed out a few at a time (--dist load:
# compiling dominates there, and the kernels each worker lowers and the programs XLA
# compiles go to folders all of them read, tests/conftest.py).
# test_sharding.py's multi-device subprocesses run once per run either way; with a GPU
# they start in the background at the first test (tests/background_checks.py). `-n 0`,
# or an -n of your own, overrides this.
# CODA_JAX_TEST_TIMES=FILE: each test's time written to FILE as it ends, so a run cut
# short keeps them (tests/run_times.py; `python tests/run_times.py FILE` summarises).
set -euo pipefail
cd "$(dirname "$0")/.."
py=$(bash scripts/setup.sh)
# The interpreter deadlocks on XLA's CPU thread pool on 2-core machines unless NPROC is
# large (tests/conftest.py sets it too, for plain `pytest`).
export NPROC="${NPROC:-32}"
# Workers share the GPU: none may take most of its memory up front.
export XLA_PYTHON_CLIENT_PREALLOCATE="${XLA_PYTHON_CLIENT_PREALLOCATE:-false}"
has_gpu=false
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then has_gpu=true; fi
# Without a GPU, XLA compiles every program for the CPU at LLVM's lowest optimisation
# level: the suite's programs are small and run briefly (the interpreter's time goes to
# its Python callbacks), so optimising them costs more than it saves. test_sharding's
# multi-device subprocess ran 89 s -> 59 s on a 2-core machine (docs/testing.md). HLO passes, and so the collectives counted, are the same.
if ! $has_gpu && [[ "${XLA_FLAGS:-}" != *xla_backend_optimization_level* ]]; then
  export XLA_FLAGS="${XLA_FLAGS:-} --xla_backend_optimization_level=0"
fi
workers_given=false
for arg in "$@"; do
  case "$arg" in -n|-n*|--numprocesses*|-pno:xdist|no:xdist) workers_given=true ;; esac
done
extra=()
if ! $workers_given; then
  cores=$(nproc)
  dist=loadfile
  if $has_gpu; then
    gpu_mib=$(nvidia-smi -i 0 --query-gpu=memory.total --format=csv,noheader,nounits)
    # each worker takes one of the GPUs (tests/worker_gpus.py), so all of them count
    gpus=$("$py" tests/worker_gpus.py)
    per_gpu=$(( gpu_mib / 8192 > 1 ? gpu_mib / 8192 : 1 ))
    by_gpu=$(( gpus * per_gpu ))
    workers=$(( cores < by_gpu ? cores : by_gpu ))
    dist=load
  else
    mem_gb=$(awk '/MemAvailable/ {print int($2 / 1048576)}' /proc/meminfo)
    by_mem=$(( mem_gb / 6 > 1 ? mem_gb / 6 : 1 ))
    by_cores=$(( cores + 1 ))
    workers=$(( by_cores < by_mem ? by_cores : by_mem ))
  fi
  workers="${CODA_JAX_TEST_WORKERS:-$workers}"
  if [ "$workers" -gt 1 ]; then
    extra=(-n "$workers" --dist "$dist")
  fi
  echo "test: $workers worker process(es), --dist $dist (CODA_JAX_TEST_WORKERS to change)" >&2
fi
# No test path of our own: pyproject.toml's testpaths is tests/, which pytest collects when
# the arguments name no files or ids (tests/test_x.py, tests/test_x.py::name).
exec "$py" -m pytest "${extra[@]}" "$@"
