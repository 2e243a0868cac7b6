"""Prompt records: the extra JSON fields of a prompt line, carried to the reward function.

A prompt line may hold any fields beside "prompt" (`{"prompt": "37+48=", "answer": "85"}`).
They travel with the prompt's tokens (`PromptBatch`) through generation, so a rule reward sees
them as `metadata["records"][i]`: one `Record` per response, in the order of the responses,
each sample of a group getting its prompt's record. A `Record` is a dict of the extra fields
that knows its origin (`prompts.jsonl:7`): reading a field it lacks raises a `RecordFieldError`
that names the file, the line and the field.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any


class RecordFieldError(KeyError):
  """A field a reward function reads is missing from a prompt record, or has the wrong type."""

  def __str__(self) -> str:  # KeyError would print the repr of the message
    return str(self.args[0])


class Record(dict):
  """The extra fields of one prompt record; `origin` is its 'file:line'."""

  def __init__(self, fields: Mapping[str, Any] = (), origin: str = "?"):
    super().__init__(fields)
    self.origin = origin

  def __missing__(self, key: str):
    have = ", ".join(sorted(self)) or "none"
    raise RecordFieldError(
      f"{self.origin}: the prompt record has no field {key!r} (its extra fields: {have})"
    )

  def require(self, key: str, *types: type) -> Any:
    """`self[key]`, checked to be one of `types` (bool is not an int here)."""
    value = self[key]
    if types and (not isinstance(value, types) or (isinstance(value, bool) and bool not in types)):
      want = " or ".join(t.__name__ for t in types)
      raise RecordFieldError(
        f"{self.origin}: field {key!r} of the prompt record must be {want}, "
        f"got {type(value).__name__} {json.dumps(value)}"
      )
    return value

  def __reduce__(self):  # keep the origin through pickling (dict's own reduce drops it)
    return (Record, (dict(self), self.origin))

  def __repr__(self) -> str:
    return f"Record({dict.__repr__(self)}, origin={self.origin!r})"


def extra_fields(value: dict[str, Any], known: Sequence[str]) -> str:
  """The fields of a parsed line beside `known`, as canonical JSON (what a dataset stores).

  Raises:
    ValueError: a field holds NaN or an infinity, which JSON cannot represent.
  """
  extra = {k: v for k, v in value.items() if k not in known}
  try:
    return json.dumps(extra, sort_keys=True, allow_nan=False, ensure_ascii=False)
  except ValueError:
    bad = [k for k, v in extra.items() if _has_non_finite(v)]
    raise ValueError(
      f"field {bad[0] if bad else '?'!r} holds NaN or an infinity, which is not JSON"
    ) from None


def _has_non_finite(v: Any) -> bool:
  if isinstance(v, float):
    return v != v or v in (float("inf"), float("-inf"))
  if isinstance(v, dict):
    return any(_has_non_finite(x) for x in v.values())
  if isinstance(v, list):
    return any(_has_non_finite(x) for x in v)
  return False


def _text(value: bytes | str) -> str:
  return value.decode("utf-8") if isinstance(value, bytes) else value


def record_of(example: Mapping[str, Any], index: int, path: str | None) -> Record:
  """The `Record` of a dataset example (its stored 'extra' JSON and 'line'); an in-memory
  example without them has no extra fields and is named by its index."""
  line = example.get("line")
  origin = f"{path or 'record'}:{int(line)}" if line is not None else f"record {index}"
  extra = example.get("extra")
  return Record(json.loads(_text(extra)) if extra else {}, origin)


@dataclasses.dataclass(frozen=True)
class PromptBatch:
  """Prompts (token ids, BOS first) and their records, row for row."""

  tokens: list[list[int]]
  records: list[Record]

  def __post_init__(self):
    if len(self.tokens) != len(self.records):
      raise ValueError(f"{len(self.tokens)} prompts but {len(self.records)} records")

  def __len__(self) -> int:
    return len(self.tokens)

  @classmethod
  def of(cls, prompts: PromptBatch | Sequence[Sequence[int]]) -> PromptBatch:
    """`prompts` as a batch; bare token lists get records with no fields."""
    if isinstance(prompts, PromptBatch):
      return prompts
    tokens = [list(p) for p in prompts]
    return cls(tokens, [Record({}, f"prompt {i}") for i in range(len(tokens))])

  def rows(self, indices: Sequence[int]) -> PromptBatch:
    """The given rows, in order (repeats allowed)."""
    return PromptBatch([self.tokens[i] for i in indices], [self.records[i] for i in indices])

  def repeat(self, k: int) -> PromptBatch:
    """Each prompt `k` times in a row: the prompts of groups of `k` samples."""
    return self.rows([i for i in range(len(self)) for _ in range(k)])

  def to_json(self) -> dict[str, Any]:
    """A JSON-serialisable form (a checkpoint's meta holds a pending batch)."""
    return {
      "tokens": [list(map(int, p)) for p in self.tokens],
      "records": [{"fields": dict(r), "origin": r.origin} for r in self.records],
    }

  @classmethod
  def from_json(cls, value: dict[str, Any] | list[list[int]]) -> PromptBatch:
    """Inverse of `to_json`; a bare list of token lists (older checkpoints) also works."""
    if isinstance(value, list):
      return cls.of(value)
    return cls(
      [list(p) for p in value["tokens"]],
      [Record(r["fields"], r["origin"]) for r in value["records"]],
    )
