"""Where an epilogue pass's time goes (``coda_jax.epilogue_pass``: the GEMM kernel with
K = 0), at the Qwen3-1.7B QK-norm backward's shape (M = 16384, 16 q / 8 kv heads of 128).

    PYTHONPATH=. python -m bench.epilogue_pass

Times (CUPTI, median of 20, random normal inputs) the QK-norm backward program and
variants with a step removed, each under two configs, beside two bandwidth floors: the
pass kernel copying two tiles into one (``copy2``, with and without a column sum) and
XLA's fused ``a + b`` over the same bytes (3 x 134 MB). Prints a markdown table. Needs a
GPU."""
from __future__ import annotations

import dataclasses
import sys

import jax
import jax.numpy as jnp

from bench import common
from coda_jax import jnp_reference as R
from coda_jax import primitives as P
from coda_jax import qk_norm as Q
from coda_jax.epilogue_gemm import epilogue_pass
from pallas_kernels import EpilogueOutput, GemmConfig, OutputKind

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


def main():
  if jax.devices()[0].platform != "gpu":
    sys.exit("bench.epilogue_pass measures on the device: run it on the GPU host")
  n = (HQ + 2 * HKV) * HD
  ks = jax.random.split(jax.random.key(0), 3)
  dqkv = jax.random.normal(ks[0], (M, n), jnp.float32).astype(jnp.bfloat16)
  u = jax.random.normal(ks[1], (M, n), jnp.float32).astype(jnp.bfloat16)
  pos = jax.random.randint(ks[2], (M,), 0, 4096, jnp.int32)
  w, sel = Q.head_norm_columns(jnp.ones((HD,)), jnp.ones((HD,)), HQ, HKV)
  ops = {"dqkv": dqkv, "pos": pos, "neg_freqs": -R.qkv_freqs(HQ, HKV, HD, 1e6, None),
         "u": u, "qk_w": w, "qk_sel": sel}
  full = Q.backward_program(HD, 1e-6, jnp.bfloat16)
  norm_grad = full[2]
  no_rotate = {k: v for k, v in ops.items() if k not in ("pos", "neg_freqs")}
  programs = {
      "QK-norm backward": (full, ops),
      "without the weights' column sums": (
          [full[0], full[1], _WithoutNormGrads(**dataclasses.asdict(norm_grad)), full[3]],
          ops),
      "without RoPE^T": ([full[0], full[2], full[3]], no_rotate),
      "copy2": ([P.AddTile("dqkv"), P.AddTile("u"), P.Store("du")], {"dqkv": dqkv, "u": u}),
      "copy2 + column sum": ([P.AddTile("dqkv"), P.AddTile("u"), P.ColSum("c"),
                              P.Store("du")], {"dqkv": dqkv, "u": u}),
  }
  configs = {
      "64x128 in1": GemmConfig(tile_m=64, tile_n=128, epi_tile_n=128, cluster_dim=None,
                               stages=2, epi_operand_slots=1),
      "128x128": GemmConfig(tile_m=128, tile_n=128, epi_tile_n=128, cluster_dim=None,
                            stages=2)}
  gbs = lambda ms: 3 * M * n * 2 / ms / 1e6
  print(common.provenance())
  print("| program | config | ms | GB/s (3 x 134 MB) |\n|---|---|---|---|")
  for name, (program, operands) in programs.items():
    for cname, cfg in configs.items():
      fn = jax.jit(lambda o, p=program, c=cfg: epilogue_pass(p, o, impl="mosaic", config=c))
      ms, _ = common.time_kernels(fn, operands, iterations=20, only="coda_gemm")
      print(f"| {name} | {cname} | {ms:.4f} | {gbs(ms):.0f} |", flush=True)
  xla = jax.jit(lambda a, b: (a.astype(jnp.float32) + b.astype(jnp.float32)).astype(a.dtype))
  ms, _ = common.time_kernels(xla, dqkv, u, iterations=20)
  print(f"| XLA's a + b | - | {ms:.4f} | {gbs(ms):.0f} |")


if __name__ == "__main__":
  main()
