"""flax_layers: every layer and the Llama model, fused (kernels) against the same
parameters on the plain-jnp reference path, outputs and gradients, under the tolerance
rule (fp32 reference = truth; bf16 reference = the unfused baseline); checkpoint
conversion against an independent standard-layout Llama; training steps, the eval step
and the optimizer.

Every width differs, so a layer that takes one for another shows: D = 192, Hq*hd = 128
(4 q heads of 32, 2 kv heads; fused QKV 256), F = 256, V = 384 (with D an odd multiple
of 64, the (D, N) weight-gradient GEMMs tile only for N a multiple of 128). Residual-
stream inputs have realistic per-row scales (std 5..50), so RMSNorm's r is far from 1."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from coda_jax import layout
from coda_jax.jnp_reference import cross_entropy
from flax_layers import (FusedMLP, LMHeadLoss, Llama, LlamaBlock, OutProjection,
                         QKVProjection, get_config, train)
from flax_layers import checkpoint as ck
from helpers import (MODEL_RUNS, assert_within_baseline, check_model_loss_and_grads, normal,
                     rel_err, residual_cotangent, spread_rows)

D, F, V = 192, 256, 384
# 3 layers: Llama.loss scans the 2 shifted blocks between its pre- and post-block, a real
# loop (a scan of 1 is folded away, and in-place writes once broke only in a real loop:
# docs/design.md#6-in-place-outputs-and-xla).
CFG = get_config("tiny", d_model=D, n_layers=3, n_q_heads=4, n_kv_heads=2, head_dim=32,
                 ffn_dim=F, vocab_size=V, init_std=0.05)
Q = CFG.q_width  # 128
assert len({D, Q, F, 2 * F, V}) == 5
B, T = 2, 64
RUNS = MODEL_RUNS  # (name, fused, dtype): ours, the truth, the baseline


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
  """FusedMLP (norm, gate/up + SwiGLU, down + residual) on a realistic-scale stream."""
  kx, kc = jax.random.split(key)
  make = lambda fused, impl: FusedMLP(D, F, fused=fused, impl=impl, init_std=0.1,
                                      rngs=nnx.Rngs(1))
  _check_three_ways(make, lambda m, x: _sum_proj(m(x), kc), [spread_rows(kx, (B, T, D))],
                    key, kernel_impl, "FusedMLP")


def test_qkv_projection(key, kernel_impl):
  """QKVProjection (norm, fused QKV, RoPE at random positions up to 4096)."""
  kx, kc = jax.random.split(key)
  pos = jax.random.randint(kc, (B, T), 0, 4096)
  make = lambda fused, impl: QKVProjection(D, 4, 2, 32, fused=fused, impl=impl,
                                           init_std=0.1, rngs=nnx.Rngs(2))
  _check_three_ways(make, lambda m, x: _sum_proj(m(x, pos), kc), [spread_rows(kx, (B, T, D))],
                    key, kernel_impl, "QKVProjection")


def test_out_projection(key, kernel_impl):
  """OutProjection (residual + y Wo), Hq*hd -> D."""
  ky, kr, kc = jax.random.split(key, 3)
  make = lambda fused, impl: OutProjection(Q, D, fused=fused, impl=impl, init_std=0.1,
                                           rngs=nnx.Rngs(3))
  _check_three_ways(make, lambda m, y, r: _sum_proj(m(y, r), kc),
                    [normal(ky, (B, T, Q)), spread_rows(kr, (B, T, D))], key, kernel_impl,
                    "OutProjection")


def test_lm_head_loss(key, kernel_impl):
  """LMHeadLoss (final norm, LM head, mean cross-entropy with ignored targets)."""
  kx, kt = jax.random.split(key)
  tgt = jax.random.randint(kt, (B, T), 0, V).at[0, :5].set(-100)
  make = lambda fused, impl: LMHeadLoss(D, V, fused=fused, impl=impl, init_std=0.2,
                                        rngs=nnx.Rngs(4))
  _check_three_ways(make, lambda m, x: m(x, tgt), [spread_rows(kx, (B, T, D))], key,
                    kernel_impl, "LMHeadLoss")


def _tokens(key, vocab=V):
  toks = jax.random.randint(key, (B, T + 1), 0, vocab)
  return toks[:, :-1], toks[:, 1:]


# id -> (tie_embeddings, the MLP's gated activation)
MODEL_CASES = {"untied-silu": (False, "silu"), "tied-gelu": (True, "gelu")}


@pytest.mark.parametrize("case", list(MODEL_CASES))
def test_llama_loss_and_grads(case, key, kernel_impl):
  """The whole model's training loss (fused blocks across layer boundaries) and the
  gradient of every parameter, with SwiGLU and GeGLU MLPs. The loss is held to the
  tolerance rule token by token (``reduction="none"``): a mean of 128 losses can land
  close to the truth by cancellation in the baseline, which made a bound on the scalar a
  lottery (it failed on the H100 at 7.6e-5 against 2 x 1.8e-5 while every gradient
  passed); the mean must then be the mean of those per-token losses. The config's dtype
  follows the inputs' run: the model casts embeddings to ``config.dtype``, so build each
  run with its own."""
  tied, act = MODEL_CASES[case]
  _check_model_loss_and_grads(CFG.replace(tie_embeddings=tied, activation=act), key,
                              kernel_impl, 8 if tied else 9)


# Qwen3's layout at the test sizes: per-head q/k RMSNorm, tied head, theta 1e6, eps 1e-6.
QWEN_CFG = CFG.replace(qk_norm=True, tie_embeddings=True, rope_theta=1e6, eps=1e-6)


@pytest.mark.parametrize("path", ["xla", "kernels"])
def test_qwen3_loss_and_grads(path, key, kernel_impl):
  """A Qwen3-style model (``qk_norm``): the loss token by token and every gradient, the
  q_norm and k_norm weights' included, fused (the QK-norm in the QKV epilogues of the
  pre- and shifted blocks, its backward in ``qk_norm_grad``) against the reference,
  under the tolerance rule (as ``test_llama_loss_and_grads``). "xla" runs the fused
  blocks' XLA programs, "kernels" the kernels (the interpreter on CPU)."""
  # The kernels' case: 1 layer (pre-block -> post-block: the QK-norm epilogue and its
  # backward GEMMs; the shifted blocks' loop runs in "xla"), as the interpreter on CPU
  # takes minutes for 3.
  cfg, impl = (QWEN_CFG, "xla") if path == "xla" else (QWEN_CFG.replace(n_layers=1),
                                                       kernel_impl)
  paths = _check_model_loss_and_grads(cfg, key, impl, 10)
  assert "['layers']['attn']['q_norm'].value" in paths, paths
  assert "['layers']['attn']['k_norm'].value" in paths, paths


def test_norm_weight_offset_loss_and_grads(key):
  """Gemma's (1 + g) norm weights (``norm_weight_offset=1``) on a Qwen3-style model, so
  the QK-norm weights take the offset too: the loss token by token and every gradient
  under the tolerance rule, fused (XLA programs; the kernels see only the fp32 sum,
  which ``test_norm_weight_offset_is_one_plus_g`` pins) against the reference."""
  _check_model_loss_and_grads(QWEN_CFG.replace(norm_weight_offset=1.0), key, "xla", 10)


def test_norm_weight_keeps_a_bf16_g_near_zero():
  """1 + g is taken in fp32: a bf16 g of 1e-3 survives (in bf16, 1 + 1e-3 rounds to 1);
  without an offset the stored weight passes through as it is."""
  from flax_layers.layers import norm_weight
  g = jnp.array([1e-3, -2e-4, 0.0, 0.5], jnp.bfloat16)
  got = norm_weight(g, 1.0)
  assert got.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(got), 1.0 + np.asarray(g, np.float32))
  assert float((1 + g)[0]) == 1.0  # what a bf16 sum would have kept
  assert norm_weight(g) is g


@pytest.mark.parametrize("fused", [True, False])
def test_norm_weight_offset_is_one_plus_g(key, fused):
  """A model with offset 1 whose stored norms are g computes exactly what a model with
  offset 0 computes whose stored norms are 1 + g (in fp32): the same loss, logits and
  gradients, bit for bit, and the stored g's gradient is the applied weight's. Its
  norms start at zero (an applied weight of 1). The fused path runs its XLA programs:
  the kernels take the same fp32 weight operand either way."""
  cfg = QWEN_CFG.replace(n_layers=2, impl="xla" if fused else "auto")
  gemma = Llama(cfg.replace(norm_weight_offset=1.0), fused=fused, rngs=nnx.Rngs(5))
  plain = Llama(cfg, fused=fused, rngs=nnx.Rngs(5))
  state = nnx.state(gemma, nnx.Param)
  norms = [jax.tree_util.keystr(p) for p, v in jax.tree_util.tree_flatten_with_path(state)[0]
           if "norm" in jax.tree_util.keystr(p)]
  assert len(norms) == 5, norms  # attn, q, k, mlp (stacked) and the head's
  for p, v in jax.tree_util.tree_flatten_with_path(state)[0]:
    if "norm" in jax.tree_util.keystr(p):
      assert not np.asarray(v).any(), p
  _perturb_norms(gemma, key)
  shifted = jax.tree_util.tree_map_with_path(
      lambda p, v: v + 1.0 if "norm" in jax.tree_util.keystr(p) else v,
      nnx.state(gemma, nnx.Param))
  nnx.update(plain, shifted)
  toks, tgt = _tokens(key)
  run = lambda m: nnx.value_and_grad(lambda m: m.loss(toks, tgt))(m)
  (la, ga), (lb, gb) = run(gemma), run(plain)
  assert float(la) == float(lb)
  for (p, a), b in zip(jax.tree_util.tree_flatten_with_path(ga)[0], jax.tree.leaves(gb)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(p))
  np.testing.assert_array_equal(np.asarray(gemma(toks)), np.asarray(plain(toks)))


def _check_model_loss_and_grads(cfg0, key, impl, n_grads):
  """``Llama(cfg0).loss`` and its gradients under the tolerance rule
  (``helpers.check_model_loss_and_grads``), ours on ``impl``."""
  toks, tgt = _tokens(key)

  def make(fused, dt):
    m = Llama(cfg0.replace(dtype=dt, impl=impl if fused else "auto"), fused=fused,
              rngs=nnx.Rngs(7))
    _perturb_norms(m, key)
    return m
  return check_model_loss_and_grads(make, toks, tgt.at[0, :3].set(-100), n_grads)


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


def _rms(x, w, eps):
  return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * w


def _standard_layer(w, x, cfg):
  """An independent Llama layer in the standard layout (``w`` as
  ``coda_jax.layout``'s standard layer: (in, out) matrices, separate q/k/v and gate/up,
  rotate-half RoPE at positions 0..T-1, repeated kv heads; Qwen3's per-head q/k RMSNorm
  where ``w`` has ``q_norm``, ``k_norm``), fp32: x (B, T, D) -> same."""
  hd, nq, nkv = cfg.head_dim, cfg.n_q_heads, cfg.n_kv_heads
  b, t, _ = x.shape
  inv = cfg.rope_theta ** (-jnp.arange(0, hd, 2) / hd)
  ang = jnp.arange(t)[:, None] * inv[None]
  cos, sin = jnp.cos(jnp.concatenate([ang, ang], -1)), jnp.sin(jnp.concatenate([ang, ang], -1))

  def rope(x):  # (B, T, H, hd)
    rot = jnp.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], -1)
    return x * cos[:, None] + rot * sin[:, None]

  h = _rms(x, w["attn_norm"], cfg.eps)
  q, k = (h @ w["wq"]).reshape(b, t, nq, hd), (h @ w["wk"]).reshape(b, t, nkv, hd)
  if "q_norm" in w:  # Qwen3: each head RMS-normed over its hd, before RoPE
    q, k = _rms(q, w["q_norm"], cfg.eps), _rms(k, w["k_norm"], cfg.eps)
  q, k = rope(q), rope(k)
  v = (h @ w["wv"]).reshape(b, t, nkv, hd)
  k, v = jnp.repeat(k, nq // nkv, axis=2), jnp.repeat(v, nq // nkv, axis=2)
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(hd)
  s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
  o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v).reshape(b, t, -1)
  x = x + o @ w["wo"]
  h = _rms(x, w["mlp_norm"], cfg.eps)
  act = {"silu": jax.nn.silu, "gelu": lambda a: jax.nn.gelu(a, approximate=True)}
  return x + (act[cfg.activation](h @ w["w_gate"]) * (h @ w["w_up"])) @ w["w_down"]


_HF_LAYER = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj",
             "wo": "self_attn.o_proj", "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj",
             "w_down": "mlp.down_proj"}


def _standard_llama_logits(sd, cfg, toks):
  """An independent Llama in the Hugging Face layout ((out, in) matrices under HF names;
  see _standard_layer), fp32."""
  x = sd["model.embed_tokens.weight"][toks]
  for i in range(cfg.n_layers):
    w = lambda n: sd[f"model.layers.{i}.{n}.weight"]
    layer = {k: w(n).T for k, n in _HF_LAYER.items()}
    layer.update(attn_norm=w("input_layernorm"), mlp_norm=w("post_attention_layernorm"))
    if cfg.qk_norm:
      layer.update(q_norm=w("self_attn.q_norm"), k_norm=w("self_attn.k_norm"))
    x = _standard_layer(layer, x, cfg)
  head = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])
  return _rms(x, sd["model.norm.weight"], cfg.eps) @ head.T


def _block_truth(params, x, cfg):
  """LlamaBlock's math on its parameters (``nnx.to_pure_dict`` of its state, the
  submodules its docstring names), through the standard layout, fp32."""
  kernel = {"g_attn": params["attn"]["norm"], "wqkv": params["attn"]["wqkv"],
            "wo": params["out"]["wo"], "g_mlp": params["mlp"]["norm"],
            "w13": params["mlp"]["w13"], "w2": params["mlp"]["w2"]}
  std = layout.kernel_layer_to_llama(kernel, n_q_heads=cfg.n_q_heads,
                                     n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                                     block=cfg.swiglu_block)
  return _standard_layer(std, x, cfg)


def test_llama_block_value_and_grads(key, kernel_impl):
  """A standalone LlamaBlock (fused ops composed op by op; x at realistic scale): its
  output and the gradients of every parameter and of x. Truth: an independent
  standard-layout layer (_standard_layer) in fp32 on the block's own parameters. The
  fp32 reference path must match it to fp32 rounding (so a bug both paths share, e.g.
  in layers.norm_stats, shows); the fused bf16 kernels are under the tolerance rule
  (baseline: the reference path in bf16)."""
  kx, kc = jax.random.split(key)
  x = spread_rows(kx, (B, T, D))
  pos = jnp.broadcast_to(jnp.arange(T), (B, T))
  cfg = CFG.replace(init_std=0.1)

  def make(fused):
    m = LlamaBlock(cfg.replace(impl=kernel_impl if fused else "auto"), fused=fused,
                   rngs=nnx.Rngs(0))
    _perturb_norms(m, key)
    return m

  params = nnx.to_pure_dict(nnx.state(make(False), nnx.Param))
  with jax.default_matmul_precision("highest"):
    ct = residual_cotangent(kc, _block_truth(params, x, cfg), x)

  def projected(fn):
    def value(*args):
      out = fn(*args)
      return jnp.sum(out.astype(jnp.float32) * ct), out
    return value

  with jax.default_matmul_precision("highest"):
    (_, out), (dp, dx) = jax.value_and_grad(
        projected(lambda p, x: _block_truth(p, x, cfg)), (0, 1), has_aux=True)(params, x)
  runs = {"independent": (out, dp, dx)}
  for name, fused, dt in RUNS:  # "truth" here: the fp32 reference path
    with jax.default_matmul_precision("highest"):
      (_, out), (dm, dx) = nnx.value_and_grad(
          projected(lambda m, x: m(x, pos)), argnums=(0, 1), has_aux=True)(
              make(fused), x.astype(dt))
    runs[name] = (out, nnx.to_pure_dict(dm), dx)
  assert runs["ours"][0].shape == x.shape and runs["ours"][0].dtype == jnp.bfloat16
  names = ["output"] + ["d" + jax.tree_util.keystr(p) for p, _ in
                        jax.tree_util.tree_flatten_with_path(dp)[0]] + ["dx"]
  leaves = {n: jax.tree.leaves(r) for n, r in runs.items()}
  assert all(len(v) == len(names) == 8 for v in leaves.values()), names
  for name, got, ref32, truth, base in zip(names, *(leaves[n] for n in (
      "ours", "truth", "independent", "base"))):
    assert rel_err(ref32, truth) < 1e-5, (name, "fp32 reference path", rel_err(ref32, truth))
    assert_within_baseline(got, truth, base, f"LlamaBlock {name}")


@pytest.mark.parametrize("tied,qk_norm", [(False, False), (True, False), (True, True)])
def test_checkpoint_round_trip_and_standard_layout(tied, qk_norm, key):
  """HF state dict -> model -> HF state dict is exact, and the model's logits are an
  independent standard-layout Llama's (Qwen3's with ``qk_norm``: q_norm / k_norm)."""
  cfg = CFG.replace(tie_embeddings=tied, dtype=jnp.float32, qk_norm=qk_norm)
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
  if qk_norm:  # q/k norm weights follow wq / wk's columns into Meta's interleaved order
    assert any(k.endswith("q_norm.weight") for k in sd)
    meta = ck.to_hf_state_dict(m, rope="interleaved")
    name = "model.layers.1.self_attn.q_norm.weight"
    np.testing.assert_array_equal(meta[name], np.asarray(
        layout.rotate_half_to_interleaved(jnp.asarray(sd[name]), cfg.head_dim)))
    again = ck.load_hf_state_dict(Llama(cfg, fused=False, rngs=nnx.Rngs(2)), meta,
                                  rope="interleaved")
    assert all(np.array_equal(v, sd[k]) for k, v in ck.to_hf_state_dict(again).items())


def test_checkpoint_errors():
  """Loading a state dict that does not fit the config names what is wrong."""
  cfg = CFG.replace(tie_embeddings=False)
  m = Llama(cfg, rngs=nnx.Rngs(0))
  sd = ck.to_hf_state_dict(m)
  with pytest.raises(ValueError, match=r"missing \['lm_head\.weight'\], unexpected \[\]"):
    ck.load_hf_state_dict(m, {k: v for k, v in sd.items() if k != "lm_head.weight"})
  with pytest.raises(ValueError, match=r"model\.norm\.weight has shape \(3,\), expected "
                                       r"\(192,\)"):
    ck.load_hf_state_dict(m, {**sd, "model.norm.weight": np.ones(3, np.float32)})
  tied = Llama(cfg.replace(tie_embeddings=True), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="lm_head.weight differs from model.embed_tokens"):
    ck.load_hf_state_dict(tied, sd)


def _head_call(tied, wlm):
  head = LMHeadLoss(D, V, tied=tied, rngs=nnx.Rngs(0))
  return head(jnp.zeros((2, D), jnp.bfloat16), jnp.zeros((2,), jnp.int32), wlm=wlm)


@functools.cache
def _small_llama():
  return Llama(CFG, rngs=nnx.Rngs(0))


@functools.cache
def _small_qwen3():
  return Llama(QWEN_CFG.replace(n_layers=1), rngs=nnx.Rngs(0))


# id -> (the call, given a Llama of CFG, and the one message it must raise)
BAD = {
    "tokens-rank": (lambda m: m.loss(jnp.zeros((8,), jnp.int32), jnp.zeros((8,), jnp.int32)),
                    r"tokens must be \(B, T\) integers"),
    "targets-shape": (
        lambda m: m.loss(jnp.zeros((2, 8), jnp.int32), jnp.zeros((2, 9), jnp.int32)),
        r"targets \(2, 9\) must match tokens \(2, 8\)"),
    "loss-reduction": (
        lambda m: m.loss(jnp.zeros((2, 8), jnp.int32), jnp.zeros((2, 8), jnp.int32),
                         reduction="avg"),
        r"reduction='avg': one of \('mean', 'sum', 'none'\)"),
    "positions-shape": (
        lambda m: m(jnp.zeros((2, 8), jnp.int32), positions=jnp.zeros((2, 9), jnp.int32)),
        r"positions \(2, 9\) must match tokens \(2, 8\)"),
    "gqa-heads": (lambda m: get_config("tiny", n_kv_heads=3),
                  r"n_q_heads=4 must be a multiple of n_kv_heads=3"),
    "unknown-config": (lambda m: get_config("llama-9"), r"unknown config 'llama-9'"),
    "qk-norm-not-bool": (lambda m: get_config("qwen3-tiny", qk_norm=1),
                         r"qk_norm=1 must be a bool"),
    "qk-norm-head-dim-kernel-only": (
        lambda m: get_config("qwen3-tiny", head_dim=256, impl="mosaic"),
        r"head_dim=256: the per-head norm needs a whole head in one epilogue sub-tile"),
    "qwen3-q-norm-shape": (
        lambda m: ck.load_hf_state_dict(_small_qwen3(), {
            **ck.to_hf_state_dict(_small_qwen3()),
            "model.layers.0.self_attn.q_norm.weight": np.ones(64, np.float32)}),
        r"model\.layers\.0\.self_attn\.q_norm\.weight has shape \(64,\), expected \(32,\) "
        r"= \(head_dim,\)"),
    "tied-head-needs-wlm": (lambda m: _head_call(True, None),
                            r"pass wlm exactly when the head is tied"),
    "untied-head-takes-no-wlm": (lambda m: _head_call(False, jnp.zeros((D, V))),
                                 r"this head has its own wlm; do not pass one"),
    "optimizer-total-steps": (lambda m: train.make_optimizer(1e-3, total_steps=0),
                              r"total_steps=0 must be positive"),
    "norm-offset-not-float": (lambda m: get_config("tiny", norm_weight_offset=True),
                              r"norm_weight_offset=True must be a finite float"),
    "norm-offset-nan": (lambda m: get_config("tiny", norm_weight_offset=float("nan")),
                        r"norm_weight_offset=nan must be a finite float"),
    "mlp-residuals-unknown": (lambda m: get_config("tiny", mlp_residuals="z"),
                              r"mlp_residuals='z': one of \('recompute', 'output'\)"),
    "norm-offset-no-hf-config": (
        lambda m: get_config("tiny", norm_weight_offset=1.0).to_hf_config(),
        r"norm_weight_offset=1.0: Llama and Qwen3 checkpoints apply their norm weights as "
        r"stored"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_inputs(case):
  """Each bad input raises ValueError with its own message."""
  fn, match = BAD[case]
  with pytest.raises(ValueError, match=match):
    fn(_small_llama())


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
  steps = 2  # the second step runs on the optimizer state the first left
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
  with pytest.raises(ValueError, match=r"batch 4 is not divisible by micro_batches=3"):
    train.make_train_step(graphdef, micro_batches=3)(state, tokens, targets)


def test_eval_step(key):
  """make_eval_step gives the loss of the state's current parameters: model.loss of the
  same model, and an independent cross-entropy of the model's logits; the state it is
  given comes back unchanged (no update)."""
  toks, tgt = _tokens(key)
  tgt = tgt.at[1, -4:].set(-100)
  cfg = CFG.replace(dtype=jnp.float32)
  graphdef, state = train.init_state(Llama(cfg, fused=False, rngs=nnx.Rngs(4)),
                                     optax.sgd(0.5))
  with jax.default_matmul_precision("highest"):
    first = float(train.make_eval_step(graphdef)(state, toks, tgt))
    state, _ = train.make_train_step(graphdef)(state, toks, tgt)  # parameters move
    before = [np.array(a) for a in jax.tree.leaves(state)]
    loss = train.make_eval_step(graphdef)(state, toks, tgt)
    model, _ = nnx.merge(graphdef, state)
    want, logits = model.loss(toks, tgt), model(toks)
  assert loss.shape == () and loss.dtype == jnp.float32
  after = jax.tree.leaves(state)
  assert len(after) == len(before) and all(np.array_equal(a, b) for a, b in zip(before, after))
  logp = jax.nn.log_softmax(logits, axis=-1)
  valid = tgt != -100
  nll = -jnp.take_along_axis(logp, jnp.where(valid, tgt, 0)[..., None], axis=-1)[..., 0]
  independent = float(jnp.sum(jnp.where(valid, nll, 0)) / jnp.sum(valid))
  np.testing.assert_allclose(float(loss), float(want), rtol=1e-6)
  np.testing.assert_allclose(float(loss), independent, rtol=1e-5)
  assert abs(first - float(loss)) > 1e-3, (first, float(loss))  # it saw the new parameters


def _lr(t, peak, total, warmup, final_fraction):
  """The documented schedule at update t (0, 1, ...): linear warm-up from 0 over
  ``warmup`` updates, then a cosine from the peak to final_fraction * peak at
  ``total``, constant after."""
  if t < warmup:
    return peak * t / warmup
  end = peak * final_fraction
  frac = min(t - warmup, total - warmup) / (total - warmup)
  return end + (peak - end) * 0.5 * (1 + np.cos(np.pi * frac))


def _adamw(params, grads, lr, *, b1, b2, weight_decay, clip, decayed, eps=1e-8):
  """An independent AdamW in float64 over flat {name: array} trees: clip the gradient to
  global norm ``clip``, Adam moments with bias correction, then the update
  -lr(t) * (m_hat / (sqrt(v_hat) + eps) + weight_decay * p) (decay where ``decayed``).
  Returns the parameters after each step."""
  p = {k: np.asarray(v, np.float64) for k, v in params.items()}
  m = {k: np.zeros_like(v) for k, v in p.items()}
  v = {k: np.zeros_like(a) for k, a in p.items()}
  out = []
  for t, g in enumerate(grads):
    g = {k: np.asarray(a, np.float64) for k, a in g.items()}
    norm = np.sqrt(sum(np.sum(a * a) for a in g.values()))
    if norm > clip:
      g = {k: a * clip / norm for k, a in g.items()}
    for k in p:
      m[k] = b1 * m[k] + (1 - b1) * g[k]
      v[k] = b2 * v[k] + (1 - b2) * g[k] ** 2
      u = (m[k] / (1 - b1 ** (t + 1))) / (np.sqrt(v[k] / (1 - b2 ** (t + 1))) + eps)
      p[k] = p[k] - lr(t) * (u + (weight_decay * p[k] if decayed[k] else 0))
    out.append(dict(p))
  return out


# A tiny parameter tree named like the model's: whether AdamW decays each leaf.
_OPT_TREE = {("embed",): True, ("layers", "attn", "norm"): False,
             ("layers", "attn", "wqkv"): True, ("layers", "mlp", "w2"): True,
             ("head", "norm"): False}

# id -> (make_optimizer keywords, steps, per-step global gradient norms or None (random),
#        the feature the case isolates, so the test checks it makes a difference)
OPT_CASES = {
    "schedule": (dict(total_steps=12, warmup_steps=3, final_fraction=0.1, weight_decay=0.0,
                      clip_norm=1e9), 15, None, None),
    "schedule-default-warmup": (dict(total_steps=60, weight_decay=0.0, clip_norm=1e9), 62,
                                None, None),
    "clipping": (dict(total_steps=8, warmup_steps=0, final_fraction=1.0, weight_decay=0.0,
                      clip_norm=1.0), 8, [4.0, 0.25] * 4, "clip_norm"),
    "weight-decay": (dict(total_steps=8, warmup_steps=0, final_fraction=1.0,
                          weight_decay=0.3, clip_norm=1e9), 8, None, "weight_decay"),
}


@pytest.mark.parametrize("case", list(OPT_CASES))
def test_make_optimizer(case, key):
  """make_optimizer's updates on a tiny tree equal an independent AdamW (_adamw) with
  the documented schedule (_lr; default warm-up max(1, total // 20)), global-norm
  clipping, and decoupled weight decay on matrices but not on norm weights (paths
  containing "norm")."""
  kw, steps, norms, feature = OPT_CASES[case]
  peak, b1, b2 = 0.1, 0.9, 0.95
  names = ["/".join(p) for p in _OPT_TREE]
  shapes = {n: (3,) if n.endswith("norm") else (3, 2) for n in names}
  ks = jax.random.split(key, steps + 1)
  params = {n: 1 + normal(k, shapes[n]) for n, k in zip(names, jax.random.split(ks[0], 5))}
  grads = []
  for t in range(steps):
    g = {n: normal(k, shapes[n]) for n, k in zip(names, jax.random.split(ks[t + 1], 5))}
    if norms:
      total = np.sqrt(sum(float(jnp.sum(a * a)) for a in g.values()))
      g = {n: a * norms[t] / total for n, a in g.items()}
    grads.append(g)
  nest = lambda flat: {"embed": flat["embed"], "head": {"norm": flat["head/norm"]},
                       "layers": {"attn": {"norm": flat["layers/attn/norm"],
                                           "wqkv": flat["layers/attn/wqkv"]},
                                  "mlp": {"w2": flat["layers/mlp/w2"]}}}
  tx = train.make_optimizer(peak, b1=b1, b2=b2, **kw)
  p, state = nest(params), tx.init(nest(params))
  update = jax.jit(tx.update)
  got = []
  for g in grads:
    upd, state = update(nest(g), state, p)
    p = optax.apply_updates(p, upd)
    got.append({"/".join(str(k.key) for k in path): v
                for path, v in jax.tree_util.tree_flatten_with_path(p)[0]})
  total = kw["total_steps"]
  warmup = kw.get("warmup_steps", max(1, total // 20))
  lr = lambda t: _lr(t, peak, total, warmup, kw.get("final_fraction", 0.1))
  adamw = lambda **o: _adamw(params, grads, lr, **{
      **dict(b1=b1, b2=b2, weight_decay=kw["weight_decay"], clip=kw["clip_norm"],
             decayed={"/".join(k): d for k, d in _OPT_TREE.items()}), **o})
  want = adamw()
  for t, (a, w) in enumerate(zip(got, want)):
    for n in names:
      np.testing.assert_allclose(np.asarray(a[n]), w[n], rtol=2e-5, atol=1e-6,
                                 err_msg=f"{case}: step {t}, {n}")
  if feature:  # the case's feature changes the trajectory well beyond the tolerance
    off = adamw(clip=np.inf) if feature == "clip_norm" else adamw(weight_decay=0.0)
    assert max(np.max(np.abs(want[-1][n] - off[-1][n])) for n in names) > 1e-2, case


def test_weight_decay_skips_the_model_norms():
  """On the real model's tree (nnx paths, through train.init_state): with zero
  gradients one AdamW step scales every matrix by 1 - lr * weight_decay and leaves every
  norm weight (attention, MLP and final norms) exactly as it was."""
  lr, wd = 0.5, 0.1
  model = Llama(CFG, fused=False, rngs=nnx.Rngs(0))
  _perturb_norms(model, jax.random.key(1))
  before = {jax.tree_util.keystr(p): np.array(v) for p, v in
            jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]}
  norms = {"['head']['norm'].value", "['layers']['attn']['norm'].value",
           "['layers']['mlp']['norm'].value"}
  matrices = {"['embed'].value", "['head']['wlm'].value", "['layers']['attn']['wqkv'].value",
              "['layers']['out']['wo'].value", "['layers']['mlp']['w13'].value",
              "['layers']['mlp']['w2'].value"}
  assert set(before) == norms | matrices, sorted(before)
  graphdef, state = train.init_state(model, train.make_optimizer(
      lr, total_steps=4, warmup_steps=0, weight_decay=wd))
  model, optimizer = nnx.merge(graphdef, state)
  optimizer.update(model, jax.tree.map(jnp.zeros_like, nnx.state(model, nnx.Param)))
  after = {jax.tree_util.keystr(p): np.array(v) for p, v in
           jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]}
  for name in norms:
    np.testing.assert_array_equal(after[name], before[name], err_msg=name)
  for name in matrices:
    np.testing.assert_allclose(after[name], before[name] * (1 - lr * wd), rtol=1e-6,
                               err_msg=name)


def test_token_ids_outside_the_vocabulary():
  """Checked where they can be (concrete ids: ValueError naming the id and place); under
  jit, where they cannot, the documented result: the token reads a NaN embedding and the
  loss is NaN, never a silently clamped id."""
  from flax_layers import Llama, get_config
  cfg = get_config("tiny")
  model = Llama(cfg, rngs=nnx.Rngs(0), fused=False)
  tokens = jnp.zeros((2, 16), jnp.int32).at[1, 3].set(cfg.vocab_size)
  with pytest.raises(ValueError, match=r"token id 256 at \(1, 3\) is outside "
                                       r"\[0, vocab_size=256\)"):
    model.loss(tokens, tokens)
  gdef, state = nnx.split(model)
  loss = jax.jit(lambda s, t: nnx.merge(gdef, s).loss(t, jnp.zeros_like(t)))(state, tokens)
  assert np.isnan(float(loss))
  # Concrete ids closed over by a jit are checked too (the check ran jnp comparisons on
  # them, which a trace turns into tracers: TracerArrayConversionError before).
  with pytest.raises(ValueError, match=r"token id 256 at \(1, 3\)"):
    jax.jit(lambda s: nnx.merge(gdef, s).loss(tokens, tokens))(state)
  good = tokens.at[1, 3].set(0)
  assert np.isfinite(float(jax.jit(lambda s: nnx.merge(gdef, s).loss(good, good))(state)))


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_ragged_batch_padded_once(key, monkeypatch, reduction):
  """A batch whose token count does not tile (2 x 63): the fused model pads every
  sequence once at its end (blocks.ROW_MULTIPLE, here 128 so a tiny batch qualifies)
  with ignored targets, and its loss and gradients equal the reference model's on the
  unpadded batch; every block saw the padded count. fp32 on the XLA programs: the
  padding is model code, exact up to summation order."""
  from coda_jax import blocks
  monkeypatch.setattr(blocks, "ROW_MULTIPLE", 128)
  seen = []
  real = blocks.post_block
  monkeypatch.setattr(blocks, "post_block",
                      lambda x0, *a: seen.append(x0.shape) or real(x0, *a))
  toks = jax.random.randint(key, (2, 64), 0, V)
  toks, tgt = toks[:, :-1], toks[:, 1:].at[1, 5].set(-100)
  out = {}
  for fused in (True, False):
    m = Llama(CFG.replace(dtype=jnp.float32, impl="xla"), fused=fused, rngs=nnx.Rngs(5))
    with jax.default_matmul_precision("highest"):
      out[fused] = nnx.value_and_grad(
          lambda m: jnp.sum(m.loss(toks, tgt, reduction=reduction)))(m)
      per_token = m.loss(toks, tgt, reduction=reduction)
    assert per_token.shape == (() if reduction == "mean" else (2, 63))
  assert seen and set(seen) == {(2, 64, D)}, seen
  np.testing.assert_allclose(float(out[True][0]), float(out[False][0]), rtol=1e-5)
  for g, r in zip(jax.tree.leaves(out[True][1]), jax.tree.leaves(out[False][1])):
    assert rel_err(g, r) < 1e-4, rel_err(g, r)
