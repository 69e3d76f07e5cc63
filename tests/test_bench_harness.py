"""The block benchmarks' harness on the CPU: at tiny shapes, with our ops on their XLA
programs, every row of bench/family_blocks.py is measured without error, and its
standard-written XLA baseline computes the same block as ours: the truth is the
baseline's math run in fp32, and ours is within the tolerance rule's 2x of the bf16
baseline's error from it (a baseline that computed something else would put ours far
from its truth, and make the GPU speed ratios meaningless)."""
import jax
import pytest

from bench import block as B
from bench import common
from bench import family_blocks as fb


@pytest.mark.parametrize("name", ["gpt2_tiny", "qwen3_tiny"])
def test_family_block_rows(name):
  rows = fb.run_shape(name, fb.SHAPES[name], "xla", B.timer(False, 1),
                      common.provenance(), jax.random.key(0))
  assert [r["op"] for r in rows] == [f"{name.split('_')[0]}_block_fwd",
                                     f"{name.split('_')[0]}_block_fwd_bwd"]
  for r in rows:
    assert "error" not in r, r["error"]
    ours, xla = r["ours_err_vs_fp32"], r["baseline_err_vs_fp32"]
    assert 0 < ours <= 2 * xla, (r["op"], ours, xla)
    assert r["rel_diff_vs_baseline"] < 0.05, (r["op"], r["rel_diff_vs_baseline"])


def test_lowering_time_lowers_each_lm_head_kernel_once():
  """bench/lowering_time.py exports the post-block for an H100 from the CPU, and the LM
  head's kernels are traced (so lowered) once whatever the number of chunks: with the
  chunks written out, the 8B training step took 134 s to compile on the H100, against
  74 s with one scan (bench/NOTES.md, issue 12, fourth session)."""
  from bench import lowering_time as lt
  two, four = lt.post_block("tiny", 128), lt.post_block("tiny", 64)  # M = 256 rows
  assert two["gemms_traced"] == four["gemms_traced"] > 0, (two, four)
  assert two["seconds"] > 0 and two["module_mb"] > 0, two


def test_tune_gemm_lists_a_workloads_gemms_without_a_gpu(monkeypatch, capsys):
  """``bench.tune_gemm --list`` traces a workload as an H100 would run it, on any machine,
  so that a session can plan its device time (which GEMMs to tune or time) before it has
  a GPU; without --list it still refuses to run off the GPU."""
  import sys
  from bench import tune_gemm
  if jax.devices()[0].platform == "gpu":
    pytest.skip("this checks the CPU path of --list; on the GPU host it lists as tuning does")
  monkeypatch.setattr(sys, "argv", ["tune_gemm", "--list", "--workloads", "block-1b"])
  tune_gemm.main()
  lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith("1b ")]
  keys = [l.split(": ", 1)[1] for l in lines]
  assert len(keys) == len(set(keys)) >= 12, lines
  assert all(k.startswith("NVIDIA H100 80GB HBM3|") for k in keys), keys
  shapes = {tuple(k.split("|")[2:4]) for k in keys}
  # the fused MLP's up/gate GEMM, and the LM head's logits GEMM and its dW GEMM
  assert {("16384x16384x2048", "nn"), ("2048x128256x2048", "nn"),
          ("2048x128256x2048", "tn")} <= shapes, shapes
  monkeypatch.setattr(sys, "argv", ["tune_gemm", "--workloads", "block-1b"])
  with pytest.raises(SystemExit, match="run it on the GPU host"):
    tune_gemm.main()
