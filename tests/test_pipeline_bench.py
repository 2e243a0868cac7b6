"""scripts/bench_pipeline.py's rows (`rlhfjax.bench.pipeline_bench`) at its smallest size: each
schedule read runs the update it names, and the bubble fractions are the tables'."""

from __future__ import annotations

import json
import math

import pytest

from rlhfjax import schedules
from rlhfjax.bench import pipeline_bench

pytestmark = pytest.mark.unit

FIELDS = {
  "schedule",
  "stages",
  "micro_batches",
  "bubble_fraction",
  "bubble_fraction_b2",
  "ticks",
  "step_s",
  "compile_s",
  "flops",
  "device",
  "devices",
}


# The schedules whose rows this test reads: 'gpipe' and 'two_1f1b' run the same executor on
# other tables (their pipelined gradients: `test_pipeline_parallel`), and three more programs
# to compile took about 10 s of the suite.
_READ = ("unpipelined", "1f1b", "1f1b_recompute", "fused")


@pytest.mark.slow  # five programs to compile
def test_bench_rows_at_the_smallest_size():
  settings = pipeline_bench.Settings(
    layers=2, stages=2, micro_batches=2, rows=4, seq=8, repeats=1, devices=8, schedules=_READ
  )
  rows = {row["schedule"]: json.loads(json.dumps(row)) for row in pipeline_bench.run(settings)}
  assert list(rows) == list(_READ)
  for name, row in rows.items():
    assert set(row) >= FIELDS, name
    assert row["micro_batches"] == 2 and row["devices"] == 8 and row["device"]
    assert row["step_s"] > 0 and row["compile_s"] > 0
  assert rows["unpipelined"]["stages"] == 1 and rows["unpipelined"]["ticks"] is None

  # The bubbles are the tables': 1F1B over 2 stages and 2 micro-batches idles (p - 1) / (m +
  # p - 1) = 1/3 of 6 ticks, two of them back to back the same over 12; fused, the critic's
  # warm-up fills the actor's drain: 8 ticks, all busy.
  for name in ("1f1b", "1f1b_recompute"):
    assert rows[name]["ticks"] == 6
    assert rows[name]["bubble_fraction"] == pytest.approx(1 / 3, abs=1e-15)
  assert rows["fused"]["ticks"] == 8 and rows["fused"]["bubble_fraction"] == 0.0
  two = schedules.sequential(2, 2)  # the 'two_1f1b' row's table
  assert rows["fused"]["bubble_fraction_b2"] < schedules.bubble_fraction(two, 1.0, 2.0)
  assert rows["1f1b"]["bubble_fraction_b2"] == schedules.bubble_fraction(
    schedules.single("1f1b", 2, 2), 1.0, 2.0
  )

  # Every row trained the models it names from the same parameters and batch: the same losses
  # as the unpipelined baseline, within the fp32 tolerance for a pipelined model (the
  # stages sum in another order).
  for name, row in rows.items():
    roles = ("actor",) if name in ("1f1b", "1f1b_recompute") else ("actor", "critic")
    assert {key for key in row if key.endswith("_loss")} == {f"{r}_loss" for r in roles}, name
    for role in roles:
      key = f"{role}_loss"
      assert math.isfinite(row[key])
      assert row[key] == pytest.approx(rows["unpipelined"][key], rel=1e-5), (name, key)
  # A backward from the kept residuals runs no forward again: fewer operations in the program.
  assert 0 < rows["1f1b"]["flops"] < rows["1f1b_recompute"]["flops"]
