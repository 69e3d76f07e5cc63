"""The fused Transformer ops (coda_jax.fused_ops): outputs and gradients against
jax.grad of the pure-jnp reference. Truth: the reference on fp32 inputs at HIGHEST
precision. Bound: twice the error of the same reference run unfused in the activation
dtype (tests/helpers.assert_within_baseline), overall and per row."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coda_jax import fused_ops as F
from coda_jax import jnp_reference as R
from helpers import assert_within_baseline, normal

HEADS = dict(n_q_heads=4, n_kv_heads=2, head_dim=32)
QKV = (4 + 2 * 2) * 32


def _inputs(key, m, d, k, f, v, dt):
  ks = jax.random.split(key, 10)
  return dict(
      y=normal(ks[0], (m, k), dt), w=normal(ks[1], (k, d), dt) * k ** -0.5,
      res=normal(ks[2], (m, d), dt), g=1 + 0.1 * normal(ks[3], (d,)),
      h=normal(ks[4], (m, d), dt), r=jnp.abs(1 + 0.2 * normal(ks[5], (m,))),
      w13=normal(ks[6], (d, 2 * f), dt) * d ** -0.5,
      wqkv=normal(ks[7], (d, QKV), dt) * d ** -0.5,
      wlm=normal(ks[8], (d, v), dt) * d ** -0.5,
      pos=jnp.arange(m, dtype=jnp.int32) % 37 + 1000,  # packed sequences, late positions
      tgt=jax.random.randint(ks[9], (m,), 0, v).at[::7].set(-100))


# op name -> (fused(x, impl), reference(x), differentiable input names)
OPS = {
    "residual_rmsnorm": (
        lambda x, impl: F.residual_rmsnorm(x["y"], x["w"], x["res"], x["g"], impl=impl),
        lambda x: R.residual_rmsnorm(x["y"], x["w"], x["res"], x["g"]),
        ("y", "w", "res", "g")),
    "rmsnorm_swiglu": (
        lambda x, impl: F.rmsnorm_swiglu(x["h"], x["r"], x["w13"], impl=impl),
        lambda x: R.rmsnorm_swiglu(x["h"], x["r"], x["w13"]),
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
}


def _projected(fn, cts):
  """Scalar <fn(x), cts>, so every output's gradient path is exercised."""
  def loss(diff, rest):
    outs = jax.tree.leaves(fn({**rest, **diff}))
    return sum(jnp.sum(o.astype(jnp.float32) * c) for o, c in zip(outs, cts))
  return loss


def check_op(name, x, impl):
  fused, reference, names = OPS[name]
  diff = {k: x[k] for k in names}
  rest = {k: v for k, v in x.items() if k not in names}
  up = lambda t: jax.tree.map(lambda a: a.astype(jnp.float32)
                              if jnp.issubdtype(a.dtype, jnp.floating) else a, t)
  with jax.default_matmul_precision("highest"):
    truth = reference(up(x))
  cts = [normal(jax.random.key(i), o.shape) for i, o in enumerate(jax.tree.leaves(truth))]
  with jax.default_matmul_precision("highest"):
    g_truth = jax.grad(_projected(reference, cts))(up(diff), up(rest))
  base, g_base = reference(x), jax.grad(_projected(reference, cts))(diff, rest)
  run = jax.jit(lambda d, r: (fused({**r, **d}, impl),
                              jax.grad(_projected(lambda z: fused(z, impl), cts))(d, r)))
  got, g_got = run(diff, rest)
  for i, (a, t, b) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(truth),
                                    jax.tree.leaves(base))):
    assert a.shape == t.shape and a.dtype == b.dtype, (name, i, a.shape, a.dtype)
    if a.ndim == 0:  # a loss: compare as a 1-element row
      a, t, b = a[None], t[None], b[None]
    assert_within_baseline(a, t, b, f"{name} output {i}")
  for k in names:
    assert g_got[k].dtype == x[k].dtype, (k, g_got[k].dtype)
    assert_within_baseline(g_got[k], g_truth[k], g_base[k], f"{name} d{k}")


@pytest.mark.parametrize("name", list(OPS))
def test_op_and_grads_bf16(name, key, kernel_impl):
  check_op(name, _inputs(key, 256, 128, 128, 128, 256, jnp.bfloat16), kernel_impl)


@pytest.mark.parametrize("name", ["rmsnorm_swiglu", "rmsnorm_lm_head_loss"])
def test_op_and_grads_fp16_odd_sizes(name, key, kernel_impl):
  # M = 192 and V = 384 are not multiples of the default 256-row / 256-column cluster
  # tile: the config falls back to smaller tiles.
  check_op(name, _inputs(key, 192, 128, 64, 128, 384, jnp.float16), kernel_impl)


def test_fp32_parameters_keep_their_dtype(key, kernel_impl):
  x = _inputs(key, 128, 128, 64, 64, 128, jnp.bfloat16)
  w13 = x["w13"].astype(jnp.float32)
  loss = lambda w: jnp.sum(F.rmsnorm_swiglu(x["h"], x["r"], w, impl=kernel_impl)
                           .astype(jnp.float32))
  g = jax.jit(jax.grad(loss))(w13)
  assert g.dtype == jnp.float32
  g_bf16 = jax.jit(jax.grad(loss))(x["w13"])
  np.testing.assert_allclose(np.asarray(g), np.asarray(g_bf16, np.float32), rtol=2e-2,
                             atol=2e-2 * float(jnp.max(jnp.abs(g))))


@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_lm_head_reductions_and_chunks(reduction, key, kernel_impl):
  x = _inputs(key, 256, 128, 64, 64, 256, jnp.bfloat16)
  fused = lambda h, w: F.rmsnorm_lm_head_loss(h, x["r"], w, x["tgt"], reduction=reduction,
                                              chunk_rows=128, impl=kernel_impl)
  with jax.default_matmul_precision("highest"):
    ref = lambda h, w: R.rmsnorm_lm_head_loss(h.astype(jnp.float32), x["r"],
                                              w.astype(jnp.float32), x["tgt"],
                                              reduction=reduction)
    ct = jnp.ones(()) if reduction == "sum" else normal(key, (256,))
    want, vjp = jax.vjp(ref, x["h"], x["wlm"])
    dh_want, dw_want = vjp(ct)
  got, vjp = jax.vjp(jax.jit(fused), x["h"], x["wlm"])
  dh, dw = vjp(ct)
  assert got.shape == want.shape
  ignored = np.asarray(x["tgt"] == -100)
  if reduction == "none":
    assert np.all(np.asarray(got)[ignored] == 0)
    assert np.all(np.asarray(dh, np.float32)[ignored] == 0)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-3, atol=1e-3)
  for a, b in ((dh, dh_want), (dw, dw_want)):
    err = np.linalg.norm(np.asarray(a, np.float32) - b) / np.linalg.norm(b)
    assert err < 1e-2, err  # bf16 storage of dlogits and gradients: ~2^-8


def test_batched_layouts_vmap_and_checkpoint(key, kernel_impl):
  """(B, T, D) inputs, vmap over B and jax.checkpoint all give the (M, D) result."""
  x = _inputs(key, 256, 128, 64, 64, 128, jnp.bfloat16)
  op = functools.partial(F.rmsnorm_qkv_rope, **HEADS, impl=kernel_impl)
  flat = jax.jit(op)(x["h"], x["r"], x["wqkv"], x["pos"])
  b = lambda a: a.reshape(2, 128, *a.shape[1:])
  batched = jax.jit(op)(b(x["h"]), b(x["r"]), x["wqkv"], b(x["pos"]))
  mapped = jax.jit(jax.vmap(op, in_axes=(0, 0, None, 0)))(b(x["h"]), b(x["r"]), x["wqkv"],
                                                          b(x["pos"]))
  np.testing.assert_array_equal(np.asarray(batched), np.asarray(b(flat)))
  np.testing.assert_array_equal(np.asarray(mapped), np.asarray(b(flat)))
  # jax.checkpoint rejects the interpreter's io_callback effects, so on CPU the remat
  # check runs the custom_vjp over the XLA path; on a GPU it runs the compiled kernels.
  if kernel_impl == "interpret":
    op = functools.partial(F.rmsnorm_qkv_rope, **HEADS, impl="xla")
  loss = lambda h, w: jnp.sum(op(h, x["r"], w, x["pos"]).astype(jnp.float32) ** 2)
  plain = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x["h"], x["wqkv"])
  remat = jax.jit(jax.value_and_grad(jax.checkpoint(loss), argnums=(0, 1)))(x["h"], x["wqkv"])
  for a, c in zip(jax.tree.leaves(plain), jax.tree.leaves(remat)):  # same math, XLA may
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(c, np.float32),
                               rtol=1e-5)  # reorder the fp32 loss sum under remat


BAD = [
    (lambda x: F.residual_rmsnorm(x["y"].astype(jnp.int32), x["w"], x["res"], x["g"]),
     "activations must be"),
    (lambda x: F.residual_rmsnorm(x["y"], x["w"][:-1], x["res"], x["g"]), "w has shape"),
    (lambda x: F.residual_rmsnorm(x["y"], x["w"], x["res"][:-1], x["g"]), "residual"),
    (lambda x: F.rmsnorm_swiglu(x["h"], x["r"][:-1], x["w13"]), "r has shape"),
    (lambda x: F.rmsnorm_swiglu(x["h"], x["r"], x["w13"][:, :-32]), "multiple of 2\\*block"),
    (lambda x: F.rmsnorm_swiglu(x["h"], x["r"], x["w13"], activation="relu"), "activation"),
    (lambda x: F.rmsnorm_qkv_rope(x["h"], x["r"], x["wqkv"], x["pos"].astype(jnp.float32),
                                  **HEADS), "positions.dtype"),
    (lambda x: F.rmsnorm_qkv_rope(x["h"], x["r"], x["wqkv"], x["pos"], n_q_heads=4,
                                  n_kv_heads=3, head_dim=32), "wqkv has shape"),
    (lambda x: F.rmsnorm_lm_head_loss(x["h"], x["r"], x["wlm"], x["tgt"], reduction="max"),
     "reduction"),
    (lambda x: F.rmsnorm_lm_head_loss(x["h"], x["r"], x["wlm"], x["tgt"], chunk_rows=100),
     "chunk_rows"),
    (lambda x: F.rmsnorm_lm_head_loss(x["h"], x["r"], x["wlm"], x["tgt"][:-1]),
     "targets has shape"),
]


@pytest.mark.parametrize("case", range(len(BAD)))
def test_bad_inputs(case, key):
  fn, match = BAD[case]
  x = _inputs(key, 128, 128, 64, 64, 128, jnp.bfloat16)
  with pytest.raises(ValueError, match=match):
    jax.eval_shape(lambda: fn(x))
