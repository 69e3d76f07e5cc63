"""Compiles the GEMM for every operand order and epilogue kind, checks it, then sweeps
tuning configs against XLA's GEMM at the benchmark shapes. GPU host only.

    PYTHONPATH=. python bench/tune_gemm.py [--shapes 16384x2048x2048,...]
"""
import argparse
import dataclasses
import itertools
import statistics
import sys

import jax
import jax.numpy as jnp
from jax.experimental.mosaic.gpu import profiler

from pallas_kernels import EpilogueOutput, GemmConfig, InputKind, MatDim, OutputKind, gemm


def rel_err(x, ref):
  x = x.astype(jnp.float32)
  return float(jnp.linalg.norm(x - ref) / jnp.linalg.norm(ref))


def check_features():
  m, n, k = 512, 768, 384
  ka, kb, kc, kd = jax.random.split(jax.random.key(0), 4)
  a = jax.random.normal(ka, (m, k), jnp.bfloat16)
  b = jax.random.normal(kb, (k, n), jnp.bfloat16)
  ref = a.astype(jnp.float32) @ b.astype(jnp.float32)
  for ta, tb in itertools.product((False, True), repeat=2):
    out = gemm(a.T if ta else a, b.T if tb else b, trans_a=ta, trans_b=tb)["out"]
    print(f"order trans_a={ta} trans_b={tb}: rel err {rel_err(out, ref):.2e}", flush=True)
  r = jax.random.normal(kc, (m,), jnp.float32)
  g = jax.random.normal(kd, (n,), jnp.float32)
  x0 = jax.random.normal(ka, (m, n), jnp.bfloat16)

  def ep(t, acc):
    x = acc + t.load("x0").astype(jnp.float32)
    t.store("out", x)
    t.store("ss", jnp.sum(x * x, axis=1))
    t.store("cs", jnp.sum(x, axis=0))
    t.store("h", x * t.load("r")[:, None] * t.load("g")[None, :])

  outs = (EpilogueOutput("out"), EpilogueOutput("ss", OutputKind.ROW_PARTIAL, jnp.float32),
          EpilogueOutput("cs", OutputKind.COL_PARTIAL, jnp.float32),
          EpilogueOutput("h", dtype=jnp.float32))
  for wg in (MatDim.N, MatDim.M):
    cfg = GemmConfig(tile_m=64, tile_n=128, wg_dim=wg, stages=2)
    try:
      o = gemm(a, b, inputs=dict(x0=(InputKind.TILE, x0), r=(InputKind.ROW, r), g=(InputKind.COL, g)), epilogue=ep, outputs=outs, config=cfg)
      x = ref + x0.astype(jnp.float32)
      print(f"epilogue wg={wg.name}: out {rel_err(o['out'], x):.2e} ss {rel_err(o['ss'].sum(0), (x*x).sum(1)):.2e} "
            f"cs {rel_err(o['cs'].sum(0), x.sum(0)):.2e} h {rel_err(o['h'], x*r[:,None]*g[None,:]):.2e}", flush=True)
    except Exception as e:  # report and go on: this is a probe
      print(f"epilogue wg={wg.name}: FAILED {type(e).__name__}: {str(e)[:2000]}", flush=True)


def time_ms(f, *args, iterations=20):
  _, times = profiler.measure(f, aggregate=False, iterations=iterations)(*args)
  # times: per-iteration list of per-kernel times; sum kernels within an iteration
  per_iter = [sum(t for _, t in it) if isinstance(it, (list, tuple)) and it and isinstance(it[0], tuple) else it for it in times]
  return statistics.median(per_iter)


def variant_sweep(shapes):
  """The default config against single-knob variants of it."""
  base = GemmConfig()
  variants = {"default": base,
              "epi_n128_st3": dataclasses.replace(base, epi_tile_n=128, stages=3),
              "tk128_st2": dataclasses.replace(base, tile_k=128, stages=2),
              "tk128_st3_epi32": dataclasses.replace(base, tile_k=128, stages=3, epi_tile_n=32),
              "st5_epi32": dataclasses.replace(base, stages=5, epi_tile_n=32),
              "epi_m128_n32": dataclasses.replace(base, epi_tile_m=128, epi_tile_n=32)}
  print("\n| M | K | N | XLA ms | " + " | ".join(variants) + " |")
  for (m, k, n) in shapes:
    a = jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(2), (k, n), jnp.bfloat16)
    xla = time_ms(jax.jit(lambda a, b: a @ b), a, b)
    cells = []
    for cfg in variants.values():
      try:
        cells.append(f"{time_ms(jax.jit(lambda a, b, cfg=cfg: gemm(a, b, config=cfg)['out']), a, b):.4f}")
      except Exception as e:
        cells.append(type(e).__name__)
    print(f"| {m} | {k} | {n} | {xla:.4f} | " + " | ".join(cells) + " |", flush=True)


def sweep(shapes):
  rows = []
  for (m, k, n) in shapes:
    a = jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(2), (k, n), jnp.bfloat16)
    xla = time_ms(jax.jit(lambda a, b: a @ b), a, b)
    best = None
    for tm, tn, (wg, gmin), tk, st, gw, cl in itertools.product(
        (128,), (128,), ((MatDim.N, MatDim.M), (MatDim.M, MatDim.N)), (64,), (4,), (8, 16),
        (None, MatDim.M, MatDim.N)):
      cfg = GemmConfig(tile_m=tm, tile_n=tn, tile_k=tk, stages=st, wg_dim=wg,
                       grid_minor_dim=gmin, grid_tile_width=gw, cluster_dim=cl)
      try:
        t = time_ms(jax.jit(lambda a, b, cfg=cfg: gemm(a, b, config=cfg)["out"]), a, b)
      except Exception as e:
        print(f"  {cfg}: {type(e).__name__} {str(e)[:200]}", flush=True)
        continue
      print(f"  {m}x{k}x{n} wg={wg.name} minor={gmin.name} width={gw} "
            f"cluster={cl.name if cl is not None else None}: {t:.4f} ms "
            f"(xla {xla:.4f})", flush=True)
      if best is None or t < best[0]:
        best = (t, cfg)
    rows.append((m, k, n, xla, best))
  print("\n| M | K | N | XLA ms | ours ms | speed vs XLA | config |")
  print("|---|---|---|---|---|---|---|")
  for m, k, n, xla, best in rows:
    if best:
      print(f"| {m} | {k} | {n} | {xla:.4f} | {best[0]:.4f} | {xla / best[0]:.3f} | {best[1]} |")


if __name__ == "__main__":
  p = argparse.ArgumentParser()
  p.add_argument("--shapes", default="16384x2048x2048")
  p.add_argument("--skip-check", action="store_true")
  p.add_argument("--variants", action="store_true", help="default config vs one-knob variants")
  args = p.parse_args()
  print(jax.devices(), jax.__version__, flush=True)
  shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
  if not args.skip_check:
    check_features()
  if args.variants:
    variant_sweep(shapes)
    sys.exit(0)
  sweep([tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")])
