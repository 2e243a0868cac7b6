"""AdamW with linear warm-up, cosine decay and global-norm clipping, from a typed config."""

from __future__ import annotations

import dataclasses

import optax

from rlhfjax import ranges


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
  """One optimizer per trained role (actor, critic)."""

  learning_rate: float = 1e-5
  """Peak learning rate, reached after `warmup_steps`."""
  warmup_steps: int = 0
  decay: str = "cosine"
  """'cosine' (to `final_lr_fraction` of the peak), 'linear', or 'constant' after warm-up."""
  final_lr_fraction: float = 0.1
  weight_decay: float = 0.0
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  max_grad_norm: float = 1.0
  """Clip gradients to this global norm (0 disables clipping)."""

  def __post_init__(self):
    if self.decay not in ("cosine", "linear", "constant"):
      raise ValueError(f"optimizer.decay must be cosine, linear or constant, got {self.decay!r}")
    ranges.check(
      "optimizer",
      self,
      learning_rate=ranges.POSITIVE,
      warmup_steps=ranges.NON_NEGATIVE,
      final_lr_fraction=ranges.FRACTION,
      weight_decay=ranges.NON_NEGATIVE,
      b1=ranges.between(0, 1, high_open=True),
      b2=ranges.between(0, 1, high_open=True),
      eps=ranges.POSITIVE,
      max_grad_norm=ranges.NON_NEGATIVE,
    )


def learning_rate_schedule(cfg: OptimizerConfig, total_updates: int) -> optax.Schedule:
  """Warm-up then decay over `total_updates` optimizer updates."""
  decay_steps = max(total_updates - cfg.warmup_steps, 1)
  final = cfg.learning_rate * cfg.final_lr_fraction
  if cfg.decay == "cosine":
    after = optax.cosine_decay_schedule(cfg.learning_rate, decay_steps, cfg.final_lr_fraction)
  elif cfg.decay == "linear":
    after = optax.linear_schedule(cfg.learning_rate, final, decay_steps)
  else:
    after = optax.constant_schedule(cfg.learning_rate)
  if cfg.warmup_steps == 0:
    return after
  warmup = optax.linear_schedule(0.0, cfg.learning_rate, cfg.warmup_steps)
  return optax.join_schedules([warmup, after], [cfg.warmup_steps])


# `optax.apply_if_finite` applies a non-finite update anyway after this many in a row; the
# trainers stop long before (`max_nonfinite_updates`), so it never does.
_NEVER = 2**30


def make_optimizer(cfg: OptimizerConfig, total_updates: int) -> optax.GradientTransformation:
  """Clipping and AdamW, skipping any update whose gradients are not all finite.

  A skipped update leaves the parameters and the moments as they were (`optax.apply_if_finite`);
  the train step reports it so the trainer can count skips and stop after too many in a row.
  """
  chain = []
  if cfg.max_grad_norm > 0:
    chain.append(optax.clip_by_global_norm(cfg.max_grad_norm))
  chain.append(
    optax.adamw(
      learning_rate_schedule(cfg, total_updates),
      b1=cfg.b1,
      b2=cfg.b2,
      eps=cfg.eps,
      weight_decay=cfg.weight_decay,
    )
  )
  return optax.apply_if_finite(optax.chain(*chain), max_consecutive_errors=_NEVER)
