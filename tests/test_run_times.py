"""tests/run_times.py through the real conftest: with CODA_JAX_TEST_TIMES set, the process
that starts the run writes each test's time, outcome and worker as the test ends; a
pytest-xdist worker writes nothing itself; a nested run (``helpers.run_pytest``) writes
to its own file, not its caller's; ``summary`` adds them up."""
import os

import pytest

import run_times
from helpers import run_probe_under_conftest

PROBE = '''
import os, time
import pytest

TIMES = os.environ.get("CODA_JAX_TEST_TIMES")

@pytest.fixture
def slow_setup():
  time.sleep(0.3)
  yield
  time.sleep(0.2)

@pytest.fixture
def broken_setup():
  raise RuntimeError("setup fails")

def test_a_passes(slow_setup):
  time.sleep(0.4)

def test_b_fails():
  assert False

def test_c_skips():
  pytest.skip("a reason")

def test_d_errors(broken_setup):
  pass

def test_e_sees_the_lines_before_it():
  # written as each test ended, not when the run ends (no workers: tests run in order)
  if os.environ.get("PYTEST_XDIST_WORKER"):
    return
  names = [line.rstrip("\\n").split("\\t")[4].split("::")[1] for line in open(TIMES)]
  assert names == ["test_a_passes", "test_b_fails", "test_c_skips", "test_d_errors"], names
'''


def _run(tmp_path, workers, own_file=True):
  """The probe under the real conftest, in a nested pytest whose environment names a
  times file of the caller's; the nested run is given one of its own where
  ``own_file``. Returns the rows of the nested run's file by test name."""
  times = tmp_path / f"times{workers}.tsv" if own_file else None
  callers = tmp_path / f"callers{workers}.tsv"
  # the last probe reads the nested run's own file, which it lacks without one
  args = [] if own_file else ["-k", "not sees_the_lines"]
  run = run_probe_under_conftest(tmp_path / f"run{workers}", PROBE, workers,
                                 dict(os.environ, CODA_JAX_TEST_TIMES=str(callers)),
                                 args=args, times_file=times)
  passed = 2 if own_file else 1
  assert f"1 failed, {passed} passed, 1 skipped" in run.stdout, run.stdout + run.stderr
  assert not callers.exists(), "the nested run wrote into its caller's times file"
  if times is None:
    return {}
  rows = run_times.read(str(times))
  assert len(rows) == 5, rows  # one line a test, none twice
  return {r[4].split("::")[1]: r for r in rows}


@pytest.mark.parametrize("workers", [1, 2])
def test_each_test_written_as_it_ends(tmp_path, workers):
  """One line a test, none twice: setup + call + teardown seconds, the outcome, the worker
  (gw0/gw1 under pytest-xdist, '-' without), and ends in order of finishing."""
  rows = _run(tmp_path, workers)
  assert sorted(rows) == ["test_a_passes", "test_b_fails", "test_c_skips", "test_d_errors",
                          "test_e_sees_the_lines_before_it"], rows
  outcomes = {name: r[1] for name, r in rows.items()}
  assert outcomes == {"test_a_passes": "passed", "test_b_fails": "failed",
                      "test_c_skips": "skipped", "test_d_errors": "error",
                      "test_e_sees_the_lines_before_it": "passed"}, outcomes
  assert 0.9 <= rows["test_a_passes"][0] < 30, rows["test_a_passes"]  # 0.3 + 0.4 + 0.2
  assert all(r[0] < 0.9 for n, r in rows.items() if n != "test_a_passes"), rows
  workers_seen = {r[2] for r in rows.values()}
  if workers == 1:
    assert workers_seen == {"-"}, rows
    ends = [rows[n][3] for n in sorted(rows)]
    assert ends == sorted(ends), rows
  else:
    assert workers_seen <= {"gw0", "gw1"} and workers_seen, rows


def test_a_nested_run_leaves_its_callers_file_alone(tmp_path):
  """``helpers.run_pytest`` without a times file of its own: the nested run's tests
  (the probe's) are written nowhere, not into the file its caller's run writes."""
  assert _run(tmp_path, 1, own_file=False) == {}


def test_summary_adds_up_tests_files_and_workers():
  rows = [(10.0, "passed", "gw0", 10.0, "tests/test_x.py::a"),
          (5.0, "failed", "gw0", 15.0, "tests/test_y.py::b"),
          (2.0, "passed", "gw1", 2.0, "tests/test_x.py::c")]
  text = run_times.summary(rows, top=2)
  assert "3 tests, 17 worker-seconds; outcomes failed 1, passed 2" in text, text
  assert text.index("tests/test_x.py::a") < text.index("tests/test_y.py::b"), text
  assert "tests/test_x.py::c" not in text.split("slowest 2 files")[0], text  # top 2 only
  files = text.split("slowest 2 files (seconds, tests):\n")[1].split("\nworkers")[0]
  assert files.splitlines()[0].split() == ["12.0", "s", "2", "tests/test_x.py"], files
  workers = text.split("tests):\n")[-1].splitlines()
  assert [w.split()[:5] for w in workers] == [["gw1", "2.0", "s", "2.0", "s"],
                                              ["gw0", "15.0", "s", "15.0", "s"]], workers


def test_split_deals_equal_time_heaviest_first(tmp_path, capsys):
  """``--split``: every collected id in exactly one list, the lists' times within the
  slowest test of each other, each list heaviest first, an id the file lacks at the
  median time; the command line writes the lists and says what each holds."""
  times = [30.0, 20.0, 11.0, 10.0, 9.0, 5.0, 4.0, 1.0]
  rows = [(t, "passed", "gw0", 0.0, f"tests/test_x.py::t{j}") for j, t in enumerate(times)]
  ids = [r[4] for r in rows] + ["tests/test_new.py::fresh"]
  seconds = {r[4]: r[0] for r in rows}
  lists = run_times.split(seconds, ids, 2)
  assert sorted(sum(lists, [])) == sorted(ids)
  cost = seconds | {"tests/test_new.py::fresh": 10.0}  # the median
  totals = [sum(cost[i] for i in l) for l in lists]
  assert abs(totals[0] - totals[1]) <= 1.0, (totals, lists)  # 50 and 50 here
  for l in lists:
    assert [cost[i] for i in l] == sorted((cost[i] for i in l), reverse=True), l
  assert run_times.split(seconds, ids, 1) == [sorted(ids, key=lambda i: (-cost[i], i))]
  with pytest.raises(ValueError, match="at least 1"):
    run_times.split(seconds, ids, 0)
  with pytest.raises(ValueError, match="twice"):
    run_times.split(seconds, ids + ids[:1], 2)

  f = tmp_path / "times.tsv"
  f.write_text("".join("\t".join([str(r[0]), r[1], r[2], str(r[3]), r[4]]) + "\n"
                       for r in rows))
  c = tmp_path / "collected.txt"
  c.write_text("".join(i + "\n" for i in ids) + "\n9 tests collected in 0.1s\n")
  run_times._main(["--split", "2", str(f), str(c), str(tmp_path / "part")])
  written = [(tmp_path / f"part.{k}").read_text().splitlines() for k in (1, 2)]
  assert written == lists
  out = capsys.readouterr().out
  assert "part.1: " in out and "not in" in out, out


def test_left_lists_what_no_times_file_finished(tmp_path, capsys):
  """``--left``: the collected ids that no times file lists, whatever their outcome
  there, in the collected order, each once; the command line reads several files."""
  ids = [f"tests/test_x.py::t{j}" for j in range(6)]
  assert run_times.left(ids, {ids[1], ids[4]}) == [ids[0], ids[2], ids[3], ids[5]]
  assert run_times.left(ids + ids[:1], set()) == ids
  assert run_times.left(ids, set(ids)) == []

  def times_file(name, rows):
    f = tmp_path / name
    f.write_text("".join(f"1.0\t{outcome}\tgw0\t1.0\t{i}\n" for i, outcome in rows))
    return str(f)

  first = times_file("a.tsv", [(ids[0], "passed"), (ids[3], "failed")])
  second = times_file("b.tsv", [(ids[5], "skipped")])
  c = tmp_path / "collected.txt"
  c.write_text("".join(i + "\n" for i in ids) + "\n6 tests collected in 0.1s\n")
  out = tmp_path / "left.txt"
  run_times._main(["--left", str(c), str(out), first, second])
  assert out.read_text().splitlines() == [ids[1], ids[2], ids[4]]
  assert "3 tests of" in capsys.readouterr().out
