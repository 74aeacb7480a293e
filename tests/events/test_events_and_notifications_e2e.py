"""Described frame -> one event, one MQTT message, one webhook: end to end, across restarts.

Everything real but the VLM: redis-server, a describer (``Describer`` against the VLM double),
``vision-serve ui`` as a process (its consumer writes SQLite), the notifier delivering to
Mosquitto and to a loopback webhook receiver that checks every signature. Twelve frames come
in three batches; between them the ui is killed with SIGKILL and the broker is stopped, once
while a batch is being described. At the end each described frame is exactly one event, and
each reached MQTT and the webhook at least once -- a repeat only ever with the same event id
and the same bytes.
"""

from __future__ import annotations

import json
import signal
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.events.events_helpers import UIProcess, event_ids, get, make_config
from tests.notify.notify_helpers import (
    Mosquitto,
    NotifierThread,
    Subscriber,
    WebhookReceiver,
    notify_section,
    settled,
)
from tests.pipelines.pipeline_helpers import (
    DescriberThread,
    RedisServer,
    VLMDouble,
    described_per_frame,
    descriptions,
    enqueue_frames,
    wait_until,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CAMERA = "door"
BATCH = 4


def test_each_described_frame_is_one_event_one_mqtt_message_and_one_webhook_across_restarts(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    client = redis_server.client()
    with (
        VLMDouble() as vlm,
        Mosquitto(tmp_path / "mosquitto") as broker,
        WebhookReceiver() as receiver,
    ):
        hook = receiver.route("/hook")
        config = make_config(
            redis_server.url,
            tmp_path / "events",
            cameras=[{"id": CAMERA, "url": f"/videos/{CAMERA}.mp4"}],
            describer={"base_url": vlm.base_url, "concurrency": 1},  # step 3 kills mid-batch
            notify=notify_section(broker, webhooks=[{"url": hook, "name": "hook"}]),
        )
        q = config.queue
        groups = [config.events.group, "notifiers:mqtt", "notifiers:webhook:hook"]
        ui = UIProcess(config, tmp_path)

        def described() -> list[str]:
            return [d["frame_uid"] for d in descriptions(client, q)]

        def caught_up(total: int) -> None:
            """Every sink has read, delivered and acknowledged all ``total`` descriptions."""
            wait_until(lambda: len(described()) == total, 20, what=f"{total} described")
            uids = set(described())
            wait_until(lambda: set(event_ids(ui.url)) == uids, 20, what="events stored")
            wait_until(lambda: set(sub.event_ids()) == uids, 30, what="MQTT messages")
            wait_until(lambda: set(receiver.delivered_ids("/hook")) == uids, 20, what="webhooks")
            wait_until(lambda: settled(client, q.descriptions_stream, groups), 10, what="acked")

        with (
            Subscriber(broker, ("vision-serve/+/event",)) as sub,  # persistent session, QoS 1
            DescriberThread(config, "describer-1"),
            NotifierThread(config) as notifier,
        ):
            ui.start()
            try:
                # 1. everything up
                enqueue_frames(redis_server.url, q, BATCH, camera=CAMERA)
                caught_up(BATCH)

                # 2. ui killed and broker killed; a batch is described while both are down
                broker.saved_since(time.time())  # the subscriber's session survives SIGKILL
                ui.stop(signal.SIGKILL)
                broker.stop(signal.SIGKILL)
                enqueue_frames(redis_server.url, q, BATCH, camera=CAMERA)
                wait_until(lambda: len(described()) == 2 * BATCH, 20, what="described while down")
                # the webhook is not held back by the dead broker
                wait_until(lambda: set(receiver.delivered_ids("/hook")) == set(described()), 20)
                broker.start()
                ui.start()
                caught_up(2 * BATCH)

                # 3. killed again while the batch is being described and delivered
                vlm.delay = 0.3
                enqueue_frames(redis_server.url, q, BATCH, camera=CAMERA)
                wait_until(lambda: len(event_ids(ui.url)) > 2 * BATCH, 20, what="batch 3 begun")
                ui.stop(signal.SIGKILL)
                broker.stop(signal.SIGTERM)  # a clean stop saves sessions and in-flight messages
                wait_until(lambda: len(described()) == 3 * BATCH, 20, what="batch 3 described")
                broker.start()
                ui.start()
                caught_up(3 * BATCH)
                stored = event_ids(ui.url)  # every page of GET /api/events
                events = {uid: get(ui.url, f"/api/events/{uid}").json() for uid in set(stored)}
            finally:
                ui.stop()
            assert notifier.alive

    # each frame described once: one description, no dead letter
    stream = {d["frame_uid"]: d for d in descriptions(client, q)}
    assert len(stream) == 3 * BATCH
    assert described_per_frame(client, q) == Counter(dict.fromkeys(stream, 1))

    # SQLite (read through the restarted ui's API): exactly one event per described frame
    assert Counter(stored) == Counter(dict.fromkeys(stream, 1))
    for uid, event in events.items():
        assert (event["id"], event["camera"], event["text"]) == (uid, CAMERA, stream[uid]["text"])

    # MQTT: every event on <prefix>/<camera>/event; a repeat is the same event, byte for byte
    mqtt = sub.on("/event")
    assert {m.topic for m in mqtt} == {f"vision-serve/{CAMERA}/event"}
    assert set(sub.event_ids()) == set(stream)
    # webhooks: every event delivered, every request signed correctly, repeats identical
    hits = receiver.on("/hook")
    assert all(h.verified for h in hits), [h.headers for h in hits if not h.verified]
    assert all(h.headers["x-vision-serve-event-id"] == h.event_id for h in hits)
    assert set(receiver.delivered_ids("/hook")) == set(stream)
    for uid, fields in stream.items():
        bodies = {m.payload for m in mqtt if m.json()["event_id"] == uid}
        bodies |= {h.body for h in hits if h.event_id == uid}
        assert len(bodies) == 1, f"{uid} sent with different bodies: {bodies}"
        payload = json.loads(bodies.pop())
        assert (payload["event_id"], payload["text"]) == (uid, fields["text"])
