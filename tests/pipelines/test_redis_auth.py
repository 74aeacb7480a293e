"""Redis behind a password, an ACL user or TLS: the producer and the describers get in with the
credentials in ``redis_url`` alone (redis-py's ``from_url``), a wrong password fails at once
with a message that says so, and no secret reaches a log line.

Each test starts its own ``redis-server``; the TLS one serves a certificate made here with
``openssl`` and signed by a throwaway CA.
"""

from __future__ import annotations

import logging
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import numpy as np
import pytest
import redis
from pipeline_helpers import (
    DescriberThread,
    RedisServer,
    TlsFiles,
    descriptions,
    enqueue_frames,
    make_tls_files,
    pending_count,
    wait_until,
)

from pipelines.config import ConfigError, parse_config, redacted_redis_url

pytestmark = pytest.mark.timeout(60)

# '/' and '#' end the host part of a URL unless percent-encoded: the URLs here encode them, as
# the compose file's hex passwords need not
PASSWORD = "s3cret/Pa#55-x"
WRONG = "n0t-the-Pa55word"
SECRETS = (PASSWORD, quote(PASSWORD, safe=""), WRONG)
REFUSED = "invalid username-password pair"


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    """A CA and a certificate for 127.0.0.1 / localhost that it signed."""
    probe = subprocess.run(
        ["redis-server", "--port", "0", "--tls-port", "0", "--save", ""],
        capture_output=True,
        text=True,
        timeout=10,
    )
    if "Bad directive" in probe.stdout + probe.stderr:
        pytest.skip("this redis-server was built without TLS (BUILD_TLS=no)")
    return make_tls_files(tmp_path_factory.mktemp("tls"), "redis")


def _server(kind: str, workdir: Path, tls_files: Any) -> RedisServer:
    if kind == "password":
        return RedisServer(workdir, password=PASSWORD)
    if kind == "acl_user":
        # only the queue's keys, no @dangerous command (CONFIG, FLUSHALL, KEYS, DEBUG, ...);
        # the default user is off
        return RedisServer(workdir, password=PASSWORD, user="vs", acl="~vs:* +@all -@dangerous")
    return RedisServer(workdir, password=PASSWORD, tls=tls_files)


@pytest.fixture(params=["password", "acl_user", "tls"])
def secured_redis(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[RedisServer]:
    tls = request.getfixturevalue("tls_files") if request.param == "tls" else None
    with _server(request.param, tmp_path / "redis", tls) as server:
        yield server


@pytest.fixture
def password_redis(tmp_path: Path) -> Iterator[RedisServer]:
    with RedisServer(tmp_path / "redis", password=PASSWORD) as server:
        yield server


def _without_credentials(url: str) -> str:
    return re.sub(r"//[^/@]*@", "//", url, count=1)


def _with_password(url: str, password: str) -> str:
    return url.replace(quote(PASSWORD, safe=""), quote(password, safe=""), 1)


def _assert_no_secret(caplog: pytest.LogCaptureFixture) -> None:
    text = "\n".join(r.getMessage() for r in caplog.records) + caplog.text
    for secret in SECRETS:
        assert secret not in text


def _log_line(caplog: pytest.LogCaptureFixture, *parts: str) -> str | None:
    return next((m for r in caplog.records if all(p in (m := r.getMessage()) for p in parts)), None)


def test_the_url_alone_gets_producer_and_describer_in(
    secured_redis: RedisServer, make_config: Any, vlm_double: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    with pytest.raises(redis.AuthenticationError):  # auth is really on
        redis.Redis.from_url(_without_credentials(secured_redis.url), socket_timeout=5).ping()
    config = make_config(secured_redis.url, describer={"base_url": vlm_double.base_url})

    ids = enqueue_frames(secured_redis.url, config.queue, 2, camera="door")  # the producer
    worker = DescriberThread(config, "w1").start()
    client = secured_redis.client()
    try:
        wait_until(lambda: len(descriptions(client, config.queue)) == 2, 20, what="2 described")
    finally:
        worker.stop()

    assert len(ids) == 2
    stored = descriptions(client, config.queue)
    assert {d["camera"] for d in stored} == {"door"}
    assert all(d["text"].startswith("double description") for d in stored)
    assert pending_count(client, config.queue) == 0
    _assert_no_secret(caplog)


def test_a_wrong_password_fails_at_once_and_says_so(password_redis: RedisServer) -> None:
    from pipelines.queue import connect

    client = connect(_with_password(password_redis.url, WRONG))
    t0 = time.monotonic()
    with pytest.raises(redis.AuthenticationError, match=REFUSED):
        client.ping()
    assert time.monotonic() - t0 < 2.0


def test_producer_with_a_wrong_password_logs_the_refusal_not_the_password(
    password_redis: RedisServer, make_config: Any, caplog: pytest.LogCaptureFixture
) -> None:
    from pipelines.detect import Detection
    from pipelines.ingest import Frame
    from pipelines.queue import FrameQueue, Outgoing

    caplog.set_level(logging.DEBUG)
    config = make_config(_with_password(password_redis.url, WRONG))
    drops: list[str] = []
    queue = FrameQueue(config.redis_url, config.queue, on_drop=lambda _c, why: drops.append(why))
    queue.start()
    try:
        image = np.zeros((32, 32, 3), np.uint8)
        det = Detection(0, "person", 0.9, (1.0, 1.0, 20.0, 20.0))
        queue.submit(Outgoing(Frame("door", 0, time.time(), image), [det], "first"))
        line = wait_until(
            lambda: _log_line(caplog, "redis_auth_failed", REFUSED), 5, what="refusal logged"
        )
    finally:
        queue.stop(flush_timeout=0.2)

    assert "component=enqueue" in line
    assert queue.enqueued == 0
    assert password_redis.client().xlen(config.queue.frames_stream) == 0
    _assert_no_secret(caplog)


def test_describer_with_a_wrong_password_logs_the_refusal_not_the_password(
    password_redis: RedisServer, make_config: Any, vlm_double: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    url = _with_password(password_redis.url, WRONG)
    config = make_config(url, describer={"base_url": vlm_double.base_url})
    worker = DescriberThread(config, "w1").start()
    try:
        line = wait_until(
            lambda: _log_line(caplog, "redis_auth_failed", REFUSED), 5, what="refusal logged"
        )
    finally:
        worker.stop()

    assert "component=describer" in line
    assert not vlm_double.requests
    _assert_no_secret(caplog)


def test_a_tls_url_without_our_ca_fails_on_the_certificate_at_once(
    tls_files: TlsFiles, tmp_path: Path
) -> None:
    with RedisServer(tmp_path / "redis", password=PASSWORD, tls=tls_files) as server:
        untrusted = server.url.split("?", 1)[0] + "?ssl_cert_reqs=required"
        t0 = time.monotonic()
        with pytest.raises(redis.ConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
            redis.Redis.from_url(untrusted, socket_connect_timeout=2).ping()
        assert time.monotonic() - t0 < 2.0


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://redis:6379/0", "redis://redis:6379/0"),
        ("redis://:s3cret@redis:6379/0", "redis://:***@redis:6379/0"),
        ("redis://vs:s3cret@redis:6379/0", "redis://vs:***@redis:6379/0"),
        ("redis://s3cret@redis:6379/0", "redis://***@redis:6379/0"),
        ("redis://:ab/cd@redis:6379/0", "redis://***"),  # unencoded '/': where does it end?
        (
            "rediss://:s3cret@h:6380/0?ssl_cert_reqs=required&ssl_ca_certs=/ca.pem",
            "rediss://:***@h:6380/0?ssl_cert_reqs=required&ssl_ca_certs=/ca.pem",
        ),
        ("unix:///run/redis.sock?password=s3cret&db=1", "unix:///run/redis.sock?password=***&db=1"),
    ],
)
def test_redacted_redis_url_hides_the_password(url: str, shown: str) -> None:
    assert redacted_redis_url(url) == shown


def test_an_unencoded_slash_in_the_password_is_a_config_error_that_says_how_to_fix_it() -> None:
    with pytest.raises(ConfigError, match="percent-encoded"):
        parse_config({"redis_url": "redis://:ab/cd@redis:6379/0"})
    assert parse_config({"redis_url": "redis://:ab%2Fcd@redis:6379/0"}).redis_url
