"""Standard Llama checkpoints in and out: Hugging Face ``LlamaForCausalLM`` state-dict names
and layouts ((out, in) matrices, rotate-half q/k), converted once to and from the kernel
layout that ``Llama`` stores (``coda_jax.layout``)."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from coda_jax import layout
from flax_layers.model import Llama

_LAYER = {"wq": "self_attn.q_proj.weight", "wk": "self_attn.k_proj.weight",
          "wv": "self_attn.v_proj.weight", "wo": "self_attn.o_proj.weight",
          "w_gate": "mlp.gate_proj.weight", "w_up": "mlp.up_proj.weight",
          "w_down": "mlp.down_proj.weight", "attn_norm": "input_layernorm.weight",
          "mlp_norm": "post_attention_layernorm.weight"}
_STACKED = {"g_attn": ("attn", "norm"), "wqkv": ("attn", "wqkv"), "wo": ("out", "wo"),
            "g_mlp": ("mlp", "norm"), "w13": ("mlp", "w13"), "w2": ("mlp", "w2")}


def hf_keys(config) -> list[str]:
  """The state-dict names a checkpoint of ``config`` has."""
  keys = ["model.embed_tokens.weight", "model.norm.weight"]
  keys += [f"model.layers.{i}.{n}" for i in range(config.n_layers) for n in _LAYER.values()]
  return keys + ([] if config.tie_embeddings else ["lm_head.weight"])


def _layout_kw(config, rope):
  return dict(n_q_heads=config.n_q_heads, n_kv_heads=config.n_kv_heads,
              head_dim=config.head_dim, block=config.swiglu_block, rope=rope, transposed=True)


def to_hf_state_dict(model: Llama, *, rope: str = "rotate_half") -> dict[str, np.ndarray]:
  """The model's parameters as a Hugging Face Llama state dict of numpy arrays (in the
  parameters' dtype). ``rope="interleaved"`` writes Meta's q/k column order instead."""
  c = model.config
  stacked = {k: getattr(getattr(model.layers, mod), name)[...]
             for k, (mod, name) in _STACKED.items()}
  out = {"model.embed_tokens.weight": model.embed[...], "model.norm.weight": model.head.norm[...]}
  for i in range(c.n_layers):
    layer = layout.kernel_layer_to_llama({k: v[i] for k, v in stacked.items()},
                                         **_layout_kw(c, rope))
    out.update({f"model.layers.{i}.{_LAYER[k]}": v for k, v in layer.items()})
  if not c.tie_embeddings:
    out["lm_head.weight"] = model.head.wlm[...].T
  return {k: np.asarray(v) for k, v in out.items()}


def load_hf_state_dict(model: Llama, state_dict, *, rope: str = "rotate_half") -> Llama:
  """Overwrites ``model``'s parameters with a Hugging Face Llama state dict (numpy or
  jax arrays; ``rope="interleaved"`` for q/k in Meta's order). Shapes and names are
  checked against the model's config; values are cast to its ``param_dtype``."""
  c = model.config
  want, have = set(hf_keys(c)), set(state_dict)
  if c.tie_embeddings and "lm_head.weight" in have:
    if not np.array_equal(np.asarray(state_dict["lm_head.weight"]),
                          np.asarray(state_dict["model.embed_tokens.weight"])):
      raise ValueError("config.tie_embeddings is set but lm_head.weight differs from "
                       "model.embed_tokens.weight")
    have.discard("lm_head.weight")
  if want != have:
    raise ValueError(f"state dict does not match the config: missing {sorted(want - have)[:8]}"
                     f", unexpected {sorted(have - want)[:8]}")
  dt = c.param_dtype

  def put(param, value, name):
    value = jnp.asarray(value)
    if value.shape != param.shape:
      raise ValueError(f"{name} has shape {value.shape}, expected {param.shape}")
    param[...] = value.astype(dt)

  put(model.embed, state_dict["model.embed_tokens.weight"], "model.embed_tokens.weight")
  put(model.head.norm, state_dict["model.norm.weight"], "model.norm.weight")
  if not c.tie_embeddings:
    put(model.head.wlm, jnp.asarray(state_dict["lm_head.weight"]).T, "lm_head.weight (.T)")
  layers = [layout.llama_layer_to_kernel(
      {k: state_dict[f"model.layers.{i}.{n}"] for k, n in _LAYER.items()},
      **_layout_kw(c, rope)) for i in range(c.n_layers)]
  for k, (mod, name) in _STACKED.items():
    put(getattr(getattr(model.layers, mod), name), jnp.stack([l[k] for l in layers]),
        f"layers' {k}")
  return model
