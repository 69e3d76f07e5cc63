"""The fused ops under ``jax.shard_map``: the rule for parameter gradients.

Data parallelism through JAX's own machinery: run a fused op, block or loss under
``jax.shard_map`` with the rows (batch x sequence) split over a mesh axis and the
weights replicated::

    sharded = jax.shard_map(
        lambda y, w, x0, g: F.residual_rmsnorm(y, w, x0, g),
        mesh=mesh, in_specs=(P("data"), P(), P("data"), P()), out_specs=P("data"))

Each device runs the kernels on its own rows; nothing is gathered. A weight that is
replicated (invariant over "data") gets, in each device's backward, the partial
gradient of that device's rows. JAX requires a ``custom_vjp``'s cotangent to have its
primal's type, including the set of mesh axes it varies over, so every backward here
passes its parameter cotangents through ``reduce_like``: a ``psum`` of the small
weight-sized gradient over exactly the axes along which the cotangent varies and its
primal does not. Outside ``shard_map`` both are invariant and it does nothing.
"""
from __future__ import annotations

import jax


def varying_axes(x) -> frozenset:
  """The manual mesh axes ``x`` varies over inside ``shard_map`` (empty outside)."""
  mat = getattr(jax.typeof(x), "manual_axis_type", None)
  return frozenset(getattr(mat, "varying", ()) or ())


def reduce_like(ct, primal):
  """``ct`` with ``primal``'s varying axes: summed over the mesh axes it varies over and
  ``primal`` does not (a replicated weight's partial gradients), and marked varying
  over those ``primal`` varies over and it does not (a kernel's output, which a Mosaic
  call leaves unmarked).

  Args:
    ct: a cotangent, or None.
    primal: the primal value ``ct`` is the cotangent of.

  Returns:
    ``ct`` varying exactly over ``primal``'s mesh axes (None for None).
  """
  if ct is None:
    return None
  extra = tuple(sorted(varying_axes(ct) - varying_axes(primal)))
  ct = jax.lax.psum(ct, extra) if extra else ct
  return vary_like(ct, primal)


def vary_like(x, *refs):
  """``x`` marked varying over every mesh axis one of ``refs`` varies over: the outputs
  of a kernel call vary with its inputs (a no-op outside ``shard_map``)."""
  missing = tuple(sorted(frozenset().union(*map(varying_axes, refs)) - varying_axes(x)))
  return jax.lax.pcast(x, missing, to="varying") if missing else x


__all__ = ["reduce_like", "vary_like", "varying_axes"]
