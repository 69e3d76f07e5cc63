"""Fills the GEMM tuning cache: finds the GEMMs a workload runs, searches configs for
each on the device, and writes the winners. GPU host only.

    PYTHONPATH=. python -m bench.tune_gemm --workloads bench,block-1b,block-8b
    PYTHONPATH=. python -m bench.tune_gemm --workloads bench --shapes 16384x2048x2048 \\
        --programs plain,residual_sumsq_aux --out /tmp/cache.json

Workloads are traced abstractly (nothing runs) with ``pallas_kernels.autotune.recording``
to collect every distinct GEMM problem: the epilogue programs of bench/gemm_epilogue.py
at its shapes (``bench``), and the fused Llama block forward, forward+backward and
post-block forward+backward of bench/block.py (``block-1b``, ``block-8b``), and the
GPT-2 and Qwen3 shifted blocks of bench/family_blocks.py (``family-gpt2_1b``,
``family-qwen3_1.7b``), and the main job's fused train step (``train-llama-3-8b:4``:
config, layers, batch rows). ``--list`` says where each one's config would come from:
tuned at its shape, tuned at a nearby M or K, either on another device kind of the same
chip (``autotune.SAME_CHIP``: "tuned on NVIDIA H100 80GB HBM3"), or NOT TUNED (the
heuristic); an entry at the problem's own key also says how many configs its search
timed ("tuned, 3 configs timed": a ``--same-shape`` or challenge entry, worth a whole
search). Each problem is then tuned (``autotune.tune``: both schedules, tiles,
clusters, grid orders, epilogue widths, the deepest pipeline that fits) and written into
``--out``, by default the cache shipped with the library,
``pallas_kernels/tuned/gemm_configs.json``. A challenge or ``--same-shape`` run writes
no winner that the caches already serve from a nearby size or a same-chip sibling's
entry (``already_served``); a whole search writes it as the problem's own entry
(``writes_served_winner``). The config that
serves a problem now (``incumbent``: its ``--out`` entry on ``--retune``, else what the
caches serve) is timed with the candidates and kept unless another is more than 1%
faster on settled times (``autotune.final_round``), so an entry does not change on noise.
A challenge or ``--same-shape`` run that keeps the config ``--out``'s entry already holds
leaves that entry as it was, with its record of the search that found it
(``keeps_entry``).
Every
candidate's time and every skipped candidate's reason is printed; the table printed
last has the winner against the heuristic default for each problem.
``--same-shape`` times only the configs that other programs' entries hold at the
problem's shape (or a nearby M or K) and the heuristic: a new program at a shape tuned
for another gets a measured entry in seconds instead of a whole search.
``--challenge-tile-m 192`` times each problem's current config against the search's
192-row candidates only, and keeps the current one unless another is more than 1%
faster (a new tile height, without a whole search); ``--challenge-tile-n 192`` likewise
against the 192-column ones, and both together against the candidates with both.
``--challenge-variant 'epi_column_sums_per_tile=True'`` does the same against the
current config with those fields replaced (a new knob, without a whole search).

Most of a cold search's time on the GPU host is lowering the candidates' kernels (Mosaic
GPU lowers in Python, 1-3 s a kernel; the compile and the timing after it take far
less), and lowering needs no GPU. So, on a machine without one:

    PYTHONPATH=. python -m bench.tune_gemm --workloads family-qwen3_1.7b --device h200 \
        --lower-only devrun/kernels

lowers every kernel that the same command compiles on an H200 (``plan`` and
``autotune.search_configs``: the candidates, the incumbent, the heuristic default) into
that kernel-cache folder, keyed for the H200 (``kernel_cache.keyed_for``). Carry the
folder to the host and run the command there without the two flags, with
``CODA_JAX_KERNEL_CACHE=devrun/kernels``: the search reads each kernel instead of lowering
it. Its last lines say how many kernels it read and how many it lowered (any that
differ: another source tree, jax version or device kind). Measured on an H200: bias +
LayerNorm statistics' wider search (156 kernels) in 37 s, which cold had not finished in
360 s; GPT-2's seven block problems (235 kernels) in 74 s; every kernel read from the
folder. Lowering them here took ~2 s a kernel on one core. The folder holds ~160 KB a
kernel (a third of that compressed). Any change to ``pallas_kernels``' source gives new
keys: lower from the tree that travels.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import datetime
import functools
import json
import re
import sys
import time
from pathlib import Path

import jax

from pallas_kernels import autotune, kernel_cache
from pallas_kernels.gemm_mgpu import GemmConfig
from bench import common, lowering_time


def bench_problems(shapes, programs):
  from bench import gemm_epilogue as ge
  found = {}
  for m, k, n in shapes:
    x = jax.eval_shape(lambda: ge.with_blocked_weights(ge.make_inputs(m, k, n, jax.random.key(0))))
    progs = ge.programs(n)
    for name in (list(progs) if programs == "all" else programs.split(",")):
      with autotune.recording() as rec:
        jax.eval_shape(progs[name][0], x)
      for key_text, problem in rec.items():
        found.setdefault(key_text, (f"{name} {m}x{k}x{n}", problem))
  return found


def block_problems(shape_name):
  from bench import block as bb
  from coda_jax import blocks
  s = bb.SHAPES[shape_name]
  x = jax.eval_shape(lambda: bb.make_inputs(s, jax.random.key(0)))
  std, pos, tgt = x["params"], x["positions"], x["targets"]
  cfg, post_cfg = bb.block_configs(s)
  mine = jax.eval_shape(lambda p: bb.ours_params(p, blocks.SHIFTED_KEYS), std)
  post = jax.eval_shape(lambda p: bb.ours_params(p, blocks.POST_KEYS), std)
  block = lambda a, b, c, p: blocks.shifted_block(a, b, c, p, cfg)
  # the post-block with each way of forming the head's gradient (BlockConfig.head_grad)
  loss = lambda a, b, t, p, head_grad: blocks.post_block(
      a, b, t, p, dataclasses.replace(post_cfg, head_grad=head_grad))
  found = {}
  for what, fn, args in [
      ("block fwd+bwd", bb.fwd_bwd(block), (x["x0"], x["y0"], pos, mine, x["cts"])),
      *[(f"post-block fwd+bwd ({g} head)",
         jax.grad(functools.partial(loss, head_grad=g), argnums=(0, 1, 3)),
         (x["x0"], x["y0"], tgt, post)) for g in ("logits", "exp")]]:
    with autotune.recording() as rec:
      jax.eval_shape(fn, *args)
    for key_text, problem in rec.items():
      found.setdefault(key_text, (f"{shape_name} {what}", problem))
  return found


def family_problems(shape_name):
  """The GEMMs of bench/family_blocks.py's shifted block at one of its shapes
  (``gpt2_1b``, ``qwen3_1.7b``): its forward+backward's, then those that only its forward
  alone runs (a forward that keeps no residuals for a backward runs other programs, e.g.
  Qwen3's SwiGLU without storing z)."""
  from bench import family_blocks as fb
  s = fb.SHAPES[shape_name]
  x = jax.eval_shape(lambda: fb.inputs(s, jax.random.key(0)))
  found = {}
  for _, backward, fn, args, *_ in sorted(fb.cases(s, x, "auto"), key=lambda c: not c[1]):
    with autotune.recording() as rec:
      jax.eval_shape(fn, *args)
    where = f"{shape_name} block {'fwd+bwd' if backward else 'fwd'}"
    found.update({k: (where, problem) for k, problem in rec.items() if k not in found})
  return found


def train_problems(spec: str):
  """The GEMMs of the main job's fused train step for ``CONFIG:LAYERS[:BATCH]`` (batch
  of 2048-token rows, default 8), as bench/train.py runs it: weight gradients
  accumulated in fp32, which the block workloads (bf16 weights) do not trace."""
  name, _, rest = spec.partition(":")
  layers, _, batch = rest.partition(":")
  step, args = lowering_time.abstract_train_step(name, int(layers) if layers else None,
                                                 int(batch or 8))
  with autotune.recording() as rec:
    jax.eval_shape(step, *args)
  return {k: (f"train {spec}", problem) for k, problem in rec.items()}


# A challenger, or a search's winner (``incumbent``), replaces the config serving a
# problem only when faster by more than this: repeated timings of one config in one
# process differ by up to ~1% (the heuristic default and an equal-but-for-grid-order
# config 0.2-1% apart in the challenge logs), and a cache entry should not change on
# noise.
CHALLENGE_MARGIN = 0.01


def challengers(problem: autotune.Problem, tile_m: int | None, extra: bool = False,
                tile_n: int | None = None):
  """The current config of ``problem`` (from the cache at ``autotune.lookup``'s path,
  or the heuristic) first, then the search's candidates with ``tile_m``-row and
  ``tile_n``-column warpgroup tiles (None: any); None when no such candidate tiles the
  problem and fits. ``autotune.tune`` times them (and the heuristic) in one process and
  keeps the current config unless another is faster by more than ``CHALLENGE_MARGIN``."""
  found, _ = problem.candidates(extra=extra, tile_m=tile_m, tile_n=tile_n)
  if not found:
    return None
  current, _ = autotune.chosen_config(problem)
  return [current] + [c for c in found if c != current]


def variant_challenger(problem: autotune.Problem, overrides: dict):
  """The current config of ``problem`` first, then the same config with ``overrides``
  (``GemmConfig`` fields; stages lowered until it fits); None when the variant is the
  current config or fits at no stage count."""
  current, _ = autotune.chosen_config(problem)
  variant = problem.deepest_fitting(dataclasses.replace(current, **overrides))
  if variant is None or variant == current:
    return None
  return [current, variant]


def same_shape_configs(problem: autotune.Problem) -> list[GemmConfig] | None:
  """``--same-shape``: the configs that the caches hold for this problem's M x N x K
  (or the same at a nearby M or K, ``autotune.NEARBY_FACTOR``), operand orders and dtype
  under any other program, on this device kind or a same-chip sibling
  (``autotune.same_chip_kinds``), nearest size and own kind first, each with the most
  stages that fit this program's staging; None where there are none. A new epilogue
  program at a shape tuned for another (one that drops or adds a cheap step) then gets a
  measured entry from a few candidates instead of a whole search.

  Args:
    problem: the tuning problem.

  Returns:
    The distinct configs that tile the problem and fit, or None.
  """
  key = problem.key
  kinds = (key.device_kind,) + autotune.same_chip_kinds(key.device_kind)
  found = []
  for other, entry in autotune.cached_entries():
    if other.device_kind not in kinds or other.signature == key.signature:
      continue
    as_this = dataclasses.replace(other, device_kind=key.device_kind,
                                  signature=key.signature)
    order = (0.0,) if as_this == key else autotune.nearby(key, as_this)
    if order is not None:
      found.append((order[:3], kinds.index(other.device_kind),
                    autotune.config_from_dict(entry["config"])))
  configs = []
  for *_, cfg in sorted(found, key=lambda t: t[:2]):
    if not autotune.tiles(key, cfg, problem.clip_m):
      continue
    cfg = problem.deepest_fitting(cfg)
    if cfg is not None and cfg not in configs:
      configs.append(cfg)
  return configs or None


def incumbent(problem: autotune.Problem, entries: dict) -> GemmConfig | None:
  """The config that serves ``problem`` now, which a search keeps unless a candidate
  is faster by more than ``CHALLENGE_MARGIN``: its entry in ``entries`` (the ``--out``
  file's, which ``--retune`` searches again), else what the caches serve
  (``autotune.lookup``: tuned, at a nearby size, on a same-chip sibling), else
  None (the heuristic default, which every search times anyway, wins only as fastest).

  Args:
    problem: the tuning problem.
    entries: key text -> cache record, of the file the search writes into.

  Returns:
    The config, or None.
  """
  record = entries.get(problem.key.text())
  if record is not None:
    return autotune.config_from_dict(record["config"])
  return autotune.lookup(problem.key, problem.clip_m)


def already_served(problem: autotune.Problem, config) -> str | None:
  """Where the caches already serve ``config`` for ``problem`` from ("tuned", "tuned at
  M=...", "tuned on <a same-chip kind>", ...), or None where they serve another config
  or none. Whether a winner served so is written: ``writes_served_winner``."""
  served, source = autotune.lookup_with_source(problem.key, problem.clip_m)
  return source if served == config else None


def writes_served_winner(source: str | None, narrowed: bool) -> bool:
  """Whether a run writes a winner that ``already_served`` says the caches serve from
  ``source``. Its own entry ("tuned"): rewritten with the new timings. Another source
  (a same-chip sibling's entry, a nearby size's): only after a whole search on this
  device and shape, whose record is then this problem's own (a narrowed run's would
  change nothing ``gemm`` runs, and its few configs would read as this problem's
  search). ``--list`` then reads the problem as tuned here, where it would otherwise go
  on offering it for a search that has been made.
  Such an entry outranks the sibling's or nearby one's later retunes, as this device's
  own search should.

  Args:
    source: ``already_served``'s answer for the winner, or None (not served).
    narrowed: the run was a challenge or ``--same-shape``.

  Returns:
    True where the winner is written."""
  return source is None or source == "tuned" or not narrowed


def tile_challenge(args) -> bool:
  """Whether the command line asks for a tile-shape challenge (``--challenge-tile-m``
  or ``--challenge-tile-n``)."""
  return args.challenge_tile_m is not None or args.challenge_tile_n is not None


def plan(problem: autotune.Problem, args, overrides: dict | None, entries: dict):
  """What the search does for ``problem`` under ``args``: ``(configs, keep)`` for
  ``autotune.tune`` (configs None: the whole search), or a line saying why it is kept
  untimed.

  Args:
    problem: the tuning problem.
    args: the parsed command line (``--same-shape``, ``--challenge-tile-m``,
      ``--challenge-tile-n``, ``--extra``).
    overrides: ``--challenge-variant``'s fields, or None.
    entries: key text -> cache record of the ``--out`` file.

  Returns:
    ``(configs, keep)`` or a string."""
  configs = None
  if args.same_shape:  # a search among fewer candidates: it keeps the incumbent
    configs = same_shape_configs(problem)
    if configs is None:
      return "no other program's entry at this shape: left for a whole search"
    return configs, incumbent(problem, entries)
  if tile_challenge(args):
    configs = challengers(problem, args.challenge_tile_m, args.extra, args.challenge_tile_n)
    if configs is None:
      return "no candidate of that tile shape tiles it: kept"
  elif overrides is not None:
    configs = variant_challenger(problem, overrides)
    if configs is None:
      return "the variant is the current config, or does not fit: kept"
  # a challenge keeps the current config (its first), a search the incumbent, within the
  # margin
  keep = configs[0] if configs else incumbent(problem, entries)
  return configs, keep


def keeps_entry(key_text: str, chosen: GemmConfig, keep: GemmConfig | None,
                entries: dict, narrowed: bool) -> bool:
  """Whether a narrowed run (a challenge or ``--same-shape``) kept the config that
  ``--out``'s own entry at this key already holds. That entry is then left as it was:
  rewritten, it would record only the few configs the narrowed run timed ("tuned, 3
  configs timed", which ``--list`` reads as worth a whole search) in place of the whole
  search that found it.

  Args:
    key_text: the problem's key text (``--out``'s entry key).
    chosen: the config the run chose.
    keep: the config the run kept within the margin (``plan``'s), or None.
    entries: key text -> cache record of the ``--out`` file.
    narrowed: the run was a challenge or ``--same-shape``, not a whole search.

  Returns:
    True where the entry should stay untouched."""
  if not narrowed or keep is None or chosen != keep or key_text not in entries:
    return False
  try:
    return autotune.config_from_dict(entries[key_text]["config"]) == chosen
  except (KeyError, ValueError):
    return False


def lower_kernels(problem: autotune.Problem, configs, keep, extra: bool, device) -> dict:
  """Lowers every kernel that ``autotune.tune(problem, configs=configs, keep=keep)``
  compiles (``autotune.search_configs``) into the kernel cache's folder, keyed for
  ``device`` (``kernel_cache.keyed_for``), as that device traces them: its SM count
  sizes the grid. On that device the search then reads them instead of lowering them.

  Args:
    problem: a problem traced for ``device`` (``lowering_time.pretend``).
    configs, keep: ``plan``'s.
    extra: ``--extra``.
    device: one of ``lowering_time.DEVICES``.

  Returns:
    How the kernels were found: ``{"lowered": n, "disk": n, "memory": n, "failed": n}``
    (failed: the lowering raised, as the device's compile will; said on stdout)."""
  configs, _, _ = autotune.search_configs(problem, configs, extra=extra, keep=keep,
                                          log=lambda _: None)
  ops = {nm: v for nm, (_, v) in problem.inputs.items()}
  found = collections.Counter()
  for i, cfg in enumerate(configs):
    t0, before = time.perf_counter(), kernel_cache.counts.copy()
    try:
      with kernel_cache.keyed_for(device):
        jax.export.export(problem.jitted(cfg, num_sms=device.core_count),
                          platforms=["cuda"])(problem.a, problem.b, ops)
    except Exception as e:  # noqa: BLE001  the search skips it on the device likewise
      found["failed"] += 1
      print(f"  not lowered {cfg.describe()}: {type(e).__name__}: {str(e)[:200]}",
            flush=True)
      continue
    now = kernel_cache.counts - before
    found += now
    print(f"  {i + 1}/{len(configs)} {'lowered' if now['lowered'] else 'already there'} "
          f"({time.perf_counter() - t0:.1f} s): {cfg.describe()}", flush=True)
  return {h: found[h] for h in ("lowered", "disk", "memory", "failed")}


def listed_source(problem: autotune.Problem) -> str:
  """Where ``--list`` says a problem's config comes from: ``autotune.lookup_with_source``'s
  source, or "NOT TUNED"; for an entry at the problem's own key, also how many configs
  its search timed. An entry that timed a few (``--same-shape``, a challenge) is worth a
  whole search: the 8B SwiGLU backward's two-config entry ran 8% slower than a config
  the same shape's other entry held (on an H200)."""
  source = autotune.lookup_with_source(problem.key)[1]
  if source is None:
    return "NOT TUNED"
  if source == "tuned":
    timed = next((rec.get("timed") for key, rec in autotune.cached_entries()
                  if key == problem.key), None)
    if timed is not None:
      return f"tuned, {timed} configs timed"
  return source


def find_problems(args) -> dict:
  """key text -> (where, problem) of every GEMM the ``--workloads`` trace."""
  from bench import gemm_epilogue as ge
  shapes = (ge.SHAPES if args.shapes is None else
            [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")])
  problems = {}
  for w in args.workloads.split(","):
    if w == "bench":
      found = bench_problems(shapes, args.programs)
    elif w.startswith("block-"):
      found = block_problems(w.removeprefix("block-"))
    elif w.startswith("family-"):
      found = family_problems(w.removeprefix("family-"))
    elif w.startswith("train-"):
      found = train_problems(w.removeprefix("train-"))
    else:
      sys.exit(f"--workloads: unknown {w!r}; one of bench, block-1b, block-8b, "
               "family-gpt2_1b, family-qwen3_1.7b, train-CONFIG:LAYERS[:BATCH] (e.g. "
               "train-llama-3-8b:4)")
    for k, v in found.items():
      problems.setdefault(k, v)
  return problems


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--workloads", default="bench,block-1b,block-8b")
  p.add_argument("--shapes", default=None, help="bench workload: MxKxN,... (default all)")
  p.add_argument("--programs", default="all", help="bench workload: program names")
  p.add_argument("--out", default=str(autotune.SHIPPED_CACHE))
  p.add_argument("--iterations", type=int, default=10)
  p.add_argument("--extra", action="store_true",
                 help="a wider search (bands of 8, tile_k 32, tile operands staged 4 "
                 "sub-tiles ahead or all of them)")
  p.add_argument("--budget-s", type=float, default=None,
                 help="stop starting new problems after this many seconds")
  p.add_argument("--match", default=None, help="only the problems whose key text "
                 "(device|jax|MxNxK|order|dtype|program) matches this regular expression")
  p.add_argument("--list", action="store_true", help="list the problems and stop")
  p.add_argument("--retune", action="store_true",
                 help="tune problems that --out already has too (default: skip them)")
  p.add_argument("--challenge-tile-m", type=int, default=None,
                 help="time each problem's current config (tuned or heuristic) against "
                 "only the search's candidates with warpgroup tiles this tall, in one "
                 "process; a challenger replaces it when more than 1%% faster (problems "
                 "--out has are included)")
  p.add_argument("--challenge-tile-n", type=int, default=None,
                 help="as --challenge-tile-m, against the candidates with warpgroup tiles "
                 "this wide (with --challenge-tile-m: both)")
  p.add_argument("--challenge-variant", default=None, metavar="FIELD=VALUE,...",
                 help="time each problem's current config against the same config with "
                 "these GemmConfig fields replaced (as bench.compare_configs' --variant, "
                 "without the name), in one process; the variant replaces it when more "
                 "than 1%% faster (problems --out has are included)")
  p.add_argument("--same-shape", action="store_true",
                 help="instead of the whole search, time only the configs the caches hold "
                 "for the same M x N x K (or nearby) under other programs, and the "
                 "heuristic (a new program at a shape tuned for another)")
  p.add_argument("--device", choices=sorted(lowering_time.DEVICES), default=None,
                 help="without a GPU: the device --list and --lower-only trace the "
                 "workloads for (default h100)")
  p.add_argument("--lower-only", metavar="DIR", default=None,
                 help="without a GPU: lower every kernel the search would compile into the "
                 "kernel-cache folder DIR, keyed for --device, and stop; on the GPU host "
                 "the same command with CODA_JAX_KERNEL_CACHE=DIR (and without these two "
                 "flags) reads them, and only compiles and times")
  args = p.parse_args()
  overrides = None
  if args.challenge_variant is not None:
    if tile_challenge(args):
      sys.exit("--challenge-variant and --challenge-tile-m/-n: pass one of them")
    from bench import compare_configs  # it imports this module
    try:
      _, overrides, num_sms = compare_configs.parse_variant("v=" + args.challenge_variant)
    except ValueError as e:
      sys.exit(str(e).replace("--variant v", "--challenge-variant"))
    if num_sms is not None or "clip_m" in overrides:
      sys.exit("--challenge-variant: only GemmConfig fields (not num_sms or clip_m)")
  challenge = tile_challenge(args) or overrides is not None
  if challenge and args.same_shape:
    sys.exit("--same-shape is a search of its own: pass it without --challenge-tile-m/-n "
             "or --challenge-variant")
  on_gpu = jax.devices()[0].platform == "gpu"
  if on_gpu and (args.device is not None or args.lower_only is not None):
    sys.exit("--device and --lower-only are for a machine without a GPU: on the GPU host "
             "the workloads are traced, and kernels lowered, for the GPU itself")
  if not on_gpu and not args.list and args.lower_only is None:
    sys.exit("tune_gemm measures on the device: run it on the GPU host (--list and "
             "--lower-only run anywhere)")
  # without a GPU: the workloads are traced as --device would run them
  device = lowering_time.DEVICES[args.device or "h100"]
  with contextlib.nullcontext() if on_gpu else lowering_time.pretend(device):
    problems = find_problems(args)
  if args.match:
    problems = {k: v for k, v in problems.items() if re.search(args.match, k)}
  prov = common.provenance()
  print(f"{len(problems)} GEMM problems; {prov}", flush=True)
  if args.list:
    for k, (where, problem) in problems.items():
      print(f"{where} [{listed_source(problem)}]: {k}")
    return
  out = Path(args.out)
  entries = json.loads(out.read_text())["entries"] if out.exists() else {}
  have = set(entries)
  if not args.retune and not challenge and have & set(problems):
    print(f"{len(have & set(problems))} problems already in {out}: skipped (--retune to "
          "redo them)", flush=True)
    problems = {k: v for k, v in problems.items() if k not in have}
  if args.lower_only is not None:
    kernel_cache.set_cache_dir(args.lower_only)
    print(f"lowering the search's kernels for {device.device_kind} into {args.lower_only}",
          flush=True)
  t0, rows, found_before = time.perf_counter(), [], kernel_cache.counts.copy()
  for i, (key_text, (where, problem)) in enumerate(problems.items()):
    if args.budget_s is not None and time.perf_counter() - t0 > args.budget_s:
      print(f"budget of {args.budget_s:.0f} s spent: {len(problems) - i} problems left "
            "untuned (rerun to continue; tuned ones are kept)", flush=True)
      break
    k = problem.key
    print(f"[{i + 1}/{len(problems)}] {where}: {k.m}x{k.n}x{k.k} {k.order} "
          f"{k.signature[:120]}", flush=True)
    try:
      planned = plan(problem, args, overrides, entries)
      if isinstance(planned, str):
        print(f"  {planned}", flush=True)
        continue
      configs, keep = planned
      if args.lower_only is not None:
        t1 = time.perf_counter()
        with lowering_time.pretend(device):
          found = lower_kernels(problem, configs, keep, args.extra, device)
        print(f"  kernels: {found['lowered']} lowered, {found['disk'] + found['memory']} "
              f"already there, {found['failed']} failed, in {time.perf_counter() - t1:.0f} s",
              flush=True)
        continue
      rec = autotune.tune(problem, iterations=args.iterations, extra=args.extra,
                          configs=configs, keep=keep, keep_within=CHALLENGE_MARGIN,
                          log=lambda s: print(s, flush=True))
    except Exception as e:  # noqa: BLE001  one problem failing does not stop the run
      print(f"  FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
      continue
    rows.append((where, k, rec))
    print(f"  best {rec['describe']}: {rec['ms']:.4f} ms (default {rec['default_ms']}) "
          f"in {rec['search_s']} s", flush=True)
    chosen = autotune.config_from_dict(rec["config"])
    if keep is not None and chosen == keep:
      print("  the current config is kept: no candidate was faster by more than "
            f"{CHALLENGE_MARGIN:.0%}", flush=True)
    narrowed = bool(challenge or args.same_shape)
    if keeps_entry(key_text, chosen, keep, entries, narrowed):
      print(f"  {args.out}'s entry holds it: left as it was", flush=True)
      continue
    source = already_served(problem, chosen)
    if not writes_served_winner(source, narrowed):
      print(f"  already served ({source}): no entry written", flush=True)
      continue
    if source is not None and source != "tuned":
      print(f"  already served ({source}): written as this problem's own entry, the "
            "record of a whole search here", flush=True)
    rec.update(where=where, commit=prov["commit"],
               measured=datetime.date.today().isoformat())
    autotune.store(k, rec, args.out)
  if args.lower_only is not None:
    print(f"\n{len(list(Path(args.lower_only).glob('*' + kernel_cache.SUFFIX)))} kernels in "
          f"{args.lower_only}: carry the folder to the GPU host and run the search there with "
          f"CODA_JAX_KERNEL_CACHE=<it>")
    return
  found = kernel_cache.counts - found_before
  print(f"\nkernels: {found['lowered']} lowered here, {found['disk']} read from the kernel "
        f"cache's folder ({kernel_cache.cache_dir()}), {found['memory']} reused in this "
        "process")
  print(f"\nwritten to {args.out}\n")
  print("| where | M x N x K | order | best | ms | default ms | default/best |")
  print("|---|---|---|---|---|---|---|")
  for where, k, rec in rows:
    d = rec["default_ms"]
    print(f"| {where} | {k.m}x{k.n}x{k.k} | {k.order} | {rec['describe']} | {rec['ms']:.4f} | "
          f"{d if d is None else f'{d:.4f}'} | {'-' if d is None else f'{d / rec['ms']:.3f}'} |")


if __name__ == "__main__":
  main()
