"""The Llama block on several devices: our fused shifted block against XLA's jit of the
same block with the same shardings, forward + backward.

    PYTHONPATH=. python -m bench.sharded_block --mesh model=2 --shapes 8b

Tensor parallel over "model" (Megatron): wqkv and w13 (XLA: w_gate, w_up) split by
columns, wo and w2 by rows; the attention output y0 arrives split by heads, x0
replicated over "model". A "data" axis splits the rows. Wall-clock medians (CUPTI
times one device), both programs timed in the same run. Writes
bench/results/<device>/sharded_block.json and .md.
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from bench import block as B
from bench import common
from coda_jax import blocks


COL, ROW = P(None, "model"), P("model", None)
OURS_SPECS = {"wo": ROW, "g_mlp": P(), "w13": COL, "w2": ROW, "g_attn": P(), "wqkv": COL}
XLA_SPECS = {"wo": ROW, "g_mlp": P(), "w_gate": COL, "w_up": COL, "w2": ROW, "g_attn": P(),
             "wqkv": COL}


def wall(fn, args, iterations):
  out = jax.block_until_ready(fn(*args))  # compile and warm up
  times = []
  for _ in range(iterations):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times) * 1e3, out


def run_shape(name, s, mesh, iterations, prov, key):
  x = B.make_inputs(s, key)
  std = {k: x["params"][k] for k in XLA_SPECS}
  ours = B.ours_params(x["params"], blocks.SHIFTED_KEYS)
  cfg, _ = B.block_configs(s)
  put = lambda v, spec: jax.device_put(v, NamedSharding(mesh, spec))
  rows_, y_spec = P("data"), P("data", "model")
  acts = (put(x["x0"], rows_), put(x["y0"], y_spec), put(x["positions"], rows_))
  cts = (put(x["cts"][0], rows_), put(x["cts"][1], y_spec))
  ours_p = {k: put(v, OURS_SPECS[k]) for k, v in ours.items()}
  xla_p = {k: put(v, XLA_SPECS[k]) for k, v in std.items()}
  ours_fn = jax.jit(B.fwd_bwd(lambda a, b, c, p: blocks.shifted_block(a, b, c, p, cfg)))
  xla_fn = jax.jit(B.fwd_bwd(B.xla_shifted_block(s)))
  ours_ms, got = wall(ours_fn, (*acts, ours_p, cts), iterations)
  xla_ms, want = wall(xla_fn, (*acts, xla_p, cts), iterations)
  diff = common.rel_diff(B.grads_to_standard(got), want)
  hlo = ours_fn.lower(*acts, ours_p, cts).compile().as_text()
  mesh_s = ",".join(f"{a}={n}" for a, n in mesh.shape.items())
  return [dict(op="shifted_block_fwd_bwd", shape=name, n_devices=mesh.size, mesh=mesh_s,
               ours_ms=ours_ms, baseline="XLA jit of the same block, same shardings",
               baseline_ms=xla_ms, speedup=xla_ms / ours_ms, rel_diff_vs_xla=diff,
               all_reduces=hlo.count("all-reduce("), all_gathers=hlo.count("all-gather("),
               iterations=iterations, **prov)]


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--mesh", default="model=2")
  p.add_argument("--shapes", default="8b", help=f"comma-separated, of {list(B.SHAPES)}")
  p.add_argument("--iterations", type=int, default=20)
  args = p.parse_args()
  mesh = common.parse_mesh(args.mesh)
  prov = common.provenance()
  rows = []
  for i, name in enumerate(args.shapes.split(",")):
    rows += run_shape(name, B.SHAPES[name], mesh, args.iterations, prov, jax.random.key(i))
  md = "\n".join([
      "# Shifted block, forward + backward, sharded", "",
      f"device: {prov['device']} x {mesh.size}; jax {prov['jax_version']}; commit "
      f"{prov['commit']}", f"command: `{prov['command']}`", "",
      "| shape | mesh | ours ms | XLA ms | speedup | rel diff vs XLA | all-reduces |",
      "|---|---|---|---|---|---|---|"] + [
      f"| {r['shape']} | {r['mesh']} | {r['ours_ms']:.3f} | {r['baseline_ms']:.3f} | "
      f"{r['speedup']:.3f}x | {r['rel_diff_vs_xla']:.2e} | {r['all_reduces']} |"
      for r in rows]) + "\n"
  out = common.write_results("sharded_block", rows, md)
  print(f"wrote {out}/sharded_block.json, .md\n\n{md}")


if __name__ == "__main__":
  main()
