"""Tensor parallelism across hosts: the groups a mesh's `tensor` axis forms, the warning for
groups spanning hosts, the planner pricing their all-reduces at the network's rate, and
`strategy=auto` proposing only placements every process of the job takes part in."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from rlhfjax.config import from_config_dict
from rlhfjax.costmodel import costs, efficiency, hardware
from rlhfjax.costmodel.workload import Workload, resolve_model
from rlhfjax.placement import strategies
from rlhfjax.placement.hosts import nodes_of, tensor_across_hosts, tensor_groups
from rlhfjax.placement.spec import PlacementSpec, Role, RoleSpec
from rlhfjax.planner import auto, evaluate, single
from rlhfjax.planner.place import tensor_warnings

pytestmark = pytest.mark.pure


def _numpy_tensor_groups(role_spec: RoleSpec) -> set[tuple[int, ...]]:
  """The reference: the mesh as `make_mesh` lays it out (row-major), the tensor axis moved last
  and every other axis flattened."""
  grid = np.array(role_spec.devices).reshape(role_spec.axis_sizes)
  axis = role_spec.axis_names.index("tensor")
  rows = np.moveaxis(grid, axis, -1).reshape(-1, role_spec.axis_size("tensor"))
  return {tuple(int(d) for d in row) for row in rows}


@pytest.mark.parametrize(
  "role_spec",
  [
    RoleSpec.training(range(16), data=2, fsdp=2, tensor=4),
    RoleSpec.training(np.random.default_rng(0).permutation(16).tolist(), fsdp=4, tensor=4),
    RoleSpec.generation(range(4, 12), data=2, tensor=4),
    RoleSpec.generation(range(8), data=8, tensor=1),
    # A tensor axis that is not last (not a shipped layout; the arithmetic must not assume it).
    RoleSpec(devices=tuple(range(12)), axes=(("tensor", 3), ("data", 4)), layout="generation"),
  ],
  ids=["training", "permuted", "generation", "no-tensor", "tensor-first"],
)
def test_tensor_groups_are_the_mesh_rows_along_its_tensor_axis(role_spec):
  groups = tensor_groups(role_spec)
  assert set(groups) == _numpy_tensor_groups(role_spec)
  assert sorted(d for g in groups for d in g) == sorted(role_spec.devices)


def _spec(**roles: RoleSpec) -> PlacementSpec:
  return PlacementSpec(strategy="explicit", roles={Role(r): s for r, s in roles.items()})


def test_a_tensor_group_across_nodes_warns_once_naming_role_size_and_nodes():
  spec = _spec(
    actor=RoleSpec.training(range(6), fsdp=3, tensor=2),
    rollout=RoleSpec.generation(range(6, 14), data=2, tensor=4),  # 6-9 straddles nodes 0 and 1
  )
  (line,) = tensor_across_hosts(spec, nodes_of(16, 8), unit="node")
  assert line.startswith("rollout: tensor=4 spans nodes 0, 1 (e.g. devices 6-9); ")
  assert "tensor parallel belongs inside a node" in line
  # The same groups on hosts named as a live job names them, one process per device.
  hosts = [f"gpu-{i // 8}" for i in range(16)]
  assert tensor_across_hosts(spec, hosts)[0].startswith(
    "rollout: tensor=4 spans hosts gpu-0, gpu-1"
  )
  # Aligned to the nodes, the same sizes stay inside them.
  aligned = _spec(rollout=RoleSpec.generation(range(8, 16), data=2, tensor=4))
  assert tensor_across_hosts(aligned, nodes_of(16, 8)) == []


def test_a_group_across_nodes_with_its_tensor_groups_inside_them_does_not_warn():
  spec = strategies.colocated(16, tensor=8, rollout_tensor=8)
  assert tensor_across_hosts(spec, nodes_of(16, 8)) == []
  # Four devices a node: every role's eight-way tensor groups span two nodes.
  lines = tensor_across_hosts(spec, nodes_of(16, 4), unit="node")
  assert [line.split(":")[0] for line in lines] == [r.value for r in Role]
  assert all("tensor=8 spans nodes 0, 1, 2, 3 (e.g. devices 0-7)" in line for line in lines)


def test_show_placement_warns_on_the_nodes_of_the_configured_hardware():
  roles = {
    role: {"devices": list(range(8)), "axes": {"fsdp": 4, "tensor": 2}}
    for role in ("actor", "reference", "critic", "reward")
  }
  roles["rollout"] = {"devices": list(range(6, 14)), "axes": {"data": 2, "tensor": 4}}
  roles["colocate"] = [["actor", "reference", "critic", "reward", "rollout"]]
  placement = {"strategy": "explicit", "num_devices": 16, "explicit": roles}
  config = from_config_dict({"model": {"size": "tiny"}, "placement": placement})
  spec = strategies.build_placement(config.placement, 16)
  assert tensor_warnings(config, spec) == []  # 'local' without a calibration: no node size
  h100 = dataclasses.replace(config.placement, hardware="h100")  # 8 GPUs a node
  (line,) = tensor_warnings(dataclasses.replace(config, placement=h100), spec)
  assert line.startswith("rollout: tensor=4 spans nodes 0, 1 (e.g. devices 6-9)")


# --- The planner ---------------------------------------------------------------------------


def _workload() -> Workload:
  seven = resolve_model("7b")
  return Workload(
    actor=seven,
    critic=seven,
    reward=seven,
    prompts=256,
    prompt_len=512,
    response_len_mean=256,
    response_len_max=512,
  )


def _crossing(spec: PlacementSpec, order: list[int]) -> PlacementSpec:
  """`spec` with every role's devices listed in `order` (same axes): its groups hold the same
  devices, its tensor groups others."""
  return dataclasses.replace(
    spec,
    roles={
      role: dataclasses.replace(rs, devices=tuple(order[d] for d in rs.devices))
      for role, rs in spec.roles.items()
    },
  )


def test_tensor_groups_across_nodes_are_priced_at_the_network_rate():
  hw, eff = hardware.load_hardware("h100"), efficiency.load_efficiency(None)
  aligned = strategies.colocated(16, tensor=8, rollout_tensor=8)
  # Half of each tensor group on either node: devices 0-3 + 8-11, then 4-7 + 12-15.
  crossing = _crossing(aligned, [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15])
  specs = {"a": aligned, "x": crossing}
  groups = {name: evaluate._group(s[Role.ACTOR], 8) for name, s in specs.items()}
  # Both groups span the two nodes (their FSDP gathers cross the network alike) ...
  assert groups["a"].spans_nodes and groups["x"].spans_nodes
  # ... but only the crossing one's tensor all-reduces do.
  assert not groups["a"].tensor_spans_nodes and groups["x"].tensor_spans_nodes
  plans = {n: evaluate.evaluate(s, _workload(), hw, eff, micro_batch=1) for n, s in specs.items()}
  for stage in ("generate", "score", "update"):
    assert plans["x"].stages[stage] > plans["a"].stages[stage], stage
  assert plans["x"].iteration_s > plans["a"].iteration_s

  # The difference of one scoring forward is exactly its all-reduces at the two rates: two per
  # layer of the [tokens, d] activations, a ring over the 8 ranks (2 (t-1)/t of the data).
  config, tokens = resolve_model("7b"), 64 * 1024
  forward = {
    spans: costs.forward_time(
      hw,
      eff,
      config,
      "lm",
      dataclasses.replace(groups["a"], tensor_spans_nodes=spans),
      sequences=64,
      seq_len=1024,
      micro_steps=1,
    )
    for spans in (False, True)
  }
  bytes_ = 2 * (tokens / groups["a"].replicas) * config.hidden_size * 2  # bfloat16
  ring = 2 * config.num_layers * bytes_ * 7 / 8 / eff.collective_bw
  expected = ring / hw.inter_node_bw - ring / hw.intra_node_bw
  assert forward[True] - forward[False] == pytest.approx(expected, rel=1e-12)


def test_single_role_splits_price_tensor_groups_across_nodes_at_the_network_rate():
  hw = dataclasses.replace(hardware.load_hardware("h100"), devices_per_node=6)
  eff, config = efficiency.load_efficiency(None), resolve_model("7b")  # 32 heads
  kwargs = dict(batch_size=48, micro_batches=1, seq_len=512)
  plans = {(p.data, p.fsdp, p.tensor): p for p in single.plan(config, "lm", hw, eff, 12, **kwargs)}
  # tensor=4 over 12 devices, 6 a node: the group 4-7 straddles nodes 0 and 1; tensor=2 does not.
  for split, spans in (((1, 3, 4), True), ((1, 6, 2), False)):
    data, fsdp, tensor = split
    group = costs.Group(
      devices=12, tensor=tensor, data=data, spans_nodes=True, tensor_spans_nodes=spans
    )
    step = costs.train_time(
      hw, eff, config, "lm", group, sequences=48, seq_len=512, epochs=1, optimizer_steps=1,
      micro_steps=1, remat="none", optimizer_dtype=None,
    )  # fmt: skip
    assert plans[split].step_s == pytest.approx(step, rel=1e-12)
  slower = dataclasses.replace(
    costs.Group(devices=12, tensor=4, data=1, spans_nodes=True), tensor_spans_nodes=True
  )
  assert costs.train_time(
    hw, eff, config, "lm", slower, sequences=48, seq_len=512, epochs=1, optimizer_steps=1,
    micro_steps=1, remat="none",
  ) > costs.train_time(
    hw, eff, config, "lm", dataclasses.replace(slower, tensor_spans_nodes=False), sequences=48,
    seq_len=512, epochs=1, optimizer_steps=1, micro_steps=1, remat="none",
  )  # fmt: skip


# --- strategy=auto across processes --------------------------------------------------------


@pytest.mark.parametrize("processes", [2, 4, 8])
def test_auto_proposes_placements_every_process_takes_part_in(processes):
  """Every placement runs across processes (`rlhfjax.mesh.transfer`) as long as each process
  owns one of its devices (`distributed.check_placement`): every usable plan of `auto` on the
  job's 8 devices passes that for `processes` processes of 8 / processes devices each, and the
  plans are not narrowed to co-location."""
  config = from_config_dict(
    {
      "model": {"size": "tiny"},
      "placement": {"strategy": "auto", "hardware": "h100"},
      "reward": {"model_coef": 0.5},
    }
  )
  _, plans = auto.choose(config, 8)
  owner = [d // (8 // processes) for d in range(8)]
  for plan in plans:
    assert {owner[d] for d in plan.spec.devices} == set(range(processes)), plan.label
  assert {p.spec.strategy for p in plans} >= {"colocated", "interleaved", "disaggregated"}
  # Some usable plans put a role's devices on processes that another role's miss entirely.
  split = [
    p
    for p in plans
    if {owner[d] for d in p.spec[Role.ROLLOUT].devices}
    != {owner[d] for d in p.spec[Role.ACTOR].devices}
  ]
  assert split
