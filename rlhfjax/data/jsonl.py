"""Local JSONL files as TFDS datasets (array_record, no TensorFlow), validated line by line.

Three kinds of record, one JSON object per line:

  prompt         {"prompt": str}
  demonstration  {"prompt": str, "response": str}
  preference     {"prompt": str, "chosen": str, "rejected": str}

In any kind a conversation may stand for the prompt: `"messages"` (system, user, assistant and
tool messages as `transformers`' chat templates take them, the last a user's or a tool's) and
optionally `"tools"` (the JSON schemas of the tools the model may call), rendered by the chat
template (`data.chat_template=True`; `rlhfjax.data.tokenizer.Conversation`).

Any other fields of a line are kept as its extra fields (canonical JSON in the 'extra' feature,
with the line number in 'line'): a prompt's extra fields reach the reward function as its
`rlhfjax.data.records.Record` (for example a reference answer).

`prepare` writes the records once with a `tfds.core.GeneratorBasedBuilder` and returns random
access data sources (`builder.as_data_source`) for grain. The builder config is named after the
kind and a hash of the files' content, so an edited file is prepared again and an unchanged one
is read from the cache. Bad records raise a one-line `DataError` naming file:line, or are
skipped and counted per reason; the counts are kept in the prepared dataset's metadata, so a
cached prepare reports them too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import tensorflow_datasets as tfds
from absl import logging as absl_logging

from rlhfjax import workdir
from rlhfjax.data import records
from rlhfjax.data.tokenizer import Conversation

logger = logging.getLogger(__name__)

FIELDS: dict[str, tuple[str, ...]] = {
  "prompt": ("prompt",),
  "demonstration": ("prompt", "response"),
  "preference": ("prompt", "chosen", "rejected"),
}
"""The string fields each kind of record must have ('prompt' or a conversation)."""
CONVERSATION = ("messages", "tools")
"""The fields of a conversation standing for a record's prompt."""

ON_BAD_RECORD = ("error", "skip")
BAD_REASONS = (
  "not_utf8",
  "invalid_json",
  "not_an_object",
  "missing_field",
  "not_a_string",
  "empty_string",
  "same_pair",
  "bad_messages",
)
"""Why a record is bad; the keys of `PreparedDataset.bad_records`. 'same_pair': a preference
whose chosen and rejected texts are equal teaches nothing (its loss is log 2 whatever the
model), so it is refused (or, with on_bad_record='skip', skipped and counted) like any bad
record."""

# 1.1: extra fields and line numbers; 1.2: pairs that cannot be told apart; 1.3: conversations
_VERSION = "1.3.0"


class DataError(ValueError):
  """A dataset is missing, empty or holds a bad record (under on_bad_record='error')."""


class BadRecord(Exception):
  """One line's problem: a reason of `BAD_REASONS` and a human-readable detail."""

  def __init__(self, reason: str, detail: str):
    super().__init__(detail)
    self.reason, self.detail = reason, detail


def parse_line(kind: str, line: bytes) -> dict[str, str] | None:
  """The record of one JSONL line (its kind's fields; 'messages': its conversation as JSON,
  with 'prompt' empty, or empty; and 'extra': the other fields as JSON); None for a blank
  line.

  Raises:
    BadRecord: the line is not UTF-8, not a JSON object, lacks a non-empty string field, or
      holds a number JSON cannot represent (NaN, Infinity).
  """
  try:
    text = line.decode("utf-8")
  except UnicodeDecodeError as e:
    raise BadRecord("not_utf8", f"not valid UTF-8 ({e.reason} at byte {e.start})") from None
  if not text.strip():
    return None
  try:
    value = json.loads(text)
  except json.JSONDecodeError as e:
    raise BadRecord("invalid_json", f"invalid JSON ({e.msg} at column {e.colno})") from None
  if not isinstance(value, dict):
    raise BadRecord("not_an_object", f"expected a JSON object, got {type(value).__name__}")
  record = {"messages": ""}
  if "messages" in value:
    if "prompt" in value:
      raise BadRecord("bad_messages", "give either 'prompt' or 'messages', not both")
    try:
      record["messages"] = Conversation(value["messages"], value.get("tools")).to_json()
    except (ValueError, TypeError, KeyError) as e:
      raise BadRecord("bad_messages", f"field 'messages': {e}") from None
    record["prompt"] = ""
  for field in FIELDS[kind]:
    if field == "prompt" and record["messages"]:
      continue
    if field not in value:
      needs = ", ".join(f if f != "prompt" else "prompt (or messages)" for f in FIELDS[kind])
      raise BadRecord("missing_field", f"missing field {field!r} (a {kind} record needs {needs})")
    if not isinstance(value[field], str):
      got = type(value[field]).__name__
      raise BadRecord("not_a_string", f"field {field!r} must be a string, got {got}")
    if not value[field].strip():
      raise BadRecord("empty_string", f"field {field!r} is empty")
    record[field] = value[field]
  if kind == "preference" and record["chosen"] == record["rejected"]:
    raise BadRecord(
      "same_pair", "fields 'chosen' and 'rejected' are the same text: the pair teaches nothing"
    )
  try:
    known = (*FIELDS[kind], *(CONVERSATION if record["messages"] else ()))
    record["extra"] = records.extra_fields(value, known)
  except ValueError as e:
    raise BadRecord("invalid_json", str(e)) from None
  return record


@dataclasses.dataclass
class BadRecordLog:
  """Bad records seen while reading, per reason, with the first message of each reason."""

  counts: dict[str, int] = dataclasses.field(default_factory=dict)
  first: dict[str, str] = dataclasses.field(default_factory=dict)

  def add(self, reason: str, message: str) -> None:
    self.counts[reason] = self.counts.get(reason, 0) + 1
    self.first.setdefault(reason, message)

  @property
  def total(self) -> int:
    return sum(self.counts.values())


def read_records(
  kind: str, path: str, on_bad_record: str, log: BadRecordLog
) -> Iterator[tuple[int, dict[str, str]]]:
  """(line number, record) of each good line of `path`; bad ones raise or go to `log`.

  Raises:
    DataError: a bad line under on_bad_record='error'.
  """
  with open(path, "rb") as f:
    for number, line in enumerate(f, start=1):
      try:
        record = parse_line(kind, line)
      except BadRecord as e:
        message = f"{path}:{number}: {e.detail}"
        if on_bad_record == "error":
          raise DataError(f"{message} (pass on_bad_record='skip' to skip bad records)") from None
        log.add(e.reason, message)
        continue
      if record is not None:
        yield number, record


def content_hash(paths: Mapping[str, str]) -> str:
  """A short hash of the split names and file contents: the cache key of a prepare."""
  digest = hashlib.sha256()
  for split in sorted(paths):
    digest.update(split.encode() + b"\0")
    with open(paths[split], "rb") as f:
      for chunk in iter(lambda: f.read(1 << 20), b""):
        digest.update(chunk)
    digest.update(b"\0")
  return digest.hexdigest()[:16]


@dataclasses.dataclass(eq=False, kw_only=True)
class JsonlConfig(tfds.core.BuilderConfig):
  """One prepare: the kind of record and the file of each split."""

  kind: str = "prompt"
  paths: tuple[tuple[str, str], ...] = ()
  on_bad_record: str = "error"


class _LocalDatasetInfo(tfds.core.DatasetInfo):
  """The info of local records: there is no published copy to start from."""

  def initialize_from_bucket(self) -> None:
    # TFDS's version makes a temporary directory before it looks for the dataset in its
    # bucket and never removes it: one empty tmp*tfds directory in the system temporary
    # directory per new prepare, thousands a day.
    pass


class JsonlDataset(tfds.core.GeneratorBasedBuilder):
  """Local JSONL files of one kind; every field is a text feature (read back as bytes)."""

  VERSION = tfds.core.Version(_VERSION)
  # No code path: local files have no download checksums to look up beside the module, and
  # TFDS's lookup of it imports `importlib_resources` (absent on Python >= 3.9) for a builder
  # defined inside a package.
  code_path = None

  def _info(self) -> tfds.core.DatasetInfo:
    # DatasetInfo(builder=self) rather than dataset_info_from_configs: the latter looks for
    # metadata files next to this module, which a builder outside the TFDS tree does not have.
    fields = (*FIELDS[self.builder_config.kind], "messages", "extra")
    features = {f: tfds.features.Text() for f in fields}
    features["line"] = tfds.features.Scalar(dtype=np.int64)
    return _LocalDatasetInfo(
      builder=self,
      description=f"Local JSONL {self.builder_config.kind} records.",
      features=tfds.features.FeaturesDict(features),
      metadata=tfds.core.MetadataDict(),
      # Keep file order: evaluation passes and error reports then follow the file.
      disable_shuffling=True,
    )

  def _split_generators(self, dl_manager):
    del dl_manager  # local files only
    log = BadRecordLog()
    self.info.metadata["bad_records"] = log.counts
    self.info.metadata["first_bad_record"] = log.first
    self.info.metadata["conversations"] = {}
    return {split: self._generate_split(path, log) for split, path in self.builder_config.paths}

  def _generate_split(self, path: str, log: BadRecordLog) -> Iterator[tuple[int, dict[str, str]]]:
    config = self.builder_config
    count = 0
    first = self.info.metadata["conversations"]
    for number, record in read_records(config.kind, path, config.on_bad_record, log):
      count += 1
      if record["messages"]:
        conversation = Conversation.from_json(record["messages"])
        roles = {m["role"] for m in conversation.messages}
        for role in (*roles, *(("tools",) if conversation.tools is not None else ())):
          first.setdefault(role, f"{path}:{number}")
      yield number, {**record, "line": number}
    if not count:
      raise DataError(_empty_message(config.kind, path, log))

  def _generate_examples(self):  # splits come from _split_generators
    raise NotImplementedError

  # TFDS prints these two lines in bold on stdout for every prepare; a log line is enough.
  def _log_download_bytes(self) -> None:
    logger.info("preparing %s in %s", self.builder_config.name, self.data_dir)

  def _log_download_done(self) -> None:
    logger.info("prepared %s in %s", self.builder_config.name, self.data_dir)


@contextlib.contextmanager
def _quiet_tfds():
  """No TFDS progress bars, nor its warning that our per-file configs are 'custom' (they are
  meant to be): preparing a few thousand local records is not news."""
  absl_logger = absl_logging.get_absl_logger()
  level = absl_logger.level
  absl_logger.setLevel(logging.ERROR)
  tfds.display_progress_bar(False)
  try:
    yield
  finally:
    tfds.display_progress_bar(True)
    absl_logger.setLevel(level)


def _empty_message(kind: str, path: str, log: BadRecordLog) -> str:
  message = f"{path}: no valid {kind} record"
  if log.total:
    reasons = ", ".join(f"{n} {reason}" for reason, n in sorted(log.counts.items()))
    message += f" (skipped {log.total} bad: {reasons}; first: {next(iter(log.first.values()))})"
  return message


@dataclasses.dataclass(frozen=True)
class PreparedDataset:
  """The prepared splits of one JSONL dataset and what was skipped while preparing them."""

  kind: str
  builder: tfds.core.DatasetBuilder
  bad_records: dict[str, int]
  """Skipped records per reason of `BAD_REASONS` (all files together)."""
  first_bad_record: dict[str, str]
  """The first 'file:line: problem' of each reason, to show the user."""
  paths: dict[str, str] = dataclasses.field(default_factory=dict)
  """The (absolute) file of each split: records name their origin 'file:line' by it."""

  @property
  def splits(self) -> tuple[str, ...]:
    return tuple(self.builder.info.splits)

  def num_examples(self, split: str = "train") -> int:
    return self.builder.info.splits[split].num_examples

  def source(self, split: str = "train") -> Any:
    """A random-access data source (len, getitem) of `split`; slices like 'train[:90%]' work.

    Each example is a dict of the kind's fields and 'extra' (the other fields, JSON) as UTF-8
    `bytes`, and 'line', its line in the file.
    """
    return self.builder.as_data_source(split=split)

  def path(self, split: str = "train") -> str | None:
    """The file `split` (or a slice of it, 'train[:90%]') was read from."""
    return self.paths.get(split.partition("[")[0])


BUNDLED_TASKS = ("vowels", "arithmetic")
_BUNDLED_FILES = {
  "prompt": "prompts.jsonl",
  "demonstration": "demonstrations.jsonl",
  "preference": "preferences.jsonl",
}


def bundled_path(task: str, kind: str) -> str:
  """The JSONL file of a bundled task's `kind` dataset (written by scripts/make_bundled_data.py).

  Raises:
    ValueError: an unknown task or kind.
  """
  if task not in BUNDLED_TASKS:
    raise ValueError(
      f"no bundled data for task {task!r}; bundled tasks: {', '.join(BUNDLED_TASKS)}"
    )
  if kind not in _BUNDLED_FILES:
    raise ValueError(f"unknown dataset kind {kind!r}; known kinds: {', '.join(_BUNDLED_FILES)}")
  path = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "bundled", task, _BUNDLED_FILES[kind]
  )
  if not os.path.isfile(path):
    raise ValueError(f"the bundled task {task!r} has no {kind} data; give a file instead")
  return path


def default_data_dir() -> str:
  """$RLHFJAX_DATA_DIR, or ~/.cache/rlhfjax/datasets: where prepared datasets are cached."""
  return os.environ.get("RLHFJAX_DATA_DIR") or os.path.expanduser("~/.cache/rlhfjax/datasets")


def _check_args(kind: str, paths: Mapping[str, str], on_bad_record: str) -> None:
  if kind not in FIELDS:
    raise ValueError(f"unknown dataset kind {kind!r}; known kinds: {', '.join(FIELDS)}")
  if on_bad_record not in ON_BAD_RECORD:
    raise ValueError(f"on_bad_record must be one of {ON_BAD_RECORD}, got {on_bad_record!r}")
  if not paths:
    raise DataError(f"no {kind} files given")
  for path in paths.values():
    if not os.path.isfile(path):
      raise DataError(f"{path}: no such {kind} file")


def prepare(
  kind: str,
  path: str | os.PathLike | Mapping[str, str | os.PathLike],
  data_dir: str | os.PathLike | None = None,
  on_bad_record: str = "error",
) -> PreparedDataset:
  """Prepares (or reuses) the TFDS array_record dataset of JSONL file(s).

  Args:
    kind: 'prompt', 'demonstration' or 'preference'.
    path: one file (the 'train' split) or a mapping from split name to file.
    data_dir: where prepared datasets are cached; None: `default_data_dir()`.
    on_bad_record: 'error' raises a `DataError` at the first bad line; 'skip' skips and counts.

  Raises:
    DataError: a file is missing or holds no valid record, or a bad record under 'error'
      (also when the cache was prepared with 'skip' and had skipped some).
  """
  if isinstance(path, Mapping):
    paths = {str(split): os.fspath(p) for split, p in path.items()}
  else:
    paths = {"train": os.fspath(path)}
  _check_args(kind, paths, on_bad_record)
  paths = {split: os.path.abspath(p) for split, p in paths.items()}
  # The bad-record policy is not part of the key: under 'error' a prepare succeeds only when
  # nothing is bad, so it writes what 'skip' would; the saved counts tell the two apart.
  config = JsonlConfig(
    name=f"{kind}-{content_hash(paths)}",
    kind=kind,
    paths=tuple(sorted(paths.items())),
    on_bad_record=on_bad_record,
  )
  data_dir = os.fspath(data_dir) if data_dir is not None else default_data_dir()
  # Concurrent preparers (two runs, or processes of a job sharing a disk) take turns: the
  # first writes the dataset, the others then find it complete and reuse it.
  with _quiet_tfds(), workdir.file_lock(os.path.join(data_dir, f".{config.name}.lock")):
    builder = JsonlDataset(config=config, data_dir=data_dir, file_format="array_record")
    builder.download_and_prepare()
  metadata = builder.info.metadata or {}
  counts = {k: int(v) for k, v in metadata.get("bad_records", {}).items() if v}
  first = dict(metadata.get("first_bad_record", {}))
  if counts and on_bad_record == "error":
    raise DataError(
      f"{next(iter(first.values()))} (the cached prepare skipped {sum(counts.values())} bad "
      "records; pass on_bad_record='skip' to accept that)"
    )
  if counts:
    logger.warning(
      "skipped %d bad %s records (%s); first: %s",
      sum(counts.values()),
      kind,
      ", ".join(f"{n} {r}" for r, n in sorted(counts.items())),
      "; ".join(first.values()),
    )
  return PreparedDataset(
    kind=kind,
    builder=builder,
    bad_records=counts,
    first_bad_record=first,
    paths=paths,
  )
