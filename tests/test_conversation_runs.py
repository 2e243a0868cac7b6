"""Multi-turn rollouts through a flow (`rollout.environment`): GRPO with the calculator tool of
examples/calculator.py on the bundled arithmetic sums. Co-located and packed against
disaggregated, padded and with fused scoring (conversations scored as they finish), the
environments on 4 threads: the same numbers; the engine's log-probs are the trainer's on the
sampled tokens; the trajectories are the sampled tokens and the observations as the environment
gave them, observations out of the loss mask; the environment's rewards in the score; an
environment that breaks its protocol, one line. (The engine's KV reuse across turns:
test_paged.py; the estimators over observations: test_algorithms.py; packed losses over them:
test_packing.py; resume: test_resume_algorithms_runs.py.)"""

import dataclasses

import numpy as np
import pytest
from runs_testing import assert_engine_agrees_with_the_trainer, assert_same_numbers, shipped_config

from examples.calculator import Calculator
from rlhfjax.flows import stages
from rlhfjax.flows.environments import EnvironmentFault
from rlhfjax.runner import Runner

pytestmark = pytest.mark.integration

STEPS: list[tuple[str, list[int], tuple]] = []
"""Every `step` of `Logged`: (record origin, turn tokens, its answer)."""


class Logged(Calculator):
  """The calculator, each step logged; an untrained policy never writes a call or digits
  alone, so every turn it takes is answered '?;' until the turn limit."""

  def reset(self, record):
    self.origin = record.origin
    return super().reset(record)

  def step(self, tokens):
    out = super().step(tokens)
    STEPS.append((self.origin, np.asarray(tokens).tolist(), out))
    return out


class Broken(Calculator):
  def step(self, tokens):
    return "=1;", "one"  # two values, not three


CONVERSATIONS = {
  "total_steps": 2,
  "data.task": "arithmetic",
  "rollout.batch_size": 8,
  "rollout.max_prompt_len": 8,
  "rollout.max_new_tokens": 16,
  "rollout.environment": f"{__name__}:Logged",
  "rollout.max_turns": 3,
  "rollout.max_turn_tokens": 4,
  "reward.fn": "",
  # The reward model's continuous scores beside the environment's (all 0 for an untrained
  # policy): advantages that are not all 0, so that the updates differ from step to step.
  "reward.model_coef": 0.5,
  "eval.num_prompts": 0,
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """GRPO co-located and packed; disaggregated, padded and fused, with 4 environment
  workers; PPO (a critic: GAE over the sampled tokens, stepping over observations)
  co-located."""
  out = {}
  for name, config, variant, changes in (
    ("colocated", "grpo_tiny", "colocated", {}),
    (
      "disaggregated, padded, fused",
      "grpo_tiny",
      "disaggregated",
      # Its environments' resets and steps on 4 threads: the same run.
      {
        "ppo.packing": False,
        "rollout.fused_scoring": True,
        "rollout.score_micro_batch": 4,
        "rollout.environment_workers": 4,
      },  # fmt: skip
    ),
    ("ppo", "ppo_tiny", "colocated", {}),
  ):
    workdir = str(tmp_path_factory.mktemp("c"))
    cfg = shipped_config(config, {**CONVERSATIONS, **changes}, variant)
    runner = Runner(cfg, workdir, show_progress=False)
    out[name] = (runner, runner.run())
  return out


def test_every_placement_and_packing_give_the_same_conversations(runs):
  base, other = (runs[k][1].metrics for k in ("colocated", "disaggregated, padded, fused"))
  keys = ["reward/mean", "kl/mean", "loss/policy", "policy/entropy", "actor/grad_norm"]
  keys += ["response/length", "rollout/turns_mean", "rollout/observation_share"]
  assert_same_numbers(base, other, keys)
  assert base[0]["loss/policy"] != base[1]["loss/policy"]
  for _, result in runs.values():
    assert_engine_agrees_with_the_trainer(result.metrics)  # (observations masked out)
    assert result.metrics[0]["loss/policy"] != result.metrics[1]["loss/policy"]
    for row in result.metrics:
      assert row["rollout/turns_mean"] > 1.5  # '?;' and another turn, up to 3
      assert 0 < row["rollout/observation_share"] < 0.5
      assert row["rollout/environment_errors"] == 0
      assert row["rollout/turn_limit_share"] + row["rollout/token_limit_share"] > 0


def test_ppo_trains_its_critic_on_conversations(runs):
  rows = runs["ppo"][1].metrics
  assert all(np.isfinite(r["loss/value"]) and r["loss/value"] > 0 for r in rows)
  assert rows[0]["loss/value"] != rows[1]["loss/value"]


def test_trajectories_are_the_sampled_tokens_and_the_observations(runs):
  runner, _ = runs["colocated"]
  ctx = runner.ctx
  batch = ctx.prompts.take_batch(8)
  del STEPS[:]
  seqs = stages.generate(ctx, batch, stages.sampling(ctx.cfg, ctx.tokenizer), seed=11)
  question = ctx.tokenizer.encode("?;", add_bos=False)
  for i, record in enumerate(batch.records):
    response = seqs.responses[i].tolist()
    turns = [t for origin, t, _ in STEPS if origin == record.origin]
    # Samples of a group share a record: this row's turns are one of the group's logs.
    n = len(response)
    mask = seqs.response_mask_bt[i, :n] > 0
    observed = np.flatnonzero(~mask)
    # Each turn is followed by the observation '?;', except the last: the whole response is
    # turn, '?;', turn, '?;', ..., turn, exactly as sampled and given (never re-rendered).
    rebuilt, cuts = [], []
    for t in turns:
      if response[len(rebuilt) : len(rebuilt) + len(t)] == t:
        rebuilt += t
        if len(rebuilt) < n:
          cuts.append(len(rebuilt))
          rebuilt += question
      if len(rebuilt) == n:
        break
    assert rebuilt == response, (i, turns, response)
    want_observed = [j for c in cuts for j in range(c, c + len(question))]
    assert observed.tolist() == want_observed
    # Observations are real tokens (attended to) but out of the policy's loss mask.
    assert seqs.attention_mask_bs[i, seqs.prompt_len :].sum() == n
  assert seqs.environment_rewards is not None and (seqs.environment_rewards == 0).all()


def test_the_environments_rewards_are_a_part_of_the_score(runs):
  runner, _ = runs["colocated"]
  ctx = runner.ctx
  seqs = stages.generate(
    ctx, ctx.prompts.take_batch(8), stages.sampling(ctx.cfg, ctx.tokenizer), seed=11
  )
  rewards = np.arange(8, dtype=np.float32)
  seqs = dataclasses.replace(seqs, environment_rewards=rewards)
  scores = ctx.rewards.evaluate(seqs)
  np.testing.assert_allclose(scores["environment"], rewards)
  coef = ctx.cfg.reward
  want = coef.model_coef * scores["reward_model"] + coef.environment_coef * rewards
  np.testing.assert_allclose(scores["reward"], want, rtol=1e-6)


def test_an_environment_that_breaks_its_protocol_is_one_line(runs, tmp_path, caplog):
  runner, _ = runs["colocated"]
  ctx = runner.ctx
  batch = ctx.prompts.take_batch(2)
  sampling = stages.sampling(ctx.cfg, ctx.tokenizer)
  broken = dataclasses.replace(
    ctx.cfg, rollout=dataclasses.replace(ctx.cfg.rollout, environment=f"{__name__}:Broken")
  )
  with pytest.raises(EnvironmentFault) as error:
    stages.generate(dataclasses.replace(ctx, cfg=broken), batch, sampling, seed=1)
  line = str(error.value)
  assert "\n" not in line and f"{__name__}:Broken" in line and batch.records[0].origin in line
  assert "step must return (observation, reward, done)" in line
  ended = dataclasses.replace(
    broken, rollout=dataclasses.replace(broken.rollout, on_environment_error="end")
  )
  seqs = stages.generate(dataclasses.replace(ctx, cfg=ended), batch, sampling, seed=1)
  assert seqs.conversation_stats["rollout/environment_errors"] == 2
  assert (
    seqs.response_mask_bt.sum(-1) == seqs.attention_mask_bs[:, seqs.prompt_len :].sum(-1)
  ).all()
  assert "the trajectory ends here" in caplog.text
