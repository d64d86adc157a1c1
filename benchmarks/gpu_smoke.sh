#!/usr/bin/env bash
# The CUDA checks paratrain's CPU test suite cannot run (issue 15), for a machine with a GPU:
#   bash benchmarks/gpu_smoke.sh [OUT_DIR]
# Each check is a short `paratrain` run of the quickstart GPT on the GPU(s) (one process per GPU for
# the multi-process layouts); a table of pass/fail is printed at the end. Exit 1 if any check failed,
# 2 if no CUDA device is visible. Every check takes well under a few minutes; the whole under 20.
# SMOKE_DEVICE=cpu SMOKE_PROCS=2 runs the same checks on CPU with gloo: a check of this script itself,
# not of any GPU path.
set -uo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-.venv/bin/python}
OUT=${1:-$(mktemp -d /tmp/gpu_smoke.XXXXXX)}
STEPS=20
mkdir -p "$OUT"
declare -a NAMES RESULTS

DEVICE=${SMOKE_DEVICE:-cuda}
if [[ $DEVICE == cuda ]] && ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "gpu_smoke: no CUDA device visible to $PYTHON (torch.cuda.is_available() is False); run it on a GPU machine" >&2
  exit 2
fi
GPUS=${SMOKE_PROCS:-$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')}

# A run of the quickstart on cuda: train NAME [overrides...] (extra `--...` options go to paratrain).
train() {
  local name=$1
  shift
  timeout 300 "$PYTHON" -m paratrain.cli train examples/quickstart.yaml "train.device=$DEVICE" \
    "train.max_steps=$STEPS" "run.output_dir=$OUT/$name" "$@" >"$OUT/$name.log" 2>&1
}

# Checks one finished run: exit 0, and every logged loss finite.
losses_finite() {
  "$PYTHON" - "$OUT/$1/metrics.jsonl" <<'EOF'
import json, math, sys
losses = [json.loads(line)["loss"] for line in open(sys.argv[1])]
sys.exit(0 if losses and all(loss is not None and math.isfinite(loss) for loss in losses) else 1)
EOF
}

check() {
  local name=$1
  shift
  local started=$SECONDS
  "$@"
  case $? in
    0) RESULTS+=("pass") ;;
    3) RESULTS+=("skipped: GPU only") ;;
    *) RESULTS+=("FAIL (logs in $OUT)") ;;
  esac
  NAMES+=("$name ($((SECONDS - started)) s)")
}

run_and_check() {
  local name=$1
  shift
  train "$name" "$@" && losses_finite "$name"
}

single_bf16() { run_and_check single-bf16 parallel.strategy=single precision=bf16; }
single_fp16() { run_and_check single-fp16 parallel.strategy=single precision=fp16; }
ddp_bf16() { run_and_check ddp-bf16 parallel.strategy=ddp precision=bf16 --nproc-per-node "$GPUS"; }
ddp_fp16() { run_and_check ddp-fp16 parallel.strategy=ddp precision=fp16 --nproc-per-node "$GPUS"; }
fsdp_bf16() {
  run_and_check fsdp-bf16 parallel.strategy=fsdp precision=bf16 parallel.fsdp.param_dtype=bf16 --nproc-per-node "$GPUS"
}
fsdp_fp16() { run_and_check fsdp-fp16 parallel.strategy=fsdp precision=fp16 --nproc-per-node "$GPUS"; }
compile_fsdp() { run_and_check compile parallel.strategy=fsdp precision=bf16 parallel.compile=true --nproc-per-node "$GPUS"; }
activation_checkpointing() {
  run_and_check activation-checkpointing parallel.strategy=fsdp parallel.activation_checkpointing=true --nproc-per-node "$GPUS"
}
cpu_offload() {
  [[ $DEVICE == cuda ]] || return 3 # preflight refuses offloading on a CPU run
  run_and_check cpu-offload parallel.strategy=fsdp parallel.fsdp.cpu_offload=true --nproc-per-node "$GPUS"
}
async_checkpoints() {
  run_and_check async-checkpoints checkpoint.async_save=true checkpoint.every_steps=5 --nproc-per-node "$GPUS" &&
    test -f "$OUT/async-checkpoints/checkpoints/step-$STEPS/paratrain-manifest.json"
}

# Killed after step 12 (checkpoints every 5), resumed by checkpoint.resume=auto, against an uninterrupted
# run: final weights bit for bit, under train.deterministic.
kill_and_resume() {
  local common=(parallel.strategy=ddp train.deterministic=true checkpoint.every_steps=5 --nproc-per-node "$GPUS")
  train kill-reference "${common[@]}" || return 1
  PARATRAIN_FAULT="after_step:12:0" train kill-resume "${common[@]}" && return 1 # the kill must end the run
  train kill-resume "${common[@]}" checkpoint.resume=auto || return 1
  "$PYTHON" - "$OUT/kill-reference" "$OUT/kill-resume" "$STEPS" <<'EOF'
import sys
import torch
from tests.harness import checkpoint_weights
reference, resumed, steps = sys.argv[1], sys.argv[2], sys.argv[3]
a = checkpoint_weights(f"{reference}/checkpoints/step-{steps}")
b = checkpoint_weights(f"{resumed}/checkpoints/step-{steps}")
sys.exit(0 if a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a) else 1)
EOF
}

# A NaN injected into the gradients at step 5 under fsdp: with train.nonfinite=stop the run ends with exit
# code 3 (on a GPU the fused optimizer skips the step on the device and the loop reads the verdict a step
# late); with skip it finishes and logs one skipped step.
nonfinite_guard() {
  PARATRAIN_FAULT="nan_grad:5" train nonfinite-stop parallel.strategy=fsdp train.nonfinite=stop \
    checkpoint.every_steps=4 --nproc-per-node "$GPUS"
  [[ $? == 3 ]] || return 1
  PARATRAIN_FAULT="nan_grad:5" train nonfinite-skip parallel.strategy=fsdp train.nonfinite=skip --nproc-per-node "$GPUS" &&
    grep -q '"skipped_steps": 1' "$OUT/nonfinite-skip/metrics.jsonl"
}

profiler_memory_snapshot() {
  run_and_check profiler parallel.strategy=single profile.enabled=true profile.memory_snapshot=true &&
    ls "$OUT/profiler/profile/" | grep -q .
}

verify() {
  timeout 600 "$PYTHON" -m paratrain.cli verify examples/quickstart.yaml "train.device=$DEVICE" \
    parallel.strategy=fsdp "run.output_dir=$OUT/verify" --nproc-per-node "$GPUS" >"$OUT/verify.log" 2>&1
}

echo "gpu_smoke: $DEVICE, $GPUS process(es) per layout, $("$PYTHON" -c 'import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU", "torch", torch.__version__, "cuda", torch.version.cuda)'); logs in $OUT"
for name in single_bf16 single_fp16 ddp_bf16 ddp_fp16 fsdp_bf16 fsdp_fp16 compile_fsdp activation_checkpointing \
  cpu_offload async_checkpoints kill_and_resume nonfinite_guard profiler_memory_snapshot verify; do
  check "$name" "$name"
done

failed=0
printf '\n| check | result |\n|---|---|\n'
for i in "${!NAMES[@]}"; do
  printf '| %s | %s |\n' "${NAMES[$i]}" "${RESULTS[$i]}"
  [[ ${RESULTS[$i]} == FAIL* ]] && failed=1
done
exit $failed
