"""Checks that this Python has what pyproject.toml asks for, installing nothing.

    python scripts/check_env.py test,bench[,cuda] [--pyproject PATH]

For an environment of your own (an offline GPU host, a container with jax installed):
scripts/setup.sh runs this with $CODA_JAX_PYTHON instead of creating .venv. The
project's dependencies must be installed at the versions pinned; so must pytest and
pytest-xdist (scripts/test.sh runs them) and tqdm (the main job's progress bar). The
other extras are named where missing or at another version, with what follows: a missing
transformers skips the tests that need it, a missing matplotlib leaves the benchmarks
without PNGs, and another version is used as installed (the interop tests read
transformers 4.x and 5.x). With "cuda", jax must also see a GPU: a CPU-only jaxlib would run every kernel
through the XLA fallback. Exits 1, naming each problem and the fix; else prints one line
saying what was checked.
"""
from __future__ import annotations

import argparse
import importlib.metadata as md
import re
import sys
import tomllib
from pathlib import Path

# Without these, scripts/test.sh or scripts/main.sh cannot run.
NEEDED_FROM_EXTRAS = {"pytest", "pytest-xdist", "tqdm"}
# What goes without an optional package (any other: what needs it skips or says so).
WITHOUT = {"transformers": "the interop tests skip (tests/test_hf_interop.py)",
           "matplotlib": "the benchmarks write no PNG (bench/plot.py draws one later)"}
REQUIREMENT = re.compile(
    r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*(?:(==|>=)\s*([0-9][0-9A-Za-z.]*))?\s*$")


def _release(version: str) -> tuple[int, ...]:
  """The leading numeric release of a version string: "0.12.1rc1" -> (0, 12, 1)."""
  parts = []
  for piece in version.split("."):
    digits = re.match(r"\d+", piece)
    if not digits:
      break
    parts.append(int(digits.group()))
    if digits.group() != piece:
      break
  return tuple(parts)


def problem_with(requirement: str) -> str | None:
  """Why this Python does not meet ``requirement`` ("name", "name==v" or "name>=v",
  extras in brackets ignored), or None where it does."""
  m = REQUIREMENT.match(requirement)
  if m is None:
    raise ValueError(f"pyproject.toml requirement {requirement!r}: this checker reads "
                     "only 'name', 'name==version' and 'name>=version'")
  name, _, op, want = m.groups()
  try:
    have = md.version(name)
  except md.PackageNotFoundError:
    return f"{name} is not installed (want {requirement.strip()})"
  if op == "==" and have != want:
    return f"{name} {have} is installed, {requirement.strip()} is pinned"
  if op == ">=" and _release(have) < _release(want):
    return f"{name} {have} is installed, {requirement.strip()} is needed"
  return None


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("extras", help="comma-separated extras, e.g. test,bench,cuda")
  p.add_argument("--pyproject", type=Path,
                 default=Path(__file__).resolve().parent.parent / "pyproject.toml")
  args = p.parse_args(argv)
  project = tomllib.loads(args.pyproject.read_text())["project"]
  extras = [e for e in args.extras.split(",") if e]
  errors, missing_optional = [], []
  want_python = _release(project["requires-python"].removeprefix(">="))
  if sys.version_info[:len(want_python)] < want_python:
    errors.append(f"Python {sys.version.split()[0]}, the project requires "
                  f"{project['requires-python']}")
  for req in project["dependencies"]:
    if (why := problem_with(req)) is not None:
      errors.append(why)
  for extra in extras:
    if extra not in project.get("optional-dependencies", {}):
      errors.append(f"pyproject.toml has no extra {extra!r}")
      continue
    for req in project["optional-dependencies"][extra]:
      why = problem_with(req)
      name = REQUIREMENT.match(req).group(1).lower()
      if why is None:
        continue
      if extra == "cuda" or name in NEEDED_FROM_EXTRAS:
        errors.append(why)
      elif "not installed" in why:
        missing_optional.append(f"{why}; {WITHOUT.get(name, 'what needs it skips or says so')}")
      else:
        missing_optional.append(f"{why}; it is used as installed")
  if "cuda" in extras and not errors:
    import jax  # only now: the versions above are right
    backend = jax.default_backend()
    if backend != "gpu":
      cuda = " ".join(f'"{r}"' for r in project["optional-dependencies"]["cuda"])
      errors.append(f"jax sees no GPU (default backend {backend!r}) though nvidia-smi "
                    f"does: install the CUDA build, pip install {cuda}")
  python = sys.executable
  if errors:
    print(f"check_env: {python} lacks what coda-jax needs:", file=sys.stderr)
    for why in errors:
      print(f"  - {why}", file=sys.stderr)
    print("Fix: install them into that environment (pip install -e \".[" + args.extras
          + "]\"), or unset CODA_JAX_PYTHON and let scripts/setup.sh create .venv.",
          file=sys.stderr)
    return 1
  for why in missing_optional:
    print(f"check_env: optional: {why}", file=sys.stderr)
  print(f"check_env: {python} has coda-jax's requirements ({args.extras}); nothing "
        "installed", file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
