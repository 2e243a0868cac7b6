"""Human-readable rendering of a placement: one row per role and a summary line."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from rlhfjax.config import ExperimentConfig
from rlhfjax.costmodel.memory import adapter_bytes
from rlhfjax.placement.memory import (
  GIB,
  MemoryEstimate,
  OptionEffect,
  Pipelining,
  adapters_synced,
  device_totals,
  option_effects,
  option_peaks,
)
from rlhfjax.placement.spec import PlacementSpec, Role, RoleSpec, ordered

_HEADER = (
  "role",
  "devices",
  "mesh",
  "layout",
  "total",
  "params",
  "optimizer",
  "grads",
  "gathered",
  "activations",
  "logits",
  "kv cache",
  "transfer",
)
_NUMERIC_FROM = _HEADER.index("total")
_KINDS = tuple(name.replace(" ", "_") for name in _HEADER[_NUMERIC_FROM:])
_UNITS = (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10))


def format_devices(devices: Iterable[int]) -> str:
  """Compact device list: runs of three or more become ranges, e.g. '0-3' or '0,1,4-7'."""
  runs: list[list[int]] = []
  for d in devices:
    if runs and d == runs[-1][-1] + 1:
      runs[-1].append(d)
    else:
      runs.append([d])
  return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 2 else ",".join(map(str, r)) for r in runs)


def format_mesh(spec: RoleSpec) -> str:
  """Mesh axes with their sizes, e.g. 'data=1 fsdp=8 tensor=1'."""
  return " ".join(f"{name}={size}" for name, size in spec.axes)


def format_placement_table(
  spec: PlacementSpec,
  estimates: Mapping[Role, MemoryEstimate],
  *,
  memory_per_device_gb: float | None = None,
) -> str:
  """A title, a table of where each role runs and its memory per device, a summary line.

  Args:
    spec: the placement.
    estimates: per-device memory of each role (`estimate_placement_memory`).
    memory_per_device_gb: the budget of one device in GiB, shown in the summary if given.

  Returns:
    The table, lines joined by newlines, without a trailing newline.
  """
  totals = device_totals(spec, estimates)
  unit, scale = _unit(max(totals.values()))
  rows = [_HEADER]
  for role in ordered(spec.roles):
    role_spec, estimate = spec[role], estimates[role]
    rows.append(
      (
        str(role),
        format_devices(role_spec.devices),
        format_mesh(role_spec),
        role_spec.layout.value,
        *(_amount(getattr(estimate, kind), scale) for kind in _KINDS),
      )
    )
  title = f"{spec.strategy} placement on {len(spec.devices)} devices, est. memory/device in {unit}"
  lines = [title, *_align(rows)]
  lines.append(_summary(spec, totals, unit, scale, memory_per_device_gb))
  return "\n".join(lines)


_OPTION_HEADER = (
  "role",
  "remat",
  "chunk",
  "offload",
  "plain",
  "remat saves",
  "chunk saves",
  "with options",
  "idle",
  "idle offloaded",
)


def format_option_table(
  effects: Mapping[Role, OptionEffect],
  settings: Mapping[Role, tuple[str, str, str]],
  peaks: Mapping[str, int],
) -> str:
  """What remat, log-prob chunks and offload do to each role's memory per device: a title, one
  row per role (its settings; its bytes during its stage without them, what each saves alone,
  with both; what it keeps on its devices while idle, without and with offload) and the peak
  device's need without and with all of them.

  Args:
    effects: `rlhfjax.placement.memory.option_effects`.
    settings: per role, its (remat policy, log-prob chunk, offloaded parts) as shown.
    peaks: `rlhfjax.placement.memory.option_peaks`.
  """
  unit, scale = _unit(max(max(e.plain, e.configured) for e in effects.values()))
  rows = [_OPTION_HEADER]
  for role in ordered(effects):  # the roles the flow places
    e = effects[role]
    rows.append(
      (
        str(role),
        *settings[role],
        _amount(e.plain, scale),
        _amount(-e.remat, scale),
        _amount(-e.chunk, scale),
        _amount(e.configured, scale),
        _amount(e.idle, scale),
        _amount(e.idle_offloaded, scale),
      )
    )
  title = f"memory options per role, est. memory/device in {unit} (planner's memory model)"
  saved = peaks["plain"] - peaks["configured"]
  summary = (
    f"options: peak device {peaks['plain'] / scale:.2f} {unit} without remat, chunks and "
    f"offload -> {peaks['configured'] / scale:.2f} {unit} with them ({saved / scale:.2f} {unit} "
    "saved)"
  )
  return "\n".join([title, *_align(rows, numeric_from=_OPTION_HEADER.index("plain")), summary])


def option_report(
  config: ExperimentConfig,
  spec: PlacementSpec,
  train_rows: int,
  score_rows: int | None = None,
  pipelining: Pipelining | None = None,
) -> str:
  """`format_option_table` of `config`'s per-role models and offload on placement `spec`, its
  micro-batches of `train_rows` and `score_rows` rows, pipelined as `pipelining` says (see
  `estimate_memory`)."""
  off = config.offload
  effects = option_effects(
    spec,
    config.model,
    config.rollout,
    train_rows=train_rows,
    score_rows=score_rows,
    offload=off,
    pipelining=pipelining,
  )
  settings = {}
  for role in effects:
    model = config.model.for_role(role)
    parked = [
      k for k, names in (("params", off.params), ("optimizer", off.optimizer)) if role in names
    ]
    settings[role] = (model.remat, str(model.logprob_chunk_size or "-"), "+".join(parked) or "-")
  return format_option_table(effects, settings, option_peaks(spec, effects))


def format_batches(
  config: ExperimentConfig, train_rows: int, score_rows: int | None, *, packed: bool
) -> str:
  """The micro-batches the memory estimates are sized for, in tokens: a packed run's token
  budgets (`ppo.max_tokens_per_micro_batch`, `rollout.max_tokens_per_score_batch`; rows of
  `max_seq_len` tokens, whatever the sequences in them) or a padded run's sequences."""
  width = config.rollout.max_seq_len
  score = score_rows or config.rollout.batch_size
  if not packed:
    return (
      f"micro-batches: padded, {train_rows} x {width} = {train_rows * width} tokens per training "
      f"micro-step, {score} x {width} = {score * width} per scoring call"
    )
  sources = (
    ("ppo.max_tokens_per_micro_batch", config.ppo.max_tokens_per_micro_batch),
    ("rollout.max_tokens_per_score_batch", config.rollout.max_tokens_per_score_batch),
  )
  named = [
    f"{name}={value}" if value else f"{name}=0, the padded micro-batch's" for name, value in sources
  ]
  return (
    f"micro-batches: packed, token budget {train_rows} x {width} = {train_rows * width} tokens "
    f"per training micro-step ({named[0]}), {score} x {width} = {score * width} per scoring "
    f"call ({named[1]})"
  )


def format_adapters(
  config: ExperimentConfig, spec: PlacementSpec, *, reference_from_base: bool = False
) -> str | None:
  """The LoRA line: which placed roles train adapters over frozen weights (`model.lora`), and
  whether the reference runs the actor's base (`reference_from_base`), or None without
  adapters."""
  ranks = {str(role): config.model.lora_rank(role) for role in spec.roles}
  adapted = {role: rank for role, rank in ranks.items() if rank}
  if not adapted:
    return None
  lora = config.model.lora
  targets = ", ".join(lora.targets)
  if len(set(adapted.values())) == 1:
    (rank,) = set(adapted.values())
    which = f"rank {rank}, alpha {lora.alpha:g} on {targets} of {', '.join(adapted)}"
  else:
    each = ", ".join(f"{role} (rank {rank})" for role, rank in adapted.items())
    which = f"alpha {lora.alpha:g} on {targets} of {each}"
  line = (
    f"adapters: LoRA {which}: their weights frozen (no gradients or optimizer moments), the "
    "adapters float32; the rollout runs the adapted weights merged"
  )
  if Role.ACTOR in spec.roles and Role.ROLLOUT in spec.roles:
    actor = config.model.for_role(Role.ACTOR)
    if adapters_synced(actor, spec[Role.ACTOR], spec[Role.ROLLOUT]) is not None:
      mib = adapter_bytes(actor) / 2**20
      line += f", each weight sync moving the adapters alone ({mib:.3g} MiB) into its own base copy"
  if reference_from_base:
    line += (
      "; the reference is the actor's base weights with the adapters off, on the actor's "
      "devices (no copy placed)"
    )
  return line


def _align(rows: Sequence[Sequence[str]], numeric_from: int = _NUMERIC_FROM) -> list[str]:
  widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
  lines = []
  for row in rows:
    cells = [
      cell.rjust(width) if i >= numeric_from else cell.ljust(width)
      for i, (cell, width) in enumerate(zip(row, widths, strict=True))
    ]
    lines.append("  ".join(cells).rstrip())
  return lines


def _summary(
  spec: PlacementSpec,
  totals: Mapping[int, int],
  unit: str,
  scale: int,
  memory_per_device_gb: float | None,
) -> str:
  peak_device = max(totals, key=lambda d: (totals[d], -d))
  peak_roles = "+".join(str(role) for role, s in spec.roles.items() if peak_device in s.devices)
  budget = f" of a {memory_per_device_gb:g} GiB budget" if memory_per_device_gb is not None else ""
  disjoint = ", ".join(f"{a}|{b}" for a, b in spec.disjoint) or "none"
  return (
    f"summary: {spec.strategy} on {len(spec.devices)} devices; peak "
    f"{totals[peak_device] / scale:.2f} {unit}{budget} on device {peak_device} ({peak_roles}); "
    f"disjoint pairs: {disjoint}"
  )


def _amount(num_bytes: int, scale: int) -> str:
  return f"{num_bytes / scale:.2f}" if num_bytes else "-"


def _unit(num_bytes: int) -> tuple[str, int]:
  """The largest unit in which `num_bytes` is at least 1 (KiB at the smallest)."""
  for unit, scale in _UNITS:
    if num_bytes >= scale:
      return unit, scale
  return _UNITS[-1]
