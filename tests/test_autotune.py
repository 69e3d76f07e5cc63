"""The GEMM tuning cache and search (pallas_kernels.autotune)."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import pytest

import pallas_kernels as pk
from pallas_kernels import autotune, gemm_mgpu
from pallas_kernels import EpilogueOutput, GemmConfig, InputKind, MatDim, OutputKind, Schedule

PINGPONG = GemmConfig(tile_m=128, tile_n=64, tile_k=32, stages=6, epi_tile_n=32,
                      cluster_dim=None, grid_minor_dim=MatDim.M, grid_tile_width=8,
                      schedule=Schedule.PINGPONG)


@pytest.fixture
def cache(tmp_path, monkeypatch):
  """An empty user cache; the shipped cache is hidden so that only this one answers."""
  path = tmp_path / "configs.json"
  monkeypatch.setenv(autotune.CACHE_ENV, str(path))
  monkeypatch.setattr(autotune, "SHIPPED_CACHE", tmp_path / "absent.json")
  return path


def _key(m=256, n=256, k=128, sig="prog;in=;out=out:tile:bfloat16:1;in_place=;group=1"):
  return autotune.ProblemKey(device_kind="NVIDIA H100 80GB HBM3", jax_version="0.11.2",
                             m=m, n=n, k=k, trans_a=False, trans_b=True, dtype="bfloat16",
                             signature=sig)


@pytest.mark.parametrize("cfg", [GemmConfig(), PINGPONG,
                                 GemmConfig(cluster_dim=MatDim.M, wg_dim=MatDim.N)])
def test_config_round_trip(cfg):
  d = json.loads(json.dumps(autotune.config_to_dict(cfg)))
  assert autotune.config_from_dict(d) == cfg


def test_config_from_dict_rejects_unknown():
  with pytest.raises(ValueError, match=r"unknown fields \['tile_q'\]"):
    autotune.config_from_dict({"tile_q": 3})
  with pytest.raises(ValueError, match="unknown enum value 'ZIGZAG'"):
    autotune.config_from_dict({"schedule": "ZIGZAG"})
  with pytest.raises(ValueError, match="tile_m=96 must be a multiple of 64"):
    autotune.config_from_dict({"tile_m": 96})  # the config checks itself


def test_store_then_lookup(cache):
  assert autotune.lookup(_key()) is None
  autotune.store(_key(), {"config": autotune.config_to_dict(PINGPONG), "ms": 0.1})
  assert autotune.lookup(_key()) == PINGPONG
  assert autotune.lookup(_key(k=512)) is None  # another problem (K over 2x away)
  assert autotune.lookup(dataclasses.replace(_key(), jax_version="0.12.0")) is None
  autotune.store(_key(k=512), {"config": autotune.config_to_dict(GemmConfig()), "ms": 0.2})
  assert autotune.lookup(_key()) == PINGPONG  # kept
  assert autotune.lookup(_key(k=512)) == GemmConfig()


def test_lookup_at_nearby_m(cache):
  """A problem tuned at another M serves within a factor of 2, nearest first (the
  larger on a tie), only where its config tiles this M; the exact key always wins."""
  small = GemmConfig(tile_m=64, tile_n=64, cluster_dim=None, epi_tile_n=32)  # 128 x 64 CTA
  autotune.store(_key(m=1024), {"config": autotune.config_to_dict(PINGPONG)})
  autotune.store(_key(m=4096), {"config": autotune.config_to_dict(small)})
  assert autotune.lookup_with_source(_key(m=1024)) == (PINGPONG, "tuned")
  assert autotune.lookup_with_source(_key(m=768)) == (PINGPONG, "tuned at M=1024")
  assert autotune.lookup_with_source(_key(m=512)) == (PINGPONG, "tuned at M=1024")
  assert autotune.lookup_with_source(_key(m=384)) == (None, None)  # a factor 2.7 away
  assert autotune.lookup_with_source(_key(m=3072)) == (small, "tuned at M=4096")
  # 2048 is a factor 2 from both: the larger M's config
  assert autotune.lookup_with_source(_key(m=2048)) == (small, "tuned at M=4096")
  # another N, K, order, program or jax version is another problem
  for other in (_key(m=768, n=512), _key(m=768, k=256),
                dataclasses.replace(_key(m=768), trans_b=False),
                _key(m=768, sig="other;in=;out=out:tile:bfloat16:1;in_place=;group=1"),
                dataclasses.replace(_key(m=768), jax_version="0.12.0")):
    assert autotune.lookup(other) is None, other
  # the nearest M's config (2304) does not tile M=2176 (17 x 128): the next nearest
  # (4096, whose 128-row CTA does) serves; 1024 is over a factor 2 away
  big = GemmConfig()  # 256 x 256 cluster tile
  autotune.store(_key(m=2304), {"config": autotune.config_to_dict(big)})
  assert autotune.lookup_with_source(_key(m=2176)) == (small, "tuned at M=4096")
  assert autotune.lookup_with_source(_key(m=2304)) == (big, "tuned")


def test_lookup_at_nearby_k(cache):
  """A weight gradient's tokens are its K: a problem tuned at another K serves within a
  factor of 2 where its tile_k divides this K; one at another M and K does not; an
  epilogue pass (K = 0) has no nearby K; a nearby M comes before a nearby K on a tie."""
  k64 = dataclasses.replace(PINGPONG, tile_k=64)
  autotune.store(_key(m=2048, k=16384), {"config": autotune.config_to_dict(k64)})
  assert autotune.lookup_with_source(_key(m=2048, k=16000)) == (k64, "tuned at K=16384")
  assert autotune.lookup_with_source(_key(m=2048, k=9216)) == (k64, "tuned at K=16384")
  assert autotune.lookup_with_source(_key(m=2048, k=8000)) == (None, None)  # over 2x
  assert autotune.lookup(_key(m=2048, k=16008)) is None  # 64 does not divide it
  assert autotune.lookup(_key(m=1536, k=16000)) is None  # another M and another K
  assert autotune.lookup(_key(m=2048, k=16000, n=512)) is None  # another N
  autotune.store(_key(m=2048, k=16032), {"config": autotune.config_to_dict(PINGPONG)})
  assert autotune.lookup_with_source(_key(m=2048, k=16000)) == (PINGPONG, "tuned at K=16032")
  # 16384 is nearer to 16352 (= 511 x 32), but only 16032's tile_k (32) divides it
  assert autotune.lookup_with_source(_key(m=2048, k=16352)) == (PINGPONG, "tuned at K=16032")
  no_product = GemmConfig(tile_m=64, tile_n=64, cluster_dim=None, epi_tile_n=32)
  autotune.store(_key(m=1024, k=0), {"config": autotune.config_to_dict(no_product)})
  assert autotune.lookup(_key(m=1024, k=64)) is None  # a pass is not a nearby GEMM
  assert autotune.lookup_with_source(_key(m=768, k=0)) == (no_product, "tuned at M=1024")
  # equally far in M (x2) and in K (x2): the M neighbour
  autotune.store(_key(m=512, k=128), {"config": autotune.config_to_dict(PINGPONG)})
  autotune.store(_key(m=256, k=256), {"config": autotune.config_to_dict(k64)})
  assert autotune.lookup_with_source(_key(m=256, k=128)) == (PINGPONG, "tuned at M=512")
  # an exact tie (the same factor and the same size along each): still the M neighbour
  autotune.store(_key(m=512, k=1024), {"config": autotune.config_to_dict(k64)})
  autotune.store(_key(m=1024, k=512), {"config": autotune.config_to_dict(PINGPONG)})
  assert autotune.lookup_with_source(_key(m=512, k=512)) == (PINGPONG, "tuned at M=1024")


def test_lookup_on_a_device_of_the_same_chip(cache):
  """An H200 runs the H100's config where it has none of its own (exact, then at a
  nearby M), and the other way round; its own entry, even one at a nearby M, comes
  first; a device kind of another chip, or in no group, gets none."""
  h100 = _key()
  h200 = dataclasses.replace(h100, device_kind="NVIDIA H200")
  assert autotune.same_chip_kinds("NVIDIA H200") == ("NVIDIA H100 80GB HBM3",)
  assert autotune.same_chip_kinds("NVIDIA H100 80GB HBM3") == ("NVIDIA H200",)
  assert autotune.same_chip_kinds("NVIDIA A100-SXM4-80GB") == ()
  autotune.store(h100, {"config": autotune.config_to_dict(PINGPONG)})
  assert autotune.lookup_with_source(h200) == (PINGPONG, "tuned on NVIDIA H100 80GB HBM3")
  assert autotune.lookup_with_source(dataclasses.replace(h200, m=384)) == (
      PINGPONG, "tuned at M=256 on NVIDIA H100 80GB HBM3")
  for other in ("NVIDIA A100-SXM4-80GB", "NVIDIA H100 PCIe", "cpu"):
    assert autotune.lookup_with_source(
        dataclasses.replace(h100, device_kind=other)) == (None, None), other
  # the H200's own entry at a nearby M wins over the H100's exact one
  own = GemmConfig(tile_m=64, tile_n=64, cluster_dim=None, epi_tile_n=32)
  autotune.store(dataclasses.replace(h200, m=512), {"config": autotune.config_to_dict(own)})
  assert autotune.lookup_with_source(h200) == (own, "tuned at M=512")
  assert autotune.lookup_with_source(h100) == (PINGPONG, "tuned")
  # and the other way round
  autotune.store(dataclasses.replace(h200, n=512), {"config": autotune.config_to_dict(own)})
  assert autotune.lookup_with_source(dataclasses.replace(h100, n=512)) == (
      own, "tuned on NVIDIA H200")


def test_chosen_config_names_a_nearby_m(cache):
  autotune.store(_key(m=1024), {"config": autotune.config_to_dict(PINGPONG)})
  a = jax.ShapeDtypeStruct((768, 128), jnp.bfloat16)
  b = jax.ShapeDtypeStruct((256, 128), jnp.bfloat16)
  with autotune.recording() as rec:
    jax.eval_shape(lambda a, b: pk.gemm(a, b, trans_b=True, program_id="prog",
                                        device_kind=_key().device_kind, num_sms=132), a, b)
  (problem,) = rec.values()
  assert problem.key == _key(m=768)
  assert autotune.chosen_config(problem) == (PINGPONG, "tuned at M=1024")


def test_user_cache_wins_over_shipped(cache, tmp_path, monkeypatch):
  shipped = tmp_path / "shipped.json"
  autotune.store(_key(), {"config": autotune.config_to_dict(GemmConfig())}, shipped)
  monkeypatch.setattr(autotune, "SHIPPED_CACHE", shipped)
  assert autotune.lookup(_key()) == GemmConfig()
  autotune.store(_key(), {"config": autotune.config_to_dict(PINGPONG)})
  assert autotune.lookup(_key()) == PINGPONG


def test_bad_cache_files(cache):
  cache.write_text("{not json")
  with pytest.raises(ValueError, match="is unreadable .* fix or delete it"):
    autotune.lookup(_key())
  cache.write_text(json.dumps({"format": 99, "entries": {}}))
  with pytest.raises(ValueError, match="has format 99, this library reads 1"):
    autotune.lookup(_key())


@pytest.mark.parametrize("key", [_key(), _key(m=64, sig="a;b=c:d"),
                                 dataclasses.replace(_key(), trans_a=True, trans_b=False)])
def test_problem_key_text_round_trip(key):
  assert autotune.ProblemKey.from_text(key.text()) == key


def test_problem_key_checks():
  with pytest.raises(ValueError, match="ProblemKey.m=0 must be positive"):
    _key(m=0)
  with pytest.raises(ValueError, match="ProblemKey.k=-1 must be >= 0"):
    _key(k=-1)
  assert autotune.ProblemKey.from_text(_key(k=0).text()).k == 0  # an epilogue pass
  with pytest.raises(ValueError, match="must not contain '|'"):
    _key(sig="a|b")


def test_candidates_fit_or_say_why():
  """Every candidate tiles the problem and fits in shared memory; what does not is
  listed with its reason."""
  m, n, k = 512, 1024, 256
  outputs = tuple(EpilogueOutput(f"o{i}", dtype=jnp.float32) for i in range(3))
  found, skipped = autotune.candidates(m, n, k, jnp.bfloat16, {}, {}, outputs,
                                       trans_a=False, trans_b=True)
  assert found and skipped
  assert {c.schedule for c in found} == set(Schedule)
  for cfg in found:
    gemm_mgpu._check_tiling(m, n, k, cfg, False, True)
    assert gemm_mgpu.smem_bytes(cfg, jnp.bfloat16, {}, {}, outputs) <= gemm_mgpu.SMEM_LIMIT_BYTES
  # three fp32 output tiles of 64x64 per slot and warpgroup (192 KiB): 64x64 sub-tiles leave no
  # room for two stages under either schedule
  assert any("no stage count fits" in why for _, why in skipped)
  # M = 192 does not divide a 256-row cooperative tile or a 128-row ping-pong one
  _, skipped = autotune.candidates(192, 256, 128, jnp.bfloat16, {}, {}, (EpilogueOutput("out"),),
                                   trans_a=False, trans_b=True)
  assert any("must be multiples of the cluster tile" in why for _, why in skipped)


def test_tall_pingpong_candidates():
  """The search has 192-row tiles where they tile M (or with clip_m): ping-pong ones in
  32-wide sub-tiles, cooperative ones; ``tile_m`` keeps only those
  (``bench.tune_gemm --challenge-tile-m``)."""
  outs = (EpilogueOutput("out"),)
  found, skipped = autotune.candidates(768, 512, 256, jnp.bfloat16, {}, {}, outs,
                                       trans_a=False, trans_b=True)
  tall = [c for c in found if c.tile_m == 192]
  assert {c.schedule for c in tall} == set(Schedule)
  assert all(c.epi_tile_n == 32 for c in tall if c.schedule == Schedule.PINGPONG)
  assert all(c.tile_n == 128 for c in tall)
  assert len(tall) < len(found)
  only, _ = autotune.candidates(768, 512, 256, jnp.bfloat16, {}, {}, outs,
                                trans_a=False, trans_b=True, tile_m=192)
  assert only == tall
  # M = 512: 192 does not divide it; with clip_m TMA drops the rows past it
  _, skipped = autotune.candidates(512, 512, 256, jnp.bfloat16, {}, {}, outs,
                                   trans_a=False, trans_b=True, tile_m=192)
  assert skipped and all("must be multiples of the cluster tile" in why for _, why in skipped)
  clipped, _ = autotune.candidates(512, 512, 256, jnp.bfloat16, {}, {}, outs,
                                   trans_a=False, trans_b=True, tile_m=192, clip_m=True)
  assert {c.tile_m for c in clipped} == {192}


def test_wide_candidates():
  """The search has 128 x 192 warpgroup tiles under both schedules, clustered along M
  and along N, where N is a multiple of 192 (384 clustered along N), ping-pong clustered
  along N with either grid order; ``tile_n`` keeps only those (``bench.tune_gemm
  --challenge-tile-n``)."""
  outs = (EpilogueOutput("out"),)
  found, _ = autotune.candidates(512, 768, 256, jnp.bfloat16, {}, {}, outs,
                                 trans_a=False, trans_b=True)
  wide = [c for c in found if c.tile_n == 192]
  assert {(c.schedule, c.cluster_dim) for c in wide} == {
      (s, d) for s in Schedule for d in (MatDim.M, MatDim.N)}
  assert all(c.tile_m == 128 for c in wide) and len(wide) < len(found)
  assert {c.grid_minor_dim for c in wide if c.schedule == Schedule.PINGPONG
          and c.cluster_dim == MatDim.N} == {MatDim.M, MatDim.N}
  for cfg in wide:
    gemm_mgpu._check_tiling(512, 768, 256, cfg, False, True)
  only, _ = autotune.candidates(512, 768, 256, jnp.bfloat16, {}, {}, outs,
                                trans_a=False, trans_b=True, tile_n=192)
  assert only == wide
  # N = 576 = 3 x 192: clustered along M only (a cluster along N is 384 wide)
  odd, skipped = autotune.candidates(512, 576, 256, jnp.bfloat16, {}, {}, outs,
                                     trans_a=False, trans_b=True, tile_n=192)
  assert odd and {c.cluster_dim for c in odd} == {MatDim.M}
  assert any("must be multiples of the cluster tile" in why for _, why in skipped)
  # N = 512: none
  none, skipped = autotune.candidates(512, 512, 256, jnp.bfloat16, {}, {}, outs,
                                      trans_a=False, trans_b=True, tile_n=192)
  assert not none and skipped


def test_pick_best_keeps_the_incumbent_within_the_margin():
  """``tune``'s choice: the fastest, unless the config to keep is within the margin."""
  a, b = GemmConfig(), PINGPONG
  assert autotune.pick_best({a: 1.000, b: 0.995}) == b
  assert autotune.pick_best({a: 1.000, b: 0.995}, keep=a, keep_within=0.01) == a
  assert autotune.pick_best({a: 1.000, b: 0.980}, keep=a, keep_within=0.01) == b
  assert autotune.pick_best({b: 0.980}, keep=a, keep_within=0.01) == b  # a never ran


def test_final_round_settles_the_leaders():
  """The leaders of the first pass (within the window of the fastest, at most
  ``finalists``, plus the config to keep) are timed again in turn, and the choice is
  made among them on their medians: a config whose first time was lucky does not win."""
  cfgs = {name: dataclasses.replace(GemmConfig(), stages=s, epi_tile_n=n)
          for name, s, n in [("a", 3, 32), ("b", 4, 32), ("c", 3, 64), ("d", 4, 64),
                             ("e", 2, 32), ("f", 2, 64), ("g", 3, 16)]}
  first = dict(a=1.000, b=0.990, c=1.020, d=1.100, e=1.005, f=1.010, g=1.012)
  true = dict(a=1.000, b=1.008, c=1.020, d=1.100, e=1.006, f=1.010, g=1.012)
  name_of = {c: n for n, c in cfgs.items()}
  times = {cfgs[n]: t for n, t in first.items()}
  calls = []

  def time_fn(cfg):
    calls.append(name_of[cfg])
    return true[name_of[cfg]]

  logs = []
  settled = autotune.final_round(times, time_fn, finalists=4, rounds=2, window=0.03,
                                 log=logs.append)
  # b (0.990) is the fastest; c is 3.03% slower, outside the window; g is the fifth
  assert calls == ["b", "a", "e", "f"] * 2
  assert {name_of[c]: t for c, t in settled.items()} == dict(
      b=1.008, a=1.000, e=1.006, f=1.010)
  assert autotune.pick_best(settled) == cfgs["a"]
  assert autotune.pick_best(times) == cfgs["b"]  # what one pass would have chosen
  assert "median of 3" in logs[0] and len(logs) == 5
  # the config to keep is a finalist where it is within the window, not outside it
  calls.clear()
  settled = autotune.final_round(times, time_fn, keep=cfgs["g"], finalists=4, rounds=1)
  assert calls == ["b", "a", "e", "f", "g"] and cfgs["g"] in settled
  calls.clear()
  settled = autotune.final_round(times, time_fn, keep=cfgs["d"], finalists=4, rounds=1)
  assert calls == ["b", "a", "e", "f"] and cfgs["d"] not in settled
  # a lone leader is not timed again
  calls.clear()
  alone = {cfgs["a"]: 1.0, cfgs["d"]: 1.1}
  assert autotune.final_round(alone, time_fn, log=logs.append) == {cfgs["a"]: 1.0}
  assert calls == []


def test_candidates_respect_the_column_group():
  found, _ = autotune.candidates(512, 512, 128, jnp.bfloat16, {}, {}, (EpilogueOutput("out"),),
                                 trans_a=False, trans_b=False, min_epi_tile_n=64)
  assert found and all(c.epi_tile_n % 64 == 0 for c in found)
  assert all(c.tile_k == 64 for c in found)  # B stored (K, N): MN-major needs tile_k 64


def test_wide_column_groups_store_in_halves():
  """A 128-wide column group (a RoPE or QK-norm head) keeps 128-wide sub-tiles; the
  search also stores their tile outputs in 64-wide halves, which frees shared memory:
  two bf16 outputs fit 128x128 cooperative tiles only so (Qwen3's QKV projection), and
  the heuristic picks that over the narrower tiles it fell back to before."""
  outs = (EpilogueOutput("u"), EpilogueOutput("qkv"))
  kinds, dtypes = {"r": InputKind.ROW, "f": InputKind.COL}, {"r": jnp.float32, "f": jnp.float32}
  found, skipped = autotune.candidates(4096, 4096, 2048, jnp.bfloat16, kinds, dtypes, outs,
                                       trans_a=False, trans_b=False, min_epi_tile_n=128)
  assert all(c.epi_tile_n == 128 for c in found)
  assert {c.epi_store_n for c in found} == {None, 64}
  coop = [c for c in found if c.schedule == Schedule.COOPERATIVE]
  assert coop and all(c.epi_store_n == 64 for c in coop)
  assert any("e64x128 in2" in name and "no stage count fits" in why for name, why in skipped)
  cfg = gemm_mgpu.default_config(4096, 4096, 2048, jnp.bfloat16, input_kinds=kinds,
                                 input_dtypes=dtypes, outputs=outs, min_epi_tile_n=128)
  assert (cfg.tile_m, cfg.tile_n, cfg.epi_tile_n, cfg.epi_store_n) == (128, 128, 128, 64)
  # 64-wide groups (head_dim 64): 32-wide halves only where they buy a stage, the two
  # outputs' halves sharing one ring of 2 x 64x32 instead of 2 x 2 x 64x64 whole ones
  found, _ = autotune.candidates(4096, 4096, 2048, jnp.bfloat16, kinds, dtypes, outs,
                                 trans_a=False, trans_b=False, min_epi_tile_n=64)
  halves = [c for c in found if c.epi_store_n is not None]
  assert halves and all((c.epi_tile_n, c.epi_store_n) == (64, 32) for c in halves)
  for c in halves:
    twin = [t for t in found if t.epi_store_n is None
            and dataclasses.replace(t, stages=c.stages, epi_store_n=32) == c]
    assert len(twin) == 1 and twin[0].stages < c.stages, c.describe()
    assert gemm_mgpu.smem_bytes(c, jnp.bfloat16, kinds, dtypes, outs) <= \
        gemm_mgpu.SMEM_LIMIT_BYTES
  described = {c.describe() for c in found}
  assert {"pingpong 128x128x64 s4 e64x64 clN M16",
          "pingpong 128x128x64 s6 e64x64/32 clN M16"} <= described
  # a pass has no pipeline to deepen; a program with no tile output has nothing to halve
  found, _ = autotune.candidates(4096, 4096, 0, jnp.bfloat16, kinds, dtypes, outs,
                                 trans_a=False, trans_b=False, min_epi_tile_n=64)
  assert found and {c.epi_store_n for c in found} == {None}
  lse = (EpilogueOutput("lse", OutputKind.ROW_PARTIAL, jnp.float32),)
  found, _ = autotune.candidates(4096, 4096, 2048, jnp.bfloat16, kinds, dtypes, lse,
                                 trans_a=False, trans_b=False, min_epi_tile_n=64)
  assert found and {c.epi_store_n for c in found} == {None}


def test_candidates_stage_tile_operands_one_or_two_ahead():
  """With a tile operand the default search tries one operand slot (which frees shared
  memory for a deeper pipeline) and two; --extra adds 4 and all; with no tile operand
  the slot count is moot and stays at the default."""
  kinds, dtypes = {"x0": InputKind.TILE}, {"x0": jnp.bfloat16}
  outs = (EpilogueOutput("out"),)
  found, _ = autotune.candidates(1024, 1024, 256, jnp.bfloat16, kinds, dtypes, outs,
                                 trans_a=False, trans_b=True)
  assert {c.epi_operand_slots for c in found} == {1, 2}
  shape = lambda c: (c.schedule, c.tile_m, c.tile_n, c.tile_k, c.epi_tile_n, c.wg_dim,
                     c.cluster_dim, c.grid_minor_dim, c.grid_tile_width)
  one = {shape(c): c.stages for c in found if c.epi_operand_slots == 1}
  two = {shape(c): c.stages for c in found if c.epi_operand_slots == 2}
  assert one.keys() == two.keys()
  # one slot never leaves a shallower pipeline than two
  assert all(one[s] >= two[s] for s in one)
  found, _ = autotune.candidates(1024, 1024, 256, jnp.bfloat16, kinds, dtypes, outs,
                                 trans_a=False, trans_b=True, extra=True)
  assert {1, 2, 4} <= {c.epi_operand_slots for c in found}
  found, _ = autotune.candidates(1024, 1024, 256, jnp.bfloat16, {}, {}, outs,
                                 trans_a=False, trans_b=True)
  assert {c.epi_operand_slots for c in found} == {2}


def test_candidates_one_output_slot_where_it_buys_a_stage():
  """Each candidate also comes with one staging slot per output (``epi_out_slots=1``)
  exactly where the shared memory that frees buys a deeper pipeline: the SwiGLU
  backward's program (a wide tile operand z, tile outputs y and dz, a row partial) gets
  five stages of ping-pong 128 x 128 instead of four; a pass (no pipeline) and a
  program whose outputs are all stored in parts (their slots are fixed) never do. Each
  one-slot candidate comes twice: with the slot waited for before the program and after
  it (``epi_store_wait_late``), which no two-slot candidate gets."""
  kinds, dtypes = {"z": InputKind.WIDE_TILE}, {"z": jnp.bfloat16}
  outs = (EpilogueOutput("y"), EpilogueOutput("zdz", OutputKind.ROW_PARTIAL, jnp.float32),
          EpilogueOutput("dz", width=2))
  found, _ = autotune.candidates(1024, 1024, 256, jnp.bfloat16, kinds, dtypes, outs,
                                 trans_a=False, trans_b=True)
  one = [c for c in found if c.epi_out_slots == 1]
  assert one and {c.epi_out_slots for c in found} == {1, 2}
  assert not any(c.epi_store_wait_late for c in found if c.epi_out_slots != 1)
  late = {c for c in one if c.epi_store_wait_late}
  assert late and {dataclasses.replace(c, epi_store_wait_late=False) for c in late} == \
      {c for c in one if not c.epi_store_wait_late}
  for c in one:
    two = dataclasses.replace(c, epi_out_slots=2, epi_store_wait_late=False)
    twin = [t for t in found if dataclasses.replace(t, stages=c.stages) == two]
    assert len(twin) == 1 and twin[0].stages < c.stages, c.describe()
    assert gemm_mgpu.smem_bytes(c, jnp.bfloat16, kinds, dtypes, outs) <= \
        gemm_mgpu.SMEM_LIMIT_BYTES
  described = {c.describe() for c in one}
  assert "pingpong 128x128x64 s5 e64x32 clN N16 in1 out1" in described
  assert "pingpong 128x128x64 s5 e64x32 clN N16 in1 out1 stlate" in described
  assert "pingpong 128x128x64 s4 e64x32 clN N16 in1" in {c.describe() for c in found}
  # a pass has no pipeline to deepen
  found, _ = autotune.candidates(1024, 1024, 0, jnp.bfloat16, kinds, dtypes, outs,
                                 trans_a=False, trans_b=False)
  assert found and {c.epi_out_slots for c in found} == {2}
  # 128-wide sub-tiles stored in 64-wide parts: epi_out_slots sizes nothing
  found, _ = autotune.candidates(4096, 4096, 2048, jnp.bfloat16, {}, {},
                                 (EpilogueOutput("u"), EpilogueOutput("qkv")),
                                 trans_a=False, trans_b=False, min_epi_tile_n=128)
  assert all(c.epi_out_slots == 2 for c in found if c.epi_store_n == 64)


def _abstract_gemm(program_id=None, k=128, **kw):
  a = jax.ShapeDtypeStruct((256, k), jnp.bfloat16)
  b = jax.ShapeDtypeStruct((k, 512), jnp.bfloat16)
  return jax.eval_shape(lambda a, b: pk.gemm(a, b, num_sms=2, program_id=program_id, **kw),
                        a, b)


def test_recording_collects_each_problem_once():
  with autotune.recording() as rec:
    _abstract_gemm()
    _abstract_gemm()  # the same problem
    _abstract_gemm(program_id="other")
    _abstract_gemm(k=192)
  assert len(rec) == 3
  ks = sorted((p.key.k, p.program_id or "") for p in rec.values())
  assert ks == [(128, ""), (128, "other"), (192, "")]
  p = next(iter(rec.values()))
  assert (p.key.m, p.key.n, p.a.shape, p.b.shape) == (256, 512, (256, 128), (128, 512))
  with autotune.recording() as rec2:
    pass
  assert rec2 == {}


def test_problem_random_inputs():
  """A recorded problem's inputs for timing: its shapes and dtypes, random normal floats
  (never zeros), integers in [0, 64), different per seed."""
  a = jax.ShapeDtypeStruct((256, 128), jnp.bfloat16)
  b = jax.ShapeDtypeStruct((128, 512), jnp.bfloat16)
  inputs = {"r": (InputKind.ROW, jax.ShapeDtypeStruct((256,), jnp.float32)),
            "t": (InputKind.ROW, jax.ShapeDtypeStruct((256,), jnp.int32))}
  with autotune.recording() as rec:
    jax.eval_shape(lambda a, b, r, t: pk.gemm(a, b, inputs={"r": (InputKind.ROW, r),
                                                            "t": (InputKind.ROW, t)},
                                              num_sms=2), a, b, inputs["r"][1], inputs["t"][1])
  (problem,) = rec.values()
  x, y, ops_ = problem.random_inputs()
  assert (x.shape, x.dtype, y.shape, y.dtype) == ((256, 128), jnp.bfloat16, (128, 512),
                                                  jnp.bfloat16)
  assert {nm: (v.shape, v.dtype) for nm, v in ops_.items()} == {
      "r": ((256,), jnp.float32), "t": ((256,), jnp.int32)}
  assert 0.9 < float(jnp.std(x.astype(jnp.float32))) < 1.1
  assert 0 <= int(ops_["t"].min()) and int(ops_["t"].max()) < 64 and int(ops_["t"].max()) > 0
  assert not jnp.array_equal(problem.random_inputs(seed=1)[0], x)


def test_gemm_uses_the_cached_config(cache, monkeypatch):
  """With config=None, pk.gemm takes the cache's entry for its problem (here keyed on
  this machine's device), not the heuristic."""
  with autotune.recording() as rec:
    _abstract_gemm(program_id="p")
  (problem,) = rec.values()
  chosen = []
  real = gemm_mgpu._check_tiling
  monkeypatch.setattr(gemm_mgpu, "_check_tiling",
                      lambda m, n, k, cfg, *a: (chosen.append(cfg), real(m, n, k, cfg, *a)))
  cfg = GemmConfig(tile_m=64, tile_n=64, tile_k=64, stages=3, epi_tile_n=32,
                   cluster_dim=None, schedule=Schedule.PINGPONG)
  autotune.store(problem.key, {"config": autotune.config_to_dict(cfg)})
  _abstract_gemm(program_id="p")
  _abstract_gemm(program_id="q")  # not in the cache: the heuristic default
  assert chosen[0] == cfg
  assert chosen[1] == pk.default_config(256, 512, 128, outputs=(EpilogueOutput("out"),))


def test_tune_on_the_device(cache, kernel_impl):
  """The search times each candidate, logs and skips one that fails to build, and
  records the fastest of the rest."""
  if kernel_impl != "mosaic":
    pytest.skip("autotune.tune measures on an sm90 GPU (CUPTI); here only the "
                "interpreter runs kernels")
  good = [GemmConfig(tile_m=64, tile_n=64, tile_k=64, stages=3, epi_tile_n=64,
                     cluster_dim=None, schedule=Schedule.PINGPONG),
          GemmConfig(tile_m=64, tile_n=64, tile_k=64, stages=3, epi_tile_n=64,
                     wg_dim=MatDim.N, cluster_dim=None)]
  bad = GemmConfig(tile_m=64, tile_n=64, tile_k=64, stages=3, epi_tile_n=32,
                   wg_dim=MatDim.N, cluster_dim=None)

  def epilogue(tile, acc):
    if tile.shape[1] == 32:
      raise RuntimeError("this epilogue cannot run 32-wide")
    tile.store("out", acc * tile.load("r")[:, None])

  with autotune.recording() as rec:
    jax.eval_shape(lambda a, b, r: pk.gemm(
        a, b, inputs={"r": (InputKind.ROW, r)}, epilogue=epilogue, program_id="scale",
        config=good[0]), jax.ShapeDtypeStruct((512, 256), jnp.bfloat16),
        jax.ShapeDtypeStruct((256, 512), jnp.bfloat16),
        jax.ShapeDtypeStruct((512,), jnp.float32))
  (problem,) = rec.values()
  logs = []
  record = autotune.tune(problem, configs=good + [bad], iterations=3, log=logs.append)
  assert any("skip" in s and "cannot run 32-wide" in s for s in logs), logs
  assert autotune.config_from_dict(record["config"]) in good
  assert record["timed"] >= len(good)  # and the heuristic default, unless among them
  assert record["ms"] > 0


def test_describe_workload_names_each_gemm(cache):
  with autotune.recording() as rec:
    _abstract_gemm(program_id="p")
  (problem,) = rec.values()
  tuned = dataclasses.replace(PINGPONG, tile_k=64)  # B stored (K, N) needs tile_k 64
  autotune.store(problem.key, {"config": autotune.config_to_dict(tuned)})
  a = jax.ShapeDtypeStruct((256, 128), jnp.bfloat16)
  b = jax.ShapeDtypeStruct((128, 512), jnp.bfloat16)
  DEFAULT = pk.default_config(256, 512, 128, outputs=(EpilogueOutput("out"),))
  lines = autotune.describe_workload(
      lambda a, b: (pk.gemm(a, b, num_sms=2, program_id="p"),
                    pk.gemm(a, b, num_sms=2, program_id="q")), a, b)
  assert lines == [f"256x512x128 nn p: {tuned.describe()} (tuned)",
                   f"256x512x128 nn q: {DEFAULT.describe()} (default)"]


def test_deepest_fitting_lowers_stages_until_the_config_fits():
  outputs = tuple(EpilogueOutput(f"o{i}", dtype=jnp.float32) for i in range(2))
  cfg = GemmConfig(tile_m=128, tile_n=128, tile_k=64, stages=7, epi_tile_n=32,
                   cluster_dim=None)
  fit = gemm_mgpu.deepest_fitting(cfg, jnp.bfloat16, {}, {}, outputs)
  assert 2 <= fit.stages < 7
  assert gemm_mgpu.smem_bytes(fit, jnp.bfloat16, {}, {}, outputs) <= gemm_mgpu.SMEM_LIMIT_BYTES
  deeper = dataclasses.replace(fit, stages=fit.stages + 1)
  assert gemm_mgpu.smem_bytes(deeper, jnp.bfloat16, {}, {}, outputs) > gemm_mgpu.SMEM_LIMIT_BYTES
  # three fp32 64x64 output tiles per slot and warpgroup leave no room for two stages
  wide = tuple(EpilogueOutput(f"o{i}", dtype=jnp.float32) for i in range(3))
  assert gemm_mgpu.deepest_fitting(dataclasses.replace(cfg, epi_tile_n=64), jnp.bfloat16,
                                   {}, {}, wide) is None


def test_parts_of_one_dtype_and_shape_share_one_ring():
  """Outputs stored in parts (epi_store_n) stage them through one ring of two slots per
  warpgroup for each part dtype and shape, not two slots each. Qwen3's QKV projection
  (u and qkv, bf16, 128-wide sub-tiles stored in 64-wide halves) frees 16 KiB a
  warpgroup: its ping-pong 128x128 tiles get 5 stages instead of 4, and 192x128 ones
  (the H200's choice) 4 instead of 3."""
  kinds = {"r": InputKind.ROW, "pos": InputKind.ROW, "freqs": InputKind.COL,
           "qk_w": InputKind.COL, "qk_sel": InputKind.COL}
  dtypes = {"r": jnp.float32, "pos": jnp.int32, "freqs": jnp.float32,
            "qk_w": jnp.float32, "qk_sel": jnp.float32}
  two = (EpilogueOutput("u"), EpilogueOutput("qkv"))
  cfg = GemmConfig(tile_m=128, tile_n=128, tile_k=64, stages=7, epi_tile_n=128,
                   epi_store_n=64, cluster_dim=None, schedule=Schedule.PINGPONG)
  scratch = gemm_mgpu._Epilogue.scratch(cfg, kinds, dtypes, two)
  rings = [nm for nm in scratch if nm.startswith("parts_")]
  assert len(rings) == 1 and not any(nm.startswith("o_") for nm in scratch), scratch
  assert scratch[rings[0]].shape == (2, 2, 64, 64)
  one = gemm_mgpu.smem_bytes(cfg, jnp.bfloat16, kinds, dtypes, two[:1])
  assert gemm_mgpu.smem_bytes(cfg, jnp.bfloat16, kinds, dtypes, two) == one
  assert gemm_mgpu.deepest_fitting(cfg, jnp.bfloat16, kinds, dtypes, two).stages == 5
  tall = dataclasses.replace(cfg, tile_m=192)
  assert gemm_mgpu.deepest_fitting(tall, jnp.bfloat16, kinds, dtypes, two).stages == 4
  # a part of another dtype (or shape) gets a ring of its own; whole outputs keep theirs
  mixed = two + (EpilogueOutput("f", dtype=jnp.float32),
                 EpilogueOutput("s", OutputKind.ROW_PARTIAL, jnp.float32))
  scratch = gemm_mgpu._Epilogue.scratch(cfg, kinds, dtypes, mixed)
  assert sorted(nm for nm in scratch if nm.startswith(("parts_", "o_"))) == [
      "o_s", "parts_bfloat16_64x64", "parts_float32_64x64"]
  whole = dataclasses.replace(cfg, epi_store_n=None)
  assert {nm for nm in gemm_mgpu._Epilogue.scratch(whole, kinds, dtypes, two)
          if nm.startswith(("parts_", "o_"))} == {"o_u", "o_qkv"}


def test_no_product_configs():
  """K = 0 (an epilogue pass): the heuristic and the search offer only unclustered
  cooperative configs, sized without a pipeline ring. The QK-norm backward's buffers
  (two bf16 tile operands and a bf16 output in 128-wide sub-tiles, 192 KiB with two
  slots) fit 128x128 warpgroup tiles only so: with a ring of even two 64-deep stages
  they would not."""
  kinds = {"dqkv": InputKind.TILE, "u": InputKind.TILE, "pos": InputKind.ROW,
           "f": InputKind.COL}
  dtypes = {"dqkv": jnp.bfloat16, "u": jnp.bfloat16, "pos": jnp.int32, "f": jnp.float32}
  outs = (EpilogueOutput("du"), EpilogueOutput("dw", OutputKind.COL_PARTIAL, jnp.float32),
          EpilogueOutput("udu", OutputKind.ROW_PARTIAL, jnp.float32))
  cfg = gemm_mgpu.default_config(16384, 4096, 0, jnp.bfloat16, input_kinds=kinds,
                                 input_dtypes=dtypes, outputs=outs, min_epi_tile_n=128)
  assert (cfg.schedule, cfg.cluster_dim) == (Schedule.COOPERATIVE, None)
  assert (cfg.tile_m, cfg.tile_n, cfg.epi_tile_n, cfg.epi_store_n) == (128, 128, 128, None)
  ring = gemm_mgpu.smem_bytes(cfg, jnp.bfloat16, kinds, dtypes, outs)
  assert ring > gemm_mgpu.SMEM_LIMIT_BYTES >= gemm_mgpu.smem_bytes(
      cfg, jnp.bfloat16, kinds, dtypes, outs, mainloop=False)
  found, _ = autotune.candidates(16384, 4096, 0, jnp.bfloat16, kinds, dtypes, outs,
                                 trans_a=False, trans_b=False, min_epi_tile_n=128)
  assert found and all(c.schedule == Schedule.COOPERATIVE and c.cluster_dim is None
                       for c in found)
  assert any(c.epi_store_n is None and c.epi_operand_slots == 2 for c in found)
  assert {c.tile_m for c in found} == {64, 128}  # 64-row tiles won on the H100
  # each also loading the next tile's operands under the current one, where it fits
  plain = [c for c in found if not c.epi_prefetch_next_tile]
  ahead = [c for c in found if c.epi_prefetch_next_tile]
  assert ahead and {dataclasses.replace(c, epi_prefetch_next_tile=False)
                    for c in ahead} <= set(plain)
  for c in ahead:
    assert gemm_mgpu.smem_bytes(c, jnp.bfloat16, kinds, dtypes, outs,
                                mainloop=False) <= gemm_mgpu.SMEM_LIMIT_BYTES
  mainloop, _ = autotune.candidates(16384, 4096, 256, jnp.bfloat16, kinds, dtypes, outs,
                                    trans_a=False, trans_b=False, min_epi_tile_n=128)
  assert not any(c.epi_prefetch_next_tile for c in mainloop)
  # a pass also tries sub-tiles as tall as its 128-row warpgroup tiles; GEMMs do not
  one = ({"x0": InputKind.TILE}, {"x0": jnp.bfloat16}, (EpilogueOutput("y"),))
  tall = {(c.tile_m, c.epi_tile_m) for c in autotune.candidates(
      16384, 2048, 0, jnp.bfloat16, *one, trans_a=False, trans_b=False)[0]}
  assert tall == {(128, 64), (128, 128), (64, 64)}
  assert {c.epi_tile_m for c in autotune.candidates(
      16384, 2048, 2048, jnp.bfloat16, *one, trans_a=False, trans_b=False)[0]} == {64}
  # column partials: each config also carries them down the tile, where it has more
  # than one row of sub-tiles; a program without them never does
  assert not any(c.epi_column_sums_per_tile for c in autotune.candidates(
      16384, 2048, 2048, jnp.bfloat16, *one, trans_a=False, trans_b=False)[0])
  summed = one[:2] + ((EpilogueOutput("y"), EpilogueOutput("c", OutputKind.COL_PARTIAL,
                                                             jnp.float32)),)
  found, _ = autotune.candidates(16384, 2048, 2048, jnp.bfloat16, *summed,
                                 trans_a=False, trans_b=False)
  carried = [c for c in found if c.epi_column_sums_per_tile]
  assert carried and all(c.tile_m > c.epi_tile_m for c in carried)
  assert {dataclasses.replace(c, epi_column_sums_per_tile=False) for c in carried} <= set(
      found)


def test_heuristic_carries_column_sums_down_the_tile_where_cheap():
  """The heuristic turns on ``epi_column_sums_per_tile`` where the program has column
  partials, a warpgroup tile has several sub-tiles down it, and the carried sums take
  at most ``COLUMN_SUMS_PER_TILE_MAX_REGISTERS`` a thread; not for the QK-norm
  backward's 64 x 128 sub-tiles (64 registers, 1.63x slower on the H100), nor without
  column partials."""
  col = EpilogueOutput("dg", OutputKind.COL_PARTIAL, jnp.float32)
  two = (col, EpilogueOutput("dbeta", OutputKind.COL_PARTIAL, jnp.float32),
         EpilogueOutput("dh"))
  one = (col, EpilogueOutput("dh"))
  for k, outs in ((2048, two), (2048, one), (0, one)):  # GEMMs and a K = 0 pass
    cfg = gemm_mgpu.default_config(1024, 512, k, outputs=outs)
    assert cfg.epi_column_sums_per_tile, cfg.describe()
    carried = gemm_mgpu.carried_column_registers(cfg, outs)
    assert carried == (len(outs) - 1) * cfg.epi_tile_m * cfg.epi_tile_n // 128
    assert 0 < carried <= gemm_mgpu.COLUMN_SUMS_PER_TILE_MAX_REGISTERS
    plain = gemm_mgpu.default_config(1024, 512, k, outputs=(EpilogueOutput("dh"),))
    assert not plain.epi_column_sums_per_tile
  # the pass's 64 x 64 sub-tiles with two column partials carry 64 registers
  cfg = gemm_mgpu.default_config(1024, 512, 0, outputs=two)
  assert cfg.epi_tile_n == 64 and not cfg.epi_column_sums_per_tile
  wide = gemm_mgpu.default_config(1024, 512, 0, outputs=(col, EpilogueOutput("du")),
                                  min_epi_tile_n=128)
  assert wide.epi_tile_n == 128 and not wide.epi_column_sums_per_tile
  assert gemm_mgpu.carried_column_registers(wide, (col,)) == 64


def _heavy_epilogue():
  """(input kinds, input dtypes, outputs) of an epilogue the heuristic gives 128 x 128
  ping-pong tiles: two fp32 tile operands and two tile outputs."""
  return ({"x0": InputKind.TILE, "x1": InputKind.TILE},
          {"x0": jnp.float32, "x1": jnp.float32},
          (EpilogueOutput("out"), EpilogueOutput("o2")))


@pytest.mark.parametrize("m,n,k,trans_a,clip_m,col_partials,tall", [
    (16384, 2048, 2048, False, True, 0, True),     # clipped: 0.8% of a row wasted
    (12288, 4096, 1024, False, False, 0, True),    # M a multiple of 192
    (2048, 128000, 2048, False, True, 0, True),    # an LM head's logits (N % 192 != 0)
    (16384, 2048, 2048, False, False, 0, False),   # 192 does not divide M, no clip
    (16384, 2048, 4096, False, True, 0, False),    # K past TALL_TILE_MAX_K
    (16384, 2048, 2048, True, True, 0, False),     # a weight gradient (A is (K, M))
    (4096, 4096, 2048, False, True, 0, False),     # fewer outputs than 2^25
    (1088, 32768, 2048, False, True, 0, False),    # 1152 rows for 1088: 5.9% waste
    (16384, 2048, 2048, False, True, 1, True),     # one column partial: 16 registers
    (16384, 2048, 2048, False, True, 2, False),    # two: 32 registers carried
])
def test_heuristic_tall_tiles(m, n, k, trans_a, clip_m, col_partials, tall):
  """The heuristic picks 192 x 128 ping-pong tiles (4 or more stages) for large
  problems with a light epilogue, K <= TALL_TILE_MAX_K and A stored (M, K), where 192
  divides M or clipping wastes little of it, with at most one column partial carried
  down the tile (``gemm_mgpu._tall_tiles_pay``); a heavy epilogue keeps 128 x 128
  ping-pong, everything else the cooperative tiles."""
  outs = (EpilogueOutput("out"),) + tuple(
      EpilogueOutput(f"cs{i}", OutputKind.COL_PARTIAL, jnp.float32)
      for i in range(col_partials))
  cfg = gemm_mgpu.default_config(m, n, k, outputs=outs, trans_a=trans_a, clip_m=clip_m)
  got = (cfg.schedule, cfg.tile_m) == (Schedule.PINGPONG, gemm_mgpu.TALL_TILE_M)
  assert got == tall, cfg.describe()
  if tall:
    assert cfg.stages >= gemm_mgpu.TALL_TILE_MIN_STAGES and cfg.cluster_dim == MatDim.N
    assert (gemm_mgpu.carried_column_registers(cfg, outs)
            <= gemm_mgpu.TALL_TILE_MAX_CARRIED_REGISTERS)
    assert cfg.epi_column_sums_per_tile == bool(col_partials), cfg.describe()
  # a heavy epilogue (two tile operands, two tile outputs) keeps 128 x 128 ping-pong
  kinds, dtypes, outs = _heavy_epilogue()
  heavy = gemm_mgpu.default_config(m, n, k, input_kinds=kinds, input_dtypes=dtypes,
                                   outputs=outs, trans_a=trans_a, clip_m=clip_m)
  assert heavy.tile_m == 128, heavy.describe()


@pytest.mark.parametrize("m,n,k,trans_a,col_partials,heavy,want", [
    (16384, 6144, 2048, False, 0, False, "pingpong"),   # was tall 192 x 128
    (2048, 128256, 2048, False, 0, False, "pingpong"),  # an LM head's logits, M = 2048
    (16384, 6144, 4096, False, 0, False, "pingpong"),   # was cooperative 256 x 128
    (16384, 6144, 8192, False, 0, False, "cooperative"),  # K past WIDE_PINGPONG_MAX_K
    (4096, 128256, 2048, True, 0, False, "pingpong"),   # an LM head's dW chunk, A (K, M)
    (2048, 3072, 16384, True, 0, False, "cooperative"),   # dW: one round for two
    (2048, 12288, 16384, True, 0, False, "cooperative"),  # dW: 4 rounds for 6
    (1024, 4224, 16384, True, 0, False, None),  # 132 narrow tiles, one round: as long
    (16384, 4096, 2048, False, 0, False, None),         # 192 does not divide N
    (16384, 6144, 2048, False, 2, False, None),         # two column partials carried
    (16384, 6144, 2048, False, 0, True, None),  # heavy, fp32 operands: under 4 stages
])
def test_heuristic_wide_tiles(m, n, k, trans_a, col_partials, heavy, want, monkeypatch):
  """The heuristic picks 128 x 192 ping-pong tiles (clusters along M) for large
  problems with a light epilogue, N a multiple of 192 and K <= WIDE_PINGPONG_MAX_K, A in
  either order; 256 x 192 cooperative CTA tiles (32-wide sub-tiles) where the rounds
  of tiles over 132 SMs favour them (``gemm_mgpu._wide_pingpong_pays``,
  ``_wide_cooperative_pays``); with both turned off, what it picked before."""
  outs = (EpilogueOutput("out"),) + tuple(
      EpilogueOutput(f"cs{i}", OutputKind.COL_PARTIAL, jnp.float32)
      for i in range(col_partials))
  kinds, dtypes = {}, {}
  if heavy:
    kinds, dtypes, outs = _heavy_epilogue()

  def heuristic():
    return gemm_mgpu.default_config(m, n, k, input_kinds=kinds, input_dtypes=dtypes,
                                    outputs=outs, trans_a=trans_a, clip_m=True)

  cfg = heuristic()
  got = cfg.schedule.name.lower() if cfg.tile_n == gemm_mgpu.WIDE_TILE_N else None
  assert got == want, cfg.describe()
  if want == "pingpong":
    assert (cfg.tile_m, cfg.cluster_dim) == (128, MatDim.M), cfg.describe()
    assert cfg.stages >= gemm_mgpu.TALL_TILE_MIN_STAGES, cfg.describe()
  if want == "cooperative":
    assert (cfg.tile_m, cfg.wg_dim, cfg.epi_tile_n) == (128, MatDim.M, 32), cfg.describe()
    assert cfg.cta_tile == (256, gemm_mgpu.WIDE_TILE_N), cfg.describe()
  monkeypatch.setattr(gemm_mgpu, "WIDE_PINGPONG_MAX_K", 0)
  monkeypatch.setattr(gemm_mgpu, "WIDE_COOPERATIVE_GAIN", -1.0)
  before = heuristic()
  assert before.tile_n == 128, before.describe()
  if want is None:
    assert before == cfg, (before.describe(), cfg.describe())


@pytest.mark.parametrize("m,n,k,wide_operand,wide", [
    (16384, 3072, 2048, False, True),    # rounds level: 16 of 1.5 for 24
    (32768, 1536, 2048, False, True),
    (4096, 12288, 2048, False, True),
    (16384, 6144, 2048, False, False),   # 32 rounds of 1.5 for 47: turned down
    (16384, 3072, 2048, True, False),    # SwiGLU's double-width z: fewer than 4 stages
    (16384, 2048, 2048, False, False),   # 192 does not divide N
])
def test_heuristic_wide_tiles_heavy_epilogue(m, n, k, wide_operand, wide, monkeypatch):
  """A heavy epilogue gets 128 x 192 ping-pong tiles clustered along N before 128 x 128
  ones where N is a multiple of 192, K <= WIDE_HEAVY_MAX_K, 4 stages fit (not beside a
  double-width tile operand) and its rounds of tiles over the SMs are no longer
  (``gemm_mgpu._wide_heavy_pays``); with WIDE_HEAVY_MAX_K = 0, the 128 x 128 tiles. The
  epilogue is shaped as residual + statistics (a bf16 tile operand, two bf16 tile
  outputs, row partials: 6 bytes an element)."""
  kinds, dtypes = {"x0": InputKind.TILE}, {"x0": jnp.bfloat16}
  outs = (EpilogueOutput("x1"), EpilogueOutput("h"),
          EpilogueOutput("ss", OutputKind.ROW_PARTIAL, jnp.float32))
  if wide_operand:
    kinds = dict(kinds, z=InputKind.WIDE_TILE)
    dtypes = dict(dtypes, z=jnp.bfloat16)

  def heuristic():
    return gemm_mgpu.default_config(m, n, k, input_kinds=kinds, input_dtypes=dtypes,
                                    outputs=outs, clip_m=True)

  cfg = heuristic()
  assert cfg.schedule == Schedule.PINGPONG, cfg.describe()
  assert (cfg.tile_m, cfg.tile_n) == ((128, 192) if wide else (128, 128)), cfg.describe()
  if wide:
    assert cfg.cluster_dim == MatDim.N, cfg.describe()
    assert cfg.stages >= gemm_mgpu.TALL_TILE_MIN_STAGES, cfg.describe()
  monkeypatch.setattr(gemm_mgpu, "WIDE_HEAVY_MAX_K", 0)
  assert heuristic().tile_n == 128, heuristic().describe()


def test_heuristic_tall_tiles_need_four_stages(monkeypatch):
  """Where only 3 stages of 64 fit beside the epilogue's buffers (a bf16 tile operand
  in 128-wide sub-tiles), the heuristic passes over the tall tiles: 3 stages ran up to
  1.9x slower than cooperative tiles. TALL_TILE_MIN_STAGES is what decides."""
  kinds, dtypes, outs = {"t": InputKind.TILE}, {"t": jnp.bfloat16}, (EpilogueOutput("out"),)

  def heuristic():
    return gemm_mgpu.default_config(16384, 4096, 2048, input_kinds=kinds,
                                    input_dtypes=dtypes, outputs=outs, min_epi_tile_n=128,
                                    clip_m=True)

  assert gemm_mgpu.epilogue_bytes_per_element(kinds, dtypes, outs) * 2048 / 2048 <= 4
  cfg = heuristic()
  assert cfg.tile_m == 128 and cfg.schedule == Schedule.COOPERATIVE, cfg.describe()
  monkeypatch.setattr(gemm_mgpu, "TALL_TILE_MIN_STAGES", 3)
  relaxed = heuristic()
  assert (relaxed.tile_m, relaxed.stages) == (192, 3), relaxed.describe()


def test_shipped_entries_are_live():
  """Every shipped entry can serve: its config loads (and so checks itself), tiles its
  own problem (M clipped where the op allows it), is keyed by this jax's version (a
  version bump would leave the whole cache unread), and is for a device kind in a
  ``SAME_CHIP`` group (a new kind is named there, with its measurement)."""
  entries = json.loads(autotune.SHIPPED_CACHE.read_text())["entries"]
  kinds = {kind for group in autotune.SAME_CHIP for kind in group}
  assert len(entries) > 100
  for text, entry in entries.items():
    key = autotune.ProblemKey.from_text(text)
    assert key.text() == text
    assert key.jax_version == jax.__version__, text
    assert key.device_kind in kinds, text
    cfg = autotune.config_from_dict(entry["config"])
    gemm_mgpu._check_tiling(key.m, key.n, key.k, cfg, key.trans_a, key.trans_b,
                            clip_m=True)
