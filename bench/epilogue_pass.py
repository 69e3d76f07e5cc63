"""Where an epilogue pass's time goes (``coda_jax.epilogue_pass``: the GEMM kernel with
K = 0), for one of two passes:

* ``--program qk_norm`` (default): the Qwen3-1.7B QK-norm backward (M = 16384, 16 q /
  8 kv heads of 128);
* ``--program qk_norm_split``: the same pass as the block runs it (du scaled by r per
  row), with its per-head branch and with the pass-through mask it replaced, against its
  q/k heads and its v heads run as passes of their own: what the v heads and the mask
  cost;
* ``--program layernorm``: GPT-2 1B's LayerNorm producer backward
  (``layernorm_ops.stats_cotangent``, M = 16384, D = 2048: dx, dh and x read, dxt
  written, two column partials).

    PYTHONPATH=. python -m bench.epilogue_pass [--program layernorm]

Times (CUPTI, median of 20, random normal inputs) the pass's program and variants with a
step removed, under several configs (``tuned``: the one ``gemm`` chooses), beside
bandwidth floors: the pass kernel copying the same tiles into one (with and without a
column sum) and XLA's fused sum of the same tiles over the same bytes. Prints a markdown
table. Needs a GPU."""
from __future__ import annotations

import argparse
import dataclasses
import sys

import jax
import jax.numpy as jnp

from bench import common
from bench.ablate_epilogue import LayerNormInputGradNoDg
from coda_jax import jnp_reference as R
from coda_jax import layernorm_ops as L
from coda_jax import primitives as P
from coda_jax import qk_norm as Q
from coda_jax.epilogue_gemm import epilogue_pass
from pallas_kernels import GemmConfig
from pallas_kernels import gemm_mgpu as g

M, HQ, HKV, HD = 16384, 16, 8, 128


@dataclasses.dataclass(frozen=True)
class _WithoutNormGrads(Q.HeadRmsNormGrad):
  """HeadRmsNormGrad without the norm weights' column sums (what they cost)."""

  def outputs(self, width):
    return tuple(o for o in super().outputs(width) if o.name != self.dweight)

  def apply(self, dy, env):
    return super().apply(dy, common.DroppingEnv(env, [self.dweight]))

  def finish(self, raw):
    return {self.udu: jnp.sum(raw[self.udu], axis=0)}


@dataclasses.dataclass(frozen=True)
class _MaskedHeads(Q.HeadRmsNormGrad):
  """HeadRmsNormGrad as it was before its per-head branch (``Env.cond``): every
  head runs the norm's math, and a 0/1 mask per column makes pass-through heads' results
  exact. With ``mask=False`` every head runs the normed head's math, with no mask and
  no branch (``normed`` is staged but not read): what the mask, and the branch, cost on
  a pass with no pass-through heads."""
  mask: bool = True

  def _head(self, env, col, ub, dyb, wb):
    if not self.mask:
      return self._normed_head(ub, dyb, wb)
    d = self.head_dim
    s = env.load(self.normed).astype(jnp.float32)[None, col:col + d]
    rho = Q._inv_rms(ub, self.eps)[:, None]
    us = ub * s
    n = (ub - us) + us * rho
    dn = dyb * wb
    c = jnp.sum(dn * n, axis=1) * (1.0 / d)
    t = dn - (n * s) * c[:, None]
    ts = t * s
    du = (t - ts) + ts * rho
    return n, du, jnp.sum(du * ub, axis=1)


def _copies(names, out, column_sum=False):
  """The pass kernel summing the tiles ``names`` into one (a bandwidth floor)."""
  return ([P.AddTile(nm) for nm in names] + ([P.ColSum("c")] if column_sum else [])
          + [P.Store(out)])


def _xla_sum(*tiles):
  """XLA's fused sum of the tiles in fp32, rounded back: the same bytes as the pass."""
  total = sum(t.astype(jnp.float32) for t in tiles)
  return total.astype(tiles[0].dtype)


def qk_norm_case(key):
  """(programs, configs, XLA floor, bytes moved) for the QK-norm backward."""
  n = (HQ + 2 * HKV) * HD
  ks = jax.random.split(key, 3)
  dqkv = jax.random.normal(ks[0], (M, n), jnp.float32).astype(jnp.bfloat16)
  u = jax.random.normal(ks[1], (M, n), jnp.float32).astype(jnp.bfloat16)
  pos = jax.random.randint(ks[2], (M,), 0, 4096, jnp.int32)
  w, sel = Q.head_norm_columns(jnp.ones((HD,)), jnp.ones((HD,)), HQ, HKV)
  ops = {"dqkv": dqkv, "pos": pos, "neg_freqs": -R.qkv_freqs(HQ, HKV, HD, 1e6, None),
         "u": u, "qk_w": w, "qk_sel": sel}
  full = Q.backward_program(HD, 1e-6, jnp.bfloat16)
  norm_grad = full[2]
  no_rotate = {k: v for k, v in ops.items() if k not in ("pos", "neg_freqs")}
  copies = {"dqkv": dqkv, "u": u}
  programs = {
      "QK-norm backward": (full, ops),
      "without the weights' column sums": (
          [full[0], full[1], _WithoutNormGrads(**dataclasses.asdict(norm_grad)), full[3]],
          ops),
      "without RoPE^T": ([full[0], full[2], full[3]], no_rotate),
      "copy2": (_copies(copies, "du"), copies),
      "copy2 + column sum": (_copies(copies, "du", True), copies),
  }
  configs = {
      "64x128 in1": GemmConfig(tile_m=64, tile_n=128, epi_tile_n=128, cluster_dim=None,
                               stages=2, epi_operand_slots=1),
      "128x128": GemmConfig(tile_m=128, tile_n=128, epi_tile_n=128, cluster_dim=None,
                            stages=2)}
  return programs, configs, ("a + b", (dqkv, u)), 3 * M * n * 2


def qk_norm_split_case(key):
  """The QK-norm backward as the Qwen3 block runs it (``row_scaled``), whole and split
  into its q/k heads and its v heads (each a pass of its own)."""
  n = (HQ + 2 * HKV) * HD
  nqk = (HQ + HKV) * HD
  ks = jax.random.split(key, 4)
  dqkv = jax.random.normal(ks[0], (M, n), jnp.float32).astype(jnp.bfloat16)
  u = jax.random.normal(ks[1], (M, n), jnp.float32).astype(jnp.bfloat16)
  pos = jax.random.randint(ks[2], (M,), 0, 4096, jnp.int32)
  r = 1 + 0.1 * jax.random.normal(ks[3], (M,), jnp.float32)
  w, sel = Q.head_norm_columns(jnp.ones((HD,)), jnp.ones((HD,)), HQ, HKV)
  neg = -R.qkv_freqs(HQ, HKV, HD, 1e6, None)
  ops = {"dqkv": dqkv, "pos": pos, "neg_freqs": neg, "u": u, "qk_w": w, "qk_sel": sel,
         "r": r}
  qk = {"dqkv": dqkv[:, :nqk], "pos": pos, "neg_freqs": neg[:nqk], "u": u[:, :nqk],
        "qk_w": w[:nqk], "qk_sel": sel[:nqk], "r": r}
  v = {"dqkv": dqkv[:, nqk:], "u": u[:, nqk:], "r": r}
  full = Q.backward_program(HD, 1e-6, jnp.bfloat16, row_scaled=True)
  grad = full[2]
  free = _MaskedHeads(**dataclasses.asdict(grad), mask=False)
  programs = {
      "QK-norm backward, row-scaled, N = 4096": (full, ops),
      "the same with a mask, no branch (before)": (
          [*full[:2], _MaskedHeads(**dataclasses.asdict(grad)), *full[3:]], ops),
      "its q/k heads alone, N = 3072": (full, qk),
      "q/k heads, no pass-through mask": ([full[0], full[1], free, *full[3:]], qk),
      "q/k heads, no mask, no RoPE^T": (
          [full[0], free, *full[3:]], {k: a for k, a in qk.items()
                                       if k not in ("pos", "neg_freqs")}),
      "its v heads alone (copy, <du, u>, r), N = 1024": (
          [P.AddTile("dqkv"), P.RowDot("u", "udu"), P.ScaleRow("r"),
           P.Store("du", jnp.bfloat16)], v),
      "copy2, N = 4096": (_copies({"dqkv": dqkv, "u": u}, "du"), {"dqkv": dqkv, "u": u}),
  }
  configs = {
      "tuned": None,
      "64x128 in1 next": GemmConfig(tile_m=64, tile_n=128, epi_tile_n=128, cluster_dim=None,
                                    stages=2, epi_operand_slots=1,
                                    epi_prefetch_next_tile=True)}
  return programs, configs, ("a + b", (dqkv, u)), 3 * M * n * 2


def layernorm_case(key, d=2048):
  """(programs, configs, XLA floor, bytes moved) for GPT-2 1B's LayerNorm producer
  backward, as ``layernorm_ops.stats_cotangent`` runs it."""
  ks = jax.random.split(key, 7)
  tile = lambda k: jax.random.normal(k, (M, d), jnp.float32).astype(jnp.bfloat16)
  row = lambda k: jax.random.normal(k, (M,), jnp.float32)
  dx, dh, x = tile(ks[0]), tile(ks[1]), tile(ks[2])
  ops = {"dx": dx, "dh": dh, "x": x, "g": 1 + 0.1 * jax.random.normal(ks[3], (d,)),
         "mu": row(ks[4]), "a": row(ks[5]), "b": row(ks[6])}
  grad = L.LayerNormInputGrad("dh", "x", "g", "mu", "a", "b")
  copies = {"dx": dx, "dh": dh, "x": x}
  programs = {
      "LayerNorm producer backward": (
          [P.AddTile("dx"), grad, P.ColSum("dsum"), P.Store("dxt")], ops),
      "without the two column sums": (
          [P.AddTile("dx"), LayerNormInputGradNoDg(**dataclasses.asdict(grad)),
           P.Store("dxt")], ops),
      "copy3": (_copies(copies, "dxt"), copies),
      "copy3 + column sum": (_copies(copies, "dxt", True), copies),
  }
  base = dict(tile_m=128, tile_n=128, epi_tile_n=64, cluster_dim=None, stages=2,
              epi_operand_slots=1, epi_prefetch_next_tile=True)
  configs = {
      "tuned": None,
      "wgN in1 next colT": GemmConfig(**base, wg_dim=g.MatDim.N,
                                      epi_column_sums_per_tile=True),
      "wgN in2 next colT": GemmConfig(**{**base, "epi_operand_slots": 2},
                                      wg_dim=g.MatDim.N, epi_column_sums_per_tile=True),
      "wgN in4 next colT": GemmConfig(**{**base, "epi_operand_slots": 4},
                                      wg_dim=g.MatDim.N, epi_column_sums_per_tile=True),
      "wgN in1 colT (no next)": GemmConfig(**{**base, "epi_prefetch_next_tile": False},
                                           wg_dim=g.MatDim.N, epi_column_sums_per_tile=True),
      "wgN in1 next": GemmConfig(**base, wg_dim=g.MatDim.N),
      "wgN in1 next colT, 3 stores": GemmConfig(**base, wg_dim=g.MatDim.N,
                                                epi_column_sums_per_tile=True,
                                                epi_out_slots=3),
      "e64x128 in1 next colT": GemmConfig(**{**base, "epi_tile_n": 128}, wg_dim=g.MatDim.N,
                                          epi_column_sums_per_tile=True),
      "64x128 in1 next colT": GemmConfig(**{**base, "tile_m": 64}, wg_dim=g.MatDim.M,
                                         epi_column_sums_per_tile=True),
  }
  return programs, configs, ("dx + dh + x", (dx, dh, x)), 4 * M * d * 2


CASES = {"qk_norm": qk_norm_case, "qk_norm_split": qk_norm_split_case,
         "layernorm": layernorm_case}


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--program", choices=sorted(CASES), default="qk_norm")
  args = p.parse_args(argv)
  if jax.devices()[0].platform != "gpu":
    sys.exit("bench.epilogue_pass measures on the device: run it on the GPU host")
  programs, configs, (xla_name, xla_args), nbytes = CASES[args.program](jax.random.key(0))
  gbs = lambda ms, b=nbytes: b / ms / 1e6
  print(common.provenance())
  print(f"| program | config | ms | GB/s (tiles read and written; {nbytes / 1e6:.0f} MB for "
        "the whole pass) |\n|---|---|---|---|")
  for name, (program, operands) in programs.items():
    tiles = [a for a in operands.values() if a.ndim == 2]
    moved = sum(a.size * a.dtype.itemsize for a in tiles) + tiles[0].size * 2
    for cname, cfg in configs.items():
      fn = jax.jit(lambda o, p=program, c=cfg: epilogue_pass(p, o, impl="mosaic", config=c))
      try:
        ms, _ = common.time_kernels(fn, operands, iterations=20, only="coda_gemm")
      except Exception as e:  # a variant that does not fit: say so, go on
        print(f"| {name} | {cname} | ERROR {type(e).__name__}: {str(e)[:120]} | - |",
              flush=True)
        continue
      print(f"| {name} | {cname} | {ms:.4f} | {gbs(ms, moved):.0f} |", flush=True)
  program, operands = next(iter(programs.values()))
  xla_pass = jax.jit(lambda o: epilogue_pass(program, o, impl="xla"))
  ms, _ = common.time_kernels(xla_pass, operands, iterations=20)
  print(f"| XLA's fusion of the same program | - | {ms:.4f} | {gbs(ms):.0f} |")
  ms, _ = common.time_kernels(jax.jit(_xla_sum), *xla_args, iterations=20)
  print(f"| XLA's {xla_name} | - | {ms:.4f} | {gbs(ms):.0f} |")


if __name__ == "__main__":
  main()
