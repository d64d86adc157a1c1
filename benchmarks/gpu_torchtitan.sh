#!/usr/bin/env bash
# paratrain against torchtitan on one lent GPU, in one call: the versions, then benchmarks/vs_torchtitan.py
# (torchtitan's Llama 3 1B, then paratrain's transformers Llama of the same shape, back to back). The
# wheels torchtitan needs beyond the GPU image travel in .whl/ (docs/benchmarks.md lists them). Logs go to
# $OUT (or ./gpu-lease-out); the comparison's table is printed last.
#
#   bash benchmarks/gpu_torchtitan.sh       # on the GPU machine, from the repository root
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh

{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  python3 -c 'import torch, transformers, torchtitan; print("torch", torch.__version__, "cuda", torch.version.cuda,
"transformers", transformers.__version__, "torchtitan", torchtitan.__version__, torch.cuda.get_device_name())'
} 2>&1 | tee "$OUT/versions.txt"

timeout "${VS_TITAN_TIMEOUT:-420}" python3 benchmarks/vs_torchtitan.py --out-dir /tmp/vs-titan "$@" 2>&1 \
  | tee "$OUT/vs_torchtitan.log" | tail -12
for name in torchtitan.log paratrain-single.log paratrain-fsdp.log; do
  [ -f "/tmp/vs-titan/$name" ] && cp "/tmp/vs-titan/$name" "$OUT/$name"
done
for layout in single fsdp; do [ -f "/tmp/vs-titan/paratrain-$layout/metrics.jsonl" ] && cp "/tmp/vs-titan/paratrain-$layout/metrics.jsonl" "$OUT/paratrain_$layout.jsonl"; done
echo "=== summary"
tail -5 "$OUT/vs_torchtitan.log"
