"""Every description reaches every sink: MQTT through a real Mosquitto (PUBACK, retained
state, Home Assistant discovery) and a webhook on loopback (signed), each exactly once when
nothing fails, and refusals and failures end in retries or dead letters that are counted."""

from __future__ import annotations

import json
import time

import pytest

from tests.notify.notify_helpers import (
    WEBHOOK_SECRET,
    Mosquitto,
    NotifierThread,
    Subscriber,
    add_descriptions,
    add_expired,
    group_state,
    notify_config,
    retained,
    settled,
    stats,
)
from tests.pipelines.pipeline_helpers import (
    DescriberThread,
    TlsFiles,
    descriptions,
    enqueue_frames,
    free_port,
    make_tls_files,
    wait_until,
)

pytestmark = pytest.mark.timeout(60)

MQTT = "notifiers:mqtt"


def test_every_described_frame_yields_one_mqtt_message_and_one_webhook_post(
    redis_server, broker, receiver, vlm_double
):
    """The real path: frames -> describer -> descriptions stream -> notifier -> both sinks."""
    url = receiver.route("/hook")
    config = notify_config(redis_server.url, broker=broker, webhooks=[{"url": url, "name": "h"}])
    config.describer.base_url = vlm_double.base_url
    client = redis_server.client()
    with Subscriber(broker, ("vision-serve/#",)) as sub:
        enqueue_frames(redis_server.url, config.queue, 5, camera="cam")
        describer = DescriberThread(config, "w1").start()
        wait_until(lambda: len(descriptions(client, config.queue)) == 5, 20, what="described")
        describer.stop()
        expired = add_expired(client, config.queue)
        frame_uids = {d["frame_uid"] for d in descriptions(client, config.queue) if "text" in d}
        with NotifierThread(config):
            groups = [MQTT, "notifiers:webhook:h"]
            wait_until(lambda: settled(client, config.queue.descriptions_stream, groups), 20)
            wait_until(lambda: len(sub.on("/event")) >= 5, 5, what="mqtt events")
            time.sleep(0.3)  # nothing more arrives
        assert sub.event_ids() == {uid: 1 for uid in frame_uids}
        assert receiver.delivered_ids("/hook") == {uid: 1 for uid in frame_uids}
        assert expired not in sub.event_ids()
    hits = receiver.on("/hook")
    assert all(h.verified for h in hits)
    assert all(h.headers["x-vision-serve-event-id"] == h.event_id for h in hits)
    body = json.loads(hits[0].body)
    assert body["event_type"] == "description" and body["camera"] == "cam"
    assert body["text"].startswith("double description") and body["model"] == "tiny"
    assert body["persons"] == 1 and body["boxes"][0]["label"] == "person"
    counted = stats(client)
    assert counted["delivered:mqtt"] == counted["delivered:webhook:h"] == 5
    assert counted["skipped:mqtt:max_age"] == counted["skipped:webhook:h:max_age"] == 1
    assert "retries:mqtt" not in counted and not client.exists("vs:notify:dead")


def test_the_newest_event_and_discovery_configs_are_retained_on_the_broker(redis_server, broker):
    config = notify_config(redis_server.url, cameras=("front-door", "yard.1"), broker=broker)
    client = redis_server.client()
    with Subscriber(broker, ("unused",), persistent=False) as other:  # junk someone left there
        for junk in (b"not json", b'{"camera": "yard.1"}'):
            topic = "vision-serve/yard.1/last_event"
            other.client.publish(topic, junk, qos=1, retain=True).wait_for_publish(5)
    ids = add_descriptions(client, config.queue, 3, camera="front-door")
    with NotifierThread(config):
        wait_until(lambda: settled(client, config.queue.descriptions_stream, [MQTT]), 15)
        held = retained(broker)
    assert held["vision-serve/status"] == b"online"
    assert json.loads(held["vision-serve/front-door/last_event"])["event_id"] == ids[-1]
    for cam in ("front-door", "yard_1"):  # configured cameras, even without an event yet
        desc = json.loads(held[f"homeassistant/sensor/vision-serve/{cam}_description/config"])
        persons = json.loads(held[f"homeassistant/sensor/vision-serve/{cam}_persons/config"])
        event = json.loads(held[f"homeassistant/event/vision-serve/{cam}_event/config"])
        assert desc["availability_topic"] == "vision-serve/status"
        assert desc["unique_id"] != persons["unique_id"] != event["unique_id"]
        assert desc["device"]["identifiers"] == event["device"]["identifiers"]
        assert event["event_types"] == ["description"]
    assert desc["state_topic"] == "vision-serve/yard.1/last_event"
    assert event["state_topic"] == "vision-serve/yard.1/event"
    # a clean stop says so on the availability topic
    assert retained(broker, "vision-serve/status", settle=0.5) == {
        "vision-serve/status": b"offline"
    }


def test_a_camera_not_in_the_file_is_announced_with_its_first_event(redis_server, broker):
    config = notify_config(redis_server.url, cameras=("cam",), broker=broker)
    client = redis_server.client()
    add_descriptions(client, config.queue, 1, camera="garage")
    with NotifierThread(config):
        wait_until(lambda: settled(client, config.queue.descriptions_stream, [MQTT]), 15)
        held = retained(broker, "homeassistant/#")
    assert "homeassistant/event/vision-serve/garage_event/config" in held


def test_home_assistant_restarting_gets_the_discovery_configs_again(redis_server, broker):
    config = notify_config(redis_server.url, cameras=("cam",), broker=broker)
    topic = "homeassistant/sensor/vision-serve/cam_persons/config"
    with NotifierThread(config), Subscriber(broker, (topic,), persistent=False) as sub:
        wait_until(lambda: sub.on("/config"), 10, what="first discovery")
        before = len(sub.on("/config"))
        sub.client.publish("homeassistant/status", b"online", qos=1).wait_for_publish(5)
        wait_until(lambda: len(sub.on("/config")) > before, 10, what="discovery again")


def test_a_webhook_answering_500_is_retried_then_delivered_once(redis_server, receiver):
    url = receiver.route("/flaky", 500, 503)
    config = notify_config(redis_server.url, webhooks=[{"url": url, "name": "flaky"}])
    client = redis_server.client()
    (event_id,) = add_descriptions(client, config.queue, 1)
    with NotifierThread(config):
        group = "notifiers:webhook:flaky"
        wait_until(lambda: settled(client, config.queue.descriptions_stream, [group]), 15)
    hits = receiver.on("/flaky")
    assert [h.status for h in hits] == [500, 503, 200]
    assert {h.event_id for h in hits} == {event_id}  # every attempt: the same event id
    assert [h.headers["x-vision-serve-attempt"] for h in hits] == ["1", "2", "3"]
    assert all(h.verified for h in hits)  # re-signed with a fresh timestamp each time
    counted = stats(client)
    assert counted["delivered:webhook:flaky"] == 1 and counted["retries:webhook:flaky"] == 2
    assert not client.exists("vs:notify:dead")


def test_a_webhook_answering_400_is_dead_lettered_with_the_reason(redis_server, broker, receiver):
    url = receiver.route("/bad", then=400)
    config = notify_config(
        redis_server.url, broker=broker, webhooks=[{"url": url, "name": "strict"}]
    )
    client = redis_server.client()
    (event_id,) = add_descriptions(client, config.queue, 1)
    with NotifierThread(config):
        groups = [MQTT, "notifiers:webhook:strict"]
        wait_until(lambda: settled(client, config.queue.descriptions_stream, groups), 15)
    assert len(receiver.on("/bad")) == 1  # a 400 is not asked again
    ((_id, letter),) = client.xrange("vs:notify:dead")
    letter = {k.decode(): v.decode() for k, v in letter.items()}
    assert letter["event_id"] == event_id and letter["sink"] == "webhook:strict"
    assert letter["reason"] == "rejected" and letter["detail"].startswith("HTTP 400")
    assert letter["attempts"] == "1" and letter["camera"] == "cam"
    counted = stats(client)
    assert counted["dead:webhook:strict:rejected"] == 1
    assert counted["delivered:mqtt"] == 1  # the other sink is not held back


def test_a_webhook_that_never_answers_is_dead_lettered_after_max_attempts(redis_server):
    url = f"http://127.0.0.1:{free_port()}/hook"  # nothing listens
    config = notify_config(
        redis_server.url, webhooks=[{"url": url, "name": "gone", "max_attempts": 3}]
    )
    client = redis_server.client()
    add_descriptions(client, config.queue, 2)
    with NotifierThread(config):
        group = "notifiers:webhook:gone"
        wait_until(lambda: settled(client, config.queue.descriptions_stream, [group]), 15)
    letters = [{k.decode(): v.decode() for k, v in f.items()} for _i, f in client.xrange(
        "vs:notify:dead")]  # fmt: skip
    assert [(x["reason"], x["attempts"]) for x in letters] == [("max_attempts", "3")] * 2
    assert "ConnectError" in letters[0]["detail"] and url not in letters[0]["detail"]
    assert stats(client)["retries:webhook:gone"] == 4


def test_events_older_than_max_event_age_are_skipped_and_counted(redis_server, receiver):
    url = receiver.route("/hook")
    config = notify_config(
        redis_server.url, webhooks=[{"url": url, "name": "h"}], max_event_age_s=60
    )
    client = redis_server.client()
    client.xadd(
        config.queue.descriptions_stream,
        {"frame_uid": "cam:old:1", "camera": "cam", "ts": f"{time.time() - 3600:.6f}",
         "text": "an hour ago"},
    )  # fmt: skip
    fresh = add_descriptions(client, config.queue, 1)
    with NotifierThread(config):
        group = "notifiers:webhook:h"
        wait_until(lambda: settled(client, config.queue.descriptions_stream, [group]), 15)
    assert receiver.delivered_ids("/hook") == {fresh[0]: 1}
    assert stats(client)["skipped:webhook:h:stale"] == 1


def test_a_sink_added_later_starts_with_new_descriptions(redis_server, receiver):
    """The first run sends the stream's history; a webhook added to the file afterwards is
    not flooded with it."""
    first = receiver.route("/first")
    config = notify_config(redis_server.url, webhooks=[{"url": first, "name": "first"}])
    client = redis_server.client()
    old = add_descriptions(client, config.queue, 2)
    with NotifierThread(config):
        wait_until(lambda: len(receiver.delivered_ids("/first")) == 2, 15)
    second = receiver.route("/second")
    hooks = [{"url": first, "name": "first"}, {"url": second, "name": "second"}]
    config = notify_config(redis_server.url, webhooks=hooks)
    with NotifierThread(config):
        wait_until(lambda: "notifiers:webhook:second" in {
            g["name"].decode() for g in client.xinfo_groups(config.queue.descriptions_stream)
        }, 10)  # fmt: skip
        new = add_descriptions(client, config.queue, 1)
        wait_until(lambda: receiver.delivered_ids("/second"), 15)
        wait_until(lambda: len(receiver.delivered_ids("/first")) == 3, 15)
    assert set(receiver.delivered_ids("/second")) == set(new)
    assert set(receiver.delivered_ids("/first")) == {*old, *new}
    assert group_state(client, config.queue.descriptions_stream, "notifiers:webhook:first") == {
        "pending": 0,
        "lag": 0,
    }


def test_the_signature_is_hmac_sha256_over_timestamp_event_id_and_raw_body():
    import hashlib
    import hmac

    from pipelines.notify.event import build_event
    from pipelines.notify.webhook import sign, verify

    event = build_event("1-0", {"frame_uid": "cam:r:1", "camera": "cam", "ts": "5", "text": "x"})
    expected = hmac.new(WEBHOOK_SECRET.encode(), b"1700000000.cam:r:1." + event.body,
                        hashlib.sha256).hexdigest()  # fmt: skip
    signature = sign(WEBHOOK_SECRET, "1700000000", "cam:r:1", event.body)
    assert signature == f"sha256={expected}"
    args = (event.body, signature, "1700000000", "cam:r:1")
    assert verify(WEBHOOK_SECRET, *args, now=1700000060)
    assert not verify(WEBHOOK_SECRET, *args, now=1700000000 + 301)  # a replay, later
    assert not verify("another-secret", *args, now=1700000060)
    assert not verify(WEBHOOK_SECRET, event.body + b" ", *args[1:], now=1700000060)
    assert not verify(WEBHOOK_SECRET, event.body, signature, "1700000000", "cam:r:2",
                      now=1700000060)  # fmt: skip


def test_the_payload_carries_the_event_id_and_the_description():
    from pipelines.notify.event import build_event

    fields = {
        "frame_id": "17-0", "frame_uid": "cam:ab:3", "camera": "cam", "ts": "1700000000.5",
        "described_at": "1700000001.5", "latency_s": "1.000", "text": "a person waves",
        "model": "tiny", "completion_tokens": "4", "vlm_seconds": "0.9", "persons": "2",
        "boxes": '[{"cls":0,"label":"person","conf":0.9,"box":[1,2,3,4]}]',
        "image": "vs:frame:cam:ab:3", "worker": "w1", "structured": '{"action": "wave"}',
    }  # fmt: skip
    assert json.loads(build_event("9-0", fields).body) == {
        "event_id": "cam:ab:3",
        "event_type": "description",
        "camera": "cam",
        "ts": 1700000000.5,
        "described_at": 1700000001.5,
        "text": "a person waves",
        "persons": 2,
        "boxes": [{"cls": 0, "label": "person", "conf": 0.9, "box": [1, 2, 3, 4]}],
        "model": "tiny",
        "latency_s": 1.0,
        "stream_id": "9-0",
        "structured": {"action": "wave"},
    }


def test_no_sink_configured_is_an_error_at_start(tmp_path, capsys):
    from vision_serve.cli import main

    path = tmp_path / "cameras.yaml"
    path.write_text("redis_url: redis://127.0.0.1:1/0\n")
    assert main(["notify", "--config", str(path)]) == 2
    assert "notify.mqtt and/or notify.webhooks" in capsys.readouterr().err


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory) -> TlsFiles:
    """A throwaway CA and a certificate it signed for 127.0.0.1."""
    tls = make_tls_files(tmp_path_factory.mktemp("tls"), "broker")
    for key in (tls.key, tls.ca.with_name("ca.key")):
        key.chmod(0o644)  # mosquitto may read it as another user
    return tls


def test_events_reach_a_broker_over_tls_checked_against_the_configured_ca(
    redis_server, tls_files, tmp_path
):
    broker = Mosquitto(tmp_path / "mosquitto", tls=tls_files)
    broker.start()
    try:
        config = notify_config(redis_server.url, broker=broker)
        config.notify.mqtt.tls = True
        config.notify.mqtt.ca_certs = str(tls_files.ca)
        client = redis_server.client()
        add_descriptions(client, config.queue, 2)
        with NotifierThread(config):  # PUBACKs over TLS, or nothing is acknowledged
            wait_until(lambda: settled(client, config.queue.descriptions_stream, [MQTT]), 15)
        assert stats(client)["delivered:mqtt"] == 2

        config.notify.mqtt.ca_certs = None  # the system's CAs do not know this broker
        add_descriptions(client, config.queue, 1)
        with NotifierThread(config) as run:
            time.sleep(1.5)
            assert group_state(client, config.queue.descriptions_stream, MQTT)["pending"] == 1
            assert not run.notifier.sinks[0].connected.is_set()
    finally:
        broker.stop()
