"""Registers and spills of each kernel a run compiled, from ptxas's own report.

Mosaic GPU prints ptxas's verbose report for every kernel it compiles when the
environment has ``MOSAIC_GPU_DUMP_PTXAS=1`` (without ``MOSAIC_GPU_DUMP_TO`` it goes to
the process's stdout). Capture a run that compiles the kernels of interest and read it
here::

  MOSAIC_GPU_DUMP_PTXAS=1 PYTHONPATH=. python -m bench.compare_configs \\
      --workloads family-qwen3_1.7b --iterations 3 > run.log 2>&1
  python -m bench.ptxas_report run.log

The table lists the kernels in the order they were compiled (a kernel compiled twice,
e.g. two configs of one problem, is listed twice; the names say the schedule, the
shape and the outputs, not the config: pair rows with the run's own table by order).
ptxas reports the launch's register count (168 for our 384-thread kernels); the compute
warpgroups raise theirs to 232 at run time (``gemm_mgpu``'s ``set_max_registers``), and
spill bytes are counted against that. A spill is per thread, in bytes of local memory
written (stores) and read (loads) by the code as compiled, not per executed
instruction: where the spill sits (a loop or straight-line code) decides its cost.
"""
from __future__ import annotations

import argparse
import dataclasses
import re
import sys

_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")


@dataclasses.dataclass
class KernelReport:
  """ptxas's report of one compiled kernel."""
  kernel: str
  registers: int | None = None
  stack_bytes: int = 0
  spill_store_bytes: int = 0
  spill_load_bytes: int = 0

  @property
  def spills(self) -> bool:
    return bool(self.spill_store_bytes or self.spill_load_bytes)


def parse(text: str) -> list[KernelReport]:
  """The kernels in ``text`` (a captured run) in the order ptxas compiled them.

  Args:
    text: stdout and stderr of a run under ``MOSAIC_GPU_DUMP_PTXAS=1``.

  Returns:
    One ``KernelReport`` per "Compiling entry function" line; a kernel's frame and
    register lines are the ones that follow its entry line. (ptxas's "Registers are
    spilled" warning comes before the entry line, with the frame line's bytes; it is
    not read.)"""
  reports: list[KernelReport] = []
  for line in text.splitlines():
    if m := _ENTRY.search(line):
      reports.append(KernelReport(kernel=m.group(1)))
      continue
    if not reports:
      continue
    if m := _FRAME.search(line):
      r = reports[-1]
      r.stack_bytes, r.spill_store_bytes, r.spill_load_bytes = map(int, m.groups())
    elif m := _USED.search(line):
      reports[-1].registers = int(m.group(1))
  return reports


def table(reports: list[KernelReport], spills_only: bool = False) -> str:
  """A markdown table of ``reports``, in order (``spills_only``: the spilling ones)."""
  rows = ["| # | kernel | registers | stack B | spill stores B | spill loads B |",
          "|---|---|---|---|---|---|"]
  for i, r in enumerate(reports):
    if spills_only and not r.spills:
      continue
    name = r.kernel.removesuffix("_mosaic_gpu_kernel")
    regs = "-" if r.registers is None else str(r.registers)
    rows.append(f"| {i + 1} | {name} | {regs} | {r.stack_bytes} | {r.spill_store_bytes} "
                f"| {r.spill_load_bytes} |")
  spilled = sum(r.spills for r in reports)
  rows.append(f"\n{len(reports)} kernels compiled, {spilled} of them spill.")
  return "\n".join(rows)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("logs", nargs="+", help="captured runs under MOSAIC_GPU_DUMP_PTXAS=1")
  ap.add_argument("--spills-only", action="store_true", help="list the spilling kernels only")
  args = ap.parse_args(argv)
  for path in args.logs:
    with open(path) as f:
      reports = parse(f.read())
    if not reports:
      print(f"{path}: no ptxas report (was the run made with MOSAIC_GPU_DUMP_PTXAS=1, "
            "and did it compile anything? a kernel read from JAX's compilation cache is "
            "not compiled)", file=sys.stderr)
      return 1
    print(f"## {path}\n")
    print(table(reports, args.spills_only))
    print()
  return 0


if __name__ == "__main__":
  sys.exit(main())
