"""The flags of `localcheck.bench_config`'s run, defined once: `scripts/calibrate.py` fits the
cost model to the very run that `scripts/bench_ppo.py` times. No JAX here: scripts define their
flags before they set the device count."""

from __future__ import annotations

import dataclasses

from absl import flags


@dataclasses.dataclass(frozen=True)
class RunFlags:
  """The flag holders; `config_kwargs` is `bench_config`'s keywords past the variant."""

  iterations: flags.FlagHolder[int]
  devices: flags.FlagHolder[int]
  hidden: flags.FlagHolder[int]
  layers: flags.FlagHolder[int]
  mlp: flags.FlagHolder[int]
  batch: flags.FlagHolder[int]
  new_tokens: flags.FlagHolder[int]
  sync_repeats: flags.FlagHolder[int]

  def config_kwargs(self) -> dict[str, int]:
    return {
      f.name: getattr(self, f.name).value
      for f in dataclasses.fields(self)
      if f.name != "sync_repeats"
    }


def define_run_flags(*, iterations: int, iterations_help: str) -> RunFlags:
  """Defines `--iterations` (default `iterations`), `--devices`, the model and batch shape and
  `--sync_repeats`, with `bench_config`'s defaults (0 for a model field: the size's own)."""
  integer = flags.DEFINE_integer
  return RunFlags(
    iterations=integer("iterations", iterations, f"{iterations_help} (>= 2: the first compiles)."),
    devices=integer("devices", 8, "Devices (host devices emulated on CPU)."),
    hidden=integer("hidden", 128, "hidden_size (0: the size's own)."),
    layers=integer("layers", 4, "num_layers (0: the size's own)."),
    mlp=integer("mlp", 352, "intermediate_size (0: the size's own)."),
    batch=integer("batch", 32, "Sequences per rollout batch."),
    new_tokens=integer("new_tokens", 32, "Response tokens per sequence."),
    sync_repeats=integer(
      "sync_repeats",
      16,
      "When calibrating: syncs timed again after each iteration (Cluster.resync).",
    ),
  )
