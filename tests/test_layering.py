"""The packages import one way: bench -> flax_layers -> coda_jax -> pallas_kernels, and the
fused path imports nothing from the jnp reference it is checked against."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ORDER = ("pallas_kernels", "coda_jax", "flax_layers", "bench")  # each may import those before it


def _imports(path: Path) -> set[str]:
  """The top-level names (and coda_jax.<module>) a file imports, at any depth."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    else:
      continue
    for name in names:
      parts = name.split(".")
      found.add(parts[0])
      if parts[0] == "coda_jax" and len(parts) > 1:
        found.add(f"coda_jax.{parts[1]}")
  return found


def _files(package: str):
  return sorted((ROOT / package).glob("*.py"))


@pytest.mark.parametrize("package", ORDER)
def test_packages_import_one_way(package):
  later = set(ORDER[ORDER.index(package) + 1:])
  files = _files(package)
  assert files, package
  for path in files:
    wrong = _imports(path) & later
    assert not wrong, f"{path.relative_to(ROOT)} imports {sorted(wrong)}, a later layer"


def test_the_fused_path_does_not_import_the_reference():
  """Only the reference itself, and the layers' and benchmarks' reference paths, read
  ``coda_jax.jnp_reference``; what the fused ops share with it lives in coda_jax.unfused
  and coda_jax.layout."""
  for path in _files("coda_jax") + _files("pallas_kernels"):
    if path.name == "jnp_reference.py":
      continue
    assert "coda_jax.jnp_reference" not in _imports(path), path.relative_to(ROOT)


def test_the_check_sees_imports():
  """The parser above finds the imports these files are known to have (a check that
  could not fail would pass on an empty parse)."""
  assert "coda_jax.jnp_reference" in _imports(ROOT / "flax_layers" / "layers.py")
  assert "coda_jax.unfused" in _imports(ROOT / "coda_jax" / "blocks.py")
  assert "pallas_kernels" in _imports(ROOT / "coda_jax" / "__init__.py")
