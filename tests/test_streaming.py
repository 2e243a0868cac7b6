"""Streaming rollout, the tail's move to fewer replicas and fused scoring against the
batch-at-a-time path."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlhfjax import config, models, rollout
from rlhfjax.bench import fusion_bench as fb
from rlhfjax.config.model import get_model_config
from rlhfjax.mesh import meshes
from rlhfjax.placement.spec import RoleSpec
from rlhfjax.rollout import compaction, fused

pytestmark = pytest.mark.unit

CONFIG = get_model_config("tiny")
MAX_NEW = 13
ENGINE = rollout.EngineConfig(
  num_slots=8, prompt_buckets=(7,), max_new_tokens=MAX_NEW, prefill_batch_sizes=(1, 8)
)
# Long-tailed stop lengths: most responses end early, two run to the end.
STOPS = (2, 1, 3, 13, 2, 4, 11, 3, 1, 5, 2)
SAMPLING = [
  rollout.SamplingParams(temperature=1.0, max_new_tokens=n, stop_token_ids=()) for n in STOPS
]


def _prompts(seed, n=11):
  rng = np.random.default_rng(seed)
  return [rng.integers(0, CONFIG.vocab_size, int(k)).tolist() for k in rng.integers(1, 8, n)]


@pytest.fixture(scope="module")
def params():
  return models.init_params(CONFIG, "lm", jax.random.key(3))


def _engine(params, devices, data, tensor, **overrides):
  config = rollout.EngineConfig(**{**ENGINE.__dict__, **overrides})
  spec = RoleSpec.generation(devices, data=data, tensor=tensor)
  return rollout.Engine.for_role(CONFIG, config, spec, params)


@pytest.fixture(scope="module")
def plain(params):
  """8 slots over data=4 on devices 0-3, the tail where it is: the batch path."""
  return _engine(params, [0, 1, 2, 3], 4, 1)


@pytest.fixture(scope="module")
def compacting(params):
  """The same mesh; once at most half the slots run, the tail moves to 4 slots on 2 replicas."""
  return _engine(params, [0, 1, 2, 3], 4, 1, tail_threshold=0.5)


def _collect(stream):
  groups = list(stream)
  return groups, np.concatenate([g.indices for g in groups])


def test_stream_hands_out_each_sample_once_as_it_finishes_like_the_batch(plain):
  prompts = _prompts(0)
  want = plain.generate(prompts, sampling=SAMPLING, seed=7)
  stream = rollout.RolloutStream(plain, prompts, sampling=SAMPLING, seed=7)
  groups, order = _collect(stream)
  assert sorted(order.tolist()) == list(range(len(prompts)))
  assert stream.stats.inserts.tolist() == [1] * len(prompts)
  # Handed out in the order they finish: short responses first, while the long ones decode.
  finish = [int(g.lengths.max()) for g in groups]
  assert len(groups) > 4 and groups[-1].indices.tolist() == [3]
  assert finish[0] < MAX_NEW
  for g in groups:
    np.testing.assert_array_equal(g.tokens, want.tokens[g.indices])
    np.testing.assert_array_equal(g.lengths, want.lengths[g.indices])
    np.testing.assert_array_equal(g.stopped, want.stopped[g.indices])
    np.testing.assert_allclose(g.logprobs, want.logprobs[g.indices], atol=1e-5, rtol=0)
  assert want.lengths.tolist() == list(STOPS)
  with pytest.raises(RuntimeError, match="iterated once"):
    iter(stream)
  with pytest.raises(ValueError, match="min_yield"):
    rollout.RolloutStream(plain, prompts, min_yield=0)


def test_the_tail_moves_to_fewer_replicas_with_the_same_tokens_and_compiles_once(plain, compacting):
  prompts = _prompts(1)
  want = plain.generate(prompts, sampling=SAMPLING, seed=3)
  assert compaction.replicas_for(4, 8, 4) == 2 and compacting.compactor.rows(0.5) == 4
  counts = []
  for _ in range(2):
    with jax.transfer_guard("disallow"):  # explicit uploads and reads only
      got = compacting.generate(prompts, sampling=SAMPLING, seed=3)
    tail = compacting.compactor.engines[4]
    counts.append((dict(compacting.compilations), dict(tail.compilations)))
    for field in ("tokens", "lengths", "mask", "stopped"):
      np.testing.assert_array_equal(getattr(got, field), getattr(want, field))
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5, rtol=0)
    # The requests still running at the move (at most 4) were inserted once more, there.
    moved = got.inserts - want.inserts
    assert set(moved.tolist()) == {0, 1} and 1 <= moved.sum() <= 4
    assert moved[3] == 1  # request 3 (13 tokens) is the last to end
  # Request 3 starts at step 0 and ends last, at step 13: every step is run once, on the
  # full mesh and then on the tail engine's.
  assert sum(want.decode_steps_by_batch.values()) == 13
  streamed = rollout.RolloutStream(compacting, prompts, sampling=SAMPLING, seed=3)
  _, order = _collect(streamed)
  assert sorted(order.tolist()) == list(range(len(prompts)))
  assert streamed.stats.compactions == [4]
  assert streamed.stats.recomputed_tokens > 0 and streamed.scheduler.all_pages_free
  assert [d.id for d in tail.mesh.devices.flat] == [0, 1]  # the first 2 'data' replicas
  # The engine's and the tail engine's programs compile once: on the first use of each (the
  # streamed run's calls return earlier and decode the tail in smaller live batches).
  assert counts[0] == counts[1] and counts[1][0] == compacting.compilations
  decode = {k: n for k, n in tail.compilations.items() if k.startswith("generate_steps")}
  assert set(decode.values()) == {1} and tail.compilations["prefill"] >= 1


def test_the_tail_engine_keeps_its_pages_on_the_first_replicas_and_reads_the_engines_weights(
  params,
):
  engine = _engine(params, [4, 5, 6, 7], 2, 2, tail_threshold=0.5)  # data x tensor
  prompts = _prompts(2, 8)
  settings = SAMPLING[:8]
  got = rollout.generate(engine, prompts, sampling=settings, seed=1)
  plain = _engine(params, [4, 5, 6, 7], 2, 2)
  want = plain.generate(prompts, sampling=settings, seed=1)
  np.testing.assert_array_equal(got.tokens, want.tokens)
  assert got.inserts.sum() > len(prompts)  # the tail moved
  # 4 slots keep the 4 rows per replica of the full batch: one replica (devices 4 and 5),
  # KV heads over 'tensor'.
  tail = engine.compactor.engines[4]
  pool = tail.init_decode_state().cache["k"]
  assert pool.shape[0] == 1 and {s.device.id for s in pool.addressable_shards} == {4, 5}
  assert {s.index[2].start for s in pool.addressable_shards} == {0, CONFIG.num_kv_heads // 2}
  # Its weights are the engine's own buffers on those devices, not copies.
  for full, part in zip(jax.tree.leaves(engine.params), jax.tree.leaves(tail.params), strict=True):
    held = {s.device: s.data.unsafe_buffer_pointer() for s in full.addressable_shards}
    assert {s.device.id for s in part.addressable_shards} == {4, 5}
    for s in part.addressable_shards:
      assert s.data.unsafe_buffer_pointer() == held[s.device]


@pytest.mark.parametrize("placement", ["disaggregated", "co-located"])
def test_fused_scoring_equals_scoring_the_batch_after_generation(compacting, params, placement):
  prompts = _prompts(3)
  devices = [4, 5, 6, 7] if placement == "disaggregated" else [0, 1, 2, 3]
  mesh = meshes.make_mesh(RoleSpec.generation(devices, data=4, tensor=1))
  scorer = fused.logprob_scorer(CONFIG, params, mesh, [np.asarray(q) for q in prompts], MAX_NEW)
  out = compacting.generate(prompts, sampling=SAMPLING, seed=9)
  whole = np.asarray(
    scorer(
      fused.MicroBatch(
        indices=np.arange(len(prompts)),
        tokens=out.tokens,
        logprobs=out.logprobs,
        lengths=out.lengths,
        stopped=out.stopped,
        num_real=len(prompts),
      )
    )
  )
  calls = []
  stream = rollout.RolloutStream(compacting, prompts, sampling=SAMPLING, seed=9)
  got = fused.score_stream(
    stream, scorer, num_samples=len(prompts), micro_batch=4, on_score=calls.append
  )
  assert {s.device.id for s in got.addressable_shards} == set(devices)
  np.testing.assert_allclose(np.asarray(got), whole, atol=1e-5, rtol=0)
  # Micro-batches went out while the long requests were still decoding.
  assert len(calls) == 3 and [c.num_real for c in calls] == [4, 4, 3]
  assert 3 not in calls[0].indices and 3 in calls[-1].indices[: calls[-1].num_real]
  # Sanity: the reference log-probs are those the sampler reported (same weights, T = 1).
  np.testing.assert_allclose(np.asarray(got), out.logprobs, atol=1e-4, rtol=0)


def test_score_stream_rejects_a_stream_that_repeats_or_misses_samples():
  one = rollout.Finished(
    indices=np.array([0]),
    tokens=np.zeros((1, 2), np.int32),
    logprobs=np.zeros((1, 2), np.float32),
    lengths=np.array([1], np.int32),
    stopped=np.array([False]),
  )
  score = lambda b: jnp.asarray(b.lengths)
  with pytest.raises(ValueError, match="twice"):
    fused.score_stream([one, one], score, num_samples=2, micro_batch=1)
  with pytest.raises(ValueError, match="never handed out samples \\[1\\]"):
    fused.score_stream([one], score, num_samples=2, micro_batch=1)


def test_tail_threshold_is_validated():
  assert config.RolloutSection(tail_threshold=0.25).tail_threshold == 0.25
  for bad in (1.0, -0.1):
    with pytest.raises(ValueError, match=r"'rollout.tail_threshold' must be in \[0, 1\)"):
      config.RolloutSection(tail_threshold=bad)
  with pytest.raises(ValueError, match="tail_threshold"):
    rollout.EngineConfig(tail_threshold=1.0)
  with pytest.raises(ValueError, match="tail_threshold"):
    rollout.EngineConfig(tail_threshold=-0.1)


def test_bench_lengths_have_the_asked_tail():
  big = fb.FusionBench(batch=5_000, mean_len=40.0, max_len=10**6, tail_ratio=8.0, seed=1)
  stats = fb.length_stats(fb.tail_lengths(big), big.tail_ratio)
  assert abs(stats["fraction_at_least_ratio_x_median"] - 0.1) < 0.01
  assert abs(stats["mean"] / 40.0 - 1) < 0.1
  capped = fb.tail_lengths(dataclasses.replace(big, max_len=50))
  assert capped.max() == 50 and capped.min() >= 1
  with pytest.raises(ValueError, match="unknown placements"):
    fb.FusionBench(placements=("sideways",))


@pytest.mark.slow
def test_bench_reports_every_key_per_placement_and_mode():
  bench = fb.FusionBench(
    size="tiny", batch=8, prompt_len=5, mean_len=4.0, max_len=24, micro_batch=4, repeats=1
  )
  records = fb.run(bench)
  keys = {"placement", "fused", "iteration_s", "generate_s", "tail_s", "idle_fraction"}
  rows = [r for r in records if "fused" in r]
  assert [(r["placement"], r["fused"]) for r in rows] == [
    (p, f) for p in fb.PLACEMENTS for f in (False, True)
  ]
  lengths = fb.tail_lengths(bench)
  assert lengths.tolist() == [1, 2, 1, 5, 2, 1, 1, 7]
  for r in rows:
    assert keys | {"decode_steps_by_batch"} <= set(r)
    steps = r["decode_steps_by_batch"]
    assert sum(steps.values()) == lengths.max()  # every request starts at step 0
    # Lengths [1 2 1 5 2 1 1 7]: fused, the two requests left after 2 steps (<= 0.25 * 8)
    # move to a tail engine of 2 slots on one replica; unfused, the live batch only halves
    # where every replica's rows fit (disaggregated: 4 replicas of 2 rows; co-located: 8 of 1).
    assert r["tail_moves"] == ([2] if r["fused"] else [])
    assert set(steps) == {"8", "2"} if r["fused"] else set(steps) <= {"8", "4"}
    assert r["tail_s"] <= r["generate_s"] <= r["iteration_s"]
  assert {r["placement"] for r in records if "speedup" in r} == set(fb.PLACEMENTS)
