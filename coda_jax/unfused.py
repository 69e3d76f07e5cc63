"""The few unfused XLA pieces that the fused ops and the Flax layers run on their
production path, and that the jnp reference (``jnp_reference``) uses too: per-row norm
statistics, and the gated activation's backward where it is not an epilogue.

Keeping them here, not in ``jnp_reference``, keeps the one-way rule: the reference is
what the fused path is checked against, and the fused path imports nothing from it.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from coda_jax.primitives import ACTIVATIONS


def rms_scale(x: jax.Array, eps: float) -> jax.Array:
  """RMSNorm's reciprocal RMS per row, fp32 (M,)."""
  xf = x.astype(jnp.float32)
  return jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1) + eps)


def layernorm_stats(x: jax.Array, eps: float = 1e-5):
  """LayerNorm's per-row (mean, 1/sqrt(var + eps)), fp32, variance in two passes."""
  xf = x.astype(jnp.float32)
  mu = jnp.mean(xf, axis=-1)
  var = jnp.mean(jnp.square(xf - mu[..., None]), axis=-1)
  return mu, jax.lax.rsqrt(var + eps)


def layernorm_apply(x, mu, r, g, beta):
  """(x - mu) r g + beta from the row statistics (mu, r), arithmetic in fp32, x's dtype
  out."""
  n = (x.astype(jnp.float32) - mu[..., None]) * r[..., None] * g + beta
  return n.astype(x.dtype)


def layernorm_split(x, g, eps: float = 1e-5):
  """LayerNorm split as ``coda_jax.layernorm_ops`` takes it, in XLA: (h = x * g in x's
  dtype (the product in fp32), mu, r)."""
  mu, r = layernorm_stats(x, eps)
  return (x.astype(jnp.float32) * g.astype(jnp.float32)).astype(x.dtype), mu, r


def pair_blocks(x, block):
  """(M, N) pair-blocked -> (a, b), each (M, N / (2 block), block)."""
  blocks = x.reshape(*x.shape[:-1], -1, 2, block)
  return blocks[..., 0, :], blocks[..., 1, :]


def unpair_blocks(a, b):
  """(a, b) -> their pair-blocked (M, N) layout: the inverse of ``pair_blocks``."""
  return jnp.stack([a, b], axis=-2).reshape(*a.shape[:-2], -1)


def gated_grad(dy: jax.Array, z: jax.Array, block: int, activation: str = "silu"):
  """dz of the gated activation act(a) * b over z's pair blocks (``jnp_reference.gated``),
  in z's layout, computed in fp32 (returns fp32)."""
  a, b = pair_blocks(z.astype(jnp.float32), block)
  g = dy.astype(jnp.float32).reshape(a.shape)
  f, df = ACTIVATIONS[activation][1](a)
  return unpair_blocks(g * b * df, g * f)
