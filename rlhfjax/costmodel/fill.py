"""What a packing engine computes: real sequence lengths packed into rows, and the rows' fill.

An engine that packs (rlhfjax's `ppo.packing`) lays each sample's real prompt and response tokens
end to end in rows of `prompt_len + response_len_max` tokens, best-fit decreasing, and splits
the rows into micro-batches of at most a token budget's rows, each rounded up to one of a few
row counts (`rlhfjax.data.packing.micro_batches`, the engine's own packer). It computes every
slot of every row it runs, so a packed stage costs its real tokens divided by the packing's
fill (real tokens / computed tokens): the slots best-fit leaves empty at the end of rows and
the empty rows of a micro-batch rounded up to its bucket.

The planner knows the lengths' mean and maximum only, so the fill is estimated by packing a
sample with those: `sample_lengths`.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from rlhfjax.data.packing import micro_batches

SEED = 0
"""Seed of the permutation that pairs sampled prompt lengths with sampled response lengths."""


def long_tailed_lengths(num: int, mean: float, max_len: int) -> np.ndarray:
  """`num` lengths in `[1, max_len]` whose mean is `mean` (to within rounding): the quantiles
  `(i + 1/2) / num` of an exponential distribution, rounded up and clipped at `max_len` (the
  samples that hit the cap are the truncated ones), its rate bisected until the sample's mean
  is `mean`. Deterministic; at a mean of a quarter of the maximum about 2% hit the cap.

  Exponential rather than `rlhfjax.rollout.lengths.tail_lengths` (log-normal): the clipped
  sample's mean is fitted exactly, and the rollout package is above the cost model.
  """
  if num < 1 or max_len < 1 or not 0 < mean <= max_len:
    raise ValueError(f"need num >= 1 and 0 < mean <= max_len, got {num}, {mean}, {max_len}")
  if mean >= max_len - 0.5:
    return np.full(num, max_len, np.int64)
  q = (np.arange(num) + 0.5) / num
  exp_quantiles = -np.log1p(-q)  # of an exponential with rate 1

  def sample(scale: float) -> np.ndarray:
    return np.clip(np.ceil(scale * exp_quantiles), 1, max_len).astype(np.int64)

  low, high = 0.0, 1.0  # scale (1 / rate); the sample's mean grows with it
  while sample(high).mean() < mean:
    high *= 2
  for _ in range(60):
    mid = (low + high) / 2
    low, high = (mid, high) if sample(mid).mean() < mean else (low, mid)
  return sample(high)


def sample_lengths(
  num: int, *, prompt_len: int, prompt_mean: float, response_mean: float, response_max: int
) -> np.ndarray:
  """`num` sequence lengths (prompt + response): responses `long_tailed_lengths` of
  `response_mean` and `response_max`; prompts `prompt_len` each, or, when their mean is less,
  `long_tailed_lengths` of it too, paired with the responses by a permutation seeded `SEED`."""
  responses = long_tailed_lengths(num, response_mean, response_max)
  if prompt_mean >= prompt_len:
    return responses + prompt_len
  prompts = long_tailed_lengths(num, prompt_mean, prompt_len)
  return responses + np.random.default_rng(SEED).permutation(prompts)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PackedStage:
  """One packing of a stage's sequences, as the engine would run it."""

  width: int
  """Tokens per row (the padded sequence length)."""
  rows: int
  """Rows computed, over every micro-batch, each rounded up to its bucket."""
  micro_batches: int
  real_tokens: int

  @property
  def fill(self) -> float:
    """Real tokens / computed tokens."""
    return self.real_tokens / (self.rows * self.width)


def packed_stage(
  num: int,
  *,
  max_rows: int,
  multiple: int = 1,
  prompt_len: int,
  prompt_mean: float,
  response_mean: float,
  response_max: int,
) -> PackedStage:
  """`num` sampled sequences (`sample_lengths`) packed into rows of `prompt_len +
  response_max` tokens and micro-batches of at most `max_rows` rows, each rounded up to
  `rlhfjax.data.packing.row_buckets(max_rows, multiple)` (`multiple`: the batch shards a
  micro-batch's rows split over)."""
  return _packed_stage(
    num,
    max(max_rows, 1),
    multiple,
    prompt_len,
    float(prompt_mean),
    float(response_mean),
    response_max,
  )


@functools.lru_cache(maxsize=1024)
def _packed_stage(num, max_rows, multiple, prompt_len, prompt_mean, response_mean, response_max):
  lengths = sample_lengths(
    num,
    prompt_len=prompt_len,
    prompt_mean=prompt_mean,
    response_mean=response_mean,
    response_max=response_max,
  )
  width = prompt_len + response_max
  packed = micro_batches(lengths, width, max_rows, multiple)
  return PackedStage(
    width=width,
    rows=sum(p.rows for _, p in packed),
    micro_batches=len(packed),
    real_tokens=int(lengths.sum()),
  )


def budget_rows(tokens: int, width: int, default: int) -> int:
  """Rows of `width` tokens a token budget holds (`tokens // width`); `default` when 0."""
  return tokens // width if tokens else default
