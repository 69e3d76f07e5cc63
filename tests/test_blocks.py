"""Whole blocks (coda_jax.blocks): pre-block, shifted block and post-block forward and
backward against jax.grad of the pure-jnp reference blocks, under the tolerance rule
(tests/helpers.assert_within_baseline): fp32 truth, 2x the unfused bf16 error."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coda_jax import blocks as B
from coda_jax import jnp_reference as R
from helpers import assert_within_baseline, normal, rel_err

M, D, F, V = 256, 128, 128, 256
CFG = B.BlockConfig(n_q_heads=4, n_kv_heads=2, head_dim=32, lm_chunk_rows=128)
HEADS = dict(n_q_heads=4, n_kv_heads=2, head_dim=32)


def _params(key, keys, dt):
  shapes = {"wo": (CFG.n_q_heads * CFG.head_dim, D), "g_mlp": (D,), "w13": (D, 2 * F),
            "w2": (F, D), "g_attn": (D,), "wqkv": (D, CFG.qkv_width), "g_final": (D,),
            "wlm": (D, V)}
  ks = jax.random.split(key, len(keys))
  return {k: (1 + 0.1 * normal(kk, shapes[k])) if k.startswith("g_")
          else normal(kk, shapes[k], dt) * shapes[k][0] ** -0.5 for k, kk in zip(keys, ks)}


def _model(blocks, pos, tgt, cts):
  """pre_block -> shifted_block -> post_block, as a scalar: the loss plus the
  intermediate outputs projected on fixed cotangents (so every path is checked)."""
  def loss(x0, y0, g0, wqkv0, p_shift, p_post):
    qkv0, (x2, qkv), ce = blocks(x0, y0, g0, wqkv0, p_shift, p_post)
    proj = sum(jnp.sum(o.astype(jnp.float32) * c) for o, c in zip((qkv0, x2, qkv), cts))
    return ce + proj
  return loss


def _fused(cfg, pos, tgt):
  def blocks(x0, y0, g0, wqkv0, p_shift, p_post):
    qkv0 = B.pre_block(x0, pos, g0, wqkv0, cfg)
    x2, qkv = B.shifted_block(x0, y0, pos, p_shift, cfg)
    return qkv0, (x2, qkv), B.post_block(x2, y0, tgt, p_post, cfg)
  return blocks


def _reference(pos, tgt):
  def blocks(x0, y0, g0, wqkv0, p_shift, p_post):
    qkv0 = R.pre_block(x0, g0, wqkv0, pos, **HEADS)
    x2, qkv = R.shifted_block(x0, y0, pos, p_shift, **HEADS)
    return qkv0, (x2, qkv), R.post_block(x2, y0, tgt, p_post)
  return blocks


def _args(key, dt):
  ks = jax.random.split(key, 6)
  return (normal(ks[0], (M, D), dt), normal(ks[1], (M, CFG.n_q_heads * CFG.head_dim), dt),
          1 + 0.1 * normal(ks[2], (D,)), normal(ks[3], (D, CFG.qkv_width), dt) * D ** -0.5,
          _params(ks[4], B.SHIFTED_KEYS, dt), _params(ks[5], B.POST_KEYS, dt))


@pytest.mark.parametrize("dt", [jnp.bfloat16, jnp.float16])
def test_blocks_forward_and_grads(dt, key, kernel_impl):
  args = _args(key, dt)
  pos = jnp.arange(M, dtype=jnp.int32) % 100 + 3000  # packed sequences, late positions
  tgt = jax.random.randint(jax.random.fold_in(key, 1), (M,), 0, V).at[::5].set(-100)
  cts = [normal(jax.random.fold_in(key, i), s) for i, s in
         enumerate([(M, CFG.qkv_width), (M, D), (M, CFG.qkv_width)])]
  ref = _model(_reference(pos, tgt), pos, tgt, cts)
  fused = _model(_fused(dataclasses.replace(CFG, impl=kernel_impl), pos, tgt), pos, tgt, cts)
  argnums = tuple(range(6))
  up = jax.tree.map(lambda a: a.astype(jnp.float32), args)
  with jax.default_matmul_precision("highest"):
    g_truth = jax.grad(ref, argnums)(*up)
  g_base = jax.grad(ref, argnums)(*args)
  g_got = jax.jit(jax.grad(fused, argnums))(*args)
  fused_blocks = _fused(dataclasses.replace(CFG, impl=kernel_impl), pos, tgt)
  with jax.default_matmul_precision("highest"):
    outs_truth = _reference(pos, tgt)(*up)
  outs_base = _reference(pos, tgt)(*args)
  outs = jax.jit(fused_blocks)(*args)
  names = ("qkv0", "x2", "qkv", "loss")
  for name, o, t, b in zip(names, *(jax.tree.leaves(v) for v in (outs, outs_truth, outs_base))):
    assert o.dtype == b.dtype, (name, o.dtype, b.dtype)
    assert_within_baseline(o if o.ndim else o[None], t if t.ndim else t[None],
                           b if b.ndim else b[None], name)
  for (path, g), t, b in zip(jax.tree_util.tree_leaves_with_path(g_got),
                             jax.tree.leaves(g_truth), jax.tree.leaves(g_base)):
    what = "d" + jax.tree_util.keystr(path)
    assert g.dtype == b.dtype, (what, g.dtype, b.dtype)  # cotangents keep primal dtypes
    assert_within_baseline(g if g.ndim else g[None], t if t.ndim else t[None],
                           b if b.ndim else b[None], what)


def test_shifted_block_batched_and_checkpointed(key, kernel_impl):
  """(B, T, D) inputs, vmap over B and jax.checkpoint give the (M, D) results."""
  x0, y0, _, _, p, _ = _args(key, jnp.bfloat16)
  pos = jnp.arange(M, dtype=jnp.int32) % 128
  # jax.checkpoint rejects the interpreter's io_callback effects: on CPU the remat check
  # runs the custom_vjp over the XLA path, on a GPU the compiled kernels.
  cfg = dataclasses.replace(CFG, impl=kernel_impl if kernel_impl == "mosaic" else "xla")
  loss = lambda x0, p: sum(jnp.sum(o.astype(jnp.float32) ** 2)
                           for o in B.shifted_block(x0, y0, pos, p, cfg))
  plain = jax.jit(jax.value_and_grad(loss, (0, 1)))(x0, p)
  remat = jax.jit(jax.value_and_grad(jax.checkpoint(loss), (0, 1)))(x0, p)
  for a, c in zip(jax.tree.leaves(plain), jax.tree.leaves(remat)):
    # Same math; XLA may fuse (and so round) the recomputed forward differently.
    assert rel_err(a, c) < 1e-2, rel_err(a, c)
  cfg = dataclasses.replace(CFG, impl=kernel_impl)
  flat = jax.jit(lambda: B.shifted_block(x0, y0, pos, p, cfg))()
  b = lambda a: a.reshape(2, M // 2, *a.shape[1:])
  batched = jax.jit(lambda: B.shifted_block(b(x0), b(y0), b(pos), p, cfg))()
  mapped = jax.jit(jax.vmap(lambda x, y, q: B.shifted_block(x, y, q, p, cfg)))(
      b(x0), b(y0), b(pos))
  for a, v, c in zip(batched, mapped, flat):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b(c)))
    # vmap runs M/2-row problems, whose kernel config (and so the fp32 order of the
    # norm statistics) may differ: a few last-bit rounding flips, no more.
    assert rel_err(v, b(c)) < 1e-3, rel_err(v, b(c))


def _bad(key):
  x0, y0, g0, wqkv0, ps, pp = _args(key, jnp.bfloat16)
  pos = jnp.arange(M, dtype=jnp.int32)
  tgt = jnp.zeros((M,), jnp.int32)
  return [
      (lambda: B.shifted_block(x0, y0, pos, {**ps, "extra": g0}, CFG), "exactly the keys"),
      (lambda: B.shifted_block(x0, y0, pos, {**ps, "wqkv": wqkv0[:, :-32]}, CFG),
       "wqkv has shape"),
      (lambda: B.shifted_block(x0, y0[:, :-1], pos, ps, CFG), "y0 has width"),
      (lambda: B.shifted_block(x0, y0.astype(jnp.float16), pos, ps, CFG), "share"),
      (lambda: B.shifted_block(x0, y0, pos[:-1], ps, CFG), "positions has shape"),
      (lambda: B.pre_block(x0, pos.astype(jnp.float32), g0, wqkv0, CFG), "positions.dtype"),
      (lambda: B.post_block(x0, y0, tgt, ps, CFG), "exactly the keys"),
      (lambda: B.post_block(x0, y0, tgt, pp, dataclasses.replace(CFG, reduction="avg")),
       "reduction"),
      (lambda: B.post_block(x0, y0, tgt, pp, dataclasses.replace(CFG, lm_chunk_rows=100)),
       "chunk_rows"),
  ]


@pytest.mark.parametrize("case", range(9))
def test_bad_block_inputs(case, key):
  fn, match = _bad(key)[case]
  with pytest.raises(ValueError, match=match):
    jax.eval_shape(fn)
