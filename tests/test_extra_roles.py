"""Extra roles (issue 42, item 1): a config's own named roles (`model.extra_roles`, here a second
reward model) are validated in one line, placed by every strategy on devices of their own,
sharing another role's or interleaved with it, counted by the memory estimate and
`show_placement`'s table, priced by the planner and part of a checkpoint's identity. Their
scores on the meshes: tests/test_extra_roles_scoring.py."""

import dataclasses

import pytest

from rlhfjax.config import ConfigError, from_config_dict
from rlhfjax.costmodel import efficiency, hardware
from rlhfjax.data.tokenizer import load_tokenizer
from rlhfjax.flows import registry
from rlhfjax.placement import (
  PlacementError,
  build_placement,
  estimate_placement_memory,
  format_placement_table,
)
from rlhfjax.planner import auto
from rlhfjax.planner.place import plan_placement
from rlhfjax.runner import identity

pytestmark = pytest.mark.pure


def _config(where=None, *, algorithm="grpo", strategy="colocated", **sections):
  """A GRPO config with a second reward model placed `where` (`placement.extra_roles.reward2`);
  `sections` change or add sections."""
  model = {"size": "tiny", "extra_roles": {"reward2": {"size": "tiny"}}}
  return from_config_dict(
    {
      "model": {**model, **sections.pop("model", {})},
      "algorithm": {"name": algorithm},
      "ppo": {"group_size": 2},
      "placement": {
        "strategy": strategy,
        "hardware": "h100",
        "memory_per_device_gb": 16.0,
        **({"extra_roles": {"reward2": where}} if where else {}),
        **sections.pop("placement", {}),
      },
      "reward": {
        "fn": "rlhfjax.tasks:vowel_reward",
        "model_coef": 0.5,
        "role_coefs": {"reward2": 0.25},
        **sections.pop("reward", {}),
      },
      **sections,
    }
  )


@pytest.mark.parametrize(
  ("changes", "message"),
  [
    (
      {"model": {"extra_roles": {"reward": {}}}},
      r"^'model.extra_roles.reward': 'reward' is a built-in role or stage name .* e.g. "
      r"'reward2'$",
    ),
    (
      {"model": {"extra_roles": {"Judge-1": {}}}},
      r"^'model.extra_roles.Judge-1': a role's name is lower-case letters, digits and '_'",
    ),
    (
      {"reward": {"role_coefs": {}}},
      r"^'model.extra_roles.reward2' is a reward role but 'reward.role_coefs.reward2' gives it "
      "no weight",
    ),
    (
      {"reward": {"role_coefs": {"reward2": 1.0, "reward3": 1.0}}},
      r"^'reward.role_coefs.reward3': no extra reward role 'reward3' in 'model.extra_roles' "
      r"\(extra roles: reward2\)$",
    ),
    (
      {"placement": {"extra_roles": {"reward3": {}}}},
      r"^'placement.extra_roles.reward3': no extra role 'reward3'",
    ),
    (
      {"placement": {"extra_roles": {"reward2": {"with_role": "judge"}}}},
      r"^'placement.extra_roles.reward2.with_role'='judge' is not a role placed before it",
    ),
    (
      {"placement": {"extra_roles": {"reward2": {"mode": "interleaved", "with_role": "actor"}}}},
      r"^'placement.extra_roles.reward2': 'interleaved' splits a scoring role's devices",
    ),
    ({"placement": {"extra_roles": {"reward2": {"mode": "apart"}}}}, r"'mode' must be one of"),
    ({"model": {"extra_roles": {"reward2": {"size": "3b"}}}}, r"unknown model size '3b'"),
    ({"model": {"roles": {"reward2": {}}}}, r"\(an extra role is set in 'model.extra_roles'\)$"),
  ],
)
def test_bad_extra_roles_are_one_line(changes, message):
  with pytest.raises(ConfigError, match=message) as error:
    _config(**changes)
  assert "\n" not in str(error.value)


def test_an_extra_role_runs_its_own_model_and_takes_the_global_numerics():
  cfg = _config(model={"size": "1b", "dtype": "float32"})
  assert cfg.model.for_role("actor").hidden_size == 2048
  reward2 = cfg.model.for_role("reward2")
  assert (reward2.hidden_size, reward2.dtype) == (56, "float32")
  assert cfg.model.head("reward2") == "value"
  # Not named in `placement.extra_roles`: it shares the reward's devices and mesh.
  assert cfg.placement.extra_roles["reward2"].mode == "shared"
  assert cfg.placement.extra_roles["reward2"].with_role == "reward"


def test_the_flows_that_score_rewards_place_the_extra_reward_roles():
  assert registry.roles_of(_config()) == ("actor", "reference", "reward", "rollout", "reward2")
  # A rule and the second reward model alone: no built-in reward model.
  assert registry.roles_of(_config(reward={"model_coef": 0.0})) == (
    "actor",
    "reference",
    "rollout",
    "reward2",
  )
  assert "reward2" in registry.roles_of(_config(algorithm="online_dpo"))
  assert registry.roles_of(_config(algorithm="sft")) == ("actor",)


def test_every_strategy_places_an_extra_role_shared_interleaved_or_on_its_own_devices():
  shared = build_placement(_config().placement, 8)
  assert shared["reward2"] == shared["reward"]
  assert shared.colocated("reward2", "reward")

  interleaved = build_placement(
    _config({"mode": "interleaved"}, strategy="interleaved").placement, 8
  )
  assert interleaved["reference"].devices == (0, 1, 2, 3)
  assert interleaved["reward"].devices == (4, 5)
  assert interleaved["reward2"].devices == (6, 7)
  assert dict(interleaved["reward2"].axes) == {"data": 1, "fsdp": 2, "tensor": 1}
  assert ("reward", "reward2") in interleaved.disjoint

  own = _config({"mode": "own", "devices": 4, "tensor": 2}, strategy="disaggregated")
  spec = build_placement(own.placement, 8)
  assert spec["reward2"].devices == (4, 5, 6, 7)
  assert dict(spec["reward2"].axes) == {"data": 1, "fsdp": 2, "tensor": 2}
  # The strategy places the built-in roles on the 4 devices left: rollout 2, training 2.
  assert spec["rollout"].devices == (2, 3) and spec["actor"].devices == (0, 1)
  assert {("actor", "reward2"), ("rollout", "reward2")} <= set(spec.disjoint)

  # A hand-written spec: the extra role placed after it, as any strategy's.
  explicit = {r: {"devices": list(range(8)), "axes": {"fsdp": 8}} for r in ("actor", "reward")}
  explicit |= {"critic": explicit["actor"], "reference": explicit["actor"]}
  explicit |= {"rollout": {"devices": list(range(8)), "axes": {"data": 8}}}
  explicit["colocate"] = [["actor", "critic", "reference", "reward", "rollout"]]
  hand = _config({"mode": "interleaved"}, strategy="explicit", placement={"explicit": explicit})
  assert build_placement(hand.placement, 8)["reward2"].devices == (4, 5, 6, 7)

  # Pipeline stages and context parallelism split an extra role's devices as the others'.
  staged = _config({"mode": "own", "devices": 4}, placement={"pipeline_stages": 2})
  assert build_placement(staged.placement, 8)["reward2"].stages == 2
  context = _config({"mode": "interleaved"}, placement={"context": 2})
  assert build_placement(context.placement, 8)["reward2"].context == 2


@pytest.mark.parametrize(
  ("where", "num_devices", "message"),
  [
    (
      {"mode": "own", "devices": 4},
      4,
      r"^placement.extra_roles.reward2: no devices left for its 4 device\(s\) of its own: the "
      r"job has 4 devices",
    ),
    (
      {"mode": "interleaved", "with_role": "reward"},
      1,
      r"^placement.extra_roles.reward2: no devices left to interleave with reward, which has 1 "
      r"device\(s\)",
    ),
  ],
)
def test_an_extra_role_with_no_devices_left_is_one_line_naming_it(where, num_devices, message):
  cfg = _config(where, placement={"num_devices": num_devices})
  with pytest.raises(PlacementError, match=message) as error:
    plan_placement(registry.configure(cfg), 8)
  assert "\n" not in str(error.value)


def test_show_placement_lists_the_extra_role_with_its_memory():
  cfg = registry.configure(_config({"mode": "interleaved"}, strategy="interleaved"))
  spec = plan_placement(cfg, 8)
  estimates = estimate_placement_memory(spec, cfg.model, cfg.rollout)
  # The same model on as many devices as the reward: the same memory.
  assert estimates["reward2"] == estimates["reward"]
  table = format_placement_table(spec, estimates)
  row = next(line for line in table.splitlines() if line.startswith("reward2"))
  assert row.split()[1:4] == ["6,7", "data=1", "fsdp=2"]
  # The built-in roles first, then the extra ones.
  names = [line.split()[0] for line in table.splitlines()[2:-1]]
  assert names == ["actor", "reference", "reward", "rollout", "reward2"]
  assert "reward|reward2" in table.splitlines()[-1]


def test_the_planner_prices_the_extra_roles_scoring_and_searches_its_placement():
  hw, eff = hardware.load_hardware("h100"), efficiency.load_efficiency(None)
  cfg = registry.configure(_config())
  plan = auto.predict(cfg, 8, hw, eff)
  scores = {r.role: r for r in plan.replay.records if r.stage == "score"}
  # The same model on the reward's devices and mesh: a forward priced as the reward's.
  assert scores["reward2"].end - scores["reward2"].start == pytest.approx(
    scores["reward"].end - scores["reward"].start
  )
  without = auto.predict(
    registry.configure(
      dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, extra_roles={}),
        reward=dataclasses.replace(cfg.reward, role_coefs={}),
        placement=dataclasses.replace(cfg.placement, extra_roles={}),
      )
    ),
    8,
    hw,
    eff,
  )
  assert plan.stages["score"] > without.stages["score"]
  assert plan.memory["reward2"].total > 0
  # strategy=auto places it as the config says, in every candidate.
  own = registry.configure(_config({"mode": "own", "devices": 2}, strategy="auto"))
  spec, plans = auto.choose(own, 8)
  assert spec["reward2"].devices == (6, 7)
  assert all(p.spec["reward2"].devices == (6, 7) for p in plans)


def test_a_checkpoints_identity_names_the_extra_roles_and_their_models():
  cfg = _config()
  tokenizer = load_tokenizer("byte")
  roles = registry.roles_of(cfg)
  mine = identity.identity(cfg, roles, tokenizer, None)
  assert "reward2" in mine["roles"] and mine["model.reward2"]["hidden_size"] == 56
  again = identity.identity(_config({"mode": "own", "devices": 2}), roles, tokenizer, None)
  assert identity.differences(mine, again) == []  # another placement resumes
  other = _config(model={"extra_roles": {"reward2": {"size": "125m"}}})
  diffs = identity.differences(mine, identity.identity(other, roles, tokenizer, None))
  assert diffs and all(d.startswith("model.reward2.") for d in diffs)
