"""Writes the bundled datasets of a task: 'vowels' (prompts, demonstrations and preferences) or
'arithmetic' (prompts with their answers, demonstrations).

  python scripts/make_bundled_data.py   # rewrites rlhfjax/data/bundled/vowels/*.jsonl
  python scripts/make_bundled_data.py --task=arithmetic   # rlhfjax/data/bundled/arithmetic/

The output is deterministic (fixed seed, Python's `random`, whose `choice`/`shuffle` are stable
across versions), so rerunning it leaves the committed files unchanged; commit the script and
its output together.

- prompts.jsonl: the 768 prompts of `rlhfjax.tasks.vowel_prompts()`.
- demonstrations.jsonl: ~1500 prompts with a short ordinary continuation (5-16 bytes, e.g.
  " in the rain."), so an SFT'd byte-level model writes English-ish endings.
- preferences.jsonl: ~1500 prompts with two continuations where the chosen one has a clearly
  larger fraction of vowel bytes (the task's reward): a third contrast vowel-rich with
  vowel-poor wording of similar length (" an eerie idea." vs " by dry myths."), a third pick
  two ordinary endings whose fractions differ by at least 0.15, so a reward model learns the
  gradations the policy will actually produce, and a third reject an answer that stops at
  once (" ." vs " via unique audio."), so the reward model does not prize stopping.
"""

from __future__ import annotations

import itertools
import json
import os
import random

from absl import app, flags

from rlhfjax import tasks

_TASK = flags.DEFINE_enum("task", "vowels", ["vowels", "arithmetic"], "The task to write.")
_OUT_DIR = flags.DEFINE_string(
  "out_dir",
  "",
  "Directory to write the task's JSONL files into; empty: rlhfjax/data/bundled/TASK.",
)

_SEED = 20240605
_NUM_DEMONSTRATIONS = 1500
_NUM_PREFERENCES = 1500

_VERBS = ("smiles", "sighs", "waits", "sings", "sleeps", "rests", "laughs", "hums", "nods")
_VERBS += ("stays", "waves", "goes home", "looks up", "listens")
_PLACES = ("the rain", "the sea", "the lake", "the trees", "the bridge", "dark", "noon")
_PLACES += ("dawn", "dusk", "lunch", "winter", "a storm", "the hill", "the door")
_ADVERBS = ("again", "today", "at night", "once more", "all day", "slowly", "quietly")
_ADVERBS += ("with joy", "with care", "for hours", "alone", "too", "at last", "every day")
_ADVERBS += ("in silence", "from afar", "for a while", "all summer", "at home")

# Vowel-rich and vowel-poor wording for the contrasting preference pairs.
_RICH_PREPS = ("via", "into", "above", "unto", "as")
_RICH_ADJS = ("eerie", "aerial", "ideal", "opaque", "unique", "audio", "aqueous", "oaken")
_RICH_NOUNS = ("idea", "aura", "area", "oboe", "queue", "aeon", "ode", "opera", "audio")
_POOR_PREPS = ("by", "thy", "past", "with", "till")
_POOR_ADJS = ("dry", "shy", "sly", "spry", "crisp", "strict", "dim", "dull")
_POOR_NOUNS = ("myths", "hymns", "lynx", "crypts", "glyphs", "nymphs", "rhythm", "gyms", "sky")


# Answers that stop at once: no vowel, so the task's reward is 0 (an empty one is not a record).
_CUT_SHORT = (".", "!", ",", " .", "...")


def vowel_fraction(text: str) -> float:
  """The task's reward of a response: the fraction of its bytes that are lowercase vowels."""
  data = text.encode("utf-8")
  return sum(b in b"aeiou" for b in data) / len(data)


def ordinary_endings() -> list[str]:
  """Short plain continuations, 5 to 16 bytes: ' and smiles.', ' in the rain.', ' again.'"""
  phrases = [f" and {v}" for v in _VERBS] + [f", then {v}" for v in _VERBS]
  phrases += [f" {p} {n}" for p in ("in", "by", "near", "under", "after") for n in _PLACES]
  phrases += [f" {a}" for a in _ADVERBS]
  endings = [p + end for p in phrases for end in (".", "!")]
  return sorted(e for e in endings if 5 <= len(e.encode()) <= 16)


def contrast_endings(preps, adjs, nouns) -> list[str]:
  """' {prep} {adjective} {noun}.' endings of one vowel register."""
  return sorted(f" {p} {a} {n}." for p, a, n in itertools.product(preps, adjs, nouns))


def similar_length_pairs(
  high: list[str], low: list[str], *, min_gap: float, max_len_gap: int
) -> list[tuple[str, str]]:
  """(chosen, rejected) pairs: chosen's vowel fraction exceeds rejected's by `min_gap`."""
  return [
    (h, lo)
    for h in high
    for lo in low
    if abs(len(h) - len(lo)) <= max_len_gap and vowel_fraction(h) - vowel_fraction(lo) >= min_gap
  ]


def make_demonstrations(rng: random.Random, prompts: list[str]) -> list[dict[str, str]]:
  endings = ordinary_endings()
  return [
    {"prompt": rng.choice(prompts), "response": rng.choice(endings)}
    for _ in range(_NUM_DEMONSTRATIONS)
  ]


def make_preferences(rng: random.Random, prompts: list[str]) -> list[dict[str, str]]:
  rich = contrast_endings(_RICH_PREPS, _RICH_ADJS, _RICH_NOUNS)
  poor = contrast_endings(_POOR_PREPS, _POOR_ADJS, _POOR_NOUNS)
  contrast = similar_length_pairs(rich, poor, min_gap=0.3, max_len_gap=2)
  ordinary = ordinary_endings()
  graded = similar_length_pairs(ordinary, ordinary, min_gap=0.15, max_len_gap=2)
  # A reward model never shown a (nearly) empty answer scores one as it likes, and PPO finds
  # that out fast: stopping at once is the easiest policy. These pairs say it is worth 0.
  cut_short = [(c, r) for c in rich + ordinary for r in _CUT_SHORT if vowel_fraction(c) > 0.3]
  kinds = (graded, contrast, cut_short)
  records = []
  for i in range(_NUM_PREFERENCES):
    chosen, rejected = rng.choice(kinds[i % 3])
    records.append({"prompt": rng.choice(prompts), "chosen": chosen, "rejected": rejected})
  return records


def write_jsonl(path: str, records: list[dict]) -> None:
  with open(path, "w", encoding="utf-8") as f:
    for record in records:
      f.write(json.dumps(record, ensure_ascii=False) + "\n")


def main(argv: list[str]) -> None:
  del argv
  bundled = os.path.join(os.path.dirname(__file__), "..", "rlhfjax", "data", "bundled")
  out_dir = os.path.normpath(_OUT_DIR.value or os.path.join(bundled, _TASK.value))
  os.makedirs(out_dir, exist_ok=True)
  if _TASK.value == "arithmetic":
    # The task's own generator (seeded): prompts.jsonl holds the demonstrated sums (the first
    # 50%), then the RL prompts SFT never sees, then the held-out ones (the last 10%).
    for kind, records in tasks.arithmetic_datasets().items():
      write_jsonl(os.path.join(out_dir, f"{kind}s.jsonl"), records)
    print(f"wrote the bundled 'arithmetic' datasets to {out_dir}")
    return
  rng = random.Random(_SEED)
  prompts = tasks.vowel_prompts()
  write_jsonl(os.path.join(out_dir, "prompts.jsonl"), [{"prompt": p} for p in prompts])
  write_jsonl(os.path.join(out_dir, "demonstrations.jsonl"), make_demonstrations(rng, prompts))
  write_jsonl(os.path.join(out_dir, "preferences.jsonl"), make_preferences(rng, prompts))
  print(f"wrote the bundled 'vowels' datasets to {out_dir}")


if __name__ == "__main__":
  app.run(main)
