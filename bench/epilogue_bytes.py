"""The tile bytes each GEMM's epilogue writes and reads, per workload: where an epilogue
writes more than its product's one output tile. Runs anywhere (no GPU: the workloads are
traced as an H100 would run them).

    PYTHONPATH=. python -m bench.epilogue_bytes --workloads block-1b,family-qwen3_1.7b

Kernel traces put the cost of the heavy epilogue programs in the bytes they write: while
one warpgroup's epilogue streams a second output tile out of the SM, the other's
mainloop loads land later, whichever engine does the writing (docs/performance.md,
"Epilogue bytes"). So the programs to slim are those that write more than the
product's own tile. For each GEMM of ``bench.tune_gemm``'s workloads this prints the
tile outputs it writes (name, width relative to N, dtype), the tile operands its
epilogue reads, their bytes, and ``written / product``: the bytes written over those of
the product stored once in bf16 (M x N x 2). Row and column partials and vectors are
left out (they are 1/64 of a tile or less).
"""
from __future__ import annotations

import argparse

import jax.numpy as jnp

from bench import lowering_time, tune_gemm
from pallas_kernels import autotune
from pallas_kernels import epilogue as epi
from pallas_kernels import gemm_mgpu as g


def tile_bytes(problem: autotune.Problem) -> dict:
  """One GEMM problem -> its epilogue's tile traffic: ``written`` and ``read`` (bytes),
  ``product`` (M x N x 2: the product stored once in bf16), and the names ``outputs``
  and ``operands`` with their widths and dtypes. Bytes per accumulator element are the
  kernel heuristic's own (``gemm_mgpu.epilogue_bytes_per_element``), taken for the
  outputs and for each operand apart."""
  k = problem.key
  cells = k.m * k.n
  dtypes = problem.input_dtypes
  per_operand = {nm: g.epilogue_bytes_per_element({nm: kind}, dtypes, ())
                 for nm, kind in problem.input_kinds.items()}
  ins = {nm: b for nm, b in per_operand.items() if b}  # tile operands only
  outs = [o for o in problem.outputs if o.kind == epi.OutputKind.TILE]
  name = lambda n, w, dt: n + ("" if w == 1 else f" x{w:g}") + f" {jnp.dtype(dt).name}"
  return dict(written=int(cells * g.epilogue_bytes_per_element({}, {}, problem.outputs)),
              read=int(cells * sum(ins.values())), product=cells * 2,
              outputs=[name(o.name, o.width, o.dtype) for o in outs],
              operands=[name(nm, b / jnp.dtype(dtypes[nm]).itemsize, dtypes[nm])
                        for nm, b in ins.items()])


def table(problems: dict) -> str:
  """``tune_gemm.find_problems``' dict -> a markdown table, one row per GEMM, the
  heaviest writers first, and a total line."""
  rows = []
  for where, problem in problems.values():
    k = problem.key
    t = tile_bytes(problem)
    rows.append((t["written"] / t["product"], where, k, problem, t))
  rows.sort(key=lambda r: -r[0])
  lines = ["| where | M x N x K | order | program | outputs | epilogue reads | MB written | "
           "MB read | written / product |", "|---|---|---|---|---|---|---|---|---|"]
  total_w = total_r = total_p = 0
  for ratio, where, k, problem, t in rows:
    program = (problem.program_id or k.signature.split(";")[0])[:48]
    lines.append(f"| {where} | {k.m}x{k.n}x{k.k} | {k.order} | {program} | "
                 f"{', '.join(t['outputs']) or '-'} | {', '.join(t['operands']) or '-'} | "
                 f"{t['written'] / 1e6:.0f} | {t['read'] / 1e6:.0f} | {ratio:.2f} |")
    total_w, total_r, total_p = total_w + t["written"], total_r + t["read"], total_p + t["product"]
  lines.append(f"| total | | | | | | {total_w / 1e6:.0f} | {total_r / 1e6:.0f} | "
               f"{total_w / max(total_p, 1):.2f} |")
  return "\n".join(lines)


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--workloads", default="block-1b",
                 help="bench.tune_gemm's workloads (bench, block-1b, family-qwen3_1.7b, ...)")
  p.add_argument("--shapes", default=None, help="bench workload: MxKxN,...")
  p.add_argument("--programs", default="all", help="bench workload: program names")
  args = p.parse_args()
  with lowering_time.pretend():
    problems = tune_gemm.find_problems(args)
  print(table(problems))


if __name__ == "__main__":
  main()
