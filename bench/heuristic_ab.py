"""Times the heuristic ``default_config`` against itself with its knobs changed, on
problems whatever the tuning cache holds for them. GPU host only.

    PYTHONPATH=. python -m bench.heuristic_ab --workloads family-gpt2_1b,bench \\
        --shapes 12288x2048x6144,16384x1536x4096 --base TALL_TILE_MAX_K=0 \\
        --variant k4096=TALL_TILE_MAX_K=4096

Problems: those of ``--workloads`` (``bench.tune_gemm``'s, with ``--shapes`` and
``--programs`` for ``bench``), as the ops record them (on a GPU they pass ``clip_m``
wherever their program keeps zero rows zero). For each problem the configs compared are
the heuristic with the module constants of ``--base`` (``pallas_kernels.gemm_mgpu``
names, e.g. ``TALL_TILE_MAX_K=0``, which turns its tall ping-pong tiles off), the
heuristic as it is ("heuristic"), and each ``--variant NAME=CONST=VALUE,...``. Problems
where they all pick one config are listed as such; the others are compiled, checked
against the base config's outputs (partials per sub-tile compared as totals), and timed
with CUPTI in ABBA order (median of the rounds). The table gives the base's time and
each config's ratio to it; ``--out`` also writes it, with provenance, as
``heuristic_ab.{md,json}``.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

from bench import common, tune_gemm
from coda_jax import primitives
from pallas_kernels import autotune
from pallas_kernels import gemm_mgpu as g


def parse_constants(text: str) -> dict:
  """``CONST=VALUE,...`` -> {name: value}: numbers of ``gemm_mgpu``'s module constants."""
  out = {}
  for item in filter(None, text.split(",")):
    name, sep, value = item.partition("=")
    if not sep or not hasattr(g, name):
      sys.exit(f"{item!r}: expected CONST=VALUE with CONST a pallas_kernels."
               "gemm_mgpu constant, e.g. TALL_TILE_MAX_K=0")
    kind = type(getattr(g, name))
    out[name] = kind(float(value)) if kind is int else kind(value)
  return out


@contextlib.contextmanager
def constants(values: dict):
  """``gemm_mgpu``'s constants set to ``values`` inside, put back after."""
  old = {k: getattr(g, k) for k in values}
  for k, v in values.items():
    setattr(g, k, v)
  try:
    yield
  finally:
    for k, v in old.items():
      setattr(g, k, v)


def _lse_max_of(name: str, outputs: dict) -> str | None:
  """The ``_max`` partials a ``_sumexp`` output's sums are relative to: its own
  (``lse_max`` for ``lse_sumexp``), or for a ``RowLogSumExp``'s ``rest`` sums (named
  freely) the row maxima of the log-sum-exp they come with, the ``_max`` output whose
  stem is the longest prefix of theirs (``lse_max`` for ``lse_rest_sumexp``)."""
  stem = name.removesuffix("_sumexp")
  stems = [m.removesuffix("_max") for m in outputs if m.endswith("_max")]
  stems = [s for s in stems if stem == s or stem.startswith(s + "_")]
  return max(stems, key=len) + "_max" if stems else None


def totals(outputs: dict, whole: bool) -> dict:
  """Each output as float64; with ``whole``, partials per sub-tile (axis 0) as their
  totals: sums, maxima, and a ``RowLogSumExp``'s sums of exp(x - max) (its ``rest``
  sums too) as the row's LSE (``primitives.finish_lse``, run in float64)."""
  res = {}
  for nm, v in outputs.items():
    v = np.asarray(v, np.float64)
    lse_max = _lse_max_of(nm, outputs) if nm.endswith("_sumexp") else None
    if not whole:
      res[nm] = v
    elif nm.endswith("_max"):
      res[nm] = v.max(axis=0)
    elif lse_max is not None:
      with jax.enable_x64(True):
        res[nm] = np.asarray(primitives.finish_lse(
            np.asarray(outputs[lse_max], np.float64), v))
    elif nm.endswith("_sumexp"):  # summed, its partials would compare as noise
      raise ValueError(f"output {nm!r}: no _max output names the maxima its sums of "
                       "exp are relative to; name a RowLogSumExp's rest after its name "
                       "(lse -> lse_rest)")
    else:
      res[nm] = v.sum(axis=0)
  return res


def rel_diff(x: np.ndarray, y: np.ndarray) -> float:
  """||x - y|| / ||y|| over the finite elements, where both have the same non-finite
  ones (random inputs overflow an exp; both configs then give the same inf); inf where
  they differ in which elements are finite, or in those elements' values."""
  finite = np.isfinite(y)
  if not np.array_equal(np.isfinite(x), finite) or not np.array_equal(
      x[~finite], y[~finite], equal_nan=True):
    return float("inf")
  x, y = x[finite], y[finite]
  return float(np.linalg.norm(x - y) / (np.linalg.norm(y) + 1e-30))


def max_rel_diff(got: dict, want: dict) -> float:
  whole = any(np.shape(got[nm]) != np.shape(want[nm]) for nm in want)
  x, y = totals(got, whole), totals(want, whole)
  return max(rel_diff(x[nm], y[nm]) for nm in want)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--workloads", default="bench")
  p.add_argument("--shapes", default=None, help="bench workload: MxKxN,...")
  p.add_argument("--programs", default="all", help="bench workload: program names")
  p.add_argument("--base", required=True, help="CONST=VALUE,...: the heuristic compared to")
  p.add_argument("--variant", action="append", default=[], help="NAME=CONST=VALUE,...")
  p.add_argument("--iterations", type=int, default=20)
  p.add_argument("--rounds", type=int, default=2)
  p.add_argument("--budget-s", type=float, default=400)
  p.add_argument("--out", type=Path, default=None)
  args = p.parse_args(argv)
  settings = {"base": parse_constants(args.base), "heuristic": {}}
  for v in args.variant:
    name, _, rest = v.partition("=")
    settings[name] = parse_constants(rest)
  if jax.devices()[0].platform != "gpu":
    sys.exit("bench.heuristic_ab measures on the device: run it on the GPU host")
  meta = common.provenance()
  print(meta, flush=True)
  t0 = time.time()
  problems = tune_gemm.find_problems(args)
  pool = concurrent.futures.ThreadPoolExecutor(12)
  rows = []
  for key_text, (where, problem) in problems.items():
    if time.time() - t0 > args.budget_s:
      print(f"--budget-s {args.budget_s:.0f} spent: {len(problems) - len(rows)} problems "
            "not run", flush=True)
      break
    k = problem.key
    label = f"{where} {k.m}x{k.n}x{k.k} {k.order}{' clip' if problem.clip_m else ''}"
    configs = {}
    for name, values in settings.items():
      with constants(values):
        configs[name] = problem.default_config()
    tuned = autotune.lookup(k, problem.clip_m) is not None
    row = {"problem": label, "key": key_text, "tuned": tuned,
           "configs": {n: c.describe() for n, c in configs.items()}}
    distinct = list(dict.fromkeys(configs.values()))
    if len(distinct) > 1:
      a, b, ops = problem.random_inputs()
      futures = {c: pool.submit(lambda c: problem.jitted(c).lower(a, b, ops).compile(), c)
                 for c in distinct}
      compiled = {c: f.result() for c, f in futures.items()}
      outs = {c: compiled[c](a, b, ops) for c in distinct}
      times = {c: [] for c in distinct}
      for r in range(args.rounds):
        for c in (distinct if r % 2 == 0 else distinct[::-1]):
          times[c].append(autotune.measure_ms(compiled[c], a, b, ops,
                                              iterations=args.iterations))
      base = configs["base"]
      base_ms = statistics.median(times[base])
      row["base_ms"] = round(base_ms, 5)
      row["ratio"] = {n: round(statistics.median(times[c]) / base_ms, 4)
                      for n, c in configs.items()}
      row["max_rel_diff"] = max(max_rel_diff(outs[c], outs[base]) for c in distinct)
    rows.append(row)
    print(label, row.get("ratio", "one config"), flush=True)
  names = list(settings)
  lines = [f"Heuristic A/B ({meta['device']}, jax {meta['jax_version']}, commit "
           f"{meta['commit']}): `{meta['command']}`", "",
           f"base: `{args.base}`; " + "; ".join(f"{v}" for v in args.variant), "",
           "| problem | tuned | base ms | " + " | ".join(f"{n} / base" for n in names[1:])
           + " | " + " | ".join(f"{n} config" for n in names)
           + " | outputs' max rel diff |",
           "|---" * (4 + 2 * len(names) - 1) + "|"]
  for r in rows:
    ratios = [f"{r['ratio'][n]:.3f}" if "ratio" in r else "same" for n in names[1:]]
    cfgs = [r["configs"][n] for n in names]
    diff = f"{r['max_rel_diff']:.1e}" if "max_rel_diff" in r else ""
    lines.append(f"| {r['problem']} | {'yes' if r['tuned'] else 'no'} | "
                 f"{r.get('base_ms', '')} | " + " | ".join(ratios + cfgs) + f" | {diff} |")
  timed = [r["ratio"]["heuristic"] for r in rows if "ratio" in r
           and r["configs"]["heuristic"] != r["configs"]["base"]]
  if timed:
    geo = float(np.exp(np.mean(np.log(timed))))
    lines += ["", f"heuristic / base where they differ: {len(timed)} problems, "
              f"{min(timed):.3f}-{max(timed):.3f}, geometric mean {geo:.3f}"]
  text = "\n".join(lines) + "\n"
  print(text)
  if args.out is not None:
    common.write_results("heuristic_ab", [dict(r, **meta) for r in rows], text, args.out)


if __name__ == "__main__":
  main()
