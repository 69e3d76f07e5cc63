"""pallas_kernels.kernel_cache: each compiled kernel lowered once per process, and read back
from its folder by a later one. Here (no GPU) kernels are lowered for CUDA as an H100 runs
them (``bench.lowering_time.pretend``) and exported, nothing runs. On an sm90 GPU the
last test runs the cached kernels against the same kernels lowered where they are traced,
bit for bit; every other GPU test runs its kernels through the cache too."""
import logging
import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench.lowering_time import pretend
from helpers import mosaic_launches
import coda_jax as cj
import pallas_kernels as pk
from pallas_kernels import kernel_cache as KC

A = jax.ShapeDtypeStruct((256, 128), jnp.bfloat16)
B = jax.ShapeDtypeStruct((128, 256), jnp.bfloat16)
STORE = [cj.Store("y", jnp.bfloat16)]
SCALED = [cj.ScaleConst(2.0), cj.Store("y", jnp.bfloat16)]


@pytest.fixture
def folder(tmp_path, monkeypatch):
  """A fresh cache folder and an empty process cache, both put back afterwards."""
  monkeypatch.setattr(KC, "_dir_override", [tmp_path])
  monkeypatch.setattr(KC, "_exported", {})
  return tmp_path


def gemm(program):
  return lambda a, b: cj.gemm_epilogue(a, b, program, impl="mosaic")["y"]


def export(fn, *args) -> tuple[str, dict]:
  """(the exported module's text, how the cache found its kernels)."""
  before = dict(KC.counts)
  with pretend():
    text = jax.export.export(jax.jit(fn), platforms=["cuda"])(*args).mlir_module()
  return text, {k: KC.counts[k] - before.get(k, 0) for k in ("lowered", "memory", "disk")}


def test_lowered_once_then_reused_then_read_back(folder, caplog):
  """The first use lowers the kernel (and logs it, with its arguments) and writes one
  file; more call sites of the same kernel in another program reuse it; a process that
  has not seen it (memory cleared) reads the file; another epilogue is another kernel."""
  with caplog.at_level(logging.INFO, logger="coda_jax"):
    text, found = export(gemm(STORE), A, B)
  assert found == {"lowered": 1, "memory": 0, "disk": 0}
  assert any("lowered kernel" in r.message and "bfloat16[256,128]" in r.message
             for r in caplog.records)
  assert text.count("mosaic_gpu_v2") == 1
  files = sorted(folder.glob(f"*{KC.SUFFIX}"))
  assert len(files) == 1

  twice = lambda a, b, c: (gemm(STORE)(a, b), gemm(STORE)(c, b))
  text, found = export(twice, A, B, A)
  assert found == {"lowered": 0, "memory": 2, "disk": 0}
  # the kernel is in the module once, and both sites call it
  assert text.count("mosaic_gpu_v2") == 1
  assert len(re.findall(r"call @call_exported_coda_kernel_", text)) == 2

  # the tests' launch count sees both sites, cached or lowered in place
  with pretend():
    assert mosaic_launches(twice, A, B, A, platforms=("cuda",)) == 2
    with KC.bypassed():
      assert mosaic_launches(twice, A, B, A, platforms=("cuda",)) == 2

  KC.clear_memory()
  _, found = export(gemm(STORE), A, B)
  assert found == {"lowered": 0, "memory": 0, "disk": 1}

  _, found = export(gemm(SCALED), A, B)
  assert found == {"lowered": 1, "memory": 0, "disk": 0}
  assert len(list(folder.glob(f"*{KC.SUFFIX}"))) == 2


def test_key_follows_the_kernel():
  """One kernel traced twice has one key; a changed epilogue, shape or config field (the
  pipeline depth, the schedule, the output slots) changes it. The key leaves the tuned
  configs' file out of its source digest because of this: the config a tuned entry
  chooses is in the traced program."""
  def key(program, a=A, **fields):
    import dataclasses
    cfg = dataclasses.replace(cj.kernel_config(a, B, program, {}), **fields)
    run = lambda a, b: tuple(cj.gemm_epilogue(a, b, program, impl="mosaic", config=cfg).values())
    with KC.bypassed(), pretend():
      return KC.kernel_key(jax.make_jaxpr(run)(a, B))
  base = key(STORE)
  assert key(STORE) == base
  assert key(SCALED) != base
  assert key(STORE, stages=cj.kernel_config(A, B, STORE, {}).stages - 1) != base
  assert key(STORE, a=jax.ShapeDtypeStruct((512, 128), jnp.bfloat16)) != base
  assert key(STORE, schedule=pk.Schedule.COOPERATIVE, stages=3) != key(STORE, stages=3)
  assert key(STORE, grid_tile_width=8) != base
  assert key(STORE, epi_out_slots=1) != base


def test_source_digest_of_the_key_reads_python_only(tmp_path):
  """``source_digest`` reads .py and .json files by default; the kernel key's digest of
  this package reads its Python only, so a retuned entry in tuned/*.json does not change
  every kernel's key (the entry's config is in the traced program:
  test_key_follows_the_kernel)."""
  pkg = tmp_path / "pkg"
  (pkg / "tuned").mkdir(parents=True)
  (pkg / "a.py").write_text("x = 1\n")
  (pkg / "tuned" / "c.json").write_text("{}")
  both, py = KC.source_digest(pkg), KC.source_digest(pkg, suffixes=(".py",))
  (pkg / "tuned" / "c.json").write_text('{"entries": {}}')
  assert KC.source_digest(pkg) != both
  assert KC.source_digest(pkg, suffixes=(".py",)) == py
  (pkg / "a.py").write_text("x = 2\n")
  assert KC.source_digest(pkg, suffixes=(".py",)) != py
  assert KC._package_digest() == KC.source_digest(KC._PACKAGE, suffixes=(".py",))


def test_damaged_file_is_lowered_again(folder, caplog):
  export(gemm(STORE), A, B)
  (path,) = folder.glob(f"*{KC.SUFFIX}")
  path.write_bytes(b"not a kernel")
  KC.clear_memory()
  with caplog.at_level(logging.WARNING, logger="coda_jax"):
    _, found = export(gemm(STORE), A, B)
  assert found["lowered"] == 1
  assert any("could not be read" in r.message for r in caplog.records)
  assert KC.read_exported(path, pytest.fail) is not None


def test_unwritable_folder_keeps_the_kernel_in_memory(tmp_path, monkeypatch, caplog):
  blocked = tmp_path / "file"
  blocked.write_text("")
  monkeypatch.setattr(KC, "_dir_override", [blocked / "kernels"])
  monkeypatch.setattr(KC, "_exported", {})
  with caplog.at_level(logging.WARNING, logger="coda_jax"):
    _, found = export(gemm(STORE), A, B)
    assert found["lowered"] == 1
    _, found = export(gemm(STORE), A, B)
  assert found["memory"] == 1
  assert any("could not write" in r.message for r in caplog.records)


def test_no_folder_keeps_the_kernel_in_memory(tmp_path, monkeypatch):
  monkeypatch.setattr(KC, "_exported", {})
  monkeypatch.setenv(KC.CACHE_ENV, "none")
  monkeypatch.setattr(KC, "_dir_override", [])
  assert KC.cache_dir() is None
  for want in ("lowered", "memory"):
    assert export(gemm(STORE), A, B)[1][want] == 1
  monkeypatch.setenv(KC.CACHE_ENV, str(tmp_path))
  assert KC.cache_dir() == tmp_path


def _entries(folder, sizes_and_ages):
  """Kernel-cache files of the given sizes, each the given seconds old."""
  paths = []
  for i, (size, age) in enumerate(sizes_and_ages):
    p = folder / f"kernel-{i:040x}{KC.SUFFIX}"
    p.write_bytes(b"k" * size)
    os.utime(p, (time.time() - age,) * 2)
    paths.append(p)
  return paths


def test_prune_deletes_the_least_recently_used(tmp_path):
  """Oldest first until the rest fit; the entry just written survives even when it is
  the oldest; files that are not this cache's entries neither count nor go."""
  old, mid, new, newest = _entries(tmp_path, [(400, 40), (300, 30), (200, 20), (100, 10)])
  other = tmp_path / f"train_step-{'0' * 32}{KC.SUFFIX}"  # a program cache's file
  other.write_bytes(b"p" * 5000)
  assert KC.prune(tmp_path, KC._KERNEL_FILE, None) == []
  assert KC.prune(tmp_path, KC._KERNEL_FILE, 1000) == []  # 1000 bytes: all fit
  assert KC.prune(tmp_path, KC._KERNEL_FILE, 500, keep=old) == [mid, new]
  assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
      p.name for p in (old, newest, other))
  assert KC.prune(tmp_path, KC._KERNEL_FILE, 0) == [old, newest]
  assert list(tmp_path.iterdir()) == [other]


def test_folder_held_to_its_bound(folder, monkeypatch):
  """After each write the folder is pruned to ``$CODA_JAX_KERNEL_CACHE_MAX_MB``; a read
  refreshes a kernel's time, so the kernel in use outlives an older unused one."""
  export(gemm(STORE), A, B)
  (stored,) = folder.glob(f"*{KC.SUFFIX}")
  unused = _entries(folder, [(stored.stat().st_size, 3600)])[0]
  os.utime(stored, (stored.stat().st_mtime - 7200,) * 2)  # older than the unused one
  KC.clear_memory()
  assert export(gemm(STORE), A, B)[1]["disk"] == 1  # the read marks it used
  one = stored.stat().st_size
  monkeypatch.setenv(KC.MAX_MB_ENV, str(2.5 * one / 1e6))  # room for two kernels
  export(gemm(SCALED), A, B)
  left = set(folder.glob(f"*{KC.SUFFIX}"))
  assert stored in left and unused not in left and len(left) == 2
  monkeypatch.setenv(KC.MAX_MB_ENV, "none")
  export(gemm([cj.ScaleConst(3.0), cj.Store("y", jnp.bfloat16)]), A, B)
  assert len(list(folder.glob(f"*{KC.SUFFIX}"))) == 3


@pytest.mark.parametrize("raw,want", [("", KC.DEFAULT_MAX_MB * 10**6), ("none", None),
                                      ("0", 0), ("2.5", 2_500_000), (" 64 ", 64 * 10**6)])
def test_bound_setting(monkeypatch, raw, want):
  monkeypatch.setenv(KC.MAX_MB_ENV, raw)
  assert KC.max_bytes(KC.MAX_MB_ENV, KC.DEFAULT_MAX_MB) == want


@pytest.mark.parametrize("raw", ["-1", "lots", "nan", "inf"])
def test_bad_bound_setting_names_the_fix(monkeypatch, raw):
  monkeypatch.setenv(KC.MAX_MB_ENV, raw)
  with pytest.raises(ValueError, match=f"{KC.MAX_MB_ENV}=.*megabytes.*'none'"):
    KC.max_bytes(KC.MAX_MB_ENV, KC.DEFAULT_MAX_MB)


def test_vmap_and_recording_lower_where_traced(folder):
  """Under vmap the batched kernel is lowered where it is traced, as it always was (an
  exported program has no batching rule; the unbatched one is still made when vmap
  traces it first); a workload recorded for the tuner is traced, never lowered."""
  a3 = jax.ShapeDtypeStruct((3, *A.shape), A.dtype)
  text, found = export(jax.vmap(gemm(STORE), in_axes=(0, None)), a3, B)
  assert "mosaic_gpu_v2" in text and "call_exported" not in text
  assert found == {"lowered": 1, "memory": 0, "disk": 0}
  before = dict(KC.counts)
  with pretend(), pk.autotune.recording() as problems:
    jax.eval_shape(gemm(SCALED), A, B)
  assert len(problems) == 1 and dict(KC.counts) == before
  assert len(list(folder.glob(f"*{KC.SUFFIX}"))) == 1  # vmap's, not the recorded one


def test_cached_kernels_equal_direct_ones(key, kernel_impl, folder):
  """On the GPU: a plain store, an epilogue with row and column partials, and an output
  written in place, each through the cache (lowered, then reused) and lowered where
  traced: the same bits."""
  if kernel_impl != "mosaic":
    pytest.skip("the cache holds compiled kernels only: this runs on an sm90 GPU")
  k1, k2, k3 = jax.random.split(key, 3)
  a = jax.random.normal(k1, (512, 256), jnp.bfloat16)
  b = jax.random.normal(k2, (256, 384), jnp.bfloat16)
  g = jax.random.normal(k3, (512, 384), jnp.float32)
  runs = {
      "store": lambda a, b, g: cj.gemm_epilogue(a, b, STORE, impl="mosaic"),
      "partials": lambda a, b, g: cj.gemm_epilogue(
          a, b, [cj.RowSum("s", square=True), cj.ColSum("c"), cj.Store("y", jnp.bfloat16)],
          impl="mosaic"),
      "in_place": lambda a, b, g: cj.gemm_epilogue(
          a, b, [cj.AddTile("g"), cj.Store("g_new", jnp.float32)], {"g": g}, impl="mosaic",
          in_place={"g_new": "g"}),
  }
  for name, run in runs.items():
    with KC.bypassed():
      want = jax.jit(run)(a, b, g)
    before = dict(KC.counts)
    got = [jax.jit(run)(a, b, g), jax.jit(lambda *x: run(*x))(a, b, g)]
    assert KC.counts["lowered"] - before.get("lowered", 0) == 1, name
    for out in got:
      for nm in want:
        np.testing.assert_array_equal(np.asarray(out[nm]), np.asarray(want[nm]), err_msg=name)


def test_a_miss_traces_once(folder):
  """The trace that gives the key is the one exported: ``fn`` runs once on a miss; a
  new function of the same kernel (as ``gemm`` makes at each call site) is traced for its
  key and finds the same copy."""
  calls = []

  def fn(x):
    calls.append(1)
    return (x * 2,)

  spec = [jax.ShapeDtypeStruct((8,), jnp.float32)]
  exp = KC.exported(fn, spec)
  assert len(calls) == 1 and KC.counts and exp.fun_name.startswith("coda_kernel_")
  assert KC.exported(lambda x: fn(x), spec) is exp and len(calls) == 2


def test_kernels_built_without_auto_barriers(monkeypatch):
  """``gemm`` builds its kernels without Pallas's auto barriers (a warpgroup barrier
  before and after each store to shared memory and before each TMA load; the kernels
  order their shared memory themselves, ``gemm_mgpu.AUTO_BARRIERS_ENV``): lowering a
  program with a tile operand and two stored outputs places fewer warpgroup barriers
  than with ``CODA_JAX_PALLAS_AUTO_BARRIERS=1``, and the two kernels have different keys,
  so the cache never hands one for the other. A value other than 0 or 1 is refused,
  naming the variable. (On the GPU, test_primitives' test_auto_barriers_change_no_bits
  runs both.)"""
  from jax.experimental.mosaic.gpu import utils as mosaic_utils
  from pallas_kernels import gemm_mgpu
  program = [cj.AddTile("res"), cj.Store("x", jnp.bfloat16), cj.ScaleConst(2.0),
             cj.Store("y", jnp.bfloat16)]
  res = jax.ShapeDtypeStruct((A.shape[0], B.shape[1]), jnp.bfloat16)
  run = lambda a, b, r: tuple(cj.gemm_epilogue(a, b, program, {"res": r},
                                               impl="mosaic").values())
  calls = [0]
  real = mosaic_utils.warpgroup_barrier

  def counted():
    calls[0] += 1
    return real()
  monkeypatch.setattr(mosaic_utils, "warpgroup_barrier", counted)
  barriers, keys = {}, {}
  for setting in ("0", "1"):
    monkeypatch.setenv(gemm_mgpu.AUTO_BARRIERS_ENV, setting)
    calls[0] = 0
    with KC.bypassed():
      export(run, A, B, res)
      with pretend():
        keys[setting] = KC.kernel_key(jax.make_jaxpr(run)(A, B, res))
    barriers[setting] = calls[0]
  assert 0 < barriers["0"] < barriers["1"], barriers
  assert keys["0"] != keys["1"]
  monkeypatch.delenv(gemm_mgpu.AUTO_BARRIERS_ENV)
  assert not gemm_mgpu.pallas_auto_barriers()
  monkeypatch.setenv(gemm_mgpu.AUTO_BARRIERS_ENV, "yes")
  with pytest.raises(ValueError, match="CODA_JAX_PALLAS_AUTO_BARRIERS='yes'"):
    gemm_mgpu.pallas_auto_barriers()
