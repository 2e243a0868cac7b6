"""The JetStream adapter, driven through JetStream's own engine API and orchestrator.

Needs the `jetstream` extra (google-jetstream, which brings TensorFlow). Without it the tests
skip, unless RLHFJAX_REQUIRE_JETSTREAM is set (as in the CI job that installs the extra): then
a missing package is an error, so the extra cannot silently stop being tested.
"""

import asyncio
import os

import jax
import numpy as np
import pytest

from rlhfjax import models, rollout

if os.environ.get("RLHFJAX_REQUIRE_JETSTREAM"):
  import jetstream  # noqa: F401  (an ImportError here fails the run instead of skipping)
pytest.importorskip("jetstream", reason="the optional 'jetstream' extra is not installed")

from jetstream.core.proto import jetstream_pb2  # noqa: E402
from jetstream.engine import engine_api, token_utils  # noqa: E402

from rlhfjax.config.model import get_model_config
from rlhfjax.rollout import jetstream_adapter  # noqa: E402

pytestmark = pytest.mark.unit

CONFIG = get_model_config("tiny")
ENGINE = rollout.EngineConfig(
  num_slots=4, prompt_buckets=(8, 16), max_new_tokens=8, prefill_batch_sizes=(1, 4)
)
BOS = 1


class _Tokenizer:
  """The little of a JetStream tokenizer that token-in/token-out serving uses."""

  bos_id, pad_id, eos_id = BOS, 0, 2
  stop_tokens: set[int] = set()

  def decode(self, token_ids):
    return " ".join(map(str, token_ids))


@pytest.fixture(scope="module")
def engine():
  params = models.init_params(CONFIG, "lm", jax.random.key(1))
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "tensor"))
  return rollout.Engine(CONFIG, ENGINE, mesh, params)


def _prompts(seed, lengths):
  rng = np.random.default_rng(seed)
  return [rng.integers(3, CONFIG.vocab_size, n).tolist() for n in lengths]


def test_prefill_insert_generate_through_the_engine_api_match_the_engine(engine):
  adapter = jetstream_adapter.JetStreamEngine(engine)
  assert isinstance(adapter, engine_api.Engine)
  assert adapter.max_concurrent_decodes == 4 and adapter.max_prefill_length == 16
  prompts = _prompts(0, (3, 16, 9, 1, 12, 5))  # more prompts than slots
  want = engine.generate(prompts)

  params = adapter.load_params()
  state = adapter.init_decode_state()
  pending, free, live = list(range(len(prompts))), list(range(4)), {}
  got = {i: [] for i in range(len(prompts))}
  stub = _Tokenizer()
  while pending or live:
    while pending and free:
      i, slot = pending.pop(0), free.pop(0)
      padded = np.zeros(16, np.int32)
      padded[: len(prompts[i])] = prompts[i]  # JetStream pads on the right
      prefix = adapter.prefill(params=params, padded_tokens=padded, true_length=len(prompts[i]))
      prefix = jax.device_put(prefix, adapter.get_prefix_destination_sharding())
      state = adapter.insert(prefix, state, slot)
      live[slot] = (i, np.zeros(1, bool))
    state, result = adapter.generate(params, state)
    result = result.convert_to_numpy()
    for slot, (i, complete) in list(live.items()):
      samples, complete = token_utils.process_result_tokens(
        tokenizer=stub,
        slot=slot,
        slot_max_length=ENGINE.max_new_tokens,
        result_tokens=result,
        complete=complete,
        is_client_side_tokenization=True,
      )
      got[i].extend(samples[0].token_ids)
      live[slot] = (i, complete)
      if complete.all():
        del live[slot]
        free.append(slot)
  assert [got[i] for i in range(len(prompts))] == want.tokens.tolist()


def test_jetstream_orchestrator_serves_the_policy(engine):
  orchestrator = jetstream_adapter.load_orchestrator()
  adapter = jetstream_adapter.JetStreamEngine(engine, tokenizer=_Tokenizer())
  prompts = _prompts(1, (4, 11, 7))
  want = engine.generate([[BOS, *p] for p in prompts])  # JetStream prepends BOS
  driver = orchestrator.Driver(
    prefill_engines=[adapter],
    generate_engines=[adapter],
    prefill_params=[adapter.load_params()],
    generate_params=[adapter.load_params()],
    interleaved_mode=True,
  )
  client = orchestrator.LLMOrchestrator(driver=driver)

  async def decode(prompt):
    request = jetstream_pb2.DecodeRequest(
      token_content=jetstream_pb2.DecodeRequest.TokenContent(token_ids=prompt),
      max_tokens=ENGINE.max_new_tokens,
    )
    tokens = []
    async for response in client.Decode(request):
      tokens.extend(response.stream_content.samples[0].token_ids)
    return tokens

  async def serve():
    try:
      return await asyncio.gather(*(decode(p) for p in prompts))
    finally:
      # Stop the driver's threads while the event loop is still open: a request's channel is
      # closed from the detokenize thread in two steps, and the second must not find the loop
      # closed (JetStream's thread wrapper kills the process on any error).
      driver.stop()

  assert asyncio.run(serve()) == want.tokens.tolist()
