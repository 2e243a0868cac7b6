"""A run's trained policy as a Hugging Face checkpoint directory (`scripts/export_hf.py`).

What a checkpoint exports is described in its own meta (`policy_meta`, written at every save):
the item holding the policy (reward model 'reward', SFT and every RL flow 'actor', never the
critic; 'policy' in SFT runs of older versions), its head, its `ModelConfig` and its tokenizer.
The output directory holds safetensors weights (one file, or shards and an index),
`config.json`, `generation_config.json` and tokenizer files that `transformers` loads as they
are.

In a job of several processes each process writes its own shard files: the layers are restored
in equal blocks, one per process (each reads only its block), and each layer file is written by
the process that holds its layers; process 0 writes the files outside the layers (embedding,
norm, head: every process reads those) and, once every shard exists, the index, config and
tokenizer. When the layer files do not split evenly over the processes (or all fits in one
file) every process reads all layers and the files are still written once each.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Mapping
from typing import Any

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rlhfjax import checkpoint as ckpt
from rlhfjax import distributed, models
from rlhfjax.config.hf import config_to_hf
from rlhfjax.config.model import HeadKind, LoraConfig, ModelConfig, RopeScaling
from rlhfjax.data import tokenizer as tokenizer_lib
from rlhfjax.data.byte_tokenizer import ByteTokenizer
from rlhfjax.models import hf, hf_read, lora
from rlhfjax.placement.spec import Layout
from rlhfjax.training import weights

STAGES = ("ppo", "rm", "sft")
"""A pipeline workdir's stage directories, in the order `--stage` defaults through them."""
_META_KEY = "policy"
_TOKENIZER_FILES = (
  "tokenizer.json",
  "tokenizer_config.json",
  "special_tokens_map.json",
  "chat_template.jinja",
)


class ExportError(ValueError):
  """A run cannot be exported as asked: no checkpoint, no such step, a non-empty output."""


# ---------------------------------------------------------------------------------------------
# What a checkpoint says about its policy.


def policy_meta(
  item: str,
  head: HeadKind,
  model: ModelConfig,
  tokenizer: str,
  chat_template: bool,
  base: str = "",
) -> dict[str, Any]:
  """The JSON a run saves with each checkpoint so that `export` can rebuild its policy; `base`
  names where its first weights came from (a Hugging Face directory or a run; '' when random),
  which an exported LoRA adapter names as its base model."""
  return {
    _META_KEY: {
      "item": item,
      "head": head,
      "model": dataclasses.asdict(model),
      "tokenizer": tokenizer,
      "chat_template": chat_template,
      "base": base,
    }
  }


def _model_from_json(fields: Mapping[str, Any]) -> ModelConfig:
  known = {f.name for f in dataclasses.fields(ModelConfig)}
  fields = {k: v for k, v in fields.items() if k in known}
  if fields.get("rope_scaling") is not None:
    fields["rope_scaling"] = RopeScaling(**fields["rope_scaling"])
  if fields.get("lora") is not None:
    fields["lora"] = LoraConfig(**{**fields["lora"], "targets": tuple(fields["lora"]["targets"])})
  fields["eos_token_ids"] = tuple(fields.get("eos_token_ids") or ())
  fields["quantized"] = tuple(fields.get("quantized") or ())
  return ModelConfig(**fields)


# ---------------------------------------------------------------------------------------------
# Finding the checkpoint.


def run_directory(workdir: str, stage: str | None = None) -> str:
  """The run to export: `workdir` itself, or a pipeline workdir's `stage` (default: the last
  stage that has checkpoints, PPO first)."""
  workdir = os.path.abspath(os.path.expanduser(workdir))
  if not os.path.isdir(workdir):
    raise ExportError(f"--workdir {workdir} does not exist")
  stages = [s for s in STAGES if os.path.isdir(os.path.join(workdir, s, "checkpoints"))]
  if stage is not None:
    if stage not in STAGES:
      raise ExportError(f"--stage must be one of {', '.join(STAGES)}, got {stage!r}")
    if stage not in stages:
      raise ExportError(f"--stage={stage}: {workdir} has no {stage}/checkpoints")
    return os.path.join(workdir, stage)
  if os.path.isdir(os.path.join(workdir, "checkpoints")) or not stages:
    return workdir
  return os.path.join(workdir, stages[0])


def step_directory(run: str, step: int | None = None) -> epath.Path:
  """The complete checkpoint of `step` (default: the latest) in `run`/checkpoints."""
  directory = os.path.join(run, "checkpoints")
  steps = ckpt.complete_steps(directory)
  if not steps:
    raise ExportError(f"no complete checkpoint in {directory}: nothing to export")
  if step is None:
    step = steps[-1]
  elif step not in steps:
    raise ExportError(
      f"--step={step}: no complete checkpoint of that step in {directory}; steps: "
      f"{', '.join(map(str, steps))}"
    )
  return epath.Path(directory) / str(step)


def read_policy_meta(step_dir: epath.Path) -> dict[str, Any]:
  meta = ckpt.read_meta(step_dir)
  if _META_KEY not in meta:
    raise ExportError(
      f"{step_dir} does not say which model it holds (checkpoints written before export "
      "existed); resume the run for one step to write a checkpoint that does"
    )
  return meta[_META_KEY]


# ---------------------------------------------------------------------------------------------
# Reading each process's share.


@dataclasses.dataclass(frozen=True)
class Assignment:
  """Which process writes which file, and whether the layers are read in per-process blocks."""

  writer: dict[str, int]
  layers_by_process: bool


def assign_files(shards: list[hf.ShardFile], num_layers: int, processes: int) -> Assignment:
  """Layer files to the process holding their block; files outside the layers to process 0.

  With `p` processes the layers are read in `p` equal blocks when every block is a whole
  number of layer files; else every process reads all layers and the layer files are dealt
  out in contiguous runs.
  """
  layer_files = [s for s in shards if s.layers and not s.top]
  by_process = processes > 1 and bool(layer_files) and len(layer_files) % processes == 0
  writer = {s.name: 0 for s in shards}
  block = num_layers // processes
  for j, shard in enumerate(layer_files):
    writer[shard.name] = (
      shard.layers.start // block if by_process else j * processes // len(layer_files)
    )
  return Assignment(writer, by_process)


def _export_mesh() -> Mesh:
  """Every device of the job as a (process, local device) mesh."""
  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  return Mesh(np.array(devices).reshape(jax.process_count(), -1), ("process", "local"))


def _on_export_mesh(shapes: Any, layers_by_process: bool) -> Any:
  """`shapes` (anything with a shape and dtype) on `_export_mesh`: the layers split over the
  processes when `layers_by_process`, everything else replicated."""
  mesh = _export_mesh()

  def abstract(path, m):
    in_layers = jax.tree_util.keystr(path[:1]) == "['layers']"
    spec = PartitionSpec("process") if in_layers and layers_by_process else PartitionSpec()
    return jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=NamedSharding(mesh, spec))

  return jax.tree_util.tree_map_with_path(
    abstract,
    shapes,
    is_leaf=lambda m: isinstance(m, ocp.metadata.ArrayMetadata | jax.ShapeDtypeStruct),
  )


def _abstract_params(item_dir: epath.Path, layers_by_process: bool) -> Any:
  """The saved parameters' shapes and dtypes on `_export_mesh` (see `_on_export_mesh`)."""
  saved = ocp.StandardCheckpointHandler().metadata(item_dir).tree
  return _on_export_mesh(saved, layers_by_process)


def _restore_policy(
  step_dir: epath.Path, policy: Mapping[str, Any], model: ModelConfig, layers_by_process: bool
) -> Any:
  """The policy's whole parameters on `_export_mesh`: as saved, or for a run with LoRA
  adapters (whose checkpoints hold the adapters alone) the adapters over their base, loaded
  again from the run's own source (`rlhfjax.training.weights.with_base`)."""
  item = policy["item"]
  adapters = weights.saved_adapters(step_dir, item)
  if adapters is None:
    item_dir = ckpt.item_directory(step_dir, item)
    return ckpt.restore_params(step_dir, _abstract_params(item_dir, layers_by_process), item)
  model = model.replace(
    lora=adapters.lora, quantized=adapters.quantized, quantization=adapters.quantization
  )
  head = policy["head"]
  abstract = _on_export_mesh(models.abstract_params(model, head), layers_by_process)
  trained = ckpt.restore_params(step_dir, lora.split(abstract)[0], item)
  shardings = jax.tree.map(lambda a: a.sharding, abstract)
  return weights.with_base(
    trained, adapters, model, head, _export_mesh(), Layout.TRAINING, shardings
  )


def _local(x: jax.Array) -> np.ndarray:
  return np.asarray(x.addressable_shards[0].data)


def _cast(x: np.ndarray, dtype: str) -> np.ndarray:
  target = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
  return x if x.dtype == target else x.astype(np.float32).astype(target)


# ---------------------------------------------------------------------------------------------
# Tokenizer files.


def byte_tokenizer_json(tokenizer: ByteTokenizer) -> str:
  """A `tokenizers` tokenizer.json that encodes any text to the byte tokenizer's ids: ids
  0..255 are the bytes (byte-level pre-tokenizer, no merges), then the special tokens, and
  BOS first when special tokens are added."""
  import tokenizers  # noqa: PLC0415 (only the byte tokenizer's export builds one)
  from tokenizers import decoders, models, pre_tokenizers, processors

  chars = pre_tokenizers.ByteLevel.alphabet()
  byte_char = {b: c for b, c in zip(range(256), _bytes_to_unicode(), strict=True)}
  assert set(byte_char.values()) == set(chars)
  vocab = {c: b for b, c in byte_char.items()}
  tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  tok.decoder = decoders.ByteLevel()
  specials = sorted(tokenizer.special_tokens.items(), key=lambda kv: kv[1])
  tok.add_special_tokens([name for name, _ in specials])
  for name, token_id in specials:
    assert tok.token_to_id(name) == token_id, (name, token_id)
  bos = next(name for name, i in specials if i == tokenizer.bos_id)
  tok.post_processor = processors.TemplateProcessing(
    single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, tokenizer.bos_id)]
  )
  return tok.to_str()


def _bytes_to_unicode() -> list[str]:
  """GPT-2's printable character for each byte 0..255 (the byte-level pre-tokenizer's)."""
  keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
  chars, extra = {}, 0
  for b in range(256):
    if b in keep:
      chars[b] = chr(b)
    else:
      chars[b] = chr(256 + extra)
      extra += 1
  return [chars[b] for b in range(256)]


_BYTE_CHAT_TEMPLATE = (
  "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}<|user|>\n"
  "{{ m['content'] }}\n{% elif m['role'] == 'assistant' %}<|assistant|>\n"
  "{{ m['content'] }}<|eos|>{% endif %}{% endfor %}"
  "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
"""`rlhfjax.data.tokenizer.ChatTemplate` with the byte tokenizer's markers, for one turn."""


def _write_byte_tokenizer(out: str, chat_template: bool, max_length: int) -> None:
  tokenizer = ByteTokenizer()
  with open(os.path.join(out, "tokenizer.json"), "w", encoding="utf-8") as f:
    f.write(byte_tokenizer_json(tokenizer))
  names = {i: name for name, i in tokenizer.special_tokens.items()}
  special = {
    "bos_token": names[tokenizer.bos_id],
    "eos_token": names[tokenizer.eos_id],
    "pad_token": names[tokenizer.pad_id],
    "additional_special_tokens": [names[tokenizer.user_id], names[tokenizer.assistant_id]],
  }
  config = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "model_max_length": max_length,
    "clean_up_tokenization_spaces": False,
    **special,
  }
  if chat_template:
    config["chat_template"] = _BYTE_CHAT_TEMPLATE
  _write_json(os.path.join(out, "tokenizer_config.json"), config)
  _write_json(os.path.join(out, "special_tokens_map.json"), special)


def _copy_tokenizer_files(spec: str, out: str) -> None:
  """The files of a Hugging Face tokenizer (`data.tokenizer`: a tokenizer.json or its
  directory), as the run read them."""
  path = os.path.expanduser(spec)
  directory = path if os.path.isdir(path) else os.path.dirname(path)
  if not os.path.exists(path):
    raise ExportError(f"the run's tokenizer {spec} no longer exists: nothing to copy")
  if not os.path.isdir(path):
    shutil.copyfile(path, os.path.join(out, "tokenizer.json"))
  for name in _TOKENIZER_FILES:
    source = os.path.join(directory, name)
    if os.path.isfile(source) and not os.path.exists(os.path.join(out, name)):
      shutil.copyfile(source, os.path.join(out, name))


def _write_json(path: str, value: Any) -> None:
  with open(path, "w", encoding="utf-8") as f:
    json.dump(value, f, indent=2)
    f.write("\n")


# ---------------------------------------------------------------------------------------------
# The export.


def _check_out(out: str, overwrite: bool) -> None:
  if os.path.exists(out) and not os.path.isdir(out):
    raise ExportError(f"--out {out} is a file, not a directory")
  if os.path.isdir(out) and os.listdir(out) and not overwrite:
    raise ExportError(f"--out {out} exists and is not empty; choose another or pass --overwrite")


def _clear_weights(out: str) -> None:
  """Creates `out`, without the weights of an earlier export it may hold (overwritten): a
  stale `model.safetensors` beside a new index would be what `transformers` loads."""
  os.makedirs(out, exist_ok=True)
  for name in os.listdir(out):
    if name.endswith(".safetensors") or name == "model.safetensors.index.json":
      os.remove(os.path.join(out, name))


def _with_token_ids(model: ModelConfig, tokenizer: tokenizer_lib.Tokenizer) -> ModelConfig:
  """The model's bos/eos/pad ids, from the tokenizer where the model does not say."""
  return dataclasses.replace(
    model,
    bos_token_id=tokenizer.bos_id if model.bos_token_id is None else model.bos_token_id,
    eos_token_ids=model.eos_token_ids or (tokenizer.eos_id,),
    pad_token_id=tokenizer.pad_id if model.pad_token_id is None else model.pad_token_id,
  )


@dataclasses.dataclass(frozen=True)
class Exported:
  """What `export` wrote: which run's model at which step, and this process's files."""

  run: str
  """The run's directory (a pipeline workdir's stage directory for a pipeline)."""
  stage: str | None
  """The pipeline stage ('sft', 'rm', 'ppo'); None for a run of its own."""
  step: int
  item: str
  """The checkpoint item, the trained role ('actor', 'reward')."""
  dtype: str
  files: list[str]
  """The shard files this process wrote."""
  base: str = ""
  """For LoRA adapters: where the run's base weights came from ('' for its random
  initialisation, which `part='base'` writes)."""

  def describe(self) -> str:
    stage = f" (stage {self.stage})" if self.stage else ""
    return f"the {self.item} of {self.run}{stage} at step {self.step} as {self.dtype}"


PARTS = ("merged", "adapter", "base")
"""What an export of a run with LoRA adapters writes: the adapted model with the adapters
merged into its weights, the adapters alone as a PEFT adapter directory, or the frozen base
they apply to (a run without adapters exports its model as 'merged')."""

_PEFT_MODULES = {
  "q": "q_proj",
  "k": "k_proj",
  "v": "v_proj",
  "o": "o_proj",
  "gate": "gate_proj",
  "up": "up_proj",
  "down": "down_proj",
  "lm_head": "lm_head",
}
"""Our adapter target names -> the Hugging Face module names PEFT targets."""
_ADAPTER_FILE = "adapter_model.safetensors"


def export(
  workdir: str,
  out: str,
  *,
  step: int | None = None,
  stage: str | None = None,
  dtype: str | None = None,
  max_shard_bytes: int = 5 * 2**30,
  overwrite: bool = False,
  part: str = "merged",
) -> Exported:
  """Writes the policy of a run's checkpoint to `out` as a Hugging Face checkpoint, or, for a
  run that trained LoRA adapters, its adapters as a PEFT adapter directory (`part`).

  Every process of the job calls it (see the module docstring for who writes what).

  Args:
    workdir: A run's workdir, or a pipeline's (then its `stage`, by default its PPO stage).
    out: The output directory: missing or empty unless `overwrite`.
    step: The checkpoint's step; None: the latest complete one.
    stage: 'sft', 'rm' or 'ppo' of a pipeline workdir.
    dtype: 'float32' or 'bfloat16'; None: the run's parameter dtype.
    max_shard_bytes: Largest safetensors file (a single tensor may exceed it).
    overwrite: Write into a non-empty `out` (files of the same names are replaced).
    part: 'merged' (the adapted model), 'adapter' (the LoRA adapters as `peft` loads them:
      `adapter_config.json`, `adapter_model.safetensors`) or 'base' (the frozen weights the
      adapters apply to, as a Hugging Face checkpoint); the last two need adapters.

  Returns:
    What it exported (run, stage, step, dtype) and the shard files this process wrote.

  Raises:
    ExportError, CheckpointError: no such run, checkpoint or step; `out` not empty; a model
      `config.json` cannot express.
  """
  if part not in PARTS:
    raise ExportError(f"part must be one of {', '.join(PARTS)}, got {part!r}")
  out = os.path.abspath(os.path.expanduser(out))
  _check_out(out, overwrite)
  # Every process has looked at `out` before process 0 creates or clears it.
  distributed.wait_for(range(jax.process_count()), "export: out checked")
  run = run_directory(workdir, stage)
  step_dir = step_directory(run, step)
  policy = read_policy_meta(step_dir)
  head: HeadKind = policy["head"]
  saved = _model_from_json(policy["model"])
  if part != "merged" and saved.lora is None:
    raise ExportError(
      f"--{part}: {run} trained no LoRA adapters (model.lora.rank=0): export it without --{part}"
    )
  if part == "adapter":
    return _export_adapter(run, workdir, step_dir, policy, saved, out, dtype or "float32")
  dtype = dtype or saved.param_dtype
  tokenizer = tokenizer_lib.load_tokenizer(policy["tokenizer"])
  model = dataclasses.replace(saved, param_dtype=dtype, dtype=dtype, lora=None, quantized=())
  model = _with_token_ids(model, tokenizer)
  hf_config = config_to_hf(model, head)  # fails here, before any file, if it cannot

  itemsize = np.dtype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype).itemsize
  shards = hf.plan_shards(model, head, itemsize, max_shard_bytes)
  assignment = assign_files(shards, model.num_layers, jax.process_count())
  params = _restore_policy(step_dir, policy, saved, assignment.layers_by_process)
  if saved.lora is not None:  # the adapted model (adapters merged into the weights), or its base
    # A quantized base (QLoRA) is written dequantized.
    params = (
      lora.dequantized(lora.base(params)) if part == "base" else lora.merged(params, saved.lora)
    )

  me = jax.process_index()
  first = me * (model.num_layers // jax.process_count()) if assignment.layers_by_process else 0
  host_top = {k: v for k, v in params.items() if k != "layers"}
  host_top = jax.tree.map(lambda x: _cast(_local(x), dtype), host_top)
  layers = jax.tree.map(lambda x: _cast(_local(x), dtype), params["layers"])
  del params
  if me == 0:
    _clear_weights(out)
  distributed.wait_for(range(jax.process_count()), "export: out ready")
  written = []
  for shard in shards:
    if assignment.writer[shard.name] == me:
      hf.write_shard(out, shard, hf.shard_tensors(model, shard, host_top, layers, first))
      written.append(shard.name)
  distributed.wait_for(range(jax.process_count()), "export: shards written")
  if me == 0:
    hf.write_index(out, model, shards)
    _write_json(os.path.join(out, "config.json"), hf_config)
    _write_json(os.path.join(out, "generation_config.json"), _generation_config(model))
    if policy["tokenizer"] == "byte":
      _write_byte_tokenizer(out, policy["chat_template"], model.max_position_embeddings)
    else:
      _copy_tokenizer_files(policy["tokenizer"], out)
  distributed.wait_for(range(jax.process_count()), "export: done")
  return _exported(run, workdir, step_dir, policy, dtype, written)


def _exported(run, workdir, step_dir, policy, dtype, written) -> Exported:
  own = run == os.path.abspath(os.path.expanduser(workdir))
  return Exported(
    run, None if own else os.path.basename(run), int(step_dir.name), policy["item"], dtype, written
  )


def _export_adapter(
  run: str,
  workdir: str,
  step_dir: epath.Path,
  policy: Mapping[str, Any],
  model: ModelConfig,
  out: str,
  dtype: str,
) -> Exported:
  """The adapters of the policy as a PEFT LoRA adapter directory, written by process 0.

  Ours are `W + (alpha / r) A B` with A `[in..., r]` and B `[r, out...]` in the kernel's layout;
  a Hugging Face weight is the kernel flattened to `[in, out]` and transposed, so PEFT's
  `lora_A.weight` `[r, in]` is A flattened and transposed and `lora_B.weight` `[out, r]` is B's,
  with the same scale (`lora_alpha / r`)."""
  if policy["head"] != "lm":
    raise ExportError(
      f"--adapter: {run} holds a value-head model, whose head trains whole beside its "
      "adapters: export it merged (without --adapter)"
    )
  abstract = _on_export_mesh(models.abstract_params(model, "lm"), False)
  found = lora.adapters(ckpt.restore_params(step_dir, lora.split(abstract)[0], policy["item"]))
  if jax.process_index() == 0:
    tensors = {}
    layers = found.get("layers", {})
    for module, path in hf.layer_projections(model).items():
      if not _has(layers, path):
        continue  # not a target
      proj = hf_read.get_at(layers, path)
      a, b = _local(proj["lora_a"]), _local(proj["lora_b"])
      for i in range(model.num_layers):
        tensors.update(_peft_pair(f"base_model.model.model.layers.{i}.{module}", a[i], b[i]))
    if "lm_head" in found:
      head = found["lm_head"]
      tensors.update(
        _peft_pair("base_model.model.lm_head", _local(head["lora_a"]), _local(head["lora_b"]))
      )
    tensors = {k: np.ascontiguousarray(_cast(v, dtype)) for k, v in tensors.items()}
    _clear_weights(out)
    hf.write_shard(out, hf.ShardFile(_ADAPTER_FILE, range(0), (), 0), tensors)
    lo = model.lora
    _write_json(
      os.path.join(out, "adapter_config.json"),
      {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": policy.get("base") or None,
        "r": lo.rank,
        "lora_alpha": lo.alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted(_PEFT_MODULES[t] for t in lo.targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
      },
    )
  distributed.wait_for(range(jax.process_count()), "export: done")
  files = [_ADAPTER_FILE] if jax.process_index() == 0 else []
  exported = _exported(run, workdir, step_dir, policy, dtype, files)
  return dataclasses.replace(exported, base=policy.get("base", ""))


def _has(tree: Mapping, path: tuple[str, ...]) -> bool:
  for key in path:
    if not isinstance(tree, Mapping) or key not in tree:
      return False
    tree = tree[key]
  return True


def _peft_pair(module: str, a: np.ndarray, b: np.ndarray) -> dict[str, np.ndarray]:
  """PEFT's `lora_A.weight` `[r, in]` and `lora_B.weight` `[out, r]` of our A `[in..., r]` and
  B `[r, out...]`."""
  r = a.shape[-1]
  return {
    f"{module}.lora_A.weight": a.reshape(-1, r).T,
    f"{module}.lora_B.weight": b.reshape(r, -1).T,
  }


def _generation_config(model: ModelConfig) -> dict[str, Any]:
  eos = list(model.eos_token_ids)
  return {
    "bos_token_id": model.bos_token_id,
    "eos_token_id": eos[0] if len(eos) == 1 else eos,
    "pad_token_id": model.pad_token_id,
  }


_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}


def parse_size(text: str) -> int:
  """Bytes of a size such as '2GB', '500MB', '64KiB' or '1000' (as `transformers` reads them)."""
  value = text.strip().upper()
  unit = next((u for u in _UNITS if value.endswith(u)), "B")
  number, factor = value.removesuffix(unit).strip(), _UNITS[unit]
  try:
    size = int(float(number) * factor)
  except ValueError:
    raise ExportError(f"--max_shard_size={text!r} is not a size such as 2GB or 500MB") from None
  if size <= 0:
    raise ExportError(f"--max_shard_size={text!r} must be positive")
  return size
