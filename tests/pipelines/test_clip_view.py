"""The clip view (``describer.view: clip``): a track's last frames go to the VLM as one video.

Checked against the real pieces: config validation, the camera's ring buffer, the producer
writing a clip entry into a real Redis (and refusing one over ``max_clip_bytes``), each of
the three ``clip_format`` forms reaching our own ``vision-serve serve`` -- the image tokens
of its ``usage.prompt_tokens`` show how many frames it decoded -- and a file camera playing
a generated clip end to end: detector stand-in, real tracker and gate, Redis, describer,
server.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from pathlib import Path
from typing import Any

import cv2
import httpx
import numpy as np
import pytest
from clip_helpers import DifferenceDetector, Walker, write_clip
from pipeline_helpers import (
    DescriberThread,
    descriptions,
    wait_all_described,
    wait_until,
)

from pipelines.clips import Clip, ClipBuffer, pick_evenly
from pipelines.config import ConfigError
from pipelines.detect import Detection
from pipelines.ingest import Frame
from pipelines.pipeline import CameraPipeline
from pipelines.queue import FrameQueue, Outgoing, read_stats
from pipelines.vlm import ClipMedia, VLMClient, build_prompt, split_clip

pytestmark = pytest.mark.timeout(180)

CLIP_CAMERA = {"id": "yard", "url": "unused.mp4", "describer": {"view": "clip"}}


# -- configuration -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("describer", "fps", "message"),
    [
        ({"view": "clip", "clip_frames": 1}, 2, "clip_frames"),
        ({"view": "clip", "clip_frames": 33}, 2, "clip_frames"),
        ({"view": "clip", "clip_frames": 8, "clip_seconds": 2}, 2, "raise clip_seconds to 4"),
        ({"view": "clip", "clip_seconds": 100}, 30, "at most 256"),
        ({"view": "crop", "clip_frames": 4}, 2, "only used with view: clip"),
    ],
)
def test_clip_settings_that_cannot_work_are_named(
    make_config: Any, describer: dict, fps: float, message: str
) -> None:
    camera = {"id": "yard", "url": "unused.mp4", "fps": fps, "describer": describer}
    with pytest.raises(ConfigError, match=message):
        make_config("redis://127.0.0.1:1/0", cameras=[camera])


def test_clip_format_is_checked_per_describer_and_endpoint(make_config: Any) -> None:
    with pytest.raises(ConfigError, match=r"describer\.clip_format"):
        make_config("redis://127.0.0.1:1/0", describer={"clip_format": "gif"})
    config = make_config(
        "redis://127.0.0.1:1/0",
        cameras=[CLIP_CAMERA],
        describer={
            "clip_format": "images",
            "endpoints": [
                {"base_url": "http://a:8000/v1", "clip_format": "video_url"},
                {"base_url": "http://b:8000/v1"},
            ],
        },
    )
    a, b = (VLMClient(config.describer, ep) for ep in config.describer.endpoints)
    assert (a.clip_format, b.clip_format) == ("video_url", "images")
    assert config.cameras[0].clip_seconds == 8 / 2  # default: clip_frames sampled frames


# -- the ring buffer -----------------------------------------------------------------------
def _tracked(frame: Frame, track: int | None) -> list[Detection]:
    return [Detection(0, "person", 0.9, (10.0, 10.0, 60.0, 90.0), track_id=track)]


def test_ring_stays_bounded_and_a_clip_shows_the_track_up_to_the_trigger() -> None:
    ring = ClipBuffer(ClipBuffer.window_capacity(3.0, 2.0), max_side=320, quality=80)
    assert ring.capacity == 7
    image = np.full((480, 640, 3), 90, np.uint8)
    shot = [Frame("yard", i + 1, 1000.0 + i / 2, image) for i in range(40)]
    for i, frame in enumerate(shot):  # track 7 is seen in even frames only
        ring.add(frame, _tracked(frame, 7 if i % 2 == 0 else None))
        assert len(ring) <= ring.capacity
    assert all(
        max(cv2.imdecode(np.frombuffer(f.jpeg, np.uint8), 1).shape) <= 320 for f in ring._frames
    )  # fmt: skip  (kept downscaled)
    end = shot[38]
    clip = ring.clip(end, _tracked(end, 7), [7], count=4, seconds=3.0)
    assert [f.seq for f in clip] == [shot[k].seq for k in (34, 36, 38)]  # the ring's with 7
    assert clip[-1].seq == end.seq and all(f.ts >= end.ts - 3.0 for f in clip)
    assert all(any(d.track_id == 7 for d in f.detections) for f in clip)
    everything = ring.clip(shot[39], [], [], count=4, seconds=3.0)  # per-frame gating
    assert len(everything) == 4 and everything[-1].seq == shot[39].seq
    assert pick_evenly(7, 4) == [0, 2, 4, 6] and pick_evenly(3, 8) == [0, 1, 2]


# -- the queue entry -----------------------------------------------------------------------
def _clip_item(n: int, camera: str = "yard", size: tuple[int, int] = (320, 240)) -> Outgoing:
    ring = ClipBuffer(n + 1, max_side=1280, quality=85)
    rng = np.random.default_rng(n)
    shot, now = [], time.time()
    for i in range(n):
        image = rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
        frame = Frame(camera, i + 1, now - (n - i) * 0.5, image)
        ring.add(frame, _tracked(frame, 3))
        shot.append(frame)
    end = shot[-1]
    clip = Clip(ring.clip(end, _tracked(end, 3), [3], n, 60.0), crop=(0, 0, 100, 120))
    return Outgoing(end, _tracked(end, 3), "track_start", (3,), clip=clip)


def _producer(redis_server: Any, queue_cfg: Any) -> tuple[FrameQueue, list[str]]:
    drops: list[str] = []
    queue = FrameQueue(redis_server.url, queue_cfg, on_drop=lambda _c, r: drops.append(r))
    queue.start()
    return queue, drops


def test_a_clip_is_one_entry_whose_key_holds_its_frames(redis_server: Any, make_config) -> None:
    config = make_config(redis_server.url, cameras=[CLIP_CAMERA])
    queue, drops = _producer(redis_server, config.queue)
    queue.submit(_clip_item(5))
    image = np.zeros((48, 64, 3), np.uint8)  # a single frame next to it: its old shape
    queue.submit(Outgoing(Frame("door", 9, time.time(), image), _tracked(None, None), "first"))
    wait_until(lambda: queue.enqueued == 2, 10, what="2 enqueued")
    queue.stop(flush_timeout=1)
    assert not drops
    client = redis_server.client()
    (_, clip), (_, single) = client.xrange(config.queue.frames_stream)
    clip = {k.decode(): v.decode() for k, v in clip.items()}
    jpegs = split_clip(client.get(clip["clip"]), clip["clip_sizes"])
    assert len(jpegs) == 5 and jpegs[-1] == client.get(clip["image"])  # snapshot = last frame
    for jpeg in jpegs:  # cropped to (0, 0, 100, 120)
        assert cv2.imdecode(np.frombuffer(jpeg, np.uint8), 1).shape[:2] == (120, 100)
    assert (clip["width"], clip["height"]) == ("100", "120")
    assert clip["clip_ts"] == "[0.0, 0.5, 1.0, 1.5, 2.0]" and clip["clip_seconds"] == "2.000"
    assert set(clip["clip_tracks"]) and '"3"' in clip["clip_tracks"]
    assert client.ttl(clip["clip"]) > 0
    assert [k.decode() for k in single] == [
        "camera", "ts", "seq", "persons", "boxes", "width", "height", "gate",
        "frame_uid", "image",
    ]  # fmt: skip
    prompt = build_prompt("Describe.", clip)
    assert "a clip: 5 frames over 2.0 s" in prompt and "person #3 from [" in prompt


def test_a_clip_over_max_clip_bytes_is_dropped_and_counted(redis_server: Any, make_config) -> None:
    config = make_config(redis_server.url, cameras=[CLIP_CAMERA], queue={"max_clip_bytes": 65536})
    queue, drops = _producer(redis_server, config.queue)
    item = _clip_item(8, size=(640, 480))
    item = Outgoing(item.frame, item.detections, "first", clip=Clip(item.clip.frames))  # no crop
    queue.submit(item)
    queue.submit(_clip_item(3))  # small: it fits
    wait_until(lambda: queue.enqueued + len(drops) == 2, 10, what="2 handled")
    queue.stop(flush_timeout=1)
    assert drops == ["clip_too_large"] and queue.enqueued == 1
    client = redis_server.client()
    assert read_stats(client, config.queue)["dropped:clip_too_large"] == 1
    (_, entry), = client.xrange(config.queue.frames_stream)  # fmt: skip
    assert len(client.get(entry[b"clip"])) <= 65536


# -- the three forms against our server ----------------------------------------------------
def _tokens(base_url: str, content: list[dict[str, Any]]) -> int:
    root = base_url.removesuffix("/v1")
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}]}
    reply = httpx.post(f"{root}/tokenize", json=body, timeout=30)
    assert reply.status_code == 200, reply.text
    return int(reply.json()["count"])


def _jpeg_url(jpeg: bytes) -> str:
    import base64

    return "data:image/jpeg;base64," + base64.b64encode(jpeg).decode()


def _image_tokens(base_url: str, jpeg: bytes, prompt: str) -> int:
    """The prompt tokens of ``prompt`` with one image before it."""
    image = {"type": "image_url", "image_url": {"url": _jpeg_url(jpeg)}}
    return _tokens(base_url, [image, {"type": "text", "text": prompt}])


def _frames(n: int, size: tuple[int, int] = (112, 140)) -> tuple[bytes, ...]:
    rng = np.random.default_rng(7)
    out = []
    for _ in range(n):
        image = rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
        out.append(cv2.imencode(".jpg", image)[1].tobytes())
    return tuple(out)


@pytest.mark.slow
@pytest.mark.timeout(600)  # the session's server: a tiny model made, then loaded (minutes)
def test_each_clip_format_reaches_our_server_as_n_frames(vlm_server: str, make_config) -> None:
    n = 4
    clip = ClipMedia(_frames(n), fps=2.0)
    prompt = "Describe."
    text = _tokens(vlm_server, [{"type": "text", "text": prompt}])
    one = _image_tokens(vlm_server, clip.frames[0], prompt) - text
    used: dict[str, int] = {}
    for fmt in ("frames", "video_url", "images"):
        config = make_config("redis://127.0.0.1:1/0", describer={
            "base_url": vlm_server, "clip_format": fmt, "max_tokens": 2})  # fmt: skip
        client = VLMClient(config.describer)

        async def ask(client: VLMClient = client) -> dict[str, Any]:
            try:
                return (await client.describe(clip, prompt))[1]
            finally:
                await client.close()

        used[fmt] = asyncio.run(ask())["prompt_tokens"] - text
    # a video merges frames in pairs (Qwen2-VL's temporal patch): n frames are n/2 images'
    # worth of tokens; n separate images are n images' worth
    assert used["images"] == n * one, (used, one)
    assert abs(used["frames"] - math.ceil(n / 2) * one) <= 4, (used, one)
    assert used["video_url"] == used["frames"], used  # the MP4 decodes to the same n frames


# -- end to end ----------------------------------------------------------------------------
FPS = 4
COUNT = 24  # 6 s
A = Walker(0, start=(10, 240), end=(520, 250), first=0, last=COUNT - 1)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_clip_camera_is_described_from_a_video_of_its_track(
    tmp_path: Path, redis_server: Any, vlm_server: str, make_config: Any
) -> None:
    clip_file = write_clip(tmp_path / "clip.mp4", [A], COUNT, FPS)
    camera = {
        "id": "yard",
        "url": str(clip_file),
        "fps": FPS,
        "loop": False,
        "gate": {"describe_on": ["track_start"], "min_frames": 4, "min_interval_s": 0},
        "describer": {"view": "clip", "clip_frames": 4},
    }
    config = make_config(
        redis_server.url,
        cameras=[camera],
        describer={"base_url": vlm_server, "max_tokens": 4},
    )
    client = redis_server.client()
    worker = DescriberThread(config, "clip-e2e").start()
    pipeline = CameraPipeline(config, DifferenceDetector())
    thread = threading.Thread(target=pipeline.run, daemon=True)
    thread.start()
    try:
        reader = pipeline.readers["yard"]
        wait_until(lambda: reader.stats.sampled >= COUNT - 4, 60, what="the clip played")
    finally:
        pipeline.stop()
        thread.join(20)
    try:
        wait_all_described(pipeline, client, config.queue, 90, "every enqueued clip described")
    finally:
        worker.stop()
    got = descriptions(client, config.queue)
    entries = {e[b"frame_uid"].decode(): e for _, e in client.xrange(config.queue.frames_stream)}
    for described in got:
        assert described["clip_frames"] == "4", described
        entry = {k.decode(): v.decode() for k, v in entries[described["frame_uid"]].items()}
        assert client.get(entry["clip"]) is None  # deleted with the result
        snapshot = client.get(entry["image"])  # kept: the event's snapshot
        image = cv2.imdecode(np.frombuffer(snapshot, np.uint8), 1)
        assert image.shape[0] * image.shape[1] < 640 * 480 / 2  # cropped to the track
        prompt = build_prompt(config.prompt_for("yard"), entry)
        assert "a clip: 4 frames over" in prompt and "Over the clip: person #" in prompt
        text = _tokens(vlm_server, [{"type": "text", "text": prompt}])
        one = _image_tokens(vlm_server, snapshot, prompt) - text
        # four frames of the snapshot's size, merged in pairs: two images' worth of tokens
        assert abs(int(described["prompt_tokens"]) - text - 2 * one) <= 4, (described, one)
