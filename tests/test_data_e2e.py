"""The bundled data are what scripts/make_bundled_data.py writes, run as a user runs it."""

import pathlib
import subprocess
import sys

import pytest

from rlhfjax import data

pytestmark = pytest.mark.e2e

_ROOT = pathlib.Path(__file__).parent.parent


def test_bundled_data_is_what_the_script_writes(tmp_path):
  subprocess.run(
    [sys.executable, str(_ROOT / "scripts" / "make_bundled_data.py"), f"--out_dir={tmp_path}"],
    check=True,
    capture_output=True,
  )
  for kind in ("prompt", "demonstration", "preference"):
    bundled = pathlib.Path(data.bundled_path("vowels", kind))
    assert (tmp_path / bundled.name).read_bytes() == bundled.read_bytes()
