"""`scripts/export_hf.py` as a job of two processes joined by `jax.distributed`: each writes
its own shard files, together the files one process writes."""

import os
import re
import subprocess
import sys

import pytest
from test_export import _SHARD
from test_export_e2e import ROOT, SCRIPT, _export, one_step_runs
from test_multihost import _env

pytestmark = [pytest.mark.e2e, pytest.mark.multiprocess]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """One SFT run of one step: the workdir the job exports."""
  return one_step_runs(tmp_path_factory.mktemp("export"), kinds=("sft",))


@pytest.mark.slow
def test_two_processes_write_disjoint_shards_equal_to_one_process(runs, tmp_path, reserve_port):
  single = _export(runs / "sft", tmp_path / "single", f"--max_shard_size={_SHARD}")
  assert single.returncode == 0, single.stderr
  port = reserve_port()
  procs = [
    subprocess.Popen(
      [
        sys.executable,
        str(SCRIPT),
        f"--workdir={runs / 'sft'}",
        f"--out={tmp_path / 'multi'}",
        f"--max_shard_size={_SHARD}",
        "--config.distributed.enabled=True",
        f"--config.distributed.coordinator_address=localhost:{port}",
        "--config.distributed.num_processes=2",
        f"--config.distributed.process_id={k}",
        "--config.distributed.local_device_count=4",
      ],
      cwd=ROOT,
      env=_env(),  # the job's own devices, this worktree on the path
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for k in (0, 1)
  ]
  outputs = [p.communicate(timeout=300)[0] for p in procs]
  assert [p.returncode for p in procs] == [0, 0], outputs
  wrote = [set(re.search(r"wrote (.*) to ", text).group(1).split(", ")) for text in outputs]
  assert wrote == [
    {f"model-{i:05d}-of-00005.safetensors" for i in (1, 2, 3)},
    {f"model-{i:05d}-of-00005.safetensors" for i in (4, 5)},
  ]
  assert sorted(os.listdir(tmp_path / "multi")) == sorted(os.listdir(tmp_path / "single"))
  for name in os.listdir(tmp_path / "single"):
    assert (tmp_path / "multi" / name).read_bytes() == (tmp_path / "single" / name).read_bytes()
