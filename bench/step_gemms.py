"""Each GEMM of a workload against cuBLAS at the same shape: where the step's GEMM time
is lost, problem by problem.

    PYTHONPATH=. python -m bench.step_gemms --workloads train-llama-3-8b:4:4

The workloads are ``bench.tune_gemm``'s (``--list`` there names their GEMMs). For every
distinct GEMM problem the workload traces, three things are timed on fresh random
inputs (CUPTI, median of ``--iterations``):

- **ours**: the problem as the workload runs it (its epilogue program, with the config
  ``gemm`` chooses: the tuned one if the cache has it, else the heuristic default);
- **our plain**: our GEMM at the same M, N, K and operand order, storing the product in
  the operands' dtype (its own chosen config);
- **XLA dot**: ``lax.dot_general`` at the same M, N, K and order, product in the operands'
  dtype: cuBLAS (or XLA's Triton GEMM) with nothing fused, the speed of light.

ours / XLA says what the problem costs against cuBLAS; our plain / XLA separates the
mainloop from the epilogue (ours / our plain). Only our GEMM kernel's own time is summed
for "ours": an in-place problem's operand copy, which XLA inserts because nothing is
donated here, is left out. Writes ``step_gemms_<workload>.{md,json}`` to --out (default
bench/results/<device>/). Needs a GPU.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax

from bench import common, tune_gemm
from pallas_kernels import autotune

OUR_KERNEL = "coda_gemm"


def xla_dot(a, b, trans_a: bool, trans_b: bool):
  """``a @ b`` with the problem's operand order, product in the operands' dtype (one
  cuBLAS call accumulating in fp32; asking for an fp32 product and converting would
  time a separate convert kernel too)."""
  dims = (((0,) if trans_a else (1,), (1,) if trans_b else (0,)), ((), ()))
  return jax.lax.dot_general(a, b, dims)


def time_problem(problem: autotune.Problem, iterations: int) -> dict:
  key = problem.key
  a, b, ops = problem.random_inputs(seed=1)
  cfg, source = autotune.chosen_config(problem)
  ours = problem.jitted(cfg)
  plain_problem = autotune.plain_problem(key.m, key.n, key.k, problem.a.dtype, key.trans_a,
                                         key.trans_b)
  plain_cfg, plain_source = autotune.chosen_config(plain_problem)
  plain_jit = plain_problem.jitted(plain_cfg)
  plain = lambda a, b: plain_jit(a, b, {})
  xla = jax.jit(lambda a, b: xla_dot(a, b, key.trans_a, key.trans_b))
  row = dict(m=key.m, n=key.n, k=key.k,
             order=key.order,
             program=problem.key.signature.split(";")[0], config=cfg.describe(),
             config_source=source, plain_config=plain_cfg.describe(),
             plain_config_source=plain_source)
  row["ours_ms"], _ = common.time_kernels(ours, a, b, ops, iterations=iterations,
                                          only=OUR_KERNEL)
  row["our_plain_ms"], _ = common.time_kernels(plain, a, b, iterations=iterations,
                                               only=OUR_KERNEL)
  row["xla_dot_ms"], kernels = common.time_kernels(xla, a, b, iterations=iterations)
  row["xla_kernels"] = [name for name, _ in kernels]
  row["tflops_ours"] = 2 * key.m * key.n * key.k / row["ours_ms"] / 1e9
  return row


def markdown(workload: str, rows: list[dict], prov: dict) -> str:
  md = [f"# Each GEMM of `{workload}` against cuBLAS at the same shape", "",
        f"device: {prov['device']}; jax {prov['jax_version']}; commit {prov['commit']}",
        f"command: `{prov['command']}`",
        "times: CUPTI, ms, median of the iterations, random normal inputs; ours counts "
        "our GEMM kernel only (no copies); each distinct problem once (a step may run it "
        "once per layer)", "",
        "| M x N x K | order | program | config (source) | ours | our plain | XLA dot | "
        "ours / XLA | plain / XLA | ours / plain | TFLOP/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    if "error" in r:
      md.append(f"| {r['m']}x{r['n']}x{r['k']} | {r['order']} | {r['program'][:60]} | "
                f"FAILED: {r['error'][:120]} | | | | | | | |")
      continue
    md.append(
        f"| {r['m']}x{r['n']}x{r['k']} | {r['order']} | {r['program'][:60]} | "
        f"{r['config']} ({r['config_source']}) | {r['ours_ms']:.3f} | "
        f"{r['our_plain_ms']:.3f} | {r['xla_dot_ms']:.3f} | "
        f"{r['ours_ms'] / r['xla_dot_ms']:.3f} | {r['our_plain_ms'] / r['xla_dot_ms']:.3f} | "
        f"{r['ours_ms'] / r['our_plain_ms']:.3f} | {r['tflops_ours']:.0f} |")
  ok = [r for r in rows if "error" not in r]
  if ok:
    tot = {k: sum(r[k] for r in ok) for k in ("ours_ms", "our_plain_ms", "xla_dot_ms")}
    md.append(f"| **sum** | | | | **{tot['ours_ms']:.3f}** | **{tot['our_plain_ms']:.3f}** "
              f"| **{tot['xla_dot_ms']:.3f}** | **{tot['ours_ms'] / tot['xla_dot_ms']:.3f}** "
              f"| **{tot['our_plain_ms'] / tot['xla_dot_ms']:.3f}** | "
              f"**{tot['ours_ms'] / tot['our_plain_ms']:.3f}** | |")
    md += ["", "XLA's kernels: " + "; ".join(sorted({
        f"`{n}`" for r in ok for n in r.get("xla_kernels", [])}))]
  return "\n".join(md) + "\n"


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--workloads", default="train-llama-3-8b:4:4",
                 help="bench.tune_gemm's workloads, comma-separated")
  p.add_argument("--iterations", type=int, default=20)
  p.add_argument("--out", type=Path, default=None)
  args = p.parse_args()
  if jax.devices()[0].platform != "gpu":
    sys.exit("step_gemms times kernels: run it on the GPU host")
  prov = common.provenance()
  for workload in args.workloads.split(","):
    problems = tune_gemm.find_problems(argparse.Namespace(
        workloads=workload, shapes=None, programs="all"))
    rows = []
    for i, (_, (where, problem)) in enumerate(problems.items()):
      k = problem.key
      print(f"[{i + 1}/{len(problems)}] {k.m}x{k.n}x{k.k} {k.signature[:100]}", flush=True)
      try:
        row = time_problem(problem, args.iterations)
      except Exception as e:  # noqa: BLE001  one failing problem does not stop the table
        row = dict(m=k.m, n=k.n, k=k.k, order="", program=k.signature.split(";")[0],
                   error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
      row.update(where=where, **prov)
      rows.append(row)
      print(f"  {row}", flush=True)
    md = markdown(workload, rows, prov)
    slug = workload.replace(":", "_").replace(".", "_")
    out = common.write_results(f"step_gemms_{slug}", rows, md, args.out)
    print(md)
    print(f"written to {out}")


if __name__ == "__main__":
  main()
