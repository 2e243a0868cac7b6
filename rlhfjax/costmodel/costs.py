"""Stage times from first principles: FLOPs, bytes and collectives over rates and efficiencies.

Every function returns seconds for one stage of one iteration on a role's device group. Counts:

- A forward costs `2 * N` FLOPs per token for `N` matmul parameters (every layer's projections
  and the LM head; the embedding lookup is free), plus attention `4 * L * h * n * c` for a
  context of `c` tokens (QK^T and PV). A train step costs three forwards (forward, two backward
  matmuls), four with full remat (the forward is recomputed), and is repeated per epoch.
- Generation = prefill (a forward over the prompts, FLOP-bound) + decode steps. One decode step
  reads the weights once and the KV cache of every slot, and computes `2 N` FLOPs per slot:
  it lasts max(bytes / bandwidth, FLOPs / rate, per-layer launch overhead: the host dispatches
  asynchronously, so an eager engine's launches overlap the device's work). Under static
  batching a wave of slots decodes for the longest response; with continuous batching the
  slots stay full and only the tail of the longest response runs alone. Tensor parallelism
  adds two all-reduces per layer per step.
- Conversations (`Conversation`: an environment answers each turn of the model): the
  observations are the environment's tokens, written into the KV cache by a forward over them
  (FLOP-bound, as prefill) instead of decoded; every turn's end returns a decode call to the
  host (the engine returns once a quarter of the slots ended a turn) and runs a program that
  writes the observations' KV, each a dispatch; the environments' steps run on the host while
  the device waits, `workers` of them at once at most (and at most as many as ended a turn in
  one decode call).
- FSDP gathers the weights in every forward and backward pass of every micro-step and
  reduce-scatters the gradients; data-parallel replicas all-reduce their gradient shard once per
  update; tensor parallelism all-reduces activations twice per layer per pass. A ring
  collective moves `(g - 1) / g` of the buffer over each device's link.
- The weight sync moves the actor's parameters into the generation layout: each rollout device
  receives its tensor shard over the slowest link between the two groups. On a shared host its
  fixed cost is per buffer the move makes (`rlhfjax.planner.sync`).
- ZeRO-Offload (`Offload.optimizer`, DeepSpeed's `offload_optimizer`): the moments and float32
  master weights live on the host. Every micro-step each device copies its gradient partition
  to the host over its own PCIe link (DeepSpeed accumulates the gradients there), every
  optimizer step the host's CPUs run Adam over the role's parameters (the node's CPU-Adam rate,
  shared by the roles that update at the same time on that node) and each device copies its
  updated partition back. With `Offload.params` (DeepSpeed's `offload_param`, ZeRO-3 only) the
  parameter shards also live on the host: every gather first copies the device's shard in.
"""

from __future__ import annotations

import dataclasses
import math

from rlhfjax.config.model import ModelConfig, param_count
from rlhfjax.costmodel.efficiency import Efficiency
from rlhfjax.costmodel.hardware import Hardware
from rlhfjax.costmodel.memory import adapter_bytes, stored_param_bytes

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Conversation:
  """Multi-turn rollouts: an environment answers each turn of the model (rlhfjax's
  `rollout.environment`); the default is one answer per prompt."""

  turns: float = 1.0
  """The model's turns per conversation, on average."""
  observation_tokens: float = 0.0
  """The environment's tokens per conversation, on average: part of the response's length
  (`rollout.max_new_tokens` limits both), written into the cache, never decoded."""
  environment_s: float = 0.0
  """Seconds one environment step takes on the host (a tool call, a sandbox)."""
  workers: int = 1
  """Environment steps run at once (`rollout.environment_workers`)."""

  def __post_init__(self):
    if self.turns < 1:
      raise ValueError(f"conversation turns must be >= 1, got {self.turns}")
    if self.observation_tokens < 0 or self.environment_s < 0 or self.workers < 1:
      raise ValueError(
        "conversation observation_tokens and environment_s must be >= 0 and workers >= 1, got "
        f"{self.observation_tokens}, {self.environment_s} and {self.workers}"
      )
    if self.turns == 1 and self.observation_tokens:
      raise ValueError("observations come between turns: observation_tokens needs turns > 1")


ONE_ANSWER = Conversation()


@dataclasses.dataclass(frozen=True, kw_only=True)
class Group:
  """A role's devices as the cost model sees them."""

  devices: int
  tensor: int = 1
  spans_nodes: bool = False
  tensor_spans_nodes: bool = False
  """Some tensor-parallel group has devices on different nodes: its all-reduces cross the
  network (`rlhfjax.placement.hosts`). A group spanning nodes with its tensor groups each
  inside one node keeps them on the node's links."""
  data: int = 1
  """Data-parallel replicas of a training layout (whole copies of the fsdp x tensor shards)."""
  context: int = 1
  """Devices each row's tokens are split over (context parallelism, within the fsdp devices)."""

  @property
  def replicas(self) -> int:
    """Independent batch shards (data x fsdp, or data groups of the generation layout)."""
    return self.devices // self.tensor

  @property
  def fsdp(self) -> int:
    """Devices one copy of the parameters is sharded over, per tensor rank."""
    return self.devices // self.tensor // self.data


@dataclasses.dataclass(frozen=True, kw_only=True)
class Offload:
  """What of a role lives in host memory while it computes (DeepSpeed's ZeRO-Offload)."""

  optimizer: bool = False
  """Moments and master weights on the host, updated there by the CPUs."""
  params: bool = False
  """Parameter shards on the host, copied in for every gather (FSDP layouts only)."""
  host_sharers: int = 1
  """Roles whose host-side updates run at the same time on this role's nodes (they split the
  host's CPU-Adam rate)."""


def matmul_params(config: ModelConfig, head: str) -> int:
  d, f, h, k, n = (
    config.hidden_size,
    config.intermediate_size,
    config.num_heads,
    config.num_kv_heads,
    config.head_dim,
  )
  per_layer = 2 * d * h * n + 2 * d * k * n + 3 * d * f
  out = d * config.vocab_size if head == "lm" else d
  return config.num_layers * per_layer + out


def matmul_bytes(config: ModelConfig, head: str) -> float:
  """Bytes of the matmul weights as stored: `param_dtype`, less what quantization saves on the
  projections in `config.quantized` (QLoRA's base; `memory.stored_param_bytes`), whose
  gathers and reads move the quantized kernels and their scales."""
  whole = matmul_params(config, head) * _BYTES[config.param_dtype]
  if not config.quantized:
    return whole
  saved = param_count(config, head) * _BYTES[config.param_dtype] - stored_param_bytes(config, head)
  return whole - saved


def _trained(config: ModelConfig, head: str) -> tuple[float, int]:
  """(parameters an update changes, bytes of each): all matmul weights in `param_dtype`, or
  the LoRA adapters alone, in float32."""
  if config.lora is None:
    return matmul_params(config, head), _BYTES[config.param_dtype]
  return adapter_bytes(config, head) / 4, 4


def forward_flops_per_token(config: ModelConfig, head: str, context: float) -> float:
  attn = 4 * config.num_layers * config.num_heads * config.head_dim * context
  return 2 * matmul_params(config, head) + attn


def _link(hw: Hardware, group: Group) -> float:
  return hw.inter_node_bw if group.spans_nodes else hw.intra_node_bw


def _ring(bytes_: float, size: int, bw: float) -> float:
  return 0.0 if size <= 1 else bytes_ * (size - 1) / size / bw


def _tensor_allreduce(hw, eff, config, group, tokens_per_replica, passes) -> float:
  """Two all-reduces of the `[tokens, d]` activations per layer per pass (ring: 2x data), on
  the node's links, or the network's when a tensor group spans nodes."""
  if group.tensor <= 1:
    return 0.0
  c = _BYTES[config.dtype]
  bytes_ = 2 * tokens_per_replica * config.hidden_size * c
  link = hw.inter_node_bw if group.tensor_spans_nodes else hw.intra_node_bw
  bw = link * eff.collective_bw
  return passes * 2 * config.num_layers * _ring(bytes_, group.tensor, bw)


def _context_gather(hw, eff, config, group, tokens, passes) -> float:
  """Context-parallel attention's all-gather of every layer's keys and values over the
  `context` devices (ring), once per pass (the backward's is a reduce-scatter of their
  gradients, the same bytes): a device receives its rows' keys and values, `2 k n` values per
  token over `tensor`."""
  if group.context <= 1:
    return 0.0
  rows_tokens = tokens / (group.devices / group.tensor / group.context)
  kv_tensor = group.tensor if config.num_kv_heads % group.tensor == 0 else 1
  bytes_ = rows_tokens * 2 * config.num_kv_heads * config.head_dim * _BYTES[config.dtype]
  bw = _link(hw, group) * eff.collective_bw
  return passes * config.num_layers * _ring(bytes_ / kv_tensor, group.context, bw)


def forward_time(
  hw: Hardware,
  eff: Efficiency,
  config: ModelConfig,
  head: str,
  group: Group,
  *,
  sequences: int,
  seq_len: int,
  micro_steps: int,
  offload: Offload = Offload(),
) -> float:
  """A scoring forward over `sequences` padded sequences of `seq_len` tokens."""
  tokens = sequences * seq_len
  flops = tokens * forward_flops_per_token(config, head, seq_len / 2)
  compute = flops / (hw.parallel(group.devices) * hw.flops(config.dtype) * eff.forward_mfu)
  fsdp = group.fsdp
  param_bytes = matmul_bytes(config, head) / group.tensor
  gather = micro_steps * _ring(param_bytes, fsdp, _link(hw, group) * eff.collective_bw)
  if offload.params and fsdp > 1:  # each gather first copies the device's shard from the host
    gather += micro_steps * param_bytes / fsdp / (hw.host_bw * eff.host_bw)
  tp = _tensor_allreduce(hw, eff, config, group, tokens / group.replicas, 1)
  tp += _context_gather(hw, eff, config, group, tokens, 1)
  overhead = eff.stage_s + micro_steps * config.num_layers * eff.layer_s
  return compute + gather + tp + overhead * hw.per_device(group.devices)


def train_time(
  hw: Hardware,
  eff: Efficiency,
  config: ModelConfig,
  head: str,
  group: Group,
  *,
  sequences: int,
  seq_len: int,
  epochs: int,
  optimizer_steps: int,
  micro_steps: int,
  remat: str,
  optimizer_dtype: str | None = None,
  offload: Offload = Offload(),
  devices_per_node: int | None = None,
  extra_forwards: int = 0,
) -> float:
  """`epochs` passes over `sequences` sequences in `optimizer_steps` updates per epoch.

  With LoRA (`config.lora`) the base is frozen: the backward computes the activations'
  gradients but no weight gradients of the base (one forward's matmuls less), and only the
  adapters' gradients are reduced and updated. `extra_forwards`: whole forwards run again on
  top of the remat policy's (a pipeline stage's recomputed forward), each with its gathers."""
  tokens = sequences * seq_len * epochs
  passes = (4 if remat == "full" else 3) + extra_forwards
  flops = passes * tokens * forward_flops_per_token(config, head, seq_len / 2)
  if config.lora is not None:  # no weight-gradient matmuls of the frozen base
    flops -= tokens * 2 * matmul_params(config, head)
  compute = flops / (hw.parallel(group.devices) * hw.flops(config.dtype) * eff.train_mfu)
  fsdp = group.fsdp
  param_bytes = matmul_bytes(config, head) / group.tensor
  trained, tb = _trained(config, head)
  grad_bytes = trained * tb / group.tensor
  bw = _link(hw, group) * eff.collective_bw
  # Two gathers (forward, backward; three with full remat) and one reduce-scatter of the
  # gradients per micro-step.
  gathers = (3 if remat == "full" else 2) + extra_forwards
  collectives = (
    epochs * micro_steps * (gathers * _ring(param_bytes, fsdp, bw) + _ring(grad_bytes, fsdp, bw))
  )
  # Data-parallel replicas all-reduce their gradient shard once per update (ring: 2x data).
  shard_bytes = grad_bytes / fsdp
  collectives += epochs * optimizer_steps * 2 * _ring(shard_bytes, group.data, bw)
  tp = _tensor_allreduce(hw, eff, config, group, tokens / group.replicas, passes)
  tp += _context_gather(hw, eff, config, group, tokens, passes)
  if offload.optimizer:
    steps = epochs * optimizer_steps
    updates = _host_update(
      hw,
      eff,
      config,
      head,
      group,
      steps=steps,
      micro_steps=epochs * micro_steps,
      sharers=offload.host_sharers,
      devices_per_node=devices_per_node or hw.devices_per_node,
    )
    if offload.params and fsdp > 1:  # every gather copies the device's shard in first
      shard = param_bytes / fsdp
      updates += epochs * micro_steps * gathers * shard / (hw.host_bw * eff.host_bw)
  else:
    ob = 4 if config.lora is not None else _BYTES[optimizer_dtype or config.param_dtype]
    # The update reads parameters, moments and gradients and writes parameters and moments.
    state = trained / hw.parallel(group.devices) * (2 * tb + 4 * ob + 4 + tb)
    updates = epochs * optimizer_steps * state / (hw.memory_bw * eff.optimizer_bw)
  overhead = (eff.stage_s + eff.update_s) * epochs * optimizer_steps + (
    epochs * micro_steps * passes * config.num_layers * eff.layer_s
  )
  return compute + collectives + tp + updates + overhead * hw.per_device(group.devices)


def _host_update(hw, eff, config, head, group, *, steps, micro_steps, sharers, devices_per_node):
  """ZeRO-Offload's host side of `steps` optimizer steps over `micro_steps` micro-steps:
  gradient partitions through PCIe, CPU-Adam over the role's parameters (the node's rate split
  among `sharers` roles), the updated partitions back."""
  params = matmul_params(config, head)
  partition = params * _BYTES[config.param_dtype] / group.devices  # each device's share
  link = hw.host_bw * eff.host_bw
  # Per optimizer step: with gradient accumulation every micro-step brings the accumulated
  # partition in and sends the sum back (DeepSpeed 0.13 stage_1_and_2.py,
  # async_accumulate_grad_in_cpu_via_gpu); at the boundary the partition goes out to the
  # float32 buffer, and after CPU-Adam the updated 16-bit partition comes back.
  accumulation = micro_steps / steps
  per_step = (2 * accumulation if accumulation > 1 else 0) + 2
  copies = steps * per_step * partition / link
  # A node's host updates the partitions of the role's devices on that node.
  on_node = params * min(group.devices, devices_per_node) / group.devices
  adam = steps * on_node * sharers / hw.host_adam_rate
  return copies + adam


def generate_time(
  hw: Hardware,
  eff: Efficiency,
  config: ModelConfig,
  group: Group,
  *,
  sequences: int,
  prompt_len: float,
  response_mean: float,
  response_max: int,
  slots: int,
  static_batching: bool,
  gather_devices: int = 1,
  conversation: Conversation = ONE_ANSWER,
) -> tuple[float, float]:
  """(prefill, decode) seconds for `sequences` rollouts on `group`, `slots` per data group;
  with a `conversation`, prefill includes the observations' forward and decode the turns'
  round trips and the environments' steps. `response_mean` and `response_max` count the
  observations."""
  replicas = group.replicas
  if hw.host_shared:  # the data groups take turns on the host's cores: one batch of all slots
    slots, replicas = slots * replicas, 1
  per_replica = math.ceil(sequences / replicas)
  slots = max(1, min(slots, per_replica))
  rate = hw.parallel(group.tensor) * hw.flops(config.dtype) * eff.forward_mfu
  prefill_flops = per_replica * prompt_len * forward_flops_per_token(config, "lm", prompt_len / 2)
  prefill = prefill_flops / rate
  prefill += _tensor_allreduce(hw, eff, config, group, per_replica * prompt_len, 1)
  host, decoded_mean, decoded_max = 0.0, response_mean, response_max
  if conversation.turns > 1:
    observed = per_replica * conversation.observation_tokens
    mid = prompt_len + response_mean / 2
    prefill += observed * forward_flops_per_token(config, "lm", mid) / rate
    prefill += _tensor_allreduce(hw, eff, config, group, observed, 1)
    ended = per_replica * (conversation.turns - 1)  # turns that an observation continues
    returns = math.ceil(ended / max(1, slots // 4))
    host = 2 * returns * eff.stage_s * hw.per_device(group.devices)
    # Every turn is stepped, the last one too; one driver steps every replica's.
    at_once = min(conversation.workers, max(1, slots * replicas // 4))
    host += sequences * conversation.turns * conversation.environment_s / at_once
    decoded_mean -= conversation.observation_tokens
    decoded_max = max(response_max - conversation.observation_tokens, decoded_mean)
  waves = math.ceil(per_replica / slots)
  if static_batching:
    steps = waves * decoded_max
  else:
    steps = math.ceil(per_replica * decoded_mean / slots) + (decoded_max - decoded_mean)
  context = prompt_len + (response_max if static_batching else response_mean) / 2
  live = slots
  if static_batching and eff.frees_finished:
    # The wave lasts as long as its longest answer, but a finished answer leaves the batch:
    # on average `slots * mean / max` slots are live, at the mean answer's context.
    live, context = slots * decoded_mean / decoded_max, prompt_len + response_mean / 2
  step = decode_step_time(hw, eff, config, group, batch=live, context=context)
  if gather_devices > 1:  # weights partitioned over the group: gathered again every step
    weights = matmul_params(config, "lm") * _BYTES[config.param_dtype]
    step += _ring(weights, gather_devices, _link(hw, group) * eff.collective_bw)
  return prefill + eff.stage_s * hw.per_device(group.devices), steps * step + host


def decode_step_time(
  hw: Hardware, eff: Efficiency, config: ModelConfig, group: Group, *, batch: int, context: float
) -> float:
  """One token for `batch` slots of one data group at mean context `context`."""
  c = _BYTES[config.dtype]
  weights = matmul_params(config, "lm") * _BYTES[config.param_dtype]
  kv = batch * context * 2 * config.num_layers * config.num_kv_heads * config.head_dim * c
  memory = (weights + kv) / (hw.parallel(group.tensor) * hw.memory_bw * eff.decode_bw)
  flops = batch * forward_flops_per_token(config, "lm", context)
  compute = flops / (hw.parallel(group.tensor) * hw.flops(config.dtype) * eff.decode_mfu)
  tp = _tensor_allreduce(hw, eff, config, group, batch, 1)
  if hw.host_shared:  # launches use the cores the maths use: one fixed cost per step, per device
    return max(memory, compute) + tp + eff.decode_step_s * hw.per_device(group.devices, step=True)
  # The host issues each layer's kernels while the device runs earlier ones (asynchronous
  # dispatch): a step lasts as long as the slower of the two, not their sum.
  launch = config.num_layers * eff.layer_s
  return max(memory, compute, launch) + tp + eff.decode_step_s


def sync_time(
  hw: Hardware,
  eff: Efficiency,
  config: ModelConfig,
  *,
  rollout_tensor: int,
  colocated: bool,
  spans_nodes: bool,
  pair_bw: float | None = None,
  devices: int = 0,
  buffers: int = 0,
  adapters_only: bool = False,
) -> float:
  """Moving the actor's weights into the rollout's layout (each device gets its shard);
  with `adapters_only` (an actor with LoRA adapters, `config.lora`, and a rollout on devices of
  its own) only the float32 adapters move, and the rollout merges them into its base copy (a
  pass over its weights: read the base, write the merged);
  `devices`: the devices of the actor and the rollout together (each reads or writes pieces
  of every array: `transfer_s` per device).

  On a shared host (`host_shared`) `transfer_s` is charged per buffer instead: `buffers`, the
  arrays' shards on the devices involved plus the pieces cut and copied
  (`rlhfjax.planner.sync.buffers`). There every buffer is allocated, dispatched and waited for
  on the same cores, and the count, not the devices or the bytes a device receives, is what
  the placements' syncs differ in (see `rlhfjax.planner.sync`)."""
  weights = matmul_params(config, "lm") * _BYTES[config.param_dtype] / rollout_tensor
  received, merge = weights, 0.0
  if adapters_only:
    received = adapter_bytes(config) / rollout_tensor
    merge = 2 * weights / (hw.memory_bw * eff.optimizer_bw)  # an elementwise pass, as Adam's
  if pair_bw:
    bw = pair_bw
  elif colocated:
    bw = hw.intra_node_bw
  else:
    bw = hw.inter_node_bw if spans_nodes else hw.intra_node_bw
  pieces = (buffers if hw.host_shared else devices) * eff.transfer_s
  return received / (bw * eff.transfer_bw) + merge + eff.stage_s + pieces
