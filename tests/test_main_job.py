"""The main job (bench.train) as a user meets it: argument errors from argparse, each of
several paths in a process of its own, a path that cannot fit reported and skipped with
the other path's results still written, and one log line per event."""
import json
import os
import subprocess
import sys

import pytest

from bench import train as job

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 2**30


@pytest.mark.parametrize("argv,message", [
    (["--batch", "0"], "argument --batch: 0 must be at least 1"),
    (["--seq", "x"], "argument --seq: 'x' is not an integer"),
    (["--lr=-1e-3"], "argument --lr: -0.001 must be a positive finite number"),
    (["--steps", "3"], "--steps must exceed the 3 untimed warm-up steps"),
    (["--batch", "8", "--micro-batches", "3"], "--micro-batches 3 must divide --batch 8"),
    (["--eval-batches", "0"], "argument --eval-batches: 0 must be at least 1"),
    (["--paths", "fused,fused"], "--paths fused,fused: distinct names"),
], ids=["batch", "seq", "lr", "steps", "micro_batches", "eval_batches", "paths"])
def test_bad_arguments_are_argparse_errors(argv, message, capsys):
  with pytest.raises(SystemExit) as e:
    job.parse_args(["--config", "tiny", *argv])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert err.startswith("usage: python -m bench.train") and message in err, err


def test_each_path_gets_its_own_command():
  args = job.parse_args(["--config", "tiny", "--paths", "fused,reference", "--steps", "8"])
  assert args.spawn
  cmd = job.child_command(args, "reference", "/tmp/r.json")
  assert cmd[1:] == ["-m", "bench.train", "--config", "tiny", "--steps", "8", "--paths",
                     "reference", "--child-result", "/tmp/r.json"]
  one = job.parse_args(["--config", "tiny", "--paths=fused,reference", "--one-process"])
  assert not one.spawn and job.child_command(one, "fused", "r")[3:] == [
      "--config", "tiny", "--paths", "fused", "--child-result", "r"]
  assert not job.parse_args(["--config", "tiny", "--paths", "fused"]).spawn


class FakeDevice:
  """A jax device as ``temp_room`` reads it."""

  def __init__(self, name, **stats):
    self.name, self.stats = name, stats

  def memory_stats(self):
    return self.stats or None  # None, as a CPU device answers

  def __str__(self):
    return self.name


def test_the_scratch_buffer_is_checked_against_what_can_be_allocated_now():
  fragmented = dict(bytes_limit=132 * GIB, pool_bytes=132 * GIB,
                    largest_free_block_bytes=70 * GIB)
  growing = dict(bytes_limit=132 * GIB, pool_bytes=30 * GIB, largest_free_block_bytes=20 * GIB)
  assert job.largest_allocation(fragmented) == 70 * GIB
  assert job.largest_allocation(growing) == 102 * GIB  # a new region can still be reserved
  assert job.largest_allocation(None) is None and job.largest_allocation({}) is None
  fits, too_big = FakeDevice("gpu0", **growing), FakeDevice("gpu1", **fragmented)
  assert job.temp_room(71 * GIB, [fits, fits]) is None
  assert job.temp_room(71 * GIB, [FakeDevice("cpu0")]) is None  # no statistics
  assert job.temp_room(0, [too_big]) is None
  device, room = job.temp_room(71 * GIB, [fits, too_big])
  assert device is too_big and room == 70 * GIB


def test_run_path_retries_with_more_micro_batches_then_skips(monkeypatch):
  tried = []

  def attempt(path, cfg, args, train_batches, val_batches, k):
    tried.append(k)
    if k < 4:
      raise job.NeedsMoreMicroBatches(2 * k)
    raise job.DoesNotFit(f"nothing fits at {k}")
  monkeypatch.setattr(job, "train_path", attempt)
  args = job.parse_args(["--config", "tiny", "--paths", "reference"])
  r = job.run_path("reference", None, args, [], [])
  assert tried == [1, 2, 4]
  assert r == {"path": "reference", "skipped": "nothing fits at 4"}


def test_a_skipped_path_leaves_the_other_paths_results(tmp_path, monkeypatch):
  """The reference fits nowhere (as on a device too small for it): the fused path's
  results are written, and the report says why the reference is missing."""
  real = job.train_path

  def train_path(path, *a):
    if path == "reference":
      raise job.DoesNotFit("83.6 GiB does not fit in 75.2 GiB at 8 micro-batches")
    return real(path, *a)
  monkeypatch.setattr(job, "train_path", train_path)
  monkeypatch.setattr("sys.argv", [
      "bench.train", "--config", "tiny", "--steps", "4", "--batch", "2", "--seq", "64",
      "--eval-batches", "1", "--one-process", "--compile-cache", "none",
      "--program-cache", "none", "--out", str(tmp_path)])
  job.main()
  rows = {r["op"]: r for r in json.loads((tmp_path / "train_tiny.json").read_text())}
  assert len(rows["train_step_fused"]["losses"]) == 4
  assert rows["train_step_reference"]["skipped"].startswith("83.6 GiB does not fit")
  assert "train_step" not in rows  # no comparison without both paths
  md = (tmp_path / "train_tiny.md").read_text()
  assert "| reference | skipped: 83.6 GiB does not fit in 75.2 GiB" in md


def test_both_paths_run_in_their_own_processes(tmp_path):
  """The default run: each path in a child process, the report written by the parent
  with the command as the user typed it, every log line once."""
  out = tmp_path / "out"
  cmd = [sys.executable, "-m", "bench.train", "--config", "tiny", "--steps", "4",
         "--batch", "2", "--seq", "64", "--eval-batches", "1", "--compile-cache", "none",
         "--program-cache", "none", "--out", str(out)]
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu",
             CODA_JAX_COMMAND="bash scripts/main.sh --steps 4")
  run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
  log = run.stdout + run.stderr
  assert run.returncode == 0, log[-4000:]
  assert "paths fused,reference (each in a process of its own)" in log
  rows = {r["op"]: r for r in json.loads((out / "train_tiny.json").read_text())}
  assert rows["train_step_fused"]["losses"][0] == pytest.approx(
      rows["train_step_reference"]["losses"][0], abs=2e-3)  # the same start, both paths
  assert rows["train_step"]["command"] == "bash scripts/main.sh --steps 4"
  lines = [line for line in log.splitlines() if line.strip()]
  for path in ("fused", "reference"):
    last = [line for line in lines if line.startswith(f"{path}: loss") and " 4/4 " in line]
    assert len(last) == 1, last  # the final progress line once
  assert lines.count("tiny: 4 layers, d_model 256, 4/2 heads of 64, ffn 512, vocab 256: "
                     "2.5M parameters") == 1
  assert not any("coda_jax: coda_jax" in line or "coda_jax:coda_jax:" in line
                 for line in lines)
  fallback = [line for line in lines if "ran xla" in line]
  assert fallback and all(line.startswith("WARNING coda_jax: ran xla") for line in fallback)
