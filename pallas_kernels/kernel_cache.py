"""Each compiled kernel lowered once: kept per process, and on disk across processes.

Why: Mosaic GPU lowers a kernel in Python (layout inference, then its dialect's lowering),
seconds for one of ``gemm``'s kernels, every time a program holding it is lowered. A
training step calls the same kernel at several sites (each layer's forward and its
recomputation, the train and the evaluation step, a first and a last layer written out),
and under ``custom_partitioning`` each site is lowered by itself inside XLA's partitioner,
so lowering was most of a fused step's compile time (``bench/lowering_time.py``;
``docs/tuning.md#compile-time-and-caches``).

``launch(fn, args)`` runs ``fn`` (a pure function of arrays whose body is one kernel
launch) through an exported copy of it (``jax.export``, platform ``cuda``). The copy is
found by the fingerprint of ``fn``'s traced program (``Fingerprint``: every equation, its
parameters and constants, the kernel body included), together with jax's and jaxlib's
versions, this package's Python source (not its tuned configs: the config an entry
chooses is in the traced program) and the device's kind (``keyed_for`` names another
device, to lower kernels for a GPU host elsewhere). It is made once per process and,
where a cache folder is set, read from and written to that folder, so a later process
lowers none of the kernels it has seen. Tracing a kernel and taking its fingerprint costs
about a tenth of lowering it.

The folder: ``$CODA_JAX_KERNEL_CACHE`` (a path, or ``none`` for no folder), default
``~/.cache/coda_jax/kernels``; ``set_cache_dir`` replaces it in a running process. One
file per kernel (60-130 KB; the 1B Llama step's 21 kernels take 2.9 MB). Every change
to the library's source gives new keys, so after each write the folder is held to
``$CODA_JAX_KERNEL_CACHE_MAX_MB`` (default 1024; ``none``: no bound) by deleting the
kernels least recently used (``prune``: a read refreshes a file's time). A file that
cannot be read is logged and replaced; a folder that cannot be written is logged, and the
kernel is kept in memory only.

Under ``jax.vmap`` (``plgpu.kernel`` batches a launch) the batched kernel is lowered where
it is traced, as without this cache: an exported program has no batching rule (the
unbatched kernel is still looked up, since vmap traces it first). While
``autotune.recording`` collects a workload's problems (inside ``bypassed``), kernels are
traced only, never lowered. Identical launches in one program share one lowered function (jax lowers a
primitive with equal parameters once per module), so the module holds each kernel once.
"""
from __future__ import annotations

import collections
import collections.abc
import contextlib
import dataclasses
import functools
import hashlib
import logging
import os
import re
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import jaxlib
import numpy as np
from jax.extend import core as jex_core

log = logging.getLogger("coda_jax")

FORMAT = "coda-jax-kernel-1"  # bump when what a file holds, or the key, changes
SUFFIX = ".jaxexport"
CACHE_ENV = "CODA_JAX_KERNEL_CACHE"
MAX_MB_ENV = "CODA_JAX_KERNEL_CACHE_MAX_MB"
DEFAULT_MAX_MB = 1024
_KERNEL_FILE = re.compile(r"kernel-[0-9a-f]{40}" + re.escape(SUFFIX))
_PACKAGE = Path(__file__).resolve().parent
_lock = threading.Lock()
_exported: dict[str, "jax.export.Exported"] = {}
_dir_override: list[Path | None] = []
_key_device: list[Any] = []  # keyed_for's device, innermost last (process-wide)
# how each launch found its kernel, for reports and tests
counts: collections.Counter = collections.Counter()


# ---- fingerprints (also coda_jax.program_cache's) ---------------------------------------

def _stable_repr(v) -> str:
  """``repr(v)``, or its type's name where the repr holds a memory address (a function or
  rule object: these parameters, e.g. custom_vmap's batching rule, are not lowered)."""
  r = repr(v)
  if " at 0x" in r:
    return f"<{type(v).__module__}.{type(v).__qualname__}>"
  return r


class Fingerprint:
  """A sha256 over a closed jaxpr's whole structure: every equation's primitive, operand and
  result types, the dataflow between them, and its parameters, recursing into nested
  jaxprs (scan and cond bodies, custom_vjp calls, kernel bodies) wherever a parameter holds
  one. A kernel launched through ``launch`` appears as a call of its exported copy, whose
  name holds the kernel's own fingerprint."""

  def __init__(self):
    self.h = hashlib.sha256()

  def add(self, *parts: str) -> None:
    for p in parts:
      self.h.update(p.encode())
      self.h.update(b"\x00")

  def jaxpr(self, jaxpr, consts: Sequence[Any] = ()) -> None:
    names: dict[Any, str] = {}

    def var(v) -> str:
      if isinstance(v, jex_core.Literal):
        return f"literal {np.asarray(v.val)!r}:{v.aval}"
      return names.setdefault(v, f"v{len(names)}") + f":{v.aval}"

    self.add("jaxpr(", *map(var, jaxpr.constvars), "|", *map(var, jaxpr.invars))
    for c in consts:
      self.array(c)
    for eqn in jaxpr.eqns:
      self.add(eqn.primitive.name, *map(var, eqn.invars))
      for k in sorted(eqn.params):
        self.add(k)
        self.value(eqn.params[k])
      # effects follow from the equations (their reprs hold object ids): types only
      self.add("->", *map(var, eqn.outvars), *sorted(type(e).__name__ for e in eqn.effects))
    self.add("return", *map(var, jaxpr.outvars), ")")

  def array(self, x) -> None:
    if isinstance(x, jax.core.Tracer):  # a nested body closing over its caller's values
      self.add("traced", str(x.aval))
      return
    a = np.asarray(x)
    self.add("array", str(a.dtype), str(a.shape))
    self.h.update(a.tobytes())

  def value(self, v) -> None:
    if isinstance(v, (jex_core.ClosedJaxpr, jex_core.Jaxpr)):  # one class in jax 0.11
      self.jaxpr(getattr(v, "jaxpr", v), getattr(v, "consts", ()))
    elif isinstance(v, jax.export.Exported):  # its name is its content's fingerprint
      self.add("exported", v.fun_name, repr(v.platforms), *map(str, v.in_avals),
               *map(str, v.out_avals))
    elif isinstance(v, (tuple, list)):
      self.add(type(v).__name__, str(len(v)))
      for x in v:
        self.value(x)
    elif isinstance(v, collections.abc.Mapping):  # dicts, jax's FrozenDict
      self.add("dict", str(len(v)))
      for k in sorted(v, key=repr):
        self.add(repr(k))
        self.value(v[k])
    elif isinstance(v, (np.ndarray, jax.Array)):
      self.array(v)
    else:
      self.add(_stable_repr(v))

  def hexdigest(self) -> str:
    return self.h.hexdigest()


def source_digest(*roots: Path, suffixes: tuple[str, ...] = (".py", ".json")) -> str:
  """A digest of source trees (callers read it once per process: the code a process
  lowers is the code it imported).

  Args:
    roots: package folders.
    suffixes: the file kinds read (default Python sources and JSON data).

  Returns:
    sha256 hex digest of every file under them with one of ``suffixes``, with its
    path."""
  h = hashlib.sha256()
  for root in roots:
    for f in sorted(f for suffix in suffixes for f in root.rglob(f"*{suffix}")):
      h.update(str(f.relative_to(root.parent)).encode())
      h.update(f.read_bytes())
  return h.hexdigest()


@functools.cache
def _package_digest() -> str:
  # The Python sources only: the tuned configs (tuned/*.json) choose a kernel's config,
  # and the config is part of the launch's traced program that ``kernel_key`` digests,
  # so a retuned entry changes only the keys of the kernels it changes, instead of every
  # key (re-lowering every kernel after each retune).
  return source_digest(_PACKAGE, suffixes=(".py",))


# ---- files -------------------------------------------------------------------------------

def write_atomic(path: Path, data: bytes) -> None:
  """Writes ``data`` to ``path`` atomically: a reader sees the old file or the whole new
  one, also when two processes write the same entry at once.

  Args:
    path: the file; its folder is made if missing.
    data: its contents.

  Returns:
    None (OSError where the folder cannot be written)."""
  path.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(data)
    os.chmod(tmp, 0o644)  # mkstemp's 0o600 would hide it from a shared cache's other users
    os.replace(tmp, path)
  except BaseException:
    Path(tmp).unlink(missing_ok=True)
    raise


def read_exported(path: Path, warn: Callable[[str], None]) -> "jax.export.Exported | None":
  """Reads an exported program (``Exported.call`` checks its argument types again), and
  marks the file as just used (its modification time: ``prune`` deletes the oldest).

  Args:
    path: the file written from ``Exported.serialize()``.
    warn: told why, when the file exists but cannot be read.

  Returns:
    The ``jax.export.Exported``, or None when there is no file or it cannot be read."""
  try:
    exp = jax.export.deserialize(bytearray(path.read_bytes()))
  except (FileNotFoundError, NotADirectoryError):  # none yet, or just pruned elsewhere
    return None
  except Exception as e:  # noqa: BLE001 (any failure to parse means: make it again)
    warn(f"{path} could not be read ({type(e).__name__}: {e}); making it again")
    return None
  try:
    os.utime(path)
  except OSError:  # a read-only shared cache is still read
    pass
  return exp


def max_bytes(env: str, default_mb: int) -> int | None:
  """A cache folder's bound from ``$env``: megabytes (10**6 bytes), or ``none``.

  Args:
    env: the variable's name; default_mb: the bound where it is unset.

  Returns:
    The bound in bytes, or None for no bound.

  Raises:
    ValueError: when the variable is neither a non-negative number nor ``none``."""
  raw = os.environ.get(env, "").strip()
  if not raw:
    return default_mb * 10**6
  if raw.lower() == "none":
    return None
  try:
    mb = float(raw)
  except ValueError:
    mb = -1.0
  if not 0 <= mb < float("inf"):
    raise ValueError(f"{env}={raw!r}: give the folder's bound in megabytes (e.g. 1024), "
                     "or 'none' for no bound")
  return int(mb * 10**6)


def write_bounded(path: Path, data: bytes, entry: "re.Pattern[str]", env: str,
                  default_mb: int) -> list[Path]:
  """Writes a cache entry (``write_atomic``), then holds its folder to the bound that
  ``$env`` sets (``max_bytes``), deleting the least recently used entries but this one
  (``prune``).

  Args:
    path: the entry; data: its contents.
    entry: the pattern of the cache's file names; env, default_mb: as ``max_bytes``.

  Returns:
    The entries deleted, oldest first (OSError where ``path`` cannot be written)."""
  write_atomic(path, data)
  return prune(path.parent, entry, max_bytes(env, default_mb), keep=path)


def prune(folder: Path, entry: "re.Pattern[str]", limit: int | None,
          keep: Path | None = None) -> list[Path]:
  """Deletes the least recently used entries of ``folder`` until the rest fit ``limit``.

  Only files whose whole name matches ``entry`` count and are deleted, so other files in
  the folder (another cache's, a user's) are left alone. Entries another process deletes
  meanwhile are skipped.

  Args:
    folder: the cache folder.
    entry: the pattern of the cache's file names (``re.fullmatch``).
    limit: the bound in bytes; None for no bound (nothing is deleted).
    keep: an entry never deleted (the one just written).

  Returns:
    The deleted files, oldest first."""
  if limit is None:
    return []
  files = []
  try:
    for p in folder.iterdir():
      if entry.fullmatch(p.name):
        try:
          st = p.stat()
        except OSError:
          continue
        files.append((st.st_mtime, st.st_size, p))
  except OSError:
    return []
  total = sum(size for _, size, _ in files)
  deleted = []
  for _, size, p in sorted(files, key=lambda f: f[:2]):
    if total <= limit:
      break
    if keep is not None and p == keep:
      continue
    try:
      p.unlink()
    except FileNotFoundError:
      pass
    except OSError:
      continue
    total -= size
    deleted.append(p)
  return deleted


# ---- the kernel cache ----------------------------------------------------------------------

_bypassed = threading.local()


@contextlib.contextmanager
def bypassed():
  """Inside, ``gemm`` lowers its kernels where it traces them, as without this module (the
  reference of the GPU test; ``autotune.recording`` traces inside it, lowering nothing).

  Returns:
    A context manager."""
  _bypassed.depth = getattr(_bypassed, "depth", 0) + 1
  try:
    yield
  finally:
    _bypassed.depth -= 1


def active() -> bool:
  """Whether ``gemm`` launches compiled kernels through this cache here.

  Returns:
    False inside ``bypassed()``, else True."""
  return not getattr(_bypassed, "depth", 0)


def cache_dir() -> Path | None:
  """The folder kernels are kept in across processes.

  Returns:
    ``set_cache_dir``'s path where it was called, else ``$CODA_JAX_KERNEL_CACHE``
    (None where it says ``none``), else ``~/.cache/coda_jax/kernels``."""
  if _dir_override:
    return _dir_override[-1]
  env = os.environ.get(CACHE_ENV, "")
  if env.lower() in ("none", "off", "0"):
    return None
  return Path(env) if env else Path.home() / ".cache" / "coda_jax" / "kernels"


def set_cache_dir(path: str | os.PathLike | None) -> None:
  """Keeps kernels in ``path`` from now on in this process, whatever
  ``$CODA_JAX_KERNEL_CACHE`` says.

  Args:
    path: the folder (made on first use), or None to keep kernels in memory only.

  Returns:
    None."""
  _dir_override[:] = [None if path is None else Path(path)]


@contextlib.contextmanager
def keyed_for(device):
  """Inside, kernels are keyed (``kernel_key``) for ``device`` instead of JAX's default
  device: a machine without a GPU lowers kernels into a folder that a GPU host of that
  kind then reads instead of lowering them (``bench.tune_gemm --lower-only``). The
  traced program must be the one that device traces (its SM count passed to ``gemm`` as
  ``num_sms``, its tuning keys; ``bench.lowering_time.pretend``).

  Args:
    device: an object with the ``platform`` ("gpu"), ``device_kind`` and
      ``compute_capability`` that the GPU host's ``jax.devices()[0]`` reports.

  Returns:
    A context manager."""
  _key_device.append(device)
  try:
    yield
  finally:
    _key_device.pop()


def clear_memory() -> None:
  """Forgets the kernels this process holds (the folder is left as it is), as a new
  process would start.

  Returns:
    None."""
  with _lock:
    _exported.clear()


def kernel_key(jaxpr: "jax.extend.core.ClosedJaxpr") -> str:
  """The key of one kernel launch's traced program.

  Args:
    jaxpr: the launch traced with abstract arguments (``jax.make_jaxpr`` or
      ``jax.jit(...).trace(...).jaxpr``).

  Returns:
    A sha256 hex digest over the program (``Fingerprint``), jax's and jaxlib's versions,
    this package's Python source and the platform, kind and compute capability of the default
    device (of ``keyed_for``'s inside it)."""
  fp = Fingerprint()
  fp.add(FORMAT, jax.__version__, jaxlib.__version__, _package_digest())
  d = _key_device[-1] if _key_device else jax.devices()[0]
  fp.add(d.platform, d.device_kind, str(getattr(d, "compute_capability", "")))
  fp.jaxpr(jaxpr.jaxpr, jaxpr.consts)
  return fp.hexdigest()


def exported(fn: Callable, specs: Sequence[jax.ShapeDtypeStruct]) -> "jax.export.Exported":
  """``fn`` exported for CUDA: from this process's memory, else the cache folder, else
  lowered now (and kept in both). ``counts`` says which. ``fn`` is traced once: the key's
  trace is the one a miss lowers.

  Args:
    fn: a pure function of arrays launching one compiled kernel, returning a tuple of
      arrays.
    specs: its arguments' shapes and dtypes.

  Returns:
    The ``jax.export.Exported`` whose ``fun_name`` holds the kernel's key."""
  jitted = jax.jit(fn)
  key = kernel_key(jitted.trace(*specs).jaxpr)
  with _lock:
    hit = _exported.get(key)
  if hit is not None:
    counts["memory"] += 1
    return hit
  name = f"coda_kernel_{key[:40]}"  # Fingerprint reads it from the call
  folder = cache_dir()
  path = None if folder is None else folder / f"kernel-{key[:40]}{SUFFIX}"
  exp = None if path is None else read_exported(
      path, lambda msg: log.warning("kernel cache: %s", msg))
  if exp is not None and exp.fun_name == name:
    counts["disk"] += 1
  else:
    t0 = time.perf_counter()
    # jit's trace cache hands export the trace above
    exp = dataclasses.replace(jax.export.export(jitted, platforms=["cuda"])(*specs),
                              fun_name=name)
    counts["lowered"] += 1
    log.info("kernel cache: lowered kernel %d of this process (arguments %s) "
             "in %.1f s", counts["lowered"], ", ".join(str(jax.typeof(x)) for x in specs),
             time.perf_counter() - t0)
    if path is not None:
      try:
        gone = write_bounded(path, bytes(exp.serialize()), _KERNEL_FILE, MAX_MB_ENV,
                             DEFAULT_MAX_MB)
      except OSError as e:  # a read-only or full disk must not stop the program itself
        log.warning("kernel cache: could not write %s (%s); the kernel is kept "
                    "in memory only", path, e)
      else:
        if gone:
          log.info("kernel cache: deleted the %d least recently used kernels of "
                   "%s to stay within $%s", len(gone), folder, MAX_MB_ENV)
  with _lock:
    _exported[key] = exp
  return exp


def call(fn: Callable, args: Sequence[jax.Array]) -> tuple:
  """``fn(*args)`` through its exported copy (``exported``); no batching rule (see
  ``launch``).

  Args:
    fn: a pure function of ``args`` whose body launches one compiled kernel, returning a
      tuple of arrays; it may capture constants, not traced values.
    args: arrays (or tracers).

  Returns:
    ``fn``'s outputs, a tuple of arrays."""
  specs = [jax.ShapeDtypeStruct(np.shape(x), x.dtype) for x in args]
  return tuple(exported(fn, specs).call(*args))


def launch(fn: Callable, args: Sequence[jax.Array]) -> tuple:
  """``call(fn, args)``; under ``jax.vmap``, ``fn`` batched and lowered where traced.

  Args:
    fn, args: as ``call``'s.

  Returns:
    ``fn``'s outputs, a tuple of arrays."""
  run = jax.custom_batching.custom_vmap(lambda *xs: call(fn, xs))

  @run.def_vmap
  def _batched(axis_size, in_batched, *xs):  # unbatched operands stay unbatched
    outs = jax.vmap(fn, in_axes=tuple(0 if b else None for b in in_batched),
                    axis_size=axis_size)(*xs)
    return outs, tuple(True for _ in outs)

  return run(*args)


__all__ = ["CACHE_ENV", "Fingerprint", "FORMAT", "SUFFIX", "active", "bypassed", "cache_dir",
           "call", "clear_memory", "counts", "exported", "kernel_key", "keyed_for", "launch",
           "read_exported", "set_cache_dir", "source_digest", "write_atomic"]
