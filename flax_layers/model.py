"""A Llama-style decoder built from the fused layers.

``LlamaBlock`` is one pre-norm layer (QKV + RoPE, causal GQA attention, out-proj +
residual, SwiGLU MLP + residual). ``Llama`` stacks ``n_layers`` of them (parameters with a
leading layer axis, run under ``jax.lax.scan`` so compile time does not grow with depth)
between a token embedding and the LM head.

``Llama.loss`` is the training path. Fused, it cuts the model at attention instead of at
layer boundaries (``coda_jax.blocks``): each GEMM-epilogue block runs one layer's
out-proj, MLP and the *next* layer's norm + QKV + RoPE, so every RMSNorm's statistics come
out of the epilogue of the GEMM that produced its input, and the backward is fused the
same way. With ``fused=False`` the same parameters run the plain-jnp reference of that
math under ordinary autodiff.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from coda_jax import blocks
from coda_jax import jnp_reference as ref
from coda_jax.fused_ops import REDUCTIONS, flat_rows
from coda_jax.sharding import RowSplit
from flax_layers import layers as Lyr
from flax_layers.config import LlamaConfig

_MLP_KEYS = ("wo", "g_mlp", "w13", "w2")


class LlamaBlock(nnx.Module):
  """One Llama layer: x + Attn(RMSNorm(x)), then + MLP(RMSNorm(·)).

  Submodules: ``attn`` (``QKVProjection``: ``norm`` (D,), ``wqkv`` (D, (Hq + 2 Hkv) hd)),
  ``out`` (``OutProjection``: ``wo`` (Hq hd, D)), ``mlp`` (``FusedMLP``: ``norm`` (D,),
  ``w13`` (D, 2F), ``w2`` (F, D)); with ``config.qk_norm`` (Qwen3) ``attn`` also holds
  ``q_norm`` and ``k_norm`` (hd,). Call: x (B, T, D), positions (B, T) int -> (B, T, D).
  Fused, the out-projection's epilogue adds the residual and emits the MLP norm's
  statistics.
  """

  def __init__(self, config: LlamaConfig, *, fused: bool = True, rngs: nnx.Rngs):
    c = config
    common = dict(param_dtype=c.param_dtype, init_std=c.init_std, fused=fused, impl=c.impl,
                  rngs=rngs)
    off = c.norm_weight_offset
    self.attn = Lyr.QKVProjection(c.d_model, c.n_q_heads, c.n_kv_heads, c.head_dim,
                                  rope_theta=c.rope_theta, rope_scaling=c.rope_scaling,
                                  eps=c.eps, qk_norm=c.qk_norm, norm_offset=off, **common)
    self.out = Lyr.OutProjection(c.q_width, c.d_model, **common)
    self.mlp = Lyr.FusedMLP(c.d_model, c.ffn_dim, block=c.swiglu_block,
                            activation=c.activation, eps=c.eps, norm_offset=off, **common)
    self.config, self.fused = config, fused

  def __call__(self, x, positions):
    return block_forward(self.params(), x, positions, self.config, self.fused)

  def params(self) -> dict:
    """This layer's parameters under ``coda_jax.blocks`` names (kernel layout), as the
    math applies them: norm weights with ``config.norm_weight_offset`` added
    (``layers.norm_weight``). With a leading layer axis when the block is stacked. With
    QK-norm, also ``g_q_norm`` and ``g_k_norm`` (``blocks.QK_NORM_KEYS``)."""
    g = lambda v: Lyr.norm_weight(v[...], self.config.norm_weight_offset)
    p = {"g_attn": g(self.attn.norm), "wqkv": self.attn.wqkv[...],
         "wo": self.out.wo[...], "g_mlp": g(self.mlp.norm), "w13": self.mlp.w13[...],
         "w2": self.mlp.w2[...]}
    if self.config.qk_norm:
      p.update(g_q_norm=g(self.attn.q_norm), g_k_norm=g(self.attn.k_norm))
    return p


def heads(c: LlamaConfig):
  return c.n_q_heads, c.n_kv_heads, c.head_dim


def block_forward(p, x, positions, c: LlamaConfig, fused: bool):
  """One layer, op by op (the fused ops where ``fused``): (B, T, D) -> (B, T, D)."""
  h, r = Lyr.norm_stats(x, p["g_attn"], c.eps)
  if c.qk_norm:
    qkv = Lyr.qkv_qknorm_rope(h, r, p["wqkv"], positions, _qk_norm_w(p), heads(c),
                              c.rope_theta, c.eps, fused, c.impl, c.rope_scaling)
  else:
    qkv = Lyr.qkv_rope(h, r, p["wqkv"], positions, heads(c), c.rope_theta, fused, c.impl,
                       c.rope_scaling)
  y = Lyr.causal_attention(qkv, heads(c), c.attention_impl)
  x1, h1, r1 = Lyr.residual_rmsnorm(y, p["wo"], x, p["g_mlp"], c.eps, fused, c.impl)
  y1 = Lyr.swiglu(h1, r1, p["w13"], c.swiglu_block, c.activation, fused, c.impl)
  return Lyr.residual_matmul(y1, p["w2"], x1, fused, c.impl)


def _qk_norm_w(p):
  """(q_norm_w, k_norm_w) of a layer's params, or None without QK-norm."""
  return (p["g_q_norm"], p["g_k_norm"]) if "g_q_norm" in p else None


class _ReferenceBlocks:
  """``coda_jax.blocks``' three entry points as plain jnp (``jnp_reference``) on (B, T, ·)."""

  def __init__(self, c: LlamaConfig):
    self.kw = dict(n_q_heads=c.n_q_heads, n_kv_heads=c.n_kv_heads, head_dim=c.head_dim,
                   theta=c.rope_theta, rope_scaling=c.rope_scaling, eps=c.eps)
    self.mlp = dict(eps=c.eps, block=c.swiglu_block, activation=c.activation)

  def pre_block(self, x0, positions, g_attn, wqkv, qk_norm_w=None):
    qkv = ref.pre_block(flat_rows(x0), g_attn, wqkv, positions.reshape(-1), **self.kw,
                        qk_norm_w=qk_norm_w)
    return qkv.reshape(*x0.shape[:-1], -1)

  def shifted_block(self, x0, y0, positions, params):
    x2, qkv = ref.shifted_block(flat_rows(x0), flat_rows(y0), positions.reshape(-1),
                                params, **self.kw, block=self.mlp["block"],
                                activation=self.mlp["activation"],
                                qk_norm_w=_qk_norm_w(params))
    return x2.reshape(x0.shape), qkv.reshape(*x0.shape[:-1], -1)

  def post_block(self, x0, y0, targets, params, reduction="mean", wlm_layout="dv"):
    if wlm_layout == "vd":  # a tied (V, D) embedding: XLA folds the transpose into its dot
      params = {**params, "wlm": params["wlm"].T}
    loss = ref.post_block(flat_rows(x0), flat_rows(y0), targets.reshape(-1), params,
                          **self.mlp, reduction=reduction)
    return loss.reshape(targets.shape) if reduction == "none" else loss


class _FusedBlocks:
  def __init__(self, c: LlamaConfig):
    self.cfg = c.block_config()

  def pre_block(self, x0, positions, g_attn, wqkv, qk_norm_w=None):
    return blocks.pre_block(x0, positions, g_attn, wqkv, self.cfg, qk_norm_w)

  def shifted_block(self, x0, y0, positions, params):
    return blocks.shifted_block(x0, y0, positions, params, self.cfg)

  def post_block(self, x0, y0, targets, params, reduction="mean", wlm_layout="dv"):
    return blocks.post_block(x0, y0, targets, params,
                             dataclasses.replace(self.cfg, reduction=reduction,
                                                 wlm_layout=wlm_layout))


class Llama(nnx.Module):
  """Llama-style decoder: embedding, ``n_layers`` stacked ``LlamaBlock``s, final RMSNorm
  and LM head (tied to the embedding when ``config.tie_embeddings``).

  Parameters (kernel layout; ``flax_layers.checkpoint`` converts from and to the standard
  Llama / Hugging Face layout): ``embed`` (V, D); ``layers``: a ``LlamaBlock`` whose
  parameters have a leading (n_layers,) axis; ``head``: ``LMHeadLoss`` (``norm`` (D,),
  ``wlm`` (D, V) unless tied).

  ``fused`` selects the fused kernels (True) or the plain-XLA reference (False) for every
  layer; ``model.set_attributes(fused=...)`` switches an existing model.
  """

  def __init__(self, config: LlamaConfig, *, fused: bool = True, rngs: nnx.Rngs):
    c = config
    self.embed = nnx.Param(nnx.initializers.normal(c.init_std)(
        rngs.params(), (c.vocab_size, c.d_model), c.param_dtype))

    @nnx.split_rngs(splits=c.n_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def stacked(rngs):
      return LlamaBlock(c, fused=fused, rngs=rngs)

    self.layers = stacked(rngs)
    self.head = Lyr.LMHeadLoss(c.d_model, c.vocab_size, tied=c.tie_embeddings, eps=c.eps,
                               param_dtype=c.param_dtype, init_std=c.init_std,
                               norm_offset=c.norm_weight_offset, fused=fused, impl=c.impl,
                               rngs=rngs)
    self.config, self.fused = config, fused

  @staticmethod
  def _check_tokens(tokens):
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
      raise ValueError(f"tokens must be (B, T) integers, got {tokens.shape} {tokens.dtype}")

  def _inputs(self, tokens, positions):
    self._check_tokens(tokens)
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32),
                                   tokens.shape)
    elif positions.shape != tokens.shape:
      raise ValueError(f"positions {positions.shape} must match tokens {tokens.shape}")
    if not isinstance(tokens, jax.core.Tracer):  # checkable now: refuse bad ids
      ids = np.asarray(tokens)  # numpy: a concrete array closed over by a jit traces too
      bad = (ids < 0) | (ids >= self.config.vocab_size)
      if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"token id {int(ids[at])} at {at} is outside "
                         f"[0, vocab_size={self.config.vocab_size})")
    # Under jit the ids cannot be checked: an id outside [0, V) reads a NaN embedding
    # (jnp.take's "fill" mode), so that token's row, and the loss, become NaN.
    x = jnp.take(self.embed[...], tokens, axis=0, mode="fill").astype(self.config.dtype)
    return x, positions

  def _head_weight(self, dtype):
    """wlm (D, V) for the fused ops, or None when the head owns it."""
    return self.embed[...].astype(dtype).T if self.config.tie_embeddings else None

  def loss(self, tokens, targets, positions=None, *, reduction: str = "mean",
           row_split: RowSplit | None = None):
    """Next-token cross-entropy of the whole model (the training path).

    Args:
      tokens: (B, T) int token ids.
      targets: (B, T) int; ``-100`` (ignore_index) entries are skipped. A target outside
        [0, V) that is not ``-100`` makes that token's loss NaN (so a mean or sum is NaN),
        on the fused and the reference path alike; it passes no gradient.
      positions: (B, T) int RoPE positions; default ``arange(T)`` per row.
      reduction: "mean" over the counted targets, "sum", or "none" (per token).
      row_split: a ``coda_jax.sharding.RowSplit`` naming the mesh axis the batch is split
        over, under ``jax.jit`` on auto axes (data parallelism, FSDP;
        ``make_train_step`` passes it by default). Both paths then gather each layer's
        weights whole as the layer scan reaches them (``layers.whole_weights``: FSDP
        per layer). The fused path also runs the last block and the LM head per device
        in one ``jax.shard_map``: each device accumulates the head's weight gradient
        in place over its row chunks and the devices sum it once, and an FSDP-split
        head is gathered once, where the per-GEMM rule would do both chunk by chunk.

    Returns:
      fp32: a scalar, or (B, T) with ``reduction="none"`` (0 where ignored).
    """
    c = self.config
    self._check_tokens(tokens)  # before the padding reads (B, T)
    if targets.shape != tokens.shape:
      raise ValueError(f"targets {targets.shape} must match tokens {tokens.shape}")
    if reduction not in REDUCTIONS:
      raise ValueError(f"reduction={reduction!r}: one of {REDUCTIONS}")
    t = tokens.shape[1]
    if self.fused:
      tokens, targets, positions = self._pad_to_tile(tokens, targets, positions)
    x, positions = self._inputs(tokens, positions)
    impl = _FusedBlocks(c) if self.fused else _ReferenceBlocks(c)
    p = self.layers.params()
    # Matrices go to the compute dtype before they are sliced per layer below, so the
    # slices cost nothing beyond the cast every step pays anyway.
    p = {k: (v if k.startswith("g_") else v.astype(c.dtype)) for k, v in p.items()}
    attend = lambda qkv: Lyr.causal_attention(qkv, heads(c), c.attention_impl)
    norms = [k for k in blocks.QK_NORM_KEYS if k in p]  # the next layer's, as g_attn
    whole = lambda tree: Lyr.whole_weights(tree, row_split)  # FSDP: gathered per layer
    first = whole({k: p[k][0] for k in ("g_attn", "wqkv", *norms)})
    qkv = impl.pre_block(x, positions, first["g_attn"], first["wqkv"],
                         _qk_norm_w({k: first[k] for k in norms}))

    def layer(carry, lp):
      x, qkv = carry
      return impl.shifted_block(x, attend(qkv), positions, whole(lp)), None

    # Block i: layer i's out-proj and MLP, then layer i + 1's norm and QKV.
    shifted = {**{k: p[k][:-1] for k in _MLP_KEYS},
               **{k: p[k][1:] for k in ("g_attn", "wqkv", *norms)}}
    (x, qkv), _ = jax.lax.scan(layer, (x, qkv), shifted)
    # A tied head is the (V, D) embedding itself: the kernels read it transposed, so
    # neither it nor its gradient is copied into a (D, V) layout each step.
    wlm, layout = ((self.embed[...].astype(c.dtype), "vd") if c.tie_embeddings
                   else (self.head.head_weight(), "dv"))
    last = whole({**{k: p[k][-1] for k in _MLP_KEYS}, "g_final": self.head.norm_weight(),
                  "wlm": wlm})
    post = lambda x, y, targets, last, red: impl.post_block(x, y, targets, last, red, layout)
    loss = Lyr.loss_over_rows(post, reduction, (x, attend(qkv), targets), (last,), targets,
                              self.head.ignore_index, row_split if self.fused else None)
    return loss[:, :t] if reduction == "none" else loss

  def _pad_to_tile(self, tokens, targets, positions):
    """Pads every sequence at its end so that the token count B * T is a multiple of
    ``blocks.ROW_MULTIPLE``, which every kernel tiles as it is. Without this each GEMM
    of a ragged batch (3 x 1000 tokens) would pad and slice its own operands; padded
    once here, the cost is the extra tokens' compute (under 1% for 8 x 2000). Causal
    attention keeps the padded tokens out of the real ones, and their targets are
    ignored, so the loss and the gradients are those of the unpadded batch. Only when
    that adds at most 2% of the tokens (small batches are left to the GEMMs)."""
    b, t = tokens.shape
    step = blocks.ROW_MULTIPLE // math.gcd(b, blocks.ROW_MULTIPLE)
    extra = -t % step
    if extra == 0 or extra * 50 > t:
      return tokens, targets, positions
    pad = ((0, 0), (0, extra))
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), tokens.shape)
    return (jnp.pad(tokens, pad), jnp.pad(targets, pad, constant_values=self.head.ignore_index),
            jnp.pad(positions, pad, mode="edge"))

  def __call__(self, tokens, positions=None):
    """tokens (B, T) int -> fp32 logits (B, T, V), layer by layer (inference, checks)."""
    x, positions = self._inputs(tokens, positions)

    def layer(x, p):
      return block_forward(p, x, positions, self.config, self.fused), None

    x, _ = jax.lax.scan(layer, x, self.layers.params())
    return self.head.logits(x, wlm=self._head_weight(x.dtype))
