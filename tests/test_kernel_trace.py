"""Kernel traces: ``gemm_mgpu.traced`` (the on-device profiler's settings) and
``bench.kernel_trace`` (a trace reduced to cycles per tile by region)."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench import kernel_trace as KT
from pallas_kernels import gemm_mgpu as g

START_NS = 5_000_000.0  # the profiler's per-warpgroup start time (globaltimer, ns)


def _events(tid, spans, start_ns=START_NS):
  """Chrome trace events as Mosaic GPU's profiler writes them: ts = (start ns + cycles
  since the first event) / 1000. ``spans``: (name, begin cycle, end cycle), nested
  spans listed after the span holding them."""
  marks = []
  for name, t0, t1 in spans:
    marks += [(t0, 1, name, "B"), (t1, 0, name, "E")]
  # at one cycle: ends before begins, outer begins before inner ones (listed first)
  marks.sort(key=lambda e: (e[0], e[1]))
  first = marks[0][0]
  return [dict(name=name, ph=ph, ts=(start_ns + t - first) / 1e3, pid=1, tid=tid)
          for t, _, name, ph in marks]


def _compute_warpgroup(offset, tiles, period, stage_waits, epi_waits):
  """A compute warpgroup's spans: ``tiles`` tiles a ``period`` apart, each a mainloop
  whose first stage wait is 1000 cycles and later ones ``stage_waits`` (a list), then
  an epilogue holding one turn wait of 50, two operand waits of 30 and 40 and a store
  wait of ``epi_waits``."""
  spans = []
  for t in range(tiles):
    t0 = offset + t * period
    main_end = t0 + 20_000
    spans.append(("mainloop", t0, main_end))
    c = t0 + 10
    for w in [1000, *stage_waits]:
      spans.append(("wait_stage", c, c + w))
      c += w + 500
    e0 = main_end + 20
    spans.append(("epilogue", e0, e0 + 9_000))
    spans += [("wait_turn", e0 + 10, e0 + 60), ("wait_operand", e0 + 100, e0 + 130),
              ("wait_operand", e0 + 200, e0 + 240), ("wait_store", e0 + 300, e0 + 300 + epi_waits)]
  return spans


def _write(tmp_path, events, name="t.json"):
  path = tmp_path / name
  path.write_text(json.dumps({"displayTimeUnit": "ns", "traceEvents": events}))
  return path


def test_summary_of_a_known_trace(tmp_path):
  """Two compute warpgroups with known regions and a memory warpgroup that waits for
  slots 3/4 of its span: the medians come back as built, the first and last tile of
  each warpgroup left out (their store waits are made different, so a median that
  took them would show)."""
  ev = []
  for tid, offset in ((1, 0), (2, 25_000)):
    spans = _compute_warpgroup(offset, 6, 50_000, [100, 200, 300], 70)
    # first and last tiles: other store waits (excluded from the medians)
    for t in (0, 5):
      e0 = offset + t * 50_000 + 20_020
      i = spans.index(("wait_store", e0 + 300, e0 + 370))
      spans[i] = ("wait_store", e0 + 300, e0 + 300 + 5_000)
    ev += _events(tid, spans)
  ev += _events(3, [("wait_slot", 0, 3_000), ("wait_slot", 3_100, 3_400),
                    ("wait_slot", 3_500, 3_700), ("wait_slot", 3_800, 4_000)])
  path = _write(tmp_path, ev)
  s = KT.summarise(path)
  assert s["tiles"] == 8  # 6 tiles per warpgroup, 4 measured, 2 warpgroups
  assert s["period"] == pytest.approx(50_000)
  assert s["mainloop"] == pytest.approx(20_000)
  assert s["first"] == pytest.approx(1_000)
  assert s["stages"] == pytest.approx(600)
  assert s["epilogue"] == pytest.approx(9_000)
  assert (s["turn"], s["operand"], s["store"]) == pytest.approx((50, 70, 70))
  assert s["work"] == pytest.approx(9_000 - 50 - 70 - 70)
  assert s["slot"] == pytest.approx(3_700 / 4_000)
  assert KT.stage_waits_by_step(path) == pytest.approx([1000, 100, 200, 300])
  table = KT.table({"k": s})
  assert table.splitlines()[0].startswith("| kernel | tiles | per wg | period |")
  assert "| k | 8 | 4 | 50,000 | 20,000 | 1,000 | 600 | 9,000 | 50 | 70 | 70 | 8,810 | 0.93 |" in table
  assert "per wg:" not in table  # four middle tiles a warpgroup: the steady state


def test_a_trace_without_waits_and_one_that_holds_the_start_only(tmp_path):
  """A trace noted with ``traced(waits=False)`` has mainloops and epilogues only: its
  wait columns are unknown ("-"), not zero. One whose warpgroups noted three tiles each
  gives a summary of one middle tile a warpgroup, which the table flags; ``by_tile``
  shows the first tile's longer period apart from the later ones."""
  def coarse(tid, offset, n, first_period=None):
    spans, t0 = [], offset
    for t in range(n):
      spans += [("mainloop", t0, t0 + 20_000), ("epilogue", t0 + 20_020, t0 + 29_020)]
      t0 += first_period if (t == 0 and first_period) else 40_000
    return _events(tid, spans)
  memory = _events(3, [("Init", 0, 900)])  # Mosaic GPU's own region: no slot waits noted
  many = _write(tmp_path, coarse(1, 0, 8, 55_000) + coarse(2, 20_000, 8, 55_000) + memory,
                "many.json")
  s = KT.summarise(many)
  assert (s["tiles"], s["per wg"]) == (12, 6)
  assert s["period"] == pytest.approx(40_000) and s["epilogue"] == pytest.approx(9_000)
  for col in ("first", "stages", "turn", "operand", "store", "work", "slot"):
    assert np.isnan(s[col]), col
  table = KT.table({"coarse": s})
  assert "| coarse | 12 | 6 | 40,000 | 20,000 | - | - | 9,000 | - | - | - | - | - |" in table
  assert "per wg:" not in table
  rows = KT.by_tile(many)
  assert [r["tile"] for r in rows] == list(range(8))
  assert rows[0]["period"] == pytest.approx(55_000) and rows[1]["period"] == pytest.approx(40_000)
  assert rows[0]["warpgroups"] == 2 and np.isnan(rows[-1]["period"])
  start = KT.summarise(_write(tmp_path, coarse(1, 0, 3) + coarse(2, 20_000, 4), "start.json"))
  assert (start["tiles"], start["per wg"]) == (3, 1)
  assert f"Under {KT.STEADY_TILES} (start)" in KT.table({"start": start})


def test_traces_keep_their_own_clock(tmp_path):
  """Each trace's times are cycles from its own first event: a warpgroup whose start
  time is another's gives the same summary (cycles, not the ns offset)."""
  spans = _compute_warpgroup(0, 4, 40_000, [10], 5)
  a = KT.summarise(_write(tmp_path, _events(1, spans), "a.json"))
  b = KT.summarise(_write(tmp_path, _events(1, spans, start_ns=9e9), "b.json"))
  slotless = lambda s: {k: v for k, v in s.items() if k != "slot"}
  assert slotless(a) == slotless(b) and a["period"] == pytest.approx(40_000)
  assert np.isnan(a["slot"]) and np.isnan(b["slot"])  # no memory warpgroup traced


def test_crossed_regions_and_short_traces_are_refused(tmp_path):
  crossed = [dict(name="mainloop", ph="B", ts=0.0, pid=1, tid=1),
             dict(name="epilogue", ph="B", ts=1.0, pid=1, tid=1),
             dict(name="mainloop", ph="E", ts=2.0, pid=1, tid=1),
             dict(name="epilogue", ph="E", ts=3.0, pid=1, tid=1)]
  with pytest.raises(ValueError, match="closes 'mainloop' inside 'epilogue'"):
    KT.regions(_write(tmp_path, crossed, "crossed.json"))
  two = _events(1, _compute_warpgroup(0, 2, 40_000, [10], 5))
  with pytest.raises(ValueError, match="two whole tiles; raise traced"):
    KT.summarise(_write(tmp_path, two, "two.json"))
  with pytest.raises(ValueError, match="no whole mainloop with stage waits"):
    KT.stage_waits_by_step(_write(tmp_path, two, "two.json"))


def test_traced_sizes_the_profiler_to_the_free_shared_memory(tmp_path):
  assert g._trace_params(100_000, 3) == {}  # off outside the context
  with g.traced(str(tmp_path / "tr"), regions=100):
    assert (tmp_path / "tr").is_dir()
    p = g._trace_params(100_000, 3)
    assert p == dict(profile_space=100, profile_dir=str(tmp_path / "tr"),
                     profile_bounds_check=True)
    # 1,000 bytes free beside the kernel: (1000 - 36) // 48 = 20 regions per warpgroup
    assert g._trace_params(g.SMEM_LIMIT_BYTES - 1_000, 3)["profile_space"] == 20
    with pytest.raises(ValueError, match="too few for the profiler's buffer"):
      g._trace_params(g.SMEM_LIMIT_BYTES - 40, 3)
    with g.traced(str(tmp_path / "inner"), regions=7):
      assert g._trace_params(0, 2)["profile_dir"] == str(tmp_path / "inner")
    assert g._trace_params(0, 2)["profile_dir"] == str(tmp_path / "tr")
  assert g._trace_params(0, 3) == {}
  with pytest.raises(ValueError, match="name a folder"):
    with g.traced(""):
      pass
  with pytest.raises(ValueError, match="at least one region"):
    with g.traced(str(tmp_path), regions=0):
      pass


def test_waits_are_noted_unless_the_trace_leaves_them_out(tmp_path):
  """``_wait_scope``: a named region (which emits nothing untraced) outside ``traced``
  and under ``traced()``; no region under ``traced(waits=False)``, restored after."""
  named = type(jax.named_scope("x"))
  assert isinstance(g._wait_scope("wait_stage"), named)
  with g.traced(str(tmp_path)):
    assert isinstance(g._wait_scope("wait_stage"), named)
    with g.traced(str(tmp_path), waits=False):
      assert not isinstance(g._wait_scope("wait_stage"), named)
    assert isinstance(g._wait_scope("wait_store"), named)
  assert isinstance(g._wait_scope("wait_operand"), named)


def test_a_traced_kernel_computes_the_same_and_notes_its_tiles(key, kernel_impl, tmp_path):
  """On the GPU: a ping-pong GEMM with a staged operand and two outputs, traced, gives
  the same bits as untraced, and its trace holds each compute warpgroup's tiles with
  their mainloop, stage and epilogue regions."""
  if kernel_impl != "mosaic":
    pytest.skip("the on-device profiler runs in compiled kernels only: this runs on an "
                "sm90 GPU")
  import coda_jax as cj
  k1, k2, k3 = jax.random.split(key, 3)
  # 64 x 16 tiles of 128 x 128 over the SMs: each warpgroup takes three or more, so
  # its middle ones have a period and make the summary
  m, k, n = 8192, 256, 2048
  a = jax.random.normal(k1, (m, k), jnp.bfloat16)
  b = jax.random.normal(k2, (k, n), jnp.bfloat16)
  x0 = jax.random.normal(k3, (m, n), jnp.bfloat16)
  cfg = g.GemmConfig(tile_m=128, tile_n=128, tile_k=64, stages=4,
                     schedule=g.Schedule.PINGPONG, epi_tile_n=32)
  program = [cj.AddTile("x0"), cj.Store("x1"), cj.ScaleConst(2.0), cj.Store("h")]
  run = lambda: jax.jit(lambda a, b, x0: cj.gemm_epilogue(
      a, b, program, {"x0": x0}, impl="mosaic", config=cfg))(a, b, x0)
  want = run()
  with g.traced(str(tmp_path)):
    got = run()
  for nm in want:
    np.testing.assert_array_equal(np.asarray(got[nm]), np.asarray(want[nm]), err_msg=nm)
  [path] = list(tmp_path.glob("*.json"))
  traces = KT.regions(path)
  compute = KT._compute_traces(traces)
  assert len(compute) == 2 * jax.devices()[0].core_count  # one CTA per SM, unclustered
  names = {r[0] for rs in compute.values() for r in rs}
  assert {"mainloop", "epilogue", "wait_stage", "wait_operand", "wait_store"} <= names
  # each whole tile's mainloop holds one stage wait per K step
  for rs in compute.values():
    mains = [r for r in rs if r[0] == "mainloop"]
    assert len(KT.tiles(rs)) >= 2
    for (_, m0, m1), t in zip(mains, KT.tiles(rs)):
      waits = [r for r in rs if r[0] == "wait_stage" and m0 <= r[1] < m1]
      assert len(waits) == k // cfg.tile_k and t["epilogue"] > 0
  s = KT.summarise(path)
  assert s["period"] > s["epilogue"] > 0
  assert len(KT.stage_waits_by_step(path)) == k // cfg.tile_k
  # without the waits: the same bits, mainloops and epilogues only, and at least as
  # many tiles a warpgroup in the same buffer
  with g.traced(str(tmp_path / "coarse"), regions=64, waits=False):
    coarse = run()
  for nm in want:
    np.testing.assert_array_equal(np.asarray(coarse[nm]), np.asarray(want[nm]), err_msg=nm)
  [cpath] = list((tmp_path / "coarse").glob("*.json"))
  ccompute = KT._compute_traces(KT.regions(cpath))
  names = {r[0] for rs in ccompute.values() for r in rs}  # with Mosaic GPU's own "Init"
  assert {"mainloop", "epilogue"} <= names and not any(n.startswith("wait_") for n in names)
  with g.traced(str(tmp_path / "fine"), regions=64):
    run()
  [fpath] = list((tmp_path / "fine").glob("*.json"))
  count = lambda p: sum(len(KT.tiles(rs)) for rs in KT._compute_traces(KT.regions(p)).values())
  # 64 regions hold under three tiles of 4 K steps and 8 sub-tiles with their waits, and
  # all of a warpgroup's three or four without them
  assert count(cpath) > count(fpath)
