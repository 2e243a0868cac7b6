"""The offload benchmark's round trip and the GPU benchmarks' datasheet peaks (on CPU)."""

import jax
import jax.numpy as jnp
import pytest

from rlhfjax.bench import offload_bench, step_bench

pytestmark = pytest.mark.unit


def test_offload_rows_report_a_bit_identical_round_trip_through_pinned_host():
  rows = offload_bench.run("tiny", repeats=2)
  assert [r["part"] for r in rows] == ["reference_params", "actor_opt_state"]
  for row in rows:
    assert row["parked_memory_kinds"] == ["pinned_host"]
    assert row["bit_identical"]
    assert row["part_bytes"] > 0 and row["to_host_s"] > 0 and row["to_device_s"] > 0
  # AdamW keeps two moments per parameter (plus scalar counts): twice the parameters' bytes.
  assert rows[1]["part_bytes"] == pytest.approx(2 * rows[0]["part_bytes"], rel=0.01)


def test_fingerprint_changes_with_one_bit():
  x = jnp.arange(16, dtype=jnp.bfloat16)
  flipped = x.at[3].set(jax.lax.bitcast_convert_type(jnp.uint16(0x4041), jnp.bfloat16))
  assert x[3] != flipped[3]
  assert int(offload_bench._fingerprint([x])[0]) != int(offload_bench._fingerprint([flipped])[0])


def test_peaks_follow_the_device_kind():
  class Kind:
    def __init__(self, kind):
      self.device_kind = kind

  assert step_bench.peaks(Kind("NVIDIA H200"))[1] == 4.8e12
  assert step_bench.peaks(Kind("NVIDIA H100 80GB HBM3"))[1] == step_bench.H100_HBM_BYTES_PER_S
  assert step_bench.peaks(Kind("cpu")) == (step_bench.H100_BF16_FLOPS, 3.35e12)
