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


# Hugging Face RoPE settings. transformers 4.x writes ``rope_theta`` and ``rope_scaling`` at
# the top level of config.json; transformers 5 writes one ``rope_parameters`` dict holding
# ``rope_type``, ``rope_theta`` and the type's own keys (and reads either layout).
ROPE_TYPES = ("default", "llama3")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
                "original_max_position_embeddings")
_ROPE_KEYS = {"default": ("rope_type", "type", "rope_theta"),
              "llama3": ("rope_type", "type", "rope_theta") + _LLAMA3_KEYS}
# transformers 5 leaves these in rope_parameters with values that change nothing here.
_NEUTRAL_ROPE_KEYS = {"partial_rotary_factor": 1.0}


def _number(value, where: str) -> float:
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
    raise ValueError(f"{where}={value!r} must be a finite number")
  return float(value)


def _one_rope_dict(params: dict, layer_types) -> dict:
  """transformers 5 may key ``rope_parameters`` by layer type ({"full_attention": {...}});
  every layer here is full attention, so that entry is the one."""
  if any(k in params for k in ("rope_type", "type", "rope_theta")):
    return params
  if params and all(isinstance(v, dict) for v in params.values()):
    used = set(layer_types or params)
    if used != {"full_attention"} or "full_attention" not in params:
      raise ValueError(f"rope_parameters is keyed by layer type {sorted(params)} for layer "
                       f"types {sorted(used)}: only full-attention layers are implemented")
    return params["full_attention"]
  raise ValueError(f"rope_parameters={params!r} has no rope_type or rope_theta: expected "
                   "transformers' layout, e.g. {'rope_type': 'default', 'rope_theta': 1e6}")


def _rope_scaling(params: dict, key: str) -> RopeScaling | None:
  """The scaling a RoPE dict asks for (None: plain RoPE). Refuses what it cannot run."""
  kind = params.get("rope_type", params.get("type", "default"))
  if kind not in ROPE_TYPES:
    raise ValueError(f"{key} type {kind!r}: only {' and '.join(map(repr, ROPE_TYPES))} (or "
                     "no scaling) are implemented; this checkpoint would compute different "
                     "positions here")
  for name, value in params.items():
    if name in _ROPE_KEYS[kind]:
      continue
    if name in _NEUTRAL_ROPE_KEYS and value == _NEUTRAL_ROPE_KEYS[name]:
      continue
    raise ValueError(f"{key}[{name!r}]={value!r}: not understood for rope_type {kind!r} "
                     f"(known keys: {list(_ROPE_KEYS[kind])}); refusing to load rather than "
                     "ignore it")
  if kind == "default":
    return None
  missing = [k for k in _LLAMA3_KEYS if k not in params]
  if missing:
    raise ValueError(f"{key} of rope_type 'llama3' lacks {missing}")
  context = params["original_max_position_embeddings"]
  if isinstance(context, bool) or not isinstance(context, int) and not (
      isinstance(context, float) and context.is_integer()):
    raise ValueError(f"{key}['original_max_position_embeddings']={context!r} must be an "
                     "integer")
  return RopeScaling(factor=_number(params["factor"], f"{key}['factor']"),
                     low_freq_factor=_number(params["low_freq_factor"],
                                             f"{key}['low_freq_factor']"),
                     high_freq_factor=_number(params["high_freq_factor"],
                                              f"{key}['high_freq_factor']"),
                     original_context=int(context))


def rope_from_hf_config(hf: dict) -> tuple[float, RopeScaling | None]:
  """RoPE's theta and scaling from a Hugging Face ``config.json`` of either layout.

  transformers 5 (``rope_parameters``) and 4.x (top-level ``rope_theta``, ``rope_scaling``)
  are both read; where a file holds both, they must agree. A 4.x file without
  ``rope_theta`` gets transformers' own default, 10000.

  Args:
    hf: the parsed ``config.json``.

  Returns:
    ``(theta, scaling)``; ``scaling`` is None for plain RoPE.

  Raises:
    ValueError: a RoPE type other than "default" or "llama3", a key this reader does not
      understand, a missing or non-numeric value, a non-unit ``partial_rotary_factor``, or
      the two layouts disagreeing. Nothing falls back to a default silently.
  """
  partial = hf.get("partial_rotary_factor", 1.0)
  if partial != 1.0:
    raise ValueError(f"partial_rotary_factor={partial!r}: RoPE here rotates the whole head "
                     "(1.0 only)")
  layer_types = hf.get("layer_types")
  if layer_types is not None and set(layer_types) - {"full_attention"}:
    raise ValueError(f"layer_types holds {sorted(set(layer_types) - {'full_attention'})}: "
                     "attention here is full causal in every layer")
  legacy_theta = hf.get("rope_theta")
  legacy_scaling = hf.get("rope_scaling")
  if legacy_scaling is not None and not isinstance(legacy_scaling, dict):
    raise ValueError(f"rope_scaling={legacy_scaling!r} must be a dict or null")
  legacy = (10000.0 if legacy_theta is None else _number(legacy_theta, "rope_theta"),
            None if not legacy_scaling else _rope_scaling(legacy_scaling, "rope_scaling"))
  params = hf.get("rope_parameters")
  if params is None:
    return legacy
  if not isinstance(params, dict):
    raise ValueError(f"rope_parameters={params!r} must be a dict (transformers 5's layout)")
  params = _one_rope_dict(params, layer_types)
  if "rope_theta" in params:
    theta = _number(params["rope_theta"], "rope_parameters['rope_theta']")
  elif legacy_theta is not None:
    theta = legacy[0]
  else:
    raise ValueError("rope_parameters has no rope_theta and the config has no top-level "
                     "rope_theta: add rope_parameters['rope_theta'] (e.g. 500000.0)")
  current = (theta, _rope_scaling(params, "rope_parameters"))
  # A 4.x key beside rope_parameters must say the same, or one of them is stale.
  if legacy_theta is not None and legacy[0] != current[0]:
    raise ValueError(f"rope_theta={legacy_theta!r} disagrees with "
                     f"rope_parameters['rope_theta']={theta!r}: fix or drop one")
  if legacy_scaling and legacy[1] != current[1]:
    raise ValueError(f"rope_scaling={legacy_scaling!r} disagrees with "
                     f"rope_parameters={params!r}: fix or drop one")
  return current


def rope_to_hf_config(theta: float, scaling: RopeScaling | None) -> dict:
  """The config.json keys for RoPE that transformers 4.x and 5 both read the same way:
  5's ``rope_parameters`` and 4.x's ``rope_theta`` and ``rope_scaling``."""
  extra = {} if scaling is None else {
      "factor": scaling.factor, "low_freq_factor": scaling.low_freq_factor,
      "high_freq_factor": scaling.high_freq_factor,
      "original_max_position_embeddings": scaling.original_context}
  kind = "default" if scaling is None else "llama3"
  return {"rope_theta": theta,
          "rope_scaling": {"rope_type": kind, **extra} if extra else None,
          "rope_parameters": {"rope_type": kind, "rope_theta": theta, **extra}}



def hf_dtype(param_dtype) -> dict:
  """config.json's parameter dtype under both names: ``dtype`` (transformers >= 4.56 and 5)
  and ``torch_dtype`` (older releases; 5 warns when it stands alone)."""
  name = jnp.dtype(param_dtype).name
  return {"dtype": name, "torch_dtype": name}


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
    theta, rope = rope_from_hf_config(hf)
    heads = hf["num_attention_heads"]
    fields = dict(
        vocab_size=hf["vocab_size"], d_model=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"], n_q_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        ffn_dim=hf["intermediate_size"], rope_theta=theta,
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
    kind = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
            "use_sliding_window": False, "sliding_window": None} if self.qk_norm else {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "mlp_bias": False}
    return {**kind,
            "vocab_size": self.vocab_size, "hidden_size": self.d_model,
            "num_hidden_layers": self.n_layers, "num_attention_heads": self.n_q_heads,
            "num_key_value_heads": self.n_kv_heads, "head_dim": self.head_dim,
            "intermediate_size": self.ffn_dim,
            **rope_to_hf_config(self.rope_theta, self.rope_scaling), "rms_norm_eps": self.eps,
            "tie_word_embeddings": self.tie_embeddings,
            "hidden_act": "silu" if self.activation == "silu" else "gelu_pytorch_tanh",
            "attention_bias": False,
            **hf_dtype(self.param_dtype)}

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
