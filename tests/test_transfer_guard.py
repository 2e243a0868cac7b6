"""Whole iterations of every placement with host transfers forbidden except the named ones.

The experience stays on the devices from scoring to update; the host sees only what must leave
or enter: the rollout's token ids (the engine's continuous batching and a rule reward), the
rule's scores, the KL coefficient and the metric scalars. Every other host transfer (a
`jax.device_put` between meshes that falls back to the host, an implicit upload) fails.
"""

import pathlib
import runpy

import pytest

from rlhfjax.config import from_config_dict
from rlhfjax.mesh.transfer import no_host_transfers
from rlhfjax.runner import Runner

pytestmark = pytest.mark.integration

_CONFIGS = pathlib.Path(__file__).parent.parent / "configs"
_NAMED = {"generate", "rollout", "reward_fn scores", "kl_coef", "metrics"}
"""The host transfers an iteration may make, by the names flows give them."""
_PACKED = {"rollout micro-batch", "packing index", "minibatch order"}
"""And those of packed scoring and updates (`ppo.packing`, the default): the packed rows'
tokens, their index arrays (planned on the host from the lengths) and the mini-batches' rows."""


def _config(variant: str, **ppo):
  cd = runpy.run_path(str(_CONFIGS / "ppo_tiny.py"))["get_config"](variant)
  cd.total_steps = 2
  cd.rollout.batch_size = 8
  cd.rollout.max_new_tokens = 8
  cd.reward.model_coef = 0.5
  cd.eval.num_prompts = 0
  cd.ppo.update(ppo)
  return from_config_dict(cd)


@pytest.mark.parametrize(
  "variant", ["colocated", "interleaved_split", "disaggregated", "disaggregated_async"]
)
def test_iterations_make_only_the_named_host_transfers(variant, tmp_path):
  runner = Runner(_config(variant), str(tmp_path), show_progress=False)
  cluster = runner.cluster
  with no_host_transfers():
    for iteration in range(2):
      row = runner.flow.iteration(iteration)
  runner.flow.close()
  assert set(cluster.host_transfers) <= _NAMED | _PACKED, cluster.host_transfers
  assert {"rollout", "metrics"} | _PACKED <= set(cluster.host_transfers)
  assert row["step"] == 1 and row["loss/value"] != 0.0


def test_the_guard_catches_an_unnamed_host_transfer(tmp_path):
  """The guard is live: a host array uploaded outside `cluster.host` fails."""
  import numpy as np

  runner = Runner(_config("colocated"), str(tmp_path), show_progress=False)
  from rlhfjax.placement.spec import Role

  with no_host_transfers(), pytest.raises(Exception, match="host-to-device"):
    runner.cluster.move(Role.ACTOR, np.zeros((8, 3), np.float32))


def test_stages_on_disjoint_devices_run_under_the_callers_guard():
  """Concurrent stages run in threads; JAX keeps guards per thread, so dispatch carries them."""
  import jax
  import numpy as np

  from rlhfjax.cluster import dispatch
  from rlhfjax.observe.timeline import Timeline

  devices = jax.devices()
  upload = lambda d: lambda: jax.device_put(np.ones(3, np.float32), devices[d]) + 0
  stages = [
    dispatch.Stage(role="a", name="score", devices=(0,), fn=upload(0)),
    dispatch.Stage(role="b", name="score", devices=(1,), fn=upload(1)),
  ]
  dispatch.run_stages(stages, Timeline(), 0)  # allowed without a guard
  with no_host_transfers(), pytest.raises(Exception, match="host-to-device"):
    dispatch.run_stages(stages, Timeline(), 0)
