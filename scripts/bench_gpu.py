r"""Single-GPU efficiency of a 1B PPO actor: train-step MFU and the rollout engine's decode
bandwidth (batch 64 and 256), JSON lines.

  python scripts/bench_gpu.py [--batch=8 --seq_len=2048 --decode_batch=64 --cache_len=2048]
  python scripts/bench_gpu.py --size=configs/hf/llama-3.1-8b --remat= --decode_batch=128
  python scripts/bench_gpu.py --decode_batch= --seq_len=8192 --batch=2 --attention=auto,xla

`--size` is a registered size or a Hugging Face `config.json` (or its directory: its shape, random
weights; bf16 for decode, fp32 masters for the train step). An empty `--remat` or
`--decode_batch` skips the train or the decode rows. `--attention` lists the attention
kernels the train rows run (`ModelConfig.attention`), each row with its program's memory from
XLA's own analysis.

First the device's measured copy bandwidth and bf16 matmul rate beside its datasheet peaks,
which the MFU and bandwidth fractions are taken against (`step_bench.peaks`: H100 or H200).
The decode rows run each of `--paged_kernels` ('auto': the Pallas kernel on a GPU; 'gather':
pages gathered into a contiguous cache, then XLA's attention).

The train step keeps fp32 master weights and trains in bf16 with the size's remat, chunked
log-probs and cuDNN flash attention ('auto' picks it on a GPU); decode runs bf16 weights.
First prints the attention kernels' agreement with the einsum path (`--check`).
See `rlhfjax.bench.step_bench` for what is counted.
"""

import json

from absl import app, flags

from rlhfjax.bench import step_bench
from rlhfjax.config.model import get_model_config, model_sizes
from rlhfjax.costmodel.workload import resolve_model

_SIZE = flags.DEFINE_string("size", "1b", "Model size.")
_BATCH = flags.DEFINE_integer("batch", 8, "Sequences per train step.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 2048, "Tokens per sequence (a quarter prompt).")
_REMAT = flags.DEFINE_list("remat", ["full"], "Remat policies to time.")
_CHUNK = flags.DEFINE_integer("chunk", 1024, "Log-prob chunk (0: whole logits).")
_DECODE_BATCH = flags.DEFINE_list("decode_batch", ["64", "256"], "Decode slots.")
_CACHE_LEN = flags.DEFINE_integer("cache_len", 2048, "KV cache length of a decode slot.")
_CHECK = flags.DEFINE_bool("check", True, "Compare attention kernels with the einsum path.")
_CEILINGS = flags.DEFINE_bool("ceilings", True, "Measure copy bandwidth and bf16 matmul rate.")
_COPY_MIB = flags.DEFINE_integer("copy_mib", 4096, "Size of the bandwidth probe in MiB.")
_MATMUL_N = flags.DEFINE_integer("matmul_n", 8192, "Side of the matmul-rate probe.")
_PAGED_KERNELS = flags.DEFINE_list(
  "paged_kernels", ["auto", "gather"], "Paged attention kernels to time ('auto', 'gather', ...)."
)
_ATTENTION = flags.DEFINE_list(
  "attention", ["auto"], "Attention kernels of the train rows (ModelConfig.attention values)."
)


def _config(size: str, **changes):
  """The size's config, or the shape of a Hugging Face config.json with fp32 parameters and
  bf16 compute (the train step's fp32 masters), with `changes`."""
  if size in model_sizes():
    return get_model_config(size, **changes)
  return resolve_model(size).replace(**{"param_dtype": "float32", "dtype": "bfloat16", **changes})


def main(argv):
  del argv
  if _CEILINGS.value:
    print(json.dumps(step_bench.ceilings(_COPY_MIB.value << 20, _MATMUL_N.value)), flush=True)
  if _CHECK.value:
    for row in step_bench.attention_check():
      print(json.dumps(row), flush=True)
  for remat in _REMAT.value:
    for kernel in _ATTENTION.value:
      config = _config(
        _SIZE.value, remat=remat, logprob_chunk_size=_CHUNK.value or None, attention=kernel
      )
      try:
        row = step_bench.train_step(config, _BATCH.value, _SEQ_LEN.value, _SEQ_LEN.value // 4)
      except Exception as e:  # noqa: BLE001 - reported (a kernel that does not build here)
        row = {"bench": "train_step", "remat": remat, "attention": kernel, "error": str(e)[:500]}
      print(json.dumps({"size": _SIZE.value, **row}), flush=True)
  rollout = _config(_SIZE.value, param_dtype="bfloat16")
  for batch in map(int, _DECODE_BATCH.value):
    for kernel in _PAGED_KERNELS.value:
      try:
        row = step_bench.paged_decode_step(rollout, batch, _CACHE_LEN.value, kernel=kernel)
      except Exception as e:  # noqa: BLE001 - reported (a kernel that does not build here)
        error = str(e)[:500]
        row = {"bench": "paged_decode_step", "batch": batch, "kernel": kernel, "error": error}
      print(json.dumps({"size": _SIZE.value, **row}), flush=True)


if __name__ == "__main__":
  app.run(main)
