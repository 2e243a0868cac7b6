"""Every config field of every section: wrong types and out-of-range values are one line naming
the field; every shipped config has every field the README and docs/ document for it."""

from __future__ import annotations

import copy
import dataclasses
import glob
import math
import os
import re
import runpy
import types
import typing

import pytest

from rlhfjax import config as config_lib
from rlhfjax.placement.validate import PlacementError
from rlhfjax.planner.place import place

pytestmark = pytest.mark.pure

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = {
  "ppo_tiny": config_lib.ExperimentConfig,
  "sft_tiny": config_lib.ExperimentConfig,
  "rm_tiny": config_lib.ExperimentConfig,
}


def _base(name: str) -> dict:
  return runpy.run_path(os.path.join(ROOT, "configs", f"{name}.py"))["get_config"]().to_dict()


_BASES = {name: _base(name) for name in SHIPPED}


def _scalar_type(tp):
  """int, float, str or bool for a scalar annotation (optional ones included), else None."""
  if typing.get_origin(tp) in (types.UnionType, typing.Union):
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    tp = args[0] if len(args) == 1 else None
  return tp if tp in (int, float, str, bool) else None


def _section_type(tp):
  if typing.get_origin(tp) in (types.UnionType, typing.Union):
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    tp = args[0] if len(args) == 1 else None
  return tp if dataclasses.is_dataclass(tp) else None


def _scalar_fields(cls, prefix=""):
  """(dotted path, type) of every scalar field of `cls` and its sections, recursively."""
  for field in dataclasses.fields(cls):
    tp = typing.get_type_hints(cls)[field.name]
    path = f"{prefix}{field.name}"
    if _section_type(tp) is not None:
      yield from _scalar_fields(_section_type(tp), f"{path}.")
    elif _scalar_type(tp) is not None:
      yield path, _scalar_type(tp)


def _cases():
  for name, cls in SHIPPED.items():
    for path, tp in _scalar_fields(cls):
      yield pytest.param(name, path, tp, id=f"{name}:{path}")


def _with(name: str, path: str, value) -> dict:
  config = copy.deepcopy(_BASES[name])
  *parents, leaf = path.split(".")
  node = config
  for parent in parents:
    if not isinstance(node.get(parent), dict):
      node[parent] = {}
    node = node[parent]
  node[leaf] = value
  return config


def _error(name: str, path: str, value) -> str | None:
  """The one-line error of the config with `path` set to `value`, at conversion or (for the
  placement, which needs the devices) at planning; None if it is accepted."""
  try:
    cfg = config_lib.from_config_dict(_with(name, path, value), SHIPPED[name])
    if SHIPPED[name] is config_lib.ExperimentConfig:
      place(cfg, 8)
  except (config_lib.ConfigError, PlacementError) as e:
    return str(e)
  return None


def _wrong_types(tp):
  return {int: ["x", 1.5, [1]], float: ["x", [1.0]], str: [5, ["a"]], bool: ["yes", 1]}[tp]


def _out_of_range(tp, path):
  if tp is float:
    return [math.nan, math.inf, -math.inf]
  if tp is int:
    return [-(10**9)]
  return []


@pytest.mark.parametrize(("name", "path", "tp"), list(_cases()))
def test_every_field_refuses_wrong_types_and_out_of_range_values_naming_it(name, path, tp):
  # The shipped config itself is valid.
  assert _error(name, path, _get(name, path)) is None
  leaf = path.split(".")[-1]
  for value in [*_wrong_types(tp), *_out_of_range(tp, path)]:
    message = _error(name, path, value)
    assert message is not None, f"{path}={value!r} was accepted"
    assert "\n" not in message and leaf in message, (path, value, message)


def _get(name, path):
  value = _get_raw(name, path)
  return _default(name, path) if value is _ABSENT else value


def _default(name, path):
  cls = SHIPPED[name]
  *parents, leaf = path.split(".")
  for parent in parents:
    cls = _section_type(typing.get_type_hints(cls)[parent])
  field = {f.name: f for f in dataclasses.fields(cls)}[leaf]
  if field.default is not dataclasses.MISSING:
    return field.default
  return field.default_factory()


# Values a user may type that make no sense: each one line naming the field.
_MEANINGLESS = [
  ("ppo_tiny", "ppo.clip_eps", -0.1, r"'ppo\.clip_eps' must be > 0, got -0\.1"),
  ("ppo_tiny", "ppo.value_clip_eps", 0.0, r"'ppo\.value_clip_eps' must be > 0"),
  ("ppo_tiny", "ppo.kl_coef", -1.0, r"'ppo\.kl_coef' must be >= 0, got -1\.0"),
  ("ppo_tiny", "ppo.gamma", 5.0, r"'ppo\.gamma' must be in \[0, 1\], got 5\.0"),
  ("ppo_tiny", "ppo.lam", 1.5, r"'ppo\.lam' must be in \[0, 1\]"),
  ("ppo_tiny", "ppo.entropy_coef", -0.01, r"'ppo\.entropy_coef' must be >= 0"),
  ("ppo_tiny", "ppo.kl_target", 0.0, r"'ppo\.kl_target' must be > 0"),
  ("ppo_tiny", "ppo.kl_horizon", 0, r"'ppo\.kl_horizon' must be >= 1"),
  ("ppo_tiny", "ppo.rollout_correction_cap", 1.0, r"'ppo\.rollout_correction_cap' must be > 1"),
  ("ppo_tiny", "ppo.rollout_correction_cap", math.nan, r"'ppo\.rollout_correction_cap' must"),
  ("ppo_tiny", "ppo.rollout_correction", "is", r"'ppo\.rollout_correction' must be one of none"),
  ("ppo_tiny", "ppo.rollout_correction_level", "batch", r"_level' must be one of token, sequence"),
  ("ppo_tiny", "total_steps", 0, r"'total_steps' must be >= 1, got 0"),
  ("ppo_tiny", "total_steps", -3, r"'total_steps' must be >= 1, got -3"),
  ("ppo_tiny", "seed", -1, r"'seed' must be in \[0, 2147483647\], got -1"),
  ("ppo_tiny", "log_every", 0, r"'log_every' must be >= 1"),
  ("ppo_tiny", "rollout.top_p", 0.0, r"'rollout\.top_p' must be in \(0, 1\]"),
  ("ppo_tiny", "rollout.temperature", -1.0, r"'rollout\.temperature' must be >= 0"),
  ("ppo_tiny", "eval.temperature", -1.0, r"'eval\.temperature' must be >= 0"),
  ("ppo_tiny", "checkpoint.keep", 0, r"'checkpoint\.keep' must be >= 1"),
  ("ppo_tiny", "actor_optimizer.b2", 1.0, r"actor_optimizer: 'optimizer\.b2' must be in \[0, 1\)"),
  ("ppo_tiny", "critic_optimizer.learning_rate", 0.0, r"critic_optimizer: .*learning_rate"),
  ("ppo_tiny", "actor_optimizer.final_lr_fraction", 2.0, r"final_lr_fraction' must be in"),
  ("ppo_tiny", "placement.num_devices", 0, r"num_devices must be >= 1, got 0"),
  ("ppo_tiny", "placement.memory_per_device_gb", 0.0, r"'placement\.memory_per_device_gb' must"),
  ("ppo_tiny", "distributed.start_timeout_s", 0, r"start_timeout_s must be >= 1"),
  ("ppo_tiny", "distributed.wait_timeout_s", 0, r"wait_timeout_s must be >= 1"),
  ("ppo_tiny", "rollout.attention", "flash", r"'rollout\.attention' must be one of auto, pallas"),
  ("ppo_tiny", "reward.fn_coef", math.nan, r"'reward\.fn_coef' must be a finite number"),
  ("sft_tiny", "seed", -1, r"'seed' must be in \[0, 2147483647\]"),
  ("sft_tiny", "eval.every_steps", -1, r"'eval\.every_steps' must be >= 0"),
  ("sft_tiny", "actor_optimizer.warmup_steps", -1, r"'optimizer\.warmup_steps' must be >= 0"),
  ("rm_tiny", "supervised.batch_size", 0, r"'supervised\.batch_size' must be >= 1"),
]


@pytest.mark.parametrize(("name", "path", "value", "pattern"), _MEANINGLESS)
def test_meaningless_values_are_refused_naming_the_field(name, path, value, pattern):
  message = _error(name, path, value)
  assert message is not None and re.search(pattern, message), message


def _documented_fields() -> set[str]:
  """The config fields the README and the guides in docs/ name."""
  pages = [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]
  text = ""
  for page in pages:
    with open(page) as f:
      text += f.read()
  return set(re.findall(r"`(?:--config\.)?([a-z_]+\.[a-z_]+)(?:=[^`]*)?`", text)) | set(
    re.findall(r"--config\.([a-z_]+\.[a-z_]+)", text)
  )


# The DPO section is documented for the DPO configs (checked below).
_DPO_FIELDS = {"dpo.beta", "dpo.loss", "dpo.label_smoothing"}
# The data files of the other stages: documented, but not for this config.
_OTHER_STAGES = {
  "ppo_tiny": {"data.demonstrations", "data.preferences"} | _DPO_FIELDS,
  "sft_tiny": {"data.prompts", "data.preferences"},
  "rm_tiny": {"data.prompts", "data.demonstrations"},
}


@pytest.mark.parametrize("name", list(SHIPPED))
def test_shipped_configs_have_every_field_the_readme_documents(name):
  fields = {path for path, _ in _scalar_fields(SHIPPED[name])}
  wanted = (_documented_fields() & fields) - _OTHER_STAGES[name]
  assert wanted, "the README documents no field of this config?"
  missing = sorted(path for path in wanted if _get_raw(name, path) is _ABSENT)
  assert not missing, f"configs/{name}.py lacks {missing}"


_ABSENT = object()


@pytest.mark.parametrize("name", ["dpo_tiny", "online_dpo_tiny"])
def test_dpo_configs_have_the_documented_dpo_fields(name):
  documented = _documented_fields() & _DPO_FIELDS
  assert documented == _DPO_FIELDS, "the README's DPO row documents these fields"
  section = _base(name)["dpo"]
  missing = sorted(path for path in documented if path.split(".")[1] not in section)
  assert not missing, f"configs/{name}.py lacks {missing}"


def _get_raw(name, path):
  node = _BASES[name]
  for part in path.split("."):
    if not isinstance(node, dict) or part not in node:
      return _ABSENT
    node = node[part]
  return node


def _schema_paths(cls, prefix=""):
  """Every dotted field of `cls` (sections recursed; a dict of role sections under each role)."""
  hints = typing.get_type_hints(cls)
  for field in dataclasses.fields(cls):
    tp, path = hints[field.name], f"{prefix}{field.name}"
    section = _section_type(tp)
    args = typing.get_args(tp)
    if section is not None:
      yield from _schema_paths(section, f"{path}.")
    elif typing.get_origin(tp) is dict and args and dataclasses.is_dataclass(args[1]):
      if field.name == "extra_roles":  # keyed by the user's own role names
        yield path
        continue
      for role in ("actor", "critic", "reference", "reward", "rollout"):
        yield from _schema_paths(args[1], f"{path}.{role}.")
    else:
      yield path


_ALL_CONFIGS = sorted(
  os.path.basename(p)[:-3]
  for p in glob.glob(os.path.join(ROOT, "configs", "*.py"))
  if not os.path.basename(p).startswith("pipeline")
)


@pytest.mark.parametrize("name", _ALL_CONFIGS)
def test_every_documented_field_is_settable_on_every_config(name):
  """Issue 28, item 9: a field the README or docs/ name (`model.roles.actor.remat`,
  `offload.params`, `data.preferences`, ...) is a key of every shipped config of its kind, so
  `--config.<field>=...` is an override, never `bad --config override`."""
  cls = SHIPPED.get(name, config_lib.ExperimentConfig)
  pages = [os.path.join(ROOT, "README.md"), *glob.glob(os.path.join(ROOT, "docs", "*.md"))]
  text = ""
  for page in pages:
    with open(page) as f:
      text += f.read()
  documented = set(re.findall(r"\b([a-z_]+(?:\.[a-z_]+)+)\b", text))
  schema = set(_schema_paths(cls))
  wanted = documented & schema
  cd = runpy.run_path(os.path.join(ROOT, "configs", f"{name}.py"))["get_config"]()
  missing = []
  for path in sorted(schema):  # every field of the schema, documented or not
    node = cd
    for part in path.split("."):
      if part not in node:
        missing.append(path)
        break
      node = node[part]
  assert not missing, f"configs/{name}.py lacks {missing}"
  assert wanted, "the docs name no field of this config?"


def test_field_paths_are_the_schemas_fields():
  assert config_lib.field_paths() == list(_schema_paths(config_lib.ExperimentConfig))


@pytest.mark.parametrize(
  ("path", "said"),
  [
    ("model.roles.actor.remat", None),
    ("model.overrides.num_layers", None),  # a key of a dict field
    ("sft.total_steps", None),  # a pipeline config's stage, then a field
    ("ppo.kl_cof", "no such field; did you mean --config.ppo.kl_coef?"),
    ("modl.size", "no such field; did you mean --config.model.size?"),
    (
      "model.remat",
      "no such field; did you mean --config.model.roles.<role>.remat (<role>: actor, critic, "
      "reference, reward, rollout)?",
    ),
    (
      "ppo.model.attention",  # the stage is kept
      "no such field; did you mean --config.ppo.model.roles.<role>.attention or "
      "--config.ppo.rollout.attention (<role>: actor, critic, reference, reward, rollout)?",
    ),
    ("zzz", "no such field"),
    (
      "sft.rollout.paged",
      "the field was removed: the rollout engine always keeps its KV cache "
      "in pages (a pool of 'rollout.kv_cache_tokens' or 'rollout.kv_memory_fraction'; 0 for "
      "both: every slot at full length, a dense cache's memory); drop the flag",
    ),
  ],
)
def test_an_override_of_no_field_names_what_it_may_have_meant(path, said):
  assert config_lib.unknown_override(path) == said
