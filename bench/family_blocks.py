"""GPT-2-style and Qwen3-style blocks: our fused shifted block vs jax.jit of the same
block written the standard way, forward and forward+backward, CUPTI kernel time.

    PYTHONPATH=. python -m bench.family_blocks [--shapes gpt2_1b,qwen3_1.7b] [--out DIR]

The "shifted block" is the part of a layer between two attentions, as ``bench.block``
times Llama's: the attention output y0 and residual x0 in, the next layer's QKV out:

* GPT-2 (LayerNorm, biases, GELU MLP; ``coda_jax.layernorm_ops``, composed as
  ``flax_layers.gpt2`` composes them):
  x1 = x0 + y0 @ Wo + bo; x2 = x1 + gelu(LN_2(x1) @ W1 + b1) @ W2 + b2;
  qkv = LN_1'(x2) @ Wqkv + bqkv. Ours, as the model runs it: the whole of it as one op,
  ``residual_layernorm_gelu_mlp(..., next_w=)`` (bias, residual and LN_2's statistics in
  the out-projection's epilogue; the MLP, whose output GEMM emits LN_1's statistics;
  LN_1 applied in the QKV GEMM's epilogue; both LayerNorms' input gradients each in one
  GEMM). ``--half-block one_op`` stops that op at the MLP (``next_norm``) and runs
  ``layernorm_matmul`` after it (GEMM + pass for LN_1's input gradient); ``two_ops`` also
  splits the out-projection from the MLP (``residual_layernorm``, then
  ``layernorm_gelu_mlp``: GEMM + pass for LN_2's too).
* Qwen3 (RMSNorm, SwiGLU, per-head q/k RMSNorm, RoPE): ``blocks.shifted_block`` with
  ``BlockConfig.qk_norm``.

Per shape: forward and forward+backward, ours vs XLA, next to the block's GEMMs alone
as plain ``jnp.dot`` under jit (the speed of light), and the compiled peak memory of the
forward+backward. Writes family_blocks.{json,md} to --out (default
bench/results/<device>/). Without a GPU: tiny shapes through the Mosaic GPU interpreter,
a correctness check whose times say nothing about GPU speed.
"""
from __future__ import annotations

import argparse
import functools
import tempfile
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp

from bench import block as B
from bench import common
from coda_jax import blocks
from coda_jax import layernorm_ops as L
from coda_jax import unfused

f32, bf16 = jnp.float32, jnp.bfloat16


class Shape(NamedTuple):
  family: str  # "gpt2" or "qwen3"
  m: int  # tokens
  d: int
  f: int
  n_q: int
  n_kv: int
  head_dim: int
  theta: float = 1e6
  eps: float = 1e-6

  @property
  def qkv_width(self):
    return (self.n_q + 2 * self.n_kv) * self.head_dim

  def as_llama(self) -> B.Shape:
    return B.Shape(self.m, self.d, self.f, self.n_q, self.n_kv, self.head_dim, 512)


SHAPES = {
    # GPT-2's block at Llama-3.2-1B's widths (GPT-2 XL's D=1600 does not tile by 128).
    "gpt2_1b": Shape("gpt2", 16384, 2048, 8192, 16, 16, 128, eps=1e-5),
    # Qwen3-1.7B: D 2048, F 6144, 16 q / 8 kv heads of 128, theta 1e6, eps 1e-6.
    "qwen3_1.7b": Shape("qwen3", 16384, 2048, 6144, 16, 8, 128),
    "gpt2_tiny": Shape("gpt2", 128, 128, 256, 2, 2, 64, eps=1e-5),  # CPU interpreter
    "qwen3_tiny": Shape("qwen3", 128, 128, 256, 4, 2, 32),
}


def gemm_mkn(s: Shape):
  """The shifted block's forward GEMMs as (M, K, N)."""
  up = s.f if s.family == "gpt2" else 2 * s.f
  return [(s.m, s.n_q * s.head_dim, s.d), (s.m, s.d, up), (s.m, s.f, s.d),
          (s.m, s.d, s.qkv_width)]


# ---- GPT-2 ---------------------------------------------------------------------------------
def gpt2_inputs(s: Shape, key):
  ks = iter(jax.random.split(key, 24))
  normal = lambda shape, scale=1.0, dt=bf16: (
      scale * jax.random.normal(next(ks), shape, f32)).astype(dt)
  weight = lambda k, n: normal((k, n), k ** -0.5)
  vec = lambda n, mean=0.0: mean + normal((n,), 0.1, f32)  # fp32, as the model's params
  p = dict(wo=weight(s.d, s.d), bo=vec(s.d), g_mlp=vec(s.d, 1.0), beta_mlp=vec(s.d),
           w1=weight(s.d, s.f), b1=vec(s.f), w2=weight(s.f, s.d), b2=vec(s.d),
           g_attn=vec(s.d, 1.0), beta_attn=vec(s.d), wqkv=weight(s.d, s.qkv_width),
           bqkv=vec(s.qkv_width))
  # a residual stream with a per-row mean offset, so LayerNorm's mean term matters
  x0 = normal((s.m, s.d)) + normal((s.m, 1), 0.5)
  return dict(x0=x0, y0=normal((s.m, s.n_q * s.head_dim)), params=p,
              cts=(normal((s.m, s.d)), normal((s.m, s.qkv_width))))


# Where the GPT-2 block's next LN_1 statistics come from (``--ln1-stats``): the MLP's
# output GEMM (``layernorm_gelu_mlp(next_norm=)``, as flax_layers.gpt2 runs it), or an XLA
# pass over the MLP's output (the unfused way, kept for comparison).
LN1_STATS = ("gemm", "xla")
# How the out-projection, the MLP and the next QKV run (``--half-block``): all as one op
# (``residual_layernorm_gelu_mlp(next_w=)``, as flax_layers.gpt2 runs them); the first two
# as one op, then ``layernorm_matmul``; or as three ops.
HALF_BLOCK = ("shifted_op", "one_op", "two_ops")


def gpt2_ours(s: Shape, impl, mlp_residuals=L.DEFAULT_MLP_RESIDUALS, ln1_stats="gemm",
              half_block=HALF_BLOCK[0]):
  if half_block == "shifted_op" and ln1_stats != "gemm":
    raise ValueError(f"half_block='shifted_op' makes LN_1's statistics inside its op: "
                     f"ln1_stats={ln1_stats!r} needs half_block 'one_op' or 'two_ops'")

  def block(x0, y0, p):
    if half_block != "two_ops":
      mlp = functools.partial(L.residual_layernorm_gelu_mlp, y0, p["wo"], x0, p["g_mlp"],
                              p["beta_mlp"], p["w1"], p["b1"], p["w2"], p["b2"],
                              proj_bias=p["bo"], eps=s.eps, impl=impl,
                              residuals=mlp_residuals)
      if half_block == "shifted_op":
        return mlp(next_norm=p["g_attn"], next_eps=s.eps, next_norm_bias=p["beta_attn"],
                   next_w=p["wqkv"], next_bias=p["bqkv"])
    else:
      x1, h1, mu1, r1 = L.residual_layernorm(y0, p["wo"], x0, p["g_mlp"], bias=p["bo"],
                                             eps=s.eps, impl=impl)
      mlp = functools.partial(L.layernorm_gelu_mlp, x1, h1, mu1, r1, p["g_mlp"],
                              p["beta_mlp"], p["w1"], p["b1"], p["w2"], p["b2"], impl=impl,
                              residuals=mlp_residuals)
    if ln1_stats == "gemm":
      x2, h2, mu2, r2 = mlp(next_norm=p["g_attn"], next_eps=s.eps)
    else:
      x2 = mlp()
      h2, mu2, r2 = unfused.layernorm_split(x2, p["g_attn"], s.eps)
    return x2, L.layernorm_matmul(h2, mu2, r2, p["g_attn"], p["beta_attn"], p["wqkv"],
                                  bias=p["bqkv"], impl=impl)
  return block


def gpt2_xla(s: Shape):
  """The block as a user writes it: LayerNorm with fp32 statistics, biases in the
  activations' dtype, GELU's tanh form."""
  def ln(x, g, beta):
    xf = x.astype(f32)
    mu = jnp.mean(xf, -1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mu), -1, keepdims=True)
    return ((xf - mu) * jax.lax.rsqrt(var + s.eps) * g + beta).astype(x.dtype)

  def block(x0, y0, p):
    dt = x0.dtype
    x1 = x0 + (y0 @ p["wo"] + p["bo"].astype(dt))
    a = jax.nn.gelu(ln(x1, p["g_mlp"], p["beta_mlp"]) @ p["w1"] + p["b1"].astype(dt),
                    approximate=True)
    x2 = x1 + (a @ p["w2"] + p["b2"].astype(dt))
    return x2, ln(x2, p["g_attn"], p["beta_attn"]) @ p["wqkv"] + p["bqkv"].astype(dt)
  return block


# ---- Qwen3 ---------------------------------------------------------------------------------
def qwen3_inputs(s: Shape, key):
  x = B.make_inputs(s.as_llama(), key)
  k1, k2 = jax.random.split(jax.random.fold_in(key, 5))
  norm = lambda k: 1 + 0.1 * jax.random.normal(k, (s.head_dim,), f32)
  p = dict(x["params"], g_q_norm=norm(k1), g_k_norm=norm(k2))
  return dict(x0=x["x0"], y0=x["y0"], positions=x["positions"], params=p, cts=x["cts"])


def qwen3_config(s: Shape, impl, mlp_residuals=blocks.MLP_RESIDUALS[0]):
  return blocks.BlockConfig(s.n_q, s.n_kv, s.head_dim, rope_theta=s.theta, eps=s.eps,
                            swiglu_block=B.BLOCK, qk_norm=True, impl=impl,
                            mlp_residuals=mlp_residuals)


def qwen3_xla(s: Shape):
  """Llama's standard block (``bench.block.xla_mlp``, ``rope``) with Qwen3's per-head
  RMSNorm of q and k (fp32 statistic, weight in the activations' dtype, as Hugging Face's
  Qwen3) before rotate-half RoPE."""
  def rms(x, g, width):
    xf = x.reshape(x.shape[0], -1, width).astype(f32)
    n = xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + s.eps)
    return (n.astype(x.dtype) * g.astype(x.dtype)).reshape(x.shape)

  def block(x0, y0, positions, p):
    x2, h2 = B.xla_mlp(x0, y0, p, p["g_attn"], s.eps)
    qkv = h2 @ p["wqkv"]
    nq, nk = s.n_q * s.head_dim, s.n_kv * s.head_dim
    rope = lambda x, g: B.rope(rms(x, g, s.head_dim), positions, s.head_dim, s.theta)
    return x2, jnp.concatenate([rope(qkv[:, :nq], p["g_q_norm"]),
                                rope(qkv[:, nq:nq + nk], p["g_k_norm"]), qkv[:, nq + nk:]], -1)
  return block


# ---- the table -----------------------------------------------------------------------------
QWEN3_STD_KEYS = ("wo", "g_mlp", "w_gate", "w_up", "w2", "g_attn", "wqkv", "g_q_norm",
                  "g_k_norm")


def inputs(s: Shape, key):
  """The block's arrays: activations, cotangents and both parameter layouts (``params``
  standard, ``mine`` ours; the conversion is load-time work, not timed). Traceable under
  ``jax.eval_shape`` (bench/tune_gemm.py)."""
  if s.family == "gpt2":
    x = gpt2_inputs(s, key)
    return dict(x, mine=x["params"])
  x = qwen3_inputs(s, key)
  std = {k: x["params"][k] for k in QWEN3_STD_KEYS}
  mine = dict(B.ours_params(std, blocks.SHIFTED_KEYS), g_q_norm=std["g_q_norm"],
              g_k_norm=std["g_k_norm"])
  return dict(x, params=std, mine=mine)


def cases(s: Shape, x, impl, mlp_residuals=None, ln1_stats="gemm", half_block=HALF_BLOCK[0]):
  """[(op, backward, ours, ours_args, xla, xla_args, to_std)] for the forward and the
  forward+backward of shape ``s``'s block on ``inputs(s, ...)``: what ``run_shape`` times
  and what tune_gemm traces. ``mlp_residuals``: GPT-2's ``layernorm_gelu_mlp``'s
  (``layernorm_ops.MLP_RESIDUALS``), or Qwen3's ``BlockConfig.mlp_residuals``
  (``blocks.MLP_RESIDUALS``); None, the family's default. ``ln1_stats``: one of
  ``LN1_STATS``; ``half_block``: one of ``HALF_BLOCK`` (both GPT-2's)."""
  if s.family == "gpt2":
    mlp_residuals = mlp_residuals or L.DEFAULT_MLP_RESIDUALS
    ours, xla = gpt2_ours(s, impl, mlp_residuals, ln1_stats, half_block), gpt2_xla(s)
    ours_args = xla_args = (x["x0"], x["y0"], x["params"])
    fwd_bwd = lambda block: lambda x0, y0, p, cts: jax.vjp(block, x0, y0, p)[1](cts)
    to_std = lambda t: t
  else:
    cfg = qwen3_config(s, impl, mlp_residuals or blocks.MLP_RESIDUALS[0])
    ours = lambda a, b, c, p: blocks.shifted_block(a, b, c, p, cfg)
    xla, fwd_bwd, to_std = qwen3_xla(s), B.fwd_bwd, B.grads_to_standard
    ours_args = (x["x0"], x["y0"], x["positions"], x["mine"])
    xla_args = (x["x0"], x["y0"], x["positions"], x["params"])
  op = f"{s.family}_block_fwd"
  return [(op, False, ours, ours_args, xla, xla_args, lambda t: t),
          (op + "_bwd", True, fwd_bwd(ours), (*ours_args, x["cts"]), fwd_bwd(xla),
           (*xla_args, x["cts"]), to_std)]


def run_shape(name, s: Shape, impl, measure, prov, key, rounds=1,
              mlp_residuals=(L.DEFAULT_MLP_RESIDUALS,), ln1_stats=(LN1_STATS[0],),
              half_block=(HALF_BLOCK[0],), gated_mlp_residuals=(blocks.MLP_RESIDUALS[0],)):
  """The rows of shape ``s``: its block's forward and forward+backward, for GPT-2 a pair
  per combination of ``mlp_residuals``, ``ln1_stats`` and ``half_block``, for Qwen3 a
  pair per entry of ``gated_mlp_residuals`` (``BlockConfig.mlp_residuals``); each row
  then names what varies."""
  x, gemm_key = inputs(s, key), jax.random.fold_in(key, 1)
  if s.family != "gpt2":  # Qwen3: its own MLP residuals, none of GPT-2's knobs
    mlp_residuals, ln1_stats, half_block = gated_mlp_residuals, ln1_stats[:1], half_block[:1]
  variants = [(keep, src, half) for keep in mlp_residuals for src in ln1_stats
              for half in half_block]

  def labels(keep, src, half):
    named = {}
    if len(mlp_residuals) > 1:
      named["mlp_residuals"] = keep
    if len(ln1_stats) > 1:
      named["ln1_stats"] = src
    if len(half_block) > 1:
      named["half_block"] = half
    return named or None

  return [B.compare_row(op, name, s._asdict(), measure, prov, impl, ours, ours_args, xla,
                        xla_args, to_std=to_std,
                        gemm_fns=B.gemms_of(gemm_mkn(s), backward, gemm_key), memory=backward,
                        rounds=rounds, labels=labels(keep, src, half))
          for keep, src, half in variants
          for op, backward, ours, ours_args, xla, xla_args, to_std in cases(
              s, x, impl, keep, src, half)]


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--shapes", default="gpt2_1b,qwen3_1.7b", help=f"comma-separated, of "
                 f"{list(SHAPES)}")
  p.add_argument("--out", type=Path, default=None,
                 help="output folder (default bench/results/<device>; a temp folder on CPU)")
  p.add_argument("--iterations", type=int, default=None, help="default 30 on GPU, 1 on CPU")
  p.add_argument("--impl", default=None, choices=("mosaic", "interpret", "xla"),
                 help="our ops' implementation (default: mosaic on a GPU, the interpreter "
                 "elsewhere; xla checks this harness in seconds)")
  p.add_argument("--rounds", type=int, default=1,
                 help="time ours and XLA alternately this many times each (ABBA) and "
                 "report the median ratio and its range (default 1)")
  p.add_argument("--mlp-residuals", default=L.DEFAULT_MLP_RESIDUALS,
                 help="GPT-2's MLP residuals (layernorm_gelu_mlp's residuals), comma-"
                 f"separated of {list(L.MLP_RESIDUALS)}: a pair of GPT-2 rows for each")
  p.add_argument("--gated-mlp-residuals", default=blocks.MLP_RESIDUALS[0],
                 help="Qwen3's MLP residuals (BlockConfig.mlp_residuals), comma-separated "
                 f"of {list(blocks.MLP_RESIDUALS)}: a pair of Qwen3 rows for each")
  p.add_argument("--ln1-stats", default=LN1_STATS[0],
                 help="where GPT-2's next LN_1 statistics come from, comma-separated of "
                 f"{list(LN1_STATS)} (the MLP's output GEMM, or an XLA pass): a pair of "
                 "GPT-2 rows for each")
  p.add_argument("--half-block", default=HALF_BLOCK[0],
                 help="how GPT-2's out-projection, MLP and next QKV run, comma-separated "
                 f"of {list(HALF_BLOCK)} (one op, whose backward forms both LayerNorms' "
                 "input gradients each in one GEMM; the first two as one op; three ops): "
                 "a pair of GPT-2 rows for each")
  p.add_argument("--sustained-s", type=float, default=None,
                 help="GPU: time each round by wall clock over this many seconds of "
                 "back-to-back calls (the power-capped steady state), with the GPU's "
                 "clock, power and energy per call, instead of CUPTI")
  args = p.parse_args()
  if args.sustained_s is not None and args.sustained_s <= 0:
    p.error(f"--sustained-s {args.sustained_s}: a positive number of seconds")
  mlp_residuals = tuple(args.mlp_residuals.split(","))
  if not mlp_residuals or any(v not in L.MLP_RESIDUALS for v in mlp_residuals):
    p.error(f"--mlp-residuals {args.mlp_residuals!r}: one or more of {list(L.MLP_RESIDUALS)}")
  gated = B.mlp_residuals_arg(p, "--gated-mlp-residuals", args.gated_mlp_residuals)
  ln1_stats = tuple(args.ln1_stats.split(","))
  if any(v not in LN1_STATS for v in ln1_stats):
    p.error(f"--ln1-stats {args.ln1_stats!r}: one or more of {list(LN1_STATS)}")
  half_block = tuple(args.half_block.split(","))
  if any(v not in HALF_BLOCK for v in half_block):
    p.error(f"--half-block {args.half_block!r}: one or more of {list(HALF_BLOCK)}")
  if "shifted_op" in half_block and "xla" in ln1_stats:
    p.error("--ln1-stats xla needs --half-block one_op or two_ops: the shifted op makes "
            "LN_1's statistics inside itself")
  on_gpu = jax.devices()[0].platform == "gpu"
  measure = B.timer(on_gpu, args.iterations or (30 if on_gpu else 1), args.sustained_s)
  names, impl = (args.shapes.split(","), "mosaic") if on_gpu else (
      ["gpt2_tiny", "qwen3_tiny"], "interpret")
  impl = args.impl or impl
  if not on_gpu:
    print(f"no GPU: tiny shapes, ours through impl={impl!r}; times are CPU wall clock and "
          "say nothing about GPU speed.")
    args.out = args.out or Path(tempfile.gettempdir()) / "coda_family_bench"
  prov = common.provenance()
  rows = []
  for i, name in enumerate(names):
    if name not in SHAPES:
      p.error(f"unknown shape {name!r}: one of {list(SHAPES)}")
    rows += run_shape(name, SHAPES[name], impl, measure, prov, jax.random.key(i),
                      args.rounds, mlp_residuals, ln1_stats, half_block, gated)
  md = B.markdown(rows, prov, on_gpu, title="GPT-2 and Qwen3 shifted blocks: ours vs "
                  "jax.jit of the standard block",
                  note="Shifted block: attention output and residual in, the next layer's "
                  "QKV out (attention itself is not timed). GEMMs alone: GPT-2 4 (out-proj, "
                  "c_fc, mlp_proj, qkv), Qwen3 4 (gate and up as one).",
                  sustained_s=args.sustained_s)
  out = common.write_results("family_blocks", rows, md, out=args.out)
  print(f"wrote {out / 'family_blocks.json'} and {out / 'family_blocks.md'}\n")
  print(md)


if __name__ == "__main__":
  main()
