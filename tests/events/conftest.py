"""Fixtures for the events tests: a private redis-server, a config, the ui on loopback."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.events.events_helpers import UIServer, make_config
from tests.pipelines.pipeline_helpers import (  # noqa: F401  (fixtures, re-exported)
    RedisServer,
    redis_server,
    video_file,
    video_frames,
)


@pytest.fixture
def config(redis_server: RedisServer, tmp_path: Path) -> Any:  # noqa: F811
    return make_config(redis_server.url, tmp_path / "events")


@pytest.fixture
def start_ui() -> Iterator[Callable[[Any], UIServer]]:
    """Start the ui (consumer, retention, API) for a config; stopped after the test."""
    started: list[UIServer] = []

    def start(config: Any) -> UIServer:
        server = UIServer(config).start()
        started.append(server)
        return server

    yield start
    for server in started:
        if server.thread.is_alive():
            server.stop()


@pytest.fixture
def ui(config: Any, start_ui: Callable[[Any], UIServer]) -> UIServer:
    return start_ui(config)
