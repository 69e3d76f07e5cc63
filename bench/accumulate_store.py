"""The LM head's weight-gradient accumulation, three ways, at the head's chunk shapes:
dW += h_chunk^T @ dlogits_chunk into an fp32 (D, V) buffer.

    PYTHONPATH=. python -m bench.accumulate_store [--shapes 1b,8b] [--iterations 30]

- **add_tile**: ``[AddTile acc, Store dw f32]`` written in place into acc: the epilogue
  stages acc's sub-tile through shared memory and adds it in registers;
- **store_add_to**: ``[Store dw f32, add_to=acc]`` in place: the TMA store adds
  (``cp.reduce.async.bulk``), acc is never staged or read by the kernel;
- **plain**: ``[Store dw f32]`` into a fresh buffer (no accumulation: the floor).

Each with the config ``gemm`` chooses (the tuning cache's, else the heuristic default).
Times are CUPTI medians of our GEMM kernel only (the buffer copy XLA inserts because
nothing is donated here is left out). Checks the accumulated values against an fp32
``acc + h^T @ dlogits``. Writes ``accumulate_store.{md,json}`` to --out (default
bench/results/<device>/). Needs a GPU.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import jax
import jax.numpy as jnp

from bench import common
from coda_jax import primitives as P
from coda_jax.epilogue_gemm import gemm_epilogue
from pallas_kernels import autotune

SHAPES = {"1b": (2048, 128256, 2048), "8b": (4096, 128256, 2048)}  # D, V, chunk rows
OUR_KERNEL = "coda_gemm"
PROGRAMS = {
    "add_tile": ([P.AddTile("acc"), P.Store("dw", jnp.float32)], {"dw": "acc"}),
    "store_add_to": ([P.Store("dw", jnp.float32, add_to="acc")], {"dw": "acc"}),
    "plain": ([P.Store("dw", jnp.float32)], None),
}


def run_shape(name, d, v, rows, iterations, key):
  ks = jax.random.split(key, 3)
  h = jax.random.normal(ks[0], (rows, d), jnp.bfloat16)
  dl = (jax.random.normal(ks[1], (rows, v), jnp.float32) * rows ** -0.5).astype(jnp.bfloat16)
  acc = jax.random.normal(ks[2], (d, v), jnp.float32)
  want = acc + jnp.matmul(h.T.astype(jnp.float32), dl.astype(jnp.float32),
                          precision=jax.lax.Precision.HIGHEST)
  out = []
  for prog_name, (program, in_place) in PROGRAMS.items():
    ops = {"acc": acc} if in_place else {}

    def fn(h, dl, ops, program=program, in_place=in_place):
      return gemm_epilogue(h, dl, program, ops, trans_a=True, impl="mosaic",
                           in_place=in_place)["dw"]

    got = jax.jit(fn)(h, dl, ops)
    err = common.rel_diff(got, want if in_place else want - acc)
    del got
    # Timed with only a row of the (D, V) fp32 result kept: the profiler holds every
    # iteration's outputs, which whole would not fit (30 x 2.1 GB at 8B).
    ms, _ = common.time_kernels(lambda *xs: fn(*xs)[:1], h, dl, ops, iterations=iterations,
                                only=OUR_KERNEL)
    config = "; ".join(autotune.describe_workload(fn, h, dl, ops))
    out.append(dict(shape=name, m=d, n=v, k=rows, program=prog_name, ms=ms, rel_err=err,
                    config=config.split(": ", 1)[-1]))
    print(out[-1], flush=True)
  return out


def markdown(rows, prov):
  md = ["# The LM head's dW accumulation: staged add vs TMA add vs no add", "",
        f"device: {prov['device']}; jax {prov['jax_version']}; commit {prov['commit']}",
        f"command: `{prov['command']}`",
        "times: CUPTI, ms, median; our GEMM kernel only; random normal inputs", "",
        "| shape | M x N x K (tn) | program | ms | / add_tile | rel err vs fp32 | config |",
        "|---|---|---|---|---|---|---|"]
  base = {r["shape"]: r["ms"] for r in rows if r["program"] == "add_tile"}
  for r in rows:
    md.append(f"| {r['shape']} | {r['m']}x{r['n']}x{r['k']} | {r['program']} | "
              f"{r['ms']:.4f} | {r['ms'] / base[r['shape']]:.3f} | {r['rel_err']:.2e} | "
              f"{r['config']} |")
  return "\n".join(md) + "\n"


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--shapes", default="1b,8b")
  p.add_argument("--iterations", type=int, default=30)
  p.add_argument("--out", type=Path, default=None)
  args = p.parse_args()
  if jax.devices()[0].platform != "gpu":
    raise SystemExit("bench.accumulate_store times compiled kernels: it needs a GPU")
  prov = common.provenance()
  rows = []
  for i, name in enumerate(args.shapes.split(",")):
    rows += [dict(r, **prov) for r in run_shape(name, *SHAPES[name], args.iterations,
                                                jax.random.key(i))]
  md = markdown(rows, prov)
  out = common.write_results("accumulate_store", rows, md, out=args.out)
  print(f"wrote {out / 'accumulate_store.md'}\n")
  print(md)


if __name__ == "__main__":
  main()
