"""flax_layers.gpt2: the GPT-2 model fused (coda_jax.layernorm_ops) against the same
parameters on the plain-jnp reference path, loss, logits and every parameter's gradient
under the tolerance rule (fp32 reference = truth; bf16 reference = the unfused baseline);
Hugging Face conversion against an independent float64 numpy GPT-2 written here from the
(in, out) Conv1D layout; safetensors directories; the config and its errors.

Most cases run the fused ops' XLA programs (impl "xla"); one small case runs the kernels
(``kernel_impl``: the Mosaic GPU interpreter on CPU). Every width differs, so a weight
taken for another shows: D = 128, 3D = 384, F = 4D = 512, V = 320, n_positions = 96."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from coda_jax.jnp_reference import cross_entropy
from flax_layers import train
from flax_layers.gpt2 import (GPT2, GPT2_CONFIGS, GPT2Config, get_gpt2_config,
                              gpt2_from_hf_state_dict, gpt2_hf_keys, gpt2_to_hf_state_dict,
                              load_gpt2_checkpoint, save_gpt2_checkpoint)
from helpers import MODEL_RUNS, assert_within_baseline, check_model_loss_and_grads, normal

CFG = GPT2Config(vocab_size=320, n_positions=96, d_model=128, n_layers=3, n_heads=2,
                 init_std=0.1, impl="xla")
B, T = 2, 64
RUNS = MODEL_RUNS  # (name, fused, dtype): ours, the truth, the baseline
N_PARAMS = 4 + 12  # wte, wpe, norm_f, norm_f_bias + 12 stacked per-layer tensors


def _perturb_vectors(model, key):
  """LayerNorm weights away from 1 and biases away from 0 (their init), so that every
  one of them shapes the output and its gradient is exercised."""
  state = nnx.state(model, nnx.Param)
  leaves, tree = jax.tree_util.tree_flatten_with_path(state)
  ks = jax.random.split(key, len(leaves))
  new = [v + 0.2 * normal(k, v.shape) if any(w in jax.tree_util.keystr(p)
                                             for w in ("norm", "bias")) else v
         for (p, v), k in zip(leaves, ks)]
  nnx.update(model, jax.tree_util.tree_unflatten(tree, new))


def _tokens(key, vocab=CFG.vocab_size, b=B, t=T):
  toks = jax.random.randint(key, (b, t + 1), 0, vocab)
  return toks[:, :-1], toks[:, 1:]


def _model(cfg, fused, key, dt):
  m = GPT2(cfg.replace(dtype=dt), fused=fused, rngs=nnx.Rngs(5))
  _perturb_vectors(m, key)
  return m


def _check_loss_and_grads(cfg, key, b=B, t=T):
  toks, tgt = _tokens(key, cfg.vocab_size, b, t)
  check_model_loss_and_grads(lambda fused, dt: _model(cfg, fused, key, dt), toks,
                             tgt.at[0, :3].set(-100), N_PARAMS)


@pytest.mark.parametrize("mlp_residuals", ["slope", "recompute"])
def test_loss_and_every_gradient(mlp_residuals):
  """The training loss token by token and the gradient of every parameter (embeddings,
  LayerNorm weights and biases, GEMM weights and biases), fused vs reference, with
  either of the MLP's saved residuals."""
  _check_loss_and_grads(CFG.replace(mlp_residuals=mlp_residuals), jax.random.key(11))


def test_loss_and_gradients_through_kernels(kernel_impl):
  """The same with the GEMM-epilogue kernels. Through the interpreter (CPU): one small
  layer. Compiled (GPU): two layers of D = 256, so the scan's shifted op runs and both
  LayerNorms' input gradients take the one-GEMM path (D a multiple of its cluster
  tile)."""
  if kernel_impl == "interpret":
    cfg, b, t = CFG.replace(n_layers=1, vocab_size=256, impl=kernel_impl), 1, 64
  else:  # 192 tokens: the last 128-row block half past M
    cfg, b, t = CFG.replace(n_layers=2, d_model=256, vocab_size=256, impl=kernel_impl), 2, 96
  _check_loss_and_grads(cfg, jax.random.key(12), b=b, t=t)


def test_logits():
  """``__call__``'s logits under the tolerance rule; in fp32 the reference's logits
  give exactly its training loss."""
  key = jax.random.key(13)
  toks, tgt = _tokens(key)
  runs = {}
  for name, fused, dt in RUNS:
    with jax.default_matmul_precision("highest"):
      runs[name] = _model(CFG, fused, key, dt)(toks)
  assert runs["ours"].shape == (B, T, CFG.vocab_size) and runs["ours"].dtype == jnp.float32
  assert_within_baseline(runs["ours"], runs["truth"], runs["base"], "logits")
  with jax.default_matmul_precision("highest"):
    loss = _model(CFG, False, key, jnp.float32).loss(toks, tgt)
  again = cross_entropy(runs["truth"].reshape(-1, CFG.vocab_size), tgt.reshape(-1))
  np.testing.assert_allclose(float(loss), float(again), rtol=1e-5)


# ---- an independent GPT-2 on Hugging Face tensors, float64 numpy ----------------------------
def _ln(x, w, b, eps):
  mu = x.mean(-1, keepdims=True)
  var = ((x - mu) ** 2).mean(-1, keepdims=True)
  return (x - mu) / np.sqrt(var + eps) * w + b


def _gelu_new(a):
  return 0.5 * a * (1 + np.tanh(np.sqrt(2 / np.pi) * (a + 0.044715 * a ** 3)))


def _numpy_gpt2_logits(sd, cfg, toks):
  """GPT-2 (GPT2LMHeadModel's math) from a Hugging Face state dict: Conv1D y = x @ W + b
  with W (in, out); c_attn's output split into q, k, v, each into heads; float64."""
  w = lambda n: np.asarray(sd[n], np.float64)
  toks = np.asarray(toks)
  b, t = toks.shape
  nh, hd, eps = cfg.n_heads, cfg.d_model // cfg.n_heads, cfg.eps
  x = w("transformer.wte.weight")[toks] + w("transformer.wpe.weight")[np.arange(t)][None]
  causal = np.tril(np.ones((t, t), bool))
  for i in range(cfg.n_layers):
    p = lambda n: w(f"transformer.h.{i}.{n}")
    h = _ln(x, p("ln_1.weight"), p("ln_1.bias"), eps)
    qkv = h @ p("attn.c_attn.weight") + p("attn.c_attn.bias")
    q, k, v = (a.reshape(b, t, nh, hd).transpose(0, 2, 1, 3) for a in np.split(qkv, 3, -1))
    s = np.where(causal, q @ k.transpose(0, 1, 3, 2) / np.sqrt(hd), -np.inf)
    s = np.exp(s - s.max(-1, keepdims=True))
    o = (s / s.sum(-1, keepdims=True)) @ v
    o = o.transpose(0, 2, 1, 3).reshape(b, t, nh * hd)
    x = x + o @ p("attn.c_proj.weight") + p("attn.c_proj.bias")
    h = _ln(x, p("ln_2.weight"), p("ln_2.bias"), eps)
    a = _gelu_new(h @ p("mlp.c_fc.weight") + p("mlp.c_fc.bias"))
    x = x + a @ p("mlp.c_proj.weight") + p("mlp.c_proj.bias")
  n = _ln(x, w("transformer.ln_f.weight"), w("transformer.ln_f.bias"), eps)
  return n @ w("transformer.wte.weight").T


def _random_hf_state_dict(cfg, key):
  """Fresh random tensors under every name, shaped as Hugging Face's (from a model's
  export); LayerNorm weights around 1, everything else around 0."""
  shapes = {k: v.shape for k, v in
            gpt2_to_hf_state_dict(GPT2(cfg, rngs=nnx.Rngs(0))).items()}
  ks = jax.random.split(key, len(shapes))
  return {k: np.asarray((1.0 if k.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight"))
                         else 0.0) + 0.2 * normal(kk, shapes[k]))
          for k, kk in zip(sorted(shapes), ks)}


def test_hf_shapes_and_names():
  """The export holds GPT2LMHeadModel's names and Conv1D's (in, out) shapes."""
  c = CFG
  sd = gpt2_to_hf_state_dict(GPT2(c, rngs=nnx.Rngs(0)))
  assert sorted(sd) == sorted(gpt2_hf_keys(c))
  d, f = c.d_model, c.ffn_dim
  want = {"transformer.wte.weight": (c.vocab_size, d),
          "transformer.wpe.weight": (c.n_positions, d), "transformer.ln_f.bias": (d,),
          "transformer.h.2.attn.c_attn.weight": (d, 3 * d),
          "transformer.h.2.attn.c_attn.bias": (3 * d,),
          "transformer.h.0.attn.c_proj.weight": (d, d),
          "transformer.h.1.mlp.c_fc.weight": (d, f), "transformer.h.1.mlp.c_fc.bias": (f,),
          "transformer.h.0.mlp.c_proj.weight": (f, d), "transformer.h.0.ln_2.bias": (d,)}
  for k, shape in want.items():
    assert sd[k].shape == shape, (k, sd[k].shape, shape)


def test_hf_round_trip_against_independent_forward():
  """A random Hugging Face state dict loads, exports back bit for bit, and gives the
  logits of the independent numpy GPT-2, on the reference path and on the fused one
  (fp32: the fused ops' XLA programs, so their wiring is checked to fp32 rounding); the
  fused fp32 loss is the numpy logits' cross-entropy."""
  cfg = CFG.replace(dtype=jnp.float32)
  sd = _random_hf_state_dict(cfg, jax.random.key(21))
  toks, tgt = _tokens(jax.random.key(22))
  want = _numpy_gpt2_logits(sd, cfg, toks)
  for fused in (False, True):
    m = gpt2_from_hf_state_dict(GPT2(cfg, fused=fused, rngs=nnx.Rngs(1)), sd)
    back = gpt2_to_hf_state_dict(m)
    assert set(back) == set(sd) and all(np.array_equal(back[k], sd[k]) for k in sd)
    with jax.default_matmul_precision("highest"):
      got = np.asarray(m(toks), np.float64)
      loss = float(m.loss(toks, tgt))
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert err < 1e-5, (fused, err)
    z = want.reshape(-1, cfg.vocab_size)
    lse = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)
    ce = np.mean(lse - z[np.arange(z.shape[0]), np.asarray(tgt).reshape(-1)])
    np.testing.assert_allclose(loss, ce, rtol=1e-5, err_msg=f"fused={fused}")


def test_hf_gpt2model_names_buffers_and_tied_head():
  """GPT2Model-style names (no ``transformer.`` prefix, as the hub's ``gpt2`` holds),
  causal-mask buffers and a tied ``lm_head.weight`` load the same parameters."""
  sd = _random_hf_state_dict(CFG, jax.random.key(23))
  bare = {k.removeprefix("transformer."): v for k, v in sd.items()}
  for i in range(CFG.n_layers):
    bare[f"h.{i}.attn.bias"] = np.tril(np.ones((1, 1, 8, 8), bool))
    bare[f"h.{i}.attn.masked_bias"] = np.asarray(-1e4, np.float32)
  bare["lm_head.weight"] = sd["transformer.wte.weight"]
  m = gpt2_from_hf_state_dict(GPT2(CFG, rngs=nnx.Rngs(2)), bare)
  back = gpt2_to_hf_state_dict(m)
  assert all(np.array_equal(back[k], sd[k]) for k in sd)


def test_hf_state_dict_errors():
  m = GPT2(CFG, rngs=nnx.Rngs(0))
  sd = gpt2_to_hf_state_dict(m)
  with pytest.raises(ValueError, match=r"missing \['transformer\.h\.1\.ln_2\.bias'\]"):
    gpt2_from_hf_state_dict(m, {k: v for k, v in sd.items()
                                if k != "transformer.h.1.ln_2.bias"})
  bad = dict(sd, **{"transformer.h.0.attn.c_proj.weight": np.zeros((CFG.d_model, 3))})
  with pytest.raises(ValueError, match=r"differs in shape between layers"):
    gpt2_from_hf_state_dict(m, bad)
  bad = dict(sd, **{"transformer.ln_f.weight": np.zeros((3,))})
  with pytest.raises(ValueError, match=r"transformer\.ln_f\.weight has shape \(3,\)"):
    gpt2_from_hf_state_dict(m, bad)
  untied = dict(sd, **{"lm_head.weight": sd["transformer.wte.weight"] + 1})
  with pytest.raises(ValueError, match="ties its head"):
    gpt2_from_hf_state_dict(m, untied)


@pytest.mark.parametrize("shard", [None, 300_000])
def test_checkpoint_directory_round_trip(tmp_path, shard):
  cfg = CFG.replace(n_layers=2)
  model = GPT2(cfg, fused=False, rngs=nnx.Rngs(1))
  _perturb_vectors(model, jax.random.key(31))
  kw = {} if shard is None else {"max_shard_bytes": shard}
  names = sorted(f.name for f in save_gpt2_checkpoint(model, tmp_path, **kw))
  if shard is None:
    assert names == ["config.json", "model.safetensors"]
  else:
    assert "model.safetensors.index.json" in names and len(names) >= 4, names
  back = load_gpt2_checkpoint(tmp_path, fused=False, seed=7, init_std=cfg.init_std,
                              impl=cfg.impl)
  assert back.config == cfg
  for a, b in zip(jax.tree.leaves(nnx.state(back, nnx.Param)),
                  jax.tree.leaves(nnx.state(model, nnx.Param))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ---- config ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(GPT2_CONFIGS))
def test_named_configs_round_trip_hf(name):
  cfg = get_gpt2_config(name)
  assert cfg.ffn_dim == 4 * cfg.d_model and cfg.head_dim % 64 == 0
  for n in (cfg.d_model, cfg.ffn_dim, cfg.vocab_size):
    assert n % 64 == 0, (name, n)
  hf = cfg.to_hf_config()
  assert hf["n_embd"] == cfg.d_model and hf["activation_function"] == "gelu_new"
  assert GPT2Config.from_hf_config(hf) == cfg
  odd = cfg.replace(ffn_dim=3 * cfg.d_model, eps=1e-6)
  assert GPT2Config.from_hf_config(odd.to_hf_config()) == odd
  assert get_gpt2_config("gpt2-small").param_count() == 124_475_904  # GPT-2 small, V 50304


@pytest.mark.parametrize("field,value,match", [
    ("d_model", 0, "d_model=0"), ("n_layers", -1, "n_layers=-1"),
    ("vocab_size", 1.5, "vocab_size=1.5"), ("n_heads", 3, "not divisible by n_heads=3"),
    ("n_heads", 16, "head_dim .* = 8 must be a multiple of 16"), ("eps", 0.0, "eps=0.0"),
    ("eps", float("nan"), "eps=nan"), ("init_std", -0.1, "init_std=-0.1"),
    ("dtype", jnp.int8, "dtype="), ("impl", "cuda", "impl='cuda'"),
    ("ffn_dim", 0, "ffn_dim=0"), ("mlp_residuals", "z", "mlp_residuals='z'")])
def test_bad_config_values(field, value, match):
  with pytest.raises(ValueError, match=match):
    CFG.replace(**{field: value})


@pytest.mark.parametrize("change,match", [
    ({"model_type": "llama"}, "model_type='llama'"),
    ({"activation_function": "relu"}, "activation_function='relu'"),
    ({"tie_word_embeddings": False}, "tie_word_embeddings=False"),
    ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx=True"),
    ({"n_head": None}, "lacks")])
def test_bad_hf_configs(change, match):
  hf = CFG.to_hf_config() | change
  hf = {k: v for k, v in hf.items() if v is not None or k == "n_inner"}
  with pytest.raises(ValueError, match=match):
    GPT2Config.from_hf_config(hf)


def test_bad_inputs():
  m = GPT2(CFG, fused=False, rngs=nnx.Rngs(0))
  toks = jnp.zeros((1, 8), jnp.int32)
  with pytest.raises(ValueError, match="token id 320"):
    m.loss(toks.at[0, 3].set(320), toks)
  with pytest.raises(ValueError, match="exceeds n_positions=96"):
    m(jnp.zeros((1, 97), jnp.int32))
  with pytest.raises(ValueError, match="position 96"):
    m(toks, positions=toks.at[0, 1].set(96))


def test_train_step_and_no_decay_on_vectors():
  """A jitted AdamW step lowers the loss; LayerNorm weights/biases and GEMM biases are
  not weight-decayed, matrices and embeddings are."""
  m = GPT2(CFG.replace(n_layers=1), rngs=nnx.Rngs(0))
  mask = train._decay_mask(nnx.to_pure_dict(nnx.state(m, nnx.Param)))
  flat = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_flatten_with_path(mask)[0]}
  decayed = sorted(k for k, v in flat.items() if v)
  assert len(decayed) == 6 and all(("norm" not in k and "bias" not in k) for k in decayed), \
      decayed
  gdef, state = train.init_state(m, train.make_optimizer(3e-3, total_steps=10))
  step = train.make_train_step(gdef)
  toks, tgt = _tokens(jax.random.key(41), b=2, t=32)
  losses = []
  for _ in range(4):
    state, loss = step(state, toks, tgt)
    losses.append(float(loss))
  assert losses[-1] < losses[0], losses
