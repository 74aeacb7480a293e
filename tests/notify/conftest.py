"""Fixtures for the notifier tests: real redis-server and Mosquitto, a webhook receiver."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.notify.notify_helpers import Mosquitto, WebhookReceiver
from tests.pipelines.pipeline_helpers import (
    VLMDouble,
    redis_server,  # noqa: F401  (fixture, re-exported)
)


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Mosquitto]:
    with Mosquitto(tmp_path / "mosquitto") as server:
        yield server


@pytest.fixture
def receiver() -> Iterator[WebhookReceiver]:
    with WebhookReceiver() as r:
        yield r


@pytest.fixture
def vlm_double() -> Iterator[VLMDouble]:
    with VLMDouble() as double:
        yield double
