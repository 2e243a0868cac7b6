"""The rollout engine against a no-cache reference, across meshes, slots, seeds and settings."""

import jax
import jax.monitoring
import jax.numpy as jnp
import numpy as np
import pytest

from rlhfjax import models, rollout
from rlhfjax.config.model import get_model_config
from rlhfjax.models.logprobs import first_argmax
from rlhfjax.placement.spec import RoleSpec
from rlhfjax.rollout import sampling

pytestmark = pytest.mark.unit

CONFIG = get_model_config("tiny")
ENGINE = rollout.EngineConfig(
  num_slots=4, prompt_buckets=(8, 16), max_new_tokens=8, prefill_batch_sizes=(1, 4)
)
LENGTHS = (1, 3, 8, 9, 13, 16)  # both buckets, and a bucket's exact size


def _role(devices, data, tensor):
  return RoleSpec.generation(devices, data=data, tensor=tensor)


@pytest.fixture(scope="module")
def params():
  return models.init_params(CONFIG, "lm", jax.random.key(1))


@pytest.fixture(scope="module")
def engine(params):
  """4 slots on one device."""
  return rollout.Engine.for_role(CONFIG, ENGINE, _role([0], 1, 1), params)


@pytest.fixture(scope="module")
def engine_2x2(params):
  """4 slots, data=2 x tensor=2 on devices 4-7."""
  return rollout.Engine.for_role(CONFIG, ENGINE, _role([4, 5, 6, 7], 2, 2), params)


@pytest.fixture(scope="module")
def engine_wide(params):
  """12 slots: every test batch fits at once, so nothing is refilled."""
  config = rollout.EngineConfig(
    num_slots=12, prompt_buckets=(8, 16), max_new_tokens=8, prefill_batch_sizes=(1, 4)
  )
  return rollout.Engine.for_role(CONFIG, config, _role([1], 1, 1), params)


def _prompts(seed, lengths=LENGTHS):
  rng = np.random.default_rng(seed)
  return [rng.integers(0, CONFIG.vocab_size, n).tolist() for n in lengths]


def _full_logits(params, prompts, responses, config=CONFIG):
  """Logits of a full forward (no cache) over prompt + response, right padded.

  Always 12 rows of 24 tokens (unused rows are empty), so every call shares one compilation.
  """
  seqs = [list(p) + list(r) for p, r in zip(prompts, responses, strict=True)]
  assert len(seqs) <= 12
  tokens = np.zeros((12, 16 + ENGINE.max_new_tokens), np.int32)
  mask = np.zeros_like(tokens)
  for i, s in enumerate(seqs):
    tokens[i, : len(s)], mask[i, : len(s)] = s, 1
  logits = models.forward_logits(config, params, jnp.asarray(tokens), jnp.asarray(mask))
  return np.asarray(logits)[: len(seqs)]


def _reference_greedy(params, prompts, max_new=ENGINE.max_new_tokens, config=CONFIG):
  """Token-by-token argmax, recomputing the full forward (no cache) for every token."""
  responses = [[] for _ in prompts]
  for _ in range(max_new):
    logits = _full_logits(params, prompts, responses, config)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
      r.append(int(np.argmax(logits[i, len(p) + len(r) - 1])))
  return responses


def _response_logits(params, prompts, out):
  """For each prompt, the no-cache logits `[length, vocab]` that predicted its response."""
  responses = [out.tokens[i, : out.lengths[i]].tolist() for i in range(len(prompts))]
  logits = _full_logits(params, prompts, responses)
  return [
    logits[i, len(p) - 1 : len(p) - 1 + len(r)]
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True))
  ]


def _log_softmax(x):
  x = x - x.max(axis=-1, keepdims=True)
  return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def _numpy_truncated(logits_v, temperature, top_k, top_p):
  """The sampled distribution's logits, written directly from the definition."""
  scaled = logits_v.astype(np.float64) / temperature
  order = np.argsort(-scaled, kind="stable")
  keep = np.zeros(scaled.shape, bool)
  k = top_k if top_k > 0 else scaled.size
  top = order[:k]
  probs = np.exp(scaled[top] - scaled[top].max())
  probs /= probs.sum()
  mass = 0.0
  for token, prob in zip(top, probs, strict=True):
    if mass >= top_p:
      break
    keep[token] = True
    mass += prob
  threshold = scaled[keep].min()  # ties with the last kept logit stay
  return np.where(scaled >= threshold, scaled, -np.inf)


# ---------------------------------------------------------------------------------------------


def test_greedy_left_padded_batch_matches_no_cache_argmax_and_logprobs(engine, params):
  prompts = _prompts(0)
  padded = np.zeros((len(prompts), 16), np.int32)
  for i, p in enumerate(prompts):
    padded[i, 16 - len(p) :] = p
  out = engine.generate(padded, [len(p) for p in prompts], padding_side="left")

  assert out.tokens.tolist() == _reference_greedy(params, prompts)
  assert out.lengths.tolist() == [8] * len(prompts) and out.mask.all() and not out.stopped.any()
  for i, logits in enumerate(_response_logits(params, prompts, out)):
    want = np.take_along_axis(_log_softmax(logits), out.tokens[i, :, None], axis=-1)[:, 0]
    np.testing.assert_allclose(out.logprobs[i], want, atol=1e-5, rtol=0)


def test_temperature_one_logprobs_equal_log_softmax_of_forward(engine, params):
  prompts = _prompts(1)
  out = engine.generate(prompts, sampling=rollout.SamplingParams(temperature=1.0), seed=7)
  assert out.tokens.tolist() != _reference_greedy(params, prompts)  # it did sample
  for i, logits in enumerate(_response_logits(params, prompts, out)):
    want = np.take_along_axis(_log_softmax(logits), out.tokens[i, :, None], axis=-1)[:, 0]
    np.testing.assert_allclose(out.logprobs[i], want, atol=1e-5, rtol=0)


def test_top_k_top_p_logprobs_are_those_of_the_truncated_distribution(engine, params):
  prompts = _prompts(2)
  settings = [
    rollout.SamplingParams(temperature=0.7, top_k=5),
    rollout.SamplingParams(temperature=1.3, top_p=0.8),
    rollout.SamplingParams(temperature=1.0, top_k=20, top_p=0.6),
    rollout.SamplingParams(temperature=0.5, top_p=0.9),
    rollout.SamplingParams(temperature=1.0, top_k=1),
    rollout.SamplingParams(temperature=2.0, top_k=3, top_p=0.99),
  ]
  out = engine.generate(prompts, sampling=settings, seed=3)
  for i, logits in enumerate(_response_logits(params, prompts, out)):
    s = settings[i]
    for j, token in enumerate(out.tokens[i]):
      dist = _log_softmax(_numpy_truncated(logits[j], s.temperature, s.top_k, s.top_p))
      assert np.isfinite(dist[token]), f"prompt {i} step {j}: token outside the support"
      np.testing.assert_allclose(out.logprobs[i, j], dist[token], atol=1e-5, rtol=0)
  assert out.tokens[4].tolist() == _reference_greedy(params, prompts[4:5])[0]  # top_k=1


def test_sampling_functions_match_numpy_and_draw_from_the_truncated_distribution():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(5, 37)).astype(np.float32) * 3
  logits[3, [4, 9]] = logits[3].max() + 1  # an exact tie at the top
  temperature = np.array([0.0, 0.6, 1.0, 1.5, 1.0], np.float32)
  top_k = np.array([0, 7, 0, 1, 3], np.int32)
  top_p = np.array([1.0, 1.0, 0.7, 1.0, 0.5], np.float32)
  got = np.asarray(rollout.truncated_logits(logits, temperature, top_k, top_p))
  for i in range(1, 5):
    want = _numpy_truncated(logits[i], temperature[i], top_k[i], top_p[i])
    np.testing.assert_array_equal(np.isfinite(got[i]), np.isfinite(want))
    np.testing.assert_allclose(got[i][np.isfinite(got[i])], want[np.isfinite(want)], rtol=1e-6)
  assert np.isfinite(got[3]).sum() == 2  # both tied tokens survive top_k=1

  # Empirical frequencies of 4000 draws of row 2 against its truncated distribution.
  keys = jax.random.split(jax.random.key(0), 4000)
  row = lambda x: jnp.broadcast_to(x[2], (4000, *x.shape[1:]))
  tokens, logprobs = jax.jit(sampling.sample)(
    row(logits), keys, row(temperature), row(top_k), row(top_p)
  )
  probs = np.exp(_log_softmax(_numpy_truncated(logits[2], 1.0, 0, 0.7)))
  freq = np.bincount(np.asarray(tokens), minlength=37) / 4000
  assert np.abs(freq - probs).max() < 0.03
  np.testing.assert_allclose(np.asarray(logprobs), np.log(probs[np.asarray(tokens)]), atol=1e-5)

  greedy_tokens, greedy_logprobs = sampling.sample(logits, keys[:5], temperature * 0, top_k, top_p)
  np.testing.assert_array_equal(greedy_tokens, logits.argmax(-1))
  np.testing.assert_allclose(greedy_logprobs, _log_softmax(logits).max(-1), atol=1e-6)


def test_the_argmax_and_the_draw_are_numpys_and_jaxs_own():
  x = np.array([[1, 3, 3, 0], [np.nan, 1, np.nan, 2], [-np.inf] * 4, [0, 0, 0, 5]], np.float32)
  np.testing.assert_array_equal(first_argmax(jnp.asarray(x)), [1, 0, 0, 3])  # as jnp.argmax
  x = np.random.default_rng(1).normal(size=(3, 2, 1000)).astype(np.float32)
  np.testing.assert_array_equal(first_argmax(jnp.asarray(x)), x.argmax(-1))

  # The same tokens as jax.random.categorical from the same keys, masked tokens never drawn.
  n, v = 4000, 1000
  logits = np.random.default_rng(2).normal(size=(n, v)).astype(np.float32) * 3
  logits[:, ::3] = -np.inf
  keys = jax.random.split(jax.random.key(2), n)
  tokens = np.asarray(jax.jit(sampling.gumbel_max_draw)(keys, logits))
  np.testing.assert_array_equal(tokens, jax.jit(jax.vmap(jax.random.categorical))(keys, logits))
  assert not np.any(tokens % 3 == 0) and len(np.unique(tokens)) > 100


def test_tensor2_data2_mesh_gives_the_same_outputs_as_one_device(engine, engine_2x2):
  mesh = engine_2x2.mesh
  kernel = engine_2x2.params["layers"]["attn"]["q_proj"]["kernel"]  # [l, d, heads, n]
  assert kernel.sharding.spec[2] == "tensor"
  assert {s.device.id for s in kernel.addressable_shards} == {4, 5, 6, 7}
  state = engine_2x2.init_decode_state()
  pool = state.cache["k"]  # [data replicas, l, kv_heads, pages per replica, page, n]
  assert pool.sharding.mesh == mesh and pool.sharding.spec[0] == "data"
  assert pool.sharding.spec[2] == "tensor"
  # 4 slots x 2 pages of 16 (a 24-token row) + 1 reserved page per replica = 5 per replica.
  assert {s.data.shape for s in pool.addressable_shards} == {(1, 3, 1, 5, 16, 12)}
  assert {s.device.id for s in pool.addressable_shards} == {4, 5, 6, 7}

  prompts = _prompts(4)
  for setting in (rollout.GREEDY, rollout.SamplingParams(temperature=1.0, top_p=0.9)):
    one = engine.generate(prompts, sampling=setting, seed=5)
    four = engine_2x2.generate(prompts, sampling=setting, seed=5)
    np.testing.assert_array_equal(four.tokens, one.tokens)
    np.testing.assert_array_equal(four.lengths, one.lengths)
    np.testing.assert_allclose(four.logprobs, one.logprobs, atol=1e-5, rtol=0)


def test_continuous_batching_answers_each_prompt_once_like_the_batch(engine, engine_wide, params):
  lengths = (5, 12, 2, 16, 7, 1, 9, 3, 14, 4, 11)
  prompts = _prompts(5, lengths)
  greedy = _reference_greedy(params, prompts)
  settings = []
  for i, ref in enumerate(greedy):
    if i % 3 == 0:  # stop on the token greedy decoding produces at step i % 5
      settings.append(rollout.SamplingParams(temperature=0.0, stop_token_ids=(ref[i % 5], 3)))
    else:
      settings.append(rollout.SamplingParams(temperature=0.0, max_new_tokens=1 + i % 8))
  want = []
  for s, ref in zip(settings, greedy, strict=True):
    response = ref[: s.max_new_tokens or 8]
    stops = [j for j, t in enumerate(response) if t in (s.stop_token_ids or ())]
    want.append(response[: stops[0] + 1] if stops else response)

  out = engine.generate(prompts, sampling=settings)
  assert out.inserts.tolist() == [1] * len(prompts)  # 11 prompts through 4 slots: refilled
  assert out.decode_calls > 1 and out.max_live == ENGINE.num_slots
  assert [out.tokens[i, :n].tolist() for i, n in enumerate(out.lengths)] == want
  assert out.stopped.tolist() == [
    bool(set(w) & set(s.stop_token_ids or ())) for w, s in zip(want, settings, strict=True)
  ]
  assert (out.tokens[~out.mask] == ENGINE.pad_token_id).all()

  batch = engine_wide.generate(prompts, sampling=settings)
  assert batch.decode_calls == 1
  for field in ("tokens", "lengths", "mask", "stopped"):
    np.testing.assert_array_equal(getattr(out, field), getattr(batch, field))
  np.testing.assert_allclose(out.logprobs, batch.logprobs, atol=1e-5, rtol=0)


def test_seeds_reproduce_across_calls_and_slot_counts_and_differ_between_seeds(engine, engine_wide):
  prompts = _prompts(6)
  setting = rollout.SamplingParams(temperature=1.0, top_k=50)
  first = engine.generate(prompts, sampling=setting, seed=11)
  again = engine.generate(prompts, sampling=setting, seed=11)
  wide = engine_wide.generate(prompts, sampling=setting, seed=11)
  other = engine.generate(prompts, sampling=setting, seed=12)
  np.testing.assert_array_equal(again.tokens, first.tokens)
  np.testing.assert_array_equal(wide.tokens, first.tokens)
  np.testing.assert_allclose(wide.logprobs, first.logprobs, atol=1e-5, rtol=0)
  assert (other.tokens != first.tokens).mean() > 0.5


def test_slot_api_prefill_insert_generate_and_reuse_a_finished_slot(params):
  """JetStream's slot protocol: prefill fills the prompts' KV, each decode step samples a
  token for every busy slot (the first step the first token), a finished slot is free."""
  engine = rollout.Engine.for_role(CONFIG, ENGINE, _role([0], 1, 1), params)
  prompts = _prompts(7, (4, 11, 6))
  greedy = _reference_greedy(params, prompts)
  state = engine.init_decode_state()
  prefix = engine.prefill(prompts[:2], rollout.SamplingParams(temperature=0.0, max_new_tokens=3))
  state = engine.insert(prefix, state, [3, 1])
  state, steps = engine.generate_steps(state, max_steps=1)
  view = engine.read(state)
  assert int(steps) == 1
  assert view.done.tolist() == [True, False, True, False]
  assert view.num_generated[[3, 1]].tolist() == [1, 1]
  assert view.last_tokens[3] == greedy[0][0]

  state, steps = engine.generate_steps(state, until_free=3)  # 2 slots are free already
  view = engine.read(state)
  assert int(steps) == 2 and view.done.all()
  assert view.tokens[3, :3].tolist() == greedy[0][:3]
  assert view.tokens[1, :3].tolist() == greedy[1][:3]

  state = engine.insert(engine.prefill(prompts[2:]), state, [3])  # slot 3 finished: reuse it
  state, _ = engine.generate_steps(state)
  view = engine.read(state)
  assert view.tokens[3].tolist() == greedy[2] and view.num_generated[3] == 8


def test_no_recompilation_across_calls_and_weight_updates(engine, params):
  prompts = _prompts(8)
  before = engine.warmup()  # every prefill batch size x bucket, and the decode loop
  # The paged decode loop: one program per live-batch size x page-table width, each once.
  decode = {k: n for k, n in before.items() if k.startswith("generate_steps")}
  assert len(decode) == len(engine.paged.batch_sizes) * len(engine.paged.widths) > 1
  assert before == {"init_decode_state": 1, "prefill": 4, "insert": 4, **dict.fromkeys(decode, 1)}
  compiles = []
  listener = lambda name, *_, **__: compiles.append(name)
  new_params = models.init_params(CONFIG, "lm", jax.random.key(2))
  # Weights from another mesh: moved device to device by the transfer function.
  elsewhere = jax.device_put(new_params, jax.devices()[3])
  jax.block_until_ready(elsewhere)
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    with jax.transfer_guard("disallow"):
      engine.generate(_prompts(9), sampling=rollout.SamplingParams(temperature=0.8, top_p=0.9))
      engine.generate(_prompts(10, (2, 5, 7, 1, 3, 16, 12)), seed=4)
      moved = engine.update_params(elsewhere)
      updated = engine.generate(prompts)
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
    engine.update_params(params)
  assert "/jax/core/compile/backend_compile_duration" not in compiles
  assert engine.compilations == before
  assert moved > 0
  assert updated.tokens.tolist() == _reference_greedy(new_params, prompts)


def test_sliding_window_attention_matches_no_cache(params):
  config = CONFIG.replace(sliding_window=5)
  engine = rollout.Engine.for_role(config, ENGINE, _role([2], 1, 1), params)
  prompts = _prompts(11, (3, 9, 14, 16))
  out = engine.generate(prompts)
  assert out.tokens.tolist() == _reference_greedy(params, prompts, config=config)
  assert out.tokens.tolist() != _reference_greedy(params, prompts)  # the window mattered


def test_bad_inputs_raise_clear_errors(engine, params):
  with pytest.raises(ValueError, match="longer than the largest prompt bucket"):
    engine.generate([[1] * 17])
  with pytest.raises(ValueError, match="empty prompt"):
    engine.generate([[1, 2], []])
  with pytest.raises(ValueError, match="exceeds the engine's cache capacity"):
    engine.generate([[1, 2]], sampling=rollout.SamplingParams(max_new_tokens=9))
  with pytest.raises(ValueError, match="stop token ids exceed"):
    engine.prefill([[1, 2]], rollout.SamplingParams(stop_token_ids=range(5)))
  with pytest.raises(ValueError, match="outside"):
    engine.prefill([[1, CONFIG.vocab_size]])
  with pytest.raises(ValueError, match="top_p"):
    rollout.SamplingParams(top_p=0.0)
  with pytest.raises(ValueError, match="temperature"):
    rollout.SamplingParams(temperature=-1.0)
  with pytest.raises(ValueError, match="prefill takes 1 to 4 prompts"):
    engine.prefill([[1]] * 5)
  with pytest.raises(ValueError, match="slots must be distinct"):
    engine.insert(rollout.Prefix(state=None, num_prompts=2, bucket=8), None, [1, 1])
  with pytest.raises(ValueError, match="multiple of the mesh's 'data' axis"):
    rollout.Engine.for_role(CONFIG, rollout.EngineConfig(num_slots=3), _role([0, 1], 2, 1))
  with pytest.raises(ValueError, match="not generation-layout axes"):
    rollout.Engine(CONFIG, ENGINE, jax.make_mesh((1,), ("fsdp",), devices=jax.devices()[:1]))
  with pytest.raises(ValueError, match="max_position_embeddings"):
    rollout.Engine(CONFIG, rollout.EngineConfig(max_new_tokens=1000), engine.mesh)
  with pytest.raises(ValueError, match="strictly increasing"):
    rollout.EngineConfig(prompt_buckets=(16, 8))
  fresh = rollout.Engine(CONFIG, ENGINE, engine.mesh)
  with pytest.raises(RuntimeError, match="update_params"):
    fresh.prefill([[1]])
  wrong = jax.tree.map(lambda x: x[..., :1], params)
  with pytest.raises(ValueError, match="do not match the model config"):
    fresh.update_params(wrong)


def test_benchmark_reports_every_field_and_agrees_with_the_no_cache_generator():
  from rlhfjax.bench import rollout_bench

  bench = rollout_bench.BenchConfig(size="tiny", batch=2, prompt_len=8, new_tokens=4, repeats=1)
  record = rollout_bench.run(bench, copy_bytes=1 << 20, matmul_n=64)
  for key in (
    "engine_tokens_per_s",
    "no_cache_tokens_per_s",
    "roofline_fraction",
    "copy_GBps",
    "matmul_GFLOPps",
    "bytes_per_step",
    "flops_per_step",
  ):
    assert record[key] > 0, key
  assert record["greedy_tokens_equal"] == 1.0
  assert record["compilations"] == 4  # init, prefill, insert, generate_steps


def test_weight_swaps_reuse_only_the_engines_own_buffers(engine_2x2, params):
  """A swap writes into the previous weights' buffers only when the engine copied them."""
  leaves = lambda tree: jax.tree.leaves(tree)
  first = models.init_params(CONFIG, "lm", jax.random.key(5))  # on device 0: copied over
  second = models.init_params(CONFIG, "lm", jax.random.key(6))
  engine_2x2.update_params(first)
  engine_2x2.update_params(second)
  # Adopted as is: arrays already laid out as the engine wants are not copied...
  adopted = jax.device_put(second, engine_2x2.param_shardings)
  engine_2x2.update_params(adopted)
  assert all(a is b for a, b in zip(leaves(adopted), leaves(engine_2x2.params), strict=True))
  # ... so the next swap must not write into (or free) them.
  engine_2x2.update_params(params)
  for tree in (first, second, adopted):
    assert not any(leaf.is_deleted() for leaf in leaves(tree))
  np.testing.assert_array_equal(np.asarray(leaves(adopted)[0]), np.asarray(leaves(second)[0]))
  for got, want in zip(leaves(engine_2x2.params), leaves(params), strict=True):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
