"""Data-parallel scaling from main-job results: tokens/s per device on N devices over
tokens/s on one device, at the same per-device batch, for each path.

    PYTHONPATH=. python -m bench.dp_scaling ONE.json MANY.json [MANY.json ...]

ONE.json and each MANY.json are ``bench.train`` results (one device; a --mesh run).
Writes bench/results/<device of ONE>/dp_scaling.json and .md: one row per (run, path)
with ``op: "dp_scaling"`` and ``ratio``, plus the fused/reference speed ratio on one and
on N devices.
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from bench import common


def by_path(rows):
  return {r["op"].removeprefix("train_step_"): r for r in rows
          if r["op"].startswith("train_step_")}


def per_device_batch(r):
  batch = int(r["shape"].split("x")[0])
  data = 1
  m = re.search(r"data=(\d+)", r.get("mesh") or "")
  if m:
    data = int(m.group(1))
  return batch // data


def scaling_rows(one_rows, many_rows, source):
  one, many = by_path(one_rows), by_path(many_rows)
  out = []
  speed = lambda runs: (runs["fused"]["tokens_per_s"] / runs["reference"]["tokens_per_s"]
                        if {"fused", "reference"} <= set(runs) else None)
  for path, r in many.items():
    if path not in one:
      continue
    if per_device_batch(r) != per_device_batch(one[path]):
      raise ValueError(f"{source}: {path} has {per_device_batch(r)} rows per device, the "
                       f"one-device run {per_device_batch(one[path])}: compare equal batches")
    ratio = r["tokens_per_s_per_device"] / one[path]["tokens_per_s"]
    out.append(dict(
        op="dp_scaling", path=path, shape=r["shape"], n_devices=r["n_devices"],
        mesh=r["mesh"], partitioner=r.get("partitioner"), ratio=ratio,
        tokens_per_s_per_device=r["tokens_per_s_per_device"],
        one_device_tokens_per_s=one[path]["tokens_per_s"],
        fused_over_reference_one=speed(one), fused_over_reference_many=speed(many),
        source=source, device=r["device"], jax_version=r["jax_version"],
        commit=r["commit"], one_device_commit=one[path]["commit"],
        command=r["command"], one_device_command=one[path]["command"]))
  return out


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("one", type=Path)
  p.add_argument("many", type=Path, nargs="+")
  p.add_argument("--out", type=Path)
  args = p.parse_args()
  one = json.loads(args.one.read_text())
  rows = []
  for path in args.many:
    rows += scaling_rows(one, json.loads(path.read_text()), path.name)
  lines = ["# Data-parallel scaling (tokens/s per device on N devices / on 1 device)", "",
           f"one device: `{one[0]['command']}` at {one[0]['commit']} on {one[0]['device']}", "",
           "| path | mesh | partitioner | devices | per device tokens/s | 1 device tokens/s | "
           "ratio | fused/reference at 1 | at N |", "|" + "---|" * 9]
  f = lambda v: "-" if v is None else f"{v:.3f}"
  for r in rows:
    lines.append(f"| {r['path']} | {r['mesh']} | {r['partitioner']} | {r['n_devices']} | "
                 f"{r['tokens_per_s_per_device']:,.0f} | {r['one_device_tokens_per_s']:,.0f} | "
                 f"**{r['ratio']:.3f}** | {f(r['fused_over_reference_one'])} | "
                 f"{f(r['fused_over_reference_many'])} |")
  md = "\n".join(lines) + "\n"
  out = common.write_results("dp_scaling", rows, md,
                             args.out or common.RESULTS / common.device_slug(one[0]["device"]))
  print(f"wrote {out}/dp_scaling.json, .md\n\n{md}")


if __name__ == "__main__":
  main()
