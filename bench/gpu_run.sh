#!/usr/bin/env bash
# The GPU machine's run, from the repository root: installs this checkout beside the
# machine's own torch (the wheels it lacks carried in .whl/), runs the system tests with
# their servers on CUDA (FERRUM_TEST_DEVICE=cuda), after bench.gpu_decode.  Logs and
# results go to $OUT (default /tmp/gpu-run).
#   bash bench/gpu_run.sh [tests|bench|all] [pytest selection...]
set -uo pipefail
OUT=${OUT:-/tmp/gpu-run}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
what=${1:-all}
shift || true
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  lscpu | grep -E "^(Model name|CPU\(s\))"
} > "$OUT/env.txt" 2>&1
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps .whl/*.whl || exit 1; fi
python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1
python3 -c "import torch, grpc, google.protobuf as p, transformers as t
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'grpc', grpc.__version__, 'protobuf', p.__version__,
      'transformers', t.__version__, torch.cuda.get_device_name())" >> "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
python3 -c "from ferrum_rpc.server.kernels import build; print(build.build_extension())" > "$OUT/build.txt" 2>&1 \
  || echo "CPU kernels not built (see build.txt)"
if [ "$what" = bench ] || [ "$what" = all ]; then
  timeout "${BENCH_TIMEOUT:-300}" python3 -m bench.gpu_decode --out "$OUT/gpu_decode.json" ${BENCH_ARGS:-} \
    > "$OUT/bench.txt" 2>&1
  echo "bench: rc $?"
  grep -E "bench:|captur|WARNING|Error" "$OUT/bench.txt" | tail -30
  sed -n '/^decode-only/,$p' "$OUT/bench.txt" | tail -12
fi
if [ "$what" = tests ] || [ "$what" = all ]; then
  FERRUM_TEST_DEVICE=cuda timeout "${TESTS_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider -n "${WORKERS:-8}" \
    --timeout 120 -rfE --tb=short "${@:-tests/system}" > "$OUT/tests.txt" 2>&1
  echo "tests: rc $?"
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.txt" | tail -40
fi
