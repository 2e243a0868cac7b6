"""The planner searches the registries: a strategy added with `register_strategy` reaches the
search and `strategy=auto` (`plan_placement.py`: test_planner_registries_e2e.py); a flow is
priced as it registered (online DPO as online DPO, a user's flow by its own `Pricing`), not by a
list kept in the planner."""

import dataclasses
import textwrap

import pytest

from rlhfjax.config import PlacementSection, from_config_dict
from rlhfjax.costmodel import efficiency, hardware, pricing
from rlhfjax.costmodel.pricing import Pricing
from rlhfjax.costmodel.workload import resolve_model
from rlhfjax.flows import registry
from rlhfjax.placement import strategies
from rlhfjax.placement.spec import Role
from rlhfjax.planner import auto, evaluate, search
from rlhfjax.planner.place import plan_placement

pytestmark = pytest.mark.pure

# A strategy none of the built-in ones makes: disaggregated, but with the rollout on the first
# devices. Written out again in test_planner_registries_e2e.py's subprocess, which cannot see
# this registry.
_TOY = textwrap.dedent(
  """
  import dataclasses
  from rlhfjax.placement import strategies

  def rollout_first(cfg, n):
    spec = strategies.disaggregated(
      n, rollout_fraction=0.25, tensor=cfg.tensor, rollout_tensor=cfg.rollout_tensor
    )
    flip = lambda rs: dataclasses.replace(rs, devices=tuple(n - 1 - d for d in rs.devices[::-1]))
    roles = {role: flip(rs) for role, rs in spec.roles.items()}
    return dataclasses.replace(spec, strategy="rollout_first", roles=roles)
  """
)


def _config(name: str, strategy: str = "colocated", **sections):
  return from_config_dict(
    {
      "model": {"size": "tiny"},
      "algorithm": {"name": name},
      "rollout": {"batch_size": 16},
      "ppo": {"group_size": 4},
      "placement": {"strategy": strategy, "hardware": "h100"},
      "reward": {"fn": "rlhfjax.tasks:vowel_reward"},
      **sections,
    }
  )


@pytest.fixture
def toy_strategy(monkeypatch):
  monkeypatch.setattr(strategies, "_STRATEGIES", dict(strategies._STRATEGIES))
  namespace = {}
  exec(_TOY, namespace)
  strategies.register_strategy("rollout_first", namespace["rollout_first"])
  return "rollout_first"


def test_a_registered_strategy_is_searched(toy_strategy):
  assert toy_strategy in strategies.searched_strategies()
  assert "explicit" not in strategies.searched_strategies()  # the config's own spec
  hw, eff = hardware.load_hardware("h100"), efficiency.load_efficiency(None)
  work = auto.workload_of(_config("ppo"))
  plans = search.search(work, hw, eff, 8, strategy=toy_strategy)
  assert plans and {p.spec.strategy for p in plans} == {toy_strategy}
  assert all(p.spec[Role.ROLLOUT].devices == (0, 1) for p in plans)
  # One variant per pair of tensor sizes dividing the heads, labelled with them (and with the
  # per-role sizes the best few were given, after them).
  labels = {p.label for p in plans}
  for want in (f"{toy_strategy} t=1 rt=1", f"{toy_strategy} t=2 rt=2"):
    assert any(label == want or label.startswith(f"{want} ") for label in labels), want
  everything = search.search(work, hw, eff, 8)
  assert toy_strategy in {p.spec.strategy for p in everything}
  assert {"colocated", "interleaved", "disaggregated"} <= {p.spec.strategy for p in everything}


def test_a_strategy_registered_with_variants_is_searched_over_them(monkeypatch):
  monkeypatch.setattr(strategies, "_STRATEGIES", dict(strategies._STRATEGIES))

  def build(cfg, n):
    spec = strategies.disaggregated(
      n, rollout_fraction=cfg.rollout_fraction, tensor=cfg.tensor, rollout_tensor=cfg.rollout_tensor
    )
    return dataclasses.replace(spec, strategy="spread")

  def variants(n, tensor, rollout_tensor, rollout_devices):
    for k in (2, 4):
      section = PlacementSection(
        strategy="spread", rollout_fraction=k / n, tensor=tensor, rollout_tensor=rollout_tensor
      )
      yield f"spread rollout={k}", section

  strategies.register_strategy("spread", build, variants)
  hw, eff = hardware.load_hardware("h100"), efficiency.load_efficiency(None)
  plans = search.search(auto.workload_of(_config("ppo")), hw, eff, 8, strategy="spread")
  assert {len(p.spec[Role.ROLLOUT].devices) for p in plans} == {2, 4}
  assert all(p.label.startswith("spread rollout=") for p in plans)


def test_a_registered_strategy_reaches_strategy_auto(toy_strategy, capsys):
  config = _config("ppo", strategy="auto")
  _, plans = auto.choose(config, 8)
  assert toy_strategy in {p.spec.strategy for p in plans}
  plan_placement(config, 8)
  assert "placement auto chosen" in capsys.readouterr().out


def _score_roles(plan) -> set[str]:
  return {r.role for r in plan.replay.records if r.stage == "score" and r.iteration == 0}


def test_online_dpo_is_priced_as_online_dpo_not_as_grpo():
  """Both sample 4 responses per prompt (`online_dpo.samples_per_prompt`, `ppo.group_size`) and
  need no critic; but online DPO keeps the best and the worst of each prompt as a pair: the
  reference scores those two, the actor trains on them, and no old log-probs are scored
  (`rlhfjax.flows.online_dpo`)."""
  online = auto.workload_of(_config("online_dpo", online_dpo={"samples_per_prompt": 4}))
  grpo = auto.workload_of(_config("grpo"))
  assert online.pricing is pricing.ONLINE_DPO and grpo.pricing is pricing.CRITIC_FREE
  assert online.sequences == grpo.sequences == 16  # 4 prompts x 4 samples, both generated
  assert (online.scored("actor"), online.scored("reference"), online.trained("actor")) == (0, 8, 8)
  assert (grpo.scored("actor"), grpo.scored("reference"), grpo.trained("actor")) == (16, 16, 16)
  assert online.train_rows * 2 == grpo.train_rows  # micro-steps of pairs: half the rows
  hw, eff = hardware.load_hardware("h100"), efficiency.load_efficiency(None)
  seven = resolve_model("7b")
  big = dict(actor=seven, reference=seven, prompts=256, train_rows=0)
  spec = strategies.colocated(8)
  a = evaluate.evaluate(spec, online.replace(**big), hw, eff, micro_batch=4)
  b = evaluate.evaluate(spec, grpo.replace(**big), hw, eff, micro_batch=4)
  assert _score_roles(a) == {"reference"} and _score_roles(b) == {"actor", "reference"}
  assert a.stages["generate"] == pytest.approx(b.stages["generate"])
  assert a.stages["score"] < b.stages["score"] / 2
  assert a.stages["update"] < b.stages["update"] * 0.6


def test_a_user_registered_flow_is_priced_as_it_registered(monkeypatch, capsys):
  registry.builtin()  # registered into the real table before it is copied
  monkeypatch.setattr(registry, "FLOWS", dict(registry.FLOWS))
  # Best-of-k fine-tuning: the reward model scores every sample, the actor trains on the best.
  best_of_k = Pricing(name="best_of_k", scored={"reward": 0}, trained={"actor": 1})
  roles = frozenset({Role.ACTOR, Role.REFERENCE, Role.ROLLOUT, Role.REWARD})
  registry.register("best_of_k", roles=lambda cfg: roles, pricing=best_of_k)(lambda ctx: None)
  config = _config("best_of_k", strategy="auto")
  work = auto.workload_of(config)
  assert work.pricing is best_of_k and work.critic is None and work.reward is not None
  assert (work.scored("reward"), work.scored("reference"), work.scored("actor")) == (16, 0, 0)
  assert work.trained("actor") == 4 and work.train_rows == 4
  spec = plan_placement(config, 8)
  assert set(spec.roles) == roles
  assert "placement auto chosen" in capsys.readouterr().out
  hw, eff = auto.load_planner_inputs(config.placement)
  plan = evaluate.evaluate(strategies.colocated(8).only(roles), work, hw, eff, micro_batch=0)
  assert _score_roles(plan) == {"reward"}
  assert {r.role for r in plan.replay.records if r.stage == "update"} == {"actor"}


_USER_FLOW = textwrap.dedent(
  """
  from rlhfjax.costmodel.pricing import Pricing
  from rlhfjax.flows import registry
  from rlhfjax.placement.spec import Role

  def undeclared(ctx):
    raise AssertionError("not built here")

  @registry.declare(
    roles=lambda cfg: frozenset({Role.ACTOR, Role.ROLLOUT, Role.REWARD}),
    pricing=Pricing(name="best_of_k", scored={"reward": 0}, trained={"actor": 1}),
  )
  def padded(ctx):
    raise AssertionError("not built here")

  @registry.declare(packs=None, trains=(Role.ACTOR,))
  def packed(ctx):
    raise AssertionError("not built here")
  """
)


def test_a_users_own_flow_is_placed_and_priced_as_it_declares(tmp_path, monkeypatch):
  """`algorithm.flow`: undeclared, every role, PPO's pricing, padded; `registry.declare`d, its
  roles and pricing, and packed as its section says when it declares `packs=None`."""
  (tmp_path / "my_flows.py").write_text(_USER_FLOW)
  monkeypatch.syspath_prepend(str(tmp_path))

  def config(factory, **sections):
    return _config("ppo", algorithm={"flow": f"my_flows:{factory}"}, **sections)

  undeclared = auto.workload_of(config("undeclared"))
  assert undeclared.pricing is pricing.PPO and undeclared.padded
  assert set(registry.roles_of(config("undeclared"))) == set(Role)
  padded = config("padded", ppo={"group_size": 4, "packing": True})
  work = auto.workload_of(padded)
  assert work.pricing.name == "best_of_k" and work.padded and work.critic is None
  assert set(registry.roles_of(padded)) == {Role.ACTOR, Role.ROLLOUT, Role.REWARD}
  for packing in (True, False):
    packed = config("packed", ppo={"group_size": 4, "packing": packing})
    assert auto.workload_of(packed).packed is packing
    assert registry.configure(packed).model.trained_roles == ("actor",)


def _with_ppo(config, **changes):
  return dataclasses.replace(config, ppo=dataclasses.replace(config.ppo, **changes))


def test_an_estimator_is_one_registration(monkeypatch):
  """An advantage estimator registered where it is defined is placed (a critic or none),
  checked (groups) and usable by a sequence-level policy loss, with nothing else edited."""
  from rlhfjax import algorithms as alg
  from rlhfjax.config import ConfigError

  monkeypatch.setattr(alg.advantages, "ADVANTAGE_ESTIMATORS", dict(alg.ADVANTAGE_ESTIMATORS))
  monkeypatch.setattr(alg, "ADVANTAGE_ESTIMATORS", alg.advantages.ADVANTAGE_ESTIMATORS)
  alg.advantages.register_estimator("best_baseline", per_sequence=True, groups=True)(
    lambda scores_b, kl_bt, values_bt, mask_bt, kl_coef, s: None
  )
  config = _config("ppo", ppo={"advantage": "best_baseline", "group_size": 4})
  assert Role.CRITIC not in registry.roles_of(config)
  registry.configure(_with_ppo(config, policy_loss="gspo"))
  with pytest.raises(ConfigError, match="'best_baseline' advantages compare the samples"):
    registry.configure(_with_ppo(config, group_size=1))
  with pytest.raises(ValueError, match="registered twice"):
    alg.advantages.register_estimator("gae")(lambda *a: None)


def test_pricing_refuses_what_no_flow_runs():
  with pytest.raises(ValueError, match="unknown roles"):
    Pricing(name="x", scored={"critc": 0}, trained={"actor": 0})
  with pytest.raises(ValueError, match="actor must be trained"):
    Pricing(name="x", scored={}, trained={"critic": 0})
  assert pricing.PPO.roles == {"actor", "critic", "reference", "reward", "rollout"}
  assert "rollout" not in pricing.DPO.roles


def test_a_model_the_planner_cannot_find_says_what_is_missing(tmp_path):
  """`--actor=` of the planning CLI: a path names the file that is not there, a directory its
  missing config.json, anything else the sizes the registry has."""
  from rlhfjax.config.model import model_sizes

  missing = tmp_path / "nope" / "config.json"
  with pytest.raises(ValueError, match=f"^model '{missing}': {missing} not found$"):
    resolve_model(str(missing))
  with pytest.raises(ValueError, match=f"^model '{tmp_path}': the directory has no config.json$"):
    resolve_model(str(tmp_path))
  sizes = ", ".join(model_sizes())
  with pytest.raises(ValueError, match=rf"^model '8q' is neither a size \({sizes}\) nor a path"):
    resolve_model("8q")
