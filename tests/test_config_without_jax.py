"""Checking a config imports no JAX: `import rlhfjax.config` and loading and validating every
shipped config file stay on the standard library and ml_collections, so a config is checked in
a fraction of a second, on a laptop (docs/design.md, "Layers")."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from rlhfjax.config import ConfigError, choices, from_config_dict

pytestmark = pytest.mark.e2e

ROOT = pathlib.Path(__file__).resolve().parent.parent
FORBIDDEN = ("jax", "jaxlib", "flax", "optax", "orbax")

_REPORT = """
import json, sys
{body}
print(json.dumps(sorted({{m for m in sys.modules if m.split(".")[0] in {forbidden!r}}})))
"""

_LOAD_AND_VALIDATE = """
import runpy
from rlhfjax import config
def check(cd):
  if "sft" in cd and "ppo" in cd:  # a pipeline: one config per stage
    for stage in cd:
      check(cd[stage])
  else:
    config.from_config_dict(cd)
check(runpy.run_path({path!r})["get_config"]())
"""


def _imported(body: str) -> list[str]:
  """The forbidden modules a fresh interpreter has imported after running `body`."""
  env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(ROOT)}
  out = subprocess.run(
    [sys.executable, "-c", _REPORT.format(body=body, forbidden=FORBIDDEN)],
    env=env,
    cwd=ROOT,
    capture_output=True,
    text=True,
    check=True,
  )
  return json.loads(out.stdout.splitlines()[-1])


def test_importing_the_config_imports_no_jax():
  assert _imported("import rlhfjax.config") == []


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.py")), ids=lambda p: p.name)
def test_loading_and_validating_a_shipped_config_imports_no_jax(path):
  assert _imported(_LOAD_AND_VALIDATE.format(path=str(path))) == []


_CHOICES = {
  "ppo.kl_estimator": ("KL_ESTIMATORS", choices.KL_ESTIMATORS),
  "ppo.kl_controller": ("KL_CONTROLLERS", choices.KL_CONTROLLERS),
  "ppo.loss_agg": ("LOSS_AGGREGATIONS", choices.LOSS_AGGREGATIONS),
  "dpo.loss": ("DPO_LOSSES", choices.DPO_LOSSES),
}


@pytest.mark.parametrize("field", list(_CHOICES))
def test_a_name_that_selects_code_is_checked_without_the_code(field):
  """Each name is checked against the config's own list, one line naming the field; the
  registry of `rlhfjax.algorithms` that dispatches on it implements exactly that list."""
  from rlhfjax import algorithms

  registry, names = _CHOICES[field]
  section, name = field.split(".")
  with pytest.raises(ConfigError, match=rf"^'{field}' must be one of {', '.join(names)}, got 'x'$"):
    from_config_dict({"model": {"size": "tiny"}, section: {name: "x"}})
  assert tuple(getattr(algorithms, registry)) == names


def test_a_registry_that_parts_ways_with_its_names_fails():
  assert choices.implement(("a", "b"), {"a": 1, "b": 2}) == {"a": 1, "b": 2}
  with pytest.raises(ValueError, match="implements a; its config names are a, b"):
    choices.implement(("a", "b"), {"a": 1})
