"""Qwen3: Qwen2's attention with RMSNorm over each query and key head, and one
`attention_bias` flag (off in the released models) for all four projections."""

from __future__ import annotations

from rlhfjax.config.families import qwen2
from rlhfjax.config.families.family import Family


def _read(hf):
  bias = bool(hf.get("attention_bias", False))
  return {
    "qkv_bias": bias,
    "o_bias": bias,
    "qk_norm": True,
    "sliding_window": qwen2.sliding_window(hf),
  }


def _write(config):
  if not config.qk_norm or config.qkv_bias != config.o_bias:
    raise ValueError("a Qwen3 export needs qk_norm=True and qkv_bias == o_bias")
  return {"attention_bias": config.qkv_bias, **qwen2.sliding_window_keys(config)}


FAMILY = Family(model_type="qwen3", class_prefix="Qwen3", read=_read, write=_write)
