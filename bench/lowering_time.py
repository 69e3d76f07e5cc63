"""How long a fused workload takes to trace and lower for an H100, measured on any
machine: Mosaic GPU lowers without a GPU, so the workload is exported for CUDA
(``jax.export``, platforms ``cuda``) with the dispatch told that its target is an H100.
Nothing runs and nothing is compiled by XLA.

    PYTHONPATH=. python -m bench.lowering_time --post-block 1b,8b --train llama-3-8b:4

The fused training step's compile on the GPU host is mostly this (its "warm" compile,
served from JAX's persistent cache, was as slow as the cold one: the cache spares XLA's
compile, not the lowering that comes before it). Reported per workload: seconds to
export, ``pallas_kernels.gemm`` calls traced (each is a kernel lowered), and the size
of the exported module. Tuned configs are the H100's from the shipped cache.
"""
from __future__ import annotations

import argparse
import contextlib
import time
import types

import jax
import jax.numpy as jnp

from coda_jax import dispatch

H100 = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3",
                             core_count=132, compute_capability="9.0")


@contextlib.contextmanager
def pretend_h100():
  """The dispatch runs "mosaic" for an H100 here, and counts the GEMMs it traces. JAX's
  caches are cleared on the way out: nothing traced for the pretend device is reused."""
  saved = dispatch.kernels_available, dispatch.target_device, dispatch.pk.gemm
  traced = []

  def counting(*args, **kwargs):
    traced.append(1)
    return saved[2](*args, **kwargs)

  dispatch.kernels_available, dispatch.target_device = (lambda: True), (lambda: H100)
  dispatch.pk.gemm = counting
  try:
    yield traced
  finally:
    dispatch.kernels_available, dispatch.target_device, dispatch.pk.gemm = saved
    jax.clear_caches()


def export_time(fn, *args) -> dict:
  """Exports ``fn`` for CUDA as an H100 would run it: seconds, GEMMs traced, MB."""
  with pretend_h100() as traced:
    t0 = time.perf_counter()
    exported = jax.export.export(jax.jit(fn), platforms=["cuda"])(*args)
    seconds = time.perf_counter() - t0
  return dict(seconds=seconds, gemms_traced=len(traced),
              module_mb=len(exported.mlir_module()) / 1e6)


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
  from flax_layers import config as C, train
  from flax_layers.model import Llama
  cfg = C.get_config(config, **({} if layers is None else {"n_layers": layers}))
  tx = train.make_optimizer(learning_rate=3e-4, total_steps=10)

  def make():
    model = Llama(cfg, rngs=nnx.Rngs(0), fused=True)
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
  p.add_argument("--train", default="", help="CONFIG[:LAYERS],... e.g. llama-3-8b:4")
  args = p.parse_args()
  rows = [(f"post-block fwd+bwd {s}", post_block(s))
          for s in filter(None, args.post_block.split(","))]
  for spec in filter(None, args.train.split(",")):
    name, _, layers = spec.partition(":")
    rows.append((f"train step {spec}", train_step(name, int(layers) if layers else None)))
  print(f"jax {jax.__version__}; lowered for an H100 on {jax.devices()[0].device_kind}")
  print("| workload | seconds | GEMMs traced | module MB |\n|---|---|---|---|")
  for what, r in rows:
    print(f"| {what} | {r['seconds']:.1f} | {r['gemms_traced']} | {r['module_mb']:.1f} |")


if __name__ == "__main__":
  main()
