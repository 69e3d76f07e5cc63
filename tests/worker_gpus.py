"""One GPU per pytest-xdist worker on a host with several.

Without this every worker runs its tests on jax's first device, so on a host with two
or eight GPUs the suite runs on one of them and each worker still opens a context on
all. ``tests/conftest.py`` calls ``pin_this_worker`` before jax starts its backends:
worker ``gw<i>`` then sees only GPU ``i mod (number of GPUs)``. No test needs two real
GPUs (the multi-device checks run on fake CPU devices, ``tests/sharded_check.py``).
``CODA_JAX_TEST_SPREAD_GPUS=0`` turns it off; a ``CUDA_VISIBLE_DEVICES`` of the caller's
is honoured (the workers spread over the GPUs it names).
"""
from __future__ import annotations

import os
import re
import subprocess

SPREAD_ENV = "CODA_JAX_TEST_SPREAD_GPUS"


def _spread_off(env) -> bool:
  return env.get(SPREAD_ENV, "1") == "0"


def _smi_lines() -> list[str]:
  try:
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
  except (OSError, subprocess.SubprocessError):
    return []
  return out.stdout.splitlines() if out.returncode == 0 else []


def visible_gpus(env: dict | None = None, smi_lines: list[str] | None = None) -> list[str]:
  """The GPUs this process may use, named as ``CUDA_VISIBLE_DEVICES`` names them.

  Args:
    env: the environment (default ``os.environ``).
    smi_lines: the lines of ``nvidia-smi -L`` (default: run it).

  Returns:
    The caller's ``CUDA_VISIBLE_DEVICES`` entries where it is set; else one index per
    GPU that ``nvidia-smi -L`` lists ("0", "1", ...). [] where there is no
    ``nvidia-smi``, or where a GPU is split into MIG instances (those are named
    otherwise, so they are left as they are).
  """
  env = os.environ if env is None else env
  given = env.get("CUDA_VISIBLE_DEVICES")
  if given is not None:
    return [d.strip() for d in given.split(",") if d.strip()]
  lines = _smi_lines() if smi_lines is None else smi_lines
  if any("MIG" in line for line in lines):
    return []
  return [str(i) for i in range(sum(1 for line in lines if re.match(r"GPU \d+:", line)))]


def gpu_for_worker(worker: str | None, gpus: list[str]) -> str | None:
  """The GPU a pytest-xdist worker takes.

  Args:
    worker: the worker's id (``PYTEST_XDIST_WORKER``: "gw0", "gw1", ...), or None in a
      process that is not a worker.
    gpus: ``visible_gpus``'s list.

  Returns:
    ``gpus[i % len(gpus)]`` for worker ``gw<i>``; None where this is not a worker or
    fewer than two GPUs are visible (nothing to spread).
  """
  m = re.fullmatch(r"gw(\d+)", worker or "")
  if m is None or len(gpus) < 2:
    return None
  return gpus[int(m.group(1)) % len(gpus)]


def spread_over(env: dict | None = None, smi_lines: list[str] | None = None) -> int:
  """How many GPUs the workers spread over (``scripts/test.sh`` sizes its workers by it).

  Args:
    env: the environment (default ``os.environ``).
    smi_lines: the lines of ``nvidia-smi -L`` (default: run it).

  Returns:
    The number of ``visible_gpus``; 1 where there are none or with
    ``CODA_JAX_TEST_SPREAD_GPUS=0`` (the workers share the first).
  """
  env = os.environ if env is None else env
  if _spread_off(env):
    return 1
  return max(1, len(visible_gpus(env, smi_lines)))


def pin_this_worker(env: dict | None = None,
                    smi_lines: list[str] | None = None) -> str | None:
  """Lets this pytest-xdist worker see one GPU, before jax starts its backends.

  Args:
    env: the environment to read and set (default ``os.environ``).
    smi_lines: the lines of ``nvidia-smi -L`` (default: run it where needed).

  Returns:
    The GPU now in ``CUDA_VISIBLE_DEVICES``, or None where nothing was changed: not a
    worker, fewer than two GPUs, or ``CODA_JAX_TEST_SPREAD_GPUS=0``.
  """
  env = os.environ if env is None else env
  if _spread_off(env) or "PYTEST_XDIST_WORKER" not in env:
    return None
  gpu = gpu_for_worker(env["PYTEST_XDIST_WORKER"], visible_gpus(env, smi_lines))
  if gpu is not None:
    env["CUDA_VISIBLE_DEVICES"] = gpu
  return gpu


if __name__ == "__main__":  # scripts/test.sh: how many GPUs its workers spread over
  print(spread_over())
