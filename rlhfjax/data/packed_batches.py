"""Packed micro-batches of the offline flows and online DPO (host planning, NumPy only).

`rlhfjax.data.packing` packs sequences into rows; this module groups them into the micro-batches
a gradient step needs and lays out the index arrays their packed losses read:

- a loss over *groups* of sequences (a preference pair's chosen and rejected sequence) needs a
  group's sequences in one micro-batch, so `group_micro_batches` never splits a group;
- supervised batches are right padded (`rlhfjax.data.pipeline`: a sequence of `L` tokens is
  columns `0 .. L - 1`), which `right_padded_layout` maps onto `PackedLayout`'s left-padded-prompt
  layout: the first token is the "prompt" (`prompt_len` 1) and the rest the "response", so
  `pred_src` indexes the shifted `[b, s - 1]` targets the padded losses read (`[:, 1:]`);
- `micro_batch_arrays` gathers one micro-batch's tokens and per-slot weights on the host.

Letters: n sequences of the micro-batch, B sequences of the whole batch, g groups, k sequences
per group, r rows, w width.
"""

from __future__ import annotations

import numpy as np

from rlhfjax.data.packing import PackedLayout, Packing, fits, micro_batches, pack, row_buckets


def group_micro_batches(
  lengths_gk: np.ndarray, width: int, max_rows: int, multiple: int = 1
) -> list[tuple[np.ndarray, Packing]]:
  """Groups of `k` sequences (lengths `[g, k]`) in micro-batches of at most `max_rows` rows of
  `width` tokens, no group split between two micro-batches.

  One sequence per group (`k` = 1) is `packing.micro_batches`. Otherwise groups go first-fit
  decreasing (by their tokens) into the first micro-batch whose sequences still pack best-fit
  decreasing into `max_rows` rows. Returns `(groups, packing)` per micro-batch: its group
  indices (ascending) and the packing of their sequences, group-major (group `groups[j]`'s
  side `i` is sequence `j * k + i`). Deterministic.
  """
  lengths_gk = np.asarray(lengths_gk, np.int64)
  g, k = lengths_gk.shape
  if k == 1:
    return micro_batches(lengths_gk[:, 0], width, max_rows, multiple)
  if not all(fits(row, width, max_rows) for row in lengths_gk):
    raise ValueError(f"a group of {k} sequences does not fit {max_rows} rows of {width} tokens")
  totals_g = lengths_gk.sum(axis=1)
  members: list[list[int]] = []
  used: list[int] = []
  for i in sorted(range(g), key=lambda i: (-totals_g[i], i)):
    for m, group in enumerate(members):
      if used[m] + totals_g[i] <= max_rows * width and fits(
        lengths_gk[sorted([*group, i])].reshape(-1), width, max_rows
      ):
        group.append(i)
        used[m] += int(totals_g[i])
        break
    else:
      members.append([i])
      used.append(int(totals_g[i]))
  buckets = row_buckets(max_rows, multiple)
  out = []
  for group in members:
    idx = np.sort(np.asarray(group, np.int64))
    out.append((idx, pack(lengths_gk[idx].reshape(-1), width, buckets)))
  return out


def right_padded_layout(packing: Packing, rows_n: np.ndarray, max_len: int) -> PackedLayout:
  """The layout of right-padded sequences (rows `rows_n` of a `[B, max_len]` batch, lengths
  `packing.length_n`): `pred_src` indexes `[B, max_len - 1]` arrays of the targets from
  column 1 on (see the module docstring)."""
  lengths_n = packing.length_n.astype(np.int32)
  return PackedLayout.create(
    packing,
    np.asarray(rows_n),
    np.ones_like(lengths_n),
    lengths_n - 1,
    prompt_len=1,
    response_len=max_len - 1,
  )


def micro_batch_arrays(
  layout: PackedLayout,
  rows_n: np.ndarray,
  tokens_bs: np.ndarray,
  pred_weight_bt: np.ndarray,
  *,
  pad_id: int,
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
  """The packed rows of one micro-batch and its per-sequence indices, on the host.

  `layout` packs rows `rows_n` of the batch `tokens_bs` (`[B, s]`); `pred_weight_bt` (`[B, t]`,
  `layout.pred_src`'s layout) weighs the prediction of each token. Returns `(rows, sequences)`:
  `rows` holds `[r, w]` arrays: `tokens`, `positions`, `segments`, `slot_weight` (the weight of
  the slot's prediction, 0 where it predicts nothing) and `slot_seq` (the batch row of the
  sequence whose token the slot predicts, `B` where none: a dump segment); `sequences` holds
  `[B]` arrays: `last_slot` (flat slot of the row's last token in this micro-batch, 0 where
  the row is not in it) and `member` (1 where it is).
  """
  b = tokens_bs.shape[0]
  pred = layout.pred_src >= 0
  weight = np.asarray(pred_weight_bt, np.float32).reshape(-1)[np.maximum(layout.pred_src, 0)]
  rows_n = np.asarray(rows_n)
  slot_seq = np.where(pred, rows_n[np.maximum(layout.pred_seq, 0)], b).astype(np.int32)
  last_slot = np.zeros(b, np.int32)
  last_slot[rows_n] = layout.last_slot
  member = np.zeros(b, np.float32)
  member[rows_n] = 1.0
  rows = {
    "tokens": layout.take(tokens_bs, fill=pad_id).astype(np.int32),
    "positions": layout.positions,
    "segments": layout.segments,
    "slot_weight": np.where(pred, weight, 0.0).astype(np.float32),
    "slot_seq": slot_seq,
  }
  return rows, {"last_slot": last_slot, "member": member}


def plan_micro_batches(
  tokens_bs: np.ndarray,
  lengths_b: np.ndarray,
  groups_gk: np.ndarray,
  pred_weight_bt: np.ndarray,
  *,
  layout_of,
  width: int,
  max_rows: int,
  multiple: int = 1,
  pad_id: int,
  pair_weight_g: np.ndarray | None = None,
) -> list[dict[str, np.ndarray]]:
  """A batch's packed micro-batches (host arrays): `micro_batch_arrays` of each micro-batch of
  `group_micro_batches`.

  The batch is `tokens_bs` with sequences of `lengths_b` tokens; `groups_gk` names the batch rows
  of each group (a pair's chosen and rejected row; `[B, 1]` for single sequences);
  `layout_of(packing, rows_n)` is their `PackedLayout` (`right_padded_layout`, or
  `PackedLayout.create` for left-padded prompts). With `pair_weight_g`, only the groups of
  non-zero weight are packed (at least one, weightless, so an update always has a micro-batch)
  and each micro-batch carries `pair_weight` (`[g]`, its own groups' weights, 0 elsewhere).
  """
  groups_gk = np.asarray(groups_gk)
  packed_g = np.arange(len(groups_gk))
  if pair_weight_g is not None:
    packed_g = np.flatnonzero(pair_weight_g) if np.any(pair_weight_g) else packed_g[:1]
  out = []
  lengths_gk = np.asarray(lengths_b)[groups_gk[packed_g]]
  for groups, packing in group_micro_batches(lengths_gk, width, max_rows, multiple):
    rows_n = groups_gk[packed_g[groups]].reshape(-1)
    rows, seqs = micro_batch_arrays(
      layout_of(packing, rows_n), rows_n, tokens_bs, pred_weight_bt, pad_id=pad_id
    )
    if pair_weight_g is not None:
      weight_g = np.zeros(len(groups_gk), np.float32)
      weight_g[packed_g[groups]] = pair_weight_g[packed_g[groups]]
      seqs["pair_weight"] = weight_g
    out.append({**rows, **seqs})
  return out


def right_padded_micro_batches(
  host: dict[str, np.ndarray],
  sides: tuple[tuple[str, str], ...],
  loss_masks: tuple[str, ...],
  *,
  max_len: int,
  max_rows: int,
  multiple: int = 1,
  pad_id: int,
) -> list[dict[str, np.ndarray]]:
  """`plan_micro_batches` of a right-padded supervised or preference batch
  (`rlhfjax.data.pipeline`).

  `sides` names each example's (tokens, attention mask) arrays, `loss_masks` the `[b, s]` masks
  weighing each side's predicted tokens (none: all weights 0). One side (SFT): the weights are
  divided by the batch's loss tokens, so the micro-batches' weighted sums add up to the token
  mean. Two sides (a preference pair, rows `chosen` and `b + chosen` of the sequences): each
  micro-batch carries `chosen`, `rejected` (`[b]` sequence rows) and `pair_weight`, 1 / the
  batch's valid pairs on its valid pairs.
  """
  b, k = host[sides[0][0]].shape[0], len(sides)
  groups_gk = np.arange(k * b).reshape(k, b).T
  if loss_masks:
    weight_bt = np.concatenate([host[m][:, 1:] for m in loss_masks]).astype(np.float32)
  else:
    weight_bt = np.zeros((k * b, max_len - 1), np.float32)
  pair_weight_g, extra = None, {}
  if k == 1:
    weight_bt = weight_bt / max(float(weight_bt.sum()), 1.0)
  else:
    pair_weight_g = host["valid"] / max(float(host["valid"].sum()), 1.0)
    extra = {"chosen": groups_gk[:, 0].astype(np.int32), "rejected": groups_gk[:, 1]}
  micros = plan_micro_batches(
    np.concatenate([host[t] for t, _ in sides]),
    np.concatenate([host[m].sum(axis=1) for _, m in sides]),
    groups_gk,
    weight_bt,
    layout_of=lambda packing, rows_n: right_padded_layout(packing, rows_n, max_len),
    width=max_len,
    max_rows=max_rows,
    multiple=multiple,
    pad_id=pad_id,
    pair_weight_g=pair_weight_g,
  )
  return [{**m, **{n: v.astype(np.int32) for n, v in extra.items()}} for m in micros]
