"""AdamW with linear warm-up, cosine decay and global-norm clipping, from a typed config."""

from __future__ import annotations

import optax

from rlhfjax.config import OptimizerConfig


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
