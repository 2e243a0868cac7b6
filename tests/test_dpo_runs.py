"""DPO's flow on two placements (the reference on its own devices), learning on the bundled
preferences; online DPO's flow: the same numbers on two placements, learning on the bundled task;
the options each refuses."""

import dataclasses
import itertools
import pathlib
import re
import runpy

import jax
import numpy as np
import pytest
from runs_testing import LEARNING_RUN, assert_same_numbers, shipped_config

from rlhfjax.config import ConfigError, from_config_dict
from rlhfjax.flows.online_dpo import refuse_ppo_fields
from rlhfjax.placement.spec import Role
from rlhfjax.runner import Runner

pytestmark = pytest.mark.integration

_ROOT = pathlib.Path(__file__).parent.parent


def _config(variant, **dpo):
  changes = {
    "total_steps": 4,
    "rollout.batch_size": 8,
    "rollout.max_prompt_len": 40,
    "rollout.max_new_tokens": 40,
  }
  return shipped_config("dpo_tiny", changes | {f"dpo.{k}": v for k, v in dpo.items()}, variant)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  out = {}
  for variant in ("colocated", "interleaved"):
    runner = Runner(_config(variant), str(tmp_path_factory.mktemp(variant)), show_progress=False)
    out[variant] = (runner, runner.run())
  return out


def test_dpo_gives_the_same_numbers_with_the_reference_on_its_own_devices(runs):
  runner = runs["interleaved"][0]
  assert runner.placement[Role.REFERENCE].devices != runner.placement[Role.ACTOR].devices
  base, other = runs["colocated"][1].metrics, runs["interleaved"][1].metrics
  keys = ("loss/dpo", "dpo/margin", "actor/grad_norm", "eval/margin", "eval/accuracy")
  assert_same_numbers(base, other, keys)


def test_dpo_learns_and_compiles_once(runs):
  runner, result = runs["colocated"]
  rows = result.metrics
  losses = [r["loss/dpo"] for r in rows]
  assert losses[0] == pytest.approx(np.log(2), abs=1e-5)  # the policy starts as the reference
  assert all(b < a for a, b in itertools.pairwise(losses))
  assert rows[-1]["eval/margin"] > rows[0]["eval/margin"] > 0
  # Held out: every pair ranked right by the implicit rewards (at the reference all tie at 0,
  # which counts as wrong). The bundled vowels preferences separate after the first step.
  assert rows[-1]["eval/accuracy"] == 1.0
  assert set(result.compilations.values()) == {1}, result.compilations
  assert set(runner.cluster.states) == {Role.ACTOR} and runner.cluster.engine is None
  ids = [d.id for d in jax.devices()]
  ref = runner.cluster.params[Role.REFERENCE]
  want = {ids[i] for i in runner.placement[Role.REFERENCE].devices}
  assert {s.device.id for leaf in jax.tree.leaves(ref) for s in leaf.addressable_shards} == want


def test_dpo_options_are_checked():
  with pytest.raises(ConfigError, match="'dpo.loss' must be one of sigmoid, ipo"):
    _config("colocated", loss="hinge")
  # Issue 28, item 10: options that would be ignored are refused.
  with pytest.raises(ConfigError, match=r"'dpo.label_smoothing'=0.1 is conservative DPO's"):
    _config("colocated", loss="ipo", label_smoothing=0.1)


def _online(variant, **changes):
  cd = runpy.run_path(str(_ROOT / "configs" / "online_dpo_tiny.py"))["get_config"](variant)
  cd.total_steps = 2
  cd.rollout.batch_size = 8
  cd.rollout.max_new_tokens = 8
  cd.eval.num_prompts = 0
  cd.reward.model_coef = 0.5  # continuous scores: no tied pairs
  for dotted, value in changes.items():
    section, _, field = dotted.rpartition("__")
    (cd[section] if section else cd)[field] = value
  return from_config_dict(cd)


@pytest.fixture(scope="module")
def online(tmp_path_factory):
  """The co-located run frees its rollout's weight copy between generations (`rollout.release`):
  the numbers are the disaggregated run's all the same."""
  return {
    variant: Runner(
      _online(variant, rollout__release=variant == "colocated"),
      str(tmp_path_factory.mktemp(variant)),
      show_progress=False,
    ).run()
    for variant in ("colocated", "disaggregated")
  }


def test_online_dpo_same_numbers_on_two_placements(online):
  base, other = online["colocated"].metrics, online["disaggregated"].metrics
  assert base[0]["pairs/valid"] == 1.0
  # The mean of the iteration's 2 x 2 updates: the first at log 2 (the policy starts as the
  # reference), the later ones after steps on these pairs.
  assert 0.5 < base[0]["loss/dpo"] < np.log(2) - 0.01
  for a, b in zip(base, other, strict=True):
    for key in ("reward/mean", "loss/dpo", "dpo/margin", "actor/grad_norm"):
      assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), key
  assert base[1]["loss/dpo"] != base[0]["loss/dpo"]
  assert set(online["disaggregated"].compilations.values()) == {1}
  assert online["disaggregated"].metrics[0]["sync/bytes"] > 0
  # What the release freed: the rollout's own copy of the weights (laid out for generation, not
  # the actor's buffers), after each generation; no row says so where nothing is released.
  released = [row["rollout/released_bytes"] for row in base]
  assert released[0] > 0 and released == [released[0]] * len(base)
  assert all("rollout/released_bytes" not in row for row in other)


@pytest.mark.parametrize("name", ["dpo", "online_dpo"])
def test_dpo_flows_refuse_fused_scoring(tmp_path, name):
  cfg = _config("colocated") if name == "dpo" else _online("colocated")
  cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, fused_scoring=True))
  match = rf"\(ppo, grpo, dapo, rloo, reinforce_pp\); {name} does not: set it to False"
  with pytest.raises(ConfigError, match=match):
    Runner(cfg, str(tmp_path), show_progress=False)


def test_online_dpo_needs_pairs(tmp_path):
  match = "'online_dpo.samples_per_prompt' must be at least 2, got 1"
  with pytest.raises(ConfigError, match=match):
    _online("colocated", online_dpo__samples_per_prompt=1)
  match = "pairs of a batch .* must split into 'online_dpo.mini_batches'"
  with pytest.raises(ConfigError, match=match):
    Runner(_online("colocated", online_dpo__mini_batches=8), str(tmp_path), show_progress=False)


@pytest.mark.parametrize(
  ("field", "value", "hint"),
  [
    ("group_size", 4, "set 'online_dpo.samples_per_prompt'"),
    ("ppo_epochs", 2, "set 'online_dpo.epochs'"),
    ("mini_batches", 2, "set 'online_dpo.mini_batches'"),
    ("micro_batches", 2, "set 'online_dpo.micro_batches'"),
    ("kl_coef", 0.5, "online DPO has no such setting"),
    ("async_rollout", True, "online DPO has no such setting"),
  ],
)
def test_online_dpo_refuses_the_ppo_fields_it_would_ignore(field, value, hint):
  cfg = _online("colocated", **{f"ppo__{field}": value})
  message = f"'ppo.{field}'={value!r} is PPO's; online DPO ignores it: {hint}"
  with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
    refuse_ppo_fields(cfg)
  refuse_ppo_fields(_online("colocated", ppo__max_skipped_updates=5))  # the runner's


def test_online_dpo_flow_refuses_ppo_fields(tmp_path):
  with pytest.raises(ConfigError, match="set 'online_dpo.samples_per_prompt'"):
    Runner(_online("colocated", ppo__group_size=4), str(tmp_path), show_progress=False)


@pytest.mark.slow
def test_online_dpo_reward_rises(tmp_path):
  """The rule alone (most pairs of the untrained policy tie and are left out), the learning run
  of every flow (`runs_testing.LEARNING_RUN`)."""
  cfg = _online("colocated", reward__model_coef=0.0, **LEARNING_RUN)
  rows = Runner(cfg, str(tmp_path), show_progress=False).run().metrics
  rewards = [r["reward/mean"] for r in rows]
  first, last = np.mean(rewards[:5]), np.mean(rewards[-5:])
  assert last > first + 0.15 and last > 5 * first, rewards
  assert 0 < rows[0]["pairs/valid"] < 1
