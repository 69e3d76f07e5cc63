"""What each step of a heavy epilogue program costs: the program timed with steps (or
parts of a step) removed, all under the full program's config, in one process. GPU host
only.

    PYTHONPATH=. python -m bench.ablate_epilogue --shapes gpt2_1b

For each program of the table below (GPT-2's heaviest at 1B shapes), the full program
runs with the config ``gemm`` chooses for it (tuned, where the cache has it); every
variant then runs with that same config (same stages, tiles, schedule), so a variant's
time minus the plain GEMM's under that config is what its steps cost. "plain, own
config" is our plain GEMM with the config chosen for it. Times: CUPTI, our GEMM kernel
only, median of ``--iterations``, random normal inputs. Prints a table per program as
soon as it is measured (a run cut by a time limit keeps the programs it finished).
``--variant`` picks variants by name; ``--ncu`` runs each twice untimed, for Nsight
Compute:

    ncu --kernel-name regex:coda_gemm --launch-skip 1 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats \\
        python -m bench.ablate_epilogue --match MLP --variant full --ncu
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

import jax
import jax.numpy as jnp

from bench import common
from coda_jax import epilogue_gemm as eg
from coda_jax import layernorm_ops as L
from coda_jax import primitives as P
from pallas_kernels import autotune

_F32 = jnp.float32
_LN_PARTS = ("dr", "dmu", "dbeta", "dg", "n")


@dataclasses.dataclass(frozen=True)
class LayerNormGradParts(L.LayerNormGrad):
  """``LayerNormGrad`` computing only ``parts`` of its outputs (dh is always returned):
  for cost attribution only, not a gradient. Its own arithmetic rather than
  ``common.DroppingEnv`` around the real step: without dr and n it must not read h at
  all (no staged tile), which dropping stores cannot express;
  ``test_ablate_epilogue_variants`` holds it bitwise to ``LayerNormGrad``."""
  parts: tuple = _LN_PARTS

  def outputs(self, width):
    return tuple(o for o, part in zip(super().outputs(width), _LN_PARTS)
                 if part in self.parts)

  def apply(self, dn, env):
    mu = env.load(self.mu).astype(_F32)
    r = env.load(self.r).astype(_F32)
    g = env.load(self.g).astype(_F32)[None, :]
    dh = r[:, None] * dn
    if {"dr", "n"} & set(self.parts):
      hc = env.load(self.h).astype(_F32) - mu[:, None] * g
    if "dr" in self.parts:
      env.store(self.dr, jnp.sum(dn * hc, axis=1))
    if "dmu" in self.parts:
      env.store(self.dmu, -r * jnp.sum(dn * g, axis=1))
    if "dbeta" in self.parts:
      env.store_column_sum(self.dbeta, dn)
    if "dg" in self.parts:
      env.store_column_sum(self.dg, (-mu)[:, None] * dh.astype(self.dtype).astype(_F32))
    if "n" in self.parts:
      beta = env.load(self.beta).astype(_F32)[None, :]
      env.store(self.n, r[:, None] * hc + beta)
    return dh

  def finish(self, raw):
    return {nm: raw[nm] if nm == self.n else jnp.sum(raw[nm], axis=0)
            for nm, part in zip((self.dr, self.dmu, self.dbeta, self.dg, self.n), _LN_PARTS)
            if part in self.parts}

  def inputs(self):
    ins = super().inputs()
    if not {"dr", "n"} & set(self.parts):
      ins.pop(self.h)
    if "n" not in self.parts:
      ins.pop(self.beta)
    return ins


@dataclasses.dataclass(frozen=True)
class LayerNormInputGradNoDg(L.LayerNormInputGrad):
  """``LayerNormInputGrad`` without g's column sum: for cost attribution only."""

  def outputs(self, width):
    return ()

  def apply(self, acc, env):
    return super().apply(acc, common.DroppingEnv(env, [self.dg]))

  def finish(self, raw):
    return {}


SHAPES = {"gpt2_1b": dict(m=16384, d=2048, f=8192, qkv=6144)}


def programs(s: dict, dt) -> list[tuple[str, tuple, dict, list[tuple[str, list]]]]:
  """(name, (M, N, K, trans_b), operand kinds, [(variant, program)]): the full program
  first."""
  m, d, f = s["m"], s["d"], s["f"]
  ln_ops = {"h": "tile", "mu": "row", "r": "row", "g": "col", "beta": "col"}
  ln = lambda parts: [LayerNormGradParts("h", "mu", "r", "g", "beta", dtype=dt,
                                         parts=parts), P.Store("dh", dt)]
  ln_variants = [("full", [L.LayerNormGrad("h", "mu", "r", "g", "beta", dtype=dt),
                           P.Store("dh", dt)]),
                 ("no column sums (dbeta, dg)", ln(("dr", "dmu", "n"))),
                 ("no dg", ln(("dr", "dmu", "dbeta", "n"))),
                 ("no n store", ln(("dr", "dmu", "dbeta", "dg"))),
                 ("no row sums (dr, dmu)", ln(("dbeta", "dg", "n"))),
                 ("rows only (dr, dmu)", ln(("dr", "dmu"))),
                 ("dh only", ln(())),
                 ("plain", [P.Store("dh", dt)])]
  out = []
  for n_out in (f, s["qkv"]):
    out.append((f"LayerNormGrad, dz @ w^T ({n_out} -> {d})", (m, d, n_out, True), ln_ops,
                ln_variants))
  sd = L.slope_dtype_for(dt)  # the slope as the MLP stores it (bf16: the one-byte code)
  mul = L.slope_multiplier("s", sd)
  out.append(("MLP slope backward, dout @ w2^T", (m, f, d, True), {"s": "slope"},
              [("full", [mul, P.ColSum("db1"), P.Store("dz", dt)]),
               ("no ColSum", [mul, P.Store("dz", dt)]),
               ("no MulTile", [P.ColSum("db1"), P.Store("dz", dt)]),
               ("plain", [P.Store("dz", dt)])]))
  norm = lambda tail: L.norm_matmul_program(tail)
  out.append(("LayerNorm + GELU forward, h @ w1", (m, f, d, False),
              {"r": "row", "r_mu": "row", "gw": "col", "cw": "col"},
              [("full", norm([L.Gelu(slope="s", slope_dtype=sd), P.Store("a", dt)])),
               ("no slope store", norm([L.Gelu(), P.Store("a", dt)])),
               ("no GELU", norm([P.Store("a", dt)])),
               ("plain", [P.Store("a", dt)])]))
  stats = L.residual_stats_program([L.AddBias("b")], dt)
  for k in (f, d):
    out.append((f"residual + LayerNorm statistics, K={k}", (m, d, k, False),
                {"b": "col", "res": "tile", "g": "col"},
                [("full", stats),
                 ("no h store", stats[:-2]),
                 ("no row sums", [s_ for s_ in stats if not isinstance(s_, P.RowSum)]),
                 ("bias + residual, one store", [L.AddBias("b"), P.AddTile("res"),
                                                 P.Store("x", dt)]),
                 ("plain", [P.Store("x", dt)])]))
  pass_ops = {"dx": "tile", "dh": "tile", "x": "tile", "g": "col", "mu": "row", "a": "row",
              "b": "row"}
  ig = ["dh", "x", "g", "mu", "a", "b"]
  out.append(("LayerNorm producer backward pass (K = 0)", (m, d, 0, False), pass_ops,
              [("full", [P.AddTile("dx"), L.LayerNormInputGrad(*ig), P.ColSum("dsum"),
                         P.Store("dxt", dt)]),
               ("no dsum", [P.AddTile("dx"), L.LayerNormInputGrad(*ig), P.Store("dxt", dt)]),
               ("no column sums", [P.AddTile("dx"), LayerNormInputGradNoDg(*ig),
                                   P.Store("dxt", dt)]),
               ("plain", [P.AddTile("dx"), P.Store("dxt", dt)])]))
  return out


def operand(kind: str, key, m: int, n: int, dt):
  if kind == "tile":
    return jax.random.normal(key, (m, n), dt)
  if kind == "slope":  # a stored GELU slope (gelu'(z)'s range), as the MLP stores it
    s, sd = jax.random.uniform(key, (m, n), _F32, -0.129, 1.129), L.slope_dtype_for(dt)
    return (L.slope_code(s) if sd == jnp.uint8 else s).astype(sd)
  if kind == "row":  # positive: r and r mu are scales
    return jax.random.uniform(key, (m,), _F32, 0.5, 1.5)
  return jax.random.normal(key, (n,), _F32)


def inputs(m, n, k, trans_b, kinds, dt):
  """(a, b, operands by name) for one program of ``programs``: random normal a and b
  (None when K = 0) and operands of ``kinds``."""
  keys = jax.random.split(jax.random.key(0), 2 + len(kinds))
  a = jax.random.normal(keys[0], (m, k), dt) if k else None
  b = jax.random.normal(keys[1], (n, k) if trans_b else (k, n), dt) if k else None
  return a, b, {nm: operand(kd, kk, m, n, dt) for kk, (nm, kd) in zip(keys[2:], kinds.items())}


def run(a, b, program, ops, trans_b, config=None):
  """The program after ``a @ b``, or (``a`` None: K = 0) as an epilogue pass."""
  if a is None:
    return eg.epilogue_pass(program, ops, impl="mosaic", config=config)
  return eg.gemm_epilogue(a, b, program, ops, trans_b=trans_b, impl="mosaic", config=config)


def chosen(a, b, program, ops, trans_b):
  """The config ``gemm`` runs this program with, and its source."""
  jax.clear_caches()
  with autotune.recording() as rec:
    jax.eval_shape(lambda a, b, o: run(a, b, program, o, trans_b), a, b, ops)
  (problem,) = rec.values()
  return autotune.chosen_config(problem)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--shapes", default="gpt2_1b", choices=sorted(SHAPES))
  p.add_argument("--iterations", type=int, default=30)
  p.add_argument("--match", default="", help="run only programs whose name contains this")
  p.add_argument("--variant", action="append", default=None, dest="variants",
                 help="a variant to run, by name (repeat for more; default: all; 'plain, "
                 "own config' is named 'own')")
  p.add_argument("--ncu", action="store_true",
                 help="run each variant twice, untimed, for Nsight Compute (profile the "
                 "second launch of each kernel)")
  args = p.parse_args(argv)
  wanted = None if args.variants is None else set(args.variants)
  dt = jnp.dtype(jnp.bfloat16)  # as the ops spell it: the tuning cache keys on repr
  print("# Epilogue cost by step", common.provenance(), flush=True)
  for name, (m, n, k, trans_b), kinds, variants in programs(SHAPES[args.shapes], dt):
    if args.match not in name:
      continue
    a, b, ops = inputs(m, n, k, trans_b, kinds, dt)
    cfg, source = chosen(a, b, variants[0][1], ops, trans_b)
    lines = [f"\n## {name}: {m}x{n}x{k} {'nt' if trans_b else 'nn'}",
             f"config: {cfg.describe()} ({source})", "",
             "| variant | ms | / full | - plain (same config), ms |", "|---|---|---|---|"]
    times = {}
    for vname, program in variants + [("plain, own config", None)]:
      if program is None and not k:
        continue  # no product: "plain" is the copy above
      if wanted is not None and ("own" if program is None else vname) not in wanted:
        continue
      if program is None:
        fn = jax.jit(lambda a, b: eg.gemm_epilogue(a, b, [P.Store("o", dt)], {},
                                                   trans_b=trans_b, impl="mosaic"))
        args_ = (a, b)
      else:
        used = {nm for st in program for nm in st.inputs()}
        vops = {nm: v for nm, v in ops.items() if nm in used}
        fn = jax.jit(lambda a, b, o, program=program: run(a, b, program, o, trans_b, cfg))
        args_ = (a, b, vops)
      try:
        if args.ncu:
          for _ in range(2):
            jax.block_until_ready(fn(*args_))
          print(f"{name} / {vname}: ran twice", flush=True)
          continue
        times[vname], _ = common.time_kernels(fn, *args_, iterations=args.iterations,
                                              only="coda_gemm")
      except Exception as e:  # a variant that does not fit is reported, not fatal
        lines.append(f"| {vname} | failed: {type(e).__name__}: {str(e)[:300]} | | |")
        print(lines[-1], flush=True)
        continue
      print(f"{name} / {vname}: {times[vname]:.4f} ms", flush=True)
    full, plain = times.get("full"), times.get("plain")
    for vname, t in times.items():
      ratio = f"{t / full:.3f}" if full else "-"
      extra = f"{t - plain:+.4f}" if plain else "-"
      lines.append(f"| {vname} | {t:.4f} | {ratio} | {extra} |")
    if not args.ncu:  # each program's table as soon as it is measured
      print("\n".join(lines), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
