"""Small Hugging Face checkpoint directories written by the tests (no downloads): a byte-level
BPE tokenizer.json trained on a few sentences, tokenizer_config.json with a chat template, and
optionally the weights and config.json of a random model."""

from __future__ import annotations

import importlib
import json
import os

import jax
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from rlhfjax import models as rlhf_models
from rlhfjax.config.model import ModelConfig, get_model_config


class _OnFirstUse:
  """A module imported when one of its attributes is first read: `torch` and `transformers`
  take about 2 s to import, which every pytest process (each worker, or a serial run) would
  pay while collecting, whether or not it runs a test that uses them."""

  def __init__(self, name: str):
    self._name = name

  def __getattr__(self, attr: str):
    if attr.startswith("_"):  # what pytest's collection looks up on every module attribute
      raise AttributeError(attr)
    return getattr(importlib.import_module(self._name), attr)


torch = _OnFirstUse("torch")
transformers = _OnFirstUse("transformers")

_TINY = get_model_config("tiny")
_LLAMA32 = get_model_config("1b")
TINY_QWEN2 = _TINY.replace(
  architecture="qwen2", qkv_bias=True, tie_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6
)
"""Qwen2's architecture (q/k/v bias, tied embeddings, its rope and eps) on the tiny shapes."""
TINY_LLAMA3 = _TINY.replace(
  rope_theta=_LLAMA32.rope_theta,
  rope_scaling=_LLAMA32.rope_scaling,
  max_position_embeddings=_LLAMA32.max_position_embeddings,
  tie_embeddings=True,
)
"""Llama 3.2's rope (theta 500000, llama3 scaling) and tied embeddings on the tiny shapes."""

# Qwen2.5-Instruct's template without the tool-calling branches (those need tools=...).
QWEN25_TEMPLATE = (
  "{%- if messages[0]['role'] == 'system' %}"
  "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
  "{%- else %}"
  "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. "
  "You are a helpful assistant.<|im_end|>\\n' }}"
  "{%- endif %}"
  "{%- for message in messages %}"
  "{%- if message.role != 'system' %}"
  "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
  "{%- endif %}"
  "{%- endfor %}"
  "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
QWEN25_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# Llama-3-Instruct's template: the BOS written by the template, a header per turn.
LLAMA3_TEMPLATE = (
  "{% set loop_messages = messages %}{% for message in loop_messages %}"
  "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
  " + message['content'] | trim + '<|eot_id|>' %}"
  "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
  "{{ content }}{% endfor %}"
  "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
  "{% endif %}"
)
LLAMA3_SPECIALS = (
  "<|begin_of_text|>",
  "<|end_of_text|>",
  "<|start_header_id|>",
  "<|end_header_id|>",
  "<|eot_id|>",
)

# A Qwen3-style template (written for these tests after the format of Qwen3's): the tools'
# schemas in the system turn, an assistant's tool calls as <tool_call> JSON, consecutive tool
# results as <tool_response> blocks of one user turn, and `enable_thinking=False` answered with
# an empty <think> block.
QWEN3_STYLE_TEMPLATE = (
  "{%- if tools %}"
  "{{- '<|im_start|>system\n' }}"
  "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}"
  "{{- '# Tools\n\n<tools>' }}"
  "{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}"
  '{{- \'\n</tools>\n\nCall a tool as <tool_call>{"name": ..., "arguments": ...}</tool_call>.'
  "<|im_end|>\n' }}"
  "{%- elif messages[0].role == 'system' %}"
  "{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}"
  "{%- endif %}"
  "{%- for message in messages %}"
  "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
  "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}"
  "{%- elif message.role == 'assistant' %}"
  "{{- '<|im_start|>assistant\n' + (message.content or '') }}"
  "{%- for call in message.tool_calls or [] %}"
  "{%- set call = call.function if call.function is defined else call %}"
  '{{- \'\n<tool_call>\n{"name": "\' + call.name + \'", "arguments": \''
  " + (call.arguments | tojson) + '}\n</tool_call>' }}"
  "{%- endfor %}"
  "{{- '<|im_end|>\n' }}"
  "{%- elif message.role == 'tool' %}"
  "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}"
  "{%- endif %}"
  "{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}"
  "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}"
  "{%- endif %}"
  "{%- endfor %}"
  "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
  "{%- if enable_thinking is defined and enable_thinking is false %}"
  "{{- '<think>\n\n</think>\n\n' }}{%- endif %}"
  "{%- endif %}"
)
QWEN3_STYLE_SPECIALS = (
  *QWEN25_SPECIALS,
  "<think>",
  "</think>",
  "<tool_call>",
  "</tool_call>",
  "<tool_response>",
  "</tool_response>",
)

# A Llama-3.1-style template (after the format of Llama 3.1's): a system turn first, the tools'
# schemas in it, an assistant's tool call as JSON ending in <|eom_id|>, a tool's result as an
# 'ipython' turn.
LLAMA31_STYLE_TEMPLATE = (
  "{{- bos_token }}"
  "{%- if messages[0].role == 'system' %}"
  "{%- set system = messages[0].content | trim %}{%- set rest = messages[1:] %}"
  "{%- else %}{%- set system = '' %}{%- set rest = messages %}{%- endif %}"
  "{{- '<|start_header_id|>system<|end_header_id|>\n\n' }}"
  "{%- if tools %}{{- 'Environment: ipython\n' }}{%- endif %}"
  "{{- 'Cutting Knowledge Date: December 2023\n\n' + system }}"
  "{%- if tools %}{{- '\n\nFunctions you may call:' }}"
  "{%- for t in tools %}{{- '\n' + (t | tojson(indent=4)) }}{%- endfor %}{%- endif %}"
  "{{- '<|eot_id|>' }}"
  "{%- for message in rest %}"
  "{%- if message.role == 'assistant' and message.tool_calls %}"
  "{%- set call = message.tool_calls[0].function %}"
  '{{- \'<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "\' + call.name'
  " + '\", \"parameters\": ' + (call.arguments | tojson) + '}<|eom_id|>' }}"
  "{%- elif message.role == 'tool' %}"
  "{{- '<|start_header_id|>ipython<|end_header_id|>\n\n' + message.content + '<|eot_id|>' }}"
  "{%- else %}"
  "{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n' + message.content | trim"
  " + '<|eot_id|>' }}"
  "{%- endif %}"
  "{%- endfor %}"
  "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
  "{%- endif %}"
)
LLAMA31_STYLE_SPECIALS = (*LLAMA3_SPECIALS, "<|eom_id|>")

_CORPUS = [
  "You are a helpful assistant. Answer the question in one word.",
  "Name a colour with many vowels: aubergine, turquoise, ochre.",
  "the quick brown fox jumps over the lazy dog " * 3,
  "user assistant system header answer question word vowel",
]


def write_tokenizer(
  path, *, specials: tuple[str, ...], bos: str | None, eos: str, template: str, vocab=300
):
  """tokenizer.json (byte-level BPE with `specials` as special tokens) and tokenizer_config.json
  naming bos/eos and carrying `template`."""
  os.makedirs(path, exist_ok=True)
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=vocab,
    special_tokens=list(specials),
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
  )
  tok.train_from_iterator(_CORPUS, trainer)
  tok.save(os.path.join(path, "tokenizer.json"))
  config = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": bos,
    "eos_token": eos,
    "pad_token": specials[0],
    "chat_template": template,
  }
  with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
    json.dump(config, f)
  return tok


def write_checkpoint(path, model: ModelConfig, *, seed: int = 0) -> None:
  """Random weights of `model` as a Hugging Face checkpoint (config.json and safetensors)."""
  params = jax.device_get(rlhf_models.init_params(model, "lm", jax.random.key(seed)))
  rlhf_models.save_hf_checkpoint(model, params, str(path))
