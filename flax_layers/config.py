"""Llama model configurations: the real shapes of Llama-3.2-1B and Llama-3-8B, and a tiny
one for tests and CPU runs."""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp

from coda_jax import fused_ops
from coda_jax import qk_norm as qk_norm_ops
from coda_jax.blocks import BlockConfig, check_mlp_residuals
from coda_jax.layout import RopeScaling

# Llama 3.1 and 3.2 checkpoints: {"rope_type": "llama3", "factor": 32.0 (3.2; 8.0 for 3.1),
# "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
LLAMA_3_2_ROPE = RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                             original_context=8192)
# Hugging Face ``model_type``s that ``LlamaConfig.from_hf_config`` reads.
HF_MODEL_TYPES = ("llama", "qwen3")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Static hyper-parameters of a Llama-style decoder (hashable), Qwen3 included.

  ``dtype`` is the compute dtype of activations (bfloat16 or float16 for the kernels);
  ``param_dtype`` the stored parameters' (float32: the optimizer's master copy).
  RoPE frequencies are ``rope_theta``'s, scaled by ``rope_scaling`` where set (Llama
  3.1/3.2's "llama3" scaling, ``coda_jax.layout.RopeScaling``). ``attention_impl`` is
  passed to ``jax.nn.dot_product_attention``; None picks "cudnn" on a GPU for 16-bit
  activations and "xla" elsewhere.
  ``qk_norm`` adds Qwen3's per-head RMSNorm of q and k (weights ``q_norm``, ``k_norm`` of
  shape (head_dim,), shared by the heads of their kind, eps = ``eps``) between the QKV
  projection and RoPE (``coda_jax.qk_norm``).
  ``norm_weight_offset`` is added to every RMSNorm weight (QK-norm's too) before it is
  applied: 1.0 gives Gemma's (1 + g) with g stored from zeros
  (``flax_layers.layers.norm_weight``: the sum is taken in fp32, the fused ops run
  unchanged on it, and the stored g gets the same gradient).
  """
  vocab_size: int
  d_model: int
  n_layers: int
  n_q_heads: int
  n_kv_heads: int
  head_dim: int
  ffn_dim: int
  rope_theta: float = 500000.0
  rope_scaling: RopeScaling | None = None
  eps: float = 1e-5
  tie_embeddings: bool = False
  dtype: Any = jnp.bfloat16
  param_dtype: Any = jnp.float32
  swiglu_block: int = 32
  activation: str = "silu"
  init_std: float = 0.02
  attention_impl: str | None = None
  qk_norm: bool = False  # Qwen3: per-head RMSNorm of q and k before RoPE
  norm_weight_offset: float = 0.0  # Gemma: every RMSNorm applies 1 + g, g stored from 0
  impl: str = "auto"  # coda_jax kernel dispatch ("auto", "mosaic", "interpret", "xla")
  head_grad: str = "auto"  # fused LM head's unit gradient (coda_jax.fused_ops.HEAD_GRADS)
  # What each layer's gated MLP keeps for its backward (coda_jax.blocks.MLP_RESIDUALS):
  # "recompute" (default) z alone, "output" its activation output too (BlockConfig's
  # comment says when that paid).
  mlp_residuals: str = "recompute"

  def __post_init__(self):
    for name in ("vocab_size", "d_model", "n_layers", "n_q_heads", "n_kv_heads", "head_dim",
                 "ffn_dim"):
      if getattr(self, name) <= 0:
        raise ValueError(f"LlamaConfig.{name}={getattr(self, name)} must be positive")
    if self.n_q_heads % self.n_kv_heads:
      raise ValueError(f"n_q_heads={self.n_q_heads} must be a multiple of n_kv_heads="
                       f"{self.n_kv_heads} (grouped-query attention)")
    if self.head_dim % 16:
      raise ValueError(f"head_dim={self.head_dim} must be a multiple of 16")
    if self.ffn_dim % self.swiglu_block:
      raise ValueError(f"ffn_dim={self.ffn_dim} must be a multiple of swiglu_block="
                       f"{self.swiglu_block}")
    if jnp.dtype(self.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16),
                                     jnp.dtype(jnp.float32)):
      raise ValueError(f"dtype={self.dtype}: bfloat16, float16 or float32")
    if not isinstance(self.qk_norm, bool):
      raise ValueError(f"qk_norm={self.qk_norm!r} must be a bool (True: Qwen3's per-head "
                       "q/k RMSNorm)")
    if self.qk_norm:
      qk_norm_ops.check_head_dim_tiles(self.head_dim, self.impl)
    fused_ops.check_head_grad(self.head_grad, self.dtype)
    check_mlp_residuals(self.mlp_residuals)
    off = self.norm_weight_offset
    if isinstance(off, bool) or not isinstance(off, (int, float)) or not math.isfinite(off):
      raise ValueError(f"norm_weight_offset={off!r} must be a finite float (0.0: the norm "
                       "applies its stored weight g; 1.0: Gemma's 1 + g)")

  @property
  def q_width(self) -> int:
    return self.n_q_heads * self.head_dim

  @property
  def qkv_width(self) -> int:
    return (self.n_q_heads + 2 * self.n_kv_heads) * self.head_dim

  @classmethod
  def from_hf_config(cls, hf: dict, **overrides) -> "LlamaConfig":
    """A config from a Hugging Face Llama or Qwen3 ``config.json`` (as a dict).

    Reads the sizes, eps, ``rope_theta``, ``rope_scaling`` ("llama3" or none) and tied
    embeddings; ``model_type`` "qwen3" also sets ``qk_norm`` and takes ``head_dim`` as
    written (Qwen3's is not hidden_size // heads: 128 with hidden_size 1024 and 16 heads).

    Args:
      hf: the parsed ``config.json``.
      **overrides: fields HF does not carry (dtype, impl, ...), or ones to replace.

    Returns:
      The ``LlamaConfig``.

    Raises:
      ValueError: a model type, activation, RoPE scaling, attention bias or sliding window
        this model does not implement (it would compute different logits), a missing
        size, or a Qwen3 config without ``head_dim``.
    """
    model_type = hf.get("model_type", "llama")
    if model_type not in HF_MODEL_TYPES:
      raise ValueError(f"model_type={model_type!r}: only {HF_MODEL_TYPES} checkpoints are "
                       "supported")
    qwen3 = model_type == "qwen3"
    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "gelu_pytorch_tanh"):
      raise ValueError(f"hidden_act={act!r}: silu (or gelu_pytorch_tanh) only")
    if hf.get("attention_bias", False):
      raise ValueError(f"attention_bias={hf['attention_bias']!r}: this model's q/k/v/o "
                       "projections have no bias; only checkpoints with attention_bias "
                       "false (Llama, Qwen3) load")
    if hf.get("mlp_bias", False):
      raise ValueError(f"mlp_bias={hf['mlp_bias']!r}: this model's MLP has no bias; only "
                       "checkpoints with mlp_bias false load")
    if hf.get("use_sliding_window", False):
      raise ValueError("use_sliding_window=True: attention here is full causal; set "
                       "use_sliding_window false (every released Qwen3 has it false)")
    missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers",
                           "num_attention_heads", "intermediate_size")
               + (("head_dim",) if qwen3 else ()) if k not in hf]
    if missing:
      raise ValueError(f"Hugging Face {model_type} config lacks {missing}"
                       + (" (Qwen3's head_dim is explicit: add it, e.g. 128)"
                          if "head_dim" in missing else ""))
    scaling = hf.get("rope_scaling")
    rope = None
    if scaling:
      kind = scaling.get("rope_type", scaling.get("type"))
      if kind == "llama3":
        rope = RopeScaling(factor=float(scaling["factor"]),
                           low_freq_factor=float(scaling["low_freq_factor"]),
                           high_freq_factor=float(scaling["high_freq_factor"]),
                           original_context=int(scaling["original_max_position_embeddings"]))
      elif kind != "default":
        raise ValueError(f"rope_scaling type {kind!r}: only 'llama3' (or none) is implemented")
    heads = hf["num_attention_heads"]
    fields = dict(
        vocab_size=hf["vocab_size"], d_model=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"], n_q_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        ffn_dim=hf["intermediate_size"], rope_theta=float(hf.get("rope_theta", 10000.0)),
        rope_scaling=rope, eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        activation="silu" if act == "silu" else "gelu", qk_norm=qwen3)
    return cls(**(fields | overrides))

  def to_hf_config(self) -> dict:
    """This config as a Hugging Face ``config.json`` dict: Llama's, or Qwen3's
    (``Qwen3ForCausalLM``) when ``qk_norm``.

    Returns:
      A JSON-serialisable dict that ``from_hf_config`` maps back to this config's
      checkpoint fields.
    """
    if self.norm_weight_offset:
      raise ValueError(f"norm_weight_offset={self.norm_weight_offset}: Llama and Qwen3 "
                       "checkpoints apply their norm weights as stored; a model with an "
                       "offset (Gemma's 1 + g) has no Hugging Face config here")
    rope = None if self.rope_scaling is None else {
        "rope_type": "llama3", "factor": self.rope_scaling.factor,
        "low_freq_factor": self.rope_scaling.low_freq_factor,
        "high_freq_factor": self.rope_scaling.high_freq_factor,
        "original_max_position_embeddings": self.rope_scaling.original_context}
    kind = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
            "use_sliding_window": False, "sliding_window": None} if self.qk_norm else {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "mlp_bias": False}
    return {**kind,
            "vocab_size": self.vocab_size, "hidden_size": self.d_model,
            "num_hidden_layers": self.n_layers, "num_attention_heads": self.n_q_heads,
            "num_key_value_heads": self.n_kv_heads, "head_dim": self.head_dim,
            "intermediate_size": self.ffn_dim, "rope_theta": self.rope_theta,
            "rope_scaling": rope, "rms_norm_eps": self.eps,
            "tie_word_embeddings": self.tie_embeddings,
            "hidden_act": "silu" if self.activation == "silu" else "gelu_pytorch_tanh",
            "attention_bias": False,
            "torch_dtype": jnp.dtype(self.param_dtype).name}

  def replace(self, **changes) -> "LlamaConfig":
    return dataclasses.replace(self, **changes)

  def block_config(self) -> BlockConfig:
    return BlockConfig(n_q_heads=self.n_q_heads, n_kv_heads=self.n_kv_heads,
                       head_dim=self.head_dim, rope_theta=self.rope_theta,
                       rope_scaling=self.rope_scaling, eps=self.eps,
                       swiglu_block=self.swiglu_block, activation=self.activation,
                       qk_norm=self.qk_norm, impl=self.impl, head_grad=self.head_grad,
                       mlp_residuals=self.mlp_residuals)

  def param_count(self) -> int:
    d, f = self.d_model, self.ffn_dim
    layer = d * self.qkv_width + self.q_width * d + 3 * d * f + 2 * d
    layer += 2 * self.head_dim if self.qk_norm else 0
    head = 0 if self.tie_embeddings else d * self.vocab_size
    return self.vocab_size * d + self.n_layers * layer + d + head


CONFIGS = {
    # Byte-level vocabulary; every matrix dimension a multiple of 64 so the kernels tile.
    "tiny": LlamaConfig(vocab_size=256, d_model=256, n_layers=4, n_q_heads=4, n_kv_heads=2,
                        head_dim=64, ffn_dim=512, rope_theta=10000.0),
    "llama-3.2-1b": LlamaConfig(vocab_size=128256, d_model=2048, n_layers=16, n_q_heads=32,
                                n_kv_heads=8, head_dim=64, ffn_dim=8192,
                                rope_scaling=LLAMA_3_2_ROPE, tie_embeddings=True),
    "llama-3-8b": LlamaConfig(vocab_size=128256, d_model=4096, n_layers=32, n_q_heads=32,
                              n_kv_heads=8, head_dim=128, ffn_dim=14336),
    # Qwen3's layout at the tiny size: q/k per-head RMSNorm, q width (4 x 64) = d_model,
    # tied head, Qwen3's theta and eps.
    "qwen3-tiny": LlamaConfig(vocab_size=256, d_model=256, n_layers=4, n_q_heads=4,
                              n_kv_heads=2, head_dim=64, ffn_dim=512, rope_theta=1000000.0,
                              eps=1e-6, tie_embeddings=True, qk_norm=True),
    # Qwen3-0.6B (Qwen/Qwen3-0.6B config.json): q width 16 x 128 = 2048 != d_model 1024;
    # vocab 151936 = 64 x 2374 tiles the kernels.
    "qwen3-0.6b": LlamaConfig(vocab_size=151936, d_model=1024, n_layers=28, n_q_heads=16,
                              n_kv_heads=8, head_dim=128, ffn_dim=3072, rope_theta=1000000.0,
                              eps=1e-6, tie_embeddings=True, qk_norm=True),
}


def get_config(name: str, **overrides) -> LlamaConfig:
  """A named configuration with fields replaced.

  Args:
    name: a key of ``CONFIGS`` (e.g. "llama-3.2-1b", "tiny").
    **overrides: ``LlamaConfig`` fields to replace (checked as the config checks them).

  Returns:
    the ``LlamaConfig``.
  """
  if name not in CONFIGS:
    raise ValueError(f"unknown config {name!r}: one of {sorted(CONFIGS)}")
  return CONFIGS[name].replace(**overrides)
