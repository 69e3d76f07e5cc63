"""QK-norm inside the QKV projection's epilogue, before RoPE (as Qwen3, OLMo 2, Gemma 3).

    qkv = rmsnorm_qkv_qknorm_rope(h, r, wqkv, positions, q_norm_w, k_norm_w, ...)

u = r * (h @ wqkv) in the kernel layout [q heads | k heads | v heads] of rotate-half
heads (``layout.py``). Every q and every k head is RMS-normalised over its own head_dim
columns and scaled by ``q_norm_w`` or ``k_norm_w`` (one (head_dim,) weight per kind,
shared by all its heads); then RoPE rotates q and k. v passes as projected.

Forward, one GEMM: ``[ScaleRow r, Store u, HeadRmsNorm, Rotate, Store qkv]``. The
epilogue sub-tile holds whole heads (``HeadRmsNorm.column_group``), so each head's
statistic is a reduction inside one sub-tile and never leaves the chip.

Backward (derivation: ``docs/qk_norm_math.md``): one elementwise pass over (M, N)
tiles, an epilogue program with no GEMM (``qk_norm_grad``, ``epilogue_gemm.epilogue_pass``:
``[AddTile dqkv, Rotate by -angle, HeadRmsNormGrad, Store du]``, with the norm weights'
column sums and dr as partials), since no GEMM of the backward produces the (M, N)
cotangent tile; then the input norm's GEMMs dh = r * (du @ wqkv^T), dwqkv = (r h)^T du.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from coda_jax import block_gemms as S
from coda_jax import dispatch
from coda_jax import layout
from coda_jax import primitives as P
from coda_jax.fused_ops import check_act, check_heads, check_rows, check_weight, flat_rows
from coda_jax.epilogue_gemm import epilogue_pass, gemm_epilogue
from coda_jax.sharding import reduce_like
from pallas_kernels import EpilogueOutput, InputKind, OutputKind

# The widest epilogue sub-tile the kernel's tilings offer (a warpgroup tile's N): a head
# must fit in one, whole, so head_dim must divide it.
KERNEL_MAX_HEAD_DIM = 128


def _inv_rms(xb, eps):
  """rsqrt(mean(xb^2) + eps) over each row of one head's columns xb (rows, head_dim): the
  forward's statistic, which the backward recomputes."""
  return jax.lax.rsqrt(jnp.sum(xb * xb, axis=1) * (1.0 / xb.shape[1]) + eps)


@dataclasses.dataclass(frozen=True)
class HeadRmsNorm(P.Primitive):
  """Per head (each ``head_dim``-wide column block): x -> x * w[n] * rsqrt(mean(x^2) +
  eps) on heads whose ``normed`` column operand is 1, x -> x * w[n] where it is 0 (v
  heads ride through with w = 1).

  ``weight`` and ``normed`` are (N,) fp32 column operands; ``normed`` is 0 or 1 and the
  same across a head. The mean runs over the head's columns, which one sub-tile holds
  whole (``column_group``)."""
  _keeps_zero_rows = True  # a zero head stays zero (eps > 0 keeps rsqrt finite)
  _column_sums_via_env = True
  weight: str
  normed: str
  head_dim: int
  eps: float

  def __post_init__(self):
    if self.head_dim <= 0 or self.head_dim % 8:
      raise ValueError(f"HeadRmsNorm.head_dim={self.head_dim} must be a positive multiple "
                       "of 8")
    if not self.eps > 0:
      raise ValueError(f"HeadRmsNorm.eps={self.eps} must be > 0")

  def inputs(self):
    return {self.weight: InputKind.COL, self.normed: InputKind.COL}

  def column_group(self):
    return self.head_dim

  def apply(self, x, env):
    # Every head runs the norm, and a 0/1 mask per column makes pass-through heads exact.
    # (A branch per head, as ``HeadRmsNormGrad`` takes, made this GEMM slower: its
    # epilogue is hidden under the other warpgroup's mainloop anyway;
    # docs/tuning.md#branches-per-head.)
    w = env.load(self.weight).astype(jnp.float32)
    sel = env.load(self.normed).astype(jnp.float32)
    d = self.head_dim
    out = []
    for i in range(0, x.shape[1], d):
      xb = x[:, i:i + d]
      rstd = _inv_rms(xb, self.eps)
      y = xb * w[None, i:i + d]
      ys = y * sel[None, i:i + d]  # y on normed heads, 0 on pass-through ones: exact
      out.append((y - ys) + ys * rstd[:, None])
    return P._join(out)


@dataclasses.dataclass(frozen=True)
class HeadRmsNormGrad(P.Primitive):
  """dy -> du, the backward of ``HeadRmsNorm`` per head (``docs/qk_norm_math.md`` §2):
  du = rho (dn - n <dn, n> / d) with n = rho u, dn = dy * w on normed heads, du = dy * w
  on pass-through ones.

  Operands: ``u`` (M, N) tile, the saved pre-norm input; ``weight`` and ``normed`` as
  the forward's. Each head branches once on ``normed`` at its first column
  (``Env.cond``), so a pass-through head runs none of the norm's math
  (``docs/tuning.md#branches-per-head``). Stores column partials of dy * n (``dweight``: the
  norm weights' gradient, per column) and row partials of <du, u> (``udu``: the input
  norm's dr term)."""
  _keeps_zero_rows = True  # dy = u = 0 gives du = 0 and zero partials (eps > 0)
  _column_sums_via_env = True
  u: str
  weight: str
  normed: str
  head_dim: int
  eps: float
  dweight: str
  udu: str

  def __post_init__(self):
    HeadRmsNorm(self.weight, self.normed, self.head_dim, self.eps)  # the same checks

  def inputs(self):
    return {self.u: InputKind.TILE, self.weight: InputKind.COL, self.normed: InputKind.COL}

  def outputs(self, width):
    return (EpilogueOutput(self.dweight, OutputKind.COL_PARTIAL, jnp.float32),
            EpilogueOutput(self.udu, OutputKind.ROW_PARTIAL, jnp.float32))

  def column_group(self):
    return self.head_dim

  def _normed_head(self, ub, dyb, wb):
    """(n, du, <du, u>) of a normed head: u, dy (rows, head_dim) and w (1, head_dim)."""
    d = self.head_dim
    rho = _inv_rms(ub, self.eps)[:, None]
    n = ub * rho
    dn = dyb * wb
    c = jnp.sum(dn * n, axis=1) * (1.0 / d)
    du = (dn - n * c[:, None]) * rho
    return n, du, jnp.sum(du * ub, axis=1)

  def _passed_head(self, ub, dyb, wb):
    """The same of a pass-through head: n = u, du = dy * w."""
    du = dyb * wb
    return ub, du, jnp.sum(du * ub, axis=1)

  def _head(self, env, col, ub, dyb, wb):
    """One head's (n, du, <du, u>), the head starting at column ``col`` of the value: a
    branch on its ``normed`` flag, read at that column."""
    return env.cond(env.column_value(self.normed, col) != 0, self._normed_head,
                    self._passed_head, ub, dyb, wb)

  def apply(self, dy, env):
    u = env.load(self.u).astype(jnp.float32)
    w = env.load(self.weight).astype(jnp.float32)
    d = self.head_dim
    ns, dus = [], []
    udu = 0.0
    for i in range(0, dy.shape[1], d):
      n, du, udu_head = self._head(env, i, u[:, i:i + d], dy[:, i:i + d], w[None, i:i + d])
      udu = udu + udu_head
      ns.append(n)
      dus.append(du)
    env.store_column_sum(self.dweight, dy * P._join(ns))
    env.store(self.udu, udu)
    return P._join(dus)

  def finish(self, raw):
    return {self.dweight: jnp.sum(raw[self.dweight], axis=0),
            self.udu: jnp.sum(raw[self.udu], axis=0)}


def head_norm_columns(q_norm_w, k_norm_w, n_q_heads, n_kv_heads):
  """The (N,) fp32 ``weight`` and ``normed`` operands of ``HeadRmsNorm`` for a fused
  [q | k | v]: q_norm_w tiled over the q heads, k_norm_w over the k heads, 1 on v;
  ``normed`` 1 on q and k, 0 on v.

  Args:
    q_norm_w: (head_dim,) the q heads' norm weight, any float dtype (taken in fp32);
      its length sets head_dim.
    k_norm_w: (head_dim,) the k heads' norm weight, likewise.
    n_q_heads: the number of q heads.
    n_kv_heads: the number of k heads, and of v heads.

  Returns:
    (weight, normed), each (N,) fp32 with N = (n_q_heads + 2 n_kv_heads) * head_dim,
    in the layout [q heads | k heads | v heads]: ``weight`` is q_norm_w repeated per q
    head, k_norm_w per k head, then 1 on every v column; ``normed`` is 1 on the q and k
    columns and 0 on the v columns.
  """
  hd = q_norm_w.shape[0]
  weight = jnp.concatenate([jnp.tile(q_norm_w.astype(jnp.float32), n_q_heads),
                            jnp.tile(k_norm_w.astype(jnp.float32), n_kv_heads),
                            jnp.ones((n_kv_heads * hd,), jnp.float32)])
  normed = jnp.concatenate([jnp.ones(((n_q_heads + n_kv_heads) * hd,), jnp.float32),
                            jnp.zeros((n_kv_heads * hd,), jnp.float32)])
  return weight, normed


def forward_program(head_dim, eps, dtype):
  """The forward epilogue: u = r * acc stored (the backward's input), per-head RMSNorm,
  RoPE, qkv stored. Operands: r, pos, freqs, qk_w, qk_sel.

  Args:
    head_dim: columns per head; a positive multiple of 16 (``HeadRmsNorm`` and
      ``Rotate``, whose block is head_dim // 2, raise ValueError otherwise).
    eps: the QK-norm's epsilon (> 0).
    dtype: the dtype u and qkv are stored in.

  Returns:
    The program ``[ScaleRow("r"), Store("u", dtype), HeadRmsNorm("qk_w", "qk_sel",
    head_dim, eps), Rotate("pos", "freqs", head_dim // 2), Store("qkv", dtype)]``. Its
    operands: "r" (M,) the row scale, "pos" (M,) token positions, "freqs" (N,)
    per-column RoPE frequencies, "qk_w" and "qk_sel" (N,) fp32 (``head_norm_columns``'s
    weight and normed). Its outputs: "u" and "qkv", (M, N) in ``dtype``.
  """
  return [P.ScaleRow("r"), P.Store("u", dtype), HeadRmsNorm("qk_w", "qk_sel", head_dim, eps),
          P.Rotate("pos", "freqs", head_dim // 2), P.Store("qkv", dtype)]


def norm_qknorm_rope(h, r, w, positions, freqs, weight, normed, head_dim, eps, impl):
  """The forward GEMM (``forward_program``). Returns (qkv, u).

  Args:
    h: (M, D) normed-input activations, bfloat16 or float16 (float32 runs the XLA
      program).
    r: (M,) the input RMSNorm's reciprocal RMS per row (fp32).
    w: (D, N) the [q | k | v] projection of rotate-half heads, in h's dtype, with
      N = (Hq + 2 Hkv) * head_dim.
    positions: (M,) token positions, int32 or float (``Rotate``'s operand).
    freqs: (N,) fp32 per-column RoPE frequencies, 0 on the v columns
      (``layout.qkv_freqs``).
    weight, normed: (N,) fp32 ``head_norm_columns`` operands.
    head_dim, eps: as ``forward_program``.
    impl: as ``coda_jax.gemm_epilogue``.

  Returns:
    (qkv, u), each (M, N) in h's dtype: qkv is r * (h @ w) with each q and k head
    RMS-normalised, scaled by ``weight`` and rotated (RoPE), the v heads unchanged;
    u is r * (h @ w) itself, the pre-norm projection the backward reads
    (``qk_norm_grad``).
  """
  out = gemm_epilogue(h, w, forward_program(head_dim, eps, h.dtype),
                      {"r": r, "pos": positions, "freqs": freqs, "qk_w": weight,
                       "qk_sel": normed}, impl=impl)
  return out["qkv"], out["u"]


def backward_program(head_dim, eps, dtype, row_scaled=False):
  """The backward pass's program (no GEMM: ``epilogue_gemm.epilogue_pass``): dqkv in, RoPE^T (a
  rotation by the negated angle), the per-head norm backward, du stored. Operands:
  dqkv, pos, neg_freqs, u, qk_w, qk_sel.

  Args:
    head_dim, eps: as ``forward_program``.
    dtype: the dtype du is stored in.
    row_scaled: du is stored times the operand "r" (M,) per row (a ``ScaleRow`` before
      the store; "udu" is of the unscaled du).

  Returns:
    The program ``[AddTile("dqkv"), Rotate("pos", "neg_freqs", head_dim // 2),
    HeadRmsNormGrad("u", "qk_w", "qk_sel", head_dim, eps, "dweight", "udu"),
    Store("du", dtype)]``. Its operands: "dqkv" and "u" (M, N) tiles, "pos" (M,) token
    positions, "neg_freqs" (N,) the negated forward frequencies, "qk_w" and "qk_sel"
    (N,) fp32 as ``forward_program``'s. Its outputs: "du" (M, N) in ``dtype``, the
    cotangent of u; "dweight" (N,) fp32, the norm weights' gradient per column (summed
    over rows); "udu" (M,) fp32, <du, u> per row (``HeadRmsNormGrad``).
  """
  scale = [P.ScaleRow("r")] if row_scaled else []
  return [P.AddTile("dqkv"), P.Rotate("pos", "neg_freqs", head_dim // 2),
          HeadRmsNormGrad("u", "qk_w", "qk_sel", head_dim, eps, "dweight", "udu"), *scale,
          P.Store("du", dtype)]


def qk_norm_grad(dqkv, u, positions, freqs, weight, normed, head_dim, eps, impl, r=None):
  """The per-head backward (``docs/qk_norm_math.md``), one elementwise pass over (M, N)
  tiles (``backward_program``).

  Args:
    dqkv: (M, N) cotangent of the op's output.
    u: (M, N) the saved pre-norm projection r * (h @ wqkv).
    positions, freqs, weight, normed: the forward's operands; head_dim, eps its
      constants.
    impl: as ``coda_jax.gemm_epilogue``.
    r: optional (M,) fp32 row scale: du is returned times r per row (the cotangent that
      ``block_gemms.norm_input_grad_row_scaled`` takes); <du, u> stays unscaled.

  Returns:
    (du (M, N) in u's dtype, dweight (N,) fp32 column sums over rows, <du, u> (M,) fp32).
  """
  operands = {"dqkv": dqkv, "pos": positions, "neg_freqs": -freqs, "u": u, "qk_w": weight,
              "qk_sel": normed}
  if r is not None:
    operands["r"] = r
  out = epilogue_pass(backward_program(head_dim, eps, u.dtype, r is not None), operands,
                      impl=impl)
  return out["du"], out["dweight"], out["udu"]


def _check_norm_weight(name, w, head_dim):
  if not jnp.issubdtype(w.dtype, jnp.floating):
    raise ValueError(f"{name}.dtype={w.dtype}: norm weights must be floating point")
  if tuple(w.shape) != (head_dim,):
    raise ValueError(f"{name} has shape {tuple(w.shape)}, expected ({head_dim},) = "
                     "(head_dim,): one weight per head dimension, shared by every head of "
                     "its kind (as Qwen3's q_norm / k_norm)")


def check_head_dim_tiles(head_dim, impl):
  """A head must fit whole in one epilogue sub-tile when only kernels may run."""
  names = dispatch.resolve(impl)
  if "xla" not in names and KERNEL_MAX_HEAD_DIM % head_dim:
    raise ValueError(f"head_dim={head_dim}: the per-head norm needs a whole head in one "
                     f"epilogue sub-tile, so head_dim must divide {KERNEL_MAX_HEAD_DIM} for "
                     f"impl={names}; use head_dim 16, 32, 64 or 128, or an impl that "
                     "includes 'xla' (e.g. 'auto')")


def rmsnorm_qkv_qknorm_rope(h, r, wqkv, positions, q_norm_w, k_norm_w, *, n_q_heads: int,
                            n_kv_heads: int, head_dim: int, eps: float, theta: float,
                            rope_scaling: layout.RopeScaling | None = None,
                            impl: str = "auto"):
  """RoPE(per-head RMSNorm(r * (h @ wqkv))) on q and k; v as projected.

  Args:
    h: (..., D) normed-input activations (``residual_rmsnorm``'s h), bfloat16 or float16
      (float32 runs the XLA program).
    r: (...) the input RMSNorm's reciprocal RMS per row.
    wqkv: (D, (Hq + 2 Hkv) * head_dim), [q | k | v] rotate-half heads.
    positions: (...) integer token positions.
    q_norm_w, k_norm_w: (head_dim,) QK-norm weights, each shared by the heads of its kind.
    n_q_heads, n_kv_heads, head_dim: the head layout (head_dim a multiple of 16).
    eps: the QK-norm's epsilon (> 0).
    theta, rope_scaling: RoPE base and optional Llama 3 frequency scaling.
    impl: as ``coda_jax.gemm_epilogue``.

  Returns:
    (..., (Hq + 2 Hkv) * head_dim) in h's dtype.

  Raises:
    ValueError: bad shapes or dtypes, a head_dim the kernel's sub-tile cannot hold whole
      (kernel-only ``impl``), or eps <= 0.
  """
  check_act("h", h)
  check_heads(n_q_heads, n_kv_heads, head_dim)  # before wqkv, whose shape they define
  check_head_dim_tiles(head_dim, impl)
  n = (n_q_heads + 2 * n_kv_heads) * head_dim
  check_weight("wqkv", wqkv, (h.shape[-1], n))
  check_rows("r", r, h.shape[:-1], "float")
  check_rows("positions", positions, h.shape[:-1], "int")
  _check_norm_weight("q_norm_w", q_norm_w, head_dim)
  _check_norm_weight("k_norm_w", k_norm_w, head_dim)
  if not eps > 0:
    raise ValueError(f"eps={eps} must be > 0 (an all-zero head would divide by zero)")
  lead = h.shape[:-1]
  qkv = _qknorm(flat_rows(h), r.reshape(-1).astype(jnp.float32), wqkv,
                positions.reshape(-1).astype(jnp.int32), q_norm_w, k_norm_w,
                (n_q_heads, n_kv_heads, head_dim, float(theta), rope_scaling, float(eps)),
                impl)
  return qkv.reshape(*lead, -1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _qknorm(h, r, wqkv, positions, q_norm_w, k_norm_w, heads, impl):
  return _qknorm_fwd(h, r, wqkv, positions, q_norm_w, k_norm_w, heads, impl)[0]


def _operands(q_norm_w, k_norm_w, heads):
  n_q, n_kv, hd, theta, scaling, _ = heads
  return (layout.qkv_freqs(n_q, n_kv, hd, theta, scaling),
          *head_norm_columns(q_norm_w, k_norm_w, n_q, n_kv))


def _qknorm_fwd(h, r, wqkv, positions, q_norm_w, k_norm_w, heads, impl):
  freqs, weight, normed = _operands(q_norm_w, k_norm_w, heads)
  qkv, u = norm_qknorm_rope(h, r, wqkv.astype(h.dtype), positions, freqs, weight, normed,
                            heads[2], heads[5], impl)
  # u (pre-norm) replaces the plain op's saved qkv: the same memory, and it gives the
  # backward both the per-head rstd and the normalised heads (docs/qk_norm_math.md §3).
  return qkv, (h, r, wqkv, positions, q_norm_w, k_norm_w, u)


def _qknorm_bwd(heads, impl, saved, dqkv):
  h, r, wqkv, positions, q_norm_w, k_norm_w, u = saved
  n_q, n_kv, hd, _, _, eps = heads
  freqs, weight, normed = _operands(q_norm_w, k_norm_w, heads)
  # du comes back times r per row, so neither GEMM below scales: r * (du @ wqkv^T) and
  # (r h)^T du = h^T (r du) (docs/row_scaled_cotangent.md)
  dur, dweight, udu = qk_norm_grad(dqkv, u, positions, freqs, weight, normed, hd, eps,
                                   impl, r=r)
  dq_w = dweight[:n_q * hd].reshape(n_q, hd).sum(axis=0)  # summed over the q heads
  dk_w = dweight[n_q * hd:(n_q + n_kv) * hd].reshape(n_kv, hd).sum(axis=0)  # and k heads
  dur = dur.astype(h.dtype)
  dh = S.input_grad(dur, wqkv.astype(h.dtype), impl)
  dw = S.weight_grad(h, dur, impl, S.grad_dtype(wqkv))
  return (dh, udu / r, reduce_like(dw, wqkv).astype(wqkv.dtype), None,
          reduce_like(dq_w, q_norm_w).astype(q_norm_w.dtype),
          reduce_like(dk_w, k_norm_w).astype(k_norm_w.dtype))


_qknorm.defvjp(_qknorm_fwd, _qknorm_bwd)

__all__ = ["HeadRmsNorm", "HeadRmsNormGrad", "KERNEL_MAX_HEAD_DIM", "backward_program",
           "forward_program", "head_norm_columns", "norm_qknorm_rope", "qk_norm_grad",
           "rmsnorm_qkv_qknorm_rope"]
