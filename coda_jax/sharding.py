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

import dataclasses
from typing import Any, Callable

import jax
from jax.sharding import NamedSharding, PartitionSpec


def varying_axes(x) -> frozenset:
  """The manual mesh axes ``x`` varies over inside ``shard_map`` (empty outside).

  Args:
    x: an array or tracer (anything ``jax.typeof`` accepts).

  Returns:
    A frozenset of the mesh axis names ``x``'s type varies over; empty when its type
    carries none (outside ``shard_map``).
  """
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
  of a kernel call vary with its inputs (a no-op outside ``shard_map``).

  Args:
    x: the array to mark.
    *refs: arrays whose varying mesh axes ``x`` should share.

  Returns:
    ``x`` cast (``jax.lax.pcast``, to "varying") over the axes some ref varies over and
    ``x`` does not; the axes ``x`` already varies over stay. ``x`` itself when none is
    missing.
  """
  missing = tuple(sorted(frozenset().union(*map(varying_axes, refs)) - varying_axes(x)))
  return jax.lax.pcast(x, missing, to="varying") if missing else x


@dataclasses.dataclass(frozen=True)
class RowSplit:
  """The rows (batch x sequence) of a step's activations are split over ``axis`` of
  ``mesh``: data parallelism, with the weights replicated or FSDP-split, under
  ``jax.jit`` on auto axes, where the rows' split is not visible while tracing.

  Args:
    mesh: the mesh the step runs on. Every axis other than ``axis`` must have size 1
      (a tensor-parallel axis is not a row split).
    axis: the mesh axis the rows are split over.
    loss_per_device: a model's loss runs its last block and LM head per device in one
      ``jax.shard_map`` (``flax_layers.layers.loss_over_rows``); False leaves them to
      ``jax.jit``'s per-GEMM rule. Either way each layer's weights are gathered whole
      per layer (``flax_layers.layers.whole_weights``).
  """
  mesh: Any
  axis: str
  loss_per_device: bool = True

  def __post_init__(self):
    shape = dict(self.mesh.shape)
    if self.axis not in shape:
      raise ValueError(f"RowSplit.axis={self.axis!r} is not an axis of the mesh "
                       f"{shape}")
    others = {a: n for a, n in shape.items() if a != self.axis and n > 1}
    if others:
      raise ValueError(f"RowSplit: mesh axes {others} besides {self.axis!r} have size > "
                       "1; a row split is data parallelism only (leave row_split=None "
                       "for tensor parallelism)")

  def whole(self, tree):
    """``tree``'s arrays whole on every device of the mesh: a weight stored split
    (FSDP) is gathered here, and its gradient leaves split like it. On an explicit axis
    that is ``jax.reshard``; on an auto axis (``jax.jit``'s own partitioning) a sharding
    constraint, since ``jax.reshard`` leaves the partitioner free there (an FSDP step's
    reference then split its GEMMs along the weights: docs/tuning.md#sharding-and-fsdp)."""
    whole = NamedSharding(self.mesh, PartitionSpec())
    kind = dict(zip(self.mesh.axis_names, self.mesh.axis_types))[self.axis]
    put = jax.reshard if kind == jax.sharding.AxisType.Explicit else (
        jax.lax.with_sharding_constraint)
    return jax.tree.map(lambda v: put(v, whole), tree)


def sum_over_rows(fn: Callable, split: RowSplit, rows: tuple, shared: tuple, *,
                  per_row: bool = False):
  """``fn(*rows, *shared)`` run per device on its own rows in one ``jax.shard_map``.

  The rows' leading dimension is split over ``split.axis``; ``shared`` (weights) enter
  whole: a weight stored split (FSDP) is gathered once here, and its gradient leaves
  split like it. Inside, every fused op runs on the device's rows, and each one's
  backward sums its weight gradients over the devices once (``reduce_like``). A loop
  over row chunks (the LM head's) then accumulates its weight gradient per device in
  place and sums it across devices once after the loop, where under ``jax.jit``'s
  per-GEMM rule each chunk's partial is reduced (and an FSDP-split weight gathered)
  chunk by chunk.

  Args:
    fn: returns a scalar sum over its rows (``per_row=False``), or one value per row.
    split: where the rows are split.
    rows: arrays whose leading dimension is the rows' (a multiple of the axis size).
    shared: arrays (or pytrees of them) every device needs whole.
    per_row: ``fn`` returns per-row values (split like the rows) instead of a sum.

  Returns:
    The sum over all rows (a scalar, ``psum``-ed over ``split.axis``), or the per-row
    values.
  """
  P = PartitionSpec
  n = split.mesh.shape[split.axis]
  for i, x in enumerate(rows):
    if x.shape[0] % n:
      raise ValueError(f"rows[{i}] has {x.shape[0]} rows along its first dimension, not "
                       f"divisible by the {n} devices of mesh axis {split.axis!r}")
  shared = split.whole(tuple(shared))

  def local(*args):
    out = fn(*args)
    return out if per_row else jax.lax.psum(out, split.axis)
  body = jax.shard_map(local, mesh=split.mesh,
                       in_specs=(P(split.axis),) * len(rows) + (P(),) * len(shared),
                       out_specs=P(split.axis) if per_row else P())
  return body(*rows, *shared)


__all__ = ["RowSplit", "reduce_like", "sum_over_rows", "vary_like", "varying_axes"]
