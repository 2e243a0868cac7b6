"""The rollout engine's pages against generation without a cache (`rollout_reference`): outputs,
pages, sharing, admission, preemption, live batches, layout, kernels."""

import contextlib
import dataclasses
import functools
import re
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import rollout_reference
from jax.experimental.pallas import tpu as pltpu

from rlhfjax import models, rollout
from rlhfjax.cluster import cluster
from rlhfjax.config import RolloutSection
from rlhfjax.config.model import get_model_config
from rlhfjax.models import transformer
from rlhfjax.placement.spec import RoleSpec
from rlhfjax.rollout import paged_decode, paged_engine, paging
from rlhfjax.rollout.lengths import tail_lengths

pytestmark = pytest.mark.unit

CONFIG = get_model_config("tiny")
# 4 slots, rows of 16 + 8 = 24 tokens: 6 pages of 4 (several pages per prompt), and reserving
# pages 3 decode steps at a time, so prompts cross page boundaries and rows re-reserve often.
PAGED = rollout.EngineConfig(
  num_slots=4,
  prompt_buckets=(8, 16),
  max_new_tokens=8,
  prefill_batch_sizes=(1, 4),
  page_size=4,
  decode_chunk=3,
)
LENGTHS = (1, 2, 3, 5, 8, 9, 12, 15, 16, 4, 7)  # a 1-token prompt to a full bucket
# fp32 log-probs of a ~6-nat scale through a few dozen roundings: the engine's attention over
# pages sums over another number of masked keys in another order than a forward without cache.
ATOL = 1e-5


def _decode_programs(engine) -> dict[str, int]:
  """Compilations of the paged decode loop, by program (one per live-batch size x width)."""
  return {k: n for k, n in engine.compilations.items() if k.startswith("generate_steps")}


def _role(devices, data=1, tensor=1):
  return RoleSpec.generation(devices, data=data, tensor=tensor)


@pytest.fixture(scope="module")
def params():
  return models.init_params(CONFIG, "lm", jax.random.key(1))


def _reference(params, prompts, sampling=rollout.GREEDY, seed=0, max_new_tokens=None, turn=None):
  """What the engine must answer (`rollout_reference.generate`)."""
  return rollout_reference.generate(
    CONFIG, params, prompts, sampling, seed=seed,
    max_new_tokens=max_new_tokens or PAGED.max_new_tokens, turn=turn,
  )  # fmt: skip


@pytest.fixture(scope="module")
def paged(params):
  return rollout.Engine.for_role(CONFIG, PAGED, _role([1]), params)


@pytest.fixture(scope="module")
def paged_2x2(params):
  """data=2 x tensor=2 on devices 4-7."""
  return rollout.Engine.for_role(CONFIG, PAGED, _role([4, 5, 6, 7], 2, 2), params)


def _prompts(seed, lengths=LENGTHS):
  rng = np.random.default_rng(seed)
  return [rng.integers(0, CONFIG.vocab_size, n).tolist() for n in lengths]


def _settings(params, prompts, temperature=0.0, **kw):
  """Very different answer lengths: a third stop on a token the greedy answer holds
  (`stop_token_ids`), the rest stop at per-request token limits from 1 to 8."""
  greedy = _reference(params, prompts).tokens
  out = []
  for i, ref in enumerate(greedy):
    if i % 3 == 0:
      stops = (int(ref[i % 5]), 3)
      out.append(rollout.SamplingParams(temperature=temperature, stop_token_ids=stops, **kw))
    else:
      limit = 1 + i % 8
      out.append(rollout.SamplingParams(temperature=temperature, max_new_tokens=limit, **kw))
  return out


def _assert_same(got, want):
  for field in ("tokens", "lengths", "mask", "stopped"):
    np.testing.assert_array_equal(getattr(got, field), getattr(want, field), err_msg=field)
  np.testing.assert_allclose(got.logprobs, want.logprobs, atol=ATOL, rtol=0)


def _stream(engine, prompts, **kw):
  """Runs a stream to the end; returns it and its output in input order."""
  stream = rollout.RolloutStream(engine, prompts, **kw)
  groups = list(stream)
  order = np.concatenate([g.indices for g in groups])
  assert sorted(order.tolist()) == list(range(len(prompts)))
  return stream, groups


# ---------------------------------------------------------------------------------------------
# The engine equals generation without a cache.


@pytest.mark.parametrize(
  "setting",
  [
    dict(temperature=0.0),
    dict(temperature=1.0),
    dict(temperature=0.8, top_k=7),
    dict(temperature=1.2, top_p=0.8),
  ],
  ids=["greedy", "t1", "top_k", "top_p"],
)
def test_engine_equals_no_cache_generation_with_refill_and_very_different_lengths(
  params, paged, setting
):
  prompts = _prompts(0)
  settings = _settings(params, prompts, **setting)
  want = _reference(params, prompts, settings, seed=5)
  got = paged.generate(prompts, sampling=settings, seed=5)
  _assert_same(got, want)
  assert len(set(want.lengths.tolist())) >= 5  # answers of very different lengths
  assert want.stopped.any() or setting["temperature"] > 0  # greedy: some on a stop token
  assert got.inserts.tolist() == [1] * len(prompts) and got.preemptions == 0
  assert got.max_live == PAGED.num_slots  # 11 prompts through 4 slots: refilled
  assert got.generated_tokens == want.lengths.sum()
  assert got.prefill_rows == len(prompts) - 1  # the 1-token prompt has nothing to prefill


def _host_refill_calls(lengths, slots: int) -> int:
  """Decode calls of a loop that refills slots from the host: one for each step at which
  requests finish while others wait for a slot, then one for the rest."""
  waiting, running, calls = list(lengths[slots:]), list(lengths[:slots]), 0
  while waiting:
    step = min(running)
    running = [n - step for n in running if n > step]
    calls += 1
    while waiting and len(running) < slots:
      running.append(waiting.pop(0))
  return calls + 1


def test_slots_refilled_on_device_need_fewer_host_round_trips(params):
  """With whole decode chunks (the default 64 steps) the queue refills slots inside the
  compiled loop: fewer decode calls than a loop that refills them from the host."""
  engine = rollout.Engine.for_role(
    CONFIG, dataclasses.replace(PAGED, decode_chunk=64), _role([3]), params
  )
  prompts = _prompts(0)
  settings = _settings(params, prompts)
  want = _reference(params, prompts, settings)
  got = engine.generate(prompts, sampling=settings)
  _assert_same(got, want)
  host = _host_refill_calls(want.lengths.tolist(), PAGED.num_slots)
  assert got.decode_calls < host, (got.decode_calls, host)


def test_data2_tensor2_mesh_equals_no_cache_generation(params, paged_2x2):
  prompts = _prompts(1)
  for setting in (rollout.GREEDY, rollout.SamplingParams(temperature=1.0, top_p=0.9)):
    want = _reference(params, prompts, setting, seed=2)
    got = paged_2x2.generate(prompts, sampling=setting, seed=2)
    _assert_same(got, want)


def test_pool_is_split_over_data_and_tensor_and_decode_gathers_no_pages(paged_2x2):
  engine = paged_2x2
  state = engine.init_decode_state()
  pool = state.cache["k"]  # [data replicas, l, kv heads, pages per replica, page, n]
  d, t = 2, 2
  assert pool.shape[0] == d and pool.shape[2] == CONFIG.num_kv_heads
  assert pool.sharding.spec[0] == "data" and pool.sharding.spec[2] == "tensor"
  shards = pool.addressable_shards
  assert {s.device.id for s in shards} == {4, 5, 6, 7}
  per_device = pool.size // (d * t)
  assert all(s.data.size == per_device for s in shards)
  assert len({(s.index[0].start, s.index[2].start) for s in shards}) == d * t  # all distinct
  plan = jax.device_put(engine.paged._host_plan(np.int32(1)), engine.paged.plan_shardings)
  assert set(engine.paged._generate_steps) == {(4, 6), (4, 3), (2, 6), (2, 3)}
  for (size, _), program in engine.paged._generate_steps.items():
    slots = jnp.tile(jnp.arange(size // d, dtype=jnp.int32), d)
    hlo = program.lower(engine.params, state, plan, slots).compile().as_text()
    gathers = re.findall(r"= \w+\[([\d,]*)\]\S* all-gather\(", hlo)
    sizes = [int(np.prod([int(x) for x in shape.split(",") if x])) for shape in gathers]
    # Only small gathers (the sampler's argmax over vocab shards), nothing of a pool's size.
    assert all(size < per_device for size in sizes), sizes


def test_short_prompts_prefill_in_the_smallest_bucket(params, paged):
  """Prompts of at most 8 tokens prefill in the 8-token bucket: the same answers as an engine
  whose one bucket is 16, over half the prefill tokens; the config's buckets reach the engine."""
  prompts = _prompts(7, lengths=(2, 5, 8, 3, 7, 6))
  settings = _settings(params, prompts)
  one_bucket = rollout.Engine.for_role(
    CONFIG, dataclasses.replace(PAGED, prompt_buckets=(16,)), _role([2]), params
  )
  want = one_bucket.generate(prompts, sampling=settings)
  got = paged.generate(prompts, sampling=settings)
  _assert_same(got, want)
  assert got.prefill_calls == want.prefill_calls
  assert want.prefill_tokens % 16 == 0 and got.prefill_tokens * 2 == want.prefill_tokens

  section = RolloutSection(max_prompt_len=100, max_new_tokens=8, min_prompt_bucket=16)
  assert section.prompt_buckets == (16, 32, 64, 100)
  assert cluster.engine_config(section, 0, 1).prompt_buckets == (16, 32, 64, 100)
  assert RolloutSection(max_prompt_len=64).prompt_buckets == (64,)  # the default starts at 128
  assert RolloutSection(max_prompt_len=256, min_prompt_bucket=0).prompt_buckets == (256,)


# ---------------------------------------------------------------------------------------------
# Prefix sharing.


def test_group_samples_prefill_a_prompt_once_and_share_its_pages(params):
  unique = _prompts(2, (13, 9, 16, 6, 11))
  prompts = [p for p in unique for _ in range(4)]  # a GRPO batch: each prompt 4 times
  prompts = prompts[::2] + prompts[1::2]  # wherever they sit in the input
  # Room for the whole batch at once (16 slots + a queue of 16), whole answers reserved at
  # admission: nothing is preempted, and a prompt is never dropped and prefilled again.
  config = dataclasses.replace(PAGED, num_slots=16, prefill_batch_sizes=None, decode_chunk=8)
  shared = rollout.Engine.for_role(CONFIG, config, _role([2]), params)
  alone = rollout.Engine.for_role(
    CONFIG, dataclasses.replace(config, share_prefixes=False), _role([3]), params
  )
  setting = rollout.SamplingParams(temperature=1.0, stop_token_ids=())
  got = shared.generate(prompts, sampling=setting, seed=9)
  ref = alone.generate(prompts, sampling=setting, seed=9)
  want = _reference(params, prompts, setting, seed=9)
  _assert_same(got, ref)
  _assert_same(got, want)
  assert (got.tokens[0] != got.tokens[4]).any()  # the samples of a group differ
  assert got.prefill_rows == len(unique) and ref.prefill_rows == len(prompts)
  assert got.max_pages_in_use < ref.max_pages_in_use


# ---------------------------------------------------------------------------------------------
# Conversations: observations appended, the KV kept.

# Turns end on a stop token; the greedy single-turn answers hold these early on. A pool of
# every conversation's whole sequence in each replica: nothing is preempted.
TURNS = dataclasses.replace(PAGED, max_new_tokens=20, decode_chunk=4, num_pages=2 * (6 * 9 + 1))


class _Turns:
  """A deterministic environment for every request: up to 3 turns, observations of 1 to 6
  tokens (page boundaries crossed) derived from the turn the model just took."""

  def __init__(self):
    self.calls = []

  def __call__(self, index, tokens, stopped, room):
    self.calls.append((index, tokens.tolist(), stopped, room))
    turns = sum(1 for c in self.calls if c[0] == index)
    m = 1 + (index + 2 * turns) % 6
    if turns >= 3 or m >= room:
      return None
    return [(int(tokens.sum()) + 17 * k + index) % CONFIG.vocab_size for k in range(m)]


def _turn_settings(params, prompts, sample):
  greedy = _reference(params, prompts, max_new_tokens=TURNS.max_new_tokens).tokens
  return [
    rollout.SamplingParams(**sample, stop_token_ids=tuple(int(t) for t in ref[[1, 3, 4]]))
    for ref in greedy
  ]


@pytest.mark.parametrize(
  "sample", [dict(temperature=0.0), dict(temperature=1.0, top_k=2)], ids=["greedy", "top_k"]
)
@pytest.mark.parametrize(
  ("devices", "data", "tensor", "pages", "turn_tokens"),
  [([1], 1, 1, None, 0), ([4, 5, 6, 7], 2, 2, None, 5), ([3], 1, 1, 11, 0)],
  ids=["one_device", "data2_tensor2_turn_limit", "small_pool"],
)
def test_conversations_keep_their_kv_and_equal_no_cache_generation(
  params, sample, devices, data, tensor, pages, turn_tokens
):
  """Each request's observations are appended and it decodes on from its own pages: tokens
  and log-probs equal generation without a cache over prompt + response + observations; the
  prompts are prefilled once and only the new tokens' KV is computed (no re-prefill of the
  history), unless a small pool preempts (then prefilled again, with the same tokens). A turn
  ends on a stop token or at its own token limit."""
  config = TURNS if pages is None else dataclasses.replace(TURNS, num_pages=pages)
  engine = rollout.Engine.for_role(CONFIG, config, _role(devices, data, tensor), params)
  prompts = _prompts(7, (5, 9, 16, 3, 12, 7))
  settings = _turn_settings(params, prompts, sample)
  want_turns, got_turns = _Turns(), _Turns()
  want = rollout_reference.generate(
    CONFIG, params, prompts, settings, seed=3, max_new_tokens=config.max_new_tokens,
    turn=want_turns, turn_tokens=turn_tokens,
  )  # fmt: skip
  got = engine.generate(prompts, sampling=settings, seed=3, turn=got_turns, turn_tokens=turn_tokens)
  _assert_same(got, want)
  np.testing.assert_array_equal(got.observed, want.observed)
  assert sorted(got_turns.calls) == sorted(want_turns.calls)
  turns = 1 + np.asarray([sum(1 for c in got_turns.calls if c[0] == i) - 1 for i in range(6)])
  assert turns.max() == 3 and (turns > 1).sum() >= 3  # conversations, not one-turn answers
  if turn_tokens:  # some turns ended at their limit, not on a stop token, and went on
    assert any(not stop and len(t) == turn_tokens and room for _, t, stop, room in got_turns.calls)
  # The trajectory is the sampled tokens and the observations, as they were given.
  for index, tokens, _, _ in got_turns.calls:
    row = got.tokens[index, : got.lengths[index]].tolist()
    assert any(row[i : i + len(tokens)] == tokens for i in range(len(row)))
  assert (got.versions[got.observed] == -1).all() and (got.logprobs[got.observed] == 0).all()
  assert got.generated_tokens == int((got.mask & ~got.observed).sum())
  observations = int(got.observed.sum())
  if pages is None:
    assert got.preemptions == 0
    assert got.prefill_rows == len(prompts)  # each prompt once: the history never again
    assert got.extended_tokens == observations  # the turn's last token + all but the last
    assert 0 < got.extend_calls <= sum(turns - 1)
  else:
    assert got.preemptions > 0 or got.prefill_rows > len(prompts)


class _Meeting(_Turns):
  """`_Turns` called from `concurrency` threads (`paging.TurnFn`), whose first call of every
  request waits until all `parties` requests are in theirs: it returns only if the engine
  calls them at the same time (one by one, the first waits alone until the barrier's time-out
  breaks it: a failure, never a pass)."""

  def __init__(self, parties):
    super().__init__()
    self.concurrency = parties
    self.barrier = threading.Barrier(parties, timeout=120)
    self.lock = threading.Lock()
    self.threads = set()

  def __call__(self, index, tokens, stopped, room):
    with self.lock:
      first = all(c[0] != index for c in self.calls)
      self.threads.add(threading.get_ident())
    if first:
      self.barrier.wait()
    with self.lock:
      return super().__call__(index, tokens, stopped, room)


def test_turns_ended_in_one_decode_call_are_taken_at_once_with_the_same_result(params):
  """A `TurnFn` with `concurrency` 4 (an environment waiting on a tool): the 4 requests end
  their first turn at its 3-token limit in the same decode call, and their 4 calls run at once
  (they meet at a barrier); the tokens, observations and calls are those of the calls made one
  by one."""
  engine = rollout.Engine.for_role(CONFIG, TURNS, _role([1]), params)
  prompts = _prompts(11, (5, 9, 16, 3))
  one_by_one, at_once = _Turns(), _Meeting(4)
  want = engine.generate(prompts, sampling=rollout.GREEDY, seed=3, turn=one_by_one, turn_tokens=3)
  got = engine.generate(prompts, sampling=rollout.GREEDY, seed=3, turn=at_once, turn_tokens=3)
  assert len(at_once.threads) == 4
  _assert_same(got, want)
  np.testing.assert_array_equal(got.observed, want.observed)
  assert sorted(at_once.calls) == sorted(one_by_one.calls)
  assert all(len(c[1]) == 3 for c in one_by_one.calls[:4])  # every first turn at its limit


def test_conversations_move_to_the_tail_engine_with_their_observations(params):
  """With tail compaction the running conversations move to the tail engine, prefilled again
  there with their observations, and go on taking turns there (a turn's observation extends
  its KV on the tail engine): the same tokens. A conversation's next turn queues on its own
  'data' replica, so the other replica may have a slot no queued request can take: the decode
  call before the move still runs (it once returned at once, with no step, and the stream
  stopped)."""
  # Room for turns after the move (at 20 new tokens every conversation moved has used its own).
  config = dataclasses.replace(
    TURNS, tail_threshold=0.75, max_new_tokens=32, num_pages=4 * (6 * 9 + 1)
  )
  engine = rollout.Engine.for_role(CONFIG, config, _role([4, 5, 6, 7], 2, 2), params)
  prompts = _prompts(7, (5, 9, 16, 3, 12, 7))
  settings = _turn_settings(params, prompts, dict(temperature=0.0))
  want = rollout_reference.generate(
    CONFIG, params, prompts, settings, seed=3, max_new_tokens=config.max_new_tokens,
    turn=_Turns(),
  )  # fmt: skip
  got_turns = _Turns()
  stream, groups = _stream(engine, prompts, sampling=settings, seed=3, turn=got_turns, min_yield=1)
  assert stream.stats.compactions == [3]
  tail = engine.compactor.engines[3]
  assert any(name.startswith("extend") for name in tail.compilations), tail.compilations
  for g in groups:
    np.testing.assert_array_equal(g.tokens, want.tokens[g.indices])
    np.testing.assert_array_equal(g.observed, want.observed[g.indices])
    np.testing.assert_allclose(g.logprobs, want.logprobs[g.indices], atol=ATOL, rtol=0)


# ---------------------------------------------------------------------------------------------
# Admission by pages, preemption, pages returned.


def test_small_pool_runs_more_live_rows_than_dense_in_the_same_memory(params):
  """A long-tailed mix: most answers are short, a few run to the cache's capacity. In the
  memory of 4 dense rows (a pool of one page per row, a whole sequence each) small pages keep
  many more requests decoding at once."""
  base = dict(prompt_buckets=(8,), max_new_tokens=24)
  dense_cfg = rollout.EngineConfig(
    num_slots=4, page_size=32, share_prefixes=False, prefill_batch_sizes=(1, 4), **base
  )
  w = -(-dense_cfg.cache_length // 4)
  paged_cfg = rollout.EngineConfig(
    num_slots=16,
    page_size=4,
    num_pages=4 * w + 1,
    decode_chunk=4,
    prefill_batch_sizes=(1, 4, 16),
    **base,
  )
  dense4 = rollout.Engine.for_role(CONFIG, dense_cfg, _role([0]), params)
  paged16 = rollout.Engine.for_role(CONFIG, paged_cfg, _role([2]), params)
  lengths = tail_lengths(32, mean=5.0, max_len=24, tail_fraction=0.1, tail_ratio=6.0, seed=0)
  prompts = _prompts(3, [int(n) for n in np.random.default_rng(4).integers(2, 9, 32)])
  settings = [
    rollout.SamplingParams(temperature=0.0, max_new_tokens=int(n), stop_token_ids=())
    for n in lengths
  ]
  want = dense4.generate(prompts, sampling=settings)
  _assert_same(want, _reference(params, prompts, settings, max_new_tokens=24))
  stream, groups = _stream(paged16, prompts, sampling=settings, min_yield=16)
  for g in groups:
    np.testing.assert_array_equal(g.tokens, want.tokens[g.indices])
    np.testing.assert_allclose(g.logprobs, want.logprobs[g.indices], atol=ATOL, rtol=0)
  got = stream.stats
  assert lengths.max() == 24 and np.median(lengths) <= 5
  assert want.max_live == 4
  assert got.max_live >= 2 * want.max_live, got.max_live
  assert got.max_pages_in_use <= paged_cfg.num_pages - 1
  assert stream.scheduler.all_pages_free


def test_live_batch_follows_the_live_rows_down_the_tail(params):
  """Once the queue is empty the decode calls run ever smaller live batches (and narrower page
  tables) as the long tail's rows finish; the outputs are those of calls that always run every
  slot at the full width, and each program compiles once."""
  config = rollout.EngineConfig(
    num_slots=16,
    prompt_buckets=(8,),
    max_new_tokens=24,
    page_size=4,
    decode_chunk=4,
    prefill_batch_sizes=(1, 4, 16),
  )
  lengths = tail_lengths(32, mean=5.0, max_len=24, tail_fraction=0.1, tail_ratio=6.0, seed=1)
  prompts = _prompts(10, [int(n) for n in np.random.default_rng(5).integers(2, 9, 32)])
  settings = [
    rollout.SamplingParams(temperature=1.0, max_new_tokens=int(n), stop_token_ids=())
    for n in lengths
  ]
  shrinking = rollout.Engine.for_role(CONFIG, config, _role([2]), params)
  fixed = rollout.Engine.for_role(CONFIG, config, _role([3]), params)
  fixed.paged.batch_sizes, fixed.paged.widths = (16,), (fixed.paged.width,)
  got = shrinking.generate(prompts, sampling=settings, seed=4)
  want = fixed.generate(prompts, sampling=settings, seed=4)
  _assert_same(got, want)
  assert shrinking.paged.batch_sizes == (16, 8, 4, 2, 1)
  assert set(want.decode_steps_by_batch) == {16}
  steps = got.decode_steps_by_batch
  assert min(steps) <= 2 and steps[min(steps)] > 0, steps  # the last rows decode alone
  assert sum(steps.values()) == want.decode_steps_by_batch[16]  # the same steps, fewer rows
  assert sum(n * k for k, n in steps.items()) < 16 * want.decode_steps_by_batch[16] / 2
  decode = _decode_programs(shrinking)
  assert set(decode.values()) == {1} and len(decode) <= len(shrinking.paged._generate_steps)
  before = dict(shrinking.compilations)
  again = shrinking.generate(prompts, sampling=settings, seed=4)
  _assert_same(again, got)
  assert shrinking.compilations == before


def test_preemption_recomputes_and_keeps_greedy_tokens(params):
  """A pool of one full row plus 2 pages: running rows outgrow it, the youngest are evicted,
  re-prefilled with the tokens they had and continue as if never stopped."""
  w = PAGED.pages_per_sequence
  tiny = dataclasses.replace(PAGED, num_pages=w + 3)
  engine = rollout.Engine.for_role(CONFIG, tiny, _role([3]), params)
  prompts = _prompts(5, (15, 12, 16, 9, 13, 3, 4, 16))
  setting = rollout.SamplingParams(temperature=0.0, stop_token_ids=())
  want = _reference(params, prompts, setting)
  stream, groups = _stream(engine, prompts, sampling=setting)
  assert stream.stats.preemptions > 0 and max(stream.stats.inserts) > 1
  assert stream.scheduler.counters.recomputed_tokens > 0  # evicted mid-answer
  for g in groups:
    np.testing.assert_array_equal(g.tokens, want.tokens[g.indices])
    np.testing.assert_allclose(g.logprobs, want.logprobs[g.indices], atol=ATOL, rtol=0)
  assert stream.scheduler.all_pages_free
  # A 16-token prompt + its tokens outgrew the prompt buckets: re-prefilled in one bucket of
  # the cache length, a third prefill shape; the decode programs are the live-batch sizes and
  # widths the stream used, each compiled once (at most all of them).
  assert engine.compilations["prefill"] == 3
  decode = _decode_programs(engine)
  assert set(decode.values()) == {1} and 1 < len(decode) <= len(engine.paged._generate_steps)


def test_every_page_is_returned_and_programs_compile_once(params, paged):
  prompts = _prompts(6)
  settings = _settings(params, prompts, temperature=1.0)
  before = paged.warmup()
  # Live batches of 4, 2 and 1 slots, page tables of 6 and 3 pages (16 + 8 tokens in pages of
  # 4; the floor: an 8-token bucket and a 3-step chunk).
  assert paged.paged.batch_sizes == (4, 2, 1) and paged.paged.widths == (6, 3)
  decode = _decode_programs(paged)
  assert len(decode) == 6 and set(decode.values()) == {1}
  assert before == {"init_decode_state": 1, "prefill": 4, "insert": 4, **decode}
  for seed in range(2):
    stream, _ = _stream(paged, prompts, sampling=settings, seed=seed, min_yield=1)
    assert stream.scheduler.all_pages_free
    assert all((pool.refs[1:] == 0).all() for pool in stream.scheduler.pools)
  assert paged.compilations == before


# ---------------------------------------------------------------------------------------------
# Weights that change mid-stream.


def test_weights_swapped_between_decode_calls_apply_from_the_next_call(params):
  config = dataclasses.replace(PAGED, decode_chunk=2)
  engine = rollout.Engine.for_role(CONFIG, config, _role([0]), params)
  prompts = _prompts(7, (5, 9, 3, 12))
  setting = [
    rollout.SamplingParams(temperature=0.0, max_new_tokens=n, stop_token_ids=())
    for n in (3, 8, 6, 8)
  ]
  old = engine.generate(prompts, sampling=setting)
  v0 = engine.params_version
  assert (old.versions[old.mask] == v0).all() and (old.versions[~old.mask] == -1).all()
  new_params = models.init_params(CONFIG, "lm", jax.random.key(9))
  stream = rollout.RolloutStream(engine, prompts, sampling=setting)
  tokens, versions = {}, {}
  try:
    for group in stream:  # every call decodes at most 2 steps: swap after the first output
      if engine.params_version == v0:
        engine.update_params(new_params)
      for j, i in enumerate(group.indices):
        tokens[int(i)], versions[int(i)] = group.tokens[j], group.versions[j]
  finally:
    engine.update_params(params)
  assert engine.params_version == v0 + 2
  switched = 0
  for i in range(len(prompts)):
    v = versions[i][: old.lengths[i]]
    assert set(v.tolist()) <= {v0, v0 + 1} and (np.diff(v) >= 0).all()
    before = int((v == v0).sum())
    switched += before < len(v)
    # Tokens sampled before the swap are the old weights' greedy tokens.
    np.testing.assert_array_equal(tokens[i][:before], old.tokens[i][:before])
  assert switched > 0


# ---------------------------------------------------------------------------------------------
# The slot API, kernels, config.


def test_slot_api_gives_each_slot_a_dense_rows_pages(params, paged):
  prompts = _prompts(8, (4, 11, 1))
  setting = rollout.SamplingParams(temperature=0.0, max_new_tokens=3)
  state = paged.init_decode_state()
  state = paged.insert(paged.prefill(prompts, setting), state, [3, 1, 0])
  state, _ = paged.generate_steps(state)
  got = paged.read(state)
  want = _reference(params, prompts, setting)
  for i, s in enumerate((3, 1, 0)):
    assert got.tokens[s, :3].tolist() == want.tokens[i].tolist()
    np.testing.assert_allclose(got.logprobs[s, :3], want.logprobs[i], atol=ATOL, rtol=0)
  assert got.done.all() and got.num_generated[[3, 1, 0]].tolist() == [3, 3, 3]
  # The paged prefill samples nothing: the first decode step draws the first token.
  state = paged.insert(paged.prefill(prompts[:1], setting), paged.init_decode_state(), [2])
  state, steps = paged.generate_steps(state, max_steps=1)
  view = paged.read(state)
  assert int(steps) == 1 and view.num_generated[2] == 1 and view.tokens[2, 0] == want.tokens[0, 0]
  table = paging.slot_pages(4, 1, 25, 6)
  assert table[1].tolist() == list(range(7, 13)) and table.max() == 24


@pytest.mark.parametrize(("kernel", "width"), [("pallas_gpu", 4), ("pallas_gpu", 6),
                                               ("pallas_tpu", 6)])  # fmt: skip
def test_pallas_kernels_in_interpret_mode_equal_the_gather_path(kernel, width):
  """JAX's Pallas paged-attention kernels, run by Pallas' interpreters on the CPU, against the
  gather + XLA attention path, on a pool with two replicas (6 pages a row: 3 key splits of
  2-page blocks on GPU, one 6-page block on TPU). The TPU kernel reads keys and values as bf16
  (what 'auto' picks it for: a bf16 pool), so the pool here holds bf16 values in fp32."""
  rng = np.random.default_rng(0)
  layers, d, k, e, n, h = 2, 2, 2, 4, 16, 4
  pages = 2 * width + 1
  pool = lambda: jnp.asarray(rng.normal(size=(layers, d, k, pages, e, n)), jnp.bfloat16).astype(
    jnp.float32
  )
  table = rng.permutation(np.arange(1, pages))[: 2 * width].reshape(2, width).repeat(2, 0)
  table = jnp.asarray(table)
  index = jnp.asarray([0, 5, 11, width * e - 1])
  q = jnp.asarray(rng.normal(size=(4, 1, h, n)), jnp.float32)
  cfg = CONFIG.replace(attention="xla")
  slots = jnp.broadcast_to(jnp.arange(width * e), (4, width * e))
  mask = models.Mask.over_keys(jnp.ones((4, 1)), index[:, None], slots <= index[:, None], slots)
  k_pool, v_pool = pool(), pool()
  outs = {}
  for name in ("gather", kernel):
    with pltpu.force_tpu_interpret_mode() if name == "pallas_tpu" else contextlib.nullcontext():
      kv = transformer.PagedKV(k_pool, v_pool, table, name)
      outs[name] = transformer.paged_attend(cfg, q, kv, jnp.int32(1), mask, index)
  np.testing.assert_allclose(outs[kernel], outs["gather"], atol=1e-5, rtol=0)


def test_auto_and_pallas_resolve_to_a_kernel_that_can_run():
  """'auto' takes the platform's Pallas kernel only where it runs (on TPU with a bf16 pool);
  'pallas' where it cannot is one line naming why and what works."""
  resolve = paged_engine.resolve_kernel
  assert resolve("auto", "gpu", None, 64) == resolve("pallas", "gpu", None, 64) == "pallas_gpu"
  assert resolve("auto", "tpu", None, 128, "bfloat16") == "pallas_tpu"
  assert resolve("auto", "tpu", None, 128, "float32") == "gather"  # the kernel rounds to bf16
  assert resolve("pallas", "tpu", None, 128, "float32") == "pallas_tpu"  # asked for
  assert resolve("auto", "cpu", None, 64) == resolve("auto", "gpu", 8, 64) == "gather"
  assert resolve("auto", "gpu", None, 24) == resolve("gather", "gpu", None, 64) == "gather"
  for platform, window, head_dim, why in (
    ("cpu", None, 64, "the rollout's devices are cpu, it needs a GPU or TPU"),
    ("gpu", 8, 64, "the model has a sliding window"),
    ("tpu", None, 24, "the head dim 24 is not a multiple of 16"),
  ):
    with pytest.raises(ValueError, match=f"^rollout.attention='pallas' cannot run here: {why}"):
      resolve("pallas", platform, window, head_dim)


def test_pallas_gpu_blocks_are_powers_of_two_that_tile_the_row():
  for width in range(1, 300):
    splits, per_block = transformer.gpu_kernel_blocks(width)
    assert per_block in (1, 2, 4, 8) and splits <= 16
    assert width % (splits * per_block) == 0
  assert transformer.gpu_kernel_blocks(128) == (16, 8)  # bench_gpu: 2048 tokens, 16 a page
  assert transformer.gpu_kernel_blocks(36) == (9, 4)


def test_pallas_gpu_kernel_runs_the_engine_per_shard_on_a_data_tensor_mesh():
  """The engine with 'pallas_gpu' (interpret mode here, under `jax.shard_map` over data=2 x
  tensor=2) samples what the gather path samples."""
  cfg = CONFIG.replace(head_dim=16)
  params = models.init_params(cfg, "lm", jax.random.key(4))
  prompts = _prompts(9, (3, 16, 7, 1, 12))
  setting = rollout.SamplingParams(temperature=1.0, max_new_tokens=5)
  outs = [
    rollout.Engine.for_role(
      cfg, dataclasses.replace(PAGED, paged_attention=kernel), _role([4, 5, 6, 7], 2, 2), params
    ).generate(prompts, sampling=setting, seed=3)
    for kernel in ("gather", "pallas_gpu")
  ]
  _assert_same(outs[1], outs[0])


def test_bad_paged_configs_raise_one_line_errors(params):
  for field, bad in (("page_size", 0), ("decode_chunk", 0), ("num_pages", 1)):
    with pytest.raises(ValueError, match=f"EngineConfig.{field}"):
      dataclasses.replace(PAGED, **{field: bad})
  with pytest.raises(ValueError, match="EngineConfig.paged_attention"):
    dataclasses.replace(PAGED, paged_attention="flash")
  with pytest.raises(ValueError, match="devices are cpu, it needs a GPU or TPU; set rollout"):
    rollout.Engine.for_role(CONFIG, dataclasses.replace(PAGED, paged_attention="pallas"),
                            _role([0]))  # fmt: skip
  with pytest.raises(ValueError, match="EngineConfig.num_pages=6 gives 6 pages per 'data'"):
    rollout.Engine.for_role(CONFIG, dataclasses.replace(PAGED, num_pages=6), _role([0]))
  with pytest.raises(ValueError, match="multiple of the mesh's 'data' axis"):
    rollout.Engine.for_role(CONFIG, dataclasses.replace(PAGED, num_pages=21), _role([0, 1], 2))
  with pytest.raises(ValueError, match="sliding window"):
    rollout.Engine.for_role(
      CONFIG.replace(sliding_window=4),
      dataclasses.replace(PAGED, paged_attention="pallas_gpu"),
      _role([0]),
    )
  small = rollout.Engine.for_role(
    CONFIG, dataclasses.replace(PAGED, num_pages=10), _role([0]), params
  )
  with pytest.raises(ValueError, match="slot API gives every slot a dense row of pages"):
    small.insert(small.prefill([[1, 2]]), small.init_decode_state(), [3])


@pytest.mark.parametrize("window", [None, 3])
def test_prefix_shapes_are_the_prefills_without_tracing_the_model(window):
  """The engine's prefill shardings come from `prefix_shapes`: every field's shape and dtype
  is the prefill's own (grouped-query heads, a sliding window, a bf16 cache)."""
  config = CONFIG.replace(sliding_window=window, dtype="bfloat16")
  m, p = 3, 5
  requests = paged_decode.Requests(
    tokens_bp=jax.ShapeDtypeStruct((m, p), jnp.int32),
    lengths_b=jax.ShapeDtypeStruct((m,), jnp.int32),
    last_b=jax.ShapeDtypeStruct((m,), jnp.int32),
    max_new_b=jax.ShapeDtypeStruct((m,), jnp.int32),
    stop_bm=jax.ShapeDtypeStruct((m, 2), jnp.int32),
    temperature_b=jax.ShapeDtypeStruct((m,), jnp.float32),
    top_k_b=jax.ShapeDtypeStruct((m,), jnp.int32),
    top_p_b=jax.ShapeDtypeStruct((m,), jnp.float32),
    seed_b=jax.ShapeDtypeStruct((m,), jnp.int32),
    request_id_b=jax.ShapeDtypeStruct((m,), jnp.int32),
  )
  params = models.abstract_params(config)
  want = jax.eval_shape(functools.partial(paged_decode.prefill, config), params, requests)
  got = paged_decode.prefix_shapes(config, requests)
  assert jax.tree.structure(got) == jax.tree.structure(want)
  assert jax.tree.leaves(got) == jax.tree.leaves(want)
  assert got.cache["k"].dtype == jnp.bfloat16 and config.num_kv_heads < config.num_heads


def test_page_pool_counts_references():
  pool = paging.PagePool(5)
  a = pool.alloc(3)
  assert 0 not in a and pool.num_free == 1 and pool.in_use == 3
  pool.retain(a[:1])
  pool.release(a)
  assert pool.num_free == 3 and pool.refs[a[0]] == 1
  with pytest.raises(RuntimeError, match="released more often"):
    pool.release(a[1:2])
  with pytest.raises(RuntimeError, match="pages asked"):
    pool.alloc(4)


@pytest.mark.parametrize(
  ("live", "attention"),
  [(None, "xla"), ((2, 16), "xla"), (None, "auto")],
  ids=["all_slots", "live_batch", "cpu_decode_attention"],
)
def test_decode_call_writes_the_pool_in_place(live, attention):
  """A decode call updates the pool in place: donated, aliased, never copied whole (also by a
  live batch of half the slots and half the table width, whose rows are gathered from the
  state and scattered back, and with the CPU's decode attention over the pages, 'auto'), in
  XLA's default CPU code generation, which users' runs get (the suite's workers compile with
  faster settings, tests/conftest.py)."""
  layers, b, length, e = 5, 4, 512, 16
  w = length // e
  pages = b * w + 1
  cfg = get_model_config("tiny", num_layers=layers, attention=attention)
  table = paging.slot_pages(b, 1, pages, w)
  state = jax.eval_shape(
    lambda: paged_decode.empty_state(
      cfg,
      num_slots=b,
      replicas=1,
      pages=pages,
      page_size=e,
      width=w,
      out_rows=2 * b + 1,
      max_new_tokens=16,
      max_stop_tokens=4,
      table_bw=table,
    )
  )
  plan = jax.eval_shape(lambda: paged_decode.idle_plan(table, 1, 4, np.int32(1)))
  size, width = live or (b, w)
  step = jax.jit(
    functools.partial(paged_decode.generate_steps, cfg, "gather", width=width), donate_argnums=1
  )
  slots = jax.ShapeDtypeStruct((size,), jnp.int32)
  compiled = step.lower(models.abstract_params(cfg, "lm"), state, plan, slots).compile(
    compiler_options={"xla_backend_optimization_level": 3, "xla_cpu_use_fusion_emitters": True}
  )
  pool_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.cache))
  stats = compiled.memory_analysis()
  assert stats.alias_size_in_bytes >= pool_bytes
  assert stats.temp_size_in_bytes < pool_bytes / 2, (stats.temp_size_in_bytes, pool_bytes)
  whole = f"f32[1,{layers},{cfg.num_kv_heads},{pages},{e},{cfg.head_dim}]"
  ops = re.findall(rf"= {re.escape(whole)}\{{[0-9,]*\}} ([a-z\-]+)\(", compiled.as_text())
  assert ops and not {"copy", "dynamic-update-slice", "broadcast", "transpose"} & set(ops), ops
