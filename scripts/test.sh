#!/usr/bin/env bash
# Set up a fresh machine and run the test suite (lint included). `.ci/run` calls this.
#
# Two tiers. Locally the default run skips tests marked `slow` (fault injection with real
# processes, fuzzing, the 64-client load test, the benchmark scripts, the two-replica failover,
# and every test on the trained person detector, whose first build on a machine takes 4-7
# minutes): under 10 minutes on 2 cores. In CI (the `CI` variable set, as every CI system does) or with VS_TEST_TIER=all,
# everything runs (~20 minutes). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 YOLO_OFFLINE=1 YOLO_AUTOINSTALL=False
ruff format --check .
ruff check .
# the kernel variants this CPU does not build at start must still compile (both AVX-512 ones
# on an AVX2-only CPU); the compiler runs beside the tests, which spend much of their time waiting,
# and speaks only if a build fails
kernel_log=$(mktemp)
python -m engine.kernels --compile-check >"$kernel_log" 2>&1 &
kernel_pid=$!
status=0
tier=${VS_TEST_TIER:-$([ -n "${CI:-}" ] && echo all || echo fast)}
select=()
if [ "$tier" = fast ]; then
  select=(-m "not slow")
  echo "test tier: fast (tests marked slow skipped; VS_TEST_TIER=all runs them, as CI does)" >&2
else
  echo "test tier: all" >&2
fi
python -m pytest -p no:cacheprovider --timeout=600 "${select[@]}" "$@" || status=$?
if ! wait "$kernel_pid"; then
  cat "$kernel_log"
  echo "kernel compile check FAILED" >&2
  status=1
fi
exit "$status"  # pytest's summary stays the last line
