"""Whole Llama-style blocks as GEMM-epilogue programs, forward and backward
(``docs/design.md`` §1.2-§1.4: forward of a block, its backward, the LM head), each one
``jax.custom_vjp``.

A model of L layers is cut at attention, which stays outside (cuDNN):

    qkv_0 = pre_block(x0, positions, g_attn_0, wqkv_0)              embedding -> QKV
    for i < L - 1:   y_i = attention(qkv_i)
                     x, qkv_{i+1} = shifted_block(x, y_i, positions, params_i)
    loss = post_block(x, y_{L-1}, targets, params_{L-1})            -> cross-entropy

``shifted_block`` params (kernel layouts, ``layout.py``): ``wo`` (Hq*hd, D) and the MLP
(``g_mlp`` (D,), ``w13`` (D, 2F) pair-blocked, ``w2`` (F, D)) of layer i, then the next
layer's ``g_attn`` (D,) and ``wqkv`` (D, (Hq + 2 Hkv) hd). ``post_block`` replaces the last
two with ``g_final`` (D,) and ``wlm`` (D, V) (or (V, D), a tied embedding table, with
``BlockConfig.wlm_layout="vd"``).

With ``BlockConfig.qk_norm`` (Qwen3) the QKV epilogue also RMS-normalises each q and k
head (``coda_jax.qk_norm``): ``pre_block`` takes the weights as ``qk_norm_w`` and
``shifted_block``'s params gain ``g_q_norm`` and ``g_k_norm`` (head_dim,) (the next
layer's, as ``g_attn``); the pre-norm projection u is saved in place of qkv.

Only what ``docs/design.md`` §1.2 ("Forward of one shifted block") lists is saved for
the backward: y0, x1, x2, z (pre-activation), qkv, r1, r2 (the post-block also keeps h2
and each row's log-sum-exp); h1 and y1 are recomputed by backward epilogues. The
n = r x g of the norms before the QKV and gate-up GEMMs is never formed: the epilogue
that produces those GEMMs' cotangent dz stores r * dz, so their input gradient reads
r * dn and their weight gradient is diag(g) x^T (r * dz)
(``docs/row_scaled_cotangent.md``). Cast policy and shapes as ``fused_ops``.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from coda_jax import fused_ops as F
from coda_jax import block_gemms as S
from coda_jax import dispatch
from coda_jax import layout
from coda_jax import primitives as P
from coda_jax import qk_norm as Q
from coda_jax import unfused
from coda_jax.grad_primitives import RmsNormGrad
from coda_jax.residuals import fenced
from coda_jax.sharding import reduce_like, vary_like


# What the gated MLP keeps for its backward (``BlockConfig.mlp_residuals``), the default
# first: z alone, or z and its activation output (as GPT-2's MLP keeps its own,
# ``layernorm_ops.MLP_RESIDUALS``).
MLP_RESIDUALS = ("recompute", "output")


def check_mlp_residuals(mlp_residuals: str) -> None:
  """ValueError unless ``mlp_residuals`` is one of ``MLP_RESIDUALS``."""
  if mlp_residuals not in MLP_RESIDUALS:
    raise ValueError(f"mlp_residuals={mlp_residuals!r}: one of {MLP_RESIDUALS} "
                     "(\"output\" keeps y = act(a) * b for the backward, \"recompute\" "
                     "recomputes it there from z)")


@dataclasses.dataclass(frozen=True)
class BlockConfig:
  """Static block hyper-parameters (hashable)."""
  n_q_heads: int
  n_kv_heads: int
  head_dim: int
  rope_theta: float = 500000.0
  rope_scaling: layout.RopeScaling | None = None  # Llama 3.1/3.2's frequency scaling
  eps: float = 1e-5
  swiglu_block: int = 32  # pair block of w13's layout (layout.gate_up_to_blocked)
  activation: str = "silu"
  ignore_index: int = -100
  reduction: str = "mean"
  lm_chunk_rows: int | None = None
  wlm_layout: str = "dv"  # post-block head: "dv" (D, V), or "vd" (V, D): a tied embedding
  head_grad: str = "auto"  # post-block head's unit gradient: fused_ops.HEAD_GRADS
  qk_norm: bool = False  # Qwen3's per-head q/k RMSNorm in the QKV epilogue (eps = eps)
  # What the gated MLP keeps for its backward, of MLP_RESIDUALS: "recompute" (default)
  # keeps z only, and the backward's GatedGrad GEMM recomputes y from z and stores it for
  # the down-projection's weight gradient; "output" also keeps the activation output y
  # (M x F more values a layer), so that GEMM stores dz alone. "output" buys little
  # time for more peak memory (docs/tuning.md#the-gated-mlps-residuals): opt in where
  # measured to pay.
  mlp_residuals: str = "recompute"
  impl: str | tuple[str, ...] = "auto"  # implementations to try (coda_jax.dispatch)

  def __post_init__(self):
    F.check_heads(self.n_q_heads, self.n_kv_heads, self.head_dim)
    if self.reduction not in F.REDUCTIONS:
      raise ValueError(f"reduction={self.reduction!r}: one of {F.REDUCTIONS}")
    if self.activation not in P.ACTIVATIONS:
      raise ValueError(f"activation={self.activation!r}: one of {sorted(P.ACTIVATIONS)}")
    if self.swiglu_block <= 0 or self.swiglu_block % 8:
      raise ValueError(f"swiglu_block={self.swiglu_block} must be a positive multiple of 8")
    if not self.eps > 0:
      raise ValueError(f"eps={self.eps} must be positive")
    F.head_layout(self.wlm_layout)  # raises on anything but "dv" / "vd"
    F.check_head_grad(self.head_grad)
    if self.lm_chunk_rows is not None and self.lm_chunk_rows <= 0:
      raise ValueError(f"lm_chunk_rows={self.lm_chunk_rows} must be positive (or None)")
    if not isinstance(self.impl, str):
      object.__setattr__(self, "impl", tuple(self.impl))  # hashable: a static argument
    dispatch.resolve(self.impl)  # raises on an unknown implementation name
    check_mlp_residuals(self.mlp_residuals)
    if not isinstance(self.qk_norm, bool):
      raise ValueError(f"qk_norm={self.qk_norm!r} must be a bool")
    if self.qk_norm:
      Q.check_head_dim_tiles(self.head_dim, self.impl)

  @property
  def qkv_width(self) -> int:
    return (self.n_q_heads + 2 * self.n_kv_heads) * self.head_dim

  def freqs(self):
    return layout.qkv_freqs(self.n_q_heads, self.n_kv_heads, self.head_dim, self.rope_theta,
                            self.rope_scaling)


SHIFTED_KEYS = ("wo", "g_mlp", "w13", "w2", "g_attn", "wqkv")
POST_KEYS = ("wo", "g_mlp", "w13", "w2", "g_final", "wlm")
# The QK-norm weights (BlockConfig.qk_norm): extra shifted-block params, "g_" as every
# norm weight (kept in fp32 by the casts).
QK_NORM_KEYS = ("g_q_norm", "g_k_norm")
# Token counts (M) that every kernel config tiles as they are: any other M is clipped by
# TMA (a multiple of 8, on the GPU) or padded to a tile by each GEMM
# (``dispatch.padded_shape``), or padded once per step by a caller that can
# (``flax_layers.model.Llama.loss`` pads its sequences).
ROW_MULTIPLE = 256


def _check_params(params, keys, d, cfg: BlockConfig):
  if set(params) != set(keys):
    raise ValueError(f"params must have exactly the keys {keys}, got {sorted(params)}")
  f = params["w13"].shape[-1] // 2
  want = {"wo": (cfg.n_q_heads * cfg.head_dim, d), "g_mlp": (d,), "w13": (d, 2 * f),
          "w2": (f, d), "g_attn": (d,), "wqkv": (d, cfg.qkv_width), "g_final": (d,),
          "wlm": (d, params["wlm"].shape[-1] if "wlm" in params else 0),
          "g_q_norm": (cfg.head_dim,), "g_k_norm": (cfg.head_dim,)}
  if "wlm" in params and cfg.wlm_layout == "vd":
    want["wlm"] = (params["wlm"].shape[0], d)
  for k in keys:
    F.check_weight(k, params[k], want[k])
  if f % cfg.swiglu_block:
    raise ValueError(f"w13 width {2 * f} must be a multiple of 2*swiglu_block="
                     f"{2 * cfg.swiglu_block}")


def _check_acts(x0, y0, d_attn):
  F.check_act("x0", x0)
  F.check_act("y0", y0, d_attn)
  if x0.shape[:-1] != y0.shape[:-1] or x0.dtype != y0.dtype:
    raise ValueError(f"x0 {x0.shape} {x0.dtype} and y0 {y0.shape} {y0.dtype} must share "
                     "leading shape and dtype")


def _cast(params, dt):
  return {k: (v.astype(jnp.float32) if k.startswith("g_") else v.astype(dt))
          for k, v in params.items()}


def _grads_like(grads, params):
  # Under shard_map, a replicated weight's partial gradients are summed over the row
  # shards here (coda_jax.sharding).
  return {k: reduce_like(grads[k], params[k]).astype(params[k].dtype) for k in params}


# ---- shared MLP half: out-proj + residual + norm, gate/up + GLU, down + residual + norm ----
def _mlp_fwd(x0, y0, p, g_next, cfg, keep_z):
  """Returns (x2, h2, r2) and what the backward keeps: (y0, x1, z, r1, y1), y1 None
  unless ``cfg.mlp_residuals`` is "output" (z None without ``keep_z``: no backward)."""
  x1, h1, r1 = S.residual_norm(y0, p["wo"], x0, p["g_mlp"], cfg.eps, cfg.impl)
  z, y1 = S.norm_gated(h1, r1, p["w13"], cfg.swiglu_block, cfg.activation, cfg.impl, keep_z)
  x2, h2, r2 = S.residual_norm(y1, p["w2"], x1, g_next, cfg.eps, cfg.impl)
  # x1 and y1 are read by the down projection too: fenced, or a layer scan's residual
  # stacking would run their GEMMs twice (coda_jax/residuals.py)
  saved_x1, kept_y = fenced(x1, y1 if cfg.mlp_residuals == "output" else None)
  return (x2, h2, r2), (y0, saved_x1, z, r1, kept_y)


def _mlp_bwd(dxa, saved, p, params, cfg):
  """dxa: total cotangent of x2. Returns dx0, dy0 and the MLP half's weight grads."""
  y0, x1, z, r1, kept_y = saved
  d = x1.shape[1]
  wdt = lambda k: S.grad_dtype(params[k])
  # dz comes back times r1 per row: the norm's backward needs no n = r1 x1 g
  # (docs/row_scaled_cotangent.md). y1 is recomputed (and stored) only if not kept.
  dzr, y_made, zdz1 = S.gated_input_grad(dxa, p["w2"], z, cfg.swiglu_block, cfg.activation,
                                         cfg.impl, r=r1, store_y=kept_y is None)
  y1 = y_made if kept_y is None else kept_y
  dw2 = S.weight_grad(y1, dxa, cfg.impl, wdt("w2"))
  dx1, dg1 = S.norm_input_grad_row_scaled(dzr, p["w13"], x1, r1, zdz1 / d, p["g_mlp"], dxa,
                                          cfg.impl)
  dw13 = S.weight_grad(x1, dzr, cfg.impl, wdt("w13"), row_scale=p["g_mlp"])
  dy0 = S.input_grad(dx1, p["wo"], cfg.impl)
  dwo = S.weight_grad(y0, dx1, cfg.impl, wdt("wo"))
  return dx1, dy0, {"wo": dwo, "g_mlp": dg1, "w13": dw13, "w2": dw2}


# ---- pre-block ---------------------------------------------------------------------------
def pre_block(x0, positions, g_attn, wqkv, cfg: BlockConfig, qk_norm_w=None):
  """The embedding output -> the first layer's normed, projected, RoPE'd q, k, v.

  Args:
    x0: (..., D) embeddings.
    positions: (...) int token positions.
    g_attn: (D,) the input RMSNorm's weight.
    wqkv: (D, qkv_width) [q | k | v] projection.
    cfg: the block's static config.
    qk_norm_w: (q_norm_w, k_norm_w), each (head_dim,), exactly when ``cfg.qk_norm``.

  Returns:
    qkv (..., qkv_width) in x0's dtype.
  """
  F.check_act("x0", x0)
  F.check_rows("positions", positions, x0.shape[:-1], "int")
  d = x0.shape[-1]
  F.check_weight("g_attn", g_attn, (d,))
  F.check_weight("wqkv", wqkv, (d, cfg.qkv_width))
  if (qk_norm_w is not None) != cfg.qk_norm:
    raise ValueError(f"pass qk_norm_w=(q_norm_w, k_norm_w) exactly when BlockConfig.qk_norm "
                     f"(it is {cfg.qk_norm}; got {'none' if qk_norm_w is None else 'weights'})")
  norms = {}
  if cfg.qk_norm:
    for k, w in zip(QK_NORM_KEYS, qk_norm_w):
      F.check_weight(k, w, (cfg.head_dim,))
    norms = dict(zip(QK_NORM_KEYS, qk_norm_w))
  lead = x0.shape[:-1]
  qkv = _pre(F.flat_rows(x0), positions.reshape(-1).astype(jnp.int32), g_attn, wqkv, norms,
             cfg)
  return qkv.reshape(*lead, -1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _pre(x0, positions, g, wqkv, norms, cfg):
  return _pre_fwd(x0, positions, g, wqkv, norms, cfg)[0]


def _qk_operands(norms, cfg):
  """(weight, normed) column operands of the QK-norm epilogue (``qk_norm``)."""
  return Q.head_norm_columns(norms["g_q_norm"], norms["g_k_norm"], cfg.n_q_heads,
                             cfg.n_kv_heads)


def _norm_qkv(h, r, w, positions, norms, cfg):
  """K4: the QKV GEMM. Returns (qkv, what the backward keeps: qkv, or u with QK-norm).
  A kept qkv is the output too, so it is fenced (``coda_jax/residuals.py``)."""
  if not cfg.qk_norm:
    qkv = S.norm_rope(h, r, w, positions, cfg.freqs(), cfg.head_dim, cfg.impl)
    return qkv, *fenced(qkv)
  return Q.norm_qknorm_rope(h, r, w, positions, cfg.freqs(), *_qk_operands(norms, cfg),
                            cfg.head_dim, cfg.eps, cfg.impl)


def _qkv_grad(dqkv, kept, positions, norms, cfg, d_model, r):
  """B1: r * dz (dz the cotangent of r * (h @ wqkv); x's dtype, row-scaled for
  ``norm_input_grad_row_scaled``), c = <dz, z> / D per row, and the QK-norm weights'
  gradients ({} without QK-norm)."""
  if not cfg.qk_norm:
    dzr, c = S.rope_grad(dqkv, kept, positions, cfg.freqs(), cfg.head_dim, d_model,
                         cfg.impl, r=r)
    return dzr, c, {}
  du, dweight, udu = Q.qk_norm_grad(dqkv, kept, positions, cfg.freqs(),
                                    *_qk_operands(norms, cfg), cfg.head_dim, cfg.eps,
                                    cfg.impl, r=r)
  hd, n_q, n_kv = cfg.head_dim, cfg.n_q_heads, cfg.n_kv_heads
  grads = {"g_q_norm": dweight[:n_q * hd].reshape(n_q, hd).sum(axis=0),  # over q heads
           "g_k_norm": dweight[n_q * hd:(n_q + n_kv) * hd].reshape(n_kv, hd).sum(axis=0)}
  return du.astype(kept.dtype), udu / d_model, grads


def _pre_fwd(x0, positions, g, wqkv, norms, cfg):
  r0 = unfused.rms_scale(x0, cfg.eps)
  h0 = (x0.astype(jnp.float32) * g.astype(jnp.float32)).astype(x0.dtype)
  qkv, kept = _norm_qkv(h0, r0, wqkv.astype(x0.dtype), positions, norms, cfg)
  return qkv, (x0, positions, g, wqkv, norms, r0, kept)


def _pre_bwd(cfg, saved, dqkv):
  x0, positions, g, wqkv, norms, r0, kept = saved
  dzr, c, dnorms = _qkv_grad(dqkv, kept, positions, norms, cfg, x0.shape[1], r0)
  dx0, dg = S.norm_input_grad_row_scaled(dzr, wqkv.astype(x0.dtype), x0, r0, c, g, None,
                                         cfg.impl)
  dw = S.weight_grad(x0, dzr, cfg.impl, S.grad_dtype(wqkv), row_scale=g)
  return (dx0, None, reduce_like(dg, g).astype(g.dtype),
          reduce_like(dw, wqkv).astype(wqkv.dtype), _grads_like(dnorms, norms))


_pre.defvjp(_pre_fwd, _pre_bwd)


# ---- shifted block -----------------------------------------------------------------------
def shifted_block(x0, y0, positions, params, cfg: BlockConfig):
  """One layer's out-projection and MLP, then the next layer's norm, QKV (and QK-norm) and
  RoPE.

  Args:
    x0: (..., D) residual stream.
    y0: (..., Hq*hd) attention output.
    positions: (...) int token positions.
    params: ``SHIFTED_KEYS`` (plus ``QK_NORM_KEYS`` exactly when ``cfg.qk_norm``).
    cfg: the block's static config.

  Returns:
    (x2 (..., D) residual stream after the MLP, qkv (..., qkv_width) of the next layer).
  """
  _check_params(params, SHIFTED_KEYS + (QK_NORM_KEYS if cfg.qk_norm else ()), x0.shape[-1],
                cfg)
  _check_acts(x0, y0, params["wo"].shape[0])
  F.check_rows("positions", positions, x0.shape[:-1], "int")
  lead = x0.shape[:-1]
  x2, qkv = _shifted(F.flat_rows(x0), F.flat_rows(y0),
                     positions.reshape(-1).astype(jnp.int32), params, cfg)
  return x2.reshape(*lead, -1), qkv.reshape(*lead, -1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _shifted(x0, y0, positions, params, cfg):
  return _shifted_fwd(x0, y0, positions, params, cfg, keep_z=False)[0]


def _shifted_fwd(x0, y0, positions, params, cfg, keep_z=True):
  p = _cast(params, x0.dtype)
  (x2, h2, r2), mlp_saved = _mlp_fwd(x0, y0, p, p["g_attn"], cfg, keep_z)
  qkv, kept = _norm_qkv(h2, r2, p["wqkv"], positions, p, cfg)
  (saved_x2,) = fenced(x2)  # x2 is this block's output too (residuals.py)
  return (x2, qkv), (params, positions, saved_x2, r2, kept, mlp_saved)


def _shifted_bwd(cfg, saved, cts):
  params, positions, x2, r2, kept, mlp_saved = saved
  dx2, dqkv = cts
  p = _cast(params, x2.dtype)
  dz4r, c2, dnorms = _qkv_grad(dqkv, kept, positions, p, cfg, x2.shape[1], r2)
  dxa, dg2 = S.norm_input_grad_row_scaled(dz4r, p["wqkv"], x2, r2, c2, p["g_attn"], dx2,
                                          cfg.impl)
  dwqkv = S.weight_grad(x2, dz4r, cfg.impl, S.grad_dtype(params["wqkv"]),
                        row_scale=p["g_attn"])
  dx0, dy0, grads = _mlp_bwd(dxa, mlp_saved, p, params, cfg)
  grads.update(g_attn=dg2, wqkv=dwqkv, **dnorms)
  return dx0, dy0, None, _grads_like(grads, params)


_shifted.defvjp(_shifted_fwd, _shifted_bwd)


# ---- post-block --------------------------------------------------------------------------
def post_block(x0, y0, targets, params, cfg: BlockConfig):
  """x0 (..., D), y0 (..., Hq*hd) of the last layer, targets (...) int -> the
  cross-entropy (``cfg.reduction``: "mean" over non-ignored targets, "sum", or "none")."""
  _check_params(params, POST_KEYS, x0.shape[-1], cfg)
  _check_acts(x0, y0, params["wo"].shape[0])
  F.check_rows("targets", targets, x0.shape[:-1], "int")
  if cfg.reduction not in F.REDUCTIONS:
    raise ValueError(f"reduction={cfg.reduction!r}: one of {F.REDUCTIONS}")
  head_grad = F.resolve_head_grad(cfg.head_grad, x0.dtype)
  rows = S.row_chunks(targets.size, _vocab(params, cfg), cfg.lm_chunk_rows,
                      buffers=1 if cfg.reduction == "none" else 2)
  loss = _post(F.flat_rows(x0), F.flat_rows(y0), targets.reshape(-1).astype(jnp.int32),
               params, dataclasses.replace(cfg, lm_chunk_rows=rows, head_grad=head_grad))
  return loss.reshape(targets.shape) if cfg.reduction == "none" else loss


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _post(x0, y0, targets, params, cfg):
  p = _cast(params, x0.dtype)
  (_, h2, r2), _ = _mlp_fwd(x0, y0, p, p["g_final"], cfg, keep_z=False)
  lse, tgt = F.lm_head_lse(h2, r2, *F.pad_vocab(p["wlm"], _w_nk(cfg)), targets,
                           cfg.lm_chunk_rows, cfg.impl, _w_nk(cfg))
  return F.loss_from_stats(lse, tgt, targets, cfg.ignore_index, cfg.reduction,
                           _vocab(params, cfg))


# The final norm's backward on a whole (rows, D) dn in fp32 (the "exp" head: its c term,
# <dn, n> / D, is known only once the dh GEMM has made dn, so the norm runs after it, in XLA).
NORM_GRAD = (RmsNormGrad("x", "r", "c", "g", "dg", "n", jnp.float32), P.Store("dx", jnp.float32))
NORM_GRAD_OUTPUTS = tuple(o for step in NORM_GRAD for o in step.outputs(1))


def _post_fwd(x0, y0, targets, params, cfg):
  p = _cast(params, x0.dtype)
  vocab, w_nk = _vocab(params, cfg), _w_nk(cfg)
  (x2, h2, r2), mlp_saved = _mlp_fwd(x0, y0, p, p["g_final"], cfg, keep_z=True)
  wlm, vmask = F.pad_vocab(p["wlm"], w_nk)  # a vocabulary that does not tile, padded
  if cfg.reduction == "none":  # one cotangent per row: the backward recomputes the logits
    lse, tgt, rest = F.lm_head_lse(h2, r2, wlm, vmask, targets, cfg.lm_chunk_rows, cfg.impl,
                                   w_nk, rest=True)
    loss = F.loss_from_stats(lse, tgt, targets, cfg.ignore_index, cfg.reduction, vocab)
    return loss, (params, targets, x2, h2, r2, (lse, tgt, rest), mlp_saved)
  # A scalar loss is linear in its cotangent: form the head's gradients for a unit one
  # now, while each chunk's logits are at hand (3 GEMMs per chunk), and scale them in
  # the backward (fused_ops.rmsnorm_lm_head_loss).
  d = x2.shape[1]
  weight, norm = F.unit_row_weights(targets, cfg.ignore_index, cfg.reduction, vocab)

  def chunk_grad(dlogits, zdz, h2c, r2c, x2c):
    # dxa in fp32 until the backward has scaled it (one rounding, as fused_ops' head)
    dxa, n2, dg = S.norm_input_grad(dlogits, wlm, x2c, r2c, zdz / d, p["g_final"], None,
                                    cfg.impl, w_nk, dx_dtype=jnp.float32)
    return n2, dxa, dg

  def dn_grad(dn, zdz, h2c, r2c, x2c):  # the same from dn = dlogits @ W^T ("exp"), in XLA
    out = dispatch.apply_program(dn, NORM_GRAD, {"x": x2c, "r": r2c, "c": zdz / d,
                                                 "g": p["g_final"].astype(jnp.float32)},
                                 NORM_GRAD_OUTPUTS)
    return out["n"], out["dx"], out["dg"]

  lse, tgt, dwlm, dxa, dg = F.lm_head_unit_grads(
      h2, r2, wlm, targets, weight, cfg.lm_chunk_rows, cfg.impl, chunk_grad,
      sums0=jnp.zeros((d,), jnp.float32), per_row=(x2,), w_nk=w_nk, vmask=vmask,
      store=cfg.head_grad, dn_grad=dn_grad)
  dwlm = F.unpad_vocab(dwlm, vocab, w_nk)
  loss = F.loss_from_stats(lse, tgt, targets, cfg.ignore_index, cfg.reduction, vocab)
  return loss, (params, (dxa, dg, dwlm), norm, mlp_saved)


def _post_bwd(cfg, saved, dloss):
  if cfg.reduction != "none":
    params, unit, norm, mlp_saved = saved
    p = _cast(params, mlp_saved[0].dtype)
    dxa, dgf, dwlm = F.scale_grads(unit, dloss * norm)
    dxa = dxa.astype(mlp_saved[0].dtype)  # rounded once, after the scale
  else:
    params, targets, x2, h2, r2, stats, mlp_saved = saved
    p = _cast(params, x2.dtype)
    dxa, dgf, dwlm = _post_head_bwd(p, params, targets, x2, h2, r2, stats, dloss, cfg)
  dx0, dy0, grads = _mlp_bwd(dxa, mlp_saved, p, params, cfg)
  grads.update(g_final=dgf, wlm=dwlm)
  return dx0, dy0, None, _grads_like(grads, params)


def _w_nk(cfg):
  return F.head_layout(cfg.wlm_layout)


def _vocab(params, cfg):
  return F.head_vocab(params["wlm"], _w_nk(cfg))


def _post_head_bwd(p, params, targets, x2, h2, r2, stats, dloss, cfg):
  """The LM head's backward for per-row cotangents: logits recomputed, chunk by chunk.
  ``stats``: the forward's (lse, target logit, lse without the target)."""
  d, rows = x2.shape[1], cfg.lm_chunk_rows
  vocab, w_nk = _vocab(params, cfg), _w_nk(cfg)
  weight = F.loss_row_weights(dloss, targets, cfg.ignore_index, vocab)
  wlm, vmask = F.pad_vocab(p["wlm"], w_nk)

  def chunk(carry, args):
    dwlm, dg = carry
    x2c, h2c, r2c, lc, gc, sc, tc, wc = args
    dlogits, zdz = S.xent_logits_grad(h2c, r2c, wlm, lc, gc, sc, tc, wc, cfg.impl, w_nk, vmask)
    dxa, n2, dgc = S.norm_input_grad(dlogits, wlm, x2c, r2c, zdz / d, p["g_final"], None,
                                     cfg.impl, w_nk)
    return (S.head_weight_grad(n2, dlogits, cfg.impl, w_nk, accumulate=dwlm), dg + dgc), dxa

  init = (F.dw_carry(wlm, x2), vary_like(jnp.zeros((d,), jnp.float32), x2))
  (dwlm, dgf), dxa = jax.lax.scan(chunk, init,
                                  tuple(F.chunked(rows, x2, h2, r2, *stats, targets,
                                                  weight)))
  return F.unchunked(dxa), dgf, F.unpad_vocab(dwlm, vocab, w_nk)


_post.defvjp(_post_fwd, _post_bwd)
