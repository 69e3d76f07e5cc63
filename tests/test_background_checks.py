"""tests/background_checks.py: a long subprocess check runs once per run, started early,
read by every process that needs it, never outliving its run."""
import os
import subprocess
import sys
import time

import pytest

import background_checks as bc


def _cmd(code: str) -> list[str]:
  return [sys.executable, "-c", code]


def _wait_for(path, seconds=30.0):
  deadline = time.monotonic() + seconds
  while not path.exists():
    assert time.monotonic() < deadline, f"{path} never appeared"
    time.sleep(0.05)


def test_started_once_and_read_by_all(tmp_path):
  """The first start runs it; later starts (other workers) do not; every reader gets the
  runner's output, code and stderr included, without running it again."""
  counter = tmp_path / "runs"
  cmd = _cmd(f"import sys; open({str(counter)!r}, 'a').write('x'); print('out'); "
             "print('err', file=sys.stderr); sys.exit(3)")
  assert bc.start(tmp_path, "c", cmd, dict(os.environ), 60, os.getpid())
  assert not bc.start(tmp_path, "c", cmd, dict(os.environ), 60, os.getpid())
  for _ in range(2):
    got = bc.result(tmp_path, "c", cmd, dict(os.environ), 60, poll_s=0.05)
    assert (got.returncode, got.stdout, got.stderr) == (3, "out\n", "err\n")
  assert counter.read_text() == "x"
  assert not bc.start(tmp_path, "c", cmd, dict(os.environ), 60, os.getpid())  # written


def test_reader_runs_it_where_nobody_is(tmp_path):
  """Nothing started (a test run alone), or a runner that died without writing: the
  reader runs the check itself."""
  cmd = _cmd("print('here')")
  assert bc.result(tmp_path, "alone", cmd, dict(os.environ), 60).stdout == "here\n"
  dead = subprocess.Popen(_cmd("pass"))
  dead.wait()
  (tmp_path / "check_died.started").write_text(str(dead.pid))
  assert bc.result(tmp_path, "died", cmd, dict(os.environ), 60, poll_s=0.05).stdout == "here\n"


def test_a_check_past_its_timeout_fails_and_says_so(tmp_path):
  """Past its timeout the check is killed and recorded as failed, in the runner and
  when a reader runs it."""
  cmd = _cmd("import time; time.sleep(60)")
  bc.start(tmp_path, "slow", cmd, dict(os.environ), 1, os.getpid())
  got = bc.result(tmp_path, "slow", cmd, dict(os.environ), 1, poll_s=0.05)
  assert got.returncode != 0 and "timed out after 1 s" in got.stderr, got
  got = bc.result(tmp_path, "slow_here", cmd, dict(os.environ), 1)
  assert got.returncode != 0 and "slow_here: timed out after 1 s" in got.stderr, got


def test_the_check_ends_with_its_run(tmp_path):
  """When the watched pytest process ends, the runner kills its check and writes nothing
  (a later reader would run it afresh)."""
  owner = subprocess.Popen(_cmd("import time; time.sleep(60)"))
  pid_file = tmp_path / "check_pid"
  cmd = _cmd(f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); "
             "time.sleep(60)")
  bc.start(tmp_path, "orphan", cmd, dict(os.environ), 60, owner.pid)
  _wait_for(pid_file)
  check_pid = int(pid_file.read_text())
  owner.kill()
  owner.wait()
  runner = bc._started[-1]
  runner.wait(timeout=30)
  assert not bc._alive(check_pid)
  assert not (tmp_path / "check_orphan.json").exists()


@pytest.mark.parametrize("fixture", sorted(bc.SHARDED_CHECKS))
def test_sharded_checks_run_on_the_cpu_at_the_lowest_level(fixture, monkeypatch):
  """sharded_check.py runs on CPU devices, its programs compiled at LLVM's lowest level
  unless the caller set a level; XLA_FLAGS already given are kept."""
  monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/nowhere")
  name, cmd, env, timeout = bc.sharded_check(fixture)
  assert cmd[1].endswith("sharded_check.py") and timeout > 0 and name
  assert env["JAX_PLATFORMS"] == "cpu"
  assert env["XLA_FLAGS"] == "--xla_dump_to=/nowhere --xla_backend_optimization_level=0"
  monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=2")
  assert bc.sharded_check(fixture)[2]["XLA_FLAGS"] == "--xla_backend_optimization_level=2"
