"""RL maths against plain NumPy loops written from the equations."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlhfjax import algorithms as alg

pytestmark = pytest.mark.unit

B, T, V = 5, 7, 11


@pytest.fixture
def batch():
  rng = np.random.default_rng(0)
  lengths = np.array([7, 3, 1, 5, 6])
  mask = (np.arange(T)[None] < lengths[:, None]).astype(np.float32)
  return dict(
    rng=rng,
    mask=mask,
    lengths=lengths,
    logp=rng.normal(-2.0, 0.5, (B, T)).astype(np.float32),
    ref=rng.normal(-2.0, 0.5, (B, T)).astype(np.float32),
    values=rng.normal(0.0, 1.0, (B, T)).astype(np.float32),
    rewards=rng.normal(0.0, 1.0, (B, T)).astype(np.float32),
    scores=rng.normal(0.0, 1.0, B).astype(np.float32),
  )


def _close(a, b, atol=1e-5):
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=atol, rtol=1e-5)


def test_kl_estimators(batch):
  logp, ref = batch["logp"].astype(np.float64), batch["ref"].astype(np.float64)
  formulas = {
    "k1": lambda lp, r: lp - r,
    "k2": lambda lp, r: 0.5 * (r - lp) ** 2,
    "k3": lambda lp, r: math.exp(r - lp) - 1 - (r - lp),
  }
  for name, formula in formulas.items():
    expected = [[formula(logp[i, t], ref[i, t]) for t in range(T)] for i in range(B)]
    _close(
      alg.get_kl_estimator(name)(jnp.asarray(batch["logp"]), jnp.asarray(batch["ref"])), expected
    )
  assert np.all(np.asarray(alg.kl_k3(jnp.asarray(logp), jnp.asarray(ref))) >= 0)
  with pytest.raises(ValueError, match="unknown KL estimator 'k9'"):
    alg.get_kl_estimator("k9")


def test_k1_and_k3_are_unbiased_estimates_of_kl():
  rng = np.random.default_rng(1)
  p = np.array([0.5, 0.3, 0.2])
  q = np.array([0.2, 0.5, 0.3])
  true_kl = np.sum(p * np.log(p / q))
  samples = rng.choice(3, size=200_000, p=p)
  logp, logq = jnp.log(p)[samples], jnp.log(q)[samples]
  assert abs(float(jnp.mean(alg.kl_k1(logp, logq))) - true_kl) < 5e-3
  assert abs(float(jnp.mean(alg.kl_k3(logp, logq))) - true_kl) < 5e-3


def test_adaptive_kl_controller():
  state = alg.KLControllerState(coef=0.1)
  up = alg.adaptive_kl_update(state, current_kl=12.0, num_samples=64, target=6.0, horizon=1000)
  assert up.coef == pytest.approx(0.1 * (1 + 0.2 * 64 / 1000))  # error clipped at +0.2
  down = alg.adaptive_kl_update(state, current_kl=5.4, num_samples=64, target=6.0, horizon=1000)
  assert down.coef == pytest.approx(0.1 * (1 - 0.1 * 64 / 1000))
  assert alg.fixed_kl_update(state, 100.0, 64, target=6.0, horizon=1000) == state


def test_shape_rewards(batch):
  kl = batch["logp"] - batch["ref"]
  expected = np.zeros((B, T))
  for i in range(B):
    for t in range(batch["lengths"][i]):
      expected[i, t] = -0.05 * kl[i, t]
    expected[i, batch["lengths"][i] - 1] += batch["scores"][i]
  got = alg.shape_rewards(
    jnp.asarray(batch["scores"]), jnp.asarray(kl), jnp.asarray(batch["mask"]), 0.05
  )
  _close(got, expected)


def _numpy_gae(rewards, values, lengths, gamma, lam):
  adv = np.zeros_like(rewards, dtype=np.float64)
  for i in range(rewards.shape[0]):
    last = 0.0
    for t in reversed(range(lengths[i])):
      next_v = values[i, t + 1] if t + 1 < lengths[i] else 0.0
      delta = rewards[i, t] + gamma * next_v - values[i, t]
      last = delta + gamma * lam * last
      adv[i, t] = last
  ret = np.where(np.arange(rewards.shape[1])[None] < lengths[:, None], adv + values, 0.0)
  return adv, ret


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.8), (1.0, 1.0)])
def test_gae(batch, gamma, lam):
  # Garbage beyond each response must not leak in.
  rewards = np.where(batch["mask"] > 0, batch["rewards"], 123.0)
  values = np.where(batch["mask"] > 0, batch["values"], -77.0)
  adv, ret = alg.gae(
    jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(batch["mask"]), gamma=gamma, lam=lam
  )
  exp_adv, exp_ret = _numpy_gae(batch["rewards"], batch["values"], batch["lengths"], gamma, lam)
  _close(adv, exp_adv)
  _close(ret, exp_ret)


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.8)])
def test_gae_and_shaped_rewards_step_over_observations(batch, gamma, lam):
  """A conversation's observations (0 in the mask mid-response) are stepped over: advantages,
  returns and shaped rewards equal those of the sequence of its sampled tokens alone (NumPy),
  scattered back; the score lands on the last sampled token."""
  rng = np.random.default_rng(3)
  observed = (rng.random((B, T)) < 0.3) & (batch["mask"] > 0)
  observed[:, 0] = False  # (a response starts with the model's turn)
  mask = (batch["mask"] > 0) & ~observed
  kl = batch["logp"] - batch["ref"]
  want_rewards, want_adv = np.zeros((B, T)), np.zeros((B, T))
  for i in range(B):
    cols = np.flatnonzero(mask[i])
    n = np.array([len(cols)])
    r = -0.05 * kl[i, cols]
    r[-1] += batch["scores"][i]
    want_rewards[i, cols] = r
    adv, _ = _numpy_gae(r[None], batch["values"][i, cols][None], n, gamma, lam)
    want_adv[i, cols] = adv[0]
  m = jnp.asarray(mask, jnp.float32)
  rewards = alg.shape_rewards(jnp.asarray(batch["scores"]), jnp.asarray(kl) * m, m, 0.05)
  _close(rewards, want_rewards)
  values = np.where(mask, batch["values"], -77.0)  # garbage on observations must not leak in
  adv, ret = alg.gae(rewards, jnp.asarray(values), m, gamma=gamma, lam=lam)
  _close(adv, want_adv)
  _close(ret, np.where(mask, want_adv + batch["values"], 0.0))


@pytest.mark.parametrize("estimator", ["gae", "reinforce_pp", "group_relative"])
def test_turn_rewards_land_on_the_tokens_that_ended_their_turns(estimator):
  """A conversation's environment rewards, one per turn, are in the score (times
  `reward.environment_coef`); a token-level estimator reads each on the last token of its
  turn (GAE and REINFORCE++ against NumPy over the sampled tokens alone, stepping over the
  observations), a sample-level one reads the score as it was."""
  from runs_testing import shipped_config

  from rlhfjax.flows import experience
  from rlhfjax.flows import ppo as ppo_flow
  from rlhfjax.flows.experience import Experience

  b, t, p, coef, gamma, lam = 4, 9, 2, 0.5, 0.9, 0.8
  # Turns of sampled tokens (1) with observations (0) between them, then padding.
  mask = np.array(
    [
      [1, 1, 0, 0, 1, 1, 1, 0, 0],
      [1, 0, 1, 0, 1, 1, 0, 0, 0],
      [1, 1, 1, 1, 1, 1, 1, 1, 1],
      [1, 1, 1, 0, 0, 0, 0, 0, 0],
    ],
    np.float32,
  )
  turns = [[0.5, 2.0], [1.0, -1.0, 3.0], [0.25], [1.0, 2.0]]  # the last: a reward past its turns
  env_bt = experience.place_turn_rewards(turns, mask)
  ends = {0: [1, 6], 1: [0, 2, 5], 2: [8], 3: [2, 2]}
  for i, cols in ends.items():
    want = np.zeros(t, np.float32)
    np.add.at(want, cols, turns[i])
    np.testing.assert_array_equal(env_bt[i], want)
  rng = np.random.default_rng(4)
  base = rng.normal(0.0, 1.0, b).astype(np.float32)
  scores = base + coef * np.asarray([sum(r) for r in turns], np.float32)
  logp, ref = (rng.normal(-2.0, 0.5, (b, t)).astype(np.float32) for _ in range(2))
  values = rng.normal(0.0, 1.0, (b, t)).astype(np.float32)
  changes = {"ppo.gamma": gamma, "ppo.lam": lam, "ppo.group_size": 2, "rollout.batch_size": b}
  cfg = shipped_config("ppo_tiny", changes)
  settings = ppo_flow.advantage_settings(cfg.ppo, estimator, environment_coef=coef)
  fields = dict(
    tokens_bs=jnp.zeros((b, p + t), jnp.int32),
    attention_mask_bs=jnp.ones((b, p + t), jnp.int32),
    response_mask_bt=jnp.asarray(mask),
    rollout_logprobs_bt=jnp.asarray(logp),
    old_logprobs_bt=jnp.asarray(logp),
    ref_logprobs_bt=jnp.asarray(ref),
    values_bt=jnp.asarray(values),
    scores_b=jnp.asarray(scores),
  )
  got, _ = ppo_flow.compute_advantages(
    settings, Experience(**fields, environment_rewards_bt=jnp.asarray(env_bt)), jnp.float32(0.05)
  )
  plain, _ = ppo_flow.compute_advantages(settings, Experience(**fields), jnp.float32(0.05))
  if estimator == "group_relative":
    np.testing.assert_array_equal(np.asarray(got.advantages_bt), np.asarray(plain.advantages_bt))
    return
  kl = (logp - ref) * mask  # the k1 estimator of the shipped config
  want = np.zeros((b, t))
  for i in range(b):
    cols = np.flatnonzero(mask[i])
    r = -0.05 * kl[i, cols] + coef * env_bt[i, cols]
    r[-1] += base[i]
    if estimator == "gae":
      adv, _ = _numpy_gae(r[None], values[i, cols][None], np.array([len(cols)]), gamma, lam)
    else:  # returns to go, which REINFORCE++ whitens over the batch
      adv = np.array([[np.sum(r[k:] * gamma ** np.arange(len(r) - k)) for k in range(len(r))]])
    want[i, cols] = adv[0]
  if estimator == "gae":
    if settings.whiten:
      want = np.asarray(alg.whiten_advantages(jnp.asarray(want, jnp.float32), jnp.asarray(mask)))
    _close(got.advantages_bt, want)
  else:
    _close(got.returns_bt, want)
  # Without the placement the same rewards sit on the last token: other advantages.
  assert not np.allclose(np.asarray(got.advantages_bt), np.asarray(plain.advantages_bt))


def test_group_relative(batch):
  scores = np.array([1.0, 2.0, 4.0, 0.0, 0.0, 3.0], np.float32)
  mask = np.ones((6, 4), np.float32)
  mask[2, 2:] = 0
  adv, _ = alg.group_relative(jnp.asarray(scores), jnp.asarray(mask), group_size=3)
  for g in range(2):
    s = scores[3 * g : 3 * g + 3]
    expected = (s - s.mean()) / (s.std() + 1e-6)
    _close(np.asarray(adv)[3 * g : 3 * g + 3, 0], expected)
  assert np.asarray(adv)[2, 3] == 0.0
  with pytest.raises(ValueError, match="not a multiple of group_size 4"):
    alg.group_relative(jnp.asarray(scores), jnp.asarray(mask), group_size=4)


def test_whitening(batch):
  x, mask = batch["values"], batch["mask"]
  vals = x[mask > 0].astype(np.float64)
  expected = (x - vals.mean()) / np.sqrt(vals.var(ddof=1) + 1e-8) * mask
  _close(alg.whiten_advantages(jnp.asarray(x), jnp.asarray(mask)), expected)
  kept = alg.masked_whiten(jnp.asarray(x), jnp.asarray(mask), shift_mean=False)
  _close(kept, (expected + vals.mean()) * mask)


def test_clipped_policy_loss(batch):
  rng = batch["rng"]
  old = batch["logp"]
  new = old + rng.normal(0, 0.3, old.shape).astype(np.float32)
  adv = rng.normal(0, 1, old.shape).astype(np.float32)
  mask, eps = batch["mask"], 0.2
  total, count, clipped = 0.0, 0, 0
  for i in range(B):
    for t in range(batch["lengths"][i]):
      r = np.exp(new[i, t] - old[i, t])
      a, b = -adv[i, t] * r, -adv[i, t] * np.clip(r, 1 - eps, 1 + eps)
      total += max(a, b)
      clipped += b > a
      count += 1
  loss, stats = alg.clipped_policy_loss(
    jnp.asarray(new), jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask), clip_eps=eps
  )
  _close(loss, total / count)
  _close(stats["clipfrac"], clipped / count)
  # Gradient flows only through unclipped tokens.
  grad = jax.grad(
    lambda lp: alg.clipped_policy_loss(
      lp, jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask), clip_eps=eps
    )[0]
  )(jnp.asarray(new))
  ratio = np.exp(new - old)
  expected_grad = np.where(
    (mask > 0) & ~(-adv * np.clip(ratio, 1 - eps, 1 + eps) > -adv * ratio),
    -adv * ratio / count,
    0.0,
  )
  _close(grad, expected_grad)


def _policy_loss(old, adv, mask, **options):
  """`alg.clipped_policy_loss` of the log-probs alone, the rest fixed (float32)."""
  as32 = lambda x: jnp.asarray(x, jnp.float32)
  return lambda lp: alg.clipped_policy_loss(lp, as32(old), as32(adv), as32(mask), **options)


def test_gspo_against_numpy(batch):
  """GSPO: one length-normalised ratio and one clip per sequence; its gradient is
  `-A_i s_i / |y_i|` on each token of an unclipped sequence, over the sequences."""
  rng, mask, lengths = batch["rng"], batch["mask"], batch["lengths"]
  old = batch["logp"].astype(np.float64)
  new = old + rng.normal(0, 0.3, old.shape)
  adv_b = np.array([1.0, -0.5, 2.0, -1.5, 0.7])
  adv = adv_b[:, None] * mask
  eps_low, eps_high = 0.05, 0.08
  total, grad, clipped = 0.0, np.zeros_like(old), []
  for i in range(B):
    n = lengths[i]
    s = math.exp(sum(new[i, t] - old[i, t] for t in range(n)) / n)
    a, b = -adv_b[i] * s, -adv_b[i] * min(max(s, 1 - eps_low), 1 + eps_high)
    total += max(a, b) / B
    clipped.append(b > a)
    if not b > a:
      grad[i, :n] = -adv_b[i] * s / n / B
  assert any(clipped) and not all(clipped)  # both branches are exercised

  loss = _policy_loss(
    old, adv, mask, clip_eps=eps_low, clip_eps_high=eps_high, aggregation="seq_mean_token_mean",
    loss="gspo",
  )  # fmt: skip

  got, stats = loss(jnp.asarray(new, jnp.float32))
  _close(got, total)
  # Token-level clip fraction: each sequence's tokens share its clip.
  _close(stats["clipfrac"], sum(c * n for c, n in zip(clipped, lengths, strict=True)) / mask.sum())
  _close(jax.grad(lambda lp: loss(lp)[0])(jnp.asarray(new, jnp.float32)), grad)


def test_cispo_against_numpy(batch):
  """CISPO: `-sg(clip(r, 1 - eps_low, 1 + eps_high)) A logp` per token; every token keeps its
  gradient `-w A`, the clipped ones too."""
  rng, mask = batch["rng"], batch["mask"]
  old = batch["logp"].astype(np.float64)
  new = old + rng.normal(0, 0.3, old.shape)
  adv = rng.normal(0, 1, old.shape) * mask
  eps_low, eps_high = 1.0, 0.2
  w = np.clip(np.exp(new - old), 1 - eps_low, 1 + eps_high)
  count = mask.sum()
  assert np.any((w == 1 + eps_high) & (mask > 0)) and np.any((w < 1 + eps_high) & (mask > 0))

  loss = _policy_loss(old, adv, mask, clip_eps=eps_low, clip_eps_high=eps_high, loss="cispo")

  got, stats = loss(jnp.asarray(new, jnp.float32))
  _close(got, np.sum(-w * adv * new * mask) / count)
  _close(stats["clipfrac"], np.sum((w == 1 + eps_high) * mask) / count)
  _close(jax.grad(lambda lp: loss(lp)[0])(jnp.asarray(new, jnp.float32)), -w * adv * mask / count)


def test_packed_sequence_mean_is_each_segments_mean_over_its_response_slots():
  from rlhfjax.training import steps

  segments = np.array([[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 1, 1]], np.int32)
  response = np.array([[0, 1, 1, 0, 1, 0], [0, 0, 1, 1, 1, 0]], bool)
  x = np.arange(12, dtype=np.float32).reshape(2, 6)
  got = steps.packed_sequence_mean(jnp.asarray(segments), jnp.asarray(response))(jnp.asarray(x))
  want = np.array([[1.5, 1.5, 1.5, 4.0, 4.0, 0.0], [9.0] * 6], np.float32)
  np.testing.assert_array_equal(np.asarray(got)[response], want[response])


def test_importance_weights_multiply_each_tokens_loss_without_gradient(batch):
  old, mask = batch["logp"], batch["mask"]
  adv = np.ones_like(old)
  weights = np.where(mask > 0, batch["rng"].uniform(0.0, 2.0, old.shape), 0.0)

  def loss(logp, w):
    return alg.clipped_policy_loss(
      logp, jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask), clip_eps=0.2, weights_bt=w
    )[0]

  # At logp = old the ratio is 1: the loss is -mean_t w_t, its gradient -w_t / count.
  count = mask.sum()
  _close(loss(jnp.asarray(old), jnp.asarray(weights)), -weights.sum() / count)
  grad = jax.grad(loss)(jnp.asarray(old), jnp.asarray(weights))
  _close(grad, -weights * mask / count)
  assert not np.any(np.asarray(jax.grad(loss, argnums=1)(jnp.asarray(old), jnp.asarray(weights))))


def _correction_reference(old, rollout, mask, kind, level, cap):
  """`alg.rollout_correction` as loops over sequences and tokens, in float64."""
  old, rollout = old.astype(np.float64), rollout.astype(np.float64)
  weights, corrected, count = np.zeros_like(old), 0, 0
  for i in range(old.shape[0]):
    tokens = [t for t in range(old.shape[1]) if mask[i, t]]
    if level == "sequence" and tokens:
      seq = sum(old[i, t] - rollout[i, t] for t in tokens) / len(tokens)
    for t in tokens:
      log_r = seq if level == "sequence" else old[i, t] - rollout[i, t]
      r = math.exp(log_r)
      if kind == "tis":
        weights[i, t], hit = min(r, cap), r > cap
      elif kind == "mis":
        inside = 1.0 / cap <= r <= cap
        weights[i, t], hit = float(inside), not inside
      else:
        weights[i, t], hit = 1.0, False
      corrected += hit
      count += 1
  return weights, corrected / count


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("kind", ["none", "tis", "mis"])
def test_rollout_correction_against_numpy(batch, kind, level):
  old, mask = batch["logp"], batch["mask"]
  # Engine log-probs a little off, some far off: both sides of the band [1/C, C] are reached.
  rollout = old + batch["rng"].normal(0.0, 0.6, old.shape).astype(np.float32)
  cap = 1.5
  got, frac = alg.rollout_correction(
    jnp.asarray(old), jnp.asarray(rollout), jnp.asarray(mask), kind=kind, level=level, cap=cap
  )
  want, want_frac = _correction_reference(old, rollout, mask, kind, level, cap)
  _close(got, want)
  _close(frac, want_frac)
  if kind != "none":
    assert 0 < want_frac < 1  # the data exercises the cap
  assert not np.any(np.asarray(got)[mask == 0])


def test_mismatch_stats_against_numpy(batch):
  old, mask = batch["logp"].astype(np.float64), batch["mask"]
  rollout = old + batch["rng"].normal(0.0, 0.1, old.shape)
  got = alg.mismatch_stats(
    jnp.asarray(old, jnp.float32), jnp.asarray(rollout, jnp.float32), jnp.asarray(mask)
  )
  log_r = [[old[i, t] - rollout[i, t] for t in range(T) if mask[i, t]] for i in range(B)]
  tokens = [x for row in log_r for x in row]
  k3 = lambda x: math.exp(x) - 1 - x
  seqs = [sum(row) / len(row) for row in log_r if row]
  # float32 inputs: log r carries ~1e-7 * |logp| of rounding, k3 ~ (log r)^2 / 2 ~ 5e-3.
  _close(got["max"], max(abs(x) for x in tokens), atol=1e-6)
  _close(got["mean"], np.mean(np.abs(tokens)), atol=1e-6)
  _close(got["k3"], np.mean([k3(x) for x in tokens]), atol=1e-6)
  _close(got["seq_k3"], np.mean([k3(x) for x in seqs]), atol=1e-6)
  # The trainer's own numerics: no mismatch.
  same = alg.mismatch_stats(jnp.asarray(old), jnp.asarray(old), jnp.asarray(mask))
  assert all(float(v) == 0.0 for v in same.values())


def test_clipped_value_loss(batch):
  rng = batch["rng"]
  old_v = batch["values"]
  new_v = old_v + rng.normal(0, 0.5, old_v.shape).astype(np.float32)
  ret = rng.normal(0, 1, old_v.shape).astype(np.float32)
  eps, total, count = 0.2, 0.0, 0
  for i in range(B):
    for t in range(batch["lengths"][i]):
      vc = old_v[i, t] + np.clip(new_v[i, t] - old_v[i, t], -eps, eps)
      total += max((new_v[i, t] - ret[i, t]) ** 2, (vc - ret[i, t]) ** 2)
      count += 1
  loss, _ = alg.clipped_value_loss(
    jnp.asarray(new_v),
    jnp.asarray(old_v),
    jnp.asarray(ret),
    jnp.asarray(batch["mask"]),
    clip_eps=eps,
  )
  _close(loss, 0.5 * total / count)


def test_entropy_and_token_logprobs(batch):
  rng = batch["rng"]
  logits = rng.normal(0, 2, (B, T, V)).astype(np.float32)
  tokens = rng.integers(0, V, (B, T))
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  ent = -(p * np.log(p)).sum(-1)
  _close(alg.entropy_from_logits(jnp.asarray(logits)), ent)
  mask = batch["mask"]
  _close(alg.entropy_bonus(jnp.asarray(logits), jnp.asarray(mask)), (ent * mask).sum() / mask.sum())
  lp = np.log(np.take_along_axis(p, tokens[..., None], -1)[..., 0])
  _close(alg.token_logprobs(jnp.asarray(logits), jnp.asarray(tokens)), lp)


_FAMILY = {
  "ppo": None,
  "grpo": "group_relative",
  "dapo": "group_relative",
  "rloo": "rloo",
  "reinforce_pp": "reinforce_pp",
}
"""The PPO-family flows and the estimator each one's name fixes (None: `ppo.advantage`'s)."""


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("kind", ["tis", "mis"])
@pytest.mark.parametrize("name", list(_FAMILY))
def test_every_ppo_family_flow_applies_each_correction(name, kind, level):
  """Each flow's advantage stage (`compute_advantages`, with the settings the flow builds from
  its shipped config) gives the NumPy correction's weights at each kind and level, and leaves
  its advantages and returns as they are without a correction. The weights reach the loss as
  data: every flow's runs apply one correction end to end (runs_testing.CORRECTION_OF)."""
  from runs_testing import shipped_config

  from rlhfjax.flows import ppo as ppo_flow
  from rlhfjax.flows.experience import Experience

  b, t, p, cap = 8, 6, 3, 1.5
  changes = {
    "ppo.group_size": 4,
    "rollout.batch_size": b,
    "rollout.max_new_tokens": t,
    "ppo.rollout_correction": kind,
    "ppo.rollout_correction_level": level,
    "ppo.rollout_correction_cap": cap,
  }
  cfg = shipped_config(f"{name}_tiny", changes)
  estimator = ppo_flow.check_config(cfg, _FAMILY[name])
  rng = np.random.default_rng(1)
  mask = (np.arange(t)[None] < rng.integers(1, t + 1, b)[:, None]).astype(np.float32)
  old = rng.normal(-2.0, 0.5, (b, t)).astype(np.float32)
  exp = Experience(
    tokens_bs=jnp.zeros((b, p + t), jnp.int32),
    attention_mask_bs=jnp.ones((b, p + t), jnp.int32),
    response_mask_bt=jnp.asarray(mask),
    rollout_logprobs_bt=jnp.asarray(old + rng.normal(0.0, 0.6, (b, t)).astype(np.float32)),
    old_logprobs_bt=jnp.asarray(old),
    ref_logprobs_bt=jnp.asarray(rng.normal(-2.0, 0.5, (b, t)).astype(np.float32)),
    values_bt=jnp.asarray(rng.normal(0.0, 1.0, (b, t)).astype(np.float32)),
    scores_b=jnp.asarray(rng.normal(0.0, 1.0, b).astype(np.float32)),
  )
  settings = ppo_flow.advantage_settings(cfg.ppo, estimator)
  got, stats = ppo_flow.compute_advantages(settings, exp, jnp.float32(0.05))
  plain, _ = ppo_flow.compute_advantages(
    dataclasses.replace(settings, correction="none"), exp, jnp.float32(0.05)
  )
  want, want_frac = _correction_reference(
    old, np.asarray(exp.rollout_logprobs_bt), mask, kind, level, cap
  )
  _close(got.is_weights_bt, want)
  _close(stats["rollout_correction/corrected_frac"], want_frac)
  assert 0 < want_frac < 1
  np.testing.assert_array_equal(np.asarray(got.advantages_bt), np.asarray(plain.advantages_bt))
  np.testing.assert_array_equal(np.asarray(got.returns_bt), np.asarray(plain.returns_bt))
