"""Whether LayerNorm's backward row terms can be finished inside the GEMM that makes dn
(``docs/layernorm_math.md`` section 6), measured at GPT-2 1B's shapes.

Today the backward of a LayerNorm takes two kernels: the GEMM dn = dz @ W^T with
``LayerNormGrad`` (stores dh, n and the row partials of dr and dmu), then the producer's
pass (``stats_cotangent``: dx, dh and x in, dxt out). With row totals
(``pallas_kernels`` row_total outputs, summed across the grid mid-epilogue) one GEMM
does both: its first pass sums g dn and g dn (x - mu) over each tile's columns, the
row block's tiles exchange those partials, and the second pass writes

    dxt = dx + r (g dn - a - xhat c),  a = sum g dn / D,  c = r sum g dn (x - mu) / D

with n = xhat g + beta and the column partials of dbeta, dg and the bias's sum dxt.

    PYTHONPATH=. python -m bench.layernorm_row_terms [--k 8192 6144] [--quick]

For each K (8192: the MLP's c_fc; 6144: attention's c_attn): checks both paths against
a float64 reference (relative error of dxt, n, dbeta, dg), then times (CUPTI medians,
random normal inputs) today's GEMM + pass against the one GEMM under several ping-pong
configs. Prints a markdown table. Needs a GPU."""
from __future__ import annotations

import argparse
import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np

from bench import common
from coda_jax import layernorm_ops as L
from coda_jax import primitives as P
from coda_jax.epilogue_gemm import gemm_epilogue
from pallas_kernels import gemm_mgpu as g

M, D = 16384, 2048
_F32 = jnp.float32


# The program is the library's (``coda_jax.layernorm_ops``, which the GPT-2 half block's
# backward runs); the benchmark calls the kernel with it directly, under each config.
first_pass = L.row_terms_first_pass
second_pass = L.row_terms_second_pass(D)
OUTPUTS = L.ROW_TERMS_OUTPUTS


def fused(dz, w, x, dx, mu, r, gam, beta, config):
  """One GEMM: (dxt, n, dbeta, dg, dsum)."""
  return L.row_terms_gemm(dz, w, x, dx, mu, r, gam, beta, config)


def today(dz, w, x, h, dx, mu, r, gam, beta):
  """The GEMM with LayerNormGrad, then the producer's pass (as the ops ran them)."""
  return L.input_grad_gemm_and_pass(dz, w, h, x, dx, mu, r, gam, beta, "mosaic")


class _NoWait:
  """While active, the kernel's wait for the row block's partials is traced as nothing:
  the totals are then wrong (whatever had arrived), so this is for timing what the wait
  costs, never for values."""

  def __enter__(self):
    self._wait = g.plgpu.semaphore_wait
    g.plgpu.semaphore_wait = lambda *args, **kwargs: None

  def __exit__(self, *exc):
    g.plgpu.semaphore_wait = self._wait


def ablations(ops, fused_ops, config):
  """name -> jitted call, each under ``config``: the one GEMM without its wait, today's
  GEMM program alone (LayerNormGrad + Store dh), and the plain GEMM."""
  def no_wait(o):
    with _NoWait():
      return fused(**o, config=config)

  def layernorm_grad(o):
    dt = o["dz"].dtype
    return gemm_epilogue(
        o["dz"], o["w"], [L.LayerNormGrad("h", "mu", "r", "g", "beta", dtype=dt),
                          P.Store("dh", dt)],
        {"h": o["h"], "mu": o["mu"], "r": o["r"], "g": o["gam"], "beta": o["beta"]},
        trans_b=True, impl="mosaic", config=config)

  return {"one GEMM without the wait (values wrong)": (jax.jit(no_wait), fused_ops),
          "today's GEMM program alone (LayerNormGrad)": (jax.jit(layernorm_grad), ops),
          "plain GEMM": (jax.jit(lambda o: g.gemm(o["dz"], o["w"], trans_b=True,
                                                  config=config)), ops)}


def reference(dz, w, x, dx, mu, r, gam, beta):
  """float64 numpy: (dxt, n, dbeta, dg, dsum)."""
  f = lambda v: np.asarray(v, np.float64)
  dn = f(dz) @ f(w).T
  mu, r, gam, beta = f(mu)[:, None], f(r)[:, None], f(gam)[None], f(beta)[None]
  xhat = (f(x) - mu) * r
  a = np.mean(gam * dn, axis=1, keepdims=True)
  c = np.mean(gam * dn * xhat, axis=1, keepdims=True)
  dxt = f(dx) + r * (gam * dn - a - xhat * c)
  return dxt, xhat * gam + beta, dn.sum(0), (dn * xhat).sum(0), dxt.sum(0)


def inputs(key, k):
  ks = jax.random.split(key, 6)
  bf = lambda kk, shape, s=1.0: (s * jax.random.normal(kk, shape, _F32)).astype(jnp.bfloat16)
  x = bf(ks[0], (M, D))
  xf = x.astype(_F32)
  mu = jnp.mean(xf, axis=1)
  r = jax.lax.rsqrt(jnp.mean(xf * xf, axis=1) - mu * mu + 1e-5)
  gam = 1 + 0.1 * jax.random.normal(ks[1], (D,), _F32)
  beta = 0.1 * jax.random.normal(ks[2], (D,), _F32)
  h = (xf * gam).astype(jnp.bfloat16)
  return dict(dz=bf(ks[3], (M, k), 0.05), w=bf(ks[4], (D, k), 0.02), x=x, h=h,
              dx=bf(ks[5], (M, D)), mu=mu, r=r, gam=gam, beta=beta)


def configs(quick):
  """name -> ping-pong config; the first (the library's, ``row_terms_config``) is the
  --quick one and the ablations'. Five stages fit beside the two tile operands, their
  outputs and the gathered partials only with one operand slot and one output slot."""
  lib = L.row_terms_config(D)
  out = {"library: " + lib.describe(): lib}
  if not quick:
    out["the same, column sums per sub-tile"] = dataclasses.replace(
        lib, epi_column_sums_per_tile=False)
    out["the same, 4 stages, 2 operand and output slots"] = dataclasses.replace(
        lib, stages=4, epi_operand_slots=2, epi_out_slots=2, epi_column_sums_per_tile=False)
  return out


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--k", type=int, nargs="+", default=[8192, 6144])
  p.add_argument("--quick", action="store_true", help="one config")
  p.add_argument("--iterations", type=int, default=20)
  p.add_argument("--ablate", action="store_true",
                 help="also time, under the first config: the one GEMM without its wait, "
                      "today's GEMM program alone, the plain GEMM")
  args = p.parse_args(argv)
  if jax.devices()[0].platform != "gpu":
    sys.exit("bench.layernorm_row_terms measures on the device: run it on the GPU host")
  print(common.provenance(), flush=True)
  names = ("dxt", "n", "dbeta", "dg", "dsum")
  rows = []
  for k in args.k:
    ops = inputs(jax.random.key(k), k)
    fused_ops = {nm: ops[nm] for nm in ("dz", "w", "x", "dx", "mu", "r", "gam", "beta")}
    want = reference(**fused_ops)
    base = jax.jit(today)
    got = base(**ops)
    errs = {nm: common.rel_diff(v, w) for nm, v, w in zip(names, got, want)}
    ms, per = common.time_kernels(lambda o: base(**o), ops, iterations=args.iterations)
    rows.append(("today: GEMM + pass", k, ms, errs, per))
    print(f"K={k} today {ms:.4f} ms {errs}", flush=True)
    for cname, cfg in configs(args.quick).items():
      fn = jax.jit(lambda o, c=cfg: fused(**o, config=c))
      try:
        got = fn(fused_ops)
        errs = {nm: common.rel_diff(v, w) for nm, v, w in zip(names, got, want)}
        ms, per = common.time_kernels(fn, fused_ops, iterations=args.iterations)
      except Exception as e:  # a config that does not fit: say so, go on
        print(f"K={k} {cname}: ERROR {type(e).__name__}: {str(e)[:300]}", flush=True)
        continue
      rows.append((f"one GEMM, {cname}", k, ms, errs, per))
      print(f"K={k} {cname} {ms:.4f} ms {errs}", flush=True)
    if args.ablate:
      cname, cfg = next(iter(configs(True).items()))
      for name, (fn, operands) in ablations(ops, fused_ops, cfg).items():
        try:
          ms, per = common.time_kernels(fn, operands, iterations=args.iterations)
        except Exception as e:  # say so, go on
          print(f"K={k} {name}: ERROR {type(e).__name__}: {str(e)[:300]}", flush=True)
          continue
        rows.append((f"{name}, {cname}", k, ms, None, per))
        print(f"K={k} {name}, {cname}: {ms:.4f} ms", flush=True)
  print("\n| path | K | ms (all kernels) | dxt err | n err | dbeta err | dg err | dsum err |"
        "\n|---|---|---|---|---|---|---|---|")
  for name, k, ms, errs, _ in rows:
    print(f"| {name} | {k} | {ms:.4f} | "
          + " | ".join("-" if errs is None else f"{errs[nm]:.2e}" for nm in names) + " |")
  print("\nPer kernel (ms):")
  for name, k, _, _, per in rows:
    print(f"- {name}, K={k}: " + ", ".join(f"{n} {t:.4f}" for n, t in per))


if __name__ == "__main__":
  main()
