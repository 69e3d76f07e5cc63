"""Epilogue primitives: scale, accumulate, pairwise, reduce, store.

A program is a sequence of primitives applied, in order, to a running fp32 value that
starts as the GEMM accumulator. Each primitive has one ``apply`` written against a small
``Env`` interface, so the *same code* runs on a kernel sub-tile (through
``pallas_kernels.EpilogueTile``) and on the whole (M, N) matrix in the jnp reference:
the reference is the definition, the kernel is an evaluation strategy.

Column-pair layout (pairwise primitives): columns are grouped in blocks of 2*P; within a
block, column j (j < P) pairs with column j + P. For SwiGLU, P gate columns are followed
by the P matching up columns; for RoPE with rotate-half heads, P = head_dim / 2 and a
block is one head. ``layout.py`` converts standard weights to and from this layout.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Protocol, Sequence

import jax
import jax.numpy as jnp

from pallas_kernels import EpilogueOutput, InputKind, OutputKind


class Env(Protocol):
  """What a primitive may touch: operands (by kind), outputs, column indices."""
  def column_ids(self) -> jax.Array: ...  # global column of each accumulator element
  def load(self, name: str) -> jax.Array: ...
  def store(self, name: str, value: jax.Array) -> None: ...
  def column_sum(self, x: jax.Array) -> jax.Array: ...  # over rows: (rows, w) -> (w,)
  # store(name, column_sum(x)) for a column-partial output, except that the kernel may
  # add x to the sub-tiles below it first and sum once (GemmConfig.epi_column_sums_per_tile)
  def store_column_sum(self, name: str, x: jax.Array) -> None: ...
  # names output ``name`` as sum_k B[k, n], the GEMM's B operand summed over K (N,): the
  # kernel's mainloop makes it, the XLA implementation sums B
  def b_column_sum(self, name: str) -> None: ...
  # column operand ``name`` at column ``col`` (a Python int) of the value this step sees:
  # a scalar, one value for the whole sub-tile in the kernel
  def column_value(self, name: str, col: int) -> jax.Array: ...
  # if_true(*args) where the scalar ``pred`` holds, else if_false(*args); both return
  # arrays of the same shapes. The kernel runs only the branch taken (``pred`` is the same
  # across the sub-tile: a ``column_value`` test), the XLA implementation runs both and
  # selects, so each must be finite wherever the other is taken. Whether a branch pays
  # depends on the kernel: measure (docs/tuning.md#branches-per-head).
  def cond(self, pred: jax.Array, if_true, if_false, *args): ...


@dataclasses.dataclass(frozen=True)
class Primitive:
  def inputs(self) -> dict[str, InputKind]:
    return {}

  def outputs(self, width: float) -> tuple[EpilogueOutput, ...]:
    """``width``: the running value's width relative to N when this step runs."""
    return ()

  def width_factor(self) -> float:  # how this primitive scales the value's width
    return 1

  def column_group(self) -> int | None:
    """Columns that must stay in one sub-tile (a pairwise step's 2P-wide block)."""
    return None

  def apply(self, x: jax.Array, env: Env) -> jax.Array:
    raise NotImplementedError

  def finish(self, raw: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """User-facing results from this step's raw kernel outputs (partials reduced)."""
    return {}

  def column_index_operands(self) -> tuple[str, ...]:
    """Row operands holding column indices (compared with ``Env.column_ids``): a call
    on a column shard must shift them by the shard's first column."""
    return ()

  def keeps_zero_rows(self) -> bool:
    """True when a zero accumulator row, with zero row and tile operands, stays zero and
    stores zeros (so rows padded onto M add nothing to column sums). Default False: a
    step that adds a constant (a bias) must not claim it."""
    return self._keeps_zero_rows

  _keeps_zero_rows = False  # a class attribute (not a dataclass field): set True to claim

  def column_sums_via_env(self) -> bool:
    """True when ``apply`` sums over rows only through ``env.column_sum`` or
    ``env.store_column_sum``, never with ``jnp.sum(x, axis=0)`` itself. In the kernel
    such sums share one scratch buffer across the two compute warpgroups: when every
    step of a program says True, the warpgroups take turns around each sum and run the
    rest of their epilogues at once; otherwise around the whole epilogue. Default False
    (always correct); the library's primitives say True."""
    return self._column_sums_via_env

  _column_sums_via_env = False  # a class attribute: set True to claim

  def combine_over_shards(self) -> dict[str, str]:
    """How each finished output of a call split over shards combines into the whole:
    "sum" for a partial sum (row sums over column shards, column sums over row shards),
    "logsumexp" for a log-sum-exp, "whole_per_row_shard" for a column output that each
    shard of the rows computes whole (``BColumnSum``: nothing to combine). Tile outputs
    are not listed: they are split."""
    return {o.name: "sum" for o in self.outputs(1)
            if o.kind in (OutputKind.ROW_PARTIAL, OutputKind.COL_PARTIAL)}


# ---- scale -----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ScaleConst(Primitive):
  """x * c for a Python constant c (folded into the kernel)."""
  _keeps_zero_rows = True
  _column_sums_via_env = True
  value: float

  def apply(self, x, env):
    return x * jnp.float32(self.value)


@dataclasses.dataclass(frozen=True)
class ScaleRow(Primitive):
  """x * r[m]; ``name`` is an (M,) operand (e.g. RMSNorm's reciprocal RMS)."""
  _keeps_zero_rows = True
  _column_sums_via_env = True
  name: str

  def inputs(self):
    return {self.name: InputKind.ROW}

  def apply(self, x, env):
    return x * env.load(self.name).astype(jnp.float32)[:, None]


@dataclasses.dataclass(frozen=True)
class ScaleCol(Primitive):
  """x * g[n]; ``name`` is an (N,) operand. A runtime scalar is passed as a
  broadcast (N,) operand (see ``ops.scalar_operand``)."""
  _keeps_zero_rows = True
  _column_sums_via_env = True
  name: str

  def inputs(self):
    return {self.name: InputKind.COL}

  def apply(self, x, env):
    return x * env.load(self.name).astype(jnp.float32)[None, :]


# ---- accumulate ------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class AddBias(Primitive):
  """x + b[n]; ``name`` is an (N,) fp32 column operand (a linear layer's bias; the LM
  head's pad-column mask, ``fused_ops.pad_vocab``).

  Its gradient is the column sum of the output's cotangent (a ``ColSum`` in the GEMM that
  produces the cotangent). A bias moves a zero row, so it does not claim
  ``keeps_zero_rows`` (rows padded onto M would add b to column sums)."""
  _column_sums_via_env = True
  name: str

  def inputs(self):
    return {self.name: InputKind.COL}

  def apply(self, x, env):
    return x + env.load(self.name).astype(jnp.float32)[None, :]


@dataclasses.dataclass(frozen=True)
class AddTile(Primitive):
  """x + t[m, n]; ``name`` is an (M, N) operand (a residual, or the previous value of
  an output being accumulated into)."""
  _keeps_zero_rows = True
  _column_sums_via_env = True
  name: str

  def inputs(self):
    return {self.name: InputKind.TILE}

  def apply(self, x, env):
    return x + env.load(self.name).astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class MulTile(Primitive):
  """x * (offset + scale * t[m, n]); ``name`` is an (M, N) operand (a saved activation
  slope: GPT-2's MLP backward multiplies da by the gelu'(z) its forward stored).

  ``scale`` and ``offset`` decode a tile stored as an affine code: a uint8 operand t
  stands for offset + scale * t (GPT-2's slope: ``layernorm_ops.slope_multiplier``). The
  defaults (1, 0) read the operand as it is."""
  _keeps_zero_rows = True  # a zero row stays zero whatever the operand holds
  _column_sums_via_env = True
  name: str
  scale: float = 1.0
  offset: float = 0.0

  def __repr__(self):  # without the code when unset: the tuning cache's program names
    code = ("" if (self.scale, self.offset) == (1.0, 0.0)
            else f", scale={self.scale!r}, offset={self.offset!r}")
    return f"MulTile(name={self.name!r}{code})"

  def inputs(self):
    return {self.name: InputKind.TILE}

  def apply(self, x, env):
    t = env.load(self.name).astype(jnp.float32)
    if (self.scale, self.offset) != (1.0, 0.0):
      t = jnp.float32(self.offset) + jnp.float32(self.scale) * t
    return x * t


# ---- pairwise --------------------------------------------------------------------------
def _blocks(x, p):
  """Splits the columns into (first, second) halves of each 2p-wide block."""
  n = x.shape[-1]
  return [(x[:, i:i + p], x[:, i + p:i + 2 * p]) for i in range(0, n, 2 * p)]


def _join(parts):
  return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)


_SQRT_2_OVER_PI = math.sqrt(2 / math.pi)


def _silu_and_grad(a):
  s = jax.nn.sigmoid(a)
  return a * s, s * (1 + a * (1 - s))


_GELU_CUBIC = 0.044715


def _gelu_tanh_and_grad(a):
  # gelu(a) = a h with h = (1 + t) / 2, t = tanh(k (a + c a^3)), k = sqrt(2 / pi); and
  # gelu'(a) = h + a (1 - t^2) (k / 2 + 3 k c a^2 / 2). Written as one multiply-add per
  # step (~10 instructions an element with the SFU tanh): GPT-2's LayerNorm + GELU
  # epilogue computes both for every element (docs/tuning.md#gelu-as-multiply-adds).
  k = _SQRT_2_OVER_PI
  a2 = a * a
  t = jnp.tanh(a * (k + (k * _GELU_CUBIC) * a2))
  h = 0.5 + 0.5 * t
  return a * h, h + a * (1 - t * t) * (0.5 * k + (1.5 * k * _GELU_CUBIC) * a2)


# name -> (act(a), (act(a), act'(a)) sharing their work): the one definition of each
# gated activation, for Gated, GatedGrad and the dense references.
ACTIVATIONS = {
    "silu": (lambda a: a * jax.nn.sigmoid(a), _silu_and_grad),
    # tanh form: erf is slower on the SFU and GeGLU checkpoints commonly use it.
    "gelu": (lambda a: jax.nn.gelu(a, approximate=True), _gelu_tanh_and_grad),
}


@dataclasses.dataclass(frozen=True)
class Gated(Primitive):
  """(a, b) -> act(a) * b per column pair; halves the width. act: silu or gelu."""
  _keeps_zero_rows = True
  _column_sums_via_env = True
  block: int
  activation: str = "silu"

  def __post_init__(self):
    if self.activation not in ACTIVATIONS:
      raise ValueError(f"Gated.activation={self.activation!r}: one of {sorted(ACTIVATIONS)}")
    if self.block <= 0 or self.block % 8:
      raise ValueError(f"Gated.block={self.block} must be a positive multiple of 8")

  def width_factor(self):
    return 0.5

  def column_group(self):
    return 2 * self.block

  def apply(self, x, env):
    act = ACTIVATIONS[self.activation][0]
    return _join([act(a) * b for a, b in _blocks(x, self.block)])


_TWO_PI = 6.283185307179586


@dataclasses.dataclass(frozen=True)
class Rotate(Primitive):
  """(a, b) -> (a cos t - b sin t, b cos t + a sin t), t = pos[m] * freq[n], per pair.

  ``positions`` is an (M,) operand (int32 or float; per token, so packed sequences
  work) and ``freqs`` an (N,) fp32 operand: the angular frequency of each column (both
  members of a pair carry the same value; columns with frequency 0 pass unchanged,
  which is how V heads ride through a fused QKV).
  """
  _keeps_zero_rows = True
  _column_sums_via_env = True
  positions: str
  freqs: str
  block: int

  def __post_init__(self):
    if self.block <= 0 or self.block % 8:
      raise ValueError(f"Rotate.block={self.block} must be a positive multiple of 8")

  def inputs(self):
    return {self.positions: InputKind.ROW, self.freqs: InputKind.COL}

  def column_group(self):
    return 2 * self.block

  def apply(self, x, env):
    pos = env.load(self.positions).astype(jnp.float32)
    freq = env.load(self.freqs).astype(jnp.float32)
    p = self.block
    out = []
    for i, (a, b) in enumerate(_blocks(x, p)):
      t = pos[:, None] * freq[None, 2 * p * i:2 * p * i + p]
      # Reduce to [-pi, pi] first: the kernel's fast sin/cos are accurate only there.
      # The fp32 angle itself is already rounded at ~1e-3 rad for t ~ 1e4, so this adds
      # no error beyond what any fp32 RoPE has.
      t = t - _TWO_PI * jnp.round(t * (1 / _TWO_PI))
      c, s = jnp.cos(t), jnp.sin(t)
      out += [a * c - b * s, b * c + a * s]
    return _join(out)


# ---- reduce ----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class RowSum(Primitive):
  """Per-row partial sums of x (or x**2 with ``square``) -> output ``name``."""
  _keeps_zero_rows = True
  _column_sums_via_env = True
  name: str
  square: bool = False

  def outputs(self, width):
    return (EpilogueOutput(self.name, OutputKind.ROW_PARTIAL, jnp.float32),)

  def apply(self, x, env):
    env.store(self.name, jnp.sum(x * x if self.square else x, axis=1))
    return x

  def finish(self, raw):
    return {self.name: jnp.sum(raw[self.name], axis=0)}


@dataclasses.dataclass(frozen=True)
class RowDot(Primitive):
  """Per-row partial inner products <x[m, :], t[m, :]> with an (M, N) tile operand
  ``other`` -> output ``name`` (the cotangent's projection on a saved activation, as a
  norm's backward needs it). The value passes on unchanged."""
  _keeps_zero_rows = True
  _column_sums_via_env = True
  other: str
  name: str

  def inputs(self):
    return {self.other: InputKind.TILE}

  def outputs(self, width):
    return (EpilogueOutput(self.name, OutputKind.ROW_PARTIAL, jnp.float32),)

  def apply(self, x, env):
    env.store(self.name, jnp.sum(x * env.load(self.other).astype(jnp.float32), axis=1))
    return x

  def finish(self, raw):
    return {self.name: jnp.sum(raw[self.name], axis=0)}


@dataclasses.dataclass(frozen=True)
class RowLogSumExp(Primitive):
  """Per-row partial (max, sum exp(x - max)) -> outputs ``name``_max, ``name``_sumexp,
  finished into the row's log-sum-exp ``name``.

  With ``exclude`` (an (M,) int32 column-index operand) and ``rest`` (an output name),
  also the log-sum-exp of the row without that column, from a second partial sum that
  shares the max. The cross-entropy backward needs it: a confident row's target dlogit
  -(1 - p_t) = -exp(rest - lse) keeps its digits, where exp(z_t - lse) - 1 loses them
  to the rounding of lse once 1 - p_t is below lse's last bit (|lse| 2^-24)."""
  _keeps_zero_rows = True
  _column_sums_via_env = True
  name: str
  exclude: str | None = None
  rest: str | None = None

  def __post_init__(self):
    if (self.exclude is None) != (self.rest is None):
      raise ValueError(f"RowLogSumExp: exclude={self.exclude!r} and rest={self.rest!r} go "
                       "together (the column-index operand and the output's name)")

  def inputs(self):
    return {} if self.exclude is None else {self.exclude: InputKind.ROW}

  def outputs(self, width):
    outs = (EpilogueOutput(self.name + "_max", OutputKind.ROW_PARTIAL, jnp.float32),
            EpilogueOutput(self.name + "_sumexp", OutputKind.ROW_PARTIAL, jnp.float32))
    if self.rest is None:
      return outs
    return outs + (EpilogueOutput(self.rest + "_sumexp", OutputKind.ROW_PARTIAL,
                                  jnp.float32),)

  def apply(self, x, env):
    mx = jnp.max(x, axis=1)
    e = jnp.exp(x - mx[:, None])
    env.store(self.name + "_max", mx)
    env.store(self.name + "_sumexp", jnp.sum(e, axis=1))
    if self.rest is not None:
      hit = env.column_ids() == env.load(self.exclude)[:, None]
      env.store(self.rest + "_sumexp", jnp.sum(jnp.where(hit, 0.0, e), axis=1))
    return x

  def column_index_operands(self):
    return () if self.exclude is None else (self.exclude,)

  def finish(self, raw):
    mx = raw[self.name + "_max"]
    out = {self.name: finish_lse(mx, raw[self.name + "_sumexp"])}
    if self.rest is not None:
      out[self.rest] = finish_lse(mx, raw[self.rest + "_sumexp"])
    return out

  def combine_over_shards(self):
    return {self.name: "logsumexp", **({} if self.rest is None else {self.rest: "logsumexp"})}


@dataclasses.dataclass(frozen=True)
class ColSum(Primitive):
  """Per-column partial sums of x over the sub-tile's rows -> output ``name``."""
  _keeps_zero_rows = True
  _column_sums_via_env = True
  name: str

  def outputs(self, width):
    return (EpilogueOutput(self.name, OutputKind.COL_PARTIAL, jnp.float32, width),)

  def apply(self, x, env):
    env.store_column_sum(self.name, x)
    return x

  def finish(self, raw):
    return {self.name: jnp.sum(raw[self.name], axis=0)}


@dataclasses.dataclass(frozen=True)
class BColumnSum(Primitive):
  """Output ``name``: the GEMM's B operand summed over K, sum_k B[k, n] (N,) fp32.

  With ``gemm_epilogue(x, dy, ..., trans_a=True)``, a weight gradient dW = x^T @ dy, that
  is the bias gradient sum_rows dy, which the kernel's mainloop makes from the dy tiles
  it streams anyway (as cuBLASLt's BGRADB epilogue does): no pass over dy of its own.
  The tiles of a column block share the K steps, each running one more small wgmma on
  its share, B's tile against a ones column (``pallas_kernels.OutputKind.B_COLUMN_SUM``). It leaves the running value as it
  is, and may stand anywhere in the program. Sharded, the sums over K's shards are
  added, and each shard of M holds them whole."""
  _keeps_zero_rows = True  # rows padded onto M are rows of A: B's sums do not see them
  _column_sums_via_env = True
  name: str

  def outputs(self, width):
    return (EpilogueOutput(self.name, OutputKind.B_COLUMN_SUM, jnp.float32),)

  def apply(self, x, env):
    env.b_column_sum(self.name)
    return x

  def finish(self, raw):
    return {self.name: jnp.sum(raw[self.name], axis=0)}

  def combine_over_shards(self):
    return {self.name: "whole_per_row_shard"}


@dataclasses.dataclass(frozen=True)
class PickColumn(Primitive):
  """Per-row partial of x[m, index[m]] -> output ``name`` (0 where ``index[m]`` is not a
  column of the sub-tile, so the finished sum is the picked value, or 0 for an index
  outside [0, N), e.g. an ignored target). ``index`` is an (M,) int32 operand. Must run
  before any step that changes the width."""
  _keeps_zero_rows = True
  _column_sums_via_env = True
  index: str
  name: str

  def inputs(self):
    return {self.index: InputKind.ROW}

  def outputs(self, width):
    return (EpilogueOutput(self.name, OutputKind.ROW_PARTIAL, jnp.float32),)

  def apply(self, x, env):
    hit = env.column_ids() == env.load(self.index)[:, None]
    env.store(self.name, jnp.sum(jnp.where(hit, x, 0.0), axis=1))
    return x

  def column_index_operands(self):
    return (self.index,)

  def finish(self, raw):
    return {self.name: jnp.sum(raw[self.name], axis=0)}


# ---- store -----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Store(Primitive):
  """Writes the running value to output ``name`` (M, N / narrowing) in ``dtype``.

  With ``add_to``, a float32 (M, N) tile operand: the output is that operand plus the
  value (an accumulator, e.g. a weight gradient summed over row chunks). Pass
  ``in_place={name: add_to}`` too and the compiled kernel never reads the operand: its
  TMA store adds to the buffer (``pallas_kernels.EpilogueOutput.adds_to``).
  """
  _keeps_zero_rows = True
  _column_sums_via_env = True
  name: str
  dtype: Any = jnp.bfloat16
  add_to: str | None = None

  def __post_init__(self):
    if self.add_to is not None and jnp.dtype(self.dtype) != jnp.float32:
      raise ValueError(f"Store({self.name!r}, add_to={self.add_to!r}): an output that adds "
                       f"to an operand is float32, got dtype={jnp.dtype(self.dtype)}")

  def __repr__(self):  # without add_to when unset: the tuning cache's program names
    add = "" if self.add_to is None else f", add_to={self.add_to!r}"
    return f"Store(name={self.name!r}, dtype={self.dtype!r}{add})"

  def inputs(self):
    return {} if self.add_to is None else {self.add_to: InputKind.TILE}

  def outputs(self, width):
    return (EpilogueOutput(self.name, OutputKind.TILE, jnp.dtype(self.dtype), width,
                           adds_to=self.add_to),)

  def apply(self, x, env):
    env.store(self.name, x)
    return x

  def finish(self, raw):
    return {self.name: raw[self.name]}


def run_program(program, x, env: Env, round_to=None) -> None:
  """Applies ``program`` to ``x``. ``round_to`` rounds the value after every step: the
  unfused-XLA emulation that the tolerance rule compares against."""
  for prim in program:
    x = prim.apply(x, env)
    if round_to is not None:
      x = x.astype(round_to).astype(jnp.float32)


def finish_lse(max_partials: jax.Array, sumexp_partials: jax.Array) -> jax.Array:
  """Combines the column-block partials of ``RowLogSumExp`` into a log-sum-exp per row.

  Args:
    max_partials: (blocks, M) float32, each block's row maximum.
    sumexp_partials: (blocks, M) float32, each block's sum of exp(x - its maximum).

  Returns:
    (M,) float32 log-sum-exp of each row over all blocks.
  """
  mx = jnp.max(max_partials, axis=0)
  return mx + jnp.log(jnp.sum(sumexp_partials * jnp.exp(max_partials - mx), axis=0))


# ---- the tuning cache's name of a program ------------------------------------------------
def _dtype_spelled_once(prim: Primitive) -> Primitive:
  """``prim`` with its dtype fields (``dtype`` and ``*_dtype``) as ``jnp.dtype``s:
  ``jnp.bfloat16``, ``"bfloat16"`` and ``x.dtype`` are one dtype, so they must name one
  program."""
  fixed = {f.name: jnp.dtype(v) for f in dataclasses.fields(prim)
           if f.name == "dtype" or f.name.endswith("_dtype")
           for v in [getattr(prim, f.name)] if v is not None}
  return dataclasses.replace(prim, **fixed) if fixed else prim


def program_column_group(program: Sequence[Primitive]) -> int:
  """The columns a program needs in one piece: the least common multiple of its steps'
  ``column_group()`` (a head, a pair block), 1 when no step has one. The kernel's epilogue
  sub-tile holds a multiple of it; the XLA program runs on blocks of it
  (``dispatch.column_block``)."""
  return math.lcm(1, *(g for prim in program if (g := prim.column_group()) is not None))


def program_id(program: Sequence[Primitive]) -> str:
  """The program as the GEMM tuning cache names it.

  Args:
    program: the epilogue steps.

  Returns:
    Their reprs joined by "+", every dtype spelled one way (``dtype(bfloat16)``,
    ``dtype('float32')``) however it was passed, so that ``Store("y", jnp.bfloat16)``
    finds the config tuned for ``Store("y", x.dtype)``.
  """
  return "+".join(repr(_dtype_spelled_once(p)) for p in program)
