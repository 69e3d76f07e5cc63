"""Standard Llama layers <-> kernel layout (coda_jax.layout): exact round trips, and
converted weights through jnp_reference.shifted_block against an independently written
standard-layout Llama (separate q/k/v and gate/up matmuls, Hugging Face or Meta RoPE)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coda_jax import jnp_reference as ref
from coda_jax import layout
from helpers import normal, rel_err

D, F, HQ, HKV, M = 64, 128, 4, 2, 96
BLOCK, THETA, EPS = 32, 500000.0, 1e-5
RTOL = 1e-5  # fp32, same math in a different order
ROPES = ("rotate_half", "interleaved")
MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def llama_layer(key, hd):
  """A random standard layer, weights (in, out)."""
  shapes = {"wq": (D, HQ * hd), "wk": (D, HKV * hd), "wv": (D, HKV * hd), "wo": (HQ * hd, D),
            "w_gate": (D, F), "w_up": (D, F), "w_down": (F, D), "attn_norm": (D,),
            "mlp_norm": (D,)}
  keys = jax.random.split(key, len(shapes))
  layer = {k: normal(kk, s) / np.sqrt(s[0]) for kk, (k, s) in zip(keys, shapes.items())}
  return {**layer, "attn_norm": 1 + 0.1 * layer["attn_norm"],
          "mlp_norm": 1 + 0.1 * layer["mlp_norm"]}


def cvt(layer, hd, rope, **kw):
  return layout.llama_layer_to_kernel(layer, n_q_heads=HQ, n_kv_heads=HKV, head_dim=hd,
                                      block=BLOCK, rope=rope, **kw)


def back(layer, hd, rope, **kw):
  return layout.kernel_layer_to_llama(layer, n_q_heads=HQ, n_kv_heads=HKV, head_dim=hd,
                                      block=BLOCK, rope=rope, **kw)


# ---- standard-layout Llama, written independently of coda_jax --------------------------
def rmsnorm(x, g):
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + EPS) * g


def rope_hf(x, pos, hd):
  """Hugging Face: x * cos + rotate_half(x) * sin, x (M, H, hd)."""
  inv = 1.0 / THETA ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd)
  t = pos[:, None].astype(jnp.float32) * inv[None]
  emb = jnp.concatenate([t, t], axis=-1)[:, None, :]
  x1, x2 = x[..., :hd // 2], x[..., hd // 2:]
  return x * jnp.cos(emb) + jnp.concatenate([-x2, x1], axis=-1) * jnp.sin(emb)


def rope_meta(x, pos, hd):
  """Meta: adjacent pairs (2j, 2j+1) as complex numbers times exp(i t_j), x (M, H, hd)."""
  inv = 1.0 / THETA ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd)
  t = pos[:, None].astype(jnp.float32) * inv[None]
  xc = jax.lax.complex(x[..., 0::2], x[..., 1::2]) * jnp.exp(1j * t)[:, None, :]
  return jnp.stack([xc.real, xc.imag], axis=-1).reshape(x.shape)


def llama_shifted(x0, y0, pos, layer, next_layer, hd, rope):
  """Layer i's out-proj + MLP, then layer i+1's normed, RoPE'd q, k, v (M, H, hd)."""
  x1 = x0 + y0 @ layer["wo"]
  h = rmsnorm(x1, layer["mlp_norm"])
  x2 = x1 + (jax.nn.silu(h @ layer["w_gate"]) * (h @ layer["w_up"])) @ layer["w_down"]
  n = rmsnorm(x2, next_layer["attn_norm"])
  q, k, v = (n @ next_layer[w] for w in ("wq", "wk", "wv"))
  q, k, v = q.reshape(M, HQ, hd), k.reshape(M, HKV, hd), v.reshape(M, HKV, hd)
  rot = rope_hf if rope == "rotate_half" else rope_meta
  return x2, rot(q, pos, hd), rot(k, pos, hd), v


def scores(q, k):
  """Per-head q . k (Hq, M, M), kv heads shared by groups of Hq / Hkv q heads."""
  return jnp.einsum("mhd,nhd->hmn", q, jnp.repeat(k, HQ // HKV, axis=1))


# ---- tests --------------------------------------------------------------------------------
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("rope", ROPES)
@pytest.mark.parametrize("hd", [16, 32])
def test_round_trip_exact(key, hd, rope, transposed):
  layer = llama_layer(key, hd)
  if transposed:
    layer = {k: v.T if k in MATRICES else v for k, v in layer.items()}
  kern = cvt(layer, hd, rope, transposed=transposed)
  assert set(kern) == {"wqkv", "wo", "w13", "w2", "g_attn", "g_mlp"}
  got = back(kern, hd, rope, transposed=transposed)
  assert set(got) == set(layer)
  for k in layer:
    assert got[k].shape == layer[k].shape and got[k].dtype == layer[k].dtype, k
    np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(layer[k]), err_msg=k)
  again = cvt(got, hd, rope, transposed=transposed)
  for k in kern:
    np.testing.assert_array_equal(np.asarray(again[k]), np.asarray(kern[k]), err_msg=k)


@pytest.mark.parametrize("rope", ROPES)
def test_transposed_matches(key, rope):
  layer = llama_layer(key, 16)
  t = {k: v.T if k in MATRICES else v for k, v in layer.items()}
  a, b = cvt(layer, 16, rope), cvt(t, 16, rope, transposed=True)
  for k in a:
    np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]), err_msg=k)


def test_interleaved_permutation():
  cols = jnp.arange(2 * 8)[None]  # two heads of 8
  perm = layout.interleaved_to_rotate_half(cols, 8)
  assert perm.tolist() == [[0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15]]
  assert layout.rotate_half_to_interleaved(perm, 8).tolist() == cols.tolist()


@pytest.mark.parametrize("rope", ROPES)
@pytest.mark.parametrize("hd", [16, 32])
def test_shifted_block_matches_llama(key, hd, rope):
  k0, k1, kx, ky = jax.random.split(key, 4)
  layer, next_layer = llama_layer(k0, hd), llama_layer(k1, hd)
  x0, y0 = normal(kx, (M, D)), normal(ky, (M, HQ * hd))
  pos = jnp.arange(M, dtype=jnp.int32) % 37  # packed sequences
  params = layout.shifted_params(cvt(layer, hd, rope), cvt(next_layer, hd, rope))
  with jax.default_matmul_precision("highest"):
    x2, qkv = ref.shifted_block(x0, y0, pos, params, n_q_heads=HQ, n_kv_heads=HKV,
                                head_dim=hd, theta=THETA, eps=EPS, block=BLOCK)
    x2_ref, q_ref, k_ref, v_ref = llama_shifted(x0, y0, pos, layer, next_layer, hd, rope)
  q = qkv[:, :HQ * hd].reshape(M, HQ, hd)
  k = qkv[:, HQ * hd:(HQ + HKV) * hd].reshape(M, HKV, hd)
  v = qkv[:, (HQ + HKV) * hd:].reshape(M, HKV, hd)
  assert rel_err(x2, x2_ref) < RTOL
  assert rel_err(v, v_ref) < RTOL
  if rope == "rotate_half":
    assert rel_err(q, q_ref) < RTOL
    assert rel_err(k, k_ref) < RTOL
  else:
    # q and k come out in rotate-half order; the scores are what attention sees.
    with jax.default_matmul_precision("highest"):
      assert rel_err(scores(q, k), scores(q_ref, k_ref)) < RTOL
    order = np.concatenate([np.arange(0, hd, 2), np.arange(1, hd, 2)])
    assert rel_err(q, q_ref[..., order]) < RTOL
    assert rel_err(k, k_ref[..., order]) < RTOL


@pytest.mark.parametrize("key_, value, match", [
    ("wv", None, r"missing keys \['wv'\]"),
    ("bias", (D,), r"unexpected keys \['bias'\]"),
    ("wk", (D, 48), r"wk has shape \(64, 48\), expected \(64, 32\) = \(D, Hkv\*hd\)"),
    ("wo", (D, D + 1), r"wo has shape \(64, 65\), expected \(64, 64\) = \(Hq\*hd, D\)"),
    ("mlp_norm", (D + 1,), r"mlp_norm has shape \(65,\), expected \(64,\)"),
    ("w_gate", (D, F, 1), r"w_gate has shape \(64, 128, 1\), expected a 2-D \(D, F\)"),
    ("w_down", (F, D - 1), r"w_down has shape \(128, 63\)"),
])
def test_bad_llama_layer(key, key_, value, match):
  layer = llama_layer(key, 16)
  if value is None:
    del layer[key_]
  else:
    layer[key_] = jnp.zeros(value)
  with pytest.raises(ValueError, match=match):
    cvt(layer, 16, "rotate_half")


def test_bad_transposed_names_stored_shape(key):
  layer = llama_layer(key, 16)  # (in, out), claimed (out, in): D, F read off w_gate as 128, 64
  with pytest.raises(ValueError, match=r"wq has shape \(64, 64\), expected \(64, 128\) = "
                     r"\(Hq\*hd, D\)"):
    cvt(layer, 16, "rotate_half", transposed=True)


def test_bad_options(key):
  layer = llama_layer(key, 16)
  with pytest.raises(ValueError, match="rope='gptj'"):
    cvt(layer, 16, "gptj")
  with pytest.raises(ValueError, match=r"F=128 must be a multiple of block=96"):
    layout.llama_layer_to_kernel(layer, n_q_heads=HQ, n_kv_heads=HKV, head_dim=16, block=96)


@pytest.mark.parametrize("key_, value, match", [
    ("wqkv", (D, 8 * 16 + 1), r"wqkv has shape \(64, 129\), expected \(64, 128\) = "
     r"\(D, \(Hq \+ 2 Hkv\) hd\)"),
    ("w2", (F + 1, D), r"w2 has shape \(129, 64\), expected \(128, 64\) = \(F, D\)"),
    ("g_attn", (D, 1), r"g_attn has shape \(64, 1\), expected \(64,\)"),
    ("w13", None, r"missing key 'w13'"),
])
def test_bad_kernel_layer(key, key_, value, match):
  kern = cvt(llama_layer(key, 16), 16, "interleaved")
  if value is None:
    del kern[key_]
  else:
    kern[key_] = jnp.zeros(value)
  with pytest.raises(ValueError, match=match):
    back(kern, 16, "interleaved")
