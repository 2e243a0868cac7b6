"""Config overrides through a script's flag parsing (scripts/show_placement.py): the documented
fields are overrides, and an override of no field is one line naming what it may have meant."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_documented_overrides_from_the_command_line(tmp_path):
  """The issue's refused overrides, through a script's flag parsing."""
  out = _show_dpo_placement(
    "--config.model.roles.actor.remat=full",
    "--config.model.roles.reference.param_dtype=bfloat16",
    "--config.offload.params=('reference',)",
    f"--config.data.preferences={tmp_path / 'prefs.jsonl'}",
  )
  assert out.returncode == 0, out.stderr


def _show_dpo_placement(*overrides: str) -> subprocess.CompletedProcess:
  script = os.path.join(ROOT, "scripts", "show_placement.py")
  config = os.path.join(ROOT, "configs", "dpo_tiny.py")
  return subprocess.run([sys.executable, script, f"--config={config}", *overrides],
                        capture_output=True, text=True, timeout=300)  # fmt: skip


def test_a_bad_override_from_the_command_line_is_one_line_naming_it():
  out = _show_dpo_placement("--config.model.roles.actor.remat=full", "--config.model.remat=full")
  assert out.returncode == 2
  assert out.stderr.splitlines() == [
    "error: bad --config override --config.model.remat: no such field; did you mean "
    "--config.model.roles.<role>.remat (<role>: actor, critic, reference, reward, rollout)?"
  ], out.stderr
