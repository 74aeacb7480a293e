#!/usr/bin/env bash
# Set up a fresh machine and run the test suite (lint included). `.ci/run` calls this.
#
# Two tiers. Locally the default run skips tests marked `slow` (fault injection with real
# processes, fuzzing, the 64-client load test, the benchmark scripts, the two-replica failover,
# and every test on the trained person detector, whose first build on a machine takes 4-7
# minutes): under 10 minutes on 2 cores. In CI (the `CI` variable set, as every CI system does) or with VS_TEST_TIER=all,
# everything runs (16-22 minutes of pytest, 20-29 with setup on a 2-core AVX2 EPYC), and on a
# wider CPU the engine's tests once more as an AVX2-only box runs them (below). Extra arguments
# go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 YOLO_OFFLINE=1 YOLO_AUTOINSTALL=False
ruff format --check .
ruff check .
tier=${VS_TEST_TIER:-$([ -n "${CI:-}" ] && echo all || echo fast)}
# Kernel variants this CPU does not run must still compile (the AVX-512 ones on an AVX2-only
# CPU). The compiler runs beside the tests, which spend much of their time waiting, and speaks
# only if a build fails. Fast tier: the other variants' objects (-O0). Tier all: every variant
# built as the Docker image builds them (python -m engine.kernels --prebuild), which
# tests/engine/test_kernel_prebuild.py then loads and verifies.
kernel_log=$(mktemp)
if [ "$tier" = fast ]; then
  python -m engine.kernels --compile-check >"$kernel_log" 2>&1 &
else
  export VS_TEST_PREBUILT_KERNELS
  VS_TEST_PREBUILT_KERNELS=$(mktemp -d)
  (
    rc=0
    python -m engine.kernels --prebuild "$VS_TEST_PREBUILT_KERNELS/kernels" \
      >"$VS_TEST_PREBUILT_KERNELS/log" 2>&1 || rc=$?
    echo "$rc" >"$VS_TEST_PREBUILT_KERNELS/rc"
    cp "$VS_TEST_PREBUILT_KERNELS/log" "$kernel_log"
    exit "$rc"
  ) &
fi
kernel_pid=$!
status=0
select=()
if [ "$tier" = fast ]; then
  select=(-m "not slow")
  echo "test tier: fast (tests marked slow skipped; VS_TEST_TIER=all runs them, as CI does)" >&2
else
  echo "test tier: all" >&2
fi
# --durations: the slowest tests, for whoever has to keep the CI run under its 30 minutes
python -m pytest -p no:cacheprovider --timeout=600 --durations=25 "${select[@]}" "$@" || status=$?
if ! wait "$kernel_pid"; then
  cat "$kernel_log"
  echo "kernel build check FAILED" >&2
  status=1
fi
# Tier all on a machine wider than AVX2 also runs the engine's tests as an AVX2-only box plans
# and computes them (README "Kernels": VISION_SERVE_CPU_VARIANT plus torch's, oneDNN's and MKL's
# caps): AVX2 kernels, bf16 widened for eager products, an fp32 vision tower -- the class most
# edge boxes are, which CI machines rarely are (~1.5 min). Its module comes from the prebuild
# above. Skipped when arguments pick tests.
best=$(python -c "from engine.kernels import runnable_variants as r; print((r() or ['none'])[0])")
if [ "$tier" != fast ] && [ $# -eq 0 ] && [ "$best" != avx2 ] && [ "$best" != none ] &&
  [ -d "${VS_TEST_PREBUILT_KERNELS:-}/kernels" ]; then
  echo "engine tests planned as an AVX2-only CPU" >&2
  VISION_SERVE_CPU_VARIANT=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \
    MKL_ENABLE_INSTRUCTIONS=AVX2 VISION_SERVE_KERNELS_DIR="$VS_TEST_PREBUILT_KERNELS/kernels" \
    python -m pytest -p no:cacheprovider --timeout=600 -q -m "not slow" \
    tests/engine tests/test_checkpoints.py || status=$?
fi
exit "$status"  # the last pytest's summary stays the last line
