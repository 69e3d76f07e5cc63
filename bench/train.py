"""Trains a Llama or a GPT-2 twice, on the fused path and on the plain-XLA reference, and compares.

    PYTHONPATH=. python -m bench.train [--config llama-3.2-1b] [--steps 200] [--out DIR]

(GPT-2: ``--config gpt2-tiny`` or ``gpt2-small``, ``flax_layers.gpt2``.)

Both runs start from the same initial parameters and see the same batches of bytes of
Python source (bench/corpus.py). Reported per path: step time and tokens/s, compile time,
the loss curve, validation loss, peak memory; and how far apart the two curves are next
to the reference curve's own noise. Defaults: on an sm90 GPU Llama-3.2-1B, batch 8 x 2048
tokens, 200 AdamW steps. Elsewhere the tiny config, sized to finish on a 2-core CPU in ~3
minutes; there the fused path runs its XLA fallback, so the run checks the training
plumbing and the loss agreement, not kernel speed. Writes train_<config>.{json,md,png}
to --out (default bench/results/<device>/).

With both paths, each one trains in a process of its own (``--one-process`` runs them in
this one), so the second path compiles on a device the first has entirely given back. A
path's micro-batch count is checked against the memory the allocator can hand out at run
time, not only against the compiled estimate; a path that fits at no micro-batch count is
reported and skipped, and the other path's results are still written.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Each path is split into the fewest micro-batches whose compiled step fits the device's
# allocator limit. JAX's default limit is 75% of the GPU, which split the 8B-shaped
# reference (60.9 GB at one micro-batch) in two on an H100; 95% lets each path use the
# GPU it runs on. A value set in the environment wins; the results record the limit used.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
# The user's preallocation setting, for the per-path processes (the parent turns it off).
_PREALLOCATE = os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE")

import jax  # noqa: E402 (after the allocator's setting)
import numpy as np
import orbax.checkpoint as ocp  # flax depends on it
from flax import nnx

from bench import common, corpus
from coda_jax import epilogue_gemm, fused_ops
from coda_jax.blocks import MLP_RESIDUALS
from flax_layers import CONFIGS, Llama, LlamaConfig, get_config, load_hf_checkpoint, train
from flax_layers.gpt2 import (GPT2, GPT2_CONFIGS, GPT2Config, get_gpt2_config,
                              load_gpt2_checkpoint)
from pallas_kernels import kernel_cache

WARMUP = 3  # steps left out of the timing: the first runs right after compilation
SMOOTH = 9  # width of the moving average the reference's noise is measured against
BIG = dict(batch=8, seq=2048, steps=200, lr=3e-4)
DEFAULTS = {"tiny": dict(batch=8, seq=128, steps=200, lr=1e-3)}  # ~3 min, both paths, 2 CPUs
DEFAULTS["qwen3-tiny"] = DEFAULTS["tiny"]  # the same sizes with Qwen3's QK-norm
DEFAULTS["gpt2-tiny"] = DEFAULTS["tiny"]
DEFAULTS["gpt2-small"] = dict(batch=16, seq=1024, steps=200, lr=6e-4)  # 1024 positions
ALL_CONFIGS = sorted({**CONFIGS, **GPT2_CONFIGS})  # Llama and GPT-2 (flax_layers.gpt2)


def int_at_least(minimum: int):
  """An argparse type: an integer >= ``minimum``."""
  def parse(text: str) -> int:
    try:
      value = int(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < minimum:
      raise argparse.ArgumentTypeError(
          f"{value} must be at least 1" if minimum == 1 else f"{value} must not be negative")
    return value
  return parse


positive_int, nonnegative_int = int_at_least(1), int_at_least(0)


def positive_float(text: str) -> float:
  """argparse type: a finite number > 0."""
  try:
    value = float(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
  if not 0 < value < float("inf"):
    raise argparse.ArgumentTypeError(f"{value} must be a positive finite number")
  return value


def parse_args(argv=None):
  p = argparse.ArgumentParser(prog="python -m bench.train",
                              description=__doc__.splitlines()[0])
  p.add_argument("--config", choices=ALL_CONFIGS, default=None,
                 help="default llama-3.2-1b on an sm90 GPU, else tiny")
  p.add_argument("--layers", type=positive_int, help="override the config's n_layers")
  for flag, kind in (("batch", positive_int), ("seq", positive_int), ("steps", positive_int),
                     ("lr", positive_float)):
    rule = f"; must exceed the {WARMUP} untimed warm-up steps" if flag == "steps" else ""
    p.add_argument(f"--{flag}", type=kind, help=f"default {BIG[flag]} (tiny, qwen3-tiny: "
                   f"{DEFAULTS['tiny'][flag]}){rule}")
  p.add_argument("--warmup-steps", type=nonnegative_int,
                 help="learning-rate warm-up (default steps/10)")
  p.add_argument("--seed", type=int, default=0, help="parameters and batch order "
                 "(default 0)")
  p.add_argument("--head-grad", choices=fused_ops.HEAD_GRADS, default=None,
                 help="the fused LM head's unit gradient (LlamaConfig.head_grad; default "
                      "the config's, \"auto\": \"exp\" unless float16)")
  p.add_argument("--mlp-residuals", choices=MLP_RESIDUALS, default=None,
                 help="what each layer's gated MLP keeps for its backward "
                      "(LlamaConfig.mlp_residuals; default the config's, \"recompute\")")
  p.add_argument("--paths", default="fused,reference",
                 help="comma-separated, in run order (default fused,reference)")
  p.add_argument("--one-process", action="store_true",
                 help="run every path in this process (default: each of several paths in a "
                 "process of its own, so no path inherits another's memory)")
  p.add_argument("--micro-batches", type=positive_int, help="gradient accumulation pieces "
                 "per step (default: 1, or as many as the step needs to fit the device)")
  p.add_argument("--eval-batches", type=positive_int, default=8,
                 help="held-out validation batches (default 8)")
  p.add_argument("--out", type=Path, help="default bench/results/<device>/")
  p.add_argument("--mesh", default=None, help="e.g. data=2 (data parallel: the batch's rows "
                 "split over 2 devices) or data=2,model=2 (plus Megatron tensor parallel "
                 "over 'model': column-parallel wqkv/w13/wlm, row-parallel wo/w2)")
  p.add_argument("--fsdp", action="store_true", help="with --mesh: split the parameters "
                 "and optimizer state over the data axis, each array inside each layer "
                 "(train.fsdp_shardings; gathered once per step with --partitioner "
                 "shard_map, per layer with jit)")
  p.add_argument("--partitioner", choices=("shard_map", "jit"), default=None,
                 help="jit (default): plain jit, each fused GEMM split as its operands are "
                 "sharded (coda_jax.partitioning); shard_map: each device runs the whole "
                 "model on its rows (data axis only; on a GPU it needs --attention xla: "
                 "jax 0.11.2's compiler segfaults with cuDNN attention there, "
                 "docs/known_issues.md)")
  p.add_argument("--head-per-device", choices=("on", "off"), default="on",
                 help="with --mesh data=N under jit: on (default): the fused last block and "
                 "LM head run per device in one shard_map, their weight gradients summed "
                 "across devices once per step (make_train_step's loss_row_split); off: "
                 "every GEMM through jit's per-GEMM rule")
  p.add_argument("--attention", choices=("cudnn", "xla"), default=None,
                 help="jax.nn.dot_product_attention's implementation (default: cuDNN on a "
                 "GPU for 16-bit activations, else XLA)")
  p.add_argument("--checkpoint-dir", type=Path, help="save the training state (parameters, "
                 "optimizer, step; the step is the data position) with orbax under "
                 "DIR/<path>/<step>")
  p.add_argument("--save-every", type=positive_int, help="with --checkpoint-dir: steps between "
                 "saves (default steps/10); the last step is always saved")
  p.add_argument("--resume", action="store_true", help="continue each path from the "
                 "newest checkpoint in --checkpoint-dir (bit for bit: the same batches "
                 "follow)")
  p.add_argument("--stop-after", type=positive_int, help="stop after this step (saving it), as an "
                 "interrupted run would; --resume continues")
  p.add_argument("--init-from", type=Path, help="start from a Hugging Face checkpoint "
                 "directory (config.json + safetensors): its config replaces --config")
  p.add_argument("--compile-cache", default=str(Path.home() / ".cache/coda_jax/xla"),
                 help="JAX's persistent compilation cache ('none' turns it off; default "
                 "%(default)s); the run reports the first compile and a warm one served "
                 "from the cache")
  p.add_argument("--program-cache", default=str(Path.home() / ".cache/coda_jax/programs"),
                 help="where the lowered train and eval steps are kept across runs "
                 "(coda_jax.program_cache; 'none' turns it off; default %(default)s): a "
                 "later run skips lowering the fused kernels, most of the fused path's "
                 "compile time")
  p.add_argument("--kernel-cache", default=None,
                 help="where each lowered Mosaic GPU kernel is kept across runs "
                 "(pallas_kernels.kernel_cache; default $CODA_JAX_KERNEL_CACHE, else "
                 "~/.cache/coda_jax/kernels; 'none': kept in this process only): a later "
                 "run, or another model with the same GEMMs, skips lowering them")
  # Where each path runs in a process of its own (main's run_path_in_child), this one.
  p.add_argument("--child-result", type=Path, help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  args.argv = list(sys.argv[1:] if argv is None else argv)
  args.paths = args.paths.split(",")
  if not set(args.paths) <= {"fused", "reference"} or len(set(args.paths)) < len(args.paths):
    p.error(f"--paths {','.join(args.paths)}: distinct names of fused, reference")
  args.spawn = len(args.paths) > 1 and not args.one_process and args.child_result is None
  if args.spawn:
    # This process only reports; no allocator of its own may take the GPU (the
    # kernels_available call below starts jax's backend).
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
  if args.init_from is not None and args.config is not None:
    p.error("--init-from takes the model's config from the checkpoint: drop --config")
  if args.init_from is not None:
    args.config = f"hf-{args.init_from.resolve().name}"  # names the results
  elif args.config is None:
    args.config = "llama-3.2-1b" if epilogue_gemm.kernels_available() else "tiny"
  if (args.resume or args.stop_after or args.save_every) and args.checkpoint_dir is None:
    p.error("--resume, --stop-after and --save-every need --checkpoint-dir")
  for k, v in DEFAULTS.get(args.config, BIG).items():
    setattr(args, k, v if getattr(args, k) is None else getattr(args, k))
  if args.warmup_steps is None:
    args.warmup_steps = max(1, args.steps // 10)
  if args.micro_batches is not None and args.batch % args.micro_batches:
    p.error(f"--micro-batches {args.micro_batches} must divide --batch {args.batch}")
  if args.steps <= WARMUP:
    p.error(f"--steps must exceed the {WARMUP} untimed warm-up steps")
  if args.save_every is None:
    args.save_every = max(1, args.steps // 10)
  if args.stop_after is not None and not 0 < args.stop_after < args.steps:
    p.error(f"--stop-after {args.stop_after}: a step in 1..{args.steps - 1}")
  return args


def checkpoints(args, path):
  """The orbax manager of one path's training state, or None without --checkpoint-dir."""
  if args.checkpoint_dir is None:
    return None
  # Synchronous saves: the next step donates the state's buffers.
  options = ocp.CheckpointManagerOptions(max_to_keep=2, create=True,
                                         enable_async_checkpointing=False)
  return ocp.CheckpointManager(args.checkpoint_dir.resolve() / path, options=options)


class _Lines:
  """A stream for tqdm off a terminal: each redraw becomes one line of the log."""

  def write(self, text):
    for part in text.split("\r"):
      if part.strip():
        sys.stderr.write(part.rstrip("\n") + "\n")

  def flush(self):
    sys.stderr.flush()


class Progress:
  """The steps' progress bar (tqdm, on stderr): steps, loss, tokens/s and the time left.
  Off a terminal (a log) it writes a line every ~10% of the steps."""

  def __init__(self, label, total, tokens_per_step, start=0):
    from tqdm import tqdm
    tty = sys.stderr.isatty()
    self.label, self.tokens = label, tokens_per_step
    self.bar = tqdm(total=total, initial=start, desc=label, unit="step",
                    file=sys.stderr if tty else _Lines(),
                    dynamic_ncols=tty, mininterval=0.5 if tty else 0,
                    miniters=1 if tty else max(1, total // 10),
                    bar_format="{desc} {n_fmt}/{total_fmt} |{bar:20}| [{elapsed}<{remaining}]")

  def update(self, i, loss, times):
    recent = statistics.median(times[1:][-10:] or times)  # times[0] ran right after compile
    self.bar.set_description_str(
        f"{self.label}: loss {loss:.4f}, {self.tokens / recent:,.0f} tokens/s,", refresh=False)
    if i == self.bar.total:  # close() draws the final line: drawing it here too doubled it
      self.bar.n = i
      self.bar.close()
    else:
      self.bar.update(i - self.bar.n)


def device_limit_bytes():
  stats = jax.devices()[0].memory_stats()
  return stats.get("bytes_limit") if stats else None


def largest_allocation(stats):
  """The largest single buffer a device's allocator can still hand out, from its
  ``memory_stats()``: its largest free block, or the memory it has not reserved yet,
  whichever is larger. None where the device reports no statistics (CPU)."""
  if not stats or "bytes_limit" not in stats:
    return None
  reserved = stats.get("pool_bytes", stats.get("bytes_reserved", stats.get("bytes_in_use", 0)))
  return max(stats.get("largest_free_block_bytes", 0), stats["bytes_limit"] - reserved)


def temp_room(temp_bytes, devices):
  """The device that cannot allocate a step's temporary buffer of ``temp_bytes`` in one
  piece now, and the most it can, or None where every device can (or none reports).

  XLA allocates the buffer when the step runs; on several devices a device that fails
  leaves the others waiting at NCCL's rendezvous for good (jax 0.11.2), so the run
  checks first."""
  if not temp_bytes:
    return None
  for d in devices:
    room = largest_allocation(d.memory_stats())
    if room is not None and temp_bytes > room:
      return d, room
  return None


class DoesNotFit(Exception):
  """A path's step fits the device at no micro-batch count; the message says why."""


class NeedsMoreMicroBatches(Exception):
  """The first step ran out of device memory: retry the path from its start at ``k``."""

  def __init__(self, k):
    super().__init__(k)
    self.k = k


def is_out_of_memory(error: Exception) -> bool:
  return isinstance(error, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in str(error)


def mem_limit(results):
  limit = next((r["device_limit_bytes"] for r in results if r.get("device_limit_bytes")),
               None)
  return f"{limit / 2**30:.1f} GiB" if limit else "-"


def device_peak_bytes():
  stats = jax.devices()[0].memory_stats()  # None on CPU
  return stats.get("peak_bytes_in_use") if stats else None


def run_path(path, cfg, args, train_batches, val_batches):
  """Trains one path from scratch (or from --resume's checkpoint); everything it allocated
  is freed on return. Returns its results, or ``{"path": path, "skipped": why}`` when its
  step fits the device at no micro-batch count."""
  k = args.micro_batches or 1
  while True:
    try:
      return train_path(path, cfg, args, train_batches, val_batches, k)
    except DoesNotFit as e:
      reason = str(e)
    except NeedsMoreMicroBatches as e:
      k = e.k
      reason = None
    gc.collect()  # the failed attempt's arrays, before the next one allocates
    if reason is not None:
      print(f"{path}: skipped: {reason}", flush=True)
      return {"path": path, "skipped": reason}


def train_path(path, cfg, args, train_batches, val_batches, k):
  """One attempt at a path with at least ``k`` micro-batches (``run_path``)."""
  if args.init_from is not None:
    load = load_gpt2_checkpoint if isinstance(cfg, GPT2Config) else load_hf_checkpoint
    model = load(args.init_from, fused=path == "fused", seed=args.seed)
  else:
    model = (GPT2 if isinstance(cfg, GPT2Config) else Llama)(
        cfg, rngs=nnx.Rngs(args.seed), fused=path == "fused")
  r = dict(path=path, runs_on=train.describe_path(model))
  runs_on = r["runs_on"]
  print(runs_on if runs_on.startswith(path) else f"{path}: {runs_on}", flush=True)
  tx = train.make_optimizer(learning_rate=args.lr, warmup_steps=args.warmup_steps,
                            total_steps=args.steps)
  graphdef, state = train.init_state(model, tx)
  del model  # its arrays are the state's, which the first step donates
  mesh = args.mesh_obj
  rows = None if mesh is None else jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec("data"))
  put = lambda batch: tuple(jax.device_put(x, rows) for x in batch)
  if mesh is not None and mesh.shape.get("model", 1) > 1:  # Megatron split over "model"
    train.check_tensor_parallel(cfg, mesh)
    state = jax.device_put(state, train.tensor_parallel_shardings(state, mesh))
  elif mesh is not None:  # parameters and optimizer state replicated, or split (--fsdp)
    state = jax.device_put(state, train.fsdp_shardings(state, mesh) if args.fsdp else
                           jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
  start, mngr = 0, checkpoints(args, path)
  if mngr is not None and args.resume and mngr.latest_step() is not None:
    start = mngr.latest_step()
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    state = mngr.restore(start, args=ocp.args.StandardRestore(abstract))
    print(f"{path}: resumed at step {start} from {mngr.directory}", flush=True)
  r["first_step"] = start + 1
  r["compile_s"] = 0.0
  first = put(train_batches[0])  # the batch the step is lowered for
  programs = None if args.program_cache == "none" else args.program_cache
  make_step = lambda k: train.make_train_step(graphdef, micro_batches=k, mesh=mesh,
                                              partitioner=args.partitioner,
                                              program_cache=programs,
                                              loss_row_split=args.head_per_device == "on")
  before = kernel_cache.counts.copy()
  lowers = path == "fused" and epilogue_gemm.kernels_available()
  print(f"{path}: compiling the train step" + (
      " (a kernel not in the kernel cache takes a second or two to lower)" if lowers
      else ""), flush=True)
  devices = [jax.devices()[0]] if mesh is None else list(mesh.devices.flat)
  can_halve = lambda k: not args.micro_batches and args.batch % (2 * k) == 0
  while True:  # "auto": halve the micro-batch until the compiled step fits the device
    step = make_step(k)
    t0 = time.perf_counter()
    compiled = step.lower(state, *first).compile()
    r["compile_s"] += time.perf_counter() - t0
    m = compiled.memory_analysis()  # arguments and outputs live throughout; temp is scratch
    r["compiled_peak_bytes"] = m and (m.argument_size_in_bytes + m.output_size_in_bytes +
                                      m.temp_size_in_bytes - m.alias_size_in_bytes)
    limit = device_limit_bytes()
    # Two tests: the compiled estimate against the allocator's limit (mesh runs are sized
    # by the user), then the step's scratch buffer against the largest piece the
    # allocator can hand out now, which is what the step needs when it runs.
    if (mesh is None and limit and r["compiled_peak_bytes"]
        and r["compiled_peak_bytes"] > 0.95 * limit):
      why = (f"{r['compiled_peak_bytes'] / 2**30:.1f} GiB does not fit in "
             f"{limit / 2**30:.1f} GiB")
    else:
      short = m and temp_room(m.temp_size_in_bytes, devices)
      if not short:
        break
      why = (f"the step's {m.temp_size_in_bytes / 2**30:.1f} GiB scratch buffer does not "
             f"fit in the {short[1] / 2**30:.1f} GiB {short[0]} can allocate in one piece")
    if not can_halve(k):
      raise DoesNotFit(f"{why} at {k} micro-batch{'es' if k > 1 else ''}" + (
          " (--micro-batches fixes the count)" if args.micro_batches else
          f"; --batch {args.batch} splits no further"))
    print(f"{path}: {why}: {2 * k} micro-batches", flush=True)
    k *= 2
  found = kernel_cache.counts - before
  r["kernels"] = {how: found[how] for how in ("lowered", "memory", "disk")}
  print(f"{path}: compiled in {r['compile_s']:.1f} s" + (
      f" ({r['kernels']['lowered']} kernels lowered, {r['kernels']['memory']} reused, "
      f"{r['kernels']['disk']} read from the kernel cache)" if lowers else ""), flush=True)
  if programs is not None:
    r["program"] = step.source(state, *first)
  if args.compile_cache != "none" or programs is not None:
    # the same step again, as a later process would make it: traced anew, its program
    # from the program cache and its executable from the persistent compilation cache
    jax.clear_caches()
    t0 = time.perf_counter()
    step = make_step(k)
    compiled = step.lower(state, *first).compile()
    r["warm_compile_s"] = time.perf_counter() - t0
  r["micro_batches"] = k
  r["losses"], r["step_s"] = [], []
  last = args.stop_after or args.steps
  bar = Progress(path, args.steps, args.batch * args.seq, start=start)
  for i in range(start, last):
    tokens, targets = put(train_batches[i])  # the host-to-device copy stays untimed
    t0 = time.perf_counter()
    try:
      state, loss = compiled(state, tokens, targets)
      loss = float(jax.block_until_ready(loss))
    except jax.errors.JaxRuntimeError as e:
      # Out of memory in the first step despite the checks above: the state was donated,
      # so the path starts over with twice the micro-batches, or is skipped.
      if i != start or not is_out_of_memory(e):
        raise
      if not can_halve(k):
        raise DoesNotFit(f"its first step ran out of device memory at {k} micro-batches "
                         f"({str(e).splitlines()[0][:200]})") from None
      print(f"{path}: the first step ran out of device memory at {k} micro-batches: "
            f"starting over with {2 * k}", flush=True)
      raise NeedsMoreMicroBatches(2 * k) from None
    r["step_s"].append(time.perf_counter() - t0)
    r["losses"].append(loss)
    bar.update(i + 1, loss, r["step_s"])
    if mngr is not None and ((i + 1) % args.save_every == 0 or i + 1 == last):
      mngr.save(i + 1, args=ocp.args.StandardSave(state), force=True)
  if mngr is not None:
    mngr.wait_until_finished()
    mngr.close()
  evaluate = train.make_eval_step(graphdef, mesh=mesh, partitioner=args.partitioner,
                                  program_cache=programs)
  r["val_loss"] = float(np.mean([evaluate(state, *put(b)) for b in val_batches]))
  r["device_peak_bytes"] = device_peak_bytes()
  r["device_limit_bytes"] = device_limit_bytes()
  del state, compiled, step, evaluate
  gc.collect()
  return r


def summarize(results, tokens_per_step):
  """Adds each trained path's timing and final loss to its results; returns the two paths'
  comparison ({} unless both trained)."""
  results = [r for r in results if "skipped" not in r]
  for r in results:
    timed = r["step_s"][WARMUP:] or r["step_s"]  # a resumed run may have few steps left
    r["median_step_ms"] = 1e3 * statistics.median(timed)
    r["tokens_per_s"] = tokens_per_step / r["median_step_ms"] * 1e3
    r["final_loss"] = float(np.mean(r["losses"][-10:]))
  by = {r["path"]: r for r in results}
  if set(by) != {"fused", "reference"}:
    return {}
  fused, ref = np.array(by["fused"]["losses"]), np.array(by["reference"]["losses"])
  if fused.size == 0 or fused.shape != ref.shape:
    return {}
  diff = np.abs(fused - ref)
  # How much the reference curve itself jitters from step to step (batch noise): its
  # residual from a centered moving average, over the flatter second half of the run.
  half, noise = ref[len(ref) // 2:], None
  if half.size > SMOOTH + 1:
    smooth = np.convolve(half, np.ones(SMOOTH) / SMOOTH, "valid")
    noise = float(np.std(half[SMOOTH // 2:half.size - SMOOTH // 2] - smooth))
  return dict(speedup=by["fused"]["tokens_per_s"] / by["reference"]["tokens_per_s"],
              loss_diff_first=float(diff[0]), loss_diff_mean=float(diff.mean()),
              loss_diff_max=float(diff.max()), loss_diff_last20_mean=float(diff[-20:].mean()),
              reference_noise_std=noise,
              val_loss_diff=by["fused"]["val_loss"] - by["reference"]["val_loss"])


def markdown(all_results, summary, args, cfg, data, prov):
  mib = lambda v: f"{v / 2**20:,.0f}" if v else "-"
  results = [r for r in all_results if "skipped" not in r]
  skipped = [r for r in all_results if "skipped" in r]
  md = [f"# Training {args.config} ({cfg.n_layers} layers): "
        + " vs ".join(r["path"] for r in all_results), "",
        f"device: {prov['device']}; jax {prov['jax_version']}; commit {prov['commit']}",
        f"command: `{prov['command']}`", data.describe(),
        f"model: {cfg.param_count() / 1e6:,.1f}M parameters, d_model {cfg.d_model}, "
        f"vocab {cfg.vocab_size}; batch {args.batch} x {args.seq} tokens, {args.steps} "
        f"AdamW steps, lr {args.lr:g} ({args.warmup_steps} warm-up), seed {args.seed}",
        (f"mesh: {args.mesh} ({args.mesh_obj.size} devices, {args.partitioner}"
         f"{', FSDP' if args.fsdp else ''}; tokens/s per device: " + ", ".join(
             f"{r['path']} {r['tokens_per_s_per_device']:,.0f}" for r in results) + ")")
        if args.mesh else "mesh: none (1 device)",
        f"allocator limit: {mem_limit(results)} (XLA_PYTHON_CLIENT_MEM_FRACTION="
        f"{os.environ.get('XLA_PYTHON_CLIENT_MEM_FRACTION', '-')})", "",
        "| path | runs on | micro-batches | compile s (warm) | step ms | tokens/s | final loss | "
        "val loss | compiled peak MiB | device peak MiB |", "|" + "---|" * 10]
  warm = lambda r: f" ({r['warm_compile_s']:.1f})" if "warm_compile_s" in r else ""
  md += [f"| {r['path']} | {r['runs_on']} | {r['micro_batches']} | {r['compile_s']:.1f}"
         f"{warm(r)} | "
         f"{r['median_step_ms']:.1f} "
         f"| {r['tokens_per_s']:,.0f} | {r['final_loss']:.4f} | {r['val_loss']:.4f} | "
         f"{mib(r['compiled_peak_bytes'])} | {mib(r['device_peak_bytes'])} |" for r in results]
  md += [f"| {r['path']} | skipped: {r['skipped']} |" + " - |" * 8 for r in skipped]
  if summary:
    s, noise = summary, summary["reference_noise_std"]
    noise = "-" if noise is None else f"{noise:.2e}"
    md += ["", f"fused / reference speed: **{s['speedup']:.3f}x** (tokens/s). Loss "
           f"|fused - reference|: step 1 (identical parameters) {s['loss_diff_first']:.1e}; "
           f"over all steps mean {s['loss_diff_mean']:.2e}, max {s['loss_diff_max']:.2e}; "
           f"last 20 steps mean {s['loss_diff_last20_mean']:.2e}. The reference's own "
           f"step-to-step noise (std of its residual from a {SMOOTH}-step moving average, "
           f"second half): {noise}. Validation loss fused - reference: "
           f"{s['val_loss_diff']:+.2e}."]
  md += ["", "Program cache: " + "; ".join(f"{r['path']} {r['program']}" for r in results)
         if results and all("program" in r for r in results) else "Program cache: off"]
  md += ["", f"Kernel cache ({kernel_cache.cache_dir() or 'in memory only'}), at the first "
         "compile: " + "; ".join(
      f"{r['path']} {r['kernels']['lowered']} kernels lowered, {r['kernels']['memory']} "
      f"reused in the process, {r['kernels']['disk']} read from the folder"
      for r in results if "kernels" in r)]
  md += ["", f"Step time: wall clock of one step until its loss is ready (the batch is "
         f"already on the device), median over steps {WARMUP + 1}-{args.steps}; tokens/s = "
         f"batch x seq / that. Compile: lowering + compiling the train step (all "
         f"attempts), with JAX's persistent compilation cache at {args.compile_cache} and "
         f"the program cache at {args.program_cache} (cold when they did not hold the step "
         f"yet); warm: the step made again after clearing the in-memory caches, as a later "
         f"run makes it: traced, its lowered program loaded from the program cache and its "
         f"executable from the persistent cache. Micro-batches: gradient-accumulation pieces per step, by default the "
         f"fewest (a power of 2) whose compiled step fits the device. Final loss: "
         f"mean of the last 10 steps' training loss (nats/byte); val loss: mean over "
         f"{args.eval_batches} held-out batches. Compiled peak: argument + output + temp - "
         f"alias bytes of the compiled step; device peak: the allocator's high-water mark in "
         f"the path's process" + (" (one process for every path: a running maximum, so "
                                  "only the first path's is its own)." if not args.spawn
                                  else ", each path in a process of its own.")]
  if not epilogue_gemm.kernels_available():
    md += ["", "No Hopper GPU: both paths are XLA programs on this machine, timed in wall "
           "clock next to whatever else ran on it; their speed ratio says nothing about the "
           "kernels. What this run shows is the loss agreement."]
  return "\n".join(md) + "\n"


def plot(results, png, title):
  try:
    import matplotlib
  except ImportError as e:
    print(f"no PNG: matplotlib missing ({e})")
    return None
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, (ax_loss, ax_time) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
  for r in results:
    steps = np.arange(1, len(r["losses"]) + 1)
    ax_loss.plot(steps, r["losses"], lw=1, label=r["runs_on"])
    ax_time.plot(steps[WARMUP:], 1e3 * np.array(r["step_s"][WARMUP:]), lw=1, label=r["path"])
  ax_loss.set_ylabel("training loss (nats/byte)")
  ax_time.set_ylabel("step time (ms, wall clock)")
  ax_time.set_xlabel("step")
  ax_loss.set_title(title, fontsize=9)
  for ax in (ax_loss, ax_time):
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(png, dpi=120)
  plt.close(fig)
  return png


def child_command(args, path: str, result: Path) -> list[str]:
  """This run's command line for one path, in a process of its own."""
  argv, skip = [], False
  for a in args.argv:
    if skip:
      skip = False
    elif a == "--paths":
      skip = True
    elif not (a.startswith("--paths=") or a == "--one-process"):
      argv.append(a)
  return [sys.executable, "-m", "bench.train", *argv, "--paths", path,
          "--child-result", str(result)]


def run_path_in_child(path: str, args) -> dict:
  """``run_path`` in a fresh process: its device memory is all given back when it ends."""
  env = dict(os.environ)
  env.pop("XLA_PYTHON_CLIENT_PREALLOCATE", None)
  if _PREALLOCATE is not None:
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = _PREALLOCATE
  with tempfile.TemporaryDirectory() as tmp:
    result = Path(tmp) / "result.json"
    code = subprocess.run(child_command(args, path, result), env=env).returncode
    if code == 0 and result.exists():
      return json.loads(result.read_text())
  why = f"its process ended with exit code {code} (its error is in the log above)"
  print(f"{path}: failed: {why}", flush=True)
  return {"path": path, "skipped": why}


def main():
  # One prefix per line: the library's messages carry none of their own.
  logging.basicConfig(format="%(levelname)s %(name)s: %(message)s", force=True)
  args = parse_args()
  if args.kernel_cache is not None:
    kernel_cache.set_cache_dir(None if args.kernel_cache == "none" else args.kernel_cache)
  if args.compile_cache != "none":  # JAX's persistent compilation cache, every program
    jax.config.update("jax_compilation_cache_dir", args.compile_cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  if args.init_from is not None:
    hf = json.loads((args.init_from / "config.json").read_text())
    kind = GPT2Config if hf.get("model_type") == "gpt2" else LlamaConfig
    cfg = kind.from_hf_config(hf, **({"n_layers": args.layers} if args.layers else {}))
  else:
    get = get_gpt2_config if args.config in GPT2_CONFIGS else get_config
    cfg = get(args.config, **({"n_layers": args.layers} if args.layers else {}))
  if args.head_grad is not None:
    if isinstance(cfg, GPT2Config):
      sys.exit("--head-grad: GPT-2's head is fused_ops.rmsnorm_lm_head_loss with the "
               "default head_grad; the flag is Llama-only")
    cfg = cfg.replace(head_grad=args.head_grad)
  if args.mlp_residuals is not None:
    if isinstance(cfg, GPT2Config):
      sys.exit("--mlp-residuals: GPT-2's MLP keeps GPT2Config.mlp_residuals; the flag is "
               "for the gated (Llama, Qwen3) MLP")
    cfg = cfg.replace(mlp_residuals=args.mlp_residuals)
  if args.attention is not None:
    cfg = cfg.replace(attention_impl=args.attention)
  if isinstance(cfg, GPT2Config) and args.mesh and "model" in args.mesh:
    sys.exit("--mesh with a 'model' axis: tensor parallelism is Llama-only")
  if isinstance(cfg, GPT2Config) and args.seq > cfg.n_positions:
    sys.exit(f"--seq {args.seq} exceeds {args.config}'s n_positions={cfg.n_positions}: "
             f"pass --seq {cfg.n_positions} or less")
  name = (f"train_{args.config}" + (f"_{cfg.n_layers}l" if args.layers else "")
          + (f"_{args.mesh.replace('=', '').replace(',', '_')}" if args.mesh else "")
          + ("_fsdp" if args.fsdp else "")
          + ("_jit" if args.mesh and args.partitioner == "jit" else "")
          + ("_head_per_gemm" if args.mesh and args.head_per_device == "off" else "")
          + (f"_{args.head_grad}_head" if args.head_grad not in (None, "auto") else "")
          + (f"_mlp_{args.mlp_residuals}" if args.mlp_residuals not in (None, "recompute")
             else ""))
  try:
    data = corpus.load(args.batch, args.seq)
  except ValueError as e:
    sys.exit(f"bench.train: {e}")
  child = args.child_result is not None
  if not args.spawn:  # the same batches for every path, and in every path's process
    train_gen = corpus.batches(data.train, args.batch, args.seq, args.seed)
    val_gen = corpus.batches(data.val, args.batch, args.seq, args.seed)
    train_batches = [next(train_gen) for _ in range(args.steps)]
    val_batches = [next(val_gen) for _ in range(args.eval_batches)]
  if not child:  # the parent said it already
    print(f"{args.config}: {cfg.n_layers} layers, d_model {cfg.d_model}, {cfg.n_q_heads}/"
          f"{cfg.n_kv_heads} heads of {cfg.head_dim}, ffn {cfg.ffn_dim}, vocab "
          f"{cfg.vocab_size}: {cfg.param_count() / 1e6:,.1f}M parameters\n"
          f"batch {args.batch} x seq {args.seq}, {args.steps} steps, paths "
          f"{','.join(args.paths)}" + (" (each in a process of its own)" if args.spawn else "")
          + f", device {jax.devices()[0].device_kind}\n{data.describe()}", flush=True)
  args.mesh_obj = common.parse_mesh(args.mesh)
  n_devices = 1 if args.mesh_obj is None else args.mesh_obj.size
  tp = 1 if args.mesh_obj is None else args.mesh_obj.shape.get("model", 1)
  if args.partitioner is None:
    args.partitioner = "jit"
  if args.mesh_obj is not None:
    n_data = args.mesh_obj.shape["data"]
    if args.batch % n_data:
      sys.exit(f"--batch {args.batch} is not divisible by the {n_data} devices of mesh "
               f"axis 'data' (--mesh {args.mesh})")
    if tp > 1 and args.partitioner != "jit":
      sys.exit("--mesh with a 'model' axis needs --partitioner jit")
    if args.partitioner == "shard_map":
      try:
        train.check_shard_map_attention(cfg)
      except ValueError as e:
        sys.exit(f"bench.train: {e} (here: --partitioner jit or --attention xla)")
    if tp > 1 and args.fsdp:
      sys.exit("--fsdp with a 'model' axis is not supported")
    if tp > 1:
      state_layout = ("split Megatron-style over 'model' (wqkv, w13, wlm by columns; wo, w2 "
                      "by rows), the rest replicated")
    elif args.fsdp:
      state_layout = ("split over the devices (FSDP), parameters gathered "
                      + ("once per step" if args.partitioner == "shard_map"
                         else "per layer, as the layer scan reaches them"
                         + ("; the head once (--head-per-device on)"
                            if args.head_per_device == "on" else "")))
    else:
      state_layout = "replicated"
    if not child:
      print(f"mesh {dict(args.mesh_obj.shape)} ({args.partitioner}): tokens and targets "
            f"split along the batch over 'data' ({args.batch // n_data} rows of {args.seq} "
            f"per data shard), parameters and optimizer state {state_layout}; devices "
            f"{[d.id for d in args.mesh_obj.devices.flat]}", flush=True)
  elif args.fsdp:
    sys.exit("--fsdp needs --mesh data=N")
  if args.spawn:
    results = [run_path_in_child(p, args) for p in args.paths]
  else:
    results = [run_path(p, cfg, args, train_batches, val_batches) for p in args.paths]
  if child:
    args.child_result.write_text(json.dumps(results[0]))
    return
  summary = summarize(results, args.batch * args.seq)
  trained = [r for r in results if "skipped" not in r]
  for r in trained:
    r["n_devices"] = n_devices
    r["mesh"] = (args.mesh or "none") + (" fsdp" if args.fsdp else "")
    r["partitioner"] = args.partitioner if args.mesh else "none"
    r["head_per_device"] = bool(args.mesh) and args.head_per_device == "on"
    r["tokens_per_s_per_device"] = r["tokens_per_s"] / n_devices
  if args.mesh_obj is not None:
    print("tokens/s per device: " + ", ".join(
        f"{r['path']} {r['tokens_per_s_per_device']:,.0f}" for r in trained), flush=True)

  prov = common.provenance()
  jsonable = lambda v: (v if isinstance(v, (int, float, str, bool, list, type(None)))
                        else getattr(v, "__name__", str(v)))  # dtypes by name, paths as str
  run = dict(args={k: jsonable(v) for k, v in vars(args).items() if k != "mesh_obj"},
             corpus=data.describe(),
             model={k: jsonable(v) for k, v in dataclasses.asdict(cfg).items()})
  rows = [dict(op=f"train_step_{r['path']}", shape=f"{args.batch}x{args.seq}", **r, **prov)
          for r in results]  # a skipped path's row says why
  if summary:
    by = {r["path"]: r for r in results}
    rows.append(dict(op="train_step", shape=f"{args.batch}x{args.seq}", n_devices=n_devices,
                     mesh=args.mesh or "none",
                     ours_ms=by["fused"]["median_step_ms"], baseline="reference (plain XLA)",
                     baseline_ms=by["reference"]["median_step_ms"], **summary, **prov))
  rows[-1].update(run)
  md = markdown(results, summary, args, cfg, data, prov)
  out = common.write_results(name, rows, md, args.out)
  png = plot(trained, out / f"{name}.png", f"{args.config} on {prov['device']}, "
             f"commit {prov['commit']}")
  print(f"wrote {out / name}.json, .md" + (", .png" if png else "") + "\n")
  print(md)


if __name__ == "__main__":
  main()
