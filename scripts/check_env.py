"""Checks that this Python has what pyproject.toml asks for, installing nothing.

    python scripts/check_env.py test,bench[,cuda] [--pyproject PATH]

For an environment of your own (an offline GPU host, a container with jax installed):
scripts/setup.sh runs this with $CODA_JAX_PYTHON instead of creating .venv. The
project's dependencies must be installed at the versions pinned; so must pytest and
pytest-xdist (scripts/test.sh runs them) and tqdm (the main job's progress bar). The
other extras are named where missing or at another version, with what follows: a missing
transformers skips the tests that need it, a missing matplotlib leaves the benchmarks
without PNGs, and another version is used as installed (the interop tests read
transformers 4.x and 5.x). With "cuda", jax must also see a GPU: a CPU-only jaxlib would
run every kernel through the XLA fallback. Requirements are read with ``packaging``
(pytest's dependency). Exits 1, naming each problem and the fix; else prints one line
saying what was checked.
"""
from __future__ import annotations

import argparse
import importlib.metadata as md
import platform
import sys
import tomllib
from pathlib import Path

try:  # pytest's own dependency, so any environment that can run the tests has it
  from packaging.requirements import Requirement
  from packaging.specifiers import SpecifierSet
  from packaging.utils import canonicalize_name
except ImportError:
  sys.exit("check_env: the 'packaging' library is missing, and so is pytest, which needs "
           "it: pip install -e \".[test,bench]\" into that environment, or unset "
           "CODA_JAX_PYTHON and let scripts/setup.sh create .venv")

# Without these, scripts/test.sh or scripts/main.sh cannot run.
NEEDED_FROM_EXTRAS = {"pytest", "pytest-xdist", "tqdm"}
# What goes without an optional package (any other: what needs it skips or says so).
WITHOUT = {"transformers": "the interop tests skip (tests/test_hf_interop.py)",
           "matplotlib": "the benchmarks write no PNG (bench/plot.py draws one later)",
           "ruff": "the lint step of .ci/run cannot run"}


def installed_version(name: str) -> str | None:
  """The installed version of distribution ``name``, or None where it is not installed."""
  try:
    return md.version(name)
  except md.PackageNotFoundError:
    return None


def problem_with(requirement: str) -> str | None:
  """Why this Python does not meet ``requirement`` (a PEP 508 string; its extras in
  brackets are not checked), or None where it does."""
  req = Requirement(requirement)
  have = installed_version(req.name)
  if have is None:
    return f"{req.name} is not installed (want {requirement.strip()})"
  if not req.specifier.contains(have, prereleases=True):
    pinned = any(spec.operator == "==" for spec in req.specifier)
    return (f"{req.name} {have} is installed, {requirement.strip()} is "
            f"{'pinned' if pinned else 'needed'}")
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
  if not SpecifierSet(project["requires-python"]).contains(platform.python_version()):
    errors.append(f"Python {platform.python_version()}, the project requires "
                  f"{project['requires-python']}")
  for req in project["dependencies"]:
    if (why := problem_with(req)) is not None:
      errors.append(why)
  for extra in extras:
    if extra not in project.get("optional-dependencies", {}):
      errors.append(f"pyproject.toml has no extra {extra!r}")
      continue
    for req in project["optional-dependencies"][extra]:
      if (why := problem_with(req)) is None:
        continue
      name = canonicalize_name(Requirement(req).name)
      if extra == "cuda" or name in NEEDED_FROM_EXTRAS:
        errors.append(why)
      elif installed_version(name) is None:
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
