"""Hardware as data: what one device computes and moves per second, and how much it holds.

Presets carry the vendors' public figures (dense, no sparsity). `local` is measured on the
current machine by `scripts/calibrate.py --out=FILE` and read back with `load_hardware`.
Bandwidths are bytes per second in one direction per device.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping

GB = 1e9
TB = 1e12
GIB = 2**30


@dataclasses.dataclass(frozen=True, kw_only=True)
class Hardware:
  """One accelerator type and its links."""

  name: str
  half_flops: float
  """Peak dense matmul FLOP/s in 16-bit (bf16, or fp16 on devices without bf16)."""
  float_flops: float
  """Peak dense matmul FLOP/s in float32 (without TF32)."""
  memory_gib: float
  """Memory per device."""
  memory_bw: float
  """Device memory bandwidth, bytes/s."""
  intra_node_bw: float
  """Device-to-device bandwidth inside a node (NVLink, ICI), bytes/s per device per direction."""
  inter_node_bw: float
  """Bandwidth per device between nodes (InfiniBand, DCN), bytes/s per direction."""
  devices_per_node: int
  native_half: bool = True
  """False where 16-bit matmuls run in float32 (XLA's CPU backend), so activations are f32."""
  pair_bw: tuple[tuple[float, ...], ...] = ()
  """Measured device-to-device copy rates (bytes/s), `local` only; empty for presets."""
  host_shared: bool = False
  """The devices are slices of one host's cores (XLA's virtual CPU devices): a group computes
  at the host's rate whatever its size, and stages on disjoint groups still take turns."""
  host_bw: float = 32 * GB
  """Host-to-device (and device-to-host) bandwidth per device per direction (PCIe), bytes/s:
  what ZeRO-Offload's gradient and parameter copies cross."""
  host_adam_rate: float = 4.5e9
  """Parameters per second one node's host CPUs update with Adam (DeepSpeed's CPU-Adam), all
  of its cores together; the host serves every device of the node."""
  device_cost: tuple[float, ...] = ()
  """`host_shared` only, measured (`calibrate.DeviceCost`): the wall time of one small train
  step, its batch split over 1, 2, 4, 8, ... devices (entry i: 2**i devices), relative to one
  device. Each virtual device runs its own copy of every op, and their collectives are copies
  on the same cores, so the fixed costs of a pass over a batch (op launches, dispatch,
  rendezvous) grow with its group by this factor; empty: 1 for every size."""
  step_cost: tuple[float, ...] = ()
  """As `device_cost` for a decode step: measured with the run's own rollout engine generating
  one batch (`calibrate.EngineCost`), or else a stand-in (one token for a few rows, forward
  only, almost nothing but the per-device copies of every op, so it grows faster with the
  group than an engine's decode loop, whose work the group shares)."""

  def parallel(self, devices: int) -> int:
    """How many devices' worth of rate a group of `devices` gets."""
    return 1 if self.host_shared else devices

  def per_device(self, devices: int, step: bool = False) -> float:
    """The factor a fixed per-device cost is multiplied by on a group of `devices` (`step`: of
    a decode step): 1 on real devices (each runs its own copy at the same time), `device_cost`
    (`step_cost`) on a shared host, interpolated in log2 of the size and proportional to the
    size beyond the last one measured."""
    measured = self.step_cost if step else self.device_cost
    if not (self.host_shared and measured) or devices <= 1:
      return 1.0
    x = math.log2(devices)
    last = len(measured) - 1
    if x >= last:
      return measured[last] * devices / 2**last
    i = int(x)
    return measured[i] + (measured[i + 1] - measured[i]) * (x - i)

  def flops(self, dtype: str) -> float:
    return self.float_flops if dtype == "float32" or not self.native_half else self.half_flops

  def link_bw(self, num_devices: int, devices_per_node: int | None = None) -> float:
    """Bandwidth of the slowest link inside a group of `num_devices` contiguous devices."""
    per_node = devices_per_node or self.devices_per_node
    return self.intra_node_bw if num_devices <= per_node else self.inter_node_bw

  def to_json(self) -> dict:
    return dataclasses.asdict(self)


# Figures from the vendors' public pages (dense figures; NVIDIA's headline "with sparsity"
# numbers are twice these):
# - H100 SXM: https://www.nvidia.com/en-us/data-center/h100/ -- BF16 989 TFLOPS, FP32 67 TFLOPS,
#   80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s (bidirectional), 8 per HGX node; inter-node
#   ConnectX-7 400 Gb/s per GPU (DGX H100 datasheet).
# - A100 80GB SXM: https://www.nvidia.com/en-us/data-center/a100/ -- BF16 312 TFLOPS, FP32
#   19.5 TFLOPS, 2,039 GB/s, NVLink 600 GB/s; 200 Gb/s HDR InfiniBand per GPU (DGX A100).
# - A800 80GB SXM: the A100 with NVLink cut to 400 GB/s (NVIDIA A800 product brief); OpenRLHF's
#   cluster used it. Inter-node as the A100.
# - H20: NVIDIA's HGX H20 product brief (no public nvidia.com page): BF16 148 TFLOPS, 96 GB HBM3
#   at 4.0 TB/s, NVLink 900 GB/s.
# - V100 32GB SXM2: https://www.nvidia.com/en-us/data-center/v100/ -- FP16 tensor 125 TFLOPS
#   (no bf16: DeepSpeed-Chat runs fp16), FP32 15.7 TFLOPS, 900 GB/s HBM2, NVLink 300 GB/s.
#   Node of 16 as a DGX-2 (16 V100-32GB on NVSwitch, https://www.nvidia.com/en-us/data-center/
#   dgx-2/), the machine DeepSpeed-Chat's 16-GPU log points to; 8 x 100 Gb/s InfiniBand per node.
# - TPU v4: https://cloud.google.com/tpu/docs/v4 -- 275 TFLOPS bf16, 32 GiB HBM at 1,200 GB/s,
#   ICI 6 links (2,400 Gbps/chip in the system-architecture table); 4 chips per host.
# - TPU v5e: https://cloud.google.com/tpu/docs/v5e -- 197 TFLOPS bf16, 16 GiB at 819 GB/s,
#   ICI 1,600 Gbps per chip; pods of 256.
# - TPU v5p: https://cloud.google.com/tpu/docs/v5p -- 459 TFLOPS bf16, 95 GiB at 2,765 GB/s,
#   ICI 4,800 Gbps per chip.
# - TPU v6e (Trillium): https://cloud.google.com/tpu/docs/v6e -- 918 TFLOPS bf16, 32 GiB at
#   1,640 GB/s, ICI 3,584 Gbps per chip; pods of 256.
# Host side (ZeRO-Offload): PCIe per device per direction, from the same pages -- A100/A800
# "PCIe Gen4: 64 GB/s" (both directions: 32 GB/s each way), H100 SXM PCIe Gen5 128 GB/s
# (64 each way), V100 SXM2 PCIe Gen3 32 GB/s (16 each way), H20 PCIe Gen5. CPU-Adam: the
# ZeRO-Offload paper (Ren et al., USENIX ATC 2021, https://arxiv.org/abs/2101.06840: its
# CPU-Adam latency comparison puts DeepSpeed's CPU-Adam at about 0.22 s per 1B parameters on a
# DGX-2's two-socket host; DeepSpeed's ZeRO-Offload tutorial: 5-7x PyTorch's CPU Adam):
# 4.5e9 parameters/s per host, taken for every GPU server (their hosts are of that class).
# TPU hosts keep the defaults (PCIe Gen3/4 class); nothing shipped offloads an optimizer there.
# TPU "nodes" here are ICI slices (the planner treats a whole slice as one fast domain); DCN
# between slices is taken as 25 GB/s per chip. FP32 on TPU is emulated with several bf16
# passes: taken as a sixth of the bf16 rate.
PRESETS: Mapping[str, Hardware] = {
  "h100": Hardware(
    name="h100",
    half_flops=989e12,
    float_flops=67e12,
    memory_gib=80 * GB / GIB,
    memory_bw=3.35 * TB,
    intra_node_bw=450 * GB,
    inter_node_bw=50 * GB,
    devices_per_node=8,
    host_bw=64 * GB,
  ),
  "a100_80gb": Hardware(
    name="a100_80gb",
    half_flops=312e12,
    float_flops=19.5e12,
    memory_gib=80 * GB / GIB,
    memory_bw=2.039 * TB,
    intra_node_bw=300 * GB,
    inter_node_bw=25 * GB,
    devices_per_node=8,
  ),
  "a800": Hardware(
    name="a800",
    half_flops=312e12,
    float_flops=19.5e12,
    memory_gib=80 * GB / GIB,
    memory_bw=2.039 * TB,
    intra_node_bw=200 * GB,
    inter_node_bw=25 * GB,
    devices_per_node=8,
  ),
  "h20": Hardware(
    name="h20",
    half_flops=148e12,
    float_flops=44e12,
    memory_gib=96 * GB / GIB,
    memory_bw=4.0 * TB,
    intra_node_bw=450 * GB,
    inter_node_bw=50 * GB,
    devices_per_node=8,
    host_bw=64 * GB,
  ),
  "v100_32gb": Hardware(
    name="v100_32gb",
    half_flops=125e12,
    float_flops=15.7e12,
    memory_gib=32 * GB / GIB,
    memory_bw=900 * GB,
    intra_node_bw=150 * GB,
    inter_node_bw=100 * GB / 16,
    devices_per_node=16,
    host_bw=16 * GB,
  ),
  "tpu_v4": Hardware(
    name="tpu_v4",
    half_flops=275e12,
    float_flops=275e12 / 6,
    memory_gib=32,
    memory_bw=1200 * GB,
    intra_node_bw=300 * GB / 2,
    inter_node_bw=25 * GB,
    devices_per_node=4096,
  ),
  "tpu_v5e": Hardware(
    name="tpu_v5e",
    half_flops=197e12,
    float_flops=197e12 / 6,
    memory_gib=16,
    memory_bw=819 * GB,
    intra_node_bw=200 * GB / 2,
    inter_node_bw=25 * GB,
    devices_per_node=256,
  ),
  "tpu_v5p": Hardware(
    name="tpu_v5p",
    half_flops=459e12,
    float_flops=459e12 / 6,
    memory_gib=95,
    memory_bw=2765 * GB,
    intra_node_bw=600 * GB / 2,
    inter_node_bw=25 * GB,
    devices_per_node=8960,
  ),
  "tpu_v6e": Hardware(
    name="tpu_v6e",
    half_flops=918e12,
    float_flops=918e12 / 6,
    memory_gib=32,
    memory_bw=1640 * GB,
    intra_node_bw=448 * GB / 2,
    inter_node_bw=25 * GB,
    devices_per_node=256,
  ),
}


def hardware_names() -> tuple[str, ...]:
  return (*PRESETS, "local")


def load_hardware(name: str, calibration: str | None = None) -> Hardware:
  """A preset by name, or `local` from the JSON `scripts/calibrate.py` wrote.

  Raises:
    ValueError: unknown name, or `local` without a readable calibration file.
  """
  if name == "local":
    if not calibration:
      raise ValueError("hardware 'local' needs the calibration file calibrate.py wrote")
    try:
      with open(calibration) as f:
        data = json.load(f)["hardware"]
    except (OSError, json.JSONDecodeError, KeyError) as e:
      raise ValueError(f"{calibration}: not a calibration file ({e})") from None
    data["pair_bw"] = tuple(tuple(row) for row in data.get("pair_bw", ()))
    data["device_cost"] = tuple(data.get("device_cost", ()))
    data["step_cost"] = tuple(data.get("step_cost", ()))
    return Hardware(**data)
  if name not in PRESETS:
    raise ValueError(f"unknown hardware {name!r}; known: {', '.join(hardware_names())}")
  return PRESETS[name]
