"""Packed scoring and updates of the PPO-family flows (`ppo.packing`).

A padded batch computes every sample at `rollout.max_seq_len` tokens. Packed, each sample's real
prompt and response tokens lie end to end with others' in rows of `max_seq_len` tokens
(`rlhfjax.data.packing`: best-fit decreasing, attention within a sample), so scoring and
training compute on about the real tokens:

* scoring: a call takes at most `rollout.score_rows_packed` rows; the rows are packed on the
  host from the rollout's token ids and uploaded once, moved device to device to each scorer's
  mesh as packed rows, and each role's packed output moves back to the actor's mesh as packed
  rows, where one gather per call puts it in the batch's `[b, t]` (or `[b]`) layout. What
  follows (advantages, metrics) is the padded flow's, on the same arrays.
* update: a mini-batch (the same samples as the padded splitter's, from the same permutation)
  is packed into as many micro-batches of at most `ppo.max_tokens_per_micro_batch` tokens as its
  samples need; each is gathered from the batch on the actor's mesh (where the advantages are)
  and moves to the trained role's mesh as packed rows. Its loss is its share of the
  mini-batch's (`alg.aggregation_weights`), so the gradients are summed and equal the whole
  mini-batch's whichever way the samples fell into micro-batches.

A program compiled per packed row count compiles once per bucket (`packing.row_buckets`): a
handful per role however the lengths vary.

Letters: b batch, p prompt length, t response length, s = p + t = w row width, r rows.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rlhfjax import algorithms as alg
from rlhfjax.cluster import dispatch
from rlhfjax.cluster.residency import Key
from rlhfjax.data import packing
from rlhfjax.flows import experience, packed_update, scoring, stages
from rlhfjax.flows.experience import Sequences
from rlhfjax.flows.stages import FlowContext
from rlhfjax.placement.spec import Role
from rlhfjax.training import steps


def per_sequence(ctx: FlowContext, role: str) -> bool:
  """Whether `role`'s packed output is read at each sample's last token (a reward model's score
  `[b]`: the reward and the extra reward roles, `rlhfjax.cluster.rewards.reward_models`);
  the others' are read at every response token's prediction slot (`[b, t]`)."""
  return role == Role.REWARD or role in ctx.cfg.reward.role_coefs


def lengths(seqs: Sequences) -> tuple[np.ndarray, np.ndarray]:
  """Real prompt and response lengths of each sample, `[n]` int32 each."""
  prompt_n = np.asarray([len(x) for x in seqs.prompts], np.int32)
  response_n = np.asarray([len(x) for x in seqs.responses], np.int32)
  return prompt_n, response_n


def batch_shards(ctx: FlowContext, roles: tuple[Role, ...]) -> int:
  """Rows of a packed batch divide evenly over the batch axes of every one of `roles`."""
  return math.lcm(*(packed_update.rows_multiple(ctx.cluster, role) for role in roles))


def layouts(
  seqs: Sequences, rows_n: np.ndarray, width: int, max_rows: int, multiple: int
) -> list[tuple[np.ndarray, packing.PackedLayout]]:
  """Samples `rows_n` of `seqs` packed into micro-batches of at most `max_rows` rows:
  `(their rows of seqs, layout)` per micro-batch."""
  prompt_n, response_n = lengths(seqs)
  prompt_n, response_n = prompt_n[rows_n], response_n[rows_n]
  p = seqs.prompt_len
  out = []
  for sub, pk in packing.micro_batches(prompt_n + response_n, width, max_rows, multiple):
    layout = packing.PackedLayout.create(
      pk,
      rows_n[sub],
      prompt_n[sub],
      response_n[sub],
      prompt_len=p,
      response_len=width - p,
    )
    out.append((rows_n[sub], layout))
  return out


def fill(layouts_: list[tuple[np.ndarray, packing.PackedLayout]]) -> float:
  """Real tokens / computed tokens over micro-batches."""
  real = sum(int((lay.segments > 0).sum()) for _, lay in layouts_)
  return real / max(sum(lay.segments.size for _, lay in layouts_), 1)


# ---------------------------------------------------------------------------------------------
# Scoring.


def unpack_response(
  out_bt: jax.Array, part_rw: jax.Array, base_b: jax.Array, length_b: jax.Array
) -> jax.Array:
  """`out_bt` with the response slots of the samples of one packed call taken from its output:
  sample `i`'s token `j` from flat slot `base_b[i] + j` for `j < length_b[i]` (`base_b[i]` -1:
  not in this call)."""
  t = out_bt.shape[1]
  j_t = jnp.arange(t)
  idx_bt = base_b[:, None] + j_t[None]
  valid_bt = (base_b[:, None] >= 0) & (j_t[None] < length_b[:, None])
  flat = part_rw.reshape(-1)
  return jnp.where(valid_bt, flat[jnp.clip(idx_bt, 0, flat.size - 1)], out_bt)


def unpack_last(out_b: jax.Array, part_rw: jax.Array, last_b: jax.Array) -> jax.Array:
  """`out_b` with each sample of one packed call given its output at its last token's slot
  (`last_b[i]` -1: not in this call)."""
  flat = part_rw.reshape(-1)
  return jnp.where(last_b >= 0, flat[jnp.clip(last_b, 0, flat.size - 1)], out_b)


class PackedScoring(scoring.MicroBatchScoring):
  """`MicroBatchScoring` of packed calls: `add` packs its samples into calls of at most `rows`
  rows (`stages_fn(rows, seqs)` gets the packed `(tokens, positions, segments)` on the actor's
  mesh), `result` unpacks every role's output to the batch's layout on the actor's mesh."""

  def __init__(
    self, ctx: FlowContext, iteration: int, stages_fn: Any, rows: int, programs: Programs
  ):
    super().__init__(ctx, iteration, stages_fn, rows)
    self.num, self.programs = ctx.cfg.rollout.batch_size, programs
    cfg = ctx.cfg
    self.width = cfg.rollout.max_seq_len
    self.multiple = batch_shards(ctx, tuple(ctx.cluster.roles))
    self._layouts: list[tuple[np.ndarray, packing.PackedLayout, np.ndarray]] = []

  def add(self, indices: np.ndarray, seqs: Sequences, then: Sequence[Key] | None = None) -> None:
    """Dispatches the scoring of `seqs` (samples `indices` of the batch) in packed calls.

    With `then` and one call: its stages run together (`Cluster.run`, disjoint meshes at the
    same time) and the state of the (role, stage) in `then` is prefetched during the last of
    them, as the padded whole-batch scoring does."""
    cluster, pad = self.ctx.cluster, self.ctx.tokenizer.pad_id
    indices = np.asarray(indices)
    _, response_n = lengths(seqs)
    parts = layouts(seqs, np.arange(len(indices)), self.width, self.rows, self.multiple)
    for sub, layout in parts:
      rows = cluster.upload(
        Role.ACTOR,
        (layout.take(seqs.tokens_bs, pad), layout.positions, layout.segments),
        "rollout micro-batch",
      )
      todo = self.stages_fn(rows, experience.take_rows([(seqs, sub)]))
      if then is not None and len(parts) == 1:
        for stage, out in zip(todo, cluster.run(todo, self.iteration, then=then), strict=True):
          self._parts.setdefault(stage.role, []).append(out)
        self._indices.append(indices[sub])
      else:
        self._dispatch(todo, indices[sub])
      self._layouts.append((indices[sub], layout, response_n[sub]))

  def result(self) -> dict[str, Any]:
    """Every role's results for the whole batch in its order, on the actor's mesh (device
    results) or as NumPy (host results)."""
    self._wait()
    order = np.concatenate(self._indices)
    if sorted(order.tolist()) != list(range(self.num)):
      raise ValueError(f"the packed calls do not hold each of {self.num} samples once")
    cluster, b = self.ctx.cluster, self.num
    index = []
    for idx, layout, response_n in self._layouts:
      base_b, length_b, last_b = (np.full(b, -1, np.int32) for _ in range(3))
      base_b[idx] = layout.response_slot[:, 0]
      # A sample whose response is empty has no response slot; its base is never read.
      base_b[idx] = np.where(response_n > 0, base_b[idx], 0)
      length_b[idx] = response_n
      last_b[idx] = layout.last_slot
      index.append((base_b, length_b, last_b))
    index = cluster.upload(Role.ACTOR, index, "packing index")
    out = {}
    programs = self.programs
    for role, parts in self._parts.items():
      if isinstance(parts[0], np.ndarray):
        out[role] = np.concatenate(parts)[np.argsort(order, kind="stable")]
        continue
      scalar = per_sequence(self.ctx, role)
      acc = programs.zeros_b() if scalar else programs.zeros_bt()
      for part, (base_b, length_b, last_b) in zip(parts, index, strict=True):
        part = cluster.move(Role.ACTOR, part)
        if scalar:
          acc = programs.last(acc, part, last_b)
        else:
          acc = programs.response(acc, part, base_b, length_b)
      out[role] = acc
    return out


class Programs:
  """The actor-mesh programs of packed scoring (unpacking) and the mini-batch order, compiled
  once per flow."""

  def __init__(self, ctx: FlowContext):
    cluster, cfg = ctx.cluster, ctx.cfg
    b, t = cfg.rollout.batch_size, cfg.rollout.max_new_tokens
    actor = cluster.roles[Role.ACTOR]
    bt, b1 = actor.batch_sharding((b, t)), actor.batch_sharding((b,))
    self.zeros_bt = cluster.compile(
      "packed_zeros_bt", lambda: jnp.zeros((b, t), jnp.float32), out_shardings=bt
    )
    self.zeros_b = cluster.compile(
      "packed_zeros_b", lambda: jnp.zeros((b,), jnp.float32), out_shardings=b1
    )
    self.response = cluster.compile("unpack_response", unpack_response, out_shardings=bt)
    self.last = cluster.compile("unpack_last", unpack_last, out_shardings=b1)
    self.order = cluster.compile(
      "minibatch_order", functools.partial(stages.minibatch_order, cfg.seed, b=b)
    )


def ready_when_full(width: int, rows: int) -> Callable[[np.ndarray], int]:
  """`scoring.generate_and_score`'s flush rule of packed calls: once the waiting samples no
  longer fit in `rows` rows, the longest first ones that do."""

  def ready(lengths_n: np.ndarray) -> int:
    if packing.fits(lengths_n, width, rows):
      return 0
    k = len(lengths_n) - 1
    while k > 1 and not packing.fits(lengths_n[:k], width, rows):
      k -= 1
    return k

  return ready


def score(
  ctx: FlowContext,
  iteration: int,
  seqs: Sequences,
  stages_fn: Any,
  rows: int,
  programs: Programs,
  then: Sequence[Key] = (),
) -> dict[str, Any]:
  """`scoring.score` packed: every sample of `seqs` in calls of at most `rows` packed rows (in
  one call, its stages run together; `then` as `PackedScoring.add`'s)."""
  scorer = PackedScoring(ctx, iteration, stages_fn, rows, programs)
  scorer.add(np.arange(len(seqs.prompts)), seqs, then=then)
  return scorer.result()


# ---------------------------------------------------------------------------------------------
# Updates.


def gather_micro_batch(
  fields: dict[str, jax.Array], index: dict[str, jax.Array]
) -> dict[str, jax.Array]:
  """A packed micro-batch from the batch's padded fields: 'tokens' `[b, s]` at `tokens_src`,
  every other field `[b, t]` at `pred_src` (0 where -1), and the index's own rows."""

  def take(x, src):
    flat = x.reshape(-1)
    return jnp.where(src >= 0, flat[jnp.maximum(src, 0)], 0).astype(x.dtype)

  micro = {name: index[name] for name in ("positions", "segments", "weights", "token_weights")}
  micro["tokens"] = take(fields["tokens"], index["tokens_src"])
  for name, x in fields.items():
    if name != "tokens":
      micro[name] = take(x, index["pred_src"])
  return micro


def minibatch_rows(ctx: FlowContext, programs: Programs, role: Role) -> list[np.ndarray]:
  """The batch's rows of each mini-batch at `role`'s optimizer step: the padded splitter's
  (`stages.minibatch_splitter`), fetched to the host, where packing is planned."""
  cluster = ctx.cluster
  order = cluster.fetch(programs.order(cluster.states[role].step), "minibatch order")
  return [np.sort(part) for part in np.split(np.asarray(order), ctx.cfg.ppo.mini_batches)]


def micro_batch_index(
  parts: list[tuple[np.ndarray, packing.PackedLayout]],
  rows_n: np.ndarray,
  response_mask_nt: np.ndarray,
  aggregation: str,
) -> list[dict[str, np.ndarray]]:
  """The index arrays of the packed micro-batches `parts` of one mini-batch (batch rows
  `rows_n`; every sample's response mask `response_mask_nt`, 0 on a conversation's
  observations), with the loss weights of `aggregation` over the mini-batch
  (`alg.aggregation_weights`) and the token-mean weights, 0 off the mask: what
  `gather_micro_batch` reads."""
  t = parts[0][1].response_slot.shape[1]
  mask_flat = (np.asarray(response_mask_nt) > 0).reshape(-1)
  policy_n = mask_flat.reshape(-1, t).sum(-1)
  weight_n = alg.aggregation_weights(aggregation, policy_n[rows_n], t)
  token_weight = np.float32(1.0 / max(int(policy_n[rows_n].sum()), 1))
  place_b = np.zeros(len(policy_n), np.int64)
  place_b[rows_n] = np.arange(len(rows_n))  # a sample's place in the mini-batch
  out = []
  for _, lay in parts:
    src = np.maximum(lay.pred_src, 0)
    valid = (lay.pred_src >= 0) & mask_flat[src]
    weights = np.where(valid, weight_n[place_b[src // t]], 0.0)
    out.append(
      {
        "tokens_src": lay.tokens_src,
        "pred_src": lay.pred_src,
        "positions": lay.positions,
        "segments": lay.segments,
        "weights": weights.astype(np.float32),
        "token_weights": np.where(valid, token_weight, 0.0).astype(np.float32),
      }
    )
  return out


class PackedUpdate:
  """One trained role's packed updates: `stages(fields, seqs, minis)` gives one optimizer
  update stage per mini-batch. Its packed micro-batches are gathered where the batch's `fields`
  are (`source`'s mesh: the actor's, where the advantages are) and moved to the role's mesh as
  packed rows; their gradients are summed (`packed_update.PackedStep`).

  `fused` (the critic of `ppo.fuse_actor_critic`): its micro-batches go to the `source`'s mesh,
  where the fused step runs, stacked as a pipelined mini-batch (`micro_batches`), and it
  compiles no step of its own."""

  def __init__(
    self,
    ctx: FlowContext,
    role: Role,
    name: str,
    loss_fn: steps.LossFn,
    source: Role,
    *,
    fused: bool = False,
  ):
    self.ctx, self.role, self.source = ctx, role, source
    cfg, ppo, cluster = ctx.cfg, ctx.cfg.ppo, ctx.cluster
    self.width = cfg.rollout.max_seq_len
    padded_rows = cfg.rollout.batch_size // (ppo.mini_batches * ppo.micro_batches)
    self.max_rows = packed_update.max_rows(ppo.max_tokens_per_micro_batch, self.width, padded_rows)
    self.multiple = batch_shards(ctx, (role, source))
    self.aggregation = ppo.loss_agg if role == Role.ACTOR else "token_mean"
    self.dest = source if fused else role
    self._gather = cluster.compile(f"{name}_gather", gather_micro_batch, role=source)
    self._step = (
      None
      if fused
      else packed_update.PackedStep(
        cluster, role, f"{name}_packed", loss_fn, field="ppo.packing", pipelines=True
      )
    )
    self._stacker = packed_update.Stacker(cluster, source, f"{name}_packed") if fused else None

  def micro_batches(
    self, fields: dict[str, jax.Array], seqs: Sequences, minis: list[np.ndarray]
  ) -> list[tuple[list[dict[str, jax.Array]], float, int]]:
    """Per mini-batch `minis[k]` (rows of `seqs`; `fields` on the source's mesh): its packed
    micro-batches, planned, gathered and moved now to `dest`'s mesh, with their fill and count."""
    cluster = self.ctx.cluster
    out = []
    for rows_n in minis:
      parts = layouts(seqs, rows_n, self.width, self.max_rows, self.multiple)
      index = micro_batch_index(parts, rows_n, seqs.response_mask_bt, self.aggregation)
      index = cluster.upload(self.source, index, "packing index")
      micros = [cluster.move(self.dest, self._gather(fields, micro)) for micro in index]
      out.append((micros, fill(parts), len(parts)))
    return out

  def stages(
    self, fields: dict[str, jax.Array], seqs: Sequences, minis: list[np.ndarray]
  ) -> list[tuple[dispatch.Stage, float, int]]:
    """Per mini-batch `minis[k]`: its update stage (`micro_batches`), with its fill and count."""
    update = functools.partial(self.ctx.cluster.update_stage, self.role, self._step)
    return [(update(micros), f, n) for micros, f, n in self.micro_batches(fields, seqs, minis)]

  def stacked(self, micros: list[dict[str, jax.Array]]) -> dict[str, jax.Array]:
    """`micros` (of `micro_batches`, `fused` only) as one pipelined mini-batch on the source's
    mesh (`packed_update.stack_micro_batches`)."""
    return self._stacker.stacked(micros)
