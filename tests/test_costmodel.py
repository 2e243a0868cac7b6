"""The cost model and the placement package import no JAX: a laptop prices and checks a
placement without starting a backend."""

import json
import pkgutil
import subprocess
import sys

import pytest

import rlhfjax.costmodel
import rlhfjax.placement

pytestmark = pytest.mark.e2e

_JAX = ("jax", "jaxlib", "flax", "optax", "orbax")
_MODULES = sorted(m.name for m in pkgutil.iter_modules(rlhfjax.costmodel.__path__))
_PLACEMENT = sorted(m.name for m in pkgutil.iter_modules(rlhfjax.placement.__path__))


def _jax_modules_after(*modules: str) -> list[str]:
  """The JAX packages loaded by a fresh interpreter that imports `modules`."""
  code = (
    "import json, sys\n"
    + "".join(f"import {m}\n" for m in modules)
    + f"print(json.dumps(sorted({{k.split('.')[0] for k in sys.modules}} & set({_JAX!r}))))"
  )
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  return json.loads(out.stdout)


def test_the_cost_model_has_its_modules():
  assert {"costs", "efficiency", "hardware", "memory", "pricing", "replay", "workload"} <= set(
    _MODULES
  )


def test_the_package_and_its_standalone_modules_import_no_jax():
  assert (
    _jax_modules_after(
      "rlhfjax.costmodel",
      "rlhfjax.costmodel.hardware",
      "rlhfjax.costmodel.efficiency",
      "rlhfjax.costmodel.pricing",
      "rlhfjax.costmodel.replay",
    )
    == []
  )


def test_every_cost_model_module_imports_no_jax():
  assert _jax_modules_after(*(f"rlhfjax.costmodel.{m}" for m in _MODULES)) == []


def test_every_placement_module_imports_no_jax():
  """Placement is data: specs, strategies and their structural and memory checks."""
  assert len(_PLACEMENT) >= 5
  assert _jax_modules_after(*(f"rlhfjax.placement.{m}" for m in _PLACEMENT)) == []
