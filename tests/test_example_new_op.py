"""examples/bias_sqrelu_mlp.py, the public recipe for a fused op of one's own: its
forward and gradients against an fp32 truth under the tolerance rule (2x the unfused
bf16 graph's error, overall and per row), through the kernel and the XLA programs."""
import os
import sys

import jax
import jax.numpy as jnp
import pytest

from helpers import assert_within_baseline, normal

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from examples.bias_sqrelu_mlp import sqrelu_mlp, sqrelu_mlp_reference  # noqa: E402


def _inputs(key, m, d, f, dt=jnp.bfloat16):
  ks = jax.random.split(key, 6)
  return dict(x=normal(ks[0], (m, d), dt), w1=normal(ks[1], (d, f)) * d ** -0.5,
              b1=0.5 * normal(ks[2], (f,)), w2=normal(ks[3], (f, d)) * f ** -0.5,
              b2=0.5 * normal(ks[4], (d,)), ct=normal(ks[5], (m, d), dt))


def _truth(x, w1, b1, w2, b2):
  with jax.default_matmul_precision("highest"):
    z = x.astype(jnp.float32) @ w1 + b1
    return x.astype(jnp.float32) + jnp.square(jnp.maximum(z, 0.0)) @ w2 + b2


@pytest.mark.parametrize("shape", [(128, 128, 256), (320, 128, 256)])  # M = 5 x 64
def test_example_op_and_grads(key, kernel_impl, shape):
  p = _inputs(key, *shape)
  args = (p["x"], p["w1"], p["b1"], p["w2"], p["b2"])
  proj = lambda fn: lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * p["ct"].astype(jnp.float32))
  truth_grads = jax.grad(proj(_truth), range(5))(
      p["x"].astype(jnp.float32), *args[1:])
  base_grads = jax.grad(proj(sqrelu_mlp_reference), range(5))(*args)
  for impl in ("xla", kernel_impl):
    fused = lambda *a, impl=impl: sqrelu_mlp(*a, impl=impl)
    got = fused(*args)
    assert got.shape == p["x"].shape and got.dtype == p["x"].dtype
    assert_within_baseline(got, _truth(*args), sqrelu_mlp_reference(*args), f"{impl} y")
    grads = jax.grad(proj(fused), range(5))(*args)
    for name, g, t, b, a in zip(("dx", "dw1", "db1", "dw2", "db2"), grads, truth_grads,
                                base_grads, args):
      assert g.dtype == a.dtype, (impl, name)
      assert_within_baseline(g, t, b, f"{impl} {name}")


def test_example_checks_its_shapes():
  p = _inputs(jax.random.key(0), 64, 64, 128)
  with pytest.raises(ValueError, match="b1 \\(128,\\) and b2 \\(64,\\)"):
    sqrelu_mlp(p["x"], p["w1"], p["b2"], p["w2"], p["b2"])
