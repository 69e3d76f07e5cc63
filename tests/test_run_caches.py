"""tests/conftest.py's folders for a run: the lowered kernels' and JAX's persistent
compilation cache, made by the process that starts the run, shared by its pytest-xdist
workers, and removed when the run ends; a caller's own folder is used and kept, and
CODA_JAX_TEST_XLA_CACHE=0 leaves XLA's cache off. Each case runs pytest anew on a copy
of the real conftest with a probe test beside it."""
import json
import os

from helpers import run_probe_under_conftest

# What each probe records, one JSON file per test: the process, the two folders as it
# sees them, the cache's minimum compile time, and whether a program compiled a second
# time came back from the cache.
PROBE = '''
import json, os, pathlib
import jax, jax.numpy as jnp
import pytest
from jax._src import monitoring

@pytest.mark.parametrize("i", range(4))
def test_probe(i):
  hits = []
  monitoring.register_event_listener(
      lambda event, **kw: hits.append(1) if event.endswith("/cache_hits") else None)
  f = lambda x: jnp.sin(x) * 3.0 + x
  jax.block_until_ready(jax.jit(f)(jnp.arange(4.0)))
  jax.clear_caches()  # the next call traces and compiles again: the cache may hand it back
  jax.block_until_ready(jax.jit(f)(jnp.arange(4.0)))
  record = dict(pid=os.getpid(), worker=os.environ.get("PYTEST_XDIST_WORKER"),
                xla=jax.config.jax_compilation_cache_dir,
                kernels=os.environ.get("CODA_JAX_KERNEL_CACHE"),
                min_s=jax.config.jax_persistent_cache_min_compile_time_secs,
                hit=bool(hits))
  out = pathlib.Path(os.environ["PROBE_OUT"]) / f"{i}.json"
  out.write_text(json.dumps(record))
'''


def _run(tmp_path, name, workers, **env_extra):
  """pytest on the probe in a folder of its own beside a copy of tests/conftest.py
  (and the modules it imports); returns the probes' records."""
  out = tmp_path / f"{name}_out"
  out.mkdir()
  env = {k: v for k, v in os.environ.items()
         if k not in ("CODA_JAX_KERNEL_CACHE", "JAX_COMPILATION_CACHE_DIR",
                      "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "CODA_JAX_TEST_XLA_CACHE")}
  env.update(PROBE_OUT=str(out), **env_extra)
  run = run_probe_under_conftest(tmp_path / name, PROBE, workers, env)
  assert run.returncode == 0, run.stdout + run.stderr
  records = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
  assert len(records) == 4, records
  return records


def test_the_run_shares_its_caches_and_removes_them(tmp_path):
  """Two workers: every test in either sees the same two folders, which the run made
  (not the caller's: none is set) and removes at its end; the cache takes every program
  (minimum compile time 0) and hands a program compiled again back from the folder."""
  records = _run(tmp_path, "shared", 2)
  assert len({r["worker"] for r in records}) == 2, records  # both workers ran probes
  for key in ("xla", "kernels"):
    folders = {r[key] for r in records}
    assert len(folders) == 1 and None not in folders, (key, records)
    assert not os.path.exists(folders.pop()), f"the run's {key} folder outlived it"
  assert {r["xla"] for r in records} != {r["kernels"] for r in records}
  assert all(r["min_s"] == 0 and r["hit"] for r in records), records


def test_a_callers_cache_is_used_and_kept(tmp_path):
  """A JAX_COMPILATION_CACHE_DIR of the caller's: used as it is, with jax's own minimum
  compile time, and still there (with its entries) after the run."""
  mine = tmp_path / "my_xla_cache"
  mine.mkdir()
  records = _run(tmp_path, "callers", 1, JAX_COMPILATION_CACHE_DIR=str(mine))
  assert {r["xla"] for r in records} == {str(mine)}, records
  assert all(r["min_s"] == 1.0 for r in records), records
  assert mine.is_dir()


def test_the_xla_cache_can_be_left_off(tmp_path):
  """CODA_JAX_TEST_XLA_CACHE=0: no XLA cache folder, no hits; the kernels' folder is
  still the run's own."""
  records = _run(tmp_path, "off", 1, CODA_JAX_TEST_XLA_CACHE="0")
  assert all(r["xla"] is None and not r["hit"] for r in records), records
  assert all(r["kernels"] for r in records), records
