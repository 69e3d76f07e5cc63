"""Shared benchmark plumbing: CUPTI timing, provenance, and the results row format.

Every benchmark writes ``bench/results/<device>/<benchmark>.json``: a list of rows with
at least op, shape, ours_ms, baseline, baseline_ms, device, jax_version, commit, command.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import jax

RESULTS = Path(__file__).resolve().parent / "results"


def device_slug(kind: str | None = None) -> str:
  """A device kind (default: this host's first device's) as a results folder name."""
  kind = kind or jax.devices()[0].device_kind
  return re.sub(r"[^A-Za-z0-9]+", "_", kind).strip("_").lower()


def parse_mesh(spec: str | None):
  """"data=2" or "data=2,model=2" -> a mesh of auto axes ("data", then "model", each 1 if
  not named) over the first devices; None -> None. Exits with a message on a bad spec."""
  import math
  if not spec:
    return None
  axes = {}
  for part in spec.split(","):
    name, _, size = part.partition("=")
    if name not in ("data", "model") or not size.isdigit() or int(size) < 1:
      sys.exit(f"--mesh {spec!r}: expected data=N and/or model=N, e.g. data=2,model=2")
    axes[name] = int(size)
  axes = {"data": axes.get("data", 1), "model": axes.get("model", 1)}
  n = math.prod(axes.values())
  if n > len(jax.devices()):
    sys.exit(f"--mesh {spec!r} needs {n} devices; this host has {len(jax.devices())}")
  auto = (jax.sharding.AxisType.Auto,) * 2  # shardings decided by the partitioner
  return jax.make_mesh(tuple(axes.values()), tuple(axes), devices=jax.devices()[:n],
                       axis_types=auto)


def commit() -> str:
  """The commit benchmarked: $CODA_COMMIT when set (copies of the tree whose .git is
  stale or absent, e.g. on the GPU host), else git's HEAD (+dirty)."""
  if os.environ.get("CODA_COMMIT"):
    return os.environ["CODA_COMMIT"]
  try:
    sha = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True,
                         text=True, check=True, cwd=RESULTS.parent.parent).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True,
                           cwd=RESULTS.parent.parent).stdout.strip()
    return sha + ("+dirty" if dirty else "")
  except (OSError, subprocess.CalledProcessError):
    return "unknown"


def command_line() -> str:
  """How this benchmark was invoked, as a command one can paste in the repo root: as the
  user typed it where a wrapper script says so (``CODA_JAX_COMMAND``, set by
  scripts/main.sh), else the Python command."""
  if os.environ.get("CODA_JAX_COMMAND"):
    return os.environ["CODA_JAX_COMMAND"]
  script = Path(sys.argv[0]).resolve()
  args = " ".join(shlex.quote(a) for a in sys.argv[1:])
  try:
    module = ".".join(script.relative_to(RESULTS.parent.parent).with_suffix("").parts)
    return f"PYTHONPATH=. python -m {module} {args}".rstrip()
  except ValueError:
    return f"python {shlex.quote(sys.argv[0])} {args}".rstrip()


def provenance() -> dict:
  return {"device": jax.devices()[0].device_kind, "jax_version": jax.__version__,
          "commit": commit(), "command": command_line()}


def time_kernels(fn, *args, iterations: int = 30,
                 only: str | None = None) -> tuple[float, list[tuple[str, float]]]:
  """Median over iterations of the summed device time of all kernels ``fn`` launches
  (CUPTI; with ``only``, of those whose name contains it), and the per-kernel medians of
  the first breakdown (all kernels)."""
  from jax.experimental.mosaic.gpu import profiler
  _, timings = profiler.measure(jax.jit(fn), aggregate=False, iterations=iterations)(*args)
  if timings is None:
    raise RuntimeError("CUPTI recorded no kernels")
  if iterations == 1:
    timings = [timings]
  totals = [sum(t for name, t in it if only is None or only in name) for it in timings]
  if not any(totals):
    raise RuntimeError(f"no kernel named *{only}* among {[n for n, _ in timings[0]]}")
  per_kernel = [(name, statistics.median(it[i][1] for it in timings))
                for i, (name, _) in enumerate(timings[0])]
  return statistics.median(totals), per_kernel


class DroppingEnv:
  """An epilogue ``Env`` that runs a primitive's own ``apply`` without the outputs named
  in ``dropped``: their stores are skipped and column sums are not taken (they return
  None; what only fed them is dead code). For timing what those outputs cost
  (``bench.epilogue_pass``, ``bench.ablate_epilogue``), never for values."""

  def __init__(self, env, dropped):
    self._env, self._dropped = env, set(dropped)
    self.load, self.column_ids = env.load, env.column_ids
    self.column_value, self.cond = env.column_value, env.cond

  def store(self, name, value):
    if name not in self._dropped:
      self._env.store(name, value)

  def column_sum(self, x):
    return None

  def store_column_sum(self, name, x):
    if name not in self._dropped:
      self._env.store_column_sum(name, x)


def _first_visible_gpu() -> int:
  """The index nvidia-smi gives the device jax puts work on first: the first of
  ``CUDA_VISIBLE_DEVICES`` where that is set, else 0."""
  visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
  return int(visible) if visible.isdigit() else 0


def nvidia_smi_readings(interval: float, gpu: int | None = None):
  """(SM clock in MHz, board power in W) of one GPU every ``interval`` seconds, from one
  ``nvidia-smi -lms`` process (spawning one per reading takes longer than the interval),
  as an iterable with a ``close()`` that stops the process; None where nvidia-smi is
  missing or cannot read the GPU. The power is the instantaneous reading
  (``power.draw.instant``) where the driver has it: ``power.draw`` is averaged over a
  second, which smears a window of a second or two into its neighbours."""
  gpu = _first_visible_gpu() if gpu is None else gpu
  for field in ("power.draw.instant", "power.draw"):
    query = ["nvidia-smi", f"--id={gpu}", f"--query-gpu=clocks.sm,{field}",
             "--format=csv,noheader,nounits"]
    try:  # one reading first: the driver may lack the field, or the GPU be unreadable
      probe = subprocess.run(query, capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
      continue
    if _smi_reading(probe.stdout) is not None:
      return _SmiStream(query + [f"-lms={max(1, round(interval * 1e3))}"], field)
  return None


def _smi_reading(line: str) -> tuple[float, float] | None:
  """(MHz, W) from one line of the query's csv; None for "[N/A]" or a partial line."""
  try:
    mhz, watts = (float(v) for v in line.strip().split(","))
  except ValueError:
    return None
  return mhz, watts


class _SmiStream:
  """The readings of a looping nvidia-smi query (``field``: which power reading);
  ``close`` ends the process."""

  def __init__(self, command: list[str], field: str):
    self.field = field
    self._proc = subprocess.Popen(command, stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, text=True)

  def __iter__(self):
    for line in self._proc.stdout:
      reading = _smi_reading(line)
      if reading is not None:
        yield reading

  def close(self):
    self._proc.terminate()
    try:
      self._proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
      self._proc.kill()


class PowerLog:
  """The GPU's SM clock and power draw, read every ``interval`` seconds by a background
  thread, to read beside timing windows: under back-to-back GEMMs an H100 sits at its
  power cap, so a block's time there is its energy per call over the cap's watts
  (docs/performance.md, "The power cap"), and ``window`` gives both.

      with PowerLog() as log:
        t0 = time.perf_counter(); ...; t1 = time.perf_counter()
        log.window(t0, t1)  # {"mhz": ..., "watts": ..., "samples": ...} or None

  ``readings(interval)`` returns an iterable of (MHz, W) that yields about every
  ``interval`` seconds (and may have a ``close()``, called on exit), or None where there
  is nothing to read (no GPU, no nvidia-smi): every window is then None. Each reading
  is stamped with ``clock``, which must be the clock the windows are read with."""

  def __init__(self, readings=nvidia_smi_readings, interval: float = 0.1,
               clock=time.perf_counter):
    if interval <= 0:
      raise ValueError(f"PowerLog interval={interval}: must be positive")
    self._readings, self._interval, self._clock = readings, interval, clock
    self._samples: list[tuple[float, float, float]] = []
    self._source = self._stop = self._thread = None

  def __enter__(self):
    import threading
    self._stop = threading.Event()
    self._source = self._readings(self._interval)
    if self._source is not None:
      self._thread = threading.Thread(target=self._run, name="PowerLog", daemon=True)
      self._thread.start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    if hasattr(self._source, "close"):
      self._source.close()
    if self._thread is not None:
      self._thread.join(timeout=10)

  def _run(self):
    for mhz, watts in self._source:
      if self._stop.is_set():
        return
      self._samples.append((self._clock(), mhz, watts))

  @property
  def field(self) -> str | None:
    """Which power reading the samples are (nvidia-smi's field name), where known."""
    return getattr(self._source, "field", None)

  def window(self, t0: float, t1: float, settle_s: float = 0.3) -> dict | None:
    """Mean SM clock and power of the readings taken from ``t0 + settle_s`` (the power
    controller settles within ~0.2 s of a load starting) to ``t1``: {"mhz", "watts",
    "samples"}, or None where none fell there."""
    inside = [(mhz, w) for t, mhz, w in list(self._samples) if t0 + settle_s <= t <= t1]
    if not inside:
      return None
    return dict(mhz=statistics.fmean(m for m, _ in inside),
                watts=statistics.fmean(w for _, w in inside), samples=len(inside))


class Sustained(NamedTuple):
  """A back-to-back timing window: ms per call, the calls made, and (with a
  ``PowerLog``) the window's mean SM clock and power draw."""
  ms: float
  calls: int
  mhz: float | None = None
  watts: float | None = None

  @property
  def joules(self) -> float | None:
    """Energy per call: the window's mean power times its time per call."""
    return None if self.watts is None else self.watts * self.ms / 1e3


def back_to_back_ms(call, seconds: float, *, sync=jax.block_until_ready,
                    clock=time.perf_counter, power: PowerLog | None = None) -> Sustained:
  """``call`` (no arguments) run back to back for about ``seconds`` of ``clock``,
  synchronised once at the end, after one synchronised call that warms it and sizes the
  window: a ``Sustained`` of ms per call and calls made, with the window's clock and
  power where ``power`` (a running ``PowerLog`` on the same clock) has samples in it. An
  H100 running GEMMs back to back sits at its power cap and lowers its clock within a
  fraction of a second, so this measures the speed its energy per call allows; a short
  CUPTI run measures nearer the boost clock (docs/performance.md, "How to measure")."""
  if seconds <= 0:
    raise ValueError(f"seconds={seconds}: must be positive")
  t0 = clock()
  sync(call())
  n = max(3, int(seconds / max(clock() - t0, 1e-6)))
  t0 = clock()
  for _ in range(n):
    out = call()
  sync(out)
  t1 = clock()
  seen = power.window(t0, t1) if power is not None else None
  return Sustained((t1 - t0) / n * 1e3, n, *((seen["mhz"], seen["watts"]) if seen else ()))


def alternating_windows(calls: dict, seconds: float, rounds: int, *,
                        sync=jax.block_until_ready, clock=time.perf_counter,
                        power: "PowerLog | None" = None,
                        warmup_s: float | None = None) -> dict:
  """name -> [``Sustained``, one per round]: each of ``calls`` (name -> a function of no
  arguments) timed by ``back_to_back_ms`` once a round, the even rounds in the given
  order and the odd ones reversed (ABBA), with ``power`` read through each window.

  Before the rounds the first call runs back to back for ``warmup_s`` (default
  ``seconds``; 0 skips it), untimed: a GPU left idle through the compiles sits at its
  idle clock (345 MHz on an H200), and a window that starts there spends its start
  climbing, which made the first config timed look up to 2x slower than it is
  (docs/performance.md, "How to measure")."""
  if seconds <= 0:
    raise ValueError(f"seconds={seconds}: must be positive")
  if rounds < 1:
    raise ValueError(f"rounds={rounds}: at least one round")
  names = list(calls)
  warmup_s = seconds if warmup_s is None else warmup_s
  if names and warmup_s > 0:
    back_to_back_ms(calls[names[0]], warmup_s, sync=sync, clock=clock)
  out = {name: [] for name in names}
  for r in range(rounds):
    for name in names if r % 2 == 0 else names[::-1]:
      out[name].append(back_to_back_ms(calls[name], seconds, sync=sync, clock=clock,
                                       power=power))
  return out


def mean_sustained(windows: list[Sustained]) -> Sustained:
  """Several windows of one function as one: mean ms per call, calls summed, clock and
  power averaged over the windows that have them."""
  if not windows:
    raise ValueError("mean_sustained: no windows")
  seen = [w for w in windows if w.watts is not None]
  return Sustained(statistics.fmean(w.ms for w in windows), sum(w.calls for w in windows),
                   *((statistics.fmean(w.mhz for w in seen),
                      statistics.fmean(w.watts for w in seen)) if seen else ()))


@jax.jit
def _leaf_rel_diff(got, want):
  got, want = got.astype("float32"), want.astype("float32")
  return jax.numpy.sqrt(jax.numpy.sum((got - want) ** 2) / jax.numpy.sum(want * want))


def rel_diff(got, want) -> float:
  """Largest relative Frobenius difference over the leaves of two matching pytrees, one
  fused reduction per leaf (no fp32 copies of large outputs)."""
  return max(float(_leaf_rel_diff(a, b))
             for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))


def write_results(benchmark: str, rows: list[dict], markdown: str,
                  out: Path | None = None) -> Path:
  """Writes <benchmark>.json and .md into ``out`` (default results/<device>/)."""
  out = Path(out) if out is not None else RESULTS / device_slug()
  out.mkdir(parents=True, exist_ok=True)
  (out / f"{benchmark}.json").write_text(json.dumps(rows, indent=1) + "\n")
  (out / f"{benchmark}.md").write_text(markdown)
  return out
