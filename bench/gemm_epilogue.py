"""GEMM and GEMM-epilogue programs vs XLA, timed with CUPTI. GPU host only.

    PYTHONPATH=. python bench/gemm_epilogue.py            # all shapes and programs
    PYTHONPATH=. python bench/gemm_epilogue.py --shapes 16384x2048x2048 --programs plain

On a machine without a GPU it runs each program once through the CPU interpreter at a
small shape instead, and prints its difference from XLA. Shapes are M x K x N. Programs: plain GEMM vs ``a @ b``; four epilogue programs of a
Transformer block vs ``jax.jit`` of the same math written the way a user would (bf16
activations, fp32 reductions). Writes bench/results/<device>/gemm_epilogue.{json,md}
and, where matplotlib is installed, a PNG (else run bench/plot.py on the JSON).
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

import jax
import jax.numpy as jnp

import coda_jax as cj
from coda_jax import layout
from coda_jax import layernorm_ops as LN
from coda_jax import qk_norm as QN
from pallas_kernels import autotune
from bench import common

SHAPES = ((16384, 2048, 2048), (16384, 2048, 16384), (16384, 8192, 2048),
          (16384, 2048, 3072), (16384, 2048, 32768), (8192, 8192, 8192))
HEAD = 64  # RoPE head size; pair block 32
BLOCK = 32  # SwiGLU pair block


def make_inputs(m, k, n, key):
  ks = jax.random.split(key, 6)
  bf = jnp.bfloat16
  return dict(
      a=jax.random.normal(ks[0], (m, k), bf),
      b=(jax.random.normal(ks[1], (k, n), jnp.float32) / math.sqrt(k)).astype(bf),
      x0=jax.random.normal(ks[2], (m, n), bf),
      g=1 + 0.1 * jax.random.normal(ks[3], (n,), jnp.float32),
      r=jax.random.uniform(ks[4], (m,), jnp.float32, 0.5, 2.0),
      pos=jax.random.randint(ks[5], (m,), 0, 8192, jnp.int32),
      bias=0.1 * jax.random.normal(ks[3], (n,), jnp.float32),
      mu=0.1 * jax.random.normal(ks[4], (m,), jnp.float32),
  )


def with_blocked_weights(x):
  # Converted once, as a model would at load time: not part of the timed step.
  return dict(x, b_blocked=layout.gate_up_to_blocked(x["b"], BLOCK))


def programs(n):
  """name -> (ours(x), xla(x), output names compared)."""
  fr = layout.rope_freqs(n, HEAD, theta=500000.0)

  def run(program, **ops):
    return lambda x: cj.gemm_epilogue(x["a"], x["b"], program, {k: x[v] for k, v in ops.items()})

  def xla_resid(x):
    x1 = x["a"] @ x["b"] + x["x0"]
    x1f = x1.astype(jnp.float32)
    return {"x1": x1, "ss": jnp.sum(x1f * x1f, axis=-1), "h": (x1f * x["g"]).astype(jnp.bfloat16)}

  def xla_swiglu(x):
    z = ((x["a"] @ x["b"]).astype(jnp.float32) * x["r"][:, None]).astype(jnp.bfloat16)
    # standard layout: gate columns then up columns
    return {"y": jax.nn.silu(z[:, :n // 2]) * z[:, n // 2:]}

  def xla_rope(x):
    z = ((x["a"] @ x["b"]).astype(jnp.float32) * x["r"][:, None]).astype(jnp.bfloat16)
    z = z.reshape(z.shape[0], -1, HEAD).astype(jnp.float32)
    t = x["pos"].astype(jnp.float32)[:, None, None] * fr[None, None, :HEAD]
    rot = jnp.concatenate([-z[..., HEAD // 2:], z[..., :HEAD // 2]], axis=-1)
    return {"q": (z * jnp.cos(t) + rot * jnp.sin(t)).reshape(z.shape[0], -1).astype(jnp.bfloat16)}

  def xla_lse(x):
    z = (x["a"] @ x["b"]).astype(jnp.float32) * x["r"][:, None]
    return {"lse": jax.nn.logsumexp(z, axis=-1)}

  def xla_ln_stats(x):  # the producer half of a LayerNorm: x1, its row sums, x1 * g
    x1 = (x["a"] @ x["b"]).astype(jnp.float32) + x["bias"] + x["x0"].astype(jnp.float32)
    x1 = x1.astype(jnp.bfloat16)
    x1f = x1.astype(jnp.float32)
    return {"x1": x1, "s1": jnp.sum(x1f, axis=-1), "s2": jnp.sum(x1f * x1f, axis=-1),
            "h": (x1f * x["g"]).astype(jnp.bfloat16)}

  def xla_ln_consumer(x):  # r * acc - (r mu) (x) gw + cw
    acc = (x["a"] @ x["b"]).astype(jnp.float32)
    r = x["r"][:, None]
    return {"out": (r * acc - (r * x["mu"][:, None]) * x["g"][None] + x["bias"][None]
                    ).astype(jnp.bfloat16)}

  def xla_gelu(x):
    z = ((x["a"] @ x["b"]).astype(jnp.float32) + x["bias"]).astype(jnp.bfloat16)
    return {"z": z, "a": jax.nn.gelu(z, approximate=True)}

  def xla_qknorm_rope(x):
    u = ((x["a"] @ x["b"]).astype(jnp.float32) * x["r"][:, None]).astype(jnp.bfloat16)
    z = u.reshape(u.shape[0], -1, HEAD).astype(jnp.float32)
    z = z * jax.lax.rsqrt(jnp.mean(z * z, -1, keepdims=True) + 1e-6)
    z = z * x["g"].reshape(-1, HEAD)[None]
    t = x["pos"].astype(jnp.float32)[:, None, None] * fr[None, None, :HEAD]
    rot = jnp.concatenate([-z[..., HEAD // 2:], z[..., :HEAD // 2]], axis=-1)
    q = (z * jnp.cos(t) + rot * jnp.sin(t)).reshape(u.shape[0], -1).astype(jnp.bfloat16)
    return {"u": u, "qkv": q}

  return {
      "plain": (run([cj.Store("out")]), lambda x: {"out": x["a"] @ x["b"]}),
      "residual_sumsq_aux": (
          run([cj.AddTile("x0"), cj.Store("x1"), cj.RowSum("ss", square=True),
               cj.ScaleCol("g"), cj.Store("h")], x0="x0", g="g"), xla_resid),
      "rowscale_swiglu": (
          lambda x: cj.gemm_epilogue(x["a"], x["b_blocked"], [cj.ScaleRow("r"), cj.Gated(BLOCK), cj.Store("y")],
                                     {"r": x["r"]}), xla_swiglu),
      "rowscale_rope": (
          lambda x: cj.gemm_epilogue(x["a"], x["b"], [cj.ScaleRow("r"), cj.Rotate("pos", "fr", HEAD // 2), cj.Store("q")],
                                     {"r": x["r"], "pos": x["pos"], "fr": fr}), xla_rope),
      "rowscale_lse": (run([cj.ScaleRow("r"), cj.RowLogSumExp("lse")], r="r"), xla_lse),
      # issue 13: GPT-2 / Qwen3 epilogues
      "bias_layernorm_stats": (
          run([cj.AddBias("bias"), cj.AddTile("x0"), cj.RowSum("s1"),
               cj.RowSum("s2", square=True), cj.Store("x1"), cj.ScaleCol("g"), cj.Store("h")],
              bias="bias", x0="x0", g="g"), xla_ln_stats),
      "layernorm_consumer": (
          lambda x: cj.gemm_epilogue(x["a"], x["b"], LN.norm_matmul_program([cj.Store("out")]),
                                     LN.norm_matmul_operands(x["mu"], x["r"], x["g"], x["bias"])),
          xla_ln_consumer),
      "bias_gelu": (run([cj.AddBias("bias"), cj.Store("z"), cj.Gelu(), cj.Store("a")],
                        bias="bias"), xla_gelu),
      "qknorm_rope": (
          lambda x: cj.gemm_epilogue(x["a"], x["b"], QN.forward_program(HEAD, 1e-6, jnp.bfloat16),
                                     {"r": x["r"], "pos": x["pos"], "freqs": fr, "qk_w": x["g"],
                                      "qk_sel": jnp.ones((n,), jnp.float32)}), xla_qknorm_rope),
  }


def cpu_demo(m=256, k=128, n=512):
  """No GPU: run every program once through the Mosaic GPU interpreter (the real kernel,
  emulated) and compare with XLA. Times here say nothing about GPU speed."""
  import os
  import time
  os.environ.setdefault("CODA_JAX_IMPL", "interpret")
  print(f"no GPU: running each program through the Mosaic GPU interpreter at "
        f"M x K x N = {m}x{k}x{n} against jax.jit of the same math (XLA on CPU).")
  x = with_blocked_weights(make_inputs(m, k, n, jax.random.key(0)))
  print("| program | max rel diff vs XLA | interpreter wall s |\n|---|---|---|")
  for name, (ours_fn, xla_fn) in programs(n).items():
    t0 = time.perf_counter()
    got = ours_fn(x)
    jax.block_until_ready(got)
    wall = time.perf_counter() - t0
    want = xla_fn(x)
    err = max(float(jnp.linalg.norm(got[o].astype(jnp.float32) - want[o].astype(jnp.float32))
                    / jnp.linalg.norm(want[o].astype(jnp.float32))) for o in want)
    print(f"| {name} | {err:.1e} | {wall:.1f} |", flush=True)


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--shapes", default=",".join("x".join(map(str, s)) for s in SHAPES))
  p.add_argument("--programs", default="all")
  p.add_argument("--iterations", type=int, default=30)
  p.add_argument("--out", type=Path, default=None, help="default bench/results/<device>/")
  args = p.parse_args()
  if jax.devices()[0].platform != "gpu":
    cpu_demo()
    return
  shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
  prov = common.provenance()
  rows = []
  for si, (m, k, n) in enumerate(shapes):
    x = with_blocked_weights(make_inputs(m, k, n, jax.random.key(si)))
    progs = programs(n)
    names = list(progs) if args.programs == "all" else args.programs.split(",")
    plain_ms = None
    for name in names:
      ours_fn, xla_fn = progs[name]
      try:
        ours_ms, ours_k = common.time_kernels(ours_fn, x, iterations=args.iterations)
      except Exception as e:  # a failing program is reported in the table, not fatal
        msg = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        print(f"{name:20s} {m}x{k}x{n}: FAILED {msg}", flush=True)
        rows.append(dict(op=name, shape=[m, k, n], ours_ms=None, baseline="xla_jit",
                         baseline_ms=None, error=msg, **prov))
        continue
      xla_ms, xla_k = common.time_kernels(xla_fn, x, iterations=args.iterations)
      got, want = jax.jit(ours_fn)(x), jax.jit(xla_fn)(x)
      # Fused reductions: the eager form made fp32 copies of 1 GiB outputs and ran out of
      # memory at 16384x2048x32768.
      err = common.rel_diff({o: got[o] for o in want}, want)
      del got, want
      configs = autotune.describe_workload(ours_fn, x)
      if name == "plain":
        plain_ms = ours_ms
      row = dict(op=name, shape=[m, k, n], ours_ms=round(ours_ms, 5), baseline="xla_jit",
                 baseline_ms=round(xla_ms, 5), speedup_vs_baseline=round(xla_ms / ours_ms, 4),
                 ours_vs_our_plain_gemm=round(ours_ms / plain_ms, 4) if plain_ms else None,
                 rel_diff_vs_baseline=err, ours_kernels=ours_k, baseline_kernels=xla_k,
                 configs=configs, **prov)
      rows.append(row)
      print(f"{name:20s} {m}x{k}x{n}: ours {ours_ms:.4f} ms, xla {xla_ms:.4f} ms, "
            f"x{xla_ms / ours_ms:.3f}, vs our GEMM {row['ours_vs_our_plain_gemm']}, "
            f"rel diff {err:.1e}; {'; '.join(configs)}", flush=True)
  md = ["# GEMM-epilogue programs vs XLA", "",
        f"device: {prov['device']}; jax {prov['jax_version']}; commit {prov['commit']}",
        f"command: `{prov['command']}`", "",
        "| op | M x K x N | ours ms | XLA ms | XLA/ours | ours / our plain GEMM | config |",
        "|---|---|---|---|---|---|---|"]
  for r in rows:
    if r["ours_ms"] is None:
      md.append(f"| {r['op']} | {'x'.join(map(str, r['shape']))} | failed: {r['error']} | | | | |")
      continue
    md.append(f"| {r['op']} | {'x'.join(map(str, r['shape']))} | {r['ours_ms']:.4f} | "
              f"{r['baseline_ms']:.4f} | {r['speedup_vs_baseline']:.3f} | "
              f"{r['ours_vs_our_plain_gemm'] if r['ours_vs_our_plain_gemm'] else '-'} | "
              f"{'<br>'.join(c.split(': ', 1)[1] for c in r['configs'])} |")
  plain = [r["speedup_vs_baseline"] for r in rows if r["op"] == "plain" and r["ours_ms"]]
  if plain:
    gm = math.exp(sum(math.log(v) for v in plain) / len(plain))
    md += ["", f"plain GEMM speed vs XLA: geometric mean {gm:.3f}, min {min(plain):.3f}"]
  out = common.write_results("gemm_epilogue", rows, "\n".join(md) + "\n", out=args.out)
  try:
    from bench import plot
    plot.plot(out / "gemm_epilogue.json")
  except ImportError as e:
    print(f"no PNG ({e}); run: python bench/plot.py {out / 'gemm_epilogue.json'}")
  print("\n".join(md))


if __name__ == "__main__":
  main()
