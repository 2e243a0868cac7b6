"""`rlhfjax.data.packing` and the segment-masked forward: rows never overflow and hold every
sequence once, deterministically; buckets bound the row counts; `PackedLayout` moves padded
arrays to packed rows and back (NumPy); the packed forward equals the padded one (fp32, within
1e-5: the same operations, only the order of the attention sums differs)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import pytest

from rlhfjax import models
from rlhfjax.config.model import get_model_config
from rlhfjax.data import packed_batches, packing
from rlhfjax.training import steps

pytestmark = pytest.mark.unit

RTOL = 1e-5


def _lengths(seed, n=60, width=32):
  """Long-tailed lengths from 1 to `width`."""
  rng = np.random.default_rng(seed)
  return np.minimum(1 + rng.geometric(4 / width, n), width)


@pytest.mark.parametrize("seed", range(5))
def test_best_fit_decreasing_places_every_sequence_once_in_rows_it_fits(seed):
  width = 32
  lengths = _lengths(seed, width=width)
  row_n, start_n, rows = packing.best_fit_decreasing(lengths, width)
  used = np.zeros((rows, width), np.int32)
  for r, s, n in zip(row_n, start_n, lengths, strict=True):
    assert 0 <= r < rows and s + n <= width  # no overflow
    used[r, s : s + n] += 1
  assert used.max() == 1  # no two sequences overlap
  assert used.sum() == lengths.sum()  # every token placed, so every sequence once
  assert rows >= -(-lengths.sum() // width)
  again = packing.best_fit_decreasing(lengths, width)
  np.testing.assert_array_equal(again[0], row_n)
  np.testing.assert_array_equal(again[1], start_n)
  with pytest.raises(ValueError, match="lengths must be 1 to the row width"):
    packing.best_fit_decreasing([3, width + 1], width)


def test_row_buckets_and_bucket():
  assert packing.row_buckets(10) == (1, 2, 3, 4, 6, 8, 10)
  assert packing.row_buckets(10, 4) == (4, 8, 12)
  assert packing.row_buckets(1) == (1,)
  # Rounding a micro-batch up to its bucket wastes under a third of it; the count is bounded.
  buckets = packing.row_buckets(1000)
  assert len(buckets) <= 2 * np.log2(1000) + 1
  assert all(packing.bucket(r, buckets) < 1.5 * r for r in range(1, 1001))
  assert [packing.bucket(r, (1, 2, 4, 8, 10)) for r in (1, 3, 5, 9, 10)] == [1, 4, 8, 10, 10]
  with pytest.raises(ValueError, match="exceed the largest bucket"):
    packing.bucket(11, (1, 2, 4, 8, 10))


@pytest.mark.parametrize(("max_rows", "multiple"), [(3, 1), (4, 2), (1, 1)])
def test_micro_batches_cover_each_index_once_within_max_rows(max_rows, multiple):
  lengths = _lengths(7)
  batches = packing.micro_batches(lengths, 32, max_rows, multiple)
  seen = np.concatenate([idx for idx, _ in batches])
  np.testing.assert_array_equal(np.sort(seen), np.arange(len(lengths)))
  buckets = packing.row_buckets(max_rows, multiple)
  for idx, p in batches:
    assert p.rows in buckets and p.row_n.max() < min(p.rows, max_rows)
    np.testing.assert_array_equal(p.length_n, lengths[idx])
    segments = p.segments()
    assert (segments > 0).sum() == p.num_tokens


def test_group_micro_batches_keep_groups_together():
  lengths_gk = np.stack([_lengths(1, 30), _lengths(2, 30)], axis=1)
  batches = packed_batches.group_micro_batches(lengths_gk, 32, 3)
  seen = np.concatenate([g for g, _ in batches])
  np.testing.assert_array_equal(np.sort(seen), np.arange(30))
  for groups, p in batches:
    np.testing.assert_array_equal(p.length_n, lengths_gk[groups].reshape(-1))
    assert packing.fits(p.length_n, 32, 3) and p.rows <= 3


def _padded_batch(seed=0, b=7, p=6, t=9, vocab=300):
  """Left-padded prompts and right-padded responses of different lengths."""
  rng = np.random.default_rng(seed)
  prompt_lens = rng.integers(1, p + 1, b)
  response_lens = rng.integers(0, t + 1, b)
  response_lens[0], prompt_lens[1] = t, p
  tokens = np.zeros((b, p + t), np.int32)
  attention = np.zeros((b, p + t), np.int32)
  for i in range(b):
    cols = slice(p - prompt_lens[i], p + response_lens[i])
    tokens[i, cols] = rng.integers(1, vocab, prompt_lens[i] + response_lens[i])
    attention[i, cols] = 1
  response = (np.arange(t)[None] < response_lens[:, None]).astype(np.float32)
  return tokens, attention, response, prompt_lens, response_lens


def _layouts(prompt_lens, response_lens, p, t, max_rows):
  out = []
  for idx, pk in packing.micro_batches(prompt_lens + response_lens, p + t, max_rows):
    layout = packing.PackedLayout.create(
      pk, idx, prompt_lens[idx], response_lens[idx], prompt_len=p, response_len=t
    )
    out.append((idx, layout))
  return out


def test_packed_layout_round_trip():
  p, t = 6, 9
  tokens, attention, response, prompt_lens, response_lens = _padded_batch(p=p, t=t)
  values_bs = np.random.default_rng(3).normal(size=tokens.shape).astype(np.float32)
  got_tokens = np.zeros_like(tokens)
  got_pred = np.zeros_like(response)
  last = np.zeros(len(tokens), np.float32)
  for idx, layout in _layouts(prompt_lens, response_lens, p, t, max_rows=2):
    packed_tokens = layout.take(tokens, fill=-7)
    assert ((packed_tokens == -7) == (layout.segments == 0)).all()
    packed_values = layout.take(values_bs)
    # Back: every real token from its packed slot; every response token's prediction slot.
    flat = layout.tokens_src[layout.tokens_src >= 0]
    got_tokens.reshape(-1)[flat] = packed_tokens[layout.tokens_src >= 0]
    slots = layout.response_slot
    for j, i in enumerate(idx):
      n = response_lens[i]
      np.testing.assert_array_equal(slots[j, n:], -1)
      got_pred[i, :n] = packed_values.reshape(-1)[slots[j, :n]]
      last[i] = packed_values.reshape(-1)[layout.last_slot[j]]
      assert (layout.pred_src.reshape(-1)[slots[j, :n]] == i * t + np.arange(n)).all()
  np.testing.assert_array_equal(got_tokens, tokens * attention)
  # The padded layout reads response token j's prediction at column p - 1 + j.
  want_pred = values_bs[:, p - 1 : -1] * response
  np.testing.assert_array_equal(got_pred, want_pred)
  last_col = p + response_lens - 1
  np.testing.assert_array_equal(last, values_bs[np.arange(len(tokens)), last_col])


CONFIG = get_model_config("tiny", dtype="float32", param_dtype="float32")


@pytest.fixture(scope="module")
def params():
  init = lambda head, key: jax.jit(functools.partial(models.init_params, CONFIG, head))(key)
  value = init("value", jax.random.key(1))
  value["value_head"] = jax.random.normal(jax.random.key(3), value["value_head"].shape)
  return {"lm": init("lm", jax.random.key(0)), "value": value}


def _packed_arrays(layout, tokens):
  return [np.asarray(x) for x in (layout.take(tokens), layout.positions, layout.segments)]


@pytest.mark.parametrize(
  "changes",
  [{}, {"logprob_chunk_size": 4}, {"sliding_window": 4}],
  ids=["plain", "chunked", "window"],
)
def test_packed_forward_equals_padded(params, changes):
  config = dataclasses.replace(CONFIG, **changes)
  p, t = 6, 9
  tokens, attention, response, prompt_lens, response_lens = _padded_batch(p=p, t=t)
  padded_logp = jax.jit(steps.response_logprobs, static_argnums=(0, 4))
  packed_stats = jax.jit(models.packed_token_stats, static_argnums=0)
  packed_values = jax.jit(functools.partial(models.forward_packed, head="value"), static_argnums=0)
  want_logp = np.asarray(padded_logp(config, params["lm"], tokens, attention, p))
  want_values = np.asarray(
    jax.jit(models.forward_values, static_argnums=0)(config, params["value"], tokens, attention)
  )
  got_logp = np.zeros_like(want_logp)
  got_values = np.zeros((len(tokens), p + t), np.float32)
  for idx, layout in _layouts(prompt_lens, response_lens, p, t, max_rows=3):
    args = _packed_arrays(layout, tokens)
    stats = packed_stats(config, params["lm"], *args)
    values = packed_values(config, params["value"], *args)
    logp, values = np.asarray(stats.logp_bt).reshape(-1), np.asarray(values).reshape(-1)
    for j, i in enumerate(idx):
      n = response_lens[i]
      got_logp[i, :n] = logp[layout.response_slot[j, :n]]
    real = layout.tokens_src >= 0
    got_values.reshape(-1)[layout.tokens_src[real]] = values[real.reshape(-1)]
  mask = response > 0
  np.testing.assert_allclose(got_logp[mask], want_logp[mask], rtol=RTOL, atol=RTOL)
  real = attention > 0
  np.testing.assert_allclose(got_values[real], want_values[real], rtol=RTOL, atol=RTOL)
