"""Experience: rollout outputs laid out as sequences, then a typed pytree on the devices.

`Sequences` is what the rollout hands over on the host (token ids a rule reward reads).
`Experience` is the batch on the actor's mesh from scoring to update: it is uploaded once and
never comes back to the host; scorers on other meshes get its tokens device to device.

Letters: b batch, p prompt length, t response length, s = p + t. Prompts are left padded to
`p`, responses right padded to `t`, so response token `j` of every row sits at column `p + j`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import flax.struct
import jax
import numpy as np

from rlhfjax.data.records import PromptBatch, Record
from rlhfjax.flows.environments import SUMMED_STATS


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sequences:
  """One rollout batch on the host, ready to be sent to every scoring role."""

  prompts: list[np.ndarray]
  responses: list[np.ndarray]
  tokens_bs: np.ndarray
  """int32 prompt + response tokens."""
  attention_mask_bs: np.ndarray
  """int32, 1 on real tokens."""
  response_mask_bt: np.ndarray
  """float32, 1 on the response tokens the policy sampled (not on a conversation's
  observations: they are out of the policy loss and the KL)."""
  rollout_logprobs_bt: np.ndarray
  """float32 log-probs of the sampled tokens under the rollout policy's sampling distribution."""
  records: list[Record] = dataclasses.field(default_factory=list)
  """Each row's prompt record (its extra fields, for a rule reward): `metadata["records"]`."""
  environment_rewards: np.ndarray | None = None
  """[b] float32: each conversation's summed environment rewards (`rlhfjax.flows.environments`);
  None without an environment."""
  environment_rewards_bt: np.ndarray | None = None
  """[b, t] float32: the same rewards on the tokens that ended their turns (`place_turn_rewards`:
  what the token-level estimators read); None without an environment."""
  conversation_stats: dict[str, float] = dataclasses.field(default_factory=dict)
  """The batch's turns, limits and environment errors (`Conversations.stats`) and its
  observation share, for the iteration's row; empty without an environment."""

  @property
  def prompt_len(self) -> int:
    return self.tokens_bs.shape[1] - self.response_mask_bt.shape[1]

  @property
  def num_tokens(self) -> int:
    """Real prompt and response tokens: what tokens/s counts."""
    return int(self.attention_mask_bs.sum())


def assemble(
  prompts: Sequence[Sequence[int]],
  response_tokens: np.ndarray,
  response_lengths: np.ndarray,
  response_logprobs: np.ndarray,
  *,
  prompt_len: int,
  response_len: int,
  pad_id: int,
  records: Sequence[Record] | None = None,
  observed: np.ndarray | None = None,
  environment_turn_rewards: Sequence[Sequence[float]] | None = None,
) -> Sequences:
  """Lays prompts (left padded) and responses (right padded) out as `[b, p + t]` sequences;
  `records` (one per prompt; None: empty ones) ride along. `observed` (`[b, >= t]` bool, like
  the response tokens) marks a conversation's observations: real tokens, out of the response
  mask; `environment_turn_rewards`, each row's rewards per turn, are summed and placed on the
  tokens that ended the turns (`place_turn_rewards`)."""
  b = len(prompts)
  records = list(records) if records is not None else PromptBatch.of(prompts).records
  if len(records) != b:
    raise ValueError(f"{b} prompts but {len(records)} records")
  tokens = np.full((b, prompt_len + response_len), pad_id, np.int32)
  attention = np.zeros((b, prompt_len + response_len), np.int32)
  response_mask = np.zeros((b, response_len), np.float32)
  logprobs = np.zeros((b, response_len), np.float32)
  prompt_arrays, response_arrays = [], []
  for i, prompt in enumerate(prompts):
    prompt = np.asarray(prompt, np.int32)
    if not 0 < len(prompt) <= prompt_len:
      raise ValueError(f"prompt {i} has {len(prompt)} tokens; expected 1 to {prompt_len}")
    n = int(response_lengths[i])
    tokens[i, prompt_len - len(prompt) : prompt_len] = prompt
    attention[i, prompt_len - len(prompt) : prompt_len + n] = 1
    tokens[i, prompt_len : prompt_len + n] = response_tokens[i, :n]
    response_mask[i, :n] = 1.0 if observed is None else ~observed[i, :n]
    logprobs[i, :n] = response_logprobs[i, :n]
    prompt_arrays.append(prompt)
    response_arrays.append(np.asarray(response_tokens[i, :n], np.int32))
  return Sequences(
    prompts=prompt_arrays,
    responses=response_arrays,
    tokens_bs=tokens,
    attention_mask_bs=attention,
    response_mask_bt=response_mask,
    rollout_logprobs_bt=logprobs,
    records=records,
    environment_rewards=(
      None
      if environment_turn_rewards is None
      else np.asarray([sum(r) for r in environment_turn_rewards], np.float32)
    ),
    environment_rewards_bt=(
      None
      if environment_turn_rewards is None
      else place_turn_rewards(environment_turn_rewards, response_mask)
    ),
  )


def place_turn_rewards(
  turn_rewards: Sequence[Sequence[float]], response_mask_bt: np.ndarray
) -> np.ndarray:
  """`[b, t]` float32: row i's k-th turn reward on the last token of its k-th turn, a run of
  sampled tokens (the response mask's runs of 1: observations and padding are 0); rewards
  beyond the row's turns (a turn the environment stepped that sampled nothing) on its last
  sampled token; a row without sampled tokens gets none."""
  out = np.zeros(response_mask_bt.shape, np.float32)
  for i, rewards in enumerate(turn_rewards):
    sampled = response_mask_bt[i] > 0
    ends = np.flatnonzero(sampled & ~np.append(sampled[1:], False))
    if not len(ends):
      continue
    for k, reward in enumerate(rewards):
      out[i, ends[min(k, len(ends) - 1)]] += reward
  return out


def merged_conversation_stats(batches: Sequence[Sequences]) -> dict[str, float]:
  """The conversation stats of several batches as one: each mean weighted by its batch's rows,
  each count (`environments.SUMMED_STATS`) summed; empty without an environment."""
  with_stats = [s for s in batches if s.conversation_stats]
  rows = sum(s.tokens_bs.shape[0] for s in with_stats)
  out: dict[str, float] = {}
  for s in with_stats:
    weight = s.tokens_bs.shape[0] / rows
    for key, value in s.conversation_stats.items():
      add = value if key in SUMMED_STATS else value * weight
      out[key] = out.get(key, 0.0) + add
  return out


def take_rows(parts: Sequence[tuple[Sequences, Sequence[int]]]) -> Sequences:
  """One batch of the given rows of several batches, in order."""
  pick = lambda name: np.concatenate([getattr(s, name)[list(rows)] for s, rows in parts])
  return Sequences(
    prompts=[s.prompts[i] for s, rows in parts for i in rows],
    responses=[s.responses[i] for s, rows in parts for i in rows],
    tokens_bs=pick("tokens_bs"),
    attention_mask_bs=pick("attention_mask_bs"),
    response_mask_bt=pick("response_mask_bt"),
    rollout_logprobs_bt=pick("rollout_logprobs_bt"),
    records=[s.records[i] for s, rows in parts for i in rows],
    environment_rewards=(
      None if parts[0][0].environment_rewards is None else pick("environment_rewards")
    ),
    environment_rewards_bt=(
      None if parts[0][0].environment_rewards_bt is None else pick("environment_rewards_bt")
    ),
  )


@flax.struct.dataclass
class Experience:
  """One batch of experience on the devices (a pytree; absent parts are None).

  Filled stage by stage: the rollout's tokens and log-probs, then the scorers' log-probs,
  values and scores, then the advantages and returns an algorithm computes from them.
  """

  tokens_bs: jax.Array
  """int32 prompt + response tokens."""
  attention_mask_bs: jax.Array
  """int32, 1 on real tokens."""
  response_mask_bt: jax.Array
  """float32, 1 on response tokens."""
  rollout_logprobs_bt: jax.Array
  """Log-probs of the sampled tokens under the policy that generated them."""
  old_logprobs_bt: jax.Array | None = None
  """The actor's log-probs before this iteration's updates."""
  ref_logprobs_bt: jax.Array | None = None
  """The frozen reference policy's log-probs."""
  values_bt: jax.Array | None = None
  """The critic's values (critic-free algorithms: None)."""
  scores_b: jax.Array | None = None
  """The sequence reward."""
  environment_rewards_bt: jax.Array | None = None
  """A conversation's environment rewards on the tokens that ended their turns
  (`Sequences.environment_rewards_bt`, unweighted: their sum is in `scores_b`, times
  `reward.environment_coef`); None without an environment."""
  advantages_bt: jax.Array | None = None
  returns_bt: jax.Array | None = None
  is_weights_bt: jax.Array | None = None
  """The rollout correction's weight of each token in the policy loss
  (`rlhfjax.algorithms.correction`; 1 on response tokens without one, 0 elsewhere)."""

  @classmethod
  def from_sequences(cls, seqs: Sequences) -> dict[str, np.ndarray]:
    """The host arrays of a rollout batch, by field: what is uploaded once."""
    out = {
      "tokens_bs": seqs.tokens_bs,
      "attention_mask_bs": seqs.attention_mask_bs,
      "response_mask_bt": seqs.response_mask_bt,
      "rollout_logprobs_bt": seqs.rollout_logprobs_bt,
    }
    if seqs.environment_rewards_bt is not None:
      out["environment_rewards_bt"] = seqs.environment_rewards_bt
    return out
