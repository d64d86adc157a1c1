#!/usr/bin/env bash
# Everything a lent GPU should run, in one call that fits a short lease: the versions, the
# CUDA tests of tests/gpu (those one GPU can run; multi-GPU ones skip, naming the count), then
# benchmarks/mfu.py on the 1.2B GPT. Logs go to $OUT (or ./gpu-lease-out); the summary is printed last.
#
#   bash benchmarks/gpu_lease.sh            # on the GPU machine, from the repository root
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh

{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  python3 -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda,
"nccl", torch.cuda.nccl.version(), "transformers", transformers.__version__, torch.cuda.get_device_name())'
} 2>&1 | tee "$OUT/versions.txt"

# Each part under its own limit, so one hang still leaves the others' results.
timeout 150 python3 -m pytest tests/gpu -q -rs -p no:cacheprovider --timeout 140 2>&1 | tee "$OUT/tests_gpu.log" | tail -40
timeout 300 python3 benchmarks/mfu.py --steps 24 --skip-steps 8 --out-dir /tmp/mfu-runs 2>&1 | tee "$OUT/mfu.log" | tail -30
for layout in fsdp ddp; do  # the per-step records, for the write-up
  [ -f "/tmp/mfu-runs/$layout/metrics.jsonl" ] && cp "/tmp/mfu-runs/$layout/metrics.jsonl" "$OUT/mfu_$layout.jsonl"
done
echo "=== summary"
tail -3 "$OUT/tests_gpu.log"
tail -4 "$OUT/mfu.log"
