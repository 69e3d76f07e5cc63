"""Column layouts for pairwise epilogues, to and from the standard ones.

Standard gated weights are ``[gate | up]``: (K, 2F), gate columns first. The kernel pairs
column j with j + P inside blocks of 2P columns, so the blocked layout interleaves
P-column chunks: [gate[0:P], up[0:P], gate[P:2P], up[P:2P], ...]. Rotate-half RoPE heads
of size 2P already satisfy the kernel's pairing, so Q/K weights need no permutation.

Whole layers: ``llama_layer_to_kernel`` / ``kernel_layer_to_llama`` convert a standard
Llama layer to and from the kernel layout (fused [q | k | v], pair-blocked [gate | up]),
exactly (bitwise) both ways. Meta's original checkpoints use interleaved RoPE (columns 2j,
2j+1 of a head pair up); their q/k columns are permuted within each head into rotate-half
order, which leaves every attention score q . k unchanged. ``shifted_params`` and
``post_params`` assemble the per-block param dicts of ``blocks`` from converted layers.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp


def _check(n: int, block: int, what: str):
  if block <= 0 or n % (2 * block):
    raise ValueError(f"{what}: width {n} must be a positive multiple of 2*block={2 * block}")


def gate_up_to_blocked(w: jax.Array, block: int) -> jax.Array:
  """[gate | up] (..., 2F) -> kernel pair-blocked layout (..., 2F)."""
  n = w.shape[-1]
  _check(n, block, "gate_up_to_blocked")
  gate, up = w[..., :n // 2], w[..., n // 2:]
  lead = w.shape[:-1]
  chunks = jnp.stack([gate.reshape(*lead, -1, block), up.reshape(*lead, -1, block)], axis=-2)
  return chunks.reshape(*lead, n)


def blocked_to_gate_up(w: jax.Array, block: int) -> jax.Array:
  """Inverse of ``gate_up_to_blocked``."""
  n = w.shape[-1]
  _check(n, block, "blocked_to_gate_up")
  lead = w.shape[:-1]
  chunks = w.reshape(*lead, -1, 2, block)
  return jnp.concatenate([chunks[..., 0, :].reshape(*lead, -1),
                          chunks[..., 1, :].reshape(*lead, -1)], axis=-1)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama 3.1/3.2's RoPE frequency scaling (``rope_type: "llama3"`` in a Hugging Face
  config), for contexts beyond the one the model was first trained at.

  With wavelength w = 2 pi / f of a base frequency f and L = ``original_context``:
  w > L / ``low_freq_factor`` (slow rotations): f / ``factor``; w < L /
  ``high_freq_factor`` (fast ones): f unchanged; between them, f times a linear blend of
  1 / factor and 1 in s = (L / w - low_freq_factor) / (high_freq_factor -
  low_freq_factor): (1 - s) / factor + s.
  """
  factor: float
  low_freq_factor: float
  high_freq_factor: float
  original_context: int

  def __post_init__(self):
    if not self.factor >= 1:
      raise ValueError(f"RopeScaling.factor={self.factor} must be >= 1")
    if not 0 < self.low_freq_factor < self.high_freq_factor:
      raise ValueError(f"RopeScaling: need 0 < low_freq_factor={self.low_freq_factor} < "
                       f"high_freq_factor={self.high_freq_factor}")
    if self.original_context <= 0:
      raise ValueError(f"RopeScaling.original_context={self.original_context} must be "
                       "positive")

  def apply(self, inv_freqs: jax.Array) -> jax.Array:
    """The scaled frequencies (fp32) of base frequencies ``inv_freqs``."""
    f = inv_freqs.astype(jnp.float32)
    wavelength = 2 * math.pi / f
    ratio = self.original_context / wavelength  # context lengths per wavelength
    s = jnp.clip((ratio - self.low_freq_factor)
                 / (self.high_freq_factor - self.low_freq_factor), 0.0, 1.0)
    return f * ((1 - s) / self.factor + s)


def rope_inv_freqs(head_dim: int, theta: float, scaling: RopeScaling | None = None):
  """The head_dim / 2 rotation frequencies theta**(-2j / head_dim), scaled if asked."""
  inv = theta ** (-jnp.arange(head_dim // 2, dtype=jnp.float32) * 2 / head_dim)
  return inv if scaling is None else scaling.apply(inv)


def rope_freqs(n: int, head_dim: int, theta: float = 10000.0,
               passthrough_heads=(), scaling: RopeScaling | None = None) -> jax.Array:
  """The (n,) ``freqs`` operand of ``Rotate(block=head_dim // 2)`` for rotate-half heads:
  columns j and j + head_dim/2 of each head both get theta**(-2j / head_dim) (with
  ``scaling`` applied). Heads listed in ``passthrough_heads`` get 0 and pass unrotated
  (V heads of a fused QKV)."""
  if head_dim % 2 or n % head_dim:
    raise ValueError(f"rope_freqs: head_dim={head_dim} must be even and divide n={n}")
  inv = rope_inv_freqs(head_dim, theta, scaling)
  per_head = jnp.tile(jnp.concatenate([inv, inv]), (n // head_dim, 1))
  rotated = ~jnp.isin(jnp.arange(n // head_dim), jnp.asarray(passthrough_heads, jnp.int32))
  return (per_head * rotated[:, None]).reshape(n)


# ---- whole layers ------------------------------------------------------------------------
ROPE_CONVENTIONS = ("rotate_half", "interleaved")
_MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def interleaved_to_rotate_half(w: jax.Array, head_dim: int) -> jax.Array:
  """(..., H*hd) interleaved-RoPE head columns (2j pairs with 2j+1) -> rotate-half order
  (j pairs with j + hd/2): each head's columns become [0, 2, ..., hd-2, 1, 3, ..., hd-1]."""
  lead, n = w.shape[:-1], w.shape[-1]
  w = w.reshape(*lead, n // head_dim, head_dim // 2, 2)
  return jnp.swapaxes(w, -1, -2).reshape(*lead, n)


def rotate_half_to_interleaved(w: jax.Array, head_dim: int) -> jax.Array:
  """Inverse of ``interleaved_to_rotate_half``."""
  lead, n = w.shape[:-1], w.shape[-1]
  w = w.reshape(*lead, n // head_dim, 2, head_dim // 2)
  return jnp.swapaxes(w, -1, -2).reshape(*lead, n)


def _check_layer(layer, want, what):
  """want: key -> (shape, symbolic shape). Exact key set and shapes, else ValueError."""
  missing, extra = sorted(set(want) - set(layer)), sorted(set(layer) - set(want))
  if missing or extra:
    raise ValueError(f"{what}: missing keys {missing}, unexpected keys {extra}; "
                     f"expected exactly {sorted(want)}")
  for k, (shape, names) in want.items():
    got = tuple(jnp.shape(layer[k]))
    if got != shape:
      raise ValueError(f"{what}: {k} has shape {got}, expected {shape} = {names}")


def _dims2(layer, key, names, what):
  if key not in layer:
    raise ValueError(f"{what}: missing key {key!r}")
  shape = tuple(jnp.shape(layer[key]))
  if len(shape) != 2:
    raise ValueError(f"{what}: {key} has shape {shape}, expected a 2-D {names} matrix")
  return shape


def _check_rope(rope, head_dim, what):
  if rope not in ROPE_CONVENTIONS:
    raise ValueError(f"{what}: rope={rope!r}, expected one of {ROPE_CONVENTIONS}")
  if head_dim <= 0 or head_dim % 2:
    raise ValueError(f"{what}: head_dim={head_dim} must be positive and even")


def llama_layer_to_kernel(layer: dict, *, n_q_heads: int, n_kv_heads: int, head_dim: int,
                          block: int = 32, rope: str = "rotate_half",
                          transposed: bool = False) -> dict:
  """A standard Llama layer -> the kernel layout.

  ``layer`` (weights (in, out), a layer is x @ W): ``wq`` (D, Hq*hd), ``wk`` and ``wv``
  (D, Hkv*hd), ``wo`` (Hq*hd, D), ``w_gate`` and ``w_up`` (D, F), ``w_down`` (F, D),
  ``attn_norm`` and ``mlp_norm`` (D,). ``transposed=True``: the seven matrices are stored
  (out, in), as PyTorch / Hugging Face ``nn.Linear`` weights.

  Returns (always (in, out)): ``wqkv`` (D, (Hq + 2 Hkv) hd) = [q | k | v], ``wo``
  (Hq*hd, D), ``w13`` (D, 2F) = ``gate_up_to_blocked([gate | up], block)``, ``w2`` (F, D),
  ``g_attn`` and ``g_mlp`` (D,): the key set of ``blocks.SHIFTED_KEYS``, all of one layer
  (``shifted_params`` pairs a layer's MLP with the next layer's attention).

  ``rope``: "rotate_half" (Hugging Face: column j of a head pairs with j + hd/2) passes
  q/k through; "interleaved" (Meta's original checkpoints: columns 2j, 2j+1 pair) permutes
  the q and k columns of every head into rotate-half order (``interleaved_to_rotate_half``).
  The kernel's q and k then come out in that order; as q and k are permuted alike, the
  scores q . k and so attention are unchanged, and v is untouched.
  """
  what = "llama_layer_to_kernel"
  _check_rope(rope, head_dim, what)
  a, b = _dims2(layer, "w_gate", "(F, D)" if transposed else "(D, F)", what)
  d, f = (b, a) if transposed else (a, b)
  q, kv = n_q_heads * head_dim, n_kv_heads * head_dim
  want = {"wq": ((d, q), ("D", "Hq*hd")), "wk": ((d, kv), ("D", "Hkv*hd")),
          "wv": ((d, kv), ("D", "Hkv*hd")), "wo": ((q, d), ("Hq*hd", "D")),
          "w_gate": ((d, f), ("D", "F")), "w_up": ((d, f), ("D", "F")),
          "w_down": ((f, d), ("F", "D")), "attn_norm": ((d,), ("D",)),
          "mlp_norm": ((d,), ("D",))}
  if transposed:
    want.update({k: (want[k][0][::-1], want[k][1][::-1]) for k in _MATRICES})
  _check_layer(layer, {k: (s, "(" + ", ".join(n) + ")") for k, (s, n) in want.items()}, what)
  if block <= 0 or f % block:
    raise ValueError(f"{what}: w_gate/w_up width F={f} must be a multiple of block={block}")
  w = {k: jnp.asarray(v) for k, v in layer.items()}
  if transposed:
    w.update({k: w[k].T for k in _MATRICES})
  wq, wk = w["wq"], w["wk"]
  if rope == "interleaved":
    wq, wk = interleaved_to_rotate_half(wq, head_dim), interleaved_to_rotate_half(wk, head_dim)
  return {"wqkv": jnp.concatenate([wq, wk, w["wv"]], axis=1), "wo": w["wo"],
          "w13": gate_up_to_blocked(jnp.concatenate([w["w_gate"], w["w_up"]], axis=1), block),
          "w2": w["w_down"], "g_attn": w["attn_norm"], "g_mlp": w["mlp_norm"]}


def kernel_layer_to_llama(layer: dict, *, n_q_heads: int, n_kv_heads: int, head_dim: int,
                          block: int = 32, rope: str = "rotate_half",
                          transposed: bool = False) -> dict:
  """Exact inverse of ``llama_layer_to_kernel`` (same arguments): a kernel-layout layer
  (``wqkv``, ``wo``, ``w13``, ``w2``, ``g_attn``, ``g_mlp``; shapes there) -> the
  standard Llama layer, q/k columns restored to ``rope``'s order, matrices (out, in)
  if ``transposed``."""
  what = "kernel_layer_to_llama"
  _check_rope(rope, head_dim, what)
  d, f2 = _dims2(layer, "w13", "(D, 2F)", what)
  f, q, kv = f2 // 2, n_q_heads * head_dim, n_kv_heads * head_dim
  _check_layer(layer, {"wqkv": ((d, q + 2 * kv), "(D, (Hq + 2 Hkv) hd)"),
                       "wo": ((q, d), "(Hq*hd, D)"), "w13": ((d, 2 * f), "(D, 2F)"),
                       "w2": ((f, d), "(F, D)"), "g_attn": ((d,), "(D,)"),
                       "g_mlp": ((d,), "(D,)")}, what)
  if block <= 0 or f % block:
    raise ValueError(f"{what}: w13 width 2F={2 * f} must be a multiple of 2*block={2 * block}")
  w = {k: jnp.asarray(v) for k, v in layer.items()}
  wq, wk, wv = w["wqkv"][:, :q], w["wqkv"][:, q:q + kv], w["wqkv"][:, q + kv:]
  if rope == "interleaved":
    wq, wk = rotate_half_to_interleaved(wq, head_dim), rotate_half_to_interleaved(wk, head_dim)
  gate_up = blocked_to_gate_up(w["w13"], block)
  out = {"wq": wq, "wk": wk, "wv": wv, "wo": w["wo"], "w_gate": gate_up[:, :f],
         "w_up": gate_up[:, f:], "w_down": w["w2"], "attn_norm": w["g_attn"],
         "mlp_norm": w["g_mlp"]}
  if transposed:
    out.update({k: out[k].T for k in _MATRICES})
  return out


def shifted_params(layer: dict, next_layer: dict) -> dict:
  """Kernel-layout layers i and i + 1 -> ``blocks.shifted_block`` params of block i:
  layer i's ``wo``, ``g_mlp``, ``w13``, ``w2`` and layer i + 1's ``g_attn``, ``wqkv``."""
  return {**{k: layer[k] for k in ("wo", "g_mlp", "w13", "w2")},
          "g_attn": next_layer["g_attn"], "wqkv": next_layer["wqkv"]}


def post_params(layer: dict, g_final: jax.Array, wlm: jax.Array) -> dict:
  """The last kernel-layout layer, final norm g_final (D,) and LM head wlm (D, V) ->
  ``blocks.post_block`` params. (Hugging Face ``lm_head.weight`` is (V, D): pass its .T)"""
  return {**{k: layer[k] for k in ("wo", "g_mlp", "w13", "w2")},
          "g_final": g_final, "wlm": wlm}


def qkv_freqs(n_q_heads: int, n_kv_heads: int, head_dim: int, theta: float,
              rope_scaling: RopeScaling | None = None) -> jax.Array:
  """Per-column RoPE frequencies of a fused [q | k | v] projection (v columns get 0)."""
  heads = n_q_heads + 2 * n_kv_heads
  v_heads = range(n_q_heads + n_kv_heads, heads)
  return rope_freqs(heads * head_dim, head_dim, theta, passthrough_heads=tuple(v_heads),
                    scaling=rope_scaling)
