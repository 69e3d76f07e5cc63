"""Our Hugging Face checkpoint directories, loaded by the reference implementation:
Hugging Face ``transformers`` itself (its Flax models, so no torch is needed), which reads
``config.json`` and the PyTorch-format safetensors as it would a downloaded model. The
logits it computes from the files must be ours: names, (out, in) shapes, GPT-2's Conv1D
(in, out) weights, the q/k row order that its rotate-half RoPE expects, grouped KV heads,
eps and theta all have to be right for that.

transformers 4.57 is the last release with Flax models, and is in the ``test`` extra. Its
Flax Llama knows no RoPE scaling, fixes theta at 10000 (it does not read ``rope_theta``)
and has no tied head (it makes a fresh ``lm_head``), so the Llama here is unscaled, of
theta 10000 and untied; those are checked against our own reader and an independent
formula instead (test_hf_checkpoint.py, test_rope_scaling.py). Where transformers has no
Flax models (5.x, as on the GPU host, which has torch) its PyTorch models run on the CPU
instead; with neither, the model comparisons skip and say why. Nothing is downloaded."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open

from coda_jax import layout
from flax_layers import Llama, get_config, load_hf_checkpoint, save_hf_checkpoint
from flax_layers.gpt2 import GPT2, get_gpt2_config, save_gpt2_checkpoint

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (the 'test' extra has it; the GPU "
                           "host has no network to install it)")

# fp32 on both sides: what is left is summation order (~1e-6), where one swapped weight,
# one mis-ordered q/k row or a wrong eps gives 1e-2 and more
TOL = 1e-5


def _tokens(vocab, key=3):
  return np.asarray(jax.random.randint(jax.random.key(key), (2, 48), 0, vocab))


def _their_logits(flax_class: str, torch_class: str, path, tokens):
  """Logits of transformers' own model loaded from ``path``: its Flax class where this
  transformers has Flax models (4.x), else its PyTorch class on the CPU (5.x)."""
  if hasattr(transformers, "FlaxPreTrainedModel"):
    theirs = getattr(transformers, flax_class).from_pretrained(path, from_pt=True,
                                                               dtype=jnp.float32)
    with jax.default_matmul_precision("highest"):
      return np.asarray(theirs(tokens).logits)
  torch = pytest.importorskip(
      "torch", reason=f"transformers {transformers.__version__} has no Flax models and "
                      "torch is not installed: nothing to run its model with")
  theirs = getattr(transformers, torch_class).from_pretrained(path, dtype=torch.float32)
  with torch.no_grad():
    return theirs(torch.as_tensor(tokens)).logits.numpy()


def _rope_theta(hf_cfg) -> float:
  """theta as transformers read it: an attribute in 4.x, in ``rope_parameters`` in 5.x."""
  if hasattr(hf_cfg, "rope_parameters") and hf_cfg.rope_parameters:
    return hf_cfg.rope_parameters["rope_theta"]
  return hf_cfg.rope_theta


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.parametrize("n_kv_heads", [2, 4])
def test_transformers_loads_our_llama_checkpoint(tmp_path, n_kv_heads):
  cfg = get_config("tiny", n_layers=2, n_kv_heads=n_kv_heads, rope_theta=1e4, eps=1e-6,
                   dtype=jnp.float32)
  model = Llama(cfg, rngs=nnx.Rngs(1), fused=False)
  save_hf_checkpoint(model, tmp_path)
  hf_cfg = transformers.AutoConfig.from_pretrained(tmp_path)
  assert (hf_cfg.model_type, hf_cfg.num_key_value_heads, _rope_theta(hf_cfg),
          hf_cfg.rms_norm_eps, hf_cfg.tie_word_embeddings) == ("llama", n_kv_heads, 1e4,
                                                              1e-6, False)
  tokens = _tokens(cfg.vocab_size)
  want = _their_logits("FlaxLlamaForCausalLM", "LlamaForCausalLM", tmp_path, tokens)
  with jax.default_matmul_precision("highest"):
    got = model(jnp.asarray(tokens))
  assert _rel(got, want) < TOL, _rel(got, want)


def test_transformers_reads_a_tied_llama_config(tmp_path):
  """Tied: the files hold no lm_head.weight and config.json says tie_word_embeddings,
  which is how transformers' (PyTorch) Llama ties the head to the embedding."""
  cfg = get_config("tiny", n_layers=1, tie_embeddings=True)
  save_hf_checkpoint(Llama(cfg, rngs=nnx.Rngs(0), fused=False), tmp_path)
  assert transformers.AutoConfig.from_pretrained(tmp_path).tie_word_embeddings is True
  assert json.loads((tmp_path / "config.json").read_text())["tie_word_embeddings"] is True
  with safe_open(str(tmp_path / "model.safetensors"), framework="numpy") as f:
    assert "lm_head.weight" not in set(f.keys()) and "model.embed_tokens.weight" in set(f.keys())


def test_transformers_loads_our_gpt2_checkpoint(tmp_path):
  cfg = get_gpt2_config("gpt2-tiny", n_layers=2, dtype=jnp.float32)
  model = GPT2(cfg, rngs=nnx.Rngs(2), fused=False)
  # biases and LayerNorm weights away from their init (0 and 1), each by its own noise, so
  # that a bias or norm the files dropped, misplaced or swapped with its twin shows
  state = nnx.state(model, nnx.Param)
  leaves, tree = jax.tree.flatten(state)
  nnx.update(model, jax.tree.unflatten(tree, [
      v + 0.05 * jax.random.normal(jax.random.key(i), v.shape, v.dtype) if v.ndim <= 2 else v
      for i, v in enumerate(leaves)]))
  save_gpt2_checkpoint(model, tmp_path)
  assert transformers.AutoConfig.from_pretrained(tmp_path).model_type == "gpt2"
  tokens = _tokens(cfg.vocab_size, 4)
  want = _their_logits("FlaxGPT2LMHeadModel", "GPT2LMHeadModel", tmp_path, tokens)
  with jax.default_matmul_precision("highest"):
    got = model(jnp.asarray(tokens))
  assert _rel(got, want) < TOL, _rel(got, want)


# RoPE settings that transformers must read from our files, and we from theirs: Llama 3's
# scaled frequencies (original context 64, so that short sequences at positions from 4000
# reach every branch of the scaling) and Qwen3's theta of 1e6. Either one misread changes
# the logits there by far more than TOL.
ROPE_CASES = {
    "llama3_scaled": dict(name="tiny", rope_theta=5e5,
                          rope_scaling=layout.RopeScaling(4.0, 1.0, 4.0, 64)),
    "qwen3": dict(name="qwen3-tiny", rope_theta=1e6, rope_scaling=None),
}
FAR = 4000  # the first position of the RoPE cases' tokens


def _rope_config(case):
  kw = dict(ROPE_CASES[case])
  return get_config(kw.pop("name"), n_layers=2, dtype=jnp.float32, **kw)


def _their_rope(hf_cfg):
  """(theta, scaling dict or None) as this transformers read them."""
  params = getattr(hf_cfg, "rope_parameters", None)
  if params:  # 5.x
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    return params["rope_theta"], None if scaling.get("rope_type") == "default" else scaling
  return hf_cfg.rope_theta, hf_cfg.rope_scaling


def _positions(tokens):
  return np.broadcast_to(np.arange(FAR, FAR + tokens.shape[1]), tokens.shape)


def _needs_torch_models():
  if hasattr(transformers, "FlaxPreTrainedModel"):
    pytest.skip(f"transformers {transformers.__version__}'s Flax Llama fixes theta at 10000 "
                "and knows no scaling: the logits are compared where transformers 5 (with "
                "torch) runs, as on the GPU host; the config is checked here")
  return pytest.importorskip("torch", reason=f"transformers {transformers.__version__} has "
                                             "no Flax models and torch is not installed")


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_transformers_reads_our_rope_settings(tmp_path, case):
  cfg = _rope_config(case)
  save_hf_checkpoint(Llama(cfg, rngs=nnx.Rngs(0), fused=False), tmp_path)
  theta, scaling = _their_rope(transformers.AutoConfig.from_pretrained(tmp_path))
  assert theta == cfg.rope_theta
  if cfg.rope_scaling is None:
    assert not scaling
  else:
    assert {k: scaling[k] for k in ("rope_type", "factor", "low_freq_factor",
                                    "high_freq_factor", "original_max_position_embeddings")
            } == {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_transformers_computes_our_rope(tmp_path, case):
  """Their model from our files, at positions from 4000: theta and scaling reached it."""
  torch = _needs_torch_models()
  cfg = _rope_config(case)
  model = Llama(cfg, rngs=nnx.Rngs(0), fused=False)
  save_hf_checkpoint(model, tmp_path)
  tokens = _tokens(cfg.vocab_size, 5)
  cls = "Qwen3ForCausalLM" if cfg.qk_norm else "LlamaForCausalLM"
  theirs = getattr(transformers, cls).from_pretrained(tmp_path, dtype=torch.float32)
  with torch.no_grad():
    want = theirs(torch.as_tensor(tokens), position_ids=torch.as_tensor(
        _positions(tokens).copy())).logits.numpy()
  with jax.default_matmul_precision("highest"):
    got = model(jnp.asarray(tokens), jnp.asarray(_positions(tokens), jnp.int32))
  assert _rel(got, want) < TOL, _rel(got, want)


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_we_read_the_config_this_transformers_writes(tmp_path, case):
  """config.json as this transformers' own config class writes it (4.x keys in 4.x,
  ``rope_parameters`` in 5.x), beside our weights: our model loads to the same logits."""
  cfg = _rope_config(case)
  model = Llama(cfg, rngs=nnx.Rngs(0), fused=False)
  save_hf_checkpoint(model, tmp_path)
  hf = json.loads((tmp_path / "config.json").read_text())
  v4 = {k: v for k, v in hf.items() if k not in ("rope_parameters", "dtype")}
  their_class = transformers.Qwen3Config if cfg.qk_norm else transformers.LlamaConfig
  their_class(**v4).save_pretrained(tmp_path)
  written = json.loads((tmp_path / "config.json").read_text())
  if hasattr(transformers, "FlaxPreTrainedModel"):  # 4.x
    assert "rope_theta" in written
  else:
    assert "rope_parameters" in written and "rope_theta" not in written
  loaded = load_hf_checkpoint(tmp_path, fused=False, dtype=jnp.float32)
  assert (loaded.config.rope_theta, loaded.config.rope_scaling) == (cfg.rope_theta,
                                                                    cfg.rope_scaling)
  tokens = jnp.asarray(_tokens(cfg.vocab_size, 6))
  positions = jnp.asarray(_positions(tokens), jnp.int32)
  with jax.default_matmul_precision("highest"):
    assert _rel(loaded(tokens, positions), model(tokens, positions)) < 1e-6


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_we_load_a_checkpoint_transformers_saved(tmp_path, case):
  """A model built and saved by transformers itself (``save_pretrained``), loaded here:
  the same logits as theirs at positions from 4000."""
  torch = _needs_torch_models()
  cfg = _rope_config(case)
  hf = cfg.to_hf_config()
  v4 = {k: v for k, v in hf.items() if k not in ("rope_parameters", "dtype", "torch_dtype")}
  torch.manual_seed(0)
  cls = "Qwen3ForCausalLM" if cfg.qk_norm else "LlamaForCausalLM"
  config_class = transformers.Qwen3Config if cfg.qk_norm else transformers.LlamaConfig
  theirs = getattr(transformers, cls)(config_class(**v4)).to(torch.float32)
  theirs.save_pretrained(tmp_path)
  tokens = _tokens(cfg.vocab_size, 7)
  with torch.no_grad():
    want = theirs(torch.as_tensor(tokens), position_ids=torch.as_tensor(
        _positions(tokens).copy())).logits.numpy()
  ours = load_hf_checkpoint(tmp_path, fused=False, dtype=jnp.float32)
  with jax.default_matmul_precision("highest"):
    got = ours(jnp.asarray(tokens), jnp.asarray(_positions(tokens), jnp.int32))
  assert _rel(got, want) < TOL, _rel(got, want)
