"""Loading Hugging Face checkpoints by slices: each process reads what its devices hold.

The reference is the whole-tensor path (`params_from_hf_tensors` on every tensor in memory).
Peak memory and two processes: test_hf_load_multiprocess.py.
"""

import json
import os
import pathlib

import hf_load_worker
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding
from safetensors.numpy import load_file, save_file

from rlhfjax import models
from rlhfjax.config.families import FAMILIES
from rlhfjax.config.hf import CheckpointError, read_hf_config
from rlhfjax.mesh import rules
from rlhfjax.models import hf, hf_read

pytestmark = pytest.mark.unit

# Distinct sizes, so a transposed axis cannot pass; every sharded one splits over 2, 4 and 8
# where the schemes below shard it (kv heads do not split 8 ways: replicated there).
_DIMS = dict(
  vocab_size=88,
  hidden_size=40,
  intermediate_size=72,
  num_hidden_layers=2,
  num_attention_heads=8,
  num_key_value_heads=4,
  head_dim=12,
  rms_norm_eps=1e-6,
  tie_word_embeddings=False,
)
_VARIANTS = {
  "llama": dict(model_type="llama"),
  "llama_bias_tied": dict(model_type="llama", attention_bias=True, tie_word_embeddings=True),
  "qwen2": dict(model_type="qwen2"),
  "qwen3_bias": dict(model_type="qwen3", attention_bias=True),
  "value": dict(model_type="llama", architectures=["LlamaForSequenceClassification"], num_labels=1),
  "bf16_two_files": dict(model_type="qwen3"),
}


def _write(path: pathlib.Path, variant: str) -> None:
  hf_config = {"architectures": ["X"], **_DIMS, **_VARIANTS[variant]}
  if hf_config["architectures"] == ["X"]:
    hf_config["architectures"] = [FAMILIES[hf_config["model_type"]].class_prefix + "ForCausalLM"]
  rng = np.random.default_rng(sum(map(ord, variant)))
  dtype = ml_dtypes.bfloat16 if variant.startswith("bf16") else np.float32
  tensors = {
    name: rng.standard_normal(shape, np.float32).astype(dtype)
    for name, shape in hf_load_worker.hf_shapes(hf_config).items()
  }
  path.mkdir()
  if variant.endswith("two_files"):
    names = sorted(tensors)
    files = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    for file, part in files.items():
      save_file({n: tensors[n] for n in part}, path / file)
    weight_map = {n: file for file, part in files.items() for n in part}
    (path / hf_read.INDEX).write_text(json.dumps({"weight_map": weight_map}))
  else:
    save_file(tensors, path / "model.safetensors")
  (path / "config.json").write_text(json.dumps(hf_config))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  root = tmp_path_factory.mktemp("hf_load")
  for variant in _VARIANTS:
    _write(root / variant, variant)
  return root


def _whole_load(path, dtype=jnp.float32):
  """The reference: every tensor of every file in memory, then stacked and reordered."""
  config, head = read_hf_config(path, jnp.dtype(dtype).name)
  tensors = {}
  for file in hf_read.shard_files(os.fspath(path)):
    tensors.update(load_file(file))
  return config, head, hf.params_from_hf_tensors(config, head, tensors, dtype), tensors


def _mesh(shape, names):
  return Mesh(np.array(jax.devices()).reshape(shape), names)


def _by_rules(mesh_shape):
  mesh = _mesh(mesh_shape, ("data", "fsdp", "tensor"))
  return lambda config, head: rules.named_shardings(
    models.logical_axes(config, head), models.abstract_params(config, head), mesh, "training"
  )


def _by_hand(place):
  """Shardings on a 2x4 mesh ('a', 'b') that `place(shape)` gives axis by axis."""
  mesh = _mesh((2, 4), ("a", "b"))

  def shardings(config, head):
    return jax.tree.map(
      lambda x: NamedSharding(mesh, PartitionSpec(*place(x.shape))),
      models.abstract_params(config, head),
    )

  return shardings


def _layers_and_last(shape):
  # The stacked layers axis (or the first) over 'a', the last axis over 'b': head_dim slices
  # of the q/k/v kernels, inside a band of whole heads.
  axes = [None] * len(shape)
  axes[0] = "a" if shape[0] % 2 == 0 else None
  if len(shape) > 1 and shape[-1] % 4 == 0:
    axes[-1] = "b"
  return axes


def _last_two(shape):
  # Heads over 'a' and head_dim over 'b' at once (q kernel), head_dim and width (o kernel).
  axes = [None] * len(shape)
  if len(shape) > 1 and shape[-2] % 2 == 0 and shape[-1] % 4 == 0:
    axes[-2:] = ["a", "b"]
  return axes


_SCHEMES = {
  "single_device": None,
  "fsdp8": _by_rules((1, 8, 1)),  # width over 8: column slices of the HF tensors
  "tensor8": _by_rules((1, 1, 8)),  # heads, mlp, vocab over 8: bands of rows
  "replicated": _by_rules((8, 1, 1)),  # every device the whole parameter
  "fsdp2_tensor4": _by_rules((1, 2, 4)),
  "layers_and_last": _by_hand(_layers_and_last),
  "last_two": _by_hand(_last_two),
}


def _assert_placed(params, shardings, reference):
  for (key, x), want in zip(
    jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(shardings), strict=True
  ):
    where = jax.tree_util.keystr(key)
    ref = np.asarray(_leaf_at(reference, key))
    assert x.shape == ref.shape and x.dtype == ref.dtype, where
    assert x.sharding == want, where
    expected_index = want.addressable_devices_indices_map(x.shape)
    assert {s.device for s in x.addressable_shards} == set(expected_index), where
    for shard in x.addressable_shards:
      assert shard.index == expected_index[shard.device], where
      np.testing.assert_array_equal(np.asarray(shard.data), ref[shard.index], err_msg=where)


def _leaf_at(tree, key):
  for k in key:
    tree = tree[k.key]
  return tree


@pytest.mark.parametrize("scheme", list(_SCHEMES))
@pytest.mark.parametrize("variant", list(_VARIANTS))
def test_sliced_load_equals_whole_load(checkpoints, variant, scheme, capfd):
  path = checkpoints / variant
  config, head, reference, tensors = _whole_load(path)
  make = _SCHEMES[scheme]
  shardings = (
    jax.tree.map(lambda _: SingleDeviceSharding(jax.local_devices()[0]), reference)
    if make is None
    else make(config, head)
  )
  with hf_read.SafetensorsReader(path) as reader:
    params = hf_read.read_params(
      reader, config, head, shardings=None if make is None else shardings
    )
    # Each distinct piece once, replicated ones included: the whole checkpoint, once.
    assert reader.bytes_read == sum(t.nbytes for t in tensors.values())
  _assert_placed(params, shardings, reference)
  assert capfd.readouterr().err == ""  # no progress bar outside a terminal


def test_public_load_takes_shardings_and_dtype(checkpoints):
  path = checkpoints / "bf16_two_files"
  shardings = _by_rules((1, 2, 4))(*read_hf_config(path))
  for dtype in (jnp.bfloat16, jnp.float32):
    config, params = models.load_hf_checkpoint(path, dtype, shardings=shardings)
    assert config.param_dtype == jnp.dtype(dtype).name
    _assert_placed(params, shardings, _whole_load(path, dtype)[2])


def test_a_tensor_of_another_shape_or_missing_is_one_line(tmp_path):
  path = tmp_path / "ckpt"
  _write(path, "llama")
  tensors = load_file(path / "model.safetensors")
  name = "model.layers.1.self_attn.k_proj.weight"
  tensors[name] = tensors[name][:-12]
  save_file(tensors, path / "model.safetensors")
  with pytest.raises(CheckpointError, match=rf"tensor '{name}' has shape \(36, 40\), "):
    models.load_hf_checkpoint(path)
  del tensors[name]
  save_file(tensors, path / "model.safetensors")
  with pytest.raises(CheckpointError, match=rf"tensor '{name}' is missing$"):
    models.load_hf_checkpoint(path)


def test_tensors_config_json_does_not_account_for_are_refused_by_name(tmp_path):
  """A checkpoint with more than config.json says (a layer beyond `num_layers`, a bias the
  architecture lacks) is refused, not read with those weights dropped; a causal LM's head
  beside tied embeddings or under a value head may stay unread."""
  path = tmp_path / "ckpt"
  _write(path, "llama")
  tensors = load_file(path / "model.safetensors")
  extra = dict(tensors)
  extra["model.layers.9.mlp.up_proj.bias"] = np.zeros(4, np.float32)
  extra["model.layers.1.self_attn.o_proj.bias"] = np.zeros(4, np.float32)
  save_file(extra, path / "model.safetensors")
  with pytest.raises(
    CheckpointError,
    match=r"tensors config.json does not account for: 'model.layers.1.self_attn.o_proj.bias', "
    r"'model.layers.9.mlp.up_proj.bias' \(config.json and the weights disagree",
  ):
    models.load_hf_checkpoint(path)
  buffers = {**tensors, "model.rotary_emb.inv_freq": np.ones(4, np.float32)}
  save_file(buffers, path / "model.safetensors")
  models.load_hf_checkpoint(path)  # a buffer, not a weight
