"""The per-shard rule of a GEMM-epilogue call: how it runs when its operands are sharded.

Every fused op reaches the kernels through ``epilogue_gemm.gemm_epilogue``, so one rule, here,
makes every op, block and layer run on sharded arrays under ``jax.jit``: the call is a
``jax.experimental.custom_partitioning`` function. XLA's partitioner (Shardy) hands it
the shardings of its operands; the rule below decides the local problem, and each
device runs the kernel on its own tiles. Why ``custom_partitioning`` and not
``shard_map``: under ``jax.jit`` with ``NamedSharding`` inputs the shardings are known
only to the partitioner, after tracing; a ``shard_map`` has to be written by the caller
with the specs spelled out (that path works too: inside a ``shard_map`` the call is
local and ``coda_jax.sharding`` gives the gradients their mesh axes).

The three dimensions of ``a @ b`` (M rows, N columns, K contraction) are read from the
operands' shardings:

* **M sharded (data parallel).** Row and tile operands and outputs stay split with the
  rows. Column partial sums (``ColSum``: dg, db) are ``psum``-ed over M's mesh axes:
  N floats.
* **N sharded (column parallel: Megatron's wqkv, w13; a vocabulary-parallel LM head).**
  Column and tile operands and outputs stay split with the columns. Row partials made
  by the epilogue are combined across the column shards: row sums (the RMSNorm
  backward's zdz term, the picked target logit) by ``psum``, log-sum-exps by a max and
  a ``psum`` of rescaled sums: M floats each, never the (M, N) activations. Column-index
  operands (targets) are shifted by the shard's first column. A shard must hold whole
  column groups (a SwiGLU or RoPE pair block), or the call is refused.
* **K sharded (row parallel: Megatron's wo, w2; every weight gradient, whose
  contraction runs over the rows).** The local product is a partial sum: the kernel
  stores it in fp32, it is ``psum``-ed over K's mesh axes, and the epilogue program
  runs after the sum in XLA (an epilogue is not linear in the accumulator in general).
  This is the one activation-sized reduction of Megatron's row-parallel layer, and the
  weight-gradient all-reduce of data parallelism. B's sums over K (``BColumnSum``, a
  bias gradient) are ``psum``-ed likewise; with M split, each shard holds them whole.

A weight sharded along a dimension the rule does not split (FSDP's storage layout) is
gathered just before the call: per layer, as FSDP does. A mesh axis that does not
divide its dimension raises a ``ValueError`` naming the axis and the sizes.

One call has a rule of its own: LayerNorm's input gradient in one GEMM, whose row
totals are exchanged across tiles inside the kernel (``layernorm_ops.row_terms_sharded``,
beside the op; it reads its layout with ``choose_layout`` and ``arg_specs``, and runs
through ``on_explicit_mesh`` or its own ``custom_partitioning``).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

import pallas_kernels as pk
from coda_jax import dispatch
from coda_jax import primitives as P


@dataclasses.dataclass(frozen=True)
class ShardedCall:
  """A ``dispatch.Call`` with the names of its operands in argument order and the
  implementations to try (static under ``custom_partitioning``)."""
  call: dispatch.Call
  operand_names: tuple[str, ...]
  impl: tuple[str, ...]

  def kinds(self):
    return dict(self.call.inputs)


def _axes(entry) -> tuple[str, ...]:
  if entry is None:
    return ()
  return (entry,) if isinstance(entry, str) else tuple(entry)


def _spec_dims(shape) -> list[tuple[str, ...]]:
  sharding = shape.sharding
  if not isinstance(sharding, NamedSharding):
    raise ValueError(
        f"coda_jax.gemm_epilogue got a {type(sharding).__name__} operand sharding; the "
        "per-shard rule needs NamedSharding (shard inputs with a jax.sharding.Mesh, or call "
        "under jax.set_mesh)")
  spec = tuple(sharding.spec) + (None,) * (len(shape.shape) - len(sharding.spec))
  return [_axes(e) for e in spec]


@dataclasses.dataclass(frozen=True)
class Layout:
  """The mesh axes that split each GEMM dimension (empty: not split)."""
  m: tuple[str, ...]
  n: tuple[str, ...]
  k: tuple[str, ...]


def _size(mesh, axes) -> int:
  return math.prod(mesh.shape[a] for a in axes)


def choose_layout(sc: ShardedCall, mesh, arg_shapes) -> Layout:
  """The split of (M, N, K) for operands arriving with ``arg_shapes``' shardings: M and K
  as ``a`` is split, N as ``b`` is (less axes already used). Raises ValueError on a split
  the kernels cannot run."""
  call = sc.call
  a_dims, b_dims = _spec_dims(arg_shapes[0]), _spec_dims(arg_shapes[1])
  a_m, a_k = (a_dims[1], a_dims[0]) if call.trans_a else (a_dims[0], a_dims[1])
  b_n = b_dims[0] if call.trans_b else b_dims[1]
  layout = Layout(m=a_m, k=a_k, n=tuple(x for x in b_n if x not in a_m + a_k))
  m, n, k = pk.check_operands(jax.ShapeDtypeStruct(arg_shapes[0].shape, arg_shapes[0].dtype),
                              jax.ShapeDtypeStruct(arg_shapes[1].shape, arg_shapes[1].dtype),
                              call.trans_a, call.trans_b, dtypes=(arg_shapes[0].dtype,))
  for dim, size, axes in (("M (rows)", m, layout.m), ("N (columns)", n, layout.n),
                          ("K (contraction)", k, layout.k)):
    parts = _size(mesh, axes)
    if size % parts:
      raise ValueError(f"coda_jax.gemm_epilogue: {dim}={size} is split over mesh axes "
                       f"{axes} of size {parts}, which does not divide it; pick a mesh or "
                       "shape where it does (or replicate that dimension)")
  parts = _size(mesh, layout.n)
  if parts > 1 and (n // parts) % call.column_group:
    raise ValueError(f"coda_jax.gemm_epilogue: N={n} split over mesh axes {layout.n} gives "
                     f"{n // parts} columns per shard, not a multiple of the program's column "
                     f"group {call.column_group} (a pair block must stay on one device)")
  return layout


def arg_specs(sc: ShardedCall, layout: Layout):
  """The specs of a, b and the operands (in ``sc.operand_names``' order) for ``layout``."""
  m, n, k = (layout.m or None), (layout.n or None), (layout.k or None)
  a = PartitionSpec(k, m) if sc.call.trans_a else PartitionSpec(m, k)
  b = PartitionSpec(n, k) if sc.call.trans_b else PartitionSpec(k, n)
  kinds = sc.kinds()
  ops = []
  for nm in sc.operand_names:
    kind = kinds[nm]
    ops.append(PartitionSpec(m) if kind == pk.InputKind.ROW else
               PartitionSpec(n) if kind == pk.InputKind.COL else PartitionSpec(m, n))
  return (a, b, *ops)


def _result_specs(sc: ShardedCall, layout: Layout):
  m, n = (layout.m or None), (layout.n or None)
  return {name: PartitionSpec(m, n) if kind == "tile" else
          PartitionSpec(n) if kind == "col" else PartitionSpec(m)
          for name, (kind, _) in dispatch.finished_kinds(sc.call).items()}


def _combine(sc: ShardedCall, layout: Layout, out: dict) -> dict:
  kinds = dispatch.finished_kinds(sc.call)
  for prim in sc.call.program:
    for name, how in prim.combine_over_shards().items():
      axes = layout.m if kinds[name][0] == "col" else layout.n
      if not axes:
        continue
      if how == "whole_per_row_shard":
        continue
      if how == "sum":
        out[name] = jax.lax.psum(out[name], axes)
      elif how == "logsumexp":
        mx = jax.lax.pmax(jax.lax.stop_gradient(out[name]), axes)
        mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
        out[name] = mx + jnp.log(jax.lax.psum(jnp.exp(out[name] - mx), axes))
      else:
        raise ValueError(f"{type(prim).__name__}.combine_over_shards: unknown {how!r}")
  return out


def local_call(sc: ShardedCall, layout: Layout, n_local: int, a, b, *values):
  """What one device runs: its tiles through ``dispatch``, then the row/column partials
  combined across shards."""
  call = sc.call
  operands = dict(zip(sc.operand_names, values))
  if layout.n:
    offset = jax.lax.axis_index(layout.n) * n_local
    # once per operand, however many steps compare it with the column ids
    # (RowLogSumExp(exclude="t") and PickColumn("t") share the targets)
    for nm in dict.fromkeys(nm for prim in call.program
                            for nm in prim.column_index_operands()):
      operands[nm] = operands[nm] - offset.astype(operands[nm].dtype)
  if layout.k:
    acc_call = dispatch.Call(program=(P.Store("acc", jnp.float32),), inputs=(),
                             outputs=(pk.EpilogueOutput("acc", dtype=jnp.float32),),
                             column_group=1, trans_a=call.trans_a, trans_b=call.trans_b,
                             program_id=P.program_id([P.Store("acc", jnp.float32)]))
    acc = dispatch.run(acc_call, a, b, {}, sc.impl)["acc"]
    acc = jax.lax.psum(acc, layout.k)
    local_sums = dispatch.b_sums(b, call.trans_b)
    # (in_place only saves memory; here the program runs in XLA after the sum)
    out = dispatch.apply_program(acc, call.program, operands, call.outputs,
                                 b_column_sums=lambda: jax.lax.psum(local_sums(), layout.k))
  else:
    out = dispatch.run(call, a, b, operands, sc.impl)
  return _combine(sc, layout, dict(out))


def _whole(sc, a, b, *values):  # one device, or every mesh axis manual: no split
  return dispatch.run(sc.call, a, b, dict(zip(sc.operand_names, values)), sc.impl)


def _partition(sc, mesh, arg_shapes, result_shape):
  layout = choose_layout(sc, mesh, arg_shapes)
  specs = arg_specs(sc, layout)
  result_specs = _result_specs(sc, layout)
  n = arg_shapes[1].shape[0 if sc.call.trans_b else 1]
  n_local = n // _size(mesh, layout.n)

  def lower(a, b, *values):
    return local_call(sc, layout, n_local, a, b, *values)
  named = lambda spec: NamedSharding(mesh, spec)
  return (mesh, lower, {k: named(v) for k, v in result_specs.items()},
          tuple(named(s) for s in specs))


def _infer(sc, mesh, arg_shapes, result_shape):
  layout = choose_layout(sc, mesh, arg_shapes)
  return {k: NamedSharding(mesh, v)
          for k, v in _result_specs(sc, layout).items()}


def _rule(sc, mesh, value_types, result_types):
  """The einsum-like Shardy rule: factors m, k (a reduction factor) and n, written
  (g c) when the program has column groups of width c (only g, whole groups, may be
  split); a column dimension of width N * w is then (g c') with c' = c * w."""
  del mesh, result_types
  a, b, ops, res, sizes = _rule_parts(sc, value_types[1].shape[0 if sc.call.trans_b else 1])
  rule = ", ".join([a, b, *ops]) + " -> " + ", ".join(res)
  return rule, dict(reduction_factors=("k",), **sizes)


def _rule_parts(sc, n):
  """(a's, b's, the operands', the results' factor strings, factor sizes) of ``_rule``
  for N columns."""
  call = sc.call
  sizes, need = {}, []
  if call.column_group > 1:
    sizes["g"] = n // call.column_group

  def cols(width):
    if call.column_group == 1:
      return "n"
    c = int(call.column_group * width)
    sizes[f"c{c}"] = c
    if f"c{c}" not in need:
      need.append(f"c{c}")
    return f"(g c{c})"
  a = "k m" if call.trans_a else "m k"
  b = f"{cols(1)} k" if call.trans_b else f"k {cols(1)}"
  kinds = sc.kinds()
  ops = ["m" if kinds[nm] == pk.InputKind.ROW else cols(1) if kinds[nm] == pk.InputKind.COL
         else f"m {cols(2 if kinds[nm] == pk.InputKind.WIDE_TILE else 1)}"
         for nm in sc.operand_names]
  res = []
  for _, (kind, width) in sorted(dispatch.finished_kinds(call).items()):  # a dict's leaf order
    res.append(f"m {cols(width)}" if kind == "tile" else cols(width) if kind == "col" else "m")
  return a, b, ops, res, dict(need_replication_factors=tuple(need), **sizes)


_partitioned = custom_partitioning(_whole, static_argnums=(0,))
_partitioned.def_partition(partition=_partition, infer_sharding_from_operands=_infer,
                           sharding_rule=_rule)


# ---- K = 0 (``epilogue_gemm.epilogue_pass``): a and b are placeholders of shape only -------------
# XLA's CPU compiler crashed (a segfault, jax 0.11.2) on zero-size arrays passed into
# jax.shard_map; so a pass's zero-size a and b never cross the split: each shard makes
# its own from its tile operands' local shape.
@dataclasses.dataclass(frozen=True)
class _Pass:
  """What a K = 0 call keeps of its placeholders: their dtype and the global M and N."""
  sc: ShardedCall
  dtype: jnp.dtype
  m: int
  n: int


def _placeholders(ps: _Pass, m, n):
  call = ps.sc.call
  a = jnp.zeros((0, m) if call.trans_a else (m, 0), ps.dtype)
  b = jnp.zeros((n, 0) if call.trans_b else (0, n), ps.dtype)
  return a, b


def _pass_shapes(ps: _Pass, mesh, value_shapes):
  """Stand-ins for a and b's shapes, sharded as the pass's first tile operand's rows
  and columns, for ``choose_layout`` and the rule."""
  tile = next(v for nm, v in zip(ps.sc.operand_names, value_shapes)
              if ps.sc.kinds()[nm] in (pk.InputKind.TILE, pk.InputKind.WIDE_TILE))
  m_axes, n_axes = (tuple(_spec_dims(tile)) + ((), ()))[:2]
  call = ps.sc.call
  spec = lambda *d: NamedSharding(mesh, PartitionSpec(*[x or None for x in d]))
  a = (jax.ShapeDtypeStruct((0, ps.m), ps.dtype, sharding=spec((), m_axes)) if call.trans_a
       else jax.ShapeDtypeStruct((ps.m, 0), ps.dtype, sharding=spec(m_axes, ())))
  b = (jax.ShapeDtypeStruct((ps.n, 0), ps.dtype, sharding=spec(n_axes, ())) if call.trans_b
       else jax.ShapeDtypeStruct((0, ps.n), ps.dtype, sharding=spec((), n_axes)))
  return [a, b, *value_shapes]


def _pass_whole(ps: _Pass, *values):
  a, b = _placeholders(ps, ps.m, ps.n)
  return dispatch.run(ps.sc.call, a, b, dict(zip(ps.sc.operand_names, values)), ps.sc.impl)


def _pass_lower(ps: _Pass, mesh, layout):
  """The per-shard function of a pass: ``local_call`` on this shard's own placeholders."""
  n_local = ps.n // _size(mesh, layout.n)
  m_local = ps.m // _size(mesh, layout.m)
  return lambda *values: local_call(ps.sc, layout, n_local,
                                    *_placeholders(ps, m_local, n_local), *values)


def _pass_partition(ps, mesh, arg_shapes, result_shape):
  """``_partition`` on the placeholders' stand-ins, less their shardings and lowering."""
  shapes = _pass_shapes(ps, mesh, arg_shapes)
  mesh, _, results, args = _partition(ps.sc, mesh, shapes, result_shape)
  return mesh, _pass_lower(ps, mesh, choose_layout(ps.sc, mesh, shapes)), results, args[2:]


def _pass_infer(ps, mesh, arg_shapes, result_shape):
  return _infer(ps.sc, mesh, _pass_shapes(ps, mesh, arg_shapes), result_shape)


def _pass_rule(ps, mesh, value_types, result_types):
  del mesh, value_types, result_types
  _, _, ops, res, sizes = _rule_parts(ps.sc, ps.n)
  return ", ".join(ops) + " -> " + ", ".join(res), sizes


_pass_partitioned = custom_partitioning(_pass_whole, static_argnums=(0,))
_pass_partitioned.def_partition(partition=_pass_partition, infer_sharding_from_operands=_pass_infer,
                                sharding_rule=_pass_rule)


def explicit_mesh(*arrays):
  """The mesh of the first array whose type carries an explicit sharding (jax's
  "sharding in types", ``AxisType.Explicit``), else None."""
  for x in arrays:
    mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
    if mesh is None or mesh.empty:
      continue
    if any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
      return mesh
  return None


def call(sc: ShardedCall, a, b, *values) -> dict:
  """Runs ``sc`` split per shard as its operands are sharded.

  Explicitly sharded operands (their types carry the mesh) go through ``jax.shard_map``
  with the layout read from the types; others through ``custom_partitioning``, whose
  rule XLA's partitioner runs with the shardings it chose. The rule is the same."""
  m, n, k = pk.check_operands(a, b, sc.call.trans_a, sc.call.trans_b)
  ps = _Pass(sc, a.dtype, m, n) if k == 0 else None
  mesh = explicit_mesh(*values) if ps else explicit_mesh(a, b, *values)
  if mesh is None:
    return _pass_partitioned(ps, *values) if ps else _partitioned(sc, a, b, *values)
  if ps:
    layout = choose_layout(sc, mesh, _pass_shapes(ps, mesh, [jax.typeof(x) for x in values]))
    specs = arg_specs(sc, layout)[2:]
    body = _pass_lower(ps, mesh, layout)
  else:
    values = (a, b, *values)
    layout = choose_layout(sc, mesh, [jax.typeof(x) for x in values])
    specs = arg_specs(sc, layout)
    body = lambda *xs: local_call(sc, layout, n // _size(mesh, layout.n), *xs)
  return on_explicit_mesh(body, mesh, values, specs, _result_specs(sc, layout))


def on_explicit_mesh(body, mesh, values, in_specs, out_specs):
  """``body`` per shard through ``jax.shard_map``, for operands on explicit mesh axes (the
  layout read from their types at trace time): each value resharded to its spec first."""
  values = [jax.reshard(x, NamedSharding(mesh, s)) for x, s in zip(values, in_specs)]
  return jax.shard_map(body, mesh=mesh, in_specs=tuple(in_specs), out_specs=out_specs,
                       check_vma=False)(*values)


__all__ = ["Layout", "ShardedCall", "arg_specs", "call", "choose_layout", "explicit_mesh",
           "local_call", "on_explicit_mesh"]


# ---- one element per row: x[m, col[m]] = val[m] -------------------------------------------
def _set_local(n_axes, x, col, val):
  """The per-shard set: ``col`` is global; on a column shard it is shifted to the
  shard's columns, and a column elsewhere (or outside [0, N)) is dropped. Negative
  indices are mapped out of range first: jnp indexing would wrap them."""
  m, n = x.shape
  if n_axes:
    col = col - (jax.lax.axis_index(n_axes) * n).astype(col.dtype)
  col = jnp.where((col >= 0) & (col < n), col, n)
  return x.at[jnp.arange(m), col].set(val.astype(x.dtype), mode="drop")


def _set_specs(spec):
  """From x's spec: its column mesh axes, and the specs of x and of the row operands."""
  axes = lambda e: () if e is None else (e,) if isinstance(e, str) else tuple(e)
  m_axes, n_axes = (axes(spec[0]) if len(spec) > 0 else (),
                    axes(spec[1]) if len(spec) > 1 else ())
  return n_axes, PartitionSpec(m_axes or None, n_axes or None), PartitionSpec(m_axes or None)


def _set_partition(mesh, arg_shapes, result_shape):
  n_axes, x_spec, rows = _set_specs(arg_shapes[0].sharding.spec)
  x_sh, rows = NamedSharding(mesh, x_spec), NamedSharding(mesh, rows)
  return (mesh, functools.partial(_set_local, n_axes), x_sh, (x_sh, rows, rows))


def _set_infer(mesh, arg_shapes, result_shape):
  spec = arg_shapes[0].sharding.spec
  return NamedSharding(mesh, PartitionSpec(*spec))


_set_partitioned = custom_partitioning(functools.partial(_set_local, ()))
_set_partitioned.def_partition(partition=_set_partition, infer_sharding_from_operands=_set_infer,
                               sharding_rule="m n, m, m -> m n")


def set_row_columns(x, col, val):
  """x (M, N) with x[m, col[m]] = val[m] for each row whose ``col`` is in [0, N) (other
  rows unchanged): one element per row, written in place. Sharded, each device sets its
  own rows' elements in its own columns, with no communication (XLA's partitioning of
  the plain scatter all-gathers the indices and values)."""
  mesh = explicit_mesh(x, col, val)
  if mesh is None:
    return _set_partitioned(x, col, val)
  n_axes, x_spec, rows = _set_specs(jax.typeof(x).sharding.spec)
  return on_explicit_mesh(functools.partial(_set_local, n_axes), mesh, (x, col, val),
                          (x_spec, rows, rows), x_spec)
