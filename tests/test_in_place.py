"""Accumulate-into-output: an output written into the buffer of the operand it adds."""
import jax
import jax.numpy as jnp
import pytest

import coda_jax as cj
import pallas_kernels as pk
from pallas_kernels import GemmConfig, MatDim
from helpers import gemm_inputs, matmul_f32, normal, rel_err

PROGRAM = [cj.AddTile("g"), cj.Store("g_new", jnp.float32)]
# several tiles per CTA, so that in-place reads and writes of neighbouring tiles interleave
CONFIG = GemmConfig(tile_m=64, tile_n=64, tile_k=64, stages=3, epi_tile_n=32,
                    wg_dim=MatDim.N, cluster_dim=None)


@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (True, False)], ids=["nn", "tn"])
def test_accumulate_in_place(key, kernel_impl, trans_a, trans_b):
  """g + A^T B, the weight-gradient form, written over g; under jit with g donated."""
  ka, kg = jax.random.split(key)
  a, b = gemm_inputs(ka, 256, 256, 128, jnp.bfloat16, trans_a, trans_b)
  g = normal(kg, (256, 256))
  want = matmul_f32(a, b, trans_a, trans_b) + g

  @jax.jit
  def step(a, b, g):
    return cj.gemm_epilogue(a, b, PROGRAM, {"g": g}, trans_a=trans_a, trans_b=trans_b,
                            impl=kernel_impl, config=CONFIG, in_place={"g_new": "g"})
  got = step(a, b, g)["g_new"]
  # fp32 accumulator and fp32 output: the only error is the fp32 summation order
  assert rel_err(got, want) < 1e-5
  hlo = jax.jit(step, donate_argnums=2).lower(a, b, g).as_text()
  assert "tf.aliasing_output" in hlo, "the donated operand is not aliased to the output"


def test_in_place_needs_matching_tile(key, interpret):
  a, b = gemm_inputs(key, 128, 256, 64, jnp.bfloat16)
  g16 = normal(key, (128, 256)).astype(jnp.bfloat16)
  with pytest.raises(ValueError, match="one shape and dtype"):
    pk.gemm(a, b, inputs={"g": (pk.InputKind.TILE, g16)},
            epilogue=lambda t, acc: t.store("o", acc + t.load("g")),
            outputs=(pk.EpilogueOutput("o", dtype=jnp.float32),), in_place={"o": "g"},
            interpret=interpret)
  with pytest.raises(ValueError, match="must be a declared output"):
    pk.gemm(a, b, inputs={"g": (pk.InputKind.TILE, g16)},
            epilogue=lambda t, acc: t.store("out", acc + t.load("g")),
            in_place={"nope": "g"}, interpret=interpret)
