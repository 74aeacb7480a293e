#!/usr/bin/env bash
# Fresh-machine demo: set up, generate a checkpoint (no hub needed), then ask the engine about a
# real photo (ultralytics ships bus.jpg) and chat in text, streaming tokens as they come.
# PRESET=bench for the realistic-size model (slower to generate, ~300M params).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 YOLO_OFFLINE=1 YOLO_AUTOINSTALL=False
PRESET=${PRESET:-tiny}
CKPT=checkpoints/demo-qwen2_vl-$PRESET
if [ ! -f "$CKPT/config.json" ]; then
  vision-serve make-model --family qwen2_vl --preset "$PRESET" --out "$CKPT"
fi
BUS=$(python -c 'import ultralytics, pathlib; print(pathlib.Path(ultralytics.__file__).parent / "assets" / "bus.jpg")')
echo "== one image, one question (weights are random: the words are noise, the serving is real) =="
vision-serve chat --model "$CKPT" --image "$BUS" --prompt "Describe the people in this picture." --max-tokens 48
echo "== a two-turn text chat =="
printf 'Hello, who is at the door?\nAnd what are they wearing?\n' | vision-serve chat --model "$CKPT" --max-tokens 32
