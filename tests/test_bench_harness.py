"""The block benchmarks' harness on the CPU: at tiny shapes, with our ops on their XLA
programs, every row of bench/family_blocks.py is measured without error, and its
standard-written XLA baseline computes the same block as ours: the truth is the
baseline's math run in fp32, and ours is within the tolerance rule's 2x of the bf16
baseline's error from it (a baseline that computed something else would put ours far
from its truth, and make the GPU speed ratios meaningless)."""
import argparse

import jax
import pytest

from bench import block as B
from bench import common
from bench import family_blocks as fb
import pallas_kernels
from pallas_kernels import autotune


@pytest.mark.parametrize("name", ["gpt2_tiny", "qwen3_tiny"])
def test_family_block_rows(name):
  rows = fb.run_shape(name, fb.SHAPES[name], "xla", B.timer(False, 1),
                      common.provenance(), jax.random.key(0), rounds=2)
  assert [r["op"] for r in rows] == [f"{name.split('_')[0]}_block_fwd",
                                     f"{name.split('_')[0]}_block_fwd_bwd"]
  for r in rows:
    assert "error" not in r, r["error"]
    assert len(r["speedup_rounds"]) == len(r["ours_ms_rounds"]) == 2, r
    ours, xla = r["ours_err_vs_fp32"], r["baseline_err_vs_fp32"]
    assert 0 < ours <= 2 * xla, (r["op"], ours, xla)
    assert r["rel_diff_vs_baseline"] < 0.05, (r["op"], r["rel_diff_vs_baseline"])


def _assert_measured_within_rule(rows):
  """Every row ran, and ours is within the tolerance rule (2x the baseline's error)."""
  for r in rows:
    assert "error" not in r, r["error"]
    assert 0 < r["ours_err_vs_fp32"] <= 2 * r["baseline_err_vs_fp32"], r["op"]


def test_gpt2_rows_one_pair_per_mlp_residuals():
  """``bench.family_blocks --mlp-residuals slope,recompute``: GPT-2's forward and
  forward+backward once per way of keeping the MLP's hidden layer, each row naming it
  and within the tolerance rule; Qwen3's rows do not multiply."""
  rows = fb.run_shape("gpt2_tiny", fb.SHAPES["gpt2_tiny"], "xla", B.timer(False, 1),
                      common.provenance(), jax.random.key(0),
                      mlp_residuals=("slope", "recompute"))
  assert [(r["op"], r["mlp_residuals"]) for r in rows] == [
      ("gpt2_block_fwd", "slope"), ("gpt2_block_fwd_bwd", "slope"),
      ("gpt2_block_fwd", "recompute"), ("gpt2_block_fwd_bwd", "recompute")]
  assert "(MLP keeps recompute)" in B.op_cell(rows[-1])
  _assert_measured_within_rule(rows)
  qwen = fb.run_shape("qwen3_tiny", fb.SHAPES["qwen3_tiny"], "xla", B.timer(False, 1),
                      common.provenance(), jax.random.key(0),
                      mlp_residuals=("slope", "recompute"))
  assert len(qwen) == 2 and all("mlp_residuals" not in r for r in qwen)


def test_gated_mlp_rows_one_pair_per_residuals():
  """``bench.family_blocks --gated-mlp-residuals output,recompute`` (Qwen3) and
  ``bench.block --mlp-residuals output,recompute`` (Llama's shifted block): a row per way
  of keeping the gated MLP's output (``BlockConfig.mlp_residuals``), each naming it and
  within the tolerance rule; GPT-2's rows do not multiply."""
  qwen = fb.run_shape("qwen3_tiny", fb.SHAPES["qwen3_tiny"], "xla", B.timer(False, 1),
                      common.provenance(), jax.random.key(0),
                      gated_mlp_residuals=("output", "recompute"))
  llama = B.run_shape("tiny", B.SHAPES["tiny"], "xla", B.timer(False, 1),
                      common.provenance(), jax.random.key(0), {"shifted_block_fwd_bwd"},
                      mlp_residuals=("output", "recompute"))
  assert [(r["op"], r["mlp_residuals"]) for r in qwen + llama] == [
      ("qwen3_block_fwd", "output"), ("qwen3_block_fwd_bwd", "output"),
      ("qwen3_block_fwd", "recompute"), ("qwen3_block_fwd_bwd", "recompute"),
      ("shifted_block_fwd_bwd", "output"), ("shifted_block_fwd_bwd", "recompute")]
  assert "(MLP keeps recompute)" in B.op_cell(llama[-1])
  _assert_measured_within_rule(qwen + llama)
  gpt2 = fb.run_shape("gpt2_tiny", fb.SHAPES["gpt2_tiny"], "xla", B.timer(False, 1),
                      common.provenance(), jax.random.key(0),
                      gated_mlp_residuals=("output", "recompute"))
  assert len(gpt2) == 2 and all("mlp_residuals" not in r for r in gpt2)


@pytest.mark.parametrize("field,values,cell", [
    ("ln1_stats", ("gemm", "xla"), "(LN_1 stats from xla)"),
    ("half_block", ("shifted_op", "one_op", "two_ops"), "(half block as two ops)")])
def test_gpt2_rows_one_pair_per_variant(field, values, cell):
  """``bench.family_blocks --ln1-stats gemm,xla`` (the next LN_1's statistics from the
  MLP's output GEMM or an XLA pass) and ``--half-block shifted_op,one_op,two_ops`` (the
  out-projection, the MLP and the next QKV as one op, the first two as one op, or three
  ops): GPT-2's rows once per variant, naming it and no other, all within the tolerance
  rule of the same baseline and computing the same block."""
  kw = {field: values}
  if field == "ln1_stats":  # the shifted op makes LN_1's statistics itself
    kw["half_block"] = ("one_op",)
  rows = fb.run_shape("gpt2_tiny", fb.SHAPES["gpt2_tiny"], "xla", B.timer(False, 1),
                      common.provenance(), jax.random.key(0), **kw)
  assert [(r["op"], r[field]) for r in rows] == [
      (op, v) for v in values for op in ("gpt2_block_fwd", "gpt2_block_fwd_bwd")]
  others = {"mlp_residuals", "ln1_stats", "half_block"} - {field}
  assert all(not others & set(r) for r in rows)
  assert cell in B.op_cell(rows[-1])
  _assert_measured_within_rule(rows)
  for r in rows:
    assert r["rel_diff_vs_baseline"] < 0.05, (r["op"], r["rel_diff_vs_baseline"])


def test_post_block_rows_one_per_head():
  """``bench.block`` times the post-block once per requested way of forming the LM
  head's gradient, each row naming its head, both within the tolerance rule of the
  same XLA baseline; an unknown head is refused before anything runs."""
  rows = B.run_shape("tiny", B.SHAPES["tiny"], "xla", B.timer(False, 1),
                     common.provenance(), jax.random.key(0), {"post_block_fwd_bwd"},
                     head_grads=("logits", "exp"))
  assert [(r["op"], r["head_grad"]) for r in rows] == [
      ("post_block_fwd_bwd", "logits"), ("post_block_fwd_bwd", "exp")]
  for r in rows:
    assert "error" not in r, r["error"]
    assert 0 < r["ours_err_vs_fp32"] <= 2 * r["baseline_err_vs_fp32"], r
  assert "(exp head)" in B.markdown(rows, common.provenance(), False)
  with pytest.raises(ValueError, match="head_grads"):
    B.run_shape("tiny", B.SHAPES["tiny"], "xla", B.timer(False, 1), common.provenance(),
                jax.random.key(0), {"post_block_fwd_bwd"}, head_grads=("softmax",))


def test_timed_rounds_alternate_and_take_medians():
  """``bench.block.timed_rounds`` times ours and XLA's block ABBA: on a machine that
  slows down steadily, the rounds' ratios straddle the true one and their median is it,
  where timing ours then XLA once would be off by the drift."""
  calls, clock = [], iter(range(100))

  def measure(fn, *args):  # each call 1% slower than the last; XLA's block 1.05x ours
    calls.append(fn.__name__)
    ms = (1.05 if fn.__name__ == "xla" else 1.0) * (1 + 0.01 * next(clock))
    return ms, [(fn.__name__, ms)], fn(*args), None  # no sustained window

  def ours(a):
    return a + 1

  def xla(a):
    return a + 2

  res = B.timed_rounds(measure, ours, (1,), xla, (1,), rounds=4)
  assert calls == ["ours", "xla", "xla", "ours", "ours", "xla", "xla", "ours"], calls
  assert (res["got"], res["want"]) == (2, 3)
  assert res["ours_kernels"] == [("ours", 1.0)] and res["baseline_kernels"][0][0] == "xla"
  assert len(res["speedup_rounds"]) == 4
  assert min(res["speedup_rounds"]) < 1.05 < max(res["speedup_rounds"])
  assert abs(res["speedup_vs_baseline"] - 1.05) < 2e-3, res["speedup_vs_baseline"]
  once = B.timed_rounds(measure, ours, (1,), xla, (1,))
  assert "speedup_rounds" not in once and once["speedup_vs_baseline"] > 1.05
  assert "rounds: " in B.speedup_cell(res) and "rounds" not in B.speedup_cell(once)
  with pytest.raises(ValueError, match="rounds=0"):
    B.timed_rounds(measure, ours, (1,), xla, (1,), rounds=0)


def test_hlo_copies_lists_the_steps_copies():
  """``bench.step_profile.hlo_copies`` finds a module's copy instructions (plain and async),
  sizes them, sorts them, and leaves out copies inside a fusion (part of its kernel)."""
  from bench.step_profile import hlo_copies
  text = """HloModule m

%fused_computation.1 (p: f32[4,4]) -> f32[4,4] {
  %p = f32[4,4]{1,0} parameter(0)
  ROOT %copy.9 = f32[4,4]{0,1} copy(f32[4,4]{1,0} %p)
}

ENTRY %main.5 (a: f32[4096,128256], b: bf16[8,16]) -> f32[4096,128256] {
  %a = f32[4096,128256]{1,0} parameter(0)
  %b = bf16[8,16]{1,0} parameter(1)
  %copy.1 = bf16[8,16]{1,0} copy(bf16[8,16]{1,0} %b)
  %copy-start.2 = (f32[4096,128256]{1,0}, f32[4096,128256]{1,0}, u32[]) copy-start(f32[4096,128256]{1,0} %a)
  %fusion.3 = f32[4,4]{0,1} fusion(f32[4,4]{1,0} %x), kind=kLoop, calls=%fused_computation.1
  ROOT %copy-done.2 = f32[4096,128256]{1,0} copy-done(%copy-start.2)
}
"""
  assert hlo_copies(text) == [("copy-start.2", "f32", (4096, 128256), 4096 * 128256 * 4),
                              ("copy.1", "bf16", (8, 16), 256)]


def test_lowering_time_lowers_each_lm_head_kernel_once():
  """bench/lowering_time.py exports the post-block for an H100 from the CPU, and the LM
  head's kernels are traced (so lowered) once whatever the number of chunks: with the
  chunks written out, the 8B training step took 134 s to compile on the H100, against
  74 s with one scan (docs/tuning.md)."""
  from bench import lowering_time as lt
  two, four = lt.post_block("tiny", 128), lt.post_block("tiny", 64)  # M = 256 rows
  assert two["gemms_traced"] == four["gemms_traced"] > 0, (two, four)
  assert two["seconds"] > 0 and two["module_mb"] > 0, two


def _listed(monkeypatch, capsys, prefix, *args):
  """``bench.tune_gemm --list *args`` on the CPU: its lines whose workload starts with
  ``prefix``, and the key of each."""
  import sys
  from bench import tune_gemm
  if jax.devices()[0].platform == "gpu":
    pytest.skip("this checks the CPU path of --list; on the GPU host it lists as tuning does")
  monkeypatch.setattr(sys, "argv", ["tune_gemm", "--list", *args])
  tune_gemm.main()
  lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith(prefix)]
  return lines, [l.split(": ", 1)[1] for l in lines]


def test_tune_gemm_lists_a_workloads_gemms_without_a_gpu(monkeypatch, capsys):
  """``bench.tune_gemm --list`` traces a workload as an H100 would run it, on any machine,
  so that a session can plan its device time (which GEMMs to tune or time) before it has
  a GPU; without --list it still refuses to run off the GPU."""
  import sys
  from bench import tune_gemm
  lines, keys = _listed(monkeypatch, capsys, "1b ", "--workloads", "block-1b")
  assert len(keys) == len(set(keys)) >= 12, lines
  assert all(k.startswith("NVIDIA H100 80GB HBM3|") for k in keys), keys
  shapes = {tuple(k.split("|")[2:4]) for k in keys}
  # the fused MLP's up/gate GEMM, and the LM head's logits GEMM and its dW GEMM
  assert {("16384x16384x2048", "nn"), ("2048x128256x2048", "nn"),
          ("2048x128256x2048", "tn")} <= shapes, shapes
  monkeypatch.setattr(sys, "argv", ["tune_gemm", "--workloads", "block-1b"])
  with pytest.raises(SystemExit, match="run it on the GPU host"):
    tune_gemm.main()


def test_tune_gemm_lists_how_many_configs_an_entry_timed(monkeypatch):
  """``--list``'s source of a problem's config: for an entry at the problem's own key,
  how many configs its search timed (a narrow entry is worth a whole search); other
  sources as ``lookup_with_source`` names them; "NOT TUNED" where none serves."""
  from bench import tune_gemm
  narrow, nearby, other = (autotune.plain_problem(m, 256, 256) for m in (256, 512, 768))
  cfg = narrow.default_config()
  served = {narrow.key: "tuned", nearby.key: "tuned at M=256 on NVIDIA H100 80GB HBM3"}
  monkeypatch.setattr(autotune, "lookup_with_source",
                      lambda key, clip_m=False: (cfg, served[key]) if key in served
                      else (None, None))
  entries = [(nearby.key, {"timed": 40}), (narrow.key, {"timed": 3})]
  monkeypatch.setattr(autotune, "cached_entries", lambda: iter(entries))
  assert tune_gemm.listed_source(narrow) == "tuned, 3 configs timed"
  assert tune_gemm.listed_source(nearby) == "tuned at M=256 on NVIDIA H100 80GB HBM3"
  assert tune_gemm.listed_source(other) == "NOT TUNED"
  entries[1] = (narrow.key, {})  # an entry written before the count was recorded
  assert tune_gemm.listed_source(narrow) == "tuned"


def test_heuristic_ab_constants_and_output_totals():
  """``bench.heuristic_ab``: knobs parse to gemm_mgpu's constants' types and are put
  back; outputs whose partials differ in count between configs compare as totals (an
  LSE's as the row's log-sum-exp)."""
  import numpy as np
  from bench import heuristic_ab as H
  from pallas_kernels import gemm_mgpu
  knobs = H.parse_constants("TALL_TILE_MAX_K=0,TALL_TILE_MAX_WASTE=0.5")
  assert knobs == {"TALL_TILE_MAX_K": 0, "TALL_TILE_MAX_WASTE": 0.5}
  assert type(knobs["TALL_TILE_MAX_K"]) is int
  with pytest.raises(SystemExit, match="CONST=VALUE"):
    H.parse_constants("NO_SUCH_KNOB=1")
  before = gemm_mgpu.TALL_TILE_MAX_K
  with H.constants({"TALL_TILE_MAX_K": 0}):
    assert gemm_mgpu.default_config(12288, 4096, 1024).tile_m == 128
  assert gemm_mgpu.TALL_TILE_MAX_K == before
  assert gemm_mgpu.default_config(12288, 4096, 1024).tile_m == 192
  x = np.random.default_rng(0).normal(size=(64, 10)) * 5  # 64 columns, 10 rows

  rest = np.arange(64)[:, None] != 5  # a RowLogSumExp's rest: all columns but one

  def partials(parts, scale=1.0):
    xs = np.split(x * scale, parts, axis=0)
    keep = np.split(rest, parts, axis=0)
    return {"lse_max": np.stack([p.max(0) for p in xs]),
            "lse_sumexp": np.stack([np.exp(p - p.max(0)).sum(0) for p in xs]),
            # relative to lse_max, as RowLogSumExp stores it (there is no lse_rest_max)
            "lse_rest_sumexp": np.stack([(np.exp(p - p.max(0)) * k).sum(0)
                                         for p, k in zip(xs, keep)]),
            "c": np.stack([p.sum(0) for p in xs])}

  assert H.max_rel_diff(partials(2), partials(4)) < 1e-12
  assert H.max_rel_diff(partials(2, 1.01), partials(4)) > 1e-3
  whole = H.totals(partials(4), whole=True)
  want = np.log(np.exp(x - x.max(0)).sum(0)) + x.max(0)
  np.testing.assert_allclose(whole["lse_sumexp"], want, rtol=1e-12)
  want_rest = np.log((np.exp(x - x.max(0)) * rest).sum(0)) + x.max(0)
  np.testing.assert_allclose(whole["lse_rest_sumexp"], want_rest, rtol=1e-12)
  unpaired = {"lse_sumexp": partials(4)["lse_sumexp"], "c": partials(4)["c"]}
  with pytest.raises(ValueError, match="lse_sumexp"):
    H.totals(unpaired, whole=True)
  # an overflowed exp: the same inf in both compares equal; inf in one only does not
  y = np.array([1.0, np.inf, 2.0])
  assert H.rel_diff(y.copy(), y) == 0.0
  assert H.rel_diff(np.array([1.0, 3.0, 2.0]), y) == np.inf
  assert H.rel_diff(np.array([1.0, -np.inf, 2.0]), y) == np.inf
  assert H.rel_diff(np.array([1.5, np.inf, 2.0]), y) > 0.1


def test_heuristic_ab_refuses_off_the_gpu():
  """``bench.heuristic_ab`` off the GPU refuses to run, naming where to run it. On the GPU
  host its ``main`` would run the whole A/B (minutes of kernels): there this case is
  skipped, with the reason printed."""
  from bench import heuristic_ab as H
  if jax.devices()[0].platform == "gpu":
    pytest.skip("this checks the refusal off the GPU; on the GPU host heuristic_ab's main "
                "runs its whole A/B")
  with pytest.raises(SystemExit, match="run it on the GPU host"):
    H.main(["--base", "TALL_TILE_MAX_K=0"])


def test_tune_gemm_lists_the_train_steps_gemms(monkeypatch, capsys):
  """The ``train-CONFIG:LAYERS:BATCH`` workload traces the main job's fused step (its
  weight gradients accumulated in fp32, which the block workloads do not trace), and
  ``--match`` keeps the problems whose key matches."""
  lines, keys = _listed(monkeypatch, capsys, "train tiny:1:2 ", "--workloads", "train-tiny:1:2")
  assert len(keys) >= 8, lines
  # 2 rows of 2048 tokens: M = 4096; the LM head's dW accumulates in place in fp32
  assert any(k.split("|")[2].startswith("4096x") for k in keys), keys
  assert any("in_place=dw<acc" in k and "dw:tile:float32" in k for k in keys), keys
  # the SwiGLU backward writes dz to a fresh buffer: in the layer scan z is a slice of the
  # stacked residuals, and a write over it made XLA copy the slice out each layer
  gated = [k for k in keys if "GatedGrad(" in k]
  assert gated and all(";in_place=;" in k for k in gated), gated
  assert all(l.split(": ", 1)[0].endswith(("[tuned]", "[NOT TUNED]")) for l in lines)
  _, matched = _listed(monkeypatch, capsys, "train tiny:1:2 ", "--workloads", "train-tiny:1:2",
                       "--match", r"\|tn\|")
  assert matched and all(k.split("|")[3] == "tn" for k in matched), matched
  assert len(matched) < len(keys)


@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
def test_step_gemms_xla_dot_orders(trans_a, trans_b):
  """bench.step_gemms' cuBLAS baseline multiplies in the problem's operand order and
  returns the product in the operands' dtype (one dot, no separate convert)."""
  import numpy as np
  import jax.numpy as jnp
  from bench import step_gemms
  ka, kb = jax.random.split(jax.random.key(3))
  a = jax.random.normal(ka, (40, 24), jnp.float32)
  b = jax.random.normal(kb, (24, 16), jnp.float32)
  with jax.default_matmul_precision("float32"):  # not TF32 on a GPU: this checks orders
    got = step_gemms.xla_dot(a.T if trans_a else a, b.T if trans_b else b, trans_a, trans_b)
  np.testing.assert_allclose(got, np.asarray(a) @ np.asarray(b), rtol=2e-5, atol=2e-5)
  bf = step_gemms.xla_dot(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), False, False)
  assert bf.dtype == jnp.bfloat16 and bf.shape == (40, 16)


def test_step_gemms_table():
  from bench import step_gemms
  prov = dict(device="dev", jax_version="0.11.2", commit="abc", command="cmd")
  rows = [dict(m=256, n=128, k=64, order="nt", program="Store(name='out')", config="cfg",
               config_source="tuned", ours_ms=2.0, our_plain_ms=1.6, xla_dot_ms=1.0,
               xla_kernels=["nvjet_x"], tflops_ours=1.0),
          dict(m=64, n=64, k=64, order="nn", program="P", error="ValueError: no")]
  md = step_gemms.markdown("w", rows, prov)
  row = [l for l in md.splitlines() if l.startswith("| 256x128x64")][0]
  # ours / XLA, plain / XLA, ours / plain
  assert "| 2.000 | 1.600 | 1.000 | 2.000 | 1.600 | 1.250 |" in row, row
  assert "FAILED: ValueError: no" in md and "`nvjet_x`" in md
  assert "| **sum** | | | | **2.000** | **1.600** | **1.000** |" in md, md


def test_compare_configs_variants_and_plain_problems():
  """bench.compare_configs: a variant's fields parse to GemmConfig values (enums by name,
  None, booleans, ints, num_sms and clip_m apart); bad ones name the field and the fix; a plain
  problem records the GEMM at its shape and operand order."""
  from bench import compare_configs as cc
  from pallas_kernels import MatDim, Schedule
  name, over, sms = cc.parse_variant(
      "pp=schedule=PINGPONG,cluster_dim=None,wg_dim=N,stages=5,epi_operand_slots=4,"
      "num_sms=64")
  assert (name, sms) == ("pp", 64)
  assert over == dict(schedule=Schedule.PINGPONG, cluster_dim=None, wg_dim=MatDim.N,
                      stages=5, epi_operand_slots=4)
  assert cc.parse_variant("pp192=tile_m=192,clip_m=True") == (
      "pp192", dict(tile_m=192, clip_m=True), None)
  with pytest.raises(ValueError, match="clip_m='yes' is not True or False"):
    cc.parse_variant("x=clip_m=yes")
  with pytest.raises(ValueError, match="'tile' is not a GemmConfig field"):
    cc.parse_variant("x=tile=128")
  with pytest.raises(ValueError, match="is not FIELD=VALUE"):
    cc.parse_variant("x=stages")
  with pytest.raises(ValueError, match="expected NAME=FIELD=VALUE"):
    cc.parse_variant("stages")
  where, problem = cc.plain_problem("512x256x128:tn")
  k = problem.key
  assert (where, k.m, k.n, k.k, k.trans_a, k.trans_b) == (
      "plain 512x256x128:tn", 512, 256, 128, True, False)
  assert problem.a.shape == (128, 512) and problem.b.shape == (128, 256)
  with pytest.raises(ValueError, match="expected MxNxK:ORDER"):
    cc.plain_problem("512x256:nn")


def test_compare_configs_deeper_only(monkeypatch):
  """``--deeper-only``'s test: a variant counts where, stages lowered until it fits, it
  runs more stages than the chosen config; one slot per output does not, at the stages
  the config has or where the deepest pipeline is already as deep as one slot allows."""
  import dataclasses
  from bench import compare_configs as cc
  from pallas_kernels import GemmConfig, Schedule
  _, problem = cc.plain_problem("4096x4096x2048:nt")
  pp = GemmConfig(schedule=Schedule.PINGPONG, tile_n=128, epi_tile_n=32, stages=4)
  chosen = [pp]
  monkeypatch.setattr(autotune, "chosen_config", lambda pr: (chosen[0], "tuned"))
  assert cc.deepens(problem, {"stages": 7})  # 4 of a possible 6
  assert cc.deepens(problem, {"stages": 7, "clip_m": True})  # clip_m is the problem's
  assert not cc.deepens(problem, {"epi_out_slots": 1})  # still 4
  assert not cc.deepens(problem, {"epi_out_slots": 0})  # not a config: not deeper
  deepest = problem.deepest_fitting(dataclasses.replace(pp, stages=7))
  chosen[0] = deepest
  assert deepest.stages == 6 and not cc.deepens(problem, {"epi_out_slots": 1, "stages": 7})


def _fake_timed_calls():
  """(now, order, call): a fake clock ([seconds]), the names of the calls made, in order,
  and ``call(name, cost)``: a function of no arguments that records its name and
  advances the clock by ``cost`` seconds."""
  now, order = [0.0], []
  def call(name, cost):
    def fn():
      order.append(name)
      now[0] += cost
      return name
    return fn
  return now, order, call


def test_compare_configs_sustained_windows():
  """``--sustained-s``: an untimed warm-up window of the first call, then each call sized
  from its first run, windows in the order given then reversed, each window's time per
  call averaged; a call's time is what the fake clock advances."""
  from bench import compare_configs as cc
  now, order, call = _fake_timed_calls()
  a, b = 2.0 ** -10, 2.0 ** -8  # seconds a call, exact in binary
  got = cc.sustained_ms({"a": call("a", a), "b": call("b", b)}, 20 * a,
                        sync=lambda x: x, clock=lambda: now[0])
  assert got == {"a": common.Sustained(a * 1e3, 40), "b": common.Sustained(b * 1e3, 10)}
  assert got["a"].joules is None  # no power log, no energy
  # the warm-up window (a, as long as a timed one), then each window: one sizing call,
  # then its calls; a, b, b, a
  assert order == ["a"] * 21 + (["a"] * 21 + ["b"] * 6 + ["b"] * 6 + ["a"] * 21)
  order.clear()
  again = cc.sustained_ms({"a": call("a", a), "b": call("b", b)}, 20 * a,
                          sync=lambda x: x, clock=lambda: now[0], warmup_s=0)
  assert again == got and order == ["a"] * 21 + ["b"] * 6 + ["b"] * 6 + ["a"] * 21
  with pytest.raises(ValueError, match="must be positive"):
    cc.sustained_ms({"a": call("a", a)}, 0)


def test_compare_configs_xla_dot_row(monkeypatch):
  """``--xla-dot``: after the base config, a row timing ``lax.dot_general`` at the
  problem's shape and operand order (here with our kernel stood in by XLA, sustained
  windows on the CPU, where no nvidia-smi gives power)."""
  from bench import compare_configs as cc
  from bench import step_gemms
  where, problem = cc.plain_problem("256x128x64:tn")
  ran = []
  def jitted(self, config, num_sms=None):
    ran.append(config)
    return jax.jit(lambda a, b, ops: step_gemms.xla_dot(a, b, True, False))
  monkeypatch.setattr(autotune.Problem, "jitted", jitted)
  rows, source = cc.run(problem, [], iterations=1, ncu=False, sustained_s=0.01,
                        xla_dot=True)
  assert [r["variant"] for r in rows] == ["base", cc.XLA_DOT] and len(ran) == 1
  assert "cuBLAS" in rows[1]["config"] and all(r["ms"] > 0 for r in rows)
  assert rows[1]["vs_base"] == rows[1]["ms"] / rows[0]["ms"]
  assert "watts" not in rows[0] and cc.power_cells(rows[0]) == "- | - | -"
  import dataclasses
  as_pass = dataclasses.replace(problem, key=dataclasses.replace(problem.key, k=0))
  rows, _ = cc.run(as_pass, [], iterations=1, ncu=False, sustained_s=0.01, xla_dot=True)
  assert "ms" in rows[0] and "no product" in rows[1]["error"]  # a pass has no product
  a, b, _ = problem.random_inputs(seed=1)
  want = jax.numpy.dot(a.T.astype("float32"), b.astype("float32"))
  got = step_gemms.xla_dot(a, b, True, False).astype("float32")
  assert common.rel_diff(got, want) < 1e-2


def test_power_log_windows():
  """``common.PowerLog``: readings are stamped with the log's clock as they arrive; a
  window averages those from its start plus the settling time to its end, none there
  gives None; the source is closed on exit; no source (no GPU): every window None."""
  import threading
  ticks, done, closed = iter([0.0, 0.1, 0.5, 0.9]), threading.Event(), []
  class Readings:
    field = "power.draw.instant"
    def __iter__(self):
      yield from [(1980.0, 130.0), (1500.0, 690.0), (1400.0, 700.0), (1300.0, 710.0)]
      done.set()
    def close(self):
      closed.append(True)
  with common.PowerLog(readings=lambda interval: Readings(), interval=0.1,
                       clock=lambda: next(ticks)) as log:
    assert done.wait(timeout=10)
  assert closed == [True] and log.field == "power.draw.instant"
  got = log.window(0.0, 0.6, settle_s=0.3)  # only the reading at 0.5
  assert got == dict(mhz=1400.0, watts=700.0, samples=1)
  got = log.window(0.0, 1.0, settle_s=0.05)  # 0.1, 0.5, 0.9
  assert got["samples"] == 3 and got["mhz"] == 1400.0 and got["watts"] == 700.0
  assert log.window(0.0, 0.2, settle_s=0.3) is None
  with common.PowerLog(readings=lambda interval: None) as none:
    pass
  assert none.window(0.0, 1e9, settle_s=0.0) is None and none.field is None
  import shutil
  if shutil.which("nvidia-smi") is None:  # this host: nothing to read, no thread
    assert common.nvidia_smi_readings(0.1) is None
  with pytest.raises(ValueError, match="interval"):
    common.PowerLog(interval=0)


def test_sustained_window_energy():
  """``back_to_back_ms`` with a power log: the window's clock and power, and energy per
  call = power x time per call; ``mean_sustained`` averages power only over the windows
  that have it."""
  now = [0.0]
  def call():
    now[0] += 2.0 ** -10
  class Fixed:
    def window(self, t0, t1):
      assert t1 > t0
      return dict(mhz=1450.0, watts=680.0, samples=7)
  got = common.back_to_back_ms(call, 2.0 ** -5, sync=lambda x: x, clock=lambda: now[0],
                               power=Fixed())
  assert (got.ms, got.calls, got.mhz, got.watts) == (2.0 ** -10 * 1e3, 32, 1450.0, 680.0)
  assert got.joules == pytest.approx(680.0 * 2.0 ** -10)
  both = common.mean_sustained([got, common.Sustained(3.0, 10)])
  assert (both.ms, both.calls, both.watts) == ((got.ms + 3.0) / 2, 42, 680.0)
  assert common.mean_sustained([common.Sustained(1.0, 3)]).joules is None


def test_block_timer_sustained_power():
  """``--sustained-s`` with power samples: each round's window power reaches the row as
  medians over the rounds, and the table gains a power section with XLA J / ours J."""
  class FakeLog:
    watts = iter([600.0, 700.0, 610.0, 690.0])  # ours, xla, xla, ours (ABBA)
    def __enter__(self):
      self.w = next(FakeLog.watts)
      return self
    def __exit__(self, *exc):
      pass
    def window(self, t0, t1):
      return dict(mhz=1500.0, watts=self.w, samples=5)
  measure = B.timer(True, 30, sustained_s=0.02, power_log=FakeLog)
  x = jax.numpy.arange(8.0)
  res = B.timed_rounds(measure, lambda v: v * 2, (x,), lambda v: v * 3, (x,), rounds=2)
  assert res["ours_watts"] == 645.0 and res["baseline_watts"] == 655.0
  assert res["ours_mhz"] == 1500.0 and res["ours_kernels"] is None
  assert res["ours_joules"] > 0 and res["baseline_joules"] > 0
  row = dict(shape="tiny", op="fwd", ours_ms=res["ours_ms"], baseline_ms=res["baseline_ms"],
             speedup_vs_baseline=res["speedup_vs_baseline"], ours_err_vs_fp32=0.0,
             baseline_err_vs_fp32=0.0, **{k: res[k] for k in res if k.endswith(
                 ("_mhz", "_watts", "_joules"))})
  md = B.markdown([row], common.provenance(), True, sustained_s=0.02)
  assert "| ours J per call |" in md
  assert f"{res['baseline_joules'] / res['ours_joules']:.3f} |" in md


def test_block_timer_sustained_mode(monkeypatch):
  """``--sustained-s``: the block benchmarks' timer gives wall clock per call over
  back-to-back calls, after an untimed window as long (no power read there), no
  per-kernel list, and the function's outputs (the timer's sustained path needs no
  CUPTI, so it runs here, pretending to be on a GPU)."""
  windows, real = [], common.back_to_back_ms
  def recorded(call, seconds, **kw):
    windows.append((seconds, kw.get("power") is not None))
    return real(call, seconds, **kw)
  monkeypatch.setattr(common, "back_to_back_ms", recorded)
  x = jax.numpy.arange(8.0)
  ms, kernels, out, window = B.timer(True, 30, sustained_s=0.05)(lambda v: v * 2, x)
  assert windows == [(0.05, False), (0.05, True)]
  assert ms > 0 and kernels is None
  assert (out == 2 * x).all()
  md = B.markdown([], common.provenance(), True, sustained_s=0.05)
  assert "over 0.05 s of back-to-back calls" in md


def test_tune_gemm_challengers():
  """``--challenge-tile-m`` (``-n``): the problem's current config first, then only the
  search's candidates that tall (wide); None where none tiles the problem."""
  from bench import tune_gemm
  problem = autotune.plain_problem(768, 512, 256, trans_b=True)
  current, _ = autotune.chosen_config(problem)
  configs = tune_gemm.challengers(problem, 192)
  assert configs[0] == current and current.tile_m != 192
  assert len(configs) > 1 and all(c.tile_m == 192 for c in configs[1:])
  assert tune_gemm.challengers(autotune.plain_problem(512, 512, 256, trans_b=True), 192) is None
  # --challenge-tile-n: the 192-column candidates (N a multiple of 192), of both schedules
  wide = autotune.plain_problem(512, 768, 256, trans_b=True)
  current, _ = autotune.chosen_config(wide)
  configs = tune_gemm.challengers(wide, None, tile_n=192)
  assert configs[0] == current and current.tile_n != 192
  assert all(c.tile_n == 192 for c in configs[1:])
  assert {c.schedule for c in configs[1:]} == set(pallas_kernels.Schedule)
  assert {c.cluster_dim for c in configs[1:]} == {pallas_kernels.MatDim.M, pallas_kernels.MatDim.N}
  assert tune_gemm.challengers(autotune.plain_problem(512, 512, 256, trans_b=True), None,
                               tile_n=192) is None
  # both: 192 x 192 warpgroup tiles are not in the search
  assert tune_gemm.challengers(wide, 192, tile_n=192) is None


def test_tune_gemm_variant_challenger(monkeypatch):
  """``--challenge-variant``: the problem's current config, then the same config with
  the fields replaced; None where the variant is the current config; the flag's text
  is checked before anything runs."""
  import dataclasses
  from bench import tune_gemm
  problem = autotune.plain_problem(768, 512, 256, trans_b=True)
  current, _ = autotune.chosen_config(problem)
  configs = tune_gemm.variant_challenger(problem, dict(epi_tile_n=16))
  assert configs == [current, dataclasses.replace(current, epi_tile_n=16)]
  assert current.epi_tile_n != 16
  assert tune_gemm.variant_challenger(problem, dict(epi_tile_n=current.epi_tile_n)) is None
  for bad, why in [("tile=128", "'tile' is not a GemmConfig field"),
                   ("num_sms=64", "only GemmConfig fields")]:
    monkeypatch.setattr("sys.argv", ["tune_gemm", "--list", "--challenge-variant", bad])
    with pytest.raises(SystemExit, match=why):
      tune_gemm.main()


def test_tune_gemm_keeps_the_entry_a_narrowed_run_keeps():
  """A challenge or ``--same-shape`` run that keeps the config ``--out``'s entry holds
  leaves the entry (and its record of the whole search) as it was; a whole search
  rewrites it, and so does any run that chose another config, kept one that differs
  from the entry, or finds no entry (or one it cannot read) at the key."""
  import dataclasses
  from bench import tune_gemm
  cfg = autotune.plain_problem(768, 512, 256, trans_b=True).default_config()
  other = dataclasses.replace(cfg, epi_tile_n=16)
  entries = {"k": {"config": autotune.config_to_dict(cfg), "timed": 36}}
  assert tune_gemm.keeps_entry("k", cfg, cfg, entries, narrowed=True)
  assert not tune_gemm.keeps_entry("k", cfg, cfg, entries, narrowed=False)
  assert not tune_gemm.keeps_entry("k", other, cfg, entries, narrowed=True)
  assert not tune_gemm.keeps_entry("k", cfg, None, entries, narrowed=True)
  assert not tune_gemm.keeps_entry("k", other, other, entries, narrowed=True)
  assert not tune_gemm.keeps_entry("j", cfg, cfg, entries, narrowed=True)
  assert not tune_gemm.keeps_entry("k", cfg, cfg, {"k": {"config": {"tile": 1}}},
                                   narrowed=True)


def test_tune_gemm_lower_only_fills_a_folder_an_h200_reads(monkeypatch, capsys, tmp_path):
  """``bench.tune_gemm --lower-only DIR --device h200`` on the CPU lowers each kernel that
  the same search compiles on an H200 (``autotune.search_configs``: the heuristic
  default, the incumbent, the challenger) into DIR, keyed for an H200; a second run
  lowers none; and the folder serves the H200's trace (SM count from the device), not an
  H100's. (An H200 read such a folder: 224 of 224 kernels.)"""
  import sys
  from bench import lowering_time as lt
  from bench import tune_gemm
  from pallas_kernels import kernel_cache as KC
  if jax.devices()[0].platform == "gpu":
    pytest.skip("--lower-only is for a machine without a GPU; the GPU host refuses it")
  monkeypatch.setattr(KC, "_dir_override", [])
  monkeypatch.setattr(KC, "_exported", {})
  argv = ["tune_gemm", "--workloads", "bench", "--shapes", "256x128x256", "--programs",
          "plain", "--challenge-variant", "epi_tile_n=16"]

  def run(*extra):
    monkeypatch.setattr(sys, "argv", argv + list(extra))
    tune_gemm.main()
    return capsys.readouterr().out

  out = run("--lower-only", str(tmp_path), "--device", "h200")
  files = {f.name for f in tmp_path.glob("*" + KC.SUFFIX)}
  with lt.pretend(lt.H200):
    (problem,) = [p for _, p in tune_gemm.bench_problems([(256, 128, 256)], "plain").values()]
  assert problem.key.device_kind == "NVIDIA H200"
  configs, keep = tune_gemm.plan(problem, argparse.Namespace(
      same_shape=False, challenge_tile_m=None, challenge_tile_n=None, extra=False),
      {"epi_tile_n": 16}, {})
  planned, _, _ = autotune.search_configs(problem, configs, keep=keep)
  assert len(planned) >= 2 and len(files) == len(planned), (out, files, planned)
  assert f"kernels: {len(planned)} lowered, 0 already there, 0 failed" in out, out
  assert out.count(f"/{len(planned)} lowered (") == len(planned), out  # one line a kernel
  assert f"{len(planned)} kernels in {tmp_path}" in out, out

  KC.clear_memory()
  out = run("--lower-only", str(tmp_path), "--device", "h200")
  assert f"kernels: 0 lowered, {len(planned)} already there, 0 failed" in out, out
  assert out.count(f"/{len(planned)} already there (") == len(planned), out
  assert {f.name for f in tmp_path.glob("*" + KC.SUFFIX)} == files

  # the H200's own trace of each kernel (its 132 SMs size the grid) finds its file;
  # keyed for an H100, the same kernel is another
  ops = {nm: v for nm, (_, v) in problem.inputs.items()}
  for device, how in [(lt.H200, "disk"), (lt.H100, "lowered")]:
    KC.clear_memory()
    before = KC.counts.copy()
    with lt.pretend(device), KC.keyed_for(device):
      jax.export.export(problem.jitted(planned[0], num_sms=132), platforms=["cuda"])(
          problem.a, problem.b, ops)
    assert (KC.counts - before) == {how: 1}, (device.device_kind, KC.counts - before)
  # off the GPU without --lower-only or --list, it still refuses
  monkeypatch.setattr(sys, "argv", argv)
  with pytest.raises(SystemExit, match="--list and --lower-only run anywhere"):
    tune_gemm.main()


def test_tune_gemm_same_shape(monkeypatch, tmp_path):
  """``--same-shape``: the configs other programs' entries hold at this shape (then at a
  nearby M) on this kind or a same-chip sibling, own kind first, none of another chip's
  nor of other sizes; the plan times only those; None (a whole search later) where no
  entry is at this shape."""
  import dataclasses
  from bench import lowering_time as lt
  from bench import tune_gemm
  monkeypatch.setenv(autotune.CACHE_ENV, str(tmp_path / "configs.json"))
  monkeypatch.setattr(autotune, "SHIPPED_CACHE", tmp_path / "absent.json")
  def as_h100(p):  # a kind with a same-chip sibling, on any machine
    return dataclasses.replace(p, key=dataclasses.replace(p.key, device_kind=lt.H100.device_kind))
  problem = as_h100(autotune.plain_problem(768, 512, 256, trans_b=True))
  alone = as_h100(autotune.plain_problem(16384, 512, 256, trans_b=True))  # none within 2x
  key = problem.key
  base = problem.default_config()
  own, sibling, near = (dataclasses.replace(base, epi_tile_n=w) for w in (16, 32, 64))
  far, other_chip = dataclasses.replace(base, stages=2), dataclasses.replace(base, stages=3)
  assert tune_gemm.same_shape_configs(problem) is None
  sib = autotune.same_chip_kinds(key.device_kind)[0]
  for k, cfg in [(dataclasses.replace(key, device_kind=sib, signature="b;x"), sibling),
                 (dataclasses.replace(key, signature="a;x"), own),
                 (dataclasses.replace(key, m=1536, signature="c;x"), near),
                 (dataclasses.replace(key, m=4096, signature="d;x"), far),
                 (dataclasses.replace(key, device_kind="NVIDIA B200", signature="e;x"),
                  other_chip),
                 (key, base)]:  # the problem's own entry is not a candidate
    autotune.store(k, {"config": autotune.config_to_dict(cfg), "ms": 0.1})
  assert tune_gemm.same_shape_configs(problem) == [own, sibling, near]
  args = argparse.Namespace(same_shape=True, challenge_tile_m=None, challenge_tile_n=None,
                            extra=False)
  configs, keep = tune_gemm.plan(problem, args, None, {})
  assert configs == [own, sibling, near] and keep == base  # what serves it now, as a search
  assert "left for a whole search" in tune_gemm.plan(alone, args, None, {})
  monkeypatch.setattr("sys.argv", ["tune_gemm", "--list", "--same-shape",
                                   "--challenge-tile-m", "192"])
  with pytest.raises(SystemExit, match="a search of its own"):
    tune_gemm.main()


def test_tune_gemm_already_served(monkeypatch):
  """A tuned winner that the caches already serve for the problem (here a same-chip
  sibling's entry) is named with its source, so tune_gemm writes no entry repeating
  it; another config, or nothing served, gives None."""
  import dataclasses
  from bench import tune_gemm
  problem = autotune.plain_problem(768, 512, 256, trans_b=True)
  cfg = problem.default_config()
  other = dataclasses.replace(cfg, epi_tile_n=16)
  served = [(cfg, "tuned on NVIDIA H100 80GB HBM3")]
  monkeypatch.setattr(autotune, "lookup_with_source", lambda key, clip_m=False: served[0])
  assert tune_gemm.already_served(problem, cfg) == "tuned on NVIDIA H100 80GB HBM3"
  assert tune_gemm.already_served(problem, other) is None
  served[0] = (None, None)
  assert tune_gemm.already_served(problem, cfg) is None


def test_tune_gemm_incumbent(monkeypatch):
  """The config a search keeps within the margin: the ``--out`` file's entry for the
  problem, else what the caches serve, else None."""
  import dataclasses
  from bench import tune_gemm
  problem = autotune.plain_problem(768, 512, 256, trans_b=True)
  cfg = problem.default_config()
  stored, served = dataclasses.replace(cfg, epi_tile_n=16), dataclasses.replace(cfg, stages=2)
  entries = {problem.key.text(): {"config": autotune.config_to_dict(stored), "ms": 0.1},
             "another key": {"config": autotune.config_to_dict(cfg), "ms": 0.1}}
  found = [(served, "tuned at K=512")]
  monkeypatch.setattr(autotune, "lookup_with_source", lambda key, clip_m=False: found[0])
  assert tune_gemm.incumbent(problem, entries) == stored
  assert tune_gemm.incumbent(problem, {"another key": entries["another key"]}) == served
  found[0] = (None, None)
  assert tune_gemm.incumbent(problem, {}) is None


def test_ncu_source_summary(tmp_path):
  """bench.ncu_source: samples per opcode with the guard predicate stripped, shares of
  the total, and the top instruction with its main stall reason (a CSV laid out as
  ncu 2025.3's `--page source --csv` is, with a title line above the header)."""
  from bench import ncu_source
  rows = [
      '"Kernel: coda_gemm_cooperative"',
      '"Address","Source","Warp Stall Sampling (All Samples)","stall_barrier","stall_long_sb"',
      '"0x10","WARPGROUP.DEPBAR.LE gsb0, 0x0","1,200","1,190","0"',
      '"0x20","@!P1  BRA 0x7f00","300","0","295"',
      '"0x30","@P0   BRA 0x7f40","100","0","90"',
  ]
  path = tmp_path / "src.csv"
  path.write_text("\n".join(rows) + "\n")
  out = ncu_source.summarise(str(path), top=1)
  assert "instructions: 3, samples: 1600" in out
  assert "| BRA | 400 | 0.250 |" in out
  assert "| WARPGROUP.DEPBAR.LE | 1200 | 0.750 |" in out
  top = out.split("top instructions")[1].splitlines()[1]
  assert "WARPGROUP.DEPBAR.LE" in top and "stall_barrier=1,190" in top
  assert "stall_long_sb" not in top


def test_ablate_epilogue_variants():
  """``bench.ablate_epilogue``'s table at tiny shapes, on the kernel's XLA program: every
  variant runs and emits a subset of its full program's outputs, the variants differ
  from the full program (an ablation that removed nothing would time nothing), and the
  stand-ins keep the real primitives' values where they compute them (LayerNormGrad
  with all parts; the pass without g's column sum)."""
  import jax.numpy as jnp
  from bench import ablate_epilogue as A
  import coda_jax as cj
  from coda_jax import layernorm_ops as L
  dt = jnp.dtype(jnp.bfloat16)
  shape = dict(m=128, d=64, f=128, qkv=64)
  for name, (m, n, k, trans_b), kinds, variants in A.programs(shape, dt):
    a, b, ops = A.inputs(m, n, k, trans_b, kinds, dt)

    def run(program):
      used = {nm for st in program for nm in st.inputs()}
      sub = {nm: v for nm, v in ops.items() if nm in used}
      if a is None:
        return cj.epilogue_pass(program, sub, impl="xla")
      return cj.gemm_epilogue(a, b, program, sub, trans_b=trans_b, impl="xla")
    assert variants[0][0] == "full" and variants[-1][0] == "plain", name
    full = run(variants[0][1])
    for vname, program in variants[1:]:
      got = run(program)
      assert set(got) <= set(full), (name, vname, set(got) - set(full))
      assert program != variants[0][1], (name, vname)
      for out in got:
        assert got[out].shape == full[out].shape, (name, vname, out)
    if name.startswith("LayerNormGrad"):
      parts = run([A.LayerNormGradParts("h", "mu", "r", "g", "beta", dtype=dt),
                   cj.Store("dh", dt)])
      assert set(parts) == set(full)
      for out in full:
        assert jnp.array_equal(parts[out], full[out]), (name, out)
    if name.startswith("LayerNorm producer"):
      ig = ["dh", "x", "g", "mu", "a", "b"]
      no_dg = run([cj.AddTile("dx"), A.LayerNormInputGradNoDg(*ig), cj.Store("dxt", dt)])
      assert jnp.array_equal(no_dg["dxt"], full["dxt"])
  assert issubclass(A.LayerNormInputGradNoDg, L.LayerNormInputGrad)


def test_ablate_epilogue_main_prints_each_table(monkeypatch, capsys):
  """``bench.ablate_epilogue``'s driver off the GPU (the timer and config lookup faked,
  the kernel run on its XLA program): ``--variant`` picks variants by name, each
  program's table is printed as soon as it is measured, and ``--ncu`` runs the chosen
  variants without timing them."""
  import pallas_kernels
  from bench import ablate_epilogue as A
  import coda_jax as cj
  monkeypatch.setitem(A.SHAPES, "tiny", dict(m=128, d=64, f=128, qkv=64))
  monkeypatch.setattr(A, "chosen", lambda *a: (pallas_kernels.GemmConfig(), "default"))
  timed = []

  def fake_time(fn, *args, iterations, only):
    timed.append(len(timed))
    return 0.5 + 0.1 * len(timed), []
  monkeypatch.setattr(A.common, "time_kernels", fake_time)
  A.main(["--shapes", "tiny", "--match", "MLP", "--variant", "full", "--variant", "plain",
          "--variant", "own"])
  out = capsys.readouterr().out
  assert len(timed) == 3, out
  assert "## MLP slope backward" in out and "| full | 0.6000 | 1.000 |" in out, out
  assert "| plain | 0.7000 |" in out and "| plain, own config | 0.8000 |" in out, out
  assert "no ColSum" not in out, out
  ran = []

  def xla_run(a, b, program, ops, trans_b, config=None):
    ran.append(program)
    if a is None:
      return cj.epilogue_pass(program, ops, impl="xla")
    return cj.gemm_epilogue(a, b, program, ops, trans_b=trans_b, impl="xla")
  monkeypatch.setattr(A, "run", xla_run)
  A.main(["--shapes", "tiny", "--match", "pass", "--variant", "plain", "--ncu"])
  out = capsys.readouterr().out
  assert len(timed) == 3 and len(ran) == 1, (timed, ran)  # untimed; traced once
  assert "ran twice" in out and "| plain |" not in out, out


def test_epilogue_pass_split_case_adds_up(monkeypatch):
  """``bench.epilogue_pass --program qk_norm_split`` at M = 128, on the XLA program: the
  pass's q/k heads and its v heads, run apart, give the whole pass's du (on the GPU to
  one bf16 step: see ``same_but_rounding``), <du, u> and (on q and k) weight sums; the
  mask it replaced gives the same bits as the per-head branch, and so does the maskless
  variant on the q/k heads (where nothing passes through)."""
  import jax
  import numpy as np
  from bench import epilogue_pass as E
  import coda_jax as cj
  monkeypatch.setattr(E, "M", 128)
  programs, _, _, _ = E.qk_norm_split_case(jax.random.key(3))
  run = lambda name: cj.epilogue_pass(*programs[name], impl="xla")
  f = lambda x: np.asarray(x, np.float32)
  whole = run("QK-norm backward, row-scaled, N = 4096")
  before = run("the same with a mask, no branch (before)")
  for nm in whole:
    np.testing.assert_array_equal(f(before[nm]), f(whole[nm]), err_msg=nm)
  qk = run("its q/k heads alone, N = 3072")
  v = run("its v heads alone (copy, <du, u>, r), N = 1024")
  nqk = (E.HQ + E.HKV) * E.HD

  def same_but_rounding(part, of_whole, what):
    # Run at another width (N = 3072 or 1024 against 4096), XLA's GPU fusions may add a
    # head's squares in another order: the row's rms then moves in its last fp32 bits,
    # and a few du round to the neighbouring bf16 (6 of 393,216 on the H200 at 4697e6b).
    # A du near zero comes out of the norm's cancellation (dn - n c) and can move by
    # more steps of its own (two at -9.4e-7, 1 of 393,216, at 6ad1c05), so: within one
    # bf16 step of the value or 2^-16 of the largest |du|, and exact almost everywhere
    # (on the CPU, all).
    atol = 2.0**-16 * float(np.max(np.abs(of_whole)))
    np.testing.assert_allclose(part, of_whole, rtol=2.0**-7, atol=atol, err_msg=what)
    assert np.mean(part != of_whole) < 1e-3, (what, int(np.sum(part != of_whole)))

  same_but_rounding(f(qk["du"]), f(whole["du"][:, :nqk]), "q/k heads' du")
  same_but_rounding(f(v["du"]), f(whole["du"][:, nqk:]), "v heads' du")
  # column sums over the rows of (M, blocks, 128): XLA's GPU reduction of 24 blocks and of
  # 32 may add the rows in different orders (3.8e-6 apart at most on the H200, of sums ~10)
  np.testing.assert_allclose(f(qk["dweight"]), f(whole["dweight"][:nqk]), rtol=1e-5,
                             atol=1e-6 * np.abs(f(whole["dweight"])).max())
  np.testing.assert_allclose(f(qk["udu"]) + f(v["udu"]), f(whole["udu"]), rtol=1e-5, atol=1e-3)
  free = run("q/k heads, no pass-through mask")
  for nm in free:
    np.testing.assert_array_equal(f(free[nm]), f(qk[nm]), err_msg=nm)


def test_train_job_refuses_shard_map_with_cudnn_attention(monkeypatch):
  """bench.train: ``--partitioner shard_map`` with cuDNN attention (which segfaults jax
  0.11.2's GPU compiler; docs/known_issues.md) stops before any step, naming the flags
  around it; ``--attention`` reaches the model's config."""
  from bench import train as job
  monkeypatch.setattr("sys.argv", ["bench.train", "--config", "tiny", "--mesh", "data=1",
                                   "--partitioner", "shard_map", "--attention", "cudnn",
                                   "--steps", "4", "--paths", "reference"])
  with pytest.raises(SystemExit, match=r"partitioner='shard_map' with cuDNN attention.*"
                                       r"--partitioner jit or --attention xla"):
    job.main()


def test_layernorm_row_terms_program_matches_its_reference():
  """``bench.layernorm_row_terms``'s two passes, run on the CPU as the kernel runs them
  (the first pass's partials summed over the row, then the second pass on the totals),
  against the float64 reference the benchmark checks the GPU against: a wrong formula
  in the program would otherwise only show as an error column on the device."""
  import numpy as np
  import jax.numpy as jnp
  from bench import layernorm_row_terms as T
  from coda_jax import layernorm_ops as L

  m, k = 64, 64
  ops = T.inputs(jax.random.key(0), k)
  ops = {nm: v[:m] if v.ndim and v.shape[0] == T.M else v for nm, v in ops.items()}
  # rows far from unit variance and zero mean, so that r and mu are not ~1 and ~0 and a
  # missing factor of either shows
  x = (3 * ops["x"].astype(jnp.float32) + 0.5).astype(jnp.bfloat16)
  xf = x.astype(jnp.float32)
  mu = jnp.mean(xf, axis=1)
  ops.update(x=x, mu=mu, r=jax.lax.rsqrt(jnp.mean(xf * xf, axis=1) - mu * mu + 1e-5))
  dn = np.asarray(ops["dz"], np.float64) @ np.asarray(ops["w"], np.float64).T
  # the two passes as the kernel runs them, on one tile spanning the rows
  got = L.row_terms_xla(jnp.asarray(dn, jnp.float32), ops["x"], ops["dx"], ops["mu"],
                        ops["r"], ops["gam"], ops["beta"])
  assert T.first_pass is L.row_terms_first_pass and T.OUTPUTS is L.ROW_TERMS_OUTPUTS
  want = T.reference(ops["dz"], ops["w"], ops["x"], ops["dx"], ops["mu"], ops["r"],
                     ops["gam"], ops["beta"])
  for nm, g, w in zip(("dxt", "n", "dbeta", "dg", "dsum"), got, want):
    g = np.asarray(g, np.float64)
    err = np.linalg.norm(g - w) / np.linalg.norm(w)
    assert err < (1e-2 if nm in ("dxt", "n") else 1e-4), (nm, err)


def test_sustained_step_windows_alternate_after_a_warm_up():
  """``bench.sustained_step``'s windows (``common.alternating_windows``): one untimed
  window of the first variant, then each round times every variant, the odd rounds in
  reverse order; a window's time per step is what
  the fake clock advances; bad variants and round counts are refused by name."""
  from bench import sustained_step as S
  now, order, call = _fake_timed_calls()
  a, b = 2.0 ** -10, 2.0 ** -8
  got = common.alternating_windows({"a": call("a", a), "b": call("b", b)}, 20 * a, 3,
                                   sync=lambda x: x, clock=lambda: now[0])
  assert got == {"a": [common.Sustained(a * 1e3, 20)] * 3,
                 "b": [common.Sustained(b * 1e3, 5)] * 3}
  wa, wb = ["a"] * 21, ["b"] * 6  # a window: one sizing call, then its calls
  assert order == wa + (wa + wb) + (wb + wa) + (wa + wb)
  assert S.parse_variant("fused") == (True, None)
  assert S.parse_variant("reference") == (False, None)
  assert S.parse_variant("fused:output") == (True, "output")
  for bad in ("xla", "reference:output", "fused:kept"):
    with pytest.raises(ValueError, match=bad.split(":")[-1]):
      S.parse_variant(bad)
  with pytest.raises(ValueError, match="at least one round"):
    common.alternating_windows({"a": call("a", a)}, 1.0, 0)


def test_sustained_step_writes_its_table(tmp_path, monkeypatch, capsys):
  """``bench.sustained_step`` end to end on the tiny config's reference step (on a CPU: no
  power read, so the power cells are "-"): the table and the json rows are written."""
  import json
  import sys
  from bench import sustained_step as S
  monkeypatch.setattr(sys, "argv", ["sustained_step", "--config", "tiny", "--layers", "1",
                                    "--batch", "1", "--seq", "32", "--variants",
                                    "reference", "--seconds", "0.02", "--rounds", "1",
                                    "--out", str(tmp_path)])
  S.main()
  md = (tmp_path / "sustained_step_tiny_1l.md").read_text()
  assert "| reference |" in md and "| 1.000 |" in md, md
  rows = json.loads((tmp_path / "sustained_step_tiny_1l.json").read_text())
  rows = rows if isinstance(rows, list) else rows["rows"]
  assert rows[0]["variant"] == "reference" and rows[0]["ms"] > 0
  assert len(rows[0]["windows"]) == 1
  monkeypatch.setattr(sys, "argv", ["sustained_step", "--variants", "fused,fused"])
  with pytest.raises(SystemExit):
    S.main()
  assert "each variant once" in capsys.readouterr().err


_PTXAS_LOG = """\
timing: CUPTI, median of 3 calls
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'coda_gemm_pingpong_64x64x64_nn_out_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for coda_gemm_pingpong_64x64x64_nn_out_mosaic_gpu_kernel
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers, 1 bytes smem
ptxas warning : Registers are spilled to local memory in function 'coda_gemm_pingpong_64x64x64_nt_y_dz_mosaic_gpu_kernel', 160 bytes spill stores, 176 bytes spill loads
ptxas info    : Compiling entry function 'coda_gemm_pingpong_64x64x64_nt_y_dz_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for coda_gemm_pingpong_64x64x64_nt_y_dz_mosaic_gpu_kernel
    104 bytes stack frame, 160 bytes spill stores, 176 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers, 104 bytes cumulative stack size, 1 bytes smem
ptxas info    : Compiling entry function 'coda_gemm_epilogue_only_64x128x0_nn_du_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for coda_gemm_epilogue_only_64x128x0_nn_du_mosaic_gpu_kernel
    8 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 255 registers, used 16 barriers, 8 bytes cumulative stack size, 1 bytes smem
| problem | M x N x K | order | variant | config | ms |
"""


def test_ptxas_report_reads_each_kernel_in_order(tmp_path, capsys):
  """``bench.ptxas_report``: each compiled kernel's registers and spill bytes are the
  lines after its own entry line (a log as the H200 gave it, three kernels, the warning
  for the second before its entry); ``--spills-only`` lists the two that spill; a log
  without ptxas's report is refused with the reason."""
  from bench import ptxas_report as P
  reports = P.parse(_PTXAS_LOG)
  assert [r.kernel for r in reports] == [
      "coda_gemm_pingpong_64x64x64_nn_out_mosaic_gpu_kernel",
      "coda_gemm_pingpong_64x64x64_nt_y_dz_mosaic_gpu_kernel",
      "coda_gemm_epilogue_only_64x128x0_nn_du_mosaic_gpu_kernel"]
  assert [(r.registers, r.stack_bytes, r.spill_store_bytes, r.spill_load_bytes)
          for r in reports] == [(168, 0, 0, 0), (168, 104, 160, 176), (255, 8, 8, 12)]
  assert [r.spills for r in reports] == [False, True, True]
  log = tmp_path / "run.log"
  log.write_text(_PTXAS_LOG)
  assert P.main([str(log), "--spills-only"]) == 0
  out = capsys.readouterr().out
  assert "| 2 | coda_gemm_pingpong_64x64x64_nt_y_dz | 168 | 104 | 160 | 176 |" in out, out
  assert "| 3 | coda_gemm_epilogue_only_64x128x0_nn_du | 255 | 8 | 8 | 12 |" in out, out
  assert "nn_out |" not in out and "3 kernels compiled, 2 of them spill." in out, out
  log.write_text("timing: CUPTI, median of 3 calls\n")
  assert P.main([str(log)]) == 1
  assert "MOSAIC_GPU_DUMP_PTXAS=1" in capsys.readouterr().err


def test_tune_gemm_writes_a_served_winner_after_a_whole_search():
  """A winner the caches already serve from a same-chip sibling's entry or a nearby
  size is written after a whole search (its record is this problem's own, and ``--list``
  then reads it as tuned here) and not after a challenge or ``--same-shape`` run; one
  served by the problem's own entry, or not served, is written after either."""
  from bench import tune_gemm
  for narrowed in (False, True):
    assert tune_gemm.writes_served_winner(None, narrowed)
    assert tune_gemm.writes_served_winner("tuned", narrowed)
  for source in ("tuned on NVIDIA H100 80GB HBM3", "tuned at M=8192"):
    assert tune_gemm.writes_served_winner(source, narrowed=False)
    assert not tune_gemm.writes_served_winner(source, narrowed=True)
