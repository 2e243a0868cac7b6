"""Tokenizers behind one small protocol, conversations, and a minimal chat template.

Two kinds: the built-in byte-level tokenizer (no files, the default task's) and a Hugging Face
`tokenizer.json` read by the `tokenizers` library. The pipelines only need encode/decode and the
BOS, EOS and PAD ids, so anything with those methods works.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

import tokenizers

from rlhfjax.data.byte_tokenizer import ASSISTANT_TOKEN, USER_TOKEN, ByteTokenizer

# Names tried, in order, when a tokenizer.json does not say which of its special tokens is which
# (Llama, Mistral, Gemma, GPT-2 and BERT spellings).
_BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>", "<|bos|>", "[CLS]", "<|endoftext|>")
_EOS_NAMES = ("</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "[SEP]", "<|endoftext|>")
_PAD_NAMES = ("<pad>", "[PAD]", "<|pad|>", "<|finetune_right_pad_id|>")


@runtime_checkable
class Tokenizer(Protocol):
  """What the data pipelines and trainers need from a tokenizer."""

  @property
  def bos_id(self) -> int: ...

  @property
  def eos_id(self) -> int: ...

  @property
  def pad_id(self) -> int: ...

  @property
  def vocab_size(self) -> int: ...

  def encode(self, text: str, *, add_bos: bool = True) -> list[int]: ...

  def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
    """Text of the ids; `skip_special_tokens=False` keeps the special tokens (BOS, a chat
    template's markers) as their names: what the model was given."""
    ...

  def token_to_id(self, token: str) -> int | None:
    """Id of a special (or any single) token string; None when the vocabulary lacks it."""
    ...

  def fingerprint(self) -> str:
    """A hash of everything that decides the ids of a text (what a cached check keys on)."""
    ...


class HFTokenizer:
  """A Hugging Face `tokenizer.json`, read with the `tokenizers` library.

  `encode` never adds the file's own post-processor specials (BERT's [CLS] ... [SEP], Llama's
  <s>): BOS is added here when asked, so both tokenizers put exactly one BOS first.
  """

  def __init__(
    self,
    tokenizer: tokenizers.Tokenizer,
    *,
    bos_token: str | None = None,
    eos_token: str | None = None,
    pad_token: str | None = None,
    name: str = "tokenizer",
  ):
    self._tok = tokenizer
    self.name = name
    self.bos_id = self._special_id("BOS", bos_token, _BOS_NAMES)
    self.eos_id = self._special_id("EOS", eos_token, _EOS_NAMES)
    # Many decoder-only vocabularies have no pad token; padded positions are masked out anyway,
    # so EOS is a safe stand-in.
    pad = self._find(pad_token, _PAD_NAMES)
    self.pad_id = self.eos_id if pad is None else pad

  @classmethod
  def from_file(cls, path: str | os.PathLike, **special_tokens: str | None) -> HFTokenizer:
    """Reads a tokenizer.json; `bos_token=`, `eos_token=`, `pad_token=` name its specials."""
    path = os.fspath(path)
    try:
      tok = tokenizers.Tokenizer.from_file(path)
    except Exception as e:  # the Rust library raises bare Exceptions for parse errors
      raise ValueError(f"cannot read Hugging Face tokenizer {path!r}: {e}") from None
    return cls(tok, name=path, **special_tokens)

  def _find(self, token: str | None, candidates: Sequence[str]) -> int | None:
    names = (token,) if token is not None else candidates
    for name in names:
      token_id = self._tok.token_to_id(name)
      if token_id is not None:
        return token_id
    return None

  def _special_id(self, what: str, token: str | None, candidates: Sequence[str]) -> int:
    token_id = self._find(token, candidates)
    if token_id is None:
      tried = repr(token) if token is not None else ", ".join(candidates)
      raise ValueError(
        f"{self.name}: no {what} token in the vocabulary (tried {tried}); name it with "
        f"{what.lower()}_token=... or in tokenizer_config.json"
      )
    return token_id

  @property
  def vocab_size(self) -> int:
    return self._tok.get_vocab_size(with_added_tokens=True)

  def token_to_id(self, token: str) -> int | None:
    return self._tok.token_to_id(token)

  def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
    ids = self._tok.encode(text, add_special_tokens=False).ids
    return [self.bos_id, *ids] if add_bos else ids

  def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
    """Text of the ids; special tokens dropped unless `skip_special_tokens=False`."""
    return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

  @functools.cache  # noqa: B019 - one tokenizer per run, kept alive by it anyway
  def fingerprint(self) -> str:
    """A hash of the tokenizer.json as read and the special ids chosen."""
    digest = hashlib.sha256(self._tok.to_str().encode())
    digest.update(f"{self.bos_id},{self.eos_id},{self.pad_id}".encode())
    return digest.hexdigest()[:16]


def _config_specials(directory: str) -> dict[str, str]:
  """bos/eos/pad token names from a tokenizer_config.json beside the tokenizer, if any."""
  path = os.path.join(directory, "tokenizer_config.json")
  if not os.path.isfile(path):
    return {}
  with open(path, encoding="utf-8") as f:
    config = json.load(f)
  out = {}
  for key in ("bos_token", "eos_token", "pad_token"):
    value = config.get(key)
    if isinstance(value, dict):  # AddedToken serialised as {"content": ...}
      value = value.get("content")
    if isinstance(value, str):
      out[key] = value
  return out


def load_tokenizer(spec: str) -> Tokenizer:
  """'byte', a tokenizer.json path, or a directory holding tokenizer.json (and maybe its config).

  Raises:
    ValueError: `spec` is none of these.
  """
  if spec == "byte":
    return ByteTokenizer()
  path = os.path.expanduser(spec)
  if os.path.isdir(path):
    file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(file):
      raise ValueError(f"tokenizer directory {spec!r} holds no tokenizer.json")
    return HFTokenizer.from_file(file, **_config_specials(path))
  if os.path.isfile(path):
    return HFTokenizer.from_file(path, **_config_specials(os.path.dirname(path) or "."))
  raise ValueError(
    f"unknown tokenizer {spec!r}: expected 'byte', a tokenizer.json file or a directory holding one"
  )


ROLES = ("system", "user", "assistant", "tool")
"""The roles a conversation's messages may have."""


@dataclasses.dataclass(frozen=True)
class Conversation:
  """A prompt as a conversation: `messages` (dicts with 'role' and 'content', an assistant's
  also 'tool_calls', a tool's 'name' or 'tool_call_id', as `transformers` takes them), the last
  one a user's or a tool's (the model answers next), and the `tools` the model may call (JSON
  schemas, or None). Checked on construction (`ValueError` naming the message)."""

  messages: tuple[dict[str, Any], ...]
  tools: tuple[dict[str, Any], ...] | None = None

  def __post_init__(self):
    messages = self.messages
    if not isinstance(messages, list | tuple) or not messages:
      raise ValueError("field 'messages' must be a non-empty list of messages")
    for i, message in enumerate(messages):
      where = f"message {i}"
      if not isinstance(message, dict):
        raise ValueError(f"{where} must be an object, got {type(message).__name__}")
      role = message.get("role")
      if role not in ROLES:
        raise ValueError(f"{where}: role {role!r} is not one of {', '.join(ROLES)}")
      content = message.get("content")
      calls = message.get("tool_calls")
      if calls is not None and (role != "assistant" or not isinstance(calls, list)):
        raise ValueError(f"{where}: 'tool_calls' must be a list, on an assistant message")
      if not isinstance(content, str) and not (content is None and calls):
        raise ValueError(f"{where}: 'content' must be a string")
    last = messages[-1]
    if last["role"] not in ("user", "tool") or not str(last.get("content") or "").strip():
      raise ValueError(
        f"the last message must be a user's or a tool's, with text (the model answers next); "
        f"got {last['role']!r}"
      )
    if self.tools is not None and (
      not isinstance(self.tools, list | tuple) or not all(isinstance(t, dict) for t in self.tools)
    ):
      raise ValueError("field 'tools' must be a list of objects (the tools' JSON schemas)")
    object.__setattr__(self, "messages", tuple(dict(m) for m in messages))
    if self.tools is not None:
      object.__setattr__(self, "tools", tuple(dict(t) for t in self.tools))

  def to_json(self) -> str:
    """JSON (what a prepared dataset stores), keys in the record's order: a template writes
    the tools' schemas and the calls' arguments in that order (`tojson`)."""
    value = {"messages": list(self.messages)}
    if self.tools is not None:
      value["tools"] = list(self.tools)
    return json.dumps(value, ensure_ascii=False, allow_nan=False)

  @classmethod
  def from_json(cls, text: str | bytes) -> Conversation:
    value = json.loads(text)
    return cls(tuple(value["messages"]), value.get("tools"))

  def with_last_content(self, content: str) -> Conversation:
    """The conversation with the last message's text replaced by `content`."""
    return Conversation(
      (*self.messages[:-1], {**self.messages[-1], "content": content}), self.tools
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChatTemplate:
  """A minimal chat format: `<|user|>\n{prompt}\n<|assistant|>\n`, then the response; a
  conversation's earlier turns come first in the same format (`<|assistant|>\n{text}\n`).
  User and assistant turns only: system and tool messages need a checkpoint's own template.

  A marker is one special token when the tokenizer has it (the byte tokenizer does) and plain
  text otherwise. The prompt is encoded in three parts so the pipelines can left-truncate a long
  prompt's text while keeping BOS, the earlier turns and both markers.
  """

  user: str = USER_TOKEN
  assistant: str = ASSISTANT_TOKEN

  def _turns(self, prompt: str | Conversation) -> tuple[list[tuple[str, str]], str]:
    """The earlier turns as (marker, text) and the last user message's text."""
    if not isinstance(prompt, Conversation):
      return [], prompt
    roles = {m["role"] for m in prompt.messages} | (
      {"tools"} if prompt.tools is not None else set()
    )
    if (problem := self.refuses(roles)) is not None:
      raise ValueError(problem)
    markers = {"user": self.user, "assistant": self.assistant}
    turns = [(markers[m["role"]], m["content"]) for m in prompt.messages[:-1]]
    return turns, prompt.messages[-1]["content"]

  @staticmethod
  def refuses(roles: Iterable[str]) -> str | None:
    """Why conversations with these roles (and 'tools': tools given) cannot be rendered in the
    built-in format; None when they can."""
    unsupported = sorted(set(roles) - {"user", "assistant", "tools"})
    what = [f"{', '.join(unsupported)} messages"] if unsupported else []
    what += ["tools"] if "tools" in roles else []
    if not what:
      return None
    return (
      f"the built-in chat format has user and assistant turns only, not {' or '.join(what)}: "
      "use a tokenizer whose checkpoint has a chat template"
    )

  def render(self, prompt: str | Conversation) -> str:
    """The template as text (what a tokenizer without the marker tokens sees)."""
    turns, last = self._turns(prompt)
    return "".join(f"{m}\n{t}\n" for m, t in turns) + f"{self.user}\n{last}\n{self.assistant}\n"

  def _marker(self, tokenizer: Tokenizer, marker: str) -> list[int]:
    token_id = tokenizer.token_to_id(marker)
    return [token_id] if token_id is not None else tokenizer.encode(marker, add_bos=False)

  def encode_parts(
    self, tokenizer: Tokenizer, prompt: str | Conversation, *, add_bos: bool = True
  ) -> tuple[list[int], list[int], list[int]]:
    """(head, body, tail): BOS, the earlier turns and the user marker; the last user message's
    text; the assistant marker."""
    turns, last = self._turns(prompt)
    newline = tokenizer.encode("\n", add_bos=False)
    head = [tokenizer.bos_id] if add_bos else []
    for marker, text in turns:
      head += self._marker(tokenizer, marker) + newline + tokenizer.encode(text, add_bos=False)
      head += newline
    head += self._marker(tokenizer, self.user) + newline
    body = tokenizer.encode(last, add_bos=False)
    tail = newline + self._marker(tokenizer, self.assistant) + newline
    return head, body, tail

  def encode(
    self, tokenizer: Tokenizer, prompt: str | Conversation, *, add_bos: bool = True
  ) -> list[int]:
    """Token ids of the rendered prompt, ready for the model to continue."""
    head, body, tail = self.encode_parts(tokenizer, prompt, add_bos=add_bos)
    return head + body + tail


NEEDS_TEMPLATE = (
  "the record is a conversation ('messages'), which needs a chat template: set "
  "data.chat_template=True"
)


def encode_prompt_parts(
  tokenizer: Tokenizer, prompt: str | Conversation, chat_template: ChatTemplate | None = None
) -> tuple[list[int], list[int], list[int]]:
  """(head, body, tail) of a prompt, with or without a chat template; head starts with BOS.

  Raises:
    ValueError: a conversation without a chat template (it has no format to render in).
  """
  if chat_template is not None:
    return chat_template.encode_parts(tokenizer, prompt)
  if isinstance(prompt, Conversation):
    raise ValueError(NEEDS_TEMPLATE)
  return [tokenizer.bos_id], tokenizer.encode(prompt, add_bos=False), []


def encode_prompt(
  tokenizer: Tokenizer, prompt: str | Conversation, chat_template: ChatTemplate | None = None
) -> list[int]:
  """A prompt's ids as the model receives it untruncated: a checkpoint's template's rendered
  text encoded at once (`apply_chat_template`'s ids), else head + body + tail."""
  if chat_template is not None:
    return chat_template.encode(tokenizer, prompt)
  return sum(encode_prompt_parts(tokenizer, prompt), [])
