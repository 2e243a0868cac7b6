"""The distributed config section, its fall-backs and the placement checks, in this process (no
processes started; `test_multihost.py` runs the multi-process jobs end to end)."""

import types

import jax
import numpy as np
import pytest

from rlhfjax import distributed
from rlhfjax.config import ConfigError, DistributedSection, from_config_dict
from rlhfjax.distributed import DistributedError
from rlhfjax.mesh import transfer
from rlhfjax.placement import strategies

pytestmark = pytest.mark.unit


def test_section_validates_with_one_line_errors():
  with pytest.raises(ConfigError, match=r"distributed: process_id=3 must be below num_processes=2"):
    from_config_dict(
      {"model": {"size": "tiny"}, "distributed": {"num_processes": 2, "process_id": 3}}
    )
  with pytest.raises(ConfigError, match="coordinator_address must be host:port"):
    from_config_dict({"model": {"size": "tiny"}, "distributed": {"coordinator_address": "x"}})
  assert from_config_dict({"model": {"size": "tiny"}}).distributed == DistributedSection()


def test_fields_fall_back_to_the_environment():
  env = {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "2"}
  assert distributed.resolve(DistributedSection(), env) == {
    "coordinator_address": "h:1",
    "num_processes": 4,
    "process_id": 2,
  }
  section = DistributedSection(coordinator_address="a:9", num_processes=2, process_id=0)
  assert distributed.resolve(section, env) == {
    "coordinator_address": "a:9",
    "num_processes": 2,
    "process_id": 0,
  }
  # Nothing said: left to JAX's cluster auto-detection.
  assert set(distributed.resolve(DistributedSection(), {}).values()) == {None}
  with pytest.raises(DistributedError, match=r"\$JAX_NUM_PROCESSES must be an integer"):
    distributed.resolve(DistributedSection(), {"JAX_NUM_PROCESSES": "two"})


def test_local_device_count_splits_the_placement():
  assert distributed.local_device_count(DistributedSection(), 8, 2) == 4
  assert distributed.local_device_count(DistributedSection(local_device_count=3), 8, 2) == 3
  assert distributed.local_device_count(DistributedSection(), 8, None) is None
  with pytest.raises(DistributedError, match="does not split evenly over 3 processes"):
    distributed.local_device_count(DistributedSection(), 8, 3)


def test_placements_across_processes(monkeypatch):
  # Two processes of 4 devices each, as `jax.devices()` lists them.
  devices = [types.SimpleNamespace(process_index=i // 4) for i in range(8)]
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  distributed.check_placement(strategies.colocated(8, rollout_tensor=2), devices)
  # Roles on different processes run (each process runs its own meshes' programs).
  distributed.check_placement(strategies.disaggregated(8), devices)
  distributed.check_placement(strategies.interleaved(8), devices)
  with pytest.raises(DistributedError, match=r"processes \[1\] own none"):
    distributed.check_placement(strategies.colocated(4), devices)


def test_to_host_reads_local_arrays():
  x = jax.device_put(np.arange(16.0).reshape(8, 2), jax.devices()[0])
  out = transfer.to_host({"x": x, "none": None})
  assert isinstance(out["x"], np.ndarray) and out["none"] is None
  np.testing.assert_array_equal(out["x"], np.arange(16.0).reshape(8, 2))
