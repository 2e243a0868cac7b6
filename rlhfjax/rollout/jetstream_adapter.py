"""JetStream's `engine_api.Engine` over the rollout engine, so JetStream's orchestrator can serve
a trained policy.

Needs the optional `jetstream` extra (`google-jetstream`, which pulls TensorFlow in through
seqio); nothing else in `rlhfjax` imports this module.

Letters in names: b decode slots.

Mapping onto JetStream 0.2.x:
  * `prefill(padded_tokens, true_length)`: one prompt (JetStream pads on the right) through
    `Engine.prefill`; the prefix is the engine's one-row `paged_decode.Prefix`, a pytree the
    orchestrator can `device_put` to `get_prefix_destination_sharding()`.
  * `insert(prefix, state, slot)` and `init_decode_state()`: the engine's own.
  * `generate(params, state)`: one decode step on device, then one token per slot as
    `ResultTokens`: the slot's next token not reported yet. JetStream's prefill returns no
    token, and neither does the engine's (the first decode step samples the first response
    token). A slot whose response is fully reported gives `valid = False`, which completes it
    in the orchestrator.
  * Sampling settings are fixed per adapter (JetStream 0.2 requests carry none); each request
    gets its own PRNG key from a counter.

JetStream 0.2.2 is archived and predates JAX 0.6; `load_orchestrator` returns its orchestrator
module patched to run on this JAX.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from jetstream.engine import engine_api, tokenizer_pb2

from rlhfjax.rollout import paged_decode
from rlhfjax.rollout.engine import Engine, Prefix
from rlhfjax.rollout.paged_decode import PagedState
from rlhfjax.rollout.sampling import GREEDY, SamplingParams


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class AdapterState:
  """The engine's decode batch plus how much of each slot's response JetStream has seen."""

  slots: PagedState
  reported_b: jax.Array
  """Response tokens of each slot already returned by `generate`."""


def _report(slots: PagedState, reported_b: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The next unreported token of every slot as `[b, 3]` (token, valid, length) rows."""
  tokens_br = paged_decode.slot_tokens(slots)
  token_b = jnp.take_along_axis(tokens_br, reported_b[:, None], axis=1, mode="clip")[:, 0]
  valid_b = reported_b < slots.num_generated_b
  data_b3 = jnp.stack([token_b, valid_b.astype(jnp.int32), reported_b + 1], axis=-1)
  return data_b3, reported_b + valid_b


def _reset(reported_b: jax.Array, slot: jax.Array) -> jax.Array:
  return jnp.where(jnp.arange(reported_b.shape[0]) == slot, 0, reported_b)


def _delete_pytree(tree: Any) -> None:
  for leaf in jax.tree.leaves(tree):
    if isinstance(leaf, jax.Array):
      leaf.delete()


def load_orchestrator() -> Any:
  """`jetstream.core.orchestrator`, fixed up to run under this JAX.

  * Its `delete_pytree` (run after every insert) calls `jax.tree_map`, which JAX 0.6 removed:
    it is replaced by an equivalent on `jax.tree.leaves`.
  * Importing it sets the root logger to DEBUG with a stdout handler: that is undone.
  """
  root = logging.getLogger()
  level, handlers = root.level, list(root.handlers)
  orchestrator = importlib.import_module("jetstream.core.orchestrator")
  root.setLevel(level)
  root.handlers[:] = handlers
  orchestrator.delete_pytree = _delete_pytree
  return orchestrator


class JetStreamEngine(engine_api.Engine):
  """A `jetstream.engine.engine_api.Engine` backed by `rlhfjax.rollout.Engine`."""

  def __init__(
    self,
    engine: Engine,
    *,
    sampling: SamplingParams = GREEDY,
    seed: int = 0,
    tokenizer_path: str = "",
    tokenizer: Any | None = None,
  ):
    """Wraps an engine that already holds parameters.

    Args:
      engine: The rollout engine (its mesh, weights and compiled programs).
      sampling: Decoding settings for every request.
      seed: Seeds every request's PRNG key, with a request counter.
      tokenizer_path: SentencePiece model for JetStream's own tokenizer (`get_tokenizer`).
      tokenizer: A ready `jetstream.engine.tokenizer_api.Tokenizer` for the orchestrator to use
        instead of building one from `tokenizer_path` (for example a Hugging Face wrapper).
    """
    if 1 not in engine.config.prefill_batch_sizes:
      raise ValueError("the JetStream adapter prefills one prompt at a time")
    self._engine = engine
    self._sampling = sampling
    self._seed = seed
    self._tokenizer_path = tokenizer_path
    self._tokenizer = tokenizer
    self._requests = 0
    replicated = NamedSharding(engine.mesh, PartitionSpec())
    row = engine.state_shardings.tokens_b
    self._state_shardings = AdapterState(slots=engine.state_shardings, reported_b=row)
    self._report = jax.jit(
      _report, in_shardings=(engine.state_shardings, row), out_shardings=(replicated, row)
    )
    self._reset = jax.jit(
      _reset, in_shardings=(row, replicated), out_shardings=row, donate_argnums=0
    )
    self._replicated = replicated

  @property
  def engine(self) -> Engine:
    return self._engine

  # -------------------------------------------------------------------------------------------
  # Accelerator calls.

  def load_params(self, *args, **kwargs) -> Any:
    """The engine's parameters (load new ones with `Engine.update_params`)."""
    del args, kwargs
    return self._engine.params

  def _use(self, params: Any) -> None:
    if params is not self._engine.params:
      self._engine.update_params(params)

  def prefill(
    self,
    *,
    params: Any,
    existing_prefix: Any | None = None,
    padded_tokens: jax.Array,
    true_length: int,
  ) -> paged_decode.Prefix:
    if existing_prefix is not None:
      raise NotImplementedError("prefill on top of an existing prefix (multi-turn caching)")
    self._use(params)
    prompt = np.asarray(jax.device_get(padded_tokens)).reshape(-1)[: int(true_length)]
    request_id = self._requests % 2**31
    self._requests += 1
    return self._engine.prefill(
      [prompt], self._sampling, seed=self._seed, request_ids=[request_id]
    ).state

  def insert(
    self, prefix: paged_decode.Prefix, decode_state: AdapterState, slot: int
  ) -> AdapterState:
    full = Prefix(state=prefix, num_prompts=1, bucket=prefix.cache["k"].shape[2])
    slots = self._engine.insert(full, decode_state.slots, [slot])
    slot_index = jax.device_put(np.int32(slot), self._replicated)
    return AdapterState(slots=slots, reported_b=self._reset(decode_state.reported_b, slot_index))

  def generate(
    self, params: Any, decode_state: AdapterState
  ) -> tuple[AdapterState, engine_api.ResultTokens]:
    self._use(params)
    slots, _ = self._engine.generate_steps(decode_state.slots, max_steps=1)
    data_b3, reported_b = self._report(slots, decode_state.reported_b)
    result = engine_api.ResultTokens(
      data=data_b3, tokens_idx=(0, 1), valid_idx=(1, 2), length_idx=(2, 3), samples_per_slot=1
    )
    return AdapterState(slots=slots, reported_b=reported_b), result

  def init_decode_state(self, *args, **kwargs) -> AdapterState:
    del args, kwargs
    slots = self._engine.init_decode_state()
    reported_b = jax.device_put(
      np.zeros(self.max_concurrent_decodes, np.int32), self._state_shardings.reported_b
    )
    return AdapterState(slots=slots, reported_b=reported_b)

  def get_prefix_destination_sharding(self) -> Any:
    return self._engine.prefix_shardings[1]

  def get_tokenizer(self) -> tokenizer_pb2.TokenizerParameters:
    return tokenizer_pb2.TokenizerParameters(path=self._tokenizer_path, extra_ids=0)

  def build_tokenizer(self, metadata: tokenizer_pb2.TokenizerParameters) -> Any:
    if self._tokenizer is not None:
      return self._tokenizer
    return super().build_tokenizer(metadata)

  # -------------------------------------------------------------------------------------------
  # Static facts.

  @property
  def max_concurrent_decodes(self) -> int:
    return self._engine.config.num_slots

  @property
  def samples_per_slot(self) -> int:
    return 1

  @property
  def max_prefill_length(self) -> int:
    return self._engine.config.prompt_buckets[-1]

  @property
  def mesh(self) -> jax.sharding.Mesh:
    return self._engine.mesh

  @property
  def colocated_cpus(self) -> None:
    return None
