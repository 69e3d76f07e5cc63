"""Bad inputs fail early with a ValueError that names the problem."""
import re

import jax.numpy as jnp
import pytest

import coda_jax as cj
import pallas_kernels as pk
from coda_jax.grad_primitives import GatedGrad
from pallas_kernels import EpilogueOutput, GemmConfig, InputKind, MatDim, OutputKind
from helpers import gemm_inputs, normal

M, N, K = 128, 256, 64
STORE = [cj.Store("y")]


@pytest.fixture
def ab(key):
  return gemm_inputs(key, M, N, K, jnp.bfloat16)


def run(a, b, program=STORE, operands=None, **kw):
  # impl="xla" so that a check that is missing would not reach (slow) kernel code.
  kw.setdefault("impl", "xla")
  return cj.gemm_epilogue(a, b, program, operands or {}, **kw)


# ---- coda_jax.gemm_epilogue ------------------------------------------------------------
@pytest.mark.parametrize("impl", ["xla", "interpret"])
def test_rank3_a(key, ab, impl):
  a3 = normal(key, (2, M, K), jnp.bfloat16)
  with pytest.raises(ValueError, match=r"2-D.*\(2, 128, 64\)"):
    run(a3, ab[1], impl=impl)


def test_dtype_mismatch(ab):
  with pytest.raises(ValueError, match="share a dtype.*bfloat16.*float16"):
    run(ab[0], ab[1].astype(jnp.float16))


def test_contracting_mismatch(ab):
  with pytest.raises(ValueError, match="contracting dims differ.*K=64.*K=32"):
    run(ab[0], ab[1][:32])


@pytest.mark.parametrize("kind,shape", [("r", (M + 8,)), ("g", (M,)), ("x0", (M, N // 2))])
def test_operand_wrong_shape(key, ab, kind, shape):
  program = {"r": [cj.ScaleRow("r")], "g": [cj.ScaleCol("g")],
             "x0": [cj.AddTile("x0")]}[kind] + STORE
  want = {"r": (M,), "g": (N,), "x0": (M, N)}[kind]
  with pytest.raises(ValueError, match=rf"operand '{kind}'.*shape \({want[0]},.*got \({shape[0]},"):
    run(*ab, program, {kind: normal(key, shape)})


def test_missing_operand(ab):
  with pytest.raises(ValueError, match=r"reads operands \['r'\] that were not passed"):
    run(*ab, [cj.ScaleRow("r"), cj.Store("y")], {})


def test_extra_operand(key, ab):
  with pytest.raises(ValueError, match=r"operands \['zz'\] are not read"):
    run(*ab, STORE, {"zz": normal(key, (M,))})


@pytest.mark.parametrize("prim", [cj.Gated(96), cj.Rotate("pos", "fr", 96)],
                         ids=["gated", "rotate"])
def test_n_not_multiple_of_pair_block(key, ab, prim):
  ops = {"pos": jnp.arange(M), "fr": normal(key, (N,))} if isinstance(prim, cj.Rotate) else {}
  with pytest.raises(ValueError,
                     match=r"N=256 must be a multiple of its column group \(pair block\) 192"):
    run(*ab, [prim, cj.Store("y")], ops)


@pytest.mark.parametrize("program", [
    [cj.Store("y"), cj.Store("y")],
    [cj.RowSum("s"), cj.ColSum("s")],
    [cj.RowLogSumExp("l"), cj.Store("l_max")],
], ids=["store", "reductions", "lse_parts"])
def test_duplicate_outputs(ab, program):
  with pytest.raises(ValueError, match="duplicate outputs"):
    run(*ab, program)


def test_program_without_outputs(ab):
  with pytest.raises(ValueError, match="stores nothing"):
    run(*ab, [cj.ScaleConst(2.0)])


def test_not_a_primitive(ab):
  with pytest.raises(ValueError, match="not a coda_jax primitive"):
    run(*ab, [lambda x: x, cj.Store("y")])


def test_operand_read_as_two_kinds(key, ab):
  with pytest.raises(ValueError, match="'v' is read both as row and col"):
    run(*ab, [cj.ScaleRow("v"), cj.ScaleCol("v"), cj.Store("y")], {"v": normal(key, (M,))})


def test_column_operand_after_narrowing(key, ab):
  with pytest.raises(ValueError, match="ScaleCol reads col operand 'g' after a step that changed "
                                       "the width; column and tile operands must come before it"):
    run(*ab, [cj.Gated(32), cj.ScaleCol("g"), cj.Store("y")], {"g": normal(key, (N,))})


def test_pairwise_after_narrowing(ab):
  """A second pair step would pair columns of the halved value: not supported."""
  with pytest.raises(ValueError, match="Gated: a pairwise step after a step that changed the "
                                       "width is not supported"):
    run(*ab, [cj.Gated(32), cj.Gated(16), cj.Store("y")])


def test_unknown_impl(ab):
  with pytest.raises(ValueError, match="impl='cuda'"):
    run(*ab, impl="cuda")


def test_unknown_impl_from_env(ab, monkeypatch):
  monkeypatch.setenv("CODA_JAX_IMPL", "triton")
  with pytest.raises(ValueError, match="CODA_JAX_IMPL='triton'"):
    run(*ab, impl="auto")


def test_config_epilogue_width_vs_pair_block(ab):
  cfg = GemmConfig(tile_m=64, tile_n=64, tile_k=32, stages=3, epi_tile_n=32)
  with pytest.raises(ValueError, match=r"epi_tile_n=32 must be a multiple of the program's "
                                       r"column group \(pair block\) 64"):
    run(*ab, [cj.Gated(32), cj.Store("y")], impl="interpret", config=cfg)


@pytest.mark.parametrize("make,match", [
    (lambda: cj.Gated(32, "relu"), r"Gated.activation='relu': one of \['gelu', 'silu'\]"),
    (lambda: cj.Gated(12), "Gated.block=12 must be a positive multiple of 8"),
    (lambda: cj.Rotate("p", "f", 0), "Rotate.block=0 must be a positive multiple of 8"),
    (lambda: GatedGrad("z", 32, "y", "zdz", "relu"),
     r"GatedGrad.activation='relu': one of \['gelu', 'silu'\]"),
    (lambda: GatedGrad("z", 20, "y", "zdz"), "GatedGrad.block=20 must be a positive multiple of 8"),
], ids=["act", "gblock", "rblock", "grad_act", "grad_block"])
def test_bad_primitive(make, match):
  with pytest.raises(ValueError, match=match):
    make()


# ---- pallas_kernels.gemm ---------------------------------------------------------------
def test_gemm_rank3(key, ab, interpret):
  with pytest.raises(ValueError, match="2-D"):
    pk.gemm(normal(key, (2, M, K), jnp.bfloat16), ab[1], interpret=interpret)


def test_gemm_float32(ab, interpret):
  a, b = (x.astype(jnp.float32) for x in ab)
  with pytest.raises(ValueError, match="float32.*bfloat16.*float16"):
    pk.gemm(a, b, interpret=interpret)


def test_gemm_config_does_not_divide(ab, interpret):
  cfg = GemmConfig(tile_m=128, tile_n=128, tile_k=64)  # CTA at least (128, 128)
  a, b = ab
  with pytest.raises(ValueError, match=r"\(M, N, K\)=\(64, 256, 64\) must be multiples of"):
    pk.gemm(a[:64], b, config=cfg, interpret=interpret)


@pytest.mark.parametrize("fields,match", [
    (dict(tile_m=96), "tile_m=96 must be a multiple of 64"),
    (dict(tile_n=100), "tile_n=100 must be a positive multiple of 8"),
    (dict(epi_tile_n=48), "must divide the warpgroup tile"),
    (dict(stages=1), "stages=1"),
    (dict(tile_m=128, epi_tile_m=32), "GemmConfig.epi_tile_m=32 must be a multiple of 64"),
    (dict(schedule="pingpong"), r"GemmConfig.schedule='pingpong': one of"),
    (dict(stages=17, schedule=pk.Schedule.PINGPONG), "use at most 16 stages"),
    (dict(grid_tile_width=0), "grid_tile_width=0 must be >= 1"),
    (dict(epi_operand_slots=5), r"epi_operand_slots=5: between 1 and the 4 sub-tiles"),
    (dict(epi_operand_slots=0), r"epi_operand_slots=0: between 1 and the 4 sub-tiles"),
    (dict(epi_out_slots=5), r"epi_out_slots=5: between 1 and the 4 sub-tiles"),
    (dict(epi_out_slots=0), r"epi_out_slots=0: between 1 and the 4 sub-tiles"),
    (dict(epi_operand_refetch_early=1), r"epi_operand_refetch_early=1: True or False"),
    (dict(epi_column_sums_per_tile="yes"), r"epi_column_sums_per_tile='yes': True or False"),
    (dict(epi_tile_n=128, epi_store_n=48), r"epi_store_n=48: a multiple of 32 that splits"),
    (dict(tile_n=96, epi_tile_n=96, epi_store_n=32), r"epi_tile_n=96 into an even number of parts"),
    (dict(epi_tile_n=64, epi_store_n=64), r"epi_store_n=64: .* or None to store whole"),
])
def test_gemm_bad_config(fields, match):
  """A config checks itself when it is made."""
  with pytest.raises(ValueError, match=match):
    GemmConfig(**fields)


def test_gemm_no_default_tiling(key, ab, interpret):
  """No config given and none of the default tilings divides M = 120."""
  with pytest.raises(ValueError, match=r"no GEMM tiling divides \(M, N, K\)=\(120, 256, 64\)"):
    pk.gemm(ab[0][:120], ab[1], interpret=interpret)


def test_gemm_no_default_tiling_odd_multiples_of_64(key, interpret):
  """M = 192 and N = 320 are multiples of 64, but with B stored (K, N) every CTA tile is
  128 wide along M or N (a warpgroup's half of B is at least one 64-column swizzle
  tile): the message says so. Stored (N, K), the same shape tiles."""
  a, b = gemm_inputs(key, 192, 320, 64, jnp.bfloat16)
  with pytest.raises(ValueError, match=r"one of them of 128 when B is stored \(K, N\)"):
    pk.gemm(a, b, interpret=interpret)
  assert pk.default_config(192, 320, 64, trans_b=True).cluster_tile == (64, 64)


def test_gemm_split_b_too_narrow(ab, interpret):
  """Warpgroups splitting N take halves of B's 64-column swizzle tiles when B is stored
  (K, N): tile_n = 32 cannot be split so (with B stored (N, K) it can)."""
  cfg = GemmConfig(tile_m=64, tile_n=32, tile_k=64, epi_tile_n=32, wg_dim=MatDim.N,
                   cluster_dim=None)
  with pytest.raises(ValueError, match=r"tile_n=32 with wg_dim=N and B stored \(K, N\): the "
                                       "warpgroups' halves of B must be multiples of 64 columns"):
    pk.gemm(*ab, config=cfg, interpret=interpret)


def test_gemm_output_width_not_multiple_of_8(ab, interpret):
  """A half-width output (after a gated pair) of an 8-column epilogue sub-tile would be 4
  columns wide: too narrow for a TMA store."""
  cfg = GemmConfig(tile_m=64, tile_n=64, tile_k=64, epi_tile_n=8, wg_dim=MatDim.N,
                   cluster_dim=None)
  with pytest.raises(ValueError, match=r"output 'o': epi_tile_n=8 \* 0.5 must be a multiple of 8"):
    pk.gemm(*ab, outputs=(EpilogueOutput("o", width=0.5),), epilogue=lambda t, acc: None,
            config=cfg, interpret=interpret)


def test_gemm_in_place_operand_backs_two_outputs(key, ab, interpret):
  g = normal(key, (M, N))
  outs = (EpilogueOutput("o1", dtype=jnp.float32), EpilogueOutput("o2", dtype=jnp.float32))
  with pytest.raises(ValueError, match="an operand can back one output only"):
    pk.gemm(*ab, inputs={"g": (InputKind.TILE, g)}, outputs=outs, epilogue=lambda t, acc: None,
            in_place={"o1": "g", "o2": "g"}, interpret=interpret)


def test_gemm_too_much_shared_memory(key, interpret):
  a, b = gemm_inputs(key, 256, 512, 256, jnp.bfloat16)
  cfg = GemmConfig(tile_m=128, tile_n=256, tile_k=128, stages=8)
  with pytest.raises(ValueError, match="bytes of shared memory"):
    pk.gemm(a, b, config=cfg, interpret=interpret)


def test_gemm_duplicate_output_names(ab, interpret):
  outs = (EpilogueOutput("o"), EpilogueOutput("o"))
  with pytest.raises(ValueError, match="output names must be unique"):
    pk.gemm(*ab, outputs=outs, epilogue=lambda t, acc: None, interpret=interpret)


def test_gemm_input_wrong_shape(key, ab, interpret):
  with pytest.raises(ValueError, match=r"operand 'g': a col operand must have shape \(256,\)"):
    pk.gemm(*ab, inputs={"g": (InputKind.COL, normal(key, (M,)))}, interpret=interpret)


@pytest.mark.parametrize("kwargs,match", [
    (dict(width=3), "width must be 0.5, 1 or 2"),
    (dict(kind=OutputKind.ROW_PARTIAL, dtype=jnp.bfloat16), "partial reductions are fp32"),
    (dict(kind=OutputKind.ROW_PARTIAL, dtype=jnp.float32, width=2),
     "row partials have one value per row; width does not apply"),
])
def test_bad_output_spec(kwargs, match):
  with pytest.raises(ValueError, match=match):
    EpilogueOutput("o", **kwargs)


SMALL = GemmConfig(tile_m=64, tile_n=64, tile_k=64, stages=3, wg_dim=MatDim.N, cluster_dim=None)


def test_epilogue_forgets_an_output(ab, interpret):
  """Checked while the kernel is traced: an unwritten output is an error, not garbage."""
  outs = (EpilogueOutput("out"), EpilogueOutput("aux"))
  with pytest.raises(ValueError, match=r"did not store outputs \['aux'\]"):
    pk.gemm(*ab, outputs=outs, epilogue=lambda t, acc: t.store("out", acc), config=SMALL,
            interpret=interpret)


def test_epilogue_stores_twice(ab, interpret):
  def twice(t, acc):
    t.store("out", acc)
    t.store("out", acc)
  with pytest.raises(ValueError, match="stores 'out' twice"):
    pk.gemm(*ab, epilogue=twice, config=SMALL, interpret=interpret)


@pytest.mark.parametrize("epilogue,match", [
    (lambda t, acc: t.store("out", acc + t.load("zz")),
     r"epilogue reads operand 'zz', but only \[\] were passed"),
    (lambda t, acc: t.store("zz", acc), r"epilogue stores 'zz', but only \['out'\] were declared"),
], ids=["load", "store"])
def test_epilogue_unknown_name(ab, interpret, epilogue, match):
  """Checked while the kernel is traced: a closure that reads an operand that was not
  passed, or stores an output that was not declared."""
  with pytest.raises(KeyError, match=match):
    pk.gemm(*ab, epilogue=epilogue, config=SMALL, interpret=interpret)


@pytest.mark.parametrize("read,match", [
    (lambda t: t.column_value("r", 0), r"column_value\('r'\): a col operand's, but 'r' is a "
                                       "row operand"),
    (lambda t: t.column_value("zz", 0), r"column_value\('zz'\): a col operand's, but 'zz' is "
                                        "not passed"),
    (lambda t: t.column_value("f", 64), r"column_value\('f', 64\): the sub-tile has columns "
                                        r"\[0, 64\)"),
], ids=["row_operand", "not_passed", "past_the_sub_tile"])
def test_epilogue_column_value_bad(key, ab, interpret, read, match):
  """``tile.column_value`` reads a col operand's value at a column of the sub-tile:
  anything else is named while the kernel is traced."""
  def epilogue(t, acc):
    read(t)
    t.store("out", acc)
  inputs = {"r": (InputKind.ROW, normal(key, (M,))), "f": (InputKind.COL, normal(key, (N,)))}
  with pytest.raises(ValueError, match=match):
    pk.gemm(*ab, inputs=inputs, epilogue=epilogue, config=SMALL, interpret=interpret)


def test_epilogue_store_wrong_shape(ab, interpret):
  with pytest.raises(ValueError, match=r"stores 'out' with shape \(64, 32\), expected \(64, 64\)"):
    pk.gemm(*ab, epilogue=lambda t, acc: t.store("out", acc[:, :32]), config=SMALL,
            interpret=interpret)


@pytest.mark.parametrize("kwargs,match", [
    (dict(head_dim=24), "head_dim=24 must be a positive multiple of 16"),
    (dict(n_kv_heads=3), "n_q_heads=4 must be a multiple of n_kv_heads=3"),
    (dict(reduction="max"), "reduction='max'"),
    (dict(activation="relu"), "activation='relu'"),
    (dict(swiglu_block=12), "swiglu_block=12 must be a positive multiple of 8"),
    (dict(eps=0.0), "eps=0.0 must be positive"),
    (dict(lm_chunk_rows=0), "lm_chunk_rows=0 must be positive"),
    (dict(impl="cuda"), "impl='cuda'"),
])
def test_block_config_checks_itself(kwargs, match):
  from coda_jax import blocks
  args = dict(n_q_heads=4, n_kv_heads=2, head_dim=32) | kwargs
  with pytest.raises(ValueError, match=re.escape(match)):
    blocks.BlockConfig(**args)


def test_block_config_impl_sequence_is_hashable():
  from coda_jax import blocks
  cfg = blocks.BlockConfig(4, 2, 32, impl=["mosaic", "xla"])
  assert cfg.impl == ("mosaic", "xla") and hash(cfg)
