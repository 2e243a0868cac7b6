"""Verifiable rewards: prompt records' extra fields reach the reward function as
`metadata["records"]` (aligned with the responses, on two placements, across a resume), bad or
missing fields name `file:line`, the exact-match reward against a hand reference, and the
bundled arithmetic task (deterministic, held-out sums never trained on). The arithmetic pipeline's
run is in test_verifiable_rewards_e2e.py."""

from __future__ import annotations

import json
import os
import pathlib
import runpy
import signal

import numpy as np
import pytest

from rlhfjax import data, tasks
from rlhfjax.config import from_config_dict
from rlhfjax.data.byte_tokenizer import ByteTokenizer
from rlhfjax.data.records import PromptBatch, Record, RecordFieldError
from rlhfjax.flows import experience
from rlhfjax.flows.ppo import PPOFlow
from rlhfjax.reward_fn_check import RewardFnError
from rlhfjax.runner import Runner

pytestmark = pytest.mark.integration

_ROOT = pathlib.Path(__file__).parent.parent
_BYTE = ByteTokenizer()


def _write(path: pathlib.Path, lines: list) -> str:
  path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
  return str(path)


def _prompt_lines(n: int) -> list:
  """Prompt lines 'q{i}' with extra fields naming them; a blank line 3 shifts the numbering."""
  lines = [{"prompt": f"q{i}", "id": i, "answer": str(7 * i), "tags": ["x", i]} for i in range(n)]
  return lines[:2] + [""] + lines[2:]


def _line_of(i: int) -> int:
  return i + 1 if i < 2 else i + 2


# ----------------------------------------------------------------------------------------------
# Records through the data pipeline.


def test_records_carry_the_extra_fields_named_by_file_and_line(tmp_path):
  path = _write(tmp_path / "prompts.jsonl", _prompt_lines(6))
  dataset = data.prepare("prompt", path, tmp_path / "cache")
  stream = data.prompt_iterator(
    dataset.source(), _BYTE, max_prompt_len=8, seed=0, repeat=False, origin=dataset.path()
  )
  batch = stream.take_batch(10, allow_fewer=True)
  assert len(batch) == 6
  for i, (tokens, record) in enumerate(zip(batch.tokens, batch.records, strict=True)):
    assert _BYTE.decode(tokens) == f"q{i}"
    assert dict(record) == {"id": i, "answer": str(7 * i), "tags": ["x", i]}
    assert record.origin == f"{dataset.path()}:{_line_of(i)}"
  with pytest.raises(RecordFieldError, match=r"prompts\.jsonl:5: .*no field 'solution'"):
    batch.records[3]["solution"]
  with pytest.raises(
    RecordFieldError,
    match=r"prompts\.jsonl:4: field 'id' of the prompt record must be str, got int",
  ):
    batch.records[2].require("id", str)
  assert batch.records[2].require("id", int) == 2 and batch.records[2].get("nope") is None
  # A line with no extra field still names its origin (an empty record).
  plain = data.prepare("prompt", _write(tmp_path / "plain.jsonl", [{"prompt": "z"}]), tmp_path)
  (record,) = (
    data.prompt_iterator(
      plain.source(), _BYTE, max_prompt_len=8, seed=0, repeat=False, origin=plain.path()
    )
    .take_batch(1)
    .records
  )
  assert record == {} and record.origin == f"{plain.path()}:1"


def test_records_resume_with_the_stream(tmp_path):
  path = _write(tmp_path / "prompts.jsonl", _prompt_lines(11))
  dataset = data.prepare("prompt", path, tmp_path / "cache")
  make = lambda: data.prompt_iterator(
    dataset.source(), _BYTE, max_prompt_len=8, seed=3, origin=dataset.path()
  )
  whole = make()
  whole.take_batch(4)
  state = json.loads(json.dumps(whole.get_state()))
  expected = whole.take_batch(9)
  resumed = make()
  resumed.set_state(state)
  got = resumed.take_batch(9)
  assert got.tokens == expected.tokens
  assert [(dict(r), r.origin) for r in got.records] == [
    (dict(r), r.origin) for r in expected.records
  ]


def test_a_bad_extra_field_or_line_is_an_error_naming_file_and_line(tmp_path):
  path = _write(tmp_path / "prompts.jsonl", [{"prompt": "a", "x": 1}, '{"prompt": "b", "w": NaN}'])
  with pytest.raises(data.DataError, match=r"prompts\.jsonl:2: field 'w' holds NaN"):
    data.prepare("prompt", path, tmp_path / "cache")
  path = _write(tmp_path / "p2.jsonl", [{"prompt": "a", "answer": "1"}, '{"prompt": "b", "ans'])
  with pytest.raises(data.DataError, match=r"p2\.jsonl:2: invalid JSON"):
    data.prepare("prompt", path, tmp_path / "cache")


def test_pending_prompts_and_rows_keep_their_records():
  records = [Record({"answer": str(i)}, f"f.jsonl:{i + 1}") for i in range(3)]
  batch = PromptBatch([[256, 49 + i] for i in range(3)], records).repeat(2)
  assert [r.origin for r in batch.records] == [f"f.jsonl:{i + 1}" for i in (0, 0, 1, 1, 2, 2)]
  # A checkpoint's meta holds the batches generated ahead (async rollout) as JSON.
  flow = PPOFlow.__new__(PPOFlow)
  flow.kl_state, flow.skipped_in_row, flow.pending_prompts = None, 0, [batch]
  flow.kl_state = type("KL", (), {"coef": 0.5})()
  meta = json.loads(json.dumps(flow.meta()))
  flow.restore({}, meta)
  assert len(flow.pending_prompts) == 1 and flow.pending_prompts[0].tokens == batch.tokens
  assert [(dict(r), r.origin) for r in flow.pending_prompts[0].records] == [
    (dict(r), r.origin) for r in batch.records
  ]
  # DAPO's dynamic sampling assembles a batch from rows of several: records follow their rows.
  seqs = experience.assemble(
    batch.tokens,
    np.full((6, 2), 50, np.int32),
    np.full(6, 2),
    np.zeros((6, 2), np.float32),
    prompt_len=4,
    response_len=2,
    pad_id=_BYTE.pad_id,
    records=batch.records,
  )
  picked = experience.take_rows([(seqs, [4, 5]), (seqs, [0, 1])])
  assert [r["answer"] for r in picked.records] == ["2", "2", "0", "0"]


# ----------------------------------------------------------------------------------------------
# The exact-match reward.


def _ids(text: str, stop: bool = True) -> np.ndarray:
  return np.array(_BYTE.encode(text, add_bos=False) + ([_BYTE.eos_id] if stop else []), np.int32)


def test_exact_match_reward_against_a_hand_reference():
  cases = [  # (response, stopped, answer, hand-computed reward)
    ("85", True, "85", 1.0),
    ("85", False, "85", 1.0),
    (" 85 ", True, "85", 1.0),
    ("86", True, "85", 0.0),
    ("850", True, "85", 0.0),
    ("8", True, "85", 0.0),
    ("", True, "85", 0.0),
    ("1 0", True, "10", 0.0),
    ("104", True, 104, 1.0),
    ("0", True, "0", 1.0),
  ]
  responses = [_ids(r, s) for r, s, _, _ in cases]
  records = [Record({"answer": a}, f"t.jsonl:{i + 1}") for i, (_, _, a, _) in enumerate(cases)]
  meta = {"step": 0, "tokenizer": _BYTE, "records": records}
  got = tasks.exact_match_reward([], responses, meta)
  assert got.dtype == np.float32
  np.testing.assert_array_equal(got, [want for *_, want in cases])


def test_reward_fn_errors_name_the_record_and_the_field():
  reward = tasks.load_reward_fn("rlhfjax.tasks:exact_match_reward")
  meta = lambda records: {"step": 0, "tokenizer": _BYTE, "records": records}
  records = [Record({"answer": "1"}, "prompts.jsonl:6"), Record({"ans": "2"}, "prompts.jsonl:7")]
  with pytest.raises(RewardFnError, match=r"prompts\.jsonl:7: .*no field 'answer'") as e:
    reward([], [_ids("1"), _ids("2")], meta(records))
  assert "\n" not in str(e.value)
  records[1] = Record({"answer": [2]}, "prompts.jsonl:7")
  with pytest.raises(
    RewardFnError, match=r"prompts\.jsonl:7: field 'answer' of the prompt record must be str or int"
  ):
    reward([], [_ids("1"), _ids("2")], meta(records))


# ----------------------------------------------------------------------------------------------
# The arithmetic task.


def test_arithmetic_task_is_deterministic_and_holds_out_its_eval_sums():
  first, again = tasks.arithmetic_datasets(), tasks.arithmetic_datasets()
  assert first == again and tasks.arithmetic_datasets(seed=5) != first
  small = tasks.arithmetic_datasets(seed=2, digits=1)
  assert sorted(p["prompt"] for p in small["prompt"]) == sorted(
    f"{a}+{b}=" for a in range(10) for b in range(10)
  )
  # The bundled files are the generator's output, split three ways as the pipeline's configs
  # read them (10,000 lines in file order): demonstrations are the first 5,000 sums, GRPO's
  # 'train[50%:90%]' the next 4,000, the held-out 'train[90%:]' the last 1,000.
  for kind in ("prompt", "demonstration"):
    lines = pathlib.Path(data.bundled_path("arithmetic", kind)).read_text().splitlines()
    assert [json.loads(x) for x in lines] == first[kind]
  sums = [p["prompt"] for p in first["prompt"]]
  demonstrated, rl, held_out = set(sums[:5000]), set(sums[5000:9000]), set(sums[9000:])
  assert (len(demonstrated), len(rl), len(held_out)) == (5000, 4000, 1000)
  assert {d["prompt"] for d in first["demonstration"]} == demonstrated
  assert not demonstrated & rl and not demonstrated & held_out and not rl & held_out
  cd = runpy.run_path(str(_ROOT / "configs" / "pipeline_arithmetic.py"))["get_config"]()
  assert (cd.ppo.data.train_split, cd.ppo.data.eval_split) == ("train[50%:90%]", "train[90%:]")
  with pytest.raises(ValueError, match="leave no"):
    tasks.arithmetic_datasets(demonstrated=0.95)
  for p in first["prompt"]:
    a, b = p["prompt"][:-1].split("+")
    assert p["answer"] == str(int(a) + int(b))
  for d in first["demonstration"][:50]:
    a, b = d["prompt"][:-1].split("+")
    assert d["response"] == str(int(a) + int(b))


# ----------------------------------------------------------------------------------------------
# Records through whole GRPO iterations on two placements.

_SEEN: dict[str, list] = {}
_STOP_AT: dict[str, int] = {}


def record_reward(prompts, responses, metadata):
  """Logs the records it got (checking each against its prompt's text) and scores a field; a
  run named in `_STOP_AT` gets SIGTERM at that step, as a preempted job would."""
  key = os.environ.get("_H11A_RUN", "?")
  records = metadata["records"]
  assert len(records) == len(prompts) == len(responses)
  for prompt, record in zip(prompts, records, strict=True):
    assert metadata["tokenizer"].decode(prompt) == f"q{record['id']}", (prompt, record)
  _SEEN.setdefault(key, []).append((metadata["step"], [(r["id"], r.origin) for r in records]))
  if _STOP_AT.get(key) == metadata["step"]:
    os.kill(os.getpid(), signal.SIGTERM)
  return np.array(
    [float(r["id"] % 3) + 0.1 * len(x) for r, x in zip(records, responses, strict=True)]
  )


def _grpo(prompts: str, steps: int = 2, **changes):
  """GRPO with the async rollout (the next batch's prompts wait in the flow) on 2 devices."""
  cd = runpy.run_path(str(_ROOT / "configs" / "grpo_tiny.py"))["get_config"]("disaggregated_async")
  cd.total_steps = steps
  cd.placement.num_devices = 2
  cd.placement.rollout_tensor = 1
  cd.rollout.batch_size = 8
  cd.rollout.max_prompt_len = 8
  cd.rollout.max_new_tokens = 4
  cd.eval.num_prompts = 4
  cd.checkpoint.every_steps = 1
  cd.data.prompts = prompts
  cd.data.train_split = "train"
  cd.data.eval_split = "train[:4]"
  cd.reward.fn = f"{__name__}:record_reward"
  for key, value in changes.items():
    cd[key] = value
  return from_config_dict(cd)


def _run(key: str, cfg, workdir, monkeypatch):
  monkeypatch.setenv("_H11A_RUN", key)
  _SEEN.pop(key, None)
  runner = Runner(cfg, str(workdir), show_progress=False)
  result = runner.run()
  return runner, result, _SEEN.pop(key)


def test_records_reach_the_reward_aligned_with_group_samples(tmp_path, monkeypatch):
  path = _write(tmp_path / "prompts.jsonl", _prompt_lines(13))
  _, _, calls = _run("async", _grpo(path), tmp_path / "run", monkeypatch)
  # Evaluation (step -1) before and after, and one call per iteration.
  assert [step for step, _ in calls] == [-1, 0, 1, -1]
  for step, rows in calls:
    for i, (ident, origin) in enumerate(rows):
      assert origin == f"{path}:{_line_of(ident)}"
      if step >= 0:  # groups of 4 samples of one prompt share its record
        assert rows[i - i % 4] == (ident, origin)
    if step >= 0:
      assert len({ident for ident, _ in rows}) == 2
  # Evaluation sees the first held-out prompts, in file order (the last one pads the batch).
  assert [ident for ident, _ in calls[0][1]] == [0, 1, 2, 3, 3, 3, 3, 3]
  # The two iterations took different prompts from the shuffled stream.
  assert {i for i, _ in calls[1][1]}.isdisjoint({i for i, _ in calls[2][1]})


@pytest.mark.slow
def test_records_after_a_resume_are_the_uninterrupted_runs(tmp_path, monkeypatch):
  """SIGTERM after iteration 0 checkpoints the async rollout's pending batch (prompts and
  records); the resumed run scores the same records as the uninterrupted one."""
  path = _write(tmp_path / "prompts.jsonl", _prompt_lines(13))
  _, _, whole = _run("whole", _grpo(path, 3), tmp_path / "whole", monkeypatch)
  _STOP_AT["parts"] = 0
  try:
    _, first, _ = _run("parts", _grpo(path, 3), tmp_path / "parts", monkeypatch)
  finally:
    _STOP_AT.pop("parts")
  assert first.preempted
  runner, _, resumed = _run("parts", _grpo(path, 3), tmp_path / "parts", monkeypatch)
  assert runner.start_step == 1
  steps = lambda calls: [(s, rows) for s, rows in calls if s >= 1]
  assert [s for s, _ in steps(whole)] == [1, 2]
  assert steps(resumed) == steps(whole)


# ----------------------------------------------------------------------------------------------
# The arithmetic pipeline: SFT then GRPO, rewarded by exact match.


def test_the_arithmetic_pipeline_config_validates():
  cd = runpy.run_path(str(_ROOT / "configs" / "pipeline_arithmetic.py"))["get_config"]()
  assert "rm" not in cd
  sft = from_config_dict(cd.sft)
  grpo = from_config_dict(cd.ppo)
  assert sft.data.task == grpo.data.task == "arithmetic"
  assert grpo.algorithm.name == "grpo" and grpo.reward.fn == "rlhfjax.tasks:exact_match_reward"
