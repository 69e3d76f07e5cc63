"""Each fused op's forward stores the residuals that other computations also read through
``coda_jax.residuals.fenced`` (one optimization barrier), so that inside a layer scan
XLA's GPU dynamic-slice fusion does not run their kernels twice (docs/known_issues.md;
the blocks' own check is tests/test_blocks.py). Traced only: the count of the barrier's
outputs in the forward scan's body, per op; the GPU count of compiled kernels is
test_blocks.py::test_scanned_block_runs_each_kernel_once."""
import jax
import jax.numpy as jnp
import pytest

from coda_jax import fused_ops as F
from coda_jax import layernorm_ops as L
from helpers import fenced_in_forward_scan, normal

M, D, FF = 64, 64, 128
BF = jnp.bfloat16


def _fenced_in_scanned_forward(step, weights, carry):
  """Outputs of optimization barriers in the forward scan of jax.grad over a two-step
  ``jax.lax.scan`` of ``step(carry, weights) -> carry`` (floats summed into the loss)."""
  stacked = jax.tree.map(lambda a: jnp.stack([a, a]), weights)

  def loss(stacked):
    out, _ = jax.lax.scan(lambda c, w: (step(c, w), None), carry, stacked)
    return sum(jnp.sum(v.astype(jnp.float32)) for v in jax.tree.leaves(out))

  return fenced_in_forward_scan(jax.make_jaxpr(jax.grad(loss))(stacked).jaxpr)


def _normal(key, shape, scale=1.0):
  return (scale * normal(key, shape)).astype(BF)


def _ops():
  ks = jax.random.split(jax.random.key(0), 8)
  y = _normal(ks[0], (M, D))
  pos = jnp.arange(M, dtype=jnp.int32)
  rms = lambda c, w: F.residual_rmsnorm(y, w["w"], c, w["g"], impl="xla")[0]
  qkv = lambda c, w: F.rmsnorm_qkv_rope(
      c, jnp.ones((M,), jnp.float32), w["w"], pos, n_q_heads=2, n_kv_heads=1, head_dim=16,
      impl="xla")[:, :D]
  ln = lambda c, w: L.residual_layernorm(y, w["w"], c, w["g"], impl="xla")[0]

  def mlp(c, w, residuals):
    x, h, mu, r = L.residual_layernorm(y, w["w"], c, w["g"], impl="xla")
    return L.layernorm_gelu_mlp(x, h, mu, r, w["g"], w["g"], w["w1"], w["b1"], w["w2"],
                                w["b2"], impl="xla", residuals=residuals,
                                next_norm=w["g"])[0]

  sq = {"w": _normal(ks[1], (D, D), 0.1), "g": jnp.ones((D,), jnp.float32)}
  wide = {"w": _normal(ks[2], (D, 64), 0.1)}
  mlp_w = {**sq, "w1": _normal(ks[3], (D, FF), 0.1), "b1": jnp.zeros((FF,), jnp.float32),
           "w2": _normal(ks[4], (FF, D), 0.1), "b2": jnp.zeros((D,), jnp.float32)}
  carry = _normal(ks[5], (M, D))
  # name -> (step, weights, barrier outputs expected in the forward)
  return {
      "residual_rmsnorm": (rms, sq, 1),  # x
      "rmsnorm_qkv_rope": (qkv, wide, 1),  # qkv
      "residual_layernorm": (ln, sq, 1),  # x
      # the producer's x, the MLP's output (its next norm's x), and a ("slope" only)
      "layernorm_gelu_mlp_slope": (lambda c, w: mlp(c, w, "slope"), mlp_w, 3),
      "layernorm_gelu_mlp_recompute": (lambda c, w: mlp(c, w, "recompute"), mlp_w, 2),
  }, carry


@pytest.mark.parametrize("op", ["residual_rmsnorm", "rmsnorm_qkv_rope", "residual_layernorm",
                                "layernorm_gelu_mlp_slope", "layernorm_gelu_mlp_recompute"])
def test_fused_op_fences_shared_residuals(op):
  ops, carry = _ops()
  step, weights, expected = ops[op]
  assert _fenced_in_scanned_forward(step, weights, carry) == expected, op
