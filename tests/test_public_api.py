"""The public API documents itself: every function the three packages export, and the
submodules the README and docs/ send users to, says what its arguments are and what it
returns (Args:/Returns:, as Flax's layers do), and every exported class has a
docstring."""
import inspect

import pytest

import coda_jax
import coda_jax.layernorm_ops
import coda_jax.qk_norm
import coda_jax.sharding
import flax_layers
import flax_layers.gpt2
import pallas_kernels
import pallas_kernels.autotune

# The submodules that README.md and docs/ name for users to import from: the LayerNorm
# and QK-norm ops' building blocks, the sharding helpers, GPT-2's checkpoint keys and
# the tuner. The rest (dispatch, partitioning, the kernels' epilogue helpers) are
# internal.
PACKAGES = [coda_jax, flax_layers, pallas_kernels, coda_jax.layernorm_ops,
            coda_jax.qk_norm, coda_jax.sharding, flax_layers.gpt2,
            pallas_kernels.autotune]


def _exported(mod):
  names = getattr(mod, "__all__", None)
  assert names, f"{mod.__name__} declares no __all__"
  return [(n, getattr(mod, n)) for n in names]


def missing_docs(mod) -> list[str]:
  """'package.name: what is missing' for each exported function or class."""
  out = []
  for name, obj in _exported(mod):
    doc = inspect.getdoc(obj) or ""
    if inspect.isclass(obj):
      if not doc:
        out.append(f"{mod.__name__}.{name}: no docstring")
    elif inspect.isfunction(obj):
      need = ["Returns:"]
      if inspect.signature(obj).parameters:
        need.insert(0, "Args:")
      gaps = [s for s in need if s not in doc]
      if gaps:
        out.append(f"{mod.__name__}.{name}: no {' or '.join(gaps)}")
  return out


@pytest.mark.parametrize("mod", PACKAGES, ids=lambda m: m.__name__)
def test_exports_are_documented(mod):
  assert missing_docs(mod) == []


def test_the_check_sees_a_missing_section():
  """The check itself: an undocumented function and class are reported."""
  import types

  def undocumented(x):
    """Does something."""

  class Bare:
    pass

  fake = types.SimpleNamespace(__name__="fake", __all__=["undocumented", "Bare"],
                               undocumented=undocumented, Bare=Bare)
  assert missing_docs(fake) == ["fake.undocumented: no Args: or Returns:",
                                "fake.Bare: no docstring"]
