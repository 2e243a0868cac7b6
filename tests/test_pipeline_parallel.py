"""Pipeline-parallel train steps (`rlhfjax.training.pipeline`) against the unpipelined ones; a
fused actor-critic update against two separate ones; staged weights to the generation layout.
PPO runs with pipeline stages: `test_pipeline_parallel_runs`.

Gradients are compared leaf by leaf as max |pipelined - reference| / max |reference|, within
1e-5: both sum the same fp32 per-micro-batch gradients in the same micro-batch order, and
differ only in how XLA fuses and orders each stage's reductions (a few fp32 ulps, 1.2e-7 each,
per reduction of at most a few hundred terms here); measured: about 1e-6.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rlhfjax import models, schedules
from rlhfjax.config.model import get_model_config
from rlhfjax.mesh import rules, sharing, transfer
from rlhfjax.placement.spec import Layout
from rlhfjax.training import pipeline, steps
from rlhfjax.training.state import init_train_state

pytestmark = pytest.mark.unit

M, ROWS, PROMPT, RESPONSE = 4, 4, 5, 6

_init = jax.jit(models.init_params, static_argnums=(0, 1))
"""`models.init_params` compiled as one program (run op by op, its many small ops each compile)."""


def _mesh(stages: int, reverse: bool = False) -> Mesh:
  """stages x fsdp x tensor over the 8 devices (tensor 2, fsdp the rest)."""
  devices = np.array(jax.devices()).reshape(stages, 8 // stages // 2, 2)
  if reverse:
    devices = np.flip(devices, 0)
  return Mesh(devices, ("stage", "fsdp", "tensor"))


def _batch(config, seed: int = 0) -> dict[str, np.ndarray]:
  """`[m, b, ...]` PPO fields with left-padded prompts and right-padded responses."""
  rng = np.random.default_rng(seed)
  s = PROMPT + RESPONSE
  tokens = rng.integers(0, config.vocab_size, (M, ROWS, s)).astype(np.int32)
  attention = np.ones((M, ROWS, s), np.int32)
  attention[:, 0, :2] = 0  # a short prompt
  attention[:, 1, -3:] = 0  # a short response
  response = attention[:, :, PROMPT:].astype(np.float32)
  noise = lambda: rng.normal(size=(M, ROWS, RESPONSE)).astype(np.float32)  # noqa: E731
  return {
    "tokens": tokens,
    "attention_mask": attention,
    "response_mask": response,
    "old_logprobs": noise() - 6.0,
    "advantages": noise(),
    # Values far from the critic's outputs (about 0), so no token sits at the clipping
    # threshold where rounding alone could flip `value/clipfrac`.
    "old_values": noise() + 3.0,
    "returns": noise(),
  }


def _actor_loss(config):
  return functools.partial(
    steps.actor_loss, config=config, prompt_len=PROMPT, clip_eps=0.2, entropy_coef=0.01
  )


def _critic_loss(config):
  return functools.partial(steps.critic_loss, config=config, prompt_len=PROMPT, clip_eps=0.2)


def _on_mesh(params, config, head, mesh):
  shardings = rules.named_shardings(
    models.logical_axes(config, head), params, mesh, Layout.TRAINING
  )
  shardings["layers"] = jax.tree.map(
    lambda sh: NamedSharding(mesh, PartitionSpec("stage", *sh.spec[1:])), shardings["layers"]
  )
  return jax.device_put(params, shardings)


def _state(params, tx, mesh):
  """A train state on `mesh`: the counters replicated, the moments beside their parameters."""
  state = init_train_state(params, tx)
  replicated = NamedSharding(mesh, PartitionSpec())
  return jax.tree.map(
    lambda x: x if isinstance(x.sharding, NamedSharding) else jax.device_put(x, replicated), state
  )


def _reference_grads(loss_fn, params, batch):
  def micro(acc, mb):
    (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, mb)
    return jax.tree.map(jnp.add, acc, grads), metrics

  grads, metrics = jax.lax.scan(micro, steps.zero_gradients(params), batch)
  return jax.tree.map(lambda g: g / M, grads), jax.tree.map(jnp.mean, metrics)


def _relative_errors(got, want):
  def one(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))

  return jax.tree.leaves(jax.tree.map(one, got, want))


# Each program compiles once for the module: the unpipelined reference (remat 'none'; the remat
# policies give the same gradients, `test_model_kernels`), and each pipelined step of the tiny
# actor, which the fused update below reuses as its separate actor update.


@pytest.fixture(scope="module")
def config():
  return get_model_config("tiny", num_layers=4)


@pytest.fixture(scope="module")
def actor_params(config):
  return _init(config, "lm", jax.random.key(0))


@pytest.fixture(scope="module")
def batch(config):
  return _batch(config)


@pytest.fixture(scope="module")
def reference(config, actor_params, batch):
  """The unpipelined mean gradients and metrics of the actor's loss."""
  return jax.jit(functools.partial(_reference_grads, _actor_loss(config)))(actor_params, batch)


@pytest.fixture(scope="module")
def pipelined(config, actor_params, batch):
  """`pipelined(stages, schedule, remat) -> (grads, metrics)`: the actor's pipelined gradients
  over `_mesh(stages)`, each computed once; `pipelined.hlo(...)`: its compiled program's
  text."""
  done, jitted = {}, {}

  def args(stages):
    return _on_mesh(actor_params, config, "lm", _mesh(stages)), batch

  def run(stages: int, schedule: str, remat: str, recompute: bool = False):
    key = (stages, schedule, remat, recompute)
    if key not in done:
      jitted[key] = jax.jit(_grads_fn(config, stages, schedule, remat, recompute))
      done[key] = jitted[key](*args(stages))
    return done[key]

  def hlo(stages: int, schedule: str, remat: str, recompute: bool = False) -> str:
    run(stages, schedule, remat, recompute)
    return jitted[stages, schedule, remat, recompute].lower(*args(stages)).compile().as_text()

  run.hlo = hlo
  return run


def _grads_fn(config, stages, schedule, remat, recompute=False):
  """`(params, batch) -> (grads, metrics)` of the actor pipelined over `_mesh(stages)`."""
  model = config.replace(remat=remat)
  mesh = _mesh(stages)
  table = schedules.single(schedule, stages, M)

  def grads(params, batch):
    (g,), (metrics,) = pipeline.pipelined_grads(
      [pipeline.Model(model, _actor_loss(model), recompute)], table, mesh, [params], [batch]
    )
    return g, metrics

  return rules.constrained(grads, Layout.TRAINING, mesh)


@pytest.mark.parametrize(
  "stages,schedule,remat,recompute",
  [
    (2, "1f1b", "none", False),
    (2, "gpipe", "full", False),
    (4, "1f1b", "full", False),
    (4, "gpipe", "none", False),
    (2, "1f1b", "none", True),
  ],
)
def test_pipelined_gradients_match_unpipelined(
  stages, schedule, remat, recompute, reference, pipelined
):
  want, want_metrics = reference
  got, metrics = pipelined(stages, schedule, remat, recompute)
  assert max(_relative_errors(got, want)) < 1e-5
  for name, value in want_metrics.items():
    np.testing.assert_allclose(float(metrics[name]), float(value), rtol=1e-5, atol=1e-6)
  # The layer stack's gradients stay split over the stages, one block of layers each.
  kernel = got["layers"]["mlp"]["up_proj"]["kernel"]
  assert kernel.sharding.spec[0] == "stage"
  blocks = {(s.index[0].start, s.index[0].stop) for s in kernel.addressable_shards}
  assert blocks == {(i * 4 // stages, (i + 1) * 4 // stages) for i in range(stages)}


def _collectives(hlo: str, kind: str) -> list[tuple[list[tuple[int, ...]], str]]:
  """The `kind` collectives ('all-reduce', 'reduce-scatter', 'all-gather') of a compiled
  program's text: the shapes of each one's result (several for a tuple) and its replica
  groups as written."""
  import re

  found = []
  pattern = r"= (\(.*?\)|\w+\[[\d,]*\]\S*) " + kind + r"(?:-start)?\(.*?replica_groups="
  for result, groups in re.findall(pattern + r"(\{[{}\d,]*\}|[^ ,]+)", hlo):
    dims = re.findall(r"\[([\d,]*)\]", result)
    found.append(([tuple(int(n) for n in x.split(",") if n) for x in dims], groups))
  return found


def test_the_vocabulary_gradients_are_reduce_scattered_over_the_stages(config, pipelined):
  """The embedding's and the head's gradients leave the pipelined step split as the training
  layout holds them (vocabulary over tensor x stage): over the stages the compiled program
  reduce-scatters each, every device summing only its own shard and keeping its block, and
  all-reduces nothing larger than the final norm's gradient (an all-reduce of them moved
  about 4 times the bytes: the whole vocabulary), nor gathers any gradient first."""
  stages, fsdp, tensor = 2, 2, 2
  hlo = pipelined.hlo(stages, "1f1b", "none")
  ids = np.vectorize(lambda d: d.id)(_mesh(stages).devices)
  groups = np.moveaxis(ids, 0, -1).reshape(-1, stages)
  over_stages = "{" + ",".join("{" + ",".join(map(str, g)) + "}" for g in groups) + "}"
  vocab, d = config.vocab_size, config.hidden_size
  block = vocab // (tensor * stages) * (d // fsdp)  # one device's share of one of them
  scattered = [s for s, g in _collectives(hlo, "reduce-scatter") if g == over_stages]
  assert sorted(int(np.prod(s[0])) for s in scattered) == [block, block]
  reduced = [shape for s, g in _collectives(hlo, "all-reduce") if g == over_stages for shape in s]
  assert reduced and max(int(np.prod(shape)) for shape in reduced) <= d
  # The only gathers: the parameters' (each device's block of a stage, gathered whole).
  gathered = [int(np.prod(shape)) for s, _ in _collectives(hlo, "all-gather") for shape in s]
  assert gathered and max(gathered) == vocab // tensor * (d // fsdp)


def _count(jaxpr, primitive: str) -> int:
  """Equations of `primitive` in `jaxpr` and every jaxpr nested in its equations' parameters."""
  n = 0
  for eqn in jaxpr.eqns:
    n += eqn.primitive.name == primitive
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        inner = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's jaxpr, or a Jaxpr
        if hasattr(inner, "eqns"):
          n += _count(inner, primitive)
  return n


def _stage_branches(jaxpr) -> list:
  """The branches of the executor's `lax.switch` (idle, then per model forward first / mid /
  last, backward first / mid / last)."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "cond" and len(eqn.params["branches"]) == 1 + len(pipeline._OPS):
      return [b.jaxpr for b in eqn.params["branches"]]
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns") and (found := _stage_branches(inner)):
          return found
  return []


@pytest.mark.parametrize("remat", ["none", "full"])
def test_a_backward_runs_no_forward_again_unless_recomputing(config, actor_params, batch, remat):
  """Each backward op uses the residuals its forward kept: its matmuls are the two of every
  forward matmul (plus, with full remat, each layer's forward once more inside the model's own
  checkpoint), not a third pass; with `recompute` the stage's forward runs again."""
  params = _on_mesh(actor_params, config, "lm", _mesh(2))
  for recompute in (False, True):
    grads = _grads_fn(config, 2, "1f1b", remat, recompute)
    branches = _stage_branches(jax.make_jaxpr(grads)(params, batch).jaxpr)
    dots = [_count(b, "dot_general") for b in branches]
    _, f_first, _, f_last, b_first, _, b_last = dots
    assert f_first == f_last > 0
    # Full remat runs each layer's forward again in the backward: at most a forward's worth.
    bound = 2 * f_last + (f_last if remat == "full" else 0)
    kept_bound = b_last <= bound and b_first <= bound
    assert kept_bound != recompute, (remat, recompute, dots)


@pytest.mark.parametrize("critic_size", ["actor's", "smaller"])
def test_fused_update_equals_two_pipelined_updates(
  config, actor_params, batch, pipelined, critic_size
):
  """Actor and critic in one fused schedule (the critic's stages in the reverse device order,
  its state a view on the actor's mesh) give the parameters of two separate 1F1B updates; also
  with a critic of another size (RLHFuse fuses a 7B actor with a smaller critic): narrower and
  shallower, its activations padded to the actor's width between stages. That one runs one
  device a stage: XLA's CPU runtime waits for every device at a collective, and the two
  models' stages, running different ops in a tick, reach their own FSDP and tensor-parallel
  collectives at different points (measured: the rendezvous timed out)."""
  stages = 2
  actor_mesh, critic_mesh = _mesh(stages), _mesh(stages, reverse=True)
  critic_config = config
  if critic_size == "smaller":
    critic_config = config.replace(hidden_size=40, intermediate_size=88, num_layers=2)
    one = np.array(jax.devices()[:stages]).reshape(stages, 1, 1)
    actor_mesh = Mesh(one, ("stage", "fsdp", "tensor"))
    critic_mesh = Mesh(np.flip(one, 0), ("stage", "fsdp", "tensor"))
  # Plain SGD: its step is the gradient times the rate, so the parameters compare the
  # gradients. Adam divides by the root of the second moment, which turns a rounding-sized
  # difference of a near-zero gradient into a visible step (measured: 4.8e-6 on one element
  # under the suite's -O0 code generation).
  tx = optax.sgd(1e-2)
  critic_params = _init(critic_config, "value", jax.random.key(1))
  actor = _state(_on_mesh(actor_params, config, "lm", actor_mesh), tx, actor_mesh)
  critic = _state(_on_mesh(critic_params, critic_config, "value", critic_mesh), tx, critic_mesh)
  actor_model = pipeline.Model(config, _actor_loss(config))
  critic_model = pipeline.Model(critic_config, _critic_loss(critic_config))

  # Each model's separate 1F1B update; the same-size actor's from the 1F1B gradients of the
  # test above (the same program as `pipelined_update`'s, compiled once) and the update
  # `pipelined_update` applies to them.
  table = schedules.single("1f1b", stages, M)

  def separate(model, mesh):
    def update(state, batch):
      (state,), (metrics,) = pipeline.pipelined_update([model], [tx], table, mesh, [state], [batch])
      return state, metrics

    return jax.jit(rules.constrained(update, Layout.TRAINING, mesh))

  if critic_size == "smaller":
    want_actor, want_actor_metrics = separate(actor_model, actor_mesh)(actor, batch)
  else:
    apply = jax.jit(functools.partial(steps.apply_gradients, tx))
    want_actor, want_actor_metrics = apply(actor, *pipelined(stages, "1f1b", "none"))
  want_critic, want_critic_metrics = separate(critic_model, critic_mesh)(critic, batch)

  def fused(states, batches):
    return pipeline.fused_accumulate_and_apply(
      (actor_model, critic_model), (tx, tx), actor_mesh, states, batches
    )

  step = jax.jit(rules.constrained(fused, Layout.TRAINING, actor_mesh))
  (got_actor, got_critic), (actor_metrics, critic_metrics) = step(
    (actor, sharing.view_on(critic, actor_mesh)), (batch, batch)
  )
  got_critic = sharing.view_on(got_critic, critic_mesh)
  for got, want in ((got_actor, want_actor), (got_critic, want_critic)):
    leaves = zip(jax.tree.leaves(got.params), jax.tree.leaves(want.params), strict=True)
    for a, b in leaves:
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)
  for got, want in ((actor_metrics, want_actor_metrics), (critic_metrics, want_critic_metrics)):
    assert got.keys() == want.keys()
    for name in want:
      np.testing.assert_allclose(float(got[name]), float(want[name]), rtol=1e-6)
  # The critic's first layers really sit on the devices of the actor's last stage.
  kernel = got_critic.params["layers"]["mlp"]["up_proj"]["kernel"]
  first_block = {s.device for s in kernel.addressable_shards if s.index[0].start == 0}
  assert first_block == set(actor_mesh.devices[-1].flat)


def test_pipelined_weights_move_to_the_generation_layout(config, actor_params):
  """Weights laid out in stages (training) reach a rollout mesh (generation layout: tensor
  parallel, no stages) with every value where it belongs."""
  staged = _on_mesh(actor_params, config, "lm", _mesh(2))
  rollout_mesh = Mesh(np.array(jax.devices()[4:]).reshape(2, 2), ("data", "tensor"))
  shardings = rules.named_shardings(
    models.logical_axes(config, "lm"), actor_params, rollout_mesh, Layout.GENERATION
  )
  moved, _ = transfer.transfer(staged, shardings)
  for got, want, sharding in zip(
    jax.tree.leaves(moved), jax.tree.leaves(actor_params), jax.tree.leaves(shardings), strict=True
  ):
    assert got.sharding == sharding
    for shard in got.addressable_shards:
      np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(want)[shard.index])


def _stack_gathers(hlo: str, layers) -> list[tuple[int, ...]]:
  """The all-gathers of a compiled program (its text) whose result is a whole stack of layer
  weights: rank and leading dimension (the layer count) those of one of `layers`' leaves, the
  other dimensions whole or still split over fsdp / tensor."""
  import re

  kinds = {(x.ndim, x.shape[0]) for x in jax.tree.leaves(layers)}
  found = re.findall(r"= \w+\[([\d,]*)\][^=]* all-gather(?:-start)?\(", hlo)
  shapes = [tuple(int(d) for d in dims.split(",") if d) for dims in found]
  return [s for s in shapes if s and (len(s), s[0]) in kinds]


def test_pipelined_scoring_equals_unpipelined_and_gathers_no_layer_stack(config, actor_params):
  """Log-probs, values and sequence scores, padded and packed, on `stage=2 x fsdp=2 x tensor=2`
  as a forward-only pipeline (`pipeline.pipelined_forward`, 4 micro-batches of 2 rows) equal
  the unpipelined ones within 1e-5 (fp32: the same per-row sums, each stage's reductions
  ordered by XLA), and the compiled program gathers no stacked layer weights over the stages,
  which an unpipelined call on the same staged mesh does at every layer."""
  mesh = _mesh(2)
  params = _on_mesh(actor_params, config, "lm", mesh)
  value_params = _on_mesh(_init(config, "value", jax.random.key(1)), config, "value", mesh)
  rows = 8
  rng = np.random.default_rng(3)
  tokens = rng.integers(0, config.vocab_size, (rows, PROMPT + RESPONSE)).astype(np.int32)
  attention = np.ones_like(tokens)
  attention[0, :2] = 0
  attention[1, -3:] = 0
  assert schedules.scoring_micro_batches(rows, 2, 2) == 4
  scorers = {
    "logprobs": (
      functools.partial(steps.response_logprobs, config, prompt_len=PROMPT, temperature=0.7),
      params,
    ),
    "values": (functools.partial(steps.response_values, config, prompt_len=PROMPT), value_params),
    "scores": (functools.partial(steps.sequence_scores, config), value_params),
  }
  # Packed rows (`ppo.packing`): two samples a row, positions restarting at each, attention
  # within a segment; the packed scorers' functions, rows split into micro-batches alike.
  segments = np.where(np.arange(tokens.shape[1]) < 9, 1, 2) * np.ones_like(tokens)
  positions = np.where(segments == 1, np.arange(tokens.shape[1]), np.arange(tokens.shape[1]) - 9)
  packed_inputs = (tokens, positions.astype(np.int32), segments.astype(np.int32))
  scorers["packed logprobs"] = (
    lambda prm, *rows: models.packed_token_stats(config, prm, *rows, 0.7).logp_bt,
    params,
  )
  scorers["packed values"] = (
    functools.partial(models.forward_packed, config, head="value"),
    value_params,
  )
  for name, (fn, prm) in scorers.items():
    inputs = packed_inputs if name.startswith("packed") else (tokens, attention)
    staged = jax.jit(
      rules.constrained(
        functools.partial(pipeline.pipelined_forward, fn, config, mesh, 4), Layout.TRAINING, mesh
      )
    )
    got = staged(prm, *inputs)
    compiled = staged.lower(prm, *inputs).compile().as_text()
    want = jax.jit(fn)(jax.device_get(prm), *inputs)
    assert got.shape == want.shape, name
    assert max(_relative_errors(got, want)) < 1e-5, name
    assert not _stack_gathers(compiled, actor_params["layers"]), name
    if name == "logprobs":  # the check can fail: the unpipelined call gathers the stacks
      flat = jax.jit(rules.constrained(fn, Layout.TRAINING, mesh))
      flat_hlo = flat.lower(prm, tokens, attention).compile().as_text()
      assert _stack_gathers(flat_hlo, actor_params["layers"])


def test_pipelined_lora_gradients_are_the_adapters_and_match_unpipelined(config):
  """With adapters (the base frozen), the pipelined step's gradients are a tree of the
  adapters alone and equal the unpipelined ones (1e-5, as above). B starts at zero, so it is
  drawn here: then A's gradients are not zero either."""
  from rlhfjax.config.model import LoraConfig
  from rlhfjax.models import lora

  model = config.replace(lora=LoraConfig(rank=4))
  params = _init(model, "lm", jax.random.key(0))
  rng = np.random.default_rng(5)
  params = jax.tree_util.tree_map_with_path(
    lambda path, x: (
      jnp.asarray(rng.normal(size=x.shape) * 0.1, x.dtype) if "lora_b" in str(path) else x
    ),
    params,
  )
  loss = _actor_loss(model)
  batch = _batch(model, seed=1)
  want, want_metrics = jax.jit(functools.partial(_lora_reference_grads, loss))(params, batch)
  mesh = _mesh(2)
  table = schedules.single("1f1b", 2, M)

  def grads(prm, b):
    (g,), (metrics,) = pipeline.pipelined_grads(
      [pipeline.Model(model, loss)], table, mesh, [prm], [b]
    )
    return g, metrics

  got, metrics = jax.jit(rules.constrained(grads, Layout.TRAINING, mesh))(
    _on_mesh(params, model, "lm", mesh), batch
  )
  trained = lora.split(params)[0]
  assert jax.tree.structure(got) == jax.tree.structure(trained)
  assert {str(p[-1]) for p, _ in jax.tree_util.tree_leaves_with_path(got)} == {
    "['lora_a']",
    "['lora_b']",
  }
  assert max(_relative_errors(got, want)) < 1e-5
  assert all(float(np.max(np.abs(g))) > 0 for g in jax.tree.leaves(got))
  for name, value in want_metrics.items():
    np.testing.assert_allclose(float(metrics[name]), float(value), rtol=1e-5, atol=1e-6)


def _lora_reference_grads(loss_fn, params, batch):
  """The unpipelined mean gradients of the trained leaves (`steps.accumulate_and_apply`'s)."""
  from rlhfjax.models import lora

  trained, frozen = lora.split(params)

  def micro(acc, mb):
    (_, metrics), g = jax.value_and_grad(lambda t: loss_fn(lora.join(t, frozen), mb), has_aux=True)(
      trained
    )
    return jax.tree.map(jnp.add, acc, g), metrics

  grads, metrics = jax.lax.scan(micro, steps.zero_gradients(params), batch)
  return jax.tree.map(lambda g: g / M, grads), jax.tree.map(jnp.mean, metrics)


def test_packed_micro_batches_through_the_stages_sum_their_contributions(config, actor_params):
  """Three packed micro-batches of 2, 4 and 2 rows (`packed_update.stack_micro_batches`: padded
  to 4 rows and to 4 micro-batches, the last empty) through 2 stages of one device: the
  pipelined step's average of the contributions scaled by 4 (`packed_update.summed`) is their
  sum, the packed updates' gradient, and the empty micro-batch adds nothing."""
  from rlhfjax.flows import packed_update

  rng = np.random.default_rng(5)
  width = PROMPT + RESPONSE

  def micro(rows: int) -> dict[str, np.ndarray]:
    segments = np.where(np.arange(width) < 6, 1, 2) * np.ones((rows, width), np.int32)
    segments[0, 9:] = 0  # the end of a row left empty
    positions = np.where(segments == 2, np.arange(width) - 6, np.arange(width)) * (segments > 0)
    fields = {
      "tokens": rng.integers(0, config.vocab_size, (rows, width)).astype(np.int32),
      "positions": positions.astype(np.int32),
      "segments": segments.astype(np.int32),
      "old_logprobs": rng.normal(-3.0, 0.5, (rows, width)).astype(np.float32),
      "advantages": rng.normal(0.0, 1.0, (rows, width)).astype(np.float32),
    }
    weights = (rng.random((rows, width)) * (segments > 0)).astype(np.float32) / 40
    return {**fields, "weights": weights, "token_weights": weights}

  micros = [micro(2), micro(4), micro(2)]
  loss = functools.partial(steps.packed_actor_loss, config=config, clip_eps=0.2, entropy_coef=0.01)
  stacked = jax.jit(functools.partial(packed_update.stack_micro_batches, count=4))(tuple(micros))
  assert stacked["tokens"].shape == (4, 4, width)
  assert not np.any(np.asarray(stacked["weights"][3])) and np.all(stacked["sum_scale"] == 4)

  grad = jax.jit(jax.grad(lambda p, m: loss(p, m)[0]))
  want = functools.reduce(
    lambda a, b: jax.tree.map(jnp.add, a, b), [grad(actor_params, m) for m in micros]
  )
  mesh = Mesh(np.array(jax.devices()[:2]).reshape(2, 1, 1), ("stage", "fsdp", "tensor"))
  params = _on_mesh(actor_params, config, "lm", mesh)
  table = schedules.single("1f1b", 2, 4)
  model = pipeline.Model(config, packed_update.summed(loss))
  (got,), _ = jax.jit(
    rules.constrained(
      lambda p, b: pipeline.pipelined_grads([model], table, mesh, [p], [b]), Layout.TRAINING, mesh
    )
  )(params, stacked)
  assert max(_relative_errors(got, want)) < 1e-5
