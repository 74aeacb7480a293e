"""Fixtures for the reliability tests: the server tests' tiny checkpoint, and a real engine
behind real uvicorn on loopback for this package (faults are injected into it, so it is not
shared with ``tests/server``); the pipeline tests' Redis and video for the camera stack."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.pipelines.pipeline_helpers import (  # noqa: F401  (fixtures, re-exported)
    redis_server,
    video_file,
    video_frames,
)
from tests.server.conftest import checkpoint  # noqa: F401  (session fixture, re-exported)
from tests.server.support import ServerHandle, make_engine, start_server
from vision_serve.settings import ServerSettings


@pytest.fixture(scope="session")
def healthy(checkpoint: Path) -> Iterator[ServerHandle]:  # noqa: F811
    """A server whose engine must survive every test that uses it."""
    engine = make_engine(str(checkpoint))
    handle = start_server(engine, ServerSettings())
    yield handle
    handle.stop()
    engine.shutdown()
