"""A checkpoint's chat template gives the token ids `transformers` gives, for one user turn and
for conversations (system, multi-turn, tool calls and results, template keyword arguments), and
keeps the head / body / tail split the pipelines truncate by; conversations as JSONL records."""

from __future__ import annotations

import json
import os
import re

import pytest
from hf_dirs import (
  LLAMA3_SPECIALS,
  LLAMA3_TEMPLATE,
  LLAMA31_STYLE_SPECIALS,
  LLAMA31_STYLE_TEMPLATE,
  QWEN3_STYLE_SPECIALS,
  QWEN3_STYLE_TEMPLATE,
  QWEN25_SPECIALS,
  QWEN25_TEMPLATE,
  transformers,
  write_tokenizer,
)

from rlhfjax import data
from rlhfjax.config import ConfigError, experiment
from rlhfjax.data import jsonl, load_tokenizer, pipeline
from rlhfjax.data.chat_template import (
  ChatTemplateError,
  JinjaChatTemplate,
  data_template,
  load_chat_template,
)
from rlhfjax.data.tokenizer import ChatTemplate, Conversation

pytestmark = pytest.mark.pure

PROMPT = "Name a colour with many vowels."
STYLES = {
  "qwen2.5": dict(specials=QWEN25_SPECIALS, bos=None, eos="<|im_end|>", template=QWEN25_TEMPLATE),
  "llama3": dict(
    specials=LLAMA3_SPECIALS, bos="<|begin_of_text|>", eos="<|eot_id|>", template=LLAMA3_TEMPLATE
  ),
}


CONVERSATION_STYLES = {
  "qwen3": dict(
    specials=QWEN3_STYLE_SPECIALS, bos=None, eos="<|im_end|>", template=QWEN3_STYLE_TEMPLATE
  ),
  "llama3.1": dict(
    specials=LLAMA31_STYLE_SPECIALS,
    bos="<|begin_of_text|>",
    eos="<|eot_id|>",
    template=LLAMA31_STYLE_TEMPLATE,
  ),
}
TOOLS = [
  {
    "type": "function",
    "function": {
      "name": "calculator",
      "description": "Evaluates an arithmetic expression.",
      "parameters": {
        "type": "object",
        "properties": {"expression": {"type": "string"}},
        "required": ["expression"],
      },
    },
  }
]
CALL = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "12*7"}}}
MULTI_TURN = [
  {"role": "system", "content": "Answer with a number."},
  {"role": "user", "content": "What is 3 + 4?"},
  {"role": "assistant", "content": "7"},
  {"role": "user", "content": "And 12 times 7?"},
]
WITH_TOOLS = [
  {"role": "user", "content": "What is 12 times 7? Use the calculator."},
  {"role": "assistant", "content": "", "tool_calls": [CALL]},
  {"role": "tool", "name": "calculator", "content": "84"},
]


def _hf_ids(path: str, messages, **kwargs) -> list[int]:
  tok = transformers.AutoTokenizer.from_pretrained(path)
  ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
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


@pytest.mark.parametrize("style", sorted(CONVERSATION_STYLES))
@pytest.mark.parametrize("which", ["multi_turn", "tools"])
def test_conversations_give_the_ids_transformers_gives(tmp_path, style, which):
  """System, multi-turn, an assistant's tool call and the tool's result, with the tools'
  schemas and a template keyword argument: the ids `apply_chat_template` gives, and the split
  around the last message's text the pipelines truncate by."""
  write_tokenizer(tmp_path, **CONVERSATION_STYLES[style])
  tokenizer = load_tokenizer(str(tmp_path))
  kwargs = {"enable_thinking": False}
  template = load_chat_template(str(tmp_path), kwargs=kwargs)
  messages, tools = (MULTI_TURN, None) if which == "multi_turn" else (WITH_TOOLS, TOOLS)
  conversation = Conversation(messages, tools)
  expected = _hf_ids(str(tmp_path), messages, tools=tools, **kwargs)
  assert template.encode(tokenizer, conversation) == expected
  head, body, tail = template.encode_parts(tokenizer, conversation)
  assert body == tokenizer.encode(messages[-1]["content"], add_bos=False)
  assert head + body + tail == expected
  # The rendering holds every turn, and the keyword argument reached the template.
  text = template.render(conversation)
  assert all(m["content"] in text for m in messages)
  if style == "qwen3":
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not load_chat_template(str(tmp_path)).render(conversation).endswith("</think>\n\n")
  if which == "tools":
    assert "calculator" in text and '"expression"' in text


def test_a_system_prompt_goes_first_unless_the_conversation_has_one(tmp_path):
  write_tokenizer(tmp_path, **CONVERSATION_STYLES["qwen3"])
  tokenizer = load_tokenizer(str(tmp_path))
  template = load_chat_template(str(tmp_path), system_prompt="Be brief.")
  turns = MULTI_TURN[1:]
  expected = _hf_ids(str(tmp_path), [{"role": "system", "content": "Be brief."}, *turns])
  assert template.encode(tokenizer, Conversation(turns)) == expected
  # Its own system message wins.
  assert template.encode(tokenizer, Conversation(MULTI_TURN)) == _hf_ids(str(tmp_path), MULTI_TURN)


def test_the_builtin_format_renders_user_and_assistant_turns_only():
  tokenizer = load_tokenizer("byte")
  template = ChatTemplate()
  conversation = Conversation(MULTI_TURN[1:])
  head, body, tail = template.encode_parts(tokenizer, conversation)
  earlier = template.encode(tokenizer, "What is 3 + 4?")[:-1]  # BOS, user turn, assistant marker
  assert head[: len(earlier)] == earlier  # the first turn as a one-turn prompt renders it
  assert body == tokenizer.encode("And 12 times 7?", add_bos=False)
  assert tail == template.encode_parts(tokenizer, "x")[2]
  user, assistant = (tokenizer.token_to_id(m) for m in (template.user, template.assistant))
  assert (head.count(user), head.count(assistant), tail.count(assistant)) == (2, 1, 1)
  for messages, tools, what in ((MULTI_TURN, None, "system messages"), (WITH_TOOLS, TOOLS, "")):
    with pytest.raises(
      ValueError, match=f"built-in chat format has user and assistant turns only, not {what}"
    ):
      template.encode(tokenizer, Conversation(messages, tools))


@pytest.mark.parametrize(
  "line, detail",
  [
    ({"messages": []}, "field 'messages': field 'messages' must be a non-empty list"),
    ({"messages": "hi"}, "must be a non-empty list"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "message 0: role 'robot' is not one of"),
    ({"messages": [{"role": "user", "content": 3}]}, "message 0: 'content' must be a string"),
    ({"messages": MULTI_TURN[:3]}, "the last message must be a user's or a tool's"),
    ({"messages": MULTI_TURN, "prompt": "x"}, "give either 'prompt' or 'messages', not both"),
    ({"messages": MULTI_TURN, "tools": {"a": 1}}, "field 'tools' must be a list of objects"),
    ({"answer": "7"}, "missing field 'prompt' (a prompt record needs prompt (or messages))"),
  ],
)
def test_a_conversation_that_is_not_one_is_a_bad_record(line, detail):
  with pytest.raises(jsonl.BadRecord) as e:
    jsonl.parse_line("prompt", json.dumps(line).encode())
  assert detail in e.value.detail
  assert e.value.reason == ("missing_field" if "answer" in line else "bad_messages")


def _prompts(tmp_path, lines, data_dir, template, **kw):
  path = tmp_path / "prompts.jsonl"
  path.write_text("".join(json.dumps(x) + "\n" for x in lines))
  prepared = data.prepare("prompt", str(path), str(data_dir))
  return pipeline.prompt_iterator(
    prepared.source("train"),
    load_tokenizer(kw.pop("tokenizer", "byte")),
    max_prompt_len=kw.pop("max_prompt_len", 256),
    seed=0,
    chat_template=template,
    repeat=False,
    origin=prepared.path("train"),
    **kw,
  )


def test_conversation_records_reach_the_model_as_transformers_renders_them(tmp_path):
  """Prompt records holding `messages` and `tools` (and a plain one), through prepare and the
  prompt pipeline with the config's system prompt and template arguments: the ids
  `apply_chat_template` gives; the records' other fields reach the reward; a long last message
  is cut from the left with the earlier turns kept."""
  hf = tmp_path / "tok"
  write_tokenizer(hf, **CONVERSATION_STYLES["qwen3"])
  cfg = experiment.DataSection(
    tokenizer=str(hf),
    chat_template=True,
    system_prompt="Be brief.",
    template_kwargs='{"enable_thinking": false}',
  )
  template = data_template(cfg)
  long_turn = {"role": "user", "content": "Now the big one: " + "7 * 8 + " * 100 + "1?"}
  lines = [
    {"messages": MULTI_TURN, "answer": "84"},
    {"messages": WITH_TOOLS, "tools": TOOLS, "answer": "84"},
    {"prompt": "What is 2 + 2?", "answer": "4"},
    {"messages": [*MULTI_TURN[1:3], long_turn], "answer": "?"},
  ]
  kwargs = {"enable_thinking": False}
  system = {"role": "system", "content": "Be brief."}
  expected = [
    _hf_ids(str(hf), MULTI_TURN, **kwargs),
    _hf_ids(str(hf), [system, *WITH_TOOLS], tools=TOOLS, **kwargs),
    _hf_ids(str(hf), [system, {"role": "user", "content": "What is 2 + 2?"}], **kwargs),
  ]
  full = _hf_ids(str(hf), [system, *MULTI_TURN[1:3], long_turn], **kwargs)
  limit = max(map(len, expected)) + 10
  assert len(full) > limit + 100
  prompts = _prompts(
    tmp_path, lines, tmp_path / "data", template, tokenizer=str(hf), max_prompt_len=limit
  )
  batch = prompts.take_batch(4)
  assert batch.tokens[:3] == expected
  assert [r["answer"] for r in batch.records] == ["84", "84", "4", "?"]
  assert "messages" not in batch.records[0] and "tools" not in batch.records[1]
  # The schemas keep their keys' order (the template writes them so).
  assert batch.tokens[1] != _hf_ids(
    str(hf), [system, *WITH_TOOLS], tools=json.loads(json.dumps(TOOLS, sort_keys=True)), **kwargs
  )
  # Cut: as long as allowed, the earlier turns and the template's end kept, the text's end too.
  cut = batch.tokens[3]
  tokenizer = load_tokenizer(str(hf))
  head, _, tail = template.encode_parts(tokenizer, Conversation([*MULTI_TURN[1:3], long_turn]))
  assert len(cut) == limit and cut[: len(head)] == head and cut[len(cut) - len(tail) :] == tail
  assert tokenizer.decode(cut[len(head) : len(cut) - len(tail)]).endswith("7 * 8 + 1?")


def test_a_conversation_without_a_chat_template_is_refused_at_start_naming_its_line(tmp_path):
  lines = [{"prompt": "fine"}, {"messages": MULTI_TURN[1:]}]
  with pytest.raises(data.DataError, match=r"prompts.jsonl:2: the record is a conversation"):
    _prompts(tmp_path, lines, tmp_path / "data", None)
  # The byte tokenizer's built-in format refuses a system message, naming the record too.
  with pytest.raises(data.DataError, match=r"prompts.jsonl:1: the built-in chat format"):
    _prompts(tmp_path, [{"messages": MULTI_TURN}], tmp_path / "data2", ChatTemplate())


@pytest.mark.parametrize(
  "fields, message",
  [
    (dict(system_prompt="Be brief."), "data.system_prompt is set but data.chat_template is False"),
    (dict(chat_template=True, template_kwargs="[1]"), "must be a JSON object, got '[1]'"),
    (dict(chat_template=True, template_kwargs="{"), "data.template_kwargs is not JSON"),
  ],
)
def test_template_fields_are_checked(fields, message):
  with pytest.raises(ConfigError, match=re.escape(message)):
    experiment.DataSection(tokenizer="t", **fields)


def test_a_system_prompt_with_the_builtin_format_is_refused():
  with pytest.raises(ConfigError, match="data.system_prompt needs a checkpoint's chat template"):
    experiment.ExperimentConfig(
      model=experiment.ModelSection(size="tiny"),
      data=experiment.DataSection(chat_template=True, system_prompt="Be brief."),
    )


def test_a_demonstration_may_be_a_conversation_its_response_the_next_assistant_turn(tmp_path):
  """SFT on a conversation: the prompt rendered as `transformers` renders it, the loss on the
  response and its EOS alone."""
  hf = tmp_path / "tok"
  write_tokenizer(hf, **CONVERSATION_STYLES["llama3.1"])
  tokenizer = load_tokenizer(str(hf))
  path = tmp_path / "demos.jsonl"
  path.write_text(json.dumps({"messages": WITH_TOOLS, "tools": TOOLS, "response": "84."}) + "\n")
  prepared = data.prepare("demonstration", str(path), str(tmp_path / "data"))
  template = load_chat_template(str(hf))
  batch = next(
    pipeline.sft_batches(
      prepared.source("train"),
      tokenizer,
      batch_size=1,
      max_len=1024,
      seed=0,
      repeat=False,
      chat_template=template,
    )
  )
  prompt = _hf_ids(str(hf), WITH_TOOLS, tools=TOOLS)
  response = tokenizer.encode("84.", add_bos=False) + [tokenizer.eos_id]
  n = len(prompt) + len(response)
  assert batch["tokens"][0, :n].tolist() == prompt + response
  assert batch["loss_mask"][0].nonzero()[0].tolist() == list(range(len(prompt), n))
