"""Llama 3.1/3.2's "llama3" RoPE frequency scaling: the frequencies against an
independent implementation of the formula, the fused QKV op and the model with it, and
the Hugging Face config that carries it."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from coda_jax import fused_ops as F
from coda_jax import jnp_reference as ref
from coda_jax import layout
from flax_layers import CONFIGS, Llama, LlamaConfig, get_config
from helpers import assert_within_baseline, normal

SCALING = layout.RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                             original_context=8192)


def llama3_frequencies_f64(head_dim, theta, factor, low, high, context):
  """The published rule, frequency by frequency, in float64: keep the fast rotations
  (wavelength under context / high), divide the slow ones (over context / low) by
  ``factor``, and between the two interpolate in context / wavelength."""
  out = []
  for j in range(head_dim // 2):
    base = 1.0 / theta ** (2.0 * j / head_dim)
    wavelength = 2.0 * math.pi / base
    if wavelength < context / high:
      out.append(base)
    elif wavelength > context / low:
      out.append(base / factor)
    else:
      smooth = (context / wavelength - low) / (high - low)
      out.append((1.0 - smooth) * base / factor + smooth * base)
  return np.array(out)


@pytest.mark.parametrize("head_dim,theta,factor,low,high,context", [
    (64, 500000.0, 32.0, 1.0, 4.0, 8192),    # Llama-3.2-1B / 3B
    (128, 500000.0, 8.0, 1.0, 4.0, 8192),    # Llama-3.1-8B
    (128, 10000.0, 4.0, 2.0, 8.0, 2048),     # other factors: every branch is taken
])
def test_frequencies_match_an_independent_formula(head_dim, theta, factor, low, high, context):
  scaling = layout.RopeScaling(factor, low, high, context)
  got = np.asarray(layout.rope_inv_freqs(head_dim, theta, scaling), np.float64)
  want = llama3_frequencies_f64(head_dim, theta, factor, low, high, context)
  np.testing.assert_allclose(got, want, rtol=2e-6)
  base = llama3_frequencies_f64(head_dim, theta, 1.0, low, high, context)
  # All three regimes occur: unchanged, divided by factor, and in between.
  assert np.any(np.isclose(want, base)) and np.any(np.isclose(want, base / factor))
  assert np.any(~np.isclose(want, base) & ~np.isclose(want, base / factor))


def test_qkv_frequency_operand_is_scaled_per_head_and_skips_v():
  hd = 64
  freqs = np.asarray(ref.qkv_freqs(4, 2, hd, 500000.0, SCALING)).reshape(8, hd)
  inv = llama3_frequencies_f64(hd, 500000.0, 32.0, 1.0, 4.0, 8192)
  for head in range(6):  # q and k heads: both halves of a head carry the same frequency
    np.testing.assert_allclose(freqs[head], np.concatenate([inv, inv]), rtol=2e-6)
  assert not freqs[6:].any()  # v heads pass unrotated


def test_fused_qkv_rope_with_scaling(key, kernel_impl):
  """The fused op with the scaled frequencies against float64 RoPE with the independent
  frequencies and exact angles, within 2x the unfused bf16 error; positions to 32768."""
  m, d, hq, hkv, hd = 128, 128, 2, 1, 64
  ks = jax.random.split(key, 3)
  h = normal(ks[0], (m, d)).astype(jnp.bfloat16)
  w = (normal(ks[1], (d, (hq + 2 * hkv) * hd)) * d ** -0.5).astype(jnp.bfloat16)
  r = jax.random.uniform(ks[2], (m,), jnp.float32, 0.5, 2.0)
  pos = jnp.linspace(0, 32768, m).astype(jnp.int32)
  kw = dict(n_q_heads=hq, n_kv_heads=hkv, head_dim=hd, theta=500000.0, rope_scaling=SCALING)
  got = F.rmsnorm_qkv_rope(h, r, w, pos, impl=kernel_impl, **kw)
  inv = llama3_frequencies_f64(hd, 500000.0, 32.0, 1.0, 4.0, 8192)
  z = (np.asarray(h, np.float64) @ np.asarray(w, np.float64)) * np.asarray(r, np.float64)[:, None]
  z4 = z.reshape(m, -1, 2, hd // 2)
  t = np.asarray(pos, np.float64)[:, None, None] * inv
  a, b = z4[:, :hq + hkv, 0], z4[:, :hq + hkv, 1]
  truth = z4.copy()
  truth[:, :hq + hkv, 0] = a * np.cos(t) - b * np.sin(t)
  truth[:, :hq + hkv, 1] = b * np.cos(t) + a * np.sin(t)
  unfused = ref.rmsnorm_qkv_rope(h, r, w, pos, **kw)  # bf16 jnp: the baseline's rounding
  assert_within_baseline(got, truth.reshape(m, -1), unfused, "qkv with llama3 scaling")
  plain = F.rmsnorm_qkv_rope(h, r, w, pos, impl="xla", **(kw | dict(rope_scaling=None)))
  assert float(jnp.max(jnp.abs(plain.astype(jnp.float32) - got.astype(jnp.float32)))) > 0.1


def test_model_paths_agree_with_scaling():
  """The tiny model with the scaling: fused and reference losses agree, and differ from
  the unscaled model's (the frequencies reach both paths)."""
  cfg = get_config("tiny", rope_scaling=layout.RopeScaling(4.0, 1.0, 4.0, 64))
  tokens = jax.random.randint(jax.random.key(0), (2, 128), 0, cfg.vocab_size)
  targets = jnp.roll(tokens, -1, axis=1)
  losses = {}
  for fused in (True, False):
    for scaled in (True, False):
      c = cfg if scaled else cfg.replace(rope_scaling=None)
      model = Llama(c, rngs=nnx.Rngs(0), fused=fused)
      losses[fused, scaled] = float(model.loss(tokens, targets))
  assert abs(losses[True, True] - losses[False, True]) < 2e-2
  assert losses[True, True] != losses[True, False]


HF_LLAMA_3_2_1B = {  # the fields of meta-llama/Llama-3.2-1B's config.json that matter here
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
    "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
    "hidden_act": "silu", "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "tie_word_embeddings": True, "torch_dtype": "bfloat16"}


def test_from_hf_config_reads_llama_3_2_1b():
  assert LlamaConfig.from_hf_config(HF_LLAMA_3_2_1B) == CONFIGS["llama-3.2-1b"]


def test_hf_config_round_trip():
  for name in CONFIGS:
    cfg = CONFIGS[name]
    assert LlamaConfig.from_hf_config(cfg.to_hf_config()) == cfg, name


@pytest.mark.parametrize("change,match", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling type 'yarn'"),
    ({"model_type": "mistral"}, "model_type='mistral'"),
    ({"hidden_act": "relu"}, "hidden_act='relu'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 0.5, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
     "factor=0.5 must be >= 1"),
], ids=["yarn", "mistral", "relu", "factor_below_1"])  # named: test_hf_checkpoint's reason
def test_from_hf_config_refuses_what_it_cannot_run(change, match):
  with pytest.raises(ValueError, match=match):
    LlamaConfig.from_hf_config(HF_LLAMA_3_2_1B | change)


def test_from_hf_config_names_missing_sizes():
  bad = dict(HF_LLAMA_3_2_1B)
  del bad["hidden_size"]
  with pytest.raises(ValueError, match="lacks \\['hidden_size'\\]"):
    LlamaConfig.from_hf_config(bad)
