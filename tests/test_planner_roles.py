"""Critic-free flows get no critic (and rule rewards no reward model) mesh or memory: from the
flow registry, `plan_placement`, `strategy=auto` and the planner's search (`plan_placement.py`:
test_planner_roles_e2e.py)."""

import dataclasses
import math
import pathlib

import pytest

from rlhfjax.config import from_config_dict
from rlhfjax.costmodel import efficiency, hardware
from rlhfjax.costmodel.pricing import CRITIC_FREE, PPO
from rlhfjax.costmodel.workload import Workload, resolve_model
from rlhfjax.flows import registry
from rlhfjax.placement import estimate_placement_memory
from rlhfjax.placement.spec import Role
from rlhfjax.planner import auto, search
from rlhfjax.planner.place import plan_placement

pytestmark = pytest.mark.pure

REPO = pathlib.Path(__file__).resolve().parents[1]
ALL = set(Role)
POLICY = {Role.ACTOR, Role.REFERENCE, Role.ROLLOUT}


def _config(name: str, strategy: str = "colocated", **sections):
  return from_config_dict(
    {
      "model": {"size": "tiny"},
      "algorithm": {"name": name},
      "ppo": {"group_size": 2},
      "placement": {"strategy": strategy, "hardware": "h100"},
      "reward": {"fn": "rlhfjax.tasks:vowel_reward", **sections.pop("reward", {})},
      **sections,
    }
  )


@pytest.mark.parametrize(
  ("name", "model_coef", "expected"),
  [
    ("ppo", 0.5, ALL),
    ("ppo", 0.0, ALL - {Role.REWARD}),
    ("grpo", 0.0, POLICY),
    ("grpo", 0.5, POLICY | {Role.REWARD}),
    ("rloo", 0.0, POLICY),
    ("reinforce_pp", 0.0, POLICY),
    ("dapo", 0.0, POLICY),
    ("online_dpo", 0.0, POLICY),
    ("dpo", 0.0, {Role.ACTOR, Role.REFERENCE}),
  ],
)
def test_each_flow_places_only_its_roles(name, model_coef, expected):
  config = _config(name, reward={"model_coef": model_coef})
  assert set(registry.roles_of(config)) == expected
  spec = plan_placement(config, 8)
  assert set(spec.roles) == expected
  assert all(a in expected and b in expected for a, b in spec.disjoint)
  # The memory check counts the placed roles only.
  assert set(estimate_placement_memory(spec, config.model, config.rollout)) == expected


def test_a_user_flow_keeps_every_role():
  config = _config("ppo", algorithm={"flow": "examples.rejection_sampling:make_flow"})
  assert set(registry.roles_of(config)) == ALL


@pytest.mark.parametrize("name", ["grpo", "rloo", "dpo"])
def test_auto_plans_no_critic_for_critic_free_flows(name, capsys):
  config = _config(name, strategy="auto")
  work = auto.workload_of(config)
  assert work.critic is None and work.reward is None
  spec, plans = auto.choose(config, 8)
  roles = set(registry.roles_of(config))
  assert set(spec.roles) == roles and Role.CRITIC not in roles
  for plan in plans:
    assert set(plan.spec.roles) == roles and set(plan.memory) == roles
    assert len(plan.spec.devices) == 8  # no candidate leaves the critic's devices idle
  spec = plan_placement(config, 8)
  assert set(spec.roles) == roles
  assert "C:" not in capsys.readouterr().out  # the printed groups name no critic


def test_search_gives_a_critic_free_workload_no_critic_and_no_idle_devices():
  hw, eff = hardware.load_hardware("h100"), efficiency.load_efficiency(None)
  tiny = resolve_model("tiny")
  grpo = Workload(actor=tiny, pricing=CRITIC_FREE, prompts=16, samples_per_prompt=4)
  plans = search.search(grpo, hw, eff, 8)
  ppo = search.search(grpo.replace(pricing=PPO, critic=tiny, reward=tiny), hw, eff, 8)
  assert plans and all(set(p.spec.roles) == POLICY for p in plans)
  assert all(len(p.spec.devices) == 8 for p in plans)
  keys = [tuple((r, s.devices, s.axes) for r, s in p.spec.roles.items()) for p in plans]
  assert len(keys) == len(set(keys))  # variants that became the same placement are one
  # Without critic and reward, the variants that split them off collapse: fewer candidates.
  assert len(plans) < len(ppo)
  assert all(Role.CRITIC in p.spec.roles for p in ppo)


def test_a_judge_is_priced_as_its_engine_generating_verdicts():
  """A generative judge (`reward.judge`) is priced and held as its engine: a prefill of each
  judged text and the decode of its verdicts in its slots (`costs.generate_time`), not a
  scoring forward; its memory is the memory check's (`estimate_placement_memory`)."""
  from rlhfjax.costmodel import costs
  from rlhfjax.planner import evaluate

  config = _config(
    "grpo",
    model={
      "size": "tiny",
      "extra_roles": {"critic_llm": {"kind": "judge", "size": "tiny", "max_new_tokens": 6}},
    },
    placement={
      "strategy": "colocated",
      "hardware": "h100",
      "extra_roles": {"critic_llm": {"mode": "own", "devices": 4, "tensor": 2}},
    },
    reward={"judge": "critic_llm", "judge_coef": 1.0, "fn_coef": 0.0},
  )
  work = auto.workload_of(config)
  section = config.model.extra_roles["critic_llm"]
  engine = work.judges["critic_llm"]
  assert (engine.slots, engine.capacity, engine.verdict) == section.judge_engine(config.rollout, 1)
  spec = plan_placement(config, 8)
  hw, eff = auto.load_planner_inputs(config.placement)
  plan = evaluate.evaluate(spec, work, hw, eff, micro_batch=1)
  judged = work.scored("critic_llm")
  slots, capacity, verdict = section.judge_engine(config.rollout, 2)  # 4 devices / tensor 2
  prefill, decode = costs.generate_time(
    hw,
    eff,
    work.model("critic_llm"),
    costs.Group(devices=4, tensor=2),
    sequences=judged,
    prompt_len=min(capacity, work.prompt_tokens + work.response_len_mean),
    response_mean=verdict,
    response_max=verdict,
    slots=slots // 2,
    static_batching=False,
  )

  def judged_seconds(plan):
    (last, *_) = [r for r in reversed(plan.replay.records) if r.role == "critic_llm"]
    assert last.stage == "score"
    return last.end - last.start

  # The replay's times are sums of start times and durations: each end and start is off by at
  # most a few dozen roundings of the largest time.
  rounding = 64 * math.ulp(max(r.end for r in plan.replay.records))
  assert judged_seconds(plan) == pytest.approx(prefill + decode, rel=0, abs=rounding)
  assert decode > 0 and verdict == 6
  # Priced as a scorer's forward it would be another number.
  forward = dataclasses.replace(work, judges={})
  other = evaluate.evaluate(spec, forward, hw, eff, micro_batch=1)
  assert judged_seconds(other) != pytest.approx(judged_seconds(plan), rel=1e-3)
  checked = estimate_placement_memory(spec, config.model, config.rollout)["critic_llm"]
  assert plan.memory["critic_llm"] == checked
