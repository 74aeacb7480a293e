"""Fixtures for the notifier tests: real redis-server and Mosquitto, a webhook receiver."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.notify.notify_helpers import Mosquitto, WebhookReceiver
from tests.pipelines.pipeline_helpers import RedisServer, VLMDouble


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Mosquitto]:
    server = Mosquitto(tmp_path / "mosquitto")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def receiver() -> Iterator[WebhookReceiver]:
    with WebhookReceiver() as r:
        yield r


@pytest.fixture
def vlm_double() -> Iterator[VLMDouble]:
    with VLMDouble() as double:
        yield double
