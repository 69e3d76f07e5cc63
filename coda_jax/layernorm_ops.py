"""LayerNorm, column bias and GPT-2's GELU MLP as GEMM-epilogue programs.

Math and derivation of the backward: ``docs/layernorm_math.md``.

    x, h, mu, r = residual_layernorm(y, w, residual, g, bias=b)   x = y @ w + b + residual,
                                                                  h = x * g, (mu, r) of x
    z   = layernorm_matmul(h, mu, r, g, beta, w, bias=c)          LN(x) @ w + c
    out = layernorm_gelu_mlp(x, h, mu, r, g, beta, w1, b1, w2, b2)
                                                    x + gelu(LN(x) @ w1 + b1) @ w2 + b2
    out, h', mu', r' = layernorm_gelu_mlp(..., next_norm=g')
                                                    the same, with the next norm's split
    out = residual_layernorm_gelu_mlp(y, w, residual, g, beta, w1, b1, w2, b2)
                                                    the first and third as one op
    out, z' = residual_layernorm_gelu_mlp(..., next_norm=g', next_norm_bias=beta',
                                          next_w=w', next_bias=c')
                                                    ... on to LN'(out) @ w' + c'

As with RMSNorm (``fused_ops``), the norm is split: the GEMM that produces x emits row
partials of sum(x) and sum(x^2) and stores x and h = x * g; the GEMM that consumes LN(x)
applies ``ScaleRow(r)``, the rank-1 term ``-(r mu) (x) (g @ W)`` and the column vector
``beta @ W (+ bias)``. Compose the ops (feed one's (x, h, mu, r) to the next) and
``jax.grad`` yields the whole LayerNorm backward; its producer part (the row terms, which
are finished only after the GEMM that makes dh) is one ``epilogue_pass``
(``LayerNormInputGrad``).

Shapes, dtypes and ``impl`` as in ``fused_ops``: activations (..., D) bfloat16 or float16
(float32 runs the XLA path), weights any float dtype (cast to the activations' dtype for
the GEMM), norm weights and biases added in fp32, (mu, r) fp32, gradients returned in each
parameter's own dtype.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning

import pallas_kernels as pk
from coda_jax import block_gemms as S
from coda_jax import dispatch, partitioning
from coda_jax.fused_ops import check_act, check_residual, check_rows, check_weight, flat_rows
from coda_jax.epilogue_gemm import epilogue_pass, gemm_epilogue
from coda_jax.primitives import (ACTIVATIONS, AddBias, AddTile, ColSum, MulTile, Primitive,
                                 RowSum, ScaleCol, ScaleRow, Store)
from coda_jax.residuals import fenced
from coda_jax.sharding import reduce_like, vary_like, varying_axes
from pallas_kernels import EpilogueOutput, InputKind, OutputKind

_F32 = jnp.float32


# ---- configuration -----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class LayerNormConfig:
  """LayerNorm's settings.

  Attributes:
    eps: added to the variance before the reciprocal square root; a positive finite
      number (GPT-2 uses 1e-5).
  """
  eps: float = 1e-5

  def __post_init__(self):
    eps = self.eps
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
      raise ValueError(f"LayerNormConfig.eps={eps!r}: must be a Python float, e.g. 1e-5")
    if not (math.isfinite(eps) and eps > 0):
      raise ValueError(f"LayerNormConfig.eps={eps!r}: must be positive and finite, e.g. 1e-5")


# ---- primitives --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class AddOuter(Primitive):
  """x + sign * u[m] * v[n]: a rank-1 update; ``row`` an (M,), ``col`` an (N,) operand,
  ``sign`` +1 or -1 (LayerNorm's mean term is ``AddOuter("r_mu", "gw", -1)``)."""
  _keeps_zero_rows = True  # u = 0 on a zero row
  _column_sums_via_env = True
  row: str
  col: str
  sign: float = 1.0

  def __post_init__(self):
    if self.sign not in (1, -1):
      raise ValueError(f"AddOuter.sign={self.sign!r}: must be 1 or -1 (scale the operand "
                       "for other factors)")

  def inputs(self):
    return {self.row: InputKind.ROW, self.col: InputKind.COL}

  def apply(self, x, env):
    u = env.load(self.row).astype(_F32)[:, None]
    v = env.load(self.col).astype(_F32)[None, :]
    return x + u * v if self.sign == 1 else x - u * v


# gelu'(z) of the tanh form lies in [-0.12899, 1.12899] (its extremes at z = -+1.4185;
# gelu'(-z) = 1 - gelu'(z)). A uint8 slope stores it as the code q = round((s - lo) /
# step), lo = -0.13 and step = 1/200 (up to lo + 255 step = 1.145): an absolute error of
# at most step / 2 = 0.0025, below bf16's rounding of s near 1 (2^-8 = 0.0039). The
# saturated slopes 0 and 1 (|z| past ~4, as common as bf16 makes them exact) are codes
# 26 and 226, exact too: no bias where many elements share them.
# docs/layernorm_math.md, section 3.
SLOPE_CODE_LO = -0.13
SLOPE_CODE_STEP = 0.005


def slope_code(s: jax.Array) -> jax.Array:
  """fp32 slopes -> (s - lo) / step + 1/2, kept in [0, 255.5]: what ``Gelu`` stores for
  a uint8 slope. The store's conversion truncates it (toward zero) to round((s - lo) /
  step); a value past the range takes its end.

  Args:
    s: gelu'(z) values, any shape (``Gelu`` passes its (M, N) tile in fp32).

  Returns:
    fp32, s's shape: (s - SLOPE_CODE_LO) / SLOPE_CODE_STEP + 1/2 clipped to [0, 255.5],
    not yet rounded (the uint8 store truncates it).
  """
  return jnp.clip(s * jnp.float32(1 / SLOPE_CODE_STEP)
                  + jnp.float32(0.5 - SLOPE_CODE_LO / SLOPE_CODE_STEP), 0.0, 255.5)


def slope_dtype_for(dtype) -> Any:
  """The dtype GPT-2's MLP stores gelu'(z) in for activations of ``dtype``: uint8 (the
  code above; half bf16's bytes, and its error is below bf16's own rounding of the
  slope's larger values) for bfloat16; the activations' own dtype otherwise (float16's
  2^-11 rounding is finer than the code's step).

  Args:
    dtype: the activations' dtype (anything ``jnp.dtype`` accepts).

  Returns:
    A numpy dtype: uint8 for bfloat16, else ``jnp.dtype(dtype)``.
  """
  return jnp.dtype(jnp.uint8) if jnp.dtype(dtype) == jnp.bfloat16 else jnp.dtype(dtype)


def slope_multiplier(name: str, dtype) -> MulTile:
  """The step that multiplies by a slope ``Gelu(slope=name, slope_dtype=dtype)`` stored.

  Args:
    name: the (M, N) tile operand that holds the stored slope.
    dtype: the dtype it was stored in (``slope_dtype_for``'s).

  Returns:
    For uint8, ``MulTile(name, scale=SLOPE_CODE_STEP, offset=SLOPE_CODE_LO)``, which
    multiplies by the decoded slope SLOPE_CODE_LO + SLOPE_CODE_STEP * q of each code q;
    for any other dtype, ``MulTile(name)``, which multiplies by the stored value.
  """
  if jnp.dtype(dtype) == jnp.uint8:
    return MulTile(name, scale=SLOPE_CODE_STEP, offset=SLOPE_CODE_LO)
  return MulTile(name)


@dataclasses.dataclass(frozen=True)
class Gelu(Primitive):
  """gelu(x), tanh form (GPT-2's); the same definition as ``Gated``'s "gelu". With
  ``slope``, also stores gelu'(x) (in ``slope_dtype``) as that (M, N) output, for a
  backward that multiplies by it (``slope_multiplier``) instead of recomputing it.
  ``slope_dtype`` uint8 stores the one-byte code (``SLOPE_CODE_LO``, ``SLOPE_CODE_STEP``)."""
  _keeps_zero_rows = True  # gelu(0) = 0 (a stored slope row is gelu'(0) = 1/2: sliced off)
  _column_sums_via_env = True
  slope: str | None = None
  slope_dtype: Any = jnp.bfloat16

  def __post_init__(self):
    dt = jnp.dtype(self.slope_dtype)
    if not (jnp.issubdtype(dt, jnp.floating) or dt == jnp.uint8):
      raise ValueError(f"Gelu.slope_dtype={dt}: a float dtype, or uint8 for the one-byte "
                       "code (layernorm_ops.SLOPE_CODE_STEP)")

  def outputs(self, width):
    if self.slope is None:
      return ()
    return (EpilogueOutput(self.slope, OutputKind.TILE, jnp.dtype(self.slope_dtype)),)

  def apply(self, x, env):
    if self.slope is None:
      return ACTIVATIONS["gelu"][0](x)
    f, df = ACTIVATIONS["gelu"][1](x)
    if jnp.dtype(self.slope_dtype) == jnp.uint8:
      df = slope_code(df)
    env.store(self.slope, df)
    return f

  def finish(self, raw):
    return {} if self.slope is None else {self.slope: raw[self.slope]}


@dataclasses.dataclass(frozen=True)
class GeluGrad(Primitive):
  """da -> dz = da * gelu'(z), with ``z`` the (M, N) saved pre-activation (tile operand).
  Stores the recomputed a = gelu(z) as ``a`` (the A operand of the next weight
  gradient), so the forward need not keep it."""
  _keeps_zero_rows = True  # da = 0 and z = 0 give dz = 0 and a = gelu(0) = 0
  _column_sums_via_env = True
  z: str
  a: str
  a_dtype: Any = jnp.bfloat16

  def inputs(self):
    return {self.z: InputKind.TILE}

  def outputs(self, width):
    return (EpilogueOutput(self.a, OutputKind.TILE, jnp.dtype(self.a_dtype)),)

  def apply(self, da, env):
    f, df = ACTIVATIONS["gelu"][1](env.load(self.z).astype(_F32))
    env.store(self.a, f)
    return da * df

  def finish(self, raw):
    return {self.a: raw[self.a]}


@dataclasses.dataclass(frozen=True)
class LayerNormGrad(Primitive):
  """dn -> dh = r * dn, for a consumer z = r (h @ W) - (r mu) (x) (g @ W) + beta @ W + ...
  whose accumulator here is dn = dz @ W^T (``docs/layernorm_math.md`` section 2).

  Operands: ``h`` (M, N) tile (x * g), ``mu`` and ``r`` (M,) rows, ``g`` and ``beta`` (N,)
  columns. Outputs (names are fields): ``dr`` and ``dmu`` row partials (the cotangents of
  r and mu: sum dn (h - mu g) and -r sum dn g), ``dbeta`` and ``dg`` column partials
  (sum dn, and g's path through g @ W: -sum mu dh, with dh rounded to ``dtype`` as it is
  returned, so that it cancels exactly against the producer's sum dh x), and ``n`` =
  r (h - mu g) + beta (the normalised input: the A operand of dW) in ``dtype``. A row
  with r = 0 (only a zero-padded row: r = 1/sqrt(var + eps) > 0 otherwise) stores n = 0,
  so a zero row stays zero in every output."""
  _keeps_zero_rows = True
  _column_sums_via_env = True
  h: str
  mu: str
  r: str
  g: str
  beta: str
  dr: str = "dr"
  dmu: str = "dmu"
  dbeta: str = "dbeta"
  dg: str = "dg"
  n: str = "n"
  dtype: Any = jnp.bfloat16

  def inputs(self):
    return {self.h: InputKind.TILE, self.mu: InputKind.ROW, self.r: InputKind.ROW,
            self.g: InputKind.COL, self.beta: InputKind.COL}

  def outputs(self, width):
    return (EpilogueOutput(self.dr, OutputKind.ROW_PARTIAL, _F32),
            EpilogueOutput(self.dmu, OutputKind.ROW_PARTIAL, _F32),
            EpilogueOutput(self.dbeta, OutputKind.COL_PARTIAL, _F32),
            EpilogueOutput(self.dg, OutputKind.COL_PARTIAL, _F32),
            EpilogueOutput(self.n, OutputKind.TILE, jnp.dtype(self.dtype)))

  def apply(self, dn, env):
    mu = env.load(self.mu).astype(_F32)
    r = env.load(self.r).astype(_F32)
    g = env.load(self.g).astype(_F32)[None, :]
    beta = env.load(self.beta).astype(_F32)[None, :]
    hc = self.centred(env.load(self.h).astype(_F32), mu[:, None], g)  # (x - mu) g
    dh = r[:, None] * dn
    dh_stored = dh.astype(self.dtype).astype(_F32)
    env.store(self.dr, jnp.sum(dn * hc, axis=1))
    env.store(self.dmu, -r * jnp.sum(dn * g, axis=1))
    env.store_column_sum(self.dbeta, dn)
    env.store_column_sum(self.dg, (-mu)[:, None] * dh_stored)
    live = (r > 0).astype(_F32)[:, None]
    env.store(self.n, r[:, None] * hc + live * beta)
    return dh

  def finish(self, raw):
    out = {nm: jnp.sum(raw[nm], axis=0) for nm in (self.dr, self.dmu, self.dbeta, self.dg)}
    out[self.n] = raw[self.n]
    return out

  @staticmethod
  def centred(h, mu, g):
    """(x - mu) g from the tile operand h = x g."""
    return h - mu * g


@dataclasses.dataclass(frozen=True)
class LayerNormGradFromX(LayerNormGrad):
  """``LayerNormGrad`` whose tile operand (still named by the field ``h``) is x itself,
  not h = x g: for a backward that kept x alone. (x - mu) g from x rounds once, as the
  unfused LayerNorm does; from a recomputed h = round(x) g it would round twice, which
  rows far from zero mean (docs/layernorm_math.md section 4) do not tolerate."""

  @staticmethod
  def centred(x, mu, g):
    return (x - mu) * g


@dataclasses.dataclass(frozen=True)
class LayerNormInputGrad(Primitive):
  """acc -> acc + g dh + a - b (x - mu): the producer part of the LayerNorm backward
  (``docs/layernorm_math.md`` section 2), with acc = dx (an ``AddTile`` before it), a =
  dmu / D and b = dr r^3 / D, for h = x * g and the statistics (mu, r) of x. Also emits
  g's gradient through h, ``dg`` = sum_rows dh x, as a column partial.

  Operands: ``dh`` and ``x`` (M, N) tiles, ``g`` an (N,) column, ``mu``, ``a``, ``b`` (M,)
  rows. A zero-padded row (zero tiles, a = b = 0) stays zero."""
  _keeps_zero_rows = True
  _column_sums_via_env = True
  dh: str
  x: str
  g: str
  mu: str
  a: str
  b: str
  dg: str = "dg"

  def inputs(self):
    return {self.dh: InputKind.TILE, self.x: InputKind.TILE, self.g: InputKind.COL,
            self.mu: InputKind.ROW, self.a: InputKind.ROW, self.b: InputKind.ROW}

  def outputs(self, width):
    return (EpilogueOutput(self.dg, OutputKind.COL_PARTIAL, _F32),)

  def apply(self, acc, env):
    dh = env.load(self.dh).astype(_F32)
    x = env.load(self.x).astype(_F32)
    env.store_column_sum(self.dg, dh * x)
    g = env.load(self.g).astype(_F32)[None, :]
    mu, a, b = (env.load(nm).astype(_F32)[:, None] for nm in (self.mu, self.a, self.b))
    return acc + dh * g + a - b * (x - mu)

  def finish(self, raw):
    return {self.dg: jnp.sum(raw[self.dg], axis=0)}


# ---- input checks ------------------------------------------------------------------------
def check_vector(name, v, width):
  """A (width,) floating parameter (a bias or a norm weight)."""
  if not hasattr(v, "dtype") or not jnp.issubdtype(v.dtype, jnp.floating):
    raise ValueError(f"{name}.dtype={getattr(v, 'dtype', type(v).__name__)}: must be a "
                     "floating-point array")
  if tuple(v.shape) != (width,):
    raise ValueError(f"{name} has shape {tuple(v.shape)}, expected ({width},): one value "
                     "per output column")


def _check_stats(h, mu, r):
  check_rows("mu", mu, h.shape[:-1], "float")
  check_rows("r", r, h.shape[:-1], "float")
  for name, v in (("mu", mu), ("r", r)):
    if not jnp.issubdtype(v.dtype, jnp.floating):
      raise ValueError(f"{name}.dtype={v.dtype}: must be floating point (float32, as "
                       "residual_layernorm returns it)")


def _f32(v):
  return None if v is None else v.astype(_F32)


# ---- GEMM-epilogue calls -----------------------------------------------------------------
def stats_from_sums(s1, s2, d, eps):
  """(mu, r) per row from the row sums of x and x^2 over d columns (fp32; var clamped at
  0 against rounding; ``docs/layernorm_math.md`` section 4 on cancellation).

  Args:
    s1: (M,) fp32 sums of each row of x.
    s2: (M,) fp32 sums of each row of x^2.
    d: the number of columns summed (the rows' length).
    eps: LayerNorm's epsilon, added to the variance.

  Returns:
    (mu, r), each of s1's shape and dtype: the mean mu = s1 / d and
    r = 1/sqrt(var + eps), with var = max(s2 / d - mu^2, 0).
  """
  mu = s1 / d
  var = jnp.maximum(s2 / d - mu * mu, 0.0)
  return mu, jax.lax.rsqrt(var + eps)


# How many 16-bit parts ``norm_columns`` splits g and beta into: three 8-bit (bfloat16)
# or 11-bit (float16) significands cover fp32's 24.
NORM_COLUMN_PARTS = 3


def split_parts(v, dtype, parts=NORM_COLUMN_PARTS):
  """fp32 ``v`` as ``parts`` stacked ``dtype`` arrays whose fp32 sum is v (exactly, for
  three parts): each part is what the earlier ones left, its significand cut to
  ``dtype``'s by masking the fp32 bits, so the subtraction is exact and the part converts
  to ``dtype`` exactly (but for float16's range). The cut is a bit mask, not a rounding
  convert: XLA on the GPU may drop a float32 -> 16-bit -> float32 round trip as excess
  precision (``xla_allow_excess_precision``), which left every part after the first
  zero there."""
  drop = jnp.finfo(_F32).nmant - jnp.finfo(dtype).nmant
  mask = np.uint32((0xFFFFFFFF << drop) & 0xFFFFFFFF)
  out, rest = [], v.astype(_F32)
  for _ in range(parts):
    part = jax.lax.bitcast_convert_type(
        jax.lax.bitcast_convert_type(rest, jnp.uint32) & mask, _F32)
    out.append(part)
    rest = rest - part
  return jnp.concatenate(out).astype(dtype)


def norm_columns(g, beta, w, bias=None):
  """(g @ w, beta @ w + bias) in fp32, from the 16-bit ``w`` the GEMM reads.

  One 16-bit GEMM with fp32 accumulation over ``w``: g and beta are split into 16-bit
  parts (``split_parts``), so every product with a 16-bit w is exact in fp32, and the
  parts' results are summed. This reads w once at its own width, where an fp32 product
  at HIGHEST precision converted it first (47.6 against 9.0 us at GPT-2 1B's w1 on the
  H100). A float32 w takes that fp32 product.

  Args:
    g: (D,) LayerNorm weight, any float dtype (taken in fp32).
    beta: (D,) LayerNorm bias, any float dtype (taken in fp32).
    w: (D, N) the weight as the GEMM reads it: bfloat16 or float16 for the split
      product; any other dtype is converted to fp32 for a HIGHEST-precision product.
    bias: optional (N,) bias of the GEMM, added to beta @ w in fp32.

  Returns:
    (gw, cw), each (N,) fp32: gw = g @ w and cw = beta @ w (+ bias).
  """
  v = jnp.stack([g, beta]).astype(_F32)
  if w.dtype in (jnp.bfloat16, jnp.float16):
    parts = jnp.matmul(split_parts(v, w.dtype), w, preferred_element_type=_F32)
    gb = parts.reshape(NORM_COLUMN_PARTS, 2, -1).sum(axis=0)
  else:
    gb = jnp.matmul(v, w.astype(_F32), precision=jax.lax.Precision.HIGHEST)
  return gb[0], gb[1] if bias is None else gb[1] + bias.astype(_F32)


def norm_matmul_program(tail):
  """The consumer's epilogue: r * acc - (r mu) (x) gw + cw, then ``tail``."""
  return [ScaleRow("r"), AddOuter("r_mu", "gw", -1.0), AddBias("cw"), *tail]


def norm_matmul_operands(mu, r, gw, cw):
  return {"r": r, "r_mu": r * mu, "gw": gw, "cw": cw}


def norm_matmul_grad(dz, w, h, mu, r, g, beta, impl, tile=LayerNormGrad):
  """dn = dz @ w^T with ``LayerNormGrad``: returns dh, n, dr, dmu, dbeta, dg'. With
  ``tile=LayerNormGradFromX``, ``h`` is x itself."""
  dt = dz.dtype
  out = gemm_epilogue(dz, w, [tile("h", "mu", "r", "g", "beta", dtype=dt),
                              Store("dh", dt)],
                      {"h": h, "mu": mu, "r": r, "g": g.astype(_F32),
                       "beta": beta.astype(_F32)}, trans_b=True, impl=impl)
  return out["dh"], out["n"], out["dr"], out["dmu"], out["dbeta"], out["dg"]


# ---- LayerNorm's whole input gradient in one GEMM (row totals) ----------------------------
# The consumer's dn = dz @ w^T and the producer's row terms, finished inside one epilogue:
# the first pass sums g dn and g dn (x - mu) over each tile's columns, the row block's
# tiles exchange them (``pallas_kernels`` row_total outputs), and the second pass writes
#     dxt = dx + r (g dn - a - xhat c),  a = sum g dn / D,  c = r sum g dn (x - mu) / D
# with n = xhat g + beta and the column partials of dbeta, dg and dxt (a bias's gradient)
# (``docs/layernorm_math.md`` section 6). ``Primitive``/``Env`` have no row totals yet, so
# this one program is written against ``pallas_kernels.gemm`` and checks here what
# ``dispatch`` would; where it cannot run, the ops take the two-kernel path
# (``norm_matmul_grad``, then ``stats_cotangent``): the same math.
ROW_TERMS_OUTPUTS = (EpilogueOutput("dxt", dtype=jnp.bfloat16),
                     EpilogueOutput("n", dtype=jnp.bfloat16),
                     EpilogueOutput("dbeta", OutputKind.COL_PARTIAL, _F32),
                     EpilogueOutput("dg", OutputKind.COL_PARTIAL, _F32),
                     EpilogueOutput("dsum", OutputKind.COL_PARTIAL, _F32),
                     EpilogueOutput("sa", OutputKind.ROW_TOTAL, _F32),
                     EpilogueOutput("sc", OutputKind.ROW_TOTAL, _F32))


_ROW_TERMS_KINDS = {"x": InputKind.TILE, "dx": InputKind.TILE, "mu": InputKind.ROW,
                    "r": InputKind.ROW, "g": InputKind.COL, "beta": InputKind.COL}


def _row_terms_outputs(dtype):
  """``ROW_TERMS_OUTPUTS`` with the tile outputs (dxt, n) in the activations' dtype."""
  return tuple(dataclasses.replace(o, dtype=dtype) if o.kind == OutputKind.TILE else o
               for o in ROW_TERMS_OUTPUTS)


def row_terms_first_pass(tile, dn):
  """The row terms' partials over this sub-tile's columns: sum g dn, sum g dn (x - mu).
  Reads x, not dx, so the kernel stages only x for it."""
  gdn = tile.load("g")[None, :] * dn
  xc = tile.load("x").astype(_F32) - tile.load("mu")[:, None]
  tile.store("sa", jnp.sum(gdn, axis=1))
  tile.store("sc", jnp.sum(gdn * xc, axis=1))


def row_terms_second_pass(d: int):
  """The program proper for rows of length ``d``: dxt, n and the column partials, from
  the row totals "sa" and "sc" (combined as (epi_m,) vectors before they meet the tile:
  Mosaic GPU's layout inference needs that)."""
  inv_d = 1.0 / d

  def second_pass(tile, dn):
    mu, r = tile.load("mu"), tile.load("r")
    gcol, beta = tile.load("g")[None, :], tile.load("beta")[None, :]
    ra = r * tile.load("sa") * inv_d  # r a
    rc = r * r * tile.load("sc") * inv_d  # r c, with c = r sum g dn (x - mu) / D
    xc = tile.load("x").astype(_F32) - mu[:, None]
    xhat = xc * r[:, None]
    dxt = (tile.load("dx").astype(_F32) + r[:, None] * (gcol * dn) - ra[:, None]
           - xc * (r * rc)[:, None])
    tile.store_column_sum("dbeta", dn)
    tile.store_column_sum("dg", dn * xhat)
    tile.store_column_sum("dsum", dxt)
    tile.store("n", xhat * gcol + beta)
    tile.store("dxt", dxt)
  return second_pass


def row_terms_config(d: int, dtype=jnp.bfloat16, stages: int = 5) -> pk.GemmConfig | None:
  """The config of ``layernorm_input_grad``'s GEMM.

  Ping-pong 128x128 tiles clustered along N, the grid walking whole rows
  (``pk.gemm_mgpu.row_totals_conflict``), one operand slot, one output slot and column
  sums per tile: so five pipeline stages fit beside the gathered partials at GPT-2's
  D = 2048 (``docs/layernorm_math.md`` section 6, where each of these is measured).

  Args:
    d: the rows' length (the GEMM's N). dtype: the activations' dtype.
    stages: the most pipeline stages to try.

  Returns:
    The config with the most stages, at most ``stages``, whose shared memory fits; None
    if not even three do.
  """
  dtypes = {nm: dtype if kind == InputKind.TILE else _F32
            for nm, kind in _ROW_TERMS_KINDS.items()}
  for s in range(stages, 2, -1):
    cfg = pk.GemmConfig(tile_m=128, tile_n=128, tile_k=64, stages=s, epi_tile_m=64,
                        epi_tile_n=32, schedule=pk.Schedule.PINGPONG,
                        grid_minor_dim=pk.MatDim.N, grid_tile_width=max(16, d // 256),
                        cluster_dim=pk.MatDim.N, epi_operand_slots=1, epi_out_slots=1,
                        epi_column_sums_per_tile=True)
    if pk.gemm_mgpu.smem_bytes(cfg, dtype, _ROW_TERMS_KINDS, dtypes,
                               _row_terms_outputs(dtype),
                               columns=d) <= pk.gemm_mgpu.SMEM_LIMIT_BYTES:
      return cfg
  return None


def row_terms_gemm(dz, w, x, dx, mu, r, g, beta, config, num_sms=None):
  """The one GEMM of ``layernorm_input_grad``, under ``config``.

  Args:
    dz, w, x, dx, mu, r, g, beta: as ``layernorm_input_grad``.
    config: the kernel config (``row_terms_config``'s, or one to measure).
    num_sms: the persistent grid's size; default the device's SM count.

  Returns:
    (dxt, n, dbeta, dg, dsum) as ``layernorm_input_grad``.

  Raises:
    ValueError: from ``pallas_kernels.gemm``, for a config, shape or grid it refuses.
  """
  operands = {"x": x, "dx": dx, "mu": mu.astype(_F32), "r": r.astype(_F32),
              "g": g.astype(_F32), "beta": beta.astype(_F32)}
  out = pk.gemm(dz, w, trans_b=True, config=config, outputs=_row_terms_outputs(dz.dtype),
                epilogue=row_terms_second_pass(x.shape[1]),
                row_totals_pass=row_terms_first_pass,
                inputs={nm: (kind, operands[nm]) for nm, kind in _ROW_TERMS_KINDS.items()},
                num_sms=num_sms, clip_m=x.shape[0] % config.cluster_tile[0] != 0)
  col = lambda nm: jnp.sum(out[nm], axis=0)
  return out["dxt"], out["n"], col("dbeta"), col("dg"), col("dsum")


def input_grad_gemm_and_pass(dz, w, h, x, dx, mu, r, g, beta, impl):
  """What ``layernorm_input_grad`` runs where the one GEMM cannot: the consumer's GEMM
  with ``LayerNormGrad``, then the producer's pass (``stats_cotangent``); the same math.

  Args:
    dz, w, x, dx, mu, r, g, beta, impl: as ``layernorm_input_grad``.
    h: (M, D) x * g as the producer stored it (``LayerNormGrad`` reads it), or None:
      the GEMM then reads x (``LayerNormGradFromX``).

  Returns:
    (dxt, n, dbeta, dg, dsum) as ``layernorm_input_grad``.
  """
  tile = LayerNormGrad if h is not None else LayerNormGradFromX
  dh, n, dr, dmu, dbeta, dg = norm_matmul_grad(dz, w, x if h is None else h, mu, r, g, beta,
                                               impl, tile)
  dxt, dsum, dg_producer = stats_cotangent(x, g, mu, r, (dx, dh, dmu, dr), impl)
  return dxt, n, dbeta, dg + dg_producer, dsum


def layernorm_input_grad(dz, w, h, x, dx, mu, r, g, beta, impl):
  """A LayerNorm's whole backward from its consumer's cotangent: in one GEMM
  (``row_terms_gemm``) where it can run, else ``input_grad_gemm_and_pass``.

  Args:
    dz: (M, K) the consumer GEMM's output cotangent; w: (D, K) its weight (dn = dz w^T).
    h: (M, D) x * g as the producer stored it, read only by the two-kernel path; None:
      that path reads x instead (``LayerNormGradFromX``), so an op need not keep h.
    x: (M, D) the normalised rows; dx: (M, D) x's cotangent from elsewhere (a residual
      add), both in dz's dtype. mu, r: (M,) fp32 statistics of x. g, beta: (D,).
    impl: as ``coda_jax.gemm_epilogue``; the one GEMM needs "mosaic" first.

  Returns:
    (dxt, n, dbeta, dg, dsum): x's whole cotangent dx + LN's input gradient and the
    normalised rows n = LN(x) (M, D) in dz's dtype; the column sums (fp32, (D,)) of
    dbeta, dg and dxt (a bias's gradient). On several devices the one GEMM runs per
    shard (``row_terms_sharded``); inside ``shard_map`` it runs on the local rows. Where
    it cannot run, the reason is logged once.
  """
  why = config = None
  d = x.shape[1]
  if dispatch.resolve(impl)[0] != "mosaic" or not dispatch.kernels_available():
    why = f"impl={impl!r} does not run the compiled kernel first on this host"
  elif dz.dtype not in (jnp.bfloat16, jnp.float16) or {x.dtype, dx.dtype, w.dtype} != {
      dz.dtype}:
    why = f"dtypes {dz.dtype}, {w.dtype}, {x.dtype}, {dx.dtype}: 16-bit and equal only"
  elif (config := row_terms_config(d, dz.dtype)) is None:
    why = f"D={d}: no pipeline of three stages fits beside the gathered partials"
  if why is None:
    args = (dz, w, x, dx, *(v.astype(_F32) for v in (mu, r, g, beta)))
    rc = RowTermsCall(config, dispatch.target_device().core_count)
    gemm = lambda *a: row_terms_gemm(*a, config, num_sms=rc.num_sms)
    try:  # a shape or grid the kernel refuses raises while tracing, with its reason
      if any(varying_axes(v) for v in args):  # inside shard_map: this shard's rows
        return tuple(vary_like(o, *args) for o in gemm(*args))
      if jax.device_count() == 1:
        return gemm(*args)
      # the whole problem's refusals, before the split (shapes only: the kernel refuses
      # explicitly sharded types, which it never sees inside the rule)
      jax.eval_shape(gemm, *(jax.ShapeDtypeStruct(v.shape, v.dtype) for v in args))
      return row_terms_sharded(rc, *args)
    except ValueError as e:
      why = str(e)
  dispatch.announce(f"LayerNorm's input gradient in one GEMM does not run ({why}); "
                    "it takes the GEMM + pass path")
  return input_grad_gemm_and_pass(dz, w, h, x, dx, mu, r, g, beta, impl)


# ---- the one GEMM on sharded arrays ---------------------------------------------------------
# ``gemm_epilogue``'s rule (``coda_jax.partitioning``) cannot split this call: its row
# totals are exchanged inside the kernel, across the row block's tiles. With the rows (M)
# split, every row is whole on one device, so each device runs the one GEMM on its rows
# and only the column sums (3 D floats) are summed across the row shards. With D (N) or
# the contraction (K) split, a kernel would see part of a row or part of dn: there each
# device forms its fp32 dn in XLA (summed over K's shards), runs the same two passes on
# it (``row_terms_xla``), and sums the first pass's row totals over D's shards (M floats
# each), which is the traffic of the GEMM + pass path's own split.
@dataclasses.dataclass(frozen=True)
class RowTermsCall:
  """What the per-shard rule of the one GEMM keeps static.

  Attributes:
    config: the kernel's config (``row_terms_config``); None: every shard runs the XLA
      form (``row_terms_xla``), for hosts with no kernel (the rule's CPU tests).
    num_sms: the persistent grid's size; None: the device's SM count.
  """
  config: pk.GemmConfig | None
  num_sms: int | None = None


def row_terms_xla(dn, x, dx, mu, r, g, beta, totals=lambda t: t, d=None):
  """The one GEMM's program in XLA on whole arrays, given dn: the kernel's two passes
  (``row_terms_first_pass``, ``row_terms_second_pass``) on one tile spanning the rows.

  Args:
    dn: (M, D) fp32, dz @ w^T. x, dx, mu, r, g, beta: as ``row_terms_gemm``'s (mu, r, g,
      beta fp32).
    totals: applied to each row total of the first pass (sum g dn, sum g dn (x - mu))
      before the second pass reads it: a sum over the shards of D's columns.
    d: the rows' whole length (the mean's divisor); default dn's columns (D unsplit).

  Returns:
    (dxt, n, dbeta, dg, dsum) as ``row_terms_gemm``'s.
  """
  m, d_local = dn.shape
  arrays = {"x": x, "dx": dx, "mu": mu, "r": r, "g": g, "beta": beta}
  specs = {o.name: o for o in _row_terms_outputs(x.dtype)}
  stored = {}

  def tile(names):
    inputs = {nm: (_ROW_TERMS_KINDS.get(nm, InputKind.ROW), lambda v=v: v)
              for nm, v in arrays.items()}
    return pk.EpilogueTile(row0=0, col0=0, shape=(m, d_local), inputs=inputs, outputs={
        nm: (specs[nm], lambda v, nm=nm: stored.__setitem__(nm, v)) for nm in names})
  row_terms_first_pass(tile(("sa", "sc")), dn)
  arrays.update({nm: totals(stored.pop(nm)) for nm in ("sa", "sc")})
  row_terms_second_pass(d or d_local)(tile(("dxt", "n", "dbeta", "dg", "dsum")), dn)
  return tuple(stored[nm] for nm in ("dxt", "n", "dbeta", "dg", "dsum"))


# The call as ``coda_jax.partitioning`` reads a layout: dz @ w^T with x, dx (tiles), mu, r
# (rows) and g, beta (columns); its layout and operand specs are every other call's.
_ROW_TERMS_SPLIT = partitioning.ShardedCall(
    dispatch.Call(program=(), inputs=tuple(_ROW_TERMS_KINDS.items()), outputs=(),
                  column_group=1, trans_b=True), tuple(_ROW_TERMS_KINDS), ())


def _row_terms_specs(mesh, shapes):
  """(layout, operand specs, result specs) for operands arriving with ``shapes``'
  shardings (``partitioning.choose_layout``: M and K as dz is split, D as w's rows are;
  a mesh axis that does not divide its dimension raises, as for every call)."""
  layout = partitioning.choose_layout(_ROW_TERMS_SPLIT, mesh, shapes)
  m, n = (layout.m or None), (layout.n or None)
  ps = jax.sharding.PartitionSpec
  return (layout, partitioning.arg_specs(_ROW_TERMS_SPLIT, layout),
          (ps(m, n), ps(m, n), ps(n), ps(n), ps(n)))


def row_terms_local(rc: RowTermsCall, layout: partitioning.Layout, dz, w, x, dx, mu, r, g,
                    beta):
  """What one device runs of ``row_terms_sharded``: the one GEMM on its rows where only M
  is split (and the kernel takes the local shape), else the XLA form with dn summed over
  K's shards and the row totals over D's; then the column sums over M's shards."""
  out = None
  if rc.config is not None and not layout.n and not layout.k:
    try:
      out = row_terms_gemm(dz, w, x, dx, mu, r, g, beta, rc.config, num_sms=rc.num_sms)
    except ValueError as e:  # a local shape the kernel refuses: the same math in XLA
      dispatch.announce(f"LayerNorm's input gradient: a shard's one GEMM does not run "
                        f"({e}); that shard runs it in XLA")
  if out is None:
    dn = jnp.matmul(dz, w.T, preferred_element_type=_F32)
    if layout.k:
      dn = jax.lax.psum(dn, layout.k)
    sum_n = (lambda t: jax.lax.psum(t, layout.n)) if layout.n else (lambda t: t)
    out = row_terms_xla(dn, x, dx, mu, r, g, beta, totals=sum_n,
                        d=x.shape[1] * (jax.lax.axis_size(layout.n) if layout.n else 1))
  dxt, n, *cols = out
  if layout.m:
    cols = [jax.lax.psum(c, layout.m) for c in cols]
  return (dxt, n, *cols)


def _row_terms_partition(rc, mesh, arg_shapes, result_shape):
  del result_shape
  layout, args, results = _row_terms_specs(mesh, arg_shapes)
  named = lambda spec: jax.sharding.NamedSharding(mesh, spec)
  return (mesh, functools.partial(row_terms_local, rc, layout),
          tuple(map(named, results)), tuple(map(named, args)))


def _row_terms_infer(rc, mesh, arg_shapes, result_shape):
  del rc, result_shape
  return tuple(jax.sharding.NamedSharding(mesh, s)
               for s in _row_terms_specs(mesh, arg_shapes)[2])


_row_terms_partitioned = custom_partitioning(
    lambda rc, *args: row_terms_local(rc, partitioning.Layout((), (), ()), *args),
    static_argnums=(0,))
_row_terms_partitioned.def_partition(
    partition=_row_terms_partition, infer_sharding_from_operands=_row_terms_infer,
    sharding_rule="m k, n k, m n, m n, m, m, n, n -> m n, m n, n, n, n",
    reduction_factors=("k",))


def row_terms_sharded(rc: RowTermsCall, dz, w, x, dx, mu, r, g, beta):
  """``row_terms_gemm`` on operands sharded over a mesh: per shard, as
  ``row_terms_local`` says. Explicitly sharded operands (their types carry the mesh) go
  through ``jax.shard_map``; others through ``custom_partitioning``, whose rule XLA's
  partitioner runs with the shardings it chose.

  Args:
    rc: the kernel's config and grid (``RowTermsCall``).
    dz, w, x, dx, mu, r, g, beta: as ``row_terms_gemm``'s (mu, r, g, beta fp32).

  Returns:
    (dxt, n, dbeta, dg, dsum) as ``row_terms_gemm``'s: dxt and n split as x is, the
    column sums as w's rows are.
  """
  args = (dz, w, x, dx, mu, r, g, beta)
  mesh = partitioning.explicit_mesh(*args)
  if mesh is None:
    return _row_terms_partitioned(rc, *args)
  layout, arg_specs, result_specs = _row_terms_specs(mesh, [jax.typeof(v) for v in args])
  return partitioning.on_explicit_mesh(functools.partial(row_terms_local, rc, layout), mesh,
                                       args, arg_specs, result_specs)


# ---- residual (+ bias) + LayerNorm statistics ---------------------------------------------
def residual_layernorm(y, w, residual, g, *, bias=None, eps: float = 1e-5,
                       impl: str = "auto"):
  """The producer of a LayerNorm'd residual stream.

  Args:
    y: (..., K) activations, bfloat16 or float16 (float32 runs the XLA path).
    w: (K, D) weight. residual: (..., D), y's dtype. g: (D,) LayerNorm weight.
    bias: optional (D,) bias of the GEMM (added in fp32).
    eps: LayerNorm's epsilon (``LayerNormConfig``).
    impl: as ``coda_jax.gemm_epilogue``.

  Returns:
    (x, h, mu, r): x = y @ w + bias + residual and h = x * g (..., D) in y's dtype;
    mu, r (...) fp32, the mean and 1/sqrt(var + eps) of each row of x (taken from the
    fp32 accumulator). Feed (h, mu, r) to ``layernorm_matmul`` or ``layernorm_gelu_mlp``.
  """
  cfg = LayerNormConfig(eps)
  check_act("y", y)
  check_weight("w", w, (y.shape[-1], w.shape[-1]))
  check_act("residual", residual, w.shape[-1])
  check_vector("g", g, w.shape[-1])
  if bias is not None:
    check_vector("bias", bias, w.shape[-1])
  check_residual(residual, y)
  lead = y.shape[:-1]
  x, h, mu, r = _residual_ln(flat_rows(y), w, flat_rows(residual), g, bias, cfg, impl)
  return x.reshape(*lead, -1), h.reshape(*lead, -1), mu.reshape(lead), r.reshape(lead)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _residual_ln(y, w, residual, g, bias, cfg, impl):
  return _residual_ln_fwd(y, w, residual, g, bias, cfg, impl)[0]


def residual_stats_program(head, dt):
  """The producer's epilogue after ``head`` (its bias): add the residual tile "res", emit
  row partials s1 = sum x and s2 = sum x^2, store x, then h = x * g ("g", fp32)."""
  return [*head, AddTile("res"), RowSum("s1"), RowSum("s2", square=True), Store("x", dt),
          ScaleCol("g"), Store("h", dt)]


def residual_stats(y, w, residual, g, head, operands, eps, impl):
  """x = y @ w + head + residual with (x, h, mu, r) from one GEMM (``residual_stats_program``;
  ``operands`` are ``head``'s).

  Args:
    y: (M, K) activations, bfloat16 or float16 (float32 runs the XLA path).
    w: (K, D) weight in y's dtype.
    residual: (M, D) in y's dtype, added after ``head``.
    g: (D,) LayerNorm weight (taken in fp32).
    head: the epilogue steps applied to the fp32 accumulator y @ w before the residual
      is added (a bias: ``[AddBias("b")]``; ``[]`` for none).
    operands: name -> array, the operands ``head`` reads.
    eps: LayerNorm's epsilon.
    impl: as ``coda_jax.gemm_epilogue``.

  Returns:
    (x, h, mu, r): x and h = x * g, (M, D) in y's dtype (h from x's fp32 value before
    rounding); mu, r (M,) fp32, the mean and 1/sqrt(var + eps) of each row of x, from
    the fp32 row sums of x and x^2 (``stats_from_sums``).
  """
  dt = y.dtype
  out = gemm_epilogue(y, w, residual_stats_program(head, dt),
                      {**operands, "res": residual, "g": g.astype(_F32)}, impl=impl)
  mu, r = stats_from_sums(out["s1"], out["s2"], w.shape[1], eps)
  return out["x"], out["h"], mu, r


def stats_cotangent(x, g, mu, r, cts, impl):
  """The producer backward of ``residual_stats`` (``docs/layernorm_math.md`` section 2),
  one pass over the rows with no GEMM (``epilogue_pass``): from the cotangents
  (dx, dh, dmu, dr) of (x, h, mu, r), the cotangent of x's sum
  dxt = dx + g dh + dmu / D - (dr r^3 / D) (x - mu) in x's dtype, its column sums in
  fp32 (before rounding; a bias's gradient), and g's gradient sum_rows dh x (fp32).

  Args:
    x: (M, D) the producer's stored x, bfloat16 or float16 (float32 runs the XLA path
      whatever ``impl`` says).
    g: (D,) LayerNorm weight (taken in fp32).
    mu, r: (M,) fp32 statistics of x (``residual_stats``'s).
    cts: (dx, dh, dmu, dr): dx and dh (M, D), converted to x's dtype; dmu and dr (M,)
      fp32.
    impl: as ``coda_jax.gemm_epilogue``.

  Returns:
    (dxt, dsum, dg): dxt (M, D) in x's dtype; dsum (D,) fp32, dxt's column sums taken
    before rounding; dg (D,) fp32, sum_rows dh x.
  """
  dx, dh, dmu, dr = cts
  d = x.shape[1]
  if x.dtype not in (jnp.bfloat16, jnp.float16):
    impl = "xla"  # float32 activations run the XLA path (the module's cast policy)
  out = epilogue_pass([AddTile("dx"), LayerNormInputGrad("dh", "x", "g", "mu", "a", "b"),
                       ColSum("dsum"), Store("dxt", x.dtype)],
                      {"dx": dx.astype(x.dtype), "dh": dh.astype(x.dtype), "x": x,
                       "g": g.astype(_F32), "mu": mu, "a": dmu / d, "b": dr * r ** 3 / d},
                      impl=impl)
  return out["dxt"], out["dsum"], out["dg"]


def _residual_ln_fwd(y, w, residual, g, bias, cfg, impl):
  head, operands = [], {}
  if bias is not None:
    head, operands = [AddBias("b")], {"b": bias.astype(_F32)}
  x, h, mu, r = residual_stats(y, w.astype(y.dtype), residual, g, head, operands, cfg.eps,
                               impl)
  return (x, h, mu, r), (y, w, *fenced(x), g, mu, r, bias)  # x: an output (residuals.py)


def _producer_grads(y, w, bias, dxt, dsum, impl):
  """The producing GEMM's gradients from its output's cotangent dxt: dy, dW (in w's
  dtype) and its bias's (from dxt's column sums dsum; None without a bias)."""
  dy = S.input_grad(dxt, w.astype(y.dtype), impl)
  dw = S.weight_grad(y, dxt, impl, S.grad_dtype(w))
  db = None if bias is None else reduce_like(dsum, bias).astype(bias.dtype)
  return dy, reduce_like(dw, w).astype(w.dtype), db


def _residual_ln_bwd(cfg, impl, saved, cts):
  y, w, x, g, mu, r, bias = saved
  dxt, dsum, dg = stats_cotangent(x, g, mu, r, cts, impl)
  dy, dw, db = _producer_grads(y, w, bias, dxt, dsum, impl)
  return dy, dw, dxt, reduce_like(dg, g).astype(g.dtype), db


_residual_ln.defvjp(_residual_ln_fwd, _residual_ln_bwd)


# ---- LayerNorm (from its statistics) + GEMM (+ bias) ---------------------------------------
def layernorm_matmul(h, mu, r, g, beta, w, *, bias=None, impl: str = "auto"):
  """LN(x) @ w + bias, from ``residual_layernorm``'s (h = x * g, mu, r).

  Args:
    h: (..., D) activations, bfloat16 or float16. mu, r: (...) float row statistics.
    g, beta: (D,) LayerNorm weight and bias (the same g that made h).
    w: (D, N) weight. bias: optional (N,) bias.
    impl: as ``coda_jax.gemm_epilogue``.

  Returns:
    (..., N) in h's dtype: ((h - mu g) r + beta) @ w + bias, computed as
    r (h @ w) - (r mu) (x) (g @ w) + beta @ w + bias in the GEMM's epilogue.
  """
  check_act("h", h)
  check_weight("w", w, (h.shape[-1], w.shape[-1]))
  _check_stats(h, mu, r)
  check_vector("g", g, h.shape[-1])
  check_vector("beta", beta, h.shape[-1])
  if bias is not None:
    check_vector("bias", bias, w.shape[-1])
  lead = h.shape[:-1]
  z = _ln_matmul(flat_rows(h), _f32(mu.reshape(-1)), _f32(r.reshape(-1)), g, beta, w, bias,
                 impl)
  return z.reshape(*lead, -1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _ln_matmul(h, mu, r, g, beta, w, bias, impl):
  return _ln_matmul_fwd(h, mu, r, g, beta, w, bias, impl)[0]


def _ln_matmul_fwd(h, mu, r, g, beta, w, bias, impl):
  dt = h.dtype
  wd = w.astype(dt)
  gw, cw = norm_columns(g, beta, wd, bias)
  z = gemm_epilogue(h, wd, norm_matmul_program([Store("z", dt)]),
                    norm_matmul_operands(mu, r, gw, cw), impl=impl)["z"]
  return z, (h, mu, r, g, beta, w, bias)


def _ln_matmul_bwd(impl, saved, dz):
  h, mu, r, g, beta, w, bias = saved
  wd = w.astype(h.dtype)
  dh, n, dr, dmu, dbeta, dg = norm_matmul_grad(dz, wd, h, mu, r, g, beta, impl)
  dw, db = _consumer_weight_grads(n, dz, w, bias, impl)
  return (dh, dmu, dr, reduce_like(dg, g).astype(g.dtype),
          reduce_like(dbeta, beta).astype(beta.dtype), dw, db)


def _consumer_weight_grads(n, dz, w, bias, impl):
  """dW = n^T dz (in w's dtype) and the bias's gradient (None without one), summed by
  dW's mainloop from the dz tiles it reads: no GEMM produces dz here."""
  if bias is None:
    dw, db = S.weight_grad(n, dz, impl, S.grad_dtype(w)), None
  else:
    dw, db = S.weight_grad(n, dz, impl, S.grad_dtype(w), bias_grad=True)
    db = reduce_like(db, bias).astype(bias.dtype)
  return reduce_like(dw, w).astype(w.dtype), db


_ln_matmul.defvjp(_ln_matmul_fwd, _ln_matmul_bwd)


# ---- GPT-2's MLP: LayerNorm -> w1 + b1 -> gelu -> w2 + b2 -> + residual --------------------
# What the GPT-2 MLP keeps for its backward (``layernorm_gelu_mlp``'s ``residuals``),
# the default first.
MLP_RESIDUALS = ("slope", "recompute")
DEFAULT_MLP_RESIDUALS = MLP_RESIDUALS[0]


def layernorm_gelu_mlp(x, h, mu, r, g, beta, w1, b1, w2, b2, *, impl: str = "auto",
                       residuals: str = DEFAULT_MLP_RESIDUALS, next_norm=None,
                       next_eps: float = 1e-5):
  """x + gelu(LN(x) @ w1 + b1) @ w2 + b2 (GELU in its tanh form, as GPT-2).

  Args:
    x: (..., D) the residual stream, bfloat16 or float16. h, mu, r: its
      ``residual_layernorm`` outputs (h = x * g).
    g, beta: (D,) LayerNorm weight and bias.
    w1: (D, F), b1: (F,), w2: (F, D), b2: (D,).
    impl: as ``coda_jax.gemm_epilogue``.
    residuals: what the forward keeps of the (..., F) hidden layer for the backward.
      "slope" (default): a = gelu(z) in x's dtype and gelu'(z) in ``slope_dtype_for``
      x's dtype (for bfloat16 a one-byte code, error at most 0.0025: below bf16's own
      rounding of slopes near 1); the backward's first GEMM multiplies by the slope and
      stores dz only. "recompute": z alone, the least memory; that GEMM recomputes gelu
      and gelu' from z and stores a as well (``docs/layernorm_math.md`` section 3).
    next_norm: optional (D,) weight of the LayerNorm that reads the output (the next
      block's LN_1, or the final LN_f). With it the second GEMM's epilogue also emits
      that norm's statistics, as ``residual_layernorm``'s does, instead of an XLA pass
      over the output (``docs/layernorm_math.md`` section 5).
    next_eps: that LayerNorm's epsilon (``LayerNormConfig``); used only with
      ``next_norm``.

  Returns:
    out (..., D) in x's dtype; with ``next_norm``, (out, h', mu', r') as
    ``residual_layernorm`` returns them: h' = out * next_norm, and the mean and
    1/sqrt(var + next_eps) of each row of out (fp32), for ``layernorm_matmul`` or the
    next ``layernorm_gelu_mlp``.
  """
  if residuals not in MLP_RESIDUALS:
    raise ValueError(f"residuals={residuals!r}: one of {MLP_RESIDUALS} (\"slope\" keeps "
                     "gelu(z) and gelu'(z), \"recompute\" keeps z alone)")
  check_act("x", x)
  check_act("h", h, x.shape[-1])
  if h.shape != x.shape or h.dtype != x.dtype:
    raise ValueError(f"h is {h.dtype}{list(h.shape)}, expected x's {x.dtype}{list(x.shape)} "
                     "(h = x * g from residual_layernorm)")
  d = x.shape[-1]
  check_weight("w1", w1, (d, w1.shape[-1]))
  check_weight("w2", w2, (w1.shape[-1], d))
  _check_stats(h, mu, r)
  check_vector("g", g, d)
  check_vector("beta", beta, d)
  check_vector("b1", b1, w1.shape[-1])
  check_vector("b2", b2, d)
  cfg = None
  if next_norm is not None:
    check_vector("next_norm", next_norm, d)
    cfg = LayerNormConfig(next_eps)
  out = _gelu_mlp(flat_rows(x), flat_rows(h), _f32(mu.reshape(-1)), _f32(r.reshape(-1)), g,
                  beta, w1, b1, w2, b2, next_norm, impl, residuals, cfg)
  if next_norm is None:
    return out.reshape(x.shape)
  lead = x.shape[:-1]
  xo, ho, muo, ro = out
  return xo.reshape(x.shape), ho.reshape(x.shape), muo.reshape(lead), ro.reshape(lead)


@functools.partial(jax.custom_vjp, nondiff_argnums=(11, 12, 13))
def _gelu_mlp(x, h, mu, r, g, beta, w1, b1, w2, b2, g_next, impl, residuals, cfg):
  return _gelu_mlp_fwd(x, h, mu, r, g, beta, w1, b1, w2, b2, g_next, impl, residuals,
                       cfg)[0]


def _gelu_mlp_fwd(x, h, mu, r, g, beta, w1, b1, w2, b2, g_next, impl, residuals, cfg):
  dt = x.dtype
  w1d = w1.astype(dt)
  gw, cw = norm_columns(g, beta, w1d, b1)
  # "slope": gelu'(z) is stored where z was (in half the bytes for bf16: the one-byte
  # code), and a is kept.
  if residuals == "slope":
    steps, hidden = [Gelu(slope="s", slope_dtype=slope_dtype_for(dt))], ("a", "s")
  else:
    steps, hidden = [Store("z", dt), Gelu()], ("z",)
  first = gemm_epilogue(h, w1d, norm_matmul_program([*steps, Store("a", dt)]),
                        norm_matmul_operands(mu, r, gw, cw), impl=impl)
  if g_next is None:
    out = gemm_epilogue(first["a"], w2.astype(dt), [AddBias("b2"), AddTile("x"),
                                                     Store("out", dt)],
                        {"b2": b2.astype(_F32), "x": x}, impl=impl)["out"]
    stats = None
  else:  # the output GEMM is residual_layernorm's program: the next norm's statistics
    out = residual_stats(first["a"], w2.astype(dt), x, g_next, [AddBias("b")],
                         {"b": b2.astype(_F32)}, cfg.eps, impl)
    stats = (*fenced(out[0]), g_next, out[2], out[3])  # out[0]: an output too
  # "a" (the "slope" residuals') is read by the output GEMM as well (residuals.py)
  kept = tuple(fenced(first[nm])[0] if nm == "a" else first[nm] for nm in hidden)
  saved = (h, mu, r, g, beta, w1, b1, w2, b2, kept, stats)
  return out, saved


def _mlp_output_cotangent(impl, saved, cts):
  """The cotangent dout of the MLP's output sum (which is also x's, through the residual
  add), from the op's output cotangents. Returns dout, db2 (from the next norm's pass, or
  None: dW2's mainloop then sums it) and dg_next (None without a next norm)."""
  stats = saved[-1]
  if stats is None:
    return cts, None, None  # no GEMM produces dout: dW2's mainloop sums db2
  # out also fed the next norm: the producer part of section 2
  xo, g_next, muo, ro = stats
  dout, db2, dg_next = stats_cotangent(xo, g_next, muo, ro, cts, impl)
  return dout, db2, reduce_like(dg_next, g_next).astype(g_next.dtype)


def _mlp_hidden_grads(impl, residuals, saved, dout):
  """B1 from the output sum's cotangent dout: dz, db1 and a (dW2's A operand)."""
  h, mu, r, g, beta, w1, b1, w2, b2, hidden, stats = saved
  dt = dout.dtype
  # B1: da = dout @ w2^T; gelu' rides here, with db1's column sums: read from the
  # forward's stored slope, or recomputed from z along with a (dW2's A operand).
  if residuals == "slope":
    a, s = hidden
    slope, ops = slope_multiplier("s", s.dtype), {"s": s}
  else:
    (z,) = hidden
    slope, ops = GeluGrad("z", "a", dt), {"z": z}
  b1_out = gemm_epilogue(dout, w2.astype(dt), [slope, ColSum("db1"), Store("dz", dt)], ops,
                         trans_b=True, impl=impl)
  a = a if residuals == "slope" else b1_out["a"]
  return b1_out["dz"], b1_out["db1"], a


def _mlp_weight_grads(impl, w1, w2, n, dz, a, dout, db2):
  """B3, B4: dW1 from the normalised rows n, dW2 (and db2 from its mainloop when the
  next norm's pass did not sum it)."""
  dw1 = S.weight_grad(n, dz, impl, S.grad_dtype(w1))
  if db2 is None:
    dw2, db2 = S.weight_grad(a, dout, impl, S.grad_dtype(w2), bias_grad=True)
  else:
    dw2 = S.weight_grad(a, dout, impl, S.grad_dtype(w2))
  return dw1, dw2, db2


def _gelu_mlp_bwd(impl, residuals, cfg, saved, cts):
  h, mu, r, g, beta, w1, b1, w2, b2, hidden, stats = saved
  dout, db2, dg_next = _mlp_output_cotangent(impl, saved, cts)
  dz, db1, a = _mlp_hidden_grads(impl, residuals, saved, dout)
  # B2: dn = dz @ w1^T -> dh and the LayerNorm terms, for the producer's pass.
  dh, n, dr, dmu, dbeta, dg = norm_matmul_grad(dz, w1.astype(dz.dtype), h, mu, r, g, beta,
                                               impl)
  dw1, dw2, db2 = _mlp_weight_grads(impl, w1, w2, n, dz, a, dout, db2)
  cast = lambda grad, p: reduce_like(grad, p).astype(p.dtype)
  return (dout, dh, dmu, dr, cast(dg, g), cast(dbeta, beta), cast(dw1, w1), cast(db1, b1),
          cast(dw2, w2), cast(db2, b2), dg_next)


_gelu_mlp.defvjp(_gelu_mlp_fwd, _gelu_mlp_bwd)


# ---- residual_layernorm and the GELU MLP as one op -----------------------------------------
def residual_layernorm_gelu_mlp(y, w_proj, residual, g, beta, w1, b1, w2, b2, *,
                                proj_bias=None, eps: float = 1e-5, impl: str = "auto",
                                residuals: str = DEFAULT_MLP_RESIDUALS, next_norm=None,
                                next_eps: float = 1e-5, next_norm_bias=None, next_w=None,
                                next_bias=None):
  """``residual_layernorm`` feeding ``layernorm_gelu_mlp``, as one op (GPT-2's second
  half-block), optionally with the next LayerNorm and the GEMM that reads it (the next
  block's c_attn):

      x1 = y @ w_proj + proj_bias + residual
      out = x1 + gelu(LN(x1) @ w1 + b1) @ w2 + b2
      z' = LN'(out) @ next_w + next_bias                         (with ``next_w``)

  The forward runs the same GEMMs as the separate ops. The backward differs: one op
  holds both x1 and the MLP's cotangents, so LayerNorm's whole input gradient comes
  from one GEMM whose epilogue finishes the row terms across the row
  (``layernorm_input_grad``, row totals), where the separate ops take that GEMM and then
  a pass over (M, D). With ``next_w`` the same holds for LN': its input gradient and the
  cotangent of out arrive in this op's backward together, so LN' too needs no pass.
  Where the one GEMM cannot run (no Hopper GPU, a D whose partials do not fit), the
  backward takes the GEMM + pass path; the values agree. On several devices it runs per
  shard (``row_terms_sharded``).

  Args:
    y: (..., K) activations (attention's output), bfloat16 or float16.
    w_proj: (K, D); residual: (..., D) in y's dtype; proj_bias: optional (D,).
    g, beta: (D,) the LayerNorm's weight and bias; eps: its epsilon.
    w1: (D, F), b1: (F,), w2: (F, D), b2: (D,): the MLP.
    impl, residuals, next_norm, next_eps: as ``layernorm_gelu_mlp``.
    next_norm_bias: (D,) the next LayerNorm's bias; with ``next_w`` only.
    next_w: optional (D, N): the GEMM that reads LN'(out) (needs ``next_norm`` and
      ``next_norm_bias``). next_bias: optional (N,) its bias.

  Returns:
    out (..., D) in y's dtype; with ``next_norm`` alone, (out, h', mu', r') as
    ``layernorm_gelu_mlp`` returns them; with ``next_w``, (out, z') where z' (..., N)
    in y's dtype is what ``layernorm_matmul(h', mu', r', next_norm, next_norm_bias,
    next_w, bias=next_bias)`` returns.
  """
  if residuals not in MLP_RESIDUALS:
    raise ValueError(f"residuals={residuals!r}: one of {MLP_RESIDUALS} (\"slope\" keeps "
                     "gelu(z) and gelu'(z), \"recompute\" keeps z alone)")
  check_act("y", y)
  check_weight("w_proj", w_proj, (y.shape[-1], w_proj.shape[-1]))
  d = w_proj.shape[-1]
  check_act("residual", residual, d)
  check_residual(residual, y)
  for name, v, width in (("g", g, d), ("beta", beta, d), ("b1", b1, w1.shape[-1]),
                         ("b2", b2, d)):
    check_vector(name, v, width)
  if proj_bias is not None:
    check_vector("proj_bias", proj_bias, d)
  check_weight("w1", w1, (d, w1.shape[-1]))
  check_weight("w2", w2, (w1.shape[-1], d))
  next_cfg = nxt = None
  if next_norm is not None:
    check_vector("next_norm", next_norm, d)
    next_cfg = LayerNormConfig(next_eps)
  if next_w is not None:
    if next_norm is None or next_norm_bias is None:
      raise ValueError("next_w needs the LayerNorm it reads through: pass next_norm and "
                       "next_norm_bias (its weight and bias) too")
    check_vector("next_norm_bias", next_norm_bias, d)
    check_weight("next_w", next_w, (d, next_w.shape[-1]))
    if next_bias is not None:
      check_vector("next_bias", next_bias, next_w.shape[-1])
    nxt = (next_norm_bias, next_w, next_bias)
  elif next_norm_bias is not None or next_bias is not None:
    raise ValueError("next_norm_bias and next_bias belong to next_w's GEMM: pass next_w, "
                     "or leave them out")
  lead = y.shape[:-1]
  out = _res_ln_mlp(flat_rows(y), w_proj, flat_rows(residual), g, beta, w1, b1, w2, b2,
                    proj_bias, next_norm, nxt, LayerNormConfig(eps), next_cfg, impl,
                    residuals)
  if next_norm is None:
    return out.reshape(*lead, d)
  if nxt is not None:
    xo, z = out
    return xo.reshape(*lead, d), z.reshape(*lead, -1)
  xo, ho, muo, ro = out
  return (xo.reshape(*lead, d), ho.reshape(*lead, d), muo.reshape(lead), ro.reshape(lead))


@functools.partial(jax.custom_vjp, nondiff_argnums=(12, 13, 14, 15))
def _res_ln_mlp(y, w_proj, residual, g, beta, w1, b1, w2, b2, proj_bias, g_next, nxt, cfg,
                next_cfg, impl, residuals):
  return _res_ln_mlp_fwd(y, w_proj, residual, g, beta, w1, b1, w2, b2, proj_bias, g_next,
                         nxt, cfg, next_cfg, impl, residuals)[0]


def _res_ln_mlp_fwd(y, w_proj, residual, g, beta, w1, b1, w2, b2, proj_bias, g_next, nxt,
                    cfg, next_cfg, impl, residuals):
  (x1, h1, mu, r), producer = _residual_ln_fwd(y, w_proj, residual, g, proj_bias, cfg, impl)
  out, mlp = _gelu_mlp_fwd(x1, h1, mu, r, g, beta, w1, b1, w2, b2, g_next, impl, residuals,
                           next_cfg)
  # h1 (and h') are not kept: the one-GEMM input gradient reads x1 (and out), and so
  # does its fallback (``LayerNormGradFromX``).
  mlp = (None, *mlp[1:])
  if nxt is None:
    return out, (producer, mlp, None)
  xo, ho, muo, ro = out
  beta_n, w_n, b_n = nxt
  z, _ = _ln_matmul_fwd(ho, muo, ro, g_next, beta_n, w_n, b_n, impl)
  return (xo, z), (producer, mlp, nxt)


def _res_ln_mlp_bwd(cfg, next_cfg, impl, residuals, saved, cts):
  (y, w_proj, x1, _, mu, r, proj_bias), mlp, nxt = saved
  _, _, _, g, beta, w1, b1, w2, b2, _, stats = mlp
  cast = lambda grad, p: reduce_like(grad, p).astype(p.dtype)
  dnxt = None
  if nxt is None:
    dout, db2, dg_next = _mlp_output_cotangent(impl, mlp, cts)
  else:  # LN'(out)'s input gradient with out's own cotangent, in one GEMM: dout, db2
    (dxo, dzn), (xo, g_next, muo, ro), (beta_n, w_n, b_n) = cts, stats, nxt
    dout, n_n, dbeta_n, dg_next, db2 = layernorm_input_grad(
        dzn, w_n.astype(dzn.dtype), None, xo, dxo.astype(xo.dtype), muo, ro, g_next, beta_n,
        impl)
    dw_n, db_n = _consumer_weight_grads(n_n, dzn, w_n, b_n, impl)
    dg_next, dnxt = cast(dg_next, g_next), (cast(dbeta_n, beta_n), dw_n, db_n)
  dz, db1, a = _mlp_hidden_grads(impl, residuals, mlp, dout)
  # LayerNorm's whole input gradient: dout is x1's cotangent through the MLP's residual
  # add, so one GEMM can finish it
  dxt, n, dbeta, dg, dsum = layernorm_input_grad(dz, w1.astype(dz.dtype), None, x1,
                                                 dout.astype(x1.dtype), mu, r, g, beta, impl)
  dw1, dw2, db2 = _mlp_weight_grads(impl, w1, w2, n, dz, a, dout, db2)
  dy, dw_proj, dproj_bias = _producer_grads(y, w_proj, proj_bias, dxt, dsum, impl)
  return (dy, dw_proj, dxt, cast(dg, g), cast(dbeta, beta), cast(dw1, w1), cast(db1, b1),
          cast(dw2, w2), cast(db2, b2), dproj_bias, dg_next, dnxt)


_res_ln_mlp.defvjp(_res_ln_mlp_fwd, _res_ln_mlp_bwd)


__all__ = ["AddBias", "AddOuter", "Gelu", "GeluGrad", "LayerNormConfig", "LayerNormGrad",
           "LayerNormGradFromX",
           "LayerNormInputGrad", "SLOPE_CODE_LO", "SLOPE_CODE_STEP", "slope_code",
           "slope_dtype_for", "slope_multiplier",
           "DEFAULT_MLP_RESIDUALS", "MLP_RESIDUALS", "layernorm_gelu_mlp", "layernorm_matmul",
           "input_grad_gemm_and_pass", "layernorm_input_grad", "norm_columns",
           "residual_layernorm", "residual_layernorm_gelu_mlp", "residual_stats",
           "row_terms_config", "row_terms_gemm",
           "stats_cotangent", "stats_from_sums"]
