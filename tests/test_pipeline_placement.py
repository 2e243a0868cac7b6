"""The `stage` mesh axis of the training layout: config, strategies (the critic's stages
reversed on the actor's devices), explicit specs, checks, and the rules that split the layer
stack over stages."""

import dataclasses
import pathlib
import runpy

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from rlhfjax import models, schedules
from rlhfjax.config import (
  ConfigError,
  ExplicitPlacementSection,
  ExplicitRoleSection,
  PlacementSection,
  choices,
  from_config_dict,
)
from rlhfjax.config import model as model_config
from rlhfjax.mesh import rules
from rlhfjax.mesh.meshes import make_mesh
from rlhfjax.placement import (
  Layout,
  PlacementError,
  PlacementSpec,
  Role,
  RoleSpec,
  build_placement,
  colocated,
  disaggregated,
  from_explicit,
  interleaved,
  reverse_stages,
)
from rlhfjax.placement.validate import check_fusable, check_spec
from rlhfjax.planner.place import place, plan_placement

pytestmark = pytest.mark.unit

REPO = pathlib.Path(__file__).resolve().parents[1]
TRAINING_ROLES = (Role.ACTOR, Role.CRITIC, Role.REFERENCE, Role.REWARD)
FOUR_LAYERS = {"num_layers": 4}
"""The tiny model has 3 layers (a prime): 2 stages need an even count."""


def _flipped(spec: RoleSpec) -> tuple[int, ...]:
  """The devices of `spec` with axis 0 of its device grid flipped (NumPy, independent of
  `reverse_stages`'s block arithmetic)."""
  grid = np.asarray(spec.devices).reshape(spec.axis_sizes)
  return tuple(np.flip(grid, axis=0).reshape(-1).tolist())


def _axes(stage, fsdp, tensor=1):
  return (("stage", stage), ("data", 1), ("fsdp", fsdp), ("tensor", tensor))


def _shipped(name: str, stages: int = 1, **model_overrides):
  """configs/<name>.py's ConfigDict with `placement.pipeline_stages` and model overrides set."""
  config = runpy.run_path(str(REPO / "configs" / f"{name}.py"))["get_config"]()
  config.placement.pipeline_stages = stages
  config.model.overrides = model_overrides
  return config


# --- RoleSpec -----------------------------------------------------------------------------------


def test_role_spec_training_puts_stage_first_only_when_pipelined():
  assert RoleSpec.training(range(8), fsdp=8).axes == (("data", 1), ("fsdp", 8), ("tensor", 1))
  assert RoleSpec.training(range(8), fsdp=8).stages == 1
  spec = RoleSpec.training(range(8), stage=2, fsdp=2, tensor=2)
  assert spec.axes == _axes(2, 2, 2)
  assert (spec.stages, spec.mesh_size) == (2, 8)


def test_reverse_stages_flips_the_stage_axis_of_the_device_grid():
  spec = RoleSpec.training((3, 1, 4, 0, 5, 2, 7, 6), stage=4, fsdp=2)
  assert reverse_stages(spec).devices == _flipped(spec) == (7, 6, 5, 2, 4, 0, 3, 1)
  assert reverse_stages(spec).axes == spec.axes
  unpipelined = RoleSpec.training(range(4), fsdp=4)
  assert reverse_stages(unpipelined) == unpipelined


# --- Strategies ---------------------------------------------------------------------------------


def _check_critic_reversed(spec: PlacementSpec) -> None:
  actor, critic = spec[Role.ACTOR], spec[Role.CRITIC]
  assert critic.axes == actor.axes
  assert critic.devices == _flipped(actor)
  assert critic.devices != actor.devices
  assert spec.colocated(Role.ACTOR, Role.CRITIC)
  # Critic stage j on the devices of actor stage P - 1 - j.
  p = actor.stages
  actor_grid = np.asarray(actor.devices).reshape(p, -1)
  critic_grid = np.asarray(critic.devices).reshape(p, -1)
  for j in range(p):
    np.testing.assert_array_equal(critic_grid[j], actor_grid[p - 1 - j])


def test_colocated_with_two_stages():
  spec = colocated(8, pipeline_stages=2)
  check_spec(spec, 8)
  for role in TRAINING_ROLES:
    assert spec[role].axes == _axes(2, 4), role
  for role in (Role.ACTOR, Role.REFERENCE, Role.REWARD):
    assert spec[role].devices == tuple(range(8)), role
  assert spec[Role.CRITIC].devices == (4, 5, 6, 7, 0, 1, 2, 3)
  _check_critic_reversed(spec)
  assert spec[Role.ROLLOUT] == colocated(8)[Role.ROLLOUT]


def test_colocated_with_stages_and_tensor():
  spec = colocated(8, tensor=2, rollout_tensor=2, pipeline_stages=2)
  check_spec(spec, 8)
  assert spec[Role.ACTOR].axes == _axes(2, 2, 2)
  _check_critic_reversed(spec)
  spec = colocated(8, pipeline_stages=4)
  assert spec[Role.ACTOR].axes == _axes(4, 2)
  assert spec[Role.CRITIC].devices == (6, 7, 4, 5, 2, 3, 0, 1)


def test_interleaved_with_two_stages():
  spec = interleaved(8, pipeline_stages=2)
  check_spec(spec, 8)
  assert spec[Role.ACTOR] == RoleSpec.training(range(8), stage=2, fsdp=4)
  _check_critic_reversed(spec)
  assert spec[Role.REFERENCE] == RoleSpec.training((0, 1, 2, 3), stage=2, fsdp=2)
  assert spec[Role.REWARD] == RoleSpec.training((4, 5, 6, 7), stage=2, fsdp=2)
  assert spec[Role.ROLLOUT] == interleaved(8)[Role.ROLLOUT]


def test_interleaved_split_keeps_each_half_in_stage_order():
  spec = interleaved(8, split_actor_critic=True, pipeline_stages=2)
  check_spec(spec, 8)
  assert spec[Role.ACTOR] == RoleSpec.training((0, 1, 2, 3), stage=2, fsdp=2)
  # Not the actor's devices, so not reversed: nothing to fuse with.
  assert spec[Role.CRITIC] == RoleSpec.training((4, 5, 6, 7), stage=2, fsdp=2)
  assert not spec.colocated(Role.ACTOR, Role.CRITIC)


def test_disaggregated_with_two_stages():
  spec = disaggregated(8, pipeline_stages=2, rollout_tensor=2)
  check_spec(spec, 8)
  for role in (Role.ACTOR, Role.REFERENCE, Role.REWARD):
    assert spec[role] == RoleSpec.training((0, 1, 2, 3), stage=2, fsdp=2), role
  assert spec[Role.CRITIC].devices == (2, 3, 0, 1)
  _check_critic_reversed(spec)
  assert spec[Role.ROLLOUT] == disaggregated(8, rollout_tensor=2)[Role.ROLLOUT]
  split = disaggregated(8, pipeline_stages=2, split_actor_critic=True)
  assert split[Role.ACTOR] == RoleSpec.training((0, 1), stage=2, fsdp=1)
  assert split[Role.CRITIC] == RoleSpec.training((2, 3), stage=2, fsdp=1)


def test_build_placement_reads_pipeline_stages():
  section = PlacementSection(strategy="interleaved", pipeline_stages=2, tensor=2)
  assert build_placement(section, 8) == interleaved(8, tensor=2, pipeline_stages=2)


def test_one_stage_changes_no_spec():
  for spec in (colocated(8), interleaved(8), disaggregated(8)):
    for role in TRAINING_ROLES:
      assert spec[role].axis_names == ("data", "fsdp", "tensor"), role
    assert spec[Role.CRITIC].devices == spec[Role.ACTOR].devices or not spec.colocated(
      Role.ACTOR, Role.CRITIC
    )


@pytest.mark.parametrize(
  "build, message",
  [
    (
      lambda: colocated(8, pipeline_stages=3),
      r"^actor: placement\.pipeline_stages=3 does not divide its 8 devices; set "
      r"placement\.pipeline_stages to one of 1, 2, 4 or 8$",
    ),
    (
      lambda: colocated(8, tensor=2, pipeline_stages=8),
      r"^actor: placement\.pipeline_stages=8 does not divide its 8 devices \(4 tensor groups "
      r"of placement\.tensor=2\); set placement\.pipeline_stages to one of 1, 2 or 4$",
    ),
    (
      lambda: interleaved(8, pipeline_stages=8),
      r"^reference: placement\.pipeline_stages=8 does not divide its 4 devices",
    ),
    (
      lambda: disaggregated(8, rollout_fraction=0.25, pipeline_stages=4),
      r"^actor: placement\.pipeline_stages=4 does not divide its 6 devices",
    ),
  ],
)
def test_indivisible_stages_raise_one_line_error(build, message):
  with pytest.raises(PlacementError, match=message):
    build()


# --- Explicit -----------------------------------------------------------------------------------


def _explicit(critic_devices=(4, 5, 6, 7, 0, 1, 2, 3), **actor_axes):
  everything = tuple(range(8))
  axes = actor_axes or {"stage": 2, "fsdp": 4}
  return ExplicitPlacementSection(
    actor=ExplicitRoleSection(devices=everything, axes=axes),
    critic=ExplicitRoleSection(devices=critic_devices, axes=axes),
    reference=ExplicitRoleSection(devices=everything, axes={"fsdp": 8}),
    reward=ExplicitRoleSection(devices=everything, axes={"stage": 1, "fsdp": 8}),
    rollout=ExplicitRoleSection(devices=everything, axes={"data": 4, "tensor": 2}),
    colocate=(tuple(r.value for r in Role),),
  )


def test_explicit_takes_a_stage_axis():
  spec = from_explicit(_explicit())
  check_spec(spec, 8)
  assert spec[Role.ACTOR].axes == _axes(2, 4)
  assert spec[Role.CRITIC].devices == (4, 5, 6, 7, 0, 1, 2, 3)  # as written
  # 'stage' left out, or given as 1, is no axis at all: the spec of before pipelines.
  assert (
    spec[Role.REFERENCE].axes
    == spec[Role.REWARD].axes
    == (
      ("data", 1),
      ("fsdp", 8),
      ("tensor", 1),
    )
  )
  check_fusable(spec)


def test_explicit_stage_axis_errors():
  with pytest.raises(
    PlacementError, match=r"^actor: mesh axes stage=3 x data=1 x fsdp=4 x tensor=1 = 12 devices"
  ):
    check_spec(from_explicit(_explicit(stage=3, fsdp=4)), 8)
  section = dataclasses.replace(
    _explicit(),
    rollout=dataclasses.replace(_explicit().rollout, axes={"stage": 2, "data": 2, "tensor": 2}),
  )
  with pytest.raises(PlacementError, match=r"^rollout: unknown mesh axis 'stage'"):
    check_spec(from_explicit(section), 8)
  misordered = RoleSpec(
    devices=tuple(range(8)),
    axes=(("data", 1), ("stage", 2), ("fsdp", 4), ("tensor", 1)),
    layout=Layout.TRAINING,
  )
  spec = from_explicit(_explicit())
  spec = dataclasses.replace(spec, roles={**spec.roles, Role.ACTOR: misordered})
  with pytest.raises(
    PlacementError,
    match=r"^actor: the training layout needs mesh axes \(stage, data, fsdp, tensor\) in this "
    r"order, got \(data, stage, fsdp, tensor\)$",
  ):
    check_spec(spec, 8)


def test_check_fusable_needs_pipelined_actor_and_critic_on_the_same_devices():
  other_mesh = dataclasses.replace(
    _explicit(), critic=dataclasses.replace(_explicit().critic, axes={"stage": 4, "fsdp": 2})
  )
  with pytest.raises(PlacementError, match=r"^ppo\.fuse_actor_critic needs the actor and critic"):
    check_fusable(from_explicit(other_mesh))
  disjoint = dataclasses.replace(
    _explicit(critic_devices=(0, 1, 2, 3)),
    critic=dataclasses.replace(_explicit().critic, devices=(0, 1, 2, 3), axes={"stage": 2}),
  )
  with pytest.raises(PlacementError, match=r"^ppo\.fuse_actor_critic needs the actor and critic"):
    check_fusable(from_explicit(disjoint))
  with pytest.raises(PlacementError, match=r"^ppo\.fuse_actor_critic needs pipelined"):
    check_fusable(colocated(8))
  with pytest.raises(PlacementError, match=r"the flow has no critic$"):
    check_fusable(colocated(8, pipeline_stages=2).only([Role.ACTOR, Role.ROLLOUT]))


# --- Config -------------------------------------------------------------------------------------


def test_pipeline_config_defaults_and_choices():
  section = PlacementSection()
  assert (section.pipeline_stages, section.pipeline_schedule) == (1, "1f1b")
  assert choices.PIPELINE_SCHEDULES == schedules.SCHEDULES
  for name in schedules.SCHEDULES:
    assert PlacementSection(pipeline_schedule=name).pipeline_schedule == name


@pytest.mark.parametrize(
  "sections, message",
  [
    (
      {"placement": {"pipeline_schedule": "zb"}},
      r"^'placement\.pipeline_schedule' must be one of gpipe, 1f1b, got 'zb'$",
    ),
    ({"placement": {"pipeline_stages": 0}}, r"^'placement\.pipeline_stages' must be >= 1, got 0$"),
    (
      {"placement": {"strategy": "auto", "pipeline_stages": 2}},
      r"^'placement\.pipeline_stages'=2 does not apply to placement\.strategy=auto: ",
    ),
    (
      {"placement": {"strategy": "explicit", "pipeline_stages": 2}},
      r"^'placement\.pipeline_stages'=2 does not apply to placement\.strategy=explicit: ",
    ),
    (
      {"ppo": {"fuse_actor_critic": True}},
      r"^'ppo\.fuse_actor_critic' fuses two pipelines: set 'placement\.pipeline_stages' > 1$",
    ),
    (
      {
        "ppo": {"fuse_actor_critic": True},
        "placement": {"strategy": "interleaved", "pipeline_stages": 2, "split_actor_critic": True},
      },
      r"^'ppo\.fuse_actor_critic' needs the actor and critic on the same devices",
    ),
  ],
)
def test_bad_pipeline_config_raises_one_line_error(sections, message):
  with pytest.raises(ConfigError, match=message):
    from_config_dict({"model": {"size": "tiny"}, **sections})


def test_a_fused_run_leaves_its_stages_to_auto():
  """`strategy=auto` with `ppo.fuse_actor_critic` chooses a placement the fused step runs on:
  actor and critic pipelined on the same devices, the critic's stages reversed."""
  from rlhfjax.planner import auto

  cfg = from_config_dict(
    {
      "model": {"size": "tiny", "overrides": {"num_layers": 4}},
      "ppo": {"fuse_actor_critic": True},
      "placement": {"strategy": "auto", "hardware": "h100"},
    }
  )
  assert cfg.ppo.fuse_actor_critic and cfg.placement.pipeline_stages == 1
  spec, plans = auto.choose(cfg, 8)
  check_fusable(spec)
  assert spec[Role.ACTOR].stages > 1 and plans[0].label.endswith("fused")


def test_auto_recomputes_the_stages_where_only_that_fits():
  """A 13B PPO without remat in 8 micro-batches fits no placement on 8 H100 whose pipelines keep
  every micro-batch's residuals: `auto` plans stages that run their forwards again in their
  backwards (the spec says so: `Cluster` builds its pipelined steps so), as it does with
  `placement.pipeline_recompute`; a job no placement fits at all is one line."""
  from rlhfjax.placement.validate import PlacementError
  from rlhfjax.planner import auto

  config = {
    "model": {"size": "13b", "roles": {r: {"remat": "none"} for r in ("actor", "critic")}},
    "rollout": {"max_prompt_len": 1023, "max_new_tokens": 1024, "batch_size": 64},
    "ppo": {"micro_batches": 8},
    "placement": {"strategy": "auto", "hardware": "h100"},
  }
  spec, plans = auto.choose(from_config_dict(config), 8)
  assert spec.pipeline_recompute and spec[Role.ACTOR].stages == 2
  assert "pp=2" in plans[0].label and plans[0].label.endswith(" recompute")
  config["placement"]["pipeline_recompute"] = True
  asked, plans = auto.choose(from_config_dict(config), 8)
  assert not asked.pipeline_recompute and asked.roles == spec.roles and "pp=2" in plans[0].label
  config["rollout"]["max_new_tokens"] = 3072  # 4k-token rows: nothing fits
  with pytest.raises(PlacementError, match=r"^placement.strategy=auto: no placement fits"):
    auto.choose(from_config_dict(config), 8)


def _shipped_experiments():
  """(name, ConfigDict) of every shipped experiment config with a placement section."""
  out = []
  for path in sorted((REPO / "configs").glob("*.py")):
    config = runpy.run_path(str(path))["get_config"]()
    stages = list(config.values()) if "ppo" in config and "sft" in config else [config]
    out += [(path.name, stage) for stage in stages if "placement" in stage]
  return out


def test_pipeline_stages_override_on_every_shipped_config():
  experiments = _shipped_experiments()
  assert "ppo_tiny.py" in [name for name, _ in experiments]
  for name, config in experiments:
    # What `--config.placement.pipeline_stages=2` does: the key must exist to be overridden.
    assert "pipeline_stages" in config.placement, name
    if config.model.lora.rank:
      continue  # adapters refuse pipeline stages (tests/test_lora.py)
    config.placement.pipeline_stages = 2
    config.placement.pipeline_schedule = "gpipe"
    parsed = from_config_dict(config)
    assert parsed.placement.pipeline_stages == 2, name
    assert parsed.placement.pipeline_schedule == "gpipe", name
  ppo = _shipped("ppo_tiny", stages=2)
  ppo.ppo.fuse_actor_critic = True
  assert from_config_dict(ppo).ppo.fuse_actor_critic


# --- Checks against the models ------------------------------------------------------------------


def test_layers_must_divide_over_stages():
  config = _shipped("ppo_tiny", stages=2)
  with pytest.raises(
    PlacementError,
    match=r"^actor: model\.num_layers=3 does not split into placement\.pipeline_stages=2 "
    r"stages \(stage counts that do: 1, 3\)$",
  ):
    plan_placement(from_config_dict(config), 8)
  config.model.overrides = FOUR_LAYERS
  config.ppo.fuse_actor_critic = True
  spec = plan_placement(from_config_dict(config), 8)
  assert spec[Role.ACTOR].axes == _axes(2, 4)
  _check_critic_reversed(spec)


def test_fused_plan_needs_a_critic():
  config = _shipped("grpo_tiny", stages=2, **FOUR_LAYERS)
  config.ppo.fuse_actor_critic = True
  with pytest.raises(PlacementError, match=r"the flow has no critic$"):
    plan_placement(from_config_dict(config), 8)


def test_single_role_flow_with_stages():
  config = _shipped("sft_tiny", stages=2)
  with pytest.raises(
    PlacementError,
    match=r"^model\.num_layers=3 does not split into placement\.pipeline_stages=2 "
    r"stages \(stage counts that do: 1, 3\)$",
  ):
    place(from_config_dict(config), 8)
  config.model.overrides = FOUR_LAYERS
  spec = place(from_config_dict(config), 8)
  ((role, role_spec),) = spec.roles.items()
  tensor = config.placement.tensor
  assert role_spec == RoleSpec.training(range(8), stage=2, fsdp=4 // tensor, tensor=tensor)
  config.placement.pipeline_stages = 3
  with pytest.raises(
    PlacementError,
    match=rf"^placement\.pipeline_stages x placement\.tensor = 3 x {tensor} does not divide "
    r"placement\.num_devices=8$",
  ):
    place(from_config_dict(config), 8)


# --- Rules --------------------------------------------------------------------------------------


def _is_axes(x):
  return isinstance(x, tuple) and all(isinstance(a, str | None) for a in x)


@pytest.mark.parametrize("head", ["lm", "value"])
def test_training_rules_split_the_layer_stack_over_stages(head):
  config = model_config.get_model_config("tiny", **FOUR_LAYERS)
  axes, shapes = models.logical_axes(config, head), models.abstract_params(config, head)
  staged = make_mesh(RoleSpec.training(range(8), stage=2, fsdp=2, tensor=2))
  flat = make_mesh(RoleSpec.training(range(4), fsdp=2, tensor=2))
  with_stage = rules.named_shardings(axes, shapes, staged, Layout.TRAINING)
  without = rules.named_shardings(axes, shapes, flat, Layout.TRAINING)
  paths = jax.tree_util.tree_flatten_with_path(axes, is_leaf=_is_axes)[0]
  seen_layers, seen_vocab = 0, []
  for (path, logical), a, b in zip(
    paths, jax.tree.leaves(with_stage), jax.tree.leaves(without), strict=True
  ):
    if logical[0] == "layers":
      seen_layers += 1
      # The stack over 'stage', everything else as on the same fsdp x tensor mesh without it.
      assert a.spec == P("stage", *b.spec[1:]), jax.tree_util.keystr(path)
    elif "vocab" in logical:
      # The embedding's and the LM head's vocabulary over 'stage' too, after 'tensor'.
      seen_vocab.append(jax.tree_util.keystr(path))
      dim = logical.index("vocab")
      want = [*b.spec] + [None] * (len(logical) - len(b.spec))
      want[dim] = ("tensor", "stage")
      assert a.spec == P(*want), jax.tree_util.keystr(path)
    else:
      assert a.spec == b.spec, jax.tree_util.keystr(path)
  assert seen_layers == 9
  assert seen_vocab == (
    ["['embedding']", "['lm_head']['kernel']"] if head == "lm" else ["['embedding']"]
  )


def test_stage_s_holds_its_contiguous_block_of_layers():
  config = model_config.get_model_config("tiny", **FOUR_LAYERS)
  spec = RoleSpec.training((5, 1, 7, 3, 0, 2, 4, 6), stage=2, fsdp=2, tensor=2)
  mesh = make_mesh(spec)
  shape = (config.num_layers, config.hidden_size)
  sharding = jax.sharding.NamedSharding(
    mesh, rules.partition_spec(("layers", "norm"), Layout.TRAINING, mesh, shape)
  )
  stack = jax.device_put(np.arange(np.prod(shape), dtype=np.float32).reshape(shape), sharding)
  stage_of = {d: s for s in range(2) for d in np.asarray(spec.devices).reshape(2, -1)[s]}
  devices = jax.devices()
  for shard in stack.addressable_shards:
    s = stage_of[devices.index(shard.device)]
    np.testing.assert_array_equal(shard.data, np.asarray(stack)[2 * s : 2 * s + 2])


def test_batch_rule_splits_rows_over_stages_and_generation_is_unchanged():
  staged = make_mesh(RoleSpec.training(range(8), stage=2, fsdp=4))
  assert rules.partition_spec(("batch", "length"), Layout.TRAINING, staged, (8, 5)) == P(
    ("fsdp", "stage"), None
  )
  assert rules.GENERATION_RULES["layers"] == ()
  assert rules.GENERATION_RULES["batch"] == ("data",)
  generation = make_mesh(RoleSpec.generation(range(8), data=4, tensor=2))
  assert rules.partition_spec(
    ("layers", "embed", "mlp"), Layout.GENERATION, generation, (4, 6, 10)
  ) == P(None, None, "tensor")
