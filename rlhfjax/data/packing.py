"""Packing sequences end to end into rows of a fixed token width (host planning, NumPy only).

Scoring and training a padded batch computes every sequence at the longest possible length;
with long-tailed response lengths most of that work is on pads. A packed batch instead lays
several sequences (segments) end to end in each row of `width` tokens; each token carries its
segment id (1, 2, ... within its row, 0 on empty slots) and its position within its segment, and
attention is masked within a segment (`rlhfjax.models.transformer.segment_mask`), so every
token's result is the padded one's up to the order of floating-point sums.

The sequences come from the padded layout the rest of the library uses (`flows.experience`): a
prompt left padded to `p`, its response right padded to `t`, so row `i`'s real tokens are columns
`p - P_i .. p + L_i - 1` of `[b, p + t]` (prompt length `P_i`, response length `L_i`).
`PackedLayout` holds the index arrays that move between the two layouts on the devices.

Letters: n sequences, r rows, w width, b batch, p prompt length, t response length.

Rows are filled best-fit decreasing (a sequence goes to the open row it leaves least room in;
the longest first), grouped into micro-batches of at most `max_rows` rows, and a micro-batch's
row count is rounded up to one of a few sizes (`row_buckets`: 1, 2, 3, 4, 6, 8, ... times the
batch shards), so a program compiled per row count compiles a bounded number of times however
the lengths vary.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Sequence

import numpy as np


def best_fit_decreasing(lengths: Sequence[int], width: int) -> tuple[np.ndarray, np.ndarray, int]:
  """Rows and start columns of sequences of `lengths` packed into rows of `width` tokens.

  Returns `(row_n, start_n, num_rows)`. Deterministic: ties go to the lower index and the
  fuller row opened first.
  """
  lengths = np.asarray(lengths, np.int64)
  if lengths.size and (lengths.min() < 1 or lengths.max() > width):
    raise ValueError(f"sequence lengths must be 1 to the row width {width}, got {lengths.tolist()}")
  row_n = np.zeros(len(lengths), np.int32)
  start_n = np.zeros(len(lengths), np.int32)
  free: list[tuple[int, int]] = []  # (free tokens, row), sorted
  used: list[int] = []  # tokens used per row
  for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
    n = int(lengths[i])
    k = bisect.bisect_left(free, (n, -1))
    if k < len(free):
      _, row = free.pop(k)
    else:
      row = len(used)
      used.append(0)
    row_n[i], start_n[i] = row, used[row]
    used[row] += n
    if used[row] < width:
      bisect.insort(free, (width - used[row], row))
  return row_n, start_n, len(used)


def row_buckets(max_rows: int, multiple: int = 1) -> tuple[int, ...]:
  """The row counts a micro-batch of at most `max_rows` rows is rounded up to: `multiple` times
  1, 2, 3, 4, 6, 8, 12, ... (powers of two and one and a half times them) below, and `max_rows`
  rounded up to `multiple`. Rounding up wastes under a third of a micro-batch; a budget of
  `n` x `multiple` rows has at most `2 log2(n) + 1` sizes, each a compiled program."""
  if max_rows < 1 or multiple < 1:
    raise ValueError(f"max_rows and multiple must be >= 1, got {max_rows}, {multiple}")
  top = -(-max_rows // multiple)
  sizes, power = {top}, 1
  while power < top:
    sizes |= {k for k in (power, power * 3 // 2) if k < top}
    power *= 2
  return tuple(k * multiple for k in sorted(sizes))


def bucket(rows: int, buckets: Sequence[int]) -> int:
  """The smallest of `buckets` (sorted) that holds `rows` rows."""
  for size in buckets:
    if size >= rows:
      return size
  raise ValueError(f"{rows} rows exceed the largest bucket {buckets[-1]}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Packing:
  """Sequences of given lengths placed in `rows` rows of `width` tokens."""

  width: int
  rows: int
  """Rows computed (a bucket size; those past the used ones are empty)."""
  row_n: np.ndarray
  start_n: np.ndarray
  length_n: np.ndarray

  @property
  def num_tokens(self) -> int:
    return int(self.length_n.sum())

  @property
  def fill(self) -> float:
    """Real tokens / computed tokens."""
    return self.num_tokens / (self.rows * self.width)

  def segments(self) -> np.ndarray:
    """`[r, w]` int32: 1, 2, ... for the segments of each row in column order, 0 on empty slots."""
    out = np.zeros((self.rows, self.width), np.int32)
    order = np.lexsort((self.start_n, self.row_n))
    count = np.zeros(self.rows, np.int32)
    for i in order:
      count[self.row_n[i]] += 1
      out[self.row_n[i], self.start_n[i] : self.start_n[i] + self.length_n[i]] = count[
        self.row_n[i]
      ]
    return out

  def positions(self) -> np.ndarray:
    """`[r, w]` int32: each token's position within its segment (0 on empty slots)."""
    out = np.zeros((self.rows, self.width), np.int32)
    for r, s, n in zip(self.row_n, self.start_n, self.length_n, strict=True):
      out[r, s : s + n] = np.arange(n)
    return out


def pack(lengths: Sequence[int], width: int, buckets: Sequence[int] | None = None) -> Packing:
  """All of `lengths` in one packing, its row count rounded up to `buckets` (None: as used)."""
  row_n, start_n, used = best_fit_decreasing(lengths, width)
  rows = max(used, 1) if buckets is None else bucket(max(used, 1), buckets)
  return Packing(
    width=width, rows=rows, row_n=row_n, start_n=start_n, length_n=np.asarray(lengths, np.int32)
  )


def micro_batches(
  lengths: Sequence[int], width: int, max_rows: int, multiple: int = 1
) -> list[tuple[np.ndarray, Packing]]:
  """`lengths` packed best-fit decreasing and split into micro-batches of at most `max_rows`
  rows (rounded up to a multiple of `multiple`), each row count rounded up to
  `row_buckets(max_rows, multiple)`.

  Returns `(indices, packing)` per micro-batch: which of `lengths` it holds (ascending) and
  their packing. Every index is in exactly one micro-batch.
  """
  buckets = row_buckets(max_rows, multiple)
  max_rows = buckets[-1]
  row_n, start_n, used = best_fit_decreasing(lengths, width)
  lengths = np.asarray(lengths, np.int32)
  out = []
  for first in range(0, used, max_rows):
    idx = np.flatnonzero((row_n >= first) & (row_n < first + max_rows))
    rows = min(max_rows, used - first)
    out.append(
      (
        idx,
        Packing(
          width=width,
          rows=bucket(rows, buckets),
          row_n=row_n[idx] - first,
          start_n=start_n[idx],
          length_n=lengths[idx],
        ),
      )
    )
  return out


def fits(lengths: Sequence[int], width: int, max_rows: int) -> bool:
  """Whether best-fit decreasing packs `lengths` into `max_rows` rows."""
  return not len(lengths) or best_fit_decreasing(lengths, width)[2] <= max_rows


@dataclasses.dataclass(frozen=True, kw_only=True)
class PackedLayout:
  """Index arrays between padded sequences and one packing of some of them (host NumPy).

  Flat indices are into a padded `[b, s]` (`token_src`) or `[b, t]` (`pred_src`) array, or
  into the packed `[r, w]` rows (`response_slot`, `last_slot`); -1 where there is none.
  """

  tokens_src: np.ndarray
  """`[r, w]`: the `[b, s]` entry of each packed token."""
  pred_src: np.ndarray
  """`[r, w]`: the `[b, t]` response token each slot's prediction is for (slot `c` predicts
  slot `c + 1`: the same column the padded layout reads a response token's log-prob and value
  at), -1 where it predicts no response token."""
  pred_seq: np.ndarray
  """`[r, w]`: which of the packed sequences (0 .. n-1) `pred_src` belongs to, -1 where none."""
  segments: np.ndarray
  positions: np.ndarray
  response_slot: np.ndarray
  """`[n, t]`: the packed slot predicting response token `j` of packed sequence `i`, -1 past
  its length."""
  last_slot: np.ndarray
  """`[n]`: the packed slot of each sequence's last real token."""

  @classmethod
  def create(
    cls,
    packing: Packing,
    rows_n: np.ndarray,
    prompt_lens_n: np.ndarray,
    response_lens_n: np.ndarray,
    *,
    prompt_len: int,
    response_len: int,
  ) -> PackedLayout:
    """The layout of `packing`, whose sequence `i` is row `rows_n[i]` of a padded batch with
    a prompt of `prompt_lens_n[i]` and a response of `response_lens_n[i]` tokens."""
    p, t, w = prompt_len, response_len, packing.width
    s = p + t
    n = len(rows_n)
    if not np.array_equal(packing.length_n, prompt_lens_n + response_lens_n):
      raise ValueError("the packing's lengths are not prompt + response lengths")
    tokens_src = np.full((packing.rows, w), -1, np.int32)
    pred_src = np.full((packing.rows, w), -1, np.int32)
    pred_seq = np.full((packing.rows, w), -1, np.int32)
    response_slot = np.full((n, t), -1, np.int32)
    last_slot = np.zeros(n, np.int32)
    for i in range(n):
      r, c0 = int(packing.row_n[i]), int(packing.start_n[i])
      big_p, big_l = int(prompt_lens_n[i]), int(response_lens_n[i])
      b = int(rows_n[i])
      tokens_src[r, c0 : c0 + big_p + big_l] = b * s + np.arange(p - big_p, p + big_l)
      first_pred = c0 + big_p - 1  # the slot predicting response token 0
      pred_src[r, first_pred : first_pred + big_l] = b * t + np.arange(big_l)
      pred_seq[r, first_pred : first_pred + big_l] = i
      response_slot[i, :big_l] = r * w + first_pred + np.arange(big_l)
      last_slot[i] = r * w + c0 + big_p + big_l - 1
    return cls(
      tokens_src=tokens_src,
      pred_src=pred_src,
      pred_seq=pred_seq,
      segments=packing.segments(),
      positions=packing.positions(),
      response_slot=response_slot,
      last_slot=last_slot,
    )

  def take(self, x_bs: np.ndarray, fill=0) -> np.ndarray:
    """The packed `[r, w]` rows of host array `x_bs` (`fill` on empty slots)."""
    flat = np.asarray(x_bs).reshape(-1)
    return np.where(self.tokens_src >= 0, flat[np.maximum(self.tokens_src, 0)], fill).astype(
      flat.dtype
    )
