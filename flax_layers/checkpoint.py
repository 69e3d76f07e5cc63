"""Standard Llama checkpoints in and out: Hugging Face ``LlamaForCausalLM`` state-dict names
and layouts ((out, in) matrices, rotate-half q/k), converted once to and from the kernel
layout that ``Llama`` stores (``coda_jax.layout``). ``Qwen3ForCausalLM`` checkpoints
(``LlamaConfig.qk_norm``) add ``self_attn.q_norm.weight`` and ``self_attn.k_norm.weight``
(head_dim,) per layer.

``load_hf_checkpoint(dir)`` / ``save_hf_checkpoint(model, dir)`` read and write a whole
Hugging Face checkpoint directory: ``config.json`` plus ``model.safetensors``, or shards
``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json``.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from coda_jax import layout
from flax_layers.config import LlamaConfig
from flax_layers.model import Llama

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_LAYER = {"wq": "self_attn.q_proj.weight", "wk": "self_attn.k_proj.weight",
          "wv": "self_attn.v_proj.weight", "wo": "self_attn.o_proj.weight",
          "w_gate": "mlp.gate_proj.weight", "w_up": "mlp.up_proj.weight",
          "w_down": "mlp.down_proj.weight", "attn_norm": "input_layernorm.weight",
          "mlp_norm": "post_attention_layernorm.weight"}
_STACKED = {"g_attn": ("attn", "norm"), "wqkv": ("attn", "wqkv"), "wo": ("out", "wo"),
            "g_mlp": ("mlp", "norm"), "w13": ("mlp", "w13"), "w2": ("mlp", "w2")}
# Qwen3's QK-norm weights: HF name, and the (module, param) of LlamaBlock holding them.
_QK_NORM = {"q_norm": ("self_attn.q_norm.weight", ("attn", "q_norm")),
            "k_norm": ("self_attn.k_norm.weight", ("attn", "k_norm"))}


def _qk_norm_names(config) -> dict:
  return {k: v[0] for k, v in _QK_NORM.items()} if config.qk_norm else {}


def _stacked(model):
  """The model's stacked layer params (n_layers, ...) by _STACKED / _QK_NORM key."""
  where = dict(_STACKED)
  if model.config.qk_norm:
    where.update({k: v[1] for k, v in _QK_NORM.items()})
  return {k: getattr(getattr(model.layers, mod), name) for k, (mod, name) in where.items()}


def _qk_norm_rope_order(w, rope, to_hf):
  """A (head_dim,) QK-norm weight in the checkpoint's q/k column order: the kernels'
  rotate-half order, permuted as wq's columns are for ``rope="interleaved"``."""
  if rope == "rotate_half":
    return w
  return (layout.rotate_half_to_interleaved if to_hf else layout.interleaved_to_rotate_half)(
      jnp.asarray(w), w.shape[-1])


def hf_keys(config) -> list[str]:
  """The state-dict names a checkpoint of ``config`` has."""
  keys = ["model.embed_tokens.weight", "model.norm.weight"]
  names = [*_LAYER.values(), *_qk_norm_names(config).values()]
  keys += [f"model.layers.{i}.{n}" for i in range(config.n_layers) for n in names]
  return keys + ([] if config.tie_embeddings else ["lm_head.weight"])


def _layout_kw(config, rope):
  return dict(n_q_heads=config.n_q_heads, n_kv_heads=config.n_kv_heads,
              head_dim=config.head_dim, block=config.swiglu_block, rope=rope, transposed=True)


def to_hf_state_dict(model: Llama, *, rope: str = "rotate_half") -> dict[str, np.ndarray]:
  """The model's parameters as a Hugging Face Llama (or Qwen3) state dict of numpy arrays (in the
  parameters' dtype). ``rope="interleaved"`` writes Meta's q/k column order instead."""
  c = model.config
  stacked = {k: v[...] for k, v in _stacked(model).items()}
  out = {"model.embed_tokens.weight": model.embed[...], "model.norm.weight": model.head.norm[...]}
  for i in range(c.n_layers):
    layer = layout.kernel_layer_to_llama({k: stacked[k][i] for k in _STACKED},
                                         **_layout_kw(c, rope))
    out.update({f"model.layers.{i}.{_LAYER[k]}": v for k, v in layer.items()})
    out.update({f"model.layers.{i}.{n}": _qk_norm_rope_order(stacked[k][i], rope, True)
                for k, n in _qk_norm_names(c).items()})
  if not c.tie_embeddings:
    out["lm_head.weight"] = model.head.wlm[...].T
  return {k: np.asarray(v) for k, v in out.items()}


def load_hf_state_dict(model: Llama, state_dict, *, rope: str = "rotate_half") -> Llama:
  """Overwrites ``model``'s parameters with a Hugging Face Llama (or Qwen3) state dict (numpy or
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
  for k, n in _qk_norm_names(c).items():
    for i in range(c.n_layers):
      layers[i][k] = _qk_norm_rope_order(state_dict[f"model.layers.{i}.{n}"], rope, False)
      if layers[i][k].shape != (c.head_dim,):
        raise ValueError(f"model.layers.{i}.{n} has shape {tuple(layers[i][k].shape)}, "
                         f"expected ({c.head_dim},) = (head_dim,): check the config's "
                         "head_dim")
  for k, param in _stacked(model).items():
    put(param, jnp.stack([jnp.asarray(l[k]) for l in layers]), f"layers' {k}")
  return model


class _LazyTensors:
  """A read-only mapping name -> numpy array over a checkpoint's safetensors files, each
  tensor read from disk only when asked for (tensor by tensor, never a whole file)."""

  def __init__(self, directory: Path, weight_map: dict[str, str]):
    from safetensors import safe_open
    self._files = {name: safe_open(os.fspath(directory / name), framework="numpy")
                   for name in sorted(set(weight_map.values()))}
    self._where = weight_map

  def __contains__(self, name):
    return name in self._where

  def __iter__(self):
    return iter(self._where)

  def __len__(self):
    return len(self._where)

  def __getitem__(self, name):
    return self._files[self._where[name]].get_tensor(name)

  def close(self):
    for f in self._files.values():
      f.__exit__(None, None, None)


def _weight_map(directory: Path) -> dict[str, str]:
  index = directory / INDEX_FILE
  if index.exists():
    return dict(json.loads(index.read_text())["weight_map"])
  single = directory / SINGLE_FILE
  if single.exists():
    from safetensors import safe_open
    with safe_open(os.fspath(single), framework="numpy") as f:
      return {k: SINGLE_FILE for k in f.keys()}
  raise ValueError(f"{directory}: neither {SINGLE_FILE} nor {INDEX_FILE} (a Hugging Face "
                   "checkpoint directory holds one of them)")


def open_checkpoint(directory):
  """(config, tensors) of a Hugging Face checkpoint directory of any model: the parsed
  ``config.json`` and a lazy name -> numpy mapping over its safetensors (one file or
  shards with an index). Call ``tensors.close()`` when done.

  Raises:
    ValueError: no ``config.json``, or no safetensors file or index.
  """
  directory = Path(directory)
  if not (directory / CONFIG_FILE).exists():
    raise ValueError(f"{directory}: no {CONFIG_FILE}")
  config = json.loads((directory / CONFIG_FILE).read_text())
  return config, _LazyTensors(directory, _weight_map(directory))


def load_hf_checkpoint(directory, *, fused: bool = True, rope: str = "rotate_half",
                       seed: int = 0, **config_overrides) -> Llama:
  """A ``Llama`` from a Hugging Face checkpoint directory.

  Args:
    directory: holds ``config.json`` and ``model.safetensors`` or sharded safetensors with
      ``model.safetensors.index.json``.
    fused: the model's path (kernels or the plain-jnp reference).
    rope: "rotate_half" (Hugging Face's q/k order) or "interleaved" (Meta's).
    seed: initializes the parameters before they are overwritten (none is left unset).
    **config_overrides: fields of ``LlamaConfig`` that Hugging Face does not carry
      (``dtype``, ``param_dtype``, ``impl``, ...).

  Returns:
    The model, its parameters cast to ``param_dtype``.

  Raises:
    ValueError: no config or weights, a config this model cannot run
      (``LlamaConfig.from_hf_config``), or tensors that do not match it.
  """
  directory = Path(directory)
  if not (directory / CONFIG_FILE).exists():
    raise ValueError(f"{directory}: no {CONFIG_FILE}")
  config = LlamaConfig.from_hf_config(json.loads((directory / CONFIG_FILE).read_text()),
                                      **config_overrides)
  tensors = _LazyTensors(directory, _weight_map(directory))
  try:
    return load_hf_state_dict(Llama(config, fused=fused, rngs=nnx.Rngs(seed)), tensors,
                              rope=rope)
  finally:
    tensors.close()


def save_hf_checkpoint(model: Llama, directory, *, rope: str = "rotate_half",
                       max_shard_bytes: int = 5 << 30, dtype=None) -> list[Path]:
  """Writes ``model`` as a Hugging Face checkpoint directory that ``transformers``'
  ``LlamaForCausalLM.from_pretrained`` reads.

  Args:
    model: the ``Llama`` to write.
    directory: where to write ``config.json`` and the safetensors (created if missing).
    rope: "rotate_half" (Hugging Face's q/k column order) or "interleaved" (Meta's).
    max_shard_bytes: one file up to this size, else shards of at most it with an index.
    dtype: the tensors' dtype; default the parameters' dtype.

  Returns:
    the paths of the files written.
  """
  return write_checkpoint(directory, to_hf_state_dict(model, rope=rope),
                          hf_keys(model.config), model.config.to_hf_config(),
                          max_shard_bytes=max_shard_bytes,
                          dtype=dtype or model.config.param_dtype)


def write_checkpoint(directory, state: dict, keys: list[str], config: dict, *,
                     max_shard_bytes: int = 5 << 30, dtype=None) -> list[Path]:
  """Writes a Hugging Face checkpoint directory of any model: ``config.json`` and the
  tensors of ``state`` in the order of ``keys``, in one safetensors file or in shards of
  at most ``max_shard_bytes`` with an index.

  Args:
    directory: created if missing.
    state: name -> numpy array (a Hugging Face state dict).
    keys: the names to write, in order (every one must be in ``state``).
    config: the ``config.json`` dict; its ``torch_dtype`` is set to the written dtype.
    max_shard_bytes: the largest shard (a tensor larger than it gets a shard alone).
    dtype: casts the tensors; default: each its own dtype.

  Returns:
    The files written (config first).
  """
  directory = Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  from safetensors.numpy import save_file
  if dtype is not None:
    state = {k: np.asarray(state[k]).astype(jnp.dtype(dtype)) for k in keys}
  shards, size = [[]], 0
  for name in keys:
    nbytes = state[name].nbytes
    if shards[-1] and size + nbytes > max_shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append(name)
    size += nbytes
  config = dict(config)
  if dtype is not None:
    config["torch_dtype"] = jnp.dtype(dtype).name
  written = [directory / CONFIG_FILE]
  written[0].write_text(json.dumps(config, indent=2) + "\n")
  names = ([SINGLE_FILE] if len(shards) == 1 else
           [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
  for fname, group in zip(names, shards):
    save_file({k: np.ascontiguousarray(state[k]) for k in group},
              os.fspath(directory / fname), metadata={"format": "pt"})
    written.append(directory / fname)
  if len(shards) > 1:
    total = sum(state[k].nbytes for k in keys)
    index = {"metadata": {"total_size": total},
             "weight_map": {k: f for f, group in zip(names, shards) for k in group}}
    written.append(directory / INDEX_FILE)
    written[-1].write_text(json.dumps(index, indent=2) + "\n")
  return written
