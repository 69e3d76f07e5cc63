"""The fused LM head + cross-entropy (coda_jax.fused_ops.rmsnorm_lm_head_loss) against a
cross-entropy written here, independently of the library: float64 numpy log-sum-exp
minus the target logit for the values, and a one-hot jnp form (fp32 at HIGHEST for the
truth, bf16 logits for the unfused baseline) for jax.grad. Tolerance rule as elsewhere
(helpers.assert_within_baseline): 2x the unfused bf16 error, overall and per row.

The docstring's contract: ``ignore_index`` rows count neither in the sum nor in the
mean's denominator and get zero gradient; any other target outside [0, V) (e.g. -100
when ignore_index is not -100, or V + 3) makes its row's loss NaN on the fused and the
reference path alike, and passes no gradient (test_out_of_range_targets_are_nan)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coda_jax import fused_ops as F
from coda_jax import jnp_reference as R
from coda_jax import block_gemms as S
from helpers import assert_within_baseline, f64, normal, record_head_stores, spread_rows

D, V = 192, 384  # distinct from each other and from the row counts
EPS = 1e-5


def _inputs(key, m, d, v, ignore_index, dt=jnp.bfloat16):
  """(h, r) of a residual stream with per-row std 5-50, wlm, and targets that contain
  ignore_index and the vocabulary's ends 0 and V - 1 (out-of-range ones: their own test)."""
  ks = jax.random.split(key, 4)
  xs = spread_rows(ks[0], (m, d))
  g = 1 + 0.1 * normal(ks[1], (d,))
  t = np.array(jax.random.randint(ks[3], (m,), 0, v))
  t[1::6], t[3::6], t[4::6] = ignore_index, 0, v - 1
  return dict(h=(xs * g).astype(dt), r=R.rms_scale(xs, EPS),
              wlm=normal(ks[2], (d, v), dt) * d ** -0.5, tgt=jnp.asarray(t, jnp.int32))


def ce_rows_f64(h, r, wlm, targets, ignore_index):
  """Per-row cross-entropy in float64: lse(logits) - logits[t] (t in [0, V)), NaN
  (t outside), 0 (t == ignore_index). Returns (losses, valid)."""
  hf, rf, wf = map(f64, (h, r, wlm))
  logits = hf @ wf * rf[:, None]
  mx = logits.max(axis=1)
  lse = mx + np.log(np.exp(logits - mx[:, None]).sum(axis=1))
  t = np.asarray(targets)
  inside = (t >= 0) & (t < logits.shape[1])
  picked = np.where(inside, logits[np.arange(len(t)), np.clip(t, 0, logits.shape[1] - 1)], 0)
  valid = t != ignore_index
  return np.where(valid & ~inside, np.nan, np.where(valid, lse - picked, 0.0)), valid


def ce_grads_f64(h, r, wlm, targets, ignore_index, reduction, ct):
  """d/d(h, r, wlm) of sum(ct * loss) in float64 (targets in [0, V) or ignored): the
  gradients' truth. fp32 is not enough for it: a confident row's target dlogit
  -(1 - p_t) is then formed as p_t - 1 with p_t within a few fp32 ulps (6e-8) of 1, and
  an fp32 reference (XLA's exp on the GPU rounds differently from the CPU's) is itself
  off by up to ~100% in such a row."""
  hf, rf, wf = map(f64, (h, r, wlm))
  u = hf @ wf
  z = u * rf[:, None]
  p = np.exp(z - z.max(axis=1, keepdims=True))
  p /= p.sum(axis=1, keepdims=True)
  t = np.asarray(targets)
  valid = t != ignore_index
  onehot = np.arange(z.shape[1])[None, :] == t[:, None]
  scale = np.broadcast_to(np.asarray(ct, np.float64), t.shape) * valid
  if reduction == "mean":
    scale = scale / max(valid.sum(), 1)
  dz = (p - onehot) * scale[:, None]
  dzr = dz * rf[:, None]  # d/d(h @ W)
  return dzr @ wf.T, (dz * u).sum(axis=1), hf.T @ dzr


def reduce_f64(losses, valid, reduction):
  if reduction == "none":
    return losses
  return losses.sum() / (max(valid.sum(), 1) if reduction == "mean" else 1)


def ce_jnp(h, r, wlm, targets, ignore_index, reduction):
  """The same cross-entropy as jnp for jax.grad: logits r * (h @ wlm) rounded to h's
  dtype (the unfused graph) and the target picked by a one-hot compare (no column
  matches a target outside [0, V))."""
  logits = ((h @ wlm).astype(jnp.float32) * r[:, None]).astype(h.dtype).astype(jnp.float32)
  lse = jax.nn.logsumexp(logits, axis=1)
  onehot = jnp.arange(logits.shape[1])[None, :] == targets[:, None]
  valid = targets != ignore_index
  losses = jnp.where(valid, lse - jnp.sum(jnp.where(onehot, logits, 0.0), axis=1), 0.0)
  if reduction == "none":
    return losses
  return jnp.sum(losses) / (jnp.maximum(jnp.sum(valid), 1) if reduction == "mean" else 1)


def _check(x, ignore_index, reduction, impl, ct, chunk_rows=None, wlm_layout="dv",
           head_grad="logits"):
  """Runs the fused loss forward and backward (w.r.t. h, r, wlm) and checks values and
  gradients against the independent truth; ignored rows exactly 0. Returns the fused
  (loss, grads)."""
  args = (x["h"], x["r"], x["wlm"])
  # "vd": the fused op gets the (V, D) transpose (a tied embedding table); jax.grad
  # turns its (V, D) gradient back, so everything below compares in (D, V).
  vd = wlm_layout == "vd"
  fused = lambda h, r, w: F.rmsnorm_lm_head_loss(h, r, w.T if vd else w, x["tgt"],
                                                 ignore_index=ignore_index,
                                                 reduction=reduction, chunk_rows=chunk_rows,
                                                 wlm_layout=wlm_layout,
                                                 head_grad=head_grad, impl=impl)
  proj = lambda fn: lambda *a: jnp.sum(fn(*a) * ct)
  got, grads = jax.jit(lambda *a: (fused(*a), jax.grad(proj(fused), (0, 1, 2))(*a)))(*args)
  losses, valid = ce_rows_f64(*args, x["tgt"], ignore_index)
  truth = reduce_f64(losses, valid, reduction)
  ref = lambda h, r, w: ce_jnp(h, r, w, x["tgt"], ignore_index, reduction)
  base = ref(*args)
  up = [a.astype(jnp.float32) for a in args]
  with jax.default_matmul_precision("highest"):
    np.testing.assert_allclose(np.asarray(jax.jit(ref)(*up)), truth, rtol=1e-5, atol=1e-5)
  t = np.asarray(x["tgt"])
  assert np.all((t == ignore_index) | ((t >= 0) & (t < x["wlm"].shape[1]))), \
    "_check's gradient truth takes targets in [0, V) or ignored"
  g_truth = ce_grads_f64(*args, x["tgt"], ignore_index, reduction, ct)
  g_base = jax.grad(proj(ref), (0, 1, 2))(*args)
  assert got.shape == np.shape(truth) and got.dtype == jnp.float32
  assert_within_baseline(jnp.atleast_1d(got), np.atleast_1d(truth), jnp.atleast_1d(base),
                         f"loss ({reduction})")
  for nm, a, t, b, arg in zip(("dh", "dr", "dwlm"), grads, g_truth, g_base, args):
    assert a.dtype == arg.dtype, (nm, a.dtype)
    assert_within_baseline(a, t, b, nm)
  ignored = ~valid
  assert ignored.any()
  if reduction == "none":
    assert np.all(np.asarray(got)[ignored] == 0)
  assert np.all(np.asarray(grads[0], np.float32)[ignored] == 0)
  assert np.all(np.asarray(grads[1])[ignored] == 0)
  return got, grads


# (ignore_index, reduction, chunk_rows, rows whose targets are all set to ignore_index,
# head_grad: how a scalar loss forms its head gradient, fused_ops.HEAD_GRADS)
CASES = {
    "ignore_0_mean": (0, "mean", None, None, "logits"),
    "ignore_last_none_chunked": (V - 1, "none", 64, None, "logits"),
    "ignore_-100_sum_chunked": (-100, "sum", 64, None, "logits"),
    "first_chunk_all_ignored_mean": (-100, "mean", 64, slice(0, 64), "logits"),
    "exp_ignore_0_mean": (0, "mean", None, None, "exp"),
    "exp_first_chunk_all_ignored_sum": (-100, "sum", 64, slice(0, 64), "exp"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_loss_and_grads(case, key, kernel_impl):
  """Kernel path, M = 128. ignore_index 0 and V - 1 (values the targets really hold,
  with -100 then an ordinary out-of-range target), -100; mean / none (per row against
  the float64 cross-entropy) / sum; two chunks of 64 rows, one of them all ignored."""
  ignore_index, reduction, chunk_rows, all_ignored, head_grad = CASES[case]
  m = 128
  x = _inputs(key, m, D, V, ignore_index)
  if all_ignored is not None:
    x["tgt"] = x["tgt"].at[all_ignored].set(ignore_index)
  ct = normal(jax.random.fold_in(key, 1), (m,)) if reduction == "none" else 0.75
  check = _check(x, ignore_index, reduction, kernel_impl, ct, chunk_rows,
                 head_grad=head_grad)
  if all_ignored is not None:
    assert np.all(np.asarray(check[1][0], np.float32)[all_ignored] == 0)


@pytest.mark.parametrize("reduction, chunk_rows", [("mean", None), ("none", 64)])
def test_tied_head_read_transposed(key, kernel_impl, reduction, chunk_rows):
  """wlm_layout="vd": the head stored (V, D), as a tied embedding table, which the
  GEMMs read transposed (logits, dh) and whose gradient they write (V, D). Held to the
  same truth and tolerance as the (D, V) head, on the scalar-loss path (gradient formed
  in the forward) and the per-row path (logits recomputed), chunked."""
  x = _inputs(key, 128, D, V, -100)
  ct = normal(jax.random.fold_in(key, 1), (128,)) if reduction == "none" else 0.75
  _check(x, -100, reduction, kernel_impl, ct, chunk_rows, wlm_layout="vd")


@pytest.mark.parametrize("reduction, head_grad", [("mean", "logits"), ("none", "logits"),
                                                  ("sum", "exp")])
def test_confident_rows_with_large_logits(key, kernel_impl, reduction, head_grad):
  """A trained model's regime: logits of 30 and more and targets that are each row's argmax,
  with p_t up to 1 - 5e-7. The target's dlogit -(1 - p_t) is then tiny beside p_t; on
  the forward-formed path it must come from the target's fp32 logit, not the stored
  fp16 one (whose rounding, ~|z| 2^-12, made one row's dh 116x wrong: 2 x 0.27 allowed).
  The regime is asserted, so the test cannot go easy if the inputs drift. The truth is
  float64 (``ce_grads_f64``): an fp32 one rounds 1 - p_t itself."""
  x = _inputs(key, 128, D, V, -100)
  x["wlm"] = (x["wlm"].astype(jnp.float32) * 12).astype(jnp.bfloat16)
  z = (x["h"].astype(jnp.float32) @ x["wlm"].astype(jnp.float32)) * x["r"][:, None]
  best = jnp.argmax(z, axis=1)
  p_best = jnp.max(jax.nn.softmax(z, axis=1), axis=1)
  assert float(jnp.max(z)) > 30 and float(jnp.quantile(p_best, 0.9)) > 0.998
  x["tgt"] = best.at[1::6].set(-100).astype(jnp.int32)
  ct = normal(jax.random.fold_in(key, 1), (128,)) if reduction == "none" else 0.75
  _check(x, -100, reduction, kernel_impl, ct, 64 if reduction != "mean" else None,
         head_grad=head_grad)


def test_exp_store_outside_its_range(key, kernel_impl):
  """head_grad="exp" stores exp(logits) unshifted only while every row of a chunk has
  |lse| < EXP_STORE_RANGE (60); the second of two chunks has logits up to ~200 (lse
  ~200: exp would overflow), so it runs its logits GEMM again shifted by each row's
  lse. Both chunks' gradients under the tolerance rule, against the float64 truth; the
  regime is asserted so the test cannot go easy."""
  x = _inputs(key, 128, D, V, -100)
  r = x["r"].at[64:].multiply(60.0)
  lse = jax.nn.logsumexp((x["h"].astype(jnp.float32) @ x["wlm"].astype(jnp.float32))
                         * r[:, None], axis=1)
  assert float(jnp.max(jnp.abs(lse[:64]))) < S.EXP_STORE_RANGE / 2
  assert float(jnp.min(lse[64:])) > S.EXP_STORE_RANGE * 1.5
  x["r"] = r
  _check(x, -100, "mean", kernel_impl, 0.75, 64, head_grad="exp")


def test_head_grad_checks(key):
  x = _inputs(key, 64, D, V, -100)
  with pytest.raises(ValueError, match=r"head_grad='exps': one of \('auto', 'logits', 'exp'\)"):
    F.rmsnorm_lm_head_loss(x["h"], x["r"], x["wlm"], x["tgt"], head_grad="exps")
  with pytest.raises(ValueError, match="overflows float16"):
    F.rmsnorm_lm_head_loss(x["h"].astype(jnp.float16), x["r"], x["wlm"].astype(jnp.float16),
                           x["tgt"], head_grad="exp")


@pytest.mark.parametrize("dt, want", [(jnp.bfloat16, "exp"), (jnp.float32, "exp"),
                                      (jnp.float16, "logits")])
def test_head_grad_auto_by_dtype(key, monkeypatch, dt, want):
  """The default head_grad ("auto") runs "exp" wherever it can and "logits" for float16
  (which "exp" refuses): the store that the forward-formed gradient receives, through
  the fused op (the post-block's: test_blocks), and the same gradient as naming it."""
  assert F.resolve_head_grad("auto", dt) == want
  assert F.resolve_head_grad("logits", dt) == "logits"
  stores = record_head_stores(monkeypatch)
  x = _inputs(key, 64, D, V, -100, dt)
  grad = lambda hg: jax.grad(lambda h, w: F.rmsnorm_lm_head_loss(
      h, x["r"], w, x["tgt"], head_grad=hg, impl="xla"), argnums=(0, 1))(
          x["h"], x["wlm"])
  auto, named = grad("auto"), grad(want)
  assert stores == [want, want], stores
  for a, b in zip(auto, named):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


V_ODD = 201  # not a multiple of 64, as GPT-2's 50257: padded to 256 columns


@pytest.mark.parametrize("wlm_layout, reduction, chunk_rows, head_grad",
                         [("dv", "mean", None, "logits"), ("vd", "none", 64, "logits"),
                          ("vd", "sum", 64, "logits"), ("vd", "mean", 64, "exp")])
def test_vocabulary_that_does_not_tile(key, kernel_impl, wlm_layout, reduction, chunk_rows,
                                       head_grad):
  """V = 201 runs on the kernels (``fused_ops.pad_vocab``): the head is padded to 256
  columns and an ``AddBias`` mask gives the pad columns the logit ``PAD_LOGIT``, whose
  probability and gradient are exactly 0. Loss and gradients (dW has V columns) held to
  the same truth and tolerance as a vocabulary that tiles, on the scalar path (gradient
  formed in the forward) and the per-row one (logits recomputed), both layouts. The
  kernel does refuse the unpadded head, so it is the padding that lets it run."""
  x = _inputs(key, 128, D, V_ODD, -100)
  with pytest.raises(ValueError, match="does not tile"):
    S.lm_head_stats(x["h"], x["r"], x["wlm"], x["tgt"], kernel_impl)
  ct = normal(jax.random.fold_in(key, 1), (128,)) if reduction == "none" else 0.75
  _, grads = _check(x, -100, reduction, kernel_impl, ct, chunk_rows, wlm_layout=wlm_layout,
                    head_grad=head_grad)
  assert grads[2].shape == (D, V_ODD)


@pytest.mark.parametrize("reduction, head_grad, gemms",
                         [("mean", "logits", 3), ("none", "logits", 4), ("mean", "exp", 4)])
def test_hub_gpt2_vocabulary_lowers_to_kernels_for_an_h100(reduction, head_grad, gemms):
  """GPT-2's vocabulary of 50257 (tied, (V, D)) exported for CUDA as an H100 runs it
  (``bench.lowering_time``: Mosaic GPU lowers without a GPU): the loss's gradient
  traces its 3 (scalar loss) or 4 (per-row) vocabulary-sized GEMMs as kernels, where
  without the padding the dispatch would fall back to XLA and trace none."""
  from bench.lowering_time import export_time
  m, d, v = 1024, 768, 50257
  shapes = (jax.ShapeDtypeStruct((m, d), jnp.bfloat16), jax.ShapeDtypeStruct((m,), jnp.float32),
            jax.ShapeDtypeStruct((v, d), jnp.bfloat16), jax.ShapeDtypeStruct((m,), jnp.int32))
  loss = lambda h, r, w, t: jnp.sum(F.rmsnorm_lm_head_loss(h, r, w, t, reduction=reduction,
                                                           wlm_layout="vd",
                                                           head_grad=head_grad))
  assert export_time(jax.grad(loss, (0, 1, 2)), *shapes)["gemms_traced"] == gemms


def test_targets_in_the_vocabulary_padding_are_nan(key, kernel_impl):
  """Targets V and V + 5 fall on pad columns of the padded head: still outside the
  vocabulary, so their rows' loss is NaN and they pass no gradient (as any target
  outside [0, V)); the other rows are untouched."""
  x = _inputs(key, 128, D, V_ODD, -100)
  bad = np.array([2, 9])
  tgt = x["tgt"].at[bad].set(jnp.array([V_ODD, V_ODD + 5]))
  loss = lambda h: F.rmsnorm_lm_head_loss(h, x["r"], x["wlm"], tgt, reduction="none",
                                          impl=kernel_impl)
  got, vjp = jax.vjp(loss, x["h"])
  got = np.asarray(got)
  assert np.all(np.isnan(got[bad]))
  assert np.all(np.isfinite(np.delete(got, bad)))
  (dh,) = vjp(jnp.ones_like(got))
  assert np.all(np.asarray(dh, np.float32)[bad] == 0)
  assert np.all(np.isfinite(np.asarray(dh, np.float32)))


def test_bad_head_layout(key):
  x = _inputs(key, 64, D, V, -100)
  with pytest.raises(ValueError, match="wlm_layout='dvv'"):
    F.rmsnorm_lm_head_loss(x["h"], x["r"], x["wlm"], x["tgt"], wlm_layout="dvv")
  with pytest.raises(ValueError, match="wlm"):  # (D, V) passed as "vd": D != h's width
    F.rmsnorm_lm_head_loss(x["h"], x["r"], x["wlm"], x["tgt"], wlm_layout="vd")


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_targets_ignored(reduction, key):
  """Every target ignored: loss 0 (per row for "none"), exactly zero gradients, nothing
  NaN (the mean divides by max(count, 1)). impl="xla": the reduction logic is XLA code
  around the kernels, and the kernels' zero-weight rows are covered by the
  first_chunk_all_ignored case of test_loss_and_grads."""
  x = _inputs(key, 128, D, V, -100)
  x["tgt"] = jnp.full((128,), -100, jnp.int32)
  fused = lambda h, r, w: F.rmsnorm_lm_head_loss(h, r, w, x["tgt"], reduction=reduction,
                                                 impl="xla")
  ct = jnp.ones((128,)) if reduction == "none" else 1.0
  loss, grads = jax.jit(lambda *a: (fused(*a), jax.grad(lambda *b: jnp.sum(fused(*b) * ct),
                                                        (0, 1, 2))(*a)))(
      x["h"], x["r"], x["wlm"])
  assert np.array_equal(np.asarray(loss), np.zeros(np.shape(loss))), loss
  assert loss.shape == ((128,) if reduction == "none" else ())
  for a in grads:
    assert np.array_equal(np.asarray(a, np.float32), np.zeros(a.shape)), a


@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_default_chunking_three_chunks(key, monkeypatch, reduction):
  """The default chunk sizing (chunk_rows=None) with a budget that holds 256 rows of
  16-bit logits but not 512: M = 768 runs as 3 chunks of 256 rows (row_chunks' answer
  and the row count each traced kernel call sees), and every row's loss and gradient
  matches the float64 / fp32 truth, the last chunk's included. "none" recomputes the
  logits in the backward, "mean" forms the gradient in the forward. impl="xla": the
  chunking is fused_ops code around the kernels, which other tests run chunked."""
  m, d, v = 768, 64, 128
  chunks, kernel_rows = [], []
  row_chunks = S.row_chunks

  def small_budget(m_, v_, chunk_rows, budget_bytes=1 << 30, buffers=1):
    # room for 256 rows of each buffer the path holds (1 recomputing, 2 forward-formed)
    chunks.append(row_chunks(m_, v_, chunk_rows, budget_bytes=256 * v_ * 2 * buffers,
                             buffers=buffers))
    return chunks[-1]

  def spy(fn):
    def wrapped(h, *a, **kw):
      kernel_rows.append((fn.__name__, h.shape[0]))
      return fn(h, *a, **kw)
    return wrapped

  monkeypatch.setattr(S, "row_chunks", small_budget)
  for name in ("lm_head_stats", "xent_logits_grad", "lm_head_logits"):
    monkeypatch.setattr(S, name, spy(getattr(S, name)))
  x = _inputs(key, m, d, v, -100)
  ct = normal(jax.random.fold_in(key, 1), (m,)) if reduction == "none" else 0.75
  _check(x, -100, reduction, "xla", ct)
  assert chunks and set(chunks) == {256}, chunks  # one call per trace (forward, grad)
  assert m // chunks[0] == 3
  want = ({("lm_head_stats", 256), ("xent_logits_grad", 256)} if reduction == "none" else
          {("lm_head_stats", 256), ("lm_head_logits", 256)})  # the loss alone; its gradient
  assert set(kernel_rows) == want, kernel_rows


def test_one_chunk_live_at_a_time(key):
  """The forward-formed head gradient runs its chunks one after another: the compiled
  step's temporaries hold about one chunk's logits and dlogits, not all of them (a chunk
  loop written out let XLA schedule chunks side by side: 291 MiB of temporaries here,
  and 9.0 GiB of peak at 1B on the H100). XLA program on the CPU: 8 chunks of
  512 x 16384; the bound is two chunks' fp32 and 16-bit arrays and three fp32 dWs."""
  m, d, v, rows = 4096, 256, 16384, 512
  h = normal(key, (m, d), jnp.bfloat16)
  w = (normal(jax.random.fold_in(key, 1), (d, v)) * d ** -0.5).astype(jnp.bfloat16)
  t = jax.random.randint(jax.random.fold_in(key, 2), (m,), 0, v)
  r = jnp.ones((m,), jnp.float32)
  grad = jax.grad(lambda h, w: F.rmsnorm_lm_head_loss(h, r, w, t, chunk_rows=rows,
                                                       impl="xla"), argnums=(0, 1))
  temp = jax.jit(grad).lower(h, w).compile().memory_analysis().temp_size_in_bytes
  bound = 2 * rows * v * (4 + 2 + 2) + 3 * d * v * 4
  assert temp <= bound, (temp / 2**20, bound / 2**20)


def test_row_chunks_odd_token_counts():
  """Chunks at the 1B vocabulary under the default 1 GiB budget: a multiple of 256
  where M has one, else of 64 or 8; M itself when it fits or has no such divisor; half
  as many rows for a path that holds two (rows, V) buffers."""
  v = 128256
  assert S.row_chunks(16384, v, None) == 4096
  assert S.row_chunks(16000, v, None) == 3200  # 2^7 * 125: no multiple of 256 divides it
  assert S.row_chunks(4000, v, None) == 4000  # fits whole
  assert S.row_chunks(16001, v, None) == 16001  # 16001 = 16001: prime, one chunk
  # the forward-formed gradient holds the logits and dlogits: half the rows
  assert S.row_chunks(16384, v, None, buffers=2) == 2048
  with pytest.raises(ValueError, match="chunk_rows=300"):
    S.row_chunks(1000, v, 300)


@pytest.mark.parametrize("reduction, head_grad, lm_gemms",
                         [("mean", "logits", 3), ("sum", "logits", 3), ("mean", "exp", 4),
                          ("sum", "auto", 4), ("none", "auto", 4)])
@pytest.mark.parametrize("op", ["fused_op", "post_block"])
def test_lm_head_gemm_count(monkeypatch, reduction, head_grad, lm_gemms, op):
  """The LM head's forward+backward costs 3 vocabulary-sized GEMMs per chunk for a
  scalar loss (logits, dh, dW: its gradient is formed while the logits are at hand)
  and 4 for a per-row loss (the backward recomputes the logits). Counted on the traced
  gradient: gemm_epilogue calls with an operand V wide. The "exp" head (the default
  for bfloat16) traces its logits GEMM twice, once in each branch of the ``lax.cond``
  that reruns a chunk outside exp's range (docs/lm_head_exp_store.md): one of the two
  runs, so it too costs 3."""
  from coda_jax import blocks
  m, d, v, f = 128, 64, 320, 128
  calls = []
  real = S.gemm_epilogue

  def counting(a, b, *args, **kw):
    if v in a.shape + b.shape:
      calls.append(tuple(type(p).__name__ for p in args[0]))
    return real(a, b, *args, **kw)

  monkeypatch.setattr(S, "gemm_epilogue", counting)
  ks = jax.random.split(jax.random.PRNGKey(0), 8)
  tgt = jax.random.randint(ks[0], (m,), 0, v)
  ct = jnp.ones((m,)) if reduction == "none" else 1.0
  if op == "fused_op":
    h = normal(ks[1], (m, d), jnp.bfloat16)
    fn = lambda h, w: jnp.sum(ct * F.rmsnorm_lm_head_loss(
        h, jnp.ones((m,)), w, tgt, reduction=reduction, chunk_rows=64, impl="xla",
        head_grad=head_grad))
    args = (h, normal(ks[2], (d, v)))
  else:
    cfg = blocks.BlockConfig(n_q_heads=2, n_kv_heads=1, head_dim=32, reduction=reduction,
                             lm_chunk_rows=64, impl="xla", head_grad=head_grad)
    params = {k: normal(ks[3], shape) for k, shape in (
        ("wo", (64, d)), ("g_mlp", (d,)), ("w13", (d, 2 * f)), ("w2", (f, d)),
        ("g_final", (d,)), ("wlm", (d, v)))}
    x0, y0 = normal(ks[4], (m, d), jnp.bfloat16), normal(ks[5], (m, 64), jnp.bfloat16)
    fn = lambda x0, p: jnp.sum(ct * blocks.post_block(x0, y0, tgt, p, cfg))
    args = (x0, params)
  jax.make_jaxpr(jax.grad(fn, (0, 1)))(*args)
  # 2 chunks of 64 rows, each loop a scan or a map: one trace of each chunk's GEMMs
  assert len(calls) == lm_gemms, calls
  if reduction != "none" and F.resolve_head_grad(head_grad, jnp.bfloat16) == "exp":
    assert calls[0] == calls[1] and "ExpShifted" in calls[0], calls  # the cond's branches


@pytest.mark.parametrize("ignore_index", [-100, 0])
def test_out_of_range_targets_are_nan(key, kernel_impl, ignore_index):
  """Targets V, V + 3 and -5 (and -100 when it is not the ignore index): that row's loss
  is NaN on the fused path (kernel and XLA program) and on the reference, the other rows
  are unchanged, a mean is NaN, and the gradient equals the one with those rows ignored
  (no gradient from a NaN row, none in the others)."""
  m = 128
  x = _inputs(key, m, D, V, ignore_index)
  bad_t = np.asarray(x["tgt"]).copy()
  bad_rows = np.zeros(m, bool)
  for row, t in ((5, V), (17, V + 3), (40, -5), (77, -100 if ignore_index != -100 else -7)):
    bad_t[row], bad_rows[row] = t, True
  bad = jnp.asarray(bad_t, jnp.int32)
  skipped = jnp.asarray(np.where(bad_rows, ignore_index, bad_t), jnp.int32)
  args = (x["h"], x["r"], x["wlm"])
  ct = normal(jax.random.fold_in(key, 1), (m,))

  def per_row(impl, targets):
    if impl == "reference":
      return lambda h, r, w: R.rmsnorm_lm_head_loss(h, r, w, targets, ignore_index, "none")
    return lambda h, r, w: F.rmsnorm_lm_head_loss(h, r, w, targets, ignore_index=ignore_index,
                                                  reduction="none", impl=impl)
  for impl in ("reference", "xla", kernel_impl):
    got = np.asarray(per_row(impl, bad)(*args))
    assert np.all(np.isnan(got[bad_rows])), impl
    clean = np.asarray(per_row(impl, skipped)(*args))
    np.testing.assert_allclose(got[~bad_rows], clean[~bad_rows], rtol=1e-6, err_msg=impl)
    if impl != "reference":
      mean = F.rmsnorm_lm_head_loss(*args, bad, ignore_index=ignore_index, impl=impl)
      assert np.isnan(float(mean)), impl
    g_bad = jax.grad(lambda *a: jnp.sum(per_row(impl, bad)(*a) * ct), (0, 1, 2))(*args)
    g_skip = jax.grad(lambda *a: jnp.sum(per_row(impl, skipped)(*a) * ct), (0, 1, 2))(*args)
    for nm, a, b in zip(("dh", "dr", "dwlm"), g_bad, g_skip):
      assert np.all(np.isfinite(np.asarray(a, np.float32))), (impl, nm)
      np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                 rtol=1e-5, atol=1e-6, err_msg=f"{impl} {nm}")
