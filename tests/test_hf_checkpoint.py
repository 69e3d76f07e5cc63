"""Hugging Face checkpoint directories (flax_layers.checkpoint): written here by
save_hf_checkpoint, read back by load_hf_checkpoint, one file or sharded with an index;
the files hold Hugging Face's names, (out, in) shapes and config. Nothing is downloaded."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from coda_jax import layout
from flax_layers import (CONFIGS, Llama, LlamaConfig, get_config, load_hf_checkpoint,
                         save_hf_checkpoint)
from flax_layers.checkpoint import hf_keys

SCALED = layout.RopeScaling(4.0, 1.0, 4.0, 64)


def _params(model):
  return jax.tree.leaves(nnx.state(model, nnx.Param))


def _loss(model):
  tokens = jax.random.randint(jax.random.key(3), (2, 64), 0, model.config.vocab_size)
  return float(model.loss(tokens, jnp.roll(tokens, -1, axis=1)))


@pytest.mark.parametrize("tied,shard", [(False, None), (True, None), (False, 600_000)])
def test_round_trip(tmp_path, tied, shard):
  cfg = get_config("tiny", n_layers=2, tie_embeddings=tied, rope_scaling=SCALED)
  model = Llama(cfg, rngs=nnx.Rngs(1), fused=False)
  kw = {} if shard is None else {"max_shard_bytes": shard}
  files = save_hf_checkpoint(model, tmp_path, **kw)
  names = sorted(f.name for f in files)
  if shard is None:
    assert names == ["config.json", "model.safetensors"]
  else:  # several shards and the index that maps every tensor to one of them
    shards = [n for n in names if n.startswith("model-")]
    assert len(shards) >= 2 and "model.safetensors.index.json" in names
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(hf_keys(cfg))
    assert set(index["weight_map"].values()) == set(shards)
  back = load_hf_checkpoint(tmp_path, fused=False, seed=7)  # other init: all overwritten
  assert back.config == cfg
  for a, b in zip(_params(back), _params(model)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert _loss(back) == _loss(model)


def test_files_have_hugging_face_names_shapes_and_config(tmp_path):
  cfg = get_config("tiny", n_layers=2, rope_scaling=SCALED)
  save_hf_checkpoint(Llama(cfg, rngs=nnx.Rngs(0), fused=False), tmp_path, dtype=jnp.bfloat16)
  d, hd = cfg.d_model, cfg.head_dim
  want = {"model.embed_tokens.weight": (cfg.vocab_size, d), "lm_head.weight": (cfg.vocab_size, d),
          "model.layers.1.self_attn.q_proj.weight": (cfg.n_q_heads * hd, d),
          "model.layers.1.self_attn.k_proj.weight": (cfg.n_kv_heads * hd, d),
          "model.layers.0.self_attn.o_proj.weight": (d, cfg.n_q_heads * hd),
          "model.layers.0.mlp.gate_proj.weight": (cfg.ffn_dim, d),
          "model.layers.0.mlp.down_proj.weight": (d, cfg.ffn_dim),
          "model.layers.0.input_layernorm.weight": (d,), "model.norm.weight": (d,)}
  with safe_open(str(tmp_path / "model.safetensors"), framework="numpy") as f:
    assert set(f.keys()) == set(hf_keys(cfg))
    assert f.metadata() == {"format": "pt"}
    for name, shape in want.items():
      t = f.get_tensor(name)
      assert t.shape == shape and t.dtype == jnp.bfloat16, name
  hf = json.loads((tmp_path / "config.json").read_text())
  assert hf["model_type"] == "llama" and hf["torch_dtype"] == "bfloat16"
  assert hf["rope_scaling"] == {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
  assert hf["num_key_value_heads"] == cfg.n_kv_heads and hf["tie_word_embeddings"] is False


def test_errors_name_the_problem(tmp_path):
  with pytest.raises(ValueError, match="no config.json"):
    load_hf_checkpoint(tmp_path)
  cfg = get_config("tiny", n_layers=1)
  (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_config()))
  with pytest.raises(ValueError, match="neither model.safetensors nor"):
    load_hf_checkpoint(tmp_path)
  save_hf_checkpoint(Llama(cfg, rngs=nnx.Rngs(0), fused=False), tmp_path)
  with safe_open(str(tmp_path / "model.safetensors"), framework="numpy") as f:
    tensors = {k: f.get_tensor(k) for k in f.keys()}
  tensors["model.norm.weight"] = np.ones((cfg.d_model + 1,), np.float32)
  save_file(tensors, str(tmp_path / "model.safetensors"))
  with pytest.raises(ValueError, match=r"model.norm.weight has shape \(257,\)"):
    load_hf_checkpoint(tmp_path)
  del tensors["model.norm.weight"]
  save_file(tensors, str(tmp_path / "model.safetensors"))
  with pytest.raises(ValueError, match="missing \\['model.norm.weight'\\]"):
    load_hf_checkpoint(tmp_path)


# Qwen/Qwen3-0.6B's config.json (the fields transformers 4.51+ writes).
HF_QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 3072,
    "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": None, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936}


def test_qwen3_hf_config():
  """Qwen3-0.6B's config.json is CONFIGS["qwen3-0.6b"] (qk_norm, explicit head_dim 128 !=
  hidden_size / heads = 64), and to_hf_config writes a Qwen3 config that reads back."""
  cfg = LlamaConfig.from_hf_config(HF_QWEN3_0_6B)
  assert cfg == CONFIGS["qwen3-0.6b"]
  assert cfg.qk_norm and cfg.head_dim == 128 and cfg.q_width == 2048
  out = cfg.to_hf_config()
  assert out["model_type"] == "qwen3" and out["architectures"] == ["Qwen3ForCausalLM"]
  assert out["use_sliding_window"] is False and out["attention_bias"] is False
  shared = HF_QWEN3_0_6B.keys() & out.keys() - {"torch_dtype"}  # that one: param_dtype's
  assert len(shared) == 17 and {k: out[k] for k in shared} == {
      k: HF_QWEN3_0_6B[k] for k in shared}
  assert LlamaConfig.from_hf_config(out) == cfg
  assert LlamaConfig.from_hf_config(CONFIGS["tiny"].to_hf_config()).qk_norm is False


@pytest.mark.parametrize("change,match", [
    ({"attention_bias": True}, r"attention_bias=True: this model's q/k/v/o projections have "
                               r"no bias; only checkpoints with attention_bias false"),
    ({"use_sliding_window": True}, r"use_sliding_window=True: attention here is full causal"),
    ({"head_dim": None}, r"lacks \['head_dim'\] \(Qwen3's head_dim is explicit"),
    ({"head_dim": 136}, r"head_dim=136 must be a multiple of 16"),
], ids=["attention_bias", "sliding_window", "no_head_dim", "head_dim_136"])  # the same ids
# under every pytest: an id made from a long message differs between pytest versions (the
# GPU host's gave the message where this machine's gave "change0-match0"), and a test list
# collected on one machine then names a test the other cannot find
def test_qwen3_hf_config_refuses_what_it_cannot_run(change, match):
  hf = {k: v for k, v in (HF_QWEN3_0_6B | change).items() if v is not None}
  with pytest.raises(ValueError, match=match):
    LlamaConfig.from_hf_config(hf)


def test_qwen3_checkpoint_round_trip(tmp_path):
  """A Qwen3 model saved and loaded: config.json says qwen3, every layer's q_norm and
  k_norm are in the files as (head_dim,), and parameters and loss come back exactly."""
  cfg = get_config("qwen3-tiny", n_layers=2)
  model = Llama(cfg, rngs=nnx.Rngs(1), fused=False)
  state = nnx.state(model, nnx.Param)  # norms away from their init of ones
  nnx.update(model, jax.tree.map(lambda v: v + 0.1 * jax.random.normal(
      jax.random.key(v.size), v.shape) if v.ndim == 2 and v.shape[-1] == cfg.head_dim
      else v, state))
  save_hf_checkpoint(model, tmp_path)
  assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen3"
  with safe_open(str(tmp_path / "model.safetensors"), framework="numpy") as f:
    assert set(f.keys()) == set(hf_keys(cfg))
    for i in range(cfg.n_layers):
      for kind in ("q_norm", "k_norm"):
        t = f.get_tensor(f"model.layers.{i}.self_attn.{kind}.weight")
        np.testing.assert_array_equal(t, np.asarray(getattr(model.layers.attn, kind)[i]))
  back = load_hf_checkpoint(tmp_path, fused=False, seed=7)
  assert back.config == cfg
  for a, b in zip(_params(back), _params(model)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert _loss(back) == _loss(model)
