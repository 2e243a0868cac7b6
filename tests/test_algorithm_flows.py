"""GRPO, RLOO and REINFORCE++ from their configs: the same numbers on every placement and
packed (`ppo.packing`, the configs' default) as padded, no critic, each program compiled once
(a packed one once per row-count bucket), the metrics a user reads, and learning on the bundled
task."""

import json
import pathlib
import runpy

import numpy as np
import pytest
from runs_testing import (
  CORRECTION_OF,
  LEARNING_RUN,
  assert_engine_agrees_with_the_trainer,
  assert_packed_gives_the_padded_numbers,
  assert_same_numbers,
)
from runs_testing import assert_packed_compiles_once_per_row_bucket as compiles_per_bucket

from rlhfjax import data, tasks
from rlhfjax.config import ConfigError, from_config_dict
from rlhfjax.placement.spec import Role
from rlhfjax.runner import Runner

pytestmark = pytest.mark.integration

_ROOT = pathlib.Path(__file__).parent.parent
_ALGORITHMS = ("grpo", "rloo", "reinforce_pp")
# GSPO's and CISPO's configs (GRPO's flow, another `ppo.policy_loss`): their own test below;
# their losses packed and padded in test_packing.py.
_VARIANTS = ("colocated", "disaggregated")
_PADDED = "colocated, padded"  # the colocated run without `ppo.packing`
_CRITIC_PREFIXES = ("value/", "critic/")


def _config(name: str, variant: str = "colocated", **changes):
  cd = runpy.run_path(str(_ROOT / "configs" / f"{name}_tiny.py"))["get_config"](variant)
  cd.total_steps = 2
  cd.rollout.batch_size = 8
  cd.rollout.max_new_tokens = 8
  cd.eval.num_prompts = 0
  for dotted, value in changes.items():
    section, _, field = dotted.rpartition("__")
    (cd[section] if section else cd)[field] = value
  return from_config_dict(cd)


_RECORDS: dict[tuple[str, str], list] = {}
_RUN: list[tuple[str, str]] = []


def logged_vowel_reward(prompts, responses, metadata):
  """The configs' rule, logging the prompts and the records it was given (for the test of
  `metadata["records"]`)."""
  decode = metadata["tokenizer"].decode
  _RECORDS.setdefault(_RUN[-1], []).append(
    (metadata["step"], [decode(p) for p in prompts], [r.origin for r in metadata["records"]])
  )
  return tasks.vowel_reward(prompts, responses, metadata)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  out = {}
  for name in _ALGORITHMS:
    for variant in (*_VARIANTS, _PADDED):
      _RUN.append((name, variant))
      # The reward model's continuous scores give every group non-zero advantages. With the
      # rule alone most groups of the untrained policy score all 0: their gradients are float
      # noise that differs with the layout's reduction order, and Adam (g / |g|) turns noise
      # into full-size steps, so placements would part after the first update.
      changes = {"ppo__packing": False} if variant == _PADDED else {}
      kind, level = CORRECTION_OF[name]
      changes.update(ppo__rollout_correction=kind, ppo__rollout_correction_level=level)
      cfg = _config(
        name,
        variant.split(",")[0],
        reward__model_coef=0.5,
        reward__fn=f"{__name__}:logged_vowel_reward",
        **changes,
      )
      runner = Runner(cfg, str(tmp_path_factory.mktemp(name)), show_progress=False)
      out[name, variant] = (runner, runner.run())
  return out


@pytest.mark.slow
def test_gspo_and_cispo_run_from_their_configs(tmp_path):
  """configs/gspo_tiny.py and configs/cispo_tiny.py (GRPO's config with another policy loss)
  on the interleaved placement: the same first batch, another loss. (scripts/train.py runs a
  config file as `Runner` does here: test_front_door_e2e, test_resume_e2e.)"""
  rows = {}
  for name in ("gspo", "cispo"):
    # The reward model's continuous scores beside the rule: advantages that are not all 0.
    cfg = _config(name, "interleaved", reward__model_coef=0.5)
    rows[name] = Runner(cfg, str(tmp_path / name), show_progress=False).run().metrics
  for name, run in rows.items():
    assert [r["step"] for r in run] == [0, 1], name
    assert "loss/kl" not in run[0]  # neither config has a KL term
    assert all(0.0 <= r["policy/clipfrac"] <= 1.0 for r in run)
    assert run[0]["loss/policy"] != run[1]["loss/policy"]
  gspo, cispo = rows["gspo"][0], rows["cispo"][0]
  assert gspo["reward/mean"] == cispo["reward/mean"]
  assert gspo["loss/policy"] != pytest.approx(cispo["loss/policy"], abs=1e-6)


@pytest.mark.parametrize("name", _ALGORITHMS)
def test_every_placement_gives_the_colocated_numbers(runs, name):
  base, other = runs[name, "colocated"][1].metrics, runs[name, "disaggregated"][1].metrics
  keys = ["reward/mean", "kl/mean", "loss/policy", "policy/entropy", "actor/grad_norm"]
  if name == "grpo":
    keys.append("loss/kl")
  assert_same_numbers(base, other, keys)
  assert base[0]["loss/policy"] != base[1]["loss/policy"]
  for variant in (*_VARIANTS, _PADDED):
    assert_engine_agrees_with_the_trainer(runs[name, variant][1].metrics)


@pytest.mark.parametrize("name", _ALGORITHMS)
def test_packed_gives_the_padded_numbers(runs, name):
  """(PPO and DAPO: test_packing_runs.py.)"""
  extra = ["loss/kl"] if name == "grpo" else []
  assert_packed_gives_the_padded_numbers(runs[name, _PADDED][1], runs[name, "colocated"][1], extra)
  compiles_per_bucket(runs[name, "colocated"][1], batch_size=8)


@pytest.mark.parametrize("name", _ALGORITHMS)
def test_no_critic_and_each_program_compiles_once(runs, name):
  runner, result = runs[name, "disaggregated"]
  assert set(runner.cluster.states) == {Role.ACTOR}
  assert set(runner.cluster.params) == {Role.REFERENCE, Role.REWARD}
  assert set(result.compilations.values()) == {1}, result.compilations
  assert not {"critic_step", "critic_values", "critic_minibatches"} & set(result.compilations)
  stages = {(r.role, r.stage) for r in runner.timeline.records}
  assert ("critic", "score") not in stages and ("critic", "update") not in stages
  rows = [
    json.loads(x) for x in (pathlib.Path(result.workdir) / "metrics.jsonl").read_text().splitlines()
  ]
  assert [r["step"] for r in rows] == [0, 1]
  assert {"reward/mean", "loss/policy", "time/iteration", "time/generate", "time/update"} <= set(
    rows[0]
  )
  # Without a critic there is no value metric to log (not a 0 standing in for one).
  critic_keys = {k for r in rows for k in r if k == "loss/value" or k.startswith(_CRITIC_PREFIXES)}
  assert not critic_keys, critic_keys


@pytest.mark.parametrize("variant", _VARIANTS)
def test_the_rule_gets_each_samples_prompt_record(runs, variant):
  """`metadata["records"]` lines up with the responses on every placement: each row's record
  names the line of the bundled file its prompt came from, and a group's samples share it."""
  lines = pathlib.Path(data.bundled_path("vowels", "prompt")).read_text().splitlines()
  for name in _ALGORITHMS:
    k = runs[name, variant][0].cfg.ppo.group_size
    calls = _RECORDS[name, variant]
    assert [step for step, _, _ in calls] == [0, 1]
    for _, prompts, origins in calls:
      assert len(prompts) == len(origins) == 8
      for i, (prompt, origin) in enumerate(zip(prompts, origins, strict=True)):
        path, _, line = origin.rpartition(":")
        assert path == data.bundled_path("vowels", "prompt")
        assert json.loads(lines[int(line) - 1])["prompt"] == prompt
        assert origin == origins[i - i % k]
      assert len(set(origins)) == 8 // k


def test_grpo_kl_loss_term_and_aggregation_change_the_update(runs, tmp_path):
  """KL in the loss (the config's) differs from KL in the reward, and Dr. GRPO's aggregation
  from the sequence mean: the options reach the compiled loss."""
  base = runs["grpo", "colocated"][1].metrics
  assert base[1]["loss/kl"] > 0.0
  dr = Runner(
    _config(
      "grpo",
      total_steps=1,
      reward__model_coef=0.5,
      ppo__loss_agg="seq_mean_token_sum_norm",
      ppo__normalize_group_std=False,
    ),
    str(tmp_path),
    show_progress=False,
  ).run()
  assert dr.metrics[0]["reward/mean"] == base[0]["reward/mean"]  # same first batch
  assert dr.metrics[0]["loss/policy"] != pytest.approx(base[0]["loss/policy"], abs=1e-6)


def test_gspo_needs_an_advantage_per_sequence(tmp_path):
  cfg = _config("gspo", ppo__advantage="reinforce_pp", algorithm__name="ppo")
  with pytest.raises(ConfigError, match=r"'ppo.policy_loss'='gspo' weighs whole sequences"):
    Runner(cfg, str(tmp_path), show_progress=False)
  with pytest.raises(ConfigError, match=r"'ppo.policy_loss' must be one of cispo, gspo, ppo"):
    Runner(_config("grpo", ppo__policy_loss="gpo"), str(tmp_path), show_progress=False)


def test_group_relative_needs_groups(tmp_path):
  """The flow's own checks (`FlowSpec.check`) refuse a config before anything is built."""
  with pytest.raises(ConfigError, match="group_size' must be >= 2"):
    Runner(_config("rloo", ppo__group_size=1), str(tmp_path), show_progress=False)
  with pytest.raises(ConfigError, match="algorithm 'grpo' estimates advantages"):
    Runner(_config("grpo", ppo__advantage="rloo"), str(tmp_path), show_progress=False)
  known = "gae, group_relative, reinforce_pp, rloo"
  with pytest.raises(ConfigError, match=f"'ppo.advantage' must be one of {known}, got 'gea'"):
    Runner(_config("ppo", ppo__advantage="gea"), str(tmp_path), show_progress=False)
  assert not list(tmp_path.iterdir())


@pytest.mark.slow
@pytest.mark.parametrize("name", _ALGORITHMS)
def test_reward_rises(name, tmp_path):
  cfg = _config(name, **LEARNING_RUN)
  rewards = [
    r["reward/mean"] for r in Runner(cfg, str(tmp_path), show_progress=False).run().metrics
  ]
  first, last = np.mean(rewards[:5]), np.mean(rewards[-5:])
  assert last > first + 0.05 and last > 2 * first, rewards
