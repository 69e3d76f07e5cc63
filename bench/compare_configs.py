"""Times a workload's GEMMs under named config variants: one knob against the config
``gemm`` would choose, on the same inputs and in the same process. GPU host only.

    PYTHONPATH=. python -m bench.compare_configs --workloads train-llama-3-8b:4 \\
        --match 'GatedGrad' --plain 14336x4096x16384:tn \\
        --variant 'pp_clN=schedule=PINGPONG,cluster_dim=N,stages=5' \\
        --variant 'one_slot=epi_operand_slots=1,tile_k=64,stages=3'

Problems: those of ``--workloads`` (``bench.tune_gemm``'s; ``--match`` filters their key
text) and ``--plain MxNxK:ORDER`` plain GEMMs. Each variant is ``NAME=FIELD=VALUE,...``:
``GemmConfig`` fields replaced in the chosen config (enums by name, ``None``, ints,
``True``/``False``); ``num_sms=N`` sets the persistent grid instead, and
``clip_m=True`` runs the problem with ``gemm``'s ``clip_m`` (tiles need not divide M:
e.g. 192-row tiles at M = 16384). Stages are lowered
until the variant fits in shared memory; one that still does not fit, or does not tile
the problem, is reported with the reason. ``--ncu`` runs each (problem, variant)
twice without timing, for Nsight Compute (profile the second launch). Prints a table:
time and the ratio to the chosen config ("base").

``--sustained-s S`` times each variant instead by wall clock over back-to-back calls for
S seconds, twice, in the order base, variants, then reversed (ABBA). An H100 running
GEMMs back to back sits at its power cap and lowers its clock: a short CUPTI run
measures the kernel near the boost clock, the sustained one at the clock its energy per
call allows (docs/performance.md, "The power cap"). nvidia-smi is sampled every 0.1 s
meanwhile (``common.PowerLog``), and the table gives each variant's mean SM clock, power
and energy per call over its windows.

``--deeper-only`` keeps the problems where some variant gets a deeper pipeline than the
chosen config (``deepens``): one output slot, for example, pays only where the shared
memory it frees buys a stage (docs/performance.md, "What was tried").

``--trace DIR`` runs each (problem, variant) once more with Mosaic GPU's on-device
profiler (``gemm_mgpu.traced``), writes its trace under ``DIR/<problem>/<variant>/``, and
prints a second table: per tile, the cycles of the warpgroups' mainloop, epilogue and the
epilogue's waits (``bench.kernel_trace``). ``--trace-waits off`` leaves the waits out, so
that a kernel with little shared memory to spare traces its steady state, not only its
first tiles (the table's "per wg" column says how many it got). ``--shapes`` and ``--programs`` choose the
``bench`` workload's problems, as in ``bench.tune_gemm``.

``--xla-dot`` adds a row per problem: the plain product at its shape and operand order
through ``lax.dot_general`` (cuBLAS, nothing fused), the yardstick for our mainloop and
for what an epilogue costs in time and, sustained, in energy.
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import hashlib
import os
import re
import sys
import time

import jax

from bench import common, kernel_trace, step_gemms, tune_gemm
from pallas_kernels import autotune
from pallas_kernels import gemm_mgpu as g


def parse_variant(text: str) -> tuple[str, dict, int | None]:
  """``NAME=FIELD=VALUE,...`` -> (name, GemmConfig field overrides, num_sms or None).
  ``clip_m`` is not a config field: it comes back among the overrides, and ``run``
  applies it to the problem."""
  name, sep, rest = text.partition("=")
  if not sep or not name:
    raise ValueError(f"--variant {text!r}: expected NAME=FIELD=VALUE,...")
  fields = {f.name: f for f in dataclasses.fields(g.GemmConfig)}
  enums = {"wg_dim": g.MatDim, "grid_minor_dim": g.MatDim, "cluster_dim": g.MatDim,
           "schedule": g.Schedule}
  overrides, num_sms = {}, None
  for item in filter(None, rest.split(",")):
    field, sep, value = item.partition("=")
    if not sep:
      raise ValueError(f"--variant {name}: {item!r} is not FIELD=VALUE")
    if field == "num_sms":
      num_sms = int(value)
      continue
    if field == "clip_m":
      if value not in ("True", "False"):
        raise ValueError(f"--variant {name}: clip_m={value!r} is not True or False")
      overrides["clip_m"] = value == "True"
      continue
    if field not in fields:
      raise ValueError(f"--variant {name}: {field!r} is not a GemmConfig field "
                       f"({sorted(fields)} or num_sms)")
    if value == "None":
      overrides[field] = None
    elif field in enums:
      overrides[field] = enums[field][value]
    elif value in ("True", "False"):
      overrides[field] = value == "True"
    else:
      overrides[field] = int(value)
  return name, overrides, num_sms


def plain_problem(spec: str) -> tuple[str, autotune.Problem]:
  """``MxNxK:ORDER`` (order nn, nt, tn or tt) -> the plain GEMM's recorded problem."""
  m_ = re.fullmatch(r"(\d+)x(\d+)x(\d+):([nt])([nt])", spec)
  if not m_:
    raise ValueError(f"--plain {spec!r}: expected MxNxK:ORDER, e.g. 8192x8192x8192:nn")
  m, n, k = (int(v) for v in m_.groups()[:3])
  return f"plain {spec}", autotune.plain_problem(m, n, k, "bfloat16", m_.group(4) == "t",
                                                 m_.group(5) == "t")


def sustained_ms(calls: dict, seconds: float, *, sync=jax.block_until_ready,
                 clock=time.perf_counter, power: common.PowerLog | None = None,
                 warmup_s: float | None = None) -> dict:
  """name -> ``common.Sustained``: each of ``calls`` (name -> a function of no
  arguments) timed in two windows, in the given order and then reversed, after an
  untimed warm-up window of the first (``common.alternating_windows``, whose ``warmup_s``
  this is), and the two windows averaged (``common.mean_sustained``; clock, power and
  energy per call where ``power`` has samples)."""
  spent = common.alternating_windows(calls, seconds, 2, sync=sync, clock=clock,
                                     power=power, warmup_s=warmup_s)
  return {name: common.mean_sustained(w) for name, w in spent.items()}


def variant_config(problem: autotune.Problem, base, overrides: dict):
  """(``base`` with a variant's ``overrides``, stages lowered until it fits, or None
  where none fits; the ``clip_m`` to run it with: the variant's, else the problem's).
  Raises ValueError where the fields make no valid config."""
  fields = dict(overrides)
  clip_m = fields.pop("clip_m", problem.clip_m)
  return problem.deepest_fitting(dataclasses.replace(base, **fields)), clip_m


def deepens(problem: autotune.Problem, overrides: dict) -> bool:
  """Whether a variant (``overrides``: GemmConfig fields, stages lowered until it fits)
  gives ``problem`` a deeper pipeline than its chosen config: ``--deeper-only``'s test,
  e.g. for a variant that frees shared memory ('out1=epi_out_slots=1,stages=7')."""
  base, _ = autotune.chosen_config(problem)
  try:
    cfg, _ = variant_config(problem, base, overrides)
  except ValueError:  # the variant is not a valid config for this base
    return False
  return cfg is not None and cfg.stages > base.stages


XLA_DOT = "xla dot"


def traced_run(problem: autotune.Problem, cfg, num_sms, inputs, folder: str,
               waits: bool = True) -> dict:
  """Runs ``problem`` once under ``cfg`` on ``inputs`` (a, b, operands) with the
  on-device profiler, its trace written into ``folder`` (made; must hold no trace yet),
  and returns ``kernel_trace``'s summary of it. ``waits``: as ``gemm_mgpu.traced``'s
  (False: mainloops and epilogues only, for many more tiles)."""
  if glob.glob(os.path.join(folder, "*.json")):
    raise ValueError(f"--trace: {folder} holds traces already; name an empty folder")
  with g.traced(folder, waits=waits):
    fn = problem.jitted(cfg, num_sms)  # traced afresh, under the profiler
    jax.block_until_ready(fn(*inputs))
  found = glob.glob(os.path.join(folder, "*.json"))
  if len(found) != 1:
    raise RuntimeError(f"--trace: expected one trace in {folder}, found {len(found)}")
  return kernel_trace.summarise(found[0])


def run(problem: autotune.Problem, variants, iterations: int, ncu: bool,
        sustained_s: float | None = None, xla_dot: bool = False,
        trace_dir: str | None = None, where: str = "", trace_waits: bool = True
        ) -> list[dict]:
  """The problem under its chosen config ("base") and each variant, and with
  ``xla_dot`` the plain product at its shape and operand order through
  ``lax.dot_general`` (cuBLAS, no epilogue: the row named ``XLA_DOT``). With
  ``trace_dir``, each config's row also gets ``trace``: ``traced_run``'s summary
  (``trace_waits``: its ``waits``)."""
  base, source = autotune.chosen_config(problem)
  a, b, ops = problem.random_inputs(seed=1)
  rows, calls = [], {}
  k = problem.key
  for name, overrides, num_sms in [("base", {}, None), *variants,
                                   *([(XLA_DOT, None, None)] if xla_dot else [])]:
    row = dict(variant=name)
    try:
      if overrides is None:  # the cuBLAS product
        if k.k == 0:
          raise ValueError("a pass (K = 0) has no product to compare")
        fn = jax.jit(lambda a, b, ops: step_gemms.xla_dot(a, b, k.trans_a, k.trans_b))
        only = None
        row["config"] = "lax.dot_general (cuBLAS), product only"
      else:
        cfg, clip_m = variant_config(problem, base, overrides)
        if cfg is None:
          raise ValueError("no stage count fits in shared memory")
        fn, only = dataclasses.replace(problem, clip_m=clip_m).jitted(cfg, num_sms), "coda_gemm"
        row["config"] = cfg.describe() + (f" sms{num_sms}" if num_sms else "")
      if ncu:
        for _ in range(2):
          jax.block_until_ready(fn(a, b, ops))
        row["ms"] = None
      elif sustained_s:
        jax.block_until_ready(fn(a, b, ops))  # compiled before any window runs
        calls[name] = lambda fn=fn: fn(a, b, ops)
      else:
        row["ms"] = common.time_kernels(fn, a, b, ops, iterations=iterations,
                                        only=only)[0]
      if trace_dir and overrides is not None:
        # where and shape name a problem for people; the key's digest tells apart two
        # programs of one workload at one shape
        digest = hashlib.sha1(k.text().encode()).hexdigest()[:8]
        folder = os.path.join(
            trace_dir, common.device_slug(f"{where} {k.m}x{k.n}x{k.k} {k.order} {digest}"),
            common.device_slug(name))
        row["trace"] = traced_run(dataclasses.replace(problem, clip_m=clip_m), cfg,
                                  num_sms, (a, b, ops), folder, waits=trace_waits)
    except Exception as e:  # noqa: BLE001  a variant that does not fit is reported
      row["error"] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}"
    rows.append(row)
  if calls:
    with common.PowerLog() as power:
      timed = sustained_ms(calls, sustained_s, power=power)
    for row in rows:
      if row["variant"] in timed:
        got = timed[row["variant"]]
        row["ms"] = got.ms
        if got.watts is not None:
          row.update(mhz=got.mhz, watts=got.watts, joules=got.joules)
  base_ms = rows[0].get("ms")
  for row in rows:
    if row.get("ms") and base_ms:
      row["vs_base"] = row["ms"] / base_ms
  return rows, source


def power_cells(row: dict) -> str:
  """A row's mean SM clock, power and energy per call as table cells ("-" where the
  run sampled none: CUPTI timing, or no nvidia-smi)."""
  if row.get("watts") is None:
    return "- | - | -"
  return f"{row['mhz']:.0f} | {row['watts']:.0f} | {row['joules'] * 1e3:.3f}"


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--workloads", default=None, help="bench.tune_gemm's workloads")
  p.add_argument("--match", default=None, help="regular expression on the key text")
  p.add_argument("--shapes", default=None, help="bench workload: MxKxN,... (default all)")
  p.add_argument("--programs", default="all", help="bench workload: program names")
  p.add_argument("--trace", default=None, metavar="DIR",
                 help="also run each config once under the on-device profiler, traces "
                 "into DIR, and print cycles per tile by region (bench.kernel_trace)")
  p.add_argument("--trace-waits", choices=("on", "off"), default="on",
                 help="with --trace: 'off' notes mainloops and epilogues only, so the "
                 "profiler's buffer holds ~10x more tiles (a kernel that leaves little "
                 "shared memory otherwise traces only its first few)")
  p.add_argument("--plain", action="append", default=[], help="MxNxK:ORDER plain GEMMs")
  p.add_argument("--variant", action="append", default=[],
                 help="NAME=FIELD=VALUE,... (repeatable)")
  p.add_argument("--iterations", type=int, default=20)
  p.add_argument("--ncu", action="store_true", help="run each twice, untimed")
  p.add_argument("--xla-dot", action="store_true",
                 help="also time the plain product at each problem's shape and operand "
                 "order through lax.dot_general (cuBLAS), as the row 'xla dot'")
  p.add_argument("--sustained-s", type=float, default=None,
                 help="time by wall clock over back-to-back calls for this many seconds "
                 "per window (two windows each, ABBA) instead of a short CUPTI run")
  p.add_argument("--deeper-only", action="store_true",
                 help="time only the problems where some variant runs a deeper pipeline "
                 "than the chosen config (e.g. --variant 'out1=epi_out_slots=1,stages=7': "
                 "where one output slot frees room for a stage)")
  args = p.parse_args()
  if args.trace and args.ncu:
    sys.exit("--trace with --ncu: profile with one at a time")
  if args.sustained_s is not None and (args.sustained_s <= 0 or args.ncu):
    sys.exit(f"--sustained-s {args.sustained_s}: a positive number of seconds, "
             "without --ncu")
  try:
    variants = [parse_variant(v) for v in args.variant]
    problems = [plain_problem(s) for s in args.plain]
  except ValueError as e:
    sys.exit(str(e))
  if args.deeper_only and not variants:
    sys.exit("--deeper-only: pass the --variant to compare depths with")
  if jax.devices()[0].platform != "gpu":
    sys.exit("compare_configs measures on the device: run it on the GPU host")
  if args.workloads:
    found = tune_gemm.find_problems(argparse.Namespace(
        workloads=args.workloads, shapes=args.shapes, programs=args.programs))
    problems += [(where, pr) for k, (where, pr) in found.items()
                 if args.match is None or re.search(args.match, k)]
  if args.deeper_only:
    kept = [(w, pr) for w, pr in problems if any(deepens(pr, o) for _, o, _ in variants)]
    print(f"--deeper-only: {len(kept)} of {len(problems)} problems get a deeper pipeline "
          "from a variant", flush=True)
    problems = kept
  print(common.provenance(), flush=True)
  print(f"timing: wall clock, back-to-back calls, two {args.sustained_s} s windows per "
        "variant (ABBA)" if args.sustained_s else
        f"timing: CUPTI, median of {args.iterations} calls", flush=True)
  table = ["| problem | M x N x K | order | variant | config | ms | / base | MHz | W | mJ per call |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  traced = {}
  for where, problem in problems:
    k = problem.key
    rows, source = run(problem, variants, args.iterations, args.ncu, args.sustained_s,
                       args.xla_dot, args.trace, where, args.trace_waits == "on")
    program = k.signature.split(";")[0][:60]
    traced.update({f"{where}: {program} {k.m}x{k.n}x{k.k} {row['variant']}": row["trace"]
                   for row in rows if "trace" in row})
    for row in rows:
      ms = row.get("ms")
      result = row.get("error") or ("ran" if ms is None else f"{ms:.4f}")
      ratio = f"{row['vs_base']:.3f}" if "vs_base" in row else "-"
      variant = row["variant"] + (f" ({source})" if row["variant"] == "base" else "")
      line = (f"| {where}: {program} | {k.m}x{k.n}x{k.k} | {k.order} | {variant} | "
              f"{row.get('config', '-')} | {result} | {ratio} | {power_cells(row)} |")
      print(line, flush=True)
      table.append(line)
  print("\n" + "\n".join(table))
  if traced:
    print("\ncycles per tile, by region (medians; bench.kernel_trace):\n"
          + kernel_trace.table(traced))


if __name__ == "__main__":
  main()
