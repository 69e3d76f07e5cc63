"""The plain GEMM (default epilogue) of pallas_kernels.gemm against an fp32 reference, and
B's sums over K that its mainloop can make beside it (a b_column_sum output)."""
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels import GemmConfig, MatDim, Schedule
from helpers import TALL, assert_within_baseline, gemm_inputs, matmul_f32

M_, N_ = MatDim.M, MatDim.N
# Every knob that changes the kernel's structure is spelled out, so that a change of
# GemmConfig's defaults doesn't silently change what these tests cover.
CONFIGS = {
    # CTA (64, 128); two epilogue sub-tiles per warpgroup
    "wg_n": GemmConfig(tile_m=64, tile_n=64, tile_k=64, stages=3, epi_tile_n=32,
                       wg_dim=N_, cluster_dim=None),
    # CTA (128, 64); one sub-tile per warpgroup, so consecutive sub-tiles share a slot
    "wg_m": GemmConfig(tile_m=64, tile_n=64, tile_k=64, stages=3, epi_tile_n=64,
                       wg_dim=M_, cluster_dim=None),
    "minor_m": GemmConfig(tile_m=64, tile_n=64, tile_k=64, stages=3, epi_tile_n=32,
                          wg_dim=N_, cluster_dim=None, grid_minor_dim=M_, grid_tile_width=2),
    "two_stages": GemmConfig(tile_m=128, tile_n=64, tile_k=64, stages=2,
                             wg_dim=N_, cluster_dim=None),
    # clusters of two CTAs that multicast the shared operand
    "cluster_n": GemmConfig(tile_m=128, tile_n=64, tile_k=64, stages=4, epi_tile_n=32,
                            wg_dim=M_, cluster_dim=N_),
    "cluster_m": GemmConfig(tile_m=64, tile_n=128, tile_k=64, stages=3, wg_dim=N_,
                            cluster_dim=M_),
    # ping-pong: each warpgroup owns whole tiles, in turn
    "pingpong": GemmConfig(tile_m=64, tile_n=64, tile_k=64, stages=3, epi_tile_n=32,
                           cluster_dim=None, schedule=Schedule.PINGPONG),
    "pingpong_two_stages": GemmConfig(tile_m=128, tile_n=64, tile_k=64, stages=2,
                                      cluster_dim=None, schedule=Schedule.PINGPONG),
    "pingpong_cluster_n": GemmConfig(tile_m=64, tile_n=64, tile_k=64, stages=4,
                                     epi_tile_n=32, cluster_dim=N_,
                                     schedule=Schedule.PINGPONG),
    "pingpong_cluster_m": GemmConfig(tile_m=64, tile_n=128, tile_k=64, stages=3,
                                     cluster_dim=M_, grid_minor_dim=M_, grid_tile_width=2,
                                     schedule=Schedule.PINGPONG),
    "default": None,
}
# (M, N, K, dtype): non-square, K = 3 x tile_k; M, N divisible by every cluster tile.
SHAPES = [(512, 256, 192, jnp.bfloat16), (256, 512, 128, jnp.float16)]
TRANSPOSES = dict(argnames="trans_a,trans_b", ids=["nn", "tn", "nt", "tt"],
                  argvalues=[(False, False), (True, False), (False, True), (True, True)])


def check_gemm(a, b, interpret, trans_a=False, trans_b=False, **kw):
  out = pk.gemm(a, b, trans_a=trans_a, trans_b=trans_b, interpret=interpret, **kw)
  assert list(out) == ["out"]
  got = out["out"]
  truth = matmul_f32(a, b, trans_a, trans_b)
  assert got.shape == truth.shape and got.dtype == a.dtype
  # XLA's own low-precision product is the yardstick.
  xla = jnp.matmul(a.T if trans_a else a, b.T if trans_b else b)
  assert xla.dtype == a.dtype
  assert_within_baseline(got, truth, xla, "gemm")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize(**TRANSPOSES)
@pytest.mark.parametrize("config", ["wg_n", "pingpong_cluster_m"])
def test_transposes(key, interpret, dtype, trans_a, trans_b, config):
  a, b = gemm_inputs(key, 128, 256, 192, dtype, trans_a, trans_b)
  check_gemm(a, b, interpret, trans_a, trans_b, config=CONFIGS[config], num_sms=2)


@pytest.mark.parametrize(**TRANSPOSES)
def test_tile_k_32(key, interpret, trans_a, trans_b):
  """K = 96 in three steps of 32: wgmma takes that with both operands K-major (A (M, K),
  B (N, K)); an MN-major operand needs tile_k % 64 == 0, which must be an error."""
  a, b = gemm_inputs(key, 128, 256, 96, jnp.bfloat16, trans_a, trans_b)
  cfg = GemmConfig(tile_m=64, tile_n=64, tile_k=32, stages=3, epi_tile_n=32, wg_dim=N_,
                   cluster_dim=None)
  if trans_a or not trans_b:
    with pytest.raises(ValueError, match="MN-major"):
      pk.gemm(a, b, trans_a=trans_a, trans_b=trans_b, config=cfg, interpret=interpret)
  else:
    check_gemm(a, b, interpret, trans_a, trans_b, config=cfg, num_sms=2)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:3])))
@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_configs(key, interpret, config, shape):
  m, n, k, dtype = shape
  a, b = gemm_inputs(key, m, n, k, dtype)
  check_gemm(a, b, interpret, config=config, num_sms=2)  # several tiles per SM


def test_default_config_single_k_step(key, interpret):
  """K = tile_k: each tile's K loop is one step."""
  a, b = gemm_inputs(key, 512, 512, 64, jnp.bfloat16)
  check_gemm(a, b, interpret, num_sms=2)


@pytest.mark.parametrize("config", ["wg_n", "pingpong"])
def test_more_sms_than_tiles(key, interpret, config):
  """Some CTAs get one tile (under ping-pong, warpgroup 1 then has none)."""
  a, b = gemm_inputs(key, 128, 256, 128, jnp.bfloat16, trans_b=True)
  check_gemm(a, b, interpret, trans_b=True, config=CONFIGS[config], num_sms=6)


def test_fewer_sms_than_a_cluster(key, interpret):
  """num_sms=1 with 2-CTA clusters cannot launch: an error that says why."""
  a, b = gemm_inputs(key, 256, 256, 128, jnp.bfloat16)
  with pytest.raises(ValueError, match="num_sms=1 is smaller than the cluster"):
    check_gemm(a, b, interpret, config=CONFIGS["cluster_n"], num_sms=1)


@pytest.mark.parametrize("k,config", [(128, "wg_n"), (128, "cluster_n"), (128, "wg_m"),
                                      (64, "default"), (128, "pingpong"),
                                      (192, "pingpong_two_stages"),
                                      (128, "pingpong_cluster_n")])
def test_race_free(key, race_detector, k, config):
  """Several tiles per SM, so that buffer reuse across tiles is exercised; the
  interpreter's happens-before checker sees races that its eager copies hide."""
  a, b = gemm_inputs(key, 512, 256, k, jnp.bfloat16)
  check_gemm(a, b, race_detector.params, config=CONFIGS[config], num_sms=2)
  assert not race_detector.races_found(), "data race in the kernel (see stdout)"



@pytest.mark.parametrize("config", TALL)
def test_tall_pingpong_tiles(key, interpret, config):
  """M = 768: four rows of 192-row tiles, 16 (or 8 cluster) tiles over 2 SMs."""
  a, b = gemm_inputs(key, 768, 256, 192, jnp.bfloat16)
  check_gemm(a, b, interpret, config=TALL[config], num_sms=2)


def test_tall_pingpong_race_free(key, race_detector):
  a, b = gemm_inputs(key, 384, 256, 128, jnp.bfloat16)
  check_gemm(a, b, race_detector.params, config=TALL["tall_cluster_n"], num_sms=2)
  assert not race_detector.races_found(), "data race in the kernel (see stdout)"


@pytest.mark.parametrize("m", [200, 16384 // 32])
def test_tall_pingpong_tiles_clip_m(key, interpret, m):
  """192-row tiles at M that they do not divide (M = 512 stands for 16384: both leave
  a third of the last row of tiles past M): TMA drops what lies past M."""
  if interpret is not None:
    pytest.skip("clip_m needs the compiled kernel: the interpreter clamps out-of-range "
                "slices instead of filling zeros")
  a, b = gemm_inputs(key, m, 256, 128, jnp.bfloat16)
  check_gemm(a, b, interpret, config=TALL["tall_cluster_n"], num_sms=2, clip_m=True)


@pytest.mark.parametrize("m,clip_m", [(12288, False), (16000, True)])
def test_default_tall_tiles(key, interpret, m, clip_m):
  """The heuristic's own 192 x 128 ping-pong tiles (``gemm_mgpu._tall_tiles_pay``) at a
  size it picks them for: M a multiple of 192, and M = 16000 clipped."""
  if interpret is not None:
    pytest.skip("the heuristic picks tall tiles for outputs of 2^25 elements and more, "
                "hours in the interpreter; test_tall_pingpong_tiles runs them small")
  n, k = 4096, 256
  cfg = pk.default_config(m, n, k, clip_m=clip_m)
  assert (cfg.schedule, cfg.tile_m) == (Schedule.PINGPONG, 192), cfg.describe()
  a, b = gemm_inputs(key, m, n, k, jnp.bfloat16)
  check_gemm(a, b, interpret, config=cfg, clip_m=clip_m)  # not a tuned nearby entry


# ---- B's sums over K from the mainloop (OutputKind.B_COLUMN_SUM) ------------------------
B_SUM_OUTPUTS = (pk.EpilogueOutput("out", dtype=jnp.bfloat16),
                 pk.EpilogueOutput("db", pk.OutputKind.B_COLUMN_SUM, jnp.float32))


def _store_and_name_b_sum(tile, acc):
  tile.store("out", acc)
  tile.b_column_sum("db")


def check_b_column_sum(a, b, params, trans_b, config, num_sms=2):
  got = pk.gemm(a, b, epilogue=_store_and_name_b_sum, outputs=B_SUM_OUTPUTS, trans_a=True,
                trans_b=trans_b, config=config, interpret=params, num_sms=num_sms)
  truth = np.asarray(b, np.float64).sum(axis=1 if trans_b else 0)
  partials = np.asarray(got["db"], np.float64)
  rows_of_tiles = -(-a.shape[1] // config.tile_m)
  assert got["db"].dtype == jnp.float32
  assert partials.shape == (rows_of_tiles, truth.shape[0])
  # the interpreter fills what a kernel leaves unwritten with NaN
  assert np.all(np.isfinite(partials)), "b_column_sum: unwritten partials"
  db = partials.sum(axis=0)
  assert np.linalg.norm(db - truth) <= 1e-6 * np.linalg.norm(truth)
  assert np.max(np.abs(db - truth)) <= 1e-5 * np.max(np.abs(truth))
  xla = jnp.matmul(a.T, b.T if trans_b else b)
  assert_within_baseline(got["out"], matmul_f32(a, b, True, trans_b), xla, "gemm")


@pytest.mark.parametrize("trans_b", [False, True], ids=["b_kn", "b_nk"])
@pytest.mark.parametrize("config", ["wg_m", "wg_n", "cluster_m", "pingpong",
                                    "pingpong_cluster_m"])
def test_b_column_sum(key, interpret, config, trans_b):
  """A weight gradient's bias gradient: sum_k B[k, n] from the extra wgmma (B's tile
  against a ones column) that the tiles of a column block run on their shares of the K
  steps, every partial written and their sum as exact as an fp32 sum; the product
  beside it unchanged. M = 256 is two to four rows of tiles and K = 192 three steps, so
  some rows of tiles take no step (and store zeros); with 2 SMs each CTA runs several
  tiles, so the sums are reset from tile to tile."""
  a, b = gemm_inputs(key, 256, 256, 192, jnp.bfloat16, True, trans_b)
  check_b_column_sum(a, b, interpret, trans_b, CONFIGS[config])


def test_b_column_sum_race_free(key, race_detector):
  a, b = gemm_inputs(key, 256, 256, 128, jnp.bfloat16, True, False)
  check_b_column_sum(a, b, race_detector.params, False, CONFIGS["pingpong"])
  assert not race_detector.races_found(), "data race in the kernel (see stdout)"


def test_b_column_sum_refuses_what_it_cannot_run(key):
  a, b = gemm_inputs(key, 128, 128, 64, jnp.bfloat16, True, False)
  params = pk.interpret_params()
  run = lambda outputs=B_SUM_OUTPUTS, epilogue=_store_and_name_b_sum, **kw: pk.gemm(
      a, b, epilogue=epilogue, outputs=outputs, trans_a=True, interpret=params,
      **{"config": CONFIGS["wg_m"], **kw})
  with pytest.raises(ValueError, match="declare one"):
    run(outputs=B_SUM_OUTPUTS + (pk.EpilogueOutput("db2", pk.OutputKind.B_COLUMN_SUM,
                                                   jnp.float32),))
  with pytest.raises(ValueError, match="K = 0"):
    pk.gemm(a[:0], b[:0], epilogue=_store_and_name_b_sum, outputs=B_SUM_OUTPUTS,
            trans_a=True, interpret=params)
  narrow = GemmConfig(tile_m=64, tile_n=32, tile_k=64, stages=2, epi_tile_n=32,
                      cluster_dim=None, schedule=Schedule.PINGPONG)
  with pytest.raises(ValueError, match="tile_n=32 is not a multiple of 64"):
    run(config=narrow)
  stores = lambda tile, acc: (tile.store("out", acc), tile.store("db", acc[0]))
  with pytest.raises(ValueError, match="the mainloop makes it"):
    run(epilogue=stores)
  with pytest.raises(ValueError, match="did not store outputs \\['db'\\]"):
    run(epilogue=lambda tile, acc: tile.store("out", acc))
  with pytest.raises(ValueError, match="output; not a b_column_sum one"):
    run(epilogue=lambda tile, acc: tile.b_column_sum("out"))
  with pytest.raises(ValueError, match="width does not apply"):
    pk.EpilogueOutput("db", pk.OutputKind.B_COLUMN_SUM, jnp.float32, width=2)


def test_kernel_names_tell_problems_apart():
  """Each GEMM problem's kernel has its own name in profiles (schedule, M x N x K, operand
  order, outputs), so a training step's profile can be read problem by problem (a
  forward kernel run twice was found only this way: docs/known_issues.md); names stay
  valid symbols."""
  from pallas_kernels import epilogue as epi
  from pallas_kernels.gemm_mgpu import kernel_name_for
  outs = (epi.EpilogueOutput("dz"), epi.EpilogueOutput("zdz"))
  coop, ping = CONFIGS["wg_n"], CONFIGS["pingpong"]
  assert (kernel_name_for(ping, 8192, 14336, 4096, False, True, outs)
          == "coda_gemm_pingpong_8192x14336x4096_nt_dz_zdz")
  assert (kernel_name_for(coop, 4096, 512, 8192, True, False, outs[:1])
          == "coda_gemm_cooperative_4096x512x8192_tn_dz")
  assert (kernel_name_for(coop, 64, 128, 0, False, False, outs[:1])
          == "coda_gemm_epilogue_only_64x128x0_nn_dz")
  odd = kernel_name_for(coop, 64, 64, 64, False, False, (epi.EpilogueOutput("a.b-c"),))
  assert odd == "coda_gemm_cooperative_64x64x64_nn_a_b_c"
