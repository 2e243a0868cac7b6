"""Helpers for tests that run the scripts as a user does, interrupt them and run them again."""

from __future__ import annotations

import functools
import json
import os
import pathlib
import runpy
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence

import pytest

_ROOT = pathlib.Path(__file__).parent.parent

VOLATILE = ("time/", "throughput/")
"""Metric keys that measure wall-clock time (seconds, tokens per second): they differ between
any two runs by nature. Every other key, and every value of it, must repeat exactly: resume is
exact (every random choice is a function of the seed and the step)."""


LEARNING_RUN = {
  "placement__num_devices": 2,
  "actor_optimizer__learning_rate": 6e-3,
  "total_steps": 15,
  "rollout__batch_size": 16,
}
"""A learning run (`test_reward_rises` of each flow): 15 iterations of 16 samples on 2 of the 8
devices (the co-located placement, rollout tensor-parallel 2), the actor's learning rate 6e-3.
Every placement gives the co-located numbers (each flow's placement tests), so a learning run
on more devices repeats the trajectory at more cost: on 2 cores a GRPO iteration takes about a
fifth less time on 2 devices than on 8. At the configs' 1e-3 the tiny policy finds the vowels
after 20-25 iterations (mean reward 0.01-0.03 until then), at 6e-3 after 5-8: on the registry
commit the last 5 of 15 iterations scored 0.58 (GRPO), 0.76 (RLOO), 0.67 (REINFORCE++), 0.57
(PPO) and 0.84 (online DPO) against 0.01-0.03 for the first 5, in 24 s for the five runs alone
(25 iterations at 3e-3: 43 s, the last 5 at 0.47-0.82); the tests ask for a rise of 0.05 (0.15
for online DPO, whose ties leave most pairs out early)."""


CORRECTION_OF = {
  "ppo": ("tis", "token"),
  "grpo": ("tis", "sequence"),
  "rloo": ("mis", "token"),
  "dapo": ("mis", "sequence"),
  "reinforce_pp": ("mis", "sequence"),
}
"""The rollout correction (`ppo.rollout_correction`, `_level`) each PPO-family flow's placement
and packing runs apply (test_algorithm_flows.py, test_packing_runs.py): every flow with one,
every correction at every level, under the comparisons of placements and of packed with
padded."""


def with_correction(cd, name: str) -> None:
  """Sets `CORRECTION_OF[name]` in the config dict `cd`."""
  cd.ppo.rollout_correction, cd.ppo.rollout_correction_level = CORRECTION_OF[name]


def assert_engine_agrees_with_the_trainer(rows: list[dict]) -> None:
  """fp32 on CPU: the engine's log-probs are the trainer's up to float rounding (|log r| below
  about 1e-5 for log-probs of a few units), so the k3 estimate, about (log r)^2 / 2, is below
  1e-9, and no token reaches the correction's cap (log 2)."""
  for row in rows:
    assert 0.0 <= row["logprob_mismatch/k3"] < 1e-9, row["logprob_mismatch/k3"]
    assert 0.0 <= row["logprob_mismatch/seq_k3"] < 1e-9
    assert row["logprob_mismatch/max"] < 1e-4
    assert row["rollout_correction/corrected_frac"] == 0.0


def assert_same_numbers(base: list[dict], other: list[dict], keys: Iterable[str]) -> None:
  """Two runs' metric rows agree on `keys`, row by row: the same computation on other meshes
  (or stages, or processes), where only the order of fp32 reductions may differ.

  The bound comes from the arithmetic, not from one machine's rounding (a bound measured on
  one CPU once failed on another: 1.3e-4 relative on a loss of -1.5e-3). The tiny models'
  log-probs are sums over a hidden size of 32-64 of terms up to about 10, so reordering them
  moves a log-prob by about sqrt(64) x 6e-8 x 10 = 5e-6; a metric that is a mean of order-one
  terms (ratios times whitened advantages, log-prob differences, values), however close to 0
  the terms cancel, moves by about as much: `abs=1e-5`. The larger metrics (norms, rewards,
  lengths) move by relative rounding compounded over a few steps: `rel=1e-4`. The sampled
  tokens, and so the rewards, stay the same at that precision."""
  for a, b in zip(base, other, strict=True):
    for key in keys:
      assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), (a.get("step"), key)


PACKED_KEYS = (
  "reward/mean",
  "kl/mean",
  "loss/policy",
  "policy/entropy",
  "policy/approx_kl",
  "actor/grad_norm",
  "response/length",
)
"""The metrics a packed run (`ppo.packing`) of a PPO-family flow shares with its padded run."""


def assert_packed_gives_the_padded_numbers(padded, packed, extra_keys: Sequence[str] = ()) -> None:
  """Two iterations of a packed run (`RunResult`) give the padded run's numbers (`PACKED_KEYS`
  and the flow's `extra_keys`), the packing metrics are in range, and the iterations differ."""
  padded_rows, packed_rows = padded.metrics, packed.metrics
  assert_same_numbers(padded_rows, packed_rows, [*PACKED_KEYS, *extra_keys])
  assert padded_rows[0]["loss/policy"] != padded_rows[1]["loss/policy"]
  # On 8 data-parallel devices a micro-batch has at least 8 rows (one per device), so these
  # 4- and 8-sample mini-batches fill few of them; `bench_packing.py` measures real fills.
  assert all(0 < row["packing/actor_fill"] <= 1 for row in packed_rows)
  assert all(row["packing/actor_micro_batches"] >= 1 for row in packed_rows)


def assert_packed_compiles_once_per_row_bucket(packed, batch_size: int) -> None:
  """Lengths vary from batch to batch; a packed run's (`RunResult`) packed programs compile at
  most once per row-count bucket, every other program once, and `compilations.json` beside
  the metrics says so."""
  from rlhfjax.data import packing

  compilations = packed.compilations
  written = json.loads((pathlib.Path(packed.workdir) / "compilations.json").read_text())
  assert written == compilations
  buckets = len(packing.row_buckets(batch_size, 8))
  assert compilations["actor_packed_grad"] <= buckets
  assert compilations["reference_logprobs_packed"] <= buckets
  bounded = {
    k: v for k, v in compilations.items() if not k.endswith("_packed") and "grads" not in k
  }
  assert set(bounded.values()) == {1}, compilations
  assert not {"actor_step", "actor_minibatches", "actor_logprobs"} & set(compilations)


def rows(workdir: str) -> list[dict]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def deterministic(row: dict) -> dict:
  return {k: v for k, v in row.items() if not k.startswith(VOLATILE)}


def deterministic_rows(workdir: str) -> list[dict]:
  return [deterministic(row) for row in rows(workdir)]


def timeline_entries(workdir: str) -> list[tuple[int, str, str]]:
  """(iteration, role, stage) of each record of `timeline.json`, the iterations in order.

  Its times differ by nature, and so does the order of the records within an iteration:
  stages that run at once (the reference's and the reward's scoring) finish in either order. So
  the iterations must come in order and each iteration's entries are compared sorted.
  """
  with open(os.path.join(workdir, "timeline.json")) as f:
    entries = [(r["iteration"], r["role"], r["stage"]) for r in json.load(f)]
  iterations = [entry[0] for entry in entries]
  assert iterations == sorted(iterations), iterations
  return sorted(entries)


def snapshot(directory: str) -> dict[str, bytes]:
  """Every file under `directory` (relative path -> bytes)."""
  files = {}
  for root, _, names in os.walk(directory):
    for name in names:
      path = os.path.join(root, name)
      with open(path, "rb") as f:
        files[os.path.relpath(path, directory)] = f.read()
  return files


def wait_until(
  proc: subprocess.Popen, condition: Callable[[], bool], what: str, timeout: float = 400
) -> None:
  """Polls `condition` while `proc` runs; fails naming `what` when `proc` ends first or time
  runs out."""
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if condition():
      return
    assert proc.poll() is None, (what, proc.communicate())
    time.sleep(0.05)
  proc.kill()
  raise AssertionError(f"not within {timeout} s: {what}")


def has_row(workdir: str, step: int, earlier: Sequence[dict] = ()) -> bool:
  """Whether `workdir/metrics.jsonl` has a complete row of `step` or later other than those of
  `earlier` (the rows an earlier run left: a rerun drops those of the steps it redoes, and
  its own differ from them in their times)."""
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return False
  with open(path) as f:
    new = [json.loads(line) for line in f if line.endswith("\n")]
  return any(row["step"] >= step and row not in earlier for row in new)


def wait_for_row(
  proc: subprocess.Popen,
  workdir: str,
  step: int,
  timeout: float = 400,
  earlier: Sequence[dict] = (),
) -> None:
  """Waits for `proc` to write a metrics row of `step` or later (not one of `earlier`)."""
  condition = functools.partial(has_row, workdir, step, earlier)
  wait_until(proc, condition, f"a metrics row of step {step}", timeout)


def assert_rerun_changes_nothing(
  finished: str,
  workdir: str,
  run: Callable[[str], subprocess.CompletedProcess],
  line: Callable[[str], str],
) -> None:
  """On a copy of the `finished` run's workdir at `workdir`, `run(workdir)` (the same command
  again) exits 0 printing only `line(workdir)`, and leaves every file as it was: the same
  names (no new TensorBoard events file either) and the same bytes."""
  shutil.copytree(finished, workdir)
  assert_rerun_of_finished_changes_nothing(workdir, run, line)


def assert_rerun_of_finished_changes_nothing(
  workdir: str, run: Callable[[str], subprocess.CompletedProcess], line: Callable[[str], str]
) -> None:
  """`run(workdir)` of the finished run in `workdir` exits 0 printing only `line(workdir)` and
  leaves every file as it was (`assert_rerun_changes_nothing`, in place)."""
  before = snapshot(workdir)
  again = run(workdir)
  assert again.returncode == 0, again.stderr[-3000:]
  assert again.stdout.strip().splitlines() == [line(workdir)]
  after = snapshot(workdir)
  assert after.keys() == before.keys()
  for name, data in after.items():
    assert data == before[name], name


def shipped_config(name: str, changes: dict, variant: str | None = "colocated"):
  """`configs/{name}.py`'s config with `changes` ('section.field' -> value) applied, typed;
  `variant`: the argument of its `get_config` (None: a config that takes none)."""
  from rlhfjax.config import from_config_dict

  get_config = runpy.run_path(str(_ROOT / "configs" / f"{name}.py"))["get_config"]
  cd = get_config() if variant is None else get_config(variant)
  for dotted, value in changes.items():
    *sections, field = dotted.split(".")
    node = cd
    for section in sections:
      node = node[section]
    node[field] = value
  return from_config_dict(cd)


def run_plan_placement(*args: str, check: bool = False) -> subprocess.CompletedProcess:
  """`python scripts/plan_placement.py *args` as a user runs it, its output captured as text."""
  return subprocess.run(
    [sys.executable, str(_ROOT / "scripts" / "plan_placement.py"), *args],
    capture_output=True,
    text=True,
    check=check,
    timeout=120,
  )
