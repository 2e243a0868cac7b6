"""A checkpoint's own chat template: the Jinja text of its tokenizer files, rendered as
`transformers` renders it, so prompts reach the model in the format it was trained on.

The template comes from `chat_template.jinja` or `tokenizer_config.json`'s `chat_template` (a
string, or a list of named templates, of which 'default' is used). It is rendered in a sandbox
with what `transformers` provides: `messages`, `add_generation_prompt=True`, the special tokens
(`bos_token`, `eos_token`, ...), `raise_exception`, `strftime_now` and a `tojson` filter.

The pipelines left-truncate a long prompt's text while keeping the template around it, so the
template is rendered once with a sentinel as the user's text and split there: the text before
(head) and after (tail) are encoded once, the prompt (body) on its own. Special tokens the
template writes as text (`<|im_start|>`) encode to their ids because the tokenizer's added
tokens are matched in text; a BOS is only what the template writes, never added twice.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox

from rlhfjax.data.tokenizer import ChatTemplate, Tokenizer

# Text no prompt contains; the rendered template is split around it.
_SENTINEL = "\u2063rlhfjax-prompt\u2063"
_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


class ChatTemplateError(ValueError):
  """A checkpoint's chat template cannot be read or rendered."""


def _raise_exception(message: str):
  raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent=None, separators=None, sort_keys=False):
  # As transformers: no ASCII escaping, so templates writing tool schemas match its output.
  return json.dumps(
    value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
  )


def _strftime_now(format: str) -> str:
  return datetime.datetime.now().strftime(format)


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
  )
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  env.globals["strftime_now"] = _strftime_now
  return env


@dataclasses.dataclass(frozen=True)
class JinjaChatTemplate:
  """A Hugging Face chat template and the special tokens it may write."""

  source: str
  """The Jinja text."""
  special_tokens: dict[str, str] = dataclasses.field(default_factory=dict)
  """bos_token, eos_token, ... as tokenizer_config.json names them."""
  system_prompt: str = ""
  """A system message before the user's, if not empty."""
  name: str = "chat template"
  """Where the template comes from, for error messages."""

  def render(self, prompt: str) -> str:
    """The template's text for one user turn, ready for the assistant's answer."""
    messages = [{"role": "user", "content": prompt}]
    if self.system_prompt:
      messages.insert(0, {"role": "system", "content": self.system_prompt})
    try:
      template = _environment().from_string(self.source)
      return template.render(messages=messages, add_generation_prompt=True, **self.special_tokens)
    except jinja2.exceptions.TemplateError as e:
      raise ChatTemplateError(f"{self.name}: {type(e).__name__}: {e}") from None

  def encode_parts(
    self, tokenizer: Tokenizer, prompt: str, *, add_bos: bool = True
  ) -> tuple[list[int], list[int], list[int]]:
    """(head, body, tail): the template before the user's text, the text, the template after.

    `add_bos` is ignored: the template writes a BOS where its model expects one.
    """
    del add_bos
    text = self.render(_SENTINEL)
    if text.count(_SENTINEL) != 1:
      raise ChatTemplateError(f"{self.name}: the template does not write the user's message once")
    before, after = text.split(_SENTINEL)
    return (
      tokenizer.encode(before, add_bos=False),
      tokenizer.encode(prompt, add_bos=False),
      tokenizer.encode(after, add_bos=False),
    )

  def encode(self, tokenizer: Tokenizer, prompt: str, *, add_bos: bool = True) -> list[int]:
    head, body, tail = self.encode_parts(tokenizer, prompt, add_bos=add_bos)
    return head + body + tail


def _read_json(path: str) -> dict[str, Any]:
  try:
    with open(path, encoding="utf-8") as f:
      value = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise ChatTemplateError(f"{path}: cannot be read ({e})") from None
  if not isinstance(value, dict):
    raise ChatTemplateError(f"{path}: not a JSON object")
  return value


def _template_text(value: Any, path: str) -> str | None:
  """The template of a `chat_template` value: a string, or [{'name':..., 'template':...}]."""
  if value is None or isinstance(value, str):
    return value
  if isinstance(value, list):
    named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
    if "default" in named:
      return named["default"]
    raise ChatTemplateError(
      f"{path}: chat_template lists no 'default' template (found {', '.join(map(str, named))})"
    )
  raise ChatTemplateError(f"{path}: chat_template must be a string or a list of named templates")


def _special_tokens(config: dict[str, Any]) -> dict[str, str]:
  out = {}
  for key in _SPECIAL_TOKENS:
    value = config.get(key)
    if isinstance(value, dict):  # AddedToken serialised as {"content": ...}
      value = value.get("content")
    out[key] = value if isinstance(value, str) else ""
  return out


def checkpoint_template(directory: str, system_prompt: str = "") -> JinjaChatTemplate | None:
  """The chat template of a tokenizer directory, or None when it has none."""
  config_path = os.path.join(directory, "tokenizer_config.json")
  config = _read_json(config_path) if os.path.isfile(config_path) else {}
  jinja_path = os.path.join(directory, "chat_template.jinja")
  if os.path.isfile(jinja_path):
    with open(jinja_path, encoding="utf-8") as f:
      source, name = f.read(), jinja_path
  else:
    source, name = _template_text(config.get("chat_template"), config_path), config_path
  if not source:
    return None
  return JinjaChatTemplate(
    source, special_tokens=_special_tokens(config), system_prompt=system_prompt, name=name
  )


def load_chat_template(tokenizer_spec: str, system_prompt: str = "") -> Any:
  """The chat template for `data.chat_template=True`: the tokenizer directory's own; for the
  built-in byte tokenizer (no checkpoint, so no template of its own) the built-in minimal
  `ChatTemplate`.

  Raises:
    ChatTemplateError: the tokenizer directory has none: its model never saw the built-in
      markers, so they are not put in its place without a word.
  """
  if tokenizer_spec == "byte":
    return ChatTemplate()
  path = os.path.expanduser(tokenizer_spec)
  directory = path if os.path.isdir(path) else (os.path.dirname(path) or ".")
  template = checkpoint_template(directory, system_prompt)
  if template is None:
    raise ChatTemplateError(
      f"data.chat_template=True: {directory} has no chat template (chat_template.jinja or "
      "tokenizer_config.json's 'chat_template'), so its model was never trained on one: set "
      "data.chat_template=False to give it the plain prompts"
    )
  return template
