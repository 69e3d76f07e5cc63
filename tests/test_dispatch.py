"""impl selection in coda_jax.gemm_epilogue: "xla", "auto" and the CODA_JAX_IMPL override;
row and contraction padding for shapes that do not tile."""
import dataclasses
import logging
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import coda_jax as cj
import pallas_kernels
from coda_jax import dispatch, epilogue_gemm
from helpers import TALL, assert_within_baseline, gemm_inputs, normal, rel_err

PROGRAM = [cj.ScaleRow("r"), cj.Store("y"), cj.RowSum("s", square=True)]


@pytest.fixture
def problem(key):
  a, b = gemm_inputs(key, 128, 256, 128, jnp.bfloat16)
  return a, b, {"r": normal(jax.random.fold_in(key, 1), (128,))}


@pytest.fixture
def kernel_calls(monkeypatch):
  """Records the ``interpret`` argument of every pallas_kernels.gemm call."""
  calls, real = [], pallas_kernels.gemm

  def spy(*args, **kw):
    calls.append(kw.get("interpret"))
    return real(*args, **kw)
  monkeypatch.setattr(pallas_kernels, "gemm", spy)
  monkeypatch.delenv("CODA_JAX_IMPL", raising=False)
  monkeypatch.setattr(dispatch, "_announced", set())  # see every fallback message again
  return calls


def assert_same(got, want):
  assert set(got) == set(want)
  for name in want:
    assert got[name].dtype == want[name].dtype, name
    np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]), err_msg=name)


@pytest.mark.parametrize("trans", [False, True])
def test_xla_is_the_reference(problem, kernel_calls, trans):
  a, b, ops_ = problem
  b = b.T if trans else b
  got = cj.gemm_epilogue(a, b, PROGRAM, ops_, trans_b=trans, impl="xla")
  assert_same(got, cj.reference(a, b, PROGRAM, ops_, trans_b=trans))
  assert got["y"].shape == (128, 256) and got["s"].shape == (128,)
  assert kernel_calls == []


def test_auto(problem, kernel_calls, kernel_impl, caplog):
  a, b, ops_ = problem
  with caplog.at_level(logging.WARNING, logger="coda_jax"):
    got = cj.gemm_epilogue(a, b, PROGRAM, ops_, impl="auto")
  if kernel_impl == "interpret":  # no sm90 GPU here: the XLA reference runs
    assert kernel_calls == []
    assert_same(got, cj.reference(a, b, PROGRAM, ops_))
    assert "no sm90 GPU" in caplog.text
  else:  # Hopper: the compiled kernel, bit-identical to asking for it
    assert kernel_calls == [None]
    assert_same(got, cj.gemm_epilogue(a, b, PROGRAM, ops_, impl="mosaic"))


def test_auto_falls_back_on_float32_and_untileable_shapes(key, kernel_calls):
  a, b = gemm_inputs(key, 128, 256, 128, jnp.float32)
  r = normal(jax.random.fold_in(key, 1), (128,))
  assert_same(cj.gemm_epilogue(a, b, PROGRAM, {"r": r}, impl="auto"),
              cj.reference(a, b, PROGRAM, {"r": r}))
  a, b = gemm_inputs(key, 128, 120, 128, jnp.bfloat16)  # N=120 does not tile (N is not padded)
  assert_same(cj.gemm_epilogue(a, b, PROGRAM, {"r": r}, impl="auto"),
              cj.reference(a, b, PROGRAM, {"r": r}))
  assert kernel_calls == []


def test_auto_pads_rows_that_do_not_tile(key, kernel_calls):
  """M=120: on an sm90 GPU "auto" runs the kernel on rows padded to 128 (elsewhere the
  XLA program, as for every shape)."""
  a, b = gemm_inputs(key, 120, 256, 128, jnp.bfloat16)
  r = normal(jax.random.fold_in(key, 1), (120,))
  got = cj.gemm_epilogue(a, b, PROGRAM, {"r": r}, impl="auto")
  assert got["y"].shape == (120, 256)
  assert kernel_calls == ([None] if epilogue_gemm.kernels_available() else [])
  want = cj.reference(a, b, PROGRAM, {"r": r})
  assert rel_err(got["y"], want["y"]) < 1e-2 and rel_err(got["s"], want["s"]) < 1e-4


def test_env_selects_xla(problem, kernel_calls, monkeypatch):
  a, b, ops_ = problem
  monkeypatch.setenv("CODA_JAX_IMPL", "xla")
  assert_same(cj.gemm_epilogue(a, b, PROGRAM, ops_), cj.reference(a, b, PROGRAM, ops_))
  assert kernel_calls == []


def test_env_selects_kernel(problem, kernel_calls, kernel_impl, monkeypatch):
  a, b, ops_ = problem
  monkeypatch.setenv("CODA_JAX_IMPL", kernel_impl)
  got = cj.gemm_epilogue(a, b, PROGRAM, ops_)  # impl="auto" is the default
  assert len(kernel_calls) == 1
  assert (kernel_calls[0] is None) == (kernel_impl == "mosaic")
  up = lambda x: x.astype(jnp.float32)
  truth = cj.reference(up(a), up(b), [cj.ScaleRow("r"), cj.Store("y", jnp.float32),
                                      cj.RowSum("s", square=True)], ops_)
  unfused = cj.reference(a, b, PROGRAM, ops_, round_to=a.dtype)
  assert_within_baseline(got["y"], truth["y"], unfused["y"], "y")
  assert rel_err(got["s"], truth["s"]) < 1e-5


def test_env_does_not_override_explicit_impl(problem, kernel_calls, monkeypatch):
  a, b, ops_ = problem
  monkeypatch.setenv("CODA_JAX_IMPL", "interpret")
  assert_same(cj.gemm_epilogue(a, b, PROGRAM, ops_, impl="xla"),
              cj.reference(a, b, PROGRAM, ops_))
  assert kernel_calls == []


def test_impl_sequence_is_tried_in_order(problem, kernel_calls):
  a, b, ops_ = problem
  # float32 operands: neither kernel implementation can run them, the XLA one can.
  a32, b32 = a.astype(jnp.float32), b.astype(jnp.float32)
  assert_same(cj.gemm_epilogue(a32, b32, PROGRAM, ops_, impl=("mosaic", "interpret", "xla")),
              cj.reference(a32, b32, PROGRAM, ops_))
  assert kernel_calls == []


def test_no_implementation_lists_every_reason(problem, kernel_calls):
  a, b, ops_ = problem
  a32, b32 = a.astype(jnp.float32), b.astype(jnp.float32)
  with pytest.raises(ValueError) as e:
    cj.gemm_epilogue(a32, b32, PROGRAM, ops_, impl=("mosaic", "interpret"))
  assert "mosaic:" in str(e.value) and "interpret: float32" in str(e.value)


@pytest.mark.parametrize("bad", ["cuda", ("xla", "triton"), ()])
def test_bad_impl_names(problem, bad):
  a, b, ops_ = problem
  with pytest.raises(ValueError, match="impl="):
    cj.gemm_epilogue(a, b, PROGRAM, ops_, impl=bad)


def test_target_device_is_a_local_device():
  assert dispatch.target_device() in jax.local_devices()


# ---- token counts that do not tile: rows padded with zeros, sliced off ---------------------
PAD_PROGRAM = [cj.ScaleRow("r"), cj.AddTile("res"), cj.RowSum("ss", square=True),
               cj.ColSum("cs"), cj.Store("y")]


@pytest.mark.parametrize("m", [1, 63, 65, 300, 200, 328])
def test_rows_that_do_not_tile_are_padded(key, kernel_calls, kernel_impl, m):
  """M = 1, 63, 65, 300: the kernel runs on zero-padded rows (poisoned operands would
  show: the padding is fresh zeros). M = 200, 328 (multiples of 8, not of the tile): on
  the GPU nothing is padded, TMA clips the last row of tiles (``clip_m``); the
  interpreter pads them. Every output, column sums included, equals the reference on
  the real rows within the tolerance rule."""
  a, b = gemm_inputs(key, m, 256, 128, jnp.bfloat16)
  ks = jax.random.split(key, 2)
  ops_ = {"r": normal(ks[0], (m,)), "res": normal(ks[1], (m, 256), jnp.bfloat16)}
  got = cj.gemm_epilogue(a, b, PAD_PROGRAM, ops_, impl=kernel_impl)
  assert len(kernel_calls) == 1
  up = lambda x: x.astype(jnp.float32)
  truth = cj.reference(up(a), up(b), [*PAD_PROGRAM[:-1], cj.Store("y", jnp.float32)], ops_)
  unfused = cj.reference(a, b, PAD_PROGRAM, ops_, round_to=jnp.bfloat16)
  assert got["y"].shape == (m, 256) and got["ss"].shape == (m,) and got["cs"].shape == (256,)
  assert_within_baseline(got["y"], truth["y"], unfused["y"], "y")
  for name in ("ss", "cs"):
    assert rel_err(got[name], truth[name]) < 1e-4, name


def test_clipped_rows_where_the_compiled_kernel_can():
  """Which M the compiled kernel clips instead of padding: multiples of 8 whose program
  keeps zero rows; never in the interpreter; never M = 65 (not a 16-byte TMA stride);
  never under a step that moves zero rows when column sums are taken."""
  def shape(m, program, compiled):
    a, b = jnp.zeros((m, 128), jnp.bfloat16), jnp.zeros((128, 256), jnp.bfloat16)
    ops_ = {"r": jnp.zeros((m,)), "res": jnp.zeros((m, 256), jnp.bfloat16)}
    call = dispatch.Call(program=tuple(program), inputs=tuple(
        (nm, kind) for nm, kind in epilogue_gemm._declared(tuple(program), m, 256)[0].items()),
        outputs=epilogue_gemm._declared(tuple(program), m, 256)[1], column_group=1)
    return dispatch.padded_shape(call, a, b, {k: v for k, v in ops_.items()
                                              if k in dict(call.inputs)}, compiled=compiled)
  assert shape(200, PAD_PROGRAM, True) == (200, 128, True)
  assert shape(200, PAD_PROGRAM, False) == (256, 128, False)
  assert shape(65, PAD_PROGRAM, True) == (128, 128, False)
  assert shape(256, PAD_PROGRAM, True).m == 256
  with pytest.raises(ValueError, match="does not tile, even with M and K padded"):
    shape(200, [_AddOne(), cj.ColSum("cs"), cj.Store("y")], True)
  assert shape(200, [_AddOne(), cj.Store("y")], True) == (200, 128, True)  # no column sums


class _Stop(Exception):
  pass


def test_explicit_config_clips_m_where_it_may(monkeypatch):
  """A caller's config (``gemm_epilogue(config=)``: the tuner's, or a benchmark's) runs
  at the operands' M, clipped by TMA where its tile does not divide M and the program
  keeps zero rows, as the cache's configs do: a 192-row config at M = 512. Checked on
  what the compiled path hands ``pallas_kernels.gemm`` (stopped there)."""
  seen = []

  def spy(*args, **kw):
    seen.append(kw["clip_m"])
    raise _Stop
  monkeypatch.setattr(pallas_kernels, "gemm", spy)
  monkeypatch.setattr(dispatch, "target_device", lambda: types.SimpleNamespace(
      core_count=132, device_kind="NVIDIA H100 80GB HBM3"))

  def clip_m(m, program):
    a, b = jnp.zeros((m, 128), jnp.bfloat16), jnp.zeros((128, 256), jnp.bfloat16)
    inputs, outputs, group = epilogue_gemm._declared(tuple(program), m, 256)
    call = dispatch.Call(program=tuple(program), inputs=tuple(inputs.items()),
                         outputs=outputs, column_group=group, config=TALL["tall"])
    with pytest.raises(_Stop):
      dispatch._kernel_run(call, a, b, {})
    return seen.pop()
  assert clip_m(512, [cj.ColSum("cs"), cj.Store("y")])
  assert not clip_m(384, [cj.ColSum("cs"), cj.Store("y")])  # 192 divides it
  assert not clip_m(512, [_AddOne(), cj.ColSum("cs"), cj.Store("y")])  # zero rows move
  assert clip_m(512, [_AddOne(), cj.Store("y")])  # ... into no column sum


def test_explicit_tall_config_at_m_it_does_not_divide(key):
  """The same on the GPU: a 192-row config at M = 512, every output against fp32."""
  if not dispatch.kernels_available():
    pytest.skip("the compiled kernel needs an sm90 GPU: the interpreter clamps "
                "out-of-range slices instead of clipping")
  a, b = gemm_inputs(key, 512, 256, 128, jnp.bfloat16)
  program = [cj.ColSum("cs"), cj.RowSum("ss", square=True), cj.Store("y")]
  got = cj.gemm_epilogue(a, b, program, impl="mosaic", config=TALL["tall"])
  up = lambda x: x.astype(jnp.float32)
  truth = cj.reference(up(a), up(b), [*program[:-1], cj.Store("y", jnp.float32)], {})
  unfused = cj.reference(a, b, program, {}, round_to=jnp.bfloat16)
  assert_within_baseline(got["y"], truth["y"], unfused["y"], "y")
  for name in ("cs", "ss"):
    assert rel_err(got[name], truth[name]) < 1e-4, name


def test_clip_m_is_checked():
  """``clip_m``: M a multiple of 8 (TMA strides), and the compiled kernel only."""
  cfg = pallas_kernels.default_config(200, 256, 128, clip_m=True)
  assert cfg.cluster_tile[0] > 200 or 200 % cfg.cluster_tile[0]  # the fastest, unclipped
  with pytest.raises(ValueError, match="multiple of 8"):
    pallas_kernels.default_config(196, 256, 128, clip_m=True)
  a, b = jnp.zeros((200, 128), jnp.bfloat16), jnp.zeros((128, 256), jnp.bfloat16)
  with pytest.raises(ValueError, match="clip_m=True needs the compiled kernel"):
    pallas_kernels.gemm(a, b, clip_m=True, interpret=pallas_kernels.interpret_params())
  with pytest.raises(ValueError, match="M need not be with clip_m"):
    pallas_kernels.gemm(a, b, config=cfg, interpret=pallas_kernels.interpret_params())


def test_contraction_that_does_not_tile_is_padded(key, kernel_calls, kernel_impl):
  """A weight gradient over 300 rows (x^T dz: the rows are the contraction): K padded."""
  x, dz = gemm_inputs(key, 128, 256, 300, jnp.bfloat16, trans_a=True)
  got = cj.gemm_epilogue(x, dz, [cj.Store("dw", jnp.float32)], trans_a=True, impl=kernel_impl)
  want = cj.reference(x.astype(jnp.float32), dz.astype(jnp.float32),
                      [cj.Store("dw", jnp.float32)], {}, trans_a=True)
  assert len(kernel_calls) == 1 and got["dw"].shape == (128, 256)
  assert rel_err(got["dw"], want["dw"]) < 1e-5


@dataclasses.dataclass(frozen=True)
class _AddOne(cj.Primitive):
  """x + 1: a zero row does not stay zero."""

  def apply(self, x, env):
    return x + 1.0


def test_rows_are_not_padded_under_a_step_that_moves_zero(key, kernel_calls):
  """A column sum after x + 1 would count the padded rows: the kernel refuses the shape
  (auto falls back to XLA), never pads it."""
  a, b = gemm_inputs(key, 65, 256, 128, jnp.bfloat16)
  program = [_AddOne(), cj.ColSum("cs"), cj.Store("y")]
  call = dispatch.Call(program=tuple(program), inputs=(),
                       outputs=epilogue_gemm._declared(tuple(program), 65, 256)[1], column_group=1)
  with pytest.raises(ValueError, match="does not tile, even with M and K padded"):
    dispatch.padded_shape(call, a, b, {})
  got = cj.gemm_epilogue(a, b, program, impl="auto")
  assert got["cs"].shape == (256,) and kernel_calls == []


def _grouped_programs(key, m):
  """Programs whose steps work per column group, with operands: (name, a, b, program,
  operands, trans_a). Each has two to four column blocks, and between them every kind of
  operand and output the per-block XLA run splits or joins."""
  from coda_jax import grad_primitives as G
  from coda_jax import qk_norm as Q
  ks = iter(jax.random.split(key, 16))
  nk = lambda shape, dtype=jnp.float32: normal(next(ks), shape, dtype)
  a, b = gemm_inputs(next(ks), m, 128, 64, jnp.bfloat16)
  pos = jax.random.randint(next(ks), (m,), 0, 4096, jnp.int32)
  freqs = jnp.tile(1.0 / 1e4 ** (jnp.arange(16) / 16), 8)
  t = jax.random.randint(next(ks), (m,), -2, 130, jnp.int32)  # some outside [0, N)
  w, sel = Q.head_norm_columns(1 + 0.1 * nk((32,)), 1 + 0.1 * nk((32,)), 2, 1)
  ab, bb = gemm_inputs(next(ks), 128, 128, m, jnp.bfloat16, trans_a=True)
  return [
      ("gated, log-sum-exp", a, b,
       [cj.ScaleRow("r"), cj.Gated(16), cj.RowLogSumExp("lse"), cj.Store("y")],
       {"r": 1 + 0.1 * nk((m,))}, False),
      ("rotate, picked column, column sums", a, b,
       [cj.AddTile("x0"), cj.PickColumn("t", "pick"), cj.Rotate("pos", "fr", 16),
        cj.ColSum("cs"), cj.Store("q")],
       {"x0": nk((m, 128), jnp.bfloat16), "t": t, "pos": pos, "fr": freqs}, False),
      ("gated backward (wide z, y)", a, b,
       [G.GatedGrad("z", 16, "y", "zdz"), cj.Store("dz")],
       {"z": nk((m, 256), jnp.bfloat16)}, False),
      ("QK-norm forward", a, b, Q.forward_program(32, 1e-6, jnp.bfloat16),
       {"r": 1 + 0.1 * nk((m,)), "pos": pos, "freqs": freqs, "qk_w": w, "qk_sel": sel}, False),
      ("QK-norm backward", a, b, Q.backward_program(32, 1e-6, jnp.bfloat16, row_scaled=True),
       {"dqkv": nk((m, 128), jnp.bfloat16), "pos": pos, "neg_freqs": -freqs,
        "u": nk((m, 128), jnp.bfloat16), "qk_w": w, "qk_sel": sel,
        "r": 1 + 0.1 * nk((m,))}, False),
      ("B's column sums, gated", ab, bb, [cj.BColumnSum("db"), cj.Gated(32), cj.Store("y")],
       {}, True),
  ]


@pytest.mark.parametrize("case", range(6))
def test_xla_runs_column_groups_per_block(key, monkeypatch, case):
  """impl="xla" runs a program with column groups once per block of columns under
  ``jax.vmap`` (``dispatch.column_block``), as the kernel runs it per sub-tile: every
  output equals the same program run on the whole matrix at once, within fp32 rounding
  (sums in another order), at rows that tile no kernel."""
  name, a, b, program, ops_, trans_a = _grouped_programs(key, 40)[case]
  n = b.shape[1]
  assert dispatch.column_block(program, n) < n, name  # the blocked path runs
  got = cj.gemm_epilogue(a, b, program, ops_, trans_a=trans_a, impl="xla")
  monkeypatch.setattr(dispatch, "column_block", lambda program, n: n)
  want = cj.gemm_epilogue(a, b, program, ops_, trans_a=trans_a, impl="xla")
  assert set(got) == set(want), name
  for nm in want:
    assert got[nm].shape == want[nm].shape and got[nm].dtype == want[nm].dtype, (name, nm)
    g, w = np.asarray(got[nm], np.float32), np.asarray(want[nm], np.float32)
    if want[nm].dtype == jnp.bfloat16:  # one rounding apart at most
      np.testing.assert_allclose(g, w, rtol=2 ** -7, atol=1e-6, err_msg=f"{name}: {nm}")
    else:
      np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-4 * np.abs(w).max(),
                                 err_msg=f"{name}: {nm}")


def test_xla_program_size_does_not_grow_with_heads(key):
  """The per-block XLA run traces each step once, however many heads the matrix has:
  the QK-norm backward's jaxpr is as long at 16 heads as at 4 (on the whole matrix, a
  step sliced out every head and concatenated them again)."""
  from coda_jax import qk_norm as Q
  program = Q.backward_program(32, 1e-6, jnp.bfloat16)
  outputs = tuple(o for p in program for o in p.outputs(1))

  def size(heads):
    n = 32 * heads
    w, sel = Q.head_norm_columns(jnp.ones((32,)), jnp.ones((32,)), heads // 2, heads // 4)
    ops_ = {"dqkv": jnp.zeros((8, n), jnp.bfloat16), "u": jnp.zeros((8, n), jnp.bfloat16),
            "pos": jnp.zeros((8,), jnp.int32), "neg_freqs": jnp.zeros((n,)), "qk_w": w,
            "qk_sel": sel}
    jaxpr = jax.make_jaxpr(lambda x, o: dispatch.apply_program(x, program, o, outputs))(
        jnp.zeros((8, n)), ops_)
    return len(jaxpr.eqns)
  assert size(16) == size(4)


def test_implementation_context_nests_and_restores(monkeypatch):
  monkeypatch.delenv("CODA_JAX_IMPL", raising=False)
  assert dispatch.current() == dispatch.AUTO
  with cj.implementation("xla"):
    assert dispatch.resolve("auto") == ("xla",)
    with cj.implementation(("interpret", "xla")):
      assert dispatch.current() == ("interpret", "xla")
    assert dispatch.current() == ("xla",)
    assert dispatch.resolve("mosaic") == ("mosaic",)  # a named choice is not overridden
  assert dispatch.current() == dispatch.AUTO


def test_implementation_context_over_the_environment(monkeypatch):
  monkeypatch.setenv("CODA_JAX_IMPL", "interpret")
  assert dispatch.current() == ("interpret",)
  with cj.implementation("auto"):
    assert dispatch.current() == dispatch.AUTO


@pytest.mark.parametrize("bad", ["cuda", (), ("xla", "triton")])
def test_implementation_refuses_unknown_names(bad):
  with pytest.raises(ValueError, match="implementation="):
    cj.implementation(bad)


def test_jit_traces_again_under_another_implementation(monkeypatch):
  monkeypatch.delenv("CODA_JAX_IMPL", raising=False)
  seen = []

  @jax.jit
  def f(x):
    seen.append(dispatch.current())
    return x * 2
  f(1.0)
  with cj.implementation("xla"):
    f(1.0)
    f(1.0)  # same choice: the cached trace
  f(1.0)
  assert seen == [dispatch.AUTO, ("xla",)]


def test_implementation_context_runs_its_choice(problem, kernel_calls):
  """Under "interpret" the kernel runs through the interpreter; left to "auto", a CPU host
  would run XLA and never reach the kernel."""
  a, b, ops = problem
  with cj.implementation("interpret"):
    got = cj.gemm_epilogue(a, b, PROGRAM, ops)
  assert kernel_calls and all(c is not None for c in kernel_calls)
  want = cj.gemm_epilogue(a, b, PROGRAM, ops, impl="interpret")
  assert_same(got, want)
