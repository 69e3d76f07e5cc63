"""Run by test_sharding.py in a fresh process with 2 fake CPU devices (the device count
is fixed when jax starts): every fused op and the shifted block under ``jax.shard_map``
with rows split over "data" and weights replicated, against the same call on one
device. Prints one line per case: name, max relative gradient difference, and the
compiled program's all-gather and all-reduce counts."""
import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + \
    " --xla_force_host_platform_device_count=2"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from coda_jax import blocks, fused_ops as F, layout  # noqa: E402

IMPL = sys.argv[1] if len(sys.argv) > 1 else "xla"
M, D, F_, HQ, HKV, HD, V = 256, 128, 192, 4, 2, 32, 320
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
    "rmsnorm_lm_head_loss": (
        lambda h, r, w, t: F.rmsnorm_lm_head_loss(h, r, w, t, reduction="sum", impl=IMPL),
        (h, r, wlm, tgt), (R, R, W, R), (0, 1, 2)),
    "shifted_block": (
        lambda x, y, p, prm, c1, c2: sum(dot(o, c) for o, c in zip(
            blocks.shifted_block(x, y, p, prm, cfg), (c1, c2))),
        (x0, y, pos, params, ct_x, ct_q), (R, R, R, W, R, R), (0, 1, 3)),
    "post_block": (
        lambda x, y, t, prm: blocks.post_block(x, y, t, prm, post_cfg),
        (x0, y, tgt, post_params), (R, R, R, W), (0, 1, 3)),
}

mesh = jax.make_mesh((2,), ("data",))
CASES_TRAIN = "train" in sys.argv[2:]
rel = lambda a, b: float(jnp.linalg.norm((a - b).astype(jnp.float32))
                         / jnp.linalg.norm(b.astype(jnp.float32)))
for name, (loss, args, specs, argnums) in CASES.items():
  one = jax.jit(jax.grad(loss, argnums=argnums))(*args)
  put = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]
  sharded = jax.jit(jax.grad(jax.shard_map(lambda *a: jax.lax.psum(loss(*a), "data"),
                                           mesh=mesh, in_specs=specs, out_specs=P()),
                             argnums=argnums))
  two = sharded(*put)
  diff = max(rel(a, b) for a, b in zip(jax.tree.leaves(two), jax.tree.leaves(one)))
  hlo = sharded.lower(*put).compile().as_text()
  print(f"CASE {name} {diff:.3e} all-gather={hlo.count('all-gather(')} "
        f"all-reduce={hlo.count('all-reduce(')}", flush=True)


if CASES_TRAIN:  # the main job's data-parallel train step against one device
  import numpy as np  # noqa: E402
  from flax import nnx  # noqa: E402
  from flax_layers import Llama, get_config, train  # noqa: E402
  cfg_m = get_config("tiny")
  tokens = jax.random.randint(jax.random.key(1), (4, 64), 0, cfg_m.vocab_size, jnp.int32)
  targets = jnp.roll(tokens, -1, axis=1).at[:, -1].set(train.IGNORE_INDEX)
  targets = targets.at[0, :40].set(train.IGNORE_INDEX)  # unequal counts per device
  results = {}
  for label, m in (("one", None), ("two", mesh), ("fsdp", mesh)):
    model = Llama(cfg_m, rngs=nnx.Rngs(0), fused=True)
    graphdef, state = train.init_state(model, train.make_optimizer(1e-3, total_steps=4))
    if label == "fsdp":
      state = jax.device_put(state, train.fsdp_shardings(state, mesh))
    elif label == "two":
      state = jax.device_put(state, NamedSharding(mesh, P()))
    step = train.make_train_step(graphdef, mesh=m, donate=False)
    rows = NamedSharding(mesh, P("data")) if m is not None else None
    t, y = (jax.device_put(tokens, rows), jax.device_put(targets, rows)) if m else (tokens, targets)
    losses = []
    for _ in range(2):
      state, loss = step(state, t, y)
      losses.append(float(loss))
    compiled = step.lower(state, t, y).compile()
    results[label] = (losses, jax.tree.leaves(nnx.state(nnx.merge(graphdef, state)[0], nnx.Param)),
                      compiled.as_text(), compiled.memory_analysis().argument_size_in_bytes)
  (l1, p1, _, _), (l2, p2, hlo2, arg2) = results["one"], results["two"]
  l3, p3, hlo3, arg3 = results["fsdp"]
  print(f"FSDP loss_diff={max(abs(a - b) for a, b in zip(l1, l3)):.3e} "
        f"param_diff={max(rel(a, b) for a, b in zip(p3, p1)):.3e} "
        f"arg_bytes_ratio={arg3 / arg2:.3f} all-gather={hlo3.count('all-gather(')}", flush=True)
  pdiff = max(rel(a, b) for a, b in zip(p2, p1))
  print(f"TRAIN loss_diff={max(abs(a - b) for a, b in zip(l1, l2)):.3e} "
        f"param_diff={pdiff:.3e} all-gather={hlo2.count('all-gather(')} "
        f"all-reduce={hlo2.count('all-reduce(')} loss={l2[-1]:.4f}", flush=True)
