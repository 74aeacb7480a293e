"""Make ``docs/events-page.png``: the events page over synthetic frames and example text.

Why synthetic: the README must not carry other people's photos (the ultralytics samples the
tests use are theirs), and the demo's model is randomly initialised, so its descriptions are
gibberish. So this script draws a few plain scenes (a yard, a street, an entrance) with
person-like figures, stores them as events with example descriptions and boxes in a temporary
event store, writes example live counters for each camera to a private redis-server, starts
``vision-serve ui`` on loopback and screenshots the page with Playwright and Debian's
Chromium (``scripts/install-system-deps.sh``). Nothing in the picture came from a model.

    python scripts/ui_screenshot.py [--out docs/events-page.png] [--chromium /usr/bin/chromium]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import cv2
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pipelines.config import PipelineConfig, parse_config  # noqa: E402
from pipelines.events.store import EventStore, NewEvent  # noqa: E402

API_KEY = "screenshot-key"
SIZE = (640, 480)
# (camera, minutes ago, scene seed, persons as (x, height, shirt BGR), example description)
EVENTS = [
    ("yard", 52, 1, [(180, 230, (60, 90, 200))],
     "One person walks along the garden path towards the shed, carrying a watering can."),
    ("street", 41, 2, [(150, 200, (160, 110, 40)), (420, 210, (40, 40, 40))],
     "Two people pass on the pavement in opposite directions; neither stops at the gate."),
    ("entrance", 33, 3, [(330, 260, (40, 150, 230))],
     "A person in an orange jacket stands at the front door and looks at a phone."),
    ("yard", 18, 4, [(250, 240, (60, 90, 200)), (430, 170, (90, 160, 60))],
     "An adult and a child stand on the lawn; the child points at the fence."),
    ("street", 9, 5, [(470, 220, (120, 60, 140))],
     "A person with a bicycle waits at the kerb, then crosses the street."),
    ("entrance", 2, 6, [(300, 265, (150, 150, 150)), (420, 255, (40, 40, 160))],
     "Two people arrive at the entrance; one rings the bell, the other holds a parcel."),
]  # fmt: skip
# example live counters per camera, as a running pipeline writes them
LIVE = {
    "yard": {"decoded_fps": "25.00", "dropped": {"detector_busy": 3}, "connected": "1"},
    "street": {"decoded_fps": "15.00", "dropped": {}, "connected": "1"},
    "entrance": {"decoded_fps": "0.00", "dropped": {"queue_full": 2}, "connected": "0"},
}


def scene(seed: int, persons: list[tuple[int, int, tuple[int, int, int]]]) -> tuple:
    """A flat drawn scene (sky, a house, a tree, a path) with person-like figures; returns
    the BGR image and each figure's box."""
    width, height = SIZE
    rng = np.random.default_rng(seed)
    image = np.zeros((height, width, 3), np.uint8)
    horizon = 230 + int(rng.integers(-20, 20))
    for y in range(horizon):  # sky: a vertical gradient
        image[y, :] = (235 - y // 4, 205 - y // 6, 150 - y // 8)
    image[horizon:, :] = (70, 135, 85) if seed % 2 else (120, 120, 125)  # grass or asphalt
    house_x = int(rng.integers(20, 360))
    cv2.rectangle(image, (house_x, horizon - 120), (house_x + 230, horizon), (170, 190, 215), -1)
    roof = np.array([[house_x - 15, horizon - 120], [house_x + 115, horizon - 190],
                     [house_x + 245, horizon - 120]], np.int32)  # fmt: skip
    cv2.fillPoly(image, [roof], (60, 70, 150))
    cv2.rectangle(image, (house_x + 95, horizon - 75), (house_x + 135, horizon), (40, 60, 90), -1)
    for wx in (house_x + 25, house_x + 160):
        cv2.rectangle(image, (wx, horizon - 95), (wx + 45, horizon - 55), (230, 220, 180), -1)
    tree_x = (house_x + 330) % (width - 60) + 30
    cv2.rectangle(image, (tree_x - 8, horizon - 60), (tree_x + 8, horizon + 20), (40, 70, 100), -1)
    cv2.circle(image, (tree_x, horizon - 90), 55, (50, 120, 60), -1)
    path = np.array([[260, height], [380, height], [house_x + 135, horizon],
                     [house_x + 95, horizon]], np.int32)  # fmt: skip
    cv2.fillPoly(image, [path], (150, 170, 185))
    boxes = []
    for x, tall, shirt in persons:
        foot = height - 30
        head = max(12, tall // 8)
        top = foot - tall
        cv2.line(image, (x - 10, foot - tall // 2), (x - 14, foot), (60, 50, 40), 9)  # legs
        cv2.line(image, (x + 10, foot - tall // 2), (x + 14, foot), (60, 50, 40), 9)
        cv2.rectangle(image, (x - 22, top + 2 * head), (x + 22, foot - tall // 2 + 8), shirt, -1)
        cv2.line(image, (x - 22, top + 2 * head + 6), (x - 34, foot - tall // 2), shirt, 9)
        cv2.line(image, (x + 22, top + 2 * head + 6), (x + 34, foot - tall // 2), shirt, 9)
        cv2.circle(image, (x, top + head), head, (140, 170, 215), -1)
        boxes.append([x - 38.0, float(top), x + 38.0, foot + 4.0])
    cv2.putText(image, "synthetic scene", (10, height - 10), cv2.FONT_HERSHEY_SIMPLEX, 0.5,
                (255, 255, 255), 1, cv2.LINE_AA)  # fmt: skip
    return image, boxes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def redis_server(workdir: Path) -> Iterator[str]:
    """A private, memory-only redis-server on loopback."""
    port = free_port()
    cmd = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
    cmd += ["--appendonly", "no", "--dir", str(workdir)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        import redis

        client = redis.Redis(port=port)
        for _ in range(100):
            with contextlib.suppress(redis.ConnectionError):
                if client.ping():
                    break
            time.sleep(0.05)
        client.close()
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(10)


def seed(config: PipelineConfig, now: float) -> None:
    """The example events (snapshots included), each camera's latest description and live
    counters, as the describers and the pipeline would have written them."""
    import redis

    store = EventStore(config.events.data_dir)
    client = redis.Redis.from_url(config.redis_url)
    q = config.queue
    for i, (camera, minutes, seed_, persons, text) in enumerate(EVENTS):
        image, boxes = scene(seed_, persons)
        ts = now - minutes * 60
        latency = 1.4 + 0.3 * i
        dets = [{"cls": 0, "label": "person", "conf": 0.91 - 0.04 * j, "box": b}
                for j, b in enumerate(boxes)]  # fmt: skip
        event = NewEvent(
            id=f"{camera}:example:{i + 1}", camera=camera, ts=ts, text=text,
            described_at=ts + latency, persons=len(boxes), boxes=json.dumps(dets),
            model="example", latency_s=latency, vlm_seconds=latency - 0.4,
            completion_tokens=24, worker="example",
        )  # fmt: skip
        ok, jpeg = cv2.imencode(".jpg", image, [cv2.IMWRITE_JPEG_QUALITY, 90])
        assert ok
        store.write_snapshots(event, jpeg.tobytes())
        store.add([event])
        client.hset(f"{q.latest_prefix}{camera}", mapping={
            "frame_uid": event.id, "ts": f"{ts:.3f}", "described_at": f"{ts + latency:.3f}",
            "persons": str(len(boxes)),
        })  # fmt: skip
    for camera, numbers in LIVE.items():
        fps = float(numbers["decoded_fps"])
        client.hset(f"{q.camera_prefix}{camera}", mapping={
            "connected": numbers["connected"], "decoded_fps": numbers["decoded_fps"],
            "decoded": str(int(fps * 3600)), "sampled": "7200", "detected": "7195",
            "gated": "412", "enqueued": "410", "dropped": json.dumps(numbers["dropped"]),
            "reconnects": "0" if numbers["connected"] == "1" else "3",
            "last_frame_ts": f"{now - (1 if numbers['connected'] == '1' else 40):.3f}",
            "persons": "1", "last_error": "" if numbers["connected"] == "1" else
            "read failed or timed out", "instance": "example-pipeline", "run": "example",
            "updated": f"{now + 600:.3f}", "ttl_s": "3600", "stopped": "0",
        })  # fmt: skip
    client.close()
    store.close()


def screenshot(config: PipelineConfig, out: Path, chromium: str) -> None:
    """Serve the page on loopback and save a 1280x800 screenshot with the newest event open."""
    import uvicorn
    from playwright.sync_api import sync_playwright

    from pipelines.events.app import create_app

    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(config), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium)
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            page.emulate_media(color_scheme="light")
            page.add_init_script(f"localStorage.setItem('vision-serve-ui-key', '{API_KEY}')")
            page.goto(f"http://127.0.0.1:{port}/")
            page.wait_for_selector("body[data-ready='1']")
            page.wait_for_function(
                "() => [...document.querySelectorAll('.camera img')].every(i => i.naturalWidth > 0)"
            )
            page.click("li.event")  # the newest: the detail view with its boxes
            page.wait_for_function("() => document.getElementById('detail-img').naturalWidth")
            out.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(out))
            browser.close()
    finally:
        server.should_exit = True
        thread.join(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "events-page.png")
    parser.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    args = parser.parse_args()
    if shutil.which("redis-server") is None:
        sys.exit("redis-server not found: run scripts/install-system-deps.sh")
    with (
        tempfile.TemporaryDirectory(prefix="vs-screenshot-") as tmp,
        redis_server(Path(tmp)) as url,
    ):
        config = parse_config(
            {
                "redis_url": url,
                "cameras": [{"id": c, "url": f"rtsp://camera-{c}.invalid/stream"} for c in LIVE],
                "events": {"data_dir": str(Path(tmp) / "events"), "retain_days": None},
                "ui": {"api_key": API_KEY},
            },
            "screenshot",
        )
        seed(config, time.time())
        screenshot(config, args.out, args.chromium)
    size = args.out.stat().st_size
    print(f"wrote {args.out} ({size / 1024:.0f} KiB)")


if __name__ == "__main__":
    main()
