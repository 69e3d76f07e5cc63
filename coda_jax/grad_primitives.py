"""Epilogue primitives of the backward pass (``docs/design.md`` §1.3 "Backward of a
block", §1.4 "LM head and cross-entropy").

Each is one fused step on the fp32 accumulator, written against the same ``Env`` as the
forward primitives, so the jnp reference and the kernel share one definition:

- ``RmsNormGrad``: acc = dn = dz @ W^T of a GEMM whose input was n = r * x * g. Emits
  dx = r * (g * dn - xhat * c) (xhat = r * x, c = <dz, z> / D by the zdz identity, passed
  in), the column partials of dn * xhat (-> dg) and n itself (the A operand of dW).
- ``RmsNormGradRowScaled``: the same backward from acc = r * dn, the GEMM of a cotangent
  its producer stored already multiplied by r per row. Emits dx and the dg partials, and
  no n: dW = n^T dz = diag(g) x^T (r * dz) reads the saved x instead
  (``docs/row_scaled_cotangent.md``).
- ``GatedGrad``: acc = dy of y = act(a) * b. Reads the saved pre-activation pairs (twice
  the accumulator's width), emits dz = (da, db) in the same pair-blocked layout, row
  partials of <dz, z> (zdz -> c) and, unless the forward kept it, the recomputed y (the
  A operand of the next dW).
- ``SoftmaxXentGrad``: acc = logits. Emits dlogits = (softmax - onehot) * w[m] and row
  partials of <dlogits, logits> (zdz for the final RMSNorm).
- ``ExpShifted``: acc = logits. exp(logits - shift[m]): the LM head's stored
  exponentials (``block_gemms.lm_head_exp``), which the dh and dW GEMMs read in place of
  dlogits, scaled per row.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from pallas_kernels import EpilogueOutput, InputKind, OutputKind
from coda_jax.primitives import ACTIVATIONS, Primitive, _join



@dataclasses.dataclass(frozen=True)
class _RmsNormGradOperands(Primitive):
  """The operands and the dg output that both RMSNorm backwards name: ``x`` (M, N) tile
  (the norm's input), ``r`` (M,) reciprocal RMS, ``c`` (M,) the zdz term <dz, z> / D,
  ``g`` (N,) norm weight; ``dg`` the column partials of the weight's gradient."""
  _keeps_zero_rows = True
  _column_sums_via_env = True
  x: str
  r: str
  c: str
  g: str
  dg: str

  def inputs(self):
    return {self.x: InputKind.TILE, self.r: InputKind.ROW, self.c: InputKind.ROW,
            self.g: InputKind.COL}


@dataclasses.dataclass(frozen=True)
class RmsNormGrad(_RmsNormGradOperands):
  """dn -> dx = r * (g * dn - xhat * c); stores dg partials (``dg``) and n (``n``).

  Operands: ``x`` (M, N) tile (the norm's input), ``r`` (M,) reciprocal RMS, ``c`` (M,)
  the zdz term <dz, z> / D, ``g`` (N,) norm weight."""
  n: str
  n_dtype: Any = jnp.bfloat16

  def outputs(self, width):
    return (EpilogueOutput(self.dg, OutputKind.COL_PARTIAL, jnp.float32),
            EpilogueOutput(self.n, OutputKind.TILE, jnp.dtype(self.n_dtype)))

  def apply(self, dn, env):
    r = env.load(self.r).astype(jnp.float32)[:, None]
    c = env.load(self.c).astype(jnp.float32)[:, None]
    g = env.load(self.g).astype(jnp.float32)[None, :]
    xhat = r * env.load(self.x).astype(jnp.float32)
    env.store_column_sum(self.dg, dn * xhat)
    env.store(self.n, xhat * g)
    return r * (g * dn - xhat * c)

  def finish(self, raw):
    return {self.dg: jnp.sum(raw[self.dg], axis=0), self.n: raw[self.n]}


@dataclasses.dataclass(frozen=True)
class RmsNormGradRowScaled(_RmsNormGradOperands):
  """acc = r * dn -> dx = g * acc - r^2 x c; stores the dg partials (``dg``) and no n.

  The GEMM's A operand is the cotangent dz' = r * dz of z = n @ W (n = r x g), which its
  producer's epilogue scaled per row (``ScaleRow``), so the accumulator is
  dz' @ W^T = r * dn. Then r * (g * dn - xhat * c) = g * acc - r^2 x c and
  dg = sum over rows of dn * xhat = sum of acc * x, and the weight gradient
  n^T dz = diag(g) x^T dz' needs x (saved) in place of n (``docs/row_scaled_cotangent.md``).

  Operands: ``x`` (M, N) tile (the norm's input), ``r`` (M,) reciprocal RMS, ``c`` (M,)
  the zdz term <dz, z> / D (of the unscaled dz), ``g`` (N,) norm weight."""

  def outputs(self, width):
    return (EpilogueOutput(self.dg, OutputKind.COL_PARTIAL, jnp.float32),)

  def apply(self, acc, env):
    r = env.load(self.r).astype(jnp.float32)
    rrc = (r * r * env.load(self.c).astype(jnp.float32))[:, None]
    g = env.load(self.g).astype(jnp.float32)[None, :]
    x = env.load(self.x).astype(jnp.float32)
    env.store_column_sum(self.dg, acc * x)
    return g * acc - x * rrc

  def finish(self, raw):
    return {self.dg: jnp.sum(raw[self.dg], axis=0)}


@dataclasses.dataclass(frozen=True)
class GatedGrad(Primitive):
  """dy -> dz = (dy * b * act'(a), dy * act(a)) per pair; doubles the width.

  ``z`` is the (M, 2N) pre-activation in the pair-blocked layout of ``Gated(block)``
  (accumulator column block i of width ``block`` pairs with z's block i of 2 * block).
  Stores row partials of <dz, z> (``zdz``) and, when ``y`` names it, y = act(a) * b
  (width N); ``y=None`` where the forward kept y (``BlockConfig.mlp_residuals``)."""
  _keeps_zero_rows = True
  _column_sums_via_env = True
  z: str
  block: int
  y: str | None
  zdz: str
  activation: str = "silu"
  y_dtype: Any = jnp.bfloat16

  def __post_init__(self):
    if self.activation not in ACTIVATIONS:
      raise ValueError(f"GatedGrad.activation={self.activation!r}: one of "
                       f"{sorted(ACTIVATIONS)}")
    if self.block <= 0 or self.block % 8:
      raise ValueError(f"GatedGrad.block={self.block} must be a positive multiple of 8")

  def inputs(self):
    return {self.z: InputKind.WIDE_TILE}

  def outputs(self, width):
    zdz = EpilogueOutput(self.zdz, OutputKind.ROW_PARTIAL, jnp.float32)
    if self.y is None:
      return (zdz,)
    return (EpilogueOutput(self.y, OutputKind.TILE, jnp.dtype(self.y_dtype), width), zdz)

  def width_factor(self):
    return 2

  def column_group(self):
    return self.block  # accumulator block i pairs with z's 2*block-wide block i

  def apply(self, dy, env):
    z = env.load(self.z).astype(jnp.float32)
    p, act = self.block, ACTIVATIONS[self.activation][1]
    ys, dzs, zdz = [], [], 0.0
    for i in range(dy.shape[1] // p):
      a, b = z[:, 2 * p * i:2 * p * i + p], z[:, 2 * p * i + p:2 * p * (i + 1)]
      g = dy[:, p * i:p * (i + 1)]
      f, df = act(a)
      da, db = g * b * df, g * f
      if self.y is not None:
        ys.append(f * b)
      dzs += [da, db]
      zdz = zdz + jnp.sum(a * da + b * db, axis=1)
    if self.y is not None:
      env.store(self.y, _join(ys))
    env.store(self.zdz, zdz)
    return _join(dzs)

  def finish(self, raw):
    done = {self.zdz: jnp.sum(raw[self.zdz], axis=0)}
    if self.y is not None:
      done[self.y] = raw[self.y]
    return done


@dataclasses.dataclass(frozen=True)
class SoftmaxXentGrad(Primitive):
  """logits -> (exp(logits - lse[m]) - onehot(targets[m])) * weight[m].

  ``lse`` (M,) fp32 log-sum-exp of the row, ``targets`` (M,) int32 (outside [0, N) never
  matches, e.g. an ignored target with weight 0), ``weight`` (M,) fp32 the per-row loss
  cotangent. Stores row partials of <dlogits, logits> as ``zdz``.

  ``rest_lse`` and ``target_logit`` (optional, together; (M,) fp32, from the forward's
  fp32 accumulator: ``RowLogSumExp(exclude=, rest=)`` and ``PickColumn``): the target
  column's dlogit is then -exp(rest_lse - lse) * weight and its logit in zdz is
  target_logit. A confident row needs them: its dlogit -(1 - p_t) is tiny beside p_t,
  and exp(z_t - lse) - 1 is wrong in its leading digit once 1 - p_t is below the
  rounding of z_t (stored in fp16: |z_t| 2^-12) or of lse (|lse| 2^-24), as is z_t's
  share of zdz. The option runs in XLA (``block_gemms.xent_grad_from_logits``): inside a
  kernel, Mosaic GPU's layout inference did not finish lowering it for sm90 (jax 0.11.2),
  so the recomputing backward patches the target column afterwards instead
  (``block_gemms.target_column_from_stats``)."""
  _keeps_zero_rows = True
  _column_sums_via_env = True
  lse: str
  targets: str
  weight: str
  zdz: str
  rest_lse: str | None = None
  target_logit: str | None = None

  def __post_init__(self):
    if (self.rest_lse is None) != (self.target_logit is None):
      raise ValueError(f"SoftmaxXentGrad: rest_lse={self.rest_lse!r} and target_logit="
                       f"{self.target_logit!r} go together")

  def inputs(self):
    kinds = {self.lse: InputKind.ROW, self.targets: InputKind.ROW, self.weight: InputKind.ROW}
    if self.rest_lse is not None:
      kinds.update({self.rest_lse: InputKind.ROW, self.target_logit: InputKind.ROW})
    return kinds

  def outputs(self, width):
    return (EpilogueOutput(self.zdz, OutputKind.ROW_PARTIAL, jnp.float32),)

  def apply(self, x, env):
    lse = env.load(self.lse)[:, None]
    p = jnp.exp(x - lse)
    hit = env.column_ids() == env.load(self.targets)[:, None]
    w = env.load(self.weight)[:, None]
    if self.rest_lse is None:
      d = (p - jnp.where(hit, 1.0, 0.0)) * w
      env.store(self.zdz, jnp.sum(d * x, axis=1))
      return d
    # Arithmetic with a 0/1 mask instead of a select between the tile and a row
    # vector (Mosaic GPU's layout inference searches exponentially on the latter);
    # products with 0 and 1 are exact, so the target column is -(1 - p_t) to the bit.
    one = jnp.where(hit, 1.0, 0.0)
    rest = jnp.exp(env.load(self.rest_lse)[:, None] - lse)  # 1 - p_t
    d = (p * (1.0 - one) - one * rest) * w
    zt = env.load(self.target_logit)[:, None]
    env.store(self.zdz, jnp.sum(d * (x * (1.0 - one) + one * zt), axis=1))
    return d

  def column_index_operands(self):
    return (self.targets,)

  def finish(self, raw):
    return {self.zdz: jnp.sum(raw[self.zdz], axis=0)}



@dataclasses.dataclass(frozen=True)
class ExpShifted(Primitive):
  """x -> exp(x - shift[m]); ``shift`` is an (M,) fp32 row operand.

  The LM head's exp-store backward stores this instead of the logits: with
  s[m] = w[m] exp(shift[m] - lse[m]), s * value is the softmax times the row weight; the
  target column is then overwritten with -exp(lse_rest - shift), so that s * value
  there is its exact dlogit -(1 - p_t) w (``block_gemms.lm_head_exp_safe``,
  ``docs/lm_head_exp_store.md``). It does not claim ``keeps_zero_rows``: a zero row
  stores exp(-shift), so a call with column partials would not pad its rows."""
  _column_sums_via_env = True
  shift: str

  def inputs(self):
    return {self.shift: InputKind.ROW}

  def apply(self, x, env):
    return jnp.exp(x - env.load(self.shift).astype(jnp.float32)[:, None])
