"""Placement strategies, validation, memory estimates and configs. The show_placement script:
test_placement_e2e.py."""

import dataclasses
import importlib.util
import math
import pathlib

import jax
import numpy as np
import pytest

from rlhfjax.config import ConfigError, ExperimentConfig, from_config_dict
from rlhfjax.costmodel import memory as memory_model
from rlhfjax.costmodel import pipeline
from rlhfjax.placement import (
  Layout,
  PlacementError,
  PlacementSpec,
  Role,
  RoleSpec,
  build_placement,
  colocated,
  disaggregated,
  estimate_memory,
  estimate_placement_memory,
  format_placement_table,
  interleaved,
  strategies,
)
from rlhfjax.placement.memory import (
  GIB,
  Pipelining,
  device_totals,
  model_options,
  option_effects,
  option_peaks,
)
from rlhfjax.placement.validate import check_models, check_spec
from rlhfjax.planner import auto
from rlhfjax.planner.place import place, plan_placement

pytestmark = pytest.mark.pure

REPO = pathlib.Path(__file__).resolve().parents[1]
SHIPPED_CONFIGS = sorted((REPO / "configs").glob("*.py"))
TRAINING_ROLES = (Role.ACTOR, Role.CRITIC, Role.REFERENCE, Role.REWARD)


def _config(**sections) -> ExperimentConfig:
  sections.setdefault("model", {"size": "tiny"})
  return from_config_dict(sections)


def _explicit(**overrides) -> dict:
  """A valid explicit placement on 8 devices (the one of configs/ppo_tiny.py), as a dict."""
  first, second = [0, 1, 2, 3], [4, 5, 6, 7]
  roles = {
    role: {"devices": devices, "axes": {"fsdp": 4}}
    for role, devices in (
      ("actor", first),
      ("reference", first),
      ("critic", second),
      ("reward", second),
    )
  }
  roles["rollout"] = {"devices": first, "axes": {"data": 2, "tensor": 2}}
  roles["colocate"] = [["actor", "reference", "rollout"], ["critic", "reward"]]
  for role, changes in overrides.items():
    roles[role] = {**roles[role], **changes} if isinstance(changes, dict) else changes
  return {"strategy": "explicit", "num_devices": 8, "explicit": roles}


def _devices(spec: PlacementSpec, role: Role) -> list[int]:
  return list(spec[role].devices)


def _replace_role(spec: PlacementSpec, role: Role, **changes) -> PlacementSpec:
  roles = dict(spec.roles)
  roles[role] = dataclasses.replace(roles[role], **changes)
  return dataclasses.replace(spec, roles=roles)


# --- Strategies -------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [8, 4, 2])
def test_colocated_puts_every_role_on_all_devices(n):
  spec = colocated(n)
  for role in Role:
    assert _devices(spec, role) == list(range(n))
  for role in TRAINING_ROLES:
    assert spec[role].axes == (("data", 1), ("fsdp", n), ("tensor", 1))
    assert spec[role].layout == Layout.TRAINING
  assert spec[Role.ROLLOUT].axes == (("data", n), ("tensor", 1))
  assert spec[Role.ROLLOUT].layout == Layout.GENERATION
  assert spec.disjoint == ()
  assert all(spec.colocated(a, b) for a in Role for b in Role)


def test_colocated_tensor_sizes():
  spec = colocated(8, tensor=2, rollout_tensor=4)
  assert spec[Role.ACTOR].axes == (("data", 1), ("fsdp", 4), ("tensor", 2))
  assert spec[Role.ROLLOUT].axes == (("data", 2), ("tensor", 4))


@pytest.mark.parametrize("n", [8, 4, 2])
def test_interleaved_splits_reference_and_reward(n):
  spec = interleaved(n)
  half = n // 2
  assert _devices(spec, Role.ACTOR) == _devices(spec, Role.CRITIC) == list(range(n))
  assert _devices(spec, Role.REFERENCE) == list(range(half))
  assert _devices(spec, Role.REWARD) == list(range(half, n))
  assert _devices(spec, Role.ROLLOUT) == _devices(spec, Role.ACTOR)
  assert not spec.colocated(Role.REFERENCE, Role.REWARD)
  assert spec.colocated(Role.ACTOR, Role.CRITIC)
  assert spec[Role.REFERENCE].axes == (("data", 1), ("fsdp", half), ("tensor", 1))
  assert spec.disjoint == ((Role.REFERENCE, Role.REWARD),)


@pytest.mark.parametrize("n", [8, 4, 2])
def test_interleaved_split_actor_critic(n):
  spec = interleaved(n, split_actor_critic=True)
  half = n // 2
  assert _devices(spec, Role.ACTOR) == _devices(spec, Role.REFERENCE) == list(range(half))
  assert _devices(spec, Role.CRITIC) == _devices(spec, Role.REWARD) == list(range(half, n))
  assert _devices(spec, Role.ROLLOUT) == list(range(half))
  assert not spec.colocated(Role.ACTOR, Role.CRITIC)
  assert not spec.colocated(Role.REFERENCE, Role.REWARD)
  assert set(spec.disjoint) == {(Role.REFERENCE, Role.REWARD), (Role.ACTOR, Role.CRITIC)}


@pytest.mark.parametrize("n", [8, 4, 2])
def test_disaggregated_gives_rollout_its_own_devices(n):
  spec = disaggregated(n)
  half = n // 2
  assert _devices(spec, Role.ROLLOUT) == list(range(half, n))
  assert spec[Role.ROLLOUT].axes == (("data", half), ("tensor", 1))
  for role in TRAINING_ROLES:
    assert _devices(spec, role) == list(range(half))
    assert not spec.colocated(role, Role.ROLLOUT)
    assert (role, Role.ROLLOUT) in spec.disjoint


def test_disaggregated_fraction_tensor_and_splits():
  spec = disaggregated(
    8,
    rollout_fraction=0.25,
    rollout_tensor=2,
    split_actor_critic=True,
    split_reference_reward=True,
  )
  assert _devices(spec, Role.ROLLOUT) == [6, 7]
  assert spec[Role.ROLLOUT].axes == (("data", 1), ("tensor", 2))
  assert _devices(spec, Role.ACTOR) == _devices(spec, Role.REFERENCE) == [0, 1, 2]
  assert _devices(spec, Role.CRITIC) == _devices(spec, Role.REWARD) == [3, 4, 5]
  assert not spec.colocated(Role.ACTOR, Role.CRITIC)
  assert not spec.colocated(Role.REFERENCE, Role.REWARD)


@pytest.mark.parametrize("n", [8, 4, 2])
@pytest.mark.parametrize(
  "strategy, extra",
  [
    ("colocated", {}),
    ("interleaved", {}),
    ("interleaved", {"split_actor_critic": True}),
    ("disaggregated", {}),
  ],
)
def test_mesh_sizes_multiply_to_group_size(n, strategy, extra):
  spec = build_placement(_config(placement={"strategy": strategy, **extra}).placement, n)
  assert spec.strategy == strategy
  assert set(spec.roles) == set(Role)
  for role_spec in spec.roles.values():
    assert math.prod(size for _, size in role_spec.axes) == len(role_spec.devices)
    assert len(set(role_spec.devices)) == len(role_spec.devices)
  assert spec.devices == tuple(range(n))


def test_build_placement_matches_the_strategy_functions():
  cases = [
    ({"strategy": "colocated", "tensor": 2}, colocated(8, tensor=2)),
    (
      {"strategy": "interleaved", "split_actor_critic": True},
      interleaved(8, split_actor_critic=True),
    ),
    ({"strategy": "disaggregated", "rollout_tensor": 2}, disaggregated(8, rollout_tensor=2)),
  ]
  for placement, expected in cases:
    assert build_placement(_config(placement=placement).placement, 8) == expected


def test_num_devices_none_uses_all_available():
  assert build_placement(_config().placement, 4).devices == (0, 1, 2, 3)


def test_explicit_placement():
  spec = build_placement(_config(placement=_explicit()).placement, 8)
  assert _devices(spec, Role.ACTOR) == [0, 1, 2, 3]
  assert spec[Role.ACTOR].axes == (("data", 1), ("fsdp", 4), ("tensor", 1))
  assert spec[Role.ROLLOUT].axes == (("data", 2), ("tensor", 2))
  assert spec[Role.ROLLOUT].layout == Layout.GENERATION
  assert spec.colocated(Role.ACTOR, Role.ROLLOUT)
  assert (Role.ACTOR, Role.CRITIC) in spec.disjoint
  assert (Role.ACTOR, Role.ROLLOUT) not in spec.disjoint


def test_explicit_sharing_allowed_by_colocate_group():
  everything = [["actor", "critic", "reference", "reward", "rollout"]]
  shared = {"devices": [0, 1, 2, 3]}
  placement = _explicit(critic=shared, reward=shared, colocate=everything)
  spec = build_placement(_config(placement=placement).placement, 8)
  assert spec.disjoint == ()
  assert spec.colocated(Role.ACTOR, Role.CRITIC)


def test_register_strategy(monkeypatch):
  monkeypatch.setattr(strategies, "_STRATEGIES", dict(strategies._STRATEGIES))
  strategies.register_strategy("reversed", lambda cfg, n: colocated(n))
  assert "reversed" in strategies.strategy_names()
  spec = build_placement(_config(placement={"strategy": "reversed"}).placement, 4)
  assert spec.devices == (0, 1, 2, 3)
  with pytest.raises(ValueError, match="already registered"):
    strategies.register_strategy("colocated", lambda cfg, n: colocated(n))


# --- Validation errors ------------------------------------------------------------------------

_BAD_PLACEMENTS = [
  (
    {"strategy": "interleave"},
    r"^unknown placement strategy 'interleave'; did you mean 'interleaved'\? known strategies: "
    r"colocated, interleaved, disaggregated, explicit, auto$",
  ),
  ({"num_devices": 0}, r"^placement\.num_devices must be >= 1, got 0$"),
  ({"num_devices": -3}, r"^placement\.num_devices must be >= 1, got -3$"),
  ({"num_devices": 9}, r"^placement\.num_devices=9 exceeds the 8 available devices$"),
  ({"strategy": "colocated", "tensor": 3}, r"^actor: placement\.tensor=3 does not divide its 8"),
  (
    {"strategy": "colocated", "rollout_tensor": 16},
    r"^rollout: placement\.rollout_tensor=16 does not divide its 8 devices; set "
    r"placement\.rollout_tensor to one of 1, 2, 4 or 8$",
  ),
  ({"strategy": "interleaved", "num_devices": 7}, r"^interleaved splits 7 devices into two"),
  (
    {"strategy": "disaggregated", "rollout_fraction": 1.0},
    r"^placement\.rollout_fraction must be in \(0, 1\), got 1\.0$",
  ),
  (
    {"strategy": "disaggregated", "rollout_fraction": 0.05},
    r"^disaggregated: rollout_fraction=0\.05 of 8 devices gives 0 rollout devices",
  ),
  (
    {"strategy": "disaggregated", "split_actor_critic": True, "num_devices": 6},
    r"^disaggregated with split_actor_critic splits 3 devices into two halves",
  ),
  (
    _explicit(actor={"devices": [0, 1, 2, 8]}),
    r"^actor: device index 8 is out of range for 8 devices \(valid: 0\.\.7; list those in "
    r"placement\.explicit\.actor\.devices\)$",
  ),
  (_explicit(actor={"devices": [-1, 0, 1, 2]}), r"^actor: device index -1 is out of range"),
  (_explicit(actor={"devices": [0, 1, 1, 2]}), r"^actor: device 1 is listed more than once$"),
  (
    _explicit(critic={"axes": {"fsdp": 3}}),
    r"^critic: mesh axes data=1 x fsdp=3 x tensor=1 = 3 devices, but the role has 4 devices$",
  ),
  (
    _explicit(rollout={"axes": {"fsdp": 4}}),
    r"^rollout: unknown mesh axis 'fsdp' for the generation layout; allowed: data, tensor$",
  ),
  (
    _explicit(actor={"axes": {"fsdp": 4, "model": 1}}),
    r"^actor: unknown mesh axis 'model' for the training layout",
  ),
  (_explicit(actor={"axes": {"fsdp": 0}}), r"^actor: mesh axis fsdp=0 must be >= 1$"),
  (
    _explicit(critic={"devices": [3, 4, 5, 6]}),
    r"^explicit: actor and critic must not share devices but both use 3 \(list them in one "
    r"placement\.explicit\.colocate group to allow it\)$",
  ),
  (
    _explicit(reward={"devices": [0, 1, 2, 3]}),
    r"^explicit: actor and reward must not share devices but both use 0-3",
  ),
  (_explicit(reward=None), r"^placement\.explicit\.reward is not set; an explicit placement "),
  (
    _explicit(rollout={"layout": "inference"}),
    r"^placement\.explicit\.rollout\.layout must be one of training, generation, got 'inference'$",
  ),
  (
    _explicit(colocate=[["actor", "policy"]]),
    r"^placement\.explicit\.colocate: unknown role 'policy'; roles: actor, critic, reference",
  ),
]


@pytest.mark.parametrize("placement, message", _BAD_PLACEMENTS)
def test_bad_placement_raises_one_line_error(placement, message):
  config = _config(placement={"num_devices": 8, **placement})
  with pytest.raises(PlacementError, match=message) as info:
    build_placement(config.placement, 8)
  assert "\n" not in str(info.value)


@pytest.mark.parametrize(
  "strategy, role, steal_from",
  [
    ("interleaved", Role.REWARD, Role.REFERENCE),
    ("disaggregated", Role.ROLLOUT, Role.ACTOR),
  ],
)
def test_forbidden_overlap_of_a_strategy(strategy, role, steal_from):
  spec = build_placement(_config(placement={"strategy": strategy}).placement, 8)
  bad = _replace_role(spec, role, devices=spec[steal_from].devices)
  a, b = sorted((role, steal_from), key=list(Role).index)
  with pytest.raises(PlacementError, match=rf"^{strategy}: {a} and {b} must not share devices"):
    check_spec(bad, 8)


def test_missing_role_is_an_error():
  spec = colocated(8)
  roles = {role: s for role, s in spec.roles.items() if role != Role.CRITIC}
  with pytest.raises(PlacementError, match=r"^colocated: no placement for role\(s\) critic$"):
    check_spec(dataclasses.replace(spec, roles=roles), 8)


def test_axes_out_of_layout_order_is_an_error():
  spec = _replace_role(colocated(8), Role.ACTOR, axes=(("fsdp", 8), ("data", 1), ("tensor", 1)))
  with pytest.raises(
    PlacementError,
    match=r"^actor: the training layout needs mesh axes "
    r"\(data, fsdp, tensor\) in this order, got \(fsdp, data, tensor\)$",
  ):
    check_spec(spec, 8)


@pytest.mark.parametrize(
  "placement, message",
  [
    ({"tensor": 4}, r"^actor: tensor=4 does not divide num_kv_heads=2 of model 'tiny'$"),
    ({"rollout_tensor": 8}, r"^rollout: tensor=8 does not divide num_heads=4 of model 'tiny'$"),
  ],
)
def test_tensor_must_divide_heads(placement, message):
  config = _config(placement={"num_devices": 8, **placement})
  with pytest.raises(PlacementError, match=message):
    plan_placement(config, 8)


def test_rollout_batch_must_split_over_data():
  config = _config(rollout={"batch_size": 12})
  with pytest.raises(
    PlacementError,
    match=r"^rollout\.batch_size=12 does not split evenly over "
    r"the 8 batch shards \(data\) of the rollout mesh$",
  ):
    plan_placement(config, 8)


def test_70b_does_not_fit_colocated_on_8_devices_of_16_gib():
  config = _config(
    model={"size": "70b"},
    placement={"strategy": "colocated", "num_devices": 8, "memory_per_device_gb": 16},
  )
  message = (
    r"^actor does not fit: needs 164 GiB per device \(params 32\.1, optimizer 64\.2, "
    r"grads 64\.2, activations 0\.405, logits 0\.0916, kv cache 0\) on its 8 devices but the "
    r"budget is 16 GiB "
    r"\(placement\.memory_per_device_gb\)$"
  )
  with pytest.raises(PlacementError, match=message) as info:
    plan_placement(config, 8)
  assert "\n" not in str(info.value)


def test_roles_sharing_a_device_must_fit_together():
  reward_model = {"model_coef": 1.0}  # all five roles placed: PPO with a reward model
  config = _config(placement={"strategy": "colocated"}, reward=reward_model)
  spec = plan_placement(config, 8)
  estimates = estimate_placement_memory(spec, config.model, config.rollout)
  colocated_peak = max(device_totals(spec, estimates).values())
  budget_gib = (colocated_peak - 1) / 2**30  # each role fits alone, all five together do not
  assert all(estimate.total <= colocated_peak - 1 for estimate in estimates.values())
  tight = _config(
    placement={"strategy": "colocated", "memory_per_device_gb": budget_gib}, reward=reward_model
  )
  with pytest.raises(
    PlacementError,
    match=r"^device 0 holds actor \+ critic \+ reference \+ "
    r"reward \+ rollout together: [\d.e-]+ GiB but the budget is [\d.e-]+ GiB",
  ):
    plan_placement(tight, 8)
  # Exactly the peak fits: the persistent state of all five plus the largest transient set.
  exact = _config(
    placement={"strategy": "colocated", "memory_per_device_gb": colocated_peak / 2**30}
  )
  plan_placement(exact, 8)
  persistent = sum(e.persistent for e in estimates.values())
  assert colocated_peak == persistent + max(e.transient for e in estimates.values())


_REWARD_MODEL = {"model_coef": 1.0}  # all five roles placed: PPO with a reward model


def _offload_estimates(strategy: str, offload: dict):
  """The placement of `strategy` with `offload`, and its estimates without and with it."""
  config = _config(placement={"strategy": strategy}, reward=_REWARD_MODEL, offload=offload)
  spec = plan_placement(config, 8)
  rows = auto.train_rows(config)
  plain = estimate_placement_memory(spec, config.model, config.rollout, train_rows=rows)
  off = estimate_placement_memory(
    spec, config.model, config.rollout, train_rows=rows, offload=config.offload
  )
  return config, spec, plain, off


def test_offloading_the_reference_params_leaves_the_trained_roles_counted():
  _, _, plain, off = _offload_estimates("colocated", {"params": ("reference",)})
  for role in (Role.ACTOR, Role.CRITIC, Role.REWARD, Role.ROLLOUT):
    assert off[role] == plain[role]
  for role in (Role.ACTOR, Role.CRITIC):
    e = off[role]
    assert e.params > 0 and e.optimizer > 0 and e.persistent == e.params + e.optimizer
  reference = off[Role.REFERENCE]
  assert reference.total == plain[Role.REFERENCE].total  # back on the devices for its scoring
  assert reference.parked == reference.params > 0 and reference.persistent == 0


@pytest.mark.parametrize("strategy", ["colocated", "interleaved"])
@pytest.mark.parametrize(
  "offload",
  [
    {"params": ("reference",)},
    {"params": ("reference", "reward"), "optimizer": ("actor",)},
    {"optimizer": ("actor", "critic")},
  ],
)
def test_device_peak_with_offload_is_the_hand_computation(strategy, offload):
  config, spec, plain, off = _offload_estimates(strategy, offload)
  # By hand, device by device, from the estimates without offload: a role keeps its params and
  # moments while idle except the parts `offload` names; the role whose stage runs holds all.
  idle = {
    role: e.params * (role.value not in offload.get("params", ()))
    + e.optimizer * (role.value not in offload.get("optimizer", ()))
    for role, e in plain.items()
  }
  totals = device_totals(spec, off)
  for device in range(8):
    here = [role for role in spec.roles if device in spec[role].devices]
    hand = sum(idle[r] for r in here) + max(plain[r].total - idle[r] for r in here)
    assert totals[device] == hand, device
  # show_placement's options table reports the same peak (one computation, not two).
  effects = option_effects(
    spec,
    config.model,
    config.rollout,
    train_rows=auto.train_rows(config),
    offload=config.offload,
  )
  assert option_peaks(spec, effects)["configured"] == max(totals.values())
  assert max(totals.values()) < max(device_totals(spec, plain).values())


def test_memory_check_counts_trained_params_when_the_config_offloads():
  offload = {"params": ("reference", "reward"), "optimizer": ("actor", "critic")}
  _, spec, _, off = _offload_estimates("colocated", offload)
  peak = max(device_totals(spec, off).values())
  # What zeroing every role's params and moments gave (the largest single role): it would fit
  # a budget just under the real peak, which keeps the trained roles' params resident.
  zeroed = max(
    e.total - (e.params + e.optimizer if r in (Role.ACTOR, Role.CRITIC) else 0)
    for r, e in off.items()
  )
  assert zeroed < peak - 1 and all(e.total <= peak - 1 for e in off.values())
  tight = _config(
    placement={"strategy": "colocated", "memory_per_device_gb": (peak - 1) / 2**30},
    reward=_REWARD_MODEL,
    offload=offload,
  )
  with pytest.raises(PlacementError, match=r"^device 0 holds actor \+ critic \+ reference"):
    plan_placement(tight, 8)
  exact = _config(
    placement={"strategy": "colocated", "memory_per_device_gb": peak / 2**30},
    reward=_REWARD_MODEL,
    offload=offload,
  )
  plan_placement(exact, 8)


# --- Memory estimate --------------------------------------------------------------------------


def _tiny_param_count(head: str) -> int:
  """Parameters of the tiny model, counted from its weight shapes."""
  v, d, f, layers, h, kv, hd = 328, 56, 152, 3, 4, 2, 12
  layer = [
    (d, h * hd),
    (d, kv * hd),
    (d, kv * hd),
    (h * hd, d),  # q, k, v, o
    (d, f),
    (d, f),
    (f, d),  # gate, up, down
    (d,),
    (d,),
  ]  # two RMSNorm scales
  out = (d, v) if head == "lm" else (d, 1)
  shapes = [(v, d)] + layer * layers + [(d,), out]
  return int(sum(np.prod(shape) for shape in shapes))


def test_memory_of_tiny_roles_matches_hand_computation():
  lm, value = _tiny_param_count("lm"), _tiny_param_count("value")
  config = _config(rollout={"batch_size": 16, "max_prompt_len": 64, "max_new_tokens": 64})
  spec = build_placement(
    _config(placement={"strategy": "colocated", "rollout_tensor": 2}).placement, 8
  )
  estimates = estimate_placement_memory(spec, config.model, config.rollout)
  fp32 = 4
  actor = estimates[Role.ACTOR]
  assert actor.params == math.ceil(lm * fp32 / 8)
  assert actor.optimizer == math.ceil(lm * 2 * 4 / 8)  # two fp32 moments (fp32 params)
  assert actor.grads == math.ceil(lm * (4 + 4) / 8)  # fp32 accumulator + averaged gradients
  assert actor.kv_cache == 0 and actor.activations > 0 and actor.logits > 0
  critic = estimates[Role.CRITIC]
  assert (critic.params, critic.optimizer) == (math.ceil(value * fp32 / 8), value * 8 // 8)
  assert estimates[Role.REFERENCE].params == lm * fp32 // 8
  assert estimates[Role.REFERENCE].optimizer == estimates[Role.REFERENCE].grads == 0
  assert estimates[Role.REWARD].params == math.ceil(value * fp32 / 8)
  assert estimates[Role.REWARD].logits == 0  # a value head has no vocabulary
  rollout = estimates[Role.ROLLOUT]
  # Generation layout, data=4 x tensor=2: params split over tensor only; a page pool per
  # replica for 16 / 4 sequences of 128 tokens in pages of 16, plus the reserved page; K and V
  # of 3 layers x 2 kv heads x 12 dims in fp32, kv heads split over 2.
  assert rollout.params == lm * fp32 // 2
  pages = (16 // 4) * (128 // 16) + 1
  assert rollout.kv_cache == pages * 16 * (2 * 3 * 2 * 12 * fp32) // 2
  assert rollout.optimizer == rollout.grads == 0
  # Co-located: no transfer buffer; decode logits of 4 slots x vocab, fp32, twice, over tensor.
  assert rollout.transfer == 0
  assert rollout.logits == 4 * 328 * 4 * 2 // 2
  assert rollout.total == rollout.params + rollout.kv_cache + rollout.logits


def test_memory_of_a_training_layout_ignores_data_replicas():
  spec = RoleSpec(
    devices=tuple(range(8)), axes=(("data", 2), ("fsdp", 2), ("tensor", 2)), layout=Layout.TRAINING
  )
  model = _config().model.for_role("actor")
  estimate = estimate_memory(Role.ACTOR, spec, model, _config().rollout)
  assert estimate.params == math.ceil(_tiny_param_count("lm") * 4 / 4)


def test_70b_memory_per_device():
  config = _config(model={"size": "70b"})
  spec = colocated(8)
  estimate = estimate_placement_memory(spec, config.model, config.rollout)[Role.ACTOR]
  params = 68_976_648_192  # Llama-2-70B with an untied LM head
  # fp32 master parameters (the real sizes' default); optax keeps the moments in their dtype.
  assert estimate.params == params * 4 // 8
  assert estimate.optimizer == params * 4 * 2 // 8
  assert estimate.grads == params * (4 + 4) // 8  # float32 accumulator and gradients
  assert estimate.persistent == estimate.params + estimate.optimizer


def test_a_staged_role_keeps_what_its_schedule_holds_for_the_backwards():
  """An actor on 2 stages of 4 devices, trained in steps of 8 micro-batches of 4 sequences:
  each device holds its stage's 2 of 4 layers and, for every micro-batch the schedule keeps
  waiting for its backward, the micro-batch's stage input and what its forward kept (GPipe: all
  8; 1F1B: 2, the stages; recomputing: the inputs alone, one micro-batch's residuals at a time).
  The placement check counts it so: a budget between 1F1B's need and GPipe's passes the one
  and refuses the other (the planner prices the same bytes: `stage_memory`)."""
  config = _config(model={"size": "tiny", "overrides": {"num_layers": 4}})
  model, rollout = config.model.for_role(Role.ACTOR), config.rollout
  spec = RoleSpec(devices=tuple(range(8)), axes=(("stage", 2), ("fsdp", 4)), layout=Layout.TRAINING)

  def need(**run):
    run = Pipelining(micro_batches=8, **run)
    return estimate_memory(Role.ACTOR, spec, model, rollout, train_rows=4, pipelining=run)

  one_f_one_b, gpipe, recompute = need(), need(schedule="gpipe"), need(recompute=True)
  stage = memory_model.Sharding(param_shards=4, batch_shards=4, tensor=1)  # one stage's
  kept = memory_model.kept_activations(
    pipeline.stage_config(model, 2),
    stage,
    micro_batch=1,
    seq_len=rollout.max_seq_len,
    options=model_options(model),
  )
  stage_input = rollout.max_seq_len * model.hidden_size * 4  # one sequence per device, fp32
  assert kept > 0 and stage_input > 0
  assert gpipe.activations - one_f_one_b.activations == (8 - 2) * (stage_input + kept)
  assert one_f_one_b.activations - recompute.activations == kept  # 2 - 1 residual sets
  assert gpipe.params == one_f_one_b.params < estimate_memory(
    Role.ACTOR, dataclasses.replace(spec, axes=(("fsdp", 4),), devices=tuple(range(4))), model,
    rollout, train_rows=4,
  ).params  # fmt: skip
  placement = PlacementSpec(strategy="explicit", roles={Role.ACTOR: spec})
  budget = (one_f_one_b.total + gpipe.total) / 2 / GIB
  check_models(
    placement, config.model, rollout, budget, train_rows=4, pipelining=Pipelining(micro_batches=8)
  )
  with pytest.raises(PlacementError, match="actor"):
    check_models(
      placement,
      config.model,
      rollout,
      budget,
      train_rows=4,
      pipelining=Pipelining(schedule="gpipe", micro_batches=8),
    )


def test_format_placement_table_lists_every_role():
  config = _config(
    placement={"strategy": "interleaved", "memory_per_device_gb": 16}, reward={"model_coef": 1.0}
  )
  spec = plan_placement(config, 8)
  table = format_placement_table(
    spec, estimate_placement_memory(spec, config.model, config.rollout), memory_per_device_gb=16
  )
  lines = table.splitlines()
  assert lines[0] == "interleaved placement on 8 devices, est. memory/device in MiB"
  assert lines[1].split()[:4] == ["role", "devices", "mesh", "layout"]
  assert lines[2].split()[:6] == ["actor", "0-7", "data=1", "fsdp=8", "tensor=1", "training"]
  assert lines[4].split()[:2] == ["reference", "0-3"]
  assert lines[5].split()[:2] == ["reward", "4-7"]
  assert lines[6].split()[:5] == ["rollout", "0-7", "data=8", "tensor=1", "generation"]
  assert lines[-1].startswith("summary: interleaved on 8 devices; peak ")
  assert "of a 16 GiB budget" in lines[-1]
  assert lines[-1].endswith("disjoint pairs: reference|reward")


# --- Config -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
  "config_dict, message",
  [
    (
      {"model": {"size": "tiny"}, "placement": {"stratgy": "colocated"}},
      r"^unknown config field 'placement\.stratgy'; did you mean 'placement\.strategy'\?$",
    ),
    (
      {"model": {"size": "tiny"}, "rollouts": {}},
      r"^unknown config field 'rollouts'; did you mean 'rollout'\?$",
    ),
    (
      {"model": {"size": "tiny"}, "placement": {"xyz": 1}},
      r"^unknown config field 'placement\.xyz'; known fields: strategy, num_devices, ",
    ),
    (
      {"model": {"size": "huge"}},
      r"^unknown model size 'huge' for 'model\.size'; known sizes: tiny, 125m, 1b, 7b, 13b, 70b$",
    ),
    (
      {"model": {"size": "tiny", "critic_size": "3b"}},
      r"^unknown model size '3b' for 'model\.critic_size'",
    ),
    (
      {"model": {"size": "tiny", "dtype": "float16"}},
      r"^'model\.dtype' must be one of float32, bfloat16, got 'float16'$",
    ),
    ({"model": {}}, r"^'model': set 'model\.size' \(a registered size\) or 'model\.hf' "),
    ({"placement": {}}, r"^missing config field 'model'$"),
    (
      {"model": {"size": "tiny"}, "placement": {"num_devices": "8"}},
      r"^config field 'placement\.num_devices' must be int \| None, got str '8'$",
    ),
    (
      {"model": {"size": "tiny"}, "placement": {"split_actor_critic": 1}},
      r"^config field 'placement\.split_actor_critic' must be bool, got int 1$",
    ),
    (
      {"model": {"size": "tiny"}, "placement": {"tensor": True}},
      r"^config field 'placement\.tensor' must be int, got bool True$",
    ),
    (
      {"model": {"size": "tiny"}, "placement": {"explicit": {"actor": {"devices": [0, "1"]}}}},
      r"^config field 'placement\.explicit\.actor\.devices\[1\]' must be int, got str '1'$",
    ),
    ({"model": "tiny"}, r"^config field 'model' must be a section, got str$"),
    (
      {"model": {"size": "tiny"}, "rollout": {"batch_size": 0}},
      r"^'rollout\.batch_size' must be >= 1, got 0$",
    ),
  ],
)
def test_bad_config_raises_one_line_error(config_dict, message):
  with pytest.raises(ConfigError, match=message):
    from_config_dict(config_dict)


def test_model_section_picks_each_role_model():
  model = _config(model={"size": "tiny", "reward_size": "125m", "param_dtype": "bfloat16"}).model
  assert model.size_for("critic") == "tiny"
  assert model.size_for("reward") == "125m"
  assert model.for_role("reward").hidden_size == 768
  assert model.for_role("actor").param_dtype == "bfloat16"


def _load_config_file(path: pathlib.Path):
  module_spec = importlib.util.spec_from_file_location(path.stem, path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module.get_config()


def _experiments(path: pathlib.Path) -> list:
  """The experiment configs a config file holds: itself, or each stage of a pipeline."""
  config = _load_config_file(path)
  if "ppo" in config and "sft" in config:
    return list(config.values())
  return [config]


@pytest.mark.parametrize("path", SHIPPED_CONFIGS, ids=lambda p: p.name)
def test_shipped_config_loads_and_validates(path):
  for section in _experiments(path):
    place(from_config_dict(section), jax.device_count())


def test_ppo_tiny_validates_with_every_strategy():
  config = from_config_dict(_load_config_file(REPO / "configs" / "ppo_tiny.py"))
  assert (config.model.size, config.placement.strategy) == ("tiny", "colocated")
  assert config.placement.num_devices == 8
  for strategy in ("colocated", "interleaved", "disaggregated", "explicit"):
    placement = dataclasses.replace(config.placement, strategy=strategy)
    plan_placement(dataclasses.replace(config, placement=placement), 8)
