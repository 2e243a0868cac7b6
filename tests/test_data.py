"""The data layer: tokenizers, JSONL datasets through TFDS (no TensorFlow) and grain pipelines."""

import json
import os
import pathlib
import sys
import tempfile

import numpy as np
import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from rlhfjax import data, tasks
from rlhfjax.data import jsonl, pipeline
from rlhfjax.data.byte_tokenizer import ByteTokenizer

pytestmark = pytest.mark.pure

_BYTE = ByteTokenizer()
_SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "<|user|>", "<|assistant|>"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp("prepared"))


def _write(path: pathlib.Path, lines: list) -> str:
  """Writes JSONL lines: dicts as JSON, bytes verbatim, str as UTF-8."""
  with open(path, "wb") as f:
    for line in lines:
      if isinstance(line, dict):
        line = json.dumps(line)
      f.write((line.encode() if isinstance(line, str) else line) + b"\n")
  return str(path)


def _records(n: int, kind: str = "demonstration") -> list[dict]:
  out = []
  for i in range(n):
    record = {
      "prompt": f"prompt {i}",
      "response": f" r{i}.",
      "chosen": " aeiou",
      "rejected": " xyz",
    }
    out.append({f: record[f] for f in jsonl.FIELDS[kind]})
  return out


def _hf_tokenizer_file(directory: pathlib.Path, specials=tuple(_SPECIALS)) -> str:
  """A tiny byte-level BPE trained here, saved as tokenizer.json."""
  tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=300,
    special_tokens=list(specials),
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
  )
  tok.train_from_iterator(tasks.vowel_prompts()[:50], trainer)
  path = directory / "tokenizer.json"
  tok.save(str(path))
  return str(path)


# ----------------------------------------------------------------------------------------------
# Tokenizers


def test_byte_tokenizer_is_unchanged_for_plain_text_and_fits_the_tiny_model():
  assert _BYTE.encode("héllo") == [256, *"héllo".encode()]
  assert _BYTE.encode("<|user|>", add_bos=False) == list(b"<|user|>")  # text never forges markers
  assert (_BYTE.bos_id, _BYTE.eos_id, _BYTE.pad_id) == (256, 257, 258)
  assert _BYTE.vocab_size <= 328
  assert max(_BYTE.special_tokens.values()) < _BYTE.vocab_size
  assert _BYTE.token_to_id("<|assistant|>") == 260 and _BYTE.token_to_id("<|nope|>") is None
  assert _BYTE.decode([256, 259, 104, 105, 257]) == "hi"
  # What the model was given: the special ids by name, the bytes between them decoded whole.
  shown = _BYTE.decode([256, 259, *"é".encode(), 260, 258], skip_special_tokens=False)
  assert shown == "<|bos|><|user|>é<|assistant|><|pad|>"
  assert isinstance(_BYTE, data.Tokenizer)


def test_hf_tokenizer_round_trip_and_special_ids(tmp_path):
  tok = data.load_tokenizer(_hf_tokenizer_file(tmp_path))
  assert isinstance(tok, data.HFTokenizer) and isinstance(tok, data.Tokenizer)
  assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 3)
  assert tok.vocab_size == 300
  text = "the cat sees the moon, héllo"
  ids = tok.encode(text)
  assert ids[0] == tok.bos_id and tok.bos_id not in ids[1:]
  assert tok.decode(ids) == text
  assert tok.decode(ids, skip_special_tokens=False).startswith(tok._tok.id_to_token(tok.bos_id))
  assert tok.encode(text, add_bos=False) == ids[1:]
  assert tok.token_to_id("<|user|>") == 4
  # A directory works too.
  again = data.load_tokenizer(str(tmp_path))
  assert again.encode("cat") == tok.encode("cat")
  # The same file, the same fingerprint (a recorded length check's key); other specials differ.
  assert again.fingerprint() == tok.fingerprint() != _BYTE.fingerprint()


def test_hf_tokenizer_special_token_errors_and_pad_fallback(tmp_path):
  (tmp_path / "a").mkdir()
  no_pad = data.load_tokenizer(_hf_tokenizer_file(tmp_path / "a", ["<unk>", "<s>", "</s>"]))
  assert no_pad.pad_id == no_pad.eos_id
  (tmp_path / "b").mkdir()
  with pytest.raises(ValueError, match="no BOS token"):
    data.load_tokenizer(_hf_tokenizer_file(tmp_path / "b", ["<unk>", "</s>"]))
  # tokenizer_config.json names the specials when the defaults do not match.
  (tmp_path / "b" / "tokenizer_config.json").write_text(
    json.dumps({"bos_token": {"content": "<unk>"}, "eos_token": "</s>"})
  )
  named = data.load_tokenizer(str(tmp_path / "b"))
  assert named.bos_id == 0
  (tmp_path / "b" / "tokenizer_config.json").write_text(json.dumps({"bos_token": "</s>"}))
  assert data.load_tokenizer(str(tmp_path / "b")).fingerprint() != named.fingerprint()


def test_load_tokenizer_rejects_unknown_specs(tmp_path):
  assert isinstance(data.load_tokenizer("byte"), ByteTokenizer)
  with pytest.raises(ValueError, match="unknown tokenizer"):
    data.load_tokenizer(str(tmp_path / "missing.json"))
  with pytest.raises(ValueError, match="holds no tokenizer.json"):
    data.load_tokenizer(str(tmp_path))
  bad = tmp_path / "bad.json"
  bad.write_text("{")
  with pytest.raises(ValueError, match="cannot read"):
    data.load_tokenizer(str(bad))


def test_chat_template_uses_marker_tokens_when_the_tokenizer_has_them(tmp_path):
  template = data.ChatTemplate()
  assert template.render("hi") == "<|user|>\nhi\n<|assistant|>\n"
  assert template.encode(_BYTE, "hi") == [256, 259, 10, 104, 105, 10, 260, 10]
  hf = data.load_tokenizer(_hf_tokenizer_file(tmp_path))
  ids = template.encode(hf, "the cat")
  assert ids[:2] == [hf.bos_id, 4] and 5 in ids
  # Without the marker tokens, the markers are plain text.
  plain = data.ChatTemplate(user="User:", assistant="Bot:")
  assert _BYTE.decode(plain.encode(_BYTE, "hi")) == "User:\nhi\nBot:\n"


# ----------------------------------------------------------------------------------------------
# JSONL through TFDS


@pytest.mark.parametrize("kind", ["prompt", "demonstration", "preference"])
def test_jsonl_round_trip_without_tensorflow(kind, tmp_path, data_dir):
  records = _records(7, kind)
  prepared = data.prepare(kind, _write(tmp_path / "d.jsonl", records), data_dir)
  assert prepared.bad_records == {} and prepared.num_examples() == 7
  source = prepared.source("train")
  got = [source[i] for i in range(len(source))]
  skipped = ("extra", "line", "messages")
  fields = lambda x: {k: v.decode() for k, v in x.items() if k not in skipped}
  assert [fields(x) for x in got] == records  # text comes back as bytes, in file order
  # Beside them, each record's other fields (none here), its line in the file and its
  # conversation (none: a plain prompt).
  assert [(x["extra"], int(x["line"]), x["messages"]) for x in got] == [
    (b"{}", i + 1, b"") for i in range(7)
  ]
  assert len(prepared.source("train[:70%]")) + len(prepared.source("train[70%:]")) == 7
  assert "tensorflow" not in sys.modules


def test_prepare_caches_by_content_and_prepares_changed_files_again(
  tmp_path, data_dir, monkeypatch
):
  scratch = tmp_path / "tmp"
  scratch.mkdir()
  monkeypatch.setattr(tempfile, "tempdir", str(scratch))
  path = _write(tmp_path / "p.jsonl", _records(5, "prompt"))
  first = data.prepare("prompt", path, data_dir)
  assert not os.listdir(scratch)  # a prepare leaves nothing in the temporary directory
  info = os.path.join(first.builder.data_dir, "dataset_info.json")
  mtime = os.path.getmtime(info)
  again = data.prepare("prompt", path, data_dir)
  assert again.builder.data_dir == first.builder.data_dir and os.path.getmtime(info) == mtime
  _write(tmp_path / "p.jsonl", _records(6, "prompt"))
  changed = data.prepare("prompt", path, data_dir)
  assert changed.builder.data_dir != first.builder.data_dir and changed.num_examples() == 6


def test_prepare_takes_a_file_per_split(tmp_path, data_dir):
  paths = {
    "train": _write(tmp_path / "t.jsonl", _records(4, "prompt")),
    "eval": _write(tmp_path / "e.jsonl", _records(2, "prompt")),
  }
  prepared = data.prepare("prompt", paths, data_dir)
  assert sorted(prepared.splits) == ["eval", "train"] and prepared.num_examples("eval") == 2


_BAD_LINES = {
  "missing_field": {"prompt": "p", "respons": "typo"},
  "invalid_json": '{"prompt": "p", "response": ',
  "not_utf8": b'{"prompt": "\xff\xfe", "response": "r"}',
  "not_a_string": {"prompt": "p", "response": 3},
  "empty_string": {"prompt": "  ", "response": "r"},
  "not_an_object": '["p", "r"]',
}


@pytest.mark.parametrize("reason", sorted(_BAD_LINES))
def test_bad_record_raises_naming_file_and_line_or_is_skipped_and_counted(
  reason, tmp_path, data_dir
):
  lines = [*_records(2), _BAD_LINES[reason], "", *_records(3)]
  path = _write(tmp_path / f"{reason}.jsonl", lines)
  with pytest.raises(data.DataError, match=rf"{reason}\.jsonl:3: ") as error:
    data.prepare("demonstration", path, data_dir, on_bad_record="error")
  assert "\n" not in str(error.value)
  prepared = data.prepare("demonstration", path, data_dir, on_bad_record="skip")
  assert prepared.bad_records == {reason: 1} and prepared.num_examples() == 5
  assert prepared.first_bad_record[reason].startswith(f"{path}:3: ")
  # A cached prepare still reports the skipped records, and still refuses under 'error'.
  assert data.prepare("demonstration", path, data_dir, on_bad_record="skip").bad_records == {
    reason: 1
  }
  with pytest.raises(data.DataError, match="cached prepare skipped 1 bad"):
    data.prepare("demonstration", path, data_dir, on_bad_record="error")


def test_a_preference_pair_that_cannot_be_told_apart_is_a_bad_record(tmp_path, data_dir):
  """Chosen and rejected the same text: the pair teaches nothing. Refused naming file:line, or
  skipped and counted."""
  pairs = [{"prompt": f"p{i}", "chosen": "aa", "rejected": "b"} for i in range(3)]
  same = {"prompt": "p", "chosen": "same", "rejected": "same"}
  path = _write(tmp_path / "pairs.jsonl", [*pairs, same])
  with pytest.raises(
    data.DataError, match=r"pairs\.jsonl:4: fields 'chosen' and 'rejected' are the same text"
  ):
    data.prepare("preference", path, data_dir)
  prepared = data.prepare("preference", path, data_dir, on_bad_record="skip")
  assert prepared.bad_records == {"same_pair": 1} and prepared.num_examples() == 3


@pytest.mark.parametrize("on_bad_record", ["error", "skip"])
def test_empty_or_missing_dataset_is_a_clear_error(on_bad_record, tmp_path, data_dir):
  empty = _write(tmp_path / "empty.jsonl", ["", "  "])
  with pytest.raises(data.DataError, match="empty.jsonl: no valid prompt record"):
    data.prepare("prompt", empty, data_dir, on_bad_record=on_bad_record)
  with pytest.raises(data.DataError, match="missing.jsonl: no such prompt file"):
    data.prepare("prompt", str(tmp_path / "missing.jsonl"), data_dir, on_bad_record)


def test_all_bad_records_skipped_is_an_empty_dataset(tmp_path, data_dir):
  path = _write(tmp_path / "bad.jsonl", [{"x": 1}, "nope"])
  with pytest.raises(data.DataError, match=r"no valid prompt record \(skipped 2 bad"):
    data.prepare("prompt", path, data_dir, on_bad_record="skip")


def test_prepare_rejects_unknown_kind_and_policy(tmp_path):
  path = _write(tmp_path / "p.jsonl", _records(1, "prompt"))
  with pytest.raises(ValueError, match="unknown dataset kind"):
    data.prepare("prompts", path, str(tmp_path))
  with pytest.raises(ValueError, match="on_bad_record must be"):
    data.prepare("prompt", path, str(tmp_path), on_bad_record="ignore")


# ----------------------------------------------------------------------------------------------
# Pipelines


def _prompts(it, n: int) -> list[str]:
  return [_BYTE.decode(p) for p in it.take(n)]


def test_shuffle_is_deterministic_and_redrawn_every_epoch():
  source = _records(12, "prompt")
  make = lambda seed: data.prompt_iterator(source, _BYTE, max_prompt_len=32, seed=seed)
  a = _prompts(make(0), 36)
  assert a == _prompts(make(0), 36)
  assert a[:12] != _prompts(make(1), 12)
  epochs = [a[i : i + 12] for i in (0, 12, 24)]
  assert all(sorted(e) == sorted(r["prompt"] for r in source) for e in epochs)
  assert epochs[0] != epochs[1] != epochs[2]


def test_prompt_state_restores_through_json_and_continues_identically():
  source = _records(10, "prompt") + [{"prompt": "x" * 40}]
  make = lambda: data.prompt_iterator(
    source, _BYTE, max_prompt_len=16, seed=3, on_long_prompt="skip"
  )
  it = make()
  it.take(7)
  state = json.loads(json.dumps(it.get_state()))
  expected, expected_stats = it.take(25), dict(it.stats)
  resumed = make()
  resumed.set_state(state)
  assert resumed.take(25) == expected and resumed.stats == expected_stats
  assert expected_stats["skipped_too_long"] >= 2  # counts survive the resume
  with pytest.raises(ValueError, match="state's seed"):
    data.prompt_iterator(source, _BYTE, max_prompt_len=16, seed=4).set_state(state)


def test_batch_state_restores_and_continues_identically():
  source = _records(9, "preference")
  make = lambda: data.preference_batches(source, _BYTE, batch_size=4, max_len=24, seed=5)
  it = make()
  next(it), next(it)
  state = json.loads(json.dumps(it.get_state()))
  expected = [next(it) for _ in range(4)]
  resumed = make()
  resumed.set_state(state)
  for want in expected:
    got = next(resumed)
    assert got.keys() == want.keys()
    for key in want:
      np.testing.assert_array_equal(got[key], want[key])


@pytest.mark.parametrize("template", [None, data.ChatTemplate()])
def test_long_prompts_are_left_truncated_keeping_bos_and_markers(template):
  source = [{"prompt": "abcdefghijklmnopqrstuvwxyz"}, {"prompt": "short"}]
  it = data.prompt_iterator(
    source, _BYTE, max_prompt_len=12, seed=0, repeat=False, chat_template=template
  )
  long, short = list(it)
  assert len(long) == 12 and long[0] == _BYTE.bos_id
  assert _BYTE.decode(long).endswith("xyz" if template is None else "xyz\n\n")
  if template is not None:
    assert long[1] == _BYTE.user_id and long[-2:] == [_BYTE.assistant_id, 10]
  assert _BYTE.decode(short).strip() == "short"
  assert it.stats == {"records": 2, "truncated": 1, "skipped_too_long": 0}


def test_long_prompts_skip_or_error_and_are_counted():
  source = [{"prompt": "x" * 30}, {"prompt": "ok"}, {"prompt": "y" * 30}]
  it = data.prompt_iterator(source, _BYTE, max_prompt_len=8, seed=0, on_long_prompt="skip")
  assert _prompts(it, 3) == ["ok"] * 3 and it.stats["skipped_too_long"] >= 4
  # 'error' checks every record when the stream is built: the last one too, before any is drawn.
  late = [{"prompt": "ok"}] * 5 + [{"prompt": "y" * 30}]
  with pytest.raises(
    data.DataError,
    match=r"^record 5: 31 tokens > max 8 \(on_long_prompt='error', checked over all 6 records",
  ):
    data.prompt_iterator(late, _BYTE, max_prompt_len=8, seed=0, on_long_prompt="error")
  with pytest.raises(data.DataError, match="all 1 records are too long"):
    next(data.prompt_iterator(source[:1], _BYTE, max_prompt_len=8, seed=0, on_long_prompt="skip"))
  with pytest.raises(ValueError, match="on_long_prompt must be"):
    data.prompt_iterator(source, _BYTE, max_prompt_len=8, seed=0, on_long_prompt="drop")
  with pytest.raises(data.DataError, match="empty"):
    data.prompt_iterator([], _BYTE, max_prompt_len=8, seed=0)


def test_the_start_up_length_check_is_recorded_so_a_resume_does_not_scan_again(
  tmp_path, monkeypatch
):
  """Issue 43: on_long_prompt='error' scans every record at start, once per prepared dataset,
  split, tokenizer, template and length; a pass is recorded beside the prepared dataset, a
  failure never is."""
  lines = [{"prompt": "ok"}] * 5 + [{"prompt": "y" * 30}]
  prepared = data.prepare("prompt", _write(tmp_path / "p.jsonl", lines), tmp_path / "data")
  scans = []
  real_tqdm = pipeline.tqdm.tqdm

  def counting(*args, **kwargs):
    scans.append(kwargs.get("desc"))
    return real_tqdm(*args, **kwargs)

  monkeypatch.setattr(pipeline.tqdm, "tqdm", counting)

  def build(max_len=64, template=None, split="train"):
    return data.prompt_iterator(
      prepared.source(split), _BYTE, max_prompt_len=max_len, seed=0, on_long_prompt="error",
      chat_template=template, origin=prepared.path(split),
    )  # fmt: skip

  for _ in range(2):
    with pytest.raises(data.DataError, match=r"p\.jsonl:6: 31 tokens > max 8"):
      build(max_len=8)
  build()
  build()  # a resume: recorded, not scanned
  assert len(scans) == 3
  build(template=data.ChatTemplate())  # another rendering: scanned
  build(split="train[:50%]")  # another split
  build(max_len=63)
  assert len(scans) == 6
  checks = json.loads((pathlib.Path(prepared.source("train").dataset_info.data_dir) /
                       "length_checks.json").read_text())  # fmt: skip
  assert sorted(checks.values()) == [3, 6, 6, 6]  # the records each pass covered


def test_sft_loss_mask_marks_exactly_the_response_and_eos():
  source = _records(5)
  batch = next(data.sft_batches(source, _BYTE, batch_size=5, max_len=32, seed=0))
  assert batch["tokens"].shape == (5, 32) and batch["tokens"].dtype == np.int32
  assert batch["attention_mask"].dtype == np.int32 and batch["loss_mask"].dtype == np.float32
  by_prompt = {r["prompt"]: r["response"] for r in source}
  for tokens, mask, loss in zip(
    batch["tokens"], batch["attention_mask"], batch["loss_mask"], strict=True
  ):
    n = int(mask.sum())
    assert mask[:n].all() and not mask[n:].any() and (tokens[n:] == _BYTE.pad_id).all()
    response = tokens[loss == 1].tolist()
    assert response[-1] == _BYTE.eos_id and tokens[n - 1] == _BYTE.eos_id
    prompt = _BYTE.decode(tokens[: n - len(response)])
    assert _BYTE.decode(response) == by_prompt[prompt]
    assert (loss == 1).sum() == len(by_prompt[prompt]) + 1 and not loss[n:].any()


def test_sft_truncates_the_prompt_first_then_the_response():
  source = [{"prompt": "abcdefgh", "response": "1234"}]
  make = lambda max_len, **kw: data.sft_batches(
    source, _BYTE, batch_size=1, max_len=max_len, seed=0, repeat=False, **kw
  )
  it = make(8)
  tokens = next(it)["tokens"][0].tolist()
  assert tokens == [256, *b"gh", *b"1234", 257] and it.stats["truncated"] == 1
  batch = next(make(4))  # no room for the prompt text: the response is cut and has no EOS
  assert batch["tokens"][0].tolist() == [256, *b"123"] and batch["loss_mask"][0].sum() == 3
  it = data.sft_batches(
    [*source, {"prompt": "a", "response": "b"}],
    _BYTE,
    batch_size=1,
    max_len=8,
    seed=0,
    repeat=False,
    on_long_prompt="skip",
  )
  assert len(list(it)) == 1 and it.stats["skipped_too_long"] == 1
  with pytest.raises(data.DataError, match="all 1 records are too long"):
    next(make(8, on_long_prompt="skip"))  # an empty pass is an error, not silence
  with pytest.raises(data.DataError, match="record 0: 14 tokens > max 8"):
    make(8, on_long_prompt="error")


def test_eval_pass_pads_the_last_batch_with_empty_rows():
  source = _records(10, "preference")
  it = data.preference_batches(source, _BYTE, batch_size=4, max_len=20, seed=0, repeat=False)
  batches = list(it)
  assert len(batches) == 3 and all(b["chosen_tokens"].shape == (4, 20) for b in batches)
  last = batches[-1]
  np.testing.assert_array_equal(last["valid"], [1, 1, 0, 0])
  for key in ("chosen_mask", "rejected_mask", "chosen_loss_mask", "rejected_loss_mask"):
    assert not last[key][2:].any() and last[key][:2].any(axis=1).all()
  assert (last["chosen_tokens"][2:] == _BYTE.pad_id).all()
  # In file order, and all of it once.
  first_rows = [_BYTE.decode(b["chosen_tokens"][0]) for b in batches]
  assert first_rows[0].startswith("prompt 0") and first_rows[1].startswith("prompt 4")
  assert sum(b["valid"].sum() for b in batches) == 10 and it.stats["records"] == 10


def test_preference_batches_share_the_prompt():
  batch = next(
    data.preference_batches(_records(3, "preference"), _BYTE, batch_size=3, max_len=20, seed=1)
  )
  assert {k: v.dtype for k, v in batch.items()} == {
    "chosen_tokens": np.int32,
    "chosen_mask": np.int32,
    "chosen_loss_mask": np.float32,
    "rejected_tokens": np.int32,
    "rejected_mask": np.int32,
    "rejected_loss_mask": np.float32,
    "valid": np.float32,
  }
  for row in range(3):
    chosen = batch["chosen_tokens"][row][batch["chosen_loss_mask"][row] == 1]
    rejected = batch["rejected_tokens"][row][batch["rejected_loss_mask"][row] == 1]
    assert _BYTE.decode(chosen) == " aeiou" and _BYTE.decode(rejected) == " xyz"
    n_prompt = int(batch["chosen_mask"][row].sum()) - len(chosen)
    np.testing.assert_array_equal(
      batch["chosen_tokens"][row][:n_prompt], batch["rejected_tokens"][row][:n_prompt]
    )


def test_pipelines_read_prepared_tfds_sources_with_an_hf_tokenizer(tmp_path, data_dir):
  tok = data.load_tokenizer(_hf_tokenizer_file(tmp_path))
  path = _write(tmp_path / "demo.jsonl", _records(6))
  source = data.prepare("demonstration", path, data_dir).source("train")
  batches = list(
    data.sft_batches(
      source, tok, batch_size=4, max_len=24, seed=0, repeat=False, chat_template=data.ChatTemplate()
    )
  )
  assert len(batches) == 2 and batches[0]["tokens"][0, :2].tolist() == [tok.bos_id, 4]
  responses = [tok.decode(b["tokens"][i][b["loss_mask"][i] == 1]) for b in batches for i in (0, 1)]
  assert responses == [" r0.", " r1.", " r4.", " r5."]


def test_fit_to_length():
  head, body, tail = [0], [1, 2, 3, 4], [5]
  assert pipeline.fit_to_length(head, body, tail, [[7, 8]], 9) == ([0, 1, 2, 3, 4, 5], [[7, 8]])
  assert pipeline.fit_to_length(head, body, tail, [[7, 8]], 6) == ([0, 3, 4, 5], [[7, 8]])
  assert pipeline.fit_to_length(head, body, tail, [[7, 8, 9], [7]], 4) == ([0, 5], [[7, 8], [7]])
  assert pipeline.fit_to_length(head, body, tail, [[7]], 2) is None
  assert pipeline.fit_to_length(head, body, tail, [], 2) == ([0, 5], [])


# ----------------------------------------------------------------------------------------------
# Bundled data


def test_bundled_vowels_data_loads_and_teaches_the_reward(data_dir):
  prompts = data.prepare("prompt", data.bundled_path("vowels", "prompt"), data_dir)
  assert prompts.num_examples() == 768
  assert {p["prompt"].decode() for p in prompts.source()} == set(tasks.vowel_prompts())
  demos = data.prepare("demonstration", data.bundled_path("vowels", "demonstration"), data_dir)
  assert 1000 <= demos.num_examples() <= 2000
  assert all(5 <= len(d["response"]) <= 16 for d in demos.source())
  prefs = data.prepare("preference", data.bundled_path("vowels", "preference"), data_dir)
  assert 1000 <= prefs.num_examples() <= 2000 and prefs.bad_records == {}
  records = list(prefs.source())
  as_ids = lambda key: [np.frombuffer(r[key], np.uint8) for r in records]
  chosen = tasks.vowel_reward([], as_ids("chosen"), {"step": 0})
  rejected = tasks.vowel_reward([], as_ids("rejected"), {"step": 0})
  assert (chosen - rejected >= 0.15 - 1e-6).all()
  with pytest.raises(ValueError, match="no bundled data for task 'poems'"):
    data.bundled_path("poems", "prompt")
  with pytest.raises(ValueError, match="unknown dataset kind"):
    data.bundled_path("vowels", "prompts")
