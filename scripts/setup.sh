#!/usr/bin/env bash
# Fresh-machine setup: system packages (redis, ffmpeg, RTSP server), a venv with the project
# and its dev tools. Idempotent: a warm machine skips what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -x scripts/install-system-deps.sh ] || [ -f scripts/install-system-deps.sh ]; then
  bash scripts/install-system-deps.sh
fi

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv" >&2
  "$PYTHON" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
stamp=.venv/.vision-serve-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "setup: installing vision-serve and dev tools into .venv" >&2
  pip install -q --upgrade pip
  # torch/torchvision: the pyproject ranges resolve to the builds on this machine's disk
  pip install -q -e '.[dev]'
  touch "$stamp"
fi
# the fused CPU decode kernel: built once per machine (~30 s), cached under ~/.cache
python -m engine.kernels
echo "setup: ok ($(python -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'))" >&2
