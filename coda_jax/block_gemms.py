"""The fused GEMMs of a block, forward and backward (``docs/design.md`` §1.2-§1.4: the
forward's K1-K4, the backward's B1-B5, the LM head), on (M, ·) matrices. Each function
is one ``gemm_epilogue`` call (or a short XLA step where the math has no GEMM to ride
on); ``fused_ops`` and ``blocks`` compose them under ``jax.custom_vjp``. Activations are
bf16/fp16 (``dt``); weights arrive cast to ``dt``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from coda_jax import dispatch
from coda_jax import primitives as P
from coda_jax.grad_primitives import (ExpShifted, GatedGrad, RmsNormGrad, RmsNormGradRowScaled,
                                      SoftmaxXentGrad)
from coda_jax.epilogue_gemm import epilogue_pass, gemm_epilogue
from coda_jax.partitioning import set_row_columns
from coda_jax.sharding import varying_axes


def residual_norm(y, w, residual, g, eps, impl):
  """K1/K3: x = y @ w + residual, h = x * g, r = rsqrt(mean(x^2) + eps)."""
  dt = y.dtype
  out = gemm_epilogue(y, w, [P.AddTile("res"), P.RowSum("ss", square=True), P.Store("x", dt),
                             P.ScaleCol("g"), P.Store("h", dt)],
                      {"res": residual, "g": g.astype(jnp.float32)}, impl=impl)
  r = jax.lax.rsqrt(out["ss"] / w.shape[1] + eps)
  return out["x"], out["h"], r


def residual_add(y, w, residual, impl):
  """x = y @ w + residual."""
  return gemm_epilogue(y, w, [P.AddTile("res"), P.Store("x", y.dtype)], {"res": residual},
                       impl=impl)["x"]


def norm_gated(h, r, w13, block, activation, impl, keep_z=True):
  """K2: z = r * (h @ w13), y = act(a) * b. Returns (z or None, y); z (the backward's
  input) is written only with ``keep_z``."""
  dt = h.dtype
  store_z = [P.Store("z", dt)] if keep_z else []
  out = gemm_epilogue(h, w13, [P.ScaleRow("r"), *store_z, P.Gated(block, activation),
                               P.Store("y", dt)], {"r": r}, impl=impl)
  return out.get("z"), out["y"]


def norm_rope(h, r, w, positions, freqs, head_dim, impl):
  """K4: RoPE(r * (h @ w)) per rotate-half head (columns with frequency 0 pass)."""
  out = gemm_epilogue(h, w, [P.ScaleRow("r"), P.Rotate("pos", "freqs", head_dim // 2),
                             P.Store("out", h.dtype)],
                      {"r": r, "pos": positions, "freqs": freqs}, impl=impl)
  return out["out"]


# ``w_nk`` below: the forward weight is stored (N, K), i.e. the LM head read from a tied
# (V, D) embedding table, which the GEMMs then read transposed instead of a copy.
def _logits_head(r, targets, vmask):
  """The program that makes logits r * acc (+ the pad-column mask ``vmask``, an (N,)
  fp32 column operand, when the vocabulary was padded: ``fused_ops.pad_vocab``), and
  its operands."""
  operands = {"r": r, "t": targets.astype(jnp.int32)}
  if vmask is None:
    return [P.ScaleRow("r")], operands
  return [P.ScaleRow("r"), P.AddBias("vmask")], dict(operands, vmask=vmask)


def lm_head_stats(h, r, wlm, targets, impl, w_nk=False, vmask=None, rest=False):
  """Per row: log-sum-exp of logits = r * (h @ wlm) and the target's logit (0 when the
  target is outside [0, V)); with ``rest``, also the log-sum-exp without the target's
  column (for a backward: ``SoftmaxXentGrad``). Only (V / epi_tile_n, M) partials ever
  exist."""
  head, operands = _logits_head(r, targets, vmask)
  lse = (P.RowLogSumExp("lse", exclude="t", rest="lse_rest") if rest
         else P.RowLogSumExp("lse"))
  out = gemm_epilogue(h, wlm, head + [lse, P.PickColumn("t", "tgt")],
                      operands, trans_b=w_nk, impl=impl)
  return (out["lse"], out["tgt"]) + ((out["lse_rest"],) if rest else ())


def lm_head_logits(h, r, wlm, targets, impl, w_nk=False, vmask=None):
  """``lm_head_stats`` plus the logits themselves, for the 3-GEMM backward
  (``xent_grad_from_logits``). They are stored in float16 (float32 for float32 inputs):
  2^-11 relative, eight times finer than the bf16 logits of an unfused bf16 graph, in
  the same bytes. A logit beyond float16's range (|z| > 65504) becomes inf and its
  row's gradient NaN, never a finite wrong value."""
  zdt = jnp.float32 if h.dtype == jnp.float32 else jnp.float16
  head, operands = _logits_head(r, targets, vmask)
  out = gemm_epilogue(h, wlm, head + [P.RowLogSumExp("lse", exclude="t", rest="lse_rest"),
                                      P.PickColumn("t", "tgt"), P.Store("z", zdt)],
                      operands, trans_b=w_nk, impl=impl)
  return out["lse"], out["tgt"], out["lse_rest"], out["z"]


# ---- the exp-store LM head (docs/lm_head_exp_store.md) ------------------------------------
# Rows whose log-sum-exp is within +-EXP_STORE_RANGE store exp(logits) unshifted: every
# value and every scale s = w exp(-lse) is then a normal number in bf16 and fp32. A chunk
# with a row outside runs its logits GEMM again with the row's own lse as the shift.
EXP_STORE_RANGE = 60.0


def lm_head_exp(h, r, wlm, targets, shift, impl, w_nk=False, vmask=None):
  """``lm_head_stats`` (lse, target logit, lse without the target) plus
  e = exp(logits - shift[m]), stored in bf16 (fp32 for fp32 inputs): (rows, V)."""
  edt = jnp.float32 if h.dtype == jnp.float32 else jnp.bfloat16
  head, operands = _logits_head(r, targets, vmask)
  out = gemm_epilogue(h, wlm, head + [P.RowLogSumExp("lse", exclude="t", rest="lse_rest"),
                                      P.PickColumn("t", "tgt"), ExpShifted("shift"),
                                      P.Store("e", edt)],
                      dict(operands, shift=shift.astype(jnp.float32)), trans_b=w_nk,
                      impl=impl)
  return out["lse"], out["tgt"], out["lse_rest"], out["e"]


def lm_head_exp_safe(h, r, wlm, targets, impl, w_nk=False, vmask=None):
  """The exp-store head's logits GEMM: (lse, tgt, lse_rest, e, shift) such that
  s * e, s = w exp(shift - lse) (``exp_store_scale``), is dlogits for row weights w.

  e = exp(logits - shift), with shift 0 when every row's |lse| < ``EXP_STORE_RANGE``,
  else (``jax.lax.cond``, per call) from a second run of the GEMM with shift = lse. Its
  target column is then overwritten with -exp(lse_rest - shift): times s, the exact
  -(1 - p_t) w from the forward's fp32 statistics (rows whose target is not a column
  keep theirs: their w is 0). Read by ``head_dn`` and ``head_weight_grad`` in place of
  dlogits."""
  lse, tgt, rest, e = lm_head_exp(h, r, wlm, targets, jnp.zeros_like(r, jnp.float32), impl,
                                  w_nk, vmask)
  ok = jnp.all(jnp.abs(lse) < EXP_STORE_RANGE)
  e = jax.lax.cond(ok, lambda: e,
                   lambda: lm_head_exp(h, r, wlm, targets, lse, impl, w_nk, vmask)[3])
  shift = jnp.where(ok, 0.0, lse)
  # one element per row, written in place (no pass over the (rows, V) array)
  e = set_row_columns(e, targets, -jnp.exp(rest - shift))
  return lse, tgt, rest, e, shift


def exp_store_scale(lse, shift, weight):
  """s = w exp(shift - lse) per row: s * e is the softmax times w (``lm_head_exp_safe``)."""
  return weight * jnp.exp(shift - lse)


def head_dn(e, w, s, impl, w_nk=False):
  """dn = dlogits @ W^T in fp32 from the stored exponentials: s[m] * (e @ W^T)."""
  return gemm_epilogue(e, w.astype(e.dtype), [P.ScaleRow("s"), P.Store("dn", jnp.float32)],
                       {"s": s}, trans_b=not w_nk, impl=impl)["dn"]


def xent_grad_from_logits(z, lse, tgt, lse_rest, targets, weight, dt):
  """(XLA, elementwise) the CE backward of ``xent_logits_grad`` from stored logits ``z``
  (rows, V): the same ``SoftmaxXentGrad`` step, run over the whole chunk, the target
  column's from the forward's fp32 ``tgt`` and ``lse_rest`` (``lm_head_logits``).
  Returns (dlogits in ``dt``, zdz)."""
  program = (SoftmaxXentGrad("lse", "t", "w", "zdz", rest_lse="rest", target_logit="tgt"),
             P.Store("dlogits", dt))
  outputs = tuple(o for step in program for o in step.outputs(1))
  out = dispatch.apply_program(z.astype(jnp.float32), program,
                               {"lse": lse, "rest": lse_rest, "tgt": tgt,
                                "t": targets.astype(jnp.int32), "w": weight}, outputs)
  return out["dlogits"], out["zdz"]


def rope_backward_program(head_dim, dtype, row_scaled=False):
  """B1's program, with no GEMM (``epilogue_gemm.epilogue_pass``): dqkv in, c's row partials
  <dqkv, qkv> (``RowDot``; a rotation keeps inner products, so this is <dz, z>), RoPE^T
  (a rotation by the negated angle), dz stored. Operands: dqkv, qkv, pos, neg_freqs; with
  ``row_scaled``, also r (M,): dz is stored times r per row (``ScaleRow``, after c)."""
  scale = [P.ScaleRow("r")] if row_scaled else []
  return [P.AddTile("dqkv"), P.RowDot("qkv", "c"),
          P.Rotate("pos", "neg_freqs", head_dim // 2), *scale, P.Store("dz", dtype)]


def rope_grad(dqkv, qkv, positions, freqs, head_dim, d_model, impl, r=None):
  """B1, one elementwise pass over (M, N) tiles (``rope_backward_program``).

  Args:
    dqkv: (M, N) cotangent of the RoPE'd projection.
    qkv: (M, N) the forward's output (after RoPE).
    positions: (M,) token positions; freqs: (N,) per-column frequencies (0 on v).
    head_dim: columns per head; d_model: the divisor of c (the norm's width).
    impl: as ``coda_jax.gemm_epilogue``.
    r: optional (M,) fp32 row scale: dz is returned times r per row, the cotangent
      ``norm_input_grad_row_scaled`` and ``weight_grad(row_scale=)`` take (c is not scaled).

  Returns:
    (dz (M, N) in dqkv's dtype: the cotangent of the projection before RoPE (times r),
    c = <dqkv, qkv> / d_model (M,) fp32: the zdz term of the norm before the GEMM).
  """
  operands = {"dqkv": dqkv, "qkv": qkv, "pos": positions, "neg_freqs": -freqs}
  if r is not None:
    operands["r"] = r
  out = epilogue_pass(rope_backward_program(head_dim, dqkv.dtype, r is not None), operands,
                      impl=impl)
  return out["dz"], out["c"] / d_model


def norm_input_grad(dz, w, x, r, c, g, d_residual, impl, w_nk=False, dx_dtype=None):
  """B2/B4: dn = dz @ w^T; dx = r * (g * dn - r x c) (+ d_residual). Returns
  (dx, n = r x g, dg); dx in ``dx_dtype`` (default dz's)."""
  out = _norm_grad_gemm(RmsNormGrad("x", "r", "c", "g", "dg", "n", dz.dtype), dz, w, x, r,
                        c, g, d_residual, impl, not w_nk, dx_dtype)
  return out["dx"], out["n"], out["dg"]


def _norm_grad_gemm(norm_grad, dz, w, x, r, c, g, d_residual, impl, trans_b, dx_dtype):
  """The GEMM of both RMSNorm input gradients: dz @ w^T through ``norm_grad`` (an
  ``RmsNormGrad`` or ``RmsNormGradRowScaled`` on operands x, r, c, g), plus d_residual
  when given, dx stored in ``dx_dtype`` (default dz's). Returns the outputs by name."""
  program = [norm_grad]
  operands = {"x": x, "r": r, "c": c, "g": g.astype(jnp.float32)}
  if d_residual is not None:
    program.append(P.AddTile("dres"))
    operands["dres"] = d_residual
  return gemm_epilogue(dz, w, program + [P.Store("dx", dx_dtype or dz.dtype)], operands,
                       trans_b=trans_b, impl=impl)


def norm_input_grad_row_scaled(dzr, w, x, r, c, g, d_residual, impl, dx_dtype=None):
  """B2/B4 from the row-scaled cotangent dzr = r * dz (``rope_grad``, ``qk_norm_grad`` or
  ``gated_input_grad`` given r): acc = dzr @ w^T = r * dn; dx = g * acc - r^2 x c
  (+ d_residual) (``RmsNormGradRowScaled``). No n is stored: the weight gradient is
  ``weight_grad(x, dzr, row_scale=g)`` = diag(g) x^T (r * dz) = n^T dz.

  Args:
    dzr: (M, N) r * dz, in the activations' dtype.
    w: (D, N) the projection the norm fed.
    x: (M, D) the norm's input; r: (M,) fp32 its reciprocal RMS; c: (M,) fp32 the zdz
      term <dz, z> / D; g: (D,) the norm weight.
    d_residual: (M, D) added to dx, or None.
    impl: as ``coda_jax.gemm_epilogue``; dx_dtype: default dzr's.

  Returns:
    (dx (M, D), dg (D,) fp32).
  """
  out = _norm_grad_gemm(RmsNormGradRowScaled("x", "r", "c", "g", "dg"), dzr, w, x, r, c, g,
                        d_residual, impl, True, dx_dtype)
  return out["dx"], out["dg"]


def gated_input_grad(dx, w2, z, block, activation, impl, r=None, store_y=True):
  """B3: dy = dx @ w2^T; dz = GLU backward (pair-blocked, 2F wide). Returns (dz, y, c*D),
  y = act(a) * b recomputed from z, or None without ``store_y`` (the forward kept it);
  with ``r`` ((M,) fp32), dz is returned times r per row (``norm_input_grad_row_scaled``'s
  operand; the zdz sums are of the unscaled dz)."""
  dt = dx.dtype
  scale, operands = ([P.ScaleRow("r")], {"z": z, "r": r}) if r is not None else ([], {"z": z})
  y_name = "y" if store_y else None
  # dz is a fresh buffer, not written over z. In the models' layer scan z is a slice of
  # the stacked residuals: an in-place write made XLA copy that slice out first, one
  # M x 2F pass each layer, and saved no memory, the copy being as large as dz. Read, z
  # stays in the stacked buffer (XLA's dynamic-slice fusion hands the kernel its
  # address). Outside a scan the fresh dz costs one M x 2F buffer while this GEMM runs
  # (docs/tuning.md#the-swiglu-backwards-dz).
  out = gemm_epilogue(dx, w2, [GatedGrad("z", block, y_name, "zdz", activation, dt), *scale,
                               P.Store("dz", dt)], operands, trans_b=True, impl=impl)
  return out["dz"], out.get("y"), out["zdz"]


def xent_logits_grad(h, r, wlm, lse, tgt, lse_rest, targets, weight, impl, w_nk=False,
                     vmask=None):
  """CE backward: dlogits = (softmax - onehot) * weight[m] from recomputed logits, and
  <dlogits, logits> per row (zdz of the final norm). ``lse``, ``tgt`` and ``lse_rest``
  are the forward's (``lm_head_stats``): the target column's dlogit -(1 - p_t) is then
  set from them (``target_column_from_stats``), exact for a confident row. (Inside the
  kernel, as ``SoftmaxXentGrad(rest_lse=...)``, Mosaic GPU's layout inference did not
  finish lowering it for sm90.)"""
  head, operands = _logits_head(r, targets, vmask)
  out = gemm_epilogue(h, wlm, head + [SoftmaxXentGrad("lse", "t", "w", "zdz"),
                                      P.PickColumn("t", "dt"), P.Store("dlogits", h.dtype)],
                      dict(operands, lse=lse, w=weight), trans_b=w_nk, impl=impl)
  return target_column_from_stats(out["dlogits"], out["zdz"], out["dt"], lse, tgt, lse_rest,
                                  targets, weight)


def target_column_from_stats(dlogits, zdz, old, lse, tgt, lse_rest, targets, weight):
  """(XLA, per row) dlogits' target column replaced by -exp(lse_rest - lse) * weight
  (-(1 - p_t), exact), and zdz's target term moved to match, with the fp32 target logit.
  ``old``: the kernel's fp32 target dlogit, which its zdz summed (``PickColumn`` after
  ``SoftmaxXentGrad``: 0 where the target is not a column). Rows whose target is not a
  column (ignored, out of range) are left as they are. No gather: on a vocabulary-
  parallel head each shard sets its own columns (``set_row_columns``)."""
  v = dlogits.shape[1]
  inside = (targets >= 0) & (targets < v)
  new = -jnp.exp(lse_rest - lse) * weight
  # one element per row, written in place (no pass over the (rows, V) array)
  dlogits = set_row_columns(dlogits, targets, new)
  return dlogits, zdz + jnp.where(inside, (new - old) * tgt, 0.0)


def input_grad(dout, w, impl, r=None, w_nk=False, dtype=None):
  """dA = dout @ w^T (times r[m] when given), in ``dtype`` (default dout's)."""
  program, operands = [P.Store("da", dtype or dout.dtype)], {}
  if r is not None:
    program, operands = [P.ScaleRow("r")] + program, {"r": r}
  return gemm_epilogue(dout, w, program, operands, trans_b=not w_nk, impl=impl)["da"]


def grad_dtype(w):
  """Weight gradients are accumulated in fp32 and stored in the weight's dtype (fp32 for
  anything wider than 16 bits), so no separate conversion pass runs."""
  return w.dtype if jnp.dtype(w.dtype).itemsize == 2 else jnp.float32


def weight_grad(a, dout, impl, dtype=jnp.float32, accumulate=None, bias_grad=False,
                row_scale=None):
  """dW = a^T @ dout (fp32 accumulation, stored in ``dtype``); added in place to the
  fp32 ``accumulate`` when given. Under ``shard_map`` with the rows split, dW is one
  shard's partial sum, still to be summed across shards: it stays fp32.

  With ``bias_grad``, returns (dW, db): db = sum_rows dout (N,) fp32, a bias's gradient
  (this call's rows only), which the same GEMM's mainloop sums from the dout tiles it
  reads (``primitives.BColumnSum``): no pass over dout of its own.

  With ``row_scale`` ((K_a,) = a's columns), dW's rows are multiplied by it in the
  epilogue: diag(row_scale) a^T dout (``norm_input_grad_row_scaled``: a = x, the scale the
  norm weight g)."""
  if varying_axes(a):
    dtype = jnp.float32
  sums = [P.BColumnSum("db")] if bias_grad else []
  scale, operands = [], {}
  if row_scale is not None:
    scale, operands = [P.ScaleRow("g")], {"g": row_scale.astype(jnp.float32)}
  if accumulate is None:
    out = gemm_epilogue(a, dout, scale + [P.Store("dw", dtype)] + sums, operands,
                        trans_a=True, impl=impl)
  else:
    # The kernel's TMA store adds n^T dout into the accumulator's buffer: no tile of it
    # is staged or read by the SMs (an AddTile would read it in the epilogue).
    out = gemm_epilogue(a, dout, scale + [P.Store("dw", jnp.float32, add_to="acc")] + sums,
                        dict(operands, acc=accumulate), trans_a=True, impl=impl,
                        in_place={"dw": "acc"})
  return (out["dw"], out["db"]) if bias_grad else out["dw"]


def head_weight_grad(n, dlogits, impl, w_nk, accumulate):
  """The LM head's dW += n^T dlogits in fp32, (D, V); with ``w_nk`` dW^T += dlogits^T n,
  (V, D), the tied embedding's layout. ``accumulate`` None: dW of this chunk alone."""
  a, b = (dlogits, n) if w_nk else (n, dlogits)
  return weight_grad(a, b, impl, accumulate=accumulate)


def row_chunks(m: int, v: int, chunk_rows: int | None, budget_bytes: int = 1 << 30,
               buffers: int = 1) -> int:
  """Rows per LM-head chunk: M if ``buffers`` 16-bit (M, V) arrays fit in
  ``budget_bytes``, else the largest divisor of M that fits, preferring multiples of 256,
  then of 64, then of 8 (the kernel pads a chunk to its tile). M with no such divisor
  (e.g. a prime) runs as one chunk. The recomputing backward holds one (rows, V) array
  per chunk (dlogits), the forward-formed gradient two (the logits and dlogits)."""
  if chunk_rows is not None:
    if chunk_rows <= 0 or m % chunk_rows:
      raise ValueError(f"chunk_rows={chunk_rows} must be a positive divisor of M={m}")
    return chunk_rows
  fits = lambda rows: rows * v * 2 * buffers <= budget_bytes
  if fits(m):
    return m
  for align in (256, 64, 8):
    found = [rows for rows in range(align, m, align) if m % rows == 0 and fits(rows)]
    if found:
      return max(found)
  return m
