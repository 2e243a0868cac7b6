"""Loading a Hugging Face checkpoint by slices in processes of its own (tests/hf_load_worker.py):
a ~280 MB checkpoint, fully sharded over the job's 8 devices. One process's peak memory is a
fraction of the checkpoint; two processes joined by `jax.distributed` read half each into the
same arrays. (The loads themselves, in this process: test_hf_load.py.)"""

import json
import os
import pathlib
import subprocess
import sys

import hf_load_worker
import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.multiprocess]

_WORKER = pathlib.Path(hf_load_worker.__file__)

# Peak resident memory of a load above what the loaded arrays take, as a fraction of the
# checkpoint. Measured: 0.14 by slices (of which ~20 MB is the runtime's, whatever the size),
# 1.76 for the whole-tensor load it replaced.
_BOUND = 0.25


def _env() -> dict[str, str]:
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(_WORKER.parent.parent), env.get("PYTHONPATH")) if p
  )
  return env


def _run(*args, env=None) -> subprocess.Popen:
  return subprocess.Popen(
    [sys.executable, str(_WORKER), *map(str, args)],
    env=env or _env(),
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
  )


def _finish(*procs: subprocess.Popen) -> None:
  outs = [proc.communicate(timeout=600)[0] for proc in procs]
  assert [p.returncode for p in procs] == [0] * len(procs), "\n".join(o[-2000:] for o in outs)


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
  path = tmp_path_factory.mktemp("wide") / "ckpt"
  _finish(_run("write", path))
  return path


def _load(wide, out, mode):
  _finish(_run("load", wide, out, mode))
  return json.loads(out.read_text())


@pytest.fixture(scope="module")
def sliced(wide):
  return _load(wide, wide.parent / "sliced.json", "sliced")


@pytest.mark.slow
def test_peak_memory_of_a_load_is_a_fraction_of_the_checkpoint(wide, sliced, tmp_path):
  whole = _load(wide, tmp_path / "whole.json", "whole")
  size = sliced["checkpoint"]
  assert sliced["devices"] == 8 and sliced["held"] == sliced["read"] > 0.99 * size
  assert sliced["digests"] == whole["digests"]
  overhead = lambda r: (r["above_baseline"] - r["held"]) / size
  assert overhead(sliced) < _BOUND, overhead(sliced)
  assert overhead(whole) > _BOUND, overhead(whole)  # the measure sees the old path's copies


@pytest.mark.slow
def test_two_processes_read_half_each_into_the_same_arrays(wide, sliced, tmp_path, reserve_port):
  port = reserve_port()
  env = _env()
  env["XLA_FLAGS"] = env.get("XLA_FLAGS", "").replace(
    "--xla_force_host_platform_device_count=8", ""
  )
  _finish(
    *(_run("load", wide, tmp_path / f"p{k}.json", "sliced", port, k, env=env) for k in (0, 1))
  )
  size = sliced["checkpoint"]
  for k in (0, 1):
    report = json.loads((tmp_path / f"p{k}.json").read_text())
    assert report["devices"] == 4
    # Its own half: the pieces of its 4 devices, nothing of the other process's.
    assert report["read"] == report["held"] == sliced["read"] // 2
    assert report["above_baseline"] < size
    assert report["digests"] == sliced["digests"]  # gathered across both processes
