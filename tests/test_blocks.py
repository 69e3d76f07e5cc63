"""Whole blocks (coda_jax.blocks): pre-block, shifted block and post-block forward and
backward against jax.grad of the pure-jnp reference blocks, under the tolerance rule
(tests/helpers.assert_within_baseline): fp32 truth, 2x the unfused bf16 error.

Every width differs, so a backward that takes one width for another shows: D = 192,
Hq*hd = 128 (4 q heads of 32, 2 kv heads; the fused QKV is 256 wide), F = 256 (w13 is
2F = 512), V = 384. (D = 192 is an odd multiple of 64: the weight-gradient GEMMs (D, N)
tile only when N is a multiple of 128, hence V = 384.) The residual stream has
realistic per-row scales (std 5..50, tests/helpers.spread_rows), so RMSNorm's r is far
from 1."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coda_jax import blocks as B
from coda_jax import jnp_reference as R
from helpers import (assert_within_baseline, f32_tree, fenced_in_forward_scan,
                     mosaic_launches, normal, rel_err, residual_cotangent,
                     record_head_stores, spread_rows, unit_rows)

M, D, F, V = 128, 192, 256, 384
CFG = B.BlockConfig(n_q_heads=4, n_kv_heads=2, head_dim=32, lm_chunk_rows=64)
HEADS = dict(n_q_heads=4, n_kv_heads=2, head_dim=32)
Q = CFG.n_q_heads * CFG.head_dim  # attention output width, 128
assert len({D, Q, F, 2 * F, V}) == 5 and CFG.qkv_width == 256


def _params(key, keys, dt):
  shapes = {"wo": (Q, D), "g_mlp": (D,), "w13": (D, 2 * F), "w2": (F, D), "g_attn": (D,),
            "wqkv": (D, CFG.qkv_width), "g_final": (D,), "wlm": (D, V)}
  ks = jax.random.split(key, len(keys))
  return {k: (1 + 0.1 * normal(kk, shapes[k])) if k.startswith("g_")
          else normal(kk, shapes[k], dt) * shapes[k][0] ** -0.5 for k, kk in zip(keys, ks)}


def _args(key, dt, m=M):
  """(x0, y0, g_attn0, wqkv0, shifted params, post params); x0 at realistic scale."""
  ks = jax.random.split(key, 6)
  return (spread_rows(ks[0], (m, D), dt), normal(ks[1], (m, Q), dt),
          1 + 0.1 * normal(ks[2], (D,)), normal(ks[3], (D, CFG.qkv_width), dt) * D ** -0.5,
          _params(ks[4], B.SHIFTED_KEYS, dt), _params(ks[5], B.POST_KEYS, dt))


def _qkv_cotangent(key, qkv):
  """A fixed cotangent of a normed, projected output, from its fp32 truth: noise plus
  the output itself (unit rms per row), so the gradient through r (c = <dq, qkv> / D,
  docs/design.md#13-backward-of-a-block) weighs as much as the projected gradient g * dn."""
  return normal(key, qkv.shape) + unit_rows(qkv)


def _project(outs, cts):
  return sum(jnp.sum(o.astype(jnp.float32) * c) for o, c in zip(outs, cts))


def _model(blocks, cts):
  """pre_block -> shifted_block -> post_block, as a scalar: every output (the per-token
  losses included) projected on a fixed cotangent, so every path is checked."""
  def loss(x0, y0, g0, wqkv0, p_shift, p_post):
    qkv0, (x2, qkv), ce = blocks(x0, y0, g0, wqkv0, p_shift, p_post)
    return _project((qkv0, x2, qkv, ce), cts)
  return loss


def _fused(cfg, pos, tgt):
  def blocks(x0, y0, g0, wqkv0, p_shift, p_post):
    qkv0 = B.pre_block(x0, pos, g0, wqkv0, cfg)
    x2, qkv = B.shifted_block(x0, y0, pos, p_shift, cfg)
    return qkv0, (x2, qkv), B.post_block(x2, y0, tgt, p_post, cfg)
  return blocks


def _reference(pos, tgt, activation="silu"):
  def blocks(x0, y0, g0, wqkv0, p_shift, p_post):
    qkv0 = R.pre_block(x0, g0, wqkv0, pos, **HEADS)
    x2, qkv = R.shifted_block(x0, y0, pos, p_shift, **HEADS, activation=activation)
    return qkv0, (x2, qkv), R.post_block(x2, y0, tgt, p_post, activation=activation,
                                         reduction="none")
  return blocks


def _check_leaves(got, truth, base, names):
  """Tolerance rule leaf by leaf; the three trees must have the same leaves."""
  leaves = [jax.tree.leaves(t) for t in (got, truth, base)]
  assert len(names) == len(leaves[0]) == len(leaves[1]) == len(leaves[2]) > 0, names
  for name, g, t, b in zip(names, *leaves):
    assert g.shape == t.shape and g.dtype == b.dtype, (name, g.shape, g.dtype, b.dtype)
    assert_within_baseline(g if g.ndim else g[None], t if t.ndim else t[None],
                           b if b.ndim else b[None], name)


# id -> (activation dtype, gated activation of the MLP)
BLOCK_CASES = {"bf16-silu": (jnp.bfloat16, "silu"), "bf16-gelu": (jnp.bfloat16, "gelu"),
               "fp16-gelu": (jnp.float16, "gelu")}


@pytest.mark.parametrize("case", list(BLOCK_CASES))
def test_blocks_forward_and_grads(case, key, kernel_impl):
  """The three blocks chained (pre -> shifted -> post), each output and the gradient of
  every input and parameter, under the tolerance rule; with both gated activations
  (GeGLU's forward and backward run in the kernels' epilogues)."""
  dt, act = BLOCK_CASES[case]
  args = _args(key, dt)
  pos = jnp.arange(M, dtype=jnp.int32) % 100 + 3000  # packed sequences, late positions
  tgt = jax.random.randint(jax.random.fold_in(key, 1), (M,), 0, V).at[::5].set(-100)
  # Per-token losses ("none"): a mean of M terms can be exact in the baseline by luck,
  # which would make 2x its error an arbitrary bar; "mean" runs in test_flax_layers.
  cfg = dataclasses.replace(CFG, impl=kernel_impl, activation=act, reduction="none")
  reference, fused = _reference(pos, tgt, act), _fused(cfg, pos, tgt)
  up = f32_tree(args)
  with jax.default_matmul_precision("highest"):
    outs_truth = reference(*up)
  qkv0, (x2, qkv), _ = outs_truth
  ks = jax.random.split(jax.random.fold_in(key, 2), 4)
  cts = [_qkv_cotangent(ks[0], qkv0), residual_cotangent(ks[1], x2, up[0]),
         _qkv_cotangent(ks[2], qkv), jax.random.uniform(ks[3], (M,), minval=0.5, maxval=1.5)]
  argnums = tuple(range(6))
  with jax.default_matmul_precision("highest"):
    g_truth = jax.grad(_model(reference, cts), argnums)(*up)
  g_base = jax.grad(_model(reference, cts), argnums)(*args)
  outs_base = reference(*args)
  outs, g_got = jax.jit(lambda *a: (fused(*a), jax.grad(_model(fused, cts), argnums)(*a)))(
      *args)
  _check_leaves(outs, outs_truth, outs_base, ["qkv0", "x2", "qkv", "loss"])
  names = ["d" + jax.tree_util.keystr(p) for p, _ in
           jax.tree_util.tree_flatten_with_path(g_truth)[0]]
  # Cotangents keep the primal dtypes (checked in _check_leaves against the baseline's).
  _check_leaves(g_got, g_truth, g_base, names)


def _shifted_runs(args, pos, cts, cfg):
  """(value, (dx0, dy0, dparams)) of <shifted_block, cts>: truth, baseline."""
  x0, y0, _, _, p, _ = args

  def loss(fn):
    return lambda x0, y0, p: _project(fn(x0, y0, p), cts)

  ref = loss(lambda x0, y0, p: R.shifted_block(x0, y0, pos, p, **HEADS))
  with jax.default_matmul_precision("highest"):
    truth = jax.value_and_grad(ref, (0, 1, 2))(*f32_tree((x0, y0, p)))
  base = jax.value_and_grad(ref, (0, 1, 2))(x0, y0, p)
  fused = loss(lambda x0, y0, p: B.shifted_block(x0, y0, pos, p, cfg))
  return fused, truth, base


GRAD_NAMES = ["value", "dx0", "dy0"] + [f"d{k}" for k in sorted(B.SHIFTED_KEYS)]


def _shifted_problem(key):
  """(args as ``_args``, positions, fixed cotangents of (x2, qkv) from the fp32 truth)."""
  args = _args(key, jnp.bfloat16)
  pos = jnp.arange(M, dtype=jnp.int32) % 64
  with jax.default_matmul_precision("highest"):
    x2, qkv = R.shifted_block(*f32_tree(args[:2]), pos, f32_tree(args[4]), **HEADS)
  k1, k2 = jax.random.split(jax.random.fold_in(key, 2))
  cts = [residual_cotangent(k1, x2, args[0].astype(jnp.float32)), _qkv_cotangent(k2, qkv)]
  return args, pos, cts


@pytest.mark.parametrize("path", ["xla", "kernels"])
def test_shifted_block_checkpointed(path, key, kernel_impl, remat_kernels):
  """jax.checkpoint (remat: the forward is recomputed inside the backward) gives the
  value and gradients of the plain run, and both are within the tolerance rule of the
  fp32 reference. The kernel path runs through the interpreter on CPU too
  (``remat_kernels``)."""
  args, pos, cts = _shifted_problem(key)
  cfg = dataclasses.replace(CFG, impl="xla" if path == "xla" else kernel_impl)
  fused, truth, base = _shifted_runs(args, pos, cts, cfg)
  x0, y0, _, _, p, _ = args
  plain = jax.jit(jax.value_and_grad(fused, (0, 1, 2)))(x0, y0, p)
  remat = jax.jit(jax.value_and_grad(jax.checkpoint(fused), (0, 1, 2)))(x0, y0, p)
  for name, a, c in zip(GRAD_NAMES, jax.tree.leaves(plain), jax.tree.leaves(remat)):
    # Same math; XLA may fuse (and so round) the recomputed forward differently.
    assert rel_err(a, c) < 1e-2, (name, rel_err(a, c))
  _check_leaves(plain, truth, base, GRAD_NAMES)
  _check_leaves(remat, truth, base, GRAD_NAMES)


def test_shifted_block_mlp_residuals(key, kernel_impl, monkeypatch):
  """``BlockConfig.mlp_residuals``: "output" keeps the MLP's y from the forward and the
  backward's GatedGrad GEMM stores no y; "recompute" recomputes and stores it there.
  Which one ran is recorded from the traced backward; "output"'s value and gradients
  are within the tolerance rule ("recompute", the default, is every other block test's)."""
  from coda_jax import block_gemms
  stored, gated = [], block_gemms.gated_input_grad

  def recording(*args, store_y=True, **kwargs):
    stored.append(store_y)
    return gated(*args, store_y=store_y, **kwargs)

  monkeypatch.setattr(block_gemms, "gated_input_grad", recording)
  args, pos, cts = _shifted_problem(key)
  x0, y0, _, _, p, _ = args
  runs = {}
  for mode in B.MLP_RESIDUALS:
    stored.clear()
    runs[mode] = _shifted_runs(args, pos, cts, dataclasses.replace(CFG, impl=kernel_impl,
                                                                  mlp_residuals=mode))
    jax.eval_shape(jax.grad(runs[mode][0], (0, 1, 2)), x0, y0, p)
    assert stored == [mode == "recompute"], (mode, stored)
  fused, truth, base = runs["output"]
  got = jax.jit(jax.value_and_grad(fused, (0, 1, 2)))(x0, y0, p)
  _check_leaves(got, truth, base, GRAD_NAMES)
  with pytest.raises(ValueError, match="mlp_residuals='z': one of"):
    dataclasses.replace(CFG, mlp_residuals="z")


def _scanned_shifted_grad(args, pos, cfg):
  """jax.grad (in the weights) of two shifted blocks under ``jax.lax.scan``, as a model's
  layer loop runs them: x2 carried, the next layer's y0 read from qkv, every residual
  stacked across the layers."""
  x0, y0, _, _, p, _ = args
  layers = jax.tree.map(lambda a: jnp.stack([a, a * 0.5]), p)
  hq = HEADS["n_q_heads"] * HEADS["head_dim"]

  def loss(layers):
    def body(carry, lp):
      x2, qkv = B.shifted_block(*carry, pos, lp, cfg)
      return (x2, qkv[:, :hq]), None
    (x, y), _ = jax.lax.scan(body, (x0, y0), layers)
    return jnp.sum(x.astype(jnp.float32) ** 2) + jnp.sum(y.astype(jnp.float32))

  return jax.grad(loss), layers


@pytest.mark.parametrize("mlp_residuals", B.MLP_RESIDUALS)
def test_scanned_block_runs_each_kernel_once(key, kernel_impl, mlp_residuals):
  """Under jax.grad of a layer scan, the compiled program holds no more GEMM kernels than
  the traced one: XLA's dynamic-slice fusion, which writes a stacked residual straight
  from the kernel that made it, ran a kernel twice where its output was also read
  elsewhere (x1, x2, qkv, and y with "output"), until those residuals were fenced
  (``coda_jax/residuals.py``; the 8B train step ran 3 of its 4 layers' QKV, out- and
  down-projection GEMMs twice). Counted on the GPU: the fusion is a pass of XLA's GPU
  compiler."""
  if kernel_impl != "mosaic":
    pytest.skip("XLA's dynamic-slice fusion is a GPU compiler pass: the compiled kernels "
                "are counted on the GPU (the fence's placement is checked on any machine "
                "by test_scanned_block_fences_shared_residuals)")
  args, pos, _ = _shifted_problem(key)
  cfg = dataclasses.replace(CFG, impl=kernel_impl, mlp_residuals=mlp_residuals)
  grad, layers = _scanned_shifted_grad(args, pos, cfg)
  traced = mosaic_launches(grad, layers)
  # loops kept rolled, so that each body's kernels are counted once, as traced
  hlo = jax.jit(grad).lower(layers).compile(compiler_options={
      "xla_gpu_enable_while_loop_unrolling": "WHILE_LOOP_UNROLLING_NO_UNROLL"}).as_text()
  compiled = hlo.count('custom_call_target="mosaic_gpu_v2"')
  assert 0 < compiled <= traced, (mlp_residuals, compiled, traced)


def test_scanned_block_fences_shared_residuals(key):
  """The forward of a scanned shifted block stores its shared residuals (x1, x2 and qkv;
  y too with "output") through an optimization barrier, which keeps XLA's GPU
  dynamic-slice fusion from running their kernels twice (the GPU counts them:
  test_scanned_block_runs_each_kernel_once). Traced only."""
  args, pos, _ = _shifted_problem(key)
  for mode, fenced in (("recompute", 3), ("output", 4)):
    cfg = dataclasses.replace(CFG, impl="xla", mlp_residuals=mode)
    grad, layers = _scanned_shifted_grad(args, pos, cfg)
    assert fenced_in_forward_scan(jax.make_jaxpr(grad)(layers).jaxpr) == fenced, mode


def test_shifted_block_batched_and_vmapped(key, kernel_impl):
  """(B, T, D) inputs and vmap over B give the (M, D) results, and all three are within
  the tolerance rule of the fp32 reference. 2 x 128 rows: each vmapped problem must
  tile by itself, and a (rows, D = 192) GEMM with B stored (K, N) needs rows a multiple
  of 128."""
  m = 2 * M
  x0, y0, _, _, p, _ = _args(key, jnp.bfloat16, m)
  pos = jnp.arange(m, dtype=jnp.int32) % M
  cfg = dataclasses.replace(CFG, impl=kernel_impl)
  flat = jax.jit(lambda: B.shifted_block(x0, y0, pos, p, cfg))()
  b = lambda a: a.reshape(2, m // 2, *a.shape[1:])
  batched = jax.jit(lambda: B.shifted_block(b(x0), b(y0), b(pos), p, cfg))()
  mapped = jax.jit(jax.vmap(lambda x, y, q: B.shifted_block(x, y, q, p, cfg)))(
      b(x0), b(y0), b(pos))
  with jax.default_matmul_precision("highest"):
    truth = R.shifted_block(*f32_tree((x0, y0)), pos, f32_tree(p), **HEADS)
  base = R.shifted_block(x0, y0, pos, p, **HEADS)
  for name, a, v, c, t, r in zip(("x2", "qkv"), batched, mapped, flat, truth, base):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b(c)))
    # vmap runs M/2-row problems, whose kernel config (and so the fp32 order of the
    # norm statistics) may differ: a few last-bit rounding flips, no more.
    assert rel_err(v, b(c)) < 1e-3, (name, rel_err(v, b(c)))
    for what, o in (("flat", c), ("vmap", v.reshape(c.shape))):
      assert_within_baseline(o, t, r, f"{name} ({what})")


QK_CFG = dataclasses.replace(CFG, qk_norm=True, eps=1e-6, impl="xla")


def test_qk_norm_blocks_forward_and_grads(key):
  """Qwen3's QK-norm in the pre- and shifted blocks (``BlockConfig.qk_norm``): qkv0, x2,
  qkv and the gradient of every input and weight, the q/k-norm weights (pre_block's
  ``qk_norm_w``, the shifted params' ``g_q_norm`` / ``g_k_norm``) included, against the
  jnp reference blocks with ``qk_norm_w``, under the tolerance rule. impl "xla": the
  blocks' XLA programs (the kernels run in test_flax_layers' Qwen3 model case)."""
  x0, y0, g0, wqkv0, ps, _ = _args(key, jnp.bfloat16)
  ks = jax.random.split(jax.random.fold_in(key, 3), 8)
  qn0 = tuple(1 + 0.3 * normal(k, (CFG.head_dim,)) for k in ks[:2])
  ps = {**ps, **{k: 1 + 0.3 * normal(kk, (CFG.head_dim,))
                 for k, kk in zip(B.QK_NORM_KEYS, ks[2:4])}}
  pos = jnp.arange(M, dtype=jnp.int32) % 100 + 3000
  heads = dict(HEADS, eps=QK_CFG.eps)

  def reference(x0, y0, g0, wqkv0, qn0, ps):
    qkv0 = R.pre_block(x0, g0, wqkv0, pos, **heads, qk_norm_w=qn0)
    x2, qkv = R.shifted_block(x0, y0, pos, ps, **heads,
                              qk_norm_w=(ps["g_q_norm"], ps["g_k_norm"]))
    return qkv0, x2, qkv

  def fused(x0, y0, g0, wqkv0, qn0, ps):
    return (B.pre_block(x0, pos, g0, wqkv0, QK_CFG, qn0),
            *B.shifted_block(x0, y0, pos, ps, QK_CFG))

  args = (x0, y0, g0, wqkv0, qn0, ps)
  up = f32_tree(args)
  with jax.default_matmul_precision("highest"):
    outs_truth = reference(*up)
  qkv0, x2, qkv = outs_truth
  cts = [_qkv_cotangent(ks[4], qkv0), residual_cotangent(ks[5], x2, up[0]),
         _qkv_cotangent(ks[6], qkv)]
  loss = lambda fn: lambda *a: _project(fn(*a), cts)
  argnums = tuple(range(len(args)))
  with jax.default_matmul_precision("highest"):
    g_truth = jax.grad(loss(reference), argnums)(*up)
  g_base = jax.grad(loss(reference), argnums)(*args)
  outs, g_got = jax.jit(lambda *a: (fused(*a), jax.grad(loss(fused), argnums)(*a)))(*args)
  _check_leaves(outs, outs_truth, reference(*args), ["qkv0", "x2", "qkv"])
  names = ["d" + jax.tree_util.keystr(p) for p, _ in
           jax.tree_util.tree_flatten_with_path(g_truth)[0]]
  assert len(names) == 14 and sum("_norm" in n for n in names) == 2, names
  _check_leaves(g_got, g_truth, g_base, names)


def _bad_args(key):
  x0, y0, g0, wqkv0, ps, pp = _args(key, jnp.bfloat16)
  return dict(x0=x0, y0=y0, g0=g0, wqkv0=wqkv0, ps=ps, pp=pp,
              pos=jnp.arange(M, dtype=jnp.int32), tgt=jnp.zeros((M,), jnp.int32))


# id -> (call on the _bad_args dict, the one message it must raise)
BAD = {
    "shifted-extra-key": (
        lambda a: B.shifted_block(a["x0"], a["y0"], a["pos"], {**a["ps"], "extra": a["g0"]},
                                  CFG),
        r"params must have exactly the keys \('wo', 'g_mlp', 'w13', 'w2', 'g_attn', 'wqkv'\)"),
    "wqkv-width": (
        lambda a: B.shifted_block(a["x0"], a["y0"], a["pos"],
                                  {**a["ps"], "wqkv": a["wqkv0"][:, :-32]}, CFG),
        r"wqkv has shape \(192, 224\), expected \(192, 256\)"),
    "w13-not-pair-blocks": (
        lambda a: B.shifted_block(a["x0"], a["y0"], a["pos"],
                                  {**a["ps"], "w13": a["ps"]["w13"][:, :2 * (F - 16)],
                                   "w2": a["ps"]["w2"][:F - 16]}, CFG),
        r"w13 width 480 must be a multiple of 2\*swiglu_block=64"),
    "y0-width": (lambda a: B.shifted_block(a["x0"], a["y0"][:, :-1], a["pos"], a["ps"], CFG),
                 r"y0 has width 127, expected 128"),
    "y0-dtype": (
        lambda a: B.shifted_block(a["x0"], a["y0"].astype(jnp.float16), a["pos"], a["ps"], CFG),
        r"must share leading shape and dtype"),
    "positions-rows": (
        lambda a: B.shifted_block(a["x0"], a["y0"], a["pos"][:-1], a["ps"], CFG),
        r"positions has shape \(127,\), expected the activations' leading shape \(128,\)"),
    "positions-float": (
        lambda a: B.pre_block(a["x0"], a["pos"].astype(jnp.float32), a["g0"], a["wqkv0"], CFG),
        r"positions\.dtype=float32: must be an integer type"),
    "qk-norm-keys-without-qk-norm": (
        lambda a: B.shifted_block(a["x0"], a["y0"], a["pos"],
                                  {**a["ps"], "g_q_norm": a["g0"][:32],
                                   "g_k_norm": a["g0"][:32]}, CFG),
        r"params must have exactly the keys \('wo', 'g_mlp', 'w13', 'w2', 'g_attn', 'wqkv'\)"),
    "qk-norm-without-its-keys": (
        lambda a: B.shifted_block(a["x0"], a["y0"], a["pos"], a["ps"], QK_CFG),
        r"params must have exactly the keys \('wo', 'g_mlp', 'w13', 'w2', 'g_attn', 'wqkv', "
        r"'g_q_norm', 'g_k_norm'\)"),
    "qk-norm-weight-head-dim": (
        lambda a: B.shifted_block(a["x0"], a["y0"], a["pos"],
                                  {**a["ps"], "g_q_norm": a["g0"][:64],
                                   "g_k_norm": a["g0"][:32]}, QK_CFG),
        r"g_q_norm has shape \(64,\), expected \(32,\)"),
    "pre-qk-norm-weights-missing": (
        lambda a: B.pre_block(a["x0"], a["pos"], a["g0"], a["wqkv0"], QK_CFG),
        r"pass qk_norm_w=\(q_norm_w, k_norm_w\) exactly when BlockConfig.qk_norm \(it is "
        r"True; got none\)"),
    "pre-qk-norm-weights-unasked": (
        lambda a: B.pre_block(a["x0"], a["pos"], a["g0"], a["wqkv0"], CFG,
                              (a["g0"][:32], a["g0"][:32])),
        r"exactly when BlockConfig.qk_norm \(it is False; got weights\)"),
    "pre-k-norm-head-dim": (
        lambda a: B.pre_block(a["x0"], a["pos"], a["g0"], a["wqkv0"], QK_CFG,
                              (a["g0"][:32], a["g0"][:16])),
        r"g_k_norm has shape \(16,\), expected \(32,\)"),
    "post-with-shifted-keys": (
        lambda a: B.post_block(a["x0"], a["y0"], a["tgt"], a["ps"], CFG),
        r"params must have exactly the keys \('wo', 'g_mlp', 'w13', 'w2', 'g_final', 'wlm'\)"),
    "post-reduction": (
        lambda a: B.post_block(a["x0"], a["y0"], a["tgt"], a["pp"],
                               dataclasses.replace(CFG, reduction="avg")),
        r"reduction='avg': one of \('mean', 'sum', 'none'\)"),
    "post-chunk-rows": (
        lambda a: B.post_block(a["x0"], a["y0"], a["tgt"], a["pp"],
                               dataclasses.replace(CFG, lm_chunk_rows=100)),
        r"chunk_rows=100 must be a positive divisor of M=128"),
    "post-head-grad": (
        lambda a: B.post_block(a["x0"], a["y0"], a["tgt"], a["pp"],
                               dataclasses.replace(CFG, head_grad="exps")),
        r"head_grad='exps': one of \('auto', 'logits', 'exp'\)"),
    "post-head-grad-fp16": (
        lambda a: B.post_block(a["x0"].astype(jnp.float16), a["y0"].astype(jnp.float16),
                               a["tgt"], a["pp"], dataclasses.replace(CFG, head_grad="exp")),
        "overflows float16"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_block_inputs(case, key):
  """Each bad input raises ValueError with its own message (checked at trace time)."""
  fn, match = BAD[case]
  args = _bad_args(key)
  with pytest.raises(ValueError, match=match):
    jax.eval_shape(lambda: fn(args))


@pytest.mark.parametrize("reduction, wlm_layout, head_grad",
                         [("mean", "dv", "logits"), ("sum", "vd", "logits"),
                          ("mean", "vd", "exp")])
def test_post_block_scalar_loss(reduction, wlm_layout, head_grad, key, kernel_impl):
  """The post-block of a "mean" or "sum" loss: its head gradient is formed in the
  forward (3 vocabulary-sized GEMMs per chunk) and scaled in the backward. Every
  gradient under the tolerance rule for a cotangent of 0.75; the loss equals the mean
  or sum of the fused per-token losses. With "vd" the head is passed (V, D), as a tied
  embedding, and its gradient comes back (V, D). ``head_grad`` "exp": the head stores
  exp(logits) and the final norm's backward runs in XLA after its dh GEMM."""
  args = _args(key, jnp.bfloat16)
  x0, y0, p = args[0], args[1], args[5]
  tgt = jax.random.randint(jax.random.fold_in(key, 1), (M,), 0, V).at[::5].set(-100)
  cfg = dataclasses.replace(CFG, impl=kernel_impl, reduction=reduction,
                            wlm_layout=wlm_layout, head_grad=head_grad)
  vd = wlm_layout == "vd"

  def fused(x0, y0, p):
    p = {**p, "wlm": p["wlm"].T} if vd else p  # jax.grad turns (V, D) back into (D, V)
    return 0.75 * B.post_block(x0, y0, tgt, p, cfg)

  def ref(x0, y0, p):
    return 0.75 * R.post_block(x0, y0, tgt, p, reduction=reduction)

  with jax.default_matmul_precision("highest"):
    truth = jax.grad(ref, (0, 1, 2))(*f32_tree((x0, y0, p)))
  base = jax.grad(ref, (0, 1, 2))(x0, y0, p)
  loss, got = jax.jit(jax.value_and_grad(fused, (0, 1, 2)))(x0, y0, p)
  names = ["d" + jax.tree_util.keystr(q) for q, _ in
           jax.tree_util.tree_flatten_with_path(truth)[0]]
  _check_leaves(got, truth, base, names)
  per_token = B.post_block(x0, y0, tgt, {**p, "wlm": p["wlm"].T} if vd else p,
                           dataclasses.replace(cfg, reduction="none"))
  counted = np.asarray(tgt) != -100
  want = np.asarray(per_token, np.float64)[counted]
  want = want.mean() if reduction == "mean" else want.sum()
  np.testing.assert_allclose(float(loss), 0.75 * want, rtol=1e-5)


@pytest.mark.parametrize("dt, want", [(jnp.bfloat16, "exp"), (jnp.float16, "logits")])
def test_post_block_default_head_grad(dt, want, key, monkeypatch):
  """``BlockConfig``'s default head_grad ("auto") reaches the head as "exp" for
  bfloat16 activations and as "logits" for float16, which "exp" refuses."""
  assert CFG.head_grad == "auto"
  stores = record_head_stores(monkeypatch)
  args = _args(key, dt)
  tgt = jax.random.randint(jax.random.fold_in(key, 1), (M,), 0, V)
  cfg = dataclasses.replace(CFG, impl="xla")
  grads = jax.grad(lambda x0: B.post_block(x0, args[1], tgt, args[5], cfg))(args[0])
  assert stores == [want], stores
  assert bool(jnp.all(jnp.isfinite(grads.astype(jnp.float32))))


@pytest.mark.parametrize("reduction, wlm_layout", [("mean", "vd"), ("none", "dv")])
def test_post_block_vocabulary_that_does_not_tile(reduction, wlm_layout, key, kernel_impl):
  """The post-block with a vocabulary of 201 (not a multiple of 64, as GPT-2's 50257):
  the head is padded to 256 masked columns inside (``fused_ops.pad_vocab``), on the
  scalar-loss path (gradient formed in the forward) and the per-row one (logits
  recomputed in the backward). Every gradient under the tolerance rule, dwlm with the
  head's own shape."""
  v = 201
  args = _args(key, jnp.bfloat16)
  x0, y0, p = args[0], args[1], dict(args[5])
  p["wlm"] = p["wlm"][:, :v]
  tgt = jax.random.randint(jax.random.fold_in(key, 1), (M,), 0, v).at[::5].set(-100)
  tgt = tgt.at[3].set(v - 1)
  cfg = dataclasses.replace(CFG, impl=kernel_impl, reduction=reduction,
                            wlm_layout=wlm_layout)
  vd = wlm_layout == "vd"
  ct = (normal(jax.random.fold_in(key, 2), (M,)) if reduction == "none"
        else jnp.float32(0.75))

  def fused(x0, y0, p):
    p = {**p, "wlm": p["wlm"].T} if vd else p
    return jnp.sum(ct * B.post_block(x0, y0, tgt, p, cfg))

  def ref(x0, y0, p):
    return jnp.sum(ct * R.post_block(x0, y0, tgt, p, reduction=reduction))

  with jax.default_matmul_precision("highest"):
    truth = jax.grad(ref, (0, 1, 2))(*f32_tree((x0, y0, p)))
  base = jax.grad(ref, (0, 1, 2))(x0, y0, p)
  got = jax.jit(jax.grad(fused, (0, 1, 2)))(x0, y0, p)
  assert got[2]["wlm"].shape == (p["wlm"].shape[0], v)
  names = ["d" + jax.tree_util.keystr(q) for q, _ in
           jax.tree_util.tree_flatten_with_path(truth)[0]]
  _check_leaves(got, truth, base, names)
