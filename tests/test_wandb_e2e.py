"""Without the `wandb` package, `logging.wandb=True` is one line before any training: in this
process and through scripts/train.py, as a user runs it."""

import os
import pathlib
import subprocess
import sys

import pytest
from test_wandb import offline_wandb  # noqa: F401 (autouse: W&B offline, its files in tmp_path)

from rlhfjax import config as config_lib

pytestmark = pytest.mark.e2e

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_wandb_without_the_package_is_one_line_before_any_training(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
  with pytest.raises(config_lib.ConfigError) as error:
    config_lib.LoggingSection(wandb=True)
  assert str(error.value) == config_lib.WANDB_MISSING
  config_lib.LoggingSection(wandb=False)  # not needed unless enabled

  # The script: a `wandb` that cannot be imported shadows the installed one.
  shadow = tmp_path / "shadow" / "wandb"
  shadow.mkdir(parents=True)
  (shadow / "__init__.py").write_text("raise ImportError(\"No module named 'wandb'\")\n")
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shadow.parent), str(ROOT)])}
  workdir = tmp_path / "run"
  proc = subprocess.run(
    [
      sys.executable,
      str(ROOT / "scripts" / "train.py"),
      "--config=configs/grpo_tiny.py",
      f"--workdir={workdir}",
      "--config.logging.wandb=True",
    ],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert proc.returncode == 2, proc.stderr
  assert proc.stderr.strip() == "error: " + config_lib.WANDB_MISSING
  assert not (workdir / "metrics.jsonl").exists() and not (workdir / "checkpoints").exists()
