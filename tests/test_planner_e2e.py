"""`scripts/plan_placement.py` as a user runs it: the plans as JSON and the winner's predicted
timeline, and bad input or meaningless flags in one line."""

import json

import pytest
from runs_testing import run_plan_placement

from rlhfjax.observe.timeline import Timeline

pytestmark = pytest.mark.e2e


def test_plan_placement_script_json(tmp_path):
  out = run_plan_placement(
    "--actor=7b",
    "--critic=7b",
    "--reward=7b",
    "--hardware=a800",
    "--devices=8",
    "--prompts=1024",
    "--prompt_len=1024",
    "--response_len_mean=512",
    "--response_len_max=1024",
    "--json",
    f"--timeline={tmp_path}",
    check=True,
  )
  plans = [json.loads(line) for line in out.stdout.splitlines()]
  assert len(plans) > 10
  for key in ("strategy", "iteration_s", "stages", "peak_memory_gb", "tokens_per_s_per_device"):
    assert key in plans[0]
  assert plans[0]["fits"] is True
  assert set(plans[0]["stages"]) == {"generate", "score", "advantages", "update", "sync"}
  # The winner's predicted timeline, in the measured timeline.json's format.
  records = Timeline.read_json(str(tmp_path / "timeline.json"))
  steady = [r for r in records if r.iteration == 3]
  span = max(r.end for r in steady) - min(r.start for r in steady)
  assert span == pytest.approx(plans[0]["iteration_s"], rel=1e-3)
  assert (tmp_path / "timeline.png").stat().st_size > 0


def test_plan_placement_script_places_and_prices_extra_roles():
  """`--extra_roles`: a second reward model on 4 devices of its own, tensor 2, and a judge on
  the reward's devices are in every plan's meshes and memory; the judge's stage is its
  verdicts' generation (`--judge_new_tokens`), which more tokens make longer."""

  def plans(tokens):
    out = run_plan_placement(
      "--actor=7b",
      "--hardware=h100",
      "--devices=16",
      "--prompts=256",
      "--extra_roles=reward2:reward:1b:own:4:2,critic_llm:judge:1b",
      f"--judge_new_tokens={tokens}",
      "--strategy=colocated",
      "--json",
      check=True,
    )
    return [json.loads(line) for line in out.stdout.splitlines()]

  short, long = plans(4), plans(64)
  best = short[0]
  assert best["mesh"]["reward2"] == {"data": 1, "fsdp": 2, "tensor": 2}
  assert "critic_llm" in best["mesh"] and best["fits"]
  # The same winner scores longer with longer verdicts.
  assert long[0]["label"] == best["label"]
  assert long[0]["stages"]["score"] > best["stages"]["score"]


def test_plan_placement_script_prices_conversations():
  """`--turns` with the environment's tokens and its step's seconds: the table's title says
  so; one worker's steps (4 turns of 1024 conversations at 0.5 s each, one after another)
  dominate generation, and 64 workers at once take a small part of that."""

  def table(workers):
    out = run_plan_placement(
      "--actor=7b", "--algorithm=grpo", "--hardware=h100", "--devices=8", "--prompts=128",
      "--samples_per_prompt=8", "--continuous_batching", "--turns=4", "--observation_tokens=300",
      "--environment_s=0.5", f"--environment_workers={workers}", "--strategy=colocated",
      "--top=1", check=True,
    )  # fmt: skip
    title, head, best = out.stdout.splitlines()[:3]
    assert f"in 4 turns (300 of them the environment's, 0.5 s a step, {workers} at once)" in title
    # The columns after the groups (whose cells hold spaces).
    names = ("mb", "generate", "score", "advantages", "update", "sync", "iter s", "tok/s/dev")
    assert all(name in head for name in names)
    return dict(zip((*names, "peak"), map(float, best.split()[-9:]), strict=True))

  one, many = table(1), table(64)
  assert one["generate"] > 1024 * 4 * 0.5  # the steps one after another, and the decoding
  assert many["generate"] < one["generate"] / 10
  assert many["update"] == pytest.approx(one["update"])  # the same placement's other stages


def test_plan_placement_script_bad_input_is_one_line():
  out = run_plan_placement("--actor=8q")
  assert out.returncode == 2
  assert out.stderr.strip().startswith("error: model '8q' is neither a size")
  assert len(out.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
  ("args", "message"),
  [
    (["--fusion", "--tail_fraction=-1"], "--tail_fraction must be in (0, 0.5), got -1.0"),
    (["--fusion", "--tail_ratio=0.5"], "--tail_ratio must be > 1, got 0.5"),
    (["--devices_per_node=0"], "--devices_per_node must be >= 1, got 0"),
    (["--actor=BAD/hidden_str.json"], "BAD/hidden_str.json: 'hidden_size' must be a whole"),
    (["--actor=BAD/list.json"], "BAD/list.json: a model config must be a JSON object, got list"),
    (
      ["--extra_roles=r2:reward:tiny:own:x"],
      "--extra_roles: 'r2': DEVICES and TENSOR must be whole numbers",
    ),
    (
      ["--extra_roles=j1:judge:tiny,j2:judge:tiny"],
      "--extra_roles: one judge at most (reward.judge names one)",
    ),
    (["--turns=0.5"], "--turns=0.5 --observation_tokens=0.0 --environment_s=0.0"),
    (["--fusion", "--turns=2"], "--fusion predicts one answer per prompt: drop --turns"),
  ],
  ids=[
    "tail_fraction",
    "tail_ratio",
    "devices_per_node",
    "string_field",
    "json_list",
    "extra_devices",
    "two_judges",
    "turns",
    "fusion_turns",
  ],
)
def test_plan_placement_refuses_meaningless_flags_and_model_files(tmp_path, args, message):
  (tmp_path / "hidden_str.json").write_text(json.dumps({"hidden_size": "4096"}))
  (tmp_path / "list.json").write_text("[1, 2]")
  args = [a.replace("BAD", str(tmp_path)) for a in args]
  out = run_plan_placement("--actor=tiny", *args)
  assert out.returncode == 2, out.stderr
  assert out.stderr.startswith("error: " + message.replace("BAD", str(tmp_path))), out.stderr
  assert len(out.stderr.strip().splitlines()) == 1
