"""Accumulate-into-output: an output written into the buffer of the operand it adds.

Values against the fp32 truth, that the operand's buffer really is reused (compiled
memory, under donation), and the patterns the library and its users rely on inside
``jax.lax.scan``: an accumulator carried across steps (the LM head's dW), and an output
written over a per-step slice of the scan's xs, also as a ``custom_vjp`` backward over a
scan's saved residuals. On the GPU the slice cases returned wrong values (NaN in
training: docs/design.md#6-in-place-outputs-and-xla) and overwrote the caller's array,
until ``pallas_kernels.gemm`` fenced the aliased buffer from XLA's dynamic-slice fusion; the
CPU interpreter never showed it."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import coda_jax as cj
import pallas_kernels as pk
from coda_jax.grad_primitives import GatedGrad
from pallas_kernels import GemmConfig, MatDim, Schedule
from helpers import (assert_within_baseline, gated_pairs, gemm_inputs, matmul_f32, normal,
                     rel_err)

PROGRAM = [cj.AddTile("g"), cj.Store("g_new", jnp.float32)]
# the same sum with the add in the output (``Store(add_to=...)``): in place on the GPU,
# the TMA store adds into g's buffer and nothing reads g; elsewhere (fresh output,
# vmap, the interpreter) the kernel stages g and adds it before a plain store
STORE_ADDS = [cj.Store("g_new", jnp.float32, add_to="g")]
PROGRAMS = pytest.mark.parametrize("program", [PROGRAM, STORE_ADDS],
                                   ids=["add_tile", "store_adds"])
# several tiles per CTA, so that in-place reads and writes of neighbouring tiles interleave
CONFIG = GemmConfig(tile_m=64, tile_n=64, tile_k=64, stages=3, epi_tile_n=32,
                    wg_dim=MatDim.N, cluster_dim=None)
PINGPONG_CONFIG = GemmConfig(tile_m=64, tile_n=64, tile_k=64, stages=3, epi_tile_n=32,
                             cluster_dim=None, schedule=Schedule.PINGPONG)
# one (64, 128) CTA tile: the scan tests run one small kernel per step
SCAN_CONFIG = GemmConfig(tile_m=64, tile_n=64, tile_k=64, stages=2, epi_tile_n=64,
                         wg_dim=MatDim.N, cluster_dim=None)
STEPS = 4  # a scan XLA keeps as a loop (the slice bug needed more than 2 steps to show)
P = 32  # gated pair block


def _temp_bytes(fn, donate, *args) -> int:
  """Bytes of temporaries (neither arguments nor outputs) of ``fn`` compiled under jit
  with argument ``donate`` donated."""
  stats = jax.jit(fn, donate_argnums=donate).lower(*args).compile().memory_analysis()
  return stats.temp_size_in_bytes


@PROGRAMS
@pytest.mark.parametrize("config", [CONFIG, PINGPONG_CONFIG], ids=["cooperative", "pingpong"])
@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (True, False)], ids=["nn", "tn"])
def test_accumulate_in_place(key, kernel_impl, trans_a, trans_b, config, program):
  """g + A^T B, the weight-gradient form, written over g; under jit with g donated."""
  ka, kg = jax.random.split(key)
  a, b = gemm_inputs(ka, 256, 256, 128, jnp.bfloat16, trans_a, trans_b)
  g = normal(kg, (256, 256))
  want = matmul_f32(a, b, trans_a, trans_b) + g

  def step(a, b, g):
    return cj.gemm_epilogue(a, b, program, {"g": g}, trans_a=trans_a, trans_b=trans_b,
                            impl=kernel_impl, config=config, in_place={"g_new": "g"})
  got = jax.jit(step, donate_argnums=2)(a, b, g + 0)["g_new"]
  # fp32 accumulator and fp32 output: the only error is the fp32 summation order
  assert rel_err(got, want) < 1e-5


@PROGRAMS
def test_in_place_reuses_the_donated_buffer(key, kernel_impl, program):
  """Under jit with the accumulated operand donated, the in-place kernel writes into
  that buffer: the compiled program holds no (M, N) temporary, where the same call
  without ``in_place`` needs one (the kernel's fresh output, then copied into the
  donated buffer). Only "the HLO aliases a donated input" would not show a dropped
  ``in_place``: XLA aliases any donated input to a same-shaped output."""
  m, n = 256, 256
  a, b = gemm_inputs(key, m, n, 128, jnp.bfloat16)
  g = normal(key, (m, n))

  def accumulate(in_place):
    return lambda a, b, g: cj.gemm_epilogue(
        a, b, program, {"g": g}, impl=kernel_impl, config=CONFIG, in_place=in_place)["g_new"]
  out_bytes = m * n * 4
  reused = _temp_bytes(accumulate({"g_new": "g"}), 2, a, b, g)
  fresh = _temp_bytes(accumulate(None), 2, a, b, g)
  assert reused < out_bytes, f"in place: {reused} bytes of temporaries; the output is {out_bytes}"
  assert fresh >= reused + out_bytes, (fresh, reused)  # the control: the check can see it


def _scan_accumulate(in_place, impl, program=PROGRAM):
  """dW = acc0 + sum_s A_s^T B_s, one in-place kernel per scan step (the LM head's dW
  over row chunks, coda_jax.fused_ops._lm_bwd)."""
  def run(a, b, acc0):
    def step(acc, ab):
      out = cj.gemm_epilogue(ab[0], ab[1], program, {"g": acc}, trans_a=True, impl=impl,
                             config=SCAN_CONFIG, in_place=in_place)
      return out["g_new"], None
    return jax.lax.scan(step, acc0, (a, b))[0]
  return run


@PROGRAMS
def test_accumulate_in_place_across_scan(key, kernel_impl, program):
  """An fp32 accumulator carried through a scan of 4 steps, each adding A_s^T B_s in
  place, with the initial accumulator donated: every step's sum is in the result
  (against the fp32 truth), and the loop saves the (M, N) temporary that the same scan
  without ``in_place`` needs."""
  m, n, k = 64, 128, 64
  ka, kb, kg = jax.random.split(key, 3)
  a = normal(ka, (STEPS, k, m), jnp.bfloat16)  # stored (K, M): trans_a, as dW = n^T dlogits
  b = normal(kb, (STEPS, k, n), jnp.bfloat16)
  acc0 = normal(kg, (m, n))
  truth = acc0 + jnp.einsum("skm,skn->mn", a.astype(jnp.float32), b.astype(jnp.float32),
                            precision=jax.lax.Precision.HIGHEST)
  # unfused: XLA's per-step GEMM in fp32 from the bf16 operands, added step by step
  unfused = acc0
  for s in range(STEPS):
    unfused = unfused + jnp.matmul(a[s].T, b[s], preferred_element_type=jnp.float32)
  run = _scan_accumulate({"g_new": "g"}, kernel_impl, program)
  got = jax.jit(run, donate_argnums=2)(a, b, acc0 + 0)
  assert_within_baseline(got, truth, unfused, "scanned accumulator")
  reused = _temp_bytes(run, 2, a, b, acc0)
  fresh = _temp_bytes(_scan_accumulate(None, kernel_impl, program), 2, a, b, acc0)
  # about one (M, N) fp32 buffer less (the loop's small temporaries pack differently)
  assert fresh - reused > m * n * 4 // 2, (fresh, reused)


# name -> (program, in_place, width of z relative to the accumulator)
SLICE_PROGRAMS = {
    "add_tile": ([cj.AddTile("z"), cj.Store("out")], {"out": "z"}, 1),
    # the program that showed the slice bug: dz of a gated pair written over the saved
    # pre-activation z
    "gated_grad": ([GatedGrad("z", P, "y", "zdz"), cj.Store("out")], {"out": "z"}, 2),
}


@pytest.mark.parametrize("name,loop", [("add_tile", "scan"), ("gated_grad", "scan"),
                                       ("add_tile", "python")])
def test_in_place_over_slices(key, kernel_impl, name, loop):
  """The backing operand is a per-step slice of the scan's xs, the output is stacked by
  the scan (4 steps), or the same unrolled in Python (static slices, jnp.stack): every
  step's values against the fp32 truth, and the caller's xs (not donated) are left as
  they were."""
  program, in_place, zw = SLICE_PROGRAMS[name]
  m, n, k = 64, 128, 64
  ka, kb, kz = jax.random.split(key, 3)
  a = normal(ka, (STEPS, m, k), jnp.bfloat16)
  b = normal(kb, (k, n), jnp.bfloat16) * k ** -0.5
  z = normal(kz, (STEPS, m, zw * n), jnp.bfloat16)
  z_before = np.asarray(z.astype(jnp.float32))

  def step(_, az):
    out = cj.gemm_epilogue(az[0], b, program, {"z": az[1]}, impl=kernel_impl,
                           config=SCAN_CONFIG, in_place=in_place)
    return None, out["out"]

  def run(a, b, z):
    if loop == "python":
      return jnp.stack([step(None, (a[s], z[s]))[1] for s in range(STEPS)])
    return jax.lax.scan(step, None, (a, z))[1]
  got = jax.jit(run)(a, b, z)
  for s in range(STEPS):
    acc = matmul_f32(a[s], b)
    acc_bf16 = jnp.matmul(a[s], b)  # XLA's unfused bf16 GEMM
    if name == "add_tile":
      truth = acc + z[s].astype(jnp.float32)
      unfused = acc_bf16 + z[s]
    else:  # dz = vjp of the gated pairs at z, cotangent acc
      truth = jax.vjp(lambda zz: gated_pairs(zz, P), z[s].astype(jnp.float32))[1](acc)[0]
      unfused = jax.vjp(lambda zz: gated_pairs(zz, P), z[s])[1](acc_bf16)[0]
    assert got[s].dtype == jnp.bfloat16
    assert_within_baseline(got[s], truth, unfused, f"{name}, step {s}")
  np.testing.assert_array_equal(np.asarray(z.astype(jnp.float32)), z_before,
                                err_msg="the kernel wrote into the caller's (undonated) xs")


def _glu_layers(impl):
  """x <- x + glu(x) per layer under jax.lax.scan; glu(x) = gated(x @ w1) @ w2 is a
  custom_vjp whose backward writes dz over the saved pre-activation z in place (the
  shape of coda_jax's SwiGLU backward). ``impl=None``: plain jnp, autodiff."""
  @jax.custom_vjp
  def glu(x, w1, w2):
    return glu_fwd(x, w1, w2)[0]

  def glu_fwd(x, w1, w2):
    z = jnp.matmul(x, w1, preferred_element_type=jnp.float32).astype(x.dtype)
    y = gated_pairs(z, P)
    return jnp.matmul(y, w2, preferred_element_type=jnp.float32).astype(x.dtype), (x, z, w1, w2)

  def glu_bwd(res, dout):
    x, z, w1, w2 = res
    out = cj.gemm_epilogue(dout, w2, [GatedGrad("z", P, "y", "zdz"), cj.Store("dz")],
                           {"z": z}, trans_b=True, impl=impl, in_place={"dz": "z"})
    dz, y = out["dz"], out["y"]
    mm = lambda p, q: jnp.matmul(p, q, preferred_element_type=jnp.float32)
    return (mm(dz, w1.T).astype(x.dtype), mm(x.T, dz).astype(w1.dtype),
            mm(y.T, dout).astype(w2.dtype))

  glu.defvjp(glu_fwd, glu_bwd)
  plain = lambda x, w1, w2: jnp.matmul(gated_pairs(jnp.matmul(x, w1), P), w2)
  layer = plain if impl is None else glu

  def loss(x, w1, w2, ct):
    def step(x, w):
      return x + layer(x, *w), None
    x, _ = jax.lax.scan(step, x, (w1, w2))
    return jnp.sum(x.astype(jnp.float32) * ct)
  return loss


def test_in_place_in_custom_vjp_backward_of_scan(key, kernel_impl):
  """jax.grad through a scan of 4 layers whose custom_vjp backward writes dz over z, a
  per-layer slice of the residuals the scan saved
  (docs/design.md#6-in-place-outputs-and-xla): every gradient against jax.grad of the
  fp32 jnp model, under the tolerance rule."""
  m, d, f = 64, 64, 64
  ks = jax.random.split(key, 4)
  x = normal(ks[0], (m, d), jnp.bfloat16)
  w1 = normal(ks[1], (STEPS, d, 2 * f), jnp.bfloat16) * d ** -0.5
  w2 = normal(ks[2], (STEPS, f, d), jnp.bfloat16) * f ** -0.5
  ct = normal(ks[3], (m, d))
  args = (x, w1, w2)
  up = [v.astype(jnp.float32) for v in args]
  with jax.default_matmul_precision("highest"):
    truth = jax.grad(_glu_layers(None), argnums=(0, 1, 2))(*up, ct)
  unfused = jax.grad(_glu_layers(None), argnums=(0, 1, 2))(*args, ct)
  got = jax.jit(jax.grad(_glu_layers(kernel_impl), argnums=(0, 1, 2)))(*args, ct)
  for name, g, t, u in zip(("dx", "dw1", "dw2"), got, truth, unfused):
    assert g.dtype == jnp.bfloat16, name
    assert_within_baseline(g, t, u, name)


@pytest.mark.parametrize("chunks", [1, 3])
def test_in_place_in_checkpointed_custom_vjp_forward(key, kernel_impl, remat_kernels, chunks):
  """A custom_vjp forward that accumulates A_c^T B_c in place over ``chunks`` row chunks
  (the LM head forms its dW so) under jax.checkpoint with nothing saved, so the backward
  re-runs the forward: the gradient that reads that dW is the fp32 truth's. The in-place
  kernel used to come back zero here: partial evaluation kept the Ref-writing call in the
  forward only, and the re-run read its fresh Ref
  (docs/design.md#6-in-place-outputs-and-xla)."""
  ka, kb, kc = jax.random.split(key, 3)
  a = normal(ka, (chunks * 64, 64), jnp.bfloat16)
  b = normal(kb, (chunks * 64, 128), jnp.bfloat16)
  probe = normal(kc, (64, 128))

  def dw_of(a, b, impl):
    dw = jnp.zeros((64, 128), jnp.float32)
    for c in range(chunks):
      ac, bc = a[c * 64:(c + 1) * 64], b[c * 64:(c + 1) * 64]
      if impl is None:
        dw = dw + matmul_f32(ac, bc, True, False)
      else:
        dw = cj.gemm_epilogue(ac, bc, PROGRAM, {"g": dw}, trans_a=True, impl=impl,
                              config=SCAN_CONFIG, in_place={"g_new": "g"})["g_new"]
    return dw

  @jax.custom_vjp
  def f(a, b):
    return jnp.sum(a.astype(jnp.float32))

  def f_fwd(a, b):
    return f(a, b), dw_of(a, b, kernel_impl)

  def f_bwd(dw, g):  # d/db of the probe's inner product with dW, scaled by g
    return jnp.zeros_like(a), (g * jnp.sum(dw * probe) * jnp.ones(b.shape)).astype(b.dtype)

  f.defvjp(f_fwd, f_bwd)
  remat = jax.checkpoint(f, policy=jax.checkpoint_policies.nothing_saveable)
  want = jnp.sum(dw_of(a, b, None) * probe)
  for name, fn in (("plain", f), ("checkpoint", remat)):
    got = jax.jit(jax.grad(fn, argnums=1))(a, b)[0, 0].astype(jnp.float32)
    # bf16 output of an fp32 sum: the only error is bf16's rounding
    assert abs(got - want) <= 1e-2 * abs(want) and abs(want) > 1, (name, got, want)


@PROGRAMS
def test_in_place_under_vmap(key, kernel_impl, program):
  """vmap over an in-place call: each example's g + A^T B (written fresh under vmap, as
  in-place only saves memory), with an unbatched B broadcast."""
  ka, kb, kg = jax.random.split(key, 3)
  a = normal(ka, (2, 128, 64), jnp.bfloat16)
  b = normal(kb, (128, 128), jnp.bfloat16)
  g = normal(kg, (2, 64, 128))
  step = lambda a, g: cj.gemm_epilogue(a, b, program, {"g": g}, trans_a=True,
                                       impl=kernel_impl, config=SCAN_CONFIG,
                                       in_place={"g_new": "g"})["g_new"]
  got = jax.jit(jax.vmap(step))(a, g)
  for i in range(2):
    assert rel_err(got[i], matmul_f32(a[i], b, True, False) + g[i]) < 1e-5, i


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


# 128-wide sub-tiles stored in 64-wide parts: a store that adds, part by part
PARTS_CONFIG = GemmConfig(tile_m=64, tile_n=128, tile_k=32, stages=2, epi_tile_n=128,
                          epi_store_n=64, wg_dim=MatDim.N, cluster_dim=None,
                          epi_operand_slots=1)


@pytest.mark.parametrize("config", [CONFIG, PARTS_CONFIG], ids=["whole", "parts"])
@pytest.mark.parametrize("in_place", [True, False], ids=["in_place", "fresh"])
def test_store_adds_to(key, kernel_impl, config, in_place):
  """``Store(add_to=g)`` beside other outputs: g + A B as a fresh output (g staged and
  added in registers) and in place (on the GPU the TMA store adds, g never read), with
  sub-tiles stored whole and in parts; a bf16 output and a row sum of the same tile are
  unaffected by the add (they see A B alone). g's own buffer keeps its values when
  the output is fresh."""
  ka, kg = jax.random.split(key)
  m, n = 128, 256
  a, b = gemm_inputs(ka, m, n, 128, jnp.bfloat16, trans_b=True)
  g = normal(kg, (m, n))
  g_before = np.asarray(g)
  program = [cj.Store("y", jnp.bfloat16), cj.RowSum("s"), cj.Store("g_new", jnp.float32,
                                                                   add_to="g")]
  out = jax.jit(lambda a, b, g: cj.gemm_epilogue(
      a, b, program, {"g": g}, trans_b=True, impl=kernel_impl, config=config,
      in_place={"g_new": "g"} if in_place else None))(a, b, g)
  prod = matmul_f32(a, b, False, True)
  assert rel_err(out["g_new"], prod + g) < 1e-5
  assert rel_err(out["y"], prod) < 1e-2
  assert rel_err(out["s"], jnp.sum(prod, axis=1)) < 1e-4
  np.testing.assert_array_equal(np.asarray(g), g_before)
  # the XLA program agrees: the add belongs to the output in both implementations
  xla = cj.gemm_epilogue(a, b, program, {"g": g}, trans_b=True, impl="xla")
  assert rel_err(xla["g_new"], prod + g) < 1e-5


def test_store_adds_to_refuses_what_it_cannot_add(key, interpret):
  """An output that adds is an fp32 tile of a passed fp32 tile operand of its shape, and
  the epilogue cannot read that operand (on the GPU it is never staged)."""
  a, b = gemm_inputs(key, 128, 256, 64, jnp.bfloat16)
  g = normal(key, (128, 256))
  with pytest.raises(ValueError, match="float32"):
    cj.Store("o", jnp.bfloat16, add_to="g")
  with pytest.raises(ValueError, match="float32 tile output"):
    pk.EpilogueOutput("o", pk.OutputKind.COL_PARTIAL, jnp.float32, adds_to="g")
  for inputs, why in (({}, "nothing"), ({"g": (pk.InputKind.TILE, g.astype(jnp.bfloat16))},
                                        "bfloat16"),
                      ({"g": (pk.InputKind.ROW, g[:, 0])}, "row")):
    with pytest.raises(ValueError, match=f"adds to 'g'.*{why}"):
      pk.gemm(a, b, inputs=inputs, epilogue=lambda t, acc: t.store("o", acc),
              outputs=(pk.EpilogueOutput("o", dtype=jnp.float32, adds_to="g"),),
              config=CONFIG, interpret=interpret)
  with pytest.raises(KeyError, match="only"):
    pk.gemm(a, b, inputs={"g": (pk.InputKind.TILE, g)},
            epilogue=lambda t, acc: t.store("o", acc + t.load("g")),
            outputs=(pk.EpilogueOutput("o", dtype=jnp.float32, adds_to="g"),),
            config=CONFIG, interpret=interpret)
