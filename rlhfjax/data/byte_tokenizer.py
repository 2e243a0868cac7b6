"""A byte-level tokenizer: ids 0..255 are bytes, then BOS, EOS and PAD. No files needed."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable


@dataclasses.dataclass(frozen=True)
class ByteTokenizer:
  bos_id: int = 256
  eos_id: int = 257
  pad_id: int = 258

  @property
  def vocab_size(self) -> int:
    return 259

  def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
    ids = list(text.encode("utf-8"))
    return [self.bos_id, *ids] if add_bos else ids

  def decode(self, ids: Iterable[int]) -> str:
    """Text of the byte ids; special ids are dropped, invalid UTF-8 is replaced."""
    return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")
