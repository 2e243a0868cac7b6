"""Fused scoring in the training loop: the same iterations as unfused, on every placement.

With `rollout.fused_scoring`, finished samples are scored in micro-batches while the rest
still generate (`rlhfjax.flows.scoring`). For a fixed seed and scoring micro-batch, fused and
unfused iterations give bit-identical samples, log-probs, values, scores, advantages, returns,
metrics and weights. (Against scoring the whole batch in one call, micro-batches differ in the
last bits: see `rlhfjax.flows.scoring`.)
"""

import functools
import json
import pathlib
import runpy

import jax
import numpy as np
import pytest
from runs_testing import assert_same_numbers

from rlhfjax import data, tasks
from rlhfjax.config import ConfigError, from_config_dict
from rlhfjax.data import packing
from rlhfjax.mesh.transfer import host_transfers_allowed, no_host_transfers
from rlhfjax.observe.timeline import Timeline
from rlhfjax.runner import Runner

pytestmark = [pytest.mark.slow, pytest.mark.integration]

_CONFIGS = pathlib.Path(__file__).parent.parent / "configs"
_PLACEMENTS = ("colocated", "interleaved", "disaggregated")
_FIELDS = (
  "tokens_bs",
  "attention_mask_bs",
  "response_mask_bt",
  "rollout_logprobs_bt",
  "old_logprobs_bt",
  "ref_logprobs_bt",
  "values_bt",
  "scores_b",
  "advantages_bt",
  "returns_bt",
)
_MICRO = 2
_RULE_CALLS: dict[str, list] = {}
_CURRENT: list[str] = []


def logged_vowel_reward(prompts, responses, metadata):
  """The configs' rule, logging each call's prompts and records (fused: one call per
  micro-batch of finished samples, in the order they finished)."""
  decode = metadata["tokenizer"].decode
  origins = [r.origin for r in metadata["records"]]
  _RULE_CALLS.setdefault(_CURRENT[-1], []).append(([decode(p) for p in prompts], origins))
  return tasks.vowel_reward(prompts, responses, metadata)


def _config(algo: str, placement: str, packing: bool = False, **rollout):
  cd = runpy.run_path(str(_CONFIGS / f"{algo}_tiny.py"))["get_config"](placement)
  cd.ppo.packing = packing
  cd.total_steps = 2
  cd.rollout.batch_size = 8
  cd.rollout.max_new_tokens = 8
  cd.rollout.slots = 4  # continuous batching: the first samples finish while others decode
  cd.reward.model_coef = 0.5  # the reward model and the rule both score
  cd.reward.fn = f"{__name__}:logged_vowel_reward"  # the same scores as the configs' rule
  cd.eval.num_prompts = 0
  for field, value in rollout.items():
    cd.rollout[field] = value
  return from_config_dict(cd)


class _Run:
  """A finished run: the experience each update got, the metrics, the trained weights, and the
  names of the host transfers its iterations made. Each iteration runs inside
  `no_host_transfers`, as `test_transfer_guard` runs them, so one that crosses unnamed fails."""

  def __init__(self, cfg, workdir: str):
    runner = Runner(cfg, workdir, show_progress=False)
    self.experiences = []
    update, iterate = runner.flow._update, runner.flow.iteration

    def record(iteration, exp, seqs):
      with host_transfers_allowed():  # the test's own copy, not the flow's
        self.experiences.append(jax.tree.map(np.asarray, exp))
      return update(iteration, exp, seqs)

    def guarded_iteration(iteration):
      with no_host_transfers():
        row = iterate(iteration)
      self.host_transfers = set(runner.cluster.host_transfers)
      return row

    runner.flow._update = record
    runner.flow.iteration = guarded_iteration
    result = runner.run()
    self.metrics = result.metrics
    self.compilations = result.compilations
    self.params = {
      role.value: jax.tree.map(np.asarray, state.params)
      for role, state in runner.cluster.states.items()
    }
    self.timeline = Timeline.read_json(str(pathlib.Path(workdir) / "timeline.json"))


@functools.cache
def _run(
  tmp_root: str, algo: str, placement: str, fused: bool, micro: int, packing: bool = False
) -> _Run:
  cfg = _config(algo, placement, packing, fused_scoring=fused, score_micro_batch=micro)
  workdir = pathlib.Path(tmp_root) / f"{algo}-{placement}-{fused}-{micro}-{packing}"
  _CURRENT.append(workdir.name)
  return _Run(cfg, str(workdir))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  root = str(tmp_path_factory.mktemp("fused"))
  return functools.partial(_run, root)


def _differences(a: _Run, b: _Run) -> dict[str, float]:
  """Largest absolute difference of each compared quantity (0: bit-identical)."""
  out = {}
  for i, (x, y) in enumerate(zip(a.experiences, b.experiences, strict=True)):
    for field in _FIELDS:
      u, v = getattr(x, field), getattr(y, field)
      out[f"{i}/{field}"] = 0.0 if np.array_equal(u, v) else float(np.max(np.abs(u - v)))
  for i, (x, y) in enumerate(zip(a.metrics, b.metrics, strict=True)):
    for key in x:
      if not key.startswith(("time/", "throughput/")):
        out[f"{i}/{key}"] = abs(x[key] - y[key])
  leaves = zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params), strict=True)
  out["params"] = max(float(np.max(np.abs(u - v))) for u, v in leaves)
  return out


@pytest.mark.parametrize("placement", _PLACEMENTS)
@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_fused_iterations_equal_unfused_ones(run, algo, placement):
  unfused, fused = run(algo, placement, False, _MICRO), run(algo, placement, True, _MICRO)
  assert len(fused.experiences) == 2
  diff = _differences(fused, unfused)
  assert {k: v for k, v in diff.items() if v} == {}
  # Not trivially equal: the scorers ran, the weights moved, the second batch differs.
  exp = fused.experiences
  assert np.all(exp[0].old_logprobs_bt[exp[0].response_mask_bt > 0] < 0)
  assert not np.array_equal(exp[0].tokens_bs, exp[1].tokens_bs)
  assert fused.metrics[0]["loss/policy"] != fused.metrics[1]["loss/policy"]
  # Each micro-batch scorer compiled once; the whole-batch ones were never built.
  assert set(fused.compilations.values()) == {1}
  assert f"reference_logprobs_{_MICRO}rows" in fused.compilations
  assert "reference_logprobs" not in fused.compilations
  # The rule saw each micro-batch's own prompt records (`metadata["records"]`), row for row.
  lines = pathlib.Path(data.bundled_path("vowels", "prompt")).read_text().splitlines()
  calls = _RULE_CALLS[f"{algo}-{placement}-True-{_MICRO}-False"]
  assert len(calls) == 2 * 8 // _MICRO
  for prompts, origins in calls:
    assert len(prompts) == len(origins) == _MICRO
    for prompt, origin in zip(prompts, origins, strict=True):
      path, _, line = origin.rpartition(":")
      assert path == data.bundled_path("vowels", "prompt")
      assert json.loads(lines[int(line) - 1])["prompt"] == prompt


@pytest.mark.parametrize(("algo", "placement"), [("ppo", "disaggregated"), ("grpo", "colocated")])
def test_packed_fused_iterations_match_unfused_ones(run, algo, placement):
  """Packed (`ppo.packing`), fused scoring packs samples as they finish and unfused scoring
  packs the whole batch best-fit decreasing: a sample sits at other columns of another row,
  where its attention sums its (same) terms between other masked zeros, in another association
  order. So the numbers agree to float rounding, not bit for bit."""
  unfused = run(algo, placement, False, _MICRO, packing=True)
  fused = run(algo, placement, True, _MICRO, packing=True)
  first, other = fused.experiences[0], unfused.experiences[0]
  for field in ("tokens_bs", "response_mask_bt", "rollout_logprobs_bt"):
    np.testing.assert_array_equal(getattr(first, field), getattr(other, field))
  mask = first.response_mask_bt > 0
  for field in ("old_logprobs_bt", "ref_logprobs_bt") + (("values_bt",) if algo == "ppo" else ()):
    # log-probs near -ln(vocab) ~ -5.5 and values ~ 0.1: a few fp32 ulps of the sums over the
    # hidden size and the keys.
    np.testing.assert_allclose(
      getattr(first, field)[mask], getattr(other, field)[mask], rtol=1e-5, atol=1e-6
    )
  np.testing.assert_allclose(first.scores_b, other.scores_b, rtol=1e-5, atol=1e-6)
  assert_same_numbers(fused.metrics, unfused.metrics, ["reward/mean", "kl/mean", "loss/policy"])
  # Packed calls ran during generation, each on one compiled program per row count.
  timeline = fused.timeline
  (generate,) = [r for r in timeline if r.iteration == 0 and r.stage == "generate"]
  chunks = [r for r in timeline if r.iteration == 0 and r.stage == "score" and r.chunk >= 0]
  assert any(r.start < generate.end for r in chunks if r.devices)
  assert fused.compilations["reference_logprobs_packed"] <= len(packing.row_buckets(_MICRO, 8))


@pytest.mark.parametrize("placement", _PLACEMENTS)
def test_fused_timeline_has_scoring_blocks_over_generation(run, placement):
  timeline = run("ppo", placement, True, _MICRO).timeline
  for iteration in (0, 1):
    records = [r for r in timeline if r.iteration == iteration]
    (generate,) = [r for r in records if r.stage == "generate"]
    chunks = [r for r in records if r.stage == "score" and r.chunk >= 0]
    # Every scoring role, every micro-batch of 8 samples: actor, reference, critic, reward
    # model and rule.
    assert sorted({(r.role, r.chunk) for r in chunks}) == sorted(
      (role, k)
      for role in ("actor", "reference", "critic", "reward", "reward_fn")
      for k in range(8 // _MICRO)
    )
    during = [r for r in chunks if r.start < generate.end and r.devices]
    assert during, "no scoring block started while generating"
    assert all(r.end > r.start >= generate.start for r in chunks)


def test_unfused_timeline_scores_after_generation(run):
  timeline = run("ppo", "colocated", False, _MICRO).timeline
  for iteration in (0, 1):
    records = [r for r in timeline if r.iteration == iteration]
    (generate,) = [r for r in records if r.stage == "generate"]
    chunks = [r for r in records if r.stage == "score"]
    assert len(chunks) == 5 * (8 // _MICRO)
    assert all(r.start >= generate.end for r in chunks)


def test_fused_iterations_make_only_named_host_transfers(run):
  """As `test_transfer_guard`, fused: micro-batches' token ids go up (named), scores stay on
  the devices apart from the reorder's row indices (named). (`_Run` ran the iterations inside
  `no_host_transfers`.)"""
  transfers = run("ppo", "disaggregated", True, _MICRO).host_transfers
  fused_names = {"rollout micro-batch", "scoring order"}
  named = {"generate", "rollout", "reward_fn scores", "kl_coef", "metrics"} | fused_names
  assert fused_names <= transfers <= named, transfers


def test_fused_scoring_refuses_what_it_cannot_do(tmp_path):
  with pytest.raises(ConfigError, match="score_micro_batch"):
    _config("ppo", "colocated", score_micro_batch=9)
  cd = runpy.run_path(str(_CONFIGS / "ppo_tiny.py"))["get_config"]("disaggregated_async")
  cd.rollout.fused_scoring = True
  with pytest.raises(ConfigError, match="fused_scoring"):
    Runner(from_config_dict(cd), str(tmp_path), show_progress=False)
