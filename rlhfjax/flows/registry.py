"""Flows by name: `algorithm.name` picks a registered flow, `algorithm.flow='module:function'`
a user's own (a factory `make_flow(ctx: FlowContext) -> flow`).

A flow is an object with:
  iteration(i) -> dict[str, float]   one iteration's metrics row;
  checkpoint_items() -> dict          arrays to save beside the trained roles' states;
  abstract_items() -> dict            their shapes and shardings, to restore into;
  meta() -> dict / restore(items, meta)  its JSON state (see `rlhfjax.runner`);
  close()                             stops background work.
`rlhfjax.flows.base.Flow` implements the parts most flows share.

A flow registered with `roles` (a function of the config) declares the roles it places: the
placement, its memory check and the planner give the others no mesh and no memory (GRPO has
no critic; a rule reward needs no reward model; DPO generates nothing). Its `pricing`
(`rlhfjax.costmodel.pricing.Pricing`) says how the planner prices an iteration: which stages
run, by which roles, on how many of the batch's sequences; its `batch` (a function of the
config) which section sets the samples per prompt, epochs, mini- and micro-batches that the
planner prices and the memory check sizes (default: `ppo`'s). One registered with `prompts=False`
reads its own dataset, not the prompt stream, and scores no samples (SFT, the reward model): the
runner builds it no prompt stream and no rewards.

A flow may also have:
  evaluate() -> dict[str, float]      its own held-out metrics ('eval/...'), which the runner
                                      records at step 0, every `eval.every_steps` steps and
                                      after the last instead of sampling held-out prompts;
  steps_from_one: bool                its rows are numbered by the updates done (the row of
                                      iteration i is step i + 1), as an optimizer counts;
  plots: tuple                        (metric, file, title) of the curves drawn in the workdir.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from rlhfjax.config import BatchShape
from rlhfjax.costmodel.pricing import PPO, Pricing
from rlhfjax.flows import user
from rlhfjax.placement.spec import Role

FLOWS: dict[str, Callable[..., Any]] = {}
"""Registered flow factories by name."""
ROLES: dict[str, Callable[[Any], frozenset[Role]]] = {}
"""The roles each registered flow uses, as a function of the experiment config."""
PRICING: dict[str, Pricing] = {}
"""How the planner prices an iteration of each registered flow."""
_NO_PROMPTS: set[str] = set()
"""Registered flows that read no prompt stream."""
BATCH: dict[str, Callable[[Any], BatchShape]] = {}
"""The batch shape each registered flow reads, as a function of the experiment config."""

_BUILTIN = ("ppo", "dpo", "online_dpo", "sft", "rm")
"""Modules of `rlhfjax.flows` whose import registers the built-in flows."""


def register(
  name: str,
  roles: Callable[[Any], frozenset[Role]] | None = None,
  pricing: Pricing | None = None,
  batch: Callable[[Any], BatchShape] | None = None,
  *,
  prompts: bool = True,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
  """Decorator: registers a flow factory (or class) under `name`; `roles(config)` says which
  roles it uses (default: all of them), `pricing` how the planner prices it (default: PPO's
  stages on the roles it uses), `batch(config)` its batch shape (default: `ppo`'s);
  `prompts=False`: it reads no prompt stream."""

  def wrap(factory: Callable[..., Any]) -> Callable[..., Any]:
    FLOWS[name] = factory
    if roles is not None:
      ROLES[name] = roles
    if pricing is not None:
      PRICING[name] = pricing
    if not prompts:
      _NO_PROMPTS.add(name)
    if batch is not None:
      BATCH[name] = batch
    return factory

  return wrap


def builtin() -> dict[str, Callable[..., Any]]:
  """The registered flows, the built-in ones imported."""
  for module in _BUILTIN:
    importlib.import_module(f"rlhfjax.flows.{module}")
  return FLOWS


def resolve(name: str, flow: str = "") -> Callable[..., Any]:
  """The factory of `flow` ('module:function') if given, else of the registered `name`."""
  if flow:
    return user.load(flow)
  flows = builtin()
  if name not in flows:
    raise ValueError(f"'algorithm.name' must be one of {', '.join(sorted(flows))}, got {name!r}")
  return flows[name]


def roles_of(config: Any) -> tuple[Role, ...]:
  """The roles the configured flow uses, in `Role` order; every role for a user's own flow
  (`algorithm.flow`), whose needs are unknown."""
  if config.algorithm.flow:
    return tuple(Role)
  builtin()
  declared = ROLES.get(config.algorithm.name)
  used = declared(config) if declared else frozenset(Role)
  return tuple(role for role in Role if role in used)


def pricing_of(config: Any) -> Pricing:
  """How the planner prices the configured flow; PPO's stages for a user's own flow
  (`algorithm.flow`) or a flow registered without a pricing."""
  if config.algorithm.flow:
    return PPO
  builtin()
  return PRICING.get(config.algorithm.name, PPO)


def batch_of(config: Any) -> BatchShape:
  """The batch shape of the configured flow; `ppo`'s for a user's own flow (`algorithm.flow`)
  or a flow registered without one."""
  if not config.algorithm.flow:
    builtin()
    declared = BATCH.get(config.algorithm.name)
    if declared:
      return declared(config)
  return config.ppo.batch


def pricing_by_name(name: str) -> Pricing:
  """The pricing of the registered flow `name` (the planning CLI's `--algorithm`)."""
  flows = builtin()
  if name not in flows:
    raise ValueError(f"unknown flow {name!r}; registered: {', '.join(sorted(flows))}")
  return PRICING.get(name, PPO)


def reads_prompts(config: Any) -> bool:
  """Whether the configured flow reads the prompt stream (a user's own flow may)."""
  if config.algorithm.flow:
    return True
  builtin()
  return config.algorithm.name not in _NO_PROMPTS


def policy_roles(config: Any, *, critic: bool, rollout: bool = True) -> frozenset[Role]:
  """Actor and reference, the rollout if the flow generates, the critic if asked, and the
  reward model unless the reward is a rule alone (`reward.model_coef` = 0; the runner loads a
  reward model whenever it is not)."""
  roles = {Role.ACTOR, Role.REFERENCE}
  if rollout:
    roles.add(Role.ROLLOUT)
  if critic:
    roles.add(Role.CRITIC)
  if config.reward.model_coef != 0.0:
    roles.add(Role.REWARD)
  return frozenset(roles)
