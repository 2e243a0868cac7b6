"""Qwen2 and Qwen2.5: q/k/v biases always (no o bias), a sliding window only on request."""

from __future__ import annotations

from rlhfjax.config.families.family import Family


def sliding_window(hf) -> int | None:
  """The window of a Qwen config.json: every layer's or none (`use_sliding_window`)."""
  if not hf.get("use_sliding_window"):
    return None
  if set(hf.get("layer_types") or []) != {"sliding_attention"}:
    raise ValueError("Qwen2 with sliding windows on only some layers is not supported")
  return hf.get("sliding_window")


def sliding_window_keys(config) -> dict:
  kind = "sliding_attention" if config.sliding_window else "full_attention"
  return {
    "use_sliding_window": config.sliding_window is not None,
    "sliding_window": config.sliding_window,
    "layer_types": [kind] * config.num_layers,
  }


def _read(hf):
  return {"qkv_bias": True, "sliding_window": sliding_window(hf)}


def _write(config):
  if not config.qkv_bias:
    raise ValueError("a Qwen2 export needs qkv_bias=True (Qwen2 always has q/k/v bias)")
  if config.o_bias:
    raise ValueError("a qwen2 export cannot carry these attention biases")
  if config.qk_norm:
    raise ValueError("a qwen2 export cannot carry q/k norms (only qwen3)")
  return sliding_window_keys(config)


FAMILY = Family(model_type="qwen2", class_prefix="Qwen2", read=_read, write=_write)
