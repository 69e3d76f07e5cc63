"""Lowered programs kept on disk across processes: ``cached_jit``.

Why: a fused program's Mosaic GPU kernels are lowered by Python every time the program is
lowered: most of the fused training step's compile time
(``docs/tuning.md#compile-time-and-caches``). JAX's persistent compilation cache is keyed
by the lowered module, so it is consulted only after that lowering, and spares none of it.
``cached_jit`` exports the lowered program once (``jax.export``) into ``cache_dir``. A later
process traces the function (a second or two), finds the program by the trace's
fingerprint, and compiles it without lowering a kernel; with JAX's persistent compilation
cache on, the XLA compile comes from there too. (Each kernel is also lowered only once per
process and kept on disk by ``pallas_kernels.kernel_cache``, which works for every
program, multi-device ones included; this cache spares a later process the rest: tracing
the kernels and putting the program together.)

The fingerprint covers everything the lowering reads:
  - the traced program itself, walked equation by equation, nested programs and
    parameters too (``pallas_kernels.kernel_cache.Fingerprint``; a compiled kernel appears
    as a call of its exported copy, named by its body's own fingerprint); jax's printed
    form elides nested kernel bodies, so it is not used;
  - the bytes of its constants;
  - the arguments' shapes, dtypes and shardings, and which arguments are donated;
  - jax's and jaxlib's versions, a few jax settings that lowering reads, the backend and its
    devices' kinds;
  - the source of coda_jax and pallas_kernels and the shipped tuning cache.
A change to the model, its config, the shapes, a kernel config or the library therefore
gives another program, never a stale one.

Not every program can be exported: one with host callbacks (the Mosaic GPU interpreter's
barriers), or a multi-device one with ``coda_jax.partitioning``'s custom partitioning. Those
run as plain ``jax.jit``, and the reason is logged once (``CachedJit.source`` says it too).
A cache entry that cannot be read is logged, exported again and replaced.

The cache holds one file per program (the 1B training step: about 4-7 MB). After each
write the folder is held to ``$CODA_JAX_PROGRAM_CACHE_MAX_MB`` (default 4096; ``none``: no
bound) by deleting the programs least recently used (``kernel_cache.prune``; a load
refreshes a file's time). Only this cache's files count, so it may share a folder with
the kernel cache.
"""
from __future__ import annotations

import functools
import os
import re
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import jaxlib
import numpy as np

from coda_jax.dispatch import announce
from pallas_kernels import kernel_cache

FORMAT = "coda-jax-program-1"  # bump when what a cache file holds, or the key, changes
SUFFIX = ".jaxexport"
MAX_MB_ENV = "CODA_JAX_PROGRAM_CACHE_MAX_MB"
DEFAULT_MAX_MB = 4096
# "<function name>-<32 hex digits of the key>.jaxexport" (kernel files have 40)
_PROGRAM_FILE = re.compile(r".+-[0-9a-f]{32}" + re.escape(SUFFIX))
_LIBRARY = tuple(Path(__file__).resolve().parents[1] / p for p in ("coda_jax", "pallas_kernels"))
_LOWERING_SETTINGS = ("jax_enable_x64", "jax_default_matmul_precision",
                      "jax_use_shardy_partitioner")
# Custom calls that jax.export refuses (their format may change between jax releases) but
# that describe compiled code completely: cuDNN's attention (jax 0.11.2's names; Mosaic GPU's
# kernels, "mosaic_gpu_v2", jax.export accepts already). A kept program is only loaded by
# the jax and jaxlib that wrote it (both are in the key), so their format cannot change
# under it. Every other custom call jax.export does not vouch for stays refused: host
# callbacks and custom partitioning name live Python objects of the process that lowered
# them.
KERNEL_TARGETS = tuple("__cudnn$" + n for n in (
    "fmhaSoftmax", "fmhaSoftmaxBackward", "fmhaSoftmaxDropout", "fmhaSoftmaxDropoutBackward",
    "fmhaScaleBiasSoftmax", "fmhaScaleBiasSoftmaxBackward", "fmhaScaleBiasSoftmaxDropout",
    "fmhaScaleBiasSoftmaxDropoutBackward", "fmhaSoftmaxF8", "fmhaSoftmaxBackwardF8",
    "fusion"))


@functools.cache
def library_digest() -> str:
  """sha256 of coda_jax's and pallas_kernels' Python sources and the shipped tuning cache,
  read once per process (the code a process lowers is the code it imported)."""
  return kernel_cache.source_digest(*_LIBRARY)


def _signature(args) -> tuple:
  """(pytree structure, (aval, sharding) per leaf): what picks a program for ``args``. It
  is computed on every call, so it holds objects, not formatted strings."""
  leaves, tree = jax.tree.flatten(args)
  return tree, tuple((jax.typeof(x), getattr(x, "sharding", None)) for x in leaves)


def program_key(traced: "jax.stages.Traced", args: tuple, donate_argnums: tuple[int, ...],
                signature: tuple | None = None) -> str:
  """The cache key of one traced call: see the module docstring for what it covers.
  ``signature``: ``_signature(args)``, where the caller has it already."""
  fp = kernel_cache.Fingerprint()
  fp.add(FORMAT, jax.__version__, jaxlib.__version__, jax.default_backend())
  for d in jax.devices():
    fp.add(d.platform, d.device_kind, str(getattr(d, "compute_capability", "")))
  for s in _LOWERING_SETTINGS:
    fp.add(s, repr(getattr(jax.config, s, None)))
  fp.add("library", library_digest())
  fp.add("donate", repr(tuple(donate_argnums)))
  tree, leaves = signature or _signature(args)
  fp.add("args", repr(tree), *(f"{aval}|{sharding!r}" for aval, sharding in leaves))
  fp.add("out", repr(jax.tree.structure(traced.out_info)))
  fp.jaxpr(traced.jaxpr.jaxpr, traced.jaxpr.consts)
  return fp.hexdigest()


def _flat_export(fun: Callable, args: tuple,
                 platforms: Sequence[str] | None = None) -> "jax.export.Exported":
  """``fun`` exported as a function of the flat argument leaves (nnx states and other
  custom pytrees need no serialization rules then: the structure is recomputed by every
  process's own trace)."""
  leaves, in_tree = jax.tree.flatten(args)

  def flat(*xs):
    return jax.tree.leaves(fun(*jax.tree.unflatten(in_tree, xs)))

  specs = [jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=getattr(x, "sharding", None))
           for x in leaves]
  allowed = [jax.export.DisabledSafetyCheck.custom_call(t) for t in KERNEL_TARGETS]
  return jax.export.export(jax.jit(flat), platforms=platforms,
                          disabled_checks=allowed)(*specs)


def _read(path: Path) -> "jax.export.Exported | None":
  """The exported program at ``path``, or None when there is none or it cannot be read
  (a damaged file: logged). Its argument types are the key's; ``Exported.call`` checks
  them again."""
  return kernel_cache.read_exported(path, lambda msg: announce(f"program cache: {msg}"))


class CachedJit:
  """``jax.jit(fun, donate_argnums=...)`` whose lowered programs are kept in ``cache_dir``.

  Call it, or ``lower`` it, as the jitted function. One program is made per argument
  signature (pytree structure, shapes, dtypes, shardings) and kept in memory; the first
  call with a signature traces ``fun``, then loads the program from the cache or exports
  and stores it."""

  def __init__(self, fun: Callable, cache_dir: str | os.PathLike, *,
               donate_argnums: int | Sequence[int] = ()):
    self.fun = fun
    self.cache_dir = Path(cache_dir)
    self.donate_argnums = ((donate_argnums,) if isinstance(donate_argnums, int)
                           else tuple(donate_argnums))
    self._jit = jax.jit(fun, donate_argnums=self.donate_argnums)
    self._programs: dict[Any, tuple[Callable, str]] = {}

  def _program(self, args) -> tuple[Callable, str]:
    sig = _signature(args)
    if sig not in self._programs:
      self._programs[sig] = self._make(args, sig)
    return self._programs[sig]

  def _make(self, args, sig) -> tuple[Callable, str]:
    traced = self._jit.trace(*args)  # errors in fun surface here, as with jax.jit
    key = program_key(traced, args, self.donate_argnums, sig)
    name = getattr(self.fun, "__name__", "fun").strip("<>") or "fun"
    path = self.cache_dir / f"{name}-{key[:32]}{SUFFIX}"
    exp, source = _read(path), f"loaded from {path}"
    if exp is None:
      try:
        exp = _flat_export(self.fun, args)
        data = exp.serialize()
      except Exception as e:  # noqa: BLE001 (whatever export refuses runs as plain jit)
        reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        announce(f"program cache: {name} runs as plain jax.jit, not kept: {reason}")
        return self._jit, f"jit ({reason})"
      try:
        gone = kernel_cache.write_bounded(path, bytes(data), _PROGRAM_FILE, MAX_MB_ENV,
                                          DEFAULT_MAX_MB)
        source = f"exported to {path}"
      except OSError as e:  # a read-only or full disk must not stop the program itself
        announce(f"program cache: could not write {path} ({e}); {name} runs without "
                 "being kept")
        source = f"exported, not kept ({type(e).__name__})"
      else:
        if gone:
          announce(f"program cache: deleted the {len(gone)} least recently used programs "
                   f"of {self.cache_dir} to stay within ${MAX_MB_ENV}")
    out_tree = jax.tree.structure(traced.out_info)

    def run(*a):
      return jax.tree.unflatten(out_tree, exp.call(*jax.tree.leaves(a)))

    run.__name__ = name
    return jax.jit(run, donate_argnums=self.donate_argnums), source

  def __call__(self, *args):
    return self._program(args)[0](*args)

  def lower(self, *args) -> "jax.stages.Lowered":
    """As ``jax.jit(...).lower``: the program for these arguments, lowered."""
    return self._program(args)[0].lower(*args)

  def source(self, *args) -> str:
    """Where the program for these arguments came from: "loaded from PATH", "exported to
    PATH", "exported, not kept (ERROR)" when the folder could not be written, or
    "jit (REASON)" when the program could not be exported."""
    return self._program(args)[1]


def cached_jit(fun: Callable, cache_dir: str | os.PathLike | None, *,
               donate_argnums: int | Sequence[int] = ()):
  """``jax.jit(fun, donate_argnums=donate_argnums)``, its lowered programs kept in
  ``cache_dir`` across processes (``CachedJit``); plain ``jax.jit`` when ``cache_dir`` is
  None.

  Args:
    fun: the function to jit (positional arguments only).
    cache_dir: the folder of exported programs, created on first use; None for no cache.
    donate_argnums: as ``jax.jit``'s.

  Returns:
    A callable with ``lower``, as ``jax.jit`` returns."""
  if cache_dir is None:
    return jax.jit(fun, donate_argnums=donate_argnums)
  return CachedJit(fun, cache_dir, donate_argnums=donate_argnums)
