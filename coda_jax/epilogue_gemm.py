"""One entry point: a GEMM followed by a composed epilogue program.

    outs = gemm_epilogue(a, b, program, operands, trans_a=False, trans_b=False)

``impl`` names the implementations to try, in order (``coda_jax.dispatch``): "auto"
(the compiled kernel on an sm90 GPU where the shape tiles, else the XLA program;
``CODA_JAX_IMPL`` overrides it), "mosaic", "interpret", "xla", or a sequence of these.
With more than one device the call is partitioned per shard (``coda_jax.partitioning``).

Outputs are returned finished: ``Store`` outputs as stored, ``RowSum`` as (M,),
``ColSum`` as (N,), ``RowLogSumExp`` as (M,) log-sum-exp under its own name.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp

import pallas_kernels as pk
from coda_jax import dispatch
from coda_jax import partitioning
from coda_jax import primitives as P
from coda_jax.dispatch import kernels_available
from coda_jax.sharding import vary_like, varying_axes

IMPLS = ("auto",) + dispatch.NAMES


def scalar_operand(value, n: int) -> jax.Array:
  """A runtime scalar as the column operand that ``ScaleCol`` reads.

  Args:
    value: a Python or traced scalar.
    n: the GEMM's N.

  Returns:
    (N,) float32, ``value`` in every element.
  """
  return jnp.broadcast_to(jnp.asarray(value, jnp.float32), (n,))


def _declared(program, m, n):
  inputs: dict[str, pk.InputKind] = {}
  outputs: list[pk.EpilogueOutput] = []
  width = 1
  for prim in program:
    if not isinstance(prim, P.Primitive):
      raise ValueError(f"program step {prim!r} is not a coda_jax primitive")
    for name, kind in prim.inputs().items():
      if inputs.setdefault(name, kind) != kind:
        raise ValueError(f"operand {name!r} is read both as {inputs[name].value} and {kind.value}")
      if width != 1 and kind != pk.InputKind.ROW:
        raise ValueError(f"{type(prim).__name__} reads {kind.value} operand {name!r} after a "
                         "step that changed the width; column and tile operands must come "
                         "before it")
    if width != 1 and (prim.column_group() is not None or prim.width_factor() != 1):
      raise ValueError(f"{type(prim).__name__}: a pairwise step after a step that changed the "
                       "width is not supported")
    outputs += prim.outputs(width)
    if prim.column_group() is not None:
      if n % prim.column_group():
        raise ValueError(f"{type(prim).__name__}: N={n} must be a multiple of its column "
                         f"group (pair block) {prim.column_group()}")
    width *= prim.width_factor()
  names = [o.name for o in outputs]
  if len(set(names)) != len(names):
    raise ValueError(f"program declares duplicate outputs: {names}")
  if not outputs:
    raise ValueError("program stores nothing: add a Store or a reduction")
  return inputs, tuple(outputs), P.program_column_group(program)


def _check_epilogue_operands(inputs, operands, m, n):
  missing = set(inputs) - set(operands)
  if missing:
    raise ValueError(f"program reads operands {sorted(missing)} that were not passed")
  extra = set(operands) - set(inputs)
  if extra:
    raise ValueError(f"operands {sorted(extra)} are not read by the program")
  for name, kind in inputs.items():
    pk.epilogue.check_input(name, kind, operands[name], m, n)


def _problem(a, b, trans_a, trans_b):
  # float32 is accepted here for the XLA reference path; the kernel takes 16-bit only.
  return pk.check_operands(a, b, trans_a, trans_b,
                           dtypes=(jnp.bfloat16, jnp.float16, jnp.float32))


def reference(a, b, program, operands, *, trans_a=False, trans_b=False, round_to=None):
  """The semantics of ``gemm_epilogue`` in jnp: the product in fp32, then the program
  step by step.

  Args:
    a, b, program, operands, trans_a, trans_b: as for ``gemm_epilogue``.
    round_to: None (fp32 throughout), or a dtype (e.g. bfloat16) that every
      intermediate is rounded to, as an unfused XLA graph in that dtype rounds it: the
      baseline of the tolerance rule.

  Returns:
    dict of output name to array, finished as ``gemm_epilogue`` returns them.
  """
  m, n, _ = _problem(a, b, trans_a, trans_b)
  inputs, outputs, _ = _declared(program, m, n)
  _check_epilogue_operands(inputs, operands, m, n)
  call = dispatch.Call(program=tuple(program), inputs=tuple(inputs.items()), outputs=outputs,
                       column_group=1, trans_a=trans_a, trans_b=trans_b)
  return dispatch.IMPLEMENTATIONS["xla"].run(call, a, b, operands, round_to=round_to)


program_id = P.program_id  # the tuning cache's name of a program (primitives.py)


def kernel_config(a, b, program, operands, *, trans_a=False, trans_b=False) -> pk.GemmConfig:
  """The heuristic kernel tuning for this problem and program. ``pallas_kernels.gemm``
  prefers a measured config from the tuning cache where it has one
  (``pallas_kernels.autotune``).

  Args:
    a, b, program, operands, trans_a, trans_b: as for ``gemm_epilogue``.

  Returns:
    the ``pallas_kernels.GemmConfig`` the heuristic picks.

  Raises:
    ValueError: the shape cannot tile, or the program is malformed.
  """
  m, n, _ = _problem(a, b, trans_a, trans_b)
  inputs, outputs, group = _declared(tuple(program), m, n)
  call = dispatch.Call(program=tuple(program), inputs=tuple(inputs.items()), outputs=outputs,
                       column_group=group, trans_a=trans_a, trans_b=trans_b)
  return dispatch.kernel_config(call, a, b, operands)


def gemm_epilogue(a: jax.Array, b: jax.Array, program: Sequence[P.Primitive],
                  operands: dict[str, jax.Array] | None = None, *, trans_a: bool = False,
                  trans_b: bool = False, impl: str | Sequence[str] = "auto",
                  config: pk.GemmConfig | None = None,
                  in_place: dict[str, str] | None = None) -> dict[str, jax.Array]:
  """``a @ b``, then ``program`` on the fp32 result, tile by tile.

  Args:
    a: (M, K), or (K, M) with ``trans_a``; bfloat16 or float16 for the kernel (float32
      runs the XLA program).
    b: (K, N), or (N, K) with ``trans_b``; ``a``'s dtype.
    program: epilogue steps (``coda_jax.primitives``, or your own ``Primitive``s).
    operands: name -> array for the steps' inputs: row (M,), column (N,), tile (M, N).
    trans_a, trans_b: the operands are stored transposed.
    impl: implementations to try in order (``coda_jax.dispatch``): "auto", "mosaic",
      "interpret", "xla", or a sequence of these.
    config: kernel tuning; default the tuning cache's, else the heuristic's.
    in_place: maps a ``Store`` output to the tile operand whose buffer it overwrites
      (gradient accumulation: ``[Store("g_new", jnp.float32, add_to="g")]`` with
      ``in_place={"g_new": "g"}``: the kernel's TMA store adds to g and never reads it;
      or ``[AddTile("g"), Store("g_new", jnp.float32)]``, which stages g); donate that
      operand under ``jit`` to reuse its memory. The values are the same with or
      without it (it is dropped on hosts with several devices and inside
      ``shard_map``, and where M is padded to the tile). Use it for whole buffers only:
      XLA copies a slice (a scan's xs or saved residuals) out first, which costs a pass
      over memory and saves nothing (``docs/design.md#6-in-place-outputs-and-xla``).

  Returns:
    The finished outputs by name: ``Store``s as stored, row sums (M,), column sums
    (N,), log-sum-exps (M,). Sharded operands give outputs sharded the same way
    (``coda_jax.partitioning``).

  Raises:
    ValueError: bad shapes, dtypes or operands, or no implementation in ``impl`` can run
      the call (each one's reason listed).
  """
  operands = dict(operands or {})
  program = tuple(program)
  names = dispatch.resolve(impl)
  m, n, k = _problem(a, b, trans_a, trans_b)
  inputs, outputs, group = _declared(program, m, n)
  _check_epilogue_operands(inputs, operands, m, n)
  call = dispatch.Call(program=program, inputs=tuple(inputs.items()), outputs=outputs,
                       column_group=group, trans_a=trans_a, trans_b=trans_b, config=config,
                       in_place=tuple(sorted((in_place or {}).items())),
                       program_id=program_id(program))  # checks in_place's names
  multi_device = jax.device_count() > 1
  # in_place saves memory only. A mutable buffer cannot cross a shard boundary: JAX
  # refuses Refs that vary over manual mesh axes (inside shard_map) and effects inside
  # custom_partitioning, so split calls write a fresh output instead.
  if multi_device or any(varying_axes(x) for x in (a, b, *operands.values())):
    call = dataclasses.replace(call, in_place=())
  if multi_device:  # split per shard where the operands are sharded (a no-op if not)
    sc = partitioning.ShardedCall(call, tuple(operands), names)
    out = partitioning.call(sc, a, b, *operands.values())
  else:
    out = dispatch.run(call, a, b, operands, names)
  # Under shard_map the Mosaic call's outputs carry no varying mesh axes: give them
  # those of its inputs (coda_jax/sharding.py).
  return {nm: vary_like(v, a, b, *operands.values()) for nm, v in out.items()}


def epilogue_pass(program: Sequence[P.Primitive], operands: dict[str, jax.Array], *,
                  impl: str | Sequence[str] = "auto", config: pk.GemmConfig | None = None,
                  in_place: dict[str, str] | None = None) -> dict[str, jax.Array]:
  """``program`` without a GEMM: on a running value that starts at zero, tile by tile.

  For memory-bound work that no GEMM produces or consumes as its output tile (the
  QK-norm and RoPE backward: their cotangent comes from attention, and their result is
  the *input* of the next GEMMs), with the same primitives, partials and kernel
  epilogue as ``gemm_epilogue``: it is ``gemm_epilogue`` with K = 0, which the kernel
  runs with no mainloop. Begin the program with an ``AddTile`` of the input: the
  kernel's running value starts at -0.0, so that add keeps every bit and compiles to
  nothing.

  Args:
    program: epilogue steps; it must read at least one (M, N) tile operand, whose shape
      is the pass's and whose shardings it follows.
    operands: as ``gemm_epilogue``'s.
    impl, config, in_place: as ``gemm_epilogue``'s (a config must be cooperative and
      unclustered: there is no mainloop to hide the epilogue under or to multicast).

  Returns:
    The finished outputs by name, as ``gemm_epilogue``'s.

  Raises:
    ValueError: the program reads no tile operand, or as ``gemm_epilogue``.
  """
  program = tuple(program)
  operands = dict(operands or {})
  tiles = [nm for prim in program for nm, kind in prim.inputs().items()
           if kind == pk.InputKind.TILE and nm in operands]
  if not tiles:
    raise ValueError("epilogue_pass: the program reads no (M, N) tile operand that was "
                     "passed, so the pass has no shape; start it with AddTile(<input>)")
  t = operands[tiles[0]]
  if t.ndim != 2:
    raise ValueError(f"epilogue_pass: tile operand {tiles[0]!r} has shape {t.shape}, "
                     "expected (M, N)")
  # Zero-size placeholders: K = 0 and the pass's M and N (a sharded call makes each
  # shard its own: coda_jax.partitioning). The kernel never reads them; their dtype picks
  # the implementations (16-bit for the kernel), not the program's precision.
  dt = t.dtype if t.dtype in (jnp.bfloat16, jnp.float16) else jnp.bfloat16
  return gemm_epilogue(t[:, :0].astype(dt), t[:0, :].astype(dt), program, operands,
                       impl=impl, config=config, in_place=in_place)


__all__ = ["IMPLS", "epilogue_pass", "gemm_epilogue", "kernel_config", "kernels_available",
           "program_id", "reference", "scalar_operand"]
