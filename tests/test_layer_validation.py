"""The Flax layers refuse a bad construction at once and a bad call by name: each error
names the layer, the argument or weight, and both sizes."""
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from flax_layers.layers import FusedMLP, LMHeadLoss, OutProjection, QKVProjection


def rngs():
  return nnx.Rngs(0)


@pytest.mark.parametrize("build,match", [
    (lambda: QKVProjection(512, 8, 3, 64, rngs=rngs()),
     r"QKVProjection: n_q_heads=8 must be a multiple of n_kv_heads=3"),
    (lambda: QKVProjection(512, 8, 0, 64, rngs=rngs()),
     r"QKVProjection: n_kv_heads=0 must be a positive integer"),
    (lambda: QKVProjection(512, 8, 2, 63, rngs=rngs()), r"QKVProjection: head_dim=63 must be even"),
    (lambda: QKVProjection(512, 8, 2, 64, eps=0.0, rngs=rngs()),
     r"QKVProjection: eps=0.0 must be a positive number"),
    (lambda: QKVProjection(512.0, 8, 2, 64, rngs=rngs()),
     r"QKVProjection: d_model=512.0 must be a positive integer"),
    (lambda: FusedMLP(512, 1000, rngs=rngs()), r"FusedMLP: ffn_dim=1000 must be a multiple of block=32"),
    (lambda: FusedMLP(-1, 1024, rngs=rngs()), r"FusedMLP: d_model=-1 must be a positive integer"),
    (lambda: FusedMLP(512, 1024, activation="relu", rngs=rngs()), r"FusedMLP: activation='relu'"),
    (lambda: OutProjection(0, 512, rngs=rngs()), r"OutProjection: q_width=0"),
    (lambda: LMHeadLoss(512, 0, rngs=rngs()), r"LMHeadLoss: vocab_size=0"),
], ids=["gqa", "no_kv_heads", "odd_head_dim", "eps", "float_width", "ffn_block", "negative",
        "activation", "out_width", "vocab"])
def test_construction_refuses_bad_sizes(build, match):
  with pytest.raises(ValueError, match=match):
    build()


def test_numpy_sizes_are_accepted():
  QKVProjection(np.int64(64), np.int64(2), np.int64(1), np.int64(16), rngs=rngs())


@pytest.mark.parametrize("call,match", [
    (lambda: FusedMLP(512, 1024, fused=False, rngs=rngs())(jnp.ones((2, 384))),
     r"FusedMLP: x has shape \(2, 384\), but w13 \(512, 2048\) expects a last dimension "
     r"of 512"),
    (lambda: QKVProjection(128, 2, 1, 32, fused=False, rngs=rngs())(
        jnp.ones((2, 3, 96)), jnp.zeros((2, 3), jnp.int32)),
     r"QKVProjection: x has shape \(2, 3, 96\), but wqkv \(128, 128\) expects a last "
     r"dimension of 128"),
    (lambda: QKVProjection(128, 2, 1, 32, fused=False, rngs=rngs())(
        jnp.ones((2, 3, 128)), jnp.zeros((2, 4), jnp.int32)),
     r"QKVProjection: positions has shape \(2, 4\); it must be x's leading shape \(2, 3\)"),
    (lambda: OutProjection(64, 128, fused=False, rngs=rngs())(jnp.ones((4, 32)),
                                                              jnp.ones((4, 128))),
     r"OutProjection: y has shape \(4, 32\), but wo \(64, 128\) expects a last dimension "
     r"of 64"),
    (lambda: OutProjection(64, 128, fused=False, rngs=rngs())(jnp.ones((4, 64)),
                                                              jnp.ones((4, 96))),
     r"OutProjection: residual has shape \(4, 96\), but wo \(64, 128\) expects a last "
     r"dimension of 128"),
    (lambda: LMHeadLoss(64, 256, fused=False, rngs=rngs())(
        jnp.ones((2, 8, 32)), jnp.zeros((2, 8), jnp.int32)),
     r"LMHeadLoss: x has shape \(2, 8, 32\), but norm \(64,\) expects a last dimension of 64"),
    (lambda: LMHeadLoss(64, 256, fused=False, rngs=rngs())(
        jnp.ones((2, 8, 64)), jnp.zeros((2, 7), jnp.int32)),
     r"LMHeadLoss: targets has shape \(2, 7\); it must be x's leading shape \(2, 8\)"),
    (lambda: LMHeadLoss(64, 256, tied=True, fused=False, rngs=rngs())(
        jnp.ones((2, 8, 64)), jnp.zeros((2, 8), jnp.int32), wlm=jnp.ones((32, 256))),
     r"LMHeadLoss: wlm has shape \(32, 256\); it must be \(D, V\) with D = 64"),
], ids=["mlp", "qkv", "positions", "out_y", "out_residual", "head_x", "head_targets",
        "head_wlm"])
def test_calls_name_the_layer_weight_and_sizes(call, match):
  with pytest.raises(ValueError, match=match):
    call()


def test_good_calls_still_run():
  x = jnp.ones((2, 4, 128), jnp.float32)
  assert FusedMLP(128, 256, fused=False, rngs=rngs())(x).shape == x.shape
  pos = jnp.zeros((2, 4), jnp.int32)
  assert QKVProjection(128, 2, 1, 32, fused=False, rngs=rngs())(x, pos).shape == (2, 4, 128)
