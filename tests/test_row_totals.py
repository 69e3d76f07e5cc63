"""Row totals (``pallas_kernels`` row_total outputs): a program that needs each row's sum
over all N columns before it stores, in one GEMM. Its first pass stores each tile's
partials, the CTAs holding a row block's tiles exchange them through global memory, and
its second pass reads the totals. The exchange waits on global semaphores, which the
Mosaic GPU interpreter does not have, so the values are checked on the GPU only; the
refusals are checked everywhere."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels import GemmConfig, MatDim, Schedule
from helpers import assert_within_baseline, normal

F32 = jnp.float32


def first_pass(tile, acc):
  """Reads x but not y: the kernel stages only x for it (``row_totals_pass_reads``)."""
  x = tile.load("x").astype(F32)
  tile.store("ss", jnp.sum(acc * acc, axis=1))
  tile.store("sx", jnp.sum(acc * x, axis=1))


def first_pass_no_tiles(tile, acc):
  """Reads no tile operand (sx is then the row's plain sum): its staging is empty."""
  tile.store("ss", jnp.sum(acc * acc, axis=1))
  tile.store("sx", jnp.sum(acc, axis=1))


def second_pass(tile, acc):
  """acc / sqrt(1 + sum acc^2) + 1e-3 x sx + y / 4: both totals over the whole row."""
  # row terms as (epi_m,) vectors before they meet the tile (a (epi_m, 1) value
  # broadcast first leaves Mosaic GPU's layout inference without a solution)
  scale, sx = jax.lax.rsqrt(tile.load("ss") + 1.0), 1e-3 * tile.load("sx")
  x = tile.load("x").astype(F32)
  tile.store("out", acc * scale[:, None] + x * sx[:, None] + 0.25 * tile.load("y").astype(F32))


OUTPUTS = (pk.EpilogueOutput("out", dtype=jnp.bfloat16),
           pk.EpilogueOutput("ss", pk.OutputKind.ROW_TOTAL, F32),
           pk.EpilogueOutput("sx", pk.OutputKind.ROW_TOTAL, F32))

PINGPONG = GemmConfig(tile_m=128, tile_n=128, tile_k=64, stages=4, epi_tile_m=64,
                      epi_tile_n=32, schedule=Schedule.PINGPONG, cluster_dim=MatDim.N,
                      grid_tile_width=16)
CONFIGS = {
    "pingpong_cluster_n": PINGPONG,
    "pingpong": dataclasses.replace(PINGPONG, cluster_dim=None),
    "pingpong_cluster_m": dataclasses.replace(PINGPONG, cluster_dim=MatDim.M),
    "pingpong_64x64": dataclasses.replace(PINGPONG, tile_m=64, tile_n=64, cluster_dim=None),
}


def run(a, b, x, y, config, num_sms=None, interpret=None, first=first_pass, **kw):
  return pk.gemm(a, b, inputs={"x": (pk.InputKind.TILE, x), "y": (pk.InputKind.TILE, y)},
                 epilogue=second_pass, outputs=OUTPUTS, row_totals_pass=first,
                 config=config, num_sms=num_sms, interpret=interpret, **kw)


def truth(a, b, x, y, tile_n, x_in_first=True):
  """float64: the output, and each warpgroup tile's partials (tiles along N, M)."""
  acc = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
  xf = np.asarray(x, np.float64)
  m, n = acc.shape
  parts = lambda v: v.reshape(m, n // tile_n, tile_n).sum(axis=2).T
  ss, sx = parts(acc * acc), parts(acc * xf if x_in_first else acc)
  out = (acc / np.sqrt(1 + ss.sum(0))[:, None] + 1e-3 * xf * sx.sum(0)[:, None]
         + 0.25 * np.asarray(y, np.float64))
  return out, ss, sx


def xla_baseline(a, b, x, y, x_in_first=True):
  """The same math unfused in bfloat16, as XLA runs it: the tolerance rule's yardstick."""
  acc = jnp.matmul(a, b)
  ss = jnp.sum(acc * acc, axis=1, keepdims=True)
  sx = jnp.sum(acc * x if x_in_first else acc, axis=1, keepdims=True)
  return acc * jax.lax.rsqrt(ss + 1) + jnp.bfloat16(1e-3) * x * sx + jnp.bfloat16(0.25) * y


# (M, N, K, SMs): the SM counts leave a row block's tiles on two waves (its first tiles
# wait for a later mainloop), and 448 rows leave the last row block part past M.
CASES = [(512, 1024, 256, 10), (384, 2048, 192, None), (1024, 1024, 512, 18),
         (448, 1024, 128, 12)]


def check_row_totals(key, config, m, n, k, sms, first=first_pass):
  """Runs the program three times and checks every partial and the output."""
  x_in_first = first is first_pass
  cfg = CONFIGS[config]
  if config == "pingpong_cluster_m" and m % 256:
    cfg = dataclasses.replace(cfg, cluster_dim=None)
  cluster = 1 if cfg.cluster_dim is None else 2
  along_n = n // cfg.cluster_tile[1]
  if sms is not None and sms // cluster < along_n:
    # a row block's tiles must be on distinct CTAs (row_totals_conflict); one more
    # cluster than that still leaves row blocks straddling two waves
    sms = (along_n + 1) * cluster
  # and the grid must walk the row blocks one whole row at a time
  cfg = dataclasses.replace(cfg, grid_tile_width=max(cfg.grid_tile_width, along_n))
  ka, kb, kx, ky = jax.random.split(key, 4)
  a, b = normal(ka, (m, k), jnp.bfloat16), normal(kb, (k, n), jnp.bfloat16)
  x, y = normal(kx, (m, n), jnp.bfloat16), normal(ky, (m, n), jnp.bfloat16)
  want, ss, sx = truth(a, b, x, y, cfg.tile_n, x_in_first)
  for _ in range(3):  # the exchange depends on timing: run it more than once
    got = run(a, b, x, y, cfg, sms, first=first, clip_m=m % cfg.cluster_tile[0] != 0)
    # every partial of every tile, written and right (the totals' inputs)
    for nm, part in (("ss", ss), ("sx", sx)):
      p = np.asarray(got[nm], np.float64)
      assert p.shape == part.shape, (nm, p.shape, part.shape)
      assert np.all(np.isfinite(p)), f"{nm}: unwritten partials"
      np.testing.assert_allclose(p, part, rtol=1e-4, atol=1e-4 * np.abs(part).max())
    assert_within_baseline(got["out"], want, xla_baseline(a, b, x, y, x_in_first),
                           f"row totals {config} {first.__name__}")


_NO_SEMAPHORES = ("row totals wait on global semaphores, which the Mosaic GPU interpreter "
                  "does not have (and it runs one CTA at a time): checked on the GPU only")


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("m,n,k,sms", CASES, ids=[f"{m}x{n}x{k}" for m, n, k, _ in CASES])
def test_row_totals(key, kernel_impl, config, m, n, k, sms):
  if kernel_impl != "mosaic":
    pytest.skip(_NO_SEMAPHORES)
  check_row_totals(key, config, m, n, k, sms)


@pytest.mark.parametrize("config", ["pingpong_cluster_n", "pingpong_64x64"])
@pytest.mark.parametrize("m,n,k,sms", CASES[:2], ids=[f"{m}x{n}x{k}" for m, n, k, _ in
                                                    CASES[:2]])
def test_row_totals_first_pass_without_tile_operands(key, kernel_impl, config, m, n, k,
                                                     sms):
  """A first pass that reads no tile operand stages none; the second stages them all."""
  if kernel_impl != "mosaic":
    pytest.skip(_NO_SEMAPHORES)
  check_row_totals(key, config, m, n, k, sms, first=first_pass_no_tiles)


def test_row_totals_first_pass_stages_what_it_reads():
  """The tile operands the first pass reads, found by tracing it on stand-ins (CPU)."""
  kinds = {"x": pk.InputKind.TILE, "r": pk.InputKind.ROW, "y": pk.InputKind.TILE}
  dtypes = {"x": jnp.bfloat16, "r": F32, "y": jnp.bfloat16}
  reads = lambda fn: pk.gemm_mgpu.row_totals_pass_reads(fn, kinds, dtypes, OUTPUTS,
                                                        PINGPONG)
  assert reads(first_pass) == ("x",)
  assert reads(first_pass_no_tiles) == ()

  def reads_y_then_x(tile, acc):
    v = acc * tile.load("y").astype(F32) + tile.load("x").astype(F32) * tile.load("r")[:, None]
    tile.store("ss", jnp.sum(v, axis=1))
    tile.store("sx", jnp.sum(v, axis=1))
  assert reads(reads_y_then_x) == ("x", "y")  # in the operands' order

  def untraceable(tile, acc):  # stores an output the first pass does not have
    tile.store("out", acc)
  assert reads(untraceable) == ("x", "y"), "a pass it cannot trace stages every operand"


def test_row_totals_refuse_what_they_cannot_run(key):
  """Where the kernel cannot make row totals, a ValueError that says why and what to
  change, before anything is compiled (so this runs on the CPU too)."""
  a, b = normal(key, (256, 128), jnp.bfloat16), normal(key, (128, 512), jnp.bfloat16)
  x = normal(key, (256, 512), jnp.bfloat16)
  go = lambda config=PINGPONG, sms=132, **kw: run(a, b, x, x, config, sms, device_kind="x",
                                                  **kw)
  with pytest.raises(ValueError, match="cooperative schedule"):
    go(dataclasses.replace(PINGPONG, schedule=Schedule.COOPERATIVE))
  with pytest.raises(ValueError, match="grid_minor_dim=MatDim.N and grid_tile_width >= 2"):
    go(dataclasses.replace(PINGPONG, grid_tile_width=1))
  with pytest.raises(ValueError, match="grid_minor_dim=MatDim.N"):
    go(dataclasses.replace(PINGPONG, grid_minor_dim=MatDim.M))
  with pytest.raises(ValueError, match="only 1 clusters"):
    go(sms=2)
  with pytest.raises(ValueError, match="interpreter has no global semaphores"):
    go(interpret=pk.interpret_params())
  with pytest.raises(ValueError, match="need a row_totals_pass"):
    pk.gemm(a, b, inputs={"x": (pk.InputKind.TILE, x)}, epilogue=second_pass,
            outputs=OUTPUTS, config=PINGPONG, num_sms=132, device_kind="x")
  with pytest.raises(ValueError, match="needs row_total outputs"):
    pk.gemm(a, b, row_totals_pass=first_pass, config=PINGPONG, num_sms=132,
            device_kind="x")
  with pytest.raises(ValueError, match="also passed operands"):
    pk.gemm(a, b, inputs={"x": (pk.InputKind.TILE, x), "ss": (pk.InputKind.ROW, x[:, 0])},
            epilogue=second_pass, outputs=OUTPUTS, row_totals_pass=first_pass,
            config=PINGPONG, num_sms=132, device_kind="x")
  with pytest.raises(ValueError, match="width does not apply"):
    pk.EpilogueOutput("ss", pk.OutputKind.ROW_TOTAL, F32, width=2)
  with pytest.raises(ValueError, match="partial reductions are fp32"):
    pk.EpilogueOutput("ss", pk.OutputKind.ROW_TOTAL, jnp.bfloat16)


def test_row_totals_lower_for_the_gpu():
  """The two-pass program lowers for an H100 (Mosaic GPU's MLIR, on any machine):
  catches tracing and layout errors of the exchange where no GPU runs it."""
  a = jax.ShapeDtypeStruct((512, 256), jnp.bfloat16)
  b = jax.ShapeDtypeStruct((256, 1024), jnp.bfloat16)
  x = jax.ShapeDtypeStruct((512, 1024), jnp.bfloat16)
  for (name, cfg), first in zip(sorted(CONFIGS.items()) + [("64x64", CONFIGS["pingpong_64x64"])],
                                [first_pass] * len(CONFIGS) + [first_pass_no_tiles]):
    fn = jax.jit(lambda a, b, x, c=cfg, f=first: run(a, b, x, x, c, 132, first=f,
                                                     device_kind="x"))
    exported = jax.export.export(fn, platforms=["cuda"])(a, b, x)
    assert "mosaic_gpu" in exported.mlir_module(), (name, first.__name__)
