"""The names config fields choose code by, declared here without the code.

A config is checked without importing what it selects: the registries that dispatch on these
names live in higher layers (`rlhfjax.algorithms`) and are built with `implement`, which fails
at import when a registry and its names part ways.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")

KL_ESTIMATORS = ("k1", "k2", "k3")
"""`ppo.kl_estimator`: `rlhfjax.algorithms.KL_ESTIMATORS`."""
KL_CONTROLLERS = ("fixed", "adaptive")
"""`ppo.kl_controller`: `rlhfjax.algorithms.KL_CONTROLLERS`."""
LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
"""`ppo.loss_agg`: `rlhfjax.algorithms.LOSS_AGGREGATIONS`."""
ROLLOUT_CORRECTIONS = ("none", "tis", "mis")
"""`ppo.rollout_correction`: `rlhfjax.algorithms.correction.CORRECTIONS`."""
CORRECTION_LEVELS = ("token", "sequence")
"""`ppo.rollout_correction_level`: a token's own ratio, or its sequence's geometric mean."""
DPO_LOSSES = ("sigmoid", "ipo")
"""`dpo.loss`: `rlhfjax.algorithms.DPO_LOSSES`."""
PIPELINE_SCHEDULES = ("gpipe", "1f1b")
"""`placement.pipeline_schedule`: `rlhfjax.schedules.SCHEDULES` (a layer above the config)."""


def implement(names: Sequence[str], implementations: dict[str, T]) -> dict[str, T]:
  """`implementations`, checked to implement exactly `names`, in their order."""
  if tuple(implementations) != tuple(names):
    raise ValueError(
      f"a registry implements {', '.join(implementations)}; its config names are {', '.join(names)}"
    )
  return implementations
