"""The Redis producer: JPEG under its own key, metadata in the stream, every loss counted."""

from __future__ import annotations

import itertools
import json
import time
from collections import Counter

import numpy as np
import pytest
import redis
from pipeline_helpers import wait_until

from pipelines.config import QueueConfig
from pipelines.detect import Detection
from pipelines.ingest import Frame
from pipelines.queue import (
    COMMIT_LUA,
    FrameQueue,
    Outgoing,
    accounting,
    ensure_group,
    queue_depth,
    read_stats,
)

pytestmark = pytest.mark.timeout(60)

SEQ = itertools.count(1)  # as a camera reader numbers its samples


def item(camera: str = "cam", age: float = 0.0, size: int = 64) -> Outgoing:
    image = np.random.default_rng(0).integers(0, 255, (size, size, 3), dtype=np.uint8)
    frame = Frame(camera, next(SEQ), time.time() - age, image)
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


def finish(client, cfg, *ids: bytes, outcome: str = "described", stat: str = "described"):
    """What a describer's commit does for each entry: acknowledge, store and count."""
    commit = client.register_script(COMMIT_LUA)
    keys = [cfg.frames_stream, cfg.descriptions_stream, f"{cfg.latest_prefix}cam", cfg.stats_key]
    for entry_id in ids:
        args = [cfg.group, entry_id, outcome, stat, 100, "frame_id", entry_id, "text", "seen"]
        assert commit(keys=keys, args=args) == 1


def enqueued(client, cfg, n: int) -> None:
    wait_until(lambda: read_stats(client, cfg).get("enqueued", 0) >= n, 10, what=f"{n} enqueued")


def test_trimming_removes_only_acknowledged_entries_and_is_counted(redis_server, producer):
    queue, drops = producer(maxlen=10)
    cfg = queue.cfg
    client = redis_server.client()
    ensure_group(client, cfg)
    for _ in range(10):
        queue.submit(item())
    enqueued(client, cfg, 10)
    reply = client.xreadgroup(cfg.group, "c1", {cfg.frames_stream: ">"}, count=10)
    ids = [entry_id for entry_id, _ in reply[0][1]]
    finish(client, cfg, *ids[:6])  # 6 done, 4 still held by c1
    for _ in range(10):
        queue.submit(item())
    enqueued(client, cfg, 20)
    stats = read_stats(client, cfg)
    assert stats["trimmed"] == 6 == 20 - client.xlen(cfg.frames_stream)
    remaining = {entry_id for entry_id, _ in client.xrange(cfg.frames_stream)}
    assert set(ids[6:]) <= remaining and not set(ids[:6]) & remaining
    assert not drops and accounting(client, cfg)["holds"]


def test_trimming_never_removes_a_frame_a_worker_holds(redis_server, producer):
    """Past maxlen, a delivered but unacknowledged entry stays; its result is stored."""
    queue, drops = producer(maxlen=10)
    cfg = queue.cfg
    client = redis_server.client()
    client.config_set("stream-node-max-entries", 5)  # so that XADD MAXLEN ~ would trim it
    ensure_group(client, cfg)

    def deliver(n: int, consumer: str, ack: bool) -> list[bytes]:
        for _ in range(n):
            queue.submit(item())
        wait_until(lambda: queue_depth(client, cfg)["lag"] == n, 10, what=f"{n} undelivered")
        reply = client.xreadgroup(cfg.group, consumer, {cfg.frames_stream: ">"}, count=n)
        ids = [entry_id for entry_id, _ in reply[0][1]]
        if ack:
            finish(client, cfg, *ids)
        return ids

    deliver(5, "fast", ack=True)
    [held] = deliver(1, "slow", ack=False)
    for _round in range(3):  # 30 more, well past maxlen
        deliver(10, "fast", ack=True)
    # only the 5 acknowledged entries older than the held one could go
    assert read_stats(client, cfg)["trimmed"] == 5 and client.xlen(cfg.frames_stream) == 31
    assert client.xrange(cfg.frames_stream, min=held, max=held), "the held entry was trimmed"
    assert client.xpending(cfg.frames_stream, cfg.group)["pending"] == 1
    finish(client, cfg, held)
    assert held in [f[b"frame_id"] for _, f in client.xrange(cfg.descriptions_stream)]
    stats = read_stats(client, cfg)
    assert stats["described"] == 36 and "duplicate_discarded" not in stats
    assert not drops and accounting(client, cfg)["holds"]


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
    # drops counted while Redis was down reach the stats hash on the next contact
    wait_until(
        lambda: read_stats(client, queue.cfg).get("dropped:buffer_full") == drops["buffer_full"],
        5,
        what="drops counted in Redis",
    )


def test_frames_too_old_to_matter_are_dropped_as_expired(redis_server, producer) -> None:
    queue, drops = producer(max_frame_age_s=5)
    queue.submit(item(age=10))
    queue.submit(item())
    wait_until(lambda: queue.enqueued == 1 and drops["expired"] == 1, 5, what="expiry")
    client = redis_server.client()
    wait_until(
        lambda: read_stats(client, queue.cfg).get("dropped:expired") == 1, 5, what="in Redis"
    )


def test_a_retried_send_enqueues_the_frame_once(redis_server) -> None:
    """The same frame sent twice (a retry after a lost reply): one entry, the same id."""
    queue = FrameQueue(redis_server.url, QueueConfig(), on_drop=Drops())
    client = redis_server.client()
    frame = item()
    queue._send(frame)
    queue._send(frame)
    [(entry_id, fields)] = client.xrange(queue.cfg.frames_stream)
    assert fields[b"frame_uid"].decode() == f"cam:{queue.run_id}:{frame.frame.seq}"
    stats = read_stats(client, queue.cfg)
    assert stats["enqueued"] == 1 and stats["enqueue_duplicate"] == 1
    assert queue.enqueued == 1 + queue.duplicates == 2  # the process counts its sends
    dedupe = f"{queue.cfg.dedupe_prefix}{fields[b'frame_uid'].decode()}"
    assert client.get(dedupe) == entry_id
    assert client.ttl(dedupe) >= queue.cfg.image_ttl_s - 5


class TimesOutAfterRunning:
    """The enqueue script runs in Redis, then the client's socket times out (reply lost)."""

    def __init__(self, script) -> None:
        self.script = script
        self.calls = 0

    def __call__(self, **kwargs):
        self.calls += 1
        reply = self.script(**kwargs)
        if self.calls == 1:
            raise redis.TimeoutError("Timeout reading from socket")
        return reply


def test_a_send_retried_after_a_socket_timeout_is_not_enqueued_twice(redis_server, producer):
    queue, drops = producer()
    queue._enqueue = TimesOutAfterRunning(queue._enqueue)
    queue.submit(item())
    client = redis_server.client()
    wait_until(lambda: queue._enqueue.calls == 2 and queue.enqueued == 1, 10, what="the retry")
    assert client.xlen(queue.cfg.frames_stream) == 1 and queue.redis_errors == 1
    stats = read_stats(client, queue.cfg)
    assert stats["enqueued"] == 1 and stats["enqueue_duplicate"] == 1
    assert not drops and accounting(client, queue.cfg)["holds"]


def test_a_restarted_pipeline_reusing_seq_numbers_is_not_taken_for_a_retry(redis_server):
    client = redis_server.client()
    cfg = QueueConfig()
    frame = item()
    for _run in range(2):  # two processes, both at camera seq N
        FrameQueue(redis_server.url, cfg, on_drop=Drops())._send(frame)
    uids = {f[b"frame_uid"] for _, f in client.xrange(cfg.frames_stream)}
    assert len(uids) == 2 and read_stats(client, cfg)["enqueued"] == 2


def test_a_killed_pipeline_leaves_its_buffered_frames_to_be_counted_lost(redis_server):
    """SIGKILL leaves the producer record; the next run under the name counts lost:crash."""
    cfg = QueueConfig(instance="edge-1")
    client = redis_server.client()
    dead = FrameQueue(redis_server.url, cfg, on_drop=Drops())
    for _ in range(3):  # buffered, never sent (its thread is not running)
        dead.submit(item())
    dead._report("start")  # what its thread writes every heartbeat_s
    record = client.hgetall(f"{cfg.producer_prefix}edge-1")
    assert record[b"run"] == dead.run_id.encode() and record[b"buffered"] == b"3"
    assert 0 < client.ttl(f"{cfg.producer_prefix}edge-1") <= cfg.producer_ttl_s
    # the process dies here; a new one starts under the same instance name
    successor = FrameQueue(redis_server.url, cfg, on_drop=Drops())
    successor.start()
    try:
        wait_until(lambda: successor.lost_crash == 3, 5, what="previous run counted")
        assert read_stats(client, cfg)["lost:crash"] == 3
        record = client.hgetall(f"{cfg.producer_prefix}edge-1")
        assert record[b"run"] == successor.run_id.encode() and record[b"buffered"] == b"0"
        assert accounting(client, cfg)["not_enqueued"] == {"lost:crash": 3}
    finally:
        successor.stop(flush_timeout=0.5)
    assert client.exists(f"{cfg.producer_prefix}edge-1") == 0  # a clean stop leaves none
    third = FrameQueue(redis_server.url, cfg, on_drop=Drops())
    third._report("start")
    assert third.lost_crash == 0 and read_stats(client, cfg)["lost:crash"] == 3


def test_the_producer_record_tracks_frames_held_unsent(redis_server, producer):
    queue, _ = producer(instance="edge-2", heartbeat_s=0.2)
    client = redis_server.client()
    key = f"{queue.cfg.producer_prefix}edge-2"
    wait_until(lambda: client.hget(key, "run") == queue.run_id.encode(), 5, what="record")
    beat = float(client.hget(key, "heartbeat"))
    wait_until(lambda: float(client.hget(key, "heartbeat")) > beat, 5, what="a heartbeat")
    assert client.hget(key, "buffered") == b"0"


def test_accounting_reports_every_counter_and_the_identity(redis_server, producer) -> None:
    queue, _ = producer(maxlen=10)
    cfg = queue.cfg
    client = redis_server.client()
    for _ in range(12):
        queue.submit(item())
    wait_until(lambda: read_stats(client, cfg).get("refused_queue_full") == 2, 10, what="full")
    reply = client.xreadgroup(cfg.group, "w", {cfg.frames_stream: ">"}, count=4)
    ids = [entry_id for entry_id, _ in reply[0][1]]
    finish(client, cfg, ids[0])
    finish(client, cfg, ids[1], outcome="expired", stat="expired:max_age")
    finish(client, cfg, ids[2], outcome="dead", stat="dead:server_error")
    acc = accounting(client, cfg)
    assert acc["holds"] and acc["unaccounted"] == 0
    assert (acc["enqueued"], acc["described"], acc["expired"], acc["dead"]) == (10, 1, 1, 1)
    assert (acc["pending"], acc["in_pel"], acc["undelivered"]) == (7, 1, 6)
    assert acc["expired_by_reason"] == {"max_age": 1}
    assert acc["dead_by_reason"] == {"server_error": 1}
    assert acc["not_enqueued"] == {"refused_queue_full": 2}
    client.hincrby(cfg.stats_key, "enqueued", 1)  # a frame nobody can account for
    acc = accounting(client, cfg)
    assert not acc["holds"] and acc["unaccounted"] == 1
