"""The Hugging Face model families, one module each: adding a family is a module and a line here.

Each module declares a `Family`: its `model_type` and class names, and how its config.json
sets the fields that differ between families (biases, q/k norms, the sliding window). The
network is the same code for all of them (`rlhfjax.models.transformer`); so are the tensor
names.
"""

from rlhfjax.config.families import llama, mistral, qwen2, qwen3
from rlhfjax.config.families.family import Family

FAMILIES: dict[str, Family] = {
  f.model_type: f for f in (llama.FAMILY, mistral.FAMILY, qwen2.FAMILY, qwen3.FAMILY)
}
"""Every supported family by its `model_type`."""

__all__ = ["FAMILIES", "Family"]
