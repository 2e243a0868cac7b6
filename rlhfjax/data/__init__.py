"""Tokenizers, local JSONL datasets (TFDS array_record, no TensorFlow) and grain pipelines.

Names are imported on first use: `from rlhfjax.data.byte_tokenizer import ByteTokenizer` (the
tasks and trainers do) then does not pay for importing grain and TFDS (seconds).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
  "ByteTokenizer": "byte_tokenizer",
  "BAD_REASONS": "jsonl",
  "BUNDLED_TASKS": "jsonl",
  "ON_BAD_RECORD": "jsonl",
  "DataError": "jsonl",
  "PreparedDataset": "jsonl",
  "bundled_path": "jsonl",
  "default_data_dir": "jsonl",
  "prepare": "jsonl",
  "ON_LONG_PROMPT": "pipeline",
  "BatchIterator": "pipeline",
  "PromptIterator": "pipeline",
  "preference_batches": "pipeline",
  "prompt_iterator": "pipeline",
  "sft_batches": "pipeline",
  "PromptBatch": "records",
  "Record": "records",
  "RecordFieldError": "records",
  "ChatTemplate": "tokenizer",
  "HFTokenizer": "tokenizer",
  "Tokenizer": "tokenizer",
  "load_tokenizer": "tokenizer",
}
__all__ = [
  "BAD_REASONS",
  "BUNDLED_TASKS",
  "ON_BAD_RECORD",
  "ON_LONG_PROMPT",
  "BatchIterator",
  "ByteTokenizer",
  "ChatTemplate",
  "DataError",
  "HFTokenizer",
  "PreparedDataset",
  "PromptBatch",
  "PromptIterator",
  "Record",
  "RecordFieldError",
  "Tokenizer",
  "bundled_path",
  "default_data_dir",
  "load_tokenizer",
  "preference_batches",
  "prepare",
  "prompt_iterator",
  "sft_batches",
]

if TYPE_CHECKING:
  from rlhfjax.data.byte_tokenizer import ByteTokenizer
  from rlhfjax.data.jsonl import (
    BAD_REASONS,
    BUNDLED_TASKS,
    ON_BAD_RECORD,
    DataError,
    PreparedDataset,
    bundled_path,
    default_data_dir,
    prepare,
  )
  from rlhfjax.data.pipeline import (
    ON_LONG_PROMPT,
    BatchIterator,
    PromptIterator,
    preference_batches,
    prompt_iterator,
    sft_batches,
  )
  from rlhfjax.data.records import PromptBatch, Record, RecordFieldError
  from rlhfjax.data.tokenizer import ChatTemplate, HFTokenizer, Tokenizer, load_tokenizer


def __getattr__(name: str):
  if name not in _EXPORTS:
    raise AttributeError(f"module 'rlhfjax.data' has no attribute {name!r}")
  return getattr(importlib.import_module(f"rlhfjax.data.{_EXPORTS[name]}"), name)


def __dir__() -> list[str]:
  return __all__
