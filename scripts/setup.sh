#!/usr/bin/env bash
# Creates .venv with Python >= 3.12 and installs coda-jax with its test and bench extras
# (jax/jaxlib pinned to 0.11.2, the GPU host's version), plus the "cuda" extra (jax's
# CUDA 13 plugin of the same version) when nvidia-smi sees a GPU. Idempotent; prints the
# python. With CODA_JAX_PYTHON set, uses that python instead and installs nothing (below).
set -euo pipefail
cd "$(dirname "$0")/.."
find_python() {
  for cand in python3.12 python3.13 python3; do
    if command -v "$cand" >/dev/null 2>&1 &&
       "$cand" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      echo "$cand"; return 0
    fi
  done
  # pyenv shims exist but point elsewhere unless told which version to use. Prefer the
  # oldest qualifying version: 3.12 is what the GPU host runs.
  if command -v pyenv >/dev/null 2>&1; then
    for v in $(pyenv versions --bare | grep -E '^3\.(1[2-9])' | sort -V); do
      echo "$(pyenv root)/versions/$v/bin/python3"; return 0
    done
  fi
  return 1
}
extras="test,bench"
has_gpu=false
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  has_gpu=true
  extras="test,bench,cuda"
fi
# An environment of your own (an offline GPU host, a container with jax installed):
# CODA_JAX_PYTHON names its python. Nothing is installed; scripts/check_env.py checks the
# pinned and needed packages (and, with a GPU, that jax sees it) and names what is missing.
if [ -n "${CODA_JAX_PYTHON:-}" ]; then
  py=$(command -v "$CODA_JAX_PYTHON") || { echo "setup: CODA_JAX_PYTHON=$CODA_JAX_PYTHON is not an executable" >&2; exit 1; }
  "$py" scripts/check_env.py "$extras" >&2
  echo "$py"
  exit 0
fi
if [ ! -x .venv/bin/python ]; then
  py=$(find_python) || { echo "setup: need Python >= 3.12 (jax 0.11 requires it)" >&2; exit 1; }
  echo "setup: creating .venv with $py ($("$py" --version))" >&2
  "$py" -m venv .venv
fi
# An NVIDIA GPU gets the CUDA build of the pinned jax (the "cuda" extra); without it pip
# would install a CPU-only jaxlib, and everything would quietly run the XLA fallback.
if $has_gpu; then
  jax_kind="jax with CUDA 13 (NVIDIA GPU found: $(nvidia-smi -L | head -1))"
else
  jax_kind="the CPU jax (no NVIDIA GPU: kernels run through the interpreter in tests)"
fi
stamp=.venv/.coda-jax-installed-${extras//,/-}
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "setup: installing coda-jax [$extras] into .venv, with $jax_kind" >&2
  .venv/bin/python -m pip install -q --upgrade pip >&2
  .venv/bin/python -m pip install -q -e ".[$extras]" >&2
  touch "$stamp"
else
  echo "setup: using .venv (coda-jax [$extras] already installed, with $jax_kind)" >&2
fi
echo "$(pwd)/.venv/bin/python"
