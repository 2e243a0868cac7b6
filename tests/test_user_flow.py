"""A flow written in the user's own file (examples/rejection_sampling.py, copied outside the
repository as a user's file would be), run by the runner from `algorithm.flow='module:function'`
on two placements; a user flow's faults named in the user's file. (Run by scripts/train.py from
the directory holding the file: tests/test_user_flow_e2e.py.)"""

import pathlib
import re
import runpy
import shutil
import sys

import jax
import numpy as np
import pytest
from runs_testing import assert_same_numbers

from rlhfjax.config import ConfigError, from_config_dict
from rlhfjax.placement.spec import Role
from rlhfjax.runner import Runner

pytestmark = pytest.mark.integration

_ROOT = pathlib.Path(__file__).parent.parent
_MODULE = "user_best_of_k"
_FLOW = f"{_MODULE}:make_flow"


def _user_file(directory: pathlib.Path) -> None:
  shutil.copy(_ROOT / "examples" / "rejection_sampling.py", directory / f"{_MODULE}.py")


def _config(variant: str, **algorithm):
  cd = runpy.run_path(str(_ROOT / "configs" / "ppo_tiny.py"))["get_config"](variant)
  cd.total_steps = 2
  cd.rollout.batch_size = 8
  cd.rollout.max_new_tokens = 8
  cd.reward.model_coef = 0.5  # continuous scores: the best of a group is unique
  cd.eval.num_prompts = 0
  cd.ppo.group_size = 4
  cd.algorithm.flow = _FLOW
  cd.algorithm.update(algorithm)
  return from_config_dict(cd)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """Both placements import the flow from a user's directory (on sys.path, as PYTHONPATH puts
  it), not from the repository."""
  directory = tmp_path_factory.mktemp("user")
  _user_file(directory)
  sys.path.insert(0, str(directory))
  try:
    out = {}
    for variant in ("colocated", "disaggregated"):
      workdir = str(tmp_path_factory.mktemp(variant))
      runner = Runner(_config(variant), workdir, show_progress=False)
      before = jax.device_get(runner.cluster.states[Role.ACTOR].params)
      out[variant] = (runner, runner.run(), before)
    assert sys.modules[_MODULE].__file__ == str(directory / f"{_MODULE}.py")
  finally:
    sys.path.remove(str(directory))
    sys.modules.pop(_MODULE, None)
  return out


def test_user_flow_gives_the_same_numbers_on_two_placements(runs):
  base, other = runs["colocated"][1].metrics, runs["disaggregated"][1].metrics
  assert [r["step"] for r in base] == [0, 1]
  assert_same_numbers(
    base, other, ("reward/mean", "reward/best_mean", "loss/sft", "actor/grad_norm")
  )
  for a in base:
    assert a["reward/best_mean"] > a["reward/mean"]  # the kept samples are the better ones
  assert base[0]["loss/sft"] != base[1]["loss/sft"]


@pytest.mark.parametrize("variant", ["colocated", "disaggregated"])
def test_user_flow_trains_and_syncs_on_its_roles_meshes(runs, variant):
  runner, result, before = runs[variant]
  assert set(result.compilations.values()) == {1}, result.compilations
  assert {"select_best", "sft_step"} <= set(result.compilations)
  params = runner.cluster.states[Role.ACTOR].params
  changed = [
    not np.array_equal(a, np.asarray(b))
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(params), strict=True)
  ]
  assert any(changed)
  ids = [d.id for d in jax.devices()]
  want = {ids[i] for i in runner.placement[Role.ROLLOUT].devices}
  for a, b in zip(
    jax.tree.leaves(params), jax.tree.leaves(runner.cluster.engine.params), strict=True
  ):
    assert {s.device.id for s in b.addressable_shards} == want
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_bad_flow_is_a_clear_error(tmp_path):
  with pytest.raises(ValueError, match="cannot import flow 'examples.nothing:make_flow'"):
    Runner(_config("colocated", flow="examples.nothing:make_flow"), str(tmp_path))
  with pytest.raises(ValueError, match="No module named 'nothing_here' .a module of your own"):
    Runner(_config("colocated", flow="nothing_here:make_flow"), str(tmp_path))
  with pytest.raises(ConfigError, match="'algorithm.flow' must be 'module:function'"):
    _config("colocated", flow="examples.rejection_sampling")
  with pytest.raises(ValueError, match="'algorithm.name' must be one of .*grpo"):
    Runner(_config("colocated", flow="", name="nope"), str(tmp_path))


_FLOW_CLASS = """from rlhfjax.flows.base import Flow


class F(Flow):
  def __init__(self, ctx):
    del ctx

  def iteration(self, i):
    return {row}


def make_flow(ctx):
  return F(ctx)
"""
_USER_FAULTS = {
  "syntax": ("def make_flow(ctx)\n  return 1\n", r"^{file}:1: flow '{flow}' could not be "
             r"imported: SyntaxError: "),
  "raises_at_import": ("import math\nmath.sqrt(-1)\n", r"^{file}:2: flow '{flow}' could not "
                       r"be imported: ValueError: math domain error"),
  "factory_raises": ("def make_flow(ctx):\n  raise RuntimeError('no judge')\n",
                     r"^{file}:2: flow '{flow}' raised RuntimeError: no judge$"),
  "factory_returns_int": ("def make_flow(ctx):\n  return 42\n", r"^flow '{flow}' returned int, "
                          r"not a flow: it has no iteration, checkpoint_items"),
  "iteration_raises": (_FLOW_CLASS.format(row="undefined_name"),
                       r"^{file}:9: flow '{flow}' iteration 0 raised NameError: "),
  "iteration_returns_none": (_FLOW_CLASS.format(row="None"),
                             r"^flow '{flow}' iteration 0 returned NoneType; expected a dict"),
  "non_scalar_metric": (_FLOW_CLASS.format(row="{'step': i, 'x': [1.0, 2.0]}"),
                        r"^flow '{flow}' iteration 0 returned metric 'x' as an array of shape "
                        r"\(2,\)"),
}  # fmt: skip


@pytest.mark.parametrize("fault", list(_USER_FAULTS))
def test_a_user_flow_fault_names_the_users_file_not_an_internal_error(tmp_path, fault):
  """Issue 28, item 7: the user's file and line first, the flow named, exit status 2."""
  from rlhfjax import errors

  source, pattern = _USER_FAULTS[fault]
  module = f"user_fault_{fault}"
  (tmp_path / f"{module}.py").write_text(source)
  flow = f"{module}:make_flow"
  sys.path.insert(0, str(tmp_path))
  try:
    with pytest.raises(Exception) as caught:  # noqa: PT011 - what it is is the test below
      Runner(_config("colocated", flow=flow), str(tmp_path / "run"), show_progress=False).run()
  finally:
    sys.path.remove(str(tmp_path))
    sys.modules.pop(module, None)
  line, status = errors.describe(caught.value)
  file = re.escape(str(tmp_path / f"{module}.py"))
  assert re.search(pattern.format(file=file, flow=re.escape(flow)), line), line
  assert status == errors.USER_ERROR, line


def test_a_user_flow_row_without_step_is_given_its_iteration(tmp_path):
  (tmp_path / "user_no_step.py").write_text(_FLOW_CLASS.format(row="{'x': 2.0 * i}"))
  sys.path.insert(0, str(tmp_path))
  try:
    config = _config("colocated", flow="user_no_step:make_flow")
    result = Runner(config, str(tmp_path / "run"), show_progress=False).run()
  finally:
    sys.path.remove(str(tmp_path))
    sys.modules.pop("user_no_step", None)
  assert [(r["step"], r["x"]) for r in result.metrics] == [(0, 0.0), (1, 2.0)]
