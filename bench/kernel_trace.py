"""Where a GEMM kernel's warpgroups spend their cycles, from Mosaic GPU's on-device
profiler. GPU host only for tracing; the summary reads trace files anywhere.

    PYTHONPATH=. python -m bench.compare_configs --workloads bench \\
        --shapes 16384x2048x8192 --programs plain,residual_sumsq_aux --trace /tmp/tr
    PYTHONPATH=. python -m bench.kernel_trace --by-step '/tmp/tr/*/*/*.json'  # again

``pallas_kernels.gemm_mgpu.traced(folder)`` makes the kernels ``gemm`` builds note, for
each compute warpgroup, the SM cycle at which it enters and leaves the kernel's named
regions: ``mainloop`` (the K loop of one tile, from its first wait for a stage to its
last wgmma) and, inside it, each step's ``wait_stage`` (ping-pong kernels); ``epilogue``
(the whole epilogue of that tile) and, inside it, the waits ``wait_turn`` (for the
other warpgroup's epilogue to end: ping-pong), ``wait_operand`` (for a staged operand
sub-tile) and ``wait_store`` (for a store slot to be read out); and the memory
warpgroup's ``wait_slot`` (for a free slot of the ring: ping-pong kernels). Each call
writes one Chrome trace (JSON; open it in Perfetto to see the timeline).

``summarise`` reduces a trace to one row: per tile of a compute warpgroup, in cycles
(medians over the warpgroups' tiles, the first and last tile of each left out):

- ``tiles``: how many tiles the medians are over; ``per wg``: the fewest of them any one
  compute warpgroup gave. The profiler's buffer lives in the shared memory the config
  leaves, and a tile notes a region per K step and two per epilogue sub-tile, so a
  heavy program's trace may hold each warpgroup's first two or three tiles only: under
  ``STEADY_TILES`` a row describes the kernel's start (the table says so). Trace
  without the waits (``traced(waits=False)``, ``compare_configs --trace-waits off``)
  to reach the steady state: the wait columns then read "-";

- ``period``: from one of its mainloops' start to its next one's. Ping-pong warpgroups
  take every other tile, so a period holds two tiles' mainloops (its own and the
  other warpgroup's) and one epilogue;
- ``mainloop`` and ``epilogue``: the regions' lengths;
- ``first``: the mainloop's wait for its first stage (ping-pong: mostly the other
  warpgroup's mainloop, which the memory warpgroup streams first);
- ``stages``: its waits for every later stage, summed: the tensor cores starved of data;
- ``turn``, ``operand``, ``store``: the epilogue's waits, summed over its sub-tiles;
- ``work``: the epilogue less its waits;

and ``slot``: the share of the memory warpgroup's traced span spent waiting for a free
slot of the ring (near 1: it runs ahead of the tensor cores; near 0: loads lag).

In a ping-pong kernel whose epilogues hide under the other warpgroup's mainloop, a
warpgroup's mainloop region (which starts with waiting for the other's to release the
tensor cores' stages) takes all of the period but its epilogue, and the period is two
tiles' worth of wgmma. An epilogue longer than the other's mainloop shows as a period
of ``epilogue`` plus this warpgroup's own mainloop, with a short first wait. An
epilogue that slows the other's mainloop shows as longer ``stages`` (``--by-step``:
in the steps it runs beside).
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import math
import statistics
from pathlib import Path

WAITS = ("wait_turn", "wait_operand", "wait_store")
COLUMNS = ("tiles", "per wg", "period", "mainloop", "first", "stages", "epilogue", "turn",
           "operand", "store", "work", "slot")
# Fewer middle tiles than this per compute warpgroup: the trace holds the kernel's start.
STEADY_TILES = 4


def regions(path: str | Path) -> dict[int, list[tuple[str, float, float]]]:
  """One trace file -> trace id -> its closed regions (name, start, end), in cycles
  from the trace's first event, in the order they started.

  The profiler writes each event's time as (the warpgroup's start time in ns + its
  cycles since its first event) / 1000, so within one trace differences are cycles.
  Where the buffer ran out mid-region the profiler ends the open regions at the last
  event noted: that tile is its warpgroup's last, which ``summarise`` leaves out.
  """
  events = json.loads(Path(path).read_text())["traceEvents"]
  by_trace = collections.defaultdict(list)
  for ev in events:
    by_trace[ev["tid"]].append(ev)
  out = {}
  for tid, evs in by_trace.items():
    origin = evs[0]["ts"]
    stack, closed = [], []
    for ev in evs:
      t = round((ev["ts"] - origin) * 1e3)  # whole ns and cycles, divided by 1000
      if ev["ph"] == "B":
        stack.append((ev["name"], t))
      else:
        name, t0 = stack.pop()
        if name != ev["name"]:
          raise ValueError(f"{path}: trace {tid} closes {ev['name']!r} inside {name!r}")
        closed.append((name, t0, t))
    out[tid] = sorted(closed, key=lambda r: r[1])
  return out


def _compute_traces(traces: dict) -> dict:
  """The compute warpgroups' traces: those with mainloop regions (the memory
  warpgroup records none)."""
  return {tid: rs for tid, rs in traces.items() if any(r[0] == "mainloop" for r in rs)}


def tiles(rs: list[tuple[str, float, float]]) -> list[dict]:
  """A compute warpgroup's regions grouped by tile: each mainloop with its stage waits
  (``stage_waits``, by K step) and the epilogue after it with the waits inside that
  epilogue; dicts of cycles."""
  mains = [r for r in rs if r[0] == "mainloop"]
  epis = [r for r in rs if r[0] == "epilogue"]
  # A trace without waits (traced(waits=False)) gives NaN for them, not zero.
  noted_waits = any(r[0].startswith("wait_") for r in rs)
  nan = float("nan")
  out = []
  for i, (_, m0, m1) in enumerate(mains):
    nxt = mains[i + 1][1] if i + 1 < len(mains) else float("inf")
    epi = next((e for e in epis if m1 <= e[1] < nxt), None)
    if epi is None:
      continue  # the buffer ran out before this tile's epilogue was noted
    waits = [r[2] - r[1] for r in rs if r[0] == "wait_stage" and m0 <= r[1] < m1]
    row = dict(start=m0, mainloop=m1 - m0, epilogue=epi[2] - epi[1], stage_waits=waits)
    row["first"], row["stages"] = (waits[0], sum(waits[1:])) if waits else (nan, nan)
    for w in WAITS:
      row[w] = (sum(r[2] - r[1] for r in rs if r[0] == w and epi[1] <= r[1] < epi[2])
                if noted_waits else nan)
    out.append(row)
  for a, b in zip(out, out[1:]):
    a["period"] = b["start"] - a["start"]
  return out


def _middle_tiles(compute: dict) -> list[dict]:
  """Every compute warpgroup's tiles (``_compute_traces``) but its first (it waits for
  the pipeline to fill) and its last (no next tile to measure a period to; where the
  buffer ran out, cut short)."""
  return [t for rs in compute.values() for t in tiles(rs)[1:-1]]


def middle_tiles_per_warpgroup(compute: dict) -> int:
  """The fewest middle tiles (``_middle_tiles``) any compute warpgroup's trace holds.
  Below ``STEADY_TILES`` the summary describes the kernel's first tiles, which run
  beside the pipelines filling and every SM's first loads, not its steady state: the
  SwiGLU backward's first two tiles ran 58,000 and 49,000 cycles a period against
  ~42,000 later (docs/performance.md, "How to measure")."""
  return min((max(len(tiles(rs)) - 2, 0) for rs in compute.values()), default=0)


def summarise(path: str | Path) -> dict:
  """One trace file -> medians per tile (``COLUMNS``) over ``_middle_tiles``."""
  traces = regions(path)
  compute = _compute_traces(traces)
  rows = _middle_tiles(compute)
  # memory warpgroups that noted slot waits (ping-pong, waits on): a cooperative
  # kernel's, or one traced without the waits, notes only Mosaic GPU's "Init"
  slot = [sum(r[2] - r[1] for r in rs if r[0] == "wait_slot") / (rs[-1][2] - rs[0][1])
          for tid, rs in traces.items()
          if tid not in compute and any(r[0] == "wait_slot" for r in rs)]
  if not rows:
    raise ValueError(f"{path}: no compute warpgroup traced two whole tiles; raise "
                     "traced(regions=...) or trace a larger problem")
  med = lambda key: statistics.median(r[key] for r in rows)
  out = {"tiles": len(rows), "per wg": middle_tiles_per_warpgroup(compute),
         "period": med("period"), "mainloop": med("mainloop"), "first": med("first"),
         "stages": med("stages"), "epilogue": med("epilogue"), "turn": med("wait_turn"),
         "operand": med("wait_operand"), "store": med("wait_store")}
  out["work"] = statistics.median(
      r["epilogue"] - sum(r[w] for w in WAITS) for r in rows)
  out["slot"] = statistics.median(slot) if slot else float("nan")
  return out


def stage_waits_by_step(path: str | Path) -> list[float]:
  """One trace file -> the mean wait for each K step's stage, by step (the first is
  the mainloop's wait for its turn), over ``_middle_tiles``. A ping-pong mainloop runs
  under the other warpgroup's epilogue for its first steps: waits that grow there, and
  not after, are the epilogue's traffic slowing the mainloop's loads
  (docs/performance.md, "Epilogue bytes")."""
  steps = [t["stage_waits"] for t in _middle_tiles(_compute_traces(regions(path)))]
  if not steps or not steps[0]:
    raise ValueError(f"{path}: no whole mainloop with stage waits between a compute "
                     "warpgroup's first and last (a ping-pong kernel traced over three "
                     "tiles or more per warpgroup has them)")
  if len({len(w) for w in steps}) != 1:
    raise ValueError(f"{path}: mainloops of {sorted({len(w) for w in steps})} stage "
                     "waits; a trace holds one problem")
  return [statistics.fmean(w) for w in zip(*steps)]


def by_tile(path: str | Path) -> list[dict]:
  """One trace file -> per tile index of a compute warpgroup (its first tile, its
  second, ...): how many warpgroups reached it, and the medians over them of its
  ``period`` (to the next tile's mainloop), ``mainloop`` and ``epilogue``, in cycles.
  Where the rows settle is the steady state; the first rows are the kernel's start."""
  per = collections.defaultdict(lambda: collections.defaultdict(list))
  for rs in _compute_traces(regions(path)).values():
    for i, t in enumerate(tiles(rs)):
      for key in ("period", "mainloop", "epilogue"):
        if key in t:
          per[i][key].append(t[key])
  nan = float("nan")
  return [dict(tile=i, warpgroups=len(per[i]["mainloop"]),
               **{key: statistics.median(per[i][key]) if per[i][key] else nan
                  for key in ("period", "mainloop", "epilogue")})
          for i in sorted(per)]


def table(named: dict[str, dict]) -> str:
  """name -> ``summarise``'s dict -> a markdown table, cycles per tile."""
  lines = ["| kernel | " + " | ".join(COLUMNS) + " |",
           "|---|" + "---|" * len(COLUMNS)]
  cell = lambda c, v: (str(v) if c in ("tiles", "per wg") else "-" if math.isnan(v)
                       else f"{v:.2f}" if c == "slot" else f"{v:,.0f}")
  for name, s in named.items():
    lines.append(f"| {name} | " + " | ".join(cell(c, s[c]) for c in COLUMNS) + " |")
  few = [name for name, s in named.items() if s["per wg"] < STEADY_TILES]
  if few:
    lines.append(f"\nper wg: the fewest middle tiles a compute warpgroup's trace holds. "
                 f"Under {STEADY_TILES} ({', '.join(few)}) the medians are the kernel's "
                 "first tiles, not its steady state: trace without the waits "
                 "(traced(waits=False), compare_configs --trace-waits off) for more tiles.")
  return "\n".join(lines)


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("files", nargs="+", help="trace files (JSON) or globs")
  p.add_argument("--by-step", action="store_true",
                 help="also print each file's mean stage wait per K step, in cycles")
  p.add_argument("--by-tile", action="store_true",
                 help="also print each file's period, mainloop and epilogue by tile index "
                 "(medians over the compute warpgroups): the start against the steady state")
  args = p.parse_args()
  paths = [q for f in args.files for q in sorted(glob.glob(f))]
  if not paths:
    raise SystemExit(f"no trace files match {args.files}")
  print(table({Path(q).stem: summarise(q) for q in paths}))
  if args.by_step:
    print("\nmean stage wait by K step, cycles (step 0: the wait for the turn):")
    for q in paths:
      print(f"{Path(q).stem}: " + " ".join(f"{w:.0f}" for w in stage_waits_by_step(q)))
  if args.by_tile:
    for q in paths:
      print(f"\n{Path(q).stem}, by tile index (medians, cycles):\n"
            "| tile | warpgroups | period | mainloop | epilogue |\n|---|---|---|---|---|")
      for r in by_tile(q):
        print(f"| {r['tile']} | {r['warpgroups']} | " + " | ".join(
            "-" if math.isnan(r[k]) else f"{r[k]:,.0f}"
            for k in ("period", "mainloop", "epilogue")) + " |")


if __name__ == "__main__":
  main()
