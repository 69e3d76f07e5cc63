"""The train step at the power cap: each path's donated step run back to back, in timed
windows that alternate between the paths, with the GPU's clock, power and energy per step.

    PYTHONPATH=. python -m bench.sustained_step --config llama-3-8b --layers 4

``bench.train`` waits for each step's loss before the next, as a training loop that logs
every step does. Here the steps run back to back, as a loop that does not, and the GPU
runs at its power cap: an H200 at 700 W holds the 8B-shaped step at ~1,450-1,520 MHz,
so a step's time is its energy over the cap's watts (docs/performance.md, "The power
cap"). Each variant is compiled and run once; the first then runs for
one window untimed, since the GPU idled through the compiles. Then ``--rounds``
rounds time each variant for ``--seconds``, in the given order and then reversed,
alternately (``common.alternating_windows``), with nvidia-smi sampled beside them
(``common.PowerLog``). The table gives each variant's mean ms a step, MHz, W, joules a step
and the first variant's time over its own ("first / this": > 1 is faster than the first).

Variants (``--variants``, comma-separated): ``fused``, ``reference`` and
``fused:<mlp_residuals>`` (``coda_jax.blocks.MLP_RESIDUALS``: the fused step with the
gated MLP's residuals kept that way). Writes ``sustained_step_<config>_<layers>l.{md,json}``
to --out (default bench/results/<device>/). On a CPU it runs the same way, at the CPU's
speed and with no power read: a check of the plumbing only.
"""
from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")  # as bench.train

from bench import common, step_profile  # noqa: E402 (after the allocator's setting)
from coda_jax.blocks import MLP_RESIDUALS  # noqa: E402
from flax_layers import get_config  # noqa: E402


def parse_variant(text: str) -> tuple[bool, str | None]:
  """``fused``, ``reference`` or ``fused:<mlp_residuals>`` -> (fused, mlp_residuals or
  None for the config's own)."""
  path, _, residuals = text.partition(":")
  if path not in ("fused", "reference") or (residuals and path != "fused"):
    raise ValueError(f"variant {text!r}: fused, reference or fused:<mlp_residuals>")
  if residuals and residuals not in MLP_RESIDUALS:
    raise ValueError(f"variant {text!r}: mlp_residuals {residuals!r} is not one of "
                     f"{MLP_RESIDUALS}")
  return path == "fused", residuals or None


def stepper(cfg, fused: bool, batch: int, seq: int, seed: int = 0):
  """A function of no arguments that runs one donated train step of a fresh model on
  fixed random tokens and returns its loss, with its state kept between calls."""
  step, state, tokens, targets = step_profile.step_and_batch(cfg, fused, batch, seq,
                                                            donate=True, seed=seed)
  box = [state]

  def call():
    box[0], loss = step(box[0], tokens, targets)
    return loss
  return call


def markdown(args, rows: list[dict], prov: dict) -> str:
  f = lambda v, spec: "-" if v is None else format(v, spec)
  md = [f"# The train step at the power cap: {args.config}, {args.layers} layers, batch "
        f"{args.batch} x {args.seq}", "",
        f"device: {prov['device']}; jax {prov['jax_version']}; commit {prov['commit']}",
        f"command: `{prov['command']}`",
        f"times: wall clock, donated steps back to back, {args.rounds} windows of "
        f"{args.seconds} s per variant (alternating order), after one untimed window; MHz "
        "and W: nvidia-smi every 50 ms", "",
        "| variant | ms a step | MHz | W | J a step | first / this |",
        "|---|---|---|---|---|---|"]
  first = rows[0]["ms"]
  for r in rows:
    md.append(f"| {r['variant']} | {r['ms']:.2f} | {f(r['mhz'], '.0f')} | "
              f"{f(r['watts'], '.0f')} | {f(r['joules'], '.1f')} | {first / r['ms']:.3f} |")
  return "\n".join(md) + "\n"


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--config", default="llama-3-8b")
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--seq", type=int, default=2048)
  p.add_argument("--variants", default="reference,fused",
                 help="comma-separated: fused, reference, fused:<mlp_residuals>")
  p.add_argument("--seconds", type=float, default=3.0, help="each timed window")
  p.add_argument("--rounds", type=int, default=2)
  p.add_argument("--out", default=None)
  args = p.parse_args()
  variants = args.variants.split(",")
  try:
    parsed = {v: parse_variant(v) for v in variants}
  except ValueError as e:
    p.error(str(e))
  if len(parsed) != len(variants):
    p.error(f"--variants {args.variants}: each variant once")
  prov = common.provenance()
  calls = {}
  for v, (fused, residuals) in parsed.items():
    cfg = get_config(args.config, n_layers=args.layers,
                     **({"mlp_residuals": residuals} if residuals else {}))
    calls[v] = stepper(cfg, fused, args.batch, args.seq)
    t0 = time.perf_counter()
    loss = float(calls[v]())
    print(f"{v}: compiled and ran one step in {time.perf_counter() - t0:.1f} s, loss "
          f"{loss:.4f}", flush=True)
  with common.PowerLog(interval=0.05) as log:
    windows = common.alternating_windows(calls, args.seconds, args.rounds, power=log)
  rows = []
  for v, ws in windows.items():
    for i, w in enumerate(ws):
      print(f"  {v} window {i}: {w.ms:.2f} ms a step over {w.calls} steps", flush=True)
    m = common.mean_sustained(ws)
    rows.append(dict(variant=v, ms=m.ms, mhz=m.mhz, watts=m.watts, joules=m.joules,
                     windows=[w._asdict() for w in ws], config=args.config,
                     layers=args.layers, batch=args.batch, seq=args.seq, **prov))
  text = markdown(args, rows, prov)
  print(text)
  common.write_results(f"sustained_step_{args.config}_{args.layers}l", rows, text, args.out)


if __name__ == "__main__":
  main()
