"""The library's layers: every module imports only from the layers below its own.

`LAYERS` is the order of `docs/design.md`, bottom first. A module of layer i may import from
layers 0..i (its own package included, never a sibling package further up), at the top of a
file or inside a function, under `TYPE_CHECKING` or not: a lazy import is still a dependency,
only a hidden one. There is no list of exceptions; a new package or root module must be placed
in `LAYERS` before the test passes.
"""

from __future__ import annotations

import ast
import pathlib
import sys

import pytest

pytestmark = pytest.mark.pure

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "rlhfjax"

LAYERS = (
  # Utilities on the standard library alone.
  "errors",
  "ranges",
  "workdir",
  "supervisor",
  "signals",
  "liveness",
  # Every config section and the model's hyper-parameters: no JAX.
  "config",
  # Pipeline schedules as tables: no JAX.
  "schedules",
  # Compiled programs shared within a process, and their traces counted.
  "programs",
  # Pure building blocks: the transformer, the RL maths, datasets, rewards, what is recorded.
  "models",
  "algorithms",
  "data",
  "reward_fn_check",
  "tasks",
  "observe",
  # What a placement costs, in time and memory: no JAX.
  "costmodel",
  # Placement as data, its strategies and checks.
  "placement",
  # Processes and meshes.
  "distributed",
  "mesh",
  # Training: checkpoints, train states and steps, export.
  "checkpoint",
  "training",
  "export",
  # Generation.
  "rollout",
  # The roles on their meshes and the one mover between them.
  "cluster",
  # The algorithms' iterations.
  "flows",
  # The search over registered strategies and flows.
  "planner",
  # Running a flow: launching processes, reruns, the loop.
  "launch",
  "rerun",
  "runner",
  # Benchmarks, calibration and validation: nothing in the library imports them.
  "bench",
)
"""Bottom first; each entry is a package or a root module of `rlhfjax`."""


def _unit(module: str) -> str:
  """The layer entry of a dotted module name inside rlhfjax ('' for the package itself)."""
  parts = module.split(".")
  return parts[1] if len(parts) > 1 else ""


def _module_name(path: pathlib.Path) -> str:
  parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
  if parts[-1] == "__init__":
    parts.pop()
  return ".".join(parts)


def _imported(path: pathlib.Path) -> list[tuple[int, str]]:
  """(line, dotted module) of every rlhfjax import in the file, wherever it stands."""
  module = _module_name(path)
  package = module if path.name == "__init__.py" else module.rpartition(".")[0]
  found = []
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      found += [(node.lineno, alias.name) for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      if node.level:
        base = package.split(".")[: len(package.split(".")) - node.level + 1]
        target = ".".join(base + ([node.module] if node.module else []))
      else:
        target = node.module or ""
      # `from rlhfjax import x` imports the unit x, not the package's __init__ only.
      found += [(node.lineno, f"{target}.{alias.name}") for alias in node.names]
  return [(line, name) for line, name in found if name.split(".")[0] == "rlhfjax"]


def _sources() -> list[pathlib.Path]:
  return sorted(PACKAGE.rglob("*.py"))


def test_every_package_and_root_module_has_a_layer():
  units = {_unit(_module_name(p)) for p in _sources()} - {""}
  assert units - set(LAYERS) == set(), "place these in LAYERS (and docs/design.md)"
  assert len(set(LAYERS)) == len(LAYERS)


def _violations() -> list[str]:
  rank = {name: i for i, name in enumerate(LAYERS)}
  bad = {}
  for path in _sources():
    source = _unit(_module_name(path))
    for line, target in _imported(path):
      unit = _unit(target)
      if not unit or unit not in rank or not source:
        continue  # the package root imports nothing; unknown units fail the test above
      if rank[unit] > rank[source]:
        where = f"{path.relative_to(PACKAGE.parent)}:{line}"
        bad.setdefault(
          (where, unit),
          f"{where}: {source} (layer {rank[source]}) imports {target} (layer {rank[unit]})",
        )
  return list(bad.values())


def test_imports_only_point_down():
  assert _violations() == []


def test_the_package_root_imports_nothing():
  """`import rlhfjax` must stay free: entry points set XLA_FLAGS before JAX starts."""
  assert _imported(PACKAGE / "__init__.py") == []


def test_the_checker_sees_lazy_relative_and_type_checking_imports(tmp_path, monkeypatch):
  """The checker itself: an upward import hidden in a function, under TYPE_CHECKING or written
  relative is found (a checker that sees nothing passes every tree)."""
  fake = tmp_path / "rlhfjax"
  (fake / "config").mkdir(parents=True)
  (fake / "runner").mkdir()
  (fake / "__init__.py").write_text("")
  (fake / "runner" / "__init__.py").write_text("from rlhfjax import config\n")
  (fake / "config" / "__init__.py").write_text(
    "from typing import TYPE_CHECKING\n"
    "if TYPE_CHECKING:\n  from rlhfjax.runner import loop\n"
    "def f():\n  from ..runner import x\n"
    "def g():\n  import rlhfjax.flows.ppo\n"
  )
  monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
  found = _violations()
  assert [v.split(": ", 1)[0] for v in found] == [
    "rlhfjax/config/__init__.py:3",
    "rlhfjax/config/__init__.py:5",
    "rlhfjax/config/__init__.py:7",
  ]
  assert all("config (layer 6) imports rlhfjax." in v for v in found)


@pytest.mark.parametrize("name", LAYERS)
def test_each_layer_exists(name):
  assert (PACKAGE / name).is_dir() or (PACKAGE / f"{name}.py").is_file()
