#!/usr/bin/env bash
# The GPU measurements still open, in one call that fits a 15-minute lease, most wanted first, each part
# under its own limit so that a slow one still leaves the others' results:
#   1. packed against padded chat fine-tuning, and attention within documents, on the GPU (bf16 autocast:
#      the variable-length flash call, not yet timed on a GPU), and that call's test against float32;
#   2. float8 (tensorwise, rowwise) against bf16 on Llama 3 8B's layers (width 4096, 6 layers), 40 steps each:
#      whether wider matmuls reach 1.2 x (the 1.5B's width-2048 ones gave 1.128 x on an H100);
#   3. start-up and tokens/s against torchtitan (torchtitan, then paratrain fsdp), with milestones.
# The limits (70 + 40 + 260 + 110 s) and the set-up fill one 10-minute call, which a 15-minute lease holds.
# Wheels the image lacks travel in .whl/ (gpu_env.sh installs them). Run on 2026-11-27 with: pydantic 2.14.4,
# pydantic-core 2.50.5, annotated-types 0.8.0, typing-inspection 0.4.5, torchao 0.17.0, torchtitan 0.2.2,
# torchdata 0.11.0, datasets 4.7.0, dill 0.4.0, multiprocess 0.70.18, tyro 1.0.17, docstring-parser 0.18.0,
# typeguard 4.6.1, tomli 2.5.0, pytest 9.2.0, pluggy 1.7.0, iniconfig 2.3.1 (fetched by `pip download --no-deps
# --only-binary=:all: --python-version 3.12`).
# Logs go to $OUT (or ./gpu-lease-out); each part's table is printed at its end.
#
#   bash benchmarks/gpu_open_items.sh          # on the GPU machine, from the repository root
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
started=$SECONDS

{
  nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv
  python3 -c 'import torch, transformers, torchao, torchtitan; print("torch", torch.__version__, "cuda", torch.version.cuda,
"transformers", transformers.__version__, "torchao", torchao.__version__, "torchtitan", torchtitan.__version__,
torch.cuda.get_device_name(), torch.cuda.get_device_capability())' 2>&1 | grep -v -i -E "warn|failed to load"
} 2>&1 | tee "$OUT/versions.txt"

part() {  # part NAME LIMIT COMMAND...: runs COMMAND under LIMIT seconds, its output in $OUT/NAME.log
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit} s, at $((SECONDS - started)) s)"
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  echo "exit $? after $((SECONDS - started)) s"
  tail -n 9 "$OUT/$name.log" | cut -c1-400
}

# The shape measured on 2026-11-27 (packed 0.06 x padded with cuDNN's attention, 1.37 x without), to compare.
part packing "${PACKING_LIMIT:-70}" python3 benchmarks/packing.py --device cuda --width 1024 --layers 4 --rows 4 --steps 10 \
  --samples 300
part varlen_test "${TEST_LIMIT:-40}" python3 -m pytest -q -p no:cacheprovider tests/gpu/test_on_cuda.py -k variable_length
part float8 "${FLOAT8_LIMIT:-260}" python3 benchmarks/float8_checkpointing.py --shape wide --micro-batch 4 \
  --runs bf16,float8-tensorwise,float8-rowwise --loss-steps 40 --skip-steps 10 --out-dir /tmp/f8
part vs_torchtitan "${TITAN_LIMIT:-110}" python3 benchmarks/vs_torchtitan.py --runs torchtitan,paratrain-fsdp \
  --steps 16 --skip-steps 8 --out-dir /tmp/titan

# The runs' per-step records and stamped logs, for the write-up (at most 8 files come back).
for run in bf16 float8-tensorwise float8-rowwise; do echo "# $run"; cat "/tmp/f8/$run/metrics.jsonl"; done >"$OUT/loss_runs.jsonl" 2>/dev/null
cat /tmp/titan/torchtitan.log /tmp/titan/paratrain-fsdp.log >"$OUT/startup_logs.txt" 2>/dev/null
echo "=== done after $((SECONDS - started)) s"
