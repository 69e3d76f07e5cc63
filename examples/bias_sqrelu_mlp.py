"""A fused op of one's own, written against coda_jax's public API only.

A squared-ReLU MLP with biases and its residual, forward and backward, as five
GEMM-epilogue programs::

    z = x @ W1 + b1,   h = relu(z)^2,   y = x + h @ W2 + b2

Forward: each GEMM's epilogue adds its bias (and the residual), and the first also
stores z and applies the activation: z and h never take an extra pass over memory.
Backward: the GEMM that makes dh = dy @ W2^T applies the activation's derivative
in its epilogue (dz = dh * 2 relu(z), reading z as a tile operand) and sums db1 there.
The GEMM that makes dx adds the residual's gradient dy. dW1 and dW2 are plain GEMMs,
and db2 is a column sum of dy in XLA, because no GEMM of the backward produces dy.

Three new primitives are needed (``AddBias``, ``SquaredRelu``, ``SquaredReluGrad``), a
few lines each. ``docs/new_fused_op.md`` walks through this file.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

import coda_jax as cj


# ---- 1. primitives: what one epilogue step does to the fp32 tile -------------------------
@dataclasses.dataclass(frozen=True)
class AddBias(cj.Primitive):
  """x + b[n]: ``name`` is an (N,) column operand."""
  _column_sums_via_env = True  # sums no rows itself (docs/new_fused_op.md, step 2)
  name: str

  def inputs(self):
    return {self.name: cj.InputKind.COL}

  def apply(self, x, env):
    return x + env.load(self.name).astype(jnp.float32)[None, :]


@dataclasses.dataclass(frozen=True)
class SquaredRelu(cj.Primitive):
  """relu(x)^2."""
  _column_sums_via_env = True

  def apply(self, x, env):
    r = jnp.maximum(x, 0.0)
    return r * r


@dataclasses.dataclass(frozen=True)
class SquaredReluGrad(cj.Primitive):
  """dh -> dz = dh * 2 relu(z), with z an (M, N) tile operand."""
  _column_sums_via_env = True
  z: str

  def inputs(self):
    return {self.z: cj.InputKind.TILE}

  def apply(self, dh, env):
    return dh * 2.0 * jnp.maximum(env.load(self.z).astype(jnp.float32), 0.0)


# ---- 2. the op: forward and backward programs under jax.custom_vjp -------------------------
def sqrelu_mlp(x, w1, b1, w2, b2, *, impl="auto"):
  """y = x + relu(x @ w1 + b1)^2 @ w2 + b2.

  Args:
    x: (M, D) activations, bfloat16 or float16.
    w1: (D, F); b1: (F,); w2: (F, D); b2: (D,). Cast to x's dtype for the GEMMs (biases
      are added in fp32).
    impl: implementations to try (``coda_jax.gemm_epilogue``).

  Returns:
    (M, D) in x's dtype.
  """
  if x.ndim != 2 or w1.shape != (x.shape[1], w2.shape[0]) or w2.shape[1] != x.shape[1]:
    raise ValueError(f"sqrelu_mlp: x (M, D), w1 (D, F), w2 (F, D); got {x.shape}, "
                     f"{w1.shape}, {w2.shape}")
  if b1.shape != (w1.shape[1],) or b2.shape != (x.shape[1],):
    raise ValueError(f"sqrelu_mlp: b1 ({w1.shape[1]},) and b2 ({x.shape[1]},); got "
                     f"{b1.shape}, {b2.shape}")
  return _mlp(x, w1, b1, w2, b2, impl)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _mlp(x, w1, b1, w2, b2, impl):
  return _mlp_fwd(x, w1, b1, w2, b2, impl)[0]


def _mlp_fwd(x, w1, b1, w2, b2, impl):
  dt = x.dtype
  first = cj.gemm_epilogue(x, w1.astype(dt), [AddBias("b1"), cj.Store("z", dt), SquaredRelu(),
                                              cj.Store("h", dt)],
                           {"b1": b1.astype(jnp.float32)}, impl=impl)
  y = cj.gemm_epilogue(first["h"], w2.astype(dt), [AddBias("b2"), cj.AddTile("x"),
                                                    cj.Store("y", dt)],
                       {"b2": b2.astype(jnp.float32), "x": x}, impl=impl)["y"]
  return y, (x, w1, b1, w2, b2, first["z"], first["h"])


def _mlp_bwd(impl, saved, dy):
  x, w1, b1, w2, b2, z, h = saved
  dt = x.dtype
  # dh = dy @ w2^T (w2 stored (F, D): read transposed), then the activation's derivative
  # and db1's column sums in the same epilogue.
  g = cj.gemm_epilogue(dy, w2.astype(dt), [SquaredReluGrad("z"), cj.Store("dz", dt),
                                           cj.ColSum("db1")],
                       {"z": z}, trans_b=True, impl=impl)
  dz = g["dz"]
  # dx = dz @ w1^T + dy (the residual's gradient rides in the epilogue).
  dx = cj.gemm_epilogue(dz, w1.astype(dt), [cj.AddTile("dy"), cj.Store("dx", dt)],
                        {"dy": dy}, trans_b=True, impl=impl)["dx"]
  # Weight gradients: contraction over the rows (x, h read transposed), fp32.
  dw1 = cj.gemm_epilogue(x, dz, [cj.Store("dw", jnp.float32)], trans_a=True, impl=impl)["dw"]
  dw2 = cj.gemm_epilogue(h, dy, [cj.Store("dw", jnp.float32)], trans_a=True, impl=impl)["dw"]
  db2 = jnp.sum(dy.astype(jnp.float32), axis=0)
  # Under jax.shard_map, replicated weights' gradients vary over the row shards: sum
  # them there (no-op elsewhere; under plain jit coda_jax.partitioning already did).
  grads = [cj.reduce_like(gr, p).astype(p.dtype)
           for gr, p in ((dw1, w1), (g["db1"], b1), (dw2, w2), (db2, b2))]
  return (dx, *grads)


_mlp.defvjp(_mlp_fwd, _mlp_bwd)


# ---- 3. the same math in plain jnp: the test's baseline and the fallback you compare to ----
def sqrelu_mlp_reference(x, w1, b1, w2, b2):
  dt = x.dtype
  z = (x @ w1.astype(dt)).astype(jnp.float32) + b1
  h = jnp.square(jnp.maximum(z.astype(dt).astype(jnp.float32), 0.0)).astype(dt)
  y = (h @ w2.astype(dt)).astype(jnp.float32) + b2 + x.astype(jnp.float32)
  return y.astype(dt)
