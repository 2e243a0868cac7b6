"""`placement.strategy=auto` for the one trained model of SFT and reward-model training: the
planner's data x fsdp x tensor split, checked against memory, ranked by predicted step time,
printed with the runner-up (run by the scripts: test_sft_rm_e2e.py, a resume onto it)."""

import os
import runpy

import pytest

from rlhfjax import config as config_lib
from rlhfjax.config.model import get_model_config
from rlhfjax.costmodel import efficiency, hardware
from rlhfjax.placement.spec import Role
from rlhfjax.placement.validate import PlacementError
from rlhfjax.planner import single
from rlhfjax.planner.place import place

pytestmark = pytest.mark.pure

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _plan(size, hw="h100", devices=8, batch=64, micro=1, seq=512, **kw):
  return single.plan(
    get_model_config(size),
    "lm",
    hardware.load_hardware(hw),
    efficiency.load_efficiency(None),
    devices,
    batch_size=batch,
    micro_batches=micro,
    seq_len=seq,
    **kw,
  )


def test_splits_cover_every_valid_factorisation():
  config = get_model_config("tiny")  # 4 heads, 2 KV heads
  got = set(single.splits(8, config, rows=8, max_tensor=8))
  want = {
    (d, 8 // t // d, t)
    for t in (1, 2)  # tensor 4 and 8 do not divide 2 KV heads
    for d in (1, 2, 4, 8)
    if (8 // t) % d == 0
  }
  assert got == want
  # A micro-batch of 6 rows splits over no batch shard count of 8 or 4 devices.
  assert all(d * f in (1, 2) for d, f, _ in single.splits(8, config, rows=6, max_tensor=8))


def test_small_model_prefers_data_parallel_and_a_big_one_needs_fsdp():
  small = _plan("tiny")
  assert small[0].fits and (small[0].data, small[0].tensor) == (8, 1)  # no gathers per step
  times = [p.step_s for p in small if p.fits]
  assert times == sorted(times)
  # 7B with fp32 AdamW moments cannot replicate over 8 x 80 GiB: the winner shards it.
  big = _plan("7b", hw="a800", batch=8, seq=1024)
  assert big[0].fits and big[0].fsdp * big[0].tensor >= 4
  replicated = next(p for p in big if p.data == 8)
  assert not replicated.fits and "GiB per device" in replicated.why_not
  assert all(p.memory.total <= 80 * 2**30 for p in big if p.fits)


def _sft_dict():
  return runpy.run_path(os.path.join(REPO, "configs", "sft_tiny.py"))["get_config"]().to_dict()


def test_auto_split_is_the_planners_winner_and_is_printed(capsys):
  cfg = config_lib.from_config_dict(
    {**_sft_dict(), "placement": {"strategy": "auto", "hardware": "h100", "num_devices": 8}},
  )
  model = get_model_config("tiny")
  spec = place(cfg, 8)[Role.ACTOR]
  lines = capsys.readouterr().out.splitlines()
  plans = single.plan(
    model,
    "lm",
    hardware.load_hardware("h100"),
    efficiency.load_efficiency(None),
    8,
    batch_size=cfg.supervised.batch_size,
    micro_batches=cfg.supervised.micro_batches,
    seq_len=cfg.supervised.max_len,
  )
  best = plans[0]
  assert spec.axes == (("data", best.data), ("fsdp", best.fsdp), ("tensor", best.tensor))
  assert lines[0].startswith(f"placement auto chosen: {best.label} predicted ")
  assert lines[1].startswith(f"placement auto runner-up: {plans[1].label} predicted ")


def test_auto_on_local_without_calibration_says_how():
  cfg = config_lib.from_config_dict({**_sft_dict(), "placement": {"strategy": "auto"}})
  with pytest.raises(ValueError, match="run scripts/calibrate.py --out=FILE"):
    place(cfg, 8)


def test_bad_strategy_is_one_line():
  cfg = config_lib.from_config_dict({**_sft_dict(), "placement": {"strategy": "interleaved"}})
  with pytest.raises(PlacementError, match="'placement.strategy' must be one of colocated, auto"):
    place(cfg, 8)
