"""PPO with a pipelined actor and critic (`placement.pipeline_stages`), fused on packed
micro-batches and separate with LoRA adapters, gives the unpipelined run's numbers, and resumes;
a flow whose packed updates do not stack refuses pipeline stages.

The runs are `Runner`s in this process, as `scripts/train_ppo.py` runs them (its flags, one-line
errors and resume message: `test_front_door_e2e`, `test_resume_e2e`); the pipelined steps against
the unpipelined ones, leaf by leaf: `test_pipeline_parallel`.
"""

import json

import jax
import pytest
from runs_testing import assert_same_numbers, rows, shipped_config

from rlhfjax import errors
from rlhfjax.config import ConfigError
from rlhfjax.runner import Runner

pytestmark = pytest.mark.integration

_PPO = {
  # One device and one layer a stage: a collective inside a stage (FSDP, tensor parallel) of a
  # pipelined step can hang XLA's CPU runtime (see `rlhfjax.cluster.cluster._alone`);
  # `test_pipeline_parallel` covers stages of several devices.
  "model.overrides": {"num_layers": 4},
  "placement.num_devices": 4,
  # Packed (the default): each mini-batch's packed micro-batches, padded to one row count,
  # through the stages; padded micro-batches: the LoRA pair below.
  "ppo.micro_batches": 4,
  "eval.num_prompts": 0,
  # A constant learning rate: a rerun that extends `total_steps` then repeats the longer run.
  "actor_optimizer.decay": "constant",
  "critic_optimizer.decay": "constant",
}
_STAGED = {"placement.pipeline_stages": 4}
_FUSED = {**_STAGED, "ppo.fuse_actor_critic": True}
_COMPARED = (
  "reward/mean",
  "response/length",
  "kl/mean",
  "loss/policy",
  "loss/value",
  "policy/entropy",
  "policy/approx_kl",
  "actor/grad_norm",
  "critic/grad_norm",
)
"""Not `value/clipfrac`: in the first epoch the critic's values equal the old values up to
rounding, where the clipped and unclipped errors tie and rounding alone decides the count."""


def _ppo(workdir, steps: int, changes: dict) -> tuple[list[dict], int]:
  """The run's rows of `metrics.jsonl` (a resumed run's too) and the step it started at."""
  cfg = shipped_config("ppo_tiny", {**_PPO, **changes, "total_steps": steps})
  runner = Runner(cfg, str(workdir), show_progress=False)
  assert runner.run().final_step == steps
  if cfg.placement.pipeline_stages > 1:
    _assert_vocabulary_split_over_stages(runner, cfg.placement.pipeline_stages)
  return rows(str(workdir)), runner.start_step


def _assert_vocabulary_split_over_stages(runner, stages: int) -> None:
  """After the run's updates, every stage keeps 1/stages of the vocabulary of each trained
  role's embedding (and the actor's LM head), of the parameters and of each of their Adam
  moments (none with adapters: the base is frozen): one block of rows per device, the blocks
  all different."""
  adapted = runner.cfg.model.adapted_roles
  for role, state in runner.cluster.states.items():
    found = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
      name = jax.tree_util.keystr(path)
      if "embedding" not in name and "lm_head" not in name:
        continue
      vocab = 0 if "embedding" in name else leaf.ndim - 1
      if leaf.ndim < 2 or "lora" in name:
        continue
      found += 1
      blocks = {(s.index[vocab].start, s.index[vocab].stop) for s in leaf.addressable_shards}
      size = leaf.shape[vocab]
      assert blocks == {(i * size // stages, (i + 1) * size // stages) for i in range(stages)}, (
        role,
        name,
      )
    # The parameters and two moments of the embedding (and of the actor's head).
    copies = 1 if role.value in adapted else 3
    assert found == (2 if role.value == "actor" else 1) * copies, (role, found)


@pytest.mark.slow
def test_pipelined_and_fused_ppo_give_the_unpipelined_numbers(tmp_path):
  """Packed updates: the flat packed run's numbers through 4 stages fused (both models'
  micro-batches stacked alike in one schedule), and a fused resume. (Separate pipelines:
  the LoRA pair below, padded; packed micro-batches through separate stages, step by step:
  `test_pipeline_parallel`.)"""
  plain, _ = _ppo(tmp_path / "plain", 3, {})
  _ppo(tmp_path / "fused", 2, _FUSED)
  # Extended by a rerun: it resumes the reversed critic's checkpoint and trains one step more.
  fused, start = _ppo(tmp_path / "fused", 3, _FUSED)
  assert start == 2
  assert [r["step"] for r in plain] == [r["step"] for r in fused] == [0, 1, 2]
  # The same maths, reduced in another order by the stages.
  assert_same_numbers(plain, fused, _COMPARED)
  assert plain[0]["loss/policy"] != plain[1]["loss/policy"]  # training moved the numbers
  assert all(r["packing/actor_micro_batches"] > 1 for r in plain + fused)
  # Fused, the critic has no update stage of its own: it trains inside the actor's.
  assert _updating(tmp_path / "fused") == {"actor"}


@pytest.mark.slow
def test_lora_through_pipeline_stages_gives_the_unpipelined_numbers(tmp_path):
  """Adapters on the actor and the critic, each stage training its own layers' adapters, the
  reference scoring the actor's base as a forward-only pipeline, the stages running their
  forwards again in their backwards (`placement.pipeline_recompute`): the unpipelined LoRA
  run's numbers (the gradients' tree, adapters alone: `test_pipeline_parallel`)."""
  lora = {"model.lora.rank": 4, "ppo.packing": False}
  recompute = {"placement.pipeline_recompute": True}
  cfg = shipped_config("ppo_tiny", {**_PPO, **_STAGED, **lora})
  assert set(cfg.model.adapted_roles) == {"actor", "critic"} and cfg.model.reference_from_base
  plain, _ = _ppo(tmp_path / "plain", 2, lora)
  staged, _ = _ppo(tmp_path / "staged", 2, {**_STAGED, **lora, **recompute})
  assert_same_numbers(plain, staged, _COMPARED)
  assert plain[0]["loss/policy"] != plain[1]["loss/policy"]
  # Not fused: each model's pipeline updates on its own.
  assert _updating(tmp_path / "staged") == {"actor", "critic"}


def _updating(workdir) -> set[str]:
  """The roles with an update stage in a run's timeline."""
  stages = json.loads((workdir / "timeline.json").read_text())
  return {s["role"] for s in stages if s["stage"] == "update"}


def test_packing_refuses_pipeline_stages_where_its_updates_do_not_stack(tmp_path):
  """DPO's packed updates run one program per row bucket, not one schedule: refused where the
  flow declares its programs, before any compiles. `launch.run` prints `errors.describe`'s
  line after 'error: ' and exits with its status, as for any failure in a run's set-up
  (`test_front_door_e2e`: the missing prompts file)."""
  stages = {"model.overrides": {"num_layers": 4}, "placement.pipeline_stages": 2}
  cfg = shipped_config("dpo_tiny", {**stages, "dpo.packing": True})
  with pytest.raises(ConfigError) as refused:
    Runner(cfg, str(tmp_path), show_progress=False)
  assert errors.describe(refused.value) == (
    "packed updates of this flow do not run through pipeline stages: set "
    "'dpo.packing=False' with 'placement.pipeline_stages'=2",
    errors.USER_ERROR,
  )
