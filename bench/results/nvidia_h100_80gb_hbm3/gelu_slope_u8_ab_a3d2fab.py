"""A/B on the GPU: GPT-2's stored GELU slope in bf16 against the uint8 code, c_fc's
LayerNorm + GELU program and the MLP backward's first GEMM, each under its tuned config."""
import json, os, sys, time
import jax, jax.numpy as jnp, numpy as np
from bench import common, compare_configs as cc
from coda_jax import gemm_epilogue, layernorm_ops as L, primitives as P
bf16, u8 = jnp.bfloat16, jnp.uint8
M, F, D = 16384, 8192, 2048
ks = jax.random.split(jax.random.PRNGKey(0), 10)
h = jax.random.normal(ks[0], (M, D), bf16)
w1 = (jax.random.normal(ks[1], (D, F)) / np.sqrt(D)).astype(bf16)
mu = 0.1 * jax.random.normal(ks[2], (M,))
r = 1 + 0.1 * jax.random.uniform(ks[3], (M,))
gw = 0.01 * jax.random.normal(ks[4], (F,)); cw = 0.1 * jax.random.normal(ks[5], (F,))
dout = jax.random.normal(ks[6], (M, D), bf16)
w2 = (jax.random.normal(ks[7], (F, D)) / np.sqrt(F)).astype(bf16)
ops_f = L.norm_matmul_operands(mu, r, gw, cw)
def fwd_fn(dt):
  prog = L.norm_matmul_program([L.Gelu(slope="s", slope_dtype=dt), P.Store("a", bf16)])
  return jax.jit(lambda h, w1, ops: gemm_epilogue(h, w1, prog, ops, impl="mosaic"))
def bwd_fn(dt):
  prog = [L.slope_multiplier("s", dt), P.ColSum("db1"), P.Store("dz", bf16)]
  return jax.jit(lambda d, w, s: gemm_epilogue(d, w, prog, {"s": s}, trans_b=True, impl="mosaic"))
f16, f8 = fwd_fn(bf16), fwd_fn(u8)
o16, o8 = f16(h, w1, ops_f), f8(h, w1, ops_f)
# check: the code decodes to the bf16 slope within step/2 (+ bf16's own rounding)
dec = L.SLOPE_CODE_LO + L.SLOPE_CODE_STEP * o8["s"].astype(jnp.float32)
err = float(jnp.max(jnp.abs(dec - o16["s"].astype(jnp.float32))))
same_a = bool(jnp.all(o8["a"] == o16["a"]))
print(f"fwd: max |decoded code - bf16 slope| = {err:.5f} (step/2 {L.SLOPE_CODE_STEP/2:.5f} + bf16 ulp/2 <= 0.0039); a identical: {same_a}")
assert err < L.SLOPE_CODE_STEP / 2 + 0.0040 and same_a
b16, b8 = bwd_fn(bf16), bwd_fn(u8)
s16, s8 = o16["s"], o8["s"]
r16, r8 = b16(dout, w2, s16), b8(dout, w2, s8)
da = jnp.dot(dout.astype(jnp.float32), w2.astype(jnp.float32).T, precision="highest")
slope = jax.vmap(jax.vmap(jax.grad(lambda v: jax.nn.gelu(v, approximate=True))))(
    (jnp.dot(h.astype(jnp.float32), w1.astype(jnp.float32), precision="highest") * r[:, None]
     - (r * mu)[:, None] * gw[None, :] + cw[None, :]))
ref = da * slope
rel = lambda x: float(jnp.linalg.norm((x.astype(jnp.float32) - ref).ravel()) / jnp.linalg.norm(ref.ravel()))
db_ref = jnp.sum(ref, 0)
relb = lambda x: float(jnp.linalg.norm(x - db_ref) / jnp.linalg.norm(db_ref))
print(f"bwd dz rel err vs fp32: bf16 slope {rel(r16['dz']):.2e}, uint8 code {rel(r8['dz']):.2e}; db1: {relb(r16['db1']):.2e}, {relb(r8['db1']):.2e}")
del ref, da, slope
calls = {"fwd bf16 slope": lambda: f16(h, w1, ops_f), "fwd uint8 code": lambda: f8(h, w1, ops_f),
         "bwd bf16 slope": lambda: b16(dout, w2, s16), "bwd uint8 code": lambda: b8(dout, w2, s8)}
rows = {}
for name, fn in calls.items():
  args = {"fwd": (h, w1, ops_f), "bwd": (dout, w2, s16 if "bf16" in name else s8)}[name[:3]]
  f = {"fwd bf16 slope": f16, "fwd uint8 code": f8, "bwd bf16 slope": b16, "bwd uint8 code": b8}[name]
  rows[name] = {"cupti": [common.time_kernels(f, *args, iterations=30, only="coda_gemm")[0]]}
for name, fn in reversed(list(calls.items())):
  args = {"fwd": (h, w1, ops_f), "bwd": (dout, w2, s16 if "bf16" in name else s8)}[name[:3]]
  f = {"fwd bf16 slope": f16, "fwd uint8 code": f8, "bwd bf16 slope": b16, "bwd uint8 code": b8}[name]
  rows[name]["cupti"].append(common.time_kernels(f, *args, iterations=30, only="coda_gemm")[0])
for rnd in range(2):
  with common.PowerLog() as power:
    timed = cc.sustained_ms(calls, 2.0, power=power)
  for name, got in timed.items():
    rows[name].setdefault("sustained", []).append(got.ms)
    rows[name].setdefault("mJ", []).append(None if got.joules is None else got.joules * 1e3)
    rows[name].setdefault("mhz", []).append(got.mhz)
print(json.dumps(rows, indent=1))
print("| program | slope | CUPTI ms (2 rounds) | sustained ms (2 rounds, 2 s ABBA) | mJ per call | MHz |")
print("|---|---|---|---|---|---|")
for name, v in rows.items():
  f = lambda xs, p=4: ", ".join("-" if x is None else f"{x:.{p}f}" for x in xs)
  print(f"| {name[:3]} | {name[4:]} | {f(v['cupti'])} | {f(v['sustained'])} | {f(v['mJ'],1)} | {f(v['mhz'],0)} |")
for kind in ("fwd", "bwd"):
  a, b = rows[f"{kind} uint8 code"], rows[f"{kind} bf16 slope"]
  print(f"{kind}: uint8 / bf16: CUPTI {np.median(a['cupti'])/np.median(b['cupti']):.3f}, sustained {np.median(a['sustained'])/np.median(b['sustained']):.3f}"
        + ("" if None in a['mJ'] + b['mJ'] else f", energy {np.median(a['mJ'])/np.median(b['mJ']):.3f}"))
