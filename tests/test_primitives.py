"""Epilogue primitives and programs through coda_jax.gemm_epilogue, against the fp32
truth (coda_jax.reference on upcast inputs, fp32 stores) and the unfused-XLA emulation
(coda_jax.reference(..., round_to=dtype))."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import coda_jax as cj
from coda_jax import layout
from coda_jax.layernorm_ops import LayerNormInputGrad
from coda_jax.primitives import PickColumn
from coda_jax.qk_norm import HeadRmsNormGrad
import pallas_kernels
from pallas_kernels import (EpilogueOutput, GemmConfig, InputKind, MatDim, OutputKind,
                            Schedule)
from helpers import (GATED_ACTS, TALL, assert_within_baseline, f64, gemm_inputs,
                     matmul_f32, normal, rel_err, rope_freqs)

# K = 128: two K steps even with the default tile_k (a single K step is a mainloop case,
# covered in test_gemm_mainloop.py).
M, N, K = 256, 512, 128
REDUCTION_RTOL = 1e-5  # fp32 outputs accumulated in fp32 from the same inputs
P32, P64 = 32, 64

PROGRAMS = {
    "scale_const": [cj.ScaleConst(0.37), cj.Store("y")],
    "scale_row": [cj.ScaleRow("r"), cj.Store("y")],
    "scale_col": [cj.ScaleCol("g"), cj.Store("y")],
    "add_tile": [cj.AddTile("x0"), cj.Store("y")],
    "store_f32": [cj.Store("y", jnp.float32)],
    "silu32": [cj.Gated(P32), cj.Store("y")],
    "gelu32": [cj.Gated(P32, "gelu"), cj.Store("y")],
    "silu64": [cj.Gated(P64), cj.Store("y")],
    "gelu64": [cj.Gated(P64, "gelu"), cj.Store("y")],
    "rope32": [cj.Rotate("pos", "fr32", P32), cj.Store("y")],
    "rope64": [cj.Rotate("pos", "fr64", P64), cj.Store("y")],
    "rowsum": [cj.RowSum("s")],
    "rowsum_sq": [cj.RowSum("s", square=True)],
    "lse": [cj.RowLogSumExp("lse")],
    "colsum": [cj.ColSum("c")],
    "rowdot": [cj.RowDot("x0", "s")],
    # compositions
    "residual_norm": [cj.AddTile("x0"), cj.Store("x1"), cj.RowSum("ss", square=True),
                      cj.ScaleCol("g"), cj.Store("h")],
    "norm_swiglu": [cj.ScaleRow("r"), cj.Gated(P32), cj.Store("y")],
    "norm_rope": [cj.ScaleRow("r"), cj.Rotate("pos", "fr32", P32), cj.Store("q")],
    "norm_lse": [cj.ScaleRow("r"), cj.RowLogSumExp("lse")],
    "colsum_store": [cj.ColSum("c"), cj.Store("o")],
    "everything": [cj.ScaleConst(0.125), cj.ScaleCol("g"), cj.AddTile("x0"), cj.Store("y"),
                   cj.ColSum("c"), cj.RowSum("s")],
    "geglu_rowsum": [cj.ScaleRow("r"), cj.Gated(P32, "gelu"), cj.RowSum("s", square=True),
                     cj.Store("y")],
    "swiglu_colsum": [cj.Gated(P32), cj.ColSum("c"), cj.Store("y")],  # (N/2,) sums
    # B's sums over K from the mainloop (a weight gradient's bias gradient)
    "b_colsum": [cj.Store("y"), cj.BColumnSum("db")],
    "swiglu_b_colsum": [cj.Gated(P32), cj.BColumnSum("db"), cj.Store("y")],  # (N,) sums
}


@pytest.fixture(autouse=True)
def two_sm_grid(monkeypatch):
  """gemm_epilogue sizes the persistent grid by the SM count: at these small shapes a
  GPU would run one tile per CTA. Two SMs make every CTA loop over several tiles, as
  the interpreter does by default, so that buffer reuse across tiles is tested."""
  real = pallas_kernels.gemm
  monkeypatch.setattr(pallas_kernels, "gemm", lambda *a, **kw: real(*a, **{"num_sms": 2, **kw}))


def make_operands(key, program, m, n, dtype):
  ks = jax.random.split(key, 4)
  pool = {
      "r": lambda: normal(ks[0], (m,)),
      "g": lambda: normal(ks[1], (n,)),
      "x0": lambda: normal(ks[2], (m, n), dtype),
      "pos": lambda: jax.random.randint(ks[3], (m,), 0, 8192, jnp.int32),
      "fr32": lambda: rope_freqs(n, P32),
      "fr64": lambda: rope_freqs(n, P64),
      # a per-head 0/1 flag (heads of 32 columns) that changes within 64-wide sub-tiles
      # and between them: HeadRmsNormGrad's branch reads it at each head's first column
      "hsel": lambda: jnp.repeat((jnp.arange(n // 32) * 5 % 3 != 0).astype(jnp.float32), 32),
  }
  # other names: unit normal by their kind ((M, N) tiles in ``dtype``)
  by_kind = {InputKind.TILE: lambda k: normal(k, (m, n), dtype),
             InputKind.ROW: lambda k: normal(k, (m,)), InputKind.COL: lambda k: normal(k, (n,))}
  kinds = {nm: kind for prim in program for nm, kind in prim.inputs().items()}
  return {nm: pool[nm]() if nm in pool else by_kind[kind](jax.random.fold_in(key, i + 4))
          for i, (nm, kind) in enumerate(sorted(kinds.items()))}


def f32_stores(program):
  return [dataclasses.replace(p, dtype=jnp.float32) if isinstance(p, cj.Store) else p
          for p in program]


def alt_config(program):
  """Warpgroups split along M, clusters of two along M: 4 cluster tiles at (M, N).
  Epilogue sub-tiles as wide as the program's pair block (64 or 128): two or one per
  warpgroup."""
  pair = max([p.column_group() for p in program if p.column_group()] + [64])
  return GemmConfig(tile_m=64, tile_n=128, tile_k=64, stages=3, wg_dim=MatDim.M,
                    epi_tile_n=pair, cluster_dim=MatDim.M)


def pingpong_config(program):
  """Ping-pong: each warpgroup owns (64, 128) tiles, clusters of two along N multicast
  A: 8 tiles over 2 clusters, so each warpgroup runs two and their epilogues alternate
  (column partials take turns across the two)."""
  pair = max([p.column_group() for p in program if p.column_group()] + [64])
  return GemmConfig(tile_m=64, tile_n=128, tile_k=64, stages=3, epi_tile_n=pair,
                    cluster_dim=MatDim.N, schedule=Schedule.PINGPONG)


CONFIGS = {"default": lambda program: None, "alt": alt_config, "pingpong": pingpong_config}


def check_program(a, b, program, operands, impl, *, trans_a=False, trans_b=False,
                  config=None):
  """Runs the program and checks every output; returns (got, fp32 truth)."""
  got = cj.gemm_epilogue(a, b, program, operands, trans_a=trans_a, trans_b=trans_b,
                         impl=impl, config=config)
  up = lambda x: x.astype(jnp.float32)
  truth = cj.reference(up(a), up(b), f32_stores(program), operands, trans_a=trans_a,
                       trans_b=trans_b)
  unfused = cj.reference(a, b, program, operands, trans_a=trans_a, trans_b=trans_b,
                         round_to=a.dtype)
  assert set(got) == set(truth)
  stores = {p.name: jnp.dtype(p.dtype) for p in program if isinstance(p, cj.Store)}
  for name in got:
    assert got[name].shape == truth[name].shape, name
    if name in stores:
      assert got[name].dtype == stores[name], name
      assert_within_baseline(got[name], truth[name], unfused[name], name)
    else:  # a reduction: fp32, accumulated in fp32 from the same inputs as the truth
      assert got[name].dtype == jnp.float32, name
      assert np.all(np.isfinite(f64(got[name]))), name
      assert rel_err(got[name], truth[name]) < REDUCTION_RTOL, name
  return got, truth


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("name", PROGRAMS)
def test_program(key, kernel_impl, name, config):
  program = PROGRAMS[name]
  a, b = gemm_inputs(key, M, N, K, jnp.bfloat16)
  ops = make_operands(jax.random.fold_in(key, 1), program, M, N, a.dtype)
  check_program(a, b, program, ops, kernel_impl, config=CONFIGS[config](program))


@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (True, False), (False, True),
                                             (True, True)], ids=["nn", "tn", "nt", "tt"])
def test_transposed_operands(key, kernel_impl, trans_a, trans_b):
  program = [cj.ScaleRow("r"), cj.ScaleCol("g"), cj.Store("y"), cj.RowSum("s"),
             cj.BColumnSum("db")]
  a, b = gemm_inputs(key, 128, 256, 128, jnp.bfloat16, trans_a, trans_b)
  ops = make_operands(jax.random.fold_in(key, 1), program, 128, 256, a.dtype)
  check_program(a, b, program, ops, kernel_impl, trans_a=trans_a, trans_b=trans_b)


@pytest.mark.parametrize("name", ["residual_norm", "norm_swiglu"])
def test_float16(key, kernel_impl, name):
  program = [dataclasses.replace(p, dtype=jnp.float16) if isinstance(p, cj.Store) else p
             for p in PROGRAMS[name]]
  a, b = gemm_inputs(key, 128, 256, 128, jnp.float16)
  ops = make_operands(jax.random.fold_in(key, 1), program, 128, 256, a.dtype)
  check_program(a, b, program, ops, kernel_impl)


@pytest.mark.parametrize("scaled", [False, True])
def test_logsumexp_matches_jax(key, kernel_impl, scaled):
  a, b = gemm_inputs(key, M, N, K, jnp.bfloat16)
  r = normal(jax.random.fold_in(key, 1), (M,))
  program = ([cj.ScaleRow("r")] if scaled else []) + [cj.RowLogSumExp("lse")]
  got = cj.gemm_epilogue(a, b, program, {"r": r} if scaled else {}, impl=kernel_impl)
  x = matmul_f32(a, b) * (r[:, None] if scaled else 1.0)
  want = jax.nn.logsumexp(x, axis=1)
  assert rel_err(got["lse"], want) < REDUCTION_RTOL


def rope_rotate_half(x, pos, freqs, p):
  """Textbook rotate-half RoPE in float64: per head of width 2p,
  x * cos + rotate_half(x) * sin, rotate_half([x1, x2]) = [-x2, x1]."""
  x, pos, freqs = np.asarray(x, np.float64), np.asarray(pos, np.float64), np.asarray(freqs, np.float64)
  out = np.empty_like(x)
  for h in range(x.shape[1] // (2 * p)):
    sl = slice(2 * p * h, 2 * p * (h + 1))
    xh = x[:, sl]
    ang = pos[:, None] * freqs[None, sl]
    rot = np.concatenate([-xh[:, p:], xh[:, :p]], axis=1)
    out[:, sl] = xh * np.cos(ang) + rot * np.sin(ang)
  return out


@pytest.mark.parametrize("p", [P32, P64])
def test_layout_rope_freqs_follow_llama(p):
  """The library's freqs operand against this file's independent definition."""
  got = np.asarray(layout.rope_freqs(N, 2 * p, theta=500000.0, passthrough_heads=(0, 3)))
  want = np.asarray(rope_freqs(N, p, theta=500000.0, zero_blocks=(0, 3)))
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("p", [P32, P64])
def test_rotate_is_rotate_half_rope(key, kernel_impl, p):
  a, b = gemm_inputs(key, M, N, K, jnp.bfloat16)
  pos = jax.random.randint(jax.random.fold_in(key, 1), (M,), 0, 8192, jnp.int32)
  freqs = rope_freqs(N, p)
  got = cj.gemm_epilogue(a, b, [cj.Rotate("pos", "fr", p), cj.Store("q")],
                         {"pos": pos, "fr": freqs}, impl=kernel_impl)["q"]
  truth = rope_rotate_half(f64(matmul_f32(a, b)), pos, freqs, p)
  # Unfused yardstick: XLA's bf16 GEMM output, RoPE, rounded to bf16 again.
  unfused = jnp.asarray(rope_rotate_half(f64(jnp.matmul(a, b)), pos, freqs, p),
                        jnp.float32).astype(jnp.bfloat16)
  assert_within_baseline(got, truth, unfused, "rope")


def test_zero_frequency_block_passes_through(key, kernel_impl):
  a, b = gemm_inputs(key, M, N, K, jnp.bfloat16)
  ops = {"r": normal(jax.random.fold_in(key, 1), (M,)),
         "pos": jax.random.randint(jax.random.fold_in(key, 2), (M,), 1, 8192, jnp.int32),
         "fr": rope_freqs(N, P32, zero_blocks=(1, 5))}
  config = GemmConfig(tile_m=128, tile_n=128, tile_k=64, stages=3, epi_tile_n=64,
                      wg_dim=MatDim.N, cluster_dim=None)
  rot = cj.gemm_epilogue(a, b, [cj.ScaleRow("r"), cj.Rotate("pos", "fr", P32), cj.Store("q")],
                         ops, impl=kernel_impl, config=config)["q"]
  plain = cj.gemm_epilogue(a, b, [cj.ScaleRow("r"), cj.Store("q")], {"r": ops["r"]},
                           impl=kernel_impl, config=config)["q"]
  rot, plain = f64(rot), f64(plain)
  zero = np.asarray(ops["fr"]) == 0
  assert zero.sum() == 2 * 2 * P32
  np.testing.assert_array_equal(rot[:, zero], plain[:, zero])
  assert rel_err(rot[:, ~zero], plain[:, ~zero]) > 0.1  # the other heads did rotate


@pytest.mark.parametrize("slots,early", [(1, False), (2, False), (3, False), (8, False),
                                         (1, True), (3, True)])
@pytest.mark.parametrize("schedule", list(Schedule), ids=lambda s: s.value)
def test_tile_operand_slots(key, kernel_impl, races_checked, schedule, slots, early):
  """Tile operands staged 1 (each sub-tile's load waits for the previous one to be
  read), 2, 3 (not dividing the 8 sub-tiles) or all 8 sub-tiles ahead of the
  epilogue, over several tiles per SM, each slot refilled after its sub-tile's program
  or (``early``) as soon as its operands are in registers; under the race detector
  when interpreted."""
  _check_slots(key, kernel_impl, races_checked, "residual_norm", schedule=schedule,
               epi_operand_slots=slots, epi_operand_refetch_early=early)


@pytest.mark.parametrize("slots,late", [(1, False), (3, False), (8, False), (1, True),
                                        (3, True)])
@pytest.mark.parametrize("schedule", list(Schedule), ids=lambda s: s.value)
def test_output_slots(key, kernel_impl, races_checked, schedule, slots, late):
  """Whole-sub-tile outputs (a tile, a row and a column partial) staged in 1 (each
  store waits for the previous one to be read), 3 (not dividing the 8 sub-tiles, so a
  tile's slots restart mid-cycle) or all 8 slots, beside a tile operand in 2, over
  several tiles per SM, the slot waited for before the program or (``late``,
  ``epi_store_wait_late``) after it; under the race detector when interpreted."""
  _check_slots(key, kernel_impl, races_checked, "everything", schedule=schedule,
               epi_out_slots=slots, epi_store_wait_late=late)


@pytest.mark.parametrize("late", [False, True])
@pytest.mark.parametrize("schedule", list(Schedule), ids=lambda s: s.value)
def test_auto_barriers_change_no_bits(key, kernel_impl, monkeypatch, schedule, late):
  """Kernels are built without Pallas's auto barriers (``gemm_mgpu.AUTO_BARRIERS_ENV``):
  on the GPU, the program with a tile operand and tile, row and column partial outputs,
  staged in one output slot (each sub-tile's store waits for the last one to be read)
  waited for before or after the program, over several tiles per SM, gives the same bits
  with and without them, and both are checked against the truth. (The interpreter runs
  a warpgroup as one thread: it has no barriers within one to drop.)"""
  if kernel_impl != "mosaic":
    pytest.skip("auto barriers exist in compiled kernels only; the interpreter runs each "
                "warpgroup as one thread")
  from pallas_kernels import kernel_cache
  program = PROGRAMS["everything"]
  a, b = gemm_inputs(key, 256, 256, K, jnp.bfloat16)
  ops = make_operands(jax.random.fold_in(key, 1), program, 256, 256, a.dtype)
  config = GemmConfig(tile_m=128, tile_n=128, tile_k=64, stages=2, epi_tile_n=32,
                      cluster_dim=None, schedule=schedule, epi_out_slots=1,
                      epi_store_wait_late=late)
  got = {}
  for setting in ("1", "0"):
    monkeypatch.setenv(pallas_kernels.gemm_mgpu.AUTO_BARRIERS_ENV, setting)
    before = sum(kernel_cache.counts.values())
    got[setting], _ = check_program(a, b, program, ops, kernel_impl, config=config)
    # each setting built its kernel (found by its own key: test_kernel_cache's
    # test_kernels_built_without_auto_barriers), none came from a jit cache
    assert sum(kernel_cache.counts.values()) > before
  for name in got["1"]:
    np.testing.assert_array_equal(np.asarray(got["0"][name]), np.asarray(got["1"][name]),
                                  err_msg=name)


def _check_slots(key, kernel_impl, races_checked, name, **config_fields):
  """PROGRAMS[name] at 256 x 256 on 128x128 warpgroup tiles of 8 (64, 32) epilogue
  sub-tiles, with ``config_fields`` (the schedule and a slot count), against the truth
  and, when interpreted, the race detector."""
  program = PROGRAMS[name]
  a, b = gemm_inputs(key, 256, 256, K, jnp.bfloat16)
  ops = make_operands(jax.random.fold_in(key, 1), program, 256, 256, a.dtype)
  config = GemmConfig(tile_m=128, tile_n=128, tile_k=64, stages=2, epi_tile_n=32,
                      cluster_dim=None, **config_fields)
  check_program(a, b, program, ops, kernel_impl, config=config)
  assert not races_checked.races_found(), "data race in the kernel (see stdout)"


# Warpgroup tiles other than 128 x 128, each over several tiles per warpgroup: ping-pong
# 192-row ones (three rows of sub-tiles), 192-column ones (two m64n192 wgmmas a K step)
# and the cooperative 192-row ones (docs/tuning.md#wide-128-x-192-tiles): (config, M, N)
WIDE_TILE_CONFIGS = {
    "pingpong_192x128_clN": (GemmConfig(tile_m=192, tile_n=128, tile_k=64, stages=3,
                                        epi_tile_n=64, cluster_dim=MatDim.N,
                                        schedule=Schedule.PINGPONG), 384, 512),
    "pingpong_128x192_clM": (GemmConfig(tile_m=128, tile_n=192, tile_k=64, stages=3,
                                        epi_tile_n=64, cluster_dim=MatDim.M,
                                        schedule=Schedule.PINGPONG), 512, 384),
    "cooperative_128x192_clN": (GemmConfig(tile_m=128, tile_n=192, tile_k=64, stages=2,
                                           epi_tile_n=64, cluster_dim=MatDim.N), 512, 768),
    "cooperative_192x128_clN": (GemmConfig(tile_m=192, tile_n=128, tile_k=64, stages=2,
                                           epi_tile_n=64, cluster_dim=MatDim.N), 768, 512),
}


@pytest.mark.parametrize("name", ["everything", "silu32"])
@pytest.mark.parametrize("config", WIDE_TILE_CONFIGS)
def test_wide_and_tall_tiles(key, kernel_impl, races_checked, config, name):
  """192-row ping-pong tiles, 128 x 192 tiles (both schedules) and cooperative 192 x 128
  ones, with a scaled store, a tile operand and row and column partials, and with a
  gated pair program (pair blocks across the 192 columns); under the race detector when
  interpreted."""
  cfg, m, n = WIDE_TILE_CONFIGS[config]
  program = PROGRAMS[name]
  a, b = gemm_inputs(key, m, n, K, jnp.bfloat16)
  ops = make_operands(jax.random.fold_in(key, 1), program, m, n, a.dtype)
  check_program(a, b, program, ops, kernel_impl, config=cfg)
  assert not races_checked.races_found(), "data race in the kernel (see stdout)"


@pytest.mark.parametrize("schedule", list(Schedule), ids=lambda s: s.value)
@pytest.mark.parametrize("name", ["residual_norm", "norm_rope", "colsum_store"])
def test_race_free(key, race_detector, name, schedule):
  """Epilogue operands and outputs are double-buffered across sub-tiles and tiles: run
  several tiles per SM (two sub-tiles per warpgroup) under the race detector."""
  program = PROGRAMS[name]
  a, b = gemm_inputs(key, 256, 256, K, jnp.bfloat16)
  ops = make_operands(jax.random.fold_in(key, 1), program, 256, 256, a.dtype)
  # cooperative: 4 CTA tiles; ping-pong: 8 warpgroup tiles. Two sub-tiles per warpgroup.
  config = GemmConfig(tile_m=128, tile_n=64, tile_k=64, stages=3, epi_tile_n=64,
                      wg_dim=MatDim.N, cluster_dim=None, schedule=schedule)
  check_program(a, b, program, ops, "interpret", config=config)
  assert not race_detector.races_found(), "data race in the kernel (see stdout)"


# name -> (program, epi_tile_n, epi_store_n)
SPLIT_STORE_PROGRAMS = {
    # 128-wide RoPE heads (one sub-tile each) with tile outputs stored in halves, beside
    # a tile operand and row and column partials, which stay whole; the two bf16 tile
    # outputs (x1, q) take turns through one ring of staging slots
    "mixed": ([cj.AddTile("x0"), cj.Store("x1"), cj.RowSum("ss", square=True),
               cj.ColSum("c"), cj.ScaleRow("r"), cj.Rotate("pos", "fr64", P64), cj.Store("q")],
              128, 64),
    # a gated pair halves the output: 64-wide sub-tiles stored in 32-wide parts
    "silu64": (PROGRAMS["silu64"], 128, 64),
    # two bf16 tile outputs of 64-wide sub-tiles (a head_dim 64 QKV projection's u and
    # qkv) in 32-wide halves through one ring (autotune._deeper_in_halves)
    "two_outputs_in_32": ([cj.ScaleRow("r"), cj.Store("x1"), cj.RowSum("ss", square=True),
                           cj.Rotate("pos", "fr32", P32), cj.Store("q")], 64, 32),
}


@pytest.mark.parametrize("schedule", list(Schedule), ids=lambda s: s.value)
@pytest.mark.parametrize("name", SPLIT_STORE_PROGRAMS)
def test_stores_in_parts(key, kernel_impl, races_checked, name, schedule):
  """``epi_store_n``: epilogue sub-tiles whose tile outputs are staged and stored in
  halves (128-wide in 64-wide ones, 64-wide in 32-wide ones), over several tiles per SM;
  under the race detector when interpreted."""
  program, epi_n, store_n = SPLIT_STORE_PROGRAMS[name]
  m, n = 512, 256
  a, b = gemm_inputs(key, m, n, K, jnp.bfloat16)
  ops = make_operands(jax.random.fold_in(key, 1), program, m, n, a.dtype)
  config = GemmConfig(tile_m=64, tile_n=128, tile_k=64, stages=2, epi_tile_n=epi_n,
                      epi_store_n=store_n, cluster_dim=None, schedule=schedule)
  check_program(a, b, program, ops, kernel_impl, config=config)
  assert not races_checked.races_found(), "data race in the kernel (see stdout)"


@pytest.mark.parametrize("schedule", list(Schedule), ids=lambda s: s.value)
def test_stores_in_parts_beside_whole_stores(key, kernel_impl, races_checked, schedule):
  """Two 128-wide sub-tiles per warpgroup tile: the tile outputs stored in halves, the
  partials (stored whole) through one slot, so each sub-tile's whole stores wait for
  the last ones while the parts' store groups come between them."""
  program = SPLIT_STORE_PROGRAMS["mixed"][0]
  m, n = 512, 256
  a, b = gemm_inputs(key, m, n, K, jnp.bfloat16)
  ops = make_operands(jax.random.fold_in(key, 1), program, m, n, a.dtype)
  config = GemmConfig(tile_m=64, tile_n=256, tile_k=64, stages=2, epi_tile_n=128,
                      epi_store_n=64, cluster_dim=None, schedule=schedule,
                      wg_dim=MatDim.M, epi_out_slots=1, epi_operand_slots=1)
  check_program(a, b, program, ops, kernel_impl, config=config)
  assert not races_checked.races_found(), "data race in the kernel (see stdout)"


# ---- independent oracles ---------------------------------------------------------------
# test_program's truth is coda_jax.reference, which runs the primitives' own ``apply``: a
# wrong formula there passes it. Here each primitive runs through the kernel and every
# output is held to a formula written in this file (numpy, float64), from the
# accumulator x = a @ b and the operands. ``q`` is what the formula rounds each
# intermediate with: the identity for the truth, bf16 for the unfused-XLA baseline.
OM, ON, OK = 128, 128, 64
# warpgroups split M: two (64, 64) epilogue sub-tiles per CTA tile and two CTA tiles, so
# row reductions finish two column partials and column reductions two row partials
ORACLE_CONFIG = GemmConfig(tile_m=64, tile_n=64, tile_k=64, stages=2, epi_tile_n=64,
                           wg_dim=MatDim.M, cluster_dim=None)


def _pairs(x, p):
  """(first, second) members of the column pairs of 2p-wide blocks, each (M, N/2p, p)."""
  x = x.reshape(x.shape[0], -1, 2, p)
  return x[:, :, 0], x[:, :, 1]


def _gated_oracle(act):
  def formula(x, o, q):
    a, b = _pairs(x, P32)
    return {"y": q(q(act(a)) * b).reshape(x.shape[0], -1),
            "y32": (act(a) * b).reshape(x.shape[0], -1)}
  return formula


def _lse(x):
  mx = x.max(axis=1, keepdims=True)
  return (mx + np.log(np.exp(x - mx).sum(axis=1, keepdims=True)))[:, 0]


def _picked(x, idx):
  idx = idx.astype(np.int64)
  valid = (idx >= 0) & (idx < x.shape[1])
  picked = np.take_along_axis(x, np.clip(idx, 0, x.shape[1] - 1)[:, None], axis=1)[:, 0]
  return np.where(valid, picked, 0.0)


# The gated rows also store fp32: a slightly wrong activation (sigmoid(1.01 a), or GELU's
# erf form for its tanh form, 2e-4 apart) hides under bf16 rounding. Their bound is the
# accuracy of the kernel's fast math on the GPU (approx_math), with margin: the H100
# measured 2.3e-6 for gelu.
ACT_RTOL = {"silu": 1e-5, "gelu": 2e-5}

# name -> (program, formula(x, operands, q) -> {output: value}); operands are float64
# numpy. bf16 outputs are held to the tolerance rule; fp32 ones (reductions, accumulated
# in fp32 from the same inputs; fp32 stores) to REDUCTION_RTOL, or the row's ACT_RTOL.
ORACLES = {
    "scale_const": ([cj.ScaleConst(0.37), cj.Store("y")], lambda x, o, q: {"y": q(0.37 * x)}),
    "scale_row": ([cj.ScaleRow("r"), cj.Store("y")],
                  lambda x, o, q: {"y": q(o["r"][:, None] * x)}),
    "scale_col": ([cj.ScaleCol("g"), cj.Store("y")],
                  lambda x, o, q: {"y": q(x * o["g"][None, :])}),
    "add_tile": ([cj.AddTile("x0"), cj.Store("y")], lambda x, o, q: {"y": q(x + o["x0"])}),
    "store": ([cj.Store("y")], lambda x, o, q: {"y": q(x)}),
    "store_f32": ([cj.Store("y", jnp.float32)], lambda x, o, q: {"y": x}),
    "silu": ([cj.Gated(P32), cj.Store("y"), cj.Store("y32", jnp.float32)],
             _gated_oracle(GATED_ACTS["silu"])),
    "gelu": ([cj.Gated(P32, "gelu"), cj.Store("y"), cj.Store("y32", jnp.float32)],
             _gated_oracle(GATED_ACTS["gelu"])),
    "rope": ([cj.Rotate("pos", "fr32", P32), cj.Store("y")],
             lambda x, o, q: {"y": q(rope_rotate_half(x, o["pos"], o["fr32"], P32))}),
    "rowsum": ([cj.RowSum("s")], lambda x, o, q: {"s": x.sum(axis=1)}),
    "rowsum_sq": ([cj.RowSum("s", square=True)], lambda x, o, q: {"s": (x * x).sum(axis=1)}),
    "lse": ([cj.RowLogSumExp("l")], lambda x, o, q: {"l": _lse(x)}),
    "colsum": ([cj.ColSum("c")], lambda x, o, q: {"c": x.sum(axis=0)}),
    "rowdot": ([cj.RowDot("x0", "s")], lambda x, o, q: {"s": (x * o["x0"]).sum(axis=1)}),
    "pick": ([PickColumn("idx", "p")], lambda x, o, q: {"p": _picked(x, o["idx"])}),
}


def _oracle_operands(key, program):
  ks = jax.random.split(key, 5)
  # indices: the first and last column of each sub-tile, and outside [0, N) (pick nothing)
  idx = jax.random.randint(ks[3], (OM,), 0, ON).at[:6].set(jnp.array([0, 63, 64, ON - 1,
                                                                      -100, ON]))
  pool = {"r": normal(ks[0], (OM,)), "g": normal(ks[1], (ON,)),
          "x0": normal(ks[2], (OM, ON), jnp.bfloat16), "idx": idx.astype(jnp.int32),
          "pos": jax.random.randint(ks[4], (OM,), 0, 8192, jnp.int32),
          "fr32": rope_freqs(ON, P32)}
  return {nm: pool[nm] for prim in program for nm in prim.inputs()}


@pytest.mark.parametrize("name", ORACLES)
def test_primitive_against_independent_formula(key, kernel_impl, name):
  """Each forward primitive through the kernel, every output against this file's own
  formula: fp32 truth on the upcast inputs; bound 2x the error of the formula run as
  an unfused bf16 graph (from XLA's bf16 GEMM output), overall and per row."""
  program, formula = ORACLES[name]
  rtol = ACT_RTOL.get(name, REDUCTION_RTOL)
  a, b = gemm_inputs(key, OM, ON, OK, jnp.bfloat16)
  b = b * OK ** -0.5  # x ~ N(0, 1): activations and exponentials in their working range
  ops = _oracle_operands(jax.random.fold_in(key, 1), program)
  got = cj.gemm_epilogue(a, b, program, ops, impl=kernel_impl, config=ORACLE_CONFIG)
  ops64 = {k: f64(v) for k, v in ops.items()}
  bf16 = lambda v: f64(jnp.asarray(v, jnp.float32).astype(jnp.bfloat16))
  truth = formula(f64(a) @ f64(b), ops64, lambda v: v)
  unfused = formula(bf16(jnp.matmul(a, b)), ops64, bf16)
  assert set(got) == set(truth)
  stores = {p.name: jnp.dtype(p.dtype) for p in program if isinstance(p, cj.Store)}
  for out, want in truth.items():
    assert got[out].shape == want.shape, out
    if out in stores and stores[out] != jnp.float32:
      assert got[out].dtype == stores[out], out
      assert_within_baseline(got[out], want, unfused[out], f"{name}:{out}")
    else:  # fp32 from the fp32 accumulator
      assert got[out].dtype == jnp.float32, out
      assert np.all(np.isfinite(f64(got[out]))), out
      e = rel_err(got[out], want)
      assert e < rtol, f"{name}:{out}: rel err {e:.3g} >= {rtol}"


# Epilogue sub-tiles taller than one 64-row wgmma block: fewer column sums and store
# rounds a tile. The search tries them for passes only (under a mainloop they ran level
# or slower on the H100), but a caller's config may name them.
TALL_SUBTILE_CONFIGS = {
    "pingpong_e128x32": GemmConfig(tile_m=128, tile_n=64, tile_k=64, stages=2,
                                   epi_tile_m=128, epi_tile_n=32, cluster_dim=None,
                                   schedule=Schedule.PINGPONG),
    "pingpong192_e192x16": dataclasses.replace(TALL["tall"], epi_tile_m=192, epi_tile_n=16),
    "cooperative_e128x32": GemmConfig(tile_m=128, tile_n=64, tile_k=64, stages=2,
                                      epi_tile_m=128, epi_tile_n=32, wg_dim=MatDim.N,
                                      cluster_dim=None),
}


@pytest.mark.parametrize("config", TALL_SUBTILE_CONFIGS)
def test_tall_subtiles(key, kernel_impl, config):
  """A tile operand, a column sum, a row sum and a store in 128- and 192-row sub-tiles
  (M = 384: two or three tiles down, several per SM), every output against fp32."""
  program = [cj.MulTile("s"), cj.ColSum("c"), cj.RowSum("r", square=True), cj.Store("o")]
  a, b = gemm_inputs(key, 384, 256, K, jnp.bfloat16, trans_b=True)
  ops = make_operands(jax.random.fold_in(key, 1), program, 384, 256, a.dtype)
  check_program(a, b, program, ops, kernel_impl, trans_b=True,
                config=TALL_SUBTILE_CONFIGS[config])


# Column partials per warpgroup tile (``epi_column_sums_per_tile``): each column block's
# sub-tiles run down the tile, a sum stored through ``tile.store_column_sum`` is added
# over them in registers and summed across warps once, a finished sum stored through
# ``tile.store`` is added after. Two rows of sub-tiles a warpgroup tile in each config.
PER_TILE_CONFIGS = {
    "pingpong": GemmConfig(tile_m=128, tile_n=64, tile_k=64, stages=2, epi_tile_n=32,
                           cluster_dim=None, schedule=Schedule.PINGPONG,
                           epi_column_sums_per_tile=True),
    # the heuristic's tall tiles (gemm_mgpu._tall_tiles_pay): three rows of sub-tiles
    "pingpong192": GemmConfig(tile_m=192, tile_n=64, tile_k=64, stages=2, epi_tile_n=32,
                              cluster_dim=None, schedule=Schedule.PINGPONG,
                              epi_column_sums_per_tile=True),
    # the warpgroups split M and take turns around each sum (column_sum_turns)
    "cooperative_wgM": GemmConfig(tile_m=128, tile_n=64, tile_k=64, stages=2,
                                  epi_tile_n=32, wg_dim=MatDim.M, cluster_dim=None,
                                  epi_column_sums_per_tile=True),
    "cooperative_wgN_one_slot": GemmConfig(tile_m=128, tile_n=64, tile_k=64, stages=2,
                                           epi_tile_n=32, wg_dim=MatDim.N,
                                           cluster_dim=None, epi_operand_slots=1,
                                           epi_column_sums_per_tile=True),
}


@pytest.mark.parametrize("k", [128, 0], ids=["gemm", "pass"])
@pytest.mark.parametrize("config", PER_TILE_CONFIGS)
def test_column_sums_per_tile_raw_partials(key, interpret, races_checked, config, k):
  """The raw partials at the kernel's contract: one row per warpgroup tile, each the
  sum of that tile's rows, for a sum stored through ``store_column_sum`` (carried
  before the sum) and one through ``store`` (carried after), beside a tile output and a
  tile operand; under the race detector when interpreted. M = 512 (384 for 192-row
  tiles): several tiles per SM. Every true partial is nonzero, so an unwritten row
  shows."""
  cfg = PER_TILE_CONFIGS[config]
  assert "colT" in cfg.describe() and cfg.column_partial_rows == cfg.tile_m
  m, n = 384 if cfg.tile_m == 192 else 512, 128
  if k:
    a, b = gemm_inputs(key, m, n, k, jnp.bfloat16)
  else:  # a pass: unclustered cooperative configs only
    a, b = jnp.zeros((m, 0), jnp.bfloat16), jnp.zeros((0, n), jnp.bfloat16)
    cfg = dataclasses.replace(cfg, schedule=Schedule.COOPERATIVE)
  x0 = normal(jax.random.fold_in(key, 2), (m, n), jnp.bfloat16)
  partial = lambda name: EpilogueOutput(name, OutputKind.COL_PARTIAL, jnp.float32)

  def epilogue(tile, acc):
    y = acc + tile.load("x0").astype(jnp.float32)
    tile.store("o", y)
    tile.store_column_sum("c", 2.0 * y)
    tile.store("v", tile.column_sum(y * y))

  interp = races_checked.params if interpret is not None else None
  out = pallas_kernels.gemm(a, b, inputs={"x0": (InputKind.TILE, x0)}, epilogue=epilogue,
                            outputs=(EpilogueOutput("o"), partial("c"), partial("v")),
                            config=cfg, num_sms=2, interpret=interp,
                            column_sum_turns=True)
  y = (matmul_f32(a, b) if k else 0.0) + x0.astype(jnp.float32)
  by_tile = lambda v: v.reshape(m // cfg.tile_m, cfg.tile_m, n).sum(axis=1)
  assert out["c"].shape == out["v"].shape == (m // cfg.tile_m, n)
  for name, terms in (("c", 2.0 * y), ("v", y * y)):
    # each partial against the sum of its terms' magnitudes (the sums cancel)
    want, scale = f64(by_tile(terms)), f64(by_tile(jnp.abs(terms)))
    assert np.all(scale > 0), name
    e = float(np.max(np.abs(f64(out[name]) - want) / scale))
    assert e < REDUCTION_RTOL, f"{name}: worst partial off by {e:.3g} of its terms"
  assert rel_err(out["o"], y) < 1e-2
  assert not races_checked.races_found(), "data race in the kernel (see stdout)"


@pytest.mark.parametrize("name", ["everything", "colsum_store", "layernorm_input_grad"])
def test_column_sums_per_tile_programs(key, kernel_impl, name):
  """Library programs with column sums under a per-tile config, every finished output
  against fp32 (the pass's LayerNorm producer backward as a pass)."""
  cfg = PER_TILE_CONFIGS["cooperative_wgM"]
  if name in NO_PRODUCT_PROGRAMS and name not in PROGRAMS:
    program = NO_PRODUCT_PROGRAMS[name]
    m, n = 512, 128
    a, b = jnp.zeros((m, 0), jnp.bfloat16), jnp.zeros((0, n), jnp.bfloat16)
  else:
    program = PROGRAMS[name]
    m, n = 512, 128
    a, b = gemm_inputs(key, m, n, K, jnp.bfloat16)
  ops = make_operands(jax.random.fold_in(key, 1), program, m, n, jnp.bfloat16)
  check_program(a, b, program, ops, kernel_impl, config=cfg)


@pytest.mark.parametrize("config", CONFIGS)
def test_bitwise_deterministic(key, kernel_impl, config):
  """Two runs on the same inputs give identical bits, every output (row and column
  partials included), under each schedule."""
  program = PROGRAMS["everything"]
  a, b = gemm_inputs(key, M, N, K, jnp.bfloat16)
  ops = make_operands(jax.random.fold_in(key, 1), program, M, N, a.dtype)
  run = jax.jit(lambda a, b, o: cj.gemm_epilogue(a, b, program, o, impl=kernel_impl,
                                                 config=CONFIGS[config](program)))
  first, second = run(a, b, ops), run(a, b, ops)
  for name in first:
    np.testing.assert_array_equal(np.asarray(first[name]).view(np.uint8),
                                  np.asarray(second[name]).view(np.uint8), err_msg=name)


# ---- K = 0: the epilogue without a product (coda_jax.epilogue_pass) ----------------------
NO_PRODUCT_PROGRAMS = {
    "add_tile": PROGRAMS["add_tile"],
    "everything": [cj.AddTile("x0"), cj.ScaleConst(0.125), cj.ScaleCol("g"), cj.Store("y"),
                   cj.ColSum("c"), cj.RowSum("s")],
    "rope_rowsum": [cj.AddTile("x0"), cj.ScaleRow("r"), cj.Rotate("pos", "fr32", P32),
                    cj.RowSum("ss", square=True), cj.Store("q")],
    # LayerNorm's producer backward: three tile operands, two column sums
    "layernorm_input_grad": [cj.AddTile("dx"), LayerNormInputGrad("dh", "x", "g", "mu", "a",
                                                                  "b"),
                             cj.ColSum("dsum"), cj.Store("dxt")],
    # the QK-norm backward's per-head step: one branch per head on "hsel" (normed or
    # passed through), heads of 32 columns, two or more to a sub-tile
    "head_norm_grad": [cj.AddTile("x0"), HeadRmsNormGrad("u", "hw", "hsel", 32, 1e-6, "dw",
                                                         "udu"), cj.Store("y")],
}
NO_PRODUCT_CONFIGS = {
    "default": None,
    # warpgroups split N, two (64, 64) sub-tiles each, one operand slot: 4 CTA tiles
    "wgN_one_slot": GemmConfig(tile_m=128, tile_n=64, epi_tile_n=64, wg_dim=MatDim.N,
                               cluster_dim=None, epi_operand_slots=1, stages=2),
    # 128-wide sub-tiles whose tile outputs are stored in halves
    "split_store": GemmConfig(tile_m=64, tile_n=128, epi_tile_n=128, epi_store_n=64,
                              cluster_dim=None, stages=2),
    # the next tile's operands loaded under this one (two tiles per SM in the
    # interpreter): both slots, one slot, and the slots refilled after the whole sub-tile
    "next_tile": GemmConfig(tile_m=128, tile_n=64, epi_tile_n=64, wg_dim=MatDim.N,
                            cluster_dim=None, stages=2, epi_prefetch_next_tile=True),
    "next_tile_one_slot": GemmConfig(tile_m=128, tile_n=64, epi_tile_n=64, wg_dim=MatDim.N,
                                     cluster_dim=None, stages=2, epi_operand_slots=1,
                                     epi_prefetch_next_tile=True),
    "next_tile_late": GemmConfig(tile_m=128, tile_n=64, epi_tile_n=64, wg_dim=MatDim.N,
                                 cluster_dim=None, stages=2, epi_prefetch_next_tile=True,
                                 epi_operand_refetch_early=False),
    # sub-tiles as tall as the warpgroup tile, two a tile
    "tall": TALL_SUBTILE_CONFIGS["cooperative_e128x32"],
    # one sub-tile as large as the warpgroup tile, the next tile's loaded under it
    "tall_next_tile": GemmConfig(tile_m=128, tile_n=64, epi_tile_m=128, epi_tile_n=64,
                                 wg_dim=MatDim.N, cluster_dim=None, stages=2,
                                 epi_operand_slots=1, epi_prefetch_next_tile=True),
}


# Every program under every config, except three tile operands in 128-wide sub-tiles with
# two slots each (236 KiB of shared memory, which the kernel refuses with a ValueError
# naming the limit; the heuristic and the tuner pick narrower sub-tiles for it) and the
# rotation's 64-column pair blocks in 32-column sub-tiles (refused likewise).
NO_PRODUCT_CASES = [(name, config) for name in NO_PRODUCT_PROGRAMS
                    for config in NO_PRODUCT_CONFIGS
                    if (name, config) not in {("layernorm_input_grad", "split_store"),
                                              ("rope_rowsum", "tall")}]


@pytest.mark.parametrize(("name", "config"), NO_PRODUCT_CASES)
def test_no_product(key, kernel_impl, races_checked, name, config):
  """K = 0 (``epilogue_pass``): the program on a zero accumulator with no mainloop, over
  several tiles per SM, every output against the truth; under the race detector when
  interpreted. Every true value is nonzero, so an unwritten element shows."""
  program = NO_PRODUCT_PROGRAMS[name]
  m, n = 256, 256
  ops = make_operands(key, program, m, n, jnp.bfloat16)
  cfg = NO_PRODUCT_CONFIGS[config]
  a, b = jnp.zeros((m, 0), jnp.bfloat16), jnp.zeros((0, n), jnp.bfloat16)
  got, _ = check_program(a, b, program, ops, kernel_impl, config=cfg)
  assert not races_checked.races_found(), "data race in the kernel (see stdout)"
  via_pass = cj.epilogue_pass(program, ops, impl=kernel_impl, config=cfg)
  for nm in got:
    np.testing.assert_array_equal(f64(via_pass[nm]), f64(got[nm]), err_msg=nm)
  assert not races_checked.races_found(), "data race in the kernel (see stdout)"


@pytest.mark.parametrize("config", ["next_tile", "next_tile_one_slot"])
def test_head_branch_reads_each_tiles_flags(key, kernel_impl, races_checked, config):
  """``tile.column_value`` while the next tile's column operands load under this one: a
  (128, 512) pass on 128-wide CTA tiles, so each of the interpreter's two SMs runs two
  tiles of different column blocks, whose per-head flags ("hsel") differ and sit in the
  two vector buffers in turn; under the race detector when interpreted."""
  program = NO_PRODUCT_PROGRAMS["head_norm_grad"]
  m, n = 128, 512
  ops = make_operands(key, program, m, n, jnp.bfloat16)
  flags = np.asarray(ops["hsel"]).reshape(4, 128)
  assert (flags[0] != flags[2]).any() and (flags[1] != flags[3]).any()
  a, b = jnp.zeros((m, 0), jnp.bfloat16), jnp.zeros((0, n), jnp.bfloat16)
  check_program(a, b, program, ops, kernel_impl, config=NO_PRODUCT_CONFIGS[config])
  assert not races_checked.races_found(), "data race in the kernel (see stdout)"


def test_no_product_keeps_the_sign_of_zero(kernel_impl):
  """The pass's accumulator is -0.0, which adding its first tile operand leaves exactly
  (x + -0.0 is x, bit for bit; the compiler drops that add), so a copy through the pass
  gives back every bit, -0.0 included. A compiled kernel on +0.0 would turn -0.0 into
  +0.0; the interpreter cannot show that (its XLA folds 0.0 + x to x), so there the test
  checks the copy's bits only."""
  m, n = 128, 256
  vals = np.array([-0.0, 0.0, -1.5, 2.0, -0.0], np.float32)
  x = jnp.asarray(np.resize(vals, m * n).reshape(m, n), jnp.bfloat16)
  as_f32 = np.asarray(x, np.float32)
  assert ((as_f32 == 0) & np.signbit(as_f32)).any()  # negative zeros to keep
  out = cj.epilogue_pass([cj.AddTile("x0"), cj.Store("y")], {"x0": x}, impl=kernel_impl)
  np.testing.assert_array_equal(np.asarray(out["y"]).view(np.uint16),
                                np.asarray(x).view(np.uint16))


@pytest.mark.parametrize("m", [1, 63, 100])
def test_no_product_pads_odd_rows(key, kernel_impl, m):
  """Row counts that do not tile: the pass pads M (the program keeps zero rows zero), and
  the padded rows reach neither the column sums nor the outputs."""
  program = NO_PRODUCT_PROGRAMS["everything"]
  ops = make_operands(key, program, m, 128, jnp.bfloat16)
  a, b = jnp.zeros((m, 0), jnp.bfloat16), jnp.zeros((0, 128), jnp.bfloat16)
  check_program(a, b, program, ops, kernel_impl)


def test_prefetch_next_tile_is_for_passes(key):
  """``epi_prefetch_next_tile``: refused with a mainloop (its tile operands load under
  it), and where the operand slots do not divide a warpgroup tile's sub-tiles."""
  a, b = gemm_inputs(key, 256, 256, 64, jnp.bfloat16)
  cfg = NO_PRODUCT_CONFIGS["next_tile"]
  with pytest.raises(ValueError, match="epi_prefetch_next_tile is for K = 0 passes"):
    pallas_kernels.gemm(a, b, config=cfg, interpret=pallas_kernels.interpret_params())
  with pytest.raises(ValueError, match="needs epi_operand_slots=3 to divide the 4"):
    GemmConfig(tile_m=128, tile_n=128, epi_tile_n=64, epi_operand_slots=3,
               epi_prefetch_next_tile=True)
  assert "next" in cfg.describe()


def test_no_product_refuses_what_it_cannot_run(key):
  ops = make_operands(key, PROGRAMS["add_tile"], 128, 128, jnp.bfloat16)
  with pytest.raises(ValueError, match="no \\(M, N\\) tile operand"):
    cj.epilogue_pass([cj.ScaleRow("r"), cj.Store("y")], {"r": jnp.ones((128,))})
  for bad in (GemmConfig(cluster_dim=MatDim.N), GemmConfig(cluster_dim=None,
                                                            schedule=Schedule.PINGPONG)):
    with pytest.raises(ValueError, match="K=0 runs the epilogue alone"):
      cj.epilogue_pass(PROGRAMS["add_tile"], ops, impl="interpret", config=bad)


@dataclasses.dataclass(frozen=True)
class _ScaleByColumnSums(cj.Primitive):
  """Sums over rows through env.column_sum but declares no column-partial output."""
  _column_sums_via_env = True

  def apply(self, x, env):
    return x * env.column_sum(x)[None, :]


def test_column_sum_needs_a_declared_partial(key):
  """A sum over rows shares the warpgroups' scratch; with no column-partial output the
  kernel has no turns to guard it, and says so instead of racing."""
  a, b = gemm_inputs(key, 128, 128, 64, jnp.bfloat16)
  with pytest.raises(Exception, match="declares no column-partial output"):
    cj.gemm_epilogue(a, b, [_ScaleByColumnSums(), cj.Store("y")], {}, impl="interpret")


@dataclasses.dataclass(frozen=True)
class _OwnColumnSum(cj.Primitive):
  """A column partial summed with jnp.sum itself, not through env.column_sum (and so not
  claiming ``column_sums_via_env``)."""
  name: str

  def outputs(self, width):
    return (cj.EpilogueOutput(self.name, cj.OutputKind.COL_PARTIAL, jnp.float32),)

  def apply(self, x, env):
    env.store(self.name, jnp.sum(x, axis=0))
    return x

  def finish(self, raw):
    return {self.name: jnp.sum(raw[self.name], axis=0)}


def test_column_sum_turns_only_when_every_step_says_so(key, monkeypatch, kernel_impl):
  """The kernel's warpgroups take turns per column sum only when every step of the
  program sums rows through env.column_sum; a step that sums them itself keeps the
  whole-epilogue turns (its sum would otherwise race for the shared scratch). Values
  are right either way. Runs the compiled kernel where there is one: on the GPU host
  the interpreter this test once named outright had not finished after 300 s (the one
  test_primitives test a 520 s GPU run left unfinished)."""
  seen = []
  real = pallas_kernels.gemm
  monkeypatch.setattr(pallas_kernels, "gemm", lambda *a, **kw: (
      seen.append(kw["column_sum_turns"]), real(*a, **kw))[1])
  a, b = gemm_inputs(key, 128, 128, 64, jnp.bfloat16)
  for program, per_sum in (([cj.ColSum("c"), cj.Store("y")], True),
                           ([_OwnColumnSum("c"), cj.Store("y")], False),
                           ([_OwnColumnSum("c"), cj.ColSum("d"), cj.Store("y")], False)):
    check_program(a, b, program, {}, kernel_impl)
    assert seen[-1] is per_sum, program


# ---- the tuning cache's name of a program ------------------------------------------------
def test_program_id_spells_each_dtype_once():
  """A dtype passed as a scalar type (``jnp.bfloat16``, ``np.float32``) or as a dtype
  (``x.dtype``) names the same program, so both find the same tuned config; fields that
  are not dtypes are left as they are."""
  from coda_jax.epilogue_gemm import program_id
  from coda_jax.layernorm_ops import Gelu
  x = jnp.zeros((2, 2), jnp.bfloat16)
  spellings = [[cj.ScaleRow("r"), cj.Store("y", dt)] for dt in
               (jnp.bfloat16, jnp.dtype("bfloat16"), x.dtype, "bfloat16")]
  ids = {program_id(p) for p in spellings}
  assert ids == {"ScaleRow(name='r')+Store(name='y', dtype=dtype(bfloat16))"}, ids
  assert (program_id([cj.Store("dw", jnp.float32)]) == program_id([cj.Store("dw", np.float32)])
          == "Store(name='dw', dtype=dtype('float32'))")
  assert (program_id([Gelu(slope="s", slope_dtype=jnp.uint8)])
          == program_id([Gelu(slope="s", slope_dtype=jnp.dtype("uint8"))]))
  assert "<class" not in program_id([Gelu(slope="s", slope_dtype=jnp.uint8)])


def test_shipped_tuning_cache_keys_spell_dtypes_as_program_id():
  """Every shipped cache entry names its program with dtypes spelled as ``program_id``
  spells them (a key with a scalar type's repr, ``<class 'jax.numpy.bfloat16'>``, would
  never be found)."""
  import json
  data = json.loads(pallas_kernels.autotune.SHIPPED_CACHE.read_text())
  stale = [k for k in data["entries"] if "<class" in k]
  assert not stale, stale[:3]
