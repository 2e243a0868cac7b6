"""Train state of one trained role and its creation directly in shards."""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax

from rlhfjax import programs
from rlhfjax.models import lora


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: Any


def init_train_state(params: Any, tx: optax.GradientTransformation) -> TrainState:
  """A fresh state; the optimizer keeps moments for the trained leaves only (with adapters,
  `models.lora.split`, not for the frozen base)."""
  opt_state = tx.init(lora.split(params)[0])
  return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt_state)


def train_state_shardings(
  params_shardings: Any,
  abstract_params: Any,
  tx: optax.GradientTransformation,
  replicated: jax.sharding.Sharding,
) -> TrainState:
  """Shardings for a `TrainState`: optimizer moments follow their parameter's sharding and
  everything else in the optimizer state (step counts) is replicated."""
  abstract_opt_state = programs.eval_shape(tx.init, lora.split(abstract_params)[0])
  opt_shardings = optax.tree_map_params(
    tx,
    lambda _, sharding: sharding,
    abstract_opt_state,
    lora.split(params_shardings)[0],
    transform_non_params=lambda _: replicated,
  )
  return TrainState(step=replicated, params=params_shardings, opt_state=opt_shardings)
