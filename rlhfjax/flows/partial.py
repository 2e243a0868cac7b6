"""Interruptible generation with bounded staleness (`ppo.max_staleness`; AReaL's partial
rollout, verl's `staleness_threshold`) on a rollout with its own devices.

One worker thread owns the rollout engine: it generates the batches the flow submits, in
order, and applies the weight syncs the flow posts. The flow's thread never calls the engine.

Versions. The policy version of a set of weights is the number of iterations whose updates
they include: iteration `i` trains its batch with version `i` and its update makes version
`i + 1`. A token's version is that of the weights that sampled it; a batch trained at iteration
`i` is `i - v` versions stale where `v` is its oldest token's version. With a bound `k`:

  * the flow submits batch `j` once batch `j - k` is being trained (at iteration `j - k`,
    when the engine holds version `j - k`), so the worker runs at most `k` batches ahead and
    every token of batch `j` is of version `j - k` or newer: at most `k` stale at iteration
    `j`. The worker also waits for version `j - k` before it starts batch `j`, so the bound
    holds whatever the flow does;
  * after update `i` the flow posts "sync version `i + 1`" and waits until the worker has
    done it (the next update donates the weights the transfer reads, so the transfer must be
    in flight first). The worker syncs between two decode calls, the running rows keep their
    KV cache and go on under the new weights, each token keeping the log-prob of the weights
    that sampled it (the importance correction's behaviour log-prob): the wait is at most one
    decode call and the sync. An idle worker syncs at once;
  * the engine's weights change only while the flow waits for a posted sync, so whatever the
    flow's thread does between iterations (checkpoints, evaluation) sees fixed weights, and at
    the end of iteration `i` the engine holds the actor's version `i + 1`.

Where a sync lands depends on timing, so such runs are not bitwise reproducible; the bound
always holds, and `Generated.versions_bt` records each token's version.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from rlhfjax.data.records import PromptBatch
from rlhfjax.flows import stages
from rlhfjax.flows.experience import Sequences
from rlhfjax.flows.stages import FlowContext


@dataclasses.dataclass(frozen=True, kw_only=True)
class Generated:
  """One batch from the worker."""

  seqs: Sequences
  versions_bt: np.ndarray
  """[b, t] int32: the policy version of the weights that sampled each response token, laid
  out as `seqs.response_mask_bt` (-1 off the responses)."""
  syncs_mid_batch: int
  """Weight syncs that landed while the batch was generating (after its first prefill)."""


def staleness_metrics(iteration: int, versions_bt: np.ndarray) -> dict[str, float]:
  """The staleness of a batch trained at `iteration` (versions as `Generated.versions_bt`):
  the largest and mean over its tokens, and the fraction of samples whose tokens come from
  more than one version (interrupted by a sync)."""
  mask_bt = versions_bt >= 0
  stale_bt = np.where(mask_bt, iteration - versions_bt, 0)
  newest_b = np.where(mask_bt, versions_bt, -1).max(-1)
  oldest_b = np.where(mask_bt, versions_bt, np.iinfo(np.int32).max).min(-1)
  spans_b = mask_bt.any(-1) & (newest_b > oldest_b)
  return {
    "rollout/staleness_max": float(stale_bt.max(initial=0)),
    "rollout/staleness_mean": float(stale_bt.sum() / max(int(mask_bt.sum()), 1)),
    "rollout/interrupted_frac": float(spans_b.mean()),
  }


class _Closed(Exception):
  """The worker was closed while it generated: the batch is abandoned."""


@dataclasses.dataclass
class _Post:
  version: int
  iteration: int
  done: concurrent.futures.Future


class PartialRollout:
  """The generation worker of `ppo.max_staleness` (see the module docstring).

  The flow's thread calls `start`, `submit`, `take`, `sync` and `close`; the engine is used by
  the worker thread only. An error on the worker is raised, as it is, by the flow's next
  `take` or `sync`.
  """

  def __init__(self, ctx: FlowContext, max_staleness: int):
    if max_staleness < 1:
      raise ValueError(f"max_staleness must be >= 1, got {max_staleness}")
    self.ctx, self.max_staleness = ctx, max_staleness
    self.before_decode_call: Callable[[int, int], None] | None = None
    """Called on the worker with (batch, decode call of that batch) before each decode call,
    before the posted syncs are applied: tests hold a call there until a sync is posted
    (`wait_posted`), so that it lands mid-batch."""
    self._cond = threading.Condition()
    self._jobs: collections.deque[tuple[int, PromptBatch, concurrent.futures.Future]] = (
      collections.deque()
    )
    self._posts: collections.deque[_Post] = collections.deque()
    self._posted = -1
    """The newest policy version posted."""
    self._out: dict[int, concurrent.futures.Future] = {}
    self._closed = False
    self._error: BaseException | None = None
    self._thread: threading.Thread | None = None
    # The worker's own state.
    self._version = -1
    """The policy version of the engine's weights."""
    self._policy_of: dict[int, int] = {}
    """Engine `params_version` -> policy version, recorded at each sync."""

  @property
  def started(self) -> bool:
    return self._thread is not None

  def start(self, version: int) -> None:
    """Starts the worker; the engine holds policy version `version` (the iteration about to
    run: the actor's weights at its start)."""
    engine = self.ctx.cluster.engine
    self._version = self._posted = version
    self._policy_of = {engine.params_version: version}
    self._thread = threading.Thread(target=self._run, name="partial-rollout", daemon=True)
    self._thread.start()

  # -------------------------------------------------------------------------------------------
  # The flow's side.

  def submit(self, batch: int, prompts: PromptBatch) -> None:
    """Queues batch `batch` (the iteration that trains it) for generation."""
    with self._cond:
      self._raise_if_failed()
      self._out[batch] = concurrent.futures.Future()
      self._jobs.append((batch, prompts, self._out[batch]))
      self._cond.notify_all()

  def take(self, batch: int) -> Generated:
    """Waits for batch `batch` (submitted before) and hands it over."""
    with self._cond:
      future = self._out[batch]
    try:
      return future.result()
    finally:
      with self._cond:
        del self._out[batch]

  def sync(self, version: int, iteration: int) -> int:
    """Posts "sync version `version`" (the actor's weights after iteration `iteration`'s
    update) and waits until the worker has done it; returns the bytes moved."""
    post = _Post(version=version, iteration=iteration, done=concurrent.futures.Future())
    with self._cond:
      self._raise_if_failed()
      self._posts.append(post)
      self._posted = version
      self._cond.notify_all()
    return post.done.result()

  def wait_posted(self, version: int) -> None:
    """Waits (on any thread) until a sync to policy version `version` or newer is posted;
    raises `_Closed` when the worker closes first."""
    with self._cond:
      self._cond.wait_for(lambda: self._closed or self._posted >= version)
      if self._closed:
        raise _Closed

  def close(self) -> None:
    """Stops the worker: a batch generating is abandoned at its next decode call; waits for
    the thread to end."""
    with self._cond:
      self._closed = True
      self._cond.notify_all()
    if self._thread is not None:
      self._thread.join()
    self._fail_all(_Closed())

  def _raise_if_failed(self) -> None:
    if self._error is not None:
      raise self._error
    if self._closed:
      raise RuntimeError("the rollout worker is closed")

  # -------------------------------------------------------------------------------------------
  # The worker's side.

  def _run(self) -> None:
    try:
      while True:
        with self._cond:
          self._cond.wait_for(lambda: self._closed or self._jobs or self._posts)
          if self._closed:
            return
          job = self._jobs.popleft() if not self._posts and self._jobs else None
        if job is None:
          self._apply_posted()
          continue
        batch, prompts, future = job
        # Every token of batch j must be of version j - k or newer.
        while self._version < batch - self.max_staleness:
          self.wait_posted(batch - self.max_staleness)
          self._apply_posted()
        future.set_result(self._generate(batch, prompts))
    except _Closed:
      return
    except BaseException as e:  # noqa: BLE001 - handed to the flow's thread as it is
      with self._cond:
        self._error = e
      self._fail_all(e)

  def _fail_all(self, error: BaseException) -> None:
    """Every batch and sync still waited for fails with `error`."""
    with self._cond:
      futures = [f for f in self._out.values() if not f.done()]
      futures += [p.done for p in self._posts if not p.done.done()]
      self._posts.clear()
    for future in futures:
      future.set_exception(error)

  def _apply_posted(self) -> int:
    """Applies every posted sync (on the worker); returns how many."""
    applied = 0
    while True:
      with self._cond:
        if self._closed:
          raise _Closed
        if not self._posts:
          return applied
        post = self._posts[0]
      cluster = self.ctx.cluster
      before = cluster.engine.params_version
      moved = cluster.sync(post.iteration)
      if cluster.engine.params_version == before:
        raise RuntimeError("the weight sync did not reach the rollout engine")
      self._policy_of[cluster.engine.params_version] = post.version
      self._version = post.version
      with self._cond:
        self._posts.popleft()
      post.done.set_result(moved)
      applied += 1

  def _generate(self, batch: int, prompts: PromptBatch) -> Generated:
    calls, mid_batch = 0, 0

    def on_decode_call() -> None:
      nonlocal calls, mid_batch
      if self.before_decode_call is not None:
        self.before_decode_call(batch, calls)
      calls += 1
      mid_batch += self._apply_posted()

    seqs, engine_versions_bt = stages.generate_stage_with_versions(
      self.ctx, batch, prompts, on_decode_call=on_decode_call
    )
    # Engine versions -> policy versions (-1, off the responses, stays -1).
    table = np.full(max(self._policy_of) + 2, -1, np.int32)
    for engine_version, version in self._policy_of.items():
      table[engine_version] = version
    return Generated(seqs=seqs, versions_bt=table[engine_versions_bt], syncs_mid_batch=mid_batch)


def pending_from_json(value: Any) -> list[PromptBatch]:
  """The prompts of the batches a checkpoint's flow had drawn but not trained: its meta's
  'pending_prompts' (None; one batch, as `PromptBatch.to_json` or a bare token list; or a list
  of `to_json` batches)."""
  if value is None:
    return []
  if isinstance(value, list) and (not value or isinstance(value[0], dict)):
    return [PromptBatch.from_json(v) for v in value]
  return [PromptBatch.from_json(value)]
