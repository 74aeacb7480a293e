#!/usr/bin/env bash
# The checks that need a CUDA GPU, most telling first, each under its own time limit so one
# short lease gets them all (CI has no GPU; run this by hand on a CUDA machine whose Python
# already has torch and the engine's dependencies: GPU images ship their own torch, so no .venv
# is made here):
#   1. the tests that compare the engine's tokens on `cuda` with transformers' and with its own
#      eager path: CUDA-graph decode steps, parity, chunked prefill, preemption, a checkpoint
#      whose embedding is padded past its tokenizer (as released ones are);
#   2. decode steps, graphs against eager, on the bench checkpoint (benchmarks.decode_graphs);
#   3. offline throughput against transformers' generate(), bench checkpoint;
#   4. the same two on a Qwen2-VL-2B-shaped checkpoint (make-model --preset 2b, made there).
#   5. the rest of the engine suite, in the time left.
# If the graph tests fail, the benchmarks run with --enforce-eager. FULL=1 adds the server suite
# (it needs fastapi, uvicorn, openai... on that Python).
#
#   bash scripts/gpu_check.sh [OUT_DIR]      # logs and JSON land in OUT_DIR
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-results/gpu}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export VISION_SERVE_TEST_DEVICE=cuda
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
py=${PYTHON:-python3}
log="$out/gpu_check.log"

$py - <<'EOF' 2>&1 | tee "$log" || exit 1
import torch, transformers
assert torch.cuda.is_available(), "no CUDA device"
print("torch", torch.__version__, "transformers", transformers.__version__, torch.cuda.get_device_name())
EOF

# every stage's limit is cut to what is left of BUDGET_S (a device lease is short): the last
# stages get what the first left, and are skipped under 20 s
deadline=$((SECONDS + ${BUDGET_S:-560}))
limit() {
    local left=$((deadline - SECONDS))
    [ "$left" -ge 20 ] || { echo "gpu_check: no time left for: ${*:2}" | tee -a "$log"; return 1; }
    timeout $(( $1 < left ? $1 : left )) "${@:2}"
}

status=0
eager=()
limit "${TESTS_TIMEOUT:-170}" $py -m pytest -q -p no:cacheprovider --timeout 120 -x \
    tests/engine/test_cuda_graphs.py tests/engine/test_parity_with_transformers.py \
    tests/engine/test_chunked_prefill.py tests/engine/test_preemption_and_caches.py \
    tests/test_checkpoints.py::test_padded_vocab_checkpoint 2>&1 | tee "$out/tests.log" \
    || { status=1; eager=(--enforce-eager); }

if [ ${#eager[@]} -eq 0 ]; then
    limit "${GRAPHS_TIMEOUT:-120}" $py -m benchmarks.decode_graphs --batches 1 4 16 64 \
        --contexts 64 1200 --out "$out/decode_graphs_bench.json" 2>&1 | tee -a "$log" || status=1
fi
limit "${BENCH_TIMEOUT:-120}" $py -m benchmarks.offline_throughput --device cuda "${eager[@]}" \
    --num-requests 16 --max-tokens 256 --hf-requests 2 \
    --out "$out/offline_bench.json" 2>&1 | tee -a "$log" || status=1

if [ "${SKIP_2B:-0}" != 1 ]; then
    ckpt=checkpoints/2b-qwen2_vl
    # make-model's own function: vision_serve's CLI would import the server's dependencies
    [ -f $ckpt/config.json ] || limit "${MAKE_2B_TIMEOUT:-150}" $py -c \
        "from engine.checkpoints import make_model; make_model('qwen2_vl', '2b', '$ckpt')" \
        2>&1 | tee -a "$log" || status=1
    limit "${BENCH_2B_TIMEOUT:-150}" $py -m benchmarks.offline_throughput --device cuda \
        "${eager[@]}" --model $ckpt --num-requests 16 --max-tokens 256 --hf-requests 2 \
        --out "$out/offline_2b.json" 2>&1 | tee -a "$log" || status=1
    if [ ${#eager[@]} -eq 0 ]; then
        limit "${GRAPHS_2B_TIMEOUT:-90}" $py -m benchmarks.decode_graphs --model $ckpt \
            --batches 1 16 64 --contexts 1200 --rounds 1 \
            --out "$out/decode_graphs_2b.json" 2>&1 | tee -a "$log" || status=1
    fi
fi

# the rest of the engine suite in what time is left (the CPU kernels' tests say nothing here)
limit "${ENGINE_TESTS_TIMEOUT:-240}" $py -m pytest -q -p no:cacheprovider --timeout 60 \
    --continue-on-collection-errors tests/engine --deselect tests/engine/test_cpu_decode_kernel.py 2>&1 \
    | tee "$out/engine_tests.log" || status=1
if [ "${FULL:-0}" = 1 ]; then
    limit "${SERVER_TESTS_TIMEOUT:-150}" $py -m pytest -q -p no:cacheprovider --timeout 60 \
        tests/server --deselect tests/server/test_native_kernels.py \
        --deselect tests/server/test_ultralytics_llm.py 2>&1 | tee "$out/server_tests.log" \
        || status=1
fi
exit $status
