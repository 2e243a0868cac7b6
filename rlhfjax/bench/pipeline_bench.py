"""Pipeline schedules of PPO's actor and critic: each schedule's bubble fraction from its table
(`rlhfjax.schedules`) and the measured time of its optimizer step (`rlhfjax.training.pipeline`).

Letters: m micro-batches, b rows of a micro-batch, s sequence length, p stages.

The actor (LM head, `steps.actor_loss`) and the critic (value head, `steps.critic_loss`) start
from random parameters and train on one random mini-batch `[m, b, s]` (left padding on some
rows). The devices form a `stage` x `fsdp` mesh; the critic's mesh is the actor's with the stage
axis reversed, as the placement strategies lay out a co-located critic, so the fused schedule
runs it in the reverse device order on views of the same buffers (`mesh.sharing.view_on`).
Schedules, one JSON row each:

* 'unpipelined': `steps.accumulate_and_apply` of the actor, then of the critic, on an `fsdp`
  mesh of the same devices (no stage axis, so no pipeline bubble): the baseline.
* 'gpipe', '1f1b': the actor alone, pipelined over the stages, each backward from the
  residuals its forward kept.
* '1f1b_recompute': the same 1F1B step, each backward running its stage's forward again from
  the stage's input (`pipeline.Model.recompute`, GPipe's re-materialisation).
* 'two_1f1b': a 1F1B step of the actor, then one of the critic: two programs.
* 'fused': both models' updates in one program, one fused schedule (`schedules.fused`).

Row fields: `schedule`, `stages`, `micro_batches`, `rows`, `seq`, `layers`; `bubble_fraction`
(unit costs) and `bubble_fraction_b2` (a backward twice a forward) from the table (`ticks`
long; 0 for the unpipelined baseline, which has none); `compile_s` (lowering and compiling
every program of the step); `step_s`, the median over `repeats` timed runs after the compile
(each run blocks until its results are ready; two programs' medians are summed); `device`,
`devices`; and the step's losses `actor_loss` / `critic_loss`, the same for every schedule
(the same parameters and batch), a check that each row ran the update it names; `flops`, the
compiled step's floating-point operations as XLA's cost analysis counts them (every branch of
the executor's `lax.switch` once, the loop of ticks once: a count to compare between rows, not
the step's work).

What the times say: the bubble fractions are properties of the schedules; the step times are
this machine's. On a CPU host the emulated devices are threads of one process sharing its cores
(2 on the machine the numbers in docs/benchmarks.md came from), so the stages do not run in
parallel and a bubble need not cost wall time: a stage that idles leaves the cores to the busy
ones. Differences between step times there may come from elsewhere (the fixed cost of each tick's
`lax.switch` and two `ppermute`s, one program against two, the `fsdp` width of the mesh) and
do not measure the fused schedule's gain, which needs one accelerator per stage.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rlhfjax import models, schedules
from rlhfjax.config.experiment import OptimizerConfig
from rlhfjax.config.model import ModelConfig, get_model_config
from rlhfjax.mesh import rules, sharing
from rlhfjax.placement.spec import Layout
from rlhfjax.placement.validate import check_layers
from rlhfjax.training import pipeline, steps
from rlhfjax.training.optimizer import make_optimizer
from rlhfjax.training.state import TrainState, init_train_state, train_state_shardings

SCHEDULES = ("unpipelined", "gpipe", "1f1b", "1f1b_recompute", "two_1f1b", "fused")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
  size: str = "tiny"
  layers: int = 4
  """num_layers (0: the size's own); the stages must divide it."""
  stages: int = 2
  micro_batches: int = 4
  rows: int = 8
  """Rows of one micro-batch."""
  seq: int = 32
  """Tokens of a row: a prompt of seq // 2, the rest the response."""
  repeats: int = 3
  devices: int = 8
  seed: int = 0
  schedules: tuple[str, ...] = SCHEDULES

  def __post_init__(self):
    if bad := [name for name in self.schedules if name not in SCHEDULES]:
      raise ValueError(f"unknown schedules {bad}; known: {', '.join(SCHEDULES)}")
    if self.stages < 2 or self.devices % self.stages:
      raise ValueError(f"stages={self.stages} must be >= 2 and divide devices={self.devices}")
    if self.micro_batches < 1 or self.rows < 1 or self.repeats < 1 or self.seq < 2:
      raise ValueError("micro_batches, rows and repeats must be >= 1 and seq >= 2")


def model_config(s: Settings) -> ModelConfig:
  config = get_model_config(s.size, **({"num_layers": s.layers} if s.layers else {}))
  check_layers(config, s.stages)
  return config


def meshes(s: Settings) -> tuple[Mesh, Mesh, Mesh]:
  """(the actor's `stage` x `fsdp` mesh, the critic's: the same with the stage axis reversed,
  the unpipelined baseline's `fsdp` mesh) over the first `devices` devices."""
  devices = np.array(jax.devices()[: s.devices])
  if devices.size != s.devices:
    raise ValueError(f"devices={s.devices} but JAX has {len(jax.devices())}")
  grid = devices.reshape(s.stages, s.devices // s.stages)
  names = (pipeline.AXIS, "fsdp")
  return Mesh(grid, names), Mesh(np.flip(grid, 0), names), Mesh(devices, ("fsdp",))


def batches(s: Settings, vocab: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
  """(the actor's, the critic's) random mini-batch `[m, b, ...]`: tokens of a prompt of
  s // 2 and a response, the first row of each micro-batch left-padded by two tokens."""
  rng = np.random.default_rng(s.seed)
  m, b, prompt = s.micro_batches, s.rows, s.seq // 2
  shape_mbt = (m, b, s.seq - prompt)
  tokens_mbs = rng.integers(3, vocab, (m, b, s.seq)).astype(np.int32)
  mask_mbs = np.ones((m, b, s.seq), np.int32)
  mask_mbs[:, 0, : min(2, prompt - 1)] = 0
  common = {
    "tokens": tokens_mbs,
    "attention_mask": mask_mbs,
    "response_mask": np.ones(shape_mbt, np.float32),
  }
  actor = {
    **common,
    "old_logprobs": -rng.uniform(0.5, 8.0, shape_mbt).astype(np.float32),
    "advantages": rng.normal(size=shape_mbt).astype(np.float32),
  }
  critic = {
    **common,
    "old_values": rng.normal(size=shape_mbt).astype(np.float32),
    "returns": rng.normal(size=shape_mbt).astype(np.float32),
  }
  return actor, critic


def _stage_split(sharding: NamedSharding) -> NamedSharding:
  """`sharding` with its leading (layers) dimension split over the stages."""
  spec = tuple(sharding.spec)
  return NamedSharding(sharding.mesh, PartitionSpec(pipeline.AXIS, *spec[1:]))


def place_state(config: ModelConfig, head: str, tx, mesh: Mesh, seed: int) -> TrainState:
  """A train state of random parameters on `mesh` in the training layout, the layer stack split
  over the stages when `mesh` has them."""
  params = models.init_params(config, head, jax.random.key(seed))
  axes = models.logical_axes(config, head)
  shardings = rules.named_shardings(axes, params, mesh, Layout.TRAINING)
  if pipeline.stages_of(mesh) > 1:
    shardings["layers"] = jax.tree.map(_stage_split, shardings["layers"])
  replicated = NamedSharding(mesh, PartitionSpec())
  state_shardings = train_state_shardings(shardings, params, tx, replicated)
  return jax.device_put(init_train_state(params, tx), state_shardings)


def place_batch(batch: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
  """Rows split over the mesh's batch axes (replicated over the stages)."""
  axes = {k: (None, "batch", *([None] * (v.ndim - 2))) for k, v in batch.items()}
  return jax.device_put(batch, rules.named_shardings(axes, batch, mesh, Layout.TRAINING))


TABLES: dict[str, Callable[[int, int], schedules.Schedule]] = {
  "gpipe": functools.partial(schedules.single, "gpipe"),
  "1f1b": functools.partial(schedules.single, "1f1b"),
  "two_1f1b": schedules.sequential,
  "fused": schedules.fused,
  "1f1b_recompute": functools.partial(schedules.single, "1f1b"),
}
"""Each pipelined schedule's table, from (stages, micro-batches)."""


def bubbles(s: Settings, name: str) -> dict[str, Any]:
  """The schedule's bubble fractions (unit costs; a backward twice a forward) and ticks."""
  if name not in TABLES:
    return {"bubble_fraction": 0.0, "bubble_fraction_b2": 0.0, "ticks": None}
  table = TABLES[name](s.stages, s.micro_batches)
  return {
    "bubble_fraction": schedules.bubble_fraction(table),
    "bubble_fraction_b2": schedules.bubble_fraction(table, 1.0, 2.0),
    "ticks": table.ticks,
  }


@dataclasses.dataclass(frozen=True)
class _Program:
  """One compiled step bound to its arguments, and the roles whose metrics it returns."""

  run: Callable[[], Any]
  roles: tuple[str, ...]
  compile_s: float
  flops: float


def _compile(fn: Callable, roles: tuple[str, ...], mesh: Mesh, *args) -> _Program:
  """`fn(*args) -> (states, per-role metrics)` compiled for `mesh` in the training layout."""
  start = time.perf_counter()
  compiled = jax.jit(rules.constrained(fn, Layout.TRAINING, mesh)).lower(*args).compile()
  seconds = time.perf_counter() - start
  flops = float((compiled.cost_analysis() or {}).get("flops", 0.0))
  return _Program(functools.partial(compiled, *args), roles, seconds, flops)


def _timed(program: _Program, repeats: int) -> tuple[float, dict[str, Any]]:
  """The median wall time of `repeats` runs, and the last run's metrics by role."""
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    _, metrics = jax.block_until_ready(program.run())
    times.append(time.perf_counter() - start)
  return statistics.median(times), dict(zip(program.roles, metrics, strict=True))


def run(s: Settings) -> Iterator[dict[str, Any]]:
  """One row per schedule of `s.schedules` (see the module docstring)."""
  config = model_config(s)
  prompt = s.seq // 2
  losses = {
    "actor": functools.partial(
      steps.actor_loss, config=config, prompt_len=prompt, clip_eps=0.2, entropy_coef=0.01
    ),
    "critic": functools.partial(steps.critic_loss, config=config, prompt_len=prompt, clip_eps=0.2),
  }
  heads, seeds = {"actor": "lm", "critic": "value"}, {"actor": s.seed, "critic": s.seed + 1}
  tx = make_optimizer(OptimizerConfig(), total_updates=10)
  actor_mesh, critic_mesh, flat_mesh = meshes(s)
  host_batches = dict(zip(("actor", "critic"), batches(s, config.vocab_size), strict=True))

  def state(role: str, mesh: Mesh) -> TrainState:
    return place_state(config, heads[role], tx, mesh, seeds[role])

  def unpipelined(role: str) -> _Program:
    def step(state, batch):
      state, metrics = steps.accumulate_and_apply(losses[role], tx, state, batch)
      return state, (metrics,)

    batch = place_batch(host_batches[role], flat_mesh)
    return _compile(step, (role,), flat_mesh, state(role, flat_mesh), batch)

  def pipelined(
    roles: tuple[str, ...], table: schedules.Schedule, mesh: Mesh, states, recompute=False
  ) -> _Program:
    """`roles` updated by `table` on `mesh`, from `states` laid out there."""
    models = [pipeline.Model(config, losses[role], recompute) for role in roles]

    def step(states, batches):
      return pipeline.pipelined_update(models, [tx] * len(roles), table, mesh, states, batches)

    batch_list = [place_batch(host_batches[role], mesh) for role in roles]
    return _compile(step, roles, mesh, states, batch_list)

  def programs(name: str) -> list[_Program]:
    p, m = s.stages, s.micro_batches
    if name == "unpipelined":
      return [unpipelined("actor"), unpipelined("critic")]
    if name == "two_1f1b":
      one = schedules.single("1f1b", p, m)
      return [
        pipelined(("actor",), one, actor_mesh, [state("actor", actor_mesh)]),
        pipelined(("critic",), one, critic_mesh, [state("critic", critic_mesh)]),
      ]
    if name == "fused":
      # The critic laid out on its own mesh (stage axis reversed), viewed on the actor's.
      critic = sharing.view_on(state("critic", critic_mesh), actor_mesh)
      states = [state("actor", actor_mesh), critic]
      return [pipelined(("actor", "critic"), TABLES[name](p, m), actor_mesh, states)]
    recompute = name == "1f1b_recompute"
    return [
      pipelined(("actor",), TABLES[name](p, m), actor_mesh, [state("actor", actor_mesh)], recompute)
    ]

  for name in s.schedules:
    compiled = programs(name)
    row: dict[str, Any] = {
      "schedule": name,
      "stages": 1 if name == "unpipelined" else s.stages,
      "micro_batches": s.micro_batches,
      "rows": s.rows,
      "seq": s.seq,
      "layers": config.num_layers,
      **bubbles(s, name),
      "step_s": 0.0,
      "compile_s": sum(program.compile_s for program in compiled),
      "flops": sum(program.flops for program in compiled),
    }
    for program in compiled:
      seconds, metrics = _timed(program, s.repeats)
      row["step_s"] += seconds
      for role, key in (("actor", "loss/policy"), ("critic", "loss/value")):
        if role in metrics:
          row[f"{role}_loss"] = float(metrics[role][key])
    row["device"] = jax.devices()[0].device_kind
    row["devices"] = s.devices
    yield row
