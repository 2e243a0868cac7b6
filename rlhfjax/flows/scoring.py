"""Scoring a rollout batch by every role: whole, in micro-batches, or fused with generation.

The PPO-family flows score each sample with the actor (old log-probs), the reference, the
critic, the reward model and a rule. `score` does it after generation; `generate_and_score`
(`rollout.fused_scoring`, RLHFuse's sample-level fusion) while generation continues: the
rollout stream (`rlhfjax.rollout.streaming`) hands out finished samples, and every
`rollout.scoring_rows` of them the scoring stages are dispatched on their roles' meshes.

* Disaggregated or interleaved placements (scorers' devices not the rollout's): a dispatched
  program returns at once, so the scorers work while the next decode chunk runs.
* Co-located: JAX runs the programs of a device in dispatch order, so scoring interleaves with
  the decode chunks.

Advantages need the whole batch (whitening, groups), so they start when `result` has put every
role's scores back in the batch's order (one gather per role, rows exact copies).

Synchronous results do not depend on fusion: a sample's scores come from the same compiled
program (one per row count), with the same per-device shapes, whichever samples share its
micro-batch (row `i` of a forward depends on row `i` only) and whenever it runs. Scoring in
micro-batches of another size than the whole batch changes the last bits: XLA's CPU matmul
orders its accumulation by the per-device row count. On the tiny test model co-located,
log-probs moved by up to 4.8e-7 (one float32 ulp at their size), within what moving the
unfused run to another placement does to every log-prob, value, score, advantage and loss,
though the mean rollout-to-actor log-prob mismatch moved 2.2e-8 against 7.5e-9 across
placements. So `rollout.score_micro_batch` is part of a run's numerics; fusion is not.

Every micro-batch's work on a device group is one timeline record (stage 'score', `chunk` its
index), from its dispatch (or the end of the group's previous block) to its completion.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from rlhfjax.cluster import dispatch
from rlhfjax.cluster.residency import Key
from rlhfjax.data.records import PromptBatch
from rlhfjax.flows import experience, stages
from rlhfjax.flows.experience import Sequences
from rlhfjax.flows.stages import FlowContext
from rlhfjax.observe.timeline import StageRecord
from rlhfjax.placement.spec import Role
from rlhfjax.rollout import fused
from rlhfjax.rollout.streaming import RolloutStream

StagesFn = Callable[[tuple[jax.Array, ...], Sequences], list[dispatch.Stage]]
"""`fn(inputs, seqs) -> stages`: the scoring stages of the rows of `seqs` from `inputs` on the
actor's mesh: `(tokens_bs, attention_bs)`, or packed `(tokens, positions, segments)` rows
(`rlhfjax.flows.packed`); each stage's result has those rows (packed: those slots)."""


class MicroBatchScoring:
  """Scoring stages dispatched micro-batch by micro-batch; `result` in the batch's order."""

  def __init__(self, ctx: FlowContext, iteration: int, stages_fn: StagesFn, rows: int):
    self.ctx, self.iteration, self.stages_fn, self.rows = ctx, iteration, stages_fn, rows
    self._parts: dict[str, list[Any]] = {}
    self._indices: list[np.ndarray] = []
    self._lanes: dict[tuple[int, ...], concurrent.futures.ThreadPoolExecutor] = {}
    self._lane_end: dict[tuple[int, ...], float] = {}
    self._waits: list[concurrent.futures.Future] = []

  def add(self, indices: np.ndarray, seqs: Sequences) -> None:
    """Dispatches the scoring of `seqs` (samples `indices` of the batch, at most `rows`),
    padded to `rows` rows by repeating its last one."""
    cluster, n = self.ctx.cluster, len(indices)
    if not 0 < n <= self.rows:
      raise ValueError(f"a micro-batch holds 1 to {self.rows} samples, got {n}")
    padded = experience.take_rows([(seqs, np.minimum(np.arange(self.rows), n - 1))])
    tokens = cluster.upload(
      Role.ACTOR, (padded.tokens_bs, padded.attention_mask_bs), "rollout micro-batch"
    )
    self._dispatch(self.stages_fn(tokens, padded), indices)

  def _dispatch(self, todo: list[dispatch.Stage], indices: np.ndarray) -> None:
    """Dispatches one call's stages (of samples `indices`), each recorded by its device
    group's lane."""
    cluster = self.ctx.cluster
    if not self._indices:
      cluster.prepare(todo)  # offloaded weights of the scorers come to device memory
    chunk = len(self._indices)
    self._indices.append(np.asarray(indices))
    for stage in todo:
      dispatched = cluster.timeline.now()
      out = stage.fn()  # device stages return once dispatched; a host stage runs here
      self._parts.setdefault(stage.role, []).append(out)
      if stage.devices not in self._lanes:
        self._lanes[stage.devices] = concurrent.futures.ThreadPoolExecutor(1)
      lane = self._lanes[stage.devices]
      self._waits.append(lane.submit(self._record, stage, out, dispatched, chunk))

  def _record(self, stage: dispatch.Stage, out: Any, dispatched: float, chunk: int) -> None:
    """Waits for one block (in its device group's thread, in dispatch order) and records it."""
    jax.block_until_ready(out)
    timeline = self.ctx.cluster.timeline
    start = max(dispatched, self._lane_end.get(stage.devices, 0.0))
    end = self._lane_end[stage.devices] = timeline.now()
    timeline.add(
      StageRecord(
        iteration=self.iteration,
        role=stage.role,
        stage=stage.name,
        start=start,
        end=end,
        devices=stage.devices,
        chunk=chunk,
      )
    )

  def _wait(self) -> None:
    """Waits for every dispatched block to complete and be recorded."""
    try:
      for wait in self._waits:
        wait.result()
    finally:
      for lane in self._lanes.values():
        lane.shutdown(wait=True)

  def result(self) -> dict[str, Any]:
    """Every stage's results for the whole batch in its order, by role name: device results on
    their role's mesh (rows split as the unfused scorer's), host results as NumPy."""
    self._wait()
    order = np.concatenate(self._indices)
    num = len(order)
    if sorted(order.tolist()) != list(range(num)):
      raise ValueError(f"the micro-batches do not hold each of {num} samples once")
    positions = np.concatenate(
      [k * self.rows + np.arange(len(idx)) for k, idx in enumerate(self._indices)]
    )
    rows_n = np.empty(num, np.int32)
    rows_n[order] = positions
    out = {}
    for role, parts in self._parts.items():
      if isinstance(parts[0], np.ndarray):
        out[role] = np.concatenate(parts)[rows_n]
      else:
        with self.ctx.cluster.host("scoring order"):  # `rows_n` goes to the devices
          ordered = fused.in_order(tuple(parts), rows_n)
        out[role] = self.ctx.cluster.move(role, ordered)
    return out


def score(
  ctx: FlowContext,
  iteration: int,
  seqs: Sequences,
  stages_fn: StagesFn,
  rows: int,
  tokens: tuple[jax.Array, jax.Array],
  then: Sequence[Key] = (),
) -> dict[str, Any]:
  """Scores a generated batch (`tokens`: its tokens and attention mask on the actor's mesh):
  in one call per stage (`rows` >= the batch, stages on disjoint devices at the same time),
  else in micro-batches of `rows` samples. `then`: the (role, stage) that runs next, whose
  offloaded state is prefetched during the last scoring stage (`Cluster.run`)."""
  cluster, num = ctx.cluster, len(seqs.prompts)
  if rows >= num:
    todo = stages_fn(tokens, seqs)
    results = cluster.run(todo, iteration, then=then)
    return dict(zip([s.role for s in todo], results, strict=True))
  scoring = MicroBatchScoring(ctx, iteration, stages_fn, rows)
  for start in range(0, num, rows):
    idx = np.arange(start, min(start + rows, num))
    scoring.add(idx, experience.take_rows([(seqs, idx)]))
  return scoring.result()


def whole_rows(rows: int) -> Callable[[np.ndarray], int]:
  """`generate_and_score`'s flush rule of padded calls: `rows` samples at a time."""
  return lambda lengths_n: rows if len(lengths_n) >= rows else 0


def generate_and_score(
  ctx: FlowContext,
  iteration: int,
  prompts: PromptBatch | Sequence[Sequence[int]],
  scorer: MicroBatchScoring,
  ready: Callable[[np.ndarray], int],
) -> tuple[Sequences, dict[str, Any]]:
  """Generates responses to `prompts` and scores them with `scorer` as they finish (see the
  module docstring): whenever `ready(lengths)` of the waiting samples' prompt + response
  lengths (in the order they finished) is k > 0, the first k are scored. Returns the batch (as
  `stages.generate_stage` does) and `scorer.result()`. The 'generate' record spans the
  stream."""
  cfg, cluster = ctx.cfg, ctx.cluster
  seed = stages.rollout_seed(cfg, iteration)
  batch, convs = stages.start_conversations(ctx, PromptBatch.of(prompts), seed)
  r = cfg.rollout
  layout = dict(prompt_len=r.max_prompt_len, response_len=r.max_new_tokens)
  stream = RolloutStream(
    cluster.engine,
    batch.tokens,
    sampling=stages.sampling(cfg, ctx.tokenizer),
    seed=seed,
    min_yield=scorer.rows,
    turn=None if convs is None else convs.turn,
    turn_tokens=r.max_turn_tokens,
  )
  num, width = stream.num_prompts, stream.width
  tokens = np.full((num, width), ctx.tokenizer.pad_id, np.int32)
  logprobs = np.zeros((num, width), np.float32)
  observed = np.zeros((num, width), bool)
  lengths = np.zeros(num, np.int32)
  prompt_lengths = np.asarray([len(x) for x in batch.tokens], np.int32)
  waiting: list[int] = []

  def flush(idx: list[int]) -> None:
    sub = experience.assemble(
      [batch.tokens[i] for i in idx],
      tokens[idx],
      lengths[idx],
      logprobs[idx],
      pad_id=ctx.tokenizer.pad_id,
      records=batch.rows(idx).records,
      **stages.conversation_fields(convs, observed, idx),
      **layout,
    )
    scorer.add(np.asarray(idx), sub)

  finished = iter(stream)
  with cluster.timeline.stage(
    iteration, "rollout", "generate", cluster.roles[Role.ROLLOUT].devices
  ), cluster.generating():  # fmt: skip
    while True:
      with cluster.host("generate"):
        done = next(finished, None)
      if done is None:
        break
      tokens[done.indices] = done.tokens
      logprobs[done.indices] = done.logprobs
      lengths[done.indices] = done.lengths
      if done.observed is not None:
        observed[done.indices] = done.observed
      waiting += done.indices.tolist()
      while k := ready(prompt_lengths[waiting] + lengths[waiting]):
        flush(waiting[:k])
        waiting = waiting[k:]
  if waiting:
    flush(waiting)
  seqs = experience.assemble(
    batch.tokens,
    tokens,
    lengths,
    logprobs,
    pad_id=ctx.tokenizer.pad_id,
    records=batch.records,
    **stages.conversation_fields(convs, observed),
    **layout,
  )
  return stages.conversation_stats(convs, seqs), scorer.result()
