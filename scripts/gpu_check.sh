#!/usr/bin/env bash
# The checks that need a CUDA GPU: the engine and server test suites against an engine on
# `cuda` (the transformers reference runs there too), then the offline throughput benchmark on
# the GPU. CI has no GPU; run this by hand on a CUDA machine whose Python already has torch and
# the project's dependencies (GPU images ship their own torch, so no .venv is made here).
#
#   bash scripts/gpu_check.sh [OUT_DIR]      # logs and the benchmark JSON land in OUT_DIR
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-results/gpu}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export VISION_SERVE_TEST_DEVICE=cuda
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
py=${PYTHON:-python3}

$py - <<'EOF' || exit 1
import torch, transformers
assert torch.cuda.is_available(), "no CUDA device"
print("torch", torch.__version__, "transformers", transformers.__version__, torch.cuda.get_device_name())
EOF

status=0
# The CPU kernels' own tests and the server test of them say nothing about CUDA.
timeout "${ENGINE_TESTS_TIMEOUT:-240}" $py -m pytest -q -p no:cacheprovider --timeout 120 \
    tests/engine tests/test_checkpoints.py \
    --deselect tests/engine/test_cpu_decode_kernel.py 2>&1 | tee "$out/engine_tests.log" || status=1

timeout "${BENCH_TIMEOUT:-200}" $py -m benchmarks.offline_throughput --device cuda \
    --num-requests "${BENCH_REQUESTS:-16}" --max-tokens 256 --hf-requests 2 \
    --out "$out/offline_throughput_cuda.json" 2>&1 | tee "$out/bench.log" || status=1

timeout "${SERVER_TESTS_TIMEOUT:-150}" $py -m pytest -q -p no:cacheprovider --timeout 60 \
    tests/server --deselect tests/server/test_native_kernels.py \
    --deselect tests/server/test_ultralytics_llm.py 2>&1 | tee "$out/server_tests.log" || status=1
exit $status
