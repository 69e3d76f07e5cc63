"""How one GEMM-epilogue call runs: the one place that picks the implementation.

Every fused op, block and layer reaches the kernels through ``epilogue_gemm.gemm_epilogue``, and
``gemm_epilogue`` hands the call here (after ``partitioning`` has split it per shard when
its operands are sharded). An *implementation* either runs the call or says why it
cannot. The caller names a list of them; they are tried in order and the first that can
run, runs. When none can, the error lists every implementation with its reason.

Implementations:
  "mosaic"     the compiled Mosaic GPU kernel (``pallas_kernels.gemm``): needs an sm90
               GPU, 16-bit operands and a shape that tiles.
  "interpret"  the same kernel through Mosaic GPU's CPU interpreter (tests).
  "xla"        the jnp semantics: an fp32 GEMM, then the program on the whole matrix.

``impl`` (the argument every public op takes) names them: one name, a sequence of
names tried in order, or "auto" = ("mosaic", "xla"). ``CODA_JAX_IMPL`` replaces "auto"
(e.g. ``CODA_JAX_IMPL=interpret`` runs a whole model through the interpreter). Which
implementation ran, and why an earlier one did not, is logged once per reason.

The kernel's persistent grid is sized from the SM count of the device the call runs
on (``target_device``), and the tuning cache is keyed by that device's kind.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp

import pallas_kernels as pk
from coda_jax import primitives as P

log = logging.getLogger("coda_jax")
NAMES = ("mosaic", "interpret", "xla")
AUTO = ("mosaic", "xla")
_announced: set[str] = set()


def announce(msg: str) -> None:
  """Logs ``msg`` once per process (the reason a fallback ran, for example)."""
  if msg not in _announced:
    _announced.add(msg)
    log.warning("%s", msg)


class Unsupported(Exception):
  """An implementation cannot run this call; the message says why."""


def _checked_names(impl: str | Sequence[str], what: str) -> tuple[str, ...]:
  names = (impl,) if isinstance(impl, str) else tuple(impl)
  if not names:
    raise ValueError(f"{what}=(): name at least one implementation")
  if names == ("auto",):
    return AUTO
  for nm in names:
    if nm not in NAMES:
      raise ValueError(f"{what}={impl!r}: {nm!r} is not one of {('auto',) + NAMES}")
  return names


# Part of jax.jit's cache key: a function traced under one implementation is traced again
# under another, never replayed with the first one's kernels.
_CHOSEN = jax.make_user_context(default_value=None)


def implementation(impl: str | Sequence[str]):
  """A context in which every GEMM-epilogue call traced runs with ``impl``.

  Args:
    impl: "mosaic", "interpret" or "xla", a sequence of them tried in order, or "auto"
      (= ("mosaic", "xla")).

  Returns:
    A context manager. ``jax.jit`` keys its cache on it, so a jitted function called
    under another implementation is traced again.

  Example: ``with coda_jax.implementation("xla"): loss = step(params, batch)``.
  """
  return _CHOSEN(_checked_names(impl, "implementation"))


def current() -> tuple[str, ...]:
  """The implementations a call traced now tries, in order: the innermost
  ``implementation(...)`` context's, else ``CODA_JAX_IMPL``'s (a process-wide default,
  read when a call is traced), else ``AUTO``."""
  chosen = _CHOSEN.value
  if chosen is not None:
    return chosen
  return _checked_names(os.environ.get("CODA_JAX_IMPL", "auto"), "CODA_JAX_IMPL")


def resolve(impl: str | Sequence[str]) -> tuple[str, ...]:
  """``impl`` as the ordered tuple of implementation names to try ("auto": ``current()``)."""
  if impl == "auto":
    return current()
  return _checked_names(impl, "impl")


def target_device() -> jax.Device:
  """The device a kernel launched now runs on: JAX's default device (every local device
  of one kind on a host; a mix of GPU models is refused, since a kernel's grid and tuning
  are sized for one)."""
  dev = jax.config.jax_default_device
  if dev is None or isinstance(dev, str):
    dev = jax.local_devices(backend=dev)[0] if isinstance(dev, str) else jax.local_devices()[0]
  kinds = {(d.device_kind, getattr(d, "core_count", None)) for d in jax.local_devices(
      backend=dev.platform)}
  if len(kinds) > 1:
    raise ValueError(f"local {dev.platform} devices of different kinds {sorted(kinds)}: "
                     "coda_jax sizes one kernel for all of them; restrict the process to "
                     "one kind (CUDA_VISIBLE_DEVICES)")
  return dev


def kernels_available() -> bool:
  """True when the target device is an sm90 (Hopper) GPU, where "mosaic" can run."""
  try:
    dev = target_device()
  except (RuntimeError, ValueError):
    return False
  return dev.platform == "gpu" and str(getattr(dev, "compute_capability", "")).startswith("9")


@dataclasses.dataclass(frozen=True)
class Call:
  """One local GEMM-epilogue problem, already validated by ``epilogue_gemm.gemm_epilogue``.

  Attributes:
    program: the epilogue steps.
    inputs: operand name -> kind, as the program reads them.
    outputs: the declared kernel outputs.
    column_group: columns that must share an epilogue sub-tile (pair blocks).
    trans_a, trans_b: operand orders.
    config: kernel tuning, or None for the tuning cache / heuristic.
    in_place: (output, operand) pairs written in place.
    program_id: the program's name in the tuning cache.
  """
  program: tuple
  inputs: tuple[tuple[str, pk.InputKind], ...]
  outputs: tuple[pk.EpilogueOutput, ...]
  column_group: int
  trans_a: bool = False
  trans_b: bool = False
  config: pk.GemmConfig | None = None
  in_place: tuple[tuple[str, str], ...] = ()
  program_id: str = ""

  def __post_init__(self):
    if self.column_group < 1:
      raise ValueError(f"column_group={self.column_group} must be >= 1")
    names = {nm for nm, _ in self.inputs}
    for out, src in self.in_place:
      if src not in names:
        raise ValueError(f"in_place {out!r} <- {src!r}: not an operand of the program")


class _MatrixEnv:
  """``primitives.Env`` over a whole (M, N) matrix, or over one (M, w) block of its
  columns (``apply_program``), for the XLA implementation."""

  def __init__(self, operands, shape, adds=None, b_column_sums=None, col0=0):
    self.operands = operands
    self.shape = shape
    self.adds = adds or {}  # output -> the operand its stored values add to
    self.b_column_sums = b_column_sums  # () -> (N,) sums of B over K, where known
    self.col0 = col0  # the global column of the value's first (a block's, in _run_blocks)
    self.stored: dict[str, jax.Array] = {}

  def column_ids(self):
    return jax.lax.broadcasted_iota(jnp.int32, self.shape, 1) + self.col0

  def load(self, name):
    return self.operands[name]

  def store(self, name, value):
    if name in self.adds:
      value = value + self.operands[self.adds[name]].astype(jnp.float32)
    self.stored[name] = value

  def column_sum(self, x):
    return jnp.sum(x, axis=0)

  def store_column_sum(self, name, x):
    self.store(name, self.column_sum(x))

  def column_value(self, name, col):
    return self.operands[name][col]

  def cond(self, pred, if_true, if_false, *args):
    # both branches, then a select: elementwise work XLA fuses, where a lax.cond per head
    # would branch at run time on a value in device memory (and, per block under vmap,
    # would run both anyway)
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), if_true(*args),
                        if_false(*args))

  def b_column_sum(self, name):
    if self.b_column_sums is None:
      raise ValueError(f"output {name!r} sums the GEMM's B operand over K, but this "
                       "program runs without one")
    self.stored[name] = self.b_column_sums()


def finish(program, raw: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """The user-facing outputs from raw kernel outputs (partials reduced)."""
  return {name: v for prim in program for name, v in prim.finish(raw).items()}


def column_block(program, n: int) -> int:
  """The columns the XLA implementation runs ``program`` on at a time: its column group
  (``primitives.program_column_group``: a head, a gated pair block), or all ``n`` when no
  step has one (or the group does not tile ``n``)."""
  group = P.program_column_group(program)
  return group if group > 1 and n % group == 0 else n


def apply_program(x: jax.Array, program, operands: dict[str, jax.Array], outputs,
                  round_to=None, b_column_sums=None) -> dict[str, jax.Array]:
  """``program`` on a whole fp32 matrix ``x``: the finished outputs. ``round_to`` rounds
  every intermediate as an unfused XLA graph in that dtype would. ``b_column_sums``: a
  function giving the (N,) sums of the GEMM's B over K, for a ``BColumnSum``.

  A program whose steps work per column group (``column_block``) runs once per block of
  columns, as the kernel runs it once per sub-tile, under ``jax.vmap``: a step's loop
  over its groups then has one or two of them, where on the whole matrix it would slice
  out every head or pair block and concatenate them again
  (``docs/tuning.md#the-xla-implementation-per-column-block``)."""
  adds = {o.name: o.adds_to for o in outputs if o.adds_to}
  width = column_block(program, x.shape[1])
  if width == x.shape[1] or any(o.kind == pk.OutputKind.ROW_TOTAL for o in outputs):
    env = _MatrixEnv(operands, x.shape, adds, b_column_sums)
    P.run_program(program, x, env, round_to=round_to)
    raw = {o.name: env.stored[o.name] if o.kind == pk.OutputKind.TILE
           else env.stored[o.name][None] for o in outputs}
  else:
    raw = _run_blocks(x, program, operands, outputs, adds, width, round_to, b_column_sums)
  return finish(program, {o.name: raw[o.name].astype(o.dtype) if o.kind == pk.OutputKind.TILE
                          else raw[o.name] for o in outputs})


def _run_blocks(x, program, operands, outputs, adds, width, round_to, b_column_sums):
  """``apply_program``'s raw outputs, the program run on each ``width``-wide column block
  of ``x`` (M, N) under ``jax.vmap``. Tile and col operands are split into as many blocks
  (a wide tile's are twice as wide); row operands are shared. Tile outputs and col
  partials are joined again; row partials come back one per block, as the kernel's come
  one per sub-tile column, for the steps' ``finish`` to reduce."""
  m, n = x.shape
  blocks = n // width
  kinds = {nm: kind for prim in program for nm, kind in prim.inputs().items()}
  split, axes = {}, {}
  for nm, a in operands.items():
    kind = kinds.get(nm)
    if kind in (pk.InputKind.TILE, pk.InputKind.WIDE_TILE):
      split[nm], axes[nm] = a.reshape(m, blocks, a.shape[1] // blocks), 1
    elif kind == pk.InputKind.COL:
      split[nm], axes[nm] = a.reshape(blocks, a.shape[0] // blocks), 0
    else:  # row operands, and any the program does not read
      split[nm], axes[nm] = a, None
  sums = None
  if b_column_sums is not None and any(o.kind == pk.OutputKind.B_COLUMN_SUM for o in outputs):
    sums = b_column_sums().reshape(blocks, width)

  def block(xb, col0, ops, sums_b):
    env = _MatrixEnv(ops, xb.shape, adds, None if sums_b is None else lambda: sums_b, col0)
    P.run_program(program, xb, env, round_to=round_to)
    return {o.name: env.stored[o.name] for o in outputs}

  out_axes = {o.name: 1 if o.kind == pk.OutputKind.TILE else 0 for o in outputs}
  stored = jax.vmap(block, in_axes=(1, 0, axes, None if sums is None else 0),
                    out_axes=out_axes)(x.reshape(m, blocks, width),
                                       jnp.arange(blocks, dtype=jnp.int32) * width, split, sums)
  raw = {}
  for o in outputs:
    v = stored[o.name]
    if o.kind == pk.OutputKind.TILE:
      raw[o.name] = v.reshape(m, -1)
    elif o.kind == pk.OutputKind.ROW_PARTIAL:
      raw[o.name] = v  # (blocks, M)
    else:  # col partials, B's column sums: (blocks, w) -> one partial of N values
      raw[o.name] = v.reshape(1, -1)
  return raw


def b_sums(b, trans_b: bool):
  """A function giving B's (N,) sums over K in fp32, B stored (K, N) or, with
  ``trans_b``, (N, K)."""
  return lambda: jnp.sum(b.astype(jnp.float32), axis=1 if trans_b else 0)


def _xla_check(call, a, b, operands):
  return None


def _xla_run(call, a, b, operands, round_to=None):
  a2 = a.T if call.trans_a else a
  b2 = b.T if call.trans_b else b
  x = jnp.matmul(a2, b2, preferred_element_type=jnp.float32,
                 precision=jax.lax.Precision.HIGHEST)
  if round_to is not None:
    x = x.astype(round_to).astype(jnp.float32)
  return apply_program(x, call.program, operands, call.outputs, round_to=round_to,
                       b_column_sums=b_sums(b, call.trans_b))


def kernel_config(call, a, b, operands, m=None, k=None, clip_m=False) -> pk.GemmConfig:
  """The heuristic tuning of the kernel for ``call`` (ValueError if it cannot tile), at
  the operands' shape or with M and K replaced by padded sizes; ``clip_m`` as
  ``pallas_kernels.gemm``'s (M need not be a multiple of the tile)."""
  m0, n, k0 = pk.check_operands(a, b, call.trans_a, call.trans_b)
  return pk.default_config(m or m0, n, k or k0, a.dtype, input_kinds=dict(call.inputs),
                           input_dtypes={nm: operands[nm].dtype for nm, _ in call.inputs},
                           outputs=call.outputs, min_epi_tile_n=call.column_group,
                           trans_a=call.trans_a, trans_b=call.trans_b, clip_m=clip_m)


def _round_up(x, multiple):
  return -(-x // multiple) * multiple


def finished_kinds(call: Call) -> dict[str, tuple[str, float]]:
  """Each finished output's name -> ("tile" | "row" | "col", width relative to N)."""
  raw = {o.name: o for o in call.outputs}
  kinds = {o.name: ("tile", o.width) for o in call.outputs if o.kind == pk.OutputKind.TILE}
  for prim in call.program:
    for name in prim.combine_over_shards():
      o = raw.get(name)
      col = o is not None and o.kind in (pk.OutputKind.COL_PARTIAL, pk.OutputKind.B_COLUMN_SUM)
      kinds[name] = ("col", o.width) if col else ("row", 1)
  return kinds


class KernelShape(NamedTuple):
  """How the kernel runs a call: at M rows and K (zero-padded from the operands' own
  where they differ), with ``clip_m`` when M is not a multiple of the tile and the
  compiled kernel's TMA clips the last row of tiles instead (``pallas_kernels.gemm``)."""
  m: int
  k: int
  clip_m: bool


def zero_rows_ok(call: Call) -> bool:
  """Whether rows of zeros past M (padded, or clipped by TMA) leave every output as it
  would be: they cannot reach a column partial when every step maps a zero row to zero
  (``Primitive.keeps_zero_rows``)."""
  has_cols = any(kind == "col" for kind, _ in finished_kinds(call).values())
  return not has_cols or all(p.keeps_zero_rows() for p in call.program)


def clip_allowed(call: Call, m: int) -> bool:
  """Whether the compiled kernel may run ``call`` at M = ``m`` with TMA clipping the
  last row of tiles (``pallas_kernels.gemm``'s ``clip_m``)."""
  return zero_rows_ok(call) and m % pk.CLIP_M_MULTIPLE == 0


def padded_shape(call: Call, a, b, operands, compiled: bool = False) -> KernelShape:
  """The (M, K) the kernel runs at: the operands' own when they tile, else the smallest
  zero-padded sizes that do (ValueError when none does). ``compiled`` (a GPU, not the
  interpreter): an M that is a multiple of ``pallas_kernels.CLIP_M_MULTIPLE`` is not
  padded; TMA fills the rows past it with zeros on load and drops them on store.

  Zero rows appended to A (and, for K, to B) change nothing a caller sees: padded K
  adds 0 to every product; padded (or clipped) M rows are sliced off (or never stored
  to) the tile and row outputs, and add nothing to column partial sums as long as every
  step maps a zero row to zero (``Primitive.keeps_zero_rows``; else M is not padded)."""
  m, _, k = pk.check_operands(a, b, call.trans_a, call.trans_b, dtypes=(a.dtype,))
  pad_m_ok = zero_rows_ok(call)
  clip = compiled and clip_allowed(call, m)
  ms = dict.fromkeys([m] + ([_round_up(m, q) for q in (64, 128, 256)] if pad_m_ok else []))
  ks = dict.fromkeys([k] + [_round_up(k, q) for q in (16, 64)])
  error = None
  for pm, pk_ in sorted(((pm, pk_) for pm in ms for pk_ in ks),
                        key=lambda s: (s[0] * s[1], s)):
    try:
      kernel_config(call, a, b, operands, m=pm, k=pk_, clip_m=clip and pm == m)
      return KernelShape(pm, pk_, clip and pm == m)
    except ValueError as e:
      error = error or e
  raise ValueError(f"shape ({m}, {b.shape[0] if call.trans_b else b.shape[1]}, {k}) does "
                   f"not tile, even with M and K padded ({error})")


def _pad_rows(x, rows, axis=0):
  if x.shape[axis] == rows:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, rows - x.shape[axis])
  return jnp.pad(x, widths)


def _mosaic_check(call, a, b, operands):
  if not kernels_available():
    raise Unsupported("no sm90 GPU (Hopper) here")
  if a.dtype not in (jnp.bfloat16, jnp.float16):
    raise Unsupported(f"{a.dtype} operands (the kernel takes bfloat16 or float16)")
  if call.config is None:
    try:
      padded_shape(call, a, b, operands, compiled=True)
    except ValueError as e:
      raise Unsupported(str(e)) from None


def _interpret_check(call, a, b, operands):
  if a.dtype not in (jnp.bfloat16, jnp.float16):
    raise Unsupported(f"{a.dtype} operands (the kernel takes bfloat16 or float16)")


def _kernel_run(call, a, b, operands, interpret=None):
  def epilogue(tile, acc):
    P.run_program(call.program, acc, tile)
  m, _, k = pk.check_operands(a, b, call.trans_a, call.trans_b, dtypes=(a.dtype,))
  if call.config is None:
    pm, pk_, clip_m = padded_shape(call, a, b, operands, compiled=interpret is None)
  else:  # the caller's config, at the operands' shape; clipped where it may be
    pm, pk_, clip_m = m, k, (interpret is None and m % call.config.cluster_tile[0] != 0
                             and clip_allowed(call, m))
  in_place = dict(call.in_place)
  if (pm, pk_) != (m, k):  # zero rows to the tile; sliced off below
    announce(f"padding (M, K) = ({m}, {k}) to ({pm}, {pk_}) so the kernel tiles")
    a = _pad_rows(_pad_rows(a, pk_ if call.trans_a else pm, 0), pm if call.trans_a else pk_, 1)
    b = _pad_rows(b, pk_, 1 if call.trans_b else 0)
    kinds = dict(call.inputs)
    operands = {nm: v if kinds[nm] == pk.InputKind.COL else _pad_rows(v, pm)
                for nm, v in operands.items()}
    if pm != m:
      in_place = {}  # the operands' padded copies are not the caller's buffers
  device = target_device()
  raw = pk.gemm(a, b, inputs={nm: (kind, operands[nm]) for nm, kind in call.inputs},
                epilogue=epilogue, outputs=call.outputs, trans_a=call.trans_a,
                trans_b=call.trans_b, config=call.config, in_place=in_place,
                program_id=call.program_id, min_epi_tile_n=call.column_group,
                num_sms=None if interpret is not None else device.core_count,
                device_kind=device.device_kind, interpret=interpret,
                column_sum_turns=all(p.column_sums_via_env() for p in call.program),
                clip_m=clip_m)
  out = finish(call.program, raw)
  if pm != m:
    kinds = finished_kinds(call)
    out = {nm: v if kinds.get(nm, ("tile",))[0] == "col" else v[:m] for nm, v in out.items()}
  return out


@dataclasses.dataclass(frozen=True)
class Implementation:
  """``check(call, a, b, operands)`` raises ``Unsupported`` when it cannot run;
  ``run`` returns the finished outputs."""
  name: str
  check: Callable[..., Any]
  run: Callable[..., dict]


IMPLEMENTATIONS = {
    "mosaic": Implementation("mosaic", _mosaic_check, _kernel_run),
    "interpret": Implementation(
        "interpret", _interpret_check,
        lambda call, a, b, ops: _kernel_run(call, a, b, ops, interpret=pk.interpret_params())),
    "xla": Implementation("xla", _xla_check, _xla_run),
}


def choose(call: Call, a, b, operands, impl) -> Implementation:
  """The first implementation in ``impl`` that can run ``call``; a ValueError listing
  each one's reason when none can."""
  names = resolve(impl)
  reasons = []
  for nm in names:
    chosen = IMPLEMENTATIONS[nm]
    try:
      chosen.check(call, a, b, operands)
    except Unsupported as e:
      reasons.append(f"{nm}: {e}")
      continue
    if reasons:
      announce(f"ran {nm} ({'; '.join(reasons)})")
    return chosen
  raise ValueError(f"no implementation in impl={names} can run this call: "
                   + "; ".join(reasons))


def run(call: Call, a, b, operands, impl) -> dict[str, jax.Array]:
  """Runs ``call`` on local arrays with the first implementation that can."""
  return choose(call, a, b, operands, impl).run(call, a, b, operands)


__all__ = ["AUTO", "Call", "IMPLEMENTATIONS", "Implementation", "NAMES", "Unsupported",
           "announce", "apply_program", "choose", "column_block", "current", "finish",
           "finished_kinds", "implementation",
           "kernel_config", "kernels_available", "KernelShape", "padded_shape", "resolve", "run",
           "target_device"]
