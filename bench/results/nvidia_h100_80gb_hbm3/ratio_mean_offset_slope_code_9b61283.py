"""The tolerance-rule ratios of test_rows_with_mean_offset[gpt2_mlp_then_qkv-300.0]'s key
(the test's own draw), with the slope stored in bf16 and as the one-byte code."""
import sys, zlib, numpy as np, jax, jax.numpy as jnp
sys.path.insert(0, "tests")
import helpers, test_layernorm_ops as T
from coda_jax import layernorm_ops as L
node = "tests/test_layernorm_ops.py::test_rows_with_mean_offset[gpt2_mlp_then_qkv-300.0]"
key = jax.random.key(zlib.crc32(node.encode()))
real = L.slope_dtype_for
for variant in ("bf16", "uint8 code"):
  L.slope_dtype_for = (lambda dt: jnp.dtype(dt)) if variant == "bf16" else real
  ratios = {}
  def within(got, truth, baseline, what=""):
    e, eb = helpers.rel_err(got, truth), helpers.rel_err(baseline, truth)
    r, rb = helpers.worst_row_err(got, truth), helpers.worst_row_err(baseline, truth)
    ratios[what] = (e / max(eb, 1e-12), r / max(rb, 1e-12))
  T.check_op("gpt2_mlp_then_qkv", T._inputs(key, T.M, T.K, T.D, T.N, T.FF, offset=300.0), "xla", key,
             within=within, per_element=lambda *a: None)
  worst = sorted(ratios.items(), key=lambda kv: -max(kv[1]))[:6]
  print(variant, "; ".join(f"{k.split()[-1]} {a:.3f}/{b:.3f}" for k, (a, b) in worst))
