"""Llama model configurations: the real shapes of Llama-3.2-1B and Llama-3-8B, and a tiny
one for tests and CPU runs."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from coda_jax.blocks import BlockConfig
from coda_jax.layout import RopeScaling

# Llama 3.1 and 3.2 checkpoints: {"rope_type": "llama3", "factor": 32.0 (3.2; 8.0 for 3.1),
# "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
LLAMA_3_2_ROPE = RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                             original_context=8192)


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Static hyper-parameters of a Llama-style decoder (hashable).

  ``dtype`` is the compute dtype of activations (bfloat16 or float16 for the kernels);
  ``param_dtype`` the stored parameters' (float32: the optimizer's master copy).
  RoPE frequencies are ``rope_theta``'s, scaled by ``rope_scaling`` where set (Llama
  3.1/3.2's "llama3" scaling, ``coda_jax.layout.RopeScaling``). ``attention_impl`` is passed to ``jax.nn.dot_product_attention``;
  None picks "cudnn" on a GPU for 16-bit activations and "xla" elsewhere.
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
  impl: str = "auto"  # coda_jax kernel dispatch ("auto", "mosaic", "interpret", "xla")

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

  @property
  def q_width(self) -> int:
    return self.n_q_heads * self.head_dim

  @property
  def qkv_width(self) -> int:
    return (self.n_q_heads + 2 * self.n_kv_heads) * self.head_dim

  @classmethod
  def from_hf_config(cls, hf: dict, **overrides) -> "LlamaConfig":
    """A config from a Hugging Face Llama ``config.json`` (as a dict): sizes, eps,
    ``rope_theta``, ``rope_scaling`` ("llama3" or none) and tied embeddings.
    ``overrides`` set the fields HF does not carry (dtype, impl, ...).

    Raises:
      ValueError: a model type, activation or RoPE scaling this model does not implement
        (it would compute different logits), or a missing size.
    """
    if hf.get("model_type", "llama") != "llama":
      raise ValueError(f"model_type={hf['model_type']!r}: only Llama checkpoints are supported")
    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "gelu_pytorch_tanh"):
      raise ValueError(f"hidden_act={act!r}: silu (or gelu_pytorch_tanh) only")
    missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers",
                           "num_attention_heads", "intermediate_size") if k not in hf]
    if missing:
      raise ValueError(f"Hugging Face config lacks {missing}")
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
        activation="silu" if act == "silu" else "gelu")
    return cls(**(fields | overrides))

  def to_hf_config(self) -> dict:
    """This config as a Hugging Face Llama ``config.json`` dict."""
    rope = None if self.rope_scaling is None else {
        "rope_type": "llama3", "factor": self.rope_scaling.factor,
        "low_freq_factor": self.rope_scaling.low_freq_factor,
        "high_freq_factor": self.rope_scaling.high_freq_factor,
        "original_max_position_embeddings": self.rope_scaling.original_context}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": self.vocab_size, "hidden_size": self.d_model,
            "num_hidden_layers": self.n_layers, "num_attention_heads": self.n_q_heads,
            "num_key_value_heads": self.n_kv_heads, "head_dim": self.head_dim,
            "intermediate_size": self.ffn_dim, "rope_theta": self.rope_theta,
            "rope_scaling": rope, "rms_norm_eps": self.eps,
            "tie_word_embeddings": self.tie_embeddings,
            "hidden_act": "silu" if self.activation == "silu" else "gelu_pytorch_tanh",
            "attention_bias": False, "mlp_bias": False,
            "torch_dtype": jnp.dtype(self.param_dtype).name}

  def replace(self, **changes) -> "LlamaConfig":
    return dataclasses.replace(self, **changes)

  def block_config(self) -> BlockConfig:
    return BlockConfig(n_q_heads=self.n_q_heads, n_kv_heads=self.n_kv_heads,
                       head_dim=self.head_dim, rope_theta=self.rope_theta,
                       rope_scaling=self.rope_scaling, eps=self.eps,
                       swiglu_block=self.swiglu_block, activation=self.activation,
                       impl=self.impl)

  def param_count(self) -> int:
    d, f = self.d_model, self.ffn_dim
    layer = d * self.qkv_width + self.q_width * d + 3 * d * f + 2 * d
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
}


def get_config(name: str, **overrides) -> LlamaConfig:
  """A named configuration (``CONFIGS``) with fields replaced by ``overrides``."""
  if name not in CONFIGS:
    raise ValueError(f"unknown config {name!r}: one of {sorted(CONFIGS)}")
  return CONFIGS[name].replace(**overrides)
