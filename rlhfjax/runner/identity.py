"""What a checkpoint means, so that a resume refuses to read it as something else.

A run's checkpoint holds the states of the roles its flow trained, for the models it built,
on token ids its tokenizer and chat template made. Resuming it under another algorithm or
flow, with other roles, another model architecture, or another tokenizer or template would
mix two runs in one `metrics.jsonl` (or drop a role's state) without a word. The runner saves
`identity(...)` in every checkpoint's meta and `check` compares it at resume: any difference is
one line naming each field with both values. What a resume may change is said in `ALLOWED`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from rlhfjax.config.model import NUMERICS_FIELDS
from rlhfjax.data.tokenizer import ChatTemplate, Tokenizer, encode_prompt_parts

KEY = "identity"
"""Where the identity sits in a checkpoint's meta (absent in checkpoints written before it)."""

ALLOWED = (
  "total_steps, the placement and its devices, optimizer settings, numerics (compute dtype, "
  "remat, attention kernel; not a trained role's param_dtype), evaluation, logging and "
  "checkpoint frequency"
)

_PROBE = "A probe of the tokenizer: The quick brown fox, 0123456789, é, ü, 日本語, 🙂."


def identity(
  cfg: Any, roles: Iterable[str], tokenizer: Tokenizer, template: ChatTemplate | None
) -> dict[str, Any]:
  """The run's meaning as JSON: algorithm, flow, roles, each role's architecture, and the ids
  its tokenizer and template give a probe prompt (paths may move; what they encode may not)."""
  roles = sorted(roles)
  out: dict[str, Any] = {
    "algorithm.name": cfg.algorithm.name,
    "algorithm.flow": cfg.algorithm.flow,
    "roles": roles,
    "tokenizer": {
      "vocab_size": tokenizer.vocab_size,
      "probe": [list(part) for part in encode_prompt_parts(tokenizer, _PROBE, template)],
    },
  }
  for role in roles:
    model = dataclasses.asdict(cfg.model.for_role(role))
    # A resume may change how a model computes, not what it is, nor the precision a trained
    # role's weights and moments are kept in (`model.fp32_masters`).
    kept = ("param_dtype",) if role in cfg.model.trained_roles else ()
    out[f"model.{role}"] = {k: v for k, v in model.items() if k not in NUMERICS_FIELDS or k in kept}
  return _as_json(out)


def _as_json(value: Any) -> Any:
  """Tuples as lists, as the meta comes back from JSON."""
  if isinstance(value, Mapping):
    return {k: _as_json(v) for k, v in value.items()}
  if isinstance(value, list | tuple):
    return [_as_json(v) for v in value]
  return value


def differences(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
  """'field: the checkpoint has X, this run Y' for every field that differs."""
  out = []
  for key in sorted(set(saved) | set(current)):
    old, new = saved.get(key), current.get(key)
    if old == new:
      continue
    if key == "tokenizer":
      out.append(
        "the tokenizer or chat template (data.tokenizer, data.chat_template) encodes prompts "
        "differently from the run that wrote it"
      )
    elif key.startswith("model.") and (old is None or new is None):
      continue  # a role one of the runs does not have: the 'roles' line says so
    elif key.startswith("model.") and isinstance(old, Mapping) and isinstance(new, Mapping):
      # A field an earlier version's checkpoint does not record is not compared.
      fields = sorted(
        f
        for f in set(old) | set(new)
        if old.get(f) != new.get(f) and (f in old or f not in _RECORDED_LATER)
      )
      out += [
        f"{key}.{f}: the checkpoint has {old.get(f)!r}, this run {new.get(f)!r}" for f in fields
      ]
    else:
      out.append(f"{key}: the checkpoint has {old!r}, this run {new!r}")
  return out


def check(meta: Mapping[str, Any], current: Mapping[str, Any], where: str) -> None:
  """Raises `IdentityError` when the checkpoint's meta says it means something else."""
  saved = meta.get(KEY)
  if saved is None:  # written before identities were saved: nothing to compare
    return
  diffs = differences(saved, current)
  if diffs:
    raise IdentityError(
      f"{where} was written by another kind of run, so this one cannot resume it: "
      f"{'; '.join(diffs)}. A resume may change {ALLOWED}; for anything else use another "
      "workdir (or delete this one)"
    )


_RECORDED_LATER = ("param_dtype", "quantization")
"""Model fields an earlier version's checkpoints do not record."""


class IdentityError(ValueError):
  """A checkpoint that another kind of run wrote."""
