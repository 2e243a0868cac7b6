"""Host-side pages of the paged rollout engine: allocator, prefix cache and scheduler (NumPy).

Each 'data' replica owns `pages` pages (page 0 reserved: see `rlhfjax.rollout.paged_decode`),
a free list with reference counts, a prefix cache, `slots` decode slots, a queue of prefilled
requests waiting for a slot (one per free slot plus `slots` more, at most `2 * slots`) and
`2 * slots` output rows (plus a garbage row).

Prefix sharing. A prompt is prefilled once per replica: the requests with that prompt (the
`group_size` samples of a GRPO group) share its full pages. The cache key is the tuple of the
prefilled tokens, all of the prompt but its last token (which the first decode step feeds).
Its partly filled last page belongs to the first request that needed it; every later request
copies it into its own page before its first token (copy on write: a request writes its
response from index `L - 1` on, so positions before it are the same in every copy). The cache
entry holds a reference to all of them until its last user finishes or is preempted.

Admission is by pages, not by slot count: a request is admitted (prefilled and queued for a
slot of its replica) when its replica has queue room and free pages for its prompt and one
decode chunk (requests queued beyond its free slots also leave the next chunk of growth of the
admitted ones free). Before each decode call every running request reserves pages for the
steps the call may run (`decode_chunk`, or all its remaining tokens when nothing waits); after
the call the pages of finished requests and unused reservations go back to the free list. When a
running request cannot get its pages, the youngest admitted request of its replica is
preempted: its pages are freed and it goes back to the front of the waiting line, keeping the
tokens it generated; readmitted, it re-prefills prompt + tokens and continues with its RNG at
its step count, so its tokens are those it would have drawn without the preemption (up to fp32
rounding of the recomputed KV). A pool of one full sequence per replica always progresses: a
request alone in its replica needs at most a sequence's pages, plus one if it shares a prompt
whose first user is gone (the entry keeps that user's last prompt page); short of it, it
preempts itself, which frees the entry, and comes back as the prompt's first user.

Conversations. With a `TurnFn`, a request that ends a turn (a stop token, or `turn_tokens`)
is handed to it; an observation it returns is appended to the request's tokens and the request
is queued again in its own pages, its history's KV kept: the next round carries an
`ExtendItem` that writes the KV of the turn's last token and the observation but its last
(which the next decode step feeds). Without queue room or pages it waits like a preempted
request and is prefilled again.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

_NEVER = 2**31 - 1


class PagePool:
  """One replica's pages: a free list and reference counts. Page 0 is never handed out."""

  def __init__(self, num_pages: int):
    self.refs = np.zeros(num_pages, np.int32)
    self.refs[0] = 1
    self._free = list(range(num_pages - 1, 0, -1))

  @property
  def num_free(self) -> int:
    return len(self._free)

  @property
  def in_use(self) -> int:
    """Pages held by someone (the reserved page excluded)."""
    return len(self.refs) - 1 - len(self._free)

  def alloc(self, n: int) -> list[int]:
    if n > len(self._free):
      raise RuntimeError(f"{n} pages asked of a pool with {len(self._free)} free")
    pages = [self._free.pop() for _ in range(n)]
    self.refs[pages] = 1
    return pages

  def retain(self, pages: Sequence[int]) -> None:
    for p in pages:
      self.refs[p] += 1

  def release(self, pages: Sequence[int]) -> None:
    for p in pages:
      if p == 0 or self.refs[p] <= 0:
        raise RuntimeError(f"page {p} released more often than it was held")
      self.refs[p] -= 1
      if self.refs[p] == 0:
        self._free.append(p)


def live_batch_sizes(num_slots: int, replicas: int) -> tuple[int, ...]:
  """Live-batch sizes a decode call may run, largest first: `num_slots`, then halves while
  each replica keeps a whole number of rows (multiples of the 'data' axis)."""
  sizes, m = [num_slots], num_slots
  while m % 2 == 0 and (m // 2) % replicas == 0:
    m //= 2
    sizes.append(m)
  return tuple(sizes)


def table_widths(width: int, floor: int) -> tuple[int, ...]:
  """Page-table widths a decode call may run, largest first: `width`, then halves (rounded up)
  while they stay at least `floor` pages."""
  widths = [width]
  while -(-widths[-1] // 2) >= max(floor, 1) and widths[-1] > 1:
    widths.append(-(-widths[-1] // 2))
  return tuple(widths)


def slot_pages(num_slots: int, replicas: int, pages: int, width: int) -> np.ndarray:
  """`[b, w]` page tables giving slot `j` of a replica pages `1 + j*w ... (j+1)*w` (0 where the
  pool is too small): the fixed layout of the slot API, a dense cache's memory in pages."""
  per = num_slots // replicas
  local = np.arange(num_slots) % per
  table = 1 + local[:, None] * width + np.arange(width)[None, :]
  return np.where(table < pages, table, 0).astype(np.int32)


@dataclasses.dataclass
class CachedPrompt:
  """A prefilled sequence's shared pages in one replica."""

  full: list[int]
  """Its full pages."""
  partial: int
  """The page holding its partly filled last page (0: none)."""
  users: int = 0


@dataclasses.dataclass(eq=False)
class Request:
  """A request's host record."""

  index: int
  prompt: np.ndarray
  max_new: int
  tokens: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[float] = dataclasses.field(default_factory=list)
  versions: list[int] = dataclasses.field(default_factory=list)
  stopped: bool = False
  status: str = "pending"
  """'pending', 'queued' (prefilled, waiting for a slot), 'running' or 'done'."""
  replica: int = -1
  row: int = -1
  slot: int = -1
  key: tuple | None = None
  """Its prefilled sequence's prefix-cache key (None: nothing prefilled, a 1-token prompt)."""
  shared: list[int] = dataclasses.field(default_factory=list)
  own: list[int] = dataclasses.field(default_factory=list)
  copy: tuple[int, int] = (0, 0)
  admitted: int = -1
  """Admission order (the largest is the youngest)."""
  admissions: int = 0
  """Times it was admitted (1, plus one per preemption)."""
  turn_start: int = 0
  """Where its current turn starts in `tokens` (a conversation: after the last observation)."""
  observed: list[tuple[int, int]] = dataclasses.field(default_factory=list)
  """`[start, end)` of each observation in `tokens`: an environment's tokens, not sampled."""
  unwritten: np.ndarray | None = None
  """Tokens whose KV is still to be written after its pages' (the last turn's final token and
  the observation but its last token), from logical index `unwritten_start` on."""
  unwritten_start: int = 0

  @property
  def index_next(self) -> int:
    """Logical index of its next decode input (the last token of prompt + response)."""
    return len(self.prompt) + len(self.tokens) - 1

  @property
  def table(self) -> list[int]:
    return self.shared + self.own


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrefillItem:
  """A sequence to prefill into pages of a replica."""

  tokens: np.ndarray
  """The tokens whose KV is written (all but the sequence's last)."""
  pages: list[int]
  """Its pages in logical order: the full ones, then the partly filled last one if any."""
  replica: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExtendItem:
  """Tokens whose KV goes after the KV a sequence's pages hold (`paged_decode.extend`)."""

  tokens: np.ndarray
  start: int
  """Logical index of the first."""
  pages: list[int]
  """The sequence's pages in logical order (covering the new tokens)."""
  replica: int


def map_in_order(fn: Callable[[Any], Any], items: Sequence[Any], workers: int, name: str) -> list:
  """`[fn(x) for x in items]`, from up to `workers` threads (named `name`) at once; an
  exception is raised in item order, as one by one."""
  if min(workers, len(items)) <= 1:
    return [fn(x) for x in items]
  with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix=name) as pool:
    return list(pool.map(fn, items))


TurnFn = Callable[[int, np.ndarray, bool, int], "np.ndarray | None"]
"""`turn(index, tokens, stopped, room) -> observation or None`: called when request `index`
ends a turn (`tokens`: the turn's sampled tokens, `stopped`: on a stop token, `room`: tokens
left under its limit); token ids to append (fewer than `room`) continue the sequence, None ends
it. A `TurnFn` with an int attribute `concurrency` above 1 is called from that many threads at
once for the requests that ended a turn in the same decode call (an environment waiting on a
tool); their observations are applied in request order, so the run is the same for any
`concurrency`."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Round:
  """What the host does before one decode call."""

  prefills: list[PrefillItem]
  extends: list[ExtendItem]
  """Continued sequences' new tokens, written after the prefills and before the decode call."""
  table_bw: np.ndarray
  evict_b: np.ndarray
  count_d: np.ndarray
  queue: dict[str, np.ndarray]
  """The fields of `paged_decode.Queue`, as host arrays."""
  max_steps: int
  until_free: int
  until_finished: int
  shrink_after: int
  """Return once the live rows fit half of `slots_s` and may run this many more steps:
  `decode_chunk` when nothing waits to take the room and half is a live-batch size, else
  never. (A return costs a round trip; a smaller batch saves half the rows of the steps left.)"""
  slots_s: np.ndarray
  """The live batch: slot ids local to their replica, `len / replicas` per replica,
  replica-major; the running slots first, then free ones for the queued requests."""
  width: int
  """Page-table width of the call: covers every page a running or queued request holds."""


@dataclasses.dataclass
class Counters:
  prefill_rows: int = 0
  preemptions: int = 0
  recomputed_tokens: int = 0
  """Generated tokens of preempted requests, prefilled again at readmission."""
  max_pages_in_use: int = 0


class Scheduler:
  """Admission, page reservation, preemption and bookkeeping of one stream's requests."""

  def __init__(
    self,
    prompts: Sequence[np.ndarray],
    settings: dict[str, np.ndarray],
    *,
    seed: int,
    replicas: int,
    slots: int,
    pages: int,
    page_size: int,
    width: int,
    decode_chunk: int,
    share_prefixes: bool,
    min_yield: int,
    chunked: bool = False,
    batch_sizes: Sequence[int] | None = None,
    widths: Sequence[int] | None = None,
    tail_rows: int = 0,
    turn: TurnFn | None = None,
    turn_tokens: int = 0,
  ):
    """Args:
    prompts: Token ids of each request.
    settings: Per-request arrays of `rlhfjax.rollout.engine` (`max_new_b`, `stop_bm`,
      `temperature_b`, `top_k_b`, `top_p_b`).
    seed: Names each request's PRNG key with its index.
    replicas, slots, pages: 'data' replicas, and decode slots and pages in each.
    page_size, width: Entries per page and pages per sequence.
    decode_chunk: Most decode steps per call while requests wait.
    share_prefixes: Share identical prompts' pages.
    min_yield: Once nothing waits, a call returns when this many more requests finished.
    chunked: Keep every call at most `decode_chunk` steps, also once nothing waits (the
      caller may swap weights between calls).
    batch_sizes: Live-batch sizes over all replicas (`live_batch_sizes`); None: all slots.
    widths: Page-table widths (`table_widths`); None: `width` only.
    tail_rows: Once nothing waits, a call returns when at most this many requests run (the
      stream then moves them to a tail engine, `rlhfjax.rollout.compaction`); 0: never.
    turn: Called as each request ends a turn (`TurnFn`); an observation it returns continues
      the request in its own pages: queued again (its KV kept, the new tokens' KV written by
      an `ExtendItem`), or, without queue room or pages, back to the waiting line like a
      preempted request. None: one turn.
    turn_tokens: With `turn`, a turn also ends after this many tokens (0: at the request's
      limit only).
    """
    self._settings = settings
    self._seed = seed
    self.replicas, self.slots, self.page_size, self.width = replicas, slots, page_size, width
    self.queue_rows = 2 * slots
    self.out_rows = 2 * slots + 1
    self._chunk = decode_chunk
    self._chunked = chunked
    self._share = share_prefixes
    self._min_yield = min_yield
    self._sizes = sorted(batch_sizes or [replicas * slots])
    self._widths = sorted(widths or [width])
    self._tail_rows = tail_rows
    self._turn, self._turn_tokens = turn, turn_tokens
    self.requests = [
      Request(index=i, prompt=np.asarray(p, np.int32), max_new=int(settings["max_new_b"][i]))
      for i, p in enumerate(prompts)
    ]
    self.pending = collections.deque(self.requests)
    self.pools = [PagePool(pages) for _ in range(replicas)]
    self.cache: list[dict[tuple, CachedPrompt]] = [{} for _ in range(replicas)]
    self.queued: list[list[Request]] = [[] for _ in range(replicas)]
    self.slot_of: list[list[Request | None]] = [[None] * slots for _ in range(replicas)]
    self._free_rows = [list(range(2 * slots - 1, -1, -1)) for _ in range(replicas)]
    self._evict: list[int] = []
    self._admissions = 0
    self.counters = Counters()

  def take_over(self, moving: Sequence[Request], requests: list[Request]) -> None:
    """Continues another scheduler's running requests `moving` (of its `requests`, which
    become this one's): each waits here to be prefilled again with its prompt and the tokens
    it has, as a preempted request does, and resumes at its next token."""
    self.requests = requests
    for r in moving:
      r.status, r.replica, r.row, r.slot, r.key = "pending", -1, -1, -1, None
      r.own, r.shared, r.copy = [], [], (0, 0)
      self.counters.recomputed_tokens += len(r.tokens)
    self.pending = collections.deque(sorted(moving, key=lambda r: r.admitted))

  # -------------------------------------------------------------------------------------------
  # Pages.

  def _pages_to_cover(self, r: Request, steps: int) -> int:
    """New pages `r` needs so its table covers the writes of `steps` more decode steps."""
    steps = min(steps, r.max_new - len(r.tokens))
    return max(0, math.ceil((r.index_next + steps) / self.page_size) - len(r.table))

  def _release(self, r: Request) -> None:
    """Frees `r`'s pages, its use of its cached prompt and its output row."""
    pool = self.pools[r.replica]
    pool.release(r.own)
    if r.key is not None:
      entry = self.cache[r.replica][r.key]
      entry.users -= 1
      if entry.users == 0:
        pool.release(entry.full + ([entry.partial] if entry.partial else []))
        del self.cache[r.replica][r.key]
    self._free_rows[r.replica].append(r.row)
    r.own, r.shared, r.key, r.row, r.copy = [], [], None, -1, (0, 0)
    r.unwritten = None  # (readmitted, it prefills prompt + tokens again)

  def _preempt(self, r: Request) -> None:
    """Evicts `r` (queued or running) back to the front of the waiting line."""
    if r.status == "running":
      self._evict.append(r.replica * self.slots + r.slot)
      self.slot_of[r.replica][r.slot] = None
    else:
      self.queued[r.replica].remove(r)
    self._wait_again(r)
    self.counters.preemptions += 1

  def _wait_again(self, r: Request) -> None:
    """`r`, in no slot or queue, gives up its pages and goes to the front of the waiting line,
    to be prefilled again with the tokens it has."""
    self._release(r)
    r.status, r.slot, r.replica = "pending", -1, -1
    self.pending.appendleft(r)
    self.counters.recomputed_tokens += len(r.tokens)

  def _admitted(self, replica: int) -> list[Request]:
    running = [r for r in self.slot_of[replica] if r is not None]
    return running + self.queued[replica]

  def _reserve(self, r: Request, steps: int) -> bool:
    """Gives running `r` pages for `steps` more steps, preempting the youngest admitted
    requests of its replica while they are short. False: `r` itself was preempted."""
    pool, need = self.pools[r.replica], self._pages_to_cover(r, steps)
    while pool.num_free < need:
      victim = max(self._admitted(r.replica), key=lambda x: x.admitted)
      self._preempt(victim)
      if victim is r:
        return False
    r.own += pool.alloc(need)
    return True

  # -------------------------------------------------------------------------------------------
  # Admission.

  def _sequence(self, r: Request) -> tuple[np.ndarray, tuple | None]:
    """The tokens `r` prefills (all of prompt + response but the last) and their cache key."""
    seq = np.concatenate([r.prompt, np.asarray(r.tokens, np.int32)])[:-1]
    if len(seq) == 0:
      return seq, None
    shared = self._share and not r.tokens
    return seq, (("prompt", *seq.tolist()) if shared else ("request", r.index, len(seq)))

  def _room(self, replica: int) -> int:
    """Requests `replica` can still queue: one per free slot (taken at the next call's start)
    and `slots` more (taken as slots free up), so its queued and running requests never need
    more than its `2 * slots` output rows."""
    free = sum(r is None for r in self.slot_of[replica])
    return free + self.slots - len(self.queued[replica])

  def _headroom(self, replica: int) -> int:
    """Pages to leave free when admitting to `replica` beyond its free slots: the next chunk of
    growth of every request admitted there (past the chunk it holds pages for), so that waiting
    requests do not take the pages running ones grow into and get preempted for them."""
    free = sum(r is None for r in self.slot_of[replica])
    if len(self.queued[replica]) < free:
      return 0
    return sum(self._pages_to_cover(r, 2 * self._chunk) for r in self._admitted(replica))

  def _admission_cost(self, r: Request, replica: int, key: tuple | None, n: int) -> int:
    full, partial = divmod(n, self.page_size)
    hit = key is not None and key in self.cache[replica]
    prompt = (1 if partial else 0) if hit else full + (1 if partial else 0)
    steps = min(self._chunk, r.max_new - len(r.tokens))
    return prompt + max(0, math.ceil((n + steps) / self.page_size) - full - (1 if partial else 0))

  def _choose_replica(self, r: Request, key: tuple | None, n: int) -> int | None:
    """The replica `r` goes to: one holding its prompt if it fits there, else the one with
    most free pages; None when none has queue room and pages."""
    fits = [
      d
      for d in range(self.replicas)
      if self._room(d) > 0
      and self._admission_cost(r, d, key, n) + self._headroom(d) <= self.pools[d].num_free
    ]
    if not fits:
      return None
    hits = [d for d in fits if key is not None and key in self.cache[d]]
    room = lambda d: (self.pools[d].num_free, -len(self._admitted(d)))
    return hits[0] if hits else max(fits, key=room)

  def _admit(self, r: Request, prefills: list[PrefillItem]) -> bool:
    seq, key = self._sequence(r)
    n = len(seq)
    d = self._choose_replica(r, key, n)
    if d is None:
      return False
    pool, full = self.pools[d], n // self.page_size
    partial = n % self.page_size != 0
    r.replica, r.key, r.row = d, key, self._free_rows[d].pop()
    r.own, r.shared, r.copy = [], [], (0, 0)
    if key is not None:
      entry = self.cache[d].get(key)
      if entry is None:
        pages = pool.alloc(full + partial)
        entry = self.cache[d][key] = CachedPrompt(
          full=pages[:full], partial=pages[full] if partial else 0
        )
        prefills.append(PrefillItem(tokens=seq, pages=pages, replica=d))
        if partial:  # the first user writes into the prompt's own last page
          pool.retain([entry.partial])
          r.own = [entry.partial]
      elif partial:  # later users copy it into a page of their own first
        r.own = pool.alloc(1)
        r.copy = (entry.partial, r.own[0])
      entry.users += 1
      r.shared = list(entry.full)
    r.own += pool.alloc(self._pages_to_cover(r, self._chunk))
    r.status, r.admitted = "queued", self._admissions
    r.admissions += 1
    self._admissions += 1
    self.queued[d].append(r)
    return True

  # -------------------------------------------------------------------------------------------
  # Rounds.

  def running(self) -> list[Request]:
    return [r for d in range(self.replicas) for r in self.slot_of[d] if r is not None]

  def plan(self) -> Round | None:
    """Reserves, preempts and admits for the next decode call; None when every request is
    done."""
    running = sorted(self.running(), key=lambda r: r.admitted)
    if not running and not self.pending and not any(self.queued):
      return None
    waiting = bool(self.pending) or any(self.queued)
    horizon = self._chunk
    if not waiting and not self._chunked:  # finish in one call if the pages allow it
      remaining = max(r.max_new - len(r.tokens) for r in running)
      need = collections.Counter()
      for r in running:
        need[r.replica] += self._pages_to_cover(r, remaining)
      if all(need[d] <= self.pools[d].num_free for d in need):
        horizon = remaining
    for r in running:
      if r.status == "running":  # (not preempted meanwhile)
        self._reserve(r, horizon)
    prefills: list[PrefillItem] = []
    while self.pending and self._admit(self.pending[0], prefills):
      self.pending.popleft()
    if not self.running() and not any(self.queued):  # (an empty pool admits any request)
      raise RuntimeError(f"request {self.pending[0].index} does not fit an empty page pool")
    self.counters.prefill_rows += len(prefills)
    self.counters.max_pages_in_use = max(
      self.counters.max_pages_in_use, sum(p.in_use for p in self.pools)
    )
    extends = []
    for r in (r for queued in self.queued for r in queued if r.unwritten is not None):
      extends.append(
        ExtendItem(tokens=r.unwritten, start=r.unwritten_start, pages=r.table, replica=r.replica)
      )
      r.unwritten = None
    return self._round(prefills, extends, horizon)

  def _round(self, prefills: list[PrefillItem], extends: list[ExtendItem], horizon: int) -> Round:
    b, w, d_all = self.replicas * self.slots, self.width, self.replicas
    table = np.zeros((b, w), np.int32)
    for d in range(d_all):
      for j, r in enumerate(self.slot_of[d]):
        if r is not None:
          table[d * self.slots + j, : len(r.table)] = r.table
    evict = np.zeros(b, bool)
    evict[self._evict] = True
    self._evict = []
    q, s = d_all * self.queue_rows, self._settings
    queue = {
      "table_qw": np.zeros((q, w), np.int32),
      "copy_from_q": np.zeros(q, np.int32),
      "copy_to_q": np.zeros(q, np.int32),
      "token_q": np.zeros(q, np.int32),
      "index_q": np.zeros(q, np.int32),
      "num_generated_q": np.zeros(q, np.int32),
      "max_new_q": np.zeros(q, np.int32),
      "stop_qm": np.full((q, s["stop_bm"].shape[1]), -1, np.int32),
      "temperature_q": np.zeros(q, np.float32),
      "top_k_q": np.zeros(q, np.int32),
      "top_p_q": np.ones(q, np.float32),
      "seed_q": np.full(q, self._seed, np.int32),
      "request_id_q": np.zeros(q, np.int32),
      "row_q": np.zeros(q, np.int32),
    }
    count = np.zeros(d_all, np.int32)
    for d in range(d_all):
      count[d] = len(self.queued[d])
      for j, r in enumerate(self.queued[d]):
        i, last = d * self.queue_rows + j, r.tokens[-1] if r.tokens else r.prompt[-1]
        queue["table_qw"][i, : len(r.table)] = r.table
        queue["copy_from_q"][i], queue["copy_to_q"][i] = r.copy
        queue["token_q"][i], queue["index_q"][i] = last, r.index_next
        queue["num_generated_q"][i] = len(r.tokens)
        for name in ("max_new", "stop", "temperature", "top_k", "top_p"):
          field = "stop_bm" if name == "stop" else f"{name}_b"
          queue["stop_qm" if name == "stop" else f"{name}_q"][i] = s[field][r.index]
        if self._turn is not None and self._turn_tokens:  # the turn ends at its own limit
          queue["max_new_q"][i] = min(r.max_new, r.turn_start + self._turn_tokens)
        queue["request_id_q"][i], queue["row_q"][i] = r.index, r.row
    idle = sum(
      max(0, sum(r is None for r in self.slot_of[d]) - len(self.queued[d])) for d in range(d_all)
    )
    pending = bool(self.pending)
    until_free = min(idle + 1, b) if pending else b
    admitted = sum(len(self._admitted(d)) for d in range(d_all))
    if not pending and 0 < self._tail_rows < admitted:
      # At most `tail_rows` run: they move. Slots no queued request of their replica can take
      # (`idle`: a conversation's next turn queues on its own replica) are free from the start,
      # so the call waits for one more than those.
      until_free = min(b, max(b - self._tail_rows, idle + 1))
    slots_s, width = self._live_batch()
    return Round(
      prefills=prefills,
      extends=extends,
      table_bw=table,
      evict_b=evict,
      count_d=count,
      queue=queue,
      max_steps=horizon,
      until_free=until_free,
      until_finished=_NEVER if pending else self._min_yield,
      shrink_after=self._chunk if not pending and len(slots_s) > self._sizes[0] else _NEVER,
      slots_s=slots_s,
      width=width,
    )

  def _live_batch(self) -> tuple[np.ndarray, int]:
    """The smallest live batch holding, in every replica, its running requests and those
    queued for the call, and the narrowest table width covering all their pages."""
    admitted = [self._admitted(d) for d in range(self.replicas)]
    most = max(len(a) for a in admitted)
    per = min(
      (s // self.replicas for s in self._sizes if s // self.replicas >= most), default=self.slots
    )
    slots_s = []
    for d in range(self.replicas):
      running = [j for j, r in enumerate(self.slot_of[d]) if r is not None]
      free = [j for j, r in enumerate(self.slot_of[d]) if r is None]
      slots_s += (running + free)[:per]
    pages = max((len(r.table) for a in admitted for r in a), default=0)
    width = min(w for w in self._widths if w >= pages)
    return np.asarray(slots_s, np.int32), width

  def finish(
    self,
    *,
    row_b: np.ndarray,
    done_b: np.ndarray,
    taken_d: np.ndarray,
    out_num_o: np.ndarray,
    out_done_o: np.ndarray,
    out_stopped_o: np.ndarray,
    out_tokens_or: np.ndarray,
    out_logprobs_or: np.ndarray,
    version: int,
  ) -> list[Request]:
    """Takes a decode call's results: records new tokens, frees what finished; returns the
    requests that finished, in output row order."""
    ro = self.out_rows
    by_row: dict[tuple[int, int], Request] = {}
    for d in range(self.replicas):
      for r in self.slot_of[d]:
        if r is not None:
          by_row[d, r.row] = r
      started, self.queued[d] = self.queued[d][: taken_d[d]], self.queued[d][taken_d[d] :]
      for r in started:
        by_row[d, r.row] = r
      self.slot_of[d] = [None] * self.slots
    for i in np.flatnonzero(~done_b):
      d, j = divmod(int(i), self.slots)
      r = by_row[d, int(row_b[i])]
      r.status, r.slot = "running", j
      self.slot_of[d][j] = r
    rows = sorted(by_row.items())
    for (d, row), r in rows:
      o = d * ro + row
      old, new = len(r.tokens), int(out_num_o[o])
      r.tokens += out_tokens_or[o, old:new].tolist()
      r.logprobs += out_logprobs_or[o, old:new].tolist()
      r.versions += [version] * (new - old)
      if out_done_o[o]:
        r.stopped, r.status = bool(out_stopped_o[o]), "done"
        if r.slot >= 0 and self.slot_of[d][r.slot] is r:
          self.slot_of[d][r.slot] = None
        r.slot = -1
    # The turns that ended, all at once (their environments may wait on tools), then each
    # request continued or released in row order, as the pages' order needs.
    observations = self._next_turns([r for (d, row), r in rows if out_done_o[d * ro + row]])
    finished = []
    for (d, row), r in rows:
      o = d * ro + row
      if out_done_o[o]:
        observation = observations[r.index]
        if observation is not None:
          self._continue(r, observation)
          continue
        self._release(r)
        finished.append(r)
      elif r.status == "running":  # give back the pages past its last write
        keep = math.ceil(r.index_next / self.page_size) - len(r.shared)
        self.pools[d].release(r.own[keep:])
        r.own = r.own[:keep]
      else:
        raise RuntimeError(f"request {r.index} left its queue but runs in no slot")
    return finished

  def _next_turns(self, ended: list[Request]) -> dict[int, np.ndarray | None]:
    """By request index, the observation that continues each of `ended` after the turn it
    just ended, or None: the `TurnFn` called for each, from its `concurrency` threads."""
    if self._turn is None:
      return dict.fromkeys((r.index for r in ended), None)
    workers = int(getattr(self._turn, "concurrency", 1))
    observations = map_in_order(self._next_turn, ended, workers, "turn")
    return {r.index: o for r, o in zip(ended, observations, strict=True)}

  def _next_turn(self, r: Request) -> np.ndarray | None:
    """The observation that continues `r` after the turn it just ended, or None."""
    room = r.max_new - len(r.tokens)
    turn = np.asarray(r.tokens[r.turn_start :], np.int32)
    observation = self._turn(r.index, turn, r.stopped, room)
    if observation is None:
      return None
    observation = np.asarray(observation, np.int32).reshape(-1)
    if not 0 < len(observation) < room:
      raise ValueError(
        f"request {r.index}: an observation must have 1 to {room - 1} tokens (its limit leaves "
        f"{room}), got {len(observation)}"
      )
    return observation

  def _continue(self, r: Request, observation: np.ndarray) -> None:
    """Appends `observation` to finished-turn `r` and queues it again in its own pages, the
    new tokens' KV to be written after theirs; without queue room or pages, it waits to be
    prefilled again (prompt and every token) as a preempted request does."""
    n, m = len(r.tokens), len(observation)
    start, last = r.index_next, r.tokens[-1]  # the turn's last token: its KV is not written
    r.tokens += observation.tolist()
    r.logprobs += [0.0] * m
    r.versions += [-1] * m
    r.observed.append((n, n + m))
    r.turn_start, r.stopped = n + m, False
    d, pool = r.replica, self.pools[r.replica]
    need = self._pages_to_cover(r, self._chunk)
    if self._room(d) > 0 and pool.num_free >= need:
      r.own += pool.alloc(need)
      r.unwritten = np.asarray([last, *observation[:-1].tolist()], np.int32)
      r.unwritten_start, r.copy = start, (0, 0)
      r.status, r.admitted = "queued", self._admissions
      self._admissions += 1
      self.queued[d].append(r)
      return
    self._wait_again(r)

  @property
  def all_pages_free(self) -> bool:
    return all(p.in_use == 0 for p in self.pools) and not any(self.cache)
