"""A process of tests/test_hf_load_multiprocess.py: writes a wide checkpoint, or loads one and
reports.

python tests/hf_load_worker.py write DIR
python tests/hf_load_worker.py load DIR OUT.json {sliced|whole} [PORT PROCESS_ID]

`load` puts the checkpoint fully sharded over all devices of the job (two processes when a
port is given) and writes to OUT.json: this process's peak resident memory during the load
above its resident memory before it, the bytes its arrays hold, the checkpoint bytes it read
and a digest of every parameter (gathered across processes).
"""

import hashlib
import json
import os
import sys

import numpy as np

# Wide and shallow: ~290 MB of float32, no parameter more than a fifth of it.
HF_CONFIG = {
  "architectures": ["LlamaForCausalLM"],
  "model_type": "llama",
  "vocab_size": 8192,
  "hidden_size": 1024,
  "intermediate_size": 2048,
  "num_hidden_layers": 5,
  "num_attention_heads": 8,
  "num_key_value_heads": 8,
  "head_dim": 128,
  "tie_word_embeddings": False,
  "rms_norm_eps": 1e-6,
}


def hf_shapes(c: dict) -> dict[str, tuple[int, ...]]:
  """Every tensor of a Llama / Qwen2 / Qwen3 checkpoint with `config.json` `c`, HF's shapes."""
  d, f, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
  n = c["head_dim"]
  q, kv = c["num_attention_heads"] * n, c["num_key_value_heads"] * n
  family, bias = c["model_type"], c.get("attention_bias", False)
  shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
  if c["architectures"][0].endswith("ForSequenceClassification"):
    shapes["score.weight"] = (1, d)
  elif not c["tie_word_embeddings"]:
    shapes["lm_head.weight"] = (v, d)
  layer = {
    "self_attn.q_proj.weight": (q, d),
    "self_attn.k_proj.weight": (kv, d),
    "self_attn.v_proj.weight": (kv, d),
    "self_attn.o_proj.weight": (d, q),
    "mlp.gate_proj.weight": (f, d),
    "mlp.up_proj.weight": (f, d),
    "mlp.down_proj.weight": (d, f),
    "input_layernorm.weight": (d,),
    "post_attention_layernorm.weight": (d,),
  }
  if bias or family == "qwen2":
    layer.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,)})
    layer["self_attn.v_proj.bias"] = (kv,)
  if bias and family != "qwen2":
    layer["self_attn.o_proj.bias"] = (d,)
  if family == "qwen3":
    layer.update({"self_attn.q_norm.weight": (n,), "self_attn.k_norm.weight": (n,)})
  for i in range(c["num_hidden_layers"]):
    shapes.update({f"model.layers.{i}.{name}": s for name, s in layer.items()})
  return shapes


def write(path: str) -> None:
  from safetensors.numpy import save_file

  os.makedirs(path, exist_ok=True)
  rng = np.random.default_rng(0)
  tensors = {n: rng.standard_normal(s, np.float32) for n, s in hf_shapes(HF_CONFIG).items()}
  save_file(tensors, os.path.join(path, "model.safetensors"))
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(HF_CONFIG, f)


def _memory_kb(field: str) -> int:
  with open("/proc/self/status") as f:
    line = next(x for x in f if x.startswith(field + ":"))
  return int(line.split()[1])


def load(path: str, out: str, mode: str, port: str | None, process_id: str | None) -> None:
  import jax

  if port:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_num_cpu_devices", 4)
    jax.distributed.initialize(f"localhost:{port}", 2, int(process_id))
  from jax.experimental import multihost_utils
  from jax.sharding import Mesh, NamedSharding, PartitionSpec

  from rlhfjax import models
  from rlhfjax.config.hf import read_hf_config
  from rlhfjax.models import hf, hf_read

  config, head = read_hf_config(path)
  mesh = Mesh(np.array(jax.devices()), ("x",))

  def spec(leaf):  # the first axis that splits evenly over every device
    axes = [None] * leaf.ndim
    axes[next(i for i, s in enumerate(leaf.shape) if s % mesh.size == 0)] = "x"
    return NamedSharding(mesh, PartitionSpec(*axes))

  shardings = jax.tree.map(spec, models.abstract_params(config, head))
  jax.block_until_ready(jax.device_put(np.zeros(8), shardings["final_norm"]["scale"]))
  try:  # reset the peak to the resident memory now (Linux >= 4.0)
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")
  except OSError:
    pass  # the peak stays the highest so far: the measure can only grow
  before = _memory_kb("VmRSS") * 1024
  read = 0
  if mode == "sliced":
    with hf_read.SafetensorsReader(path) as reader:
      params = hf_read.read_params(reader, config, head, shardings=shardings)
      jax.block_until_ready(params)
      read = reader.bytes_read
  else:  # the whole-tensor load this replaced: every tensor read, stacked, then placed
    from safetensors.numpy import load_file

    tensors = load_file(os.path.join(path, "model.safetensors"))
    params = jax.device_put(hf.params_from_hf_tensors(config, head, tensors), shardings)
    del tensors
    jax.block_until_ready(params)
  peak = _memory_kb("VmHWM") * 1024
  held = sum(s.data.nbytes for x in jax.tree.leaves(params) for s in x.addressable_shards)
  digests = {}
  for key, x in jax.tree_util.tree_leaves_with_path(params):
    whole = multihost_utils.process_allgather(x, tiled=True) if port else np.asarray(x)
    digests[jax.tree_util.keystr(key)] = hashlib.sha256(np.ascontiguousarray(whole)).hexdigest()
  with open(out, "w") as f:
    json.dump(
      {
        "above_baseline": peak - before,
        "held": held,
        "read": read,
        "checkpoint": os.path.getsize(os.path.join(path, "model.safetensors")),
        "digests": digests,
        "devices": jax.local_device_count(),
      },
      f,
    )


if __name__ == "__main__":
  if sys.argv[1] == "write":
    write(sys.argv[2])
  else:
    load(*sys.argv[2:5], *(sys.argv[5:7] if len(sys.argv) > 5 else (None, None)))
