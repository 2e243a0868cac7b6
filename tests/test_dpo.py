"""DPO's losses and sequence log-probs, and online DPO's pairs, against NumPy. The flows' runs:
test_dpo_runs.py."""

import jax
import numpy as np
import pytest

from rlhfjax import algorithms as alg
from rlhfjax.flows.online_dpo import make_pairs

pytestmark = pytest.mark.unit

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
