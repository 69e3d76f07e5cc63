"""Run by test_sharding.py in a fresh process with 4 fake CPU devices (the device count
is fixed when jax starts): every fused op (the LayerNorm ops too) and the
shifted block under ``jax.shard_map``
with rows split over "data" and weights replicated, against the same call on one
device. Prints one line per case: name, max relative gradient difference, and the
compiled program's collective counts; for the blocks, also the one-device and the
sharded gradients' errors against the same math in float32 (``TRUTH``).

    python tests/sharded_check.py IMPL [shard_map] [jit] [auto] [train] [errors] [row_terms]
                                  [only=a,b]

``only=`` keeps the cases whose name contains one of the comma-separated words. With no
mode named, the ops run under shard_map; ``train`` or ``row_terms`` alone runs only the
train step or LayerNorm's one-GEMM input gradient (``layernorm_ops.row_terms_sharded``)."""
import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + \
    " --xla_force_host_platform_device_count=4"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from coda_jax import blocks, fused_ops as F, layernorm_ops as L, layout, qk_norm  # noqa: E402
from coda_jax import jnp_reference as ref  # noqa: E402
from coda_jax.unfused import layernorm_stats  # noqa: E402
from helpers import f32_tree  # noqa: E402  (tests/, this script's folder)

IMPL = sys.argv[1] if len(sys.argv) > 1 else "xla"
# On a GPU (2 devices: the tensor-parallel mesh is then data=1 x model=2) the sizes tile
# the kernels: every local GEMM runs through Mosaic GPU.
ON_GPU = jax.devices()[0].platform == "gpu"
M, D, F_, HQ, HKV, HD, V = ((2048, 256, 512, 4, 2, 64, 1024) if ON_GPU else
                            (256, 128, 192, 4, 2, 32, 320))
TP_DATA = 2 if len(jax.devices()) >= 4 else 1
QKV = (HQ + 2 * HKV) * HD
bf = jnp.bfloat16
ks = iter(jax.random.split(jax.random.key(0), 32))
normal = lambda shape, s=1.0: (s * jax.random.normal(next(ks), shape, jnp.float32)).astype(bf)
weight = lambda k, n: normal((k, n), k ** -0.5)
gain = lambda n: 1 + 0.1 * jax.random.normal(next(ks), (n,), jnp.float32)

x0 = normal((M, D)) * 5
y = normal((M, HQ * HD))
h = normal((M, D))
r = jax.random.uniform(next(ks), (M,), jnp.float32, 0.5, 2.0)
pos = jnp.arange(M, dtype=jnp.int32) % 64
tgt = jax.random.randint(next(ks), (M,), 0, V, jnp.int32)
wo, w13 = weight(HQ * HD, D), layout.gate_up_to_blocked(weight(D, 2 * F_), 32)
w2, wqkv, wlm = weight(F_, D), weight(D, QKV), weight(D, V)
g1, g2 = gain(D), gain(D)
cfg = blocks.BlockConfig(HQ, HKV, HD, impl=IMPL)
params = {"wo": wo, "g_mlp": g1, "w13": w13, "w2": w2, "g_attn": g2, "wqkv": wqkv}
ct_x, ct_q = normal((M, D)), normal((M, QKV))
post_cfg = blocks.BlockConfig(HQ, HKV, HD, impl=IMPL, reduction="sum")
post_params = dict(params, g_final=gain(D), wlm=wlm)
del post_params["g_attn"], post_params["wqkv"]


def dot(out, ct):
  return jnp.sum(out.astype(jnp.float32) * ct.astype(jnp.float32))


# GPT-2's LayerNorm ops: the stream x0 with its (h, mu, r) as
# residual_layernorm hands them on, weights of the MLP (F_ wide) and a QKV projection.
# Their own keys, so the cases above keep their draws.
ks_ln = iter(jax.random.split(jax.random.key(1), 16))
ln_vec = lambda n, s: s * jax.random.normal(next(ks_ln), (n,), jnp.float32)
ln_g, ln_beta, ln_g_next = 1 + ln_vec(D, 0.1), ln_vec(D, 0.3), 1 + ln_vec(D, 0.1)
ln_x = x0.astype(jnp.float32)
ln_mu, ln_r = layernorm_stats(ln_x, 1e-5)
ln_h = (ln_x * ln_g).astype(bf)
ln_w1 = (jax.random.normal(next(ks_ln), (D, F_)) * D ** -0.5).astype(bf)
ln_w2 = (jax.random.normal(next(ks_ln), (F_, D)) * F_ ** -0.5).astype(bf)
ln_b1, ln_b2, ln_bq = ln_vec(F_, 0.5), ln_vec(D, 0.5), ln_vec(QKV, 0.5)
ln_cts = [jax.random.normal(next(ks_ln), (M,), jnp.float32) for _ in range(2)]


# name -> (loss(*args), args, in_specs, indices of args to differentiate). Output
# cotangents are row-sharded arguments too.
R, W = P("data"), P()
CASES = {
    "residual_rmsnorm": (
        lambda y, w, x, g, c1, c2: sum(dot(o, c) for o, c in zip(
            F.residual_rmsnorm(y, w, x, g, impl=IMPL)[:2], (c1, c2))),
        (y, wo, x0, g1, ct_x, normal((M, D))), (R, W, R, W, R, R), (0, 1, 2, 3)),
    "rmsnorm_swiglu": (
        lambda h, r, w, c: dot(F.rmsnorm_swiglu(h, r, w, impl=IMPL), c),
        (h, r, w13, normal((M, F_))), (R, R, W, R), (0, 1, 2)),
    "rmsnorm_qkv_rope": (
        lambda h, r, w, p, c: dot(F.rmsnorm_qkv_rope(h, r, w, p, n_q_heads=HQ, n_kv_heads=HKV,
                                                     head_dim=HD, impl=IMPL), c),
        (h, r, wqkv, pos, ct_q), (R, R, W, R, R), (0, 1, 2)),
    # its backward is an epilogue pass (K = 0), whose placeholders must not cross the split
    "rmsnorm_qkv_qknorm_rope": (
        lambda h, r, w, p, qw, kw, c: dot(qk_norm.rmsnorm_qkv_qknorm_rope(
            h, r, w, p, qw, kw, n_q_heads=HQ, n_kv_heads=HKV, head_dim=HD, eps=1e-6,
            theta=1e6, impl=IMPL), c),
        (h, r, wqkv, pos, gain(HD), gain(HD), ct_q), (R, R, W, R, W, W, R), (0, 1, 2, 4, 5)),
    "rmsnorm_lm_head_loss": (
        lambda h, r, w, t: F.rmsnorm_lm_head_loss(h, r, w, t, reduction="sum", impl=IMPL),
        (h, r, wlm, tgt), (R, R, W, R), (0, 1, 2)),
    "lm_head_loss_chunked": (
        lambda h, r, w, t: F.rmsnorm_lm_head_loss(h, r, w, t, reduction="sum", chunk_rows=M // 4,
                                                  impl=IMPL),
        (h, r, wlm, tgt), (R, R, W, R), (0, 1, 2)),
    "lm_head_loss_exp": (
        lambda h, r, w, t: F.rmsnorm_lm_head_loss(h, r, w, t, reduction="sum",
                                                  chunk_rows=M // 4, head_grad="exp",
                                                  impl=IMPL),
        (h, r, wlm, tgt), (R, R, W, R), (0, 1, 2)),
    "shifted_block": (
        lambda x, y, p, prm, c1, c2: sum(dot(o, c) for o, c in zip(
            blocks.shifted_block(x, y, p, prm, cfg), (c1, c2))),
        (x0, y, pos, params, ct_x, ct_q), (R, R, R, W, R, R), (0, 1, 3)),
    "post_block": (
        lambda x, y, t, prm: blocks.post_block(x, y, t, prm, post_cfg),
        (x0, y, tgt, post_params), (R, R, R, W), (0, 1, 3)),
    # the producer: x, h and the row statistics, whose backward is an epilogue pass
    "residual_layernorm": (
        lambda y, w, x, g, b, c1, c2, c3, c4: sum(
            dot(o, c) for o, c in zip(L.residual_layernorm(y, w, x, g, bias=b, impl=IMPL),
                                      (c1, c2, c3, c4))),
        (y, wo, x0, ln_g, ln_b2, ct_x, normal((M, D)), *ln_cts),
        (R, W, R, W, W, R, R, R, R), (0, 1, 2, 3, 4)),
    "layernorm_matmul": (
        lambda h, mu, r, g, beta, w, b, c: dot(
            L.layernorm_matmul(h, mu, r, g, beta, w, bias=b, impl=IMPL), c),
        (ln_h, ln_mu, ln_r, ln_g, ln_beta, wqkv, ln_bq, ct_q),
        (R, R, R, W, W, W, W, R), (0, 1, 2, 3, 4, 5, 6)),
    # GPT-2's MLP with the next norm's statistics: its saved slope is a one-byte code
    "layernorm_gelu_mlp": (
        lambda x, h, mu, r, g, beta, w1, b1, w2, b2, gn, c1, c2, c3, c4: sum(
            dot(o, c) for o, c in zip(
                L.layernorm_gelu_mlp(x, h, mu, r, g, beta, w1, b1, w2, b2, impl=IMPL,
                                     next_norm=gn), (c1, c2, c3, c4))),
        (x0, ln_h, ln_mu, ln_r, ln_g, ln_beta, ln_w1, ln_b1, ln_w2, ln_b2, ln_g_next, ct_x,
         normal((M, D)), *ln_cts),
        (R, R, R, R, W, W, W, W, W, W, W, R, R, R, R), tuple(range(11))),
}

# The blocks' math in float32 at HIGHEST precision (coda_jax.jnp_reference): the truth the
# one-device and the sharded gradients are both measured against, so that a sharded run
# that differs from one device shows whether it is the less accurate one.
_ref_kw = dict(n_q_heads=HQ, n_kv_heads=HKV, head_dim=HD, theta=cfg.rope_theta, eps=cfg.eps,
               block=cfg.swiglu_block, activation=cfg.activation)
TRUTH = {
    "shifted_block": lambda x, y, p, prm, c1, c2: sum(dot(o, c) for o, c in zip(
        ref.shifted_block(x, y, p, prm, **_ref_kw), (c1, c2))),
    "post_block": lambda x, y, t, prm: ref.post_block(
        x, y, t, prm, eps=cfg.eps, block=cfg.swiglu_block, activation=cfg.activation,
        reduction="sum"),
}
TRUTH["tp_shifted_block"], TRUTH["tp_post_block"] = TRUTH["shifted_block"], TRUTH["post_block"]


_truths = {}  # name -> its float32 gradients, shared by the modes


def errors_vs_truth(name, args, argnums, *grads):
  """" err_one=.. err_sharded=..": the largest relative error over the leaves of each of
  ``grads`` against TRUTH[name]'s float32 gradients; "" for a case without a truth."""
  if name not in TRUTH:
    return ""
  if name not in _truths:
    with jax.default_matmul_precision("highest"):
      _truths[name] = jax.jit(jax.grad(TRUTH[name], argnums=argnums))(*f32_tree(args))
  truth = _truths[name]
  err = lambda g: max(rel(a.astype(jnp.float32), b) for a, b in
                      zip(jax.tree.leaves(g), jax.tree.leaves(truth)))
  return "".join(f" {label}={err(g):.3e}" for label, g in zip(("err_one", "err_sharded"),
                                                              grads))


mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
CASES_TRAIN = "train" in sys.argv[2:]
# No mode named: shard_map, or none at all beside "train" (the train step alone).
MODES = [m for m in ("shard_map", "jit", "auto") if m in sys.argv[2:]] or (
    [] if CASES_TRAIN or "row_terms" in sys.argv[2:] else ["shard_map"])
# "only=a,b": the cases whose name contains one of these (a short run on the GPU host)
ONLY = [w for arg in sys.argv[2:] if arg.startswith("only=")
        for w in arg.removeprefix("only=").split(",") if w]
rel = lambda a, b: float(jnp.linalg.norm((a - b).astype(jnp.float32))
                         / jnp.linalg.norm(b.astype(jnp.float32)))
# Tensor parallel on a (data=2, model=2) mesh: column-parallel wqkv, w13 and wlm (the
# vocabulary), row-parallel wo, w2; the attention output y arrives split by heads.
COL, ROW, Y = P(None, "model"), P("model", None), P("data", "model")
TP_BLOCK = {"wo": ROW, "g_mlp": W, "w13": COL, "w2": ROW, "g_attn": W, "wqkv": COL}
TP_POST = {"wo": ROW, "g_mlp": W, "w13": COL, "w2": ROW, "g_final": W, "wlm": COL}
TP_CASES = {
    "tp_rmsnorm_swiglu": CASES["rmsnorm_swiglu"][:2] + ((R, R, COL, Y), (0, 1, 2)),
    "tp_lm_head_loss": CASES["lm_head_loss_chunked"][:2] + ((R, R, COL, R), (0, 1, 2)),
    "tp_lm_head_loss_exp": CASES["lm_head_loss_exp"][:2] + ((R, R, COL, R), (0, 1, 2)),
    # per-token losses: the backward recomputes the logits and sets the target column
    "tp_lm_head_loss_none": (
        lambda h, r, w, t, c: jnp.sum(c * F.rmsnorm_lm_head_loss(
            h, r, w, t, reduction="none", chunk_rows=M // 4, impl=IMPL)),
        (h, r, wlm, tgt, normal((M,)).astype(jnp.float32)), (R, R, COL, R, R), (0, 1, 2)),
    "tp_shifted_block": CASES["shifted_block"][:2] + ((R, Y, R, TP_BLOCK, R, Y), (0, 1, 3)),
    "tp_post_block": CASES["post_block"][:2] + ((R, Y, R, TP_POST), (0, 1, 3)),
}


def count_op(hlo, op):
  """How many ``op`` collectives compiled HLO text holds, synchronous or asynchronous (the
  GPU compiler emits e.g. ``all-reduce-start``, the CPU's ``all-reduce``)."""
  return hlo.count(op + "(") + hlo.count(op + "-start(")


COLLECTIVE_OPS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all",
                  "collective-permute")


def collectives(hlo):
  """Counts of each collective in compiled HLO text (``count_op``)."""
  return " ".join(f"{op}={count_op(hlo, op)}" for op in COLLECTIVE_OPS)


def loop_collectives(hlo, dim):
  """Collectives of compiled HLO text that run inside a while loop (in a loop's body or
  in any computation it calls) on an array with a dimension of size ``dim``."""
  import re
  bodies, calls, comp = {}, {}, None
  for line in hlo.splitlines():
    if line and not line.startswith(" ") and line.rstrip().endswith("{"):
      comp = "ENTRY" if line.startswith("ENTRY") else line.split()[0].lstrip("%")
      bodies[comp] = []
      calls[comp] = set()
    elif comp is not None:
      bodies[comp].append(line)
      calls[comp].update(re.findall(
          r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)", line))
      for group in re.findall(r"(?:branch_computations|called_computations)=\{([^}]*)\}", line):
        calls[comp].update(x.strip().lstrip("%") for x in group.split(","))
  todo = [b for lines in bodies.values() for line in lines
          for b in re.findall(r"while\(.*body=%?([\w.\-]+)", line)]
  inside = set()
  while todo:
    c = todo.pop()
    if c not in inside and c in bodies:
      inside.add(c)
      todo.extend(calls[c])
  pat = re.compile(r"\[[^\]]*\b%d\b[^\]]*\]" % dim)
  count = 0
  for c in inside:
    for line in bodies[c]:
      rhs = line.split(" = ", 1)[-1]
      for op in COLLECTIVE_OPS:
        if count_op(rhs, " " + op):
          count += bool(pat.search(rhs.split(f" {op}", 1)[0]))
  return count


def largest_reduce(hlo):
  """Elements of the largest array any all-reduce of ``hlo`` sums."""
  import re
  sizes = [0]
  for line in hlo.splitlines():
    if " all-reduce(" in line or " all-reduce-start(" in line:
      lhs = line.split(" all-reduce")[0].split("=", 1)[-1]
      for dims in re.findall(r"\w+\[([\d,]*)\]", lhs):
        sizes.append(int(np.prod([int(d) for d in dims.split(",") if d])))
  return max(sizes)


def put_tree(mesh, args, specs):
  return [jax.tree.map(lambda a, s=s: jax.device_put(a, NamedSharding(mesh, s)), a)
          if not isinstance(s, dict) else
          {k: jax.device_put(v, NamedSharding(mesh, s[k])) for k, v in a.items()}
          for a, s in zip(args, specs)]


Auto, Explicit = jax.sharding.AxisType.Auto, jax.sharding.AxisType.Explicit
_ones = {}  # name -> the case's gradients on one device (compiled once, not per mode)
for mode in MODES:
  cases = dict(CASES)
  if mode != "shard_map":
    types = (Explicit if mode == "jit" else Auto,)
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2], axis_types=types)
    mesh_tp = jax.make_mesh((TP_DATA, 2), ("data", "model"), axis_types=types * 2,
                            devices=jax.devices()[:2 * TP_DATA])
    cases.update(TP_CASES)
  if ONLY:
    cases = {nm: c for nm, c in cases.items() if any(w in nm for w in ONLY)}
    if not cases:
      sys.exit(f"only={','.join(ONLY)} matches no case of mode {mode}")
  for name, (loss, args, specs, argnums) in cases.items():
    if name not in _ones:  # the one-device gradients, the same in every mode
      _ones[name] = jax.jit(jax.grad(loss, argnums=argnums))(*args)
    one = _ones[name]
    put = put_tree(mesh_tp if name.startswith("tp_") else mesh, args, specs)
    if mode == "shard_map":
      sharded = jax.jit(jax.grad(jax.shard_map(lambda *a: jax.lax.psum(loss(*a), "data"),
                                               mesh=mesh, in_specs=specs, out_specs=P()),
                                 argnums=argnums))
    else:  # plain jit of the same loss (explicit or auto axes): coda_jax.partitioning
      sharded = jax.jit(jax.grad(loss, argnums=argnums))
    two = sharded(*put)
    diff = max(rel(a, b) for a, b in zip(jax.tree.leaves(two), jax.tree.leaves(one)))
    hlo = sharded.lower(*put).compile().as_text()
    fwd = "" if mode == "shard_map" else jax.jit(loss).lower(*put).compile().as_text()
    print(f"CASE {mode} {name} {diff:.3e} {collectives(hlo)} "
          f"largest_reduce={largest_reduce(hlo)} forward_largest_reduce="
          f"{largest_reduce(fwd)}{errors_vs_truth(name, args, argnums, one, two)}",
          flush=True)


if CASES_TRAIN:  # the main job's data-parallel train step against one device
  from flax import nnx  # noqa: E402
  from flax_layers import Llama, get_config, train  # noqa: E402
  # XLA's attention on a GPU: the shard_map runs refuse cuDNN's (train.check_shard_map_attention)
  # A vocabulary no other dimension shares, so the head's collectives can be told apart,
  # and LM-head chunks of 64 rows (4 on one device, 2 per device on 2): a loop over
  # chunks, as the 1B model runs with 8 of 2048 rows.
  VOCAB_M, HEAD_ROWS = 384, 64
  cfg_m = get_config("tiny", vocab_size=VOCAB_M,
                     **({"attention_impl": "xla"} if ON_GPU else {}))
  import coda_jax.block_gemms as BG  # noqa: E402
  _row_chunks = BG.row_chunks
  BG.row_chunks = lambda m, v, chunk_rows, **kw: _row_chunks(m, v, chunk_rows or HEAD_ROWS, **kw)
  tokens = jax.random.randint(jax.random.key(1), (4, 64), 0, cfg_m.vocab_size, jnp.int32)
  targets = jnp.roll(tokens, -1, axis=1).at[:, -1].set(train.IGNORE_INDEX)
  targets = targets.at[0, :40].set(train.IGNORE_INDEX)  # unequal counts per device
  results = {}
  mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
  auto = (jax.sharding.AxisType.Auto,)
  mesh_jit = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2], axis_types=auto)
  mesh_tp = jax.make_mesh((TP_DATA, 2), ("data", "model"), axis_types=auto * 2,
                          devices=jax.devices()[:2 * TP_DATA])
  runs = (("one", None, "jit"), ("two", mesh, "shard_map"), ("fsdp", mesh, "shard_map"),
          ("jit", mesh_jit, "jit"), ("jit_fsdp", mesh_jit, "jit"), ("tp", mesh_tp, "jit"),
          ("jit_per_gemm", mesh_jit, "jit"), ("jit_fsdp_per_gemm", mesh_jit, "jit"))
  for label, m, partitioner in runs:
    print(f"RUN train {label}", flush=True)  # progress; a crash names its run
    model = Llama(cfg_m, rngs=nnx.Rngs(0), fused=True)
    graphdef, state = train.init_state(model, train.make_optimizer(1e-3, total_steps=4))
    if label in ("fsdp", "jit_fsdp", "jit_fsdp_per_gemm"):
      state = jax.device_put(state, train.fsdp_shardings(state, m))
    elif label == "tp":
      train.check_tensor_parallel(cfg_m, m)
      state = jax.device_put(state, train.tensor_parallel_shardings(state, m))
    elif m is not None:
      state = jax.device_put(state, NamedSharding(m, P()))
    # the default splits the head's rows per device; the per_gemm runs turn that off
    per_gemm = {"loss_row_split": False} if "per_gemm" in label else {}
    step = train.make_train_step(graphdef, mesh=m, donate=False, partitioner=partitioner,
                                 **per_gemm)
    rows = NamedSharding(m, P("data")) if m is not None else None
    t, y = (jax.device_put(tokens, rows), jax.device_put(targets, rows)) if m else (tokens, targets)
    losses = []
    for _ in range(2):
      state, loss = step(state, t, y)
      losses.append(float(loss))
    compiled = step.lower(state, t, y).compile()
    results[label] = (losses, jax.tree.leaves(nnx.state(nnx.merge(graphdef, state)[0], nnx.Param)),
                      compiled.as_text(), compiled.memory_analysis().argument_size_in_bytes)
  # Tensor-parallel gradients of the loss, fused and reference, against one device: the
  # sharded reference (XLA's own partitioning of the plain jnp model) sets the scale.
  grads = {}
  for fused in (True, False):
    for label in ("one", "tp"):
      print(f"RUN grad {label} fused={fused}", flush=True)
      model = Llama(cfg_m, rngs=nnx.Rngs(0), fused=fused)
      gdef, params, rest = nnx.split(model, nnx.Param, ...)
      t, y = tokens, targets
      if label == "tp":
        params = jax.device_put(params, train.tensor_parallel_shardings(params, mesh_tp))
        rows = NamedSharding(mesh_tp, P("data"))
        t, y = jax.device_put(tokens, rows), jax.device_put(targets, rows)
      grads[fused, label] = jax.jit(jax.grad(
          lambda p, t, y, gdef=gdef, rest=rest: nnx.merge(gdef, p, rest).loss(t, y)))(
              params, t, y)
  gdiff = {f: max(rel(a, b) for a, b in zip(jax.tree.leaves(grads[f, "tp"]),
                                            jax.tree.leaves(grads[f, "one"])))
           for f in (True, False)}
  print(f"GRADTP fused={gdiff[True]:.3e} reference={gdiff[False]:.3e}", flush=True)
  for label in ("jit", "jit_fsdp", "tp", "jit_per_gemm", "jit_fsdp_per_gemm"):
    (l1, p1, _, _), (lx, px, hlox, argx) = results["one"], results[label]
    print(f"TRAINJIT {label} loss_diff={max(abs(a - b) for a, b in zip(l1, lx)):.3e} "
          f"param_diff={max(rel(a, b) for a, b in zip(px, p1)):.3e} "
          f"arg_bytes_ratio={argx / results['jit'][3]:.3f} {collectives(hlox)} "
          f"head_collectives_in_loops={loop_collectives(hlox, VOCAB_M)} "
          f"layer_collectives_in_loops={loop_collectives(hlox, 2 * cfg_m.ffn_dim)}",
          flush=True)
  # Llama.loss and GPT2.loss with row_split (the head per device in one shard_map)
  # against the same jit on the same 2 devices without it, each reduction, gradients of
  # the mean; then the refusals of RowSplit and sum_over_rows.
  from coda_jax.sharding import RowSplit, sum_over_rows  # noqa: E402
  from flax_layers import GPT2, get_gpt2_config  # noqa: E402
  split = RowSplit(mesh_jit, "data")
  rows = NamedSharding(mesh_jit, P("data"))
  t, y = jax.device_put(tokens, rows), jax.device_put(targets, rows)
  for name, model in (("llama", Llama(cfg_m, rngs=nnx.Rngs(0), fused=True)),
                      ("gpt2", GPT2(get_gpt2_config("gpt2-tiny", vocab_size=VOCAB_M),
                                    rngs=nnx.Rngs(0), fused=True))):
    gdef, params, rest = nnx.split(model, nnx.Param, ...)
    params = jax.device_put(params, NamedSharding(mesh_jit, P()))
    of = lambda p, red, rs, gdef=gdef, rest=rest: nnx.merge(gdef, p, rest).loss(
        t, y, reduction=red, row_split=rs)

    # One program per path (compiling is most of this check's time): each reduction's
    # loss, and the mean's gradient.
    def losses(p, rs):
      grad = jax.grad(lambda q: of(q, "mean", rs))(p)
      return {red: of(p, red, rs) for red in ("mean", "sum", "none")}, grad
    (l_split, g_split), (l_plain, g_plain) = (
        jax.jit(lambda p, rs=rs: losses(p, rs))(params) for rs in (split, None))
    diffs = {red: rel(l_split[red], l_plain[red]) for red in ("mean", "sum", "none")}
    gdiff = max(rel(a, b) for a, b in zip(jax.tree.leaves(g_split), jax.tree.leaves(g_plain)))
    print(f"ROWSPLIT {name} " + " ".join(f"{k}={v:.3e}" for k, v in diffs.items())
          + f" grad={gdiff:.3e}", flush=True)
  for label, make in (("axis", lambda: RowSplit(mesh_jit, "model")),
                      ("tp", lambda: RowSplit(mesh_tp, "data")),
                      ("rows", lambda: sum_over_rows(jnp.sum, split, (jnp.ones((3, 4)),), ()))):
    try:
      make()
      print(f"ROWSPLITERR {label} none", flush=True)
    except ValueError as e:
      print(f"ROWSPLITERR {label} ok {str(e)[:150]}", flush=True)
  BG.row_chunks = _row_chunks
  (l1, p1, _, _), (l2, p2, hlo2, arg2) = results["one"], results["two"]
  l3, p3, hlo3, arg3 = results["fsdp"]
  print(f"FSDP loss_diff={max(abs(a - b) for a, b in zip(l1, l3)):.3e} "
        f"param_diff={max(rel(a, b) for a, b in zip(p3, p1)):.3e} "
        f"arg_bytes_ratio={arg3 / arg2:.3f} all-gather={count_op(hlo3, 'all-gather')}", flush=True)
  pdiff = max(rel(a, b) for a, b in zip(p2, p1))
  print(f"TRAIN loss_diff={max(abs(a - b) for a, b in zip(l1, l2)):.3e} "
        f"param_diff={pdiff:.3e} all-gather={count_op(hlo2, 'all-gather')} "
        f"all-reduce={count_op(hlo2, 'all-reduce')} loss={l2[-1]:.4f}", flush=True)


if "errors" in sys.argv[2:] and len(jax.devices()) >= 4:  # splits the kernels cannot run are refused, never replicated
  for types in (Explicit, Auto):
    mesh4 = jax.make_mesh((1, 4), ("data", "model"), axis_types=(types,) * 2)
    put4 = lambda x, s: jax.device_put(x, NamedSharding(mesh4, s))
    # 2F = 384 columns over 4 devices: 96 per device, not whole 64-column SwiGLU pairs.
    try:
      jax.jit(lambda h, r, w: F.rmsnorm_swiglu(h, r, w, impl=IMPL))(
          put4(h, P()), put4(r, P()), put4(w13, P(None, "model")))
      print(f"ERRORCASE {types.name} swiglu_pairs none", flush=True)
    except Exception as e:  # noqa: BLE001 (the auto partitioner wraps it)
      msg = str(e)
      ok = ("not a multiple of the program's column group 64" in msg if types == Explicit
            else "not divisible by axis_size=4" in msg)
      print(f"ERRORCASE {types.name} swiglu_pairs {'ok' if ok else 'wrong'}: "
            f"{msg.splitlines()[0][:200]}", flush=True)


# LayerNorm's input gradient in one GEMM (layernorm_ops.row_terms_sharded): its row totals
# are exchanged inside the kernel, so it has a rule of its own. With IMPL "mosaic" (on the
# GPU) each shard whose rows alone are split runs the kernel; otherwise, and on the CPU,
# every shard runs the same program in XLA (row_terms_xla), which is what the rule's
# collectives are checked on. Prints
#   ROWTERMS <axis type> <split> diff=<max rel diff from one device> <collectives>
#   largest_reduce=<elements>
if "row_terms" in sys.argv[2:]:
  ks_rt = iter(jax.random.split(jax.random.key(2), 8))
  rt_x = (3 * jax.random.normal(next(ks_rt), (M, D)) + 0.5).astype(bf)
  rt_mu, rt_r = layernorm_stats(rt_x.astype(jnp.float32), 1e-5)
  # dn ~ 1 and dx ~ 0.3: the row terms are a large part of dxt, so a wrong total shows
  rt_args = (normal((M, F_)), weight(F_, D).T, rt_x, normal((M, D), 0.3), rt_mu, rt_r,  # dz,
             gain(D), 0.3 * gain(D) - 0.3)  # w, x, dx, mu, r, g, beta
  rc = L.RowTermsCall(L.row_terms_config(D) if IMPL == "mosaic" else None)
  one_rt = jax.jit(lambda *a: L.row_terms_local(
      rc, L.partitioning.Layout((), (), ()), *a))(*rt_args)
  # split name -> (dz, w, x) specs (dx as x; mu, r with x's rows; g, beta with w's rows)
  splits = {"rows": (P("data"), P(), P("data")),
            "cols": (P(), P("model"), P(None, "model")),
            "contraction": (P(None, "model"), P(None, "model"), P()),
            "rows_cols": (P("data"), P("model"), P("data", "model")),
            "rows_contraction": (P("data", "model"), P(None, "model"), P("data"))}
  for types in (Auto, Explicit):
    mesh_rt = {"rows": jax.make_mesh((2,), ("data",), devices=jax.devices()[:2],
                                     axis_types=(types,))}
    mesh_rt["tp"] = jax.make_mesh((TP_DATA, 2), ("data", "model"), axis_types=(types,) * 2,
                                  devices=jax.devices()[:2 * TP_DATA])
    for split, (s_dz, s_w, s_x) in splits.items():
      m_rt = mesh_rt["rows" if split == "rows" else "tp"]
      s_rows, s_cols = P(s_x[0] if len(s_x) else None), P(s_w[0] if len(s_w) else None)
      put = [jax.device_put(a, NamedSharding(m_rt, s)) for a, s in zip(
          rt_args, (s_dz, s_w, s_x, s_x, s_rows, s_rows, s_cols, s_cols))]
      fn = jax.jit(lambda *a: L.row_terms_sharded(rc, *a))
      got = fn(*put)
      diff = max(rel(a, b) for a, b in zip(got, one_rt))
      hlo = fn.lower(*put).compile().as_text()
      print(f"ROWTERMS {types.name} {split} diff={diff:.3e} {collectives(hlo)} "
            f"largest_reduce={largest_reduce(hlo)}", flush=True)

  # layernorm_input_grad's routing with rows split: under jit on auto and explicit axes
  # (row_terms_sharded) and inside shard_map (the local call), the one GEMM runs and
  # nothing falls back. On the CPU a stand-in takes the kernel's place: it refuses, as
  # the kernel does, operands whose types carry a sharding, and otherwise runs the XLA
  # form (a fallback, if taken, runs with impl "xla"). Prints ROUTE <mode> fallbacks=<count> diff=<max rel diff from one device>.
  from coda_jax import dispatch
  fallbacks = []
  dispatch.announce = fallbacks.append
  if IMPL != "mosaic":
    class _Device:
      core_count = 132

    def kernel_stand_in(dz, w, x, dx, mu, r, g, beta, config, num_sms=None):
      specs = [getattr(getattr(jax.typeof(v), "sharding", None), "spec", None) or ()
               for v in (dz, w, x, dx, mu, r, g, beta)]
      if any(e is not None for spec in specs for e in spec):
        raise ValueError(f"stand-in: sharded types reach the kernel ({specs})")
      dn = jnp.matmul(dz, w.T, preferred_element_type=jnp.float32)
      return L.row_terms_xla(dn, x, dx, mu, r, g, beta)
    dispatch.kernels_available, dispatch.target_device = (lambda: True), (lambda: _Device())
    L.row_terms_gemm = kernel_stand_in
    gemm_and_pass = L.input_grad_gemm_and_pass  # a fallback, if taken, runs XLA's GEMMs
    L.input_grad_gemm_and_pass = lambda *a: gemm_and_pass(*a[:-1], "xla")
  grad = lambda *a: L.layernorm_input_grad(a[0], a[1], None, *a[2:], "mosaic")
  specs_rt = (P("data"), P(), P("data"), P("data"), P("data"), P("data"), P(), P())

  def local_grad(*a):
    dxt, n, *cols = grad(*a)
    return dxt, n, *(jax.lax.psum(c, "data") for c in cols)
  for label, types in (("jit_auto", Auto), ("jit_explicit", Explicit), ("shard_map", Auto)):
    m_rt = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2], axis_types=(types,))
    put = [jax.device_put(a, NamedSharding(m_rt, s)) for a, s in zip(rt_args, specs_rt)]
    fn = jax.jit(grad if label != "shard_map" else jax.shard_map(
        local_grad, mesh=m_rt, in_specs=specs_rt,
        out_specs=(P("data"), P("data"), P(), P(), P())))
    del fallbacks[:]
    diff = max(rel(a, b) for a, b in zip(fn(*put), one_rt))
    print(f"ROUTE {label} fallbacks={len(fallbacks)} diff={diff:.3e} {fallbacks}", flush=True)
