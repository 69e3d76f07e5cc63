"""Where one training step's GPU time goes, on the fused path and on the reference: the
CUPTI time of every kernel of one step (median of a few), summed by kind.

    PYTHONPATH=. python -m bench.step_profile --config llama-3-8b --layers 4 --batch 4

The kinds are matched on kernel names (``KINDS``, first match wins; ``--top`` prints the
largest kernels by name, to check the matching). The state is not donated, so that the
same step can run again: it is held twice, which is why the default batch is 4, not the
training benchmark's 8, and the profiler keeps every iteration's outputs (a new state
each), which is why the default is one iteration (3 ran out of memory at 8B-4l on an
H100). Writes ``step_profile_<config>_<layers>l.{md,json}`` to --out
(default bench/results/<device>/). Needs a GPU (CUPTI).

``--copies N`` lists instead the N largest copies XLA put into each path's step as the
training benchmark compiles it (state donated): the copy instructions of the optimized
HLO, with their bytes. A copy of a large buffer is time neither path's math asks for
(a loop carry or an in-place output that XLA could not alias, a layout change)."""
from __future__ import annotations

import argparse
import gc
import os
import re
from pathlib import Path

# as bench.train: both paths may use 95% of the GPU (its docstring says why)
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

import jax  # noqa: E402 (after the allocator's setting)
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from bench import common  # noqa: E402
from flax_layers import Llama, get_config, train  # noqa: E402

# (kind, regular expression over the kernel's name); the first that matches names it
KINDS = (
    ("attention", r"cudnn|flash|fmha|sdpa|attention"),
    ("our GEMM kernels (Mosaic GPU)", r"coda_gemm|mosaic|pallas"),
    ("XLA's GEMMs (cuBLAS)", r"gemm|cutlass|xmma|nvjet|cublas|sm90_"),
    ("copies and sets", r"memcpy|memset|copy"),
    ("XLA fusions and reductions", r"fusion|loop_|input_|reduce|convert|transpose|"
                                   r"broadcast|concatenate|slice|scatter|gather|select"),
)


_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2,
                "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8,
                "f64": 8}
# one HLO instruction that copies: "%copy.3 = f32[8,16]{1,0} copy(f32[8,16]{0,1} %p)",
# or an async "copy-start" (its result is a tuple whose first element is the copy)
_COPY = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*\(?\s*([a-z]\w*)\[([\d,]*)\]"
                   r"[^=]*?\s(copy|copy-start)\(")
_MEMCPY_FUSION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*([a-z]\w*)\[([\d,]*)\]"
                            r"\S*\s+fusion\(")


def hlo_copies(hlo_text: str) -> list[tuple[str, str, tuple[int, ...], int]]:
  """The copies of an HLO module's text, largest first: copy instructions outside fusions,
  and fusions that XLA runs as a device memcpy (a dynamic slice of a loop's stacked
  array, say: their backend config names a memcpy).

  Args:
    hlo_text: a compiled executable's ``as_text()`` (or any HLO module text).

  Returns:
    [(instruction name, dtype, shape, bytes)], sorted by bytes, descending.
  """
  # copies inside a fusion's computation are part of that fusion's kernel: skipped
  fused = set(re.findall(r"\sfusion\(.*?calls=%?([\w.\-]+)", hlo_text))
  out, computation = [], None
  for line in hlo_text.splitlines():
    header = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
    if header and not line.startswith(" "):
      computation = header.group(1)
      continue
    m = _COPY.match(line) or _MEMCPY_FUSION.match(line)
    if m and computation not in fused and (m.re is _COPY or "memcpy" in line.lower()):
      name, dtype, dims = m.group(1), m.group(2), m.group(3)
      shape = tuple(int(d) for d in dims.split(",") if d)
      n = 1
      for d in shape:
        n *= d
      out.append((name, dtype, shape, n * _DTYPE_BYTES.get(dtype, 4)))
  return sorted(out, key=lambda c: -c[3])


def step_copies(cfg, fused: bool, batch: int, seq: int, seed: int = 0):
  """hlo_copies of one optimizer step as the training benchmark compiles it (donated)."""
  model = Llama(cfg, rngs=nnx.Rngs(seed), fused=fused)
  graphdef, state = train.init_state(model, train.make_optimizer(total_steps=100))
  del model
  step = train.make_train_step(graphdef, donate=True)
  tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
  text = step.lower(state, tokens, tokens).compile().as_text()
  del state
  gc.collect()
  return hlo_copies(text)


def kind_of(name: str) -> str:
  for kind, pattern in KINDS:
    if re.search(pattern, name, re.IGNORECASE):
      return kind
  return "other"


def step_and_batch(cfg, fused: bool, batch: int, seq: int, *, donate: bool, seed: int = 0):
  """(jitted train step, its optimizer state, tokens, targets): a fresh model's step
  (``train.make_train_step``) on fixed random tokens, the targets the next tokens."""
  model = Llama(cfg, rngs=nnx.Rngs(seed), fused=fused)
  graphdef, state = train.init_state(model, train.make_optimizer(total_steps=100))
  del model
  step = train.make_train_step(graphdef, donate=donate)
  tokens = jax.random.randint(jax.random.key(seed + 1), (batch, seq), 0, cfg.vocab_size)
  return step, state, tokens, jnp.roll(tokens, -1, axis=1)


def profile_path(cfg, fused: bool, batch: int, seq: int, iterations: int, seed: int = 0):
  """(total ms, [(kernel name, ms)]) of one optimizer step on random tokens."""
  step, state, tokens, targets = step_and_batch(cfg, fused, batch, seq, donate=False,
                                                seed=seed)
  total, per_kernel = common.time_kernels(step, state, tokens, targets,
                                          iterations=iterations)
  del state, step
  gc.collect()
  jax.clear_caches()
  return total, per_kernel


def by_kind(per_kernel):
  sums = {}
  for name, ms in per_kernel:
    sums[kind_of(name)] = sums.get(kind_of(name), 0.0) + ms
  return sums


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--config", default="llama-3-8b")
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--batch", type=int, default=4)
  p.add_argument("--seq", type=int, default=2048)
  p.add_argument("--iterations", type=int, default=1)
  p.add_argument("--top", type=int, default=15, help="largest kernels listed per path")
  p.add_argument("--out", type=Path, default=None)
  p.add_argument("--paths", default="fused,reference",
                 help="comma-separated, of fused and reference (default both)")
  p.add_argument("--mlp-residuals", default=None,
                 help="LlamaConfig.mlp_residuals (default the config's)")
  p.add_argument("--copies", type=int, default=0,
                 help="list the N largest copies in each path's compiled (donated) step "
                 "instead of timing it")
  args = p.parse_args()
  cfg = get_config(args.config, n_layers=args.layers,
                   **({"mlp_residuals": args.mlp_residuals} if args.mlp_residuals else {}))
  paths = args.paths.split(",")
  if not paths or not set(paths) <= {"fused", "reference"}:
    p.error(f"--paths {args.paths}: fused and/or reference")
  if args.copies:
    print(common.provenance(), flush=True)
    for path in paths:
      copies = step_copies(cfg, path == "fused", args.batch, args.seq)
      total = sum(c[3] for c in copies)
      print(f"{path}: {len(copies)} copies, {total / 2**20:.1f} MiB in all; the largest:")
      for name, dtype, shape, nbytes in copies[:args.copies]:
        print(f"  {nbytes / 2**20:10.1f} MiB  {dtype}{list(shape)}  {name}")
    return
  if jax.devices()[0].platform != "gpu":
    raise SystemExit("bench.step_profile times kernels with CUPTI: run it on the GPU host")
  prov = common.provenance()
  runs = {}
  for path in paths:
    runs[path] = profile_path(cfg, path == "fused", args.batch, args.seq, args.iterations)
    print(f"{path}: {runs[path][0]:.1f} ms of kernels a step", flush=True)
  kinds = [k for k, _ in KINDS] + ["other"]
  sums = {path: by_kind(pk) for path, (_, pk) in runs.items()}
  flags = os.environ.get("XLA_FLAGS", "")
  md = [f"# Kernel time of one training step: {args.config}, {args.layers} layers, "
        f"batch {args.batch} x {args.seq}", "",
        f"device: {prov['device']}; jax {prov['jax_version']}; commit {prov['commit']}",
        f"command: `{prov['command']}`" + (f"; XLA_FLAGS=`{flags}`" if flags else ""),
        "times: CUPTI, ms, median over iterations of each kernel; the step not donated", "",
        "| kind | " + " | ".join(f"{p} ms" for p in runs)
        + (" | reference - fused |" if len(runs) == 2 else " |"),
        "|---|" + "---|" * (len(runs) + (len(runs) == 2))]
  for k in kinds:
    cells = [sums[p].get(k, 0.0) for p in runs]
    md.append(f"| {k} | " + " | ".join(f"{c:.2f}" for c in cells)
              + (f" | {cells[1] - cells[0]:+.2f} |" if paths == ["fused", "reference"]
                 else " |"))
  totals = [runs[p][0] for p in runs]
  md.append("| **all kernels** | " + " | ".join(f"**{t:.2f}**" for t in totals) + " |")
  if paths == ["fused", "reference"]:
    md[-1] = md[-1] + f" **{totals[1] - totals[0]:+.2f}** |"
    md += ["", f"reference / fused: {totals[1] / totals[0]:.3f}"]
  md.append("")
  for path, (_, pk) in runs.items():
    md += [f"## {path}: the {args.top} largest kernels", "",
           "| kernel | kind | ms | calls | fastest call, ms | slowest call, ms |",
           "|---|---|---|---|---|---|"]
    merged = {}
    for name, ms in pk:
      merged.setdefault(name, []).append(ms)
    for name, calls in sorted(merged.items(), key=lambda kv: -sum(kv[1]))[:args.top]:
      md.append(f"| `{name[:90]}` | {kind_of(name)} | {sum(calls):.2f} | {len(calls)} | "
                f"{min(calls):.3f} | {max(calls):.3f} |")
    md.append("")
  text = "\n".join(md) + "\n"
  print(text)
  rows = [dict(path=path, config=args.config, layers=args.layers, batch=args.batch,
               seq=args.seq, kernel_ms=runs[path][0], by_kind=sums[path],
               xla_flags=flags, **prov)
          for path in runs]
  common.write_results(f"step_profile_{args.config}_{args.layers}l", rows, text, args.out)


if __name__ == "__main__":
  main()
