"""A jitted optax training step for ``Llama``, ``GPT2`` (or any module with ``loss(tokens, targets)``).

    tx = make_optimizer(3e-4, total_steps=1000)
    graphdef, state = init_state(model, tx)
    step = make_train_step(graphdef)
    state, loss = step(state, tokens, targets)       # donates and returns the state

The model and its ``nnx.Optimizer`` travel as one ``nnx.State`` through ``jax.jit``, so a
step is a single XLA program with no Python graph traversal per call.
"""
from __future__ import annotations

import inspect
import os

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import coda_jax.epilogue_gemm
from coda_jax.program_cache import cached_jit
from coda_jax.sharding import RowSplit
from flax_layers import layers as Lyr


def _decay_mask(params):
  """Weight decay on matrices only: not on norm weights or biases (whose paths say "norm"
  or "bias": Llama's norms, GPT-2's LayerNorm weights and biases and its GEMM biases)."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: not any(w in str(getattr(k, "key", k)) for k in path
                              for w in ("norm", "bias")), params)


def make_optimizer(learning_rate: float = 3e-4, *, total_steps: int,
                   warmup_steps: int | None = None, weight_decay: float = 0.1,
                   b1: float = 0.9, b2: float = 0.95, clip_norm: float = 1.0,
                   final_fraction: float = 0.1) -> optax.GradientTransformation:
  """AdamW with global-norm clipping, linear warm-up and cosine decay to
  ``final_fraction`` of the peak rate."""
  if total_steps <= 0:
    raise ValueError(f"total_steps={total_steps} must be positive")
  warmup = min(total_steps, max(1, total_steps // 20) if warmup_steps is None
               else warmup_steps)
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, learning_rate, warmup, max(total_steps, warmup + 1),
      end_value=learning_rate * final_fraction)
  return optax.chain(optax.clip_by_global_norm(clip_norm),
                     optax.adamw(schedule, b1=b1, b2=b2, weight_decay=weight_decay,
                                 mask=_decay_mask))


def init_state(model: nnx.Module, tx: optax.GradientTransformation):
  """(graphdef, state) of the pair (model, ``nnx.Optimizer`` over its ``nnx.Param``s)."""
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  return nnx.split((model, optimizer))


IGNORE_INDEX = -100  # Llama.loss skips these targets


def data_parallel_loss(gdef, rest, mesh, data_axis: str):
  """loss(params, tokens, targets) -> the mean loss over the whole batch, each device
  running the model on its rows (``jax.shard_map``; parameters replicated, or gathered
  once per step where stored split). The sum of the losses and the count of counted
  targets are summed across devices (``layers.loss_over_rows``); gradients of the
  replicated parameters come back summed by shard_map and the fused ops' backward
  (coda_jax/sharding.py)."""
  split = RowSplit(mesh, data_axis)

  def loss_of(tokens, targets, params, reduction):
    return nnx.merge(gdef, params, rest).loss(tokens, targets, reduction=reduction)

  def loss(params, tokens, targets):
    return Lyr.loss_over_rows(loss_of, "mean", (tokens, targets), (params,), targets,
                              IGNORE_INDEX, split)
  return loss


def fsdp_shardings(tree, mesh, data_axis: str = "data"):
  """Shardings that split each array of a train state over the devices, FSDP-style.

  Each array is split along its largest dimension that the ``data_axis`` size divides
  (the later one on a tie), and replicated when none does (scalars, small vectors).
  A stack of layers, (n_layers, K, N), is therefore split inside each layer, not along
  the layer axis: the layer scan slices one layer on every device and gathers that
  layer's weights as it reaches them, so no device ever holds the whole model. (Split
  along the layer axis, each layer lives on one device and XLA gathers the whole fp32
  stack before the scan: docs/tuning.md#sharding-and-fsdp.)

  Args:
    tree: the state (parameters and optimizer moments alike), or any pytree of arrays.
    mesh: the device mesh; its only axis of size > 1 must be ``data_axis``.
    data_axis: the axis to split over.

  Returns:
    ``tree``'s structure of ``NamedSharding``s. ``jax.device_put(state, ...)`` them to
    train with ``make_train_step(mesh=...)``: each device stores 1/N of the state.
  """
  from jax.sharding import NamedSharding, PartitionSpec as P
  check_mesh(mesh, data_axis)
  n = mesh.shape[data_axis]

  def one(x):
    shape = getattr(x, "shape", ())
    split = [d for d, size in enumerate(shape) if size >= n and size % n == 0]
    if not split:
      return NamedSharding(mesh, P())
    dim = max(split, key=lambda d: (shape[d], d))
    return NamedSharding(mesh, P(*([None] * dim), data_axis))
  return jax.tree.map(one, tree)


COLUMN_PARALLEL = ("wqkv", "w13", "wlm")  # split along their output columns
ROW_PARALLEL = ("wo", "w2")  # split along their input rows


def tensor_parallel_shardings(tree, mesh, model_axis: str = "model"):
  """Megatron-style shardings for a ``Llama`` train state.

  Args:
    tree: the state (parameters and optimizer moments alike, matched by name), or any
      pytree of its arrays.
    mesh: the device mesh; it must have ``model_axis``.
    model_axis: the axis to split over.

  Returns:
    ``tree``'s structure of ``NamedSharding``s: ``wqkv``, ``w13`` and ``wlm`` split along
    their columns (column parallel; ``wlm``: a vocabulary-parallel LM head), ``wo`` and
    ``w2`` along their rows (row parallel), everything else replicated. Use with
    ``make_train_step(partitioner="jit")``; check the model first with
    ``check_tensor_parallel``.
  """
  from jax.sharding import NamedSharding, PartitionSpec as P
  if model_axis not in mesh.axis_names:
    raise ValueError(f"model_axis={model_axis!r} is not an axis of the mesh "
                     f"{dict(mesh.shape)}: name one of {list(mesh.axis_names)}")

  def one(path, x):
    names = {str(getattr(k, "key", getattr(k, "name", k))) for k in path}
    ndim = len(getattr(x, "shape", ()))
    if ndim >= 2 and names & set(COLUMN_PARALLEL):
      return NamedSharding(mesh, P(*([None] * (ndim - 1)), model_axis))
    if ndim >= 2 and names & set(ROW_PARALLEL):
      return NamedSharding(mesh, P(*([None] * (ndim - 2)), model_axis, None))
    return NamedSharding(mesh, P())
  return jax.tree_util.tree_map_with_path(one, tree)


def check_tensor_parallel(config, mesh, model_axis: str = "model"):
  """Raises ValueError naming the axis and the sizes unless ``mesh``'s ``model_axis``
  divides the query and key/value heads, the vocabulary and the MLP's pair blocks."""
  n = mesh.shape.get(model_axis, 1)
  for what, size in (("n_q_heads", config.n_q_heads), ("n_kv_heads", config.n_kv_heads),
                     ("vocab_size", config.vocab_size),
                     ("ffn_dim / swiglu_block", config.ffn_dim // config.swiglu_block)):
    if size % n:
      raise ValueError(f"mesh axis {model_axis!r} of size {n} does not divide {what}={size}")
  if config.tie_embeddings and n > 1:
    raise ValueError(f"mesh axis {model_axis!r} of size {n}: tensor parallelism with tied "
                     "embeddings is not supported (the head reads the replicated embedding)")


def check_mesh(mesh, data_axis: str, batch: int | None = None, *,
               other_axes: bool = False):
  """Raises ValueError unless ``mesh`` has ``data_axis`` (dividing ``batch``) and, unless
  ``other_axes``, no other axis of size > 1."""
  if data_axis not in mesh.axis_names:
    raise ValueError(f"data_axis={data_axis!r} is not an axis of the mesh "
                     f"{dict(mesh.shape)}: name one of {list(mesh.axis_names)}")
  extra = {a: n for a, n in mesh.shape.items() if a != data_axis and n > 1}
  if extra and not other_axes:
    raise ValueError(f"mesh axes {extra} besides {data_axis!r}: the shard_map train step "
                     "is data parallel only; use partitioner='jit' with "
                     "tensor_parallel_shardings for a model axis")
  if batch is not None and batch % mesh.shape[data_axis]:
    raise ValueError(f"batch {batch} is not divisible by the {mesh.shape[data_axis]} "
                     f"devices of mesh axis {data_axis!r}")


PARTITIONERS = ("shard_map", "jit")


def check_shard_map_attention(config, platform: str | None = None):
  """Refuses a ``partitioner="shard_map"`` train step that jax 0.11.2's GPU compiler
  cannot build: the gradient of a ``jax.shard_map`` over a ``jax.lax.scan`` of cuDNN
  attention segfaults in its ``shardy-xla`` pass: the process dies, and it takes none of
  this library's code (``docs/known_issues.md`` has a jax-only repro). The models scan
  their layers, so this refuses any model of two or more layers whose attention is cuDNN
  (the default for 16-bit activations on a GPU); measured crashing: the 4-layer tiny
  Llama, fused and reference, and jax's scan over 2 layers. One layer, XLA's attention and
  the "jit" partitioner compile.

  Args:
    config: the model's config (``LlamaConfig`` or ``GPT2Config``: ``attention_impl``,
      ``dtype``, ``n_layers``).
    platform: the devices' platform; default that of ``jax.devices()``.

  Raises:
    ValueError: naming the two ways around it.
  """
  platform = platform or jax.devices()[0].platform
  attention = Lyr.attention_impl(config.dtype, config.attention_impl, platform=platform)
  if attention == "cudnn" and config.n_layers >= 2:
    raise ValueError(
        f"partitioner='shard_map' with cuDNN attention ({config.n_layers} layers, "
        f"attention_impl={config.attention_impl!r} resolves to 'cudnn' on {platform}): "
        "jax 0.11.2's GPU compiler segfaults on the gradient of a shard_map over a scan of "
        "cuDNN attention (docs/known_issues.md). Use partitioner='jit' (the default; each "
        "fused GEMM is split over the mesh), or attention_impl='xla' in the model's config "
        "(XLA's attention, slower)")


def make_train_step(graphdef, *, micro_batches: int = 1, donate: bool = True, mesh=None,
                    data_axis: str = "data", partitioner: str = "jit",
                    program_cache: str | os.PathLike | None = None,
                    loss_row_split: bool = True):
  """jit(step)(state, tokens, targets) -> (state, loss): one optimizer step on the mean
  loss. ``micro_batches`` > 1 splits the batch and accumulates gradients (fp32, in the
  parameters' dtype) over the pieces in a ``jax.lax.scan``, so activations of only one
  piece are live; the step's gradient is the mean of the pieces' (the full batch's when
  each piece has as many counted targets). ``donate`` updates the state in place.

  ``mesh``: the step runs sharded; the loss is the mean over the whole batch. Pass tokens
  and targets sharded along the batch (``NamedSharding(mesh, P(data_axis))``) and the
  state replicated (data parallel), split by ``fsdp_shardings`` (FSDP) or by
  ``tensor_parallel_shardings`` (Megatron, over a model axis).

  ``partitioner``: "jit" (default): the step is jitted as written and the arrays' own
  shardings decide the split (``coda_jax.partitioning`` splits each fused GEMM: rows
  over ``data_axis``, tensor-parallel weights over the model axis, FSDP-split weights
  gathered per GEMM, i.e. per layer). "shard_map": data parallel only; each device runs
  the whole model on its rows inside ``jax.shard_map`` and FSDP parameters are gathered
  once per step. On a GPU, jax 0.11.2's compiler segfaults on this path with cuDNN
  attention (``check_shard_map_attention`` refuses it with a ValueError; the kernels are
  not the cause): use "jit", or the config's ``attention_impl="xla"``.

  With ``partitioner="jit"`` and a mesh whose only axis of size > 1 is ``data_axis``
  (data parallelism, FSDP), the model's ``loss`` gets ``row_split=RowSplit(mesh,
  data_axis)`` when it takes one (``Llama``, ``GPT2``). Both paths then gather each
  layer's weights whole as the layer scan reaches them (``layers.whole_weights``): an
  FSDP-split layer is gathered per layer, and the activations stay split by rows.

  ``loss_row_split``: True (default): the fused last block and LM head also run per
  device in one ``jax.shard_map``, so the head's weight gradient is summed across
  devices once per step and an FSDP-split head gathered once, not once per row chunk.
  On 2 H200s it took the 1B step from 316 to 302 ms data parallel and GPT-2 small to
  1.07x its reference (docs/tuning.md#sharding-and-fsdp).
  False: those GEMMs go through jit's per-GEMM rule too.

  ``program_cache``: a folder where the lowered step is kept across processes
  (``coda_jax.program_cache``): a later process with the same model, shapes and library
  skips lowering the kernels (most of the fused step's compile time). None: plain jit."""
  if micro_batches < 1:
    raise ValueError(f"micro_batches={micro_batches} must be >= 1")
  if partitioner not in PARTITIONERS:
    raise ValueError(f"partitioner={partitioner!r}: one of {PARTITIONERS}")
  shard_map_mesh = mesh if partitioner == "shard_map" else None
  if mesh is not None:
    check_mesh(mesh, data_axis, other_axes=partitioner == "jit")
    if micro_batches != 1:
      raise ValueError("micro_batches > 1 with a mesh is not supported yet: use more "
                       "devices or a smaller batch")

  row_split = None
  if (mesh is not None and partitioner == "jit"
      and all(n == 1 for a, n in mesh.shape.items() if a != data_axis)):
    row_split = RowSplit(mesh, data_axis, loss_per_device=loss_row_split)

  def loss_of(model, tokens, targets):
    if row_split is not None and "row_split" in inspect.signature(model.loss).parameters:
      return model.loss(tokens, targets, row_split=row_split)
    return model.loss(tokens, targets)

  def grads_of(model, tokens, targets):
    if mesh is not None:
      check_mesh(mesh, data_axis, tokens.shape[0], other_axes=partitioner == "jit")
    if shard_map_mesh is not None:
      check_shard_map_attention(model.config)
      gdef, params, rest = nnx.split(model, nnx.Param, ...)
      return jax.value_and_grad(data_parallel_loss(gdef, rest, shard_map_mesh, data_axis))(
          params, tokens, targets)
    if micro_batches == 1:
      return nnx.value_and_grad(lambda m: loss_of(m, tokens, targets))(model)
    if tokens.shape[0] % micro_batches:
      raise ValueError(f"batch {tokens.shape[0]} is not divisible by micro_batches="
                       f"{micro_batches}")
    gdef, params, rest = nnx.split(model, nnx.Param, ...)
    grad_fn = jax.value_and_grad(lambda p, t, y: nnx.merge(gdef, p, rest).loss(t, y))
    split = lambda x: x.reshape(micro_batches, -1, *x.shape[1:])

    def piece(acc, batch):
      loss, g = grad_fn(params, *batch)
      return jax.tree.map(lambda a, b: a + b.astype(a.dtype), acc, (loss, g)), None

    zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
    (loss, grads), _ = jax.lax.scan(piece, zeros, (split(tokens), split(targets)))
    return jax.tree.map(lambda x: x / micro_batches, (loss, grads))

  def train_step(state, tokens, targets):
    model, optimizer = nnx.merge(graphdef, state)
    loss, grads = grads_of(model, tokens, targets)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer)), loss

  return cached_jit(train_step, program_cache, donate_argnums=(0,) if donate else ())


def make_eval_step(graphdef, *, mesh=None, data_axis: str = "data",
                   partitioner: str = "jit", program_cache: str | os.PathLike | None = None):
  """jit(fn)(state, tokens, targets) -> loss, no gradients; sharded with ``mesh`` and
  ``partitioner``, and kept in ``program_cache``, as ``make_train_step``."""
  if partitioner not in PARTITIONERS:
    raise ValueError(f"partitioner={partitioner!r}: one of {PARTITIONERS}")
  if mesh is not None:
    check_mesh(mesh, data_axis, other_axes=partitioner == "jit")

  def eval_step(state, tokens, targets):
    model, _ = nnx.merge(graphdef, state)
    if mesh is None or partitioner == "jit":
      return model.loss(tokens, targets)
    gdef, params, rest = nnx.split(model, nnx.Param, ...)
    return data_parallel_loss(gdef, rest, mesh, data_axis)(params, tokens, targets)

  return cached_jit(eval_step, program_cache)


def describe_path(model) -> str:
  """Which implementation the model's layers run, in words."""
  if not getattr(model, "fused", True):
    return "reference: plain jnp under XLA (jax autodiff)"
  impl = getattr(getattr(model, "config", None), "impl", "auto")
  if impl == "auto":
    impl = os.environ.get("CODA_JAX_IMPL", "auto")
  if impl == "auto":
    return ("fused: Mosaic GPU GEMM-epilogue kernels (sm90)" if coda_jax.epilogue_gemm.kernels_available()
            else "fused: the fused programs' XLA fallback (no Hopper GPU: no kernels run)")
  return {"mosaic": "fused: Mosaic GPU GEMM-epilogue kernels (forced)",
          "interpret": "fused: Mosaic GPU kernels through the CPU interpreter (slow)",
          "xla": "fused: the fused programs' XLA fallback (forced)"}[impl]
