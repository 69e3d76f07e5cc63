"""Column layouts for pairwise epilogues, to and from the standard ones.

Standard gated weights are ``[gate | up]``: (K, 2F), gate columns first. The kernel pairs
column j with j + P inside blocks of 2P columns, so the blocked layout interleaves
P-column chunks: [gate[0:P], up[0:P], gate[P:2P], up[P:2P], ...]. Rotate-half RoPE heads
of size 2P already satisfy the kernel's pairing, so Q/K weights need no permutation.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def _check(n: int, block: int, what: str):
  if block <= 0 or n % (2 * block):
    raise ValueError(f"{what}: width {n} must be a positive multiple of 2*block={2 * block}")


def gate_up_to_blocked(w: jax.Array, block: int) -> jax.Array:
  """[gate | up] (..., 2F) -> kernel pair-blocked layout (..., 2F)."""
  n = w.shape[-1]
  _check(n, block, "gate_up_to_blocked")
  gate, up = w[..., :n // 2], w[..., n // 2:]
  lead = w.shape[:-1]
  chunks = jnp.stack([gate.reshape(*lead, -1, block), up.reshape(*lead, -1, block)], axis=-2)
  return chunks.reshape(*lead, n)


def blocked_to_gate_up(w: jax.Array, block: int) -> jax.Array:
  """Inverse of ``gate_up_to_blocked``."""
  n = w.shape[-1]
  _check(n, block, "blocked_to_gate_up")
  lead = w.shape[:-1]
  chunks = w.reshape(*lead, -1, 2, block)
  return jnp.concatenate([chunks[..., 0, :].reshape(*lead, -1),
                          chunks[..., 1, :].reshape(*lead, -1)], axis=-1)


def rope_freqs(n: int, head_dim: int, theta: float = 10000.0,
               passthrough_heads=()) -> jax.Array:
  """The (n,) ``freqs`` operand of ``Rotate(block=head_dim // 2)`` for rotate-half heads:
  columns j and j + head_dim/2 of each head both get theta**(-2j / head_dim). Heads
  listed in ``passthrough_heads`` get 0 and pass unrotated (V heads of a fused QKV)."""
  if head_dim % 2 or n % head_dim:
    raise ValueError(f"rope_freqs: head_dim={head_dim} must be even and divide n={n}")
  half = head_dim // 2
  inv = theta ** (-jnp.arange(half, dtype=jnp.float32) * 2 / head_dim)
  per_head = jnp.tile(jnp.concatenate([inv, inv]), (n // head_dim, 1))
  rotated = ~jnp.isin(jnp.arange(n // head_dim), jnp.asarray(passthrough_heads, jnp.int32))
  return (per_head * rotated[:, None]).reshape(n)
