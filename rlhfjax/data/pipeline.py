"""grain pipelines over prepared data sources: prompts for PPO, SFT and preference batches.

Each pipeline is a `grain.MapDataset`: tokenize (with the source index, for error messages),
then for training a seeded shuffle that is redrawn every epoch and endless repetition; for
evaluation one pass in file order. A thin iterator on top applies the long-sequence policy,
counts what it truncated or skipped, and assembles fixed-shape NumPy batches, so a batch never
changes shape (no recompiles) and bad lengths never reach JAX.

Long sequences (`on_long_prompt`):
  'truncate'  the prompt text is cut from the left (its end is what the response continues),
              keeping BOS and the chat markers (a conversation: its last message's text is cut,
              the earlier turns kept); a response is cut only when an empty prompt text still
              does not leave room (it then has no EOS);
  'skip'      the example is dropped and counted;
  'error'     a `DataError` names the record.

`get_state()` is a JSON-serialisable dict (the grain iterator's position plus the counts);
`set_state()` on a fresh iterator of the same pipeline continues with exactly the examples the
uninterrupted iterator would have produced.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import grain
import numpy as np
import tqdm

from rlhfjax.data.jsonl import DataError
from rlhfjax.data.records import PromptBatch, Record, record_of
from rlhfjax.data.tokenizer import (
  NEEDS_TEMPLATE,
  ChatTemplate,
  Conversation,
  Tokenizer,
  encode_prompt,
  encode_prompt_parts,
)

logger = logging.getLogger(__name__)

ON_LONG_PROMPT = ("truncate", "skip", "error")

# Tokenizing runs ahead of the consumer in a few threads; grain keeps the order and its
# iterator state counts only what was consumed, so prefetching does not change a resume.
_READ_OPTIONS = grain.ReadOptions(num_threads=4, prefetch_buffer_size=256)
_STATE_VERSION = 1


class Encoded(NamedTuple):
  """One tokenized example, before batching.

  `status` is 'ok', 'truncated' or 'too_long' (to be skipped, or raised under 'error');
  `parts` is (prompt,) for prompts, (prompt, response) for SFT and (prompt, chosen, rejected)
  for preferences, each a token list; a response ends with EOS unless it was cut. `record`
  holds the example's extra fields (prompts only).
  """

  index: int
  status: str
  length: int
  parts: tuple[list[int], ...]
  record: Record | None = None


def fit_to_length(
  head: list[int], body: list[int], tail: list[int], responses: Sequence[list[int]], max_len: int
) -> tuple[list[int], list[list[int]]] | None:
  """Cuts a prompt (head + body + tail) and its responses so each sequence fits `max_len`.

  The body loses tokens from its start first; then each response loses tokens from its end.
  Returns (prompt, responses), or None when even an empty body leaves no room for the head,
  the tail and one token of every response.
  """
  fixed = len(head) + len(tail)
  longest = max((len(r) for r in responses), default=0)
  keep = max_len - fixed - longest
  if keep >= 0:
    return head + body[len(body) - min(keep, len(body)) :] + tail, list(responses)
  room = max_len - fixed
  if room < (1 if responses else 0):
    return None
  return head + tail, [r[:room] for r in responses]


def _text(value: bytes | str) -> str:
  """TFDS text features come back as bytes; in-memory sources may hold str."""
  return value.decode("utf-8") if isinstance(value, bytes) else value


def prompt_of(record: dict[str, Any]) -> str | Conversation:
  """A dataset example's prompt: its text, or the conversation its 'messages' holds."""
  messages = _text(record.get("messages") or "")
  return Conversation.from_json(messages) if messages else _text(record["prompt"])


def encode_example(
  index: int,
  record: dict[str, Any],
  *,
  tokenizer: Tokenizer,
  response_fields: tuple[str, ...],
  max_len: int,
  on_long_prompt: str,
  chat_template: ChatTemplate | None,
  origin: str | None = None,
) -> Encoded:
  """Tokenizes one record (prompt plus each of `response_fields`) and fits it to `max_len`.

  `origin` (the file of the source) given: the record's extra fields come along as a `Record`
  named 'file:line'. A record whose 'messages' holds a conversation is that conversation's
  prompt (`Conversation`); it needs a chat template.

  Raises:
    DataError: a conversation without a chat template, or one the template cannot render.
  """
  extra = record_of(record, index, origin) if origin is not None else None
  text = prompt_of(record)
  try:
    prompt = encode_prompt(tokenizer, text, chat_template)
  except ValueError as e:
    where = extra.origin if extra is not None else f"record {index}"
    raise DataError(f"{where}: {e}") from None
  responses = [
    tokenizer.encode(_text(record[f]), add_bos=False) + [tokenizer.eos_id] for f in response_fields
  ]
  length = len(prompt) + max((len(r) for r in responses), default=0)
  if length <= max_len:
    return Encoded(index, "ok", length, (prompt, *responses), extra)
  fitted = fit_to_length(*encode_prompt_parts(tokenizer, text, chat_template), responses, max_len)
  if on_long_prompt != "truncate" or fitted is None:
    return Encoded(index, "too_long", length, (), extra)
  return Encoded(index, "truncated", length, (fitted[0], *fitted[1]), extra)


def _shuffle_seed(seed: int) -> int:
  """A 32-bit grain seed from any int; hashing keeps seed s+1 from replaying s's next epoch
  (grain reshuffles epoch e with seed + e)."""
  return int(np.random.SeedSequence(seed).generate_state(1)[0])


def _dataset(source: Sequence, encode: Callable, *, seed: int, repeat: bool) -> grain.MapDataset:
  ds = grain.MapDataset.source(source).map_with_index(encode)
  if repeat:
    ds = ds.shuffle(seed=_shuffle_seed(seed)).repeat()
  return ds


_SHOW_CHECK_FROM = 20_000
"""Records from which the start-up length check shows its progress (stderr)."""


_CHECKS = "length_checks.json"
"""Beside a prepared dataset (`rlhfjax.data.jsonl`): the length checks it passed."""


def _check_key(source: Sequence, encode: Callable) -> tuple[str, str] | None:
  """Where a passed length check of `source` under `encode` is recorded, and its key: the
  prepared dataset's directory (named by its files' contents) and a hash of the split, the
  tokenizer, the chat template and the lengths. None for a source that is not a prepared
  dataset, or an `encode` that is not `encode_example`'s."""
  info = getattr(source, "dataset_info", None)
  if info is None or not isinstance(encode, functools.partial):
    return None
  if encode.func is not encode_example:
    return None
  kw = dict(encode.keywords)
  tokenizer, template = kw.pop("tokenizer"), kw.pop("chat_template")
  kw.pop("origin", None)
  fingerprint = getattr(tokenizer, "fingerprint", None)
  if fingerprint is None:
    return None
  what = json.dumps(
    [str(getattr(source, "split", "")), fingerprint(), repr(template), sorted(kw.items())]
  )
  return os.path.join(info.data_dir, _CHECKS), hashlib.sha256(what.encode()).hexdigest()[:16]


def _passes(path: str) -> dict[str, int]:
  """The keys of the checks recorded in `path` (and their record counts); {} if none."""
  with contextlib.suppress(OSError, ValueError), open(path, encoding="utf-8") as f:
    return dict(json.load(f))
  return {}


def _record_pass(where: tuple[str, str], records: int) -> None:
  """Adds the key to the file (written whole, then renamed: processes and runs that check at
  once each leave a complete file)."""
  path, key = where
  passed = {**_passes(path), key: records}
  with contextlib.suppress(OSError):  # a read-only data dir: the next run checks again
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
      json.dump(passed, f)
    os.replace(tmp, path)


def _check_conversations(source: Sequence, encode: Callable) -> None:
  """The conversations of a prepared dataset (its metadata names the first record of each role
  and of tools) against the chat template, when the stream is built: a conversation without a
  template, or a system or tool message in the built-in format, stops the run at its start.

  Raises:
    DataError: naming the first such record.
  """
  info = getattr(source, "dataset_info", None)
  first = dict((info.metadata or {}).get("conversations", {})) if info is not None else {}
  if not first or not isinstance(encode, functools.partial) or encode.func is not encode_example:
    return
  template = encode.keywords.get("chat_template")
  if template is None:
    raise DataError(f"{min(first.values(), key=_line)}: {NEEDS_TEMPLATE}")
  if isinstance(template, ChatTemplate) and (problem := template.refuses(first)) is not None:
    refused = [where for role, where in first.items() if role not in ("user", "assistant")]
    raise DataError(f"{min(refused, key=_line)}: {problem}")


def _line(origin: str) -> tuple[str, int]:
  """'file:line' in file order."""
  path, _, line = origin.rpartition(":")
  return path, int(line) if line.isdigit() else 0


def _check_lengths(source: Sequence, encode: Callable[[int, Any], Encoded], max_len: int) -> None:
  """With on_long_prompt='error': every record checked when the stream is built, in one pass,
  so a record too long at line 900,000 stops the run at its start, not hours into it. A pass
  is recorded beside a prepared dataset (`_check_key`): a resume, or another run with the same
  files, tokenizer, template and lengths, does not scan again.

  Raises:
    DataError: the first record too long, named.
  """
  where = _check_key(source, encode)
  if where is not None and where[1] in _passes(where[0]):
    return
  records = grain.MapDataset.source(source).map_with_index(encode).to_iter_dataset(_READ_OPTIONS)
  shown = len(source) >= _SHOW_CHECK_FROM
  with tqdm.tqdm(total=len(source), desc="checking lengths", disable=not shown) as bar:
    for example in records:
      bar.update()
      if example.status == "too_long":
        where = example.record.origin if example.record is not None else f"record {example.index}"
        raise DataError(
          f"{where}: {example.length} tokens > max {max_len} (on_long_prompt='error', checked "
          f"over all {len(source)} records at start; set it to 'truncate' or 'skip')"
        )
  if where is not None:
    _record_pass(where, len(source))


class _Stream:
  """Encoded examples from grain, with the long-sequence policy applied and counted."""

  _pipeline = "stream"

  def __init__(
    self,
    source: Sequence,
    encode: Callable[[int, Any], Encoded],
    *,
    max_len: int,
    seed: int,
    repeat: bool,
    on_long_prompt: str,
  ):
    if on_long_prompt not in ON_LONG_PROMPT:
      raise ValueError(f"on_long_prompt must be one of {ON_LONG_PROMPT}, got {on_long_prompt!r}")
    if max_len < 1:
      raise ValueError(f"the maximum length must be >= 1, got {max_len}")
    self._num_records = len(source)
    if not self._num_records:
      raise DataError("the dataset is empty: no record to iterate over")
    self._max_len, self._seed, self._repeat = max_len, seed, repeat
    self._on_long = on_long_prompt
    _check_conversations(source, encode)
    if on_long_prompt == "error":
      _check_lengths(source, encode, max_len)
    self._dataset = _dataset(source, encode, seed=seed, repeat=repeat)
    self._iter = iter(self._dataset.to_iter_dataset(_READ_OPTIONS))
    self.stats: dict[str, int] = {"records": 0, "truncated": 0, "skipped_too_long": 0}
    """Records read, and of those the ones truncated or skipped as too long."""

  def __iter__(self):
    return self

  def _next_example(self) -> Encoded:
    skipped_in_a_row = 0
    while True:
      example = next(self._iter)  # StopIteration ends an evaluation pass
      self.stats["records"] += 1
      if example.status == "ok":
        return example
      what = f"record {example.index}: {example.length} tokens > max {self._max_len}"
      if example.status == "truncated":
        self.stats["truncated"] += 1
        if self.stats["truncated"] == 1:
          logger.warning("truncating long examples (first: %s); counted in stats", what)
        return example
      if self._on_long == "error":
        raise DataError(f"{what} (set on_long_prompt to 'truncate' or 'skip')")
      self.stats["skipped_too_long"] += 1
      if self.stats["skipped_too_long"] == 1:
        logger.warning("skipping long examples (first: %s); counted in stats", what)
      skipped_in_a_row += 1
      if skipped_in_a_row >= self._num_records:  # a repeating stream would spin forever
        raise DataError(
          f"all {self._num_records} records are too long for max {self._max_len} tokens"
        )

  def get_state(self) -> dict[str, Any]:
    """A JSON-serialisable snapshot: the grain position, the counts and what they belong to."""
    return {
      "version": _STATE_VERSION,
      "pipeline": self._pipeline,
      "num_records": self._num_records,
      "seed": self._seed,
      "grain": self._iter.get_state(),
      "stats": dict(self.stats),
    }

  def set_state(self, state: dict[str, Any]) -> None:
    """Continues from `get_state()` of an iterator over the same data, seed and pipeline."""
    mine = self.get_state()
    for key in ("version", "pipeline", "num_records", "seed"):
      if state.get(key) != mine[key]:
        raise ValueError(
          f"cannot restore the {self._pipeline} iterator: the state's {key} is "
          f"{state.get(key)!r}, this iterator's is {mine[key]!r}"
        )
    self._iter.set_state(state["grain"])
    self.stats = {k: int(v) for k, v in state["stats"].items()}


class PromptIterator(_Stream):
  """Tokenized prompts, one `list[int]` per `next()`; `take(n)` for a PPO batch, `take_batch(n)`
  for one with the prompts' records."""

  _pipeline = "prompt"

  def __next__(self) -> list[int]:
    return self._next_example().parts[0]

  def take(self, n: int) -> list[list[int]]:
    return [next(self) for _ in range(n)]

  def take_batch(self, n: int, *, allow_fewer: bool = False) -> PromptBatch:
    """The next `n` prompts and their records (`allow_fewer`: an evaluation pass may end
    before `n`)."""
    tokens, records = [], []
    for _ in range(n):
      try:
        example = self._next_example()
      except StopIteration:
        if not allow_fewer:
          raise
        break
      tokens.append(example.parts[0])
      record = example.record
      records.append(record if record is not None else Record({}, f"record {example.index}"))
    return PromptBatch(tokens, records)


class BatchIterator(_Stream):
  """Fixed-shape dicts of NumPy arrays; an evaluation pass pads its last batch with empty rows."""

  def __init__(self, source, encode, *, batch_size: int, collate: Callable, pipeline: str, **kw):
    if batch_size < 1:
      raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    self._pipeline = pipeline
    super().__init__(source, encode, **kw)
    self._batch_size, self._collate = batch_size, collate

  def __next__(self) -> dict[str, np.ndarray]:
    rows = []
    for _ in range(self._batch_size):
      try:
        rows.append(self._next_example().parts)
      except StopIteration:
        break
    if not rows:
      raise StopIteration
    return self._collate(rows, self._batch_size, self._max_len)


def _pack(
  sequences: Sequence[tuple[list[int], list[int]]], batch_size: int, max_len: int, pad_id: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Right-padded (tokens, attention mask, loss mask) of (prompt, response) rows."""
  tokens = np.full((batch_size, max_len), pad_id, np.int32)
  mask = np.zeros((batch_size, max_len), np.int32)
  loss_mask = np.zeros((batch_size, max_len), np.float32)
  for i, (prompt, response) in enumerate(sequences):
    n = len(prompt) + len(response)
    tokens[i, :n] = prompt + response
    mask[i, :n] = 1
    loss_mask[i, len(prompt) : n] = 1.0
  return tokens, mask, loss_mask


def _valid(rows: int, batch_size: int) -> np.ndarray:
  return (np.arange(batch_size) < rows).astype(np.float32)


def collate_sft(rows, batch_size: int, max_len: int, *, pad_id: int) -> dict[str, np.ndarray]:
  tokens, mask, loss_mask = _pack(rows, batch_size, max_len, pad_id)
  return {
    "tokens": tokens,
    "attention_mask": mask,
    "loss_mask": loss_mask,
    "valid": _valid(len(rows), batch_size),
  }


def collate_preference(
  rows, batch_size: int, max_len: int, *, pad_id: int
) -> dict[str, np.ndarray]:
  chosen = _pack([(p, c) for p, c, _ in rows], batch_size, max_len, pad_id)
  rejected = _pack([(p, r) for p, _, r in rows], batch_size, max_len, pad_id)
  return {
    "chosen_tokens": chosen[0],
    "chosen_mask": chosen[1],
    "chosen_loss_mask": chosen[2],
    "rejected_tokens": rejected[0],
    "rejected_mask": rejected[1],
    "rejected_loss_mask": rejected[2],
    "valid": _valid(len(rows), batch_size),
  }


def prompt_iterator(
  source: Sequence,
  tokenizer: Tokenizer,
  *,
  max_prompt_len: int,
  seed: int,
  on_long_prompt: str = "truncate",
  chat_template: ChatTemplate | None = None,
  repeat: bool = True,
  origin: str = "",
) -> PromptIterator:
  """Prompts (BOS first) of a 'prompt' source: shuffled and endless, or one pass in order.

  Any record with a 'prompt' field works, so demonstration and preference sources serve too.
  `origin` is the source's file (`PreparedDataset.path`): each prompt's `Record` is named
  'origin:line'.
  """
  encode = functools.partial(
    encode_example,
    tokenizer=tokenizer,
    response_fields=(),
    max_len=max_prompt_len,
    on_long_prompt=on_long_prompt,
    chat_template=chat_template,
    origin=origin,
  )
  return PromptIterator(
    source,
    encode,
    max_len=max_prompt_len,
    seed=seed,
    repeat=repeat,
    on_long_prompt=on_long_prompt,
  )


def _batches(
  source: Sequence,
  tokenizer: Tokenizer,
  *,
  response_fields: tuple[str, ...],
  collate: Callable,
  pipeline: str,
  batch_size: int,
  max_len: int,
  seed: int,
  repeat: bool,
  on_long_prompt: str,
  chat_template: ChatTemplate | None,
) -> BatchIterator:
  """Fixed-shape batches of prompt + responses: what SFT and preference batches share."""
  return BatchIterator(
    source,
    functools.partial(
      encode_example,
      tokenizer=tokenizer,
      response_fields=response_fields,
      max_len=max_len,
      on_long_prompt=on_long_prompt,
      chat_template=chat_template,
    ),
    batch_size=batch_size,
    collate=functools.partial(collate, pad_id=tokenizer.pad_id),
    pipeline=pipeline,
    max_len=max_len,
    seed=seed,
    repeat=repeat,
    on_long_prompt=on_long_prompt,
  )


def sft_batches(
  source: Sequence,
  tokenizer: Tokenizer,
  *,
  batch_size: int,
  max_len: int,
  seed: int,
  repeat: bool = True,
  on_long_prompt: str = "truncate",
  chat_template: ChatTemplate | None = None,
) -> BatchIterator:
  """Batches of a 'demonstration' source: prompt + response + EOS, right-padded to `max_len`.

  Each batch: `tokens`, `attention_mask` int32 [b, L] (1 on real tokens); `loss_mask` float32
  [b, L], 1 where the token in that column is a response token (or the final EOS) to predict,
  i.e. the logits of column t - 1 are scored against it; `valid` float32 [b], 0 on the padding
  rows of an evaluation pass's last batch.
  """
  return _batches(
    source,
    tokenizer,
    response_fields=("response",),
    collate=collate_sft,
    pipeline="sft",
    batch_size=batch_size,
    max_len=max_len,
    seed=seed,
    repeat=repeat,
    on_long_prompt=on_long_prompt,
    chat_template=chat_template,
  )


def preference_batches(
  source: Sequence,
  tokenizer: Tokenizer,
  *,
  batch_size: int,
  max_len: int,
  seed: int,
  repeat: bool = True,
  on_long_prompt: str = "truncate",
  chat_template: ChatTemplate | None = None,
) -> BatchIterator:
  """Batches of a 'preference' source: the chosen and rejected sequences of each prompt.

  Each batch: `chosen_tokens`, `chosen_mask`, `rejected_tokens`, `rejected_mask` int32 [b, L]
  (prompt + response + EOS, right-padded; the mask is 1 on real tokens), `chosen_loss_mask`,
  `rejected_loss_mask` float32 [b, L] (1 on response tokens and EOS, for DPO-style losses) and
  `valid` float32 [b]. Both sequences of a row share the same (possibly truncated) prompt.
  """
  return _batches(
    source,
    tokenizer,
    response_fields=("chosen", "rejected"),
    collate=collate_preference,
    pipeline="preference",
    batch_size=batch_size,
    max_len=max_len,
    seed=seed,
    repeat=repeat,
    on_long_prompt=on_long_prompt,
    chat_template=chat_template,
  )
