"""scripts/check_env.py and scripts/setup.sh with CODA_JAX_PYTHON: an environment of
one's own is checked, never installed into."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import check_env  # noqa: E402


def _run(*args, pyproject=None):
  cmd = [sys.executable, str(ROOT / "scripts" / "check_env.py"), *args]
  if pyproject is not None:
    cmd += ["--pyproject", str(pyproject)]
  return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def _pyproject(tmp_path, deps, extras, python=">=3.12"):
  path = tmp_path / "pyproject.toml"
  path.write_text(textwrap.dedent(f"""\
      [project]
      name = "x"
      requires-python = "{python}"
      dependencies = {deps!r}
      [project.optional-dependencies]
      """).replace("'", '"') + "".join(f"{k} = {v!r}\n".replace("'", '"')
                                       for k, v in extras.items()))
  return path


def test_this_environment_passes():
  run = _run("test,bench")
  assert run.returncode == 0, run.stderr
  assert "has coda-jax's requirements (test,bench); nothing installed" in run.stderr


@pytest.mark.parametrize("requirement, have, why", [
    ("jax==0.11.2", "0.11.2", None),
    ("jax>=0.11", "0.12.1rc1", None),  # a pre-release past the minimum meets it
    ("jax>=2.0", "1.0.post1", "jax 1.0.post1 is installed, jax>=2.0 is needed"),
    ("jax[cuda13]==0.11.2", "0.11.1", "jax 0.11.1 is installed, jax[cuda13]==0.11.2 is pinned"),
])
def test_versions_compared(monkeypatch, requirement, have, why):
  monkeypatch.setattr(check_env, "installed_version", lambda name: have)
  assert check_env.problem_with(requirement) == why


def test_requirements_read():
  import jax
  assert check_env.problem_with(f"jax=={jax.__version__}") is None
  assert check_env.problem_with("jax[cuda13]>=0.1") is None  # extras are not checked here
  assert check_env.problem_with("jax==0.0.1") == (
      f"jax {jax.__version__} is installed, jax==0.0.1 is pinned")
  assert check_env.problem_with("jax>=99") == (
      f"jax {jax.__version__} is installed, jax>=99 is needed")
  assert "is not installed" in check_env.problem_with("surely-not-a-package-xyz")
  assert check_env.problem_with("jax<99") is None
  with pytest.raises(ValueError, match="jax<<<0.12"):  # packaging's InvalidRequirement
    check_env.problem_with("jax<<<0.12")


def test_what_is_missing_is_named(tmp_path):
  """Each unmet requirement is named with the fix, the exit status is 1; an optional
  extra's missing package is only named; pytest-xdist is needed from any extra."""
  bad = _pyproject(tmp_path, ["jax==0.0.1", "surely-not-a-package-xyz>=1"],
                   {"test": ["pytest-xdist>=99"], "docs": ["another-missing-pkg-xyz"]})
  run = _run("test,docs", pyproject=bad)
  assert run.returncode == 1
  for text in ("jax==0.0.1 is pinned", "surely-not-a-package-xyz is not installed",
               "pytest-xdist>=99 is needed", 'pip install -e ".[test,docs]"',
               "unset CODA_JAX_PYTHON"):
    assert text in run.stderr, (text, run.stderr)
  assert "another-missing-pkg-xyz" not in run.stderr  # reported only when all else is met
  fine = _pyproject(tmp_path, ["jax>=0.1"], {"docs": ["another-missing-pkg-xyz"]})
  run = _run("docs", pyproject=fine)
  assert run.returncode == 0, run.stderr
  assert "optional: another-missing-pkg-xyz is not installed" in run.stderr
  assert "another-missing-pkg-xyz is not installed (want another-missing-pkg-xyz); what " \
      "needs it skips or says so" in run.stderr
  run = _run("docs", pyproject=_pyproject(tmp_path, [], {"docs": ["matplotlib>=99"]}))
  assert run.returncode == 0 and "the benchmarks write no PNG" not in run.stderr
  import jax
  other = _pyproject(tmp_path, [], {"docs": ["jax==0.0.1"]})
  run = _run("docs", pyproject=other)
  assert run.returncode == 0, run.stderr
  assert (f"optional: jax {jax.__version__} is installed, jax==0.0.1 is pinned; it is "
          "used as installed") in run.stderr
  run = _run("nosuch", pyproject=fine)
  assert run.returncode == 1 and "has no extra 'nosuch'" in run.stderr
  run = _run("docs", pyproject=_pyproject(tmp_path, [], {"docs": []}, python=">=3.99"))
  assert run.returncode == 1 and "the project requires >=3.99" in run.stderr


def test_setup_uses_the_given_python():
  env = dict(os.environ, CODA_JAX_PYTHON=sys.executable)
  run = subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh")], capture_output=True,
                       text=True, env=env, timeout=300)
  assert run.returncode == 0, run.stderr
  assert run.stdout.strip() == sys.executable
  assert "nothing installed" in run.stderr and "pip" not in run.stderr.replace(
      'pip install -e', '')
  env["CODA_JAX_PYTHON"] = "/nonexistent/python3"
  run = subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh")], capture_output=True,
                       text=True, env=env, timeout=60)
  assert run.returncode == 1
  assert "CODA_JAX_PYTHON=/nonexistent/python3 is not an executable" in run.stderr


def test_cuda_extra_needs_jax_to_see_a_gpu():
  """A CPU-only jaxlib where a GPU build is asked for is the failure the "cuda" extra
  exists for: it is an error, not a silent XLA fallback."""
  import jax
  run = _run("cuda")
  if jax.default_backend() == "gpu":
    assert run.returncode == 0, run.stderr
  else:
    assert run.returncode == 1
    assert "jax sees no GPU (default backend 'cpu')" in run.stderr
    assert 'pip install "jax[cuda13]==0.11.2"' in run.stderr
