"""Exact resume of every flow beyond PPO, in this process (PPO's kill -9, Ctrl-C and SIGTERM
through the script: test_resume_e2e.py and test_front_door_e2e.py; DPO killed with SIGKILL
through scripts/train.py: test_resume_algorithms.py).

Each algorithm's shipped config runs uninterrupted for 3 steps, writing checkpoints 2 and 3 (the
last, off the `every_steps` grid, forced at the end). A copy of its workdir is put back into the
state a run killed during the save of step 3 leaves (checkpoint 3 not renamed into place, the
row and timeline of step 2 written, no finished marker), and a new Runner resumes it: from step
2, it must repeat the uninterrupted run exactly, every metrics row, the timeline's stages and
the final checkpoint's fingerprints, which hash every array (parameters, optimizer state, the
flow's own arrays) and the JSON state (data iterators, controllers). All the state is in the
checkpoint: nothing else the first run held matters.
"""

import json
import pathlib
import shutil

import pytest
from runs_testing import shipped_config, timeline_entries

from rlhfjax import checkpoint as ckpt
from rlhfjax import programs, rerun
from rlhfjax.runner import Runner

pytestmark = pytest.mark.integration

VOLATILE = ("time/", "throughput/")
STEPS = 3
_COMMON = {
  "total_steps": STEPS,
  "checkpoint.every_steps": 2,
  "rollout.batch_size": 8,
  "rollout.max_new_tokens": 8,
  "eval.num_prompts": 0,
  "reward.model_coef": 0.5,  # continuous scores: every group and pair carries a signal
}
# Each run: its shipped config and what it changes beyond _COMMON.
RUNS = {
  "grpo": ("grpo", {}),
  # Checkpoints of the adapters and their moments alone: the resume reloads the base.
  "grpo_lora": ("grpo_lora", {}),
  "rloo": ("rloo", {}),
  # Conversations: the calculator's observations, a turn limit; the environments are made
  # again from the records and the iteration's seed.
  "grpo_conversations": (
    "grpo",
    {
      "data.task": "arithmetic",
      "reward.fn": "",
      "rollout.environment": "examples.calculator:Calculator",
      "rollout.max_turns": 3,
      "rollout.max_turn_tokens": 4,
      "rollout.max_prompt_len": 8,
      "rollout.max_new_tokens": 16,
    },
  ),
  "reinforce_pp": ("reinforce_pp", {}),
  "dapo": ("dapo", {}),
  "dpo": ("dpo", {"rollout.max_prompt_len": 40, "rollout.max_new_tokens": 40}),
  "online_dpo": ("online_dpo", {}),
  "rejection_sampling": (
    "ppo",
    {"algorithm.flow": "examples.rejection_sampling:make_flow", "ppo.group_size": 4},
  ),
}


def changes(name: str, steps: int = STEPS) -> tuple[str, dict]:
  """The shipped config `name` runs and what it changes in it."""
  config, own = RUNS[name]
  return config, {**_COMMON, **own, "total_steps": steps}


def config(name: str, steps: int = STEPS):
  shipped, changed = changes(name, steps)
  return shipped_config(f"{shipped}_tiny", changed)


def _rows(workdir: pathlib.Path) -> list[dict]:
  rows = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
  return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


def _final_fingerprints(workdir: pathlib.Path) -> dict:
  step_dir = workdir / "checkpoints" / str(STEPS)
  return json.loads((step_dir / "fingerprints" / "metadata").read_text())


_UNINTERRUPTED: dict[str, pathlib.Path] = {}
"""name -> the workdir of its uninterrupted run: one per worker, read by both files."""


def uninterrupted_run(name: str, tmp_path_factory) -> pathlib.Path:
  """The workdir of `name`'s uninterrupted run (run once per process; leave it as it is)."""
  if name not in _UNINTERRUPTED:
    workdir = tmp_path_factory.mktemp(f"whole_{name}")
    Runner(config(name), str(workdir), show_progress=False).run()
    assert ckpt.complete_steps(workdir / "checkpoints") == [2, STEPS]
    _UNINTERRUPTED[name] = workdir
  return _UNINTERRUPTED[name]


_ONCE_PER_RUN = {"dpo": ("reference", "score")}
"""A stage a flow runs once per run, in its first iteration: DPO's reference scores its
held-out batch. A resumed run runs it again."""


def assert_same_run(got: pathlib.Path, want: pathlib.Path, name: str, resumed_at: int) -> None:
  """The run in `got`, resumed at step `resumed_at`, is the uninterrupted run of `name` in
  `want`: every metrics row, the final checkpoint's fingerprints, the timeline's stages."""
  assert [r["step"] for r in _rows(got)] == list(range(STEPS))
  assert _rows(got) == _rows(want)
  assert _final_fingerprints(got) == _final_fingerprints(want)
  again = [(resumed_at, *_ONCE_PER_RUN[name])] if name in _ONCE_PER_RUN else []
  assert timeline_entries(str(got)) == sorted(timeline_entries(str(want)) + again)


def _as_if_killed_in_the_last_save(workdir: pathlib.Path) -> None:
  """What a run killed while saving checkpoint `STEPS` leaves: its rows and timeline written
  (`Runner._save` writes the timeline first), the checkpoint still in orbax's temporary
  directory (renamed into place only when complete), and no finished marker."""
  last = workdir / "checkpoints" / str(STEPS)
  (last / ckpt.COMMIT_MARKER).unlink(missing_ok=True)
  last.rename(last.with_name(f"{STEPS}.orbax-checkpoint-tmp-1"))
  (workdir / rerun.MARKER).unlink()


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_a_run_resumed_from_its_checkpoint_repeats_the_uninterrupted_run(
  name, tmp_path_factory, tmp_path
):
  whole, workdir = uninterrupted_run(name, tmp_path_factory), tmp_path / "run"
  shutil.copytree(whole, workdir)
  _as_if_killed_in_the_last_save(workdir)
  built = programs.stats().get("built", 0)
  resumed = Runner(config(name), str(workdir), show_progress=False)
  assert resumed.start_step == 2
  resumed.run()
  assert_same_run(workdir, whole, name, 2)
  # The same config in the same process: every program of the resumed run is one the
  # uninterrupted run built (`rlhfjax.programs`), nothing is traced and lowered again.
  assert programs.stats().get("built", 0) == built
  # The killed save's temporary directory is cleaned up.
  assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["2", str(STEPS)]


@pytest.mark.slow
def test_a_finished_run_rerun_for_more_steps_repeats_the_longer_run(tmp_path_factory, tmp_path):
  """A run that ended (its last checkpoint forced at `total_steps`, off the `every_steps` grid)
  extended by a rerun with more steps; the runner's path, the same for every flow: checked on
  DPO, whose data differ most."""
  whole = uninterrupted_run("dpo", tmp_path_factory)
  Runner(config("dpo", 1), str(tmp_path), show_progress=False).run()
  resumed = Runner(config("dpo"), str(tmp_path), show_progress=False)
  assert resumed.start_step == 1
  resumed.run()
  assert_same_run(tmp_path, whole, "dpo", 1)
