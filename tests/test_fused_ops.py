"""The fused Transformer ops (coda_jax.fused_ops): outputs and gradients against
jax.grad of the pure-jnp reference. Truth: the reference on fp32 inputs at HIGHEST
precision. Bound: twice the error of the same reference run unfused in the activation
dtype (tests/helpers.assert_within_baseline), overall and per row.

Sizes: the op table runs with D, K, F, Hq * head_dim and V all different (a backward that
uses one where another belongs cannot pass), and inputs at realistic scales: the residual
stream and the rows behind (h, r) have per-row std in [5, 50] (helpers.spread_rows), so
r = 1/rms is far from 1. The cross-entropy's own cases are in test_losses.py."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coda_jax import block_gemms as S
from coda_jax import fused_ops as F
from coda_jax import jnp_reference as R
from coda_jax import epilogue_gemm as O
from helpers import (assert_within_baseline, f32_tree, normal, projected, rel_err, spread_rows,
                     worst_row_err)

HEADS = dict(n_q_heads=4, n_kv_heads=2, head_dim=32)  # Hq * head_dim = 128
QKV = (4 + 2 * 2) * 32
# M rows; D model width; K the input width of residual_rmsnorm's GEMM; F the FFN width;
# V the vocabulary. All distinct, all multiples of 64 (the kernels' tiles); (K, D) must
# tile the weight-gradient GEMM too (K = 64 or 320 with D = 192 does not).
M, D, K, FF, V = 128, 192, 256, 320, 384
EPS = 1e-5


def _inputs(key, m, d, k, f, v, dt):
  """Inputs of every op. ``res`` is a residual stream (per-row std 5-50); (h, r) are
  what residual_rmsnorm hands on for another such stream: h = x * g, r = 1/rms(x)."""
  ks = jax.random.split(key, 10)
  g = 1 + 0.1 * normal(ks[3], (d,))
  xs = spread_rows(ks[4], (m, d))
  return dict(
      y=normal(ks[0], (m, k), dt), w=normal(ks[1], (k, d), dt) * k ** -0.5,
      res=spread_rows(ks[2], (m, d), dt), g=g,
      h=(xs * g).astype(dt), r=R.rms_scale(xs, EPS),
      w13=normal(ks[6], (d, 2 * f), dt) * d ** -0.5,
      wqkv=normal(ks[7], (d, QKV), dt) * d ** -0.5,
      wlm=normal(ks[8], (d, v), dt) * d ** -0.5,
      pos=jnp.arange(m, dtype=jnp.int32) % 37 + 1000,  # packed sequences, late positions
      tgt=jax.random.randint(ks[9], (m,), 0, v).at[1::7].set(-100))  # row 0 counts (M=1)


def _residual_cts(key, truth, x):
  """Cotangents of (x, h, r) whose three paths into dy / dres have the same order: the
  r path adds -(dr r^3 / D) x per row, of norm |dr| r^2 / sqrt(D), so dr ~ D / r^2 (r
  of the fp32 truth) matches the sqrt(D) norm of the unit-normal dx and dh."""
  ks = jax.random.split(key, 3)
  _, _, r = truth
  d = truth[0].shape[-1]
  return [normal(ks[0], truth[0].shape), normal(ks[1], truth[1].shape),
          normal(ks[2], r.shape) * d / r ** 2]


def _composed(norm_op, tail):
  """residual_rmsnorm feeding the (h, r) op ``tail``: returns (x, tail's output)."""
  def fn(x, impl=None):
    kw = {} if impl is None else dict(impl=impl)
    xo, h, r = norm_op(x["y"], x["w"], x["res"], x["g"], **kw)
    return xo, tail(x, h, r, kw)
  return fn


_swiglu_tail = lambda mod: lambda x, h, r, kw: mod.rmsnorm_swiglu(h, r, x["w13"], **kw)
_qkv_tail = lambda mod: lambda x, h, r, kw: mod.rmsnorm_qkv_rope(h, r, x["wqkv"], x["pos"],
                                                                 **HEADS, **kw)

# op name -> (fused(x, impl), reference(x), differentiable input names[, cotangents])
OPS = {
    "residual_rmsnorm": (
        lambda x, impl: F.residual_rmsnorm(x["y"], x["w"], x["res"], x["g"], impl=impl),
        lambda x: R.residual_rmsnorm(x["y"], x["w"], x["res"], x["g"]),
        ("y", "w", "res", "g"), _residual_cts),
    "residual_matmul": (
        lambda x, impl: F.residual_matmul(x["y"], x["w"], x["res"], impl=impl),
        lambda x: R.residual_matmul(x["y"], x["w"], x["res"]),
        ("y", "w", "res")),
    "rmsnorm_swiglu": (
        lambda x, impl: F.rmsnorm_swiglu(x["h"], x["r"], x["w13"], impl=impl),
        lambda x: R.rmsnorm_swiglu(x["h"], x["r"], x["w13"]),
        ("h", "r", "w13")),
    "rmsnorm_geglu": (
        lambda x, impl: F.rmsnorm_swiglu(x["h"], x["r"], x["w13"], activation="gelu",
                                         impl=impl),
        lambda x: R.rmsnorm_swiglu(x["h"], x["r"], x["w13"], activation="gelu"),
        ("h", "r", "w13")),
    "rmsnorm_qkv_rope": (
        lambda x, impl: F.rmsnorm_qkv_rope(x["h"], x["r"], x["wqkv"], x["pos"], **HEADS,
                                           impl=impl),
        lambda x: R.rmsnorm_qkv_rope(x["h"], x["r"], x["wqkv"], x["pos"], **HEADS),
        ("h", "r", "wqkv")),
    "rmsnorm_lm_head_loss": (
        lambda x, impl: F.rmsnorm_lm_head_loss(x["h"], x["r"], x["wlm"], x["tgt"], impl=impl),
        lambda x: R.rmsnorm_lm_head_loss(x["h"], x["r"], x["wlm"], x["tgt"]),
        ("h", "r", "wlm")),
    # jax.grad through the composition is the whole RMSNorm backward (x, h and r of the
    # first op all feed the second), w.r.t. every input of both.
    "composed_norm_swiglu": (
        _composed(F.residual_rmsnorm, _swiglu_tail(F)),
        _composed(R.residual_rmsnorm, _swiglu_tail(R)),
        ("y", "w", "res", "g", "w13")),
    "composed_norm_qkv_rope": (
        _composed(F.residual_rmsnorm, _qkv_tail(F)),
        _composed(R.residual_rmsnorm, _qkv_tail(R)),
        ("y", "w", "res", "g", "wqkv")),
}
SINGLE_OPS = [n for n in OPS if not n.startswith("composed") and n != "rmsnorm_geglu"]


def max_rel_err(got, truth):
  """Largest per-element relative error of a positive vector (r = 1/rms spans 10x across
  rows: helpers.worst_row_err, taken against the largest element, would dilute a wrong
  small r)."""
  got, truth = np.asarray(got, np.float64), np.asarray(truth, np.float64)
  assert np.all(truth > 0)
  return float(np.max(np.abs(got - truth) / truth))


def assert_rows_within_baseline(got, truth, base, what):
  """The tolerance rule per element, for a positive per-row statistic such as r."""
  e, e_base = max_rel_err(got, truth), max_rel_err(base, truth)
  assert e <= 2 * e_base + 1e-6, f"{what}: max rel err {e:.3g} > 2 x unfused {e_base:.3g}"


def check_op(name, x, impl, wrap=lambda f: f, key=None):
  """Runs op ``name`` (through ``wrap``, e.g. jax.checkpoint) forward and backward under
  jit and checks outputs and input gradients against the fp32 truth under the tolerance
  rule. Returns (got, truth, baseline) outputs."""
  fused, reference, names, *make_cts = OPS[name]
  key = jax.random.key(0) if key is None else key
  diff = {k: x[k] for k in names}
  rest = {k: v for k, v in x.items() if k not in names}
  with jax.default_matmul_precision("highest"):  # jit: one compile (the baseline stays
    truth = jax.jit(reference)(f32_tree(x))             # eager, op by op, as unfused XLA runs)
  if make_cts:
    cts = make_cts[0](key, jax.tree.leaves(truth), x)
  else:
    cts = [normal(jax.random.fold_in(key, i), o.shape)
           for i, o in enumerate(jax.tree.leaves(truth))]
  with jax.default_matmul_precision("highest"):
    g_truth = jax.jit(jax.grad(projected(reference, cts)))(f32_tree(diff), f32_tree(rest))
  base, g_base = reference(x), jax.grad(projected(reference, cts))(diff, rest)
  op = wrap(lambda z: fused(z, impl))
  run = jax.jit(lambda d, r: (op({**r, **d}), jax.grad(projected(op, cts))(d, r)))
  got, g_got = run(diff, rest)
  for i, (a, t, b) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(truth),
                                    jax.tree.leaves(base))):
    assert a.shape == t.shape and a.dtype == b.dtype, (name, i, a.shape, a.dtype)
    if a.ndim == 0:  # a loss: compare as a 1-element row
      a, t, b = a[None], t[None], b[None]
    assert_within_baseline(a, t, b, f"{name} output {i}")
    if a.ndim == 1 and np.all(np.asarray(t) > 0):  # r
      assert_rows_within_baseline(a, t, b, f"{name} output {i}")
  for k in names:
    assert g_got[k].dtype == x[k].dtype, (k, g_got[k].dtype)
    assert_within_baseline(g_got[k], g_truth[k], g_base[k], f"{name} d{k}")
  return got, truth, base


@pytest.mark.parametrize("name", list(OPS))
def test_op_and_grads_bf16(name, key, kernel_impl):
  """Every op (and the two compositions of the block) forward and backward, with D, K,
  F, Hq * head_dim, V distinct and realistic residual-stream scales."""
  check_op(name, _inputs(key, M, D, K, FF, V, jnp.bfloat16), kernel_impl, key=key)


@pytest.mark.parametrize("name", ["rmsnorm_swiglu", "rmsnorm_lm_head_loss"])
def test_op_and_grads_fp16_odd_sizes(name, key, kernel_impl):
  """fp16 activations; M = 192 and V = 384 are not multiples of the default 256-row /
  256-column cluster tile: the config falls back to smaller tiles."""
  check_op(name, _inputs(key, 192, 128, 64, 128, 384, jnp.float16), kernel_impl, key=key)


@pytest.mark.parametrize("m", [1, 63, 65, 300, 200, 4000])
@pytest.mark.parametrize("name", ["residual_rmsnorm", "rmsnorm_swiglu", "rmsnorm_qkv_rope",
                                  "rmsnorm_lm_head_loss"])
def test_token_counts_that_do_not_tile(name, m, key, kernel_impl):
  """M = 1, 63, 65, 300 token rows: the kernels run on zero-padded rows (the forward's
  rows, the weight gradients' contraction); M = 200 and 4000 on the GPU unpadded, TMA
  clipping the last row of tiles (``pallas_kernels.gemm``'s ``clip_m``; the weight
  gradients' contraction is padded to 256). Outputs and gradients meet the tolerance
  rule. ``impl`` names the kernel alone, so a call that could not run it would raise
  rather than fall back to XLA."""
  # (M = 4000's 32 rows of tiles a GEMM would also add minutes to the CPU suite.)
  if m in (200, 4000) and kernel_impl == "interpret":
    pytest.skip(f"M = {m} on the GPU only: it is here for TMA's clipping of the last row "
                "of tiles, which only the compiled kernel does; the interpreter pads it, "
                "the path M = 65 and 300 take")
  check_op(name, _inputs(key, m, D, K, FF, V, jnp.bfloat16), kernel_impl, key=key)


def _rope_truth_f64(x, heads, theta=500000.0):
  """RoPE(r * (h @ wqkv)) in float64 numpy with exact angles pos * theta^(-2j / hd):
  independent of the library's fp32 frequencies and of any range reduction."""
  hd, p = heads["head_dim"], heads["head_dim"] // 2
  z = (np.asarray(x["h"], np.float64) @ np.asarray(x["wqkv"], np.float64)
       * np.asarray(x["r"], np.float64)[:, None])
  z4 = z.reshape(z.shape[0], -1, 2, p)  # (M, heads, [first, second half], p)
  n_rot = heads["n_q_heads"] + heads["n_kv_heads"]
  t = np.asarray(x["pos"], np.float64)[:, None, None] * theta ** (-2.0 * np.arange(p) / hd)
  cos, sin = np.cos(t), np.sin(t)
  a, b = z4[:, :n_rot, 0], z4[:, :n_rot, 1]
  out = z4.copy()
  out[:, :n_rot, 0], out[:, :n_rot, 1] = a * cos - b * sin, b * cos + a * sin
  return out.reshape(z.shape)


def test_rope_long_positions(key, kernel_impl):
  """Positions 8192..131072 (long context): the kernel range-reduces the fp32 angle
  before its sin/cos. Output within 2x the unfused bf16 error against an fp64 RoPE with
  exact angles, and against the fp32 reference; gradients against jax.grad of it."""
  x = _inputs(key, M, D, K, FF, V, jnp.bfloat16)
  x["pos"] = jnp.linspace(8192, 131072, M).astype(jnp.int32)
  assert int(x["pos"][0]) == 8192 and int(x["pos"][-1]) == 131072
  got, _, base = check_op("rmsnorm_qkv_rope", x, kernel_impl, key=key)
  assert_within_baseline(got, _rope_truth_f64(x, HEADS), base, "qkv vs fp64 RoPE")


@pytest.mark.parametrize("m,head_dim", [(256, 64), (100, 128), (1, 64)])
def test_rope_backward_pass_against_vjp(key, kernel_impl, races_checked, m, head_dim):
  """B1 as an epilogue pass (``block_gemms.rope_grad``: RowDot, RoPE^T, no GEMM) against
  ``jax.vjp`` of the forward RoPE in fp32: dz under the tolerance rule (baseline: the
  program run unfused in bf16), c = <dqkv, qkv> / D against fp32 sums of the same
  inputs. M = 100 and 1 leave rows padded onto the tile (they must not reach c). Under
  the race detector when interpreted."""
  hq, hkv, d = 2, 1, 320
  n = (hq + 2 * hkv) * head_dim
  ks = jax.random.split(key, 3)
  qkv = normal(ks[0], (m, n), jnp.bfloat16)
  dqkv = normal(ks[1], (m, n), jnp.bfloat16)
  pos = jax.random.randint(ks[2], (m,), 0, 8192, jnp.int32)
  freqs = R.qkv_freqs(hq, hkv, head_dim, 5e5, None)
  _, vjp = jax.vjp(lambda z: R.rotate(z, pos, freqs, head_dim // 2),
                   jnp.zeros((m, n), jnp.float32))
  dz_t, = vjp(dqkv.astype(jnp.float32))
  c_t = jnp.sum(dqkv.astype(jnp.float32) * qkv.astype(jnp.float32), axis=1) / d
  dz, c = S.rope_grad(dqkv, qkv, pos, freqs, head_dim, d, kernel_impl)
  program = S.rope_backward_program(head_dim, jnp.bfloat16)
  ops = {"dqkv": dqkv, "qkv": qkv, "pos": pos, "neg_freqs": -freqs}
  unfused = O.reference(dqkv[:, :0], dqkv[:0, :], program, ops, round_to=jnp.bfloat16)
  assert dz.dtype == jnp.bfloat16 and dz.shape == (m, n) and c.shape == (m,)
  assert_within_baseline(dz, dz_t, unfused["dz"], "dz")
  e = rel_err(c, c_t)
  assert e < 1e-5, f"c: rel err {e:.3g}"
  assert not races_checked.races_found(), "data race in the kernel (see stdout)"


# ---- fp16 range: what the fp32 epilogue buys, and what it cannot -------------------------
def test_fp16_swiglu_gemm_past_fp16_range(key, kernel_impl):
  """fp16 rmsnorm_swiglu with h at a residual scale (row rms 2e3-8e3) where h @ w13
  exceeds 65504 in many entries: the unfused fp16 graph rounds that product to inf before
  the row scale r (its output is inf/NaN); OURS scales by r in the fp32 epilogue, so its
  output and gradients are finite and as accurate as the unfused fp16 graph run at a
  scale that does not overflow (h / s, r * s, exact for s a power of 2)."""
  ks = jax.random.split(key, 3)
  xs = spread_rows(ks[0], (M, D), lo=2000, hi=8000)
  dt, s = jnp.float16, 4096.0
  h, r = xs.astype(dt), R.rms_scale(xs, EPS)
  w13 = normal(ks[1], (D, 2 * FF), dt)
  acc = np.asarray(h, np.float64) @ np.asarray(w13, np.float64)
  assert np.mean(np.abs(acc) > 65504) > 0.05  # the premise: the GEMM leaves fp16's range
  unfused = R.rmsnorm_swiglu(h, r, w13)
  assert not np.all(np.isfinite(np.asarray(unfused, np.float32)))
  ct = normal(ks[2], (M, FF))
  loss = lambda fn: lambda h, r, w: jnp.sum(fn(h, r, w).astype(jnp.float32) * ct)
  fused = lambda h, r, w: F.rmsnorm_swiglu(h, r, w, impl=kernel_impl)
  got, grads = jax.jit(lambda *a: (fused(*a), jax.grad(loss(fused), (0, 1, 2))(*a)))(h, r, w13)
  with jax.default_matmul_precision("highest"):
    truth = R.rmsnorm_swiglu(*f32_tree((h, r, w13)))
    g_truth = jax.grad(loss(R.rmsnorm_swiglu), (0, 1, 2))(*f32_tree((h, r, w13)))
  hs = (h.astype(jnp.float32) / s).astype(dt)
  base = R.rmsnorm_swiglu(hs, r * s, w13)
  gb = jax.grad(loss(R.rmsnorm_swiglu), (0, 1, 2))(hs, r * s, w13)
  g_base = (gb[0].astype(jnp.float32) / s, gb[1] * s, gb[2])  # back to (h, r) scale
  assert got.dtype == dt
  assert_within_baseline(got, truth, base, "y")
  for nm, a, t, b in zip(("dh", "dr", "dw13"), grads, g_truth, g_base):
    assert_within_baseline(a, t, b, nm)


def test_fp16_residual_past_fp16_range(key, kernel_impl):
  """fp16 residual_rmsnorm. Rows 8..: y @ w exceeds 65504 but the residual brings x back
  into range: the unfused fp16 graph's x is inf there, OURS adds the residual to the fp32
  accumulator and its x, h and r are finite and accurate. Rows 0..7: x itself exceeds
  65504: OURS stores inf in x and h (an fp16 output cannot hold it; nothing clamps or
  hides it) exactly where the fp32 truth is out of range, while r, taken from the fp32
  accumulator, stays finite and accurate (the unfused graph's r is 0 there)."""
  ks = jax.random.split(key, 4)
  dt, s, k = jnp.float16, 4.0, 64
  y = normal(ks[0], (M, k), dt)
  w = normal(ks[1], (k, D), dt) * 3072.0  # |y @ w| ~ 2.5e4 std: past 65504 often
  yw = np.asarray(y, np.float64) @ np.asarray(w, np.float64)
  res = np.clip(-yw, -60000, 60000) + 100 * np.asarray(normal(ks[2], (M, D)))
  res[:8] = 60000.0 * np.sign(yw[:8]) * (np.abs(yw[:8]) > 20000)  # x > 65504 where |yw| > 2e4
  res = jnp.asarray(res, dt)
  g = 1 + 0.1 * normal(ks[3], (D,))
  with jax.default_matmul_precision("highest"):
    truth = R.residual_rmsnorm(*f32_tree((y, w, res)), g)
  over = np.abs(np.asarray(truth[0])) >= 65520  # rounds to inf in fp16
  assert over[:8].any() and not over[8:].any() and np.all(np.isfinite(truth[0]))
  assert (np.abs(yw[8:]) > 65504).any()
  unfused = R.residual_rmsnorm(y, w, res, g)
  assert not np.all(np.isfinite(np.asarray(unfused[0][8:], np.float32)))
  assert np.all(np.asarray(unfused[2][:8])[over[:8].any(1)] == 0)
  x, h, r = jax.jit(functools.partial(F.residual_rmsnorm, impl=kernel_impl))(y, w, res, g)
  x_np, h_np = np.asarray(x, np.float32), np.asarray(h, np.float32)
  assert np.array_equal(np.isinf(x_np), over), "x: inf exactly where out of fp16 range"
  assert np.array_equal(np.isinf(h_np), np.abs(np.asarray(truth[1])) >= 65520)
  assert np.all(np.isfinite(np.asarray(r)))
  base = R.residual_rmsnorm(y, w * (1 / s), (res.astype(jnp.float32) / s).astype(dt), g)
  base = (base[0].astype(jnp.float32) * s, base[1].astype(jnp.float32) * s, base[2] / s)
  for nm, a, t, b in zip("xh", (x, h), truth, base):
    assert_within_baseline(a[8:], t[8:], b[8:], nm)
  assert_within_baseline(r, truth[2], base[2], "r")
  assert_rows_within_baseline(r, truth[2], base[2], "r")


@pytest.mark.parametrize("name", list(OPS))
def test_float32_activations(name, key, monkeypatch):
  """float32 activations and weights (the kernels take 16-bit only: impl="auto" runs the
  XLA path, as on a GPU): outputs and gradients stay float32 and match the fp32 truth to
  1e-5, overall and per row (a 16-bit rounding anywhere on the path would be ~1e-3).
  Positions < 37: an fp32 RoPE angle pos * freq is itself rounded to ~ulp(pos) rad, and
  the epilogue's range reduction rounds as much again (~3e-5 at position 1000)."""
  monkeypatch.delenv("CODA_JAX_IMPL", raising=False)
  fused, reference, names, *_ = OPS[name]
  x = _inputs(key, M, D, K, FF, V, jnp.float32)
  x["pos"] = x["pos"] - 1000
  diff = {k: x[k] for k in names}
  rest = {k: v for k, v in x.items() if k not in names}
  with jax.default_matmul_precision("highest"):
    truth = reference(x)
    cts = [normal(jax.random.fold_in(key, i), o.shape)
           for i, o in enumerate(jax.tree.leaves(truth))]
    g_truth = jax.grad(projected(reference, cts))(diff, rest)
  op = lambda z: fused(z, "auto")
  got, g_got = jax.jit(lambda d, r: (op({**r, **d}), jax.grad(projected(op, cts))(d, r)))(
      diff, rest)
  pairs = [(f"output {i}", a, t) for i, (a, t) in
           enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(truth)))]
  pairs += [(f"d{k}", g_got[k], g_truth[k]) for k in names]
  for what, a, t in pairs:
    assert a.dtype == jnp.float32, (what, a.dtype)
    a, t = jnp.atleast_1d(a), jnp.atleast_1d(t)
    assert rel_err(a, t) < 1e-5 and worst_row_err(a, t) < 1e-5, (
        what, rel_err(a, t), worst_row_err(a, t))


def test_fp32_parameters_keep_their_dtype(key, kernel_impl):
  """fp32 weights with bf16 activations: the weight gradient comes back fp32, equals the
  bf16-weight run's up to bf16 storage, and is within 2x the unfused bf16 graph's error
  (same fp32 weights, cast to bf16 for the GEMM) against the fp32 truth."""
  x = _inputs(key, 128, 128, 64, 64, 128, jnp.bfloat16)
  w13 = x["w13"].astype(jnp.float32)
  ct = normal(key, (128, 64))
  loss = lambda fn: lambda w, h: jnp.sum(fn(h, x["r"], w).astype(jnp.float32) * ct)
  fused = functools.partial(F.rmsnorm_swiglu, impl=kernel_impl)
  g = jax.jit(jax.grad(loss(fused)))(w13, x["h"])
  assert g.dtype == jnp.float32
  g_bf16 = jax.jit(jax.grad(loss(fused)))(x["w13"], x["h"])
  np.testing.assert_allclose(np.asarray(g), np.asarray(g_bf16, np.float32), rtol=2e-2,
                             atol=2e-2 * float(jnp.max(jnp.abs(g))))
  with jax.default_matmul_precision("highest"):
    g_truth = jax.grad(loss(R.rmsnorm_swiglu))(w13, x["h"].astype(jnp.float32))
  g_base = jax.grad(loss(R.rmsnorm_swiglu))(w13, x["h"])
  assert g_base.dtype == jnp.float32
  assert_within_baseline(g, g_truth, g_base, "dw13 (fp32 weights)")


# ---- jax.checkpoint over the kernel path -----------------------------------------------
@pytest.mark.parametrize("name", SINGLE_OPS)
def test_op_under_checkpoint(name, key, kernel_impl, remat_kernels):
  """Each fused op's kernel path under jax.checkpoint (nothing saved: the forward kernels
  re-run in the backward) against the fp32 truth under the tolerance rule."""
  remat = functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.nothing_saveable)
  check_op(name, _inputs(key, 128, 128, 128, 64, 128, jnp.bfloat16), kernel_impl,
           wrap=remat, key=key)


def test_batched_layouts_vmap_and_checkpoint(key, kernel_impl, remat_kernels):
  """(B, T, D) inputs, vmap over B and jax.checkpoint all give the (M, D) result, and
  that result (values and gradients, checkpointed or not) is within the tolerance rule
  of the fp32 truth."""
  x = _inputs(key, 256, 128, 64, 64, 128, jnp.bfloat16)
  op = functools.partial(F.rmsnorm_qkv_rope, **HEADS, impl=kernel_impl)
  flat = jax.jit(op)(x["h"], x["r"], x["wqkv"], x["pos"])
  b = lambda a: a.reshape(2, 128, *a.shape[1:])
  batched = jax.jit(op)(b(x["h"]), b(x["r"]), x["wqkv"], b(x["pos"]))
  mapped = jax.jit(jax.vmap(op, in_axes=(0, 0, None, 0)))(b(x["h"]), b(x["r"]), x["wqkv"],
                                                          b(x["pos"]))
  np.testing.assert_array_equal(np.asarray(batched), np.asarray(b(flat)))
  np.testing.assert_array_equal(np.asarray(mapped), np.asarray(b(flat)))
  ref = functools.partial(R.rmsnorm_qkv_rope, **HEADS)
  with jax.default_matmul_precision("highest"):
    truth = ref(*f32_tree((x["h"], x["r"], x["wqkv"])), x["pos"])
  assert_within_baseline(flat, truth, ref(x["h"], x["r"], x["wqkv"], x["pos"]), "qkv")
  ct = normal(key, truth.shape)
  loss = lambda fn: lambda h, w: jnp.sum(fn(h, x["r"], w, x["pos"]).astype(jnp.float32) * ct)
  plain = jax.jit(jax.value_and_grad(loss(op), argnums=(0, 1)))(x["h"], x["wqkv"])
  remat = jax.jit(jax.value_and_grad(jax.checkpoint(loss(op)), argnums=(0, 1)))(
      x["h"], x["wqkv"])
  for a, c in zip(jax.tree.leaves(plain), jax.tree.leaves(remat)):  # same math, XLA may
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(c, np.float32),
                               rtol=1e-5)  # reorder the fp32 loss sum under remat
  with jax.default_matmul_precision("highest"):
    g_truth = jax.grad(loss(ref), (0, 1))(*f32_tree((x["h"], x["wqkv"])))
  g_base = jax.grad(loss(ref), (0, 1))(x["h"], x["wqkv"])
  for nm, a, t, bb in zip(("dh", "dwqkv"), remat[1], g_truth, g_base):
    assert_within_baseline(a, t, bb, f"checkpointed {nm}")


# ---- errors ------------------------------------------------------------------------------
BAD = {
    "act_int": (lambda x: F.residual_rmsnorm(x["y"].astype(jnp.int32), x["w"], x["res"],
                                             x["g"]),
                r"y\.dtype=int32: activations must be bfloat16, float16 or float32"),
    "act_ndim": (lambda x: F.rmsnorm_swiglu(x["h"][0], x["r"][0], x["w13"]),
                 r"h must be \(\.\.\., D\) with at least 2 dims, got shape \(128,\)"),
    "weight_int": (lambda x: F.rmsnorm_swiglu(x["h"], x["r"], x["w13"].astype(jnp.int32)),
                   r"w13\.dtype=int32: weights must be floating point"),
    "w_shape": (lambda x: F.residual_rmsnorm(x["y"], x["w"][:-1], x["res"], x["g"]),
                r"w has shape \(63, 128\), expected \(64, 128\)"),
    "residual_width": (lambda x: F.residual_rmsnorm(x["y"], x["w"], x["res"][:, :-64],
                                                    x["g"]),
                       r"residual has width 64, expected 128"),
    "residual_rows": (lambda x: F.residual_rmsnorm(x["y"], x["w"], x["res"][:-1], x["g"]),
                      r"residual has leading shape \(127,\), expected y's leading shape "
                      r"\(128,\)"),
    "residual_dtype": (lambda x: F.residual_rmsnorm(x["y"], x["w"],
                                                    x["res"].astype(jnp.float16), x["g"]),
                       r"residual\.dtype=float16 must equal y\.dtype=bfloat16"),
    "g_shape": (lambda x: F.residual_rmsnorm(x["y"], x["w"], x["res"], x["g"][:-1]),
                r"g has shape \(127,\), expected \(128,\)"),
    "r_shape": (lambda x: F.rmsnorm_swiglu(x["h"], x["r"][:-1], x["w13"]),
                r"r has shape \(127,\), expected the activations' leading shape \(128,\)"),
    "w13_block": (lambda x: F.rmsnorm_swiglu(x["h"], x["r"], x["w13"][:, :-32]),
                  r"w13 width 96 must be a multiple of 2\*block=64"),
    "activation": (lambda x: F.rmsnorm_swiglu(x["h"], x["r"], x["w13"], activation="relu"),
                   r"activation='relu': one of \['gelu', 'silu'\]"),
    "positions_dtype": (lambda x: F.rmsnorm_qkv_rope(x["h"], x["r"], x["wqkv"],
                                                     x["pos"].astype(jnp.float32), **HEADS),
                        r"positions\.dtype=float32: must be an integer type"),
    "wqkv_shape": (lambda x: F.rmsnorm_qkv_rope(x["h"], x["r"], x["wqkv"], x["pos"],
                                                n_q_heads=4, n_kv_heads=1, head_dim=32),
                   r"wqkv has shape \(128, 256\), expected \(128, 192\)"),
    "head_dim": (lambda x: F.rmsnorm_qkv_rope(x["h"], x["r"], x["wqkv"][:, :192], x["pos"],
                                              n_q_heads=4, n_kv_heads=2, head_dim=24),
                 r"head_dim=24 must be a positive multiple of 16"),
    "head_dim_zero": (lambda x: F.rmsnorm_qkv_rope(x["h"], x["r"], x["wqkv"][:, :0], x["pos"],
                                                   n_q_heads=4, n_kv_heads=2, head_dim=0),
                      r"head_dim=0 must be a positive multiple of 16"),
    "n_q_not_multiple": (lambda x: F.rmsnorm_qkv_rope(x["h"], x["r"], x["wqkv"][:, :224],
                                                      x["pos"], n_q_heads=3, n_kv_heads=2,
                                                      head_dim=32),
                         r"n_q_heads=3 must be a multiple of n_kv_heads=2"),
    "n_kv_zero": (lambda x: F.rmsnorm_qkv_rope(x["h"], x["r"], x["wqkv"][:, :128], x["pos"],
                                               n_q_heads=4, n_kv_heads=0, head_dim=32),
                  r"n_kv_heads=0 must be positive"),
    "n_q_zero": (lambda x: F.rmsnorm_qkv_rope(x["h"], x["r"], x["wqkv"][:, :128], x["pos"],
                                              n_q_heads=0, n_kv_heads=2, head_dim=32),
                 r"n_q_heads=0 must be positive"),
    "reduction": (lambda x: F.rmsnorm_lm_head_loss(x["h"], x["r"], x["wlm"], x["tgt"],
                                                   reduction="max"),
                  r"reduction='max': one of \('mean', 'sum', 'none'\)"),
    "chunk_rows": (lambda x: F.rmsnorm_lm_head_loss(x["h"], x["r"], x["wlm"], x["tgt"],
                                                    chunk_rows=100),
                   r"chunk_rows=100 must be a positive divisor of M=128"),
    "targets_shape": (lambda x: F.rmsnorm_lm_head_loss(x["h"], x["r"], x["wlm"],
                                                       x["tgt"][:-1]),
                      r"targets has shape \(127,\), expected the activations' leading "
                      r"shape \(128,\)"),
    "targets_float": (lambda x: F.rmsnorm_lm_head_loss(x["h"], x["r"], x["wlm"],
                                                       x["tgt"].astype(jnp.float32)),
                      r"targets\.dtype=float32: must be an integer type"),
    "rm_y_dtype": (lambda x: F.residual_matmul(x["y"].astype(jnp.int8), x["w"], x["res"]),
                   r"y\.dtype=int8: activations must be bfloat16, float16 or float32"),
    "rm_w_rows": (lambda x: F.residual_matmul(x["y"], x["w"][:-16], x["res"]),
                  r"w has shape \(48, 128\), expected \(64, 128\)"),
    "rm_w_int": (lambda x: F.residual_matmul(x["y"], x["w"].astype(jnp.int32), x["res"]),
                 r"w\.dtype=int32: weights must be floating point"),
    "rm_residual_width": (lambda x: F.residual_matmul(x["y"], x["w"], x["res"][:, :64]),
                          r"residual has width 64, expected 128"),
    "rm_residual_rows": (lambda x: F.residual_matmul(x["y"], x["w"], x["res"][:64]),
                         r"residual has leading shape \(64,\), expected y's leading shape "
                         r"\(128,\)"),
    "rm_residual_dtype": (lambda x: F.residual_matmul(x["y"], x["w"],
                                                      x["res"].astype(jnp.float32)),
                          r"residual\.dtype=float32 must equal y\.dtype=bfloat16"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_inputs(case, key):
  """Each bad input raises a ValueError with its own message, before any GEMM runs."""
  fn, match = BAD[case]
  x = _inputs(key, 128, 128, 64, 64, 128, jnp.bfloat16)
  with pytest.raises(ValueError, match=match):
    jax.eval_shape(lambda: fn(x))
