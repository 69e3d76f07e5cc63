"""Shared fixtures: backend selection (compiled Mosaic GPU kernel on Hopper, the Mosaic GPU
interpreter elsewhere), the interpreter's race detector, per-test random keys,
jax.checkpoint over interpreted kernels, interpreter-state cleanup, the long
subprocess checks started at a process's first test (tests/background_checks.py), one
GPU per pytest-xdist worker on a host with several (tests/worker_gpus.py), and each
test's time written as it ends where CODA_JAX_TEST_TIMES names a file
(tests/run_times.py)."""
import os
import sys
import types

# XLA's CPU client deadlocks the Mosaic GPU interpreter on small (2-core) machines
# unless NPROC is large. This must happen before jax is imported.
os.environ.setdefault("NPROC", "32")
# Folders this process made for the run (pytest_unconfigure removes them). The
# pytest-xdist workers inherit the controller's environment, so one run's processes
# share each folder, and only the process that made it removes it.
_RUN_FOLDERS: list[str] = []


def _run_folder(env: str, prefix: str) -> None:
  if env not in os.environ:
    import tempfile
    os.environ[env] = tempfile.mkdtemp(prefix=prefix)
    _RUN_FOLDERS.append(os.environ[env])


# Kernels lowered for the GPU are kept in a folder of this run's own (not the user's
# ~/.cache/coda_jax/kernels), unless the caller names one.
_run_folder("CODA_JAX_KERNEL_CACHE", "coda_jax_kernels-")
# XLA's compiled programs too: JAX's persistent compilation cache, every program however
# quick its compile. Tests build their models and functions afresh, so jax traces new
# jitted functions whose programs an earlier test, or another worker, compiled already;
# the cache hands those back. On 2 CPU cores test_gpt2.py and test_rope_scaling.py ran
# in 104 s against 131; CI's whole suite, where the interpreter's callbacks take most of
# the time, used 62 CPU minutes against 66 in the same 33. A hit needs the same XLA
# module, options and versions: it is the program itself. Two processes compiling one
# program at once may meet a half-written entry: jax then warns and compiles it. A
# JAX_COMPILATION_CACHE_DIR of the caller's is used as it is (and kept);
# CODA_JAX_TEST_XLA_CACHE=0 leaves the cache off.
if (os.environ.get("CODA_JAX_TEST_XLA_CACHE", "1") != "0"
    and "JAX_COMPILATION_CACHE_DIR" not in os.environ):
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  _run_folder("JAX_COMPILATION_CACHE_DIR", "coda_jax_xla-")

import zlib  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import worker_gpus  # noqa: E402  (tests/, this file's folder)

# On a host with several GPUs each pytest-xdist worker sees one of them
# (tests/worker_gpus.py). This must happen before jax starts its backends.
_PINNED_GPU = worker_gpus.pin_this_worker()

import jax  # noqa: E402
import pytest  # noqa: E402

import background_checks  # noqa: E402  (tests/, this file's folder)
import pallas_kernels  # noqa: E402
import run_times  # noqa: E402  (tests/, this file's folder)

_TIMES = run_times.recorder()

_IMPLS = ("mosaic", "interpret")


def _on_hopper() -> bool:
  dev = jax.devices()[0]
  return dev.platform == "gpu" and str(getattr(dev, "compute_capability", "")).startswith("9")


def _kernel_impl() -> str:
  forced = os.environ.get("CODA_JAX_TEST_IMPL")
  if forced:
    if forced not in _IMPLS:
      raise pytest.UsageError(f"CODA_JAX_TEST_IMPL={forced!r}: one of {_IMPLS}")
    return forced
  return "mosaic" if _on_hopper() else "interpret"


def pytest_sessionstart(session):
  """A worker given one GPU must see it: else its kernels would quietly run through the
  interpreter on the CPU."""
  if _PINNED_GPU is not None and jax.devices()[0].platform != "gpu":
    raise pytest.UsageError(
        f"pytest-xdist worker {os.environ.get('PYTEST_XDIST_WORKER')} was given GPU "
        f"{_PINNED_GPU} (CUDA_VISIBLE_DEVICES) but jax sees {jax.devices()[0].platform} "
        "(is jax's CUDA plugin installed? scripts/setup.sh installs it where it finds a "
        f"GPU): {worker_gpus.SPREAD_ENV}=0 leaves every worker all the GPUs")


def pytest_runtest_logreport(report):
  """Each test's time, written as it ends (``tests/run_times.py``), where
  CODA_JAX_TEST_TIMES names a file: a run cut short keeps the times of what finished."""
  if _TIMES is not None:
    _TIMES.add(report)


def pytest_unconfigure(config):
  """Removes the folders this process made for the run (``_RUN_FOLDERS``): in a
  pytest-xdist run the controller's, after every worker has finished."""
  import shutil
  for folder in _RUN_FOLDERS:
    shutil.rmtree(folder, ignore_errors=True)


def pytest_report_header(config):
  dev = jax.devices()[0]
  impl = _kernel_impl()
  how = ("compiled Mosaic GPU kernel" if impl == "mosaic"
         else "Mosaic GPU interpreter on CPU (slow; small shapes)")
  return [f"coda_jax kernels: impl={impl!r} ({how}); jax {jax.__version__}, "
          f"device {dev.platform}:{getattr(dev, 'device_kind', '?')}"
          + (" [forced by CODA_JAX_TEST_IMPL]" if os.environ.get("CODA_JAX_TEST_IMPL") else "")]


@pytest.fixture(scope="session")
def kernel_impl() -> str:
  """``impl`` for ``coda_jax.gemm_epilogue``: "mosaic" on sm90, else "interpret"."""
  return _kernel_impl()


@pytest.fixture(scope="session")
def interpret(kernel_impl):
  """``interpret`` for ``pallas_kernels.gemm``: None (compiled) or interpreter params."""
  return None if kernel_impl == "mosaic" else pallas_kernels.interpret_params()


class RaceDetector:
  """The interpreter with its happens-before race detector switched on."""

  def __init__(self):
    import jax.experimental.pallas.mosaic_gpu as plgpu
    self.params = plgpu.InterpretGPUParams(detect_races=True)

  def races_found(self) -> bool:
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    return gpu_callbacks.get_races().races_found


def _detect_races(monkeypatch) -> RaceDetector:
  """Switches the interpreter's race detector on for this test (skips where this jax
  has none)."""
  try:
    det = RaceDetector()
  except (ImportError, TypeError) as e:
    pytest.skip(f"this jax's Mosaic GPU interpreter has no race detector: {e}")
  monkeypatch.setattr(pallas_kernels, "interpret_params", lambda: det.params)
  return det


@pytest.fixture
def race_detector(kernel_impl, monkeypatch):
  """Interpreter-only: ``.params`` for ``pallas_kernels.gemm(interpret=...)``; also makes
  ``coda_jax.gemm_epilogue(impl="interpret")`` detect races. ``.races_found()`` reports
  on the last kernel run."""
  if kernel_impl != "interpret":
    pytest.skip("race detection needs the Mosaic GPU interpreter (on a GPU, use "
                "compute-sanitizer --tool racecheck instead)")
  return _detect_races(monkeypatch)


@pytest.fixture
def races_checked(kernel_impl, monkeypatch):
  """For tests that run on both backends: the interpreter with the race detector on
  (``.races_found()`` reports on the last kernel run), or the compiled kernel on a GPU,
  where ``.races_found()`` is False and only the values are checked."""
  if kernel_impl != "interpret":
    return types.SimpleNamespace(races_found=lambda: False)
  return _detect_races(monkeypatch)


@pytest.fixture(scope="session", autouse=True)
def _long_checks_started_early(request, tmp_path_factory):
  """On a GPU host, starts at this process's first test the subprocess checks that some
  selected test reads (``tests/background_checks.py``: ``sharded_check.py``'s runs,
  minutes each), so that they run beside the rest of the suite instead of holding its
  end. Where the kernels are interpreted (a CPU machine) the first test that reads one
  runs it, as before: there the interpreter's warpgroup threads wait on each other, and
  a fourth busy process on 2 cores left them idle longer. CI's suite ran 39m07s with the
  checks started early against 34m49s without, the same CPU time (66 minutes) in both."""
  if _kernel_impl() != "mosaic":
    return
  needed = sorted({f for item in request.session.items
                   for f in getattr(item, "fixturenames", ())
                   if f in background_checks.SHARDED_CHECKS})
  folder = background_checks.shared_folder(request.config, tmp_path_factory)
  for fixture in needed:
    background_checks.start(folder, *background_checks.sharded_check(fixture),
                            watch_pid=background_checks.run_owner_pid(request.config))


@pytest.fixture
def key(request):
  """A PRNG key unique to this test (and parametrisation), stable across runs."""
  return jax.random.key(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(autouse=True)
def _reset_interpreter_state():
  yield
  # An exception inside an interpreted kernel leaves the interpreter's global state
  # (barriers, thread bookkeeping) dirty, which would hang or poison later tests.
  try:
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import (
        reset_gpu_interpret_mode_state)
  except ImportError:
    return
  reset_gpu_interpret_mode_state()


@pytest.fixture
def remat_kernels(kernel_impl, monkeypatch):
  """Lets the kernel path run under jax.checkpoint. Compiled kernels need nothing. The
  interpreter orders its kernels with ordered io_callbacks, and jax 0.11.2 refuses AD of
  checkpoint over any effect outside ``effects.remat_allowed_effects`` ("Effects not
  supported in AD of `checkpoint`/`remat`: [OrderedIOEffect]") before it looks at the
  policy: every policy, prevent_cse=False and jax.remat fail alike. Re-running an
  interpreted kernel in the backward is harmless, so for the test the interpreter's
  effect is registered as remat-safe (private jax API, restored afterwards)."""
  if kernel_impl != "interpret":
    return
  try:
    from jax._src import callback, effects
    types = effects.remat_allowed_effects._effect_types
    io_effect = callback.OrderedIOEffect
  except (ImportError, AttributeError) as e:
    pytest.skip(f"cannot register the interpreter's OrderedIOEffect as remat-safe in this "
                f"jax ({e}); jax.checkpoint rejects it: 'Effects not supported in AD of "
                "`checkpoint`/`remat`'")
  monkeypatch.setattr(effects.remat_allowed_effects, "_effect_types", {*types, io_effect})
