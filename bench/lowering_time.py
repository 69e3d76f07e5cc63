"""How long a fused workload takes to trace and lower for an H100, measured on any
machine: Mosaic GPU lowers without a GPU, so the workload is exported for CUDA
(``jax.export``, platforms ``cuda``) with the dispatch told that its target is an H100.
Nothing runs and nothing is compiled by XLA.

    PYTHONPATH=. python -m bench.lowering_time --post-block 1b,8b --train llama-3-8b:4

The fused training step's compile on the GPU host is mostly this: JAX's persistent
compilation cache spares XLA's compile, not the lowering that comes before it. Each
distinct kernel is lowered once per process and kept in the kernel cache's folder
(``pallas_kernels.kernel_cache``; by default here a new empty folder, so the figures are
cold; ``--kernel-cache DIR`` twice shows a later process's). Reported per workload:
seconds to export, ``pallas_kernels.gemm`` calls traced, how many kernels were lowered,
reused within the process or read from the folder, and the size of the exported module.
Tuned configs are the H100's from the shipped cache.
"""
from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
import types

import jax
import jax.numpy as jnp

from coda_jax import dispatch
from pallas_kernels import kernel_cache

# What each GPU's jax.devices()[0] reports (the fields the dispatch, the tuning cache's
# keys and the kernel cache's keys read).
H100 = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3",
                             core_count=132, compute_capability="9.0")
H200 = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H200", core_count=132,
                             compute_capability="9.0")
DEVICES = {"h100": H100, "h200": H200}


@contextlib.contextmanager
def pretend(device=H100):
  """The dispatch runs "mosaic" for ``device`` here (one of ``DEVICES``), and counts the
  GEMMs it traces. JAX's caches are cleared on the way out: nothing traced for the
  pretend device is reused.

  Args:
    device: what the GPU's ``jax.devices()[0]`` reports.

  Returns:
    A context manager giving the list that grows by one per ``gemm`` call traced."""
  saved = dispatch.kernels_available, dispatch.target_device, dispatch.pk.gemm
  traced = []

  def counting(*args, **kwargs):
    traced.append(1)
    return saved[2](*args, **kwargs)

  dispatch.kernels_available, dispatch.target_device = (lambda: True), (lambda: device)
  dispatch.pk.gemm = counting
  try:
    yield traced
  finally:
    dispatch.kernels_available, dispatch.target_device, dispatch.pk.gemm = saved
    jax.clear_caches()


def export_time(fn, *args) -> dict:
  """Exports ``fn`` for CUDA as an H100 would run it: seconds, GEMMs traced, MB, and how
  the kernel cache found the kernels (``pallas_kernels.kernel_cache``: lowered now, reused
  from this process's memory, read from the cache folder)."""
  before = kernel_cache.counts.copy()
  with pretend() as traced:
    t0 = time.perf_counter()
    exported = jax.export.export(jax.jit(fn), platforms=["cuda"])(*args)
    seconds = time.perf_counter() - t0
  found = kernel_cache.counts - before
  return dict(seconds=seconds, gemms_traced=len(traced),
              module_mb=len(exported.mlir_module()) / 1e6,
              **{f"kernels_{how}": found[how] for how in ("lowered", "memory", "disk")})


def post_block(shape: str, chunk_rows: int | None = None) -> dict:
  """bench/block.py's post-block forward+backward at one of its shapes (LM-head chunks
  of ``chunk_rows`` rows; default the library's choice)."""
  import dataclasses
  from bench import block as bb
  from coda_jax import blocks
  s = bb.SHAPES[shape]
  x = jax.eval_shape(lambda: bb.make_inputs(s, jax.random.key(0)))
  cfg = dataclasses.replace(bb.block_configs(s)[1], lm_chunk_rows=chunk_rows)
  p = jax.eval_shape(lambda q: bb.ours_params(q, blocks.POST_KEYS), x["params"])
  grad = jax.grad(lambda a, b, t, q: blocks.post_block(a, b, t, q, cfg), argnums=(0, 1, 3))
  return export_time(grad, x["x0"], x["y0"], x["targets"], p)


def abstract_train_step(config: str, layers: int | None, batch: int = 8,
                        seq: int = 2048) -> tuple:
  """(step, args): the main job's fused train step (flax_layers.train.make_train_step) of
  a config, and abstract arguments for it (state, tokens, targets) at ``batch`` x
  ``seq`` tokens; nothing is allocated."""
  from flax import nnx
  from flax_layers import config as C, gpt2, train
  from flax_layers.model import Llama
  gpt = config in gpt2.GPT2_CONFIGS
  get = gpt2.get_gpt2_config if gpt else C.get_config
  cfg = get(config, **({} if layers is None else {"n_layers": layers}))
  seq = min(seq, cfg.n_positions) if gpt else seq
  tx = train.make_optimizer(learning_rate=3e-4, total_steps=10)

  def make():
    model = (gpt2.GPT2 if gpt else Llama)(cfg, rngs=nnx.Rngs(0), fused=True)
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

  graphdef, state = nnx.split(nnx.eval_shape(make))
  tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
  return train.make_train_step(graphdef), (state, tokens, tokens)


def train_step(config: str, layers: int | None, batch: int = 8, seq: int = 2048) -> dict:
  """Export time of the main job's fused train step of a config."""
  step, args = abstract_train_step(config, layers, batch, seq)
  return export_time(lambda s, t, y: step(s, t, y), *args)


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--post-block", default="1b", help="bench/block.py shapes, comma-separated")
  p.add_argument("--train", default="",
                 help="CONFIG[:LAYERS],... e.g. llama-3-8b:4 or gpt2-small")
  p.add_argument("--kernel-cache", default="",
                 help="the kernel cache's folder (pallas_kernels.kernel_cache); default a "
                 "new empty one, so every workload's kernels are lowered (cold) unless an "
                 "earlier workload of this run had them; 'none' for memory only")
  args = p.parse_args()
  if args.kernel_cache.lower() == "none":
    kernel_cache.set_cache_dir(None)
  else:
    kernel_cache.set_cache_dir(args.kernel_cache or tempfile.mkdtemp(prefix="kernels-"))
  rows = [(f"post-block fwd+bwd {s}", post_block(s))
          for s in filter(None, args.post_block.split(","))]
  for spec in filter(None, args.train.split(",")):
    name, _, layers = spec.partition(":")
    rows.append((f"train step {spec}", train_step(name, int(layers) if layers else None)))
  print(f"jax {jax.__version__}; lowered for an H100 on {jax.devices()[0].device_kind}")
  print(f"kernel cache: {kernel_cache.cache_dir()}")
  print("| workload | seconds | GEMMs traced | kernels lowered | reused in process | "
        "read from the folder | module MB |\n|---|---|---|---|---|---|---|")
  for what, r in rows:
    print(f"| {what} | {r['seconds']:.1f} | {r['gemms_traced']} | {r['kernels_lowered']} | "
          f"{r['kernels_memory']} | {r['kernels_disk']} | {r['module_mb']:.1f} |")


if __name__ == "__main__":
  main()
