"""Residuals that a fused op's forward both keeps for its backward and hands on.

Inside a ``jax.lax.scan`` under autodiff (a model's layer loop), every residual of a
``custom_vjp`` forward is stacked across iterations: XLA writes it into a (layers, ...)
buffer with a dynamic-update-slice. XLA's GPU dynamic-slice fusion
(``--xla_gpu_enable_dynamic_slice_fusion``, on by default in jax 0.11.2) then fuses the
custom call that made the value with that update, so that the kernel stores straight
into the stacked buffer. When the same value also has other readers (the next GEMM, the
scan's carry), XLA keeps the original custom call for them as well: **the kernel runs
twice** each iteration. In the 8B-shaped training step the QKV, out-projection and
down-projection GEMMs of every scanned layer ran twice (``docs/known_issues.md``).

``fenced`` passes such values through one ``jax.lax.optimization_barrier`` on their way
into the residuals: the stacking update then reads the barrier's result, the fusion does
not apply, and the kernel runs once. The price is the update's copy of the value into the
stacked buffer (what XLA does for any value that is not a custom call's result). A
residual that nothing else reads (the gated MLP's z) needs no fence: the fusion keeps
the single kernel and saves that copy.
"""
from __future__ import annotations

import jax


def fenced(*values):
  """``values`` through one optimization barrier (None entries pass through untouched).

  Args:
    *values: arrays (or None) that a ``custom_vjp`` forward keeps for its backward and
      that other computations also read.

  Returns:
    The same values, as a tuple, to be stored as residuals in place of the originals
    (the other readers keep using the originals).
  """
  present = [v for v in values if v is not None]
  if not present:
    return values
  fenced_values = iter(jax.lax.optimization_barrier(tuple(present)))
  return tuple(None if v is None else next(fenced_values) for v in values)
