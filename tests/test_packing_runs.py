"""Every PPO-family flow packed (`ppo.packing`) against padded: the metrics of two iterations
equal the padded run's, and each packed program compiles at most once per row-count bucket while
the lengths vary. (The packed functions against the padded ones: test_packing.py.)"""

import json
import pathlib
import runpy

import pytest
from runs_testing import assert_same_numbers

from rlhfjax.config import from_config_dict
from rlhfjax.data import packing
from rlhfjax.runner import Runner

pytestmark = pytest.mark.integration

_ROOT = pathlib.Path(__file__).parent.parent
_FLOWS = ("ppo", "grpo", "dapo", "rloo", "reinforce_pp")


def _config(name: str, packing_on: bool):
  cd = runpy.run_path(str(_ROOT / "configs" / f"{name}_tiny.py"))["get_config"]("colocated")
  cd.total_steps = 2
  cd.rollout.batch_size = 8
  cd.rollout.max_new_tokens = 8
  cd.eval.num_prompts = 0
  cd.reward.model_coef = 0.5  # continuous scores: every group carries a signal
  cd.ppo.packing = packing_on
  if name == "ppo":
    cd.ppo.mini_batches = 2
  if name == "dapo":
    cd.ppo.overlong_buffer = 4
  return from_config_dict(cd)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  out = {}
  for name in _FLOWS:
    for packing_on in (False, True):
      workdir = str(tmp_path_factory.mktemp(f"{name}-{packing_on}"))
      out[name, packing_on] = Runner(_config(name, packing_on), workdir, show_progress=False).run()
  return out


@pytest.mark.slow
@pytest.mark.parametrize("name", _FLOWS)
def test_every_flow_packed_gives_the_padded_numbers(runs, name):
  padded, packed_run = runs[name, False].metrics, runs[name, True].metrics
  keys = ["reward/mean", "kl/mean", "loss/policy", "policy/entropy", "policy/approx_kl"]
  keys += ["actor/grad_norm", "response/length"]
  if name == "ppo":
    keys += ["loss/value", "critic/grad_norm"]
  if name == "grpo":
    keys.append("loss/kl")
  if name == "dapo":
    keys.append("reward/overlong_mean")
  assert_same_numbers(padded, packed_run, keys)
  assert padded[0]["loss/policy"] != padded[1]["loss/policy"]
  # On 8 data-parallel devices a micro-batch has at least 8 rows (one per device), so these
  # 4- and 8-sample mini-batches fill few of them; `bench_packing.py` measures real fills.
  assert all(0 < row["packing/actor_fill"] <= 1 for row in packed_run)
  assert all(row["packing/actor_micro_batches"] >= 1 for row in packed_run)


@pytest.mark.slow
@pytest.mark.parametrize("name", _FLOWS)
def test_packed_programs_compile_once_per_row_bucket(runs, name):
  """Lengths vary from batch to batch; the packed programs' compiles stay within the buckets."""
  compilations = runs[name, True].compilations
  written = json.loads((pathlib.Path(runs[name, True].workdir) / "compilations.json").read_text())
  assert written == compilations  # reported beside the metrics
  assert compilations["actor_packed_grad"] <= len(packing.row_buckets(8, 8))
  assert compilations["reference_logprobs_packed"] <= len(packing.row_buckets(8, 8))
  bounded = {
    k: v for k, v in compilations.items() if not k.endswith("_packed") and "grads" not in k
  }
  assert set(bounded.values()) == {1}, compilations
  assert not {"actor_step", "actor_minibatches", "actor_logprobs"} & set(compilations)
