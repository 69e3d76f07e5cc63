"""Each test's time, written down as the test ends, for runs that may be cut short.

``CODA_JAX_TEST_TIMES=FILE``: the process that starts the run (pytest-xdist's controller,
or pytest without workers) appends one line to FILE as each test ends, tab-separated:

  seconds (setup + call + teardown), outcome, worker, seconds since the run began, node id

pytest's ``--durations`` prints only when the run ends, so a GPU run cut by a device
call's time limit returns no times at all. This file keeps the times of every test that
finished.
``python tests/run_times.py FILE`` summarises one: the slowest tests and files, and each
worker's busy seconds against its last test's end (a worker idle long before the others
is a tail of the run). ``python tests/run_times.py --split N FILE COLLECTED OUT`` deals
the node ids of COLLECTED (one a line, e.g. ``pytest --collect-only -q``'s) into N lists
of about equal time by FILE's times, heaviest first, written to ``OUT.1`` ... ``OUT.N``:
the GPU suite on one H200 is ~8,600-10,400 worker-seconds, over one device call's limit on 16
workers, so it runs as N calls of ``xargs -0 pytest < OUT.k``.
``python tests/run_times.py --left COLLECTED OUT FILE...`` writes to
OUT the ids of COLLECTED that none of the FILEs lists (those a call's limit cut off, or
never started), in COLLECTED's order, for the next call to run first. Collect the ids on
the machine that runs them: a parametrised test's id can differ between pytest versions.
"""
from __future__ import annotations

import collections
import os
import sys
import time

TIMES_ENV = "CODA_JAX_TEST_TIMES"


class Recorder:
  """Adds up each test's phases and appends its line at its teardown."""

  def __init__(self, path: str):
    self.path = path
    self.start = time.monotonic()
    self.phases: dict[str, tuple[float, str]] = {}

  def add(self, report) -> None:
    seconds, outcome = self.phases.get(report.nodeid, (0.0, "passed"))
    seconds += report.duration
    # a test failed if any phase did; it was skipped if its setup or call skipped
    if report.failed:
      outcome = "failed" if report.when == "call" else "error"
    elif report.skipped and outcome == "passed":
      outcome = "skipped"
    self.phases[report.nodeid] = (seconds, outcome)
    if report.when != "teardown":
      return
    del self.phases[report.nodeid]
    node = getattr(report, "node", None)  # the pytest-xdist worker that ran it
    worker = getattr(getattr(node, "gateway", None), "id", None) or "-"
    line = "\t".join([f"{seconds:.3f}", outcome, worker,
                      f"{time.monotonic() - self.start:.1f}", report.nodeid])
    with open(self.path, "a", encoding="utf-8") as f:
      f.write(line + "\n")


def recorder(env=None) -> Recorder | None:
  """The recorder for this process: where ``CODA_JAX_TEST_TIMES`` names a file and this
  process is not a pytest-xdist worker (the controller receives the workers' reports);
  else None."""
  env = os.environ if env is None else env
  path = env.get(TIMES_ENV)
  if not path or env.get("PYTEST_XDIST_WORKER"):
    return None
  return Recorder(path)


def read(path: str) -> list[tuple[float, str, str, float, str]]:
  """The lines of a times file as (seconds, outcome, worker, end, node id)."""
  rows = []
  with open(path, encoding="utf-8") as f:
    for line in f:
      seconds, outcome, worker, end, nodeid = line.rstrip("\n").split("\t", 4)
      rows.append((float(seconds), outcome, worker, float(end), nodeid))
  return rows


def summary(rows, top: int = 20) -> str:
  """The slowest tests and files, and each worker's busy time and last end."""
  out = [f"{len(rows)} tests, {sum(r[0] for r in rows):.0f} worker-seconds; outcomes "
         + ", ".join(f"{k} {v}" for k, v in
                     sorted(collections.Counter(r[1] for r in rows).items()))]
  out.append(f"slowest {top} tests:")
  out += [f"  {r[0]:8.1f} s  {r[4]}" for r in sorted(rows, key=lambda r: -r[0])[:top]]
  files = collections.defaultdict(lambda: [0.0, 0])
  for r in rows:
    f = files[r[4].split("::")[0]]
    f[0] += r[0]
    f[1] += 1
  out.append(f"slowest {top} files (seconds, tests):")
  out += [f"  {s:8.1f} s  {n:4d}  {name}"
          for name, (s, n) in sorted(files.items(), key=lambda kv: -kv[1][0])[:top]]
  workers = collections.defaultdict(lambda: [0.0, 0.0, 0])
  for r in rows:
    w = workers[r[2]]
    w[0] += r[0]
    w[1] = max(w[1], r[3])
    w[2] += 1
  out.append("workers (busy seconds, last test ended at, tests):")
  out += [f"  {name:5s} {busy:8.1f} s  {end:8.1f} s  {n:4d}"
          for name, (busy, end, n) in sorted(workers.items(), key=lambda kv: kv[1][1])]
  return "\n".join(out)


def split(seconds: dict[str, float], collected: list[str], parts: int) -> list[list[str]]:
  """``collected``'s node ids dealt into ``parts`` lists of about equal time: each id, the
  slowest first, goes to the list with the least time so far. An id the times file lacks
  (a new test) counts the median of the file's times. Each list is heaviest first, so
  pytest-xdist starts its slowest tests early.

  Args:
    seconds: node id -> seconds, from a times file (``read``).
    collected: the node ids to deal, each once.
    parts: how many lists (at least 1).

  Returns:
    ``parts`` lists of node ids; together ``collected``, each id once.

  Raises:
    ValueError: for parts below 1, or an id twice in ``collected``.
  """
  if parts < 1:
    raise ValueError(f"parts={parts}: deal into at least 1 list")
  twice = sorted(i for i, n in collections.Counter(collected).items() if n > 1)
  if twice:
    raise ValueError(f"node ids listed twice in the collected ids: {twice[:5]}")
  known = sorted(seconds.values())
  median = known[len(known) // 2] if known else 1.0
  cost = {i: seconds.get(i, median) for i in collected}
  lists, totals = [[] for _ in range(parts)], [0.0] * parts
  for i in sorted(collected, key=lambda i: (-cost[i], i)):
    k = min(range(parts), key=lambda k: (totals[k], k))
    lists[k].append(i)
    totals[k] += cost[i]
  return lists


def left(collected: list[str], finished: set[str]) -> list[str]:
  """The ids of ``collected`` that ``finished`` lacks, in ``collected``'s order: what a run
  cut short by a device call's limit still owes.

  Args:
    collected: node ids, e.g. one part of ``split``.
    finished: the node ids of the times files the runs wrote (any outcome).

  Returns:
    The ids still to run, each once.
  """
  return [i for i in dict.fromkeys(collected) if i not in finished]


def _read_ids(path: str) -> list[str]:
  with open(path, encoding="utf-8") as f:
    return [l.strip() for l in f if "::" in l]


def _main(argv) -> None:
  if len(argv) >= 4 and argv[0] == "--left":
    collected, out, times = argv[1], argv[2], argv[3:]
    finished = {r[4] for t in times for r in read(t)}
    ids = left(_read_ids(collected), finished)
    with open(out, "w", encoding="utf-8") as f:
      f.write("".join(i + "\n" for i in ids))
    print(f"{out}: {len(ids)} tests of {collected} not in {', '.join(times)}")
    return
  if len(argv) == 5 and argv[0] == "--split":
    parts, times, collected, out = int(argv[1]), argv[2], argv[3], argv[4]
    ids = _read_ids(collected)
    seconds = {r[4]: r[0] for r in read(times)}
    for k, ids_k in enumerate(split(seconds, ids, parts), 1):
      with open(f"{out}.{k}", "w", encoding="utf-8") as f:
        f.write("".join(i + "\n" for i in ids_k))
      known = sum(seconds[i] for i in ids_k if i in seconds)
      print(f"{out}.{k}: {len(ids_k)} tests, {known:.0f} worker-seconds known, "
            f"{sum(i not in seconds for i in ids_k)} not in {times}")
    return
  if len(argv) not in (1, 2):
    sys.exit("usage: python tests/run_times.py TIMES_FILE [TOP]\n"
             "       python tests/run_times.py --split N TIMES_FILE COLLECTED_IDS OUT\n"
             "       python tests/run_times.py --left COLLECTED_IDS OUT TIMES_FILE...")
  print(summary(read(argv[0]), *(int(a) for a in argv[1:])))


if __name__ == "__main__":
  _main(sys.argv[1:])
