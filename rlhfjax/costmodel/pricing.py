"""How a flow's iteration is priced: which stages it runs, by which roles, on how many sequences.

A flow registers its `Pricing` beside its factory (`rlhfjax.flows.registry.register`), and the
planner prices a workload by it, so a flow that generates but trains on pairs (online DPO) is
not priced as the flow whose roles it happens to share (GRPO). Roles are named by their
`rlhfjax.placement.spec.Role` values; this layer sits below the placement package.

Counts are per prompt: a prompt of the batch makes `samples_per_prompt` sequences (the
workload's), a stage of a role covers `n` of them, 0 meaning all.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping

_ROLES = ("actor", "critic", "reference", "reward")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Pricing:
  """The stages of one iteration of a flow, as the cost model prices them."""

  name: str
  generates: bool = True
  """The rollout generates the responses (and receives the actor's weights after the update);
  False: the batch is given (DPO's preference pairs), nothing is generated or synced."""
  samples_per_prompt: int = 0
  """Sequences each prompt of a config's batch makes: 0 for the flow's samples per prompt k
  (`ppo.group_size`, `online_dpo.samples_per_prompt`) to each of `rollout.batch_size / k`
  prompts; a number n for n sequences to each of `rollout.batch_size` prompts (DPO's pairs:
  2)."""
  scored: Mapping[str, int]
  """Roles whose forward scores the batch (old log-probs, reference log-probs, values,
  rewards), with the sequences per prompt each scores (0: every one)."""
  trained: Mapping[str, int]
  """Roles updated on the batch, with the sequences per prompt each trains on (0: every one)."""
  packed_pipelines: bool = False
  """The flow's packed updates run through pipeline stages (the PPO family's stack a
  mini-batch's packed micro-batches into one schedule); False: a packing run of it cannot be
  pipelined, so the planner plans no stages for one."""

  def __post_init__(self):
    for what in ("scored", "trained"):
      stages = getattr(self, what)
      unknown = set(stages) - set(_ROLES)
      if unknown:
        raise ValueError(f"{self.name}: {what} names unknown roles {sorted(unknown)}")
      if any(n < 0 for n in stages.values()):
        raise ValueError(f"{self.name}: {what} counts must be >= 0, got {dict(stages)}")
      object.__setattr__(self, what, types.MappingProxyType(dict(stages)))
    if "actor" not in self.trained:
      raise ValueError(f"{self.name}: the actor must be trained")
    if self.samples_per_prompt < 0:
      raise ValueError(f"{self.name}: samples_per_prompt must be >= 0")

  @property
  def roles(self) -> frozenset[str]:
    """Every role a stage of this flow runs on (the rollout if it generates)."""
    return frozenset({*self.scored, *self.trained, *(("rollout",) if self.generates else ())})


PPO = Pricing(
  name="ppo",
  scored={"actor": 0, "reference": 0, "critic": 0, "reward": 0},
  trained={"actor": 0, "critic": 0},
  packed_pipelines=True,
)
"""PPO: every role scores every sample; actor and critic train on all of them. Without a
critic (`Workload.critic` None, as the flow's roles say) it is priced as `CRITIC_FREE`."""
CRITIC_FREE = Pricing(
  name="critic_free",
  scored={"actor": 0, "reference": 0, "reward": 0},
  trained={"actor": 0},
  packed_pipelines=True,
)
"""GRPO, RLOO, REINFORCE++, DAPO: PPO without a critic."""
DPO = Pricing(
  name="dpo",
  generates=False,
  samples_per_prompt=2,
  scored={"reference": 0, "reward": 0},
  trained={"actor": 0},
)
"""Offline DPO: given pairs, scored by the reference; the actor scores its pairs inside its
train step."""
ONLINE_DPO = Pricing(
  name="online_dpo",
  scored={"reward": 0, "reference": 2},
  trained={"actor": 2},
)
"""Online DPO (`rlhfjax.flows.online_dpo`): the rollout generates `online_dpo.samples_per_prompt`
samples per prompt and the reward scores them all, but only the best and the worst of each
prompt form a pair: the reference scores those two and the actor trains on them (no old
log-probs, no critic)."""
