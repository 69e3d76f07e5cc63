"""The fused Transformer ops, each a ``jax.custom_vjp`` (math: ``docs/design.md`` §1,
"The CODA algebra").

    x, h, r = residual_rmsnorm(y, w, residual, g)        x = y @ w + residual, h = x * g,
                                                         r = rsqrt(mean(x^2) + eps)
    x = residual_matmul(y, w, residual)                  x = y @ w + residual
    y  = rmsnorm_swiglu(h, r, w13)                       act(a) * b of r * (h @ w13)
    qkv = rmsnorm_qkv_rope(h, r, wqkv, positions, ...)   RoPE(r * (h @ wqkv)) on q and k
    loss = rmsnorm_lm_head_loss(h, r, wlm, targets)      cross-entropy of r * (h @ wlm)

RMSNorm(x) @ W = r * ((x * g) @ W): the norm is split into its statistics r (emitted by
the GEMM that produces x) and a row scale in the consumer's epilogue. Compose them
(``rmsnorm_swiglu(*residual_rmsnorm(...)[1:], w13)``) and ``jax.grad`` yields exactly the
RMSNorm backward; ``blocks.py`` fuses that backward further across op boundaries.

Shapes: activations (..., D) (e.g. (B, T, D) or (M, D)); leading dims are flattened into
M. ``positions`` and ``targets`` have the activations' leading shape.

Cast policy: activations must be bfloat16 or float16 (float32 runs the XLA reference
path). Weights may be any float dtype: they are cast to the activation dtype for the
GEMM, norm weights to fp32 for the epilogue, and their gradients are accumulated in fp32
and returned in the weight's own dtype. ``r`` is fp32.

Gemma's (1 + g) norm weights: pass ``norm_weight(g, 1.0)`` (1 + g in fp32) as ``g``; its
gradient reaches the stored g unchanged, since d(1 + g)/dg = 1.

``impl``: as ``gemm_epilogue`` ("auto", "mosaic", "interpret", "xla").
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from coda_jax import layout
from coda_jax import block_gemms as S
from coda_jax import unfused
from coda_jax.primitives import ACTIVATIONS
from coda_jax.residuals import fenced
from coda_jax.sharding import reduce_like, vary_like

_ACT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
REDUCTIONS = ("mean", "sum", "none")

# How a scalar loss's LM head forms its unit gradient (``lm_head_unit_grads``): "logits"
# stores the chunk's logits (fp16) and runs the softmax backward over them in XLA; "exp"
# stores exp(logits) (bf16) and folds the softmax into the dh and dW GEMMs' row scales;
# "auto" (the default) is "exp" wherever it can run (bfloat16 and float32 activations)
# and "logits" for float16 (``resolve_head_grad``). "exp" measured 3% faster on the 1B
# post-block in the same process (docs/lm_head_exp_store.md).
HEAD_GRADS = ("auto", "logits", "exp")


def norm_weight(stored, offset: float = 0.0):
  """The weight a norm multiplies by: the stored one, plus ``offset`` when it is nonzero
  (Gemma's norms apply 1 + g to a stored g that starts at 0).

  Args:
    stored: the (D,) (or stacked (L, D)) parameter as held.
    offset: the constant added (0.0: Llama, Qwen, GPT-2; 1.0: Gemma).

  Returns:
    ``stored`` itself without an offset; else ``offset + stored`` in fp32, so that a
    bf16-stored g near 0 keeps its bits (1 + g in bf16 would round g to 1/128). The ops
    take norm weights in fp32, and d(offset + g)/dg = 1, so under ``jax.grad`` the
    stored weight gets the op's gradient of the applied one.
  """
  return stored if not offset else stored.astype(jnp.float32) + offset


def check_act(name, x, width=None):
  if x.dtype not in _ACT_DTYPES:
    raise ValueError(f"{name}.dtype={x.dtype}: activations must be bfloat16, float16 or "
                     "float32")
  if x.ndim < 2:
    raise ValueError(f"{name} must be (..., D) with at least 2 dims, got shape {x.shape}")
  if width is not None and x.shape[-1] != width:
    raise ValueError(f"{name} has width {x.shape[-1]}, expected {width}")


def check_weight(name, w, shape):
  if not jnp.issubdtype(w.dtype, jnp.floating):
    raise ValueError(f"{name}.dtype={w.dtype}: weights must be floating point")
  if tuple(w.shape) != tuple(shape):
    raise ValueError(f"{name} has shape {tuple(w.shape)}, expected {tuple(shape)}")


def check_rows(name, v, lead, dtype_kind):
  if tuple(v.shape) != tuple(lead):
    raise ValueError(f"{name} has shape {tuple(v.shape)}, expected the activations' leading "
                     f"shape {tuple(lead)}")
  if dtype_kind == "int" and not jnp.issubdtype(v.dtype, jnp.integer):
    raise ValueError(f"{name}.dtype={v.dtype}: must be an integer type")


def check_residual(residual, y):
  if residual.shape[:-1] != y.shape[:-1]:
    raise ValueError(f"residual has leading shape {tuple(residual.shape[:-1])}, expected y's "
                     f"leading shape {tuple(y.shape[:-1])}")
  if residual.dtype != y.dtype:
    raise ValueError(f"residual.dtype={residual.dtype} must equal y.dtype={y.dtype}")


def check_heads(n_q_heads, n_kv_heads, head_dim):
  if head_dim <= 0 or head_dim % 16:
    raise ValueError(f"head_dim={head_dim} must be a positive multiple of 16")
  for name, n in (("n_q_heads", n_q_heads), ("n_kv_heads", n_kv_heads)):
    if n <= 0:
      raise ValueError(f"{name}={n} must be positive")
  if n_q_heads % n_kv_heads:
    raise ValueError(f"n_q_heads={n_q_heads} must be a multiple of n_kv_heads={n_kv_heads} "
                     "(each KV head serves a whole group of query heads)")


def flat_rows(x):
  return x.reshape(-1, x.shape[-1])


# ---- residual add + RMSNorm statistics + norm-weighted output ------------------------------
def residual_rmsnorm(y, w, residual, g, *, eps: float = 1e-5, impl: str = "auto"):
  """y (..., K), w (K, D), residual (..., D), g (D,) -> x (..., D), h (..., D), r (...)."""
  check_act("y", y)
  check_weight("w", w, (y.shape[-1], w.shape[-1]))
  check_act("residual", residual, w.shape[-1])
  check_weight("g", g, (w.shape[-1],))
  check_residual(residual, y)
  lead = y.shape[:-1]
  x, h, r = _residual_rmsnorm(flat_rows(y), w, flat_rows(residual), g, eps, impl)
  return x.reshape(*lead, -1), h.reshape(*lead, -1), r.reshape(lead)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _residual_rmsnorm(y, w, residual, g, eps, impl):
  return _residual_rmsnorm_fwd(y, w, residual, g, eps, impl)[0]


def _residual_rmsnorm_fwd(y, w, residual, g, eps, impl):
  x, h, r = S.residual_norm(y, w.astype(y.dtype), residual, g, eps, impl)
  return (x, h, r), (y, w, *fenced(x), g, r)  # x is an output too (residuals.py)


def _residual_rmsnorm_bwd(eps, impl, saved, cts):
  y, w, x, g, r = saved
  dx, dh, dr = cts
  xf = x.astype(jnp.float32)
  d = x.shape[1]
  dxt = (dx.astype(jnp.float32) + dh.astype(jnp.float32) * g.astype(jnp.float32)
         - (dr * r ** 3 / d)[:, None] * xf).astype(x.dtype)
  dg = jnp.sum(dh.astype(jnp.float32) * xf, axis=0)
  dy = S.input_grad(dxt, w.astype(y.dtype), impl)
  dw = S.weight_grad(y, dxt, impl, S.grad_dtype(w))
  return dy, reduce_like(dw, w).astype(w.dtype), dxt, reduce_like(dg, g).astype(g.dtype)


_residual_rmsnorm.defvjp(_residual_rmsnorm_fwd, _residual_rmsnorm_bwd)


# ---- residual add (no norm) -------------------------------------------------------------
def residual_matmul(y, w, residual, *, impl: str = "auto"):
  """y (..., K), w (K, D), residual (..., D) -> x = y @ w + residual (..., D): the
  residual add in the GEMM's epilogue, where no norm follows (a standalone MLP's down
  projection)."""
  check_act("y", y)
  check_weight("w", w, (y.shape[-1], w.shape[-1]))
  check_act("residual", residual, w.shape[-1])
  check_residual(residual, y)
  x = _residual_matmul(flat_rows(y), w, flat_rows(residual), impl)
  return x.reshape(residual.shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _residual_matmul(y, w, residual, impl):
  return S.residual_add(y, w.astype(y.dtype), residual, impl)


def _residual_matmul_fwd(y, w, residual, impl):
  return _residual_matmul(y, w, residual, impl), (y, w)


def _residual_matmul_bwd(impl, saved, dx):
  y, w = saved
  dy = S.input_grad(dx, w.astype(y.dtype), impl)
  dw = S.weight_grad(y, dx, impl, S.grad_dtype(w))
  return dy, reduce_like(dw, w).astype(w.dtype), dx


_residual_matmul.defvjp(_residual_matmul_fwd, _residual_matmul_bwd)


# ---- RMSNorm row scale + gate/up GEMM + gated activation --------------------------------
def rmsnorm_swiglu(h, r, w13, *, block: int = 32, activation: str = "silu",
                   impl: str = "auto"):
  """h (..., D), r (...), w13 (D, 2F) pair-blocked (``layout.gate_up_to_blocked``)
  -> y (..., F) = act(gate) * up of RMSNorm'd input. activation: "silu" or "gelu"."""
  check_act("h", h)
  check_weight("w13", w13, (h.shape[-1], w13.shape[-1]))
  check_rows("r", r, h.shape[:-1], "float")
  if w13.shape[1] % (2 * block):
    raise ValueError(f"w13 width {w13.shape[1]} must be a multiple of 2*block={2 * block}")
  if activation not in ACTIVATIONS:
    raise ValueError(f"activation={activation!r}: one of {sorted(ACTIVATIONS)}")
  lead = h.shape[:-1]
  y = _rmsnorm_swiglu(flat_rows(h), r.reshape(-1).astype(jnp.float32), w13, block, activation,
                      impl)
  return y.reshape(*lead, -1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _rmsnorm_swiglu(h, r, w13, block, activation, impl):
  return S.norm_gated(h, r, w13.astype(h.dtype), block, activation, impl, keep_z=False)[1]


def _rmsnorm_swiglu_fwd(h, r, w13, block, activation, impl):
  z, y = S.norm_gated(h, r, w13.astype(h.dtype), block, activation, impl)
  return y, (h, r, w13, z)


def _rmsnorm_swiglu_bwd(block, activation, impl, saved, dy):
  h, r, w13, z = saved
  dzf = unfused.gated_grad(dy, z, block, activation)
  dr = jnp.sum(dzf * z.astype(jnp.float32), axis=1) / r  # zdz: <dz, acc> = <dz, z> / r
  return _norm_gemm_grads(h, w13, (dzf * r[:, None]).astype(h.dtype), dr, impl)


def _norm_gemm_grads(h, w, dzr, dr, impl):
  """Cotangents of (h, r, w) for z = r * (h @ w), given dzr = r * dz (row-scaled by its
  producer) and dr = <dz, z> / r: dh = r * (dz @ w^T) = dzr @ w^T and
  dw = (r h)^T dz = h^T dzr, two plain GEMMs (docs/row_scaled_cotangent.md)."""
  dh = S.input_grad(dzr, w.astype(h.dtype), impl)
  dw = S.weight_grad(h, dzr, impl, S.grad_dtype(w))
  return dh, dr, reduce_like(dw, w).astype(w.dtype)


_rmsnorm_swiglu.defvjp(_rmsnorm_swiglu_fwd, _rmsnorm_swiglu_bwd)


# ---- RMSNorm row scale + QKV GEMM + RoPE -------------------------------------------------
def rmsnorm_qkv_rope(h, r, wqkv, positions, *, n_q_heads: int, n_kv_heads: int,
                     head_dim: int, theta: float = 500000.0,
                     rope_scaling: layout.RopeScaling | None = None, impl: str = "auto"):
  """h (..., D), r (...), wqkv (D, (Hq + 2 Hkv) * head_dim) as [q | k | v] rotate-half
  heads, positions (...) int -> qkv (..., (Hq + 2 Hkv) * head_dim), RoPE'd q and k."""
  check_act("h", h)
  check_heads(n_q_heads, n_kv_heads, head_dim)  # before wqkv, whose shape they define
  n = (n_q_heads + 2 * n_kv_heads) * head_dim
  check_weight("wqkv", wqkv, (h.shape[-1], n))
  check_rows("r", r, h.shape[:-1], "float")
  check_rows("positions", positions, h.shape[:-1], "int")
  lead = h.shape[:-1]
  qkv = _rmsnorm_qkv_rope(flat_rows(h), r.reshape(-1).astype(jnp.float32), wqkv,
                          positions.reshape(-1).astype(jnp.int32),
                          (n_q_heads, n_kv_heads, head_dim, float(theta), rope_scaling), impl)
  return qkv.reshape(*lead, -1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _rmsnorm_qkv_rope(h, r, wqkv, positions, heads, impl):
  return _qkv_fwd(h, r, wqkv, positions, heads, impl)[0]


def _qkv_fwd(h, r, wqkv, positions, heads, impl):
  freqs = layout.qkv_freqs(*heads)
  qkv = S.norm_rope(h, r, wqkv.astype(h.dtype), positions, freqs, heads[2], impl)
  return qkv, (h, r, wqkv, positions, *fenced(qkv))  # the output, kept (residuals.py)


def _qkv_bwd(heads, impl, saved, dqkv):
  h, r, wqkv, positions, qkv = saved
  dzr, c = S.rope_grad(dqkv, qkv, positions, layout.qkv_freqs(*heads), heads[2], 1, impl,
                       r=r)
  dh, dr, dw = _norm_gemm_grads(h, wqkv, dzr, c / r, impl)
  return dh, dr, dw, None


_rmsnorm_qkv_rope.defvjp(_qkv_fwd, _qkv_bwd)


# ---- RMSNorm row scale + LM head + cross-entropy -----------------------------------------
def rmsnorm_lm_head_loss(h, r, wlm, targets, *, ignore_index: int = -100,
                         reduction: str = "mean", chunk_rows: int | None = None,
                         wlm_layout: str = "dv", head_grad: str = "auto",
                         impl: str = "auto"):
  """Cross-entropy of the logits r * (h @ wlm), never stored whole.

  Args:
    h: (..., D) bf16/fp16 activations (x * g of the final RMSNorm).
    r: (...) the norm's row scale 1 / rms(x).
    wlm: the head: (D, V), or (V, D) with ``wlm_layout="vd"`` (a tied embedding table,
      read transposed by the GEMMs instead of copied; its gradient comes back (V, D)).
    targets: (...) int token ids; ``ignore_index`` entries are skipped.
    ignore_index, reduction: as ``jnp_reference.cross_entropy``.
    chunk_rows: rows per chunk (a divisor of the token count); default
      ``block_gemms.row_chunks``: a chunk's 16-bit (rows, V) buffers fit in 1 GiB.
    wlm_layout: "dv" or "vd".
    head_grad: how a "mean" or "sum" loss forms its gradient in the forward
      (``HEAD_GRADS``): "logits" stores each chunk's logits in float16 and runs the
      softmax backward over them in XLA; "exp" stores exp(logits) in bfloat16 and folds
      the softmax into the dh and dW GEMMs (no pass over the chunk; bfloat16 or float32
      activations only; docs/lm_head_exp_store.md); "auto" (default) is "exp" for
      bfloat16 and float32 activations and "logits" for float16. "none" ignores it.
    impl: as ``gemm_epilogue``.

  Returns:
    fp32: a scalar ("mean" over non-ignored targets, or "sum"), or per token ("none",
    shaped like targets).

  Rows run in chunks of ``chunk_rows``; only one chunk's logits ever exist. Without
  differentiation, one GEMM per chunk computes each row's log-sum-exp and target logit
  in its epilogue. Under ``jax.grad`` of a "mean" or "sum" loss, the forward also
  forms the gradient, chunk by chunk, while the chunk's logits are at hand: the loss is
  linear in its scalar cotangent, so the gradients for a unit cotangent are computed
  there (3 GEMMs per chunk: logits, dh, dW) and the backward only scales them. For
  "none" (one cotangent per row) the backward recomputes the logits instead (4 GEMMs
  per chunk).

  A target outside [0, V) other than ``ignore_index`` makes its row's loss NaN (and a
  mean or sum NaN), as in ``jnp_reference.cross_entropy``; that row passes no
  gradient."""
  check_act("h", h)
  w_nk = head_layout(wlm_layout)
  check_weight("wlm", wlm, (wlm.shape[0], h.shape[-1]) if w_nk else (h.shape[-1], wlm.shape[-1]))
  check_rows("r", r, h.shape[:-1], "float")
  check_rows("targets", targets, h.shape[:-1], "int")
  if reduction not in REDUCTIONS:
    raise ValueError(f"reduction={reduction!r}: one of {REDUCTIONS}")
  head_grad = resolve_head_grad(head_grad, h.dtype)
  m = targets.size
  rows = S.row_chunks(m, head_vocab(wlm, w_nk), chunk_rows,
                      buffers=1 if reduction == "none" else 2)
  out = _lm_head_loss(flat_rows(h), r.reshape(-1).astype(jnp.float32), wlm,
                      targets.reshape(-1).astype(jnp.int32),
                      HeadOptions(int(ignore_index), reduction, rows, w_nk, head_grad), impl)
  return out.reshape(targets.shape) if reduction == "none" else out


def head_layout(wlm_layout: str) -> bool:
  """"dv" -> False, "vd" -> True (the head is stored (V, D): ``block_gemms``' w_nk)."""
  if wlm_layout not in ("dv", "vd"):
    raise ValueError(f"wlm_layout={wlm_layout!r}: \"dv\" for a (D, V) head, \"vd\" for a "
                     "(V, D) one such as a tied embedding table")
  return wlm_layout == "vd"


def head_vocab(wlm, w_nk: bool) -> int:
  return wlm.shape[0] if w_nk else wlm.shape[1]


# The logit of a padded vocabulary's extra columns (``pad_vocab``). Finite, so that its
# products with their zero gradient stay 0 in zdz (-inf * 0 would be NaN); within
# float16's range (the stored logits); low enough that exp(PAD_LOGIT - lse) is exactly 0
# in fp32 for any row whose largest real logit is above PAD_LOGIT + 104.
PAD_LOGIT = -30000.0
VOCAB_TILE = 64  # the kernels tile a vocabulary that is a multiple of this


def pad_vocab(wlm, w_nk: bool):
  """A head whose vocabulary V does not tile (GPT-2's 50257), padded with zero columns
  to a multiple of 128, and the (Vp,) fp32 ``AddBias`` operand that masks the pad
  columns out of every softmax: 0 on the V real columns, ``PAD_LOGIT`` on the others.
  Their logits are then PAD_LOGIT, their probabilities and gradients exactly 0, so the
  loss, the LSE, dh and dW's real columns are those of the unpadded head
  (``unpad_vocab`` drops dW's pad columns). A V that tiles is returned as it is, with
  no mask. Costs one copy of the head per call, against running its three
  vocabulary-sized GEMMs in XLA.

  Args:
    wlm: the head, (D, V), or (V, D) with ``w_nk``.
    w_nk: the (V, D) layout.

  Returns:
    (head, mask): the padded head (or ``wlm``) and the mask (or None)."""
  v = head_vocab(wlm, w_nk)
  if v % VOCAB_TILE == 0:
    return wlm, None
  vp = -(-v // 128) * 128
  widths = ((0, vp - v), (0, 0)) if w_nk else ((0, 0), (0, vp - v))
  mask = jnp.where(jnp.arange(vp) < v, 0.0, PAD_LOGIT).astype(jnp.float32)
  return jnp.pad(wlm, widths), mask


def unpad_vocab(dw, vocab: int, w_nk: bool):
  """dW of a ``pad_vocab`` head back to the real vocabulary's ``vocab`` columns."""
  if head_vocab(dw, w_nk) == vocab:
    return dw
  return dw[:vocab] if w_nk else dw[:, :vocab]


def chunked(rows, *arrays):
  """(M, ...) arrays as (M / rows, rows, ...) chunks of strided rows: chunk c holds rows
  c, c + C, c + 2C, ... (C chunks). When the rows are split over devices, every chunk
  is then split the same way, and a loop over chunks needs no communication."""
  return [a.reshape(rows, -1, *a.shape[1:]).swapaxes(0, 1) for a in arrays]


def unchunked(x):
  """The inverse of ``chunked``: (C, rows, ...) -> (C * rows, ...)."""
  return x.swapaxes(0, 1).reshape(-1, *x.shape[2:])


@dataclasses.dataclass(frozen=True)
class HeadOptions:
  """The static options of one ``rmsnorm_lm_head_loss`` call (a ``custom_vjp``
  non-differentiable argument: hashable)."""
  ignore_index: int
  reduction: str  # REDUCTIONS
  rows: int  # rows per chunk, dividing the token count
  w_nk: bool  # the head is stored (V, D)
  head_grad: str  # HEAD_GRADS

  def __post_init__(self):
    if self.reduction not in REDUCTIONS:
      raise ValueError(f"reduction={self.reduction!r}: one of {REDUCTIONS}")
    if self.rows <= 0:
      raise ValueError(f"rows={self.rows} per chunk must be positive")
    check_head_grad(self.head_grad)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _lm_head_loss(h, r, wlm, targets, opts, impl):
  ignore_index, reduction, rows, w_nk = opts.ignore_index, opts.reduction, opts.rows, opts.w_nk
  lse, tgt = lm_head_lse(h, r, *pad_vocab(wlm, w_nk), targets, rows, impl, w_nk)
  return loss_from_stats(lse, tgt, targets, ignore_index, reduction, head_vocab(wlm, w_nk))


def lm_head_lse(h, r, wlm, vmask, targets, rows, impl, w_nk=False, rest=False):
  """(lse, target logit) per row, ``rows`` rows per kernel call; ``wlm`` and ``vmask``
  as ``pad_vocab`` returns them. With ``rest``, also the log-sum-exp without the
  target's column, which a recomputing backward needs (``S.xent_logits_grad``)."""
  w = wlm.astype(h.dtype)
  step = lambda args: S.lm_head_stats(*args[:2], w, args[2], impl, w_nk, vmask, rest)
  return tuple(map(unchunked, jax.lax.map(step, tuple(chunked(rows, h, r, targets)))))


def out_of_range(targets, vocab, ignore_index):
  """Targets that are neither in [0, vocab) nor ``ignore_index``: their loss is NaN."""
  return (targets != ignore_index) & ((targets < 0) | (targets >= vocab))


def loss_from_stats(lse, tgt, targets, ignore_index, reduction, vocab):
  valid = targets != ignore_index
  losses = jnp.where(valid, lse - tgt, 0.0)
  losses = jnp.where(out_of_range(targets, vocab, ignore_index), jnp.nan, losses)
  if reduction == "none":
    return losses
  total = jnp.sum(losses)
  return total if reduction == "sum" else total / jnp.maximum(jnp.sum(valid), 1)


def loss_row_weights(dloss, targets, ignore_index, vocab):
  """d (sum of row losses) / d (lse_m - logit_m), times the cotangent ``dloss`` (a
  scalar, or one per row): 0 for ignored rows and for rows whose loss is NaN (an
  out-of-range target passes no gradient, as in the reference). A mean's 1/count is
  applied by the caller (``unit_row_weights``)."""
  valid = ((targets != ignore_index)
           & ~out_of_range(targets, vocab, ignore_index)).astype(jnp.float32)
  return valid * dloss


def lm_head_unit_grads(h, r, wlm, targets, weight, rows, impl, chunk_grad, sums0=(),
                       per_row=(), w_nk=False, vmask=None, store="logits", dn_grad=None):
  """The 3-GEMM LM head, chunk by chunk (``rows`` rows each): one GEMM makes the logits
  r * (h @ W) with their log-sum-exp and target logit; dlogits for the row weights
  ``weight`` follow elementwise; ``chunk_grad(dlogits, zdz, hc, rc, *per_row chunks)``
  runs the input-gradient GEMM and returns (n, per-row outputs, column sums) with
  n = h * r the normed input; the third GEMM adds n^T dlogits to dW. ``sums0``: zeros
  shaped like the column sums, which add up over the chunks.

  ``store="exp"`` (``HEAD_GRADS``; docs/lm_head_exp_store.md): the logits GEMM stores
  exp(logits) instead, and no elementwise pass over the (rows, V) chunk runs: the dh
  GEMM scales its rows (``S.head_dn``) and ``dn_grad(dn, zdz, hc, rc, *per_row chunks)``
  takes dn = dlogits @ W^T (fp32) where ``chunk_grad`` takes dlogits, and returns n in
  fp32; the dW GEMM reads the exponentials with n's rows scaled.

  Returns (lse, target logit, dW in fp32 and ``wlm``'s layout, per-row outputs, column
  sums over all rows). Under ``shard_map`` with the rows split, dW and the sums are this
  shard's: ``reduce_like`` them once scaled by the cotangent (which may vary too).
  ``wlm`` and ``vmask`` as ``pad_vocab`` returns them (dW then has the pad columns)."""
  if resolve_head_grad(store, h.dtype) != store:  # checks it, and that it is resolved
    raise ValueError(f"store={store!r}: 'logits' or 'exp' (resolve_head_grad first)")
  w = wlm.astype(h.dtype)
  # A scan over the chunks: its body's kernels are lowered and compiled once, and one
  # chunk's logits and dlogits are live at a time. The kernel adds each chunk's
  # n^T dlogits into the dW carry in place: one fp32 dW buffer for all chunks
  # (compile time and peak memory against the alternatives:
  # docs/tuning.md#the-lm-heads-chunk-scan).

  def step_exp(carry, args):
    dw, sums = carry
    hc, rc, tc, wc, *rest = args
    lse, tgt, _, e, shift = S.lm_head_exp_safe(hc, rc, w, tc, impl, w_nk, vmask)
    s = S.exp_store_scale(lse, shift, wc)
    dn = S.head_dn(e, w, s, impl, w_nk)
    # <dlogits, logits> = <dlogits, r (h @ W)> = r <dn, h>: no pass over the logits
    zdz = rc * jnp.sum(dn * hc.astype(jnp.float32), axis=1)
    n, ys, col_sums = dn_grad(dn, zdz, hc, rc, *rest)
    sums = jax.tree.map(jnp.add, sums, col_sums)
    # the dW GEMM reads s n (rounded once from fp32 n) against e
    ns = (n * s[:, None]).astype(e.dtype)
    return (S.head_weight_grad(ns, e, impl, w_nk, accumulate=dw), sums), (lse, tgt, ys)

  def step(carry, args):
    dw, sums = carry
    hc, rc, tc, wc, *rest = args
    lse, tgt, lse_rest, z = S.lm_head_logits(hc, rc, w, tc, impl, w_nk, vmask)
    dlogits, zdz = S.xent_grad_from_logits(z, lse, tgt, lse_rest, tc, wc, h.dtype)
    n, ys, col_sums = chunk_grad(dlogits, zdz, hc, rc, *rest)
    sums = jax.tree.map(jnp.add, sums, col_sums)
    return (S.head_weight_grad(n, dlogits, impl, w_nk, accumulate=dw), sums), (lse, tgt, ys)

  xs = tuple(chunked(rows, h, r, targets, weight, *per_row))
  vary = lambda x: vary_like(x, h)  # the accumulators vary with the rows' shards
  init = (dw_carry(wlm, h), jax.tree.map(vary, sums0))
  body = step_exp if store == "exp" else step
  (dw, sums), (lse, tgt, ys) = jax.lax.scan(body, init, xs)
  return unchunked(lse), unchunked(tgt), dw, jax.tree.map(unchunked, ys), sums


def dw_carry(w, rows):
  """The LM head's fp32 dW accumulator for a scan over row chunks: zeros shaped and (on
  explicit mesh axes) sharded like the head ``w``, varying with ``rows``' shards (each
  shard sums its own rows' part)."""
  return vary_like(jnp.zeros_like(w, jnp.float32), rows)


def check_head_grad(head_grad: str, dtype=None) -> None:
  """ValueError unless ``head_grad`` is one of ``HEAD_GRADS`` and, when the activations'
  ``dtype`` is given, can run in it."""
  if head_grad not in HEAD_GRADS:
    raise ValueError(f"head_grad={head_grad!r}: one of {HEAD_GRADS}")
  if head_grad == "exp" and dtype is not None and jnp.dtype(dtype) == jnp.float16:
    raise ValueError("head_grad='exp' stores exp(logits), which overflows float16 above "
                     "logit 11: use bfloat16 (or float32) activations, or "
                     "head_grad='logits'")


def resolve_head_grad(head_grad: str, dtype) -> str:
  """The way of forming the LM head's gradient that runs for activations of ``dtype``.

  Args:
    head_grad: one of ``HEAD_GRADS``.
    dtype: the activations' dtype.

  Returns:
    "logits" or "exp": ``head_grad`` itself, checked against ``dtype`` (ValueError for
    "exp" with float16), or for "auto" "logits" with float16 activations and "exp"
    otherwise.
  """
  check_head_grad(head_grad, dtype)
  if head_grad != "auto":
    return head_grad
  return "logits" if jnp.dtype(dtype) == jnp.float16 else "exp"


def unit_row_weights(targets, ignore_index, reduction, vocab):
  """The forward-formed head gradient's row weights, and the scalar that turns them
  into d loss / d (lse - logit) once multiplied by the cotangent: the weights are a
  "sum"'s (1 per counted row), and a mean's 1 / count goes into that scalar. So the
  bf16 dlogits are the same whether the mean is taken here or by a caller that sums
  per device and divides by the global count."""
  weight = loss_row_weights(1.0, targets, ignore_index, vocab)
  if reduction == "mean":
    return weight, 1.0 / jnp.maximum(jnp.sum(targets != ignore_index), 1).astype(jnp.float32)
  return weight, jnp.ones((), jnp.float32)


def scale_grads(grads, scale):
  """Each gradient times a scalar cotangent, in fp32, back in its own dtype."""
  scale = jnp.asarray(scale, jnp.float32)
  return jax.tree.map(lambda g: (g.astype(jnp.float32) * scale).astype(g.dtype), grads)


def _lm_fwd(h, r, wlm, targets, opts, impl):
  ignore_index, reduction, rows, w_nk = opts.ignore_index, opts.reduction, opts.rows, opts.w_nk
  head_grad = opts.head_grad
  vocab = head_vocab(wlm, w_nk)
  wp, vmask = pad_vocab(wlm, w_nk)
  if reduction == "none":
    lse, tgt, rest = lm_head_lse(h, r, wp, vmask, targets, rows, impl, w_nk, rest=True)
    return (loss_from_stats(lse, tgt, targets, ignore_index, reduction, vocab),
            (h, r, wlm, targets, lse, tgt, rest))
  weight, norm = unit_row_weights(targets, ignore_index, reduction, vocab)
  w = wp.astype(h.dtype)

  def chunk_grad(dlogits, zdz, hc, rc):  # dh = r * (dlogits @ W^T); dr = zdz / r
    n = (hc.astype(jnp.float32) * rc[:, None]).astype(hc.dtype)
    # dh in fp32 until the backward has scaled it: one rounding to h's dtype, as when
    # the cotangent is inside dlogits (the "none" path, or another device count).
    return n, (S.input_grad(dlogits, w, impl, r=rc, w_nk=w_nk, dtype=jnp.float32),
               zdz / rc), ()

  def dn_grad(dn, zdz, hc, rc):  # the same from dn = dlogits @ W^T (head_grad="exp")
    return hc.astype(jnp.float32) * rc[:, None], (rc[:, None] * dn, zdz / rc), ()

  lse, tgt, dw, (dh, dr), _ = lm_head_unit_grads(h, r, wp, targets, weight, rows, impl,
                                                 chunk_grad, w_nk=w_nk, vmask=vmask,
                                                 store=head_grad, dn_grad=dn_grad)
  dw = unpad_vocab(dw, vocab, w_nk)
  loss = loss_from_stats(lse, tgt, targets, ignore_index, reduction, vocab)
  # dh and dW stay fp32 until they are scaled; the empty arrays carry h's and the
  # weight's dtypes, and r's and the weight's varying mesh axes (for reduce_like: under
  # shard_map an r made on every device alike, e.g. ones, gets its dr summed).
  return loss, (dh, dr, dw, norm, jnp.zeros((0,), h.dtype),
                vary_like(jnp.zeros((0,), wlm.dtype), wlm), vary_like(jnp.zeros((0,)), r))


def _lm_bwd(opts, impl, saved, dloss):
  ignore_index, reduction, rows, w_nk = opts.ignore_index, opts.reduction, opts.rows, opts.w_nk
  if reduction != "none":  # the forward's gradients for a unit cotangent, scaled
    dh, dr, dw, norm, hdt, wdt, rdt = saved
    dh, dr, dw = scale_grads((dh, dr, dw), dloss * norm)
    return (dh.astype(hdt.dtype), reduce_like(dr, rdt), reduce_like(dw, wdt).astype(wdt.dtype),
            None)
  h, r, wlm, targets, lse, tgt, rest = saved
  vocab = head_vocab(wlm, w_nk)
  weight = loss_row_weights(dloss, targets, ignore_index, vocab)
  wp, vmask = pad_vocab(wlm, w_nk)
  w = wp.astype(h.dtype)

  def step(dw, args):
    hc, rc, lc, gc, sc, tc, wc = args
    dlogits, zdz = S.xent_logits_grad(hc, rc, w, lc, gc, sc, tc, wc, impl, w_nk, vmask)
    dh = S.input_grad(dlogits, w, impl, r=rc, w_nk=w_nk)
    n = (hc.astype(jnp.float32) * rc[:, None]).astype(hc.dtype)
    return S.head_weight_grad(n, dlogits, impl, w_nk, accumulate=dw), (dh, zdz / rc)

  dw, (dh, dr) = jax.lax.scan(step, dw_carry(wp, h),
                              tuple(chunked(rows, h, r, lse, tgt, rest, targets, weight)))
  dw = unpad_vocab(dw, vocab, w_nk)
  return (unchunked(dh), reduce_like(unchunked(dr), r), reduce_like(dw, wlm).astype(wlm.dtype),
          None)


_lm_head_loss.defvjp(_lm_fwd, _lm_bwd)
