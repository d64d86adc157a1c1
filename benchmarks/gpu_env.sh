# Sourced by the GPU lease scripts (gpu_lease.sh, mfu_variants.sh), from the repository root: makes
# paratrain importable on the GPU machine's image, which has torch but not pydantic. Wheels downloaded
# here into .whl/ (docs/benchmarks.md) are installed first when present; paratrain itself goes in without
# touching the image's packages (its version ranges are read from its metadata).
export PYTHONUNBUFFERED=1
OUT="${OUT:-gpu-lease-out}"
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
  || export PYTHONPATH="$PWD:${PYTHONPATH:-}"
