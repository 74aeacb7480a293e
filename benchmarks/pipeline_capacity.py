"""``benchmarks/pipeline.py --capacity``: sustained cameras x fps per detector format.

Why: "how many cameras can this box take" depends on the detector's format (PyTorch eager,
ONNX Runtime, OpenVINO) and input size, and a per-frame timing alone does not answer it --
the pipeline batches frames across cameras, decodes every camera's stream and runs the gate
and the Redis producer on the same cores. So each format is probed with the real pipeline:
N file cameras at a fixed sampling fps -> ``CameraPipeline`` (the exported model loaded
through the pipeline's own ``Detector``) -> Redis -> one describer process against the null
VLM endpoint (answers at once: only the pipeline is measured).

A probe of N cameras is *sustained* when, over its window, the detector handled at least
95 % of the target (N x fps frames/s; less one frame per camera, which the window's edges
may cut off) and at most 5 % of the sampled frames were dropped because the detector was
still busy (``detector_busy``: the newest frame replaced an older one nobody took). Once a
batch of all N cameras takes longer than a sampling period, every camera loses frames, so
the limit is sharp: N x fps x ms/frame (at that batch size) near 1000 ms per second.
The search starts near the estimate from a short ms/frame timing, doubles
(or halves) until it brackets the limit, then bisects to ``--resolution``.

    python benchmarks/pipeline.py --capacity --formats pt onnx openvino --imgsz 320 640
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import redis

from benchmarks.pipeline import (
    REPO,
    Services,
    log,
    make_frames,
    make_video,
    people_unless_blank,
    snapshot,
    start_null_vlm,
    start_redis,
)
from pipelines.config import DetectorConfig, parse_config
from pipelines.detect import Detector, InjectedDetections
from pipelines.ingest import Frame
from pipelines.pipeline import CameraPipeline

SUSTAINED_SHARE = 0.95  # detector frames/s against the target
BUSY_DROP_SHARE = 0.05  # sampled frames dropped because the detector was busy


@dataclass
class Probe:
    """One run of ``cameras`` cameras: what the detector kept up with."""

    cameras: int
    target_fps: float
    detector_fps: float
    ms_per_frame: float
    mean_batch: float
    sampled: int
    detected: int
    busy_dropped: int
    other_dropped: dict[str, int]
    enqueued: int
    sustained: bool


@dataclass
class Settings:
    """What every probe shares."""

    fps: float
    warmup_s: float
    window_s: float
    max_batch: int
    max_cameras: int
    max_probes: int
    resolution: float
    video: str
    redis_url: str
    vlm_url: str


def probe(detector: Any, imgsz: int, cameras: int, s: Settings) -> Probe:
    """``cameras`` cameras through the pipeline for a warm-up and a measured window."""
    config = parse_config(
        {
            "redis_url": s.redis_url,
            "cameras": [{"id": f"cam{i}", "url": s.video, "fps": s.fps} for i in range(cameras)],
            "detector": {"weights": "unused.pt", "imgsz": imgsz, "max_batch": s.max_batch},
            "gate": {"min_persons": 1, "cooldown_s": 5.0, "min_interval_s": 1},
            "describer": {"base_url": s.vlm_url, "model": "null"},
            "metrics": {"pipeline_port": 0, "describe_port": 0},
            "log_level": "WARNING",
        },
        "capacity benchmark",
    )
    client = redis.Redis.from_url(s.redis_url)
    pipeline = CameraPipeline(config, detector)
    runner = threading.Thread(target=pipeline.run, daemon=True)
    runner.start()
    try:
        time.sleep(s.warmup_s)
        start = snapshot(pipeline, client, config.queue)
        time.sleep(s.window_s)
        end = snapshot(pipeline, client, config.queue)
    finally:
        pipeline.stop()
        runner.join(30)
        client.close()
    window = end["t"] - start["t"]
    detected = end["detected"] - start["detected"]
    batches = end["batches"] - start["batches"]
    sampled = end["sampled"] - start["sampled"]
    dropped: Counter[str] = end["dropped"] - start["dropped"]
    busy = dropped.pop("detector_busy", 0)
    target = cameras * s.fps
    rate = detected / window
    enqueued = end["redis"].get("enqueued", 0) - start["redis"].get("enqueued", 0)
    return Probe(
        cameras=cameras,
        target_fps=target,
        detector_fps=round(rate, 2),
        ms_per_frame=round(
            1000 * (end["detect_seconds"] - start["detect_seconds"]) / max(detected, 1), 2
        ),
        mean_batch=round(detected / max(batches, 1), 2),
        sampled=sampled,
        detected=detected,
        busy_dropped=busy,
        other_dropped=dict(dropped),
        enqueued=enqueued,
        # slack of one frame per camera: a window's edges cut a sampling period in two
        sustained=rate >= SUSTAINED_SHARE * target - cameras / window
        and busy <= BUSY_DROP_SHARE * max(sampled, 1),
    )


def search(run: Callable[[int], Probe], start: int, s: Settings) -> list[Probe]:
    """Probes until the largest sustained count is bracketed to ``s.resolution``: double up
    from ``start`` while sustained (halve down while not), then bisect."""
    done: dict[int, Probe] = {}
    ok, bad = 0, None
    n = max(1, min(start, s.max_cameras))
    while len(done) < s.max_probes:
        result = done[n] = run(n)
        mark = "sustained" if result.sustained else "NOT sustained"
        log(
            f"  {n} cameras: {result.detector_fps} of {result.target_fps:g} frames/s, "
            f"{result.ms_per_frame} ms/frame, batch {result.mean_batch}, "
            f"busy drops {result.busy_dropped}/{result.sampled} -> {mark}"
        )
        if result.sustained:
            ok = max(ok, n)
        else:
            bad = n if bad is None else min(bad, n)
        if bad is None:  # still sustained: go up
            if n >= s.max_cameras:
                break
            n = min(n * 2, s.max_cameras)
        elif ok == 0:  # nothing sustained yet: go down
            if n == 1:
                break
            n = max(1, n // 2)
        else:
            if bad - ok <= max(1, int(ok * s.resolution)):
                break
            n = (ok + bad) // 2
        if n in done:
            break
    return [done[k] for k in sorted(done)]


def single_frame_ms(detector: Any, frames: list[np.ndarray], imgsz: int) -> float:
    """Median ms for one frame per call (after two warm-up calls): the search's first guess."""
    times = []
    for i, image in enumerate(frames[:2] + frames):
        started = time.perf_counter()
        detector.detect([Frame("probe", i, time.time(), image)])
        if i >= 2:
            times.append((time.perf_counter() - started) * 1000)
    return float(np.median(times))


def load_detector(fmt: str, pt: Path, imgsz: int, work: Path, max_batch: int) -> Detector:
    from benchmarks.detector import weights_for

    weights = weights_for(fmt, pt, imgsz, work)
    config = DetectorConfig(weights=weights, imgsz=imgsz, device="cpu", max_batch=max_batch)
    return Detector(config)


def plot(rows: list[dict[str, Any]], fps: float, path: Path) -> Path:
    """Bars: sustained cameras x fps per format, one group per imgsz."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r["imgsz"] for r in rows})
    formats = list(dict.fromkeys(r["format"] for r in rows))
    fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(sizes) * len(formats) / 2, 4))
    width = 0.8 / max(len(formats), 1)
    for j, fmt in enumerate(formats):
        xs, ys, labels = [], [], []
        for i, size in enumerate(sizes):
            for r in rows:
                if r["format"] == fmt and r["imgsz"] == size:
                    xs.append(i + (j - (len(formats) - 1) / 2) * width)
                    ys.append(r["sustained_frames_per_s"])
                    labels.append(f"{r['sustained_cameras']} x {fps:g}")
        bars = ax.bar(xs, ys, width, label=fmt)
        ax.bar_label(bars, labels=labels, fontsize=8)
    ax.set_xticks(range(len(sizes)), [f"imgsz {s}" for s in sizes])
    ax.set_ylabel(f"sustained cameras x fps (at {fps:g} fps/camera)")
    ax.set_title("Pipeline capacity per detector format (CPU)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("--capacity (see benchmarks/pipeline_capacity.py)")
    g.add_argument("--capacity", action="store_true", help="cameras x fps sustained per format")
    g.add_argument("--formats", nargs="+", default=["pt", "onnx", "openvino"])
    g.add_argument("--probe-warmup", type=float, default=4.0, help="seconds before measuring")
    g.add_argument("--probe-window", type=float, default=10.0, help="measured seconds")
    g.add_argument("--max-cameras", type=int, default=96)
    g.add_argument("--max-probes", type=int, default=7, help="per format and size")
    g.add_argument("--resolution", type=float, default=0.1, help="bisect to this share")
    g.add_argument("--quick", action="store_true", help="tiny probes (a smoke test)")


def run(args: argparse.Namespace) -> int:
    """The whole capacity benchmark: one Redis, null VLM and describer for every probe."""
    if args.quick:
        args.probe_warmup, args.probe_window = 1.5, 3.0
        args.max_probes, args.max_cameras = min(args.max_probes, 2), min(args.max_cameras, 4)
    sizes = args.imgsz or [320, 640]
    if args.weights and args.weights.endswith(".pt"):
        pt = Path(args.weights)
    else:
        from pipelines.detector_training import make_detector

        pt = Path(make_detector(log=log).weights)
    workdir = Path(tempfile.mkdtemp(prefix="vs-capacity-"))
    services = Services(workdir)
    null_server = None
    rows: list[dict[str, Any]] = []
    try:
        redis_url = start_redis(services, args.fsync)
        vlm_url, null_server = start_null_vlm()
        frames = make_frames(workdir / "frames")
        video = make_video(frames, workdir / "camera.mp4", args.source_fps)
        settings = Settings(
            fps=args.fps,
            warmup_s=args.probe_warmup,
            window_s=args.probe_window,
            max_batch=args.max_batch,
            max_cameras=args.max_cameras,
            max_probes=args.max_probes,
            resolution=args.resolution,
            video=str(video),
            redis_url=redis_url,
            vlm_url=vlm_url,
        )
        start_describer(services, settings, args)
        for imgsz in sizes:
            for fmt in args.formats:
                log(f"{fmt} at imgsz {imgsz}: exporting / loading {pt.name}")
                detector = load_detector(fmt, pt, imgsz, workdir, args.max_batch)
                ms = single_frame_ms(detector, frames, imgsz)
                guess = max(1, int(0.8 * 1000 / ms / args.fps))
                log(f"  one frame per call: {ms:.1f} ms -> first probe {guess} cameras")
                injected = InjectedDetections(detector, people_unless_blank)
                probes = search(
                    lambda n, d=injected, z=imgsz: probe(d, z, n, settings), guess, settings
                )
                rows.append(summarize(fmt, imgsz, ms, probes, args.fps))
                del detector, injected
        result = report(rows, args, settings, pt)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = out / f"pipeline-capacity-{stamp}.json"
        path.write_text(json.dumps(result, indent=2))
        png = plot(rows, args.fps, out / f"pipeline-capacity-{stamp}.png")
        print_table(rows, args.fps)
        log(f"saved {path} and {png}")
        return 0
    finally:
        services.stop_all()
        if null_server is not None:
            null_server.shutdown()
        shutil.rmtree(workdir, ignore_errors=True)


def start_describer(services: Services, s: Settings, args: argparse.Namespace) -> None:
    """One describer process for all probes: it knows every camera id a probe may use."""
    import sys

    import yaml

    config = parse_config(
        {
            "redis_url": s.redis_url,
            "cameras": [{"id": f"cam{i}", "url": s.video} for i in range(s.max_cameras)],
            "describer": {"base_url": s.vlm_url, "model": "null", "max_tokens": 8,
                          "concurrency": args.concurrency, "timeout_s": 30},
            "metrics": {"pipeline_port": 0, "describe_port": 0},
            "log_level": "WARNING",
        },
        "capacity benchmark",
    )  # fmt: skip
    path = services.workdir / "describer.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    cmd = [sys.executable, "-m", "vision_serve.cli", "describe", "--config", str(path)]
    services.spawn([*cmd, "--consumer", "capacity"], "describer.log", cwd=REPO)


def summarize(fmt: str, imgsz: int, ms: float, probes: list[Probe], fps: float) -> dict[str, Any]:
    sustained = [p for p in probes if p.sustained]
    best = max(sustained, key=lambda p: p.cameras) if sustained else None
    first_fail = min((p for p in probes if not p.sustained), key=lambda p: p.cameras, default=None)
    return {
        "format": fmt,
        "imgsz": imgsz,
        "single_frame_ms": round(ms, 2),
        "sustained_cameras": best.cameras if best else 0,
        "sustained_frames_per_s": best.cameras * fps if best else 0,
        "ms_per_frame": best.ms_per_frame if best else None,
        "mean_batch": best.mean_batch if best else None,
        "first_unsustained_cameras": first_fail.cameras if first_fail else None,
        # the most frames/s the detector handled in any probe: its saturated throughput
        "max_detector_fps": max((p.detector_fps for p in probes), default=0.0),
        "probes": [asdict(p) for p in probes],
    }


def report(rows: list[dict], args: argparse.Namespace, s: Settings, pt: Path) -> dict[str, Any]:
    cpu = "?"
    if Path("/proc/cpuinfo").exists():
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "benchmark": "pipeline-capacity",
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {
            "cpu": cpu,
            "cpus": os.cpu_count(),
            "load_avg_1m_at_end": round(os.getloadavg()[0], 2),
            "platform": platform.platform(),
        },
        "setup": {
            "weights": str(pt),
            "fps_per_camera": args.fps,
            "source_fps": args.source_fps,
            "max_batch": args.max_batch,
            "warmup_s": s.warmup_s,
            "window_s": s.window_s,
            "criterion": f"detector >= {SUSTAINED_SHARE:.0%} of cameras x fps and "
            f"detector_busy drops <= {BUSY_DROP_SHARE:.0%} of sampled frames "
            "(less one frame per camera for the window's edges)",
            "detections": "injected on non-grey frames (the real model runs on every frame)",
            "vlm": "null endpoint (answers at once), one describer process",
            "quick": args.quick,
        },
        "rows": rows,
    }


def print_table(rows: list[dict[str, Any]], fps: float) -> None:
    head = f"{'format':<9} {'imgsz':>5} {'cameras':>7} {'x fps':>7} {'ms/frame':>8} "
    print(head + f"{'batch':>6} {'1-frame ms':>10} {'fails at':>8} {'max det fps':>11}")
    for r in rows:
        ms = "-" if r["ms_per_frame"] is None else f"{r['ms_per_frame']:.1f}"
        batch = "-" if r["mean_batch"] is None else f"{r['mean_batch']:.2f}"
        fail = r["first_unsustained_cameras"] or "-"
        print(
            f"{r['format']:<9} {r['imgsz']:>5} {r['sustained_cameras']:>7} "
            f"{r['sustained_frames_per_s']:>7g} {ms:>8} {batch:>6} "
            f"{r['single_frame_ms']:>10.1f} {fail!s:>8} {r['max_detector_fps']:>11.2f}"
        )
    print(f"(cameras x fps: sustained frames/s at {fps:g} fps per camera)")
