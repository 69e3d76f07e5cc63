"""The fused ops under jax.shard_map (data parallel): rows split over a mesh axis,
weights replicated. The multi-device cases run in a fresh process with 2 fake CPU
devices (tests/sharded_check.py): the device count is fixed when jax starts."""
import os
import re
import subprocess
import sys

import jax.numpy as jnp
import pytest

from coda_jax import sharding

HERE = os.path.dirname(os.path.abspath(__file__))


def test_rules_are_identity_outside_shard_map():
  x, w = jnp.ones((4, 3)), jnp.ones((3,))
  assert sharding.varying_axes(x) == frozenset()
  assert sharding.reduce_like(w * 2, w) is not None
  assert jnp.array_equal(sharding.reduce_like(w * 2, w), w * 2)
  assert jnp.array_equal(sharding.vary_like(x, w, x), x)
  assert sharding.reduce_like(None, w) is None


@pytest.fixture(scope="module")
def sharded_results():
  """name -> (max relative gradient difference from one device, all-gathers,
  all-reduces) for each case of sharded_check.py (XLA path)."""
  out = subprocess.run([sys.executable, os.path.join(HERE, "sharded_check.py"), "xla"],
                       capture_output=True, text=True, timeout=900)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  cases = {}
  for m in re.finditer(r"CASE (\S+) (\S+) all-gather=(\d+) all-reduce=(\d+)", out.stdout):
    cases[m.group(1)] = (float(m.group(2)), int(m.group(3)), int(m.group(4)))
  assert len(cases) == 6, out.stdout
  return cases


@pytest.mark.parametrize("name", ["residual_rmsnorm", "rmsnorm_swiglu", "rmsnorm_qkv_rope",
                                  "rmsnorm_lm_head_loss", "shifted_block", "post_block"])
def test_data_parallel_matches_one_device(sharded_results, name):
  """Gradients of inputs and of replicated weights equal the one-device ones: the
  weights' partial gradients are summed across the row shards, in fp32 (a bf16 sum of
  bf16 partials would differ by ~3e-3)."""
  diff, _, _ = sharded_results[name]
  assert diff < 1e-4, diff


@pytest.mark.parametrize("name", ["residual_rmsnorm", "shifted_block", "post_block"])
def test_data_parallel_gathers_no_activations(sharded_results, name):
  """Each device runs on its own rows: the compiled program has no all-gather, and one
  all-reduce (XLA combines the weight gradients' sums)."""
  _, gathers, reduces = sharded_results[name]
  assert gathers == 0
  assert reduces >= 1
