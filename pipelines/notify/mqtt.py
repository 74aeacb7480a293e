"""MQTT: each event on ``<prefix>/<camera>/event``, the newest retained on
``<prefix>/<camera>/last_event``, and Home Assistant discovery so each camera shows up by itself.

Topics (``prefix`` = ``notify.mqtt.topic_prefix``, default ``vision-serve``):

- ``<prefix>/<camera>/event`` -- every event, QoS 1, not retained (the JSON body of
  ``event.py``; it carries ``event_type`` for Home Assistant's ``event`` entity).
- ``<prefix>/<camera>/last_event`` -- the newest event by capture time, QoS 1, retained: a
  client that connects later reads the current state at once.
- ``<prefix>/status`` -- ``online`` (retained) once connected; ``offline`` when the notifier
  stops, and as the broker-sent will when its connection dies.
- ``<discovery_prefix>/sensor/<node>/<camera>_description/config``,
  ``.../sensor/<node>/<camera>_persons/config`` and ``.../event/<node>/<camera>_event/config``
  -- retained discovery configs: per camera a device with a "Last description" sensor, a
  "Persons" sensor (both read ``last_event``) and an event entity (reads ``event``). Published
  on every connect, for each configured camera and for any other camera an event comes from,
  and again whenever Home Assistant announces itself (``<discovery_prefix>/status`` =
  ``online``).

An event counts as delivered when the broker's PUBACK for both publishes came back. Broker
down, refused or silent: the connection is retried with backoff in the background and the
events wait (pending in Redis) -- nothing is given up on, nothing is lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import socket
import ssl

import aiomqtt
from aiomqtt.exceptions import MqttConnectError

from pipelines.backoff import Backoff
from pipelines.logs import kv
from pipelines.notify import metrics
from pipelines.notify.config import MqttConfig
from pipelines.notify.event import EVENT_TYPE, Event
from pipelines.notify.sink import Delivered, Hooks, Result
from pipelines.worker import Stopping

log = logging.getLogger(__name__)

QOS = 1


def object_id(text: str) -> str:
    """Home Assistant's discovery topics allow ``[a-zA-Z0-9_-]`` in node and object ids."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", text)


class MqttSink:
    """One broker connection, kept up by a background task; ``deliver`` waits for it."""

    name = "mqtt"

    def __init__(
        self,
        cfg: MqttConfig,
        cameras: list[str],
        hooks: Hooks,
        concurrency: int,
        backoff_initial_s: float = 1.0,
        backoff_max_s: float = 30.0,
    ) -> None:
        self.cfg = cfg
        self.hooks = hooks
        self.concurrency = concurrency
        self.backoff = (backoff_initial_s, backoff_max_s)
        self.node = object_id(cfg.topic_prefix)
        self.client_id = cfg.client_id or f"vision-serve-notify-{socket.gethostname()}"
        self.cameras: list[str] = list(dict.fromkeys(cameras))  # announced on every connect
        self.announced: set[str] = set()  # ... on this connection
        self.last_ts: dict[str, float] = {}  # newest capture time on <camera>/last_event
        self.client: aiomqtt.Client | None = None
        self.connected = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closing = False

    def __repr__(self) -> str:
        return f"MqttSink({self.cfg.host}:{self.cfg.port})"

    # -- topics --------------------------------------------------------------------------
    @property
    def status_topic(self) -> str:
        return f"{self.cfg.topic_prefix}/status"

    def event_topic(self, camera: str) -> str:
        return f"{self.cfg.topic_prefix}/{camera}/event"

    def last_event_topic(self, camera: str) -> str:
        return f"{self.cfg.topic_prefix}/{camera}/last_event"

    def discovery(self, camera: str) -> dict[str, dict]:
        """Discovery topic -> config, for one camera's device and its three entities."""
        cam = object_id(camera)
        base = {
            "availability_topic": self.status_topic,
            "payload_available": "online",
            "payload_not_available": "offline",
            "device": {
                "identifiers": [f"{self.node}_{cam}"],
                "name": camera,
                "manufacturer": "vision-serve",
                "model": "camera",
            },
            "origin": {"name": "vision-serve"},
        }
        last = self.last_event_topic(camera)
        prefix = f"{self.cfg.discovery_prefix}"
        return {
            f"{prefix}/sensor/{self.node}/{cam}_description/config": {
                **base,
                "name": "Last description",
                "unique_id": f"{self.node}_{cam}_description",
                "state_topic": last,
                # a sensor's state holds at most 255 characters; attributes hold the rest
                "value_template": "{{ value_json.text[:255] }}",
                "json_attributes_topic": last,
                "icon": "mdi:text-box-outline",
            },
            f"{prefix}/sensor/{self.node}/{cam}_persons/config": {
                **base,
                "name": "Persons",
                "unique_id": f"{self.node}_{cam}_persons",
                "state_topic": last,
                "value_template": "{{ value_json.persons }}",
                "state_class": "measurement",
                "icon": "mdi:account-multiple",
            },
            f"{prefix}/event/{self.node}/{cam}_event/config": {
                **base,
                "name": "Description",
                "unique_id": f"{self.node}_{cam}_event",
                "state_topic": self.event_topic(camera),
                "event_types": [EVENT_TYPE],
                "icon": "mdi:cctv",
            },
        }

    # -- connection ----------------------------------------------------------------------
    def _new_client(self) -> aiomqtt.Client:
        tls = None
        if self.cfg.tls:
            tls = ssl.create_default_context(cafile=self.cfg.ca_certs)
            if self.cfg.certfile:
                tls.load_cert_chain(self.cfg.certfile, self.cfg.keyfile)
        password = self.cfg.password.get_secret_value() if self.cfg.password else None
        return aiomqtt.Client(
            self.cfg.host,
            self.cfg.port,
            username=self.cfg.username,
            password=password,
            identifier=self.client_id,
            will=aiomqtt.Will(self.status_topic, b"offline", qos=QOS, retain=True),
            keepalive=self.cfg.keepalive_s,
            timeout=self.cfg.publish_timeout_s,
            tls_context=tls,
            max_inflight_messages=max(20, 2 * self.concurrency),
        )

    async def start(self) -> None:
        self._task = asyncio.create_task(self._keep_connected(), name="mqtt-connection")

    async def _keep_connected(self) -> None:
        backoff = Backoff(*self.backoff)
        where = f"{self.cfg.host}:{self.cfg.port}"
        while not self._closing:
            try:
                client = self._new_client()
                async with client:
                    await self._on_connect(client)
                    self.client = client
                    self.connected.set()
                    metrics.SINK_UP.labels(self.name).set(1)
                    log.info(kv("mqtt_connected", broker=where, client_id=self.client_id))
                    backoff.reset()
                    async for message in client.messages:
                        await self._on_message(client, message)
            except Exception as exc:  # MqttError; OSError (a missing CA file...); a bug here
                # must not end the connection for good: it is logged and tried again
                self.connected.clear()
                self.client = None
                metrics.SINK_UP.labels(self.name).set(0)
                if self._closing:
                    return
                if backoff.attempts == 0:
                    if isinstance(exc, MqttConnectError):  # a refused login: name it as such
                        log.error(
                            kv("mqtt_refused", broker=where, user=self.cfg.username, error=exc)
                        )
                    elif isinstance(exc, aiomqtt.MqttError | OSError):
                        log.warning(kv("mqtt_unavailable", broker=where, error=exc))
                    else:
                        log.exception(kv("mqtt_connection_failed", broker=where, error=repr(exc)))
                await asyncio.sleep(backoff.next_delay())
            finally:
                self.connected.clear()
                self.client = None

    async def _on_connect(self, client: aiomqtt.Client) -> None:
        self.announced.clear()
        await client.publish(self.status_topic, b"online", qos=QOS, retain=True)
        await client.subscribe(f"{self.cfg.topic_prefix}/+/last_event", qos=QOS)
        if self.cfg.discovery:
            await client.subscribe(f"{self.cfg.discovery_prefix}/status", qos=QOS)
            for camera in self.cameras:
                await self._announce(client, camera)

    async def _on_message(self, client: aiomqtt.Client, message: aiomqtt.Message) -> None:
        topic = str(message.topic)
        payload = message.payload if isinstance(message.payload, bytes) else b""
        if topic == f"{self.cfg.discovery_prefix}/status" and payload == b"online":
            log.info(kv("mqtt_discovery_again", reason="home assistant started"))
            self.announced.clear()
            for camera in self.cameras:
                await self._announce(client, camera)
        elif topic.endswith("/last_event"):  # retained state: an older event must not replace it
            with contextlib.suppress(ValueError, TypeError, KeyError, AttributeError):
                data = json.loads(payload)
                camera, ts = str(data["camera"]), float(data["ts"])
                self.last_ts[camera] = max(ts, self.last_ts.get(camera, 0.0))

    async def _announce(self, client: aiomqtt.Client, camera: str) -> None:
        if not self.cfg.discovery:
            return
        for topic, config in self.discovery(camera).items():
            body = json.dumps(config, separators=(",", ":")).encode()
            await client.publish(topic, body, qos=QOS, retain=True)
        self.announced.add(camera)
        if camera not in self.cameras:
            self.cameras.append(camera)

    async def close(self) -> None:
        self._closing = True
        client = self.client
        if client is not None and self.connected.is_set():
            with contextlib.suppress(aiomqtt.MqttError):  # a clean stop says so (no will)
                await client.publish(self.status_topic, b"offline", qos=QOS, retain=True, timeout=2)
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    # -- delivery ------------------------------------------------------------------------
    async def _connection(self) -> aiomqtt.Client:
        while True:
            client = self.client
            if self.connected.is_set() and client is not None:
                return client
            waiters = [
                asyncio.ensure_future(self.connected.wait()),
                asyncio.ensure_future(self.hooks.stopped()),
            ]
            try:
                await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waiters:
                    w.cancel()
            if waiters[1].done() and not waiters[1].cancelled():
                raise Stopping

    async def deliver(self, event: Event) -> Result:
        backoff = Backoff(*self.backoff)
        attempt = 0
        while True:
            client = await self._connection()
            attempt += 1
            try:
                if event.camera not in self.announced:
                    await self._announce(client, event.camera)
                await client.publish(self.event_topic(event.camera), event.body, qos=QOS)
                if event.ts >= self.last_ts.get(event.camera, 0.0):
                    self.last_ts[event.camera] = event.ts
                    topic = self.last_event_topic(event.camera)
                    await client.publish(topic, event.body, qos=QOS, retain=True)
                return Delivered(attempt)
            except aiomqtt.MqttError as exc:
                # a dead connection is noticed by the connection task too; a publish that
                # timed out on a live one is simply sent again (same event id)
                self.hooks.retry(self.name, "publish_failed")
                log.debug(kv("mqtt_publish_failed", id=event.event_id, error=exc))
                await self.hooks.sleep(backoff.next_delay())
