#!/usr/bin/env bash
# Set up a fresh machine and run the whole test suite (lint included). `.ci/run` calls this.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 YOLO_OFFLINE=1 YOLO_AUTOINSTALL=False
ruff format --check .
ruff check .
# the kernel variants this CPU does not build at start must still compile (all of them on an
# AVX2-only CPU); the compiler runs beside the tests, which spend much of their time waiting,
# and speaks only if a build fails
kernel_log=$(mktemp)
python -m engine.kernels --compile-check >"$kernel_log" 2>&1 &
kernel_pid=$!
status=0
python -m pytest -p no:cacheprovider --timeout=600 "$@" || status=$?
if ! wait "$kernel_pid"; then
  cat "$kernel_log"
  echo "kernel compile check FAILED" >&2
  status=1
fi
exit "$status"  # pytest's summary stays the last line
