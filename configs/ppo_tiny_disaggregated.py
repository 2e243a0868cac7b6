"""configs/ppo_tiny.py with the disaggregated placement (see that file for every field)."""

import pathlib
import runpy


def get_config():
  base = runpy.run_path(str(pathlib.Path(__file__).with_name("ppo_tiny.py")))
  return base["get_config"]("disaggregated")
