"""DPO: the losses against NumPy, and the flow on two placements (the reference on its own
devices), learning on the bundled preferences. Online DPO: its pairs against NumPy, the same
numbers on two placements, learning on the bundled task."""

import dataclasses
import itertools
import pathlib
import re
import runpy

import jax
import numpy as np
import pytest
from runs_testing import assert_same_numbers, shipped_config

from rlhfjax import algorithms as alg
from rlhfjax.config import ConfigError, from_config_dict
from rlhfjax.flows.online_dpo import make_pairs, refuse_ppo_fields
from rlhfjax.placement.spec import Role
from rlhfjax.runner import Runner

_ROOT = pathlib.Path(__file__).parent.parent
B = 5


def _logsig(x):
  return -np.logaddexp(0.0, -x)


@pytest.mark.parametrize(("loss", "smoothing"), [("sigmoid", 0.0), ("sigmoid", 0.2), ("ipo", 0.0)])
def test_dpo_loss_against_numpy(loss, smoothing):
  rng = np.random.default_rng(7)
  pc, pr, rc, rr = (rng.normal(-20, 3, B).astype(np.float32) for _ in range(4))
  valid = np.array([1, 1, 1, 0, 1], np.float32)
  beta = 0.3
  h = (pc.astype(np.float64) - rc) - (pr.astype(np.float64) - rr)
  if loss == "sigmoid":
    per = -(1 - smoothing) * _logsig(beta * h) - smoothing * _logsig(-beta * h)
  else:
    per = (h - 1 / (2 * beta)) ** 2
  got, stats = alg.dpo_loss(pc, pr, rc, rr, valid, beta=beta, loss=loss, label_smoothing=smoothing)
  np.testing.assert_allclose(float(got), (per * valid).sum() / valid.sum(), rtol=1e-5)
  chosen, rejected = beta * (pc - rc), beta * (pr - rr)
  np.testing.assert_allclose(
    float(stats["margin"]), ((chosen - rejected) * valid).sum() / valid.sum(), rtol=1e-4
  )
  assert float(stats["accuracy"]) == pytest.approx(((chosen > rejected) * valid).sum() / 4)


def test_sequence_logprobs_sum_the_response_tokens():
  rng = np.random.default_rng(1)
  logits = rng.normal(0, 1, (2, 5, 7)).astype(np.float32)
  tokens = rng.integers(0, 7, (2, 5)).astype(np.int32)
  mask = np.array([[0, 0, 1, 1, 0], [0, 1, 1, 1, 1]], np.float32)
  logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  want = [sum(logp[i, j - 1, tokens[i, j]] for j in range(1, 5) if mask[i, j]) for i in range(2)]
  np.testing.assert_allclose(
    np.asarray(alg.sequence_logprobs(logits, tokens, mask)), want, rtol=1e-5
  )


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
  return {
    variant: Runner(
      _online(variant), str(tmp_path_factory.mktemp(variant)), show_progress=False
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


@pytest.mark.parametrize("name", ["dpo", "online_dpo"])
def test_dpo_flows_refuse_fused_scoring(tmp_path, name):
  cfg = _config("colocated") if name == "dpo" else _online("colocated")
  cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, fused_scoring=True))
  with pytest.raises(ConfigError, match=rf"{name} does not score samples while they generate"):
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


@pytest.mark.parametrize("group_size", [2, 3])
def test_online_dpo_pairs_the_best_and_worst_sample_of_each_prompt(group_size):
  rng = np.random.default_rng(group_size)
  groups, t, p = 4, 5, 3
  b, s = groups * group_size, p + t
  scores = rng.integers(0, 3, b).astype(np.float32)
  scores[:group_size] = 1.0  # a group whose samples all tie
  tokens = rng.integers(0, 97, (b, s)).astype(np.int32)
  attention = rng.integers(0, 2, (b, s)).astype(np.int32)
  response = rng.integers(0, 2, (b, t)).astype(np.float32)
  got = jax.device_get(make_pairs(tokens, attention, response, scores, group_size=group_size))
  loss_mask = np.concatenate([np.zeros((b, p), np.float32), response], axis=1)
  for g in range(groups):
    rows = scores[g * group_size : (g + 1) * group_size]
    best, worst = g * group_size + np.argmax(rows), g * group_size + np.argmin(rows)
    assert got["valid"][g] == float(rows.max() > rows.min())
    for name, row in (("chosen", best), ("rejected", worst)):
      np.testing.assert_array_equal(got[f"{name}_tokens"][g], tokens[row])
      np.testing.assert_array_equal(got[f"{name}_mask"][g], attention[row])
      np.testing.assert_array_equal(got[f"{name}_loss_mask"][g], loss_mask[row])
  assert got["valid"][0] == 0.0


@pytest.mark.slow
def test_online_dpo_reward_rises(tmp_path):
  """The rule alone (most pairs of the untrained policy tie and are left out), 40 iterations of
  16 samples, as GRPO's learning test in test_algorithm_flows.py."""
  cfg = _online("colocated", total_steps=40, rollout__batch_size=16, reward__model_coef=0.0)
  rows = Runner(cfg, str(tmp_path), show_progress=False).run().metrics
  rewards = [r["reward/mean"] for r in rows]
  first, last = np.mean(rewards[:5]), np.mean(rewards[-5:])
  assert last > first + 0.15 and last > 5 * first, rewards
  assert 0 < rows[0]["pairs/valid"] < 1
