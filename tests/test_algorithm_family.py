"""GRPO, RLOO, REINFORCE++ and DAPO maths against NumPy loops written from the equations."""

import numpy as np
import pytest

from rlhfjax import algorithms as alg

pytestmark = pytest.mark.unit

G, P, T = 3, 2, 7  # samples per prompt, prompts, response length
B = G * P


@pytest.fixture
def batch():
  rng = np.random.default_rng(3)
  lengths = np.array([7, 3, 1, 5, 6, 2])
  mask = (np.arange(T)[None] < lengths[:, None]).astype(np.float32)
  return dict(
    mask=mask,
    scores=rng.normal(0.0, 1.0, B).astype(np.float32),
    kl=rng.normal(0.1, 0.2, (B, T)).astype(np.float32) * mask,  # estimators take masked KL
    x=rng.normal(0.0, 1.0, (B, T)).astype(np.float32),
    logp=rng.normal(-2.0, 0.3, (B, T)).astype(np.float32),
    old=rng.normal(-2.0, 0.3, (B, T)).astype(np.float32),
    adv=rng.normal(0.0, 1.0, (B, T)).astype(np.float32),
  )


def _close(a, b, atol=1e-5):
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=atol, rtol=1e-5)


def test_leave_one_out(batch):
  s, mask = batch["scores"].astype(np.float64), batch["mask"]
  want = np.zeros(B)
  for i in range(B):
    group = range(i // G * G, i // G * G + G)
    want[i] = s[i] - np.mean([s[j] for j in group if j != i])
  adv, ret = alg.leave_one_out(batch["scores"], mask, group_size=G)
  _close(adv, want[:, None] * mask)
  _close(ret, s[:, None] * mask)
  with pytest.raises(ValueError, match="group_size >= 2"):
    alg.leave_one_out(batch["scores"], mask, group_size=1)


def test_group_relative_without_std_is_dr_grpo(batch):
  s, mask = batch["scores"].astype(np.float64), batch["mask"]
  groups = s.reshape(P, G)
  want = (groups - groups.mean(-1, keepdims=True)).reshape(B)
  adv, _ = alg.group_relative(batch["scores"], mask, group_size=G, normalize_std=False)
  _close(adv, want[:, None] * mask)


def test_reinforce_pp_returns_whitened_over_the_batch(batch):
  r, mask, gamma = batch["x"].astype(np.float64), batch["mask"], 0.9
  ret = np.zeros((B, T))
  for i in range(B):
    n = int(mask[i].sum())
    for t in range(n):
      ret[i, t] = sum(gamma ** (k - t) * r[i, k] for k in range(t, n))
  values = ret[mask > 0]
  want = (ret - values.mean()) / np.sqrt(values.var(ddof=1) + 1e-8) * mask
  adv, got_ret = alg.reinforce_pp(batch["x"], mask, gamma=gamma)
  _close(got_ret, ret)
  _close(adv, want, atol=1e-4)


@pytest.mark.parametrize("name", ["group_relative", "rloo", "reinforce_pp", "gae"])
def test_estimators_take_the_kl_as_a_reward(batch, name):
  """Sample-level estimators subtract beta * sum_t kl_t from the score; token-level ones shape
  per-token rewards. With beta = 0 the KL does not matter."""
  mask, beta = batch["mask"], 0.3
  settings = alg.EstimatorSettings(gamma=1.0, lam=0.95, group_size=G)
  values = np.zeros((B, T), np.float32)
  estimate = alg.ADVANTAGE_ESTIMATORS[name].estimate
  with_kl, _ = estimate(batch["scores"], batch["kl"], values, mask, beta, settings)
  no_kl_a, _ = estimate(batch["scores"], batch["kl"], values, mask, 0.0, settings)
  no_kl_b, _ = estimate(batch["scores"], 0 * batch["kl"], values, mask, 0.0, settings)
  _close(no_kl_a, no_kl_b)
  assert not np.allclose(np.asarray(with_kl), np.asarray(no_kl_a))
  if name in ("group_relative", "rloo"):
    total = batch["scores"] - beta * (batch["kl"] * mask).sum(-1)
    ref, _ = estimate(total, 0 * batch["kl"], values, mask, 0.0, settings)
    _close(with_kl, ref)


def test_loss_aggregations(batch):
  x, mask = batch["x"].astype(np.float64), batch["mask"]
  per_seq = [(x[i] * mask[i]).sum() / mask[i].sum() for i in range(B)]
  _close(alg.token_mean(batch["x"], mask), (x * mask).sum() / mask.sum())
  _close(alg.seq_mean_token_mean(batch["x"], mask), np.mean(per_seq))
  _close(alg.seq_mean_token_sum_norm(batch["x"], mask), np.mean((x * mask).sum(-1)) / T)
  assert set(alg.LOSS_AGGREGATIONS) == {
    "token_mean",
    "seq_mean_token_mean",
    "seq_mean_token_sum_norm",
  }


@pytest.mark.parametrize("aggregation", sorted(alg.LOSS_AGGREGATIONS))
def test_decoupled_clip(batch, aggregation):
  low, high = 0.1, 0.3
  logp, old = batch["logp"].astype(np.float64), batch["old"].astype(np.float64)
  adv, mask = batch["adv"].astype(np.float64), batch["mask"]
  ratio = np.exp(logp - old)
  per_token = np.maximum(-adv * ratio, -adv * np.clip(ratio, 1 - low, 1 + high))
  want = float(alg.LOSS_AGGREGATIONS[aggregation](per_token.astype(np.float32), mask))
  got, _ = alg.clipped_policy_loss(
    batch["logp"],
    batch["old"],
    batch["adv"],
    mask,
    clip_eps=low,
    clip_eps_high=high,
    aggregation=aggregation,
  )
  _close(got, want)
  symmetric, _ = alg.clipped_policy_loss(
    batch["logp"], batch["old"], batch["adv"], mask, clip_eps=low, aggregation=aggregation
  )
  assert abs(float(symmetric) - float(got)) > 1e-6  # the upper clip really differs
