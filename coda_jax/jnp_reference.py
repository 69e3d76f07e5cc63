"""Pure-jnp references of the fused Transformer ops and blocks, in the kernel layouts.

Written the way a user writes the math: every op follows its inputs' dtype, so with fp32
inputs (and ``jax.default_matmul_precision("highest")``) these are the truth the tests
compare against, and with bf16 inputs they are the unfused XLA baseline whose error sets
the tolerance. Norm statistics are taken in fp32, as every Llama implementation does.

Layouts (see ``layout.py``): ``w13`` is [gate | up] pair-blocked in blocks of
``swiglu_block``; ``wqkv`` is [q heads | k heads | v heads] with rotate-half heads.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from coda_jax.layout import qkv_freqs  # noqa: F401  (re-exported: the reference's API)
from coda_jax.primitives import ACTIVATIONS
# Shared with the fused path, which imports them from coda_jax.unfused, never from here.
from coda_jax.unfused import (gated_grad, layernorm_apply, layernorm_split,  # noqa: F401
                              layernorm_stats, rms_scale)
from coda_jax.unfused import pair_blocks as _pairs


def gated(z: jax.Array, block: int, activation: str = "silu") -> jax.Array:
  """act(a) * b over the pair-blocked columns of z: (M, 2F) -> (M, F)."""
  a, b = _pairs(z, block)
  return (ACTIVATIONS[activation][0](a) * b).reshape(*z.shape[:-1], -1)


def rotate(x: jax.Array, positions: jax.Array, freqs: jax.Array, block: int) -> jax.Array:
  """Rotate-half RoPE over heads of 2 * block columns (fp32 math, x's dtype out):
  (a, b) -> (a cos t - b sin t, b cos t + a sin t), t = positions[m] * freqs[n].
  Written elementwise (each output computes its own angle) so XLA emits one fusion."""
  x4 = x.astype(jnp.float32).reshape(x.shape[0], -1, 2, block)
  partner = x4[:, :, ::-1, :]  # b for a's columns, a for b's
  sign = jnp.array([-1.0, 1.0], jnp.float32)[:, None]
  t = positions.astype(jnp.float32)[:, None, None, None] * freqs.reshape(1, -1, 2, block)
  return (x4 * jnp.cos(t) + sign * partner * jnp.sin(t)).reshape(x.shape).astype(x.dtype)


def residual_rmsnorm(y, w, residual, g, eps=1e-5):
  """x = y @ w + residual; h = x * g; r = rsqrt(mean(x^2) + eps). Returns (x, h, r)."""
  x = y @ w.astype(y.dtype) + residual
  return x, x * g.astype(x.dtype), rms_scale(x, eps)


def residual_matmul(y, w, residual):
  return y @ w.astype(y.dtype) + residual


def _row_scale(acc, r):
  return (acc.astype(jnp.float32) * r[:, None]).astype(acc.dtype)


def rmsnorm_swiglu(h, r, w13, block=32, activation="silu"):
  """y = act(a) * b of z = r * (h @ w13) (pair-blocked): (M, D) -> (M, F)."""
  z = _row_scale(h @ w13.astype(h.dtype), r)
  return gated(z, block, activation).astype(h.dtype)


def rmsnorm_qkv_rope(h, r, wqkv, positions, *, n_q_heads, n_kv_heads, head_dim,
                     theta=500000.0, rope_scaling=None):
  """RoPE(r * (h @ wqkv)) on q and k heads; v unrotated."""
  z = _row_scale(h @ wqkv.astype(h.dtype), r)
  freqs = qkv_freqs(n_q_heads, n_kv_heads, head_dim, theta, rope_scaling)
  return rotate(z, positions, freqs, head_dim // 2)


def cross_entropy(logits, targets, ignore_index=-100, reduction="mean"):
  """Token cross-entropy in fp32; ``ignore_index`` targets count neither in the sum
  nor in the mean's denominator."""
  logits = logits.astype(jnp.float32)
  vocab = logits.shape[-1]
  valid = targets != ignore_index
  bad = valid & ((targets < 0) | (targets >= vocab))  # neither a class nor ignored: NaN
  lse = jax.nn.logsumexp(logits, axis=-1)
  safe = jnp.where(valid & ~bad, targets, 0)
  picked = jnp.take_along_axis(logits, safe[:, None], axis=-1)[:, 0]
  losses = jnp.where(valid, lse - picked, 0.0)
  losses = jnp.where(bad, jnp.nan, losses)
  if reduction == "none":
    return losses
  total = jnp.sum(losses)
  return total if reduction == "sum" else total / jnp.maximum(jnp.sum(valid), 1)


def rmsnorm_lm_head_loss(h, r, wlm, targets, ignore_index=-100, reduction="mean"):
  """Cross-entropy of logits = r * (h @ wlm)."""
  logits = _row_scale(h @ wlm.astype(h.dtype), r)
  return cross_entropy(logits, targets, ignore_index, reduction)


def _qkv(h, r, wqkv, positions, qk_norm_w, *, n_q_heads, n_kv_heads, head_dim, theta,
         rope_scaling, eps):
  """The QKV projection + RoPE, with Qwen3's per-head q/k RMSNorm when ``qk_norm_w``."""
  heads = dict(n_q_heads=n_q_heads, n_kv_heads=n_kv_heads, head_dim=head_dim, theta=theta,
               rope_scaling=rope_scaling)
  if qk_norm_w is None:
    return rmsnorm_qkv_rope(h, r, wqkv, positions, **heads)
  q_norm_w, k_norm_w = qk_norm_w
  return rmsnorm_qkv_qknorm_rope(h, r, wqkv, positions, q_norm_w, k_norm_w, eps=eps, **heads)


def pre_block(x0, g_attn, wqkv, positions, *, n_q_heads, n_kv_heads, head_dim,
              theta=500000.0, rope_scaling=None, eps=1e-5, qk_norm_w=None):
  """Embedding output -> the first layer's RoPE'd QKV.

  Args:
    x0: (M, D) embeddings; g_attn (D,); wqkv (D, (Hq + 2 Hkv) head_dim); positions (M,).
    n_q_heads, n_kv_heads, head_dim, theta, rope_scaling, eps: the layer's constants.
    qk_norm_w: None (Llama), or (q_norm_w, k_norm_w), each (head_dim,): Qwen3's per-head
      q/k RMSNorm (eps ``eps``) before RoPE.

  Returns:
    (M, (Hq + 2 Hkv) head_dim) in x0's dtype.
  """
  r = rms_scale(x0, eps)
  return _qkv(x0 * g_attn.astype(x0.dtype), r, wqkv, positions, qk_norm_w,
              n_q_heads=n_q_heads, n_kv_heads=n_kv_heads, head_dim=head_dim, theta=theta,
              rope_scaling=rope_scaling, eps=eps)


def mlp_half(x0, y0, wo, g_mlp, w13, w2, g_next, *, block=32, activation="silu", eps=1e-5):
  """Out-proj + residual, RMSNorm, SwiGLU MLP, down-proj + residual: -> (x2, h2, r2)."""
  x1, h1, r1 = residual_rmsnorm(y0, wo, x0, g_mlp, eps)
  y1 = rmsnorm_swiglu(h1, r1, w13, block, activation)
  return residual_rmsnorm(y1, w2, x1, g_next, eps)


def shifted_block(x0, y0, positions, params, *, n_q_heads, n_kv_heads, head_dim,
                  theta=500000.0, rope_scaling=None, eps=1e-5, block=32, activation="silu",
                  qk_norm_w=None):
  """Attention output -> the next layer's RoPE'd QKV.

  Args:
    x0: (M, D) residual stream; y0 (M, Hq head_dim) attention output; positions (M,).
    params: ``wo``, ``g_mlp``, ``w13``, ``w2`` of this layer, ``g_attn``, ``wqkv`` of the
      next (other keys are ignored).
    n_q_heads ... activation: the layers' constants.
    qk_norm_w: None (Llama), or the next layer's (q_norm_w, k_norm_w) (Qwen3).

  Returns:
    (x2 (M, D), qkv (M, (Hq + 2 Hkv) head_dim)).
  """
  x2, h2, r2 = mlp_half(x0, y0, params["wo"], params["g_mlp"], params["w13"], params["w2"],
                        params["g_attn"], block=block, activation=activation, eps=eps)
  qkv = _qkv(h2, r2, params["wqkv"], positions, qk_norm_w, n_q_heads=n_q_heads,
             n_kv_heads=n_kv_heads, head_dim=head_dim, theta=theta,
             rope_scaling=rope_scaling, eps=eps)
  return x2, qkv


def post_block(x0, y0, targets, params, *, eps=1e-5, block=32, activation="silu",
               ignore_index=-100, reduction="mean"):
  """Last layer's attention output -> loss (MLP, final RMSNorm, LM head, cross-entropy)."""
  _, h2, r2 = mlp_half(x0, y0, params["wo"], params["g_mlp"], params["w13"], params["w2"],
                       params["g_final"], block=block, activation=activation, eps=eps)
  return rmsnorm_lm_head_loss(h2, r2, params["wlm"], targets, ignore_index, reduction)


def head_rmsnorm(x, w, head_dim, eps):
  """RMSNorm of every head_dim-wide head of x (statistic in fp32, as Qwen3's), times
  the (head_dim,) weight w shared by the heads: (M, H * head_dim) -> same, x's dtype."""
  x3 = x.reshape(*x.shape[:-1], -1, head_dim)
  xf = x3.astype(jnp.float32)
  normed = (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)
  return (normed * w.astype(x.dtype)).reshape(x.shape)


def rmsnorm_qkv_qknorm_rope(h, r, wqkv, positions, q_norm_w, k_norm_w, *, n_q_heads,
                            n_kv_heads, head_dim, eps, theta, rope_scaling=None):
  """RoPE(QK-norm(r * (h @ wqkv))): q heads RMS-normed with q_norm_w, k heads with
  k_norm_w (each (head_dim,)), then RoPE on q and k; v as projected."""
  z = _row_scale(h @ wqkv.astype(h.dtype), r)
  q_end = n_q_heads * head_dim
  k_end = q_end + n_kv_heads * head_dim
  z = jnp.concatenate([head_rmsnorm(z[:, :q_end], q_norm_w, head_dim, eps),
                       head_rmsnorm(z[:, q_end:k_end], k_norm_w, head_dim, eps),
                       z[:, k_end:]], axis=1)
  freqs = qkv_freqs(n_q_heads, n_kv_heads, head_dim, theta, rope_scaling)
  return rotate(z, positions, freqs, head_dim // 2)


# ---- LayerNorm, column bias, GPT-2's GELU MLP (coda_jax.layernorm_ops) --------------------
def layer_norm(x, g, beta, eps=1e-5):
  """(x - mu) r g + beta, statistics and arithmetic in fp32, x's dtype out."""
  return layernorm_apply(x, *layernorm_stats(x, eps), g, beta)


def _add_bias(z, bias):
  return z if bias is None else z + bias.astype(z.dtype)


def residual_layernorm(y, w, residual, g, bias=None, eps=1e-5):
  """x = y @ w + bias + residual; h = x * g; (mu, r) of x. Returns (x, h, mu, r)."""
  x = _add_bias(y @ w.astype(y.dtype), bias) + residual
  mu, r = layernorm_stats(x, eps)
  return x, x * g.astype(x.dtype), mu, r


def layernorm_matmul(h, mu, r, g, beta, w, bias=None):
  """((h - mu g) r + beta) @ w + bias: LN(x) @ w + bias given h = x * g."""
  n = (h.astype(jnp.float32) - mu[:, None] * g) * r[:, None] + beta
  return _add_bias(n.astype(h.dtype) @ w.astype(h.dtype), bias)


def layernorm_gelu_mlp(x, h, mu, r, g, beta, w1, b1, w2, b2):
  """x + gelu(LN(x) @ w1 + b1) @ w2 + b2, LN(x) from (h = x * g, mu, r)."""
  a = ACTIVATIONS["gelu"][0](layernorm_matmul(h, mu, r, g, beta, w1, b1))
  return _add_bias(x + a @ w2.astype(x.dtype), b2)


def gpt2_mlp(x, g, beta, w1, b1, w2, b2, eps=1e-5):
  """GPT-2's MLP sub-block written plainly: x + gelu(LN(x) @ w1 + b1) @ w2 + b2."""
  a = ACTIVATIONS["gelu"][0](_add_bias(layer_norm(x, g, beta, eps) @ w1.astype(x.dtype), b1))
  return _add_bias(x + a @ w2.astype(x.dtype), b2)
