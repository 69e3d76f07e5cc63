"""Persistent, warp-specialised Hopper GEMM with a composable epilogue.

One memory warpgroup streams A and B tiles through a ``stages``-deep TMA ring into
shared memory; two compute warpgroups each own half of a CTA tile and issue wgmma into
fp32 register accumulators. When a tile's K loop ends, each compute warpgroup walks its
accumulator in (epi_tile_m, epi_tile_n) sub-tiles and calls the epilogue closure on each
(see ``epilogue.py``), then TMA-stores what the closure wrote. Stores are left in flight
while the next tile's mainloop starts; the memory warpgroup has already prefetched the
next tile's operands.

Operand orders: ``trans_a`` reads A stored (K, M), ``trans_b`` reads B stored (N, K);
both are fed to wgmma as transposed shared-memory views, so no transpose is materialised.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels import epilogue as epi

SMEM_LIMIT_BYTES = 227 * 1024  # sm90 per-block opt-in maximum
_SMEM_RESERVE_BYTES = 2304  # barriers and alignment padding (measured: ~2.1 KiB)
_REDUCTION_SCRATCH_BYTES = 2048  # plgpu.CompilerParams.reduction_scratch_bytes default


class MatDim(enum.IntEnum):
  M = 0
  N = 1


@dataclasses.dataclass(frozen=True)
class GemmConfig:
  """Tuning knobs. Tiles are per compute warpgroup; the CTA tile is two of them."""
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

  @property
  def cluster_tile(self) -> tuple[int, int]:
    """The unit the grid is divided into: a CTA tile, doubled along cluster_dim."""
    cm, cn = self.cta_tile
    return (cm * (2 if self.cluster_dim == MatDim.M else 1),
            cn * (2 if self.cluster_dim == MatDim.N else 1))

  @property
  def cta_tile(self) -> tuple[int, int]:
    return (self.tile_m * (2 if self.wg_dim == MatDim.M else 1),
            self.tile_n * (2 if self.wg_dim == MatDim.N else 1))

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


def _swizzle_transforms(minor_elems: int, dtype) -> tuple:
  swizzle = plgpu.find_swizzle(minor_elems * jnp.dtype(dtype).itemsize * 8)
  swizzle_elems = swizzle // jnp.dtype(dtype).itemsize
  return (plgpu.TilingTransform((8, swizzle_elems)), plgpu.SwizzleTransform(swizzle))


def smem_bytes(config: GemmConfig, dtype, input_kinds: dict, input_dtypes: dict,
               outputs: tuple[epi.EpilogueOutput, ...]) -> int:
  """Shared memory one CTA needs for this config and epilogue program: the pipeline
  ring plus exactly the buffers the epilogue allocates."""
  cm, cn = config.cta_tile
  total = config.stages * (cm + cn) * config.tile_k * jnp.dtype(dtype).itemsize
  for alloc in _Epilogue.scratch(config, input_kinds, input_dtypes, outputs).values():
    if isinstance(alloc, plgpu.Barrier):
      continue  # counted in the reserve
    # Mosaic aligns each buffer (swizzled ones to 1024 bytes): count whole KiB.
    total += -(-math.prod(alloc.shape) * jnp.dtype(alloc.dtype).itemsize // 1024) * 1024
  if any(o.kind == epi.OutputKind.COL_PARTIAL for o in outputs):
    total += _REDUCTION_SCRATCH_BYTES
  return total + _SMEM_RESERVE_BYTES


def default_config(m: int, n: int, k: int, dtype=jnp.bfloat16, *, input_kinds=None,
                   input_dtypes=None, outputs=(), min_epi_tile_n: int = 1,
                   trans_a: bool = False, trans_b: bool = False) -> GemmConfig:
  """Per-shape defaults: the largest tiles that divide the problem and fit in SMEM.

  Tuned on H100 (bench/tune_gemm.py, results in bench/results/): 256x128 CTA tiles (the
  warpgroups split M) in clusters of two along N that multicast A and N-minor order in
  bands of 16 were best or within 1% of best at every benchmark shape.
  ``trans_a`` / ``not trans_b`` (MN-major operands) need tile_k a multiple of 64.

  ``min_epi_tile_n``: the epilogue sub-tile width must be a multiple of this (the
  pair block of a pairwise epilogue).
  """
  input_kinds = input_kinds or {}
  input_dtypes = input_dtypes or {}
  candidates = [  # (tile_m, tile_n, wg_dim, cluster_dim), fastest first
      (128, 128, MatDim.M, MatDim.N), (128, 128, MatDim.M, None), (128, 128, MatDim.N, None),
      (128, 64, MatDim.N, None), (64, 128, MatDim.M, None), (64, 64, MatDim.N, None),
      (64, 32, MatDim.N, None), (128, 64, MatDim.M, None), (64, 64, MatDim.M, None)]
  # (tile_k, stages), deepest K in flight first: with a large epilogue, 5 stages of 32
  # beat 2 of 64 by 10% (bench/NOTES.md, the SwiGLU backward GEMM).
  depths = [(64, 4), (64, 3), (32, 6), (32, 5), (32, 4), (64, 2), (32, 3), (16, 6), (16, 4),
            (32, 2), (16, 2)]
  if trans_a or not trans_b:  # MN-major operands need tile_k = 64
    depths = [(tk, st) for tk, st in depths if tk == 64]
  for tm, tn, wg, cl in candidates:
    for tk, stages in depths:
      probe = GemmConfig(tile_m=tm, tile_n=tn, tile_k=tk, wg_dim=wg, cluster_dim=cl)
      cm, cn = probe.cluster_tile
      if _split_b_too_narrow(probe, trans_b) or k % tk or m % cm or n % cn:
        continue
      # Pipeline depth matters more than epilogue sub-tile width: try narrower sub-tiles
      # (smaller epilogue buffers) before fewer stages.
      for en in (64, 32, 16):
        en = max(min(en, tn), min_epi_tile_n)
        if tn % en or en % min_epi_tile_n:
          continue
        cfg = dataclasses.replace(probe, epi_tile_n=en, stages=stages)
        if smem_bytes(cfg, dtype, input_kinds, input_dtypes, outputs) <= SMEM_LIMIT_BYTES:
          return cfg
  raise ValueError(f"no GEMM tiling divides (M, N, K)=({m}, {n}, {k}) with an epilogue "
                   f"width that is a multiple of {min_epi_tile_n}: M and N must be "
                   "multiples of 64, and one of them of 128 when B is stored (K, N); K of "
                   "64 (of 16 with A (M, K) and B (N, K)); the epilogue's buffers must fit "
                   "in shared memory")


def interpret_params():
  """Mosaic GPU's CPU interpreter, for tests on machines without a Hopper GPU."""
  return plgpu.InterpretGPUParams()


def check_operands(a, b, trans_a=False, trans_b=False,
                   dtypes=(jnp.bfloat16, jnp.float16)) -> tuple[int, int, int]:
  """Validates GEMM operands (rank, shared dtype in ``dtypes``, K); returns (M, N, K)."""
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
  return config.wg_dim == MatDim.N and not trans_b and config.tile_n % 64 != 0


def _check_tiling(m, n, k, config: GemmConfig, trans_a: bool, trans_b: bool):
  config.check()
  if _split_b_too_narrow(config, trans_b):
    raise ValueError(f"tile_n={config.tile_n} with wg_dim=N and B stored (K, N): the "
                     "warpgroups' halves of B must be multiples of 64 columns")
  if (trans_a or not trans_b) and config.tile_k % 64:
    raise ValueError(f"tile_k={config.tile_k}: an operand stored MN-major (A as (K, M) or "
                     "B as (K, N)) needs tile_k to be a multiple of 64 for wgmma")
  cm, cn = config.cluster_tile
  if m % cm or n % cn or k % config.tile_k:
    raise ValueError(f"(M, N, K)=({m}, {n}, {k}) must be multiples of the cluster tile "
                     f"({cm}, {cn}, {config.tile_k}) of {config}")


# Tile operand kinds and their width in accumulator sub-tile widths.
_TILE_KINDS = {epi.InputKind.TILE: 1, epi.InputKind.WIDE_TILE: 2}


class _Epilogue:
  """One compute warpgroup's epilogue machinery: staging of extra
  operands, the sub-tile walk that calls the closure, and the TMA stores."""

  def __init__(self, cfg, in_gmem, out_gmem, input_kinds, outputs, epilogue, smem, wg):
    self.cfg, self.in_gmem, self.out_gmem = cfg, in_gmem, out_gmem
    self.kinds, self.outputs, self.fn, self.smem, self.wg = (
        input_kinds, outputs, epilogue, smem, wg)
    self.tiles_in = [nm for nm, kd in input_kinds.items() if kd in _TILE_KINDS]
    self.vecs_in = [nm for nm, kd in input_kinds.items() if kd not in _TILE_KINDS]
    em, en = cfg.epi_tile_m, cfg.epi_tile_n
    self.sub_tiles = [(i, j) for i in range(cfg.tile_m // em) for j in range(cfg.tile_n // en)]

  @staticmethod
  def scratch(cfg, input_kinds, input_dtypes, outputs) -> dict:
    em, en = cfg.epi_tile_m, cfg.epi_tile_n
    out = {}
    for o in outputs:  # [warpgroup, slot, *sub-tile]
      shape = o.subtile_shape(em, en)
      # 2-D tiles are TMA-stored through swizzled SMEM; 1-D partials need no swizzle.
      transforms = _swizzle_transforms(shape[-1], o.dtype) if len(shape) == 2 else ()
      out["o_" + o.name] = plgpu.SMEM((2, 2, *shape), o.dtype, transforms=transforms)
    tiles = [nm for nm, kd in input_kinds.items() if kd in _TILE_KINDS]
    vecs = [nm for nm, kd in input_kinds.items() if kd not in _TILE_KINDS]
    for nm in tiles:
      dt, w = input_dtypes[nm], en * _TILE_KINDS[input_kinds[nm]]
      out["i_" + nm] = plgpu.SMEM((2, 2, em, w), dt, transforms=_swizzle_transforms(w, dt))
    for nm in vecs:
      length = cfg.tile_m if input_kinds[nm] == epi.InputKind.ROW else cfg.tile_n
      out["i_" + nm] = plgpu.SMEM((2, length), input_dtypes[nm])
    if tiles:
      out["tile_bar"] = plgpu.Barrier(num_arrivals=len(tiles), num_barriers=4)
    if vecs:
      out["vec_bar"] = plgpu.Barrier(num_arrivals=len(vecs), num_barriers=2)
    if any(o.kind == epi.OutputKind.COL_PARTIAL for o in outputs):
      out["turn"] = plgpu.Barrier(num_arrivals=1, num_barriers=2)
    return out

  def _origin(self, s, row_base, col_base):
    i, j = self.sub_tiles[s]
    em, en = self.cfg.epi_tile_m, self.cfg.epi_tile_n
    return pl.multiple_of(row_base + i * em, em), pl.multiple_of(col_base + j * en, en)

  def _fetch_tiles(self, s, row_base, col_base):
    r0, c0 = self._origin(s, row_base, col_base)
    em, en = self.cfg.epi_tile_m, self.cfg.epi_tile_n
    for nm in self.tiles_in:
      w = en * _TILE_KINDS[self.kinds[nm]]
      cols = pl.ds(pl.multiple_of(c0 * _TILE_KINDS[self.kinds[nm]], w), w)
      plgpu.copy_gmem_to_smem(self.in_gmem[nm].at[pl.ds(r0, em), cols],
                              self.smem["i_" + nm].at[self.wg, s % 2],
                              self.smem["tile_bar"].at[self.wg * 2 + s % 2])

  def prefetch(self, row_base, col_base):
    """Issues the operand loads for the tile at (row_base, col_base); call before the
    mainloop so they land while it runs."""
    if not (self.vecs_in or self.tiles_in):
      return
    # The previous tile's epilogue may still be reading these buffers in other warps:
    # commit_smem ends with a warpgroup barrier.
    plgpu.commit_smem()
    for nm in self.vecs_in:
      if self.kinds[nm] == epi.InputKind.ROW:
        src = self.in_gmem[nm].at[pl.ds(row_base, self.cfg.tile_m)]
      else:
        src = self.in_gmem[nm].at[pl.ds(col_base, self.cfg.tile_n)]
      plgpu.copy_gmem_to_smem(src, self.smem["i_" + nm].at[self.wg],
                              self.smem["vec_bar"].at[self.wg])
    # Tile operands run two sub-tiles ahead of the epilogue, one per slot.
    for s in range(min(2, len(self.sub_tiles)) if self.tiles_in else 0):
      self._fetch_tiles(s, row_base, col_base)

  def run(self, acc, row_base, col_base):
    if self.vecs_in:
      plgpu.barrier_wait(self.smem["vec_bar"].at[self.wg])
    if "turn" not in self.smem:
      self._subtiles(acc, row_base, col_base)
      return
    # Column (cross-warp) reductions use compiler-placed SMEM scratch at one static
    # offset, the same for both warpgroups: take turns, warpgroup 0 first.
    turn = self.smem["turn"]
    pl.when(self.wg == 1)(lambda: plgpu.barrier_wait(turn.at[0]))
    self._subtiles(acc, row_base, col_base)
    pl.when(self.wg == 0)(lambda: plgpu.barrier_arrive(turn.at[0]))
    pl.when(self.wg == 1)(lambda: plgpu.barrier_arrive(turn.at[1]))
    pl.when(self.wg == 0)(lambda: plgpu.barrier_wait(turn.at[1]))

  def _subtiles(self, acc, row_base, col_base):
    em, en = self.cfg.epi_tile_m, self.cfg.epi_tile_n
    for s, (i, j) in enumerate(self.sub_tiles):
      slot = s % 2
      r0, c0 = self._origin(s, row_base, col_base)
      if self.tiles_in:
        plgpu.barrier_wait(self.smem["tile_bar"].at[self.wg * 2 + slot])
      # The stores issued two sub-tiles ago used this slot; at a tile's first sub-tile
      # the previous tile's last store may have used it too (odd sub-tile counts).
      plgpu.wait_smem_to_gmem(0 if s == 0 else 1, wait_read_only=True)
      tile = self._tile(slot, i, j, r0, c0)
      self.fn(tile, acc[i * em:(i + 1) * em, j * en:(j + 1) * en])
      missing = {o.name for o in self.outputs} - tile.stored
      if missing:
        raise ValueError(f"epilogue did not store outputs {sorted(missing)}")
      plgpu.commit_smem()  # also: every warp is done reading this slot's operands
      if self.tiles_in and s + 2 < len(self.sub_tiles):
        self._fetch_tiles(s + 2, row_base, col_base)
      for o in self.outputs:
        plgpu.copy_smem_to_gmem(self.smem["o_" + o.name].at[self.wg, slot],
                                self._window(o, r0, c0), commit_group=False)
      plgpu.commit_smem_to_gmem_group()

  def _tile(self, slot, i, j, r0, c0):
    em, en, smem, wg = self.cfg.epi_tile_m, self.cfg.epi_tile_n, self.smem, self.wg

    def reader(nm):
      kind = self.kinds[nm]
      if kind in _TILE_KINDS:
        return lambda: smem["i_" + nm].at[wg, slot][...]
      if kind == epi.InputKind.ROW:
        return lambda: epi.load_row(smem["i_" + nm].at[wg, pl.ds(i * em, em)])
      return lambda: epi.load_col(smem["i_" + nm].at[wg, pl.ds(j * en, en)])

    def writer(o):
      def write(value):
        smem["o_" + o.name][wg, slot] = value
      return write

    return epi.EpilogueTile(
        row0=r0, col0=c0, shape=(em, en),
        inputs={nm: (kind, reader(nm)) for nm, kind in self.kinds.items()},
        outputs={o.name: (o, writer(o)) for o in self.outputs})

  def _window(self, o, r0, c0):
    em, en = self.cfg.epi_tile_m, self.cfg.epi_tile_n
    ref = self.out_gmem[o.name]
    if o.kind == epi.OutputKind.ROW_PARTIAL:
      return ref.at[c0 // en, pl.ds(r0, em)]
    w = o.subtile_shape(em, en)[-1]
    cols = pl.ds(pl.multiple_of(o.scaled(c0), w), w)
    return ref.at[pl.ds(r0, em), cols] if o.kind == epi.OutputKind.TILE else ref.at[r0 // em, cols]


def _operand_views(a_smem, b_smem, trans_a, trans_b, wg_m, wg_n):
  """wgmma operands from shared-memory tiles, transposed views where stored so."""
  a_op = a_smem.at[:, wg_m].transpose((1, 0)) if trans_a else a_smem.at[wg_m]
  b_op = b_smem.at[wg_n].transpose((1, 0)) if trans_b else b_smem.at[:, wg_n]
  return a_op, b_op


def _kernel(a_gmem, b_gmem, *refs, cfg: GemmConfig, m, n, k, trans_a, trans_b,
            input_names, input_kinds, outputs, epilogue, in_place):
  """Both compute warpgroups share each CTA tile and each pipeline stage."""
  in_gmem = dict(zip(input_names, refs[:len(input_names)]))
  fresh = [o.name for o in outputs if o.name not in in_place]
  out_gmem = dict(zip(fresh, refs[len(input_names):]))
  out_gmem.update({o: in_gmem[i] for o, i in in_place.items()})
  dtype = a_gmem.dtype
  tm, tn, tk = cfg.tile_m, cfg.tile_n, cfg.tile_k
  cm, cn = cfg.cta_tile
  clm, cln = cfg.cluster_tile
  m_iters, n_iters, k_iters = m // clm, n // cln, k // tk
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
    ep = _Epilogue(cfg, in_gmem, out_gmem, input_kinds, outputs, epilogue, smem, wg)

    @plgpu.nd_loop((m_iters * n_iters,), collective_axes="sm")
    def _tile_loop(info):
      (lin,) = info.index
      mi, ni = plgpu.planar_snake(lin, (m_iters, n_iters), cfg.grid_minor_dim,
                                  cfg.grid_tile_width)
      if cfg.cluster_dim == MatDim.M:
        mi = mi * 2 + lax.axis_index("cluster")
      elif cfg.cluster_dim == MatDim.N:
        ni = ni * 2 + lax.axis_index("cluster")
      if cfg.wg_dim == MatDim.M:
        row_base, col_base = mi * cm + wg * tm, ni * cn
        wg_m, wg_n = pl.ds(wg * tm, tm), slice(None)
      else:
        row_base, col_base = mi * cm, ni * cn + wg * tn
        wg_m, wg_n = slice(None), pl.ds(wg * tn, tn)

      def compute_context(run_mainloop):
        ep.prefetch(row_base, col_base)

        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tm, tn), jnp.float32))
        def _acc_scope(acc_ref):
          run_mainloop(acc_ref)
          ep.run(acc_ref[...], row_base, col_base)

      def mma_body(_, a_smem, b_smem, acc_ref):
        plgpu.wgmma(acc_ref, *_operand_views(a_smem, b_smem, trans_a, trans_b, wg_m, wg_n))
        # Wait for this MMA before its slot is released: with the MMA left in flight
        # (delay_release) the pipeline never releases the last K step's slot, and the
        # next tile's prologue overwrites it while the MMA may still read it.
        plgpu.wgmma_wait(0)
        return acc_ref

      a_cta = a_gmem.at[:, pl.ds(mi * cm, cm)] if trans_a else a_gmem.at[pl.ds(mi * cm, cm)]
      b_cta = b_gmem.at[pl.ds(ni * cn, cn)] if trans_b else b_gmem.at[:, pl.ds(ni * cn, cn)]
      pipeline(mma_body, compute_context)(a_cta, b_cta, allocations=pipeline_allocs)

    plgpu.wait_smem_to_gmem(0, wait_read_only=False)

  ignore = lambda *_, **__: None
  pl.run_scoped(
      scope,
      pipeline_allocs=pipeline(ignore, ignore).get_allocations(a_gmem, b_gmem),
      collective_axes="wg",
      **_Epilogue.scratch(cfg, input_kinds, {nm: r.dtype for nm, r in in_gmem.items()},
                          outputs),
  )


def gemm(a: jax.Array, b: jax.Array, *,
         inputs: dict[str, tuple[epi.InputKind, jax.Array]] | None = None,
         epilogue: Callable | None = None,
         outputs: tuple[epi.EpilogueOutput, ...] | None = None,
         trans_a: bool = False, trans_b: bool = False,
         in_place: dict[str, str] | None = None,
         config: GemmConfig | None = None, num_sms: int | None = None,
         interpret=None) -> dict[str, jax.Array]:
  """Runs ``a @ b`` (operands optionally transposed) with an epilogue program.

  Args:
    a: (M, K), or (K, M) with ``trans_a``. bfloat16 or float16.
    b: (K, N), or (N, K) with ``trans_b``. Same dtype as ``a``.
    inputs: extra operands, name -> (kind, array); row (M,), col (N,), tile (M, N).
    epilogue: ``fn(tile, acc)``; default stores ``acc`` to the output ``"out"``.
    outputs: declared outputs; default one (M, N) ``"out"`` in ``a.dtype``.
    in_place: output name -> tile operand name: the output is written into that
      operand's buffer (a mutable ``jax.Ref`` inside; XLA reuses the buffer when the
      caller donates it), e.g. accumulating a gradient into its previous value. Each
      element is read before it is written, by the same CTA.
    config: tuning; default ``default_config`` for the shape and program.
    num_sms: size of the persistent grid; default the device's SM count.
    interpret: ``plgpu.InterpretGPUParams()`` to run on CPU through the interpreter.
  Returns:
    dict of output name to array, shapes per ``epilogue.output_shape``.
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
  if config is None:
    config = default_config(m, n, k, a.dtype, input_kinds=input_kinds,
                            input_dtypes=input_dtypes, outputs=outputs, trans_a=trans_a,
                            trans_b=trans_b)
  _check_tiling(m, n, k, config, trans_a, trans_b)
  for o in outputs:
    if (o.kind == epi.OutputKind.TILE
        and o.subtile_shape(config.epi_tile_m, config.epi_tile_n)[-1] % 8):
      raise ValueError(f"output {o.name!r}: epi_tile_n={config.epi_tile_n} * "
                       f"{o.width} must be a multiple of 8")
  need = smem_bytes(config, a.dtype, input_kinds, input_dtypes, outputs)
  if need > SMEM_LIMIT_BYTES:
    raise ValueError(f"{config} with this epilogue needs {need} bytes of shared memory, "
                     f"over the {SMEM_LIMIT_BYTES}-byte limit: lower stages or tiles")
  if num_sms is None:
    num_sms = jax.devices()[0].core_count if interpret is None else 2
  tiles = (m // config.cluster_tile[0]) * (n // config.cluster_tile[1])
  cluster = 1 if config.cluster_dim is None else 2
  out_type = tuple(
      jax.ShapeDtypeStruct(epi.output_shape(o, m, n, config.epi_tile_m, config.epi_tile_n),
                           o.dtype) for o in outputs if o.name not in in_place)
  names_in = tuple(inputs)
  if num_sms < cluster:
    raise ValueError(f"num_sms={num_sms} is smaller than the cluster ({cluster} CTAs) of "
                     f"{config}: pass cluster_dim=None or more SMs")
  grid = min(num_sms // cluster, tiles)
  kernel = plgpu.kernel(
      functools.partial(_kernel, cfg=config, m=m, n=n, k=k, trans_a=trans_a,
                        trans_b=trans_b, input_names=names_in, input_kinds=input_kinds,
                        outputs=outputs, epilogue=epilogue, in_place=in_place),
      out_type=out_type,
      grid=(grid,),
      grid_names=("sm",),
      cluster=(cluster,),
      cluster_names=("cluster",),
      num_threads=3,
      thread_name="wg",
      # approx_math: SFU exp/sin/cos/division in epilogues (inputs are range-reduced
      # where that matters; see coda_jax.primitives.Rotate).
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup, approx_math=True),
      interpret=interpret,
  )
  # Optimization barriers on both sides of the aliased buffer: without them XLA's GPU
  # dynamic-slice fusion folds a slice feeding that operand (a scan's xs, its saved
  # residuals, z[i]) and a dynamic-update-slice taking the result (a scan's stacked ys)
  # into the kernel's custom call, ignoring its operand-output aliasing: the kernel then
  # writes into the caller's sliced array and the result is never written (wrong values
  # or NaN; bench/NOTES.md, issue 4). The barriers copy nothing.
  backing = {nm: jax.new_ref(lax.optimization_barrier(inputs[nm][1]))
             for nm in in_place.values()}
  results = iter(kernel(a, b, *(backing.get(nm, inputs[nm][1]) for nm in names_in)))
  return {nm: lax.optimization_barrier(jax.freeze(backing[in_place[nm]])) if nm in in_place
          else next(results) for nm in names}
