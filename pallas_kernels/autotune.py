"""Measured GEMM configs, searched on the device and cached on disk.

A tuning problem is keyed by everything that changes which config is fastest:
the device kind, the jax version, (M, N, K), the operand orders, the dtype and the
epilogue program's signature (its name, declared operands and outputs, in-place
outputs, and the column group its epilogue sub-tiles must be a multiple of).

``gemm(config=None)`` asks ``lookup`` first: the user's cache
(``$CODA_JAX_GEMM_CACHE``, default ``~/.cache/coda_jax/gemm_configs.json``), then the
cache shipped in ``pallas_kernels/tuned/gemm_configs.json``. Where neither has the key,
the same problem tuned at the nearest row count M (or contraction K) within a factor of
2 serves (a ragged batch of 16000 rows runs the config tuned at 16384), if it tiles this
problem; else the same search among the entries of another device kind of the same chip
(``SAME_CHIP``: an H200 runs the H100's configs where it has none of its own); else
``default_config``'s heuristic. ``tune`` runs the search for one problem:
every candidate that the shape tiles and that fits in shared memory is compiled and
timed with CUPTI; one that fails to compile or run is skipped with its reason logged,
never chosen. ``bench/tune_gemm.py`` is the front end that fills the cache.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import enum
import json
import math
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

import jax
import jax.numpy as jnp

from pallas_kernels import gemm_mgpu as g, kernel_cache

CACHE_ENV = "CODA_JAX_GEMM_CACHE"
SHIPPED_CACHE = Path(__file__).resolve().parent / "tuned" / "gemm_configs.json"
CACHE_FORMAT = 1


def user_cache_path() -> Path:
  """The user's GEMM config cache file, the first that ``lookup`` reads.

  Returns:
    The path in ``$CODA_JAX_GEMM_CACHE`` (``CACHE_ENV``) where that is set and not
    empty, else ``~/.cache/coda_jax/gemm_configs.json``. The file need not exist.
  """
  return Path(os.environ.get(CACHE_ENV) or
              Path.home() / ".cache" / "coda_jax" / "gemm_configs.json")


@dataclasses.dataclass(frozen=True)
class ProblemKey:
  """What a tuned config is valid for."""
  device_kind: str
  jax_version: str
  m: int
  n: int
  k: int
  trans_a: bool
  trans_b: bool
  dtype: str
  signature: str

  def __post_init__(self):
    for name in ("m", "n"):
      if getattr(self, name) < 1:
        raise ValueError(f"ProblemKey.{name}={getattr(self, name)} must be positive")
    if self.k < 0:  # K = 0: an epilogue pass with no product
      raise ValueError(f"ProblemKey.k={self.k} must be >= 0")
    if "|" in self.signature:
      raise ValueError(f"ProblemKey.signature={self.signature!r} must not contain '|'")

  @classmethod
  def from_text(cls, text: str) -> "ProblemKey":
    """The key whose ``text()`` this is."""
    device_kind, jax_version, shape, order, dtype, sig = text.split("|", 5)
    m, n, k = (int(v) for v in shape.split("x"))
    return cls(device_kind, jax_version, m, n, k, order[0] == "t", order[1] == "t", dtype,
               sig)

  @property
  def order(self) -> str:
    """The operands' storage orders as the key spells them: "nn", "nt", "tn" or "tt"
    (A then B; "t" where the operand is stored transposed)."""
    return ("t" if self.trans_a else "n") + ("t" if self.trans_b else "n")

  def text(self) -> str:
    """The cache's key for this problem."""
    return "|".join([self.device_kind, self.jax_version, f"{self.m}x{self.n}x{self.k}",
                     self.order, self.dtype, self.signature])


def signature(program_id: str | None, input_kinds: dict, input_dtypes: dict,
              outputs: tuple, in_place: dict, min_epi_tile_n: int) -> str:
  """The epilogue program as the cache sees it. ``program_id`` names what the closure
  computes (two programs with the same operands can cost differently).

  Args:
    program_id: names the epilogue program; None for an unnamed one ("anonymous").
    input_kinds: operand name -> ``epilogue.InputKind``, in the order the key lists
      them.
    input_dtypes: operand name -> dtype, for every name in ``input_kinds``.
    outputs: the program's declared outputs (``epilogue.EpilogueOutput``), in order.
    in_place: output name -> the tile operand it is written into (``gemm``'s
      ``in_place``).
    min_epi_tile_n: the column group: the epilogue sub-tile width must be a multiple of
      it.

  Returns:
    ``"<program_id>;in=<operands>;out=<outputs>;in_place=<pairs>;group=<n>"``: each
    operand as ``name:kind:dtype``, each output as ``name:kind:dtype:width`` (followed
    by ``+<operand>`` where it adds to one), each in-place pair as ``output<operand``
    sorted by output, ``<n>`` the column group, and every "|" replaced by "/" (it
    separates the fields of the cache's key).
  """
  ins = ",".join(f"{nm}:{kind.value}:{jnp.dtype(input_dtypes[nm]).name}"
                 for nm, kind in input_kinds.items())
  outs = ",".join(f"{o.name}:{o.kind.value}:{jnp.dtype(o.dtype).name}:{o.width}"
                  + (f"+{o.adds_to}" if o.adds_to else "") for o in outputs)
  places = ",".join(f"{o}<{i}" for o, i in sorted(in_place.items()))
  return (f"{program_id or 'anonymous'};in={ins};out={outs};in_place={places};"
          f"group={min_epi_tile_n}").replace("|", "/")


def problem_key(m, n, k, dtype, trans_a, trans_b, sig: str,
                device_kind: str | None = None) -> ProblemKey:
  """The tuning cache's key for one GEMM problem under the installed jax.

  Args:
    m: rows of A and of the product.
    n: columns of B and of the product.
    k: the contraction size; 0 for an epilogue pass with no product.
    dtype: the operands' dtype (anything ``jnp.dtype`` takes); the key holds its name.
    trans_a: A is stored transposed, as (K, M).
    trans_b: B is stored transposed, as (N, K).
    sig: the epilogue program's ``signature``.
    device_kind: the device kind to key on; None (or "") for that of
      ``jax.devices()[0]``.

  Returns:
    The ``ProblemKey``, with ``jax.__version__`` as its jax version.

  Raises:
    ValueError: from ``ProblemKey``'s checks: M or N below 1, K below 0, or a "|" in
      ``sig``.
  """
  device_kind = device_kind or jax.devices()[0].device_kind
  return ProblemKey(device_kind=device_kind, jax_version=jax.__version__, m=m, n=n,
                    k=k, trans_a=trans_a, trans_b=trans_b, dtype=jnp.dtype(dtype).name,
                    signature=sig)


# ---- the cache file ------------------------------------------------------------------

def config_to_dict(cfg: g.GemmConfig) -> dict:
  """A config as the cache file stores it.

  Args:
    cfg: the config.

  Returns:
    Field name -> value for every field of ``GemmConfig``, enum values (``MatDim``,
    ``Schedule``) as their member names; ``config_from_dict`` inverts it.
  """
  out = {}
  for f in dataclasses.fields(cfg):
    v = getattr(cfg, f.name)
    out[f.name] = v.name if isinstance(v, enum.Enum) else v
  return out


def config_from_dict(d: dict) -> g.GemmConfig:
  """Inverse of ``config_to_dict``; raises ValueError on unknown fields or values.

  Args:
    d: field name -> value, as ``config_to_dict`` writes it: ``wg_dim``,
      ``grid_minor_dim`` and ``cluster_dim`` (which may be None) as ``MatDim`` member
      names, ``schedule`` as a ``Schedule`` member name. A field left out takes its
      ``GemmConfig`` default.

  Returns:
    The ``GemmConfig``.

  Raises:
    ValueError: on a field that ``GemmConfig`` does not have, on an enum member name
      that does not exist, or where ``GemmConfig``'s own checks reject the values.
  """
  fields = {f.name for f in dataclasses.fields(g.GemmConfig)}
  unknown = set(d) - fields
  if unknown:
    raise ValueError(f"cached config has unknown fields {sorted(unknown)}")
  kw = dict(d)
  try:
    for name in ("wg_dim", "grid_minor_dim"):
      if name in kw:
        kw[name] = g.MatDim[kw[name]]
    if kw.get("cluster_dim") is not None:
      kw["cluster_dim"] = g.MatDim[kw["cluster_dim"]]
    if "schedule" in kw:
      kw["schedule"] = g.Schedule[kw["schedule"]]
  except KeyError as e:
    raise ValueError(f"cached config has an unknown enum value {e}") from None
  return g.GemmConfig(**kw)


_lock = threading.Lock()
_loaded: dict[Path, tuple[float, dict]] = {}


def _entries(path: Path) -> dict:
  """The entries of one cache file, re-read when it changes; {} if it is absent."""
  try:
    mtime = path.stat().st_mtime
  except OSError:
    return {}
  with _lock:
    hit = _loaded.get(path)
    if hit and hit[0] == mtime:
      return hit[1]
    try:
      data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
      raise ValueError(f"GEMM config cache {path} is unreadable ({e}): fix or delete it") from e
    if data.get("format") != CACHE_FORMAT:
      raise ValueError(f"GEMM config cache {path} has format {data.get('format')!r}, "
                       f"this library reads {CACHE_FORMAT}: delete it and re-tune")
    _loaded[path] = (mtime, data["entries"])
    return data["entries"]


def cache_paths() -> list[Path]:
  """Where ``lookup`` looks, first hit wins."""
  return [user_cache_path(), SHIPPED_CACHE]


def cached_entries() -> Iterator[tuple[ProblemKey, dict]]:
  """Every entry of the caches, in ``cache_paths`` order (a key held by two comes twice;
  ``lookup`` takes the first).

  Returns:
    An iterator of (key, record) pairs, the record as ``store`` wrote it.
  """
  for path in cache_paths():
    for text, entry in _entries(path).items():
      yield ProblemKey.from_text(text), entry


def tiles(key: ProblemKey, cfg: g.GemmConfig, clip_m: bool = False) -> bool:
  """Whether ``cfg`` tiles the problem ``key`` (``gemm_mgpu._check_tiling``): a config
  tuned at another size may not (M not a multiple of its cluster tile, K of its tile_k).

  Args:
    key: the problem.
    cfg: a config, e.g. one cached for another problem.
    clip_m: ``gemm``'s: M need not be a multiple of the config's cluster tile.

  Returns:
    True where ``gemm`` can run the problem under ``cfg``'s tiling.
  """
  try:
    g._check_tiling(key.m, key.n, key.k, cfg, key.trans_a, key.trans_b, clip_m)
  except ValueError:
    return False
  return True


# How far (a factor) a cached problem's token count may be from the asked one for its
# config to serve (``lookup_with_source``): the same problem at a nearby row count M (a
# forward or data-gradient GEMM) or a nearby contraction K (a weight gradient, A^T @ dY,
# whose K is the tokens) tiles the same way and is bound the same way. Further apart (a
# tiny evaluation batch against a training one), the heuristic serves instead.
NEARBY_FACTOR = 2


def nearby(key: ProblemKey, other: ProblemKey) -> tuple[float, int, int, str] | None:
  """Where ``other`` is ``key`` at another M or another K (not both) within
  ``NEARBY_FACTOR``: its order among such neighbours (nearest first, then the larger
  size, then M before K) and its source text, "tuned at M=<m>" or "tuned at K=<k>".
  Else None. K = 0 (an epilogue pass) has no nearby K. The lookup's and
  ``tune_gemm --same-shape``'s one notion of a nearby problem.

  Args:
    key: the problem asked for.
    other: a cached problem.

  Returns:
    (log distance, -its size, 0 for M or 1 for K, source text), or None.
  """
  for rank, dim in enumerate(("m", "k")):
    mine, theirs = getattr(key, dim), getattr(other, dim)
    if (mine != theirs and mine > 0 and theirs > 0
        and dataclasses.replace(key, **{dim: theirs}) == other
        and mine <= theirs * NEARBY_FACTOR and theirs <= mine * NEARBY_FACTOR):
      return abs(math.log(theirs / mine)), -theirs, rank, f"tuned at {dim.upper()}={theirs}"
  return None


# Device kinds that are one chip: the same SMs (132), shared memory and tensor cores, so
# a config fits and schedules the same on each; they differ only in memory (the H200's
# 141 GB of HBM3e at 4.8 TB/s against the H100's 80 GB of HBM3 at 3.35). A device kind's
# own entries serve first; a sibling's (exact, then at a nearby M or K) only where it has
# none: a sibling's tuned config measured closer to the best than the heuristic
# (docs/tuning.md#configs-shared-across-h100-and-h200). Another kind of the same chip
# (an H800, a GH200) joins a group here once measured so.
SAME_CHIP = (("NVIDIA H100 80GB HBM3", "NVIDIA H200"),)


def same_chip_kinds(device_kind: str) -> tuple[str, ...]:
  """The other device kinds whose tuned configs may serve ``device_kind``
  (``SAME_CHIP``), in the group's order; () for a kind in no group.

  Args:
    device_kind: a device kind as ``jax.Device.device_kind`` spells it.

  Returns:
    The other kinds of the first ``SAME_CHIP`` group that holds ``device_kind``, in the
    group's order; () where no group holds it.
  """
  for group in SAME_CHIP:
    if device_kind in group:
      return tuple(kind for kind in group if kind != device_kind)
  return ()


def _lookup_one_kind(key: ProblemKey, clip_m: bool
                     ) -> tuple[g.GemmConfig | None, str | None]:
  """``lookup_with_source`` among the entries of ``key.device_kind`` alone."""
  text = key.text()
  for path in cache_paths():
    entry = _entries(path).get(text)
    if entry is not None:
      return config_from_dict(entry["config"]), "tuned"
  near = [(order, entry["config"]) for other, entry in cached_entries()
          if (order := nearby(key, other)) is not None]
  for (*_, source), cfg_dict in sorted(near, key=lambda t: t[0]):
    cfg = config_from_dict(cfg_dict)
    if tiles(key, cfg, clip_m):  # the nearest whose config tiles this M and K
      return cfg, source
  return None, None


def lookup_with_source(key: ProblemKey, clip_m: bool = False
                       ) -> tuple[g.GemmConfig | None, str | None]:
  """The cached config for this problem and where it came from.

  Args:
    key: the problem.
    clip_m: ``gemm``'s: M need not be a multiple of the config's cluster tile.

  Returns:
    ``(config, "tuned")`` for this key; else ``(config, "tuned at M=<m>")`` or
    ``(config, "tuned at K=<k>")``: the same problem at the nearest cached M, or K,
    within a factor ``NEARBY_FACTOR`` whose config tiles this problem (the larger size
    on a tie, M before K); else the same search among the entries of another device
    kind of the same chip (``same_chip_kinds``), its source ending " on <that kind>"
    (e.g. ``"tuned on NVIDIA H100 80GB HBM3"``); else ``(None, None)``. The first cache
    in ``cache_paths`` that has the key wins; nearby sizes are looked for only where no
    cache has it.
  """
  cfg, source = _lookup_one_kind(key, clip_m)
  if cfg is not None:
    return cfg, source
  for kind in same_chip_kinds(key.device_kind):
    cfg, source = _lookup_one_kind(dataclasses.replace(key, device_kind=kind), clip_m)
    if cfg is not None:
      return cfg, f"{source} on {kind}"
  return None, None


def lookup(key: ProblemKey, clip_m: bool = False) -> g.GemmConfig | None:
  """The cached config for this problem (or for it at a nearby M or K:
  ``lookup_with_source``), or None.

  Args:
    key: the problem.
    clip_m: ``gemm``'s: M need not be a multiple of the config's cluster tile.

  Returns:
    The config that ``lookup_with_source`` finds, without its source; None where no
    cache serves the problem.

  Raises:
    ValueError: where a cache file it reads is not valid JSON, has another format
      than this library's, or holds a config that ``config_from_dict`` rejects.
  """
  return lookup_with_source(key, clip_m)[0]


def store(key: ProblemKey, record: dict, path: Path | None = None) -> Path:
  """Writes one entry (``record["config"]`` a config dict) into a cache file.

  Args:
    key: the problem; its ``text()`` is the entry's key, and an entry already under it
      is replaced.
    record: the entry, a JSON-serializable dict (``tune``'s record) whose ``"config"``
      is ``config_to_dict``'s form.
    path: the cache file (a str or a ``Path``); default ``user_cache_path()``. Its
      folder is made where missing. Where the file is absent, cannot be read or is not
      valid JSON, a new cache that holds this entry alone is written in its place.

  Returns:
    The path of the file written. The entries are written sorted by key, through a
    temporary file that then replaces it.
  """
  path = Path(path) if path is not None else user_cache_path()
  path.parent.mkdir(parents=True, exist_ok=True)
  with _lock:
    try:
      data = json.loads(path.read_text())
    except (OSError, ValueError):
      data = {"format": CACHE_FORMAT, "entries": {}}
    data["entries"][key.text()] = record
    data["entries"] = dict(sorted(data["entries"].items()))
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)
    _loaded.pop(path, None)
  return path


# ---- recording the GEMMs a workload runs -----------------------------------------------

@dataclasses.dataclass(frozen=True)
class Problem:
  """One GEMM call as ``gemm`` saw it: enough to re-run it on fresh inputs."""
  key: ProblemKey
  a: jax.ShapeDtypeStruct
  b: jax.ShapeDtypeStruct
  inputs: dict  # name -> (kind, ShapeDtypeStruct)
  epilogue: Callable
  outputs: tuple
  trans_a: bool
  trans_b: bool
  in_place: dict
  program_id: str | None
  min_epi_tile_n: int
  column_sum_turns: bool = False
  clip_m: bool = False  # gemm's: M need not be a multiple of the cluster tile

  @property
  def input_kinds(self) -> dict:
    return {nm: kind for nm, (kind, _) in self.inputs.items()}

  @property
  def staged_kinds(self) -> dict:
    """The operands the compiled kernel stages (what its shared memory holds)."""
    return g.staged_inputs(self.input_kinds, self.outputs, self.in_place)

  @property
  def input_dtypes(self) -> dict:
    return {nm: v.dtype for nm, (_, v) in self.inputs.items()}

  def random_inputs(self, seed: int = 0) -> tuple:
    """(a, b, operands by name): fresh random normal inputs of the problem's shapes
    (integer operands uniform in [0, 64))."""
    ks = jax.random.split(jax.random.key(seed), 2 + len(self.inputs))
    return (_random_like(ks[0], self.a), _random_like(ks[1], self.b),
            {nm: _random_like(kk, v) for kk, (nm, (_, v)) in zip(ks[2:], self.inputs.items())})

  def jitted(self, config: g.GemmConfig, num_sms: int | None = None) -> Callable:
    """``jit(f)`` with ``f(a, b, operands)`` this problem's GEMM under ``config`` (and
    ``num_sms``, default the device's)."""
    kinds = self.input_kinds
    return jax.jit(lambda a, b, ops: g.gemm(
        a, b, inputs={nm: (kinds[nm], v) for nm, v in ops.items()}, epilogue=self.epilogue,
        outputs=self.outputs, trans_a=self.key.trans_a, trans_b=self.key.trans_b,
        in_place=self.in_place, config=config, program_id=self.program_id,
        min_epi_tile_n=self.min_epi_tile_n, num_sms=num_sms,
        column_sum_turns=self.column_sum_turns, clip_m=self.clip_m))

  def candidates(self, extra: bool = False, tile_m: int | None = None,
                 tile_n: int | None = None
                 ) -> tuple[list[g.GemmConfig], list[tuple[str, str]]]:
    """``candidates`` (the search) for this problem: (configs, [(description, why
    skipped)])."""
    k = self.key
    return candidates(k.m, k.n, k.k, self.a.dtype, self.staged_kinds, self.input_dtypes,
                      self.outputs, trans_a=k.trans_a, trans_b=k.trans_b,
                      min_epi_tile_n=self.min_epi_tile_n, extra=extra, clip_m=self.clip_m,
                      tile_m=tile_m, tile_n=tile_n)

  def deepest_fitting(self, config: g.GemmConfig) -> g.GemmConfig | None:
    """``g.deepest_fitting`` for this problem: ``config`` with the most stages, at most
    its own, whose shared memory (the operands the kernel stages) fits; None if none."""
    return g.deepest_fitting(config, self.a.dtype, self.staged_kinds, self.input_dtypes,
                             self.outputs, mainloop=self.key.k > 0)

  def default_config(self) -> g.GemmConfig:
    """The heuristic config ``gemm`` falls back to (raises ValueError if none tiles)."""
    k = self.key
    return g.default_config(k.m, k.n, k.k, self.a.dtype, input_kinds=self.staged_kinds,
                            input_dtypes=self.input_dtypes, outputs=self.outputs,
                            min_epi_tile_n=self.min_epi_tile_n, trans_a=k.trans_a,
                            trans_b=k.trans_b, clip_m=self.clip_m)


def plain_problem(m: int, n: int, k: int, dtype="bfloat16", trans_a: bool = False,
                  trans_b: bool = False) -> Problem:
  """The recorded problem of the plain GEMM (default epilogue: the product stored in
  ``dtype``) at M, N, K and this operand order.

  Args:
    m: rows of A and of the product.
    n: columns of B and of the product.
    k: the contraction size.
    dtype: the operands' and the product's dtype.
    trans_a: A is stored transposed, as (K, M).
    trans_b: B is stored transposed, as (N, K).

  Returns:
    The ``Problem`` that ``gemm`` records for this call, traced with ``jax.eval_shape``
    (nothing runs), keyed on the device kind of ``jax.devices()[0]``.
  """
  a = jax.ShapeDtypeStruct((k, m) if trans_a else (m, k), dtype)
  b = jax.ShapeDtypeStruct((n, k) if trans_b else (k, n), dtype)
  with recording() as rec:
    # num_sms only sizes the grid, which a problem does not hold: any will do
    jax.eval_shape(lambda a, b: g.gemm(a, b, trans_a=trans_a, trans_b=trans_b,
                                       num_sms=132), a, b)
  return next(iter(rec.values()))


_recorders: list[dict] = []


@contextlib.contextmanager
def recording() -> Iterator[dict]:
  """Collects the problems of every ``gemm`` call traced inside, by key text (trace the
  workload with ``jax.jit(f).lower(...)`` or ``jax.eval_shape``; nothing runs, and no
  kernel is lowered: ``kernel_cache.bypassed``).

  Returns:
    A context manager. ``with recording() as rec`` gives a dict, key text ->
    ``Problem``, that fills as ``gemm`` calls are traced in the block (the first
    ``Problem`` of each key is kept) and keeps them after it. ``gemm`` records neither
    interpreted calls nor programs with row_total outputs.
  """
  found: dict = {}
  _recorders.append(found)
  try:
    with kernel_cache.bypassed():
      yield found
  finally:
    _recorders.remove(found)


def is_recording() -> bool:
  return bool(_recorders)


def record(problem: Problem) -> None:
  """Adds a problem to every active ``recording`` that has no problem of its key yet
  (``gemm`` calls this while one is active).

  Args:
    problem: the problem of one ``gemm`` call.

  Returns:
    None.
  """
  for found in _recorders:
    found.setdefault(problem.key.text(), problem)


def chosen_config(problem: Problem) -> tuple[g.GemmConfig, str]:
  """What ``gemm(config=None)`` runs for a recorded problem, and where it came from
  ("tuned", "tuned at M=<m>", "tuned at K=<k>", any of those ending " on <another
  device kind of the same chip>", or "default"): for benchmark tables.

  Args:
    problem: a recorded problem (``recording``, ``plain_problem``).

  Returns:
    ``(config, source)``: ``lookup_with_source``'s pair for the problem's key and
    ``clip_m`` where a cache serves it, else ``(problem.default_config(), "default")``.

  Raises:
    ValueError: where no cache serves the problem and no heuristic config tiles it
      (``Problem.default_config``).
  """
  tuned, source = lookup_with_source(problem.key, problem.clip_m)
  if tuned is not None:
    return tuned, source
  return problem.default_config(), "default"


def describe_workload(fn: Callable, *args) -> list[str]:
  """Traces ``fn(*args)`` (nothing runs) and describes the config each of its GEMMs
  would run with. Clears jax's caches first: a trace that hits them (``fn`` or a
  ``custom_vjp`` inside it traced before) would not reach ``gemm``.

  Args:
    fn: the workload: a function that calls ``gemm``.
    *args: ``fn``'s arguments: arrays or ``jax.ShapeDtypeStruct``s.

  Returns:
    One line per recorded problem, in the order first traced:
    ``"<M>x<N>x<K> <order> <program_id>"`` (cut to 90 characters), then
    ``": <config> (<source>)"`` with the ``describe()`` of ``chosen_config``'s config
    and its source.
  """
  jax.clear_caches()
  with recording() as rec:
    jax.eval_shape(fn, *args)
  out = []
  for p in rec.values():
    cfg, source = chosen_config(p)
    out.append(f"{p.key.m}x{p.key.n}x{p.key.k} {p.key.order} {p.program_id or ''}"[:90]
               + f": {cfg.describe()} ({source})")
  return out


# ---- the search ------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class SearchStructure:
  """One tile structure of the search (``GemmConfig``'s fields of those names); the
  search tries each with every epilogue sub-tile height in ``epi_heights`` and width in
  ``epi_widths``, each K step, and the deepest pipeline that fits."""
  schedule: g.Schedule
  tile_m: int
  tile_n: int
  wg_dim: g.MatDim
  cluster_dim: g.MatDim | None
  grid_minor_dim: g.MatDim
  grid_tile_width: int = 16
  epi_widths: tuple[int, ...] = (64, 32)
  epi_heights: tuple[int, ...] = (64,)

  def __post_init__(self):
    if not self.epi_widths or any(w <= 0 or w % 8 for w in self.epi_widths):
      raise ValueError(f"SearchStructure.epi_widths={self.epi_widths}: positive "
                       "multiples of 8")
    if not self.epi_heights or any(h <= 0 or h % 64 or self.tile_m % h
                                   for h in self.epi_heights):
      raise ValueError(f"SearchStructure.epi_heights={self.epi_heights}: multiples of 64 "
                       f"that divide tile_m={self.tile_m}")
    # the tile and grid fields, as GemmConfig checks them (each width is checked where
    # a candidate is made, against the problem's column group)
    self.config(epi_tile_n=self.tile_n)

  def config(self, **rest) -> g.GemmConfig:
    """A ``GemmConfig`` of this structure, with ``rest`` (K step, stages, ...)."""
    return g.GemmConfig(schedule=self.schedule, tile_m=self.tile_m, tile_n=self.tile_n,
                        wg_dim=self.wg_dim, cluster_dim=self.cluster_dim,
                        grid_minor_dim=self.grid_minor_dim,
                        grid_tile_width=self.grid_tile_width, **rest)


def candidates(m: int, n: int, k: int, dtype, input_kinds: dict, input_dtypes: dict,
               outputs: tuple, *, trans_a: bool, trans_b: bool, min_epi_tile_n: int = 1,
               max_stages: int = 7, extra: bool = False, clip_m: bool = False,
               tile_m: int | None = None, tile_n: int | None = None
               ) -> tuple[list[g.GemmConfig], list[tuple[str, str]]]:
  """The search space for one problem.

  Each tile structure of the search (both schedules; 128 x 128, 192 x 128 and 128 x 192
  warpgroup tiles; clustered along M, N or not at all; the grid walked N- or M-minor) is
  tried with epilogue sub-tiles 64 or 32 columns wide (a multiple of the column group;
  sub-tiles wider than 64 also with their tile outputs stored in halves:
  ``gemm_mgpu.store_widths``), with tile operands staged 2 sub-tiles ahead or 1, each
  at the deepest pipeline that fits in shared memory. Each such config is also tried in
  the variants that free shared memory for one more stage: one staging slot per output
  (``_deeper_with_one_output_slot``), that with the slot waited for after the program
  (``GemmConfig.epi_store_wait_late``), and 64-wide sub-tiles stored in 32-wide halves
  (``_deeper_in_halves``). A program with column partials also tries each config
  carrying them down the warpgroup tile (``GemmConfig.epi_column_sums_per_tile``). A
  pass (K = 0) tries unclustered cooperative tiles with sub-tiles up to 128 rows tall,
  each also loading the next tile's operands under the current one
  (``GemmConfig.epi_prefetch_next_tile``). GEMMs keep 64-row sub-tiles. ``extra`` adds
  bands of 8, tile_k 32 and tile operands staged 4 sub-tiles ahead or all of them
  during the mainloop. 192-row tiles tile M = 16384 only with ``clip_m``; 192-wide
  ones (192-row cooperative ones) need N (M) a multiple of 192. Why these structures
  and not others: ``docs/tuning.md#the-search-space``.

  Args:
    m: rows of A and of the product.
    n: columns of B and of the product.
    k: the contraction size; 0 for an epilogue pass.
    dtype: the operands' dtype.
    input_kinds: operand name -> ``epilogue.InputKind`` of the operands the kernel
      stages in shared memory (``gemm_mgpu.staged_inputs``).
    input_dtypes: operand name -> dtype.
    outputs: the program's declared outputs (``epilogue.EpilogueOutput``).
    trans_a: A is stored transposed, as (K, M).
    trans_b: B is stored transposed, as (N, K).
    min_epi_tile_n: the column group: epilogue sub-tile widths are made a multiple of
      it.
    max_stages: the most pipeline stages a candidate may have.
    extra: also search the wider space above.
    clip_m: ``gemm``'s: M need not be a multiple of the config's cluster tile.
    tile_m: keep only the structures whose ``tile_m`` is this; None keeps all.
    tile_n: keep only the structures whose ``tile_n`` is this; None keeps all.

  Returns:
    ``(configs, skipped)``: the candidate configs, and ``(description, reason)`` for
    each variant left out because its epilogue width does not fit, its config is
    invalid or does not tile the problem, or no stage count fits in shared memory.
  """
  M_, N_ = g.MatDim.M, g.MatDim.N
  PP, CO = g.Schedule.PINGPONG, g.Schedule.COOPERATIVE
  # Left out, having never won where measured: 64-row or 64-column and 64 x 256
  # warpgroup tiles; tile_k 32, bands of 8 and every tile operand sub-tile staged during
  # the mainloop only with ``extra`` (docs/tuning.md#the-search-space).
  S = SearchStructure
  structures = [S(CO, 128, 128, M_, N_, N_), S(CO, 128, 128, M_, None, N_),
                S(PP, 128, 128, M_, N_, N_), S(PP, 128, 128, M_, M_, M_),
                S(PP, 128, 128, M_, N_, M_, epi_widths=(32,)),
                S(PP, 128, 128, M_, M_, N_, epi_widths=(32,)),
                S(PP, 192, 128, M_, N_, N_, epi_widths=(32,)),
                S(PP, 192, 128, M_, N_, M_, epi_widths=(32,)),
                S(PP, 128, 192, M_, M_, N_), S(PP, 128, 192, M_, N_, N_),
                S(PP, 128, 192, M_, N_, M_, epi_widths=(32,)),
                S(CO, 128, 192, M_, M_, N_), S(CO, 128, 192, M_, N_, N_),
                S(CO, 192, 128, M_, N_, N_)]
  if k == 0:  # an epilogue pass: unclustered cooperative tiles (gemm_mgpu._no_product_config)
    # With no mainloop to hide a sub-tile's load and store latency under, sub-tiles as
    # tall as the warpgroup tile halve their count
    # (docs/tuning.md#epilogue-sub-tile-shapes).
    structures = [S(CO, 128, 128, M_, None, N_, epi_heights=(64, 128)),
                  S(CO, 64, 128, M_, None, N_),
                  S(CO, 128, 128, N_, None, N_, epi_heights=(64, 128))]
  if extra:
    structures += [dataclasses.replace(s, grid_tile_width=8) for s in structures]
  if tile_m is not None:
    structures = [s for s in structures if s.tile_m == tile_m]
  if tile_n is not None:
    structures = [s for s in structures if s.tile_n == tile_n]
  mn_major = trans_a or not trans_b
  tile_ks = (64,) if mn_major or not extra else (64, 32)
  has_tiles = any(kind in g._TILE_KINDS for kind in input_kinds.values())
  found, skipped, seen = [], [], set()
  for st, tk, em, en, depth in (
      (s, tk, em, en, sl) for s in structures for tk in tile_ks for em in s.epi_heights
      for en in s.epi_widths
      for sl in ((1, 2, 4, None) if has_tiles and extra else (1, 2) if has_tiles else (2,))):
    tn = st.tile_n
    en = max(min(en, tn), min_epi_tile_n)
    subtiles = (st.tile_m // em) * (tn // en)
    slots = subtiles if depth is None else min(depth, max(2, subtiles))
    for store_n in g.store_widths(en):
      store = f"/{store_n}" if store_n else ""
      cl = st.cluster_dim.name if st.cluster_dim else "-"
      name = (f"{st.schedule.value} {st.tile_m}x{tn}x{tk} wg{st.wg_dim.name} cl{cl} "
              f"{st.grid_minor_dim.name}{st.grid_tile_width} e{em}x{en}{store} in{slots}")
      if name in seen:
        continue
      seen.add(name)
      why = None
      if tn % en or en % min_epi_tile_n:
        why = f"epilogue width {en} does not fit tile_n {tn} and column group {min_epi_tile_n}"
      best = None
      if not why:
        try:
          cfg = st.config(tile_k=tk, stages=max_stages, epi_tile_m=em, epi_tile_n=en,
                          epi_operand_slots=slots, epi_store_n=store_n)
          g._check_tiling(m, n, k, cfg, trans_a, trans_b, clip_m)
          best = g.deepest_fitting(cfg, dtype, input_kinds, input_dtypes, outputs,
                                   mainloop=k > 0)
        except ValueError as e:
          why = str(e)
      if best is not None:
        these = [best]
        deeper = _deeper_with_one_output_slot(best, dtype, input_kinds, input_dtypes,
                                              outputs, max_stages) if k else None
        if deeper is not None:
          # and with its one slot waited for after the program (epi_store_wait_late)
          these += [deeper, dataclasses.replace(deeper, epi_store_wait_late=True)]
        halves = _deeper_in_halves(best, dtype, input_kinds, input_dtypes, outputs,
                                   max_stages) if k else None
        if halves is not None:
          these.append(halves)
        if k == 0:  # a pass: also with the next tile's operands loaded under this one
          nxt = _prefetching_next_tile(best, dtype, input_kinds, input_dtypes, outputs)
          if nxt is not None:
            these.append(nxt)
        if g.can_carry_column_sums(best, outputs):
          # column partials carried down the tile: fewer cross-warp sums, same memory
          these += [dataclasses.replace(c, epi_column_sums_per_tile=True) for c in these]
        found += these
      else:
        skipped.append((name, why or "no stage count fits in shared memory"))
  return found, skipped


def _deeper_with_one_output_slot(cfg, dtype, input_kinds, input_dtypes, outputs,
                                 max_stages):
  """``cfg`` with one staging slot per whole-stored output (``epi_out_slots=1``) and the
  deepest pipeline that then fits, or None where that buys no stage. At the same depth
  one slot runs level with two, so it is a candidate only where the shared memory it
  frees buys a stage; with the stage it won on some programs and lost on others, so
  the tuner times both (``docs/tuning.md#output-slots``)."""
  return _deeper_with(cfg, dtype, input_kinds, input_dtypes, outputs, max_stages,
                      epi_out_slots=1)


def _deeper_with(cfg, dtype, input_kinds, input_dtypes, outputs, max_stages, **changes):
  """``cfg`` with ``changes`` and the deepest pipeline that then fits, or None where the
  changes buy no stage (the variants that free shared memory are only worth timing
  where they deepen the pipeline)."""
  deeper = g.deepest_fitting(dataclasses.replace(cfg, **changes, stages=max_stages),
                             dtype, input_kinds, input_dtypes, outputs)
  return deeper if deeper is not None and deeper.stages > cfg.stages else None


def _deeper_in_halves(cfg, dtype, input_kinds, input_dtypes, outputs, max_stages):
  """``cfg``'s 64-wide sub-tiles with their tile outputs stored in 32-wide halves
  (``epi_store_n=32``) and the deepest pipeline that then fits, or None where that buys
  no stage. Halves of one dtype share one staging ring (``gemm_mgpu._part_rings``), so a
  program writing two tile outputs stages 2 halves instead of 2 x 2 whole sub-tiles.
  ``gemm_mgpu.store_widths`` offers halves only for sub-tiles wider than 64 (a 128-wide
  head); here they are a candidate where they deepen the pipeline. The extra stage won
  in ping-pong tiles and lost in cooperative ones, so the tuner times both
  (``docs/tuning.md#outputs-stored-in-parts``)."""
  if cfg.epi_store_n is not None or cfg.epi_tile_n != 64:
    return None
  return _deeper_with(cfg, dtype, input_kinds, input_dtypes, outputs, max_stages,
                      epi_store_n=32)


def _prefetching_next_tile(cfg, dtype, input_kinds, input_dtypes, outputs):
  """``cfg`` with ``epi_prefetch_next_tile``, or None where its slots do not divide the
  sub-tiles or its second row and column buffers do not fit."""
  try:
    nxt = dataclasses.replace(cfg, epi_prefetch_next_tile=True)
  except ValueError:
    return None
  return g.deepest_fitting(nxt, dtype, input_kinds, input_dtypes, outputs, mainloop=False)


def _random_like(key, sds):
  if jnp.issubdtype(sds.dtype, jnp.integer):
    return jax.random.randint(key, sds.shape, 0, 64, sds.dtype)
  return jax.random.normal(key, sds.shape, jnp.float32).astype(sds.dtype)


def measure_ms(fn, *args, iterations: int = 20) -> float:
  """Median CUPTI time of all kernels ``fn`` launches, in ms.

  Args:
    fn: the function to time (``jax.jit``-wrapped unless it is jitted or compiled
      already), called as ``fn(*args)``: once untimed, then ``iterations`` times.
    *args: ``fn``'s arguments.
    iterations: how many timed calls.

  Returns:
    The median over the timed calls of the summed time of the kernels each launched,
    in milliseconds.

  Raises:
    RuntimeError: if CUPTI recorded no kernels.
  """
  from jax.experimental.mosaic.gpu import profiler
  _, timings = profiler.measure(fn, aggregate=False, iterations=iterations)(*args)
  if timings is None:
    raise RuntimeError("CUPTI recorded no kernels")
  if iterations == 1:
    timings = [timings]
  return statistics.median(sum(t for _, t in it) for it in timings)


# The search's final round (``final_round``). One pass times each candidate once (the
# median of ``iterations`` calls), and the fastest of one pass is partly the luckiest:
# the leaders are often closer than timing one config again moves it. So the leaders,
# those within ``FINAL_WINDOW`` of the fastest (at most ``FINALISTS``, plus the config
# to keep), are timed ``FINAL_ROUNDS`` more times, in turn, and the choice is made among
# them on their medians. That settles the search's own noise, not every difference
# between timings, so bench/tune_gemm.py also keeps the config serving a problem unless
# another is faster by more than its margin (docs/tuning.md#the-final-round).
FINALISTS = 4
FINAL_ROUNDS = 2
FINAL_WINDOW = 0.03


def final_round(times: dict, time_fn: Callable[[g.GemmConfig], float], *,
                keep: g.GemmConfig | None = None, finalists: int = FINALISTS,
                rounds: int = FINAL_ROUNDS, window: float = FINAL_WINDOW,
                log: Callable[[str], None] = print) -> dict:
  """Times the leaders of a first pass again and returns their settled times.

  Args:
    times: config -> ms of the first pass.
    time_fn: times one config again (ms).
    keep: a config that ``pick_best`` is to keep within its margin: a finalist too where
      it is within ``window``, so that it is compared on settled times.
    finalists: at most this many of the fastest, besides ``keep``.
    rounds: how many more times each finalist is timed. The rounds go through the
      finalists in turn, so a drift in clock or temperature falls on each alike.
    window: only configs within this fraction of the fastest first time are finalists.
    log: where each finalist's times go.

  Returns:
    finalist -> the median of its first time and its ``rounds`` more. The choice is made
    among these alone: a config outside them has only its first, luckiest-of-one time.
  """
  fastest = min(times.values())
  near = [c for c in sorted(times, key=times.get) if times[c] <= fastest * (1 + window)]
  leaders = near[:finalists]
  if keep in near and keep not in leaders:
    leaders.append(keep)
  samples = {c: [times[c]] for c in leaders}
  for _ in range(rounds if len(leaders) > 1 else 0):  # a lone leader has no rival
    for c in leaders:
      samples[c].append(time_fn(c))
  settled = {c: statistics.median(s) for c, s in samples.items()}
  if len(leaders) > 1:
    log(f"  final round, median of {rounds + 1} timings each:")
    for c in sorted(settled, key=settled.get):
      log(f"  {settled[c]:.4f} ms  {c.describe()}  ("
          + ", ".join(f"{t:.4f}" for t in samples[c]) + ")")
  return settled


def pick_best(times: dict, keep: g.GemmConfig | None = None, keep_within: float = 0.0):
  """The fastest config of ``times`` (config -> ms), unless ``keep`` was timed and is
  within ``keep_within`` (a fraction) of it: then ``keep``. A challenge keeps the
  current config against a difference smaller than the timings' spread.

  Args:
    times: config -> time in ms.
    keep: the config to keep within ``keep_within``, e.g. the one serving the problem
      now; None for none.
    keep_within: a fraction: ``keep`` is chosen where its time is at most
      ``1 + keep_within`` times the fastest.

  Returns:
    ``keep`` where it is in ``times`` and within ``keep_within`` of the fastest; else
    the fastest config of ``times`` (the first in ``times``' order on a tie).
  """
  best = min(times, key=times.get)
  if keep is not None and keep in times and times[keep] <= times[best] * (1 + keep_within):
    return keep
  return best


def search_configs(problem: Problem, configs: list[g.GemmConfig] | None = None, *,
                   extra: bool = False, keep: g.GemmConfig | None = None,
                   log: Callable[[str], None] = print
                   ) -> tuple[list[g.GemmConfig], g.GemmConfig | None, list[tuple[str, str]]]:
  """The configs ``tune`` times for ``problem``, and so the kernels it compiles (which
  ``bench.tune_gemm --lower-only`` lowers beforehand on another machine).

  Args:
    problem: the recorded problem.
    configs, extra, keep: as ``tune``'s.
    log: where a missing heuristic default is said.

  Returns:
    ``(configs, default, skipped)``: the heuristic default first where it is not among
    them, then ``keep`` likewise, then ``configs`` (default ``problem.candidates(extra)``);
    the default (None where no heuristic config tiles the problem); and the search's
    skipped ``(description, why)`` pairs.
  """
  skipped = []
  if configs is None:
    configs, skipped = problem.candidates(extra=extra)
  if keep is not None and keep not in configs:
    configs = [keep] + list(configs)
  try:
    default = problem.default_config()
    if default not in configs:
      configs = [default] + list(configs)
  except ValueError as e:
    default = None
    log(f"  no default config: {e}")
  return list(configs), default, skipped


def tune(problem: Problem, *, iterations: int = 20, log: Callable[[str], None] = print,
         configs: list[g.GemmConfig] | None = None, compile_threads: int = 12,
         extra: bool = False, keep: g.GemmConfig | None = None,
         keep_within: float = 0.0) -> dict:
  """Times every candidate config of ``problem`` (``configs``, default the whole
  search of ``candidates``), ``keep`` and the heuristic default on the device, then the
  leaders again (``final_round``); returns the cache record: the best finalist
  (``pick_best``: ``keep`` where it is within ``keep_within`` of the fastest), its
  settled time, the heuristic default's time and what was skipped and why.

  Args:
    problem: the recorded problem.
    iterations: calls per timing (``measure_ms``).
    log: where each time, each skipped config with its reason and the final round go.
    configs: the configs to time; default ``problem.candidates(extra=extra)``, whose
      skipped variants are logged.
    compile_threads: how many threads compile the configs in parallel.
    extra: search ``candidates``' wider space; used only where ``configs`` is None.
    keep: a config to time as well, and to choose where it is a finalist within
      ``keep_within`` of the fastest settled time (``pick_best``); None for none.
    keep_within: a fraction of the fastest time (``pick_best``).

  Returns:
    The cache record: ``"config"`` the chosen config (``config_to_dict``),
    ``"describe"`` its description, ``"ms"`` its settled time, ``"default_ms"`` the
    heuristic default's time (settled where it was a finalist; None where it has no
    default or the default failed), ``"default"`` the default's description or None,
    ``"timed"`` how many configs ran, ``"finalists"`` how many the final round
    settled, ``"skipped"`` how many were left out by the search or failed to compile
    or run (their reasons go to ``log``), and ``"search_s"`` the seconds spent
    compiling and timing (to 0.1 s). Times are in ms, rounded to 5 decimals.

  Raises:
    RuntimeError: if no config compiled and ran.
  """
  key = problem.key
  configs, default, skipped = search_configs(problem, configs, extra=extra, keep=keep,
                                             log=log)
  for name, why in skipped:
    log(f"  skip {name}: {why}")
  a, b, ops = problem.random_inputs()

  def build(cfg):
    return problem.jitted(cfg).lower(a, b, ops).compile()

  t0 = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(compile_threads) as pool:
    futures = {cfg: pool.submit(build, cfg) for cfg in configs}
  compiled = {}

  def time_one(cfg):
    return measure_ms(compiled[cfg], a, b, ops, iterations=iterations)

  times = {}
  for cfg, fut in futures.items():
    try:
      compiled[cfg] = fut.result()
      times[cfg] = time_one(cfg)
    except Exception as e:  # noqa: BLE001  a failing candidate is logged, never chosen
      first = (str(e).strip().splitlines() or [""])[0][:300]
      log(f"  skip {cfg.describe()}: {type(e).__name__}: {first}")
      skipped.append((cfg.describe(), f"{type(e).__name__}: {first}"))
      continue
    log(f"  {times[cfg]:.4f} ms  {cfg.describe()}"
        + ("  (default)" if cfg == default else ""))
  if not times:
    raise RuntimeError(f"no candidate config ran for {key.text()}")
  settled = final_round(times, time_one, keep=keep, log=log)
  best = pick_best(settled, keep, keep_within)
  times.update(settled)
  return {"config": config_to_dict(best), "describe": best.describe(),
          "ms": round(times[best], 5),
          "default_ms": round(times[default], 5) if default in times else None,
          "default": default.describe() if default else None,
          "timed": len(times), "finalists": len(settled), "skipped": len(skipped),
          "search_s": round(time.perf_counter() - t0, 1)}


__all__ = ["CACHE_ENV", "Problem", "ProblemKey", "SHIPPED_CACHE", "candidates",
           "chosen_config", "describe_workload",
           "config_from_dict", "config_to_dict", "lookup", "lookup_with_source", "measure_ms",
           "FINALISTS", "FINAL_ROUNDS", "FINAL_WINDOW", "SAME_CHIP", "final_round",
           "pick_best", "plain_problem", "problem_key", "same_chip_kinds",
           "record", "recording", "search_configs", "signature", "store", "tune",
           "user_cache_path"]
