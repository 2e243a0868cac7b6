"""Pipeline-parallel train steps (`rlhfjax.training.pipeline`) against the unpipelined ones.

Gradients are compared leaf by leaf as max |pipelined - reference| / max |reference|, within
1e-5: both sum the same fp32 per-micro-batch gradients in the same micro-batch order, and
differ only in how XLA fuses and orders each stage's reductions (a few fp32 ulps, 1.2e-7 each,
per reduction of at most a few hundred terms here); measured: under 1e-6.
"""

import functools
import json
import os
import subprocess
import sys

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

M, ROWS, PROMPT, RESPONSE = 4, 4, 5, 6


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


@pytest.mark.parametrize(
  "stages,schedule,remat",
  [(2, "1f1b", "none"), (2, "gpipe", "full"), (4, "1f1b", "full"), (4, "gpipe", "none")],
)
def test_pipelined_gradients_match_unpipelined(stages, schedule, remat):
  config = get_model_config("tiny", num_layers=4, remat=remat)
  mesh = _mesh(stages)
  params = models.init_params(config, "lm", jax.random.key(0))
  batch = _batch(config)
  loss_fn = _actor_loss(config)
  want, want_metrics = jax.jit(functools.partial(_reference_grads, loss_fn))(params, batch)

  table = schedules.single(schedule, stages, M)

  def grads(params, batch):
    (g,), (metrics,) = pipeline.pipelined_grads(
      [pipeline.Model(config, loss_fn)], table, mesh, [params], [batch]
    )
    return g, metrics

  step = jax.jit(rules.constrained(grads, Layout.TRAINING, mesh))
  got, metrics = step(_on_mesh(params, config, "lm", mesh), batch)
  assert max(_relative_errors(got, want)) < 1e-5
  for name, value in want_metrics.items():
    np.testing.assert_allclose(float(metrics[name]), float(value), rtol=1e-5, atol=1e-6)
  # The layer stack's gradients stay split over the stages, one block of layers each.
  kernel = got["layers"]["mlp"]["up_proj"]["kernel"]
  assert kernel.sharding.spec[0] == "stage"
  blocks = {(s.index[0].start, s.index[0].stop) for s in kernel.addressable_shards}
  assert blocks == {(i * 4 // stages, (i + 1) * 4 // stages) for i in range(stages)}


def test_layers_must_divide_over_stages():
  with pytest.raises(ValueError, match="num_layers=3 does not split into .*pipeline_stages=2"):
    pipeline.check_layers(get_model_config("tiny", num_layers=3), 2)


def test_fused_update_equals_two_pipelined_updates():
  """Actor and critic in one fused schedule (the critic's stages in the reverse device order,
  its state a view on the actor's mesh) give the parameters of two separate 1F1B updates."""
  stages = 2
  config = get_model_config("tiny", num_layers=4)
  actor_mesh, critic_mesh = _mesh(stages), _mesh(stages, reverse=True)
  # Plain SGD: its step is the gradient times the rate, so the parameters compare the
  # gradients. Adam divides by the root of the second moment, which turns a rounding-sized
  # difference of a near-zero gradient into a visible step (measured: 4.8e-6 on one element
  # under the suite's -O0 code generation).
  tx = optax.sgd(1e-2)
  actor_params = models.init_params(config, "lm", jax.random.key(0))
  critic_params = models.init_params(config, "value", jax.random.key(1))
  actor = _state(_on_mesh(actor_params, config, "lm", actor_mesh), tx, actor_mesh)
  critic = _state(_on_mesh(critic_params, config, "value", critic_mesh), tx, critic_mesh)
  batch = _batch(config)
  actor_model = pipeline.Model(config, _actor_loss(config))
  critic_model = pipeline.Model(config, _critic_loss(config))

  def separate(model, mesh):
    table = schedules.single("1f1b", stages, M)

    def step(state, batch):
      (state,), (metrics,) = pipeline.pipelined_update([model], [tx], table, mesh, [state], [batch])
      return state, metrics

    return jax.jit(rules.constrained(step, Layout.TRAINING, mesh))

  want_actor, want_actor_metrics = separate(actor_model, actor_mesh)(actor, batch)
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
    for name in want:
      np.testing.assert_allclose(float(got[name]), float(want[name]), rtol=1e-6)
  # The critic's first layers really sit on the devices of the actor's last stage.
  kernel = got_critic.params["layers"]["mlp"]["up_proj"]["kernel"]
  first_block = {s.device for s in kernel.addressable_shards if s.index[0].start == 0}
  assert first_block == set(actor_mesh.devices[-1].flat)


def test_pipelined_weights_move_to_the_generation_layout():
  """Weights laid out in stages (training) reach a rollout mesh (generation layout: tensor
  parallel, no stages) with every value where it belongs."""
  config = get_model_config("tiny", num_layers=4)
  params = models.init_params(config, "lm", jax.random.key(0))
  staged = _on_mesh(params, config, "lm", _mesh(2))
  rollout_mesh = Mesh(np.array(jax.devices()[4:]).reshape(2, 2), ("data", "tensor"))
  shardings = rules.named_shardings(
    models.logical_axes(config, "lm"), params, rollout_mesh, Layout.GENERATION
  )
  moved, _ = transfer.transfer(staged, shardings)
  for got, want, sharding in zip(
    jax.tree.leaves(moved), jax.tree.leaves(params), jax.tree.leaves(shardings), strict=True
  ):
    assert got.sharding == sharding
    for shard in got.addressable_shards:
      np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(want)[shard.index])


# ---------------------------------------------------------------------------------------------
# End to end: scripts/train_ppo.py with a pipelined actor and critic, separate and fused.

_SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")
_PPO = (
  sys.executable,
  os.path.join(_SCRIPT, "train_ppo.py"),
  f"--config={os.path.join(os.path.dirname(_SCRIPT), 'configs', 'ppo_tiny.py')}",
  # One device and one layer a stage: a collective inside a stage (FSDP, tensor parallel) of a
  # pipelined step can hang XLA's CPU runtime (see `rlhfjax.cluster.cluster._alone`); the
  # gradient tests above cover stages of several devices.
  "--config.model.overrides={'num_layers': 8}",
  "--config.ppo.packing=False",  # pipelines run padded micro-batches
  "--config.ppo.micro_batches=4",  # 4 micro-batches of 2 rows through the stages
  "--config.eval.num_prompts=0",
  # A constant learning rate: a rerun that extends `total_steps` then repeats the longer run.
  "--config.actor_optimizer.decay=constant",
  "--config.critic_optimizer.decay=constant",
)
_COMPARED = (
  "reward/mean",
  "response/length",
  "kl/mean",
  "loss/policy",
  "loss/value",
  "policy/entropy",
  "policy/approx_kl",
  "actor/grad_norm",
  "critic/grad_norm",
)
"""Not `value/clipfrac`: in the first epoch the critic's values equal the old values up to
rounding, where the clipped and unclipped errors tie and rounding alone decides the count."""


def _ppo(workdir, steps: int, *extra: str) -> list[dict]:
  done = subprocess.run(
    [*_PPO, f"--workdir={workdir}", f"--config.total_steps={steps}", *extra],
    capture_output=True,
    text=True,
    timeout=900,
  )
  assert done.returncode == 0, (workdir.name, steps, done.stderr[-3000:])
  rows = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
  return rows, done.stdout + done.stderr


@pytest.mark.slow
def test_pipelined_and_fused_ppo_give_the_unpipelined_numbers(tmp_path):
  plain, _ = _ppo(tmp_path / "plain", 3)
  staged, _ = _ppo(tmp_path / "staged", 2, "--config.placement.pipeline_stages=8")
  fused_flags = ("--config.placement.pipeline_stages=8", "--config.ppo.fuse_actor_critic=True")
  _ppo(tmp_path / "fused", 2, *fused_flags)
  # Extended by a rerun: it resumes the reversed critic's checkpoint and trains one step more.
  fused, log = _ppo(tmp_path / "fused", 3, *fused_flags)
  assert "resuming from the checkpoint of step 2" in log
  assert [r["step"] for r in plain] == [r["step"] for r in fused] == [0, 1, 2]
  assert [r["step"] for r in staged] == [0, 1]
  for want, *gots in zip(plain, staged, fused, strict=False):
    for got in gots:
      for key in _COMPARED:
        # Measured: at most 2.9e-5 relative (kl/mean at step 1, a mean of differences near 0),
        # the rest under 1e-6: the same maths, reduced in another order by the stages.
        assert got[key] == pytest.approx(want[key], rel=5e-5, abs=1e-7), (want["step"], key)
  assert fused[2]["loss/policy"] == pytest.approx(plain[2]["loss/policy"], rel=5e-5, abs=1e-7)
  assert plain[0]["loss/policy"] != plain[1]["loss/policy"]  # training moved the numbers
  # Fused, the critic has no update stage of its own: it trains inside the actor's.
  assert _updating(tmp_path / "fused") == {"actor"}
  assert _updating(tmp_path / "staged") == {"actor", "critic"}


def _updating(workdir) -> set[str]:
  """The roles with an update stage in a run's timeline."""
  stages = json.loads((workdir / "timeline.json").read_text())
  return {s["role"] for s in stages if s["stage"] == "update"}


def test_packing_refuses_pipeline_stages(tmp_path):
  done = subprocess.run(
    [
      *_PPO[:3],
      f"--workdir={tmp_path}",
      "--config.model.overrides={'num_layers': 4}",
      "--config.placement.pipeline_stages=2",
    ],
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert done.returncode != 0
  assert done.stderr.strip().splitlines()[-1] == (
    "error: packed updates do not run through pipeline stages: set 'ppo.packing=False' with "
    "'placement.pipeline_stages'=2"
  )
