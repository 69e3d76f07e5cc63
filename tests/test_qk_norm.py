"""QK-norm inside the QKV epilogue (coda_jax.qk_norm): outputs and the gradients of every
input (h, r, wqkv and both norm weights) against jax.grad of the plain-jnp reference.
Truth: the reference on fp32 inputs at HIGHEST precision. Bound: twice the error of the
same reference run unfused in bf16/fp16 (helpers.assert_within_baseline), overall and per
row. The table runs on impl="xla"; one small case runs the kernel tile path
(``kernel_impl``: the Mosaic GPU interpreter off Hopper).

The heads of wqkv are scaled by factors spread over [0.2, 5], so every head has its own
RMS: a norm taken over the wrong columns, or skipped on a head, shows."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coda_jax import dispatch
from coda_jax import fused_ops as F
from coda_jax import jnp_reference as R
from coda_jax import qk_norm as Q
from coda_jax.epilogue_gemm import epilogue_pass, gemm_epilogue, kernel_config, reference
from coda_jax.primitives import Rotate, Store
from helpers import assert_within_baseline, f32_tree, normal, rel_err, spread_rows
from pallas_kernels import GemmConfig

EPS, THETA = 1e-6, 1e6  # Qwen3's
DIFF = ("h", "r", "wqkv", "qw", "kw")


def _inputs(key, m, d, hq, hkv, hd, dt=jnp.bfloat16, head_scale=None):
  ks = jax.random.split(key, 8)
  heads = hq + 2 * hkv
  g = 1 + 0.1 * normal(ks[0], (d,))
  xs = spread_rows(ks[1], (m, d))
  if head_scale is None:
    head_scale = jnp.exp(jax.random.uniform(ks[2], (heads,), jnp.float32, np.log(0.2),
                                            np.log(5.0)))
  wqkv = normal(ks[3], (d, heads * hd)) * d ** -0.5 * jnp.repeat(head_scale, hd)
  return dict(h=(xs * g).astype(dt), r=R.rms_scale(xs, 1e-5), wqkv=wqkv.astype(dt),
              qw=1 + 0.3 * normal(ks[4], (hd,)), kw=1 + 0.3 * normal(ks[5], (hd,)),
              pos=jnp.arange(m, dtype=jnp.int32) % 37 + 1000,
              ct=normal(ks[6], (m, heads * hd)))


def _heads(hq, hkv, hd):
  return dict(n_q_heads=hq, n_kv_heads=hkv, head_dim=hd, eps=EPS, theta=THETA)


def _fns(heads, impl):
  ref = lambda p, pos: R.rmsnorm_qkv_qknorm_rope(p["h"], p["r"], p["wqkv"], pos, p["qw"],
                                                 p["kw"], **heads)
  fused = lambda p, pos: Q.rmsnorm_qkv_qknorm_rope(p["h"], p["r"], p["wqkv"], pos, p["qw"],
                                                   p["kw"], **heads, impl=impl)
  return ref, fused


def check(x, heads, impl):
  """Forward and every gradient under the tolerance rule."""
  ref, fused = _fns(heads, impl)
  diff, pos, ct = {k: x[k] for k in DIFF}, x["pos"], x["ct"]
  proj = lambda fn: lambda p, ps: jnp.sum(fn(p, ps).astype(jnp.float32) * ct)
  with jax.default_matmul_precision("highest"):
    truth = jax.jit(ref)(f32_tree(diff), pos)
    g_truth = jax.jit(jax.grad(proj(ref)))(f32_tree(diff), pos)
  base, g_base = ref(diff, pos), jax.grad(proj(ref))(diff, pos)  # eager: unfused XLA
  got, g_got = jax.jit(lambda p, ps: (fused(p, ps), jax.grad(proj(fused))(p, ps)))(diff, pos)
  assert got.shape == truth.shape and got.dtype == x["h"].dtype
  assert_within_baseline(got, truth, base, f"{impl} qkv")
  for k in DIFF:
    assert g_got[k].dtype == x[k].dtype, (k, g_got[k].dtype)
    assert_within_baseline(g_got[k], g_truth[k], g_base[k], f"{impl} d{k}")


# (M, D, Hq, Hkv, head_dim, dtype): M = 1 and odd M, GQA and MHA, head_dim 16 to 128.
CASES = [
    (1, 64, 2, 1, 32, jnp.bfloat16),
    (63, 96, 4, 2, 32, jnp.bfloat16),
    (128, 192, 4, 4, 64, jnp.bfloat16),
    (65, 128, 2, 1, 128, jnp.bfloat16),
    (300, 64, 6, 2, 64, jnp.bfloat16),
    (33, 80, 3, 1, 16, jnp.bfloat16),
    (96, 128, 4, 2, 64, jnp.float16),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "m{}_d{}_hq{}_hkv{}_hd{}_{}".format(
    *c[:5], jnp.dtype(c[5]).name))
def test_op_and_grads_xla(case, key):
  m, d, hq, hkv, hd, dt = case
  check(_inputs(key, m, d, hq, hkv, hd, dt), _heads(hq, hkv, hd), "xla")


@pytest.mark.parametrize("impl", ["xla", "kernel"])
def test_heads_near_and_at_zero(key, kernel_impl, impl):
  """eps matters where a head's mean square is near it: q head 0 at RMS ~ 1e-3 (mean
  square ~ eps = 1e-6, so dropping eps moves it by ~40%), and k head 0 all zero (its
  output must be 0 and every gradient finite, not 0 * inf = NaN; k head 1 keeps the
  k weight's gradient nonzero)."""
  hq, hkv, hd = 2, 2, 32
  scale = jnp.array([1e-3, 1.0, 0.0, 1.0, 1.0, 1.0], jnp.float32)  # q0 q1 k0 k1 v0 v1
  x = _inputs(key, 64, 64, hq, hkv, hd, head_scale=scale)
  impl = kernel_impl if impl == "kernel" else impl
  check(x, _heads(hq, hkv, hd), impl)
  _, fused = _fns(_heads(hq, hkv, hd), impl)
  diff = {k: x[k] for k in DIFF}
  out, grads = jax.jit(lambda p: (fused(p, x["pos"]), jax.grad(
      lambda q: jnp.sum(fused(q, x["pos"]).astype(jnp.float32) * x["ct"]))(p)))(diff)
  k0 = slice(hq * hd, (hq + 1) * hd)
  assert not np.asarray(jnp.isnan(out)).any()
  np.testing.assert_array_equal(np.asarray(out[:, k0], np.float32), 0.0)
  for k, g in grads.items():
    assert np.isfinite(np.asarray(g, np.float32)).all(), k


def test_op_and_grads_kernel(key, kernel_impl):
  """The kernel tile path: M = 100 pads to the row tile. Two heads share each 64-wide
  epilogue sub-tile (checked below), so the per-head loop inside one sub-tile runs, and
  the second sub-tile holds a k head beside a v head (the selector within a sub-tile)."""
  x = _inputs(key, 100, 64, 2, 1, 32)
  n = x["wqkv"].shape[1]
  cfg = kernel_config(jnp.zeros((128, 64), jnp.bfloat16), x["wqkv"],  # M padded to 128
                      Q.forward_program(32, EPS, jnp.bfloat16),
                      {"r": jnp.ones((128,)), "pos": jnp.zeros((128,), jnp.int32),
                       "freqs": jnp.ones((n,)), "qk_w": jnp.ones((n,)), "qk_sel": jnp.ones((n,))})
  assert cfg.epi_tile_n == 64, cfg.describe()
  check(x, _heads(2, 1, 32), kernel_impl)


def _truth_f64(x, hq, hkv, hd):
  """The forward in float64 numpy with exact angles: independent of the library's RoPE
  frequencies and of the jnp reference."""
  f = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)
  u = f(x["r"])[:, None] * (f(x["h"]) @ f(x["wqkv"]))
  m, heads = u.shape[0], hq + 2 * hkv
  u3 = u.reshape(m, heads, hd).copy()
  w = [f(x["qw"])] * hq + [f(x["kw"])] * hkv
  for j in range(hq + hkv):
    rms = np.sqrt(np.mean(u3[:, j] ** 2, axis=1, keepdims=True) + EPS)
    u3[:, j] = u3[:, j] / rms * w[j]
  p = hd // 2
  t = f(x["pos"])[:, None] * THETA ** (-2.0 * np.arange(p) / hd)
  c, s = np.cos(t)[:, None], np.sin(t)[:, None]
  a, b = u3[:, :hq + hkv, :p].copy(), u3[:, :hq + hkv, p:].copy()
  u3[:, :hq + hkv, :p], u3[:, :hq + hkv, p:] = a * c - b * s, b * c + a * s
  return u3.reshape(m, -1)


def test_forward_against_float64(key):
  x = _inputs(key, 64, 96, 4, 2, 32)
  got = Q.rmsnorm_qkv_qknorm_rope(x["h"], x["r"], x["wqkv"], x["pos"], x["qw"], x["kw"],
                                  **_heads(4, 2, 32), impl="xla")
  base = R.rmsnorm_qkv_qknorm_rope(x["h"], x["r"], x["wqkv"], x["pos"], x["qw"], x["kw"],
                                   **_heads(4, 2, 32))
  assert_within_baseline(got, _truth_f64(x, 4, 2, 32), base, "qkv vs float64")


def test_v_rides_through_and_batched_layout(key):
  """v columns equal the plain op's (no norm there), bit for bit; (B, T, D) inputs give
  the (B * T, D) result reshaped."""
  hq, hkv, hd = 4, 2, 32
  x = _inputs(key, 62, 64, hq, hkv, hd)
  args = (x["h"], x["r"], x["wqkv"], x["pos"], x["qw"], x["kw"])
  got = Q.rmsnorm_qkv_qknorm_rope(*args, **_heads(hq, hkv, hd), impl="xla")
  plain = F.rmsnorm_qkv_rope(*args[:4], n_q_heads=hq, n_kv_heads=hkv, head_dim=hd,
                             theta=THETA, impl="xla")
  v0 = (hq + hkv) * hd
  np.testing.assert_array_equal(np.asarray(got[:, v0:], np.float32),
                                np.asarray(plain[:, v0:], np.float32))
  b = lambda a: a.reshape(2, 31, *a.shape[1:])
  batched = Q.rmsnorm_qkv_qknorm_rope(b(x["h"]), b(x["r"]), x["wqkv"], b(x["pos"]), x["qw"],
                                      x["kw"], **_heads(hq, hkv, hd), impl="xla")
  np.testing.assert_array_equal(np.asarray(batched.reshape(got.shape), np.float32),
                                np.asarray(got, np.float32))


@pytest.mark.parametrize("config", [
    None,
    # one operand slot, 64-row warpgroup tiles, du stored in 64-wide halves: 8 CTA tiles
    GemmConfig(tile_m=64, tile_n=128, epi_tile_n=128, epi_store_n=64, cluster_dim=None,
               stages=2, epi_operand_slots=1)], ids=["default", "one_slot_split"])
def test_backward_pass_against_vjp(key, kernel_impl, races_checked, config):
  """The per-head backward (``backward_program``, an epilogue pass with no GEMM) at
  Qwen3's head_dim of 128, against ``jax.vjp`` of the forward's definition (HeadRmsNorm,
  then RoPE) in fp32: du under the tolerance rule (baseline: the program run unfused in
  bf16), the norm weights' column sums and <du, u> in fp32 from the same inputs. Under
  the race detector when interpreted."""
  hq, hkv, hd, m = 2, 1, 128, 256
  n = (hq + 2 * hkv) * hd
  ks = jax.random.split(key, 5)
  scale = jnp.repeat(jnp.array([0.3, 2.0, 1.0, 0.7]), hd)  # a different RMS per head
  u = (normal(ks[0], (m, n)) * scale).astype(jnp.bfloat16)
  dqkv = normal(ks[1], (m, n), jnp.bfloat16)
  pos = jax.random.randint(ks[2], (m,), 0, 8192, jnp.int32)
  qw, kw = 1 + 0.3 * normal(ks[3], (hd,)), 1 + 0.3 * normal(ks[4], (hd,))
  freqs = R.qkv_freqs(hq, hkv, hd, THETA, None)
  weight, normed = Q.head_norm_columns(qw, kw, hq, hkv)

  def forward(u32, w):  # the forward epilogue's steps after Store u, on whole matrices
    env = dispatch._MatrixEnv({"w": w, "sel": normed, "pos": pos, "freqs": freqs}, u32.shape)
    y = Q.HeadRmsNorm("w", "sel", hd, EPS).apply(u32, env)
    return Rotate("pos", "freqs", hd // 2).apply(y, env)

  u32 = u.astype(jnp.float32)
  _, vjp = jax.vjp(forward, u32, weight)
  du_t, dw_t = vjp(dqkv.astype(jnp.float32))
  program = Q.backward_program(hd, EPS, jnp.bfloat16)
  ops = {"dqkv": dqkv, "pos": pos, "neg_freqs": -freqs, "u": u, "qk_w": weight,
         "qk_sel": normed}
  got = epilogue_pass(program, ops, impl=kernel_impl, config=config)
  unfused = reference(u[:, :0], u[:0, :], program, ops, round_to=jnp.bfloat16)
  assert got["du"].dtype == jnp.bfloat16
  assert_within_baseline(got["du"], du_t, unfused["du"], "du")
  for name, want in (("dweight", dw_t), ("udu", jnp.sum(du_t * u32, axis=1))):
    e = rel_err(got[name], want)
    assert e < 1e-4, f"{name}: rel err {e:.3g}"
  assert not races_checked.races_found(), "data race in the kernel (see stdout)"


def test_head_rms_norm_primitive_keeps_heads_whole():
  """The primitive declares its head as a column group: N must be whole heads."""
  prim = Q.HeadRmsNorm("w", "sel", 64, EPS)
  assert prim.column_group() == 64
  a, b = jnp.ones((64, 64), jnp.bfloat16), jnp.ones((64, 96), jnp.bfloat16)
  ops = {"w": jnp.ones((96,)), "sel": jnp.ones((96,))}
  with pytest.raises(ValueError, match="N=96 must be a multiple of its column group"):
    gemm_epilogue(a, b, [prim, Store("o")], ops, impl="xla")
  with pytest.raises(ValueError, match=r"HeadRmsNorm.head_dim=12 must be a positive multiple"):
    Q.HeadRmsNorm("w", "sel", 12, EPS)


_x = lambda: _inputs(jax.random.key(0), 16, 64, 4, 2, 32)
BAD = {
    "head_dim_odd": (dict(head_dim=33), "head_dim=33 must be a positive multiple of 16"),
    "head_dim_24": (dict(head_dim=24), "head_dim=24 must be a positive multiple of 16"),
    "head_dim_untileable": (dict(head_dim=96, impl="interpret"),
                            r"head_dim=96: .* must divide 128 .* use head_dim 16, 32, 64 or "
                            r"128, or an impl that includes 'xla'"),
    "q_norm_w_per_head": (dict(qw=jnp.ones((4, 32))),
                          r"q_norm_w has shape \(4, 32\), expected \(32,\) = \(head_dim,\)"),
    "k_norm_w_len": (dict(kw=jnp.ones((64,))),
                     r"k_norm_w has shape \(64,\), expected \(32,\) = \(head_dim,\)"),
    "k_norm_w_int": (dict(kw=jnp.ones((32,), jnp.int32)),
                     r"k_norm_w\.dtype=int32: norm weights must be floating point"),
    "eps_zero": (dict(eps=0.0), r"eps=0.0 must be > 0"),
    "wqkv_width": (dict(n_kv_heads=1), r"wqkv has shape \(64, 256\), expected \(64, 192\)"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_inputs(case):
  """Each bad input raises its own ValueError before any GEMM runs."""
  kw, match = dict(BAD[case][0]), BAD[case][1]
  x = _x()
  qw, kw_ = kw.pop("qw", x["qw"]), kw.pop("kw", x["kw"])
  heads = _heads(4, 2, 32) | kw
  with pytest.raises(ValueError, match=match):
    jax.eval_shape(lambda: Q.rmsnorm_qkv_qknorm_rope(x["h"], x["r"], x["wqkv"], x["pos"], qw,
                                                     kw_, **heads))
