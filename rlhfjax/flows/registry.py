"""Flows by name: `algorithm.name` picks a registered flow, `algorithm.flow='module:function'`
a user's own (a factory `make_flow(ctx: FlowContext) -> flow`).

A flow is an object with:
  iteration(i) -> dict[str, float]   one iteration's metrics row;
  checkpoint_items() -> dict          arrays to save beside the trained roles' states;
  abstract_items() -> dict            their shapes and shardings, to restore into;
  meta() -> dict / restore(items, meta)  its JSON state (see `rlhfjax.runner`);
  close()                             stops background work.
`rlhfjax.flows.base.Flow` implements the parts most flows share.

What the rest of the library asks of a flow is declared once, where the flow is defined, as a
`FlowSpec` (`register` for a built-in flow, `declare` on a user's factory): the roles it places
(the placement, its memory check and the planner give the others no mesh and no memory: GRPO
has no critic, a rule reward needs no reward model, DPO generates nothing), the roles it
trains (fp32 masters: `ModelSection.trained_roles`, set by `configure`), how the planner
prices an iteration (`rlhfjax.costmodel.pricing.Pricing`), the config section that sets its
batch shape and packing, and whether it reads the prompt stream (SFT and the reward model
read their own datasets: the runner builds them no prompt stream and no rewards). Nothing
outside this module branches on a flow's name.

A flow may also have:
  evaluate() -> dict[str, float]      its own held-out metrics ('eval/...'), which the runner
                                      records at step 0, every `eval.every_steps` steps and
                                      after the last instead of sampling held-out prompts;
  steps_from_one: bool                its rows are numbered by the updates done (the row of
                                      iteration i is step i + 1), as an optimizer counts;
  plots: tuple                        (metric, file, title) of the curves drawn in the workdir.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Any

from rlhfjax.config import BatchShape, ConfigError
from rlhfjax.costmodel.pricing import PPO, Pricing
from rlhfjax.flows import user
from rlhfjax.placement.spec import Role, ordered


def _every_role(config: Any) -> frozenset[str]:
  return frozenset(Role) | frozenset(config.model.extra_roles)


@dataclasses.dataclass(frozen=True, kw_only=True)
class FlowSpec:
  """What the runner, the placement, the planner and the config ask of one flow."""

  name: str
  """`algorithm.name` (a built-in flow), or the 'module:function' of a user's own."""
  factory: Callable[..., Any] | None = None
  """`make_flow(ctx) -> flow`; None on a user's declaration (`declare`), which decorates it."""
  roles: Callable[[Any], frozenset[str]] = _every_role
  """The roles it places, as a function of the experiment config (default: every one, the
  config's extra roles (`model.extra_roles`) included); an extra role is one of them by its
  name."""
  trains: tuple[Role, ...] = (Role.ACTOR, Role.CRITIC)
  """The roles it may train: they keep fp32 master weights (`ModelSection.trained_roles`)."""
  pricing: Pricing = PPO
  """The stages of an iteration, as the planner prices them (default: PPO's on its roles)."""
  section: str = "ppo"
  """The config section that sets its batch shape (`batch`: samples per prompt, epochs, mini-
  and micro-batches; `ppo`'s for a section without one) and its packing (`packing`,
  `max_tokens_per_micro_batch`)."""
  packs: bool | None = None
  """Whether it scores and trains on packed rows: None as its section's `packing` says; a
  user's flow that pads whatever the section says declares False (its default when it
  declares nothing)."""
  prompts: bool = True
  """It reads the prompt stream and scores samples; False: it trains one model on its own
  dataset (SFT, the reward model), sized by `rlhfjax.planner.single`."""
  fused_scoring: bool = False
  """It scores samples as they finish (`rollout.fused_scoring`); `configure` refuses the
  option for the others."""
  check: Callable[[Any], Any] | None = None
  """`check(config)` raises `ConfigError` for what the flow cannot run, before anything is
  built (`configure` runs it)."""

  def __post_init__(self):
    if self.section not in _SECTIONS:
      raise ValueError(f"flow {self.name!r}: section must be one of {', '.join(_SECTIONS)}")


_SECTIONS = ("ppo", "online_dpo", "dpo", "supervised")
"""The config sections a flow may read its batch shape and packing from."""

FLOWS: dict[str, FlowSpec] = {}
"""The registered flows by name."""

_BUILTIN = ("ppo", "dpo", "online_dpo", "sft", "rm")
"""Modules of `rlhfjax.flows` whose import registers the built-in flows."""


def register(name: str, **fields: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
  """Decorator: registers a flow factory (or class) under `name` with its `FlowSpec` fields."""

  def wrap(factory: Callable[..., Any]) -> Callable[..., Any]:
    FLOWS[name] = FlowSpec(name=name, factory=factory, **fields)
    return factory

  return wrap


def declare(**fields: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
  """Decorator for a user's own factory (`algorithm.flow`): its `FlowSpec` fields, so that it
  is placed, priced and sized as it runs. Undeclared, a user's flow places every role, is
  priced as PPO on the `ppo` section's batch and pads; declared, it pads unless it says
  `packs` (None: as its section's `packing` says)."""

  def wrap(factory: Callable[..., Any]) -> Callable[..., Any]:
    setattr(factory, user.DECLARED, fields)
    return factory

  return wrap


def builtin() -> dict[str, FlowSpec]:
  """The registered flows, the built-in ones imported."""
  for module in _BUILTIN:
    importlib.import_module(f"rlhfjax.flows.{module}")
  return FLOWS


def spec_of(config: Any) -> FlowSpec:
  """The `FlowSpec` of the configured flow: the registered `algorithm.name`'s, or what a
  user's own factory (`algorithm.flow`) declares.

  Raises:
    ConfigError: no flow of that name is registered.
    user.FlowError: the user's flow cannot be imported.
  """
  flow = config.algorithm.flow
  if flow:
    declared = getattr(user.load(flow), user.DECLARED, None) or {}
    return FlowSpec(name=flow, **{"packs": False, **declared})  # a user's flow pads unless it says
  flows = builtin()
  name = config.algorithm.name
  if name not in flows:
    raise ConfigError(f"'algorithm.name' must be one of {', '.join(sorted(flows))}, got {name!r}")
  return flows[name]


def resolve(config: Any) -> Callable[..., Any]:
  """The factory of the configured flow (a user's wrapped so that its faults name it)."""
  if config.algorithm.flow:
    return user.load(config.algorithm.flow)
  return spec_of(config).factory


def configure(config: Any) -> Any:
  """`config` with what its flow declares that the config must know: the roles it trains
  (`ModelSection.trained_roles`, which keep fp32 masters), after the flow's own `check`. Every
  entry that builds models of a config (the runner, the placement, the scripts) passes it
  through here.

  Raises:
    ConfigError: the flow cannot run this config (`FlowSpec.check`), in one line.
  """
  spec = spec_of(config)
  if config.rollout.fused_scoring and not spec.fused_scoring:
    raise ConfigError(
      "'rollout.fused_scoring' is for the flows that score samples while they generate "
      f"({', '.join(fused_scoring_flows())}); {spec.name} does not: set it to False"
    )
  _check_context(config, spec)
  trained = tuple(role.value for role in spec.trains)
  parked = [name for name in config.offload.params if name in trained]
  if parked and spec.section != "ppo":
    raise ConfigError(
      f"'offload.params' names {', '.join(parked)}: a trained role's parameters come back for "
      f"the stages of the PPO-family flows; {spec.name} updates and evaluates outside them: "
      "leave it out"
    )
  if spec.check is not None:
    spec.check(config)
  for role, section in config.model.roles.items():
    if section.lora_rank and role not in trained:
      raise ConfigError(
        f"'model.roles.{role}.lora_rank'={section.lora_rank}: {spec.name} does not train the "
        f"{role} (it trains {', '.join(trained)}); adapters are for trained roles"
      )
  if config.model.trained_roles == trained:
    return config
  model = dataclasses.replace(config.model, trained_roles=trained)
  return dataclasses.replace(config, model=model)


def _check_context(config: Any, spec: FlowSpec) -> None:
  """`placement.context` splits every row of the flow's model into equal pieces."""
  context = config.placement.context
  if spec.section == "supervised":
    width, field = config.supervised.max_len, "'supervised.max_len'"
  else:
    width = config.rollout.max_seq_len
    field = "'rollout.max_prompt_len' + 'rollout.max_new_tokens'"
  if width % context:
    raise ConfigError(
      f"'placement.context'={context} does not divide the rows' {width} tokens ({field}): "
      f"make them a multiple of {context}"
    )


def roles_of(config: Any) -> tuple[str, ...]:
  """The roles the configured flow uses: the built-in ones in `Role` order, then the extra
  ones (`model.extra_roles`) in the config's order."""
  used = spec_of(config).roles(config)
  return ordered(role for role in config.model.role_names if role in used)


def reference_from_base(config: Any) -> bool:
  """Whether the configured flow's reference runs the actor's base weights with the adapters
  off, placed on the actor's devices with no weights of its own
  (`ModelSection.reference_from_base`, `PlacementSpec.beside`)."""
  used = set(roles_of(config))
  return config.model.reference_from_base and {Role.ACTOR, Role.REFERENCE} <= used


def pricing_of(config: Any) -> Pricing:
  """How the planner prices the configured flow."""
  return spec_of(config).pricing


def section_of(config: Any) -> Any:
  """The config section the configured flow reads its batch shape and packing from."""
  return getattr(config, spec_of(config).section)


def batch_of(config: Any) -> BatchShape:
  """The batch shape of the configured flow: its section's, or `ppo`'s for a section that
  sets none (offline DPO's pairs)."""
  section = section_of(config)
  return section.batch if hasattr(section, "batch") else config.ppo.batch


def packs(config: Any) -> bool:
  """Whether the configured flow scores and trains on packed rows, as the planner prices and
  the memory check sizes it: as its section's `packing` says unless it declares otherwise; a
  flow on its own dataset (`prompts=False`) is sized by `rlhfjax.planner.single`, not here."""
  spec = spec_of(config)
  if not spec.prompts:
    return False
  return section_of(config).packing if spec.packs is None else spec.packs


def train_budget(config: Any) -> int:
  """Tokens per packed training micro-step: the flow's section's `max_tokens_per_micro_batch`
  (0: the padded micro-batch's)."""
  return section_of(config).max_tokens_per_micro_batch


def pricing_by_name(name: str) -> Pricing:
  """The pricing of the registered flow `name` (the planning CLI's `--algorithm`)."""
  flows = builtin()
  if name not in flows:
    raise ValueError(f"unknown flow {name!r}; registered: {', '.join(sorted(flows))}")
  return flows[name].pricing


def reads_prompts(config: Any) -> bool:
  """Whether the configured flow reads the prompt stream."""
  return spec_of(config).prompts


def fused_scoring_flows() -> tuple[str, ...]:
  """The registered flows that score samples as they finish (`rollout.fused_scoring`)."""
  return tuple(name for name, spec in builtin().items() if spec.fused_scoring)


def policy_roles(config: Any, *, critic: bool, rollout: bool = True) -> frozenset[str]:
  """Actor and reference, the rollout if the flow generates, the critic if asked, the reward
  model unless the reward is a rule alone (`reward.model_coef` = 0; the runner loads a reward
  model whenever it is not), and the extra reward roles (`reward.role_coefs`) and the judge
  (`reward.judge`), which score with it (`rlhfjax.cluster.rewards`)."""
  roles = {Role.ACTOR, Role.REFERENCE}
  if rollout:
    roles.add(Role.ROLLOUT)
  if critic:
    roles.add(Role.CRITIC)
  if config.reward.model_coef != 0.0:
    roles.add(Role.REWARD)
  judge = {config.reward.judge} if config.reward.judge else set()
  return frozenset(roles) | frozenset(config.reward.role_coefs) | judge
