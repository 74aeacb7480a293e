"""The Redis producer: JPEG under its own key, metadata in the stream, every loss counted."""

from __future__ import annotations

import json
import time
from collections import Counter

import numpy as np
import pytest
from pipeline_helpers import wait_until

from pipelines.config import QueueConfig
from pipelines.detect import Detection
from pipelines.ingest import Frame
from pipelines.queue import FrameQueue, Outgoing, ensure_group, queue_depth, read_stats

pytestmark = pytest.mark.timeout(60)


def item(camera: str = "cam", age: float = 0.0, size: int = 64) -> Outgoing:
    image = np.random.default_rng(0).integers(0, 255, (size, size, 3), dtype=np.uint8)
    frame = Frame(camera, 1, time.time() - age, image)
    return Outgoing(frame, [Detection(0, "person", 0.87, (1.0, 2.0, 30.0, 40.0))], "first")


class Drops(Counter):
    def __call__(self, camera: str, reason: str) -> None:
        self[reason] += 1


@pytest.fixture
def producer(redis_server):
    made = []

    def build(**cfg) -> tuple[FrameQueue, Drops]:
        drops = Drops()
        queue = FrameQueue(redis_server.url, QueueConfig(**cfg), on_drop=drops)
        queue.start()
        made.append(queue)
        return queue, drops

    yield build
    for queue in made:
        queue.stop(flush_timeout=0.5)


def test_frame_goes_to_the_stream_and_its_jpeg_to_a_key_with_ttl(redis_server, producer) -> None:
    queue, drops = producer(image_ttl_s=120)
    queue.submit(item("front"))
    client = redis_server.client()
    cfg = queue.cfg
    wait_until(lambda: client.xlen(cfg.frames_stream) == 1, 5, what="entry")
    [(_id, fields)] = client.xrange(cfg.frames_stream)
    assert fields[b"camera"] == b"front" and fields[b"persons"] == b"1"
    assert json.loads(fields[b"boxes"])[0] == {
        "cls": 0, "label": "person", "conf": 0.87, "box": [1.0, 2.0, 30.0, 40.0]
    }  # fmt: skip
    key = fields[b"image"]
    assert client.get(key)[:2] == b"\xff\xd8"  # a JPEG
    assert 0 < client.ttl(key) <= 120
    assert read_stats(client, cfg)["enqueued"] == 1
    assert not drops


def test_large_frames_are_downscaled_with_their_boxes(redis_server, producer) -> None:
    queue, _ = producer(max_image_side=64)
    queue.submit(item(size=128))
    client = redis_server.client()
    wait_until(lambda: client.xlen(queue.cfg.frames_stream) == 1, 5, what="entry")
    [(_, fields)] = client.xrange(queue.cfg.frames_stream)
    assert fields[b"width"] == b"64"
    assert json.loads(fields[b"boxes"])[0]["box"] == [0.5, 1.0, 15.0, 20.0]


def test_full_queue_refuses_new_frames_and_counts_them(redis_server, producer) -> None:
    queue, drops = producer(maxlen=10)
    for _ in range(13):
        queue.submit(item())
    client = redis_server.client()
    wait_until(lambda: drops["queue_full"] == 3, 10, what="3 refusals")
    assert client.xlen(queue.cfg.frames_stream) == 10
    assert read_stats(client, queue.cfg) == {"enqueued": 10, "refused_queue_full": 3}
    assert queue_depth(client, queue.cfg)["lag"] == 10


def test_trimming_removes_only_delivered_entries_and_is_counted(redis_server, producer) -> None:
    client = redis_server.client()
    client.config_set("stream-node-max-entries", 5)  # let MAXLEN ~ trim at this small scale
    queue, drops = producer(maxlen=10)
    cfg = queue.cfg
    ensure_group(client, cfg)
    delivered: list[bytes] = []
    for _ in range(4):
        for _ in range(10):
            queue.submit(item())
        wait_until(lambda: client.xinfo_groups(cfg.frames_stream)[0]["lag"] == 10, 10, what="lag")
        reply = client.xreadgroup(cfg.group, "c1", {cfg.frames_stream: ">"}, count=10)
        delivered += [entry_id for entry_id, _ in reply[0][1]]
    stats = read_stats(client, cfg)
    assert stats["enqueued"] == 40 and len(set(delivered)) == 40
    assert stats["trimmed"] > 0 and stats["trimmed"] == 40 - client.xlen(cfg.frames_stream)
    assert not drops  # nothing undelivered was lost


def test_redis_outage_buffers_frames_and_reconnects(redis_server, producer) -> None:
    queue, drops = producer(local_buffer=4)
    client = redis_server.client()
    queue.submit(item())
    wait_until(lambda: queue.enqueued == 1, 5, what="first frame")
    redis_server.stop()
    for _ in range(6):
        queue.submit(item())
        time.sleep(0.05)
    wait_until(lambda: queue.redis_errors > 0, 10, what="redis error seen")
    assert drops["buffer_full"] >= 2  # newest 4 kept, older ones dropped and counted
    redis_server.start()
    wait_until(lambda: queue.enqueued + sum(drops.values()) == 7, 20, what="buffer drained")
    client = redis_server.client()
    assert client.xlen(queue.cfg.frames_stream) == queue.enqueued
    assert queue.enqueued + drops["buffer_full"] == 7


def test_frames_too_old_to_matter_are_dropped_as_expired(redis_server, producer) -> None:
    queue, drops = producer(max_frame_age_s=5)
    queue.submit(item(age=10))
    queue.submit(item())
    wait_until(lambda: queue.enqueued == 1 and drops["expired"] == 1, 5, what="expiry")
