"""The planner prices packed runs: real tokens over the packing's fill, token-budget memory,
`strategy=auto` from the config's packing. `plan_placement.py --packed`:
test_planner_packing_e2e.py."""

import math

import numpy as np
import pytest
from runs_testing import shipped_config

from rlhfjax.costmodel import costs, fill, hardware, memory
from rlhfjax.costmodel.efficiency import Efficiency
from rlhfjax.costmodel.pricing import CRITIC_FREE
from rlhfjax.costmodel.workload import Workload, resolve_model
from rlhfjax.data import packing
from rlhfjax.placement import estimate_memory, format_batches, strategies
from rlhfjax.placement.memory import model_options, sharding_of
from rlhfjax.placement.spec import Role
from rlhfjax.planner import auto, evaluate

pytestmark = pytest.mark.pure

PROMPT, MEAN, MAX = 64, 128, 512
WIDTH = PROMPT + MAX


def _workload(**changes) -> Workload:
  """A GRPO iteration whose responses average a quarter of their maximum."""
  base = dict(
    actor=resolve_model("1b"),
    pricing=CRITIC_FREE,
    prompts=32,
    samples_per_prompt=8,
    prompt_len=PROMPT,
    response_len_mean=MEAN,
    response_len_max=MAX,
    optimizer_steps=2,
  )
  return Workload(**{**base, **changes})


def _packed(**changes) -> Workload:
  return _workload(padded=False, packed=True, **changes)


def test_long_tailed_lengths_have_the_mean_and_stay_within_the_maximum():
  lengths = fill.long_tailed_lengths(1000, MEAN, MAX)
  assert lengths.min() >= 1 and lengths.max() == MAX  # the tail reaches the cap
  assert abs(lengths.mean() - MEAN) <= 0.5  # the scale is bisected to the mean
  assert np.median(lengths) < MEAN  # long-tailed: most are shorter than the mean
  np.testing.assert_array_equal(lengths, fill.long_tailed_lengths(1000, MEAN, MAX))
  assert (fill.long_tailed_lengths(7, MAX, MAX) == MAX).all()


def test_packed_stage_is_the_engines_packer_on_the_sampled_lengths():
  work = _packed()
  stage = work.packing(256, max_rows=16, multiple=2)
  lengths = fill.sample_lengths(
    256, prompt_len=PROMPT, prompt_mean=PROMPT, response_mean=MEAN, response_max=MAX
  )
  batches = packing.micro_batches(lengths, WIDTH, 16, 2)
  assert stage.real_tokens == lengths.sum() == 256 * (PROMPT + MEAN)
  assert stage.rows == sum(p.rows for _, p in batches) and stage.micro_batches == len(batches)
  assert stage.width == WIDTH
  # Best-fit needs at least the rows the tokens fill; it leaves some room (fill below 1).
  assert math.ceil(stage.real_tokens / WIDTH) <= stage.rows < 256
  assert 0.5 < stage.fill < 1


def _stage_seconds(work: Workload, spec, micro_batch: int) -> dict:
  hw = hardware.load_hardware("h100")
  return evaluate.evaluate(spec, work, hw, Efficiency(), micro_batch=micro_batch).stages


def test_packed_stages_cost_their_packings_rows_and_more_than_the_ideal():
  """On one device with no fixed costs (no collectives, no overheads), scoring costs its rows
  of `WIDTH` tokens: packed / padded = the packing's rows / the sequences."""
  spec, mb = strategies.colocated(1), 4
  padded, packed = _workload(), _packed()
  ideal = _workload(padded=False)  # real lengths, every computed token real
  n = padded.sequences
  # The engine's packer on the sampled lengths, the scoring call's rows (mb x 1 device).
  lengths = fill.sample_lengths(
    n, prompt_len=PROMPT, prompt_mean=PROMPT, response_mean=MEAN, response_max=MAX
  )
  rows = sum(p.rows for _, p in packing.micro_batches(lengths, WIDTH, mb))
  real_fill = lengths.sum() / (rows * WIDTH)
  assert real_fill < 1

  t_pad, t_pack, t_ideal = (_stage_seconds(w, spec, mb) for w in (padded, packed, ideal))
  assert t_pack["score"] / t_pad["score"] == pytest.approx(rows / n, rel=1e-12)
  # Real tokens over the fill: the tokens computed per sequence, against padding's WIDTH.
  assert rows / n == pytest.approx((PROMPT + MEAN) / real_fill / WIDTH, rel=1e-12)
  assert t_pack["score"] < t_pad["score"] / 2  # mean/max = 1/4: well over half is padding
  # The fill loss (and rows' full-width attention) make it cost more than the real tokens.
  assert t_pack["score"] >= t_ideal["score"] / real_fill
  # Training: the same ratio once the update's token-independent part (optimizer) is off.
  hw, config = hardware.load_hardware("h100"), padded.actor
  group = costs.Group(devices=1)
  optimizer = costs.train_time(
    hw,
    Efficiency(),
    config,
    "lm",
    group,
    sequences=0,
    seq_len=WIDTH,
    epochs=1,
    optimizer_steps=2,
    micro_steps=2,
    remat="none",
  )
  # Each of the two mini-batches packs its n/2 sequences on its own.
  half = fill.sample_lengths(
    n // 2, prompt_len=PROMPT, prompt_mean=PROMPT, response_mean=MEAN, response_max=MAX
  )
  per_step = sum(p.rows for _, p in packing.micro_batches(half, WIDTH, mb))
  ratio = (t_pack["update"] - optimizer) / (t_pad["update"] - optimizer)
  assert ratio == pytest.approx(2 * per_step / n, rel=1e-9)


def test_packed_micro_batch_memory_is_its_token_budget():
  spec = strategies.colocated(8)  # fsdp=8: eight batch shards
  hw, eff = hardware.load_hardware("h100"), Efficiency()
  shards = sharding_of(spec[Role.ACTOR])
  width = WIDTH
  opts = evaluate.options(_workload(), hw, eff)

  def actor(work, mb):
    return evaluate.role_memory(Role.ACTOR, spec, work, hw, eff, mb, 0)

  def expect(mb):
    return memory.train_memory(
      resolve_model("1b"), "lm", shards, micro_batch=mb, seq_len=width, options=opts
    )

  # 32 rows of budget over 8 shards: 4 rows of `width` tokens per device, whatever the
  # padded micro-batch (2) would have been.
  assert actor(_packed(train_tokens=32 * width), 2) == expect(4)
  assert actor(_packed(train_tokens=32 * width + width - 1), 2) == expect(4)  # whole rows
  assert actor(_packed(), 2) == actor(_workload(), 2) == expect(2)  # 0: the padded size
  reference = evaluate.role_memory(
    Role.REFERENCE, spec, _packed(score_tokens=8 * width), hw, eff, 2, 0
  )
  assert reference == memory.forward_memory(
    resolve_model("1b"), "lm", shards, micro_batch=1, seq_len=width, options=opts
  )
  assert (
    reference.activations
    < evaluate.role_memory(Role.REFERENCE, spec, _workload(), hw, eff, 2, 0).activations
  )


def test_placement_memory_and_show_placement_use_the_token_budget():
  config = shipped_config(
    "grpo_tiny",
    {"ppo.max_tokens_per_micro_batch": 1024, "rollout.max_tokens_per_score_batch": 256},
  )
  width = config.rollout.max_seq_len
  train_rows, score_rows = auto.memory_rows(config)
  assert (train_rows, score_rows) == (1024 // width, 256 // width)
  spec = strategies.colocated(8)
  model = config.model.for_role("actor")
  for role, rows in ((Role.ACTOR, train_rows), (Role.REFERENCE, score_rows)):
    got = estimate_memory(
      role, spec[role], model, config.rollout, train_rows=train_rows, score_rows=score_rows
    )
    shards = sharding_of(spec[role])
    fn = memory.train_memory if role == Role.ACTOR else memory.forward_memory
    want = fn(
      model,
      "lm",
      shards,
      micro_batch=math.ceil(rows / shards.batch_shards),
      seq_len=width,
      options=model_options(model),
    )
    assert got.activations == want.activations and got.logits == want.logits
  line = format_batches(config, train_rows, score_rows, packed=True)
  assert f"{train_rows} x {width} = {train_rows * width} tokens" in line
  assert "ppo.max_tokens_per_micro_batch=1024" in line
  assert "rollout.max_tokens_per_score_batch=256" in line
  padded = shipped_config("grpo_tiny", {"ppo.packing": False})
  assert auto.memory_rows(padded) == (auto.train_rows(padded), None)
  assert format_batches(padded, 8, None, packed=False).startswith("micro-batches: padded")


@pytest.mark.parametrize("packing", [True, False])
def test_auto_prices_the_configs_packing(packing):
  config = shipped_config(
    "grpo_tiny", {"ppo.packing": packing, "ppo.max_tokens_per_micro_batch": 512}
  )
  work = auto.workload_of(config)
  assert (work.packed, work.padded) == (packing, not packing)
  assert work.train_tokens == (512 if packing else 0)
  width = config.rollout.max_seq_len
  assert work.score_tokens == (config.rollout.score_rows_packed * width if packing else 0)


def test_auto_packs_online_dpo_as_its_section_says():
  config = shipped_config("online_dpo_tiny", {})
  assert auto.packs(config) and auto.packing_of(config)["packed"]
  config = shipped_config("online_dpo_tiny", {"online_dpo.packing": False})
  assert not auto.packs(config) and auto.workload_of(config).padded


def test_workload_refuses_packed_and_padded_at_once_and_budgets_below_a_row():
  with pytest.raises(ValueError, match="set padded=False"):
    _workload(packed=True)
  with pytest.raises(ValueError, match="train_tokens"):
    _packed(train_tokens=WIDTH - 1)
