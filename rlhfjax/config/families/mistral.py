"""Mistral: Llama's layers with a sliding window over every layer, and no attention biases."""

from __future__ import annotations

from rlhfjax.config.families.family import Family


def _read(hf):
  # No Mistral has attention biases; a config.json that says so anyway fails at export.
  return {
    "qkv_bias": bool(hf.get("attention_bias", False)),
    "sliding_window": hf.get("sliding_window"),
  }


def _write(config):
  if config.qkv_bias or config.o_bias:
    raise ValueError("a mistral export cannot carry these attention biases")
  if config.qk_norm:
    raise ValueError("a mistral export cannot carry q/k norms (only qwen3)")
  return {"sliding_window": config.sliding_window}


FAMILY = Family(model_type="mistral", class_prefix="Mistral", read=_read, write=_write)
