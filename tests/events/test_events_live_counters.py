"""``GET /api/cameras``: each camera's live numbers from the pipeline that reads it.

A real pipeline (file camera, the untrained YOLO26n, gate, producer) against a real
redis-server, the ui on real uvicorn: the camera shows its decoded fps, its drops by reason,
what it queued and what waits for a describer, and once the pipeline stops it shows offline --
and after the record's TTL there is no record at all, never the numbers it stopped with.
"""

from __future__ import annotations

import pytest

from tests.events.events_helpers import PipelineRunner, describe, get, live_config
from tests.pipelines.pipeline_helpers import wait_until

pytestmark = pytest.mark.timeout(60)


def yard(ui) -> dict:
    body = get(ui.url, "/api/cameras").json()
    return next(c for c in body["data"] if c["id"] == "yard")


def test_a_running_pipeline_shows_live_counters_and_goes_offline_when_stopped(
    redis_server, tmp_path, video_file, start_ui
):
    config = live_config(redis_server.url, tmp_path / "events", video_file)
    describe(config, ["a person crosses the yard"], camera="yard")  # a latest description
    ui = start_ui(config)
    client = redis_server.client()
    key = f"{config.queue.camera_prefix}yard"

    with PipelineRunner(config) as runner:

        def counters_up() -> dict | None:
            live = yard(ui)["live"]
            return live if live and live["dropped"].get("queue_full", 0) > 0 else None

        live = wait_until(counters_up, 30, interval=0.2, what="queue_full drops in /api/cameras")
        assert live["state"] == "online" and live["connected"]
        assert live["decoded_fps"] > 0 and live["decoded"] >= live["sampled"] > 0
        assert live["detected"] > 0 and live["enqueued"] == 10
        assert live["dropped_total"] == sum(live["dropped"].values())
        assert live["instance"] == runner.pipeline.queue.instance
        assert live["last_frame_ts"] > 0 and live["persons"] == 0  # untrained: nobody found
        assert 0 < client.pttl(key) <= 600  # refreshed every beat, never kept
        camera = yard(ui)
        assert camera["queued"] == 10  # nobody describes: the stream is full
        assert camera["describer_lag_s"] is not None and camera["describer_lag_s"] >= 0

    # a clean stop says so at once; then the record expires
    assert yard(ui)["live"]["state"] == "offline"
    wait_until(lambda: yard(ui)["live"] is None, 10, what="the camera record expired")
    assert client.exists(key) == 0


def test_cameras_without_a_pipeline_have_no_live_record(config, ui):
    describe(config, ["someone at the door"], camera="door")
    camera = next(c for c in get(ui.url, "/api/cameras").json()["data"] if c["id"] == "door")
    assert camera["live"] is None and camera["queued"] == 0
    assert camera["describer_lag_s"] >= 0
