"""Summarises Nsight Compute's per-instruction page: the share of warp-stall samples
per SASS opcode, and the instructions with the most samples with their stall reasons.

    ncu --clock-control none --kernel-name regex:coda_gemm --launch-skip 1 --launch-count 1 \\
        --section WarpStateStats --section SourceCounters --import-source no -o rep \\
        python3 -m bench.compare_configs --workloads train-llama-3-8b:4 --match GatedGrad --ncu
    ncu --import rep.ncu-rep --page source --csv --print-source sass > src.csv
    python3 -m bench.ncu_source src.csv [TOP]

Samples are taken from every resident warp at a fixed rate, so a kernel's samples
split its time between its warps' states: in our GEMMs the producer warpgroup waits in
mbarrier loops (BRA / NANOSLEEP with long-scoreboard stalls) and the compute warpgroups
wait on their wgmma groups (WARPGROUP.DEPBAR) while the tensor cores run.
"""
from __future__ import annotations

import collections
import csv
import re
import sys


def _num(text: str) -> float:
  try:
    return float(text.replace(",", ""))
  except ValueError:
    return 0.0


def summarise(path: str, top: int = 40) -> str:
  """The report for one `--page source --csv` file."""
  rows = list(csv.reader(open(path, newline="", errors="replace")))
  head = next(i for i, r in enumerate(rows) if any(c.strip() == "Source" for c in r))
  names = [c.strip() for c in rows[head]]
  body = [r for r in rows[head + 1:] if len(r) == len(names)]
  src = names.index("Source")
  samp = next(i for i, h in enumerate(names) if h.startswith("Warp Stall Sampling (All"))
  reasons = [i for i, h in enumerate(names) if h.lower().startswith("stall")]
  total = sum(_num(r[samp]) for r in body)
  by_op = collections.Counter()
  for r in body:
    op = re.sub(r"^@!?U?P\w+\s+", "", r[src].strip()).split(" ")[0]
    by_op[op] += _num(r[samp])
  out = [f"instructions: {len(body)}, samples: {total:.0f}",
         "| opcode | samples | share |", "|---|---|---|"]
  out += [f"| {op} | {v:.0f} | {v / max(total, 1):.3f} |" for op, v in by_op.most_common(25)]
  out.append("\ntop instructions (index, samples, share, sass, main stall reasons):")
  for i in sorted(range(len(body)), key=lambda i: -_num(body[i][samp]))[:top]:
    r, n = body[i], _num(body[i][samp])
    why = "; ".join(f"{names[j]}={r[j]}" for j in reasons if _num(r[j]) > 0.05 * max(n, 1))
    out.append(f"{i:6d} {n:8.0f} {n / max(total, 1):.3f}  {r[src].strip()[:70]}  {why[:200]}")
  return "\n".join(out)


if __name__ == "__main__":
  print(summarise(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 40))
