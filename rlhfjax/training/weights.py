"""A role's first weights: random, from another rlhfjax run's checkpoint, or from Hugging Face.

The source is a string, as configs hold it: empty for a random initialisation, a directory with
a `config.json` for a Hugging Face checkpoint, anything else for an rlhfjax checkpoint (a run's
`WORKDIR/checkpoints`, whose latest complete step is read, or one step directory). Weights are
read straight into the role's shards.

A checkpoint may hold another head than the role needs: an SFT policy (language-model head)
starts a critic or a reward model. Its trunk is carried over and the value head starts at zero,
so the first values are 0 and the trunk's features are what the head learns from. The other
way (a policy from a value-head model) has no language-model head to take and is an error.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rlhfjax import checkpoint as ckpt
from rlhfjax import models, programs
from rlhfjax.config import model as model_config
from rlhfjax.config.hf import read_hf_config
from rlhfjax.config.model import HeadKind, ModelConfig
from rlhfjax.mesh import rules
from rlhfjax.models import lora

# Which head a saved item carries, by the item names the trainers use.
ITEM_HEADS: dict[str, HeadKind] = {
  "policy": "lm",  # SFT runs of older versions
  "actor": "lm",  # SFT, PPO
  "reward": "value",  # reward-model training
  "critic": "value",  # PPO
}


class WeightsError(ValueError):
  """Weights cannot start a role: wrong model, wrong head or no such item."""


def items_for(head: HeadKind) -> tuple[str, ...]:
  """The items of an rlhfjax checkpoint a model with `head` starts from, in order of
  preference: a policy's for a language model; a value model's own first for a value head."""
  return ("policy", "actor") if head == "lm" else ("reward", "critic", "policy", "actor")


def is_hf_checkpoint(source: str) -> bool:
  return os.path.isfile(os.path.join(source, "config.json"))


def param_shardings(model: ModelConfig, head: HeadKind, mesh, layout) -> Any:
  """Parameter shardings of a `head` model on `mesh` with the rules of `layout`."""
  return rules.named_shardings(
    models.logical_axes(model, head), models.abstract_params(model, head), mesh, layout
  )


def abstract_with_shardings(tree: Any, shardings: Any) -> Any:
  """`jax.ShapeDtypeStruct` leaves carrying the target shardings: what a restore fills."""
  return jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
  )


def load_params(
  source: str,
  *,
  model: ModelConfig,
  head: HeadKind,
  mesh,
  layout,
  shardings: Any,
  rng: jax.Array,
  items: Sequence[str],
  what: str,
) -> Any:
  """The first parameters of a role, in `shardings` (the role's parameter shardings).

  Args:
    source: '' (random from `rng`), a Hugging Face checkpoint directory or an rlhfjax
      checkpoint (a run's checkpoints directory or one step directory).
    model, head, mesh, layout, shardings: the role's model and where its parameters live.
    rng: key of the random initialisation.
    items: saved items to look for in an rlhfjax checkpoint, in order of preference.
    what: the config field naming `source`, for error messages.
  """
  if not source:
    return models.init_params(model, head, rng, shardings=shardings)
  again = functools.partial(
    load_params, source, head=head, mesh=mesh, layout=layout, rng=rng, items=items, what=what
  )
  if model.lora is None and model.quantized:
    # QLoRA's base: the source's float weights, then its adapted kernels quantized.
    float_base = again(model=model.replace(quantized=()), shardings=lora.without_scales(shardings))
    like = models.abstract_params(model, head)
    return programs.jit(
      lambda params: lora.quantize_base(params, like), "quantize_base", out_shardings=shardings
    )(float_base)
  if model.lora is not None:
    # The source holds a base model: its weights, then fresh adapters over them.
    base = again(model=model.replace(lora=None), shardings=lora.base(shardings))
    return lora.attach(base, models.init_adapters(model, head, rng, shardings=shardings))
  if is_hf_checkpoint(source):
    return _from_hf(source, model, head, mesh, layout, shardings, what)
  return _from_checkpoint(source, model, head, mesh, layout, shardings, items, what)


def _from_hf(source, model, head, mesh, layout, shardings, what) -> Any:
  found, found_head = read_hf_config(source, dtype=model.param_dtype)
  # The config is what later stages build (and export): weights of another architecture
  # would run silently wrong, so every architecture field must agree, not only the shapes.
  try:
    model_config.check_same_architecture(
      found, model, f"{what}: {os.path.join(source, 'config.json')}"
    )
  except model_config.ArchitectureMismatch as e:
    raise WeightsError(str(e)) from None
  _check_heads(found_head, head, f"{what} {source!r}")
  _, params = models.load_hf_checkpoint(
    source,
    model.param_dtype,
    shardings=param_shardings(model, found_head, mesh, layout),
  )
  return _with_head(params, found_head, head, shardings)


def _from_checkpoint(source, model, head, mesh, layout, shardings, items, what) -> Any:
  step_dir = ckpt.find_step_dir(source)
  saved = ckpt.saved_items(step_dir)
  item = next((name for name in items if name in saved), None)
  if item is None:
    raise WeightsError(
      f"{what}: {step_dir} holds none of the items {', '.join(items)} (found: "
      f"{', '.join(sorted(saved)) or 'none'})"
    )
  found_head = ITEM_HEADS[item]
  _check_heads(found_head, head, f"{what} {str(step_dir)!r} (item {item!r})")
  # A run that trained LoRA adapters saved them alone, its base being its own source: the model
  # it trained is the two merged, which is what a later run starts from (an SFT's adapted
  # policy as PPO's).
  adapters = saved_adapters(step_dir, item)
  saved = model.replace(lora=None, quantized=())
  if adapters is not None:
    saved = saved.replace(
      lora=adapters.lora, quantized=adapters.quantized, quantization=adapters.quantization
    )
  saved_shardings = param_shardings(saved, found_head, mesh, layout)
  abstract = abstract_with_shardings(models.abstract_params(saved, found_head), saved_shardings)
  if adapters is None:
    params = ckpt.restore_params(step_dir, abstract, item=item)
    return _with_head(params, found_head, head, shardings)
  trained = ckpt.restore_params(step_dir, lora.split(abstract)[0], item=item)
  params = with_base(trained, adapters, saved, found_head, mesh, layout, saved_shardings)
  wanted = param_shardings(model.replace(lora=None, quantized=()), found_head, mesh, layout)
  params = jax.jit(lambda p: lora.merged(p, adapters.lora), out_shardings=wanted)(params)
  return _with_head(params, found_head, head, shardings)


ADAPTERS_META = "adapters"
"""The meta key of a checkpoint's adapters: {item: `SavedAdapters.to_json`} of each saved
trained role that has LoRA adapters (`adapters_meta`)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SavedAdapters:
  """What a checkpoint of a role with LoRA adapters says about them: it holds the adapters (and
  a value head) alone, and their frozen base is `load_params(base, rng=rng)` of the model
  without adapters, the weights the run started from."""

  lora: model_config.LoraConfig
  base: str
  """The base's source ('': random from `rng`)."""
  rng: jax.Array
  quantized: tuple[str, ...] = ()
  """The base's projections the adapters were trained over quantized (`ModelConfig.quantized`)."""
  quantization: str = "int8"
  """How those were stored (`ModelConfig.quantization`)."""

  @classmethod
  def of(cls, model: ModelConfig, source: Any) -> SavedAdapters:
    """From a role's model (its `lora` and quantized base) and its
    `rlhfjax.cluster.WeightSource`."""
    return cls(
      lora=model.lora,
      base=source.source,
      rng=source.rng,
      quantized=model.quantized,
      quantization=model.quantization,
    )

  def to_json(self) -> dict[str, Any]:
    return {
      "lora": dataclasses.asdict(self.lora),
      "base": self.base,
      "rng": [int(x) for x in np.asarray(jax.random.key_data(self.rng)).ravel()],
      "quantized": list(self.quantized),
      "quantization": self.quantization,
    }

  @classmethod
  def from_json(cls, found: dict[str, Any]) -> SavedAdapters:
    lora_fields = found["lora"]
    return cls(
      lora=model_config.LoraConfig(**{**lora_fields, "targets": tuple(lora_fields["targets"])}),
      base=found["base"],
      rng=jax.random.wrap_key_data(np.asarray(found["rng"], np.uint32)),
      quantized=tuple(found.get("quantized", ())),
      quantization=found.get("quantization", "int8"),
    )


def adapters_meta(adapted: dict[str, SavedAdapters]) -> dict[str, Any]:
  """The JSON a checkpoint saves about the adapters of its items (`saved_adapters`); nothing
  when none has adapters."""
  if not adapted:
    return {}
  return {ADAPTERS_META: {item: saved.to_json() for item, saved in adapted.items()}}


def saved_adapters(step_dir: Any, item: str) -> SavedAdapters | None:
  """What item `item` of a checkpoint says about its adapters, or None without adapters."""
  found = ckpt.read_meta(step_dir).get(ADAPTERS_META, {}).get(item)
  return None if found is None else SavedAdapters.from_json(found)


def with_base(
  trained: Any, saved: SavedAdapters, model: ModelConfig, head: HeadKind, mesh, layout, shardings
) -> Any:
  """The whole parameters of a checkpoint item that holds only its trained part (`trained`:
  adapters and a value head, the base as None): the base loaded from its source again, in
  `shardings` (the whole tree's, adapters included)."""
  frozen = load_params(
    saved.base,
    model=model.replace(lora=None),
    head=head,
    mesh=mesh,
    layout=layout,
    shardings=lora.base(shardings),
    rng=saved.rng,
    items=items_for(head),
    what=f"the base of the adapters ({saved.base or 'random'})",
  )
  frozen = jax.device_put(frozen, lora.base(shardings))
  return lora.join(trained, lora.split(lora.attach(frozen, lora.adapters(trained)))[1])


def _check_heads(found: HeadKind, wanted: HeadKind, what: str) -> None:
  if found == "value" and wanted == "lm":
    raise WeightsError(f"{what} has a value head; a policy needs a language-model head")


def _with_head(params: dict, found: HeadKind, wanted: HeadKind, shardings: Any) -> dict:
  """`params` of a `found`-head model as a `wanted`-head model: the trunk kept, a value head
  added at zero when a language model starts a value model."""
  if found == wanted:
    return params
  trunk = {k: v for k, v in params.items() if k != "lm_head"}
  value_sharding = shardings["value_head"]
  hidden = trunk["final_norm"]["scale"].shape[0]
  dtype = trunk["final_norm"]["scale"].dtype
  zeros = jax.jit(lambda: jnp.zeros((hidden,), dtype), out_shardings=value_sharding)()
  return {**trunk, "value_head": zeros}
