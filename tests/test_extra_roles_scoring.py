"""Extra roles (issue 42, item 1) on their meshes: a second reward model placed on devices of its
own, sharing the reward's, or interleaved with it scores as the built-in reward model does with
the same weights, and the combined reward is the configured weighted sum."""

import json
import types

import jax
import numpy as np
import pytest
from runs_testing import rows, shipped_config

from rlhfjax import tasks
from rlhfjax.cluster.cluster import Cluster
from rlhfjax.cluster.rewards import Rewards
from rlhfjax.mesh import transfer
from rlhfjax.placement.spec import Role
from rlhfjax.planner import place
from rlhfjax.runner import Runner

pytestmark = pytest.mark.integration

B, P, T = 16, 12, 52  # the tiny configs' rollout batch and sequence width (64)
COEFS = {"model": 0.5, "fn": 2.0, "reward2": -0.75}


def _config(placement: dict):
  return shipped_config(
    "grpo_tiny",
    {
      "reward.model_coef": COEFS["model"],
      "reward.fn_coef": COEFS["fn"],
      "reward.role_coefs": {"reward2": COEFS["reward2"]},
      "model.extra_roles": {"reward2": {"size": "tiny"}},
      "placement.extra_roles": {"reward2": placement},
    },
  )


def _batch(seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(1, 300, (B, P + T), dtype=np.int32)
  lengths = rng.integers(P + 1, P + T + 1, B)  # every row a different length
  attention = (np.arange(P + T)[None] < lengths[:, None]).astype(np.int32)
  tokens = tokens * attention
  seqs = types.SimpleNamespace(
    prompts=[t[:P] for t in tokens],
    responses=[t[P:n] for t, n in zip(tokens, lengths, strict=True)],
    records=[None] * B,
  )
  return tokens, attention, seqs


# 'own' takes the last 4 devices (the built-in roles keep 0-3); 'shared' sits on the reward's
# mesh; 'interleaved' takes the second half of the reward's devices.
PLACEMENTS = {
  "own": ({"mode": "own", "devices": 4}, (4, 5, 6, 7)),
  "shared": ({"mode": "shared", "with_role": "reward"}, tuple(range(8))),
  "interleaved": ({"mode": "interleaved", "with_role": "reward"}, (4, 5, 6, 7)),
}


@pytest.mark.parametrize("name", PLACEMENTS)
def test_an_extra_reward_role_scores_as_the_built_in_reward_with_the_same_weights(name):
  placement, devices = PLACEMENTS[name]
  cfg = _config(placement)
  spec = place.place(cfg, 8)
  assert spec["reward2"].devices == devices
  cluster = Cluster(cfg, spec)
  rewards = Rewards(cfg, cluster, tokenizer=None)
  cluster.materialize()
  # The same weights as the built-in reward model's, laid out on reward2's own mesh.
  rt = cluster.roles["reward2"]
  weights = transfer.transfer(cluster.params[Role.REWARD], rt.param_shardings)[0]
  cluster.params["reward2"] = weights
  for leaf in jax.tree.leaves(weights):
    assert {s.device.id for s in leaf.addressable_shards} == {jax.devices()[d].id for d in devices}

  tokens, attention, seqs = _batch()
  with cluster.host("test batch"):
    on_actor = cluster.roles[Role.ACTOR].put_batch((tokens, attention))
  todo = rewards.stages(on_actor, seqs, 0)
  results = dict(zip([s.role for s in todo], cluster.run(todo, 0), strict=True))
  assert [s.devices for s in todo if s.role == "reward2"] == [devices]
  reward, reward2 = (np.asarray(cluster.fetch(results[r], "test")) for r in ("reward", "reward2"))
  assert reward.shape == (B,) and np.std(reward) > 0
  if name == "shared":  # the same program on the same mesh: the same numbers
    np.testing.assert_array_equal(reward2, reward)
  else:
    # On CPU the rows come out bitwise equal: every device computes whole rows with the
    # all-gathered weights, so the mesh changes where a row is computed, not its arithmetic. A
    # backend whose summation order followed the mesh would differ by rounding: fp32's eps
    # (1.2e-7) times the longest reduction (the MLP's 152 terms) is 1.8e-5 of a sum's size.
    np.testing.assert_allclose(reward2, reward, rtol=2e-5, atol=2e-5)

  combined = np.asarray(cluster.fetch(rewards.combine(results), "test"))
  rule = tasks.vowel_reward(seqs.prompts, seqs.responses, {})
  expected = (
    np.float32(COEFS["model"]) * reward
    + np.float32(COEFS["fn"]) * rule
    + np.float32(COEFS["reward2"]) * reward2
  )
  # Three fp32 products and two sums: a few ulps of the largest term.
  np.testing.assert_allclose(combined, expected, rtol=1e-6, atol=1e-6)
  evaluated = rewards.evaluate(
    types.SimpleNamespace(tokens_bs=tokens, attention_mask_bs=attention, **vars(seqs))
  )
  np.testing.assert_allclose(evaluated["reward2_model"], reward2, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(evaluated["reward"], expected, rtol=1e-6, atol=1e-6)


def test_a_run_with_an_extra_reward_role_trains_and_resumes(tmp_path):
  """One small run, packed scoring (the tiny configs' default), the second reward model
  interleaved with the reward: it scores on its own devices, and a resume of the workdir with
  the role configured (a frozen role: nothing of it in the checkpoint) continues."""
  small = {
    "total_steps": 1,
    "rollout.batch_size": 8,
    "rollout.max_new_tokens": 8,
    "eval.num_prompts": 0,  # `Rewards.evaluate` is checked above
    "checkpoint.async_save": False,
    "model.extra_roles": {"reward2": {"size": "tiny"}},
    "reward.model_coef": 0.5,
    "reward.role_coefs": {"reward2": 0.25},
    "placement.extra_roles": {"reward2": {"mode": "interleaved", "with_role": "reward"}},
  }
  Runner(shipped_config("grpo_tiny", small), str(tmp_path), show_progress=False).run()
  entries = {
    (r["role"], r["stage"]): r for r in json.loads((tmp_path / "timeline.json").read_text())
  }
  assert entries[("reward2", "score")]["devices"] == [4, 5, 6, 7]
  cfg = shipped_config("grpo_tiny", {**small, "total_steps": 2})
  again = Runner(cfg, str(tmp_path), show_progress=False)
  assert again.start_step == 1
  again.run()
  assert [row["step"] for row in rows(str(tmp_path))] == [0, 1]
