"""DPO: the losses against NumPy, and the flow on two placements (the reference on its own
devices), learning on the bundled preferences."""

import itertools
import pathlib
import runpy

import jax
import numpy as np
import pytest

from rlhfjax import algorithms as alg
from rlhfjax.config import ConfigError, from_config_dict
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
  cd = runpy.run_path(str(_ROOT / "configs" / "dpo_tiny.py"))["get_config"](variant)
  cd.total_steps = 4
  cd.rollout.batch_size = 8
  cd.rollout.max_prompt_len = 40
  cd.rollout.max_new_tokens = 40
  cd.dpo.update(dpo)
  return from_config_dict(cd)


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
  for a, b in zip(base, other, strict=True):
    for key in ("loss/dpo", "dpo/margin", "actor/grad_norm", "eval/margin", "eval/accuracy"):
      assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), key


def test_dpo_learns_and_compiles_once(runs):
  runner, result = runs["colocated"]
  rows = result.metrics
  losses = [r["loss/dpo"] for r in rows]
  assert losses[0] == pytest.approx(np.log(2), abs=1e-5)  # the policy starts as the reference
  assert all(b < a for a, b in itertools.pairwise(losses))
  assert rows[-1]["eval/margin"] > rows[0]["eval/margin"] > 0
  assert set(result.compilations.values()) == {1}, result.compilations
  assert set(runner.cluster.states) == {Role.ACTOR} and runner.cluster.engine is None
  ids = [d.id for d in jax.devices()]
  ref = runner.cluster.params[Role.REFERENCE]
  want = {ids[i] for i in runner.placement[Role.REFERENCE].devices}
  assert {s.device.id for leaf in jax.tree.leaves(ref) for s in leaf.addressable_shards} == want


def test_dpo_options_are_checked():
  with pytest.raises(ConfigError, match="'dpo.loss' must be one of sigmoid, ipo"):
    _config("colocated", loss="hinge")


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
  assert base[0]["loss/dpo"] == pytest.approx(np.log(2), abs=1e-5)
  for a, b in zip(base, other, strict=True):
    for key in ("reward/mean", "loss/dpo", "dpo/margin", "actor/grad_norm"):
      assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), key
  assert base[1]["loss/dpo"] != base[0]["loss/dpo"]
  assert set(online["disaggregated"].compilations.values()) == {1}
  assert online["disaggregated"].metrics[0]["sync/bytes"] > 0


def test_online_dpo_needs_pairs(tmp_path):
  with pytest.raises(ConfigError, match="'ppo.group_size' must be 2"):
    Runner(_online("colocated", ppo__group_size=4), str(tmp_path), show_progress=False)
