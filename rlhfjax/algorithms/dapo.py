"""DAPO's reward shaping and sampling rule (Yu et al., 2025); its decoupled clip is
`clipped_policy_loss(clip_eps_high=...)`.

Letters: b batch, g groups (prompts), k samples per group.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def overlong_penalty(lengths_b: jnp.ndarray, *, max_len: int, buffer: int) -> jnp.ndarray:
  """Soft overlong punishment: 0 up to `max_len - buffer` tokens, then falling linearly to -1
  at `max_len`, and -1 beyond:

    R(L) = 0                          L <= Lmax - Lc
         = (Lmax - Lc - L) / Lc       Lmax - Lc < L <= Lmax
         = -1                         L > Lmax
  """
  lengths_b = jnp.asarray(lengths_b, jnp.float32)
  start = max_len - buffer
  return jnp.where(lengths_b <= start, 0.0, jnp.maximum((start - lengths_b) / buffer, -1.0))


def groups_with_signal(scores_b: np.ndarray, group_size: int) -> np.ndarray:
  """Dynamic sampling's filter, `bool[g]`: groups whose scores are not all equal. A group with
  one score for every sample has zero group-relative advantage and so no gradient."""
  groups_gk = np.asarray(scores_b).reshape(-1, group_size)
  return groups_gk.max(-1) > groups_gk.min(-1)
