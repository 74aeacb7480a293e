"""Describer workers: consumer group delivery, reclaim, expiry, dead letters, outages.

The VLM here is a recording double (``VLMDouble``): these tests inject faults. The happy
path against our real server is in ``test_pipeline_e2e.py``.
"""

from __future__ import annotations

import base64
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import cv2
import numpy as np
import pytest
from pipeline_helpers import (
    REPO,
    DescriberThread,
    VLMDouble,
    descriptions,
    enqueue_frames,
    kill_group,
    pending_count,
    wait_until,
    write_config,
)

from pipelines import metrics
from pipelines.queue import COMMIT_LUA, accounting, read_stats
from pipelines.vlm import fit_frame, fit_size

pytestmark = pytest.mark.timeout(90)


def test_frames_are_described_acknowledged_and_stored(redis_server, vlm_double, make_config):
    config = make_config(redis_server.url, describer={"base_url": vlm_double.base_url})
    ids = enqueue_frames(redis_server.url, config.queue, 3, camera="door")
    worker = DescriberThread(config, "w1").start()
    client = redis_server.client()
    try:
        wait_until(lambda: len(descriptions(client, config.queue)) == 3, 15, what="3 described")
    finally:
        worker.stop()
    got = descriptions(client, config.queue)
    assert sorted(d["frame_id"] for d in got) == sorted(ids)
    assert all(d["text"].startswith("double description") and d["camera"] == "door" for d in got)
    assert pending_count(client, config.queue) == 0
    assert read_stats(client, config.queue)["described"] == 3
    latest = client.hgetall(f"{config.queue.latest_prefix}door")
    assert latest[b"frame_id"].decode() in ids
    # what the endpoint saw: image as a data URL, camera and detections in the prompt, batch
    request = vlm_double.requests[0]
    content = request["messages"][0]["content"]
    assert content[0]["image_url"]["url"].startswith("data:image/jpeg;base64,")
    assert "Camera: door" in content[1]["text"] and "person 0.90" in content[1]["text"]
    assert request["priority"] == "batch" and request["model"] == "tiny"
    # the frame's remaining age, so the server drops it unstarted once stale
    assert 0 < request["max_queue_seconds"] <= config.queue.max_frame_age_s


@pytest.mark.parametrize(
    ("size", "max_pixels"),
    [((640, 480), 200704), ((1920, 1080), 50176), ((480, 640), 12544), ((333, 77), 5000)],
)
def test_fit_size_stays_under_max_pixels_and_keeps_the_aspect_ratio(size, max_pixels) -> None:
    width, height = size
    w, h = fit_size(width, height, max_pixels)
    assert w * h <= max_pixels
    assert (w + 1) * (h + 1) > max_pixels, "as large as the budget allows (up to 1 px per side)"
    assert abs(w / h - width / height) <= width / height * 0.02


def test_fit_size_edge_cases() -> None:
    assert fit_size(640, 480, 640 * 480) == (640, 480)  # fits: untouched
    assert fit_size(10000, 1, 100) == (100, 1)  # a side cannot go below 1 px
    assert fit_size(1, 10000, 100) == (1, 100)


def _jpeg(width: int, height: int) -> bytes:
    rng = np.random.default_rng(0)
    image = rng.integers(0, 255, (height, width, 3), dtype=np.uint8)
    return cv2.imencode(".jpg", image)[1].tobytes()


def test_fit_frame_downscales_the_jpeg_and_the_prompt_fields() -> None:
    boxes = json.dumps([{"label": "person", "conf": 0.9, "box": [64.0, 48.0, 320.0, 480.0]}])
    fields = {"camera": "door", "width": "640", "height": "480", "boxes": boxes}
    jpeg, out = fit_frame(_jpeg(640, 480), fields, 160 * 120, quality=85)
    image = cv2.imdecode(np.frombuffer(jpeg, np.uint8), cv2.IMREAD_COLOR)
    assert image.shape[:2] == (120, 160)  # 1/4 per side, exactly 160x120 pixels
    assert (out["width"], out["height"], out["camera"]) == ("160", "120", "door")
    assert json.loads(out["boxes"])[0]["box"] == [16.0, 12.0, 80.0, 120.0]
    assert fields["width"] == "640", "the stored frame's fields are not changed"
    # a frame that fits, or one that does not decode, goes out as it came
    small = _jpeg(64, 48)
    assert fit_frame(small, fields, 64 * 48, quality=85) == (small, fields)
    assert fit_frame(b"not a jpeg", fields, 100, quality=85) == (b"not a jpeg", fields)


def test_describer_sends_frames_downscaled_to_max_pixels(redis_server, vlm_double, make_config):
    config = make_config(
        redis_server.url, describer={"base_url": vlm_double.base_url, "max_pixels": 32 * 32}
    )
    enqueue_frames(redis_server.url, config.queue, 1, camera="door")  # 64x64, box 1..20 px
    worker = DescriberThread(config, "w1").start()
    client = redis_server.client()
    try:
        wait_until(lambda: len(descriptions(client, config.queue)) == 1, 15, what="described")
    finally:
        worker.stop()
    content = vlm_double.requests[0]["messages"][0]["content"]
    jpeg = base64.b64decode(content[0]["image_url"]["url"].split(",", 1)[1])
    image = cv2.imdecode(np.frombuffer(jpeg, np.uint8), cv2.IMREAD_COLOR)
    assert image.shape[:2] == (32, 32)
    assert "in a 32x32 image" in content[1]["text"]  # detections in the sent image's pixels
    # what is stored keeps the queued frame's coordinates (its JPEG is the full-size one)
    stored = descriptions(client, config.queue)[0]
    assert json.loads(stored["boxes"])[0]["box"] == [1.0, 1.0, 20.0, 20.0]


def test_frames_older_than_max_age_are_expired_without_a_request(
    redis_server, vlm_double, make_config
):
    config = make_config(
        redis_server.url, describer={"base_url": vlm_double.base_url}, queue={"max_frame_age_s": 5}
    )
    # enqueued by a producer that still accepts them (its own max age is larger)
    producer_cfg = config.queue.model_copy(update={"max_frame_age_s": 60})
    enqueue_frames(redis_server.url, producer_cfg, 2, age=30)
    worker = DescriberThread(config, "w1").start()
    client = redis_server.client()
    try:
        wait_until(
            lambda: read_stats(client, config.queue).get("expired:max_age") == 2, 10, what="expiry"
        )
    finally:
        worker.stop()
    assert vlm_double.requests == [] and descriptions(client, config.queue) == []
    assert pending_count(client, config.queue) == 0


def test_a_killed_describer_loses_nothing_and_nothing_is_described_twice(
    redis_server, make_config, tmp_path: Path
):
    """Worker A (a real process) dies holding 4 frames; worker B reclaims and finishes all."""
    with VLMDouble(delay=30.0) as slow, VLMDouble() as fast:
        config_a = make_config(
            redis_server.url, describer={"base_url": slow.base_url, "concurrency": 4}
        )
        ids = enqueue_frames(redis_server.url, config_a.queue, 6)
        cmd = [sys.executable, "-m", "vision_serve.cli", "describe"]
        cmd += ["--config", str(write_config(tmp_path / "a.yaml", config_a)), "--consumer", "A"]
        proc = subprocess.Popen(cmd, cwd=REPO, start_new_session=True)
        client = redis_server.client()
        try:
            wait_until(lambda: len(slow.requests) == 4, 30, what="A holds 4 frames")
            kill_group(proc, signal.SIGKILL)  # mid-batch: 4 requests in flight, none answered
        finally:
            kill_group(proc, signal.SIGKILL)
        pel = client.xpending(config_a.queue.frames_stream, config_a.queue.group)
        assert pel["pending"] == 4 and pel["consumers"][0]["name"] == b"A"

        config_b = make_config(redis_server.url, describer={"base_url": fast.base_url})
        worker = DescriberThread(config_b, "B").start()
        try:
            wait_until(lambda: len(descriptions(client, config_b.queue)) >= 6, 30, what="all 6")
            time.sleep(1.0)  # a duplicate would show up now
        finally:
            worker.stop()
    got = [d["frame_id"] for d in descriptions(client, config_b.queue)]
    assert sorted(got) == sorted(ids)  # every frame once: none lost, none twice
    assert pending_count(client, config_b.queue) == 0
    assert worker.describer.counts["reclaimed"] == 4
    stats = read_stats(client, config_b.queue)
    assert stats["described"] == 6 and "duplicate_discarded" not in stats
    assert accounting(client, config_b.queue)["holds"]


def test_commit_is_gated_on_the_acknowledgement(redis_server, make_config):
    """Two workers finishing the same frame: the second result is discarded and counted."""
    config = make_config(redis_server.url)
    q = config.queue
    [entry_id] = enqueue_frames(redis_server.url, q, 1)
    client = redis_server.client()
    client.xreadgroup(q.group, "slow", {q.frames_stream: ">"}, count=1)
    client.xclaim(q.frames_stream, q.group, "fast", 0, [entry_id])
    commit = client.register_script(COMMIT_LUA)
    keys = [q.frames_stream, q.descriptions_stream, f"{q.latest_prefix}cam", q.stats_key]
    results = [
        commit(keys=keys, args=[q.group, entry_id, "described", "described", 100, "text", who])
        for who in ("fast", "slow")
    ]
    assert results == [1, 0]
    assert [(d["n"], d["text"]) for d in descriptions(client, q)] == [("1", "fast")]
    assert read_stats(client, q) == {
        "enqueued": 1,
        "described": 1,
        "duplicate_discarded": 1,
        f"appended:{q.descriptions_stream}": 1,  # the entry's number, not an outcome
    }


def test_frames_delivered_too_often_go_to_the_dead_letter_stream(
    redis_server, vlm_double, make_config
):
    config = make_config(
        redis_server.url,
        describer={"base_url": vlm_double.base_url, "max_deliveries": 2, "claim_idle_s": 0.3},
    )
    q = config.queue
    [entry_id] = enqueue_frames(redis_server.url, q, 1)
    client = redis_server.client()
    client.xreadgroup(q.group, "crashed-1", {q.frames_stream: ">"}, count=1)
    client.xclaim(q.frames_stream, q.group, "crashed-2", 0, [entry_id])  # 2nd delivery
    time.sleep(0.4)
    worker = DescriberThread(config, "w1").start()  # its reclaim is the 3rd delivery
    try:
        wait_until(lambda: client.xlen(q.dead_letter_stream) == 1, 10, what="dead letter")
    finally:
        worker.stop()
    [(_id, dead)] = client.xrange(q.dead_letter_stream)
    assert dead[b"frame_id"].decode() == entry_id and dead[b"reason"] == b"max_deliveries"
    assert vlm_double.requests == [] and pending_count(client, q) == 0
    assert read_stats(client, q)["dead:max_deliveries"] == 1


def test_a_pending_frame_deleted_from_the_stream_is_counted_dead(
    redis_server, vlm_double, make_config
):
    config = make_config(
        redis_server.url, describer={"base_url": vlm_double.base_url, "claim_idle_s": 0.3}
    )
    q = config.queue
    [entry_id] = enqueue_frames(redis_server.url, q, 1)
    client = redis_server.client()
    client.xreadgroup(q.group, "crashed", {q.frames_stream: ">"}, count=1)
    client.xdel(q.frames_stream, entry_id)  # not our trimming: someone else's XDEL
    time.sleep(0.4)
    worker = DescriberThread(config, "w1").start()
    try:
        wait_until(lambda: client.xlen(q.dead_letter_stream) == 1, 10, what="dead letter")
    finally:
        worker.stop()
    [(_id, dead)] = client.xrange(q.dead_letter_stream)
    assert dead[b"frame_id"].decode() == entry_id and dead[b"reason"] == b"trimmed_pending"
    assert read_stats(client, q)["dead:trimmed_pending"] == 1
    assert accounting(client, q)["holds"] and pending_count(client, q) == 0


def test_a_frame_the_endpoint_rejects_is_dead_lettered(redis_server, vlm_double, make_config):
    vlm_double.status = 400
    config = make_config(redis_server.url, describer={"base_url": vlm_double.base_url})
    enqueue_frames(redis_server.url, config.queue, 1)
    worker = DescriberThread(config, "w1").start()
    client = redis_server.client()
    try:
        wait_until(lambda: client.xlen(config.queue.dead_letter_stream) == 1, 10, what="dead")
    finally:
        worker.stop()
    [(_id, dead)] = client.xrange(config.queue.dead_letter_stream)
    assert dead[b"reason"] == b"rejected" and b"HTTP 400" in dead[b"detail"]
    assert len(vlm_double.requests) == 1  # not retried


def test_a_frame_that_keeps_getting_500_is_dead_lettered_and_later_frames_are_described(
    redis_server, vlm_double, make_config
):
    vlm_double.status = 500
    config = make_config(
        redis_server.url, describer={"base_url": vlm_double.base_url, "max_failures": 3}
    )
    q = config.queue
    client = redis_server.client()
    [entry_id] = enqueue_frames(redis_server.url, q, 1)
    worker = DescriberThread(config, "w1").start()
    try:
        started = time.monotonic()
        wait_until(lambda: client.xlen(q.dead_letter_stream) == 1, 10, what="dead letter")
        assert time.monotonic() - started < 5  # 3 tries with backoff, not until max age (60 s)
        assert len(vlm_double.requests) == 3
        [(_id, dead)] = client.xrange(q.dead_letter_stream)
        assert dead[b"frame_id"].decode() == entry_id and dead[b"reason"] == b"server_error"
        assert b"HTTP 500" in dead[b"detail"]
        vlm_double.status = 200
        [good] = enqueue_frames(redis_server.url, q, 1)
        wait_until(lambda: len(descriptions(client, q)) == 1, 10, what="described")
    finally:
        worker.stop()
    assert descriptions(client, q)[0]["frame_id"] == good
    stats = read_stats(client, q)
    assert stats["dead:server_error"] == 1 and stats["described"] == 1
    assert accounting(client, q)["holds"] and pending_count(client, q) == 0


def test_a_503_is_an_outage_the_frame_waits_for_not_a_frame_failure(
    redis_server, vlm_double, make_config
):
    vlm_double.status = 503
    config = make_config(
        redis_server.url, describer={"base_url": vlm_double.base_url, "max_failures": 1}
    )
    q = config.queue
    client = redis_server.client()
    enqueue_frames(redis_server.url, q, 1)
    worker = DescriberThread(config, "w1").start()
    try:
        wait_until(lambda: len(vlm_double.requests) >= 3, 10, what="3 tries")
        assert not worker.describer.endpoint_ok and client.xlen(q.dead_letter_stream) == 0
        vlm_double.status = 200
        wait_until(lambda: len(descriptions(client, q)) == 1, 10, what="described")
    finally:
        worker.stop()
    assert accounting(client, q)["holds"]


def test_endpoint_down_frames_wait_then_expire_counted_and_work_resumes(
    redis_server, make_config, closed_port_url
):
    config = make_config(
        redis_server.url,
        describer={"base_url": closed_port_url, "concurrency": 4},
        queue={"max_frame_age_s": 3},
    )
    q = config.queue
    client = redis_server.client()
    enqueue_frames(redis_server.url, q, 1)
    worker = DescriberThread(config, "w1").start()
    try:
        wait_until(lambda: not worker.describer.endpoint_ok, 10, what="endpoint seen down")
        enqueue_frames(redis_server.url, q, 3)
        time.sleep(0.5)
        # while the endpoint fails, one frame probes it; new ones wait in the stream (a read
        # already blocking when the endpoint failed may still take one more)
        assert worker.alive and metrics.VLM_UP._value.get() == 0
        lag = client.xinfo_groups(q.frames_stream)[0]["lag"]
        assert lag >= 2 and pending_count(client, q) + lag == 4
        wait_until(lambda: read_stats(client, q).get("expired:max_age") == 4, 15, what="4 expired")
        assert descriptions(client, q) == [] and pending_count(client, q) == 0
        # the endpoint comes back on the same address: new frames are described
        port = int(closed_port_url.rsplit(":", 1)[1].split("/")[0])
        with VLMDouble(port=port):
            enqueue_frames(redis_server.url, q, 2)
            wait_until(lambda: len(descriptions(client, q)) == 2, 15, what="described after")
        assert worker.describer.endpoint_ok
    finally:
        worker.stop()


def test_describer_survives_a_redis_restart_and_acknowledged_work_persists(
    redis_server, vlm_double, make_config
):
    """Redis is SIGKILLed; with AOF appendfsync always every acknowledged result survives."""
    assert redis_server.FSYNC_POLICY == "always"
    config = make_config(redis_server.url, describer={"base_url": vlm_double.base_url})
    q = config.queue
    worker = DescriberThread(config, "w1").start()
    try:
        before = enqueue_frames(redis_server.url, q, 3)
        client = redis_server.client()
        wait_until(lambda: len(descriptions(client, q)) == 3, 15, what="3 described")
        redis_server.restart(signal.SIGKILL, down_for=1.5)
        client = redis_server.client()
        got = [d["frame_id"] for d in descriptions(client, q)]
        assert sorted(got) == sorted(before)  # acknowledged descriptions survived
        assert read_stats(client, q)["described"] == 3
        after = enqueue_frames(redis_server.url, q, 2)
        wait_until(lambda: len(descriptions(client, q)) == 5, 20, what="described after restart")
        assert worker.alive
    finally:
        worker.stop()
    assert sorted(d["frame_id"] for d in descriptions(client, q)) == sorted(before + after)
    assert pending_count(client, q) == 0
