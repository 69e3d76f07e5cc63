"""Error measures, input generators and program counts shared by the tests."""
import re

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import GemmConfig, MatDim, Schedule

# A kernel launched through ``pallas_kernels.kernel_cache`` is a call of its exported
# copy; the copy's body, one Mosaic GPU custom call, is in the module once however many
# sites call it.
_CACHED_CALL = re.compile(r"call @(call_exported_coda_kernel_\w+)")


def mosaic_launches(fn, *args, platforms=None) -> int:
  """How many Mosaic GPU kernel launches ``jax.jit(fn)`` lowers to, whether the kernels
  come through the kernel cache (calls of an exported copy) or are lowered in place
  (custom calls in the module), so the count does not change with ``CODA_JAX_KERNEL_CACHE``.

  Args:
    fn: the function; args: its arguments (arrays or ``jax.ShapeDtypeStruct``).
    platforms: lower for these (e.g. ``("cuda",)`` on a CPU); default the device's.

  Returns:
    The number of call sites of cached kernels plus the custom calls outside their copies.
  """
  text = jax.jit(fn).trace(*args).lower(lowering_platforms=platforms).as_text()
  cached = _CACHED_CALL.findall(text)
  return len(cached) + text.count("@mosaic_gpu") - len(set(cached))


def fenced_in_forward_scan(jaxpr) -> int:
  """Outputs of optimization barriers (``coda_jax.residuals.fenced``) in the body of the
  first ``scan`` of ``jaxpr``: the forward loop of ``jax.grad`` over a layer scan, where
  the residuals that are also read elsewhere must be fenced."""
  forward = next(e for e in jaxpr.eqns if e.primitive.name == "scan").params["jaxpr"].jaxpr
  return sum(len(e.outvars) for e in forward.eqns
             if e.primitive.name == "optimization_barrier")


# Added to every "2x the unfused baseline" bound, so that a baseline that happens to be
# exact (error 0) doesn't demand bit-exactness from a differently ordered accumulation.
EPS = 1e-6


def f64(x) -> np.ndarray:
  return np.asarray(jnp.asarray(x).astype(jnp.float32), dtype=np.float64)


def rel_err(x, ref) -> float:
  """Relative Frobenius error ||x - ref|| / ||ref||, in float64."""
  x, ref = f64(x), f64(ref)
  assert x.shape == ref.shape, (x.shape, ref.shape)
  return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def worst_row_err(x, ref) -> float:
  """Largest per-row relative error: one bad row (or an unwritten sub-tile) stands out
  here even when the whole-matrix error is diluted."""
  x, ref = f64(x), f64(ref)
  assert x.shape == ref.shape, (x.shape, ref.shape)
  if ref.ndim <= 1:  # a scalar or vector (a norm weight's gradient, a per-row statistic): relative
    # error per element is ill-posed near zero, so measure the worst element against
    # the largest one.
    return float(np.max(np.abs(x - ref)) / np.max(np.abs(ref)))
  x, ref = x.reshape(ref.shape[0], -1), ref.reshape(ref.shape[0], -1)
  norm = np.linalg.norm(ref, axis=1)
  # An all-zero reference row (e.g. the gradient of an ignored target) must come out
  # exactly zero: its error is measured absolutely.
  return float(np.max(np.linalg.norm(x - ref, axis=1) / np.where(norm == 0, 1, norm)))


def assert_within_baseline(got, truth, baseline, what=""):
  """The tolerance rule: our error vs the fp32 truth is at most twice the error of an
  unfused XLA computation of the same thing (plus EPS), overall and in every row."""
  got_np = f64(got)
  assert np.all(np.isfinite(got_np)), f"{what}: non-finite values (unwritten output?)"
  e, e_base = rel_err(got, truth), rel_err(baseline, truth)
  assert e <= 2 * e_base + EPS, f"{what}: rel err {e:.3g} > 2 x unfused {e_base:.3g}"
  r, r_base = worst_row_err(got, truth), worst_row_err(baseline, truth)
  assert r <= 2 * r_base + EPS, f"{what}: worst-row err {r:.3g} > 2 x unfused {r_base:.3g}"


def normal(key, shape, dtype=jnp.float32):
  return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def gemm_inputs(key, m, n, k, dtype, trans_a=False, trans_b=False):
  ka, kb = jax.random.split(key)
  a = normal(ka, (k, m) if trans_a else (m, k), dtype)
  b = normal(kb, (n, k) if trans_b else (k, n), dtype)
  return a, b


def matmul_f32(a, b, trans_a=False, trans_b=False):
  """The fp32 truth of the product of (possibly stored-transposed) low-precision inputs."""
  a = a.astype(jnp.float32)
  b = b.astype(jnp.float32)
  return jnp.matmul(a.T if trans_a else a, b.T if trans_b else b,
                    preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST)


def rope_freqs(n, p, theta=10000.0, zero_blocks=()):
  """(N,) per-column angular frequencies for rotate-half heads of width 2p: column j of a
  head and column j + p share theta**(-2j / 2p). Heads listed in zero_blocks get 0."""
  inv = theta ** (-2.0 * np.arange(p) / (2 * p))
  heads = [np.zeros(2 * p) if h in zero_blocks else np.concatenate([inv, inv])
           for h in range(n // (2 * p))]
  return jnp.asarray(np.concatenate(heads), jnp.float32)


def spread_rows(key, shape, dtype=jnp.float32, lo=5.0, hi=50.0):
  """Normal values whose per-row standard deviation spreads log-uniformly over [lo, hi]
  (a residual stream at realistic scale): RMSNorm's r = 1/rms is then far from 1, so a
  backward that drops or mis-scales the gradient through r shows."""
  kx, ks = jax.random.split(key)
  std = jnp.exp(jax.random.uniform(ks, shape[:-1] + (1,), jnp.float32, np.log(lo), np.log(hi)))
  return (jax.random.normal(kx, shape, jnp.float32) * std).astype(dtype)


def f32_tree(tree):
  """Every floating leaf of ``tree`` upcast to fp32 (integer leaves as they are): the
  inputs of the fp32 truth."""
  return jax.tree.map(lambda a: a.astype(jnp.float32)
                      if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def unit_rows(a):
  """Each row scaled to unit RMS."""
  return a / jnp.sqrt(jnp.mean(a * a, axis=-1, keepdims=True))


def residual_cotangent(key, out, x, eps=1e-5):
  """A fixed cotangent of a residual-stream output ``out`` of input ``x`` (both fp32
  truth): (noise plus the update out - x, unit RMS per row) times each row's
  r = 1/rms(out). The factor r keeps the residual pass-through from swamping the norm
  paths (which carry a factor r); the update term makes the gradient through r weigh as
  much as the projected gradient."""
  r = jax.lax.rsqrt(jnp.mean(out * out, axis=-1, keepdims=True) + eps)
  return (normal(key, out.shape) + unit_rows(out - x)) * r


def _xp(a):
  return np if isinstance(a, np.ndarray) else jnp


# Gated activations written here, independently of coda_jax (GELU in its tanh form), for
# numpy (float64 oracles) or jnp (autodiff) arrays alike.
GATED_ACTS = {
    "silu": lambda a: a / (1 + _xp(a).exp(-a)),
    "gelu": lambda a: 0.5 * a * (1 + _xp(a).tanh((2 / np.pi) ** 0.5  # a Python float:
                                                 * (a + 0.044715 * a * a * a))),  # keeps bf16
}


def gated_pairs(z, p, activation="silu"):
  """act(a) * b over the column pairs of 2p-wide blocks (a: the first p columns of each
  block, b the next p): (M, 2N) -> (M, N), in z's array type and dtype."""
  z4 = z.reshape(z.shape[0], -1, 2, p)
  return (GATED_ACTS[activation](z4[:, :, 0]) * z4[:, :, 1]).reshape(z.shape[0], -1)


# Ours: fused kernels in bf16; truth: the reference in fp32 (highest precision); the
# baseline: the reference in bf16, whose error sets the tolerance.
MODEL_RUNS = (("ours", True, jnp.bfloat16), ("truth", False, jnp.float32),
              ("base", False, jnp.bfloat16))


def check_model_loss_and_grads(make_model, toks, tgt, n_grads):
  """A model's ``loss(toks, tgt)`` and every parameter gradient: ours
  (``make_model(True, bf16)``) against the truth (``make_model(False, fp32)``) within
  twice the baseline's (``make_model(False, bf16)``) error, per token
  (``reduction="none"``: a mean of many losses can land close by cancellation) and per
  gradient leaf; the mean equals the mean of the per-token losses. Returns the
  gradients' key paths."""
  from flax import nnx
  runs, per_token = {}, {}
  for name, fused, dt in MODEL_RUNS:
    m = make_model(fused, dt)
    with jax.default_matmul_precision("highest"):
      runs[name] = nnx.value_and_grad(lambda m: m.loss(toks, tgt))(m)
      per_token[name] = m.loss(toks, tgt, reduction="none")
  assert per_token["ours"].shape == tgt.shape
  assert np.all(np.asarray(per_token["ours"])[np.asarray(tgt) == -100] == 0)
  assert_within_baseline(per_token["ours"], per_token["truth"], per_token["base"],
                         "per-token loss")
  counted = np.asarray(tgt) != -100
  # The two losses come from programs compiled apart (the mean's under value_and_grad,
  # the per-token one without), whose bf16 activations XLA may round apart: 1.1e-5 for
  # the Qwen3 model's "xla" path on an H200. A token
  # counted wrongly moves the mean by ~1/(tokens counted), 1/125 in test_flax_layers.
  for name, rtol in (("ours", 1e-4), ("truth", 1e-5)):
    mean = np.asarray(per_token[name], np.float64)[counted].mean()
    np.testing.assert_allclose(float(runs[name][0]), mean, rtol=rtol, err_msg=name)
  paths = [jax.tree_util.keystr(p) for p, _ in
           jax.tree_util.tree_flatten_with_path(runs["truth"][1])[0]]
  grads = [jax.tree.leaves(runs[n][1]) for n in ("ours", "truth", "base")]
  assert len(paths) == len(grads[0]) == len(grads[2]) == n_grads, paths
  for p, g, t, b in zip(paths, *grads):
    assert g.shape == t.shape, p
    assert_within_baseline(g, t, b, f"grad {p}")
  return paths


def projected(fn, cts):
  """loss(diff, rest) = <fn({**rest, **diff}) leaves, cts>: a scalar whose gradient
  w.r.t. ``diff`` runs every output's backward path."""
  def loss(diff, rest):
    outs = jax.tree.leaves(fn({**rest, **diff}))
    return sum(jnp.sum(o.astype(jnp.float32) * c) for o, c in zip(outs, cts))
  return loss


def record_head_stores(monkeypatch) -> list:
  """Wraps ``fused_ops.lm_head_unit_grads`` (which the fused op and the post-block call)
  so that every call appends the ``store`` it received to the returned list: which LM
  head's gradient the forward formed."""
  from coda_jax import fused_ops
  stores, unit_grads = [], fused_ops.lm_head_unit_grads

  def recording(*args, store="logits", **kwargs):
    stores.append(store)
    return unit_grads(*args, store=store, **kwargs)

  monkeypatch.setattr(fused_ops, "lm_head_unit_grads", recording)
  return stores


# Ping-pong with 192-row warpgroup tiles: three 64-row wgmma blocks and three rows of
# epilogue sub-tiles per tile (the tuner's tall structures).
TALL = {"tall": GemmConfig(tile_m=192, tile_n=64, tile_k=64, stages=3, epi_tile_n=32,
                           cluster_dim=None, schedule=Schedule.PINGPONG),
        "tall_cluster_n": GemmConfig(tile_m=192, tile_n=64, tile_k=64, stages=4,
                                     epi_tile_n=32, cluster_dim=MatDim.N,
                                     schedule=Schedule.PINGPONG)}


def _copy_conftest(run_dir) -> None:
  """Copies tests/conftest.py into ``run_dir`` with the modules of tests/ that it imports
  (read from its ``import`` lines), so that a pytest run there loads the real conftest."""
  import ast
  import shutil
  from pathlib import Path
  tests = Path(__file__).resolve().parent
  conftest = tests / "conftest.py"
  body = ast.parse(conftest.read_text()).body
  names = {alias.name for node in body if isinstance(node, ast.Import)
           for alias in node.names}
  names |= {node.module for node in body if isinstance(node, ast.ImportFrom) and node.module}
  for f in [conftest, *(tests / f"{n}.py" for n in sorted(names))]:
    if f.is_file():
      shutil.copy(f, Path(run_dir) / f.name)


def run_probe_under_conftest(run_dir, probe, workers, env, args=(), times_file=None):
  """A probe test file run by a pytest of its own beside a copy of the real
  tests/conftest.py (and the modules of tests/ it imports), on the CPU, every worker
  on it (``CODA_JAX_TEST_SPREAD_GPUS=0``), the repository importable.

  Args:
    run_dir: a folder (``pathlib.Path``) that does not exist yet: made for the run.
    probe: the text of ``test_probe.py``.
    workers: pytest-xdist workers; 1 runs without pytest-xdist.
    env: the environment to start from (e.g. ``os.environ`` with the caller's changes).
    args: more pytest arguments.
    times_file: as ``run_pytest``'s.

  Returns:
    ``run_pytest``'s ``subprocess.CompletedProcess``.
  """
  from pathlib import Path
  run_dir.mkdir()
  _copy_conftest(run_dir)
  (run_dir / "test_probe.py").write_text(probe)
  env = dict(env, JAX_PLATFORMS="cpu", CODA_JAX_TEST_SPREAD_GPUS="0",
             PYTHONPATH=str(Path(__file__).resolve().parent.parent))
  xdist = ["-n", str(workers)] if workers > 1 else ["-p", "no:xdist"]
  return run_pytest([*xdist, *args, "test_probe.py"], run_dir, env, times_file=times_file)


def run_pytest(args, cwd, env, times_file=None):
  """A pytest run of its own, as a user would start it: ``env`` minus every
  ``PYTEST_*`` variable (a worker's pytest-xdist id and pytest's own among them, so the
  run starts afresh) and the caller's ``CODA_JAX_TEST_TIMES`` (the nested run's tests
  are not the caller's), with pytest's cache and pytest-benchmark off.

  Args:
    args: pytest's arguments (files, ``-n``, ...).
    cwd: the folder to run in.
    env: the environment.
    times_file: where the nested run writes its tests' times (``tests/run_times.py``);
      None: nowhere.

  Returns:
    The ``subprocess.CompletedProcess``, output captured as text.
  """
  import subprocess
  import sys
  import run_times
  env = {k: v for k, v in env.items()
         if not k.startswith("PYTEST_") and k != run_times.TIMES_ENV}
  if times_file is not None:
    env[run_times.TIMES_ENV] = str(times_file)
  cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
         "no:benchmark", *args]
  return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                        timeout=300)
