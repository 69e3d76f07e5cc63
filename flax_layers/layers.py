"""Flax NNX layers over the fused ops, each with a pure-XLA twin behind one switch.

Every layer holds its parameters in the kernel layout (``coda_jax.layout``) and a static
``fused`` flag: True runs ``coda_jax.fused_ops`` (GEMM-epilogue kernels on Hopper, their
XLA programs elsewhere), False runs ``coda_jax.jnp_reference``, the same math as plain
jnp under ordinary autodiff. ``module.set_attributes(fused=False)`` flips a whole model.

Inputs are (..., D) activations, usually (B, T, D); ``positions`` and ``targets`` have
their leading shape. Parameters are stored in ``param_dtype`` and cast to the
activations' dtype for the GEMMs (norm weights: fp32).

Norm weights: the layers with a norm take ``norm_offset``: 0.0 applies the stored weight
g (Llama, Qwen), 1.0 applies 1 + g with g stored from zeros (Gemma); ``norm_weight``.
"""
from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
from flax import nnx

from coda_jax import fused_ops as F
from coda_jax import jnp_reference as ref
from coda_jax import qk_norm as qk_norm_ops
from coda_jax import unfused
from coda_jax.primitives import ACTIVATIONS
from coda_jax.sharding import RowSplit, sum_over_rows


def _check_sizes(layer: str, **sizes) -> None:
  """Construction-time check: every size a positive integer."""
  for name, value in sizes.items():
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
      raise ValueError(f"{layer}: {name}={value!r} must be a positive integer")


def _check_eps(layer: str, eps) -> None:
  if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not eps > 0:
    raise ValueError(f"{layer}: eps={eps!r} must be a positive number")


def _check_width(layer: str, arg: str, array, weight: str, want: int) -> None:
  """Call-time check that ``array``'s last dimension is what ``weight`` was built for."""
  if array.ndim < 1 or array.shape[-1] != want:
    raise ValueError(f"{layer}: {arg} has shape {tuple(array.shape)}, but {weight} expects a "
                     f"last dimension of {want} (the layer's width); reshape the input or "
                     "build the layer for this width")


def _check_lead(layer: str, arg: str, array, x_arg: str, x) -> None:
  """``array`` (e.g. positions, targets) must have ``x``'s leading shape."""
  if tuple(array.shape) != tuple(x.shape[:-1]):
    raise ValueError(f"{layer}: {arg} has shape {tuple(array.shape)}; it must be "
                     f"{x_arg}'s leading shape {tuple(x.shape[:-1])}")


def _normal(rngs, shape, std, dtype):
  return nnx.Param(nnx.initializers.normal(std)(rngs.params(), shape, dtype))


def _norm_param(shape, dtype, offset):
  """A norm weight stored so that ``norm_weight`` starts at 1: ones, or zeros for a
  Gemma-style offset of 1."""
  return nnx.Param(jnp.full(shape, 1.0 - offset, dtype))


norm_weight = F.norm_weight  # stored g -> the applied weight (offset + g, fp32)


def norm_stats(x, g, eps):
  """The split RMSNorm of ``fused_ops``: h = x * g (x's dtype), r = rsqrt(mean(x^2) + eps)
  (fp32), so that RMSNorm(x) @ W = r * (h @ W)."""
  h = (x.astype(jnp.float32) * g.astype(jnp.float32)).astype(x.dtype)
  return h, unfused.rms_scale(x, eps)


def residual_rmsnorm(y, w, residual, g, eps, fused, impl="auto"):
  """x = y @ w + residual and the split norm (h, r) of x: (..., K) -> 3 x (..., ·)."""
  if fused:
    return F.residual_rmsnorm(y, w, residual, g, eps=eps, impl=impl)
  x, h, r = ref.residual_rmsnorm(F.flat_rows(y), w, F.flat_rows(residual), g, eps)
  lead = residual.shape[:-1]
  return x.reshape(residual.shape), h.reshape(residual.shape), r.reshape(lead)


def residual_matmul(y, w, residual, fused, impl="auto"):
  if fused:
    return F.residual_matmul(y, w, residual, impl=impl)
  return ref.residual_matmul(y, w, residual)


def swiglu(h, r, w13, block, activation, fused, impl="auto"):
  if fused:
    return F.rmsnorm_swiglu(h, r, w13, block=block, activation=activation, impl=impl)
  y = ref.rmsnorm_swiglu(F.flat_rows(h), r.reshape(-1), w13, block, activation)
  return y.reshape(*h.shape[:-1], -1)


def qkv_rope(h, r, wqkv, positions, heads, theta, fused, impl="auto", rope_scaling=None):
  n_q, n_kv, hd = heads
  if fused:
    return F.rmsnorm_qkv_rope(h, r, wqkv, positions, n_q_heads=n_q, n_kv_heads=n_kv,
                              head_dim=hd, theta=theta, rope_scaling=rope_scaling, impl=impl)
  qkv = ref.rmsnorm_qkv_rope(F.flat_rows(h), r.reshape(-1), wqkv, positions.reshape(-1),
                             n_q_heads=n_q, n_kv_heads=n_kv, head_dim=hd, theta=theta,
                             rope_scaling=rope_scaling)
  return qkv.reshape(*h.shape[:-1], -1)


def qkv_qknorm_rope(h, r, wqkv, positions, qk_norm_w, heads, theta, eps, fused, impl="auto",
                    rope_scaling=None):
  """``qkv_rope`` with Qwen3's per-head RMSNorm of q and k before RoPE.

  Args:
    h, r: the input norm's split (``norm_stats``), (..., D) and (...).
    wqkv: (D, (Hq + 2 Hkv) hd); positions: (...) int.
    qk_norm_w: (q_norm_w, k_norm_w), each (hd,).
    heads: (Hq, Hkv, hd); theta, rope_scaling: RoPE's; eps: the QK-norm's epsilon.
    fused, impl: the fused op (``coda_jax.qk_norm``) or the jnp reference.

  Returns:
    qkv (..., (Hq + 2 Hkv) hd) in h's dtype.
  """
  n_q, n_kv, hd = heads
  q_norm_w, k_norm_w = qk_norm_w
  kw = dict(n_q_heads=n_q, n_kv_heads=n_kv, head_dim=hd, eps=eps, theta=theta,
            rope_scaling=rope_scaling)
  if fused:
    return qk_norm_ops.rmsnorm_qkv_qknorm_rope(h, r, wqkv, positions, q_norm_w, k_norm_w,
                                               impl=impl, **kw)
  qkv = ref.rmsnorm_qkv_qknorm_rope(F.flat_rows(h), r.reshape(-1), wqkv,
                                    positions.reshape(-1), q_norm_w, k_norm_w, **kw)
  return qkv.reshape(*h.shape[:-1], -1)


def whole_weights(tree, row_split: RowSplit | None):
  """``tree``'s arrays whole on every device of ``row_split``'s mesh, or ``tree`` as it is
  when there is no split.

  With the rows split over the devices, every device needs each weight whole while its
  layer runs. A weight stored split (FSDP, ``flax_layers.train.fsdp_shardings``) is
  gathered here: called on one layer's slice inside the layer scan, it gathers that
  layer's weights as the scan reaches them, and their gradients are summed back the
  same way. Without it, jit's partitioner is free to split the plain-XLA path's GEMMs
  along the weights' split instead, and moves activations between devices (all-to-alls;
  docs/tuning.md#sharding-and-fsdp).
  The fused GEMMs gather a split weight themselves (``coda_jax.partitioning``); here
  the gather is explicit for both paths.

  Args:
    tree: a pytree of arrays (one layer's weights).
    row_split: a ``coda_jax.sharding.RowSplit``, or None.

  Returns:
    ``tree``, replicated over ``row_split.mesh`` (``RowSplit.whole``).
  """
  return tree if row_split is None else row_split.whole(tree)


def loss_over_rows(fn, reduction, rows, shared, targets, ignore_index,
                   row_split: RowSplit | None = None):
  """``fn(*rows, *shared, reduction)``, a loss over the rows, with ``rows`` split over
  ``row_split``'s mesh axis: each device computes the sum over its own rows inside one
  ``jax.shard_map`` (``coda_jax.sharding.sum_over_rows``) and a mean divides by the
  count of counted targets over all rows. Without ``row_split`` (or with its
  ``loss_per_device`` False), ``fn`` as it is.

  Args:
    fn: the loss of its rows for a reduction ("mean", "sum" or "none").
    reduction: the one asked for.
    rows: arrays whose leading dimension is the batch (split over the devices).
    shared: weights every device needs whole (a pytree each).
    targets: the targets among ``rows``, for a mean's count.
    ignore_index: the targets not counted.
    row_split: a ``coda_jax.sharding.RowSplit``, or None.

  Returns:
    What ``fn`` returns for ``reduction``, over all rows.
  """
  if row_split is None or not row_split.loss_per_device:
    return fn(*rows, *shared, reduction)
  if reduction == "none":
    return sum_over_rows(lambda *a: fn(*a, "none"), row_split, rows, shared, per_row=True)
  total = sum_over_rows(lambda *a: fn(*a, "sum"), row_split, rows, shared)
  if reduction == "sum":
    return total
  count = jnp.sum(targets != ignore_index).astype(jnp.float32)
  return total / jnp.maximum(count, 1.0)


def lm_head_loss(h, r, wlm, targets, ignore_index, reduction, fused, impl="auto"):
  if fused:
    return F.rmsnorm_lm_head_loss(h, r, wlm, targets, ignore_index=ignore_index,
                                  reduction=reduction, impl=impl)
  loss = ref.rmsnorm_lm_head_loss(F.flat_rows(h), r.reshape(-1), wlm, targets.reshape(-1),
                                  ignore_index, reduction)
  return loss.reshape(targets.shape) if reduction == "none" else loss


def attention_impl(dtype, requested=None, platform=None):
  """``jax.nn.dot_product_attention``'s implementation: cuDNN on a GPU for 16-bit
  activations, XLA elsewhere, unless ``requested``. ``platform``: default that of
  ``jax.devices()``."""
  if requested is not None:
    return requested
  on_gpu = (platform or jax.devices()[0].platform) == "gpu"
  return "cudnn" if on_gpu and jnp.dtype(dtype).itemsize == 2 else "xla"


def causal_attention(qkv, heads, implementation=None):
  """Causal grouped-query attention: each group of Hq / Hkv query heads shares a k/v
  head.

  Args:
    qkv: (B, T, (Hq + 2 Hkv) hd), the heads [q | k | v] side by side.
    heads: (Hq, Hkv, hd).
    implementation: ``jax.nn.dot_product_attention``'s; default cuDNN for 16-bit inputs
      on a GPU, else XLA.

  Returns:
    (B, T, Hq hd), the heads' outputs side by side.
  """
  n_q, n_kv, hd = heads
  if qkv.ndim != 3 or qkv.shape[-1] != (n_q + 2 * n_kv) * hd:
    raise ValueError(f"qkv must be (B, T, {(n_q + 2 * n_kv) * hd}), got {qkv.shape}")
  b, t, _ = qkv.shape
  q, k, v = jnp.split(qkv, [n_q * hd, (n_q + n_kv) * hd], axis=-1)
  out = jax.nn.dot_product_attention(
      q.reshape(b, t, n_q, hd), k.reshape(b, t, n_kv, hd), v.reshape(b, t, n_kv, hd),
      is_causal=True, implementation=attention_impl(qkv.dtype, implementation))
  return out.reshape(b, t, n_q * hd)


class FusedMLP(nnx.Module):
  """Pre-norm SwiGLU MLP with its residual: x + W2 (act(RMSNorm(x) W1) * RMSNorm(x) W3).

  Parameters: ``norm`` (D,), ``w13`` (D, 2F) = [gate | up] pair-blocked in blocks of
  ``block`` (``coda_jax.layout.gate_up_to_blocked``), ``w2`` (F, D).
  Call: x (..., D) -> (..., D). Fused: the norm's row scale, gate/up and the activation
  run in one GEMM's epilogue, the residual add in the down projection's.
  """

  def __init__(self, d_model: int, ffn_dim: int, *, block: int = 32,
               activation: str = "silu", eps: float = 1e-5, param_dtype=jnp.float32,
               init_std: float = 0.02, norm_offset: float = 0.0, fused: bool = True,
               impl: str = "auto", rngs: nnx.Rngs):
    _check_sizes("FusedMLP", d_model=d_model, ffn_dim=ffn_dim, block=block)
    _check_eps("FusedMLP", eps)
    if ffn_dim % block:
      raise ValueError(f"FusedMLP: ffn_dim={ffn_dim} must be a multiple of block={block}")
    if activation not in ACTIVATIONS:
      raise ValueError(f"FusedMLP: activation={activation!r}: one of {sorted(ACTIVATIONS)}")
    self.norm_offset = norm_offset
    self.norm = _norm_param((d_model,), param_dtype, norm_offset)
    self.w13 = _normal(rngs, (d_model, 2 * ffn_dim), init_std, param_dtype)
    self.w2 = _normal(rngs, (ffn_dim, d_model), init_std, param_dtype)
    self.block, self.activation, self.eps = block, activation, eps
    self.fused, self.impl = fused, impl

  def __call__(self, x):
    _check_width("FusedMLP", "x", x, f"w13 {tuple(self.w13.shape)}", self.w13.shape[0])
    h, r = norm_stats(x, norm_weight(self.norm[...], self.norm_offset), self.eps)
    y = swiglu(h, r, self.w13[...], self.block, self.activation, self.fused, self.impl)
    return residual_matmul(y, self.w2[...], x, self.fused, self.impl)


class QKVProjection(nnx.Module):
  """Pre-norm fused q/k/v projection with rotate-half RoPE on q and k (and, with
  ``qk_norm``, Qwen3's per-head RMSNorm of q and k before RoPE).

  Parameters: ``norm`` (D,), ``wqkv`` (D, (Hq + 2 Hkv) hd) = [q heads | k heads | v heads];
  with ``qk_norm`` also ``q_norm`` and ``k_norm`` (hd,) (ones at init; None without).
  Call: x (B, T, D), positions (B, T) int -> qkv (B, T, (Hq + 2 Hkv) hd), ready for
  ``causal_attention``. Fused: norm scale, QK-norm and RoPE in the GEMM's epilogue.
  """

  def __init__(self, d_model: int, n_q_heads: int, n_kv_heads: int, head_dim: int, *,
               rope_theta: float = 500000.0, rope_scaling=None, eps: float = 1e-5,
               qk_norm: bool = False, param_dtype=jnp.float32, init_std: float = 0.02,
               norm_offset: float = 0.0, fused: bool = True, impl: str = "auto",
               rngs: nnx.Rngs):
    _check_sizes("QKVProjection", d_model=d_model, n_q_heads=n_q_heads,
                 n_kv_heads=n_kv_heads, head_dim=head_dim)
    _check_eps("QKVProjection", eps)
    if n_q_heads % n_kv_heads:
      raise ValueError(f"QKVProjection: n_q_heads={n_q_heads} must be a multiple of "
                       f"n_kv_heads={n_kv_heads} (grouped-query attention)")
    if head_dim % 2:
      raise ValueError(f"QKVProjection: head_dim={head_dim} must be even (RoPE rotates "
                       "pairs)")
    if qk_norm:
      qk_norm_ops.check_head_dim_tiles(head_dim, impl)
    width = (n_q_heads + 2 * n_kv_heads) * head_dim
    self.rope_scaling = rope_scaling  # coda_jax.layout.RopeScaling or None
    self.norm_offset = norm_offset
    self.norm = _norm_param((d_model,), param_dtype, norm_offset)
    self.wqkv = _normal(rngs, (d_model, width), init_std, param_dtype)
    self.q_norm = _norm_param((head_dim,), param_dtype, norm_offset) if qk_norm else None
    self.k_norm = _norm_param((head_dim,), param_dtype, norm_offset) if qk_norm else None
    self.heads, self.rope_theta, self.eps = (n_q_heads, n_kv_heads, head_dim), rope_theta, eps
    self.fused, self.impl = fused, impl

  def __call__(self, x, positions):
    _check_width("QKVProjection", "x", x, f"wqkv {tuple(self.wqkv.shape)}",
                 self.wqkv.shape[0])
    _check_lead("QKVProjection", "positions", positions, "x", x)
    off = self.norm_offset
    h, r = norm_stats(x, norm_weight(self.norm[...], off), self.eps)
    if self.q_norm is not None:
      return qkv_qknorm_rope(h, r, self.wqkv[...], positions,
                             (norm_weight(self.q_norm[...], off),
                              norm_weight(self.k_norm[...], off)), self.heads,
                             self.rope_theta, self.eps, self.fused, self.impl,
                             self.rope_scaling)
    return qkv_rope(h, r, self.wqkv[...], positions, self.heads, self.rope_theta, self.fused,
                    self.impl, self.rope_scaling)


class OutProjection(nnx.Module):
  """Attention output projection with its residual: residual + y Wo.

  Parameter: ``wo`` (Hq hd, D). Call: y (..., Hq hd), residual (..., D) -> (..., D).
  ``LlamaBlock`` instead fuses the MLP's norm statistics into this GEMM's epilogue.
  """

  def __init__(self, q_width: int, d_model: int, *, param_dtype=jnp.float32,
               init_std: float = 0.02, fused: bool = True, impl: str = "auto",
               rngs: nnx.Rngs):
    _check_sizes("OutProjection", q_width=q_width, d_model=d_model)
    self.wo = _normal(rngs, (q_width, d_model), init_std, param_dtype)
    self.fused, self.impl = fused, impl

  def __call__(self, y, residual):
    _check_width("OutProjection", "y", y, f"wo {tuple(self.wo.shape)}", self.wo.shape[0])
    _check_width("OutProjection", "residual", residual, f"wo {tuple(self.wo.shape)}",
                 self.wo.shape[1])
    return residual_matmul(y, self.wo[...], residual, self.fused, self.impl)


class LMHeadLoss(nnx.Module):
  """Final RMSNorm, LM head and token cross-entropy; fused, the (tokens, V) logits are
  never stored (log-sum-exp and the target logit come from the GEMM's epilogue).

  Parameters: ``norm`` (D,) and, unless ``tied``, ``wlm`` (D, V).
  Call: x (..., D), targets (...) int (``ignore_index`` entries are skipped) -> the
  loss (``reduction``: "mean", "sum", or "none" giving (...)). Tied heads take ``wlm``
  (D, V) as an argument (the transposed embedding).
  """

  def __init__(self, d_model: int, vocab_size: int, *, tied: bool = False,
               eps: float = 1e-5, ignore_index: int = -100, param_dtype=jnp.float32,
               init_std: float = 0.02, norm_offset: float = 0.0, fused: bool = True,
               impl: str = "auto", rngs: nnx.Rngs):
    _check_sizes("LMHeadLoss", d_model=d_model, vocab_size=vocab_size)
    _check_eps("LMHeadLoss", eps)
    self.norm_offset = norm_offset
    self.norm = _norm_param((d_model,), param_dtype, norm_offset)
    self.wlm = None if tied else _normal(rngs, (d_model, vocab_size), init_std, param_dtype)
    self.eps, self.ignore_index = eps, ignore_index
    self.fused, self.impl = fused, impl

  def head_weight(self, wlm=None):
    if (wlm is None) == (self.wlm is None):
      raise ValueError("pass wlm exactly when the head is tied" if self.wlm is None
                       else "this head has its own wlm; do not pass one")
    if wlm is not None and (wlm.ndim != 2 or wlm.shape[0] != self.norm.shape[0]):
      raise ValueError(f"LMHeadLoss: wlm has shape {tuple(wlm.shape)}; it must be (D, V) "
                       f"with D = {self.norm.shape[0]} (the norm's width)")
    return self.wlm[...] if wlm is None else wlm

  def norm_weight(self):
    """The final norm's applied weight (``norm_weight``)."""
    return norm_weight(self.norm[...], self.norm_offset)

  def __call__(self, x, targets, *, wlm=None, reduction: str = "mean"):
    _check_width("LMHeadLoss", "x", x, f"norm {tuple(self.norm.shape)}", self.norm.shape[0])
    _check_lead("LMHeadLoss", "targets", targets, "x", x)
    h, r = norm_stats(x, self.norm_weight(), self.eps)
    return lm_head_loss(h, r, self.head_weight(wlm), targets, self.ignore_index, reduction,
                        self.fused, self.impl)

  def logits(self, x, *, wlm=None):
    """x (..., D) -> fp32 logits (..., V) (plain XLA: inference and checks)."""
    _check_width("LMHeadLoss", "x", x, f"norm {tuple(self.norm.shape)}", self.norm.shape[0])
    h, r = norm_stats(x, self.norm_weight(), self.eps)
    w = self.head_weight(wlm)
    return (h @ w.astype(h.dtype)).astype(jnp.float32) * r[..., None]
