"""A checkpoint's own chat template: the Jinja text of its tokenizer files, rendered as
`transformers` renders it, so prompts reach the model in the format it was trained on.

The template comes from `chat_template.jinja` or `tokenizer_config.json`'s `chat_template` (a
string, or a list of named templates, of which 'default' is used). It is rendered in a sandbox
with what `transformers` provides: `messages`, `tools`, `add_generation_prompt=True`, the special
tokens (`bos_token`, `eos_token`, ...), `raise_exception`, `strftime_now`, a `tojson` filter and
the run's template keyword arguments (`data.template_kwargs`, e.g. `enable_thinking`).

A prompt is a text (one user turn) or a conversation (`Conversation`: messages with system,
user, assistant and tool roles, and the tools the model may call). Either way its token ids are
those of the rendered text encoded at once, as `apply_chat_template(..., tokenize=True)` gives.

The pipelines left-truncate a long prompt's text while keeping the template around it, so for
that the template is rendered once with a sentinel in place of the last message's text and split
there: the text before (head: the template and the earlier turns) and after (tail) are encoded
once, the last message's text (body) on its own. Special tokens the template writes as text
(`<|im_start|>`) encode to their ids because the tokenizer's added tokens are matched in text; a
BOS is only what the template writes, never added twice.
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

from rlhfjax.data.tokenizer import ChatTemplate, Conversation, Tokenizer

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
  """A system message first, if not empty and the prompt has none of its own."""
  name: str = "chat template"
  """Where the template comes from, for error messages."""
  kwargs: tuple[tuple[str, Any], ...] = ()
  """Keyword arguments the template reads (`data.template_kwargs`: `enable_thinking`, ...)."""

  def messages(self, prompt: str | Conversation) -> tuple[list[dict[str, Any]], list | None]:
    """The messages and tools a prompt renders: a text is one user turn; `system_prompt`
    goes first unless the conversation starts with a system message."""
    if isinstance(prompt, Conversation):
      messages, tools = [dict(m) for m in prompt.messages], prompt.tools
    else:
      messages, tools = [{"role": "user", "content": prompt}], None
    if self.system_prompt and messages[0].get("role") != "system":
      messages.insert(0, {"role": "system", "content": self.system_prompt})
    return messages, tools

  def render(self, prompt: str | Conversation) -> str:
    """The template's text for the prompt, ready for the assistant's answer."""
    messages, tools = self.messages(prompt)
    try:
      template = _environment().from_string(self.source)
      return template.render(
        messages=messages,
        tools=tools,
        add_generation_prompt=True,
        **self.special_tokens,
        **dict(self.kwargs),
      )
    except jinja2.exceptions.TemplateError as e:
      raise ChatTemplateError(f"{self.name}: {type(e).__name__}: {e}") from None

  def encode_parts(
    self, tokenizer: Tokenizer, prompt: str | Conversation, *, add_bos: bool = True
  ) -> tuple[list[int], list[int], list[int]]:
    """(head, body, tail): the template (and earlier turns) before the last message's text,
    that text, the template after it.

    `add_bos` is ignored: the template writes a BOS where its model expects one.
    """
    del add_bos
    if isinstance(prompt, Conversation):
      body = prompt.messages[-1]["content"]
      sentinel = prompt.with_last_content(_SENTINEL)
    else:
      body, sentinel = prompt, _SENTINEL
    text = self.render(sentinel)
    if text.count(_SENTINEL) != 1:
      raise ChatTemplateError(f"{self.name}: the template does not write the last message once")
    before, after = text.split(_SENTINEL)
    return (
      tokenizer.encode(before, add_bos=False),
      tokenizer.encode(body, add_bos=False),
      tokenizer.encode(after, add_bos=False),
    )

  def encode(
    self, tokenizer: Tokenizer, prompt: str | Conversation, *, add_bos: bool = True
  ) -> list[int]:
    """The rendered text's ids, encoded at once (as `apply_chat_template` encodes it)."""
    del add_bos
    return tokenizer.encode(self.render(prompt), add_bos=False)


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


def checkpoint_template(
  directory: str, system_prompt: str = "", kwargs: dict[str, Any] | None = None
) -> JinjaChatTemplate | None:
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
    source,
    special_tokens=_special_tokens(config),
    system_prompt=system_prompt,
    name=name,
    kwargs=tuple(sorted((kwargs or {}).items())),
  )


def load_chat_template(
  tokenizer_spec: str, system_prompt: str = "", kwargs: dict[str, Any] | None = None
) -> Any:
  """The chat template for `data.chat_template=True`: the tokenizer directory's own; for the
  built-in byte tokenizer (no checkpoint, so no template of its own) the built-in minimal
  `ChatTemplate` (user and assistant turns only, no system prompt nor keyword arguments:
  `DataSection` refuses those for it).

  Raises:
    ChatTemplateError: the tokenizer directory has none: its model never saw the built-in
      markers, so they are not put in its place without a word.
  """
  if tokenizer_spec == "byte":
    return ChatTemplate()
  path = os.path.expanduser(tokenizer_spec)
  directory = path if os.path.isdir(path) else (os.path.dirname(path) or ".")
  template = checkpoint_template(directory, system_prompt, kwargs)
  if template is None:
    raise ChatTemplateError(
      f"data.chat_template=True: {directory} has no chat template (chat_template.jinja or "
      "tokenizer_config.json's 'chat_template'), so its model was never trained on one: set "
      "data.chat_template=False to give it the plain prompts"
    )
  return template


def data_template(data: Any) -> Any:
  """The chat template a `DataSection` asks for (with its system prompt and keyword
  arguments), or None when `data.chat_template` is False."""
  if not data.chat_template:
    return None
  return load_chat_template(data.tokenizer, data.system_prompt, data.template_arguments)
