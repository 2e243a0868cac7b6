"""Exports the trained policy of a run as a Hugging Face checkpoint `transformers` loads.

  python scripts/export_hf.py --workdir=workdirs/pipeline --out=exports/pipeline
  python scripts/export_hf.py --workdir=workdirs/pipeline --stage=rm --out=exports/rm
  python scripts/export_hf.py --workdir=workdirs/sft --out=exports/sft --step=6 --dtype=bfloat16
  python scripts/export_hf.py --workdir=workdirs/grpo_lora --out=exports/adapter --adapter

`--workdir` is any run's workdir (SFT, reward model: a `*ForSequenceClassification` with one
label, PPO / GRPO / DAPO / RLOO / REINFORCE++ / DPO / online DPO: the actor) or a pipeline's
(its PPO stage unless `--stage`). Writes safetensors weights (sharded past --max_shard_size),
config.json, generation_config.json and the tokenizer files; a run with LoRA adapters exports
the adapted model merged, or with `--adapter` the adapters alone as a PEFT adapter directory
(`peft.PeftModel.from_pretrained` loads it onto the base; `--base` writes that base). Several
processes
(`--config.distributed.*`, as the training scripts) each write their own shards. Bad input:
one `error:` line, exit status 2.
"""

import dataclasses

import ml_collections
from absl import flags
from ml_collections import config_flags

from rlhfjax import launch
from rlhfjax.config import DistributedSection

_WORKDIR = flags.DEFINE_string("workdir", None, "The run's (or the pipeline's) workdir.")
_OUT = flags.DEFINE_string("out", None, "The Hugging Face checkpoint directory to write.")
_STEP = flags.DEFINE_integer("step", None, "The checkpoint's step; default: the latest.")
_STAGE = flags.DEFINE_enum("stage", None, ["sft", "rm", "ppo"], "A pipeline workdir's stage.")
_DTYPE = flags.DEFINE_enum(
  "dtype", None, ["float32", "bfloat16"], "Weights' dtype; default: the run's parameter dtype."
)
_MAX_SHARD_SIZE = flags.DEFINE_string(
  "max_shard_size", "5GB", "Largest safetensors file, e.g. 2GB, 500MB."
)
_OVERWRITE = flags.DEFINE_boolean("overwrite", False, "Write into a non-empty --out.")
_ADAPTER = flags.DEFINE_boolean(
  "adapter",
  False,
  "A run with LoRA adapters: write the adapters alone as a PEFT adapter directory "
  "(adapter_config.json, adapter_model.safetensors; float32 unless --dtype).",
)
_BASE = flags.DEFINE_boolean(
  "base",
  False,
  "A run with LoRA adapters: write the frozen base weights the adapters apply to.",
)
_CONFIG = config_flags.DEFINE_config_dict(
  "config",
  ml_collections.ConfigDict({"distributed": dataclasses.asdict(DistributedSection())}),
  "Only `--config.distributed.*`: the job's processes, as for the training scripts.",
)
flags.mark_flags_as_required(["workdir", "out"])


def main(argv: list[str]) -> None:
  launch.start(argv, _CONFIG.value, max_cpu_devices=1)

  if _ADAPTER.value and _BASE.value:
    launch.fail("--adapter and --base each write one part of the model: pass one of them")
  part = "adapter" if _ADAPTER.value else "base" if _BASE.value else "merged"

  from rlhfjax import export  # imports JAX: after `start`

  exported = export.export(
    _WORKDIR.value,
    _OUT.value,
    step=_STEP.value,
    stage=_STAGE.value,
    dtype=_DTYPE.value,
    max_shard_bytes=export.parse_size(_MAX_SHARD_SIZE.value),
    overwrite=_OVERWRITE.value,
    part=part,
  )
  what = {"adapter": "the LoRA adapters of ", "base": "the frozen base of "}.get(part, "")
  print(
    f"exported {what}{exported.describe()}: wrote {', '.join(exported.files) or 'no shard'} to "
    f"{_OUT.value}"
  )
  if part == "adapter":
    base = exported.base or "the run's random initialisation (write it with --base)"
    print(
      f"their base: {base}; peft.PeftModel.from_pretrained(base_model, {_OUT.value!r}) loads them"
    )


if __name__ == "__main__":
  launch.run(main)
