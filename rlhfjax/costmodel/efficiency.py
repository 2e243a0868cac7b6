"""Named efficiency factors: the fraction of each hardware peak a stage reaches.

Stage costs are first-principles counts (FLOPs, bytes read, bytes moved) divided by a peak rate
times one of these factors, plus fixed overheads (on a `host_shared` machine each fixed overhead
is one device's and grows with the group, `Hardware.per_device`). One profile per engine ships
as a JSON file in `profiles/` (`jax.json` is the default: what a well-tuned JAX stack reaches);
`scripts/calibrate.py` fits the factors of the machine at hand and writes the same format.
"""

from __future__ import annotations

import dataclasses
import json
import os

PROFILES_DIR = os.path.join(os.path.dirname(__file__), "profiles")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Efficiency:
  """Fractions of peak (0..1] and fixed overheads (seconds)."""

  train_mfu: float = 0.4
  """Matmul rate of train steps (forward and backward) as a fraction of peak FLOP/s."""
  forward_mfu: float = 0.5
  """Matmul rate of scoring forwards and of prefill."""
  decode_bw: float = 0.6
  """Fraction of memory bandwidth a decode step reaches reading weights and KV cache."""
  decode_mfu: float = 0.3
  """Matmul rate of a decode step once the batch makes it compute-bound."""
  collective_bw: float = 0.7
  """Fraction of link bandwidth collectives (all-gather, reduce-scatter, all-reduce) reach."""
  transfer_bw: float = 0.5
  """Fraction of link bandwidth the weight sync between layouts reaches."""
  host_bw: float = 0.8
  """Fraction of the host link (PCIe) the engine's host copies reach: pinned buffers about
  0.8, pageable ones (copied through a staging buffer by the CPU) about half of that."""
  decode_step_s: float = 0.0
  """Fixed cost of one decode step (dispatch, sampling, host loop), per step."""
  layer_s: float = 0.0
  """Fixed cost per layer per forward or decode step (kernel launches)."""
  stage_s: float = 0.0
  """Fixed cost of dispatching one stage (a jitted call and its wait)."""
  update_s: float = 0.0
  """Fixed cost of one optimizer step beyond its passes (the update's own kernels, gradient
  clipping and reduction), per call."""
  transfer_s: float = 0.0
  """Fixed cost of the weight sync per device it reads from or writes to (one piece of every
  array per device)."""
  optimizer_bw: float = 0.5
  """Fraction of memory bandwidth the optimizer update reaches (reads and writes its state)."""
  replicated_activations: bool = False
  """The engine's train step keeps SwiGLU intermediates and logits whole on every FSDP device
  (the current rlhfjax step, see `memory`); False where activations split over the batch."""
  fused_attention: bool = False
  """The engine's attention never materialises the `[h, s, s]` weights (flash attention)."""
  frees_finished: bool = False
  """Under static batching a finished answer leaves the batch (vLLM's scheduler): the wave
  still lasts as long as its longest answer, but reads and computes only the live ones."""
  generation_engine: str = "jax"
  """Free text naming the engine the factors describe (shown in reports)."""

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if field.name.endswith(("_mfu", "_bw")) and not 0.0 < value <= 1.0:
        raise ValueError(f"efficiency.{field.name} must be in (0, 1], got {value}")
      if field.name.endswith("_s") and value < 0:
        raise ValueError(f"efficiency.{field.name} must be >= 0, got {value}")


def load_efficiency(path: str | None) -> Efficiency:
  """Factors from a JSON file (a profile, or a calibration with an `efficiency` key); the
  default profile (`profiles/jax.json`) when `path` is None or a profile name."""
  if path is None:
    path = os.path.join(PROFILES_DIR, "jax.json")
  elif not os.path.exists(path) and os.path.exists(os.path.join(PROFILES_DIR, f"{path}.json")):
    path = os.path.join(PROFILES_DIR, f"{path}.json")
  try:
    with open(path) as f:
      data = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise ValueError(f"efficiency file {path}: {e}") from None
  data = data.get("efficiency", data)
  known = {f.name for f in dataclasses.fields(Efficiency)}
  unknown = sorted(set(data) - known - {"comment"})
  if unknown:
    raise ValueError(f"efficiency file {path}: unknown factors {', '.join(unknown)}")
  return Efficiency(**{k: v for k, v in data.items() if k in known})


def profile_names() -> tuple[str, ...]:
  return tuple(sorted(f[:-5] for f in os.listdir(PROFILES_DIR) if f.endswith(".json")))
