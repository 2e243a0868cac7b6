"""Llama 1 to 3.x: one `attention_bias` flag for all four attention projections."""

from __future__ import annotations

from rlhfjax.config.families.family import Family


def _read(hf):
  bias = bool(hf.get("attention_bias", False))
  return {"qkv_bias": bias, "o_bias": bias}


def _write(config):
  if config.qkv_bias != config.o_bias:
    raise ValueError("a Llama export needs qkv_bias == o_bias (one attention_bias flag)")
  if config.qk_norm:
    raise ValueError("a llama export cannot carry q/k norms (only qwen3)")
  return {"attention_bias": config.qkv_bias, "mlp_bias": False}


FAMILY = Family(model_type="llama", class_prefix="Llama", read=_read, write=_write)
