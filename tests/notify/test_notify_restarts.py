"""Nothing is lost when a process dies: the notifier killed mid-run (SIGKILL) and started
again, the MQTT broker killed and restarted, Redis killed and restarted. Repeats are allowed,
only ever with the same event id; and no secret reaches a log line."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest

from pipelines.config import QueueConfig
from tests.notify.notify_helpers import (
    MQTT_PASSWORD,
    WEBHOOK_SECRET,
    NotifierThread,
    Subscriber,
    add_descriptions,
    group_state,
    notify_config,
    retained,
    settled,
    write_raw_config,
)
from tests.pipelines.pipeline_helpers import REPO, RedisServer, free_port, kill_group, wait_until

pytestmark = pytest.mark.timeout(90)

CLI = [sys.executable, "-m", "vision_serve.cli", "notify"]
MQTT = "notifiers:mqtt"
REDIS_PASSWORD = "redis-Pa55-for-notify"


def start_cli(config: Path, log: Path, metrics_port: int = 0) -> subprocess.Popen:
    args = ["--config", str(config), "--log-level", "DEBUG", "--metrics-port", str(metrics_port)]
    with open(log, "w") as out:
        return subprocess.Popen(
            CLI + args, cwd=REPO, start_new_session=True, stdout=out, stderr=subprocess.STDOUT
        )


def test_a_notifier_killed_mid_run_resumes_and_loses_nothing(tmp_path, broker, receiver):
    redis_server = RedisServer(tmp_path / "redis", password=REDIS_PASSWORD)
    redis_server.start()
    try:
        client = redis_server.client()
        url = receiver.route("/slow", delay=0.15)
        path = write_raw_config(
            tmp_path / "cameras.yaml",
            redis_server.url,
            broker=broker,
            webhooks=[{"url": url, "name": "slow"}],
            concurrency=2,
        )
        ids = add_descriptions(client, QueueConfig(), 16)
        port = free_port()
        with Subscriber(broker, ("vision-serve/#",)) as sub:
            first = start_cli(path, tmp_path / "run1.log", port)
            try:
                wait_until(lambda: len(receiver.delivered_ids("/slow")) >= 4, 30, what="4 hooks")
                metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
                assert 'vs_notify_delivered_total{sink="webhook:slow"}' in metrics
                kill_group(first, signal.SIGKILL)
                # the broker publishes the will: Home Assistant shows the cameras unavailable
                wait_until(lambda: [m for m in sub.on("/status") if m.payload == b"offline"], 10)
                stream = "vs:descriptions"
                at_kill = group_state(client, stream, "notifiers:webhook:slow")
                assert at_kill is not None and at_kill != {"pending": 0, "lag": 0}
                second = start_cli(path, tmp_path / "run2.log")
                groups = [MQTT, "notifiers:webhook:slow"]
                wait_until(lambda: settled(client, stream, groups), 40, what="all delivered")
                wait_until(lambda: set(sub.event_ids()) == set(ids), 10, what="mqtt events")
                kill_group(second, signal.SIGTERM)
                assert second.returncode == 0
            finally:
                kill_group(first, signal.SIGKILL)
        hooks = receiver.delivered_ids("/slow")
        assert set(hooks) == set(ids) and set(sub.event_ids()) == set(ids)
        # repeats: at most the events in flight when it died (concurrency 2 per sink)
        assert sum(hooks.values()) - len(ids) <= 2
        assert sum(sub.event_ids().values()) - len(ids) <= 2
        logs = (tmp_path / "run1.log").read_text() + (tmp_path / "run2.log").read_text()
        # deliveries in flight at the kill stay pending and are resumed from the consumer's
        # history; a kill between two deliveries leaves none (only unread entries), and
        # nothing to resume (CI once killed it there: the 12 left came as new reads)
        if at_kill["pending"]:
            assert "event=notify_resumed sink=webhook:slow" in logs
        assert "event=event_delivered" in logs
        for secret in (MQTT_PASSWORD, WEBHOOK_SECRET, REDIS_PASSWORD, quote(REDIS_PASSWORD)):
            assert secret not in logs
        assert url not in logs  # a webhook URL may carry a token: the sink name stands for it
    finally:
        redis_server.stop()


def test_a_broker_killed_and_restarted_loses_nothing_and_holds_back_no_webhook(
    redis_server, broker, receiver
):
    url = receiver.route("/hook")
    config = notify_config(redis_server.url, broker=broker, webhooks=[{"url": url, "name": "h"}])
    client = redis_server.client()
    stream = config.queue.descriptions_stream
    with Subscriber(broker, ("vision-serve/+/event",)) as sub, NotifierThread(config) as run:
        before = add_descriptions(client, config.queue, 4)
        wait_until(lambda: set(sub.event_ids()) == set(before), 15, what="first events")
        broker.saved_since(time.time())  # the subscriber's session is on disk
        broker.stop(signal.SIGKILL)
        during = add_descriptions(client, config.queue, 4)
        # the webhook is not held back by the dead broker
        wait_until(lambda: set(receiver.delivered_ids("/hook")) == {*before, *during}, 15)
        time.sleep(1.0)  # the notifier retries meanwhile, and stays up
        waiting = group_state(client, stream, MQTT)
        assert waiting["pending"] + waiting["lag"] >= 1
        assert run.thread.is_alive()
        broker.start()
        wait_until(lambda: set(sub.event_ids()) == {*before, *during}, 30, what="all events")
        wait_until(lambda: settled(client, stream, [MQTT, "notifiers:webhook:h"]), 10)
    assert all(n == 1 for n in receiver.delivered_ids("/hook").values())
    held = retained(broker)
    assert "homeassistant/sensor/vision-serve/cam_description/config" in held  # persisted
    assert b'"event_id":"%s"' % during[-1].encode() in held["vision-serve/cam/last_event"]


def test_redis_killed_and_restarted_mid_run_loses_nothing(redis_server, receiver):
    url = receiver.route("/hook")
    config = notify_config(redis_server.url, webhooks=[{"url": url, "name": "h"}])
    client = redis_server.client()
    with NotifierThread(config) as run:
        first = add_descriptions(client, config.queue, 3)
        wait_until(lambda: set(receiver.delivered_ids("/hook")) == set(first), 15)
        redis_server.restart(signal.SIGKILL, down_for=0.5)
        client = redis_server.client()
        second = add_descriptions(client, config.queue, 3)
        wait_until(lambda: set(receiver.delivered_ids("/hook")) == {*first, *second}, 30)
        group = "notifiers:webhook:h"
        wait_until(lambda: settled(client, config.queue.descriptions_stream, [group]), 10)
        assert run.thread.is_alive()


def test_a_wrong_broker_password_is_named_not_shown_and_events_wait(redis_server, broker, caplog):
    config = notify_config(redis_server.url, broker=broker)
    config.notify.mqtt.password = "not-the-Pa55word"
    client = redis_server.client()
    add_descriptions(client, config.queue, 1)
    with caplog.at_level(logging.DEBUG), NotifierThread(config):
        wait_until(lambda: "event=mqtt_refused" in caplog.text, 10, what="refusal logged")
        time.sleep(0.5)
        assert group_state(client, config.queue.descriptions_stream, MQTT)["pending"] == 1
    assert "not-the-Pa55word" not in caplog.text and MQTT_PASSWORD not in caplog.text
