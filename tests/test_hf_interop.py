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

from flax_layers import Llama, get_config, save_hf_checkpoint
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
