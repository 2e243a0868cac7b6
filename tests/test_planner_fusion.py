"""The planner's fusion model: length mixes, static vs continuous batching, compaction, overlap."""

import numpy as np
import pytest

from rlhfjax.bench import fusion
from rlhfjax.costmodel import costs, efficiency, hardware
from rlhfjax.costmodel.workload import Workload, resolve_model
from rlhfjax.planner import search

pytestmark = pytest.mark.pure


def _rollout(slots=2, step=1.0, devices=(0,), prefill=0.0):
  return fusion.Rollout(
    slots=slots,
    replicas=1,
    prefill_s=prefill,
    step_s=lambda batch, context: step * batch,  # a step costs its batch size
    devices=devices,
    prompt_len=4,
    mean=4.0,
    max_len=16,
  )


def _scorer(devices):
  return fusion.Scorer(
    role="reference", model=None, head="lm", devices=devices, group=costs.Group(devices=1)
  )


def _per_row(seconds):
  return lambda scorer, rows, longest: seconds * rows


def _generate_only(lengths, slots, batching, **kwargs):
  """The phase of a rollout with `slots` and nothing scored."""
  return fusion.replay_phase(lengths, _rollout(slots=slots), [], _per_row(0), batching, **kwargs)


def test_static_batches_last_as_long_as_their_longest_sample():
  lengths = np.array([1, 9, 2, 3])
  phase = _generate_only(lengths, 2, "static", micro_batch=1, threshold=0)
  # Two waves of 2 slots: 9 then 3 steps, each step costing 2.
  assert phase.decode_steps_by_batch == {2: 12}
  assert phase.generate_s == 24.0


def test_continuous_batching_refills_finished_slots():
  lengths = np.array([1, 9, 2, 3])
  phase = _generate_only(lengths, 2, "continuous", micro_batch=1, threshold=0)
  # Slots: [1, 9] -> the first frees at 1 and takes 2 (ends at 3), then 3 (ends at 6); 9 ends
  # at 9, so 9 steps at batch 2.
  assert phase.decode_steps_by_batch == {2: 9}
  assert phase.generate_s == 18.0


def test_tail_compaction_halves_the_batch_down_to_an_odd_size():
  lengths = np.array([1] * 9 + [5, 6, 40])
  phase = _generate_only(lengths, 12, "fused", micro_batch=4, threshold=0.25)
  # 3 of 12 left after step 1 (<= a quarter): 12 -> 6 -> 3 (odd: no further), 39 more steps.
  assert phase.decode_steps_by_batch == {12: 1, 3: 39}
  assert phase.generate_s == 12 + 3 * 39


def test_fused_scoring_overlaps_on_disjoint_devices_and_waits_on_shared_ones():
  lengths = np.array([2, 2, 20, 20])
  rollout = _rollout(slots=4, step=0.25)  # a step of 4 slots costs 1
  kwargs = dict(micro_batch=2, threshold=0)
  unfused = fusion.replay_phase(
    lengths, rollout, [_scorer((1,))], _per_row(1.0), "continuous", **kwargs
  )
  assert unfused.generate_s == 20.0 and unfused.scored_s == 24.0  # 4 rows after the end
  apart = fusion.replay_phase(lengths, rollout, [_scorer((1,))], _per_row(1.0), "fused", **kwargs)
  # The first two are scored during generation (2..4 on device 1), the last two after it.
  assert apart.generate_s == 20.0 and apart.scored_s == 22.0
  shared = fusion.replay_phase(lengths, rollout, [_scorer((0,))], _per_row(1.0), "fused", **kwargs)
  # Co-located: generation waits 2 s for the first micro-batch; nothing is hidden.
  assert shared.generate_s == 22.0 and shared.scored_s == 24.0


def test_lengths_have_the_asked_mean_and_a_long_tail():
  lengths = fusion.lengths_with_mean(
    4096, mean=512, max_len=4096, tail_fraction=0.1, tail_ratio=8.0, seed=0
  )
  assert lengths.mean() == pytest.approx(512, abs=1)
  assert lengths.max() == 4096
  assert np.mean(lengths >= 8 * np.median(lengths)) == pytest.approx(0.1, abs=0.02)


def test_fusion_prediction_at_scale():
  """7B actor and critic on 8 H100, mean 512 / max 4096: the numbers the README quotes."""
  work = Workload(
    actor=resolve_model("7b"),
    critic=resolve_model("7b"),
    reward=resolve_model("7b"),
    prompts=1024,
    prompt_len=1024,
    response_len_mean=512,
    response_len_max=4096,
  )
  hw, eff = hardware.load_hardware("h100"), efficiency.load_efficiency(None)
  plan = search.search(work, hw, eff, 8)[0]
  assert plan.fits and plan.slots > 0
  pred = fusion.predict(plan, work, hw, eff, fusion.FusionSettings())
  # Batch at a time, this plan's own prediction (one wave at the longest response).
  assert pred.iteration_s["static"] == pytest.approx(plan.iteration_s, rel=0.05)
  assert pred.gain["static"] > 1.5
  assert pred.gain["continuous"] > 1.0
  fused = pred.phases["fused"].decode_steps_by_batch
  assert min(fused) < plan.slots  # the tail was compacted
