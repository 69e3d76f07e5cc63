"""tests/worker_gpus.py: on a host with several GPUs each pytest-xdist worker takes one,
round robin; the caller's CUDA_VISIBLE_DEVICES is honoured; MIG instances, a single GPU,
a process that is not a worker and CODA_JAX_TEST_SPREAD_GPUS=0 are left as they are."""
import subprocess
import sys
from pathlib import Path

import worker_gpus as W
from helpers import run_pytest

SMI_TWO = ["GPU 0: NVIDIA H200 (UUID: GPU-aaaa)", "GPU 1: NVIDIA H200 (UUID: GPU-bbbb)"]
SMI_MIG = ["GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-cccc)",
           "  MIG 3g.40gb     Device  0: (UUID: MIG-dddd)"]


def test_visible_gpus():
  assert W.visible_gpus({}, SMI_TWO) == ["0", "1"]
  assert W.visible_gpus({}, SMI_TWO[:1]) == ["0"]
  assert W.visible_gpus({}, []) == []  # no nvidia-smi
  assert W.visible_gpus({}, SMI_MIG) == []
  # the caller's list wins over what nvidia-smi sees, UUIDs included
  assert W.visible_gpus({"CUDA_VISIBLE_DEVICES": "3, 5,GPU-eeee"}, SMI_TWO) == [
      "3", "5", "GPU-eeee"]
  assert W.visible_gpus({"CUDA_VISIBLE_DEVICES": ""}, SMI_TWO) == []  # none allowed


def test_gpu_for_worker():
  gpus = ["0", "1", "2"]
  assert [W.gpu_for_worker(f"gw{i}", gpus) for i in range(7)] == [
      "0", "1", "2", "0", "1", "2", "0"]
  assert W.gpu_for_worker("gw12", ["4", "6"]) == "4"
  assert W.gpu_for_worker(None, gpus) is None  # the controller, or no xdist
  assert W.gpu_for_worker("master", gpus) is None
  assert W.gpu_for_worker("gw3", ["0"]) is None  # nothing to spread
  assert W.gpu_for_worker("gw3", []) is None


def test_pin_this_worker():
  env = {"PYTEST_XDIST_WORKER": "gw3"}
  assert W.pin_this_worker(env, SMI_TWO) == "1"
  assert env["CUDA_VISIBLE_DEVICES"] == "1"
  # pinned once, a second call sees one GPU and changes nothing
  assert W.pin_this_worker(env, SMI_TWO) is None and env["CUDA_VISIBLE_DEVICES"] == "1"
  env = {"PYTEST_XDIST_WORKER": "gw2", "CUDA_VISIBLE_DEVICES": "4,6,7"}
  assert W.pin_this_worker(env, SMI_TWO) == "7" and env["CUDA_VISIBLE_DEVICES"] == "7"
  for env in ({"PYTEST_XDIST_WORKER": "gw3", W.SPREAD_ENV: "0"}, {}):
    before = dict(env)
    assert W.pin_this_worker(env, SMI_TWO) is None and env == before
  env = {"PYTEST_XDIST_WORKER": "gw1"}
  assert W.pin_this_worker(env, SMI_MIG) is None and "CUDA_VISIBLE_DEVICES" not in env


def _fake_smi(folder: Path, smi_lines: list[str]) -> None:
  """An ``nvidia-smi`` in ``folder`` that lists ``smi_lines`` for ``-L`` and prints an
  H200's memory (MiB) for anything else."""
  fake = folder / "nvidia-smi"
  fake.write_text("#!/bin/sh\n"
                  'if [ "$1" = -L ]; then printf "%s\\n" "' + "\n".join(smi_lines) + '"; '
                  "else echo 143771; fi\n")
  fake.chmod(0o755)


def test_conftest_pins_each_worker(tmp_path):
  """Through pytest-xdist with an nvidia-smi that lists two GPUs: tests/conftest.py
  gives worker gw0 GPU 0 and gw1 GPU 1, and, since jax here runs on the CPU, each
  worker stops with the error that says so, instead of running its kernels through
  the interpreter unnoticed. With CODA_JAX_TEST_SPREAD_GPUS=0 the same run passes."""
  import os
  _fake_smi(tmp_path, SMI_TWO)
  root = Path(__file__).resolve().parent.parent
  env = {k: v for k, v in os.environ.items()
         if k not in ("CUDA_VISIBLE_DEVICES", W.SPREAD_ENV)}
  env.update(PATH=f"{tmp_path}:{env.get('PATH', '/usr/bin:/bin')}", JAX_PLATFORMS="cpu")
  args = ["-n", "2", "tests/test_worker_gpus.py::test_gpu_for_worker"]
  run = run_pytest(args, root, env)
  out = run.stdout + run.stderr
  assert run.returncode != 0, out
  for worker, gpu in (("gw0", "0"), ("gw1", "1")):
    assert f"worker {worker} was given GPU {gpu}" in out, out
  run = run_pytest(args, root, {**env, W.SPREAD_ENV: "0"})
  assert run.returncode == 0, run.stdout + run.stderr


def test_test_sh_counts_every_gpu(tmp_path):
  """scripts/test.sh sizes the workers by all the GPUs (8 GiB of GPU memory each, at
  most one per core), by the caller's CUDA_VISIBLE_DEVICES where set, and by the first
  GPU alone with CODA_JAX_TEST_SPREAD_GPUS=0 or MIG. Its worker-count lines run with a
  stand-in nvidia-smi."""
  root = Path(__file__).resolve().parent.parent
  text = (root / "scripts" / "test.sh").read_text()
  start = text.index('    gpu_mib=$(nvidia-smi -i 0')
  last = "    by_gpu=$(( gpus * per_gpu ))\n"
  end = text.index(last) + len(last)
  snippet = (f"set -euo pipefail\npy={sys.executable}\n" + text[start:end]
             + 'echo "$by_gpu"\n')

  def by_gpu(smi_lines, **env):
    _fake_smi(tmp_path, smi_lines)
    full_env = {"PATH": f"{tmp_path}:/usr/bin:/bin", **env}
    out = subprocess.run(["bash", "-c", snippet], env=full_env, capture_output=True,
                         text=True, check=True, cwd=root)
    return int(out.stdout.strip())

  per_gpu = 143771 // 8192  # an H200's memory.total in MiB
  assert by_gpu(SMI_TWO) == 2 * per_gpu
  assert by_gpu(SMI_TWO[:1]) == per_gpu
  assert by_gpu(SMI_TWO, CUDA_VISIBLE_DEVICES="0,1,2") == 3 * per_gpu
  assert by_gpu(SMI_TWO, CODA_JAX_TEST_SPREAD_GPUS="0") == per_gpu
  assert by_gpu(SMI_MIG) == per_gpu
