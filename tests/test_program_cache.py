"""coda_jax.program_cache: a jitted function's lowered program kept on disk. A program
loaded from the cache computes what jax.jit computes, bit for bit; the key changes with
everything the lowering reads (kernel bodies and configs, constants, shapes, donation);
a damaged entry is replaced; what jax.export refuses runs as plain jit and says so."""
import dataclasses
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np

from bench.lowering_time import pretend
from coda_jax import epilogue_gemm as E, primitives as P, program_cache as PC


def f(params, x):
  """A pytree in, a pytree out, a constant and a literal inside."""
  table = jnp.asarray(np.linspace(-1.0, 1.0, x.shape[-1], dtype=np.float32))
  h = jnp.tanh(x @ params["w"] + table) * 1.5
  return {"y": h.astype(jnp.bfloat16), "stats": (h.sum(), jnp.abs(h).max(axis=0))}


def args(key, n=16):
  k1, k2 = jax.random.split(key)
  return ({"w": jax.random.normal(k1, (n, n), jnp.float32)},
          jax.random.normal(k2, (8, n), jnp.float32))


def same(a, b):
  return all(bool(jnp.array_equal(u, v)) for u, v in
             zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def exports_forbidden(monkeypatch):
  def refuse(*a, **k):
    raise AssertionError("exported again: the cached program was not used")
  monkeypatch.setattr(PC, "_flat_export", refuse)


def test_loaded_program_equals_jit(tmp_path, key, monkeypatch):
  """First use exports; a new CachedJit (as in a new process, JAX's caches cleared)
  loads the same file without exporting, and both give jax.jit's outputs bit for bit,
  on the first arguments and on fresh ones."""
  a = args(key)
  first = PC.cached_jit(f, tmp_path)
  out = first(*a)
  assert first.source(*a).startswith("exported to ")
  assert same(out, jax.jit(f)(*a))
  files = list(tmp_path.glob(f"*{PC.SUFFIX}"))
  assert len(files) == 1 and files[0].name.startswith("f-")

  jax.clear_caches()
  exports_forbidden(monkeypatch)
  second = PC.cached_jit(f, tmp_path)
  b = args(jax.random.fold_in(key, 1))
  assert same(second(*b), jax.jit(f)(*b))
  assert second.source(*b) == f"loaded from {files[0]}"
  lowered = second.lower(*a).compile()  # the AOT path, as bench.train uses it
  assert same(lowered(*a), out)


def test_donation_survives_the_cache(tmp_path, key):
  """The donated argument's buffer is consumed and aliased to the output, as with
  jax.jit: the compiled program aliases as many bytes as the plain one."""
  g = lambda s, x: (jax.tree.map(lambda v: v * 0.5 + x.sum(), s), x.mean())
  s, x = args(key)
  plain = jax.jit(g, donate_argnums=0).lower(s, x).compile().memory_analysis()
  cached = PC.cached_jit(g, tmp_path, donate_argnums=0)
  mem = cached.lower(s, x).compile().memory_analysis()
  if plain is not None and mem is not None:
    assert mem.alias_size_in_bytes == plain.alias_size_in_bytes > 0
  want = g(s, x)
  got = cached(s, x)
  assert s["w"].is_deleted()
  assert same(got, want)


def key_of(fun, *a, donate=()):
  return PC.program_key(jax.jit(fun, donate_argnums=donate).trace(*a), a, donate)


def test_key_follows_what_lowering_reads(key):
  """The same program gives the same key; a changed constant, literal, shape, dtype,
  donation, output structure or default matmul precision gives another."""
  a = args(key)
  base = key_of(f, *a)
  assert key_of(f, *a) == base
  c1 = np.float32(1.0)
  assert key_of(lambda p, x: f(p, x * 1.0), *a) != key_of(lambda p, x: f(p, x * 2.0), *a)
  big = lambda v: (lambda p, x: f(p, x + jnp.asarray(np.full(x.shape, v, np.float32))))
  assert key_of(big(c1), *a) != key_of(big(c1 + 1), *a)  # a constant's bytes, not its shape
  assert key_of(big(c1), *a) == key_of(big(c1), *a)
  assert key_of(f, *args(key, n=32)) != base
  assert key_of(f, a[0], a[1].astype(jnp.bfloat16)) != base
  assert key_of(f, *a, donate=(0,)) != base
  assert key_of(lambda p, x: [f(p, x)], *a) != base
  with jax.default_matmul_precision("highest"):  # read at lowering, not in the trace
    assert key_of(f, *a) != base


def test_key_sees_inside_kernels():
  """Two GEMM kernels that differ only in their pipeline depth, and two that differ
  only in their epilogue program, get different keys (traced as for an H100, where the
  kernel bodies are nested several levels deep in the step's program)."""
  a = jax.ShapeDtypeStruct((256, 128), jnp.bfloat16)
  b = jax.ShapeDtypeStruct((128, 256), jnp.bfloat16)
  keys = {}
  with pretend():
    for name, prog in (("store", [P.Store("y", jnp.bfloat16)]),
                       ("scaled", [P.ScaleConst(2.0), P.Store("y", jnp.bfloat16)])):
      base = E.kernel_config(a, b, prog, {})
      for stages in (base.stages, base.stages - 1):
        cfg = dataclasses.replace(base, stages=stages)
        run = lambda a, b, prog=prog, cfg=cfg: E.gemm_epilogue(a, b, prog, impl="mosaic",
                                                               config=cfg)
        keys[name, stages == base.stages] = (key_of(run, a, b), key_of(run, a, b))
  assert all(k1 == k2 for k1, k2 in keys.values())  # the same kernel: the same key
  assert len({k for k, _ in keys.values()}) == 4


def test_kernels_are_exportable():
  """A Mosaic GPU kernel, lowered for CUDA as an H100 runs it, passes jax.export's
  custom-call check and serializes (cuDNN's attention, the other kernel a step holds,
  lowers only on a GPU: the GPU run of test_train_step_from_the_cache covers it)."""
  a = jax.ShapeDtypeStruct((256, 128), jnp.bfloat16)
  b = jax.ShapeDtypeStruct((128, 256), jnp.bfloat16)
  run = lambda a, b: E.gemm_epilogue(a, b, [P.Store("y", jnp.bfloat16)], impl="mosaic")
  with pretend() as traced:
    exp = PC._flat_export(run, (a, b), platforms=["cuda"])
  assert traced and "mosaic_gpu_v2" in exp.mlir_module()
  assert jax.export.deserialize(exp.serialize()).in_avals == exp.in_avals


def test_damaged_entry_is_exported_again(tmp_path, key, caplog):
  a = args(key)
  PC.cached_jit(f, tmp_path)(*a)
  (path,) = tmp_path.glob(f"*{PC.SUFFIX}")
  path.write_bytes(b"not a program")
  jax.clear_caches()
  again = PC.cached_jit(f, tmp_path)
  with caplog.at_level(logging.WARNING, logger="coda_jax"):
    assert same(again(*a), jax.jit(f)(*a))
  assert again.source(*a) == f"exported to {path}"
  assert any("could not be read" in r.message for r in caplog.records)
  assert PC._read(path) is not None


def test_folder_held_to_its_bound(tmp_path, key, monkeypatch):
  """After a write the folder is pruned to ``$CODA_JAX_PROGRAM_CACHE_MAX_MB``, oldest
  program first; the kernel cache's files in the same folder are not this cache's to
  delete."""
  kernel = tmp_path / f"kernel-{'0' * 40}{PC.SUFFIX}"
  kernel.write_bytes(b"k" * 10**6)
  os.utime(kernel, (0, 0))
  first = PC.cached_jit(f, tmp_path)
  first(*args(key))
  (old,) = tmp_path.glob(f"f-*{PC.SUFFIX}")
  os.utime(old, (1, 1))
  monkeypatch.setenv(PC.MAX_MB_ENV, str(1.5 * old.stat().st_size / 1e6))  # one program
  wider = args(key, n=24)  # another signature: another program
  first(*wider)
  left = set(tmp_path.glob(f"*{PC.SUFFIX}"))
  assert old not in left and kernel in left and len(left) == 2
  assert first.source(*wider).startswith("exported to ")


def test_unwritable_cache_still_runs(tmp_path, key, caplog):
  """A cache folder that cannot be made (here a file stands at its path) is logged; the
  program runs all the same."""
  blocked = tmp_path / "file"
  blocked.write_text("")
  a = args(key)
  cached = PC.cached_jit(f, blocked / "programs")
  with caplog.at_level(logging.WARNING, logger="coda_jax"):
    assert same(cached(*a), jax.jit(f)(*a))
  assert cached.source(*a).startswith("exported, not kept")
  assert any("could not write" in r.message for r in caplog.records)


def test_unexportable_program_runs_as_jit(tmp_path, key, caplog):
  """A host callback cannot be exported: the function runs as plain jax.jit, nothing is
  written, and the reason is logged and kept in ``source``."""
  def with_callback(p, x):
    y = jax.pure_callback(lambda v: np.asarray(v) * 2, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
    return f(p, y)

  a = args(key)
  cached = PC.cached_jit(with_callback, tmp_path)
  with caplog.at_level(logging.WARNING, logger="coda_jax"):
    assert same(cached(*a), jax.jit(with_callback)(*a))
  assert cached.source(*a).startswith("jit (")
  assert not list(tmp_path.glob(f"*{PC.SUFFIX}"))
  assert any("runs as plain jax.jit" in r.message for r in caplog.records)


def test_no_cache_dir_is_plain_jit():
  fn = PC.cached_jit(f, None)
  assert not isinstance(fn, PC.CachedJit) and hasattr(fn, "lower")


def test_train_step_from_the_cache(tmp_path):
  """The fused tiny Llama's train and eval steps through the program cache: two steps
  equal plain jit's bit for bit (losses and every state leaf), and a second
  make_train_step loads the program instead of lowering it."""
  from flax import nnx
  from flax_layers import Llama, get_config, train

  cfg = get_config("tiny")
  toks = jax.random.randint(jax.random.key(3), (2, 64), 0, cfg.vocab_size, jnp.int32)
  tgt = jnp.roll(toks, -1, axis=1)

  def run(cache):
    model = Llama(cfg, rngs=nnx.Rngs(0), fused=True)
    graphdef, state = train.init_state(model, train.make_optimizer(1e-3, total_steps=4))
    step = train.make_train_step(graphdef, program_cache=cache)
    losses = []
    for _ in range(2):
      state, loss = step(state, toks, tgt)
      losses.append(loss)
    ev = train.make_eval_step(graphdef, program_cache=cache)(state, toks, tgt)
    return losses, state, ev, step

  want_losses, want_state, want_eval, _ = run(None)
  losses, state, ev, step = run(tmp_path)
  assert same(losses, want_losses) and same(ev, want_eval)
  assert same(jax.tree.leaves(state), jax.tree.leaves(want_state))
  names = sorted(p.name.split("-")[0] for p in tmp_path.glob(f"*{PC.SUFFIX}"))
  assert names == ["eval_step", "train_step"]
  model = Llama(cfg, rngs=nnx.Rngs(0), fused=True)
  graphdef, fresh = train.init_state(model, train.make_optimizer(1e-3, total_steps=4))
  again = train.make_train_step(graphdef, program_cache=tmp_path)
  assert again.source(fresh, toks, tgt).startswith("loaded from ")
