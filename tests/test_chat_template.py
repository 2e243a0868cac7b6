"""A checkpoint's chat template gives the token ids `transformers` gives, and keeps the
head / body / tail split the pipelines truncate by."""

from __future__ import annotations

import json
import os

import pytest
from hf_dirs import (
  LLAMA3_SPECIALS,
  LLAMA3_TEMPLATE,
  QWEN25_SPECIALS,
  QWEN25_TEMPLATE,
  transformers,
  write_tokenizer,
)

from rlhfjax.data import load_tokenizer
from rlhfjax.data.chat_template import ChatTemplateError, JinjaChatTemplate, load_chat_template
from rlhfjax.data.tokenizer import ChatTemplate

pytestmark = pytest.mark.pure

PROMPT = "Name a colour with many vowels."
STYLES = {
  "qwen2.5": dict(specials=QWEN25_SPECIALS, bos=None, eos="<|im_end|>", template=QWEN25_TEMPLATE),
  "llama3": dict(
    specials=LLAMA3_SPECIALS, bos="<|begin_of_text|>", eos="<|eot_id|>", template=LLAMA3_TEMPLATE
  ),
}


def _hf_ids(path: str, messages) -> list[int]:
  tok = transformers.AutoTokenizer.from_pretrained(path)
  ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
  return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.mark.parametrize("style", sorted(STYLES))
def test_token_ids_equal_transformers(tmp_path, style):
  write_tokenizer(tmp_path, **STYLES[style])
  tokenizer = load_tokenizer(str(tmp_path))
  template = load_chat_template(str(tmp_path))
  assert isinstance(template, JinjaChatTemplate)
  head, body, tail = template.encode_parts(tokenizer, PROMPT)
  expected = _hf_ids(str(tmp_path), [{"role": "user", "content": PROMPT}])
  assert head + body + tail == expected
  assert body == tokenizer.encode(PROMPT, add_bos=False)
  # The template's special tokens are single ids, and a BOS only where the template writes one.
  specials = STYLES[style]["specials"]
  ids = {tokenizer.token_to_id(s) for s in specials}
  assert set(head + tail) & ids
  bos = tokenizer.token_to_id("<|begin_of_text|>")
  assert (head + tail).count(bos) == (1 if style == "llama3" else 0)


def test_a_system_prompt_goes_first(tmp_path):
  write_tokenizer(tmp_path, **STYLES["qwen2.5"])
  tokenizer = load_tokenizer(str(tmp_path))
  template = load_chat_template(str(tmp_path), system_prompt="Answer in one word.")
  expected = _hf_ids(
    str(tmp_path),
    [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": PROMPT}],
  )
  assert template.encode(tokenizer, PROMPT) == expected


def test_a_list_of_named_templates_uses_default(tmp_path):
  write_tokenizer(tmp_path, **STYLES["qwen2.5"])
  path = os.path.join(tmp_path, "tokenizer_config.json")
  with open(path) as f:
    config = json.load(f)
  config["chat_template"] = [
    {"name": "tool_use", "template": "{{ raise_exception('tools only') }}"},
    {"name": "default", "template": QWEN25_TEMPLATE},
  ]
  with open(path, "w") as f:
    json.dump(config, f)
  assert load_chat_template(str(tmp_path)).source == QWEN25_TEMPLATE


def test_a_checkpoint_without_a_template_is_refused_not_given_the_builtin_one(tmp_path):
  """No silent fallback: its model never saw the built-in markers. The byte tokenizer, which
  has no checkpoint, uses them."""
  write_tokenizer(tmp_path, **{**STYLES["qwen2.5"], "template": None})
  for spec in (str(tmp_path), str(tmp_path / "tokenizer.json")):
    with pytest.raises(ChatTemplateError, match=rf"^data.chat_template=True: {tmp_path} has no"):
      load_chat_template(spec)
  assert load_chat_template("byte") == ChatTemplate()


def test_a_template_that_raises_is_one_line(tmp_path):
  template = JinjaChatTemplate("{{ raise_exception('only user turns') }}", name="t.json")
  with pytest.raises(ChatTemplateError, match=r"^t.json: TemplateError: only user turns$"):
    template.render(PROMPT)
