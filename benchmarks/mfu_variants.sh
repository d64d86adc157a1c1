#!/usr/bin/env bash
# The MFU tuning runs on one GPU, back to back in one call: benchmarks/mfu.py's 1.2B GPT under
# each variant, 60 steps (steps 1-10 left out); logs go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh

mfu() {  # name, then mfu.py arguments
  local name=$1; shift
  echo "=== $name"
  timeout 120 python3 benchmarks/mfu.py --steps 60 --skip-steps 10 --out-dir "/tmp/mfu-$name" "$@" 2>&1 | tail -4 | tee "$OUT/$name.txt"
}
mfu fsdp-mb4 --layouts fsdp
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True mfu fsdp-mb4-expandable --layouts fsdp
mfu fsdp-mb4-no-reshard --layouts fsdp --set parallel.fsdp.reshard_after_forward=false
mfu fsdp-mb8 --layouts fsdp --set train.micro_batch_size=8 --set train.global_batch_size=8
mfu ddp-mb8 --layouts ddp --set train.micro_batch_size=8 --set train.global_batch_size=8
cp /tmp/mfu-fsdp-mb4/fsdp/metrics.jsonl "$OUT/fsdp-mb4.jsonl" 2>/dev/null
cp /tmp/mfu-fsdp-mb4-expandable/fsdp/metrics.jsonl "$OUT/fsdp-mb4-expandable.jsonl" 2>/dev/null
echo "=== summary"; for f in "$OUT"/*.txt; do echo "$(basename "$f" .txt): $(grep -E '^(fsdp|ddp):' "$f")"; done
