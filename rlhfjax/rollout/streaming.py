"""Streaming rollout: finished samples leave the continuous-batching loop as they finish.

The loop is `rlhfjax.rollout.paging.Scheduler`'s: before each decode call it reserves pages for
the running requests (preempting the youngest when the pool runs short), admits waiting prompts
while pages and queue room allow (identical prompts prefilled once, sharing their pages) and
hands the decode call a queue of prefilled requests, which take slots on device as others
finish; after the call the finished requests come out, go to the consumer, and their pages go
back to the pool. The requests still running keep decoding in the next device call while the
consumer works on what came out (a scorer dispatching to its own mesh returns at once: JAX runs
it alongside).

Each call decodes only a live batch, the smallest allowed size holding the running and queued
requests, with page tables as wide as their pages; once nothing waits, a call returns when its
live rows fit half its batch, so the long tail of a length mix decodes ever smaller batches.
With `tail_threshold`, once nothing waits and at most that fraction of the slots run, the
running requests move onto a tail engine on fewer 'data' replicas
(`rlhfjax.rollout.compaction`) and finish there.

Each request's PRNG key is `fold_in(key(seed), index in the input)`, and each of its tokens is
drawn with that key folded with the token's position in the response, so a prompt's response
depends on the seed and its own index only: not on the slot count, on the other prompts, on
when it is handed out, on preemption or on the tail's move.

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
  length and on observations (a `RolloutStream` always sets it; None from producers that do
  not track it)."""
  observed: np.ndarray | None = None
  """[k, r] bool: the token is an observation a `turn` function appended, not sampled (its
  log-prob 0); None for one-turn streams."""


@dataclasses.dataclass(kw_only=True)
class StreamStats:
  """What a stream did so far (updated as it runs)."""

  inserts: np.ndarray
  """[prompts] int32: how many times each prompt was put into a slot (1, plus one per
  preemption and one for the move to the tail engine)."""
  prefill_calls: int = 0
  prefill_rows: int = 0
  """Sequences prefilled: with shared prefixes, one per distinct prompt (and replica)."""
  prefill_tokens: int = 0
  """Tokens the prefill calls ran over: each call's compiled rows times its prompt bucket
  (padding included)."""
  decode_calls: int = 0
  """Device decode calls: the host round trips."""
  host_transfers: int = 0
  """Host transfers the stream made: uploads (`jax.device_put`) and reads, one per call."""
  generated_tokens: int = 0
  """Response tokens handed out."""
  max_live: int = 0
  """Most requests decoding at once."""
  max_pages_in_use: int = 0
  """Most KV pages held at once (by the engine, then by the tail engine)."""
  preemptions: int = 0
  """Requests evicted for lack of pages (recomputed later)."""
  recomputed_tokens: int = 0
  """Generated tokens prefilled again: of preempted requests, and of those moved to the tail
  engine."""
  extend_calls: int = 0
  """Device calls writing observations' KV after their sequences' (conversations)."""
  extended_tokens: int = 0
  """Tokens those calls wrote: each observation and the turn's last token before it."""
  decode_steps_by_batch: dict[int, int] = dataclasses.field(default_factory=dict)
  """Decode steps run at each live-batch size (the tail engine's included)."""
  compactions: list[int] = dataclasses.field(default_factory=list)
  """Slots of the tail engine the running requests moved to (at most one move)."""


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


def _waves(items: Sequence[paging.ExtendItem], most: int) -> list[list[paging.ExtendItem]]:
  """Extensions as calls of at most `most` tokens a row: wave `k` holds the `k`-th piece of
  every item longer than `k * most` (a piece's KV attends to the pieces before it)."""
  waves: list[list[paging.ExtendItem]] = []
  for it in items:
    for k, at in enumerate(range(0, len(it.tokens), most)):
      if k == len(waves):
        waves.append([])
      piece = it.tokens[at : at + most]
      waves[k].append(dataclasses.replace(it, tokens=piece, start=it.start + at))
  return waves


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
    turn: paging.TurnFn | None = None,
    turn_tokens: int = 0,
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
      tail_threshold: Fraction of the slots at or below which the running requests move to a
        tail engine on fewer replicas (`rlhfjax.rollout.compaction`); None: the engine's
        `EngineConfig.tail_threshold`; 0: never.
      on_decode_call: Called (on the iterating thread) before each device decode call (and
        the prefills for it): the point where new weights may be swapped in
        (`Engine.update_params`) while rows are mid-answer; they keep their KV cache, and each
        token's `Finished.versions` entry says which weights produced it. With it, decode calls
        stay `EngineConfig.decode_chunk` steps long to the end, so a swap never waits for more
        than one chunk.
      turn: Called as each request ends a turn (`paging.TurnFn`: its index, the turn's tokens,
        whether it stopped on a stop token, the tokens left under its limit); token ids it
        returns are appended as an observation and the request decodes on from them, its KV
        cache kept (only the new tokens' KV is computed); None ends the request. Its
        `max_new_tokens` limits the whole conversation's response, observations included.
      turn_tokens: With `turn`, a turn also ends after this many tokens, not on a stop token
        (0: at the request's limit only).
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
    self._engine = engine
    self._settings = settings
    self._seed = seed
    self._min_yield = min_yield
    self._threshold = threshold
    self._on_decode_call = on_decode_call
    self._turn, self._turn_tokens = turn, turn_tokens
    self._started = False
    self.num_prompts = num
    self.width = max(limits)
    """Columns of every `Finished.tokens`: the largest `max_new_tokens` asked for."""
    self.stats = StreamStats(inserts=np.zeros(num, np.int32))
    self.scheduler: paging.Scheduler | None = None
    """The scheduler (its pages and requests) of the engine decoding, once iteration started:
    the tail engine's after the move."""

  def __iter__(self) -> Iterator[Finished]:
    if self._started:
      raise RuntimeError("a RolloutStream is iterated once")
    self._started = True
    return self._run()

  def _finished(self, done: list[paging.Request]) -> Finished:
    """`Finished` of finished requests."""
    width, pad = self.width, self._engine.config.pad_token_id
    k = len(done)
    tokens = np.full((k, width), pad, np.int32)
    logprobs = np.zeros((k, width), np.float32)
    versions = np.full((k, width), -1, np.int32)
    observed = np.zeros((k, width), bool)
    for i, r in enumerate(done):
      n = len(r.tokens)
      tokens[i, :n], logprobs[i, :n], versions[i, :n] = r.tokens, r.logprobs, r.versions
      for start, end in r.observed:
        observed[i, start:end] = True
    lengths = np.asarray([len(r.tokens) for r in done], np.int32)
    self.stats.generated_tokens += int(lengths.sum() - observed.sum())
    return Finished(
      indices=np.asarray([r.index for r in done]),
      tokens=tokens,
      logprobs=logprobs,
      lengths=lengths,
      stopped=np.asarray([r.stopped for r in done], bool),
      versions=versions,
      observed=observed if self._turn is not None else None,
    )

  def _scheduler(self, engine: Engine, tail_rows: int | None = None) -> paging.Scheduler:
    cfg, paged = engine.config, engine.paged
    return paging.Scheduler(
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
      tail_rows=tail_rows or 0,
      turn=self._turn,
      turn_tokens=self._turn_tokens,
    )

  def _run(self) -> Iterator[Finished]:
    engine = self._engine
    tail_rows = engine.compactor.rows(self._threshold)
    self.scheduler = self._scheduler(engine, tail_rows)
    moving = yield from self._drive(engine, tail_rows, StreamStats(inserts=self.stats.inserts))
    if moving:
      tail = engine.compactor.engine(tail_rows)
      main = self.scheduler
      self.scheduler = self._scheduler(tail)
      self.scheduler.take_over(moving, main.requests)
      self.stats.compactions.append(tail_rows)
      yield from self._drive(tail, None, dataclasses.replace(self.stats))

  def _drive(self, engine: Engine, tail_rows: int | None, base: StreamStats) -> Iterator[Finished]:
    """Runs `self.scheduler` on `engine` until every request is done, adding its counts to
    those of `base`; returns None, or the running requests once they fit `tail_rows` with
    nothing waiting (and drops the engine's decode state)."""
    cfg, stats, sched, paged = engine.config, self.stats, self.scheduler, engine.paged
    transfers = engine.host_transfers
    state = engine.init_decode_state()
    while (round_ := sched.plan()) is not None:
      if self._on_decode_call is not None:
        self._on_decode_call()
      params = engine.params
      by_bucket = collections.defaultdict(list)
      for item in sorted(round_.prefills, key=lambda it: len(it.tokens)):
        by_bucket[paged.bucket(len(item.tokens))].append(item)
      for bucket, items in by_bucket.items():
        for chunk in _chunks(items, cfg.prefill_batch_sizes):
          state = paged.prefill_pages(params, state, chunk)
          stats.prefill_calls += 1
          stats.prefill_tokens += bucket * len(chunk)  # a chunk is a compiled batch size
      for wave in _waves(round_.extends, cfg.prompt_buckets[-1]):
        state = paged.extend_pages(params, state, wave)
        stats.extend_calls += 1
        stats.extended_tokens += sum(len(it.tokens) for it in wave)
      version = self._engine.params_version
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
      stats.prefill_rows = base.prefill_rows + counters.prefill_rows
      stats.preemptions = base.preemptions + counters.preemptions
      stats.recomputed_tokens = base.recomputed_tokens + counters.recomputed_tokens
      stats.max_pages_in_use = max(base.max_pages_in_use, counters.max_pages_in_use)
      stats.inserts[:] = [r.admissions for r in sched.requests]
      stats.host_transfers = base.host_transfers + engine.host_transfers - transfers
      if done:
        yield self._finished(done)
      running = sched.running()
      waiting = sched.pending or any(sched.queued)
      if tail_rows and not waiting and 0 < len(running) <= tail_rows < size:
        paged.drop(state)
        return running
    return None
