"""A GPT-2-style decoder over the LayerNorm GEMM-epilogue ops.

GPT-2: learned token (``wte``) and position (``wpe``) embeddings; ``n_layers`` pre-LayerNorm
blocks, each

    x1 = x + c_proj(attn(c_attn(LN_1(x))))          (causal multi-head attention, biases)
    x2 = x1 + mlp_proj(gelu(c_fc(LN_2(x1))))         (GELU in its tanh form, biases)

then the final ``LN_f`` and an LM head tied to ``wte``. Matrices are stored (in, out), as
Hugging Face's ``Conv1D`` stores them, so checkpoints convert without transposes.

``fused=True`` runs ``coda_jax.layernorm_ops``, cut at attention as the Llama model is
(``coda_jax.blocks``):

    qkv_0 = c_attn_0(LN_1_0(x))                     LN_1_0's split in XLA, then
                                                    ``layernorm_matmul`` (its bias too)
    for i < L - 1:  x, qkv_{i+1} = shifted(x, attn(qkv_i), layer i's c_proj and MLP,
                                           layer i + 1's LN_1 and c_attn)
    x, LN_f's (mu, r) = the same for the last layer, with LN_f in place of LN_1 and c_attn

* ``shifted`` is one op, ``residual_layernorm_gelu_mlp(..., next_w=)``: c_proj's bias +
  residual add and LN_2's row statistics ride in its epilogue, then LN_2's application +
  c_fc's bias + GELU in one epilogue, mlp_proj's bias + residual + the next LayerNorm's
  statistics in the next, then the next LayerNorm's application + c_attn's bias in
  c_attn's. One op, so that its backward forms LN_2's and the next LN_1's whole input
  gradients each in one GEMM (row totals: ``layernorm_ops.layernorm_input_grad``), with
  no pass over (tokens, D) between.
* attention: ``flax_layers.layers.causal_attention`` (``jax.nn.dot_product_attention``;
  cuDNN on a GPU).

The layers run under ``jax.lax.scan`` with (x, qkv) as the carry, the parameters shifted
by a layer as in the Llama model.

The LM head: LN_f is applied in XLA from the last block's (mu, r) (n = LN(x), the
activations' dtype), then
``coda_jax.fused_ops.rmsnorm_lm_head_loss`` runs on h = n with r = 1 (the norm weight and
bias are already in n): the (tokens, V) logits are never stored, which is where the head's
memory goes (V = 50304). The fused head only has a row scale in its epilogue, not
LayerNorm's mean and bias terms, so folding LN_f into it would need a new op; the extra
XLA pass over (tokens, D) is small next to the (tokens, V) GEMMs.

``fused=False`` runs the same math as plain jnp (``coda_jax.jnp_reference.layer_norm``,
``gpt2_mlp``, ``cross_entropy``) under ordinary autodiff: the reference.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from coda_jax import fused_ops as F
from coda_jax import jnp_reference as ref
from coda_jax import layernorm_ops as L
from coda_jax import unfused
from coda_jax.fused_ops import REDUCTIONS
from coda_jax.sharding import RowSplit
from flax_layers import checkpoint as ck
from flax_layers.config import hf_dtype
from flax_layers import layers as Lyr

_F32 = jnp.float32
IGNORE_INDEX = -100  # the targets the loss skips (fused_ops' default)
_DTYPES = ("bfloat16", "float16", "float32")
_IMPLS = ("auto", "mosaic", "interpret", "xla")
_HF_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")  # both GELU's tanh form


# ---- configuration -----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class GPT2Config:
  """Static hyper-parameters of a GPT-2-style decoder (hashable; validates itself).

  Attributes:
    vocab_size: token embeddings (rows of ``wte``; the tied head's outputs).
    n_positions: learned positions (rows of ``wpe``): the longest sequence.
    d_model: the residual width (Hugging Face ``n_embd``).
    n_layers: blocks (``n_layer``). n_heads: attention heads (``n_head``), dividing
      d_model into heads of ``head_dim`` = d_model / n_heads, a multiple of 16.
    ffn_dim: the MLP's width (``n_inner``); None means 4 * d_model (GPT-2's).
    eps: LayerNorm's epsilon (``layer_norm_epsilon``).
    dtype: activations' compute dtype (bfloat16 or float16 for the kernels; float32
      runs XLA). param_dtype: the stored parameters' (float32: the optimizer's copy).
    init_std: the normal init of matrices and embeddings (c_proj and mlp_proj get
      init_std / sqrt(2 n_layers), GPT-2's residual scaling).
    attention_impl: ``jax.nn.dot_product_attention``'s; None: cuDNN on a GPU for 16-bit
      activations, XLA elsewhere.
    impl: coda_jax kernel dispatch ("auto", "mosaic", "interpret", "xla").
    mlp_residuals: what the fused MLP keeps for its backward
      (``coda_jax.layernorm_gelu_mlp``'s ``residuals``): "slope" (default; gelu(z) and
      gelu'(z), the latter as a one-byte code for bf16: the faster backward) or
      "recompute" (z alone, the least memory).
  """
  vocab_size: int
  n_positions: int
  d_model: int
  n_layers: int
  n_heads: int
  ffn_dim: int | None = None
  eps: float = 1e-5
  dtype: Any = jnp.bfloat16
  param_dtype: Any = jnp.float32
  init_std: float = 0.02
  attention_impl: str | None = None
  impl: str = "auto"
  mlp_residuals: str = L.DEFAULT_MLP_RESIDUALS

  def __post_init__(self):
    if self.ffn_dim is None:
      object.__setattr__(self, "ffn_dim", 4 * self.d_model)
    for name in ("vocab_size", "n_positions", "d_model", "n_layers", "n_heads", "ffn_dim"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
        raise ValueError(f"GPT2Config.{name}={v!r}: must be a positive integer")
    if self.d_model % self.n_heads:
      raise ValueError(f"GPT2Config.d_model={self.d_model} is not divisible by n_heads="
                       f"{self.n_heads}: pick n_heads dividing d_model")
    if self.head_dim % 16:
      raise ValueError(f"GPT2Config: head_dim = d_model / n_heads = {self.head_dim} must be "
                       "a multiple of 16 (e.g. 64, GPT-2's): change d_model or n_heads")
    for name in ("eps", "init_std"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, (int, float)) or not (
          math.isfinite(v) and v > 0):
        raise ValueError(f"GPT2Config.{name}={v!r}: must be a positive finite float")
    for name in ("dtype", "param_dtype"):
      try:
        dt = jnp.dtype(getattr(self, name)).name
      except TypeError:
        dt = None
      if dt not in _DTYPES:
        raise ValueError(f"GPT2Config.{name}={getattr(self, name)!r}: one of {_DTYPES}")
    if self.impl not in _IMPLS:
      raise ValueError(f"GPT2Config.impl={self.impl!r}: one of {_IMPLS}")
    if self.mlp_residuals not in L.MLP_RESIDUALS:
      raise ValueError(f"GPT2Config.mlp_residuals={self.mlp_residuals!r}: one of "
                       f"{L.MLP_RESIDUALS}")

  # The fields bench/train.py prints for any model.
  @property
  def head_dim(self) -> int:
    return self.d_model // self.n_heads

  @property
  def n_q_heads(self) -> int:
    return self.n_heads

  @property
  def n_kv_heads(self) -> int:
    return self.n_heads

  def replace(self, **changes) -> "GPT2Config":
    """A copy with ``changes`` applied (validated again)."""
    return dataclasses.replace(self, **changes)

  def param_count(self) -> int:
    """Parameters of the model (the tied head counted once)."""
    d, f = self.d_model, self.ffn_dim
    layer = d * 3 * d + 3 * d + d * d + d + d * f + f + f * d + d + 4 * d
    return (self.vocab_size + self.n_positions) * d + self.n_layers * layer + 2 * d

  @classmethod
  def from_hf_config(cls, hf: dict, **overrides) -> "GPT2Config":
    """A config from a Hugging Face GPT-2 ``config.json`` (as a dict).

    Args:
      hf: the dict; reads n_embd, n_layer, n_head, n_positions, vocab_size, n_inner,
        layer_norm_epsilon and checks the rest names the model this file implements.
      **overrides: fields Hugging Face does not carry (dtype, impl, ...).

    Returns:
      The config.

    Raises:
      ValueError: a missing size, another model type, an activation other than GELU's
        tanh form, untied embeddings, or attention scaled otherwise than 1/sqrt(head_dim).
    """
    if hf.get("model_type", "gpt2") != "gpt2":
      raise ValueError(f"model_type={hf['model_type']!r}: only GPT-2 checkpoints "
                       "(model_type 'gpt2') are supported here")
    act = hf.get("activation_function", "gelu_new")
    if act not in _HF_ACTIVATIONS:
      raise ValueError(f"activation_function={act!r}: this model computes GELU's tanh form "
                       f"({' or '.join(_HF_ACTIVATIONS)})")
    for key, want in (("tie_word_embeddings", True), ("scale_attn_weights", True),
                      ("scale_attn_by_inverse_layer_idx", False), ("add_cross_attention",
                                                                   False)):
      if bool(hf.get(key, want)) != want:
        raise ValueError(f"{key}={hf[key]!r}: this model implements {key}={want} only")
    missing = [k for k in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head")
               if k not in hf]
    if missing:
      raise ValueError(f"Hugging Face GPT-2 config lacks {missing}")
    fields = dict(vocab_size=hf["vocab_size"], n_positions=hf["n_positions"],
                  d_model=hf["n_embd"], n_layers=hf["n_layer"], n_heads=hf["n_head"],
                  ffn_dim=hf.get("n_inner"),
                  eps=float(hf.get("layer_norm_epsilon", 1e-5)))
    return cls(**(fields | overrides))

  def to_hf_config(self) -> dict:
    """This config as a Hugging Face ``GPT2LMHeadModel`` ``config.json`` dict (dropout
    0: this model has none)."""
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "vocab_size": self.vocab_size, "n_positions": self.n_positions,
            "n_ctx": self.n_positions, "n_embd": self.d_model, "n_layer": self.n_layers,
            "n_head": self.n_heads,
            "n_inner": None if self.ffn_dim == 4 * self.d_model else self.ffn_dim,
            "activation_function": "gelu_new", "layer_norm_epsilon": self.eps,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
            "scale_attn_weights": True, "tie_word_embeddings": True,
            "initializer_range": self.init_std, **hf_dtype(self.param_dtype)}


GPT2_CONFIGS = {
    # Tests and CPU runs: byte-level vocabulary (bench/corpus.py), every matrix dimension
    # a multiple of 64 so the kernels tile.
    "gpt2-tiny": GPT2Config(vocab_size=256, n_positions=512, d_model=256, n_layers=4,
                            n_heads=4),
    # GPT-2 small's shape (124M), the vocabulary 50257 stored padded to 50304 = 393 * 128
    # so the head's GEMMs tile without a copy (a Hugging Face checkpoint loads with
    # vocab_size=50257, which the fused head pads per call: fused_ops.pad_vocab).
    "gpt2-small": GPT2Config(vocab_size=50304, n_positions=1024, d_model=768, n_layers=12,
                             n_heads=12),
}


def get_gpt2_config(name: str, **overrides) -> GPT2Config:
  """A named configuration.

  Args:
    name: a key of ``GPT2_CONFIGS``.
    **overrides: fields to replace.

  Returns:
    The config.
  """
  if name not in GPT2_CONFIGS:
    raise ValueError(f"unknown GPT-2 config {name!r}: one of {sorted(GPT2_CONFIGS)}")
  return GPT2_CONFIGS[name].replace(**overrides)


# ---- the model ---------------------------------------------------------------------------
_VECTORS = ("norm_attn", "norm_attn_bias", "c_attn_bias", "c_proj_bias", "norm_mlp",
            "norm_mlp_bias", "c_fc_bias", "mlp_proj_bias")
_MATRICES = ("c_attn", "c_proj", "c_fc", "mlp_proj")


class GPT2Block(nnx.Module):
  """One GPT-2 block's parameters ((in, out) matrices; names with "norm" or "bias" get no
  weight decay in ``flax_layers.train``): ``norm_attn``/``norm_attn_bias`` (D,) LN_1,
  ``c_attn`` (D, 3D) [q | k | v] + ``c_attn_bias``, ``c_proj`` (D, D) + bias,
  ``norm_mlp``/``norm_mlp_bias`` LN_2, ``c_fc`` (D, F) + bias, ``mlp_proj`` (F, D) + bias.
  Call: x (B, T, D) -> (B, T, D) (``block_forward``)."""

  def __init__(self, config: GPT2Config, *, fused: bool = True, rngs: nnx.Rngs):
    c = config
    d, f, dt = c.d_model, c.ffn_dim, c.param_dtype
    normal = lambda shape, std: nnx.Param(nnx.initializers.normal(std)(rngs.params(), shape,
                                                                       dt))
    ones = lambda n: nnx.Param(jnp.ones((n,), dt))
    zeros = lambda n: nnx.Param(jnp.zeros((n,), dt))
    resid_std = c.init_std / math.sqrt(2 * c.n_layers)
    self.norm_attn, self.norm_attn_bias = ones(d), zeros(d)
    self.c_attn, self.c_attn_bias = normal((d, 3 * d), c.init_std), zeros(3 * d)
    self.c_proj, self.c_proj_bias = normal((d, d), resid_std), zeros(d)
    self.norm_mlp, self.norm_mlp_bias = ones(d), zeros(d)
    self.c_fc, self.c_fc_bias = normal((d, f), c.init_std), zeros(f)
    self.mlp_proj, self.mlp_proj_bias = normal((f, d), resid_std), zeros(d)
    self.config, self.fused = config, fused

  def params(self) -> dict:
    """name -> array (with a leading layer axis when stacked)."""
    return {k: getattr(self, k)[...] for k in _VECTORS + _MATRICES}

  def __call__(self, x):
    return block_forward(self.params(), x, self.config, self.fused)


def _attention(c: GPT2Config):
  heads = (c.n_heads, c.n_heads, c.head_dim)
  return lambda qkv: Lyr.causal_attention(qkv, heads, c.attention_impl)


# A layer's parameters by the op that reads them: LN_1 and c_attn (the attention's input),
# and the rest (``_shifted``: c_proj, LN_2 and the MLP).
_ATTN = ("norm_attn", "norm_attn_bias", "c_attn", "c_attn_bias")
_HALF = ("c_proj", "c_proj_bias", "norm_mlp", "norm_mlp_bias", "c_fc", "c_fc_bias",
         "mlp_proj", "mlp_proj_bias")


def _shifted(p, x, y, c: GPT2Config, next_norm=None, next_attn=None):
  """c_proj of the attention output y, the residual add, LN_2 and the MLP
  (``residual_layernorm_gelu_mlp``), from layer parameters ``p``. Returns x2; with
  ``next_norm`` (a LayerNorm's weight) (x2, h', mu', r') of that norm; with
  ``next_attn`` (the next layer's ``_ATTN`` parameters) (x2, its qkv)."""
  nxt = {}
  if next_attn is not None:
    nxt = dict(next_norm=next_attn["norm_attn"],
               next_norm_bias=next_attn["norm_attn_bias"], next_w=next_attn["c_attn"],
               next_bias=next_attn["c_attn_bias"])
  elif next_norm is not None:
    nxt = dict(next_norm=next_norm)
  return L.residual_layernorm_gelu_mlp(
      y, p["c_proj"], x, p["norm_mlp"], p["norm_mlp_bias"], p["c_fc"], p["c_fc_bias"],
      p["mlp_proj"], p["mlp_proj_bias"], proj_bias=p["c_proj_bias"], eps=c.eps,
      impl=c.impl, residuals=c.mlp_residuals, next_eps=c.eps, **nxt)


def _c_attn(p, x, c: GPT2Config):
  """LN_1 (its split in XLA) and c_attn of x, from a layer's ``_ATTN`` parameters ``p``:
  the one LN_1 that no GEMM's epilogue emits (x is the embedding, or one block alone)."""
  h, mu, r = unfused.layernorm_split(x, p["norm_attn"], c.eps)
  return L.layernorm_matmul(h, mu, r, p["norm_attn"], p["norm_attn_bias"], p["c_attn"],
                            bias=p["c_attn_bias"], impl=c.impl)


def _fused_block(p, x, c: GPT2Config):
  """One block on the fused ops. Returns x2."""
  return _shifted(p, x, _attention(c)(_c_attn(p, x, c)), c)


def block_forward(p, x, c: GPT2Config, fused: bool):
  """One GPT-2 block, fused ops or plain jnp.

  Args:
    p: the block's parameters (``GPT2Block.params`` names; matrices in x's dtype or any
      float dtype, vectors in fp32 or any float dtype).
    x: (B, T, D) the residual stream.
    c: the config. fused: the ``layernorm_ops`` path or the plain-jnp reference.

  Returns:
    (B, T, D) in x's dtype.
  """
  if fused:
    return _fused_block(p, x, c)
  attend = _attention(c)
  dt = x.dtype
  n = ref.layer_norm(x, p["norm_attn"].astype(_F32), p["norm_attn_bias"].astype(_F32), c.eps)
  qkv = n @ p["c_attn"].astype(dt) + p["c_attn_bias"].astype(dt)
  x1 = x + (attend(qkv) @ p["c_proj"].astype(dt) + p["c_proj_bias"].astype(dt))
  mlp = ref.gpt2_mlp(F.flat_rows(x1), p["norm_mlp"].astype(_F32),
                     p["norm_mlp_bias"].astype(_F32), p["c_fc"], p["c_fc_bias"],
                     p["mlp_proj"], p["mlp_proj_bias"], c.eps)
  return mlp.reshape(x1.shape)


class GPT2(nnx.Module):
  """GPT-2-style decoder: ``wte`` (V, D) and ``wpe`` (n_positions, D) embeddings,
  ``layers`` (a ``GPT2Block`` whose parameters have a leading (n_layers,) axis, run under
  ``jax.lax.scan``), final LayerNorm ``norm_f``/``norm_f_bias`` (D,), and the LM head
  tied to ``wte``.

  ``fused`` selects ``coda_jax.layernorm_ops`` (module docstring) or the plain-jnp
  reference of the same math; ``model.set_attributes(fused=...)`` switches a model.
  """

  def __init__(self, config: GPT2Config, *, fused: bool = True, rngs: nnx.Rngs):
    c = config
    init = nnx.initializers.normal(c.init_std)
    self.wte = nnx.Param(init(rngs.params(), (c.vocab_size, c.d_model), c.param_dtype))
    self.wpe = nnx.Param(init(rngs.params(), (c.n_positions, c.d_model), c.param_dtype))

    @nnx.split_rngs(splits=c.n_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def stacked(rngs):
      return GPT2Block(c, fused=fused, rngs=rngs)

    self.layers = stacked(rngs)
    self.norm_f = nnx.Param(jnp.ones((c.d_model,), c.param_dtype))
    self.norm_f_bias = nnx.Param(jnp.zeros((c.d_model,), c.param_dtype))
    self.config, self.fused = config, fused

  def _embed(self, tokens, positions):
    c = self.config
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
      raise ValueError(f"tokens must be (B, T) integers, got {tokens.shape} {tokens.dtype}")
    if positions is None:
      if tokens.shape[1] > c.n_positions:
        raise ValueError(f"sequence length {tokens.shape[1]} exceeds n_positions="
                         f"{c.n_positions}: shorten the sequences or raise n_positions")
      positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32),
                                   tokens.shape)
    elif positions.shape != tokens.shape:
      raise ValueError(f"positions {positions.shape} must match tokens {tokens.shape}")
    for name, ids, n in (("token id", tokens, c.vocab_size),
                         ("position", positions, c.n_positions)):
      if not isinstance(ids, jax.core.Tracer):  # checkable now: refuse bad ids
        ids = np.asarray(ids)  # numpy: a concrete array closed over by a jit traces too
        bad = (ids < 0) | (ids >= n)
        if bad.any():
          at = tuple(int(i) for i in np.argwhere(bad)[0])
          raise ValueError(f"{name} {int(ids[at])} at {at} is outside [0, {n})")
    # Under jit ids cannot be checked: one out of range reads a NaN row ("fill" mode).
    x = (jnp.take(self.wte[...], tokens, axis=0, mode="fill")
         + jnp.take(self.wpe[...], positions, axis=0, mode="fill"))
    return x.astype(c.dtype)

  def _trunk(self, tokens, positions, row_split: RowSplit | None = None):
    """Embeddings and every block. Returns the final residual stream (B, T, D), and on
    the fused path LN_f's statistics (mu, r) of it, which the last block's MLP emits
    (None on the reference path). With ``row_split`` each layer's weights are gathered
    whole as the scan reaches them (``layers.whole_weights``)."""
    c = self.config
    x = self._embed(tokens, positions)
    p = self.layers.params()
    # Matrices in the compute dtype once, before the scan slices them per layer.
    p = {k: (v.astype(c.dtype) if k in _MATRICES else v) for k, v in p.items()}
    whole = lambda tree: Lyr.whole_weights(tree, row_split)  # FSDP: gathered per layer
    if not self.fused:
      x, _ = jax.lax.scan(lambda x, lp: (block_forward(whole(lp), x, c, False), None), x, p)
      return x, None
    # Cut at attention: step i runs layer i's c_proj and MLP, then layer i + 1's LN_1
    # and c_attn (``_shifted``); the last layer's MLP emits LN_f's statistics instead.
    attend = _attention(c)
    qkv = _c_attn(whole({k: p[k][0] for k in _ATTN}), x, c)

    def layer(carry, lp):
      x, qkv = carry
      lp = whole(lp)
      nxt = {k: lp["next_" + k] for k in _ATTN}
      return _shifted(lp, x, attend(qkv), c, next_attn=nxt), None

    shifted = {**{k: p[k][:-1] for k in _HALF},
               **{"next_" + k: p[k][1:] for k in _ATTN}}
    (x, qkv), _ = jax.lax.scan(layer, (x, qkv), shifted)
    last = whole({k: p[k][-1] for k in _HALF})
    norm_f = self.norm_f[...].astype(p["norm_attn"].dtype)
    x, _, mu, r = _shifted(last, x, attend(qkv), c, next_norm=norm_f)
    return x, (mu, r)

  def _final_norm(self, x, stats):
    """LN_f(x) in x's dtype; from (mu, r) where the trunk emitted them."""
    g, beta = self.norm_f[...].astype(_F32), self.norm_f_bias[...].astype(_F32)
    if stats is None:
      return ref.layer_norm(x, g, beta, self.config.eps)
    return unfused.layernorm_apply(x, *stats, g, beta)

  def loss(self, tokens, targets, positions=None, *, reduction: str = "mean",
           row_split: RowSplit | None = None):
    """Next-token cross-entropy of the whole model (the training path).

    Args:
      tokens: (B, T) int token ids.
      targets: (B, T) int; ``-100`` (ignore_index) entries are skipped. A target outside
        [0, V) that is not ``-100`` makes that token's loss NaN (so a mean or sum is NaN),
        on the fused and the reference path alike.
      positions: (B, T) int positions into ``wpe``; default ``arange(T)`` per row.
      reduction: "mean" over the counted targets, "sum", or "none" (per token).
      row_split: a ``coda_jax.sharding.RowSplit`` naming the mesh axis the batch is split
        over under ``jax.jit`` on auto axes (``make_train_step`` passes it by
        default): both paths gather each layer's weights whole as the layer scan
        reaches them, and the fused path runs the LM head per device in one
        ``jax.shard_map``, as ``Llama.loss`` does.

    Returns:
      fp32: a scalar, or (B, T) with ``reduction="none"`` (0 where ignored).
    """
    c = self.config
    if targets.shape != tokens.shape:
      raise ValueError(f"targets {targets.shape} must match tokens {tokens.shape}")
    if reduction not in REDUCTIONS:
      raise ValueError(f"reduction={reduction!r}: one of {REDUCTIONS}")
    n = self._final_norm(*self._trunk(tokens, positions, row_split))
    wte = Lyr.whole_weights(self.wte[...].astype(c.dtype), row_split)
    if self.fused:  # n = LN_f(x) already holds g and beta: the head's row scale is 1
      head = lambda n, targets, wte, red: F.rmsnorm_lm_head_loss(
          n, jnp.ones(n.shape[:-1], _F32), wte, targets, ignore_index=IGNORE_INDEX,
          reduction=red, wlm_layout="vd", impl=c.impl)
      return Lyr.loss_over_rows(head, reduction, (n, targets), (wte,), targets,
                                IGNORE_INDEX, row_split)
    loss = ref.cross_entropy(F.flat_rows(n) @ wte.T, targets.reshape(-1),
                             reduction=reduction)
    return loss.reshape(targets.shape) if reduction == "none" else loss

  def __call__(self, tokens, positions=None):
    """tokens (B, T) int -> fp32 logits (B, T, V) (the head in XLA: inference, checks)."""
    n = self._final_norm(*self._trunk(tokens, positions))
    wte = self.wte[...].astype(n.dtype)
    return jnp.matmul(n, wte.T, preferred_element_type=_F32)


# ---- Hugging Face checkpoints --------------------------------------------------------------
_PREFIX = "transformer."
_HF_LAYER = {"norm_attn": "ln_1.weight", "norm_attn_bias": "ln_1.bias",
             "c_attn": "attn.c_attn.weight", "c_attn_bias": "attn.c_attn.bias",
             "c_proj": "attn.c_proj.weight", "c_proj_bias": "attn.c_proj.bias",
             "norm_mlp": "ln_2.weight", "norm_mlp_bias": "ln_2.bias",
             "c_fc": "mlp.c_fc.weight", "c_fc_bias": "mlp.c_fc.bias",
             "mlp_proj": "mlp.c_proj.weight", "mlp_proj_bias": "mlp.c_proj.bias"}
_HF_TOP = {"wte": "wte.weight", "wpe": "wpe.weight", "norm_f": "ln_f.weight",
           "norm_f_bias": "ln_f.bias"}


def gpt2_hf_keys(config: GPT2Config) -> list[str]:
  """The state-dict names ``gpt2_to_hf_state_dict`` writes (``GPT2LMHeadModel``'s, the
  tied ``lm_head.weight`` left out as ``save_pretrained`` does).

  Args:
    config: the model's config; only ``n_layers`` is read.

  Returns:
    A list of 4 + 12 * n_layers names: ``transformer.wte.weight``,
    ``transformer.wpe.weight``, ``transformer.ln_f.weight`` and
    ``transformer.ln_f.bias``, then for each layer i in order its twelve
    ``transformer.h.{i}.*`` names (``ln_1.weight`` through ``mlp.c_proj.bias``).
  """
  keys = [_PREFIX + v for v in _HF_TOP.values()]
  return keys + [f"{_PREFIX}h.{i}.{n}" for i in range(config.n_layers)
                 for n in _HF_LAYER.values()]


def gpt2_to_hf_state_dict(model: GPT2) -> dict[str, np.ndarray]:
  """The model's parameters as a Hugging Face GPT-2 state dict.

  Args:
    model: a ``GPT2``.

  Returns:
    name -> numpy array in the parameters' dtype, ``GPT2LMHeadModel``'s names
    (``transformer.h.{i}.attn.c_attn.weight`` (D, 3D), ...), Conv1D matrices (in, out).
  """
  out = {_PREFIX + n: getattr(model, k)[...] for k, n in _HF_TOP.items()}
  for k, n in _HF_LAYER.items():
    stacked = getattr(model.layers, k)[...]
    out.update({f"{_PREFIX}h.{i}.{n}": stacked[i] for i in range(model.config.n_layers)})
  return {k: np.asarray(v) for k, v in out.items()}


def _canonical(state_dict):
  """name -> name with the ``transformer.`` prefix (``GPT2Model`` checkpoints, such as
  the hub's ``gpt2``, lack it), attention-mask buffers dropped."""
  names = {}
  for k in state_dict:
    if k.endswith((".attn.bias", ".attn.masked_bias")) and ".h." in f".{k}":
      continue  # the causal-mask buffers older transformers versions saved
    names[k if k.startswith(_PREFIX) or k == "lm_head.weight" else _PREFIX + k] = k
  return names


def gpt2_from_hf_state_dict(model: GPT2, state_dict) -> GPT2:
  """Overwrites ``model``'s parameters with a Hugging Face GPT-2 state dict.

  Args:
    model: a ``GPT2`` whose config matches the checkpoint.
    state_dict: name -> numpy or jax array; ``GPT2LMHeadModel`` names
      (``transformer.h.0.ln_1.weight``) or ``GPT2Model`` ones (``h.0.ln_1.weight``);
      causal-mask buffers (``attn.bias``) are ignored, ``lm_head.weight`` must equal
      ``wte`` (tied).

  Returns:
    ``model``, its parameters cast to ``param_dtype``.

  Raises:
    ValueError: missing or unexpected names, a wrong shape, or an untied head.
  """
  c = model.config
  names = _canonical(state_dict)
  get = lambda name: state_dict[names[name]]
  if "lm_head.weight" in names:
    if not np.array_equal(np.asarray(get("lm_head.weight")),
                          np.asarray(get(_PREFIX + "wte.weight"))):
      raise ValueError("lm_head.weight differs from transformer.wte.weight: this model "
                       "ties its head to the token embedding")
    del names["lm_head.weight"]
  want, have = set(gpt2_hf_keys(c)), set(names)
  if want != have:
    raise ValueError(f"state dict does not match the config: missing {sorted(want - have)[:8]}"
                     f", unexpected {sorted(have - want)[:8]}")

  def put(param, value, name):
    value = jnp.asarray(value)
    if value.shape != param.shape:
      raise ValueError(f"{name} has shape {value.shape}, expected {param.shape} (check "
                       "the config's sizes; Conv1D matrices are stored (in, out))")
    param[...] = value.astype(c.param_dtype)

  for k, n in _HF_TOP.items():
    put(getattr(model, k), get(_PREFIX + n), _PREFIX + n)
  for k, n in _HF_LAYER.items():
    layers = [jnp.asarray(get(f"{_PREFIX}h.{i}.{n}")) for i in range(c.n_layers)]
    shapes = {tuple(v.shape) for v in layers}
    if len(shapes) != 1:
      raise ValueError(f"h.*.{n} differs in shape between layers: {sorted(shapes)}")
    put(getattr(model.layers, k), jnp.stack(layers), f"h.*.{n} (stacked)")
  return model


def load_gpt2_checkpoint(directory, *, fused: bool = True, seed: int = 0,
                         **config_overrides) -> GPT2:
  """A ``GPT2`` from a Hugging Face GPT-2 checkpoint directory.

  Args:
    directory: ``config.json`` and ``model.safetensors`` (or shards with an index).
    fused: the model's path.
    seed: the init the loaded tensors overwrite (none is left).
    **config_overrides: ``GPT2Config`` fields Hugging Face does not carry.

  Returns:
    The model.
  """
  hf, tensors = ck.open_checkpoint(directory)
  try:
    config = GPT2Config.from_hf_config(hf, **config_overrides)
    return gpt2_from_hf_state_dict(GPT2(config, fused=fused, rngs=nnx.Rngs(seed)), tensors)
  finally:
    tensors.close()


def save_gpt2_checkpoint(model: GPT2, directory, *, max_shard_bytes: int = 5 << 30,
                         dtype=None) -> list:
  """Writes ``model`` as a Hugging Face GPT-2 checkpoint directory (``config.json`` and
  safetensors under ``GPT2LMHeadModel``'s names, the tied head left out).

  Args:
    model: a ``GPT2``.
    directory: created if missing.
    max_shard_bytes: larger checkpoints are sharded with an index.
    dtype: casts the tensors (default: the parameters' dtype).

  Returns:
    The files written.
  """
  return ck.write_checkpoint(directory, gpt2_to_hf_state_dict(model),
                             gpt2_hf_keys(model.config), model.config.to_hf_config(),
                             max_shard_bytes=max_shard_bytes,
                             dtype=dtype or model.config.param_dtype)


__all__ = ["GPT2", "GPT2Block", "GPT2Config", "GPT2_CONFIGS", "block_forward",
           "get_gpt2_config", "gpt2_from_hf_state_dict", "gpt2_hf_keys",
           "gpt2_to_hf_state_dict", "load_gpt2_checkpoint", "save_gpt2_checkpoint"]
