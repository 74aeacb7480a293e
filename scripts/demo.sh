#!/usr/bin/env bash
# Fresh-machine demo of the whole stack, no model hub, no Docker:
#   1. set up (apt packages, .venv), generate a checkpoint (random weights: the words are
#      noise, the serving is real) and a person detector (`vision-serve make-detector`: YOLO26n
#      trained on synthetic frames, a few minutes the first time, then cached);
#   2. ask the engine about a real photo from the terminal;
#   3. run the camera stack for ~DEMO_SECONDS: redis (AOF) + `vision-serve serve` + a looping
#      camera video (people and empty frames) -> `vision-serve pipeline` (YOLO26, gate, Redis
#      Streams) -> `vision-serve describe` (OpenAI SDK, priority=batch) -> descriptions in Redis
#      -> `vision-serve ui` (SQLite event store, events page). The demo ends by printing the
#      events page's URL; from a terminal the page stays up until Ctrl-C.
# PRESET=bench for the realistic-size model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 YOLO_OFFLINE=1 YOLO_AUTOINSTALL=False
PRESET=${PRESET:-tiny}
DEMO_SECONDS=${DEMO_SECONDS:-40}
CKPT=checkpoints/demo-qwen2_vl-$PRESET
WORK=$(mktemp -d /tmp/vision-serve-demo.XXXX)
if [ ! -f "$CKPT/config.json" ]; then
  vision-serve make-model --family qwen2_vl --preset "$PRESET" --out "$CKPT"
fi
# the trained person detector (cached under ~/.cache/vision-serve/detectors/); stdout's last
# line is its weights path, the summary (held-out mAP50) goes to stderr
DETECTOR=$(vision-serve make-detector | tail -n 1)
# its input size and confidence threshold (max F1 on held-out frames), from its metrics.json
read -r DETECTOR_IMGSZ DETECTOR_CONF < <(python -c 'import json, sys
m = json.load(open(sys.argv[1])); print(m["imgsz"], m["conf"])' "$(dirname "$DETECTOR")/metrics.json")
# find_spec, not import: the first `import ultralytics` on a machine prints its settings banner
# to stdout, which would end up in $ASSETS
ASSETS=$(python -c 'import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec("ultralytics").origin).parent / "assets")')

echo "== 1. the engine from the terminal: one photo, one question =="
vision-serve chat --model "$CKPT" --image "$ASSETS/bus.jpg" \
  --prompt "Describe the people in this picture." --max-tokens 32

echo "== 2. the camera stack for ${DEMO_SECONDS}s =="
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT
REDIS_PORT=${REDIS_PORT:-6390}
VLM_PORT=${VLM_PORT:-8011}
UI_PORT=${UI_PORT:-8012}
redis-server --port "$REDIS_PORT" --dir "$WORK" --appendonly yes --appendfsync always \
  --save "" --daemonize no >"$WORK/redis.log" 2>&1 &
pids+=($!)
# default step policy: sized by predicted time (serve.log's step_policy line says how)
vision-serve serve --model "$CKPT" --port "$VLM_PORT" --served-model-name demo \
  >"$WORK/serve.log" 2>&1 &
pids+=($!)
# a camera: a looping video alternating frames with people (bus, zidane) and an empty street
ffmpeg -loglevel error -y -f lavfi -i color=c=gray:s=640x480:d=1 -frames:v 1 "$WORK/empty.jpg"
ffmpeg -loglevel error -y \
  -loop 1 -t 3 -i "$ASSETS/bus.jpg" -loop 1 -t 3 -i "$WORK/empty.jpg" -loop 1 -t 3 -i "$ASSETS/zidane.jpg" \
  -filter_complex "[0]scale=640:480,setsar=1[a];[1]scale=640:480,setsar=1[b];[2]scale=640:480,setsar=1[c];[a][b][c]concat=n=3:v=1[v]" \
  -map "[v]" -r 10 -pix_fmt yuv420p "$WORK/camera.mp4"
cat >"$WORK/cameras.yaml" <<YAML
redis_url: redis://127.0.0.1:$REDIS_PORT/0
cameras:
  - {id: demo-cam, url: $WORK/camera.mp4, fps: 1}
detector: {weights: $DETECTOR, imgsz: $DETECTOR_IMGSZ, conf: $DETECTOR_CONF}  # finds the people
gate: {min_persons: 1, cooldown_s: 4}            # so the empty street frames are gated out
describer: {base_url: "http://127.0.0.1:$VLM_PORT/v1", model: demo, max_tokens: 24, concurrency: 2}
metrics: {pipeline_port: 0, describe_port: 0}
events: {data_dir: $WORK/events}
ui: {port: $UI_PORT}
YAML
for _ in $(seq 120); do curl -sf "http://127.0.0.1:$VLM_PORT/health" >/dev/null && break; sleep 1; done
vision-serve pipeline --config "$WORK/cameras.yaml" >"$WORK/pipeline.log" 2>&1 &
pids+=($!)
vision-serve describe --config "$WORK/cameras.yaml" >"$WORK/describe.log" 2>&1 &
pids+=($!)
# the events page (loopback, so no key needed): stores every description as an event
vision-serve ui --config "$WORK/cameras.yaml" >"$WORK/ui.log" 2>&1 &
ui_pid=$!
pids+=($ui_pid)
sleep "$DEMO_SECONDS"
echo "== descriptions stored in Redis (stream vs:descriptions) =="
python - "$REDIS_PORT" <<'PY'
import sys, redis
r = redis.Redis(port=int(sys.argv[1]), decode_responses=True)
entries = r.xrange("vs:descriptions")
for _id, fields in entries[-5:]:
    print({k: (v[:80] if isinstance(v, str) else v) for k, v in fields.items()})
print(f"{len(entries)} descriptions; stats: {r.hgetall('vs:stats')}")
PY
python - "$UI_PORT" <<'PY'
import json, sys, time, urllib.request
url = f"http://127.0.0.1:{sys.argv[1]}/api/events?limit=200"
for _ in range(20):  # the ui stores what the describers wrote within a second or two
    events = json.load(urllib.request.urlopen(url, timeout=5))["data"]
    if events:
        break
    time.sleep(0.5)
print(f"{len(events)} events in the event store; newest: {events[0]['text'][:80]!r}" if events
      else "no events stored yet")
PY
echo "logs in $WORK"
echo "== events page: http://127.0.0.1:$UI_PORT/ =="
if [ -t 0 ] && [ -t 1 ]; then
  # keep only the page up: the camera stack stops, its events stay browsable
  for p in "${pids[@]}"; do [ "$p" = "$ui_pid" ] || kill "$p" 2>/dev/null || true; done
  echo "(serving the demo's events until Ctrl-C; later: vision-serve ui --config $WORK/cameras.yaml)"
  wait "$ui_pid" || true
fi
