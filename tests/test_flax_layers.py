"""flax_layers: every layer and the Llama model, fused (kernels) against the same
parameters on the plain-jnp reference path, outputs and gradients, under the tolerance
rule (fp32 reference = truth; bf16 reference = the unfused baseline); checkpoint
conversion against an independent standard-layout Llama; training steps."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from coda_jax.jnp_reference import cross_entropy
from flax_layers import (FusedMLP, LMHeadLoss, Llama, LlamaBlock, OutProjection,
                         QKVProjection, get_config, train)
from flax_layers import checkpoint as ck
from helpers import assert_within_baseline, normal

CFG = get_config("tiny", d_model=128, n_layers=3, n_q_heads=4, n_kv_heads=2, head_dim=32,
                 ffn_dim=128, init_std=0.05)
B, T = 2, 64
# Ours: fused kernels in bf16; truth: the reference in fp32 (highest precision); the
# baseline: the reference in bf16, whose error sets the tolerance.
RUNS = (("ours", True, jnp.bfloat16), ("truth", False, jnp.float32),
        ("base", False, jnp.bfloat16))


def _perturb_norms(module, key):
  """Norm weights away from 1, so their gradients and placement are exercised."""
  state = nnx.state(module, nnx.Param)
  leaves, tree = jax.tree_util.tree_flatten_with_path(state)
  ks = jax.random.split(key, len(leaves))
  new = [v + 0.2 * normal(k, v.shape) if "norm" in jax.tree_util.keystr(p) else v
         for (p, v), k in zip(leaves, ks)]
  nnx.update(module, jax.tree_util.tree_unflatten(tree, new))


def _value_and_grads(module, fn, *args):
  """fn(module, *args) -> scalar; returns (value, grads of params, grads of args)."""
  val, grads = nnx.value_and_grad(fn, argnums=tuple(range(len(args) + 1)))(module, *args)
  return val, grads[0], grads[1:]


def _check_three_ways(make, fn, args_f32, key, kernel_impl, what):
  """``make(fused, impl)`` builds the module with the same init; ``fn(module, *args)`` a
  scalar. Ours: fused kernels in bf16; truth: reference in fp32; baseline: reference in
  bf16. Compares the value, every parameter gradient and every input gradient."""
  runs = {}
  for name, fused, dt in RUNS:
    m = make(fused, kernel_impl if fused else "auto")
    _perturb_norms(m, key)
    args = [a.astype(dt) if jnp.issubdtype(a.dtype, jnp.floating) else a for a in args_f32]
    with jax.default_matmul_precision("highest"):
      runs[name] = _value_and_grads(m, fn, *args)
  for i, label in enumerate(("value", "param grads", "input grads")):
    got, truth, base = (jax.tree.leaves(runs[n][i]) for n in ("ours", "truth", "base"))
    assert len(got) == len(truth) == len(base) > 0
    for g, t, b in zip(got, truth, base):
      assert_within_baseline(g, t, b, f"{what}: {label}")


def _sum_proj(out, key):
  c = normal(key, out.shape)
  return jnp.sum(out.astype(jnp.float32) * c)


def test_fused_mlp(key, kernel_impl):
  kx, kc = jax.random.split(key)
  make = lambda fused, impl: FusedMLP(128, 128, fused=fused, impl=impl, init_std=0.1,
                                      rngs=nnx.Rngs(1))
  _check_three_ways(make, lambda m, x: _sum_proj(m(x), kc), [normal(kx, (B, T, 128))], key,
                    kernel_impl, "FusedMLP")


def test_qkv_projection(key, kernel_impl):
  kx, kc = jax.random.split(key)
  pos = jax.random.randint(kc, (B, T), 0, 4096)
  make = lambda fused, impl: QKVProjection(128, 4, 2, 32, fused=fused, impl=impl,
                                           init_std=0.1, rngs=nnx.Rngs(2))
  _check_three_ways(make, lambda m, x: _sum_proj(m(x, pos), kc), [normal(kx, (B, T, 128))],
                    key, kernel_impl, "QKVProjection")


def test_out_projection(key, kernel_impl):
  ky, kr, kc = jax.random.split(key, 3)
  make = lambda fused, impl: OutProjection(128, 128, fused=fused, impl=impl, init_std=0.1,
                                           rngs=nnx.Rngs(3))
  _check_three_ways(make, lambda m, y, r: _sum_proj(m(y, r), kc),
                    [normal(ky, (B, T, 128)), normal(kr, (B, T, 128))], key, kernel_impl,
                    "OutProjection")


def test_lm_head_loss(key, kernel_impl):
  kx, kt = jax.random.split(key)
  tgt = jax.random.randint(kt, (B, T), 0, 256).at[0, :5].set(-100)
  make = lambda fused, impl: LMHeadLoss(128, 256, fused=fused, impl=impl, init_std=0.2,
                                        rngs=nnx.Rngs(4))
  _check_three_ways(make, lambda m, x: m(x, tgt), [normal(kx, (B, T, 128))], key,
                    kernel_impl, "LMHeadLoss")


def _tokens(key, vocab=256):
  toks = jax.random.randint(key, (B, T + 1), 0, vocab)
  return toks[:, :-1], toks[:, 1:]


def _model_maker(cfg, kernel_impl):
  def make(fused, impl):
    return Llama(cfg.replace(impl=impl), fused=fused, rngs=nnx.Rngs(7))
  return make


@pytest.mark.parametrize("tied", [False, True])
def test_llama_loss_and_grads(tied, key, kernel_impl):
  """The whole model's training loss (fused blocks across layer boundaries) and the
  gradient of every parameter. The config's dtype follows the inputs' run: the model
  casts embeddings to ``config.dtype``, so build each run with its own."""
  toks, tgt = _tokens(key)
  runs = {}
  for name, fused, dt in RUNS:
    cfg = CFG.replace(tie_embeddings=tied, dtype=dt, impl=kernel_impl if fused else "auto")
    m = Llama(cfg, fused=fused, rngs=nnx.Rngs(7))
    _perturb_norms(m, key)
    with jax.default_matmul_precision("highest"):
      runs[name] = nnx.value_and_grad(lambda m: m.loss(toks, tgt))(m)
  assert_within_baseline(runs["ours"][0], runs["truth"][0], runs["base"][0], "loss")
  paths = [jax.tree_util.keystr(p) for p, _ in
           jax.tree_util.tree_flatten_with_path(runs["truth"][1])[0]]
  for p, g, t, b in zip(paths, *(jax.tree.leaves(runs[n][1]) for n in ("ours", "truth",
                                                                       "base"))):
    assert_within_baseline(g, t, b, f"grad {p}")


def _three_runs(make, fn, kernel_impl):
  """fn(module built by make(dtype, fused, impl)) for ours (fused kernels, bf16), the
  truth (reference, fp32, highest precision) and the baseline (reference, bf16)."""
  runs = {}
  for name, fused, dt in RUNS:
    with jax.default_matmul_precision("highest"):
      runs[name] = fn(make(dt, fused, kernel_impl if fused else "auto"), dt)
  return runs


def test_llama_logits(key, kernel_impl):
  """``__call__`` (op by op, LlamaBlock's composition) gives logits under the tolerance
  rule, and in fp32 they give exactly the training loss of the cross-layer blocks."""
  toks, tgt = _tokens(key)
  make = lambda dt, fused, impl: Llama(CFG.replace(dtype=dt, impl=impl), fused=fused,
                                       rngs=nnx.Rngs(3))
  runs = _three_runs(make, lambda m, dt: m(toks), kernel_impl)
  assert runs["ours"].shape == (B, T, CFG.vocab_size) and runs["ours"].dtype == jnp.float32
  assert_within_baseline(runs["ours"], runs["truth"], runs["base"], "logits")
  with jax.default_matmul_precision("highest"):
    loss = make(jnp.float32, False, "auto").loss(toks, tgt)
  again = cross_entropy(runs["truth"].reshape(-1, CFG.vocab_size), tgt.reshape(-1))
  np.testing.assert_allclose(float(loss), float(again), rtol=1e-5)


def test_llama_block_is_one_layer(key, kernel_impl):
  """A standalone LlamaBlock (fused ops composed op by op) under the tolerance rule."""
  x = normal(key, (B, T, 128))
  pos = jnp.broadcast_to(jnp.arange(T), (B, T))
  make = lambda dt, fused, impl: LlamaBlock(CFG.replace(impl=impl, init_std=0.1),
                                            fused=fused, rngs=nnx.Rngs(0))
  runs = _three_runs(make, lambda m, dt: m(x.astype(dt), pos), kernel_impl)
  assert runs["ours"].shape == x.shape and runs["ours"].dtype == jnp.bfloat16
  assert_within_baseline(runs["ours"], runs["truth"], runs["base"], "LlamaBlock")


def _standard_llama_logits(sd, cfg, toks):
  """An independent Llama in the Hugging Face layout (separate q/k/v and gate/up,
  (out, in) matrices, rotate-half RoPE, repeated kv heads), fp32."""
  hd, nq, nkv = cfg.head_dim, cfg.n_q_heads, cfg.n_kv_heads

  def rms(x, w):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + cfg.eps) * w

  inv = cfg.rope_theta ** (-jnp.arange(0, hd, 2) / hd)
  ang = jnp.arange(toks.shape[1])[:, None] * inv[None]
  cos, sin = jnp.cos(jnp.concatenate([ang, ang], -1)), jnp.sin(jnp.concatenate([ang, ang], -1))

  def rope(x):  # (B, T, H, hd)
    rot = jnp.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], -1)
    return x * cos[:, None] + rot * sin[:, None]

  x = sd["model.embed_tokens.weight"][toks]
  b, t, _ = x.shape
  for i in range(cfg.n_layers):
    w = lambda n: sd[f"model.layers.{i}.{n}.weight"]
    h = rms(x, w("input_layernorm"))
    q = rope((h @ w("self_attn.q_proj").T).reshape(b, t, nq, hd))
    k = rope((h @ w("self_attn.k_proj").T).reshape(b, t, nkv, hd))
    v = (h @ w("self_attn.v_proj").T).reshape(b, t, nkv, hd)
    k, v = jnp.repeat(k, nq // nkv, axis=2), jnp.repeat(v, nq // nkv, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(hd)
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
    o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v).reshape(b, t, -1)
    x = x + o @ w("self_attn.o_proj").T
    h = rms(x, w("post_attention_layernorm"))
    x = x + (jax.nn.silu(h @ w("mlp.gate_proj").T) * (h @ w("mlp.up_proj").T)) @ w(
        "mlp.down_proj").T
  head = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])
  return rms(x, sd["model.norm.weight"]) @ head.T


@pytest.mark.parametrize("tied", [False, True])
def test_checkpoint_round_trip_and_standard_layout(tied, key):
  cfg = CFG.replace(tie_embeddings=tied, dtype=jnp.float32)
  ks = jax.random.split(key, len(ck.hf_keys(cfg)) + 1)
  shapes = {k: v.shape for k, v in ck.to_hf_state_dict(Llama(cfg, rngs=nnx.Rngs(0))).items()}
  assert sorted(shapes) == sorted(ck.hf_keys(cfg))
  # Fresh random weights (norms around 1), not the model's own init.
  sd = {k: np.asarray(1 + 0.2 * normal(kk, shapes[k]) if len(shapes[k]) == 1
                      else 0.1 * normal(kk, shapes[k])) for k, kk in zip(sorted(shapes), ks)}
  m = ck.load_hf_state_dict(Llama(cfg, fused=False, rngs=nnx.Rngs(1)), sd)
  back = ck.to_hf_state_dict(m)
  assert set(back) == set(sd) and all(np.array_equal(back[k], sd[k]) for k in sd)
  toks, _ = _tokens(ks[-1])
  with jax.default_matmul_precision("highest"):
    got, want = m(toks), _standard_llama_logits(sd, cfg, toks)
  err = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
  assert err < 1e-5, err


def test_checkpoint_errors():
  cfg = CFG.replace(tie_embeddings=False)
  m = Llama(cfg, rngs=nnx.Rngs(0))
  sd = ck.to_hf_state_dict(m)
  with pytest.raises(ValueError, match="missing"):
    ck.load_hf_state_dict(m, {k: v for k, v in sd.items() if k != "lm_head.weight"})
  with pytest.raises(ValueError, match="shape"):
    ck.load_hf_state_dict(m, {**sd, "model.norm.weight": np.ones(3, np.float32)})
  tied = Llama(cfg.replace(tie_embeddings=True), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="differs"):
    ck.load_hf_state_dict(tied, sd)


def test_bad_inputs():
  m = Llama(CFG, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"tokens must be \(B, T\)"):
    m.loss(jnp.zeros((8,), jnp.int32), jnp.zeros((8,), jnp.int32))
  with pytest.raises(ValueError, match="targets"):
    m.loss(jnp.zeros((2, 8), jnp.int32), jnp.zeros((2, 9), jnp.int32))
  with pytest.raises(ValueError, match="n_kv_heads"):
    get_config("tiny", n_kv_heads=3)
  with pytest.raises(ValueError, match="unknown config"):
    get_config("llama-9")
  with pytest.raises(ValueError, match="tied"):
    LMHeadLoss(128, 256, tied=True, rngs=nnx.Rngs(0))(jnp.zeros((2, 128), jnp.bfloat16),
                                                      jnp.zeros((2,), jnp.int32))


def test_switch_flips_every_layer():
  m = Llama(CFG, rngs=nnx.Rngs(0))
  m.set_attributes(fused=False)
  flags = [mod.fused for _, mod in nnx.iter_modules(m) if hasattr(mod, "fused")]
  assert len(flags) >= 5 and not any(flags)
  assert train.describe_path(m).startswith("reference")


def test_training_steps_match_reference(key, kernel_impl):
  """N optimizer steps, fused kernels vs the reference path, from the same init on the
  same batches: each step's loss is within 2x the bf16 reference's deviation from the
  fp32 reference (the bf16 noise), plus a floor for steps where that is ~0."""
  steps = 3
  batches = [_tokens(key)] * steps  # one batch, so that the loss must fall
  curves = {}
  for name, fused, dt in RUNS:
    cfg = CFG.replace(dtype=dt, impl=kernel_impl if fused else "auto")
    model = Llama(cfg, fused=fused, rngs=nnx.Rngs(11))
    graphdef, state = train.init_state(model, train.make_optimizer(1e-2, total_steps=steps,
                                                                   warmup_steps=0))
    step = train.make_train_step(graphdef)
    losses = []
    for toks, tgt in batches:
      state, loss = step(state, toks, tgt)
      losses.append(float(loss))
    curves[name] = np.array(losses)
  assert curves["ours"][-1] < curves["ours"][0] - 0.05, curves  # it learns
  noise = np.abs(curves["base"] - curves["truth"])
  dev = np.abs(curves["ours"] - curves["truth"])
  assert np.all(dev <= 2 * noise + 1e-3 * np.abs(curves["truth"])), (dev, noise, curves)


def test_micro_batches_match_one_batch(key):
  """Gradient accumulation over micro-batches takes the same step as the whole batch
  (plain SGD, so parameters after a step differ exactly by the gradients' difference)."""
  toks = jax.random.randint(key, (4, T + 1), 0, 256)
  tokens, targets = toks[:, :-1], toks[:, 1:]
  cfg = CFG.replace(dtype=jnp.float32)
  out = []
  for k in (1, 2):
    graphdef, state = train.init_state(Llama(cfg, fused=False, rngs=nnx.Rngs(2)),
                                       optax.sgd(1.0))
    step = train.make_train_step(graphdef, micro_batches=k)
    with jax.default_matmul_precision("highest"):
      for _ in range(2):
        state, loss = step(state, tokens, targets)
    out.append((float(loss), jax.tree.leaves(nnx.state(nnx.merge(graphdef, state)[0]))))
  assert abs(out[0][0] - out[1][0]) < 1e-5, (out[0][0], out[1][0])
  for a, b in zip(out[0][1], out[1][1]):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
  with pytest.raises(ValueError, match="divisible"):
    train.make_train_step(graphdef, micro_batches=3)(state, tokens, targets)
