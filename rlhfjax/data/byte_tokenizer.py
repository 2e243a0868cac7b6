"""A byte-level tokenizer: ids 0..255 are bytes, then BOS, EOS, PAD and the chat markers.

No files needed, so tests and the bundled task run offline. Plain text always encodes to its
UTF-8 bytes: a marker such as "<|user|>" typed inside a prompt stays bytes, and only a chat
template (`rlhfjax.data.tokenizer.ChatTemplate`) inserts the marker ids, so user text cannot
forge a turn boundary.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

USER_TOKEN = "<|user|>"
ASSISTANT_TOKEN = "<|assistant|>"


@dataclasses.dataclass(frozen=True)
class ByteTokenizer:
  bos_id: int = 256
  eos_id: int = 257
  pad_id: int = 258
  user_id: int = 259
  assistant_id: int = 260

  @property
  def vocab_size(self) -> int:
    return 261

  @property
  def special_tokens(self) -> dict[str, int]:
    """Special token strings by name, for `token_to_id` and chat templates."""
    return {
      "<|bos|>": self.bos_id,
      "<|eos|>": self.eos_id,
      "<|pad|>": self.pad_id,
      USER_TOKEN: self.user_id,
      ASSISTANT_TOKEN: self.assistant_id,
    }

  def fingerprint(self) -> str:
    """Fixed: the byte vocabulary and its specials never change."""
    return f"byte:{self.vocab_size}"

  def token_to_id(self, token: str) -> int | None:
    """Id of a special token string, or None when this tokenizer has no such token."""
    return self.special_tokens.get(token)

  def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
    ids = list(text.encode("utf-8"))
    return [self.bos_id, *ids] if add_bos else ids

  def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
    """Text of the byte ids, invalid UTF-8 replaced; special ids dropped, or with
    `skip_special_tokens=False` written as their names (`<|bos|>`)."""
    names = {} if skip_special_tokens else {i: t for t, i in self.special_tokens.items()}
    out, run = [], bytearray()
    for i in ids:
      if 0 <= i < 256:
        run.append(i)
      elif i in names:
        out += [run.decode("utf-8", errors="replace"), names[i]]
        run = bytearray()
    return "".join([*out, run.decode("utf-8", errors="replace")])
