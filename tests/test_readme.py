"""The Python examples of README.md and docs/ run as written and return what their
comments say.

Each ```python block of the files in ``DOCUMENTS`` is run from its text: README.md's two
layer examples one after the other in one namespace, as a reader's session would run
them; the op API sketches (README.md's ``gemm_epilogue`` and ``fused_ops`` examples,
docs/ops.md's LayerNorm and QK-norm ops) after a setup that makes the arrays they name
(shapes that tile the kernels, so on an H100 they run compiled); and the two sharded
examples (README.md's tensor-parallel train step, docs/sharding.md's ``shard_map``) in a
fresh process on 4 fake CPU devices, after the model example that makes their
``state``. A block this file does not know fails ``test_every_example_is_run``, so a new
example gets a run here.
"""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import normal

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

# A line that starts each example this file runs (at the start of one of its lines,
# in exactly one block of the documents below).
LAYERS = "class MyBlock(nnx.Module):"
MODEL = "model = Llama(get_config("
GEMM = "outs = coda_jax.gemm_epilogue("
OPS = "x, h, r = fused_ops.residual_rmsnorm("
FAMILIES = "x, h, mu, r = layernorm_ops.residual_layernorm("
TENSOR_PARALLEL = "state = jax.device_put(state, train.tensor_parallel_shardings("
SHARD_MAP = "post = jax.shard_map("
# Each document with python examples, and the examples it holds.
DOCUMENTS = {
    README: (LAYERS, MODEL, GEMM, OPS, TENSOR_PARALLEL),
    ROOT / "docs" / "ops.md": (FAMILIES,),
    ROOT / "docs" / "sharding.md": (SHARD_MAP,),
}
EXAMPLES = tuple(m for markers in DOCUMENTS.values() for m in markers)


def python_blocks(text: str) -> list[tuple[int, str]]:
  """(first line number, source) of each ```python block of ``text``, in order."""
  blocks, lines = [], text.split("\n")
  start = None
  for i, line in enumerate(lines):
    if start is None and line.strip() == "```python":
      start = i + 1
    elif start is not None and line.strip() == "```":
      blocks.append((start + 1, "\n".join(lines[start:i])))
      start = None
  assert start is None, f"the ```python block at line {start} is not closed"
  return blocks


def _marks(src: str, marker: str) -> bool:
  return any(line.startswith(marker) for line in src.split("\n"))


def example(marker: str) -> tuple[Path, int, str]:
  """(document, first line number, source) of the example with a line starting
  ``marker``, in the document ``DOCUMENTS`` names for it."""
  path = next(p for p, markers in DOCUMENTS.items() if marker in markers)
  found = [(path, line, src) for line, src in python_blocks(path.read_text())
           if _marks(src, marker)]
  assert len(found) == 1, (f"{path.name} has {len(found)} python blocks with a line "
                           f"starting {marker!r}; tests/test_readme.py runs exactly one")
  return found[0]


def run(block: tuple[Path, int, str], namespace: dict) -> dict:
  """Runs a documented example in ``namespace``; a traceback names its document line."""
  path, line, source = block
  exec(compile("\n" * (line - 1) + source, str(path), "exec"), namespace)
  return namespace


def finite(x) -> bool:
  return bool(jnp.all(jnp.isfinite(jnp.asarray(x, jnp.float32))))


def test_python_blocks_parses_every_block():
  text = "a\n```python\nx = 1\n```\n```bash\nls\n```\n```python\ny = 2\nz = 3\n```\n"
  assert python_blocks(text) == [(3, "x = 1"), (9, "y = 2\nz = 3")]
  with pytest.raises(AssertionError, match="not closed"):
    python_blocks("```python\nx = 1\n")


def test_every_example_is_run():
  """Every python block of each document is one this file runs, and no document but
  those in ``DOCUMENTS`` holds one of its examples."""
  for path, markers in DOCUMENTS.items():
    blocks = python_blocks(path.read_text())
    unknown = [(line, src.split("\n", 1)[0]) for line, src in blocks
               if not any(_marks(src, k) for k in markers)]
    assert not unknown, (f"{path.name} python blocks no test runs (line, first line): "
                         f"{unknown}; add each to tests/test_readme.py")
    assert sorted(example(k)[1] for k in markers) == [line for line, _ in blocks]
  for path in sorted((ROOT / "docs").glob("*.md")):
    if path in DOCUMENTS:
      continue
    for line, src in python_blocks(path.read_text()):
      assert not any(_marks(src, k) for k in EXAMPLES), (
          f"{path.name}:{line} holds an example this file runs from another document")


def test_layers_and_model(tmp_path, monkeypatch):
  """"Using the layers": a block of the Flax layers and its gradients, then the whole
  model saved and read back as a Hugging Face checkpoint and trained a step."""
  monkeypatch.chdir(tmp_path)
  ns = run(example(LAYERS), {})
  grads = jax.tree.leaves(ns["grads"])
  assert grads and all(finite(g) for g in grads)
  assert any(float(jnp.max(jnp.abs(g))) > 0 for g in grads)
  assert ns["block"].mlp.fused is False  # set_attributes reached the layers
  run(example(MODEL), ns)
  assert (tmp_path / "out" / "config.json").is_file()
  assert ns["tokens"].shape == ns["targets"].shape == (4, 64)
  loss = float(ns["loss"])
  # a step on random tokens of a fresh model: near the uniform guess's log(V)
  assert abs(loss - math.log(ns["model"].config.vocab_size)) < 1.0, loss


def _normal(key, shape, scale=1.0):
  return (scale * normal(key, shape)).astype(jnp.bfloat16)


M, K, D, F_, V = 256, 128, 256, 512, 512


def test_gemm_epilogue(key):
  """``gemm_epilogue``'s example: x1 = x0 + y @ Wo, its rows' sum of squares, x1 * g."""
  ks = jax.random.split(key, 4)
  ns = dict(y=_normal(ks[0], (M, K)), wo=_normal(ks[1], (K, D), K ** -0.5),
            x0=_normal(ks[2], (M, D)), g=1 + 0.1 * jax.random.normal(ks[3], (D,)))
  run(example(GEMM), ns)
  outs = ns["outs"]
  assert (outs["x1"].shape, outs["x1"].dtype) == ((M, D), jnp.bfloat16)
  assert (outs["ss"].shape, outs["ss"].dtype) == ((M,), jnp.float32)
  assert (outs["h"].shape, outs["h"].dtype) == ((M, D), jnp.bfloat16)
  f32 = lambda a: np.asarray(a, np.float32)
  x1 = f32(ns["y"]) @ f32(ns["wo"]) + f32(ns["x0"])
  np.testing.assert_allclose(f32(outs["x1"]), x1, rtol=2e-2, atol=2e-2)
  np.testing.assert_allclose(f32(outs["ss"]), (f32(outs["x1"]) ** 2).sum(1), rtol=1e-2)


def test_fused_ops(key):
  """``fused_ops``' example, one op feeding the next as in a Llama block."""
  from coda_jax import layout
  ks = iter(jax.random.split(key, 8))
  hq, hkv, hd = 32, 8, 64  # the example's heads
  ns = dict(y=_normal(next(ks), (M, K)), wo=_normal(next(ks), (K, D), K ** -0.5),
            x0=_normal(next(ks), (M, D)), g_mlp=jnp.ones((D,)),
            w13=layout.gate_up_to_blocked(_normal(next(ks), (D, 2 * F_), D ** -0.5), 32),
            wqkv=_normal(next(ks), (D, (hq + 2 * hkv) * hd), D ** -0.5),
            positions=jnp.arange(M, dtype=jnp.int32),
            wlm=_normal(next(ks), (D, V), D ** -0.5),
            targets=jax.random.randint(next(ks), (M,), 0, V))
  run(example(OPS), ns)
  assert ns["x"].shape == ns["h"].shape == (M, D) and ns["r"].shape == (M,)
  assert ns["y1"].shape == (M, F_)
  assert ns["qkv"].shape == (M, (hq + 2 * hkv) * hd)
  assert ns["loss"].shape == () and finite(ns["loss"])


def test_beyond_llama(key):
  """The LayerNorm ops' and QK-norm's example, each call as written."""
  ks = iter(jax.random.split(key, 24))
  w = lambda k, n: _normal(next(ks), (k, n), k ** -0.5)
  vec = lambda n, s=0.1: s * jax.random.normal(next(ks), (n,))
  hq, hkv, hd = 16, 8, 128  # the QK-norm call's heads
  ns = dict(y=_normal(next(ks), (M, K)), w=w(K, D), res=_normal(next(ks), (M, D)),
            g=1 + vec(D), b=vec(D), beta=vec(D), w_qkv=w(D, 3 * D), b_qkv=vec(3 * D),
            w1=w(D, F_), b1=vec(F_), w2=w(F_, D), b2=vec(D), g_next=1 + vec(D),
            beta_next=vec(D), wqkv=w(D, (hq + 2 * hkv) * hd),
            positions=jnp.arange(M, dtype=jnp.int32), q_norm_w=1 + vec(hd),
            k_norm_w=1 + vec(hd))
  # the example's h and r are the LayerNorm's; the QK-norm call takes an RMSNorm's
  # (h, r) of the same shapes, which these are
  run(example(FAMILIES), ns)
  assert ns["x"].shape == ns["h"].shape == (M, D)
  assert ns["mu"].shape == ns["r"].shape == (M,)
  assert ns["z"].shape == (M, 3 * D)
  assert ns["x2"].shape == ns["h2"].shape == (M, D) and ns["r2"].shape == (M,)
  assert ns["qkv"].shape == (M, (hq + 2 * hkv) * hd)
  assert all(finite(ns[k]) for k in ("x2", "h2", "z", "qkv"))


# Run in a fresh process on 4 fake CPU devices: the model example (for ``state``,
# ``graphdef``, ``train``, ``tokens``, ``targets``), then the two sharded examples,
# the second after a setup that makes the post-block's arguments. Each sharded loss is
# printed beside the same loss on one device.
_SHARDED_SCRIPT = """
import json, sys
import jax, jax.numpy as jnp
from flax import nnx
sys.path.insert(0, {tests!r})
import test_readme as T
from coda_jax import blocks, layout
ns = T.run(T.example(T.MODEL), {{}})
model, _ = nnx.merge(ns["graphdef"], ns["state"])
step_loss = float(model.loss(ns["tokens"], ns["targets"]))  # the state block 6 steps from
T.run(T.example(T.TENSOR_PARALLEL), ns)
tp_loss = float(ns["loss"])
specs = sorted({{str(x.sharding.spec) for x in jax.tree.leaves(ns["state"])}})
ks = iter(jax.random.split(jax.random.key(1), 8))
n = lambda s, k=1.0: T._normal(next(ks), s, k)
M, D, F, V, HQ, HKV, HD = 256, 128, 256, 320, 4, 2, 32
ns.update(x0=n((M, D)), y0=n((M, HQ * HD)), t=jax.random.randint(next(ks), (M,), 0, V),
          cfg=blocks.BlockConfig(HQ, HKV, HD, reduction="sum"), blocks=blocks,
          params=dict(wo=n((HQ * HD, D), 0.1), g_mlp=jnp.ones((D,)),
                      w13=layout.gate_up_to_blocked(n((D, 2 * F), 0.1), 32),
                      w2=n((F, D), 0.1), g_final=jnp.ones((D,)), wlm=n((D, V), 0.1)))
T.run(T.example(T.SHARD_MAP), ns)
one = blocks.post_block(ns["x0"], ns["y0"], ns["t"], ns["params"], ns["cfg"])
print("RESULT " + json.dumps(dict(devices=len(jax.devices()), specs=specs,
                                  step_loss=step_loss, tp_loss=tp_loss,
                                  shard_map_loss=float(ns["loss"]), one_device=float(one))))
"""


def test_sharded(tmp_path):
  """"Sharded arrays": the tensor-parallel train step and a ``shard_map`` of the
  post-block over the rows, on 4 fake CPU devices (the device count is fixed when jax
  starts), each against the same loss on one device."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT),
             XLA_FLAGS=os.environ.get("XLA_FLAGS", "")
             + " --xla_force_host_platform_device_count=4")
  script = _SHARDED_SCRIPT.format(tests=str(ROOT / "tests"))
  proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=900)
  lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
  assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
  got = json.loads(lines[-1][len("RESULT "):])
  assert got["devices"] == 4, got
  assert any("model" in s for s in got["specs"]), got["specs"]  # tensor parallel split
  # the step's loss is the loss of the state it steps from, on 4 devices as on one
  assert abs(got["tp_loss"] - got["step_loss"]) < 1e-3 * abs(got["step_loss"]), got
  assert abs(got["shard_map_loss"] - got["one_device"]) < 1e-3 * abs(got["one_device"]), got
