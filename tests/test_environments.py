"""The environment protocol (`rlhfjax.flows.environments.Conversations`) without a model: what a
factory is given, prompts from `reset` (the record's, ids, or messages through the chat
template), observations as ids or text, rewards summed, turn and token limits, and every fault
an environment can make reported in one line naming it and the record."""

import threading

import numpy as np
import pytest

from rlhfjax.data.byte_tokenizer import ByteTokenizer
from rlhfjax.data.records import PromptBatch, Record
from rlhfjax.data.tokenizer import ChatTemplate, Conversation
from rlhfjax.flows.environments import Conversations, EnvironmentFault

pytestmark = pytest.mark.unit

TOKENIZER = ByteTokenizer()
MADE: list[dict] = []


class Echo:
  """Takes every keyword; its prompt depends on the record; says back the turn's length, with
  reward 0.5 a turn, for `record["turns"]` turns."""

  def __init__(self, tokenizer, seed, record):
    MADE.append({"tokenizer": tokenizer, "seed": seed, "record": record})
    self.turns = 0

  def reset(self, record):
    return None if record["kind"] == "own" else TOKENIZER.encode(record["kind"])

  def step(self, tokens):
    self.turns += 1
    return f"<{len(tokens)}>", 0.5, self.turns >= self.limit if hasattr(self, "limit") else False


class Chat:
  def reset(self, record):
    return [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
            {"role": "user", "content": record["q"]}]  # fmt: skip

  def step(self, tokens):
    return [1, 2, 3], 1.0, True


class Forever:
  def reset(self, record):
    return None

  def step(self, tokens):
    return [7], 0.25, False


def _batch(*records):
  return PromptBatch(
    [TOKENIZER.encode("p") for _ in records],
    [Record(r, f"data.jsonl:{i + 1}") for i, r in enumerate(records)],
  )


def _conversations(name, **kw):
  kw = {"tokenizer": TOKENIZER, "vocab_size": TOKENIZER.vocab_size, "max_turns": 3, **kw}
  return Conversations(f"{__name__}:{name}", **kw)


def test_a_factory_gets_what_it_takes_and_reset_makes_the_prompt():
  del MADE[:]
  convs = _conversations("Echo")
  batch = _batch({"kind": "own"}, {"kind": "abc"})
  prompts = convs.start(batch, seed=5, max_prompt_len=8)
  assert prompts.tokens == [TOKENIZER.encode("p"), TOKENIZER.encode("abc")]
  assert [m["record"] for m in MADE] == batch.records and MADE[0]["tokenizer"] is TOKENIZER
  assert MADE[0]["seed"] != MADE[1]["seed"]  # one per row, from the iteration's seed
  # Text observations are encoded without BOS; rewards sum; the turn limit ends it.
  obs = convs.turn(0, np.asarray([65, 66]), True, 20)
  assert obs.tolist() == TOKENIZER.encode("<2>", add_bos=False)
  assert convs.turn(0, np.asarray([65]), True, 20) is not None
  assert convs.turn(0, np.asarray([65]), True, 20) is None  # the third turn: max_turns
  np.testing.assert_allclose(convs.rewards(), [1.5, 0.0])
  assert convs.turns().tolist() == [3, 1]
  assert convs.stats()["rollout/turn_limit_share"] == 0.5


def test_messages_are_rendered_by_the_chat_template():
  convs = _conversations("Chat", chat_template=ChatTemplate())
  prompts = convs.start(_batch({"q": "2+2?"}), seed=0, max_prompt_len=64)
  messages = Chat().reset({"q": "2+2?"})
  assert prompts.tokens[0] == ChatTemplate().encode(TOKENIZER, Conversation(tuple(messages)))
  with pytest.raises(EnvironmentFault, match=r"reset raised ValueError: .*chat template"):
    _conversations("Chat").start(_batch({"q": "x"}), seed=0, max_prompt_len=64)


def test_an_environment_that_never_ends_is_stopped_by_the_limits():
  convs = _conversations("Forever", max_turns=100)
  convs.start(_batch({}), seed=0, max_prompt_len=8)
  limit, used = 16, 0  # the response's token limit; each turn 3 tokens, each observation 1
  while True:
    used += 3
    obs = convs.turn(0, np.asarray([65, 66, 67]), True, limit - used)
    if obs is None:
      break
    used += len(obs)
  # Turns end at 3, 7, 11 and 15 tokens: after the fourth, 1 token is left, and an
  # observation must leave the model one.
  assert convs.turns().tolist() == [4] and used == 15
  assert convs.stats()["rollout/token_limit_share"] == 1.0
  np.testing.assert_allclose(convs.rewards(), [1.0])


class Raises:
  def reset(self, record):
    return None

  def step(self, tokens):
    raise ValueError("tool\nbroke")  # (a message over two lines: one line)


class WrongReward:
  def reset(self, record):
    return None

  def step(self, tokens):
    return [1], "high", False


class OutOfVocabulary:
  def reset(self, record):
    return None

  def step(self, tokens):
    return [5, 100_000], 0.0, False


class BadInit:
  def __init__(self):
    raise RuntimeError("no tool server")


@pytest.mark.parametrize(
  ("name", "message"),
  [
    ("Raises", r"step raised ValueError: tool broke"),
    ("WrongReward", r"step raised TypeError: the reward must be a number, got 'high'"),
    ("OutOfVocabulary", r"token ids outside the vocabulary \[0, 261\)"),
    ("BadInit", r"creating it raised RuntimeError: no tool server"),
  ],
)
def test_a_faulty_environment_is_one_line_naming_it_and_the_record(name, message, caplog):
  batch = _batch({}, {})
  with pytest.raises(EnvironmentFault, match=message) as error:
    convs = _conversations(name)
    convs.start(batch, seed=0, max_prompt_len=8)
    convs.turn(1, np.asarray([65]), True, 10)
  line = str(error.value)
  assert "\n" not in line and f"{__name__}:{name}" in line and "data.jsonl:" in line
  # 'end': the trajectory ends there with its rewards so far, the others go on.
  convs = _conversations(name, on_error="end")
  convs.start(batch, seed=0, max_prompt_len=8)
  assert convs.turn(1, np.asarray([65]), True, 10) is None
  assert convs.stats()["rollout/environment_errors"] >= 1
  assert "the trajectory ends here" in caplog.text


MEETING: list = []  # the barrier `Meets` waits at, set by the test


class Meets:
  """Its reset waits until every row's is running (`MEETING[0]`, a barrier): it returns only
  when the resets run at the same time."""

  def __init__(self, seed):
    self.seed = seed

  def reset(self, record):
    MEETING[0].wait()
    return [1 + self.seed % 200, 2]

  def step(self, tokens):
    return [3], 1.0, True


def test_workers_reset_the_rows_at_once_with_the_prompts_of_one_by_one():
  """`rollout.environment_workers` 4: the 4 resets run at once (they meet at a barrier, whose
  time-out would break it one by one), the prompts are those of one worker, in row order, and
  the engine is told it may take 4 turns at once (`concurrency`); a fault still stops the run
  in one line."""
  batch = _batch({}, {}, {}, {})
  MEETING[:] = [threading.Barrier(1)]
  want = _conversations("Meets").start(batch, seed=3, max_prompt_len=8).tokens
  MEETING[:] = [threading.Barrier(4, timeout=120)]
  convs = _conversations("Meets", workers=4)
  assert convs.start(batch, seed=3, max_prompt_len=8).tokens == want
  assert len(set(map(tuple, want))) == 4 and convs.turn.concurrency == 4
  assert convs.turn(2, np.asarray([65]), True, 10) is None
  np.testing.assert_allclose(convs.rewards(), [0, 0, 1, 0])
  with pytest.raises(EnvironmentFault, match="creating it raised RuntimeError: no tool server"):
    _conversations("BadInit", workers=4).start(batch, seed=0, max_prompt_len=8)
