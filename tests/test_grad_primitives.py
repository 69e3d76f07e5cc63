"""Backward epilogue primitives (coda_jax.grad_primitives) and PickColumn: their formulas
against jax autodiff of the forward math, and their kernels against the reference under
the tolerance rule (fp32 truth; 2x the error of the unfused bf16 emulation)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import coda_jax as cj
from coda_jax import ops
from coda_jax.grad_primitives import GatedGrad, RmsNormGrad, SoftmaxXentGrad
from coda_jax.primitives import Gated, PickColumn
from helpers import assert_within_baseline, gemm_inputs, normal, rel_err

M, N, K, P = 256, 256, 128, 32
FORMULA_RTOL = 1e-5  # fp32 formula vs fp32 autodiff of the same math


def _env(operands, shape):
  return ops._MatrixEnv(operands, shape)


@pytest.mark.parametrize("activation", ["silu", "gelu"])
def test_gated_grad_is_the_derivative(activation, key):
  kz, ky = jax.random.split(key)
  z, dy = normal(kz, (M, 2 * N)), normal(ky, (M, N))
  env = _env({"z": z}, dy.shape)
  dz = GatedGrad("z", P, "y", "zdz", activation).apply(dy, env)
  y, vjp = jax.vjp(lambda z: Gated(P, activation).apply(z, _env({}, z.shape)), z)
  assert rel_err(dz, vjp(dy)[0]) < FORMULA_RTOL
  assert rel_err(env.stored["y"], y) < FORMULA_RTOL
  assert rel_err(env.stored["zdz"], jnp.sum(dz * z, axis=1)) < FORMULA_RTOL


def test_rmsnorm_grad_is_the_derivative(key):
  """dx of <(r x g) @ W, dz>, r = rsqrt(mean(x^2) + eps), from dn = dz @ W^T and the zdz
  term c = <dz, z> / D alone."""
  kx, kg, kw, kd = jax.random.split(key, 4)
  x, g = normal(kx, (M, K)), 1 + 0.1 * normal(kg, (K,))
  w, dz = normal(kw, (K, N)), normal(kd, (M, N))
  with jax.default_matmul_precision("highest"):
    r = jax.lax.rsqrt(jnp.mean(x * x, axis=1) + 1e-5)
    z = (r[:, None] * x * g) @ w
    dx_want, dg_want = jax.grad(lambda x, g: jnp.sum(
        ((jax.lax.rsqrt(jnp.mean(x * x, axis=1) + 1e-5)[:, None] * x * g) @ w) * dz),
        argnums=(0, 1))(x, g)
    dn = dz @ w.T
  env = _env({"x": x, "r": r, "c": jnp.sum(dz * z, axis=1) / K, "g": g}, dn.shape)
  dx = RmsNormGrad("x", "r", "c", "g", "dg", "n", jnp.float32).apply(dn, env)
  assert rel_err(dx, dx_want) < FORMULA_RTOL
  assert rel_err(env.stored["dg"], dg_want) < FORMULA_RTOL
  assert rel_err(env.stored["n"], r[:, None] * x * g) < FORMULA_RTOL


def test_softmax_xent_grad_is_the_derivative(key):
  kx, kt, kw = jax.random.split(key, 3)
  x = 3 * normal(kx, (M, N))
  t = jax.random.randint(kt, (M,), 0, N).at[::9].set(-100)
  w = normal(kw, (M,)) * (t != -100)
  lse = jax.nn.logsumexp(x, axis=1)
  want = jax.grad(lambda x: jnp.sum(w * (jax.nn.logsumexp(x, axis=1) - jnp.take_along_axis(
      x, jnp.maximum(t, 0)[:, None], axis=1)[:, 0])))(x)
  env = _env({"lse": lse, "t": t, "w": w}, x.shape)
  d = SoftmaxXentGrad("lse", "t", "w", "zdz").apply(x, env)
  assert rel_err(d, want) < FORMULA_RTOL
  assert rel_err(env.stored["zdz"], jnp.sum(d * x, axis=1)) < FORMULA_RTOL
  picked = PickColumn("t", "p")
  picked.apply(x, env := _env({"t": t}, x.shape))
  np.testing.assert_array_equal(
      np.asarray(env.stored["p"]),
      np.where(t >= 0, np.take_along_axis(np.asarray(x), np.maximum(t, 0)[:, None], 1)[:, 0], 0))


def _operands(key, dt):
  ks = jax.random.split(key, 8)
  return {"z": normal(ks[0], (M, 2 * N), dt), "x": normal(ks[1], (M, N), dt),
          "r": jnp.abs(1 + 0.2 * normal(ks[2], (M,))), "c": 0.1 * normal(ks[3], (M,)),
          "g": 1 + 0.1 * normal(ks[4], (N,)), "dres": normal(ks[5], (M, N), dt),
          "t": jax.random.randint(ks[6], (M,), -1, N + 1).at[::7].set(-100),
          "w": normal(ks[7], (M,)) * 0.01}


PROGRAMS = {
    "gated_grad_silu": [GatedGrad("z", P, "y", "zdz"), cj.Store("dz")],
    "gated_grad_gelu": [GatedGrad("z", P, "y", "zdz", "gelu"), cj.Store("dz")],
    "rmsnorm_grad": [RmsNormGrad("x", "r", "c", "g", "dg", "n"), cj.AddTile("dres"),
                     cj.Store("dx")],
    "xent_grad": [cj.ScaleRow("r"), cj.RowLogSumExp("lse"), PickColumn("t", "tgt"),
                  SoftmaxXentGrad("lse_in", "t", "w", "zdz"), cj.Store("d")],
}


def _f32(program):
  """The same program storing everything in fp32: the truth."""
  fields = ("dtype", "y_dtype", "n_dtype")
  return [dataclasses.replace(p, **{f: jnp.float32 for f in fields if hasattr(p, f)})
          for p in program]


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_backward_program_in_kernel(name, key, kernel_impl):
  a, b = gemm_inputs(key, M, N, K, jnp.bfloat16, trans_b=True)
  b = b * K ** -0.5
  program = PROGRAMS[name]
  inputs, _, _ = ops._declared(program, M, N)
  ops_all = _operands(jax.random.fold_in(key, 1), jnp.bfloat16)
  ops_all["lse_in"] = 2 + normal(key, (M,))
  operands = {k: ops_all[k] for k in inputs}
  up = {k: v.astype(jnp.float32) if v.dtype == jnp.bfloat16 else v for k, v in operands.items()}
  truth = cj.reference(a.astype(jnp.float32), b.astype(jnp.float32), _f32(program), up,
                       trans_b=True)
  base = cj.reference(a, b, program, operands, trans_b=True, round_to=jnp.bfloat16)
  got = jax.jit(lambda a, b, o: cj.gemm_epilogue(a, b, program, o, trans_b=True,
                                                 impl=kernel_impl))(a, b, operands)
  assert set(got) == set(base)
  for out in got:
    assert got[out].shape == base[out].shape and got[out].dtype == base[out].dtype, out
    assert_within_baseline(got[out], truth[out], base[out], f"{name}:{out}")
