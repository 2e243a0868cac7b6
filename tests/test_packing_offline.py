"""Packing in DPO, online DPO, SFT and reward-model training (issue 24): the packed loss and
gradients against the padded ones on sequences of very different lengths, and two token budgets
(two different packings) giving the same gradients. Each flow's run packed against padded:
test_packing_offline_runs.py.

Tolerances (fp32): a packed forward computes every token's result with the same operations as
the padded one, only the order of the sums differs (attention over `w` instead of `s` columns,
per-sequence sums by segment, micro-batch sums), so results agree to a few float32 roundings
of the sums: relative 1e-5 on losses and on gradients (their elements measured against the
largest of their leaf, as tiny elements carry absolute, not relative, rounding error).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from rlhfjax import models
from rlhfjax.config.model import get_model_config
from rlhfjax.data import packed_batches
from rlhfjax.flows.dpo import dpo_step_loss, packed_dpo_step_loss, pair_logprobs
from rlhfjax.flows.experience import assemble
from rlhfjax.flows.online_dpo import host_pairs, make_pairs, plan_pairs
from rlhfjax.training import packed, reward_model, sft

pytestmark = pytest.mark.unit

CONFIG = get_model_config("tiny", dtype="float32", param_dtype="float32")
RTOL = 1e-5
PAD = 258
DPO = {"beta": 0.1, "loss": "sigmoid", "label_smoothing": 0.0}


@pytest.fixture(scope="module")
def params():
  init = lambda head, key: jax.jit(functools.partial(models.init_params, CONFIG, head))(key)
  lm = init("lm", jax.random.key(0))
  value = init("value", jax.random.key(1))
  # A reference away from the policy, so DPO's margins are not all zero.
  ref = jax.tree.map(lambda p, q: p + 0.05 * q, lm, init("lm", jax.random.key(2)))
  # A value head away from zero (it starts at 0 in a fresh reward model only when loaded).
  value["value_head"] = jax.random.normal(jax.random.key(3), value["value_head"].shape)
  return {"lm": lm, "ref": ref, "value": value}


def _right_padded(lengths, s, seed, prompt_lens=None):
  """Right-padded tokens, attention and loss masks of sequences of `lengths`."""
  rng = np.random.default_rng(seed)
  b = len(lengths)
  prompt_lens = prompt_lens if prompt_lens is not None else [max(1, n // 3) for n in lengths]
  tokens = np.full((b, s), PAD, np.int32)
  mask = np.zeros((b, s), np.int32)
  loss = np.zeros((b, s), np.float32)
  for i, (n, p) in enumerate(zip(lengths, prompt_lens, strict=True)):
    tokens[i, :n] = rng.integers(0, 256, n)
    mask[i, :n] = 1
    loss[i, p:n] = 1.0
  return tokens, mask, loss


S = 40
LENGTHS = [40, 3, 17, 9, 32, 5, 2, 26]  # very different lengths, one at the full width
OTHER = [4, 38, 21, 2, 11, 30, 7, 15]


def _sft_batch():
  tokens, mask, loss = _right_padded(LENGTHS, S, 0)
  return {
    "tokens": tokens,
    "attention_mask": mask,
    "loss_mask": loss,
    "valid": np.ones(len(LENGTHS), np.float32),
  }


def _pair_batch(valid=None):
  chosen = _right_padded(LENGTHS, S, 1)
  prompts = [max(1, n // 3) for n in LENGTHS]
  rejected = _right_padded(
    OTHER, S, 2, [min(p, n - 1) for p, n in zip(prompts, OTHER, strict=True)]
  )
  out = {"valid": np.ones(len(LENGTHS), np.float32) if valid is None else valid}
  for name, (tokens, mask, loss) in (("chosen", chosen), ("rejected", rejected)):
    out |= {f"{name}_tokens": tokens, f"{name}_mask": mask, f"{name}_loss_mask": loss}
  return out


PAIR_SIDES = (("chosen_tokens", "chosen_mask"), ("rejected_tokens", "rejected_mask"))
DPO_MASKS = ("chosen_loss_mask", "rejected_loss_mask")


def _padded(loss_fn, params, batch):
  (loss, metrics), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params, batch)
  return float(loss), jax.device_get(metrics), jax.device_get(grads)


def _packed_budgets(loss_fn, params, micros_of):
  """The batch's metrics and gradients summed over its packed micro-batches (`micros_of(rows)`)
  for each of `BUDGETS`, as `PackedStep` sums them (`packed.accumulate`, one trace per row
  count, shared between the budgets)."""
  zeros = jax.jit(functools.partial(packed.zeros, loss_fn))
  step = jax.jit(functools.partial(packed.accumulate, loss_fn))
  out = []
  for max_rows in BUDGETS:
    micros = micros_of(max_rows)
    assert len(micros) > 1  # gradient accumulation really runs
    acc = zeros(params, micros[0])
    for micro in micros:
      acc = step(params, acc, micro)
    acc = jax.device_get(acc)
    out.append((acc["metrics"], acc["grads"], micros))
  (_, first, a), (_, second, b) = out
  assert [m["tokens"].shape[0] for m in a] != [m["tokens"].shape[0] for m in b]
  _assert_grads_close(second, first)  # two packings, the same gradients
  return out


def _assert_grads_close(got, want):
  for path, g in jax.tree_util.tree_leaves_with_path(got):
    w = _leaf(want, path)
    scale = float(np.max(np.abs(w)))
    assert scale > 0, path
    np.testing.assert_allclose(g, w, rtol=RTOL, atol=RTOL * scale, err_msg=str(path))


def _leaf(tree, path):
  for key in path:
    tree = tree[key.key]
  return tree


def _assert_metrics_close(got, want, atol=1e-7):
  """`atol`: DPO's rewards are `beta` times differences of sequence log-probs of some hundred
  nats, whose rounding is relative to those sums, not to the small differences."""
  assert set(got) == set(want)
  for key, value in want.items():
    np.testing.assert_allclose(got[key], value, rtol=RTOL, atol=atol, err_msg=key)


def _dpo_atol(batch):
  return RTOL * DPO["beta"] * float(np.max(np.abs(batch["ref_chosen"])))


def _right_padded_micros(batch, sides, masks):
  return lambda max_rows: packed_batches.right_padded_micro_batches(
    batch, sides, masks, max_len=S, max_rows=max_rows, pad_id=PAD
  )


BUDGETS = (2, 3)
"""Rows per micro-batch: two different packings of the same batch."""


def _check(loss_fn, packed_loss, params, batch, micros_of, atol=1e-7):
  """Padded against packed at both budgets: metrics and gradients."""
  _, want, want_grads = _padded(loss_fn, params, batch)
  for got, grads, _ in _packed_budgets(packed_loss, params, micros_of):
    _assert_metrics_close(got, want, atol)
    _assert_grads_close(grads, want_grads)
  return want


def test_sft_packed_equals_padded(params):
  batch = _sft_batch()
  _check(
    functools.partial(sft.sft_loss, config=CONFIG),
    functools.partial(sft.sft_packed_loss, config=CONFIG),
    params["lm"],
    batch,
    _right_padded_micros(batch, (("tokens", "attention_mask"),), ("loss_mask",)),
  )


def test_reward_model_packed_equals_padded(params):
  batch = _pair_batch(valid=np.array([1, 1, 0, 1, 1, 1, 0, 1], np.float32))
  _check(
    functools.partial(reward_model.preference_loss, config=CONFIG),
    functools.partial(reward_model.packed_preference_loss, config=CONFIG),
    params["value"],
    batch,
    _right_padded_micros(batch, PAIR_SIDES, ()),
  )


def _with_reference(params, batch):
  ref = jax.jit(functools.partial(pair_logprobs, CONFIG))(params["ref"], batch)
  return {**batch, "ref_chosen": ref["chosen"], "ref_rejected": ref["rejected"]}


def _packed_reference(params, micros, b):
  """The reference's sequence log-probs `[b]` scored on the packed micro-batches."""
  score = jax.jit(lambda p, m: packed.sequence_logprobs(CONFIG, p, m) * m["member"])
  return sum(np.asarray(score(params["ref"], m)) for m in micros)


def _dpo_atol(batch):
  return RTOL * DPO["beta"] * float(np.max(np.abs(batch["ref_chosen"])))


def test_dpo_packed_equals_padded(params):
  batch = _with_reference(params, _pair_batch())
  b = len(LENGTHS)
  plan = _right_padded_micros(batch, PAIR_SIDES, DPO_MASKS)
  ref = _packed_reference(params, plan(BUDGETS[0]), 2 * b)
  np.testing.assert_allclose(ref[:b], batch["ref_chosen"], rtol=RTOL)
  np.testing.assert_allclose(ref[b:], batch["ref_rejected"], rtol=RTOL)
  want = _check(
    functools.partial(dpo_step_loss, config=CONFIG, **DPO),
    functools.partial(packed_dpo_step_loss, config=CONFIG, **DPO),
    params["lm"],
    batch,
    lambda rows: [{**m, "ref_seq": ref} for m in plan(rows)],
    _dpo_atol(batch),
  )
  assert 0 < want["dpo/accuracy"] < 1  # the reference is not the policy


def _rollout(seed=0, groups=6, k=2, p=12, t=20):
  """A rollout batch: prompts left padded to `p`, responses right padded to `t`, of very
  different lengths (some at the full width, one response of 1 token)."""
  rng = np.random.default_rng(seed)
  b = groups * k
  prompt_lens = rng.integers(1, p + 1, groups).repeat(k)
  response_lens = rng.integers(1, t + 1, b)
  response_lens[0], response_lens[3] = t, 1
  prompts = [rng.integers(0, 256, n).tolist() for n in prompt_lens[::k]]
  prompts = [q for q in prompts for _ in range(k)]
  responses = rng.integers(0, 256, (b, t)).astype(np.int32)
  return assemble(
    prompts,
    responses,
    response_lens,
    np.zeros((b, t), np.float32),
    prompt_len=p,
    response_len=t,
    pad_id=PAD,
  )


def test_online_dpo_packed_equals_padded(params):
  seqs, k = _rollout(), 2
  scores = np.array([1, 0, 2, 5, 3, 3, 0, 1, 4, 2, 1, 0], np.float32)  # one tied pair
  pairs = make_pairs(
    seqs.tokens_bs, seqs.attention_mask_bs, seqs.response_mask_bt, scores, group_size=k
  )
  batch = _with_reference(params, jax.device_get(pairs))
  rows_g2, valid_g = host_pairs(scores, k)
  np.testing.assert_array_equal(valid_g, batch["valid"])
  assert valid_g.min() == 0
  valid = valid_g > 0
  scored = np.unique(rows_g2[valid])[:, None]
  ref_micros = plan_pairs(seqs, scored, None, max_rows=3, multiple=1, pad_id=PAD)
  ref = _packed_reference(params, ref_micros, len(scores))
  np.testing.assert_allclose(ref[rows_g2[valid, 0]], batch["ref_chosen"][valid], rtol=RTOL)
  np.testing.assert_allclose(ref[rows_g2[valid, 1]], batch["ref_rejected"][valid], rtol=RTOL)
  weight_g = valid_g / valid_g.sum()
  _check(
    functools.partial(dpo_step_loss, config=CONFIG, **DPO),
    functools.partial(packed_dpo_step_loss, config=CONFIG, **DPO),
    params["lm"],
    batch,
    lambda rows: [
      {**m, "ref_seq": ref}
      for m in plan_pairs(seqs, rows_g2, weight_g, max_rows=rows, multiple=1, pad_id=PAD)
    ],
    _dpo_atol(batch),
  )
