"""``bench.epilogue_bytes``: the tile bytes each GEMM's epilogue writes and reads."""
import jax
import jax.numpy as jnp

import coda_jax as cj
from bench import epilogue_bytes as EB
from bench import lowering_time as lt
from pallas_kernels import autotune

M, K, N = 512, 256, 1024


def _recorded(program, operands):
  """The problem ``gemm_epilogue(a, b, program, operands)`` records, traced as an H100
  would run it (nothing lowered)."""
  a = jax.ShapeDtypeStruct((M, K), jnp.bfloat16)
  b = jax.ShapeDtypeStruct((K, N), jnp.bfloat16)
  with lt.pretend(), autotune.recording() as rec:
    jax.eval_shape(lambda a, b, ops: cj.gemm_epilogue(a, b, program, ops), a, b, operands)
  [problem] = rec.values()
  return problem


def test_bytes_of_outputs_and_operands_by_width_and_dtype():
  tile = jax.ShapeDtypeStruct((M, N), jnp.bfloat16)
  two = _recorded([cj.AddTile("x0"), cj.Store("x1"), cj.RowSum("ss", square=True),
                   cj.ScaleConst(2.0), cj.Store("h", jnp.float32)], {"x0": tile})
  t = EB.tile_bytes(two)
  assert (t["written"], t["read"], t["product"]) == (M * N * (2 + 4), M * N * 2, M * N * 2)
  assert t["outputs"] == ["x1 bfloat16", "h float32"]  # the row partial left out
  assert t["operands"] == ["x0 bfloat16"]
  gated = _recorded([cj.Store("z"), cj.Gated(32), cj.Store("y")], {})
  t = EB.tile_bytes(gated)
  assert (t["written"], t["read"]) == (M * N * 2 + M * N // 2 * 2, 0)
  assert t["outputs"] == ["z bfloat16", "y x0.5 bfloat16"]
  table = EB.table({"a": ("plain-ish", gated), "b": ("two", two)}).splitlines()
  # the heaviest writer first (3.00 before 1.50), then the total over both
  assert "| two |" in table[2] and table[2].endswith("| 3.00 |")
  assert "| plain-ish |" in table[3] and table[3].endswith("| 1.50 |")
  total_mb = (M * N * 6 + M * N * 3) / 1e6
  assert table[4] == f"| total | | | | | | {total_mb:.0f} | {M * N * 2 / 1e6:.0f} | 2.25 |"
