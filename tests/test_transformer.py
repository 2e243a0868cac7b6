"""The model's own invariants: padding, KV cache, parameter counts, logical axes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlhfjax import models
from rlhfjax.config.model import get_model_config, model_sizes, param_count
from rlhfjax.models import transformer

pytestmark = pytest.mark.unit

CONFIG = get_model_config("tiny")


@pytest.fixture(scope="module")
def params():
  return models.init_params(CONFIG, "lm", jax.random.key(1))


def test_left_padding_does_not_change_logits(params):
  rng = np.random.default_rng(0)
  row = rng.integers(0, CONFIG.vocab_size, size=7).astype(np.int32)
  alone = models.forward_logits(CONFIG, params, jnp.asarray(row[None]))
  padded = np.concatenate([np.full(5, 9, np.int32), row])[None]
  mask = np.concatenate([np.zeros(5, np.int32), np.ones(7, np.int32)])[None]
  logits = models.forward_logits(CONFIG, params, jnp.asarray(padded), jnp.asarray(mask))
  np.testing.assert_allclose(np.asarray(logits)[0, 5:], np.asarray(alone)[0], atol=1e-5)
  assert np.all(np.isfinite(np.asarray(logits)))  # pad queries see nothing, yet no NaN


def test_prefill_then_decode_with_cache_equals_full_forward(params):
  """Prefill a left-padded prompt into the cache, decode 4 tokens one by one."""
  rng = np.random.default_rng(1)
  b, prompt_len, steps, cache_len = 2, 6, 4, 16
  tokens = rng.integers(0, CONFIG.vocab_size, size=(b, prompt_len + steps)).astype(np.int32)
  mask = np.ones_like(tokens)
  mask[1, :2] = 0  # row 1 is left padded by 2
  full = models.forward_logits(CONFIG, params, jnp.asarray(tokens), jnp.asarray(mask))

  cache = models.init_cache(CONFIG, b, cache_len)
  key_valid = np.zeros((b, cache_len), bool)
  key_valid[:, :prompt_len] = mask[:, :prompt_len]
  positions = np.asarray(models.positions_from_mask(jnp.asarray(mask)))
  slots = np.broadcast_to(np.arange(cache_len), (b, cache_len))
  # Queries and keys ordered by their slots; the keys' own padding is segment 0.
  prefill_mask = models.Mask.over_keys(
    np.ones((b, prompt_len)), slots[:, :prompt_len], key_valid, slots
  )
  logits, cache = transformer.apply(
    CONFIG,
    params,
    jnp.asarray(tokens[:, :prompt_len]),
    jnp.asarray(positions[:, :prompt_len]),
    prefill_mask,
    cache=cache,
    cache_index_b=jnp.zeros(b, jnp.int32),
  )
  real = mask[:, :prompt_len].astype(bool)
  np.testing.assert_allclose(
    np.asarray(logits)[real], np.asarray(full)[:, :prompt_len][real], atol=1e-5
  )
  for step in range(steps):
    i = prompt_len + step
    key_valid[:, i] = True
    logits, cache = transformer.apply(
      CONFIG,
      params,
      jnp.asarray(tokens[:, i : i + 1]),
      jnp.asarray(positions[:, i : i + 1]),
      models.Mask.over_keys(np.ones((b, 1)), np.full((b, 1), i), key_valid, slots),
      cache=cache,
      cache_index_b=jnp.full(b, i, jnp.int32),
    )
    np.testing.assert_allclose(np.asarray(logits)[:, 0], np.asarray(full)[:, i], atol=1e-5)


@pytest.mark.parametrize("size", model_sizes())
@pytest.mark.parametrize("head", ["lm", "value"])
def test_param_count_matches_the_tree(size, head):
  config = get_model_config(size)
  shapes = models.abstract_params(config, head)
  assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes)) == param_count(config, head)


def test_named_sizes_have_the_published_parameter_counts():
  billions = {s: param_count(get_model_config(s)) / 1e9 for s in ("1b", "7b", "13b", "70b")}
  assert abs(billions["1b"] - 1.24) < 0.01  # Llama-3.2-1B
  assert abs(billions["7b"] - 6.74) < 0.01  # Llama-2-7B
  assert abs(billions["13b"] - 13.02) < 0.01
  assert abs(billions["70b"] - 68.98) < 0.01


def test_logical_axes_cover_every_parameter_with_matching_rank():
  for head in ("lm", "value"):
    shapes = models.abstract_params(CONFIG, head)
    axes = models.logical_axes(CONFIG, head)
    flat_shapes = jax.tree.leaves(shapes)
    flat_axes = jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple))
    assert len(flat_shapes) == len(flat_axes)
    for shape, names in zip(flat_shapes, flat_axes, strict=True):
      assert len(shape.shape) == len(names)
      assert all(
        n in {"vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "layers", "norm"}
        for n in names
      )


def test_bad_model_configs_raise_clear_errors():
  with pytest.raises(ValueError, match="unknown model size 'huge'"):
    get_model_config("huge")
  with pytest.raises(ValueError, match="num_kv_heads=3 must divide num_heads=4"):
    CONFIG.replace(num_kv_heads=3)
  with pytest.raises(ValueError, match="dtype must be one of"):
    CONFIG.replace(dtype="float16")


def test_sequence_reward_picks_last_real_token():
  values = jnp.arange(12, dtype=jnp.float32).reshape(2, 6)
  mask = jnp.array([[0, 0, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]])
  np.testing.assert_array_equal(models.sequence_reward(values, mask), [5.0, 8.0])
