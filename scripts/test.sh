#!/usr/bin/env bash
# Set up a fresh machine and run the whole test suite (lint included). `.ci/run` calls this.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 YOLO_OFFLINE=1 YOLO_AUTOINSTALL=False
ruff format --check .
ruff check .
python -m pytest -p no:cacheprovider --timeout=600 "$@"
