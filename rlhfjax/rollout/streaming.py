"""Streaming rollout: finished samples leave the continuous-batching loop as they finish.

The host loop over the engine's slot API:
  1. take pending prompts for the free slots; prefill them in batches of the engine's prefill
     sizes (short prompts together, so few are padded to a long bucket) and insert them;
  2. run the compiled decode loop on device until some slot finishes (or, once the queue is
     empty, until `min_yield` more do);
  3. copy the finished rows out, hand them to the consumer, mark their slots free; repeat.
The slots still running keep decoding in the next device call while the consumer works on
what came out (a scorer dispatching to its own mesh returns at once: JAX runs it alongside).

Once the queue is empty and at most `tail_threshold` of the slots still run, the running rows
are compacted into a smaller decode batch on fewer replicas (`rlhfjax.rollout.compaction`), and
again each time they fit the next smaller size.

Each request's PRNG key is `fold_in(key(seed), index in the input)`, so a prompt's response
depends on the seed and its own index only: not on the slot count, on the other prompts, on
when it is handed out or on compaction.

With the paged engine (`EngineConfig.paged`) the loop is `rlhfjax.rollout.paging.Scheduler`'s:
before each decode call it reserves pages for the running requests (preempting the youngest
when the pool runs short), admits waiting prompts while pages and queue room allow (identical
prompts prefilled once, sharing their pages) and hands the decode call a queue of prefilled
requests, which take slots on device as others finish; after the call the finished requests
come out and their pages go back to the pool. Each call decodes only a live batch, the
smallest allowed size holding the running and queued requests, with page tables as wide as
their pages; once nothing waits, a call returns when its live rows fit half its batch, so the
tail decodes ever smaller batches (the paged counterpart of tail compaction).

Each generated token records the version of the weights that sampled it
(`Engine.params_version` at the decode call, or the prefill, that produced it): weights
swapped between two decode calls of a stream apply from the next call on, the running requests
keeping their KV cache.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from rlhfjax.rollout import paging
from rlhfjax.rollout.sampling import GREEDY, SamplingParams

if TYPE_CHECKING:
  from rlhfjax.rollout.engine import Engine


@dataclasses.dataclass(frozen=True, kw_only=True)
class Finished:
  """Requests that finished during one decode call (host arrays, `k` rows)."""

  indices: np.ndarray
  """[k] int: each request's position in the input prompts."""
  tokens: np.ndarray
  """[k, r] int32 response tokens, `pad_token_id` past each length (`r`: `RolloutStream.width`)."""
  logprobs: np.ndarray
  """[k, r] float32 log-prob of each token under the distribution it was sampled from."""
  lengths: np.ndarray
  """[k] int32 response lengths, a final stop token included."""
  stopped: np.ndarray
  """[k] bool: the response ended with a stop token (else it hit its token limit)."""
  versions: np.ndarray | None = None
  """[k, r] int32 `Engine.params_version` of the weights that sampled each token, -1 past each
  length (a `RolloutStream` always sets it; None from producers that do not track it)."""


@dataclasses.dataclass(kw_only=True)
class StreamStats:
  """What a stream did so far (updated as it runs)."""

  inserts: np.ndarray
  """[prompts] int32: how many times each prompt was put into a slot (1, plus one per
  preemption)."""
  prefill_calls: int = 0
  prefill_rows: int = 0
  """Sequences prefilled: with shared prefixes, one per distinct prompt (and replica)."""
  decode_calls: int = 0
  """Device decode calls: the host round trips."""
  host_transfers: int = 0
  """Host transfers the stream made: uploads (`jax.device_put`) and reads, one per call."""
  generated_tokens: int = 0
  """Response tokens handed out."""
  max_live: int = 0
  """Most requests decoding at once."""
  max_pages_in_use: int = 0
  """Most KV pages held at once (the dense engine: its whole cache, in pages)."""
  preemptions: int = 0
  """Requests evicted for lack of pages (recomputed later)."""
  decode_steps_by_batch: dict[int, int] = dataclasses.field(default_factory=dict)
  """Decode steps run at each decode batch size (the full batch, then compacted sizes; the
  paged engine: its live-batch sizes)."""
  compactions: list[int] = dataclasses.field(default_factory=list)
  """The sizes the decode batch shrank to, in order."""


def as_prompt_list(
  prompts: Any, lengths: Any = None, padding_side: str = "left"
) -> list[np.ndarray]:
  """Prompts as a list of 1-D int arrays.

  Args:
    prompts: A sequence of token id lists, or a 2-D array of padded prompts.
    lengths: For a 2-D array, the real length of each row; None: every row is full.
    padding_side: For a 2-D array, 'left' (row i is `prompts[i, -lengths[i]:]`) or 'right'
      (`prompts[i, :lengths[i]]`).
  """
  if padding_side not in ("left", "right"):
    raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
  if isinstance(prompts, np.ndarray) or hasattr(prompts, "shape"):
    array = np.asarray(prompts)
    if array.ndim != 2:
      raise ValueError(f"a prompt array must be 2-D [prompts, length], got shape {array.shape}")
    if lengths is None:
      lengths = np.full(array.shape[0], array.shape[1])
    lengths = np.asarray(lengths).reshape(-1)
    if lengths.shape[0] != array.shape[0]:
      raise ValueError(f"{lengths.shape[0]} lengths for {array.shape[0]} prompts")
    if lengths.min(initial=0) < 0 or lengths.max(initial=0) > array.shape[1]:
      raise ValueError(f"prompt lengths must be in [0, {array.shape[1]}], got {lengths}")
    if padding_side == "left":
      return [array[i, array.shape[1] - n :] for i, n in enumerate(lengths)]
    return [array[i, :n] for i, n in enumerate(lengths)]
  if lengths is not None:
    raise ValueError("lengths are only for a 2-D prompt array")
  return [np.asarray(p).reshape(-1) for p in prompts]


def _chunks(items: list[int], sizes: Sequence[int]) -> list[list[int]]:
  """Splits `items` into runs whose lengths are prefill batch sizes, largest first."""
  out, rest = [], list(items)
  while rest:
    m = max(s for s in sizes if s <= len(rest))
    out.append(rest[:m])
    rest = rest[m:]
  return out


class RolloutStream:
  """An iterator of `Finished` groups, each request exactly once, in the order they finish.

  Iterate it once. `stats` fills in as it runs.
  """

  def __init__(
    self,
    engine: Engine,
    prompts: Any,
    lengths: Any = None,
    *,
    sampling: SamplingParams | Sequence[SamplingParams] = GREEDY,
    seed: int = 0,
    padding_side: str = "left",
    min_yield: int = 1,
    tail_threshold: float | None = None,
    on_decode_call: Callable[[], None] | None = None,
  ):
    """Checks the requests; nothing runs until iteration.

    Args:
      engine: The engine (its mesh, weights and compiled programs).
      prompts: Token id lists, or a 2-D padded array with `lengths` (see `as_prompt_list`).
      lengths: Real lengths of the rows of a 2-D `prompts` array.
      sampling: One setting for every prompt or one per prompt (per-prompt `max_new_tokens`
        and stop ids included).
      seed: Seeds every request's PRNG key together with its index in `prompts`.
      padding_side: Where a 2-D `prompts` array is padded.
      min_yield: Once no prompt is queued, a decode call returns when this many more requests
        finished (or all did); 1 hands each out as early as possible, `num_slots` makes as few
        host round trips as possible.
      tail_threshold: Fraction of the slots below which the tail is compacted; None: the
        engine's `EngineConfig.tail_threshold`; 0: never.
      on_decode_call: Called (on the iterating thread) before each device decode call (and
        the paged engine's prefills for it): the point where new weights may be swapped in
        (`Engine.update_params`) while rows are mid-answer; they keep their KV cache, and each
        token's `Finished.versions` entry says which weights produced it. With it, the paged
        engine's calls stay `EngineConfig.decode_chunk` steps long to the end, so a swap never
        waits for more than one chunk.
    """
    cfg = engine.config
    self._prompts = as_prompt_list(prompts, lengths, padding_side)
    num = len(self._prompts)
    if num == 0:
      raise ValueError("no prompts to generate from")
    settings = [sampling] * num if isinstance(sampling, SamplingParams) else list(sampling)
    if len(settings) != num:
      raise ValueError(f"{len(settings)} sampling settings for {num} prompts")
    for i, p in enumerate(self._prompts):
      try:
        cfg.bucket(len(p))
      except ValueError as e:
        raise ValueError(f"prompt {i}: {e}") from None
    limits = [
      cfg.max_new_tokens if s.max_new_tokens is None else s.max_new_tokens for s in settings
    ]
    if max(limits) > cfg.max_new_tokens:
      raise ValueError(
        f"max_new_tokens={max(limits)} exceeds the engine's cache capacity "
        f"(EngineConfig.max_new_tokens={cfg.max_new_tokens})"
      )
    if min_yield < 1:
      raise ValueError(f"min_yield must be >= 1, got {min_yield}")
    threshold = cfg.tail_threshold if tail_threshold is None else float(tail_threshold)
    if not 0.0 <= threshold < 1.0:
      raise ValueError(f"tail_threshold must be in [0, 1), got {threshold}")
    if cfg.paged and threshold > 0:
      raise ValueError("tail_threshold > 0 needs the dense engine (EngineConfig.paged=False)")
    self._engine = engine
    self._settings = settings
    self._seed = seed
    self._min_yield = min_yield
    self._threshold = threshold
    self._on_decode_call = on_decode_call
    self._started = False
    self.num_prompts = num
    self.width = max(limits)
    """Columns of every `Finished.tokens`: the largest `max_new_tokens` asked for."""
    self.stats = StreamStats(inserts=np.zeros(num, np.int32))
    self.scheduler: paging.Scheduler | None = None
    """The paged engine's scheduler (its pages and requests), once iteration started."""

  def __iter__(self) -> Iterator[Finished]:
    if self._started:
      raise RuntimeError("a RolloutStream is iterated once")
    self._started = True
    return self._run_paged() if self._engine.paged is not None else self._run()

  def _finished(self, rows: list[tuple[int, list, list, list, bool]]) -> Finished:
    """`Finished` of `(index, tokens, logprobs, versions, stopped)` rows."""
    width, pad = self.width, self._engine.config.pad_token_id
    k = len(rows)
    tokens = np.full((k, width), pad, np.int32)
    logprobs = np.zeros((k, width), np.float32)
    versions = np.full((k, width), -1, np.int32)
    for i, (_, t, lp, v, _) in enumerate(rows):
      tokens[i, : len(t)], logprobs[i, : len(lp)], versions[i, : len(v)] = t, lp, v
    lengths = np.asarray([len(r[1]) for r in rows], np.int32)
    self.stats.generated_tokens += int(lengths.sum())
    return Finished(
      indices=np.asarray([r[0] for r in rows]),
      tokens=tokens,
      logprobs=logprobs,
      lengths=lengths,
      stopped=np.asarray([r[4] for r in rows], bool),
      versions=versions,
    )

  def _run_paged(self) -> Iterator[Finished]:
    engine, cfg, stats = self._engine, self._engine.config, self.stats
    paged = engine.paged
    transfers = engine.host_transfers
    sched = self.scheduler = paging.Scheduler(
      self._prompts,
      engine.settings_arrays(self._settings),
      seed=self._seed,
      replicas=paged.replicas,
      slots=paged.slots_per_replica,
      pages=paged.pages,
      page_size=cfg.page_size,
      width=paged.width,
      decode_chunk=cfg.decode_chunk,
      share_prefixes=cfg.share_prefixes,
      min_yield=self._min_yield,
      chunked=self._on_decode_call is not None,
      batch_sizes=paged.batch_sizes,
      widths=paged.widths,
    )
    state = engine.init_decode_state()
    while (round_ := sched.plan()) is not None:
      if self._on_decode_call is not None:
        self._on_decode_call()
      params = engine.params
      by_bucket = collections.defaultdict(list)
      for item in sorted(round_.prefills, key=lambda it: len(it.tokens)):
        by_bucket[paged.bucket(len(item.tokens))].append(item)
      for items in by_bucket.values():
        for chunk in _chunks(items, cfg.prefill_batch_sizes):
          state = paged.prefill_pages(params, state, chunk)
          stats.prefill_calls += 1
      version = engine.params_version
      state, steps = paged.decode(params, state, round_)
      got = paged.read_round(state, steps)
      stats.decode_calls += 1
      size, steps = len(round_.slots_s), int(got.pop("steps"))
      if steps == 0:  # (the next call would plan the same: no progress)
        raise RuntimeError(f"a decode call of a live batch of {size} slots ran no step")
      stats.decode_steps_by_batch[size] = stats.decode_steps_by_batch.get(size, 0) + steps
      stats.max_live = max(stats.max_live, int(got.pop("live_max")))
      done = sched.finish(**got, version=version)
      counters = sched.counters
      stats.prefill_rows, stats.preemptions = counters.prefill_rows, counters.preemptions
      stats.max_pages_in_use = counters.max_pages_in_use
      stats.inserts[:] = [r.admissions for r in sched.requests]
      stats.host_transfers = engine.host_transfers - transfers
      if done:
        yield self._finished([(r.index, r.tokens, r.logprobs, r.versions, r.stopped) for r in done])

  def _stop_at(self, size: int, active: int, queued: bool, compacted: bool) -> int:
    """Free slots at which the next decode call returns."""
    free = size - active
    want = free + (1 if queued else self._min_yield)
    full = self._engine.config.num_slots
    if not queued and self._threshold > 0 and size // 2 in self._engine.compactor.sizes:
      trigger = size // 2 if compacted else min(int(self._threshold * full), size // 2)
      if trigger >= 1:
        want = min(want, size - trigger)  # return when the tail fits the next size
    return min(max(want, free + 1), size)

  def _run(self) -> Iterator[Finished]:
    engine, cfg, stats = self._engine, self._engine.config, self.stats
    compactor = engine.compactor
    transfers = engine.host_transfers
    pending = collections.deque(range(self.num_prompts))
    size = cfg.num_slots
    slot_request = [-1] * size
    versions = np.full((self.num_prompts, self.width), -1, np.int32)
    reported = np.zeros(self.num_prompts, np.int32)  # tokens whose version is recorded
    compacted = False
    stats.max_pages_in_use = cfg.num_slots * cfg.pages_per_sequence  # the whole dense cache
    state = engine.init_decode_state()
    while True:
      free = [s for s, r in enumerate(slot_request) if r < 0]
      if pending and free:
        taken = [pending.popleft() for _ in range(min(len(free), len(pending)))]
        taken.sort(key=lambda i: len(self._prompts[i]))
        for chunk in _chunks(taken, cfg.prefill_batch_sizes):
          slots, free = free[: len(chunk)], free[len(chunk) :]
          prefix = engine.prefill(
            [self._prompts[i] for i in chunk],
            [self._settings[i] for i in chunk],
            seed=self._seed,
            request_ids=chunk,
          )
          state = engine.insert(prefix, state, slots)
          stats.prefill_calls += 1
          stats.prefill_rows += len(chunk)
          for s, i in zip(slots, chunk, strict=True):
            slot_request[s] = i
            stats.inserts[i] += 1
            versions[i, 0], reported[i] = engine.params_version, 1  # the prefill's token
      active = [s for s, r in enumerate(slot_request) if r >= 0]
      if not active:
        return
      stats.max_live = max(stats.max_live, len(active))
      in_tail = compacted or len(active) <= self._threshold * cfg.num_slots
      if not pending and self._threshold > 0 and in_tail:
        while size // 2 in compactor.sizes and len(active) <= size // 2:
          size //= 2
          state = compactor.shrink(state, size, active)
          slot_request = [slot_request[s] for s in active] + [-1] * (size - len(active))
          active = list(range(len(active)))
          compacted = True
          stats.compactions.append(size)
      until_free = self._stop_at(size, len(active), bool(pending), compacted)
      if self._on_decode_call is not None:
        self._on_decode_call()
      version = engine.params_version
      if size == cfg.num_slots:
        state, steps = engine.generate_steps(state, until_free=until_free)
      else:
        state, steps = compactor.generate_steps(size, state, cfg.max_new_tokens, until_free)
      stats.decode_calls += 1
      view = engine.read(state)
      engine.host_transfers += 1  # the step count, read below
      stats.decode_steps_by_batch[size] = stats.decode_steps_by_batch.get(size, 0) + int(steps)
      for s in active:
        i, n = slot_request[s], int(view.num_generated[s])
        versions[i, reported[i] : n] = version
        reported[i] = n
      stats.host_transfers = engine.host_transfers - transfers
      done = [s for s in active if view.done[s]]
      if not done:
        continue
      rows = []
      for s in done:
        i, n = slot_request[s], int(view.num_generated[s])
        width = min(n, self.width)
        rows.append(
          (
            i,
            view.tokens[s, :width].tolist(),
            view.logprobs[s, :width].tolist(),
            versions[i, :width].tolist(),
            bool(view.stopped[s]),
          )
        )
        slot_request[s] = -1
      yield self._finished(rows)
