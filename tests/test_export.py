"""`rlhfjax.export` without a run: the byte tokenizer's tokenizer.json encodes as ours, a
checkpoint without its policy's meta is one line, a Hugging Face tokenizer's files are copied,
shard files split over processes by whole layer blocks. `scripts/export_hf.py` on runs:
test_export_e2e.py; two processes writing disjoint shards: test_export_multiprocess.py."""

import os

import jax
import numpy as np
import pytest
import tokenizers

from rlhfjax import checkpoint as ckpt
from rlhfjax import export
from rlhfjax.config.model import get_model_config
from rlhfjax.data.byte_tokenizer import ByteTokenizer
from rlhfjax.models import hf

pytestmark = pytest.mark.unit

# Four layers, one per file at this size: two layer files per process in the 2-process test.
_LAYERS = 4
_SHARD = "150KB"  # embedding + norm + LM head in one file (~146 KB), each layer (~135 KB) alone


def test_byte_tokenizer_json_encodes_like_ours():
  ours = ByteTokenizer()
  theirs = tokenizers.Tokenizer.from_str(export.byte_tokenizer_json(ours))
  # Every byte value (the ASCII code points as one byte, the others as two), and text whose
  # characters take three and four bytes.
  for text in ("".join(map(chr, range(256))), "日本 ✓ \t\n 😀", "<|user|>"[:3]):
    assert theirs.encode(text).ids == ours.encode(text)
    assert theirs.encode(text, add_special_tokens=False).ids == ours.encode(text, add_bos=False)
  for name, token_id in ours.special_tokens.items():
    assert theirs.token_to_id(name) == token_id
  assert theirs.get_vocab_size() == ours.vocab_size


def test_a_checkpoint_without_its_policy_meta_is_one_line(tmp_path):
  x = jax.device_put(np.zeros(3, np.float32), jax.devices()[0])
  with ckpt.Checkpointer(tmp_path / "old" / "checkpoints") as checkpointer:
    checkpointer.save(1, {"policy": {"w": x}}, {"step": 1}, force=True)
  with pytest.raises(export.ExportError, match=r"old/checkpoints/1 does not say which model"):
    export.export(str(tmp_path / "old"), str(tmp_path / "out"))
  assert not (tmp_path / "out").exists()


def test_a_hugging_face_tokenizer_is_copied(tmp_path):
  source = tmp_path / "tok"
  source.mkdir()
  (source / "tokenizer.json").write_text(export.byte_tokenizer_json(ByteTokenizer()))
  (source / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}')
  (source / "unrelated.txt").write_text("")
  for spec, out in ((source, tmp_path / "a"), (source / "tokenizer.json", tmp_path / "b")):
    out.mkdir()
    export._copy_tokenizer_files(str(spec), str(out))
    assert sorted(os.listdir(out)) == ["tokenizer.json", "tokenizer_config.json"]
    for name in os.listdir(out):
      assert (out / name).read_bytes() == (source / name).read_bytes()


def test_shard_files_split_over_processes_by_whole_layer_blocks():
  model = get_model_config("tiny", num_layers=_LAYERS)
  shards = hf.plan_shards(model, "lm", 4, export.parse_size(_SHARD))
  assert [list(s.layers) for s in shards] == [[], [0], [1], [2], [3]]
  two = export.assign_files(shards, _LAYERS, 2)
  assert two.layers_by_process and list(two.writer.values()) == [0, 0, 0, 1, 1]
  three = export.assign_files(shards, _LAYERS, 3)  # 4 layer files over 3: all read all layers
  assert not three.layers_by_process and list(three.writer.values()) == [0, 0, 0, 1, 2]
  assert [s.name for s in hf.plan_shards(model, "lm", 4, 10**9)] == ["model.safetensors"]
