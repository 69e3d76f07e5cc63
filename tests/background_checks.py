"""Long subprocess checks that many tests read, run once per pytest run and started early.

``tests/sharded_check.py`` runs the sharded cases on 4 fake CPU devices in a fresh process
(the device count is fixed when jax starts). Its two runs take minutes, and ~140 tests of
``test_sharding.py`` read their output. Run when the first of those tests came up, a
run held every pytest-xdist worker that then picked up a sharding test: on a GPU host,
where the tests are handed out a few at a time and ``test_sharding.py`` sorts near the
end, the suite's last minutes were 16 workers waiting on one CPU process.

So on a GPU host each process of the run, at its first test (``tests/conftest.py``),
starts in the background every check that some selected test needs (``start``); the
first to ask starts it, under a lock in the run's shared temporary folder, and the
others see that it is started. A test that needs the output waits for it (``result``),
or runs the check itself where nobody is running it (a runner that died, a test run
alone, or a CPU machine, where the check is not started early: there it slowed the
interpreted tests beside it more than it saved).

The background runner is this file run as a script: it runs the check, writes its
return code and output to a JSON file (atomically), and kills the check and writes
nothing if the pytest process it watches has ended (``-x``, Ctrl-C, a crash), so that no
check outlives its run.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

# fixture name -> (check name, tests/sharded_check.py arguments, timeout in seconds)
SHARDED_CHECKS = {
    "sharded_results": ("results", ["xla", "train", "shard_map", "jit", "auto", "errors"],
                        1500),
    "row_terms_results": ("row_terms", ["xla", "row_terms"], 600),
}

# How long ``result`` waits beyond a check's own timeout for a runner that is alive but
# has written nothing (its timeout is enforced by the runner itself).
WAIT_MARGIN_S = 120.0

_started: list[subprocess.Popen] = []  # kept referenced while they run


def sharded_check(fixture: str) -> tuple[str, list[str], dict[str, str], float]:
  """The check behind ``fixture`` (a key of ``SHARDED_CHECKS``).

  Returns:
    (name, command, environment, timeout): ``sharded_check.py`` on the CPU, with XLA's
    CPU programs compiled at LLVM's lowest level, as ``scripts/test.sh`` compiles them
    without a GPU (on a GPU host too: these are CPU programs; the collectives counted are
    the same at every level).
  """
  name, args, timeout = SHARDED_CHECKS[fixture]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  flags = env.get("XLA_FLAGS", "")
  if "xla_backend_optimization_level" not in flags:
    env["XLA_FLAGS"] = f"{flags} --xla_backend_optimization_level=0".strip()
  return name, [sys.executable, str(HERE / "sharded_check.py"), *args], env, timeout


def shared_folder(config, tmp_path_factory) -> Path:
  """The folder every process of this pytest run sees: the workers' basetemps' parent
  under pytest-xdist, else the run's basetemp."""
  base = tmp_path_factory.getbasetemp()
  return base.parent if hasattr(config, "workerinput") else base


def run_owner_pid(config) -> int:
  """The pytest process whose end ends the run: an xdist worker's parent (the
  controller), else this process."""
  return os.getppid() if hasattr(config, "workerinput") else os.getpid()


def _paths(folder: Path, name: str) -> tuple[Path, Path, Path]:
  stem = folder / f"check_{name}"
  return Path(f"{stem}.json"), Path(f"{stem}.started"), Path(f"{stem}.lock")


@contextlib.contextmanager
def _locked(path: Path):
  with open(path, "w") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    yield


def _alive(pid: int) -> bool:
  """Whether ``pid`` is a running process (a zombie, exited but not yet reaped by its
  parent, is not)."""
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  try:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
  except (OSError, IndexError):
    return True


def _write(out: Path, returncode: int, stdout: str, stderr: str):
  tmp = out.with_suffix(f".{os.getpid()}.tmp")
  tmp.write_text(json.dumps([returncode, stdout, stderr]))
  os.replace(tmp, out)


def _read(cmd, out: Path) -> subprocess.CompletedProcess:
  return subprocess.CompletedProcess(cmd, *json.loads(out.read_text()))


def start(folder: Path, name: str, cmd: list[str], env: dict[str, str], timeout: float,
          watch_pid: int) -> bool:
  """Starts check ``name`` (``cmd`` under ``env``) in the background unless this run has
  started it or has its output already.

  Args:
    folder: the run's shared folder (``shared_folder``).
    timeout: seconds after which the runner kills the check and records a failure.
    watch_pid: the runner kills the check, and records nothing, once this process ends.

  Returns:
    Whether this call started it.
  """
  out, started, lock = _paths(folder, name)
  with _locked(lock):
    if out.is_file() or started.is_file():
      return False
    runner = subprocess.Popen(
        [sys.executable, __file__, str(out), name, str(timeout), str(watch_pid), *cmd], env=env,
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _started.append(runner)
    started.write_text(str(runner.pid))
  return True


def result(folder: Path, name: str, cmd: list[str], env: dict[str, str], timeout: float,
           poll_s: float = 1.0) -> subprocess.CompletedProcess:
  """Check ``name``'s output: read when written, waited for while its runner is alive, and
  run here (under the lock, so that other processes wait) when nobody is running it.

  Returns:
    The check's ``subprocess.CompletedProcess``, its output as text. A check that ran
    past ``timeout``, or a runner that wrote nothing within ``timeout`` plus
    ``WAIT_MARGIN_S``, comes back with a nonzero return code and says so in stderr.
  """
  out, started, lock = _paths(folder, name)
  deadline = time.monotonic() + timeout + WAIT_MARGIN_S
  while True:
    with _locked(lock):
      if out.is_file():
        return _read(cmd, out)
      runner = int(started.read_text()) if started.is_file() else None
      if runner is None or not _alive(runner):
        started.write_text(str(os.getpid()))
        _run(out, name, timeout, os.getpid(), cmd, env)
        return _read(cmd, out)
    if time.monotonic() > deadline:
      return subprocess.CompletedProcess(
          cmd, -1, "", f"[{name}: its background runner (pid {runner}) wrote nothing within "
          f"{timeout + WAIT_MARGIN_S:.0f} s]")
    time.sleep(poll_s)


def _run(out: Path, name: str, timeout: float, watch_pid: int, cmd, env=None):
  """Runs check ``name``: its return code and output into ``out``, a nonzero code past
  ``timeout``, nothing written if ``watch_pid`` ends first. The background runner, and
  a reader that runs the check itself (watching its own process)."""
  check = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
  t0 = time.monotonic()
  while True:
    try:
      stdout, stderr = check.communicate(timeout=1.0)
      code = check.returncode
      break
    except subprocess.TimeoutExpired:
      if not _alive(watch_pid):  # the run is over: nobody will read it
        check.kill()
        check.communicate()
        return
      if time.monotonic() - t0 > timeout:
        check.kill()
        stdout, stderr = check.communicate()
        code, stderr = -9, f"{stderr}\n[{name}: timed out after {timeout:.0f} s]"
        break
  _write(out, code, stdout, stderr)


if __name__ == "__main__":  # the background runner: OUT NAME TIMEOUT WATCH_PID CMD...
  _out, _name, _timeout, _watch, *_cmd = sys.argv[1:]
  _run(Path(_out), _name, float(_timeout), int(_watch), _cmd)
