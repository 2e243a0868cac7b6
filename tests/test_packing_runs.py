"""PPO and DAPO packed (`ppo.packing`) against padded: the metrics of two iterations equal the
padded run's, and each packed program compiles at most once per row-count bucket while the
lengths vary. (GRPO, RLOO and REINFORCE++: test_algorithm_flows.py, whose colocated runs are
packed; the packed functions against the padded ones: test_packing.py.)"""

import pathlib
import runpy

import pytest
from runs_testing import (
  assert_engine_agrees_with_the_trainer,
  assert_packed_gives_the_padded_numbers,
  with_correction,
)
from runs_testing import assert_packed_compiles_once_per_row_bucket as compiles_per_bucket

from rlhfjax.config import from_config_dict
from rlhfjax.runner import Runner

pytestmark = pytest.mark.integration

_ROOT = pathlib.Path(__file__).parent.parent
_FLOWS = ("ppo", "dapo")


def _config(name: str, packing_on: bool):
  cd = runpy.run_path(str(_ROOT / "configs" / f"{name}_tiny.py"))["get_config"]("colocated")
  cd.total_steps = 2
  cd.rollout.batch_size = 8
  cd.rollout.max_new_tokens = 8
  cd.eval.num_prompts = 0
  cd.reward.model_coef = 0.5  # continuous scores: every group carries a signal
  cd.ppo.packing = packing_on
  with_correction(cd, name)
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
  extra = {"ppo": ["loss/value", "critic/grad_norm"], "dapo": ["reward/overlong_mean"]}[name]
  assert_packed_gives_the_padded_numbers(runs[name, False], runs[name, True], extra)
  for packing_on in (False, True):
    assert_engine_agrees_with_the_trainer(runs[name, packing_on].metrics)


@pytest.mark.slow
@pytest.mark.parametrize("name", _FLOWS)
def test_packed_programs_compile_once_per_row_bucket(runs, name):
  compiles_per_bucket(runs[name, True], batch_size=8)
