"""Camera pipeline benchmark: N simulated cameras -> YOLO26 -> Redis -> describers -> VLM.

Measures, over a steady-state window after a warm-up:
  - sustained detector throughput (frames/s) against the target (cameras x fps),
    detector ms/frame and mean batch size;
  - frames dropped (by reason) in the pipeline, expired / dead-lettered in the describers;
  - Redis queue lag (undelivered entries and age of the oldest), sampled every second;
  - frame -> description latency p50 / p99 (capture time to stored description).

Sources are loopback simulations of cameras: a video file per camera played in real time
(``--source file``) or GStreamer RTSP mounts (``--source rtsp``). The VLM is our own
``vision-serve serve`` with a tiny checkpoint (``--vlm serve``), any OpenAI-compatible URL
(``--vlm URL --model NAME``), or ``--vlm null``: an in-process endpoint that answers at
once without a model, to measure the pipeline's own overhead (reported as such).

Untrained weights (a ``.yaml``, the only YOLO26 available offline) find no people, so by
default the benchmark injects one person box into frames that are not flat grey (the same
hook the tests use, ``InjectedDetections``); the real model still runs on every frame.

    python benchmarks/pipeline.py --cameras 8 --fps 2 --duration 60 --imgsz 640

``--gating-compare`` measures something else, offline (no Redis, no VLM, no real time): VLM
requests per minute of camera time with per-frame gating against per-track gating, on a
looped synthetic clip (people from the sample images walking across, then nobody, then one
person standing for a minute). Boxes are the clip's own; ``--gating-weights`` runs a trained
detector (``vision-serve make-detector``) on the frames instead.

    python benchmarks/pipeline.py --gating-compare --gating-minutes 10

``--capacity`` finds, per detector format (pt / onnx / openvino) and imgsz, the most cameras
at ``--fps`` the pipeline sustains (``--vlm`` is the null endpoint there); see
``benchmarks/pipeline_capacity.py``.

    python benchmarks/pipeline.py --capacity --formats pt onnx openvino --imgsz 320 640
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

os.environ.setdefault("YOLO_OFFLINE", "1")
os.environ.setdefault("YOLO_AUTOINSTALL", "False")

import cv2
import numpy as np
import redis

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pipelines.config import parse_config  # noqa: E402
from pipelines.detect import Detection, Detector, InjectedDetections  # noqa: E402
from pipelines.ingest import Frame  # noqa: E402
from pipelines.logs import setup_logging  # noqa: E402
from pipelines.pipeline import CameraPipeline  # noqa: E402
from pipelines.queue import queue_depth, read_stats  # noqa: E402

FRAME_SIZE = (640, 480)


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"benchmark: timed out waiting for {what}")
        time.sleep(0.1)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


# --- simulated cameras ---------------------------------------------------------------------
def make_frames(folder: Path) -> list[np.ndarray]:
    """People (ultralytics' bus and zidane) and empty grey frames, 640x480."""
    from ultralytics.utils import ASSETS

    people = [
        cv2.resize(cv2.imread(str(ASSETS / n)), FRAME_SIZE) for n in ("bus.jpg", "zidane.jpg")
    ]
    blank = np.full((FRAME_SIZE[1], FRAME_SIZE[0], 3), 96, np.uint8)
    frames = [people[0], people[0], blank, blank, people[1], people[1], blank, blank]
    folder.mkdir(parents=True, exist_ok=True)
    for i, frame in enumerate(frames):
        cv2.imwrite(str(folder / f"frame_{i:05d}.jpg"), frame)
    return frames


def make_video(frames: list[np.ndarray], path: Path, fps: int, seconds: int = 8) -> Path:
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps, FRAME_SIZE)
    for i in range(fps * seconds):
        writer.write(frames[(i * len(frames)) // (fps * seconds) % len(frames)])
    writer.release()
    return path


def is_blank(image: np.ndarray) -> bool:
    return float(image.std()) < 8.0


def people_unless_blank(frame: Frame, real: list[Detection]) -> list[Detection]:
    if is_blank(frame.image):
        return []
    h, w = frame.image.shape[:2]
    return [Detection(0, "person", 0.9, (w * 0.25, h * 0.1, w * 0.6, h * 0.95))]


# --- services ------------------------------------------------------------------------------
class Services:
    """Processes started by the benchmark, stopped (by process group) at the end."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: list[subprocess.Popen] = []

    def spawn(self, cmd: list[str], log_name: str, **kw: Any) -> subprocess.Popen:
        out = open(self.workdir / log_name, "w")  # noqa: SIM115  (closed with the process)
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, **kw
        )
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


def start_redis(services: Services, fsync: str) -> str:
    if shutil.which("redis-server") is None:
        raise SystemExit("benchmark: redis-server missing; run scripts/install-system-deps.sh")
    port = free_port()
    data = services.workdir / "redis"
    data.mkdir()
    cmd = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data)]
    cmd += ["--appendonly", "yes", "--appendfsync", fsync, "--save", ""]
    services.spawn(cmd, "redis.log")
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)

    def up() -> bool:
        try:
            return bool(client.ping())
        except redis.ConnectionError:
            return False

    wait_for(up, 15, "redis-server")
    return url


def start_rtsp(services: Services, images: Path, cameras: int, fps: int) -> list[str]:
    port = free_port()
    cmd = ["/usr/bin/python3", str(REPO / "scripts" / "rtsp_server.py"), "--port", str(port)]
    cmd += ["--images", str(images), "--fps", str(fps)]
    for i in range(cameras):
        cmd += ["--mount", f"/cam{i}"]
    proc = services.spawn(cmd, "rtsp.log")
    wait_for(lambda: "READY" in (services.workdir / "rtsp.log").read_text(), 20, "RTSP server")
    if proc.poll() is not None:
        raise SystemExit("benchmark: RTSP server failed: see rtsp.log")
    return [f"rtsp://127.0.0.1:{port}/cam{i}" for i in range(cameras)]


def start_vlm_server(services: Services) -> tuple[str, str]:
    """Our ``vision-serve serve`` with a freshly made tiny checkpoint."""
    model_dir = services.workdir / "tiny-model"
    log("making the tiny checkpoint (vision-serve make-model)")
    cli = [sys.executable, "-m", "vision_serve.cli"]
    subprocess.run(
        [*cli, "make-model", "--family", "qwen2_vl", "--preset", "tiny", "--out", str(model_dir)],
        check=True,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
    )
    port = free_port()
    cmd = [*cli, "serve", "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port)]
    services.spawn([*cmd, "--served-model-name", "tiny"], "vlm.log", cwd=REPO)
    import httpx

    def healthy() -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    log("waiting for vision-serve serve /health")
    wait_for(healthy, 300, "vision-serve serve")
    return f"http://127.0.0.1:{port}/v1", "tiny"


def start_null_vlm() -> tuple[str, ThreadingHTTPServer]:
    """Answers every chat completion at once, without a model (pipeline overhead only)."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            pass

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            body = json.dumps(
                {
                    "id": "null",
                    "object": "chat.completion",
                    "created": int(time.time()),
                    "model": "null",
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": "null endpoint"},
                            "finish_reason": "stop",
                        }
                    ],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                }
            ).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}/v1", server


# --- the run -------------------------------------------------------------------------------
def sample_queue(client: redis.Redis, cfg: Any, stop: threading.Event, out: list[dict]) -> None:
    while not stop.wait(1.0):
        try:
            depth = queue_depth(client, cfg)
        except redis.RedisError:
            continue
        out.append({"t": time.time(), **depth})


def snapshot(pipeline: CameraPipeline, client: redis.Redis, cfg: Any) -> dict[str, Any]:
    return {
        "t": time.time(),
        "detected": pipeline.detected.total(),
        "batches": pipeline.batches,
        "detect_seconds": pipeline.detect_seconds,
        "sampled": sum(r.stats.sampled for r in pipeline.readers.values()),
        "decoded": sum(r.stats.decoded for r in pipeline.readers.values()),
        "dropped": sum((Counter(r.stats.dropped) for r in pipeline.readers.values()), Counter()),
        "redis": read_stats(client, cfg),
    }


# --- per-frame against per-track gating ---------------------------------------------------
GATINGS: dict[str, dict[str, Any]] = {
    "frame (cooldown 10 s, on count change)": {"describe_on": ["frame"]},
    "track_start": {"describe_on": ["track_start"]},
    "track_start + track_end": {"describe_on": ["track_start", "track_end"]},
    "track_start + interval 30 s": {"describe_on": ["track_start", "interval"], "interval_s": 30},
}


def gating_clip(fps: float) -> list[tuple[np.ndarray, list[tuple[float, ...]]]]:
    """One loop of the scene: two people walking across (20 s), nobody (5 s), one person
    standing still (60 s)."""
    from pipelines import synthetic

    rng = np.random.default_rng(7)
    walk = synthetic.clip(rng, FRAME_SIZE, int(20 * fps), persons=2)
    empty = [(synthetic.background(rng, FRAME_SIZE), [])] * int(5 * fps)
    stand = synthetic.clip(rng, FRAME_SIZE, 1, persons=1) * int(60 * fps)
    return walk + empty + stand


def gating_compare(minutes: float, fps: float, weights: str | None) -> dict[str, Any]:
    """Requests each gating would send for ``minutes`` of the looped clip at ``fps``."""
    clip = gating_clip(fps)
    frames = int(minutes * 60 * fps)
    detector: Any = None
    if weights:
        detector = Detector(parse_config({"detector": {"weights": weights}}).detector)
    # the detector's answers per clip frame, computed once (the loop repeats them)
    boxes: list[list[Detection]] = []
    for image, truth in clip:
        if detector is not None:
            frame = Frame("bench", 0, 0.0, image)
            boxes.append(detector.detect([frame])[0])
        else:
            boxes.append([Detection(0, "person", 0.9, tuple(b)) for b in truth])
    out: dict[str, Any] = {}
    for name, gate in GATINGS.items():
        camera = {"id": "bench", "url": "clip.mp4", "gate": gate}
        config = parse_config({"redis_url": "redis://127.0.0.1:1/0", "cameras": [camera]})
        pipeline = CameraPipeline(config, detector)  # process() is handed the boxes
        sent: Counter[str] = Counter()
        started = time.perf_counter()
        for i in range(frames):
            image, _ = clip[i % len(clip)]
            frame = Frame("bench", i + 1, 1_000_000.0 + i / fps, image)
            for item in pipeline.process(frame, boxes[i % len(clip)]):
                sent[item.gate_reason] += 1
        seconds = time.perf_counter() - started
        total = sum(sent.values())
        out[name] = {
            "requests": total,
            "requests_per_min": round(total / minutes, 2),
            "by_reason": dict(sent),
            "track_gate_ms_per_frame": round(seconds / frames * 1000, 3),
        }
        log(f"{name}: {total} requests ({total / minutes:.2f}/min) {dict(sent)}")
    base = out[next(iter(GATINGS))]["requests"]
    for name in GATINGS:
        n = out[name]["requests"]
        out[name]["reduction_vs_frame"] = round(1 - n / base, 3) if base else None
    return {
        "minutes": minutes,
        "fps": fps,
        "clip_seconds": len(clip) / fps,
        "detector": weights or "clip boxes",
        "gatings": out,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gating-compare", action="store_true", help="see the module doc")
    parser.add_argument("--gating-minutes", type=float, default=10.0)
    parser.add_argument("--gating-weights", default=None, help="trained detector weights")
    parser.add_argument("--cameras", type=int, default=8)
    parser.add_argument("--fps", type=float, default=2.0, help="sampling fps per camera")
    parser.add_argument("--source", choices=["file", "rtsp"], default="file")
    parser.add_argument("--source-fps", type=int, default=10, help="the simulated cameras' fps")
    parser.add_argument("--duration", type=float, default=60.0, help="measured seconds")
    parser.add_argument("--warmup", type=float, default=10.0)
    parser.add_argument(
        "--weights", default=None, help="default yolo26n.yaml; --capacity: the trained detector"
    )
    parser.add_argument(
        "--imgsz", type=int, nargs="+", default=None, help="default 640; --capacity: 320 640"
    )
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--no-inject", action="store_true", help="use the model's own boxes")
    parser.add_argument("--cooldown", type=float, default=5.0, help="gate cooldown seconds")
    parser.add_argument("--vlm", default="serve", help="serve | null | an OpenAI base URL")
    parser.add_argument("--model", default="tiny", help="model name for --vlm URL")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--describers", type=int, default=1, help="describer processes")
    parser.add_argument("--concurrency", type=int, default=4, help="per describer process")
    parser.add_argument("--max-frame-age", type=float, default=60.0)
    parser.add_argument("--fsync", default="everysec", choices=["always", "everysec", "no"])
    parser.add_argument("--out", default=str(REPO / "results"))
    from benchmarks.pipeline_capacity import add_arguments

    add_arguments(parser)
    args = parser.parse_args()
    setup_logging("WARNING")
    if args.capacity:
        from benchmarks.pipeline_capacity import run as run_capacity

        return run_capacity(args)
    if args.imgsz and len(args.imgsz) > 1:
        parser.error("--imgsz takes one size, except with --capacity")
    args.imgsz = args.imgsz[0] if args.imgsz else 640
    args.weights = args.weights or "yolo26n.yaml"
    if args.gating_compare:
        result = gating_compare(args.gating_minutes, args.fps, args.gating_weights)
        result["machine"] = platform.platform()
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"pipeline_gating_{time.strftime('%Y%m%d_%H%M%S')}.json"
        path.write_text(json.dumps(result, indent=2))
        log(f"saved {path}")
        return 0

    workdir = Path(tempfile.mkdtemp(prefix="vs-bench-"))
    services = Services(workdir)
    null_server = None
    try:
        redis_url = start_redis(services, args.fsync)
        frames = make_frames(workdir / "frames")
        if args.source == "rtsp":
            urls = start_rtsp(services, workdir / "frames", args.cameras, args.source_fps)
        else:
            video = make_video(frames, workdir / "camera.mp4", args.source_fps)
            urls = [str(video)] * args.cameras
        if args.vlm == "serve":
            base_url, model, vlm_kind = *start_vlm_server(services), "vision-serve serve (tiny)"
        elif args.vlm == "null":
            base_url, null_server = start_null_vlm()
            model, vlm_kind = "null", "null endpoint (no model: pipeline overhead only)"
        else:
            base_url, model, vlm_kind = args.vlm, args.model, f"external {args.vlm}"

        config = parse_config(
            {
                "redis_url": redis_url,
                "cameras": [
                    {"id": f"cam{i}", "url": url, "fps": args.fps} for i, url in enumerate(urls)
                ],
                "detector": {
                    "weights": args.weights,
                    "imgsz": args.imgsz,
                    "max_batch": args.max_batch,
                },
                "gate": {"min_persons": 1, "cooldown_s": args.cooldown, "min_interval_s": 1},
                "queue": {"max_frame_age_s": args.max_frame_age},
                "describer": {
                    "base_url": base_url,
                    "model": model,
                    "max_tokens": args.max_tokens,
                    "concurrency": args.concurrency,
                    "timeout_s": 120,
                },
                "metrics": {"pipeline_port": 0, "describe_port": 0},
                "log_level": "WARNING",
            },
            "benchmark",
        )
        cfg_path = workdir / "cameras.yaml"
        import yaml

        cfg_path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
        log(f"{args.cameras} cameras x {args.fps} fps ({args.source}), imgsz {args.imgsz}")
        detector: Any = Detector(config.detector)
        inject = not args.no_inject
        if inject:
            detector = InjectedDetections(detector, people_unless_blank)
        for i in range(args.describers):
            services.spawn(
                [sys.executable, "-m", "vision_serve.cli", "describe", "--config", str(cfg_path),
                 "--consumer", f"bench-{i}"],
                f"describer-{i}.log",
                cwd=REPO,
            )  # fmt: skip

        pipeline = CameraPipeline(config, detector)
        runner = threading.Thread(target=pipeline.run, daemon=True)
        client = redis.Redis.from_url(redis_url)
        runner.start()
        log(f"warming up {args.warmup:.0f}s")
        time.sleep(args.warmup)
        start = snapshot(pipeline, client, config.queue)
        lag_samples: list[dict] = []
        stop_sampling = threading.Event()
        sampler = threading.Thread(
            target=sample_queue, args=(client, config.queue, stop_sampling, lag_samples)
        )
        sampler.start()
        log(f"measuring {args.duration:.0f}s")
        time.sleep(args.duration)
        end = snapshot(pipeline, client, config.queue)
        stop_sampling.set()
        sampler.join()
        pipeline.stop()
        runner.join(30)
        time.sleep(2.0)  # let describers store what they were finishing

        window = end["t"] - start["t"]
        detected = end["detected"] - start["detected"]
        batches = end["batches"] - start["batches"]
        target = args.cameras * args.fps
        dropped = end["dropped"] - start["dropped"]
        redis_delta = {k: v - start["redis"].get(k, 0) for k, v in end["redis"].items()}
        described = [
            {k.decode(): v.decode() for k, v in fields.items()}
            for _id, fields in client.xrange(config.queue.descriptions_stream)
        ]
        in_window = [d for d in described if start["t"] <= float(d["ts"]) <= end["t"]]
        latencies = [float(d["latency_s"]) for d in in_window]
        vlm_secs = [float(d["vlm_seconds"]) for d in in_window]
        lags = [s["lag"] for s in lag_samples]
        lag_secs = [s["lag_seconds"] for s in lag_samples]
        result = {
            "benchmark": "pipeline",
            "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "machine": {
                "cpus": os.cpu_count(),
                "platform": platform.platform(),
                "python": platform.python_version(),
            },
            "setup": {
                "cameras": args.cameras,
                "fps_per_camera": args.fps,
                "source": args.source,
                "source_fps": args.source_fps,
                "weights": args.weights,
                "imgsz": args.imgsz,
                "detections": "injected on non-grey frames (real model runs)"
                if inject
                else "model",
                "gate_cooldown_s": args.cooldown,
                "vlm": vlm_kind,
                "describers": args.describers,
                "concurrency": args.concurrency,
                "redis_appendfsync": args.fsync,
                "warmup_s": args.warmup,
                "window_s": round(window, 1),
            },
            "detector": {
                "target_fps": target,
                "sustained_fps": round(detected / window, 2),
                "sustained": detected / window >= 0.95 * target,
                "ms_per_frame": round(
                    1000 * (end["detect_seconds"] - start["detect_seconds"]) / max(detected, 1), 1
                ),
                "mean_batch": round(detected / max(batches, 1), 2),
                "decoded_fps_all_cameras": round((end["decoded"] - start["decoded"]) / window, 1),
            },
            "frames": {
                "sampled": end["sampled"] - start["sampled"],
                "detected": detected,
                "dropped": dict(dropped),
                "enqueued": redis_delta.get("enqueued", 0),
                "refused_queue_full": redis_delta.get("refused_queue_full", 0),
                "trimmed": redis_delta.get("trimmed", 0),
                "described": redis_delta.get("described", 0),
                "expired": {k: v for k, v in redis_delta.items() if k.startswith("expired:")},
                "dead_lettered": {k: v for k, v in redis_delta.items() if k.startswith("dead:")},
            },
            "queue": {
                "lag_entries_mean": round(statistics.fmean(lags), 2) if lags else None,
                "lag_entries_max": max(lags) if lags else None,
                "lag_seconds_max": round(max(lag_secs), 2) if lag_secs else None,
                "pending_max": max((s["pending"] for s in lag_samples), default=None),
            },
            "latency_s": {
                "frames": len(latencies),
                "p50": round(percentile(latencies, 0.5), 3) if latencies else None,
                "p99": round(percentile(latencies, 0.99), 3) if latencies else None,
                "vlm_request_p50": round(percentile(vlm_secs, 0.5), 3) if vlm_secs else None,
            },
        }
        out_dir = Path(args.out)
        out_dir.mkdir(parents=True, exist_ok=True)
        name = f"pipeline-{args.cameras}cam-{args.fps:g}fps-{args.imgsz}-{args.source}"
        path = out_dir / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
        path.write_text(json.dumps(result, indent=2))
        print(json.dumps(result, indent=2))
        d, lat = result["detector"], result["latency_s"]
        log(
            f"detector {d['sustained_fps']} fps of {target:g} target "
            f"({'sustained' if d['sustained'] else 'NOT sustained'}), "
            f"{d['ms_per_frame']} ms/frame, "
            f"batch {d['mean_batch']}; dropped {dict(dropped) or 0}; "
            f"latency p50 {lat['p50']} s p99 {lat['p99']} s; queue lag max "
            f"{result['queue']['lag_entries_max']} entries"
        )
        log(f"saved {path}")
        return 0
    finally:
        services.stop_all()
        if null_server is not None:
            null_server.shutdown()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
