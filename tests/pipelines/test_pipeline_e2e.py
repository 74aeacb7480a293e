"""Camera to description, end to end: RTSP -> YOLO26 -> gate -> Redis -> describer -> VLM.

The happy path runs against our own ``vision-serve serve`` (tiny checkpoint) with the person
detector ``vision-serve make-detector`` trained offline: it finds the people of the test
video's bus and zidane frames and nobody in its flat grey ones, so the gate
(``min_persons: 1``) runs on real detections. Fault tests use the recording double.
"""

from __future__ import annotations

import signal
import threading
import time
from collections import Counter
from typing import Any

import cv2
import numpy as np
import pytest
from pipeline_helpers import (
    DescriberThread,
    descriptions,
    is_blank,
    pending_count,
    wait_until,
)

from pipelines import metrics
from pipelines.pipeline import CameraPipeline
from pipelines.queue import queue_depth, read_stats


class PipelineThread:
    def __init__(self, config: Any, detector: Any) -> None:
        self.pipeline = CameraPipeline(config, detector)
        self.thread = threading.Thread(target=self.pipeline.run, daemon=True)

    def __enter__(self) -> CameraPipeline:
        self.thread.start()
        return self.pipeline

    def __exit__(self, *exc: Any) -> None:
        self.pipeline.stop()
        self.thread.join(20)
        assert not self.thread.is_alive(), "pipeline did not stop"


BEFORE_DETECTION = ("detector_busy", "detector_error", "shutdown_undetected")


def assert_every_frame_accounted_for(pipeline: CameraPipeline) -> None:
    """After stop: each sampled frame was detected or dropped; each gated frame enqueued or
    dropped -- with a reason, nothing silently."""
    for camera_id, reader in pipeline.readers.items():
        dropped = Counter(reader.stats.dropped)
        detected = pipeline.detected[camera_id]
        undetected = sum(dropped[r] for r in BEFORE_DETECTION)
        assert reader.stats.sampled == detected + undetected, (camera_id, reader.stats, detected)
    unsent = sum(
        n
        for reader in pipeline.readers.values()
        for reason, n in reader.stats.dropped.items()
        if reason not in BEFORE_DETECTION
    )
    assert pipeline.sent.total() == pipeline.queue.enqueued + unsent


def gate_count(camera: str, reason: str) -> float:
    return metrics.GATE_DECISIONS.labels(camera, "skip", reason)._value.get()


@pytest.mark.timeout(600)  # the first run on a machine trains the detector (cached after)
def test_rtsp_frames_with_people_are_described_by_our_server(
    rtsp_server, redis_server, person_detector, vlm_server, make_config
):
    config = make_config(
        redis_server.url,
        cameras=[{"id": "e2e-cam", "url": rtsp_server.url, "fps": 5}],
        gate={"min_persons": 1, "cooldown_s": 2, "min_interval_s": 0.5},
        describer={"base_url": vlm_server, "model": "tiny", "max_tokens": 8, "timeout_s": 60},
        queue={"max_frame_age_s": 120},
    )
    client = redis_server.client()
    detector = person_detector
    calls_before = detector.calls
    skipped_before = gate_count("e2e-cam", "too_few_persons")
    worker = DescriberThread(config, "e2e").start()
    try:
        with PipelineThread(config, detector) as pipeline:
            # both: a warm describer can finish 2 descriptions within the first 3 frames
            wait_until(
                lambda: (
                    len(descriptions(client, config.queue)) >= 2
                    and pipeline.detected["e2e-cam"] >= 5
                ),
                150,
                what="2 described and 5 frames detected",
            )
        # the pipeline stopped; the describer finishes what was enqueued
        wait_until(
            lambda: (
                pending_count(client, config.queue) == 0
                and queue_depth(client, config.queue)["lag"] == 0
            ),
            120,
            what="queue drained",
        )
    finally:
        worker.stop()

    assert detector.calls > calls_before  # the real ultralytics model ran on the frames
    assert pipeline.detected["e2e-cam"] >= 5
    assert gate_count("e2e-cam", "too_few_persons") > skipped_before  # empty frames gated out
    got = descriptions(client, config.queue)
    stats = read_stats(client, config.queue)
    assert stats["enqueued"] == pipeline.queue.enqueued
    assert stats["described"] == len(got) == stats["enqueued"]  # nothing lost, nothing twice
    assert len({d["frame_id"] for d in got}) == len(got)
    for d in got:
        assert d["camera"] == "e2e-cam" and d["model"] and d["worker"] == "e2e"
        assert float(d["latency_s"]) > 0 and int(d["persons"]) >= 1
        jpeg = client.get(d["image"])  # described frames keep their JPEG until the TTL
        image = cv2.imdecode(np.frombuffer(jpeg, np.uint8), cv2.IMREAD_COLOR)
        assert not is_blank(image)  # only frames with (detected) people were described
    assert_every_frame_accounted_for(pipeline)


@pytest.mark.timeout(120)
def test_pipeline_and_describer_reconnect_after_redis_restart(
    rtsp_server, redis_server, detector, vlm_double, make_config
):
    """Redis is SIGKILLed mid-run. AOF with appendfsync always: acknowledged descriptions
    survive; ingest buffers (bounded, counted) and both sides reconnect."""
    assert redis_server.FSYNC_POLICY == "always"
    config = make_config(
        redis_server.url,
        cameras=[{"id": "restart-cam", "url": rtsp_server.url, "fps": 2}],
        gate={"min_persons": 0, "cooldown_s": 0.4, "min_interval_s": 0},
        describer={"base_url": vlm_double.base_url},
    )
    q = config.queue
    worker = DescriberThread(config, "w1").start()
    try:
        with PipelineThread(config, detector) as pipeline:
            client = redis_server.client()
            wait_until(lambda: len(descriptions(client, q)) >= 3, 40, what="3 described")
            before = {d["frame_id"] for d in descriptions(client, q)}
            redis_server.restart(signal.SIGKILL, down_for=2.0)
            client = redis_server.client()
            survived = {d["frame_id"] for d in descriptions(client, q)}
            assert before <= survived  # every acknowledged description is still there
            wait_until(lambda: len(descriptions(client, q)) >= len(survived) + 3, 40, what="3 more")
            assert pipeline.queue.redis_errors > 0
            assert all(r.stats.connected for r in pipeline.readers.values())
        wait_until(lambda: pending_count(client, q) == 0, 20, what="queue drained")
    finally:
        worker.stop()
    stats = read_stats(client, q)
    assert stats["described"] == len(descriptions(client, q))
    assert_every_frame_accounted_for(pipeline)
    assert time.time() - max(float(d["ts"]) for d in descriptions(client, q)) < 30
