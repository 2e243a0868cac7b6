"""Typed experiment configuration, converted from the `ml_collections.ConfigDict` of a config file.

`configs/*.py` expose `get_config()` returning a `ConfigDict` (so absl flags can override any
field: `--config.placement.strategy=interleaved`); `from_config_dict` turns it into a frozen
`ExperimentConfig` and rejects unknown fields and wrong types with a one-line `ConfigError`.
Later sections (ppo, data, checkpoint, ...) are new fields of `ExperimentConfig` with defaults:
the conversion walks the dataclass fields, so nothing else has to change.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import os
import re
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from rlhfjax import ranges
from rlhfjax.config import choices, hf
from rlhfjax.config import model as model_config

_DTYPES = ("float32", "bfloat16")
_BITS = {"float32": 32, "bfloat16": 16}
T = TypeVar("T")


class ConfigError(ValueError):
  """A config field is unknown, missing, of the wrong type or has an invalid value."""


def _check_choice(field: str, value: Any, names: Sequence[str]) -> None:
  if value not in names:
    raise ConfigError(f"'{field}' must be one of {', '.join(names)}, got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RoleModelSection:
  """Numerics and memory settings of one role's model; None: the size's own (or the section's)."""

  dtype: str | None = None
  """Compute dtype ('float32' or 'bfloat16')."""
  param_dtype: str | None = None
  """Parameter dtype: the trained roles keep fp32 masters, frozen roles may store bf16."""
  remat: str | None = None
  """Rematerialisation policy (`model.REMAT_POLICIES`)."""
  attention: str | None = None
  """Attention kernel (`model.ATTENTION_IMPLS`)."""
  logprob_chunk_size: int | None = None
  """Tokens per chunk of the log-prob / entropy / LM-loss computation."""
  hf: str = ""
  """The critic's or the reward model's own Hugging Face checkpoint directory (a causal LM or a
  one-label *ForSequenceClassification): its config.json gives the role's architecture, and
  its weights start the role unless `init.critic` / `init.reward` say otherwise."""
  lora_rank: int | None = None
  """A trained role's own LoRA rank over `model.lora.rank` (0: this role trains its full
  weights; None: `model.lora.rank`), with `model.lora`'s alpha and targets."""

  def __post_init__(self):
    known_names = {
      "dtype": _DTYPES,
      "param_dtype": _DTYPES,
      "remat": model_config.REMAT_POLICIES,
      "attention": model_config.ATTENTION_IMPLS,
    }
    for name, known in known_names.items():
      if getattr(self, name) is not None:
        _check_choice(name, getattr(self, name), known)
    if self.logprob_chunk_size is not None and self.logprob_chunk_size < 1:
      raise ConfigError(f"'logprob_chunk_size' must be >= 1, got {self.logprob_chunk_size}")
    if self.lora_rank is not None and self.lora_rank < 0:
      raise ConfigError(f"'lora_rank' must be >= 0 (0: no adapters), got {self.lora_rank}")

  def overrides(self) -> dict[str, Any]:
    """The `ModelConfig` fields this section sets."""
    return {
      name: getattr(self, name)
      for name in model_config.NUMERICS_FIELDS
      if getattr(self, name) is not None
    }


_ROLES = ("actor", "critic", "reference", "reward", "rollout")
ROLE_HEADS: dict[str, model_config.HeadKind] = {
  "actor": "lm",
  "critic": "value",
  "reference": "lm",
  "reward": "value",
  "rollout": "lm",
}
"""The head each built-in role's model carries: policies score tokens, value models states or
sequences."""
EXTRA_ROLE_KINDS: dict[str, model_config.HeadKind] = {"reward": "value", "judge": "lm"}
"""What an extra role (`ExtraRoleSection.kind`) may do, with the head its model carries:
'reward', a frozen reward model (a value head read at each sequence's last token, as the
built-in reward's) whose score joins the reward with its weight in `reward.role_coefs`;
'judge', a frozen language model that generates a verdict on each response, parsed to a score
(`reward.judge`, `rlhfjax.cluster.judge`)."""
_RESERVED_ROLE_NAMES = (*_ROLES, "reward_fn", "environment")
"""Names an extra role may not take: the built-in roles, and the host stages of the rule
reward and of the environment's rewards."""
_ROLE_NAME = re.compile(r"[a-z][a-z0-9_]*")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExtraRoleSection(RoleModelSection):
  """A role beyond the built-in five (`model.extra_roles.<name>`, e.g. 'reward2'): its model,
  numerics and what it does. It is placed like any role (`placement.extra_roles.<name>`),
  counted by the memory check and `show_placement`, and priced by the planner. Extra roles are
  frozen: a checkpoint holds nothing of them (a resume loads them from `init` or `hf` again)."""

  kind: str = "reward"
  """What it does: one of `EXTRA_ROLE_KINDS` ('reward': a reward model whose score joins the
  reward, weighted by `reward.role_coefs.<name>`; 'judge': a language model generating
  verdicts, `reward.judge`)."""
  size: str | None = None
  """A registered size; None: `hf`'s architecture, or else the actor's model."""
  init: str = ""
  """Its weights: a reward-model run (item 'reward') or a Hugging Face sequence-classification
  checkpoint for a reward role, a policy run (item 'actor') or a Hugging Face causal LM for a
  judge; empty: `hf`'s weights when set, else a random initialisation (seeded by `seed` and the
  role's name)."""

  slots: int = 0
  """A judge's decode slots (its engine's batch, rounded up to a multiple of its 'data'
  replicas); 0: `rollout.batch_size`, at most 64."""
  max_prompt_len: int = 0
  """A judge's prompt capacity in tokens (the template filled with a prompt and a response; a
  longer one keeps its first token and its end); 0: the rollout's `max_seq_len` + 64."""
  max_new_tokens: int = 8
  """A judge's longest verdict."""

  def __post_init__(self):
    super().__post_init__()
    _check_choice("kind", self.kind, tuple(EXTRA_ROLE_KINDS))
    ranges.check(
      "",
      self,
      slots=ranges.NON_NEGATIVE,
      max_prompt_len=ranges.NON_NEGATIVE,
      max_new_tokens=ranges.COUNT,
    )
    if self.size is not None and self.size not in model_config.model_sizes():
      raise ConfigError(
        f"unknown model size {self.size!r}; known sizes: {', '.join(model_config.model_sizes())}"
      )
    if self.lora_rank is not None:
      raise ConfigError("'lora_rank': an extra role is frozen, it trains no adapters")

  def judge_engine(self, rollout: RolloutSection, data: int) -> tuple[int, int, int]:
    """A judge's engine over `data` replicas: (slots, prompt capacity, verdict tokens), read
    by the judge (`rlhfjax.cluster.judge`) and the memory check alike."""
    slots = self.slots or min(rollout.batch_size, 64)
    capacity = self.max_prompt_len or rollout.max_seq_len + 64
    return -(-slots // data) * data, capacity, self.max_new_tokens


_LORA_REFERENCES = ("base", "placed")
_LORA_QUANTIZE = ("", *model_config.QUANTIZATIONS)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraSection:
  """Low-rank adapters on every trained role (`model_config.LoraConfig`, `rlhfjax.models.lora`):
  the base weights frozen, with no optimizer state; only the adapters (and a critic's or reward
  model's value head) train, in float32. The rollout runs the adapted weights merged."""

  rank: int = 0
  """Rank of each adapter; 0: no adapters (every weight trains)."""
  alpha: float = 16.0
  """The adapters' output is scaled by alpha / rank."""
  targets: tuple[str, ...] = model_config.LORA_TARGETS
  """Adapted projections: some of q, k, v, o (attention), gate, up, down (MLP), and lm_head
  (an untied LM head; not by default)."""
  reference: str = "base"
  """Where the reference policy's log-probs come from when the actor trains adapters: 'base',
  the actor's own frozen base weights with the adapters off, on the actor's devices (the
  reference is the model the adapters started from, so no copy is loaded or placed); 'placed',
  a separate copy on its own devices like any other role."""
  quantize: str = ""
  """'int8': the adapted projections' frozen base kernels are stored as int8 with a float32
  scale per output channel (symmetric, absmax: about a quarter of the float32 bytes, half of
  bf16's); 'nf4': as QLoRA's 4-bit NormalFloat, two codes a byte with an absmax scale per
  block of 64 contracted weights, quantized again to 8 bits (about 4.13 bits a weight);
  either dequantized in the
  forward, on every backend (XLA computes the dequantization; no special kernel). ''
  (default): the base in its own dtype. The reference scores the same quantized weights, on
  the base ('base') or as a placed copy of the actor's model ('placed'); the rollout runs the
  adapted weights dequantized and merged."""

  def __post_init__(self):
    if self.quantize not in _LORA_QUANTIZE:
      raise ConfigError(
        f"'model.lora.quantize' must be one of {', '.join(map(repr, _LORA_QUANTIZE))} ('': "
        f"the base in its own dtype), got {self.quantize!r}"
      )
    if isinstance(self.targets, str):
      object.__setattr__(self, "targets", tuple(t for t in self.targets.split(",") if t))
    if self.rank < 0:
      raise ConfigError(f"'model.lora.rank' must be >= 0 (0: no adapters), got {self.rank}")
    if not self.alpha > 0:
      raise ConfigError(f"'model.lora.alpha' must be > 0, got {self.alpha}")
    _check_choice("model.lora.reference", self.reference, _LORA_REFERENCES)
    known = model_config.LORA_TARGETS + model_config.LORA_EXTRA_TARGETS
    unknown = [t for t in self.targets if t not in known]
    if unknown or not self.targets:
      raise ConfigError(
        f"'model.lora.targets': unknown projection(s) {', '.join(unknown) or '(none given)'}; "
        f"choose from {', '.join(known)}"
      )

  def for_model(self, rank: int | None = None) -> model_config.LoraConfig | None:
    """The adapters of rank `rank` (None: `rank`'s) with these alpha and targets; None at 0."""
    rank = self.rank if rank is None else rank
    if rank == 0:
      return None
    return model_config.LoraConfig(rank=rank, alpha=self.alpha, targets=self.targets)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSection:
  """Which model each role runs: a registered size or a Hugging Face checkpoint's config.json."""

  size: str | None = None
  """Size of the actor; the reference and the rollout run the same model. None: `hf`'s."""
  hf: str = ""
  """A local Hugging Face checkpoint directory (Llama 1-3.x, Mistral, Qwen2/2.5/3) whose
  config.json gives every role's architecture (sizes, heads, rope, norm eps, biases, tied
  embeddings, dtype from `torch_dtype`, special token ids). Its weights start the actor and
  the reference (and the model SFT trains) when `init.actor` is empty, and its tokenizer.json is
  the tokenizer when `data.tokenizer` is left at 'byte'. A `size` or `overrides` given as well
  must agree with it on every architecture field."""
  critic_size: str | None = None
  """Size of the critic; None: the actor's size."""
  reward_size: str | None = None
  """Size of the reward model; None: the actor's size."""
  dtype: str | None = None
  """Compute dtype override for every model ('float32' or 'bfloat16'); None: the size's own."""
  param_dtype: str | None = None
  """Parameter dtype override for every model; None: the size's own."""
  overrides: dict[str, float] = dataclasses.field(default_factory=dict)
  """Number `ModelConfig` fields changed for every model, e.g. {'num_layers': 4} or
  {'rope_theta': 500000.0}."""
  roles: dict[str, RoleModelSection] = dataclasses.field(default_factory=dict)
  """Per-role settings over the above, e.g. {'reference': {'param_dtype': 'bfloat16'},
  'actor': {'remat': 'dots_with_no_batch_dims_saveable', 'logprob_chunk_size': 1024}}."""
  extra_roles: dict[str, ExtraRoleSection] = dataclasses.field(default_factory=dict)
  """Roles beyond the built-in five, by name (`ExtraRoleSection`), e.g. {'reward2': {'kind':
  'reward', 'size': 'tiny', 'init': '/runs/rm2/checkpoints'}}; `dtype`, `param_dtype` and
  `overrides` above apply to them too."""
  fp32_masters: bool = True
  """A checkpoint saved in bf16 (`hf`'s config.json says so; every public Llama and Qwen does)
  trains with fp32 master weights and so fp32 optimizer moments in the trained roles
  (`trained_roles`), its matmuls in bf16; the frozen roles (reference, a PPO reward model) and
  the rollout copy hold its bf16 weights, and the weight sync casts on the way. False: pure
  bf16, for experiments only: an Adam step of about the learning rate on a weight of 0.02 is
  below half its bf16 spacing (6.1e-5) up to learning rates of about 6e-5, so most updates
  round away (refused below that learning rate). A dtype set here or per role wins over both."""
  trained_roles: tuple[str, ...] = ("actor", "critic")
  """The roles the flow trains (the reward model in its own flow): set from the flow's
  declaration (`rlhfjax.flows.registry.configure`), not by hand."""
  lora: LoraSection = dataclasses.field(default_factory=LoraSection)
  """Low-rank adapters on the trained roles (`trained_roles`) over their frozen weights."""

  def __post_init__(self):
    # A role's section with nothing set is the same as none (`complete` writes one per role).
    unset = RoleModelSection()
    kept = {r: s for r, s in self.roles.items() if r not in _ROLES or s != unset}
    object.__setattr__(self, "roles", kept)
    if self.size == "":  # `--config.model.size=` unsets a shipped config's size
      object.__setattr__(self, "size", None)
    if self.size is None and not self.hf:
      raise ConfigError("'model': set 'model.size' (a registered size) or 'model.hf' (a directory)")
    for role, section in self.roles.items():
      if section.hf and role not in ("critic", "reward"):
        raise ConfigError(
          f"'model.roles.{role}.hf': only the critic and the reward model take their own "
          "checkpoint; the actor, reference and rollout run 'model.hf'"
        )
    known = model_config.model_sizes()
    for name in ("size", "critic_size", "reward_size"):
      value = getattr(self, name)
      if value is not None and value not in known:
        raise ConfigError(
          f"unknown model size {value!r} for 'model.{name}'; known sizes: {', '.join(known)}"
        )
    fields = {f.name: f.type for f in dataclasses.fields(model_config.ModelConfig)}
    for name in self.overrides:
      if name not in fields:
        raise ConfigError(f"unknown model field {name!r} in 'model.overrides'")
    object.__setattr__(self, "overrides", _whole_numbers(self.overrides, fields))
    for name in ("dtype", "param_dtype"):
      if getattr(self, name) is not None:
        _check_choice(f"model.{name}", getattr(self, name), _DTYPES)

    for role in self.roles:
      if role not in _ROLES:
        extra = " (an extra role is set in 'model.extra_roles')" if role in self.extra_roles else ""
        raise ConfigError(
          f"unknown role {role!r} in 'model.roles'; roles: {', '.join(_ROLES)}{extra}"
        )
    for name in self.extra_roles:
      if name in _RESERVED_ROLE_NAMES:
        raise ConfigError(
          f"'model.extra_roles.{name}': {name!r} is a built-in role or stage name "
          f"({', '.join(_RESERVED_ROLE_NAMES)}); name the extra role otherwise, e.g. '{name}2'"
        )
      if not _ROLE_NAME.fullmatch(name):
        raise ConfigError(
          f"'model.extra_roles.{name}': a role's name is lower-case letters, digits and '_', "
          "starting with a letter"
        )
    # The sync casts the actor's parameters to the rollout's dtype on the actor's mesh
    # (`rlhfjax.mesh.transfer.cast_program`); widening them would only add bytes.
    actor, rollout = (self.for_role(r).param_dtype for r in ("actor", "rollout"))
    if _BITS[rollout] > _BITS[actor]:
      raise ConfigError(
        f"'model.roles': the rollout's param_dtype {rollout} is wider than the actor's {actor}: "
        "the weight sync would only add bytes, not precision"
      )

  @property
  def reference_from_base(self) -> bool:
    """Whether the reference runs the actor's frozen base weights with the adapters off, on
    the actor's devices, instead of a placed copy (`LoraSection.reference`): the actor trains
    adapters and the reference is given nothing of its own."""
    return (
      bool(self.lora_rank("actor"))
      and self.lora.reference == "base"
      and "reference" not in self.roles
    )

  def _scores_quantized_base(self, role: str) -> bool:
    """Whether `role` is a reference that scores the model the actor's adapters start from:
    on the actor's base, or placed on its own devices from the same checkpoint or size. With
    `lora.quantize` that model is the quantized base, so such a reference is quantized the same
    way (the same weights as the actor's at step 0: the KL starts at 0)."""
    if role != "reference" or not self.lora_rank("actor"):
      return False
    return self.reference_from_base or self.model_name("reference") == self.model_name("actor")

  def lora_rank(self, role: str) -> int:
    """The LoRA rank `role` trains adapters of (0: none, or a role that is not trained): its
    own `lora_rank` in `roles`, else `lora.rank`."""
    if role not in self.trained_roles:
      return 0
    own = self.roles.get(role, RoleModelSection()).lora_rank
    return self.lora.rank if own is None else own

  @property
  def adapted_roles(self) -> tuple[str, ...]:
    """The trained roles that train LoRA adapters."""
    return tuple(role for role in self.trained_roles if self.lora_rank(role))

  @property
  def role_names(self) -> tuple[str, ...]:
    """Every role a model may be asked for: the built-in five, then the extra ones."""
    return (*_ROLES, *self.extra_roles)

  def head(self, role: str) -> model_config.HeadKind:
    """The head `role`'s model carries ('lm' or 'value')."""
    if role in self.extra_roles:
      return EXTRA_ROLE_KINDS[self.extra_roles[role].kind]
    return ROLE_HEADS[role]

  def _section(self, role: str) -> RoleModelSection:
    """`role`'s own settings: its `extra_roles` section, or its `roles` one (empty if none)."""
    return self.extra_roles.get(role) or self.roles.get(role, RoleModelSection())

  def _own_size(self, role: str) -> str | None:
    """The size given to `role` itself (`critic_size`, `reward_size`, an extra role's `size`)."""
    if role in self.extra_roles:
      return self.extra_roles[role].size
    return {"critic": self.critic_size, "reward": self.reward_size}.get(role)

  def size_for(self, role: str) -> str | None:
    """The model size `role` (a built-in role or an extra one) runs; None when only a
    checkpoint's config.json says (`hf_for`)."""
    if role not in self.role_names:
      raise ValueError(f"unknown role {role!r}")
    own = self._own_size(role)
    if own is not None:
      return own
    return None if self._section(role).hf else self.size

  def hf_for(self, role: str) -> str:
    """The Hugging Face directory whose config.json `role` runs; '' for a registered size."""
    own = self._section(role).hf
    if own:
      return own
    # A role given its own size (critic, reward, an extra role) does not run the actor's
    # checkpoint.
    if self._own_size(role) is not None:
      return ""
    return self.hf

  def model_name(self, role: str) -> str:
    """What `role` runs, for messages: its size or its checkpoint directory."""
    return self.hf_for(role) or str(self.size_for(role))

  def for_role(self, role: str) -> model_config.ModelConfig:
    """The `ModelConfig` of `role`, with the dtype and field overrides applied."""
    overrides = {
      name: getattr(self, name)
      for name in ("dtype", "param_dtype")
      if getattr(self, name) is not None
    }
    changes = {**overrides, **self.overrides, **self._section(role).overrides()}
    if rank := self.lora_rank(role):
      changes["lora"] = self.lora.for_model(rank)
    if self.lora.quantize and (self.lora_rank(role) or self._scores_quantized_base(role)):
      changes["quantized"] = self.lora.targets
      changes["quantization"] = self.lora.quantize
    try:
      if self.hf_for(role):
        return self._from_hf(role, changes)
      return model_config.get_model_config(self.size_for(role), **changes)
    except model_config.ArchitectureMismatch as e:
      raise ConfigError(str(e)) from None
    except ValueError as e:
      raise ConfigError(f"model: {e}") from None

  def _from_hf(self, role: str, changes: dict[str, Any]) -> model_config.ModelConfig:
    """The checkpoint's architecture with the numerics changes; any architecture field the
    config gives too (a size, an override) must equal the checkpoint's. Numerics: the
    checkpoint's dtype, with fp32 masters for a trained role (`fp32_masters`), and remat and
    chunked log-probs from 1B parameters on (`_LARGE_PARAMS`)."""
    directory = self.hf_for(role)
    found, _ = hf.read_hf_config(directory)
    found = found.replace(**self._checkpoint_numerics(role, found))
    kept = (*model_config.NUMERICS_FIELDS, *model_config.ADAPTER_FIELDS)
    numerics = {k: v for k, v in changes.items() if k in kept}
    size = self.size_for(role)
    given = model_config.get_model_config(size, **changes) if size else found.replace(**changes)
    section = "extra_roles" if role in self.extra_roles else "roles"
    what = f"model.{section}.{role}.hf" if self._section(role).hf else "model.hf"
    try:
      model_config.check_same_architecture(
        found, given, f"{what}: {os.path.join(directory, 'config.json')}"
      )
    except model_config.ArchitectureMismatch as e:
      hint = f" (the size {size!r} is another model: --config.model.size= runs the checkpoint's)"
      raise model_config.ArchitectureMismatch(f"{e}{hint if size else ''}") from None
    return found.replace(**numerics)

  def _checkpoint_numerics(self, role: str, found: model_config.ModelConfig) -> dict[str, Any]:
    """The numerics a checkpoint's role runs with before the config's own (`_from_hf`)."""
    out: dict[str, Any] = {}
    trained = role in self.trained_roles
    # With adapters the base is frozen: it keeps the checkpoint's dtype (the adapters are
    # float32 whatever it is).
    adapted = self.lora_rank(role) > 0
    if trained and self.fp32_masters and found.param_dtype != "float32" and not adapted:
      out["param_dtype"] = "float32"  # the compute dtype stays the checkpoint's
    if model_config.param_count(found) >= _LARGE_PARAMS:
      out["logprob_chunk_size"] = _LARGE_CHUNK
      if trained:
        out["remat"] = "full"
    return out


_LARGE_PARAMS = 10**9
"""From this many parameters a checkpoint's roles compute log-probs in chunks of `_LARGE_CHUNK`
tokens (no [b, t, vocab] fp32 logits) and its trained roles rematerialise every layer."""
_LARGE_CHUNK = 1024


def _whole_numbers(overrides: dict[str, float], types: dict[str, Any]) -> dict[str, float]:
  """`overrides` (read as floats) with the integer fields of `ModelConfig` made ints again."""
  out = {}
  for name, value in overrides.items():
    if "int" in str(types[name]).split(" | "):
      if not float(value).is_integer():
        raise ConfigError(f"'model.overrides.{name}' must be a whole number, got {value!r}")
      value = int(value)
    out[name] = value
  return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExplicitRoleSection:
  """Where one role runs in a hand-written placement."""

  devices: tuple[int, ...] = ()
  """Indices into `jax.devices()`, in mesh order (row-major over the layout's axes)."""
  axes: dict[str, int] = dataclasses.field(default_factory=dict)
  """Mesh axis sizes by name, e.g. {'fsdp': 4}; axes of the layout left out have size 1."""
  layout: str | None = None
  """'training' or 'generation'; None: generation for the rollout, training for the others."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExplicitPlacementSection:
  """A hand-written placement, used when `placement.strategy='explicit'`.

  Roles not listed together in a `colocate` group must use disjoint devices: sharing devices
  serialises two roles, which a hand-written spec should say on purpose rather than by a typo
  in a device list.
  """

  actor: ExplicitRoleSection | None = None
  critic: ExplicitRoleSection | None = None
  reference: ExplicitRoleSection | None = None
  reward: ExplicitRoleSection | None = None
  rollout: ExplicitRoleSection | None = None
  colocate: tuple[tuple[str, ...], ...] = ()
  """Groups of roles allowed to share devices, e.g. (('actor', 'rollout'),)."""


_EXTRA_MODES = ("shared", "interleaved", "own")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExtraPlacementSection:
  """Where an extra role (`model.extra_roles`) runs: `placement.extra_roles.<name>`, for every
  strategy (the strategy places the built-in roles, then this places the extra one)."""

  mode: str = "shared"
  """'shared': on `with_role`'s devices and mesh (co-located: the two take turns); 'interleaved':
  `with_role`'s devices split into halves, `with_role` keeping the first and this role taking
  the second, so the two score at the same time; 'own': the last `devices` devices of the job,
  which no other role uses (the strategy places the others on the rest)."""
  with_role: str = "reward"
  """'shared', 'interleaved': the role whose devices it shares or splits (a built-in role or
  an extra one placed before it; 'interleaved' takes a scoring role: the reference, the reward
  or an extra role)."""
  devices: int = 1
  """'own': how many devices it takes."""
  tensor: int = 1
  """'own': its tensor-parallel size (fsdp over the rest); 'shared' and 'interleaved' keep
  `with_role`'s mesh axes."""

  def __post_init__(self):
    _check_choice("mode", self.mode, _EXTRA_MODES)
    ranges.check("", self, devices=ranges.COUNT, tensor=ranges.COUNT)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlacementSection:
  """How the roles are placed on devices; see `rlhfjax.placement.strategies`."""

  strategy: str = "colocated"
  """'colocated', 'interleaved', 'disaggregated', 'explicit', or 'auto' (the planner picks the
  fastest placement that fits; see `rlhfjax.planner`)."""
  num_devices: int | None = None
  """Devices the job uses (the first ones of `jax.devices()`); None: all of them."""
  memory_per_device_gb: float | None = None
  """Memory budget of one device in GiB (2**30 bytes); None: skip the memory check."""
  tensor: int = 1
  """Tensor-parallel size of the training roles (actor, critic, reference, reward)."""
  data: int = 1
  """Data-parallel replicas of the one trained model of a flow that places a single role (SFT,
  reward model): data x fsdp x tensor over the devices, fsdp taking the rest."""
  rollout_tensor: int = 1
  """Tensor-parallel size of the rollout (generation layout)."""
  rollout_fraction: float = 0.5
  """disaggregated: the fraction of the devices given to the rollout."""
  split_actor_critic: bool = False
  """interleaved, disaggregated: actor and critic on disjoint halves, updating concurrently."""
  split_reference_reward: bool = False
  """disaggregated: reference and reward on disjoint halves (interleaved always splits them)."""
  explicit: ExplicitPlacementSection = dataclasses.field(default_factory=ExplicitPlacementSection)
  """The hand-written spec of the 'explicit' strategy."""
  hardware: str = "local"
  """auto: the planner's hardware, a preset name or 'local' (measured, see `efficiency`)."""
  efficiency: str = ""
  """auto: a calibration JSON of `scripts/calibrate.py` (needed by 'local') or a profile."""
  pipeline_stages: int = 1
  """Pipeline stages of every training-layout role (actor, critic, reference, reward; the one
  trained model of SFT and the reward model): each role's devices are split stage x fsdp x
  tensor and its scanned layers into this many contiguous blocks, one per stage. 1: no
  pipeline. 'explicit' names a `stage` axis per role instead; 'auto' plans without stages."""
  context: int = 1
  """Context-parallel size of the training-layout roles (actor, critic, reference, reward; the
  one trained model of SFT and the reward model): each row's tokens split over this many of
  its fsdp devices, which gather the keys and values of the whole row in attention
  (`rlhfjax.models.attention.context_attention`). For sequences whose activations do not fit
  one device's share. 1: none. Must divide the rows' length ('rollout.max_prompt_len' +
  'rollout.max_new_tokens', or 'supervised.max_len'); not with pipeline stages. 'explicit'
  names a 'context' axis per role instead."""
  pipeline_schedule: str = "1f1b"
  """How a pipelined role runs its micro-batches: 'gpipe' (all forwards, then all backwards) or
  '1f1b' (one forward, one backward in the steady state; fewer activations in flight). See
  `rlhfjax.schedules`."""
  pipeline_recompute: bool = False
  """A pipelined backward runs its stage's forward again from the stage's stashed input
  (GPipe's re-materialisation) instead of keeping the residuals of every micro-batch in
  flight (what the role's `remat` policy keeps, per micro-batch, as Megatron's schedules do):
  one micro-batch's residuals per device at a time, for one more forward per backward. For a
  model whose pipeline does not fit otherwise (`strategy=auto` turns it on itself where no
  placement fits without it: `PlacementSpec.pipeline_recompute`)."""
  extra_roles: dict[str, ExtraPlacementSection] = dataclasses.field(default_factory=dict)
  """Where each extra role (`model.extra_roles`) runs, by name, in their order (one not named
  here shares the reward's devices: `ExtraPlacementSection`'s defaults), e.g. {'reward2':
  {'mode': 'interleaved', 'with_role': 'reward'}}."""

  def __post_init__(self):
    # num_devices and rollout_fraction are checked where the placement is planned
    # (`rlhfjax.placement`), which knows the devices at hand.
    ranges.check(
      "placement",
      self,
      memory_per_device_gb=ranges.POSITIVE,
      tensor=ranges.COUNT,
      data=ranges.COUNT,
      rollout_tensor=ranges.COUNT,
      pipeline_stages=ranges.COUNT,
      context=ranges.COUNT,
    )
    if self.context > 1 and self.pipeline_stages > 1:
      raise ConfigError(
        f"'placement.context'={self.context} with 'placement.pipeline_stages'="
        f"{self.pipeline_stages}: context parallelism does not run inside pipeline stages; "
        "set one of them to 1"
      )
    if self.context > 1 and self.strategy in ("auto", "explicit"):
      instead = {
        "auto": "the planner splits rows over devices itself where a sequence does not fit",
        "explicit": "give each training role a 'context' axis in placement.explicit.<role>.axes",
      }[self.strategy]
      raise ConfigError(
        f"'placement.context'={self.context} does not apply to placement.strategy="
        f"{self.strategy}: {instead}"
      )
    _check_choice("placement.pipeline_schedule", self.pipeline_schedule, choices.PIPELINE_SCHEDULES)
    if self.pipeline_stages > 1 and self.strategy in ("auto", "explicit"):
      instead = {
        "auto": "the planner splits the layers into stages itself where no placement fits "
        "without them or training spans nodes; to fix the stages, pick colocated, interleaved "
        "or disaggregated",
        "explicit": "give each training role a 'stage' axis in placement.explicit.<role>.axes",
      }[self.strategy]
      raise ConfigError(
        f"'placement.pipeline_stages'={self.pipeline_stages} does not apply to "
        f"placement.strategy={self.strategy}: {instead}"
      )


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutSection:
  """Shape of one rollout batch."""

  batch_size: int = 16
  """Prompts per rollout batch (over all rollout devices)."""
  max_prompt_len: int = 64
  max_new_tokens: int = 64
  min_prompt_bucket: int = 128
  """Prefill pads each prompt to the smallest of the prompt buckets that holds it: the powers
  of two from this one up to below `max_prompt_len`, then `max_prompt_len` (`prompt_buckets`),
  each compiled once, so a batch of short prompts does not pay for the longest. 0, or at
  least `max_prompt_len`: one bucket, `max_prompt_len`."""
  temperature: float = 1.0
  """Sampling temperature; 0 means greedy."""
  top_k: int = 0
  """Keep the k most likely tokens (0: all)."""
  top_p: float = 1.0
  """Keep the smallest set of tokens with this much probability (1: all)."""
  slots: int = 0
  """Decode slots of the continuous-batching engine (0: one per prompt of the batch)."""
  tail_threshold: float = 0.0
  """Tail compaction: once at most this fraction of the slots still decode (and no prompt is
  queued), the running requests move onto that many slots on the fewest 'data' replicas that
  keep the rows per replica (re-prefilled there with the tokens they have), freeing the other
  replicas' devices. 0: off (the live batch still halves as the tail finishes)."""
  page_size: int = 16
  """Tokens per KV page. The rollout keeps its KV cache in fixed-size pages from one pool per
  'data' replica (`rlhfjax.rollout.paging`): a sequence holds pages for the tokens it has,
  prompts are admitted by free pages, and identical prompts share theirs."""
  kv_cache_tokens: int = 0
  """Tokens the page pool holds over all the rollout's 'data' replicas (the KV
  cache's memory). 0: every slot at full length, `slots x max_seq_len`, the dense cache's
  memory. A smaller pool with more `slots` runs more sequences at once on long-tailed lengths;
  when it fills, the youngest sequence is preempted and recomputed later."""
  kv_memory_fraction: float = 0.0
  """In (0, 1]: size the pool from memory, like vLLM's `gpu_memory_utilization`:
  this fraction of a rollout device's memory (`placement.memory_per_device_gb`, else what the
  device reports) less what it holds while generating (the rollout's weights, logits and sync
  buffer, the parameters and optimizer state of roles sharing it) goes to the pool, in the
  memory model's bytes (`rlhfjax.placement.memory.kv_pool`), at most every slot at full length.
  `placement.strategy=auto` plans generation in that share of memory too. 0: `kv_cache_tokens`
  sizes it. `kv_cache_tokens` set too overrides it."""
  release: bool = False
  """Free the rollout's own copy of the weights after each generation, so scoring and training
  on its devices have that memory; the sync after the update (or the next generation) copies
  the actor's current weights in again. Its KV pool lives only while it generates anyway. A
  rollout that reads the actor's arrays themselves (co-located, same layout and dtype) has no
  copy to free. Not with generation ahead of the update (`ppo.async_rollout`,
  `ppo.max_staleness`), whose rollout never stops."""
  share_prefixes: bool = True
  """The samples of one prompt (a GRPO group) prefill it once and share its
  pages."""
  decode_chunk: int = 64
  """Most decode steps one device call runs while prompts wait (their admission and the page
  reservations happen between calls; finished slots refill on device within a call)."""
  attention: str = "auto"
  """Decode attention over the KV pages: 'gather' (each row's pages gathered,
  then XLA's attention; any backend, any model), 'pallas' (JAX's Pallas paged-attention kernel
  of the rollout's platform, GPU or TPU; refused elsewhere and for models it cannot run: a
  sliding window, a head dim not a multiple of 16) or 'auto': 'pallas' where it can run (on
  TPU only with a bf16 cache: its kernel rounds keys and values to bf16), else 'gather'."""
  fused_scoring: bool = False
  """Score finished samples in micro-batches while the rest still generate (RLHFuse): each
  scoring role on its own mesh, concurrently when disjoint from the rollout's, between decode
  chunks when co-located (`rlhfjax.flows.scoring`). Results equal the unfused ones at the same
  `score_micro_batch`."""
  score_micro_batch: int = 0
  """Samples per scoring call. 0: the whole batch in one call unfused, a quarter of it (at
  least 1) fused."""
  max_tokens_per_score_batch: int = 0
  """With `ppo.packing`: tokens (rows x `max_seq_len`) per packed scoring call, the samples of
  a call packed end to end (`rlhfjax.data.packing`). 0: `scoring_rows` x `max_seq_len`, the
  padded call's size."""
  environment: str = ""
  """Multi-turn rollouts: 'module:name' of a class or factory called once per trajectory,
  whose `reset(record)` gives the prompt and `step(turn token ids) -> (observation, reward,
  done)` answers each of the model's turns (`rlhfjax.flows.environments`); the KV cache is kept
  across turns, observations are masked out of the policy loss and the KL, and the rewards are
  a part of the score (`reward.environment_coef`). Empty: one answer per prompt."""
  max_turns: int = 8
  """With an environment: most turns of the model in one trajectory (`max_new_tokens` limits
  its whole response, observations included)."""
  stop_token_ids: tuple[int, ...] = ()
  """Token ids that end an answer (or, with an environment, a turn) besides the tokenizer's EOS
  and the checkpoint's own stop tokens: a tool call's closing token, for example."""
  max_turn_tokens: int = 0
  """With an environment: a turn of the model also ends after this many tokens (0: on a stop
  token or at `max_new_tokens` only); the environment answers it like any turn."""
  environment_workers: int = 1
  """With an environment: threads that run the `reset`s of a batch, and the `step`s of the
  trajectories that ended a turn in the same decode call, at once (environments that wait on a
  tool, a sandbox or a server); 1: one after another. The run is the same for any count (each
  trajectory's calls in order, their results applied in trajectory order); environments of
  different trajectories must then not share unguarded state."""
  on_environment_error: str = "error"
  """An environment that raises or breaks its protocol: 'error' stops the run with one line
  naming it and the record; 'end' ends that trajectory there (its rewards so far kept) and
  counts it (`rollout/environment_errors`)."""

  def __post_init__(self):
    ranges.check(
      "rollout",
      self,
      batch_size=ranges.COUNT,
      max_prompt_len=ranges.COUNT,
      max_new_tokens=ranges.COUNT,
      min_prompt_bucket=ranges.NON_NEGATIVE,
      temperature=ranges.NON_NEGATIVE,
      top_k=ranges.NON_NEGATIVE,
      top_p=ranges.between(0, 1, low_open=True),
      slots=ranges.NON_NEGATIVE,
      tail_threshold=ranges.between(0, 1, high_open=True),
      page_size=ranges.COUNT,
      kv_cache_tokens=ranges.NON_NEGATIVE,
      kv_memory_fraction=ranges.between(0, 1),
      decode_chunk=ranges.COUNT,
      score_micro_batch=ranges.NON_NEGATIVE,
      max_tokens_per_score_batch=ranges.NON_NEGATIVE,
      max_turns=ranges.COUNT,
      max_turn_tokens=ranges.NON_NEGATIVE,
      environment_workers=ranges.COUNT,
    )
    if self.environment and ":" not in self.environment:
      raise ConfigError(f"'rollout.environment' must be 'module:name', got {self.environment!r}")
    _check_choice("rollout.on_environment_error", self.on_environment_error, _ON_ENV_ERROR)
    if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
      raise ConfigError(
        f"'rollout.stop_token_ids' must be token ids (ints >= 0), got {self.stop_token_ids!r}"
      )
    if 0 < self.max_tokens_per_score_batch < self.max_seq_len:
      raise ConfigError(
        f"'rollout.max_tokens_per_score_batch'={self.max_tokens_per_score_batch} is below one "
        f"sequence's capacity, max_prompt_len + max_new_tokens = {self.max_seq_len}"
      )
    _check_choice("rollout.attention", self.attention, _ROLLOUT_ATTENTION)
    if 0 < self.kv_cache_tokens < self.max_seq_len:
      raise ConfigError(
        f"'rollout.kv_cache_tokens'={self.kv_cache_tokens} cannot hold one sequence of "
        f"max_prompt_len + max_new_tokens = {self.max_seq_len} tokens"
      )
    if self.score_micro_batch > self.batch_size:
      raise ConfigError(
        f"'rollout.score_micro_batch'={self.score_micro_batch} exceeds "
        f"'rollout.batch_size'={self.batch_size}"
      )

  @property
  def max_seq_len(self) -> int:
    """Tokens per sequence the KV cache holds: prompt plus response."""
    return self.max_prompt_len + self.max_new_tokens

  @property
  def prompt_buckets(self) -> tuple[int, ...]:
    """The prefill's prompt lengths (see `min_prompt_bucket`), increasing."""
    buckets, size = [], self.min_prompt_bucket
    while 0 < size < self.max_prompt_len:
      buckets.append(size)
      size *= 2
    return (*buckets, self.max_prompt_len)

  @property
  def num_slots(self) -> int:
    """Decode slots of the engine (see `slots`)."""
    return self.slots or self.batch_size

  def kv_pages(self, replicas: int) -> int:
    """Pages of the pool over `replicas` 'data' replicas, one reserved page each
    included (`kv_cache_tokens` in whole pages per replica; 0: every slot of the replica at
    full length)."""
    ceil = lambda a, b: -(-a // b)
    if self.kv_cache_tokens:
      per_replica = ceil(ceil(self.kv_cache_tokens, replicas), self.page_size)
    else:
      per_replica = ceil(self.num_slots, replicas) * ceil(self.max_seq_len, self.page_size)
    return replicas * (per_replica + 1)

  @property
  def scoring_rows(self) -> int:
    """Samples per scoring call (see `score_micro_batch`)."""
    if self.score_micro_batch:
      return self.score_micro_batch
    return max(1, self.batch_size // 4) if self.fused_scoring else self.batch_size

  @property
  def score_rows_packed(self) -> int:
    """Packed rows of `max_seq_len` tokens per scoring call (see `max_tokens_per_score_batch`)."""
    if self.max_tokens_per_score_batch:
      return self.max_tokens_per_score_batch // self.max_seq_len
    return self.scoring_rows


@dataclasses.dataclass(frozen=True, kw_only=True)
class BatchShape:
  """How a flow samples its batch and splits it into updates: what the planner prices and the
  memory check sizes, whichever section of the config sets it (`ppo`, `online_dpo`)."""

  samples_per_prompt: int
  """Responses the rollout samples for each prompt of `rollout.batch_size`."""
  epochs: int
  """Passes over each batch."""
  mini_batches: int
  """Optimizer updates per epoch."""
  micro_batches: int
  """Gradient-accumulation steps per mini-batch."""


@functools.cache
def _packing(packed_by_default: bool) -> type:
  """The base of every section whose flows pack (`ppo`, `dpo`, `online_dpo`, `supervised`):
  the two packing fields, declared once, with the section's default. Each section's docstring
  says what its rows hold and what one unit of the budget is."""

  @dataclasses.dataclass(frozen=True, kw_only=True)
  class Packing:
    packing: bool = packed_by_default
    """Score and train on packed rows (`rlhfjax.data.packing`): each sequence's real tokens end
    to end in rows of the section's sequence length, attention within a sequence, instead of
    every sequence padded to it. Same numbers up to float rounding; micro-batches by token
    budget (`max_tokens_per_micro_batch`). False: padded."""
    max_tokens_per_micro_batch: int = 0
    """With `packing`: the token budget of one gradient-accumulation step, at least one unit's
    capacity (a sequence's, a pair's); as many steps as the batch needs. 0: the padded
    micro-batch's tokens."""

    def check_budget(self, section: str, capacity: int, what: str) -> None:
      """A budget is 0 or holds at least one unit (`what`, of `capacity` tokens)."""
      budget = self.max_tokens_per_micro_batch
      if 0 < budget < capacity:
        raise ConfigError(
          f"'{section}.max_tokens_per_micro_batch'={budget} is below {what} = {capacity}"
        )

  return Packing


@dataclasses.dataclass(frozen=True, kw_only=True)
class PPOSection(_packing(True)):
  """The PPO algorithm: advantage estimation, KL penalty, losses and update schedule.

  Packed (`packing`, on by default): each sample's real prompt and response tokens in rows of
  `rollout.max_seq_len` tokens; a budget of 0 is the padded micro-batch's tokens,
  `rollout.batch_size / (mini_batches x micro_batches)` x `max_seq_len`."""

  ppo_epochs: int = 1
  """Passes over each rollout batch."""
  mini_batches: int = 1
  """Optimizer updates per epoch: the rollout batch is split into this many mini-batches."""
  micro_batches: int = 1
  """Gradient-accumulation steps per mini-batch."""
  clip_eps: float = 0.2
  value_clip_eps: float = 0.2
  entropy_coef: float = 0.0
  advantage: str = "gae"
  """PPO's estimator (`rlhfjax.algorithms.ADVANTAGE_ESTIMATORS`, checked when the flow is
  configured): 'gae' (with the critic) or a critic-free one: 'group_relative' (GRPO), 'rloo',
  'reinforce_pp'. The flows of those names fix it."""
  group_size: int = 1
  """Samples per prompt; 'group_relative' compares the samples of one prompt."""
  gamma: float = 1.0
  lam: float = 0.95
  whiten_advantages: bool = True
  kl_estimator: str = "k1"
  """Per-token KL estimator against the reference: 'k1', 'k2' or 'k3'."""
  kl_coef: float = 0.05
  """Initial coefficient of the KL penalty in the shaped reward (0: no KL in the reward)."""
  kl_loss_coef: float = 0.0
  """Coefficient of the KL to the reference as a loss term (GRPO's way; `kl_estimator`
  per token, aggregated as `loss_agg`); 0: none."""
  loss_agg: str = "token_mean"
  """How per-token policy losses reduce: 'token_mean', 'seq_mean_token_mean' (mean over
  sequences of their token means) or 'seq_mean_token_sum_norm' (Dr. GRPO: token sums over the
  response capacity, mean over sequences)."""
  policy_loss: str = "ppo"
  """The per-token policy loss (`rlhfjax.algorithms.POLICY_LOSSES`, checked when the flow is
  built): 'ppo' (clipped surrogate), 'gspo' (sequence-level ratio and clip; needs one
  advantage per sample: group_relative or rloo) or 'cispo' (REINFORCE weighed by the clipped
  ratio, without gradient through it). `configs/gspo_tiny.py`, `configs/cispo_tiny.py`."""
  clip_eps_high: float = 0.0
  """Upper clip of the importance ratio, `1 + clip_eps_high` (DAPO's clip-higher); 0: `clip_eps`."""
  normalize_group_std: bool = True
  """Group-relative advantages divide by the group's standard deviation (False: Dr. GRPO)."""
  overlong_buffer: int = 0
  """DAPO's soft overlong punishment: responses longer than `rollout.max_new_tokens -
  overlong_buffer` lose up to 1 of their score, linearly; 0: none."""
  dynamic_sampling_rounds: int = 0
  """DAPO's dynamic sampling: drop groups whose scores are all equal and generate more, up to
  this many extra rounds, to fill the batch with groups that carry a signal; 0: off."""
  kl_controller: str = "fixed"
  """'fixed' or 'adaptive' (proportional controller towards `kl_target`)."""
  kl_target: float = 6.0
  kl_horizon: int = 10_000
  async_rollout: bool = False
  """Generate the next batch while this one trains (one step off-policy, importance-corrected),
  the weights synced between batches: deterministic, and a resume repeats the run exactly.
  Needs a rollout on its own devices (disaggregated). See `max_staleness` for syncs that land
  mid-batch."""
  max_staleness: int = 0
  """Interruptible generation with bounded staleness (AReaL's partial rollout, verl's
  `staleness_threshold`): generation runs up to this many batches ahead on the rollout's own
  devices (disaggregated), and each weight sync lands as soon as its update is done, between
  two decode calls, while rows are mid-answer; they go on under the new weights, every token
  keeping the log-prob of the weights that sampled it (the importance correction's behaviour
  log-prob). No token of a trained batch is more than this many policy versions (iterations)
  older than the weights it trains. 0: synchronous. Not combined with `async_rollout` (its
  deterministic one-batch-ahead form); runs are not bitwise reproducible (timing decides where
  syncs land)."""
  rollout_correction: str = "none"
  """How the policy loss corrects for the engine's log-probs differing from the trainer's
  (`rlhfjax.algorithms.correction`): 'none', 'tis' (each token's loss weighed by its truncated
  importance ratio `min(pi_old / pi_rollout, rollout_correction_cap)`) or 'mis' (tokens whose
  ratio lies outside `[1 / cap, cap]` weigh 0). Generating ahead (`async_rollout`,
  `max_staleness`) always corrects, as decoupled PPO: 'none' is 'tis' there."""
  rollout_correction_level: str = "token"
  """'token': each token's own ratio; 'sequence': its response's geometric mean, so a whole
  response is kept, truncated or dropped together."""
  rollout_correction_cap: float = 2.0
  """The correction's `C` (> 1), apart from `clip_eps`."""
  max_skipped_updates: int = 3
  """Stop the run, with a message, after this many updates in a row were skipped for a
  non-finite loss or gradients (each skip is counted in the metrics as `update/skipped`)."""
  fuse_actor_critic: bool = False
  """Run the actor's and the critic's updates as one fused pipeline schedule
  (`rlhfjax.schedules.fused`, RLHFuse's intra-stage fusion): the critic's stages run over the
  devices in the reverse order, so each model's micro-batches fill the other's bubbles. Needs
  `placement.pipeline_stages` > 1 and the actor and critic on the same devices."""

  @property
  def correction(self) -> str:
    """The correction the policy loss applies: `rollout_correction`, 'tis' when it is 'none'
    and the rollout generates ahead."""
    if self.rollout_correction == "none" and self.generates_ahead:
      return "tis"
    return self.rollout_correction

  @property
  def generates_ahead(self) -> bool:
    """Whether the rollout generates while the update trains (`async_rollout` or
    `max_staleness`)."""
    return self.async_rollout or self.max_staleness > 0

  def __post_init__(self):
    _check_choice("ppo.kl_estimator", self.kl_estimator, choices.KL_ESTIMATORS)
    _check_choice("ppo.loss_agg", self.loss_agg, choices.LOSS_AGGREGATIONS)
    if min(self.kl_loss_coef, self.clip_eps_high) < 0:
      raise ConfigError("'ppo.kl_loss_coef' and 'ppo.clip_eps_high' must be >= 0")
    if self.overlong_buffer < 0 or self.dynamic_sampling_rounds < 0:
      raise ConfigError("'ppo.overlong_buffer' and 'ppo.dynamic_sampling_rounds' must be >= 0")
    _check_choice("ppo.kl_controller", self.kl_controller, choices.KL_CONTROLLERS)
    _check_choice("ppo.rollout_correction", self.rollout_correction, choices.ROLLOUT_CORRECTIONS)
    _check_choice(
      "ppo.rollout_correction_level", self.rollout_correction_level, choices.CORRECTION_LEVELS
    )
    if not self.rollout_correction_cap > 1.0:  # NaN too
      raise ConfigError(
        f"'ppo.rollout_correction_cap' must be > 1 (the ratio's truncation, and the band "
        f"[1/cap, cap] masking keeps), got {self.rollout_correction_cap}"
      )
    ranges.check(
      "ppo",
      self,
      ppo_epochs=ranges.COUNT,
      mini_batches=ranges.COUNT,
      micro_batches=ranges.COUNT,
      group_size=ranges.COUNT,
      max_skipped_updates=ranges.COUNT,
      max_tokens_per_micro_batch=ranges.NON_NEGATIVE,
      max_staleness=ranges.NON_NEGATIVE,
      clip_eps=ranges.POSITIVE,
      value_clip_eps=ranges.POSITIVE,
      entropy_coef=ranges.NON_NEGATIVE,
      gamma=ranges.FRACTION,
      lam=ranges.FRACTION,
      kl_coef=ranges.NON_NEGATIVE,
      kl_target=ranges.POSITIVE,
      kl_horizon=ranges.COUNT,
    )
    if self.async_rollout and self.max_staleness:
      raise ConfigError(
        f"'ppo.async_rollout' (one batch ahead, synced between batches) and "
        f"'ppo.max_staleness'={self.max_staleness} (syncs mid-batch) are two ways to generate "
        "ahead: set one"
      )

  @property
  def batch(self) -> BatchShape:
    return BatchShape(
      samples_per_prompt=self.group_size,
      epochs=self.ppo_epochs,
      mini_batches=self.mini_batches,
      micro_batches=self.micro_batches,
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class AlgorithmSection:
  """Which flow runs the iterations (see `rlhfjax.flows`)."""

  name: str = "ppo"
  """A registered flow (`rlhfjax.flows.registry`): 'ppo' (its critic-free variants through
  `ppo.advantage`), 'dpo', 'online_dpo', 'sft' or 'rm' (the reward model)."""
  flow: str = ""
  """A user's flow factory 'module:function' (`make_flow(ctx) -> flow`); overrides `name`."""

  def __post_init__(self):
    if self.flow and ":" not in self.flow:
      raise ConfigError(f"'algorithm.flow' must be 'module:function', got {self.flow!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DPOSection(_packing(False)):
  """Direct preference optimisation's loss (algorithm 'dpo' on `data.preferences`; 'online_dpo'
  on pairs sampled by the rollout and ranked by the reward, as `online_dpo` says).

  Packed (`packing`, offline DPO's; online DPO packs by `online_dpo.packing`): each pair's
  chosen and rejected sequences in rows of `rollout.max_seq_len` tokens, a pair never split
  between two micro-batches; a budget holds at least one pair, 2 x `rollout.max_seq_len`, and 0
  is 2 x `rollout.batch_size` x `rollout.max_seq_len`."""

  beta: float = 0.1
  """Scale of the implicit reward `beta * (log pi - log pi_ref)`."""
  loss: str = "sigmoid"
  """'sigmoid' (DPO; conservative DPO with `label_smoothing` > 0) or 'ipo'."""
  label_smoothing: float = 0.0
  """Probability that a preference label is flipped (conservative DPO); 'sigmoid' only."""

  def __post_init__(self):
    _check_choice("dpo.loss", self.loss, choices.DPO_LOSSES)
    ranges.check("dpo", self, max_tokens_per_micro_batch=ranges.NON_NEGATIVE)
    if self.beta <= 0 or not 0 <= self.label_smoothing < 0.5:
      raise ConfigError("'dpo' needs beta > 0 and 0 <= label_smoothing < 0.5")
    if self.loss == "ipo" and self.label_smoothing:
      raise ConfigError(
        f"'dpo.label_smoothing'={self.label_smoothing} is conservative DPO's, for "
        "loss='sigmoid'; 'ipo' has no label smoothing: set it to 0"
      )


@dataclasses.dataclass(frozen=True, kw_only=True)
class OnlineDPOSection(_packing(True)):
  """Online DPO's sampling and update schedule (algorithm 'online_dpo'); its loss is `dpo`'s.
  It reads no `ppo` field but the runner's `ppo.max_skipped_updates`.

  Packed (`packing`, on by default): the reference scores and the actor trains on each pair's
  chosen and rejected samples in rows of `rollout.max_seq_len` tokens; pairs whose samples tie
  are not computed at all; with `micro_batches` 1 the padded numbers up to float rounding. A
  budget holds at least one pair, 2 x `rollout.max_seq_len`; 0 is 2 x the pairs of a
  micro-batch x `max_seq_len`. The reference scores `rollout.max_tokens_per_score_batch` tokens
  per call."""

  samples_per_prompt: int = 2
  """Responses sampled per prompt; the best and the worst of them form the prompt's pair."""
  epochs: int = 1
  """Passes over each iteration's pairs."""
  mini_batches: int = 1
  """Optimizer updates per epoch: the pairs are shuffled and split into this many."""
  micro_batches: int = 1
  """Gradient-accumulation steps per mini-batch (padded; packed, `max_tokens_per_micro_batch`
  sets them)."""

  def __post_init__(self):
    counts = ("epochs", "mini_batches", "micro_batches")
    ranges.check("online_dpo", self, **dict.fromkeys(counts, ranges.COUNT))
    ranges.check("online_dpo", self, max_tokens_per_micro_batch=ranges.NON_NEGATIVE)
    if self.samples_per_prompt < 2:
      raise ConfigError(
        "online DPO pairs the samples of a prompt: 'online_dpo.samples_per_prompt' must be at "
        f"least 2, got {self.samples_per_prompt}"
      )

  @property
  def batch(self) -> BatchShape:
    return BatchShape(
      samples_per_prompt=self.samples_per_prompt,
      epochs=self.epochs,
      mini_batches=self.mini_batches,
      micro_batches=self.micro_batches,
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardSection:
  """Where the sequence score comes from: `model_coef * reward model + fn_coef * fn` (+
  `environment_coef * the environment's rewards` with `rollout.environment`)."""

  fn: str = ""
  """Rule-based reward 'module:function', called as fn(prompts, responses, metadata) ->
  float32[batch] with token-id arrays; empty: none."""
  fn_coef: float = 1.0
  model_coef: float = 0.0
  """Weight of the reward model's score; 0 skips the reward model."""
  environment_coef: float = 1.0
  """Weight of a trajectory's summed environment rewards (`rollout.environment`)."""
  role_coefs: dict[str, float] = dataclasses.field(default_factory=dict)
  """Weight of each extra reward role's score (`model.extra_roles` of kind 'reward'), by name:
  the score is `model_coef * reward + fn_coef * fn + sum of role_coefs[r] * r`."""
  judge: str = ""
  """A generative judge: the name of an extra role of kind 'judge' (`model.extra_roles`), which
  reads `judge_template` filled with each prompt and response and generates a verdict (greedy,
  on its own engine and devices), parsed to a score by `judge_parser`; empty: none."""
  judge_coef: float = 1.0
  """Weight of the judge's score."""
  judge_template: str = "Question: {prompt}\nAnswer: {response}\nScore from 0 to 10:"
  """The judge's prompt: `{prompt}` and `{response}` are replaced by their texts."""
  judge_parser: str = "rlhfjax.cluster.judge:first_number"
  """'module:function' turning a verdict's text into a score (a float); raising, or returning
  no finite number, is a parse failure."""
  judge_failure_score: float = 0.0
  """The score of a response whose verdict cannot be parsed (counted: `reward/judge_failures`).
  The judge's engine (its slots, prompt capacity and longest verdict) is its role's
  (`model.extra_roles.<name>`)."""

  def __post_init__(self):
    if self.fn and ":" not in self.fn:
      raise ConfigError(f"'reward.fn' must be 'module:function', got {self.fn!r}")
    if self.judge:
      if ":" not in self.judge_parser:
        raise ConfigError(
          f"'reward.judge_parser' must be 'module:function', got {self.judge_parser!r}"
        )
      missing = [k for k in ("{prompt}", "{response}") if k not in self.judge_template]
      if missing:
        raise ConfigError(
          f"'reward.judge_template' must contain {' and '.join(missing)}, got "
          f"{self.judge_template!r}"
        )


_ROLLOUT_ATTENTION = ("auto", "pallas", "gather")
_ON_ENV_ERROR = ("error", "end")
_ON_BAD_RECORD = ("error", "skip")
_ON_LONG_PROMPT = ("truncate", "skip", "error")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataSection:
  """Datasets and tokenizer: JSONL files prepared by TFDS (array_record), fed by grain.

  Each dataset is a JSONL file; empty means the bundled file of `task`. Prompts feed PPO,
  demonstrations SFT, preferences the reward model.
  """

  task: str = "vowels"
  """A bundled task of `rlhfjax.tasks` (datasets and a default reward)."""
  prompts: str = ""
  """JSONL of {"prompt"}; empty: the task's bundled prompts."""
  demonstrations: str = ""
  """JSONL of {"prompt", "response"}; empty: the task's bundled demonstrations."""
  preferences: str = ""
  """JSONL of {"prompt", "chosen", "rejected"}; empty: the task's bundled preferences."""
  train_split: str = "train[:90%]"
  """TFDS split expression of the examples trained on."""
  eval_split: str = "train[90%:]"
  """TFDS split expression of the held-out examples (evaluation)."""
  data_dir: str = ""
  """Where TFDS writes the prepared array_record files; empty: WORKDIR/data."""
  tokenizer: str = "byte"
  """'byte' (built in) or the path of a Hugging Face tokenizer.json (or its directory); left
  at 'byte' with `model.hf` set: that directory's tokenizer."""
  chat_template: bool = False
  """Wrap prompts in a chat template: the tokenizer directory's own (chat_template.jinja or
  tokenizer_config.json's `chat_template`, rendered as `transformers` does); refused in one line
  when it has none (its model never saw the built-in markers). The built-in byte tokenizer uses
  the minimal built-in one (user / assistant markers). The run prints the first prompt as the
  model receives it, and eval.md shows each sample's prompt so. Needed by records that hold a
  conversation (`messages`, docs/data.md)."""
  system_prompt: str = ""
  """A system message put first in every prompt whose conversation has none of its own (needs
  `chat_template` and a checkpoint's template: the built-in one has no system turn)."""
  template_kwargs: str = ""
  """A JSON object of keyword arguments the chat template reads, as `apply_chat_template`
  passes them, e.g. '{"enable_thinking": false}' for Qwen3 (needs what `system_prompt` does)."""
  on_bad_record: str = "error"
  """A malformed JSONL record: 'error' (one line naming file:line) or 'skip' (counted)."""
  on_long_prompt: str = "truncate"
  """A prompt over `rollout.max_prompt_len` tokens: 'truncate' (keep its end), 'skip' or
  'error'; truncations and skips are counted in the metrics."""

  def __post_init__(self):
    _check_choice("data.on_bad_record", self.on_bad_record, _ON_BAD_RECORD)
    _check_choice("data.on_long_prompt", self.on_long_prompt, _ON_LONG_PROMPT)
    self.template_arguments  # noqa: B018  (checks the JSON)
    for field in ("system_prompt", "template_kwargs"):
      if not getattr(self, field):
        continue
      if not self.chat_template:
        raise ConfigError(f"data.{field} is set but data.chat_template is False: set it True")

  @property
  def template_arguments(self) -> dict[str, Any]:
    """`template_kwargs` as a dict."""
    if not self.template_kwargs:
      return {}
    try:
      value = json.loads(self.template_kwargs)
    except json.JSONDecodeError as e:
      raise ConfigError(
        f"data.template_kwargs is not JSON ({e.msg}): {self.template_kwargs!r}"
      ) from None
    if not isinstance(value, dict):
      raise ConfigError(f"data.template_kwargs must be a JSON object, got {self.template_kwargs!r}")
    return value


@dataclasses.dataclass(frozen=True, kw_only=True)
class RoleInitSection:
  """Where the models start (PPO's, or the one SFT or the reward model trains); empty: a random
  initialisation (seeded by `seed`).

  Each field is an rlhfjax run's checkpoints directory (its latest complete step) or one step
  directory in it, or a local Hugging Face checkpoint directory (one with a config.json). A
  Hugging Face checkpoint must have the architecture of the `model` section (every field, not
  only the shapes: rope, norm eps, biases); a difference is an error naming the fields.
  """

  actor: str = ""
  """The policy: an SFT run (item 'actor'; 'policy' in older runs) or a Hugging Face causal
  LM. The reference is the same weights. Empty with `model.hf` set: that directory's weights."""
  critic: str = ""
  """The critic: a reward-model run (item 'reward'), an SFT run (its trunk; the value head
  starts at zero) or a Hugging Face sequence-classification checkpoint; empty: the actor's
  trunk if `actor` is set, else random. Empty with `model.roles.critic.hf` set: its weights."""
  reward: str = ""
  """The reward model: a reward-model run (item 'reward') or a Hugging Face
  sequence-classification checkpoint; for reward-model training also an SFT run or a Hugging
  Face causal LM, whose trunk it starts from (the value head starts at zero). Empty with
  `model.roles.reward.hf` set: its weights."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalSection:
  """Evaluation of the policy on held-out prompts, before training and after it (and every
  `every_steps` iterations)."""

  num_prompts: int = 64
  """Prompts of the data's eval split used (rounded up to whole rollout batches)."""
  temperature: float = 0.0
  """Sampling temperature of the evaluation; 0: greedy."""
  every_steps: int = 0
  """Also evaluate every this many iterations, into the metrics as `eval/*` at that step
  (`eval.json` and `eval.md` keep before and after); 0: only before and after. SFT and the
  reward model evaluate on their whole held-out split, into the metrics rows of step 0, of
  every `every_steps`-th step and of the last."""

  def __post_init__(self):
    ranges.check(
      "eval",
      self,
      num_prompts=ranges.NON_NEGATIVE,
      temperature=ranges.NON_NEGATIVE,
      every_steps=ranges.NON_NEGATIVE,
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class OffloadSection:
  """Idle roles' state parked in host memory between their stages (`rlhfjax.mesh.offload`)."""

  params: tuple[str, ...] = ()
  """Roles whose parameters live in host memory outside their stages: 'reference', 'reward'
  (their scoring), 'actor', 'critic' (their scoring and updates, PPO-family flows; the sync
  reads a device copy of the actor's)."""
  optimizer: tuple[str, ...] = ()
  """Roles whose optimizer state lives in host memory outside their update: 'actor', 'critic'."""

  def __post_init__(self):
    for name, allowed in (
      ("params", ("reference", "reward", "actor", "critic")),
      ("optimizer", ("actor", "critic")),
    ):
      for role in getattr(self, name):
        if role not in allowed:
          names = f"{', '.join(allowed[:-1])} and {allowed[-1]}"
          raise ConfigError(f"'offload.{name}' may name {names}, got {role!r}")


WANDB_MODES = ("online", "offline", "disabled")
WANDB_MISSING = 'logging.wandb=True needs the wandb package: pip install -e ".[wandb]"'


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoggingSection:
  """Where process 0's metrics go besides WORKDIR/metrics.jsonl and TensorBoard."""

  wandb: bool = False
  """Also log every metrics row, and this config, to a Weights & Biases run (one per workdir:
  a resumed run continues it; its id is kept in WORKDIR/wandb_run.json)."""
  wandb_project: str = "rlhfjax"
  wandb_entity: str = ""
  """The W&B user or team; empty: the logged-in user's default entity."""
  wandb_run_name: str = ""
  """The run's display name; empty: the workdir's name."""
  wandb_mode: str = ""
  """'online', 'offline' or 'disabled'; empty: W&B's own default (the WANDB_MODE variable)."""

  def __post_init__(self):
    if self.wandb_mode and self.wandb_mode not in WANDB_MODES:
      raise ConfigError(
        f"'logging.wandb_mode' must be empty or one of {', '.join(WANDB_MODES)}, "
        f"got {self.wandb_mode!r}"
      )
    if self.wandb:
      # Here, not when the first row is logged: a missing package must stop the job before
      # any model is built.
      try:
        import wandb  # noqa: F401
      except ImportError:
        raise ConfigError(WANDB_MISSING) from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
  """One optimizer per trained role (actor, critic)."""

  learning_rate: float = 1e-5
  """Peak learning rate, reached after `warmup_steps`."""
  warmup_steps: int = 0
  decay: str = "cosine"
  """'cosine' (to `final_lr_fraction` of the peak), 'linear', or 'constant' after warm-up."""
  final_lr_fraction: float = 0.1
  weight_decay: float = 0.0
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  max_grad_norm: float = 1.0
  """Clip gradients to this global norm (0 disables clipping)."""

  def __post_init__(self):
    if self.decay not in ("cosine", "linear", "constant"):
      raise ValueError(f"optimizer.decay must be cosine, linear or constant, got {self.decay!r}")
    ranges.check(
      "optimizer",
      self,
      learning_rate=ranges.POSITIVE,
      warmup_steps=ranges.NON_NEGATIVE,
      final_lr_fraction=ranges.FRACTION,
      weight_decay=ranges.NON_NEGATIVE,
      b1=ranges.between(0, 1, high_open=True),
      b2=ranges.between(0, 1, high_open=True),
      eps=ranges.POSITIVE,
      max_grad_norm=ranges.NON_NEGATIVE,
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointSection:
  """When checkpoints are written and whether a run resumes from them."""

  every_steps: int = 10
  """Save every this many iterations; 0: only at the end of the run and on SIGTERM."""
  keep: int = 3
  """Number of most recent complete checkpoints kept on disk."""
  async_save: bool = True
  """Write in the background: `save` returns once the arrays are copied to host memory."""
  resume: bool = True
  """Resume from the latest complete checkpoint in WORKDIR/checkpoints if there is one."""

  def __post_init__(self):
    ranges.check("checkpoint", self, every_steps=ranges.NON_NEGATIVE, keep=ranges.COUNT)


_HOST_PORT = re.compile(r"^\S+:\d+$")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistributedSection:
  """Multi-process runs. Empty or zero fields fall back to environment variables, and then to
  JAX's cluster auto-detection (Slurm, Open MPI, Cloud TPU, Kubernetes)."""

  enabled: bool = False
  """Call `jax.distributed.initialize` at start-up; every process runs the same command."""
  coordinator_address: str = ""
  """host:port of the coordination service, which process 0 runs; '': $JAX_COORDINATOR_ADDRESS."""
  num_processes: int = 0
  """Processes in the job; 0: $JAX_NUM_PROCESSES."""
  process_id: int = -1
  """This process's index in [0, num_processes); -1: $JAX_PROCESS_ID."""
  local_device_count: int = 0
  """Host (CPU) devices this process emulates; 0: placement.num_devices / num_processes.
  CPU only: GPU and TPU processes use the devices they have."""
  start_timeout_s: int = 300
  """Seconds a process waits for the whole job to join (process 0's coordination service and
  every other process) before it stops with an error naming what it waited for."""
  peer_timeout_s: int = 60
  """Seconds without a sign of life from another process after which the others stop with an
  error naming it (instead of waiting forever in a collective)."""
  wait_timeout_s: int = 3600
  """Seconds a process waits for the others at a meeting point (before a program whose
  collectives span processes, a stop agreed between iterations, a program compiled by another
  process) before it stops with an error naming the point and where each missing process is:
  processes that are alive but took different paths (a deadlock) end instead of waiting
  forever. Long enough for the slowest process's generation of a batch."""
  supervise: bool = True
  """Run the work in a child of the process started, which turns JAX's abort when process 0
  (the coordination service) is lost into one line (`rlhfjax.supervisor`); False: no child
  (for a debugger or profiler attached to the process started)."""

  def __post_init__(self):
    if self.coordinator_address and not _HOST_PORT.match(self.coordinator_address):
      raise ValueError(f"coordinator_address must be host:port, got {self.coordinator_address!r}")
    if self.num_processes < 0:
      raise ValueError(f"num_processes must be >= 0, got {self.num_processes}")
    if self.process_id < -1:
      raise ValueError(f"process_id must be >= -1, got {self.process_id}")
    if self.num_processes and self.process_id >= self.num_processes:
      raise ValueError(
        f"process_id={self.process_id} must be below num_processes={self.num_processes}"
      )
    if self.local_device_count < 0:
      raise ValueError(f"local_device_count must be >= 0, got {self.local_device_count}")
    for name in ("start_timeout_s", "peer_timeout_s", "wait_timeout_s"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SupervisedSection(_packing(False)):
  """Batches of the flows that train one model on a dataset: SFT on `data.demonstrations`,
  the reward model on `data.preferences`. Held-out evaluation runs on the whole eval split
  before the first step, every `eval.every_steps` steps and after the last.

  Packed (`packing`): each example's real tokens in rows of `max_len` tokens (a reward model's
  pair never split between two micro-batches), weighted so the update is the whole batch's
  exact mean (SFT's over tokens, the reward model's over pairs): the padded run's numbers up to
  float rounding when `micro_batches` is 1. A budget holds at least one example, `max_len` (a
  pair, 2 x `max_len`, for the reward model); 0 is `batch_size / micro_batches` x `max_len`
  (twice that for pairs). Evaluation stays padded."""

  batch_size: int = 32
  """Examples (SFT) or preference pairs (reward model) per optimizer update."""
  micro_batches: int = 1
  """Gradient-accumulation steps per update; must divide `batch_size`."""
  max_len: int = 256
  """Tokens per sequence (prompt and response); longer examples are truncated and counted."""

  def __post_init__(self):
    ranges.check(
      "supervised",
      self,
      batch_size=ranges.COUNT,
      micro_batches=ranges.COUNT,
      max_len=ranges.COUNT,
      max_tokens_per_micro_batch=ranges.NON_NEGATIVE,
    )
    self.check_budget("supervised", self.max_len, "one sequence's capacity, supervised.max_len")
    if self.batch_size % self.micro_batches:
      raise ConfigError(
        f"supervised: 'micro_batches'={self.micro_batches} must divide "
        f"'batch_size'={self.batch_size}"
      )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExperimentConfig:
  """The whole experiment; each field is one section of the config file."""

  model: ModelSection
  placement: PlacementSection = dataclasses.field(default_factory=PlacementSection)
  rollout: RolloutSection = dataclasses.field(default_factory=RolloutSection)
  seed: int = 0
  total_steps: int = 20
  """Iterations of the flow: PPO's rollout, score, update, sync; one optimizer update of SFT or
  the reward model (a resumed run continues to this step)."""
  ppo: PPOSection = dataclasses.field(default_factory=PPOSection)
  algorithm: AlgorithmSection = dataclasses.field(default_factory=AlgorithmSection)
  dpo: DPOSection = dataclasses.field(default_factory=DPOSection)
  online_dpo: OnlineDPOSection = dataclasses.field(default_factory=OnlineDPOSection)
  reward: RewardSection = dataclasses.field(
    default_factory=lambda: RewardSection(fn="rlhfjax.tasks:vowel_reward")
  )
  data: DataSection = dataclasses.field(default_factory=DataSection)
  actor_optimizer: OptimizerConfig = dataclasses.field(
    default_factory=lambda: OptimizerConfig(learning_rate=1e-5)
  )
  critic_optimizer: OptimizerConfig = dataclasses.field(
    default_factory=lambda: OptimizerConfig(learning_rate=5e-5)
  )
  reward_optimizer: OptimizerConfig = dataclasses.field(
    default_factory=lambda: OptimizerConfig(learning_rate=1e-4, warmup_steps=10)
  )
  """The reward model's, when a flow trains it (algorithm 'rm')."""
  supervised: SupervisedSection = dataclasses.field(default_factory=SupervisedSection)
  log_every: int = 1
  checkpoint: CheckpointSection = dataclasses.field(default_factory=lambda: CheckpointSection())
  """How often to checkpoint to WORKDIR/checkpoints and whether a rerun resumes."""
  init: RoleInitSection = dataclasses.field(default_factory=RoleInitSection)
  eval: EvalSection = dataclasses.field(default_factory=EvalSection)
  distributed: DistributedSection = dataclasses.field(default_factory=DistributedSection)
  offload: OffloadSection = dataclasses.field(default_factory=OffloadSection)
  logging: LoggingSection = dataclasses.field(default_factory=LoggingSection)

  def __post_init__(self):
    ranges.check("", self, seed=ranges.SEED, total_steps=ranges.COUNT, log_every=ranges.COUNT)
    init = self.init
    # A model given as a checkpoint directory starts from its weights unless told otherwise.
    defaults = {
      "actor": self.model.hf_for("actor"),
      "critic": self.model.roles.get("critic", RoleModelSection()).hf,
      "reward": self.model.roles.get("reward", RoleModelSection()).hf,
    }
    changes = {k: v for k, v in defaults.items() if v and not getattr(init, k)}
    if changes:
      object.__setattr__(self, "init", dataclasses.replace(init, **changes))
    _check_pure_bf16(self)
    _check_extra_roles(self)
    if self.model.lora.quantize and not self.model.adapted_roles:
      raise ConfigError(
        f"'model.lora.quantize'={self.model.lora.quantize!r} quantizes the frozen base under "
        "LoRA adapters, but no role trains adapters: set 'model.lora.rank' > 0"
      )
    if self.model.reference_from_base:
      parked = [r for r in ("actor", "reference") if r in self.offload.params]
      if parked:
        raise ConfigError(
          f"'offload.params' names {', '.join(parked)}, but the reference runs the actor's base "
          "weights on the actor's devices ('model.lora.reference'='base'): leave "
          f"{'them' if len(parked) > 1 else 'it'} out, or set 'model.lora.reference'='placed'"
        )
    reward, environment = self.reward, self.rollout.environment
    parts = (reward.fn, reward.model_coef, any(reward.role_coefs.values()), reward.judge)
    if not any((*parts, environment)):
      raise ConfigError(
        "no reward: set 'reward.fn', a non-zero 'reward.model_coef', 'reward.role_coefs', "
        "'reward.judge' or 'rollout.environment'"
      )
    _checkpoint_tokenizer(self)
    _check_template_fields(self.data)
    _check_positions(self)
    width, lengths = self.rollout.max_seq_len, "rollout.max_prompt_len + rollout.max_new_tokens"
    self.ppo.check_budget("ppo", width, f"one sequence's capacity, {lengths}")
    _check_fusable(self.ppo, self.placement)
    if self.rollout.release and self.ppo.generates_ahead:
      raise ConfigError(
        "'rollout.release' frees the rollout's weights between generations, but "
        "'ppo.async_rollout' or 'ppo.max_staleness' keeps it generating while the update "
        "trains: set one of them"
      )
    for name in ("dpo", "online_dpo"):
      getattr(self, name).check_budget(name, 2 * width, f"one pair's capacity, 2 x ({lengths})")


_BF16_HALF_SPACING = 2.0**-14
"""Half the spacing of bf16 numbers in [2^-6, 2^-5), where a typical weight (0.02) lies: an
update smaller than this leaves such a weight unchanged."""


def _check_pure_bf16(cfg: ExperimentConfig) -> None:
  """`model.fp32_masters=False` with a trained role in bf16 and a learning rate whose Adam
  steps (about the learning rate) bf16 cannot add to a weight of 0.02."""
  if cfg.model.fp32_masters:
    return
  optimizers = {"actor": "actor_optimizer", "reward": "reward_optimizer"}
  for role, section in optimizers.items():
    if role not in cfg.model.trained_roles or cfg.model.lora_rank(role):
      continue  # not trained, or adapters (float32 whatever the base)
    if cfg.model.for_role(role).param_dtype != "bfloat16":
      continue
    lr = getattr(cfg, section).learning_rate
    if lr < _BF16_HALF_SPACING:
      raise ConfigError(
        f"'{section}.learning_rate'={lr:g} with 'model.fp32_masters'=False: the {role} trains "
        f"in pure bf16, where an update below {_BF16_HALF_SPACING:.2g} leaves a weight of 0.02 "
        "unchanged, so most updates would round away; keep fp32 masters (the default)"
      )


def _check_extra_roles(cfg: ExperimentConfig) -> None:
  """Each extra role's weight and place: a reward role has a non-zero `reward.role_coefs`
  entry and no other name has one; `placement.extra_roles` names extra roles only, each placed
  against a role that exists before it; every extra role gets a placement entry (the default,
  shared with the reward, where none is given), in `model.extra_roles`' order."""
  extras = cfg.model.extra_roles
  judge = cfg.reward.judge
  if judge and (judge not in extras or extras[judge].kind != "judge"):
    judges = [n for n, s in extras.items() if s.kind == "judge"]
    raise ConfigError(
      f"'reward.judge'={judge!r}: no extra role of kind 'judge' by that name in "
      f"'model.extra_roles' (judges: {', '.join(judges) or 'none'})"
    )
  for name in cfg.reward.role_coefs:
    if name not in extras or extras[name].kind != "reward":
      raise ConfigError(
        f"'reward.role_coefs.{name}': no extra reward role {name!r} in 'model.extra_roles' "
        f"(extra roles: {', '.join(extras) or 'none'})"
      )
  for name, section in extras.items():
    if section.kind == "reward" and not cfg.reward.role_coefs.get(name):
      raise ConfigError(
        f"'model.extra_roles.{name}' is a reward role but 'reward.role_coefs.{name}' gives it "
        "no weight: set a non-zero weight, or drop the role"
      )
    if section.kind == "judge" and cfg.reward.judge != name:
      raise ConfigError(
        f"'model.extra_roles.{name}' is a judge but 'reward.judge' is "
        f"{cfg.reward.judge!r}: set 'reward.judge'={name!r}, or drop the role"
      )
  placed = cfg.placement.extra_roles
  for name in placed:
    if name not in extras:
      raise ConfigError(
        f"'placement.extra_roles.{name}': no extra role {name!r} in 'model.extra_roles' "
        f"(extra roles: {', '.join(extras) or 'none'})"
      )
  sections = {name: placed.get(name, ExtraPlacementSection()) for name in extras}
  before = list(_ROLES)
  for name, section in sections.items():
    if section.mode != "own" and section.with_role not in before:
      raise ConfigError(
        f"'placement.extra_roles.{name}.with_role'={section.with_role!r} is not a role placed "
        f"before it; choose one of {', '.join(before)}"
      )
    if section.mode == "interleaved" and section.with_role in ("actor", "critic", "rollout"):
      raise ConfigError(
        f"'placement.extra_roles.{name}': 'interleaved' splits a scoring role's devices "
        f"(reference, reward or an extra role), not the {section.with_role}'s"
      )
    before.append(name)
  placement = dataclasses.replace(cfg.placement, extra_roles=sections)
  object.__setattr__(cfg, "placement", placement)


def _check_positions(cfg: ExperimentConfig) -> None:
  """A sequence of `rollout.max_seq_len` tokens must have positions the policy knows (with
  'dynamic' rotary scaling the base grows past them: that is its point)."""
  model = cfg.model.for_role("actor")
  dynamic = model.rope_scaling is not None and model.rope_scaling.type == "dynamic"
  if cfg.rollout.max_seq_len > model.max_position_embeddings and not dynamic:
    raise ConfigError(
      f"'rollout.max_prompt_len' + 'rollout.max_new_tokens' = {cfg.rollout.max_seq_len} "
      f"exceeds the actor's max_position_embeddings ({model.max_position_embeddings}, "
      f"{cfg.model.model_name('actor')}): lower them or run a model with longer positions"
    )


def _check_fusable(ppo: PPOSection, placement: PlacementSection) -> None:
  """`ppo.fuse_actor_critic` needs pipelined actor and critic on the same devices; what the
  config alone shows is checked here, the devices of an explicit spec where it is built
  (`rlhfjax.placement.validate.check_fusable`)."""
  if not ppo.fuse_actor_critic:
    return
  if placement.strategy == "auto":  # the planner chooses the stages, of fusable placements only
    return
  if placement.strategy != "explicit" and placement.pipeline_stages == 1:
    raise ConfigError(
      "'ppo.fuse_actor_critic' fuses two pipelines: set 'placement.pipeline_stages' > 1"
    )
  if placement.split_actor_critic and placement.strategy in ("interleaved", "disaggregated"):
    raise ConfigError(
      "'ppo.fuse_actor_critic' needs the actor and critic on the same devices, but "
      "'placement.split_actor_critic' puts them on disjoint halves"
    )


def _check_template_fields(data: DataSection) -> None:
  """A system prompt or template arguments need a checkpoint's template (once `data.tokenizer`
  is resolved)."""
  for field in ("system_prompt", "template_kwargs"):
    if getattr(data, field) and data.tokenizer == "byte":
      raise ConfigError(
        f"data.{field} needs a checkpoint's chat template; the byte tokenizer's built-in one "
        "has user and assistant turns only"
      )


def _checkpoint_tokenizer(cfg: ExperimentConfig) -> None:
  """The tokenizer of `model.hf` when `data.tokenizer` is left at its default ('byte')."""
  if cfg.model.hf and cfg.data.tokenizer == "byte":
    object.__setattr__(cfg, "data", dataclasses.replace(cfg.data, tokenizer=cfg.model.hf))


@dataclasses.dataclass(frozen=True, kw_only=True)
class _DistributedOnly:
  distributed: DistributedSection = dataclasses.field(default_factory=DistributedSection)


def distributed_from_config_dict(config_dict: Any) -> DistributedSection:
  """The `distributed` section of a config file's `ConfigDict`, typed and validated (defaults
  when the file has none), for entry points that need it before the whole config is built."""
  if hasattr(config_dict, "to_dict"):
    config_dict = config_dict.to_dict()
  section = config_dict.get("distributed")
  wrapped = {} if section is None else {"distributed": section}
  return from_config_dict(wrapped, _DistributedOnly).distributed


def from_config_dict(config_dict: Any, cls: type[T] = ExperimentConfig) -> T:
  """Converts a `ConfigDict` (or nested mapping) into a typed config (`ExperimentConfig` by
  default; the SFT and reward-model trainers pass their own classes).

  Args:
    config_dict: an `ml_collections.ConfigDict` or a plain nested mapping.
    cls: the frozen dataclass to build.

  Returns:
    The typed, validated config.

  Raises:
    ConfigError: a field is unknown (naming its dotted path and a close match), missing, of the
      wrong type, or invalid (for example an unknown model size).
  """
  if hasattr(config_dict, "to_dict"):
    config_dict = config_dict.to_dict()
  return _convert(config_dict, cls, "")


def _convert(value: Any, tp: Any, path: str) -> Any:
  """Checks `value` against the type annotation `tp`, recursing into sections and tuples."""
  if dataclasses.is_dataclass(tp):
    return _convert_section(value, tp, path)
  origin, args = typing.get_origin(tp), typing.get_args(tp)
  if origin in (types.UnionType, typing.Union):
    if value is None and type(None) in args:
      return None
    (inner,) = [arg for arg in args if arg is not type(None)]
    if isinstance(inner, type) and not dataclasses.is_dataclass(inner):
      return _convert_plain(value, inner, path, shown_type=tp)
    return _convert(value, inner, path)
  if origin is tuple:
    if not isinstance(value, list | tuple):
      raise _type_error(path, tp, value)
    item_type = args[0]
    return tuple(_convert(item, item_type, f"{path}[{i}]") for i, item in enumerate(value))
  if origin is dict:
    if not isinstance(value, Mapping):
      raise _type_error(path, tp, value)
    key_type, value_type = args
    return {
      _convert(key, key_type, path): _convert(item, value_type, f"{path}.{key}")
      for key, item in value.items()
    }
  return _convert_plain(value, tp, path, shown_type=tp)


def _convert_plain(value: Any, tp: type, path: str, *, shown_type: Any) -> Any:
  """Checks a scalar (int, float, str, bool); ints are accepted where floats are expected, and
  every float must be finite."""
  if tp is float and isinstance(value, int) and not isinstance(value, bool):
    return float(value)
  if tp is float and isinstance(value, float) and not math.isfinite(value):
    raise ConfigError(f"config field {path!r} must be a finite number, got {value!r}")
  # bool is a subclass of int, but `num_devices=True` is a mistake, not the number 1.
  if not isinstance(value, tp) or (tp is not bool and isinstance(value, bool)):
    raise _type_error(path, shown_type, value)
  return value


def _convert_section(value: Any, cls: type, path: str) -> Any:
  if not isinstance(value, Mapping):
    raise ConfigError(f"config field {path!r} must be a section, got {type(value).__name__}")
  fields = {field.name: field for field in dataclasses.fields(cls)}
  hints = _type_hints(cls)
  prefix = f"{path}." if path else ""
  for key in value:
    if key not in fields:
      raise ConfigError(_unknown_field_message(f"{prefix}{key}", key, fields, prefix))
  kwargs = {}
  for name, field in fields.items():
    if name in value:
      kwargs[name] = _convert(value[name], hints[name], f"{prefix}{name}")
    elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
      raise ConfigError(f"missing config field '{prefix}{name}'")
  try:
    return cls(**kwargs)
  except ConfigError:
    raise
  except ranges.RangeError as e:  # names the field; within a nested section, the section too
    raise ConfigError(str(e) if not path or f"'{path}." in str(e) else f"{path}: {e}") from None
  except ValueError as e:  # a section's own validation (e.g. OptimizerConfig)
    raise ConfigError(f"{path or 'config'}: {e}") from None


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
  return typing.get_type_hints(cls)


_REMOVED = {
  "rollout.paged": "the rollout engine always keeps its KV cache in pages (a pool of "
  "'rollout.kv_cache_tokens' or 'rollout.kv_memory_fraction'; 0 for both: every slot at full "
  "length, a dense cache's memory)",
}
"""Fields that were removed, and why: a config that still sets one says so."""


def _unknown_field_message(dotted: str, key: str, fields: Mapping[str, Any], prefix: str) -> str:
  if dotted in _REMOVED:
    return f"config field {dotted!r} was removed: {_REMOVED[dotted]}; drop it"
  message = f"unknown config field {dotted!r}"
  close = difflib.get_close_matches(str(key), list(fields), n=1)
  if close:
    return f"{message}; did you mean '{prefix}{close[0]}'?"
  return f"{message}; known fields: {', '.join(fields)}"


def _type_error(path: str, tp: Any, value: Any) -> ConfigError:
  expected = tp.__name__ if isinstance(tp, type) else str(tp)
  return ConfigError(
    f"config field {path!r} must be {expected}, got {type(value).__name__} {value!r}"
  )


_COMPLETED_KEYS = {"roles": _ROLES}
"""Keys a `dict[str, section]` field is completed with (`complete`): a role's section exists
for every role, so `--config.model.roles.actor.remat=full` is an override, not a new key."""


def complete(config_dict: Any, cls: type) -> Any:
  """Adds every field of the typed config `cls` that `config_dict` (a config file's
  `ConfigDict`) lacks, with its default, so that every field is settable from the command line
  on every config (`ml_collections` refuses an override of a key the file did not write).

  A field whose default is None becomes a typed `FieldReference` (an override of a None field
  needs its type); sections recurse; a `dict[str, section]` of roles gets each role's section.
  What the file wrote is kept as it is, so the typed config it means does not change.
  """
  import ml_collections  # noqa: PLC0415 - config files call this; the library does not need it

  hints = _type_hints(cls)
  for field in dataclasses.fields(cls):
    tp = hints[field.name]
    inner = _optional_inner(tp)
    if field.name in config_dict:
      value = config_dict[field.name]
      if dataclasses.is_dataclass(inner) and isinstance(value, ml_collections.ConfigDict):
        complete(value, inner)
      elif _is_section_dict(inner) and isinstance(value, ml_collections.ConfigDict):
        _complete_section_dict(value, field.name, inner)
      continue
    if dataclasses.is_dataclass(inner):
      if field.default is None:
        continue  # an optional section: absent means None
      config_dict[field.name] = complete(ml_collections.ConfigDict(), inner)
    elif _is_section_dict(inner):
      config_dict[field.name] = _complete_section_dict(
        ml_collections.ConfigDict(), field.name, inner
      )
    else:
      default = _default(field)
      if default is dataclasses.MISSING:
        continue
      if default is None:
        if isinstance(inner, type) and inner in (int, float, str, bool):
          config_dict[field.name] = ml_collections.FieldReference(None, field_type=inner)
      elif isinstance(default, int | float | str | bool | tuple):
        config_dict[field.name] = default
      elif isinstance(default, dict):  # e.g. model.overrides: keys are the user's to add
        config_dict[field.name] = ml_collections.ConfigDict(default)
  return config_dict


def field_paths(cls: type = ExperimentConfig, prefix: str = "") -> list[str]:
  """Every dotted field of the typed config `cls`: sections recursed, a dict of role sections
  under each role (`model.roles.actor.remat`), a dict of sections by the user's names (the
  extra roles, `model.extra_roles`) as itself."""
  hints = _type_hints(cls)
  paths = []
  for field in dataclasses.fields(cls):
    tp, path = _optional_inner(hints[field.name]), f"{prefix}{field.name}"
    if dataclasses.is_dataclass(tp):
      paths += field_paths(tp, f"{path}.")
    elif _is_section_dict(tp) and field.name in _COMPLETED_KEYS:
      for key in _COMPLETED_KEYS[field.name]:
        paths += field_paths(typing.get_args(tp)[1], f"{path}.{key}.")
    elif _is_section_dict(tp):
      paths.append(path)  # its keys are the user's (extra roles): the dict itself
    else:
      paths.append(path)
  return paths


def unknown_override(path: str) -> str | None:
  """What to say of `--config.<path>`, an override `ml_collections` refused, or None when
  `path` names a field of `ExperimentConfig` (or lies inside one, a dict's key). Any prefix
  of sections `ExperimentConfig` does not know (a pipeline config's stage, `ppo.`) is kept."""
  paths = field_paths()
  known = set(paths)
  parts = path.split(".")
  for start in range(len(parts)):
    inner = ".".join(parts[start:])
    if inner in known or any(inner.startswith(f"{p}.") for p in known):
      return None
  # The longest tail of `path` in known sections: what comes before it (a stage) is kept.
  sections = {p.rsplit(".", 1)[0] for p in paths if "." in p}
  start = next((i for i in range(len(parts) - 1) if ".".join(parts[i:-1]) in sections), 0)
  kept, inner, name = ".".join(parts[:start]), ".".join(parts[start:]), parts[-1]
  if inner in _REMOVED:
    return f"the field was removed: {_REMOVED[inner]}; drop the flag"
  same_name = sorted({_any_role(p) for p in paths if p.rsplit(".", 1)[-1] == name})
  guesses = same_name or difflib.get_close_matches(inner, paths, n=1)
  message = "no such field"
  if guesses:
    flags = " or ".join(f"--config.{kept + '.' if kept else ''}{g}" for g in guesses[:3])
    roles = f" (<role>: {', '.join(_ROLES)})" if "<role>" in flags else ""
    message += f"; did you mean {flags}{roles}?"
  return message


def _any_role(path: str) -> str:
  return re.sub(rf"\.roles\.(?:{'|'.join(_ROLES)})\.", ".roles.<role>.", path)


def _optional_inner(tp: Any) -> Any:
  if typing.get_origin(tp) in (types.UnionType, typing.Union):
    args = [arg for arg in typing.get_args(tp) if arg is not type(None)]
    if len(args) == 1:
      return args[0]
  return tp


def _is_section_dict(tp: Any) -> bool:
  args = typing.get_args(tp)
  return typing.get_origin(tp) is dict and len(args) == 2 and dataclasses.is_dataclass(args[1])


def _complete_section_dict(value: Any, name: str, tp: Any) -> Any:
  import ml_collections  # noqa: PLC0415

  section = typing.get_args(tp)[1]
  for key in _COMPLETED_KEYS.get(name, ()):
    if key not in value:
      value[key] = ml_collections.ConfigDict()
  for key in value:
    complete(value[key], section)
  return value


def _default(field: dataclasses.Field) -> Any:
  if field.default is not dataclasses.MISSING:
    return field.default
  if field.default_factory is not dataclasses.MISSING:
    return field.default_factory()
  return dataclasses.MISSING
