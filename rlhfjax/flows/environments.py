"""Multi-turn rollouts: an environment per trajectory, turns taken in the rollout engine.

`rollout.environment` names a class or factory ('module:name', as `reward.fn` is). It is called
once per trajectory with the keyword arguments its signature takes of `tokenizer`, `seed` (of
the iteration and the row: a resumed iteration sees the same) and `record` (the prompt's
record), and the object it returns answers:

    reset(record) -> None | token ids | messages
        The prompt: None for the record's own (as the data pipeline prepared it), token ids as
        they are, or a conversation (a list of `{'role', 'content'}` messages) rendered by the
        run's chat template (`data.chat_template=True`).
    step(token ids of the model's turn) -> (observation, reward, done)
        The observation (token ids, or a text encoded without BOS) is appended to the
        trajectory as it is and the model continues from it; `reward` (a number) adds to the
        trajectory's; `done` ends it. Tools are whatever Python the environment calls here.

The engine keeps each trajectory's KV cache across turns (`rlhfjax.rollout.streaming`): the
history is never prefilled again nor re-rendered, so the trainer scores exactly the tokens the
policy sampled and the observations as they were given (`observed`). A trajectory also ends
after `rollout.max_turns` turns of the model, when its response reaches
`rollout.max_new_tokens` (observations included), or when an observation would not leave it
one token. A turn ends on a stop token or after `rollout.max_turn_tokens` tokens. Its reward
is the sum of its turns' (`rewards`), a part of the sequence score (`reward.environment_coef`,
`rlhfjax.cluster.rewards`).

`rollout.environment_workers` threads run the `reset`s of a batch, and the `step`s of the
trajectories that ended a turn in the same decode call, at once (an environment waiting on a
tool, a sandbox or a server); each trajectory's calls stay in order, and what they return is
applied in trajectory order, so a run is the same for any number of workers. Environments of
different trajectories then run on different threads: they must not share unguarded state.

An environment that raises or answers with the wrong types: one line naming it and the record;
`rollout.on_environment_error='error'` stops the run with it, 'end' ends that trajectory there
(its rewards so far kept) and counts it (`rollout/environment_errors`).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from rlhfjax import errors, tasks
from rlhfjax.data.records import PromptBatch, Record
from rlhfjax.data.tokenizer import Conversation
from rlhfjax.rollout import paging

log = logging.getLogger(__name__)

_KEYWORDS = ("tokenizer", "seed", "record")


class EnvironmentFault(ValueError):
  """An environment raised or broke its protocol (the message names it and the record): a
  user error, exit status 2."""


@dataclasses.dataclass
class _Trajectory:
  env: Any
  record: Record
  rewards: list[float] = dataclasses.field(default_factory=list)
  turns: int = 0
  ended: str = ""
  """Why it ended early: '' (the environment said done, or it never started another turn),
  'error', 'turns' or 'tokens'."""


def load_environment(path: str) -> Callable[..., Any]:
  """The factory `rollout.environment` names, with a clear error."""
  return tasks.load_callable(path, "environment")


@dataclasses.dataclass(frozen=True)
class _TurnFn:
  """`Conversations.turn`: the engine's `paging.TurnFn`, with the threads it may use."""

  step: Callable[[int, np.ndarray, bool, int], np.ndarray | None]
  concurrency: int

  def __call__(self, index: int, tokens: np.ndarray, stopped: bool, room: int):
    return self.step(index, tokens, stopped, room)


class Conversations:
  """One rollout batch's environments: `start` makes the prompts, `turn` is the engine's
  `paging.TurnFn`, then `rewards`, `turns` and `stats` read what happened."""

  def __init__(
    self,
    path: str,
    *,
    tokenizer: Any,
    vocab_size: int,
    chat_template: Any = None,
    max_turns: int,
    on_error: str = "error",
    workers: int = 1,
  ):
    self.path, self.tokenizer, self.template = path, tokenizer, chat_template
    self.max_turns, self.on_error, self.vocab_size = max_turns, on_error, vocab_size
    self.turn = _TurnFn(self._turn, workers)
    """The engine's `paging.TurnFn`: the environment's step, then the observation that
    continues the trajectory, or None when it ends."""
    factory = load_environment(path)
    try:
      params = inspect.signature(factory).parameters
      var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
      self._keywords = _KEYWORDS if var_kw else tuple(k for k in _KEYWORDS if k in params)
    except (TypeError, ValueError):  # (a builtin without a signature: no keywords)
      self._keywords = ()
    self._factory = factory
    self._rows: list[_Trajectory] = []

  def _fail(self, row: int, what: str) -> None:
    """An environment's fault on `row`: stop, or end the trajectory and count it."""
    t = self._rows[row]
    message = errors.one_line(f"environment {self.path!r} on {t.record.origin}: {what}")
    if self.on_error == "error":
      raise EnvironmentFault(message)
    log.warning("%s; the trajectory ends here (rollout.on_environment_error='end')", message)
    t.ended = "error"

  def start(self, batch: PromptBatch, seed: int, max_prompt_len: int) -> PromptBatch:
    """A new environment per row of `batch` and its `reset`: the batch's prompts."""
    self._rows = [_Trajectory(env=None, record=record) for record in batch.records]
    start = lambda a: self._start(*a, seed=seed, max_prompt_len=max_prompt_len)  # noqa: E731
    rows = list(enumerate(batch.tokens))
    prompts = paging.map_in_order(start, rows, self.turn.concurrency, "env")
    return PromptBatch(prompts, list(batch.records))

  def _start(self, i: int, tokens: Sequence[int], *, seed: int, max_prompt_len: int) -> list[int]:
    """Row `i`'s environment made and reset: its prompt."""
    record = self._rows[i].record
    values = {"tokenizer": self.tokenizer, "seed": (seed * 1_000_003 + i) % 2**31}
    values["record"] = record
    what = "creating it"
    try:
      env = self._rows[i].env = self._factory(**{k: values[k] for k in self._keywords})
      what = "reset"
      prompt = self._prompt(env.reset(record), tokens)
    except EnvironmentFault:
      raise
    except Exception as e:  # noqa: BLE001 (any fault of user code is reported, one line)
      self._fail(i, f"{what} raised {type(e).__name__}: {e}")
      prompt = list(tokens)
    if not 0 < len(prompt) <= max_prompt_len:
      self._fail(i, f"reset gave a prompt of {len(prompt)} tokens; 1 to {max_prompt_len} fit")
      prompt = list(tokens)
    return prompt

  def _prompt(self, value: Any, tokens: Sequence[int]) -> list[int]:
    if value is None:
      return list(tokens)
    if isinstance(value, list | tuple) and value and isinstance(value[0], dict):
      if self.template is None:
        raise ValueError("reset gave messages, which need a chat template: set data.chat_template")
      return list(self.template.encode(self.tokenizer, Conversation(tuple(value))))
    return _token_ids(value, "reset's prompt", self.vocab_size)

  def _turn(self, index: int, tokens: np.ndarray, stopped: bool, room: int) -> np.ndarray | None:
    """`turn` of trajectory `index`. (A turn that ended without a stop token, at
    `rollout.max_turn_tokens`, is the environment's to answer like any other.)"""
    del stopped
    t = self._rows[index]
    if t.ended:  # (an error at reset: the model's one answer is all)
      return None
    t.turns += 1
    try:
      out = t.env.step(np.asarray(tokens, np.int32))
      if not (isinstance(out, tuple | list) and len(out) == 3):
        raise TypeError(f"step must return (observation, reward, done), got {out!r:.80}")
      observation, reward, done = out
      if not isinstance(reward, numbers.Real) or isinstance(reward, bool):
        raise TypeError(f"the reward must be a number, got {reward!r:.80}")
      t.rewards.append(float(reward))
      if done or observation is None:
        return None
      if isinstance(observation, str):
        observation = self.tokenizer.encode(observation, add_bos=False)
      observation = _token_ids(observation, "the observation", self.vocab_size)
    except Exception as e:  # noqa: BLE001 (any fault of user code is reported, one line)
      self._fail(index, f"step raised {type(e).__name__}: {e}")
      return None
    if t.turns >= self.max_turns:
      t.ended = "turns"
      return None
    if not 0 < len(observation) < room:
      t.ended = "tokens"
      return None
    return np.asarray(observation, np.int32)

  def rewards(self) -> np.ndarray:
    """`[b]` float32: each trajectory's summed rewards."""
    return np.asarray([sum(t.rewards) for t in self._rows], np.float32)

  def turn_rewards(self) -> list[list[float]]:
    """Each trajectory's rewards, one per turn its environment stepped, in order."""
    return [list(t.rewards) for t in self._rows]

  def turns(self) -> np.ndarray:
    """`[b]` int32: the model's turns in each trajectory."""
    return np.asarray([max(t.turns, 1) for t in self._rows], np.int32)

  def stats(self) -> dict[str, float]:
    """What the batch's conversations did, for the iteration's row: means and shares over its
    conversations, and the count of `SUMMED_STATS` (how batches combine:
    `experience.merged_conversation_stats`)."""
    ended = [t.ended for t in self._rows]
    n = max(len(ended), 1)
    return {
      "rollout/turns_mean": float(self.turns().mean()) if self._rows else 0.0,
      "rollout/turn_limit_share": ended.count("turns") / n,
      "rollout/token_limit_share": ended.count("tokens") / n,
      "rollout/environment_errors": float(ended.count("error")),
    }


SUMMED_STATS = ("rollout/environment_errors",)
"""`Conversations.stats` that count (summed over batches); the others are means over rows."""


def _token_ids(value: Any, what: str, vocab_size: int) -> list[int]:
  """`value` as a list of token ids of the model's vocabulary, or a one-line error."""
  array = np.asarray(value)
  if array.ndim != 1 or not (array.size == 0 or np.issubdtype(array.dtype, np.integer)):
    raise TypeError(f"{what} must be token ids (a list of ints) or a text, got {value!r:.80}")
  if array.size and not (array.min() >= 0 and array.max() < vocab_size):
    raise ValueError(f"{what} has token ids outside the vocabulary [0, {vocab_size})")
  return array.astype(np.int64).tolist()
