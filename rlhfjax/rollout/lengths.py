"""Long-tailed response lengths, seeded and stratified (no JAX: the planner uses them too).

A log-normal whose `1 - tail_fraction` quantile is `tail_ratio` times its median (so
`tail_fraction` of the samples are at least `tail_ratio` times longer than the median), scaled
to the mean `mean` and clipped to `[1, max_len]`.
"""

from __future__ import annotations

import math
import statistics

import numpy as np


def tail_lengths(
  num: int, *, mean: float, max_len: int, tail_fraction: float, tail_ratio: float, seed: int
) -> np.ndarray:
  """`num` seeded response lengths (see the module docstring).

  Stratified: sample `i` draws its quantile from its own slice `[j, j + 1) / num` of [0, 1)
  (`j` a seeded permutation of the samples), so a batch holds the distribution's tail in
  proportion (a batch of 40 has exactly 4 draws above the 0.9 quantile) rather than by luck.
  """
  if not 0 < tail_fraction < 0.5 or tail_ratio <= 1:
    raise ValueError("tail_fraction must be in (0, 0.5) and tail_ratio > 1")
  if mean < 1 or max_len < 1 or num < 1:
    raise ValueError("mean, max_len and num must be >= 1")
  normal = statistics.NormalDist()
  sigma = math.log(tail_ratio) / normal.inv_cdf(1 - tail_fraction)
  median = mean / math.exp(sigma**2 / 2)
  rng = np.random.default_rng(seed)
  quantiles = (rng.permutation(num) + rng.uniform(size=num)) / num
  z = np.array([normal.inv_cdf(min(max(q, 1e-12), 1 - 1e-12)) for q in quantiles])
  return np.clip(np.rint(median * np.exp(sigma * z)), 1, max_len).astype(np.int32)
