#!/usr/bin/env bash
# The open issues' GPU checks as one run, for a session lent a GPU (15 minutes of device time in
# all, docs/benchmarks.md "Open GPU checks"): every check is one command under its own time
# limit, in the order of what each issue still waits for, its JSON lines (or its run's
# metrics.jsonl and timeline.json) left under the output folder with its log.
#
#   bash scripts/gpu_checks.sh OUT            # on the GPU machine: OUT is $OUT there
#   SMOKE=1 bash scripts/gpu_checks.sh OUT    # on a CPU: the same commands at the tiny size
#
# A check that fails or runs out of time is reported and the next one runs. About 11 minutes of
# limits on a GPU; SMOKE=1 takes about 4 minutes on the 2-core development machine.
set -uo pipefail
out=${1:?usage: bash scripts/gpu_checks.sh OUT}
mkdir -p "$out"
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo" || exit 1
python=${PYTHON:-python3}
# The repository itself, not an installed copy: the device machine installs nothing.
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

if [ "${SMOKE:-0}" = 1 ]; then
  size=tiny llama=tiny new_tokens=16 batch=8 seq=256 cache=512
  export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=1"
else
  size=1b llama=configs/hf/llama-3.1-8b new_tokens=512 batch=64 seq=8192 cache=2048
fi

# check NAME LIMIT_S COMMAND...: runs COMMAND with its output in OUT/NAME.jsonl (stdout) and
# OUT/NAME.log (stderr), and says how it ended.
check() {
  local name=$1 limit=$2 start=$SECONDS
  shift 2
  echo "+ $name (limit ${limit} s): $*"
  timeout --kill-after=10 "$limit" "$@" >"$out/$name.jsonl" 2>"$out/$name.log"
  local rc=$?
  echo "$name: exit $rc in $((SECONDS - start)) s"
  [ "$rc" = 0 ] || tail -5 "$out/$name.log"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$out/device.txt" 2>&1
"$python" -c "import jax; print(jax.__version__, jax.devices())" >>"$out/device.txt" 2>&1

# Issue 44 (one engine at the roofline): the decode step of the 1B model at batch 64 and 256
# and of Llama-3.1-8B's shape (random bf16 weights) at 128, after the card's copy bandwidth and
# matmul rate (the targets are fractions of the measured copy bandwidth).
check decode_1b 150 "$python" scripts/bench_gpu.py --size="$size" --remat= --nocheck \
  --decode_batch=64,256 --paged_kernels=auto,gather --cache_len="$cache"
check decode_8b 150 "$python" scripts/bench_gpu.py --size="$llama" --remat= --nocheck \
  --noceilings --decode_batch=128 --paged_kernels=auto --cache_len="$cache"

# Issues 41 (the profile's MFU) and 39 (the packed attention kernel against XLA's): the 1B
# train step at 4k and 8k tokens with and without remat, and with both kernels at 8k and 16k,
# each row with its program's memory from XLA's analysis.
check train_4k 120 "$python" scripts/bench_gpu.py --size="$size" --noceilings --nocheck \
  --decode_batch= --seq_len=$((seq / 2)) --batch=4 --remat=none,full
check train_8k 150 "$python" scripts/bench_gpu.py --size="$size" --noceilings --nocheck \
  --decode_batch= --seq_len="$seq" --batch=2 --remat=none,full --attention=auto,xla
check train_16k 120 "$python" scripts/bench_gpu.py --size="$size" --noceilings --nocheck \
  --decode_batch= --seq_len=$((seq * 2)) --batch=1 --remat=full --attention=auto,xla

# Issues 38 (trusted updates) and 40 (LoRA): 1B GRPO iterations on the paged engine with a
# bf16 rollout: fp32 masters with 'tis' (logprob_mismatch/k3 and /max in metrics.jsonl), pure
# bf16 (the iteration time against fp32 masters), and adapters of rank 16 over the same base
# (time per stage, sync/bytes).
grpo() {
  local name=$1
  shift
  check "$name" 180 "$python" scripts/train.py --config=configs/grpo_tiny.py \
    --workdir="$out/$name" --config.model.size="$size" --config.placement.num_devices=1 \
    --config.placement.rollout_tensor=1 --config.total_steps=3 --config.eval.num_prompts=0 \
    --config.rollout.batch_size="$batch" --config.rollout.max_new_tokens="$new_tokens" \
    --config.checkpoint.every_steps=0 "$@"
}
grpo grpo_fp32_masters_tis --config.model.roles.rollout.param_dtype=bfloat16 \
  --config.ppo.rollout_correction=tis
grpo grpo_pure_bf16 --config.model.param_dtype=bfloat16 --config.ppo.rollout_correction=tis
grpo grpo_lora --config.model.roles.rollout.param_dtype=bfloat16 \
  --config.ppo.rollout_correction=tis --config.model.lora.rank=16
echo "done: $out"
