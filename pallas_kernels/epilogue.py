"""The contract between the GEMM mainloop and an epilogue closure.

An epilogue is a Python callable ``fn(tile: EpilogueTile, acc) -> None``, traced once
per epilogue sub-tile of shape ``(epi_tile_m, epi_tile_n)``. ``acc`` is the fp32
accumulator sub-tile, still in registers. Through ``tile`` the closure reads the extra
operands the caller passed (already staged in shared memory by asynchronous copies
issued before the mainloop) and writes the outputs it declared.

Operand kinds, by the shape of the array passed for them (M x N is the GEMM output):
  row   (M,)    one value per output row; ``tile.load`` gives (epi_tile_m,)
  col   (N,)    one value per output column; ``tile.load`` gives (epi_tile_n,),
                ``tile.column_value(name, j)`` the one at the sub-tile's column j, a scalar
                the whole warpgroup shares (``tile.cond`` branches on such a scalar
                without diverging)
  tile  (M, N)  ``tile.load`` gives (epi_tile_m, epi_tile_n) in the operand's dtype

  wide_tile (M, 2N)  twice the output's width (a gated pair's operand in the backward of
                a gated epilogue): ``tile.load`` gives (epi_tile_m, 2 * epi_tile_n), the
                columns [2 * col0, 2 * col0 + 2 * epi_tile_n)

Output kinds (``width`` in {0.5, 1, 2}: the output's width relative to N, after a gated
pair halved the value or a gated backward doubled it):
  tile         (M, N * width); ``tile.store`` takes (epi_m, epi_n * width)
  row_partial  (N // epi_tile_n, M) fp32; ``tile.store`` takes (epi_m,): one partial per
               row and epilogue column block, finished by a reduction over axis 0.
  col_partial  (M // epi_tile_m, N * width) fp32; ``tile.store`` takes (epi_n * width,),
               ``tile.store_column_sum`` the (epi_m, epi_n * width) value whose sum over
               rows it is. Under ``GemmConfig.epi_column_sums_per_tile`` one row per
               warpgroup tile, (M // tile_m, N * width): the kernel adds the sub-tiles of
               a column block before it sums (``store_column_sum``) or after (``store``).
               (With ``gemm``'s ``clip_m``, a row for every row of tiles, past M too.)
  b_column_sum (ceil(M / tile_m), N) fp32: partials of sum_k B[k, n], the B operand
               summed over the contraction (the bias gradient of a weight-gradient GEMM
               dW = X^T dY, as cuBLASLt's BGRADB epilogue gives it), finished by a sum
               over axis 0. The *mainloop* makes them, not the epilogue: the warpgroup
               tiles of a column block share its K steps, row of tiles p taking steps p,
               p + P, ... (P rows), each with one more small wgmma, B's tile (transposed)
               against a ones column; each stores its sums as row p. The closure only
               names the output, with ``tile.b_column_sum(name)``.
  row_total    (N // tile_n, M) fp32: a row partial per warpgroup tile that the kernel
               also sums across the whole row *during* the epilogue, so that the
               program can use each row's total over all N columns before it stores
               anything (a norm's row terms, such as LayerNorm's backward needs). Such a
               program runs in two passes over its sub-tiles: ``row_totals_pass``
               (``gemm``'s argument) stores each row-total output's (epi_m,) partial
               with ``tile.store``; then the CTAs holding a row block's tiles exchange
               their partials through global memory (a semaphore per row block), and the
               epilogue proper reads each total as a row operand of the same name
               (``tile.load``). Ping-pong schedule, compiled kernels only
               (``gemm_mgpu.row_totals_conflict``).

A tile output may name ``adds_to``, a tile operand of its shape and dtype (float32): the
kernel adds that operand's values to what the epilogue stores (an accumulator, e.g. a
weight gradient summed over row chunks), and the epilogue cannot ``tile.load`` it.
Written in place into that operand's buffer, the add is the TMA store's own
(``cp.reduce.async.bulk`` add: the operand is never staged or read by the SM);
otherwise (a fresh output, vmap, the interpreter, which has no TMA reductions) the
kernel stages the operand like any tile operand and adds it before a plain store.

Every declared output must be stored exactly once per sub-tile: the kernel checks this
at trace time, so an unwritten output is an error, not garbage.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Any, Callable

import jax
import jax.numpy as jnp
import jax.experimental.pallas.mosaic_gpu as plgpu


class InputKind(enum.Enum):
  ROW = "row"
  COL = "col"
  TILE = "tile"
  WIDE_TILE = "wide_tile"


class OutputKind(enum.Enum):
  TILE = "tile"
  ROW_PARTIAL = "row_partial"
  COL_PARTIAL = "col_partial"
  B_COLUMN_SUM = "b_column_sum"
  ROW_TOTAL = "row_total"


@dataclasses.dataclass(frozen=True)
class EpilogueOutput:
  """A declared output of an epilogue program."""
  name: str
  kind: OutputKind = OutputKind.TILE
  dtype: Any = jnp.bfloat16
  width: float = 1  # relative to N: 0.5 after a gated pair, 2 after a gated backward
  adds_to: str | None = None  # a tile operand whose values the stored ones are added to

  def __post_init__(self):
    if self.width not in (0.5, 1, 2):
      raise ValueError(f"output {self.name!r}: width must be 0.5, 1 or 2, got {self.width}")
    if self.adds_to is not None and (self.kind != OutputKind.TILE
                                     or jnp.dtype(self.dtype) != jnp.float32):
      raise ValueError(f"output {self.name!r}: adds_to={self.adds_to!r} needs a float32 "
                       f"tile output (an accumulator), got a {self.kind.value} output of "
                       f"{jnp.dtype(self.dtype)}")
    if self.kind != OutputKind.TILE and jnp.dtype(self.dtype) != jnp.float32:
      raise ValueError(f"output {self.name!r}: partial reductions are fp32")
    if self.kind in (OutputKind.ROW_PARTIAL, OutputKind.ROW_TOTAL) and self.width != 1:
      raise ValueError(f"output {self.name!r}: row partials have one value per row; "
                       "width does not apply")
    if self.kind == OutputKind.B_COLUMN_SUM and self.width != 1:
      raise ValueError(f"output {self.name!r}: B's sums over K have one value per column "
                       "of B; width does not apply")

  def scaled(self, n: int) -> int:
    """A width (or column offset, possibly traced) of n accumulator columns, as this
    output's."""
    return n * 2 if self.width == 2 else n // 2 if self.width == 0.5 else n


  def subtile_shape(self, epi_m: int, epi_n: int) -> tuple[int, ...]:
    """What ``EpilogueTile.store`` takes for this output in one (epi_m, epi_n) sub-tile."""
    if self.kind in (OutputKind.ROW_PARTIAL, OutputKind.ROW_TOTAL):
      return (epi_m,)
    width = self.scaled(epi_n)
    return (epi_m, width) if self.kind == OutputKind.TILE else (width,)


def check_input(name: str, kind: InputKind, value, m: int, n: int) -> None:
  want = {InputKind.ROW: (m,), InputKind.COL: (n,), InputKind.TILE: (m, n),
          InputKind.WIDE_TILE: (m, 2 * n)}[kind]
  if tuple(value.shape) != want:
    raise ValueError(f"operand {name!r}: a {kind.value} operand must have shape {want}, "
                     f"got {tuple(value.shape)}")


def output_shape(out: EpilogueOutput, m: int, n: int, epi_m: int, epi_n: int,
                 tile_m: int | None = None, tile_n: int | None = None):
  """The raw output's shape for an (M, N) problem: ``epi_m`` rows per column partial,
  ``epi_n`` columns per row partial, ``tile_m`` (the warpgroup tile's rows) per row of
  b_column_sum partials, and ``tile_n`` (its columns) per row-total partial."""
  if out.kind == OutputKind.TILE:
    return (m, out.scaled(n))
  if out.kind == OutputKind.ROW_PARTIAL:
    return (n // epi_n, m)
  if out.kind == OutputKind.ROW_TOTAL:
    return (n // tile_n, m)
  if out.kind == OutputKind.B_COLUMN_SUM:
    return (-(-m // tile_m), n)
  return (m // epi_m, out.scaled(n))


class EpilogueTile:
  """What an epilogue closure sees of one sub-tile. Built by the kernel."""

  def __init__(self, *, row0, col0, shape, inputs: dict[str, tuple[InputKind, Callable]],
               outputs: dict[str, tuple[EpilogueOutput, Callable]],
               column_sum: Callable | None = None,
               column_sum_writers: dict[str, Callable] | None = None,
               column_values: dict[str, Callable] | None = None):
    self.row0 = row0  # global row of the sub-tile's first element (traced int32)
    self.col0 = col0  # global column likewise
    self.shape = shape  # (epi_tile_m, epi_tile_n)
    self._inputs = inputs
    self._outputs = outputs
    self._column_sum = column_sum or (lambda x: jnp.sum(x, axis=0))
    self._column_sum_writers = column_sum_writers or {}
    self._column_values = column_values or {}
    self.stored: set[str] = set()

  def column_sum(self, x: jax.Array) -> jax.Array:
    """(epi_m, w) -> (w,): the sum over the sub-tile's rows. A sum across the
    warpgroup's warps goes through shared scratch that both compute warpgroups share;
    an epilogue that sums over rows only through this call lets the kernel make them
    take turns around each sum instead of around the whole epilogue (``gemm``'s
    ``column_sum_turns``)."""
    return self._column_sum(x)

  def column_ids(self) -> jax.Array:
    """(epi_m, epi_n) int32: the global output column of each accumulator element."""
    return plgpu.broadcasted_iota(jnp.int32, self.shape, 1,
                                  layout=plgpu.Layout.WGMMA) + self.col0

  def load(self, name: str) -> jax.Array:
    if name not in self._inputs:
      raise KeyError(f"epilogue reads operand {name!r}, but only "
                     f"{sorted(self._inputs)} were passed")
    return self._inputs[name][1]()

  def column_value(self, name: str, col: int) -> jax.Array:
    """Column operand ``name`` at column ``col`` (a Python int) of the sub-tile: one
    scalar, read from where the kernel staged the operand (the same value in every
    thread, so a branch on it does not diverge)."""
    kind = self._inputs[name][0] if name in self._inputs else None
    if kind != InputKind.COL:
      raise ValueError(f"column_value({name!r}): a col operand's, but {name!r} is "
                       f"{'not passed' if kind is None else 'a ' + kind.value + ' operand'}")
    if not 0 <= col < self.shape[1]:
      raise ValueError(f"column_value({name!r}, {col}): the sub-tile has columns "
                       f"[0, {self.shape[1]})")
    if name in self._column_values:
      return self._column_values[name](col)
    return self.load(name)[col]  # a tile over a whole matrix (not built by the kernel)

  def cond(self, pred, if_true: Callable, if_false: Callable, *args):
    """``if_true(*args)`` where the scalar ``pred`` holds, else ``if_false(*args)``;
    only the branch taken runs. ``pred`` must be the same across the sub-tile (a test of
    ``column_value``), so the warpgroup does not diverge."""
    return jax.lax.cond(pred, if_true, if_false, *args)

  def store(self, name: str, value: jax.Array) -> None:
    if name not in self._outputs:
      raise KeyError(f"epilogue stores {name!r}, but only {sorted(self._outputs)} "
                     "were declared")
    if name in self.stored:
      raise ValueError(f"epilogue stores {name!r} twice in one sub-tile")
    spec, write = self._outputs[name]
    if spec.kind == OutputKind.B_COLUMN_SUM:
      raise ValueError(f"epilogue stores {name!r}, a b_column_sum output: the mainloop "
                       "makes it; name it with tile.b_column_sum")
    want = spec.subtile_shape(*self.shape)
    if tuple(value.shape) != want:
      raise ValueError(f"epilogue stores {name!r} with shape {value.shape}, "
                       f"expected {want}")
    self.stored.add(name)
    write(value.astype(spec.dtype))

  def _output_of_kind(self, name: str, call: str, kind: OutputKind, wrong: str):
    """The declared output ``name``'s spec for ``tile.<call>``: a KeyError if it was not
    declared, a ValueError ending in ``wrong`` if it is not of ``kind``."""
    if name not in self._outputs:
      raise KeyError(f"epilogue {'names' if kind == OutputKind.B_COLUMN_SUM else 'stores'} "
                     f"{name!r}, but only {sorted(self._outputs)} were declared")
    spec, _ = self._outputs[name]
    if spec.kind != kind:
      raise ValueError(f"{call}({name!r}): a {spec.kind.value} output; {wrong}")
    return spec

  def b_column_sum(self, name: str) -> None:
    """Names output ``name`` (a ``b_column_sum`` output) as the sums of B over K that
    the mainloop makes: nothing to compute or pass here, but the program must name it
    in every sub-tile, as it stores every other output."""
    self._output_of_kind(name, "b_column_sum", OutputKind.B_COLUMN_SUM,
                         "not a b_column_sum one")
    if name in self.stored:
      raise ValueError(f"epilogue names {name!r} twice in one sub-tile")
    self.stored.add(name)

  def store_column_sum(self, name: str, value: jax.Array) -> None:
    """Stores the sum of ``value`` (epi_m, w) over its rows as column-partial output
    ``name``: ``store(name, column_sum(value))``, except that the kernel may first add
    ``value`` to the sub-tiles below it and sum once (``epi_column_sums_per_tile``)."""
    spec = self._output_of_kind(name, "store_column_sum", OutputKind.COL_PARTIAL,
                                "only col_partial outputs are sums over rows")
    want = (self.shape[0], spec.subtile_shape(*self.shape)[0])
    if tuple(value.shape) != want:
      raise ValueError(f"store_column_sum({name!r}) with shape {value.shape}, expected "
                       f"{want} (the sub-tile's rows by the output's width)")
    if name not in self._column_sum_writers:  # a closure not run by the kernel
      self.store(name, self._column_sum(value))
      return
    if name in self.stored:
      raise ValueError(f"epilogue stores {name!r} twice in one sub-tile")
    self.stored.add(name)
    self._column_sum_writers[name](value.astype(jnp.float32))


def store_main(out_name: str = "out") -> Callable[[EpilogueTile, jax.Array], None]:
  """The plain epilogue: cast the accumulator and store it."""
  def epilogue(tile: EpilogueTile, acc):
    tile.store(out_name, acc)
  return epilogue


# Loads of 1-D operands name their register layout explicitly, so that they broadcast
# against the WGMMA accumulator without a relayout.
def load_row(ref) -> jax.Array:
  return plgpu.load(ref, layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)


def load_col(ref) -> jax.Array:
  return plgpu.load(ref, layout=plgpu.Layout.WGMMA.reduce(0), optimized=False)


__all__ = ["EpilogueOutput", "EpilogueTile", "InputKind", "OutputKind", "store_main",
           "check_input", "output_shape", "load_row", "load_col"]
