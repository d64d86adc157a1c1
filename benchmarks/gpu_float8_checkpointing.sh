#!/usr/bin/env bash
# float8 and activation checkpointing on one lent H100 or H200, in one call per part: the versions, the float8 and checkpointing CUDA
# tests of tests/gpu, then benchmarks/float8_checkpointing.py on the 1.5B Llama of benchmarks/vs_torchtitan.py.
# float8 needs torchao: put its wheel (a release in pyproject.toml's float8 range) in .whl/ beside the others
# gpu_env.sh installs. Logs go to $OUT (or ./gpu-lease-out); the tables are printed last.
#
#   bash benchmarks/gpu_float8_checkpointing.sh float8          # bf16 against float8, 300 steps each (~6 min)
#   bash benchmarks/gpu_float8_checkpointing.sh checkpointing   # none (the bf16 run) / selective / full (~5 min)
#   bash benchmarks/gpu_float8_checkpointing.sh all             # both and the tests (~12 min: over one 10-minute call)
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
part="${1:-all}"

{
  nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv
  python3 -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda,
"transformers", transformers.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_capability())'
  python3 -c 'import torchao; print("torchao", torchao.__version__)' \
    || echo "torchao is missing: float8 runs will be refused (put its wheel in .whl/)"
} 2>&1 | tee "$OUT/versions.txt"

case "$part" in
  float8) runs="bf16,float8-tensorwise" ;;
  checkpointing) runs="bf16,selective,full"; loss_steps=(--loss-steps 30) ;;
  all) runs="bf16,float8-tensorwise,selective,full" ;;
  *) echo "usage: $0 [float8|checkpointing|all]" >&2; exit 2 ;;
esac
if [ "$part" = all ]; then
  timeout 240 python3 -m pytest tests/gpu -q -rs -p no:cacheprovider --timeout 200 -k "float8 or selective" 2>&1 \
    | tee "$OUT/tests_gpu.log" | tail -20
fi
timeout "${FLOAT8_TIMEOUT:-570}" python3 benchmarks/float8_checkpointing.py --runs "$runs" ${loss_steps[@]+"${loss_steps[@]}"} \
  --out-dir /tmp/float8-ckpt 2>&1 | tee "$OUT/float8_checkpointing.log" | tail -12
for run in ${runs//,/ }; do
  [ -f "/tmp/float8-ckpt/$run/metrics.jsonl" ] && cp "/tmp/float8-ckpt/$run/metrics.jsonl" "$OUT/$run.jsonl"
done
echo "=== summary"
grep -E "^(device|bf16|float8|checkpointing)" "$OUT/float8_checkpointing.log"
