"""Programs shared within a process (`rlhfjax.programs`): the key compares functions and their
jit arguments by value, equal programs are one jitted function, every builder counts the traces
it needs, and what cannot be keyed is never shared."""

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from rlhfjax import programs

pytestmark = pytest.mark.unit


@dataclasses.dataclass(frozen=True)
class Settings:
  scale: float
  name: str = "x"


@dataclasses.dataclass
class Mutable:
  scale: float


def scaled(settings, x):
  return x * settings.scale


def closure(scale):
  def f(x):
    return x * scale

  return f


@contextlib.contextmanager
def traces():
  """The traces JAX makes inside the block (one entry each)."""
  seen = []

  def listen(event, *_, **__):
    if event == "/jax/core/compile/jaxpr_trace_duration":
      seen.append(event)

  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    yield seen
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)


def test_keys_compare_programs_by_value():
  key = programs.key
  assert key(functools.partial(scaled, Settings(2.0))) == key(
    functools.partial(scaled, Settings(2.0))
  )
  assert key(functools.partial(scaled, Settings(2.0))) != key(
    functools.partial(scaled, Settings(3.0))
  )
  assert key(closure(2.0)) == key(closure(2.0)) != key(closure(3.0))
  # The same code in another module's namespace (a file loaded twice) is another program.
  namespace = {}
  exec(compile("def f(x):\n  return x * SCALE\n", __file__, "exec"), namespace)
  other = dict(namespace)
  exec(compile("def f(x):\n  return x * SCALE\n", __file__, "exec"), other)
  assert namespace["f"].__code__ == other["f"].__code__
  assert key(namespace["f"]) != key(other["f"])
  assert key(1) != key(1.0) != key(True)  # the type is part of a value
  assert key(-0.0) != key(0.0) and key(float("nan")) == key(float("nan"))
  mesh = jax.make_mesh((8,), ("data",))
  assert key({"s": NamedSharding(mesh, PartitionSpec("data"))}) == key(
    {"s": NamedSharding(jax.make_mesh((8,), ("data",)), PartitionSpec("data"))}
  )
  split, whole = NamedSharding(mesh, PartitionSpec("data")), NamedSharding(mesh, PartitionSpec())
  assert key(split) != key(whole)
  # What may change after the key is taken has none.
  for unkeyable in (
    functools.partial(scaled, Mutable(2.0)),
    closure(np.ones(3)),
    closure(jnp.ones(3)),
    Mutable(1.0).__eq__,
  ):
    with pytest.raises(programs._Unkeyable):
      key(unkeyable)


def test_builders_of_one_program_share_it_and_count_what_each_needs():
  a, b = programs.TraceCounter(), programs.TraceCounter()
  settings = Settings(2.5, name="shared-test")
  pa = a.jit("scale", functools.partial(scaled, settings))
  pb = b.jit("scale", functools.partial(scaled, Settings(2.5, name="shared-test")))
  assert pa._jitted is pb._jitted
  np.testing.assert_array_equal(pa(jnp.ones(4)), np.full(4, 2.5))
  assert a.counts == {"scale": 1}
  # b's first call finds a's trace: it counts the one compile it would have made, no trace.
  with traces() as traced:
    np.testing.assert_array_equal(pb(jnp.ones(4)), np.full(4, 2.5))
  assert b.counts == {"scale": 1} and not traced
  # A new shape is a trace of b's own; a's count is its own.
  with traces() as traced:
    pb(jnp.ones(5))
  assert b.counts == {"scale": 2} and a.counts == {"scale": 1} and traced
  # A third builder counts each shape it calls once, traced by others or not.
  c = programs.TraceCounter()
  pc = c.jit("scale", functools.partial(scaled, settings))
  with traces() as traced:
    for n in (4, 5, 4, 5):
      pc(jnp.ones(n))
  assert c.counts == {"scale": 2} and not traced
  # Anything else is the jitted function's.
  assert pa._cache_size() == 2
  assert pa.lower(jnp.ones(3)).compile() is not None


def test_different_values_and_unkeyable_functions_are_not_shared():
  a = programs.TraceCounter()
  two = a.jit("f", functools.partial(scaled, Settings(2.0, name="unshared-test")))
  three = a.jit("g", functools.partial(scaled, Settings(3.0, name="unshared-test")))
  assert two._jitted is not three._jitted
  np.testing.assert_array_equal(three(jnp.ones(2)), np.full(2, 3.0))
  before = programs.stats().get("unshared", 0)
  m1 = a.jit("m", functools.partial(scaled, Mutable(2.0)))
  m2 = a.jit("m", functools.partial(scaled, Mutable(2.0)))
  assert m1._jitted is not m2._jitted
  assert programs.stats()["unshared"] == before + 2
  assert any(why.endswith(": Mutable") for why in programs.stats()["unshared_why"])


def test_a_second_model_of_the_same_config_traces_nothing():
  from rlhfjax import models
  from rlhfjax.config.model import get_model_config

  config = get_model_config("tiny")
  mesh = jax.make_mesh((8,), ("fsdp",))
  sharding = NamedSharding(mesh, PartitionSpec())
  shardings = jax.tree.map(lambda _: sharding, models.abstract_params(config, "lm"))
  first = models.init_params(config, "lm", jax.random.key(0), shardings=shardings)
  with traces() as traced:
    assert models.abstract_params(config, "lm") is models.abstract_params(config, "lm")
    second = models.init_params(config, "lm", jax.random.key(0), shardings=shardings)
  assert not traced
  for x, y in zip(jax.tree.leaves(first), jax.tree.leaves(second), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
