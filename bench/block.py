"""Whole Llama blocks: our fused shifted block (and post-block) vs jax.jit of the same
block written the standard way, forward and forward+backward, CUPTI kernel time.

    PYTHONPATH=. python -m bench.block [--shapes 1b,8b] [--out DIR] [--iterations N]
        [--rounds R] [--sustained-s S]

Per shape: (a) shifted block forward and (b) forward+backward, ours vs XLA, each next to
(c) its GEMMs alone as plain ``jnp.dot`` under jit (the speed of light); (d) each fused op
of ``fused_ops`` vs jit of its ``jnp_reference``; (e) compiled peak memory of (b); (f)
post-block forward+backward (1b only). The XLA baseline uses the standard layouts:
separate gate and up weights, one fused [q | k | v] projection, rotate-half RoPE.
Writes block.{json,md} to --out (default bench/results/<device>/). Without a GPU it runs
a tiny shape through the Mosaic GPU interpreter: a correctness check of ours vs the
baseline, with wall-clock times that say nothing about GPU speed. ``--sustained-s``
times each round by wall clock over back-to-back calls instead, the H100's power-capped
steady state, with its SM clock, power and energy per call (``timer``).
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp

from bench import common
from pallas_kernels import autotune
from coda_jax import blocks, layout
from coda_jax import fused_ops as F
from coda_jax import jnp_reference as ref

f32, bf16 = jnp.float32, jnp.bfloat16
BLOCK = 32  # SwiGLU pair block of our w13 layout
THETA, EPS, SEQ = 500000.0, 1e-5, 2048  # RoPE base, RMSNorm eps, packed sequence length


class Shape(NamedTuple):
  m: int  # tokens
  d: int
  f: int
  n_q: int
  n_kv: int
  head_dim: int
  vocab: int

  @property
  def qkv_width(self):
    return (self.n_q + 2 * self.n_kv) * self.head_dim


SHAPES = {"1b": Shape(16384, 2048, 8192, 32, 8, 64, 128256),  # Llama-3.2-1B
          # 1B with a token count that does not tile (the kernels pad M; compare per token)
          "1b_m16000": Shape(16000, 2048, 8192, 32, 8, 64, 128256),
          # ... and the 16128 rows Llama.loss runs 8 x 2000 tokens at (ROW_MULTIPLE padding)
          "1b_m16128": Shape(16128, 2048, 8192, 32, 8, 64, 128256),
          "8b": Shape(8192, 4096, 14336, 32, 8, 128, 128256),  # Llama-3-8B
          "tiny": Shape(256, 128, 256, 4, 2, 32, 512)}  # CPU interpreter check


def make_inputs(s: Shape, key, dtype=bf16):
  """Activations ~N(0, 1); weights ~N(0, 1/fan_in) so every GEMM output stays O(1)."""
  ks = iter(jax.random.split(key, 16))
  normal = lambda shape, scale=1.0: (scale * jax.random.normal(next(ks), shape, f32)).astype(dtype)
  weight = lambda k, n: normal((k, n), k ** -0.5)
  norm = lambda: 1 + 0.1 * jax.random.normal(next(ks), (s.d,), f32)
  params = dict(wo=weight(s.n_q * s.head_dim, s.d), g_mlp=norm(), w_gate=weight(s.d, s.f),
                w_up=weight(s.d, s.f), w2=weight(s.f, s.d), g_attn=norm(),
                wqkv=weight(s.d, s.qkv_width), g_final=norm(), wlm=weight(s.d, s.vocab))
  return dict(x0=normal((s.m, s.d)), y0=normal((s.m, s.n_q * s.head_dim)),
              positions=jnp.arange(s.m, dtype=jnp.int32) % SEQ,
              targets=jax.random.randint(next(ks), (s.m,), 0, s.vocab, jnp.int32),
              cts=(normal((s.m, s.d)), normal((s.m, s.qkv_width))), params=params)


def ours_params(std, keys):
  # Converted once, as a model would at load time: not part of any timed step.
  w13 = layout.gate_up_to_blocked(jnp.concatenate([std["w_gate"], std["w_up"]], 1), BLOCK)
  return {k: w13 if k == "w13" else std[k] for k in keys}


def grads_to_standard(grads):
  """Our (.., {.., w13 pair-blocked}) gradients -> the baseline's gate/up layout."""
  *acts, dp = grads
  dp = dict(dp)
  gate_up = layout.blocked_to_gate_up(dp.pop("w13"), BLOCK)
  f = gate_up.shape[1] // 2
  return (*acts, dict(dp, w_gate=gate_up[:, :f], w_up=gate_up[:, f:]))


# ---- the XLA baseline, written the way a user writes a Llama block ------------------------
def rmsnorm(x, g, eps=EPS):
  xf = x.astype(f32)
  return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + eps) * g).astype(x.dtype)


def rope(x, positions, head_dim, theta=THETA):
  """Rotate-half RoPE on (M, heads * head_dim), fp32 angles."""
  xh = x.reshape(x.shape[0], -1, head_dim).astype(f32)
  inv = theta ** (-jnp.arange(head_dim // 2, dtype=f32) * 2 / head_dim)
  t = positions.astype(f32)[:, None, None] * jnp.concatenate([inv, inv])
  half = head_dim // 2
  rotated = jnp.concatenate([-xh[..., half:], xh[..., :half]], -1)
  return (xh * jnp.cos(t) + rotated * jnp.sin(t)).reshape(x.shape).astype(x.dtype)


def xla_mlp(x0, y0, p, g_next, eps=EPS):
  x1 = y0 @ p["wo"] + x0
  h1 = rmsnorm(x1, p["g_mlp"], eps)
  y1 = jax.nn.silu(h1 @ p["w_gate"]) * (h1 @ p["w_up"])
  x2 = y1 @ p["w2"] + x1
  return x2, rmsnorm(x2, g_next, eps)


def xla_shifted_block(s: Shape):
  def block(x0, y0, positions, p):
    x2, h2 = xla_mlp(x0, y0, p, p["g_attn"])
    qkv = h2 @ p["wqkv"]  # one fused projection, split into heads below
    nq, nk = s.n_q * s.head_dim, s.n_kv * s.head_dim
    q, k = rope(qkv[:, :nq], positions, s.head_dim), rope(qkv[:, nq:nq + nk], positions, s.head_dim)
    return x2, jnp.concatenate([q, k, qkv[:, nq + nk:]], -1)
  return block


def xla_post_block(x0, y0, targets, p):
  _, h2 = xla_mlp(x0, y0, p, p["g_final"])
  logits = (h2 @ p["wlm"]).astype(f32)
  picked = jnp.take_along_axis(logits, targets[:, None], -1)[:, 0]
  return jnp.mean(jax.nn.logsumexp(logits, -1) - picked)


def fwd_bwd(block):
  """Forward + backward of (x0, y0, positions, params) -> outputs: the gradients of
  x0, y0 and params for the given output cotangents."""
  def step(x0, y0, positions, p, cts):
    _, pull = jax.vjp(lambda a, b, q: block(a, b, positions, q), x0, y0, p)
    return pull(cts)
  return step


def gemms(s: Shape, backward: bool, key):
  """(fn, args): the block's forward GEMMs (and, with ``backward``, each one's input
  gradient dout @ W^T and fp32 weight gradient A^T @ dout), one jitted function."""
  return gemms_of([(s.m, s.n_q * s.head_dim, s.d), (s.m, s.d, 2 * s.f), (s.m, s.f, s.d),
                   (s.m, s.d, s.qkv_width)], backward, key)


def gemms_of(mkn, backward: bool, key):
  """(fn, args) for GEMMs of the given (M, K, N)s, as ``gemms``. Every GEMM gets its own
  operands so XLA cannot merge dots that share an input."""
  ks = iter(jax.random.split(key, 3 * len(mkn)))
  args = [(jax.random.normal(next(ks), (m, k), bf16),
           (jax.random.normal(next(ks), (k, n), f32) * k ** -0.5).astype(bf16),
           jax.random.normal(next(ks), (m, n), bf16)) for m, k, n in mkn]

  def fn(args):
    outs = [a @ w for a, w, _ in args]
    if backward:
      outs += [dout @ w.T for _, w, dout in args]
      outs += [jnp.dot(a.T, dout, preferred_element_type=f32) for a, _, dout in args]
    return outs
  return fn, args


rel_diff = common.rel_diff


def check_baseline():
  """The baseline is the same math as ``jnp_reference`` (which ours is tested against):
  in fp32 they agree to rounding; in bf16 they differ only by where each rounds."""
  s = SHAPES["tiny"]
  heads = dict(n_q_heads=s.n_q, n_kv_heads=s.n_kv, head_dim=s.head_dim, theta=THETA)
  for dtype in (f32, bf16):
    x = make_inputs(s, jax.random.key(7), dtype)
    p = x["params"]  # standard layout; ours_params gives jnp_reference's
    with jax.default_matmul_precision("highest"):
      mine = xla_shifted_block(s)(x["x0"], x["y0"], x["positions"], p)
      theirs = ref.shifted_block(x["x0"], x["y0"], x["positions"],
                                 ours_params(p, blocks.SHIFTED_KEYS), **heads, eps=EPS)
      post = xla_post_block(x["x0"], x["y0"], x["targets"], p)
      post_ref = ref.post_block(x["x0"], x["y0"], x["targets"], ours_params(p, blocks.POST_KEYS))
    print(f"baseline vs jnp_reference ({jnp.dtype(dtype).name}): shifted block "
          f"{rel_diff(mine, theirs):.1e}, post-block {rel_diff(post, post_ref):.1e}")


def peak_bytes(fn, *args):
  """Compiled peak device memory from ``memory_analysis()``: arguments and outputs live
  throughout, temp is XLA's liveness-packed scratch, aliased outputs reuse arguments."""
  m = jax.jit(fn).lower(*args).compile().memory_analysis()
  return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
          - m.alias_size_in_bytes)


def block_configs(s: Shape, impl="auto", lm_chunk_rows=None):
  """(shifted block, post-block) configs of our fused path at shape ``s``, as timed here
  and as bench/tune_gemm.py traces them (``lm_chunk_rows``: the LM head's rows per chunk,
  default the library's choice; the head's gradient is the library's default)."""
  return (blocks.BlockConfig(s.n_q, s.n_kv, s.head_dim, rope_theta=THETA, eps=EPS,
                             swiglu_block=BLOCK, impl=impl),
          blocks.BlockConfig(s.n_q, s.n_kv, s.head_dim, eps=EPS, swiglu_block=BLOCK,
                             impl=impl, lm_chunk_rows=lm_chunk_rows))


def timed_rounds(measure, ours, ours_args, xla, xla_args, rounds=1):
  """``ours`` and ``xla`` timed ``rounds`` times each, alternating ABBA (ours first in
  even rounds, XLA first in odd ones), so that a drift of the machine's speed over the
  run (clocks settling after an idle start, another tenant) falls on both alike.

  Returns:
    A dict: ours_ms and baseline_ms (the medians of the rounds' medians),
    speedup_vs_baseline (the median of the rounds' XLA / ours ratios), the per-round
    lists ours_ms_rounds, baseline_ms_rounds and speedup_rounds (only when ``rounds`` >
    1), the first round's per-kernel times (ours_kernels, baseline_kernels), and each
    function's outputs from its first round (under the keys "got" and "want"). Where
    ``measure`` gives a window's power (``timer``'s sustained mode), also the medians
    over the rounds of each one's SM clock, power and energy per call: ours_mhz,
    ours_watts, ours_joules and baseline_mhz, baseline_watts, baseline_joules.
  """
  if rounds < 1:
    raise ValueError(f"rounds={rounds}: at least 1")
  times, first, power = {"ours": [], "xla": []}, {}, {"ours": [], "xla": []}
  for i in range(rounds):
    order = (("ours", ours, ours_args), ("xla", xla, xla_args))
    for name, fn, args in (order if i % 2 == 0 else order[::-1]):
      ms, kernels, out, window = measure(fn, *args)
      times[name].append(ms)
      if window is not None and window.watts is not None:
        power[name].append(window)
      first.setdefault(name, (kernels, out))
      del out
  ratios = [b / a for a, b in zip(times["ours"], times["xla"])]
  res = dict(ours_ms=statistics.median(times["ours"]),
             baseline_ms=statistics.median(times["xla"]),
             speedup_vs_baseline=statistics.median(ratios),
             ours_kernels=first["ours"][0], baseline_kernels=first["xla"][0],
             got=first["ours"][1], want=first["xla"][1])
  if rounds > 1:
    res.update(ours_ms_rounds=times["ours"], baseline_ms_rounds=times["xla"],
               speedup_rounds=ratios)
  if power["ours"] and power["xla"]:
    for name, prefix in (("ours", "ours"), ("xla", "baseline")):
      for field in ("mhz", "watts", "joules"):
        res[f"{prefix}_{field}"] = statistics.median(getattr(w, field) for w in power[name])
  return res


def compare_row(op, shape_name, dims, measure, prov, impl, ours, ours_args, xla, xla_args,
                to_std=lambda t: t, gemm_fns=None, memory=False, rounds=1, labels=None):
  """One table row: ``ours`` and ``xla`` timed on their arguments (CUPTI kernel time on a
  GPU; ``rounds`` > 1 alternates them, see ``timed_rounds``), their outputs compared with
  each other and with the fp32 truth (``xla`` run in fp32 at HIGHEST precision), and
  optionally the GEMMs alone and the compiled peaks; ``labels``, more fields naming the
  row (e.g. its head_grad). A failing measurement is reported in the row, not raised."""
  row = dict(op=op, shape=shape_name, dims=dims, baseline="xla_jit", **(labels or {}), **prov)
  try:
    timed = timed_rounds(measure, ours, ours_args, xla, xla_args, rounds)
    got, want = timed.pop("got"), timed.pop("want")
    row.update(timed)
    row["rel_diff_vs_baseline"] = rel_diff(to_std(got), want)
    # Both against the fp32 truth of the same math: ours should be as close as XLA's bf16.
    upcast = lambda v: v.astype(f32) if v.dtype == bf16 else v
    with jax.default_matmul_precision("highest"):
      truth = jax.jit(xla)(*jax.tree.map(upcast, xla_args))
    row["ours_err_vs_fp32"], row["baseline_err_vs_fp32"] = (
        rel_diff(to_std(got), truth), rel_diff(want, truth))
    del got, want, truth
    if gemm_fns:
      row["gemms_ms"] = measure(*gemm_fns)[0]
      row["ours_vs_gemms"] = row["ours_ms"] / row["gemms_ms"]
    if memory:
      row["ours_peak_bytes"] = peak_bytes(ours, *ours_args)
      row["baseline_peak_bytes"] = peak_bytes(xla, *xla_args)
    if impl == "mosaic":  # the config each of our GEMMs ran with (clears jax's caches)
      row["configs"] = autotune.describe_workload(ours, *ours_args)
  except Exception as e:  # a failing measurement is reported in the table, not fatal
    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
  print(f"{shape_name} {op}: " + ", ".join(f"{k} {v:.3g}" for k, v in row.items()
                                           if isinstance(v, (int, float)) and "_" in k)
        + row.get("error", ""), flush=True)
  return row


def check_head_grads(head_grads) -> None:
  """ValueError, naming ``head_grads``, unless it is one or more of ``F.HEAD_GRADS``."""
  if not head_grads or any(h not in F.HEAD_GRADS for h in head_grads):
    raise ValueError(f"head_grads={tuple(head_grads)!r}: one or more of {F.HEAD_GRADS}")


def run_shape(name, s: Shape, impl, measure, prov, key, only=None, lm_chunk_rows=None,
              head_grads=("auto",), rounds=1, mlp_residuals=(blocks.MLP_RESIDUALS[0],)):
  """The rows of shape ``s``: each op of ``only`` (default all), the shifted block's
  forward+backward once per entry of ``mlp_residuals`` (``BlockConfig.mlp_residuals``),
  and at 1b and tiny the post-block once per entry of ``head_grads``
  (``BlockConfig.head_grad``)."""
  check_head_grads(head_grads)
  x = make_inputs(s, key)
  std, pos, tgt = x["params"], x["positions"], x["targets"]
  cfg, post_cfg = block_configs(s, impl, lm_chunk_rows)
  mine = ours_params(std, blocks.SHIFTED_KEYS)
  ours_block = lambda a, b, c, p: blocks.shifted_block(a, b, c, p, cfg)
  xla_block = xla_shifted_block(s)
  std_shifted = {k: std[k] for k in ("wo", "g_mlp", "w_gate", "w_up", "w2", "g_attn", "wqkv")}
  rows = []

  def compare(op, *args, **kwargs):
    if not only or op in only:
      rows.append(compare_row(op, name, s._asdict(), measure, prov, impl, *args,
                              rounds=rounds, **kwargs))

  gemm_key = jax.random.fold_in(key, 1)
  compare("shifted_block_fwd", ours_block, (x["x0"], x["y0"], pos, mine),
          xla_block, (x["x0"], x["y0"], pos, std_shifted), gemm_fns=gemms(s, False, gemm_key))
  for kept in mlp_residuals:  # one row per choice of what the MLP keeps
    cfg_k = dataclasses.replace(cfg, mlp_residuals=kept)
    compare("shifted_block_fwd_bwd",
            fwd_bwd(lambda a, b, c, p, c_k=cfg_k: blocks.shifted_block(a, b, c, p, c_k)),
            (x["x0"], x["y0"], pos, mine, x["cts"]),
            fwd_bwd(xla_block), (x["x0"], x["y0"], pos, std_shifted, x["cts"]),
            to_std=grads_to_standard, gemm_fns=gemms(s, True, gemm_key), memory=True,
            labels={"mlp_residuals": kept} if len(mlp_residuals) > 1 else None)

  # per-op inputs: a normed residual stream h = x * g and its RMS scale r
  h, r = (x["x0"].astype(f32) * std["g_mlp"]).astype(bf16), ref.rms_scale(x["x0"], EPS)
  heads = dict(n_q_heads=s.n_q, n_kv_heads=s.n_kv, head_dim=s.head_dim, theta=THETA)
  ops = {
      "residual_rmsnorm": (lambda *a: F.residual_rmsnorm(*a, eps=EPS, impl=impl),
                           lambda *a: ref.residual_rmsnorm(*a, eps=EPS),
                           (x["y0"], std["wo"], x["x0"], std["g_mlp"])),
      "rmsnorm_swiglu": (lambda *a: F.rmsnorm_swiglu(*a, block=BLOCK, impl=impl),
                         lambda *a: ref.rmsnorm_swiglu(*a, BLOCK), (h, r, mine["w13"])),
      "rmsnorm_qkv_rope": (lambda *a: F.rmsnorm_qkv_rope(*a, **heads, impl=impl),
                           lambda *a: ref.rmsnorm_qkv_rope(*a, **heads), (h, r, std["wqkv"], pos)),
      "rmsnorm_lm_head_loss": (lambda *a: F.rmsnorm_lm_head_loss(*a, impl=impl),
                               ref.rmsnorm_lm_head_loss, (h, r, std["wlm"], tgt)),
  }
  for op, (ours, xla, args) in ops.items():
    compare(op, ours, args, xla, args)

  if name in ("1b", "tiny"):
    grad = lambda loss: jax.grad(loss, argnums=(0, 1, 3))
    std_post = {k: std[k] for k in ("wo", "g_mlp", "w_gate", "w_up", "w2", "g_final", "wlm")}
    for head in head_grads:  # one row per way of forming the head's gradient
      cfg_h = dataclasses.replace(post_cfg, head_grad=head)
      compare("post_block_fwd_bwd",
              grad(lambda a, b, t, p, c=cfg_h: blocks.post_block(a, b, t, p, c)),
              (x["x0"], x["y0"], tgt, ours_params(std, blocks.POST_KEYS)),
              grad(xla_post_block), (x["x0"], x["y0"], tgt, std_post),
              to_std=grads_to_standard, memory=True, labels={"head_grad": head})
  return rows


def timer(on_gpu, iterations, sustained_s=None, power_log=common.PowerLog):
  """``measure(fn, *args)`` -> (ms per call, per-kernel ms or None, fn's outputs, the
  sustained window or None): on a GPU the median of ``iterations`` calls' kernel time
  (CUPTI), or with ``sustained_s`` the wall clock per call over that many seconds of
  back-to-back calls (``common.alternating_windows``: the power-capped steady state,
  after as long again of untimed ones, as the clock climbs from idle after the compile),
  whose ``common.Sustained`` comes last, with clock and power from a ``power_log()`` read
  through the window; on a CPU the interpreter's wall clock."""
  def measure(fn, *args):
    jitted, times = jax.jit(fn), []
    out = jax.block_until_ready(jitted(*args))  # the compile, and outputs to compare
    if on_gpu and sustained_s:
      with power_log() as log:  # an untimed window first: the GPU idled in the compile
        windows = common.alternating_windows({"fn": lambda: jitted(*args)}, sustained_s, 1,
                                             power=log)
      window = windows["fn"][0]
      return window.ms, None, out, window
    if on_gpu:
      return (*common.time_kernels(fn, *args, iterations=iterations), out, None)
    for _ in range(iterations):  # CPU: wall clock of the interpreter, not a GPU speed
      t0 = time.perf_counter()
      out = jax.block_until_ready(jitted(*args))
      times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), None, out, None
  return measure


LLAMA_NOTE = ("XLA's block: separate gate/up matmuls, one fused qkv matmul. LM head per-op: "
              "all M rows, full vocabulary.")


def op_cell(row) -> str:
  """The op as a table cell; a post-block row names its head's gradient, a GPT-2 row
  its MLP's saved residuals, where its next LN_1 statistics come from and how its
  out-projection and MLP run, where the run compared them."""
  return (row["op"] + (f" ({row['head_grad']} head)" if "head_grad" in row else "")
          + (f" (MLP keeps {row['mlp_residuals']})" if "mlp_residuals" in row else "")
          + (f" (LN_1 stats from {row['ln1_stats']})" if "ln1_stats" in row else "")
          + (f" (half block as {row['half_block'].replace('_', ' ')})"
             if "half_block" in row else ""))


def speedup_cell(row) -> str:
  """XLA / ours as a table cell: with rounds, the median and the rounds' range."""
  cell = f"{row['speedup_vs_baseline']:.3f}"
  if row.get("speedup_rounds"):
    rs = row["speedup_rounds"]
    cell += f" ({len(rs)} rounds: {min(rs):.3f}-{max(rs):.3f})"
  return cell


def markdown(rows, prov, on_gpu, title="Llama blocks: ours vs jax.jit of the standard block",
             note=LLAMA_NOTE, sustained_s=None):
  mb = lambda v: f"{v / 2**20:.1f}" if v is not None else "-"
  fmt = lambda v, p=4: f"{v:.{p}f}" if v is not None else "-"
  unit = "CUPTI kernel ms per call, median" if on_gpu else "CPU wall-clock ms of the " \
      "Mosaic GPU interpreter: NOT a GPU speed, a correctness check only"
  if on_gpu and sustained_s:
    unit = (f"wall-clock ms per call over {sustained_s} s of back-to-back calls (the "
            "power-capped steady state; GEMMs alone likewise)")
  md = [f"# {title}", "",
        f"device: {prov['device']}; jax {prov['jax_version']}; commit {prov['commit']}",
        f"command: `{prov['command']}`", f"times: {unit}", "",
        "| shape | op | ours ms | XLA ms | GEMMs alone ms | XLA/ours | ours/GEMMs | "
        "ours err | XLA err | ours peak MiB | XLA peak MiB |", "|" + "---|" * 11]
  for r in rows:
    if "error" in r:
      md.append(f"| {r['shape']} | {op_cell(r)} | failed: {r['error']} |" + " |" * 8)
      continue
    md.append(f"| {r['shape']} | {op_cell(r)} | {fmt(r['ours_ms'])} | {fmt(r['baseline_ms'])} | "
              f"{fmt(r.get('gemms_ms'))} | {speedup_cell(r)} | "
              f"{fmt(r.get('ours_vs_gemms'), 3)} | {r['ours_err_vs_fp32']:.1e} | "
              f"{r['baseline_err_vs_fp32']:.1e} | "
              f"{mb(r.get('ours_peak_bytes'))} | {mb(r.get('baseline_peak_bytes'))} |")
  powered = [r for r in rows if "error" not in r and r.get("ours_joules") is not None]
  if powered:
    md += ["", "Power (nvidia-smi every 0.1 s through each window, from 0.3 s into it; "
           "medians over the rounds): SM clock, board power, and energy per call (power "
           "x time per call).", "",
           "| shape | op | ours MHz | XLA MHz | ours W | XLA W | ours J per call | "
           "XLA J per call | XLA J / ours J |", "|" + "---|" * 9]
    md += [f"| {r['shape']} | {op_cell(r)} | {r['ours_mhz']:.0f} | {r['baseline_mhz']:.0f} | "
           f"{r['ours_watts']:.0f} | {r['baseline_watts']:.0f} | {r['ours_joules']:.3f} | "
           f"{r['baseline_joules']:.3f} | {r['baseline_joules'] / r['ours_joules']:.3f} |"
           for r in powered]
  if any(r.get("speedup_rounds") for r in rows):
    md += ["", "XLA/ours: with rounds, ours and XLA's block were timed alternately (ABBA), "
           "and the cell gives the median of the rounds' ratios and their range; ours ms "
           "and XLA ms are the medians of the rounds' times."]
  md += ["", "GEMMs alone: the block's GEMMs as plain jnp.dot under jit (fwd: 4; fwd_bwd: "
         "also dout @ W^T and fp32 A^T @ dout for each). err: largest relative Frobenius "
         "difference over outputs (fwd) or gradients (fwd_bwd) from the XLA baseline's "
         "math run in fp32 (HIGHEST precision); ours vs XLA directly is rel_diff_vs_baseline "
         "in the JSON. Peak: argument + output + temp - alias bytes of the compiled "
         f"fwd+bwd. {note}"]
  configs = {}  # shape -> the GEMMs' configs, over every op
  for r in rows:
    for c in r.get("configs", []):
      configs.setdefault(r["shape"], {})[c] = None
  for shape, cs in configs.items():
    md += ["", f"GEMM configs that ran at {shape} (M x N x K: schedule, warpgroup tile x "
           "tile_k, stages, epilogue sub-tile, split, cluster, grid order; tuned = from "
           "the tuning cache):", ""]
    md += [f"- {c}" for c in cs]
  return "\n".join(md) + "\n"


def mlp_residuals_arg(parser, flag: str, text: str) -> tuple[str, ...]:
  """A comma-separated list of ``BlockConfig.mlp_residuals`` values from ``flag``'s
  ``text``; ``parser.error`` (naming the flag) on one that is not."""
  values = tuple(text.split(","))
  try:
    for v in values:
      blocks.check_mlp_residuals(v)
  except ValueError as e:
    parser.error(f"{flag}: {e}")
  return values


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--shapes", default="1b,8b", help=f"comma-separated, of {list(SHAPES)}")
  p.add_argument("--out", type=Path, default=None,
                 help="output folder (default bench/results/<device>; a temp folder on CPU)")
  p.add_argument("--iterations", type=int, default=None, help="default 30 on GPU, 1 on CPU")
  p.add_argument("--ops", default=None,
                 help="comma-separated ops to time (default all), e.g. post_block_fwd_bwd")
  p.add_argument("--lm-chunk-rows", type=int, default=None,
                 help="the post-block LM head's rows per chunk (default the library's choice)")
  p.add_argument("--head-grad", default="auto",
                 help="the post-block LM head's unit gradient (BlockConfig.head_grad), "
                 f"comma-separated of {list(F.HEAD_GRADS)}: a post-block row for each")
  p.add_argument("--mlp-residuals", default=blocks.MLP_RESIDUALS[0],
                 help="what the shifted block's MLP keeps (BlockConfig.mlp_residuals), "
                 f"comma-separated of {list(blocks.MLP_RESIDUALS)}: a forward+backward row "
                 "for each")
  p.add_argument("--rounds", type=int, default=1,
                 help="time ours and XLA alternately this many times each (ABBA) and "
                 "report the median ratio and its range (default 1)")
  p.add_argument("--sustained-s", type=float, default=None,
                 help="GPU: time each round by wall clock over this many seconds of "
                 "back-to-back calls (the power-capped steady state), with the GPU's "
                 "clock, power and energy per call, instead of CUPTI")
  args = p.parse_args()
  if args.sustained_s is not None and args.sustained_s <= 0:
    p.error(f"--sustained-s {args.sustained_s}: a positive number of seconds")
  mlp_residuals = mlp_residuals_arg(p, "--mlp-residuals", args.mlp_residuals)
  head_grads = tuple(args.head_grad.split(","))
  try:
    check_head_grads(head_grads)
  except ValueError as e:
    p.error(f"--head-grad: {e}")
  on_gpu = jax.devices()[0].platform == "gpu"
  check_baseline()
  measure = timer(on_gpu, args.iterations or (30 if on_gpu else 1), args.sustained_s)
  names, impl = (args.shapes.split(","), "mosaic") if on_gpu else (["tiny"], "interpret")
  if not on_gpu:
    print("no GPU: the tiny shape through the Mosaic GPU interpreter; times are CPU wall "
          "clock and say nothing about GPU speed.")
    args.out = args.out or Path(tempfile.gettempdir()) / "coda_block_bench"
  prov = common.provenance()
  rows, only = [], set(args.ops.split(",")) if args.ops else None
  for i, name in enumerate(names):
    rows += run_shape(name, SHAPES[name], impl, measure, prov, jax.random.key(i), only,
                      args.lm_chunk_rows, head_grads, args.rounds, mlp_residuals)
  md = markdown(rows, prov, on_gpu, sustained_s=args.sustained_s)
  out = common.write_results("block", rows, md, out=args.out)
  print(f"wrote {out / 'block.json'} and {out / 'block.md'}\n")
  print(md)


if __name__ == "__main__":
  main()
