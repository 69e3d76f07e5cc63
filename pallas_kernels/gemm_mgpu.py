"""Persistent, warp-specialised Hopper GEMM with a composable epilogue, in two schedules.

Cooperative (``_kernel_cooperative``, the default): one memory warpgroup streams A and B
tiles through a ``stages``-deep TMA ring into shared memory; two compute warpgroups each
own half of a CTA tile and issue wgmma into fp32 register accumulators.
Ping-pong (``_kernel_pingpong``): the compute warpgroups own whole tiles in turn, so one
warpgroup's epilogue runs under the other's mainloop (see ``Schedule``).

In both, when a tile's K loop ends, each compute warpgroup walks its
accumulator in (epi_tile_m, epi_tile_n) sub-tiles and calls the epilogue closure on each
(see ``epilogue.py``), then TMA-stores what the closure wrote. Stores are left in flight
while the next tile's mainloop starts; the memory warpgroup has already prefetched the
next tile's operands.

Operand orders: ``trans_a`` reads A stored (K, M), ``trans_b`` reads B stored (N, K);
both are fed to wgmma as transposed shared-memory views, so no transpose is materialised.
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import math
import os
import re
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels import epilogue as epi
from pallas_kernels import kernel_cache

SMEM_LIMIT_BYTES = 227 * 1024  # sm90 per-block opt-in maximum
_SMEM_RESERVE_BYTES = 2304  # barriers and alignment padding (measured: ~2.1 KiB)
_REDUCTION_SCRATCH_BYTES = 2048  # plgpu.CompilerParams.reduction_scratch_bytes default
# Mosaic GPU's on-device profiler keeps, per warpgroup, two 4-byte entries (a tag and
# the SM's cycle counter) for each end of a named region: 16 bytes a region.
_TRACE_BYTES_PER_REGION = 16
_TRACE_HEADER_ENTRIES = 3  # start time, SM id, entries used

# Where kernels built by ``gemm`` write their traces (``traced``), or None.
_trace: dict | None = None

# Pallas's "auto barriers" (``plgpu.CompilerParams.unsafe_no_auto_barriers=False``) put
# a warpgroup barrier before and after every store from registers to shared memory and
# before every TMA load a warpgroup issues. These kernels order their shared memory
# themselves, and the auto barriers only repeat that order:
# - an output slot is written after ``wait_smem_to_gmem`` (which ends with a warpgroup
#   barrier: the thread that issued the slot's last TMA store has seen it read), and
#   read by TMA after ``commit_smem`` (a proxy fence, then a warpgroup barrier);
# - an operand slot or vector buffer is refilled by TMA after ``commit_smem`` (every warp
#   has read it), and read after its mbarrier wait;
# - cross-warp sums place their own barriers (Mosaic GPU's reduction), and the
#   warpgroups' turns are mbarriers;
# - the memory warpgroup's loads follow an mbarrier wait on the stage, issued by one
#   thread.
# So the kernels are built without them (what that saves:
# docs/tuning.md#pallas-auto-barriers). Setting CODA_JAX_PALLAS_AUTO_BARRIERS=1 builds
# them with the auto barriers again (a suspected race; an A/B timing); the setting is
# part of each kernel's key (kernel_cache), so the two never share a kernel. A new
# shared-memory buffer must keep to the order above: the interpreter's race detector runs
# a warpgroup as one thread and cannot see a race between its warps (compute-sanitizer's
# racecheck on a GPU can).
AUTO_BARRIERS_ENV = "CODA_JAX_PALLAS_AUTO_BARRIERS"


def pallas_auto_barriers() -> bool:
  """Whether kernels built now keep Pallas's auto barriers (``AUTO_BARRIERS_ENV`` set to
  1); by default they do not.

  Raises:
    ValueError: if the variable is set to anything but 0 or 1.
  """
  raw = os.environ.get(AUTO_BARRIERS_ENV, "0").strip()
  if raw not in ("0", "1"):
    raise ValueError(f"{AUTO_BARRIERS_ENV}={raw!r}: set it to 1 to build kernels with "
                     "Pallas's auto barriers, or 0 (or leave it unset) to build them "
                     "without")
  return raw == "1"


@contextlib.contextmanager
def traced(directory: str, regions: int = 512, waits: bool = True):
  """Kernels that ``gemm`` builds inside this context record their named regions.

  Each warpgroup's first thread notes the SM cycle counter as it enters and leaves
  each ``jax.named_scope`` of the kernel body (``mainloop``, ``epilogue`` and the
  epilogue's waits: ``wait_turn``, ``wait_operand``, ``wait_store``; in ping-pong
  kernels also each K step's wait for its stage, ``wait_stage``, and the memory
  warpgroup's wait for a free slot, ``wait_slot``), and each call
  writes a Chrome trace (JSON) into ``directory`` (Mosaic GPU's profiler; its traces
  time regions in cycles, so read them with ``bench.kernel_trace``).

  Args:
    directory: the folder for the traces; made if missing.
    regions: at most this many regions per warpgroup, fewer where shared memory left
      over by the kernel's config holds fewer. Regions past the buffer are dropped, so
      a long kernel's trace covers its first tiles.
    waits: also note the waits inside the mainloop and the epilogue. A ping-pong tile
      notes one ``wait_stage`` per K step and two waits per epilogue sub-tile, so a
      config that leaves a few KiB of shared memory holds only a warpgroup's first two
      or three tiles: the kernel's start, not its steady state. ``waits=False`` notes
      ``mainloop`` and ``epilogue`` alone, two regions a tile.

  Only kernels that ``gemm`` builds in the context are traced: a function jitted and
  called before it keeps its compiled, untraced kernel, so trace a fresh one (as
  ``bench.compare_configs --trace`` does). Traced kernels are neither read from nor
  written to the kernel cache, and the profiler's buffer and cycle reads cost a little
  time: time kernels untraced.

  Raises:
    ValueError: no folder, or fewer than one region; and from ``gemm``, where the
      kernel's config leaves too little shared memory for one region per warpgroup.
  """
  global _trace
  if not directory:
    raise ValueError("traced(directory=...): name a folder for the traces")
  if regions < 1:
    raise ValueError(f"traced(regions={regions}): need at least one region per warpgroup")
  os.makedirs(directory, exist_ok=True)
  before, _trace = _trace, dict(directory=directory, regions=regions, waits=waits)
  try:
    yield
  finally:
    _trace = before


def _wait_scope(name: str):
  """The named region of a wait inside a mainloop or an epilogue: ``jax.named_scope``
  (which emits nothing unless the kernel is traced), or no region under
  ``traced(waits=False)``."""
  if _trace is not None and not _trace["waits"]:
    return contextlib.nullcontext()
  return jax.named_scope(name)


def _trace_params(smem_used: int, warpgroups: int) -> dict:
  """CompilerParams' profiler fields under ``traced``: as many regions per warpgroup as
  asked and as fit beside the kernel's own shared memory."""
  if _trace is None:
    return {}
  free = SMEM_LIMIT_BYTES - smem_used - _TRACE_HEADER_ENTRIES * 4 * warpgroups
  regions = min(_trace["regions"], free // (_TRACE_BYTES_PER_REGION * warpgroups))
  if regions < 1:
    raise ValueError(f"traced(): the kernel leaves {max(free, 0)} bytes of shared memory, "
                     "too few for the profiler's buffer; trace a config with fewer "
                     "stages or slots")
  return dict(profile_space=regions, profile_dir=_trace["directory"],
              profile_bounds_check=True)


class MatDim(enum.IntEnum):
  M = 0
  N = 1


class Schedule(enum.Enum):
  """How the two compute warpgroups share the tensor cores.

  COOPERATIVE: both work on one CTA tile (each owns half of it, split along
    ``wg_dim``) and share every pipeline stage; their epilogues run together while the
    tensor cores wait.
  PINGPONG: each owns a whole tile of its own, and the CTA's tiles alternate between
    them. The memory warpgroup fills one ring of stages in tile order, so one
    warpgroup's mainloop runs while the other's epilogue reads and writes memory.
  """
  COOPERATIVE = "cooperative"
  PINGPONG = "pingpong"


@dataclasses.dataclass(frozen=True)
class GemmConfig:
  """Tuning knobs, checked when the config is made.

  ``tile_m`` x ``tile_n`` is the output tile one compute warpgroup accumulates. Under
  the cooperative schedule the CTA tile is two of them side by side (along
  ``wg_dim``); under ping-pong each warpgroup works on a tile of its own. A warpgroup
  tile holds tile_m x tile_n / 128 fp32 accumulator registers a thread: 128 for the
  default 128x128, 192 for the tall 192x128 and wide 128x192 tiles, which leaves 40 for
  the epilogue. Which tiles pay where: ``docs/tuning.md#tile-shapes``; the epilogue
  fields below: ``docs/tuning.md#epilogue-staging``.

  Raises:
    ValueError: when made, for a field out of its range or fields that do not fit
      together (``check``).
  """
  tile_m: int = 128
  tile_n: int = 128
  tile_k: int = 64
  stages: int = 4
  epi_tile_m: int = 64
  epi_tile_n: int = 64
  wg_dim: MatDim = MatDim.M  # the two compute warpgroups split the CTA tile along this
  grid_minor_dim: MatDim = MatDim.N
  grid_tile_width: int = 16  # L2 reuse: tiles visited in bands this wide
  # Pair CTAs along this dim into a cluster that multicasts the operand they share
  # (cluster along M shares B tiles, along N shares A tiles), halving its L2 traffic.
  cluster_dim: MatDim | None = MatDim.N
  schedule: Schedule = Schedule.COOPERATIVE
  # Epilogue sub-tiles of each tile operand (a residual, a saved pre-activation) staged
  # in shared memory ahead of the epilogue. The first ones are loaded while the
  # mainloop runs; as many as a warpgroup tile has sub-tiles loads all of them then.
  epi_operand_slots: int = 2
  # Columns of each TMA store of a tile output: None stores whole epilogue sub-tiles;
  # a divisor of epi_tile_n into an even number of parts stages and stores each tile
  # output in parts this wide. The program still sees epi_tile_n columns at once (a
  # RoPE or QK-norm head must be whole), but its tile outputs' buffers shrink by that
  # factor, which leaves room for bigger tiles or a deeper pipeline.
  epi_store_n: int | None = None
  # Staging slots per compute warpgroup for each output stored a whole epilogue sub-tile
  # at a time. Sub-tile s writes slot s % epi_out_slots once the TMA store that last
  # read it (epi_out_slots groups back) is done, so more slots let more stores drain
  # behind the epilogue; as many as a warpgroup tile has sub-tiles never wait within a
  # tile. More than 2 has not paid; one pays only where the memory it frees buys a
  # pipeline stage (autotune._deeper_with_one_output_slot; docs/tuning.md#output-slots).
  # Outputs stored in parts (epi_store_n) share one ring of two slots per dtype and
  # part shape (_part_rings).
  epi_out_slots: int = 2
  # When the next load into a tile operand's slot is issued: True (default), as soon as
  # every warp has read the sub-tile's operands into registers (one more warpgroup
  # barrier per sub-tile), so the load runs under the sub-tile's math; False, once the
  # sub-tile's whole epilogue has run (its math and stores), when with one slot the
  # next sub-tile waits a load's whole latency. Early measured faster on 12 of 13
  # tile-operand GEMMs (docs/tuning.md#operand-refetch).
  epi_operand_refetch_early: bool = True
  # When a sub-tile waits for its output slots to be read out by the stores that last
  # used them: False (default), before its program runs; True, after it, just before
  # its outputs are written into the slots (the program's values held in registers till
  # then), so a store's read of its slot runs under the next sub-tile's math instead of
  # ahead of it. For epilogues as long as the other warpgroup's mainloop, with one
  # output slot (docs/tuning.md#the-store-wait-after-the-program). The tuner tries it
  # beside one output slot.
  epi_store_wait_late: bool = False
  # K = 0 passes only (no mainloop to load a tile's operands under): load the next
  # tile's first operand sub-tiles from the slots this tile's last ones free, and its
  # row and column operands into a second buffer, so a tile's loads run under the one
  # before it instead of at its start. Needs the slots to divide a warpgroup tile's
  # sub-tiles (each sub-tile keeps its slot from tile to tile).
  epi_prefetch_next_tile: bool = False
  # Column partials (``EpilogueOutput`` col_partial) one per warpgroup tile and column
  # block instead of one per epilogue sub-tile: the sub-tiles of a column block run one
  # after another down the tile, and a sum stored through ``tile.store_column_sum``
  # adds them in registers before the one sum across the warpgroup's warps (shuffles and
  # a round trip through shared scratch), so a tile takes tile_m / epi_tile_m times
  # fewer of those sums and partial stores. Costs one (epi_tile_m, width) fp32 value in
  # registers per such output. The partials' shape is (M // tile_m, N * width).
  epi_column_sums_per_tile: bool = False

  def __post_init__(self):
    self.check()

  @property
  def cluster_tile(self) -> tuple[int, int]:
    """The unit the grid is divided into: a CTA tile, doubled along cluster_dim."""
    cm, cn = self.cta_tile
    return (cm * (2 if self.cluster_dim == MatDim.M else 1),
            cn * (2 if self.cluster_dim == MatDim.N else 1))

  @property
  def cta_tile(self) -> tuple[int, int]:
    """The output tile one pass of the mainloop computes (one pipeline stage holds its
    operands): two warpgroup tiles when cooperative, one under ping-pong."""
    if self.schedule == Schedule.PINGPONG:
      return (self.tile_m, self.tile_n)
    return (self.tile_m * (2 if self.wg_dim == MatDim.M else 1),
            self.tile_n * (2 if self.wg_dim == MatDim.N else 1))

  def describe(self) -> str:
    """A short name for tables: schedule, warpgroup tile x K step, stages, epilogue
    sub-tile, split, cluster."""
    split = "" if self.schedule == Schedule.PINGPONG else f" wg{self.wg_dim.name}"
    cl = f" cl{self.cluster_dim.name}" if self.cluster_dim is not None else ""
    slots = f" in{self.epi_operand_slots}" if self.epi_operand_slots != 2 else ""
    slots += f" out{self.epi_out_slots}" if self.epi_out_slots != 2 else ""
    slots += " late" if not self.epi_operand_refetch_early else ""
    slots += " stlate" if self.epi_store_wait_late else ""
    slots += " next" if self.epi_prefetch_next_tile else ""
    slots += " colT" if self.epi_column_sums_per_tile else ""
    store = f"/{self.epi_store_n}" if self.epi_store_n is not None else ""
    return (f"{self.schedule.value} {self.tile_m}x{self.tile_n}x{self.tile_k} "
            f"s{self.stages} e{self.epi_tile_m}x{self.epi_tile_n}{store}{split}{cl} "
            f"{self.grid_minor_dim.name}{self.grid_tile_width}{slots}")

  @property
  def column_partial_rows(self) -> int:
    """Rows of the output that one column partial sums: a warpgroup tile's under
    ``epi_column_sums_per_tile``, else an epilogue sub-tile's."""
    return self.tile_m if self.epi_column_sums_per_tile else self.epi_tile_m

  @property
  def store_parts(self) -> int:
    """The TMA stores one tile output's epilogue sub-tile takes (1 when whole)."""
    return 1 if self.epi_store_n is None else self.epi_tile_n // self.epi_store_n

  def check(self):
    for name in ("tile_m", "tile_n", "tile_k", "epi_tile_m", "epi_tile_n"):
      v = getattr(self, name)
      if v <= 0 or v % 8:
        raise ValueError(f"GemmConfig.{name}={v} must be a positive multiple of 8")
    if self.tile_m % 64:
      raise ValueError(f"GemmConfig.tile_m={self.tile_m} must be a multiple of 64 (wgmma M)")
    if self.tile_m % self.epi_tile_m or self.tile_n % self.epi_tile_n:
      raise ValueError(f"epilogue tile ({self.epi_tile_m}, {self.epi_tile_n}) must divide "
                       f"the warpgroup tile ({self.tile_m}, {self.tile_n})")
    if self.epi_tile_m % 64:
      raise ValueError(f"GemmConfig.epi_tile_m={self.epi_tile_m} must be a multiple of 64")
    if self.stages < 2:
      raise ValueError(f"GemmConfig.stages={self.stages} must be >= 2")
    if not isinstance(self.schedule, Schedule):
      raise ValueError(f"GemmConfig.schedule={self.schedule!r}: one of "
                       f"{[s.value for s in Schedule]}")
    if self.schedule == Schedule.PINGPONG and 2 * self.stages > 32:
      raise ValueError(f"GemmConfig.stages={self.stages}: ping-pong keeps a barrier per "
                       "stage and warpgroup, at most 32; use at most 16 stages")
    subtiles = (self.tile_m // self.epi_tile_m) * (self.tile_n // self.epi_tile_n)
    for name in ("epi_operand_slots", "epi_out_slots"):
      v = getattr(self, name)
      if not 1 <= v <= max(2, subtiles):
        raise ValueError(f"GemmConfig.{name}={v}: between 1 and the {max(2, subtiles)} "
                         "sub-tiles of a warpgroup tile")
    if self.epi_store_n is not None and (
        self.epi_store_n <= 0 or self.epi_store_n % 32 or self.epi_tile_n % self.epi_store_n
        or (self.epi_tile_n // self.epi_store_n) % 2):
      raise ValueError(f"GemmConfig.epi_store_n={self.epi_store_n}: a multiple of 32 that "
                       f"splits epi_tile_n={self.epi_tile_n} into an even number of parts, "
                       "or None to store whole sub-tiles")
    if not isinstance(self.epi_operand_refetch_early, bool):
      raise ValueError(f"GemmConfig.epi_operand_refetch_early="
                       f"{self.epi_operand_refetch_early!r}: True or False")
    if not isinstance(self.epi_store_wait_late, bool):
      raise ValueError(f"GemmConfig.epi_store_wait_late={self.epi_store_wait_late!r}: "
                       "True or False")
    if not isinstance(self.epi_column_sums_per_tile, bool):
      raise ValueError(f"GemmConfig.epi_column_sums_per_tile="
                       f"{self.epi_column_sums_per_tile!r}: True or False")
    if not isinstance(self.epi_prefetch_next_tile, bool):
      raise ValueError(f"GemmConfig.epi_prefetch_next_tile={self.epi_prefetch_next_tile!r}: "
                       "True or False")
    if self.epi_prefetch_next_tile and subtiles % self.epi_operand_slots:
      raise ValueError(f"GemmConfig.epi_prefetch_next_tile=True needs epi_operand_slots="
                       f"{self.epi_operand_slots} to divide the {subtiles} sub-tiles of a "
                       "warpgroup tile (each sub-tile keeps its slot across tiles)")
    if self.grid_tile_width < 1:
      raise ValueError(f"GemmConfig.grid_tile_width={self.grid_tile_width} must be >= 1")


def _swizzle_transforms(minor_elems: int, dtype) -> tuple:
  swizzle = plgpu.find_swizzle(minor_elems * jnp.dtype(dtype).itemsize * 8)
  swizzle_elems = swizzle // jnp.dtype(dtype).itemsize
  return (plgpu.TilingTransform((8, swizzle_elems)), plgpu.SwizzleTransform(swizzle))


def smem_bytes(config: GemmConfig, dtype, input_kinds: dict, input_dtypes: dict,
               outputs: tuple[epi.EpilogueOutput, ...], *, mainloop: bool = True,
               columns: int = 0) -> int:
  """Shared memory one CTA needs for this config and epilogue program.

  Args:
    config: the kernel config.
    dtype: the operands' dtype.
    input_kinds, input_dtypes: the staged epilogue operands' kinds and dtypes by name.
    outputs: the epilogue's declared outputs.
    mainloop: False for a K = 0 problem, which has no pipeline ring.
    columns: the problem's N; sizes the buffer that gathers a row block's partials of
      each row_total output (one row per warpgroup tile across N).

  Returns:
    bytes: the pipeline ring plus exactly the buffers the epilogue allocates
    (``_Epilogue.scratch``), each rounded up to a KiB as Mosaic aligns them, plus the
    reduction scratch and the fixed reserve.
  """
  cm, cn = config.cta_tile
  total = config.stages * (cm + cn) * config.tile_k * jnp.dtype(dtype).itemsize * mainloop
  for alloc in _Epilogue.scratch(config, input_kinds, input_dtypes, outputs,
                                 operand_dtype=dtype, columns=columns).values():
    if isinstance(alloc, plgpu.Barrier):
      continue  # counted in the reserve
    # Mosaic aligns each buffer (swizzled ones to 1024 bytes): count whole KiB.
    total += -(-math.prod(alloc.shape) * jnp.dtype(alloc.dtype).itemsize // 1024) * 1024
  if any(o.kind == epi.OutputKind.COL_PARTIAL for o in outputs):
    total += _REDUCTION_SCRATCH_BYTES
  return total + _SMEM_RESERVE_BYTES


def deepest_fitting(config: GemmConfig, dtype, input_kinds: dict, input_dtypes: dict,
                    outputs: tuple[epi.EpilogueOutput, ...], *,
                    mainloop: bool = True) -> GemmConfig | None:
  """``config`` with the most stages, at most its own, whose shared memory fits; None
  if not even two stages fit. Without a mainloop (K = 0) stages mean nothing: the
  config comes back with the fewest (2) if its epilogue fits."""
  for stages in range(config.stages, 1, -1) if mainloop else (2,):
    cfg = dataclasses.replace(config, stages=stages)
    if smem_bytes(cfg, dtype, input_kinds, input_dtypes, outputs,
                  mainloop=mainloop) <= SMEM_LIMIT_BYTES:
      return cfg
  return None


def epilogue_bytes_per_element(input_kinds: dict, input_dtypes: dict,
                               outputs: tuple[epi.EpilogueOutput, ...]) -> float:
  """HBM bytes the epilogue reads and writes per accumulator element: its tile operands
  and tile outputs (row and column operands and partials are negligible)."""
  total = sum(jnp.dtype(input_dtypes[nm]).itemsize * _TILE_KINDS[kind]
              for nm, kind in input_kinds.items() if kind in _TILE_KINDS)
  return total + sum(jnp.dtype(o.dtype).itemsize * o.width for o in outputs
                     if o.kind == epi.OutputKind.TILE)


# The heuristic's tall ping-pong tiles (``_tall_tiles_pay``): 192 x 128 warpgroup tiles
# for GEMMs with a light epilogue and K up to TALL_TILE_MAX_K (0 turns them off), when
# at least TALL_TILE_MIN_STAGES pipeline stages of 64 fit, the output has at least
# TALL_TILE_MIN_OUTPUT elements, the rows the last row of tiles wastes (M clipped) are
# at most TALL_TILE_MAX_WASTE of M, and column partials carried down the tile take at
# most TALL_TILE_MAX_CARRIED_REGISTERS a thread.
TALL_TILE_M = 192
TALL_TILE_MAX_K = 2048
TALL_TILE_MIN_STAGES = 4
TALL_TILE_MIN_OUTPUT = 1 << 25
TALL_TILE_MAX_WASTE = 1 / 32
TALL_TILE_MAX_CARRIED_REGISTERS = 16


def _tall_tiles_pay(m: int, n: int, k: int, trans_a: bool, clip_m: bool, outputs) -> bool:
  """Whether the heuristic tries 192 x 128 ping-pong tiles before the cooperative ones
  (for a light epilogue; ``default_config`` asks).

  True for A stored (M, K) within the bounds of ``_large_pingpong_tiles_pay`` at K up to
  TALL_TILE_MAX_K; ``default_config`` also keeps at least TALL_TILE_MIN_STAGES stages
  and at most TALL_TILE_MAX_CARRIED_REGISTERS carried column-partial registers (a
  192-row tile's accumulators leave 40 a thread). The bounds are where they measured
  faster: ``docs/tuning.md#tall-192-x-128-ping-pong-tiles``."""
  return not trans_a and _large_pingpong_tiles_pay(m, n, k, clip_m, outputs,
                                                   max_k=TALL_TILE_MAX_K, rows=TALL_TILE_M)


def _large_pingpong_tiles_pay(m: int, n: int, k: int, clip_m: bool, outputs, *,
                              max_k: int, rows: int) -> bool:
  """The bounds the tall and the wide ping-pong tiles share (both hold 192
  accumulators a thread): K up to ``max_k``, an output of at least TALL_TILE_MIN_OUTPUT
  elements, no B column sums (not measured), and rows of ``rows`` that tile M exactly
  or clipped with at most TALL_TILE_MAX_WASTE of M past its end."""
  if k > max_k or m * n < TALL_TILE_MIN_OUTPUT:
    return False
  if any(o.kind == epi.OutputKind.B_COLUMN_SUM for o in outputs):
    return False
  if m % rows == 0:
    return True
  padded = -(-m // rows) * rows
  return clip_m and (padded - m) <= TALL_TILE_MAX_WASTE * m


# The heuristic's wide tiles: 128 x WIDE_TILE_N warpgroup tiles. Two m64n192 wgmmas a K
# step read 0.67 bytes of shared memory per multiply, against 0.75 for 128-wide tiles
# (docs/tuning.md#wide-128-x-192-tiles). Ping-pong (``_wide_pingpong_pays``): for GEMMs
# with a light epilogue, N a multiple of WIDE_TILE_N, K up to WIDE_PINGPONG_MAX_K (0
# turns them off), A in either order (WIDE_PINGPONG_TRANS_A = 0 keeps them to A stored
# (M, K)), and the tall tiles' bounds on output size, clipped rows, stages and carried
# registers. Cooperative (``_wide_cooperative_pays``): 256 x WIDE_TILE_N CTA tiles where
# their rounds of tiles over HEURISTIC_NUM_SMS SMs, 1.5x as long each, take at most
# (1 + WIDE_COOPERATIVE_GAIN) the 256 x 128 tiles' time (a negative gain turns them off).
# Heavy epilogues (``_wide_heavy_pays``): ping-pong tiles clustered along N, K up to
# WIDE_HEAVY_MAX_K (0 turns them off), where their rounds are no longer.
WIDE_TILE_N = 192
WIDE_ROWS = 256  # rows the rules count in: a ping-pong cluster along M, a cooperative CTA
WIDE_PINGPONG_MAX_K = 4096
WIDE_PINGPONG_TRANS_A = 1
WIDE_COOPERATIVE_GAIN = 0.03
WIDE_HEAVY_MAX_K = 2048
HEURISTIC_NUM_SMS = 132  # H100 SXM and H200; the heuristic is a function of shape only


def _wide_pingpong_pays(m: int, n: int, k: int, trans_a: bool, clip_m: bool,
                        outputs) -> bool:
  """Whether the heuristic tries 128 x 192 ping-pong tiles in clusters along M (a 256 x
  192 cluster tile multicasting the wider B tile) first, for a light epilogue, A in
  either order.

  True where N is a multiple of WIDE_TILE_N, A's order is allowed
  (WIDE_PINGPONG_TRANS_A), and the tall tiles' bounds (``_large_pingpong_tiles_pay``)
  hold at K up to WIDE_PINGPONG_MAX_K with rows counted in clusters of WIDE_ROWS.
  Evidence: ``docs/tuning.md#wide-128-x-192-tiles``."""
  if n % WIDE_TILE_N or (trans_a and not WIDE_PINGPONG_TRANS_A):
    return False
  return _large_pingpong_tiles_pay(m, n, k, clip_m, outputs, max_k=WIDE_PINGPONG_MAX_K,
                                   rows=WIDE_ROWS)


def _wide_heavy_pays(m: int, n: int, k: int, clip_m: bool, outputs) -> bool:
  """Whether the heuristic tries 128 x 192 ping-pong tiles in clusters along N before
  the 128 x 128 ones it gives a heavy epilogue (one that moves more than ~4 bytes an
  element per 2048 of K): N a multiple of 192, K up to WIDE_HEAVY_MAX_K (0 turns them
  off), rounds of tiles over the SMs no longer than the 128 x 128 tiles'
  (``_wide_rounds_pay`` with no gain), and the tall tiles' other bounds
  (``_large_pingpong_tiles_pay``; ``default_config`` keeps their 4 stages, which a
  program with a wide tile operand, the SwiGLU backward's z, does not fit).
  Evidence: ``docs/tuning.md#wide-128-x-192-tiles``."""
  if n % WIDE_TILE_N:
    return False
  return (_wide_rounds_pay(-(-m // 128), n, gain=0.0)
          and _large_pingpong_tiles_pay(m, n, k, clip_m, outputs, max_k=WIDE_HEAVY_MAX_K,
                                        rows=128))


def _wide_rounds_pay(rows: int, n: int, gain: float) -> bool:
  """Whether ``rows`` rows of tiles 192 wide take at most (1 + gain) the time of the same
  rows of 128-wide tiles over N, counted in rounds of tiles over HEURISTIC_NUM_SMS SMs,
  a wide tile 1.5x a narrow one's time: where the rounds come out level the wide tiles
  win by what their fewer shared-memory reads save, where they save a round by more,
  and where they add part of a round they lose."""
  narrow = -(-rows * -(-n // 128) // HEURISTIC_NUM_SMS)
  wide = -(-rows * (n // WIDE_TILE_N) // HEURISTIC_NUM_SMS)
  return wide * (WIDE_TILE_N / 128) <= narrow * (1 + gain)


def _wide_cooperative_pays(m: int, n: int) -> bool:
  """Whether the heuristic tries 256 x 192 cooperative CTA tiles before 256 x 128 ones:
  where their rounds of tiles favour them by WIDE_COOPERATIVE_GAIN
  (``_wide_rounds_pay``; a negative gain turns them off). Evidence:
  ``docs/tuning.md#wide-128-x-192-tiles``."""
  if n % WIDE_TILE_N or WIDE_COOPERATIVE_GAIN < 0:
    return False
  return _wide_rounds_pay(-(-m // WIDE_ROWS), n, WIDE_COOPERATIVE_GAIN)


def default_config(m: int, n: int, k: int, dtype=jnp.bfloat16, *, input_kinds=None,
                   input_dtypes=None, outputs=(), min_epi_tile_n: int = 1,
                   trans_a: bool = False, trans_b: bool = False,
                   clip_m: bool = False) -> GemmConfig:
  """Per-shape defaults: the largest tiles that divide the problem and fit in SMEM.

  The heuristic (each rule and what it was measured against: ``docs/tuning.md``,
  "Schedule" and "Tile shapes"): cooperative 256x128 CTA tiles (the warpgroups split M)
  in clusters of two along N that multicast A, the grid N-minor in bands of 16.
  Epilogues that move many bytes per element for their K (see
  ``epilogue_bytes_per_element``) get the ping-pong schedule first; large problems with
  a light epilogue and K up to 2048 get tall 192 x 128 ping-pong tiles first where 4
  stages fit (``_tall_tiles_pay``), and where N is a multiple of 192 wide 128 x 192 ones
  before those, up to K = 4096 (``_wide_pingpong_pays``), as do heavy epilogues up to
  K = 2048 where the rounds of tiles over the SMs are no longer (``_wide_heavy_pays``);
  cooperative tiles are 256 x 192 first where those rounds favour them
  (``_wide_cooperative_pays``). Programs with column partials carry them down the
  warpgroup tile (``epi_column_sums_per_tile``) where that takes few registers
  (``COLUMN_SUMS_PER_TILE_MAX_REGISTERS``). The tuning cache (``autotune``) overrides
  all of this where it has the problem.
  ``trans_a`` / ``not trans_b`` (MN-major operands) need tile_k a multiple of 64.

  Args:
    m, n, k: the problem; dtype: the operands' dtype.
    input_kinds, input_dtypes, outputs: the epilogue's staged operands and outputs.
    min_epi_tile_n: the epilogue sub-tile width must be a multiple of this (the pair
      block of a pairwise epilogue).
    trans_a, trans_b: the operands' storage orders.
    clip_m: M need not be a multiple of the tile (``gemm``'s ``clip_m``).

  Returns:
    a ``GemmConfig`` that tiles the problem and fits in shared memory.

  Raises:
    ValueError: no config tiles the problem.
  """
  input_kinds = input_kinds or {}
  input_dtypes = input_dtypes or {}
  sums_b = any(o.kind == epi.OutputKind.B_COLUMN_SUM for o in outputs)
  if clip_m and m % CLIP_M_MULTIPLE:
    raise ValueError(f"M={m}: clip_m needs M to be a multiple of {CLIP_M_MULTIPLE}")
  if k == 0:
    return _no_product_config(m, n, dtype, input_kinds, input_dtypes, outputs, min_epi_tile_n,
                              clip_m)
  cooperative = [  # (tile_m, tile_n, wg_dim, cluster_dim), fastest first
      (128, 128, MatDim.M, MatDim.N), (128, 128, MatDim.M, None), (128, 128, MatDim.N, None),
      (128, 64, MatDim.N, None), (64, 128, MatDim.M, None), (64, 64, MatDim.N, None),
      (64, 32, MatDim.N, None), (128, 64, MatDim.M, None), (64, 64, MatDim.M, None)]
  if _wide_cooperative_pays(m, n):
    cooperative[:0] = [(128, WIDE_TILE_N, MatDim.M, MatDim.M),
                       (128, WIDE_TILE_N, MatDim.M, MatDim.N)]
  candidates = [(Schedule.COOPERATIVE, *c) for c in cooperative]
  if epilogue_bytes_per_element(input_kinds, input_dtypes, outputs) * 2048 / k > 4:
    # The epilogue moves more than ~4 bytes per output element per 2048 of K: ping-pong
    # hides it under the other warpgroup's mainloop, which pays for its slower mainloop
    # (docs/tuning.md#schedule-cooperative-or-ping-pong). Deep rings before wide
    # epilogue sub-tiles, as below.
    candidates.insert(0, (Schedule.PINGPONG, 128, 128, MatDim.M, MatDim.N))
    if _wide_heavy_pays(m, n, k, clip_m, outputs):
      candidates.insert(0, (Schedule.PINGPONG, 128, WIDE_TILE_N, MatDim.M, MatDim.N))
  else:
    if _tall_tiles_pay(m, n, k, trans_a, clip_m, outputs):
      candidates.insert(0, (Schedule.PINGPONG, TALL_TILE_M, 128, MatDim.M, MatDim.N))
    if _wide_pingpong_pays(m, n, k, trans_a, clip_m, outputs):
      candidates.insert(0, (Schedule.PINGPONG, 128, WIDE_TILE_N, MatDim.M, MatDim.M))
  # (tile_k, stages), deepest K in flight first: with a large epilogue, more stages of a
  # shorter K step beat fewer long ones (docs/tuning.md#pipeline-depth).
  depths = [(64, 4), (64, 3), (32, 6), (32, 5), (32, 4), (64, 2), (32, 3), (16, 6), (16, 4),
            (32, 2), (16, 2)]
  if trans_a or not trans_b:  # MN-major operands need tile_k = 64
    depths = [(tk, st) for tk, st in depths if tk == 64]
  for schedule, tm, tn, wg, cl in candidates:
    stage_depths = depths
    if schedule == Schedule.PINGPONG:  # its stages hold half as much: more of them
      stage_depths = [(64, st) for st in (5, 4, 3)]
    wide_or_tall = tm == TALL_TILE_M or tn == WIDE_TILE_N
    if wide_or_tall and schedule == Schedule.PINGPONG:
      # fewer than TALL_TILE_MIN_STAGES lost (_tall_tiles_pay)
      stage_depths = [(64, st) for st in range(5, TALL_TILE_MIN_STAGES - 1, -1)]
    elif wide_or_tall:  # 256 x 192 CTA tiles: three stages of 64 fit, four do not
      stage_depths = [(64, 3)]
    for tk, stages in stage_depths:
      probe = GemmConfig(tile_m=tm, tile_n=tn, tile_k=tk, wg_dim=wg, cluster_dim=cl,
                         epi_tile_n=min(64, tn), schedule=schedule)
      cm, cn = probe.cluster_tile
      if _split_b_too_narrow(probe, trans_b) or k % tk or (m % cm and not clip_m) or n % cn:
        continue
      if sums_b and b_column_sum_conflict(probe):
        continue
      # Pipeline depth matters more than epilogue sub-tile width: try narrower sub-tiles
      # (smaller epilogue buffers) before fewer stages.
      # 32-wide sub-tiles under 128 x 192 cooperative tiles too: level with 64-wide or
      # faster (docs/tuning.md#epilogue-sub-tile-shapes).
      for en in ((32,) if schedule == Schedule.PINGPONG or wide_or_tall
                 else (64, 32, 16)):
        en = max(min(en, tn), min_epi_tile_n)
        if tn % en or en % min_epi_tile_n:
          continue
        for store_n in store_widths(en):
          cfg = dataclasses.replace(probe, epi_tile_n=en, stages=stages, epi_store_n=store_n)
          if wide_or_tall and (carried_column_registers(cfg, outputs)
                               > TALL_TILE_MAX_CARRIED_REGISTERS):
            continue
          if smem_bytes(cfg, dtype, input_kinds, input_dtypes, outputs) <= SMEM_LIMIT_BYTES:
            return _column_sums_per_tile_if_cheap(cfg, outputs)
  raise ValueError(f"no GEMM tiling divides (M, N, K)=({m}, {n}, {k}) with an epilogue "
                   f"width that is a multiple of {min_epi_tile_n}: M and N must be "
                   "multiples of 64, and one of them of 128 when B is stored (K, N); K of "
                   "64 (of 16 with A (M, K) and B (N, K)); the epilogue's buffers must fit "
                   "in shared memory")


# The most fp32 registers per thread that carried column partials may take for the
# heuristic to turn on ``epi_column_sums_per_tile``: (epi_tile_m x width) per output over
# a warpgroup's 128 threads. Up to 32 paid or ran level, 64 ran much slower
# (docs/tuning.md#column-sums-per-tile).
COLUMN_SUMS_PER_TILE_MAX_REGISTERS = 32


def carried_column_registers(cfg: GemmConfig, outputs) -> int:
  """fp32 registers per thread that ``epi_column_sums_per_tile`` carries down a tile:
  one (epi_tile_m, width) value per column-partial output, over 128 threads."""
  return sum(cfg.epi_tile_m * o.scaled(cfg.epi_tile_n) for o in outputs
             if o.kind == epi.OutputKind.COL_PARTIAL) // 128


def can_carry_column_sums(cfg: GemmConfig, outputs) -> bool:
  """Whether ``epi_column_sums_per_tile`` changes anything for this program under
  ``cfg``: it has column partials and a warpgroup tile has more than one row of
  sub-tiles to add."""
  return (cfg.tile_m > cfg.epi_tile_m
          and any(o.kind == epi.OutputKind.COL_PARTIAL for o in outputs))


def _column_sums_per_tile_if_cheap(cfg: GemmConfig, outputs) -> GemmConfig:
  """The heuristic's choice of ``epi_column_sums_per_tile``: on where the program has
  column partials, a warpgroup tile has more than one sub-tile down it, and the carried
  sums take at most ``COLUMN_SUMS_PER_TILE_MAX_REGISTERS``."""
  if (can_carry_column_sums(cfg, outputs)
      and carried_column_registers(cfg, outputs) <= COLUMN_SUMS_PER_TILE_MAX_REGISTERS):
    return dataclasses.replace(cfg, epi_column_sums_per_tile=True)
  return cfg


def _no_product_config(m, n, dtype, input_kinds, input_dtypes, outputs,
                       min_epi_tile_n, clip_m=False) -> GemmConfig:
  """K = 0 (``_kernel_no_product``): no ring to share shared memory with and nothing to
  multicast, so the largest warpgroup tiles whose epilogue buffers fit, unclustered;
  each warpgroup's tile operands are staged two sub-tiles ahead (a whole 128x128 tile
  of 128-wide sub-tiles, the QK-norm backward's)."""
  for tm, tn, wg in ((128, 128, MatDim.M), (128, 128, MatDim.N), (64, 128, MatDim.M),
                     (128, 64, MatDim.N), (64, 64, MatDim.M), (64, 64, MatDim.N)):
    for en in (64, 32, 16):
      en = max(min(en, tn), min_epi_tile_n)
      if tn % en or en % min_epi_tile_n:
        continue
      for store_n in store_widths(en):
        cfg = GemmConfig(tile_m=tm, tile_n=tn, stages=2, epi_tile_n=en, wg_dim=wg,
                         cluster_dim=None, epi_store_n=store_n)
        cm, cn = cfg.cta_tile
        if (m % cm and not clip_m) or n % cn:
          continue
        if smem_bytes(cfg, dtype, input_kinds, input_dtypes, outputs,
                      mainloop=False) <= SMEM_LIMIT_BYTES:
          return _column_sums_per_tile_if_cheap(cfg, outputs)
  raise ValueError(f"no tiling divides (M, N)=({m}, {n}) of this K = 0 epilogue pass with "
                   f"an epilogue width that is a multiple of {min_epi_tile_n}: M and N must "
                   "be multiples of 64 and the epilogue's buffers must fit in shared memory")


def interpret_params():
  """Mosaic GPU's CPU interpreter, for tests on machines without a Hopper GPU.

  Returns:
    ``plgpu.InterpretGPUParams()``, to pass as ``gemm``'s ``interpret``.
  """
  return plgpu.InterpretGPUParams()


def check_operands(a, b, trans_a=False, trans_b=False,
                   dtypes=(jnp.bfloat16, jnp.float16)) -> tuple[int, int, int]:
  """Validates GEMM operands.

  Args:
    a: (M, K), or (K, M) with ``trans_a``.
    b: (K, N), or (N, K) with ``trans_b``.
    dtypes: the dtypes allowed (both operands share one).

  Returns:
    (M, N, K).

  Raises:
    ValueError: naming the rank, dtype or K mismatch.
  """
  if a.ndim != 2 or b.ndim != 2:
    raise ValueError(f"a and b must be 2-D, got a.shape={a.shape}, b.shape={b.shape}")
  if a.dtype != b.dtype:
    raise ValueError(f"a and b must share a dtype, got {a.dtype} and {b.dtype}")
  if a.dtype not in dtypes:
    raise ValueError(f"a.dtype={a.dtype}: expected one of {[jnp.dtype(d).name for d in dtypes]}")
  m, k = a.shape[::-1] if trans_a else a.shape
  k2, n = b.shape[::-1] if trans_b else b.shape
  if k != k2:
    raise ValueError(f"contracting dims differ: a gives K={k} ({'(K, M)' if trans_a else '(M, K)'}"
                     f" layout), b gives K={k2} ({'(N, K)' if trans_b else '(K, N)'} layout)")
  return m, n, k


def _split_b_too_narrow(config: GemmConfig, trans_b: bool) -> bool:
  # B stored (K, N) is swizzled in 64-column tiles: the warpgroups can only split it
  # along N at multiples of 64.
  return (config.schedule == Schedule.COOPERATIVE and config.wg_dim == MatDim.N
          and not trans_b and config.tile_n % 64 != 0)


CLIP_M_MULTIPLE = 8  # rows: M * 2 bytes (A stored (K, M)) must be a 16-byte stride for TMA


def _check_tiling(m, n, k, config: GemmConfig, trans_a: bool, trans_b: bool,
                  clip_m: bool = False):
  """Raises ValueError unless ``config`` tiles (M, N, K). With ``clip_m`` M need not be
  a multiple of the cluster tile (``gemm``'s ``clip_m``), only of ``CLIP_M_MULTIPLE``."""
  if _split_b_too_narrow(config, trans_b):
    raise ValueError(f"tile_n={config.tile_n} with wg_dim=N and B stored (K, N): the "
                     "warpgroups' halves of B must be multiples of 64 columns")
  if (trans_a or not trans_b) and config.tile_k % 64:
    raise ValueError(f"tile_k={config.tile_k}: an operand stored MN-major (A as (K, M) or "
                     "B as (K, N)) needs tile_k to be a multiple of 64 for wgmma")
  if k == 0 and (config.schedule != Schedule.COOPERATIVE or config.cluster_dim is not None):
    raise ValueError(f"K=0 runs the epilogue alone (no mainloop, nothing to multicast or "
                     f"to hide it under): use schedule=cooperative and cluster_dim=None, "
                     f"not {config.describe()}")
  cm, cn = config.cluster_tile
  if clip_m and m % CLIP_M_MULTIPLE:
    raise ValueError(f"M={m}: clip_m needs M to be a multiple of {CLIP_M_MULTIPLE} (TMA's "
                     "16-byte strides); pad M to one")
  if (m % cm and not clip_m) or n % cn or k % config.tile_k:
    raise ValueError(f"(M, N, K)=({m}, {n}, {k}) must be multiples of the cluster tile "
                     f"({cm}, {cn}, {config.tile_k}) of {config}"
                     + ("" if clip_m else " (M need not be with clip_m)"))


def store_widths(epi_tile_n: int) -> tuple[int | None, ...]:
  """The ``epi_store_n`` values worth trying for sub-tiles this wide, whole first: a
  sub-tile wider than 64 (a 128-wide RoPE or QK-norm head, which must stay whole) may
  also store its tile outputs in 64-column halves, which halves their buffers."""
  return (None, 64) if epi_tile_n > 64 else (None,)


def b_column_sum_conflict(cfg: GemmConfig) -> str | None:
  """Why ``cfg`` cannot make a b_column_sum output (None when it can). Its wgmma reads a
  warpgroup's columns of B's stage tile as the A operand, so they must be a multiple of
  wgmma's 64 rows. That tile and the ones column then share a swizzle, as one wgmma's
  operands must: B stored (N, K) and the ones are both swizzled by their rows of tile_k;
  B stored (K, N) by rows of at least 64 16-bit columns (128 bytes), and the ones by
  tile_k, which an operand stored so makes a multiple of 64 (``_check_tiling``)."""
  if cfg.tile_n % 64:
    return f"tile_n={cfg.tile_n} is not a multiple of 64 (wgmma's M)"
  return None


def row_totals_conflict(cfg: GemmConfig, n: int, num_clusters: int) -> str | None:
  """Why ``cfg`` cannot make row_total outputs for an N-column problem on a grid of
  ``num_clusters`` (None when it can). A warpgroup tile publishes its partials, then
  waits until every tile of its row block has: that cannot deadlock only when each CTA
  takes its tiles in increasing order and the tiles of a row block come one after
  another in that order, on different CTAs (``docs/layernorm_math.md`` section 6). So:
  the ping-pong schedule (whose warpgroups own whole tiles), the grid walked row block
  by row block (``grid_minor_dim`` N, one band as wide as the row), and no more tiles
  along N than the grid has clusters."""
  n_iters = n // cfg.cluster_tile[1]
  if cfg.schedule != Schedule.PINGPONG:
    return ("the cooperative schedule splits a tile between two warpgroups that would "
            "wait for each other; use schedule=Schedule.PINGPONG")
  if cfg.grid_minor_dim != MatDim.N or cfg.grid_tile_width < n_iters:
    return (f"the grid must visit each row block's {n_iters} tiles one after another: "
            f"grid_minor_dim=MatDim.N and grid_tile_width >= {n_iters}, got "
            f"{cfg.grid_minor_dim.name} and {cfg.grid_tile_width}")
  if n_iters > num_clusters:
    return (f"a row block has {n_iters} tiles along N but the grid only {num_clusters} "
            "clusters, so one CTA would wait for a tile it has yet to run; use wider "
            "tiles or more SMs")
  return None


def row_totals_pass_reads(row_totals_pass: Callable, input_kinds: dict, input_dtypes: dict,
                          outputs, cfg: GemmConfig) -> tuple[str, ...]:
  """The tile operands (names, in ``input_kinds``'s order) that a program's first pass
  reads: the kernel stages only these for it (``_Epilogue._staged``), the second pass
  all of them. Found by tracing the pass once on stand-in values (``jax.eval_shape``, no
  device work); a pass that cannot be traced so (one that calls into the kernel itself)
  gets every tile operand, which costs loads and never values."""
  em, en = cfg.epi_tile_m, cfg.epi_tile_n
  shapes = {epi.InputKind.ROW: (em,), epi.InputKind.COL: (en,),
            epi.InputKind.TILE: (em, en), epi.InputKind.WIDE_TILE: (em, 2 * en)}
  tiles = tuple(nm for nm, kd in input_kinds.items() if kd in _TILE_KINDS)
  adds_to = {o.adds_to for o in outputs}
  read = set()

  def stand_in(nm, kind):
    def load():
      read.add(nm)
      return jnp.zeros(shapes[kind], input_dtypes[nm])
    return load

  def first_pass(acc):
    tile = epi.EpilogueTile(
        row0=0, col0=0, shape=(em, en),
        inputs={nm: (kd, stand_in(nm, kd)) for nm, kd in input_kinds.items()
                if nm not in adds_to},
        outputs={o.name: (o, lambda value: None) for o in outputs
                 if o.kind == epi.OutputKind.ROW_TOTAL},
        column_sum=_Epilogue._no_column_sums)
    row_totals_pass(tile, acc)

  try:
    jax.eval_shape(first_pass, jax.ShapeDtypeStruct((em, en), jnp.float32))
  except Exception:  # pylint: disable=broad-except  (stage all: slower, still right)
    return tiles
  return tuple(nm for nm in tiles if nm in read)


def _stored_width(cfg: GemmConfig, o: epi.EpilogueOutput) -> int:
  """Accumulator columns one TMA store of ``o`` covers: tile outputs are stored in
  ``cfg.store_parts`` parts, partials whole."""
  split = cfg.epi_store_n is not None and o.kind == epi.OutputKind.TILE
  return cfg.epi_store_n if split else cfg.epi_tile_n


def staged_inputs(input_kinds: dict, outputs, in_place: dict, compiled: bool = True) -> dict:
  """The operands (name -> kind) the kernel stages in shared memory for its epilogue:
  all but those that an output adds to in place (``EpilogueOutput.adds_to``), where the
  compiled kernel's TMA store does the add (the interpreter has no TMA reductions)."""
  by_store = {o.adds_to for o in outputs if o.adds_to and compiled
              and in_place.get(o.name) == o.adds_to}
  return {nm: kind for nm, kind in input_kinds.items() if nm not in by_store}


# Compute warpgroups per CTA: epilogue buffers have one half per warpgroup.
_COMPUTE_WARPGROUPS = 2


def _vec_slots(cfg) -> int:
  """Buffers per warpgroup for each row or column operand (``_Epilogue.vec_slot``)."""
  return 2 if cfg.epi_prefetch_next_tile else 1


# Staging slots of the ring that outputs stored in parts (``GemmConfig.epi_store_n``)
# take turns through: their parts alternate between two (``_Epilogue._store_in_parts``).
_PART_SLOTS = 2


def _part_rings(cfg: GemmConfig, outputs) -> dict[str, str]:
  """Output name -> the scratch name of the staging ring its parts go through, for each
  output stored in parts (``GemmConfig.epi_store_n``): one ring per parts' dtype and
  shape, ``parts_<dtype>_<rows>x<columns>``.

  Outputs whose parts have one dtype and shape share one ring of ``_PART_SLOTS``
  slots per warpgroup. That is safe because every part store is its own store group
  and every output has an even number of parts: part h of any output takes slot
  h % 2, which the store two groups back took, whichever output that was, and the
  store waits until at most one group is in flight. A shared ring frees shared memory
  for larger tiles or more stages (docs/tuning.md#outputs-stored-in-parts).
  """
  rings = {}
  for o in outputs:
    width = _stored_width(cfg, o)
    if width != cfg.epi_tile_n:
      shape = o.subtile_shape(cfg.epi_tile_m, width)
      rings[o.name] = f"parts_{jnp.dtype(o.dtype).name}_{'x'.join(map(str, shape))}"
  return rings


# Columns of the ones operand that B's tiles are multiplied with for a b_column_sum output:
# wgmma's narrowest N. The kernel gets the ones as an extra operand under this name.
_ONES_COLUMNS = 8
_ONES_OPERAND = "_b_column_sum_ones"

# Tile operand kinds and their width in accumulator sub-tile widths.
_TILE_KINDS = {epi.InputKind.TILE: 1, epi.InputKind.WIDE_TILE: 2}


class _Epilogue:
  """One compute warpgroup's epilogue machinery: staging of extra
  operands, the sub-tile walk that calls the closure, and the TMA stores."""

  def __init__(self, cfg, in_gmem, out_gmem, input_kinds, outputs, epilogue, smem, wg,
               column_sum_turns=False, row_totals_pass=None, semaphores=None, columns=0,
               first_pass_tiles=()):
    self.cfg, self.in_gmem, self.out_gmem = cfg, in_gmem, out_gmem
    self.kinds, self.outputs, self.fn, self.smem, self.wg = (
        input_kinds, outputs, epilogue, smem, wg)
    self.tiles_in = [nm for nm, kd in input_kinds.items() if kd in _TILE_KINDS]
    self.vecs_in = [nm for nm, kd in input_kinds.items() if kd not in _TILE_KINDS]
    em, en = cfg.epi_tile_m, cfg.epi_tile_n
    rows, cols = range(cfg.tile_m // em), range(cfg.tile_n // en)
    # Column partials per warpgroup tile: each column block's sub-tiles run down the
    # tile in turn, so one running sum a partial output carries them (``_tile``).
    self.per_tile = cfg.epi_column_sums_per_tile
    self.sub_tiles = ([(i, j) for j in cols for i in rows] if self.per_tile
                      else [(i, j) for i in rows for j in cols])
    self.last_row = len(rows) - 1
    self.running: dict[str, jax.Array] = {}  # column partials carried down the tile
    self.in_slots, self.out_slots = cfg.epi_operand_slots, cfg.epi_out_slots
    # Row and column operands: one buffer, or two that alternate by tile when the next
    # tile's are loaded ahead (epi_prefetch_next_tile). ``vec_slot`` is the current one.
    self.vec_slots = _vec_slots(cfg)
    self.vec_slot = 0
    # Outputs staged whole, one sub-tile per slot and one store group per sub-tile; the
    # rest (tile outputs, when the config splits stores) are stored part by part from
    # inside ``tile.store``, through their ring (``rings``: output name -> scratch name).
    self.rings = _part_rings(cfg, outputs)
    self.whole = [o for o in outputs if o.name not in self.rings
                  and o.kind not in (epi.OutputKind.B_COLUMN_SUM, epi.OutputKind.ROW_TOTAL)]
    # Row totals (row_total outputs): the first pass's partials, carried across the
    # tile's columns by (name, row of sub-tiles); the tiles across N per row block; the
    # semaphore per row block; the totals read back, by (name, row of sub-tiles).
    self.totals = [o for o in outputs if o.kind == epi.OutputKind.ROW_TOTAL]
    self.totals_pass, self.semaphores = row_totals_pass, semaphores
    # The tile operands the first pass reads (``row_totals_pass_reads``): its share of
    # the staging sequence stages only these.
    self.first_tiles = [nm for nm in self.tiles_in if nm in first_pass_tiles]
    self.total_tiles = columns // cfg.tile_n
    self.partials: dict[tuple[str, int], jax.Array] = {}
    self.read_totals: dict[tuple[str, int], jax.Array] = {}
    # The sums of B over K (a b_column_sum output), made in the mainloop, or None.
    self.b_sum = next((o for o in outputs if o.kind == epi.OutputKind.B_COLUMN_SUM), None)
    # Column sums use compiler-placed shared scratch at one offset, the same for both
    # warpgroups. Cooperative epilogues run at once, so they take turns: around each
    # sum when the epilogue sums only through tile.column_sum, else around the whole
    # epilogue. (Ping-pong epilogues alternate anyway: ``run``.)
    self.sum_turns = (column_sum_turns and "turn" in smem
                      and cfg.schedule == Schedule.COOPERATIVE)
    # Outputs that add to an operand (``EpilogueOutput.adds_to``): where the operand is
    # staged, its sub-tile is added in registers before the store; where it is not (the
    # output is written in place into it), the TMA store itself adds.
    self.adds = {o.name: o.adds_to for o in outputs if o.adds_to in input_kinds}
    self.reduces = {o.name for o in outputs if o.adds_to and o.adds_to not in input_kinds}
    self.readable = {nm: kd for nm, kd in input_kinds.items()
                     if nm not in {o.adds_to for o in outputs}}

  @staticmethod
  def scratch(cfg, input_kinds, input_dtypes, outputs, operand_dtype=jnp.bfloat16,
              columns=0, first_pass_tiles=()) -> dict:
    em, en = cfg.epi_tile_m, cfg.epi_tile_n
    out = {}
    totals = [o for o in outputs if o.kind == epi.OutputKind.ROW_TOTAL]
    rings = _part_rings(cfg, outputs)
    for o in totals:
      # This tile's partials, staged for their TMA store: one buffer per warpgroup (the
      # exchange's publish runs outside the ping-pong turn). The row block's, loaded
      # back: one buffer for both (they are gathered and read inside the turn).
      out["t_" + o.name] = plgpu.SMEM((_COMPUTE_WARPGROUPS, cfg.tile_m), jnp.float32)
      out["x_" + o.name] = plgpu.SMEM((max(columns // cfg.tile_n, 1), cfg.tile_m),
                                      jnp.float32)
    if totals:
      out["x_bar"] = plgpu.Barrier(num_arrivals=len(totals),
                                   num_barriers=_COMPUTE_WARPGROUPS)
    if totals and first_pass_tiles:
      # The first pass's staging (``_staged``): a TMA barrier counts one arrival per
      # copy, and that pass copies fewer operands than the second.
      out["first_bar"] = plgpu.Barrier(
          num_arrivals=len(first_pass_tiles),
          num_barriers=_COMPUTE_WARPGROUPS * cfg.epi_operand_slots)
    for o in outputs:
      if o.kind == epi.OutputKind.ROW_TOTAL:
        continue
      if o.kind == epi.OutputKind.B_COLUMN_SUM:
        # [warpgroup, column of its tile]: the sums, staged for one TMA store; and the
        # ones column (8 wide, wgmma's narrowest N) that B's tiles are multiplied with
        out["o_" + o.name] = plgpu.SMEM((_COMPUTE_WARPGROUPS, cfg.tile_n), jnp.float32)
        out["b_ones"] = plgpu.SMEM((_COMPUTE_WARPGROUPS, _ONES_COLUMNS, cfg.tile_k),
                                   operand_dtype,
                                   transforms=_swizzle_transforms(cfg.tile_k, operand_dtype))
        out["b_ones_bar"] = plgpu.Barrier(num_arrivals=1, num_barriers=_COMPUTE_WARPGROUPS)
        continue
      # [warpgroup, slot, *sub-tile]; outputs stored in parts: one ring per dtype and
      # part shape, [warpgroup, slot, *part] (``_part_rings``)
      name = rings.get(o.name, "o_" + o.name)
      if name in out:
        continue  # a ring that an earlier output's parts go through too
      shape = o.subtile_shape(em, _stored_width(cfg, o))
      slots = _PART_SLOTS if o.name in rings else cfg.epi_out_slots
      # 2-D tiles are TMA-stored through swizzled SMEM; 1-D partials need no swizzle.
      transforms = _swizzle_transforms(shape[-1], o.dtype) if len(shape) == 2 else ()
      out[name] = plgpu.SMEM((_COMPUTE_WARPGROUPS, slots, *shape), o.dtype,
                             transforms=transforms)
    tiles = [nm for nm, kd in input_kinds.items() if kd in _TILE_KINDS]
    vecs = [nm for nm, kd in input_kinds.items() if kd not in _TILE_KINDS]
    for nm in tiles:
      dt, w = input_dtypes[nm], en * _TILE_KINDS[input_kinds[nm]]
      out["i_" + nm] = plgpu.SMEM((_COMPUTE_WARPGROUPS, cfg.epi_operand_slots, em, w), dt,
                                  transforms=_swizzle_transforms(w, dt))
    for nm in vecs:
      length = cfg.tile_m if input_kinds[nm] == epi.InputKind.ROW else cfg.tile_n
      out["i_" + nm] = plgpu.SMEM((_COMPUTE_WARPGROUPS, _vec_slots(cfg), length),
                                  input_dtypes[nm])
    if tiles:
      out["tile_bar"] = plgpu.Barrier(
          num_arrivals=len(tiles), num_barriers=_COMPUTE_WARPGROUPS * cfg.epi_operand_slots)
    if vecs:
      out["vec_bar"] = plgpu.Barrier(num_arrivals=len(vecs),
                                     num_barriers=_COMPUTE_WARPGROUPS * _vec_slots(cfg))
    if any(o.kind in (epi.OutputKind.COL_PARTIAL, epi.OutputKind.ROW_TOTAL)
           for o in outputs):
      # one barrier per warpgroup: each arrives on its own when its turn ends (row
      # totals share their buffers between the warpgroups, so they take turns too)
      out["turn"] = plgpu.Barrier(num_arrivals=1, num_barriers=_COMPUTE_WARPGROUPS)
    return out

  def _origin(self, s, row_base, col_base):
    """Sub-tile ``s``'s first row and column; ``s`` counts on through a second pass."""
    i, j = self.sub_tiles[s % len(self.sub_tiles)]
    em, en = self.cfg.epi_tile_m, self.cfg.epi_tile_n
    return pl.multiple_of(row_base + i * em, em), pl.multiple_of(col_base + j * en, en)

  def _staged(self, s):
    """The tile operands staged at position ``s`` of the staging sequence, and their
    barriers' name: with row totals, the first pass's positions (a tile's worth)
    stage only what that pass reads, under barriers of their own; the rest, all."""
    if self.totals and s < len(self.sub_tiles):
      return self.first_tiles, "first_bar"
    return self.tiles_in, "tile_bar"

  def _fetch_tiles(self, s, row_base, col_base):
    r0, c0 = self._origin(s, row_base, col_base)
    em, en = self.cfg.epi_tile_m, self.cfg.epi_tile_n
    names, bar = self._staged(s)
    for nm in names:
      w = en * _TILE_KINDS[self.kinds[nm]]
      cols = pl.ds(pl.multiple_of(c0 * _TILE_KINDS[self.kinds[nm]], w), w)
      plgpu.copy_gmem_to_smem(self.in_gmem[nm].at[pl.ds(r0, em), cols],
                              self.smem["i_" + nm].at[self.wg, s % self.in_slots],
                              self.smem[bar].at[self.wg * self.in_slots
                                                + s % self.in_slots])

  def prefetch(self, row_base, col_base):
    """Issues the operand loads for the tile at (row_base, col_base); call before the
    mainloop so they land while it runs."""
    if not (self.vecs_in or self.tiles_in):
      return
    # The previous tile's epilogue may still be reading these buffers in other warps:
    # commit_smem ends with a warpgroup barrier.
    plgpu.commit_smem()
    self._fetch_vectors(row_base, col_base, self.vec_slot)
    # Tile operands run epi_operand_slots sub-tiles ahead of the epilogue.
    for s in range(min(self.in_slots, len(self.sub_tiles)) if self.tiles_in else 0):
      self._fetch_tiles(s, row_base, col_base)

  def prefetch_vectors(self, row_base, col_base, slot):
    """Issues the row and column operand loads of the tile at (row_base, col_base) into
    vector buffer ``slot``, which no warp of this warpgroup may still be reading (the
    tile before the current one used it: epi_prefetch_next_tile)."""
    if self.vecs_in:
      plgpu.commit_smem()  # ends with a warpgroup barrier: every warp is done with it
      self._fetch_vectors(row_base, col_base, slot)

  def _fetch_vectors(self, row_base, col_base, slot):
    for nm in self.vecs_in:
      if self.kinds[nm] == epi.InputKind.ROW:
        src = self.in_gmem[nm].at[pl.ds(row_base, self.cfg.tile_m)]
      else:
        src = self.in_gmem[nm].at[pl.ds(col_base, self.cfg.tile_n)]
      plgpu.copy_gmem_to_smem(src, self.smem["i_" + nm].at[self.wg, slot],
                              self.smem["vec_bar"].at[self.wg * self.vec_slots + slot])

  def fill_ones(self):
    """Before the first tile, when the program has a b_column_sum output: this
    warpgroup's ones column, which its wgmma reads, loaded and waited for."""
    if self.b_sum is None:
      return

    # (the cooperative kernel's memory warpgroup runs this scope too)
    @pl.when(self.wg < _COMPUTE_WARPGROUPS)
    def _fill():
      # Copied in by TMA, which swizzles as wgmma reads it: no register layout stores
      # a constant to swizzled shared memory.
      bar = self.smem["b_ones_bar"].at[self.wg]
      plgpu.copy_gmem_to_smem(self.in_gmem[_ONES_OPERAND], self.smem["b_ones"].at[self.wg],
                              bar)
      plgpu.barrier_wait(bar)

  def sum_b(self, sums_ref, b_tile, trans_b, wg_n, kk, row_base, rows_of_tiles):
    """K step ``kk`` of the sums of B over K, if it is this warpgroup tile's: the tiles
    of each column block share its K steps, the one in row of tiles p taking the steps
    p, p + P, ... (P rows of tiles), so each runs 1/P of the extra work: a wgmma eight
    columns wide costs far more than its share of the tensor cores' time
    (``docs/tuning.md#bs-column-sums-in-the-mainloop``). The step adds B's
    stage tile ``b_tile`` (this warpgroup's ``wg_n`` columns), transposed, times the
    ones column to ``sums_ref`` (tile_n, 8). Issue it before the step's main wgmma, so
    that a wait leaving one wgmma in flight leaves the main one."""
    if self.b_sum is None:
      return
    cols = b_tile.at[wg_n] if trans_b else b_tile.at[:, wg_n].transpose((1, 0))
    ones = self.smem["b_ones"].at[self.wg].transpose((1, 0))
    mine = kk % rows_of_tiles == row_base // self.cfg.tile_m
    pl.when(mine)(lambda: plgpu.wgmma(sums_ref, cols, ones))

  def store_b_sum(self, sums_ref, row_base, col_base):
    """After the mainloop: this warpgroup tile's share of the sums of B over K (every
    column of the ones gives the same sum: their mean is it exactly), TMA-stored to its
    row of tiles' row of the partials, in its columns."""
    if self.b_sum is None:
      return
    sums = jnp.sum(sums_ref[...], axis=1) * (1.0 / _ONES_COLUMNS)
    buf = self.smem["o_" + self.b_sum.name].at[self.wg]
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last store from buf is done
    buf[...] = sums
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(buf, self.out_gmem[self.b_sum.name].at[
        row_base // self.cfg.tile_m,
        pl.ds(pl.multiple_of(col_base, self.cfg.tile_n), self.cfg.tile_n)])

  def begin(self):
    """Before the first tile. With turns per column sum, warpgroup 1 hands warpgroup 0
    the first one."""
    if self.sum_turns:
      pl.when(self.wg == 1)(lambda: plgpu.barrier_arrive(self.smem["turn"].at[1]))

  def end(self):
    """After the last tile: warpgroup 0 observes the turn warpgroup 1 handed back after
    the last sum (no barrier phase goes unobserved)."""
    if self.sum_turns:
      pl.when(self.wg == 0)(lambda: plgpu.barrier_wait(self.smem["turn"].at[1]))

  def _column_sum_in_turn(self, x):
    """A column sum between this warpgroup's turn and the other's: wait for the other
    to finish its sum, sum, hand the turn back. The two run the same sums in the same
    order (the same program on the same number of sub-tiles), so turns alternate."""
    turn = self.smem["turn"]
    plgpu.barrier_wait(turn.at[1 - self.wg])
    total = jnp.sum(x, axis=0)
    plgpu.commit_smem()  # ends with a warpgroup barrier: every warp is done with the scratch
    plgpu.barrier_arrive(turn.at[self.wg])
    return total

  @staticmethod
  def _no_column_sums(x):
    raise ValueError("the epilogue sums over rows (tile.column_sum) but declares no "
                     "column-partial output, so the kernel has no turns for its "
                     "warpgroups' shared scratch; declare the sum as a col_partial output")

  def run(self, acc, row_base, col_base, *, first_tile=None, next_tile=None):
    """The epilogue of one tile. ``first_tile`` (ping-pong only): whether this is the
    CTA's first tile, whose epilogue waits for no earlier one. ``next_tile`` (K = 0 with
    epi_prefetch_next_tile): (whether there is one, its row_base, its col_base), whose
    first tile-operand sub-tiles this tile's last ones load as they free their slots."""
    if self.vecs_in:
      plgpu.barrier_wait(self.smem["vec_bar"].at[self.wg * self.vec_slots + self.vec_slot])
    if "turn" not in self.smem or self.sum_turns:
      self._walk(acc, row_base, col_base, next_tile)
      return
    # Column (cross-warp) reductions use compiler-placed SMEM scratch at one static
    # offset, the same for both warpgroups: their epilogues take turns.
    turn = self.smem["turn"]
    if first_tile is None:  # cooperative: warpgroup 0 first, then 1, on every tile
      pl.when(self.wg == 1)(lambda: plgpu.barrier_wait(turn.at[0]))
      self._walk(acc, row_base, col_base, next_tile)
      pl.when(self.wg == 0)(lambda: plgpu.barrier_arrive(turn.at[0]))
      pl.when(self.wg == 1)(lambda: plgpu.barrier_arrive(turn.at[1]))
      pl.when(self.wg == 0)(lambda: plgpu.barrier_wait(turn.at[1]))
      return
    # Ping-pong: tiles alternate between the warpgroups, and so do their epilogues. Each
    # waits for the other's previous epilogue (the tile before its own) to finish.
    # With row totals the epilogue takes two passes over the sub-tiles, their tile
    # operands staged in one sequence (the first pass's last sub-tiles load the
    # second's first). The first pass (the totals' partials) and the publish and wait
    # of the exchange run before the turn: they touch nothing the warpgroups share
    # (each has its own partials buffer; sums along rows stay inside a warp), so one
    # warpgroup's wait for its row block overlaps the other's epilogue. Gathering the
    # block's partials into the shared buffer and the program proper take the turn.
    if self.totals:
      self._walk(acc, row_base, col_base, first_pass=True)
      self._publish_and_wait(row_base, col_base)

    @pl.when(jnp.logical_not(first_tile))
    def _wait_for_previous():
      with _wait_scope("wait_turn"):
        plgpu.barrier_wait(turn.at[1 - self.wg])
    if self.totals:
      self._gather(row_base)
    self._walk(acc, row_base, col_base)
    plgpu.barrier_arrive(turn.at[self.wg])

  def _publish_and_wait(self, row_base, col_base):
    """The first half of the row totals' exchange: TMA-stores this tile's partials to
    the output's row for this tile's columns, waits for the stores to complete, signals
    the row block's semaphore (a release at GPU scope) and waits until every tile of
    the row block has signalled."""
    em, tm = self.cfg.epi_tile_m, self.cfg.tile_m
    for o in self.totals:
      buf = self.smem["t_" + o.name].at[self.wg]
      for i in range(tm // em):
        buf[pl.ds(i * em, em)] = self.partials.pop((o.name, i))
    assert not self.partials, f"row-total partials left over: {sorted(self.partials)}"
    plgpu.commit_smem()
    column_tile = col_base // self.cfg.tile_n
    rows = pl.ds(pl.multiple_of(row_base, tm), tm)
    for o in self.totals:
      plgpu.copy_smem_to_gmem(self.smem["t_" + o.name].at[self.wg],
                              self.out_gmem[o.name].at[column_tile, rows], commit_group=False)
    plgpu.commit_smem_to_gmem_group()
    plgpu.wait_smem_to_gmem(0, wait_read_only=False)
    semaphore = self.semaphores.at[row_base // tm]
    plgpu.semaphore_signal(semaphore, 1, memory_scope="gpu")
    plgpu.semaphore_wait(semaphore, self.total_tiles, decrement=False, memory_scope="gpu")

  def _gather(self, row_base):
    """The second half, inside the turn: loads the row block's partials into the
    buffer the warpgroups share. They are summed in a fixed order when read
    (``_tile``), so the totals do not depend on timing."""
    tm = self.cfg.tile_m
    rows = pl.ds(pl.multiple_of(row_base, tm), tm)
    bar = self.smem["x_bar"].at[self.wg]
    for o in self.totals:
      plgpu.copy_gmem_to_smem(self.out_gmem[o.name].at[:, rows], self.smem["x_" + o.name],
                              bar)
    plgpu.barrier_wait(bar)
    self.read_totals = {}

  def _walk(self, acc, row_base, col_base, next_tile=None, *, first_pass=False):
    """One pass of the epilogue over the tile's sub-tiles: the program proper, or with
    ``first_pass`` the row totals' (which stores only their partials). Tile operands
    are staged through one sequence of sub-tiles that runs on through both passes, so
    with row totals the program proper starts a tile's worth of sub-tiles into it."""
    em, en = self.cfg.epi_tile_m, self.cfg.epi_tile_n
    count = len(self.sub_tiles)
    offset = count if self.totals and not first_pass else 0
    sequence = 2 * count if self.totals else count
    self.running = {}
    for s, (i, j) in enumerate(self.sub_tiles):
      q = offset + s
      slot, in_slot = s % self.out_slots, q % self.in_slots
      r0, c0 = self._origin(s, row_base, col_base)
      staged, bar = self._staged(q)
      if staged:
        with _wait_scope("wait_operand"):
          plgpu.barrier_wait(self.smem[bar].at[self.wg * self.in_slots + in_slot])
      # The stores issued out_slots sub-tiles ago used this slot, and each sub-tile
      # commits at least one store group, so at most out_slots - 1 groups may still be
      # reading. At a tile's first sub-tile the previous tile's stores used the slots in
      # an order this tile does not continue: wait for all of them (a whole mainloop has
      # run since). With epi_store_wait_late the wait comes after the program, before
      # its outputs (``deferred``) are written.
      def wait_store(s=s):
        with _wait_scope("wait_store"):
          plgpu.wait_smem_to_gmem(0 if s == 0 else self.out_slots - 1, wait_read_only=True)
      deferred = None
      if self.whole and not first_pass:
        if self.cfg.epi_store_wait_late:
          deferred = []
        else:
          wait_store()
      # The load into this sub-tile's slot once every warp is done with it: a later
      # sub-tile of this tile, or past its last, the next tile's (the same slot:
      # in_slots divides count); None where there is none.
      refill = None
      if self.tiles_in and q + self.in_slots < sequence:
        refill = functools.partial(self._fetch_tiles, q + self.in_slots, row_base, col_base)
      elif self.tiles_in and next_tile is not None:
        has_next, next_row, next_col = next_tile
        refill = lambda: pl.when(has_next)(
            lambda: self._fetch_tiles(s + self.in_slots - count, next_row, next_col))
      read = None
      if self.cfg.epi_operand_refetch_early and staged:
        # Read the sub-tile's operands into registers now, so their slot can refill
        # while the program runs.
        read = {nm: self.smem["i_" + nm].at[self.wg, in_slot][...] for nm in staged}
        if refill:
          plgpu.commit_smem()  # ends with a warpgroup barrier: every warp has read
          refill()
      tile = self._tile(slot, in_slot, i, j, r0, c0, read, first_pass=first_pass,
                        deferred=deferred)
      program = self.totals_pass if first_pass else self.fn
      program(tile, acc[i * em:(i + 1) * em, j * en:(j + 1) * en])
      declared = self.totals if first_pass else [
          o for o in self.outputs if o.kind != epi.OutputKind.ROW_TOTAL]
      missing = {o.name for o in declared} - tile.stored
      if missing:
        raise ValueError(f"{'row_totals_pass' if first_pass else 'epilogue'} did not "
                         f"store outputs {sorted(missing)}")
      if deferred:
        wait_store()
        for name, value in deferred:
          self.smem["o_" + name][self.wg, slot] = value
      plgpu.commit_smem()  # also: every warp is done reading this slot's operands
      if refill and read is None:
        refill()
      if self.whole and not first_pass:
        for o in self.whole:
          if self._carried(o) and i != self.last_row:
            continue  # carried down to the tile's last row of sub-tiles
          plgpu.copy_smem_to_gmem(self.smem["o_" + o.name].at[self.wg, slot],
                                  self._window(o, r0, c0), commit_group=False,
                                  reduction_op=self._reduction(o))
        # one group a sub-tile, empty or not: the slot waits above count on it
        plgpu.commit_smem_to_gmem_group()
    assert not self.running, f"column partials left uncarried: {sorted(self.running)}"

  def _store_in_parts(self, o, value, r0, c0):
    """Stores one tile output's sub-tile value in ``store_parts`` TMA stores, each from
    a slot of the ring it shares with the other outputs whose parts have its dtype and
    shape (``_part_rings``), alternating between the two. Every store is its own group,
    so waiting until at most one is in flight frees the slot this one takes: its last
    store, of this output or another, is at least two groups back (every output's part
    count is even, so each starts at slot 0)."""
    parts = self.cfg.store_parts
    width = value.shape[1] // parts
    ring = self.smem[self.rings[o.name]]
    for h in range(parts):
      plgpu.wait_smem_to_gmem(_PART_SLOTS - 1, wait_read_only=True)
      buf = ring.at[self.wg, h % _PART_SLOTS]
      buf[...] = value[:, h * width:(h + 1) * width]
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(buf, self._window(o, r0, c0, part=h),
                              reduction_op=self._reduction(o))

  def _carried(self, o) -> bool:
    """Whether output ``o`` is a column partial carried down the warpgroup tile."""
    return self.per_tile and o.kind == epi.OutputKind.COL_PARTIAL

  def _carry(self, name, value, i):
    """Adds ``value`` (sub-tile (i, j)'s part of output ``name``) to the sum carried
    down column block j; the total at its last row of sub-tiles, else None."""
    total = value if i == 0 else self.running.pop(name) + value
    if i == self.last_row:
      return total
    self.running[name] = total
    return None

  def _reduction(self, o):
    """The TMA store's reduction for output ``o``: "add" where it adds to its operand
    in place, None (overwrite) otherwise."""
    return "add" if o.name in self.reduces else None

  def _tile(self, slot, in_slot, i, j, r0, c0, read=None, first_pass=False, deferred=None):
    """The program's view of sub-tile (i, j). ``read``: its tile operands, already read
    from their slot (``GemmConfig.epi_operand_refetch_early``), else None. With
    ``first_pass`` the row totals' pass's view: it stores their partials only; after
    it, the program proper reads each total as a row operand. ``deferred``: a list that
    collects (name, value) of the outputs staged whole, for the caller to write into
    their slots after the program (``GemmConfig.epi_store_wait_late``); None writes
    them as they are stored."""
    em, en, smem, wg = self.cfg.epi_tile_m, self.cfg.epi_tile_n, self.smem, self.wg

    def reader(nm):
      kind = self.kinds[nm]
      if kind in _TILE_KINDS and read is not None:
        return lambda: read[nm]
      if kind in _TILE_KINDS:
        return lambda: smem["i_" + nm].at[wg, in_slot][...]
      vslot = self.vec_slot
      if kind == epi.InputKind.ROW:
        return lambda: epi.load_row(smem["i_" + nm].at[wg, vslot, pl.ds(i * em, em)])
      return lambda: epi.load_col(smem["i_" + nm].at[wg, vslot, pl.ds(j * en, en)])

    def column_value(nm):
      vslot = self.vec_slot
      return lambda col: smem["i_" + nm][wg, vslot, j * en + col]

    column_values = {nm: column_value(nm) for nm, kind in self.readable.items()
                     if kind == epi.InputKind.COL}

    def stage(o, value):
      if o.name in self.adds:  # the staged operand's sub-tile, added in registers
        value = value + reader(self.adds[o.name])()
      if o not in self.whole:
        self._store_in_parts(o, value, r0, c0)
      elif deferred is not None:
        deferred.append((o.name, value))
      else:
        smem["o_" + o.name][wg, slot] = value

    column_sum = (self._column_sum_in_turn if self.sum_turns
                  else (lambda x: jnp.sum(x, axis=0)) if "turn" in self.smem
                  else self._no_column_sums)

    def writer(o, finish=lambda value: value):
      """Stores ``finish(value)``; a column partial carried down the tile, once its
      last row of sub-tiles has been added."""
      def write(value):
        if self._carried(o):
          value = self._carry(o.name, value, i)
          if value is None:
            return
        stage(o, finish(value))
      return write

    # a tile whose sum over rows is the partial: summed once the rows are added
    sum_writer = lambda o: writer(o, lambda value: column_sum(value).astype(o.dtype))
    inputs = {nm: (kind, reader(nm)) for nm, kind in self.readable.items()
              if not first_pass or kind not in _TILE_KINDS or nm in self.first_tiles}

    if first_pass:
      def add_partial(o):
        def write(value):
          key = (o.name, i)
          self.partials[key] = value if key not in self.partials else (
              self.partials[key] + value)
        return write
      return epi.EpilogueTile(
          row0=r0, col0=c0, shape=(em, en), inputs=inputs,
          outputs={o.name: (o, add_partial(o)) for o in self.totals},
          column_sum=self._no_column_sums, column_values=column_values)

    def total(nm):
      def read_total():
        # the row block's partials in column order (the same sum on every tile); read
        # once per row of sub-tiles
        if (nm, i) not in self.read_totals:
          buf = smem["x_" + nm]
          parts = [epi.load_row(buf.at[c, pl.ds(i * em, em)])
                   for c in range(self.total_tiles)]
          self.read_totals[nm, i] = functools.reduce(lambda x, y: x + y, parts)
        return self.read_totals[nm, i]
      return read_total

    inputs.update({o.name: (epi.InputKind.ROW, total(o.name)) for o in self.totals})
    return epi.EpilogueTile(
        row0=r0, col0=c0, shape=(em, en),
        inputs=inputs,
        outputs={o.name: (o, writer(o)) for o in self.outputs
                 if o.kind != epi.OutputKind.ROW_TOTAL},
        column_sum=column_sum,
        column_sum_writers={o.name: sum_writer(o) for o in self.outputs
                            if o.kind == epi.OutputKind.COL_PARTIAL},
        column_values=column_values)

  def _window(self, o, r0, c0, part=0):
    """Where one store of ``o`` lands: the sub-tile at (r0, c0), or its ``part``-th
    part when ``o`` is stored in parts."""
    em, en = self.cfg.epi_tile_m, self.cfg.epi_tile_n
    ref = self.out_gmem[o.name]
    if o.kind == epi.OutputKind.ROW_PARTIAL:
      return ref.at[c0 // en, pl.ds(r0, em)]
    w = o.subtile_shape(em, _stored_width(self.cfg, o))[-1]
    cols = pl.ds(pl.multiple_of(o.scaled(c0) + part * w, w), w)
    if o.kind == epi.OutputKind.TILE:
      return ref.at[pl.ds(r0, em), cols]
    return ref.at[r0 // self.cfg.column_partial_rows, cols]


def _bind_refs(refs, input_names, outputs, in_place):
  """The kernel's operand refs by name, and its output refs by name (an in-place output
  is its operand's ref)."""
  in_gmem = dict(zip(input_names, refs[:len(input_names)]))
  fresh = [o.name for o in outputs if o.name not in in_place]
  out_gmem = dict(zip(fresh, refs[len(input_names):]))
  out_gmem.update({o: in_gmem[i] for o, i in in_place.items()})
  return in_gmem, out_gmem


def _operand_views(a_smem, b_smem, trans_a, trans_b, wg_m, wg_n):
  """wgmma operands from shared-memory tiles, transposed views where stored so."""
  a_op = a_smem.at[:, wg_m].transpose((1, 0)) if trans_a else a_smem.at[wg_m]
  b_op = b_smem.at[wg_n].transpose((1, 0)) if trans_b else b_smem.at[:, wg_n]
  return a_op, b_op


def _kernel_cooperative(a_gmem, b_gmem, *refs, cfg: GemmConfig, m, n, k, trans_a, trans_b,
                        input_names, input_kinds, outputs, epilogue, in_place,
                        num_clusters, column_sum_turns):
  """Both compute warpgroups share each CTA tile and each pipeline stage."""
  del num_clusters  # nd_loop spreads the tiles over the grid
  in_gmem, out_gmem = _bind_refs(refs, input_names, outputs, in_place)
  dtype = a_gmem.dtype
  tm, tn, tk = cfg.tile_m, cfg.tile_n, cfg.tile_k
  cm, cn = cfg.cta_tile
  cluster_tile_m, cluster_tile_n = cfg.cluster_tile
  m_iters, n_iters, k_iters = -(-m // cluster_tile_m), n // cluster_tile_n, k // tk
  share_a = ("cluster",) if cfg.cluster_dim == MatDim.N else ()
  share_b = ("cluster",) if cfg.cluster_dim == MatDim.M else ()
  a_block = (tk, cm) if trans_a else (cm, tk)
  b_block = (cn, tk) if trans_b else (tk, cn)
  a_spec = plgpu.BlockSpec(a_block, (lambda kk: (kk, 0)) if trans_a else (lambda kk: (0, kk)),
                           transforms=_swizzle_transforms(a_block[1], dtype),
                           collective_axes=share_a)
  b_spec = plgpu.BlockSpec(b_block, (lambda kk: (0, kk)) if trans_b else (lambda kk: (kk, 0)),
                           transforms=_swizzle_transforms(b_block[1], dtype),
                           collective_axes=share_b)

  def pipeline(body, compute_context):
    return plgpu.emit_pipeline_warp_specialized(
        body, grid=(k_iters,), memory_registers=40, in_specs=[a_spec, b_spec],
        wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=cfg.stages,
        compute_context=compute_context)

  def scope(pipeline_allocs, **smem):
    wg = lax.axis_index("wg")
    ep = _Epilogue(cfg, in_gmem, out_gmem, input_kinds, outputs, epilogue, smem, wg,
                   column_sum_turns)
    ep.fill_ones()
    ep.begin()

    @plgpu.nd_loop((m_iters * n_iters,), collective_axes="sm")
    def _tile_loop(info):
      (lin,) = info.index
      mi, ni, row_base, col_base = _warpgroup_origin(lin, cfg, m_iters, n_iters, wg)
      if cfg.wg_dim == MatDim.M:
        wg_m, wg_n = pl.ds(wg * tm, tm), slice(None)
      else:
        wg_m, wg_n = slice(None), pl.ds(wg * tn, tn)

      def compute_context(run_mainloop):
        ep.prefetch(row_base, col_base)

        @functools.partial(pl.run_scoped, **_accumulators(cfg, outputs))
        def _acc_scope(acc_ref, sums_ref=None):
          with jax.named_scope("mainloop"):
            run_mainloop((acc_ref, sums_ref))
          with jax.named_scope("epilogue"):
            ep.store_b_sum(sums_ref, row_base, col_base)
            ep.run(acc_ref[...], row_base, col_base)

      def mma_body(indices, a_smem, b_smem, refs):
        acc_ref, sums_ref = refs
        ep.sum_b(sums_ref, b_smem, trans_b, wg_n, indices[0], row_base,
                 m_iters * cluster_tile_m // tm)
        plgpu.wgmma(acc_ref, *_operand_views(a_smem, b_smem, trans_a, trans_b, wg_m, wg_n))
        # Wait for this MMA before its slot is released: with the MMA left in flight
        # (delay_release) the pipeline never releases the last K step's slot, and the
        # next tile's prologue overwrites it while the MMA may still read it.
        plgpu.wgmma_wait(0)
        return refs

      a_cta = a_gmem.at[:, pl.ds(mi * cm, cm)] if trans_a else a_gmem.at[pl.ds(mi * cm, cm)]
      b_cta = b_gmem.at[pl.ds(ni * cn, cn)] if trans_b else b_gmem.at[:, pl.ds(ni * cn, cn)]
      pipeline(mma_body, compute_context)(a_cta, b_cta, allocations=pipeline_allocs)

    ep.end()
    plgpu.wait_smem_to_gmem(0, wait_read_only=False)

  ignore = lambda *_, **__: None
  pl.run_scoped(
      scope,
      pipeline_allocs=pipeline(ignore, ignore).get_allocations(a_gmem, b_gmem),
      collective_axes="wg",
      **_Epilogue.scratch(cfg, input_kinds, {nm: r.dtype for nm, r in in_gmem.items()},
                          outputs, operand_dtype=dtype),
  )


def _accumulators(cfg: GemmConfig, outputs) -> dict:
  """A warpgroup's accumulators for one tile, for ``pl.run_scoped``: the product's
  (``acc_ref``), and where the program has a b_column_sum output the sums of B over K
  (``sums_ref``: one row per column of the tile, one column per column of the ones)."""
  accs = {"acc_ref": plgpu.ACC((cfg.tile_m, cfg.tile_n), jnp.float32)}
  if any(o.kind == epi.OutputKind.B_COLUMN_SUM for o in outputs):
    accs["sums_ref"] = plgpu.ACC((cfg.tile_n, _ONES_COLUMNS), jnp.float32)
  return accs


def _kernel_no_product(*refs, cfg: GemmConfig, m, n, input_names, input_kinds, outputs,
                       epilogue, in_place, column_sum_turns):
  """K = 0: the epilogue program alone, on an accumulator of -0.0 (an elementwise pass
  over (M, N) whose first steps add its tile operands; why -0.0: beside ``acc``). No
  mainloop and no memory warpgroup: the two warpgroups split each CTA tile as in the
  cooperative schedule, and each stages its tile operands, runs the program and stores,
  tile after tile."""
  in_gmem, out_gmem = _bind_refs(refs, input_names, outputs, in_place)
  tm, tn = cfg.tile_m, cfg.tile_n
  cm, cn = cfg.cta_tile
  m_iters, n_iters = -(-m // cm), n // cn

  def scope(**smem):
    wg = lax.axis_index("wg")
    ep = _Epilogue(cfg, in_gmem, out_gmem, input_kinds, outputs, epilogue, smem, wg,
                   column_sum_turns)
    ep.begin()

    @plgpu.nd_loop((m_iters * n_iters,), collective_axes="sm")
    def _tile_loop(info):
      (lin,) = info.index
      _, _, row_base, col_base = _warpgroup_origin(lin, cfg, m_iters, n_iters, wg)
      next_tile = None
      if not cfg.epi_prefetch_next_tile:
        ep.prefetch(row_base, col_base)
      else:
        # This tile's loads were issued under the one before (the first tile's here);
        # the next tile's row and column operands go to the other buffer now, and its
        # first operand sub-tiles as this tile frees their slots.
        t = info.local_index
        ep.vec_slot = t % 2
        pl.when(t == 0)(lambda: ep.prefetch(row_base, col_base))
        has_next = t + 1 < info.num_local_steps
        # nd_loop deals linear tiles round-robin over the SMs: this SM's next one
        _, _, next_row, next_col = _warpgroup_origin(
            lin + lax.axis_size("sm"), cfg, m_iters, n_iters, wg)
        pl.when(has_next)(lambda: ep.prefetch_vectors(next_row, next_col, 1 - t % 2))
        next_tile = (has_next, next_row, next_col)

      # An accumulator no wgmma touches, in the layout the program expects: negative
      # zeros, because x + (-0.0) is x exactly, so the compiler drops the add of the
      # program's first tile operand (0.0 + x is not x where x is -0.0, so it stays).
      acc = plgpu.layout_cast(jnp.full((tm, tn), -0.0, jnp.float32), plgpu.Layout.WGMMA)
      ep.run(acc, row_base, col_base, next_tile=next_tile)

    ep.end()
    plgpu.wait_smem_to_gmem(0, wait_read_only=False)

  pl.run_scoped(scope, collective_axes="wg",
                **_Epilogue.scratch(cfg, input_kinds,
                                    {nm: r.dtype for nm, r in in_gmem.items()}, outputs))


def _warpgroup_origin(lin, cfg: GemmConfig, m_iters, n_iters, wg):
  """(mi, ni, row_base, col_base) of cooperative tile ``lin``: its CTA-tile coordinates
  and the first row and column of warpgroup ``wg``'s half of it."""
  mi, ni = _tile_origin(lin, cfg, m_iters, n_iters)
  cm, cn = cfg.cta_tile
  if cfg.wg_dim == MatDim.M:
    return mi, ni, mi * cm + wg * cfg.tile_m, ni * cn
  return mi, ni, mi * cm, ni * cn + wg * cfg.tile_n


def _tile_origin(lin, cfg: GemmConfig, m_iters, n_iters):
  """(mi, ni): the CTA-tile coordinates of linear tile ``lin`` of this cluster."""
  mi, ni = plgpu.planar_snake(lin, (m_iters, n_iters), cfg.grid_minor_dim,
                              cfg.grid_tile_width)
  if cfg.cluster_dim == MatDim.M:
    mi = mi * 2 + lax.axis_index("cluster")
  elif cfg.cluster_dim == MatDim.N:
    ni = ni * 2 + lax.axis_index("cluster")
  return mi, ni


def _kernel_pingpong(a_gmem, b_gmem, *refs, cfg: GemmConfig, m, n, k, trans_a, trans_b,
                     input_names, input_kinds, outputs, epilogue, in_place, num_clusters,
                     column_sum_turns, row_totals_pass=None, row_totals_reads=()):
  del column_sum_turns  # ping-pong epilogues alternate whole (``_Epilogue.run``)
  """Ping-pong: warpgroups 0 and 1 take the CTA's tiles in turn, each a whole
  (tile_m, tile_n) tile; warpgroup 2 streams every tile's A and B stages, in tile order,
  through one ring. Stage ``g`` (counted over the CTA's whole run) sits in slot
  ``g % stages``; its "full" barrier is the owning warpgroup's own, so each barrier is
  waited on by one warpgroup at every phase, and the automatic phase tracking holds.
  The owner releases a slot (the "consumed" barrier, cluster-wide when an operand is
  multicast) once the wgmma reading it has finished."""
  in_gmem, out_gmem = _bind_refs(refs, input_names, outputs, in_place)
  dtype = a_gmem.dtype
  tm, tn, tk, stages = cfg.tile_m, cfg.tile_n, cfg.tile_k, cfg.stages
  cluster_tile_m, cluster_tile_n = cfg.cluster_tile
  m_iters, n_iters, k_iters = -(-m // cluster_tile_m), n // cluster_tile_n, k // tk
  num_tiles = m_iters * n_iters
  multicast_a = ("cluster",) if cfg.cluster_dim == MatDim.N else None
  multicast_b = ("cluster",) if cfg.cluster_dim == MatDim.M else None
  a_block = (tk, tm) if trans_a else (tm, tk)
  b_block = (tn, tk) if trans_b else (tk, tn)
  if cfg.cluster_dim is None:
    consumed = plgpu.Barrier(num_arrivals=1, num_barriers=stages)
  else:  # a multicast writes the peer CTA's slot too: both must have released it
    consumed = plgpu.ClusterBarrier(collective_axes=("cluster",), num_arrivals=1,
                                    num_barriers=stages)

  def scope(a_ring, b_ring, full, consumed, **smem):
    wg = lax.axis_index("wg")
    cluster_id = lax.axis_index("sm")
    # Row totals: one semaphore per row block of warpgroup tiles, in global memory,
    # zeroed before each launch (``_Epilogue._publish_and_wait``).
    semaphores = None
    if any(o.kind == epi.OutputKind.ROW_TOTAL for o in outputs):
      semaphores = pl.get_global(plgpu.SemaphoreType.REGULAR(
          (m_iters * cluster_tile_m // tm,)))
    # This cluster's tiles: cluster_id, cluster_id + num_clusters, ...
    local_tiles = (num_tiles - cluster_id + num_clusters - 1) // num_clusters

    @pl.when(wg == 2)
    def _memory():
      plgpu.set_max_registers(40, action="decrease")

      def tile_body(t, step):
        mi, ni = _tile_origin(cluster_id + t * num_clusters, cfg, m_iters, n_iters)
        owner = t % 2

        def k_body(kk, step):
          slot = step % stages

          @pl.when(step >= stages)
          def _wait_released():
            with _wait_scope("wait_slot"):
              plgpu.barrier_wait(consumed.at[slot])

          ks = pl.ds(pl.multiple_of(kk * tk, tk), tk)
          rows, cols = pl.ds(mi * tm, tm), pl.ds(ni * tn, tn)
          a_src = a_gmem.at[ks, rows] if trans_a else a_gmem.at[rows, ks]
          b_src = b_gmem.at[cols, ks] if trans_b else b_gmem.at[ks, cols]
          bar = full.at[owner * stages + slot]
          plgpu.copy_gmem_to_smem(a_src, a_ring.at[slot], bar, collective_axes=multicast_a)
          plgpu.copy_gmem_to_smem(b_src, b_ring.at[slot], bar, collective_axes=multicast_b)
          return step + 1

        return lax.fori_loop(0, k_iters, k_body, step)

      total = lax.fori_loop(0, local_tiles, tile_body, jnp.int32(0))

      # Observe the last releases, so that no barrier ends with a phase unseen.
      @pl.loop(jnp.maximum(total - stages, 0), total)
      def _drain(step):
        plgpu.barrier_wait(consumed.at[step % stages])

    @pl.when(wg < 2)
    def _compute():
      plgpu.set_max_registers(232, action="increase")
      ep = _Epilogue(cfg, in_gmem, out_gmem, input_kinds, outputs, epilogue, smem, wg,
                     row_totals_pass=row_totals_pass, semaphores=semaphores, columns=n,
                     first_pass_tiles=row_totals_reads)
      ep.fill_ones()

      def tile_body(i, _):
        t = 2 * i + wg
        mi, ni = _tile_origin(cluster_id + t * num_clusters, cfg, m_iters, n_iters)
        row_base, col_base = mi * tm, ni * tn
        ep.prefetch(row_base, col_base)
        first_step = t * k_iters

        @functools.partial(pl.run_scoped, **_accumulators(cfg, outputs))
        def _acc_scope(acc_ref, sums_ref=None):
          def k_body(kk, _):
            step = first_step + kk
            slot = step % stages
            with _wait_scope("wait_stage"):
              plgpu.barrier_wait(full.at[wg * stages + slot])
            a_op = a_ring.at[slot].transpose((1, 0)) if trans_a else a_ring.at[slot]
            b_op = b_ring.at[slot].transpose((1, 0)) if trans_b else b_ring.at[slot]
            ep.sum_b(sums_ref, b_ring.at[slot], trans_b, slice(None), kk, row_base,
                     m_iters * cluster_tile_m // tm)
            plgpu.wgmma(acc_ref, a_op, b_op)
            plgpu.wgmma_wait(1)  # the previous step's wgmma is done: release its slot

            @pl.when(kk > 0)
            def _release_previous():
              plgpu.barrier_arrive(consumed.at[(step - 1) % stages])

          with jax.named_scope("mainloop"):
            lax.fori_loop(0, k_iters, k_body, None)
            plgpu.wgmma_wait(0)
          plgpu.barrier_arrive(consumed.at[(first_step + k_iters - 1) % stages])
          with jax.named_scope("epilogue"):
            ep.store_b_sum(sums_ref, row_base, col_base)
            ep.run(acc_ref[...], row_base, col_base, first_tile=t == 0)

      lax.fori_loop(0, (local_tiles - wg + 1) // 2, tile_body, None)
      if "turn" in smem:  # the other warpgroup's last epilogue: observe its turn

        @pl.when((local_tiles - 1) % 2 != wg)
        def _last_turn():
          plgpu.barrier_wait(smem["turn"].at[1 - wg])
      plgpu.wait_smem_to_gmem(0, wait_read_only=False)

  pl.run_scoped(
      scope,
      a_ring=plgpu.SMEM((stages, *a_block), dtype,
                        transforms=_swizzle_transforms(a_block[1], dtype)),
      b_ring=plgpu.SMEM((stages, *b_block), dtype,
                        transforms=_swizzle_transforms(b_block[1], dtype)),
      full=plgpu.Barrier(num_arrivals=2, num_barriers=2 * stages),
      consumed=consumed,
      collective_axes="wg",
      **_Epilogue.scratch(cfg, input_kinds, {nm: r.dtype for nm, r in in_gmem.items()},
                          outputs, operand_dtype=dtype, columns=n,
                          first_pass_tiles=row_totals_reads),
  )


def kernel_name_for(config: GemmConfig, m: int, n: int, k: int, trans_a: bool,
                    trans_b: bool, outputs) -> str:
  """The kernel's name in profiles: the schedule, the problem's M x N x K and operand
  order, and its outputs' names, so that a step's profile tells its GEMMs apart, e.g.
  ``coda_gemm_pingpong_8192x14336x4096_nt_dz_zdz`` (``coda_gemm_epilogue_only_...`` for
  K = 0). Characters a symbol cannot hold become ``_``."""
  kind = config.schedule.name.lower() if k > 0 else "epilogue_only"
  order = ("t" if trans_a else "n") + ("t" if trans_b else "n")
  outs = "_".join(o.name for o in outputs)
  return re.sub(r"[^A-Za-z0-9_]", "_", f"coda_gemm_{kind}_{m}x{n}x{k}_{order}_{outs}")


def gemm(a: jax.Array, b: jax.Array, *,
         inputs: dict[str, tuple[epi.InputKind, jax.Array]] | None = None,
         epilogue: Callable | None = None,
         outputs: tuple[epi.EpilogueOutput, ...] | None = None,
         trans_a: bool = False, trans_b: bool = False,
         in_place: dict[str, str] | None = None,
         config: GemmConfig | None = None, num_sms: int | None = None,
         interpret=None, program_id: str | None = None,
         min_epi_tile_n: int = 1, device_kind: str | None = None,
         column_sum_turns: bool = False, clip_m: bool = False,
         row_totals_pass: Callable | None = None) -> dict[str, jax.Array]:
  """Runs ``a @ b`` (operands optionally transposed) with an epilogue program.

  Args:
    a: (M, K), or (K, M) with ``trans_a``. bfloat16 or float16.
    b: (K, N), or (N, K) with ``trans_b``. Same dtype as ``a``. K may be 0: the product
      is then zero, and the kernel runs the epilogue alone (``_kernel_no_product``: no
      mainloop, unclustered cooperative configs only), an elementwise pass over (M, N)
      tiles whose program starts from zero (e.g. with an ``AddTile``).
    inputs: extra operands, name -> (kind, array); row (M,), col (N,), tile (M, N).
    epilogue: ``fn(tile, acc)``; default stores ``acc`` to the output ``"out"``.
    outputs: declared outputs; default one (M, N) ``"out"`` in ``a.dtype``. A tile
      output with ``adds_to`` is the named float32 tile operand plus what the epilogue
      stores; the epilogue cannot read that operand. One ``b_column_sum`` output gets
      partials of B's sums over K from the mainloop (``epilogue.py``; K > 0, tile_n a
      multiple of 64).
    in_place: output name -> tile operand name: the output is written into that
      operand's buffer (a mutable ``jax.Ref`` inside; XLA reuses the buffer when the
      caller donates it), e.g. accumulating a gradient into its previous value. Each
      element is read before it is written, by the same CTA; where the output adds to
      that very operand (``EpilogueOutput.adds_to``), nothing reads it: the TMA store
      adds to the buffer (compiled kernels; the interpreter stages and adds). For whole
      buffers only: XLA copies a slice of a larger array (a scan's xs, a stacked
      residual) out to a buffer of its own first, a pass over memory that saves nothing.
    config: tuning; default the tuned config for this problem from the on-disk cache
      (``autotune.lookup``), else ``default_config``'s heuristic.
    num_sms: size of the persistent grid; default the device's SM count.
    interpret: ``plgpu.InterpretGPUParams()`` to run on CPU through the interpreter.
    program_id: names the epilogue program in the tuning cache's key (what the closure
      computes; its operands and outputs are part of the key anyway).
    min_epi_tile_n: the epilogue sub-tile width must be a multiple of this (a pairwise
      epilogue's pair block); used where ``config`` is chosen here.
    device_kind: the tuning cache's device key; default that of ``jax.devices()[0]``.
    column_sum_turns: the epilogue sums over rows only through ``tile.column_sum``
      (never ``jnp.sum(x, axis=0)`` itself): the cooperative schedule's warpgroups then
      take turns around each such sum, whose shared scratch they share, instead of
      around the whole epilogue, and run the rest of their epilogues at once.
    clip_m: M need not be a multiple of the cluster tile (only of ``CLIP_M_MULTIPLE``):
      the last row of tiles reaches past M, TMA fills what it loads there (rows of A,
      row and tile operands) with zeros and drops what it stores there. The rows past M
      do reach column partials: the caller's epilogue must map a zero accumulator row
      with zero operands to zero (or declare no column partials). Compiled kernels
      only (the interpreter clamps out-of-range slices instead of filling zeros).
    row_totals_pass: ``fn(tile, acc)``, the first pass of a program with row_total
      outputs: it stores each one's (epi_tile_m,) partial for the sub-tile (and nothing
      else). The kernel sums them over the whole row across the grid, and ``epilogue``
      then reads each total as a row operand of the output's name (``epilogue.py``).
      Needs a ping-pong ``config`` (``row_totals_conflict``) and the compiled kernel.
  Returns:
    dict of output name to array, shapes per ``epilogue.output_shape`` (with
    ``clip_m``, column partials keep a row for each row of sub-tiles, past M too).
  """
  inputs = dict(inputs or {})
  outputs = tuple(outputs) if outputs is not None else (epi.EpilogueOutput("out", dtype=a.dtype),)
  epilogue = epilogue or epi.store_main(outputs[0].name)
  names = [o.name for o in outputs]
  if len(set(names)) != len(names):
    raise ValueError(f"output names must be unique, got {names}")
  m, n, k = check_operands(a, b, trans_a, trans_b)
  for nm, (kind, v) in inputs.items():
    epi.check_input(nm, kind, v, m, n)
  input_kinds = {nm: kind for nm, (kind, _) in inputs.items()}
  input_dtypes = {nm: v.dtype for nm, (_, v) in inputs.items()}
  in_place = dict(in_place or {})
  specs = {o.name: o for o in outputs}
  for out_name, in_name in in_place.items():
    if out_name not in specs or in_name not in inputs:
      raise ValueError(f"in_place={in_place}: {out_name!r} must be a declared output and "
                       f"{in_name!r} a passed operand")
    o, (kind, v) = specs[out_name], inputs[in_name]
    if (kind not in _TILE_KINDS or o.kind != epi.OutputKind.TILE
        or o.width != _TILE_KINDS[kind] or jnp.dtype(o.dtype) != v.dtype):
      raise ValueError(f"in_place {out_name!r} <- {in_name!r}: both must be tiles of one "
                       f"shape and dtype, got {o} and a {kind.value} operand of {v.dtype}")
  if len(set(in_place.values())) != len(in_place):
    raise ValueError(f"in_place={in_place}: an operand can back one output only")
  for o in outputs:
    if o.adds_to is None:
      continue
    kind, v = inputs.get(o.adds_to, (None, None))
    if kind not in _TILE_KINDS or o.width != _TILE_KINDS[kind] or v.dtype != jnp.float32:
      raise ValueError(f"output {o.name!r} adds to {o.adds_to!r}, which must be a passed "
                       f"float32 tile operand of the output's shape, got "
                       f"{'nothing' if v is None else f'a {kind.value} operand of {v.dtype}'}")

  totals = [o.name for o in outputs if o.kind == epi.OutputKind.ROW_TOTAL]
  if bool(totals) != (row_totals_pass is not None):
    raise ValueError(f"row_total outputs {totals} need a row_totals_pass that stores "
                     "their partials, and a row_totals_pass needs row_total outputs; got "
                     f"row_totals_pass={row_totals_pass!r}")
  if totals and (interpret is not None or k == 0 or in_place):
    raise ValueError(f"row_total outputs {totals}: compiled kernels with a mainloop only "
                     "and no in-place outputs (the interpreter has no global semaphores, "
                     "and runs one CTA at a time, so a row block's wait would never end)")
  clash = set(totals) & set(inputs)
  if clash:
    raise ValueError(f"row_total outputs {sorted(clash)} are also passed operands: the "
                     "epilogue reads a total under its output's name, so rename one")
  sums_b = [o.name for o in outputs if o.kind == epi.OutputKind.B_COLUMN_SUM]
  if len(sums_b) > 1:
    raise ValueError(f"outputs {sums_b} are all b_column_sum outputs: declare one")
  if sums_b and k == 0:
    raise ValueError(f"output {sums_b[0]!r} sums B over K, but K = 0 (an epilogue pass "
                     "has no B)")
  if clip_m and interpret is not None:
    raise ValueError("clip_m=True needs the compiled kernel: the interpreter clamps "
                     "out-of-range slices instead of filling zeros; pad M to the tile")
  staged = lambda in_place: staged_inputs(input_kinds, outputs, in_place,
                                          compiled=interpret is None)
  from pallas_kernels import autotune  # it imports this module
  # (a program with row totals is not recorded for the tuner, which would replay it
  # without its first pass: it runs with the config it is given)
  if interpret is None and (config is None or autotune.is_recording()) and not totals:
    key = autotune.problem_key(m, n, k, a.dtype, trans_a, trans_b, autotune.signature(
        program_id, input_kinds, input_dtypes, outputs, in_place, min_epi_tile_n),
        device_kind=device_kind)
    if autotune.is_recording():
      autotune.record(autotune.Problem(
          key=key, a=jax.ShapeDtypeStruct(a.shape, a.dtype),
          b=jax.ShapeDtypeStruct(b.shape, b.dtype),
          inputs={nm: (kind, jax.ShapeDtypeStruct(v.shape, v.dtype))
                  for nm, (kind, v) in inputs.items()},
          epilogue=epilogue, outputs=outputs, trans_a=trans_a, trans_b=trans_b,
          in_place=in_place, program_id=program_id, min_epi_tile_n=min_epi_tile_n,
          column_sum_turns=column_sum_turns, clip_m=clip_m))
    if config is None:
      config = autotune.lookup(key, clip_m=clip_m)
  if config is None:
    config = default_config(m, n, k, a.dtype, input_kinds=staged(in_place),
                            input_dtypes=input_dtypes, outputs=outputs, trans_a=trans_a,
                            trans_b=trans_b, min_epi_tile_n=min_epi_tile_n, clip_m=clip_m)
  if config.epi_tile_n % min_epi_tile_n:
    raise ValueError(f"config.epi_tile_n={config.epi_tile_n} must be a multiple of the "
                     f"program's column group (pair block) {min_epi_tile_n}")
  _check_tiling(m, n, k, config, trans_a, trans_b, clip_m)
  if sums_b and (why := b_column_sum_conflict(config)):
    raise ValueError(f"{config} cannot sum B over K for output {sums_b[0]!r}: {why}")
  for o in outputs:
    if (o.kind == epi.OutputKind.TILE
        and o.subtile_shape(config.epi_tile_m, config.epi_tile_n)[-1] % 8):
      raise ValueError(f"output {o.name!r}: epi_tile_n={config.epi_tile_n} * "
                       f"{o.width} must be a multiple of 8")
  mainloop = k > 0
  if config.epi_prefetch_next_tile and mainloop:
    raise ValueError(f"{config}: epi_prefetch_next_tile is for K = 0 passes (with a "
                     f"mainloop a tile's operands load under it); K={k}")

  def check_smem(kinds):
    need = smem_bytes(config, a.dtype, kinds, input_dtypes, outputs, mainloop=mainloop,
                      columns=n)
    if need > SMEM_LIMIT_BYTES:
      raise ValueError(f"{config} with this epilogue needs {need} bytes of shared memory, "
                       f"over the {SMEM_LIMIT_BYTES}-byte limit: lower stages or tiles")
    return need
  if num_sms is None:
    num_sms = jax.devices()[0].core_count if interpret is None else 2
  tiles = -(-m // config.cluster_tile[0]) * (n // config.cluster_tile[1])
  cluster = 1 if config.cluster_dim is None else 2
  names_in = tuple(inputs)
  kernel_inputs = {nm: v for nm, (_, v) in inputs.items()}
  if sums_b:  # the ones that B's tiles are multiplied with (_Epilogue.fill_ones)
    names_in += (_ONES_OPERAND,)
    kernel_inputs[_ONES_OPERAND] = jnp.ones((_ONES_COLUMNS, config.tile_k), a.dtype)
  if num_sms < cluster:
    raise ValueError(f"num_sms={num_sms} is smaller than the cluster ({cluster} CTAs) of "
                     f"{config}: pass cluster_dim=None or more SMs")
  grid = min(num_sms // cluster, tiles)
  if totals and (why := row_totals_conflict(config, n, grid)):
    raise ValueError(f"{config} cannot make row_total outputs {totals}: {why}")
  smem_used = check_smem(staged(in_place))
  if not mainloop:  # K = 0: the product is zero; a, b are not passed to the kernel
    body = functools.partial(_kernel_no_product, cfg=config, m=m, n=n)
  else:
    body = functools.partial(
        _kernel_pingpong if config.schedule == Schedule.PINGPONG else _kernel_cooperative,
        num_clusters=grid, cfg=config, m=m, n=n, k=k, trans_a=trans_a, trans_b=trans_b)
  body = functools.partial(body, column_sum_turns=column_sum_turns)
  if totals:
    body = functools.partial(
        body, row_totals_pass=row_totals_pass,
        row_totals_reads=row_totals_pass_reads(row_totals_pass, staged(in_place),
                                               input_dtypes, outputs, config))
  kernel_name = kernel_name_for(config, m, n, k, trans_a, trans_b, outputs)

  # Partial outputs span every row of tiles, past M where clip_m leaves the last row of
  # tiles reaching beyond it: a (tiles, M) row partial's rows are contiguous, and Mosaic
  # GPU merges contiguous dimensions of a TMA store, so a store past M would land in the
  # next row instead of being dropped. Row partials are sliced back to M; column
  # partials keep their extra rows, which the caller's zero rows leave zero.
  rows_m = -(-m // config.cluster_tile[0]) * config.cluster_tile[0]
  partial_m = lambda o: m if o.kind == epi.OutputKind.TILE else rows_m

  def unclip(results):
    rows = (epi.OutputKind.ROW_PARTIAL, epi.OutputKind.ROW_TOTAL)
    return {nm: v[:, :m] if specs[nm].kind in rows and rows_m != m
            else v for nm, v in results.items()}

  # a memory warpgroup beside the two compute ones where there is a mainloop to feed
  warpgroups = 3 if mainloop else 2

  auto_barriers = pallas_auto_barriers()  # read once per build: every launch alike

  def make_kernel(in_place, smem_used):
    """The kernel, with the outputs in ``in_place`` written into their operands' Refs;
    ``smem_used``: its shared memory (``check_smem`` of what it stages), which sizes a
    traced kernel's profiler buffer."""
    return plgpu.kernel(
        functools.partial(body, input_names=names_in, input_kinds=staged(in_place),
                          outputs=outputs, epilogue=epilogue, in_place=in_place),
        out_type=tuple(
            jax.ShapeDtypeStruct(epi.output_shape(o, partial_m(o), n,
                                                  config.column_partial_rows,
                                                  config.epi_tile_n, config.tile_m,
                                                  config.tile_n), o.dtype)
            for o in outputs if o.name not in in_place),
        grid=(grid,), grid_names=("sm",), cluster=(cluster,), cluster_names=("cluster",),
        num_threads=warpgroups, thread_name="wg",
        kernel_name=kernel_name,  # in profiles
        # approx_math: SFU exp/sin/cos/division in epilogues (inputs are range-reduced
        # where that matters; see coda_jax.primitives.Rotate).
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup, approx_math=True,
            unsafe_no_auto_barriers=not auto_barriers,
            **(_trace_params(smem_used, warpgroups)
               if interpret is None else {})),
        interpret=interpret)

  lead = (a, b) if mainloop else ()
  # compiled kernels are lowered once per process and kept on disk (kernel_cache); a
  # traced one is not (its profiler buffer and output folder are not in the key)
  lowered_once = interpret is None and kernel_cache.active() and _trace is None
  if not in_place:
    fresh = lambda *xs: tuple(make_kernel({}, smem_used)(*xs))
    args = (*lead, *(kernel_inputs[nm] for nm in names_in))
    results = kernel_cache.launch(fresh, args) if lowered_once else fresh(*args)
    return unclip(dict(zip(names, results)))

  def run_in_place(*args):  # a and b where there is a product, then the operands
    # Optimization barriers on both sides of the aliased buffer: without them XLA's GPU
    # dynamic-slice fusion folds a slice feeding that operand (a scan's xs, its saved
    # residuals, z[i]) and a dynamic-update-slice taking the result (a scan's stacked
    # ys) into the kernel's custom call, ignoring its operand-output aliasing: the kernel
    # then writes into the caller's sliced array and the result is never written (wrong
    # values or NaN; docs/design.md#6-in-place-outputs-and-xla). The barriers copy
    # nothing.
    ops = dict(zip(names_in, args[len(lead):]))
    backing = {nm: jax.new_ref(lax.optimization_barrier(ops[nm]))
               for nm in in_place.values()}
    kernel = make_kernel(in_place, smem_used)
    results = iter(kernel(*args[:len(lead)], *(backing.get(nm, ops[nm]) for nm in names_in)))
    return tuple(lax.optimization_barrier(jax.freeze(backing[in_place[nm]]))
                 if nm in in_place else next(results) for nm in names)

  # The Refs live and die inside this function, so from outside it is a pure function of
  # its operands, which jax.checkpoint re-runs whole and vmap batches. Called bare, under
  # jax.checkpoint partial evaluation kept the Ref-writing kernel in the forward only,
  # and the backward's re-run read its fresh, unwritten Ref (the LM head's dW came back
  # zero; docs/design.md#6-in-place-outputs-and-xla). Under vmap the outputs are not
  # written in place (that only saves memory): every output is fresh, and plgpu.kernel
  # batches the call.
  run = jax.custom_batching.custom_vmap(
      (lambda *xs: kernel_cache.call(run_in_place, xs)) if lowered_once else run_in_place)

  @run.def_vmap
  def _batched(axis_size, in_batched, *args):
    # fresh outputs stage every operand, added-to ones included
    fresh = make_kernel({}, check_smem(staged({})))
    args = [x if batched else jnp.broadcast_to(x, (axis_size, *x.shape))
            for x, batched in zip(args, in_batched)]
    outs = jax.vmap(lambda *xs: tuple(fresh(*xs)))(*args)
    return outs, tuple(True for _ in outs)

  return unclip(dict(zip(names, run(*lead, *(kernel_inputs[nm] for nm in names_in)))))
