"""notebooks/quickstart.ipynb runs top to bottom in a fresh kernel and shows what it promises."""

import base64
import json
import os
import pathlib
import sys

import pytest

pytestmark = pytest.mark.e2e

_NOTEBOOK = pathlib.Path(__file__).resolve().parents[1] / "notebooks" / "quickstart.ipynb"
_STRATEGIES = ("colocated", "interleaved", "disaggregated")
_STEPS = 8


def _code_cells(nb):
  return [cell for cell in nb.cells if cell.cell_type == "code"]


def _text(cell) -> str:
  return "".join(out.get("text", "") for out in cell.outputs if out.output_type == "stream")


def _python3_from_this_interpreter(monkeypatch, tmp_path: pathlib.Path) -> None:
  """The notebook's `python3` kernel is ipykernel's spec for `sys.executable`, whether or not
  (and for whichever interpreter) a `python3` spec is installed: JUPYTER_PATH comes first."""
  from ipykernel.kernelspec import write_kernel_spec
  from jupyter_client.kernelspec import KernelSpecManager

  write_kernel_spec(tmp_path / "jupyter" / "kernels" / "python3")
  monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
  assert KernelSpecManager().get_kernel_spec("python3").argv[0] == sys.executable


def test_notebook_is_stored_without_outputs():
  import nbformat  # Jupyter's modules (0.3 s to import) only where used

  nb = nbformat.read(_NOTEBOOK, as_version=4)
  nbformat.validate(nb)
  assert nb.metadata.kernelspec.name == "python3"
  for cell in _code_cells(nb):
    assert cell.outputs == [] and cell.execution_count is None, cell.source[:60]


@pytest.mark.slow
def test_quickstart_notebook_runs(monkeypatch, tmp_path):
  _python3_from_this_interpreter(monkeypatch, tmp_path)
  # The notebook asks for its 8 host devices itself, as on Colab: the test session's device
  # count (conftest's XLA_FLAGS) never reaches the kernel. Its other flags do: in the workers,
  # the fast code generation, with which the other runs the suite starts are compiled too (only
  # the CPU backend's machine code changes, not what the notebook shows). Its workdir
  # (tempfile) goes under tmp_path.
  flags = os.environ.get("XLA_FLAGS", "").split()
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "TMPDIR": str(tmp_path)}
  env["XLA_FLAGS"] = " ".join(f for f in flags if "host_platform_device_count" not in f)
  import nbclient
  import nbformat

  nb = nbformat.read(_NOTEBOOK, as_version=4)
  client = nbclient.NotebookClient(
    nb,
    timeout=600,  # per cell; the run cell takes under a minute on 2 CPU cores
    kernel_name="python3",
    resources={"metadata": {"path": str(_NOTEBOOK.parent)}},  # RLHFJAX_SOURCE = ".."
  )
  client.execute(env=env)  # a cell that raises fails here with CellExecutionError

  cells = _code_cells(nb)
  assert all(cell.execution_count is not None for cell in cells)
  assert not [out for cell in cells for out in cell.outputs if out.output_type == "error"]
  text = "\n".join(_text(cell) for cell in cells)
  assert "8 cpu device(s): disaggregated on 8" in text
  assert "ppo_tiny.py: model tiny" in text  # the repository's config, not the fallback
  for strategy in _STRATEGIES:
    assert f"{strategy} placement on 8 devices" in text
    assert f"summary: {strategy} on 8 devices" in text

  images = [
    base64.b64decode(out.data["image/png"])
    for cell in cells
    for out in cell.outputs
    if out.output_type == "display_data" and "image/png" in out.data
  ]
  assert len(images) == 2 and all(png.startswith(b"\x89PNG") for png in images)

  (workdir,) = tmp_path.glob("rlhfjax_quickstart_*")
  assert {"reward.png", "timeline.png", "metrics.jsonl"} <= {p.name for p in workdir.iterdir()}
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert len(rows) == _STEPS
  assert all(0.0 <= row["reward/mean"] <= 1.0 for row in rows)
  table = [line.split() for line in _text(cells[-1]).splitlines()]
  assert table[0][:2] == ["step", "reward/mean"] and len(table) == 1 + _STEPS
  printed = [float(line[1]) for line in table[1:]]
  assert printed == pytest.approx([row["reward/mean"] for row in rows], rel=1e-3)
