"""Bar chart of a benchmark's JSON rows: baseline time / our time, per op and shape.

    python bench/plot.py bench/results/<device>/<benchmark>.json   # writes .png beside it
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def plot(json_path) -> Path:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  json_path = Path(json_path)
  rows = [r for r in json.loads(json_path.read_text()) if r.get("ours_ms")]
  ops = list(dict.fromkeys(r["op"] for r in rows))
  shapes = list(dict.fromkeys("x".join(map(str, r["shape"])) for r in rows))
  speed = {(r["op"], "x".join(map(str, r["shape"]))): r["baseline_ms"] / r["ours_ms"]
           for r in rows}
  fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(shapes)), 4))
  width = 0.8 / len(ops)
  for i, op in enumerate(ops):
    xs = [j + i * width for j in range(len(shapes))]
    ax.bar(xs, [speed.get((op, s), 0) for s in shapes], width, label=op)
  ax.axhline(1.0, color="k", lw=0.8)
  ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))], shapes, fontsize=8)
  ax.set_ylabel(f"{rows[0]['baseline']} time / ours (higher is better)")
  ax.set_xlabel("M x K x N")
  ax.set_title(f"{json_path.stem} on {rows[0]['device']} (jax {rows[0]['jax_version']}, "
               f"{rows[0]['commit']})", fontsize=9)
  ax.legend(fontsize=7)
  fig.tight_layout()
  out = json_path.with_suffix(".png")
  fig.savefig(out, dpi=120)
  return out


if __name__ == "__main__":
  print(plot(sys.argv[1]))
