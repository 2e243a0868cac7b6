"""The cost model's pipeline stages and fused actor-critic schedule (`costmodel.pipeline`): the
priced tables against `rlhfjax.schedules`, one stage against today's costs, memory per stage,
the planner on a spec with a `stage` axis, and the README's quoted prediction
(`scripts/plan_pipeline.py` itself: test_costmodel_pipeline_e2e.py)."""

import dataclasses
import math
import pathlib

import pytest

from rlhfjax import schedules
from rlhfjax.config.model import LoraConfig, param_count
from rlhfjax.costmodel import costs, efficiency, hardware, memory, pipeline
from rlhfjax.costmodel.workload import Workload, resolve_model
from rlhfjax.placement import strategies
from rlhfjax.placement.spec import PlacementSpec, Role, RoleSpec
from rlhfjax.planner import evaluate

pytestmark = pytest.mark.pure

REPO = pathlib.Path(__file__).resolve().parents[1]
H100 = hardware.load_hardware("h100")
EFF = efficiency.load_efficiency(None)
B70 = resolve_model("70b")  # as the planner reads a size: bf16 parameters
_LORA = LoraConfig(rank=8)
# 1024 prompts in 8 optimizer steps: 128 sequences per step of 2048 padded tokens.
WORK = Workload(actor=B70, critic=B70, reward=B70, prompts=1024, optimizer_steps=8, remat="full")


def _work(busy=12.0, m=8, backward_cost=pipeline.BACKWARD_COST, send=0.0, flushes=3):
  return pipeline.StageWork(
    busy_s=busy, send_s=send, micro_batches=m, flushes=flushes, backward_cost=backward_cost
  )


@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 32), (8, 8)])
def test_priced_bubble_is_the_schedule_tables(name, p, m):
  table = pipeline.table(name, p, m)
  work = _work(m=m)
  priced = pipeline.priced(table, [work])
  expected = schedules.bubble_fraction(table, 1.0, pipeline.BACKWARD_COST)
  assert priced.bubble_fraction == pytest.approx(expected, rel=1e-12)
  # Without sends the update is the busy time stretched by the bubble.
  assert priced.seconds == pytest.approx(work.busy_s / (1 - expected), rel=1e-12)


@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 32), (8, 3)])
def test_equal_op_costs_give_the_textbook_bubble(name, p, m):
  """(p - 1) / (m + p - 1), computed here from p and m, not from the tables."""
  priced = pipeline.priced(pipeline.table(name, p, m), [_work(m=m, backward_cost=1.0)])
  assert priced.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), rel=1e-12)
  assert priced.ticks == 2 * (m + p - 1)


def test_sends_follow_every_tick():
  table = pipeline.table("1f1b", 4, 8)
  quiet, loud = (pipeline.priced(table, [_work(send=s)]) for s in (0.0, 0.01))
  assert loud.send_s == pytest.approx(3 * table.ticks * 0.01, rel=1e-12)  # 3 flushes
  assert loud.seconds == pytest.approx(quiet.seconds + loud.send_s, rel=1e-12)
  assert loud.bubble_fraction == quiet.bubble_fraction


def test_a_send_is_one_micro_batch_of_stage_inputs():
  """[rows, seq, hidden] in bf16 over the network (stages on different nodes), per device;
  the epochs repeat the micro-batches, they do not change them."""
  group = costs.Group(devices=8)  # FSDP 8: 8 batch shards
  kwargs = dict(sequences=1024, seq_len=2048, optimizer_steps=8, micro_steps=8 * 8, remat="none")
  rows = 1024 // (8 * 8 * 8)
  expected = rows * 2048 * B70.hidden_size * 2 / (H100.inter_node_bw * EFF.collective_bw)
  for epochs in (1, 2):
    work = pipeline.update_work(
      H100, EFF, B70, "lm", group, stages=4, crosses_nodes=True, epochs=epochs, **kwargs
    )
    assert work.send_s == pytest.approx(expected, rel=1e-12)
    assert (work.micro_batches, work.flushes) == (8, 8 * epochs)


def test_the_vocabulary_is_gathered_and_its_gradients_reduce_scattered_once_a_step():
  """Per optimizer step, each device's block of the embedding and the head (vocab x hidden
  each, over tensor x fsdp) gathered in bf16 and its float32 gradients reduce-scattered, a ring
  over the stages ((P - 1) / P of the buffer each way); with LoRA only the gather; nothing on
  one stage, or when the vocabulary does not divide over tensor x stages (whole everywhere)."""
  group = costs.Group(devices=8, tensor=2)
  shard = 2 * B70.vocab_size * B70.hidden_size / 8
  link = H100.inter_node_bw * EFF.collective_bw

  def priced(config, stages=4, crosses_nodes=True):
    return pipeline.vocabulary_sync_time(
      H100, EFF, config, "lm", group, stages=stages, crosses_nodes=crosses_nodes
    )

  assert priced(B70) == pytest.approx(shard * (2 + 4) * 3 / 4 / link, rel=1e-12)
  lora = B70.replace(lora=_LORA)
  assert priced(lora) == pytest.approx(shard * 2 * 3 / 4 / link, rel=1e-12)
  assert priced(B70, crosses_nodes=False) < priced(B70) / 5  # the node's links
  assert priced(B70, stages=1) == 0.0
  assert priced(B70.replace(vocab_size=B70.vocab_size + 1)) == 0.0
  # Charged once per optimizer step, over every epoch.
  kwargs = dict(sequences=1024, seq_len=2048, optimizer_steps=8, micro_steps=64, remat="none")
  works = [
    pipeline.update_work(
      H100, EFF, B70, "lm", group, stages=4, crosses_nodes=True, **kwargs, epochs=epochs
    )  # fmt: skip
    for epochs in (1, 2)
  ]
  whole = [costs.train_time(H100, EFF, B70, "lm", group, **kwargs, epochs=e) for e in (1, 2)]
  for work, flat, epochs in zip(works, whole, (1, 2), strict=True):
    fixed = (EFF.stage_s + EFF.update_s) * work.flushes * H100.per_device(8)
    sync = work.flushes * priced(B70)
    assert work.busy_s == pytest.approx((flat - fixed) / 4 + fixed + sync, rel=1e-9)
    assert work.flushes == 8 * epochs


def test_a_pipeline_that_keeps_residuals_prices_no_recomputed_forward():
  """rlhfjax's pipelined backward, like Megatron's, keeps the residuals its remat policy keeps:
  3 passes and a backward op of 2 forwards without remat; with `pipeline_recompute` it runs
  the stage's forward again: one pass and one forward more, with full remat too."""
  group = costs.Group(devices=8, tensor=2)
  kwargs = dict(sequences=256, seq_len=2048, epochs=1, optimizer_steps=4, micro_steps=4 * 8)

  def work(recompute, remat):
    return pipeline.update_work(
      H100,
      EFF,
      B70,
      "lm",
      group,
      stages=4,
      crosses_nodes=False,
      remat=remat,
      recompute=recompute,
      **kwargs,
    )

  recomputed, kept = work(True, "none"), work(False, "none")
  assert (recomputed.backward_cost, kept.backward_cost) == (3.0, 2.0)
  # The stage's compute is 3 passes instead of 4; collectives, optimizer and dispatch stay.
  flops = 4 * 256 * 2048 * costs.forward_flops_per_token(B70, "lm", 1024)
  one_pass = flops / 4 / (H100.parallel(8) * H100.flops(B70.dtype) * EFF.train_mfu)
  # One pass more is one more set of tensor all-reduces, one more parameter gather (FSDP 4) and
  # one more launch of every layer per micro-step.
  extra_tp = costs._tensor_allreduce(H100, EFF, B70, group, 256 * 2048 / group.replicas, 1)
  param_bytes = costs.matmul_params(B70, "lm") * 2 / group.tensor
  bw = costs._link(H100, group) * EFF.collective_bw
  extra_gathers = 4 * 8 * costs._ring(param_bytes, group.fsdp, bw)
  launches = 4 * 8 * B70.num_layers * EFF.layer_s  # each layer's kernels, once more
  expected = (one_pass + extra_tp + extra_gathers + launches) / 4
  assert recomputed.busy_s - kept.busy_s == pytest.approx(expected, rel=1e-9)
  # Full remat runs each layer's forward again; recomputing the stage adds one more pass.
  full, both = work(False, "full"), work(True, "full")
  assert (full.backward_cost, both.backward_cost) == (3.0, 4.0)
  assert both.busy_s - full.busy_s == pytest.approx(expected, rel=1e-9)
  # A backward op costs two of its forwards instead of three.
  assert kept.op_s(schedules.BACKWARD) == pytest.approx(2 * kept.op_s(schedules.FORWARD))
  forward = recomputed.op_s(schedules.FORWARD)
  assert recomputed.op_s(schedules.BACKWARD) == pytest.approx(3 * forward)


def test_one_stage_is_todays_cost_exactly():
  group = costs.Group(devices=8, tensor=2)
  kwargs = dict(
    sequences=256,
    seq_len=2048,
    epochs=2,
    optimizer_steps=4,
    micro_steps=4 * 8,
    remat="none",
    devices_per_node=8,
  )
  today = costs.train_time(H100, EFF, B70, "lm", group, **kwargs)
  work = pipeline.update_work(H100, EFF, B70, "lm", group, stages=1, crosses_nodes=False, **kwargs)
  assert work.busy_s == today
  for name in ("1f1b", "gpipe"):
    assert pipeline.priced(pipeline.table(name, 1, 8), [work]).seconds == today
  both = pipeline.priced(pipeline.table("fused", 1, 8), [work, work])
  assert both.seconds == 2 * today and both.bubble_fraction == 0.0
  scoring = dict(sequences=256, seq_len=2048, micro_steps=8)
  assert pipeline.forward_time(
    H100, EFF, B70, "value", group, stages=1, crosses_nodes=False, **scoring
  ) == costs.forward_time(H100, EFF, B70, "value", group, **scoring)
  sharding = memory.Sharding(param_shards=8, batch_shards=4, tensor=2)
  options = memory.Options(remat="full")
  mem = dict(micro_batch=2, seq_len=2048, options=options)
  assert pipeline.train_memory(
    B70, "lm", sharding, stages=1, slots=0, **mem
  ) == memory.train_memory(B70, "lm", sharding, **mem)


def _pipelined(spec: PlacementSpec, stages: int, roles=(Role.ACTOR, Role.CRITIC)):
  """`spec` with `roles` split into `stages` pipeline stages: a first `stage` axis, FSDP
  divided by it."""

  def split(rs: RoleSpec) -> RoleSpec:
    axes = tuple((n, s // stages if n == "fsdp" else s) for n, s in rs.axes)
    return dataclasses.replace(rs, axes=(("stage", stages), *axes))

  return PlacementSpec(
    strategy=spec.strategy,
    roles={r: split(rs) if r in roles else rs for r, rs in spec.roles.items()},
  )


def test_a_stage_axis_of_one_plans_as_today():
  """A spec written with `stage`=1 (as the config's change may write it) is priced as one
  without the axis."""
  spec = strategies.colocated(16, tensor=2, rollout_tensor=4)
  work = WORK.replace(prompts=256, optimizer_steps=2)
  today = evaluate.evaluate(spec, work, H100, EFF, micro_batch=2)
  staged = evaluate.evaluate(_pipelined(spec, 1, tuple(spec.roles)), work, H100, EFF, micro_batch=2)
  assert staged.stages == today.stages
  assert staged.peak_memory_gib == today.peak_memory_gib


def test_fused_beats_two_1f1b_at_4_stages_and_8_micro_batches():
  p, m = 4, 8
  # Unequal models too. In lock-step the slowest op sets each tick: a critic of 5/12 the
  # actor's cost gains nothing from fusion (0.98x at these op costs).
  actor, critic = _work(busy=12.0, m=m), _work(busy=8.0, m=m)
  two = pipeline.priced(pipeline.table("two_1f1b", p, m), [actor, critic])
  fused = pipeline.priced(pipeline.table("fused", p, m), [actor, critic])
  assert fused.seconds < two.seconds
  assert fused.bubble_fraction < two.bubble_fraction
  # Back to back is each model's own 1F1B, one after the other.
  alone = [pipeline.priced(pipeline.table("1f1b", p, m), [w]).seconds for w in (actor, critic)]
  assert two.seconds == pytest.approx(sum(alone), rel=1e-12)

  gain = pipeline.compare(WORK, H100, EFF, devices=32, stages=p, micro_batches=m)
  assert gain.fused.seconds < gain.two_1f1b.seconds
  assert gain.gain == gain.two_1f1b.seconds / gain.fused.seconds > 1
  # Models of equal cost: the priced bubbles are the tables' at 1:3 op costs (actor and
  # critic above differ by their heads).
  same = [_work(m=m), _work(m=m)]
  for name in ("two_1f1b", "fused"):
    table = pipeline.table(name, p, m)
    expected = schedules.bubble_fraction(table, 1.0, pipeline.BACKWARD_COST)
    assert pipeline.priced(table, same).bubble_fraction == pytest.approx(expected, rel=1e-12)


def test_the_planner_prices_a_pipelined_spec_as_compare_does():
  """`evaluate` on actor and critic with a `stage` axis of 4 (32 devices, FSDP 8 per stage):
  its update stage is two 1F1B pipelines back to back, or the fused table with
  `fuse_actor_critic`, as `compare` prices them."""
  base = strategies.colocated(32, tensor=1, rollout_tensor=8)
  spec = _pipelined(base, 4)
  # 128 sequences per step over a stage's 8 batch shards at 2 rows: 8 micro-batches.
  gain = pipeline.compare(WORK, H100, EFF, devices=32, stages=4, micro_batches=8)
  plans = {}
  for fuse, expected in ((False, gain.two_1f1b), (True, gain.fused)):
    plan = evaluate.evaluate(spec, WORK.replace(fuse_actor_critic=fuse), H100, EFF, micro_batch=2)
    assert plan.stages["update"] == pytest.approx(expected.seconds, rel=1e-9)
    plans[fuse] = plan
  # Fused, the actor's working set carries the critic's too (both live in the one update).
  fused_actor, critic = plans[True].memory[Role.ACTOR], plans[True].memory[Role.CRITIC]
  assert fused_actor.grads == plans[False].memory[Role.ACTOR].grads + critic.grads
  assert fused_actor.total > plans[False].memory[Role.ACTOR].total
  # Generation and the weight sync do not see the training roles' stages.
  flat = evaluate.evaluate(base, WORK, H100, EFF, micro_batch=2)
  # Spans of records at other start times: equal up to the rounding of the absolute times (a few
  # dozen additions of seconds up to the iteration's).
  rounding = 64 * math.ulp(max(flat.iteration_s, plan.iteration_s))
  for stage in ("generate", "sync"):
    assert flat.stages[stage] == pytest.approx(plan.stages[stage], rel=0, abs=rounding)
  assert flat.stages["update"] != plan.stages["update"]


def test_params_per_device_fall_as_one_over_stages():
  sharding = memory.Sharding(param_shards=8, batch_shards=8)
  options = memory.Options(remat="full")
  kw = dict(micro_batch=2, seq_len=2048, options=options)
  one = pipeline.train_memory(B70, "lm", sharding, stages=1, slots=0, **kw)
  # The embedding's and the head's vocabulary split over the stages with their moments: what
  # a device keeps between steps is 1/P of everything. During a step the rest of them comes
  # back gathered, and their gradients are whole until the step's end: those are 1/P plus at
  # most their share of the parameters.
  vocab = 2 * B70.vocab_size * B70.hidden_size
  share = vocab / param_count(B70, "lm")
  for p in (2, 4, 8):
    staged = pipeline.train_memory(B70, "lm", sharding, stages=p, slots=p, **kw)
    for kind in ("params", "optimizer"):
      ratio = getattr(staged, kind) / getattr(one, kind)
      assert ratio == pytest.approx(1 / p, rel=1e-6), (p, kind, ratio)
    assert 1 / p <= staged.grads / one.grads <= 1 / p + share
    gathered = (1 - 1 / p) * vocab * 2 / 8  # bf16 over the 8 parameter shards
    assert staged.gathered - one.gathered == pytest.approx(gathered, rel=1e-6)


def test_the_stash_is_the_schedules_slots_of_stage_inputs_and_residuals():
  sharding = memory.Sharding(param_shards=8, batch_shards=8)
  kw = dict(stages=4, micro_batch=2, seq_len=2048, options=memory.Options(remat="full"))
  one_f, gpipe = pipeline.stash_slots("1f1b", 4, 8), pipeline.stash_slots("gpipe", 4, 8)
  slots = schedules.slots(schedules.single("1f1b", 4, 8))
  assert one_f == tuple(map(max, slots.activation_slots, slots.residual_slots)) == (4,)
  assert gpipe == (8,)  # GPipe keeps every micro-batch, 1F1B one per stage
  a = pipeline.train_memory(B70, "lm", sharding, slots=one_f[0], **kw)
  b = pipeline.train_memory(B70, "lm", sharding, slots=gpipe[0], **kw)
  stage_input = 2 * 2048 * B70.hidden_size * 2  # rows x tokens x width x bf16
  # Full remat keeps each of the stage's layers' input, the rows split over the 8 batch shards.
  residuals = B70.num_layers // 4 * 8 * 2 * 2048 * B70.hidden_size * 2 // 8
  assert b.activations - a.activations == (gpipe[0] - one_f[0]) * (stage_input + residuals)
  assert (a.params, a.grads, a.logits) == (b.params, b.grads, b.logits)


def test_uneven_splits_are_refused():
  with pytest.raises(ValueError, match="stages=3 must divide the model's num_layers=80"):
    pipeline.stage_config(B70, 3)
  with pytest.raises(ValueError, match="stages=3 must divide devices=32"):
    pipeline.layout(32, 3, 1, 8)
  with pytest.raises(ValueError, match="micro_batches=32 leaves batch shards without rows"):
    pipeline.compare(WORK, H100, EFF, devices=32, stages=4, micro_batches=32)


def test_readme_quotes_the_prediction():
  """README's pipeline paragraph: the numbers its command prints (rounded as quoted)."""
  readme = " ".join((REPO / "README.md").read_text().split())  # line breaks as spaces
  command = (
    "python scripts/plan_pipeline.py --actor=70b --critic=70b --hardware=h100 --devices=32 "
    "--stages=4 \\ --micro_batches=8 --prompts=1024 --optimizer_steps=8 --remat=full"
  )
  assert command in readme
  gain = pipeline.compare(WORK, H100, EFF, devices=32, stages=4, micro_batches=8)
  flat = pipeline.compare(WORK, H100, EFF, devices=32, stages=4, micro_batches=8, tensor=8)
  quoted = (
    f"{gain.two_1f1b.seconds:.1f} s for two 1F1B",
    f"{gain.fused.seconds:.1f} s for the",
    f"{gain.gain:.2f}x faster",
    f"from {gain.two_1f1b.bubble_fraction:.3f} to {gain.fused.bubble_fraction:.3f}",
    f"textbook 1F1B bubble is {schedules.textbook_bubble(4, 8):.3f}",
    f"at {gain.memory_gib['fused']:.1f} GiB per device instead of "
    f"{gain.memory_gib['two_1f1b']:.1f}",
    f"`unpipelined_s`, {gain.unpipelined_s:.1f} s, prices",
    f"FSDP over all {gain.unpipelined_layout.stage_group.fsdp} devices, tensor "
    f"{gain.unpipelined_layout.stage_group.tensor} as the flag says",
    f"tensor {flat.unpipelined_layout.stage_group.tensor} x FSDP "
    f"{flat.unpipelined_layout.stage_group.fsdp}, at {flat.unpipelined_s:.1f} s",
  )
  for text in quoted:
    assert text in readme, text
  assert gain.to_json()["unpipelined_layout"] == {"tensor": 1, "fsdp": 32}


def test_with_stages_splits_fsdp_into_contiguous_stages_and_reverses_the_critic():
  spec = strategies.with_stages(strategies.colocated(8, tensor=2), 2)
  actor, critic, rollout = spec[Role.ACTOR], spec[Role.CRITIC], spec[Role.ROLLOUT]
  assert actor.axes == (("stage", 2), ("data", 1), ("fsdp", 2), ("tensor", 2))
  assert actor.devices == tuple(range(8))  # stage j: the j-th block of 4
  assert critic.devices == (4, 5, 6, 7, 0, 1, 2, 3)  # the fused schedule's reversed critic
  assert spec[Role.REFERENCE].stages == spec[Role.REWARD].stages == 2
  assert rollout == strategies.colocated(8, tensor=2)[Role.ROLLOUT]  # generation untouched
  # The same as `placement.pipeline_stages` builds.
  assert spec.roles == strategies.colocated(8, tensor=2, pipeline_stages=2).roles
  with pytest.raises(strategies.PlacementError, match="pipeline_stages=8 does not divide"):
    strategies.with_stages(strategies.colocated(8, tensor=2), 8)


def test_a_stage_holds_its_layers_once_in_the_planners_memory():
  """Parameters per device are the model's over stage x fsdp x tensor, whether the layers are
  split into stages or sharded by FSDP alone (each stage counted with embedding and head)."""
  flat = strategies.colocated(8)
  staged = strategies.with_stages(flat, 4)
  work = WORK.replace(remat="full")
  mem = {
    name: evaluate.evaluate(spec, work, H100, EFF, micro_batch=1).memory
    for name, spec in (("flat", flat), ("staged", staged))
  }
  share = 2 * B70.vocab_size * B70.hidden_size / param_count(B70, "lm")
  for role in (Role.ACTOR, Role.REFERENCE):
    ratio = mem["staged"][role].params / mem["flat"][role].params
    assert 1 <= ratio <= 1 + 4 * share, (role, ratio)


def _long_rows(packed=False, recompute=True):
  """13B PPO on sequences of 8191 tokens (odd: no context parallelism), no remat, pipelines
  recomputing their stages' forwards."""
  b13 = resolve_model("13b")
  rows = dict(prompt_len=4095, response_len_mean=2048, response_len_max=4096, remat="none")
  work = Workload(
    actor=b13, critic=b13, reward=b13, prompts=64, pipeline_recompute=recompute, **rows
  )
  return work.replace(padded=False, packed=True) if packed else work


def test_auto_plans_pipeline_stages_where_nothing_fits_without():
  """On 8 H100 in pairs (tensor parallelism within a pair), a 13B PPO of 8191-token rows
  without remat fits no placement without stages; with `pipeline_recompute` the search splits
  the layers and a plan with stages wins, padded or packed (keeping every micro-batch's
  residuals, nothing fits). A packing run of a flow whose packed updates do not run through
  stages (`Pricing.packed_pipelines`) gets none."""
  from rlhfjax.costmodel.pricing import ONLINE_DPO
  from rlhfjax.planner import search

  kept = search.search(_long_rows(recompute=False), H100, EFF, 8, devices_per_node=2)
  assert kept and not any(p.fits for p in kept)
  plans = search.search(_long_rows(), H100, EFF, 8, devices_per_node=2)
  staged = [p for p in plans if any(s.stages > 1 for s in p.spec.roles.values())]
  assert staged and not any(p.fits for p in plans if p not in staged)
  winner = plans[0]
  assert winner.fits and winner in staged and "pp=" in winner.label
  assert winner.spec[Role.ACTOR].axis_size("tensor") <= 2
  line = search.explain(plans).splitlines()[-1]
  assert line.startswith("searched: ") and "stage 1/2/4/8" in line
  assert "the winner among them" in line
  packed = search.search(_long_rows(packed=True), H100, EFF, 8, devices_per_node=2)
  assert packed[0].fits and "pp=" in packed[0].label
  pairs = _long_rows(packed=True).replace(pricing=ONLINE_DPO, critic=None)
  unstaged = search.search(pairs, H100, EFF, 8, devices_per_node=2)
  assert not any(any(s.stages > 1 for s in p.spec.roles.values()) for p in unstaged)


def test_auto_plans_only_fusable_placements_for_a_fused_run():
  """`fuse_actor_critic` (the config's `ppo.fuse_actor_critic`) runs only where the actor and
  critic are pipelined on the same devices: the search plans every stage count of those and
  nothing else, and prices them with the fused table, the critic's stages reversed."""
  from rlhfjax.planner import search

  b7 = resolve_model("7b")
  work = Workload(actor=b7, critic=b7, reward=b7, prompts=512, remat="full")
  plans = search.search(work.replace(fuse_actor_critic=True), H100, EFF, 16)
  assert plans and all(evaluate.fused(p.spec, work.replace(fuse_actor_critic=True)) for p in plans)
  winner = plans[0]
  assert winner.fits and winner.label.endswith("fused")
  actor, critic = winner.spec[Role.ACTOR], winner.spec[Role.CRITIC]
  assert critic == strategies.reverse_stages(actor)
  # The fused table, not two 1F1B's: the same placement priced unfused updates for longer.
  unfused = evaluate.evaluate(winner.spec, work, H100, EFF, micro_batch=winner.micro_batch)
  assert winner.stages["update"] < unfused.stages["update"]


def test_with_role_mesh_gives_one_role_its_own_sizes():
  spec = strategies.colocated(8, tensor=2)
  narrow = strategies.with_role_mesh(spec, Role.REWARD, tensor=1)
  assert narrow[Role.REWARD].axes == (("data", 1), ("fsdp", 8), ("tensor", 1))
  assert narrow[Role.ACTOR] == spec[Role.ACTOR] and narrow[Role.REWARD].devices == tuple(range(8))
  replicas = strategies.with_role_mesh(spec, Role.ACTOR, data=2)
  assert replicas[Role.ACTOR].axes == (("data", 2), ("fsdp", 2), ("tensor", 2))
  with pytest.raises(strategies.PlacementError, match="tensor=2 x data=8 does not divide"):
    strategies.with_role_mesh(spec, Role.ACTOR, data=8)


def test_the_search_gives_a_scoring_role_its_own_tensor_size_where_it_pays():
  """70B PPO on 32 H100 with full remat: the reward model, which only scores, is faster
  FSDP-sharded over all 32 devices than tensor-parallel like the actor (its forwards need no
  per-layer all-reduces of the activations), so the winner gives it tensor 1 of its own."""
  from rlhfjax.planner import search

  work = WORK.replace(prompts=512, remat="full")
  plans = search.search(work, H100, EFF, 32)
  winner = plans[0]
  assert winner.fits and "rwt=1" in winner.label
  reward, actor = winner.spec[Role.REWARD], winner.spec[Role.ACTOR]
  assert reward.axis_size("tensor") == 1 < actor.axis_size("tensor")
  uniform = strategies.with_role_mesh(winner.spec, Role.REWARD, tensor=actor.axis_size("tensor"))
  same = evaluate.evaluate(uniform, work, H100, EFF, micro_batch=winner.micro_batch)
  assert winner.iteration_s < same.iteration_s
  assert "per-role tensor and data sizes" in search.explain(plans)


def test_a_cpu_host_plans_stages_of_one_device():
  """On a CPU host (`host_shared`: XLA's virtual devices), a collective inside a pipeline stage
  can hang XLA's runtime, so the search plans only stages of one device each."""
  from rlhfjax.planner import search

  b7 = resolve_model("7b")
  work = Workload(actor=b7, critic=b7, reward=b7, prompts=64, remat="full", fuse_actor_critic=True)
  host = dataclasses.replace(H100, host_shared=True)
  for hw, one in ((H100, False), (host, True)):
    plans = search.search(work, hw, EFF, 8)
    staged = [p.spec[Role.ACTOR] for p in plans]
    assert staged and all(s.stages > 1 for s in staged)
    assert all(len(s.devices) == s.stages for s in staged) == one
