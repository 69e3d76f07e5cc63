"""Runs GEMM-epilogue programs (ours and XLA's) a fixed number of times, for a hardware
profile under Nsight Compute. GPU host only.

    ncu --clock-control none --kernel-name regex:'coda_gemm_|nvjet' \\
        --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis \\
        --metrics sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active \\
        python3 -m bench.ncu_programs --programs plain,residual_sumsq_aux

The tensor pipe's busy share is ``sm__pipe_tensor_op_hmma_cycles_active``: on the GPU
host's ncu it counts wgmma (HGMMA) too, 98.5% for the plain GEMM on an H200, while
``sm__pipe_tensor_op_gmma_cycles_active`` comes back n/a (``ncu --query-metrics | grep
tensor`` lists what a version has).

Each program is compiled and run once before the profiled run, so every kernel shows up
twice: take the second. Inputs and programs are bench/gemm_epilogue.py's.
"""
from __future__ import annotations

import argparse

import jax

from bench import gemm_epilogue as G


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--shape", default="16384x2048x2048", help="M x K x N")
  p.add_argument("--programs", default="plain,residual_sumsq_aux")
  p.add_argument("--sides", default="ours,xla", help="ours, xla or both: under ncu, XLA's "
                 "GEMM autotuning launches (and ncu profiles) every cuBLAS candidate")
  args = p.parse_args()
  m, k, n = (int(v) for v in args.shape.split("x"))
  x = G.with_blocked_weights(G.make_inputs(m, k, n, jax.random.key(0)))
  progs = G.programs(n)
  for name in args.programs.split(","):
    for side, fn in zip(("ours", "xla"), progs[name]):
      if side not in args.sides.split(","):
        continue
      f = jax.jit(fn)
      for _ in range(2):
        jax.block_until_ready(f(x))
      print(f"ran {name} ({side}) at {m}x{k}x{n}", flush=True)


if __name__ == "__main__":
  main()
