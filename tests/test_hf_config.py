"""Hugging Face ``config.json`` in both transformers layouts.

transformers 4.x writes RoPE as top-level ``rope_theta`` and ``rope_scaling``; transformers 5
writes one ``rope_parameters`` dict (``rope_type``, ``rope_theta`` and the type's keys) and
``dtype`` for ``torch_dtype``. The published Llama-3.2-1B and Qwen3-0.6B configs are written
here in both layouts from their known values: each must read to the same ``LlamaConfig``,
a checkpoint directory in either layout must give the same logits, and whatever the reader
does not understand must be refused by name, never replaced by a default.
"""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from coda_jax import layout
from flax_layers import (CONFIGS, Llama, LlamaConfig, get_config, load_hf_checkpoint,
                         save_hf_checkpoint)
from flax_layers.config import rope_from_hf_config
from test_hf_checkpoint import HF_QWEN3_0_6B as QWEN3_0_6B_V4  # as transformers 4.x wrote it

# meta-llama/Llama-3.2-1B's config.json, as transformers 4.x wrote it.
LLAMA_3_2_1B_V4 = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192,
    "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0.dev0", "use_cache": True, "vocab_size": 128256}

def as_transformers_5(hf: dict) -> dict:
  """``hf`` in transformers 5's layout: RoPE under ``rope_parameters`` alone, ``dtype``
  for ``torch_dtype``, and (Qwen3) ``layer_types``."""
  out = {k: v for k, v in hf.items() if k not in ("rope_theta", "rope_scaling", "torch_dtype")}
  out["rope_parameters"] = {"rope_type": "default", **(hf.get("rope_scaling") or {}),
                            "rope_theta": hf["rope_theta"]}
  out["dtype"] = hf["torch_dtype"]
  out["transformers_version"] = "5.0.0"
  if hf["model_type"] == "qwen3":
    out["layer_types"] = ["full_attention"] * hf["num_hidden_layers"]
  return out


LLAMA_3_2_1B_V5 = as_transformers_5(LLAMA_3_2_1B_V4)
QWEN3_0_6B_V5 = as_transformers_5(QWEN3_0_6B_V4)


def test_the_v5_layout_has_no_v4_rope_keys():
  """The fixtures are what they claim: a reader that looked only at the 4.x keys would
  find nothing in them."""
  for hf in (LLAMA_3_2_1B_V5, QWEN3_0_6B_V5):
    assert "rope_theta" not in hf and "rope_scaling" not in hf and "rope_parameters" in hf
  assert LLAMA_3_2_1B_V5["rope_parameters"] == {
      "rope_type": "llama3", "factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
      "original_max_position_embeddings": 8192, "rope_theta": 500000.0}


@pytest.mark.parametrize("name,hf", [
    ("llama-3.2-1b", LLAMA_3_2_1B_V4), ("llama-3.2-1b", LLAMA_3_2_1B_V5),
    ("qwen3-0.6b", QWEN3_0_6B_V4), ("qwen3-0.6b", QWEN3_0_6B_V5),
], ids=["llama_v4", "llama_v5", "qwen3_v4", "qwen3_v5"])
def test_published_configs_read_the_same_in_both_layouts(name, hf):
  assert LlamaConfig.from_hf_config(hf) == CONFIGS[name]


def test_rope_parameters_are_read_not_defaulted():
  """theta and scaling come from ``rope_parameters``: a reader that ignored it would give
  transformers 4's defaults (10000, no scaling), which is the silent wrong answer."""
  cfg = LlamaConfig.from_hf_config(LLAMA_3_2_1B_V5)
  assert cfg.rope_theta == 500000.0
  assert cfg.rope_scaling == layout.RopeScaling(32.0, 1.0, 4.0, 8192)
  assert LlamaConfig.from_hf_config(QWEN3_0_6B_V5).rope_theta == 1e6
  nested = LLAMA_3_2_1B_V5 | {"rope_parameters": {
      "full_attention": LLAMA_3_2_1B_V5["rope_parameters"]}}  # 5's per-layer-type form
  assert rope_from_hf_config(nested) == (500000.0, cfg.rope_scaling)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_written_configs_carry_both_layouts(name):
  """to_hf_config writes RoPE so that a 4.x and a 5.x reader both get it: the 5.x dict
  alone and the 4.x keys alone each read back to the config."""
  cfg = CONFIGS[name]
  hf = cfg.to_hf_config()
  assert hf["rope_parameters"]["rope_theta"] == hf["rope_theta"] == cfg.rope_theta
  assert hf["dtype"] == hf["torch_dtype"] == "float32"
  only_v5 = {k: v for k, v in hf.items() if k not in ("rope_theta", "rope_scaling")}
  only_v4 = {k: v for k, v in hf.items() if k != "rope_parameters"}
  assert LlamaConfig.from_hf_config(only_v5) == cfg
  assert LlamaConfig.from_hf_config(only_v4) == cfg


LLAMA3 = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 32.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("change,match", [
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}},
     r"rope_parameters type 'yarn': only 'default' and 'llama3'"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e6, "factor": 2.0}},
     r"rope_parameters type 'dynamic'"),
    ({"rope_parameters": LLAMA3 | {"attention_factor": 0.5}},
     r"rope_parameters\['attention_factor'\]=0.5: not understood for rope_type 'llama3'"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "factor": 8.0}},
     r"rope_parameters\['factor'\]=8.0: not understood for rope_type 'default'"),
    ({"rope_parameters": LLAMA3 | {"partial_rotary_factor": 0.5}},
     r"rope_parameters\['partial_rotary_factor'\]=0.5"),
    ({"rope_parameters": {k: v for k, v in LLAMA3.items() if k != "low_freq_factor"}},
     r"rope_parameters of rope_type 'llama3' lacks \['low_freq_factor'\]"),
    ({"rope_parameters": LLAMA3 | {"factor": "32"}}, r"rope_parameters\['factor'\]='32' must"),
    ({"rope_parameters": {"rope_type": "llama3"} | {k: v for k, v in LLAMA3.items()
                                                     if k != "rope_theta"}},
     r"rope_parameters has no rope_theta"),
    ({"rope_parameters": [500000.0]}, r"rope_parameters=\[500000.0\] must be a dict"),
    ({"rope_parameters": {"factor": 4.0}}, r"has no rope_type or rope_theta"),
    ({"rope_parameters": {"full_attention": LLAMA3, "sliding_attention": LLAMA3}},
     r"keyed by layer type"),
    ({"rope_parameters": LLAMA3, "rope_theta": 1e4}, r"rope_theta=10000.0 disagrees"),
    ({"rope_parameters": LLAMA3, "rope_scaling": LLAMA3 | {"factor": 8.0}},
     r"rope_scaling=.* disagrees with rope_parameters"),
    ({"rope_scaling": "llama3"}, r"rope_scaling='llama3' must be a dict or null"),
    ({"rope_scaling": {"rope_type": "longrope"}}, r"rope_scaling type 'longrope'"),
    ({"rope_theta": "500000"}, r"rope_theta='500000' must be a finite number"),
    ({"partial_rotary_factor": 0.5}, r"partial_rotary_factor=0.5"),
    ({"layer_types": ["full_attention", "sliding_attention"]},
     r"layer_types holds \['sliding_attention'\]"),
], ids=["yarn", "dynamic", "unknown_key", "default_with_factor", "partial_in_params",
        "llama3_missing_key", "string_factor", "no_theta", "not_a_dict", "no_type",
        "per_layer_sliding", "theta_disagrees", "scaling_disagrees", "v4_not_a_dict",
        "v4_longrope", "v4_string_theta", "partial_top_level", "sliding_layers"])
def test_refuses_what_it_does_not_understand(change, match):
  base = {k: v for k, v in LLAMA_3_2_1B_V4.items() if k not in ("rope_theta", "rope_scaling")}
  with pytest.raises(ValueError, match=match):
    LlamaConfig.from_hf_config(base | change)


def test_neutral_extras_are_accepted():
  """What transformers 5 itself leaves in a plain config reads without complaint."""
  hf = QWEN3_0_6B_V5 | {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                                            "partial_rotary_factor": 1.0}}
  assert LlamaConfig.from_hf_config(hf) == CONFIGS["qwen3-0.6b"]


def _logits(model, tokens, positions):
  with jax.default_matmul_precision("highest"):
    return np.asarray(model(tokens, positions), np.float64)


@pytest.mark.parametrize("name,scaling,theta", [
    ("tiny", layout.RopeScaling(4.0, 1.0, 4.0, 64), 5e5),
    ("qwen3-tiny", None, 1e6),
], ids=["llama3_scaled", "qwen3"])
def test_checkpoints_in_both_layouts_give_the_same_logits(tmp_path, name, scaling, theta):
  """One model saved, its config.json rewritten in each layout: both load to the same
  logits as the model itself, at positions where theta and the scaling both matter."""
  cfg = get_config(name, n_layers=2, rope_theta=theta, rope_scaling=scaling,
                   dtype=jnp.float32)
  model = Llama(cfg, rngs=nnx.Rngs(0), fused=False)
  save_hf_checkpoint(model, tmp_path)
  written = json.loads((tmp_path / "config.json").read_text())
  tokens = jax.random.randint(jax.random.key(1), (2, 32), 0, cfg.vocab_size)
  positions = jnp.broadcast_to(jnp.arange(4000, 4032, dtype=jnp.int32), tokens.shape)
  want = _logits(model, tokens, positions)
  layouts = {"v4": {k: v for k, v in written.items() if k != "rope_parameters"},
             "v5": {k: v for k, v in written.items() if k not in ("rope_theta",
                                                                 "rope_scaling")}}
  for label, hf in layouts.items():
    (tmp_path / "config.json").write_text(json.dumps(hf))
    loaded = load_hf_checkpoint(tmp_path, fused=False, dtype=jnp.float32)
    assert loaded.config == cfg, label
    np.testing.assert_array_equal(_logits(loaded, tokens, positions), want, err_msg=label)
  # The positions are far enough out that a reader which dropped theta or the scaling
  # (transformers 4's defaults) would be visibly wrong.
  wrong = Llama(cfg.replace(rope_theta=10000.0, rope_scaling=None), rngs=nnx.Rngs(0),
                fused=False)
  diff = np.linalg.norm(_logits(wrong, tokens, positions) - want) / np.linalg.norm(want)
  assert diff > 1e-2, diff
