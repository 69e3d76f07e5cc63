"""Backward epilogue primitives (coda_jax.grad_primitives) and PickColumn: their formulas
against jax autodiff of the forward math, and their kernels against the reference under
the tolerance rule (fp32 truth; 2x the error of the unfused bf16 emulation)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk

import coda_jax as cj
from coda_jax import dispatch, epilogue_gemm
from coda_jax.grad_primitives import (ExpShifted, GatedGrad, RmsNormGrad, RmsNormGradRowScaled,
                                      SoftmaxXentGrad)
from coda_jax.primitives import Gated, PickColumn, RowLogSumExp
from helpers import (assert_within_baseline, gated_pairs, gemm_inputs, normal, rel_err,
                     spread_rows)

M, N, K, P = 256, 256, 128, 32
FORMULA_RTOL = 1e-5  # fp32 formula vs fp32 autodiff of the same math


def _env(operands, shape):
  return dispatch._MatrixEnv(operands, shape)


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
  # from the row-scaled cotangent r * dz: the same dx and dg, and diag(g) x^T (r dz) is
  # the weight gradient n^T dz (docs/row_scaled_cotangent.md)
  with jax.default_matmul_precision("highest"):
    dw_want = jax.grad(lambda w: jnp.sum(((r[:, None] * x * g) @ w) * dz))(w)
    acc = (r[:, None] * dz) @ w.T
    dw = g[:, None] * (x.T @ (r[:, None] * dz))
  env = _env({"x": x, "r": r, "c": jnp.sum(dz * z, axis=1) / K, "g": g}, acc.shape)
  dx = RmsNormGradRowScaled("x", "r", "c", "g", "dg").apply(acc, env)
  assert rel_err(dx, dx_want) < FORMULA_RTOL
  assert rel_err(env.stored["dg"], dg_want) < FORMULA_RTOL
  assert rel_err(dw, dw_want) < FORMULA_RTOL
  assert set(env.stored) == {"dg"}


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
  # The LSE without the target's column, and the target's dlogit from it: the same
  # derivative, and exact where 1 - p_t is below lse's rounding (a confident row).
  rows = RowLogSumExp("lse", exclude="t", rest="rest")
  rows.apply(x, env := _env({"t": t}, x.shape))
  rest = rows.finish({k: v[None] for k, v in env.stored.items()})["rest"]
  others = jnp.where(jnp.arange(N)[None, :] == t[:, None], -jnp.inf, x)
  assert rel_err(rest, jax.nn.logsumexp(others, axis=1)) < FORMULA_RTOL
  tgt = jnp.where(t >= 0, jnp.take_along_axis(x, jnp.maximum(t, 0)[:, None], 1)[:, 0], 0)
  env = _env({"lse": lse, "t": t, "w": w, "rest": rest, "tgt": tgt}, x.shape)
  d_rest = SoftmaxXentGrad("lse", "t", "w", "zdz", rest_lse="rest", target_logit="tgt").apply(
      x, env)
  assert rel_err(d_rest, want) < FORMULA_RTOL
  assert rel_err(env.stored["zdz"], jnp.sum(want * x, axis=1)) < FORMULA_RTOL
  with pytest.raises(ValueError, match="go together"):
    RowLogSumExp("lse", exclude="t")
  with pytest.raises(ValueError, match="go together"):
    SoftmaxXentGrad("lse", "t", "w", "zdz", rest_lse="rest")
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
    "rmsnorm_grad_row_scaled": [RmsNormGradRowScaled("x", "r", "c", "g", "dg"),
                                cj.AddTile("dres"), cj.Store("dx")],
    "gated_grad_row_scaled": [GatedGrad("z", P, "y", "zdz"), cj.ScaleRow("r"), cj.Store("dz")],
    # y kept by the forward (BlockConfig.mlp_residuals="output"): dz and zdz only
    "gated_grad_no_y": [GatedGrad("z", P, None, "zdz"), cj.ScaleRow("r"), cj.Store("dz")],
    "xent_grad": [cj.ScaleRow("r"), cj.RowLogSumExp("lse"), PickColumn("t", "tgt"),
                  SoftmaxXentGrad("lse_in", "t", "w", "zdz"), cj.Store("d")],
    # the LSE without the target column (what the LM head's forward now computes)
    "xent_lse_rest": [cj.ScaleRow("r"), cj.RowLogSumExp("lse", exclude="t", rest="lse_rest"),
                      PickColumn("t", "tgt"), cj.Store("d")],
    # the exp-store LM head's logits GEMM (block_gemms.lm_head_exp)
    "xent_exp_store": [cj.ScaleRow("r"), cj.RowLogSumExp("lse", exclude="t", rest="lse_rest"),
                       PickColumn("t", "tgt"), ExpShifted("shift"), cj.Store("d")],
}


def _f32(program):
  """The same program storing everything in fp32: the truth."""
  fields = ("dtype", "y_dtype", "n_dtype")
  return [dataclasses.replace(p, **{f: jnp.float32 for f in fields if hasattr(p, f)})
          for p in program]


# the programs with tile operands also run with one operand slot, refilled early (the
# default, GemmConfig.epi_operand_refetch_early) and late: z is a wide tile,
# rmsnorm_grad reads two
IN_KERNEL_CASES = ([(n, s) for s in ("default", "pingpong") for n in PROGRAMS]
                   + [(n, s) for s in ("one_slot_early", "one_slot_late")
                      for n in ("gated_grad_silu", "gated_grad_gelu", "rmsnorm_grad")])


@pytest.mark.parametrize("name,schedule", IN_KERNEL_CASES)
def test_backward_program_in_kernel(name, key, kernel_impl, schedule, monkeypatch):
  a, b = gemm_inputs(key, M, N, K, jnp.bfloat16, trans_b=True)
  b = b * K ** -0.5
  program = PROGRAMS[name]
  inputs, _, _ = epilogue_gemm._declared(program, M, N)
  ops_all = _operands(jax.random.fold_in(key, 1), jnp.bfloat16)
  ops_all["lse_in"] = 2 + normal(key, (M,))
  ops_all["shift"] = normal(jax.random.fold_in(key, 2), (M,))
  operands = {k: ops_all[k] for k in inputs}
  up = {k: v.astype(jnp.float32) if v.dtype == jnp.bfloat16 else v for k, v in operands.items()}
  truth = cj.reference(a.astype(jnp.float32), b.astype(jnp.float32), _f32(program), up,
                       trans_b=True)
  base = cj.reference(a, b, program, operands, trans_b=True, round_to=jnp.bfloat16)
  # ping-pong with warpgroup tiles (64, 64): several tiles per CTA, so column partials
  # (dg) and in-turn epilogues alternate between the warpgroups
  config = None if schedule == "default" else pk.GemmConfig(
      tile_m=64, tile_n=64, tile_k=64, stages=3, epi_tile_n=2 * P if "gated" in name else 64,
      cluster_dim=None, schedule=pk.Schedule.PINGPONG)
  if schedule.startswith("one_slot"):  # 64x128 tiles of two sub-tiles: one refill a tile
    config = dataclasses.replace(config, tile_n=128, epi_operand_slots=1,
                                 epi_operand_refetch_early=schedule == "one_slot_early")
  real = pk.gemm  # two SMs on the GPU too: each CTA loops over several tiles
  monkeypatch.setattr(pk, "gemm", lambda *a, **kw: real(*a, **{"num_sms": 2, **kw}))
  got = jax.jit(lambda a, b, o: cj.gemm_epilogue(a, b, program, o, trans_b=True,
                                                 impl=kernel_impl, config=config))(a, b, operands)
  assert set(got) == set(base)
  for out in got:
    assert got[out].shape == base[out].shape and got[out].dtype == base[out].dtype, out
    assert_within_baseline(got[out], truth[out], base[out], f"{name}:{out}")


# ---- independent oracles through the kernel ----------------------------------------------
# test_backward_program_in_kernel's truth is coda_jax.reference, which runs the
# primitives' own apply. Here each backward program runs through the kernel on a
# consistent problem (r, c and lse computed from the forward they belong to), and every
# output (the zdz partials and n included) is held to jax autodiff of a forward written
# in this file: fp32 at HIGHEST precision on the upcast inputs; bound 2x the error of
# the same backward run as an unfused bf16 XLA graph, overall and per row.
OM, ON, OK = 128, 128, 64
BF16, F32 = jnp.bfloat16, jnp.float32
RMS_EPS = 1e-5

def _up(v):
  return v.astype(F32)


def _q(v):
  """Rounded to bf16, as an unfused bf16 graph stores every intermediate."""
  return v.astype(BF16).astype(F32)


def _gated_case(act):
  def case(key, run):
    ka, kz = jax.random.split(key)
    a, b = gemm_inputs(ka, OM, ON, OK, BF16, trans_b=True)
    b = b * OK ** -0.5
    z = normal(kz, (OM, 2 * ON), BF16)
    got = run(a, b, [GatedGrad("z", P, "y", "zdz", act), cj.Store("dz")], {"z": z})

    def backward(dy, z):  # y and dz = vjp of the pairs; zdz = <dz, z> per row
      y, vjp = jax.vjp(lambda z: gated_pairs(z, P, act), z)
      dz = vjp(dy)[0]
      return {"y": y, "dz": dz, "zdz": jnp.sum(_up(dz) * _up(z), axis=1)}
    with jax.default_matmul_precision("highest"):
      truth = backward(jnp.matmul(_up(a), _up(b).T), _up(z))
    return got, truth, backward(jnp.matmul(a, b.T), z)  # unfused: all in bf16
  return case


def _rmsnorm_case(row_scaled):
  """z = n @ w with n = r * x * g: dn = dz @ w^T is the accumulator; dx (plus a residual
  gradient), dg and n against autodiff of the norm and the GEMM. ``row_scaled``: the
  same backward from the cotangent r * dz, as its producer stores it in bf16
  (``RmsNormGradRowScaled``): dx and dg, no n; the unfused baseline is still the
  unscaled path."""
  def case(key, run):
    ks = jax.random.split(key, 5)
    x = spread_rows(ks[0], (OM, ON), BF16)
    g = 1 + 0.1 * normal(ks[1], (ON,))
    w = normal(ks[2], (ON, OK), BF16) * ON ** -0.5  # (D, D_out): B stored (N, K)
    dz, dres = normal(ks[3], (OM, OK), BF16), normal(ks[4], (OM, ON), BF16)
    with jax.default_matmul_precision("highest"):
      fwd = lambda x, g: (jax.lax.rsqrt(jnp.mean(x * x, axis=1) + RMS_EPS)[:, None] * x * g) @ _up(w)
      xf = _up(x)
      r = jax.lax.rsqrt(jnp.mean(xf * xf, axis=1) + RMS_EPS)
      c = jnp.sum(_up(dz) * fwd(xf, g), axis=1) / ON  # the zdz term
      dx, dg = jax.grad(lambda x, g: jnp.sum(fwd(x, g) * _up(dz)), argnums=(0, 1))(xf, g)
    truth = {"dx": dx + _up(dres), "dg": dg, "n": r[:, None] * xf * g}
    dn = _up(jnp.matmul(dz, w.T))  # unfused: XLA's bf16 GEMM, then bf16 elementwise steps
    xhat = _q(r[:, None] * xf)
    unfused = {"dx": _q(_q(r[:, None] * _q(_q(g * dn) - _q(xhat * c[:, None]))) + _up(dres)),
               "dg": jnp.sum(_q(dn * xhat), axis=0), "n": _q(xhat * g)}
    operands = {"x": x, "r": r, "c": c, "g": g, "dres": dres}
    if row_scaled:
      dzr = (r[:, None] * _up(dz)).astype(BF16)  # the producer's one rounding
      got = run(dzr, w, [RmsNormGradRowScaled("x", "r", "c", "g", "dg"), cj.AddTile("dres"),
                         cj.Store("dx")], operands)
      del truth["n"], unfused["n"]
    else:
      got = run(dz, w, [RmsNormGrad("x", "r", "c", "g", "dg", "n"), cj.AddTile("dres"),
                        cj.Store("dx")], operands)
    return got, truth, unfused
  return case


def _xent_case(key, run):
  """logits = r * (h @ wlm^T) is the accumulator; dlogits and <dlogits, logits> against
  autodiff of the weighted cross-entropy (ignored targets: weight 0)."""
  ks = jax.random.split(key, 4)
  h, wlm = gemm_inputs(ks[0], OM, ON, OK, BF16, trans_b=True)
  wlm = wlm * 3 * OK ** -0.5  # logits ~ N(0, 9): a peaked softmax
  r = jnp.abs(1 + 0.2 * normal(ks[1], (OM,)))
  t = jax.random.randint(ks[2], (OM,), 0, ON).at[::7].set(-100).at[1:4].set(
      jnp.array([0, 63, ON - 1]))
  w = normal(ks[3], (OM,)) * (t != -100)
  with jax.default_matmul_precision("highest"):
    logits = r[:, None] * jnp.matmul(_up(h), _up(wlm).T)
  lse = jax.scipy.special.logsumexp(logits, axis=1)
  picked = lambda l: jnp.take_along_axis(l, jnp.maximum(t, 0)[:, None], axis=1)[:, 0]
  d = jax.grad(lambda l: jnp.sum(w * (jax.scipy.special.logsumexp(l, axis=1) - picked(l))))(logits)
  truth = {"d": d, "zdz": jnp.sum(d * logits, axis=1)}
  program = [cj.ScaleRow("r"), SoftmaxXentGrad("lse", "t", "w", "zdz"), cj.Store("d")]
  got = run(h, wlm, program, {"r": r, "lse": lse, "t": t.astype(jnp.int32), "w": w})
  lb = _q(r[:, None] * _up(jnp.matmul(h, wlm.T)))  # unfused bf16
  onehot = jax.nn.one_hot(t, ON, dtype=F32)  # all zero for t = -100
  db = _q(_q(_q(jnp.exp(_q(lb - lse[:, None]))) - onehot) * w[:, None])
  return got, truth, {"d": db, "zdz": jnp.sum(_q(db * lb), axis=1)}


ORACLES = {"gated_grad_silu": _gated_case("silu"), "gated_grad_gelu": _gated_case("gelu"),
           "rmsnorm_grad": _rmsnorm_case(False), "rmsnorm_grad_row_scaled": _rmsnorm_case(True),
           "xent_grad": _xent_case}


@pytest.mark.parametrize("name", list(ORACLES))
def test_backward_kernel_against_autodiff(name, key, kernel_impl):
  """Every output of each backward program, through the kernel (B stored (N, K), as the
  backward GEMMs read it), against autodiff of an independent forward."""
  def run(a, b, program, operands):
    return jax.jit(lambda a, b, o: cj.gemm_epilogue(a, b, program, o, trans_b=True,
                                                    impl=kernel_impl))(a, b, operands)
  got, truth, unfused = ORACLES[name](key, run)
  assert set(got) == set(truth)
  for out in got:
    assert got[out].shape == truth[out].shape, out
    assert got[out].dtype == (F32 if got[out].ndim == 1 else BF16), out
    assert_within_baseline(got[out], truth[out], unfused[out], f"{name}:{out}")
