"""The fused ops under jax.shard_map (data parallel): rows split over a mesh axis,
weights replicated. The multi-device cases run in a fresh process with 2 fake CPU
devices (tests/sharded_check.py): the device count is fixed when jax starts."""
import os
import re
import subprocess
import sys

import jax
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
  out = subprocess.run([sys.executable, os.path.join(HERE, "sharded_check.py"), "xla",
                        "train"], capture_output=True, text=True, timeout=900)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  cases = {}
  for m in re.finditer(r"CASE (\S+) (\S+) all-gather=(\d+) all-reduce=(\d+)", out.stdout):
    cases[m.group(1)] = (float(m.group(2)), int(m.group(3)), int(m.group(4)))
  assert len(cases) == 6, out.stdout
  m = re.search(r"TRAIN loss_diff=(\S+) param_diff=(\S+) all-gather=(\d+) all-reduce=(\d+)",
                out.stdout)
  assert m, out.stdout
  cases["train_step"] = (float(m.group(1)), float(m.group(2)), int(m.group(3)),
                         int(m.group(4)))
  m = re.search(r"FSDP loss_diff=(\S+) param_diff=(\S+) arg_bytes_ratio=(\S+) "
                r"all-gather=(\d+)", out.stdout)
  assert m, out.stdout
  cases["fsdp"] = (float(m.group(1)), float(m.group(2)), float(m.group(3)), int(m.group(4)))
  return cases


@pytest.mark.parametrize("name", ["residual_rmsnorm", "rmsnorm_swiglu", "rmsnorm_qkv_rope",
                                  "rmsnorm_lm_head_loss", "shifted_block", "post_block"])
def test_data_parallel_matches_one_device(sharded_results, name):
  """Gradients of inputs and of replicated weights equal the one-device ones: the
  weights' partial gradients are summed across the row shards, in fp32 (a bf16 sum of
  bf16 partials would differ by ~3e-3)."""
  diff, _, _ = sharded_results[name]
  assert diff < 1e-4, diff


def test_data_parallel_train_step(sharded_results):
  """flax_layers.train.make_train_step(mesh=...): two AdamW steps of the tiny Llama on 2
  devices (the batch's rows split, one device with fewer counted targets) give the
  one-device loss (the mean over the whole batch) and parameters, with no all-gather."""
  loss_diff, param_diff, gathers, reduces = sharded_results["train_step"]
  assert loss_diff < 1e-5 and param_diff < 1e-4, (loss_diff, param_diff)
  assert gathers == 0 and reduces >= 1


def test_fsdp_train_step(sharded_results):
  """The same steps with the state split by train.fsdp_shardings: the same loss and
  parameters, half the argument bytes per device (compiled memory analysis: the
  parameters and AdamW moments dominate), and the parameters gathered (all-gathers)."""
  loss_diff, param_diff, arg_ratio, gathers = sharded_results["fsdp"]
  assert loss_diff < 1e-5 and param_diff < 1e-4, (loss_diff, param_diff)
  assert arg_ratio < 0.55, arg_ratio
  assert gathers >= 1


@pytest.mark.parametrize("name", ["residual_rmsnorm", "shifted_block", "post_block"])
def test_data_parallel_gathers_no_activations(sharded_results, name):
  """Each device runs on its own rows: the compiled program has no all-gather, and one
  all-reduce (XLA combines the weight gradients' sums)."""
  _, gathers, reduces = sharded_results[name]
  assert gathers == 0
  assert reduces >= 1


@pytest.mark.parametrize("axes,batch,match", [
    ({"model": 1}, None, r"data_axis='data' is not an axis of the mesh \{'model': 1\}"),
    ({"data": 2, "model": 2}, None, r"mesh axes \{'model': 2\} besides 'data'"),
    ({"data": 2}, 3, r"batch 3 is not divisible by the 2 devices of mesh axis 'data'"),
])
def test_train_step_checks_its_mesh(axes, batch, match):
  from flax_layers import train
  mesh = jax.sharding.AbstractMesh(tuple(axes.values()), tuple(axes))
  with pytest.raises(ValueError, match=match):
    train.check_mesh(mesh, "data", batch)


def test_train_step_mesh_and_micro_batches():
  from flax_layers import train
  mesh = jax.sharding.AbstractMesh((1,), ("data",))
  with pytest.raises(ValueError, match="micro_batches > 1 with a mesh is not supported yet"):
    train.make_train_step(None, micro_batches=2, mesh=mesh)
