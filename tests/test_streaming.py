"""Streaming rollout, tail compaction and fused scoring against the batch-at-a-time path."""

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
  """8 slots over data=4 on devices 0-3, no compaction: the batch path."""
  return _engine(params, [0, 1, 2, 3], 4, 1)


@pytest.fixture(scope="module")
def compacting(params):
  """The same mesh, compacting once at most half the slots run (the dense engine's)."""
  return _engine(params, [0, 1, 2, 3], 4, 1, tail_threshold=0.5, paged=False)


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


def test_compacted_tail_gives_the_same_tokens_and_logprobs_and_compiles_once_per_size(
  plain, compacting
):
  prompts = _prompts(1)
  want = plain.generate(prompts, sampling=SAMPLING, seed=3)
  assert compaction.allowed_sizes(8) == (4, 2, 1)
  for _ in range(2):
    with jax.transfer_guard("disallow"):  # compaction moves rows device to device only
      got = compacting.generate(prompts, sampling=SAMPLING, seed=3)
    for field in ("tokens", "lengths", "mask", "stopped", "inserts"):
      np.testing.assert_array_equal(getattr(got, field), getattr(want, field))
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5, rtol=0)
  # Request 3 (13 tokens: 12 decode steps after the dense prefill's first token; 13 in the
  # paged engine, whose first decode step samples it) starts at step 0 and is the last to end;
  # request 6 (11 tokens) ends 2 steps before it, so request 3 runs its last 2 steps alone on 1
  # slot. (The paged reference's live batch shrinks too, on its own mesh, as rows finish.)
  assert sum(want.decode_steps_by_batch.values()) == 13 and 8 in want.decode_steps_by_batch
  assert sum(got.decode_steps_by_batch.values()) == 12
  assert got.decode_steps_by_batch[1] == 2 and set(got.decode_steps_by_batch) == {8, 4, 2, 1}
  streamed = rollout.RolloutStream(compacting, prompts, sampling=SAMPLING, seed=3)
  _, order = _collect(streamed)
  assert sorted(order.tolist()) == list(range(len(prompts)))
  assert streamed.stats.compactions == [4, 2, 1]
  counts = compacting.compilations
  for size in (4, 2, 1):
    assert counts[f"compact[{size}]"] == counts[f"generate_steps[{size}]"] == 1
  assert counts["generate_steps"] == 1
  assert compacting.warmup() == counts | {"init_decode_state": 1, "prefill": 2, "insert": 2}


def test_compacted_cache_moves_to_fewer_replicas_with_the_rows_it_held(params):
  engine = _engine(params, [4, 5, 6, 7], 2, 2, tail_threshold=0.5, paged=False)  # data x tensor
  prompts = _prompts(2, 8)
  state = engine.init_decode_state()
  setting = rollout.SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, stop_token_ids=())
  state = engine.insert(engine.prefill(prompts, setting), state, range(8))
  state, _ = engine.generate_steps(state, max_steps=3)
  before = jax.device_get(state)
  rows = [6, 1, 3]
  small = engine.compactor.shrink(state, 4, rows)
  # 4 rows keep 4 rows per replica: one replica (devices 4, 5), KV heads over 'tensor'.
  k = small.cache["k"]
  assert k.shape == (CONFIG.num_layers, 4, before.cache["k"].shape[2], 2, CONFIG.head_dim)
  assert {s.device.id for s in k.addressable_shards} == {4, 5}
  for shard in k.addressable_shards:
    assert shard.data.shape == (CONFIG.num_layers, 4, k.shape[2], 1, CONFIG.head_dim)
    heads = shard.index[3]
    np.testing.assert_array_equal(
      np.asarray(shard.data)[:, :3], before.cache["k"][:, rows][:, :, :, heads]
    )
  got = jax.device_get(small)
  assert got.done_b.tolist() == [False, False, False, True]
  np.testing.assert_array_equal(got.out_tokens_br[:3], before.out_tokens_br[rows])
  np.testing.assert_array_equal(got.num_generated_b[:3], before.num_generated_b[rows])
  # The weights on the smaller mesh are the engine's own buffers, not copies.
  view = engine.compactor.params(4)
  for full, part in zip(jax.tree.leaves(engine.params), jax.tree.leaves(view), strict=True):
    held = {s.device: s.data.unsafe_buffer_pointer() for s in full.addressable_shards}
    for s in part.addressable_shards:
      assert s.data.unsafe_buffer_pointer() == held[s.device]
  tiny = engine.compactor.shrink(small, 2, [0, 2])
  assert {s.device.id for s in tiny.cache["v"].addressable_shards} == {4, 5}
  np.testing.assert_array_equal(jax.device_get(tiny.out_tokens_br), before.out_tokens_br[[6, 3]])


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
  assert config.RolloutSection(tail_threshold=0.25, paged=False).tail_threshold == 0.25
  for bad in (1.0, -0.1):
    with pytest.raises(ValueError, match=r"'rollout.tail_threshold' must be in \[0, 1\)"):
      config.RolloutSection(tail_threshold=bad)
  with pytest.raises(ValueError, match="tail_threshold"):
    rollout.EngineConfig(tail_threshold=1.0)
  with pytest.raises(ValueError, match="tail_threshold"):
    rollout.EngineConfig(tail_threshold=-0.1)
  assert rollout.EngineConfig().paged and not rollout.EngineConfig(tail_threshold=0.5).paged
  with pytest.raises(ValueError, match="tail_threshold > 0 needs paged=False"):
    rollout.EngineConfig(tail_threshold=0.5, paged=True)


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
    assert sum(steps.values()) == lengths.max() - 1  # every request starts at step 0
    # Lengths [1 2 1 5 2 1 1 7]: two requests left (<= 0.25 * 8) go onto 2 slots, then 1.
    assert set(steps) == ({"8", "2", "1"} if r["fused"] else {"8"})
    assert r["tail_s"] <= r["generate_s"] <= r["iteration_s"]
  assert {r["placement"] for r in records if "speedup" in r} == set(fb.PLACEMENTS)
